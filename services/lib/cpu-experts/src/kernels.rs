//! Row-kernel dispatch: one call computes `W[rows] · x_t` for a block of weight rows and a
//! block of tokens with the chosen path, writing `out[t · token_stride + local_row]`.
//!
//! Owns: the choice of kernel per (path, weight dtype, token count) and the per-thread scratch
//! the kernels use. Must not touch: how rows and tokens are shared among threads (`layer`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::isa::KernelIsa;
use crate::layout::MatrixView;
use crate::prepare::InputRows;

/// Software-prefetch distance in bytes ahead of the weight row being read (0 = off).
static PREFETCH_DISTANCE: AtomicUsize = AtomicUsize::new(4096);
/// 0: prefetch into L1 (`prefetcht0`), 1: into L2 (`prefetcht1`).
static PREFETCH_TO_L2: AtomicUsize = AtomicUsize::new(1);

/// Sets how far ahead (bytes) the streaming kernels prefetch weights, and into which cache
/// level; 0 bytes leaves it to the hardware prefetchers. A tuning knob for `ninfer bench`; the
/// default (4096 bytes ahead, into L2) streamed 13–22% faster than none at decode (int4 and
/// int8) on the 16-core Xeon of `docs/BENCHMARKS.md`.
pub fn set_prefetch_distance(bytes: usize, into_l2: bool) {
    PREFETCH_DISTANCE.store(bytes, Ordering::Relaxed);
    PREFETCH_TO_L2.store(into_l2 as usize, Ordering::Relaxed);
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline]
pub(crate) fn prefetch_distance() -> usize {
    PREFETCH_DISTANCE.load(Ordering::Relaxed)
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline]
pub(crate) fn prefetch_to_l2() -> bool {
    PREFETCH_TO_L2.load(Ordering::Relaxed) != 0
}

/// Prefetches the line at `address` (any address: prefetches never fault).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_line(address: *const u8, into_l2: bool) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    // SAFETY: PREFETCH is a hint; it never faults and has no architectural effect.
    unsafe {
        if into_l2 {
            _mm_prefetch::<_MM_HINT_T1>(address.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(address.cast());
        }
    }
}

/// Prefetches the f16 scales of the row `distance` value-bytes ahead of `row`'s start, so the
/// scale stream is as far ahead as the value stream.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_row_scales(matrix: &MatrixView, row: usize, distance: usize, into_l2: bool) {
    let layout = &matrix.layout;
    let scale_bytes = layout.groups_per_row * 2;
    if distance == 0 || scale_bytes == 0 {
        return;
    }
    let start =
        layout.scales_offset + row * scale_bytes + distance * scale_bytes / layout.row_bytes;
    let mut offset = 0;
    while offset < scale_bytes + 64 {
        prefetch_line(matrix.base.wrapping_add(start + offset), into_l2);
        offset += 64;
    }
}

/// Prefetches (into L2) the first `bytes` value bytes of the rows from `row` on, and their
/// scales: the start of a stream a thread is about to read (see `LayerTuning::prefetch_ahead`).
pub(crate) fn prefetch_stream_start(matrix: &MatrixView, row: usize, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let layout = &matrix.layout;
        let start = row * layout.row_bytes;
        let end = (start + bytes).min(layout.rows * layout.row_bytes);
        let mut offset = start;
        while offset < end {
            prefetch_line(matrix.base.wrapping_add(offset), true);
            offset += 64;
        }
        if layout.groups_per_row > 0 {
            let scale_bytes = layout.groups_per_row * 2;
            let first = layout.scales_offset + row * scale_bytes;
            let last = first + (end - start).div_ceil(layout.row_bytes) * scale_bytes;
            let mut offset = first & !63;
            while offset < last {
                prefetch_line(matrix.base.wrapping_add(offset), true);
                offset += 64;
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (matrix, row, bytes);
}

/// Int4 rows per pass of the decode kernels: 2, 4 or 8 (a tuning knob for `ninfer bench`).
static INT4_ROWS_PER_PASS: AtomicUsize = AtomicUsize::new(2);

/// Sets how many int4 weight rows the decode (one-token) kernels stream in one pass: 2, 4 or 8
/// (anything else means 2).
pub fn set_int4_rows_per_pass(rows: usize) {
    let rows = if rows == 4 || rows == 8 { rows } else { 2 };
    INT4_ROWS_PER_PASS.store(rows, Ordering::Relaxed);
}

/// Whether the int4 decode kernel may use GFNI where the CPU has it (a knob for `ninfer bench`
/// and the tests, which compare both forms on one machine).
static INT4_GFNI_ALLOWED: AtomicBool = AtomicBool::new(true);

/// Allows or forbids the GFNI form of the int4 decode kernel (allowed by default; used only
/// where the CPU has GFNI).
pub fn set_int4_gfni(allowed: bool) {
    INT4_GFNI_ALLOWED.store(allowed, Ordering::Relaxed);
}

/// The int4 decode kernel's GFNI form is allowed and this CPU has GFNI.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn int4_gfni() -> bool {
    INT4_GFNI_ALLOWED.load(Ordering::Relaxed) && std::arch::is_x86_feature_detected!("gfni")
}

/// Per-thread buffers, owned by `LayerScratch`; one thread uses one of them at a time.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // strip / tiles: AMX only
#[derive(Clone, Copy)]
pub(crate) struct ThreadBuffers {
    /// `max(H, Im)` f32: a decoded weight row (scalar path).
    pub row: *mut f32,
    pub row_len: usize,
    /// 16 rows of bf16 weights, `max(H, Im)` rounded up to 32 each (AMX A tiles).
    pub strip: *mut u16,
    /// Two 16×16 f32 C tiles.
    pub tiles: *mut f32,
}

// SAFETY: each ThreadBuffers is used by exactly one pool thread during a job.
unsafe impl Send for ThreadBuffers {}
unsafe impl Sync for ThreadBuffers {}

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
            crate::avx512::rows_float(matrix, first, count, input, out, token_stride)
        }
        #[cfg(target_arch = "x86_64")]
        KernelIsa::Avx512Vnni => {
            crate::avx512::rows_vnni(matrix, first, count, input, out, token_stride)
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
) {
    #[cfg(target_arch = "x86_64")]
    {
        let vnni = matches!(isa, KernelIsa::Avx512Vnni | KernelIsa::Amx);
        let dtype = matrix.layout.dtype;
        if vnni && input.tokens == 1 && input.amx_base.is_none() && dtype.is_quantized() {
            let mut local = 0;
            let int4_rows = INT4_ROWS_PER_PASS.load(Ordering::Relaxed);
            if dtype == crate::layout::WeightDType::Int4 && int4_rows == 8 {
                while count - local >= 4 {
                    let (a, b) = (first_a + local, first_b + local);
                    crate::avx512::int4_rows_one_token::<8>(
                        matrix,
                        [a, a + 1, a + 2, a + 3, b, b + 1, b + 2, b + 3],
                        input,
                        std::array::from_fn(|i| {
                            let out = if i < 4 { out_a } else { out_b };
                            out.add(local + i % 4)
                        }),
                    );
                    local += 4;
                }
            }
            if dtype == crate::layout::WeightDType::Int4 && int4_rows >= 4 {
                while count - local >= 2 {
                    let (row_a, row_b) = (first_a + local, first_b + local);
                    crate::avx512::int4_rows_one_token::<4>(
                        matrix,
                        [row_a, row_a + 1, row_b, row_b + 1],
                        input,
                        [
                            out_a.add(local),
                            out_a.add(local + 1),
                            out_b.add(local),
                            out_b.add(local + 1),
                        ],
                    );
                    local += 2;
                }
            }
            while local < count {
                let (row_a, row_b) = (first_a + local, first_b + local);
                let (a, b) = (out_a.add(local), out_b.add(local));
                if dtype == crate::layout::WeightDType::Int4 {
                    crate::avx512::int4_rows_one_token::<2>(matrix, [row_a, row_b], input, [a, b]);
                } else {
                    crate::avx512::int8_row_pair(matrix, row_a, row_b, input, a, b);
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
    );
}
