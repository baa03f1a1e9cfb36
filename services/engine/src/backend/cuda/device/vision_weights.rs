//! The vision tower's weights on the GPU: every matrix as bf16 (the tensor cores' input; a
//! checkpoint's bf16 values are kept exactly, f32 ones rounded to nearest even), biases,
//! norms and the learned position table as f32.
//!
//! Owns: the upload of a [`VisionWeights`] and the shapes the forward reads.
//! Must not touch: the forward (`vision.rs`), reading the artifact (`crate::vision::weights`).

use cudarc::driver::CudaSlice;

use super::super::CudaError;
use super::{driver_error, CudaBackend};
use crate::vision::weights::{LayerNorm, Linear, VisionWeights};

/// `y = x Wᵀ + b`: `W` bf16 `[outputs, inputs]`.
pub(super) struct DeviceLinear {
    pub weight: CudaSlice<u16>,
    pub bias: CudaSlice<f32>,
    pub outputs: usize,
    pub inputs: usize,
}

pub(super) struct DeviceLayerNorm {
    pub weight: CudaSlice<f32>,
    pub bias: CudaSlice<f32>,
}

pub(super) struct DeviceVisionBlock {
    pub norm1: DeviceLayerNorm,
    pub qkv: DeviceLinear,
    pub proj: DeviceLinear,
    pub norm2: DeviceLayerNorm,
    pub fc1: DeviceLinear,
    pub fc2: DeviceLinear,
}

pub(super) struct DeviceVisionWeights {
    pub patch_embed: DeviceLinear,
    /// `[num_position_embeddings, hidden]`.
    pub position_embeddings: CudaSlice<f32>,
    pub blocks: Vec<DeviceVisionBlock>,
    pub merger_norm: DeviceLayerNorm,
    pub merger_fc1: DeviceLinear,
    pub merger_fc2: DeviceLinear,
    /// `hidden` zeros: the bias the first norm is owed (none).
    pub zero_bias: CudaSlice<f32>,
}

impl CudaBackend {
    fn upload_bf16(&self, values: &[f32]) -> Result<CudaSlice<u16>, CudaError> {
        let bits: Vec<u16> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        if bits.is_empty() {
            return Err(CudaError::Invalid {
                problem: "an empty vision matrix".into(),
            });
        }
        self.stream
            .memcpy_stod(&bits)
            .map_err(driver_error("copying a vision matrix to the GPU"))
    }

    fn upload_linear(&self, layer: &Linear) -> Result<DeviceLinear, CudaError> {
        Ok(DeviceLinear {
            weight: self.upload_bf16(&layer.weight)?,
            bias: self.upload_f32(&layer.bias)?,
            outputs: layer.outputs,
            inputs: layer.inputs,
        })
    }

    fn upload_layer_norm(&self, norm: &LayerNorm) -> Result<DeviceLayerNorm, CudaError> {
        Ok(DeviceLayerNorm {
            weight: self.upload_f32(&norm.weight)?,
            bias: self.upload_f32(&norm.bias)?,
        })
    }

    /// `weights` on this GPU.
    pub(super) fn upload_vision_weights(
        &self,
        weights: &VisionWeights,
    ) -> Result<DeviceVisionWeights, CudaError> {
        let blocks = weights
            .blocks
            .iter()
            .map(|block| {
                Ok(DeviceVisionBlock {
                    norm1: self.upload_layer_norm(&block.norm1)?,
                    qkv: self.upload_linear(&block.qkv)?,
                    proj: self.upload_linear(&block.proj)?,
                    norm2: self.upload_layer_norm(&block.norm2)?,
                    fc1: self.upload_linear(&block.fc1)?,
                    fc2: self.upload_linear(&block.fc2)?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(DeviceVisionWeights {
            patch_embed: self.upload_linear(&weights.patch_embed)?,
            position_embeddings: self.upload_f32(&weights.position_embeddings)?,
            blocks,
            merger_norm: self.upload_layer_norm(&weights.merger_norm)?,
            merger_fc1: self.upload_linear(&weights.merger_fc1)?,
            merger_fc2: self.upload_linear(&weights.merger_fc2)?,
            zero_bias: self.alloc(weights.config.hidden_size)?,
        })
    }
}
