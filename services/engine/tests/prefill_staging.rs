//! Prefill staging (`Model::enable_prefill_staging`, the engine's
//! `--moe-prefill-gpu-min-tokens`): a batch big enough computes its routed experts on the
//! backend from staging slots instead of the expert executor. One body per backend, on the
//! golden fixtures: the same teacher-forced NLL as without staging (within f32 rounding for f32
//! experts, bf16-level for quantized ones), with and without resident experts beside it, and
//! decode (one token, below the threshold) still goes to the executor with the same tokens.
//! Layerwise prefill (double-buffered streaming, each layer split between the backend and the
//! executor) gives the staged path's results under every split.

use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::perplexity::negative_log_likelihood;
use ninfer_engine::testing::{
    golden_fixture_dir, greedy_tokens, json_numbers, teacher_forced_logits, MOE_GOLDEN_FIXTURES,
};
use ninfer_engine::{test_device, Backend, Model, PrefillStagingOptions, PrefillThroughputs};

const GREEDY_TOKENS: usize = 12;

fn staged_prefill_does_not_change_the_model<B: Backend>(backend: Arc<B>) {
    let work = tempfile::tempdir().unwrap();
    for name in MOE_GOLDEN_FIXTURES {
        let fixture = golden_fixture_dir(name);
        let text = std::fs::read_to_string(fixture.join("reference.json"))
            .unwrap_or_else(|error| panic!("golden fixture `{name}`: {error}"));
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let tokens: Vec<u32> = json_numbers(&json["nll_token_ids"])
            .into_iter()
            .map(|x| x as u32)
            .collect();
        let prompt: Vec<u32> = json_numbers(&json["prompts"][0]["prompt_token_ids"])
            .into_iter()
            .map(|x| x as u32)
            .collect();
        assert!(
            tokens.len() > 8 && prompt.len() > 2,
            "{name}: fixture too short"
        );
        for dtype in [DType::F32, DType::Int8, DType::Int4] {
            let path = work.path().join(format!("{name}-{dtype}.ninfer"));
            let options = ConvertOptions {
                experts_dtype: dtype,
                dense_dtype: DType::F32,
                ..ConvertOptions::new(&fixture, &path)
            };
            convert_checkpoint(&options, &NoProgress).unwrap();
            let nll_and_greedy = |model: &Model<B>| {
                let nll: Vec<f64> = teacher_forced_logits(model, &tokens)
                    .unwrap()
                    .iter()
                    .zip(&tokens[1..])
                    .map(|(logits, &next)| negative_log_likelihood(logits, next))
                    .collect();
                (nll, greedy_tokens(model, &prompt, GREEDY_TOKENS).unwrap())
            };
            let base = Model::open(Arc::clone(&backend), &path).unwrap();
            let (base_nll, base_greedy) = nll_and_greedy(&base);
            drop(base);
            for resident_half in [false, true] {
                let mut model = Model::open(Arc::clone(&backend), &path).unwrap();
                let common = model.spec().common.clone();
                if resident_half {
                    let odd: Vec<u32> = (0..common.num_experts as u32)
                        .filter(|e| e % 2 == 1)
                        .collect();
                    let placement: Vec<Vec<u32>> = (0..common.num_hidden_layers)
                        .map(|l| {
                            if common.moe_layers[l] {
                                odd.clone()
                            } else {
                                Vec::new()
                            }
                        })
                        .collect();
                    model.place_resident_experts(&placement).unwrap();
                }
                // Every prefill of two tokens or more is staged; decode is not.
                let bytes = model.enable_prefill_staging(2).unwrap();
                assert!(bytes > 0, "{name}: staging slots take memory");
                let (nll, greedy) = nll_and_greedy(&model);
                let difference = nll
                    .iter()
                    .zip(&base_nll)
                    .map(|(a, b)| (a - b).abs())
                    .sum::<f64>()
                    / nll.len() as f64;
                let tolerance = if dtype == DType::F32 { 1e-4 } else { 2e-3 };
                println!(
                    "{name} {dtype} experts on {}: staged prefill{} vs executor: mean |ΔNLL| = {difference:.2e}, greedy {}",
                    backend.name(),
                    if resident_half { " + half resident" } else { "" },
                    if greedy == base_greedy { "identical" } else { "DIFFERENT" }
                );
                assert!(
                    difference <= tolerance,
                    "{name} {dtype} resident_half={resident_half}: mean |ΔNLL| {difference}"
                );
                assert_eq!(
                    greedy, base_greedy,
                    "{name} {dtype} resident_half={resident_half}: greedy tokens differ"
                );
            }
        }
    }
}
test_device!(staged_prefill_does_not_change_the_model);

/// Throughputs that make every layer of a batch stream all its experts, split them about
/// half and half with the executor, or leave them all to the executor.
fn forced_throughputs(split: &str) -> PrefillThroughputs {
    let fast = 1e15;
    match split {
        // The executor's rate unknown: nothing is left to it.
        "gpu" => PrefillThroughputs {
            copy_bytes_per_second: fast,
            backend_pairs_per_second: fast,
            executor_pairs_per_second: 0.0,
            flops_per_pair: 1.0,
        },
        // Copies free, both sides equally fast: half of the experts each.
        "mixed" => PrefillThroughputs {
            copy_bytes_per_second: fast,
            backend_pairs_per_second: 1e3,
            executor_pairs_per_second: 1e3,
            flops_per_pair: 1.0,
        },
        // A backend of a pair per thousand seconds: nothing is worth streaming.
        _ => PrefillThroughputs {
            copy_bytes_per_second: fast,
            backend_pairs_per_second: 1e-3,
            executor_pairs_per_second: fast,
            flops_per_pair: 1.0,
        },
    }
}

/// Layerwise prefill (`Model::enable_prefill_staging_with`, the engine's
/// `--moe-prefill-layerwise-min-tokens`) gives the staged path's NLL and greedy tokens whether
/// each layer streams all its non-resident experts, splits them with the executor or leaves
/// them to it, with and without resident experts; the profile shows each split happened
/// (experts streamed, the executor waited on or not), and the start-up measurement gives
/// usable rates.
fn layerwise_prefill_matches_the_staged_path<B: Backend>(backend: Arc<B>) {
    let work = tempfile::tempdir().unwrap();
    for name in MOE_GOLDEN_FIXTURES {
        let fixture = golden_fixture_dir(name);
        let text = std::fs::read_to_string(fixture.join("reference.json"))
            .unwrap_or_else(|error| panic!("golden fixture `{name}`: {error}"));
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let tokens: Vec<u32> = json_numbers(&json["nll_token_ids"])
            .into_iter()
            .map(|x| x as u32)
            .collect();
        let prompt: Vec<u32> = json_numbers(&json["prompts"][0]["prompt_token_ids"])
            .into_iter()
            .map(|x| x as u32)
            .collect();
        for dtype in [DType::F32, DType::Int8, DType::Int4] {
            let path = work.path().join(format!("{name}-{dtype}.ninfer"));
            let options = ConvertOptions {
                experts_dtype: dtype,
                dense_dtype: DType::F32,
                ..ConvertOptions::new(&fixture, &path)
            };
            convert_checkpoint(&options, &NoProgress).unwrap();
            let nll_and_greedy = |model: &Model<B>| {
                let nll: Vec<f64> = teacher_forced_logits(model, &tokens)
                    .unwrap()
                    .iter()
                    .zip(&tokens[1..])
                    .map(|(logits, &next)| negative_log_likelihood(logits, next))
                    .collect();
                (nll, greedy_tokens(model, &prompt, GREEDY_TOKENS).unwrap())
            };
            for resident_half in [false, true] {
                let open = || {
                    let mut model = Model::open(Arc::clone(&backend), &path).unwrap();
                    if resident_half {
                        let common = model.spec().common.clone();
                        let odd: Vec<u32> = (0..common.num_experts as u32)
                            .filter(|e| e % 2 == 1)
                            .collect();
                        let placement: Vec<Vec<u32>> = (0..common.num_hidden_layers)
                            .map(|l| {
                                if common.moe_layers[l] {
                                    odd.clone()
                                } else {
                                    Vec::new()
                                }
                            })
                            .collect();
                        model.place_resident_experts(&placement).unwrap();
                    }
                    model
                };
                let mut staged = open();
                staged.enable_prefill_staging(2).unwrap();
                let (staged_nll, staged_greedy) = nll_and_greedy(&staged);
                drop(staged);
                let mut model = open();
                let bytes = model
                    .enable_prefill_staging_with(PrefillStagingOptions {
                        staged_min_tokens: 0,
                        layerwise_min_tokens: 2,
                    })
                    .unwrap();
                let stride = model.expert_slot_bytes().unwrap();
                let experts = model.spec().common.num_experts as u64;
                assert_eq!(
                    bytes,
                    2 * experts * stride,
                    "{name}: two layer-sized halves"
                );
                let measured = model.measure_prefill_throughputs(64, 16).unwrap();
                for rate in [
                    measured.copy_bytes_per_second,
                    measured.backend_pairs_per_second,
                    measured.executor_pairs_per_second,
                ] {
                    assert!(
                        rate.is_finite() && rate > 0.0,
                        "{name}: measured {measured:?}"
                    );
                }
                for split in ["gpu", "mixed", "cpu"] {
                    model
                        .set_prefill_throughputs(forced_throughputs(split))
                        .unwrap();
                    let summary = model.layerwise_split_summary(tokens.len()).unwrap();
                    match split {
                        "gpu" => assert!(summary.mixed_layers + summary.cpu_layers == 0),
                        "mixed" => assert!(summary.mixed_layers > 0, "{summary:?}"),
                        _ => assert!(summary.layerwise_gpu_layers + summary.mixed_layers == 0),
                    }
                    model.profile().snapshot(true);
                    let (nll, greedy) = nll_and_greedy(&model);
                    let prefill = model.profile().snapshot(true).prefill;
                    let difference = nll
                        .iter()
                        .zip(&staged_nll)
                        .map(|(a, b)| (a - b).abs())
                        .sum::<f64>()
                        / nll.len() as f64;
                    let tolerance = if dtype == DType::F32 { 1e-4 } else { 2e-3 };
                    println!(
                        "{name} {dtype} experts on {}: layerwise ({split}){} vs staged: mean |ΔNLL| = {difference:.2e}, streamed {} experts, executor waited {} ns",
                        backend.name(),
                        if resident_half { " + half resident" } else { "" },
                        prefill.streamed_experts,
                        prefill.expert_wait_nanos,
                    );
                    assert!(
                        difference <= tolerance,
                        "{name} {dtype} {split} resident_half={resident_half}: mean |ΔNLL| {difference}"
                    );
                    assert_eq!(
                        greedy, staged_greedy,
                        "{name} {dtype} {split} resident_half={resident_half}: greedy tokens differ"
                    );
                    let streamed_all = split == "gpu";
                    assert_eq!(
                        prefill.streamed_experts > 0,
                        split != "cpu",
                        "{name} {split}: streamed experts"
                    );
                    assert_eq!(
                        prefill.expert_wait_nanos > 0,
                        !streamed_all,
                        "{name} {split}: the executor's share"
                    );
                }
            }
        }
    }
}
test_device!(layerwise_prefill_matches_the_staged_path);
