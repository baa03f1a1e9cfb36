//! Each stage's prefill staging slots: the first stage's are the model's `prefill_staging` (the
//! only ones unsplit), the later stages' live with the stages; a forward crossing to a stage
//! hands its layers that stage's slots (`NextStage`).
//!
//! Owns: where the stages' staging slots are kept and found. Must not touch: making them
//! (`prefill_staging.rs`), the staged and streamed routes (`crate::moe`).

use crate::backend::Backend;
use crate::model::Model;
use crate::moe::layer::PrefillStaging;

impl<B: Backend> Model<B> {
    /// Every stage's staging slots, in stage order (`None` where a stage has none).
    pub(in crate::model) fn stage_stagings(
        &self,
    ) -> impl Iterator<Item = Option<&PrefillStaging<B>>> {
        let later = self
            .pipeline
            .as_ref()
            .map(|stages| stages.later_staging.as_slice())
            .unwrap_or_default();
        std::iter::once(self.prefill_staging.as_ref()).chain(later.iter().map(Option::as_ref))
    }

    /// Replaces every stage's staging slots (`per_stage` in stage order).
    pub(in crate::model) fn set_stage_stagings(
        &mut self,
        per_stage: Vec<Option<PrefillStaging<B>>>,
    ) {
        let mut per_stage = per_stage.into_iter();
        self.prefill_staging = per_stage.next().flatten();
        if let Some(stages) = self.pipeline.as_mut() {
            stages.later_staging = per_stage.collect();
            stages
                .later_staging
                .resize_with(stages.backends.len() - 1, || None);
        }
    }

    /// The staging slots of the stage that runs decoder layer `layer`.
    pub(in crate::model) fn staging_of_layer(&self, layer: usize) -> Option<&PrefillStaging<B>> {
        let stage = match &self.pipeline {
            None => 0,
            Some(stages) => stages.stage_of_layer.get(layer).copied()?,
        };
        self.stage_stagings().nth(stage).flatten()
    }
}
