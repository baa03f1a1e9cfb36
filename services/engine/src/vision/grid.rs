//! The index math of image grids, shared by every backend: where each patch row sits in its
//! image, which learned position embeddings it blends and with what weights, its 2-D rotary
//! angles, and which rows attend to each other (docs/MODELS.md §10.5).

use crate::error::EngineError;

/// One image (or video) in patches: `temporal` frames of `height × width` patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageGrid {
    pub temporal: usize,
    pub height: usize,
    pub width: usize,
}

impl ImageGrid {
    pub fn patches(&self) -> usize {
        self.temporal * self.height * self.width
    }

    /// Checks that the grid divides into merge blocks.
    pub fn check(&self, merge: usize) -> Result<(), EngineError> {
        if self.patches() == 0 || self.height % merge != 0 || self.width % merge != 0 {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "image grid {}x{}x{} does not divide into {merge}x{merge} merge blocks",
                    self.temporal, self.height, self.width
                ),
            });
        }
        Ok(())
    }
}

/// (row, column) of every patch row of `grid`, in the processor's order: merge blocks in
/// raster order, the patches of a block in raster order, frames one after another.
pub fn patch_coordinates(grid: &ImageGrid, merge: usize) -> Vec<(usize, usize)> {
    let mut coordinates = Vec::with_capacity(grid.patches());
    for _ in 0..grid.temporal {
        for block_row in 0..grid.height / merge {
            for block_column in 0..grid.width / merge {
                for within_row in 0..merge {
                    for within_column in 0..merge {
                        coordinates.push((
                            block_row * merge + within_row,
                            block_column * merge + within_column,
                        ));
                    }
                }
            }
        }
    }
    coordinates
}

/// The four learned position-embedding rows a patch blends and their weights: bilinear
/// interpolation of the `side × side` table onto the image's grid with aligned corners, in f32
/// as `transformers` computes it.
pub fn position_embedding_taps(
    row: usize,
    column: usize,
    grid: &ImageGrid,
    side: usize,
) -> [(usize, f32); 4] {
    let axis = |index: usize, size: usize| -> [(usize, f32); 2] {
        let source = index as f32 * (side - 1) as f32 / size.saturating_sub(1).max(1) as f32;
        let floor = source.floor();
        let fraction = source - floor;
        let first = (floor as usize).min(side - 1);
        let second = (floor as usize + 1).min(side - 1);
        [(first, 1.0 - fraction), (second, fraction)]
    };
    let rows = axis(row, grid.height);
    let columns = axis(column, grid.width);
    [
        (rows[0].0 * side + columns[0].0, rows[0].1 * columns[0].1),
        (rows[0].0 * side + columns[1].0, rows[0].1 * columns[1].1),
        (rows[1].0 * side + columns[0].0, rows[1].1 * columns[0].1),
        (rows[1].0 * side + columns[1].0, rows[1].1 * columns[1].1),
    ]
}

/// The 2-D rotary angles of a patch at (`row`, `column`) for heads of `head_dim`: the row's
/// angles then the column's, `head_dim / 4` each, over `inverse_frequencies`; the caller
/// duplicates them across the two halves of the head.
pub fn rotary_angles(row: usize, column: usize, inverse_frequencies: &[f32]) -> Vec<f32> {
    inverse_frequencies
        .iter()
        .map(|frequency| row as f32 * frequency)
        .chain(
            inverse_frequencies
                .iter()
                .map(|frequency| column as f32 * frequency),
        )
        .collect()
}

/// `1 / θ^(2i / (head_dim / 2))` for `i < head_dim / 4`, in f32 as `transformers` computes it.
pub fn rotary_inverse_frequencies(head_dim: usize, theta: f64) -> Vec<f32> {
    crate::host_math::rope_inverse_frequencies(head_dim / 2, theta)
}

/// The row ranges that attend to each other: each frame of each image on its own.
pub fn attention_segments(grids: &[ImageGrid]) -> Vec<std::ops::Range<usize>> {
    let mut segments = Vec::new();
    let mut start = 0;
    for grid in grids {
        for _ in 0..grid.temporal {
            let end = start + grid.height * grid.width;
            segments.push(start..end);
            start = end;
        }
    }
    segments
}
