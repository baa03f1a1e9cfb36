//! The model's side of its pipeline stages: the backend of a layer, of the output head, the
//! stages' layers, the crossing of the hidden state from one stage to the next, and what the
//! MTP head on the last stage needs from the others (embeddings, its MoE context).
//!
//! Owns: those accessors. Must not touch: the stages themselves (`super`), the forward.

use std::ops::Range;
use std::sync::Arc;

use super::{stage_backend, NextStage};
use crate::backend::{Backend, HostKvRequest, KvPlacement};
use crate::error::EngineError;
use crate::model::worker_handoff::BackendHandoff;
use crate::model::Model;
use crate::moe::gpu_split::stage_host_kv_bytes;
use crate::moe::layer::MoeContext;
use crate::spec::MixerKind;

impl<B: Backend> Model<B> {
    /// The backend decoder layer `index` runs on (past the decoder layers: the last stage's).
    pub(in crate::model) fn layer_backend(&self, index: usize) -> &B {
        stage_backend(&self.backend, &self.pipeline, index)
    }

    /// The backend of the final norm and the output head: the last stage's. Tensors of
    /// [`Model::forward_logits_on_backend`], [`Model::forward_hidden`] and
    /// [`Model::head_logits_on_backend`] live there (with one stage, [`Model::backend`]).
    pub fn output_backend(&self) -> &B {
        match &self.pipeline {
            None => &self.backend,
            Some(stages) => stages.last(),
        }
    }

    /// What a MoE layer on the last stage uses (the MTP head's layer, which follows the last
    /// decoder layer): the last stage's backend and prefill staging slots.
    pub(in crate::model) fn output_stage_moe_context(&self) -> MoeContext<'_, B> {
        let mut context = self.moe_context();
        if let Some(stages) = &self.pipeline {
            context.backend = stages.last();
            context.staging = stages.later_staging.last().and_then(Option::as_ref);
        }
        context
    }

    /// Token embeddings (looked up on the first stage, where the table is) on the last stage.
    pub(in crate::model) fn embed_on_output_stage(
        &self,
        tokens: &[u32],
    ) -> Result<B::Tensor, EngineError> {
        let embedded = self.backend.embed(&self.embed_tokens, tokens)?;
        match &self.pipeline {
            None => Ok(embedded),
            Some(stages) => self.backend.move_tensor_to(&embedded, stages.last()),
        }
    }

    /// The decoder layers of each stage, in order (one range of every layer when unsplit).
    pub fn pipeline_stage_layers(&self) -> Vec<Range<usize>> {
        match &self.pipeline {
            #[allow(clippy::single_range_in_vec_init)] // one stage: one range, not its layers
            None => vec![0..self.layers.len()],
            Some(stages) => stages.layer_ranges(),
        }
    }

    /// The backends of the stages after the first, in order (none when unsplit).
    pub(in crate::model) fn later_stage_backends(&self) -> &[Arc<B>] {
        match &self.pipeline {
            None => &[],
            Some(stages) => stages.backends.get(1..).unwrap_or_default(),
        }
    }

    /// Waits until every stage's queued ops have run.
    pub(in crate::model) fn wait_for_every_stage(&self) -> Result<(), EngineError> {
        self.backend.wait_for_queued_ops()?;
        for backend in self.later_stage_backends() {
            backend.wait_for_queued_ops()?;
        }
        Ok(())
    }

    /// Per stage, the attention layers whose KV caches it holds (the MTP head's on the last).
    pub fn attention_layers_per_stage(&self) -> Vec<usize> {
        let mut counts: Vec<usize> = self
            .pipeline_stage_layers()
            .into_iter()
            .map(|layers| {
                self.spec.mixers[layers]
                    .iter()
                    .filter(|&&mixer| mixer == MixerKind::Attention)
                    .count()
            })
            .collect();
        if let (true, Some(last)) = (self.mtp.is_some(), counts.last_mut()) {
            *last += 1;
        }
        counts
    }

    /// `--host-kv-mib` on every stage: each stage's backend reserves its own page-locked KV
    /// pool, its share of `request.host_bytes` in proportion to the KV caches its layers make
    /// ([`stage_host_kv_bytes`]), with the request's GPU share rule for its own card.
    pub fn reserve_host_kv(&self, request: &HostKvRequest) -> Result<(), EngineError> {
        let shares = stage_host_kv_bytes(request.host_bytes, &self.attention_layers_per_stage());
        let backends = std::iter::once(&*self.backend)
            .chain(self.later_stage_backends().iter().map(|backend| &**backend));
        for (backend, host_bytes) in backends.zip(shares) {
            backend.reserve_host_kv(&HostKvRequest {
                host_bytes,
                device_share: request.device_share,
            })?;
        }
        Ok(())
    }

    /// Where the live KV caches are, over every stage (`None` without a host KV pool).
    pub fn kv_placement(&self) -> Option<KvPlacement> {
        let backends = std::iter::once(&*self.backend)
            .chain(self.later_stage_backends().iter().map(|backend| &**backend));
        backends
            .filter_map(|backend| backend.kv_placement())
            .reduce(|sum, stage| KvPlacement {
                device_caches: sum.device_caches + stage.device_caches,
                device_bytes: sum.device_bytes + stage.device_bytes,
                host_caches: sum.host_caches + stage.host_caches,
                host_bytes: sum.host_bytes + stage.host_bytes,
                host_pool_bytes: sum.host_pool_bytes + stage.host_pool_bytes,
                device_share_bytes: match (sum.device_share_bytes, stage.device_share_bytes) {
                    (Some(a), Some(b)) => Some(a + b),
                    (a, b) => a.or(b),
                },
            })
    }

    /// The later stages' own hand-offs to the workers (none when unsplit, or when the host
    /// hands a split's layers off).
    pub(in crate::model) fn later_stage_handoffs(&self) -> &[BackendHandoff<B>] {
        match &self.pipeline {
            None => &[],
            Some(stages) => &stages.later_handoffs,
        }
    }

    /// Whether the model is split over several backends.
    pub fn is_split(&self) -> bool {
        self.pipeline.is_some()
    }

    /// After layer `index`: when the next layer runs on another stage, `carried` (the residual
    /// stream and the output that joins it; a qwen4_exp model's residual streams) moved there,
    /// and that stage's backend and prefill staging slots. The residual add and the next
    /// layer's input norm then run on the next stage, as one op, exactly as the unsplit model
    /// runs them.
    pub(in crate::model) fn cross_to_next_stage(
        &self,
        index: usize,
        carried: &mut [&mut B::Tensor],
    ) -> Result<Option<NextStage<'_, B>>, EngineError> {
        let Some(stages) = &self.pipeline else {
            return Ok(None);
        };
        let Some(next) = stages.next_stage_after(index) else {
            return Ok(None);
        };
        let here = stages.backend_of_layer(index);
        for tensor in carried.iter_mut() {
            **tensor = here.move_tensor_to(tensor, next.backend)?;
        }
        Ok(Some(next))
    }
}
