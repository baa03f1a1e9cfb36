//! Images a client can send to hurt the server: each is refused with the error naming its
//! problem, and the oversized ones are refused from their header, before pixels are allocated
//! (the crafted files here carry almost no pixel data, so reaching the decoder would fail
//! differently).

use std::path::PathBuf;

use ninfer_vision_input::crafted::{gif_header_only, png_header_only};
use ninfer_vision_input::{
    decode_rgb, preprocess_image, probe_grid, probe_image, DecodeLimits, ImageProcessorSettings,
    VisionInputError,
};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../tests/fixtures/vision_input")
        .join(name);
    std::fs::read(path).expect("fixture readable")
}

fn limits() -> DecodeLimits {
    DecodeLimits::default()
}

#[test]
fn a_decompression_bomb_is_refused_from_its_header() {
    // 12,000 × 12,000 = 144 MP: every side allowed, the pixel count not.
    let error = decode_rgb(
        &png_header_only(12_000, 12_000),
        Some("image/png"),
        &limits(),
    )
    .expect_err("refused");
    assert_eq!(
        error,
        VisionInputError::TooManyPixels {
            width: 12_000,
            height: 12_000,
            pixels: 144_000_000,
            limit: 64 << 20
        }
    );
    assert!(error.to_string().contains("12000x12000"), "{error}");
    // 20,000 × 20,000: a side over the limit.
    let error = decode_rgb(&png_header_only(20_000, 20_000), None, &limits()).expect_err("refused");
    assert!(
        matches!(error, VisionInputError::SideTooLong { width: 20_000, .. }),
        "{error}"
    );
    // The same for GIF (its largest screen, 65535²).
    let error = decode_rgb(
        &gif_header_only(65_535, 65_535),
        Some("image/gif"),
        &limits(),
    )
    .expect_err("refused");
    assert!(
        matches!(error, VisionInputError::SideTooLong { .. }),
        "{error}"
    );
}

#[test]
fn a_100_megapixel_image_is_refused_and_a_large_photo_is_not() {
    let error = decode_rgb(&png_header_only(12_500, 8_000), None, &limits()).expect_err("refused");
    assert!(matches!(
        error,
        VisionInputError::TooManyPixels {
            pixels: 100_000_000,
            ..
        }
    ));
    // A 48 MP header passes the size checks and fails only for want of pixel data.
    let error = decode_rgb(&png_header_only(8_000, 6_000), None, &limits()).expect_err("no data");
    assert!(
        matches!(error, VisionInputError::Corrupt { format: "PNG", .. }),
        "{error}"
    );
}

#[test]
fn truncated_and_corrupt_files_are_refused_as_corrupt() {
    let png = fixture("png_rgb_downscale.png");
    let error = decode_rgb(&png[..png.len() / 2], Some("image/png"), &limits()).expect_err("cut");
    assert!(
        matches!(error, VisionInputError::Corrupt { format: "PNG", .. }),
        "{error}"
    );
    let gif = fixture("gif_first_frame.gif");
    let error = decode_rgb(&gif[..gif.len() / 2], None, &limits()).expect_err("cut");
    assert!(
        matches!(error, VisionInputError::Corrupt { format: "GIF", .. }),
        "{error}"
    );
    // A cut JPEG (its decoder would fill the rest with grey), and one cut just before its end.
    let jpeg = fixture("jpeg_420.jpg");
    for cut in [jpeg.len() / 2, jpeg.len() - 2] {
        let error = decode_rgb(&jpeg[..cut], None, &limits()).expect_err("cut");
        assert!(
            matches!(error, VisionInputError::Corrupt { format: "JPEG", .. }),
            "{error}"
        );
    }
    // The EXIF thumbnail's end marker before the scan does not count as the image's.
    let rotated = fixture("jpeg_exif_rotated.jpg");
    assert!(decode_rgb(&rotated, None, &limits()).is_ok());
    let error = decode_rgb(&rotated[..rotated.len() - 100], None, &limits()).expect_err("cut");
    assert!(
        matches!(error, VisionInputError::Corrupt { format: "JPEG", .. }),
        "{error}"
    );
    let webp = fixture("webp_lossless.webp");
    let error = decode_rgb(&webp[..webp.len() / 2], None, &limits()).expect_err("cut");
    assert!(
        matches!(error, VisionInputError::Corrupt { format: "WebP", .. }),
        "{error}"
    );
    // A PNG whose pixel data is noise: the checksum of IDAT fails.
    let mut garbled = png.clone();
    let middle = garbled.len() / 2;
    for byte in &mut garbled[middle..middle + 16] {
        *byte ^= 0x5A;
    }
    let error = decode_rgb(&garbled, None, &limits()).expect_err("garbled");
    assert!(
        matches!(error, VisionInputError::Corrupt { format: "PNG", .. }),
        "{error}"
    );
}

#[test]
fn wrong_or_unsupported_media_types_are_named() {
    let svg = br#"<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>"#;
    assert_eq!(
        decode_rgb(svg, Some("image/svg+xml"), &limits()),
        Err(VisionInputError::UnsupportedMediaType(
            "image/svg+xml".into()
        ))
    );
    assert_eq!(
        decode_rgb(svg, Some("image/png"), &limits()),
        Err(VisionInputError::UnrecognisedFormat)
    );
    let png = fixture("png_rgb_downscale.png");
    let error = decode_rgb(&png, Some("image/jpeg"), &limits()).expect_err("mismatch");
    assert_eq!(
        error,
        VisionInputError::MediaTypeMismatch {
            declared: "image/jpeg".into(),
            detected: "PNG".into()
        }
    );
    assert_eq!(
        error.to_string(),
        "image declared as `image/jpeg` but its bytes are PNG"
    );
    // Parameters and case do not matter; `image/jpg` is JPEG.
    assert!(decode_rgb(&png, Some("IMAGE/PNG; charset=binary"), &limits()).is_ok());
    let jpeg = fixture("jpeg_420.jpg");
    assert!(decode_rgb(&jpeg, Some("image/jpg"), &limits()).is_ok());
}

#[test]
fn empty_oversized_and_extreme_aspect_images_are_refused() {
    assert_eq!(
        decode_rgb(&[], None, &limits()),
        Err(VisionInputError::Empty)
    );
    let png = fixture("png_rgb_downscale.png");
    let small = DecodeLimits {
        max_encoded_bytes: 1_000,
        ..limits()
    };
    assert!(matches!(
        decode_rgb(&png, None, &small),
        Err(VisionInputError::EncodedTooLarge { limit: 1_000, .. })
    ));
    // 1 × 250: decodable, but more extreme than the processor's 200:1.
    let mut thin = Vec::new();
    image::RgbImage::from_pixel(250, 1, image::Rgb([10, 20, 30]))
        .write_to(
            &mut std::io::Cursor::new(&mut thin),
            image::ImageFormat::Png,
        )
        .expect("encodes");
    let error = preprocess_image(&thin, None, &ImageProcessorSettings::default(), &limits())
        .expect_err("refused");
    assert_eq!(
        error,
        VisionInputError::AspectRatio {
            width: 250,
            height: 1
        }
    );
}

#[test]
fn the_released_settings_give_the_released_token_counts() {
    // A 1024 × 768 photo at the released settings: 1024 × 768 stays (multiples of 32, within
    // the bounds), 64 × 48 patches, 768 merged tokens, rows of 3·2·16·16 values.
    let mut bytes = Vec::new();
    image::RgbImage::from_fn(1024, 768, |x, y| {
        image::Rgb([(x % 256) as u8, (y % 256) as u8, 7])
    })
    .write_to(
        &mut std::io::Cursor::new(&mut bytes),
        image::ImageFormat::Png,
    )
    .expect("encodes");
    let patches = preprocess_image(&bytes, None, &ImageProcessorSettings::default(), &limits())
        .expect("processed");
    assert_eq!(
        (
            patches.grid.temporal,
            patches.grid.height,
            patches.grid.width
        ),
        (1, 48, 64)
    );
    assert_eq!(patches.grid.merged_tokens(2), 768);
    assert_eq!(patches.patch_len, 1536);
    assert_eq!(patches.values.len(), 3072 * 1536);
    // The first row is the top-left patch: channel 0, both temporal slots, x = 0..16 of y = 0.
    let first: Vec<f32> = (0..16).map(|x| (x as f32 / 255.0 - 0.5) / 0.5).collect();
    for (ours, expected) in patches.values[..16].iter().zip(&first) {
        assert!((ours - expected).abs() < 1e-6);
    }
    assert_eq!(patches.values[..16], patches.values[256..272]);
    // Row 2 of the output is the first block's second row: patch (1, 0), y = 16.
    let second_row_first_pixel = patches.values[2 * 1536 + 512];
    assert!((second_row_first_pixel - (16.0 / 255.0 - 0.5) / 0.5).abs() < 1e-6);
}

/// Every fixture's header gives the size and grid its decoding gives (the EXIF-rotated JPEG
/// turned), and the hostile files are refused from the header alone as decoding refuses them
/// (a truncated file by its missing end).
#[test]
fn the_header_probe_agrees_with_decoding() {
    let settings = ImageProcessorSettings {
        min_pixels: 1024,
        max_pixels: 4096,
        patch_size: 8,
        ..ImageProcessorSettings::default()
    };
    let directory =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../tests/fixtures/vision_input");
    let mut probed = 0;
    for entry in std::fs::read_dir(directory).expect("fixtures") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if name.ends_with(".f32") || name.ends_with(".json") {
            continue;
        }
        let bytes = std::fs::read(&path).expect("readable");
        let header = probe_image(&bytes, None, &limits()).expect("probed");
        let decoded = decode_rgb(&bytes, None, &limits()).expect("decoded");
        assert_eq!(
            (header.width, header.height),
            (decoded.width, decoded.height),
            "{name}"
        );
        let grid = probe_grid(&bytes, None, &settings, &limits()).expect("grid");
        let patches = preprocess_image(&bytes, None, &settings, &limits()).expect("patches");
        assert_eq!(grid, patches.grid, "{name}");
        for cut in [bytes.len() / 2, bytes.len() - 1] {
            let error = probe_image(&bytes[..cut], None, &limits()).expect_err("cut");
            assert!(
                matches!(error, VisionInputError::Corrupt { .. }),
                "{name} cut at {cut}: {error}"
            );
        }
        probed += 1;
    }
    // Eleven images, the seven frames of the video reference and the eighteen of the resized
    // videos' reference.
    assert_eq!(probed, 36);
    let error = probe_image(&png_header_only(20_000, 20_000), None, &limits()).expect_err("big");
    assert!(
        matches!(error, VisionInputError::SideTooLong { .. }),
        "{error}"
    );
    let error = probe_image(&png_header_only(12_000, 12_000), None, &limits()).expect_err("bomb");
    assert!(
        matches!(error, VisionInputError::TooManyPixels { .. }),
        "{error}"
    );
    let png = fixture("png_rgb_downscale.png");
    let error = probe_image(&png, Some("image/webp"), &limits()).expect_err("declared");
    assert!(
        matches!(error, VisionInputError::MediaTypeMismatch { .. }),
        "{error}"
    );
    let svg = br#"<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>"#;
    assert!(probe_image(svg, Some("image/svg+xml"), &limits()).is_err());
    assert_eq!(
        probe_image(svg, None, &limits()),
        Err(VisionInputError::UnrecognisedFormat)
    );
}
