//! Every engine flag is reachable from `ninfer run` / `ninfer serve`: the named ones (including
//! the seeds' `--moe-offload`), `--engine-arg`, and everything after `--`, verbatim. Needs the
//! workspace binaries built next to `ninfer` (`cargo build --workspace --bins`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

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
