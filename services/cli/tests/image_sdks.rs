//! The official `openai` and `anthropic` Python SDKs send an image to `ninfer run --serve` of
//! the multimodal `qwen3_5_moe` fixture (its vision tower on the CPU) and get answers whose
//! prompt counts hold the image's tokens; hostile images (a decompression bomb, 20,000 x 20,000,
//! truncated, SVG, a wrong declared type) are refused as bad requests naming the problem
//! (`scripts/image_sdk_check.py`), and five more rounds of them leave the gateway process's
//! resident memory within 50 MB of where it was. The server fetches image URLs of `127.0.0.1`
//! (`--image-url-hosts`), so the same image also goes by URL from a local HTTP origin and counts
//! the same tokens. Skipped, loudly, where the SDKs are not installed (the script says so).
//!
//! Needs the workspace binaries next to `ninfer` (`cargo build --workspace --bins`).

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::serve::Server;
use common::{convert_fixture_f32, fixture};

#[test]
fn official_sdks_send_an_image_to_the_served_vision_fixture() {
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = scratch.path().join("vision.ninfer");
    convert_fixture_f32("qwen3_5_moe", &model);
    let server = Server::start(
        scratch.path(),
        &model,
        &[
            "--served-model-name",
            "vision",
            "--image-url-hosts",
            "127.0.0.1",
        ],
    );
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/image_sdk_check.py");
    // 53×37 at the fixture's processor settings: a 4×6 patch grid, 6 image tokens.
    let image = fixture("vision_input").join("png_rgb_downscale.png");
    let image_url = serve_file(&image);
    let check = |extra: &[&str]| {
        let output = Command::new("python3")
            .arg(&script)
            .args(["--base-url", &format!("http://{}", server.address)])
            .args(["--model", "vision", "--image-tokens", "6"])
            .args(["--image-url", &image_url, "--image"])
            .arg(&image)
            .args(extra)
            .env("PYTHONUNBUFFERED", "1")
            .output()
            .unwrap_or_else(|e| panic!("python3: {e}"));
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr);
        eprintln!("{stdout}");
        let skipped = output.status.code() == Some(77);
        assert!(
            skipped || output.status.success(),
            "image_sdk_check.py {extra:?} failed:\n{stdout}\n{stderr}"
        );
        (!skipped).then_some(stdout)
    };
    let Some(stdout) = check(&[]) else {
        return; // the SDKs are not installed: the script said so
    };
    assert!(stdout.contains("7 passed, 0 failed"), "{stdout}");

    // Every hostile image has been through the gateway once; five more rounds must not grow it.
    let gateway = descendant_named(server.child.id(), "ninfer-gateway")
        .unwrap_or_else(|| panic!("no ninfer-gateway process under ninfer run"));
    let before = resident_bytes(gateway);
    let stdout = check(&["--hostile-rounds", "5"]).unwrap_or_default();
    assert!(stdout.contains("10 passed, 0 failed"), "{stdout}");
    let grown = resident_bytes(gateway).saturating_sub(before);
    println!(
        "gateway resident memory grew {:.1} MB over 5 rounds of hostile images",
        grown as f64 / 1e6
    );
    assert!(
        grown < 50_000_000,
        "gateway resident memory grew {grown} bytes"
    );
}

/// The first process below `root` (children first, then theirs) whose command name is `name`.
fn descendant_named(root: u32, name: &str) -> Option<u32> {
    let parent_of = |pid: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // `pid (comm) state ppid …`: the name may hold spaces, so read after its last `)`.
        let (_, rest) = stat.rsplit_once(')')?;
        rest.split_whitespace().nth(1)?.parse().ok()
    };
    let processes: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let mut level = vec![root];
    while !level.is_empty() {
        let children: Vec<u32> = processes
            .iter()
            .copied()
            .filter(|&pid| parent_of(pid).is_some_and(|parent| level.contains(&parent)))
            .collect();
        if let Some(&found) = children.iter().find(|&&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim() == name)
        }) {
            return Some(found);
        }
        level = children;
    }
    None
}

/// The resident memory of process `pid`, in bytes.
fn resident_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("process {pid}: {e}"))
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
        .unwrap_or_else(|| panic!("process {pid}: no VmRSS"))
}

/// Serves `file` as `image/png` to every GET on a local port; its URL.
fn serve_file(file: &Path) -> String {
    let bytes = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let port = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                bytes.len()
            );
            let _ = stream.write_all(&bytes);
        }
    });
    format!("http://127.0.0.1:{port}/cat.png")
}
