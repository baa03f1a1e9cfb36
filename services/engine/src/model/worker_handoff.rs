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
//!
//! Owns: the backend's hand-off object and its on/off switch, the per-forward readiness check,
//! the failure check and the expert time it counts.
//! Must not touch: the channel protocol, worker supervision (the executor), the route choice of
//! a layer (`crate::moe::layer`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ninfer_artifact::CommonConfig;

use super::Model;
use crate::backend::{Backend, WorkerHandoffFailure};
use crate::error::EngineError;
use crate::moe::executor::ExpertExecutor;
use crate::profile::PhaseTotals;

/// Most rows a forward hands off through the backend: decode batches. Bigger batches are
/// prefill, whose hand-offs the host chunks to the channel's size.
pub(super) const MOST_HANDOFF_ROWS: usize = 64;

/// The backend's hand-off object and whether forwards may use it.
pub(super) struct BackendHandoff<B: Backend> {
    handoff: B::WorkerHandoff,
    /// The smaller of [`MOST_HANDOFF_ROWS`] and the channels' rows per request.
    most_rows: usize,
    on: AtomicBool,
}

/// A forward's use of the hand-off: the object, and the workers' compute time before it.
pub(super) struct HandoffInUse<'a, B: Backend> {
    pub handoff: &'a B::WorkerHandoff,
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

impl<B: Backend> Model<B> {
    /// Turns the backend's own hand-off to the workers on (the default, where there is one) or
    /// off (the host hands every layer off; the tests compare the two).
    pub fn set_worker_handoff(&self, on: bool) {
        if let Some(state) = &self.worker_handoff {
            state.on.store(on, Ordering::Relaxed);
        }
    }

    /// Whether forwards may hand layers to the workers through the backend.
    pub fn worker_handoff_on(&self) -> bool {
        self.worker_handoff
            .as_ref()
            .is_some_and(|state| state.on.load(Ordering::Relaxed))
    }

    /// The hand-off a forward of `rows` rows uses, with the workers readied for it, or `None`
    /// (see the module doc).
    pub(super) fn ready_worker_handoff(
        &self,
        rows: usize,
    ) -> Result<Option<HandoffInUse<'_, B>>, EngineError> {
        let Some(state) = &self.worker_handoff else {
            return Ok(None);
        };
        if !state.on.load(Ordering::Relaxed) || rows == 0 || rows > state.most_rows {
            return Ok(None);
        }
        // Offloaded dense MLPs go to the same workers' channels from the host, which must not
        // race the backend's posts.
        if self.moe_layers().all(|layer| layer.every_expert_resident())
            || self.offloaded_dense_mlp_layers() > 0
        {
            return Ok(None);
        }
        let Some(owned) = self
            .experts
            .worker_channels()
            .and_then(|channels| channels.prepare_backend_handoff())
        else {
            return Ok(None);
        };
        self.backend
            .set_worker_handoff_owners(&state.handoff, &owned)?;
        Ok(Some(HandoffInUse {
            handoff: &state.handoff,
            compute_before: self.experts.compute_nanos(),
        }))
    }

    /// After a forward that used the hand-off (its ops queued, no step graph recording): waits
    /// for it, fails the forward if a hand-off failed, and counts the workers' compute time.
    /// With the device driving the hand-off, the host cannot tell the workers' compute from
    /// the channel's share of the wait, so both count as compute.
    pub(super) fn finish_worker_handoff(
        &self,
        in_use: HandoffInUse<'_, B>,
        tally: &mut PhaseTotals,
    ) -> Result<(), EngineError> {
        if let Some(failure) = self.backend.take_worker_handoff_failure(in_use.handoff)? {
            let channels = self.experts.worker_channels();
            let address =
                |worker: usize| channels.map_or_else(String::new, |c| c.worker_address(worker));
            return Err(match failure {
                WorkerHandoffFailure::Refused { worker, layer } => EngineError::ExpertExecutor {
                    executor: format!("remote worker {}", address(worker)),
                    layer,
                    problem: channels
                        .and_then(|c| c.refusal(worker))
                        .unwrap_or_else(|| "the worker refused the request".into()),
                },
                WorkerHandoffFailure::Abandoned { worker, layer } => EngineError::ExpertExecutor {
                    executor: format!("remote worker {}", address(worker)),
                    layer,
                    problem: "the worker did not come back within --worker-timeout".into(),
                },
            });
        }
        if let (Some(before), Some(after)) = (in_use.compute_before, self.experts.compute_nanos()) {
            let computed = after.saturating_sub(before);
            tally.expert_compute_nanos += computed;
            tally.expert_wait_nanos += computed;
            self.profile.note_compute_reported();
        }
        Ok(())
    }
}
