//! Runs `scripts/sdk_smoke.py` (the official `openai` and `anthropic` Python SDKs) against the
//! gateway and the scripted test engine. Skipped, loudly, where the SDKs are not installed.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use common::*;

fn python_has_sdks() -> bool {
    let found = Command::new("python3")
        .args(["-c", "import openai, anthropic"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found {
        eprintln!("SKIPPED: python3 with the `openai` and `anthropic` packages is not available (pip install openai anthropic)");
    }
    found
}

/// Runs `scripts/sdk_smoke.py` against `base_url` with `extra` arguments; fails on any check.
async fn run_smoke_script(base_url: String, extra: &[&str]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/sdk_smoke.py");
    let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
    // The SDK calls block: run the script on a blocking thread so the gateway keeps serving.
    let output = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script)
            .args(["--base-url", &base_url, "--api-key", "smoke-key"])
            .args(&extra)
            .env("PYTHONUNBUFFERED", "1")
            .output()
    })
    .await
    .unwrap_or_else(|error| panic!("join: {error}"))
    .unwrap_or_else(|error| panic!("python3: {error}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{stdout}");
    assert!(
        output.status.success(),
        "sdk_smoke.py failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}

/// Every answer is one `get_weather(city=Paris)` call: a call cut by `max_tokens` is reported
/// as cut (`length` / `max_tokens`) with no half call anywhere, a whole one as a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdks_see_cut_tool_calls_as_cut() {
    if !python_has_sdks() {
        return;
    }
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    engine.script.set_text(
        "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    );
    let gateway = RunningGateway::start(
        &[engine.address],
        GatewayOptions {
            api_key: Some("smoke-key".into()),
            ..Default::default()
        },
    )
    .await;
    gateway.wait_for_health(200).await;
    run_smoke_script(
        format!("http://{}", gateway.address),
        &["--tool-call-answer"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdks_work_against_the_gateway() {
    if !python_has_sdks() {
        return;
    }
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    engine.script.set_text("Let me think about it.\n</think>\n\nThe capital of France is Paris, a lovely city on the Seine.");
    let gateway = RunningGateway::start(
        &[engine.address],
        GatewayOptions {
            api_key: Some("smoke-key".into()),
            model_aliases: vec!["claude-*=test-model".into()],
            ..Default::default()
        },
    )
    .await;
    gateway.wait_for_health(200).await;
    run_smoke_script(
        format!("http://{}", gateway.address),
        &["--max-tokens", "64", "--claude-model", "claude-sonnet-4-5"],
    )
    .await;
}
