//! Typed errors of the gateway and how each API dialect shows them to a client.
//!
//! Owns: the one error type every request path returns ([`GatewayError`]), its HTTP status, and the
//! two JSON envelopes (OpenAI `{"error":{...}}`, Anthropic `{"type":"error","error":{...}}`).
//! Must not touch: transport or logging decisions; handlers choose the dialect, this module only
//! renders.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Everything that can go wrong while serving one request, classified by who is at fault.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    /// The request body or a parameter is malformed (400). `parameter` names the offending field.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        parameter: Option<String>,
    },
    /// Missing or wrong API key (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The requested model is not served by any engine (404).
    #[error("The model `{0}` does not exist or is not served by this gateway")]
    ModelNotFound(String),
    /// Unknown route (404).
    #[error("{0}")]
    RouteNotFound(String),
    /// The body is larger than the configured limit (413).
    #[error("request body is larger than the limit of {limit_bytes} bytes")]
    BodyTooLarge { limit_bytes: usize },
    /// Prompt (+ requested completion) does not fit the model's context (400, naming the numbers).
    #[error("This model's maximum context length is {max_context} tokens. However, you requested {requested_total} tokens ({prompt_tokens} in the prompt, {completion_tokens} for the completion). Please reduce the length of the prompt or the completion.")]
    ContextLengthExceeded {
        max_context: u32,
        prompt_tokens: u32,
        completion_tokens: u32,
        requested_total: u64,
    },
    /// The gateway or the engine queue is full (OpenAI 429, Anthropic 529).
    #[error("{0}")]
    Overloaded(String),
    /// No engine is ready to serve the request (503).
    #[error("{0}")]
    NoEngineAvailable(String),
    /// The chat template refused the conversation (`raise_exception`) or failed to render (400).
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// Something broke inside the gateway or the engine (500).
    #[error("{0}")]
    Internal(String),
    /// The gateway is stopping: an answer still streaming at the drain deadline is cut with
    /// this (503 where a status can still be chosen).
    #[error("{0}")]
    ShuttingDown(String),
}

/// Which API's error envelope and status conventions to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiDialect {
    OpenAi,
    Anthropic,
}

impl GatewayError {
    pub fn invalid(message: impl Into<String>) -> Self {
        GatewayError::InvalidRequest {
            message: message.into(),
            parameter: None,
        }
    }

    pub fn invalid_parameter(parameter: &str, message: impl Into<String>) -> Self {
        GatewayError::InvalidRequest {
            message: message.into(),
            parameter: Some(parameter.to_string()),
        }
    }

    /// HTTP status for this error in the given dialect (only "overloaded" differs).
    pub fn status(&self, dialect: ApiDialect) -> StatusCode {
        match self {
            GatewayError::InvalidRequest { .. }
            | GatewayError::ChatTemplate(_)
            | GatewayError::ContextLengthExceeded { .. } => StatusCode::BAD_REQUEST,
            GatewayError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            GatewayError::ModelNotFound(_) | GatewayError::RouteNotFound(_) => {
                StatusCode::NOT_FOUND
            }
            GatewayError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::Overloaded(_) => match dialect {
                ApiDialect::OpenAi => StatusCode::TOO_MANY_REQUESTS,
                // Anthropic's documented "overloaded_error" status.
                ApiDialect::Anthropic => {
                    StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
                }
            },
            GatewayError::NoEngineAvailable(_) | GatewayError::ShuttingDown(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            GatewayError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI `error.type`.
    fn openai_type(&self) -> &'static str {
        match self {
            GatewayError::InvalidRequest { .. }
            | GatewayError::ChatTemplate(_)
            | GatewayError::ContextLengthExceeded { .. }
            | GatewayError::BodyTooLarge { .. }
            | GatewayError::ModelNotFound(_)
            | GatewayError::RouteNotFound(_) => "invalid_request_error",
            GatewayError::Unauthorized(_) => "authentication_error",
            GatewayError::Overloaded(_) => "rate_limit_error",
            GatewayError::NoEngineAvailable(_) | GatewayError::ShuttingDown(_) => {
                "service_unavailable"
            }
            GatewayError::Internal(_) => "server_error",
        }
    }

    /// OpenAI `error.code`: never null, so a client can tell errors apart also inside a stream
    /// that began with a 200.
    fn openai_code(&self) -> &'static str {
        match self {
            GatewayError::ModelNotFound(_) => "model_not_found",
            GatewayError::ContextLengthExceeded { .. } => "context_length_exceeded",
            GatewayError::Unauthorized(_) => "invalid_api_key",
            GatewayError::BodyTooLarge { .. } => "request_too_large",
            GatewayError::InvalidRequest { .. } | GatewayError::ChatTemplate(_) => {
                "invalid_request"
            }
            GatewayError::RouteNotFound(_) => "not_found",
            GatewayError::Overloaded(_) => "rate_limit_exceeded",
            GatewayError::NoEngineAvailable(_) => "service_unavailable",
            GatewayError::ShuttingDown(_) => "server_shutting_down",
            GatewayError::Internal(_) => "server_error",
        }
    }

    /// Anthropic `error.type`.
    fn anthropic_type(&self) -> &'static str {
        match self {
            GatewayError::InvalidRequest { .. }
            | GatewayError::ChatTemplate(_)
            | GatewayError::ContextLengthExceeded { .. } => "invalid_request_error",
            GatewayError::Unauthorized(_) => "authentication_error",
            GatewayError::ModelNotFound(_) | GatewayError::RouteNotFound(_) => "not_found_error",
            GatewayError::BodyTooLarge { .. } => "request_too_large",
            // Anthropic's word for "try again shortly", which a stopping gateway means too.
            GatewayError::Overloaded(_) | GatewayError::ShuttingDown(_) => "overloaded_error",
            GatewayError::NoEngineAvailable(_) | GatewayError::Internal(_) => "api_error",
        }
    }

    /// The message in Anthropic's words. Context overflows use the two sentences Anthropic's
    /// API answers with, which clients parse to shrink `max_tokens` or compact the conversation:
    /// "input length and `max_tokens` exceed context limit: P + M > L" and "prompt is too long:
    /// N tokens > M maximum".
    fn anthropic_message(&self) -> String {
        match self {
            GatewayError::ContextLengthExceeded {
                max_context,
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                if prompt_tokens > max_context {
                    format!("prompt is too long: {prompt_tokens} tokens > {max_context} maximum")
                } else {
                    format!(
                        "input length and `max_tokens` exceed context limit: {prompt_tokens} + {completion_tokens} > {max_context}, decrease input length or `max_tokens` and try again"
                    )
                }
            }
            _ => self.to_string(),
        }
    }

    /// The JSON body of this error in the given dialect.
    pub fn envelope(&self, dialect: ApiDialect) -> serde_json::Value {
        match dialect {
            ApiDialect::OpenAi => {
                let parameter = match self {
                    GatewayError::InvalidRequest { parameter, .. } => parameter.clone(),
                    GatewayError::ModelNotFound(_) => Some("model".to_string()),
                    _ => None,
                };
                json!({"error": {
                    "message": self.to_string(),
                    "type": self.openai_type(),
                    "param": parameter,
                    "code": self.openai_code(),
                }})
            }
            ApiDialect::Anthropic => json!({
                "type": "error",
                "error": {"type": self.anthropic_type(), "message": self.anthropic_message()},
            }),
        }
    }

    /// The full HTTP response (status + JSON envelope).
    pub fn into_response_for(self, dialect: ApiDialect) -> Response {
        let status = self.status(dialect);
        let mut response = (status, axum::Json(self.envelope(dialect))).into_response();
        if matches!(self, GatewayError::Overloaded(_)) {
            // Clients (the OpenAI and Anthropic SDKs among them) back off by this header.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }

    /// gRPC status for the public gRPC API.
    pub fn to_grpc_status(&self) -> tonic::Status {
        let message = self.to_string();
        match self {
            GatewayError::InvalidRequest { .. } | GatewayError::ChatTemplate(_) => {
                tonic::Status::invalid_argument(message)
            }
            GatewayError::ContextLengthExceeded { .. } => tonic::Status::out_of_range(message),
            GatewayError::Unauthorized(_) => tonic::Status::unauthenticated(message),
            GatewayError::ModelNotFound(_) | GatewayError::RouteNotFound(_) => {
                tonic::Status::not_found(message)
            }
            GatewayError::BodyTooLarge { .. } => tonic::Status::invalid_argument(message),
            GatewayError::Overloaded(_) => tonic::Status::resource_exhausted(message),
            GatewayError::NoEngineAvailable(_) | GatewayError::ShuttingDown(_) => {
                tonic::Status::unavailable(message)
            }
            GatewayError::Internal(_) => tonic::Status::internal(message),
        }
    }

    /// The last bytes of a server-sent-event stream on `path` that this error ends, in the
    /// shape that API's streams report errors: OpenAI chat and completions a `data:` error
    /// object (with its code) and `[DONE]`, the Responses API an `error` event, Anthropic an
    /// `error` event with its envelope.
    pub fn final_stream_event(&self, path: &str) -> String {
        if path.starts_with("/v1/messages") {
            let envelope = self.envelope(ApiDialect::Anthropic);
            return format!("event: error\ndata: {envelope}\n\n");
        }
        let envelope = self.envelope(ApiDialect::OpenAi);
        if path.starts_with("/v1/responses") {
            let detail = &envelope["error"];
            let event = json!({
                "type": "error",
                "code": detail["code"],
                "message": detail["message"],
                "param": detail["param"],
            });
            return format!("event: error\ndata: {event}\n\n");
        }
        format!("data: {envelope}\n\ndata: [DONE]\n\n")
    }
}

/// Maps an engine's gRPC status to the gateway's error, following the contract in engine.proto.
pub fn error_from_engine_status(status: &tonic::Status) -> GatewayError {
    let message = status.message().to_string();
    match status.code() {
        tonic::Code::ResourceExhausted => {
            GatewayError::Overloaded(format!("the engine is overloaded: {message}"))
        }
        tonic::Code::InvalidArgument | tonic::Code::OutOfRange => GatewayError::invalid(message),
        tonic::Code::NotFound => GatewayError::ModelNotFound(message),
        tonic::Code::Unavailable
        | tonic::Code::Cancelled
        | tonic::Code::DeadlineExceeded
        | tonic::Code::Unknown => {
            GatewayError::NoEngineAvailable(format!("the engine is unavailable: {message}"))
        }
        _ => GatewayError::Internal(format!("engine error ({:?}): {message}", status.code())),
    }
}

pub type GatewayResult<T> = Result<T, GatewayError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_openai_error_has_a_code() {
        let errors = [
            GatewayError::InvalidRequest {
                message: "bad".into(),
                parameter: None,
            },
            GatewayError::Unauthorized("no key".into()),
            GatewayError::ModelNotFound("m".into()),
            GatewayError::RouteNotFound("/x".into()),
            GatewayError::BodyTooLarge { limit_bytes: 1 },
            GatewayError::ContextLengthExceeded {
                max_context: 1,
                prompt_tokens: 2,
                completion_tokens: 0,
                requested_total: 2,
            },
            GatewayError::Overloaded("busy".into()),
            GatewayError::NoEngineAvailable("none".into()),
            GatewayError::ChatTemplate("refused".into()),
            GatewayError::Internal("broke".into()),
            GatewayError::ShuttingDown("stopping".into()),
        ];
        for error in errors {
            let envelope = error.envelope(ApiDialect::OpenAi);
            assert!(
                envelope["error"]["code"]
                    .as_str()
                    .is_some_and(|c| !c.is_empty()),
                "{error:?}: {envelope}"
            );
        }
    }
}
