//! The endpoints beside generation: models, tokenize and detokenize, metrics and expert
//! statistics; routing statistics across a gateway restart, engine restarts not counted twice.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::common::*;

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
