//! The per-forward decision for the backend's hand-off to the expert workers: whether this
//! forward's routed experts go to the workers straight from the device.
//!
//! Owns: that decision and its fallback. Must not touch: the hand-off's buffers
//! (`worker_handoff.rs`).

use crate::backend::WorkerHandoffFailure;
use std::sync::atomic::Ordering;

use super::HandoffInUse;
use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::Model;
use crate::profile::PhaseTotals;

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
    pub(in crate::model) fn ready_worker_handoff(
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
        let later = self.later_stage_handoffs();
        for (backend, stage) in self.later_stage_backends().iter().zip(later) {
            backend.set_worker_handoff_owners(&stage.handoff, &owned)?;
        }
        Ok(Some(HandoffInUse {
            handoff: &state.handoff,
            later,
            compute_before: self.experts.compute_nanos(),
        }))
    }

    /// After a forward that used the hand-off (its ops queued, no step graph recording): waits
    /// for it, fails the forward if a hand-off failed, and counts the workers' compute time.
    /// With the device driving the hand-off, the host cannot tell the workers' compute from
    /// the channel's share of the wait, so both count as compute.
    pub(in crate::model) fn finish_worker_handoff(
        &self,
        in_use: HandoffInUse<'_, B>,
        tally: &mut PhaseTotals,
    ) -> Result<(), EngineError> {
        // Every stage's word is read (and cleared); the first failure is the step's.
        let mut failed = self.backend.take_worker_handoff_failure(in_use.handoff)?;
        for (backend, stage) in self.later_stage_backends().iter().zip(in_use.later) {
            let later = backend.take_worker_handoff_failure(&stage.handoff)?;
            failed = failed.or(later);
        }
        if let Some(failure) = failed {
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
