//! Model-level checks on tiny random-weight artifacts of every architecture: prefill vs decode,
//! chunked vs recurrent delta rule, batch independence, quantized experts, bad input.

use std::path::Path;
use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_engine::testing::{
    max_abs_difference, write_tiny_model, TinyArchitecture, TinyModelOptions,
};
use ninfer_engine::{
    test_device, Backend, DeltaRuleForm, EngineError, LogitsSelection, Model, SequenceInput,
};

const ARCHITECTURES: [TinyArchitecture; 3] = [
    TinyArchitecture::Qwen3Moe,
    TinyArchitecture::Qwen3Next,
    TinyArchitecture::Qwen35Moe,
];

fn tiny_model<B: Backend>(
    backend: &Arc<B>,
    directory: &Path,
    options: TinyModelOptions,
) -> Model<B> {
    let path = directory.join(format!(
        "{:?}-{}-{}.ninfer",
        options.architecture, options.experts_dtype, options.dense_dtype
    ));
    write_tiny_model(&path, options).unwrap();
    Model::open(Arc::clone(backend), &path).unwrap()
}

fn prompt(length: usize, salt: u32) -> Vec<u32> {
    (0..length as u32)
        .map(|i| (i * 31 + salt * 17 + 5) % 97)
        .collect()
}

/// Largest difference relative to the largest magnitude (logits of random models reach ~10, where
/// one f32 ulp is ~1e-6).
fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    max_abs_difference(a, b) / scale
}

/// Prefill of N tokens then one decode step equals a prefill of N+1 tokens at the last position;
/// also across the 64-token chunk boundary of the delta rule, and for a multi-token continuation.
fn prefill_then_decode_equals_longer_prefill<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    for architecture in ARCHITECTURES {
        let model = tiny_model(
            &backend,
            directory.path(),
            TinyModelOptions::new(architecture),
        );
        for n in [1usize, 7, 70] {
            let tokens = prompt(n + 3, 1);
            let mut full = model.new_sequence(128).unwrap();
            let expected = model.prefill(&mut full, &tokens[..n + 1]).unwrap();
            let mut stepped = model.new_sequence(128).unwrap();
            model.prefill(&mut stepped, &tokens[..n]).unwrap();
            let decoded = model.prefill(&mut stepped, &tokens[n..n + 1]).unwrap();
            let difference = max_relative_difference(&expected, &decoded);
            println!("{architecture:?}: prefill {n} + decode vs prefill {}: max |Δlogit| / max |logit| = {difference:.2e}", n + 1);
            assert!(difference < 1e-5, "{architecture:?} n={n}: {difference}");
            // A two-token continuation (chunked path with a cached state).
            let expected = model.prefill(&mut full, &tokens[n + 1..n + 3]).unwrap();
            let continued = model.prefill(&mut stepped, &tokens[n + 1..n + 3]).unwrap();
            let difference = max_relative_difference(&expected, &continued);
            assert!(
                difference < 1e-5,
                "{architecture:?} n={n} continuation: {difference}"
            );
        }
    }
}
test_device!(prefill_then_decode_equals_longer_prefill);

/// The whole model with the delta rule forced to its chunked form equals the recurrent form.
fn chunked_and_recurrent_delta_rule_give_the_same_logits<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    for architecture in [TinyArchitecture::Qwen3Next, TinyArchitecture::Qwen35Moe] {
        let mut model = tiny_model(
            &backend,
            directory.path(),
            TinyModelOptions::new(architecture),
        );
        let tokens = prompt(100, 2);
        let mut run = |form| {
            model.set_delta_rule_form(form);
            let mut state = model.new_sequence(128).unwrap();
            let mut batch = [SequenceInput {
                state: &mut state,
                tokens: &tokens,
            }];
            model
                .forward(&mut batch, LogitsSelection::All)
                .unwrap()
                .remove(0)
        };
        let chunked = run(DeltaRuleForm::Chunked);
        let recurrent = run(DeltaRuleForm::Recurrent);
        let difference = max_relative_difference(&chunked, &recurrent);
        println!("{architecture:?}: chunked vs recurrent delta rule, all 100 positions: max |Δlogit| / max |logit| = {difference:.2e}");
        assert!(difference < 1e-5, "{architecture:?}: {difference}");
    }
}
test_device!(chunked_and_recurrent_delta_rule_give_the_same_logits);

/// Sequences batched together (different lengths, different positions) give the logits they
/// give alone, in prefill and in batched decode.
fn results_do_not_depend_on_batching<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    for architecture in ARCHITECTURES {
        let model = tiny_model(
            &backend,
            directory.path(),
            TinyModelOptions::new(architecture),
        );
        let prompts = [prompt(5, 1), prompt(23, 2), prompt(1, 3)];
        let continuations = [prompt(1, 4), prompt(1, 5), prompt(3, 6)];
        let mut alone = Vec::new();
        for (p, c) in prompts.iter().zip(&continuations) {
            let mut state = model.new_sequence(64).unwrap();
            let first = model.prefill(&mut state, p).unwrap();
            let second = model.prefill(&mut state, c).unwrap();
            alone.push((first, second));
        }
        let mut states: Vec<_> = (0..3).map(|_| model.new_sequence(64).unwrap()).collect();
        let mut batch: Vec<SequenceInput<'_, B>> = states
            .iter_mut()
            .zip(&prompts)
            .map(|(state, tokens)| SequenceInput { state, tokens })
            .collect();
        let first = model.forward(&mut batch, LogitsSelection::Last).unwrap();
        let mut batch: Vec<SequenceInput<'_, B>> = states
            .iter_mut()
            .zip(&continuations)
            .map(|(state, tokens)| SequenceInput { state, tokens })
            .collect();
        let second = model.forward(&mut batch, LogitsSelection::Last).unwrap();
        let mut worst = 0.0f32;
        for i in 0..3 {
            worst = worst
                .max(max_abs_difference(&alone[i].0, &first[i]))
                .max(max_abs_difference(&alone[i].1, &second[i]));
        }
        println!("{architecture:?}: batched vs alone: max |Δlogit| = {worst:.2e}");
        assert!(worst < 1e-5, "{architecture:?}: {worst}");
    }
}
test_device!(results_do_not_depend_on_batching);

/// Quantized and bf16 experts load, run, and stay close to the f32 model on a random model.
fn quantized_weights_run_close_to_f32<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    for architecture in ARCHITECTURES {
        let reference = tiny_model(
            &backend,
            directory.path(),
            TinyModelOptions::new(architecture),
        );
        let tokens = prompt(40, 7);
        let nll = |model: &Model<B>| {
            let options = ninfer_engine::PerplexityOptions {
                max_context: 64,
                chunk_tokens: 16,
            };
            let scored =
                ninfer_engine::token_nlls(model, &tokens, options, &mut |_, _| {}).unwrap();
            scored.iter().map(|s| s.nll).sum::<f64>() / scored.len() as f64
        };
        let base = nll(&reference);
        for (experts, dense, bound) in [
            (DType::Bf16, DType::Bf16, 0.05),
            (DType::Int8, DType::F32, 0.05),
            (DType::Int4, DType::F32, 0.3),
        ] {
            let options = TinyModelOptions {
                experts_dtype: experts,
                dense_dtype: dense,
                ..TinyModelOptions::new(architecture)
            };
            let model = tiny_model(&backend, directory.path(), options);
            let delta = nll(&model) - base;
            println!("{architecture:?}: experts {experts}, dense {dense}: mean NLL {:.5} (Δ {delta:+.5} vs f32 {base:.5})", base + delta);
            assert!(delta.abs() < bound, "{architecture:?} {experts}: Δ {delta}");
        }
    }
}
test_device!(quantized_weights_run_close_to_f32);

/// A prompt longer than the context is refused with both numbers; so is running past it later.
fn overlong_prompt_names_both_numbers<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let model = tiny_model(
        &backend,
        directory.path(),
        TinyModelOptions::new(TinyArchitecture::Qwen35Moe),
    );
    let mut state = model.new_sequence(16).unwrap();
    let error = model.prefill(&mut state, &prompt(17, 1)).unwrap_err();
    assert!(matches!(
        error,
        EngineError::PromptTooLong {
            tokens: 17,
            max_context: 16
        }
    ));
    let message = error.to_string();
    assert!(
        message.contains("17") && message.contains("16"),
        "{message}"
    );
    // The refused prompt left the state untouched: a fitting prompt still works.
    model.prefill(&mut state, &prompt(16, 1)).unwrap();
    let error = model.prefill(&mut state, &prompt(1, 2)).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("16") && message.contains('1'), "{message}");
    // Token ids outside the vocabulary are an error, not a panic.
    let mut fresh = model.new_sequence(16).unwrap();
    let error = model.prefill(&mut fresh, &[5, 1000]).unwrap_err();
    assert!(error.to_string().contains("1000"), "{error}");
}
test_device!(overlong_prompt_names_both_numbers);

/// An artifact whose header names an architecture the engine does not implement is refused at
/// load, by name. (The header is rewritten in place: same length, fresh checksums.)
#[test]
fn unknown_architecture_is_refused_by_name() {
    use ninfer_artifact::header::{Checksum, Preamble, PREAMBLE_LENGTH};
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("model.ninfer");
    write_tiny_model(&path, TinyModelOptions::new(TinyArchitecture::Qwen3Moe)).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let mut preamble = Preamble::decode(&bytes[..PREAMBLE_LENGTH as usize], &path).unwrap();
    let start = preamble.header_offset as usize;
    let end = start + preamble.header_length as usize;
    let header = String::from_utf8(bytes[start..end].to_vec()).unwrap();
    let renamed = header.replace(
        "\"architecture\":\"qwen3_moe\"",
        "\"architecture\":\"qwen9_moe\"",
    );
    assert_ne!(header, renamed, "the header should name its architecture");
    bytes[start..end].copy_from_slice(renamed.as_bytes());
    preamble.header_checksum = Checksum::of(renamed.as_bytes());
    bytes[..PREAMBLE_LENGTH as usize].copy_from_slice(&preamble.encode());
    std::fs::write(&path, &bytes).unwrap();

    let backend = Arc::new(ninfer_engine::CpuBackend::new());
    let error = match Model::open(backend, &path) {
        Ok(_) => panic!("an unknown architecture was loaded"),
        Err(error) => error,
    };
    assert!(
        matches!(error, EngineError::UnsupportedArchitecture { ref name } if name == "qwen9_moe"),
        "{error}"
    );
    assert!(error.to_string().contains("qwen9_moe"), "{error}");
}

/// Perplexity windows are non-overlapping: every token but the first of each window is scored.
fn perplexity_windows_do_not_overlap<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let model = tiny_model(
        &backend,
        directory.path(),
        TinyModelOptions::new(TinyArchitecture::Qwen3Next),
    );
    let tokens = prompt(50, 3);
    let options = ninfer_engine::PerplexityOptions {
        max_context: 20,
        chunk_tokens: 7,
    };
    let scored = ninfer_engine::token_nlls(&model, &tokens, options, &mut |_, _| {}).unwrap();
    let positions: Vec<usize> = scored.iter().map(|s| s.position).collect();
    let expected: Vec<usize> = (0..50).filter(|p| p % 20 != 0).collect();
    assert_eq!(positions, expected);
    // Same as a single prefill of the window, scored directly.
    let mut state = model.new_sequence(20).unwrap();
    let mut batch = [SequenceInput {
        state: &mut state,
        tokens: &tokens[20..40],
    }];
    let logits = model
        .forward(&mut batch, LogitsSelection::All)
        .unwrap()
        .remove(0);
    let vocab = model.vocab_size();
    for s in scored.iter().filter(|s| (21..40).contains(&s.position)) {
        let row = s.position - 21;
        let direct = ninfer_engine::perplexity::negative_log_likelihood(
            &logits[row * vocab..(row + 1) * vocab],
            tokens[s.position],
        );
        assert!((direct - s.nll).abs() < 1e-5);
    }
}
test_device!(perplexity_windows_do_not_overlap);

/// The in-process expert executor equals a plain loop over fully dequantized experts (decoded by
/// `ninfer-artifact`'s own `to_f32_vec`), for every expert dtype.
#[test]
fn cpu_expert_executor_matches_dequantized_loop() {
    use ninfer_engine::{ExpertBatch, ExpertExecutor, ReferenceExpertExecutor};
    let directory = tempfile::tempdir().unwrap();
    for dtype in [DType::F32, DType::Bf16, DType::Int8, DType::Int4] {
        let path = directory.path().join(format!("experts-{dtype}.ninfer"));
        let options = TinyModelOptions {
            experts_dtype: dtype,
            ..TinyModelOptions::new(TinyArchitecture::Qwen3Moe)
        };
        let config = write_tiny_model(&path, options).unwrap();
        let common = config.common();
        let (hidden, intermediate) = (common.hidden_size, common.moe_intermediate_size);
        let artifact = ninfer_engine::open_artifact(&path).unwrap();
        let bank = artifact
            .expert_bank("layers.2.moe.experts")
            .unwrap()
            .clone();
        let tokens = 5;
        let k = 3;
        let x: Vec<f32> = (0..tokens * hidden)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let ids: Vec<u32> = (0..tokens * k)
            .map(|i| ((i * 5 + i / k) % 8) as u32)
            .collect();
        let weights: Vec<f32> = (0..tokens * k)
            .map(|i| 0.1 + (i % 4) as f32 * 0.2)
            .collect();
        let executor = ReferenceExpertExecutor::new(Arc::clone(&artifact));
        let mut out = vec![0.0f32; tokens * hidden];
        executor
            .compute(
                &ExpertBatch {
                    layer: 2,
                    bank: &bank,
                    hidden_size: hidden,
                    intermediate_size: intermediate,
                    hidden: &x,
                    experts_per_token: k,
                    expert_ids: &ids,
                    weights: &weights,
                },
                &mut out,
            )
            .unwrap();
        let silu = |v: f32| v / (1.0 + (-v).exp());
        let mut worst = 0.0f32;
        for t in 0..tokens {
            let mut expected = vec![0.0f32; hidden];
            for j in 0..k {
                let e = ids[t * k + j];
                let gate_up = artifact
                    .tensor(&format!("layers.2.moe.experts.{e}.gate_up"))
                    .unwrap()
                    .to_f32_vec();
                let down = artifact
                    .tensor(&format!("layers.2.moe.experts.{e}.down"))
                    .unwrap()
                    .to_f32_vec();
                let xt = &x[t * hidden..(t + 1) * hidden];
                let row = |r: usize| -> f32 {
                    (0..hidden).map(|c| gate_up[r * hidden + c] * xt[c]).sum()
                };
                let activated: Vec<f32> = (0..intermediate)
                    .map(|i| silu(row(i)) * row(intermediate + i))
                    .collect();
                for (o, value) in expected.iter_mut().enumerate() {
                    let y: f32 = (0..intermediate)
                        .map(|i| down[o * intermediate + i] * activated[i])
                        .sum();
                    *value += weights[t * k + j] * y;
                }
            }
            worst = worst.max(max_abs_difference(
                &expected,
                &out[t * hidden..(t + 1) * hidden],
            ));
        }
        println!("expert executor vs dequantized loop, {dtype}: max |Δ| = {worst:.2e}");
        assert!(worst < 1e-5, "{dtype}: {worst}");
    }
}
