//! Bicubic resizes of an 8-bit RGB image reproduced to the integer, in the two forms the Qwen
//! processors use (docs/MODELS.md §10.2 and §10.7 state the formulas):
//!
//! * Pillow's (`Image.resize(size, BICUBIC)`, `libImaging/Resample.c`), what the image
//!   processor's PIL form runs: per axis, f64 Keys-cubic weights (`a = −0.5`) over a support
//!   widened by the reduction factor, normalised, turned into 22-bit fixed-point integers; two
//!   passes through an 8-bit image, in the order Pillow 13 picks;
//! * PyTorch's anti-aliased bicubic on `uint8` (`torchvision`'s `resize` on the CPU), what the
//!   video processor runs on every frame: the same taps and normalised weights (the kernel's
//!   outer branch written differently), turned into integers of the most fraction bits that
//!   keep the axis's largest weight within 15 bits; the horizontal pass always first.

use crate::error::VisionInputError;

/// Fixed-point fraction bits of Pillow's 8-bit resampling (`32 − 8 − 2`).
const PILLOW_PRECISION_BITS: u32 = 22;

/// Fraction bits PyTorch's `uint8` resampling tries at most for one axis.
const TORCH_MOST_PRECISION_BITS: u32 = 22;

/// The Keys cubic at `a = −0.5`, support 2, as Pillow writes it.
fn bicubic_pillow(x: f64) -> f64 {
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

/// The same cubic as PyTorch's anti-aliasing filter writes it (`cubic_convolution1/2`).
fn bicubic_torch(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// One output index's taps along an axis: the first input index and the integer weights.
struct AxisTaps {
    first: usize,
    weights: Vec<i32>,
}

/// An axis's taps and the fixed-point fraction bits of their weights.
struct AxisFilter {
    taps: Vec<AxisTaps>,
    precision: u32,
}

/// Each output index's first input index and normalised f64 weights: `center = (o + 0.5) ·
/// scale`, taps `[trunc(center − support + 0.5) ∨ 0, trunc(center + support + 0.5) ∧ in)`,
/// weights `kernel((i − center + 0.5) / max(scale, 1))` over their sum (both libraries).
fn normalised_weights(
    input_size: usize,
    output_size: usize,
    kernel: fn(f64) -> f64,
) -> Vec<(usize, Vec<f64>)> {
    let scale = input_size as f64 / output_size as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    let most_taps = support.ceil() as usize * 2 + 1;
    (0..output_size)
        .map(|output| {
            let centre = (output as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero; the lower bound is then clamped at 0.
            let first = ((centre - support + 0.5) as i64).max(0) as usize;
            let end = ((centre + support + 0.5) as i64).min(input_size as i64) as usize;
            // At most the `2·⌈support⌉ + 1` taps the libraries make room for (PyTorch clips a
            // rounding's extra tap).
            let end = end.min(first + most_taps);
            let raw: Vec<f64> = (first..end)
                .map(|input| kernel((input as f64 - centre + 0.5) / filter_scale))
                .collect();
            let total: f64 = raw.iter().sum();
            let weights = raw
                .iter()
                .map(|&weight| if total != 0.0 { weight / total } else { weight })
                .collect();
            (first, weights)
        })
        .collect()
}

/// `weight · 2^precision` rounded half away from zero, as both libraries do with a C cast.
fn fixed_point(weight: f64, precision: u32) -> i32 {
    let scaled = weight * f64::from(1u32 << precision);
    if scaled < 0.0 {
        (-0.5 + scaled) as i32
    } else {
        (0.5 + scaled) as i32
    }
}

/// `precompute_coeffs` and `normalize_coeffs_8bpc` of Pillow for one axis.
fn pillow_axis(input_size: usize, output_size: usize) -> AxisFilter {
    let taps = normalised_weights(input_size, output_size, bicubic_pillow)
        .into_iter()
        .map(|(first, weights)| AxisTaps {
            first,
            weights: weights
                .iter()
                .map(|&w| fixed_point(w, PILLOW_PRECISION_BITS))
                .collect(),
        })
        .collect();
    AxisFilter {
        taps,
        precision: PILLOW_PRECISION_BITS,
    }
}

/// PyTorch's `_compute_index_ranges_int16_weights` for one axis: the fraction bits are the
/// most (below 22) for which the axis's largest weight, rounded at one bit more, stays under
/// 2¹⁵; every weight is then rounded at that precision.
fn torch_axis(input_size: usize, output_size: usize) -> AxisFilter {
    let weights = normalised_weights(input_size, output_size, bicubic_torch);
    let largest = weights
        .iter()
        .flat_map(|(_, weights)| weights.iter().copied())
        .fold(0.0f64, f64::max);
    let precision = (0..TORCH_MOST_PRECISION_BITS)
        .find(|&bits| (0.5 + largest * f64::from(1u32 << (bits + 1))) as i64 >= 1 << 15)
        .unwrap_or(TORCH_MOST_PRECISION_BITS);
    let taps = weights
        .into_iter()
        .map(|(first, weights)| AxisTaps {
            first,
            weights: weights.iter().map(|&w| fixed_point(w, precision)).collect(),
        })
        .collect();
    AxisFilter { taps, precision }
}

/// The rounded fixed-point sum back to a byte.
fn clip8(sum: i64, precision: u32) -> u8 {
    (sum >> precision).clamp(0, 255) as u8
}

fn check_sizes(
    rgb: &[u8],
    width: usize,
    height: usize,
    new_width: usize,
    new_height: usize,
) -> Result<(), VisionInputError> {
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
    Ok(())
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
    check_sizes(rgb, width, height, new_width, new_height)?;
    // Pillow 13 runs the vertical pass first when the height shrinks by more than twice as many
    // pixels as the width does (earlier Pillow always went horizontal first); with 8-bit
    // rounding between the passes the order shows in the result.
    let (height_drop, width_drop) = (
        height as i64 - new_height as i64,
        width as i64 - new_width as i64,
    );
    let vertical_first = height_drop > 0 && height_drop > width_drop * 2;
    let passes = if vertical_first {
        [Axis::Vertical, Axis::Horizontal]
    } else {
        [Axis::Horizontal, Axis::Vertical]
    };
    Ok(resize_in_passes(
        rgb,
        (width, height),
        (new_width, new_height),
        passes,
        pillow_axis,
    ))
}

/// Resizes `rgb` to `new_width × new_height` as `torchvision`'s `resize` does to a `uint8`
/// image on the CPU with bicubic interpolation and anti-aliasing (PyTorch's
/// `_upsample_bicubic2d_aa`); an unchanged size is a copy.
pub fn resize_bicubic_like_torchvision(
    rgb: &[u8],
    width: u32,
    height: u32,
    new_width: usize,
    new_height: usize,
) -> Result<Vec<u8>, VisionInputError> {
    let (width, height) = (width as usize, height as usize);
    check_sizes(rgb, width, height, new_width, new_height)?;
    Ok(resize_in_passes(
        rgb,
        (width, height),
        (new_width, new_height),
        [Axis::Horizontal, Axis::Vertical],
        torch_axis,
    ))
}

#[derive(Clone, Copy)]
enum Axis {
    Horizontal,
    Vertical,
}

/// The two passes in `order`, each skipped where its side keeps its size, with `axis_filter`'s
/// taps; 8-bit rounding between them.
fn resize_in_passes(
    rgb: &[u8],
    (width, height): (usize, usize),
    (new_width, new_height): (usize, usize),
    order: [Axis; 2],
    axis_filter: fn(usize, usize) -> AxisFilter,
) -> Vec<u8> {
    let mut image = rgb.to_vec();
    let (mut current_width, mut current_height) = (width, height);
    for axis in order {
        match axis {
            Axis::Horizontal if new_width != current_width => {
                let filter = axis_filter(current_width, new_width);
                image = resample_rows(&image, current_width, current_height, &filter);
                current_width = new_width;
            }
            Axis::Vertical if new_height != current_height => {
                let filter = axis_filter(current_height, new_height);
                image = resample_columns(&image, current_width, &filter);
                current_height = new_height;
            }
            _ => {}
        }
    }
    image
}

/// The horizontal pass: every row from `width` pixels to one per tap of `filter`.
fn resample_rows(rgb: &[u8], width: usize, height: usize, filter: &AxisFilter) -> Vec<u8> {
    let new_width = filter.taps.len();
    let rounding = 1i64 << (filter.precision.max(1) - 1);
    let mut out = vec![0u8; height * new_width * 3];
    for (input_row, output_row) in rgb
        .chunks_exact(width * 3)
        .zip(out.chunks_exact_mut(new_width * 3))
    {
        for (tap, pixel) in filter.taps.iter().zip(output_row.chunks_exact_mut(3)) {
            let mut sums = [rounding; 3];
            for (offset, &weight) in tap.weights.iter().enumerate() {
                let source = &input_row[(tap.first + offset) * 3..][..3];
                for (sum, &value) in sums.iter_mut().zip(source) {
                    *sum += i64::from(value) * i64::from(weight);
                }
            }
            for (value, sum) in pixel.iter_mut().zip(sums) {
                *value = clip8(sum, filter.precision);
            }
        }
    }
    out
}

/// The vertical pass: every column of `width` pixels to one row per tap of `filter`.
fn resample_columns(rgb: &[u8], width: usize, filter: &AxisFilter) -> Vec<u8> {
    let row_len = width * 3;
    let rounding = 1i64 << (filter.precision.max(1) - 1);
    let mut out = vec![0u8; filter.taps.len() * row_len];
    for (tap, output_row) in filter.taps.iter().zip(out.chunks_exact_mut(row_len)) {
        for (column, value) in output_row.iter_mut().enumerate() {
            let mut sum = rounding;
            for (offset, &weight) in tap.weights.iter().enumerate() {
                sum += i64::from(rgb[(tap.first + offset) * row_len + column]) * i64::from(weight);
            }
            *value = clip8(sum, filter.precision);
        }
    }
    out
}
