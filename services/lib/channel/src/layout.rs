//! The byte layout of the shared segment: its header, the slot headers, the slots' arrays and
//! where each lies (see the crate doc for the picture and the protocol).
//!
//! Owns: the layout's one definition, its magic and sizes. Must not touch: the protocol's steps
//! (the engine and worker ends).

use std::sync::atomic::{AtomicU32, AtomicU64};

pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"NICHAN03");

pub(crate) const HEADER_BYTES: usize = 4096;

pub(crate) const SLOT_HEADER_BYTES: usize = 256;

pub(crate) const ERROR_TEXT_BYTES: usize = 192;

/// Sizes of a channel; fixed at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelGeometry {
    pub slot_count: u32,
    pub max_tokens: u32,
    pub hidden_size: u32,
    pub max_top_k: u32,
}

impl ChannelGeometry {
    pub(crate) fn slot_stride(&self) -> usize {
        let entries = self.max_tokens as usize * self.max_top_k as usize;
        let vectors = self.max_tokens as usize * self.hidden_size as usize;
        (SLOT_HEADER_BYTES + entries * 8 + vectors * 8).next_multiple_of(4096)
    }

    pub(crate) fn segment_bytes(&self) -> usize {
        HEADER_BYTES + self.slot_count as usize * self.slot_stride()
    }
}

/// Where the words of one slot and the hand-off words lie in a segment, in bytes from its start:
/// what a device-driven hand-off needs to post and collect requests through its own mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLayout {
    /// u32, written by the engine side last (the publication of a request).
    pub request_sequence: usize,
    /// u32, written by the worker last (the publication of an answer).
    pub response_sequence: usize,
    /// u32 each, written by the engine side before `request_sequence`.
    pub layer: usize,
    pub token_count: usize,
    pub top_k: usize,
    /// u32, 0 when the worker answered, else it refused (the error text is in the slot).
    pub status: usize,
    /// `[max_tokens, max_top_k]` u32, then the same of f32, then `[max_tokens, hidden]` f32 in,
    /// then the same out.
    pub expert_ids: usize,
    pub routing_weights: usize,
    pub hidden: usize,
    pub output: usize,
    /// u32 in the segment header (see the module doc).
    pub handoff_abort: usize,
}

/// A channel segment as mapped in the engine: its address, length, sizes and one slot's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentMemory {
    pub address: usize,
    pub length: usize,
    pub geometry: ChannelGeometry,
    pub slot: SlotLayout,
}

#[repr(C)]
pub(crate) struct SegmentHeader {
    pub(crate) magic: u64,
    pub(crate) slot_count: u32,
    pub(crate) max_tokens: u32,
    pub(crate) hidden_size: u32,
    pub(crate) max_top_k: u32,
    pub(crate) slot_stride: u64,
    /// Written by the worker when it attaches.
    pub(crate) worker_pid: AtomicU32,
    pub(crate) worker_sleeping: AtomicU32,
    /// Futex word the worker sleeps on; the engine bumps it after posting.
    pub(crate) doorbell: AtomicU32,
    /// Bumped by the worker when it attaches, so the engine sees a restart.
    pub(crate) attach_generation: AtomicU32,
    /// Bumped by a worker thread every few milliseconds while the process runs.
    pub(crate) heartbeat: AtomicU64,
    /// Written by the engine: until this `CLOCK_MONOTONIC` time (ns) the worker spins for its
    /// next request instead of sleeping (a device-driven hand-off cannot wake it).
    pub(crate) spin_until_nanos: AtomicU64,
    /// Written by the worker: nanoseconds spent computing answers, summed over its life.
    pub(crate) compute_nanos_total: AtomicU64,
    /// Written by the engine: non-zero releases a device waiting for an answer on this segment.
    pub(crate) handoff_abort: AtomicU32,
}

#[repr(C)]
pub(crate) struct SlotHeader {
    pub(crate) request_sequence: AtomicU32,
    pub(crate) response_sequence: AtomicU32,
    pub(crate) engine_waiting: AtomicU32,
    pub(crate) layer: u32,
    pub(crate) token_count: u32,
    pub(crate) top_k: u32,
    /// 0 = ok; otherwise the worker refused the request and wrote `error_text`.
    pub(crate) status: u32,
    pub(crate) error_length: u32,
    pub(crate) error_text: [u8; ERROR_TEXT_BYTES],
    /// Response half: nanoseconds the worker spent computing the answer (0 when it does not
    /// say), so the engine can split its wait into compute and channel time.
    pub(crate) compute_nanos: u64,
}

const _: () = assert!(std::mem::size_of::<SlotHeader>() <= SLOT_HEADER_BYTES);

const _: () = assert!(std::mem::size_of::<SegmentHeader>() <= HEADER_BYTES);

/// One request: as the engine posts it, and as the worker reads it back (then the counts are as
/// posted, so validate them before use; the slices are clamped to the slot).
pub struct Request<'a> {
    pub layer: u32,
    pub token_count: u32,
    pub top_k: u32,
    /// `[token_count, top_k]`; `ninfer_artifact::NO_EXPERT` for entries this worker does not own.
    pub expert_ids: &'a [u32],
    /// `[token_count, top_k]`.
    pub routing_weights: &'a [f32],
    /// `[token_count, hidden]`.
    pub hidden: &'a [f32],
}
