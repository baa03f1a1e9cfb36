//! The vision tower's settings, from the artifact's embedded `vision_config.json` (the
//! checkpoint's `vision_config` with the image and video token ids and the decoder's
//! `mrope_section` beside it), and what the decoder needs to place an image.

use ninfer_artifact::Artifact;
use serde::Deserialize;

use crate::error::EngineError;

/// `vision_config` with `transformers`' defaults for the keys a checkpoint leaves out.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct VisionConfig {
    #[serde(default = "defaults::depth")]
    pub depth: usize,
    #[serde(default = "defaults::hidden_size")]
    pub hidden_size: usize,
    #[serde(default = "defaults::hidden_act")]
    pub hidden_act: String,
    #[serde(default = "defaults::intermediate_size")]
    pub intermediate_size: usize,
    #[serde(default = "defaults::num_heads")]
    pub num_heads: usize,
    #[serde(default = "defaults::in_channels")]
    pub in_channels: usize,
    #[serde(default = "defaults::patch_size")]
    pub patch_size: usize,
    #[serde(default = "defaults::spatial_merge_size")]
    pub spatial_merge_size: usize,
    #[serde(default = "defaults::temporal_patch_size")]
    pub temporal_patch_size: usize,
    #[serde(default = "defaults::out_hidden_size")]
    pub out_hidden_size: usize,
    #[serde(default = "defaults::num_position_embeddings")]
    pub num_position_embeddings: usize,
    #[serde(default)]
    pub rope_parameters: Option<VisionRope>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct VisionRope {
    #[serde(default = "defaults::rope_type")]
    pub rope_type: String,
    #[serde(default = "defaults::rope_theta")]
    pub rope_theta: f64,
}

/// `Qwen3_5VisionConfig`'s defaults.
mod defaults {
    pub fn depth() -> usize {
        27
    }
    pub fn hidden_size() -> usize {
        1152
    }
    pub fn hidden_act() -> String {
        "gelu_pytorch_tanh".into()
    }
    pub fn intermediate_size() -> usize {
        4304
    }
    pub fn num_heads() -> usize {
        16
    }
    pub fn in_channels() -> usize {
        3
    }
    pub fn patch_size() -> usize {
        16
    }
    pub fn spatial_merge_size() -> usize {
        2
    }
    pub fn temporal_patch_size() -> usize {
        2
    }
    pub fn out_hidden_size() -> usize {
        3584
    }
    pub fn num_position_embeddings() -> usize {
        2304
    }
    pub fn rope_type() -> String {
        "axial".into()
    }
    pub fn rope_theta() -> f64 {
        10000.0
    }
}

#[derive(Debug, Deserialize)]
struct VisionDocument {
    vision_config: VisionConfig,
    #[serde(default)]
    mrope_section: Option<[usize; 3]>,
    #[serde(default)]
    image_token_id: Option<u32>,
    #[serde(default)]
    video_token_id: Option<u32>,
}

/// What the decoder needs to place an image: its placeholder token and the M-RoPE layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImagePlacement {
    pub image_token_id: u32,
    /// The placeholder of a video's frame pairs (`None`: the model takes no video).
    pub video_token_id: Option<u32>,
    /// `mrope_section` (`[11, 11, 10]` when the checkpoint leaves it out).
    pub mrope_section: [usize; 3],
    pub spatial_merge_size: usize,
}

impl ImagePlacement {
    /// The tokens whose runs are encoded pictures: the image placeholder, and the video one
    /// where the model has it.
    pub fn placeholder_tokens(&self) -> Vec<u32> {
        std::iter::once(self.image_token_id)
            .chain(self.video_token_id)
            .collect()
    }

    /// The placement of `artifact`'s images; `Ok(None)` when it has no vision tower or no image
    /// token.
    pub fn from_artifact(artifact: &Artifact) -> Result<Option<Self>, EngineError> {
        let Some(document) = read_document(artifact)? else {
            return Ok(None);
        };
        Ok(document
            .image_token_id
            .map(|image_token_id| ImagePlacement {
                image_token_id,
                video_token_id: document.video_token_id,
                mrope_section: document.mrope_section.unwrap_or([11, 11, 10]),
                spatial_merge_size: document.vision_config.spatial_merge_size,
            }))
    }
}

fn read_document(artifact: &Artifact) -> Result<Option<VisionDocument>, EngineError> {
    let Some(bytes) = artifact.file("vision_config.json") else {
        return Ok(None);
    };
    let document: VisionDocument =
        serde_json::from_slice(bytes).map_err(|error| EngineError::InvalidConfig {
            problem: format!("vision_config.json: {error}"),
        })?;
    document.vision_config.validate()?;
    Ok(Some(document))
}

impl VisionConfig {
    /// The settings of `artifact`'s vision tower; `Ok(None)` when it has none.
    pub fn from_artifact(artifact: &Artifact) -> Result<Option<Self>, EngineError> {
        Ok(read_document(artifact)?.map(|document| document.vision_config))
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values in one patch row (`channels · temporal patch · patch²`).
    pub fn patch_row_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patch rows merged into one image token.
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }

    /// Side of the square learned position grid.
    pub fn position_grid_side(&self) -> usize {
        // `int(num_position_embeddings ** 0.5)`: the largest side whose square fits.
        let mut side = (self.num_position_embeddings as f64).sqrt() as usize;
        while side * side > self.num_position_embeddings {
            side -= 1;
        }
        while (side + 1) * (side + 1) <= self.num_position_embeddings {
            side += 1;
        }
        side
    }

    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .map_or(defaults::rope_theta(), |rope| rope.rope_theta)
    }

    /// Refuses settings this implementation does not compute.
    pub fn validate(&self) -> Result<(), EngineError> {
        let invalid = |problem: String| Err(EngineError::InvalidConfig { problem });
        if self.num_heads == 0 || self.hidden_size % self.num_heads != 0 {
            return invalid(format!(
                "vision hidden_size {} is not a multiple of num_heads {}",
                self.hidden_size, self.num_heads
            ));
        }
        if self.head_dim() % 4 != 0 {
            return invalid(format!(
                "vision head width {} is not a multiple of 4 (2-D rotary halves)",
                self.head_dim()
            ));
        }
        if self.hidden_act != "gelu_pytorch_tanh" {
            return invalid(format!(
                "vision hidden_act `{}` is not supported (gelu_pytorch_tanh is)",
                self.hidden_act
            ));
        }
        if let Some(rope) = &self.rope_parameters {
            if rope.rope_type != "axial" {
                return invalid(format!(
                    "vision rope_type `{}` is not supported (axial is)",
                    rope.rope_type
                ));
            }
        }
        if self.patch_size == 0
            || self.temporal_patch_size == 0
            || self.spatial_merge_size == 0
            || self.position_grid_side() < 2
        {
            return invalid("vision patch, merge and position sizes must be positive".into());
        }
        Ok(())
    }
}
