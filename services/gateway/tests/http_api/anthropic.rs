//! The Anthropic Messages API: thinking and stop sequences, and the exact streaming event
//! sequence.

use serde_json::json;

use crate::common::*;
use crate::helpers::start;

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
