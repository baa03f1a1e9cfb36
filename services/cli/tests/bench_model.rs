//! `ninfer bench MODEL` on a tiny synthetic qwen3-30b-a3b (2 layers, shrunk): with expert
//! workers and in-process, the JSON report has every field, positive speeds, a time split that
//! adds up to no more than the measured time per token, expert bytes per decoded token equal to
//! (distinct CPU experts per token × stride) — top-k per MoE layer at batch 1 — and a roofline
//! ratio in (0, 1.5]; decode step percentiles with p50 ≤ p99; `--decode-during-prefill` with
//! its solo and during-prefill windows; a missing MODEL fails naming the file. Speeds are not
//! judged here.

use std::path::Path;
use std::process::Command;

mod common;

use serde_json::Value;

use common::binary;

/// A short bench on the CPU: one 16-token prompt, 4 decoded tokens, one expert thread, a small
/// RAM bandwidth reference.
const SMALL_CPU_BENCH: &[&str] = &[
    "--device",
    "cpu",
    "--prompt-lengths",
    "16",
    "--decode-tokens",
    "4",
    "--moe-threads",
    "1",
    "--ram-buffer-gib",
    "0.0625",
    "--ram-passes",
    "2",
];

fn ninfer(args: &[&str], directory: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(args)
        .current_dir(directory)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running ninfer")
}

fn number(value: &Value, path: &str) -> f64 {
    let mut current = value;
    for key in path.split('.') {
        current = current
            .get(key)
            .unwrap_or_else(|| panic!("`{path}` missing in the report: {value:#}"));
    }
    current
        .as_f64()
        .unwrap_or_else(|| panic!("`{path}` is not a number: {current}"))
}

/// Step percentiles at the client: `steps` gaps (when given), 0 ≤ p50 ≤ p99 ≤ max.
fn check_steps(steps: &Value, expected: f64) {
    let (p50, p99, max) = (
        number(steps, "p50_ms"),
        number(steps, "p99_ms"),
        number(steps, "max_ms"),
    );
    assert!(0.0 <= p50 && p50 <= p99 && p99 <= max, "{steps:#}");
    if expected > 0.0 {
        assert_eq!(number(steps, "steps"), expected, "{steps:#}");
    }
}

/// Converts the shrunk two-layer qwen3-30b-a3b into `dir/model.ninfer`.
fn convert_tiny_moe(dir: &Path) {
    let output = ninfer(
        &[
            "convert",
            "--synthetic",
            "qwen3-30b-a3b",
            "--scale-down",
            "--layers",
            "2",
            "--experts-dtype",
            "int8",
            "--routing",
            "uniform",
            "model.ninfer",
        ],
        dir,
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `placed`: routed experts per layer in (host-backed) "GPU" slots; `decode_tokens`: the run's
/// `--decode-tokens`.
fn check_report(
    report: &Value,
    executor: &str,
    top_k: f64,
    moe_layers: f64,
    placed: u64,
    decode_tokens: f64,
) {
    assert_eq!(report["device"], "cpu");
    assert_eq!(report["expert_executor"], executor);
    for key in [
        "model",
        "architecture",
        "moe_gpu_experts",
        "expert_stride_bytes",
        "dense_weight_bytes_per_forward",
        "ram_bandwidth",
        "device_bandwidth_gbps",
        "roofline",
    ] {
        assert!(report.get(key).is_some(), "`{key}` missing: {report:#}");
    }
    assert!(report["roofline"]["denominator"].is_string());
    assert!(number(report, "ram_bandwidth.best_gbps") > 0.0);
    let stride = number(report, "expert_stride_bytes");
    assert!(stride > 0.0);
    let results = report["results"].as_array().expect("results");
    assert_eq!(results.len(), 1);
    let row = &results[0];
    assert_eq!(number(row, "prompt_tokens"), 16.0);
    assert!(number(row, "prefill_tok_s") > 0.0);
    assert!(number(row, "decode_tok_s") > 0.0);
    for phase in ["prefill", "decode"] {
        let figures = &row[phase];
        let measured = number(figures, "ms_per_token");
        let engine = number(figures, "engine_forward_ms_per_token");
        assert!(measured > 0.0 && engine > 0.0, "{figures:#}");
        let split = &figures["split_ms_per_token"];
        let parts = ["gpu_dense", "cpu_experts", "channel_wait", "transfers"];
        let mut sum = 0.0;
        for part in parts {
            let value = number(split, part);
            assert!(value >= 0.0, "{phase}.{part} = {value}");
            sum += value;
        }
        // The engine's parts add up to its forward time, which the client's time includes.
        assert!(
            (sum - engine).abs() <= 1e-6 + 1e-9 * engine,
            "{phase}: parts {sum} vs forward {engine}"
        );
        // The client's clock starts at the first token's delivery, which can come after the
        // engine began the next forward (up to one forward of slack); the bench never reports
        // less than the engine's own time (tokens delivered together on a busy machine).
        let tokens = number(figures, "tokens").max(1.0);
        assert!(
            measured >= engine - 1e-9,
            "{phase}: measured {measured} < forward {engine}"
        );
        assert!(
            sum <= measured * 1.1 + engine / tokens + 0.05,
            "{phase}: parts {sum} ms > measured {measured} ms"
        );
        let other = number(split, "other");
        assert!(other >= 0.0 && sum + other >= measured - 1e-6);
        if placed == 0 {
            assert_eq!(number(figures, "gpu_experts_per_token"), 0.0);
        }
    }
    let decode = &row["decode"];
    assert_eq!(number(decode, "tokens"), decode_tokens);
    assert_eq!(number(decode, "forwards"), decode_tokens);
    // Batch 1: each MoE layer computes the token's top-k experts, all distinct: on the CPU, or
    // from the slots when placed there.
    let experts = number(decode, "cpu_experts_per_token");
    let resident = number(decode, "gpu_experts_per_token");
    assert_eq!(experts + resident, top_k * moe_layers);
    let bytes = number(decode, "cpu_expert_bytes_per_token");
    assert!(bytes > 0.0 || placed > 0);
    assert_eq!(bytes, experts * stride);
    let resident_bytes = number(decode, "gpu_expert_bytes_per_token");
    assert_eq!(resident_bytes, resident * stride);
    check_steps(&row["decode_step_ms"], decode_tokens);
    let per_repeat = row["decode_step_ms_per_repeat"]
        .as_array()
        .expect("decode_step_ms_per_repeat");
    assert_eq!(per_repeat.len(), 1, "{row:#}");
    check_steps(&per_repeat[0], decode_tokens);
    let ratio = number(row, "roofline_ratio");
    assert!(ratio > 0.0 && ratio <= 1.5, "roofline ratio {ratio}");
    let ideal = number(row, "ideal_ms_per_token");
    let ram = number(row, "ram_bytes_per_token");
    // The CPU device reads experts (both kinds) and dense weights from RAM.
    assert_eq!(
        ram,
        bytes + number(report, "dense_weight_bytes_per_forward") + resident_bytes
    );
    let expected_ideal = ram / (number(report, "ram_bandwidth.best_gbps") * 1e9) * 1e3;
    assert!((ideal - expected_ideal).abs() <= 1e-9 + 1e-6 * expected_ideal);
    if placed > 0 {
        // Every routed choice of the measured run is a hit or a miss: 16 prompt tokens and
        // `decode_tokens` decode forwards, top-k per MoE layer. The decode-only counts (from
        // the first token, read beside the stream, so possibly in the middle of a step, whose
        // layers count as they run) are at most the decode's.
        let cache = &report["expert_cache"];
        let per_token = top_k * moe_layers;
        let all = number(cache, "hits") + number(cache, "misses");
        assert_eq!(all, (16.0 + decode_tokens) * per_token, "{cache:#}");
        let decode = number(cache, "decode_hits") + number(cache, "decode_misses");
        assert!(decode <= decode_tokens * per_token, "{cache:#}");
        let rate = number(cache, "decode_hit_rate");
        assert!((0.0..=1.0).contains(&rate), "{cache:#}");
    }
}

#[test]
fn bench_model_reports_every_figure_with_and_without_workers() {
    // The worker is started from next to `ninfer`; make sure it is there.
    binary("ninfer-expert-worker");
    binary("ninfer-engine");
    let directory = tempfile::tempdir().unwrap();
    let dir = directory.path();
    convert_tiny_moe(dir);
    let artifact = ninfer_artifact::Artifact::open(&dir.join("model.ninfer")).unwrap();
    let common = artifact.config().common().clone();
    let top_k = common.num_experts_per_tok as f64;
    let moe_layers = common.moe_layers.iter().filter(|&&m| m).count() as f64;
    drop(artifact);

    let half = (common.num_experts / 2) as u64;
    for (extra, executor, placed) in [
        (&[][..], "remote-workers", 0),
        // With the batch-decode table: batch 1 and batch 2.
        (
            &["--no-workers", "--decode-batch", "1,2"][..],
            "cpu-kernels-in-process",
            0,
        ),
        // The CPU backend keeps "GPU" slots in host memory: the split logic runs anyway.
        (&["--moe-gpu-experts", "half"][..], "remote-workers", half),
    ] {
        // A batch's sequences must decode at the same time: with only a few tokens each, the
        // first can finish before the second's prompt is in (16 were too few once on a loaded
        // 2-core machine), so the batch run decodes more.
        let batch = extra.contains(&"--decode-batch");
        let (decode_tokens, decode_arg) = if batch { (64.0, "64") } else { (4.0, "4") };
        let mut args = vec!["bench", "model.ninfer"];
        args.extend_from_slice(SMALL_CPU_BENCH);
        let flag = args.iter().position(|&arg| arg == "--decode-tokens");
        args[flag.expect("SMALL_CPU_BENCH sets --decode-tokens") + 1] = decode_arg;
        args.push("--json");
        args.extend_from_slice(extra);
        let output = ninfer(&args, dir);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{args:?}: {stderr}");
        let report: Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {stderr}"));
        assert_eq!(report["gpu_experts_per_layer"], placed, "{args:?}");
        check_report(&report, executor, top_k, moe_layers, placed, decode_tokens);
        if batch {
            let rows = report["decode_batches"].as_array().expect("decode_batches");
            let sequences: Vec<u64> = rows
                .iter()
                .filter_map(|r| r["sequences"].as_u64())
                .collect();
            assert_eq!(sequences, [1, 2], "{report}");
            for row in rows {
                let aggregate = row["aggregate_tok_s"].as_f64().unwrap_or(0.0);
                let per_sequence = row["per_sequence_tok_s"].as_f64().unwrap_or(0.0);
                assert!(aggregate > 0.0 && per_sequence > 0.0, "{row}");
                assert!(row["aggregate_over_batch_1"].as_f64().is_some(), "{row}");
                check_steps(&row["step_ms"], 0.0);
                // The CPU device reads every weight from RAM: the dense ones at least.
                let ram = row["ram_bytes_per_step"].as_f64().unwrap_or(0.0);
                assert!(ram > 0.0, "{row}");
                assert_eq!(row["device_bytes_per_step"].as_f64(), Some(0.0), "{row}");
                let share = row["roofline_ratio"].as_f64().unwrap_or(0.0);
                assert!(share > 0.0 && share.is_finite(), "{row}");
            }
        } else {
            assert!(report.get("decode_batches").is_none(), "{report}");
        }
        if executor == "remote-workers" {
            assert_eq!(report["expert_compute_reported_by_workers"], true);
        }
    }
}

/// One stream decodes alone, then beside a 64-token prompt fed in chunks of 16 (so the stream
/// gets tokens between them): both windows, their ratio, the longest gap and the long prompt's
/// prefill figures are reported. In process, one decode length, to stay quick on two cores.
#[test]
fn bench_model_decodes_during_a_long_prefill() {
    binary("ninfer-engine");
    let directory = tempfile::tempdir().unwrap();
    let dir = directory.path();
    convert_tiny_moe(dir);
    let mut args = vec!["bench", "model.ninfer", "--no-workers"];
    args.extend_from_slice(SMALL_CPU_BENCH);
    args.extend_from_slice(&[
        "--decode-during-prefill",
        "64",
        "--engine-arg=--prefill-chunk-tokens",
        "--engine-arg=16",
        "--json",
    ]);
    let output = ninfer(&args, dir);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {stderr}"));
    check_steps(&report["results"][0]["decode_step_ms"], 4.0);
    let figures = &report["decode_during_prefill"];
    assert_eq!(number(figures, "prompt_tokens"), 64.0, "{figures:#}");
    assert_eq!(number(figures, "stream_prompt_tokens"), 16.0, "{figures:#}");
    assert_eq!(number(figures, "solo.tokens"), 4.0, "{figures:#}");
    check_steps(&figures["solo"]["step_ms"], 4.0);
    assert!(number(figures, "solo.tok_s") > 0.0, "{figures:#}");
    // Three chunks end before the last one gives the prompt its first token, and the stream
    // decodes between any two.
    let during = number(figures, "during_prefill.tokens");
    assert!(during >= 1.0, "{figures:#}");
    assert!(number(figures, "during_prefill.tok_s") > 0.0, "{figures:#}");
    check_steps(&figures["during_prefill"]["step_ms"], 0.0);
    assert!(number(figures, "during_over_solo") > 0.0, "{figures:#}");
    let gap = number(figures, "longest_gap_ms");
    assert!(gap >= 0.0, "{figures:#}");
    assert_eq!(gap, number(figures, "during_prefill.step_ms.max_ms"));
    let ttft = number(figures, "time_to_first_token_ms");
    assert!(ttft > 0.0, "{figures:#}");
    assert_eq!(number(figures, "during_prefill.window_ms"), ttft);
    let rate = number(figures, "prefill_tok_s");
    assert!(
        (rate - 64.0 / (ttft / 1e3)).abs() <= 1e-6 * rate,
        "{figures:#}"
    );
    assert!(
        number(figures, "stream_max_new_tokens") >= 4.0 + 1.0 + 4.0,
        "{figures:#}"
    );
}

#[test]
fn bench_model_refuses_a_bad_decode_during_prefill() {
    let directory = tempfile::tempdir().unwrap();
    let dir = directory.path();
    convert_tiny_moe(dir);
    for value in ["1", "x"] {
        let output = ninfer(
            &[
                "bench",
                "model.ninfer",
                "--device",
                "cpu",
                "--decode-during-prefill",
                value,
            ],
            dir,
        );
        assert!(!output.status.success(), "{value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("--decode-during-prefill"),
            "{value}: {stderr}"
        );
    }
}

/// `--gpus` reaches the plan the bench starts its processes from, which checks it against the
/// machine and names it (here no second card, or the CPU device it is not for).
#[test]
fn bench_model_plans_with_the_gpus_it_is_given() {
    let directory = tempfile::tempdir().unwrap();
    let dir = directory.path();
    convert_tiny_moe(dir);
    let mut args = vec!["bench", "model.ninfer", "--gpus", "0,1"];
    args.extend_from_slice(SMALL_CPU_BENCH);
    let output = ninfer(&args, dir);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("--gpus 0,1"), "{stderr}");
}

#[test]
fn bench_model_names_a_missing_model_file() {
    let directory = tempfile::tempdir().unwrap();
    let output = ninfer(
        &["bench", "no-such-model.ninfer", "--device", "cpu", "--json"],
        directory.path(),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no-such-model.ninfer"),
        "the error names the file: {stderr}"
    );
    assert!(output.stdout.is_empty());
    // Not a model at all: the artifact reader's refusal, still naming the file.
    std::fs::write(directory.path().join("junk.ninfer"), b"not an artifact").unwrap();
    let output = ninfer(
        &["bench", "junk.ninfer", "--device", "cpu"],
        directory.path(),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("junk.ninfer"), "{stderr}");
}

/// The dense and the Qwen4-Exp presets bench on the CPU backend at two layers of toy width (the
/// Qwen4-Exp one with its PLE layer and n-gram table among them), in process.
#[test]
fn bench_model_runs_the_dense_and_qwen4_exp_presets() {
    binary("ninfer-engine");
    let directory = tempfile::tempdir().unwrap();
    let dir = directory.path();
    for (preset, architecture) in [
        ("qwen3.6-27b", "qwen3_5"),
        ("qwen3.8-flash-next", "qwen4_exp"),
    ] {
        let output = ninfer(
            &[
                "convert",
                "--synthetic",
                preset,
                "--scale-down",
                "--layers",
                "2",
                "model.ninfer",
            ],
            dir,
        );
        assert!(
            output.status.success(),
            "{preset}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let artifact = ninfer_artifact::Artifact::open(&dir.join("model.ninfer")).unwrap();
        if let Some(qwen4) = artifact.config().qwen4_exp() {
            assert_eq!(qwen4.ple_layers, vec![0], "{preset}: the PLE layer is kept");
            assert!(artifact
                .tensor("layers.0.ple.ngram_embedding.shard_0")
                .is_ok());
        }
        drop(artifact);
        let mut args = vec!["bench", "model.ninfer", "--no-workers"];
        args.extend_from_slice(SMALL_CPU_BENCH);
        args.push("--json");
        let output = ninfer(&args, dir);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{preset}: {stderr}");
        let report: Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("{preset}: stdout is not one JSON object ({e}): {stderr}"));
        assert_eq!(report["device"], "cpu", "{preset}");
        assert_eq!(report["architecture"], architecture, "{preset}");
        std::fs::remove_file(dir.join("model.ninfer")).unwrap();
    }
}
