//! Every golden fixture converts with every `--experts-dtype`; the artifact holds the right
//! tensors and counts; f32/bf16 tensors round-trip bit-exactly and int8/int4 within the
//! documented bound. The checkpoint is read back with the independent `safetensors` crate.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::bf16;
use ninfer_artifact::quant::{quantization_error_bound, GROUP_SIZE};
use ninfer_artifact::{Artifact, DType, ModelConfig, TensorClass};
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};

const FIXTURES: [&str; 4] = ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../tests/fixtures")
        .join(name)
}

/// All checkpoint tensors as f32, keyed by name with `model.language_model.` folded to `model.`.
fn checkpoint_tensors(directory: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut tensors = BTreeMap::new();
    for entry in std::fs::read_dir(directory).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in file.tensors() {
            let values: Vec<f32> = match view.dtype() {
                safetensors::Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                safetensors::Dtype::BF16 => view
                    .data()
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                other => panic!("fixture dtype {other:?}"),
            };
            let name = name.replace("model.language_model.", "model.");
            tensors.insert(name, (view.shape().to_vec(), values));
        }
    }
    tensors
}

fn convert(name: &str, experts: DType, dense: DType, into: &Path) -> Artifact {
    let output = into.join(format!("{name}-{experts}-{dense}.ninfer"));
    let mut options = ConvertOptions::new(fixture(name), &output);
    options.experts_dtype = experts;
    options.dense_dtype = dense;
    let report = convert_checkpoint(&options, &NoProgress)
        .unwrap_or_else(|e| panic!("{name} with {experts} experts: {e}"));
    assert_eq!(report.files, vec![output.clone()]);
    let artifact = Artifact::open(&output).unwrap();
    artifact.verify(|_| {}).unwrap();
    artifact
}

/// gate_up of expert `e` from the checkpoint, in either on-disk layout.
fn source_gate_up(
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    layer: usize,
    expert: usize,
    h: usize,
    im: usize,
) -> Vec<f32> {
    let prefix = format!("model.layers.{layer}.mlp.experts");
    if let Some((_, fused)) = tensors.get(&format!("{prefix}.gate_up_proj")) {
        return fused[expert * 2 * im * h..(expert + 1) * 2 * im * h].to_vec();
    }
    let mut values = tensors[&format!("{prefix}.{expert}.gate_proj.weight")]
        .1
        .clone();
    values.extend_from_slice(&tensors[&format!("{prefix}.{expert}.up_proj.weight")].1);
    values
}

fn source_down(
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    layer: usize,
    expert: usize,
    h: usize,
    im: usize,
) -> Vec<f32> {
    let prefix = format!("model.layers.{layer}.mlp.experts");
    if let Some((_, fused)) = tensors.get(&format!("{prefix}.down_proj")) {
        return fused[expert * h * im..(expert + 1) * h * im].to_vec();
    }
    tensors[&format!("{prefix}.{expert}.down_proj.weight")]
        .1
        .clone()
}

fn assert_matches(name: &str, dtype: DType, stored: &[f32], source: &[f32], cols: usize) {
    assert_eq!(stored.len(), source.len(), "{name}: length");
    match dtype {
        DType::F32 => assert!(
            stored
                .iter()
                .zip(source)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: f32 not bit-exact"
        ),
        DType::Bf16 => assert!(
            stored
                .iter()
                .zip(source)
                .all(|(a, b)| a.to_bits() == bf16::from_f32(*b).to_f32().to_bits()),
            "{name}: bf16 not the round-to-nearest-even of the source"
        ),
        DType::Int8 | DType::Int4 => {
            for (group, (stored, source)) in stored
                .chunks(GROUP_SIZE)
                .zip(source.chunks(GROUP_SIZE))
                .enumerate()
            {
                let max_abs = source.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                let bound = quantization_error_bound(dtype, max_abs) * (1.0 + 1e-6);
                for (a, b) in stored.iter().zip(source) {
                    assert!(
                        (a - b).abs() <= bound,
                        "{name}: group {group} (row {}) error {} above bound {bound}",
                        group * GROUP_SIZE / cols,
                        (a - b).abs()
                    );
                }
            }
        }
    }
}

#[test]
fn every_fixture_converts_with_every_experts_dtype() {
    let scratch = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let tensors = checkpoint_tensors(&fixture(name));
        for experts in [DType::F32, DType::Bf16, DType::Int8, DType::Int4] {
            let dense = if experts == DType::F32 {
                DType::F32
            } else {
                DType::Bf16
            };
            let artifact = convert(name, experts, dense, scratch.path());
            let config = artifact.config().clone();
            let common = config.common();
            let (h, im, e) = (
                common.hidden_size,
                common.moe_intermediate_size,
                common.num_experts,
            );
            assert_eq!(artifact.config().architecture().name(), name);

            // Counts: routed-expert parameters are exactly MoE layers × E × 3 × H × Im.
            let moe_layers = common.moe_layers.iter().filter(|m| **m).count();
            let routed: u64 = artifact
                .tensors()
                .filter(|t| t.entry.class == TensorClass::RoutedExpert)
                .map(|t| t.entry.element_count())
                .sum();
            assert_eq!(
                routed,
                (moe_layers * e * 3 * h * im) as u64,
                "{name}: routed-expert parameters"
            );
            match name {
                "qwen3_5_moe" => assert_eq!(moe_layers, common.num_hidden_layers),
                "qwen3_5" => assert_eq!(moe_layers, 0, "qwen3_5 is dense"),
                _ => assert!(
                    moe_layers >= 1 && moe_layers < common.num_hidden_layers,
                    "{name}: the fixture should mix dense and MoE layers"
                ),
            }
            // Dense-MLP layers: their three matrices, class `dense_mlp`, the checkpoint's values.
            let i = common.intermediate_size;
            for layer in (0..common.num_hidden_layers).filter(|&l| !common.moe_layers[l]) {
                for (which, cols) in [("gate_proj", h), ("up_proj", h), ("down_proj", i)] {
                    let stored = artifact
                        .tensor(&format!("layers.{layer}.mlp.{which}"))
                        .unwrap();
                    assert_eq!(stored.entry.class, TensorClass::DenseMlp, "{name}");
                    let source = tensors
                        .iter()
                        .find(|(n, _)| {
                            !n.starts_with("mtp.")
                                && n.ends_with(&format!("layers.{layer}.mlp.{which}.weight"))
                        })
                        .map(|(_, (_, values))| values)
                        .unwrap();
                    assert_matches(stored.name(), dense, &stored.to_f32_vec(), source, cols);
                }
            }
            assert_eq!(
                artifact
                    .header()
                    .expert_banks
                    .iter()
                    .filter(|b| b.class == TensorClass::RoutedExpert)
                    .count(),
                moe_layers
            );

            // Every checkpoint parameter of the text model is accounted for (vision/MTP as their classes).
            let text_parameters: u64 = tensors
                .iter()
                .filter(|(n, _)| !n.starts_with("mtp.") && !n.starts_with("model.visual."))
                .map(|(_, (shape, _))| shape.iter().product::<usize>() as u64)
                .sum();
            let stored_text: u64 = artifact
                .tensors()
                .filter(|t| {
                    matches!(
                        t.entry.class,
                        TensorClass::Embedding
                            | TensorClass::Dense
                            | TensorClass::DenseMlp
                            | TensorClass::RoutedExpert
                    )
                })
                .map(|t| t.entry.element_count())
                .sum();
            assert_eq!(stored_text, text_parameters, "{name}: text parameters");

            // Values.
            let embed = artifact.tensor("embed_tokens").unwrap();
            assert_matches(
                "embed_tokens",
                dense,
                &embed.to_f32_vec(),
                &tensors["model.embed_tokens.weight"].1,
                h,
            );
            let final_norm = artifact.tensor("final_norm").unwrap();
            assert_eq!(final_norm.dtype(), DType::F32, "1-D tensors stay f32");
            assert_matches(
                "final_norm",
                DType::F32,
                final_norm.as_f32().unwrap(),
                &tensors["model.norm.weight"].1,
                h,
            );
            for layer in (0..common.num_hidden_layers).filter(|&l| common.moe_layers[l]) {
                let bank = artifact
                    .expert_bank(&format!("layers.{layer}.moe.experts"))
                    .unwrap();
                assert_eq!((bank.num_experts as usize, bank.dtype), (e, experts));
                for expert in 0..e {
                    let gate_up = artifact
                        .tensor(&format!("layers.{layer}.moe.experts.{expert}.gate_up"))
                        .unwrap();
                    assert_eq!(
                        gate_up.entry.offset,
                        bank.offset + expert as u64 * bank.expert_stride
                    );
                    assert_matches(
                        gate_up.name(),
                        experts,
                        &gate_up.to_f32_vec(),
                        &source_gate_up(&tensors, layer, expert, h, im),
                        h,
                    );
                    let down = artifact
                        .tensor(&format!("layers.{layer}.moe.experts.{expert}.down"))
                        .unwrap();
                    assert_matches(
                        down.name(),
                        experts,
                        &down.to_f32_vec(),
                        &source_down(&tensors, layer, expert, h, im),
                        im,
                    );
                }
            }
            if let ModelConfig::Qwen35Moe(hybrid) | ModelConfig::Qwen35(hybrid) = &config {
                assert_eq!(
                    hybrid.mtp_num_layers, 1,
                    "the {name} fixture carries one MTP layer"
                );
                // The MTP layer has the model's usual feed-forward: experts, or a dense MLP.
                let dense = matches!(config, ModelConfig::Qwen35(_));
                assert_eq!(
                    artifact.expert_bank("mtp.layers.0.moe.experts").is_some(),
                    !dense
                );
                assert_eq!(artifact.get("mtp.layers.0.mlp.down_proj").is_some(), dense);
                assert!(
                    artifact
                        .tensors()
                        .any(|t| t.entry.class == TensorClass::Vision),
                    "vision tensors kept"
                );
                // The vision tower's settings travel with it, token ids beside them.
                let vision: serde_json::Value = serde_json::from_slice(
                    artifact
                        .file("vision_config.json")
                        .expect("vision settings kept"),
                )
                .expect("valid JSON");
                let source: serde_json::Value = serde_json::from_slice(
                    &std::fs::read(fixture(name).join("config.json")).expect("config readable"),
                )
                .expect("valid JSON");
                assert_eq!(vision["vision_config"], source["vision_config"]);
                assert_eq!(vision["image_token_id"], source["image_token_id"]);
                assert_eq!(
                    vision["vision_start_token_id"],
                    source["vision_start_token_id"]
                );
            }
            assert!(
                artifact.file("tokenizer.json").is_some()
                    && artifact.file("chat_template.jinja").is_some()
            );
            assert!(!artifact.header().generation.eos_token_ids.is_empty());
        }
    }
}

#[test]
fn split_conversion_equals_single_file() {
    let scratch = tempfile::tempdir().unwrap();
    let single = convert("qwen3_next", DType::Int4, DType::Bf16, scratch.path());
    let split_path = scratch.path().join("split.ninfer");
    let mut options = ConvertOptions::new(fixture("qwen3_next"), &split_path);
    options.experts_dtype = DType::Int4;
    options.max_file_bytes = Some(64 * 1024);
    let report = convert_checkpoint(&options, &NoProgress).unwrap();
    assert!(report.files.len() > 2);
    let split = Artifact::open(&split_path).unwrap();
    split.verify(|_| {}).unwrap();
    let mut crossing = 0;
    for tensor in single.tensors() {
        let other = split.tensor(tensor.name()).unwrap();
        assert_eq!(tensor.bytes, other.bytes, "{}", tensor.name());
        let last = other.entry.offset + other.entry.length - 1;
        crossing += usize::from(other.entry.offset / (64 * 1024) != last / (64 * 1024));
    }
    assert!(crossing > 0, "no tensor crossed a part boundary");
}

#[test]
fn reuse_copies_existing_tensors_and_adds_new_ones() {
    let scratch = tempfile::tempdir().unwrap();
    // An "old" artifact made without the vision tower, then a new one that adds it.
    let old_path = scratch.path().join("old.ninfer");
    let mut options = ConvertOptions::new(fixture("qwen3_5_moe"), &old_path);
    options.skip_vision = true;
    let old_report = convert_checkpoint(&options, &NoProgress).unwrap();
    assert!(
        old_report
            .notes
            .iter()
            .any(|n| n.contains("skipped") && n.contains("vision")),
        "{:?}",
        old_report.notes
    );
    let new_path = scratch.path().join("new.ninfer");
    let mut options = ConvertOptions::new(fixture("qwen3_5_moe"), &new_path);
    options.reuse = Some(old_path.clone());
    let report = convert_checkpoint(&options, &NoProgress).unwrap();
    let old = Artifact::open(&old_path).unwrap();
    assert_eq!(report.tensors_reused as usize, old.header().tensors.len());
    assert!(
        old.file("vision_config.json").is_none(),
        "no vision settings without the vision tower"
    );
    let new = Artifact::open(&new_path).unwrap();
    assert!(new.file("vision_config.json").is_some());
    let vision = new
        .tensors()
        .filter(|t| t.entry.class == TensorClass::Vision)
        .count();
    assert_eq!(report.tensors_written as usize, vision);
    assert!(vision > 0);
}
