//! `/image PATH` in the terminal chat of `ninfer run` on the multimodal `qwen3_5_moe` fixture
//! (its vision tower on the CPU): the ready line offers it, a missing path or file is an error
//! that leaves the chat going, an attached file that is not an image is refused by the server
//! naming the problem, and an attached image reaches the model (the same question answers
//! otherwise than without it, and the same again with the same image).
//!
//! Needs the workspace binaries next to `ninfer` (`cargo build --workspace --bins`).

mod common;

use std::io::Write;
use std::process::Stdio;

use common::serve::ninfer;
use common::{convert_fixture_f32, fixture};

/// What the chat printed on stdout after each `> ` prompt, one entry per line typed.
fn turns(stdout: &str) -> Vec<String> {
    stdout
        .split("> ")
        .skip(1)
        .map(|turn| turn.trim_end().to_string())
        .collect()
}

#[test]
fn the_chats_image_command_attaches_an_image_to_the_next_message() {
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = scratch.path().join("vision.ninfer");
    convert_fixture_f32("qwen3_5_moe", &model);
    let image = fixture("vision_input").join("png_rgb_downscale.png");
    let image_bytes = std::fs::read(&image).unwrap_or_else(|e| panic!("{e}"));
    let not_an_image = scratch.path().join("notes.txt");
    let words = "plain words, not pixels\n";
    std::fs::write(&not_an_image, words).unwrap_or_else(|e| panic!("{e}"));
    let missing = scratch.path().join("missing.png");

    let question = "What is this?";
    let script = [
        "/image".to_string(),
        format!("/image {}", missing.display()),
        format!("/image {}", not_an_image.display()),
        question.to_string(),
        // The refused image waits for the next try; /reset forgets it.
        "/reset".to_string(),
        question.to_string(),
        "/reset".to_string(),
        format!("/image {}", image.display()),
        question.to_string(),
        "/reset".to_string(),
        format!("/image {}", image.display()),
        question.to_string(),
        "/exit".to_string(),
    ]
    .join("\n")
        + "\n";

    let mut child = ninfer(scratch.path())
        .arg("run")
        .arg(&model)
        .args(["--device", "cpu", "--no-mtp", "--moe-threads", "1"])
        .args(["--temperature", "0", "--max-tokens", "8"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("ninfer run: {e}"));
    child
        .stdin
        .take()
        .unwrap_or_else(|| panic!("stdin is piped"))
        .write_all(script.as_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    let output = child.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "ninfer run failed ({}):\n{stdout}\n{stderr}",
        output.status
    );

    let ready = stdout.lines().next().unwrap_or_default();
    assert!(
        ready.contains("/image PATH attaches an image to the next message"),
        "{ready}"
    );
    assert!(stderr.contains("error: usage: /image PATH"), "{stderr}");
    assert!(
        stderr.contains(&format!("error: reading {}", missing.display())),
        "{stderr}"
    );
    assert!(
        stderr.contains("image bytes are not a PNG, JPEG, WebP or GIF file"),
        "the server's refusal of the text file:\n{stderr}"
    );

    let turns = turns(&stdout);
    let attached = |bytes: usize| format!("(image of {bytes} bytes attached to the next message)");
    let cleared = "(conversation cleared)";
    // /image, /image missing: nothing printed on stdout.
    assert_eq!(turns[0], "", "{stdout}");
    assert_eq!(turns[1], "", "{stdout}");
    assert_eq!(turns[2], attached(words.len()), "{stdout}");
    assert_eq!(
        turns[3], "",
        "the refused turn printed no answer:\n{stdout}"
    );
    assert_eq!(turns[4], cleared, "{stdout}");
    let without_image = &turns[5];
    assert_eq!(turns[6], cleared, "{stdout}");
    assert_eq!(turns[7], attached(image_bytes.len()), "{stdout}");
    let with_image = &turns[8];
    assert_eq!(turns[9], cleared, "{stdout}");
    assert_eq!(turns[10], attached(image_bytes.len()), "{stdout}");
    let with_image_again = &turns[11];
    // The prompt /exit was typed at.
    assert_eq!(turns[12], "", "{stdout}");
    assert_eq!(turns.len(), 13, "{stdout}");

    assert!(
        !without_image.is_empty() && !with_image.is_empty(),
        "{stdout}"
    );
    assert_ne!(
        with_image, without_image,
        "the image changed nothing the model saw:\n{stdout}"
    );
    assert_eq!(with_image_again, with_image, "{stdout}");
}
