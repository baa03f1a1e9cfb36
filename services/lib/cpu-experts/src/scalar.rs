//! The scalar reference kernel: decodes each weight row exactly as `docs/FORMAT.md` says and
//! accumulates in f64. Every other path is tested against it; it is also the only path on
//! CPUs other than x86-64.

use half::{bf16, f16};

use crate::layout::{MatrixView, WeightDType, GROUP};
use crate::prepare::InputRows;

/// Decodes row `row` into `out[..cols]`.
///
/// # Safety
/// `row < rows` of the view and `out` holds `cols` floats.
pub(crate) unsafe fn decode_row(matrix: &MatrixView, row: usize, out: &mut [f32]) {
    let layout = &matrix.layout;
    let values = matrix.row_values(row);
    match layout.dtype {
        WeightDType::F32 => {
            for (index, slot) in out.iter_mut().enumerate().take(layout.cols) {
                *slot = f32::from_le_bytes(*values.add(index * 4).cast::<[u8; 4]>());
            }
        }
        WeightDType::Bf16 => {
            for (index, slot) in out.iter_mut().enumerate().take(layout.cols) {
                *slot = bf16::from_le_bytes(*values.add(index * 2).cast::<[u8; 2]>()).to_f32();
            }
        }
        WeightDType::Int8 | WeightDType::Int4 => {
            let scales = matrix.row_scales(row).cast::<[u8; 2]>();
            for group in 0..layout.groups_per_row {
                let scale = f16::from_le_bytes(*scales.add(group)).to_f32();
                // A last partial group's padding codes are 0 and are not decoded.
                for index in 0..GROUP.min(layout.cols - group * GROUP) {
                    let column = group * GROUP + index;
                    let code = if layout.dtype == WeightDType::Int8 {
                        *values.add(column) as i8 as f32
                    } else {
                        let byte = *values.add(column / 2);
                        let nibble = if column.is_multiple_of(2) {
                            byte & 0x0f
                        } else {
                            byte >> 4
                        };
                        nibble as f32 - 8.0
                    };
                    out[column] = code * scale;
                }
            }
        }
    }
}

/// `out[t·token_stride + (r − first)] = W[r, :] · x_t` for `r` in `first..first+count`.
///
/// # Safety
/// Rows inside the matrix, `input` holds `tokens` f32 rows of at least `cols` features, `out`
/// is writable at every index above, `row_buffer` holds `cols` floats.
pub(crate) unsafe fn rows(
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
    row_buffer: &mut [f32],
) {
    let cols = matrix.layout.cols;
    for local in 0..count {
        decode_row(matrix, first + local, row_buffer);
        for token in 0..input.tokens {
            let x = std::slice::from_raw_parts(input.f32_row(token), cols);
            let sum: f64 = row_buffer[..cols]
                .iter()
                .zip(x)
                .map(|(&w, &v)| w as f64 * v as f64)
                .sum();
            *out.add(token * token_stride + local) = sum as f32;
        }
    }
}
