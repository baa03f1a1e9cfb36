//! The video processor's settings (`video_preprocessor_config.json`, read as
//! `Qwen3VLVideoProcessor` reads it): the pixel bounds of a whole clip, the patch sizes, the
//! normalisation, the frame rate frames are taken at and the optional per-frame pixel cap.
//!
//! `transformers` loads a video processor from `video_preprocessor_config.json` and, where a
//! checkpoint has none, from `preprocessor_config.json`: either file is read here the same way,
//! with the video processor class's defaults for the keys it leaves out (its `size` only: the
//! `min_pixels` / `max_pixels` keys the image processor honours mean nothing to it).

use serde::Deserialize;

use crate::error::VisionInputError;
use crate::settings::ImageProcessorSettings;

/// What `Qwen3VLVideoProcessor` is configured with.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoProcessorSettings {
    /// `min_pixels` / `max_pixels`: the bounds on all frames' pixels together
    /// (`size.shortest_edge` / `size.longest_edge`); the patch sizes, mean and std.
    pub frames: ImageProcessorSettings,
    /// The rate the processor takes frames at (`fps`): a client's frames are at this rate
    /// unless it names another.
    pub fps: f64,
    /// `cap_pixels_per_frame`: each frame's pixels are bounded by `max_video_tokens` merged
    /// tokens and by an even share of `size.longest_edge`, floored at 1.05 × `shortest_edge`.
    pub cap_pixels_per_frame: bool,
    pub max_video_tokens: u64,
}

/// The keys of a video processor's configuration read here.
#[derive(Debug, Deserialize)]
struct VideoPreprocessorConfig {
    size: Option<VideoSize>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
    fps: Option<f64>,
    cap_pixels_per_frame: Option<bool>,
    max_video_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct VideoSize {
    shortest_edge: Option<u64>,
    longest_edge: Option<u64>,
}

impl VideoProcessorSettings {
    /// Settings from a `video_preprocessor_config.json` (or, for a checkpoint without one, its
    /// `preprocessor_config.json`); absent keys take `Qwen3VLVideoProcessor`'s class defaults.
    pub fn from_video_preprocessor_config(json: &str) -> Result<Self, VisionInputError> {
        let config: VideoPreprocessorConfig = serde_json::from_str(json)
            .map_err(|error| VisionInputError::InvalidSettings(error.to_string()))?;
        let size = config.size.as_ref();
        let settings = Self {
            frames: ImageProcessorSettings {
                min_pixels: size.and_then(|s| s.shortest_edge).unwrap_or(128 * 32 * 32),
                max_pixels: size.and_then(|s| s.longest_edge).unwrap_or(32 * 32 * 768),
                patch_size: config.patch_size.unwrap_or(16),
                temporal_patch_size: config.temporal_patch_size.unwrap_or(2),
                merge_size: config.merge_size.unwrap_or(2),
                // `IMAGENET_STANDARD_MEAN` / `_STD`.
                image_mean: config.image_mean.unwrap_or([0.5; 3]),
                image_std: config.image_std.unwrap_or([0.5; 3]),
            },
            fps: config.fps.unwrap_or(2.0),
            cap_pixels_per_frame: config.cap_pixels_per_frame.unwrap_or(false),
            max_video_tokens: config.max_video_tokens.unwrap_or(768),
        };
        settings.validate()?;
        Ok(settings)
    }

    /// A video processor with `frames`' bounds and patches, at the class's frame rate and
    /// without a per-frame cap: what a model without any processor file gets.
    pub fn like_images(frames: &ImageProcessorSettings) -> Self {
        Self {
            frames: frames.clone(),
            fps: 2.0,
            cap_pixels_per_frame: false,
            max_video_tokens: 768,
        }
    }

    /// Refuses settings the arithmetic cannot take.
    pub fn validate(&self) -> Result<(), VisionInputError> {
        self.frames.validate()?;
        if !(self.fps.is_finite() && self.fps > 0.0) {
            return Err(VisionInputError::InvalidSettings(
                "fps must be a positive number".into(),
            ));
        }
        if self.max_video_tokens == 0 {
            return Err(VisionInputError::InvalidSettings(
                "max_video_tokens must be positive".into(),
            ));
        }
        Ok(())
    }

    /// The bounds on all `frames` frames' pixels together that `smart_resize` is held to:
    /// `size`'s, or with the per-frame cap `max(min(max_video_tokens · factor², ⌊longest_edge
    /// / frames⌋), ⌊1.05 · shortest_edge⌋) · frames` as the upper one.
    pub fn clip_pixel_bounds(&self, frames: usize) -> (u64, u64) {
        let (min_pixels, max_pixels) = (self.frames.min_pixels, self.frames.max_pixels);
        if !self.cap_pixels_per_frame || frames == 0 {
            return (min_pixels, max_pixels);
        }
        let factor = self.frames.factor() as u64;
        let frame_cap = self.max_video_tokens.saturating_mul(factor * factor);
        let floor = (min_pixels as f64 * 1.05) as u64;
        let per_frame = frame_cap.min(max_pixels / frames as u64).max(floor);
        (min_pixels, per_frame.saturating_mul(frames as u64))
    }

    /// The settings as a `video_preprocessor_config.json` that
    /// [`VideoProcessorSettings::from_video_preprocessor_config`] reads back to the same
    /// values.
    pub fn to_json(&self) -> String {
        let f = &self.frames;
        serde_json::json!({
            "size": {"shortest_edge": f.min_pixels, "longest_edge": f.max_pixels},
            "patch_size": f.patch_size,
            "temporal_patch_size": f.temporal_patch_size,
            "merge_size": f.merge_size,
            "image_mean": f.image_mean,
            "image_std": f.image_std,
            "fps": self.fps,
            "cap_pixels_per_frame": self.cap_pixels_per_frame,
            "max_video_tokens": self.max_video_tokens,
        })
        .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_size_not_the_image_keys_and_keeps_the_class_defaults() {
        let sparse = VideoProcessorSettings::from_video_preprocessor_config(
            r#"{"min_pixels": 10, "max_pixels": 20, "fps": 4}"#,
        )
        .expect("valid");
        assert_eq!(
            (sparse.frames.min_pixels, sparse.frames.max_pixels),
            (131_072, 786_432)
        );
        assert_eq!(
            (
                sparse.frames.patch_size,
                sparse.fps,
                sparse.cap_pixels_per_frame
            ),
            (16, 4.0, false)
        );
        let full = VideoProcessorSettings::from_video_preprocessor_config(
            r#"{"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "video_processor_type": "Qwen3VLVideoProcessor"}"#,
        )
        .expect("valid");
        assert_eq!(
            (full.frames.min_pixels, full.frames.max_pixels),
            (4096, 25_165_824)
        );
        assert_eq!(
            VideoProcessorSettings::from_video_preprocessor_config(&full.to_json()),
            Ok(full)
        );
        assert!(VideoProcessorSettings::from_video_preprocessor_config(r#"{"fps": 0}"#).is_err());
    }

    #[test]
    fn the_per_frame_cap_bounds_the_clip() {
        let mut settings = VideoProcessorSettings::from_video_preprocessor_config(
            r#"{"size": {"shortest_edge": 4096, "longest_edge": 1000000}, "max_video_tokens": 100}"#,
        )
        .expect("valid");
        assert_eq!(settings.clip_pixel_bounds(8), (4096, 1_000_000));
        settings.cap_pixels_per_frame = true;
        // 100 tokens of 32×32 pixels = 102,400 per frame, under 1e6 / 8 = 125,000.
        assert_eq!(settings.clip_pixel_bounds(8), (4096, 8 * 102_400));
        // 1e6 / 64 = 15,625 per frame.
        assert_eq!(settings.clip_pixel_bounds(64), (4096, 64 * 15_625));
        // Floored at 1.05 × 4096 = 4300 per frame.
        assert_eq!(settings.clip_pixel_bounds(400), (4096, 400 * 4300));
    }
}
