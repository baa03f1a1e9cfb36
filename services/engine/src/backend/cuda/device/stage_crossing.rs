//! A tensor crossing from one pipeline stage's backend to the next one's, on the device: stages
//! of one card (sharing its primary context) copy within the context; stages on different
//! cards copy peer to peer (`cuMemcpyAsync` on the unified address space, which goes over NVLink
//! or PCIe where the cards have peer access, else the driver stages it through host memory; not
//! `cuMemcpyPeerAsync`, which a stream capture refuses, so a step graph over the stages could not
//! record it). Either way the copy is queued, not waited for: no host round trip between stages.
//!
//! Ordering: the copy runs on the target's stream after everything the source stream queued
//! so far (which wrote the tensor); the source stream then waits for the copy before its next
//! work, so a buffer the source's pool hands out again is not overwritten while the copy reads it.
//! Events of one context may be waited for by a stream of another (the driver allows it; the
//! waits go through `driver::wait_for_stream`, since cudarc's own refuses another context's
//! event).
//!
//! Owns: the crossing copy, peer access between stages' cards. Must not touch: which stage
//! owns which layers (`crate::model`).

use std::sync::atomic::Ordering;

use cudarc::driver::{sys, DevicePtr, DevicePtrMut};

use super::super::CudaError;
use super::{driver_error, wait_for_stream, CudaBackend, CudaTensor};

/// How two stages' cards reach each other's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerPath {
    /// One context: copies within it.
    SameContext,
    /// Peer access on both sides: copies go card to card.
    Direct,
    /// No peer access between the cards: the driver stages each copy through host memory.
    ThroughHost,
}

impl CudaBackend {
    /// `tensor` copied onto `target`'s stream and pool, ordered after the work that wrote it.
    /// Inside a step graph spanning stages (device/step_graph.rs) the copy is recorded with the
    /// rest of the step: both waits only join streams already in the capture, and the events
    /// are recorded within it.
    pub(super) fn move_tensor_on_device(
        &self,
        tensor: &CudaTensor,
        target: &CudaBackend,
    ) -> Result<CudaTensor, CudaError> {
        let mut moved = target.output_uninit(tensor.rows, tensor.cols)?;
        let len = (tensor.rows * tensor.cols).max(1);
        wait_for_stream(&target.stream, &self.stream)
            .map_err(driver_error("ordering a stage crossing after its writes"))?;
        let (source, _) = tensor.data.device_ptr(&self.stream);
        let (destination, _) = moved.data.device_ptr_mut(&target.stream);
        // SAFETY: both pointers hold `len` f32 (the source tensor's data and a buffer of its
        // shape) in their backends' contexts; the copy is queued on the target's stream after
        // the source's writes (the wait above), and the source waits for it below before its
        // pool may hand the buffer out again.
        let peer = unsafe {
            self.copy_to_stage(
                target,
                source,
                destination,
                len * std::mem::size_of::<f32>(),
            )?
        };
        if peer {
            self.peer_crossings.fetch_add(1, Ordering::Relaxed);
        }
        wait_for_stream(&self.stream, &target.stream)
            .map_err(driver_error("ordering the source stage after its crossing"))?;
        Ok(moved)
    }

    /// Queues on `target`'s stream a copy of `bytes` from `source` (this backend's memory) to
    /// `destination` (`target`'s): within the context where the two share one (unless
    /// `peer_stage_crossings`), else peer to peer. Says whether it was a peer copy.
    ///
    /// # Safety
    /// `source` must hold `bytes` in this backend's context and `destination` in `target`'s,
    /// both live until the copy has run, and `target`'s stream ordered after the writes of
    /// `source`.
    pub(super) unsafe fn copy_to_stage(
        &self,
        target: &CudaBackend,
        source: sys::CUdeviceptr,
        destination: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<bool, CudaError> {
        let same_context = self.stream.context() == target.stream.context();
        let peer = !same_context || self.options.peer_stage_crossings;
        target
            .stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the next stage's context"))?;
        // SAFETY: the caller's contract; both contexts are live (their streams are).
        let status = unsafe {
            match peer {
                false => {
                    sys::cuMemcpyDtoDAsync_v2(destination, source, bytes, target.stream.cu_stream())
                }
                // The unified address space says which card each pointer is on.
                true => sys::cuMemcpyAsync(destination, source, bytes, target.stream.cu_stream()),
            }
        };
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Driver {
                what: match peer {
                    false => "copying to the next stage".into(),
                    true => "copying to the next stage's card".into(),
                },
                message: format!("{status:?}"),
            });
        }
        Ok(peer)
    }

    /// Tensors this backend has sent to another stage by a peer copy (the split tests ask).
    pub fn peer_stage_crossings(&self) -> u64 {
        self.peer_crossings.load(Ordering::Relaxed)
    }

    /// Lets this backend's card and `peer`'s read each other's memory where the driver allows
    /// it, so the crossings between them go card to card; says which path they take.
    pub fn enable_peer_access(&self, peer: &CudaBackend) -> Result<PeerPath, CudaError> {
        let (mine, theirs) = (self.stream.context(), peer.stream.context());
        if mine == theirs {
            return Ok(PeerPath::SameContext);
        }
        let can_access = |from: sys::CUdevice, to: sys::CUdevice| -> Result<bool, CudaError> {
            let mut can = 0;
            // SAFETY: a valid out pointer; the devices come from live contexts.
            let status = unsafe { sys::cuDeviceCanAccessPeer(&mut can, from, to) };
            if status != sys::CUresult::CUDA_SUCCESS {
                return Err(CudaError::Driver {
                    what: "asking whether two cards reach each other's memory".into(),
                    message: format!("{status:?}"),
                });
            }
            Ok(can == 1)
        };
        if !can_access(mine.cu_device(), theirs.cu_device())?
            || !can_access(theirs.cu_device(), mine.cu_device())?
        {
            return Ok(PeerPath::ThroughHost);
        }
        for (from, to) in [(mine, theirs), (theirs, mine)] {
            from.bind_to_thread()
                .map_err(driver_error("binding a stage's context"))?;
            // SAFETY: `from` is current on this thread; `to` is a live context.
            let status = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
            let enabled = matches!(
                status,
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            );
            if !enabled {
                return Err(CudaError::Driver {
                    what: "enabling peer access between two stages' cards".into(),
                    message: format!("{status:?}"),
                });
            }
        }
        self._context
            .bind_to_thread()
            .map_err(driver_error("binding the backend's context"))?;
        Ok(PeerPath::Direct)
    }
}
