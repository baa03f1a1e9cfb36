//! The path users take, on the CPU, with a model of the real Qwen3.5 vocabulary (248,320 rows;
//! the tokenizer rebuilt in `tests/fixtures/qwen3_5_tokenizer`): a tiny random model made by
//! `ninfer convert --synthetic --tokenizer`, served by `ninfer run --serve`.
//!
//! - `ninfer bench serve` measures it through the HTTP API: every level answers, `/health`
//!   keeps answering within 100 ms under 16 streams, and the gateway's CPU time per generated
//!   token is far from the whole-vocabulary work per token it once did (the bound leaves room
//!   for a debug build on a loaded machine; release figures are in docs/BENCHMARKS.md, and
//!   `services/gateway/tests/per_token_work.rs` bounds the per-token work by counting).
//! - `ninfer bench serve --agent-turns` replays an agent's conversation, its later turns from
//!   the prefix cache.
//! - The served name carries no conversion checksum, aliases from `--model-alias` answer, and
//!   `/metrics` shows routing statistics of this model only.
//! - Unmodified Claude Code completes a `-p` run against a model that ends its turn at once
//!   (`--ends-turns`), when Claude Code is installed (`.ci/run` installs it).
//!
//! Needs the workspace binaries next to `ninfer` (`cargo build --workspace --bins`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::fixture;
use common::serve::{http, ninfer, Server};
use serde_json::Value;

/// The tiny real-vocabulary model: the Qwen3.5-35B-A3B structure at toy width, 4 layers (three
/// Gated DeltaNet, one full attention), the real tokenizer.
fn real_vocabulary_model(scratch: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let output = scratch.join(format!("{name}.ninfer"));
    let result = ninfer(scratch)
        .args([
            "convert",
            "--synthetic",
            "qwen3.5-35b-a3b",
            "--scale-down",
            "--layers",
            "4",
            "--tokenizer",
        ])
        .arg(fixture("qwen3_5_tokenizer"))
        .args(extra)
        .arg(&output)
        .output()
        .unwrap_or_else(|e| panic!("ninfer convert: {e}"));
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    output
}

#[test]
fn bench_serve_measures_the_api_with_the_real_vocabulary() {
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = real_vocabulary_model(scratch.path(), "real", &[]);
    let report = bench_serve_report(
        scratch.path(),
        &model,
        &[
            "--concurrency",
            "1,16",
            "--prompt-tokens",
            "64",
            "--output-tokens",
            "24",
            "--json",
            "--run-arg=--device",
            "--run-arg=cpu",
            "--run-arg=--no-mtp",
            "--run-arg=--moe-threads",
            "--run-arg=1",
            "--bench-arg=--device",
            "--bench-arg=cpu",
            "--bench-arg=--moe-threads",
            "--bench-arg=1",
            "--bench-arg=--ram-buffer-gib",
            "--bench-arg=0.0625",
            "--bench-arg=--ram-passes",
            "--bench-arg=2",
        ],
    );
    assert_eq!(report["model"], "real");
    let levels = report["levels"].as_array().cloned().unwrap_or_default();
    assert_eq!(levels.len(), 2, "{report}");
    for level in &levels {
        let streams = level["concurrency"].as_u64().unwrap_or(0);
        assert_eq!(level["requests"].as_u64(), Some(streams), "{level}");
        // Every answer is the asked length (end-of-sequence ignored) and the prompt the asked
        // length as the server's tokenizer counts it.
        assert_eq!(
            level["completion_tokens"].as_u64(),
            Some(24 * streams),
            "{level}"
        );
        assert_eq!(level["prompt_tokens"].as_u64(), Some(64), "{level}");
        assert!(
            level["stream_tok_s"].as_f64().unwrap_or(0.0) > 0.0,
            "{level}"
        );
        assert_eq!(level["health_failures"].as_u64(), Some(0), "{level}");
        assert!(level["health_probes"].as_u64().unwrap_or(0) > 0, "{level}");
        // Health never waits on generation: within 100 ms at every level (it once took seconds).
        assert!(
            level["health_max_ms"].as_f64().unwrap_or(f64::MAX) < 100.0,
            "{level}"
        );
        // Whole-vocabulary work per token cost ~185,000 µs; a debug build's per-token work
        // is a few hundred.
        let cpu = level["gateway_cpu_us_per_token"].as_f64();
        assert!(cpu.is_some_and(|us| us < 5000.0), "{level}");
    }
    // The same cost measured without probes: one stream, two answer lengths differenced.
    let unprobed = report["gateway_cpu_us_per_token_unprobed"].as_f64();
    assert!(
        unprobed.is_some_and(|us| us > 0.0 && us < 5000.0),
        "{report}"
    );
    let engine = report["engine_decode_tok_s"].as_f64().unwrap_or(0.0);
    assert!(engine > 0.0, "{report}");
    assert!(report["stream_over_engine"].as_f64().unwrap_or(0.0) > 0.0);
}

/// `ninfer bench serve --agent-turns` replays an agent's conversation: the first turn computes
/// its whole prompt, every later one takes the conversation so far from the prefix cache (whole
/// blocks, more each turn as the conversation grows), and the cache's bytes come back within
/// its budget.
#[test]
fn bench_serve_replays_an_agent_conversation_from_the_prefix_cache() {
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = real_vocabulary_model(scratch.path(), "agent", &[]);
    let report = bench_serve_report(
        scratch.path(),
        &model,
        &[
            "--agent-turns",
            "3",
            "--agent-system-tokens",
            "600",
            "--agent-turn-tokens",
            "300",
            "--output-tokens",
            "4",
            "--json",
            "--run-arg=--device",
            "--run-arg=cpu",
            "--run-arg=--moe-threads",
            "--run-arg=1",
        ],
    );
    let turns = report["turns"].as_array().cloned().unwrap_or_default();
    assert_eq!(turns.len(), 3, "{report}");
    let figure = |turn: &Value, name: &str| turn[name].as_u64().unwrap_or(u64::MAX);
    assert_eq!(figure(&turns[0], "cached_tokens"), 0, "{report}");
    assert!(figure(&turns[0], "prompt_tokens") > 600, "{report}");
    let mut previous = 0;
    for turn in &turns[1..] {
        let (prompt, cached) = (figure(turn, "prompt_tokens"), figure(turn, "cached_tokens"));
        // Whole blocks of 256 tokens; each turn grows by more than a block.
        assert!(cached > previous && cached % 256 == 0, "{turn}");
        assert!(cached < prompt, "{turn}");
        assert!(turn["ttft_ms"].as_f64().unwrap_or(0.0) > 0.0, "{turn}");
        previous = cached;
    }
    let bytes = report["prefix_cache_bytes"].as_u64().unwrap_or(0);
    let budget = report["prefix_cache_budget_bytes"].as_u64().unwrap_or(0);
    assert!(bytes > 0 && bytes <= budget, "{report}");
}

#[test]
fn served_names_aliases_and_metrics_are_this_models() {
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = real_vocabulary_model(scratch.path(), "tiny-real", &[]);
    // Routing totals of another model, left in the state directory by an earlier server.
    let stats = scratch.path().join("state/ninfer/expert-stats");
    std::fs::create_dir_all(&stats).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(
        stats.join("some-other-model.json"),
        r#"{"format":"ninfer-expert-stats-v1","model":"some-other-model","tokens_routed":5,"layers":{"0":[5,0]},"updated_unix_ms":1}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let server = Server::start(
        scratch.path(),
        &model,
        &[
            "--served-model-name",
            "qwen-tiny",
            "--model-alias",
            "gpt-4o=qwen-tiny",
        ],
    );
    let (status, models) = http(&server.address, "GET", "/v1/models", None);
    assert_eq!(status, 200, "{models}");
    let models: Value = serde_json::from_str(&models).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(models["data"][0]["id"], "qwen-tiny", "{models}");
    let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#;
    let (status, answer) = http(&server.address, "POST", "/v1/chat/completions", Some(body));
    assert_eq!(status, 200, "{answer}");
    let (status, _) = http(&server.address, "HEAD", "/", None);
    assert_eq!(status, 200);
    let (_, metrics) = http(&server.address, "GET", "/metrics", None);
    assert!(!metrics.contains("some-other-model"), "{metrics}");
}

fn claude_code() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("NINFER_CLAUDE_CODE") {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    let found = Command::new("sh")
        .args(["-c", "command -v claude"])
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&found.stdout).trim().to_string();
    (found.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
}

#[test]
fn claude_code_completes_two_turns_the_second_from_the_prefix_cache() {
    let Some(claude) = claude_code() else {
        eprintln!("SKIPPED: Claude Code is not installed (npm install @anthropic-ai/claude-code, then set NINFER_CLAUDE_CODE to its `claude` binary or put it on PATH)");
        return;
    };
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = real_vocabulary_model(scratch.path(), "ends-turns", &["--ends-turns"]);
    // Claude Code's system prompt and tools are tens of thousands of tokens.
    let server = Server::start(
        scratch.path(),
        &model,
        &[
            "--max-context",
            "65536",
            "--model-alias",
            "claude-*=ends-turns",
        ],
    );
    let home = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let work = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let turn = |arguments: &[&str]| -> Value {
        let output = Command::new("timeout")
            .arg("600")
            .arg(&claude)
            .args(arguments)
            .args([
                "--output-format",
                "json",
                "--model",
                "claude-sonnet-4-5",
                "--max-turns",
                "2",
            ])
            .current_dir(work.path())
            .env("HOME", home.path())
            .env("ANTHROPIC_BASE_URL", format!("http://{}", server.address))
            .env("ANTHROPIC_API_KEY", "test-key")
            .env("DISABLE_TELEMETRY", "1")
            .env("DISABLE_AUTOUPDATER", "1")
            .env("DISABLE_ERROR_REPORTING", "1")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .output()
            .unwrap_or_else(|e| panic!("claude: {e}"));
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        eprintln!("claude stdout: {stdout}\nclaude stderr: {stderr}");
        let result: Value = serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("Claude Code's JSON output: {e}\n{stdout}\n{stderr}"));
        assert_eq!(result["is_error"], false, "{result}");
        assert_eq!(result["subtype"], "success", "{result}");
        assert!(output.status.success(), "{stderr}");
        result
    };
    turn(&["-p", "Say hello."]);
    // The second turn resends the system prompt, the tools and the first turn: the prefix
    // cache serves them, and Claude Code hears so.
    let second = turn(&["-p", "Say hello again.", "--continue"]);
    let cached = second["usage"]["cache_read_input_tokens"]
        .as_u64()
        .unwrap_or_default();
    assert!(
        cached > 1000,
        "the second turn's cached input tokens: {}",
        second["usage"]
    );
    drop(server);
}

/// `ninfer bench serve MODEL ARGS` (ARGS ending in `--json`): the report it prints, after
/// checking that it succeeded.
fn bench_serve_report(scratch: &Path, model: &Path, args: &[&str]) -> Value {
    let output = ninfer(scratch)
        .args(["bench", "serve"])
        .arg(model)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("ninfer bench serve: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let report: Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    eprintln!("{report:#}");
    report
}
