//! The real processes under stop signals and strangers: `ninfer run --serve` with idle HTTP/2
//! clients on the gateway and on the engine stops every process within 2 s of SIGTERM (each one
//! by itself, none killed) and leaves no shared-memory segment; the engine's socket is
//! owner-only; an engine on TCP with a control secret refuses callers without it, serves the
//! gateway that has it, and still exits within 2 s of SIGTERM while that gateway is connected;
//! an expert worker on TCP with a control secret refuses callers without it, and an engine with
//! the wrong secret says so and stays unready while one with the right secret registers it;
//! an engine or worker on a public address without a secret does not start unless told
//! `--insecure-listen`; ten SIGTERMs to `ninfer run --serve` under two streams each end them
//! with the documented drain error (the gateway stops before the engine).
//! Needs the workspace binaries built next to `ninfer` (`cargo build --workspace --bins`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ninfer_protocol::control_secret::SendSecret;
use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::expert_worker_client::ExpertWorkerClient;
use ninfer_protocol::v1::gateway_client::GatewayClient;
use ninfer_protocol::v1::{ListModelsRequest, ModelInfoRequest, WorkerInfoRequest};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn binary(name: &str) -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_ninfer"))
        .parent()
        .map(|directory| directory.join(name))
        .unwrap_or_else(|| PathBuf::from(name))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .unwrap_or_else(|error| panic!("no free port: {error}"))
}

/// The fixture converted (f32) into `directory`.
fn artifact(directory: &Path) -> PathBuf {
    let output = directory.join("qwen3_moe.ninfer");
    let status = Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(["convert", "--experts-dtype", "f32", "--dense-dtype", "f32"])
        .arg(fixture("qwen3_moe"))
        .arg(&output)
        .stderr(Stdio::null())
        .status()
        .unwrap_or_else(|error| panic!("convert: {error}"));
    assert!(status.success());
    output
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            !stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

fn segments_of(pid: i32) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with(&format!("ninfer-{pid}-")))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits for `child` to exit; returns how long it took, failing past `limit`.
fn exit_time(child: &mut Child, limit: Duration, what: &str) -> Duration {
    let started = Instant::now();
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return started.elapsed();
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("{what} still running {limit:?} after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn sigterm(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGTERM)
        .unwrap_or_else(|error| panic!("SIGTERM {pid}: {error}"));
}

#[test]
fn sigterm_with_idle_http2_clients_stops_every_process_by_itself_within_two_seconds() {
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    let model = artifact(scratch.path());
    let runtime_root = scratch.path().join("runtime");
    std::fs::create_dir_all(&runtime_root).unwrap_or_else(|error| panic!("{error}"));
    let listen = format!("127.0.0.1:{}", free_port());
    let log = scratch.path().join("run.err");
    let mut run = Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .env("XDG_RUNTIME_DIR", &runtime_root)
        .env("XDG_CACHE_HOME", scratch.path().join("cache"))
        .env("XDG_STATE_HOME", scratch.path().join("state"))
        .arg("run")
        .arg(&model)
        .args(["--moe-threads", "1", "--serve", "--listen", &listen])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap_or_else(|error| panic!("{error}")))
        .spawn()
        .unwrap_or_else(|error| panic!("ninfer run: {error}"));
    let stdout = BufReader::new(run.stdout.take().unwrap_or_else(|| panic!("no stdout")));
    let ready = stdout
        .lines()
        .map_while(Result::ok)
        .any(|line| line.starts_with("ready: "));
    assert!(ready, "run --serve never said ready");
    let runtime_dir = runtime_root.join(format!("ninfer-{}", run.id()));
    let pid_of = |label: &str| -> i32 {
        std::fs::read_to_string(runtime_dir.join(format!("{label}.pid")))
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or_else(|| panic!("no pid file for {label}"))
    };
    let children = [pid_of("gateway"), pid_of("engine"), pid_of("experts-0")];
    // The engine is reached on sockets only this user may open: its gRPC API and its tokens.
    let engine_socket = runtime_dir.join("engine.sock");
    for socket in [
        engine_socket.clone(),
        runtime_dir.join("engine.sock.tokens"),
    ] {
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&socket)
                .unwrap_or_else(|error| panic!("{}: {error}", socket.display()))
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600, "{} mode {mode:o}", socket.display());
    }
    // Idle HTTP/2 clients: one on the gateway, one on the engine, each after one call.
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|error| panic!("{error}"));
    let engine_address = format!("unix:{}", engine_socket.display());
    let _idle_clients = tokio.block_on(async {
        let gateway = ninfer_protocol::transport::connect(&listen, Duration::from_secs(2))
            .await
            .unwrap_or_else(|error| panic!("gateway: {error}"));
        let mut gateway_client = GatewayClient::new(gateway.clone());
        gateway_client
            .list_models(ListModelsRequest {})
            .await
            .unwrap_or_else(|error| panic!("ListModels: {error}"));
        let engine = ninfer_protocol::transport::connect(&engine_address, Duration::from_secs(2))
            .await
            .unwrap_or_else(|error| panic!("engine: {error}"));
        EngineClient::new(engine.clone())
            .get_model_info(ModelInfoRequest {})
            .await
            .unwrap_or_else(|error| panic!("GetModelInfo: {error}"));
        (gateway, engine)
    });
    sigterm(run.id());
    let took = exit_time(&mut run, Duration::from_secs(2), "ninfer run --serve");
    eprintln!("ninfer run --serve and its children stopped {took:?} after SIGTERM");
    for pid in children {
        assert!(!alive(pid), "child {pid} still running after run stopped");
    }
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !said.contains("did not stop in time"),
        "a child had to be killed:\n{said}"
    );
    assert!(
        segments_of(children[1]).is_empty(),
        "shared memory left behind"
    );
}

#[test]
fn an_engine_on_tcp_refuses_callers_without_its_secret_and_stops_with_a_gateway_connected() {
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    let model = artifact(scratch.path());
    let secret_file = scratch.path().join("control-secret");
    std::fs::write(&secret_file, "correct horse battery staple\n")
        .unwrap_or_else(|error| panic!("{error}"));
    let engine_address = format!("127.0.0.1:{}", free_port());
    let mut engine = Command::new(binary("ninfer-engine"))
        .arg("--model")
        .arg(&model)
        .args([
            "--device",
            "cpu",
            "--moe-threads",
            "1",
            "--listen",
            &engine_address,
        ])
        .arg("--control-secret-file")
        .arg(&secret_file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("engine: {error}"));
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|error| panic!("{error}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    let refusal = loop {
        let answer = tokio.block_on(async {
            let channel =
                ninfer_protocol::transport::connect(&engine_address, Duration::from_millis(300))
                    .await
                    .ok()?;
            Some(
                EngineClient::new(channel)
                    .get_model_info(ModelInfoRequest {})
                    .await,
            )
        });
        match answer {
            Some(answer) => break answer,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            None => panic!("the engine never listened"),
        }
    };
    let status = refusal.expect_err("a caller without the secret was served");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    // The gateway, given the secret, serves; it holds HTTP/2 connections (and an endless
    // routing-statistics stream) to the engine.
    let api = format!("127.0.0.1:{}", free_port());
    let mut gateway = Command::new(binary("ninfer-gateway"))
        .args(["--engine", &engine_address, "--listen", &api])
        .arg("--control-secret-file")
        .arg(&secret_file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("gateway: {error}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let healthy = tokio.block_on(async {
            let channel = ninfer_protocol::transport::connect(&api, Duration::from_millis(300))
                .await
                .ok()?;
            let models = GatewayClient::new(channel)
                .list_models(ListModelsRequest {})
                .await
                .ok()?;
            Some(models.get_ref().models.iter().any(|m| m.ready_engines > 0))
        });
        if healthy == Some(true) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway never saw the engine ready"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let engine_pid = engine.id() as i32;
    sigterm(engine.id());
    let took = exit_time(&mut engine, Duration::from_secs(2), "the engine");
    eprintln!("standalone engine with a gateway connected stopped {took:?} after SIGTERM");
    assert!(
        segments_of(engine_pid).is_empty(),
        "shared memory left behind"
    );
    sigterm(gateway.id());
    let took = exit_time(&mut gateway, Duration::from_secs(2), "the gateway");
    eprintln!("gateway stopped {took:?} after SIGTERM");
}

#[test]
fn a_grpc_client_idle_past_the_idle_timeout_carries_on() {
    // The gateway closes a silent connection (GOAWAY); the client's next call must not fail.
    let api = format!("127.0.0.1:{}", free_port());
    let mut gateway = Command::new(binary("ninfer-gateway"))
        .args([
            "--engine",
            "127.0.0.1:1",
            "--listen",
            &api,
            "--idle-timeout-seconds",
            "0.5",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("gateway: {error}"));
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|error| panic!("{error}"));
    let outcome = tokio.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        let channel = loop {
            match ninfer_protocol::transport::connect(&api, Duration::from_millis(300)).await {
                Ok(channel) => break channel,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(error) => panic!("the gateway never listened: {error}"),
            }
        };
        let mut client = GatewayClient::new(channel);
        let mut answers = Vec::new();
        for _ in 0..3 {
            answers.push(client.list_models(ListModelsRequest {}).await.map(|_| ()));
            // Idle long enough for the gateway to close the connection.
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        answers
    });
    sigterm(gateway.id());
    exit_time(&mut gateway, Duration::from_secs(2), "the gateway");
    for (call, answer) in outcome.iter().enumerate() {
        assert!(
            answer.is_ok(),
            "call {call} after an idle close failed: {answer:?}"
        );
    }
}

/// `GET /health` of a gateway: (status, body), or `None` while it does not answer.
fn health(api: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(api).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let status = answer.split(' ').nth(1)?.parse().ok()?;
    Some((status, answer))
}

#[test]
fn another_user_cannot_reach_the_engine_socket() {
    let effective_uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status
                .lines()
                .find(|line| line.starts_with("Uid:"))?
                .to_string();
            line.split_whitespace().nth(2).map(str::to_string)
        });
    if effective_uid.as_deref() != Some("0") {
        eprintln!("SKIPPED: switching to another user needs root; the socket mode is checked in the SIGTERM test");
        return;
    }
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    // The directory lets anyone through: only the socket's own mode keeps others out.
    std::fs::set_permissions(
        scratch.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let model = artifact(scratch.path());
    let socket = scratch.path().join("engine.sock");
    let address = format!("unix:{}", socket.display());
    let mut engine = Command::new(binary("ninfer-engine"))
        .arg("--model")
        .arg(&model)
        .args([
            "--device",
            "cpu",
            "--moe-threads",
            "1",
            "--listen",
            &address,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("engine: {error}"));
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|error| panic!("{error}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while tokio
        .block_on(async {
            let channel = ninfer_protocol::transport::connect(&address, Duration::from_millis(300))
                .await
                .ok()?;
            EngineClient::new(channel)
                .get_model_info(ModelInfoRequest {})
                .await
                .ok()
        })
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "the engine never answered its owner"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A gateway run by user `nobody` cannot open the socket: the engine stays unreachable.
    let api = format!("127.0.0.1:{}", free_port());
    let mut stranger = {
        use std::os::unix::process::CommandExt;
        Command::new(binary("ninfer-gateway"))
            .args(["--engine", &address, "--listen", &api])
            .uid(65534)
            .gid(65534)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("gateway as nobody: {error}"))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let (status, body) = loop {
        match health(&api) {
            Some((status, body)) if body.to_ascii_lowercase().contains("permission denied") => {
                break (status, body)
            }
            Some((200, body)) => panic!("a gateway run by another user reached the engine: {body}"),
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            other => panic!("the stranger's gateway never reported the refusal: {other:?}"),
        }
    };
    assert_eq!(status, 503, "{body}");
    sigterm(stranger.id());
    exit_time(&mut stranger, Duration::from_secs(2), "the gateway");
    sigterm(engine.id());
    exit_time(&mut engine, Duration::from_secs(2), "the engine");
}

/// Waits until `log` holds `needle` (the process writing it may still be starting).
fn wait_for_log(log: &Path, needle: &str, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "`{needle}` never appeared in {}:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_expert_worker_on_tcp_refuses_callers_without_its_secret() {
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    let model = artifact(scratch.path());
    let secret = "worker secret 42";
    let secret_file = scratch.path().join("control-secret");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap_or_else(|error| panic!("{error}"));
    let worker_address = format!("127.0.0.1:{}", free_port());
    // The secret comes from the environment (a file named there), never the command line.
    let mut worker = Command::new(binary("ninfer-expert-worker"))
        .arg("--model")
        .arg(&model)
        .args(["--listen", &worker_address, "--moe-threads", "1"])
        .env("NINFER_CONTROL_SECRET_FILE", &secret_file)
        .env_remove("NINFER_CONTROL_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("worker: {error}"));
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|error| panic!("{error}"));
    let worker_info = |secret: Option<&str>| {
        tokio.block_on(async {
            let channel =
                ninfer_protocol::transport::connect(&worker_address, Duration::from_millis(300))
                    .await
                    .ok()?;
            Some(
                ExpertWorkerClient::with_interceptor(channel, SendSecret::new(secret))
                    .get_worker_info(WorkerInfoRequest {})
                    .await,
            )
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let refusal = loop {
        match worker_info(None) {
            Some(answer) => break answer,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            None => panic!("the worker never listened"),
        }
    };
    let status = refusal.expect_err("a caller without the secret was served");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("shared secret"), "{status:?}");
    let wrong = worker_info(Some("guess")).map(|answer| answer.map(|_| ()));
    assert!(
        matches!(&wrong, Some(Err(status)) if status.code() == tonic::Code::Unauthenticated),
        "{wrong:?}"
    );
    let served = worker_info(Some(secret)).map(|answer| answer.map(|info| info.into_inner().pid));
    assert!(
        matches!(served, Some(Ok(pid)) if pid == worker.id()),
        "{served:?}"
    );

    // An engine with another secret is refused, says why, and stays unready.
    let engine = |label: &str, secret: &str| {
        let log = scratch.path().join(format!("{label}.log"));
        let log_file = std::fs::File::create(&log).unwrap_or_else(|error| panic!("{error}"));
        let child = Command::new(binary("ninfer-engine"))
            .arg("--model")
            .arg(&model)
            .args([
                "--device",
                "cpu",
                "--moe-threads",
                "1",
                "--experts",
                &worker_address,
            ])
            .arg("--listen")
            .arg(format!(
                "unix:{}",
                scratch.path().join(format!("{label}.sock")).display()
            ))
            .env("NINFER_CONTROL_SECRET", secret)
            .env_remove("NINFER_CONTROL_SECRET_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|error| panic!("engine: {error}"));
        (child, log)
    };
    let (mut refused_engine, log) = engine("engine-wrong-secret", "not the worker's");
    let text = wait_for_log(
        &log,
        "refuses this engine's control secret",
        Duration::from_secs(60),
    );
    assert!(!text.contains("expert worker registered"), "{text}");
    assert!(
        !text.contains("not the worker's"),
        "the secret was logged: {text}"
    );
    sigterm(refused_engine.id());
    exit_time(&mut refused_engine, Duration::from_secs(2), "the engine");
    // With the worker's secret, the engine registers it.
    let (mut engine, log) = engine("engine-right-secret", secret);
    wait_for_log(&log, "expert worker registered", Duration::from_secs(60));
    sigterm(engine.id());
    exit_time(&mut engine, Duration::from_secs(2), "the engine");
    sigterm(worker.id());
    exit_time(&mut worker, Duration::from_secs(2), "the worker");
}

/// A program started with `arguments` and no control secret: its exit status and log, failing
/// if it is still running after `limit`.
fn exit_without_secret(program: &str, arguments: &[&str], limit: Duration) -> (bool, String) {
    let output = Command::new(binary(program))
        .args(arguments)
        .env_remove("NINFER_CONTROL_SECRET")
        .env_remove("NINFER_CONTROL_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("{program}: {error}"));
    let started = Instant::now();
    let pid = output.id() as i32;
    let mut child = output;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if started.elapsed() < limit => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                panic!("{program} (pid {pid}) still ran {limit:?} after its start");
            }
        }
    }
    let finished = child
        .wait_with_output()
        .unwrap_or_else(|error| panic!("{program}: {error}"));
    let log = String::from_utf8_lossy(&finished.stdout).into_owned()
        + &String::from_utf8_lossy(&finished.stderr);
    (finished.status.success(), log)
}

/// An engine or worker on a non-loopback TCP address without a control secret refuses to start
/// (before it loads anything), naming the secret's sources and `--insecure-listen`; with that
/// flag the engine serves there.
#[test]
fn engines_and_workers_on_a_public_address_refuse_to_start_without_a_secret() {
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    let model = artifact(scratch.path());
    let model = model.display().to_string();
    let public = format!("0.0.0.0:{}", free_port());
    let engine_arguments = [
        "--model",
        &model,
        "--device",
        "cpu",
        "--moe-threads",
        "1",
        "--listen",
        &public,
    ];
    let (succeeded, log) =
        exit_without_secret("ninfer-engine", &engine_arguments, Duration::from_secs(20));
    assert!(!succeeded, "the engine started:\n{log}");
    for named in ["--insecure-listen", "--control-secret-file", &public] {
        assert!(
            log.contains(named),
            "the refusal does not name {named}:\n{log}"
        );
    }
    let worker_arguments = ["--model", &model, "--moe-threads", "1", "--listen", &public];
    let (succeeded, log) = exit_without_secret(
        "ninfer-expert-worker",
        &worker_arguments,
        Duration::from_secs(20),
    );
    assert!(!succeeded, "the worker started:\n{log}");
    assert!(log.contains("--insecure-listen"), "{log}");

    // Loopback needs no flag (a warning only), and the explicit flag opens a public address.
    let mut engine = Command::new(binary("ninfer-engine"))
        .args(engine_arguments)
        .arg("--insecure-listen")
        .env_remove("NINFER_CONTROL_SECRET")
        .env_remove("NINFER_CONTROL_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("engine: {error}"));
    let port = public.rsplit(':').next().unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_err() {
        assert!(
            matches!(engine.try_wait(), Ok(None)),
            "the engine with --insecure-listen exited"
        );
        assert!(Instant::now() < deadline, "the engine never listened");
        std::thread::sleep(Duration::from_millis(100));
    }
    sigterm(engine.id());
    exit_time(&mut engine, Duration::from_secs(5), "the engine");
}

/// One streaming request on its own connection, read in the background: everything the
/// gateway sent until it closed the connection.
fn streaming_request(
    api: &str,
    path: &str,
    body: &str,
) -> (
    std::sync::mpsc::Receiver<()>,
    std::thread::JoinHandle<String>,
) {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect(api).unwrap_or_else(|error| panic!("{api}: {error}"));
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nanthropic-version: 2023-06-01\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .unwrap_or_else(|error| panic!("{error}"));
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let (first_text, first_text_seen) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut received = Vec::new();
        let mut buffer = [0u8; 4096];
        let mut told = false;
        while let Ok(read) = stream.read(&mut buffer) {
            if read == 0 {
                break;
            }
            received.extend_from_slice(&buffer[..read]);
            let text = String::from_utf8_lossy(&received);
            // The headers, then at least two events: the answer is streaming.
            if !told && text.matches("data: ").count() >= 2 {
                told = true;
                let _ = first_text.send(());
            }
        }
        String::from_utf8_lossy(&received).into_owned()
    });
    (first_text_seen, reader)
}

/// Ten SIGTERMs in a row to `ninfer run --serve`, each under two streams already answering (an
/// OpenAI chat and an Anthropic message): the gateway is stopped before the engine, so every
/// stream ends with the documented drain error (`server_shutting_down`, Anthropic
/// `overloaded_error`), never an engine failure, and every process is gone within 2 s.
#[test]
fn every_sigterm_under_streams_ends_them_with_the_documented_code() {
    let scratch = tempfile::tempdir().unwrap_or_else(|error| panic!("{error}"));
    let model = artifact(scratch.path());
    let runtime_root = scratch.path().join("runtime");
    std::fs::create_dir_all(&runtime_root).unwrap_or_else(|error| panic!("{error}"));
    // Answers of hundreds of tokens: the chat ignores end-of-sequence, the message's prompt makes
    // the fixture write 400 tokens.
    let chat = r#"{"model": "qwen3_moe", "stream": true, "max_tokens": 2000, "ignore_eos": true, "temperature": 0, "messages": [{"role": "user", "content": "Count"}]}"#;
    let message = r#"{"model": "qwen3_moe", "stream": true, "max_tokens": 2000, "temperature": 0, "messages": [{"role": "user", "content": "Tell me a story"}]}"#;
    let mut stop_times = Vec::new();
    for round in 0..10 {
        let listen = format!("127.0.0.1:{}", free_port());
        let log = scratch.path().join(format!("run-{round}.err"));
        let mut run = Command::new(env!("CARGO_BIN_EXE_ninfer"))
            .env("XDG_RUNTIME_DIR", &runtime_root)
            .env("XDG_CACHE_HOME", scratch.path().join("cache"))
            .env("XDG_STATE_HOME", scratch.path().join("state"))
            // Slow experts keep both answers streaming past the gateway's drain deadline.
            .env("NINFER_WORKER_TEST_DELAY_MS", "5")
            .arg("run")
            .arg(&model)
            .args(["--moe-threads", "1", "--serve", "--listen", &listen])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap_or_else(|error| panic!("{error}")))
            .spawn()
            .unwrap_or_else(|error| panic!("ninfer run: {error}"));
        let stdout = BufReader::new(run.stdout.take().unwrap_or_else(|| panic!("no stdout")));
        let ready = stdout
            .lines()
            .map_while(Result::ok)
            .any(|line| line.starts_with("ready: "));
        assert!(ready, "round {round}: run --serve never said ready");
        let runtime_dir = runtime_root.join(format!("ninfer-{}", run.id()));
        let pid_of = |label: &str| -> i32 {
            std::fs::read_to_string(runtime_dir.join(format!("{label}.pid")))
                .ok()
                .and_then(|text| text.trim().parse().ok())
                .unwrap_or_else(|| panic!("no pid file for {label}"))
        };
        let children = [pid_of("gateway"), pid_of("engine"), pid_of("experts-0")];
        let (openai_started, openai) = streaming_request(&listen, "/v1/chat/completions", chat);
        let (anthropic_started, anthropic) = streaming_request(&listen, "/v1/messages", message);
        for started in [openai_started, anthropic_started] {
            started
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("round {round}: a stream never answered"));
        }
        sigterm(run.id());
        let took = exit_time(&mut run, Duration::from_secs(2), "ninfer run --serve");
        stop_times.push(took);
        for pid in children {
            assert!(!alive(pid), "round {round}: child {pid} still running");
        }
        let openai = openai.join().unwrap_or_else(|_| panic!("reader panicked"));
        let anthropic = anthropic
            .join()
            .unwrap_or_else(|_| panic!("reader panicked"));
        // The drain error is the stream's one error and its last event (OpenAI: before
        // `[DONE]`): no stream saw the engine go away first (OpenAI `service_unavailable`,
        // Anthropic `api_error`) and then the drain error too.
        let openai_events = sse_data(&openai);
        let openai_errors = openai_events
            .iter()
            .filter(|event| json_of(event).get("error").is_some())
            .count();
        assert!(
            openai_errors == 1
                && openai_events.len() >= 2
                && openai_events[openai_events.len() - 2]
                    .contains("\"code\":\"server_shutting_down\"")
                && openai_events[openai_events.len() - 1] == "[DONE]",
            "round {round}: the OpenAI stream did not end with the drain error alone:\n{}",
            tail(&openai)
        );
        let anthropic_events = sse_data(&anthropic);
        let anthropic_errors = anthropic_events
            .iter()
            .filter(|event| json_of(event)["type"] == "error")
            .count();
        assert!(
            anthropic_errors == 1
                && anthropic_events
                    .last()
                    .is_some_and(|last| last.contains("\"type\":\"overloaded_error\"")),
            "round {round}: the Anthropic stream did not end with the drain error alone:\n{}",
            tail(&anthropic)
        );
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            !said.contains("did not stop in time"),
            "round {round}: a child had to be killed:\n{said}"
        );
    }
    let slowest = stop_times.iter().max().copied().unwrap_or_default();
    eprintln!(
        "ten SIGTERMs under two streams: 20 of 20 streams ended with the drain error; every process gone after {stop_times:?} (slowest {slowest:?})"
    );
}

/// The `data:` payloads of a server-sent event stream, in order.
fn sse_data(received: &str) -> Vec<&str> {
    received
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(str::trim)
        .collect()
}

/// An event's payload as JSON (`null` where it is not, as `[DONE]`).
fn json_of(event: &str) -> serde_json::Value {
    serde_json::from_str(event).unwrap_or_default()
}

/// The last few hundred characters of what a stream carried, for a failure message.
fn tail(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    chars[chars.len().saturating_sub(600)..].iter().collect()
}
