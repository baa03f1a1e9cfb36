//! The model's side of the backend's own hand-off to the expert workers
//! ([`Backend::post_to_workers`]): whether a forward uses it, readying the workers for it, and
//! turning a failed hand-off into the step's error.
//!
//! A forward uses it when the backend and the executor both have it, it is on
//! ([`Model::set_worker_handoff`]), the batch has at most [`MOST_HANDOFF_ROWS`] rows (decode
//! steps; a prompt's big batch goes through the host, which chunks it), some MoE layer has
//! experts outside the backend's slots, no dense MLP is offloaded to the workers (the host
//! posts those), and every worker is up with disjoint experts. Then each
//! such layer posts and collects on the backend, and the host waits once, at the forward's end.
//! A split model has one hand-off per stage (the later stages' kept with the stages): every
//! stage's owner table is set, each layer posts on its own stage, and every stage's failure
//! word is read at the end.
//!
//! Owns: the backend's hand-off object and its on/off switch, the per-forward readiness check,
//! the failure check and the expert time it counts.
//! Must not touch: the channel protocol, worker supervision (the executor), the route choice of
//! a layer (`crate::moe::layer`).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use ninfer_artifact::CommonConfig;

mod per_forward;

use crate::backend::Backend;
use crate::moe::executor::ExpertExecutor;

/// Most rows a forward hands off through the backend: decode batches. Bigger batches are
/// prefill, whose hand-offs the host chunks to the channel's size.
pub(super) const MOST_HANDOFF_ROWS: usize = 64;

/// The backend's hand-off object and whether forwards may use it (the first stage's flag
/// decides for every stage of a split).
pub(super) struct BackendHandoff<B: Backend> {
    pub(super) handoff: B::WorkerHandoff,
    /// The smaller of [`MOST_HANDOFF_ROWS`] and the channels' rows per request.
    most_rows: usize,
    on: AtomicBool,
}

/// A forward's use of the hand-off: the first stage's object (the only one unsplit), the later
/// stages' of a split, and the workers' compute time before it.
pub(super) struct HandoffInUse<'a, B: Backend> {
    pub handoff: &'a B::WorkerHandoff,
    pub later: &'a [BackendHandoff<B>],
    compute_before: Option<u64>,
}

impl<B: Backend> Clone for HandoffInUse<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for HandoffInUse<'_, B> {}

impl<B: Backend> BackendHandoff<B> {
    /// The hand-off, when `experts` runs in workers and `backend` can drive it; a backend that
    /// has one but cannot open it (e.g. the channels cannot be registered) leaves the host to
    /// hand off, with a warning.
    pub(super) fn open(
        backend: &B,
        experts: &Arc<dyn ExpertExecutor>,
        common: &CommonConfig,
    ) -> Option<Self> {
        let channels = experts.worker_channels()?;
        let memory = channels.channel_memory();
        let most_rows = memory
            .iter()
            .map(|segment| segment.geometry.max_tokens as usize)
            .min()?
            .min(MOST_HANDOFF_ROWS);
        let keep_alive: Box<dyn Send + Sync> = Box::new(Arc::clone(experts));
        match backend.new_worker_handoff(&memory, common.num_experts, keep_alive) {
            Ok(Some(handoff)) => {
                tracing::info!(
                    workers = memory.len(),
                    "MoE layers hand their CPU experts to the workers from the {} itself",
                    backend.name()
                );
                Some(BackendHandoff {
                    handoff,
                    most_rows,
                    on: AtomicBool::new(true),
                })
            }
            Ok(None) => None,
            Err(error) => {
                tracing::warn!(
                    "the {} cannot hand MoE layers to the workers itself ({error}); the host does",
                    backend.name()
                );
                None
            }
        }
    }
}
