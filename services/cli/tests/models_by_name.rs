//! Models by name, against a fake hub on loopback (no network): `ninfer run ORG/NAME` and
//! `ninfer convert ORG/NAME` download the fixture checkpoint the way the Hugging Face and
//! ModelScope APIs serve it (file list, then each file), resume a file whose connection was cut
//! with an HTTP range, refuse a file whose SHA-256 does not match, and name the model a 404 is
//! about; `--dry-run` downloads nothing. And plans for machines this one is not: `--dry-run
//! --plan-json --machine-profile FILE` for a 16 GB card with 64 GB of RAM and a 24 GB card with
//! 128 GB.

mod common;
use common::fixture;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

/// Files of the fixture checkpoint the fake hub serves.
const SERVED_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors",
];

fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// What the fake hub saw: each file request's path and `Range` header.
type Requests = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A hub serving `Org/Tiny` (the fixture) and `Org/Corrupt` (the fixture with a wrong
/// checksum listed for its weights) in both APIs' shapes; anything else is 404. The first
/// request for `model.safetensors` of each repository is cut halfway.
struct FakeHub {
    endpoint: String,
    requests: Requests,
}

impl FakeHub {
    fn start() -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let files: HashMap<String, Vec<u8>> = SERVED_FILES
            .iter()
            .map(|name| {
                (
                    name.to_string(),
                    std::fs::read(fixture("qwen3_moe").join(name)).unwrap(),
                )
            })
            .collect();
        let files = Arc::new(files);
        let requests: Requests = Arc::default();
        let cut_already = Arc::new(Mutex::new(Vec::<String>::new()));
        let seen = requests.clone();
        std::thread::spawn(move || {
            for connection in listener.incoming().flatten() {
                let (files, seen, cut_already) = (files.clone(), seen.clone(), cut_already.clone());
                std::thread::spawn(move || serve(connection, &files, &seen, &cut_already));
            }
        });
        FakeHub { endpoint, requests }
    }
}

fn serve(
    mut connection: TcpStream,
    files: &HashMap<String, Vec<u8>>,
    seen: &Requests,
    cut_already: &Mutex<Vec<String>>,
) {
    let mut reader = BufReader::new(connection.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let mut range = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("range") {
                range = Some(value.trim().to_string());
            }
        }
    }
    let target = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string();
    let respond = |connection: &mut TcpStream, status: &str, headers: &str, body: &[u8]| {
        let _ = connection.write_all(
            format!(
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n{headers}\r\n",
                body.len()
            )
            .as_bytes(),
        );
        let _ = connection.write_all(body);
    };
    let listing = |repository: &str, modelscope: bool| {
        let entries: Vec<serde_json::Value> = SERVED_FILES
            .iter()
            .map(|name| {
                let bytes = &files[*name];
                let mut sha = sha256_hex(bytes);
                if repository == "Org/Corrupt" && *name == "model.safetensors" {
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
    };
    let known = |repository: &str| repository == "Org/Tiny" || repository == "Org/Corrupt";
    // Hugging Face: /api/models/ORG/NAME/tree/main?recursive=true, /ORG/NAME/resolve/main/FILE.
    // ModelScope: /api/v1/models/ORG/NAME/repo/files?..., /api/v1/models/ORG/NAME/repo?...&FilePath=FILE.
    let (repository, file) = if let Some(rest) = target.strip_prefix("/api/v1/models/") {
        let repository: String = rest.split('/').take(2).collect::<Vec<_>>().join("/");
        if rest.contains("/repo/files") {
            if known(&repository) {
                respond(
                    &mut connection,
                    "200 OK",
                    "",
                    listing(&repository, true).as_bytes(),
                );
            } else {
                respond(&mut connection, "404 Not Found", "", b"{}");
            }
            return;
        }
        let file = rest.split("FilePath=").nth(1).unwrap_or("").to_string();
        (repository, file)
    } else if let Some(rest) = target.strip_prefix("/api/models/") {
        let repository: String = rest.split('/').take(2).collect::<Vec<_>>().join("/");
        if known(&repository) {
            respond(
                &mut connection,
                "200 OK",
                "",
                listing(&repository, false).as_bytes(),
            );
        } else {
            respond(
                &mut connection,
                "404 Not Found",
                "",
                b"{\"error\":\"Repository not found\"}",
            );
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
    seen.lock().unwrap().push((file.clone(), range.clone()));
    let Some(bytes) = files.get(&file).filter(|_| known(&repository)) else {
        respond(&mut connection, "404 Not Found", "", b"");
        return;
    };
    let start: usize = range
        .as_deref()
        .and_then(|range| range.strip_prefix("bytes="))
        .and_then(|range| range.trim_end_matches('-').parse().ok())
        .unwrap_or(0);
    let rest = &bytes[start.min(bytes.len())..];
    let (status, headers) = if start > 0 {
        (
            "206 Partial Content",
            format!(
                "content-range: bytes {start}-{}/{}\r\n",
                bytes.len() - 1,
                bytes.len()
            ),
        )
    } else {
        ("200 OK", String::new())
    };
    let first_of_weights = file == "model.safetensors" && {
        let mut cut = cut_already.lock().unwrap();
        let first = !cut.contains(&repository);
        cut.push(repository.clone());
        first
    };
    if first_of_weights {
        // Promise everything, send half, hang up.
        let _ = connection.write_all(
            format!(
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n{headers}\r\n",
                rest.len()
            )
            .as_bytes(),
        );
        let _ = connection.write_all(&rest[..rest.len() / 2]);
        let _ = connection.flush();
        let _ = connection.shutdown(std::net::Shutdown::Both);
        return;
    }
    respond(&mut connection, status, &headers, rest);
}

fn ninfer(scratch: &Path, hub: &FakeHub) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ninfer"));
    std::fs::create_dir_all(scratch.join("runtime")).unwrap();
    command
        .env("XDG_RUNTIME_DIR", scratch.join("runtime"))
        .env("XDG_CACHE_HOME", scratch.join("cache"))
        .env("XDG_STATE_HOME", scratch.join("state"))
        .env("NINFER_MODELS_DIR", scratch.join("models"))
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("MODELSCOPE_ENDPOINT", &hub.endpoint)
        .env_remove("NINFER_SOURCE")
        .env_remove("HF_TOKEN")
        .stdin(Stdio::null());
    command
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).to_string()
}

#[test]
fn a_model_by_name_is_downloaded_resumed_checked_and_converted() {
    let scratch = tempfile::tempdir().unwrap();
    let hub = FakeHub::start();
    let models = scratch.path().join("models");

    // A dry run plans nothing it would have to download, and writes nothing.
    let dry = ninfer(scratch.path(), &hub)
        .args(["run", "Org/Tiny", "--dry-run", "--plan-json"])
        .output()
        .unwrap();
    assert!(!dry.status.success());
    assert!(stderr_of(&dry).contains("Org/Tiny"), "{}", stderr_of(&dry));
    assert!(
        !models.exists(),
        "a dry run wrote into the models directory"
    );
    assert!(hub.requests.lock().unwrap().is_empty());

    // `convert ORG/NAME` downloads the checkpoint (the weights resumed after a cut) and converts.
    let output = scratch.path().join("tiny.ninfer");
    let converted = ninfer(scratch.path(), &hub)
        .args([
            "convert",
            "--experts-dtype",
            "f32",
            "--dense-dtype",
            "f32",
            "Org/Tiny",
        ])
        .arg(&output)
        .output()
        .unwrap();
    assert!(converted.status.success(), "{}", stderr_of(&converted));
    assert!(output.is_file());
    let downloaded = models.join("Org/Tiny");
    for name in SERVED_FILES {
        assert_eq!(
            std::fs::read(downloaded.join(name)).unwrap(),
            std::fs::read(fixture("qwen3_moe").join(name)).unwrap(),
            "{name}"
        );
    }
    assert!(!downloaded.join("README.md").exists());
    let requests = hub.requests.lock().unwrap().clone();
    let weights: Vec<Option<String>> = requests
        .iter()
        .filter(|(file, _)| file == "model.safetensors")
        .map(|(_, range)| range.clone())
        .collect();
    let half = std::fs::metadata(fixture("qwen3_moe/model.safetensors"))
        .unwrap()
        .len()
        / 2;
    assert_eq!(
        weights,
        [None, Some(format!("bytes={half}-"))],
        "the cut download was not resumed from where it stopped"
    );
    let progress = stderr_of(&converted);
    assert!(
        progress.contains("model.safetensors:") && progress.contains("MiB"),
        "{progress}"
    );

    // `run ORG/NAME` now finds it; the dry run plans from it without a request to the hub.
    let before = hub.requests.lock().unwrap().len();
    let planned = ninfer(scratch.path(), &hub)
        .args(["run", "Org/Tiny", "--dry-run", "--plan-json"])
        .output()
        .unwrap();
    assert!(planned.status.success(), "{}", stderr_of(&planned));
    let plan: serde_json::Value = serde_json::from_slice(&planned.stdout).unwrap();
    assert_eq!(plan["architecture"], "qwen3_moe");
    assert_eq!(hub.requests.lock().unwrap().len(), before);
}

#[test]
fn modelscope_serves_the_same_and_failures_name_the_model() {
    let scratch = tempfile::tempdir().unwrap();
    let hub = FakeHub::start();
    let models = scratch.path().join("models");
    let output = scratch.path().join("tiny.ninfer");
    let converted = ninfer(scratch.path(), &hub)
        .args(["convert", "--experts-dtype", "f32", "--dense-dtype", "f32"])
        .args(["--source", "modelscope", "Org/Tiny"])
        .arg(&output)
        .output()
        .unwrap();
    assert!(converted.status.success(), "{}", stderr_of(&converted));
    assert!(models.join("Org/Tiny/model.safetensors").is_file());

    // NINFER_SOURCE chooses the hub too; an unknown model is a 404 that names it.
    let missing = ninfer(scratch.path(), &hub)
        .args(["run", "Org/Nowhere", "--prompt", "Hi"])
        .env("NINFER_SOURCE", "modelscope")
        .output()
        .unwrap();
    let message = stderr_of(&missing);
    assert!(!missing.status.success());
    assert!(
        message.contains("Org/Nowhere")
            && message.contains("404")
            && message.contains("ModelScope"),
        "{message}"
    );
    let missing = ninfer(scratch.path(), &hub)
        .args(["serve", "Org/Nowhere"])
        .output()
        .unwrap();
    let message = stderr_of(&missing);
    assert!(
        message.contains("Org/Nowhere: no such model on Hugging Face (404"),
        "{message}"
    );

    // A file whose checksum does not match is refused and removed.
    let corrupt = ninfer(scratch.path(), &hub)
        .args(["convert", "Org/Corrupt"])
        .arg(scratch.path().join("corrupt.ninfer"))
        .output()
        .unwrap();
    let message = stderr_of(&corrupt);
    assert!(!corrupt.status.success());
    assert!(
        message.contains("model.safetensors") && message.contains("does not match"),
        "{message}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(models.join("Org/Corrupt"))
        .unwrap()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().to_string())
        .filter(|name| name.starts_with("model.safetensors"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// The plan for a machine described in a file, as JSON.
fn plan_for_profile(scratch: &Path, profile: serde_json::Value) -> serde_json::Value {
    let file = scratch.join("machine.json");
    std::fs::write(&file, profile.to_string()).unwrap();
    let hub = FakeHub::start();
    let output = ninfer(scratch, &hub)
        .args(["run", "--dry-run", "--plan-json", "--machine-profile"])
        .arg(&file)
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr_of(&output));
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn plans_for_machine_profiles() {
    let scratch = tempfile::tempdir().unwrap();
    let small = plan_for_profile(
        scratch.path(),
        serde_json::json!({"cpus": 8, "numa_nodes": 1, "ram_gib": 64, "gpu_vram_gib": 16}),
    );
    let large = plan_for_profile(
        scratch.path(),
        serde_json::json!({"cpus": 32, "numa_nodes": 2, "ram_gib": 128, "gpu_vram_gib": 24}),
    );
    for plan in [&small, &large] {
        // A GPU: experts fitted on it by default; the tiny model fits whole.
        assert_eq!(plan["gpu_experts"], "auto", "{plan}");
        let experts = plan["gpu_experts_estimate"].as_u64().unwrap();
        assert!(experts > 0, "{plan}");
        assert!(plan["max_context"].as_u64().unwrap() > 0);
        assert_eq!(plan["kv_dtype"], "bf16");
        assert_eq!(plan["mtp_draft_tokens"], 0);
        // Dense weights on the GPU: host RAM holds the expert banks.
        assert_eq!(plan["host_ram_bytes"], plan["expert_bank_bytes"], "{plan}");
    }
    assert_eq!(small["machine"]["gpu"]["total_bytes"], 16u64 << 30);
    assert_eq!(small["machine"]["ram_total_bytes"], 64u64 << 30);
    assert_eq!(small["expert_workers"].as_array().unwrap().len(), 1);
    assert_eq!(small["expert_workers"][0]["threads"], 8);
    assert_eq!(large["machine"]["gpu"]["total_bytes"], 24u64 << 30);
    assert_eq!(large["expert_workers"].as_array().unwrap().len(), 2);
    assert_eq!(large["expert_workers"][1]["experts"], "shard=1/2");

    // Values are checked against the profile's machine, not this one.
    let file = scratch.path().join("machine.json");
    std::fs::write(&file, r#"{"cpus": 4, "ram_gib": 8}"#).unwrap();
    let hub = FakeHub::start();
    let refused = ninfer(scratch.path(), &hub)
        .args([
            "run",
            "--dry-run",
            "--moe-threads",
            "6",
            "--machine-profile",
        ])
        .arg(&file)
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        stderr_of(&refused).contains("--moe-threads 6: this machine lets ninfer use 4 CPUs"),
        "{}",
        stderr_of(&refused)
    );
    std::fs::write(&file, r#"{"cpus": 4, "ram": 8}"#).unwrap();
    let malformed = ninfer(scratch.path(), &hub)
        .args(["run", "--dry-run", "--machine-profile"])
        .arg(&file)
        .arg(fixture("qwen3_moe"))
        .output()
        .unwrap();
    assert!(!malformed.status.success());
    assert!(
        stderr_of(&malformed).contains("--machine-profile"),
        "{}",
        stderr_of(&malformed)
    );
}
