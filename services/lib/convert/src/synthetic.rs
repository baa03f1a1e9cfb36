//! `ninfer convert --synthetic PRESET`: a random-weight artifact with the exact shapes of a real
//! model, for speed measurements where the real checkpoint cannot be downloaded.
//!
//! Owns: the parallel generate → quantize → in-order write pipeline of a synthetic model. Its
//! parts: the preset shape table (`synthetic_presets.rs`, the one place that knows the released
//! models' dimensions; `bench` may read it), the options (`synthetic_options.rs`), and the
//! distributions weights are drawn from with the Zipf and trained routing biases
//! (`synthetic_weights.rs`, with the trained fixture's measured popularity table).
//! Must not touch: the artifact's byte layout (it goes through `ninfer-artifact`'s writer) or the
//! tensor names, classes and dtypes: a synthetic model is described as the `config.json` and the
//! tensor list of a real checkpoint and then goes through the same config parser and plan as a
//! real conversion, so the engine cannot tell the difference.
//!
//! Weights (uniform distributions, std in brackets): matrices [1/√fan_in]; output projections
//! (`o_proj`, `out_proj`, `down`) [0.5/√(fan_in · layers)], so the residual stream grows by a
//! bounded amount over the full depth; norm weights at their identity (1 for plain `w`, 0 for
//! zero-centred `1+w`); `A_log` = ln U(1, 16) and `dt_bias` = softplus⁻¹ of a log-uniform
//! dt ∈ [0.001, 0.1] (Mamba's initialisation); conv1d U(±1/√Kc); embeddings [1].
//!
//! Zipf routing: every embedding row carries a shared component κ·ĉ (ĉ a seeded unit vector, κ =
//! √H, as much energy as the random part), so every normalised hidden state has x·ĉ ≈ √(H/2).
//! Router row e = (random row with its ĉ part removed) + α_e·ĉ with α_e·√(H/2) = τ·ln w_e, w_e the
//! Zipf weight of e's popularity rank (a seeded permutation per layer). The random part gives each
//! logit noise of std ≈ 0.7, roughly a Gumbel of scale τ, so the top choice follows w_e. `lm_head`
//! has its ĉ part removed, so the shared component does not bias the output tokens.
//!
//! Trained routing: popularity from the profile that `tests/fixtures/qwen3_5_moe_trained`
//! measured on held-out text (layer at the same relative depth, profile resampled to the
//! preset's expert count so ln E − H, the distance from uniform, is kept), through probit biases
//! along ĉ that fit top-k selection better than τ·ln w. It also reproduces the fixture's
//! temporal reuse (how often a token's experts were picked by the previous 1, 4, 16 tokens):
//! layer 0's mixer writes short and long running averages of the tokens' states into two
//! reserved blocks of the hidden state, and each router reads a share of its logit noise from
//! them. The layout, the carrier weights and the fitted shares are in `routing_locality`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use ninfer_artifact::{ArtifactWriter, DType, ModelConfig, SourceInfo, TensorSpec, WriterOptions};

use crate::error::ConvertError;
use crate::plan::{DTypeChoice, Plan, PlannedBank, PlannedItem, PlannedTensor, SourceNames};
use crate::plan_model::build_plan;
use crate::safetensors_file::Checkpoint;
use crate::synthetic_tokenizer::SyntheticTokenizer;
use crate::synthetic_weights::Drawer;
// The presets are named from here, where a synthetic model is made.
pub use crate::synthetic_options::{Routing, SyntheticOptions, DEFAULT_SEED};
pub use crate::synthetic_presets::{preset, LinearAttentionShape, Preset, Qwen4ExpShape, PRESETS};
use crate::{expert_spec, ConvertProgress, ConvertReport};

/// The model config and conversion plan of a synthetic model (what a real conversion of such a
/// checkpoint would produce), before any weight exists.
pub(crate) fn synthetic_plan(
    options: &SyntheticOptions,
) -> Result<(ModelConfig, Plan), ConvertError> {
    let preset = &options.preset;
    let layers = match options.layers {
        None => preset.num_hidden_layers,
        Some(n) if n >= 1 && n <= preset.num_hidden_layers => n,
        Some(n) => {
            return Err(ConvertError::InvalidOption {
                option: "--layers",
                problem: format!(
                    "{n} is not between 1 and the {} layers of {}",
                    preset.num_hidden_layers, preset.name
                ),
            })
        }
    };
    if !matches!(options.dense_dtype, DType::Bf16 | DType::F32) {
        return Err(ConvertError::InvalidOption {
            option: "--dense-dtype",
            problem: format!("must be bf16 or f32, not {}", options.dense_dtype),
        });
    }
    let mut model = preset.model_config(layers)?;
    let directory = PathBuf::from(format!("<synthetic {}>", preset.name));
    let checkpoint = Checkpoint::shapes_only(&directory, preset.checkpoint_tensors(layers));
    let mut names = SourceNames::new(&checkpoint);
    let plan = build_plan(
        &model,
        &mut names,
        DTypeChoice {
            experts: options.experts_dtype,
            dense: options.dense_dtype,
        },
        false,
    )?;
    if let Some(c) = model.hybrid_mut() {
        c.mtp_num_layers = plan.mtp_layers;
    }
    Ok((model, plan))
}

/// Writes a synthetic artifact. Like [`crate::convert_checkpoint`]: nothing is left behind on
/// error or cancellation, and the result is a function of the options alone (not of `threads`).
pub fn write_synthetic(
    options: &SyntheticOptions,
    progress: &dyn ConvertProgress,
) -> Result<ConvertReport, ConvertError> {
    let (model, plan) = synthetic_plan(options)?;
    let tokenizer = match &options.tokenizer {
        Some(tokenizer) => tokenizer.clone(),
        None => SyntheticTokenizer::built_in()?,
    };
    if tokenizer.token_count > options.preset.vocab_size {
        return Err(ConvertError::InvalidOption {
            option: "--tokenizer",
            problem: format!(
                "the tokenizer has {} tokens, more than the {} rows of {}'s embedding",
                tokenizer.token_count, options.preset.vocab_size, options.preset.name
            ),
        });
    }
    let draw = Drawer::new(
        options,
        &model,
        options
            .ends_turns
            .then_some(tokenizer.end_of_turn_id as usize),
    );

    let mut jobs = Vec::new();
    for item in &plan.items {
        match item {
            PlannedItem::Tensor(tensor) => jobs.push(Job::Tensor(tensor)),
            PlannedItem::Bank(bank) => {
                jobs.extend((0..bank.experts.len()).map(|index| Job::Expert { bank, index }))
            }
        }
    }
    let total_tensors: u64 = jobs
        .iter()
        .map(|job| match job {
            Job::Tensor(_) => 1,
            Job::Expert { .. } => 2,
        })
        .sum();
    progress.start(total_tensors);
    progress.note(&format!(
        "synthetic {} ({} layers, {} routing, seed {}): random weights, real shapes",
        options.preset.name,
        model.common().num_hidden_layers,
        options.routing,
        options.seed
    ));

    let mut writer = ArtifactWriter::create(
        &options.output,
        WriterOptions {
            max_part_bytes: options.max_file_bytes,
        },
    )?;
    writer.add_file("tokenizer.json", &tokenizer.tokenizer_json)?;
    if let Some(config) = &tokenizer.tokenizer_config_json {
        writer.add_file("tokenizer_config.json", config)?;
    }
    if let Some(template) = &tokenizer.chat_template {
        writer.add_file("chat_template.jinja", template.as_bytes())?;
    }

    let threads = options
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(4, |n| n.get()))
        .clamp(1, 64);
    let queue = Queue::new(threads * 2);
    let written = std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| queue.work(&jobs, &draw));
        }
        // Stops the workers on every way out of the write loop, errors included.
        let _stop = StopOnDrop(&queue);
        write_in_order(&mut writer, &plan, &queue, progress)
    })?;

    let bytes = writer.position();
    let mut source_options = BTreeMap::new();
    source_options.insert("experts_dtype".into(), options.experts_dtype.to_string());
    source_options.insert("dense_dtype".into(), options.dense_dtype.to_string());
    source_options.insert("skip_vision".into(), "false".into());
    source_options.insert("synthetic".into(), options.preset.name.to_string());
    source_options.insert("routing".into(), options.routing.to_string());
    source_options.insert("seed".into(), options.seed.to_string());
    let files = writer.finish(
        model.clone(),
        tokenizer.generation.clone(),
        SourceInfo {
            converter: format!("ninfer {}", env!("CARGO_PKG_VERSION")),
            model_type: options.preset.model_type.to_string(),
            options: source_options,
        },
    )?;
    Ok(ConvertReport {
        files,
        architecture: model.architecture().to_string(),
        tensors_written: written,
        tensors_reused: 0,
        bytes,
        notes: plan.notes.clone(),
    })
}

/// The writer side: takes each job's bytes in plan order.
fn write_in_order(
    writer: &mut ArtifactWriter,
    plan: &Plan,
    queue: &Queue,
    progress: &dyn ConvertProgress,
) -> Result<u64, ConvertError> {
    let mut next = 0;
    let mut written = 0;
    for item in &plan.items {
        match item {
            PlannedItem::Tensor(tensor) => {
                let Output::Tensor(bytes) = queue.take(next, progress)? else {
                    return Err(ConvertError::Interrupted);
                };
                next += 1;
                let length = bytes.len() as u64;
                writer.add_tensor(
                    TensorSpec {
                        name: tensor.name.clone(),
                        class: tensor.class,
                        dtype: tensor.dtype,
                        shape: tensor.shape.clone(),
                        quantization: None,
                    },
                    &bytes,
                )?;
                written += 1;
                progress.tensor_written(&tensor.name, length);
            }
            PlannedItem::Bank(bank) => {
                let (h, im) = (bank.hidden_size, bank.intermediate_size);
                let gate_up_shape = [2 * im as u64, h as u64];
                let down_shape = [h as u64, im as u64];
                let sizes = |shape: &[u64]| {
                    expert_spec(bank, 0, "x", shape).and_then(|spec| {
                        ninfer_artifact::writer::expected_tensor_bytes(&spec).map_err(|problem| {
                            ConvertError::Input {
                                file: PathBuf::from(&bank.prefix),
                                problem,
                            }
                        })
                    })
                };
                writer.begin_expert_bank(
                    &bank.prefix,
                    bank.class,
                    bank.dtype,
                    bank.experts.len() as u64,
                    sizes(&gate_up_shape)?,
                    sizes(&down_shape)?,
                )?;
                for index in 0..bank.experts.len() {
                    let Output::Expert(gate_up, down) = queue.take(next, progress)? else {
                        return Err(ConvertError::Interrupted);
                    };
                    next += 1;
                    let length = (gate_up.len() + down.len()) as u64;
                    writer.add_expert(
                        expert_spec(bank, index, "gate_up", &gate_up_shape)?,
                        &gate_up,
                        expert_spec(bank, index, "down", &down_shape)?,
                        &down,
                    )?;
                    written += 2;
                    progress.tensor_written(&bank.prefix, length);
                }
                writer.end_expert_bank()?;
            }
        }
    }
    Ok(written)
}

/// One unit of generation: a whole tensor, or one expert's two matrices.
enum Job<'p> {
    Tensor(&'p PlannedTensor),
    Expert { bank: &'p PlannedBank, index: usize },
}

enum Output {
    Tensor(Vec<u8>),
    Expert(Vec<u8>, Vec<u8>),
}

/// Jobs are handed out in plan order, at most `window` ahead of the writer, so memory stays at
/// a few tensors however far generation outruns the disk.
struct Queue {
    state: Mutex<QueueState>,
    changed: Condvar,
    window: usize,
}

struct QueueState {
    next_job: usize,
    next_write: usize,
    done: BTreeMap<usize, Output>,
    stop: bool,
    failed: bool,
}

struct StopOnDrop<'q>(&'q Queue);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        if let Ok(mut state) = self.0.state.lock() {
            state.stop = true;
        }
        self.0.changed.notify_all();
    }
}

impl Queue {
    fn new(window: usize) -> Self {
        Queue {
            state: Mutex::new(QueueState {
                next_job: 0,
                next_write: 0,
                done: BTreeMap::new(),
                stop: false,
                failed: false,
            }),
            changed: Condvar::new(),
            window,
        }
    }

    fn work(&self, jobs: &[Job], draw: &Drawer) {
        loop {
            let index = {
                let Ok(mut state) = self.state.lock() else {
                    return;
                };
                loop {
                    if state.stop || state.next_job >= jobs.len() {
                        return;
                    }
                    if state.next_job < state.next_write + self.window {
                        break;
                    }
                    state = match self.changed.wait(state) {
                        Ok(state) => state,
                        Err(_) => return,
                    };
                }
                state.next_job += 1;
                state.next_job - 1
            };
            // A panicking generator must fail the run, not leave the writer waiting forever.
            let output =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &jobs[index] {
                    Job::Tensor(tensor) => Output::Tensor(draw.tensor(tensor)),
                    Job::Expert { bank, index } => {
                        let (gate_up, down) = draw.expert(bank, *index);
                        Output::Expert(gate_up, down)
                    }
                }));
            let Ok(mut state) = self.state.lock() else {
                return;
            };
            match output {
                Ok(output) => {
                    state.done.insert(index, output);
                }
                Err(_) => {
                    state.failed = true;
                    state.stop = true;
                }
            }
            drop(state);
            self.changed.notify_all();
        }
    }

    /// Job `index`'s output, polling `progress` for cancellation while waiting.
    fn take(&self, index: usize, progress: &dyn ConvertProgress) -> Result<Output, ConvertError> {
        let poisoned = || ConvertError::Input {
            file: PathBuf::from("<synthetic>"),
            problem: "a generator thread panicked".into(),
        };
        let mut state = self.state.lock().map_err(|_| poisoned())?;
        loop {
            if progress.cancelled() {
                return Err(ConvertError::Interrupted);
            }
            if state.failed {
                return Err(poisoned());
            }
            if let Some(output) = state.done.remove(&index) {
                state.next_write = index + 1;
                drop(state);
                self.changed.notify_all();
                return Ok(output);
            }
            state = self
                .changed
                .wait_timeout(state, Duration::from_millis(100))
                .map_err(|_| poisoned())?
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ninfer_artifact::LayerType;

    /// Parameters of the whole preset: all, the MTP layer's, the n-gram tables'.
    fn parameters(preset: &Preset) -> (u64, u64, u64) {
        let options = SyntheticOptions::new(preset.clone(), "unused.ninfer");
        let (_, plan) = synthetic_plan(&options).unwrap();
        let (mut total, mut mtp, mut ngram) = (0, 0, 0);
        for item in &plan.items {
            let (count, class) = match item {
                PlannedItem::Tensor(t) => (t.shape.iter().product::<u64>(), t.class),
                PlannedItem::Bank(b) => (
                    (3 * b.hidden_size * b.intermediate_size * b.experts.len()) as u64,
                    b.class,
                ),
            };
            // A dense MLP's one-expert bank is a second copy of its matrices.
            if class == ninfer_artifact::TensorClass::DenseMlpExpert {
                continue;
            }
            total += count;
            match class {
                ninfer_artifact::TensorClass::Mtp => mtp += count,
                ninfer_artifact::TensorClass::NgramEmbedding => ngram += count,
                _ => {}
            }
        }
        (total, mtp, ngram)
    }

    /// Parameter counts are the released models' (to the published precision), which checks
    /// every shape at once; MTP weights are extra in the released checkpoints' totals, and so
    /// is Qwen3.8-Flash-Next's n-gram table (published as about 51 B besides its 125 B).
    #[test]
    fn presets_have_the_released_parameter_counts() {
        let expected = [
            ("qwen3-30b-a3b", 30.5e9, 0.0),
            ("qwen3.5-35b-a3b", 35.0e9, 0.0),
            ("qwen3-next-80b-a3b", 80.0e9, 0.0),
            ("qwen3-235b-a22b", 235.1e9, 0.0),
            // The 27B of the name counts the vision tower (about 0.4 B) as well.
            ("qwen3.6-27b", 26.9e9, 0.0),
            ("qwen3.8-flash-next", 125.0e9, 51.0e9),
        ];
        for (name, billions, ngram_billions) in expected {
            let (total, mtp, ngram) = parameters(&preset(name).unwrap());
            let main = (total - mtp - ngram) as f64;
            println!(
                "{name}: {:.2} B parameters without MTP and n-gram tables, {:.2} B MTP, {:.2} B n-gram",
                main / 1e9,
                mtp as f64 / 1e9,
                ngram as f64 / 1e9
            );
            assert!(
                (main / billions - 1.0).abs() < 0.02,
                "{name}: {main} parameters, expected about {billions}"
            );
            let ngram = ngram as f64;
            assert!(
                (ngram - ngram_billions).abs() <= 0.02 * ngram_billions,
                "{name}: {ngram} n-gram parameters, expected about {ngram_billions}"
            );
        }
    }

    /// Qwen3.8-Flash-Next at int4 experts: the routed banks are about 68 GB (69 GB with the
    /// released MTP layer's bank, which the preset leaves out), the n-gram table 102 GB in bf16,
    /// stored where the converter stores a checkpoint's: one `ngram_embedding` tensor per shard.
    #[test]
    fn qwen3_8_flash_next_sizes_and_table_layout() {
        let mut options =
            SyntheticOptions::new(preset("qwen3.8-flash-next").unwrap(), "unused.ninfer");
        options.experts_dtype = DType::Int4;
        let (model, plan) = synthetic_plan(&options).unwrap();
        let qwen4 = model.qwen4_exp().expect("a qwen4_exp config");
        assert_eq!(qwen4.ple_layers, vec![0]);
        assert_eq!(
            (qwen4.hyper_connection_streams, qwen4.hyper_connection_rank),
            (4, 320)
        );
        assert_eq!(qwen4.ngram_row_width(), 160);
        let mut bank_bytes = 0u64;
        let mut table_rows = 0u64;
        let mut shards = 0;
        for item in &plan.items {
            match item {
                PlannedItem::Bank(bank) => {
                    let spec = |rows: usize, cols: usize| {
                        crate::expert_spec(bank, 0, "x", &[rows as u64, cols as u64]).unwrap()
                    };
                    let (h, im) = (bank.hidden_size, bank.intermediate_size);
                    let expert = ninfer_artifact::writer::expected_tensor_bytes(&spec(2 * im, h))
                        .unwrap()
                        + ninfer_artifact::writer::expected_tensor_bytes(&spec(h, im)).unwrap();
                    bank_bytes += expert * bank.experts.len() as u64;
                }
                PlannedItem::Tensor(t)
                    if t.class == ninfer_artifact::TensorClass::NgramEmbedding =>
                {
                    assert_eq!(
                        t.name,
                        format!("layers.0.ple.ngram_embedding.shard_{shards}")
                    );
                    assert_eq!(t.shape[1], 160);
                    table_rows += t.shape[0];
                    shards += 1;
                }
                PlannedItem::Tensor(_) => {}
            }
        }
        let gb = bank_bytes as f64 / 1e9;
        println!("routed experts at int4: {gb:.1} GB");
        assert!((66.0..70.0).contains(&gb), "{gb} GB of routed experts");
        assert_eq!(shards, 512);
        assert_eq!(table_rows, qwen4.ngram_table_rows(0));
        // The transformers reference value of the first PLE layer's padded table.
        assert_eq!(table_rows, 320_001_536);
        // A truncated model keeps the PLE layer only when it is among its layers.
        assert_eq!(
            preset("qwen3.8-flash-next")
                .unwrap()
                .model_config(2)
                .unwrap()
                .qwen4_exp()
                .map(|c| c.ple_layers.clone()),
            Some(vec![0])
        );
    }

    #[test]
    fn preset_configs_are_the_real_ones() {
        let config = preset("qwen3-30b-a3b").unwrap().model_config(48).unwrap();
        let ModelConfig::Qwen3Moe(c) = &config else {
            panic!("{config:?}")
        };
        let common = &c.common;
        assert_eq!(
            (
                common.hidden_size,
                common.num_hidden_layers,
                common.num_attention_heads
            ),
            (2048, 48, 32)
        );
        assert_eq!(
            (
                common.num_key_value_heads,
                common.head_dim,
                common.rotary_dim
            ),
            (4, 128, 128)
        );
        assert_eq!((common.num_experts, common.num_experts_per_tok), (128, 8));
        assert_eq!(
            (common.moe_intermediate_size, common.vocab_size),
            (768, 151936)
        );
        assert_eq!(common.rope_theta, 1e6);
        assert!(common.norm_topk_prob && !common.tie_word_embeddings);
        assert!(common.moe_layers.iter().all(|&m| m));
        assert_eq!(c.sliding_window, None);

        for (name, architecture, experts, top_k, vocab, layers) in [
            ("qwen3-next-80b-a3b", "qwen3_next", 512, 10, 151936, 48),
            ("qwen3.5-35b-a3b", "qwen3_5_moe", 256, 8, 248320, 40),
        ] {
            let config = preset(name).unwrap().model_config(layers).unwrap();
            assert_eq!(config.architecture().name(), architecture);
            let (ModelConfig::Qwen3Next(c) | ModelConfig::Qwen35Moe(c)) = &config else {
                panic!("{config:?}")
            };
            let common = &c.common;
            assert_eq!(
                (common.hidden_size, common.num_hidden_layers),
                (2048, layers)
            );
            assert_eq!(
                (common.num_attention_heads, common.num_key_value_heads),
                (16, 2)
            );
            assert_eq!((common.head_dim, common.rotary_dim), (256, 64));
            assert_eq!(
                (common.num_experts, common.num_experts_per_tok),
                (experts, top_k)
            );
            assert_eq!(
                (common.moe_intermediate_size, common.vocab_size),
                (512, vocab)
            );
            assert_eq!(common.rope_theta, 1e7);
            assert!(common.norm_topk_prob && !common.tie_word_embeddings);
            assert_eq!((c.linear_num_key_heads, c.linear_num_value_heads), (16, 32));
            assert_eq!((c.linear_key_head_dim, c.linear_value_head_dim), (128, 128));
            assert_eq!(
                (c.linear_conv_kernel_dim, c.shared_expert_intermediate_size),
                (4, 512)
            );
            for (layer, kind) in c.layer_types.iter().enumerate() {
                let full = (layer + 1) % 4 == 0;
                assert_eq!(
                    *kind == LayerType::FullAttention,
                    full,
                    "{name} layer {layer}"
                );
            }
        }
    }

    #[test]
    fn the_dense_preset_is_the_released_qwen3_6_27b() {
        let config = preset("qwen3.6-27b").unwrap().model_config(64).unwrap();
        let ModelConfig::Qwen35(c) = &config else {
            panic!("{config:?}")
        };
        let common = &c.common;
        assert_eq!(
            (
                common.hidden_size,
                common.intermediate_size,
                common.num_hidden_layers
            ),
            (5120, 17408, 64)
        );
        assert_eq!(
            (
                common.num_attention_heads,
                common.num_key_value_heads,
                common.head_dim,
                common.rotary_dim
            ),
            (24, 4, 256, 64)
        );
        assert_eq!((common.vocab_size, common.rope_theta), (248320, 1e7));
        assert_eq!(
            (
                common.num_experts,
                common.num_experts_per_tok,
                c.shared_expert_intermediate_size
            ),
            (0, 0, 0)
        );
        assert!(common.moe_layers.iter().all(|&moe| !moe));
        assert_eq!((c.linear_num_key_heads, c.linear_num_value_heads), (16, 48));
        assert_eq!((c.linear_key_head_dim, c.linear_value_head_dim), (128, 128));
        let full: Vec<usize> = (0..64)
            .filter(|&l| c.layer_types[l] == LayerType::FullAttention)
            .collect();
        assert_eq!(full, (0..16).map(|i| 4 * i + 3).collect::<Vec<_>>());
        // The plan: dense MLPs of their own class, each also as a bank of one expert in the
        // dense dtype (for the CPU workers), a dense MTP layer.
        let options = SyntheticOptions::new(preset("qwen3.6-27b").unwrap(), "unused.ninfer");
        let (model, plan) = synthetic_plan(&options).unwrap();
        assert_eq!(model.hybrid().map(|h| h.mtp_num_layers), Some(1));
        let banks: Vec<&PlannedBank> = plan
            .items
            .iter()
            .filter_map(|item| match item {
                PlannedItem::Bank(bank) => Some(bank),
                PlannedItem::Tensor(_) => None,
            })
            .collect();
        assert_eq!(banks.len(), 64);
        for (layer, bank) in banks.iter().enumerate() {
            assert_eq!(bank.prefix, format!("layers.{layer}.mlp.experts"));
            assert_eq!(bank.class, ninfer_artifact::TensorClass::DenseMlpExpert);
            assert_eq!(
                (bank.experts.len(), bank.intermediate_size, bank.dtype),
                (1, 17408, DType::Bf16)
            );
        }
        let dense_mlp = plan
            .items
            .iter()
            .filter(|item| {
                matches!(item, PlannedItem::Tensor(t) if t.class == ninfer_artifact::TensorClass::DenseMlp)
            })
            .count();
        assert_eq!(dense_mlp, 3 * 64);
        assert!(plan.items.iter().any(
            |item| matches!(item, PlannedItem::Tensor(t) if t.name == "mtp.layers.0.mlp.down_proj")
        ));
    }

    #[test]
    fn bad_preset_and_routing_name_the_value_and_the_valid_ones() {
        let message = preset("qwen9").unwrap_err().to_string();
        assert!(
            message.contains("`qwen9`") && message.contains("qwen3-235b-a22b"),
            "{message}"
        );
        for bad in ["zipfian", "zipf:", "zipf:-1", "zipf:abc", ""] {
            let message = bad.parse::<Routing>().unwrap_err().to_string();
            assert!(
                message.contains(&format!("`{bad}`")) && message.contains("uniform"),
                "{message}"
            );
        }
        assert_eq!(
            "zipf:1.5".parse::<Routing>().unwrap(),
            Routing::Zipf { exponent: 1.5 }
        );
        assert_eq!("uniform".parse::<Routing>().unwrap(), Routing::Uniform);
        assert_eq!("trained".parse::<Routing>().unwrap(), Routing::Trained);
        assert_eq!(Routing::Trained.to_string(), "trained");
        let mut options = SyntheticOptions::new(preset("qwen3-30b-a3b").unwrap(), "x.ninfer");
        options.layers = Some(49);
        let message = synthetic_plan(&options).unwrap_err().to_string();
        assert!(
            message.contains("--layers") && message.contains("49"),
            "{message}"
        );
    }

    /// Generation speed at full size (qwen3-30b-a3b, 2 layers, int8 experts, ~2.6 GB written):
    /// `cargo test --release -p ninfer-convert --lib full_size -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn full_size_generation_speed() {
        let directory =
            std::env::temp_dir().join(format!("ninfer-synthetic-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("qwen3-30b-a3b-2layers.ninfer");
        let mut options = SyntheticOptions::new(preset("qwen3-30b-a3b").unwrap(), &path);
        options.layers = Some(2);
        options.experts_dtype = DType::Int8;
        let started = std::time::Instant::now();
        let report = write_synthetic(&options, &crate::NoProgress).unwrap();
        let seconds = started.elapsed().as_secs_f64();
        let gb = report.bytes as f64 / 1e9;
        println!(
            "{gb:.2} GB in {seconds:.1} s with {} threads: {:.1} s/GB",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            seconds / gb
        );
        std::fs::remove_dir_all(&directory).unwrap();
    }
}
