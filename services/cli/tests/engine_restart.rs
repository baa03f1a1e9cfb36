//! No answer is lost when the engine dies: `ninfer run --serve` with sixteen HTTP streams in
//! flight (OpenAI chat and completions, Anthropic messages; greedy and seeded sampling; one
//! forced tool call whose grammar is half-way through) and two through the public gRPC API
//! (GenerateStream, ChatStream), the engine killed with SIGKILL and restarted by the supervisor,
//! then stopped with SIGTERM and restarted — every stream completes with exactly the text of an
//! uninterrupted run, the gateway counts the resumed streams in `/metrics`, and the longest pause
//! each client saw is reported. The same holds for seeded sampled streams of a model whose
//! engine drafts with its MTP head (the continuations draft too).
//! Needs the workspace binaries built next to `ninfer` (`cargo build --workspace --bins`).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ninfer_protocol::v1::gateway_client::GatewayClient;
use ninfer_protocol::v1::{
    ChatMessage, ChatRequest, GatewayFinishReason, GatewaySamplingOptions, TextGenerationRequest,
};
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

/// `ninfer run --serve` on a fixture with slowed experts, until dropped.
struct Served {
    run: Child,
    api: String,
    runtime_dir: PathBuf,
}

impl Served {
    /// Serves `name` (a fixture, converted under `scratch`; served under that name).
    fn start(scratch: &Path, name: &str) -> Served {
        let model = scratch.join(format!("{name}.ninfer"));
        if !model.exists() {
            let status = Command::new(env!("CARGO_BIN_EXE_ninfer"))
                .args(["convert", "--experts-dtype", "f32", "--dense-dtype", "f32"])
                .arg(fixture(name))
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

/// One streaming request of a run.
enum Call {
    /// An HTTP API: its path and body.
    Http(&'static str, Value),
    /// The public gRPC API's GenerateStream.
    GrpcGenerate(TextGenerationRequest),
    /// The public gRPC API's ChatStream.
    GrpcChat(ChatRequest),
}

/// The sixteen HTTP requests, then the two gRPC ones.
fn requests() -> Vec<Call> {
    let tool = json!({"type": "function", "function": {"name": "lookup",
        "description": "Looks a word up.", "parameters": {"type": "object",
        "properties": {"word": {"type": "string", "enum": [
            "the first word of a very long story about numbers", "the second word"]}},
        "required": ["word"]}}});
    let mut requests = Vec::new();
    for index in 0..4 {
        let prompt = format!("Tell me a story about the number {index}");
        requests.push(Call::Http(
            "/v1/messages",
            json!({"model": "qwen3_moe", "stream": true,
            "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}),
        ));
        requests.push(Call::Http(
            "/v1/chat/completions",
            json!({"model": "qwen3_moe", "stream": true,
            "max_tokens": 200, "temperature": 0.9, "seed": 40 + index, "ignore_eos": true,
            "messages": [{"role": "user", "content": prompt}]}),
        ));
        requests.push(Call::Http(
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
        requests.push(Call::Http("/v1/chat/completions", greedy_chat));
    }
    requests.push(Call::GrpcGenerate(TextGenerationRequest {
        model: "qwen3_moe".into(),
        prompt: "Tell me a story about the number 7".into(),
        options: Some(GatewaySamplingOptions {
            temperature: Some(0.9),
            top_k: Some(20),
            seed: Some(99),
            max_tokens: 200,
            ..Default::default()
        }),
    }));
    requests.push(Call::GrpcChat(ChatRequest {
        model: "qwen3_moe".into(),
        messages: vec![ChatMessage {
            role: "user".into(),
            content: "Tell me a story about the number 8".into(),
            ..Default::default()
        }],
        options: Some(GatewaySamplingOptions {
            temperature: Some(0.0),
            max_tokens: 200,
            ..Default::default()
        }),
        ..Default::default()
    }));
    requests
}

/// Seeded sampled streams (and one greedy) for the model whose engine drafts with its MTP head.
fn drafting_requests(model: &str) -> Vec<Call> {
    let mut requests = Vec::new();
    for index in 0..3u64 {
        let prompt = format!("Tell me a story about the number {index}");
        requests.push(Call::Http(
            "/v1/chat/completions",
            json!({"model": model, "stream": true, "max_tokens": 160,
            "temperature": 0.7, "top_k": 20, "top_p": 0.95, "seed": 11 + index,
            "ignore_eos": true, "messages": [{"role": "user", "content": prompt}]}),
        ));
        requests.push(Call::Http(
            "/v1/completions",
            json!({"model": model, "stream": true, "max_tokens": 160,
            "temperature": 1.0, "top_k": 0, "seed": 21 + index, "ignore_eos": true,
            "prompt": prompt}),
        ));
    }
    requests.push(Call::Http(
        "/v1/chat/completions",
        json!({"model": model, "stream": true, "max_tokens": 160, "temperature": 0,
        "ignore_eos": true,
        "messages": [{"role": "user", "content": "Tell me a story about the number 5"}]}),
    ));
    requests.push(Call::GrpcGenerate(TextGenerationRequest {
        model: model.into(),
        prompt: "Tell me a story about the number 6".into(),
        options: Some(GatewaySamplingOptions {
            temperature: Some(0.9),
            top_p: Some(0.9),
            seed: Some(31),
            max_tokens: 160,
            ..Default::default()
        }),
    }));
    requests
}

/// What a client read from one stream: the answer as it would assemble it, and the longest
/// pause between two reads that carried tokens.
struct Streamed {
    answer: String,
    longest_gap: Duration,
}

/// Events arriving on one stream: the longest pause between them, and the signal that the
/// stream is a few events in (sent once; at the end at the latest).
struct Arrivals {
    last: Option<Instant>,
    longest_gap: Duration,
    events: usize,
    events_before_started: usize,
    started: Option<std::sync::mpsc::Sender<()>>,
}

impl Arrivals {
    fn new(events_before_started: usize, started: std::sync::mpsc::Sender<()>) -> Self {
        Arrivals {
            last: None,
            longest_gap: Duration::ZERO,
            events: 0,
            events_before_started,
            started: Some(started),
        }
    }

    /// `events` more arrived now.
    fn arrived(&mut self, events: usize) {
        let now = Instant::now();
        if let Some(last) = self.last {
            self.longest_gap = self.longest_gap.max(now - last);
        }
        self.last = Some(now);
        self.events += events;
        if self.events >= self.events_before_started {
            self.tell_started();
        }
    }

    fn tell_started(&mut self) {
        if let Some(started) = self.started.take() {
            let _ = started.send(());
        }
    }
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
        let mut arrivals = Arrivals::new(events_before_started, started);
        while let Ok(read) = connection.read(&mut buffer) {
            if read == 0 {
                break;
            }
            let chunk = String::from_utf8_lossy(&buffer[..read]);
            let events = chunk.matches("data: ").count();
            if events > 0 {
                arrivals.arrived(events);
            }
            text.push_str(&chunk);
        }
        arrivals.tell_started();
        let events: Vec<Value> = text
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .collect();
        Streamed {
            answer: answer_of(path, &events),
            longest_gap: arrivals.longest_gap,
        }
    })
}

/// Runs one gRPC streaming call in the background (its own runtime), like [`stream`]: the
/// answer is the chunks' text and reasoning and the finish reason, an error included.
fn grpc_stream(
    api: &str,
    call: Call,
    started: std::sync::mpsc::Sender<()>,
) -> std::thread::JoinHandle<Streamed> {
    let address = format!("http://{api}");
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|error| panic!("a runtime: {error}"));
        runtime.block_on(async move {
            let channel = tonic::transport::Endpoint::from_shared(address)
                .unwrap_or_else(|error| panic!("{error}"))
                .connect()
                .await
                .unwrap_or_else(|error| panic!("connect: {error}"));
            let mut client = GatewayClient::new(channel);
            let mut arrivals = Arrivals::new(6, started);
            let answer = match call {
                Call::GrpcGenerate(request) => match client.generate_stream(request).await {
                    Ok(response) => {
                        read_chunks(response.into_inner(), &mut arrivals, |chunk| {
                            (chunk.text.clone(), chunk.finish_reason)
                        })
                        .await
                    }
                    Err(status) => format!("[error {status}]"),
                },
                Call::GrpcChat(request) => match client.chat_stream(request).await {
                    Ok(response) => {
                        read_chunks(response.into_inner(), &mut arrivals, |chunk| {
                            (
                                format!("{}{}", chunk.reasoning_content, chunk.content),
                                chunk.finish_reason,
                            )
                        })
                        .await
                    }
                    Err(status) => format!("[error {status}]"),
                },
                Call::Http(..) => panic!("not a gRPC call"),
            };
            arrivals.tell_started();
            Streamed {
                answer,
                longest_gap: arrivals.longest_gap,
            }
        })
    })
}

/// A gRPC answer stream read to its end: each chunk's text (`piece`: its text and finish
/// reason), the finish reason's name, or the error that ended it.
async fn read_chunks<Chunk>(
    mut chunks: tonic::Streaming<Chunk>,
    arrivals: &mut Arrivals,
    piece: impl Fn(&Chunk) -> (String, i32),
) -> String {
    let mut answer = String::new();
    loop {
        match chunks.message().await {
            Ok(Some(chunk)) => {
                arrivals.arrived(1);
                let (text, finish) = piece(&chunk);
                answer.push_str(&text);
                if finish != GatewayFinishReason::Unspecified as i32 {
                    answer.push_str(&format!("[finish {finish}]"));
                }
            }
            Ok(None) => return answer,
            Err(status) => {
                answer.push_str(&format!("[error {status}]"));
                return answer;
            }
        }
    }
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

/// Runs `calls` at once; `during` runs once each has streamed a few events.
fn all_streams(
    served: &Served,
    calls: Vec<Call>,
    during: impl FnOnce(),
) -> Vec<(String, Duration)> {
    let (started, all_started) = std::sync::mpsc::channel();
    let running: Vec<_> = calls
        .into_iter()
        .map(|call| match call {
            Call::Http(path, body) => stream(&served.api, path, &body, started.clone()),
            grpc => grpc_stream(&served.api, grpc, started.clone()),
        })
        .collect();
    for _ in 0..running.len() {
        all_started
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("a stream never started"));
    }
    during();
    running
        .into_iter()
        .map(|reader| {
            let streamed = reader
                .join()
                .unwrap_or_else(|_| panic!("a stream reader panicked"));
            (streamed.answer, streamed.longest_gap)
        })
        .collect()
}

fn sixteen_streams(served: &Served, during: impl FnOnce()) -> Vec<(String, Duration)> {
    all_streams(served, requests(), during)
}

/// The sum of a metric's series (any labels), polled until it is positive or `within` passes
/// (engine counters reach the gateway with its status polls).
fn positive_metric(served: &Served, name: &str, within: Duration) -> u64 {
    let deadline = Instant::now() + within;
    loop {
        let text = served.metrics();
        let sum: u64 = text
            .lines()
            .filter_map(|line| line.strip_prefix(name))
            .filter(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            .filter_map(|rest| rest.rsplit(' ').next())
            .filter_map(|value| value.trim().parse::<u64>().ok())
            .sum();
        if sum > 0 || Instant::now() >= deadline {
            return sum;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(&format!("{name} ")))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn streams_survive_a_killed_or_restarted_engine_with_the_uninterrupted_text() {
    use nix::sys::signal::{kill, Signal};
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    let served = Served::start(scratch.path(), "qwen3_moe");
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
        "engine SIGKILLed under {} streams (two of them gRPC): all identical to the uninterrupted run; longest token gap per text stream p50 {p50:?}, p99 {p99:?} (uninterrupted p99 {:?}); {resumed_streams} streams resumed",
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
        "engine restarted with SIGTERM under 18 streams: all identical; longest token gap per text stream p99 {:?}",
        gaps[(gaps.len() * 99).div_ceil(100) - 1]
    );
}

/// Seeded sampled answers of an engine that drafts with its MTP head (`ninfer run` turns it on
/// for a model with the head) survive a SIGKILL of the engine with their uninterrupted text:
/// the continuations draft too, and a token uses one draw of its seed's stream whether it was
/// drafted or not.
#[test]
fn sampled_streams_of_a_drafting_engine_resume_with_the_uninterrupted_text() {
    use nix::sys::signal::{kill, Signal};
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    let model = "qwen3_5_moe_trained";
    let served = Served::start(scratch.path(), model);
    let uninterrupted = all_streams(&served, drafting_requests(model), || {});
    for (answer, _) in &uninterrupted {
        assert!(!answer.contains("[error"), "{answer}");
        assert!(answer.len() > 20, "a short answer: {answer}");
    }
    let accepted = "ninfer_engine_draft_tokens_accepted_total";
    let accepted_before = positive_metric(&served, accepted, Duration::from_secs(5));
    assert!(accepted_before > 0, "the engine accepted no draft");
    let killed_pid = served.engine_pid();
    let resumed = all_streams(&served, drafting_requests(model), || {
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
            "drafting, stream {index} differs from its uninterrupted run"
        );
    }
    // The restarted engine's counts: drafts of the continuations alone.
    let accepted_after_restart = positive_metric(&served, accepted, Duration::from_secs(5));
    let metrics = served.metrics();
    let resumed_streams = metric(&metrics, "ninfer_gateway_resumed_streams_total");
    let mut gaps: Vec<Duration> = resumed.iter().map(|(_, gap)| *gap).collect();
    gaps.sort();
    eprintln!(
        "drafting engine SIGKILLed under {} streams: all identical to the uninterrupted run; {resumed_streams} resumed, {accepted_after_restart} drafts accepted by the restarted engine; longest token gap p99 {:?}",
        resumed.len(),
        gaps[(gaps.len() * 99).div_ceil(100) - 1]
    );
    assert!(
        resumed_streams >= 1,
        "no stream counted as resumed:\n{metrics}"
    );
    assert!(
        accepted_after_restart > 0,
        "the continuations accepted no draft:\n{metrics}"
    );
}
