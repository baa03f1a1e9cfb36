//! Normalised model configurations: one type per architecture family, every `transformers`
//! default already resolved by the converter, so no consumer re-interprets `config.json`.

use serde::{Deserialize, Serialize};

/// Architectures the artifact format knows. The engine may support fewer; it refuses the others
/// by name at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    Qwen3Moe,
    Qwen3Next,
    #[serde(rename = "qwen3_5_moe")]
    Qwen35Moe,
    /// Qwen3.5 dense: the qwen3_5_moe layers with a dense SwiGLU MLP in place of every MoE block.
    #[serde(rename = "qwen3_5")]
    Qwen35,
    /// Qwen4-Exp: the qwen3_5_moe layers with hyper-connection residual streams, QSA sparse
    /// attention and per-layer hashed n-gram embeddings (PLE).
    Qwen4Exp,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen3Next => "qwen3_next",
            Architecture::Qwen35Moe => "qwen3_5_moe",
            Architecture::Qwen35 => "qwen3_5",
            Architecture::Qwen4Exp => "qwen4_exp",
        }
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The model config stored in the header, tagged by architecture.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "architecture", content = "config", rename_all = "snake_case")]
pub enum ModelConfig {
    Qwen3Moe(Qwen3MoeConfig),
    Qwen3Next(HybridConfig),
    #[serde(rename = "qwen3_5_moe")]
    Qwen35Moe(HybridConfig),
    /// Every layer dense (`moe_layers` all false, no experts, no shared expert).
    #[serde(rename = "qwen3_5")]
    Qwen35(HybridConfig),
    Qwen4Exp(Qwen4ExpConfig),
}

impl ModelConfig {
    pub fn architecture(&self) -> Architecture {
        match self {
            ModelConfig::Qwen3Moe(_) => Architecture::Qwen3Moe,
            ModelConfig::Qwen3Next(_) => Architecture::Qwen3Next,
            ModelConfig::Qwen35Moe(_) => Architecture::Qwen35Moe,
            ModelConfig::Qwen35(_) => Architecture::Qwen35,
            ModelConfig::Qwen4Exp(_) => Architecture::Qwen4Exp,
        }
    }

    /// Fields every architecture has, for code that does not care which one it is.
    pub fn common(&self) -> &CommonConfig {
        match self {
            ModelConfig::Qwen3Moe(c) => &c.common,
            ModelConfig::Qwen3Next(c) | ModelConfig::Qwen35Moe(c) | ModelConfig::Qwen35(c) => {
                &c.common
            }
            ModelConfig::Qwen4Exp(c) => &c.hybrid.common,
        }
    }

    /// The hybrid (Gated DeltaNet + gated attention) config, for the architectures that have one.
    pub fn hybrid(&self) -> Option<&HybridConfig> {
        match self {
            ModelConfig::Qwen3Moe(_) => None,
            ModelConfig::Qwen3Next(c) | ModelConfig::Qwen35Moe(c) | ModelConfig::Qwen35(c) => {
                Some(c)
            }
            ModelConfig::Qwen4Exp(c) => Some(&c.hybrid),
        }
    }

    /// The Qwen4-Exp extras (hyper-connections, QSA, PLE), for that architecture only.
    pub fn qwen4_exp(&self) -> Option<&Qwen4ExpConfig> {
        match self {
            ModelConfig::Qwen4Exp(c) => Some(c),
            _ => None,
        }
    }

    pub fn hybrid_mut(&mut self) -> Option<&mut HybridConfig> {
        match self {
            ModelConfig::Qwen3Moe(_) => None,
            ModelConfig::Qwen3Next(c) | ModelConfig::Qwen35Moe(c) | ModelConfig::Qwen35(c) => {
                Some(c)
            }
            ModelConfig::Qwen4Exp(c) => Some(&mut c.hybrid),
        }
    }
}

/// Fields shared by all supported decoder architectures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommonConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Number of leading dims of each head that RoPE rotates (`int(head_dim · partial_rotary_factor)`).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    /// Intermediate size of dense-MLP layers (0 when the model has none).
    pub intermediate_size: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Renormalise the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
    /// One entry per layer: true for a routed-MoE layer, false for a dense MLP layer.
    pub moe_layers: Vec<bool>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
}

/// `qwen3_moe`: plain RMSNorm, full RoPE, standard GQA attention on every layer, no shared expert.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3MoeConfig {
    #[serde(flatten)]
    pub common: CommonConfig,
    /// Sliding-window size when `use_sliding_window` is set, else `None`.
    pub sliding_window: Option<usize>,
}

/// Token mixer of one hybrid layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    LinearAttention,
    FullAttention,
}

/// `qwen3_next`, `qwen3_5_moe` and `qwen3_5`: Gated DeltaNet + gated attention, zero-centred
/// norms, then MoE with a sigmoid-gated shared expert (`qwen3_5`: a dense SwiGLU MLP instead). The checkpoint's projection layouts are normalised
/// by the converter (qwen3_next's grouped `in_proj_qkvz` becomes the flat qwen3.5 layout).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HybridConfig {
    #[serde(flatten)]
    pub common: CommonConfig,
    pub layer_types: Vec<LayerType>,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub shared_expert_intermediate_size: usize,
    pub mtp_num_layers: usize,
}

impl HybridConfig {
    /// Channels of the causal conv: `[q ‖ k ‖ v]`.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }
}

/// Activation of the Gated DeltaNet output gate (`output_gate_type`, else `hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputGateActivation {
    Silu,
    Sigmoid,
}

/// `qwen4_exp`: the hybrid layers of qwen3_5_moe (every layer MoE with a shared expert, its
/// attention layers sparse through the QSA indexer) around `hyper_connection_streams` residual
/// streams, plus hashed n-gram embeddings on the PLE layers. `layer_types` says
/// `full_attention` for the QSA layers. There are no input / post-attention / final norms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen4ExpConfig {
    #[serde(flatten)]
    pub hybrid: HybridConfig,
    /// Residual streams `n` (`hc_count`, at least 2).
    pub hyper_connection_streams: usize,
    /// Rank of each stream mixer (`hc_lowrank`).
    pub hyper_connection_rank: usize,
    pub output_gate: OutputGateActivation,
    /// Query heads of the QSA indexer (`indexer_n_heads`); it has one key head.
    pub indexer_heads: usize,
    pub indexer_head_dim: usize,
    /// Tokens a query may attend beyond its tail (`indexer_budget`, a multiple of the ratio).
    pub indexer_budget: usize,
    /// Tokens per pooled key block (`indexer_compress_ratio`).
    pub indexer_compress_ratio: usize,
    /// 0-based indices of the layers with a PLE block (the config's `ple_layer_ids` are 1-based),
    /// ascending; each is a linear-attention layer. Empty: no PLE.
    pub ple_layers: Vec<usize>,
    /// Width of a token's concatenated n-gram embedding (`ple_embed_dim`).
    pub ple_embed_dim: usize,
    pub ple_conv_kernel_size: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub ngram_vocab_size_base: u64,
    /// Each PLE table's row count is padded to a multiple of this
    /// (`make_ngram_vocab_size_divisible_by`).
    pub ngram_table_rows_divisor: u64,
    /// Seed of the n-gram hash multipliers (`seed`).
    pub ngram_seed: u64,
    /// The end-of-sequence id the n-gram contexts stop at (first of `eos_token_id`); required
    /// when there are PLE layers.
    pub ngram_eos_token_id: Option<u32>,
}

impl Qwen4ExpConfig {
    /// Hashed heads of a token's n-gram embedding: `(ngram_size − 1) · heads_per_ngram`.
    pub fn ngram_heads(&self) -> usize {
        self.ngram_size.saturating_sub(1) * self.heads_per_ngram
    }

    /// Width of one n-gram table row (`ple_embed_dim / ngram_heads`).
    pub fn ngram_row_width(&self) -> usize {
        self.ple_embed_dim / self.ngram_heads().max(1)
    }

    /// Rows of PLE layer `ple_layer_index`'s n-gram table: its heads' tables back to back,
    /// padded to a multiple of `ngram_table_rows_divisor`.
    pub fn ngram_table_rows(&self, ple_layer_index: usize) -> u64 {
        let total: u64 = ngram_head_table_sizes(
            self.ngram_vocab_size_base,
            self.ngram_heads(),
            ple_layer_index,
        )
        .iter()
        .sum();
        let divisor = self.ngram_table_rows_divisor.max(1);
        total.div_ceil(divisor) * divisor
    }
}

/// Per hashed head (`heads` of them) of PLE layer `ple_layer_index` (0-based among the PLE
/// layers), its table's row count: the next primes at or above `vocab_size_base`, after the
/// primes the earlier PLE layers' heads took.
pub fn ngram_head_table_sizes(
    vocab_size_base: u64,
    heads: usize,
    ple_layer_index: usize,
) -> Vec<u64> {
    let mut candidate = vocab_size_base.saturating_sub(1);
    let mut next_prime = || {
        candidate += 1;
        while !is_prime(candidate) {
            candidate += 1;
        }
        candidate
    };
    for _ in 0..ple_layer_index * heads {
        next_prime();
    }
    (0..heads).map(|_| next_prime()).collect()
}

/// Trial division, as the reference does (n-gram table sizes are ~2·10⁷, so this is quick).
pub fn is_prime(value: u64) -> bool {
    if value < 2 {
        return false;
    }
    if value % 2 == 0 {
        return value == 2;
    }
    let mut divisor = 3u64;
    while divisor * divisor <= value {
        if value % divisor == 0 {
            return false;
        }
        divisor += 2;
    }
    true
}

/// Generation defaults from `generation_config.json` (and the tokenizer config).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GenerationDefaults {
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub do_sample: Option<bool>,
}
