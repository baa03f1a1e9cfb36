//! A prompt's images in the decoder (docs/MODELS.md §10.5, §10.6): the encoded image tokens'
//! embeddings replace the `<|image_pad|>` embeddings (a video's frame pairs: `<|video_pad|>`,
//! one run per pair, each placed as an image), and every prompt token turns by its three
//! position streams. Attached to a new sequence before its prompt is processed; the forward
//! reads them through the batch plan.
//!
//! Each attached image gets a key of what the decoder sees of it (its grid and its tokens'
//! embeddings), which the prefix cache names blocks by, so a cached prefix is reused only for
//! the same images.
//!
//! Owns: checking and attaching a prompt's images, their keys. Must not touch: the vision
//! tower's math (`crate::vision`), the forward's ops.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::layers::{ImageKey, SequenceImages, SequenceState};
use crate::model::Model;
use crate::vision::{multimodal_positions_of, ImageGrid, ImagePlacement};

/// The keys of images `grids` whose tokens sit at `image_tokens` (ascending, runs in image
/// order) with `embeddings` (`hidden` values per token).
fn image_keys(
    grids: &[ImageGrid],
    merge_unit: usize,
    image_tokens: &[usize],
    embeddings: &[f32],
    hidden: usize,
) -> Vec<ImageKey> {
    let mut keys = Vec::with_capacity(grids.len());
    let mut first = 0;
    for grid in grids {
        let tokens = grid.patches() / merge_unit;
        let Some(&first_token) = image_tokens.get(first) else {
            break;
        };
        let mut bytes = Vec::with_capacity(24 + tokens * hidden * 4);
        for side in [grid.temporal, grid.height, grid.width] {
            bytes.extend_from_slice(&(side as u64).to_le_bytes());
        }
        let rows = embeddings.get(first * hidden..(first + tokens) * hidden);
        bytes.extend_from_slice(bytemuck::cast_slice(rows.unwrap_or_default()));
        keys.push(ImageKey {
            first_token,
            tokens,
            content: xxhash_rust::xxh3::xxh3_128(&bytes),
        });
        first += tokens;
    }
    keys
}

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
        let placeholders = placement.placeholder_tokens();
        let positions =
            multimodal_positions_of(prompt, &placeholders, grids, placement.spatial_merge_size)?;
        let image_tokens: Vec<usize> = prompt
            .iter()
            .enumerate()
            .filter(|(_, token)| placeholders.contains(token))
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
        let merge_unit = placement.spatial_merge_size * placement.spatial_merge_size;
        let keys = image_keys(grids, merge_unit, &image_tokens, &embeddings, hidden);
        state.images = Some(Arc::new(SequenceImages {
            keys,
            streams: positions.streams,
            delta: positions.delta,
            section: placement.mrope_section,
            image_tokens,
            embeddings,
        }));
        Ok(())
    }
}
