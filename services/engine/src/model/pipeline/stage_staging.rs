//! Prefill staging on a split model: every stage gets its own staging slots (room for one
//! layer's experts, on its own backend) for its own MoE layers (the last stage's include the MTP
//! head's), readied from their banks, and a forward hands each stage's layers that stage's
//! slots. Layerwise prefill, whose stream plans every layer's copies over one set of slots, is
//! refused split.
//!
//! Owns: making the stages' staging slots. Must not touch: the staged route itself
//! (`crate::moe::layer`), the unsplit staging (`expert_placement.rs`).

use std::sync::Mutex;

use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::layers::FeedForward;
use crate::model::{Model, PrefillStagingOptions};
use crate::moe::layer::PrefillStaging;

impl<B: Backend> Model<B> {
    /// [`Model::enable_prefill_staging_with`] on a split model: the staged route on every stage
    /// that has MoE layers. Returns the bytes the slots take over all stages.
    pub(in crate::model) fn enable_prefill_staging_per_stage(
        &mut self,
        options: PrefillStagingOptions,
    ) -> Result<u64, EngineError> {
        if options.layerwise_min_tokens > 0 {
            return Err(EngineError::InvalidConfig {
                problem: "layerwise prefill is not available on a model split over several backends yet (the staged route is)".into(),
            });
        }
        if options.staged_min_tokens == 0 {
            return Ok(0);
        }
        let Some(layout) = self.staging_layout()? else {
            return Ok(0);
        };
        let num_experts = self.spec.common.num_experts;
        let mut bytes = 0u64;
        let mut per_stage = Vec::new();
        let stage_layers = self.pipeline_stage_layers();
        let last_stage = stage_layers.len() - 1;
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
            let mut slots = backend.new_expert_slots(&layout, num_experts, num_experts)?;
            // Ready the stage's banks now (on a GPU: page-lock them), as unsplit staging does.
            for bank in banks {
                backend.prepare_expert_source(&mut slots, &self.artifact, bank);
            }
            tracing::info!(stage, "prefill staging: the stage's expert banks readied");
            bytes += (num_experts * layout.stride) as u64;
            per_stage.push(Some(PrefillStaging {
                min_tokens: options.staged_min_tokens,
                slots: Mutex::new(slots),
                layerwise: None,
            }));
        }
        let mut per_stage = per_stage.into_iter();
        self.prefill_staging = per_stage.next().flatten();
        if let Some(stages) = self.pipeline.as_mut() {
            stages.later_staging = per_stage.collect();
        }
        Ok(bytes)
    }
}
