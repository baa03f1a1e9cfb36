//! A video given as its frames (each an encoded image): every frame decoded as an image is,
//! all frames resized to the one size the Qwen video processor picks for the whole clip (with
//! the video processor's own settings, and its `torchvision` resize and normalisation), and
//! consecutive frames paired into temporal patches (the last frame repeated when the count is
//! odd). Each pair is laid out as an image's patch rows whose two temporal slots are the two
//! frames, and carries the timestamp the prompt writes before it (docs/MODELS.md §10.7).
//!
//! Owns: the video's target size (`smart_resize` of `Qwen3VLVideoProcessor`), the frame-count
//! bound, the pairing and the timestamps. Must not touch: decoding and resampling (`decode`,
//! `resample`), the settings' file format (`video_settings`), tokens.

use thiserror::Error;

use crate::decode::{decode_rgb, probe_image};
use crate::error::VisionInputError;
use crate::patchify::{normalise_and_patchify_frames, ImageGrid, PixelPatches, PixelScaling};
use crate::resample::resize_bicubic_like_torchvision;
use crate::settings::DecodeLimits;
use crate::video_settings::VideoProcessorSettings;

/// Most frames of one video: each pair of frames costs the tower and the prompt what an image
/// does, so this bounds a video at half the images one request may carry.
pub const MAX_VIDEO_FRAMES: usize = 64;

/// One frame as the request carries it: an encoded image and its declared media type.
#[derive(Debug, Clone, Copy)]
pub struct EncodedFrame<'a> {
    pub encoded: &'a [u8],
    pub declared_media_type: Option<&'a str>,
}

/// Why a video was refused, naming the frame where one is at fault.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum VideoInputError {
    #[error("a video needs at least {least} frames, got {frames}")]
    TooFewFrames { frames: usize, least: usize },
    #[error("a video of {frames} frames is over the limit of {limit} frames")]
    TooManyFrames { frames: usize, limit: usize },
    #[error("frame {frame}: {error}")]
    Frame {
        /// 1-based.
        frame: usize,
        error: VisionInputError,
    },
    #[error("frame {frame} is {width}x{height} but frame 1 is {first_width}x{first_height}: all frames of a video must have one size")]
    SizesDiffer {
        frame: usize,
        width: u32,
        height: u32,
        first_width: u32,
        first_height: u32,
    },
    #[error(transparent)]
    Video(VisionInputError),
}

/// `(height, width)` every frame of a `frames`-frame video of `height × width` frames is
/// resized to: `Qwen3VLVideoProcessor`'s `smart_resize`, whose pixel bounds count the frames
/// (rounded to whole temporal patches; the upper one capped per frame where the settings say
/// so) and which first scales a side shorter than the grid unit up to it. Python's
/// arithmetic: f64, `round` half to even, `int` truncating.
pub fn video_smart_resize(
    frames: usize,
    height: u32,
    width: u32,
    video: &VideoProcessorSettings,
) -> Result<(usize, usize), VisionInputError> {
    let settings = &video.frames;
    if height == 0 || width == 0 {
        return Err(VisionInputError::NoPixels {
            width: width.into(),
            height: height.into(),
        });
    }
    let factor = settings.factor() as f64;
    let temporal = settings.temporal_patch_size as f64;
    let (mut h, mut w) = (f64::from(height), f64::from(width));
    if h < factor || w < factor {
        let scale = (factor / h).max(factor / w);
        h = (h * scale).trunc();
        w = (w * scale).trunc();
    }
    if h.max(w) / h.min(w) > 200.0 {
        return Err(VisionInputError::AspectRatio {
            width: width.into(),
            height: height.into(),
        });
    }
    let n = frames as f64;
    let (min_pixels, max_pixels) = video.clip_pixel_bounds(frames);
    let (min_pixels, max_pixels) = (min_pixels as f64, max_pixels as f64);
    let mut h_bar = (h / factor).round_ties_even() * factor;
    let mut w_bar = (w / factor).round_ties_even() * factor;
    let t_bar = (n / temporal).round_ties_even() * temporal;
    if t_bar * h_bar * w_bar > max_pixels {
        let beta = (n * h * w / max_pixels).sqrt();
        h_bar = factor.max((h / beta / factor).floor() * factor);
        w_bar = factor.max((w / beta / factor).floor() * factor);
    } else if t_bar * h_bar * w_bar < min_pixels {
        let beta = (min_pixels / (n * h * w)).sqrt();
        h_bar = (h * beta / factor).ceil() * factor;
        w_bar = (w * beta / factor).ceil() * factor;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// The frame count checked against the bounds: at least one temporal patch's worth (the video
/// processor refuses fewer), at most [`MAX_VIDEO_FRAMES`].
fn check_frame_count(frames: usize, video: &VideoProcessorSettings) -> Result<(), VideoInputError> {
    let least = video.frames.temporal_patch_size;
    if frames < least {
        return Err(VideoInputError::TooFewFrames { frames, least });
    }
    if frames > MAX_VIDEO_FRAMES {
        return Err(VideoInputError::TooManyFrames {
            frames,
            limit: MAX_VIDEO_FRAMES,
        });
    }
    Ok(())
}

/// The grid of each temporal patch of the video (all equal, `temporal` 1) and their count, from
/// the frames' headers alone: what sizes the video's placeholder runs without decoding it.
pub fn probe_video_grid(
    frames: &[EncodedFrame<'_>],
    video: &VideoProcessorSettings,
    limits: &DecodeLimits,
) -> Result<(ImageGrid, usize), VideoInputError> {
    video.validate().map_err(VideoInputError::Video)?;
    check_frame_count(frames.len(), video)?;
    let mut first = None;
    for (index, frame) in frames.iter().enumerate() {
        let probed =
            probe_image(frame.encoded, frame.declared_media_type, limits).map_err(|error| {
                VideoInputError::Frame {
                    frame: index + 1,
                    error,
                }
            })?;
        let size = (probed.width, probed.height);
        let (first_width, first_height) = *first.get_or_insert(size);
        if size != (first_width, first_height) {
            return Err(VideoInputError::SizesDiffer {
                frame: index + 1,
                width: size.0,
                height: size.1,
                first_width,
                first_height,
            });
        }
    }
    let (width, height) = first.unwrap_or_default();
    let (resized_height, resized_width) =
        video_smart_resize(frames.len(), height, width, video).map_err(VideoInputError::Video)?;
    let patch = video.frames.patch_size;
    let grid = ImageGrid {
        temporal: 1,
        height: resized_height / patch,
        width: resized_width / patch,
    };
    Ok((grid, temporal_patches(frames.len(), video)))
}

/// Temporal patches of a `frames`-frame video: the count rounded up to whole patches.
pub fn temporal_patches(frames: usize, video: &VideoProcessorSettings) -> usize {
    frames.div_ceil(video.frames.temporal_patch_size)
}

/// The whole pre-processing of a video: every frame decoded (within `limits`) and resized to
/// the video's size as the video processor does (`torchvision`'s bicubic), then one
/// [`PixelPatches`] per temporal patch (grid `temporal` 1, values normalised in the
/// `torchvision` form), in order.
pub fn preprocess_video(
    frames: &[EncodedFrame<'_>],
    video: &VideoProcessorSettings,
    limits: &DecodeLimits,
) -> Result<Vec<PixelPatches>, VideoInputError> {
    let (grid, pairs) = probe_video_grid(frames, video, limits)?;
    let settings = &video.frames;
    let (height, width) = (
        grid.height * settings.patch_size,
        grid.width * settings.patch_size,
    );
    let mut resized = Vec::with_capacity(frames.len());
    for (index, frame) in frames.iter().enumerate() {
        let at_frame = |error| VideoInputError::Frame {
            frame: index + 1,
            error,
        };
        let decoded =
            decode_rgb(frame.encoded, frame.declared_media_type, limits).map_err(at_frame)?;
        resized.push(
            resize_bicubic_like_torchvision(
                &decoded.rgb,
                decoded.width,
                decoded.height,
                width,
                height,
            )
            .map_err(at_frame)?,
        );
    }
    let temporal = settings.temporal_patch_size;
    (0..pairs)
        .map(|pair| {
            // The last frame stands in for the frames an odd count lacks.
            let slots: Vec<&[u8]> = (0..temporal)
                .map(|slot| resized[(pair * temporal + slot).min(resized.len() - 1)].as_slice())
                .collect();
            normalise_and_patchify_frames(&slots, height, width, settings, PixelScaling::Fused)
                .map_err(VideoInputError::Video)
        })
        .collect()
}

/// The time in seconds the prompt writes before each temporal patch of a `frames`-frame video
/// sampled at `fps`: the mean of its first and last frame's `index / fps`, the frame indices
/// padded with the last one as the frames are.
pub fn temporal_patch_timestamps(frames: usize, fps: f64, temporal_patch_size: usize) -> Vec<f64> {
    let last = frames.saturating_sub(1);
    (0..frames.div_ceil(temporal_patch_size.max(1)))
        .map(|pair| {
            let first = pair * temporal_patch_size;
            let end = (first + temporal_patch_size - 1).min(last);
            (first as f64 / fps + end as f64 / fps) / 2.0
        })
        .collect()
}

/// A timestamp as the prompt writes it: `<1.5 seconds>` (one decimal, as Python's `:.1f`).
pub fn timestamp_text(seconds: f64) -> String {
    format!("<{seconds:.1} seconds>")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> VideoProcessorSettings {
        VideoProcessorSettings::like_images(&crate::settings::ImageProcessorSettings {
            min_pixels: 1024,
            max_pixels: 4096,
            patch_size: 8,
            ..crate::settings::ImageProcessorSettings::default()
        })
    }

    #[test]
    fn the_size_counts_the_frames_rounded_to_pairs() {
        // Three frames count as four: 4 · 32 · 48 is over 4096, so the frames shrink.
        assert_eq!(video_smart_resize(3, 32, 48, &settings()), Ok((16, 32)));
        assert_eq!(video_smart_resize(2, 32, 48, &settings()), Ok((32, 48)));
        assert_eq!(video_smart_resize(4, 32, 32, &settings()), Ok((32, 32)));
        // A side under the grid unit is scaled up to it first (int() truncates).
        assert_eq!(video_smart_resize(2, 5, 40, &settings()), Ok((16, 128)));
    }

    #[test]
    fn timestamps_average_each_pair_and_repeat_the_last_frame() {
        assert_eq!(temporal_patch_timestamps(4, 2.0, 2), [0.25, 1.25]);
        assert_eq!(temporal_patch_timestamps(3, 2.0, 2), [0.25, 1.0]);
        // Python's `:.1f` rounds the exact binary value, half to even.
        assert_eq!(timestamp_text(0.25), "<0.2 seconds>");
        assert_eq!(timestamp_text(1.25), "<1.2 seconds>");
        assert_eq!(timestamp_text(0.75), "<0.8 seconds>");
    }

    #[test]
    fn frame_counts_are_bounded() {
        let frame = EncodedFrame {
            encoded: b"",
            declared_media_type: None,
        };
        let limits = DecodeLimits::default();
        assert!(matches!(
            probe_video_grid(&[frame], &settings(), &limits),
            Err(VideoInputError::TooFewFrames { frames: 1, .. })
        ));
        let many = vec![frame; MAX_VIDEO_FRAMES + 1];
        let refused = probe_video_grid(&many, &settings(), &limits).expect_err("too many");
        assert!(
            refused.to_string().contains("over the limit of 64 frames"),
            "{refused}"
        );
        let empty = probe_video_grid(&[frame, frame], &settings(), &limits).expect_err("empty");
        assert!(
            empty.to_string().starts_with("frame 1: image is empty"),
            "{empty}"
        );
    }
}
