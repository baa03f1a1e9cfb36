//! The CUDA backend's fidelity bars on the golden fixtures (`tests/fixtures/<arch>/`, transformers
//! references): every fixture, converted with f32 and with bf16 weights, through the CUDA
//! backend — per-token NLL within 2e-2 mean absolute difference of transformers (on the same
//! weights: the f32 reference, or `bf16_weights` for the bf16 artifact), top-1 next-token
//! agreement with the CPU backend ≥ 99% under teacher forcing, and the CPU backend's greedy
//! tokens for the first 16 tokens of every prompt. Prints one line per fixture and dtype. Runs
//! with the default options, as `ninfer-engine --device cuda` does: bf16 KV cache, cuBLAS for
//! bf16 prefill GEMMs when it is present (printed first).
//! The `qwen4_exp` fixture has its own case with the same bars, except that its bf16 artifact
//! has no bf16 reference: it is held to 0.1 mean |ΔNLL| against the f32 reference, the sanity
//! bound the CPU backend's golden test gives it.
//! Skipped without a GPU (fails under `NINFER_REQUIRE_GPU=1`).

use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::backend::cuda::CudaBackend;
use ninfer_engine::perplexity::negative_log_likelihood;
use ninfer_engine::sampling::argmax;
use ninfer_engine::testing::{
    golden_fixture_dir, greedy_tokens, json_numbers, teacher_forced_logits, GOLDEN_FIXTURES,
};
use ninfer_engine::{CpuBackend, Model};

const GREEDY_TOKENS: usize = 16;

/// The GPU backend with the default options, or `None` (and a note) where there is none.
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

#[test]
fn golden_fixtures_through_cuda_meet_the_cuda_bars() {
    let Some(gpu) = gpu_or_skip("golden_fixtures_through_cuda_meet_the_cuda_bars") else {
        return;
    };
    println!(
        "cuda backend: KV cache {}, cuBLAS {}",
        gpu.info().kv_dtype,
        gpu.info().cublas_library.as_deref().unwrap_or("off")
    );
    let cpu = Arc::new(CpuBackend::new());
    let work = tempfile::tempdir().unwrap();
    let mut ran = 0;
    for name in GOLDEN_FIXTURES {
        let fixture = golden_fixture_dir(name);
        let Ok(text) = std::fs::read_to_string(fixture.join("reference.json")) else {
            println!("SKIPPED golden fixture `{name}`: no reference.json");
            continue;
        };
        ran += 1;
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let tokens: Vec<u32> = json_numbers(&json["nll_token_ids"])
            .into_iter()
            .map(|x| x as u32)
            .collect();
        let prompts: Vec<Vec<u32>> = json["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                json_numbers(&p["prompt_token_ids"])
                    .into_iter()
                    .map(|x| x as u32)
                    .collect()
            })
            .collect();
        for (dtype, reference) in [
            (DType::F32, json_numbers(&json["token_nll"])),
            (
                DType::Bf16,
                json_numbers(&json["bf16_weights"]["token_nll"]),
            ),
        ] {
            // References store N−1 values (positions 1..N) or N (a leading placeholder).
            let reference = if reference.len() == tokens.len() {
                reference[1..].to_vec()
            } else {
                reference
            };
            assert_eq!(
                reference.len() + 1,
                tokens.len(),
                "{name}: reference length"
            );
            let path = work.path().join(format!("{name}-{dtype}.ninfer"));
            let options = ConvertOptions {
                experts_dtype: dtype,
                dense_dtype: dtype,
                ..ConvertOptions::new(&fixture, &path)
            };
            convert_checkpoint(&options, &NoProgress).unwrap();
            let on_gpu = Model::open(Arc::clone(&gpu), &path).unwrap();
            let on_cpu = Model::open(Arc::clone(&cpu), &path).unwrap();
            let (logits_g, logits_c) = (
                teacher_forced_logits(&on_gpu, &tokens).unwrap(),
                teacher_forced_logits(&on_cpu, &tokens).unwrap(),
            );
            let scored = tokens.len() - 1;
            let mut nll_difference = 0.0f64;
            let mut agree = 0usize;
            for t in 0..scored {
                let nll = negative_log_likelihood(&logits_g[t], tokens[t + 1]);
                nll_difference += (nll - reference[t]).abs();
                agree += usize::from(argmax(&logits_g[t]) == argmax(&logits_c[t]));
            }
            let mean_difference = nll_difference / scored as f64;
            let agreement = agree as f64 / scored as f64;
            let mut greedy_same = 0;
            for prompt in &prompts {
                let (g, c) = (
                    greedy_tokens(&on_gpu, prompt, GREEDY_TOKENS).unwrap(),
                    greedy_tokens(&on_cpu, prompt, GREEDY_TOKENS).unwrap(),
                );
                greedy_same += g.iter().zip(&c).take_while(|(a, b)| a == b).count();
                assert_eq!(
                    g, c,
                    "{name} {dtype}: greedy tokens differ from the CPU backend"
                );
            }
            println!(
                "{name} {dtype} weights on cuda: mean |ΔNLL| vs transformers = {mean_difference:.2e} over {scored} tokens, top-1 agreement with cpu {:.1}%, greedy identical to cpu {greedy_same}/{} tokens",
                100.0 * agreement,
                GREEDY_TOKENS * prompts.len()
            );
            assert!(
                mean_difference <= 2e-2,
                "{name} {dtype}: mean |ΔNLL| {mean_difference}"
            );
            assert!(
                agreement >= 0.99,
                "{name} {dtype}: top-1 agreement {agreement}"
            );
        }
    }
    if ran == 0 {
        println!("SKIPPED all golden fixtures: none is committed under tests/fixtures/");
    }
    gpu.synchronize().unwrap();
}

/// The qwen4_exp fixture (hyper-connection streams, PLE blocks, QSA sparse attention on the GPU)
/// through the CUDA backend with the default options: per-token NLL within 2e-2 mean absolute
/// difference of transformers (f32 weights; bf16 weights within 0.1 of the f32 reference), top-1
/// agreement with the CPU backend ≥ 99% under teacher forcing, the CPU backend's greedy tokens.
#[test]
fn qwen4_exp_fixture_through_cuda_meets_the_cuda_bars() {
    let Some(gpu) = gpu_or_skip("qwen4_exp_fixture_through_cuda_meets_the_cuda_bars") else {
        return;
    };
    let cpu = Arc::new(CpuBackend::new());
    let work = tempfile::tempdir().unwrap();
    let name = "qwen4_exp";
    let fixture = golden_fixture_dir(name);
    // The fixture is committed: a missing one is a failure, not a skip.
    let text = std::fs::read_to_string(fixture.join("reference.json"))
        .unwrap_or_else(|error| panic!("golden fixture `{name}`: {error}"));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tokens: Vec<u32> = json_numbers(&json["nll_token_ids"])
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let prompts: Vec<Vec<u32>> = json["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            json_numbers(&p["prompt_token_ids"])
                .into_iter()
                .map(|x| x as u32)
                .collect()
        })
        .collect();
    let reference = json_numbers(&json["token_nll"]);
    // References store N−1 values (positions 1..N) or N (a leading placeholder).
    let reference = if reference.len() == tokens.len() {
        reference[1..].to_vec()
    } else {
        reference
    };
    assert_eq!(
        reference.len() + 1,
        tokens.len(),
        "{name}: reference length"
    );
    for (dtype, bound) in [(DType::F32, 2e-2), (DType::Bf16, 0.1)] {
        let path = work.path().join(format!("{name}-{dtype}.ninfer"));
        let options = ConvertOptions {
            experts_dtype: dtype,
            dense_dtype: dtype,
            ..ConvertOptions::new(&fixture, &path)
        };
        convert_checkpoint(&options, &NoProgress).unwrap();
        let on_gpu = Model::open(Arc::clone(&gpu), &path).unwrap();
        let on_cpu = Model::open(Arc::clone(&cpu), &path).unwrap();
        let (logits_g, logits_c) = (
            teacher_forced_logits(&on_gpu, &tokens).unwrap(),
            teacher_forced_logits(&on_cpu, &tokens).unwrap(),
        );
        let scored = tokens.len() - 1;
        let mut nll_difference = 0.0f64;
        let mut agree = 0usize;
        for t in 0..scored {
            let nll = negative_log_likelihood(&logits_g[t], tokens[t + 1]);
            nll_difference += (nll - reference[t]).abs();
            agree += usize::from(argmax(&logits_g[t]) == argmax(&logits_c[t]));
        }
        let mean_difference = nll_difference / scored as f64;
        let agreement = agree as f64 / scored as f64;
        for prompt in &prompts {
            let (g, c) = (
                greedy_tokens(&on_gpu, prompt, GREEDY_TOKENS).unwrap(),
                greedy_tokens(&on_cpu, prompt, GREEDY_TOKENS).unwrap(),
            );
            assert_eq!(
                g, c,
                "{name} {dtype}: greedy tokens differ from the CPU backend"
            );
        }
        println!(
            "{name} {dtype} weights on cuda: mean |ΔNLL| vs transformers f32 = {mean_difference:.2e} over {scored} tokens, top-1 agreement with cpu {:.1}%, greedy identical to cpu {} tokens",
            100.0 * agreement,
            GREEDY_TOKENS * prompts.len()
        );
        assert!(
            mean_difference <= bound,
            "{name} {dtype}: mean |ΔNLL| {mean_difference} > {bound}"
        );
        assert!(
            agreement >= 0.99,
            "{name} {dtype}: top-1 agreement {agreement}"
        );
    }
    gpu.synchronize().unwrap();
}
