//! A tensor as the writer is given it (everything but its bytes) and the bytes its dtype and
//! shape take: what the writer lays out and the reader checks.
//!
//! Owns: [`TensorSpec`] and [`expected_tensor_bytes`]. Must not touch: file layout (`writer.rs`).

use crate::header::{DType, QuantizationParams, TensorClass};

/// Everything about a tensor except its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub class: TensorClass,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub quantization: Option<QuantizationParams>,
}

/// Bytes a tensor of this spec occupies, or why the spec is invalid.
pub fn expected_tensor_bytes(spec: &TensorSpec) -> Result<u64, String> {
    let elements: u64 = spec.shape.iter().product();
    match spec.dtype {
        DType::F32 => Ok(elements * 4),
        DType::Bf16 => Ok(elements * 2),
        DType::Int8 | DType::Int4 => {
            let [rows, cols] = spec.shape[..] else {
                return Err(format!(
                    "{} tensors must be 2-D, shape is {:?}",
                    spec.dtype, spec.shape
                ));
            };
            let layout =
                crate::quant::QuantizedLayout::new(spec.dtype, rows as usize, cols as usize)?;
            match &spec.quantization {
                Some(params) if *params == layout.params() => Ok(layout.total_bytes as u64),
                Some(params) => Err(format!(
                    "quantization parameters {params:?} differ from the format's {:?}",
                    layout.params()
                )),
                None => Err(format!(
                    "{} tensor without quantization parameters",
                    spec.dtype
                )),
            }
        }
    }
}
