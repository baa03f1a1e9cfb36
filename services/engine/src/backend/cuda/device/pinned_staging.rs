//! Page-locked, device-mapped host buffers: the one the read-backs go through and the pool the
//! pending routings draw from.
//!
//! Owns: allocating, mapping and freeing such a buffer, and bounds-checked addresses into it.
//! Must not touch: what is copied into it (device/readback.rs, device/pending_routing.rs).

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaEvent};

use super::driver::driver_error;
use crate::backend::cuda::CudaError;

/// Page-locked host memory from `cuMemAllocHost` (cached: the host reads it; cudarc's own
/// pinned slices are write-combined, which is slow to read), mapped into the device's address
/// space so kernels can store to it directly.
pub(crate) struct PinnedStaging {
    /// Read and written by the read-backs (device/readback.rs).
    pub(super) pointer: *mut u8,
    /// The same memory as the device addresses it.
    device_pointer: u64,
    bytes: usize,
}

// SAFETY: the pointer is owned memory used only under the backend's mutex.
unsafe impl Send for PinnedStaging {}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        if !self.pointer.is_null() {
            // SAFETY: allocated by cuMemAllocHost below; no copy is pending (every use waits).
            unsafe { sys::cuMemFreeHost(self.pointer.cast()) };
        }
    }
}

pub(crate) type StagingSlot = Mutex<Option<PinnedStaging>>;

/// Page-locked buffers, each with the event its copies are waited by, free for the next
/// pending routing (one per routing in flight: at most one per MoE layer of a forward). Kept,
/// not made per layer: allocating page-locked memory or an event is a driver call.
pub(crate) type RoutingStagingPool = Arc<Mutex<Vec<(PinnedStaging, CudaEvent)>>>;

impl PinnedStaging {
    /// `bytes` of page-locked, cached host memory in `context` (bound to this thread here).
    pub(super) fn allocate(context: &CudaContext, bytes: usize) -> Result<Self, CudaError> {
        context
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        let mut pointer: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the context is current on this thread (bound above); valid out pointer.
        let status = unsafe { sys::cuMemAllocHost_v2(&mut pointer, bytes) };
        if status != sys::CUresult::CUDA_SUCCESS || pointer.is_null() {
            return Err(CudaError::Driver {
                what: format!("cuMemAllocHost of {bytes} bytes for read-backs"),
                message: format!("{status:?}"),
            });
        }
        let mut staging = PinnedStaging {
            pointer: pointer.cast(),
            device_pointer: 0,
            bytes,
        };
        let mut device_pointer: sys::CUdeviceptr = 0;
        // SAFETY: `pointer` is page-locked memory of this context (allocated above); valid out
        // pointer; flags must be 0.
        let status = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_pointer, pointer, 0) };
        if status != sys::CUresult::CUDA_SUCCESS {
            // `staging` frees the memory on the way out.
            return Err(CudaError::Driver {
                what: format!("mapping {bytes} bytes of page-locked memory into the device"),
                message: format!("{status:?}"),
            });
        }
        staging.device_pointer = device_pointer;
        Ok(staging)
    }

    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The host address of the u32 at byte `offset` (4-aligned, inside the buffer), for words
    /// kernels store to and the host reads after waiting for them, or the host writes while no
    /// kernel touches them.
    pub(super) fn host_word(&self, offset: usize) -> Result<*mut u32, CudaError> {
        if offset % 4 != 0 || offset + 4 > self.bytes {
            return Err(CudaError::Invalid {
                problem: format!(
                    "word at byte {offset} of a {}-byte staging buffer",
                    self.bytes
                ),
            });
        }
        // SAFETY: inside the allocation (checked above).
        Ok(unsafe { self.pointer.add(offset) }.cast())
    }

    /// The device address of byte `offset` (kernels store to it; the host reads it after a
    /// wait on the stream or on an event recorded after those kernels).
    pub(super) fn device_address(&self, offset: usize) -> Result<u64, CudaError> {
        if offset >= self.bytes {
            return Err(CudaError::Invalid {
                problem: format!(
                    "offset {offset} is outside a {}-byte staging buffer",
                    self.bytes
                ),
            });
        }
        Ok(self.device_pointer + offset as u64)
    }
}
