//! A video given as frames against `transformers`' `Qwen3VLVideoProcessor`
//! (`video_prompt_reference.json` and `video_reference.pixel_values.f32`, made by
//! `scripts/make_video_reference.py` with the `qwen3_5_moe` fixture's processor settings): the
//! grids, the pixel values of every temporal patch (an odd frame count's last frame repeated)
//! and the timestamps the prompt writes.

use std::path::PathBuf;

use ninfer_vision_input::{
    preprocess_video, temporal_patch_timestamps, timestamp_text, DecodeLimits, EncodedFrame,
    ImageProcessorSettings,
};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../tests/fixtures")
}

#[test]
fn frames_become_the_processors_pixel_values_and_grids() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3_5_moe/video_prompt_reference.json"))
            .expect("reference readable"),
    )
    .expect("reference parses");
    let settings = ImageProcessorSettings::from_preprocessor_config(
        &std::fs::read_to_string(fixtures().join("qwen3_5_moe/preprocessor_config.json"))
            .expect("settings readable"),
    )
    .expect("settings parse");
    let expected: Vec<f32> =
        std::fs::read(fixtures().join("vision_input/video_reference.pixel_values.f32"))
            .expect("pixel values readable")
            .chunks_exact(4)
            .map(|bytes| f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
            .collect();
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
        for seconds in temporal_patch_timestamps(frames.len(), fps, settings.temporal_patch_size) {
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
