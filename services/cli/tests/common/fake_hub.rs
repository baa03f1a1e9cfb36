//! A model hub on loopback for the tests of models by name: it answers the Hugging Face and the
//! ModelScope APIs (file listings and files, with HTTP byte ranges) for the repositories it is
//! given, and counts what it sends.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One repository of the hub.
#[derive(Clone, Default)]
pub struct Repo {
    pub files: Vec<(String, Arc<Vec<u8>>)>,
    /// Listing and files answer 401 without an `Authorization` header.
    pub gated: bool,
    /// Files the listing gives a wrong SHA-256 for.
    pub wrong_sha: Vec<String>,
    /// Files served only up to this many bytes while the listing gives their full size.
    pub truncated: HashMap<String, usize>,
    /// Files whose first request is cut halfway through its answer.
    pub cut_first: Vec<String>,
}

impl Repo {
    /// The files `names` of `directory`.
    pub fn from_directory(directory: &Path, names: &[&str]) -> Repo {
        Repo {
            files: names
                .iter()
                .map(|name| {
                    let bytes = std::fs::read(directory.join(name))
                        .unwrap_or_else(|e| panic!("{}: {e}", directory.join(name).display()));
                    (name.to_string(), Arc::new(bytes))
                })
                .collect(),
            ..Repo::default()
        }
    }

    pub fn with_file(mut self, name: &str, bytes: Vec<u8>) -> Repo {
        self.files.retain(|(existing, _)| existing != name);
        self.files.push((name.to_string(), Arc::new(bytes)));
        self
    }

    pub fn bytes(&self, name: &str) -> &[u8] {
        &self
            .files
            .iter()
            .find(|(existing, _)| existing == name)
            .unwrap_or_else(|| panic!("no file {name}"))
            .1
    }
}

/// What a hub saw: each file request's repository, path and `Range` header.
pub type Requests = Arc<Mutex<Vec<(String, String, Option<String>)>>>;

pub struct FakeHub {
    pub endpoint: String,
    pub requests: Requests,
    /// Body bytes of file answers sent (listings not counted).
    pub served: Arc<AtomicU64>,
    /// Each file request waits this many milliseconds before answering.
    pub delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// An endpoint where nothing listens (connections are refused).
pub fn dead_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{address}")
}

/// An endpoint that accepts connections and never answers.
pub fn silent_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for connection in listener.incoming().flatten() {
            held.push(connection);
        }
    });
    endpoint
}

struct Shared {
    repos: HashMap<String, Repo>,
    requests: Requests,
    served: Arc<AtomicU64>,
    delay_ms: Arc<AtomicU64>,
    cut_already: Mutex<Vec<String>>,
}

impl FakeHub {
    pub fn start(repos: HashMap<String, Repo>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let requests: Requests = Arc::default();
        let served = Arc::new(AtomicU64::new(0));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            repos,
            requests: requests.clone(),
            served: served.clone(),
            delay_ms: delay_ms.clone(),
            cut_already: Mutex::new(Vec::new()),
        });
        let stopped = stop.clone();
        std::thread::spawn(move || {
            for connection in listener.incoming().flatten() {
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                let shared = shared.clone();
                std::thread::spawn(move || serve(connection, &shared));
            }
        });
        FakeHub {
            endpoint,
            requests,
            served,
            delay_ms,
            stop,
        }
    }
}

fn respond(connection: &mut TcpStream, status: &str, headers: &str, body: &[u8]) {
    let _ = connection.write_all(
        format!(
            "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n{headers}\r\n",
            body.len()
        )
        .as_bytes(),
    );
    let _ = connection.write_all(body);
}

fn listing(repo: &Repo, modelscope: bool) -> String {
    let entries: Vec<serde_json::Value> = repo
        .files
        .iter()
        .map(|(name, bytes)| {
            let mut sha = sha256_hex(bytes);
            if repo.wrong_sha.contains(name) {
                sha = "0".repeat(64);
            }
            if modelscope {
                serde_json::json!({"Type": "blob", "Path": name, "Size": bytes.len(), "Sha256": sha})
            } else {
                serde_json::json!({"type": "file", "path": name, "size": bytes.len(),
                                   "lfs": {"oid": sha, "size": bytes.len()}})
            }
        })
        .chain([serde_json::json!({"type": "file", "path": "README.md", "size": 5})])
        .collect();
    if modelscope {
        serde_json::json!({"Code": 200, "Data": {"Files": entries}}).to_string()
    } else {
        serde_json::Value::from(entries).to_string()
    }
}

fn serve(mut connection: TcpStream, shared: &Shared) {
    let mut reader = BufReader::new(connection.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let (mut range, mut authorized) = (None, false);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("range") {
                range = Some(value.trim().to_string());
            }
            if name.eq_ignore_ascii_case("authorization") {
                authorized = true;
            }
        }
    }
    let target = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string();
    // Hugging Face: /api/models/ORG/NAME/tree/main?recursive=true, /ORG/NAME/resolve/main/FILE.
    // ModelScope: /api/v1/models/ORG/NAME/repo/files?..., /api/v1/models/ORG/NAME/repo?...&FilePath=FILE.
    let (repository, file) = if let Some(rest) = target.strip_prefix("/api/v1/models/") {
        let repository: String = rest.split('/').take(2).collect::<Vec<_>>().join("/");
        if rest.contains("/repo/files") {
            match shared.repos.get(&repository) {
                Some(repo) if repo.gated && !authorized => {
                    respond(&mut connection, "401 Unauthorized", "", b"{}")
                }
                Some(repo) => respond(
                    &mut connection,
                    "200 OK",
                    "",
                    listing(repo, true).as_bytes(),
                ),
                None => respond(&mut connection, "404 Not Found", "", b"{}"),
            }
            return;
        }
        let file = rest.split("FilePath=").nth(1).unwrap_or("").to_string();
        (repository, file)
    } else if let Some(rest) = target.strip_prefix("/api/models/") {
        let repository: String = rest.split('/').take(2).collect::<Vec<_>>().join("/");
        match shared.repos.get(&repository) {
            Some(repo) if repo.gated && !authorized => {
                respond(&mut connection, "401 Unauthorized", "", b"{}")
            }
            Some(repo) => respond(
                &mut connection,
                "200 OK",
                "",
                listing(repo, false).as_bytes(),
            ),
            None => respond(
                &mut connection,
                "404 Not Found",
                "",
                b"{\"error\":\"Repository not found\"}",
            ),
        }
        return;
    } else {
        let parts: Vec<&str> = target.trim_start_matches('/').splitn(5, '/').collect();
        match parts.as_slice() {
            [organisation, name, "resolve", "main", file] => {
                (format!("{organisation}/{name}"), file.to_string())
            }
            _ => {
                respond(&mut connection, "404 Not Found", "", b"");
                return;
            }
        }
    };
    shared
        .requests
        .lock()
        .unwrap()
        .push((repository.clone(), file.clone(), range.clone()));
    let delay = shared.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        std::thread::sleep(Duration::from_millis(delay));
    }
    let Some(repo) = shared.repos.get(&repository) else {
        respond(&mut connection, "404 Not Found", "", b"");
        return;
    };
    if repo.gated && !authorized {
        respond(&mut connection, "401 Unauthorized", "", b"");
        return;
    }
    let Some((_, bytes)) = repo.files.iter().find(|(name, _)| *name == file) else {
        respond(&mut connection, "404 Not Found", "", b"");
        return;
    };
    let total = bytes.len();
    let available = repo
        .truncated
        .get(&file)
        .copied()
        .unwrap_or(total)
        .min(total);
    // `bytes=A-B` (inclusive) or `bytes=A-`.
    let asked = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .map(|r| {
            let (start, end) = r.split_once('-').unwrap_or((r, ""));
            let start: usize = start.trim().parse().unwrap_or(0);
            let end: usize = end.trim().parse().map(|e: usize| e + 1).unwrap_or(total);
            (start, end.min(total))
        });
    let (status, headers, start, end) = match asked {
        Some((start, _)) if start >= total => {
            respond(
                &mut connection,
                "416 Range Not Satisfiable",
                &format!("content-range: bytes */{total}\r\n"),
                b"",
            );
            return;
        }
        Some((start, end)) => (
            "206 Partial Content",
            format!("content-range: bytes {start}-{}/{total}\r\n", end - 1),
            start,
            end,
        ),
        None => ("200 OK", String::new(), 0, total),
    };
    let cut = repo.cut_first.contains(&file) && {
        let mut cut = shared.cut_already.lock().unwrap();
        let key = format!("{repository}/{file}");
        let first = !cut.contains(&key);
        cut.push(key);
        first
    };
    // Promise the whole range; send what is available (half of it when cutting), hang up.
    let sent_end = if cut {
        start + (end - start) / 2
    } else {
        end.min(available.max(start))
    };
    let _ = connection.write_all(
        format!(
            "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n{headers}\r\n",
            end - start
        )
        .as_bytes(),
    );
    let body = &bytes[start..sent_end];
    if connection.write_all(body).is_ok() {
        shared.served.fetch_add(body.len() as u64, Ordering::SeqCst);
    }
    let _ = connection.flush();
    let _ = connection.shutdown(std::net::Shutdown::Both);
}
