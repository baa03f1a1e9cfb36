//! `config.json` → the artifact's normalised config, resolving every default the way
//! `transformers` 5.17 does (`docs/MODELS.md`, each architecture's configuration).

use std::path::Path;

use ninfer_artifact::{
    CommonConfig, HybridConfig, LayerType, ModelConfig, OutputGateActivation, Qwen3MoeConfig,
    Qwen4ExpConfig,
};
use serde_json::{Map, Value};

use crate::error::ConvertError;

/// The parsed config plus facts about the checkpoint layout that the converter needs.
#[derive(Debug, Clone)]
pub struct ParsedConfig {
    pub model: ModelConfig,
    /// `model_type` as written in `config.json`.
    pub model_type: String,
}

struct Fields<'a> {
    file: &'a Path,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn error(&self, field: &str, problem: impl Into<String>) -> ConvertError {
        ConvertError::ConfigField {
            file: self.file.to_path_buf(),
            field: field.to_string(),
            problem: problem.into(),
        }
    }

    fn usize_or(&self, field: &str, default: usize) -> Result<usize, ConvertError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(value) => value.as_u64().map(|v| v as usize).ok_or_else(|| {
                self.error(
                    field,
                    format!("expected a non-negative integer, found {value}"),
                )
            }),
        }
    }

    fn positive_or(&self, field: &str, default: usize) -> Result<usize, ConvertError> {
        let value = self.usize_or(field, default)?;
        if value == 0 {
            return Err(self.error(field, "must be greater than 0"));
        }
        Ok(value)
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64, ConvertError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(value) => value
                .as_f64()
                .ok_or_else(|| self.error(field, format!("expected a number, found {value}"))),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool, ConvertError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(value) => value
                .as_bool()
                .ok_or_else(|| self.error(field, format!("expected true or false, found {value}"))),
        }
    }

    fn usize_list(&self, field: &str) -> Result<Vec<usize>, ConvertError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    item.as_u64().map(|v| v as usize).ok_or_else(|| {
                        self.error(field, format!("expected integers, found {item}"))
                    })
                })
                .collect(),
            Some(other) => Err(self.error(field, format!("expected a list, found {other}"))),
        }
    }

    /// `rope_theta` and `partial_rotary_factor`: `rope_parameters` wins, then the top-level key.
    fn rope(&self, default_partial: f64) -> Result<(f64, f64), ConvertError> {
        let parameters = self
            .map
            .get("rope_parameters")
            .or_else(|| self.map.get("rope_scaling"));
        let inner = parameters.and_then(|p| p.as_object());
        if let Some(kind) = inner
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(|t| t.as_str())
        {
            if kind != "default" {
                return Err(self.error(
                    "rope_parameters.rope_type",
                    format!("`{kind}` RoPE is not supported yet (only `default`)"),
                ));
            }
        }
        let from_inner = |key: &str| inner.and_then(|p| p.get(key)).and_then(|v| v.as_f64());
        let theta = match from_inner("rope_theta") {
            Some(theta) => theta,
            None => self.f64_or("rope_theta", 10000.0)?,
        };
        let partial = match from_inner("partial_rotary_factor") {
            Some(partial) => partial,
            None => self.f64_or("partial_rotary_factor", default_partial)?,
        };
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(self.error(
                "partial_rotary_factor",
                format!("must be in (0, 1], found {partial}"),
            ));
        }
        Ok((theta, partial))
    }

    /// MoE-vs-dense per layer (`docs/MODELS.md`, Qwen3-MoE): MoE iff not in `mlp_only_layers`, experts > 0 and
    /// `(i+1) % decoder_sparse_step == 0`.
    fn moe_layers(&self, layers: usize, experts: usize) -> Result<Vec<bool>, ConvertError> {
        let mlp_only = self.usize_list("mlp_only_layers")?;
        let step = self.positive_or("decoder_sparse_step", 1)?;
        Ok((0..layers)
            .map(|i| !mlp_only.contains(&i) && experts > 0 && (i + 1) % step == 0)
            .collect())
    }

    /// `layer_types`, derived with `full_attention_interval` (default 4) when absent; legacy
    /// names are remapped as `remap_legacy_layer_types` does. With `sparse_attention`
    /// (qwen4_exp), `qwen_sparse_attention` is its attention layers' name too.
    fn layer_types(
        &self,
        layers: usize,
        sparse_attention: bool,
    ) -> Result<Vec<LayerType>, ConvertError> {
        match self.map.get("layer_types") {
            None | Some(Value::Null) => {
                let interval = self.positive_or("full_attention_interval", 4)?;
                Ok((0..layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect())
            }
            Some(Value::Array(items)) => {
                if items.len() != layers {
                    return Err(self.error(
                        "layer_types",
                        format!("has {} entries for {layers} layers", items.len()),
                    ));
                }
                items
                    .iter()
                    .map(|item| match item.as_str() {
                        Some("linear_attention" | "mamba" | "conv") => {
                            Ok(LayerType::LinearAttention)
                        }
                        Some("full_attention" | "attention") => Ok(LayerType::FullAttention),
                        Some("qwen_sparse_attention") if sparse_attention => {
                            Ok(LayerType::FullAttention)
                        }
                        _ => Err(self.error("layer_types", format!("unknown layer type {item}"))),
                    })
                    .collect()
            }
            Some(other) => {
                Err(self.error("layer_types", format!("expected a list, found {other}")))
            }
        }
    }
}

/// Reads `DIR/config.json`.
pub fn read_config(directory: &Path) -> Result<ParsedConfig, ConvertError> {
    let file = directory.join("config.json");
    let text = std::fs::read_to_string(&file).map_err(|e| ConvertError::io(&file, "reading", e))?;
    let root: Value = serde_json::from_str(&text).map_err(|e| ConvertError::Input {
        file: file.clone(),
        problem: format!("not valid JSON: {e}"),
    })?;
    parse_config(&file, &root)
}

/// Parses a `config.json` value; `file` names it in errors.
pub fn parse_config(file: &Path, root: &Value) -> Result<ParsedConfig, ConvertError> {
    let file = file.to_path_buf();
    let Some(root_map) = root.as_object() else {
        return Err(ConvertError::Input {
            file,
            problem: "expected a JSON object".into(),
        });
    };
    let model_type = root_map
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    let top = Fields {
        file: &file,
        map: root_map,
    };
    let model = match model_type.as_str() {
        "qwen3_moe" => ModelConfig::Qwen3Moe(qwen3_moe(&top)?),
        "qwen3_next" => ModelConfig::Qwen3Next(hybrid(&top, HybridDefaults::QWEN3_NEXT, None)?),
        "qwen3_5_moe_text" => {
            ModelConfig::Qwen35Moe(hybrid(&top, HybridDefaults::QWEN3_5_MOE, None)?)
        }
        "qwen3_5_text" => ModelConfig::Qwen35(hybrid(&top, HybridDefaults::QWEN3_5, None)?),
        "qwen4_exp_text" => ModelConfig::Qwen4Exp(qwen4_exp(&top, None)?),
        "qwen4_exp" => {
            let Some(text) = root_map.get("text_config").and_then(|v| v.as_object()) else {
                return Err(top.error(
                    "text_config",
                    "missing (qwen4_exp configs keep the text model there)",
                ));
            };
            let fields = Fields {
                file: &file,
                map: text,
            };
            let tie = top.bool_or(
                "tie_word_embeddings",
                fields.bool_or("tie_word_embeddings", false)?,
            )?;
            ModelConfig::Qwen4Exp(qwen4_exp(&fields, Some(tie))?)
        }
        "qwen3_5_moe" | "qwen3_5" => {
            // Multimodal release: the text model lives under `text_config`; tying is decided at
            // the top level (MODELS.md §4.1).
            let Some(text) = root_map.get("text_config").and_then(|v| v.as_object()) else {
                return Err(top.error(
                    "text_config",
                    format!("missing ({model_type} configs keep the text model there)"),
                ));
            };
            let fields = Fields {
                file: &file,
                map: text,
            };
            let tie = top.bool_or(
                "tie_word_embeddings",
                fields.bool_or("tie_word_embeddings", false)?,
            )?;
            if model_type == "qwen3_5" {
                ModelConfig::Qwen35(hybrid(&fields, HybridDefaults::QWEN3_5, Some(tie))?)
            } else {
                ModelConfig::Qwen35Moe(hybrid(&fields, HybridDefaults::QWEN3_5_MOE, Some(tie))?)
            }
        }
        "" => return Err(top.error("model_type", "missing")),
        other => {
            return Err(ConvertError::UnknownModelType {
                file,
                model_type: other.to_string(),
            })
        }
    };
    Ok(ParsedConfig { model, model_type })
}

fn common(
    fields: &Fields,
    defaults: &CommonDefaults,
    rotary_factor_default: f64,
) -> Result<CommonConfig, ConvertError> {
    let hidden_size = fields.positive_or("hidden_size", defaults.hidden_size)?;
    let num_attention_heads =
        fields.positive_or("num_attention_heads", defaults.num_attention_heads)?;
    let head_dim = fields.positive_or(
        "head_dim",
        defaults
            .head_dim
            .unwrap_or(hidden_size / num_attention_heads),
    )?;
    let num_hidden_layers = fields.positive_or("num_hidden_layers", defaults.num_hidden_layers)?;
    // A dense architecture has no expert fields in its config class: any such keys in
    // `config.json` are extra attributes its model never reads.
    let (num_experts, num_experts_per_tok, moe_intermediate_size) = if defaults.routed_experts {
        let num_experts = fields.usize_or(
            "num_experts",
            fields.usize_or("num_local_experts", defaults.num_experts)?,
        )?;
        let num_experts_per_tok =
            fields.positive_or("num_experts_per_tok", defaults.num_experts_per_tok)?;
        if num_experts_per_tok > num_experts {
            return Err(fields.error(
                "num_experts_per_tok",
                format!("{num_experts_per_tok} exceeds num_experts {num_experts}"),
            ));
        }
        let moe_intermediate_size =
            fields.positive_or("moe_intermediate_size", defaults.moe_intermediate_size)?;
        (num_experts, num_experts_per_tok, moe_intermediate_size)
    } else {
        (0, 0, 0)
    };
    let (rope_theta, partial) = fields.rope(rotary_factor_default)?;
    let rotary_dim = (head_dim as f64 * partial) as usize;
    if rotary_dim % 2 != 0 || rotary_dim == 0 {
        return Err(fields.error(
            "partial_rotary_factor",
            format!("gives an odd or empty rotary dim {rotary_dim}"),
        ));
    }
    let num_key_value_heads =
        fields.positive_or("num_key_value_heads", defaults.num_key_value_heads)?;
    if num_attention_heads % num_key_value_heads != 0 {
        return Err(fields.error(
            "num_key_value_heads",
            format!(
                "{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"
            ),
        ));
    }
    Ok(CommonConfig {
        vocab_size: fields.positive_or("vocab_size", defaults.vocab_size)?,
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rotary_dim,
        rope_theta,
        rms_norm_eps: fields.f64_or("rms_norm_eps", 1e-6)?,
        intermediate_size: if defaults.routed_experts {
            fields.usize_or("intermediate_size", defaults.intermediate_size)?
        } else {
            // Every layer is a dense MLP of this width.
            fields.positive_or("intermediate_size", defaults.intermediate_size)?
        },
        num_experts,
        num_experts_per_tok,
        moe_intermediate_size,
        norm_topk_prob: defaults.routed_experts
            && fields.bool_or("norm_topk_prob", defaults.norm_topk_prob)?,
        moe_layers: Vec::new(),
        tie_word_embeddings: fields.bool_or("tie_word_embeddings", false)?,
        max_position_embeddings: fields
            .positive_or("max_position_embeddings", defaults.max_position_embeddings)?,
    })
}

struct CommonDefaults {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: Option<usize>,
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    norm_topk_prob: bool,
    max_position_embeddings: usize,
    /// False for an all-dense architecture: no expert fields are read, all are 0.
    routed_experts: bool,
}

fn qwen3_moe(fields: &Fields) -> Result<Qwen3MoeConfig, ConvertError> {
    let defaults = CommonDefaults {
        vocab_size: 151936,
        hidden_size: 2048,
        intermediate_size: 6144,
        num_hidden_layers: 24,
        num_attention_heads: 32,
        num_key_value_heads: 4,
        head_dim: None,
        num_experts: 128,
        num_experts_per_tok: 8,
        moe_intermediate_size: 768,
        norm_topk_prob: false,
        max_position_embeddings: 32768,
        routed_experts: true,
    };
    // qwen3_moe ignores partial_rotary_factor: rot = head_dim.
    let mut common = common(fields, &defaults, 1.0)?;
    common.rotary_dim = common.head_dim;
    common.moe_layers = fields.moe_layers(common.num_hidden_layers, common.num_experts)?;
    let sliding_window = if fields.bool_or("use_sliding_window", false)? {
        Some(fields.positive_or("sliding_window", 4096)?)
    } else {
        None
    };
    Ok(Qwen3MoeConfig {
        common,
        sliding_window,
    })
}

struct HybridDefaults {
    common: CommonDefaults,
    shared_expert_intermediate_size: usize,
    layers: HybridLayers,
}

/// Which layers of a hybrid architecture are MoE.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HybridLayers {
    /// qwen3_next: as `mlp_only_layers` / `decoder_sparse_step` say.
    MlpOnlyLayersDense,
    /// qwen3_5_moe: no `mlp_only_layers`, and the router always renormalises.
    EveryLayerMoeNormalised,
    /// qwen3_5: no experts at all.
    EveryLayerDense,
    /// qwen4_exp: every layer MoE, renormalised as `norm_topk_prob` says.
    EveryLayerMoe,
}

impl HybridDefaults {
    const QWEN3_NEXT: HybridDefaults = HybridDefaults {
        common: CommonDefaults {
            vocab_size: 151936,
            hidden_size: 2048,
            intermediate_size: 5632,
            num_hidden_layers: 48,
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: Some(256),
            num_experts: 512,
            num_experts_per_tok: 10,
            moe_intermediate_size: 512,
            norm_topk_prob: true,
            max_position_embeddings: 32768,
            routed_experts: true,
        },
        shared_expert_intermediate_size: 512,
        layers: HybridLayers::MlpOnlyLayersDense,
    };
    const QWEN3_5_MOE: HybridDefaults = HybridDefaults {
        common: CommonDefaults {
            vocab_size: 248320,
            hidden_size: 2048,
            intermediate_size: 0,
            num_hidden_layers: 40,
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: Some(256),
            num_experts: 256,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            norm_topk_prob: true,
            max_position_embeddings: 262144,
            routed_experts: true,
        },
        shared_expert_intermediate_size: 512,
        layers: HybridLayers::EveryLayerMoeNormalised,
    };
    /// `Qwen3_5TextConfig` (MODELS.md §4.1): every layer a dense MLP of `intermediate_size`.
    const QWEN3_5: HybridDefaults = HybridDefaults {
        common: CommonDefaults {
            vocab_size: 248320,
            hidden_size: 4096,
            intermediate_size: 12288,
            num_hidden_layers: 32,
            num_attention_heads: 16,
            num_key_value_heads: 4,
            head_dim: Some(256),
            num_experts: 0,
            num_experts_per_tok: 0,
            moe_intermediate_size: 0,
            norm_topk_prob: false,
            max_position_embeddings: 32768,
            routed_experts: false,
        },
        shared_expert_intermediate_size: 0,
        layers: HybridLayers::EveryLayerDense,
    };
}

fn hybrid(
    fields: &Fields,
    defaults: HybridDefaults,
    tie_override: Option<bool>,
) -> Result<HybridConfig, ConvertError> {
    hybrid_with_rotary_default(fields, defaults, tie_override, 0.25)
}

/// [`hybrid`] with the architecture's default `partial_rotary_factor`.
fn hybrid_with_rotary_default(
    fields: &Fields,
    defaults: HybridDefaults,
    tie_override: Option<bool>,
    rotary_factor_default: f64,
) -> Result<HybridConfig, ConvertError> {
    let mut common = common(fields, &defaults.common, rotary_factor_default)?;
    if let Some(tie) = tie_override {
        common.tie_word_embeddings = tie;
    }
    let shared_expert_intermediate_size = match defaults.layers {
        HybridLayers::EveryLayerMoeNormalised => {
            common.norm_topk_prob = true;
            common.moe_layers = vec![true; common.num_hidden_layers];
            if common.num_experts == 0 {
                return Err(fields.error("num_experts", "qwen3_5_moe needs routed experts"));
            }
            fields.usize_or(
                "shared_expert_intermediate_size",
                defaults.shared_expert_intermediate_size,
            )?
        }
        HybridLayers::MlpOnlyLayersDense => {
            common.moe_layers = fields.moe_layers(common.num_hidden_layers, common.num_experts)?;
            fields.usize_or(
                "shared_expert_intermediate_size",
                defaults.shared_expert_intermediate_size,
            )?
        }
        HybridLayers::EveryLayerDense => {
            common.moe_layers = vec![false; common.num_hidden_layers];
            0
        }
        HybridLayers::EveryLayerMoe => {
            common.moe_layers = vec![true; common.num_hidden_layers];
            if common.num_experts == 0 {
                return Err(fields.error("num_experts", "qwen4_exp needs routed experts"));
            }
            fields.usize_or(
                "shared_expert_intermediate_size",
                defaults.shared_expert_intermediate_size,
            )?
        }
    };
    let layer_types = fields.layer_types(
        common.num_hidden_layers,
        defaults.layers == HybridLayers::EveryLayerMoe,
    )?;
    let linear_num_key_heads = fields.positive_or("linear_num_key_heads", 16)?;
    let linear_num_value_heads = fields.positive_or("linear_num_value_heads", 32)?;
    if linear_num_value_heads % linear_num_key_heads != 0 {
        return Err(fields.error(
            "linear_num_value_heads",
            format!("{linear_num_value_heads} is not a multiple of linear_num_key_heads {linear_num_key_heads}"),
        ));
    }
    Ok(HybridConfig {
        common,
        layer_types,
        linear_num_key_heads,
        linear_num_value_heads,
        linear_key_head_dim: fields.positive_or("linear_key_head_dim", 128)?,
        linear_value_head_dim: fields.positive_or("linear_value_head_dim", 128)?,
        linear_conv_kernel_dim: fields.positive_or("linear_conv_kernel_dim", 4)?,
        shared_expert_intermediate_size,
        // Counted from the tensors actually converted (see `plan`).
        mtp_num_layers: 0,
    })
}

/// `Qwen4ExpTextConfig` (MODELS.md §5.1): the qwen3_5_moe hybrid fields with their own
/// defaults, no partial-rotary default, and the hyper-connection, QSA and PLE fields. Refuses
/// what transformers refuses, and the QSA fields it cannot run without.
fn qwen4_exp(fields: &Fields, tie_override: Option<bool>) -> Result<Qwen4ExpConfig, ConvertError> {
    let defaults = HybridDefaults {
        common: CommonDefaults {
            num_experts: 512,
            num_experts_per_tok: 10,
            max_position_embeddings: 32768,
            ..HybridDefaults::QWEN3_5_MOE.common
        },
        shared_expert_intermediate_size: 512,
        layers: HybridLayers::EveryLayerMoe,
    };
    // Layer types: transformers calls the attention layers `qwen_sparse_attention` (the
    // released config says `full_attention`); both are stored as full attention, QSA-indexed.
    let hybrid = hybrid_with_rotary_default(fields, defaults, tie_override, 1.0)?;
    let layers = hybrid.common.num_hidden_layers;
    let hyper_connection_streams = fields.positive_or("hc_count", 4)?;
    if hyper_connection_streams < 2 {
        return Err(fields.error("hc_count", "must be greater than 1"));
    }
    let hidden = hybrid.common.hidden_size;
    let output_gate = match fields.map.get("output_gate_type").and_then(|v| v.as_str()) {
        Some(kind) => kind.to_string(),
        None => match fields.map.get("hidden_act").and_then(|v| v.as_str()) {
            Some(kind) => kind.to_string(),
            None => "silu".to_string(),
        },
    };
    let output_gate = match output_gate.as_str() {
        "silu" | "swish" => OutputGateActivation::Silu,
        "sigmoid" => OutputGateActivation::Sigmoid,
        other => {
            return Err(fields.error(
                "output_gate_type",
                format!("`{other}` is not supported (silu or sigmoid)"),
            ))
        }
    };
    let required = |field: &str| -> Result<usize, ConvertError> {
        match fields.map.get(field) {
            None | Some(Value::Null) => Err(fields.error(
                field,
                "missing (every Qwen4-Exp attention layer has a QSA indexer that needs it)",
            )),
            Some(_) => fields.positive_or(field, 1),
        }
    };
    let indexer_heads = required("indexer_n_heads")?;
    let indexer_head_dim = required("indexer_head_dim")?;
    let indexer_budget = required("indexer_budget")?;
    let indexer_compress_ratio = required("indexer_compress_ratio")?;
    if required("indexer_kv_heads")? != 1 {
        return Err(fields.error("indexer_kv_heads", "must be 1"));
    }
    if indexer_budget % indexer_compress_ratio != 0 {
        return Err(fields.error(
            "indexer_budget",
            format!("{indexer_budget} is not a multiple of indexer_compress_ratio {indexer_compress_ratio}"),
        ));
    }
    if hybrid.common.rotary_dim > indexer_head_dim {
        return Err(fields.error(
            "indexer_head_dim",
            format!(
                "{indexer_head_dim} is narrower than the rotary width {}",
                hybrid.common.rotary_dim
            ),
        ));
    }
    let mut ple_layers = Vec::new();
    for id in fields.usize_list("ple_layer_ids")? {
        if id == 0 || id > layers {
            return Err(fields.error(
                "ple_layer_ids",
                format!("{id} is not a layer id (they count from 1 to {layers})"),
            ));
        }
        if hybrid.layer_types[id - 1] != LayerType::LinearAttention {
            return Err(fields.error(
                "ple_layer_ids",
                format!("layer id {id} is not a linear-attention layer"),
            ));
        }
        ple_layers.push(id - 1);
    }
    ple_layers.sort_unstable();
    ple_layers.dedup();
    let ngram_size = fields.positive_or("ngram_size", 3)?;
    let heads_per_ngram = fields.positive_or("heads_per_ngram", 8)?;
    let ple_embed_dim = fields.positive_or("ple_embed_dim", hidden)?;
    let ngram_eos_token_id = match fields.map.get("eos_token_id") {
        Some(Value::Array(items)) => items.first().and_then(|v| v.as_u64()),
        Some(value) => value.as_u64(),
        None => None,
    }
    .map(|id| id as u32);
    if !ple_layers.is_empty() {
        if ngram_size < 2 {
            return Err(fields.error("ngram_size", "must be at least 2"));
        }
        let heads = (ngram_size - 1) * heads_per_ngram;
        if ple_embed_dim % heads != 0 {
            return Err(fields.error(
                "ple_embed_dim",
                format!("{ple_embed_dim} is not a multiple of (ngram_size − 1) · heads_per_ngram = {heads}"),
            ));
        }
        if ngram_eos_token_id.is_none() {
            return Err(fields.error(
                "eos_token_id",
                "missing (the PLE n-gram contexts stop at it)",
            ));
        }
    }
    Ok(Qwen4ExpConfig {
        hybrid,
        hyper_connection_streams,
        hyper_connection_rank: fields.positive_or("hc_lowrank", 320)?,
        output_gate,
        indexer_heads,
        indexer_head_dim,
        indexer_budget,
        indexer_compress_ratio,
        ple_layers,
        ple_embed_dim,
        ple_conv_kernel_size: fields.positive_or("ple_conv_kernel_size", 4)?,
        ngram_size,
        heads_per_ngram,
        ngram_vocab_size_base: fields.positive_or("ngram_vocab_size_base", 20_000_000)? as u64,
        ngram_table_rows_divisor: fields.positive_or("make_ngram_vocab_size_divisible_by", 128)?
            as u64,
        ngram_seed: fields.usize_or("seed", 1234)? as u64,
        ngram_eos_token_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(value: Value) -> Result<ParsedConfig, ConvertError> {
        parse_config(Path::new("config.json"), &value)
    }

    /// The dense Qwen3.5 text config: every layer dense, no expert fields read (an expert key in
    /// the file is an extra attribute `Qwen3_5TextConfig` never uses), transformers' defaults.
    #[test]
    fn dense_qwen3_5_text_has_no_experts_and_transformers_defaults() {
        let parsed = parse(json!({
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 8,
            "num_experts": 64,
        }))
        .unwrap();
        let ModelConfig::Qwen35(c) = &parsed.model else {
            panic!("{:?}", parsed.model)
        };
        let common = &c.common;
        assert_eq!(
            (
                common.vocab_size,
                common.hidden_size,
                common.intermediate_size
            ),
            (248320, 4096, 12288)
        );
        assert_eq!(
            (
                common.num_attention_heads,
                common.num_key_value_heads,
                common.head_dim,
                common.rotary_dim
            ),
            (16, 4, 256, 64)
        );
        assert_eq!(
            (
                common.num_experts,
                common.num_experts_per_tok,
                common.moe_intermediate_size,
                c.shared_expert_intermediate_size
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(common.moe_layers, vec![false; 8]);
        let full: Vec<usize> = (0..8)
            .filter(|&l| c.layer_types[l] == LayerType::FullAttention)
            .collect();
        assert_eq!(full, vec![3, 7]);
        assert_eq!((c.linear_num_key_heads, c.linear_num_value_heads), (16, 32));
    }

    /// The multimodal release: the text model under `text_config`, tying decided at the top.
    #[test]
    fn multimodal_qwen3_5_reads_its_text_config() {
        let parsed = parse(json!({
            "model_type": "qwen3_5",
            "tie_word_embeddings": true,
            "text_config": {
                "model_type": "qwen3_5_text",
                "hidden_size": 5120,
                "intermediate_size": 17408,
                "num_hidden_layers": 4,
                "num_attention_heads": 24,
                "num_key_value_heads": 4,
                "linear_num_value_heads": 48,
                "tie_word_embeddings": false,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                    "partial_rotary_factor": 0.25},
            },
        }))
        .unwrap();
        assert_eq!(parsed.model_type, "qwen3_5");
        assert_eq!(parsed.model.architecture().name(), "qwen3_5");
        let common = parsed.model.common();
        assert_eq!(
            (common.hidden_size, common.intermediate_size),
            (5120, 17408)
        );
        assert_eq!(common.rope_theta, 1e7);
        assert!(common.tie_word_embeddings);
        assert_eq!(
            parsed.model.hybrid().map(|h| h.linear_num_value_heads),
            Some(48)
        );
    }

    #[test]
    fn dense_qwen3_5_errors_name_the_field() {
        let error = parse(json!({"model_type": "qwen3_5_text", "intermediate_size": 0}))
            .unwrap_err()
            .to_string();
        assert!(error.contains("intermediate_size"), "{error}");
        let error = parse(json!({"model_type": "qwen3_5"}))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("text_config") && error.contains("qwen3_5"),
            "{error}"
        );
    }
}
