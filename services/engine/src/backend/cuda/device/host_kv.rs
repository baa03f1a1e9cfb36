//! `--host-kv-mib`: KV caches in page-locked, device-mapped host memory. One `cuMemHostAlloc`
//! (`DEVICEMAP`) region is the pool; a KV cache placed there is an ordinary [`CudaKvCache`] whose
//! key and value buffers point into the region's device mapping, so the attention kernels read
//! and write it over PCIe unchanged. Caches go to the GPU first; once the GPU's share of KV
//! memory is used up, whole caches (one attention layer of one sequence) go to the pool while it
//! has room, then to the GPU again (as without a pool).
//!
//! Owns: the placement of each new cache (the device share, decided at the first cache); the
//! pool, its ranges and counters are device/host_kv_pool.rs.
//! Must not touch: the cache layout and the kernels (device/mod.rs, attention.rs).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::sys;

use super::host_kv_pool::{HostKv, HostKvPool, KvPlacementToken, ALIGN};
use super::{CudaBackend, CudaKvCache, KvBuffer, KvDtype};
use crate::backend::cuda::CudaError;
use crate::backend::{DeviceKvShare, HostKvRequest, KvPlacement};

/// GPU memory `DeviceKvShare::Auto` leaves for everything else (activations, workspaces).
const WORKING_MEMORY: u64 = 1 << 30;

impl Drop for CudaKvCache {
    fn drop(&mut self) {
        let in_host_pool = matches!(self.placement, KvPlacementToken::Host { .. });
        for buffer in [&mut self.keys, &mut self.values] {
            // SAFETY: each buffer is taken exactly once, here, and never used after.
            let buffer = unsafe { std::mem::ManuallyDrop::take(buffer) };
            // The buffers of a host-pool cache point into the pool: never hand them to
            // cuMemFree.
            if in_host_pool {
                match buffer {
                    KvBuffer::F32(slice) => {
                        slice.leak();
                    }
                    KvBuffer::Bf16(slice) => {
                        slice.leak();
                    }
                }
            }
        }
    }
}

/// Where [`CudaBackend::place_kv_cache`] put a new cache.
pub(super) enum KvPlace {
    /// In the host pool, ready.
    Host(CudaKvCache),
    /// To be allocated on the GPU, counted by this token.
    Device(KvPlacementToken),
}

impl CudaBackend {
    /// [`crate::backend::Backend::reserve_host_kv`].
    pub(super) fn reserve_host_kv_pool(&self, request: &HostKvRequest) -> Result<(), CudaError> {
        let pool = if request.host_bytes == 0 {
            None
        } else {
            let bytes = usize::try_from(request.host_bytes).map_err(|_| CudaError::Invalid {
                problem: format!("--host-kv-mib: {} bytes", request.host_bytes),
            })?;
            Some(HostKvPool::new(&self.stream, bytes)?)
        };
        let mut slot = self.host_kv.lock().map_err(|_| CudaError::Invalid {
            problem: "the host KV lock is poisoned".into(),
        })?;
        *slot = pool.map(|pool| {
            tracing::info!(
                host_kv_mib = request.host_bytes >> 20,
                device_share = ?request.device_share,
                "host KV pool: page-locked, device-mapped; attention layers' KV caches go there once the GPU's share is used up"
            );
            HostKv {
                pool: Arc::new(pool),
                share: request.device_share,
                resolved: None,
                counters: Arc::default(),
            }
        });
        Ok(())
    }

    /// [`crate::backend::Backend::kv_placement`].
    pub(super) fn host_kv_placement(&self) -> Option<KvPlacement> {
        let slot = self.host_kv.lock().ok()?;
        let state = slot.as_ref()?;
        let counters = &state.counters;
        Some(KvPlacement {
            device_caches: counters.device_caches.load(Ordering::Relaxed),
            device_bytes: counters.device_bytes.load(Ordering::Relaxed),
            host_caches: counters.host_caches.load(Ordering::Relaxed),
            host_bytes: counters.host_bytes.load(Ordering::Relaxed),
            host_pool_bytes: state.pool.bytes as u64,
            device_share_bytes: state.resolved,
        })
    }

    /// Where a new `[max_tokens, kv_width]` K/V cache goes (see the module doc).
    pub(super) fn place_kv_cache(
        &self,
        max_tokens: usize,
        kv_width: usize,
    ) -> Result<KvPlace, CudaError> {
        let Ok(mut slot) = self.host_kv.lock() else {
            return Ok(KvPlace::Device(KvPlacementToken::Untracked));
        };
        let Some(state) = slot.as_mut() else {
            return Ok(KvPlace::Device(KvPlacementToken::Untracked));
        };
        let dtype = self.options.kv_dtype;
        let count = (max_tokens * kv_width).max(1);
        let buffer_bytes = count * dtype.bytes();
        let bytes = 2 * buffer_bytes as u64;
        let share = match (state.resolved, state.share) {
            (Some(share), _) => share,
            (None, DeviceKvShare::Bytes(share)) => share,
            (None, DeviceKvShare::Auto { budget_bytes }) => {
                let (free, total) = self.memory_info().unwrap_or((0, 0));
                let used = total.saturating_sub(free) as u64;
                let available = match budget_bytes {
                    Some(budget) => budget.saturating_sub(used).min(free as u64),
                    None => free as u64,
                };
                available.saturating_sub(WORKING_MEMORY)
            }
        };
        if state.resolved.is_none() {
            state.resolved = Some(share);
            tracing::info!(
                device_share_mib = share >> 20,
                "GPU share of KV caches decided; caches beyond it go to the host KV pool"
            );
        }
        let counters = Arc::clone(&state.counters);
        let device_bytes = counters.device_bytes.load(Ordering::Relaxed);
        let device = || {
            counters.device_caches.fetch_add(1, Ordering::Relaxed);
            counters.device_bytes.fetch_add(bytes, Ordering::Relaxed);
            KvPlace::Device(KvPlacementToken::Device {
                counters: Arc::clone(&counters),
                bytes,
            })
        };
        if device_bytes.saturating_add(bytes) <= share {
            return Ok(device());
        }
        let aligned = buffer_bytes.next_multiple_of(ALIGN);
        let Some((offset, leased)) = state.pool.allocate(2 * aligned) else {
            // The pool is full too: the GPU, as without a pool.
            return Ok(device());
        };
        let pool = Arc::clone(&state.pool);
        drop(slot);
        let placement = KvPlacementToken::Host {
            counters: Arc::clone(&counters),
            pool: Arc::clone(&pool),
            offset,
            bytes: leased,
        };
        counters.host_caches.fetch_add(1, Ordering::Relaxed);
        counters
            .host_bytes
            .fetch_add(leased as u64, Ordering::Relaxed);
        let keys_at = pool.device + offset as u64;
        let values_at = keys_at + aligned as u64;
        // The region may hold an earlier cache's values: zero it, in stream order.
        // SAFETY: the range lies inside the live mapping (`allocate` checked it).
        let status =
            unsafe { sys::cuMemsetD8Async(keys_at, 0, 2 * aligned, self.stream.cu_stream()) };
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Driver {
                what: "clearing a host KV cache".into(),
                message: format!("{status:?}"),
            });
        }
        // SAFETY: both ranges lie inside the pool's device mapping, each `count` elements, and
        // the cache never frees them (`Drop for CudaKvCache` leaks host-placed buffers; the
        // token returns the range to the pool).
        let (keys, values) = unsafe {
            match dtype {
                KvDtype::F32 => (
                    KvBuffer::F32(self.stream.upgrade_device_ptr(keys_at, count)),
                    KvBuffer::F32(self.stream.upgrade_device_ptr(values_at, count)),
                ),
                KvDtype::Bf16 => (
                    KvBuffer::Bf16(self.stream.upgrade_device_ptr(keys_at, count)),
                    KvBuffer::Bf16(self.stream.upgrade_device_ptr(values_at, count)),
                ),
            }
        };
        Ok(KvPlace::Host(CudaKvCache {
            max_tokens,
            kv_width,
            len: 0,
            dtype,
            keys: std::mem::ManuallyDrop::new(keys),
            values: std::mem::ManuallyDrop::new(values),
            placement,
        }))
    }
}
