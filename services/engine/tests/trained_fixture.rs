//! The trained fixture (`tests/fixtures/qwen3_5_moe_trained/`, a small Qwen3.5-MoE trained on the
//! Python standard library by `scripts/train_tiny_moe.py`, bf16 weights on disk, with its
//! transformers references) converted with `ninfer-convert` and run through the engine.
//!
//! Unlike the random golden fixtures, this model has learned something, so it measures what random
//! weights cannot: how much bf16, int8 and int4 storage costs in held-out NLL, and whether greedy
//! decoding keeps the f32 path's tokens. Run with
//! `cargo test -p ninfer-engine --test trained_fixture -- --nocapture` to see the figures.
//!
//! Bounds: the f32 path within 1e-4 mean |ΔNLL| of transformers (the checkpoint is bf16, so f32
//! and bf16 storage hold the same weights and get the same bound); greedy tokens equal to
//! transformers' up to the first near-tie of the reference (top-1 − top-2 logit < 1e-3); int8
//! experts at most 0.02 nats above f32 in mean NLL, int4 at most 0.15.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::testing::{
    golden_fixture_dir, greedy_tokens, json_numbers, mean, mean_abs_difference,
    token_negative_log_likelihoods,
};
use ninfer_engine::{test_device, Backend, Model};

const FIXTURE: &str = "qwen3_5_moe_trained";
/// A reference greedy pick closer than this to the runner-up may flip under f32 reordering.
const NEAR_TIE: f64 = 1e-3;

struct NllText {
    kind: String,
    tokens: Vec<u32>,
    token_nll: Vec<f64>,
}

struct Prompt {
    tokens: Vec<u32>,
    greedy: Vec<u32>,
    margins: Vec<f64>,
}

fn token_ids(value: &serde_json::Value) -> Vec<u32> {
    json_numbers(value).into_iter().map(|x| x as u32).collect()
}

fn read_reference(directory: &Path) -> (Vec<NllText>, Vec<Prompt>) {
    let path = directory.join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/train_tiny_moe.py)", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("reference.json is JSON");
    let texts = json["nll_texts"]
        .as_array()
        .expect("reference.json: nll_texts")
        .iter()
        .map(|t| NllText {
            kind: t["kind"].as_str().unwrap_or("?").to_string(),
            tokens: token_ids(&t["token_ids"]),
            token_nll: json_numbers(&t["token_nll"]),
        })
        .collect();
    let prompts = json["prompts"]
        .as_array()
        .expect("reference.json: prompts")
        .iter()
        .map(|p| Prompt {
            tokens: token_ids(&p["prompt_token_ids"]),
            greedy: token_ids(&p["greedy_token_ids"]),
            margins: json_numbers(&p["greedy_top1_top2_margins_no_cache"]),
        })
        .collect();
    (texts, prompts)
}

fn convert(output: &Path, experts: DType, dense: DType) -> PathBuf {
    let path = output.join(format!("trained-{experts}-{dense}.ninfer"));
    let options = ConvertOptions {
        experts_dtype: experts,
        dense_dtype: dense,
        ..ConvertOptions::new(golden_fixture_dir(FIXTURE), &path)
    };
    convert_checkpoint(&options, &NoProgress)
        .unwrap_or_else(|e| panic!("converting the trained fixture ({experts}/{dense}): {e}"));
    path
}

/// Tokens that must match: all of them, or those before the reference's first near-tie.
fn comparable_prefix(prompt: &Prompt) -> usize {
    prompt
        .margins
        .iter()
        .position(|&m| m < NEAR_TIE)
        .unwrap_or(prompt.greedy.len())
        .min(prompt.greedy.len())
}

/// How many leading tokens two greedy continuations share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn trained_fixture_matches_transformers<B: Backend>(backend: Arc<B>) {
    let (texts, prompts) = read_reference(&golden_fixture_dir(FIXTURE));
    assert!(!texts.is_empty() && !prompts.is_empty(), "empty reference");
    let work = tempfile::tempdir().expect("temporary directory");
    let all_tokens = |texts: &[NllText]| texts.iter().map(|t| t.token_nll.len()).sum::<usize>();

    // f32 storage: per-token NLL against transformers, greedy tokens.
    let model = Model::open(
        Arc::clone(&backend),
        &convert(work.path(), DType::F32, DType::F32),
    )
    .expect("open f32 artifact");
    let mut f32_nll: Vec<Vec<f64>> = Vec::new();
    let mut worst_mean_abs = 0.0f64;
    for text in &texts {
        let nll = token_negative_log_likelihoods(&model, &text.tokens).expect("forward");
        let mean_abs = mean_abs_difference(&nll, &text.token_nll);
        let max_abs = nll
            .iter()
            .zip(&text.token_nll)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f64, f64::max);
        println!(
            "trained f32 {}: {} tokens, mean NLL {:.5} (transformers {:.5}), mean |ΔNLL| {mean_abs:.2e}, max {max_abs:.2e}",
            text.kind,
            nll.len(),
            mean(&nll),
            mean(&text.token_nll)
        );
        worst_mean_abs = worst_mean_abs.max(mean_abs);
        f32_nll.push(nll);
    }
    assert!(
        worst_mean_abs < 1e-4,
        "f32 path: mean |ΔNLL| vs transformers {worst_mean_abs:.3e} ≥ 1e-4"
    );
    let f32_greedy: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| greedy_tokens(&model, &p.tokens, p.greedy.len()).expect("greedy decoding"))
        .collect();
    for (index, (prompt, ours)) in prompts.iter().zip(&f32_greedy).enumerate() {
        let must = comparable_prefix(prompt);
        let shared = common_prefix(ours, &prompt.greedy);
        println!(
            "trained f32 prompt {index}: {shared}/{} greedy tokens equal transformers' (first near-tie at {must})",
            prompt.greedy.len()
        );
        assert!(
            shared >= must,
            "prompt {index}: greedy tokens differ from transformers' at {shared}, before the first near-tie at {must}"
        );
    }
    drop(model);
    let f32_mean = mean(&f32_nll.concat());

    // Other storage types, f32 activations: NLL moved from the f32 path, greedy agreement with it.
    for (experts, dense, bound) in [
        (DType::Bf16, DType::Bf16, 1e-4),
        (DType::Int8, DType::F32, 0.02),
        (DType::Int4, DType::F32, 0.15),
        (DType::Int4, DType::Bf16, 0.15),
    ] {
        let model = Model::open(Arc::clone(&backend), &convert(work.path(), experts, dense))
            .expect("open artifact");
        let nll: Vec<Vec<f64>> = texts
            .iter()
            .map(|t| token_negative_log_likelihoods(&model, &t.tokens).expect("forward"))
            .collect();
        let quantized_mean = mean(&nll.concat());
        let delta = quantized_mean - f32_mean;
        let per_token = mean_abs_difference(&nll.concat(), &f32_nll.concat());
        let per_kind: Vec<String> = texts
            .iter()
            .zip(nll.iter().zip(&f32_nll))
            .map(|(t, (q, f))| format!("{} {:+.5}", t.kind, mean(q) - mean(f)))
            .collect();
        let (mut agree, mut total) = (0usize, 0usize);
        for (prompt, reference) in prompts.iter().zip(&f32_greedy) {
            let ours = greedy_tokens(&model, &prompt.tokens, reference.len()).expect("greedy");
            agree += common_prefix(&ours, reference);
            total += reference.len();
        }
        println!(
            "trained experts {experts} dense {dense}: mean NLL {quantized_mean:.5} over {} tokens, Δ vs f32 {delta:+.5} nats ({}), mean |ΔNLL| per token {per_token:.5}, greedy prefix shared with f32 {agree}/{total} (bound {bound})",
            all_tokens(&texts),
            per_kind.join(", ")
        );
        assert!(
            delta.abs() <= bound,
            "experts {experts} dense {dense}: mean NLL moved by {delta:+.5} (bound {bound})"
        );
    }
}
test_device!(trained_fixture_matches_transformers);
