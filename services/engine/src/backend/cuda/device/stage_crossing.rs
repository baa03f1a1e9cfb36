//! A tensor crossing from one pipeline stage's backend to the next one's, on the device: stages
//! of one card (sharing its primary context) copy within the context; stages on different
//! cards copy peer to peer (`cuMemcpyPeerAsync`, which goes over NVLink or PCIe where the cards
//! have peer access, else the driver stages it through host memory). Either way the copy is
//! queued, not waited for: no host round trip between stages.
//!
//! Ordering: the copy runs on the target's stream after everything the source stream queued
//! so far (which wrote the tensor); the source stream then waits for the copy before its next
//! work, so a buffer the source's pool hands out again is not overwritten while the copy reads it.
//! Events of one context may be waited for by a stream of another.
//!
//! Owns: the crossing copy, peer access between stages' cards. Must not touch: which stage
//! owns which layers (`crate::model`).

use std::sync::atomic::Ordering;

use cudarc::driver::{sys, DevicePtr, DevicePtrMut};

use super::super::CudaError;
use super::{driver_error, CudaBackend, CudaTensor};

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
    pub(super) fn move_tensor_on_device(
        &self,
        tensor: &CudaTensor,
        target: &CudaBackend,
    ) -> Result<CudaTensor, CudaError> {
        let mut moved = target.output_uninit(tensor.rows, tensor.cols)?;
        let len = (tensor.rows * tensor.cols).max(1);
        let written = self.stream.record_event(None).map_err(driver_error(
            "marking the tensor's writes for another stage",
        ))?;
        target
            .stream
            .wait(&written)
            .map_err(driver_error("ordering a stage crossing after its writes"))?;
        let same_context = self.stream.context() == target.stream.context();
        if same_context && !self.options.peer_stage_crossings {
            target
                .stream
                .memcpy_dtod(
                    &tensor.data.slice(0..len),
                    &mut moved.data.slice_mut(0..len),
                )
                .map_err(driver_error("copying a tensor to the next stage"))?;
        } else {
            let (source, _) = tensor.data.device_ptr(&self.stream);
            let (destination, _) = moved.data.device_ptr_mut(&target.stream);
            // SAFETY: both pointers hold `len` f32 (the source tensor's data and a buffer of
            // its shape) in the contexts named; the copy is queued on the target's stream after
            // the source's writes (the event above), and the source waits for it below before
            // its pool may hand the buffer out again.
            let status = unsafe {
                sys::cuMemcpyPeerAsync(
                    destination,
                    target.stream.context().cu_ctx(),
                    source,
                    self.stream.context().cu_ctx(),
                    len * std::mem::size_of::<f32>(),
                    target.stream.cu_stream(),
                )
            };
            if status != sys::CUresult::CUDA_SUCCESS {
                return Err(CudaError::Driver {
                    what: "copying a tensor to the next stage's card".into(),
                    message: format!("{status:?}"),
                });
            }
            self.peer_crossings.fetch_add(1, Ordering::Relaxed);
        }
        let read = target
            .stream
            .record_event(None)
            .map_err(driver_error("marking a stage crossing's copy"))?;
        self.stream
            .wait(&read)
            .map_err(driver_error("ordering the source stage after its crossing"))?;
        Ok(moved)
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
