//! The official `openai` and `anthropic` Python SDKs send an image to `ninfer run --serve` of
//! the multimodal `qwen3_5_moe` fixture (its vision tower on the CPU) and get answers whose
//! prompt counts hold the image's tokens; hostile images are refused as bad requests
//! (`scripts/image_sdk_check.py`). Skipped, loudly, where the SDKs are not installed (the
//! script says so).
//!
//! Needs the workspace binaries next to `ninfer` (`cargo build --workspace --bins`).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::serve::Server;
use common::{convert_fixture_f32, fixture};

#[test]
fn official_sdks_send_an_image_to_the_served_vision_fixture() {
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = scratch.path().join("vision.ninfer");
    convert_fixture_f32("qwen3_5_moe", &model);
    let server = Server::start(scratch.path(), &model, &["--served-model-name", "vision"]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/image_sdk_check.py");
    // 53×37 at the fixture's processor settings: a 4×6 patch grid, 6 image tokens.
    let image = fixture("vision_input").join("png_rgb_downscale.png");
    let output = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("http://{}", server.address)])
        .args(["--model", "vision", "--image-tokens", "6", "--image"])
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
    assert!(stdout.contains("6 passed, 0 failed"), "{stdout}");
}
