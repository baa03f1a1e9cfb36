//! The HTTP APIs against a scripted in-process engine: OpenAI and Anthropic shapes, streaming
//! event order, stop strings across token boundaries, reasoning split, usage, errors, auth,
//! cancellation, metrics and routing statistics.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;

async fn start() -> (RunningEngine, RunningGateway) {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    gateway.wait_for_health(200).await;
    (engine, gateway)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_splits_reasoning_and_counts_usage() {
    let (engine, gateway) = start().await;
    engine
        .script
        .set_text("I think it is four.\n</think>\n\nThe answer is 4.");
    let response = post_json(
        gateway.address,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 100, "temperature": 0.0, "top_k": 1, "seed": 7}),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let body = response.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["content"], "The answer is 4.");
    assert_eq!(
        body["choices"][0]["message"]["reasoning_content"],
        "I think it is four."
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    // Prompt = the transformers rendering of the fixture template, tokenized.
    let prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n";
    let request = engine.script.last_request();
    assert_eq!(
        body["usage"]["prompt_tokens"],
        request.prompt_token_ids.len()
    );
    assert_eq!(request.prompt_token_ids.len(), count_tokens(prompt));
    let completion = count_tokens("I think it is four.\n</think>\n\nThe answer is 4.") + 1;
    assert_eq!(body["usage"]["completion_tokens"], completion);
    assert_eq!(
        body["usage"]["total_tokens"],
        request.prompt_token_ids.len() + completion
    );
    let sampling = request.sampling.unwrap_or_default();
    assert_eq!(
        (sampling.temperature, sampling.top_k, sampling.seed),
        (0.0, 1, Some(7))
    );
    assert_eq!(
        sampling.top_p, 0.95,
        "generation defaults fill what the request leaves out"
    );
    assert_eq!(request.stop_token_ids, vec![482, 480]);
    assert_eq!(request.max_new_tokens, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sampling_parameter_reaches_the_engine() {
    let (engine, gateway) = start().await;
    engine.script.set_text("Fine.");
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let mut body = json!({"model": MODEL, "max_completion_tokens": 7, "temperature": 0.7,
            "top_p": 0.8, "top_k": 5, "min_p": 0.05, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.1, "seed": 42});
        if path == "/v1/completions" {
            body["prompt"] = json!("Hello");
            body["max_tokens"] = body["max_completion_tokens"].take();
        } else {
            body["messages"] = json!([{"role": "user", "content": "Hello"}]);
        }
        let response = post_json(gateway.address, path, &body).await;
        assert_eq!(response.status, 200, "{path}: {}", response.text());
        let request = engine.script.last_request();
        let sampling = request.sampling.unwrap_or_default();
        assert_eq!(
            (
                sampling.temperature,
                sampling.top_p,
                sampling.top_k,
                sampling.min_p,
                sampling.presence_penalty,
                sampling.frequency_penalty,
                sampling.repetition_penalty,
                sampling.seed,
            ),
            (0.7, 0.8, 5, 0.05, 0.5, 0.25, 1.1, Some(42)),
            "{path}"
        );
        assert_eq!(request.max_new_tokens, 7, "{path}");
    }
    let response = post_json(
        gateway.address,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 9, "temperature": 0.3, "top_p": 0.6, "top_k": 11,
                "messages": [{"role": "user", "content": "Hello"}]}),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let request = engine.script.last_request();
    let sampling = request.sampling.unwrap_or_default();
    assert_eq!(
        (sampling.temperature, sampling.top_p, sampling.top_k),
        (0.3, 0.6, 11)
    );
    assert_eq!(request.max_new_tokens, 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_off_gives_plain_content() {
    let (engine, gateway) = start().await;
    engine.script.set_text("Just the answer.");
    let response = post_json(
        gateway.address,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    let body = response.json();
    assert_eq!(body["choices"][0]["message"]["content"], "Just the answer.");
    assert!(body["choices"][0]["message"]["reasoning_content"].is_null());
    let request = engine.script.last_request();
    assert_eq!(
        request.prompt_token_ids.len(),
        count_tokens(
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
    );
    // No max_tokens: the rest of the context.
    assert_eq!(
        request.max_new_tokens as usize,
        4096 - request.prompt_token_ids.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chat_has_openai_chunk_order_usage_and_done() {
    let (engine, gateway) = start().await;
    engine
        .script
        .set_text("Reasoning here.</think>\n\nFinal words.");
    let response = post_json(
        gateway.address,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(response.status, 200);
    assert!(response
        .header("content-type")
        .unwrap_or("")
        .starts_with("text/event-stream"));
    let events = response.sse_events();
    assert_eq!(events.last().map(|(_, data)| data.as_str()), Some("[DONE]"));
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, data)| serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}")))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut content = String::new();
    let mut reasoning = String::new();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        if let Some(choice) = chunk["choices"].get(0) {
            content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            reasoning.push_str(choice["delta"]["reasoning_content"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(reasoning, "Reasoning here.");
    assert_eq!(content, "Final words.");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage_chunk = &chunks[chunks.len() - 1];
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["completion_tokens"],
        count_tokens("Reasoning here.</think>\n\nFinal words.") + 1
    );
    assert!(
        chunks[0]["usage"].is_null(),
        "usage is null on content chunks with include_usage"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_string_across_token_boundaries_is_never_emitted_and_cancels_the_engine() {
    let (engine, gateway) = start().await;
    let text = "The quick brown fox jumps over the lazy dog and keeps running far away.";
    engine.script.set_text(text);
    engine.script.set_delay(Duration::from_millis(5));
    // "fox jumps" spans several tokens of the fixture tokenizer.
    assert!(count_tokens("fox jumps") > 1);
    for stream in [false, true] {
        let before_drops = engine.script.dropped_streams.load(Ordering::SeqCst);
        let response = post_json(
            gateway.address,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "Once", "max_tokens": 200, "stop": ["fox jumps", "never"], "stream": stream}),
        )
        .await;
        assert_eq!(response.status, 200, "{}", response.text());
        let (text_out, finish, stop_reason) = if stream {
            let events = response.sse_events();
            let mut text_out = String::new();
            let mut finish = serde_json::Value::Null;
            let mut stop_reason = serde_json::Value::Null;
            for (_, data) in &events[..events.len() - 1] {
                let chunk: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
                text_out.push_str(chunk["choices"][0]["text"].as_str().unwrap_or(""));
                if !chunk["choices"][0]["finish_reason"].is_null() {
                    finish = chunk["choices"][0]["finish_reason"].clone();
                    stop_reason = chunk["choices"][0]["stop_reason"].clone();
                }
            }
            (text_out, finish, stop_reason)
        } else {
            let body = response.json();
            (
                body["choices"][0]["text"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                body["choices"][0]["finish_reason"].clone(),
                body["choices"][0]["stop_reason"].clone(),
            )
        };
        assert_eq!(text_out, "The quick brown ", "stream={stream}");
        assert_eq!(finish, "stop");
        assert_eq!(stop_reason, "fox jumps");
        // The gateway dropped the engine stream (and called Cancel) once the stop string matched.
        for _ in 0..100 {
            if engine.script.dropped_streams.load(Ordering::SeqCst) > before_drops {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            engine.script.dropped_streams.load(Ordering::SeqCst) > before_drops,
            "engine stream not cancelled (stream={stream})"
        );
    }
    assert!(engine.script.cancels.load(Ordering::SeqCst) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_length_n_and_logprobs() {
    let (engine, gateway) = start().await;
    engine.script.set_text("one two three four five six seven");
    let response = post_json(
        gateway.address,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Count:", "max_tokens": 3, "n": 2, "logprobs": 2, "seed": 1}),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let body = response.json();
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(2));
    for choice in body["choices"].as_array().cloned().unwrap_or_default() {
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(
            choice["logprobs"]["tokens"].as_array().map(Vec::len),
            Some(3)
        );
        assert_eq!(choice["logprobs"]["token_logprobs"][0], -0.5);
        assert_eq!(
            choice["logprobs"]["top_logprobs"][0]
                .as_object()
                .map(|m| m.len()),
            Some(2)
        );
    }
    assert_eq!(body["usage"]["completion_tokens"], 6);
    assert_eq!(engine.script.last_request().top_logprobs, 2);
    // Token-id prompts work too.
    let response = post_json(
        gateway.address,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [72, 101, 108], "max_tokens": 2}),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(
        engine.script.last_request().prompt_token_ids,
        vec![72, 101, 108]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_shape() {
    let (_engine, gateway) = start().await;
    let response = post_json(
        gateway.address,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": true, "top_logprobs": 1, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    let body = response.json();
    let content = &body["choices"][0]["logprobs"]["content"];
    assert_eq!(content.as_array().map(Vec::len), Some(2), "{body}");
    assert_eq!(content[0]["top_logprobs"].as_array().map(Vec::len), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_with_thinking_and_stop_sequences() {
    let (engine, gateway) = start().await;
    engine
        .script
        .set_text("Let me see.\n</think>\n\nParis is the capital. END more text");
    let response = post_json(
        gateway.address,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 200, "system": "Be terse.", "stop_sequences": ["END"],
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": "old", "signature": "x"}, {"type": "text", "text": "Earlier."}]}, {"role": "user", "content": [{"type": "text", "text": "Again?"}]}]}),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let body = response.json();
    assert_eq!(body["type"], "message");
    assert_eq!(
        body["content"][0],
        json!({"type": "thinking", "thinking": "Let me see.", "signature": ""})
    );
    assert_eq!(
        body["content"][1],
        json!({"type": "text", "text": "Paris is the capital. "})
    );
    assert_eq!(body["stop_reason"], "stop_sequence");
    assert_eq!(body["stop_sequence"], "END");
    let prompt_tokens = engine.script.last_request().prompt_token_ids.len();
    assert_eq!(body["usage"]["input_tokens"], prompt_tokens);
    // count_tokens agrees with what /v1/messages sent.
    let counted = post_json(
        gateway.address,
        "/v1/messages/count_tokens",
        &json!({"model": MODEL, "system": "Be terse.", "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": "old", "signature": "x"}, {"type": "text", "text": "Earlier."}]}, {"role": "user", "content": [{"type": "text", "text": "Again?"}]}]}),
    )
    .await;
    assert_eq!(counted.json(), json!({"input_tokens": prompt_tokens}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_streaming_event_sequence_is_exact() {
    let (engine, gateway) = start().await;
    engine.script.set_text("Hmm.</think>\n\nHello!");
    let response = post_json(
        gateway.address,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 50, "stream": true, "thinking": {"type": "enabled", "budget_tokens": 100},
                "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(response.status, 200);
    let events = response.sse_events();
    let names: Vec<String> = events
        .iter()
        .map(|(name, _)| name.clone().unwrap_or_default())
        .collect();
    // Collapse runs of deltas to check the grammar.
    let mut collapsed: Vec<String> = Vec::new();
    for name in &names {
        if collapsed.last() != Some(name) || name != "content_block_delta" {
            collapsed.push(name.clone());
        }
    }
    assert_eq!(
        collapsed,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let data: Vec<serde_json::Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap_or_default())
        .collect();
    for ((name, _), value) in events.iter().zip(&data) {
        assert_eq!(
            value["type"].as_str(),
            name.as_deref(),
            "event name equals data.type"
        );
    }
    assert_eq!(
        data[0]["message"]["usage"]["input_tokens"],
        engine.script.last_request().prompt_token_ids.len()
    );
    assert_eq!(data[2]["content_block"]["type"], "thinking");
    let thinking: String = data
        .iter()
        .filter(|d| d["delta"]["type"] == "thinking_delta")
        .map(|d| d["delta"]["thinking"].as_str().unwrap_or("").to_string())
        .collect();
    let text: String = data
        .iter()
        .filter(|d| d["delta"]["type"] == "text_delta")
        .map(|d| d["delta"]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!((thinking.as_str(), text.as_str()), ("Hmm.", "Hello!"));
    let message_delta = data
        .iter()
        .find(|d| d["type"] == "message_delta")
        .cloned()
        .unwrap_or_default();
    assert_eq!(message_delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(
        message_delta["usage"]["output_tokens"],
        count_tokens("Hmm.</think>\n\nHello!") + 1
    );
    let starts: Vec<i64> = data
        .iter()
        .filter(|d| d["type"] == "content_block_start")
        .map(|d| d["index"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(starts, vec![0, 1]);
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_tokenize_detokenize_metrics_and_expert_statistics() {
    let state_dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(
        &[engine.address],
        GatewayOptions {
            state_dir: Some(state_dir.path().to_path_buf()),
            ..Default::default()
        },
    )
    .await;
    gateway.wait_for_health(200).await;
    let models = get(gateway.address, "/v1/models").await.json();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    assert_eq!(get(gateway.address, "/v1/models/nope").await.status, 404);

    let tokenized = post_json(
        gateway.address,
        "/tokenize",
        &json!({"model": MODEL, "prompt": "Hello world"}),
    )
    .await
    .json();
    assert_eq!(tokenized["count"], count_tokens("Hello world"));
    let detokenized = post_json(
        gateway.address,
        "/detokenize",
        &json!({"model": MODEL, "tokens": tokenized["tokens"]}),
    )
    .await
    .json();
    assert_eq!(detokenized["prompt"], "Hello world");
    let bad = post_json(gateway.address, "/detokenize", &json!({"tokens": [999999]})).await;
    assert_eq!(bad.status, 400);

    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5});
    assert_eq!(
        post_json(gateway.address, "/v1/chat/completions", &chat)
            .await
            .status,
        200
    );
    // The generation finishes its bookkeeping just after the response: poll briefly.
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = get(gateway.address, "/metrics").await.text();
        if metrics.contains("ninfer_gateway_in_flight_requests 0") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for name in [
        "ninfer_gateway_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "ninfer_gateway_time_to_first_token_seconds_count 1",
        "ninfer_gateway_inter_token_latency_seconds_bucket",
        "ninfer_gateway_completion_tokens_total 5",
        "ninfer_gateway_in_flight_requests 0",
        "ninfer_gateway_cancelled_generations_total 0",
        "ninfer_engine_expert_cache_hits_total{engine=",
        "ninfer_engine_expert_cache_bytes_copied_total{engine=",
        "\",layer=\"3\"} 2",
        "ninfer_engine_up{engine=",
        "ninfer_engine_speculative_steps_total{engine=",
        "ninfer_engine_draft_tokens_by_depth_total{engine=",
        "depth=\"2\"} 5",
        "ninfer_engine_draft_tokens_accepted_by_depth_total{engine=",
    ] {
        assert!(metrics.contains(name), "metrics lack {name}:\n{metrics}");
    }
    // The totals add the depths up (the scripted engine drafted 8 + 5, accepted 6 + 3).
    for (name, total) in [
        ("ninfer_engine_draft_tokens_total{", " 13"),
        ("ninfer_engine_draft_tokens_accepted_total{", " 9"),
    ] {
        assert!(
            metrics
                .lines()
                .any(|line| line.starts_with(name) && line.ends_with(total)),
            "metrics lack {name}…{total}:\n{metrics}"
        );
    }
    // Routing statistics: streamed from the engine, merged, served and persisted.
    let mut served = serde_json::Value::Null;
    for _ in 0..100 {
        served = get(gateway.address, "/v1/stats/experts").await.json();
        if served["data"][0]["tokens_routed"].as_u64().unwrap_or(0) >= 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let routed = served["data"][0]["tokens_routed"].as_u64().unwrap_or(0);
    assert_eq!(routed, 5, "{served}");
    assert_eq!(served["data"][0]["layers"]["0"], json!([5, 10, 0, 0]));
    assert_eq!(served["data"][0]["layers"]["1"], json!([5, 10, 0, 1]));
    gateway
        .routing_stats
        .flush()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let persisted: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            state_dir
                .path()
                .join("expert-stats")
                .join(format!("{MODEL}.json")),
        )
        .unwrap_or_else(|e| panic!("{e}")),
    )
    .unwrap_or_default();
    assert_eq!(persisted["tokens_routed"], 5);
    assert_eq!(persisted["format"], "ninfer-expert-stats-v1");
    assert!(get(gateway.address, "/metrics")
        .await
        .text()
        .contains(&format!(
            "ninfer_routing_tokens_total{{model=\"{MODEL}\"}} 5"
        )));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_statistics_survive_a_gateway_restart_and_engine_restarts_are_not_double_counted() {
    let state_dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = ninfer_gateway::routing_stats::RoutingStatsHandle::start(
        Some(state_dir.path().to_path_buf()),
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let report = |instance: &str, routed: u64| ninfer_protocol::v1::RoutingStatistics {
        tokens_routed: routed,
        layers: vec![ninfer_protocol::v1::LayerRoutingCounts {
            layer: 3,
            expert_token_counts: vec![routed, 1],
        }],
        model_name: "m/with slash".to_string(),
        engine_instance_id: instance.to_string(),
    };
    store.observe("a".into(), report("1", 10));
    store.observe("a".into(), report("1", 10)); // repeated cumulative report adds nothing
    store.observe("a".into(), report("1", 15));
    store.observe("b".into(), report("x", 4)); // a second engine of the same model
    store.observe("a".into(), report("2", 3)); // engine a restarted: counts from zero again
    store.flush().await.unwrap_or_else(|e| panic!("{e}"));
    let totals = store.snapshot().await;
    assert_eq!(totals[0].tokens_routed, 15 + 4 + 3);
    assert_eq!(totals[0].layers[&3], vec![22, 3]);
    let reloaded = ninfer_gateway::routing_stats::RoutingStatsHandle::start(
        Some(state_dir.path().to_path_buf()),
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reloaded.snapshot().await, totals);
    assert!(state_dir
        .path()
        .join("expert-stats/m_with_slash.json")
        .exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_become_openai_tool_calls_and_anthropic_tool_use() {
    let (engine, gateway) = start().await;
    engine.script.set_text(
        "Need weather.</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    );
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools});
    let body = post_json(gateway.address, "/v1/chat/completions", &chat)
        .await
        .json();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    assert_eq!(choice["message"]["content"], "Checking.");
    assert_eq!(choice["message"]["reasoning_content"], "Need weather.");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments: serde_json::Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap_or(""))
            .unwrap_or_default();
    assert_eq!(arguments, json!({"city": "Oslo", "days": 2}));

    let mut streaming = chat.clone();
    streaming["stream"] = json!(true);
    let events = post_json(gateway.address, "/v1/chat/completions", &streaming)
        .await
        .sse_events();
    let chunks: Vec<serde_json::Value> = events
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str(d).unwrap_or_default())
        .collect();
    let content: String = chunks
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(
        content, "Checking.",
        "no part of the tool call leaks into content"
    );
    let call = chunks
        .iter()
        .find_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0).cloned())
        .unwrap_or_default();
    assert_eq!(
        (call["index"].clone(), call["function"]["name"].clone()),
        (json!(0), json!("get_weather"))
    );
    assert_eq!(
        chunks
            .iter()
            .rev()
            .find_map(|c| c["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string)),
        Some("tool_calls".to_string())
    );

    let anthropic_tools = json!([{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]);
    let messages = json!({"model": MODEL, "max_tokens": 300, "thinking": {"type": "enabled", "budget_tokens": 100}, "tools": anthropic_tools,
                          "messages": [{"role": "user", "content": "Weather in Oslo?"}]});
    let body = post_json(gateway.address, "/v1/messages", &messages)
        .await
        .json();
    assert_eq!(body["stop_reason"], "tool_use", "{body}");
    let kinds: Vec<&str> = body["content"]
        .as_array()
        .map(|blocks| blocks.iter().filter_map(|b| b["type"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(kinds, ["thinking", "text", "tool_use"]);
    assert_eq!(
        body["content"][2]["input"],
        json!({"city": "Oslo", "days": 2})
    );

    let mut streaming = messages.clone();
    streaming["stream"] = json!(true);
    let events = post_json(gateway.address, "/v1/messages", &streaming)
        .await
        .sse_events();
    let data: Vec<serde_json::Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap_or_default())
        .collect();
    let starts: Vec<String> = data
        .iter()
        .filter(|d| d["type"] == "content_block_start")
        .map(|d| {
            d["content_block"]["type"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(starts, ["thinking", "text", "tool_use"]);
    let partial = data
        .iter()
        .find(|d| d["delta"]["type"] == "input_json_delta")
        .map(|d| {
            d["delta"]["partial_json"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_default();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&partial).unwrap_or_default(),
        json!({"city": "Oslo", "days": 2})
    );
    let stops = data
        .iter()
        .filter(|d| d["type"] == "content_block_stop")
        .count();
    assert_eq!(stops, 3);
    assert_eq!(
        data.iter()
            .find(|d| d["type"] == "message_delta")
            .map(|d| d["delta"]["stop_reason"].clone()),
        Some(json!("tool_use"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chat_with_two_choices_keeps_them_apart() {
    let (engine, gateway) = start().await;
    engine.script.set_text("Same answer for both.");
    let response = post_json(
        gateway.address,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": true,
                "stream_options": {"include_usage": true}, "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    let events = response.sse_events();
    let mut texts = [String::new(), String::new()];
    let mut finishes = 0;
    for (_, data) in &events[..events.len() - 1] {
        let chunk: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
        if let Some(choice) = chunk["choices"].get(0) {
            let index = choice["index"].as_u64().unwrap_or(9) as usize;
            texts[index].push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            finishes += usize::from(!choice["finish_reason"].is_null());
        } else {
            assert_eq!(
                chunk["usage"]["completion_tokens"],
                2 * (count_tokens("Same answer for both.") + 1)
            );
        }
    }
    assert_eq!(
        texts,
        [
            "Same answer for both.".to_string(),
            "Same answer for both.".to_string()
        ]
    );
    assert_eq!(finishes, 2);
    assert_eq!(engine.script.generations.load(Ordering::SeqCst), 2);
}
