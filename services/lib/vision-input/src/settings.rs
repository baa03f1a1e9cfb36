//! The image processor's settings (`preprocessor_config.json`) and the decoder's limits.

use serde::Deserialize;

use crate::error::VisionInputError;

/// What `Qwen2VLImageProcessor` is configured with. The defaults are the released Qwen3.5 /
/// Qwen3.6 values; [`ImageProcessorSettings::from_preprocessor_config`] reads a checkpoint's own.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorSettings {
    /// Fewest pixels of the resized image (`size.shortest_edge`, formerly `min_pixels`).
    pub min_pixels: u64,
    /// Most pixels of the resized image (`size.longest_edge`, formerly `max_pixels`).
    pub max_pixels: u64,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl Default for ImageProcessorSettings {
    fn default() -> Self {
        Self {
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
        }
    }
}

/// The fields of `preprocessor_config.json` read here; absent ones keep the processor's class
/// defaults as `transformers` applies them (`min_pixels` / `max_pixels` override `size`).
#[derive(Debug, Deserialize)]
struct PreprocessorConfig {
    size: Option<PreprocessorSize>,
    min_pixels: Option<u64>,
    max_pixels: Option<u64>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
}

#[derive(Debug, Deserialize)]
struct PreprocessorSize {
    shortest_edge: Option<u64>,
    longest_edge: Option<u64>,
}

impl ImageProcessorSettings {
    /// The grid unit of the resized image: one merged token covers `factor × factor` pixels.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Numbers in one patch row: `3 · temporal_patch_size · patch_size²`.
    pub fn patch_len(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Settings from a `preprocessor_config.json`'s text. Keys it leaves out take the
    /// `Qwen2VLImageProcessor` class defaults (Qwen2-VL's, not Qwen3.5's), as `transformers` does.
    pub fn from_preprocessor_config(json: &str) -> Result<Self, VisionInputError> {
        let config: PreprocessorConfig = serde_json::from_str(json)
            .map_err(|error| VisionInputError::InvalidSettings(error.to_string()))?;
        // `Qwen2VLImageProcessor`'s class attributes.
        const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
        const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];
        let size = config.size.as_ref();
        let settings = Self {
            min_pixels: config
                .min_pixels
                .or(size.and_then(|s| s.shortest_edge))
                .unwrap_or(56 * 56),
            max_pixels: config
                .max_pixels
                .or(size.and_then(|s| s.longest_edge))
                .unwrap_or(28 * 28 * 1280),
            patch_size: config.patch_size.unwrap_or(14),
            temporal_patch_size: config.temporal_patch_size.unwrap_or(2),
            merge_size: config.merge_size.unwrap_or(2),
            image_mean: config.image_mean.unwrap_or(CLIP_MEAN),
            image_std: config.image_std.unwrap_or(CLIP_STD),
        };
        settings.validate()?;
        Ok(settings)
    }

    /// Refuses settings the arithmetic cannot take (zero sizes, a zero deviation, min > max).
    pub fn validate(&self) -> Result<(), VisionInputError> {
        let invalid = |what: &str| Err(VisionInputError::InvalidSettings(what.to_string()));
        if self.patch_size == 0 || self.temporal_patch_size == 0 || self.merge_size == 0 {
            return invalid("patch_size, temporal_patch_size and merge_size must be positive");
        }
        if self.min_pixels == 0 || self.min_pixels > self.max_pixels {
            return invalid("min_pixels must be positive and not exceed max_pixels");
        }
        if self.image_std.iter().any(|s| *s == 0.0 || !s.is_finite())
            || self.image_mean.iter().any(|m| !m.is_finite())
        {
            return invalid("image_std must be finite and non-zero, image_mean finite");
        }
        Ok(())
    }
}

/// Bounds on what the decoder accepts, checked from the file's header before pixels are
/// allocated, so a decompression bomb costs nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Most bytes of one encoded image.
    pub max_encoded_bytes: usize,
    /// Most pixels (width × height) of the decoded image.
    pub max_pixels: u64,
    /// Most pixels on either side.
    pub max_side: u32,
    /// Most bytes the decoder may allocate at once.
    pub max_decoder_allocation: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        // 64 Mi pixels takes the 48-megapixel photos of current phones and refuses 100 MP; the
        // decoder's own buffers stay under 512 MiB for one such image.
        Self {
            max_encoded_bytes: 32 << 20,
            max_pixels: 64 << 20,
            max_side: 16_384,
            max_decoder_allocation: 512 << 20,
        }
    }
}
