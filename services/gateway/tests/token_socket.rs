//! An engine reached over a unix socket that also serves a token socket: answers come over the
//! token socket (refusals, stop strings and their cancellation as over gRPC); an engine on TCP
//! is called over gRPC whatever it reports.

mod common;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ninfer_protocol::v1::engine_server::EngineServer;
use serde_json::json;

/// The gRPC API of one scripted engine on `unix:DIR/engine.sock` and, beside it, a token socket
/// served by another (so an answer's text tells which way it came), on their own runtime.
struct UnixEngine {
    address: String,
    grpc: Arc<EngineScript>,
    tokens: Arc<EngineScript>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl UnixEngine {
    fn start(directory: &Path) -> UnixEngine {
        let grpc_path = directory.join("engine.sock");
        let address = format!("unix:{}", grpc_path.display());
        let token_path = ninfer_protocol::token_socket::path_beside(&address)
            .unwrap_or_else(|| panic!("no token socket beside {address}"));
        let grpc = Arc::new(EngineScript::default());
        grpc.set_text("Spoken over gRPC.");
        *grpc
            .token_socket_path
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = token_path.clone();
        let tokens = Arc::new(EngineScript::default());
        tokens.set_text("Spoken over the token socket.");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("engine runtime: {e}"));
        let (grpc_engine, token_engine) = (
            ScriptedEngine::new(grpc.clone()),
            Arc::new(ScriptedEngine::new(tokens.clone())),
        );
        let bind = |path: &Path| {
            let listener = std::os::unix::net::UnixListener::bind(path)
                .unwrap_or_else(|e| panic!("bind {}: {e}", path.display()));
            listener
                .set_nonblocking(true)
                .unwrap_or_else(|e| panic!("nonblocking: {e}"));
            listener
        };
        let (grpc_listener, token_listener) = (bind(&grpc_path), bind(Path::new(&token_path)));
        runtime.spawn(async move {
            let listener = tokio::net::UnixListener::from_std(grpc_listener)
                .unwrap_or_else(|e| panic!("listener: {e}"));
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(EngineServer::new(grpc_engine))
                .serve_with_incoming(incoming)
                .await;
        });
        runtime.spawn(async move {
            let listener = tokio::net::UnixListener::from_std(token_listener)
                .unwrap_or_else(|e| panic!("listener: {e}"));
            ninfer_protocol::token_socket::serve(
                listener,
                token_engine,
                None,
                std::future::pending(),
                Duration::ZERO,
            )
            .await;
        });
        UnixEngine {
            address,
            grpc,
            tokens,
            runtime: Some(runtime),
        }
    }
}

impl Drop for UnixEngine {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

fn streamed_content(response: &HttpResponse) -> String {
    response
        .sse_events()
        .iter()
        .filter_map(|(_, data)| serde_json::from_str::<serde_json::Value>(data).ok())
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect()
}

fn chat(stream: bool) -> serde_json::Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50,
           "stream": stream, "chat_template_kwargs": {"enable_thinking": false}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_of_an_engine_on_a_unix_socket_come_over_its_token_socket() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let engine = UnixEngine::start(directory.path());
    let gateway = RunningGateway::start_with_engine_addresses(
        std::slice::from_ref(&engine.address),
        GatewayOptions::default(),
    )
    .await;
    gateway.wait_for_health(200).await;
    let response = post_json(gateway.address, "/v1/chat/completions", &chat(true)).await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(streamed_content(&response), "Spoken over the token socket.");
    assert_eq!(
        response.sse_events().last().map(|(_, data)| data.as_str()),
        Some("[DONE]")
    );
    let response = post_json(gateway.address, "/v1/chat/completions", &chat(false)).await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(
        response.json()["choices"][0]["message"]["content"],
        "Spoken over the token socket."
    );
    assert_eq!(
        response.json()["usage"]["completion_tokens"],
        count_tokens("Spoken over the token socket.") + 1
    );
    assert_eq!(engine.grpc.generations.load(Ordering::SeqCst), 0);
    assert_eq!(engine.tokens.generations.load(Ordering::SeqCst), 2);
    // A refusal before the first token still picks the HTTP status, as over gRPC.
    engine.tokens.overloaded.store(true, Ordering::SeqCst);
    let response = post_json(gateway.address, "/v1/chat/completions", &chat(true)).await;
    assert_eq!(response.status, 429, "{}", response.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_closes_the_token_socket_and_the_engine_drops_the_generation() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let engine = UnixEngine::start(directory.path());
    engine
        .tokens
        .set_text("The quick brown fox jumps over the lazy dog and keeps running far away.");
    engine.tokens.set_delay(Duration::from_millis(5));
    let gateway = RunningGateway::start_with_engine_addresses(
        std::slice::from_ref(&engine.address),
        GatewayOptions::default(),
    )
    .await;
    gateway.wait_for_health(200).await;
    let response = post_json(
        gateway.address,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Once", "max_tokens": 200, "stop": ["fox jumps"], "stream": true}),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let text: String = response
        .sse_events()
        .iter()
        .filter_map(|(_, data)| serde_json::from_str::<serde_json::Value>(data).ok())
        .filter_map(|chunk| chunk["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, "The quick brown ");
    // Bounded wait: the engine notices the closed connection at its next token.
    for _ in 0..500 {
        if engine.tokens.dropped_streams.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(engine.tokens.dropped_streams.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_on_tcp_is_called_over_grpc_whatever_token_socket_it_reports() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    // The unix engine's token socket exists, but the TCP engine only reports its path.
    let unix_engine = UnixEngine::start(directory.path());
    let script = Arc::new(EngineScript::default());
    script.set_text("Spoken over gRPC.");
    *script
        .token_socket_path
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = unix_engine
        .grpc
        .token_socket_path
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let engine = RunningEngine::start(script, None).await;
    let gateway = RunningGateway::start(&[engine.address], GatewayOptions::default()).await;
    gateway.wait_for_health(200).await;
    let response = post_json(gateway.address, "/v1/chat/completions", &chat(true)).await;
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(streamed_content(&response), "Spoken over gRPC.");
    assert_eq!(unix_engine.tokens.generations.load(Ordering::SeqCst), 0);
}
