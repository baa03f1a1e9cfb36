//! The `convert` → `inspect` → `perplexity` commands on the committed golden fixtures, through
//! the real `ninfer` binary:
//!
//! * `inspect` prints the right architecture and, per tensor class, exactly the parameter counts
//!   of the checkpoint (counted here from the safetensors headers, independently of the
//!   converter), with the bytes of the float rows equal to parameters × element size;
//! * `perplexity --in-process` (the f32 reference) reproduces transformers' mean and per-token
//!   NLL (`reference.json`) on the fixture's text, tokenized by the artifact's own tokenizer,
//!   prints progress and tokens/s; `perplexity` through the serving pipeline windows (not
//!   refuses) a text longer than `--max-context` (`perplexity_through_engine.rs` compares the
//!   two paths in full);
//! * `perplexity` refuses an artifact of an unknown architecture by its name.
//!
//! Run with `cargo test -p ninfer --test convert_inspect_perplexity -- --nocapture`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FIXTURES: [&str; 3] = ["qwen3_moe", "qwen3_next", "qwen3_5_moe"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn ninfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(args)
        .output()
        .expect("running ninfer")
}

fn succeed(args: &[&str]) -> (String, String) {
    let output = ninfer(args);
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert!(
        output.status.success(),
        "ninfer {args:?} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    (stdout, stderr)
}

fn convert(name: &str, experts: &str, dense: &str, into: &Path) -> String {
    let output = into.join(format!("{name}-{experts}-{dense}.ninfer"));
    let output = output.to_str().expect("utf-8 temp path").to_string();
    let input = fixture(name);
    succeed(&[
        "convert",
        input.to_str().expect("utf-8 fixture path"),
        &output,
        "--experts-dtype",
        experts,
        "--dense-dtype",
        dense,
    ]);
    output
}

fn reference(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Element count of every tensor of the fixture's `model.safetensors`.
fn checkpoint_elements(name: &str) -> BTreeMap<String, u64> {
    let bytes = std::fs::read(fixture(name).join("model.safetensors")).unwrap();
    let length = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + length]).unwrap();
    header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, entry)| {
            let elements = entry["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .product();
            (name, elements)
        })
        .collect()
}

/// The artifact class a checkpoint tensor must land in (by its checkpoint name alone).
fn expected_class(name: &str) -> &'static str {
    let text = name
        .strip_prefix("model.language_model.")
        .map(|rest| format!("model.{rest}"))
        .unwrap_or_else(|| name.to_string());
    if text.starts_with("mtp.") {
        "mtp"
    } else if text.starts_with("model.visual.") {
        "vision"
    } else if text == "model.embed_tokens.weight" || text == "lm_head.weight" {
        "embedding"
    } else if text.contains(".mlp.experts.") {
        "routed_expert"
    } else if is_dense_mlp_matrix(&text) {
        "dense_mlp"
    } else {
        "dense"
    }
}

/// `model.layers.N.mlp.{gate,up,down}_proj.weight`: a dense-MLP layer's matrices (a MoE layer's
/// shared expert sits under `mlp.shared_expert.`).
fn is_dense_mlp_matrix(text: &str) -> bool {
    let Some(rest) = text.strip_prefix("model.layers.") else {
        return false;
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return false;
    };
    layer.chars().all(|c| c.is_ascii_digit())
        && [
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
        .contains(&tail)
}

/// `ninfer inspect`'s table: (class, dtype) → (tensors, parameters, bytes text), and the total.
type InspectTable = BTreeMap<(String, String), (u64, u64, String)>;

fn parse_inspect(stdout: &str) -> (InspectTable, u64) {
    let mut rows = BTreeMap::new();
    let mut total = None;
    let mut in_table = false;
    for line in stdout.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"class") {
            in_table = true;
            continue;
        }
        if !in_table || words.is_empty() {
            if in_table {
                break;
            }
            continue;
        }
        if words[0] == "total" {
            total = Some(words[2].parse::<u64>().unwrap());
            break;
        }
        assert!(words.len() == 6, "unexpected inspect row: {line}");
        rows.insert(
            (words[0].to_string(), words[1].to_string()),
            (
                words[2].parse().unwrap(),
                words[3].parse().unwrap(),
                format!("{} {}", words[4], words[5]),
            ),
        );
    }
    (rows, total.expect("inspect printed no total row"))
}

/// Same formatting as `ninfer inspect`.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

#[test]
fn inspect_shows_the_checkpoints_parameter_counts() {
    let scratch = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let elements = checkpoint_elements(name);
        let mut expected: BTreeMap<&str, u64> = BTreeMap::new();
        for (tensor, count) in &elements {
            *expected.entry(expected_class(tensor)).or_default() += count;
        }
        for (experts, dense) in [("f32", "f32"), ("int4", "bf16"), ("int8", "bf16")] {
            let artifact = convert(name, experts, dense, scratch.path());
            let (stdout, _) = succeed(&["inspect", "--verify", &artifact]);
            assert!(
                stdout
                    .lines()
                    .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["architecture:", name]),
                "{name}: inspect does not name the architecture:\n{stdout}"
            );
            assert!(stdout.contains("checksums:"), "{stdout}");
            let (rows, total) = parse_inspect(&stdout);
            let mut by_class: BTreeMap<&str, u64> = BTreeMap::new();
            for ((class, dtype), (_, parameters, bytes)) in &rows {
                let class = expected
                    .keys()
                    .find(|c| **c == class.as_str())
                    .unwrap_or_else(|| panic!("{name}: unexpected class `{class}`:\n{stdout}"));
                *by_class.entry(class).or_default() += parameters;
                let element_bytes = match dtype.as_str() {
                    "f32" => Some(4),
                    "bf16" => Some(2),
                    _ => None,
                };
                if let Some(size) = element_bytes {
                    assert_eq!(
                        bytes,
                        &human_bytes(parameters * size),
                        "{name} {class} {dtype}: bytes"
                    );
                }
                // Routed experts (and the MTP block's experts) are stored in the experts dtype.
                if *class == "routed_expert" {
                    assert_eq!(dtype, experts, "{name}: routed experts' dtype");
                }
            }
            println!("{name} experts {experts} dense {dense}: inspect per class {by_class:?}, total {total}; checkpoint {expected:?}");
            assert_eq!(by_class, expected, "{name}: parameters per class");
            assert_eq!(
                total,
                elements.values().sum::<u64>(),
                "{name}: total parameters"
            );
        }
    }
}

/// `(position, token, nll)` lines of `--token-nll`.
fn read_token_nll(path: &Path) -> Vec<(usize, u32, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            assert_eq!(fields.len(), 3, "token-nll line: {line}");
            (
                fields[0].parse().unwrap(),
                fields[1].parse().unwrap(),
                fields[2].parse().unwrap(),
            )
        })
        .collect()
}

/// `mean NLL X nats over N scored tokens …` → (X, N).
fn parse_mean(stdout: &str) -> (f64, usize) {
    let words: Vec<&str> = stdout.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == "NLL")
        .unwrap_or_else(|| panic!("no mean NLL in: {stdout}"));
    (
        words[at + 1].parse().unwrap(),
        words[at + 4].parse().unwrap(),
    )
}

#[test]
fn perplexity_matches_transformers_and_windows_long_texts() {
    let scratch = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let reference = reference(name);
        let ids: Vec<u32> = reference["nll_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let expected_nll: Vec<f64> = reference["token_nll"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(
            expected_nll.len() + 1,
            ids.len(),
            "{name}: reference layout"
        );
        let text = scratch.path().join(format!("{name}.txt"));
        std::fs::write(&text, reference["nll_text"].as_str().unwrap()).unwrap();
        let text = text.to_str().unwrap();
        let artifact = convert(name, "f32", "f32", scratch.path());

        // One window: transformers' mean and per-token NLL.
        let per_token = scratch.path().join(format!("{name}.tsv"));
        let (stdout, stderr) = succeed(&[
            "perplexity",
            "--in-process",
            &artifact,
            text,
            "--token-nll",
            per_token.to_str().unwrap(),
        ]);
        assert!(stderr.contains("tokens/s"), "no progress line: {stderr}");
        assert!(
            stdout.contains("tokens/s"),
            "no speed in the result: {stdout}"
        );
        let (mean, scored) = parse_mean(&stdout);
        let expected_mean = reference["mean_nll"].as_f64().unwrap();
        let lines = read_token_nll(&per_token);
        assert_eq!(scored, ids.len() - 1, "{name}: scored tokens");
        assert_eq!(lines.len(), scored, "{name}: --token-nll lines");
        let mut worst = 0.0f64;
        for (index, (position, token, nll)) in lines.iter().enumerate() {
            assert_eq!(*position, index + 1, "{name}: positions");
            assert_eq!(*token, ids[index + 1], "{name}: the CLI's tokenization");
            worst = worst.max((nll - expected_nll[index]).abs());
        }
        println!(
            "{name}: ninfer perplexity mean NLL {mean:.6} (transformers {expected_mean:.6}) over {scored} tokens; per-token max |ΔNLL| = {worst:.2e}"
        );
        // The file has 6 decimals; the mean is printed with 6 too.
        assert!(worst < 1e-4, "{name}: per-token NLL differs by {worst}");
        assert!(
            (mean - expected_mean).abs() < 1e-4,
            "{name}: mean {mean} vs {expected_mean}"
        );

        // The in-process GPU path: on a machine without one, `auto` falls back to the CPU with
        // the expert kernels, and `cuda` is refused by name.
        let (stdout, _) = succeed(&[
            "perplexity",
            "--in-process",
            &artifact,
            text,
            "--device",
            "auto",
        ]);
        let (auto_mean, _) = parse_mean(&stdout);
        assert!(
            (auto_mean - expected_mean).abs() < 2e-3,
            "{name}: --device auto mean {auto_mean} vs {expected_mean}"
        );
        let output = ninfer(&[
            "perplexity",
            "--in-process",
            &artifact,
            text,
            "--device",
            "cuda",
        ]);
        if output.status.success() {
            let (cuda_mean, _) = parse_mean(&String::from_utf8_lossy(&output.stdout));
            assert!(
                (cuda_mean - expected_mean).abs() < 2e-2,
                "{name}: cuda {cuda_mean}"
            );
        } else {
            let message = String::from_utf8_lossy(&output.stderr);
            assert!(message.contains("--device cuda"), "{message}");
        }

        // A context shorter than the text, through the serving pipeline: non-overlapping
        // windows, first token of each unscored.
        let (stdout, _) = succeed(&[
            "perplexity",
            &artifact,
            text,
            "--device",
            "cpu",
            "--max-context",
            "50",
            "--token-nll",
            per_token.to_str().unwrap(),
        ]);
        let (_, scored) = parse_mean(&stdout);
        let positions: Vec<usize> = read_token_nll(&per_token)
            .iter()
            .map(|line| line.0)
            .collect();
        let expected_positions: Vec<usize> = (0..ids.len()).filter(|p| p % 50 != 0).collect();
        assert_eq!(positions, expected_positions, "{name}: windows of 50");
        assert_eq!(scored, expected_positions.len());
        // The first window's tokens are scored exactly as in the unwindowed run.
        for (index, (_, _, nll)) in read_token_nll(&per_token).iter().take(49).enumerate() {
            assert!((nll - expected_nll[index]).abs() < 1e-4, "{name}: window 0");
        }
    }
}

#[test]
fn perplexity_refuses_an_unknown_architecture_by_name() {
    use ninfer_artifact::header::{Checksum, Preamble, PREAMBLE_LENGTH};
    let scratch = tempfile::tempdir().unwrap();
    let artifact = convert("qwen3_next", "int8", "bf16", scratch.path());
    let path = Path::new(&artifact);
    let mut bytes = std::fs::read(path).unwrap();
    let mut preamble = Preamble::decode(&bytes[..PREAMBLE_LENGTH as usize], path).unwrap();
    let start = preamble.header_offset as usize;
    let end = start + preamble.header_length as usize;
    let header = String::from_utf8(bytes[start..end].to_vec()).unwrap();
    let renamed = header.replace(
        "\"architecture\":\"qwen3_next\"",
        "\"architecture\":\"qwen9_next\"",
    );
    assert_ne!(header, renamed, "the header should name its architecture");
    bytes[start..end].copy_from_slice(renamed.as_bytes());
    preamble.header_checksum = Checksum::of(renamed.as_bytes());
    bytes[..PREAMBLE_LENGTH as usize].copy_from_slice(&preamble.encode());
    std::fs::write(path, &bytes).unwrap();

    let text = scratch.path().join("text.txt");
    std::fs::write(&text, "The teacher opened the old notebook.").unwrap();
    let output = ninfer(&["perplexity", &artifact, text.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("unknown architecture: {}", stderr.trim());
    assert!(!output.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("qwen9_next")
            && stderr.contains(path.file_name().unwrap().to_str().unwrap()),
        "{stderr}"
    );
}
