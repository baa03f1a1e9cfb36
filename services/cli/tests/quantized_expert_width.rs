//! Quantized experts whose width is not a multiple of the quantization group (32): a checkpoint
//! made here from the Qwen3-MoE golden fixture with its experts widened from 32 to 40 (8 more
//! rows of `gate_proj` / `up_proj`, 8 more columns of `down_proj`, all different from the
//! originals) converts with `--experts-dtype int4` and `int8` (the last group of every `down`
//! row padded), `inspect --verify` accepts it, and its perplexity — through the serving
//! pipeline (worker, and half the experts in the engine's slots) and in-process — is within the
//! golden tests' bars of the f32 conversion's: int4 0.15 nats, int8 0.02 nats of mean NLL.
//!
//! Needs the workspace binaries (`cargo test --workspace` or `scripts/test.sh` builds them).
//! Run with `cargo test -p ninfer --test quantized_expert_width -- --nocapture`.

mod common;
use common::fixture;

use std::collections::BTreeMap;
use std::path::Path;

const WIDTH: usize = 40;

/// Mean-NLL bars of quantized experts against f32 ones (`services/engine/tests/golden.rs`).
const BARS: [(&str, f64); 2] = [("int4", 0.15), ("int8", 0.02)];

fn ninfer(args: &[&str]) -> String {
    common::ninfer_stdout(args)
}

/// A safetensors file's tensors: name → (shape, f32 values).
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn read_f32_safetensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).expect("reading the checkpoint");
    let length = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + length]).expect("safetensors header");
    let data = &bytes[8 + length..];
    header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, entry)| {
            assert_eq!(entry["dtype"], "F32", "{name}: the fixture is f32");
            let shape: Vec<usize> = entry["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|d| d.as_u64().expect("dimension") as usize)
                .collect();
            let offsets = entry["data_offsets"].as_array().expect("offsets");
            let (start, end) = (
                offsets[0].as_u64().expect("start") as usize,
                offsets[1].as_u64().expect("end") as usize,
            );
            let values = data[start..end]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, (shape, values))
        })
        .collect()
}

fn write_f32_safetensors(path: &Path, tensors: &Tensors) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut data = Vec::new();
    for (name, (shape, values)) in tensors {
        let start = data.len();
        for value in values {
            data.extend_from_slice(&value.to_le_bytes());
        }
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [start, data.len()] }),
        );
    }
    let mut header = serde_json::to_vec(&header).expect("header JSON");
    // The data starts 8-byte aligned (the header may be padded with spaces).
    while (8 + header.len()) % 8 != 0 {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).expect("writing the checkpoint");
}

/// The fixture with every routed expert widened from 32 to [`WIDTH`]: new `gate` / `up` rows
/// are earlier rows × −0.75, new `down` columns earlier columns × 0.5.
fn widened_checkpoint(directory: &Path) {
    let source = fixture("qwen3_moe");
    std::fs::create_dir_all(directory).expect("creating the checkpoint directory");
    for entry in std::fs::read_dir(&source).expect("listing the fixture") {
        let path = entry.expect("fixture entry").path();
        let name = path.file_name().expect("file name").to_owned();
        if name != "model.safetensors" && name != "config.json" {
            std::fs::copy(&path, directory.join(&name)).expect("copying a fixture file");
        }
    }
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(source.join("config.json")).expect("config.json"),
    )
    .expect("config.json is JSON");
    let old_width = config["moe_intermediate_size"].as_u64().expect("width") as usize;
    assert!(old_width < WIDTH && WIDTH % 32 != 0);
    config["moe_intermediate_size"] = WIDTH.into();
    std::fs::write(
        directory.join("config.json"),
        serde_json::to_string_pretty(&config).expect("config JSON"),
    )
    .expect("writing config.json");

    let mut tensors = read_f32_safetensors(&source.join("model.safetensors"));
    let mut widened = 0;
    for (name, (shape, values)) in tensors.iter_mut() {
        if !name.contains(".mlp.experts.") {
            continue;
        }
        let extra = WIDTH - old_width;
        if name.ends_with("down_proj.weight") {
            let (rows, cols) = (shape[0], shape[1]);
            assert_eq!(cols, old_width, "{name}");
            let mut out = Vec::with_capacity(rows * WIDTH);
            for row in values.chunks_exact(cols) {
                out.extend_from_slice(row);
                out.extend(row[..extra].iter().map(|v| v * 0.5));
            }
            *values = out;
            shape[1] = WIDTH;
        } else {
            let (rows, cols) = (shape[0], shape[1]);
            assert_eq!(rows, old_width, "{name}");
            let added: Vec<f32> = values[..extra * cols].iter().map(|v| v * -0.75).collect();
            values.extend(added);
            shape[0] = WIDTH;
        }
        widened += 1;
    }
    assert!(widened > 0, "the fixture has routed experts");
    write_f32_safetensors(&directory.join("model.safetensors"), &tensors);
}

fn mean_nll(args: &[&str]) -> f64 {
    let mut all = vec!["perplexity", "--json"];
    all.extend_from_slice(args);
    let stdout = ninfer(&all);
    let summary: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    summary["mean_nll"].as_f64().expect("mean_nll")
}

#[test]
fn quantized_experts_of_width_40_convert_and_keep_the_perplexity() {
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let checkpoint = scratch.path().join("qwen3-moe-width-40");
    widened_checkpoint(&checkpoint);
    let checkpoint = checkpoint.to_str().expect("utf-8 path");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3_moe").join("reference.json")).expect("reference"),
    )
    .expect("reference.json is JSON");
    let text = scratch.path().join("text.txt");
    std::fs::write(&text, reference["nll_text"].as_str().expect("nll_text")).expect("text");
    let text = text.to_str().expect("utf-8 path");

    let convert = |experts: &str| {
        let output = scratch.path().join(format!("width-40-{experts}.ninfer"));
        let output = output.to_str().expect("utf-8 path").to_string();
        ninfer(&[
            "convert",
            checkpoint,
            &output,
            "--experts-dtype",
            experts,
            "--dense-dtype",
            "f32",
        ]);
        let inspected = ninfer(&["inspect", "--verify", &output]);
        assert!(
            inspected.lines().any(|line| {
                let words: Vec<&str> = line.split_whitespace().collect();
                words.first() == Some(&"routed_expert") && words.get(1) == Some(&experts)
            }),
            "{experts}: inspect shows no {experts} routed experts:\n{inspected}"
        );
        output
    };
    let f32_artifact = convert("f32");
    let through_engine = |artifact: &str, extra: &[&str]| {
        let mut args = vec![artifact, text, "--device", "cpu"];
        args.extend_from_slice(extra);
        mean_nll(&args)
    };
    let f32_engine = through_engine(&f32_artifact, &[]);
    let f32_in_process = mean_nll(&["--in-process", &f32_artifact, text]);
    assert!(
        (f32_engine - f32_in_process).abs() < 1e-4,
        "f32: engine {f32_engine} vs in-process {f32_in_process}"
    );
    for (experts, bar) in BARS {
        let artifact = convert(experts);
        let engine = through_engine(&artifact, &[]);
        let split = through_engine(&artifact, &["--moe-gpu-experts", "half"]);
        let in_process = mean_nll(&["--in-process", &artifact, text]);
        println!(
            "width {WIDTH}, {experts} experts: mean NLL {engine:.6} (worker), {split:.6} (half in slots), {in_process:.6} (in-process); f32 {f32_engine:.6}; bar {bar}"
        );
        for (path, value) in [
            ("worker", engine),
            ("half in slots", split),
            ("in-process", in_process),
        ] {
            let delta = value - f32_engine;
            assert!(
                delta.abs() < bar,
                "{experts} experts through {path}: mean NLL moved by {delta} (bar {bar})"
            );
        }
        // The weights really were quantized.
        assert_ne!(
            in_process, f32_in_process,
            "{experts}: no quantization happened"
        );
    }
}
