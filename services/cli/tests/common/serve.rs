//! `ninfer run --serve` for the integration tests: private runtime, cache and state directories,
//! a free loopback port, the server stopped with SIGTERM when dropped, and plain HTTP requests.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `ninfer` with private runtime, cache and state directories under `scratch`.
pub fn ninfer(scratch: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ninfer"));
    let runtime = scratch.join("runtime");
    std::fs::create_dir_all(&runtime).unwrap_or_else(|e| panic!("{e}"));
    command
        .env("XDG_RUNTIME_DIR", runtime)
        .env("XDG_CACHE_HOME", scratch.join("cache"))
        .env("XDG_STATE_HOME", scratch.join("state"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    command
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// `ninfer run MODEL --serve` on the CPU; stopped with SIGTERM on drop.
pub struct Server {
    pub child: Child,
    pub address: String,
}

impl Server {
    pub fn start(scratch: &Path, model: &Path, extra: &[&str]) -> Self {
        let address = format!("127.0.0.1:{}", free_port());
        let log =
            std::fs::File::create(scratch.join("server.log")).unwrap_or_else(|e| panic!("{e}"));
        let child = ninfer(scratch)
            .arg("run")
            .arg(model)
            .args([
                "--serve", "--listen", &address, "--device", "cpu", "--no-mtp",
            ])
            .args(["--moe-threads", "1"])
            .args(extra)
            .stdout(log.try_clone().unwrap_or_else(|e| panic!("{e}")))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("ninfer run: {e}"));
        let mut server = Server { child, address };
        let deadline = Instant::now() + Duration::from_secs(180);
        while http(&server.address, "GET", "/health", None).0 != 200 {
            if Instant::now() > deadline || matches!(server.child.try_wait(), Ok(Some(_))) {
                let log = std::fs::read_to_string(scratch.join("server.log")).unwrap_or_default();
                let _ = server.child.kill();
                panic!("ninfer run --serve did not become healthy:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 request on a fresh connection: (status, body).
pub fn http(address: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(address) else {
        return (0, String::new());
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    if stream.write_all(request.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    (status, body)
}
