//! What real clients (Claude Code, the OpenAI and Anthropic SDKs) send and parse, on the wire:
//! system messages inside Anthropic `messages`, context overflows in Anthropic's words, images
//! in tool results, model aliases, the tokenizer's size sent so padded ids are never sampled,
//! and fresh seeds for unseeded requests.

mod common;

use std::sync::Arc;

use common::*;
use serde_json::json;

async fn start_with(options: GatewayOptions) -> (RunningEngine, RunningGateway) {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(&[engine.address], options).await;
    gateway.wait_for_health(200).await;
    (engine, gateway)
}

fn fixture_tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(fixture_dir().join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("tokenizer: {e}"))
}

/// The prompt text the engine last received.
fn last_prompt(engine: &RunningEngine) -> String {
    fixture_tokenizer()
        .decode(&engine.script.last_request().prompt_token_ids, false)
        .unwrap_or_else(|e| panic!("decode: {e}"))
}

fn anthropic_error_message(response: &HttpResponse) -> String {
    let body = response.json();
    assert_eq!(body["type"], "error", "{body}");
    body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_system_messages_inside_messages_join_the_system_prompt() {
    let (engine, gateway) = start_with(GatewayOptions::default()).await;
    let body = json!({"model": MODEL, "max_tokens": 8,
        "system": [{"type": "text", "text": "Field prompt."}],
        "messages": [{"role": "system", "content": "Message prompt."},
                     {"role": "user", "content": "Hi"},
                     {"role": "system", "content": [{"type": "text", "text": "Late note."}]}]});
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let prompt = last_prompt(&engine);
    assert!(
        prompt.contains(
            "<|im_start|>system\nField prompt.\n\nMessage prompt.\n\nLate note.<|im_end|>\n<|im_start|>user\nHi<|im_end|>"
        ),
        "{prompt}"
    );
    assert_eq!(prompt.matches("<|im_start|>system").count(), 1, "{prompt}");

    // Only system messages: nothing to answer. An unknown role: Anthropic's wording.
    let only_system =
        json!({"model": MODEL, "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]});
    let response = post_json(gateway.address, "/v1/messages", &only_system).await;
    assert_eq!(response.status, 400);
    assert!(anthropic_error_message(&response).contains("user or assistant message"));
    let wizard =
        json!({"model": MODEL, "max_tokens": 8, "messages": [{"role": "wizard", "content": "x"}]});
    let response = post_json(gateway.address, "/v1/messages", &wizard).await;
    assert_eq!(response.status, 400);
    assert_eq!(
        anthropic_error_message(&response),
        "messages.0.role: Input should be 'user', 'assistant' or 'system'"
    );
}

/// The numbers after `prefix` in `message`, split on non-digits.
fn numbers_after(message: &str, prefix: &str) -> Vec<u64> {
    let rest = message
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("`{message}` does not start with `{prefix}`"));
    rest.split(|c: char| !c.is_ascii_digit())
        .filter(|part| !part.is_empty())
        .filter_map(|part| part.parse().ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_context_overflows_use_anthropics_sentences() {
    let (_engine, gateway) = start_with(GatewayOptions::default()).await;
    // Prompt and max_tokens together too long: "input length and `max_tokens` exceed context
    // limit: P + M > L", which Claude Code parses to lower max_tokens.
    let body = json!({"model": MODEL, "max_tokens": 5000, "messages": [{"role": "user", "content": "Hi"}]});
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 400);
    assert_eq!(response.json()["error"]["type"], "invalid_request_error");
    let message = anthropic_error_message(&response);
    let numbers = numbers_after(
        &message,
        "input length and `max_tokens` exceed context limit: ",
    );
    assert!(
        numbers.len() == 3 && numbers[1] == 5000 && numbers[2] == 4096,
        "{message}"
    );
    assert!(numbers[0] + numbers[1] > numbers[2], "{message}");
    assert!(
        message.contains(&format!("{} + 5000 > 4096", numbers[0])),
        "{message}"
    );
    // The prompt alone too long: "prompt is too long: N tokens > M maximum" (Claude Code compacts).
    let long = "word ".repeat(5000);
    let body =
        json!({"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": long}]});
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 400);
    let message = anthropic_error_message(&response);
    let numbers = numbers_after(&message, "prompt is too long: ");
    assert!(
        numbers.len() == 2 && numbers[0] > 4096 && numbers[1] == 4096,
        "{message}"
    );
    assert_eq!(
        message,
        format!("prompt is too long: {} tokens > 4096 maximum", numbers[0])
    );
    // The OpenAI endpoint keeps OpenAI's wording for the same request.
    let chat =
        json!({"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": long}]});
    let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
    assert_eq!(response.status, 400);
    assert_eq!(response.json()["error"]["code"], "context_length_exceeded");
}

fn conversation_with_an_image_tool_result() -> serde_json::Value {
    json!({"model": MODEL, "max_tokens": 8,
        "tools": [{"name": "Read", "description": "Reads a file",
                   "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": "Look at shot.png"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "shot.png"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]},
                {"type": "text", "text": "What is in it?"},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Plain notes."}}]}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_in_tool_results_become_a_placeholder_or_a_400_when_configured() {
    let (engine, gateway) = start_with(GatewayOptions::default()).await;
    let body = conversation_with_an_image_tool_result();
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let prompt = last_prompt(&engine);
    assert!(
        prompt.contains("[image omitted: this model reads text only]"),
        "{prompt}"
    );
    assert!(prompt.contains("What is in it?"), "{prompt}");
    // A plain-text document is shown as its text.
    assert!(prompt.contains("Plain notes."), "{prompt}");
    let counted = post_json(gateway.address, "/v1/messages/count_tokens", &body).await;
    assert_eq!(counted.status, 200, "{}", counted.text());

    let (_engine, refusing) = start_with(GatewayOptions {
        non_text_content: ninfer_gateway::chat::NonTextContent::Reject,
        ..Default::default()
    })
    .await;
    let response = post_json(refusing.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 400);
    assert!(
        anthropic_error_message(&response).contains("refuse image content"),
        "{}",
        response.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_aliases_answer_for_the_served_model() {
    let (engine, gateway) = start_with(GatewayOptions {
        model_aliases: vec!["sonnet=test-model".into(), "claude-*=test-model".into()],
        ..Default::default()
    })
    .await;
    for name in [
        "sonnet",
        "claude-sonnet-4-5",
        "claude-3-5-haiku-20241022",
        MODEL,
    ] {
        let body = json!({"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]});
        let response = post_json(gateway.address, "/v1/messages", &body).await;
        assert_eq!(response.status, 200, "{name}: {}", response.text());
        assert_eq!(engine.script.last_request().model_name, MODEL);
        let chat = json!({"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]});
        let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
        assert_eq!(response.status, 200, "{name}: {}", response.text());
    }
    let body =
        json!({"model": "opus", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]});
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 404);
    assert_eq!(response.json()["error"]["type"], "not_found_error");
    // Malformed aliases are refused when the gateway starts.
    assert!(ninfer_gateway::generation::ModelAliases::parse(&["sonnet".into()]).is_err());
    assert!(ninfer_gateway::generation::ModelAliases::parse(&["=x".into()]).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_is_told_the_tokenizers_size_so_padded_ids_are_never_sampled() {
    let (engine, gateway) = start_with(GatewayOptions::default()).await;
    let chat =
        json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]});
    let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
    assert_eq!(response.status, 200);
    let size = fixture_tokenizer().get_vocab_size(true) as u32;
    assert!(size > 0);
    assert_eq!(
        engine.script.last_request().sampleable_vocabulary_size,
        size
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unseeded_requests_draw_fresh_seeds_and_seeded_ones_stay_reproducible() {
    let (engine, gateway) = start_with(GatewayOptions::default()).await;
    engine.script.set_text("seed {seed}");
    let texts = |body: serde_json::Value| -> Vec<String> {
        body["choices"]
            .as_array()
            .map(|choices| {
                choices
                    .iter()
                    .map(|choice| choice["text"].as_str().unwrap_or_default().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let unseeded = json!({"model": MODEL, "prompt": "Say", "max_tokens": 64, "n": 3});
    let first = texts(
        post_json(gateway.address, "/v1/completions", &unseeded)
            .await
            .json(),
    );
    let again = texts(
        post_json(gateway.address, "/v1/completions", &unseeded)
            .await
            .json(),
    );
    assert_eq!(first.len(), 3);
    let mut all: Vec<&String> = first.iter().chain(&again).collect();
    assert!(all.iter().all(|text| text.starts_with("seed ")), "{all:?}");
    all.sort();
    all.dedup();
    assert_eq!(
        all.len(),
        6,
        "three choices and a retry, all different: {first:?} {again:?}"
    );

    let seeded = json!({"model": MODEL, "prompt": "Say", "max_tokens": 64, "n": 2, "seed": 7});
    for _ in 0..2 {
        let body = post_json(gateway.address, "/v1/completions", &seeded)
            .await
            .json();
        assert_eq!(
            texts(body),
            vec!["seed 7".to_string(), "seed 8".to_string()]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_is_checked_and_none_keeps_calls_as_text() {
    let (engine, gateway) = start_with(GatewayOptions::default()).await;
    engine.script.set_text(
        "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
    );
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let chat = |tool_choice: serde_json::Value| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
               "tools": tools, "tool_choice": tool_choice})
    };
    // OpenAI: an unknown function, `required` without tools, and a malformed choice are 400s.
    let unknown = chat(json!({"type": "function", "function": {"name": "no_such_tool"}}));
    let response = post_json(gateway.address, "/v1/chat/completions", &unknown).await;
    assert_eq!(response.status, 400, "{}", response.text());
    assert_eq!(response.json()["error"]["param"], "tool_choice");
    let mut without_tools = chat(json!("required"));
    without_tools["tools"] = json!([]);
    let response = post_json(gateway.address, "/v1/chat/completions", &without_tools).await;
    assert_eq!(response.status, 400, "{}", response.text());
    let response = post_json(
        gateway.address,
        "/v1/chat/completions",
        &chat(json!("sometimes")),
    )
    .await;
    assert_eq!(response.status, 400);
    // Named and required choices of declared tools are taken, and the call parses.
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
        json!("auto"),
    ] {
        let body = post_json(
            gateway.address,
            "/v1/chat/completions",
            &chat(choice.clone()),
        )
        .await
        .json();
        assert_eq!(
            body["choices"][0]["finish_reason"], "tool_calls",
            "{choice}: {body}"
        );
    }
    // `none`: no tool calls; the text stays text.
    let body = post_json(
        gateway.address,
        "/v1/chat/completions",
        &chat(json!("none")),
    )
    .await
    .json();
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    assert!(
        body["choices"][0]["message"]["tool_calls"].is_null(),
        "{body}"
    );
    assert!(body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .contains("<tool_call>"));

    // Anthropic: tool with an unknown name, tool without a name, an unknown type are 400s.
    let anthropic_tools = json!([{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let message = |tool_choice: serde_json::Value| {
        json!({"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
               "tools": anthropic_tools, "tool_choice": tool_choice})
    };
    for bad in [
        json!({"type": "tool", "name": "no_such_tool"}),
        json!({"type": "tool"}),
        json!({"type": "often"}),
    ] {
        let response = post_json(gateway.address, "/v1/messages", &message(bad.clone())).await;
        assert_eq!(response.status, 400, "{bad}: {}", response.text());
        assert_eq!(response.json()["error"]["type"], "invalid_request_error");
    }
    for good in [
        json!({"type": "any"}),
        json!({"type": "tool", "name": "get_weather"}),
        json!({"type": "auto"}),
    ] {
        let body = post_json(gateway.address, "/v1/messages", &message(good.clone()))
            .await
            .json();
        assert_eq!(body["stop_reason"], "tool_use", "{good}: {body}");
    }
    let body = post_json(
        gateway.address,
        "/v1/messages",
        &message(json!({"type": "none"})),
    )
    .await
    .json();
    assert_eq!(body["stop_reason"], "end_turn", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_reaches_the_engine_and_bad_entries_are_refused() {
    let (engine, gateway) = start_with(GatewayOptions::default()).await;
    let chat = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                      "logit_bias": {"11": 100, "42": -100, "7": 2.5}});
    let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let bias = engine.script.last_request().logit_bias;
    assert_eq!(bias.len(), 3);
    assert_eq!(bias.get(&11), Some(&100.0));
    assert_eq!(bias.get(&42), Some(&-100.0));
    assert_eq!(bias.get(&7), Some(&2.5));
    let completion =
        json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": -1}});
    let response = post_json(gateway.address, "/v1/completions", &completion).await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(engine.script.last_request().logit_bias.get(&5), Some(&-1.0));
    for bad in [
        json!({"abc": 1}),
        json!({"11": 150}),
        json!({"99999999": 1}),
    ] {
        let chat = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "logit_bias": bad});
        let response = post_json(gateway.address, "/v1/chat/completions", &chat).await;
        assert_eq!(response.status, 400, "{bad}: {}", response.text());
        assert_eq!(response.json()["error"]["param"], "logit_bias");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_clients_get_anthropics_model_list() {
    let (_engine, gateway) = start_with(GatewayOptions::default()).await;
    let response = request(
        gateway.address,
        "GET",
        "/v1/models",
        &[("anthropic-version", "2023-06-01")],
        b"",
    )
    .await;
    assert_eq!(response.status, 200);
    let body = response.json();
    assert_eq!(body["data"][0]["type"], "model", "{body}");
    assert_eq!(body["data"][0]["id"], MODEL);
    assert!(body["data"][0]["created_at"]
        .as_str()
        .unwrap_or_default()
        .ends_with('Z'));
    assert_eq!(body["has_more"], false);
    assert_eq!(body["first_id"], MODEL);
    // OpenAI clients keep OpenAI's shape.
    assert_eq!(
        get(gateway.address, "/v1/models").await.json()["object"],
        "list"
    );
}
