//! Tool calls of the model become OpenAI `tool_calls` and Anthropic `tool_use` blocks.

use serde_json::json;

use crate::common::*;
use crate::helpers::start;

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
