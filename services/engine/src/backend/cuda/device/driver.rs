//! The driver-call helpers every op file shares: a driver error with what was being done, the
//! launch size of the element-wise kernels, the C `int` check of kernel arguments, the guard
//! against cudarc's panics, and one stream waiting for another of any context.
//!
//! Owns: turning driver failures and panics into [`CudaError`].
//! Must not touch: the backend's state (it knows nothing of [`super::CudaBackend`]).

use cudarc::driver::{sys, CudaStream, DriverError, LaunchConfig};

use super::super::CudaError;

/// Threads per block of the element-wise kernels.
pub(super) const BLOCK: u32 = 256;

pub(super) fn driver_error(
    what: impl Into<String>,
) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    let what = what.into();
    move |error| CudaError::Driver {
        what,
        message: describe(&error),
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`: cudarc's `Display` needs its `std` feature.
pub(super) fn describe(error: &cudarc::driver::DriverError) -> String {
    let name = error
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", error.0));
    match error.error_string() {
        Ok(text) => format!("{name} ({})", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// Kernel arguments are C `int`: refuse sizes that do not fit rather than wrap.
pub(super) fn int(value: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(value).map_err(|_| CudaError::Invalid {
        problem: format!("{what} = {value} does not fit a 32-bit kernel argument"),
    })
}

/// One thread per element, grid-stride beyond 2^16 blocks.
pub(super) fn elementwise(count: usize) -> LaunchConfig {
    let blocks = count.div_ceil(BLOCK as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Runs `f`, turning a panic inside cudarc (it panics when its own loader misses a library or a
/// symbol) into a typed error.
pub(super) fn no_panic<T>(
    what: &str,
    f: impl FnOnce() -> T + std::panic::UnwindSafe,
) -> Result<T, CudaError> {
    std::panic::catch_unwind(f).map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into());
        CudaError::Driver {
            what: what.to_string(),
            message,
        }
    })
}

/// Makes `waiter` wait for everything `source` queued so far. The streams may belong to
/// different contexts (cards): the driver lets a stream wait for another context's event, which
/// cudarc's `CudaStream::wait` refuses. Under stream capture, a wait for an event recorded in the
/// capture makes `waiter` part of it (and a capture's origin stream waiting for a stream that
/// joined it joins that stream back).
pub(super) fn wait_for_stream(waiter: &CudaStream, source: &CudaStream) -> Result<(), DriverError> {
    let queued = source.record_event(None)?;
    waiter.context().bind_to_thread()?;
    // SAFETY: the stream and the event are live for the call; the driver keeps what the wait
    // needs after the event is destroyed.
    unsafe { sys::cuStreamWaitEvent(waiter.cu_stream(), queued.cu_event(), 0) }.result()
}
