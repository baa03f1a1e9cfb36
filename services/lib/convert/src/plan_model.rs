//! The plan of a whole model: its tensors in the artifact's order (embedding, each layer, the
//! final norm and head, the MTP layers), the checkpoint tensors left out on purpose, and the
//! checks that every checkpoint tensor is used or named.
//!
//! Owns: [`build_plan`]. Must not touch: one layer's tensors (`plan_layers.rs`).

use ninfer_artifact::{DType, LayerType, ModelConfig, TensorClass};

use crate::error::ConvertError;
use crate::plan::{u, DTypeChoice, Plan, PlannedItem, Planner, RowSelection, SourceNames};
use crate::plan_layers::{
    plan_bank, plan_dense_mlp, plan_dense_mlp_bank, plan_hyper_connection, plan_layer_body,
    plan_moe_dense, plan_qwen4_exp_layer_extras, skip_checkpoint_tensors,
};
use crate::safetensors_file::SourceTensor;

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
