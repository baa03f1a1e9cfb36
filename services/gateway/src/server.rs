//! Assembles the gateway: the HTTP router (OpenAI, Anthropic, utility routes), the public gRPC
//! services on the same port, authentication, body limits and request metrics.
//!
//! Owns: [`build_router`], [`serve`], the API-key check,
//! and the small utility routes (`/health`, `/metrics`, `/tokenize`, `/detokenize`,
//! `/v1/stats/experts`).
//! Must not touch: generation logic (see `generation`) or API request shapes (see `openai`,
//! `openai_completions`, `anthropic`, `responses`, `grpc_api`, `models`).

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tower::ServiceExt;

use crate::connections::{serve_connections, ConnectionLimits};
use crate::error::{ApiDialect, GatewayError};
use crate::json_body::parse_json_body;
use crate::request_body::JsonRequestBody;
use crate::state::GatewayState;

/// The whole service: HTTP routes plus gRPC (public API, health, reflection) on one port.
pub fn build_router(state: Arc<GatewayState>) -> Router {
    // gRPC calls never match an HTTP route: they reach the fallback, which hands anything with a
    // gRPC content type to the tonic services (public API, health, reflection).
    let grpc_router = crate::grpc_api::grpc_routes(state.clone());
    let fallback = move |request: Request| {
        let grpc_router = grpc_router.clone();
        async move {
            if is_grpc_request(&request) {
                match grpc_router.oneshot(request).await {
                    Ok(response) => response.into_response(),
                    Err(never) => match never {},
                }
            } else {
                route_not_found(request).await
            }
        }
    };
    Router::new()
        .route(
            "/v1/chat/completions",
            post(crate::openai::chat_completions),
        )
        .route(
            "/v1/completions",
            post(crate::openai_completions::completions),
        )
        .route("/v1/responses", post(crate::responses::create_response))
        .route("/v1/responses/{id}", get(crate::responses::get_response))
        .route("/v1/models", get(crate::models::list_models))
        .route("/v1/models/{model}", get(crate::models::get_model))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        // Clients check that a server is there with `HEAD /` (GET answers HEAD too).
        .route("/", get(root))
        .route("/metrics", get(metrics))
        .route("/v1/stats/experts", get(expert_statistics))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.settings.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            authenticate_and_count,
        ))
        .with_state(state)
}

fn is_grpc_request(request: &Request) -> bool {
    request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|content_type| content_type.starts_with("application/grpc"))
}

/// Binds nothing itself: serves `router` on an already bound listener until `shutdown` resolves,
/// within the default [`ConnectionLimits`], then drains (see [`serve_connections`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_connections(listener, router, shutdown, ConnectionLimits::default()).await
}

/// Which error envelope a path speaks.
pub fn dialect_for_path(path: &str) -> ApiDialect {
    if path.starts_with("/v1/messages") {
        ApiDialect::Anthropic
    } else {
        ApiDialect::OpenAi
    }
}

/// Paths anyone may call (probes and scrapers).
fn is_public_path(path: &str) -> bool {
    path == "/health"
        || path == "/"
        || path == "/metrics"
        || path.starts_with("/grpc.health.v1.")
        || path.starts_with("/grpc.reflection.")
}

fn presented_api_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(value) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(value.trim());
    }
    let authorization = headers.get("authorization").and_then(|v| v.to_str().ok())?;
    authorization
        .strip_prefix("Bearer ")
        .or_else(|| authorization.strip_prefix("bearer "))
        .map(str::trim)
}

/// Constant-time comparison, so the key cannot be guessed byte by byte from timings.
fn keys_match(presented: &str, expected: &str) -> bool {
    let (a, b) = (presented.as_bytes(), expected.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn authenticate_and_count(
    State(state): State<Arc<GatewayState>>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path().to_string();
    let is_grpc = is_grpc_request(&request);
    if let Some(expected) = &state.settings.api_key {
        if !is_public_path(&path) {
            let authorized =
                presented_api_key(request.headers()).is_some_and(|key| keys_match(key, expected));
            if !authorized {
                let error = GatewayError::Unauthorized(
                    "Invalid or missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`".to_string(),
                );
                if is_grpc {
                    return grpc_error_response(tonic::Code::Unauthenticated, &error.to_string());
                }
                let response = error.into_response_for(dialect_for_path(&path));
                state
                    .metrics
                    .record_request(&metric_endpoint(&path), response.status().as_u16());
                return response;
            }
        }
    }
    let method = request.method().clone();
    let started = std::time::Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16();
    let endpoint = if is_grpc {
        "grpc".to_string()
    } else {
        metric_endpoint(&path)
    };
    state.metrics.record_request(&endpoint, status);
    tracing::debug!(%method, %path, status, elapsed_ms = started.elapsed().as_millis() as u64, "request");
    response
}

/// A gRPC "trailers-only" error response.
fn grpc_error_response(code: tonic::Code, message: &str) -> Response {
    let mut response = StatusCode::OK.into_response();
    let headers = response.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(code as i32));
    if let Ok(value) = HeaderValue::from_str(message) {
        headers.insert("grpc-message", value);
    }
    response
}

/// Known endpoints by name; anything else is one label, so clients cannot blow up the label set.
fn metric_endpoint(path: &str) -> String {
    const KNOWN: [&str; 12] = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/models",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/v1/stats/experts",
        "/ninfer.v1.Gateway",
    ];
    KNOWN
        .iter()
        .find(|known| path == **known)
        .map(|known| known.to_string())
        .unwrap_or_else(|| "other".to_string())
}

async fn route_not_found(request: Request) -> Response {
    let path = request.uri().path().to_string();
    GatewayError::RouteNotFound(format!("no route for {} {path}", request.method()))
        .into_response_for(dialect_for_path(&path))
}

async fn method_not_allowed(request: Request) -> Response {
    let path = request.uri().path().to_string();
    let error = GatewayError::invalid(format!(
        "method {} is not allowed on {path}",
        request.method()
    ));
    let mut response = error.into_response_for(dialect_for_path(&path));
    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    response
}

/// What this server is: a name and where its health is; never waits on an engine.
async fn root() -> Response {
    Json(json!({"service": "ninfer", "version": env!("CARGO_PKG_VERSION"), "health": "/health"}))
        .into_response()
}

/// 200 when at least one engine is ready, 503 otherwise. The body lists the engines (their
/// addresses, models and errors) only to callers with the API key when one is set: a probe
/// learns ok / not ready, nothing about the deployment.
async fn health(State(state): State<Arc<GatewayState>>, headers: HeaderMap) -> Response {
    let snapshot = state.backend.snapshot();
    let ready = snapshot.any_engine_ready();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let status_word = if ready { "ok" } else { "unavailable" };
    let shows_detail = match &state.settings.api_key {
        Some(expected) => presented_api_key(&headers).is_some_and(|key| keys_match(key, expected)),
        None => true,
    };
    if !shows_detail {
        return (status, Json(json!({"status": status_word}))).into_response();
    }
    let engines: Vec<_> = snapshot
        .engines
        .iter()
        .map(|engine| {
            json!({
                "address": engine.address,
                "ready": engine.ready,
                "model": engine.model_name,
                "in_flight_requests": engine.in_flight_requests,
                "error": engine.last_error,
            })
        })
        .collect();
    (
        status,
        Json(json!({"status": status_word, "engines": engines})),
    )
        .into_response()
}

async fn metrics(State(state): State<Arc<GatewayState>>) -> Response {
    let snapshot = state.backend.snapshot();
    // The state directory keeps totals of every model it ever served; show this server's.
    let routing: Vec<_> = match &state.routing_stats {
        Some(store) => store.snapshot().await,
        None => Vec::new(),
    }
    .into_iter()
    .filter(|totals| snapshot.models.contains_key(&totals.model))
    .collect();
    let text = state
        .metrics
        .render(&snapshot, &routing, state.backend.resume_counts());
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

async fn expert_statistics(State(state): State<Arc<GatewayState>>) -> Response {
    let models = match &state.routing_stats {
        Some(store) => store.snapshot().await,
        None => Vec::new(),
    };
    Json(json!({"object": "list", "data": models})).into_response()
}

#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    /// Raw text to encode.
    prompt: Option<String>,
    /// Or a conversation, rendered with the chat template first.
    messages: Option<Vec<crate::openai::OpenAiMessage>>,
    #[serde(default = "default_true")]
    add_special_tokens: bool,
    #[serde(default = "default_true")]
    add_generation_prompt: bool,
}

fn default_true() -> bool {
    true
}

/// The model a utility request means: the named one, or the only one served.
pub fn pick_model(
    state: &GatewayState,
    requested: Option<&str>,
) -> Result<crate::backend::ServedModel, GatewayError> {
    let snapshot = state.backend.snapshot();
    match requested {
        Some(name) => snapshot.resolve_model(name),
        None => match snapshot
            .models
            .values()
            .find(|model| model.ready_engines > 0)
        {
            Some(model) => Ok(model.clone()),
            None => Err(GatewayError::NoEngineAvailable(
                "no engine is ready; retry when /health is 200".to_string(),
            )),
        },
    }
}

async fn tokenize(State(state): State<Arc<GatewayState>>, body: JsonRequestBody) -> Response {
    let result = async {
        let request: TokenizeRequest = parse_json_body(body)?;
        let model = pick_model(&state, request.model.as_deref())?;
        let tokens = match (request.prompt, request.messages) {
            (Some(prompt), None) => crate::generation_plan::encode_text(&model, prompt, request.add_special_tokens).await?,
            (None, Some(messages)) => {
                let conversation = crate::openai::chat_conversation(&messages, None, request.add_generation_prompt, None)?;
                crate::generation_plan::build_chat_prompt(&model, &conversation.template_input()?).await?.1
            }
            _ => return Err(GatewayError::invalid("give exactly one of `prompt` or `messages`")),
        };
        Ok(json!({"model": model.name, "count": tokens.len(), "max_model_len": model.resources.max_context, "tokens": tokens}))
    }
    .await;
    match result {
        Ok(body) => Json(body).into_response(),
        Err(error) => error.into_response_for(ApiDialect::OpenAi),
    }
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
    /// Drop special tokens (`<|im_end|>`...) as generated text does; default keeps them.
    #[serde(default)]
    skip_special_tokens: bool,
}

async fn detokenize(State(state): State<Arc<GatewayState>>, body: JsonRequestBody) -> Response {
    let result = (|| {
        let request: DetokenizeRequest = parse_json_body(body)?;
        let model = pick_model(&state, request.model.as_deref())?;
        let text = model
            .resources
            .tokenizer
            .decode(&request.tokens, request.skip_special_tokens)?;
        Ok::<_, GatewayError>(json!({"model": model.name, "prompt": text}))
    })();
    match result {
        Ok(body) => Json(body).into_response(),
        Err(error) => error.into_response_for(ApiDialect::OpenAi),
    }
}
