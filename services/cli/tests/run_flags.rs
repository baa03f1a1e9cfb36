//! Every engine flag is reachable from `ninfer run` / `ninfer serve`: the named ones (including
//! the seeds' `--moe-offload`), `--engine-arg`, and everything after `--`, verbatim. Needs the
//! workspace binaries built next to `ninfer` (`cargo build --workspace --bins`).

mod common;
use common::fixture;

use std::path::Path;
use std::process::{Command, Stdio};

fn ninfer(scratch: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ninfer"));
    std::fs::create_dir_all(scratch.join("runtime")).unwrap();
    command
        .env("XDG_RUNTIME_DIR", scratch.join("runtime"))
        .env("XDG_CACHE_HOME", scratch.join("cache"))
        .env("XDG_STATE_HOME", scratch.join("state"))
        .stdin(Stdio::null());
    command
}

#[test]
fn help_lists_the_engine_flags() {
    for subcommand in ["run", "serve"] {
        let output = Command::new(env!("CARGO_BIN_EXE_ninfer"))
            .args([subcommand, "--help"])
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&output.stdout);
        for flag in [
            "--kv-dtype",
            "--host-kv-mib",
            "--moe-expert-stats",
            "--moe-record-stats",
            "--moe-offload",
            "--max-sequences",
            "--gpus",
            "--gpu-split",
            "--engine-arg",
            "[ENGINE ARGS]...",
        ] {
            assert!(
                help.contains(flag),
                "ninfer {subcommand} --help lacks {flag}:\n{help}"
            );
        }
    }
}

/// A prompt answered with the named flags and a pass-through flag; the engine wrote the
/// routing statistics `--moe-record-stats` asked for at its clean exit.
#[test]
fn named_and_passed_through_flags_reach_the_engine() {
    let scratch = tempfile::tempdir().unwrap();
    let artifact = scratch.path().join("qwen3_moe.ninfer");
    let status = ninfer(scratch.path())
        .args(["convert", "--experts-dtype", "f32", "--dense-dtype", "f32"])
        .arg(fixture("qwen3_moe"))
        .arg(&artifact)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let stats = scratch.path().join("routing.json");
    let output = ninfer(scratch.path())
        .arg("run")
        .arg(&artifact)
        .args([
            "--moe-offload",
            "--moe-threads",
            "1",
            "--kv-dtype",
            "f32",
            "--max-sequences",
            "2",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--prompt",
            "Hello",
            "--moe-record-stats",
        ])
        .arg(&stats)
        .args(["--", "--worker-hang-ms", "900"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let recorded = std::fs::read_to_string(&stats).unwrap_or_else(|error| {
        panic!(
            "no routing statistics in {}: {error}\n{stderr}",
            stats.display()
        )
    });
    assert!(recorded.contains("qwen3_moe"), "{recorded}");

    // A flag the engine does not know, after `--`, reaches it (and is refused there, quoted).
    let output = ninfer(scratch.path())
        .arg("run")
        .arg(&artifact)
        .args(["--moe-threads", "1", "--", "--no-such-engine-flag"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("--no-such-engine-flag"), "{stderr}");
}

/// `ninfer run ORG/NAME` finds the model under `--models-dir` (or `$NINFER_MODELS_DIR`) and
/// says where it looked when it is not there.
#[test]
fn a_model_by_name_resolves_in_the_models_directory() {
    let scratch = tempfile::tempdir().unwrap();
    let models = scratch.path().join("models");
    std::fs::create_dir_all(models.join("Qwen")).unwrap();
    std::os::unix::fs::symlink(fixture("qwen3_moe"), models.join("Qwen/Tiny-MoE")).unwrap();
    let by_flag = ninfer(scratch.path())
        .args([
            "run",
            "Qwen/Tiny-MoE",
            "--dry-run",
            "--json",
            "--models-dir",
        ])
        .arg(&models)
        .output()
        .unwrap();
    assert!(by_flag.status.success(), "{by_flag:?}");
    let plan: serde_json::Value = serde_json::from_slice(&by_flag.stdout).unwrap();
    assert_eq!(plan["architecture"], "qwen3_moe");
    let by_variable = ninfer(scratch.path())
        .args(["serve", "Qwen/Absent-1B"])
        .env("NINFER_MODELS_DIR", &models)
        // Not in the models directory, so it is downloaded: from a hub that is not there.
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env_remove("NINFER_SOURCE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&by_variable.stderr);
    assert!(!by_variable.status.success());
    assert!(
        stderr.contains("Qwen/Absent-1B") && stderr.contains(&models.display().to_string()),
        "{stderr}"
    );
}

/// Linked as the seeds' `ninfer-run` (and `ninfer-serve`, `ninfer-perplexity`), the binary
/// behaves as `ninfer run` (`serve`, `perplexity`).
#[test]
fn the_seeds_program_names_answer() {
    let scratch = tempfile::tempdir().unwrap();
    for (name, expected) in [
        ("ninfer-run", "--dry-run"),
        ("ninfer-serve", "--listen"),
        ("ninfer-perplexity", "--token-nll"),
    ] {
        let link = scratch.path().join(name);
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ninfer"), &link).unwrap();
        let output = Command::new(&link).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && help.contains(expected),
            "{name}:\n{help}"
        );
    }
    let output = Command::new(scratch.path().join("ninfer-run"))
        .args(["--dry-run", "--json"])
        .arg(fixture("qwen3_moe"))
        .env("XDG_CACHE_HOME", scratch.path().join("cache"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(plan["architecture"], "qwen3_moe");
}

/// A machine with two GPUs (described by `--machine-profile`): `--dry-run --json` lists each
/// card's layers, with a host KV pool too; a wrong `--gpu-split` is named.
#[test]
fn two_gpus_are_planned_and_wrong_splits_are_named() {
    let scratch = tempfile::tempdir().unwrap();
    let profile = scratch.path().join("two-gpus.json");
    std::fs::write(
        &profile,
        r#"{"cpus": 4, "ram_gib": 64, "gpus": [{"vram_gib": 24}, {"vram_gib": 16, "name": "small"}]}"#,
    )
    .unwrap();
    // Unnamed, the second card is left alone: the plan and the run use the first.
    let output = ninfer(scratch.path())
        .args(["run", "--dry-run", "--json", "--machine-profile"])
        .arg(&profile)
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(plan["gpus"].as_array().map(Vec::len), Some(1), "{plan}");

    let output = ninfer(scratch.path())
        .args(["run", "--dry-run", "--json", "--machine-profile"])
        .arg(&profile)
        .args(["--gpus", "0,1"])
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let cards = plan["gpus"].as_array().unwrap();
    assert_eq!(cards.len(), 2, "{plan}");
    assert_eq!(cards[0]["first_layer"], 0);
    assert_eq!(cards[1]["name"], "small");
    assert_eq!(
        cards[1]["first_layer"].as_u64().unwrap(),
        cards[0]["last_layer"].as_u64().unwrap() + 1
    );
    let layers = plan["gpus"][1]["last_layer"].as_u64().unwrap() + 1;
    assert!(layers >= 2, "{plan}");

    let output = ninfer(scratch.path())
        .args(["run", "--dry-run", "--machine-profile"])
        .arg(&profile)
        .args(["--gpus", "0,1", "--gpu-split", "50,50"])
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(
        text.contains("gpu 0") && text.contains("gpu 1") && text.contains("small: layers"),
        "{text}"
    );

    let output = ninfer(scratch.path())
        .args(["run", "--dry-run", "--json", "--machine-profile"])
        .arg(&profile)
        .args(["--gpus", "0,1", "--host-kv-mib", "64"])
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let pooled: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(pooled["gpus"].as_array().map(Vec::len), Some(2), "{pooled}");
    assert_eq!(pooled["host_kv_mib"], 64, "{pooled}");

    let output = ninfer(scratch.path())
        .args(["run", "--dry-run", "--machine-profile"])
        .arg(&profile)
        .args(["--gpus", "0,1", "--gpu-split", "60,50"])
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("--gpu-split 60,50"),
        "{stderr}"
    );
}
