//! The resized image's size (`smart_resize` of the Qwen image processor): both sides multiples
//! of `patch_size · merge_size`, the pixel count within `[min_pixels, max_pixels]`, the aspect
//! ratio kept as closely as that allows. The arithmetic is Python's: f64, and `round` half to
//! even.

use crate::error::VisionInputError;
use crate::settings::ImageProcessorSettings;

/// `(height, width)` of the resized image for a decoded `height × width` one.
pub fn smart_resize(
    height: u32,
    width: u32,
    settings: &ImageProcessorSettings,
) -> Result<(usize, usize), VisionInputError> {
    if height == 0 || width == 0 {
        return Err(VisionInputError::NoPixels {
            width: width.into(),
            height: height.into(),
        });
    }
    let (h, w) = (f64::from(height), f64::from(width));
    if h.max(w) / h.min(w) > 200.0 {
        return Err(VisionInputError::AspectRatio {
            width: width.into(),
            height: height.into(),
        });
    }
    let factor = settings.factor() as f64;
    let (min_pixels, max_pixels) = (settings.min_pixels as f64, settings.max_pixels as f64);
    let mut h_bar = (h / factor).round_ties_even() * factor;
    let mut w_bar = (w / factor).round_ties_even() * factor;
    if h_bar * w_bar > max_pixels {
        let beta = (h * w / max_pixels).sqrt();
        h_bar = factor.max((h / beta / factor).floor() * factor);
        w_bar = factor.max((w / beta / factor).floor() * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels / (h * w)).sqrt();
        h_bar = (h * beta / factor).ceil() * factor;
        w_bar = (w * beta / factor).ceil() * factor;
    }
    // Whole numbers well inside f64's exact range (sides ≤ 2³² · √max_pixels).
    Ok((h_bar as usize, w_bar as usize))
}
