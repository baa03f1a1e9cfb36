//! What the engine needs to know about a model, derived once from the artifact's normalised
//! config: which architecture, which norm style, which layers are attention / GDN / MoE / dense.
//!
//! Owns: the mapping "architecture → model-graph switches" and the refusal of architectures the
//! engine does not implement.
//! Must not touch: weights, compute.

use ninfer_artifact::{Architecture, CommonConfig, LayerType, ModelConfig};

use crate::backend::{AttentionSpec, DeltaRuleSpec, NormStyle};
use crate::error::EngineError;

/// Architectures this engine implements, by their artifact names.
pub const SUPPORTED_ARCHITECTURES: [&str; 5] = [
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen3_5",
    "qwen4_exp",
];

/// Refuses an architecture name the engine does not implement (the artifact format may know
/// more architectures than this engine runs).
pub fn check_architecture_name(name: &str) -> Result<(), EngineError> {
    if SUPPORTED_ARCHITECTURES.contains(&name) {
        Ok(())
    } else {
        Err(EngineError::UnsupportedArchitecture {
            name: name.to_string(),
        })
    }
}

/// Token mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixerKind {
    Attention,
    GatedDeltaNet,
}

/// Channel mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedForwardKind {
    Dense,
    Moe,
}

/// Everything the model graph switches on.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub architecture: Architecture,
    pub common: CommonConfig,
    pub norm_style: NormStyle,
    /// Gated attention (per-head `[query ‖ gate]` q_proj, `o ⊙ sigmoid(gate)`).
    pub gated_attention: bool,
    pub mixers: Vec<MixerKind>,
    pub feed_forwards: Vec<FeedForwardKind>,
    pub attention: AttentionSpec,
    pub delta_rule: Option<DeltaRuleSpec>,
    pub conv_kernel: usize,
    pub shared_expert_intermediate_size: usize,
    pub normalize_routing: bool,
    /// The qwen4_exp extras (hyper-connections, QSA, PLE); `None` for other architectures.
    pub qwen4_exp: Option<ninfer_artifact::Qwen4ExpConfig>,
}

impl ModelSpec {
    pub fn from_config(config: &ModelConfig) -> Result<Self, EngineError> {
        check_architecture_name(config.architecture().name())?;
        let common = config.common().clone();
        let layers = common.num_hidden_layers;
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        if common.moe_layers.len() != layers {
            return Err(invalid(format!(
                "moe_layers has {} entries for {layers} layers",
                common.moe_layers.len()
            )));
        }
        if common.num_key_value_heads == 0
            || common.num_attention_heads % common.num_key_value_heads != 0
        {
            return Err(invalid(format!(
                "{} attention heads cannot be grouped over {} key/value heads",
                common.num_attention_heads, common.num_key_value_heads
            )));
        }
        if common.rotary_dim > common.head_dim || common.rotary_dim % 2 != 0 {
            return Err(invalid(format!(
                "rotary_dim {} does not fit head_dim {}",
                common.rotary_dim, common.head_dim
            )));
        }
        let feed_forwards = common
            .moe_layers
            .iter()
            .map(|&moe| {
                if moe {
                    FeedForwardKind::Moe
                } else {
                    FeedForwardKind::Dense
                }
            })
            .collect();
        let spec = match config {
            ModelConfig::Qwen3Moe(c) => ModelSpec {
                architecture: Architecture::Qwen3Moe,
                norm_style: NormStyle::Plain,
                gated_attention: false,
                mixers: vec![MixerKind::Attention; layers],
                feed_forwards,
                attention: AttentionSpec {
                    heads: common.num_attention_heads,
                    kv_heads: common.num_key_value_heads,
                    head_dim: common.head_dim,
                    sliding_window: c.sliding_window,
                },
                delta_rule: None,
                conv_kernel: 0,
                shared_expert_intermediate_size: 0,
                normalize_routing: common.norm_topk_prob,
                qwen4_exp: None,
                common,
            },
            ModelConfig::Qwen3Next(c)
            | ModelConfig::Qwen35Moe(c)
            | ModelConfig::Qwen35(c)
            | ModelConfig::Qwen4Exp(ninfer_artifact::Qwen4ExpConfig { hybrid: c, .. }) => {
                if c.layer_types.len() != layers {
                    return Err(invalid(format!(
                        "layer_types has {} entries for {layers} layers",
                        c.layer_types.len()
                    )));
                }
                let delta_rule = DeltaRuleSpec {
                    key_heads: c.linear_num_key_heads,
                    value_heads: c.linear_num_value_heads,
                    key_head_dim: c.linear_key_head_dim,
                    value_head_dim: c.linear_value_head_dim,
                };
                if delta_rule.key_heads == 0 || delta_rule.value_heads % delta_rule.key_heads != 0 {
                    return Err(invalid(format!(
                        "{} linear value heads cannot be grouped over {} key heads",
                        delta_rule.value_heads, delta_rule.key_heads
                    )));
                }
                if c.linear_conv_kernel_dim == 0 {
                    return Err(invalid("linear_conv_kernel_dim is 0".into()));
                }
                // qwen3_5_moe always renormalises (MODELS.md §1.6), whatever the flag says.
                let is_qwen35 = matches!(config, ModelConfig::Qwen35Moe(_));
                ModelSpec {
                    architecture: config.architecture(),
                    norm_style: NormStyle::ZeroCentred,
                    gated_attention: true,
                    mixers: c
                        .layer_types
                        .iter()
                        .map(|t| match t {
                            LayerType::LinearAttention => MixerKind::GatedDeltaNet,
                            LayerType::FullAttention => MixerKind::Attention,
                        })
                        .collect(),
                    feed_forwards,
                    attention: AttentionSpec {
                        heads: common.num_attention_heads,
                        kv_heads: common.num_key_value_heads,
                        head_dim: common.head_dim,
                        sliding_window: None,
                    },
                    delta_rule: Some(delta_rule),
                    conv_kernel: c.linear_conv_kernel_dim,
                    shared_expert_intermediate_size: c.shared_expert_intermediate_size,
                    normalize_routing: is_qwen35 || common.norm_topk_prob,
                    qwen4_exp: config.qwen4_exp().cloned(),
                    common,
                }
            }
        };
        Ok(spec)
    }

    pub fn layers(&self) -> usize {
        self.common.num_hidden_layers
    }

    /// Whether the MoE layers have a sigmoid-gated shared expert (qwen3_5 has no MoE layers).
    pub fn has_shared_expert(&self) -> bool {
        matches!(
            self.architecture,
            Architecture::Qwen3Next | Architecture::Qwen35Moe | Architecture::Qwen4Exp
        )
    }

    /// Whether any layer is MoE (false for an all-dense model: nothing for expert workers or
    /// expert slots).
    pub fn has_moe_layers(&self) -> bool {
        self.feed_forwards.contains(&FeedForwardKind::Moe)
    }

    pub fn eps(&self) -> f32 {
        self.common.rms_norm_eps as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_architectures_pass_and_others_are_named() {
        for name in SUPPORTED_ARCHITECTURES {
            assert!(check_architecture_name(name).is_ok());
        }
        let error = check_architecture_name("qwen5").unwrap_err();
        assert!(error.to_string().contains("qwen5"), "{error}");
    }
}
