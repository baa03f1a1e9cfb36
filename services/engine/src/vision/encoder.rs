//! The vision tower's forward in f32 on the host (docs/MODELS.md §10.5): patch embedding,
//! interpolated learned positions, the blocks with 2-D rotary attention within each image, and
//! the patch merger. It is the reference the device paths are held to, and the CPU backend's
//! way to see images.

use ninfer_artifact::DType;

use crate::error::EngineError;
use crate::vision::grid::{
    attention_segments, patch_coordinates, position_embedding_taps, rotary_angles,
    rotary_inverse_frequencies, ImageGrid,
};
use crate::vision::weights::{LayerNorm, Linear, VisionWeights};
use crate::weights::WeightMatrix;

/// LayerNorm's epsilon in every norm of the tower.
const LAYER_NORM_EPS: f64 = 1e-6;

/// What the tower makes of a batch of images.
#[derive(Debug, Clone)]
pub struct VisionOutput {
    /// The last block's output, one row of `hidden_size` per patch row.
    pub last_hidden_state: Vec<f32>,
    /// The merger's output: one row of `out_hidden_size` per image token, images in order.
    pub merged: Vec<f32>,
    /// Image tokens of each image.
    pub tokens_per_image: Vec<usize>,
}

/// Runs the tower over the patch rows of `grids` (their rows one image after another, as the
/// image processor lays them out).
pub fn encode_images(
    weights: &VisionWeights,
    pixel_rows: &[f32],
    grids: &[ImageGrid],
) -> Result<VisionOutput, EngineError> {
    let config = &weights.config;
    let merge = config.spatial_merge_size;
    for grid in grids {
        grid.check(merge)?;
    }
    let rows: usize = grids.iter().map(ImageGrid::patches).sum();
    if pixel_rows.len() != rows * config.patch_row_len() {
        return Err(EngineError::InvalidConfig {
            problem: format!(
                "{} pixel values for {rows} patch rows of {}",
                pixel_rows.len(),
                config.patch_row_len()
            ),
        });
    }
    let hidden = config.hidden_size;
    let side = config.position_grid_side();

    let mut x = linear(&weights.patch_embed, pixel_rows, rows)?;
    let mut coordinates = Vec::with_capacity(rows);
    for grid in grids {
        for (row, column) in patch_coordinates(grid, merge) {
            coordinates.push((row, column, *grid));
        }
    }
    for (patch, &(row, column, grid)) in coordinates.iter().enumerate() {
        let mut position = vec![0.0f32; hidden];
        for (index, weight) in position_embedding_taps(row, column, &grid, side) {
            let embedding = &weights.position_embeddings[index * hidden..(index + 1) * hidden];
            for (sum, value) in position.iter_mut().zip(embedding) {
                *sum += value * weight;
            }
        }
        for (value, offset) in x[patch * hidden..(patch + 1) * hidden]
            .iter_mut()
            .zip(position)
        {
            *value += offset;
        }
    }

    let head_dim = config.head_dim();
    let inverse_frequencies = rotary_inverse_frequencies(head_dim, config.rope_theta());
    let rotations: Vec<(Vec<f32>, Vec<f32>)> = coordinates
        .iter()
        .map(|&(row, column, _)| {
            let angles = rotary_angles(row, column, &inverse_frequencies);
            (
                angles.iter().map(|a| a.cos()).collect(),
                angles.iter().map(|a| a.sin()).collect(),
            )
        })
        .collect();
    let segments = attention_segments(grids);

    for block in &weights.blocks {
        let normed = layer_norm(&x, &block.norm1, hidden);
        let qkv = linear(&block.qkv, &normed, rows)?;
        let attended = attention(
            &qkv,
            rows,
            config.num_heads,
            head_dim,
            &rotations,
            &segments,
        );
        add_assign(&mut x, &linear(&block.proj, &attended, rows)?);
        let normed = layer_norm(&x, &block.norm2, hidden);
        let mut inner = linear(&block.fc1, &normed, rows)?;
        inner.iter_mut().for_each(|v| *v = gelu_tanh(*v));
        add_assign(&mut x, &linear(&block.fc2, &inner, rows)?);
    }

    // The merger: a norm per patch row, then each merge block's rows side by side.
    let normed = layer_norm(&x, &weights.merger_norm, hidden);
    let tokens = rows / config.merge_unit();
    let mut inner = linear(&weights.merger_fc1, &normed, tokens)?;
    inner.iter_mut().for_each(|v| *v = gelu_exact(*v));
    let merged = linear(&weights.merger_fc2, &inner, tokens)?;
    Ok(VisionOutput {
        last_hidden_state: x,
        merged,
        tokens_per_image: grids
            .iter()
            .map(|grid| grid.patches() / config.merge_unit())
            .collect(),
    })
}

/// `x Wᵀ + b` over `rows` rows of `x`.
fn linear(layer: &Linear, x: &[f32], rows: usize) -> Result<Vec<f32>, EngineError> {
    let matrix = WeightMatrix::from_raw(
        DType::F32,
        layer.outputs,
        layer.inputs,
        bytemuck::cast_slice(&layer.weight),
    )?;
    let mut out = vec![0.0f32; rows * layer.outputs];
    matrix.matmul(x, rows, &mut out);
    for row in out.chunks_exact_mut(layer.outputs) {
        for (value, bias) in row.iter_mut().zip(&layer.bias) {
            *value += bias;
        }
    }
    Ok(out)
}

/// LayerNorm over rows of `width` (biased variance, statistics in f64).
fn layer_norm(x: &[f32], norm: &LayerNorm, width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(width) {
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / width as f64;
        let variance = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / width as f64;
        let scale = 1.0 / (variance + LAYER_NORM_EPS).sqrt();
        out.extend(
            row.iter()
                .zip(norm.weight.iter().zip(&norm.bias))
                .map(|(&v, (&w, &b))| ((f64::from(v) - mean) * scale) as f32 * w + b),
        );
    }
    out
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Bidirectional attention within each segment, q and k rotated by their patch's 2-D angles
/// (rotate-half pairing over the whole head), softmax in f32.
fn attention(
    qkv: &[f32],
    rows: usize,
    heads: usize,
    head_dim: usize,
    rotations: &[(Vec<f32>, Vec<f32>)],
    segments: &[std::ops::Range<usize>],
) -> Vec<f32> {
    let hidden = heads * head_dim;
    let half = head_dim / 2;
    let rotate = |head: &[f32], (cos, sin): &(Vec<f32>, Vec<f32>)| -> Vec<f32> {
        let mut out = head.to_vec();
        for j in 0..half {
            let (a, b) = (head[j], head[j + half]);
            out[j] = a * cos[j] - b * sin[j];
            out[j + half] = b * cos[j] + a * sin[j];
        }
        out
    };
    let part = |row: usize, which: usize, head: usize| {
        let start = row * 3 * hidden + which * hidden + head * head_dim;
        &qkv[start..start + head_dim]
    };
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut out = vec![0.0f32; rows * hidden];
    for segment in segments {
        for head in 0..heads {
            let keys: Vec<Vec<f32>> = segment
                .clone()
                .map(|row| rotate(part(row, 1, head), &rotations[row]))
                .collect();
            for query_row in segment.clone() {
                let query = rotate(part(query_row, 0, head), &rotations[query_row]);
                let scores: Vec<f32> = keys
                    .iter()
                    .map(|key| crate::weights::dot(&query, key) * scale)
                    .collect();
                let largest = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let exponentials: Vec<f32> = scores.iter().map(|s| (s - largest).exp()).collect();
                let total: f32 = exponentials.iter().sum();
                let output = &mut out[query_row * hidden + head * head_dim..][..head_dim];
                for (offset, probability) in exponentials.iter().enumerate() {
                    let value = part(segment.start + offset, 2, head);
                    for (o, v) in output.iter_mut().zip(value) {
                        *o += probability / total * v;
                    }
                }
            }
        }
    }
    out
}

/// `gelu_pytorch_tanh`.
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// `nn.GELU()`: `x · Φ(x)` with the exact normal CDF.
fn gelu_exact(x: f32) -> f32 {
    let z = f64::from(x) * std::f64::consts::FRAC_1_SQRT_2;
    (0.5 * f64::from(x) * (1.0 + erf(z))) as f32
}

/// The error function in f64: its Taylor series where it converges to full f32 precision
/// (|z| < 4, cancellation costs at most five of f64's digits there), ±1 beyond (where
/// `1 − |erf|` < 2e-8).
fn erf(z: f64) -> f64 {
    if z.abs() >= 4.0 {
        return z.signum();
    }
    let square = z * z;
    let mut term = z; // (-1)^n z^(2n+1) / n!
    let mut sum = z;
    for n in 1..120 {
        term *= -square / n as f64;
        let contribution = term / (2 * n + 1) as f64;
        sum += contribution;
        if contribution.abs() < 1e-17 * sum.abs() {
            break;
        }
    }
    sum * std::f64::consts::FRAC_2_SQRT_PI
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        // erf(0.5), erf(1), erf(2), erf(3.5) to 15 digits.
        for (z, expected) in [
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.5, 0.999_999_256_901_627_7),
        ] {
            assert!((erf(z) - expected).abs() < 1e-12, "erf({z}) = {}", erf(z));
            assert!((erf(-z) + expected).abs() < 1e-12);
        }
    }
}
