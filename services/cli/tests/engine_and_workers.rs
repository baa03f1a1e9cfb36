//! The process boundary, end to end: `ninfer-engine` and `ninfer-expert-worker` started as real
//! processes on unix sockets, spoken to over gRPC. Needs the workspace binaries built next to
//! this test (`scripts/test.sh` / `cargo test --workspace` builds them).

mod common;
use common::fixture;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::expert_worker_client::ExpertWorkerClient;
use ninfer_protocol::v1::gateway_client::GatewayClient;
use ninfer_protocol::v1::{
    AttachChannelRequest, EngineStatusRequest, GenerateRequest, WorkerInfoRequest,
};

/// A workspace binary next to this test's executable (target/<profile>/).
fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(
        path.exists(),
        "{} is not built; run the tests with `scripts/test.sh` (cargo test --workspace)",
        path.display()
    );
    path
}

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture(name).join("reference.json")).unwrap()).unwrap()
}

fn prompts(name: &str) -> Vec<Vec<u32>> {
    reference(name)["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["prompt_token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

/// Child processes killed on drop, with their logs in the scratch directory.
struct Stack {
    directory: tempfile::TempDir,
    children: Vec<(String, Child)>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Stack {
    fn new() -> Self {
        Stack {
            directory: tempfile::tempdir().unwrap(),
            children: Vec::new(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.directory.path().join(name)
    }

    /// Converts a fixture (f32 weights: exact comparisons).
    fn convert(&self, fixture_name: &str) -> PathBuf {
        let output = self.path(&format!("{fixture_name}.ninfer"));
        common::convert_fixture_f32(fixture_name, &output);
        output
    }

    fn spawn(&mut self, label: &str, program: &Path, args: &[String]) {
        let log = File::create(self.path(&format!("{label}.log"))).unwrap();
        let child = Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push((label.to_string(), child));
    }

    fn worker(&mut self, label: &str, model: &Path, shard: &str, extra: &[&str]) -> String {
        self.worker_on(label, label, model, shard, extra)
    }

    /// A worker listening on `socket_name.sock` (a restarted worker reuses its predecessor's).
    fn worker_on(
        &mut self,
        label: &str,
        socket_name: &str,
        model: &Path,
        shard: &str,
        extra: &[&str],
    ) -> String {
        let socket = format!(
            "unix:{}",
            self.path(&format!("{socket_name}.sock")).display()
        );
        let mut args = vec![
            "--model".to_string(),
            model.display().to_string(),
            "--experts".into(),
            shard.into(),
            "--listen".into(),
            socket.clone(),
            "--moe-threads".into(),
            "2".into(),
            "--kernel-isa".into(),
            "scalar".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        self.spawn(label, &binary("ninfer-expert-worker"), &args);
        socket
    }

    /// A gateway on a free loopback port in front of `engine`, once its `/health` is 200; its
    /// address.
    fn gateway(&mut self, engine: &str) -> String {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let api = format!("127.0.0.1:{port}");
        let state = self.path("state").display().to_string();
        self.spawn(
            "gateway",
            &binary("ninfer-gateway"),
            &["--engine", engine, "--listen", &api, "--state-dir", &state].map(String::from),
        );
        wait_for_health(&api, 200);
        api
    }

    fn engine(&mut self, label: &str, model: &Path, workers: &[String], extra: &[&str]) -> String {
        self.engine_on(label, label, model, workers, extra)
    }

    /// An engine listening on `socket_name.sock` (a restarted engine reuses its predecessor's).
    fn engine_on(
        &mut self,
        label: &str,
        socket_name: &str,
        model: &Path,
        workers: &[String],
        extra: &[&str],
    ) -> String {
        let socket = format!(
            "unix:{}",
            self.path(&format!("{socket_name}.sock")).display()
        );
        let mut args = vec!["--model".to_string(), model.display().to_string()];
        // The CPU unless the test names a device.
        if !extra.contains(&"--device") {
            args.extend(["--device".to_string(), "cpu".to_string()]);
        }
        args.extend([
            "--listen".to_string(),
            socket.clone(),
            "--moe-threads".into(),
            "2".into(),
            "--kernel-isa".into(),
            "scalar".into(),
        ]);
        if !workers.is_empty() {
            args.push("--experts".into());
            args.push(workers.join(","));
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        self.spawn(label, &binary("ninfer-engine"), &args);
        socket
    }

    fn log(&self, label: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{label}.log"))).unwrap_or_default()
    }

    /// How often `needle` occurs in `label`'s log now.
    fn log_count(&self, label: &str, needle: &str) -> usize {
        self.log(label).matches(needle).count()
    }

    /// Polls `label`'s log until `needle` occurs more than `before` times (5 s at most); the
    /// time since `since`.
    fn wait_for_log(
        &self,
        label: &str,
        needle: &str,
        before: usize,
        since: Instant,
    ) -> Option<Duration> {
        while since.elapsed() < Duration::from_secs(5) {
            if self.log(label).matches(needle).count() > before {
                return Some(since.elapsed());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    fn child(&mut self, label: &str) -> &mut Child {
        &mut self
            .children
            .iter_mut()
            .find(|(l, _)| l == label)
            .unwrap()
            .1
    }

    fn signal(&mut self, label: &str, signal: nix::sys::signal::Signal) {
        let pid = self.child(label).id() as i32;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).unwrap();
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn client(address: &str) -> EngineClient<tonic::transport::Channel> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(channel) =
            ninfer_protocol::transport::connect(address, Duration::from_millis(200)).await
        {
            let mut client = EngineClient::new(channel);
            if let Ok(status) = client.get_status(EngineStatusRequest {}).await {
                if status.get_ref().ready {
                    return client;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "engine at {address} not ready within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn greedy(prompt: &[u32], max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt_token_ids: prompt.to_vec(),
        max_new_tokens,
        ..Default::default()
    }
}

async fn generate(
    client: &mut EngineClient<tonic::transport::Channel>,
    request: GenerateRequest,
) -> Vec<u32> {
    generate_acting_after(client, request, usize::MAX, || {}).await
}

/// Streams a generation and runs `action` once, right after the `after`-th token arrived (it may
/// block: the engine keeps generating meanwhile).
async fn generate_acting_after(
    client: &mut EngineClient<tonic::transport::Channel>,
    request: GenerateRequest,
    after: usize,
    mut action: impl FnMut(),
) -> Vec<u32> {
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while let Some(message) = stream.message().await.unwrap() {
        if !message.no_token {
            tokens.push(message.token_id);
            if tokens.len() == after {
                action();
            }
        }
    }
    tokens
}

#[test]
fn greedy_through_workers_equals_in_process() {
    let rt = runtime();
    for name in ["qwen3_moe", "qwen3_next", "qwen3_5_moe"] {
        let mut stack = Stack::new();
        let model = stack.convert(name);
        let in_process = stack.engine("engine-local", &model, &[], &[]);
        let one = stack.worker("worker-all", &model, "all", &[]);
        let engine_one = stack.engine("engine-one", &model, &[one], &[]);
        let half0 = stack.worker("worker-half0", &model, "shard=0/2", &[]);
        let half1 = stack.worker("worker-half1", &model, "shard=1/2", &[]);
        let engine_two = stack.engine("engine-two", &model, &[half0, half1], &[]);
        // Half the experts of every layer resident in the backend's slots, the rest on two
        // workers of its own: the split must not change the tokens.
        let split0 = stack.worker("worker-split0", &model, "shard=0/2", &[]);
        let split1 = stack.worker("worker-split1", &model, "shard=1/2", &[]);
        let engine_split = stack.engine(
            "engine-split",
            &model,
            &[split0, split1],
            &["--moe-gpu-experts", "half"],
        );
        let expected = reference(name);
        for (index, prompt) in prompts(name).iter().enumerate() {
            let local = rt.block_on(async {
                generate(&mut client(&in_process).await, greedy(prompt, 24)).await
            });
            let through_one = rt.block_on(async {
                generate(&mut client(&engine_one).await, greedy(prompt, 24)).await
            });
            let through_two = rt.block_on(async {
                generate(&mut client(&engine_two).await, greedy(prompt, 24)).await
            });
            let through_split = rt.block_on(async {
                generate(&mut client(&engine_split).await, greedy(prompt, 24)).await
            });
            assert_eq!(local.len(), 24);
            assert_eq!(
                through_split, local,
                "{name} prompt {index}: half the experts in slots differs from in-process"
            );
            assert_eq!(
                through_one, local,
                "{name} prompt {index}: one worker differs from in-process"
            );
            assert_eq!(
                through_two, local,
                "{name} prompt {index}: two workers differ from in-process"
            );
            let transformers: Vec<u32> = expected["prompts"][index]["greedy_token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(
                local, transformers,
                "{name} prompt {index}: differs from the transformers greedy tokens"
            );
        }
        assert!(stack.log("engine-two").contains("expert worker registered"));
        assert!(stack
            .log("engine-split")
            .contains("GPU expert slots filled"));
    }
}

#[test]
fn concurrent_requests_equal_their_solo_results() {
    let rt = runtime();
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_next");
    let worker = stack.worker("worker", &model, "all", &[]);
    let engine = stack.engine("engine", &model, &[worker], &[]);
    let base = prompts("qwen3_next");
    // Eight different prompts: the fixture's two, and prefixes of them.
    let requests: Vec<Vec<u32>> = (0..8)
        .map(|i| base[i % 2][..base[i % 2].len() - i / 2].to_vec())
        .collect();
    rt.block_on(async {
        let mut solo = Vec::new();
        for prompt in &requests {
            solo.push(generate(&mut client(&engine).await, greedy(prompt, 16)).await);
        }
        let connected = client(&engine).await;
        let handles: Vec<_> = requests
            .iter()
            .map(|prompt| {
                let mut client = connected.clone();
                let request = greedy(prompt, 16);
                tokio::spawn(async move { generate(&mut client, request).await })
            })
            .collect();
        for (index, handle) in handles.into_iter().enumerate() {
            assert_eq!(
                handle.await.unwrap(),
                solo[index],
                "request {index} differs when batched"
            );
        }

        // A request that arrives while another decodes joins the running batch: the late, short
        // one finishes while the long one is still streaming, and neither changes.
        let long_solo = generate(&mut connected.clone(), greedy(&requests[0], 48)).await;
        let short_solo = solo[3][..8].to_vec();
        let mut stream = connected
            .clone()
            .generate(greedy(&requests[0], 48))
            .await
            .unwrap()
            .into_inner();
        let mut long = Vec::new();
        let mut late = None;
        let mut long_tokens_when_late_finished = None;
        while let Some(message) = stream.message().await.unwrap() {
            if message.no_token {
                continue;
            }
            long.push(message.token_id);
            if long.len() == 4 {
                let mut client = connected.clone();
                let request = greedy(&requests[3], 8);
                late = Some(tokio::spawn(
                    async move { generate(&mut client, request).await },
                ));
            }
            if long_tokens_when_late_finished.is_none()
                && late.as_ref().is_some_and(|handle| handle.is_finished())
            {
                long_tokens_when_late_finished = Some(long.len());
            }
        }
        assert_eq!(
            long, long_solo,
            "the running request changed when one joined"
        );
        assert_eq!(
            late.unwrap().await.unwrap(),
            short_solo,
            "the late request differs"
        );
        let at = long_tokens_when_late_finished
            .unwrap_or_else(|| panic!("the late request finished only after the long one"));
        assert!(
            at < 48,
            "the late request waited for the long one ({at} tokens)"
        );
        println!("late 8-token request finished while the long one was at token {at} of 48");
    });
}

#[test]
fn killed_or_stopped_worker_does_not_change_the_generation() {
    let (killed, stopped, _) = worker_kill_and_stop_keep_the_tokens(&[], 64);
    println!("killed worker noticed after {killed:?}, stopped worker after {stopped:?}");
}

/// One engine on `qwen3_moe` with `engine_args` and one slowed worker: a greedy generation of
/// `tokens` tokens, then the same generation with the worker killed (`SIGKILL`) after 10
/// tokens and restarted on its socket, then again with it stopped (`SIGSTOP`) for 300 ms after
/// 5: the same tokens every time, the death and the hang each noticed within a second, the
/// interrupted layer replayed and the resumed worker reported. Returns how long the engine took
/// to notice the death and the hang, and its log.
fn worker_kill_and_stop_keep_the_tokens(
    engine_args: &[&str],
    tokens: u32,
) -> (Duration, Duration, String) {
    use nix::sys::signal::Signal;
    let rt = runtime();
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_moe");
    let prompt = prompts("qwen3_moe")[0].clone();
    let worker = stack.worker("worker", &model, "all", &["--test-delay-ms", "20"]);
    let engine = stack.engine("engine", &model, std::slice::from_ref(&worker), engine_args);
    let uninterrupted =
        rt.block_on(async { generate(&mut client(&engine).await, greedy(&prompt, tokens)).await });
    assert_eq!(uninterrupted.len(), tokens as usize);

    let mut death_noticed_after = None;
    let interrupted = rt.block_on(async {
        let mut client = client(&engine).await;
        generate_acting_after(&mut client, greedy(&prompt, tokens), 10, || {
            let before = stack.log_count("engine", "expert worker died");
            let killed_at = Instant::now();
            stack.signal("worker", Signal::SIGKILL);
            let _ = stack.child("worker").wait();
            death_noticed_after =
                stack.wait_for_log("engine", "expert worker died", before, killed_at);
            stack.worker_on(
                "worker-restarted",
                "worker",
                &model,
                "all",
                &["--test-delay-ms", "20"],
            );
        })
        .await
    });
    let log = stack.log("engine");
    assert_eq!(
        interrupted, uninterrupted,
        "generation changed across a worker restart:\n{log}"
    );
    let death_noticed = death_noticed_after
        .unwrap_or_else(|| panic!("engine did not report the death within 5 s:\n{log}"));
    assert!(
        death_noticed < Duration::from_secs(1),
        "the dead worker was noticed after {death_noticed:?}, not within a second"
    );
    assert!(
        log.contains("replayed"),
        "engine did not replay the interrupted layer:\n{log}"
    );

    let mut hang_noticed_after = None;
    let resumed = rt.block_on(async {
        let mut client = client(&engine).await;
        generate_acting_after(&mut client, greedy(&prompt, tokens), 5, || {
            let before = stack.log_count("engine", "expert worker hung");
            let stopped_at = Instant::now();
            stack.signal("worker-restarted", Signal::SIGSTOP);
            hang_noticed_after =
                stack.wait_for_log("engine", "expert worker hung", before, stopped_at);
            std::thread::sleep(Duration::from_millis(300));
            stack.signal("worker-restarted", Signal::SIGCONT);
        })
        .await
    });
    let log = stack.log("engine");
    assert_eq!(
        resumed, uninterrupted,
        "a stopped worker changed the tokens"
    );
    let hang_noticed = hang_noticed_after
        .unwrap_or_else(|| panic!("engine did not report the hung worker within 5 s:\n{log}"));
    assert!(
        hang_noticed < Duration::from_secs(1),
        "the stopped worker was noticed after {hang_noticed:?}, not within a second"
    );
    assert!(
        log.contains("resumed"),
        "engine did not report the resumed worker:\n{log}"
    );
    (death_noticed, hang_noticed, log)
}

/// Whether the GPU opens; `false` skips a GPU test (and `NINFER_REQUIRE_GPU=1` fails it).
fn gpu_present(test: &str) -> bool {
    match ninfer_engine::backend::cuda::CudaBackend::new(0) {
        Ok(_) => true,
        Err(error) if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("NINFER_REQUIRE_GPU=1 but the GPU is unusable: {error}")
        }
        Err(error) => {
            println!("skipped `{test}`: {error}");
            false
        }
    }
}

/// On a GPU: with half of every layer's experts resident and the rest on two workers, the GPU
/// hands each MoE layer's CPU experts to the workers itself (the default) and gives the tokens
/// of the host's hand-off (`--cuda-worker-handoff off`), with decode steps as graphs and op by
/// op, alone and batched; and its steps do run as graphs with the hand-off inside.
#[test]
fn gpu_worker_handoff_gives_the_host_handoffs_tokens() {
    if !gpu_present("gpu_worker_handoff_gives_the_host_handoffs_tokens") {
        return;
    }
    let rt = runtime();
    for name in ["qwen3_moe", "qwen3_next", "qwen3_5_moe"] {
        let mut stack = Stack::new();
        let model = stack.convert(name);
        let mut engines = Vec::new();
        for (label, flags) in [
            ("host", &["--cuda-worker-handoff", "off"][..]),
            ("device", &[][..]),
            ("device-ops", &["--cuda-graphs", "off"][..]),
        ] {
            let workers: Vec<String> = (0..2)
                .map(|shard| {
                    stack.worker(
                        &format!("worker-{label}-{shard}"),
                        &model,
                        &format!("shard={shard}/2"),
                        &[],
                    )
                })
                .collect();
            let mut extra = vec!["--device", "cuda", "--moe-gpu-experts", "half"];
            extra.extend_from_slice(flags);
            engines.push((label, stack.engine(label, &model, &workers, &extra)));
        }
        let requests = prompts(name);
        rt.block_on(async {
            let mut expected = Vec::new();
            for prompt in &requests {
                expected.push(generate(&mut client(&engines[0].1).await, greedy(prompt, 32)).await);
            }
            for (label, engine) in &engines[1..] {
                for (index, prompt) in requests.iter().enumerate() {
                    let alone = generate(&mut client(engine).await, greedy(prompt, 32)).await;
                    assert_eq!(
                        alone, expected[index],
                        "{name} {label}: prompt {index} alone"
                    );
                }
                let connected = client(engine).await;
                let handles: Vec<_> = requests
                    .iter()
                    .map(|prompt| {
                        let mut client = connected.clone();
                        let request = greedy(prompt, 32);
                        tokio::spawn(async move { generate(&mut client, request).await })
                    })
                    .collect();
                for (index, handle) in handles.into_iter().enumerate() {
                    assert_eq!(
                        handle.await.unwrap(),
                        expected[index],
                        "{name} {label}: prompt {index} batched"
                    );
                }
            }
        });
        for (label, _) in &engines[1..] {
            let log = stack.log(label);
            assert!(
                log.contains("hand their CPU experts to the workers from the cuda"),
                "{name} {label}: the GPU did not hand off:\n{log}"
            );
            assert!(
                !log.contains("could not be recorded"),
                "{name} {label}: a step graph failed:\n{log}"
            );
        }
        let log = stack.log("device");
        assert!(
            log.contains("recorded as a graph, MoE layers handed to the workers by the device"),
            "{name}: no step graph with the hand-off inside:\n{log}"
        );
        assert!(!stack.log("host").contains("from the cuda"));
    }
}

/// On a GPU, with the hand-off on the GPU and steps as graphs: a worker killed mid-generation
/// (its death noticed within a second, a new one started on its socket) and a worker stopped
/// (noticed as hung within a second, then continued) change no token.
#[test]
fn gpu_worker_handoff_rides_out_a_killed_or_stopped_worker() {
    if !gpu_present("gpu_worker_handoff_rides_out_a_killed_or_stopped_worker") {
        return;
    }
    let cuda = ["--device", "cuda", "--moe-gpu-experts", "half"];
    let (killed, stopped, log) = worker_kill_and_stop_keep_the_tokens(&cuda, 48);
    assert!(
        log.contains("from the cuda"),
        "the GPU did not hand off:\n{log}"
    );
    println!("device hand-off: killed worker noticed after {killed:?}, stopped after {stopped:?}");
}

#[test]
fn worker_of_another_model_is_refused_with_both_ids() {
    let rt = runtime();
    let mut stack = Stack::new();
    let served = stack.convert("qwen3_moe");
    let other = stack.convert("qwen3_next");
    let worker = stack.worker("worker", &other, "all", &[]);
    let _engine = stack.engine("engine", &served, std::slice::from_ref(&worker), &[]);
    let (served_id, other_id) = rt.block_on(async {
        let connect = |address: String| async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Ok(channel) =
                    ninfer_protocol::transport::connect(&address, Duration::from_millis(200)).await
                {
                    if let Ok(info) = ExpertWorkerClient::new(channel)
                        .get_worker_info(WorkerInfoRequest {})
                        .await
                    {
                        return info.into_inner().model_id;
                    }
                }
                assert!(Instant::now() < deadline, "worker not up");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let other_id = connect(worker).await;
        let probe = stack.worker("probe", &served, "all", &[]);
        (connect(probe).await, other_id)
    });
    assert_ne!(served_id, other_id);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = stack.log("engine");
        if log.contains("refused") && log.contains(&served_id) && log.contains(&other_id) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "engine log does not name both model ids:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn corrupt_channel_requests_are_refused_not_fatal() {
    use ninfer_artifact::NO_EXPERT;
    use ninfer_channel::{ChannelGeometry, EngineChannel, Request, WaitOutcome};
    let rt = runtime();
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_moe");
    let worker = stack.worker("worker", &model, "shard=0/2", &[]);
    let name = format!("ninfer-test-corrupt-{}", std::process::id());
    let channel = EngineChannel::create(
        &name,
        ChannelGeometry {
            slot_count: 1,
            max_tokens: 4,
            hidden_size: 64,
            max_top_k: 2,
        },
    )
    .unwrap();
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut client = loop {
            if let Ok(c) =
                ninfer_protocol::transport::connect(&worker, Duration::from_millis(200)).await
            {
                break ExpertWorkerClient::new(c);
            }
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let model_id = loop {
            if let Ok(info) = client.get_worker_info(WorkerInfoRequest {}).await {
                break info.into_inner().model_id;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        client
            .attach_channel(AttachChannelRequest {
                shared_memory_path: channel.name().to_string(),
                model_id,
            })
            .await
            .unwrap();
    });
    let hidden = vec![0.1f32; 64];
    let cases: [(&str, u32, u32, &[u32]); 3] = [
        ("not owned", 0, 1, &[7, NO_EXPERT]),
        ("outside", 0, 1, &[99, NO_EXPERT]),
        ("not a MoE layer", 1, 1, &[0, NO_EXPERT]),
    ];
    for (what, layer, tokens, ids) in cases {
        let sequence = channel
            .post(
                0,
                &Request {
                    layer,
                    token_count: tokens,
                    top_k: 2,
                    expert_ids: ids,
                    routing_weights: &[1.0, 0.0],
                    hidden: &hidden,
                },
            )
            .unwrap();
        match channel.wait(0, sequence, Duration::from_secs(10)) {
            WaitOutcome::Refused(reason) => println!("{what}: refused: {reason}"),
            other => panic!("{what}: expected a refusal, got {other:?}"),
        }
    }
    // A bad length: more tokens than the slot holds.
    let sequence = channel.corrupt_request_for_tests(0, 1_000_000, 2, 0);
    assert!(matches!(
        channel.wait(0, sequence, Duration::from_secs(10)),
        WaitOutcome::Refused(_)
    ));
    // Still alive and correct afterwards.
    let sequence = channel
        .post(
            0,
            &Request {
                layer: 0,
                token_count: 1,
                top_k: 2,
                expert_ids: &[0, 3],
                routing_weights: &[0.5, 0.5],
                hidden: &hidden,
            },
        )
        .unwrap();
    assert_eq!(
        channel.wait(0, sequence, Duration::from_secs(10)),
        WaitOutcome::Done
    );
    assert!(channel.output(0).iter().any(|v| *v != 0.0));
    assert!(
        stack.child("worker").try_wait().unwrap().is_none(),
        "the worker exited"
    );
}

/// The worker's control side: `grpc.health.v1` says SERVING; a worker that may not lock memory
/// (`ulimit -l 0`) says so once, with the fix, and serves unlocked; statistics count exactly the
/// tokens the engine routed to it; drain detaches it without ending the process.
#[test]
fn worker_control_health_statistics_drain_and_memlock() {
    use ninfer_protocol::v1::{DrainRequest, RoutingStatisticsRequest, WorkerStatisticsRequest};
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let rt = runtime();
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_moe");
    let socket = format!("unix:{}", stack.path("worker.sock").display());
    let mut args = vec![
        "-c".to_string(),
        // Root locks regardless of the limit (CAP_IPC_LOCK): drop the capability too.
        "ulimit -l 0 && if command -v setpriv >/dev/null; then exec setpriv --bounding-set \
         -ipc_lock \"$0\" \"$@\"; else exec \"$0\" \"$@\"; fi"
            .into(),
        binary("ninfer-expert-worker").display().to_string(),
    ];
    args.extend(
        [
            "--model",
            &model.display().to_string(),
            "--experts",
            "all",
            "--listen",
            &socket,
            "--moe-threads",
            "1",
            "--kernel-isa",
            "scalar",
        ]
        .map(String::from),
    );
    stack.spawn("worker", Path::new("/bin/sh"), &args);
    let engine = stack.engine("engine", &model, std::slice::from_ref(&socket), &[]);
    let prompt = prompts("qwen3_moe")[0].clone();
    let can_lock_anyway = rt.block_on(async {
        let mut engine_client = client(&engine).await;
        assert_eq!(
            generate(&mut engine_client, greedy(&prompt, 6)).await.len(),
            6
        );
        let channel = ninfer_protocol::transport::connect(&socket, Duration::from_secs(2))
            .await
            .unwrap();
        let mut health = HealthClient::new(channel.clone());
        for service in ["", "ninfer.v1.ExpertWorker"] {
            let status = health
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap()
                .into_inner()
                .status;
            assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
        }
        let mut worker = ExpertWorkerClient::new(channel);
        let info = worker
            .get_worker_info(WorkerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        let can_lock_anyway = can_lock_regardless_of_the_limit(info.pid);
        if can_lock_anyway {
            println!("memlock part skipped: the worker kept CAP_IPC_LOCK (no setpriv)");
        } else {
            assert!(!info.banks_locked, "banks locked under `ulimit -l 0`");
        }
        // Every token of every MoE layer went to this worker (it owns all experts, top-2).
        let routed = engine_client
            .stream_routing_statistics(RoutingStatisticsRequest { interval_ms: 100 })
            .await
            .unwrap()
            .into_inner()
            .message()
            .await
            .unwrap()
            .unwrap();
        let routed_tokens: u64 = routed
            .layers
            .iter()
            .map(|layer| layer.expert_token_counts.iter().sum::<u64>())
            .sum::<u64>()
            / 2;
        assert!(routed_tokens > 0);
        let statistics = worker
            .get_statistics(WorkerStatisticsRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(statistics.tokens_computed, routed_tokens, "{statistics:?}");
        assert!(statistics.batches_computed > 0 && statistics.expert_bytes_streamed > 0);
        worker.drain(DrainRequest {}).await.unwrap();
        let after = worker
            .get_worker_info(WorkerInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(after.pid, info.pid, "the drained worker still answers");
        can_lock_anyway
    });
    let log = stack.log("worker");
    if !can_lock_anyway {
        assert_eq!(
            log.matches("cannot lock the expert banks").count(),
            1,
            "the memlock refusal is said exactly once:\n{log}"
        );
        assert!(log.contains("LimitMEMLOCK=infinity"), "{log}");
    }
    assert!(log.contains("drained"), "{log}");
    assert!(
        stack.child("worker").try_wait().unwrap().is_none(),
        "the worker exited after the drain"
    );
}

/// Whether process `pid` holds CAP_IPC_LOCK (bit 14 of its effective set), which lets it
/// `mlock` past RLIMIT_MEMLOCK.
fn can_lock_regardless_of_the_limit(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

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

#[test]
fn held_requests_fail_clearly_after_the_worker_timeout() {
    use nix::sys::signal::Signal;
    let rt = runtime();
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_moe");
    let prompt = prompts("qwen3_moe")[0].clone();
    let worker = stack.worker("worker", &model, "all", &[]);
    let engine = stack.engine("engine", &model, &[worker], &["--worker-timeout", "1"]);
    rt.block_on(async {
        let mut client = client(&engine).await;
        assert_eq!(generate(&mut client, greedy(&prompt, 4)).await.len(), 4);
        stack.signal("worker", Signal::SIGKILL);
        let _ = stack.child("worker").wait();
        let started = Instant::now();
        let mut stream = client
            .generate(greedy(&prompt, 4))
            .await
            .unwrap()
            .into_inner();
        let error = loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the request completed without its worker"),
                Err(status) => break status,
            }
        };
        let waited = started.elapsed();
        assert!(error.message().contains("--worker-timeout"), "{error:?}");
        assert!(
            waited >= Duration::from_millis(900) && waited < Duration::from_secs(15),
            "failed after {waited:?}"
        );
    });
}

#[test]
fn routing_statistics_are_streamed_and_recorded_at_exit() {
    use ninfer_protocol::v1::RoutingStatisticsRequest;
    let rt = runtime();
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_moe");
    let stats_file = stack.path("routing.json");
    let stats_arg = stats_file.display().to_string();
    let engine = stack.engine("engine", &model, &[], &["--moe-record-stats", &stats_arg]);
    let prompt = prompts("qwen3_moe")[0].clone();
    let streamed = rt.block_on(async {
        let mut client = client(&engine).await;
        generate(&mut client, greedy(&prompt, 8)).await;
        let mut stream = client
            .stream_routing_statistics(RoutingStatisticsRequest { interval_ms: 100 })
            .await
            .unwrap()
            .into_inner();
        stream.message().await.unwrap().unwrap()
    });
    // qwen3_moe fixture: layer 1 is dense, top-2 routing; prompt + 7 fed-back tokens per MoE layer.
    let tokens = (prompt.len() + 7) as u64;
    for layer in &streamed.layers {
        let total: u64 = layer.expert_token_counts.iter().sum();
        let expected = if layer.layer == 1 { 0 } else { 2 * tokens };
        assert_eq!(total, expected, "layer {}", layer.layer);
    }
    stack.signal("engine", nix::sys::signal::Signal::SIGTERM);
    let _ = stack.child("engine").wait();
    let recorded: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&stats_file).expect("stats file written at exit"))
            .unwrap();
    let layer0: u64 = recorded["layers"]["0"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(layer0, 2 * tokens);
}

/// One HTTP/1.1 request over a fresh connection: (status, body).
fn http(address: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Polls `GET /health` until it answers `want` (30 s at most).
fn wait_for_health(address: &str, want: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if std::net::TcpStream::connect(address).is_ok()
            && http(address, "GET", "/health", "").0 == want
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "/health did not answer {want} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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
