//! The conversion plan: which artifact tensors to write, in which order, from which checkpoint
//! tensors and with which re-layout. Built (and shape-checked) before any byte is written, so a
//! missing or mis-shaped tensor fails fast with nothing left behind.

use std::collections::{BTreeMap, BTreeSet};

use ninfer_artifact::{DType, LayerType, ModelConfig, Qwen4ExpConfig, TensorClass};

use crate::error::ConvertError;
use crate::safetensors_file::{Checkpoint, SourceTensor};

/// How an output tensor's rows are taken from one checkpoint tensor.
#[derive(Debug, Clone)]
pub enum RowSelection {
    /// The whole tensor (possibly reshaped, e.g. conv1d `[C,1,K]` → `[C,K]`).
    All,
    /// These rows of the tensor viewed as `[rows, row_len]`, in this order.
    Rows(Vec<usize>),
}

/// One output tensor and where it comes from.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    pub name: String,
    pub class: TensorClass,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub source: String,
    pub rows: RowSelection,
}

/// Where one expert's three matrices come from.
#[derive(Debug, Clone)]
pub enum ExpertSource {
    /// `experts.{e}.gate_proj/up_proj/down_proj.weight`.
    PerExpert {
        gate: String,
        up: String,
        down: String,
    },
    /// Slice `index` of fused `experts.gate_up_proj [E,2Im,H]` and `experts.down_proj [E,H,Im]`.
    Fused {
        gate_up: String,
        down: String,
        index: usize,
    },
}

/// The experts of one MoE layer.
#[derive(Debug, Clone)]
pub struct PlannedBank {
    pub prefix: String,
    pub class: TensorClass,
    pub dtype: DType,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub experts: Vec<ExpertSource>,
}

#[derive(Debug, Clone)]
pub enum PlannedItem {
    Tensor(PlannedTensor),
    Bank(PlannedBank),
}

/// The whole plan plus what was deliberately left out.
#[derive(Debug, Clone)]
pub struct Plan {
    pub items: Vec<PlannedItem>,
    pub notes: Vec<String>,
    pub mtp_layers: usize,
}

/// Dtype choices of the user.
#[derive(Debug, Clone, Copy)]
pub struct DTypeChoice {
    pub experts: DType,
    pub dense: DType,
}

/// Checkpoint names with the multimodal `model.language_model.` prefix folded to `model.`.
pub struct SourceNames<'a> {
    checkpoint: &'a Checkpoint,
    canonical: BTreeMap<String, String>,
    used: BTreeSet<String>,
    /// The checkpoint spells its text model `model.language_model.*` (multimodal release).
    language_model_prefix: bool,
}

impl<'a> SourceNames<'a> {
    pub fn new(checkpoint: &'a Checkpoint) -> Self {
        let canonical = checkpoint
            .tensors
            .keys()
            .map(|name| {
                let short = match name.strip_prefix("model.language_model.") {
                    Some(rest) => format!("model.{rest}"),
                    None => name.clone(),
                };
                (short, name.clone())
            })
            .collect();
        let language_model_prefix = checkpoint
            .tensors
            .keys()
            .any(|name| name.starts_with("model.language_model."));
        SourceNames {
            checkpoint,
            canonical,
            used: BTreeSet::new(),
            language_model_prefix,
        }
    }

    /// A canonical name as this checkpoint would spell it (for messages about missing tensors).
    fn spelled(&self, canonical: &str) -> String {
        match canonical.strip_prefix("model.") {
            Some(rest) if self.language_model_prefix && !rest.starts_with("visual.") => {
                format!("model.language_model.{rest}")
            }
            _ => canonical.to_string(),
        }
    }

    fn find(&self, canonical: &str) -> Option<&'a SourceTensor> {
        let real = self.canonical.get(canonical)?;
        self.checkpoint.tensors.get(real)
    }

    fn has(&self, canonical: &str) -> bool {
        self.canonical.contains_key(canonical)
    }

    /// The real name of a required tensor whose shape must be `expected`.
    fn require(&mut self, canonical: &str, expected: &[u64]) -> Result<String, ConvertError> {
        let tensor = self
            .find(canonical)
            .ok_or_else(|| ConvertError::MissingTensor {
                directory: self.checkpoint.directory.clone(),
                name: self.spelled(canonical),
            })?;
        if tensor.dtype == crate::safetensors_file::SourceDType::I64 {
            return Err(ConvertError::Input {
                file: self.checkpoint.shard_path(tensor).to_path_buf(),
                problem: format!(
                    "tensor `{}` holds integers where a weight is expected",
                    tensor.name
                ),
            });
        }
        if tensor.shape != expected {
            return Err(ConvertError::WrongShape {
                file: self.checkpoint.shard_path(tensor).to_path_buf(),
                name: tensor.name.clone(),
                found: tensor.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        self.used.insert(tensor.name.clone());
        Ok(tensor.name.clone())
    }

    fn mark_used(&mut self, real: &str) {
        self.used.insert(real.to_string());
    }

    /// Checkpoint tensors no planned item consumed.
    pub fn unused(&self) -> Vec<String> {
        self.checkpoint
            .tensors
            .keys()
            .filter(|name| !self.used.contains(*name))
            .cloned()
            .collect()
    }
}

struct Planner<'a, 'b> {
    names: &'b mut SourceNames<'a>,
    dtypes: DTypeChoice,
    items: Vec<PlannedItem>,
}

impl Planner<'_, '_> {
    fn matrix_dtype(&self, class: TensorClass) -> DType {
        match class {
            TensorClass::RoutedExpert => self.dtypes.experts,
            _ => self.dtypes.dense,
        }
    }

    /// A tensor copied whole; 1-D tensors are always stored f32.
    fn copy(
        &mut self,
        name: &str,
        class: TensorClass,
        source: &str,
        shape: &[u64],
    ) -> Result<(), ConvertError> {
        let real = self.names.require(source, shape)?;
        let dtype = if shape.len() == 1 {
            DType::F32
        } else {
            self.matrix_dtype(class)
        };
        self.push(name, class, dtype, shape.to_vec(), real, RowSelection::All);
        Ok(())
    }

    fn push(
        &mut self,
        name: &str,
        class: TensorClass,
        dtype: DType,
        shape: Vec<u64>,
        source: String,
        rows: RowSelection,
    ) {
        self.items.push(PlannedItem::Tensor(PlannedTensor {
            name: name.to_string(),
            class,
            dtype,
            shape,
            source,
            rows,
        }));
    }
}

fn u(values: &[usize]) -> Vec<u64> {
    values.iter().map(|&v| v as u64).collect()
}

/// Builds the plan for `config` over `names`.
pub fn build_plan(
    config: &ModelConfig,
    names: &mut SourceNames,
    dtypes: DTypeChoice,
    skip_vision: bool,
) -> Result<Plan, ConvertError> {
    let common = config.common().clone();
    let h = common.hidden_size;
    let mut planner = Planner {
        names,
        dtypes,
        items: Vec::new(),
    };
    let mut notes = Vec::new();
    planner.copy(
        "embed_tokens",
        TensorClass::Embedding,
        "model.embed_tokens.weight",
        &u(&[common.vocab_size, h]),
    )?;

    let hybrid = config.hybrid().cloned();
    let is_next = matches!(config, ModelConfig::Qwen3Next(_));
    let mut banks = Vec::new();
    // A model without routed experts (dense qwen3_5) also stores each dense MLP as a bank of
    // one expert, so the CPU expert workers can compute the layers that do not fit the GPU.
    let model_has_routed_experts = common.moe_layers.iter().any(|&moe| moe);
    for layer in 0..common.num_hidden_layers {
        let source = format!("model.layers.{layer}");
        let target = format!("layers.{layer}");
        let layer_type = hybrid
            .as_ref()
            .map(|c| c.layer_types[layer])
            .unwrap_or(LayerType::FullAttention);
        plan_layer_body(
            &mut planner,
            config,
            &source,
            &target,
            layer_type,
            is_next,
            TensorClass::Dense,
        )?;
        if let Some(qwen4) = config.qwen4_exp() {
            plan_qwen4_exp_layer_extras(&mut planner, qwen4, &source, &target, layer)?;
        }
        if common.moe_layers[layer] {
            plan_moe_dense(&mut planner, config, &source, &target, TensorClass::Dense)?;
            banks.push(plan_bank(
                planner.names,
                config,
                &source,
                &format!("{target}.moe.experts"),
                TensorClass::RoutedExpert,
                dtypes.experts,
            )?);
        } else {
            plan_dense_mlp(
                &mut planner,
                config,
                &source,
                &target,
                TensorClass::DenseMlp,
            )?;
            if !model_has_routed_experts {
                banks.push(plan_dense_mlp_bank(
                    planner.names,
                    config,
                    &source,
                    &target,
                    dtypes.dense,
                )?);
            }
        }
    }
    match config.qwen4_exp() {
        // The final stream mixer takes the final norm's place.
        Some(qwen4) => plan_hyper_connection(
            &mut planner,
            qwen4,
            "model.hyper_connection_mixer",
            "hc_mixer",
            false,
        )?,
        None => planner.copy(
            "final_norm",
            TensorClass::Dense,
            "model.norm.weight",
            &u(&[h]),
        )?,
    }
    if planner.names.has("lm_head.weight") {
        planner.copy(
            "lm_head",
            TensorClass::Embedding,
            "lm_head.weight",
            &u(&[common.vocab_size, h]),
        )?;
    } else if !common.tie_word_embeddings {
        return Err(ConvertError::MissingTensor {
            directory: planner.names.checkpoint.directory.clone(),
            name: "lm_head.weight (the config does not tie embeddings)".into(),
        });
    }
    planner
        .items
        .extend(banks.into_iter().map(PlannedItem::Bank));

    // MTP block (hybrid architectures): kept as class `mtp`; its layer has the model's usual
    // feed-forward (MODELS.md §7.1): MoE with experts packed like routed ones, or a dense MLP
    // when no main layer is MoE (qwen3_5).
    let mtp_is_moe = common.moe_layers.iter().any(|&moe| moe);
    let mut mtp_layers = 0;
    if config.qwen4_exp().is_some() {
        // Its MTP head's layout is not published with the architecture: skipped, said so.
        skip_checkpoint_tensors(
            &mut planner,
            &mut notes,
            |name| name.starts_with("mtp."),
            "MTP tensor(s): the Qwen4-Exp MTP head is not supported yet",
        );
        // The PLE hash buffers are recomputed from the config by the engine.
        skip_checkpoint_tensors(
            &mut planner,
            &mut notes,
            |name| {
                name.contains(".ple.ple_embedding.")
                    && [
                        "layer_multipliers",
                        "ngram_heads_vocab_sizes",
                        "ngram_heads_offsets",
                    ]
                    .iter()
                    .any(|buffer| name.ends_with(buffer))
            },
            "PLE hash buffer(s): recomputed from the config",
        );
    } else if hybrid.is_some() {
        while planner
            .names
            .has(&format!("mtp.layers.{mtp_layers}.input_layernorm.weight"))
        {
            mtp_layers += 1;
        }
        if mtp_layers > 0 {
            planner.copy("mtp.fc", TensorClass::Mtp, "mtp.fc.weight", &u(&[h, 2 * h]))?;
            for norm in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
                planner.copy(
                    &format!("mtp.{norm}"),
                    TensorClass::Mtp,
                    &format!("mtp.{norm}.weight"),
                    &u(&[h]),
                )?;
            }
            let mut mtp_banks = Vec::new();
            for layer in 0..mtp_layers {
                let source = format!("mtp.layers.{layer}");
                let target = format!("mtp.layers.{layer}");
                plan_layer_body(
                    &mut planner,
                    config,
                    &source,
                    &target,
                    LayerType::FullAttention,
                    false,
                    TensorClass::Mtp,
                )?;
                if !mtp_is_moe {
                    plan_dense_mlp(&mut planner, config, &source, &target, TensorClass::Mtp)?;
                    continue;
                }
                plan_moe_dense(&mut planner, config, &source, &target, TensorClass::Mtp)?;
                mtp_banks.push(plan_bank(
                    planner.names,
                    config,
                    &source,
                    &format!("{target}.moe.experts"),
                    TensorClass::Mtp,
                    dtypes.experts,
                )?);
            }
            planner
                .items
                .extend(mtp_banks.into_iter().map(PlannedItem::Bank));
            notes.push(format!("kept {mtp_layers} MTP layer(s) as class `mtp`"));
        }
    }

    // Vision tower: kept under its checkpoint names as class `vision`, or dropped with a note.
    let vision: Vec<SourceTensor> = planner
        .names
        .checkpoint
        .tensors
        .values()
        .filter(|t| t.name.starts_with("model.visual.") || t.name.starts_with("visual."))
        .cloned()
        .collect();
    if !vision.is_empty() {
        let count = vision.len();
        let parameters: u64 = vision.iter().map(|t| t.element_count()).sum();
        for tensor in vision {
            planner.names.mark_used(&tensor.name);
            if !skip_vision {
                let dtype = if tensor.dtype == crate::safetensors_file::SourceDType::Bf16 {
                    DType::Bf16
                } else {
                    DType::F32
                };
                planner.push(
                    &tensor.name,
                    TensorClass::Vision,
                    dtype,
                    tensor.shape.clone(),
                    tensor.name.clone(),
                    RowSelection::All,
                );
            }
        }
        notes.push(if skip_vision {
            format!("skipped {count} vision tensor(s) ({parameters} parameters) because of --skip-vision")
        } else {
            format!("kept {count} vision tensor(s) ({parameters} parameters) as class `vision`")
        });
    }

    // Nothing may be silently lost: any tensor not consumed is an error (RoPE caches excepted).
    let unknown: Vec<String> = planner
        .names
        .unused()
        .into_iter()
        .filter(|name| !name.ends_with("rotary_emb.inv_freq"))
        .collect();
    if !unknown.is_empty() {
        let examples = unknown
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ");
        return Err(ConvertError::UnknownTensors {
            directory: planner.names.checkpoint.directory.clone(),
            count: unknown.len(),
            examples,
        });
    }
    Ok(Plan {
        items: planner.items,
        notes,
        mtp_layers,
    })
}

/// Norms and the token mixer (attention or Gated DeltaNet) of one decoder layer.
fn plan_layer_body(
    planner: &mut Planner,
    config: &ModelConfig,
    source: &str,
    target: &str,
    layer_type: LayerType,
    is_next: bool,
    class: TensorClass,
) -> Result<(), ConvertError> {
    let common = config.common();
    let (h, nh, nkv, hd) = (
        common.hidden_size,
        common.num_attention_heads,
        common.num_key_value_heads,
        common.head_dim,
    );
    let qwen4 = config.qwen4_exp();
    // Qwen4-Exp has no layer norms: its hyper-connection norms take their place.
    if qwen4.is_none() {
        planner.copy(
            &format!("{target}.input_norm"),
            class,
            &format!("{source}.input_layernorm.weight"),
            &u(&[h]),
        )?;
        planner.copy(
            &format!("{target}.post_attention_norm"),
            class,
            &format!("{source}.post_attention_layernorm.weight"),
            &u(&[h]),
        )?;
    }
    let gated = !matches!(config, ModelConfig::Qwen3Moe(_));
    match layer_type {
        LayerType::FullAttention => {
            let q_rows = if gated { nh * 2 * hd } else { nh * hd };
            let attn = format!("{source}.self_attn");
            planner.copy(
                &format!("{target}.attn.q_proj"),
                class,
                &format!("{attn}.q_proj.weight"),
                &u(&[q_rows, h]),
            )?;
            planner.copy(
                &format!("{target}.attn.k_proj"),
                class,
                &format!("{attn}.k_proj.weight"),
                &u(&[nkv * hd, h]),
            )?;
            planner.copy(
                &format!("{target}.attn.v_proj"),
                class,
                &format!("{attn}.v_proj.weight"),
                &u(&[nkv * hd, h]),
            )?;
            planner.copy(
                &format!("{target}.attn.o_proj"),
                class,
                &format!("{attn}.o_proj.weight"),
                &u(&[h, nh * hd]),
            )?;
            planner.copy(
                &format!("{target}.attn.q_norm"),
                class,
                &format!("{attn}.q_norm.weight"),
                &u(&[hd]),
            )?;
            planner.copy(
                &format!("{target}.attn.k_norm"),
                class,
                &format!("{attn}.k_norm.weight"),
                &u(&[hd]),
            )?;
            if let Some(qwen4) = qwen4 {
                let (heads, width) = (qwen4.indexer_heads, qwen4.indexer_head_dim);
                planner.copy(
                    &format!("{target}.attn.indexer.qk_proj"),
                    class,
                    &format!("{attn}.indexer.index_qk_proj.weight"),
                    &u(&[(heads + 1) * width, h]),
                )?;
                for (norm, name) in [("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")] {
                    planner.copy(
                        &format!("{target}.attn.indexer.{norm}"),
                        class,
                        &format!("{attn}.indexer.{name}.weight"),
                        &u(&[width]),
                    )?;
                }
            }
        }
        LayerType::LinearAttention => {
            let Some(c) = config.hybrid() else {
                return Ok(());
            };
            let (nk, nv, dk, dv, kc) = (
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                c.linear_conv_kernel_dim,
            );
            let conv_dim = c.linear_conv_dim();
            let gdn = format!("{source}.linear_attn");
            let dense = planner.dtypes.dense;
            if is_next {
                // Grouped-by-key-head layout → the flat qwen3.5 layout (MODELS.md §1.5.1).
                let r = nv / nk;
                let group = 2 * dk + 2 * r * dv;
                let qkvz = planner.names.require(
                    &format!("{gdn}.in_proj_qkvz.weight"),
                    &u(&[2 * nk * dk + 2 * nv * dv, h]),
                )?;
                let mut qkv_rows = Vec::with_capacity(conv_dim);
                for part in 0..2 {
                    for g in 0..nk {
                        qkv_rows.extend(g * group + part * dk..g * group + (part + 1) * dk);
                    }
                }
                for g in 0..nk {
                    qkv_rows.extend(g * group + 2 * dk..g * group + 2 * dk + r * dv);
                }
                let z_rows: Vec<usize> = (0..nk)
                    .flat_map(|g| g * group + 2 * dk + r * dv..(g + 1) * group)
                    .collect();
                planner.push(
                    &format!("{target}.gdn.in_proj_qkv"),
                    class,
                    dense,
                    u(&[conv_dim, h]),
                    qkvz.clone(),
                    RowSelection::Rows(qkv_rows),
                );
                planner.push(
                    &format!("{target}.gdn.in_proj_z"),
                    class,
                    dense,
                    u(&[nv * dv, h]),
                    qkvz,
                    RowSelection::Rows(z_rows),
                );
                let ba = planner
                    .names
                    .require(&format!("{gdn}.in_proj_ba.weight"), &u(&[2 * nv, h]))?;
                let b_rows: Vec<usize> = (0..nk).flat_map(|g| g * 2 * r..g * 2 * r + r).collect();
                let a_rows: Vec<usize> = (0..nk)
                    .flat_map(|g| g * 2 * r + r..(g + 1) * 2 * r)
                    .collect();
                planner.push(
                    &format!("{target}.gdn.in_proj_b"),
                    class,
                    dense,
                    u(&[nv, h]),
                    ba.clone(),
                    RowSelection::Rows(b_rows),
                );
                planner.push(
                    &format!("{target}.gdn.in_proj_a"),
                    class,
                    dense,
                    u(&[nv, h]),
                    ba,
                    RowSelection::Rows(a_rows),
                );
            } else {
                planner.copy(
                    &format!("{target}.gdn.in_proj_qkv"),
                    class,
                    &format!("{gdn}.in_proj_qkv.weight"),
                    &u(&[conv_dim, h]),
                )?;
                planner.copy(
                    &format!("{target}.gdn.in_proj_z"),
                    class,
                    &format!("{gdn}.in_proj_z.weight"),
                    &u(&[nv * dv, h]),
                )?;
                planner.copy(
                    &format!("{target}.gdn.in_proj_b"),
                    class,
                    &format!("{gdn}.in_proj_b.weight"),
                    &u(&[nv, h]),
                )?;
                planner.copy(
                    &format!("{target}.gdn.in_proj_a"),
                    class,
                    &format!("{gdn}.in_proj_a.weight"),
                    &u(&[nv, h]),
                )?;
            }
            let conv = planner
                .names
                .require(&format!("{gdn}.conv1d.weight"), &u(&[conv_dim, 1, kc]))?;
            planner.push(
                &format!("{target}.gdn.conv1d"),
                class,
                DType::F32,
                u(&[conv_dim, kc]),
                conv,
                RowSelection::All,
            );
            planner.copy(
                &format!("{target}.gdn.dt_bias"),
                class,
                &format!("{gdn}.dt_bias"),
                &u(&[nv]),
            )?;
            planner.copy(
                &format!("{target}.gdn.A_log"),
                class,
                &format!("{gdn}.A_log"),
                &u(&[nv]),
            )?;
            planner.copy(
                &format!("{target}.gdn.norm"),
                class,
                &format!("{gdn}.norm.weight"),
                &u(&[dv]),
            )?;
            planner.copy(
                &format!("{target}.gdn.out_proj"),
                class,
                &format!("{gdn}.out_proj.weight"),
                &u(&[h, nv * dv]),
            )?;
        }
    }
    Ok(())
}

/// A Qwen4-Exp layer's two hyper-connections and, on the PLE layers, its PLE block.
fn plan_qwen4_exp_layer_extras(
    planner: &mut Planner,
    config: &Qwen4ExpConfig,
    source: &str,
    target: &str,
    layer: usize,
) -> Result<(), ConvertError> {
    plan_hyper_connection(
        planner,
        config,
        &format!("{source}.attn_hyper_connection"),
        &format!("{target}.attn_hc"),
        true,
    )?;
    plan_hyper_connection(
        planner,
        config,
        &format!("{source}.mlp_hyper_connection"),
        &format!("{target}.mlp_hc"),
        true,
    )?;
    if !config.ple_layers.contains(&layer) {
        return Ok(());
    }
    let h = config.hybrid.common.hidden_size;
    let streams_width = config.hyper_connection_streams * h;
    let ple = format!("{source}.ple");
    let (embed, kernel) = (config.ple_embed_dim, config.ple_conv_kernel_size);
    let class = TensorClass::Dense;
    planner.copy(
        &format!("{target}.ple.key_proj"),
        class,
        &format!("{ple}.key_proj.weight"),
        &u(&[streams_width, embed]),
    )?;
    planner.copy(
        &format!("{target}.ple.value_proj"),
        class,
        &format!("{ple}.value_proj.weight"),
        &u(&[h, embed]),
    )?;
    for norm in ["norm_key", "norm_query", "norm_conv"] {
        planner.copy(
            &format!("{target}.ple.{norm}"),
            class,
            &format!("{ple}.{norm}.weight"),
            &u(&[streams_width]),
        )?;
    }
    let conv = planner.names.require(
        &format!("{ple}.conv1d.weight"),
        &u(&[streams_width, 1, kernel]),
    )?;
    planner.push(
        &format!("{target}.ple.conv1d"),
        class,
        DType::F32,
        u(&[streams_width, kernel]),
        conv,
        RowSelection::All,
    );
    plan_ngram_table(planner, config, &ple, target)
}

/// A PLE layer's n-gram table: one tensor in memory, on disk split into consecutive row shards
/// `ngram_embedding.shard_{i}.weight` (transformers concatenates them in numeric order). Each
/// shard is kept as its own artifact tensor `{target}.ple.ngram_embedding.shard_{i}`, so no
/// step of the conversion holds a whole table; the engine checks the total rows.
/// Marks the checkpoint's tensors that `skipped` picks as used, noting how many were skipped
/// and why (`what`: "… tensor(s): reason").
fn skip_checkpoint_tensors(
    planner: &mut Planner,
    notes: &mut Vec<String>,
    skipped: impl Fn(&str) -> bool,
    what: &str,
) {
    let names: Vec<String> = planner
        .names
        .checkpoint
        .tensors
        .keys()
        .filter(|name| skipped(name))
        .cloned()
        .collect();
    if names.is_empty() {
        return;
    }
    for name in &names {
        planner.names.mark_used(name);
    }
    notes.push(format!("skipped {} {what}", names.len()));
}

fn plan_ngram_table(
    planner: &mut Planner,
    config: &Qwen4ExpConfig,
    ple: &str,
    target: &str,
) -> Result<(), ConvertError> {
    let width = config.ngram_row_width() as u64;
    let table = format!("{ple}.ple_embedding.ngram_embedding");
    let class = TensorClass::NgramEmbedding;
    let whole = format!("{table}.weight");
    let mut sources = Vec::new();
    if planner.names.has(&whole) {
        sources.push(whole);
    } else {
        while planner
            .names
            .has(&format!("{table}.shard_{}.weight", sources.len()))
        {
            sources.push(format!("{table}.shard_{}.weight", sources.len()));
        }
    }
    if sources.is_empty() {
        return Err(ConvertError::MissingTensor {
            directory: planner.names.checkpoint.directory.clone(),
            name: planner.names.spelled(&format!("{table}.shard_0.weight")),
        });
    }
    for (index, source) in sources.iter().enumerate() {
        let rows = planner
            .names
            .find(source)
            .map(|tensor| tensor.shape.first().copied().unwrap_or(0))
            .unwrap_or(0);
        planner.copy(
            &format!("{target}.ple.ngram_embedding.shard_{index}"),
            class,
            source,
            &[rows, width],
        )?;
    }
    Ok(())
}

/// One Qwen4-Exp stream mixer (`hc_norm`, the low-rank mix down/up and, in a layer's
/// hyper-connections, the block injection weights).
fn plan_hyper_connection(
    planner: &mut Planner,
    config: &Qwen4ExpConfig,
    source: &str,
    target: &str,
    with_injection: bool,
) -> Result<(), ConvertError> {
    let h = config.hybrid.common.hidden_size;
    let streams = config.hyper_connection_streams;
    let (width, rank) = (streams * h, config.hyper_connection_rank);
    let class = TensorClass::Dense;
    planner.copy(
        &format!("{target}.norm"),
        class,
        &format!("{source}.hc_norm.weight"),
        &u(&[width]),
    )?;
    planner.copy(
        &format!("{target}.mix_down"),
        class,
        &format!("{source}.input_mix_weight_down.weight"),
        &u(&[rank, width]),
    )?;
    planner.copy(
        &format!("{target}.mix_up"),
        class,
        &format!("{source}.input_mix_weight_up.weight"),
        &u(&[width, rank]),
    )?;
    if with_injection {
        // Small and decides each stream's share of the block output: kept f32 like a router.
        let inject = planner.names.require(
            &format!("{source}.block_inject_weight.weight"),
            &u(&[streams, width]),
        )?;
        planner.push(
            &format!("{target}.inject"),
            class,
            DType::F32,
            u(&[streams, width]),
            inject,
            RowSelection::All,
        );
    }
    Ok(())
}

/// The SwiGLU matrices of a dense-MLP layer (`intermediate_size` wide).
fn plan_dense_mlp(
    planner: &mut Planner,
    config: &ModelConfig,
    source: &str,
    target: &str,
    class: TensorClass,
) -> Result<(), ConvertError> {
    let (h, i) = (
        config.common().hidden_size,
        config.common().intermediate_size,
    );
    for (name, shape) in [
        ("gate_proj", [i, h]),
        ("up_proj", [i, h]),
        ("down_proj", [h, i]),
    ] {
        planner.copy(
            &format!("{target}.mlp.{name}"),
            class,
            &format!("{source}.mlp.{name}.weight"),
            &u(&shape),
        )?;
    }
    Ok(())
}

/// Router and shared expert of a MoE layer (the routed experts go into a bank).
fn plan_moe_dense(
    planner: &mut Planner,
    config: &ModelConfig,
    source: &str,
    target: &str,
    class: TensorClass,
) -> Result<(), ConvertError> {
    let common = config.common();
    let (h, e) = (common.hidden_size, common.num_experts);
    // The router stays f32: it is tiny and routing decisions are sensitive to rounding.
    let router = planner
        .names
        .require(&format!("{source}.mlp.gate.weight"), &u(&[e, h]))?;
    planner.push(
        &format!("{target}.moe.router"),
        class,
        DType::F32,
        u(&[e, h]),
        router,
        RowSelection::All,
    );
    if let Some(c) = config
        .hybrid()
        .filter(|_| !matches!(config, ModelConfig::Qwen35(_)))
    {
        let is = c.shared_expert_intermediate_size;
        let shared = format!("{source}.mlp.shared_expert");
        planner.copy(
            &format!("{target}.moe.shared_expert.gate_proj"),
            class,
            &format!("{shared}.gate_proj.weight"),
            &u(&[is, h]),
        )?;
        planner.copy(
            &format!("{target}.moe.shared_expert.up_proj"),
            class,
            &format!("{shared}.up_proj.weight"),
            &u(&[is, h]),
        )?;
        planner.copy(
            &format!("{target}.moe.shared_expert.down_proj"),
            class,
            &format!("{shared}.down_proj.weight"),
            &u(&[h, is]),
        )?;
        let gate = planner.names.require(
            &format!("{source}.mlp.shared_expert_gate.weight"),
            &u(&[1, h]),
        )?;
        planner.push(
            &format!("{target}.moe.shared_expert_gate"),
            class,
            DType::F32,
            u(&[1, h]),
            gate,
            RowSelection::All,
        );
    }
    Ok(())
}

/// The routed experts of one layer, from per-expert or fused checkpoint tensors.
/// A dense-MLP layer's SwiGLU as a bank of one expert (`{target}.mlp.experts`, class
/// `dense_mlp_expert`) from the same checkpoint tensors as its `dense_mlp` matrices, in the dense
/// dtype so both copies hold the same numbers.
fn plan_dense_mlp_bank(
    names: &mut SourceNames,
    config: &ModelConfig,
    source: &str,
    target: &str,
    dtype: DType,
) -> Result<PlannedBank, ConvertError> {
    let (h, i) = (
        config.common().hidden_size,
        config.common().intermediate_size,
    );
    let mlp = format!("{source}.mlp");
    Ok(PlannedBank {
        prefix: format!("{target}.mlp.experts"),
        class: TensorClass::DenseMlpExpert,
        dtype,
        hidden_size: h,
        intermediate_size: i,
        experts: vec![ExpertSource::PerExpert {
            gate: names.require(&format!("{mlp}.gate_proj.weight"), &u(&[i, h]))?,
            up: names.require(&format!("{mlp}.up_proj.weight"), &u(&[i, h]))?,
            down: names.require(&format!("{mlp}.down_proj.weight"), &u(&[h, i]))?,
        }],
    })
}

fn plan_bank(
    names: &mut SourceNames,
    config: &ModelConfig,
    source: &str,
    prefix: &str,
    class: TensorClass,
    dtype: DType,
) -> Result<PlannedBank, ConvertError> {
    let common = config.common();
    let (h, e, im) = (
        common.hidden_size,
        common.num_experts,
        common.moe_intermediate_size,
    );
    let experts_prefix = format!("{source}.mlp.experts");
    let fused_down = [
        format!("{experts_prefix}.down_proj"),
        format!("{experts_prefix}.down_proj.weight"),
    ]
    .into_iter()
    .find(|name| names.has(name));
    let fused_gate_up = [
        format!("{experts_prefix}.gate_up_proj"),
        format!("{experts_prefix}.gate_up_proj.weight"),
    ]
    .into_iter()
    .find(|name| names.has(name))
    // A fused `down_proj` without per-expert tensors means the layer is fused: report the
    // missing fused `gate_up_proj`, not a per-expert name the checkpoint never had.
    .or_else(|| {
        let per_expert = names.has(&format!("{experts_prefix}.0.gate_proj.weight"));
        match &fused_down {
            Some(down) if !per_expert => Some(down.replace("down_proj", "gate_up_proj")),
            _ => None,
        }
    });
    let experts = if let Some(gate_up_name) = fused_gate_up {
        let down_name = if gate_up_name.ends_with(".weight") {
            format!("{experts_prefix}.down_proj.weight")
        } else {
            format!("{experts_prefix}.down_proj")
        };
        let gate_up = names.require(&gate_up_name, &u(&[e, 2 * im, h]))?;
        let down = names.require(&down_name, &u(&[e, h, im]))?;
        (0..e)
            .map(|index| ExpertSource::Fused {
                gate_up: gate_up.clone(),
                down: down.clone(),
                index,
            })
            .collect()
    } else {
        let mut experts = Vec::with_capacity(e);
        for index in 0..e {
            let base = format!("{experts_prefix}.{index}");
            experts.push(ExpertSource::PerExpert {
                gate: names.require(&format!("{base}.gate_proj.weight"), &u(&[im, h]))?,
                up: names.require(&format!("{base}.up_proj.weight"), &u(&[im, h]))?,
                down: names.require(&format!("{base}.down_proj.weight"), &u(&[h, im]))?,
            });
        }
        experts
    };
    Ok(PlannedBank {
        prefix: prefix.to_string(),
        class,
        dtype,
        hidden_size: h,
        intermediate_size: im,
        experts,
    })
}
