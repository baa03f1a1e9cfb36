//! The official `openai` and `anthropic` Python SDKs send an image to `ninfer run --serve` of
//! the multimodal `qwen3_5_moe` fixture (its vision tower on the CPU) and get answers whose
//! prompt counts hold the image's tokens; hostile images are refused as bad requests
//! (`scripts/image_sdk_check.py`). The server fetches image URLs of `127.0.0.1`
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
    let output = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("http://{}", server.address)])
        .args(["--model", "vision", "--image-tokens", "6"])
        .args(["--image-url", &image_url, "--image"])
        .arg(image)
        .env("PYTHONUNBUFFERED", "1")
        .output()
        .unwrap_or_else(|e| panic!("python3: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{stdout}");
    if output.status.code() == Some(77) {
        return; // the SDKs are not installed: the script said so
    }
    assert!(
        output.status.success(),
        "image_sdk_check.py failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("7 passed, 0 failed"), "{stdout}");
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
