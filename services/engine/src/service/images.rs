//! A prompt's images from the wire to the scheduler: each encoded file decoded and
//! pre-processed as the model's image processor does (`ninfer-vision-input`, within the
//! decoder's limits), the grids checked against the prompt's placeholder runs, and the patches
//! encoded by the vision tower, on a blocking thread so the async workers and the scheduler's
//! steps go on meanwhile. The scheduler then only attaches the embeddings to the sequence.
//!
//! Images arrive encoded because the encoded file is the smallest form of an image: the
//! gateway reads only its header (to size the placeholder run) and never holds its pixels.
//!
//! Owns: the image and video processors' settings and the decoder's limits the engine applies
//! (a video's from the artifact's `video_preprocessor_config.json`, else read from its
//! `preprocessor_config.json` as `transformers` falls back to it), where the
//! tower runs and its weights (loaded on the first image: on the GPU when the engine runs on
//! CUDA, on a CUDA backend of the tower's own so its launches never enter the scheduler's
//! stream; the host forward otherwise, or when the GPU tower cannot start), how many prompts are
//! encoded at once, and the refusals of images as statuses. Must not touch: the tower's math
//! (`crate::vision`, `backend::cuda::CudaVisionTower`), the sequence.

use std::sync::{Arc, OnceLock};

use ninfer_artifact::Artifact;
use ninfer_protocol::v1::ImageInput;
use ninfer_vision_input::{
    preprocess_image, preprocess_video, DecodeLimits, EncodedFrame, ImageProcessorSettings,
    PixelPatches, VideoProcessorSettings,
};
use tonic::Status;

use ninfer_artifact::DType;

use crate::backend::cuda::{CudaBackend, CudaOptions, CudaVisionTower, VisionPrecision};
use crate::error::EngineError;
use crate::service::scheduler::PromptImages;
use crate::vision::weights::stored_matrix_dtype;
use crate::vision::{
    multimodal_positions_of, HostVisionTower, ImageGrid, ImagePlacement, VisionConfig, VisionTower,
    VisionWeights,
};

/// Prompts whose images are encoded at once: the host tower uses every core for one, the GPU
/// tower the whole GPU.
const PROMPTS_ENCODED_AT_ONCE: usize = 1;

/// Most images in one request (each is a separate encoder segment and placeholder run), and
/// most encoder segments of images and videos' frame pairs together.
pub const MAX_IMAGES_PER_REQUEST: usize = 64;

/// Where the engine runs the vision tower.
#[derive(Debug, Clone, Copy)]
pub enum TowerDevice {
    /// The f32 host forward.
    Host,
    /// GPU `ordinal`, on a CUDA backend of the tower's own opened with `options` (cuBLAS on:
    /// the tower's GEMMs need it).
    Cuda {
        ordinal: usize,
        options: CudaOptions,
    },
}

/// `device`'s tower over `weights` (stored as `stored`: a GPU tower computes in bf16 on the
/// tensor cores for a bf16 checkpoint, in f32 otherwise); the host tower, with a warning, where
/// the GPU one cannot start.
pub fn start_tower(
    device: TowerDevice,
    weights: VisionWeights,
    stored: DType,
) -> Box<dyn VisionTower> {
    let TowerDevice::Cuda { ordinal, options } = device else {
        return Box::new(HostVisionTower { weights });
    };
    let options = CudaOptions {
        cublas: true,
        ..options
    };
    let started = CudaBackend::with_options(ordinal, options)
        .map_err(|error| error.to_string())
        .and_then(|backend| {
            CudaVisionTower::new(
                Arc::new(backend),
                &weights,
                VisionPrecision::for_stored(stored),
            )
            .map_err(|error| error.to_string())
        });
    match started {
        Ok(tower) => Box::new(tower),
        Err(problem) => {
            tracing::warn!(
                "the vision tower runs on the host: it cannot start on the GPU: {problem}"
            );
            Box::new(HostVisionTower { weights })
        }
    }
}

/// How the engine turns a request's images into the embeddings its prompt takes.
pub struct ImageEncoding {
    artifact: Arc<Artifact>,
    placement: ImagePlacement,
    settings: ImageProcessorSettings,
    video_settings: VideoProcessorSettings,
    limits: DecodeLimits,
    device: TowerDevice,
    tower: OnceLock<Result<Box<dyn VisionTower>, String>>,
    encoding: tokio::sync::Semaphore,
}

impl ImageEncoding {
    /// The image path of `artifact`'s model; `Ok(None)` when it has no vision tower. The image
    /// processor's settings are the artifact's `preprocessor_config.json` (keys it leaves out
    /// take the processor class's defaults, as `transformers` does), or the released Qwen3.5
    /// bounds and normalisation in the tower's own patches when the artifact has none. The
    /// video processor's are its `video_preprocessor_config.json`, else its
    /// `preprocessor_config.json` read as one (with the video processor class's defaults), else
    /// the image settings.
    pub fn for_artifact(artifact: &Arc<Artifact>) -> Result<Option<Self>, EngineError> {
        let Some(placement) = ImagePlacement::from_artifact(artifact)? else {
            return Ok(None);
        };
        let settings = match artifact.file("preprocessor_config.json") {
            Some(bytes) => {
                ImageProcessorSettings::from_preprocessor_config(&String::from_utf8_lossy(bytes))
                    .map_err(|error| EngineError::InvalidConfig {
                        problem: format!("preprocessor_config.json: {error}"),
                    })?
            }
            // The released pixel bounds and normalisation, in the patches the tower takes.
            None => {
                let tower = VisionConfig::from_artifact(artifact)?;
                let defaults = ImageProcessorSettings::default();
                ImageProcessorSettings {
                    patch_size: tower.as_ref().map_or(defaults.patch_size, |t| t.patch_size),
                    temporal_patch_size: tower
                        .as_ref()
                        .map_or(defaults.temporal_patch_size, |t| t.temporal_patch_size),
                    merge_size: placement.spatial_merge_size,
                    ..defaults
                }
            }
        };
        let video_file = ["video_preprocessor_config.json", "preprocessor_config.json"]
            .into_iter()
            .find_map(|name| Some((name, artifact.file(name)?)));
        let video_settings = match video_file {
            Some((name, bytes)) => VideoProcessorSettings::from_video_preprocessor_config(
                &String::from_utf8_lossy(bytes),
            )
            .map_err(|error| EngineError::InvalidConfig {
                problem: format!("{name} (the video processor's settings): {error}"),
            })?,
            None => VideoProcessorSettings::like_images(&settings),
        };
        for (processor, merge) in [
            ("image", settings.merge_size),
            ("video", video_settings.frames.merge_size),
        ] {
            if merge != placement.spatial_merge_size {
                return Err(EngineError::InvalidConfig {
                    problem: format!(
                        "the {processor} processor merges {merge}x{merge} patches, the vision tower {0}x{0}",
                        placement.spatial_merge_size
                    ),
                });
            }
        }
        Ok(Some(ImageEncoding {
            artifact: Arc::clone(artifact),
            placement,
            settings,
            video_settings,
            limits: DecodeLimits::default(),
            device: TowerDevice::Host,
            tower: OnceLock::new(),
            encoding: tokio::sync::Semaphore::new(PROMPTS_ENCODED_AT_ONCE),
        }))
    }

    /// The same image path with the tower on `device`.
    pub fn on_device(self, device: TowerDevice) -> Self {
        ImageEncoding { device, ..self }
    }

    /// The processor settings this engine applies, as a `preprocessor_config.json` that
    /// [`ImageProcessorSettings::from_preprocessor_config`] reads back to the same values (what
    /// the gateway sizes placeholder runs with).
    pub fn settings_json(&self) -> String {
        let s = &self.settings;
        serde_json::json!({
            "min_pixels": s.min_pixels,
            "max_pixels": s.max_pixels,
            "patch_size": s.patch_size,
            "temporal_patch_size": s.temporal_patch_size,
            "merge_size": s.merge_size,
            "image_mean": s.image_mean,
            "image_std": s.image_std,
        })
        .to_string()
    }

    /// The video processor's settings this engine applies (what the gateway sizes videos'
    /// runs and writes their timestamps with).
    pub fn video_settings(&self) -> &VideoProcessorSettings {
        &self.video_settings
    }

    /// Where the tower runs (its [`VisionTower::describe`]) once the first image loaded it;
    /// `None` before that or when it could not be loaded.
    pub fn tower_description(&self) -> Option<String> {
        match self.tower.get() {
            Some(Ok(tower)) => Some(tower.describe()),
            _ => None,
        }
    }

    /// The embeddings of `images` for `prompt`, or the status that refuses them
    /// (INVALID_ARGUMENT naming the image and its problem).
    pub async fn encode(
        self: &Arc<Self>,
        prompt: &[u32],
        images: Vec<ImageInput>,
    ) -> Result<PromptImages, Status> {
        if images.len() > MAX_IMAGES_PER_REQUEST {
            return Err(Status::invalid_argument(format!(
                "{} images in one request, over the limit of {MAX_IMAGES_PER_REQUEST}",
                images.len()
            )));
        }
        let _permit = self
            .encoding
            .acquire()
            .await
            .map_err(|_| Status::unavailable("the engine is shutting down"))?;
        let this = Arc::clone(self);
        let prompt = prompt.to_vec();
        tokio::task::spawn_blocking(move || this.encode_now(&prompt, &images))
            .await
            .map_err(|error| Status::internal(format!("encoding the images failed: {error}")))?
    }

    /// [`ImageEncoding::encode`] on the calling thread.
    pub fn encode_now(
        &self,
        prompt: &[u32],
        images: &[ImageInput],
    ) -> Result<PromptImages, Status> {
        let mut grids = Vec::new();
        let mut rows = Vec::new();
        // The placeholder each segment's run must be made of, in order.
        let mut run_tokens = Vec::new();
        let placement = &self.placement;
        for (index, image) in images.iter().enumerate() {
            let segments = self.preprocess(image).map_err(|problem| {
                let kind = if image.frames.is_empty() {
                    "image"
                } else {
                    "video"
                };
                Status::invalid_argument(format!("{kind} {}: {problem}", index + 1))
            })?;
            let token = match image.frames.is_empty() {
                true => placement.image_token_id,
                false => placement.video_token_id.ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "video {}: the model has no video placeholder token",
                        index + 1
                    ))
                })?,
            };
            for patches in segments {
                grids.push(ImageGrid {
                    temporal: patches.grid.temporal,
                    height: patches.grid.height,
                    width: patches.grid.width,
                });
                rows.extend_from_slice(&patches.values);
                run_tokens.push(token);
            }
            if grids.len() > MAX_IMAGES_PER_REQUEST {
                return Err(Status::invalid_argument(format!(
                    "the request's images and video frame pairs are over the limit of {MAX_IMAGES_PER_REQUEST} in all"
                )));
            }
        }
        let placeholders = placement.placeholder_tokens();
        multimodal_positions_of(prompt, &placeholders, &grids, placement.spatial_merge_size)
            .map_err(|error| Status::invalid_argument(format!("the prompt's images: {error}")))?;
        let prompt_runs = prompt
            .iter()
            .enumerate()
            .filter(|&(at, token)| {
                placeholders.contains(token) && (at == 0 || prompt[at - 1] != *token)
            })
            .map(|(_, &token)| token);
        if !prompt_runs.eq(run_tokens.iter().copied()) {
            return Err(Status::invalid_argument(
                "the prompt's image and video placeholder runs are not in the order of the request's images and videos",
            ));
        }
        let tower = self
            .tower
            .get_or_init(|| match VisionWeights::load(&self.artifact) {
                Ok(Some(weights)) => {
                    let stored = stored_matrix_dtype(&self.artifact).map_err(|e| e.to_string())?;
                    let tower = start_tower(self.device, weights, stored);
                    tracing::info!(device = %tower.describe(), "vision tower loaded");
                    Ok(tower)
                }
                Ok(None) => Err("the artifact has no vision settings".to_string()),
                Err(error) => Err(error.to_string()),
            })
            .as_ref()
            .map_err(|problem| {
                Status::internal(format!("the vision tower could not be loaded: {problem}"))
            })?;
        let output = tower
            .encode(&rows, &grids)
            .map_err(|error| Status::internal(format!("encoding the images failed: {error}")))?;
        Ok(PromptImages {
            grids,
            embeddings: output.merged,
        })
    }

    /// One image's patches, or a video's, one per frame pair; the refusal names the problem.
    fn preprocess(&self, image: &ImageInput) -> Result<Vec<PixelPatches>, String> {
        if image.frames.is_empty() {
            return preprocess_image(
                &image.encoded,
                declared_media_type(&image.media_type),
                &self.settings,
                &self.limits,
            )
            .map(|patches| vec![patches])
            .map_err(|error| error.to_string());
        }
        let frames: Vec<EncodedFrame<'_>> = image
            .frames
            .iter()
            .map(|frame| EncodedFrame {
                encoded: &frame.encoded,
                declared_media_type: declared_media_type(&frame.media_type),
            })
            .collect();
        preprocess_video(&frames, &self.video_settings, &self.limits)
            .map_err(|error| error.to_string())
    }
}

/// The media type a request declared, `None` when it declared none.
fn declared_media_type(media_type: &str) -> Option<&str> {
    Some(media_type).filter(|media| !media.is_empty())
}
