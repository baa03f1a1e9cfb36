//! Device buffers of dropped tensors, kept for the next op that asks for the same length.
//!
//! A decode step runs the same few dozen ops with the same shapes layer after layer; without
//! this each op's output cost a stream-ordered allocation, a memset and, when the tensor died,
//! a stream-ordered free — three driver calls around one launch, which made the decode step
//! bound by the host (measured on the H200: ~13 ms of a 14 ms token with every expert on the
//! GPU). A recycled buffer costs a lock and a vector pop.
//!
//! Safety of reuse: every op of a [`CudaBackend`](super::CudaBackend) is queued on its one
//! stream, so a kernel queued after a buffer came back here runs after every kernel and copy
//! queued before, the same ordering `cuMemFreeAsync` gives. A pool belongs to one backend
//! (one stream) and its buffers never reach another.
//!
//! Owns: the free lists and their byte bound. Must not touch: what the buffers hold (a
//! recycled buffer is uninitialised as far as its next user knows).

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::CudaSlice;

/// Largest buffer kept (floats): decode shapes and the logits of a big vocabulary fit; a long
/// prompt's activations are freed as before (prefill is bound by the GPU, not the host).
const POOL_MAX_FLOATS: usize = 1 << 20;
/// Most bytes held by the free lists together.
const POOL_MAX_BYTES: usize = 512 << 20;

#[derive(Default)]
pub(crate) struct TensorPool {
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    free: HashMap<usize, Vec<CudaSlice<f32>>>,
    bytes: usize,
}

impl TensorPool {
    /// A free buffer of exactly `len` floats, if one is kept (contents unspecified).
    pub(crate) fn take(&self, len: usize) -> Option<CudaSlice<f32>> {
        let mut state = self.state.lock().ok()?;
        let buffer = state.free.get_mut(&len)?.pop()?;
        state.bytes -= len * 4;
        Some(buffer)
    }

    /// Keeps `buffer` for a later [`TensorPool::take`], or frees it (stream-ordered) when it is
    /// too big or the pool is full.
    pub(crate) fn give_back(&self, buffer: CudaSlice<f32>) {
        let len = buffer.len();
        if len > POOL_MAX_FLOATS {
            return;
        }
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if state.bytes + len * 4 > POOL_MAX_BYTES {
            return;
        }
        state.bytes += len * 4;
        state.free.entry(len).or_default().push(buffer);
    }
}
