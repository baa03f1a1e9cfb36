//! Image URLs through the gateway's three chat APIs (OpenAI `image_url`, Responses
//! `input_image`, Anthropic `url` image sources) to a model that sees images (the scripted
//! engine serving the multimodal fixture's tokenizer, template and image processor settings),
//! fetched from a local HTTP server: refused by default and for hosts not allowed; fetched and
//! sent to the engine as the file with its placeholder run when the host is allowed; a slow
//! origin times out (one request's fetches sharing the timeout), an oversized body is cut off at
//! the cap while it streams (and refused on its `Content-Length` before), a redirect is not followed, an origin's error status is named,
//! a name resolving to a loopback address is refused, and a hostile file fetched by URL gets
//! the same 400 as sent inline.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ninfer_gateway::image_urls::ImageUrlPolicy;
use ninfer_vision_input::crafted::png_header_only;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const IMAGE_PAD: u32 = 491;
/// The byte cap the tests' gateway fetches within.
const CAP: usize = 256 * 1024;
/// What the origin streams for an oversized image without a `Content-Length`.
const HUGE: usize = 64 << 20;

/// A local origin for the images: each path a behaviour.
struct Origin {
    port: u16,
    /// Bytes written of the oversized body before the gateway stopped reading.
    huge_written: Arc<AtomicUsize>,
}

impl Origin {
    async fn start() -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind origin");
        let port = listener.local_addr().expect("address").port();
        let huge_written = Arc::new(AtomicUsize::new(0));
        let written = huge_written.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, port, written.clone()));
            }
        });
        Origin { port, huge_written }
    }

    fn url(&self, host: &str, path: &str) -> String {
        format!("http://{host}:{}{path}", self.port)
    }
}

fn fixture_png() -> Vec<u8> {
    std::fs::read(fixture_dir().join("../vision_input/png_rgb_downscale.png"))
        .unwrap_or_else(|e| panic!("fixture: {e}"))
}

/// Answers one request on `stream` as its path says.
async fn serve(mut stream: TcpStream, port: u16, huge_written: Arc<AtomicUsize>) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
    let answer = |status: &str, media: &str, body: &[u8]| {
        let mut response = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {media}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        response.extend_from_slice(body);
        response
    };
    let response = match path.as_str() {
        "/cat.png" => answer("200 OK", "image/png", &fixture_png()),
        // An origin that says nothing of the type: the header probe tells it.
        "/untyped" => answer("200 OK", "application/octet-stream", &fixture_png()),
        "/bomb.png" => answer("200 OK", "image/png", &png_header_only(12_000, 12_000)),
        "/page.png" => answer("200 OK", "text/html", b"<html>not an image</html>"),
        "/missing.png" => answer("404 Not Found", "text/plain", b"no such image"),
        "/redirect.png" => format!(
            "HTTP/1.1 302 Found\r\nLocation: http://localhost:{port}/cat.png\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .into_bytes(),
        "/slow.png" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            answer("200 OK", "image/png", &fixture_png())
        }
        "/large-declared.png" => {
            // Declares more than the cap: refused before the body is read.
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {HUGE}\r\nConnection: close\r\n\r\n"
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(&fixture_png()).await;
            tokio::time::sleep(Duration::from_secs(5)).await;
            return;
        }
        "/huge.png" => {
            // No length: the body runs until the connection closes, far past the cap.
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nConnection: close\r\n\r\n")
                .await;
            let mut chunk = fixture_png();
            chunk.resize(64 * 1024, 0);
            while huge_written.load(Ordering::SeqCst) < HUGE {
                if stream.write_all(&chunk).await.is_err() {
                    return;
                }
                huge_written.fetch_add(chunk.len(), Ordering::SeqCst);
            }
            return;
        }
        _ => answer("404 Not Found", "text/plain", b""),
    };
    let _ = stream.write_all(&response).await;
    let _ = stream.shutdown().await;
}

async fn gateway(engine: &RunningEngine, hosts: &[&str]) -> RunningGateway {
    let hosts: Vec<String> = hosts.iter().map(|host| host.to_string()).collect();
    let image_urls = ImageUrlPolicy::from_hosts(&hosts, Duration::from_secs(2), CAP)
        .unwrap_or_else(|e| panic!("hosts: {e}"));
    let gateway = RunningGateway::start(
        &[engine.address],
        GatewayOptions {
            image_urls,
            ..Default::default()
        },
    )
    .await;
    gateway.wait_for_health(200).await;
    gateway
}

async fn vision_engine() -> RunningEngine {
    let script = EngineScript::default();
    script.vision.store(true, Ordering::SeqCst);
    RunningEngine::start(Arc::new(script), None).await
}

/// The three APIs' requests carrying the image at `url`, as (path, body).
fn url_requests(url: &str) -> Vec<(&'static str, serde_json::Value)> {
    vec![
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": url}}]}]}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": url}},
                {"type": "text", "text": "What is this?"}]}]}),
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": url}]}]}),
        ),
    ]
}

/// The message of a 400 in the API's own error shape.
fn refusal(path: &str, response: &HttpResponse) -> String {
    assert_eq!(response.status, 400, "{path}: {}", response.text());
    let body = response.json();
    if path == "/v1/messages" {
        assert_eq!(body["type"], "error", "{path}: {body}");
    }
    assert_eq!(
        body["error"]["type"], "invalid_request_error",
        "{path}: {body}"
    );
    body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Every API refuses the image at `url` with a 400 whose message holds `named`.
async fn refused_everywhere(gateway: &RunningGateway, url: &str, named: &str) {
    for (path, body) in url_requests(url) {
        let response = post_json(gateway.address, path, &body).await;
        let message = refusal(path, &response);
        assert!(message.contains(named), "{url} via {path}: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_hosts_images_are_fetched_and_others_refused() {
    let origin = Origin::start().await;
    let engine = vision_engine().await;
    let png = fixture_png();

    // By default nothing is fetched.
    let default = gateway(&engine, &[]).await;
    refused_everywhere(
        &default,
        &origin.url("127.0.0.1", "/cat.png"),
        "not fetched",
    )
    .await;

    let allowing = gateway(&engine, &["127.0.0.1", "*.images.example.com"]).await;
    for url in [
        origin.url("127.0.0.1", "/cat.png"),
        origin.url("127.0.0.1", "/untyped"),
    ] {
        for (path, body) in url_requests(&url) {
            let response = post_json(allowing.address, path, &body).await;
            assert_eq!(
                response.status,
                200,
                "{url} via {path}: {}",
                response.text()
            );
            let request = engine.script.last_request();
            assert_eq!(request.images.len(), 1, "{path}");
            assert_eq!(request.images[0].encoded, png, "{url} via {path}");
            let declared = if url.ends_with("cat.png") {
                "image/png"
            } else {
                ""
            };
            assert_eq!(request.images[0].media_type, declared, "{url} via {path}");
            // 53×37 at the fixture's settings: 6 image tokens, as for the inline image.
            let pads = request
                .prompt_token_ids
                .iter()
                .filter(|&&id| id == IMAGE_PAD)
                .count();
            assert_eq!(pads, 6, "{url} via {path}");
        }
    }
    let anthropic = &url_requests(&origin.url("127.0.0.1", "/cat.png"))[1].1;
    let answered = post_json(allowing.address, "/v1/messages", anthropic).await;
    assert_eq!(answered.status, 200, "{}", answered.text());
    let counted = post_json(allowing.address, "/v1/messages/count_tokens", anthropic).await;
    assert_eq!(counted.status, 200, "{}", counted.text());
    assert_eq!(
        counted.json()["input_tokens"],
        engine.script.last_request().prompt_token_ids.len(),
        "count_tokens counts the fetched image"
    );

    // Another host, and a name for an allowed address: refused before any connection.
    refused_everywhere(
        &allowing,
        &origin.url("127.0.0.2", "/cat.png"),
        "not one this server fetches images from",
    )
    .await;
    refused_everywhere(
        &allowing,
        &origin.url("localhost", "/cat.png"),
        "not one this server fetches images from",
    )
    .await;
    // A name that is allowed but resolves to a loopback address: refused.
    let by_name = gateway(&engine, &["localhost"]).await;
    refused_everywhere(
        &by_name,
        &origin.url("localhost", "/cat.png"),
        "private, loopback or link-local",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_fetches_and_hostile_files_get_400_naming_the_problem() {
    let origin = Origin::start().await;
    let engine = vision_engine().await;
    let gateway = gateway(&engine, &["127.0.0.1"]).await;
    let generations_before = engine.script.generations.load(Ordering::SeqCst);
    let url = |path: &str| origin.url("127.0.0.1", path);

    refused_everywhere(&gateway, &url("/missing.png"), "HTTP 404").await;
    refused_everywhere(
        &gateway,
        &url("/redirect.png"),
        "redirects are not followed",
    )
    .await;
    refused_everywhere(&gateway, &url("/large-declared.png"), "too large").await;
    // The same refusals as an inline image's.
    refused_everywhere(&gateway, &url("/bomb.png"), "pixels").await;
    refused_everywhere(&gateway, &url("/page.png"), "not a PNG, JPEG").await;

    // A slow origin: each API's answer comes at the 2 s timeout, not the origin's 30 s.
    let started = Instant::now();
    refused_everywhere(&gateway, &url("/slow.png"), "timed out").await;
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(12),
        "three timeouts of 2 s took {waited:?}"
    );
    // One request's fetches share the timeout: four slow images take it once (2 s), not once
    // each (8 s); the bound leaves a loaded machine 4 s of slack.
    let slow = url("/slow.png");
    let started = Instant::now();
    let slow_part = json!({"type": "image_url", "image_url": {"url": slow}});
    let four_slow = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user",
        "content": vec![slow_part; 4]}]});
    let response = post_json(gateway.address, "/v1/chat/completions", &four_slow).await;
    let message = refusal("/v1/chat/completions", &response);
    assert!(message.contains("timed out"), "{message}");
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(6),
        "four slow images in one request took {waited:?}, not the one 2 s timeout"
    );

    // An endless body: cut off at the cap as it streams, the origin stopped long before.
    let response = post_json(
        gateway.address,
        "/v1/chat/completions",
        &url_requests(&url("/huge.png"))[0].1,
    )
    .await;
    let message = refusal("/v1/chat/completions", &response);
    assert!(message.contains("too large"), "{message}");
    assert!(message.contains(&CAP.to_string()), "{message}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let written = origin.huge_written.load(Ordering::SeqCst);
    println!("the origin wrote {written} bytes of the endless body before it was cut off");
    assert!(
        written < HUGE / 4,
        "the origin wrote {written} bytes: the body was not cut off at the cap"
    );

    assert_eq!(
        engine.script.generations.load(Ordering::SeqCst),
        generations_before,
        "no refused image reached the engine"
    );
}
