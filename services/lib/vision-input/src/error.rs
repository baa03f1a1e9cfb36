//! Why an image was refused: one variant per problem a client can cause, each naming it.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum VisionInputError {
    #[error("image media type `{0}` is not supported (supported: image/png, image/jpeg, image/webp, image/gif)")]
    UnsupportedMediaType(String),
    #[error("image declared as `{declared}` but its bytes are {detected}")]
    MediaTypeMismatch { declared: String, detected: String },
    #[error("image bytes are not a PNG, JPEG, WebP or GIF file")]
    UnrecognisedFormat,
    #[error("image is empty (0 bytes)")]
    Empty,
    #[error("image file is {bytes} bytes, over the limit of {limit}")]
    EncodedTooLarge { bytes: usize, limit: usize },
    #[error("image is {width}x{height} ({pixels} pixels), over the limit of {limit} pixels")]
    TooManyPixels {
        width: u64,
        height: u64,
        pixels: u64,
        limit: u64,
    },
    #[error("image is {width}x{height}, over the limit of {limit} pixels on a side")]
    SideTooLong { width: u64, height: u64, limit: u64 },
    #[error("image has no pixels ({width}x{height})")]
    NoPixels { width: u64, height: u64 },
    #[error("image aspect ratio {width}x{height} is more extreme than 200:1")]
    AspectRatio { width: u64, height: u64 },
    #[error("{format} image is corrupt or truncated: {detail}")]
    Corrupt {
        format: &'static str,
        detail: String,
    },
    #[error("{format} image needs more memory to decode than the limit allows: {detail}")]
    DecodeMemoryLimit {
        format: &'static str,
        detail: String,
    },
    #[error("{format} image uses a feature the decoder does not support: {detail}")]
    UnsupportedFeature {
        format: &'static str,
        detail: String,
    },
    #[error("image processor settings are invalid: {0}")]
    InvalidSettings(String),
}
