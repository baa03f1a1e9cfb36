//! What the row kernels of every path share: cache-line prefetches of weight rows and their
//! scales, and the per-thread scratch buffers.
//!
//! Owns: the prefetch helpers and [`ThreadBuffers`]. Must not touch: the kernels themselves and
//! their dispatch (`kernels.rs`).

#[cfg(target_arch = "x86_64")]
use crate::layout::MatrixView;

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
