//! Unmodified Claude Code (`claude -p`, print mode, JSON output) against the gateway, with the
//! scripted engine answering a `<tool_call>` for its Bash tool and then a plain answer once the
//! tool's result comes back: the tool runs, its result is sent, and Claude Code exits cleanly.
//!
//! Claude Code is found at `$NINFER_CLAUDE_CODE` or as `claude` on `PATH` (`.ci/run` installs
//! it from the npm registry); without it the test says SKIPPED and why.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_runs_a_tool_and_finishes() {
    let Some(claude) = claude_code() else {
        eprintln!("SKIPPED: Claude Code is not installed (npm install @anthropic-ai/claude-code, then set NINFER_CLAUDE_CODE to its `claude` binary or put it on PATH)");
        return;
    };
    let script = Arc::new(EngineScript::default());
    // Claude Code's prompt (system prompt and tool definitions) is tens of thousands of tokens.
    script.max_context.store(200_000, Ordering::SeqCst);
    script.set_delay(Duration::ZERO);
    script.set_text("I will write the marker.\n</think>\n\n<tool_call>\n<function=Bash>\n<parameter=command>\necho ninfer-tool-ran > marker.txt\n</parameter>\n<parameter=description>\nWrite a marker file\n</parameter>\n</function>\n</tool_call>");
    *script
        .completion_after_tool_result
        .lock()
        .unwrap_or_else(|e| e.into_inner()) =
        Some("</think>\n\nThe marker file is written.".to_string());
    let engine = RunningEngine::start(Arc::clone(&script), None).await;
    let gateway = RunningGateway::start(
        &[engine.address],
        GatewayOptions {
            model_aliases: vec!["claude-*=test-model".into()],
            ..Default::default()
        },
    )
    .await;
    gateway.wait_for_health(200).await;
    let home = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let work = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let base_url = format!("http://{}", gateway.address);
    let (home_path, work_path) = (home.path().to_path_buf(), work.path().to_path_buf());
    let output = tokio::task::spawn_blocking(move || {
        Command::new("timeout")
            .arg("180")
            .arg(claude)
            .args([
                "-p",
                "Write the marker file.",
                "--output-format",
                "json",
                "--model",
                "claude-sonnet-4-5",
                "--allowedTools",
                "Bash",
                "--max-turns",
                "4",
            ])
            .current_dir(&work_path)
            .env("HOME", &home_path)
            .env("ANTHROPIC_BASE_URL", &base_url)
            .env("ANTHROPIC_API_KEY", "test-key")
            .env("DISABLE_TELEMETRY", "1")
            .env("DISABLE_AUTOUPDATER", "1")
            .env("DISABLE_ERROR_REPORTING", "1")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .output()
    })
    .await
    .unwrap_or_else(|e| panic!("join: {e}"))
    .unwrap_or_else(|e| panic!("claude: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("claude stdout: {stdout}\nclaude stderr: {stderr}");
    let result: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("Claude Code's JSON output: {e}\n{stdout}\n{stderr}"));
    assert_eq!(result["is_error"], false, "{result}");
    assert_eq!(result["subtype"], "success", "{result}");
    assert!(
        result["result"]
            .as_str()
            .is_some_and(|r| r.contains("marker file is written")),
        "{result}"
    );
    let marker = std::fs::read_to_string(work.path().join("marker.txt"))
        .unwrap_or_else(|e| panic!("the Bash tool did not run ({e}): {result}"));
    assert_eq!(marker.trim(), "ninfer-tool-ran");
    assert!(output.status.success(), "{stderr}");
}
