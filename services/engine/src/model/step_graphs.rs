//! Decode steps through the backend's step graphs ([`Backend::begin_step_graph`]): a batch of
//! one-token sequences that decodes step after step gets one graph, which runs the step's ops
//! in the graph's shape once, records them the next step, and replays them from then on.
//!
//! A model split over pipeline stages records one graph per batch over all its stages: the
//! first stage's graph records and replays, and each later stage has a graph of its own for its
//! part's buffers (`Backend::begin_split_step_graph`); a step counts once in
//! [`StepGraphCounts`] however many stages it spans.
//!
//! Only steps the host has no part in inside the forward go through a graph: every row one new
//! token, and every MoE layer's routed experts resident (nothing for the expert executor) or
//! handed to the workers by the backend itself (`super::worker_handoff`). A
//! graph is keyed by its sequences' graph keys in batch order, so a batch that changes (a
//! sequence joins, leaves or is restored to a checkpoint) gets a new one; the least recently
//! used of at most [`MOST_STEP_GRAPHS`] is dropped.
//!
//! Owns: which steps use a graph, the graphs per batch, the recorded step's outputs, and the
//! host bookkeeping a replay skips (positions, routing counts, the profile).
//! Must not touch: how a backend records or replays.

use std::sync::atomic::{AtomicU64, Ordering};

mod replay;

use crate::backend::Backend;
use crate::moe::layer::DeferredRouting;

/// Step graphs kept at once (one per batch of sequences seen decoding recently).
pub(super) const MOST_STEP_GRAPHS: usize = 8;

static NEXT_GRAPH_KEY: AtomicU64 = AtomicU64::new(1);

/// A key no other sequence state has had.
pub(super) fn new_graph_key() -> u64 {
    NEXT_GRAPH_KEY.fetch_add(1, Ordering::Relaxed)
}

/// The model's step graphs.
pub(super) struct StepGraphs<B: Backend> {
    entries: Vec<StepGraphEntry<B>>,
    /// Counts lookups, to find the least recently used entry.
    clock: u64,
    /// The backend has no step graphs, or they were turned off ([`Model::set_step_graphs`]).
    off: bool,
    counts: StepGraphCounts,
    /// Why the last recording failed.
    last_abandoned: Option<String>,
}

/// How decode steps went through step graphs so far ([`Model::step_graph_counts`]); a step of
/// a split model counts once, however many stages its graph spans.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepGraphCounts {
    /// Steps run in a graph's shape before recording.
    pub shaped: u64,
    /// Steps recorded (and run once).
    pub recorded: u64,
    /// Steps replayed.
    pub replayed: u64,
    /// Recordings whose capture something broke, tried again later.
    pub interrupted: u64,
    /// Recordings that failed for good (those batches run op by op).
    pub abandoned: u64,
}

impl<B: Backend> Default for StepGraphs<B> {
    fn default() -> Self {
        StepGraphs {
            entries: Vec::new(),
            clock: 0,
            off: false,
            counts: StepGraphCounts::default(),
            last_abandoned: None,
        }
    }
}

struct StepGraphEntry<B: Backend> {
    keys: Vec<u64>,
    /// `None`: recording failed or an op failed; this batch runs op by op.
    graph: Option<B::StepGraph>,
    /// A split model's later stages' graphs, in stage order (none unsplit): each holds the
    /// buffers of its stage's part of the step, which `graph`'s recording spans.
    later_stages: Vec<B::StepGraph>,
    /// The recorded step's outputs, which every replay rewrites: the logits, and the routings
    /// of the MoE layers (finished by the host after each replay, to count them).
    recorded: Option<(B::Tensor, Vec<DeferredRouting<B>>)>,
    last_used: u64,
}
