//! Row-kernel dispatch: one call computes `W[rows] · x_t` for a block of weight rows and a
//! block of tokens with the chosen path, writing `out[t · token_stride + local_row]`.
//!
//! Owns: the choice of kernel per (path, weight dtype, token count) and the per-thread scratch
//! the kernels use. Must not touch: how rows and tokens are shared among threads (`layer`).

use crate::isa::KernelIsa;
use crate::kernel_shared::ThreadBuffers;
use crate::layout::MatrixView;
use crate::prepare::InputRows;
use crate::tuning::Prefetch;

/// Computes rows `first..first+count` of `matrix` against every token of `input`.
///
/// # Safety
/// Rows are inside the matrix; `input` was prepared for this path and the matrix dtype;
/// `out` is writable at `t · token_stride + r` for `t < input.tokens`, `r < count`; the
/// buffers belong to the calling thread. The path is supported by this CPU.
#[allow(clippy::too_many_arguments)] // one hot-path call with no natural grouping
pub(crate) unsafe fn matmul_rows(
    isa: KernelIsa,
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
    buffers: &ThreadBuffers,
    prefetch: Prefetch,
) {
    match isa {
        KernelIsa::Scalar => {
            let row = std::slice::from_raw_parts_mut(buffers.row, buffers.row_len);
            crate::scalar::rows(matrix, first, count, input, out, token_stride, row);
        }
        #[cfg(target_arch = "x86_64")]
        KernelIsa::Avx2 => crate::avx2::rows(matrix, first, count, input, out, token_stride),
        #[cfg(target_arch = "x86_64")]
        KernelIsa::Avx512 => {
            crate::avx512::rows_float(matrix, first, count, input, out, token_stride, prefetch)
        }
        #[cfg(target_arch = "x86_64")]
        KernelIsa::Avx512Vnni => {
            crate::avx512::rows_vnni(matrix, first, count, input, out, token_stride, prefetch)
        }
        #[cfg(target_arch = "x86_64")]
        KernelIsa::Amx => {
            let mut done = 0;
            if input.amx_base.is_some() {
                while count - done >= 16 {
                    crate::amx::rows16(
                        matrix,
                        first + done,
                        input,
                        out.add(done),
                        token_stride,
                        buffers,
                    );
                    done += 16;
                }
            }
            if done < count {
                crate::avx512::rows_vnni(
                    matrix,
                    first + done,
                    count - done,
                    input,
                    out.add(done),
                    token_stride,
                    prefetch,
                );
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => {
            // Only the scalar path is ever reported supported off x86-64.
            let row = std::slice::from_raw_parts_mut(buffers.row, buffers.row_len);
            crate::scalar::rows(matrix, first, count, input, out, token_stride, row);
        }
    }
}

/// Rows `first_a..first_a+count` and `first_b..first_b+count` of `matrix` (two separate weight
/// streams, e.g. gate and up rows) against every token of `input`, into `out_a` / `out_b`
/// (same indexing as [`matmul_rows`]). Decode-shaped int8 / int4 on the VNNI / AMX paths runs
/// both streams in one pass; everything else is two `matmul_rows` calls.
///
/// # Safety
/// As [`matmul_rows`] for both row ranges and outputs.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_row_pairs(
    isa: KernelIsa,
    matrix: &MatrixView,
    first_a: usize,
    first_b: usize,
    count: usize,
    input: &InputRows,
    out_a: *mut f32,
    out_b: *mut f32,
    token_stride: usize,
    buffers: &ThreadBuffers,
    prefetch: Prefetch,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let vnni = matches!(isa, KernelIsa::Avx512Vnni | KernelIsa::Amx);
        let dtype = matrix.layout.dtype;
        if vnni && input.tokens == 1 && input.amx_base.is_none() && dtype.is_quantized() {
            let mut local = 0;
            while local < count {
                let (row_a, row_b) = (first_a + local, first_b + local);
                let (a, b) = (out_a.add(local), out_b.add(local));
                if dtype == crate::layout::WeightDType::Int4 {
                    crate::avx512::int4_rows_one_token::<2>(
                        matrix,
                        [row_a, row_b],
                        input,
                        [a, b],
                        prefetch,
                    );
                } else {
                    crate::avx512::int8_row_pair(matrix, row_a, row_b, input, a, b, prefetch);
                }
                local += 1;
            }
            return;
        }
    }
    matmul_rows(
        isa,
        matrix,
        first_a,
        count,
        input,
        out_a,
        token_stride,
        buffers,
        prefetch,
    );
    matmul_rows(
        isa,
        matrix,
        first_b,
        count,
        input,
        out_b,
        token_stride,
        buffers,
        prefetch,
    );
}
