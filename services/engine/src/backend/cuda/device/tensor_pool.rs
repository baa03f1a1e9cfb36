//! Device buffers of dropped tensors, kept for the next op that asks for the same length.
//!
//! A decode step runs the same few dozen ops with the same shapes layer after layer; without
//! this each op's output cost a stream-ordered allocation, a memset and, when the tensor died,
//! a stream-ordered free — three driver calls around one launch, which made the decode step
//! bound by the host. A recycled buffer costs a lock and a vector pop.
//!
//! Safety of reuse: every op of a [`CudaBackend`](super::CudaBackend) is queued on its one
//! stream, so a kernel queued after a buffer came back here runs after every kernel and copy
//! queued before, the same ordering `cuMemFreeAsync` gives. A pool belongs to one backend
//! (one stream) and its buffers never reach another.
//!
//! Owns: the free lists, their byte bound and what is evicted to keep it. Must not touch: what
//! the buffers hold (a recycled buffer is uninitialised as far as its next user knows).

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::CudaSlice;

/// Largest buffer kept (floats): decode shapes and the logits of a big vocabulary fit; a long
/// prompt's activations are freed as before (prefill is bound by the GPU, not the host).
const POOL_MAX_FLOATS: usize = 1 << 20;
/// Most bytes held by the free lists together (inside the 1 GiB of working memory that
/// `--gpu-mem-budget` leaves).
const POOL_MAX_BYTES: usize = 256 << 20;

/// What the pool keeps: anything that knows its length in floats.
pub(crate) trait PooledBuffer {
    fn floats(&self) -> usize;
}

impl PooledBuffer for CudaSlice<f32> {
    fn floats(&self) -> usize {
        self.len()
    }
}

/// Free buffers by length, at most `max_bytes` of them.
pub(crate) struct RecyclePool<B> {
    state: Mutex<PoolState<B>>,
    max_floats: usize,
    max_bytes: usize,
}

/// The CUDA backend's pool of op outputs.
pub(crate) type TensorPool = RecyclePool<CudaSlice<f32>>;

struct PoolState<B> {
    free: HashMap<usize, Vec<B>>,
    bytes: usize,
}

impl Default for TensorPool {
    fn default() -> Self {
        RecyclePool::new(POOL_MAX_FLOATS, POOL_MAX_BYTES)
    }
}

impl<B: PooledBuffer> RecyclePool<B> {
    pub(crate) fn new(max_floats: usize, max_bytes: usize) -> Self {
        RecyclePool {
            state: Mutex::new(PoolState {
                free: HashMap::new(),
                bytes: 0,
            }),
            max_floats,
            max_bytes,
        }
    }

    /// A free buffer of exactly `len` floats, if one is kept (contents unspecified).
    pub(crate) fn take(&self, len: usize) -> Option<B> {
        let mut state = self.state.lock().ok()?;
        let buffer = state.free.get_mut(&len)?.pop()?;
        state.bytes -= len * 4;
        Some(buffer)
    }

    /// Keeps `buffer` for a later [`RecyclePool::take`], or lets it go (freed) when it is
    /// bigger than the pool keeps. When the pool is full, buffers of other lengths are let go
    /// first: lengths a past prompt used must not crowd out the ones every decode step asks
    /// for.
    pub(crate) fn give_back(&self, buffer: B) {
        let len = buffer.floats();
        let bytes = len * 4;
        if len > self.max_floats || bytes > self.max_bytes {
            return;
        }
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if state.bytes + bytes > self.max_bytes {
            let state = &mut *state;
            let lengths: Vec<usize> = state.free.keys().copied().filter(|&l| l != len).collect();
            for other in lengths {
                if let Some(buffers) = state.free.remove(&other) {
                    state.bytes -= buffers.len() * other * 4;
                }
                if state.bytes + bytes <= self.max_bytes {
                    break;
                }
            }
            if state.bytes + bytes > self.max_bytes {
                // Only buffers of this very length are held: enough of them.
                return;
            }
        }
        state.bytes += bytes;
        state.free.entry(len).or_default().push(buffer);
    }

    /// Bytes the free lists hold.
    #[cfg(test)]
    fn held_bytes(&self) -> usize {
        self.state.lock().map(|state| state.bytes).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl PooledBuffer for Vec<f32> {
        fn floats(&self) -> usize {
            self.len()
        }
    }

    #[test]
    fn buffers_come_back_by_exact_length_within_the_bounds() {
        let pool: RecyclePool<Vec<f32>> = RecyclePool::new(100, 1000);
        assert!(pool.take(10).is_none());
        pool.give_back(vec![1.0; 10]);
        pool.give_back(vec![2.0; 10]);
        assert_eq!(pool.held_bytes(), 80);
        assert!(
            pool.take(11).is_none(),
            "only the exact length is handed out"
        );
        assert_eq!(pool.take(10).map(|b| b.len()), Some(10));
        assert_eq!(pool.held_bytes(), 40);
        // Bigger than the pool keeps: let go.
        pool.give_back(vec![0.0; 101]);
        assert!(pool.take(101).is_none());
        assert_eq!(pool.held_bytes(), 40);
    }

    #[test]
    fn a_full_pool_lets_other_lengths_go_first() {
        // Room for 250 floats.
        let pool: RecyclePool<Vec<f32>> = RecyclePool::new(100, 1000);
        pool.give_back(vec![0.0; 90]); // a past prompt's length
        pool.give_back(vec![0.0; 80]);
        pool.give_back(vec![0.0; 50]);
        assert_eq!(pool.held_bytes(), 880);
        // A decode length arrives with no room: the other lengths go until it fits.
        pool.give_back(vec![0.0; 40]);
        assert!(pool.held_bytes() <= 1000);
        assert!(pool.take(40).is_some(), "the newest length is kept");
        // Filling the pool with one length stops at the bound without evicting itself.
        for _ in 0..30 {
            pool.give_back(vec![0.0; 20]);
        }
        assert!(pool.held_bytes() <= 1000);
        let mut kept = 0;
        while pool.take(20).is_some() {
            kept += 1;
        }
        assert!(
            kept >= 1 && kept * 80 <= 1000,
            "{kept} buffers of 20 floats kept"
        );
    }
}
