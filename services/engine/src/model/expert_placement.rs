//! Where a model's routed experts run: resident experts placed into GPU slots, the dynamic
//! expert cache, and the MoE context a forward hands its layers (prefill staging and layerwise
//! streaming: `prefill_staging.rs`).
//!
//! Owns: those settings of a loaded model and their reports. Must not touch: the MoE layer's
//! own forward (`crate::moe::layer`).

use std::sync::Arc;

use crate::backend::{Backend, WithExpertSlotTable};
use crate::error::EngineError;
use crate::model::layers::FeedForward;
use crate::model::pipeline::stage_backend;
use crate::model::Model;
use crate::moe::expert_cache::{ExpertCache, ExpertCacheCounters, ExpertCacheOptions};
use crate::moe::layer::{MoeContext, MoeLayer};
use crate::moe::layerwise::LayerwiseStream;
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

    /// The experts in each placement layer's resident slots now, ascending (empty for a layer
    /// without slots or routed experts): what the start-up placement and the expert cache have
    /// made of the slots.
    pub fn resident_experts(&self) -> Result<Vec<Vec<usize>>, EngineError> {
        self.feed_forwards()
            .map(|feed_forward| match feed_forward {
                FeedForward::Moe(moe) => moe.resident_experts(),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => Ok(Vec::new()),
            })
            .collect()
    }

    /// The placement index of the MTP layer (it follows the decoder layers).
    pub fn mtp_layer_index(&self) -> usize {
        self.layers.len()
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
