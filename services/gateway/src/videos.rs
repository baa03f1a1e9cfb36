//! Videos in chat requests, given as their frames (an OpenAI `video` part: a list of image data
//! URLs and an optional `fps`, the form Qwen's own API takes): each frame read and checked as an
//! image is, the frame count and the one frame size checked from the headers, and the video's
//! one `<|video_pad|>` of the rendered prompt expanded as the model's processor does: per pair of
//! frames, its timestamp as text (`<0.2 seconds>`), then `<|vision_start|>`, the pair's pad
//! tokens and `<|vision_end|>`.
//!
//! Owns: [`ChatVideo`] and its placeholder run. Must not touch: decoding (the engine's), the
//! APIs' JSON shapes, images' own placeholder runs (`images.rs`).

use ninfer_protocol::v1::ImageInput;
use ninfer_vision_input::{
    probe_video_grid, temporal_patch_timestamps, timestamp_text, DecodeLimits, EncodedFrame,
    ImageProcessorSettings, VideoProcessorSettings,
};

use crate::error::GatewayError;

/// A video as a conversation carries it: its frames, each an image, and their rate (`None`:
/// the client named none, and the model's video processor's rate applies).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatVideo {
    pub frames: Vec<VideoFrame>,
    pub fps: Option<f64>,
}

/// One frame: an encoded image file and the media type the client declared (empty if none).
#[derive(Debug, Clone, PartialEq)]
pub struct VideoFrame {
    pub encoded: Vec<u8>,
    pub media_type: String,
}

/// The tokens a video's placeholder run is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VideoTokens {
    pub video_pad: u32,
    pub vision_start: u32,
    pub vision_end: u32,
}

impl ChatVideo {
    /// Refuses (400 naming `where_`) a frame rate that is not a positive number, or more
    /// frames than a video may have, before any frame is read.
    pub fn check_request(
        frames: usize,
        fps: Option<f64>,
        where_: &str,
    ) -> Result<(), GatewayError> {
        if let Some(fps) = fps.filter(|fps| !(fps.is_finite() && *fps > 0.0)) {
            return Err(GatewayError::invalid(format!(
                "{where_}: `fps` must be a positive number, got {fps}"
            )));
        }
        if frames > ninfer_vision_input::MAX_VIDEO_FRAMES {
            return Err(GatewayError::invalid(format!(
                "{where_}: a video of {frames} frames is over the limit of {} frames",
                ninfer_vision_input::MAX_VIDEO_FRAMES
            )));
        }
        Ok(())
    }

    /// A video of `frames` (each already checked as an image), refused (400 naming `where_`)
    /// when they are too few, too many or of different sizes.
    pub fn new(
        frames: Vec<VideoFrame>,
        fps: Option<f64>,
        where_: &str,
    ) -> Result<Self, GatewayError> {
        Self::check_request(frames.len(), fps, where_)?;
        let video = ChatVideo { frames, fps };
        // Counts and sizes, from the headers (the settings shape only the grid).
        probe_video_grid(
            &video.encoded_frames(),
            &VideoProcessorSettings::like_images(&ImageProcessorSettings::default()),
            &DecodeLimits::default(),
        )
        .map_err(|error| GatewayError::invalid(format!("{where_}: {error}")))?;
        Ok(video)
    }

    fn encoded_frames(&self) -> Vec<EncodedFrame<'_>> {
        self.frames
            .iter()
            .map(|frame| EncodedFrame {
                encoded: &frame.encoded,
                declared_media_type: Some(frame.media_type.as_str()).filter(|m| !m.is_empty()),
            })
            .collect()
    }

    /// The video as the engine request carries it: its frames.
    pub fn engine_input(&self) -> ImageInput {
        ImageInput {
            encoded: Vec::new(),
            media_type: String::new(),
            frames: self
                .frames
                .iter()
                .map(|frame| ImageInput {
                    encoded: frame.encoded.clone(),
                    media_type: frame.media_type.clone(),
                    frames: Vec::new(),
                })
                .collect(),
        }
    }

    /// The tokens that stand for the video in the prompt, as the processor expands its one
    /// `<|video_pad|>` with the model's video processor `settings`: per frame pair, the
    /// timestamp's text tokens (`encode_text`; at the video's rate, else the processor's), the
    /// start marker, the pair's pad tokens and the end marker.
    pub fn placeholder_run(
        &self,
        settings: &VideoProcessorSettings,
        tokens: VideoTokens,
        encode_text: &dyn Fn(&str) -> Result<Vec<u32>, GatewayError>,
        where_: &str,
    ) -> Result<Vec<u32>, GatewayError> {
        let (grid, pairs) =
            probe_video_grid(&self.encoded_frames(), settings, &DecodeLimits::default())
                .map_err(|error| GatewayError::invalid(format!("{where_}: {error}")))?;
        let pads = grid.merged_tokens(settings.frames.merge_size);
        let stamps = temporal_patch_timestamps(
            self.frames.len(),
            self.fps.unwrap_or(settings.fps),
            settings.frames.temporal_patch_size,
        );
        debug_assert_eq!(stamps.len(), pairs);
        let mut run = Vec::new();
        for seconds in stamps {
            run.extend(encode_text(&timestamp_text(seconds))?);
            run.push(tokens.vision_start);
            run.extend(std::iter::repeat_n(tokens.video_pad, pads));
            run.push(tokens.vision_end);
        }
        Ok(run)
    }
}
