//! `ninfer convert --synthetic PRESET`: a random-weight artifact with the exact shapes of a real
//! model, for speed measurements where the real checkpoint cannot be downloaded.
//!
//! Owns: the preset shape table (the one place that knows the released models' dimensions; `bench`
//! may read it), the distributions weights are drawn from, the Zipf and trained routing biases
//! (with the trained fixture's measured popularity table), and the parallel
//! generate → quantize → in-order write pipeline.
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
use std::str::FromStr;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use ninfer_artifact::config::ngram_head_table_sizes;
use ninfer_artifact::{ArtifactWriter, DType, ModelConfig, SourceInfo, TensorSpec, WriterOptions};
use serde_json::{json, Value};

use crate::error::ConvertError;
use crate::hf_config::parse_config;
use crate::plan::{
    build_plan, DTypeChoice, Plan, PlannedBank, PlannedItem, PlannedTensor, SourceNames,
};
use crate::routing_locality::{probit_biases, Locality, TRAINED_CONTEXT_SHARES};
use crate::safetensors_file::Checkpoint;
use crate::synthetic_tokenizer::SyntheticTokenizer;
use crate::{encode_expert, encode_float, expert_spec, ConvertProgress, ConvertReport};

/// The Gated DeltaNet dimensions of a hybrid preset.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttentionShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
    /// Every this-many-th layer is full attention (the others Gated DeltaNet).
    pub full_attention_interval: usize,
}

/// The shapes of one released model, as its `config.json` gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    /// `qwen3_moe`, `qwen3_next`, `qwen3_5_moe` or `qwen3_5` (dense: no experts).
    pub model_type: &'static str,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Dense-MLP width: every layer of a `qwen3_5` preset; only written to `config.json` for
    /// the MoE presets, whose every layer is MoE.
    pub intermediate_size: usize,
    /// 0 for a dense preset (and then `num_experts_per_tok` and `moe_intermediate_size` too).
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// 0 when the model has no shared expert.
    pub shared_expert_intermediate_size: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub max_position_embeddings: usize,
    pub linear: Option<LinearAttentionShape>,
    /// Multi-token-prediction layers the released checkpoint carries (and the artifact keeps).
    pub mtp_layers: usize,
    /// The Qwen4-Exp parts of a `qwen4_exp` preset (streams, QSA indexer, PLE n-gram tables).
    pub qwen4_exp: Option<Qwen4ExpShape>,
}

/// The Qwen4-Exp fields of a `qwen4_exp` preset's `text_config` (MODELS.md §5.1).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen4ExpShape {
    /// Residual streams (`hc_count`) and the rank of their mixers (`hc_lowrank`).
    pub hc_count: usize,
    pub hc_lowrank: usize,
    pub indexer_heads: usize,
    pub indexer_head_dim: usize,
    pub indexer_budget: usize,
    pub indexer_compress_ratio: usize,
    /// 1-based ids of the PLE layers (linear-attention layers); a `--layers N` artifact keeps
    /// those within its first N layers.
    pub ple_layer_ids: &'static [usize],
    pub ple_embed_dim: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub ngram_vocab_size_base: usize,
    pub ngram_rows_divisor: usize,
    /// Row shards of each n-gram table in the checkpoint (`split_ngram_parts`).
    pub split_ngram_parts: usize,
    /// `output_gate_type`: the Gated DeltaNet gated norm's activation.
    pub output_gate_type: &'static str,
    /// The end-of-sequence id the n-gram contexts stop at (the synthetic tokenizer's
    /// `<|endoftext|>`, which every preset's vocabulary holds).
    pub eos_token_id: usize,
}

const QWEN3_NEXT_LINEAR: LinearAttentionShape = LinearAttentionShape {
    key_heads: 16,
    value_heads: 32,
    key_head_dim: 128,
    value_head_dim: 128,
    conv_kernel: 4,
    full_attention_interval: 4,
};

/// The Gated DeltaNet of the dense Qwen3.5/3.6 27B: 48 value heads over 16 key heads.
const QWEN3_5_27B_LINEAR: LinearAttentionShape = LinearAttentionShape {
    key_heads: 16,
    value_heads: 48,
    key_head_dim: 128,
    value_head_dim: 128,
    conv_kernel: 4,
    full_attention_interval: 4,
};

/// Qwen3.8-Flash-Next's Qwen4-Exp parts. Published: four streams of rank 320 (the gguf
/// metadata's `hyper_connection.count` / `low_rank`), a QSA indexer of 4 heads of 128 with a
/// budget of 2048 tokens in blocks of 4, one PLE layer, and an n-gram table of about 51 B
/// parameters (about 95 GiB in bf16), which the transformers defaults give with
/// `ple_embed_dim` = H = 2560: 16 hashed heads of 20 M rows, each row 160 wide. Assumed: the
/// PLE layer is the first (`ple_layer_ids` [1]; the released config was not read), the table is
/// split into transformers' default 512 shards, and the Gated DeltaNet norm gate is the sigmoid
/// the reference implementations name.
const QWEN3_8_FLASH_NEXT_PARTS: Qwen4ExpShape = Qwen4ExpShape {
    hc_count: 4,
    hc_lowrank: 320,
    indexer_heads: 4,
    indexer_head_dim: 128,
    indexer_budget: 2048,
    indexer_compress_ratio: 4,
    ple_layer_ids: &[1],
    ple_embed_dim: 2560,
    ngram_size: 3,
    heads_per_ngram: 8,
    ngram_vocab_size_base: 20_000_000,
    ngram_rows_divisor: 128,
    split_ngram_parts: 512,
    output_gate_type: "sigmoid",
    eos_token_id: 480,
};

/// The Gated DeltaNet of Qwen3.8-Flash-Next: 48 value heads (inner size 6144) over 16 key heads.
const QWEN3_8_FLASH_NEXT_LINEAR: LinearAttentionShape = LinearAttentionShape {
    key_heads: 16,
    value_heads: 48,
    key_head_dim: 128,
    value_head_dim: 128,
    conv_kernel: 4,
    full_attention_interval: 4,
};

/// The presets, with the values of the released checkpoints' `config.json`.
pub const PRESETS: [Preset; 6] = [
    // Qwen/Qwen3-30B-A3B
    Preset {
        name: "qwen3-30b-a3b",
        model_type: "qwen3_moe",
        vocab_size: 151936,
        hidden_size: 2048,
        num_hidden_layers: 48,
        num_attention_heads: 32,
        num_key_value_heads: 4,
        head_dim: 128,
        intermediate_size: 6144,
        num_experts: 128,
        num_experts_per_tok: 8,
        moe_intermediate_size: 768,
        shared_expert_intermediate_size: 0,
        rope_theta: 1e6,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 40960,
        linear: None,
        mtp_layers: 0,
        qwen4_exp: None,
    },
    // Qwen/Qwen3.5-35B-A3B (text model of the multimodal release)
    Preset {
        name: "qwen3.5-35b-a3b",
        model_type: "qwen3_5_moe",
        vocab_size: 248320,
        hidden_size: 2048,
        num_hidden_layers: 40,
        num_attention_heads: 16,
        num_key_value_heads: 2,
        head_dim: 256,
        intermediate_size: 0,
        num_experts: 256,
        num_experts_per_tok: 8,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: 512,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 262144,
        linear: Some(QWEN3_NEXT_LINEAR),
        mtp_layers: 1,
        qwen4_exp: None,
    },
    // Qwen/Qwen3-Next-80B-A3B-Instruct
    Preset {
        name: "qwen3-next-80b-a3b",
        model_type: "qwen3_next",
        vocab_size: 151936,
        hidden_size: 2048,
        num_hidden_layers: 48,
        num_attention_heads: 16,
        num_key_value_heads: 2,
        head_dim: 256,
        intermediate_size: 5120,
        num_experts: 512,
        num_experts_per_tok: 10,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: 512,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 262144,
        linear: Some(QWEN3_NEXT_LINEAR),
        mtp_layers: 1,
        qwen4_exp: None,
    },
    // Qwen/Qwen3-235B-A22B
    Preset {
        name: "qwen3-235b-a22b",
        model_type: "qwen3_moe",
        vocab_size: 151936,
        hidden_size: 4096,
        num_hidden_layers: 94,
        num_attention_heads: 64,
        num_key_value_heads: 4,
        head_dim: 128,
        intermediate_size: 12288,
        num_experts: 128,
        num_experts_per_tok: 8,
        moe_intermediate_size: 1536,
        shared_expert_intermediate_size: 0,
        rope_theta: 1e6,
        partial_rotary_factor: 1.0,
        max_position_embeddings: 40960,
        linear: None,
        mtp_layers: 0,
        qwen4_exp: None,
    },
    // Qwen/Qwen3.6-27B (text model of the multimodal release; Qwen3.5-27B has the same
    // shapes). Every value is the `text_config` of Qwen/Qwen3.6-27B's config.json (revision
    // 6a9e13bd6fc8f0983b9b99948120bc37f49c13e9): hidden 5120, intermediate 17408, 64 layers with
    // full_attention_interval 4, 24 query / 4 key-value heads of 256, linear 16 key / 48 value
    // heads of 128, conv kernel 4, rope_theta 1e7 with partial_rotary_factor 0.25, vocab 248320,
    // max_position_embeddings 262144, untied head, mtp_num_hidden_layers 1. The attention,
    // width, depth, RoPE and vocabulary figures match THUDM/slime's
    // scripts/models/qwen3.5-27B.sh as well.
    Preset {
        name: "qwen3.6-27b",
        model_type: "qwen3_5",
        vocab_size: 248320,
        hidden_size: 5120,
        num_hidden_layers: 64,
        num_attention_heads: 24,
        num_key_value_heads: 4,
        head_dim: 256,
        intermediate_size: 17408,
        num_experts: 0,
        num_experts_per_tok: 0,
        moe_intermediate_size: 0,
        shared_expert_intermediate_size: 0,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 262144,
        linear: Some(QWEN3_5_27B_LINEAR),
        mtp_layers: 1,
        qwen4_exp: None,
    },
    // Qwen/Qwen3.8-Flash-Next (text model; the Qwen4-Exp architecture). Published: 48 decoder
    // layers (full_attention_interval 4) plus one MTP layer, hidden 2560, 24 query / 2 key-value
    // heads of 256 with rotary width 64 (rope_theta 1e7), 512 experts of width 640 with top-10
    // and a shared expert of 640, vocabulary 248320, 262144 positions; about 125 B parameters
    // without the n-gram table, 6 B active. The MTP layer is left out: its layout is not
    // published (MODELS.md §7.3) and the converter skips a checkpoint's `mtp.*` for this
    // architecture. At int4 experts the routed banks take about 68 GB (69 GB with the MTP
    // layer's); the n-gram table is another 102 GB in bf16.
    Preset {
        name: "qwen3.8-flash-next",
        model_type: "qwen4_exp",
        vocab_size: 248320,
        hidden_size: 2560,
        num_hidden_layers: 48,
        num_attention_heads: 24,
        num_key_value_heads: 2,
        head_dim: 256,
        intermediate_size: 0,
        num_experts: 512,
        num_experts_per_tok: 10,
        moe_intermediate_size: 640,
        shared_expert_intermediate_size: 640,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 262144,
        linear: Some(QWEN3_8_FLASH_NEXT_LINEAR),
        mtp_layers: 0,
        qwen4_exp: Some(QWEN3_8_FLASH_NEXT_PARTS),
    },
];

fn preset_names() -> String {
    PRESETS
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The preset called `name`, or an error listing the valid names.
pub fn preset(name: &str) -> Result<Preset, ConvertError> {
    PRESETS
        .iter()
        .find(|p| p.name == name)
        .cloned()
        .ok_or_else(|| ConvertError::InvalidOption {
            option: "--synthetic",
            problem: format!("unknown preset `{name}` (valid: {})", preset_names()),
        })
}

impl FromStr for Preset {
    type Err = ConvertError;
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        preset(name)
    }
}

impl Preset {
    /// The same structure (architecture, layer pattern, MTP, expert count up to 16) at toy
    /// dimensions, so tests can write and run every preset in well under a second.
    pub fn scaled_down(&self) -> Preset {
        let mut small = self.clone();
        small.vocab_size = 1024;
        small.hidden_size = 128;
        small.num_attention_heads = 4;
        small.num_key_value_heads = 2;
        small.head_dim = 32;
        small.intermediate_size = small.intermediate_size.min(256);
        small.num_experts = self.num_experts.min(16);
        small.num_experts_per_tok = self.num_experts_per_tok.min(4);
        small.moe_intermediate_size = if self.num_experts > 0 { 64 } else { 0 };
        if self.shared_expert_intermediate_size > 0 {
            small.shared_expert_intermediate_size = 64;
        }
        if let Some(parts) = &mut small.qwen4_exp {
            parts.hc_lowrank = 16;
            parts.indexer_heads = 2;
            parts.indexer_head_dim = 32;
            parts.indexer_budget = 16;
            // 16 hashed heads of 4: a table of about 8000 rows in 3 shards.
            parts.ple_embed_dim = 64;
            parts.ngram_vocab_size_base = 500;
            parts.ngram_rows_divisor = 64;
            parts.split_ngram_parts = 3;
        }
        if let Some(linear) = &mut small.linear {
            linear.key_heads = 2;
            linear.value_heads = 4;
            linear.key_head_dim = 32;
            linear.value_head_dim = 32;
        }
        small
    }

    fn layer_is_full_attention(&self, layer: usize) -> bool {
        match &self.linear {
            None => true,
            Some(linear) => (layer + 1) % linear.full_attention_interval == 0,
        }
    }

    /// The `config.json` a checkpoint of this model with `layers` decoder layers would carry.
    pub fn config_json(&self, layers: usize) -> Value {
        let mut text = json!({
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": true,
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": false,
            "attention_bias": false,
            "hidden_act": "silu",
        });
        let object = text.as_object_mut();
        let Some(fields) = object else {
            return text;
        };
        match self.model_type {
            "qwen3_moe" => {
                fields.insert("model_type".into(), json!("qwen3_moe"));
                fields.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
                fields.insert("decoder_sparse_step".into(), json!(1));
                fields.insert("mlp_only_layers".into(), json!([]));
                fields.insert("use_sliding_window".into(), json!(false));
                fields.insert("sliding_window".into(), Value::Null);
                text
            }
            _ => {
                if let Some(linear) = &self.linear {
                    for (key, value) in [
                        ("linear_num_key_heads", linear.key_heads),
                        ("linear_num_value_heads", linear.value_heads),
                        ("linear_key_head_dim", linear.key_head_dim),
                        ("linear_value_head_dim", linear.value_head_dim),
                        ("linear_conv_kernel_dim", linear.conv_kernel),
                        ("full_attention_interval", linear.full_attention_interval),
                    ] {
                        fields.insert(key.into(), json!(value));
                    }
                }
                fields.insert(
                    "shared_expert_intermediate_size".into(),
                    json!(self.shared_expert_intermediate_size),
                );
                fields.insert(
                    "partial_rotary_factor".into(),
                    json!(self.partial_rotary_factor),
                );
                if self.model_type == "qwen3_next" {
                    fields.insert("model_type".into(), json!("qwen3_next"));
                    fields.insert("architectures".into(), json!(["Qwen3NextForCausalLM"]));
                    fields.insert("decoder_sparse_step".into(), json!(1));
                    fields.insert("mlp_only_layers".into(), json!([]));
                    return text;
                }
                // qwen3_5(_moe): the multimodal release keeps the text model under `text_config`,
                // with explicit `layer_types` and RoPE inside `rope_parameters`.
                let layer_types: Vec<&str> = (0..layers)
                    .map(|layer| {
                        if self.layer_is_full_attention(layer) {
                            "full_attention"
                        } else {
                            "linear_attention"
                        }
                    })
                    .collect();
                fields.remove("rope_theta");
                fields.remove("partial_rotary_factor");
                if let Some(parts) = &self.qwen4_exp {
                    let ple_layer_ids: Vec<usize> = parts
                        .ple_layer_ids
                        .iter()
                        .copied()
                        .filter(|&id| id <= layers)
                        .collect();
                    for (key, value) in [
                        ("hc_count", json!(parts.hc_count)),
                        ("hc_lowrank", json!(parts.hc_lowrank)),
                        ("indexer_n_heads", json!(parts.indexer_heads)),
                        ("indexer_kv_heads", json!(1)),
                        ("indexer_head_dim", json!(parts.indexer_head_dim)),
                        ("indexer_budget", json!(parts.indexer_budget)),
                        (
                            "indexer_compress_ratio",
                            json!(parts.indexer_compress_ratio),
                        ),
                        ("ple_layer_ids", json!(ple_layer_ids)),
                        ("ple_embed_dim", json!(parts.ple_embed_dim)),
                        ("ple_conv_kernel_size", json!(4)),
                        ("ngram_size", json!(parts.ngram_size)),
                        ("heads_per_ngram", json!(parts.heads_per_ngram)),
                        ("ngram_vocab_size_base", json!(parts.ngram_vocab_size_base)),
                        (
                            "make_ngram_vocab_size_divisible_by",
                            json!(parts.ngram_rows_divisor),
                        ),
                        ("split_ngram_parts", json!(parts.split_ngram_parts)),
                        ("seed", json!(1234)),
                        ("output_gate_type", json!(parts.output_gate_type)),
                        ("eos_token_id", json!(parts.eos_token_id)),
                    ] {
                        fields.insert(key.into(), value);
                    }
                }
                let dense = self.model_type == "qwen3_5";
                if dense {
                    // Qwen3_5TextConfig has no expert fields.
                    for key in [
                        "num_experts",
                        "num_experts_per_tok",
                        "moe_intermediate_size",
                        "norm_topk_prob",
                        "shared_expert_intermediate_size",
                    ] {
                        fields.remove(key);
                    }
                }
                let (text_type, top_type, class) = if dense {
                    ("qwen3_5_text", "qwen3_5", "Qwen3_5ForConditionalGeneration")
                } else if self.qwen4_exp.is_some() {
                    (
                        "qwen4_exp_text",
                        "qwen4_exp",
                        "Qwen4ExpForConditionalGeneration",
                    )
                } else {
                    (
                        "qwen3_5_moe_text",
                        "qwen3_5_moe",
                        "Qwen3_5MoeForConditionalGeneration",
                    )
                };
                fields.insert("model_type".into(), json!(text_type));
                fields.insert("layer_types".into(), json!(layer_types));
                fields.insert("mtp_num_hidden_layers".into(), json!(self.mtp_layers));
                fields.insert(
                    "rope_parameters".into(),
                    json!({
                        "rope_type": "default",
                        "rope_theta": self.rope_theta,
                        "partial_rotary_factor": self.partial_rotary_factor,
                        "mrope_section": [11, 11, 10],
                        "mrope_interleaved": true,
                    }),
                );
                json!({
                    "model_type": top_type,
                    "architectures": [class],
                    "tie_word_embeddings": false,
                    "text_config": text,
                })
            }
        }
    }

    /// The normalised config the converter derives from [`Preset::config_json`].
    pub fn model_config(&self, layers: usize) -> Result<ModelConfig, ConvertError> {
        let file = PathBuf::from(format!("<synthetic {}>/config.json", self.name));
        Ok(parse_config(&file, &self.config_json(layers))?.model)
    }

    /// Checkpoint tensor names and shapes of this model (`model.*`, fused experts, `mtp.*`).
    fn checkpoint_tensors(&self, layers: usize) -> Vec<(String, Vec<u64>)> {
        let u = |values: &[usize]| values.iter().map(|&v| v as u64).collect::<Vec<u64>>();
        let (h, v) = (self.hidden_size, self.vocab_size);
        let mut tensors = vec![
            ("model.embed_tokens.weight".to_string(), u(&[v, h])),
            ("lm_head.weight".to_string(), u(&[v, h])),
        ];
        match &self.qwen4_exp {
            // The final stream mixer takes the final norm's place.
            Some(parts) => {
                let (width, rank) = (parts.hc_count * h, parts.hc_lowrank);
                let mixer = "model.hyper_connection_mixer";
                tensors.push((format!("{mixer}.hc_norm.weight"), u(&[width])));
                tensors.push((
                    format!("{mixer}.input_mix_weight_down.weight"),
                    u(&[rank, width]),
                ));
                tensors.push((
                    format!("{mixer}.input_mix_weight_up.weight"),
                    u(&[width, rank]),
                ));
            }
            None => tensors.push(("model.norm.weight".to_string(), u(&[h]))),
        }
        let mut ple_index = 0;
        for layer in 0..layers {
            let full = self.layer_is_full_attention(layer);
            let prefix = format!("model.layers.{layer}");
            self.layer_tensors(&prefix, full, &mut tensors);
            if let Some(parts) = &self.qwen4_exp {
                let ple = parts.ple_layer_ids.contains(&(layer + 1));
                self.qwen4_exp_layer_tensors(
                    parts,
                    &prefix,
                    ple.then_some(ple_index),
                    &mut tensors,
                );
                ple_index += usize::from(ple);
            }
        }
        if self.mtp_layers > 0 {
            tensors.push(("mtp.fc.weight".into(), u(&[h, 2 * h])));
            for norm in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
                tensors.push((format!("mtp.{norm}.weight"), u(&[h])));
            }
            for layer in 0..self.mtp_layers {
                self.layer_tensors(&format!("mtp.layers.{layer}"), true, &mut tensors);
            }
        }
        tensors
    }

    /// A Qwen4-Exp layer's two hyper-connections and, on a PLE layer (`ple_index`: its
    /// 0-based place among the PLE layers), its PLE block with the n-gram table in
    /// `split_ngram_parts` row shards of `ceil(rows / parts)` rows (as `torch.chunk` saves it).
    fn qwen4_exp_layer_tensors(
        &self,
        parts: &Qwen4ExpShape,
        prefix: &str,
        ple_index: Option<usize>,
        out: &mut Vec<(String, Vec<u64>)>,
    ) {
        let u = |values: &[usize]| values.iter().map(|&v| v as u64).collect::<Vec<u64>>();
        let h = self.hidden_size;
        let (width, rank) = (parts.hc_count * h, parts.hc_lowrank);
        for connection in ["attn_hyper_connection", "mlp_hyper_connection"] {
            let name = |tensor: &str| format!("{prefix}.{connection}.{tensor}.weight");
            out.push((name("hc_norm"), u(&[width])));
            out.push((name("input_mix_weight_down"), u(&[rank, width])));
            out.push((name("input_mix_weight_up"), u(&[width, rank])));
            out.push((name("block_inject_weight"), u(&[parts.hc_count, width])));
        }
        let Some(ple_index) = ple_index else {
            return;
        };
        let ple = |tensor: &str| format!("{prefix}.ple.{tensor}");
        let embed = parts.ple_embed_dim;
        out.push((ple("key_proj.weight"), u(&[width, embed])));
        out.push((ple("value_proj.weight"), u(&[h, embed])));
        for norm in ["norm_key", "norm_query", "norm_conv"] {
            out.push((ple(&format!("{norm}.weight")), u(&[width])));
        }
        out.push((ple("conv1d.weight"), u(&[width, 1, 4])));
        let heads = (parts.ngram_size - 1) * parts.heads_per_ngram;
        let total: u64 =
            ngram_head_table_sizes(parts.ngram_vocab_size_base as u64, heads, ple_index)
                .iter()
                .sum();
        let divisor = parts.ngram_rows_divisor.max(1) as u64;
        let rows = total.div_ceil(divisor) * divisor;
        let shard_rows = rows.div_ceil(parts.split_ngram_parts.max(1) as u64);
        let row_width = (embed / heads.max(1)) as u64;
        let mut first = 0;
        let mut shard = 0;
        while first < rows {
            let count = shard_rows.min(rows - first);
            out.push((
                ple(&format!(
                    "ple_embedding.ngram_embedding.shard_{shard}.weight"
                )),
                vec![count, row_width],
            ));
            first += count;
            shard += 1;
        }
    }

    fn layer_tensors(&self, prefix: &str, full: bool, out: &mut Vec<(String, Vec<u64>)>) {
        let u = |values: &[usize]| values.iter().map(|&v| v as u64).collect::<Vec<u64>>();
        let (h, nh, nkv, hd) = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        );
        let mut add = |name: &str, shape: Vec<u64>| out.push((format!("{prefix}.{name}"), shape));
        // Qwen4-Exp has no layer norms: its hyper-connection norms take their place.
        if self.qwen4_exp.is_none() {
            add("input_layernorm.weight", u(&[h]));
            add("post_attention_layernorm.weight", u(&[h]));
        }
        match (&self.linear, full) {
            (Some(linear), false) => {
                let (nk, nv, dk, dv, kc) = (
                    linear.key_heads,
                    linear.value_heads,
                    linear.key_head_dim,
                    linear.value_head_dim,
                    linear.conv_kernel,
                );
                let conv_dim = 2 * nk * dk + nv * dv;
                if self.model_type == "qwen3_next" {
                    add(
                        "linear_attn.in_proj_qkvz.weight",
                        u(&[2 * nk * dk + 2 * nv * dv, h]),
                    );
                    add("linear_attn.in_proj_ba.weight", u(&[2 * nv, h]));
                } else {
                    add("linear_attn.in_proj_qkv.weight", u(&[conv_dim, h]));
                    add("linear_attn.in_proj_z.weight", u(&[nv * dv, h]));
                    add("linear_attn.in_proj_b.weight", u(&[nv, h]));
                    add("linear_attn.in_proj_a.weight", u(&[nv, h]));
                }
                add("linear_attn.conv1d.weight", u(&[conv_dim, 1, kc]));
                add("linear_attn.dt_bias", u(&[nv]));
                add("linear_attn.A_log", u(&[nv]));
                add("linear_attn.norm.weight", u(&[dv]));
                add("linear_attn.out_proj.weight", u(&[h, nv * dv]));
            }
            _ => {
                let q_rows = if self.linear.is_some() {
                    nh * 2 * hd
                } else {
                    nh * hd
                };
                add("self_attn.q_proj.weight", u(&[q_rows, h]));
                add("self_attn.k_proj.weight", u(&[nkv * hd, h]));
                add("self_attn.v_proj.weight", u(&[nkv * hd, h]));
                add("self_attn.o_proj.weight", u(&[h, nh * hd]));
                add("self_attn.q_norm.weight", u(&[hd]));
                add("self_attn.k_norm.weight", u(&[hd]));
                if let Some(parts) = &self.qwen4_exp {
                    let (heads, width) = (parts.indexer_heads, parts.indexer_head_dim);
                    add(
                        "self_attn.indexer.index_qk_proj.weight",
                        u(&[(heads + 1) * width, h]),
                    );
                    add("self_attn.indexer.q_layernorm.weight", u(&[width]));
                    add("self_attn.indexer.k_layernorm.weight", u(&[width]));
                }
            }
        }
        if self.num_experts == 0 {
            let i = self.intermediate_size;
            add("mlp.gate_proj.weight", u(&[i, h]));
            add("mlp.up_proj.weight", u(&[i, h]));
            add("mlp.down_proj.weight", u(&[h, i]));
            return;
        }
        let (e, im) = (self.num_experts, self.moe_intermediate_size);
        add("mlp.gate.weight", u(&[e, h]));
        add("mlp.experts.gate_up_proj", u(&[e, 2 * im, h]));
        add("mlp.experts.down_proj", u(&[e, h, im]));
        if self.shared_expert_intermediate_size > 0 {
            let is = self.shared_expert_intermediate_size;
            add("mlp.shared_expert.gate_proj.weight", u(&[is, h]));
            add("mlp.shared_expert.up_proj.weight", u(&[is, h]));
            add("mlp.shared_expert.down_proj.weight", u(&[h, is]));
            add("mlp.shared_expert_gate.weight", u(&[1, h]));
        }
    }
}

/// How the router weights are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Expert popularity per layer follows a Zipf law with this exponent (a trained model's skew).
    Zipf { exponent: f64 },
    /// Plain random router weights: every expert about equally popular.
    Uniform,
    /// Expert popularity per layer follows the rank profile measured on the trained fixture
    /// (`tests/fixtures/qwen3_5_moe_trained`, held-out Python code and documentation), stretched
    /// to the preset's expert count and depth.
    Trained,
}

impl Default for Routing {
    fn default() -> Self {
        Routing::Zipf { exponent: 1.0 }
    }
}

impl std::fmt::Display for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Routing::Zipf { exponent } => write!(f, "zipf:{exponent}"),
            Routing::Uniform => f.write_str("uniform"),
            Routing::Trained => f.write_str("trained"),
        }
    }
}

impl FromStr for Routing {
    type Err = ConvertError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = |why: &str| {
            ConvertError::InvalidOption {
            option: "--routing",
            problem: format!(
                "`{text}` {why} (valid: `zipf`, `zipf:S` with an exponent S in (0, 8], `uniform`, `trained`)"
            ),
        }
        };
        match text {
            "uniform" => Ok(Routing::Uniform),
            "trained" => Ok(Routing::Trained),
            "zipf" => Ok(Routing::default()),
            _ => {
                let Some(exponent) = text.strip_prefix("zipf:") else {
                    return Err(invalid("is not a routing mode"));
                };
                match exponent.parse::<f64>() {
                    Ok(s) if s > 0.0 && s <= 8.0 => Ok(Routing::Zipf { exponent: s }),
                    _ => Err(invalid("has no valid exponent")),
                }
            }
        }
    }
}

/// What to generate and where.
#[derive(Debug, Clone)]
pub struct SyntheticOptions {
    pub preset: Preset,
    pub output: PathBuf,
    pub experts_dtype: DType,
    pub dense_dtype: DType,
    /// Decoder layers to keep (the first `N`, so the layer-type pattern is the model's); all when
    /// `None`.
    pub layers: Option<usize>,
    pub routing: Routing,
    pub seed: u64,
    pub max_file_bytes: Option<u64>,
    /// Generator threads (default: the available cores).
    pub threads: Option<usize>,
    /// The tokenizer files and generation defaults the artifact carries; `None`: the fixtures'
    /// small built-in tokenizer.
    pub tokenizer: Option<SyntheticTokenizer>,
    /// The head always ranks `<|im_end|>` first, so every answer ends at once (for tests of
    /// clients that need a finished turn; the model is random either way).
    pub ends_turns: bool,
}

/// Default `--seed`.
pub const DEFAULT_SEED: u64 = 0x6e69_6e66_6572;

impl SyntheticOptions {
    pub fn new(preset: Preset, output: impl Into<PathBuf>) -> Self {
        SyntheticOptions {
            preset,
            output: output.into(),
            experts_dtype: DType::Bf16,
            dense_dtype: DType::Bf16,
            layers: None,
            routing: Routing::default(),
            seed: DEFAULT_SEED,
            max_file_bytes: None,
            threads: None,
            tokenizer: None,
            ends_turns: false,
        }
    }
}

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

/// Deterministic per-tensor random streams and the weight distributions.
struct Drawer {
    seed: u64,
    plain_norms: bool,
    hidden: usize,
    /// From the preset's full depth (not `--layers`), so a truncated model's layers equal the
    /// full model's first layers.
    output_scale: f32,
    /// Unit vector ĉ shared by every embedding row (Zipf and trained routing).
    direction: Option<Vec<f32>>,
    routing: Routing,
    num_experts: usize,
    /// The preset's full depth (the trained profile is stretched over it).
    num_layers: usize,
    experts_per_token: usize,
    /// Trained routing: the hidden layout and layer-0 carrier of the temporal reuse (`None`
    /// for the other modes, or when the shape cannot carry context).
    locality: Option<Locality>,
    /// The `lm_head` row that always wins (`--ends-turns`): it reads the shared direction ĉ,
    /// which every hidden state carries.
    winning_row: Option<usize>,
}

/// How strongly the winning `lm_head` row reads ĉ: its logit is about this times √(H/2), far
/// above the other rows' logits (std about 1).
const WINNING_ROW_WEIGHT: f32 = 4.0;

/// Logit noise of the random router part, as the scale of a Gumbel (see the module doc).
const ROUTER_TEMPERATURE: f64 = 0.55;

impl Drawer {
    fn new(options: &SyntheticOptions, model: &ModelConfig, winning_row: Option<usize>) -> Self {
        let hidden = model.common().hidden_size;
        let unit_vector = |len: usize| {
            let mut rng = Rng::for_name(options.seed, "shared direction");
            let mut c = vec![0.0f32; len];
            rng.fill_uniform(&mut c, 1.0);
            let norm = c.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            c.iter_mut().for_each(|x| *x /= norm);
            c
        };
        // Without routers (a dense model) there is no popularity or reuse to steer.
        let has_routers = model.common().num_experts > 0;
        let locality = match options.routing {
            Routing::Trained if has_routers => Locality::new(model, unit_vector),
            Routing::Trained | Routing::Zipf { .. } | Routing::Uniform => None,
        };
        let direction = match (&options.routing, &locality) {
            // A winning head row needs the shared direction whatever the routing.
            _ if winning_row.is_some() && locality.is_none() => Some(unit_vector(hidden)),
            _ if !has_routers => None,
            (Routing::Uniform, _) => None,
            (_, Some(locality)) => Some(locality.direction().to_vec()),
            (Routing::Zipf { .. } | Routing::Trained, None) => Some(unit_vector(hidden)),
        };
        Drawer {
            seed: options.seed,
            plain_norms: matches!(model, ModelConfig::Qwen3Moe(_)),
            hidden,
            output_scale: 0.5 / (options.preset.num_hidden_layers as f32).sqrt(),
            direction,
            routing: options.routing,
            num_experts: model.common().num_experts,
            num_layers: options.preset.num_hidden_layers,
            experts_per_token: model.common().num_experts_per_tok,
            locality,
            winning_row,
        }
    }

    /// The encoded bytes of one planned tensor, generated row by row (no f32 copy of a large
    /// embedding).
    fn tensor(&self, tensor: &PlannedTensor) -> Vec<u8> {
        let rows = tensor.shape[0] as usize;
        let cols = tensor.shape[1..].iter().product::<u64>().max(1) as usize;
        let name = tensor.name.as_str();
        let mut rng = Rng::for_name(self.seed, name);
        let element = if tensor.dtype == DType::Bf16 { 2 } else { 4 };
        let mut out = Vec::with_capacity(rows * cols * element);
        if tensor.shape.len() == 1 {
            if let Some(values) = self
                .locality
                .as_ref()
                .and_then(|locality| locality.carrier_vector(name, rows))
            {
                return encode_float(&values, tensor.dtype);
            }
            let mut values = vec![0.0f32; rows];
            self.vector(name, &mut rng, &mut values);
            return encode_float(&values, tensor.dtype);
        }
        if let Some(matrix) = self
            .locality
            .as_ref()
            .and_then(|locality| locality.carrier_matrix(name, rows, cols))
        {
            return encode_float(&matrix, tensor.dtype);
        }
        let mut row = vec![0.0f32; cols];
        let router_bias = name
            .ends_with(".moe.router")
            .then(|| self.router_bias(name))
            .flatten();
        let bound = uniform_bound(self.matrix_std(name, cols));
        for r in 0..rows {
            if let (Some(locality), Some(bias), Some(c)) =
                (&self.locality, &router_bias, &self.direction)
            {
                // Trained routing with a carrier: fresh part on the token coordinates, context
                // parts on the carried blocks, popularity along ĉ.
                let shares = context_shares(name, self.num_layers.max(1));
                let fresh = locality.token_coordinates();
                let fresh_std = ((1.0 - shares.0 - shares.1) / fresh as f64).sqrt() as f32;
                row.fill(0.0);
                rng.fill_uniform(&mut row[..fresh], uniform_bound(fresh_std));
                remove_component(&mut row, c);
                locality.add_context_parts(&mut row, shares, |values, bound| {
                    rng.fill_uniform(values, bound)
                });
                row.iter_mut().zip(c).for_each(|(x, c)| *x += bias[r] * c);
                out.extend(encode_float(&row, tensor.dtype));
                continue;
            }
            if let (Some(locality), "embed_tokens", Some(c)) =
                (&self.locality, name, &self.direction)
            {
                // Nothing on the carried blocks: the carrier writes them.
                let fresh = locality.token_coordinates();
                row.fill(0.0);
                rng.fill_uniform(&mut row[..fresh], bound);
                let kappa = (self.hidden as f32).sqrt();
                row.iter_mut().zip(c).for_each(|(x, c)| *x += kappa * c);
                out.extend(encode_float(&row, tensor.dtype));
                continue;
            }
            rng.fill_uniform(&mut row, bound);
            match (name, &self.direction) {
                ("embed_tokens", Some(c)) => {
                    let kappa = (self.hidden as f32).sqrt();
                    row.iter_mut().zip(c).for_each(|(x, c)| *x += kappa * c);
                }
                ("lm_head", Some(c)) => {
                    remove_component(&mut row, c);
                    if self.winning_row == Some(r) {
                        row.iter_mut()
                            .zip(c)
                            .for_each(|(x, c)| *x += WINNING_ROW_WEIGHT * c);
                    }
                }
                _ => {}
            }
            if let (Some(bias), Some(c)) = (&router_bias, &self.direction) {
                remove_component(&mut row, c);
                row.iter_mut().zip(c).for_each(|(x, c)| *x += bias[r] * c);
            }
            out.extend(encode_float(&row, tensor.dtype));
        }
        out
    }

    /// A plain matrix drawn as [`Drawer::tensor`] draws `name` (row by row from its stream).
    fn plain_matrix(&self, name: &str, rows: usize, cols: usize) -> Vec<f32> {
        let mut rng = Rng::for_name(self.seed, name);
        let bound = uniform_bound(self.matrix_std(name, cols));
        let mut values = vec![0.0f32; rows * cols];
        for row in values.chunks_exact_mut(cols.max(1)) {
            rng.fill_uniform(row, bound);
        }
        values
    }

    /// One expert's `[gate; up]` and `down`, encoded in the bank's dtype.
    fn expert(&self, bank: &PlannedBank, index: usize) -> (Vec<u8>, Vec<u8>) {
        let (h, im) = (bank.hidden_size, bank.intermediate_size);
        if bank.class == ninfer_artifact::TensorClass::DenseMlpExpert {
            // The layer's dense MLP itself: the same numbers as its `mlp.*` matrices.
            let mlp = bank.prefix.trim_end_matches(".experts");
            let mut gate_up = self.plain_matrix(&format!("{mlp}.gate_proj"), im, h);
            gate_up.extend(self.plain_matrix(&format!("{mlp}.up_proj"), im, h));
            let down = self.plain_matrix(&format!("{mlp}.down_proj"), h, im);
            return (
                encode_expert(&gate_up, bank.dtype, 2 * im, h),
                encode_expert(&down, bank.dtype, h, im),
            );
        }
        let mut rng = Rng::for_name(self.seed, &format!("{}.{index}", bank.prefix));
        let mut gate_up = vec![0.0f32; 2 * im * h];
        rng.fill_uniform(&mut gate_up, uniform_bound(1.0 / (h as f32).sqrt()));
        let gate_up = encode_expert(&gate_up, bank.dtype, 2 * im, h);
        let mut down = vec![0.0f32; h * im];
        rng.fill_uniform(
            &mut down,
            uniform_bound(self.output_scale / (im as f32).sqrt()),
        );
        let down = encode_expert(&down, bank.dtype, h, im);
        (gate_up, down)
    }

    fn matrix_std(&self, name: &str, fan_in: usize) -> f32 {
        let base = 1.0 / (fan_in as f32).sqrt();
        if name == "embed_tokens" {
            1.0
        } else if name.ends_with("gdn.conv1d") {
            // PyTorch's default conv init, U(±1/√Kc), as a std.
            base / 3f32.sqrt()
        } else if name.ends_with("o_proj")
            || name.ends_with("out_proj")
            || name.ends_with("down_proj")
        {
            self.output_scale * base
        } else {
            base
        }
    }

    /// 1-D tensors: norm weights at identity, GDN decay parameters in Mamba's ranges.
    fn vector(&self, name: &str, rng: &mut Rng, out: &mut [f32]) {
        if name.ends_with("gdn.A_log") {
            // A ~ U(1, 16).
            for x in out.iter_mut() {
                *x = (1.0 + 15.0 * rng.unit()).ln();
            }
        } else if name.ends_with("gdn.dt_bias") {
            // dt log-uniform in [1e-3, 0.1]; dt_bias = softplus⁻¹(dt) = ln(e^dt − 1).
            for x in out.iter_mut() {
                let dt = (1e-3f32.ln() + (0.1f32.ln() - 1e-3f32.ln()) * rng.unit()).exp();
                *x = dt.exp_m1().ln();
            }
        } else if name.ends_with("gdn.norm") || self.plain_norms {
            // The gated GDN norm and qwen3_moe's norms are plain `w`.
            out.fill(1.0);
        } else {
            // Zero-centred `1 + w` norms.
            out.fill(0.0);
        }
    }

    /// Per-expert coefficient α_e along ĉ for one router (Zipf and trained routing).
    fn router_bias(&self, name: &str) -> Option<Vec<f32>> {
        self.direction.as_ref()?;
        let experts = self.num_experts;
        // Popularity rank of each expert: a seeded permutation per layer.
        let mut ranks: Vec<usize> = (0..experts).collect();
        let mut rng = Rng::for_name(self.seed, &format!("{name} popularity"));
        for i in (1..experts).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            ranks.swap(i, j);
        }
        // x·ĉ of a normalised hidden state (κ = √H: half its energy along ĉ).
        let along = (self.hidden as f64 / 2.0).sqrt();
        let by_rank: Vec<f64> = match self.routing {
            Routing::Zipf { exponent } => (0..experts)
                .map(|rank| -exponent * ((rank + 1) as f64).ln())
                .collect(),
            Routing::Trained => {
                let shares: Vec<f64> =
                    trained_log_shares(router_layer(name), self.num_layers.max(1), experts)
                        .iter()
                        .map(|l| l.exp())
                        .collect();
                // The logit noise has variance ½ (a unit-norm row against x with |x|² = H,
                // half of it along ĉ).
                let biases = probit_biases(&shares, self.experts_per_token, 0.5f64.sqrt());
                return Some(
                    ranks
                        .iter()
                        .map(|&rank| (biases[rank] / along) as f32)
                        .collect(),
                );
            }
            Routing::Uniform => return None,
        };
        let log_weights: Vec<f64> = ranks.iter().map(|&rank| by_rank[rank]).collect();
        let mean = log_weights.iter().sum::<f64>() / experts.max(1) as f64;
        Some(
            log_weights
                .iter()
                .map(|w| (ROUTER_TEMPERATURE * (w - mean) / along) as f32)
                .collect(),
        )
    }
}

/// Expert share by popularity rank (most popular first) of each MoE layer of the trained fixture
/// (`tests/fixtures/qwen3_5_moe_trained/reference.json` → `routing.layers[i].share_by_rank`,
/// rounded): 32 experts, top-4, measured over held-out Python code and documentation. One
/// layer per line.
const TRAINED_SHARE_BY_RANK_TEXT: &str = include_str!("trained_share_by_rank.txt");

/// [`TRAINED_SHARE_BY_RANK_TEXT`] as numbers, one row per layer.
fn trained_share_by_rank() -> &'static [Vec<f64>] {
    static TABLE: std::sync::OnceLock<Vec<Vec<f64>>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        TRAINED_SHARE_BY_RANK_TEXT
            .lines()
            .map(|line| {
                line.split_whitespace()
                    .filter_map(|word| word.parse().ok())
                    .collect()
            })
            .filter(|row: &Vec<f64>| !row.is_empty())
            .collect()
    })
}

/// The decoder layer a router tensor belongs to (`layers.{i}.…`; 0 when the name has none).
fn router_layer(name: &str) -> usize {
    name.split('.')
        .skip_while(|part| *part != "layers")
        .nth(1)
        .and_then(|index| index.parse().ok())
        .unwrap_or(0)
}

/// The context shares of a router (`layers.{i}.moe.router`): the trained layer at the same
/// relative depth as for popularity. MTP routers read no context: their input is not a decoder
/// layer's residual stream.
fn context_shares(name: &str, layers: usize) -> (f64, f64) {
    if !name.starts_with("layers.") {
        return (0.0, 0.0);
    }
    let table = &TRAINED_CONTEXT_SHARES;
    table[(router_layer(name) * table.len() / layers).min(table.len() - 1)]
}

/// ln(share) by rank for layer `layer` of `layers` with `experts` experts: the trained layer at
/// the same relative depth, its rank profile resampled at the rank quantiles (r + ½)/E and
/// renormalised, so the shape (share relative to the mean) survives any expert count.
fn trained_log_shares(layer: usize, layers: usize, experts: usize) -> Vec<f64> {
    let table = trained_share_by_rank();
    let trained_layers = table.len();
    let profile = &table[(layer * trained_layers / layers).min(trained_layers - 1)];
    let last = profile.len() - 1;
    let shares: Vec<f64> = (0..experts)
        .map(|rank| {
            let position = ((rank as f64 + 0.5) / experts as f64 * profile.len() as f64 - 0.5)
                .clamp(0.0, last as f64);
            let low = position.floor() as usize;
            let high = (low + 1).min(last);
            let fraction = position - low as f64;
            profile[low] * (1.0 - fraction) + profile[high] * fraction
        })
        .collect();
    let total: f64 = shares.iter().sum();
    shares.iter().map(|s| (s / total).ln()).collect()
}

/// Half-width of a uniform distribution with standard deviation `std`.
fn uniform_bound(std: f32) -> f32 {
    std * 3f32.sqrt()
}

/// `row -= (row·c) c` for a unit vector `c`.
fn remove_component(row: &mut [f32], c: &[f32]) {
    let dot: f32 = row.iter().zip(c).map(|(x, c)| x * c).sum();
    row.iter_mut().zip(c).for_each(|(x, c)| *x -= dot * c);
}

/// xoshiro256++ seeded through splitmix64: fast, and one independent stream per tensor name.
struct Rng([u64; 4]);

impl Rng {
    fn for_name(seed: u64, name: &str) -> Self {
        // FNV-1a of the name, mixed with the seed.
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for byte in name.bytes() {
            hash = (hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let mut state = seed ^ hash.rotate_left(17);
        let mut next = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Fills `out` with U(−bound, bound), two values per 64 random bits.
    fn fill_uniform(&mut self, out: &mut [f32], bound: f32) {
        let scale = 2.0 * bound / (1u32 << 24) as f32;
        let mut pairs = out.chunks_exact_mut(2);
        for pair in &mut pairs {
            let bits = self.next_u64();
            pair[0] = ((bits >> 40) as f32) * scale - bound;
            pair[1] = (((bits >> 8) & 0xff_ffff) as f32) * scale - bound;
        }
        for x in pairs.into_remainder() {
            *x = ((self.next_u64() >> 40) as f32) * scale - bound;
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

    #[test]
    fn trained_share_table_is_the_fixtures_measurement_rounded() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../tests/fixtures/qwen3_5_moe_trained/reference.json"
        );
        let reference: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).expect("reading the trained reference"))
                .expect("parsing the trained reference");
        let layers = reference["routing"]["layers"]
            .as_array()
            .expect("routing layers");
        let table = trained_share_by_rank();
        assert_eq!(table.len(), layers.len());
        for (row, layer) in table.iter().zip(layers) {
            let measured = layer["share_by_rank"].as_array().expect("share_by_rank");
            assert_eq!(row.len(), measured.len());
            for (rounded, exact) in row.iter().zip(measured) {
                let exact = exact.as_f64().expect("a share");
                assert!((rounded - exact).abs() <= 5e-6, "{rounded} vs {exact}");
            }
        }
    }

    #[test]
    fn trained_profile_keeps_its_shape_at_any_expert_count() {
        // How far below uniform the popularity is, ln E − H: the same for any E when the shape
        // (share relative to the mean) is kept.
        let below_uniform = |log_shares: &[f64]| {
            let entropy: f64 = log_shares.iter().map(|l| -l.exp() * l).sum();
            (log_shares.len() as f64).ln() - entropy
        };
        for (layer, profile) in trained_share_by_rank().iter().enumerate() {
            let total: f64 = profile.iter().sum();
            assert!((total - 1.0).abs() < 1e-3, "layer {layer} sums to {total}");
            assert!(
                profile.windows(2).all(|w| w[0] >= w[1]),
                "layer {layer} not by rank"
            );
            // Same count and depth: the measured profile itself.
            let same = trained_log_shares(layer, 8, 32);
            for (l, p) in same.iter().zip(profile) {
                assert!((l.exp() - p / total).abs() < 1e-12);
            }
            // A 256-expert, 40-layer preset: the layer at the same depth, the same shape.
            let stretched = trained_log_shares(layer * 5, 40, 256);
            let (a, b) = (below_uniform(&same), below_uniform(&stretched));
            assert!((a - b).abs() < 0.01, "layer {layer}: ln E − H {a} vs {b}");
            let top_ratio = stretched[0].exp() * 256.0 / (same[0].exp() * 32.0);
            assert!(
                (0.8..=1.05).contains(&top_ratio),
                "layer {layer}: top share ratio {top_ratio}"
            );
        }
        assert_eq!(router_layer("layers.17.moe.router"), 17);
        assert_eq!(router_layer("mtp.layers.0.moe.router"), 0);
    }

    #[test]
    fn uniform_fill_has_the_requested_spread() {
        let mut rng = Rng::for_name(1, "x");
        let mut values = vec![0.0f32; 100_001];
        rng.fill_uniform(&mut values, uniform_bound(0.5));
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        let std =
            (values.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / values.len() as f32).sqrt();
        assert!(
            mean.abs() < 0.01 && (std - 0.5).abs() < 0.01,
            "{mean} {std}"
        );
    }
}
