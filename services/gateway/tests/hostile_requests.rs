//! Acceptance: 100 malformed or hostile requests each get a 4xx in the right envelope, the
//! gateway stays up, and a normal request afterwards succeeds.

mod common;

use std::sync::Arc;

use common::*;
use serde_json::json;

/// (path, body bytes, extra headers) of one hostile request.
type Hostile = (&'static str, Vec<u8>, Vec<(&'static str, String)>);

fn hostile_requests() -> Vec<Hostile> {
    let mut requests: Vec<Hostile> = Vec::new();
    let chat = "/v1/chat/completions";
    let completions = "/v1/completions";
    let messages = "/v1/messages";
    let count = "/v1/messages/count_tokens";
    let user = json!([{"role": "user", "content": "Hi"}]);
    let bodies_for_every_endpoint: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"{".to_vec(),
        b"not json at all".to_vec(),
        b"[]".to_vec(),
        b"null".to_vec(),
        b"42".to_vec(),
        b"\"a string\"".to_vec(),
        b"{\"model\": \xff\xfe}".to_vec(),
        vec![0xc3, 0x28, 0xa0, 0xa1],
        b"{\"model\": \"test-model\", \"messages\": [{\"role\": \"user\", \"content\": \"\xed\xa0\x80\"}]}".to_vec(),
        b"{\"model\": \"test-model\",,}".to_vec(),
        b"{\"model\": \"test-model\", \"messages\": \"\\ud800\"}".to_vec(),
        br#"{"model": {"nested": true}}"#.to_vec(),
        br#"{"model": "test-model", "messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": "ten"}"#.to_vec(),
        "{\"a\":".repeat(200).into_bytes(),
        vec![b'{'; 5000],
    ];
    for body in &bodies_for_every_endpoint {
        for path in [chat, completions, messages, count] {
            requests.push((path, body.clone(), Vec::new()));
        }
    }
    // 64 so far. Wrong types and out-of-range values.
    let chat_cases = [
        json!({"model": "test-model", "messages": user, "max_tokens": -1}),
        json!({"model": "test-model", "messages": user, "max_tokens": 0}),
        json!({"model": "test-model", "messages": user, "max_tokens": 1_000_000_000_000_i64}),
        json!({"model": "test-model", "messages": user, "max_completion_tokens": 99_999_999}),
        json!({"model": "test-model", "messages": user, "temperature": "hot"}),
        json!({"model": "test-model", "messages": user, "temperature": -1.0}),
        json!({"model": "test-model", "messages": user, "top_p": 7}),
        json!({"model": "test-model", "messages": user, "top_k": -5}),
        json!({"model": "test-model", "messages": user, "n": 0}),
        json!({"model": "test-model", "messages": user, "n": 1000}),
        json!({"model": "test-model", "messages": user, "stop": 17}),
        json!({"model": "test-model", "messages": user, "stop": vec!["a"; 40]}),
        json!({"model": "test-model", "messages": user, "top_logprobs": 500, "logprobs": true}),
        json!({"model": "test-model", "messages": []}),
        json!({"model": "test-model", "messages": [{"role": "wizard", "content": "x"}]}),
        json!({"model": "test-model", "messages": [{"content": "no role"}]}),
        json!({"model": "test-model", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        json!({"model": "test-model", "messages": [{"role": "system", "content": "only system"}]}),
        json!({"model": "no-such-model", "messages": user}),
        json!({"messages": user}),
        json!({"model": "test-model", "messages": user, "chat_template_kwargs": [1, 2]}),
        json!({"model": "test-model", "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}, {"role": "user", "content": "x"}]}),
    ];
    for case in chat_cases {
        requests.push((chat, case.to_string().into_bytes(), Vec::new()));
    }
    let completion_cases = [
        json!({"model": "test-model", "prompt": "x", "max_tokens": -100}),
        json!({"model": "test-model", "prompt": "x", "max_tokens": 1e300}),
        json!({"model": "test-model", "prompt": [1, 2, 999_999]}),
        json!({"model": "test-model", "prompt": ["a", "b"]}),
        json!({"model": "test-model", "prompt": ""}),
        json!({"model": "test-model", "prompt": 5}),
        json!({"model": "ghost", "prompt": "x"}),
    ];
    for case in completion_cases {
        requests.push((completions, case.to_string().into_bytes(), Vec::new()));
    }
    let message_cases = [
        json!({"model": "test-model", "messages": user}),
        json!({"model": "test-model", "max_tokens": -3, "messages": user}),
        json!({"model": "test-model", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
        json!({"model": "test-model", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
        json!({"model": "test-model", "max_tokens": 5, "messages": user, "top_k": -1}),
        json!({"model": "unknown", "max_tokens": 5, "messages": user}),
    ];
    for case in message_cases {
        requests.push((messages, case.to_string().into_bytes(), Vec::new()));
    }
    // A 10 MB body (the test gateway's limit is 1 MiB).
    let mut huge = br#"{"model": "test-model", "prompt": ""#.to_vec();
    huge.extend(std::iter::repeat_n(b'a', 10 * 1024 * 1024));
    huge.extend_from_slice(br#""}"#);
    requests.push((completions, huge.clone(), Vec::new()));
    requests.push((messages, huge, Vec::new()));
    requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_hostile_requests_get_4xx_in_the_right_envelope_and_the_gateway_survives() {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    gateway.wait_for_health(200).await;
    let requests = hostile_requests();
    assert!(
        requests.len() >= 100,
        "only {} hostile requests",
        requests.len()
    );
    let mut statuses = std::collections::BTreeMap::new();
    for (index, (path, body, headers)) in requests.iter().enumerate() {
        let mut header_refs: Vec<(&str, &str)> =
            headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        header_refs.push(("content-type", "application/json"));
        let response = request(gateway.address, "POST", path, &header_refs, body).await;
        let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).to_string();
        assert!(
            (400..500).contains(&response.status),
            "#{index} {path} {shown:?}: status {} body {}",
            response.status,
            response.text()
        );
        let envelope: serde_json::Value =
            serde_json::from_slice(&response.body).unwrap_or_else(|e| {
                panic!(
                    "#{index} {path} {shown:?}: body not JSON ({e}): {}",
                    response.text()
                )
            });
        if path.starts_with("/v1/messages") {
            assert_eq!(
                envelope["type"], "error",
                "#{index} {path} {shown:?}: {envelope}"
            );
            assert!(
                envelope["error"]["type"].is_string() && envelope["error"]["message"].is_string(),
                "#{index}: {envelope}"
            );
        } else {
            let error = &envelope["error"];
            assert!(
                error["message"].is_string() && error["type"].is_string(),
                "#{index} {path} {shown:?}: {envelope}"
            );
            assert!(
                error.get("param").is_some() && error.get("code").is_some(),
                "#{index}: {envelope}"
            );
        }
        *statuses.entry(response.status).or_insert(0) += 1;
    }
    eprintln!("{} hostile requests, statuses {statuses:?}", requests.len());
    assert!(
        statuses.contains_key(&404) && statuses.contains_key(&413) && statuses.contains_key(&400),
        "{statuses:?}"
    );
    // Still up, and a normal request works.
    gateway.wait_for_health(200).await;
    let response = post_json(
        gateway.address,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let response = post_json(
        gateway.address,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_methods_answer_in_an_envelope() {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    let response = get(gateway.address, "/v1/nothing").await;
    assert_eq!(response.status, 404);
    assert!(response.json()["error"]["message"].is_string());
    let response = get(gateway.address, "/v1/messages").await;
    assert_eq!(response.status, 405);
    assert_eq!(response.json()["type"], "error");
}
