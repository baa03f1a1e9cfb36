//! `ninfer-engine --device cuda|auto` on this machine: with no usable GPU, `cuda` exits with an
//! error that names what it looked for, and `auto` warns and serves from the CPU; with a GPU,
//! both start on it. A layer split over stages of one device starts, and a split refuses the
//! features it does not run yet, naming both flags.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ninfer_engine::backend::cuda::CudaBackend;
use ninfer_engine::testing::{write_tiny_model, TinyArchitecture, TinyModelOptions};

/// Starts the engine and returns its stderr lines up to the first one containing any of
/// `until` (then kills it), or everything it printed if it exits first.
fn engine_output(device: &str, until: &[&str]) -> (Vec<String>, Option<i32>) {
    engine_output_with(device, &[], until)
}

/// [`engine_output`] with `extra` arguments.
fn engine_output_with(device: &str, extra: &[&str], until: &[&str]) -> (Vec<String>, Option<i32>) {
    let directory = tempfile::tempdir().unwrap();
    let model = directory.path().join("tiny.ninfer");
    write_tiny_model(&model, TinyModelOptions::new(TinyArchitecture::Qwen3Moe)).unwrap();
    let socket = directory.path().join("engine.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ninfer-engine"))
        .args(["--device", device, "--model"])
        .arg(&model)
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .args(["--moe-threads", "1"])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut lines = Vec::new();
    for line in BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        let done = until.iter().any(|u| line.contains(u));
        lines.push(line);
        if done || Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
    }
    let status = child.wait().unwrap();
    (lines, status.code())
}

#[test]
fn device_cuda_fails_clearly_and_auto_falls_back_without_a_gpu() {
    let gpu = CudaBackend::shared();
    let (lines, code) = engine_output("auto", &["engine ready"]);
    let text = lines.join("\n");
    match &gpu {
        Ok(_) => assert!(text.contains("dense layers on the GPU"), "{text}"),
        Err(_) => assert!(
            text.contains("--device auto: no usable GPU, running on the CPU"),
            "{text}"
        ),
    }
    assert!(
        text.contains("engine ready"),
        "auto did not start: {code:?}\n{text}"
    );

    let (lines, code) = engine_output("cuda", &["engine ready"]);
    let text = lines.join("\n");
    match gpu {
        Ok(_) => assert!(text.contains("engine ready"), "{text}"),
        Err(error) => {
            assert_ne!(
                code,
                Some(0),
                "--device cuda without a GPU must fail:\n{text}"
            );
            assert!(text.contains("--device cuda"), "{text}");
            // The message says what was looked for: the driver library names, or the device.
            assert!(
                text.contains("libcuda.so.1") || text.contains("no usable CUDA device"),
                "{text}"
            );
            println!("--device cuda without a GPU: {error}");
        }
    }
}

/// Runs the engine to its exit with `arguments`; its stderr and exit code.
fn engine_exit(arguments: &[&str]) -> (String, Option<i32>) {
    let directory = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_ninfer-engine"))
        .args(["--model", "absent.ninfer", "--listen"])
        .arg(format!(
            "unix:{}",
            directory.path().join("e.sock").display()
        ))
        .args(arguments)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&output.stderr).into_owned(),
        output.status.code(),
    )
}

/// A wrong `--gpus` / `--gpu-split` / `--pipeline-stages-on-one-device` is named. Checked
/// before the driver or the model is opened, so it holds on any machine.
#[test]
fn wrong_split_choices_are_named() {
    for (arguments, named) in [
        (
            &["--pipeline-stages-on-one-device", "2", "--gpus", "0,1"][..],
            "name one card",
        ),
        (
            &[
                "--pipeline-stages-on-one-device",
                "2",
                "--gpu-split",
                "20,30,50",
            ][..],
            "--gpu-split 20,30,50",
        ),
        (
            &["--pipeline-stages-on-one-device", "0"][..],
            "give 1 or more",
        ),
        (
            &["--device", "cpu", "--gpus", "0,1"][..],
            "--gpus 0,1 with --device cpu",
        ),
    ] {
        let (stderr, code) = engine_exit(arguments);
        assert_ne!(code, Some(0), "{arguments:?}: {stderr}");
        assert!(stderr.contains(named), "{arguments:?}: {stderr}");
    }
    for (arguments, named) in [
        (
            &["--gpus", "0,1", "--gpu-split", "60,30"][..],
            "--gpu-split 60,30",
        ),
        (
            &["--gpus", "0", "--gpu-split", "60,40"][..],
            "--gpu-split 60,40",
        ),
        (&["--gpus", "zero"][..], "--gpus zero"),
    ] {
        let (stderr, code) = engine_exit(arguments);
        assert_ne!(code, Some(0), "{arguments:?}: {stderr}");
        assert!(stderr.contains(named), "{arguments:?}: {stderr}");
    }
}

/// The engine splits the model over two CPU backends (`--pipeline-stages-on-one-device 2`,
/// 25/75: one layer, then three), with a host KV pool asked for (each stage gets its share),
/// and serves: each stage is logged with its layers.
#[test]
fn the_engine_starts_split_over_two_stages_of_one_device() {
    let (lines, code) = engine_output_with(
        "cpu",
        &[
            "--pipeline-stages-on-one-device",
            "2",
            "--gpu-split",
            "25,75",
            "--host-kv-mib",
            "64",
        ],
        &["engine ready"],
    );
    let text = lines.join("\n");
    assert!(
        text.contains("engine ready"),
        "the split engine did not start: {code:?}\n{text}"
    );
    let stages: Vec<String> = lines
        .iter()
        .map(|line| without_colours(line))
        .filter(|line| line.contains("pipeline stage"))
        .collect();
    assert_eq!(stages.len(), 2, "{text}");
    assert!(
        stages[0].contains("first_layer=0") && stages[0].contains("last_layer=0"),
        "{text}"
    );
    assert!(
        stages[1].contains("first_layer=1") && stages[1].contains("last_layer=3"),
        "{text}"
    );
}

/// `line` without its ANSI colour sequences (`ESC [ … m`).
fn without_colours(line: &str) -> String {
    let mut plain = String::with_capacity(line.len());
    let mut characters = line.chars();
    while let Some(character) = characters.next() {
        if character == '\u{1b}' {
            for inside in characters.by_ref() {
                if inside == 'm' {
                    break;
                }
            }
        } else {
            plain.push(character);
        }
    }
    plain
}
