//! The vision tower's weights on the GPU: every matrix in the tower's precision (bf16, the
//! tensor cores' input: a checkpoint's bf16 values kept exactly; or f32), biases, norms and the
//! learned position table as f32.
//!
//! Owns: [`VisionPrecision`], the upload of a [`VisionWeights`] and the shapes the forward reads.
//! Must not touch: the forward (`vision.rs`), reading the artifact (`crate::vision::weights`).

use cudarc::driver::CudaSlice;
use ninfer_artifact::DType;

use super::super::CudaError;
use super::{driver_error, CudaBackend};
use crate::vision::weights::{LayerNorm, Linear, VisionWeights};

/// What the tower's matrix products take as inputs (accumulation is f32 in both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionPrecision {
    /// bf16 on the tensor cores: the speed of a bf16 checkpoint run as `transformers` runs it.
    Bf16,
    /// f32 throughout (cuBLAS without TF32, the f32 attention kernel): the host forward's
    /// arithmetic up to the order of f32 sums, for towers stored in f32.
    F32,
}

impl VisionPrecision {
    /// The precision of a tower whose matrices are stored as `dtype`: bf16 checkpoints compute
    /// in bf16, every other dtype in f32.
    pub fn for_stored(dtype: DType) -> Self {
        if dtype == DType::Bf16 {
            VisionPrecision::Bf16
        } else {
            VisionPrecision::F32
        }
    }
}

/// A product's input on the GPU in the tower's precision (matrices and activations alike).
pub(super) enum DeviceValues {
    /// bf16 bit patterns.
    Bf16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// `y = x Wᵀ + b`: `W` `[outputs, inputs]` in the tower's precision.
pub(super) struct DeviceLinear {
    pub weight: DeviceValues,
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
    /// `values` as a product's input in `precision`.
    pub(super) fn upload_values(
        &self,
        values: &[f32],
        precision: VisionPrecision,
    ) -> Result<DeviceValues, CudaError> {
        if values.is_empty() {
            return Err(CudaError::Invalid {
                problem: "an empty vision matrix".into(),
            });
        }
        match precision {
            VisionPrecision::F32 => Ok(DeviceValues::F32(self.upload_f32(values)?)),
            VisionPrecision::Bf16 => {
                let bits: Vec<u16> = values
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                Ok(DeviceValues::Bf16(self.stream.memcpy_stod(&bits).map_err(
                    driver_error("copying a vision matrix to the GPU"),
                )?))
            }
        }
    }

    fn upload_linear(
        &self,
        layer: &Linear,
        precision: VisionPrecision,
    ) -> Result<DeviceLinear, CudaError> {
        Ok(DeviceLinear {
            weight: self.upload_values(&layer.weight, precision)?,
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

    /// `weights` on this GPU, their matrices in `precision`.
    pub(super) fn upload_vision_weights(
        &self,
        weights: &VisionWeights,
        precision: VisionPrecision,
    ) -> Result<DeviceVisionWeights, CudaError> {
        let blocks = weights
            .blocks
            .iter()
            .map(|block| {
                Ok(DeviceVisionBlock {
                    norm1: self.upload_layer_norm(&block.norm1)?,
                    qkv: self.upload_linear(&block.qkv, precision)?,
                    proj: self.upload_linear(&block.proj, precision)?,
                    norm2: self.upload_layer_norm(&block.norm2)?,
                    fc1: self.upload_linear(&block.fc1, precision)?,
                    fc2: self.upload_linear(&block.fc2, precision)?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(DeviceVisionWeights {
            patch_embed: self.upload_linear(&weights.patch_embed, precision)?,
            position_embeddings: self.upload_f32(&weights.position_embeddings)?,
            blocks,
            merger_norm: self.upload_layer_norm(&weights.merger_norm)?,
            merger_fc1: self.upload_linear(&weights.merger_fc1, precision)?,
            merger_fc2: self.upload_linear(&weights.merger_fc2, precision)?,
            zero_bias: self.alloc(weights.config.hidden_size)?,
        })
    }
}
