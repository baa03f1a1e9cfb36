//! A model split over several backends of one type, as a pipeline: each stage owns a contiguous
//! range of decoder layers with their weights, their part of every sequence's state (KV caches,
//! conv and recurrent states) and their expert slots; the embeddings live on the first stage,
//! the final norm and the output head on the last. A forward runs the stages in order and the
//! hidden state (the residual stream, and the last feed-forward's output that joins it) crosses
//! from one stage to the next through [`Backend::move_tensor_to`].
//!
//! A model of one stage has no [`PipelineStages`] at all: every accessor below then answers
//! the model's one backend, so the unsplit forward runs exactly the ops it always ran.
//!
//! Prefill staging and layerwise prefill run per stage: each stage has its own staging slots
//! for its own MoE layers (`pipeline/stage_staging.rs`) and a forward its own layerwise stream
//! per stage, and a forward crossing to a stage hands its layers that stage's slots and
//! stream. Layerwise streams of two stages copy at once, each over its own card's link.
//!
//! Decode steps go through step graphs that span every stage (`super::step_graphs`): the
//! first stage's graph records and replays, each later stage's holds its part's buffers.
//!
//! The MTP head follows the last decoder layer on the last stage, beside the output head its
//! rows draft through; its token embeddings are looked up on the first stage and cross to the
//! last, and its layer's routed experts use the last stage's slots and staging slots.
//!
//! A qwen4_exp model splits the same way: its residual streams cross between stages, each
//! layer's stream mixers, QSA indexer and PLE block (with their sequence states) live on the
//! layer's stage, and the final stream mixer beside the head.
//!
//! Each stage drives its own hand-off to the expert workers (`later_handoffs`; the first
//! stage's registers the channels, the others map that registration): a crossing hands the
//! MoE layers after it the next stage's. The protocol's sequence lives in the channels, and
//! the stages post one after another in stream order, so the workers see one stream of
//! requests. Where a later stage cannot open one, the host hands off every stage's layers.
//!
//! Owns: the stages and which stage a layer is on (here), the model's accessors of them and the
//! crossing between two stages (`pipeline/stage_access.rs`). Must not touch: the ops of a layer
//! (`forward.rs`), loading (`loading.rs`).

mod stage_access;
mod stage_staging;

use std::ops::Range;
use std::sync::Arc;

use ninfer_artifact::CommonConfig;

use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::worker_handoff::BackendHandoff;
use crate::moe::layer::PrefillStaging;
use crate::moe::ExpertExecutor;

/// One stage of a layer split: a backend and the decoder layers it owns.
pub struct PipelineStage<B: Backend> {
    pub backend: Arc<B>,
    pub layers: Range<usize>,
}

impl<B: Backend> PipelineStage<B> {
    /// The stages of `split`: stage `i` owns `split[i]` on `backends[i]` (as many stages as
    /// the shorter of the two lists).
    pub fn over(backends: &[Arc<B>], split: &[Range<usize>]) -> Vec<Self> {
        backends
            .iter()
            .zip(split)
            .map(|(backend, layers)| PipelineStage {
                backend: Arc::clone(backend),
                layers: layers.clone(),
            })
            .collect()
    }
}

/// The stage a forward crosses to: its index, backend and prefill staging slots.
pub(in crate::model) struct NextStage<'m, B: Backend> {
    pub(in crate::model) stage: usize,
    pub(in crate::model) backend: &'m B,
    pub(in crate::model) staging: Option<&'m PrefillStaging<B>>,
}

/// The stages of a model split over several backends.
pub(in crate::model) struct PipelineStages<B: Backend> {
    /// Every stage's backend, in layer order; the first is the model's `backend`.
    backends: Vec<Arc<B>>,
    /// Per decoder layer, the index of its stage in `backends`.
    stage_of_layer: Vec<usize>,
    /// Per stage after the first, its prefill staging slots (`None`: off, or no MoE layer);
    /// the first stage's are the model's `prefill_staging`, as unsplit.
    later_staging: Vec<Option<PrefillStaging<B>>>,
    /// Per stage after the first, its own hand-off to the expert workers (empty: the host
    /// hands off; the first stage's is the model's `worker_handoff`). Dropped before it: the
    /// first stage's registered the channels.
    later_handoffs: Vec<BackendHandoff<B>>,
}

impl<B: Backend> PipelineStages<B> {
    /// The first stage's backend and, for more than one stage, the stages: `stages` must
    /// cover the `layers` decoder layers once, in order, each stage at least one layer.
    pub(in crate::model) fn new(
        stages: Vec<PipelineStage<B>>,
        layers: usize,
    ) -> Result<(Arc<B>, Option<Self>), EngineError> {
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        let Some(first) = stages.first() else {
            return Err(invalid("a layer split of no stage".into()));
        };
        let first_backend = Arc::clone(&first.backend);
        let mut stage_of_layer = Vec::with_capacity(layers);
        for (index, stage) in stages.iter().enumerate() {
            if stage.layers.start != stage_of_layer.len() || stage.layers.is_empty() {
                return Err(invalid(format!(
                    "stage {index} of the layer split owns layers {:?}; the stages must own at least one layer each, one after another from layer 0",
                    stage.layers
                )));
            }
            stage_of_layer.extend(stage.layers.clone().map(|_| index));
        }
        if stage_of_layer.len() != layers {
            return Err(invalid(format!(
                "the layer split covers {} layers, the model has {layers}",
                stage_of_layer.len()
            )));
        }
        if stages.len() == 1 {
            return Ok((first_backend, None));
        }
        Ok((
            first_backend,
            Some(PipelineStages {
                later_staging: (1..stages.len()).map(|_| None).collect(),
                later_handoffs: Vec::new(),
                backends: stages.into_iter().map(|stage| stage.backend).collect(),
                stage_of_layer,
            }),
        ))
    }

    /// Opens every later stage's own hand-off to the workers of `experts`; false (and none
    /// kept) when a stage cannot have one.
    pub(in crate::model) fn open_later_handoffs(
        &mut self,
        experts: &Arc<dyn ExpertExecutor>,
        common: &CommonConfig,
    ) -> bool {
        let opened: Option<Vec<BackendHandoff<B>>> = self.backends[1..]
            .iter()
            .map(|backend| BackendHandoff::open(&**backend, experts, common))
            .collect();
        match opened {
            Some(handoffs) => {
                self.later_handoffs = handoffs;
                true
            }
            None => false,
        }
    }

    /// The backend of decoder layer `index`; past the decoder layers, the last stage's.
    pub(in crate::model) fn backend_of_layer(&self, index: usize) -> &B {
        let stage = self
            .stage_of_layer
            .get(index)
            .copied()
            .unwrap_or(self.backends.len() - 1);
        &self.backends[stage]
    }

    /// The last stage's backend (final norm, head).
    pub(in crate::model) fn last(&self) -> &B {
        let last = self.backends.len() - 1;
        &self.backends[last]
    }

    /// When layer `index + 1` runs on another stage than layer `index`: that stage's backend
    /// and its prefill staging slots.
    pub(in crate::model) fn next_stage_after(&self, index: usize) -> Option<NextStage<'_, B>> {
        let here = self.stage_of_layer.get(index)?;
        let next = *self.stage_of_layer.get(index + 1)?;
        let staging = next
            .checked_sub(1)
            .and_then(|later| self.later_staging.get(later))
            .and_then(Option::as_ref);
        (*here != next).then(|| NextStage {
            stage: next,
            backend: &*self.backends[next],
            staging,
        })
    }

    fn layer_ranges(&self) -> Vec<Range<usize>> {
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(self.backends.len());
        for (layer, &stage) in self.stage_of_layer.iter().enumerate() {
            match ranges.get_mut(stage) {
                Some(range) => range.end = layer + 1,
                None => ranges.push(layer..layer + 1),
            }
        }
        ranges
    }
}

/// The backend of layer `index` of a model whose fields are `backend` and `pipeline` (for
/// callers that hold another field of the model mutably).
pub(in crate::model) fn stage_backend<'m, B: Backend>(
    backend: &'m Arc<B>,
    pipeline: &'m Option<PipelineStages<B>>,
    index: usize,
) -> &'m B {
    match pipeline {
        None => backend,
        Some(stages) => stages.backend_of_layer(index),
    }
}
