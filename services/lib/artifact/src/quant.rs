//! Weight codecs: bf16 rounding and symmetric group quantization to int8 / int4
//! (exact rules and error bound in `docs/FORMAT.md`, "Data types and quantization").

use half::{bf16, f16};

use crate::header::{align_up, DType, QuantizationParams, QuantizationScheme, ScaleDType};

/// Input features per quantization group.
pub const GROUP_SIZE: usize = 32;

/// Byte layout of one group-quantized `[rows, cols]` matrix.
///
/// A row whose `cols` is not a multiple of [`GROUP_SIZE`] is stored as if it had
/// [`QuantizedLayout::stored_cols`] columns: its last group is padded with code 0 (int8 byte 0,
/// int4 nibble 8), which decodes to exactly 0 whatever the group's scale, so a kernel that runs
/// over whole groups against activations zero-padded the same way adds exactly nothing for the
/// padding. The scale of that group comes from its real values only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizedLayout {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Bytes of quantized values of one row (of `stored_cols()` codes).
    pub row_value_bytes: usize,
    /// Offset of the f16 scales from the tensor start.
    pub scales_offset: usize,
    /// Total tensor bytes.
    pub total_bytes: usize,
}

impl QuantizedLayout {
    /// Layout of a quantized matrix, or why it cannot be quantized.
    pub fn new(dtype: DType, rows: usize, cols: usize) -> Result<Self, String> {
        let stored_cols = cols.next_multiple_of(GROUP_SIZE);
        let row_value_bytes = match dtype {
            DType::Int8 => stored_cols,
            DType::Int4 => stored_cols / 2,
            other => return Err(format!("{other} is not a quantized dtype")),
        };
        let scales_offset = align_up((rows * row_value_bytes) as u64, 64) as usize;
        let total_bytes = scales_offset + rows * (stored_cols / GROUP_SIZE) * 2;
        Ok(QuantizedLayout {
            dtype,
            rows,
            cols,
            row_value_bytes,
            scales_offset,
            total_bytes,
        })
    }

    /// Groups of one row, the last one padded when `cols` is not a multiple of the group size.
    pub fn groups_per_row(&self) -> usize {
        self.cols.div_ceil(GROUP_SIZE)
    }

    /// Codes stored per row: `cols` rounded up to whole groups.
    pub fn stored_cols(&self) -> usize {
        self.groups_per_row() * GROUP_SIZE
    }

    pub fn params(&self) -> QuantizationParams {
        QuantizationParams {
            scheme: QuantizationScheme::SymmetricGroup,
            group_size: GROUP_SIZE as u32,
            scales_offset: self.scales_offset as u64,
            scale_dtype: ScaleDType::F16,
        }
    }

    fn max_code(&self) -> f32 {
        match self.dtype {
            DType::Int4 => 7.0,
            _ => 127.0,
        }
    }
}

/// The smallest f16 that is ≥ `value` (value ≥ 0), so `max|x| / scale` never exceeds the code range.
fn f16_round_up(value: f32) -> f16 {
    let mut scale = f16::from_f32(value);
    while scale.to_f32() < value {
        scale = f16::from_bits(scale.to_bits() + 1);
    }
    scale
}

/// Quantizes a row-major `[rows, cols]` f32 matrix into the tensor bytes of `layout`.
pub fn quantize_matrix(values: &[f32], layout: &QuantizedLayout) -> Vec<u8> {
    assert_eq!(
        values.len(),
        layout.rows * layout.cols,
        "matrix size does not match its layout"
    );
    let mut bytes = vec![0u8; layout.total_bytes];
    if layout.dtype == DType::Int4 {
        // Code 0 everywhere first (nibble 8), so the padding of a last partial group decodes
        // to exactly 0; int8's code 0 is the zero byte already.
        bytes[..layout.rows * layout.row_value_bytes].fill(0x88);
    }
    let max_code = layout.max_code();
    let groups = layout.groups_per_row();
    for row in 0..layout.rows {
        for group in 0..groups {
            let start = row * layout.cols + group * GROUP_SIZE;
            let end = (start + GROUP_SIZE).min((row + 1) * layout.cols);
            let chunk = &values[start..end];
            let max_abs = chunk.iter().fold(0.0f32, |acc, x| acc.max(x.abs()));
            let scale = f16_round_up(max_abs / max_code);
            let scale_f32 = scale.to_f32();
            let scale_at = layout.scales_offset + (row * groups + group) * 2;
            bytes[scale_at..scale_at + 2].copy_from_slice(&scale.to_le_bytes());
            for (index, &x) in chunk.iter().enumerate() {
                // Division (not multiplication by the inverse) keeps round-half-away exact.
                let code = if scale_f32 > 0.0 {
                    (x / scale_f32).round()
                } else {
                    0.0
                };
                let code = code.clamp(-max_code, max_code) as i32;
                let column = group * GROUP_SIZE + index;
                match layout.dtype {
                    DType::Int8 => bytes[row * layout.row_value_bytes + column] = code as i8 as u8,
                    _ => {
                        let byte_at = row * layout.row_value_bytes + column / 2;
                        let nibble = (code + 8) as u8;
                        if column % 2 == 0 {
                            bytes[byte_at] = (bytes[byte_at] & 0xf0) | nibble;
                        } else {
                            bytes[byte_at] = (bytes[byte_at] & 0x0f) | (nibble << 4);
                        }
                    }
                }
            }
        }
    }
    bytes
}

/// Decodes quantized tensor bytes back to a row-major f32 matrix.
pub fn dequantize_matrix(bytes: &[u8], layout: &QuantizedLayout) -> Vec<f32> {
    let mut out = vec![0.0f32; layout.rows * layout.cols];
    dequantize_rows(bytes, layout, 0, layout.rows, &mut out);
    out
}

/// Decodes rows `first..first+count` into `out` (`count × cols` values).
pub fn dequantize_rows(
    bytes: &[u8],
    layout: &QuantizedLayout,
    first: usize,
    count: usize,
    out: &mut [f32],
) {
    let groups = layout.groups_per_row();
    for local in 0..count {
        let row = first + local;
        let row_values = &bytes[row * layout.row_value_bytes..(row + 1) * layout.row_value_bytes];
        let out_row = &mut out[local * layout.cols..(local + 1) * layout.cols];
        for group in 0..groups {
            let scale_at = layout.scales_offset + (row * groups + group) * 2;
            let scale = f16::from_le_bytes([bytes[scale_at], bytes[scale_at + 1]]).to_f32();
            let in_group = GROUP_SIZE.min(layout.cols - group * GROUP_SIZE);
            for index in 0..in_group {
                let column = group * GROUP_SIZE + index;
                let code = match layout.dtype {
                    DType::Int8 => row_values[column] as i8 as f32,
                    _ => {
                        let byte = row_values[column / 2];
                        let nibble = if column % 2 == 0 {
                            byte & 0x0f
                        } else {
                            byte >> 4
                        };
                        nibble as f32 - 8.0
                    }
                };
                out_row[column] = code * scale;
            }
        }
    }
}

/// The documented per-element error bound of a group: half its (rounded-up) scale.
pub fn quantization_error_bound(dtype: DType, group_max_abs: f32) -> f32 {
    let max_code = if dtype == DType::Int4 { 7.0 } else { 127.0 };
    f16_round_up(group_max_abs / max_code).to_f32() * 0.5
}

/// f32 → bf16 bytes, round to nearest even.
pub fn f32_to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(values.len() * 2);
    for &value in values {
        bytes.extend_from_slice(&bf16::from_f32(value).to_le_bytes());
    }
    bytes
}

/// f32 → little-endian f32 bytes.
pub fn f32_to_bytes(values: &[f32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(values.len() * 4);
    for &value in values {
        bytes.extend_from_slice(&value.to_le_bytes());
    }
    bytes
}

/// Decodes stored bytes of an f32 or bf16 tensor into f32 values.
pub fn float_bytes_to_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random_matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..rows * cols)
            .map(|i| {
                // Mix magnitudes so some groups are tiny and some are all zero.
                if i % 97 < 32 && (i / 97) % 5 == 0 {
                    0.0
                } else {
                    rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..2))
                }
            })
            .collect()
    }

    fn assert_within_bound(dtype: DType) {
        let (rows, cols) = (7, 96);
        let values = random_matrix(rows, cols, 42);
        let layout = QuantizedLayout::new(dtype, rows, cols).unwrap();
        let bytes = quantize_matrix(&values, &layout);
        assert_eq!(bytes.len(), layout.total_bytes);
        let decoded = dequantize_matrix(&bytes, &layout);
        let mut worst_ratio = 0.0f32;
        for row in 0..rows {
            for group in 0..cols / GROUP_SIZE {
                let start = row * cols + group * GROUP_SIZE;
                let chunk = &values[start..start + GROUP_SIZE];
                let max_abs = chunk.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                let bound = quantization_error_bound(dtype, max_abs) * (1.0 + 1e-6);
                for i in 0..GROUP_SIZE {
                    let error = (values[start + i] - decoded[start + i]).abs();
                    assert!(error <= bound, "{dtype}: error {error} above bound {bound}");
                    if bound > 0.0 {
                        worst_ratio = worst_ratio.max(error / bound);
                    }
                }
            }
        }
        // A codec that rounds correctly uses most of its error budget on random data.
        assert!(
            worst_ratio > 0.5,
            "{dtype}: suspiciously small error ratio {worst_ratio}"
        );
    }

    #[test]
    fn int8_round_trip_is_within_documented_bound() {
        assert_within_bound(DType::Int8);
    }

    #[test]
    fn int4_round_trip_is_within_documented_bound() {
        assert_within_bound(DType::Int4);
    }

    #[test]
    fn int4_packs_low_nibble_first() {
        let layout = QuantizedLayout::new(DType::Int4, 1, 32).unwrap();
        let mut values = vec![0.0f32; 32];
        values[0] = 7.0;
        values[1] = -7.0;
        let bytes = quantize_matrix(&values, &layout);
        assert_eq!(bytes[0], (7 + 8) | ((8 - 7) << 4));
        assert_eq!(
            f16::from_le_bytes([bytes[layout.scales_offset], bytes[layout.scales_offset + 1]])
                .to_f32(),
            1.0
        );
    }

    /// Rows of 40 and 72 inputs: the last group is padded to 32 codes that decode to 0, and
    /// the real values keep the documented bound (the scale comes from them alone).
    #[test]
    fn widths_not_multiple_of_the_group_round_trip_with_zero_padding() {
        for dtype in [DType::Int8, DType::Int4] {
            for cols in [40, 72, 33] {
                let rows = 5;
                let values = random_matrix(rows, cols, cols as u64);
                let layout = QuantizedLayout::new(dtype, rows, cols).unwrap();
                assert_eq!(layout.stored_cols(), cols.next_multiple_of(GROUP_SIZE));
                assert_eq!(layout.groups_per_row(), cols.div_ceil(GROUP_SIZE));
                let bytes = quantize_matrix(&values, &layout);
                assert_eq!(bytes.len(), layout.total_bytes);
                let decoded = dequantize_matrix(&bytes, &layout);
                assert_eq!(decoded.len(), rows * cols);
                for row in 0..rows {
                    for group in 0..layout.groups_per_row() {
                        let first = group * GROUP_SIZE;
                        let last = (first + GROUP_SIZE).min(cols);
                        let real = &values[row * cols + first..row * cols + last];
                        let max_abs = real.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                        let bound = quantization_error_bound(dtype, max_abs) * (1.0 + 1e-6);
                        for (index, &x) in real.iter().enumerate() {
                            let error = (x - decoded[row * cols + first + index]).abs();
                            assert!(error <= bound, "{dtype} cols {cols}: {error} > {bound}");
                        }
                    }
                    // The padding codes: every stored column from `cols` on is code 0.
                    let row_bytes =
                        &bytes[row * layout.row_value_bytes..][..layout.row_value_bytes];
                    for column in cols..layout.stored_cols() {
                        let code = match dtype {
                            DType::Int8 => row_bytes[column] as i8 as i32,
                            _ => {
                                let byte = row_bytes[column / 2];
                                let nibble = if column % 2 == 0 {
                                    byte & 0x0f
                                } else {
                                    byte >> 4
                                };
                                nibble as i32 - 8
                            }
                        };
                        assert_eq!(code, 0, "{dtype} cols {cols}: padding column {column}");
                    }
                }
            }
        }
    }
}
