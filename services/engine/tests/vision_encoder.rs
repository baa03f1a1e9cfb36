//! The vision tower's f32 host forward against `transformers` on the `qwen3_5_moe` golden
//! fixture's tower (`vision_reference.json`, made by
//! `scripts/make_vision_encoder_reference.py`): three images of different grid sizes and
//! aspect ratios in one batch, so the interpolated position embeddings, the 2-D rotary angles,
//! the per-image attention and the merger are all compared, through a real conversion.

use ninfer_artifact::Artifact;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::testing::{
    golden_fixture_dir, json_numbers, max_abs_difference, one_grid_per_temporal_patch,
    video_reference_patches, vision_reference_inputs,
};
use ninfer_engine::vision::{
    encode_images, ImageGrid, ImagePlacement, VisionConfig, VisionWeights,
};

fn reference() -> serde_json::Value {
    let path = golden_fixture_dir("qwen3_5_moe").join("vision_reference.json");
    let text = std::fs::read_to_string(&path).expect("vision reference readable");
    serde_json::from_str(&text).expect("valid JSON")
}

#[test]
fn the_vision_tower_matches_transformers_on_three_images() {
    let scratch = tempfile::tempdir().expect("scratch directory");
    let output = scratch.path().join("model.ninfer");
    convert_checkpoint(
        &ConvertOptions::new(golden_fixture_dir("qwen3_5_moe"), &output),
        &NoProgress,
    )
    .expect("fixture converts");
    let artifact = Artifact::open(&output).expect("artifact opens");
    let weights = VisionWeights::load(&artifact)
        .expect("vision weights load")
        .expect("the fixture has a vision tower");
    assert_eq!(weights.blocks.len(), weights.config.depth);
    // The fixture's image and video tokens and M-RoPE layout (config.json: 491, 492, [2, 1, 1]).
    assert_eq!(
        ImagePlacement::from_artifact(&artifact).expect("readable"),
        Some(ImagePlacement {
            image_token_id: 491,
            video_token_id: Some(492),
            mrope_section: [2, 1, 1],
            spatial_merge_size: 2
        })
    );

    let reference = reference();
    let row_len = weights.config.patch_row_len();
    assert_eq!(reference["patch_row_len"].as_u64(), Some(row_len as u64));
    let (grids, pixels) = vision_reference_inputs(&reference, row_len);
    let output = encode_images(&weights, &pixels, &grids).expect("encodes");

    let to_f32 = |key: &str| -> Vec<f32> {
        json_numbers(&reference[key])
            .into_iter()
            .map(|v| v as f32)
            .collect()
    };
    let hidden = to_f32("last_hidden_state");
    let merged = to_f32("merged");
    assert_eq!(output.last_hidden_state.len(), hidden.len());
    assert_eq!(output.merged.len(), merged.len());
    assert_eq!(output.tokens_per_image, vec![4, 12, 4]);
    let hidden_error = max_abs_difference(&output.last_hidden_state, &hidden);
    let merged_error = max_abs_difference(&output.merged, &merged);
    let scale = merged.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    println!("max |Δ| before the merger {hidden_error:.3e}, merged {merged_error:.3e} (max |merged| {scale:.3})");
    assert!(hidden_error < 2e-5, "before the merger: {hidden_error}");
    assert!(merged_error < 2e-5, "merged: {merged_error}");
}

#[test]
fn an_artifact_without_a_vision_tower_has_no_vision_settings() {
    let scratch = tempfile::tempdir().expect("scratch directory");
    let output = scratch.path().join("model.ninfer");
    let mut options = ConvertOptions::new(golden_fixture_dir("qwen3_5_moe"), &output);
    options.skip_vision = true;
    convert_checkpoint(&options, &NoProgress).expect("fixture converts");
    let artifact = Artifact::open(&output).expect("artifact opens");
    assert_eq!(
        VisionConfig::from_artifact(&artifact).expect("readable"),
        None
    );
    assert!(VisionWeights::load(&artifact).expect("readable").is_none());
}

#[test]
fn a_grid_that_does_not_divide_into_merge_blocks_is_refused() {
    let scratch = tempfile::tempdir().expect("scratch directory");
    let output = scratch.path().join("model.ninfer");
    convert_checkpoint(
        &ConvertOptions::new(golden_fixture_dir("qwen3_5_moe"), &output),
        &NoProgress,
    )
    .expect("fixture converts");
    let artifact = Artifact::open(&output).expect("artifact opens");
    let weights = VisionWeights::load(&artifact)
        .expect("loads")
        .expect("has a tower");
    let grid = ImageGrid {
        temporal: 1,
        height: 3,
        width: 4,
    };
    let rows: Vec<f32> = (0..12 * weights.config.patch_row_len())
        .map(|i| (i % 7) as f32 / 7.0)
        .collect();
    assert!(encode_images(&weights, &rows, &[grid]).is_err());
    let grid = ImageGrid {
        temporal: 1,
        height: 4,
        width: 4,
    };
    assert!(
        encode_images(&weights, &rows[..10], &[grid]).is_err(),
        "too few pixel values"
    );
}

#[test]
fn a_video_grid_of_several_temporal_patches_is_its_frame_pairs_one_by_one() {
    let scratch = tempfile::tempdir().expect("scratch directory");
    let output = scratch.path().join("model.ninfer");
    convert_checkpoint(
        &ConvertOptions::new(golden_fixture_dir("qwen3_5_moe"), &output),
        &NoProgress,
    )
    .expect("fixture converts");
    let artifact = Artifact::open(&output).expect("artifact opens");
    let weights = VisionWeights::load(&artifact)
        .expect("loads")
        .expect("has a tower");
    // transformers' rows of the two videos, each one grid of two temporal patches.
    let (grids, pixels) = video_reference_patches(weights.config.patch_row_len());
    assert!(grids.iter().all(|grid| grid.temporal == 2));
    let whole = encode_images(&weights, &pixels, &grids).expect("encodes");
    let pairs = one_grid_per_temporal_patch(&grids);
    let split = encode_images(&weights, &pixels, &pairs).expect("encodes");
    // Each temporal patch attends only to its own rows and takes the same positions: the whole
    // grid is its pairs side by side.
    assert_eq!(
        whole.tokens_per_image,
        [
            split.tokens_per_image[0] + split.tokens_per_image[1],
            split.tokens_per_image[2] + split.tokens_per_image[3]
        ]
    );
    let scale = whole.merged.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let difference = max_abs_difference(&whole.merged, &split.merged);
    assert!(difference <= 1e-6 * scale, "merged: {difference}");
    assert!(
        max_abs_difference(&whole.last_hidden_state, &split.last_hidden_state) <= 1e-5,
        "before the merger"
    );
    // The pairs differ (a pan): a video's two temporal patches do not give the same tokens.
    let tokens = split.tokens_per_image[0] * weights.config.out_hidden_size;
    assert!(max_abs_difference(&split.merged[..tokens], &split.merged[tokens..2 * tokens]) > 1e-3);
}
