//! Device memory bandwidth: a timed device-to-device copy, the HBM reference of `ninfer bench
//! MODEL`'s roofline (as `ninfer bench memory` is the RAM one).
//!
//! Owns: the copy, its timing (CUDA events on the backend's stream) and the buffers, freed on
//! return.
//! Must not touch: anything the model holds; the copy runs on the backend's stream, so a caller
//! measuring while the model computes gets a lower figure (the bench measures while idle).

use cudarc::driver::sys::CUevent_flags;

use super::{driver_error, CudaBackend};
use crate::backend::cuda::CudaError;

/// Copy size tried first; halved while the allocation fails (a GPU filled by expert slots).
const COPY_BYTES: usize = 1 << 30;
/// Below this the copy is too short to time well; report the failure instead.
const SMALLEST_COPY_BYTES: usize = 64 << 20;
/// Timed copies after one untimed warm-up; the fastest counts (others share the GPU's clocks).
const TIMED_COPIES: usize = 5;

impl CudaBackend {
    /// Device memory bandwidth in bytes per second: `2 · size / time` of the fastest of a few
    /// device-to-device copies of 1 GiB (each byte is read once and written once, the
    /// convention of CUDA's `bandwidthTest`), smaller when 2 GiB are not free.
    pub fn measure_copy_bandwidth(&self) -> Result<f64, CudaError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        let mut bytes = COPY_BYTES;
        let (source, mut target) = loop {
            let pair = self.stream.alloc_zeros::<u8>(bytes).and_then(|source| {
                self.stream
                    .alloc_zeros::<u8>(bytes)
                    .map(|target| (source, target))
            });
            match pair {
                Ok(pair) => break pair,
                Err(error) if bytes / 2 >= SMALLEST_COPY_BYTES => {
                    tracing::debug!(bytes, ?error, "bandwidth buffers do not fit; halving");
                    bytes /= 2;
                }
                Err(error) => {
                    return Err(driver_error(format!(
                        "allocating two {} MiB buffers for the bandwidth copy",
                        bytes >> 20
                    ))(error))
                }
            }
        };
        self.stream
            .memcpy_dtod(&source, &mut target)
            .map_err(driver_error("warm-up copy"))?;
        let mut best_seconds = f64::INFINITY;
        for _ in 0..TIMED_COPIES {
            let start = self
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver_error("recording a timing event"))?;
            self.stream
                .memcpy_dtod(&source, &mut target)
                .map_err(driver_error("device-to-device copy"))?;
            let end = self
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver_error("recording a timing event"))?;
            let milliseconds = start
                .elapsed_ms(&end)
                .map_err(driver_error("reading the copy time"))?;
            best_seconds = best_seconds.min(f64::from(milliseconds) / 1e3);
        }
        self.synchronize()?;
        if !(best_seconds.is_finite() && best_seconds > 0.0) {
            return Err(CudaError::Driver {
                what: "timing the bandwidth copy".into(),
                message: format!("implausible copy time {best_seconds} s"),
            });
        }
        Ok(2.0 * bytes as f64 / best_seconds)
    }
}
