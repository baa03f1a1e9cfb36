//! The worker's side of the boundary: a worker of another model refused, corrupt channel
//! requests refused without harm, health, statistics, drain and memory locking, held requests
//! failing after the worker timeout, routing statistics streamed and recorded at exit.

use std::path::Path;
use std::time::{Duration, Instant};

use ninfer_protocol::v1::expert_worker_client::ExpertWorkerClient;
use ninfer_protocol::v1::{AttachChannelRequest, WorkerInfoRequest};

use crate::helpers::{binary, client, generate, greedy, prompts, runtime, Stack};

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
