//! Bad input through the real `ninfer` binary: each case must exit non-zero with a message that
//! names the file and the problem, never panic, and leave no output file behind.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn ninfer(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(args)
        .output()
        .expect("running ninfer")
}

/// A writable copy of a fixture checkpoint.
fn copy_fixture(name: &str, into: &Path) -> PathBuf {
    let target = into.join(name);
    std::fs::create_dir_all(&target).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, target.join(path.file_name().unwrap())).unwrap();
    }
    target
}

/// Asserts a failed run: non-zero exit, no panic, every `needles` in stderr, nothing in `output_dir`.
fn assert_clean_failure(output: &Output, needles: &[&str], output_dir: &Path) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "expected failure, got success; stderr:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "panicked:\n{stderr}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "stderr does not mention `{needle}`:\n{stderr}"
        );
    }
    let left: Vec<_> = std::fs::read_dir(output_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
}

/// Rewrites the JSON header of a safetensors file (data section unchanged).
fn edit_safetensors_header(
    path: &Path,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) {
    let bytes = std::fs::read(path).unwrap();
    let header_length = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + header_length]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_vec(&header).unwrap();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut rewritten = (text.len() as u64).to_le_bytes().to_vec();
    rewritten.extend_from_slice(&text);
    rewritten.extend_from_slice(&bytes[8 + header_length..]);
    std::fs::write(path, rewritten).unwrap();
}

struct Case {
    _scratch: tempfile::TempDir,
    checkpoint: PathBuf,
    output_dir: PathBuf,
    output: PathBuf,
}

fn case(fixture_name: &str) -> Case {
    let scratch = tempfile::tempdir().unwrap();
    let checkpoint = copy_fixture(fixture_name, scratch.path());
    let output_dir = scratch.path().join("out");
    std::fs::create_dir_all(&output_dir).unwrap();
    let output = output_dir.join("model.ninfer");
    Case {
        _scratch: scratch,
        checkpoint,
        output_dir,
        output,
    }
}

fn convert(case: &Case) -> Output {
    ninfer(&[
        Path::new("convert"),
        &case.checkpoint,
        &case.output,
        Path::new("--max-file-gb"),
        Path::new("0.0001"),
    ])
}

#[test]
fn truncated_safetensors_is_named() {
    let case = case("qwen3_moe");
    let weights = case.checkpoint.join("model.safetensors");
    let length = std::fs::metadata(&weights).unwrap().len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap();
    file.set_len(length / 2).unwrap();
    assert_clean_failure(
        &convert(&case),
        &["model.safetensors", "truncated"],
        &case.output_dir,
    );
}

#[test]
fn wrong_shape_is_named() {
    let case = case("qwen3_moe");
    edit_safetensors_header(&case.checkpoint.join("model.safetensors"), |header| {
        let tensor = header
            .get_mut("model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        let shape = tensor["shape"].as_array().unwrap().clone();
        tensor["shape"] = serde_json::json!([shape[1], shape[0]]);
    });
    assert_clean_failure(
        &convert(&case),
        &[
            "model.safetensors",
            "model.layers.0.self_attn.q_proj.weight",
            "shape",
        ],
        &case.output_dir,
    );
}

#[test]
fn missing_tensor_is_named() {
    let case = case("qwen3_next");
    edit_safetensors_header(&case.checkpoint.join("model.safetensors"), |header| {
        header.remove("model.layers.0.linear_attn.A_log");
    });
    assert_clean_failure(
        &convert(&case),
        &["missing tensor", "model.layers.0.linear_attn.A_log"],
        &case.output_dir,
    );
}

/// A missing tensor of the multimodal release is named as that checkpoint spells it
/// (`model.language_model.*`), and a missing fused expert tensor by its fused name.
#[test]
fn missing_tensor_is_named_as_the_checkpoint_spells_it() {
    for (removed, named) in [
        (
            "model.language_model.layers.1.mlp.experts.gate_up_proj",
            "missing tensor `model.language_model.layers.1.mlp.experts.gate_up_proj`",
        ),
        (
            "model.language_model.layers.3.self_attn.q_proj.weight",
            "missing tensor `model.language_model.layers.3.self_attn.q_proj.weight`",
        ),
    ] {
        let case = case("qwen3_5_moe");
        edit_safetensors_header(&case.checkpoint.join("model.safetensors"), |header| {
            assert!(header.remove(removed).is_some(), "{removed} not in fixture");
        });
        assert_clean_failure(&convert(&case), &[named], &case.output_dir);
    }
}

/// `--reuse` with an artifact of another model would copy its weights by name: refused, naming
/// the old artifact, before anything is written.
#[test]
fn reuse_of_another_models_artifact_is_refused() {
    let other = case("qwen3_next");
    let converted = ninfer(&[Path::new("convert"), &other.checkpoint, &other.output]);
    assert!(
        converted.status.success(),
        "{}",
        String::from_utf8_lossy(&converted.stderr)
    );
    let case = case("qwen3_moe");
    let output = ninfer(&[
        Path::new("convert"),
        &case.checkpoint,
        &case.output,
        Path::new("--reuse"),
        &other.output,
    ]);
    assert_clean_failure(
        &output,
        &[
            &other.output.display().to_string(),
            "--reuse needs an artifact of the same model",
            "qwen3_next",
        ],
        &case.output_dir,
    );
}

#[test]
fn unknown_model_type_is_named() {
    let case = case("qwen3_5_moe");
    let config_path = case.checkpoint.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    config["model_type"] = serde_json::json!("llama4");
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    assert_clean_failure(
        &convert(&case),
        &["config.json", "unknown model_type `llama4`"],
        &case.output_dir,
    );
}

#[test]
fn damaged_artifacts_are_refused_by_inspect() {
    let case = case("qwen3_moe");
    let converted = convert(&case);
    assert!(
        converted.status.success(),
        "{}",
        String::from_utf8_lossy(&converted.stderr)
    );
    let part = PathBuf::from(format!("{}.part-0001", case.output.display()));
    assert!(
        part.exists(),
        "the tiny --max-file-gb should have split the artifact"
    );
    let inspect = ninfer(&[Path::new("inspect"), Path::new("--verify"), &case.output]);
    assert!(
        inspect.status.success(),
        "{}",
        String::from_utf8_lossy(&inspect.stderr)
    );

    // A flipped byte in the data: `--verify` names the tensor.
    let good = std::fs::read(&part).unwrap();
    let mut damaged = good.clone();
    damaged[100] ^= 0x40;
    std::fs::write(&part, &damaged).unwrap();
    let output = ninfer(&[Path::new("inspect"), Path::new("--verify"), &case.output]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success()
            && stderr.contains("checksum mismatch")
            && stderr.contains("model.ninfer"),
        "{stderr}"
    );

    // A truncated part.
    std::fs::write(&part, &good[..good.len() / 2]).unwrap();
    let output = ninfer(&[Path::new("inspect"), &case.output]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success()
            && stderr.contains("model.ninfer.part-0001")
            && stderr.contains("bytes, expected"),
        "{stderr}"
    );

    // A missing part.
    std::fs::remove_file(&part).unwrap();
    let output = ninfer(&[Path::new("inspect"), &case.output]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success()
            && stderr.contains("missing part file")
            && stderr.contains("part-0001"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"));
}
