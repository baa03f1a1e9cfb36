//! Prefill staging and layerwise prefill of a loaded model: each stage's staging slots (one
//! stage unsplit; a split gives every stage its own, for its own MoE layers, the last stage's
//! including the MTP head's), the throughputs layerwise prefill chooses each layer's split
//! from (measured on the first MoE layer's stage, the same on every stage), the split summary
//! the bench prints, and each forward's layerwise streams, one per stage.
//!
//! Owns: those settings and streams of a loaded model. Must not touch: the staged and streamed
//! routes themselves (`crate::moe::layer`, `crate::moe::layerwise`), resident placement and the
//! cache (`expert_placement.rs`).

use std::sync::{Mutex, RwLock};
use std::time::Instant;

use ninfer_cpu_experts::ExpertLayout;

use crate::backend::{Backend, ExpertSlotFills, Routing};
use crate::error::EngineError;
use crate::model::layers::FeedForward;
use crate::model::{LayerwiseSummary, Model, PrefillStagingOptions};
use crate::moe::layer::{LayerwiseSettings, MoeLayer, PrefillStaging};
use crate::moe::layerwise::{
    layer_split, streamed_expert_count, LayerBatch, LayerPlan, LayerSplit, LayerwiseStream,
    PrefillThroughputs,
};
use crate::moe::ExpertBatch;

impl<B: Backend> Model<B> {
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
        if options.staged_min_tokens == 0 && options.layerwise_min_tokens == 0 {
            return Ok(0);
        }
        let Some(layout) = self.staging_layout()? else {
            return Ok(0);
        };
        let common = &self.spec.common;
        let num_experts = common.num_experts;
        let halves = if options.layerwise_min_tokens > 0 {
            2
        } else {
            1
        };
        let flops_per_pair = 6.0 * common.hidden_size as f64 * common.moe_intermediate_size as f64;
        // Each stage stages its own layers' experts in its own slots (one stage unsplit).
        let stage_layers = self.pipeline_stage_layers();
        let last_stage = stage_layers.len() - 1;
        let mut bytes = 0u64;
        let mut per_stage = Vec::with_capacity(stage_layers.len());
        for (stage, layers) in stage_layers.into_iter().enumerate() {
            let backend = self.layer_backend(layers.start);
            // The last stage also runs the MTP head's layer.
            let mtp_layer = self
                .mtp
                .as_ref()
                .filter(|_| stage == last_stage)
                .map(|head| &head.layer);
            let banks: Vec<_> = self.layers[layers]
                .iter()
                .chain(mtp_layer)
                .filter_map(|layer| match &layer.feed_forward {
                    FeedForward::Moe(moe) => Some(&moe.bank),
                    FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
                })
                .collect();
            if banks.is_empty() {
                per_stage.push(None);
                continue;
            }
            let mut slots = backend.new_expert_slots(&layout, num_experts, halves * num_experts)?;
            // Ready every bank now (on a GPU: page-lock it), so the first long prompt does not
            // pay for it: the first 4K prefill measured 30% slower than the second before this.
            let started = Instant::now();
            for bank in banks {
                backend.prepare_expert_source(&mut slots, &self.artifact, bank);
            }
            tracing::info!(
                stage,
                seconds = started.elapsed().as_secs_f64(),
                "prefill staging: expert banks readied as copy sources"
            );
            bytes += (halves * num_experts * layout.stride) as u64;
            per_stage.push(Some(PrefillStaging {
                min_tokens: match options.staged_min_tokens {
                    0 => usize::MAX,
                    tokens => tokens,
                },
                slots: Mutex::new(slots),
                layerwise: (options.layerwise_min_tokens > 0).then(|| LayerwiseSettings {
                    min_tokens: options.layerwise_min_tokens,
                    throughputs: RwLock::new(PrefillThroughputs::unmeasured(flops_per_pair)),
                }),
            }));
        }
        self.set_stage_stagings(per_stage);
        Ok(bytes)
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

    /// The layerwise settings of the first stage that has them (every stage's are alike).
    pub(in crate::model) fn layerwise_settings(&self) -> Result<&LayerwiseSettings, EngineError> {
        self.stage_stagings()
            .flatten()
            .find_map(|staging| staging.layerwise.as_ref())
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "layerwise prefill is not enabled".into(),
            })
    }

    /// What layerwise prefill chooses each layer's split from, from now on (on every stage).
    pub fn set_prefill_throughputs(
        &self,
        throughputs: PrefillThroughputs,
    ) -> Result<(), EngineError> {
        self.layerwise_settings()?;
        for settings in self
            .stage_stagings()
            .flatten()
            .filter_map(|staging| staging.layerwise.as_ref())
        {
            *settings
                .throughputs
                .write()
                .map_err(|_| EngineError::InvalidConfig {
                    problem: "the prefill throughputs' lock is poisoned".into(),
                })? = throughputs;
        }
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
        self.layerwise_settings()?;
        let Some((layer, moe)) = self.indexed_moe_layers().next() else {
            return Err(EngineError::InvalidConfig {
                problem: "the model has no MoE layer to measure".into(),
            });
        };
        // The first MoE layer's stage: its backend and its staging slots.
        let backend = self.layer_backend(layer);
        let staging = self
            .staging_of_layer(layer)
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "layerwise prefill is not enabled".into(),
            })?;
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
            backend.wait_for_queued_ops()?;
            let started = Instant::now();
            slots.start_batch_fill(0, &all, &self.artifact, &moe.bank)?;
            slots.complete_batch_fill()?;
            backend.wait_for_queued_ops()?;
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
        let x = backend.upload(&hidden_values(backend_tokens), backend_tokens, hidden)?;
        let routing = uniform(backend_tokens);
        let mut backend_seconds = f64::INFINITY;
        for run in 0..2 {
            backend.wait_for_queued_ops()?;
            let started = Instant::now();
            let out = backend.slotted_experts(&slots, &x, &routing)?;
            backend.wait_for_queued_ops()?;
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
        self.set_prefill_throughputs(throughputs)?;
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

    /// The layerwise streams of a forward of `rows` rows, one per stage (`None` where the
    /// stage does not stream: layerwise prefill off, a batch too small, or every expert of its
    /// layers resident): the split of each of the stage's decoder MoE layers with experts
    /// outside its resident slots, then the first copies started.
    pub(in crate::model) fn layerwise_streams(
        &self,
        rows: usize,
    ) -> Result<Vec<Option<LayerwiseStream<'_, B>>>, EngineError> {
        let stage_layers = self.pipeline_stage_layers();
        let mut streams = Vec::with_capacity(stage_layers.len());
        for (staging, layers) in self.stage_stagings().zip(stage_layers) {
            let Some(staging) = staging.filter(|staging| {
                staging
                    .layerwise
                    .as_ref()
                    .is_some_and(|settings| rows >= settings.min_tokens)
            }) else {
                streams.push(None);
                continue;
            };
            let throughputs =
                self.prefill_throughputs()
                    .ok_or_else(|| EngineError::InvalidConfig {
                        problem: "the prefill throughputs' lock is poisoned".into(),
                    })?;
            let mut plans = Vec::new();
            for (layer, moe) in self
                .indexed_moe_layers()
                .filter(|(layer, _)| layers.contains(layer))
            {
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
            streams.push(if plans.is_empty() {
                None
            } else {
                Some(LayerwiseStream::start(
                    &staging.slots,
                    &self.artifact,
                    plans,
                    self.spec.common.num_experts,
                )?)
            });
        }
        Ok(streams)
    }
}
