//! Copies of cache rows between sequences' caches on the GPU (the prefix cache keeps blocks of
//! one sequence's KV and puts them back into another's).
//!
//! Owns: the bounds checks and the device-to-device copies of KV rows, in the caches' own dtype
//! (GPU memory or the host KV pool: both are addressed by the device).
//! Must not touch: what a cache's rows mean (attention, QSA), which rows are copied when.

use std::ops::Range;

use cudarc::driver::CudaSlice;

use super::{driver_error, CudaBackend, CudaKvCache, KvBuffer};
use crate::backend::cuda::CudaError;

impl CudaBackend {
    /// Positions `from` of `source` to positions `to..` of `target`, keys and values, queued on
    /// the compute stream (so ordered before every later op that reads `target` and after every
    /// earlier op that wrote `source`).
    pub(super) fn copy_kv_rows_on(
        &self,
        source: &CudaKvCache,
        from: Range<usize>,
        target: &mut CudaKvCache,
        to: usize,
    ) -> Result<(), CudaError> {
        let width = source.kv_width;
        let end = to + from.len();
        if target.kv_width != width
            || target.dtype != source.dtype
            || from.end > source.max_tokens
            || end > target.max_tokens
        {
            return Err(CudaError::Invalid {
                problem: format!(
                    "copy_kv_rows: positions {from:?} of a {}-position {:?} cache of width {width} to {to}.. of a {}-position {:?} cache of width {}",
                    source.max_tokens, source.dtype, target.max_tokens, target.dtype, target.kv_width
                ),
            });
        }
        if from.is_empty() {
            return Ok(());
        }
        let (source_values, target_values) = (
            from.start * width..from.end * width,
            to * width..end * width,
        );
        for (source_buffer, target_buffer) in [
            (&*source.keys, &mut *target.keys),
            (&*source.values, &mut *target.values),
        ] {
            match (source_buffer, target_buffer) {
                (KvBuffer::F32(source), KvBuffer::F32(target)) => {
                    self.copy_range(source, source_values.clone(), target, target_values.clone())?
                }
                (KvBuffer::Bf16(source), KvBuffer::Bf16(target)) => {
                    self.copy_range(source, source_values.clone(), target, target_values.clone())?
                }
                _ => {
                    return Err(CudaError::Invalid {
                        problem: "copy_kv_rows between caches of different dtypes".into(),
                    })
                }
            }
        }
        target.len = target.len.max(end);
        Ok(())
    }

    /// `source[from]` to `target[to]` (ranges of equal length, inside both buffers).
    pub(super) fn copy_range<T>(
        &self,
        source: &CudaSlice<T>,
        from: Range<usize>,
        target: &mut CudaSlice<T>,
        to: Range<usize>,
    ) -> Result<(), CudaError> {
        if from.len() != to.len() || from.end > source.len() || to.end > target.len() {
            return Err(CudaError::Invalid {
                problem: format!(
                    "a copy of elements {from:?} of {} to {to:?} of {}",
                    source.len(),
                    target.len()
                ),
            });
        }
        self.stream
            .memcpy_dtod(&source.slice(from), &mut target.slice_mut(to))
            .map_err(driver_error("copying cache rows"))
    }
}
