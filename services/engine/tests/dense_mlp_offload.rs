//! Dense MLP offload on the dense qwen3_5 fixture: a model whose last N dense MLPs the expert
//! executor computes from their one-expert banks (routing weight 1) gives the greedy tokens of
//! the model that computes them on the backend: the same logits bit for bit through the f32
//! reference executor, within f32 summation-order differences (1e-4 of the largest logit)
//! through the SIMD kernels the workers run;
//! too many layers, or a model without the banks, are refused by name.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_cpu_experts::KernelIsa;
use ninfer_engine::moe::KernelExpertExecutor;
use ninfer_engine::testing::{golden_fixture_dir, greedy_tokens, max_abs_difference};
use ninfer_engine::{
    open_artifact, CpuBackend, ExpertExecutor, Model, NoRoutedExperts, ReferenceExpertExecutor,
};

/// The fixture's four layers are dense MLPs.
const LAYERS: usize = 4;

fn convert(directory: &Path, fixture: &str, dense: DType) -> PathBuf {
    let path = directory.join(format!("{fixture}-{dense}.ninfer"));
    let options = ConvertOptions {
        experts_dtype: dense,
        dense_dtype: dense,
        ..ConvertOptions::new(golden_fixture_dir(fixture), &path)
    };
    convert_checkpoint(&options, &NoProgress)
        .unwrap_or_else(|e| panic!("converting {fixture} ({dense}): {e}"));
    path
}

fn prompts() -> Vec<Vec<u32>> {
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(golden_fixture_dir("qwen3_5").join("reference.json")).unwrap(),
    )
    .unwrap();
    reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["prompt_token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

#[test]
fn offloaded_dense_mlps_give_the_tokens_and_logits_of_the_backend() {
    let directory = tempfile::tempdir().unwrap();
    for dense in [DType::F32, DType::Bf16] {
        let path = convert(directory.path(), "qwen3_5", dense);
        let artifact = open_artifact(&path).unwrap();
        // The converter wrote every dense MLP a second time, as a bank of one expert.
        for layer in 0..LAYERS {
            let bank = artifact
                .expert_bank(&format!("layers.{layer}.mlp.experts"))
                .unwrap();
            assert_eq!((bank.num_experts, bank.dtype), (1, dense));
        }
        let backend = Arc::new(CpuBackend::new());
        let plain = Model::load(
            Arc::clone(&backend),
            Arc::clone(&artifact),
            Arc::new(NoRoutedExperts),
        )
        .unwrap();
        assert_eq!(plain.offloaded_dense_mlp_layers(), 0);
        let executors: [(&str, Arc<dyn ExpertExecutor>); 2] = [
            (
                "kernels",
                Arc::new(
                    KernelExpertExecutor::new(Arc::clone(&artifact), 2, &[], KernelIsa::Scalar, 64)
                        .unwrap(),
                ),
            ),
            (
                "reference",
                Arc::new(ReferenceExpertExecutor::new(Arc::clone(&artifact))),
            ),
        ];
        for (name, executor) in executors {
            for offloaded in [1, LAYERS] {
                let model = Model::load_offloading_dense_mlps(
                    Arc::clone(&backend),
                    Arc::clone(&artifact),
                    Arc::clone(&executor),
                    offloaded,
                )
                .unwrap();
                assert_eq!(model.offloaded_dense_mlp_layers(), offloaded);
                for (index, prompt) in prompts().iter().enumerate() {
                    let case = format!("{dense} {name}, {offloaded} offloaded, prompt {index}");
                    let mut plain_state = plain.new_sequence(prompt.len() + 1).unwrap();
                    let mut state = model.new_sequence(prompt.len() + 1).unwrap();
                    let expected = plain.prefill(&mut plain_state, prompt).unwrap();
                    let got = model.prefill(&mut state, prompt).unwrap();
                    let scale = expected.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                    let difference = max_abs_difference(&expected, &got);
                    println!("{case}: max |Δlogit| {difference:.2e} of {scale:.2}");
                    assert!(difference <= 1e-4 * scale.max(1.0), "{case}: {difference}");
                    // The f32 reference sums like the CPU backend's matmuls: the same bits.
                    if name == "reference" {
                        assert_eq!(expected, got, "{case}: not bit-identical");
                    }
                    assert_eq!(
                        greedy_tokens(&model, prompt, 12).unwrap(),
                        greedy_tokens(&plain, prompt, 12).unwrap(),
                        "{case}: greedy tokens differ"
                    );
                }
            }
        }
        // More layers than the model has dense MLPs: refused, saying how many there are.
        let error = Model::load_offloading_dense_mlps(
            Arc::clone(&backend),
            Arc::clone(&artifact),
            Arc::new(NoRoutedExperts),
            LAYERS + 1,
        )
        .err()
        .expect("five of four layers refused")
        .to_string();
        assert!(error.contains("4 dense-MLP layers"), "{error}");
    }
    // A MoE model has no dense MLPs to offload.
    let moe = open_artifact(&convert(directory.path(), "qwen3_5_moe", DType::F32)).unwrap();
    let error = Model::load_offloading_dense_mlps(
        Arc::new(CpuBackend::new()),
        Arc::clone(&moe),
        Arc::new(ReferenceExpertExecutor::new(Arc::clone(&moe))),
        1,
    )
    .err()
    .expect("a MoE model refuses")
    .to_string();
    assert!(error.contains("0 dense-MLP layers"), "{error}");
}
