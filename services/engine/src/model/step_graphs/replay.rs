//! Decode steps through the step graphs: a batch's step recorded once and replayed, and the
//! expert cache's work kept outside any graph.
//!
//! Owns: when a step is recorded, replayed or run plainly. Must not touch: the graphs' storage
//! (`step_graphs.rs`), the ops.

use std::time::Instant;

use super::{StepGraphCounts, StepGraphEntry, StepGraphs, MOST_STEP_GRAPHS};
use crate::backend::Backend;
use crate::backend::{FollowingStepGraph, StepGraphEnd, StepGraphRun};
use crate::error::EngineError;
use crate::model::layers::{FeedForward, LayerScratch, LogitsSelection, SequenceInput};
use crate::model::Model;
use crate::moe::layer::DeferredRouting;
use crate::profile::PhaseTotals;

impl<B: Backend> Model<B> {
    /// Turns step graphs on (the default, where the backend has them) or off: with them off
    /// every decode step runs op by op (the tests compare the two).
    pub fn set_step_graphs(&self, on: bool) {
        if let Ok(mut graphs) = self.step_graphs.lock() {
            graphs.off = !on;
            if !on {
                graphs.entries.clear();
            }
        }
    }

    /// How decode steps went through step graphs so far.
    pub fn step_graph_counts(&self) -> StepGraphCounts {
        self.step_graphs
            .lock()
            .map(|graphs| graphs.counts)
            .unwrap_or_default()
    }

    /// Why the last recording of a step graph failed (abandoned or interrupted), if one did.
    pub fn step_graph_last_abandoned(&self) -> Option<String> {
        self.step_graphs
            .lock()
            .ok()
            .and_then(|graphs| graphs.last_abandoned.clone())
    }

    /// Whether the host has no part inside this batch's forward: one token per sequence, every
    /// MoE layer's routed experts resident or handed off by the backend, no dense MLP
    /// offloaded, and not a qwen4_exp model (its n-gram rows are gathered on the host and its
    /// QSA ops upload a row table per call, between the ops, which a recorded step would not
    /// repeat).
    pub(in crate::model) fn step_graph_fits(
        &self,
        batch: &[SequenceInput<'_, B>],
        backend_handoff: bool,
    ) -> bool {
        !batch.is_empty()
            && self.qwen4_exp.is_none()
            && batch.iter().all(|item| item.tokens.len() == 1)
            && (backend_handoff || self.moe_layers().all(|layer| layer.every_expert_resident()))
            && self.offloaded_dense_mlp_layers() == 0
    }

    /// A decode step of `batch` through its step graph, with the logits left on the output
    /// backend (as [`Model::forward_logits_on_backend`]); `None` when the step must run op by
    /// op (the batch does not fit a graph, the backend has none, or recording failed: then
    /// nothing ran and no state changed). A model split over several backends records one
    /// graph spanning every stage (the crossings between them recorded with the rest) and
    /// replays it with one launch on the first stage ([`Backend::begin_split_step_graph`]).
    pub(in crate::model) fn decode_through_step_graph(
        &self,
        batch: &mut [SequenceInput<'_, B>],
    ) -> Result<Option<B::Tensor>, EngineError> {
        let one_token_each = batch.iter().all(|item| item.tokens.len() == 1);
        let handoff = match one_token_each {
            true => self.ready_worker_handoff(batch.len())?,
            false => None,
        };
        if !self.step_graph_fits(batch, handoff.is_some()) {
            return Ok(None);
        }
        let mut graphs = self
            .step_graphs
            .lock()
            .map_err(|_| EngineError::InvalidConfig {
                problem: "the step graphs' lock is poisoned".into(),
            })?;
        if graphs.off {
            return Ok(None);
        }
        let plan = self.batch_plan(batch)?;
        if plan.has_images() {
            // Image rows replace embeddings and may turn by three streams: the plain forward.
            return Ok(None);
        }
        let keys: Vec<u64> = batch.iter().map(|item| item.state.graph_key).collect();
        let keys_len = keys.len();
        graphs.clock += 1;
        let now = graphs.clock;
        let index = match graphs.entries.iter().position(|entry| entry.keys == keys) {
            Some(index) => index,
            None => {
                let Some(graph) = self.backend.new_step_graph(keys.len())? else {
                    graphs.off = true;
                    return Ok(None);
                };
                let mut later_stages = Vec::new();
                for backend in self.later_stage_backends() {
                    let Some(graph) = backend.new_step_graph(keys.len())? else {
                        graphs.off = true;
                        return Ok(None);
                    };
                    later_stages.push(graph);
                }
                if graphs.entries.len() >= MOST_STEP_GRAPHS {
                    // A dropped graph's buffers may still be in use by a queued replay.
                    self.wait_for_every_stage()?;
                    if let Some(oldest) = (0..graphs.entries.len())
                        .min_by_key(|&index| graphs.entries[index].last_used)
                    {
                        graphs.entries.swap_remove(oldest);
                    }
                }
                graphs.entries.push(StepGraphEntry {
                    keys,
                    graph: Some(graph),
                    later_stages,
                    recorded: None,
                    last_used: now,
                });
                graphs.entries.len() - 1
            }
        };
        let StepGraphs {
            entries,
            counts,
            last_abandoned,
            ..
        } = &mut *graphs;
        let entry = &mut entries[index];
        entry.last_used = now;
        let StepGraphEntry {
            graph: Some(graph),
            later_stages,
            recorded,
            ..
        } = entry
        else {
            return Ok(None);
        };
        // A split model's later stages, each with its graph (none unsplit).
        let mut followers: Vec<FollowingStepGraph<'_, B>> = self
            .later_stage_backends()
            .iter()
            .zip(later_stages.iter_mut())
            .map(|(backend, graph)| FollowingStepGraph {
                backend: &**backend,
                graph,
            })
            .collect();
        let split = !followers.is_empty();
        let started = Instant::now();
        // Slot table changes happen before the graph (which reads the table): between the
        // steps, or queued behind the step before while it ran.
        self.expert_cache_between_steps()?;
        let backend = &*self.backend;
        let output = self.output_backend();
        let run = match split {
            false => backend.begin_step_graph(graph, &plan.ids, &plan.positions)?,
            true => match backend.begin_split_step_graph(
                graph,
                &mut followers,
                &plan.ids,
                &plan.positions,
            ) {
                Ok(run) => run,
                // Nothing ran (the backend's contract): the batch goes on op by op.
                Err(error) => {
                    counts.abandoned += 1;
                    let reason = error.to_string();
                    tracing::warn!(
                        "a decode step over the pipeline stages could not go through its step graph; this batch runs op by op: {reason}"
                    );
                    *last_abandoned = Some(reason);
                    entry.graph = None;
                    return Ok(None);
                }
            },
        };
        match run {
            StepGraphRun::Replayed => {
                counts.replayed += 1;
                // The GPU runs the step: the next step's cache work meanwhile. Unsplit only: a
                // later stage's copies would queue on its own stream, beside the graph (which
                // runs on the first stage's) rather than behind it; split, they wait for the
                // next step.
                if !split {
                    self.expert_cache_upkeep_ahead()?;
                }
                let (logits, deferred) =
                    recorded
                        .as_ref()
                        .ok_or_else(|| EngineError::InvalidConfig {
                            problem: "a replayed step graph has no recorded outputs".into(),
                        })?;
                // The hand-off's wait first: it sleeps rather than spins (see
                // `Backend::take_worker_handoff_failure`).
                let mut tally = PhaseTotals::default();
                if let Some(handoff) = handoff {
                    self.finish_worker_handoff(handoff, &mut tally)?;
                }
                backend.wait_for_queued_ops()?;
                self.count_recorded_routings(deferred, &mut tally)?;
                self.account_forward(batch, &plan, tally, started);
                // The caller owns what it gets; the graph's logits are rewritten next step.
                let (_, vocab) = output.shape(logits);
                Ok(Some(output.columns(logits, 0..vocab)?))
            }
            StepGraphRun::RunOps => {
                let mut scratch =
                    LayerScratch::new(self.moe_context_with(handoff.map(|h| h.handoff), None));
                scratch.later_handoffs = handoff.map_or(&[], |h| h.later);
                let result = self.run_layers(
                    batch,
                    &plan,
                    LogitsSelection::Last,
                    self.delta_rule_form,
                    &mut scratch,
                    |backend, normed| backend.matmul(&normed, self.head()),
                );
                let end = match split {
                    false => backend.end_step_graph(graph, result.is_ok())?,
                    true => backend.end_split_step_graph(graph, &mut followers, result.is_ok())?,
                };
                match end {
                    StepGraphEnd::Ran => {
                        counts.shaped += 1;
                        if result.is_err() {
                            entry.graph = None;
                        }
                        let logits = result?;
                        if let Some(handoff) = handoff {
                            self.finish_worker_handoff(handoff, &mut scratch.tally)?;
                        }
                        self.finish_deferred_routing(&mut scratch)?;
                        self.account_forward(batch, &plan, scratch.tally, started);
                        Ok(Some(logits))
                    }
                    StepGraphEnd::Recorded => {
                        counts.recorded += 1;
                        tracing::info!(
                            "a decode step of {} sequence(s) recorded as a graph{}",
                            keys_len,
                            match handoff {
                                Some(_) => ", MoE layers handed to the workers by the device",
                                None => "",
                            }
                        );
                        let logits = result?;
                        let deferred = std::mem::take(&mut scratch.deferred);
                        let mut tally = scratch.tally;
                        if let Some(handoff) = handoff {
                            self.finish_worker_handoff(handoff, &mut tally)?;
                        }
                        backend.wait_for_queued_ops()?;
                        self.count_recorded_routings(&deferred, &mut tally)?;
                        self.account_forward(batch, &plan, tally, started);
                        let (_, vocab) = output.shape(&logits);
                        let copy = output.columns(&logits, 0..vocab)?;
                        *recorded = Some((logits, deferred));
                        Ok(Some(copy))
                    }
                    StepGraphEnd::Interrupted {
                        capture_broken_after,
                    } => {
                        counts.interrupted += 1;
                        let reason = match (&result, capture_broken_after) {
                            (Err(error), Some(broken)) => format!("{error}; {broken}"),
                            (Err(error), None) => error.to_string(),
                            (Ok(_), Some(broken)) => broken,
                            (Ok(_), None) => "the capture broke".to_string(),
                        };
                        tracing::info!(
                            "a decode step's recording was interrupted; this step runs op by op and a later one records again: {reason}"
                        );
                        *last_abandoned = Some(reason);
                        // Nothing ran: the positions never moved, and the step runs op by op.
                        Ok(None)
                    }
                    StepGraphEnd::Abandoned {
                        capture_broken_after,
                    } => {
                        counts.abandoned += 1;
                        let mut reason = match &result {
                            Err(error) => error.to_string(),
                            Ok(_) => "the driver refused the recording".to_string(),
                        };
                        if let Some(broken) = capture_broken_after {
                            reason = format!("{reason}; {broken}");
                        }
                        tracing::warn!(
                            "a decode step could not be recorded as a graph; this batch runs op by op: {reason}"
                        );
                        *last_abandoned = Some(reason);
                        // Nothing ran: the positions never moved, and the step runs op by op.
                        entry.graph = None;
                        Ok(None)
                    }
                }
            }
        }
    }

    /// Counts the routings a replay left in the recorded step's pending routings.
    pub(in crate::model) fn count_recorded_routings(
        &self,
        deferred: &[DeferredRouting<B>],
        tally: &mut PhaseTotals,
    ) -> Result<(), EngineError> {
        let context = self.moe_context();
        for DeferredRouting { layer, pending } in deferred {
            let routing = self.layer_backend(*layer).peek_routing(pending)?;
            if let Some(FeedForward::Moe(moe)) = self.moe_layer_at(*layer) {
                moe.account_deferred_routing(&context, *layer, &routing, tally)?;
            }
        }
        Ok(())
    }
}
