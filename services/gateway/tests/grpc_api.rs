//! The public gRPC API on the gateway port: ListModels, Generate, GenerateStream, Chat,
//! ChatStream, grpc.health.v1 and server reflection, plus API-key enforcement.

mod common;

use std::sync::Arc;

use common::*;
use futures_util::StreamExt;
use ninfer_protocol::v1::gateway_client::GatewayClient;
use ninfer_protocol::v1::{
    ChatMessage, ChatRequest, GatewayFinishReason, GatewaySamplingOptions, ListModelsRequest,
    TextGenerationRequest,
};

async fn channel(address: std::net::SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .unwrap_or_else(|e| panic!("{e}"))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_grpc_api_health_and_reflection() {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    gateway.wait_for_health(200).await;
    let channel = channel(gateway.address).await;
    let mut client = GatewayClient::new(channel.clone());

    let models = client
        .list_models(ListModelsRequest {})
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(models.models[0].name, MODEL);
    assert_eq!(models.models[0].ready_engines, 1);

    engine.script.set_text("alpha beta gamma delta");
    let options = GatewaySamplingOptions {
        max_tokens: 50,
        stop: vec!["gamma".to_string()],
        ..Default::default()
    };
    let response = client
        .generate(TextGenerationRequest {
            model: MODEL.into(),
            prompt: "Say".into(),
            options: Some(options.clone()),
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(response.text, "alpha beta ");
    assert_eq!(response.finish_reason, GatewayFinishReason::Stop as i32);
    assert_eq!(response.matched_stop, "gamma");

    let mut stream = client
        .generate_stream(TextGenerationRequest {
            model: MODEL.into(),
            prompt: "Say".into(),
            options: Some(options),
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    let mut text = String::new();
    let mut last = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap_or_else(|e| panic!("{e}"));
        text.push_str(&chunk.text);
        last = Some(chunk);
    }
    assert_eq!(text, "alpha beta ");
    assert!(last
        .and_then(|c| c.usage)
        .is_some_and(|u| u.completion_tokens > 0));

    engine.script.set_text("weighing it</think>\n\nYes.");
    let chat = ChatRequest {
        model: MODEL.into(),
        messages: vec![ChatMessage {
            role: "user".into(),
            content: "Well?".into(),
            reasoning_content: String::new(),
            images: Vec::new(),
        }],
        options: None,
        enable_thinking: Some(true),
        chat_template_kwargs_json: String::new(),
    };
    let response = client
        .chat(chat.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(
        (
            response.reasoning_content.as_str(),
            response.content.as_str()
        ),
        ("weighing it", "Yes.")
    );
    let mut stream = client
        .chat_stream(chat.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    let (mut reasoning, mut content) = (String::new(), String::new());
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap_or_else(|e| panic!("{e}"));
        reasoning.push_str(&chunk.reasoning_content);
        content.push_str(&chunk.content);
    }
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("weighing it", "Yes.")
    );

    let unknown = client
        .chat(ChatRequest {
            model: "ghost".into(),
            ..chat.clone()
        })
        .await;
    assert_eq!(
        unknown.err().map(|status| status.code()),
        Some(tonic::Code::NotFound)
    );

    // grpc.health.v1 says SERVING for the whole server and for the Gateway service.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for service in ["", "ninfer.v1.Gateway"] {
        // The health service follows the pool a moment after /health does.
        let mut status = 0;
        for _ in 0..100 {
            status = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap_or_else(|e| panic!("health {service}: {e}"))
                .into_inner()
                .status;
            if status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "service {service:?}"
        );
    }

    // Reflection lists the services (what `grpcurl list` does).
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let channel_for_alpha = channel.clone();
    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(futures_util::stream::iter(vec![request]))
        .await
        .unwrap_or_else(|e| panic!("reflection: {e}"))
        .into_inner();
    let response = responses
        .next()
        .await
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("no reflection answer"));
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"ninfer.v1.Gateway".to_string()),
        "{names:?}"
    );
    // What `grpcurl describe` asks next: the file defining the service, no proto files needed.
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(
            "ninfer.v1.Gateway".into(),
        )),
    };
    let response = reflection
        .server_reflection_info(futures_util::stream::iter(vec![request]))
        .await
        .unwrap_or_else(|e| panic!("reflection: {e}"))
        .into_inner()
        .next()
        .await
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("no reflection answer"));
    let Some(MessageResponse::FileDescriptorResponse(files)) = response.message_response else {
        panic!("unexpected reflection answer: {response:?}")
    };
    // A FileDescriptorProto carries its file name and service names as plain strings.
    let contains =
        |bytes: &[u8], text: &str| bytes.windows(text.len()).any(|w| w == text.as_bytes());
    let described = files.file_descriptor_proto.iter().any(|bytes| {
        contains(bytes, "ninfer/v1/gateway.proto") && contains(bytes, "GenerateStream")
    });
    assert!(described, "no descriptor defines ninfer.v1.Gateway");
    // The older v1alpha protocol too.
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as Alpha;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as AlphaRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse as AlphaResponse;
    let request = tonic_reflection::pb::v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(AlphaRequest::ListServices(String::new())),
    };
    let response = Alpha::new(channel_for_alpha)
        .server_reflection_info(futures_util::stream::iter(vec![request]))
        .await
        .unwrap_or_else(|e| panic!("v1alpha reflection: {e}"))
        .into_inner()
        .next()
        .await
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("no v1alpha reflection answer"));
    let Some(AlphaResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected v1alpha answer")
    };
    assert!(list.service.iter().any(|s| s.name == "ninfer.v1.Gateway"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_needs_the_api_key_when_one_is_set() {
    let engine = RunningEngine::start(Arc::new(EngineScript::default()), None).await;
    let gateway = RunningGateway::start(
        &[engine.address],
        GatewayOptions {
            api_key: Some("k".into()),
            ..Default::default()
        },
    )
    .await;
    gateway.wait_for_health(200).await;
    let channel = channel(gateway.address).await;
    let mut client = GatewayClient::new(channel.clone());
    let refused = client.list_models(ListModelsRequest {}).await;
    assert_eq!(
        refused.err().map(|s| s.code()),
        Some(tonic::Code::Unauthenticated)
    );
    let mut request = tonic::Request::new(ListModelsRequest {});
    request.metadata_mut().insert(
        "authorization",
        "Bearer k".parse().unwrap_or_else(|e| panic!("{e}")),
    );
    assert!(client.list_models(request).await.is_ok());
    // Health stays open for probes.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    assert!(health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new()
        })
        .await
        .is_ok());
}
