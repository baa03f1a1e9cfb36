//! The vision tower on the GPU (`CudaVisionTower`, f32 residual) in both precisions — bf16
//! products on the tensor cores (bf16 checkpoints) and f32 products (f32 checkpoints, such as
//! the fixture) — against the f32 host forward and `transformers` on the `qwen3_5_moe` golden
//! fixture's tower:
//!
//! * the three images of `vision_reference.json` in one batch (different grids and aspect
//!   ratios, so the position taps, the 2-D rotary angles, attention within each image and the
//!   merger are all exercised): the last hidden state and the merged embeddings against both
//!   references, within [`F32_BAR`] in f32 and [`BF16_BAR`] in bf16 (of the largest reference
//!   value);
//! * a wide tower of random weights (heads of 72, the released width, over 300 patches in two
//!   images: the padded tensor-core kernel, several key tiles, a tile shared by two images)
//!   against the host forward on the same weights, and each image alone against the batch;
//! * the chat prompt of `image_prompt_reference.json` with its images encoded by the tower the
//!   engine picks for this f32 fixture and the decoder on the GPU (default options): the CUDA
//!   golden bars — mean |ΔNLL| ≤ 2e-2 against `transformers`, top-1 agreement ≥ 99% with the
//!   host tower and the CPU backend;
//! * the two videos of `video_prompt_reference.json` as `transformers` pre-processed them, each
//!   one grid of two temporal patches (frame pairs): against the host forward of the same grids,
//!   and equal to the same tower given each pair as a grid of its own (how the engine sends
//!   them);
//! * the engine's image path picks the GPU tower when it serves on CUDA.
//!
//! Skipped without a GPU (fails under `NINFER_REQUIRE_GPU=1`).

use std::sync::Arc;

use ninfer_artifact::{Artifact, DType};
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::backend::cuda::{CudaBackend, CudaVisionTower, VisionPrecision};
use ninfer_engine::sampling::{argmax, Xoshiro256};
use ninfer_engine::service::images::{start_tower, TowerDevice};
use ninfer_engine::testing::{
    golden_fixture_dir, image_prompt_patches, json_numbers, mean_abs_difference, next_token_nll,
    one_grid_per_temporal_patch, video_reference_patches, vision_reference_inputs,
};
use ninfer_engine::vision::weights::{stored_matrix_dtype, LayerNorm, Linear, VisionBlock};
use ninfer_engine::vision::{encode_images, ImageGrid, VisionConfig, VisionTower, VisionWeights};
use ninfer_engine::{CpuBackend, LogitsSelection, Model, SequenceInput};

/// The largest |Δ| allowed, as a fraction of the largest |reference| value, with bf16 inputs to
/// every product (8 mantissa bits, ~4e-3 relative per rounding, through a few layers) …
const BF16_BAR: f32 = 3e-2;
/// … and with f32 products (the host forward's arithmetic up to the order of sums).
const F32_BAR: f32 = 1e-4;

const PRECISIONS: [(VisionPrecision, f32); 2] = [
    (VisionPrecision::F32, F32_BAR),
    (VisionPrecision::Bf16, BF16_BAR),
];

/// The GPU backend with the default options (cuBLAS on), or `None` (and a note) where there is
/// none.
fn gpu_or_skip(test: &str) -> Option<Arc<CudaBackend>> {
    match CudaBackend::shared() {
        Ok(backend) => Some(backend),
        Err(error) => {
            if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("NINFER_REQUIRE_GPU=1 but the GPU is unusable: {error}");
            }
            println!("skipped `{test}` on cuda: {error}");
            None
        }
    }
}

/// The largest |a − b| over the largest |b|.
fn relative_error(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(
        ours.len(),
        reference.len(),
        "compared slices differ in length"
    );
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst.is_finite(), "non-finite output");
    worst / scale.max(f32::MIN_POSITIVE)
}

fn fixture_artifact(work: &std::path::Path, dtype: DType) -> std::path::PathBuf {
    let path = work.join(format!("model-{dtype}.ninfer"));
    let options = ConvertOptions {
        experts_dtype: dtype,
        dense_dtype: dtype,
        ..ConvertOptions::new(golden_fixture_dir("qwen3_5_moe"), &path)
    };
    convert_checkpoint(&options, &NoProgress).expect("fixture converts");
    path
}

fn read_reference(name: &str) -> serde_json::Value {
    let path = golden_fixture_dir("qwen3_5_moe").join(name);
    serde_json::from_str(&std::fs::read_to_string(path).expect("readable")).expect("valid JSON")
}

#[test]
fn the_gpu_tower_matches_the_host_forward_and_transformers_on_three_images() {
    let Some(gpu) = gpu_or_skip("the_gpu_tower_matches_the_host_forward_and_transformers") else {
        return;
    };
    let work = tempfile::tempdir().expect("scratch directory");
    let artifact = Artifact::open(&fixture_artifact(work.path(), DType::F32)).expect("opens");
    let weights = VisionWeights::load(&artifact)
        .expect("loads")
        .expect("the fixture has a vision tower");
    let reference = read_reference("vision_reference.json");
    let (grids, pixels) = vision_reference_inputs(&reference, weights.config.patch_row_len());
    let host = encode_images(&weights, &pixels, &grids).expect("host forward");
    let numbers = |key: &str| -> Vec<f32> {
        json_numbers(&reference[key])
            .into_iter()
            .map(|v| v as f32)
            .collect()
    };
    for (precision, bar) in PRECISIONS {
        let tower = CudaVisionTower::new(Arc::clone(&gpu), &weights, precision)
            .expect("the GPU tower starts");
        let ours = tower.encode(&pixels, &grids).expect("GPU forward");
        assert_eq!(ours.tokens_per_image, host.tokens_per_image);
        for (what, ours, host, transformers) in [
            (
                "last hidden state",
                &ours.last_hidden_state,
                &host.last_hidden_state,
                numbers("last_hidden_state"),
            ),
            ("merged", &ours.merged, &host.merged, numbers("merged")),
        ] {
            let against_host = relative_error(ours, host);
            let against_transformers = relative_error(ours, &transformers);
            println!(
                "{precision:?} {what}: max |Δ| / max |ref| {against_host:.2e} against the host forward, {against_transformers:.2e} against transformers"
            );
            assert!(
                against_host < bar,
                "{precision:?} {what} against the host: {against_host}"
            );
            assert!(
                against_transformers < bar,
                "{precision:?} {what} against transformers: {against_transformers}"
            );
        }
    }
}

#[test]
fn the_gpu_tower_takes_video_grids_of_several_temporal_patches() {
    let Some(gpu) = gpu_or_skip("the_gpu_tower_takes_video_grids_of_several_temporal_patches")
    else {
        return;
    };
    let work = tempfile::tempdir().expect("scratch directory");
    let artifact = Artifact::open(&fixture_artifact(work.path(), DType::F32)).expect("opens");
    let weights = VisionWeights::load(&artifact)
        .expect("loads")
        .expect("the fixture has a vision tower");
    let (grids, pixels) = video_reference_patches(weights.config.patch_row_len());
    assert!(grids.iter().all(|grid| grid.temporal > 1));
    let pairs = one_grid_per_temporal_patch(&grids);
    let host = encode_images(&weights, &pixels, &grids).expect("host forward");
    for (precision, bar) in PRECISIONS {
        let tower = CudaVisionTower::new(Arc::clone(&gpu), &weights, precision)
            .expect("the GPU tower starts");
        let whole = tower.encode(&pixels, &grids).expect("GPU forward");
        assert_eq!(whole.tokens_per_image, host.tokens_per_image);
        let hidden_error = relative_error(&whole.last_hidden_state, &host.last_hidden_state);
        let merged_error = relative_error(&whole.merged, &host.merged);
        let split = tower.encode(&pixels, &pairs).expect("GPU forward");
        let split_error = relative_error(&split.merged, &whole.merged);
        println!(
            "{precision:?} videos of two temporal patches: max |Δ| / max |host| {hidden_error:.2e} before the merger, {merged_error:.2e} merged; pairs one by one against the whole grids {split_error:.2e}"
        );
        assert!(
            hidden_error < bar,
            "{precision:?} before the merger: {hidden_error}"
        );
        assert!(merged_error < bar, "{precision:?} merged: {merged_error}");
        assert!(
            split_error < bar / 3.0,
            "{precision:?}: the pairs one by one: {split_error}"
        );
    }
}

/// Values uniform in `±scale`.
fn random_values(rng: &mut Xoshiro256, count: usize, scale: f32) -> Vec<f32> {
    (0..count)
        .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        .collect()
}

fn random_linear(rng: &mut Xoshiro256, outputs: usize, inputs: usize) -> Linear {
    Linear {
        weight: random_values(rng, outputs * inputs, 1.0 / (inputs as f32).sqrt()),
        bias: random_values(rng, outputs, 0.1),
        outputs,
        inputs,
    }
}

fn random_norm(rng: &mut Xoshiro256, width: usize) -> LayerNorm {
    LayerNorm {
        weight: random_values(rng, width, 0.5)
            .into_iter()
            .map(|v| v + 1.0)
            .collect(),
        bias: random_values(rng, width, 0.1),
    }
}

#[test]
fn a_tower_with_heads_of_the_released_width_matches_the_host_forward() {
    let Some(gpu) = gpu_or_skip("a_tower_with_heads_of_the_released_width") else {
        return;
    };
    // Heads of 72 (padded to 80 by the attention kernel), 2 blocks, patch 8.
    let config: VisionConfig = serde_json::from_value(serde_json::json!({
        "depth": 2, "hidden_size": 144, "num_heads": 2, "intermediate_size": 200,
        "patch_size": 8, "out_hidden_size": 96, "num_position_embeddings": 64,
    }))
    .expect("settings");
    config.validate().expect("valid settings");
    let mut rng = Xoshiro256::seed_from_u64(11);
    let hidden = config.hidden_size;
    let merged = hidden * config.merge_unit();
    let weights = VisionWeights {
        patch_embed: random_linear(&mut rng, hidden, config.patch_row_len()),
        position_embeddings: random_values(&mut rng, config.num_position_embeddings * hidden, 0.5),
        blocks: (0..config.depth)
            .map(|_| VisionBlock {
                norm1: random_norm(&mut rng, hidden),
                qkv: random_linear(&mut rng, 3 * hidden, hidden),
                proj: random_linear(&mut rng, hidden, hidden),
                norm2: random_norm(&mut rng, hidden),
                fc1: random_linear(&mut rng, config.intermediate_size, hidden),
                fc2: random_linear(&mut rng, hidden, config.intermediate_size),
            })
            .collect(),
        merger_norm: random_norm(&mut rng, hidden),
        merger_fc1: random_linear(&mut rng, merged, merged),
        merger_fc2: random_linear(&mut rng, config.out_hidden_size, merged),
        config,
    };
    // 14 × 18 = 252 patches (four key tiles, the last shared with the next image) and 6 × 10.
    let grids = [
        ImageGrid {
            temporal: 1,
            height: 14,
            width: 18,
        },
        ImageGrid {
            temporal: 1,
            height: 6,
            width: 10,
        },
    ];
    let rows: usize = grids.iter().map(ImageGrid::patches).sum();
    let pixels = random_values(&mut rng, rows * weights.config.patch_row_len(), 1.0);
    let host = encode_images(&weights, &pixels, &grids).expect("host forward");
    let first_rows = grids[0].patches() * weights.config.patch_row_len();
    for (precision, bar) in PRECISIONS {
        let tower = CudaVisionTower::new(Arc::clone(&gpu), &weights, precision)
            .expect("the GPU tower starts");
        let ours = tower.encode(&pixels, &grids).expect("GPU forward");
        let hidden_error = relative_error(&ours.last_hidden_state, &host.last_hidden_state);
        let merged_error = relative_error(&ours.merged, &host.merged);
        println!("{precision:?}, heads of 72: max |Δ| / max |ref| {hidden_error:.2e} before the merger, {merged_error:.2e} merged");
        assert!(
            hidden_error < bar,
            "{precision:?} before the merger: {hidden_error}"
        );
        assert!(merged_error < bar, "{precision:?} merged: {merged_error}");
        // Each image attends only to itself: the second image alone gives its own rows.
        let alone = tower
            .encode(&pixels[first_rows..], &grids[1..])
            .expect("GPU forward");
        let first_tokens = ours.tokens_per_image[0] * weights.config.out_hidden_size;
        let alone_error = relative_error(&alone.merged, &ours.merged[first_tokens..]);
        assert!(
            alone_error < bar / 3.0,
            "{precision:?}: the second image alone: {alone_error}"
        );
    }
}

/// Per-position logits of `tokens` with `images` attached, one prefill.
fn image_prompt_logits<B: ninfer_engine::Backend>(
    model: &Model<B>,
    tokens: &[u32],
    grids: &[ImageGrid],
    embeddings: Vec<f32>,
) -> Vec<f32> {
    let mut state = model.new_sequence(tokens.len()).expect("sequence");
    model
        .attach_images(&mut state, tokens, grids, embeddings)
        .expect("images attach");
    model
        .forward(
            &mut [SequenceInput {
                state: &mut state,
                tokens,
            }],
            LogitsSelection::All,
        )
        .expect("forward")
        .pop()
        .expect("one sequence")
}

#[test]
fn an_image_prompt_on_the_gpu_meets_the_cuda_bars() {
    let Some(gpu) = gpu_or_skip("an_image_prompt_on_the_gpu_meets_the_cuda_bars") else {
        return;
    };
    let reference = read_reference("image_prompt_reference.json");
    let work = tempfile::tempdir().expect("scratch directory");
    let path = fixture_artifact(work.path(), DType::F32);
    let on_gpu = Model::open(Arc::clone(&gpu), &path).expect("opens on the GPU");
    let on_cpu = Model::open(Arc::new(CpuBackend::new()), &path).expect("opens on the CPU");
    let weights = VisionWeights::load(on_gpu.artifact())
        .expect("loads")
        .expect("the fixture has a vision tower");
    let (grids, rows) = image_prompt_patches(&reference);
    let host = encode_images(&weights, &rows, &grids).expect("host forward");
    // The precision the engine picks for the fixture's tower (stored in f32).
    let precision = VisionPrecision::for_stored(
        stored_matrix_dtype(on_gpu.artifact()).expect("the fixture has a vision tower"),
    );
    assert_eq!(precision, VisionPrecision::F32);
    let tower = CudaVisionTower::new(gpu, &weights, precision).expect("the GPU tower starts");
    let ours = tower.encode(&rows, &grids).expect("GPU forward");
    let embedding_error = relative_error(&ours.merged, &host.merged);
    assert!(embedding_error < F32_BAR, "embeddings: {embedding_error}");

    let tokens: Vec<u32> = json_numbers(&reference["token_ids"])
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let expected_nll = json_numbers(&reference["token_nll"]);
    let cpu_logits = image_prompt_logits(&on_cpu, &tokens, &grids, host.merged);
    // The decoder with the default options (what `--device cuda` runs) and with the exact ones
    // (f32 KV cache, no cuBLAS: the decoder's own error out of the way, so what is left is the
    // tower's). This fixture's decoder is very sensitive to its image embeddings (they dominate
    // its residual stream): 0.1% noise on them moves the mean NLL by 1.4e-2.
    let exact = CudaBackend::shared_exact().expect("the GPU opens with the exact options");
    let on_gpu_exact = Model::open(exact, &path).expect("opens on the GPU");
    for (decoder, model) in [("default", &on_gpu), ("exact", &on_gpu_exact)] {
        let vocab = model.vocab_size();
        let gpu_logits = image_prompt_logits(model, &tokens, &grids, ours.merged.clone());
        let nll = next_token_nll(&tokens, &gpu_logits, vocab);
        assert_eq!(nll.len(), expected_nll.len(), "reference length");
        let mean_difference = mean_abs_difference(&nll, &expected_nll);
        let agreeing = gpu_logits
            .chunks(vocab)
            .zip(cpu_logits.chunks(vocab))
            .filter(|(g, c)| argmax(g) == argmax(c))
            .count();
        let agreement = agreeing as f64 / tokens.len() as f64;
        println!(
            "image prompt on cuda ({precision:?} GPU tower, embeddings max |Δ| / max |ref| {embedding_error:.2e}; {decoder} decoder): mean |ΔNLL| vs transformers {mean_difference:.2e} over {} tokens, top-1 agreement with cpu {:.1}%",
            nll.len(),
            100.0 * agreement
        );
        assert!(
            mean_difference <= 2e-2,
            "{decoder} decoder: mean |ΔNLL| {mean_difference}"
        );
        assert!(
            agreement >= 0.99,
            "{decoder} decoder: top-1 agreement {agreement}"
        );
    }
}

#[test]
fn the_engine_encodes_images_on_the_gpu_when_it_serves_on_cuda() {
    let Some(gpu) = gpu_or_skip("the_engine_encodes_images_on_the_gpu") else {
        return;
    };
    let work = tempfile::tempdir().expect("scratch directory");
    let artifact = Artifact::open(&fixture_artifact(work.path(), DType::Bf16)).expect("opens");
    let weights = VisionWeights::load(&artifact)
        .expect("loads")
        .expect("the fixture has a vision tower");
    let tower = start_tower(
        TowerDevice::Cuda {
            ordinal: gpu.info().ordinal,
            options: gpu.options(),
        },
        weights,
        stored_matrix_dtype(&artifact).expect("the fixture has a vision tower"),
    );
    assert!(
        tower.describe().starts_with("cuda"),
        "the tower runs on {}",
        tower.describe()
    );
}
