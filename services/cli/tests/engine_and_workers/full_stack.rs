//! The whole stack as a user meets it: `ninfer run` answering a prompt, chatting and printing
//! its plan; `ninfer run --serve` under the official SDKs (on the fixtures and on Qwen4-Exp, and
//! on a GPU through the OpenAI API); an agent's second turn through the gateway reporting the
//! prompt tokens it reused.

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ninfer_protocol::v1::gateway_client::GatewayClient;

use crate::common::fixture;
use crate::helpers::{gpu_present, http, runtime, Stack};

/// `ninfer run` on the shipped fixture as the README says: `--prompt` answers once (the
/// checkpoint directory converted once into the cache, then reused); the terminal chat answers
/// the same prompt with the same greedy text, toggles `/think`, forgets with `/reset`, leaves on
/// `/exit`; `--dry-run --json` prints the plan; the runtime directory is gone afterwards.
#[test]
fn run_answers_a_prompt_chats_and_prints_its_plan() {
    use std::io::Write;
    let stack = Stack::new();
    let runtime_base = stack.path("runtime");
    std::fs::create_dir_all(&runtime_base).unwrap();
    let ninfer = |extra: &[&str], stdin: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ninfer"));
        command
            .arg("run")
            .arg(fixture("qwen3_moe"))
            .args([
                "--moe-threads",
                "1",
                "--temperature",
                "0",
                "--max-tokens",
                "12",
            ])
            .args(extra)
            .env("XDG_RUNTIME_DIR", &runtime_base)
            .env("XDG_CACHE_HOME", stack.path("cache"))
            .env("XDG_STATE_HOME", stack.path("state"))
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().unwrap();
        if let Some(text) = stdin {
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
        }
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(
            output.status.success(),
            "ninfer run {extra:?} failed ({}):\n{stdout}\n{stderr}",
            output.status
        );
        (stdout, stderr)
    };

    let (answer, stderr) = ninfer(&["--prompt", "Hello"], None);
    assert!(stderr.contains("converting"), "{stderr}");
    let answer = answer.strip_suffix('\n').unwrap_or(&answer).to_string();
    assert!(!answer.trim().is_empty(), "no answer to --prompt");

    let (chat, stderr) = ninfer(&[], Some("Hello\n/think\n/think\n/reset\nHello\n/exit\n"));
    assert!(!stderr.contains("converting"), "converted twice:\n{stderr}");
    let expected = format!(
        "qwen3_moe ready. /think toggles thinking, /reset clears the conversation, /exit quits.\n\
         > {answer}\n> (thinking on)\n> (thinking off)\n> (conversation cleared)\n> {answer}\n> "
    );
    assert_eq!(chat, expected);

    let (plan, _) = ninfer(&["--dry-run", "--json", "--moe-gpu-experts", "half"], None);
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    assert_eq!(plan["architecture"], "qwen3_moe");
    assert_eq!(plan["gpu_experts_per_layer"], 4, "{plan}");
    assert_eq!(plan["expert_workers"][0]["threads"], 1, "{plan}");
    assert!(plan["device"].is_string() && plan["max_context"].as_u64() > Some(0));

    let left: Vec<_> = std::fs::read_dir(&runtime_base).unwrap().collect();
    assert!(left.is_empty(), "runtime directories left behind: {left:?}");
}

/// The official `openai` and `anthropic` Python SDKs against `ninfer run --serve` on a fixture:
/// chat and completions, streaming and not, usage, stop strings, Anthropic event order, and a raw
/// greedy completion equal to the transformers reference text. `.ci/run` installs the SDKs.
#[test]
fn official_sdks_against_the_full_stack() {
    official_sdks_against(&["qwen3_moe"]);
}

/// The same SDK checks on the Qwen4-Exp fixture (hyper-connection streams, PLE n-gram blocks,
/// QSA attention): `ninfer run` serves the converted checkpoint through the OpenAI and
/// Anthropic APIs, and its raw greedy completion is transformers' reference text.
#[test]
fn official_sdks_against_qwen4_exp() {
    official_sdks_against(&["qwen4_exp"]);
}

fn official_sdks_against(fixtures: &[&str]) {
    let have_sdks = Command::new("python3")
        .args(["-c", "import openai, anthropic"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have_sdks {
        println!("SKIPPED: python3 with the openai and anthropic packages is not installed (.ci/run installs them)");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for fixture_name in fixtures {
        let stack = Stack::new();
        let model = stack.convert(fixture_name);
        let served = ServedByRun::start(&stack, &model, &[]);
        let output = served.ready.then(|| {
            Command::new("python3")
                .arg(root.join("scripts/sdk_smoke.py"))
                .args(["--base-url", &format!("http://{}", served.api)])
                .arg("--reference")
                .arg(fixture(fixture_name).join("reference.json"))
                .output()
                .unwrap()
        });
        served.stop_and_check(&stack);
        let output = output.unwrap();
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        println!("{fixture_name}:\n{report}");
        assert!(
            output.status.success(),
            "SDK checks failed on {fixture_name}:\n{report}"
        );
    }
}

/// On a GPU: `ninfer run --serve` of the Qwen4-Exp fixture on CUDA answers a raw greedy
/// completion through the OpenAI API with transformers' reference tokens (plain HTTP, so the
/// GPU machine needs no SDKs).
#[test]
fn gpu_qwen4_exp_answers_through_the_openai_api() {
    if !gpu_present("gpu_qwen4_exp_answers_through_the_openai_api") {
        return;
    }
    let stack = Stack::new();
    let model = stack.convert("qwen4_exp");
    let served = ServedByRun::start(&stack, &model, &["--device", "cuda"]);
    let result = served.ready.then(|| {
        let reference: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture("qwen4_exp").join("reference.json")).unwrap(),
        )
        .unwrap();
        let plain = reference["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["kind"] == "plain")
            .unwrap()
            .clone();
        let ids = plain["greedy_token_ids"].as_array().unwrap().len();
        let request = serde_json::json!({
            "model": "qwen4_exp",
            "prompt": plain["prompt_token_ids"],
            "max_tokens": ids,
            "temperature": 0,
        });
        let (status, body) = http(&served.api, "POST", "/v1/completions", &request.to_string());
        let detokenize = serde_json::json!({
            "model": "qwen4_exp",
            "tokens": plain["greedy_token_ids"],
            "skip_special_tokens": true,
        });
        let (_, expected) = http(&served.api, "POST", "/detokenize", &detokenize.to_string());
        (status, body, expected, ids)
    });
    served.stop_and_check(&stack);
    let (status, body, expected, ids) = result.unwrap();
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&expected).unwrap();
    assert_eq!(
        answer["choices"][0]["text"], expected["prompt"],
        "CUDA greedy text differs from the reference: {body}"
    );
    assert_eq!(answer["usage"]["completion_tokens"], ids, "{body}");
}

/// `ninfer run --serve` of `model` on a free loopback port, with its log in the stack.
struct ServedByRun {
    run: std::process::Child,
    api: String,
    ready: bool,
}

impl ServedByRun {
    fn start(stack: &Stack, model: &Path, extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let api = format!("127.0.0.1:{port}");
        let run = Command::new(env!("CARGO_BIN_EXE_ninfer"))
            .args(["run", "--serve", "--moe-threads", "1", "--listen", &api])
            .args(extra)
            .arg(model)
            .env("XDG_RUNTIME_DIR", stack.path(""))
            .env("XDG_STATE_HOME", stack.path("state"))
            .stdout(Stdio::null())
            .stderr(File::create(stack.path("run.log")).unwrap())
            .spawn()
            .unwrap();
        let ready = runtime().block_on(async {
            use ninfer_protocol::v1::gateway_client::GatewayClient;
            use ninfer_protocol::v1::ListModelsRequest;
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(channel) =
                    ninfer_protocol::transport::connect(&api, Duration::from_millis(200)).await
                {
                    if let Ok(models) = GatewayClient::new(channel)
                        .list_models(ListModelsRequest {})
                        .await
                    {
                        if models.get_ref().models.iter().any(|m| m.ready_engines > 0) {
                            return true;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            false
        });
        ServedByRun { run, api, ready }
    }

    /// SIGTERM; the stack must have become ready and `ninfer run` must stop cleanly.
    fn stop_and_check(mut self, stack: &Stack) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.run.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let stopped = self.run.wait().unwrap();
        assert!(
            self.ready,
            "the stack did not become ready:\n{}",
            std::fs::read_to_string(stack.path("run.log")).unwrap_or_default()
        );
        assert!(
            stopped.success(),
            "ninfer run did not stop cleanly: {stopped}"
        );
    }
}

/// An agent's second turn through the gateway reuses its first turn's prompt: the engine with a
/// prefix cache and MTP drafting on (as `ninfer run` starts it for a model with an MTP head),
/// the same long system prompt twice, the conversation grown between; the second
/// answer reports cached prompt tokens (Anthropic `cache_read_input_tokens`, OpenAI
/// `prompt_tokens_details.cached_tokens`, the gRPC API's `cached_prompt_tokens`), the first
/// none, and `/metrics` counts the hits.
#[test]
fn a_second_turn_reports_the_prompt_tokens_it_reused() {
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_5_moe");
    let engine = stack.engine(
        "engine",
        &model,
        &[],
        &["--prefix-cache-gib", "1", "--spec", "mtp"],
    );
    let api = stack.gateway(&engine);
    let system = "You are a careful agent with tools for files and shells. ".repeat(40);
    let first = serde_json::json!({
        "model": "qwen3_5_moe", "max_tokens": 4, "temperature": 0, "system": system,
        "messages": [{"role": "user", "content": "List the files."}],
    });
    let (status, body) = http(&api, "POST", "/v1/messages", &first.to_string());
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["usage"]["cache_read_input_tokens"], 0, "{answer}");
    let first_input = answer["usage"]["input_tokens"].as_u64().unwrap();
    assert!(first_input > 600, "a prompt of several blocks: {answer}");
    let second = serde_json::json!({
        "model": "qwen3_5_moe", "max_tokens": 4, "temperature": 0, "system": system,
        "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "Here they are."},
            {"role": "user", "content": "Now read the first one."},
        ],
    });
    let (status, body) = http(&api, "POST", "/v1/messages", &second.to_string());
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    let cached = answer["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached >= 256 && cached % 256 == 0, "{answer}");
    assert!(cached < first_input, "{answer}");
    let chat = serde_json::json!({
        "model": "qwen3_5_moe", "max_tokens": 4, "temperature": 0,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "List the files."},
        ],
    });
    let (status, body) = http(&api, "POST", "/v1/chat/completions", &chat.to_string());
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 256, "{answer}");
    let grpc_usage = runtime().block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{api}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let chat = ninfer_protocol::v1::ChatRequest {
            model: "qwen3_5_moe".into(),
            messages: [("system", system.as_str()), ("user", "List the files.")]
                .map(|(role, content)| ninfer_protocol::v1::ChatMessage {
                    role: role.into(),
                    content: content.into(),
                    reasoning_content: String::new(),
                    images: Vec::new(),
                })
                .to_vec(),
            options: Some(ninfer_protocol::v1::GatewaySamplingOptions {
                temperature: Some(0.0),
                max_tokens: 4,
                ..Default::default()
            }),
            enable_thinking: None,
            chat_template_kwargs_json: String::new(),
        };
        GatewayClient::new(channel)
            .chat(chat)
            .await
            .unwrap()
            .into_inner()
            .usage
            .unwrap()
    });
    assert!(
        grpc_usage.cached_prompt_tokens >= 256
            && grpc_usage.cached_prompt_tokens < grpc_usage.prompt_tokens,
        "{grpc_usage:?}"
    );
    // The gateway polls the engine's status about twice a second.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, metrics) = http(&api, "GET", "/metrics", "");
        let hits = metrics
            .lines()
            .find(|line| line.starts_with("ninfer_engine_prefix_cache_hits_total{"))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse::<u64>().ok());
        if hits == Some(3) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "prefix cache hits on /metrics: {metrics}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
