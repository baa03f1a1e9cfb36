//! Prefill staging (`Model::enable_prefill_staging`, the engine's
//! `--moe-prefill-gpu-min-tokens`): a batch big enough computes its routed experts on the
//! backend from staging slots instead of the expert executor. One body per backend, on the
//! golden fixtures: the same teacher-forced NLL as without staging (within f32 rounding for f32
//! experts, bf16-level for quantized ones), with and without resident experts beside it, and
//! decode (one token, below the threshold) still goes to the executor with the same tokens.

use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::perplexity::negative_log_likelihood;
use ninfer_engine::testing::{
    golden_fixture_dir, greedy_tokens, json_numbers, teacher_forced_logits, MOE_GOLDEN_FIXTURES,
};
use ninfer_engine::{test_device, Backend, Model};

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
