//! A prompt's images in the decoder (docs/MODELS.md §10.5, §10.6): the encoded image tokens'
//! embeddings replace the `<|image_pad|>` embeddings, and every prompt token turns by its three
//! position streams. Attached to a new sequence before its prompt is processed; the forward
//! reads them through the batch plan.
//!
//! Owns: checking and attaching a prompt's images. Must not touch: the vision tower's math
//! (`crate::vision`), the forward's ops.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::layers::{SequenceImages, SequenceState};
use crate::model::Model;
use crate::vision::{multimodal_positions, ImageGrid, ImagePlacement};

impl<B: Backend> Model<B> {
    /// Attaches the images of `prompt` (its whole token ids, placeholders expanded) to a
    /// sequence that has processed nothing yet: `embeddings` are the vision tower's output for
    /// `grids` (`[image tokens, hidden]`, images in prompt order). The prompt is then fed as
    /// usual, in one forward or in chunks.
    pub fn attach_images(
        &self,
        state: &mut SequenceState<B>,
        prompt: &[u32],
        grids: &[ImageGrid],
        embeddings: Vec<f32>,
    ) -> Result<(), EngineError> {
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        if state.position != 0 {
            return Err(invalid(format!(
                "images are attached before the prompt; the sequence holds {} tokens",
                state.position
            )));
        }
        let placement = ImagePlacement::from_artifact(&self.artifact)?
            .ok_or_else(|| invalid("the model has no vision tower".into()))?;
        let positions = multimodal_positions(
            prompt,
            placement.image_token_id,
            grids,
            placement.spatial_merge_size,
        )?;
        let image_tokens: Vec<usize> = prompt
            .iter()
            .enumerate()
            .filter(|(_, &token)| token == placement.image_token_id)
            .map(|(index, _)| index)
            .collect();
        let hidden = self.spec.common.hidden_size;
        if embeddings.len() != image_tokens.len() * hidden {
            return Err(invalid(format!(
                "{} image embedding values for {} image tokens of width {hidden}",
                embeddings.len(),
                image_tokens.len()
            )));
        }
        state.images = Some(Arc::new(SequenceImages {
            streams: positions.streams,
            delta: positions.delta,
            section: placement.mrope_section,
            image_tokens,
            embeddings,
        }));
        Ok(())
    }
}
