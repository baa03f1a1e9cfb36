//! The OpenAI Responses API on the wire: function calls as output items (streamed and not),
//! the event sequence, the conversation that `previous_response_id` continues, and errors in
//! the OpenAI shape. (The official SDK's round trip is in `scripts/sdk_smoke.py`.)

mod common;

use std::sync::Arc;

use common::*;
use serde_json::{json, Value};

async fn start() -> (RunningEngine, RunningGateway) {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    gateway.wait_for_health(200).await;
    (engine, gateway)
}

fn tools() -> Value {
    json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}])
}

fn prompt(engine: &RunningEngine) -> String {
    tokenizers::Tokenizer::from_file(fixture_dir().join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("{e}"))
        .decode(&engine.script.last_request().prompt_token_ids, false)
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_calls_are_output_items_and_the_conversation_continues() {
    let (engine, gateway) = start().await;
    engine.script.set_text("Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>");
    let body = json!({"model": MODEL, "instructions": "Be brief.", "input": "Weather in Paris?", "tools": tools()});
    let response = post_json(gateway.address, "/v1/responses", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let first = response.json();
    assert_eq!(first["object"], "response");
    assert_eq!(first["status"], "completed");
    let output = first["output"].as_array().unwrap();
    assert_eq!(output[0]["type"], "reasoning");
    let call = output
        .iter()
        .find(|item| item["type"] == "function_call")
        .expect("a function call");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(
        serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).unwrap(),
        json!({"city": "Paris"})
    );
    let first_prompt = prompt(&engine);
    let system_turn = first_prompt.split("<|im_end|>").next().unwrap_or_default();
    assert!(
        system_turn.starts_with("<|im_start|>system") && system_turn.contains("Be brief."),
        "{first_prompt}"
    );

    // The tool's output continues the stored conversation; instructions do not carry over.
    engine.script.set_text("</think>\n\nSunny.");
    let body = json!({"model": MODEL, "previous_response_id": first["id"], "tools": tools(),
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21 C"}]});
    let response = post_json(gateway.address, "/v1/responses", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let second = response.json();
    assert_eq!(
        second["output"].as_array().unwrap().last().unwrap()["content"][0]["text"],
        "Sunny."
    );
    let prompt = prompt(&engine);
    assert!(
        prompt.contains("Weather in Paris?")
            && prompt.contains("<function=get_weather>")
            && prompt.contains("Sunny, 21 C"),
        "{prompt}"
    );
    assert!(!prompt.contains("Be brief."), "{prompt}");

    // Streamed: the call arrives as its own item, after the reasoning, then completed.
    engine.script.set_text("Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>");
    let body =
        json!({"model": MODEL, "input": "Weather in Rome?", "tools": tools(), "stream": true});
    let response = post_json(gateway.address, "/v1/responses", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let events: Vec<(String, Value)> = response
        .sse_events()
        .into_iter()
        .map(|(name, data)| {
            (
                name.unwrap_or_default(),
                serde_json::from_str(&data).unwrap(),
            )
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    for (name, data) in &events {
        assert_eq!(
            data["type"],
            name.as_str(),
            "the event name is the payload's type"
        );
    }
    assert_eq!(names.first(), Some(&"response.created"));
    assert_eq!(names.last(), Some(&"response.completed"));
    let done = names
        .iter()
        .position(|n| *n == "response.function_call_arguments.done")
        .expect("arguments done");
    assert!(
        names[..done].contains(&"response.reasoning_text.delta"),
        "{names:?}"
    );
    assert_eq!(events[done].1["arguments"], "{\"city\":\"Rome\"}");
    let numbers: Vec<u64> = events
        .iter()
        .map(|(_, data)| data["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
    let last = &events.last().unwrap().1["response"];
    assert!(last["output"]
        .as_array()
        .unwrap()
        .iter()
        .any(|item| item["type"] == "function_call" && item["status"] == "completed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let (_engine, gateway) = start().await;
    for (body, param) in [
        (json!({"model": MODEL}), "input"),
        (json!({"model": MODEL, "input": 5}), "input"),
        (
            json!({"model": MODEL, "input": [{"type": "computer_call"}]}),
            "input",
        ),
        (
            json!({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}),
            "tools",
        ),
        (
            json!({"model": MODEL, "input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}),
            "previous_response_id",
        ),
        (
            json!({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}}),
            "text",
        ),
    ] {
        let response = post_json(gateway.address, "/v1/responses", &body).await;
        assert_eq!(response.status, 400, "{body}: {}", response.text());
        let error = &response.json()["error"];
        assert_eq!(error["type"], "invalid_request_error", "{body}");
        assert!(
            error["param"].as_str().unwrap_or("").starts_with(param),
            "{body}: {error}"
        );
    }
    let response = post_json(
        gateway.address,
        "/v1/responses",
        &json!({"model": "nope", "input": "x"}),
    )
    .await;
    assert_eq!(response.status, 404);
    let response = post_json(
        gateway.address,
        "/v1/responses",
        &json!({"model": MODEL, "input": "x", "max_output_tokens": 3}),
    )
    .await;
    assert_eq!(
        response.json()["status"],
        "incomplete",
        "{}",
        response.text()
    );
    assert_eq!(
        response.json()["incomplete_details"]["reason"],
        "max_output_tokens"
    );
}
