//! A tensor crossing from one backend's stream to another's on the same GPU (a layer split's
//! stages on one card share its primary context): one device-to-device copy ordered by events,
//! instead of a round trip through the host. Backends on different cards keep the host path
//! (`Backend::move_tensor_to`'s default) until peer copies are built.
//!
//! Ordering: the copy runs on the target's stream after everything the source stream queued
//! so far (which wrote the tensor); the source stream then waits for the copy before its next
//! work, so a buffer the source's pool hands out again is not overwritten while the copy reads it.

use super::super::CudaError;
use super::{driver_error, CudaBackend, CudaTensor};

impl CudaBackend {
    /// `tensor` copied onto `target`'s stream and pool, or `None` where the two backends do
    /// not share a context (nothing queued).
    pub(super) fn move_tensor_on_device(
        &self,
        tensor: &CudaTensor,
        target: &CudaBackend,
    ) -> Result<Option<CudaTensor>, CudaError> {
        if self.stream.context() != target.stream.context() {
            return Ok(None);
        }
        let mut moved = target.output_uninit(tensor.rows, tensor.cols)?;
        let len = (tensor.rows * tensor.cols).max(1);
        let written = self.stream.record_event(None).map_err(driver_error(
            "marking the tensor's writes for another stage",
        ))?;
        target
            .stream
            .wait(&written)
            .map_err(driver_error("ordering a stage crossing after its writes"))?;
        target
            .stream
            .memcpy_dtod(
                &tensor.data.slice(0..len),
                &mut moved.data.slice_mut(0..len),
            )
            .map_err(driver_error("copying a tensor to the next stage"))?;
        let read = target
            .stream
            .record_event(None)
            .map_err(driver_error("marking a stage crossing's copy"))?;
        self.stream
            .wait(&read)
            .map_err(driver_error("ordering the source stage after its crossing"))?;
        Ok(Some(moved))
    }
}
