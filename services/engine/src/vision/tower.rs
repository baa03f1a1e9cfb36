//! Where the tower runs: [`VisionTower`], one encoder of patch rows into image-token embeddings,
//! and its host form (the f32 reference forward of `encoder.rs`). The CUDA backend's tower
//! (`backend::cuda::CudaVisionTower`) implements the same trait, so the engine's image path
//! holds one of either.

use crate::error::EngineError;
use crate::vision::encoder::{encode_images, VisionOutput};
use crate::vision::grid::ImageGrid;
use crate::vision::weights::VisionWeights;

/// A vision tower ready to encode: its weights where it computes.
pub trait VisionTower: Send + Sync {
    /// The tower over the patch rows of `grids` (their rows one image after another, as the
    /// image processor lays them out).
    fn encode(&self, pixel_rows: &[f32], grids: &[ImageGrid]) -> Result<VisionOutput, EngineError>;

    /// Where it runs, for logs and benchmarks.
    fn describe(&self) -> String;
}

/// The f32 host forward.
pub struct HostVisionTower {
    pub weights: VisionWeights,
}

impl VisionTower for HostVisionTower {
    fn encode(&self, pixel_rows: &[f32], grids: &[ImageGrid]) -> Result<VisionOutput, EngineError> {
        encode_images(&self.weights, pixel_rows, grids)
    }

    fn describe(&self) -> String {
        "cpu (f32 host forward)".into()
    }
}
