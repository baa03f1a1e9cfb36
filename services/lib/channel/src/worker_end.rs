//! The worker's end of the channel: it attaches to the segment, beats its heartbeat, takes the
//! next request and answers it.
//!
//! Owns: [`WorkerChannel`]. Must not touch: the engine's end (`engine_end.rs`).

use std::ffi::CString;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::mman::shm_open;
use nix::sys::stat::Mode;

use crate::doorbell::{futex_wait, futex_wake, monotonic_nanos, request_spin_for};
use crate::layout::{
    ChannelGeometry, Request, SegmentHeader, ERROR_TEXT_BYTES, HEADER_BYTES, MAGIC,
};
use crate::segments::{map_segment, system, Mapping};
use crate::ChannelError;

/// The worker's end: attaches to a segment the engine created.
pub struct WorkerChannel {
    mapping: Mapping,
    /// Where the next scan starts (round robin); only the serving thread moves it.
    next_slot: AtomicU32,
}

impl WorkerChannel {
    /// Opens and maps `/NAME`, checking it is a channel whose hidden size is `hidden_size`.
    pub fn attach(name: &str, hidden_size: u32) -> Result<Self, ChannelError> {
        let c_name = CString::new(name).map_err(|_| ChannelError::Geometry {
            name: name.into(),
            problem: "name contains a NUL byte".into(),
        })?;
        let fd = shm_open(c_name.as_c_str(), OFlag::O_RDWR, Mode::empty())
            .map_err(system(name, "opening"))?;
        let length = nix::sys::stat::fstat(&fd)
            .map_err(system(name, "reading size"))?
            .st_size as usize;
        if length < HEADER_BYTES {
            return Err(ChannelError::NotAChannel { name: name.into() });
        }
        let base = map_segment(name, &fd, length)?;
        // SAFETY: at least HEADER_BYTES are mapped; the engine wrote the header before sending
        // us the name.
        let header = unsafe { &*(base.as_ptr() as *const SegmentHeader) };
        let geometry = ChannelGeometry {
            slot_count: header.slot_count,
            max_tokens: header.max_tokens,
            hidden_size: header.hidden_size,
            max_top_k: header.max_top_k,
        };
        let mapping = Mapping {
            name: name.to_string(),
            base,
            length,
            geometry,
        };
        if header.magic != MAGIC
            || header.slot_stride != geometry.slot_stride() as u64
            || geometry.segment_bytes() > length
        {
            return Err(ChannelError::NotAChannel { name: name.into() });
        }
        if geometry.hidden_size != hidden_size {
            return Err(ChannelError::Geometry {
                name: name.into(),
                problem: format!(
                    "hidden size {} but this worker's model has {hidden_size}",
                    geometry.hidden_size
                ),
            });
        }
        header
            .worker_pid
            .store(std::process::id(), Ordering::Release);
        header.attach_generation.fetch_add(1, Ordering::AcqRel);
        Ok(WorkerChannel {
            mapping,
            next_slot: AtomicU32::new(0),
        })
    }

    pub fn name(&self) -> &str {
        &self.mapping.name
    }

    pub fn geometry(&self) -> ChannelGeometry {
        self.mapping.geometry
    }

    /// Bumps the liveness counter the engine watches.
    pub fn beat(&self) {
        self.mapping
            .header()
            .heartbeat
            .fetch_add(1, Ordering::Release);
    }

    /// Whether the engine asked for spinning until a time not yet reached.
    pub(crate) fn spinning_requested(&self) -> bool {
        let until = self
            .mapping
            .header()
            .spin_until_nanos
            .load(Ordering::Relaxed);
        until != 0 && monotonic_nanos() < until
    }

    pub(crate) fn pending(&self, slot: u32) -> bool {
        let header = self.mapping.slot_header(slot);
        header.request_sequence.load(Ordering::Acquire)
            != header.response_sequence.load(Ordering::Acquire)
    }

    /// The next posted request, in slot order, waiting at most `timeout` (spin, then futex).
    pub fn next_request(&self, timeout: Duration) -> Option<(u32, Request<'_>)> {
        let segment = self.mapping.header();
        let slots = self.mapping.geometry.slot_count;
        let started = Instant::now();
        let spin = request_spin_for();
        let slot = 'found: loop {
            let start = self.next_slot.load(Ordering::Relaxed);
            for offset in 0..slots {
                let slot = (start + offset) % slots;
                if self.pending(slot) {
                    break 'found slot;
                }
            }
            let elapsed = started.elapsed();
            if elapsed >= timeout {
                return None;
            }
            if elapsed < spin || self.spinning_requested() {
                std::hint::spin_loop();
                continue;
            }
            segment.worker_sleeping.store(1, Ordering::SeqCst);
            let observed = segment.doorbell.load(Ordering::SeqCst);
            if !(0..slots).any(|slot| self.pending(slot)) {
                futex_wait(
                    &segment.doorbell,
                    observed,
                    (timeout - elapsed).min(Duration::from_millis(50)),
                );
            }
            segment.worker_sleeping.store(0, Ordering::SeqCst);
        };
        self.next_slot.store((slot + 1) % slots, Ordering::Relaxed);
        let geometry = self.mapping.geometry;
        // SAFETY: the request is published (Acquire in `pending`); the engine will not write this
        // slot again until we answer it. Counts are clamped to the slot's capacity here, so the
        // slices stay inside the slot even if the posted counts are corrupt; the caller checks
        // them against the model and refuses bad requests.
        unsafe {
            let raw = self.mapping.slot_header_mut(slot);
            let token_count = (*raw).token_count;
            let top_k = (*raw).top_k;
            let tokens = (token_count.min(geometry.max_tokens)) as usize;
            let k = (top_k.min(geometry.max_top_k)) as usize;
            Some((
                slot,
                Request {
                    layer: (*raw).layer,
                    token_count,
                    top_k,
                    expert_ids: std::slice::from_raw_parts(self.mapping.ids_ptr(slot), tokens * k),
                    routing_weights: std::slice::from_raw_parts(
                        self.mapping.weights_ptr(slot),
                        tokens * k,
                    ),
                    hidden: std::slice::from_raw_parts(
                        self.mapping.hidden_ptr(slot),
                        tokens * geometry.hidden_size as usize,
                    ),
                },
            ))
        }
    }

    /// The output area of `slot` (`[max_tokens, hidden]`), to be filled before `complete`.
    ///
    /// # Safety
    /// Only between `next_request` returning this slot and `complete` for it, and not while a
    /// `Request` read from the same slot is used to write (the areas are disjoint, so reading the
    /// view while writing here is fine).
    // The output lives in shared memory, not in `self`: the slot protocol, not the borrow of
    // `self`, is what makes the access exclusive (hence `unsafe` and the contract above).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn output_mut(&self, slot: u32) -> &mut [f32] {
        let geometry = self.mapping.geometry;
        std::slice::from_raw_parts_mut(
            self.mapping.output_ptr(slot),
            geometry.max_tokens as usize * geometry.hidden_size as usize,
        )
    }

    /// Publishes the answer to the request on `slot`: `Ok` or a refusal with a reason.
    pub fn complete(&self, slot: u32, result: Result<(), &str>) {
        self.complete_timed(slot, result, Duration::ZERO);
    }

    /// [`Self::complete`], also telling the engine how long computing the answer took.
    pub fn complete_timed(&self, slot: u32, result: Result<(), &str>, compute: Duration) {
        let header = self.mapping.slot_header(slot);
        let sequence = header.request_sequence.load(Ordering::Acquire);
        // SAFETY: we own the slot's response half until the Release store below.
        unsafe {
            let raw = self.mapping.slot_header_mut(slot);
            (*raw).compute_nanos = u64::try_from(compute.as_nanos()).unwrap_or(u64::MAX);
            self.mapping
                .header()
                .compute_nanos_total
                .fetch_add((*raw).compute_nanos, Ordering::Relaxed);
            match result {
                Ok(()) => {
                    (*raw).status = 0;
                    (*raw).error_length = 0;
                }
                Err(text) => {
                    let bytes = text.as_bytes();
                    let length = bytes.len().min(ERROR_TEXT_BYTES);
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        (*raw).error_text.as_mut_ptr(),
                        length,
                    );
                    (*raw).error_length = length as u32;
                    (*raw).status = 1;
                }
            }
        }
        header.response_sequence.store(sequence, Ordering::Release);
        if header.engine_waiting.load(Ordering::SeqCst) != 0 {
            futex_wake(&header.response_sequence);
        }
    }
}
