//! Processes going away: `ninfer serve` supervises, restarts and stops its children; an engine
//! killed behind a running gateway gives 503 and its restart resumes service.

use std::fs::File;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::helpers::{client, generate, greedy, http, prompts, runtime, wait_for_health, Stack};

#[test]
fn serve_supervises_restarts_and_stops_its_children() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let rt = runtime();
    let stack = Stack::new();
    let model = stack.convert("qwen3_moe");
    let runtime_base = stack.path("runtime");
    std::fs::create_dir_all(&runtime_base).unwrap();
    let api = format!("unix:{}", stack.path("api.sock").display());
    let mut serve = Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(["serve", "--moe-threads", "1", "--listen", &api])
        .arg(&model)
        .env("XDG_RUNTIME_DIR", &runtime_base)
        .stdout(Stdio::null())
        .stderr(File::create(stack.path("serve.log")).unwrap())
        .spawn()
        .unwrap();
    let prompt = prompts("qwen3_moe")[0].clone();
    let first = rt.block_on(async { generate(&mut client(&api).await, greedy(&prompt, 8)).await });
    assert_eq!(first.len(), 8);

    let runtime_dir = runtime_base.join(format!("ninfer-{}", serve.id()));
    let pid_file = runtime_dir.join("experts-0.pid");
    let read_pid = || {
        std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse::<i32>().ok())
    };
    let old_pid = read_pid().expect("worker pid file");
    kill(Pid::from_raw(old_pid), Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while read_pid() == Some(old_pid) {
        assert!(Instant::now() < deadline, "the worker was not restarted");
        std::thread::sleep(Duration::from_millis(50));
    }
    let again = rt.block_on(async { generate(&mut client(&api).await, greedy(&prompt, 8)).await });
    assert_eq!(again, first, "generation changed after the worker restart");

    let engine_pid = std::fs::read_to_string(runtime_dir.join("engine.pid"))
        .unwrap()
        .trim()
        .parse::<i32>()
        .unwrap();
    let worker_pid = read_pid().unwrap();
    kill(Pid::from_raw(serve.id() as i32), Signal::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "ninfer serve did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "ninfer serve exited with {status}");
    for pid in [engine_pid, worker_pid] {
        assert!(
            kill(Pid::from_raw(pid), None).is_err(),
            "child {pid} still running after serve stopped"
        );
    }
    assert!(
        !runtime_dir.exists(),
        "the runtime directory was not removed"
    );
}

/// Engine restarts behind a running gateway, with real processes: `kill -9` the engine behind a running
/// `ninfer-gateway`: `/health` turns 503 and requests get 503 in each API's envelope; start the
/// engine again on the same address: service resumes, same greedy answer, same gateway process.
#[test]
fn killed_engine_gives_503_and_its_restart_resumes_service_without_the_gateway_restarting() {
    use nix::sys::signal::Signal;
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_moe");
    let engine = stack.engine("engine", &model, &[], &[]);
    let api = stack.gateway(&engine);
    let chat = r#"{"model": "qwen3_moe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}"#;
    let messages = r#"{"model": "qwen3_moe", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}"#;
    let (status, before) = http(&api, "POST", "/v1/chat/completions", chat);
    assert_eq!(status, 200, "{before}");
    let before: serde_json::Value = serde_json::from_str(&before).unwrap();

    stack.signal("engine", Signal::SIGKILL);
    let _ = stack.child("engine").wait();
    wait_for_health(&api, 503);
    let (status, body) = http(&api, "POST", "/v1/chat/completions", chat);
    assert_eq!(status, 503, "{body}");
    let envelope: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(envelope["error"]["message"].is_string(), "{envelope}");
    let (status, body) = http(&api, "POST", "/v1/messages", messages);
    assert_eq!(status, 503, "{body}");
    let envelope: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(envelope["type"], "error", "{envelope}");

    stack.engine_on("engine-restarted", "engine", &model, &[], &[]);
    wait_for_health(&api, 200);
    let (status, after) = http(&api, "POST", "/v1/chat/completions", chat);
    assert_eq!(status, 200, "{after}");
    let after: serde_json::Value = serde_json::from_str(&after).unwrap();
    assert_eq!(
        after["choices"][0]["message"],
        before["choices"][0]["message"]
    );
    let (status, body) = http(&api, "POST", "/v1/messages", messages);
    assert_eq!(status, 200, "{body}");
    assert!(
        stack.child("gateway").try_wait().unwrap().is_none(),
        "the gateway exited"
    );
}
