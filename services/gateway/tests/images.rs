//! Images through the gateway's three chat APIs to a model that sees them (the scripted engine
//! serving the multimodal fixture's tokenizer, template and image processor settings): an
//! OpenAI `image_url` data URL, an Anthropic base64 `image` block and a Responses
//! `input_image` each reach the engine as the encoded file, with the template's placeholder
//! repeated to the image's token count (the processor's grid) and counted in `usage`; URLs to
//! fetch and hostile files are refused with 400 in each API's error shape naming the problem,
//! and the gateway's memory does not grow with them. An image inside an Anthropic `tool_result`
//! (a screenshot a client's tool took) reaches the engine as an image too, inside the tool
//! response, counted in `usage` and `count_tokens`. A video's frame pairs are sized and stamped
//! with the model's video processor settings where the engine reports them. A text-only model
//! keeps its stand-in.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use base64::Engine as _;
use common::*;
use ninfer_vision_input::crafted::png_header_only;
use serde_json::json;

const IMAGE_PAD: u32 = 491;

async fn start(vision: bool) -> (RunningEngine, RunningGateway) {
    let script = EngineScript::default();
    script.vision.store(vision, Ordering::SeqCst);
    let engine = RunningEngine::start(Arc::new(script), None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    gateway.wait_for_health(200).await;
    (engine, gateway)
}

fn fixture_image(name: &str) -> Vec<u8> {
    std::fs::read(fixture_dir().join("../vision_input").join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The three APIs' requests carrying one image (`data_url` for OpenAI and Responses, the
/// base64 `data` and `media_type` for Anthropic), as (path, body).
fn image_requests(
    data_url: &str,
    data: &str,
    media_type: &str,
) -> Vec<(&'static str, serde_json::Value)> {
    vec![
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": data_url}}]}]}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}},
                {"type": "text", "text": "What is this?"}]}]}),
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": data_url}]}]}),
        ),
    ]
}

/// The error message of a 400 in the API's own shape.
fn error_message(path: &str, response: &HttpResponse) -> String {
    assert_eq!(response.status, 400, "{path}: {}", response.text());
    let body = response.json();
    if path == "/v1/messages" {
        assert_eq!(body["type"], "error", "{path}: {body}");
        assert_eq!(
            body["error"]["type"], "invalid_request_error",
            "{path}: {body}"
        );
    } else {
        assert_eq!(
            body["error"]["type"], "invalid_request_error",
            "{path}: {body}"
        );
    }
    body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn prompt_tokens(path: &str, body: &serde_json::Value) -> u64 {
    let usage = &body["usage"];
    let count = match path {
        "/v1/messages" => &usage["input_tokens"],
        "/v1/responses" => &usage["input_tokens"],
        _ => &usage["prompt_tokens"],
    };
    count
        .as_u64()
        .unwrap_or_else(|| panic!("{path}: no prompt count in {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_sends_the_image_with_its_placeholder_run() {
    let (engine, gateway) = start(true).await;
    // 53×37 at the fixture's settings: a 4×6 patch grid, 6 image tokens (as the reference).
    let png = fixture_image("png_rgb_downscale.png");
    let data = base64(&png);
    let data_url = format!("data:image/png;base64,{data}");
    for (path, body) in image_requests(&data_url, &data, "image/png") {
        let response = post_json(gateway.address, path, &body).await;
        assert_eq!(response.status, 200, "{path}: {}", response.text());
        let request = engine.script.last_request();
        assert_eq!(request.images.len(), 1, "{path}");
        assert_eq!(request.images[0].encoded, png, "{path}");
        assert_eq!(request.images[0].media_type, "image/png", "{path}");
        let ids = &request.prompt_token_ids;
        let first = ids.iter().position(|&id| id == IMAGE_PAD).expect("a run");
        let run = ids[first..]
            .iter()
            .take_while(|&&id| id == IMAGE_PAD)
            .count();
        assert_eq!(run, 6, "{path}: the image's tokens");
        assert_eq!(
            ids.iter().filter(|&&id| id == IMAGE_PAD).count(),
            6,
            "{path}"
        );
        assert_eq!(
            prompt_tokens(path, &response.json()),
            ids.len() as u64,
            "{path}"
        );
        if path == "/v1/messages" {
            let counted = post_json(gateway.address, "/v1/messages/count_tokens", &body).await;
            assert_eq!(counted.status, 200, "{}", counted.text());
            assert_eq!(counted.json()["input_tokens"], ids.len(), "count_tokens");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_images_get_400_naming_the_problem_without_memory_growth() {
    let (engine, gateway) = start(true).await;
    let png = fixture_image("png_rgb_downscale.png");
    // A large truncated file: 120 KB of a PNG's start (within the inline-data limit of the
    // test model's context).
    let mut large_truncated = png[..png.len() / 2].to_vec();
    large_truncated.resize(120_000, 0x41);
    let svg = br#"<svg xmlns="http://www.w3.org/2000/svg" width="20000" height="20000"/>"#.to_vec();
    let cases: Vec<(&str, Vec<u8>, &str, &str)> = vec![
        // A decompression bomb: 12,000 × 12,000 claimed by a tiny file.
        (
            "bomb",
            png_header_only(12_000, 12_000),
            "image/png",
            "pixels",
        ),
        (
            "20k x 20k",
            png_header_only(20_000, 20_000),
            "image/png",
            "20000x20000",
        ),
        (
            "truncated",
            png[..png.len() - 20].to_vec(),
            "image/png",
            "truncated",
        ),
        ("large truncated", large_truncated, "image/png", "truncated"),
        ("SVG", svg, "image/svg+xml", "image/svg+xml"),
        (
            "wrong declared type",
            png.clone(),
            "image/jpeg",
            "declared as `image/jpeg`",
        ),
    ];
    let generations_before = engine.script.generations.load(Ordering::SeqCst);
    let mut baseline = 0;
    for round in 0..6 {
        if round == 1 {
            baseline = resident_bytes();
        }
        for (what, bytes, media_type, named) in &cases {
            let data = base64(bytes);
            let data_url = format!("data:{media_type};base64,{data}");
            for (path, body) in image_requests(&data_url, &data, media_type) {
                let response = post_json(gateway.address, path, &body).await;
                let message = error_message(path, &response);
                assert!(message.contains(named), "{what} via {path}: {message}");
            }
        }
    }
    let grown = resident_bytes().saturating_sub(baseline);
    println!(
        "gateway resident memory grew {:.1} MB over 5 rounds of hostile images",
        grown as f64 / 1e6
    );
    assert!(grown < 50_000_000, "resident memory grew {grown} bytes");
    assert_eq!(
        engine.script.generations.load(Ordering::SeqCst),
        generations_before,
        "no hostile image reached the engine"
    );

    // URLs are not fetched: a 400 that says so, in each API.
    let url = "https://example.com/cat.png";
    for (path, body) in image_requests(url, "", "image/png") {
        let body = if path == "/v1/messages" {
            json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": url}}]}]})
        } else {
            body
        };
        let response = post_json(gateway.address, path, &body).await;
        let message = error_message(path, &response);
        assert!(message.contains("not fetched"), "{path}: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_only_model_gets_the_stand_in() {
    let (engine, gateway) = start(false).await;
    let data_url = format!(
        "data:image/png;base64,{}",
        base64(&fixture_image("png_rgb_downscale.png"))
    );
    let (path, body) = image_requests(&data_url, "", "image/png").remove(0);
    let response = post_json(gateway.address, path, &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let request = engine.script.last_request();
    assert!(request.images.is_empty());
    let prompt = tokenizers::Tokenizer::from_file(fixture_dir().join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("{e}"))
        .decode(&request.prompt_token_ids, false)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        prompt.contains("[image omitted: this model reads text only]"),
        "{prompt}"
    );
}

/// A Claude Code turn: the assistant called a tool that read a screenshot, the user message
/// carries its `tool_result` (text, the image, more text) and a question.
fn tool_result_with_a_screenshot(data: &str) -> serde_json::Value {
    json!({"model": MODEL, "max_tokens": 4,
        "tools": [{"name": "Read", "description": "Reads a file",
                   "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": "Look at shot.png"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                "input": {"file_path": "shot.png"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "shot.png:"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                    {"type": "text", "text": "(53x37)"}]},
                {"type": "text", "text": "What is in it?"}]}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_in_a_tool_result_reaches_the_model_as_an_image() {
    let (engine, gateway) = start(true).await;
    let png = fixture_image("png_rgb_downscale.png");
    let body = tool_result_with_a_screenshot(&base64(&png));
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let request = engine.script.last_request();
    assert_eq!(request.images.len(), 1);
    assert_eq!(request.images[0].encoded, png);
    assert_eq!(request.images[0].media_type, "image/png");
    let ids = &request.prompt_token_ids;
    // The image's run of 6 tokens (its 4×6 patch grid), inside the tool response, between the
    // result's texts.
    assert_eq!(ids.iter().filter(|&&id| id == IMAGE_PAD).count(), 6);
    let tokenizer = tokenizers::Tokenizer::from_file(fixture_dir().join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("{e}"));
    let prompt = tokenizer
        .decode(ids, false)
        .unwrap_or_else(|e| panic!("{e}"));
    let run = format!(
        "<|vision_start|>{}<|vision_end|>",
        "<|image_pad|>".repeat(6)
    );
    assert!(
        prompt.contains(&format!(
            "<tool_response>\nshot.png:\n{run}\n(53x37)\n</tool_response>"
        )),
        "{prompt}"
    );
    assert!(!prompt.contains("omitted"), "{prompt}");
    let input_tokens = response.json()["usage"]["input_tokens"].as_u64();
    assert_eq!(input_tokens, Some(ids.len() as u64));
    let counted = post_json(gateway.address, "/v1/messages/count_tokens", &body).await;
    assert_eq!(counted.status, 200, "{}", counted.text());
    assert_eq!(counted.json()["input_tokens"], ids.len(), "count_tokens");

    // A file that is not an image is refused naming where it is, as a top-level block is.
    let refused = post_json(
        gateway.address,
        "/v1/messages",
        &tool_result_with_a_screenshot(&base64(&png[..png.len() - 20])),
    )
    .await;
    let message = error_message("/v1/messages", &refused);
    assert!(
        message.starts_with("messages.2.content.0.content.1"),
        "{message}"
    );
    assert!(message.contains("truncated"), "{message}");
}

/// The pieces of a prompt's video runs: each pair's timestamp and its pad count.
fn video_runs(prompt: &str) -> Vec<(String, usize)> {
    prompt
        .split("<|vision_start|>")
        .skip(1)
        .filter_map(|piece| {
            let pads = piece.matches("<|video_pad|>").count();
            (pads > 0).then_some(pads)
        })
        .zip(
            prompt
                .match_indices(" seconds>")
                .map(|(end, _)| prompt[prompt[..end].rfind('<').unwrap_or(0)..end + 9].to_string()),
        )
        .map(|(pads, stamp)| (stamp, pads))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_videos_runs_follow_the_models_video_processor_settings() {
    let frames: Vec<String> = (0..4)
        .map(|index| {
            format!(
                "data:image/png;base64,{}",
                base64(&fixture_image(&format!("video_0_frame_{index}.png")))
            )
        })
        .collect();
    let body = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What happens?"},
        {"type": "video", "video": frames}]}]});
    let tokenizer =
        tokenizers::Tokenizer::from_file(fixture_dir().join("../qwen3_5_moe/tokenizer.json"))
            .unwrap_or_else(|e| panic!("{e}"));
    let mut runs = Vec::new();
    for video_settings in [
        // None reported: the image processor's settings (4096 pixels, patch 8), 2 frames a second.
        "",
        // The clip's 4 frames within 1024 pixels: 16×16 frames, one token a pair; 4 a second.
        r#"{"size": {"shortest_edge": 256, "longest_edge": 1024}, "patch_size": 8,
            "temporal_patch_size": 2, "merge_size": 2, "fps": 4.0}"#,
    ] {
        let script = EngineScript::default();
        script.vision.store(true, Ordering::SeqCst);
        *script
            .video_preprocessor_config_json
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = video_settings.to_string();
        let engine = RunningEngine::start(Arc::new(script), None).await;
        let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
        gateway.wait_for_health(200).await;
        let response = post_json(gateway.address, "/v1/chat/completions", &body).await;
        assert_eq!(response.status, 200, "{}", response.text());
        let request = engine.script.last_request();
        assert_eq!(request.images.len(), 1);
        assert_eq!(request.images[0].frames.len(), 4);
        let prompt = tokenizer
            .decode(&request.prompt_token_ids, false)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            response.json()["usage"]["prompt_tokens"].as_u64(),
            Some(request.prompt_token_ids.len() as u64)
        );
        runs.push(video_runs(&prompt));
    }
    // Frame k at k / fps seconds, each pair stamped with its frames' mean, one decimal.
    assert_eq!(
        runs[0],
        [
            ("<0.2 seconds>".to_string(), 4),
            ("<1.2 seconds>".to_string(), 4)
        ]
    );
    assert_eq!(
        runs[1],
        [
            ("<0.1 seconds>".to_string(), 1),
            ("<0.6 seconds>".to_string(), 1)
        ]
    );
}
