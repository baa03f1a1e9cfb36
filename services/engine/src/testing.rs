//! Test support shared by unit and integration tests: the `test_device!` macro (one test body,
//! run once per backend) and tiny random-weight artifacts of every supported architecture.
//!
//! Owns: nothing the engine runs in production; it is public so `tests/` can use it.
//! Must not touch: engine behaviour.

use std::path::Path;

use ninfer_artifact::quant::{f32_to_bf16_bytes, f32_to_bytes, quantize_matrix};
use ninfer_artifact::{
    ArtifactWriter, CommonConfig, DType, GenerationDefaults, HybridConfig, LayerType, ModelConfig,
    QuantizedLayout, Qwen3MoeConfig, SourceInfo, TensorClass, TensorSpec, WriterOptions,
};

use crate::error::EngineError;
use crate::sampling::Xoshiro256;

/// Runs a test body `fn NAME<B: Backend>(backend: Arc<B>)` once per backend, as tests
/// `NAME::cpu` and `NAME::cuda`. The CUDA case runs on GPU 0 (one backend shared by the whole
/// test binary) with `CudaOptions::exact` (f32 KV cache, no cuBLAS): these bodies hold both
/// backends to the same f32 tolerances and to batch invariance; `tests/cuda_*.rs` cover the
/// default options against the CUDA bf16 tolerances. Without a usable GPU it prints that it
/// is skipped and why, and passes, unless
/// `NINFER_REQUIRE_GPU=1` (the GPU test script sets it), where it fails.
#[macro_export]
macro_rules! test_device {
    ($name:ident) => {
        mod $name {
            #[test]
            fn cpu() {
                let backend = ::std::sync::Arc::new($crate::backend::cpu::CpuBackend::new());
                super::$name(backend);
            }

            #[test]
            fn cuda() {
                match $crate::backend::cuda::CudaBackend::shared_exact() {
                    Ok(backend) => super::$name(backend),
                    Err(error) => {
                        if ::std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                            panic!(
                                "NINFER_REQUIRE_GPU=1 but `{}` cannot run on cuda: {error}",
                                stringify!($name)
                            );
                        }
                        println!("skipped `{}` on cuda: {error}", stringify!($name));
                    }
                }
            }
        }
    };
}

/// The golden fixtures (`tests/fixtures/<name>/`, transformers references).
pub const GOLDEN_FIXTURES: [&str; 4] = ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5"];

/// The golden fixtures with routed experts (for tests of where experts are computed; the dense
/// `qwen3_5` has none).
pub const MOE_GOLDEN_FIXTURES: [&str; 3] = ["qwen3_moe", "qwen3_next", "qwen3_5_moe"];

/// The largest `|a[i] − b[i]|` (the slices must be the same length).
pub fn max_abs_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

/// max |got − expected| / max |expected|; NaN counts as infinite.
pub fn relative_difference(got: &[f32], expected: &[f32]) -> f32 {
    let scale = expected.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let worst = max_abs_difference(got, expected);
    if worst.is_nan() || got.iter().any(|v| v.is_nan()) {
        f32::INFINITY
    } else {
        worst / scale
    }
}

/// `count` values uniform in [−scale, scale).
pub fn symmetric_uniform(rng: &mut Xoshiro256, count: usize, scale: f32) -> Vec<f32> {
    (0..count)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// The shared CUDA backend for GPU test `test`, or `None` after saying it is skipped (a panic
/// under `NINFER_REQUIRE_GPU=1`).
pub fn cuda_or_skip(test: &str) -> Option<std::sync::Arc<crate::backend::cuda::CudaBackend>> {
    skip_without_cuda(test, crate::backend::cuda::CudaBackend::shared())
}

/// A CUDA backend of its own with `options` for GPU test `test`, or `None` as
/// [`cuda_or_skip`].
pub fn cuda_with_options_or_skip(
    test: &str,
    options: crate::backend::cuda::CudaOptions,
) -> Option<std::sync::Arc<crate::backend::cuda::CudaBackend>> {
    skip_without_cuda(
        test,
        crate::backend::cuda::CudaBackend::with_options(0, options).map(std::sync::Arc::new),
    )
}

/// `backend` for GPU test `test`, or `None` after saying it is skipped (a panic under
/// `NINFER_REQUIRE_GPU=1`).
pub fn skip_without_cuda<T, E: std::fmt::Display>(test: &str, backend: Result<T, E>) -> Option<T> {
    match backend {
        Ok(backend) => Some(backend),
        Err(error) => {
            if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("NINFER_REQUIRE_GPU=1 but `{test}` cannot run on cuda: {error}");
            }
            println!("skipped `{test}` on cuda: {error}");
            None
        }
    }
}

/// `tests/fixtures/<name>` of this checkout.
pub fn golden_fixture_dir(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The numbers of a JSON array (empty for anything else).
pub fn json_numbers(value: &serde_json::Value) -> Vec<f64> {
    value
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
        .unwrap_or_default()
}

/// Logits after every token of `tokens` (one prefill), one `[vocab]` row per position.
pub fn teacher_forced_logits<B: crate::Backend>(
    model: &crate::Model<B>,
    tokens: &[u32],
) -> Result<Vec<Vec<f32>>, EngineError> {
    let mut state = model.new_sequence(tokens.len())?;
    let mut batch = [crate::SequenceInput {
        state: &mut state,
        tokens,
    }];
    let logits = model
        .forward(&mut batch, crate::LogitsSelection::All)?
        .pop()
        .unwrap_or_default();
    Ok(logits
        .chunks(model.vocab_size().max(1))
        .map(<[f32]>::to_vec)
        .collect())
}

/// NLL of tokens `1..` of `tokens` given their prefixes, from one prefill.
pub fn token_negative_log_likelihoods<B: crate::Backend>(
    model: &crate::Model<B>,
    tokens: &[u32],
) -> Result<Vec<f64>, EngineError> {
    let logits = teacher_forced_logits(model, tokens)?;
    Ok(tokens
        .iter()
        .skip(1)
        .zip(&logits)
        .map(|(&token, row)| crate::perplexity::negative_log_likelihood(row, token))
        .collect())
}

/// The mean of `values` (0 for none).
pub fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// Each position's NLL of the next token, from all positions' logits (`vocab` per row).
pub fn next_token_nll(tokens: &[u32], logits: &[f32], vocab: usize) -> Vec<f64> {
    tokens
        .iter()
        .skip(1)
        .zip(logits.chunks(vocab))
        .map(|(&token, row)| crate::perplexity::negative_log_likelihood(row, token))
        .collect()
}

/// The mean `|a[i] − b[i]|` (the slices must be the same length).
pub fn mean_abs_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>() / a.len().max(1) as f64
}

/// A two-sample χ² test of two samplers' outcome counts (`[first sampler, second]` per
/// outcome, equal run counts): cells with fewer than 10 counts pooled into one. Returns the
/// statistic, the cell count and the 0.1% point of χ² with cells − 1 degrees of freedom
/// (Wilson–Hilferty); the samplers agree when the statistic stays below that bound.
pub fn two_sample_chi_square<'a>(
    counts: impl IntoIterator<Item = &'a [u64; 2]>,
) -> (f64, usize, f64) {
    let (mut statistic, mut cells, mut pooled) = (0.0f64, 0usize, [0u64; 2]);
    let mut add = |counts: [u64; 2]| {
        let expected = (counts[0] + counts[1]) as f64 / 2.0;
        for count in counts {
            statistic += (count as f64 - expected).powi(2) / expected;
        }
        cells += 1;
    };
    for counts in counts {
        if counts[0] + counts[1] >= 10 {
            add(*counts);
        } else {
            pooled[0] += counts[0];
            pooled[1] += counts[1];
        }
    }
    if pooled[0] + pooled[1] > 0 {
        add(pooled);
    }
    let df = cells.saturating_sub(1).max(1) as f64;
    let bound = df * (1.0 - 2.0 / (9.0 * df) + 3.09 * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (statistic, cells, bound)
}

/// `count` greedy tokens after `prompt`: a prefill, then one decode step per token.
pub fn greedy_tokens<B: crate::Backend>(
    model: &crate::Model<B>,
    prompt: &[u32],
    count: usize,
) -> Result<Vec<u32>, EngineError> {
    let state = model.new_sequence(prompt.len() + count)?;
    greedy_tokens_of(model, state, prompt, count)
}

/// [`greedy_tokens`] of a new sequence prepared by the caller (images attached, say).
pub fn greedy_tokens_of<B: crate::Backend>(
    model: &crate::Model<B>,
    mut state: crate::SequenceState<B>,
    prompt: &[u32],
    count: usize,
) -> Result<Vec<u32>, EngineError> {
    let mut logits = model.prefill(&mut state, prompt)?;
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let next = crate::sampling::argmax(&logits);
        out.push(next);
        if out.len() < count {
            logits = model.prefill(&mut state, &[next])?;
        }
    }
    Ok(out)
}

/// A greedy generation request of `max_new_tokens` for the scheduler, its events on `events`.
pub fn greedy_request(
    request_id: String,
    prompt: Vec<u32>,
    max_new_tokens: usize,
    events: tokio::sync::mpsc::Sender<crate::service::scheduler::SchedulerResult>,
) -> crate::service::scheduler::GenerationRequest {
    crate::service::scheduler::GenerationRequest {
        request_id,
        prompt,
        max_new_tokens,
        sampling: crate::SamplingParams::default(),
        stop_token_ids: Vec::new(),
        top_logprobs: 0,
        sampleable_vocabulary: 0,
        logit_bias: Vec::new(),
        guide: None,
        draft_tokens: None,
        images: None,
        events,
    }
}

/// A request's tokens until its finish, and the prompt tokens the prefix cache gave it (from
/// the last event); an error event or a stream without a finish panics.
pub fn collect_tokens(
    receiver: &mut tokio::sync::mpsc::Receiver<crate::service::scheduler::SchedulerResult>,
) -> (Vec<u32>, u32) {
    let mut tokens = Vec::new();
    while let Some(event) = receiver.blocking_recv() {
        let event = event.unwrap_or_else(|e| panic!("{e}"));
        tokens.extend(event.token.map(|t| t.token_id));
        if event.finish.is_some() {
            return (tokens, event.cached_tokens);
        }
    }
    panic!("the stream ended without a finish");
}

/// Why CUDA test cases are skipped in this build.
pub const CUDA_UNAVAILABLE: &str = "this build has no CUDA backend yet (CPU-only)";

/// Which tiny model to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyArchitecture {
    Qwen3Moe,
    Qwen3Next,
    Qwen35Moe,
}

/// Options of a tiny random model.
#[derive(Debug, Clone, Copy)]
pub struct TinyModelOptions {
    pub architecture: TinyArchitecture,
    pub experts_dtype: DType,
    pub dense_dtype: DType,
    pub seed: u64,
}

impl TinyModelOptions {
    pub fn new(architecture: TinyArchitecture) -> Self {
        TinyModelOptions {
            architecture,
            experts_dtype: DType::F32,
            dense_dtype: DType::F32,
            seed: 1,
        }
    }
}

/// Small sizes that still exercise GQA, partial RoPE, head grouping of the delta rule, a dense
/// layer among MoE layers, and quantization groups (every input dim is a multiple of 32).
pub fn tiny_config(architecture: TinyArchitecture) -> ModelConfig {
    let hybrid = architecture != TinyArchitecture::Qwen3Moe;
    let layers = 4;
    let common = CommonConfig {
        vocab_size: 97,
        hidden_size: 64,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        rotary_dim: if hybrid { 8 } else { 32 },
        rope_theta: if hybrid { 10_000_000.0 } else { 1_000_000.0 },
        rms_norm_eps: 1e-6,
        intermediate_size: 96,
        num_experts: 8,
        num_experts_per_tok: 3,
        moe_intermediate_size: 32,
        norm_topk_prob: architecture != TinyArchitecture::Qwen3Moe,
        moe_layers: (0..layers)
            .map(|i| architecture == TinyArchitecture::Qwen35Moe || i != 1)
            .collect(),
        tie_word_embeddings: architecture == TinyArchitecture::Qwen3Next,
        max_position_embeddings: 4096,
    };
    match architecture {
        TinyArchitecture::Qwen3Moe => ModelConfig::Qwen3Moe(Qwen3MoeConfig {
            common,
            sliding_window: None,
        }),
        TinyArchitecture::Qwen3Next | TinyArchitecture::Qwen35Moe => {
            let config = HybridConfig {
                common,
                layer_types: (0..layers)
                    .map(|i| {
                        if (i + 1) % 2 == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect(),
                linear_num_key_heads: 2,
                linear_num_value_heads: 4,
                linear_key_head_dim: 16,
                linear_value_head_dim: 16,
                linear_conv_kernel_dim: 4,
                shared_expert_intermediate_size: 32,
                mtp_num_layers: 0,
            };
            if architecture == TinyArchitecture::Qwen3Next {
                ModelConfig::Qwen3Next(config)
            } else {
                ModelConfig::Qwen35Moe(config)
            }
        }
    }
}

struct RandomWeights {
    rng: Xoshiro256,
}

impl RandomWeights {
    fn uniform(&mut self, count: usize, low: f32, high: f32) -> Vec<f32> {
        (0..count)
            .map(|_| low + (high - low) * self.rng.next_f64() as f32)
            .collect()
    }

    /// `[rows, cols]` with the usual `1/√fan_in` scale.
    fn matrix(&mut self, rows: usize, cols: usize) -> Vec<f32> {
        let bound = 1.0 / (cols as f32).sqrt();
        self.uniform(rows * cols, -bound, bound)
    }
}

fn encode(
    values: &[f32],
    dtype: DType,
    shape: &[u64],
) -> Result<(Vec<u8>, TensorSpecParts), EngineError> {
    let invalid = |problem: String| EngineError::InvalidConfig { problem };
    match dtype {
        DType::F32 => Ok((f32_to_bytes(values), None)),
        DType::Bf16 => Ok((f32_to_bf16_bytes(values), None)),
        DType::Int8 | DType::Int4 => {
            let [rows, cols] = shape else {
                return Err(invalid(format!("{dtype} needs a matrix, shape {shape:?}")));
            };
            let layout =
                QuantizedLayout::new(dtype, *rows as usize, *cols as usize).map_err(invalid)?;
            Ok((quantize_matrix(values, &layout), Some(layout.params())))
        }
    }
}

type TensorSpecParts = Option<ninfer_artifact::QuantizationParams>;

struct TinyWriter {
    writer: ArtifactWriter,
    weights: RandomWeights,
    dense_dtype: DType,
}

impl TinyWriter {
    fn put(
        &mut self,
        name: &str,
        class: TensorClass,
        dtype: DType,
        shape: &[u64],
        values: &[f32],
    ) -> Result<(), EngineError> {
        let (bytes, quantization) = encode(values, dtype, shape)?;
        self.writer.add_tensor(
            TensorSpec {
                name: name.to_string(),
                class,
                dtype,
                shape: shape.to_vec(),
                quantization,
            },
            &bytes,
        )?;
        Ok(())
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<(), EngineError> {
        let values = self.weights.matrix(rows, cols);
        self.put(
            name,
            TensorClass::Dense,
            self.dense_dtype,
            &[rows as u64, cols as u64],
            &values,
        )
    }

    /// A matrix kept f32 whatever the dense dtype, as the converter keeps a router.
    fn f32_matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<(), EngineError> {
        let values = self.weights.matrix(rows, cols);
        self.put(
            name,
            TensorClass::Dense,
            DType::F32,
            &[rows as u64, cols as u64],
            &values,
        )
    }

    /// 1-D parameters are always f32 (docs/FORMAT.md).
    fn vector(&mut self, name: &str, values: &[f32]) -> Result<(), EngineError> {
        self.put(
            name,
            TensorClass::Dense,
            DType::F32,
            &[values.len() as u64],
            values,
        )
    }

    fn norm(&mut self, name: &str, size: usize, zero_centred: bool) -> Result<(), EngineError> {
        let centre = if zero_centred { 0.0 } else { 1.0 };
        let values = self.weights.uniform(size, centre - 0.2, centre + 0.2);
        self.vector(name, &values)
    }
}

/// Writes a tiny random-weight artifact at `path` (embedding and lm_head at the dense dtype).
pub fn write_tiny_model(
    path: &Path,
    options: TinyModelOptions,
) -> Result<ModelConfig, EngineError> {
    let config = tiny_config(options.architecture);
    write_model(path, &config, options)?;
    Ok(config)
}

/// Writes a random-weight artifact of any supported config at `path`.
pub fn write_model(
    path: &Path,
    config: &ModelConfig,
    options: TinyModelOptions,
) -> Result<(), EngineError> {
    let common = config.common().clone();
    let hybrid = config.hybrid().cloned();
    let zero_centred = hybrid.is_some();
    let mut w = TinyWriter {
        writer: ArtifactWriter::create(path, WriterOptions::default())?,
        weights: RandomWeights {
            rng: Xoshiro256::seed_from_u64(options.seed),
        },
        dense_dtype: options.dense_dtype,
    };
    let (h, v) = (common.hidden_size, common.vocab_size);
    let embedding = w.weights.uniform(v * h, -1.0, 1.0);
    w.put(
        "embed_tokens",
        TensorClass::Embedding,
        options.dense_dtype,
        &[v as u64, h as u64],
        &embedding,
    )?;
    if !common.tie_word_embeddings {
        let head = w.weights.matrix(v, h);
        w.put(
            "lm_head",
            TensorClass::Embedding,
            options.dense_dtype,
            &[v as u64, h as u64],
            &head,
        )?;
    }
    w.norm("final_norm", h, zero_centred)?;
    let (nh, nkv, hd) = (
        common.num_attention_heads,
        common.num_key_value_heads,
        common.head_dim,
    );
    for layer in 0..common.num_hidden_layers {
        let p = |s: &str| format!("layers.{layer}.{s}");
        w.norm(&p("input_norm"), h, zero_centred)?;
        w.norm(&p("post_attention_norm"), h, zero_centred)?;
        let linear = hybrid
            .as_ref()
            .is_some_and(|c| c.layer_types[layer] == LayerType::LinearAttention);
        if let (true, Some(c)) = (linear, &hybrid) {
            let key_width = c.linear_num_key_heads * c.linear_key_head_dim;
            let value_width = c.linear_num_value_heads * c.linear_value_head_dim;
            let conv_dim = 2 * key_width + value_width;
            let nv = c.linear_num_value_heads;
            w.matrix(&p("gdn.in_proj_qkv"), conv_dim, h)?;
            w.matrix(&p("gdn.in_proj_z"), value_width, h)?;
            w.matrix(&p("gdn.in_proj_b"), nv, h)?;
            w.matrix(&p("gdn.in_proj_a"), nv, h)?;
            let kernel = c.linear_conv_kernel_dim;
            let taps = w.weights.uniform(conv_dim * kernel, -0.5, 0.5);
            w.put(
                &p("gdn.conv1d"),
                TensorClass::Dense,
                DType::F32,
                &[conv_dim as u64, kernel as u64],
                &taps,
            )?;
            let dt_bias = w.weights.uniform(nv, -0.5, 0.5);
            w.vector(&p("gdn.dt_bias"), &dt_bias)?;
            let a_log: Vec<f32> = w
                .weights
                .uniform(nv, 1.0, 16.0)
                .iter()
                .map(|x| x.ln())
                .collect();
            w.vector(&p("gdn.A_log"), &a_log)?;
            w.norm(&p("gdn.norm"), c.linear_value_head_dim, false)?;
            w.matrix(&p("gdn.out_proj"), h, value_width)?;
        } else {
            let q_rows = if zero_centred { 2 * nh * hd } else { nh * hd };
            w.matrix(&p("attn.q_proj"), q_rows, h)?;
            w.matrix(&p("attn.k_proj"), nkv * hd, h)?;
            w.matrix(&p("attn.v_proj"), nkv * hd, h)?;
            w.matrix(&p("attn.o_proj"), h, nh * hd)?;
            w.norm(&p("attn.q_norm"), hd, zero_centred)?;
            w.norm(&p("attn.k_norm"), hd, zero_centred)?;
        }
        if common.moe_layers[layer] {
            let (e, im) = (common.num_experts, common.moe_intermediate_size);
            // The router stays f32, as `ninfer convert` writes it.
            w.f32_matrix(&p("moe.router"), e, h)?;
            if let Some(c) = &hybrid {
                let is = c.shared_expert_intermediate_size;
                w.matrix(&p("moe.shared_expert.gate_proj"), is, h)?;
                w.matrix(&p("moe.shared_expert.up_proj"), is, h)?;
                w.matrix(&p("moe.shared_expert.down_proj"), h, is)?;
                w.matrix(&p("moe.shared_expert_gate"), 1, h)?;
            }
            let mut experts = Vec::with_capacity(e);
            for _ in 0..e {
                let gate_up = w.weights.matrix(2 * im, h);
                let down = w.weights.matrix(h, im);
                let gate_up = encode(&gate_up, options.experts_dtype, &[2 * im as u64, h as u64])?;
                let down = encode(&down, options.experts_dtype, &[h as u64, im as u64])?;
                experts.push((gate_up, down));
            }
            let prefix = p("moe.experts");
            let (gate_up_bytes, down_bytes) =
                (experts[0].0 .0.len() as u64, experts[0].1 .0.len() as u64);
            w.writer.begin_expert_bank(
                &prefix,
                TensorClass::RoutedExpert,
                options.experts_dtype,
                e as u64,
                gate_up_bytes,
                down_bytes,
            )?;
            for (index, ((gate_up, gate_up_q), (down, down_q))) in experts.into_iter().enumerate() {
                w.writer.add_expert(
                    TensorSpec {
                        name: format!("{prefix}.{index}.gate_up"),
                        class: TensorClass::RoutedExpert,
                        dtype: options.experts_dtype,
                        shape: vec![2 * im as u64, h as u64],
                        quantization: gate_up_q,
                    },
                    &gate_up,
                    TensorSpec {
                        name: format!("{prefix}.{index}.down"),
                        class: TensorClass::RoutedExpert,
                        dtype: options.experts_dtype,
                        shape: vec![h as u64, im as u64],
                        quantization: down_q,
                    },
                    &down,
                )?;
            }
            w.writer.end_expert_bank()?;
        } else {
            let i = common.intermediate_size;
            w.matrix(&p("mlp.gate_proj"), i, h)?;
            w.matrix(&p("mlp.up_proj"), i, h)?;
            w.matrix(&p("mlp.down_proj"), h, i)?;
        }
    }
    w.writer.finish(
        config.clone(),
        GenerationDefaults::default(),
        SourceInfo {
            converter: "ninfer-engine tests".into(),
            model_type: config.architecture().name().into(),
            options: Default::default(),
        },
    )?;
    Ok(())
}

/// The images of an image-prompt reference (`image_prompt_reference.json`: `image_files` under
/// `tests/fixtures/vision_input`, `processor_settings`, `grids`) pre-processed by
/// `ninfer-vision-input`: their grids (checked against the reference's) and patch rows.
pub fn image_prompt_patches(
    reference: &serde_json::Value,
) -> (Vec<crate::vision::ImageGrid>, Vec<f32>) {
    use ninfer_vision_input::{preprocess_image, DecodeLimits, ImageProcessorSettings};
    let settings_json = &reference["processor_settings"];
    let number = |key: &str| settings_json[key].as_u64().expect("whole number");
    let settings = ImageProcessorSettings {
        min_pixels: number("min_pixels"),
        max_pixels: number("max_pixels"),
        patch_size: number("patch_size") as usize,
        temporal_patch_size: number("temporal_patch_size") as usize,
        merge_size: number("merge_size") as usize,
        image_mean: [0.5; 3],
        image_std: [0.5; 3],
    };
    let images = golden_fixture_dir("vision_input");
    let mut grids = Vec::new();
    let mut rows = Vec::new();
    for file in reference["image_files"].as_array().expect("files") {
        let bytes = std::fs::read(images.join(file.as_str().expect("name"))).expect("image");
        let patches = preprocess_image(&bytes, None, &settings, &DecodeLimits::default())
            .expect("pre-processed");
        grids.push(crate::vision::ImageGrid {
            temporal: patches.grid.temporal,
            height: patches.grid.height,
            width: patches.grid.width,
        });
        rows.extend(patches.values);
    }
    let expected: Vec<Vec<usize>> = reference["grids"]
        .as_array()
        .expect("grids")
        .iter()
        .map(|grid| json_numbers(grid).into_iter().map(|v| v as usize).collect())
        .collect();
    let ours: Vec<Vec<usize>> = grids
        .iter()
        .map(|grid| vec![grid.temporal, grid.height, grid.width])
        .collect();
    assert_eq!(ours, expected, "grids");
    (grids, rows)
}

/// A reference's `[[t, h, w], …]` grids.
pub fn json_grids(value: &serde_json::Value) -> Vec<crate::vision::ImageGrid> {
    value
        .as_array()
        .expect("grids")
        .iter()
        .map(|grid| {
            let values = json_numbers(grid);
            crate::vision::ImageGrid {
                temporal: values[0] as usize,
                height: values[1] as usize,
                width: values[2] as usize,
            }
        })
        .collect()
}

/// `vision_reference.json`'s grids and its patch rows (the reference's pixel formula, in f32 as
/// the script computes it).
pub fn vision_reference_inputs(
    reference: &serde_json::Value,
    patch_row_len: usize,
) -> (Vec<crate::vision::ImageGrid>, Vec<f32>) {
    let grids = json_grids(&reference["grids"]);
    let rows: usize = grids.iter().map(crate::vision::ImageGrid::patches).sum();
    let pixels = (0..rows * patch_row_len)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    (grids, pixels)
}

/// The two videos of the video-prompt reference as `transformers` pre-processed them
/// (`video_reference.pixel_values.f32` under `tests/fixtures/vision_input`, `video_grid_thw` of
/// `qwen3_5_moe/video_prompt_reference.json`): each video one grid of its temporal patches
/// (`temporal` > 1), and the patch rows of both, checked against `patch_row_len`.
pub fn video_reference_patches(patch_row_len: usize) -> (Vec<crate::vision::ImageGrid>, Vec<f32>) {
    let reference_path = golden_fixture_dir("qwen3_5_moe").join("video_prompt_reference.json");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(reference_path).expect("readable"))
            .expect("valid JSON");
    let grids = json_grids(&reference["video_grid_thw"]);
    let bytes =
        std::fs::read(golden_fixture_dir("vision_input").join("video_reference.pixel_values.f32"))
            .expect("pixel values");
    let pixels: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let rows: usize = grids.iter().map(crate::vision::ImageGrid::patches).sum();
    assert_eq!(
        pixels.len(),
        rows * patch_row_len,
        "pixel values for the grids"
    );
    (grids, pixels)
}

/// `grids` with each grid of several temporal patches split into that many grids of one.
pub fn one_grid_per_temporal_patch(
    grids: &[crate::vision::ImageGrid],
) -> Vec<crate::vision::ImageGrid> {
    grids
        .iter()
        .flat_map(|grid| {
            std::iter::repeat_n(
                crate::vision::ImageGrid {
                    temporal: 1,
                    ..*grid
                },
                grid.temporal,
            )
        })
        .collect()
}
