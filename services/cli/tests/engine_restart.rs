//! No answer is lost when the engine dies: `ninfer run --serve` with sixteen streams in flight
//! (OpenAI chat and completions, Anthropic messages; greedy and seeded sampling; one forced tool
//! call whose grammar is half-way through), the engine killed with SIGKILL and restarted by the
//! supervisor, then stopped with SIGTERM and restarted — every stream completes with exactly the
//! text of an uninterrupted run, the gateway counts the resumed streams in `/metrics`, and the
//! longest pause each client saw is reported.
//! Needs the workspace binaries built next to `ninfer` (`cargo build --workspace --bins`).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .unwrap_or_else(|error| panic!("no free port: {error}"))
}

/// `ninfer run --serve` on the fixture with slowed experts, until dropped.
struct Served {
    run: Child,
    api: String,
    runtime_dir: PathBuf,
}

impl Served {
    fn start(scratch: &Path) -> Served {
        let model = scratch.join("qwen3_moe.ninfer");
        if !model.exists() {
            let status = Command::new(env!("CARGO_BIN_EXE_ninfer"))
                .args(["convert", "--experts-dtype", "f32", "--dense-dtype", "f32"])
                .arg(fixture("qwen3_moe"))
                .arg(&model)
                .stderr(Stdio::null())
                .status()
                .unwrap_or_else(|error| panic!("convert: {error}"));
            assert!(status.success());
        }
        let runtime_root = scratch.join("runtime");
        std::fs::create_dir_all(&runtime_root).unwrap_or_else(|error| panic!("{error}"));
        let api = format!("127.0.0.1:{}", free_port());
        let mut run = Command::new(env!("CARGO_BIN_EXE_ninfer"))
            .env("XDG_RUNTIME_DIR", &runtime_root)
            .env("XDG_CACHE_HOME", scratch.join("cache"))
            .env("XDG_STATE_HOME", scratch.join("state"))
            // Slow experts keep sixteen answers streaming for seconds.
            .env("NINFER_WORKER_TEST_DELAY_MS", "3")
            .arg("run")
            .arg(&model)
            .args(["--moe-threads", "1", "--serve", "--listen", &api])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(
                std::fs::File::create(scratch.join("run.err"))
                    .unwrap_or_else(|error| panic!("{error}")),
            )
            .spawn()
            .unwrap_or_else(|error| panic!("ninfer run: {error}"));
        let stdout = BufReader::new(run.stdout.take().unwrap_or_else(|| panic!("no stdout")));
        let ready = stdout
            .lines()
            .map_while(Result::ok)
            .any(|line| line.starts_with("ready: "));
        assert!(ready, "run --serve never said ready");
        let runtime_dir = runtime_root.join(format!("ninfer-{}", run.id()));
        Served {
            run,
            api,
            runtime_dir,
        }
    }

    fn engine_pid(&self) -> i32 {
        std::fs::read_to_string(self.runtime_dir.join("engine.pid"))
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or_else(|| panic!("no engine pid file"))
    }

    fn metrics(&self) -> String {
        let mut stream = std::net::TcpStream::connect(&self.api)
            .unwrap_or_else(|error| panic!("{}: {error}", self.api));
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .unwrap_or_else(|error| panic!("{error}"));
        let mut text = String::new();
        let _ = stream.read_to_string(&mut text);
        text
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.run.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.run.wait();
    }
}

/// One of the sixteen requests: its path and body.
fn requests() -> Vec<(&'static str, Value)> {
    let tool = json!({"type": "function", "function": {"name": "lookup",
        "description": "Looks a word up.", "parameters": {"type": "object",
        "properties": {"word": {"type": "string", "enum": [
            "the first word of a very long story about numbers", "the second word"]}},
        "required": ["word"]}}});
    let mut requests = Vec::new();
    for index in 0..4 {
        let prompt = format!("Tell me a story about the number {index}");
        requests.push((
            "/v1/messages",
            json!({"model": "qwen3_moe", "stream": true,
            "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}),
        ));
        requests.push((
            "/v1/chat/completions",
            json!({"model": "qwen3_moe", "stream": true,
            "max_tokens": 200, "temperature": 0.9, "seed": 40 + index, "ignore_eos": true,
            "messages": [{"role": "user", "content": prompt}]}),
        ));
        requests.push((
            "/v1/completions",
            json!({"model": "qwen3_moe", "stream": true,
            "max_tokens": 200, "temperature": 0.8, "top_p": 0.95, "seed": 7 + index,
            "ignore_eos": true, "prompt": prompt}),
        ));
        let greedy_chat = if index == 0 {
            // A forced tool call: the engine's grammar is half-way through its arguments.
            json!({"model": "qwen3_moe", "stream": true, "max_tokens": 300, "temperature": 0,
                "tools": [tool], "tool_choice": "required", "parallel_tool_calls": false,
                "chat_template_kwargs": {"enable_thinking": false},
                "messages": [{"role": "user", "content": prompt}]})
        } else {
            json!({"model": "qwen3_moe", "stream": true, "max_tokens": 200, "temperature": 0,
                "ignore_eos": true, "messages": [{"role": "user", "content": prompt}]})
        };
        requests.push(("/v1/chat/completions", greedy_chat));
    }
    requests
}

/// What a client read from one stream: its events' payloads and when each read arrived.
struct Streamed {
    events: Vec<Value>,
    longest_gap: Duration,
}

/// Sends `body` (HTTP/1.0: the answer is the event stream itself, no chunk framing) and reads
/// the stream to its end in the background; `started` is told once a few events arrived (the
/// other streams are then a few tokens in, and a forced tool call is half-way).
fn stream(
    api: &str,
    path: &'static str,
    body: &Value,
    started: std::sync::mpsc::Sender<()>,
) -> std::thread::JoinHandle<Streamed> {
    // A tool call streams nothing until it is whole: its stream counts as started at once.
    let events_before_started = if body.get("tools").is_some() { 1 } else { 6 };
    let mut connection =
        std::net::TcpStream::connect(api).unwrap_or_else(|error| panic!("{api}: {error}"));
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nanthropic-version: 2023-06-01\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    connection
        .write_all(head.as_bytes())
        .unwrap_or_else(|error| panic!("{error}"));
    let _ = connection.set_read_timeout(Some(Duration::from_secs(60)));
    std::thread::spawn(move || {
        let mut text = String::new();
        let mut buffer = [0u8; 16384];
        let mut last_event_at: Option<Instant> = None;
        let mut longest_gap = Duration::ZERO;
        let mut told = false;
        while let Ok(read) = connection.read(&mut buffer) {
            if read == 0 {
                break;
            }
            let now = Instant::now();
            let chunk = String::from_utf8_lossy(&buffer[..read]);
            if chunk.contains("data: ") {
                if let Some(last) = last_event_at {
                    longest_gap = longest_gap.max(now - last);
                }
                last_event_at = Some(now);
            }
            text.push_str(&chunk);
            if !told && text.matches("data: ").count() >= events_before_started {
                told = true;
                let _ = started.send(());
            }
        }
        let events = text
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .collect();
        Streamed {
            events,
            longest_gap,
        }
    })
}

/// The answer a stream carried, as the client would assemble it: text, reasoning, tool-call
/// names and arguments, the finish reason; errors included (so an error never compares equal).
fn answer_of(path: &str, events: &[Value]) -> String {
    let mut answer = String::new();
    for event in events {
        if let Some(error) = event.get("error") {
            answer.push_str(&format!("[error {error}]"));
        }
        if path == "/v1/messages" {
            let delta = &event["delta"];
            for key in ["text", "thinking", "partial_json", "stop_reason"] {
                if let Some(piece) = delta[key].as_str() {
                    answer.push_str(piece);
                }
            }
            if let Some(name) = event["content_block"]["name"].as_str() {
                answer.push_str(&format!("[tool {name}]"));
            }
            continue;
        }
        let choice = &event["choices"][0];
        for piece in [
            &choice["text"],
            &choice["delta"]["content"],
            &choice["delta"]["reasoning_content"],
            &choice["delta"]["tool_calls"][0]["function"]["name"],
            &choice["delta"]["tool_calls"][0]["function"]["arguments"],
            &choice["finish_reason"],
        ] {
            if let Some(piece) = piece.as_str() {
                answer.push_str(piece);
            }
        }
    }
    answer
}

/// Runs the sixteen requests at once; `during` runs once each has streamed a few events.
fn sixteen_streams(served: &Served, during: impl FnOnce()) -> Vec<(String, Duration)> {
    let (started, all_started) = std::sync::mpsc::channel();
    let running: Vec<_> = requests()
        .into_iter()
        .map(|(path, body)| (path, stream(&served.api, path, &body, started.clone())))
        .collect();
    for _ in 0..running.len() {
        all_started
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("a stream never started"));
    }
    during();
    running
        .into_iter()
        .map(|(path, reader)| {
            let streamed = reader
                .join()
                .unwrap_or_else(|_| panic!("a stream reader panicked"));
            (answer_of(path, &streamed.events), streamed.longest_gap)
        })
        .collect()
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(&format!("{name} ")))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn sixteen_streams_survive_a_killed_or_restarted_engine_with_the_uninterrupted_text() {
    use nix::sys::signal::{kill, Signal};
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    let served = Served::start(scratch.path());
    let uninterrupted = sixteen_streams(&served, || {});
    for (answer, _) in &uninterrupted {
        assert!(!answer.contains("[error"), "{answer}");
        assert!(answer.len() > 20, "a short answer: {answer}");
    }
    let killed_pid = served.engine_pid();
    let resumed = sixteen_streams(&served, || {
        kill(nix::unistd::Pid::from_raw(killed_pid), Signal::SIGKILL)
            .unwrap_or_else(|error| panic!("SIGKILL the engine: {error}"));
    });
    assert_ne!(
        served.engine_pid(),
        killed_pid,
        "the engine was not restarted"
    );
    for (index, ((before, _), (after, _))) in uninterrupted.iter().zip(&resumed).enumerate() {
        assert_eq!(
            after, before,
            "stream {index} differs from its uninterrupted run"
        );
    }
    // The forced tool call streamed a call, not text.
    assert!(
        uninterrupted[3].0.contains("lookup"),
        "the forced tool call: {}",
        uninterrupted[3].0
    );
    // The forced tool call streams nothing until its call is whole: its pause is by design.
    let text_streams = |answers: &[(String, Duration)]| -> Vec<Duration> {
        answers
            .iter()
            .enumerate()
            .filter(|(index, _)| *index != 3)
            .map(|(_, (_, gap))| *gap)
            .collect()
    };
    let mut gaps = text_streams(&resumed);
    gaps.sort();
    let p99 = gaps[(gaps.len() * 99).div_ceil(100) - 1];
    let p50 = gaps[gaps.len().div_ceil(2) - 1];
    let metrics = served.metrics();
    let resumed_streams = metric(&metrics, "ninfer_gateway_resumed_streams_total");
    eprintln!(
        "engine SIGKILLed under {} streams: all identical to the uninterrupted run; longest token gap per text stream p50 {p50:?}, p99 {p99:?} (uninterrupted p99 {:?}); {resumed_streams} streams resumed",
        resumed.len(),
        text_streams(&uninterrupted).into_iter().max().unwrap_or_default()
    );
    assert!(
        resumed_streams >= 1,
        "no stream counted as resumed:\n{metrics}"
    );
    assert_eq!(
        metric(&metrics, "ninfer_gateway_abandoned_resumes_total"),
        0,
        "{metrics}"
    );

    // A graceful restart (SIGTERM to the engine alone, as `systemctl restart` does) is the same.
    let stopped_pid = served.engine_pid();
    let restarted = sixteen_streams(&served, || {
        kill(nix::unistd::Pid::from_raw(stopped_pid), Signal::SIGTERM)
            .unwrap_or_else(|error| panic!("SIGTERM the engine: {error}"));
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while served.engine_pid() == stopped_pid {
        assert!(Instant::now() < deadline, "the engine was not restarted");
        std::thread::sleep(Duration::from_millis(50));
    }
    let metrics = served.metrics();
    assert!(
        metric(&metrics, "ninfer_gateway_resumed_streams_total") > resumed_streams,
        "no stream outlived the engine's drain and resumed:\n{metrics}"
    );
    for (index, ((before, _), (after, _))) in uninterrupted.iter().zip(&restarted).enumerate() {
        assert_eq!(
            after, before,
            "stream {index} differs from its uninterrupted run after a graceful engine restart"
        );
    }
    let mut gaps = text_streams(&restarted);
    gaps.sort();
    eprintln!(
        "engine restarted with SIGTERM under 16 streams: all identical; longest token gap per text stream p99 {:?}",
        gaps[(gaps.len() * 99).div_ceil(100) - 1]
    );
}
