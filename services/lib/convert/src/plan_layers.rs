//! The plan of one decoder layer: its mixer (attention, Gated DeltaNet, the Qwen4-Exp extras),
//! its feed-forward (dense MLP, offload bank, MoE with shared expert) and the expert banks.
//!
//! Owns: which tensors a layer writes and from which checkpoint tensors. Must not touch: the
//! order of the layers (`plan_model.rs`).

use ninfer_artifact::{DType, LayerType, ModelConfig, Qwen4ExpConfig, TensorClass};

use crate::error::ConvertError;
use crate::plan::{u, ExpertSource, PlannedBank, Planner, RowSelection, SourceNames};

/// Norms and the token mixer (attention or Gated DeltaNet) of one decoder layer.
pub(crate) fn plan_layer_body(
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
pub(crate) fn plan_qwen4_exp_layer_extras(
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
pub(crate) fn skip_checkpoint_tensors(
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

pub(crate) fn plan_ngram_table(
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
pub(crate) fn plan_hyper_connection(
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
pub(crate) fn plan_dense_mlp(
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
pub(crate) fn plan_moe_dense(
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
pub(crate) fn plan_dense_mlp_bank(
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

pub(crate) fn plan_bank(
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
