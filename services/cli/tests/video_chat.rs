//! A video given as frames through `/v1/chat/completions` of `ninfer run --serve` of the
//! multimodal `qwen3_5_moe` fixture (its vision tower on the CPU): the conversation of
//! `video_prompt_reference.json` (two videos of frame data URLs) is answered, its prompt
//! counting the tokens `transformers`' processor gives it (timestamps and one run per frame
//! pair); too many frames, a bad frame and frames of two sizes are refused as bad requests.
//!
//! Needs the workspace binaries next to `ninfer` (`cargo build --workspace --bins`).

mod common;

use common::serve::{http, Server};
use common::{convert_fixture_f32, fixture};
use serde_json::{json, Value};

/// A PNG data URL (standard base64, padded).
fn data_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut text = String::from("data:image/png;base64,");
    for chunk in bytes.chunks(3) {
        let word = chunk
            .iter()
            .enumerate()
            .fold(0u32, |word, (i, &b)| word | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            text.push(if i <= chunk.len() {
                char::from(ALPHABET[(word >> (18 - 6 * i) & 63) as usize])
            } else {
                '='
            });
        }
    }
    text
}

fn chat(server: &Server, content: Value) -> (u16, Value) {
    let body = json!({
        "model": "vision",
        "max_tokens": 3,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    });
    let (status, text) = http(
        &server.address,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    );
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, value)
}

#[test]
fn a_chat_with_videos_as_frames_is_answered_and_counted() {
    let scratch = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = scratch.path().join("vision.ninfer");
    convert_fixture_f32("qwen3_5_moe", &model);
    let server = Server::start(scratch.path(), &model, &["--served-model-name", "vision"]);
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3_5_moe").join("video_prompt_reference.json"))
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let frames: Vec<Vec<String>> = reference["frame_files"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|files| {
            files
                .as_array()
                .into_iter()
                .flatten()
                .map(|name| {
                    let path = fixture("vision_input").join(name.as_str().unwrap_or_default());
                    data_url(&std::fs::read(path).unwrap_or_else(|e| panic!("{e}")))
                })
                .collect()
        })
        .collect();
    assert_eq!(frames.len(), 2);

    let (status, answer) = chat(
        &server,
        json!([
            {"type": "text", "text": "Watch this."},
            {"type": "video", "video": frames[0]},
            {"type": "text", "text": "and then"},
            {"type": "video", "video": frames[1], "fps": 2.0},
            {"type": "text", "text": "What happens?"},
        ]),
    );
    assert_eq!(status, 200, "{answer}");
    let expected = reference["token_ids"].as_array().map_or(0, Vec::len) as u64;
    assert_eq!(
        answer["usage"]["prompt_tokens"].as_u64(),
        Some(expected),
        "{answer}"
    );
    println!("usage {}", answer["usage"]);

    // Too many frames, refused from the body's scan before any is read (small frames: 65 of
    // the real ones would be refused for their bytes first).
    let many = vec!["data:image/png;base64,QUJD"; 65];
    let (status, refused) = chat(&server, json!([{"type": "video", "video": many}]));
    assert_eq!(status, 400, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("more than 64 frames"), "{message}");

    // A frame that is not an image, named by its place.
    let mut bad = frames[0].clone();
    bad[1] = "data:image/png;base64,iVBORw0KGgo=".to_string();
    let (status, refused) = chat(&server, json!([{"type": "video", "video": bad}]));
    assert_eq!(status, 400, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("content[0].video[1]"), "{message}");

    // Frames of two sizes.
    let mixed = vec![frames[0][0].clone(), frames[1][0].clone()];
    let (status, refused) = chat(&server, json!([{"type": "video", "video": mixed}]));
    assert_eq!(status, 400, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("one size"), "{message}");
}
