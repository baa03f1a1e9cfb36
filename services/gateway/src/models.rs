//! `GET /v1/models` and `GET /v1/models/{model}`: every model an engine has served since start,
//! with readiness, in the shape of the API that asks. Anthropic's SDKs share the path and send
//! `anthropic-version`: they get Anthropic's list shape; everyone else OpenAI's.
//!
//! Owns: choosing the dialect of the answer. Must not touch: the shapes (each dialect's file
//! writes its own).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::error::{ApiDialect, GatewayError};
use crate::state::GatewayState;

/// `GET /v1/models`.
pub async fn list_models(State(state): State<Arc<GatewayState>>, headers: HeaderMap) -> Response {
    let snapshot = state.backend.snapshot();
    let models = snapshot.models.values();
    if headers.contains_key("anthropic-version") {
        return Json(crate::anthropic::model_list_json(models)).into_response();
    }
    Json(crate::openai::model_list_json(models)).into_response()
}

/// `GET /v1/models/{model}`.
pub async fn get_model(
    State(state): State<Arc<GatewayState>>,
    Path(model): Path<String>,
) -> Response {
    match state.backend.snapshot().models.get(&model) {
        Some(served) => Json(crate::openai::model_json(served)).into_response(),
        None => GatewayError::ModelNotFound(model).into_response_for(ApiDialect::OpenAi),
    }
}
