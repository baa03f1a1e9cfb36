//! The `--host-kv-mib` pool: one page-locked, device-mapped host region (`cuMemHostAlloc`,
//! `DEVICEMAP`) handed out in first-fit ranges, the placement counters, and the token each KV
//! cache holds while it lives (it returns the cache's range and counts on drop).
//!
//! Owns: the region, its free ranges and the counters.
//! Must not touch: where caches go (device/host_kv.rs) and the cache layout (device/mod.rs).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaStream};

use super::driver::driver_error;
use crate::backend::cuda::CudaError;
use crate::backend::DeviceKvShare;

/// Every range of the pool starts on this many bytes.
pub(super) const ALIGN: usize = 256;

/// The page-locked region and its free ranges.
pub(crate) struct HostKvPool {
    host: *mut u8,
    pub(super) device: sys::CUdeviceptr,
    pub(super) bytes: usize,
    /// Free `(offset, len)` ranges, sorted by offset, never adjacent.
    free: Mutex<Vec<(usize, usize)>>,
    stream: Arc<CudaStream>,
}

// SAFETY: the region is owned by the pool and only reached through the GPU (stream-ordered) or
// the free list (behind its mutex).
unsafe impl Send for HostKvPool {}
unsafe impl Sync for HostKvPool {}

impl Drop for HostKvPool {
    fn drop(&mut self) {
        // No kernel may still read a cache of the region (every lease holds the pool).
        let _ = self.stream.synchronize();
        // SAFETY: allocated by cuMemHostAlloc in `HostKvPool::new`, freed once.
        unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}

impl HostKvPool {
    pub(super) fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self, CudaError> {
        let failed = |call: &str, status: sys::CUresult| CudaError::Driver {
            what: format!("{call} of {bytes} bytes for --host-kv-mib"),
            message: format!("{status:?}"),
        };
        stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the driver is loaded (the context exists); valid out pointer.
        let status =
            unsafe { sys::cuMemHostAlloc(&mut host, bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) };
        if status != sys::CUresult::CUDA_SUCCESS || host.is_null() {
            return Err(failed("cuMemHostAlloc", status));
        }
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` is a live DEVICEMAP allocation; valid out pointer.
        let status = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
        if status != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: allocated just above.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(failed("cuMemHostGetDevicePointer", status));
        }
        Ok(HostKvPool {
            host: host.cast(),
            device,
            bytes,
            free: Mutex::new(vec![(0, bytes)]),
            stream: Arc::clone(stream),
        })
    }

    /// First fit of `bytes` (rounded up to [`ALIGN`]): `(offset, leased bytes)`.
    pub(super) fn allocate(&self, bytes: usize) -> Option<(usize, usize)> {
        allocate_range(&mut *self.free.lock().ok()?, bytes)
    }

    fn release(&self, offset: usize, bytes: usize) {
        if let Ok(mut free) = self.free.lock() {
            release_range(&mut free, offset, bytes);
        }
    }
}

/// First fit of `bytes` rounded up to [`ALIGN`] in the sorted free ranges.
fn allocate_range(free: &mut Vec<(usize, usize)>, bytes: usize) -> Option<(usize, usize)> {
    let bytes = bytes.checked_next_multiple_of(ALIGN)?.max(ALIGN);
    let index = free.iter().position(|&(_, len)| len >= bytes)?;
    let (offset, len) = free[index];
    if len == bytes {
        free.remove(index);
    } else {
        free[index] = (offset + bytes, len - bytes);
    }
    Some((offset, bytes))
}

/// Returns a range to the sorted free ranges, merged with its neighbours.
fn release_range(free: &mut Vec<(usize, usize)>, offset: usize, bytes: usize) {
    let index = free.partition_point(|&(start, _)| start < offset);
    free.insert(index, (offset, bytes));
    if index + 1 < free.len() && free[index].0 + free[index].1 == free[index + 1].0 {
        free[index].1 += free[index + 1].1;
        free.remove(index + 1);
    }
    if index > 0 && free[index - 1].0 + free[index - 1].1 == free[index].0 {
        free[index - 1].1 += free[index].1;
        free.remove(index);
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(super) device_caches: AtomicUsize,
    pub(super) device_bytes: AtomicU64,
    pub(super) host_caches: AtomicUsize,
    pub(super) host_bytes: AtomicU64,
}

/// The backend's `--host-kv-mib` state (`None`: no pool, caches on the GPU, nothing counted).
pub(crate) struct HostKv {
    pub(super) pool: Arc<HostKvPool>,
    pub(super) share: DeviceKvShare,
    /// The share in bytes, decided at the first cache.
    pub(super) resolved: Option<u64>,
    pub(super) counters: Arc<Counters>,
}

pub(crate) type HostKvSlot = Mutex<Option<HostKv>>;

/// Where one KV cache is, counted while it lives.
#[derive(Default)]
pub(crate) enum KvPlacementToken {
    /// No pool: nothing counted.
    #[default]
    Untracked,
    Device {
        counters: Arc<Counters>,
        bytes: u64,
    },
    Host {
        counters: Arc<Counters>,
        pool: Arc<HostKvPool>,
        offset: usize,
        bytes: usize,
    },
}

impl Drop for KvPlacementToken {
    fn drop(&mut self) {
        match self {
            KvPlacementToken::Untracked => {}
            KvPlacementToken::Device { counters, bytes } => {
                counters.device_caches.fetch_sub(1, Ordering::Relaxed);
                counters.device_bytes.fetch_sub(*bytes, Ordering::Relaxed);
            }
            KvPlacementToken::Host {
                counters,
                pool,
                offset,
                bytes,
            } => {
                counters.host_caches.fetch_sub(1, Ordering::Relaxed);
                counters
                    .host_bytes
                    .fetch_sub(*bytes as u64, Ordering::Relaxed);
                // Stream order: kernels queued later that reuse the range run after the ones
                // queued for this cache.
                pool.release(*offset, *bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_aligned_first_fit_and_merge_back_into_one() {
        let mut free = vec![(0usize, 4096usize)];
        let a = allocate_range(&mut free, 1000).unwrap();
        let b = allocate_range(&mut free, 1).unwrap();
        let c = allocate_range(&mut free, 2048).unwrap();
        assert_eq!((a, b, c), ((0, 1024), (1024, 256), (1280, 2048)));
        assert_eq!(allocate_range(&mut free, 1024), None);
        release_range(&mut free, b.0, b.1);
        assert_eq!(allocate_range(&mut free, 256), Some((1024, 256)));
        release_range(&mut free, 1024, 256);
        release_range(&mut free, c.0, c.1);
        release_range(&mut free, a.0, a.1);
        assert_eq!(free, vec![(0, 4096)]);
    }
}
