//! API keys in each dialect, and what a client meets when something goes wrong: an overloaded
//! engine, a prompt too long, its own disconnect (the generation is cancelled), an engine that
//! goes away and starts again, one of two engines dying.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::common::*;
use crate::helpers::start;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_in_each_dialect() {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(
        &[engine.address],
        GatewayOptions {
            api_key: Some("sekret".into()),
            ..Default::default()
        },
    )
    .await;
    gateway.wait_for_health(200).await; // /health needs no key
                                        // ...but without it, it tells only ok / not ready: no engine address, model or error.
    let anonymous_health = get(gateway.address, "/health").await;
    assert_eq!(anonymous_health.json(), json!({"status": "ok"}));
    let keyed_health = request(
        gateway.address,
        "GET",
        "/health",
        &[("authorization", "Bearer sekret")],
        b"",
    )
    .await;
    assert_eq!(keyed_health.status, 200);
    assert_eq!(
        keyed_health.json()["engines"][0]["address"],
        engine.address.to_string()
    );
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            .to_string();
    let response = request(
        gateway.address,
        "POST",
        "/v1/chat/completions",
        &[],
        chat.as_bytes(),
    )
    .await;
    assert_eq!(response.status, 401);
    assert_eq!(response.json()["error"]["type"], "authentication_error");
    let response = request(
        gateway.address,
        "POST",
        "/v1/messages",
        &[("x-api-key", "wrong")],
        b"{}",
    )
    .await;
    assert_eq!(response.status, 401);
    assert_eq!(response.json()["type"], "error");
    assert_eq!(response.json()["error"]["type"], "authentication_error");
    let response = request(
        gateway.address,
        "POST",
        "/v1/chat/completions",
        &[("authorization", "Bearer sekret")],
        chat.as_bytes(),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let messages =
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
            .to_string();
    let response = request(
        gateway.address,
        "POST",
        "/v1/messages",
        &[("x-api-key", "sekret")],
        messages.as_bytes(),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overloaded_and_too_long_prompts_get_the_right_status() {
    let (engine, gateway) = start().await;
    engine.script.overloaded.store(true, Ordering::SeqCst);
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
    assert_eq!(response.status, 429);
    assert_eq!(response.json()["error"]["type"], "rate_limit_error");
    let messages =
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]});
    let response = post_json(gateway.address, "/v1/messages", &messages).await;
    assert_eq!(response.status, 529);
    assert_eq!(response.json()["error"]["type"], "overloaded_error");
    engine.script.overloaded.store(false, Ordering::SeqCst);
    let long_prompt = "word ".repeat(5000);
    let response = post_json(
        gateway.address,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": long_prompt, "max_tokens": 10}),
    )
    .await;
    assert_eq!(response.status, 400);
    let message = response.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        message.contains("4096") && message.contains("10 for the completion"),
        "{message}"
    );
    assert_eq!(response.json()["error"]["code"], "context_length_exceeded");
    let response = post_json(
        gateway.address,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 5000}),
    )
    .await;
    assert_eq!(response.status, 400, "max_tokens beyond the context");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_generation() {
    let (engine, gateway) = start().await;
    engine
        .script
        .set_text(&"many words to stream slowly ".repeat(40));
    engine.script.set_delay(Duration::from_millis(20));
    let body =
        json!({"model": MODEL, "prompt": "x", "max_tokens": 500, "stream": true}).to_string();
    let head = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    let mut stream = tokio::net::TcpStream::connect(gateway.address)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(head.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    stream
        .write_all(body.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut buffer = vec![0u8; 4096];
    let read = stream.read(&mut buffer).await.unwrap_or(0);
    assert!(String::from_utf8_lossy(&buffer[..read]).contains("200 OK"));
    drop(stream);
    for _ in 0..200 {
        if engine.script.dropped_streams.load(Ordering::SeqCst) >= 1
            && engine.script.cancels.load(Ordering::SeqCst) >= 1
        {
            // Counted once as cancelled, and no longer in flight.
            let metrics = get(gateway.address, "/metrics").await.text();
            for line in [
                "ninfer_gateway_cancelled_generations_total 1",
                "ninfer_gateway_in_flight_requests 0",
            ] {
                assert!(metrics.contains(line), "{line} missing:\n{metrics}");
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "generation not cancelled: dropped {} cancels {}",
        engine.script.dropped_streams.load(Ordering::SeqCst),
        engine.script.cancels.load(Ordering::SeqCst)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_going_away_gives_503_and_service_resumes_without_restart() {
    // Reserve a port, start the gateway before the engine exists.
    let placeholder = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let address = placeholder.local_addr().unwrap_or_else(|e| panic!("{e}"));
    drop(placeholder);
    let gateway = RunningGateway::start(&[address], GatewayOptions::default()).await;
    gateway.wait_for_health(503).await;
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3});
    let messages =
        json!({"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]});
    let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
    assert_eq!(response.status, 503);
    assert!(response.json()["error"]["message"].is_string());
    let response = post_json(gateway.address, "/v1/messages", &messages).await;
    assert_eq!(response.status, 503);
    assert_eq!(response.json()["type"], "error");

    let script = Arc::new(EngineScript::default());
    let engine = RunningEngine::start(script.clone(), Some(address)).await;
    gateway.wait_for_health(200).await;
    assert_eq!(
        post_json(gateway.address, "/v1/chat/completions", &chat)
            .await
            .status,
        200
    );

    let address = engine.kill();
    gateway.wait_for_health(503).await;
    assert_eq!(
        post_json(gateway.address, "/v1/chat/completions", &chat)
            .await
            .status,
        503
    );
    assert_eq!(
        post_json(gateway.address, "/v1/messages", &messages)
            .await
            .status,
        503
    );

    *script.instance_id.lock().unwrap_or_else(|e| e.into_inner()) = "instance-2".to_string();
    let _engine = RunningEngine::start(script.clone(), Some(address)).await;
    gateway.wait_for_health(200).await;
    let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let response = post_json(gateway.address, "/v1/messages", &messages).await;
    assert_eq!(response.status, 200, "{}", response.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_share_the_load_and_one_dying_is_invisible() {
    let script_a = Arc::new(EngineScript::default());
    let script_b = Arc::new(EngineScript::default());
    let engine_a = RunningEngine::start(script_a.clone(), None).await;
    let engine_b = RunningEngine::start(script_b.clone(), None).await;
    let gateway = RunningGateway::start(
        &[engine_a.address, engine_b.address],
        GatewayOptions::default(),
    )
    .await;
    for _ in 0..100 {
        if gateway
            .state
            .backend
            .snapshot()
            .engines
            .iter()
            .all(|e| e.ready)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3});
    let requests: Vec<_> = (0..6)
        .map(|_| post_json(gateway.address, "/v1/chat/completions", &chat))
        .collect();
    for response in futures_util::future::join_all(requests).await {
        assert_eq!(response.status, 200);
    }
    assert!(
        script_a.generations.load(Ordering::SeqCst) >= 1
            && script_b.generations.load(Ordering::SeqCst) >= 1,
        "both engines used"
    );
    engine_a.kill();
    for _ in 0..5 {
        let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
        assert_eq!(response.status, 200, "{}", response.text());
    }
}
