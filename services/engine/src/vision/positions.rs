//! The decoder's three position streams of a prompt with images (docs/MODELS.md §10.6,
//! `get_rope_index`): text tokens count on in all three; an image's tokens take (start + frame,
//! start + row, start + column) over its merged grid, and the count then jumps by the grid's
//! longer side. Later tokens add the prompt's `delta` to their index in all three.

use crate::error::EngineError;
use crate::vision::grid::ImageGrid;

/// The positions of a prompt's tokens and what later tokens add to their index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultimodalPositions {
    /// (temporal, height, width) of each prompt token.
    pub streams: Vec<[usize; 3]>,
    /// `max(positions) + 1 − prompt length`: a token at index `i` after the prompt sits at
    /// `i + delta` in every stream.
    pub delta: i64,
}

/// The positions of `token_ids`, whose runs of `image_token_id` are the images of `grids` in
/// order (each run exactly one image's `t·h·w / merge²` tokens).
pub fn multimodal_positions(
    token_ids: &[u32],
    image_token_id: u32,
    grids: &[ImageGrid],
    merge: usize,
) -> Result<MultimodalPositions, EngineError> {
    multimodal_positions_of(token_ids, &[image_token_id], grids, merge)
}

/// [`multimodal_positions`] where a run of any one of `placeholders` is a picture: an image, or
/// one frame pair of a video (whose grid is that of one temporal patch; the timestamps between
/// pairs are text).
pub fn multimodal_positions_of(
    token_ids: &[u32],
    placeholders: &[u32],
    grids: &[ImageGrid],
    merge: usize,
) -> Result<MultimodalPositions, EngineError> {
    let invalid = |problem: String| EngineError::InvalidConfig { problem };
    let mut streams = Vec::with_capacity(token_ids.len());
    let mut next = 0usize;
    let mut images = grids.iter();
    let mut index = 0;
    while index < token_ids.len() {
        let token = token_ids[index];
        if !placeholders.contains(&token) {
            streams.push([next; 3]);
            next += 1;
            index += 1;
            continue;
        }
        let run = token_ids[index..]
            .iter()
            .take_while(|&&next| next == token)
            .count();
        let grid = images.next().ok_or_else(|| {
            invalid(format!(
                "the prompt has more image placeholder runs than the {} image(s) given",
                grids.len()
            ))
        })?;
        grid.check(merge)?;
        let (rows, columns) = (grid.height / merge, grid.width / merge);
        if run != grid.temporal * rows * columns {
            return Err(invalid(format!(
                "an image placeholder run of {run} tokens for an image of {} tokens",
                grid.temporal * rows * columns
            )));
        }
        for frame in 0..grid.temporal {
            for row in 0..rows {
                for column in 0..columns {
                    streams.push([next + frame, next + row, next + column]);
                }
            }
        }
        next += grid.height.max(grid.width) / merge;
        index += run;
    }
    if images.next().is_some() {
        return Err(invalid(format!(
            "{} image(s) given for fewer placeholder runs",
            grids.len()
        )));
    }
    let largest = streams
        .iter()
        .flatten()
        .copied()
        .max()
        .map_or(-1, |v| v as i64);
    Ok(MultimodalPositions {
        delta: largest + 1 - streams.len() as i64,
        streams,
    })
}
