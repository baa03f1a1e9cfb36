//! One MoE layer's forward: the router, the routed experts split between the backend's expert
//! slots and the expert executor, and the shared expert.
//!
//! Owns: choosing each layer call's [`Route`], queueing the backend's own work before anything
//! waits for the routing, masking resident experts out of the executor's batch, copying a big
//! batch's experts into the prefill staging slots, adding the parts, and counting a call's
//! routing (routing statistics and the forward profile).
//! Must not touch: the graph around the layer and weight loading (`crate::model`), op
//! implementations (backends), which experts are resident (`crate::moe::placement`).

use std::borrow::Cow;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use ninfer_artifact::{Artifact, CommonConfig, ExpertBank, NO_EXPERT};
use ninfer_cpu_experts::ExpertLayout;

use crate::backend::{
    Backend, ExpertSlotFills, ExpertSlotTable, LayerInput, Routing, WithExpertSlotTable,
};
use crate::error::EngineError;
use crate::moe::executor::{ExpertBatch, ExpertExecutor};
use crate::moe::expert_cache::{CachedLayer, ExpertCache};
use crate::moe::layerwise::{LayerwiseStream, PrefillThroughputs};
use crate::profile::{distinct_experts, nanos, ForwardProfile, PhaseTotals};

/// The shared expert of a MoE layer (qwen3_next, qwen3_5_moe), gated per token.
pub(crate) struct SharedExpert<B: Backend> {
    pub gate_proj: B::Weight,
    pub up_proj: B::Weight,
    pub down_proj: B::Weight,
    pub gate: B::Weight,
}

/// A MoE layer's weights and its resident experts.
pub(crate) struct MoeLayer<B: Backend> {
    pub router: B::Weight,
    pub bank: ExpertBank,
    pub shared: Option<SharedExpert<B>>,
    /// Experts of this layer held in the backend's slots (GPU expert slots), if any. Written
    /// only between steps (placement, the expert cache's hook); a forward reads it.
    pub resident: RwLock<Option<B::ExpertSlots>>,
}

/// One layer-sized set of backend slots that batches of at least `min_tokens` rows copy their
/// non-resident experts into (a long prompt's prefill), reused layer after layer; with
/// layerwise prefill two such sets (the halves of `slots`), streamed into alternately.
pub(crate) struct PrefillStaging<B: Backend> {
    /// Staged route from this many rows (`usize::MAX`: only layerwise).
    pub min_tokens: usize,
    /// `num_experts` slots, or twice that with `layerwise` (the staged route uses the first
    /// half, slot = expert).
    pub slots: Mutex<B::ExpertSlots>,
    pub layerwise: Option<LayerwiseSettings>,
}

/// When and how a forward streams its layers' experts.
pub(crate) struct LayerwiseSettings {
    /// Batches of at least this many rows stream.
    pub min_tokens: usize,
    /// What the split of each layer is chosen from (measured at start, or given by a test).
    pub throughputs: RwLock<PrefillThroughputs>,
}

/// A MoE layer's routing left on the backend because nothing waits for it mid-forward
/// ([`Route::Resident`]): finished and counted at the forward's end.
pub(crate) struct DeferredRouting<B: Backend> {
    pub layer: usize,
    pub pending: B::PendingRouting,
}

/// What every MoE layer of a model uses during a forward.
pub(crate) struct MoeContext<'a, B: Backend> {
    pub backend: &'a B,
    pub artifact: &'a Arc<Artifact>,
    pub executor: &'a dyn ExpertExecutor,
    pub profile: &'a ForwardProfile,
    pub common: &'a CommonConfig,
    pub normalize_routing: bool,
    pub staging: Option<&'a PrefillStaging<B>>,
    /// The dynamic expert cache, counting each layer call's routing against its slots.
    pub expert_cache: Option<&'a ExpertCache>,
    /// The backend's own hand-off to the expert workers, when this forward uses it (the
    /// workers are ready and the batch is small enough): the executor's experts of a layer are
    /// then posted and collected by the backend, with no host step in between.
    pub worker_handoff: Option<&'a B::WorkerHandoff>,
    /// This forward's layerwise streaming, when the batch is big enough.
    pub layerwise: Option<&'a LayerwiseStream<'a, B>>,
}

/// Where a layer call's routed experts are computed.
pub(crate) enum Route<'a, B: Backend> {
    /// Every expert of the layer is in the backend's slots: the backend computes them all and
    /// the routing stays on the backend until the forward's end (it is wanted only for the
    /// statistics), so this layer does not wait.
    Resident,
    /// The batch has at least the staging threshold of rows: the non-resident experts it routes
    /// to are copied into the staging slots and computed on the backend, beside the resident
    /// ones.
    Staged(&'a Mutex<B::ExpertSlots>),
    /// The expert executor computes the experts not in slots (it gets the hidden states with
    /// the routing, one wait on a GPU); the backend sums the resident ones.
    Executor,
    /// The executor's workers compute the experts not in slots, posted and collected by the
    /// backend itself ([`Backend::post_to_workers`]); the routing is counted at the forward's
    /// end, as for [`Route::Resident`], so this layer does not wait either.
    BackendHandoff(&'a B::WorkerHandoff),
    /// The forward streams this layer: the experts its plan streams were copied into a half of
    /// the staging slots while the layers before computed and are computed there; the
    /// executor computes the other non-resident ones at the same time.
    Layerwise(&'a LayerwiseStream<'a, B>),
}

impl<'a, B: Backend> Route<'a, B> {
    /// Layerwise streaming first (the forward planned this layer), then staging (a big batch),
    /// then all-resident, then the backend's own hand-off, else the executor through the host.
    fn choose(
        context: &MoeContext<'a, B>,
        index: usize,
        resident: Option<&B::ExpertSlots>,
        rows: usize,
    ) -> Self {
        let (staging, worker_handoff) = (context.staging, context.worker_handoff);
        if let Some(stream) = context
            .layerwise
            .filter(|stream| stream.plan(index).is_some())
        {
            return Route::Layerwise(stream);
        }
        if let Some(staging) = staging.filter(|staging| rows >= staging.min_tokens) {
            return Route::Staged(&staging.slots);
        }
        let every_expert_resident =
            resident.is_some_and(|slots| slots.slot_table().every_expert_resident());
        match worker_handoff {
            _ if every_expert_resident => Route::Resident,
            Some(handoff) => Route::BackendHandoff(handoff),
            None => Route::Executor,
        }
    }
}

impl<B: Backend> MoeLayer<B> {
    /// The layer's resident slots for reading (a forward).
    fn resident_slots(&self) -> Result<RwLockReadGuard<'_, Option<B::ExpertSlots>>, EngineError> {
        self.resident.read().map_err(|_| poisoned())
    }

    /// The layer's resident slots for changing (between steps).
    pub(crate) fn resident_slots_mut(
        &self,
    ) -> Result<RwLockWriteGuard<'_, Option<B::ExpertSlots>>, EngineError> {
        self.resident.write().map_err(|_| poisoned())
    }

    /// Whether every routed expert of the layer is in its resident slots (nothing for the
    /// executor; a poisoned lock says no).
    pub fn every_expert_resident(&self) -> bool {
        self.resident_slots().is_ok_and(|resident| {
            resident
                .as_ref()
                .is_some_and(|slots| slots.slot_table().every_expert_resident())
        })
    }

    /// The layer's routed experts not in its resident slots now, ascending.
    pub fn non_resident_experts(&self) -> Result<Vec<usize>, EngineError> {
        let resident = self.resident_slots()?;
        let table = resident.as_ref().map(WithExpertSlotTable::slot_table);
        let num_experts = usize::try_from(self.bank.num_experts).unwrap_or(usize::MAX);
        Ok((0..num_experts)
            .filter(|&expert| !table.is_some_and(|table| table.is_resident(expert)))
            .collect())
    }

    /// The layer's routed experts in its resident slots now, ascending.
    pub fn resident_experts(&self) -> Result<Vec<usize>, EngineError> {
        let resident = self.resident_slots()?;
        Ok(resident.as_ref().map_or_else(Vec::new, |slots| {
            let table = slots.slot_table();
            (0..table.num_experts())
                .filter(|&expert| table.is_resident(expert))
                .collect()
        }))
    }

    /// How many of the layer's routed experts are in its resident slots now (a poisoned lock
    /// says none).
    pub fn resident_expert_count(&self) -> usize {
        self.resident_experts().map_or(0, |experts| experts.len())
    }

    /// The routed experts and the shared expert of the layer's normed input `x` (`[rows,
    /// hidden]`, given or formed from a residual add: [`LayerInput`]), summed.
    pub fn forward(
        &self,
        context: &MoeContext<'_, B>,
        index: usize,
        input: LayerInput<'_, B>,
        tally: &mut PhaseTotals,
        deferred: &mut Vec<DeferredRouting<B>>,
    ) -> Result<B::Tensor, EngineError> {
        let backend = context.backend;
        let resident_guard = self.resident_slots()?;
        let resident = resident_guard.as_ref();
        let resident_table = resident.map(WithExpertSlotTable::slot_table);
        let rows = input.rows(backend);
        let route = Route::choose(context, index, resident, rows);
        let executor_reads_hidden = match &route {
            Route::Executor => true,
            Route::Layerwise(stream) => stream
                .plan(index)
                .is_some_and(|plan| plan.executor_experts > 0),
            _ => false,
        };
        let (k, normalize) = (
            context.common.num_experts_per_tok,
            context.normalize_routing,
        );
        let normed_here;
        let (x, pending) = match input {
            LayerInput::Normed(x) => {
                let pending = backend.start_routing_by_router(
                    x,
                    &self.router,
                    k,
                    normalize,
                    executor_reads_hidden,
                )?;
                (x, pending)
            }
            LayerInput::AfterResidualAdd {
                residual,
                delta,
                norm,
            } => {
                let (normed, pending) = backend.add_rms_norm_and_start_routing_by_router(
                    residual,
                    delta,
                    norm,
                    &self.router,
                    k,
                    normalize,
                    executor_reads_hidden,
                )?;
                normed_here = normed;
                (&normed_here, pending)
            }
        };
        // The workers start as soon as the routing is known: posted before the backend queues
        // its own experts.
        if let Route::BackendHandoff(handoff) = route {
            backend.post_to_workers(handoff, index, x, &pending, resident)?;
        }
        // Work the backend does itself is queued before anything waits for the routing (on a
        // GPU it runs while this thread reads the routing and then waits for the expert
        // workers): the resident experts, then the shared expert.
        let resident_sum = resident
            .map(|slots| backend.slotted_experts_by_pending_routing(slots, x, &pending))
            .transpose()?;
        let shared_parts = self
            .shared
            .as_ref()
            .map(|shared| -> Result<_, EngineError> {
                // The three projections of x in one pass and the activation inside the down
                // projection where the backend can (two launches instead of five at decode on
                // the GPU; the same values).
                let [gate_proj, up_proj, gate] =
                    backend.matmul3(x, [&shared.gate_proj, &shared.up_proj, &shared.gate])?;
                Ok((
                    backend.matmul_silu_mul(&gate_proj, &up_proj, &shared.down_proj)?,
                    gate,
                ))
            })
            .transpose()?;
        let mut output = match route {
            Route::BackendHandoff(handoff) => {
                // The host path's additions: the workers' sum, then the resident experts.
                let mut routed = backend.collect_from_workers(handoff, rows)?;
                if let Some(resident_sum) = resident_sum {
                    backend.add_assign(&mut routed, &resident_sum)?;
                }
                deferred.push(DeferredRouting {
                    layer: index,
                    pending,
                });
                routed
            }
            Route::Resident => {
                deferred.push(DeferredRouting {
                    layer: index,
                    pending,
                });
                resident_sum.ok_or_else(|| EngineError::InvalidConfig {
                    problem: format!("MoE layer {index}: resident route without expert slots"),
                })?
            }
            Route::Staged(staging) => {
                let (routing, hidden) = backend.finish_routing(pending)?;
                self.account_routing(context, index, &routing, resident_table, tally);
                let expert_ids = executor_expert_ids(resident_table, &routing.expert_ids);
                match self.staged_experts(context, staging, x, &expert_ids, &routing)? {
                    Some(mut staged_sum) => {
                        if let Some(resident_sum) = resident_sum {
                            backend.add_assign(&mut staged_sum, &resident_sum)?;
                        }
                        staged_sum
                    }
                    None => match resident_sum {
                        Some(resident_sum) => resident_sum,
                        None => self.executor_part(
                            context,
                            index,
                            x,
                            &hidden,
                            &expert_ids,
                            &routing,
                            None,
                            tally,
                        )?,
                    },
                }
            }
            Route::Layerwise(stream) => {
                let (routing, hidden) = backend.finish_routing(pending)?;
                self.account_routing(context, index, &routing, resident_table, tally);
                // The expert cache may re-place the slots from the staging (it takes them for
                // writing): the resident sum is queued, and the rest needs only the table.
                let resident_table = resident_table.cloned();
                drop(resident_guard);
                self.layerwise_experts(
                    context,
                    stream,
                    index,
                    x,
                    &hidden,
                    &routing,
                    resident_table.as_ref(),
                    resident_sum,
                    tally,
                )?
            }
            Route::Executor => {
                let (routing, hidden) = backend.finish_routing(pending)?;
                self.account_routing(context, index, &routing, resident_table, tally);
                let expert_ids = executor_expert_ids(resident_table, &routing.expert_ids);
                // With every chosen expert resident the executor has nothing to do.
                let nothing_for_executor = expert_ids.iter().all(|&id| id == NO_EXPERT);
                match resident_sum {
                    Some(resident_sum) if nothing_for_executor => resident_sum,
                    resident_sum => self.executor_part(
                        context,
                        index,
                        x,
                        &hidden,
                        &expert_ids,
                        &routing,
                        resident_sum,
                        tally,
                    )?,
                }
            }
        };
        if let Some((expert, gate)) = shared_parts {
            backend.add_sigmoid_scaled_rows(&mut output, &expert, &gate)?;
        }
        Ok(output)
    }

    /// Counts the routing of a call whose routing was left on the backend
    /// ([`DeferredRouting`]), against the layer's slots.
    pub fn account_deferred_routing(
        &self,
        context: &MoeContext<'_, B>,
        index: usize,
        routing: &Routing,
        tally: &mut PhaseTotals,
    ) -> Result<(), EngineError> {
        // The table the step read, when an upkeep ahead has changed the layer's since.
        let kept = context
            .expert_cache
            .and_then(|cache| cache.table_of_running_step(index));
        let resident = self.resident_slots()?;
        let table = kept
            .as_deref()
            .or_else(|| resident.as_ref().map(WithExpertSlotTable::slot_table));
        self.account_routing(context, index, routing, table, tally);
        Ok(())
    }

    /// Counts one layer call's routing: the executor's routing statistics (every routed choice,
    /// before the split between the backend's slots and the executor) and the profile's expert
    /// tallies.
    fn account_routing(
        &self,
        context: &MoeContext<'_, B>,
        index: usize,
        routing: &Routing,
        resident_table: Option<&ExpertSlotTable>,
        tally: &mut PhaseTotals,
    ) {
        let tokens = routing_tokens(routing);
        context
            .executor
            .observe_routing(index, &routing.expert_ids, tokens);
        if let Some(cache) = context.expert_cache {
            cache.observe(index, &routing.expert_ids, tokens, resident_table);
        }
        let (cpu_experts, resident_experts) = distinct_experts(
            &routing.expert_ids,
            resident_table,
            context.common.num_experts,
        );
        tally.moe_layer_calls += 1;
        tally.cpu_experts += cpu_experts;
        tally.resident_experts += resident_experts;
        tally.cpu_expert_bytes += cpu_experts * self.bank.expert_stride;
        tally.resident_expert_bytes += resident_experts * self.bank.expert_stride;
    }

    /// The non-resident routed experts of a staged batch (`expert_ids`, resident ones masked)
    /// copied into the staging slots and computed on the backend; `None` when the batch routes
    /// to resident experts only. Each routed expert goes to the slot of its own index, so the
    /// table never points at an expert of another layer for an id this batch uses.
    fn staged_experts(
        &self,
        context: &MoeContext<'_, B>,
        staging: &Mutex<B::ExpertSlots>,
        x: &B::Tensor,
        expert_ids: &[u32],
        routing: &Routing,
    ) -> Result<Option<B::Tensor>, EngineError> {
        let mut wanted = vec![false; context.common.num_experts];
        for &id in expert_ids {
            if let Some(flag) = wanted.get_mut(id as usize) {
                *flag = true;
            }
        }
        if !wanted.contains(&true) {
            return Ok(None);
        }
        let mut slots = staging.lock().map_err(|_| EngineError::InvalidConfig {
            problem: "the prefill staging slots' lock is poisoned".into(),
        })?;
        // A layerwise forward that failed may have left copies in flight into these slots:
        // they land (and enter the table) before this batch's own copies.
        if slots.fills_in_flight() > 0 {
            slots.complete_fills()?;
        }
        for (expert, _) in wanted.iter().enumerate().filter(|(_, &wanted)| wanted) {
            context.backend.fill_expert_slot(
                &mut slots,
                expert,
                expert,
                context.artifact,
                &self.bank,
            )?;
        }
        let masked = Routing {
            experts_per_token: routing.experts_per_token,
            expert_ids: expert_ids.to_vec(),
            weights: routing.weights.clone(),
        };
        Ok(Some(context.backend.slotted_experts(&slots, x, &masked)?))
    }

    /// A streamed layer's routed experts: the streamed ones on the backend (queued first), the
    /// rest of the non-resident ones on the executor meanwhile, plus the resident sum.
    #[allow(clippy::too_many_arguments)]
    fn layerwise_experts(
        &self,
        context: &MoeContext<'_, B>,
        stream: &LayerwiseStream<'_, B>,
        index: usize,
        x: &B::Tensor,
        hidden: &[f32],
        routing: &Routing,
        resident_table: Option<&ExpertSlotTable>,
        resident_sum: Option<B::Tensor>,
        tally: &mut PhaseTotals,
    ) -> Result<B::Tensor, EngineError> {
        let backend = context.backend;
        let (streamed, executor_experts) = stream
            .plan(index)
            .map(|plan| (plan.streamed.clone(), plan.executor_experts))
            .unwrap_or_default();
        tally.streamed_experts += streamed.len() as u64;
        tally.streamed_expert_bytes += streamed.len() as u64 * self.bank.expert_stride;
        let mut place_from_staging =
            |staging: &B::ExpertSlots, staged: &[(usize, usize)]| match context.expert_cache {
                Some(cache) => cache.place_from_staging(index, self, staging, staged),
                None => Ok(()),
            };
        let streamed_sum = stream.compute(backend, index, x, routing, &mut place_from_staging)?;
        let mut on_backend = match (resident_sum, streamed_sum) {
            (Some(mut resident), Some(streamed)) => {
                backend.add_assign(&mut resident, &streamed)?;
                Some(resident)
            }
            (resident, streamed) => resident.or(streamed),
        };
        if executor_experts > 0 {
            let mut is_streamed = vec![false; context.common.num_experts];
            for expert in streamed {
                if let Some(flag) = is_streamed.get_mut(expert) {
                    *flag = true;
                }
            }
            let expert_ids: Vec<u32> = executor_expert_ids(resident_table, &routing.expert_ids)
                .iter()
                .map(|&id| {
                    if is_streamed.get(id as usize).copied().unwrap_or(false) {
                        NO_EXPERT
                    } else {
                        id
                    }
                })
                .collect();
            if expert_ids.iter().any(|&id| id != NO_EXPERT) {
                return self.executor_part(
                    context,
                    index,
                    x,
                    hidden,
                    &expert_ids,
                    routing,
                    on_backend.take(),
                    tally,
                );
            }
        }
        match on_backend {
            Some(sum) => Ok(sum),
            None => {
                // No pair of the batch chose an expert computed anywhere: zeros.
                let (rows, cols) = backend.shape(x);
                backend.upload(&vec![0.0; rows * cols], rows, cols)
            }
        }
    }

    /// The executor's part uploaded to the backend, plus the resident experts' sum if any.
    #[allow(clippy::too_many_arguments)]
    fn executor_part(
        &self,
        context: &MoeContext<'_, B>,
        index: usize,
        x: &B::Tensor,
        hidden: &[f32],
        expert_ids: &[u32],
        routing: &Routing,
        resident_sum: Option<B::Tensor>,
        tally: &mut PhaseTotals,
    ) -> Result<B::Tensor, EngineError> {
        let backend = context.backend;
        let (rows, cols) = backend.shape(x);
        let routed = self.routed_on_executor(context, index, hidden, expert_ids, routing, tally)?;
        let copying = Instant::now();
        let mut output = backend.upload(&routed, rows, cols)?;
        tally.transfer_nanos += nanos(copying.elapsed());
        if let Some(resident_sum) = resident_sum {
            backend.add_assign(&mut output, &resident_sum)?;
        }
        Ok(output)
    }

    /// The routed experts the executor computes (the CPU workers, or in-process), summed per
    /// token; zeros where it has none. Counts its wait and the workers' compute time.
    fn routed_on_executor(
        &self,
        context: &MoeContext<'_, B>,
        layer: usize,
        hidden: &[f32],
        expert_ids: &[u32],
        routing: &Routing,
        tally: &mut PhaseTotals,
    ) -> Result<Vec<f32>, EngineError> {
        let mut routed = vec![0.0f32; hidden.len()];
        if expert_ids.iter().all(|&id| id == NO_EXPERT) {
            return Ok(routed);
        }
        let executor = context.executor;
        let reported_before = executor.compute_nanos();
        let waiting = Instant::now();
        executor.compute(
            &ExpertBatch {
                layer,
                bank: &self.bank,
                hidden_size: context.common.hidden_size,
                intermediate_size: context.common.moe_intermediate_size,
                hidden,
                experts_per_token: routing.experts_per_token,
                expert_ids,
                weights: &routing.weights,
            },
            &mut routed,
        )?;
        let waited = nanos(waiting.elapsed());
        tally.expert_wait_nanos += waited;
        tally.expert_compute_nanos += match (reported_before, executor.compute_nanos()) {
            (Some(before), Some(after)) => {
                context.profile.note_compute_reported();
                after.saturating_sub(before).min(waited)
            }
            _ => waited,
        };
        Ok(routed)
    }

    /// The slot layout of this layer's experts.
    pub fn layout(&self, common: &CommonConfig) -> Result<ExpertLayout, EngineError> {
        ExpertLayout::for_bank(&self.bank, common.hidden_size, common.moe_intermediate_size)
            .map_err(|error| EngineError::InvalidConfig {
                problem: error.to_string(),
            })
    }

    /// Puts `experts` of this layer (layer `index`) in new backend slots, replacing any earlier
    /// ones (none for an empty list). Returns the bytes copied.
    pub fn place_resident(
        &mut self,
        backend: &B,
        artifact: &Arc<Artifact>,
        common: &CommonConfig,
        index: usize,
        experts: &[u32],
    ) -> Result<u64, EngineError> {
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        let mut resident = self.resident_slots_mut()?;
        *resident = None;
        if experts.is_empty() {
            return Ok(0);
        }
        let mut seen = vec![false; common.num_experts];
        for &expert in experts {
            match seen.get_mut(expert as usize) {
                Some(flag) if !*flag => *flag = true,
                Some(_) => {
                    return Err(invalid(format!(
                        "layer {index}: expert {expert} is placed twice"
                    )))
                }
                None => {
                    return Err(invalid(format!(
                        "layer {index}: expert {expert} is not one of the {} experts",
                        common.num_experts
                    )))
                }
            }
        }
        let layout = self.layout(common)?;
        let mut slots = backend.new_expert_slots(&layout, common.num_experts, experts.len())?;
        for (slot, &expert) in experts.iter().enumerate() {
            backend.fill_expert_slot(&mut slots, slot, expert as usize, artifact, &self.bank)?;
        }
        *resident = Some(slots);
        Ok((experts.len() * layout.stride) as u64)
    }
}

impl<B: Backend> CachedLayer for MoeLayer<B> {
    type Slots = B::ExpertSlots;

    fn resident_slots_mut(
        &self,
    ) -> Result<RwLockWriteGuard<'_, Option<B::ExpertSlots>>, EngineError> {
        MoeLayer::resident_slots_mut(self)
    }

    fn expert_bank(&self) -> &ExpertBank {
        &self.bank
    }
}

fn poisoned() -> EngineError {
    EngineError::InvalidConfig {
        problem: "a MoE layer's expert slot lock is poisoned".into(),
    }
}

/// The routing's expert ids with the experts resident in `table` masked out ([`NO_EXPERT`]):
/// what is left for the executor or the staging slots.
fn executor_expert_ids<'r>(
    table: Option<&ExpertSlotTable>,
    expert_ids: &'r [u32],
) -> Cow<'r, [u32]> {
    match table {
        Some(table) => Cow::Owned(
            expert_ids
                .iter()
                .map(|&id| {
                    if table.is_resident(id as usize) {
                        NO_EXPERT
                    } else {
                        id
                    }
                })
                .collect(),
        ),
        None => Cow::Borrowed(expert_ids),
    }
}

/// Tokens of a routing (`[tokens, k]` entries).
fn routing_tokens(routing: &Routing) -> usize {
    routing
        .expert_ids
        .len()
        .checked_div(routing.experts_per_token)
        .unwrap_or(0)
}
