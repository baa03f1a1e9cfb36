//! Read-backs through one page-locked staging buffer: several device buffers copied with
//! async copies and one wait, instead of one synchronous pageable copy (and one wait) each.
//! The MoE layer's routing ids, routing weights and hidden states come back this way.
//!
//! Owns: the staging buffer (grown on demand, never shrunk) and its lock.
//! Must not touch: what the values are (callers decode the bytes).

use cudarc::driver::{sys, CudaSlice, DevicePtr};

use super::pinned_staging::PinnedStaging;
use super::{driver_error, CudaBackend, CudaError, CudaTensor};

/// Largest read-back that goes through the staging buffer.
pub(super) const STAGING_MAX_BYTES: usize = 64 << 20;

/// One device buffer to read back: its first `len` elements.
pub(super) enum ReadBack<'a> {
    F32(&'a CudaSlice<f32>, usize),
    /// u32 values kept in an f32 buffer (a recycled tensor buffer; any bits are valid in both).
    U32Bits(&'a CudaSlice<f32>, usize),
}

impl ReadBack<'_> {
    fn bytes(&self) -> usize {
        self.shape().bytes()
    }
}

/// The values read back, in the order asked.
pub(super) enum HostValues {
    F32(Vec<f32>),
    U32(Vec<u32>),
}

/// The element type and count of one part of a read-back, without its device buffer.
#[derive(Debug, Clone, Copy)]
pub(super) enum ReadBackShape {
    F32(usize),
    U32(usize),
}

impl ReadBack<'_> {
    pub(super) fn shape(&self) -> ReadBackShape {
        match self {
            ReadBack::F32(_, len) => ReadBackShape::F32(*len),
            ReadBack::U32Bits(_, len) => ReadBackShape::U32(*len),
        }
    }
}

impl ReadBackShape {
    fn bytes(&self) -> usize {
        match self {
            ReadBackShape::F32(len) | ReadBackShape::U32(len) => len * 4,
        }
    }
}

/// Each part's offset in a staging buffer (256-byte aligned, so every copy's destination is
/// aligned) and the bytes they take together.
pub(super) fn staging_layout(shapes: &[ReadBackShape]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(shapes.len());
    let mut total = 0usize;
    for shape in shapes {
        offsets.push(total);
        total += shape.bytes().div_ceil(256) * 256;
    }
    (offsets, total)
}

/// The values of the parts copied into `staging` at `offsets`.
///
/// # Safety
/// Every copy into `staging` at those offsets must have completed (a wait on the stream or on
/// an event recorded after the copies).
pub(super) unsafe fn decode_staged(
    staging: &PinnedStaging,
    shapes: &[ReadBackShape],
    offsets: &[usize],
) -> Vec<HostValues> {
    let mut values = Vec::with_capacity(shapes.len());
    for (shape, &offset) in shapes.iter().zip(offsets) {
        // SAFETY: [offset, offset + bytes) lies inside the allocation (staging_layout) and its
        // copy completed (the caller's contract).
        let bytes =
            unsafe { std::slice::from_raw_parts(staging.pointer.add(offset), shape.bytes()) };
        let words = bytes
            .chunks_exact(4)
            .map(|word| [word[0], word[1], word[2], word[3]]);
        values.push(match shape {
            ReadBackShape::F32(_) => HostValues::F32(words.map(f32::from_ne_bytes).collect()),
            ReadBackShape::U32(_) => HostValues::U32(words.map(u32::from_ne_bytes).collect()),
        });
    }
    values
}

impl CudaBackend {
    /// Every value of `tensor`, through the page-locked staging buffer.
    pub(super) fn download_values(&self, tensor: &CudaTensor) -> Result<Vec<f32>, CudaError> {
        let len = tensor.rows * tensor.cols;
        if len == 0 {
            return Ok(Vec::new());
        }
        let data = &*tensor.data;
        // Big read-backs (a prefill's logits) go straight to pageable memory rather than grow
        // the page-locked buffer for good.
        if len * 4 > STAGING_MAX_BYTES {
            let mut values = self
                .stream
                .memcpy_dtov(data)
                .map_err(driver_error("copying to the host"))?;
            values.truncate(len);
            return Ok(values);
        }
        match self.read_back_together(&[ReadBack::F32(data, len)])?.pop() {
            Some(HostValues::F32(values)) => Ok(values),
            _ => Err(CudaError::Invalid {
                problem: "a read-back came back in the wrong shape".into(),
            }),
        }
    }

    /// Queues a copy of every part into the staging buffer, waits once for the stream, and
    /// returns the parts' values.
    pub(super) fn read_back_together(
        &self,
        parts: &[ReadBack<'_>],
    ) -> Result<Vec<HostValues>, CudaError> {
        let shapes: Vec<ReadBackShape> = parts.iter().map(ReadBack::shape).collect();
        let (offsets, total) = staging_layout(&shapes);
        let mut slot = self.staging.lock().map_err(|_| CudaError::Invalid {
            problem: "the read-back staging buffer's lock is poisoned".into(),
        })?;
        if slot.as_ref().is_none_or(|staging| staging.bytes() < total) {
            // Free the old one first (no copy is pending: every use ends with a wait).
            *slot = None;
            let bytes = total.max(1 << 20).next_power_of_two();
            *slot = Some(PinnedStaging::allocate(&self._context, bytes)?);
        }
        let staging = slot.as_ref().ok_or_else(|| CudaError::Invalid {
            problem: "no read-back staging buffer".into(),
        })?;
        self.queue_read_backs(staging, parts, &offsets)?;
        self.stream
            .synchronize()
            .map_err(driver_error("waiting for the read-back"))?;
        // SAFETY: the copies completed (the wait above).
        Ok(unsafe { decode_staged(staging, &shapes, &offsets) })
    }

    /// Queues the device-to-host copy of every part into `staging` at `offsets` (from
    /// [`staging_layout`]); the caller waits before reading or reusing `staging`.
    pub(super) fn queue_read_backs(
        &self,
        staging: &PinnedStaging,
        parts: &[ReadBack<'_>],
        offsets: &[usize],
    ) -> Result<(), CudaError> {
        for (part, &offset) in parts.iter().zip(offsets) {
            let bytes = part.bytes();
            if bytes == 0 {
                continue;
            }
            if offset + bytes > staging.bytes() {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "a read-back of {bytes} bytes at {offset} overruns its {}-byte staging buffer",
                        staging.bytes()
                    ),
                });
            }
            let source = match part {
                ReadBack::F32(buffer, len) | ReadBack::U32Bits(buffer, len) => {
                    check_length(buffer.len(), *len)?;
                    buffer.device_ptr(&self.stream).0
                }
            };
            // SAFETY: destination inside the staging allocation (checked above); the source
            // holds at least `bytes` (checked above); the caller waits for the copy before the
            // host reads or the buffer is reused.
            let status = unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    staging.pointer.add(offset).cast(),
                    source,
                    bytes,
                    self.stream.cu_stream(),
                )
            };
            if status != sys::CUresult::CUDA_SUCCESS {
                return Err(CudaError::Driver {
                    what: "queueing a read-back copy".into(),
                    message: format!("{status:?}"),
                });
            }
        }
        Ok(())
    }
}

fn check_length(available: usize, wanted: usize) -> Result<(), CudaError> {
    if wanted > available {
        return Err(CudaError::Invalid {
            problem: format!("read-back of {wanted} values from a buffer of {available}"),
        });
    }
    Ok(())
}
