//! The vision tower's weights, read from the artifact by their checkpoint names
//! (`model.visual.*`, docs/MODELS.md §10.4) into f32 host memory, every shape checked against
//! the settings.

use ninfer_artifact::{Artifact, DType};

use crate::error::EngineError;
use crate::vision::config::VisionConfig;

/// A linear layer `y = x Wᵀ + b` with `W` `[outputs, inputs]`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub outputs: usize,
    pub inputs: usize,
}

/// LayerNorm weight and bias.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

#[derive(Debug, Clone)]
pub struct VisionBlock {
    pub norm1: LayerNorm,
    pub qkv: Linear,
    pub proj: Linear,
    pub norm2: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

#[derive(Debug, Clone)]
pub struct VisionWeights {
    pub config: VisionConfig,
    /// The 3-D convolution as a linear layer over a patch row.
    pub patch_embed: Linear,
    /// `[num_position_embeddings, hidden]`.
    pub position_embeddings: Vec<f32>,
    pub blocks: Vec<VisionBlock>,
    pub merger_norm: LayerNorm,
    pub merger_fc1: Linear,
    pub merger_fc2: Linear,
}

/// The tensor names' prefix: the multimodal release's, or a vision-only checkpoint's.
fn prefix(artifact: &Artifact) -> &'static str {
    if artifact.get("visual.patch_embed.proj.weight").is_some() {
        "visual."
    } else {
        "model.visual."
    }
}

/// A tensor as f32 after checking its element count.
fn read(artifact: &Artifact, name: &str, elements: usize) -> Result<Vec<f32>, EngineError> {
    let view = artifact.tensor(name)?;
    let values = view.to_f32_vec();
    if values.len() != elements {
        return Err(EngineError::InvalidWeight {
            name: name.to_string(),
            problem: format!(
                "shape {:?} holds {} values, the vision settings need {elements}",
                view.shape(),
                values.len()
            ),
        });
    }
    Ok(values)
}

fn linear(
    artifact: &Artifact,
    name: &str,
    outputs: usize,
    inputs: usize,
) -> Result<Linear, EngineError> {
    Ok(Linear {
        weight: read(artifact, &format!("{name}.weight"), outputs * inputs)?,
        bias: read(artifact, &format!("{name}.bias"), outputs)?,
        outputs,
        inputs,
    })
}

fn layer_norm(artifact: &Artifact, name: &str, width: usize) -> Result<LayerNorm, EngineError> {
    Ok(LayerNorm {
        weight: read(artifact, &format!("{name}.weight"), width)?,
        bias: read(artifact, &format!("{name}.bias"), width)?,
    })
}

/// How `artifact` stores the tower's matrices (the first block's qkv; a checkpoint stores its
/// tower in one dtype): what a device tower computes in.
pub fn stored_matrix_dtype(artifact: &Artifact) -> Result<DType, EngineError> {
    let prefix = prefix(artifact);
    let name = if artifact
        .get(&format!("{prefix}blocks.0.attn.qkv.weight"))
        .is_some()
    {
        format!("{prefix}blocks.0.attn.qkv.weight")
    } else {
        format!("{prefix}patch_embed.proj.weight")
    };
    Ok(artifact.tensor(&name)?.dtype())
}

impl VisionWeights {
    /// The tower of `artifact`; `Ok(None)` when the artifact carries no vision settings.
    pub fn load(artifact: &Artifact) -> Result<Option<Self>, EngineError> {
        let Some(config) = VisionConfig::from_artifact(artifact)? else {
            return Ok(None);
        };
        Self::load_with(artifact, config).map(Some)
    }

    /// The tower of `artifact` under the given settings.
    pub fn load_with(artifact: &Artifact, config: VisionConfig) -> Result<Self, EngineError> {
        let prefix = prefix(artifact);
        let hidden = config.hidden_size;
        let merged = hidden * config.merge_unit();
        let blocks = (0..config.depth)
            .map(|index| {
                let block = format!("{prefix}blocks.{index}");
                Ok(VisionBlock {
                    norm1: layer_norm(artifact, &format!("{block}.norm1"), hidden)?,
                    qkv: linear(artifact, &format!("{block}.attn.qkv"), 3 * hidden, hidden)?,
                    proj: linear(artifact, &format!("{block}.attn.proj"), hidden, hidden)?,
                    norm2: layer_norm(artifact, &format!("{block}.norm2"), hidden)?,
                    fc1: linear(
                        artifact,
                        &format!("{block}.mlp.linear_fc1"),
                        config.intermediate_size,
                        hidden,
                    )?,
                    fc2: linear(
                        artifact,
                        &format!("{block}.mlp.linear_fc2"),
                        hidden,
                        config.intermediate_size,
                    )?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        Ok(VisionWeights {
            patch_embed: linear(
                artifact,
                &format!("{prefix}patch_embed.proj"),
                hidden,
                config.patch_row_len(),
            )?,
            position_embeddings: read(
                artifact,
                &format!("{prefix}pos_embed.weight"),
                config.num_position_embeddings * hidden,
            )?,
            blocks,
            merger_norm: layer_norm(artifact, &format!("{prefix}merger.norm"), hidden)?,
            merger_fc1: linear(
                artifact,
                &format!("{prefix}merger.linear_fc1"),
                merged,
                merged,
            )?,
            merger_fc2: linear(
                artifact,
                &format!("{prefix}merger.linear_fc2"),
                config.out_hidden_size,
                merged,
            )?,
            config,
        })
    }
}
