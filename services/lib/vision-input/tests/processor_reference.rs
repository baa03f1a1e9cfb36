//! The pre-processing against `transformers`' Qwen image processor (Pillow form) on the images
//! of `tests/fixtures/vision_input` (made by `scripts/make_vision_input_fixtures.py`): the grid
//! equal, the pixel values equal (lossless formats) or within the decoders' known differences
//! (lossy formats), and the target sizes of many image sizes equal.

use std::path::PathBuf;

use ninfer_vision_input::{
    preprocess_image, smart_resize, DecodeLimits, ImageProcessorSettings, VisionInputError,
};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../tests/fixtures/vision_input")
}

fn read_json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(name)).expect("fixture file readable");
    serde_json::from_str(&text).expect("fixture JSON parses")
}

fn settings_from(value: &Value) -> ImageProcessorSettings {
    let three = |key: &str| -> [f32; 3] {
        let list: Vec<f32> = value[key]
            .as_array()
            .expect("a list")
            .iter()
            .map(|v| v.as_f64().expect("a number") as f32)
            .collect();
        [list[0], list[1], list[2]]
    };
    let number = |key: &str| value[key].as_u64().expect("a whole number");
    ImageProcessorSettings {
        min_pixels: number("min_pixels"),
        max_pixels: number("max_pixels"),
        patch_size: number("patch_size") as usize,
        temporal_patch_size: number("temporal_patch_size") as usize,
        merge_size: number("merge_size") as usize,
        image_mean: three("image_mean"),
        image_std: three("image_std"),
    }
}

/// How far a case may be from the reference, in normalised units (one 8-bit level is 2/255
/// with mean and std 0.5): lossless formats decode to the same bytes everywhere, so they must be
/// equal; JPEG and lossy WebP decoders differ from libjpeg-turbo and libwebp by a few levels
/// (IDCT, chroma upsampling, YUV conversion), which the resampling carries on.
fn tolerance(media_type: &str, name: &str) -> (f32, f64) {
    match media_type {
        "image/jpeg" => (8.0 * 2.0 / 255.0, 0.5),
        "image/webp" if name.contains("lossy") => (8.0 * 2.0 / 255.0, 0.5),
        _ => (1e-6, 0.0),
    }
}

#[test]
fn pixel_values_and_grids_equal_the_processors() {
    let reference = read_json("reference.json");
    let settings = settings_from(&reference["settings"]);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("name");
        let media_type = case["media_type"].as_str().expect("media type");
        let bytes = std::fs::read(fixtures().join(case["file"].as_str().expect("file")))
            .expect("image readable");
        let expected_bytes =
            std::fs::read(fixtures().join(case["pixel_values_file"].as_str().expect("file")))
                .expect("reference values readable");
        let expected: Vec<f32> = expected_bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let ours = preprocess_image(
            &bytes,
            Some(media_type),
            &settings,
            &DecodeLimits::default(),
        )
        .unwrap_or_else(|error| panic!("{name}: {error}"));
        let grid: Vec<u64> = case["grid_thw"]
            .as_array()
            .expect("grid")
            .iter()
            .map(|v| v.as_u64().expect("whole"))
            .collect();
        assert_eq!(
            [ours.grid.temporal, ours.grid.height, ours.grid.width].map(|v| v as u64),
            [grid[0], grid[1], grid[2]],
            "{name}: grid"
        );
        let shape = case["pixel_values_shape"].as_array().expect("shape");
        assert_eq!(
            ours.patch_len as u64,
            shape[1].as_u64().expect("whole"),
            "{name}"
        );
        assert_eq!(ours.values.len(), expected.len(), "{name}: value count");
        let differences: Vec<f32> = ours
            .values
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .collect();
        let largest = differences.iter().cloned().fold(0.0f32, f32::max);
        let differing = differences.iter().filter(|d| **d > 1e-6).count();
        let share = differing as f64 / differences.len() as f64;
        report.push(format!(
            "{name}: max |Δ| {largest:.3e}, {differing} of {} values differ",
            differences.len()
        ));
        let (max_allowed, share_allowed) = tolerance(media_type, name);
        if largest > max_allowed || share > share_allowed {
            failures.push(format!(
                "{name}: max |Δ| {largest}, share differing {share:.3}"
            ));
        }
    }
    println!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn target_sizes_equal_smart_resize() {
    let table = read_json("smart_resize.json");
    let released = settings_from(&table["settings"]["released"]);
    assert_eq!(released, ImageProcessorSettings::default());
    let small = settings_from(&table["settings"]["small"]);
    let rows = table["rows"].as_array().expect("rows");
    assert!(rows.len() > 100);
    for row in rows {
        let settings = match row["settings"].as_str() {
            Some("released") => &released,
            _ => &small,
        };
        let (height, width) = (
            row["height"].as_u64().expect("whole") as u32,
            row["width"].as_u64().expect("whole") as u32,
        );
        let ours = smart_resize(height, width, settings);
        match row["resized"].as_array() {
            Some(expected) => {
                let expected = (
                    expected[0].as_u64().expect("whole") as usize,
                    expected[1].as_u64().expect("whole") as usize,
                );
                assert_eq!(
                    ours,
                    Ok(expected),
                    "{height}x{width} ({:?})",
                    row["settings"]
                );
            }
            None => assert!(
                matches!(ours, Err(VisionInputError::AspectRatio { .. })),
                "{height}x{width}: {ours:?}"
            ),
        }
    }
}

#[test]
fn preprocessor_config_reads_the_released_file_and_keeps_class_defaults() {
    let released = r#"{"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast"}"#;
    assert_eq!(
        ImageProcessorSettings::from_preprocessor_config(released),
        Ok(ImageProcessorSettings::default())
    );
    let sparse = ImageProcessorSettings::from_preprocessor_config(r#"{"max_pixels": 1000000}"#)
        .expect("valid");
    assert_eq!(
        (sparse.min_pixels, sparse.max_pixels, sparse.patch_size),
        (3136, 1_000_000, 14)
    );
    assert!(matches!(
        ImageProcessorSettings::from_preprocessor_config(r#"{"patch_size": 0}"#),
        Err(VisionInputError::InvalidSettings(_))
    ));
}
