//! Structured output and forced tool calls: the grammars the gateway sends accept only answers
//! its own parsers read as schema-valid (checked by walking the grammars at random with the
//! grammar engine itself), schemas with keywords the grammar cannot enforce are refused, and the
//! engine request carries the grammar, the reasoning block and the thinking budget.

mod common;

use std::sync::Arc;

use common::*;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::ApproximateTokEnv;
use llguidance::{Matcher, ParserFactory};
use ninfer_gateway::chat::ToolChoice;
use ninfer_gateway::structured::{
    forced_tool_grammar, response_format_grammar, ResponseFormat, ToolCallSyntax, ToolSpec,
};
use ninfer_gateway::tool_calls::{split_tool_calls, AnswerEnd};
use serde_json::{json, Value};

/// A small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// One random sentence of `grammar` over single-byte tokens: each step draws among the bytes
/// the grammar allows (structural characters weighted up so strings and numbers end), and
/// stops as soon as the grammar may end. `None` when it ran past `max_bytes`.
fn random_sentence(grammar: &str, seed: u64, max_bytes: usize) -> Option<String> {
    let env = ApproximateTokEnv::single_byte_env();
    let eos = env.tok_trie().eos_token();
    let mut factory = ParserFactory::new_simple(&env).unwrap_or_else(|e| panic!("{e}"));
    factory.quiet();
    let parser = factory
        .create_parser(TopLevelGrammar::from_lark(grammar.to_string()))
        .unwrap_or_else(|e| panic!("the gateway's grammar does not compile: {e}\n{grammar}"));
    let mut matcher = Matcher::new(Ok(parser));
    let mut rng = Rng(seed);
    let mut bytes = Vec::new();
    while bytes.len() < max_bytes {
        if matcher.is_stopped() {
            return Some(String::from_utf8(bytes).expect("grammar output is UTF-8"));
        }
        let mask = matcher.compute_mask().unwrap_or_else(|e| panic!("{e}"));
        if mask.is_allowed(eos) {
            return Some(String::from_utf8(bytes).expect("grammar output is UTF-8"));
        }
        let mut choices = Vec::new();
        for byte in 0..=255u32 {
            if mask.is_allowed(byte) {
                let weight = if b"\"}],<\n:0123456789tfn".contains(&(byte as u8)) {
                    40
                } else {
                    1
                };
                choices.extend(std::iter::repeat_n(byte, weight));
            }
        }
        assert!(
            !choices.is_empty(),
            "the grammar allows nothing after {:?}",
            String::from_utf8_lossy(&bytes)
        );
        let byte = choices[(rng.next() % choices.len() as u64) as usize];
        matcher
            .consume_token(byte)
            .unwrap_or_else(|e| panic!("{e}"));
        bytes.push(byte as u8);
    }
    None
}

fn weather_tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "detailed": {"type": "boolean"},
                "airport": {"type": "string", "pattern": "^[A-Z]{3}$"}
            }, "required": ["city", "unit", "airport"]}}}),
        json!({"type": "function", "function": {"name": "add", "parameters": {"type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}),
    ]
}

fn specs(tools: &[Value]) -> Vec<ToolSpec> {
    tools
        .iter()
        .map(|t| ToolSpec {
            name: t["function"]["name"].as_str().unwrap().to_string(),
            parameters: t["function"]["parameters"].clone(),
        })
        .collect()
}

/// The arguments fit the tools above (types, enum, range, required, nothing else).
fn check_arguments(name: &str, arguments: &serde_json::Map<String, Value>) {
    match name {
        "get_weather" => {
            assert!(
                arguments["city"]
                    .as_str()
                    .is_some_and(|c| c.chars().count() <= 12),
                "{arguments:?}"
            );
            assert!(
                ["celsius", "fahrenheit"].contains(&arguments["unit"].as_str().unwrap_or("")),
                "{arguments:?}"
            );
            if let Some(days) = arguments.get("days") {
                assert!(
                    days.as_i64().is_some_and(|d| (1..=7).contains(&d)),
                    "{arguments:?}"
                );
            }
            if let Some(detailed) = arguments.get("detailed") {
                assert!(detailed.is_boolean(), "{arguments:?}");
            }
            let airport = arguments["airport"].as_str().unwrap_or_default();
            assert!(
                airport.len() == 3 && airport.chars().all(|c| c.is_ascii_uppercase()),
                "{arguments:?}"
            );
            for key in arguments.keys() {
                assert!(
                    ["city", "unit", "days", "detailed", "airport"].contains(&key.as_str()),
                    "{arguments:?}"
                );
            }
        }
        "add" => {
            assert!(
                arguments["a"].is_number() && arguments["b"].is_number(),
                "{arguments:?}"
            );
            assert_eq!(arguments.len(), 2, "{arguments:?}");
        }
        other => panic!("unexpected tool {other}"),
    }
}

#[test]
fn forced_tool_calls_in_both_syntaxes_always_parse_and_fit_their_schemas() {
    let tools = weather_tools();
    let definitions: Vec<minijinja::Value> =
        tools.iter().map(minijinja::Value::from_serialize).collect();
    for syntax in [ToolCallSyntax::Xml, ToolCallSyntax::Json] {
        for (choice, parallel) in [
            (ToolChoice::Function("get_weather".into()), false),
            (ToolChoice::Required, false),
            (ToolChoice::Required, true),
        ] {
            let grammar = forced_tool_grammar(&choice, &specs(&tools), syntax, parallel)
                .unwrap()
                .unwrap();
            let mut finished = 0;
            let mut names = std::collections::BTreeSet::new();
            for seed in 0..40u64 {
                let Some(text) = random_sentence(&grammar, seed, 4000) else {
                    continue;
                };
                finished += 1;
                let (rest, calls) = split_tool_calls(&text, &definitions, AnswerEnd::Finished);
                assert!(
                    !calls.is_empty(),
                    "{syntax:?} {choice:?}: no call parsed from {text:?}"
                );
                assert!(
                    rest.trim().is_empty(),
                    "{syntax:?}: text beside the call: {rest:?}"
                );
                if !parallel {
                    assert_eq!(calls.len(), 1, "{text:?}");
                }
                for call in &calls {
                    if let ToolChoice::Function(name) = &choice {
                        assert_eq!(&call.name, name);
                    }
                    names.insert(call.name.clone());
                    check_arguments(&call.name, &call.arguments);
                }
            }
            assert!(
                finished >= 30,
                "{syntax:?} {choice:?}: only {finished} of 40 walks ended"
            );
            if choice == ToolChoice::Required {
                assert_eq!(names.len(), 2, "both tools are reachable: {names:?}");
            }
        }
    }
    // A string `format` cannot be enforced on the XML syntax's raw values: refused by name.
    let dated = vec![ToolSpec {
        name: "when".into(),
        parameters: json!({"type": "object", "properties": {"day": {"type": "string", "format": "date"}}}),
    }];
    let error =
        forced_tool_grammar(&ToolChoice::Required, &dated, ToolCallSyntax::Xml, false).unwrap_err();
    assert!(error.to_string().contains("`format`"), "{error}");
    assert!(
        forced_tool_grammar(&ToolChoice::Required, &dated, ToolCallSyntax::Json, false).is_ok()
    );
    // A forced choice of an undeclared tool is refused, not ignored.
    assert!(forced_tool_grammar(
        &ToolChoice::Function("nope".into()),
        &specs(&tools),
        ToolCallSyntax::Json,
        true
    )
    .is_err());
}

#[test]
fn json_answers_parse_and_fit_the_schema() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number"},
            "member": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "nothing": {"type": "null"},
            "address": {"$ref": "#/$defs/Address"}
        },
        "required": ["name", "age", "member", "tags", "nothing", "address"],
        "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}
    });
    let grammar = response_format_grammar(&ResponseFormat::JsonSchema(schema)).unwrap();
    let mut finished = 0;
    for seed in 0..40u64 {
        let Some(text) = random_sentence(&grammar, seed, 4000) else {
            continue;
        };
        let value: Value = match serde_json::from_str(&text) {
            Ok(value) => value,
            // JSON allows exponents no f64 holds (`1e99999`); valid, but not checkable here.
            Err(error) if error.to_string().contains("number out of range") => continue,
            Err(error) => panic!("{error}: {text:?}"),
        };
        finished += 1;
        let object = value.as_object().unwrap();
        assert!(object["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 10));
        assert!(
            object["age"]
                .as_i64()
                .is_some_and(|a| (0..=120).contains(&a)),
            "{text}"
        );
        if let Some(score) = object.get("score") {
            assert!(score.is_number());
        }
        assert!(object["member"].is_boolean());
        let tags = object["tags"].as_array().unwrap();
        assert!(
            tags.len() <= 3
                && tags
                    .iter()
                    .all(|t| ["a", "b", "c"].contains(&t.as_str().unwrap_or("")))
        );
        assert!(object["nothing"].is_null());
        assert!(object["address"]["city"].is_string());
        assert_eq!(
            object["address"].as_object().unwrap().len(),
            1,
            "strict objects: {text}"
        );
        for key in object.keys() {
            assert!(
                ["name", "age", "score", "member", "tags", "nothing", "address"]
                    .contains(&key.as_str()),
                "{text}"
            );
        }
    }
    assert!(finished >= 30, "only {finished} of 40 walks ended");
    let any_object = response_format_grammar(&ResponseFormat::JsonObject).unwrap();
    for seed in 0..10u64 {
        if let Some(text) = random_sentence(&any_object, seed, 4000) {
            assert!(serde_json::from_str::<Value>(&text)
                .unwrap_or_else(|e| panic!("{e}: {text:?}"))
                .is_object());
        }
    }
}

async fn start() -> (RunningEngine, RunningGateway) {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    gateway.wait_for_health(200).await;
    (engine, gateway)
}

fn token_id(text: &str) -> u32 {
    tokenizers::Tokenizer::from_file(fixture_dir().join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("{e}"))
        .token_to_id(text)
        .unwrap_or_else(|| panic!("no token {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_schema_keywords_are_refused_by_name() {
    let (_engine, gateway) = start().await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema":
            {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": true}}, "if": {}}}}});
    let response = post_json(gateway.address, "/v1/chat/completions", &body).await;
    assert_eq!(response.status, 400, "{}", response.text());
    let error = &response.json()["error"];
    assert_eq!(error["type"], "invalid_request_error");
    assert!(
        error["param"]
            .as_str()
            .unwrap()
            .starts_with("response_format"),
        "{error}"
    );
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("`uniqueItems` at #/properties/ids") && message.contains("`if` at #"),
        "{message}"
    );
    for bad in [json!({"type": "yaml"}), json!({"type": "json_schema"})] {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "response_format": bad});
        let response = post_json(gateway.address, "/v1/chat/completions", &body).await;
        assert_eq!(response.status, 400, "{}", response.text());
    }
    // A tool whose parameters the grammar cannot enforce, when its call is forced.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]});
    let response = post_json(gateway.address, "/v1/chat/completions", &body).await;
    assert_eq!(response.status, 400, "{}", response.text());
    assert!(
        response.text().contains("`not` at #"),
        "{}",
        response.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_gets_the_grammar_and_the_reasoning_block() {
    let (engine, gateway) = start().await;
    let think_end = token_id("</think>");
    // Thinking on (the template opens `<think>`): the grammar waits for the block's end.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
        "response_format": {"type": "json_object"}});
    let response = post_json(gateway.address, "/v1/chat/completions", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let request = engine.script.last_request();
    assert!(
        request.lark_grammar.contains("%json"),
        "{}",
        request.lark_grammar
    );
    let reasoning = request.reasoning.expect("a reasoning block");
    assert_eq!(reasoning.start_token_id, None);
    assert_eq!(reasoning.end_token_id, think_end);
    assert_eq!(reasoning.budget_tokens, 0);
    // Thinking off: the prompt closed the block, the grammar applies from the first token.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
        "chat_template_kwargs": {"enable_thinking": false},
        "tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "add"}}});
    let response = post_json(gateway.address, "/v1/chat/completions", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let request = engine.script.last_request();
    assert!(request.reasoning.is_none());
    // The fixture's template is Qwen3.5's: the XML tool-call syntax.
    assert!(
        request.lark_grammar.contains("<function=add>"),
        "{}",
        request.lark_grammar
    );
    assert!(
        !request.lark_grammar.contains("get_weather"),
        "{}",
        request.lark_grammar
    );
    // No constraint: nothing sent.
    let body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8});
    post_json(gateway.address, "/v1/chat/completions", &body).await;
    let request = engine.script.last_request();
    assert!(request.lark_grammar.is_empty() && request.reasoning.is_none());

    // Anthropic thinking with a budget: the engine closes the block after that many tokens.
    let body = json!({"model": MODEL, "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 5},
        "messages": [{"role": "user", "content": "Hi"}]});
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let reasoning = engine
        .script
        .last_request()
        .reasoning
        .expect("a reasoning block");
    assert_eq!(reasoning.budget_tokens, 5);
    assert!(
        reasoning.close_token_ids.contains(&think_end),
        "{reasoning:?}"
    );
    // Disabled: no block at all; a budget of zero: Anthropic's 400.
    let body = json!({"model": MODEL, "max_tokens": 64, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "Hi"}]});
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert!(engine.script.last_request().reasoning.is_none());
    let body = json!({"model": MODEL, "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 0},
        "messages": [{"role": "user", "content": "Hi"}]});
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 400, "{}", response.text());
    assert_eq!(response.json()["type"], "error");
    // Anthropic forced tool: the grammar names it.
    let body = json!({"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}],
        "tool_choice": {"type": "tool", "name": "lookup"}});
    let response = post_json(gateway.address, "/v1/messages", &body).await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert!(engine
        .script
        .last_request()
        .lark_grammar
        .contains("<function=lookup>"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_tool_calls_false_keeps_one_call() {
    let (engine, gateway) = start().await;
    let call = |city: &str| {
        format!("<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    };
    engine
        .script
        .set_text(&format!("</think>\n\n{}\n{}", call("Paris"), call("Rome")));
    for (parallel, expected) in [(json!(true), 2usize), (json!(false), 1)] {
        for stream in [false, true] {
            let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
                "tools": weather_tools(), "parallel_tool_calls": parallel, "stream": stream});
            let response = post_json(gateway.address, "/v1/chat/completions", &body).await;
            assert_eq!(response.status, 200, "{}", response.text());
            let calls: usize = if stream {
                response
                    .sse_events()
                    .iter()
                    .filter_map(|(_, data)| serde_json::from_str::<Value>(data).ok())
                    .filter_map(|chunk| {
                        chunk["choices"][0]["delta"]["tool_calls"]
                            .as_array()
                            .map(Vec::len)
                    })
                    .sum()
            } else {
                response.json()["choices"][0]["message"]["tool_calls"]
                    .as_array()
                    .map_or(0, Vec::len)
            };
            assert_eq!(
                calls,
                expected,
                "parallel {parallel} stream {stream}: {}",
                response.text()
            );
        }
    }
}
