//! Encoded bytes → an 8-bit RGB image, as `transformers.image_utils.load_image` makes one with
//! Pillow: the first frame, turned by its EXIF orientation, converted to RGB (a palette looked
//! up, grey replicated, alpha dropped). The format is recognised from the bytes and checked
//! against the declared media type; the size is checked from the header before any pixel is
//! allocated. [`probe_image`] does the checks that need no pixels (format, declared type, size,
//! orientation, a file cut short) and gives the size the decoded image will have.

use std::io::Cursor;

use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageError, ImageFormat, ImageReader};

use crate::error::VisionInputError;
use crate::settings::DecodeLimits;

/// The formats accepted, by the name an error gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormatName {
    Png,
    Jpeg,
    Webp,
    Gif,
}

impl ImageFormatName {
    pub fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Jpeg => "JPEG",
            Self::Webp => "WebP",
            Self::Gif => "GIF",
        }
    }

    pub fn media_type(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Jpeg => "image/jpeg",
            Self::Webp => "image/webp",
            Self::Gif => "image/gif",
        }
    }

    fn image_format(self) -> ImageFormat {
        match self {
            Self::Png => ImageFormat::Png,
            Self::Jpeg => ImageFormat::Jpeg,
            Self::Webp => ImageFormat::WebP,
            Self::Gif => ImageFormat::Gif,
        }
    }

    /// The format a media type names (`image/jpg` taken for `image/jpeg`; parameters and case
    /// ignored).
    pub fn from_media_type(media_type: &str) -> Result<Self, VisionInputError> {
        let essence = media_type
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        match essence.as_str() {
            "image/png" => Ok(Self::Png),
            "image/jpeg" | "image/jpg" => Ok(Self::Jpeg),
            "image/webp" => Ok(Self::Webp),
            "image/gif" => Ok(Self::Gif),
            _ => Err(VisionInputError::UnsupportedMediaType(
                media_type.to_string(),
            )),
        }
    }

    /// The format of the bytes, from their signature.
    pub fn sniff(bytes: &[u8]) -> Result<Self, VisionInputError> {
        match image::guess_format(bytes) {
            Ok(ImageFormat::Png) => Ok(Self::Png),
            Ok(ImageFormat::Jpeg) => Ok(Self::Jpeg),
            Ok(ImageFormat::WebP) => Ok(Self::Webp),
            Ok(ImageFormat::Gif) => Ok(Self::Gif),
            _ => Err(VisionInputError::UnrecognisedFormat),
        }
    }
}

/// A decoded image: `rgb` holds `height` rows of `width` RGB triples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedImage {
    pub format: ImageFormatName,
    pub width: u32,
    pub height: u32,
    pub rgb: Vec<u8>,
}

/// What an image's header says: its format and the size of the decoded, upright image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbedImage {
    pub format: ImageFormatName,
    pub width: u32,
    pub height: u32,
}

/// The checks of [`decode_rgb`] that need no pixels: the bytes' format against the declared
/// media type, the header's size within `limits` (after the EXIF orientation, as decoding
/// turns it), and the file's end where the format marks it (a truncated file). Memory stays
/// within the decoder's header buffers whatever the file claims.
pub fn probe_image(
    bytes: &[u8],
    declared_media_type: Option<&str>,
    limits: &DecodeLimits,
) -> Result<ProbedImage, VisionInputError> {
    let format = check_format(bytes, declared_media_type, limits)?;
    if !reaches_its_end(format, bytes) {
        return Err(VisionInputError::Corrupt {
            format: format.name(),
            detail: "the file ends before its end marker (truncated)".into(),
        });
    }
    let (decoder, orientation) = checked_decoder(bytes, format, limits)?;
    let (width, height) = decoder.dimensions();
    let (width, height) = match orientation {
        Orientation::Rotate90
        | Orientation::Rotate270
        | Orientation::Rotate90FlipH
        | Orientation::Rotate270FlipH => (height, width),
        _ => (width, height),
    };
    Ok(ProbedImage {
        format,
        width,
        height,
    })
}

/// The checks before any decoding: not empty, within the encoded size, a supported format that
/// is the declared one.
fn check_format(
    bytes: &[u8],
    declared_media_type: Option<&str>,
    limits: &DecodeLimits,
) -> Result<ImageFormatName, VisionInputError> {
    if bytes.is_empty() {
        return Err(VisionInputError::Empty);
    }
    if bytes.len() > limits.max_encoded_bytes {
        return Err(VisionInputError::EncodedTooLarge {
            bytes: bytes.len(),
            limit: limits.max_encoded_bytes,
        });
    }
    let declared = declared_media_type
        .map(ImageFormatName::from_media_type)
        .transpose()?;
    let format = ImageFormatName::sniff(bytes)?;
    if let Some(declared) = declared.filter(|declared| *declared != format) {
        return Err(VisionInputError::MediaTypeMismatch {
            declared: declared.media_type().to_string(),
            detected: format.name().to_string(),
        });
    }
    Ok(format)
}

/// Whether the file reaches the end its format marks: a PNG's `IEND` chunk, a GIF's trailer, a
/// WebP's RIFF length, a JPEG's end-of-image marker after its first scan.
fn reaches_its_end(format: ImageFormatName, bytes: &[u8]) -> bool {
    match format {
        // `IEND` and its checksum, past which a writer may have left a few bytes.
        ImageFormatName::Png => {
            let tail = bytes.len().saturating_sub(64);
            bytes[tail..]
                .windows(4)
                .enumerate()
                .any(|(offset, chunk)| chunk == b"IEND" && tail + offset + 8 <= bytes.len())
        } // The trailer byte, past any padding a writer left.
        ImageFormatName::Gif => bytes
            .iter()
            .rev()
            .find(|&&byte| byte != 0 && byte != b'\n')
            .is_some_and(|&byte| byte == 0x3B),
        ImageFormatName::Webp => bytes.get(4..8).is_some_and(|length| {
            let riff = u32::from_le_bytes([length[0], length[1], length[2], length[3]]);
            (riff as usize).saturating_add(8) <= bytes.len()
        }),
        ImageFormatName::Jpeg => jpeg_reaches_its_end_marker(bytes),
    }
}

/// Decodes `bytes` within `limits` (see the module doc).
pub fn decode_rgb(
    bytes: &[u8],
    declared_media_type: Option<&str>,
    limits: &DecodeLimits,
) -> Result<DecodedImage, VisionInputError> {
    let format = check_format(bytes, declared_media_type, limits)?;
    let corrupt = |error: ImageError| decode_error(format, error);
    // The JPEG decoder fills a cut-off scan with grey where Pillow refuses the file.
    if format == ImageFormatName::Jpeg && !jpeg_reaches_its_end_marker(bytes) {
        return Err(VisionInputError::Corrupt {
            format: format.name(),
            detail: "the file ends before its end-of-image marker (truncated)".into(),
        });
    }
    let (decoder, orientation) = checked_decoder(bytes, format, limits)?;
    let mut image = DynamicImage::from_decoder(decoder).map_err(corrupt)?;
    image.apply_orientation(orientation);
    let rgb = image.to_rgb8();
    Ok(DecodedImage {
        format,
        width: rgb.width(),
        height: rgb.height(),
        rgb: rgb.into_raw(),
    })
}

/// The decoder of `bytes` (of `format`) with its allocations bounded, once its header's size
/// passed the limits, and the EXIF orientation decoding applies.
fn checked_decoder<'bytes>(
    bytes: &'bytes [u8],
    format: ImageFormatName,
    limits: &DecodeLimits,
) -> Result<(impl ImageDecoder + 'bytes, Orientation), VisionInputError> {
    let corrupt = |error: ImageError| decode_error(format, error);
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format.image_format());
    let mut decoder_limits = image::Limits::default();
    decoder_limits.max_alloc = Some(limits.max_decoder_allocation);
    reader.limits(decoder_limits);
    let mut decoder = reader.into_decoder().map_err(corrupt)?;
    let (width, height) = decoder.dimensions();
    check_dimensions(width, height, limits)?;
    let orientation = decoder.orientation().map_err(corrupt)?;
    Ok((decoder, orientation))
}

/// The header's size against the limits, before the pixels are decoded.
fn check_dimensions(
    width: u32,
    height: u32,
    limits: &DecodeLimits,
) -> Result<(), VisionInputError> {
    let (wide, high) = (u64::from(width), u64::from(height));
    if width == 0 || height == 0 {
        return Err(VisionInputError::NoPixels {
            width: wide,
            height: high,
        });
    }
    if width > limits.max_side || height > limits.max_side {
        return Err(VisionInputError::SideTooLong {
            width: wide,
            height: high,
            limit: limits.max_side.into(),
        });
    }
    let pixels = wide * high;
    if pixels > limits.max_pixels {
        return Err(VisionInputError::TooManyPixels {
            width: wide,
            height: high,
            pixels,
            limit: limits.max_pixels,
        });
    }
    Ok(())
}

/// Whether a JPEG's end-of-image marker (`FF D9`) follows its first scan. The segments before
/// the scan are skipped by their lengths (an EXIF thumbnail there has its own markers); inside
/// and between scans an `FF` byte of data is always followed by `00` or a marker other than
/// `D9`, so the first `FF D9` found after the first scan header is the image's end.
fn jpeg_reaches_its_end_marker(bytes: &[u8]) -> bool {
    let mut position = 2; // after SOI
    loop {
        let Some(&[0xFF, marker]) = bytes.get(position..position + 2) else {
            return false;
        };
        match marker {
            // Fill bytes before a marker.
            0xFF => position += 1,
            // Markers without a length.
            0x01 | 0xD0..=0xD7 => position += 2,
            0xD9 => return false,
            _ => {
                let Some(&[high, low]) = bytes.get(position + 2..position + 4) else {
                    return false;
                };
                let length = usize::from(u16::from_be_bytes([high, low]));
                position += 2 + length;
                if marker == 0xDA {
                    break;
                }
            }
        }
    }
    bytes
        .get(position..)
        .is_some_and(|rest| rest.windows(2).any(|pair| pair == [0xFF, 0xD9]))
}

fn decode_error(format: ImageFormatName, error: ImageError) -> VisionInputError {
    let format = format.name();
    match error {
        ImageError::Limits(detail) => VisionInputError::DecodeMemoryLimit {
            format,
            detail: detail.to_string(),
        },
        ImageError::Unsupported(detail) => VisionInputError::UnsupportedFeature {
            format,
            detail: detail.to_string(),
        },
        other => VisionInputError::Corrupt {
            format,
            detail: other.to_string(),
        },
    }
}
