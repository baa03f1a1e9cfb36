//! Where a model's routed experts run: resident experts placed into GPU slots, prefill staging
//! and layerwise streaming with their measured throughputs, the dynamic expert cache, and the
//! MoE context a forward hands its layers.
//!
//! Owns: those settings of a loaded model and their reports. Must not touch: the MoE layer's
//! own forward (`crate::moe::layer`).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use ninfer_cpu_experts::ExpertLayout;

use crate::backend::{Backend, ExpertSlotFills, Routing, WithExpertSlotTable};
use crate::error::EngineError;
use crate::model::layers::FeedForward;
use crate::model::pipeline::stage_backend;
use crate::model::Model;
use crate::moe::expert_cache::{ExpertCache, ExpertCacheCounters, ExpertCacheOptions};
use crate::moe::layer::{LayerwiseSettings, MoeContext, MoeLayer, PrefillStaging};
use crate::moe::layerwise::{
    layer_split, streamed_expert_count, LayerBatch, LayerPlan, LayerSplit, LayerwiseStream,
    PrefillThroughputs,
};
use crate::moe::ExpertBatch;
use crate::service::routing_stats::ExpertStatistics;

/// What [`Model::place_resident_experts`] put where.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResidentExpertsReport {
    /// MoE layers with at least one resident expert.
    pub layers: usize,
    /// Resident experts over all layers.
    pub experts: usize,
    /// Bytes of expert weights copied to the backend.
    pub bytes: u64,
}

/// [`Model::enable_prefill_staging_with`]'s thresholds (rows of a forward's batch; 0: off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillStagingOptions {
    /// The staged route: the routed non-resident experts copied after the routing, no overlap.
    pub staged_min_tokens: usize,
    /// Layerwise prefill: every layer's experts streamed while the layer before computes.
    pub layerwise_min_tokens: usize,
}

/// [`Model::layerwise_split_summary`]: a batch's layers by split, the estimated seconds of
/// their non-resident experts and the expert bytes the streaming would copy.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LayerwiseSummary {
    pub layerwise_gpu_layers: usize,
    pub mixed_layers: usize,
    pub cpu_layers: usize,
    pub seconds: f64,
    pub streamed_bytes: u64,
}

impl<B: Backend> Model<B> {
    /// Puts experts of each MoE layer in the backend's expert slots (GPU expert slots):
    /// `placement[layer]` lists the experts of that layer to make resident (empty: none; dense
    /// layers must be empty). The layers are those of [`Model::placement_layers`]: the decoder
    /// layers, then the MTP layer; a placement that stops after the decoder layers leaves the
    /// MTP layer's experts with the executor. Replaces any earlier placement. Resident experts
    /// are computed by the backend while the expert executor computes the others; the sum is
    /// the same.
    pub fn place_resident_experts(
        &mut self,
        placement: &[Vec<u32>],
    ) -> Result<ResidentExpertsReport, EngineError> {
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        let with_mtp = self.layers.len() + usize::from(self.mtp.is_some());
        if placement.len() != self.layers.len() && placement.len() != with_mtp {
            return Err(invalid(format!(
                "expert placement lists {} layers, the model has {} (and {} with its MTP layer)",
                placement.len(),
                self.layers.len(),
                with_mtp
            )));
        }
        let common = self.spec.common.clone();
        let mut report = ResidentExpertsReport::default();
        let no_experts = Vec::new();
        // Each layer's experts go to the slots of its own stage's backend.
        let (backend, pipeline) = (&self.backend, &self.pipeline);
        let feed_forwards = self
            .layers
            .iter_mut()
            .map(|layer| &mut layer.feed_forward)
            .chain(self.mtp.as_mut().map(|head| &mut head.layer.feed_forward));
        for (index, feed_forward) in feed_forwards.enumerate() {
            let experts = placement.get(index).unwrap_or(&no_experts);
            let FeedForward::Moe(moe) = feed_forward else {
                if experts.is_empty() {
                    continue;
                }
                return Err(invalid(format!(
                    "layer {index} has no routed experts, the placement lists {}",
                    experts.len()
                )));
            };
            let layer_backend = stage_backend(backend, pipeline, index);
            let bytes =
                moe.place_resident(layer_backend, &self.artifact, &common, index, experts)?;
            if !experts.is_empty() {
                report.layers += 1;
                report.experts += experts.len();
                report.bytes += bytes;
            }
        }
        Ok(report)
    }

    /// How many of the MTP layer's routed experts are resident now; `None` when the model has
    /// no MTP head or its layer has no routed experts.
    pub fn mtp_resident_experts(&self) -> Option<usize> {
        match self.mtp.as_ref().map(|head| &head.layer.feed_forward) {
            Some(FeedForward::Moe(moe)) => Some(moe.resident_expert_count()),
            _ => None,
        }
    }

    /// The placement index of the MTP layer (it follows the decoder layers).
    pub fn mtp_layer_index(&self) -> usize {
        self.layers.len()
    }

    /// From batches of `min_tokens` rows on (a long prompt's prefill), every MoE layer copies
    /// the non-resident experts its tokens route to into one set of backend slots (room for all
    /// experts of one layer, reused layer after layer) and computes them there, instead of
    /// sending the batch to the expert executor. On a GPU the copies are DMAs from the
    /// page-locked banks: a layer's experts cross PCIe in milliseconds, where the CPU would
    /// need tens of milliseconds per hundred tokens (DESIGN.md, "Prefill of long prompts").
    /// Returns the bytes the slots take; a model without routed experts needs none.
    pub fn enable_prefill_staging(&mut self, min_tokens: usize) -> Result<u64, EngineError> {
        self.enable_prefill_staging_with(PrefillStagingOptions {
            staged_min_tokens: min_tokens,
            layerwise_min_tokens: 0,
        })
    }

    /// [`Model::enable_prefill_staging`] with layerwise prefill beside it: from
    /// `layerwise_min_tokens` rows on (0: never) a forward streams each MoE layer's
    /// non-resident experts into one half of two layer-sized sets of staging slots while the
    /// layer before computes, and leaves as many of them to the expert executor as the
    /// throughputs ([`Model::set_prefill_throughputs`], [`Model::measure_prefill_throughputs`])
    /// say is fastest (DESIGN.md, "Prefill of long prompts"). `staged_min_tokens` 0: no staged
    /// route. Returns the bytes the slots take.
    pub fn enable_prefill_staging_with(
        &mut self,
        options: PrefillStagingOptions,
    ) -> Result<u64, EngineError> {
        if self.is_split() {
            // Each stage stages its own layers' experts in its own slots.
            return self.enable_prefill_staging_per_stage(options);
        }
        let common = &self.spec.common;
        let Some(layout) = self.staging_layout()? else {
            return Ok(0);
        };
        let halves = if options.layerwise_min_tokens > 0 {
            2
        } else {
            1
        };
        let mut slots = self.backend.new_expert_slots(
            &layout,
            common.num_experts,
            halves * common.num_experts,
        )?;
        // Ready every bank now (on a GPU: page-lock it), so the first long prompt does not
        // pay for it: the first 4K prefill measured 30% slower than the second before this.
        let started = std::time::Instant::now();
        for moe in self.placed_moe_layers() {
            self.backend
                .prepare_expert_source(&mut slots, &self.artifact, &moe.bank);
        }
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            "prefill staging: expert banks readied as copy sources"
        );
        let flops_per_pair = 6.0 * common.hidden_size as f64 * common.moe_intermediate_size as f64;
        self.prefill_staging = Some(PrefillStaging {
            min_tokens: match options.staged_min_tokens {
                0 => usize::MAX,
                tokens => tokens,
            },
            slots: Mutex::new(slots),
            layerwise: (options.layerwise_min_tokens > 0).then(|| LayerwiseSettings {
                min_tokens: options.layerwise_min_tokens,
                throughputs: std::sync::RwLock::new(PrefillThroughputs::unmeasured(flops_per_pair)),
            }),
        });
        Ok((halves * common.num_experts * layout.stride) as u64)
    }

    /// The one layout every MoE layer's experts share, which staging slots take; `None` for a
    /// model without routed experts.
    pub(in crate::model) fn staging_layout(&self) -> Result<Option<ExpertLayout>, EngineError> {
        let common = &self.spec.common;
        let mut layouts = self.placed_moe_layers().map(|moe| moe.layout(common));
        let Some(first) = layouts.next() else {
            return Ok(None);
        };
        let layout = first?;
        for other in layouts {
            if other? != layout {
                return Err(EngineError::InvalidConfig {
                    problem: "prefill staging needs every MoE layer's experts in one layout".into(),
                });
            }
        }
        Ok(Some(layout))
    }

    pub(in crate::model) fn layerwise_settings(&self) -> Result<&LayerwiseSettings, EngineError> {
        self.prefill_staging
            .as_ref()
            .and_then(|staging| staging.layerwise.as_ref())
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "layerwise prefill is not enabled".into(),
            })
    }

    /// What layerwise prefill chooses each layer's split from, from now on.
    pub fn set_prefill_throughputs(
        &self,
        throughputs: PrefillThroughputs,
    ) -> Result<(), EngineError> {
        let settings = self.layerwise_settings()?;
        *settings
            .throughputs
            .write()
            .map_err(|_| EngineError::InvalidConfig {
                problem: "the prefill throughputs' lock is poisoned".into(),
            })? = throughputs;
        Ok(())
    }

    /// The throughputs layerwise prefill uses now (`None` when it is off).
    pub fn prefill_throughputs(&self) -> Option<PrefillThroughputs> {
        let settings = self.layerwise_settings().ok()?;
        settings.throughputs.read().ok().map(|t| *t)
    }

    /// Measures the three rates layerwise prefill chooses from and uses them from now on:
    /// the copy of the first MoE layer's experts into the staging slots (bytes / time, the
    /// fastest of three; on a GPU the pinned host-to-device rate), the backend's slotted
    /// experts over `backend_tokens` rows of uniform routing (pairs / time), and the expert
    /// executor over `executor_tokens` rows (0 rows, or a failure: rate 0, nothing is left to
    /// it). Each timed run follows an untimed one.
    pub fn measure_prefill_throughputs(
        &self,
        backend_tokens: usize,
        executor_tokens: usize,
    ) -> Result<PrefillThroughputs, EngineError> {
        let settings = self.layerwise_settings()?;
        let staging = self
            .prefill_staging
            .as_ref()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "layerwise prefill is not enabled".into(),
            })?;
        let Some((layer, moe)) = self.indexed_moe_layers().next() else {
            return Err(EngineError::InvalidConfig {
                problem: "the model has no MoE layer to measure".into(),
            });
        };
        let common = &self.spec.common;
        let (experts, k, hidden) = (
            common.num_experts,
            common.num_experts_per_tok,
            common.hidden_size,
        );
        let flops_per_pair = 6.0 * hidden as f64 * common.moe_intermediate_size as f64;
        let all: Vec<usize> = (0..experts).collect();
        let mut slots = staging
            .slots
            .lock()
            .map_err(|_| EngineError::InvalidConfig {
                problem: "the prefill staging slots' lock is poisoned".into(),
            })?;
        slots.complete_fills()?;
        let mut copy_seconds = f64::INFINITY;
        for run in 0..4 {
            self.backend.wait_for_queued_ops()?;
            let started = Instant::now();
            slots.start_batch_fill(0, &all, &self.artifact, &moe.bank)?;
            slots.complete_batch_fill()?;
            self.backend.wait_for_queued_ops()?;
            if run > 0 {
                copy_seconds = copy_seconds.min(started.elapsed().as_secs_f64());
            }
        }
        let bytes = (experts as u64 * moe.bank.expert_stride) as f64;
        // A uniform routing: token t's choice j is expert (t·k + j) mod E, weight 1/k.
        let uniform = |tokens: usize| Routing {
            experts_per_token: k,
            expert_ids: (0..tokens * k)
                .map(|pair| (pair % experts) as u32)
                .collect(),
            weights: vec![1.0 / k as f32; tokens * k],
        };
        let hidden_values = |tokens: usize| -> Vec<f32> {
            (0..tokens * hidden)
                .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
                .collect()
        };
        let backend_tokens = backend_tokens.max(1);
        let x = self
            .backend
            .upload(&hidden_values(backend_tokens), backend_tokens, hidden)?;
        let routing = uniform(backend_tokens);
        let mut backend_seconds = f64::INFINITY;
        for run in 0..2 {
            self.backend.wait_for_queued_ops()?;
            let started = Instant::now();
            let out = self.backend.slotted_experts(&slots, &x, &routing)?;
            self.backend.wait_for_queued_ops()?;
            drop(out);
            if run > 0 {
                backend_seconds = started.elapsed().as_secs_f64();
            }
        }
        drop(slots);
        let executor_pairs_per_second = if executor_tokens == 0 {
            0.0
        } else {
            let values = hidden_values(executor_tokens);
            let routing = uniform(executor_tokens);
            let mut out = vec![0.0f32; values.len()];
            let mut seconds = f64::INFINITY;
            let mut failed = None;
            for run in 0..2 {
                let started = Instant::now();
                let computed = self.experts.compute(
                    &ExpertBatch {
                        layer,
                        bank: &moe.bank,
                        hidden_size: hidden,
                        intermediate_size: common.moe_intermediate_size,
                        hidden: &values,
                        experts_per_token: k,
                        expert_ids: &routing.expert_ids,
                        weights: &routing.weights,
                    },
                    &mut out,
                );
                if let Err(error) = computed {
                    failed = Some(error);
                    break;
                }
                if run > 0 {
                    seconds = started.elapsed().as_secs_f64();
                }
            }
            match failed {
                Some(error) => {
                    tracing::warn!("measuring the expert executor failed ({error}); layerwise prefill leaves it nothing");
                    0.0
                }
                None => (executor_tokens * k) as f64 / seconds.max(1e-9),
            }
        };
        let throughputs = PrefillThroughputs {
            copy_bytes_per_second: bytes / copy_seconds.max(1e-9),
            backend_pairs_per_second: (backend_tokens * k) as f64 / backend_seconds.max(1e-9),
            executor_pairs_per_second,
            flops_per_pair,
        };
        *settings
            .throughputs
            .write()
            .map_err(|_| EngineError::InvalidConfig {
                problem: "the prefill throughputs' lock is poisoned".into(),
            })? = throughputs;
        Ok(throughputs)
    }

    /// How a batch of `tokens` rows would be split, layer by layer, under the current
    /// throughputs: counts of layers per split and the estimated seconds of all MoE layers'
    /// non-resident experts (`None` below the layerwise threshold or without it).
    pub fn layerwise_split_summary(&self, tokens: usize) -> Option<LayerwiseSummary> {
        let settings = self.layerwise_settings().ok()?;
        if tokens < settings.min_tokens {
            return None;
        }
        let throughputs = self.prefill_throughputs()?;
        let mut summary = LayerwiseSummary::default();
        for (_, moe) in self.indexed_moe_layers() {
            let batch = self.layer_batch(moe, tokens);
            let streamed = streamed_expert_count(&throughputs, &batch);
            summary.seconds += batch.estimated_seconds(&throughputs, streamed);
            summary.streamed_bytes += (streamed * batch.expert_bytes) as u64;
            match layer_split(streamed, batch.non_resident) {
                LayerSplit::Backend => summary.layerwise_gpu_layers += 1,
                LayerSplit::Mixed => summary.mixed_layers += 1,
                LayerSplit::Executor => summary.cpu_layers += 1,
            }
        }
        Some(summary)
    }

    /// The decoder layers' MoE layers with their layer index.
    pub(in crate::model) fn indexed_moe_layers(
        &self,
    ) -> impl Iterator<Item = (usize, &MoeLayer<B>)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(index, layer)| match &layer.feed_forward {
                FeedForward::Moe(moe) => Some((index, moe)),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
            })
    }

    /// A batch of `tokens` rows through `moe`, as the streaming rule sees it.
    pub(in crate::model) fn layer_batch(&self, moe: &MoeLayer<B>, tokens: usize) -> LayerBatch {
        let common = &self.spec.common;
        LayerBatch {
            tokens,
            experts_per_token: common.num_experts_per_tok,
            num_experts: common.num_experts,
            non_resident: common.num_experts - moe.resident_expert_count().min(common.num_experts),
            expert_bytes: usize::try_from(moe.bank.expert_stride).unwrap_or(usize::MAX),
            hidden_size: common.hidden_size,
        }
    }

    /// The layerwise stream of a forward of `rows` rows, when layerwise prefill is on and the
    /// batch is big enough: the split of each decoder MoE layer with experts outside its
    /// resident slots, then the first copies started.
    pub(in crate::model) fn layerwise_stream(
        &self,
        rows: usize,
    ) -> Result<Option<LayerwiseStream<'_, B>>, EngineError> {
        let Some(staging) = self.prefill_staging.as_ref() else {
            return Ok(None);
        };
        if staging
            .layerwise
            .as_ref()
            .is_none_or(|settings| rows < settings.min_tokens)
        {
            return Ok(None);
        }
        let throughputs = self
            .prefill_throughputs()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "the prefill throughputs' lock is poisoned".into(),
            })?;
        let mut plans = Vec::new();
        for (layer, moe) in self.indexed_moe_layers() {
            let batch = self.layer_batch(moe, rows);
            if batch.non_resident == 0 {
                // All resident: the resident route, which does not wait for the routing.
                continue;
            }
            let count = streamed_expert_count(&throughputs, &batch);
            let mut streamed = moe.non_resident_experts()?;
            streamed.truncate(count);
            plans.push(LayerPlan {
                layer,
                bank: &moe.bank,
                executor_experts: batch.non_resident - streamed.len().min(batch.non_resident),
                streamed,
            });
        }
        if plans.is_empty() {
            return Ok(None);
        }
        LayerwiseStream::start(
            &staging.slots,
            &self.artifact,
            plans,
            self.spec.common.num_experts,
        )
        .map(Some)
    }

    /// Turns on the dynamic expert cache over the experts placed by
    /// [`Model::place_resident_experts`] (call it after): from the next forward on, the slots
    /// follow the routing (`options.fills_per_layer` 0: they keep the placement, only the
    /// counters count). Scores start from `statistics`. Returns the counters.
    pub fn enable_expert_cache(
        &mut self,
        options: ExpertCacheOptions,
        statistics: Option<&ExpertStatistics>,
    ) -> Result<Arc<ExpertCacheCounters>, EngineError> {
        let mut slot_layers = Vec::with_capacity(self.layers.len() + 1);
        let mut slots_per_layer = 0;
        // The MTP layer, after the decoder layers, is one more cached layer.
        for feed_forward in self.feed_forwards() {
            let slots = match feed_forward {
                FeedForward::Moe(moe) => moe
                    .resident_slots_mut()?
                    .as_ref()
                    .map(|slots| slots.slot_table().slot_count()),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
            };
            slots_per_layer = slots_per_layer.max(slots.unwrap_or(0));
            slot_layers.push(slots.is_some());
        }
        let common = &self.spec.common;
        let cache = ExpertCache::new(
            options,
            &slot_layers,
            slots_per_layer,
            common.num_experts,
            common.num_experts_per_tok,
            statistics,
        );
        let counters = Arc::clone(cache.counters());
        self.expert_cache = Some(cache);
        Ok(counters)
    }

    /// Bytes one expert of this model takes in a slot (its bank stride), or `None` for a model
    /// without routed experts.
    pub fn expert_slot_bytes(&self) -> Option<u64> {
        self.moe_layers().next().map(|moe| moe.bank.expert_stride)
    }

    /// The MoE layers that placement covers: the decoder layers', then the MTP layer's.
    pub(in crate::model) fn placed_moe_layers(&self) -> impl Iterator<Item = &MoeLayer<B>> {
        self.feed_forwards()
            .filter_map(|feed_forward| match feed_forward {
                FeedForward::Moe(moe) => Some(moe),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
            })
    }

    /// The decoder layers' MoE layers, in order (the step graphs cover these only).
    pub(in crate::model) fn moe_layers(&self) -> impl Iterator<Item = &MoeLayer<B>> {
        self.layers
            .iter()
            .filter_map(|layer| match &layer.feed_forward {
                FeedForward::Moe(moe) => Some(moe),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
            })
    }

    /// What the MoE layers use during a forward that hands layers off through the host.
    pub(in crate::model) fn moe_context(&self) -> MoeContext<'_, B> {
        self.moe_context_with(None, None)
    }

    /// What the MoE layers use during a forward, with the backend's own hand-off if given.
    pub(in crate::model) fn moe_context_with<'a>(
        &'a self,
        worker_handoff: Option<&'a B::WorkerHandoff>,
        layerwise: Option<&'a LayerwiseStream<'a, B>>,
    ) -> MoeContext<'a, B> {
        MoeContext {
            backend: &self.backend,
            artifact: &self.artifact,
            executor: &*self.experts,
            profile: &self.profile,
            common: &self.spec.common,
            normalize_routing: self.spec.normalize_routing,
            staging: self.prefill_staging.as_ref(),
            expert_cache: self.expert_cache.as_ref(),
            worker_handoff,
            layerwise,
        }
    }
}
