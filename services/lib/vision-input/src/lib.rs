//! Image pre-processing for the Qwen3.5 vision tower: encoded bytes in, the patch rows the vision
//! encoder's patch embedding takes and the image's grid out, equal to what `transformers`' Qwen
//! image processor (the Pillow form) makes of the same bytes (docs/MODELS.md §10.2), and for a
//! video given as frames what its video processor (`torchvision`) makes of them (§10.7).
//!
//! Owns: recognising and decoding PNG, JPEG, WebP and GIF (first frame) within limits set before
//! any pixel is allocated ([`decode`]), the target size and its rounding ([`smart_resize`]),
//! Pillow's and `torchvision`'s bicubic resampling ([`resample`]), normalisation and the patch
//! layout ([`patchify`]), and videos given as frames ([`video`]) with the video processor's
//! settings ([`video_settings`]).
//! Every refusal is a typed [`VisionInputError`] that names the problem, for an API to answer 400.
//! Must not touch: tokens, prompts, the model (the engine runs the encoder; the gateway decides
//! which bytes arrive).

pub mod crafted;
pub mod decode;
pub mod error;
pub mod patchify;
pub mod resample;
pub mod settings;
pub mod smart_resize;
pub mod video;
pub mod video_settings;

pub use decode::{decode_rgb, probe_image, DecodedImage, ImageFormatName, ProbedImage};
pub use error::VisionInputError;
pub use patchify::{
    normalise_and_patchify, normalise_and_patchify_frames, ImageGrid, PixelPatches, PixelScaling,
};
pub use resample::{resize_bicubic_like_pillow, resize_bicubic_like_torchvision};
pub use settings::{DecodeLimits, ImageProcessorSettings};
pub use smart_resize::smart_resize;
pub use video::{
    preprocess_video, probe_video_grid, temporal_patch_timestamps, timestamp_text,
    video_smart_resize, EncodedFrame, VideoInputError, MAX_VIDEO_FRAMES,
};
pub use video_settings::VideoProcessorSettings;

/// The grid `bytes` will have after pre-processing, from the header alone ([`probe_image`] and
/// [`smart_resize`]): what sizes an image's placeholder run without decoding it.
pub fn probe_grid(
    bytes: &[u8],
    declared_media_type: Option<&str>,
    settings: &ImageProcessorSettings,
    limits: &DecodeLimits,
) -> Result<ImageGrid, VisionInputError> {
    settings.validate()?;
    let probed = probe_image(bytes, declared_media_type, limits)?;
    let (height, width) = smart_resize(probed.height, probed.width, settings)?;
    Ok(ImageGrid {
        temporal: 1,
        height: height / settings.patch_size,
        width: width / settings.patch_size,
    })
}

/// The whole pre-processing of one image: decode (within `limits`), resize to the processor's
/// grid, normalise, patchify. `declared_media_type` is what the request said the bytes are
/// (`image/png`, …), checked against what they are.
pub fn preprocess_image(
    bytes: &[u8],
    declared_media_type: Option<&str>,
    settings: &ImageProcessorSettings,
    limits: &DecodeLimits,
) -> Result<PixelPatches, VisionInputError> {
    settings.validate()?;
    let decoded = decode_rgb(bytes, declared_media_type, limits)?;
    let (height, width) = smart_resize(decoded.height, decoded.width, settings)?;
    let resized =
        resize_bicubic_like_pillow(&decoded.rgb, decoded.width, decoded.height, width, height)?;
    normalise_and_patchify(&resized, height, width, settings)
}
