//! The synthetic presets: the shapes of released models (the one place that knows their
//! dimensions; `bench` may read it), and each preset's `config.json` and tensor list as the
//! real checkpoint has them.
//!
//! Owns: the preset table and what a preset says about its model. Must not touch: the weights'
//! values (`synthetic_weights.rs`), writing (`synthetic.rs`).

use std::path::PathBuf;
use std::str::FromStr;

use ninfer_artifact::config::ngram_head_table_sizes;
use ninfer_artifact::ModelConfig;
use serde_json::{json, Value};

use crate::error::ConvertError;
use crate::hf_config::parse_config;

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

    pub(crate) fn layer_is_full_attention(&self, layer: usize) -> bool {
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
    pub(crate) fn checkpoint_tensors(&self, layers: usize) -> Vec<(String, Vec<u64>)> {
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
    pub(crate) fn qwen4_exp_layer_tensors(
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

    pub(crate) fn layer_tensors(
        &self,
        prefix: &str,
        full: bool,
        out: &mut Vec<(String, Vec<u64>)>,
    ) {
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
