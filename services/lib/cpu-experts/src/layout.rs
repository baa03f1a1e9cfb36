//! Byte layout of one routed expert's weights, exactly as `docs/FORMAT.md` stores them.
//!
//! Owns: `WeightDType`, the per-matrix layout (`[rows, cols]` row-major values, then for int8 /
//! int4 the f16 group scales at the next multiple of 64 bytes), the expert layout (`gate_up`
//! `[2·Im, H]`, then `down` `[H, Im]` at the next 64-byte boundary, stride rounded to 4096), and
//! encode/decode helpers for tests and benchmarks. The quantization rules themselves live in
//! `ninfer_artifact::quant`; this module only reuses them.

use std::fmt;
use std::str::FromStr;

use ninfer_artifact::header::DType;
use ninfer_artifact::quant::{self, QuantizedLayout, GROUP_SIZE};

use crate::KernelError;

/// Elements per quantization group (along the input dimension).
pub const GROUP: usize = GROUP_SIZE;

/// Weight storage type of a routed expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDType {
    F32,
    Bf16,
    Int8,
    Int4,
}

impl WeightDType {
    pub const ALL: [WeightDType; 4] = [
        WeightDType::F32,
        WeightDType::Bf16,
        WeightDType::Int8,
        WeightDType::Int4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WeightDType::F32 => "f32",
            WeightDType::Bf16 => "bf16",
            WeightDType::Int8 => "int8",
            WeightDType::Int4 => "int4",
        }
    }

    pub fn is_quantized(self) -> bool {
        matches!(self, WeightDType::Int8 | WeightDType::Int4)
    }

    pub fn artifact_dtype(self) -> DType {
        match self {
            WeightDType::F32 => DType::F32,
            WeightDType::Bf16 => DType::Bf16,
            WeightDType::Int8 => DType::Int8,
            WeightDType::Int4 => DType::Int4,
        }
    }

    pub fn from_artifact(dtype: DType) -> WeightDType {
        match dtype {
            DType::F32 => WeightDType::F32,
            DType::Bf16 => WeightDType::Bf16,
            DType::Int8 => WeightDType::Int8,
            DType::Int4 => WeightDType::Int4,
        }
    }
}

impl fmt::Display for WeightDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WeightDType {
    type Err = KernelError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        WeightDType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(text.trim()))
            .ok_or_else(|| {
                KernelError::Layout(format!(
                    "unknown weight dtype `{text}` (expected f32, bf16, int8 or int4)"
                ))
            })
    }
}

/// Layout of one `[rows, cols]` weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixLayout {
    pub dtype: WeightDType,
    pub rows: usize,
    pub cols: usize,
    /// Bytes of values of one row.
    pub row_bytes: usize,
    /// Offset of the f16 scales from the matrix start (0 for f32 / bf16, which have none).
    pub scales_offset: usize,
    /// Scales per row (`cols / 32` rounded up for int8 / int4, the last group padded; else 0).
    pub groups_per_row: usize,
    pub total_bytes: usize,
}

impl MatrixLayout {
    pub fn new(dtype: WeightDType, rows: usize, cols: usize) -> Result<Self, KernelError> {
        if rows == 0 || cols == 0 {
            return Err(KernelError::Layout(format!(
                "matrix [{rows}, {cols}] has no elements"
            )));
        }
        match dtype {
            WeightDType::F32 | WeightDType::Bf16 => {
                let element = if dtype == WeightDType::F32 { 4 } else { 2 };
                Ok(MatrixLayout {
                    dtype,
                    rows,
                    cols,
                    row_bytes: cols * element,
                    scales_offset: 0,
                    groups_per_row: 0,
                    total_bytes: rows * cols * element,
                })
            }
            WeightDType::Int8 | WeightDType::Int4 => {
                let quantized = QuantizedLayout::new(dtype.artifact_dtype(), rows, cols)
                    .map_err(KernelError::Layout)?;
                Ok(MatrixLayout {
                    dtype,
                    rows,
                    cols,
                    row_bytes: quantized.row_value_bytes,
                    scales_offset: quantized.scales_offset,
                    groups_per_row: quantized.groups_per_row(),
                    total_bytes: quantized.total_bytes,
                })
            }
        }
    }

    /// Bytes a kernel must read to use the whole matrix once (values + scales, no padding).
    pub fn streamed_bytes(&self) -> usize {
        self.rows * self.row_bytes + self.rows * self.groups_per_row * 2
    }
}

/// Layout of one expert as stored in an expert bank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    pub dtype: WeightDType,
    /// Model hidden size `H` (input of `gate_up`, output of `down`).
    pub hidden: usize,
    /// Expert intermediate size `Im`.
    pub intermediate: usize,
    /// `[2·Im, H]`: rows `0..Im` gate, `Im..2Im` up.
    pub gate_up: MatrixLayout,
    /// `[H, Im]`.
    pub down: MatrixLayout,
    /// Offset of `down` from the expert start (the writer aligns tensors to 64 bytes).
    pub down_offset: usize,
    /// Distance between experts in a bank (a multiple of 4096).
    pub stride: usize,
}

impl ExpertLayout {
    pub fn new(
        dtype: WeightDType,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self, KernelError> {
        let gate_up = MatrixLayout::new(dtype, 2 * intermediate, hidden)?;
        let down = MatrixLayout::new(dtype, hidden, intermediate)?;
        let down_offset = gate_up.total_bytes.next_multiple_of(64);
        let stride = (down_offset + down.total_bytes).next_multiple_of(4096);
        Ok(ExpertLayout {
            dtype,
            hidden,
            intermediate,
            gate_up,
            down,
            down_offset,
            stride,
        })
    }

    /// The layout of the experts of an artifact's `bank`, checked against the bank's stride, so
    /// a bank written with another layout is refused instead of misread.
    pub fn for_bank(
        bank: &ninfer_artifact::ExpertBank,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self, KernelError> {
        let layout =
            ExpertLayout::new(WeightDType::from_artifact(bank.dtype), hidden, intermediate)?;
        if layout.stride as u64 != bank.expert_stride {
            return Err(KernelError::Layout(format!(
                "bank `{}` has expert stride {}, the kernels expect {}",
                bank.prefix, bank.expert_stride, layout.stride
            )));
        }
        Ok(layout)
    }

    /// Weight bytes the kernels stream for one expert (both matrices, values and scales).
    pub fn streamed_bytes(&self) -> usize {
        self.gate_up.streamed_bytes() + self.down.streamed_bytes()
    }
}

/// Encodes a row-major f32 matrix into the stored bytes of `layout` (bf16 rounds to nearest
/// even; int8 / int4 follow `ninfer_artifact::quant`).
pub fn encode_matrix(values: &[f32], layout: &MatrixLayout) -> Result<Vec<u8>, KernelError> {
    if values.len() != layout.rows * layout.cols {
        return Err(KernelError::Layout(format!(
            "{} values for a [{}, {}] matrix",
            values.len(),
            layout.rows,
            layout.cols
        )));
    }
    Ok(match layout.dtype {
        WeightDType::F32 => quant::f32_to_bytes(values),
        WeightDType::Bf16 => quant::f32_to_bf16_bytes(values),
        WeightDType::Int8 | WeightDType::Int4 => {
            let quantized =
                QuantizedLayout::new(layout.dtype.artifact_dtype(), layout.rows, layout.cols)
                    .map_err(KernelError::Layout)?;
            quant::quantize_matrix(values, &quantized)
        }
    })
}

/// Decodes stored matrix bytes back to row-major f32 (what every kernel must compute with).
pub fn decode_matrix(bytes: &[u8], layout: &MatrixLayout) -> Result<Vec<f32>, KernelError> {
    if bytes.len() < layout.total_bytes {
        return Err(KernelError::Layout(format!(
            "{} bytes for a matrix of {} bytes",
            bytes.len(),
            layout.total_bytes
        )));
    }
    let bytes = &bytes[..layout.total_bytes];
    Ok(match layout.dtype {
        WeightDType::F32 | WeightDType::Bf16 => {
            quant::float_bytes_to_f32(layout.dtype.artifact_dtype(), bytes)
        }
        WeightDType::Int8 | WeightDType::Int4 => {
            let quantized =
                QuantizedLayout::new(layout.dtype.artifact_dtype(), layout.rows, layout.cols)
                    .map_err(KernelError::Layout)?;
            quant::dequantize_matrix(bytes, &quantized)
        }
    })
}

/// A matrix the kernels read: its layout and the address of its first byte.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MatrixView {
    pub layout: MatrixLayout,
    pub base: *const u8,
}

// SAFETY: a MatrixView only ever reads the immutable weight bytes it was built from, which the
// caller keeps alive and unmodified for the duration of `compute_layer`.
unsafe impl Send for MatrixView {}
unsafe impl Sync for MatrixView {}

impl MatrixView {
    /// Validates that `bytes` holds the whole matrix.
    pub fn new(bytes: &[u8], layout: MatrixLayout) -> Result<Self, KernelError> {
        if bytes.len() < layout.total_bytes {
            return Err(KernelError::Input(format!(
                "weight slice of {} bytes is shorter than its [{}, {}] {} matrix ({} bytes)",
                bytes.len(),
                layout.rows,
                layout.cols,
                layout.dtype,
                layout.total_bytes
            )));
        }
        Ok(MatrixView {
            layout,
            base: bytes.as_ptr(),
        })
    }

    /// First value byte of `row`.
    ///
    /// # Safety
    /// `row < rows`.
    #[inline]
    pub unsafe fn row_values(&self, row: usize) -> *const u8 {
        self.base.add(row * self.layout.row_bytes)
    }

    /// First f16 scale (little-endian u16) of `row`.
    ///
    /// # Safety
    /// `row < rows` and the dtype is quantized.
    #[inline]
    pub unsafe fn row_scales(&self, row: usize) -> *const u16 {
        self.base
            .add(self.layout.scales_offset + row * self.layout.groups_per_row * 2)
            .cast::<u16>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_layout_matches_writer_rules() {
        let layout = ExpertLayout::new(WeightDType::Int4, 2048, 512).unwrap();
        assert_eq!(layout.gate_up.row_bytes, 1024);
        assert_eq!(layout.gate_up.scales_offset, 1024 * 1024);
        assert_eq!(layout.gate_up.total_bytes, 1024 * 1024 + 1024 * 64 * 2);
        assert_eq!(layout.down_offset % 64, 0);
        assert_eq!(layout.stride % 4096, 0);
        assert!(ExpertLayout::new(WeightDType::Bf16, 37, 19).is_ok());
        // Any width quantizes: rows of 100 inputs are stored as 128 codes (4 groups, the last
        // padded), rows of 40 as 64.
        let padded = ExpertLayout::new(WeightDType::Int8, 100, 40).unwrap();
        assert_eq!(padded.gate_up.row_bytes, 128);
        assert_eq!(padded.gate_up.groups_per_row, 4);
        assert_eq!(padded.down.row_bytes, 64);
        assert_eq!(padded.down.groups_per_row, 2);
        let padded = ExpertLayout::new(WeightDType::Int4, 100, 40).unwrap();
        assert_eq!(padded.gate_up.row_bytes, 64);
        assert_eq!(padded.down.row_bytes, 32);
        assert_eq!(
            padded.down.scales_offset,
            (100 * 32usize).next_multiple_of(64)
        );
    }
}
