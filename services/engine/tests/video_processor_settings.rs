//! A checkpoint's video processor settings through conversion to the engine's video path: the
//! converter embeds `video_preprocessor_config.json` (or `processor_config.json`'s nested
//! `video_processor`, which `transformers` prefers), and the engine sizes a video's frames with
//! its bounds instead of the image processor's, reports them for the gateway, and falls back to
//! `preprocessor_config.json` read as a video processor's where the checkpoint has neither. A
//! checkpoint with no processor file at all gets the released bounds in the tower's own patches.

use std::path::Path;
use std::sync::Arc;

use ninfer_artifact::Artifact;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::service::images::ImageEncoding;
use ninfer_engine::testing::golden_fixture_dir;
use ninfer_vision_input::{
    probe_video_grid, DecodeLimits, EncodedFrame, ImageGrid, VideoProcessorSettings,
};

/// The video processor settings written beside the fixture: a quarter of the image processor's
/// upper bound, a frame rate of its own.
const VIDEO_CONFIG: &str = r#"{"size": {"shortest_edge": 256, "longest_edge": 1024},
    "patch_size": 8, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "fps": 4.0, "video_processor_type": "Qwen3VLVideoProcessor"}"#;

/// The `qwen3_5_moe` fixture's files linked into `directory`, with `extra` files written beside.
fn checkpoint_with(directory: &Path, extra: &[(&str, &str)]) {
    checkpoint_without(directory, extra, "")
}

/// [`checkpoint_with`], leaving out the fixture's file `left_out`.
fn checkpoint_without(directory: &Path, extra: &[(&str, &str)], left_out: &str) {
    for entry in std::fs::read_dir(golden_fixture_dir("qwen3_5_moe")).expect("fixture") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("name");
        if name.to_str() != Some(left_out) {
            std::os::unix::fs::symlink(&path, directory.join(name)).expect("link");
        }
    }
    for (name, text) in extra {
        std::fs::write(directory.join(name), text).expect("written");
    }
}

fn converted(directory: &Path, skip_vision: bool) -> Arc<Artifact> {
    let output = directory.join("model.ninfer");
    let mut options = ConvertOptions::new(directory, &output);
    options.skip_vision = skip_vision;
    convert_checkpoint(&options, &NoProgress).expect("converts");
    Arc::new(Artifact::open(&output).expect("opens"))
}

/// The grid of each frame pair of the reference's first video (four 32×32 frames).
fn first_video_grid(settings: &VideoProcessorSettings) -> ImageGrid {
    let frames: Vec<Vec<u8>> = (0..4)
        .map(|index| {
            std::fs::read(
                golden_fixture_dir("vision_input").join(format!("video_0_frame_{index}.png")),
            )
            .expect("frame")
        })
        .collect();
    let encoded: Vec<EncodedFrame<'_>> = frames
        .iter()
        .map(|encoded| EncodedFrame {
            encoded,
            declared_media_type: None,
        })
        .collect();
    let (grid, pairs) =
        probe_video_grid(&encoded, settings, &DecodeLimits::default()).expect("probed");
    assert_eq!(pairs, 2);
    grid
}

#[test]
fn the_checkpoints_video_processor_sizes_the_frames() {
    let scratch = tempfile::tempdir().expect("scratch directory");
    checkpoint_with(
        scratch.path(),
        &[("video_preprocessor_config.json", VIDEO_CONFIG)],
    );
    let artifact = converted(scratch.path(), false);
    assert!(artifact.file("video_preprocessor_config.json").is_some());
    let encoding = ImageEncoding::for_artifact(&artifact)
        .expect("image path")
        .expect("a vision tower");
    let expected =
        VideoProcessorSettings::from_video_preprocessor_config(VIDEO_CONFIG).expect("valid");
    assert_eq!(encoding.video_settings(), &expected);
    // What the gateway is told reads back to the same settings.
    assert_eq!(
        VideoProcessorSettings::from_video_preprocessor_config(
            &encoding.video_settings().to_json()
        ),
        Ok(expected.clone())
    );
    // Four 32×32 frames: within the image processor's 4096 pixels a pair is 4×4 patches; the
    // video processor's 1024 for the whole clip shrinks the frames to 16×16, 2×2 patches.
    assert_eq!(
        first_video_grid(encoding.video_settings()),
        ImageGrid {
            temporal: 1,
            height: 2,
            width: 2
        }
    );
    // The image processor keeps its own bounds.
    let image_settings: serde_json::Value =
        serde_json::from_str(&encoding.settings_json()).expect("JSON");
    assert_eq!(image_settings["max_pixels"], 4096);

    // Without the file (and without the vision tower) nothing is embedded.
    let without = tempfile::tempdir().expect("scratch directory");
    checkpoint_with(
        without.path(),
        &[("video_preprocessor_config.json", VIDEO_CONFIG)],
    );
    assert!(converted(without.path(), true)
        .file("video_preprocessor_config.json")
        .is_none());
}

#[test]
fn the_nested_video_processor_wins_and_the_image_file_stands_in() {
    let scratch = tempfile::tempdir().expect("scratch directory");
    let nested = format!(
        r#"{{"processor_class": "Qwen3VLProcessor", "video_processor": {}}}"#,
        VIDEO_CONFIG.replace("\"fps\": 4.0", "\"fps\": 5.0")
    );
    checkpoint_with(
        scratch.path(),
        &[
            ("video_preprocessor_config.json", VIDEO_CONFIG),
            ("processor_config.json", &nested),
        ],
    );
    let encoding = ImageEncoding::for_artifact(&converted(scratch.path(), false))
        .expect("image path")
        .expect("a vision tower");
    assert_eq!(encoding.video_settings().fps, 5.0);
    assert_eq!(encoding.video_settings().frames.max_pixels, 1024);

    // The fixture alone has no video processor file: its preprocessor_config.json is read as
    // one (its `size`, patch 8), the frame rate the class's.
    let plain = tempfile::tempdir().expect("scratch directory");
    checkpoint_with(plain.path(), &[]);
    let artifact = converted(plain.path(), false);
    assert!(artifact.file("video_preprocessor_config.json").is_none());
    let encoding = ImageEncoding::for_artifact(&artifact)
        .expect("image path")
        .expect("a vision tower");
    let settings = encoding.video_settings();
    assert_eq!(
        (
            settings.frames.min_pixels,
            settings.frames.max_pixels,
            settings.frames.patch_size,
            settings.fps
        ),
        (1024, 4096, 8, 2.0)
    );
    assert_eq!(
        first_video_grid(settings),
        ImageGrid {
            temporal: 1,
            height: 4,
            width: 4
        }
    );
}

#[test]
fn without_processor_files_the_released_bounds_come_in_the_towers_patches() {
    let scratch = tempfile::tempdir().expect("scratch directory");
    checkpoint_without(scratch.path(), &[], "preprocessor_config.json");
    let artifact = converted(scratch.path(), false);
    assert!(artifact.file("preprocessor_config.json").is_none());
    let encoding = ImageEncoding::for_artifact(&artifact)
        .expect("image path")
        .expect("a vision tower");
    let image: serde_json::Value = serde_json::from_str(&encoding.settings_json()).expect("JSON");
    // The fixture's tower takes patches of 8 (the released 16 would not fit it); the released
    // bounds.
    assert_eq!(
        (
            &image["patch_size"],
            &image["max_pixels"],
            &image["min_pixels"]
        ),
        (&8.into(), &16_777_216.into(), &65_536.into())
    );
    let video = encoding.video_settings();
    assert_eq!(
        (video.frames.patch_size, video.frames.max_pixels, video.fps),
        (8, 16_777_216, 2.0)
    );
}
