//! `ninfer convert --synthetic`: every preset's artifact loads in the engine unchanged and
//! generates finite logits; the same seed gives the same model; Zipf routing skews the experts
//! the engine actually selects, uniform routing does not; bad arguments fail clearly.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use ninfer_artifact::{Artifact, DType};
use ninfer_convert::synthetic::{preset, Routing, SyntheticOptions, PRESETS};
use ninfer_convert::{write_synthetic, NoProgress};
use ninfer_engine::{
    open_artifact, CpuBackend, EngineError, ExpertBatch, ExpertExecutor, Model,
    ReferenceExpertExecutor,
};

/// Delegates to the reference executor and counts which experts the model routed to.
struct CountingExecutor {
    inner: ReferenceExpertExecutor,
    /// `[layer][expert]` selections.
    counts: Mutex<Vec<Vec<u64>>>,
}

impl ExpertExecutor for CountingExecutor {
    fn name(&self) -> &str {
        "counting"
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        if let Ok(mut counts) = self.counts.lock() {
            for &id in batch.expert_ids {
                counts[batch.layer][id as usize] += 1;
            }
        }
        self.inner.compute(batch, out)
    }
}

fn open_counting(path: &Path) -> (Model<CpuBackend>, Arc<CountingExecutor>) {
    let artifact = open_artifact(path).unwrap();
    let common = artifact.config().common().clone();
    let executor = Arc::new(CountingExecutor {
        inner: ReferenceExpertExecutor::new(Arc::clone(&artifact)),
        counts: Mutex::new(vec![vec![0; common.num_experts]; common.num_hidden_layers]),
    });
    let model = Model::load(
        Arc::new(CpuBackend::new()),
        artifact,
        Arc::clone(&executor) as Arc<dyn ExpertExecutor>,
    )
    .unwrap();
    (model, executor)
}

/// Pseudo-random token ids below `vocab` (a fixed LCG, so runs are comparable).
fn tokens(count: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64 ^ salt;
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

#[test]
fn every_preset_loads_in_the_engine_and_generates_finite_logits() {
    let directory = tempfile::tempdir().unwrap();
    let dtypes = [
        DType::Int4,
        DType::Int8,
        DType::Bf16,
        DType::Int4,
        DType::Int8,
        DType::Int4,
    ];
    assert_eq!(dtypes.len(), PRESETS.len());
    for (preset, experts_dtype) in PRESETS.iter().zip(dtypes) {
        let small = preset.scaled_down();
        // Four layers hold one full-attention layer of the hybrid patterns.
        let layers = 4.min(small.num_hidden_layers);
        let path = directory.path().join(format!("{}.ninfer", preset.name));
        let mut options = SyntheticOptions::new(small.clone(), &path);
        options.layers = Some(layers);
        options.experts_dtype = experts_dtype;
        write_synthetic(&options, &NoProgress).unwrap();

        // The header holds exactly the config a conversion of such a checkpoint gives.
        let artifact = Artifact::open(&path).unwrap();
        let mut expected = small.model_config(layers).unwrap();
        if let Some(c) = expected.hybrid_mut() {
            c.mtp_num_layers = small.mtp_layers;
        }
        assert_eq!(artifact.config(), &expected, "{}", preset.name);
        let (v, h) = (small.vocab_size as u64, small.hidden_size as u64);
        assert_eq!(artifact.tensor("embed_tokens").unwrap().shape(), [v, h]);
        assert_eq!(artifact.tensor("lm_head").unwrap().shape(), [v, h]);
        if small.num_experts > 0 {
            let bank = artifact.expert_bank("layers.0.moe.experts").unwrap();
            assert_eq!(
                (bank.num_experts, bank.dtype),
                (small.num_experts as u64, experts_dtype)
            );
            let gate_up = artifact.tensor("layers.0.moe.experts.0.gate_up").unwrap();
            assert_eq!(gate_up.shape(), [2 * small.moe_intermediate_size as u64, h]);
        } else {
            // A dense preset: every layer's MLP in the `dense_mlp` class, and the same numbers
            // again as a one-expert bank (the CPU workers' copy, in the dense dtype).
            let up = artifact.tensor("layers.0.mlp.up_proj").unwrap();
            assert_eq!(up.shape(), [small.intermediate_size as u64, h]);
            assert_eq!(up.entry.class, ninfer_artifact::TensorClass::DenseMlp);
            assert_eq!(artifact.header().expert_banks.len(), layers);
            let bank = artifact.expert_bank("layers.0.mlp.experts").unwrap();
            assert_eq!((bank.num_experts, bank.dtype), (1, DType::Bf16));
            let gate_up = artifact.tensor("layers.0.mlp.experts.0.gate_up").unwrap();
            let i = small.intermediate_size;
            let row_bytes = 2 * h as usize;
            assert_eq!(
                &gate_up.bytes[i * row_bytes..],
                up.bytes,
                "the bank's up rows are the up_proj matrix"
            );
        }
        assert!(artifact.file("tokenizer.json").is_some());
        assert!(artifact.file("chat_template.jinja").is_some());
        assert_eq!(
            artifact.header().source.options.get("synthetic"),
            Some(&preset.name.to_string())
        );
        drop(artifact);

        let (model, executor) = open_counting(&path);
        let mut state = model.new_sequence(64).unwrap();
        let mut logits = model
            .prefill(&mut state, &tokens(12, small.vocab_size, 1))
            .unwrap();
        for step in 0..4 {
            assert_eq!(logits.len(), small.vocab_size);
            assert!(
                logits.iter().all(|x| x.is_finite()),
                "{} step {step}: non-finite logits",
                preset.name
            );
            let spread = logits.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            assert!(spread > 1e-3, "{}: logits all ~0", preset.name);
            let next = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap();
            logits = model.prefill(&mut state, &[next]).unwrap();
        }
        let counts = executor.counts.lock().unwrap();
        let routed: u64 = counts.iter().flatten().sum();
        assert_eq!(
            routed as usize,
            16 * layers * small.num_experts_per_tok,
            "{}: every token of every layer went through the experts",
            preset.name
        );
    }
}

#[test]
fn same_seed_same_model_whatever_the_thread_count() {
    let directory = tempfile::tempdir().unwrap();
    let small = preset("qwen3-next-80b-a3b").unwrap().scaled_down();
    let id = |name: &str, seed: u64, threads: usize| {
        let path = directory.path().join(name);
        let mut options = SyntheticOptions::new(small.clone(), &path);
        options.layers = Some(4);
        options.experts_dtype = DType::Int8;
        options.seed = seed;
        options.threads = Some(threads);
        write_synthetic(&options, &NoProgress).unwrap();
        Artifact::open(&path).unwrap().model_id()
    };
    let first = id("a.ninfer", 7, 1);
    assert_eq!(first, id("b.ninfer", 7, 3));
    assert_ne!(first, id("c.ninfer", 8, 2));
}

/// Share of all selections that went to the most-selected 10% of experts, per layer.
fn top_decile_shares(counts: &[Vec<u64>]) -> Vec<f64> {
    counts
        .iter()
        .map(|layer| {
            let mut sorted = layer.clone();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            let top = sorted.len().div_ceil(10);
            let total: u64 = sorted.iter().sum();
            sorted[..top].iter().sum::<u64>() as f64 / total.max(1) as f64
        })
        .collect()
}

/// Routing measured through the engine on qwen3-30b-a3b's real hidden size and expert count
/// (128 experts, top-8), with the parts routing does not depend on made small.
#[test]
fn zipf_routing_skews_the_selected_experts_and_uniform_does_not() {
    let directory = tempfile::tempdir().unwrap();
    let mut shape = preset("qwen3-30b-a3b").unwrap();
    shape.vocab_size = 2048;
    shape.num_attention_heads = 4;
    shape.num_key_value_heads = 2;
    shape.moe_intermediate_size = 32;
    let mut shares = Vec::new();
    for routing in [Routing::Zipf { exponent: 1.0 }, Routing::Uniform] {
        let path = directory.path().join(format!("{routing}.ninfer"));
        let mut options = SyntheticOptions::new(shape.clone(), &path);
        options.layers = Some(2);
        options.experts_dtype = DType::Int4;
        options.routing = routing;
        write_synthetic(&options, &NoProgress).unwrap();
        let (model, executor) = open_counting(&path);
        for sequence in 0..3 {
            let mut state = model.new_sequence(64).unwrap();
            model
                .prefill(&mut state, &tokens(64, shape.vocab_size, sequence))
                .unwrap();
        }
        let counts = executor.counts.lock().unwrap();
        let per_layer = top_decile_shares(&counts);
        println!("{routing}: top 10% of experts get {per_layer:.3?} of the selections per layer");
        shares.push(per_layer);
    }
    // Flat would be 10%, plus sampling noise (12 selections per expert on average here).
    for share in &shares[0] {
        assert!(*share > 0.4, "zipf routing not skewed: {:?}", shares[0]);
    }
    for share in &shares[1] {
        assert!(*share < 0.22, "uniform routing skewed: {:?}", shares[1]);
    }
}

/// A measurement, not a check: does the skew last through qwen3-235b-a22b's 94 layers? (Real
/// depth and expert count, hidden 256.) `cargo test -p ninfer --test synthetic -- --ignored
/// --nocapture`.
#[test]
#[ignore]
fn zipf_skew_through_the_full_depth() {
    let directory = tempfile::tempdir().unwrap();
    let mut shape = preset("qwen3-235b-a22b").unwrap().scaled_down();
    shape.hidden_size = 256;
    shape.num_experts = 128;
    shape.num_experts_per_tok = 8;
    shape.moe_intermediate_size = 32;
    for routing in [Routing::Zipf { exponent: 1.0 }, Routing::Uniform] {
        let path = directory.path().join("deep.ninfer");
        let mut options = SyntheticOptions::new(shape.clone(), &path);
        options.experts_dtype = DType::Int4;
        options.routing = routing;
        write_synthetic(&options, &NoProgress).unwrap();
        let (model, executor) = open_counting(&path);
        for sequence in 0..4 {
            let mut state = model.new_sequence(128).unwrap();
            let logits = model
                .prefill(&mut state, &tokens(128, shape.vocab_size, sequence))
                .unwrap();
            assert!(logits.iter().all(|x| x.is_finite()));
        }
        let shares = top_decile_shares(&executor.counts.lock().unwrap());
        let every_10th: Vec<String> = shares
            .iter()
            .enumerate()
            .filter(|(layer, _)| layer % 10 == 0 || *layer == shares.len() - 1)
            .map(|(layer, share)| format!("L{layer} {share:.2}"))
            .collect();
        println!(
            "{routing}: top-10% share by layer: {}",
            every_10th.join(", ")
        );
    }
}

fn ninfer(args: &[&str], directory: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(args)
        .current_dir(directory)
        .output()
        .expect("running ninfer")
}

#[test]
fn cli_writes_a_synthetic_artifact_and_rejects_bad_arguments() {
    let directory = tempfile::tempdir().unwrap();
    let dir = directory.path();
    let output = ninfer(
        &[
            "convert",
            "--synthetic",
            "qwen3.5-35b-a3b",
            "--scale-down",
            "--layers",
            "4",
            "--experts-dtype",
            "int4",
            "--routing",
            "uniform",
            "--seed",
            "5",
            "out.ninfer",
        ],
        dir,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let artifact = Artifact::open(&dir.join("out.ninfer")).unwrap();
    let options = &artifact.header().source.options;
    assert_eq!(options.get("routing").map(String::as_str), Some("uniform"));
    assert_eq!(options.get("seed").map(String::as_str), Some("5"));
    assert_eq!(artifact.config().common().num_hidden_layers, 4);
    drop(artifact);
    std::fs::remove_file(dir.join("out.ninfer")).unwrap();

    // A Qwen4-Exp preset with a smaller n-gram table.
    let output = ninfer(
        &[
            "convert",
            "--synthetic",
            "qwen3.8-flash-next",
            "--scale-down",
            "--layers",
            "2",
            "--ngram-vocab-base",
            "300",
            "out.ninfer",
        ],
        dir,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let artifact = Artifact::open(&dir.join("out.ninfer")).unwrap();
    let parts = artifact.config().qwen4_exp().expect("a qwen4_exp config");
    assert_eq!(parts.ngram_vocab_size_base, 300);
    drop(artifact);
    std::fs::remove_file(dir.join("out.ninfer")).unwrap();

    let cases: [(&[&str], &[&str]); 7] = [
        (
            &[
                "convert",
                "--synthetic",
                "qwen3-30b-a3b",
                "--ngram-vocab-base",
                "1000",
                "x.ninfer",
            ],
            &["--ngram-vocab-base", "Qwen4-Exp", "qwen3-30b-a3b"],
        ),
        (
            &["convert", "--synthetic", "qwen4-1t", "x.ninfer"],
            &["`qwen4-1t`", "qwen3-30b-a3b", "qwen3-235b-a22b"],
        ),
        (
            &[
                "convert",
                "--synthetic",
                "qwen3-30b-a3b",
                "--routing",
                "zipf:x",
                "x.ninfer",
            ],
            &["`zipf:x`", "uniform"],
        ),
        (
            &[
                "convert",
                "--synthetic",
                "qwen3-30b-a3b",
                "hf_dir",
                "x.ninfer",
            ],
            &["--synthetic", "only the output path", "Usage:"],
        ),
        (&["convert"], &["--synthetic PRESET", "HF_DIR", "Usage:"]),
        (
            &["convert", "--synthetic", "qwen3-30b-a3b"],
            &["output path"],
        ),
        (
            &[
                "convert",
                "--synthetic",
                "qwen3-30b-a3b",
                "--layers",
                "49",
                "x.ninfer",
            ],
            &["--layers", "49", "48"],
        ),
    ];
    for (args, needles) in cases {
        let output = ninfer(args, dir);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{stderr}");
        for needle in needles {
            assert!(
                stderr.contains(needle),
                "{args:?}: no `{needle}` in:\n{stderr}"
            );
        }
        let left: Vec<_> = std::fs::read_dir(dir).unwrap().collect();
        assert!(left.is_empty(), "{args:?} left files behind");
    }
}
