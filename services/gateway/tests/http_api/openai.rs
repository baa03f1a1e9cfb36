//! The OpenAI API: chat completions with the reasoning split and usage, every sampling
//! parameter reaching the engine, thinking off, the streaming chunk order, stop strings across
//! token boundaries, completions with `n` and logprobs, and two streamed choices kept apart.

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::json;

use crate::common::*;
use crate::helpers::start;

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
