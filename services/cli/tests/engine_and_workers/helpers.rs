//! What the files of this suite share: the workspace binaries, the fixtures' references, a
//! stack of child processes (engine, workers, gateway) killed on drop, gRPC clients and greedy
//! requests, the GPU check and a plain HTTP client.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::GenerateRequest;

use crate::common::{self, fixture};

pub use crate::common::binary;

pub fn reference(name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture(name).join("reference.json")).unwrap()).unwrap()
}

pub fn prompts(name: &str) -> Vec<Vec<u32>> {
    common::reference_prompts(name)
}

/// Child processes killed on drop, with their logs in the scratch directory.
pub struct Stack {
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
    pub fn new() -> Self {
        Stack {
            directory: tempfile::tempdir().unwrap(),
            children: Vec::new(),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.directory.path().join(name)
    }

    /// Converts a fixture (f32 weights: exact comparisons).
    pub fn convert(&self, fixture_name: &str) -> PathBuf {
        let output = self.path(&format!("{fixture_name}.ninfer"));
        common::convert_fixture_f32(fixture_name, &output);
        output
    }

    pub fn spawn(&mut self, label: &str, program: &Path, args: &[String]) {
        let log = File::create(self.path(&format!("{label}.log"))).unwrap();
        let child = Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push((label.to_string(), child));
    }

    pub fn worker(&mut self, label: &str, model: &Path, shard: &str, extra: &[&str]) -> String {
        self.worker_on(label, label, model, shard, extra)
    }

    /// A worker listening on `socket_name.sock` (a restarted worker reuses its predecessor's).
    pub fn worker_on(
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
    pub fn gateway(&mut self, engine: &str) -> String {
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

    pub fn engine(
        &mut self,
        label: &str,
        model: &Path,
        workers: &[String],
        extra: &[&str],
    ) -> String {
        self.engine_on(label, label, model, workers, extra)
    }

    /// An engine listening on `socket_name.sock` (a restarted engine reuses its predecessor's).
    pub fn engine_on(
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

    pub fn log(&self, label: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{label}.log"))).unwrap_or_default()
    }

    /// How often `needle` occurs in `label`'s log now.
    pub fn log_count(&self, label: &str, needle: &str) -> usize {
        self.log(label).matches(needle).count()
    }

    /// Polls `label`'s log until `needle` occurs more than `before` times (5 s at most); the
    /// time since `since`.
    pub fn wait_for_log(
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

    pub fn child(&mut self, label: &str) -> &mut Child {
        &mut self
            .children
            .iter_mut()
            .find(|(l, _)| l == label)
            .unwrap()
            .1
    }

    pub fn signal(&mut self, label: &str, signal: nix::sys::signal::Signal) {
        let pid = self.child(label).id() as i32;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).unwrap();
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub async fn client(address: &str) -> EngineClient<tonic::transport::Channel> {
    common::ready_engine_client(address, Duration::from_secs(30)).await
}

pub fn greedy(prompt: &[u32], max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt_token_ids: prompt.to_vec(),
        max_new_tokens,
        ..Default::default()
    }
}

pub async fn generate(
    client: &mut EngineClient<tonic::transport::Channel>,
    request: GenerateRequest,
) -> Vec<u32> {
    generate_acting_after(client, request, usize::MAX, || {}).await
}

/// Streams a generation and runs `action` once, right after the `after`-th token arrived (it may
/// block: the engine keeps generating meanwhile).
pub async fn generate_acting_after(
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

/// Whether the GPU opens; `false` skips a GPU test (and `NINFER_REQUIRE_GPU=1` fails it).
pub fn gpu_present(test: &str) -> bool {
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

/// One HTTP/1.1 request over a fresh connection: (status, body).
pub fn http(address: &str, method: &str, path: &str, body: &str) -> (u16, String) {
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
pub fn wait_for_health(address: &str, want: u16) {
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
