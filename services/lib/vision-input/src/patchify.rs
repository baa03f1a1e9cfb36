//! Normalisation and the patch layout: the resized 8-bit image becomes the rows the patch
//! embedding takes, in the order the merger groups them (docs/MODELS.md §10.2, step 4 and 5).

use crate::error::VisionInputError;
use crate::settings::ImageProcessorSettings;

/// An image's patch grid: `temporal` frames (1 for an image) of `height × width` patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageGrid {
    pub temporal: usize,
    pub height: usize,
    pub width: usize,
}

impl ImageGrid {
    /// Patch rows of the image (the vision encoder's sequence).
    pub fn patches(&self) -> usize {
        self.temporal * self.height * self.width
    }

    /// `<|image_pad|>` tokens the image takes in the prompt: one per merged block.
    pub fn merged_tokens(&self, merge_size: usize) -> usize {
        self.patches() / (merge_size * merge_size)
    }
}

/// The processor's output for one image: `grid.patches()` rows of `patch_len` values.
#[derive(Debug, Clone, PartialEq)]
pub struct PixelPatches {
    pub values: Vec<f32>,
    pub patch_len: usize,
    pub grid: ImageGrid,
}

/// How 8-bit values become the normalised ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PixelScaling {
    /// The image processor's PIL form: `f32(level · (1/255))` (f64 rounded to f32, as numpy
    /// does), then `(x − mean) / std` in f32.
    RescaleThenNormalise,
    /// The `torchvision` form the video processor runs: rescale folded into the normalisation,
    /// `(level − mean·255) / (std·255)` in f32 with `mean·255` and `std·255` products of f32s.
    Fused,
}

impl PixelScaling {
    /// The normalised value of each of the 256 levels of each channel.
    fn table(self, settings: &ImageProcessorSettings) -> [[f32; 256]; 3] {
        let mut table = [[0f32; 256]; 3];
        // `1 / (1/255)` in f64, as an f32 (255 exactly).
        let inverse_rescale = (1.0 / (1.0f64 / 255.0)) as f32;
        for (channel, values) in table.iter_mut().enumerate() {
            let (mean, std) = (settings.image_mean[channel], settings.image_std[channel]);
            for (level, value) in values.iter_mut().enumerate() {
                *value = match self {
                    PixelScaling::RescaleThenNormalise => {
                        let rescaled = (level as f64 * (1.0 / 255.0)) as f32;
                        (rescaled - mean) / std
                    }
                    PixelScaling::Fused => {
                        (level as f32 - mean * inverse_rescale) / (std * inverse_rescale)
                    }
                };
            }
        }
        table
    }
}

/// Rescales (`/255`, in f64 rounded to f32 as numpy does), normalises per channel in f32 and
/// lays `rgb` (`height × width` RGB triples, sides multiples of `patch_size · merge_size`) out
/// as patch rows: merge blocks in raster order, the `merge × merge` patches of a block in raster
/// order, each row `(channel, temporal slot, y, x)` with the image in every temporal slot.
pub fn normalise_and_patchify(
    rgb: &[u8],
    height: usize,
    width: usize,
    settings: &ImageProcessorSettings,
) -> Result<PixelPatches, VisionInputError> {
    let slots = vec![rgb; settings.temporal_patch_size];
    normalise_and_patchify_frames(
        &slots,
        height,
        width,
        settings,
        PixelScaling::RescaleThenNormalise,
    )
}

/// [`normalise_and_patchify`] of one temporal patch whose `temporal_patch_size` slots hold
/// `frames` in order (a video's consecutive frames; an image is itself in every slot), the
/// levels scaled as `scaling` says.
pub fn normalise_and_patchify_frames(
    frames: &[&[u8]],
    height: usize,
    width: usize,
    settings: &ImageProcessorSettings,
    scaling: PixelScaling,
) -> Result<PixelPatches, VisionInputError> {
    let (patch, merge, temporal) = (
        settings.patch_size,
        settings.merge_size,
        settings.temporal_patch_size,
    );
    let factor = settings.factor();
    if height == 0 || width == 0 || height % factor != 0 || width % factor != 0 {
        return Err(VisionInputError::InvalidSettings(format!(
            "a {width}x{height} image does not divide into {factor}-pixel merged patches"
        )));
    }
    if frames.len() != temporal {
        return Err(VisionInputError::InvalidSettings(format!(
            "a temporal patch holds {temporal} frames, got {}",
            frames.len()
        )));
    }
    if let Some(rgb) = frames.iter().find(|rgb| rgb.len() != height * width * 3) {
        return Err(VisionInputError::InvalidSettings(format!(
            "an RGB image of {width}x{height} needs {} bytes, got {}",
            height * width * 3,
            rgb.len()
        )));
    }
    // The 256 possible values of each channel, computed once.
    let table = scaling.table(settings);
    let grid = ImageGrid {
        temporal: 1,
        height: height / patch,
        width: width / patch,
    };
    let patch_len = settings.patch_len();
    let mut values = Vec::with_capacity(grid.patches() * patch_len);
    for block_row in 0..grid.height / merge {
        for block_column in 0..grid.width / merge {
            for within_row in 0..merge {
                for within_column in 0..merge {
                    let top = (block_row * merge + within_row) * patch;
                    let left = (block_column * merge + within_column) * patch;
                    for (channel, channel_table) in table.iter().enumerate() {
                        for rgb in frames {
                            for y in top..top + patch {
                                let row =
                                    &rgb[(y * width + left) * 3..(y * width + left + patch) * 3];
                                values.extend(
                                    row.chunks_exact(3)
                                        .map(|pixel| channel_table[usize::from(pixel[channel])]),
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(PixelPatches {
        values,
        patch_len,
        grid,
    })
}
