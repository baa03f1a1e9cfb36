//! Models by name, against a fake hub on loopback (no network): `ninfer run ORG/NAME
//! --dry-run` plans from the hub's config and headers, `ninfer convert ORG/NAME` converts the
//! fixture checkpoint while it streams from either hub's API (resuming a range whose
//! connection was cut), refuses a file whose SHA-256 does not match, and names the model a 404
//! is about. And plans for machines this one is not: `--dry-run --plan-json
//! --machine-profile FILE` for a 16 GB card with 64 GB of RAM and a 24 GB card with 128 GB.

mod common;
use common::fake_hub::{FakeHub, Repo};
use common::fixture;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Files of the fixture checkpoint the fake hub serves.
const SERVED_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors",
];

/// A hub serving `Org/Tiny` (the fixture; the first answer for its weights is cut halfway)
/// and `Org/Corrupt` (the fixture with a wrong checksum listed for its config).
fn start_hub() -> FakeHub {
    let mut tiny = Repo::from_directory(&fixture("qwen3_moe"), &SERVED_FILES);
    tiny.cut_first = vec!["model.safetensors".into()];
    let mut corrupt = Repo::from_directory(&fixture("qwen3_moe"), &SERVED_FILES);
    corrupt.wrong_sha = vec!["config.json".into()];
    FakeHub::start(HashMap::from([
        ("Org/Tiny".to_string(), tiny),
        ("Org/Corrupt".to_string(), corrupt),
    ]))
}

fn ninfer(scratch: &Path, hub: &FakeHub) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ninfer"));
    std::fs::create_dir_all(scratch.join("runtime")).unwrap();
    command
        .env("XDG_RUNTIME_DIR", scratch.join("runtime"))
        .env("XDG_CACHE_HOME", scratch.join("cache"))
        .env("XDG_STATE_HOME", scratch.join("state"))
        .env("NINFER_MODELS_DIR", scratch.join("models"))
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("MODELSCOPE_ENDPOINT", &hub.endpoint)
        .env_remove("NINFER_SOURCE")
        .env_remove("HF_TOKEN")
        .stdin(Stdio::null());
    command
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).to_string()
}

#[test]
fn a_model_by_name_is_planned_and_converted_from_its_hub() {
    let scratch = tempfile::tempdir().unwrap();
    let hub = start_hub();
    let models = scratch.path().join("models");

    // A dry run plans from the config and the header, and writes no model.
    let dry = ninfer(scratch.path(), &hub)
        .args(["run", "Org/Tiny", "--dry-run", "--plan-json"])
        .output()
        .unwrap();
    assert!(dry.status.success(), "{}", stderr_of(&dry));
    let plan: serde_json::Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!(plan["architecture"], "qwen3_moe");
    assert!(
        !models.exists(),
        "a dry run wrote into the models directory"
    );

    // `convert ORG/NAME` converts the checkpoint while it streams (the weights' range resumed
    // after a cut) into what a local conversion writes.
    let output = scratch.path().join("tiny.ninfer");
    let converted = ninfer(scratch.path(), &hub)
        .args([
            "convert",
            "--experts-dtype",
            "f32",
            "--dense-dtype",
            "f32",
            "Org/Tiny",
        ])
        .arg(&output)
        .output()
        .unwrap();
    assert!(converted.status.success(), "{}", stderr_of(&converted));
    let local = scratch.path().join("local.ninfer");
    common::convert_fixture_f32("qwen3_moe", &local);
    assert!(std::fs::read(&output).unwrap() == std::fs::read(&local).unwrap());
    assert!(!models.exists());
    let weights: Vec<Option<String>> = hub
        .requests
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, file, _)| file == "model.safetensors")
        .map(|(_, _, range)| range.clone())
        .collect();
    assert_eq!(
        weights[..3],
        [
            Some("bytes=0-7".to_string()),
            Some("bytes=4-7".to_string()),
            weights[2].clone()
        ],
        "the cut range was not resumed from where it stopped"
    );
    let progress = stderr_of(&converted);
    assert!(progress.contains("tensors, fetched"), "{progress}");
}

#[test]
fn modelscope_serves_the_same_and_failures_name_the_model() {
    let scratch = tempfile::tempdir().unwrap();
    let hub = start_hub();
    let output = scratch.path().join("tiny.ninfer");
    let converted = ninfer(scratch.path(), &hub)
        .args(["convert", "--experts-dtype", "f32", "--dense-dtype", "f32"])
        .args(["--source", "modelscope", "Org/Tiny"])
        .arg(&output)
        .output()
        .unwrap();
    assert!(converted.status.success(), "{}", stderr_of(&converted));
    assert!(output.is_file());

    // NINFER_SOURCE chooses the hub too; an unknown model is a 404 that names it.
    let missing = ninfer(scratch.path(), &hub)
        .args(["run", "Org/Nowhere", "--prompt", "Hi"])
        .env("NINFER_SOURCE", "modelscope")
        .output()
        .unwrap();
    let message = stderr_of(&missing);
    assert!(!missing.status.success());
    assert!(
        message.contains("Org/Nowhere")
            && message.contains("404")
            && message.contains("ModelScope"),
        "{message}"
    );
    let missing = ninfer(scratch.path(), &hub)
        .args(["serve", "Org/Nowhere"])
        .output()
        .unwrap();
    let message = stderr_of(&missing);
    assert!(
        message.contains("Org/Nowhere: no such model on Hugging Face (404"),
        "{message}"
    );

    // A file whose checksum does not match is refused and removed.
    let corrupt = ninfer(scratch.path(), &hub)
        .args(["convert", "Org/Corrupt"])
        .arg(scratch.path().join("corrupt.ninfer"))
        .output()
        .unwrap();
    let message = stderr_of(&corrupt);
    assert!(!corrupt.status.success());
    assert!(
        message.contains("config.json") && message.contains("does not match"),
        "{message}"
    );
    let files = scratch.path().join("cache/ninfer/hub/Org/Corrupt/files");
    let leftovers: Vec<_> = std::fs::read_dir(files)
        .unwrap()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().to_string())
        .filter(|name| name.starts_with("config.json"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert!(!scratch.path().join("corrupt.ninfer").exists());
}

/// The plan for a machine described in a file, as JSON.
fn plan_for_profile(scratch: &Path, profile: serde_json::Value) -> serde_json::Value {
    let file = scratch.join("machine.json");
    std::fs::write(&file, profile.to_string()).unwrap();
    let hub = FakeHub::start(HashMap::new());
    let output = ninfer(scratch, &hub)
        .args(["run", "--dry-run", "--plan-json", "--machine-profile"])
        .arg(&file)
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr_of(&output));
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn plans_for_machine_profiles() {
    let scratch = tempfile::tempdir().unwrap();
    let small = plan_for_profile(
        scratch.path(),
        serde_json::json!({"cpus": 8, "numa_nodes": 1, "ram_gib": 64, "gpu_vram_gib": 16}),
    );
    let large = plan_for_profile(
        scratch.path(),
        serde_json::json!({"cpus": 32, "numa_nodes": 2, "ram_gib": 128, "gpu_vram_gib": 24}),
    );
    for plan in [&small, &large] {
        // A GPU: experts fitted on it by default; the tiny model fits whole.
        assert_eq!(plan["gpu_experts"], "auto", "{plan}");
        let experts = plan["gpu_experts_estimate"].as_u64().unwrap();
        assert!(experts > 0, "{plan}");
        assert!(plan["max_context"].as_u64().unwrap() > 0);
        assert_eq!(plan["kv_dtype"], "bf16");
        assert_eq!(plan["mtp_draft_tokens"], 0);
        // Dense weights on the GPU: host RAM holds the expert banks.
        assert_eq!(plan["host_ram_bytes"], plan["expert_bank_bytes"], "{plan}");
    }
    assert_eq!(small["machine"]["gpu"]["total_bytes"], 16u64 << 30);
    assert_eq!(small["machine"]["ram_total_bytes"], 64u64 << 30);
    assert_eq!(small["expert_workers"].as_array().unwrap().len(), 1);
    assert_eq!(small["expert_workers"][0]["threads"], 8);
    assert_eq!(large["machine"]["gpu"]["total_bytes"], 24u64 << 30);
    assert_eq!(large["expert_workers"].as_array().unwrap().len(), 2);
    assert_eq!(large["expert_workers"][1]["experts"], "shard=1/2");

    // Values are checked against the profile's machine, not this one.
    let file = scratch.path().join("machine.json");
    std::fs::write(&file, r#"{"cpus": 4, "ram_gib": 8}"#).unwrap();
    let hub = FakeHub::start(HashMap::new());
    let refused = ninfer(scratch.path(), &hub)
        .args([
            "run",
            "--dry-run",
            "--moe-threads",
            "6",
            "--machine-profile",
        ])
        .arg(&file)
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        stderr_of(&refused).contains("--moe-threads 6: this machine lets ninfer use 4 CPUs"),
        "{}",
        stderr_of(&refused)
    );
    std::fs::write(&file, r#"{"cpus": 4, "ram": 8}"#).unwrap();
    let malformed = ninfer(scratch.path(), &hub)
        .args(["run", "--dry-run", "--machine-profile"])
        .arg(&file)
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(!malformed.status.success());
    assert!(
        stderr_of(&malformed).contains("--machine-profile"),
        "{}",
        stderr_of(&malformed)
    );
}
