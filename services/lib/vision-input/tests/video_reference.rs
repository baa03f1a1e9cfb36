//! A video given as frames against `transformers`' `Qwen3VLVideoProcessor`:
//!
//! * `video_prompt_reference.json` and `video_reference.pixel_values.f32` (made by
//!   `scripts/make_video_reference.py`; the `qwen3_5_moe` fixture has no video processor file,
//!   so its `preprocessor_config.json` is read as one, as `transformers` falls back to it): the
//!   grids, the pixel values of every temporal patch (an odd frame count's last frame repeated)
//!   and the timestamps the prompt writes;
//! * `video_resize_reference.json` (made by `scripts/make_video_resize_reference.py`): clips
//!   whose frames the processor resizes — shrinking, one side up and one down, a side under
//!   the grid unit, under the per-frame pixel cap — with video processor settings of their
//!   own: the grids and the pixel values of `torchvision`'s resize and normalisation, which
//!   Pillow's resize would not give.

use std::path::PathBuf;

use ninfer_vision_input::{
    decode_rgb, preprocess_video, resize_bicubic_like_pillow, resize_bicubic_like_torchvision,
    temporal_patch_timestamps, timestamp_text, video_smart_resize, DecodeLimits, EncodedFrame,
    VideoProcessorSettings, VisionInputError,
};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../tests/fixtures")
}

/// Little-endian f32 values of a fixture file.
fn read_f32(name: &str) -> Vec<f32> {
    std::fs::read(fixtures().join(name))
        .expect("pixel values readable")
        .chunks_exact(4)
        .map(|bytes| f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
        .collect()
}

#[test]
fn frames_become_the_processors_pixel_values_and_grids() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3_5_moe/video_prompt_reference.json"))
            .expect("reference readable"),
    )
    .expect("reference parses");
    let settings = VideoProcessorSettings::from_video_preprocessor_config(
        &std::fs::read_to_string(fixtures().join("qwen3_5_moe/preprocessor_config.json"))
            .expect("settings readable"),
    )
    .expect("settings parse");
    let expected = read_f32("vision_input/video_reference.pixel_values.f32");
    let fps = reference["fps"].as_f64().expect("fps");
    let mut values = Vec::new();
    let mut stamps = String::new();
    for (video, files) in reference["frame_files"]
        .as_array()
        .expect("videos")
        .iter()
        .enumerate()
    {
        let bytes: Vec<Vec<u8>> = files
            .as_array()
            .expect("frames")
            .iter()
            .map(|name| {
                std::fs::read(
                    fixtures()
                        .join("vision_input")
                        .join(name.as_str().expect("name")),
                )
                .expect("frame readable")
            })
            .collect();
        let frames: Vec<EncodedFrame<'_>> = bytes
            .iter()
            .map(|encoded| EncodedFrame {
                encoded,
                declared_media_type: Some("image/png"),
            })
            .collect();
        let pairs =
            preprocess_video(&frames, &settings, &DecodeLimits::default()).expect("pre-processed");
        let grid = &reference["video_grid_thw"][video];
        let number = |index: usize| grid[index].as_u64().expect("whole") as usize;
        assert_eq!(pairs.len(), number(0), "video {video}: temporal patches");
        for pair in &pairs {
            assert_eq!(pair.grid.temporal, 1);
            assert_eq!((pair.grid.height, pair.grid.width), (number(1), number(2)));
            values.extend_from_slice(&pair.values);
        }
        for seconds in
            temporal_patch_timestamps(frames.len(), fps, settings.frames.temporal_patch_size)
        {
            stamps.push_str(&timestamp_text(seconds));
        }
    }
    assert_eq!(values.len(), expected.len());
    let largest = values
        .iter()
        .zip(&expected)
        .map(|(ours, theirs)| (ours - theirs).abs())
        .fold(0f32, f32::max);
    assert!(largest <= 1e-5, "max |Δ| = {largest}");
    // The stamps, in order, are those of the processor's expanded prompt.
    let prompt = reference["prompt_text"].as_str().expect("prompt");
    let theirs: String = prompt
        .match_indices('<')
        .filter_map(|(at, _)| {
            let rest = &prompt[at..];
            let end = rest.find('>')?;
            rest[..=end]
                .ends_with(" seconds>")
                .then(|| rest[..=end].to_string())
        })
        .collect();
    assert_eq!(stamps, theirs);
}

#[test]
fn resized_frames_are_the_video_processors_under_its_own_settings() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("vision_input/video_resize_reference.json"))
            .expect("reference readable"),
    )
    .expect("reference parses");
    let expected = read_f32("vision_input/video_resize_reference.pixel_values.f32");
    let mut pillow_would_differ = false;
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("name");
        let settings = VideoProcessorSettings::from_video_preprocessor_config(
            &case["video_preprocessor_config"].to_string(),
        )
        .expect("settings parse");
        let bytes: Vec<Vec<u8>> = case["frame_files"]
            .as_array()
            .expect("frames")
            .iter()
            .map(|file| {
                std::fs::read(
                    fixtures()
                        .join("vision_input")
                        .join(file.as_str().expect("name")),
                )
                .expect("frame readable")
            })
            .collect();
        let frames: Vec<EncodedFrame<'_>> = bytes
            .iter()
            .map(|encoded| EncodedFrame {
                encoded,
                declared_media_type: None,
            })
            .collect();
        let pairs =
            preprocess_video(&frames, &settings, &DecodeLimits::default()).expect("pre-processed");
        let grid: Vec<usize> = case["video_grid_thw"]
            .as_array()
            .expect("grid")
            .iter()
            .map(|v| v.as_u64().expect("whole") as usize)
            .collect();
        assert_eq!(pairs.len(), grid[0], "{name}: temporal patches");
        let values: Vec<f32> = pairs
            .iter()
            .flat_map(|pair| {
                assert_eq!(
                    (pair.grid.height, pair.grid.width),
                    (grid[1], grid[2]),
                    "{name}"
                );
                pair.values.iter().copied()
            })
            .collect();
        let offset = case["values_offset"].as_u64().expect("offset") as usize;
        let count = case["values_count"].as_u64().expect("count") as usize;
        assert_eq!(values.len(), count, "{name}: values");
        let theirs = &expected[offset..offset + count];
        let largest = values
            .iter()
            .zip(theirs)
            .map(|(ours, theirs)| (ours - theirs).abs())
            .fold(0f32, f32::max);
        println!("{name}: max |Δ| {largest:e}");
        assert!(largest <= 1e-6, "{name}: max |Δ| = {largest}");

        // The frames' resize is the one that tells the processors apart: Pillow's would give
        // other bytes for some of these frames.
        let decoded = decode_rgb(&bytes[0], None, &DecodeLimits::default()).expect("decodes");
        let (height, width) =
            video_smart_resize(frames.len(), decoded.height, decoded.width, &settings)
                .expect("sized");
        type Resize = fn(&[u8], u32, u32, usize, usize) -> Result<Vec<u8>, VisionInputError>;
        let resize = |resize_fn: Resize| -> Vec<u8> {
            resize_fn(&decoded.rgb, decoded.width, decoded.height, width, height).expect("resized")
        };
        pillow_would_differ |=
            resize(resize_bicubic_like_pillow) != resize(resize_bicubic_like_torchvision);
    }
    assert!(pillow_would_differ, "no clip tells the two resizes apart");
}
