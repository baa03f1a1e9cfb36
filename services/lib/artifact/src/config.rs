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
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen3Next => "qwen3_next",
            Architecture::Qwen35Moe => "qwen3_5_moe",
            Architecture::Qwen35 => "qwen3_5",
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
}

impl ModelConfig {
    pub fn architecture(&self) -> Architecture {
        match self {
            ModelConfig::Qwen3Moe(_) => Architecture::Qwen3Moe,
            ModelConfig::Qwen3Next(_) => Architecture::Qwen3Next,
            ModelConfig::Qwen35Moe(_) => Architecture::Qwen35Moe,
            ModelConfig::Qwen35(_) => Architecture::Qwen35,
        }
    }

    /// Fields every architecture has, for code that does not care which one it is.
    pub fn common(&self) -> &CommonConfig {
        match self {
            ModelConfig::Qwen3Moe(c) => &c.common,
            ModelConfig::Qwen3Next(c) | ModelConfig::Qwen35Moe(c) | ModelConfig::Qwen35(c) => {
                &c.common
            }
        }
    }

    /// The hybrid (Gated DeltaNet + gated attention) config, for the architectures that have one.
    pub fn hybrid(&self) -> Option<&HybridConfig> {
        match self {
            ModelConfig::Qwen3Moe(_) => None,
            ModelConfig::Qwen3Next(c) | ModelConfig::Qwen35Moe(c) | ModelConfig::Qwen35(c) => {
                Some(c)
            }
        }
    }

    pub fn hybrid_mut(&mut self) -> Option<&mut HybridConfig> {
        match self {
            ModelConfig::Qwen3Moe(_) => None,
            ModelConfig::Qwen3Next(c) | ModelConfig::Qwen35Moe(c) | ModelConfig::Qwen35(c) => {
                Some(c)
            }
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
