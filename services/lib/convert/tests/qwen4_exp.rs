//! Conversion of Qwen4-Exp checkpoints, on a tiny checkpoint written here: the multimodal
//! release layout (`model.language_model.*`, a vision tower, an MTP block) and the text-only
//! layout give the same text tensors; the PLE n-gram tables, split on disk into row shards,
//! are kept shard by shard as the host-RAM class `ngram_embedding`; what the engine recomputes
//! or does not run yet is skipped with a note, and config problems name the field.

use std::collections::BTreeMap;
use std::path::Path;

use ninfer_artifact::{Artifact, DType, LayerType, ModelConfig, OutputGateActivation, TensorClass};
use ninfer_convert::{convert_checkpoint, ConvertOptions, ConvertProgress, NoProgress};
use serde_json::{json, Value};

const HIDDEN: usize = 8;
const STREAMS: usize = 2;
const RANK: usize = 3;
const VOCAB: usize = 16;
const EOS: u32 = 15;
/// Rows of layer 0's n-gram table: heads of 11 and 13 rows (the primes from 11), padded to 4.
const NGRAM_ROWS: usize = 24;
const NGRAM_ROW_WIDTH: usize = 2;

/// The text config: layer 0 linear attention with PLE, layer 1 QSA attention.
fn text_config() -> Value {
    json!({
        "model_type": "qwen4_exp_text",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "hidden_act": "silu",
        "output_gate_type": "sigmoid",
        "rms_norm_eps": 1e-6,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 4,
        "linear_value_head_dim": 4,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
        "shared_expert_intermediate_size": 4,
        "hc_count": STREAMS,
        "hc_lowrank": RANK,
        "ple_layer_ids": [1],
        "ple_embed_dim": 4,
        "ple_conv_kernel_size": 3,
        "ngram_size": 3,
        "heads_per_ngram": 1,
        "ngram_vocab_size_base": 11,
        "make_ngram_vocab_size_divisible_by": 4,
        "split_ngram_parts": 3,
        "seed": 99,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 4,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
        "eos_token_id": [EOS, 14],
        "tie_word_embeddings": false,
    })
}

/// Every text tensor under its in-memory name (`model.…`), the n-gram table split into
/// `shards` row shards on disk, with distinct values so a mix-up shows.
fn text_tensors(shards: usize) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let width = STREAMS * HIDDEN;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![VOCAB, HIDDEN]),
        ("lm_head.weight".into(), vec![VOCAB, HIDDEN]),
        (
            "model.hyper_connection_mixer.hc_norm.weight".into(),
            vec![width],
        ),
        (
            "model.hyper_connection_mixer.input_mix_weight_down.weight".into(),
            vec![RANK, width],
        ),
        (
            "model.hyper_connection_mixer.input_mix_weight_up.weight".into(),
            vec![width, RANK],
        ),
    ];
    for layer in 0..2 {
        let p = format!("model.layers.{layer}");
        for hc in ["attn_hyper_connection", "mlp_hyper_connection"] {
            shapes.push((format!("{p}.{hc}.hc_norm.weight"), vec![width]));
            shapes.push((
                format!("{p}.{hc}.input_mix_weight_down.weight"),
                vec![RANK, width],
            ));
            shapes.push((
                format!("{p}.{hc}.input_mix_weight_up.weight"),
                vec![width, RANK],
            ));
            shapes.push((
                format!("{p}.{hc}.block_inject_weight.weight"),
                vec![STREAMS, width],
            ));
        }
        shapes.push((format!("{p}.mlp.gate.weight"), vec![4, HIDDEN]));
        shapes.push((format!("{p}.mlp.experts.gate_up_proj"), vec![4, 8, HIDDEN]));
        shapes.push((format!("{p}.mlp.experts.down_proj"), vec![4, HIDDEN, 4]));
        for name in ["gate_proj", "up_proj"] {
            shapes.push((
                format!("{p}.mlp.shared_expert.{name}.weight"),
                vec![4, HIDDEN],
            ));
        }
        shapes.push((
            format!("{p}.mlp.shared_expert.down_proj.weight"),
            vec![HIDDEN, 4],
        ));
        shapes.push((
            format!("{p}.mlp.shared_expert_gate.weight"),
            vec![1, HIDDEN],
        ));
    }
    let gdn = "model.layers.0.linear_attn";
    let conv_dim = 2 * 4 + 2 * 4;
    shapes.extend([
        (format!("{gdn}.in_proj_qkv.weight"), vec![conv_dim, HIDDEN]),
        (format!("{gdn}.in_proj_z.weight"), vec![8, HIDDEN]),
        (format!("{gdn}.in_proj_b.weight"), vec![2, HIDDEN]),
        (format!("{gdn}.in_proj_a.weight"), vec![2, HIDDEN]),
        (format!("{gdn}.conv1d.weight"), vec![conv_dim, 1, 4]),
        (format!("{gdn}.dt_bias"), vec![2]),
        (format!("{gdn}.A_log"), vec![2]),
        (format!("{gdn}.norm.weight"), vec![4]),
        (format!("{gdn}.out_proj.weight"), vec![HIDDEN, 8]),
    ]);
    let ple = "model.layers.0.ple";
    shapes.extend([
        (format!("{ple}.key_proj.weight"), vec![width, 4]),
        (format!("{ple}.value_proj.weight"), vec![HIDDEN, 4]),
        (format!("{ple}.norm_key.weight"), vec![width]),
        (format!("{ple}.norm_query.weight"), vec![width]),
        (format!("{ple}.norm_conv.weight"), vec![width]),
        (format!("{ple}.conv1d.weight"), vec![width, 1, 3]),
    ]);
    let shard_rows = NGRAM_ROWS.div_ceil(shards);
    for shard in 0..shards {
        let rows = shard_rows.min(NGRAM_ROWS - shard * shard_rows);
        shapes.push((
            format!("{ple}.ple_embedding.ngram_embedding.shard_{shard}.weight"),
            vec![rows, NGRAM_ROW_WIDTH],
        ));
    }
    let attn = "model.layers.1.self_attn";
    shapes.extend([
        (format!("{attn}.q_proj.weight"), vec![16, HIDDEN]),
        (format!("{attn}.k_proj.weight"), vec![4, HIDDEN]),
        (format!("{attn}.v_proj.weight"), vec![4, HIDDEN]),
        (format!("{attn}.o_proj.weight"), vec![HIDDEN, 8]),
        (format!("{attn}.q_norm.weight"), vec![4]),
        (format!("{attn}.k_norm.weight"), vec![4]),
        (
            format!("{attn}.indexer.index_qk_proj.weight"),
            vec![12, HIDDEN],
        ),
        (format!("{attn}.indexer.q_layernorm.weight"), vec![4]),
        (format!("{attn}.indexer.k_layernorm.weight"), vec![4]),
    ]);
    let mut tensors = BTreeMap::new();
    let mut next = 0.0f32;
    for (name, shape) in shapes {
        let count: usize = shape.iter().product();
        // Distinct values that survive bf16 (small integers over 64).
        let values: Vec<f32> = (0..count)
            .map(|_| {
                next += 1.0;
                (next % 251.0) / 64.0
            })
            .collect();
        tensors.insert(name, (shape, values));
    }
    // The n-gram shards concatenated are rows 0.. of one table: make row r hold r, r + 0.5.
    let mut row = 0;
    for shard in 0..shards {
        let name = format!("{ple}.ple_embedding.ngram_embedding.shard_{shard}.weight");
        let (shape, values) = tensors.get_mut(&name).unwrap();
        for (index, value) in values.iter_mut().enumerate() {
            *value = (row + index / NGRAM_ROW_WIDTH) as f32 + (index % 2) as f32 * 0.5;
        }
        row += shape[0];
    }
    tensors
}

fn write_checkpoint(
    directory: &Path,
    config: &Value,
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) {
    std::fs::create_dir_all(directory).unwrap();
    std::fs::write(
        directory.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    let bytes: BTreeMap<String, Vec<u8>> = tensors
        .iter()
        .map(|(name, (_, values))| {
            (
                name.clone(),
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (shape, _))| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape.clone(),
                    &bytes[name],
                )
                .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &directory.join("model.safetensors")).unwrap();
}

/// The text-only layout (`qwen4_exp_text`, `model.*` names).
fn write_text_only(directory: &Path, shards: usize) {
    write_checkpoint(directory, &text_config(), &text_tensors(shards));
}

/// The multimodal release layout: text config under `text_config`, text weights under
/// `model.language_model.`, `lm_head` at the top, plus a vision tower and an MTP block.
fn write_multimodal(directory: &Path, shards: usize) {
    let config = json!({
        "model_type": "qwen4_exp",
        "text_config": text_config(),
        "vision_config": {"depth": 1},
        "tie_word_embeddings": false,
    });
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)> = text_tensors(shards)
        .into_iter()
        .map(|(name, tensor)| {
            let name = match name.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => name,
            };
            (name, tensor)
        })
        .collect();
    tensors.insert(
        "model.visual.patch_embed.proj.weight".into(),
        (vec![4, 3], vec![0.25; 12]),
    );
    tensors.insert(
        "mtp.fc.weight".into(),
        (vec![HIDDEN, 2 * HIDDEN], vec![0.5; 128]),
    );
    write_checkpoint(directory, &config, &tensors);
}

/// Notes the conversion told its progress sink.
#[derive(Default)]
struct Notes(std::sync::Mutex<Vec<String>>);
impl ConvertProgress for Notes {
    fn note(&self, message: &str) {
        self.0.lock().unwrap().push(message.to_string());
    }
}

fn convert(directory: &Path, dense: DType) -> (Artifact, Vec<String>) {
    let output = directory.join(format!("model-{dense}.ninfer"));
    let mut options = ConvertOptions::new(directory, &output);
    options.experts_dtype = DType::F32;
    options.dense_dtype = dense;
    let notes = Notes::default();
    let report = convert_checkpoint(&options, &notes)
        .unwrap_or_else(|e| panic!("{}: {e}", directory.display()));
    assert_eq!(report.architecture, "qwen4_exp");
    let artifact = Artifact::open(&output).unwrap();
    artifact.verify(|_| {}).unwrap();
    let notes = notes.0.into_inner().unwrap();
    (artifact, notes)
}

fn f32_values(artifact: &Artifact, name: &str) -> Vec<f32> {
    artifact.tensor(name).unwrap().to_f32_vec()
}

#[test]
fn both_layouts_convert_to_the_same_text_model() {
    let work = tempfile::tempdir().unwrap();
    let (text_dir, multimodal_dir) = (work.path().join("text"), work.path().join("multimodal"));
    write_text_only(&text_dir, 3);
    write_multimodal(&multimodal_dir, 3);
    let (text, text_notes) = convert(&text_dir, DType::F32);
    let (multimodal, multimodal_notes) = convert(&multimodal_dir, DType::F32);

    let ModelConfig::Qwen4Exp(config) = text.config() else {
        panic!("not a qwen4_exp config: {:?}", text.config());
    };
    assert_eq!(
        config.hybrid.layer_types,
        [LayerType::LinearAttention, LayerType::FullAttention]
    );
    assert_eq!(config.hyper_connection_streams, STREAMS);
    assert_eq!(config.hyper_connection_rank, RANK);
    assert_eq!(config.output_gate, OutputGateActivation::Sigmoid);
    assert_eq!(config.ple_layers, [0], "ple_layer_ids count from 1");
    assert_eq!(config.ngram_eos_token_id, Some(EOS), "the first eos id");
    assert_eq!(
        (config.indexer_budget, config.indexer_compress_ratio),
        (4, 2)
    );
    assert_eq!(config.ngram_seed, 99);
    assert_eq!(
        config.hybrid.common.rotary_dim, 4,
        "no partial-rotary default"
    );
    assert_eq!(config.hybrid.common.moe_layers, [true, true]);
    assert!(config.hybrid.common.norm_topk_prob);
    assert_eq!(multimodal.config(), text.config());

    // Same text tensors, same bytes, in both layouts (the vision tower is kept as its own
    // class, as for qwen3_5).
    let names = |artifact: &Artifact| -> Vec<(String, TensorClass)> {
        artifact
            .header()
            .tensors
            .iter()
            .filter(|t| t.class != TensorClass::Vision)
            .map(|t| (t.name.clone(), t.class))
            .collect()
    };
    assert_eq!(names(&text), names(&multimodal));
    for tensor in text.tensors() {
        assert_eq!(
            tensor.to_f32_vec(),
            multimodal.tensor(tensor.name()).unwrap().to_f32_vec(),
            "{}",
            tensor.name()
        );
    }
    let source = text_tensors(3);
    assert_eq!(
        f32_values(&text, "layers.1.attn.indexer.qk_proj"),
        source["model.layers.1.self_attn.indexer.index_qk_proj.weight"].1
    );
    assert_eq!(
        f32_values(&text, "hc_mixer.mix_up"),
        source["model.hyper_connection_mixer.input_mix_weight_up.weight"].1
    );
    assert_eq!(
        f32_values(&text, "layers.0.mlp_hc.inject"),
        source["model.layers.0.mlp_hyper_connection.block_inject_weight.weight"].1
    );
    assert_eq!(text.tensor("layers.0.ple.conv1d").unwrap().shape(), [16, 3]);
    for absent in ["final_norm", "layers.0.input_norm", "layers.1.ple.key_proj"] {
        assert!(text.get(absent).is_none(), "{absent} should not exist");
    }

    // The n-gram table: three shards in order, class ngram_embedding, rows r = (r, r + 0.5).
    let mut rows = Vec::new();
    for shard in 0..3 {
        let name = format!("layers.0.ple.ngram_embedding.shard_{shard}");
        let entry = text
            .header()
            .tensors
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(entry.class, TensorClass::NgramEmbedding);
        rows.extend(f32_values(&text, &name));
    }
    let expected: Vec<f32> = (0..NGRAM_ROWS)
        .flat_map(|row| [row as f32, row as f32 + 0.5])
        .collect();
    assert_eq!(rows, expected);
    assert!(text.get("layers.0.ple.ngram_embedding.shard_3").is_none());

    assert!(!text_notes
        .iter()
        .any(|n| n.contains("vision") || n.contains("MTP")));
    for expected in ["vision", "MTP"] {
        assert!(
            multimodal_notes.iter().any(|n| n.contains(expected)),
            "no note about the {expected} tensors: {multimodal_notes:?}"
        );
    }
}

#[test]
fn the_ngram_table_converts_from_any_shard_count_and_in_bf16() {
    let work = tempfile::tempdir().unwrap();
    for shards in [1, 5] {
        let directory = work.path().join(format!("shards-{shards}"));
        write_text_only(&directory, shards);
        let (artifact, _) = convert(&directory, DType::Bf16);
        let mut rows = Vec::new();
        for shard in 0..shards {
            let name = format!("layers.0.ple.ngram_embedding.shard_{shard}");
            let tensor = artifact.tensor(&name).unwrap();
            assert_eq!(tensor.dtype(), DType::Bf16, "{name}");
            rows.extend(tensor.to_f32_vec());
        }
        assert_eq!(rows.len(), NGRAM_ROWS * NGRAM_ROW_WIDTH, "{shards} shards");
        assert_eq!(rows[2 * 23], 23.0);
        assert_eq!(rows[2 * 23 + 1], 23.5);
    }
}

#[test]
fn config_problems_name_the_field() {
    let work = tempfile::tempdir().unwrap();
    let cases: [(&str, Value, &str); 5] = [
        ("indexer_budget", Value::Null, "indexer_budget"),
        (
            "indexer_budget",
            json!(5),
            "multiple of indexer_compress_ratio",
        ),
        ("ple_layer_ids", json!([2]), "not a linear-attention layer"),
        ("output_gate_type", json!("gelu"), "output_gate_type"),
        ("hc_count", json!(1), "hc_count"),
    ];
    for (index, (field, value, expected)) in cases.into_iter().enumerate() {
        let directory = work.path().join(format!("case-{index}"));
        let mut config = text_config();
        match value {
            Value::Null => {
                config.as_object_mut().unwrap().remove(field);
            }
            value => config[field] = value,
        }
        write_checkpoint(&directory, &config, &text_tensors(3));
        let options = ConvertOptions::new(&directory, directory.join("out.ninfer"));
        let error = convert_checkpoint(&options, &NoProgress)
            .expect_err(field)
            .to_string();
        assert!(
            error.contains(expected) && error.contains(field),
            "{field}: {error}"
        );
    }
}

#[test]
fn a_missing_ngram_shard_or_an_unknown_tensor_is_an_error() {
    let work = tempfile::tempdir().unwrap();
    let directory = work.path().join("no-table");
    let mut tensors = text_tensors(3);
    tensors.retain(|name, _| !name.contains("ngram_embedding"));
    write_checkpoint(&directory, &text_config(), &tensors);
    let options = ConvertOptions::new(&directory, directory.join("out.ninfer"));
    let error = convert_checkpoint(&options, &NoProgress)
        .unwrap_err()
        .to_string();
    assert!(error.contains("ngram_embedding.shard_0"), "{error}");

    // A shard after a gap is not part of the table: nothing is silently lost.
    let directory = work.path().join("gap");
    let mut tensors = text_tensors(3);
    let shard = tensors
        .remove("model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight")
        .unwrap();
    tensors.insert(
        "model.layers.0.ple.ple_embedding.ngram_embedding.shard_7.weight".into(),
        shard,
    );
    write_checkpoint(&directory, &text_config(), &tensors);
    let options = ConvertOptions::new(&directory, directory.join("out.ninfer"));
    let error = convert_checkpoint(&options, &NoProgress)
        .unwrap_err()
        .to_string();
    assert!(error.contains("shard_"), "{error}");
}

#[test]
fn layer_types_in_transformers_spelling_and_defaults_read_as_the_release_spelling() {
    let work = tempfile::tempdir().unwrap();
    let directory = work.path().join("spelling");
    let mut config = text_config();
    config["layer_types"] = json!(["linear_attention", "qwen_sparse_attention"]);
    // Without these the config's defaults apply: `output_gate_type` falls back to `hidden_act`.
    config.as_object_mut().unwrap().remove("output_gate_type");
    write_checkpoint(&directory, &config, &text_tensors(3));
    let parsed = ninfer_convert::read_config(&directory).unwrap();
    let ModelConfig::Qwen4Exp(parsed) = parsed.model else {
        panic!("not qwen4_exp");
    };
    assert_eq!(
        parsed.hybrid.layer_types,
        [LayerType::LinearAttention, LayerType::FullAttention]
    );
    assert_eq!(parsed.output_gate, OutputGateActivation::Silu);
}
