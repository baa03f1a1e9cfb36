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

/// The fixture converted with f32 weights (under `work`) and opened on `backend`.
fn open_f32<B: Backend>(backend: &Arc<B>, work: &Path) -> Model<B> {
    Model::open(Arc::clone(backend), &convert(work, DType::F32, DType::F32))
        .expect("open f32 artifact")
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

/// One reference MTP sequence: the main model's greedy continuation of an opening, and the
/// transformers-side chained drafts at every position (`drafts[j][t]` predicts token `t + 2 + j`).
struct MtpSequence {
    tokens: Vec<u32>,
    drafts: Vec<Vec<u32>>,
}

fn read_mtp_sequences(directory: &Path) -> Vec<MtpSequence> {
    let text = std::fs::read_to_string(directory.join("reference.json")).expect("reference.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("reference.json is JSON");
    json["mtp"]["sequences"]
        .as_array()
        .expect("reference.json: mtp.sequences")
        .iter()
        .map(|s| MtpSequence {
            tokens: token_ids(&s["token_ids"]),
            drafts: s["drafts"]
                .as_array()
                .map_or_else(Vec::new, |depths| depths.iter().map(token_ids).collect()),
        })
        .collect()
}

/// The argmax of each `vocab`-wide row and its lead over the runner-up.
fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<(u32, f32)> {
    logits
        .chunks(vocab)
        .map(|row| {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            (order[0] as u32, row[order[0]] - row[order[1]])
        })
        .collect()
}

/// Tallies drafts against the reference: a draft that differs must be a near-tie on our side.
#[derive(Default)]
struct DraftAgreement {
    equal: usize,
    near_tie: usize,
}

impl DraftAgreement {
    fn check(&mut self, what: &str, ours: (u32, f32), reference: u32) {
        if ours.0 == reference {
            self.equal += 1;
        } else {
            assert!(
                f64::from(ours.1) < NEAR_TIE,
                "{what}: draft {} where transformers drafts {reference}, with a lead of {}",
                ours.0,
                ours.1
            );
            self.near_tie += 1;
        }
    }
}

/// The engine's MTP head drafts what the transformers-side reference math drafts: depth 1 for
/// every position of each sequence in one pass, and chains of three drafts (each fed the
/// previous draft's output and token one position later) from a sample of positions.
fn mtp_drafts_match_the_reference<B: Backend>(backend: Arc<B>) {
    let sequences = read_mtp_sequences(&golden_fixture_dir(FIXTURE));
    assert!(!sequences.is_empty(), "no MTP sequences in the reference");
    let work = tempfile::tempdir().expect("temporary directory");
    let model = open_f32(&backend, work.path());
    assert!(model.has_mtp(), "the trained fixture has an MTP head");
    let vocab = model.vocab_size();
    let (mut depth_one, mut chained) = (DraftAgreement::default(), DraftAgreement::default());
    // Three code openings and three documentation openings.
    for (index, sequence) in sequences.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        let tokens = &sequence.tokens;
        let pairs = tokens.len() - 1;
        assert_eq!(
            sequence.drafts.len(),
            3,
            "sequence {index}: three draft depths"
        );
        let mut state = model.new_sequence(tokens.len()).expect("state");
        let hidden = model
            .forward_hidden(
                &mut [ninfer_engine::SequenceInput {
                    state: &mut state,
                    tokens,
                }],
                None,
            )
            .expect("main forward");
        let all_pairs: Vec<usize> = (0..pairs).collect();
        let pair_hidden = backend.gather_rows(&hidden, &all_pairs).expect("gather");

        let mut mtp = model.new_mtp_state(tokens.len()).expect("MTP state");
        let out = model
            .mtp_forward(&mut mtp, &pair_hidden, &tokens[1..])
            .expect("MTP forward");
        let drafts = argmax_rows(&model.head_logits(&out).expect("head"), vocab);
        for (t, &draft) in drafts.iter().enumerate() {
            depth_one.check(
                &format!("sequence {index} depth 1 at {t}"),
                draft,
                sequence.drafts[0][t],
            );
        }

        for t in (0..pairs).step_by(11) {
            let mut mtp = model.new_mtp_state(t + 4).expect("MTP state");
            let prefix: Vec<usize> = (0..=t).collect();
            let out = model
                .mtp_forward(
                    &mut mtp,
                    &backend.gather_rows(&hidden, &prefix).expect("gather"),
                    &tokens[1..=t + 1],
                )
                .expect("MTP forward");
            let mut last = backend.gather_rows(&out, &[t]).expect("gather");
            let mut draft = argmax_rows(&model.head_logits(&last).expect("head"), vocab)[0];
            for depth in 1..3 {
                last = model
                    .mtp_forward(&mut mtp, &last, &[draft.0])
                    .expect("MTP draft step");
                draft = argmax_rows(&model.head_logits(&last).expect("head"), vocab)[0];
                if t + 2 + depth < tokens.len() {
                    chained.check(
                        &format!("sequence {index} depth {} at {t}", depth + 1),
                        draft,
                        sequence.drafts[depth][t],
                    );
                }
            }
        }
    }
    println!(
        "trained MTP drafts on {}: depth 1 {}/{} equal to transformers ({} near-ties), chained depths 2–3 {}/{} ({} near-ties)",
        backend.name(),
        depth_one.equal,
        depth_one.equal + depth_one.near_tie,
        depth_one.near_tie,
        chained.equal,
        chained.equal + chained.near_tie,
        chained.near_tie
    );
    assert!(depth_one.equal > 0 && chained.equal > 0, "nothing compared");
}
test_device!(mtp_drafts_match_the_reference);

/// Greedy speculative decoding with the MTP head gives plain greedy decoding's tokens, token for
/// token, at 1, 2 and 3 drafts per step, on every reference prompt.
fn speculative_greedy_equals_plain_greedy<B: Backend>(backend: Arc<B>) {
    let (_, prompts) = read_reference(&golden_fixture_dir(FIXTURE));
    let work = tempfile::tempdir().expect("temporary directory");
    let model = open_f32(&backend, work.path());
    for draft_tokens in 1..=3 {
        let (mut tokens, mut steps) = (0usize, 0usize);
        let mut accepted = vec![0usize; draft_tokens];
        let mut drafted = vec![0usize; draft_tokens];
        for (index, prompt) in prompts.iter().enumerate() {
            let plain = greedy_tokens(&model, &prompt.tokens, 48).expect("greedy decoding");
            let speculative =
                ninfer_engine::model::greedy_with_mtp(&model, &prompt.tokens, 48, draft_tokens)
                    .expect("speculative decoding");
            assert_eq!(
                speculative.tokens, plain,
                "prompt {index}, {draft_tokens} drafts: speculative greedy differs from greedy"
            );
            tokens += speculative.tokens.len() - 1;
            steps += speculative.verifications;
            for depth in 0..draft_tokens {
                accepted[depth] += speculative.accepted[depth];
                drafted[depth] += speculative.drafted[depth];
            }
        }
        let rates: Vec<String> = accepted
            .iter()
            .zip(&drafted)
            .map(|(a, d)| format!("{:.2}", *a as f64 / (*d).max(1) as f64))
            .collect();
        println!(
            "trained MTP on {}: {draft_tokens} drafts per step, acceptance by depth {}, {:.2} tokens per main step, greedy output identical",
            backend.name(),
            rates.join(" / "),
            tokens as f64 / steps.max(1) as f64
        );
        assert!(accepted[0] > 0, "no draft was ever accepted");
    }
}
test_device!(speculative_greedy_equals_plain_greedy);

/// Sampled speculative decoding: with top-k 1 it is greedy decoding; otherwise each seed gives,
/// token for token, what plain sampling gives with it, at 1, 2 and 3 drafts (whole row, and
/// top-k with top-p).
fn speculative_sampling_is_plain_sampling<B: Backend>(backend: Arc<B>) {
    use ninfer_engine::model::sample_with_mtp;
    use ninfer_engine::{Sampler, SamplingParams};
    let (_, prompts) = read_reference(&golden_fixture_dir(FIXTURE));
    let work = tempfile::tempdir().expect("temporary directory");
    let model = open_f32(&backend, work.path());
    let prompt = &prompts[0].tokens;
    let top_one = SamplingParams {
        temperature: 1.0,
        top_k: 1,
        ..SamplingParams::default()
    };
    assert_eq!(
        sample_with_mtp(&model, prompt, 24, 2, top_one)
            .expect("sampling")
            .tokens,
        greedy_tokens(&model, prompt, 24).expect("greedy"),
        "top-k 1 sampling with drafts must be greedy decoding"
    );

    let tokens = 24;
    for (seed, params) in [
        SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.95,
            ..SamplingParams::default()
        },
    ]
    .into_iter()
    .flat_map(|params| (0..4u64).map(move |seed| (seed, params.clone())))
    {
        let params = SamplingParams { seed, ..params };
        let mut sampler = Sampler::new(params.clone()).expect("sampler");
        let mut state = model.new_sequence(prompt.len() + tokens).expect("state");
        let mut logits = model.prefill(&mut state, prompt).expect("prefill");
        let mut plain = Vec::new();
        while plain.len() < tokens {
            let token = sampler.sample(&logits, &plain).expect("sample");
            plain.push(token);
            if plain.len() < tokens {
                logits = model.prefill(&mut state, &[token]).expect("decode");
            }
        }
        for draft_tokens in 1..=3 {
            let drafted = sample_with_mtp(&model, prompt, tokens, draft_tokens, params.clone())
                .expect("sampling");
            assert_eq!(
                drafted.tokens, plain,
                "{params:?}, {draft_tokens} drafts: drafting changed the sampled tokens"
            );
            assert!(
                drafted.accepted.iter().sum::<usize>() > 0,
                "{params:?}: no draft was accepted"
            );
        }
    }
}
test_device!(speculative_sampling_is_plain_sampling);
