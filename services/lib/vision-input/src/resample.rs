//! Pillow's bicubic resize of an 8-bit RGB image (`Image.resize(size, BICUBIC)`,
//! `libImaging/Resample.c`), reproduced to the integer: per axis, f64 Keys-cubic weights
//! (`a = −0.5`) over a support widened by the reduction factor, normalised, turned into 22-bit
//! fixed-point integers; two passes through an 8-bit image, in the order Pillow 13 picks.
//! docs/MODELS.md §10.2 states the formulas.

use crate::error::VisionInputError;

/// Fixed-point fraction bits of Pillow's 8-bit resampling (`32 − 8 − 2`).
const PRECISION_BITS: u32 = 22;

/// Pillow's bicubic kernel (`a = −0.5`), support 2.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One output index's taps along an axis: the first input index and the integer weights.
struct AxisTaps {
    first: usize,
    weights: Vec<i32>,
}

/// `precompute_coeffs` and `normalize_coeffs_8bpc` of Pillow for one axis.
fn axis_taps(input_size: usize, output_size: usize) -> Vec<AxisTaps> {
    let scale = input_size as f64 / output_size as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    (0..output_size)
        .map(|output| {
            let centre = (output as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero; the lower bound is then clamped at 0.
            let first = ((centre - support + 0.5) as i64).max(0) as usize;
            let end = ((centre + support + 0.5) as i64).min(input_size as i64) as usize;
            let raw: Vec<f64> = (first..end)
                .map(|input| bicubic((input as f64 - centre + 0.5) / filter_scale))
                .collect();
            let total: f64 = raw.iter().sum();
            let one = f64::from(1u32 << PRECISION_BITS);
            let weights = raw
                .iter()
                .map(|&weight| {
                    let weight = if total != 0.0 { weight / total } else { weight };
                    if weight < 0.0 {
                        (-0.5 + weight * one) as i32
                    } else {
                        (0.5 + weight * one) as i32
                    }
                })
                .collect();
            AxisTaps { first, weights }
        })
        .collect()
}

/// `clip8`: the rounded fixed-point sum back to a byte.
fn clip8(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes `rgb` (`height` rows of `width` RGB triples) to `new_width × new_height` as Pillow's
/// bicubic `Image.resize` does (Pillow 13); an unchanged size is a copy.
pub fn resize_bicubic_like_pillow(
    rgb: &[u8],
    width: u32,
    height: u32,
    new_width: usize,
    new_height: usize,
) -> Result<Vec<u8>, VisionInputError> {
    let (width, height) = (width as usize, height as usize);
    if rgb.len() != width * height * 3 {
        return Err(VisionInputError::InvalidSettings(format!(
            "an RGB image of {width}x{height} needs {} bytes, got {}",
            width * height * 3,
            rgb.len()
        )));
    }
    if width == 0 || height == 0 || new_width == 0 || new_height == 0 {
        return Err(VisionInputError::NoPixels {
            width: width as u64,
            height: height as u64,
        });
    }
    // Pillow 13 runs the vertical pass first when the height shrinks by more than twice as many
    // pixels as the width does (earlier Pillow always went horizontal first); with 8-bit
    // rounding between the passes the order shows in the result.
    let (height_drop, width_drop) = (
        height as i64 - new_height as i64,
        width as i64 - new_width as i64,
    );
    let vertical_first = height_drop > 0 && height_drop > width_drop * 2;
    let mut image = rgb.to_vec();
    let (mut current_width, mut current_height) = (width, height);
    let passes: [Axis; 2] = if vertical_first {
        [Axis::Vertical, Axis::Horizontal]
    } else {
        [Axis::Horizontal, Axis::Vertical]
    };
    for axis in passes {
        match axis {
            Axis::Horizontal if new_width != current_width => {
                image = resample_rows(&image, current_width, current_height, new_width);
                current_width = new_width;
            }
            Axis::Vertical if new_height != current_height => {
                image = resample_columns(&image, current_width, current_height, new_height);
                current_height = new_height;
            }
            _ => {}
        }
    }
    Ok(image)
}

#[derive(Clone, Copy)]
enum Axis {
    Horizontal,
    Vertical,
}

/// The horizontal pass: every row from `width` to `new_width` pixels.
fn resample_rows(rgb: &[u8], width: usize, height: usize, new_width: usize) -> Vec<u8> {
    let taps = axis_taps(width, new_width);
    let rounding = 1i32 << (PRECISION_BITS - 1);
    let mut out = vec![0u8; height * new_width * 3];
    for (input_row, output_row) in rgb
        .chunks_exact(width * 3)
        .zip(out.chunks_exact_mut(new_width * 3))
    {
        for (tap, pixel) in taps.iter().zip(output_row.chunks_exact_mut(3)) {
            let mut sums = [rounding; 3];
            for (offset, &weight) in tap.weights.iter().enumerate() {
                let source = &input_row[(tap.first + offset) * 3..][..3];
                for (sum, &value) in sums.iter_mut().zip(source) {
                    *sum += i32::from(value) * weight;
                }
            }
            for (value, sum) in pixel.iter_mut().zip(sums) {
                *value = clip8(sum);
            }
        }
    }
    out
}

/// The vertical pass: every column from `height` to `new_height` pixels.
fn resample_columns(rgb: &[u8], width: usize, height: usize, new_height: usize) -> Vec<u8> {
    let taps = axis_taps(height, new_height);
    let rounding = 1i32 << (PRECISION_BITS - 1);
    let row_len = width * 3;
    let mut out = vec![0u8; new_height * row_len];
    for (tap, output_row) in taps.iter().zip(out.chunks_exact_mut(row_len)) {
        for (column, value) in output_row.iter_mut().enumerate() {
            let mut sum = rounding;
            for (offset, &weight) in tap.weights.iter().enumerate() {
                sum += i32::from(rgb[(tap.first + offset) * row_len + column]) * weight;
            }
            *value = clip8(sum);
        }
    }
    out
}
