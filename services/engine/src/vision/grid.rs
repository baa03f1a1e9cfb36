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

/// What a device forward reads per patch row, laid out as flat tables (rows in the processor's
/// order, images one after another): the four position-embedding taps, the rotary cosines and
/// sines (`head_dim / 2` per row: the row's angles then the column's), and the key range each
/// row attends to (its frame's rows).
#[derive(Debug, Clone, PartialEq)]
pub struct PatchTables {
    /// `[rows, 4]` rows of the learned position table.
    pub tap_index: Vec<u32>,
    /// `[rows, 4]` their weights.
    pub tap_weight: Vec<f32>,
    /// `[rows, head_dim / 2]`.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// First row of each row's segment, and one past its last.
    pub first_key: Vec<u32>,
    pub end_key: Vec<u32>,
}

/// The [`PatchTables`] of `grids` for heads of `head_dim`, the same numbers the host forward
/// computes (f32 angles, f32 `cos` / `sin`).
pub fn patch_tables(
    grids: &[ImageGrid],
    merge: usize,
    position_side: usize,
    head_dim: usize,
    rope_theta: f64,
) -> Result<PatchTables, EngineError> {
    let rows: usize = grids.iter().map(ImageGrid::patches).sum();
    let too_many = || EngineError::InvalidConfig {
        problem: format!("{rows} patch rows do not fit 32-bit indices"),
    };
    let index = |value: usize| u32::try_from(value).map_err(|_| too_many());
    let inverse_frequencies = rotary_inverse_frequencies(head_dim, rope_theta);
    let mut tables = PatchTables {
        tap_index: Vec::with_capacity(rows * 4),
        tap_weight: Vec::with_capacity(rows * 4),
        cos: Vec::with_capacity(rows * head_dim / 2),
        sin: Vec::with_capacity(rows * head_dim / 2),
        first_key: Vec::with_capacity(rows),
        end_key: Vec::with_capacity(rows),
    };
    for grid in grids {
        for (row, column) in patch_coordinates(grid, merge) {
            for (tap, weight) in position_embedding_taps(row, column, grid, position_side) {
                tables.tap_index.push(index(tap)?);
                tables.tap_weight.push(weight);
            }
            for angle in rotary_angles(row, column, &inverse_frequencies) {
                tables.cos.push(angle.cos());
                tables.sin.push(angle.sin());
            }
        }
    }
    for segment in attention_segments(grids) {
        let (first, end) = (index(segment.start)?, index(segment.end)?);
        for _ in segment {
            tables.first_key.push(first);
            tables.end_key.push(end);
        }
    }
    Ok(tables)
}
