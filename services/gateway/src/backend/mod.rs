//! The seam between the HTTP/gRPC front and whatever generates tokens.
//!
//! Owns: the [`GenerationBackend`] trait (like the TGI router's `Backend`), the snapshot type that
//! describes served models and engines, and the per-model resources (tokenizer, chat template,
//! defaults) every API needs.
//! Must not touch: HTTP, JSON or API dialects (handlers do), or engine connections (the
//! implementation in [`engine_pool`] does).

pub mod engine_pool;
pub mod poll_schedule;
mod pool_actor;
pub mod resume;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::Stream;
use ninfer_protocol::v1::{EngineStatus, GenerateRequest, GeneratedToken, GenerationDefaults};

use crate::chat_template::ChatTemplate;
use crate::error::GatewayError;
use crate::structured::ToolCallSyntax;
use crate::tokenizer::{ModelTokenizer, TypedControlTokens};

/// Tokens of one generation, in order. Dropping it before the end cancels the generation.
pub type TokenStream = Pin<Box<dyn Stream<Item = Result<GeneratedToken, GatewayError>> + Send>>;

/// Something that turns token ids into a token stream: one or more engines, or a test double.
pub trait GenerationBackend: Send + Sync + 'static {
    /// Starts a generation. Errors that happen before the first token (no engine, overloaded,
    /// prompt rejected) come back here, so handlers can still choose the HTTP status.
    fn generate(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'static, Result<TokenStream, GatewayError>>;

    /// What is served right now (never blocks).
    fn snapshot(&self) -> Arc<BackendSnapshot>;

    /// A receiver that wakes on every new snapshot, where the backend publishes them (the
    /// engine pool does); `None`: watchers poll [`GenerationBackend::snapshot`] instead.
    fn snapshot_changes(&self) -> Option<tokio::sync::watch::Receiver<Arc<BackendSnapshot>>> {
        None
    }

    /// Answers continued after their engine went away, and those that could not be.
    fn resume_counts(&self) -> ResumeCounts {
        ResumeCounts::default()
    }
}

/// Answers resumed after their engine went away, and resumptions that gave up (`/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResumeCounts {
    pub resumed: u64,
    pub abandoned: u64,
}

/// Files and settings of one model, fetched once from an engine (`GetModelFiles`).
pub struct ModelResources {
    pub model_name: String,
    pub tokenizer: ModelTokenizer,
    /// `None` when the model has no chat template (chat endpoints answer 400).
    pub chat_template: Option<ChatTemplate>,
    /// Why there is no chat template (missing, or it does not compile); chat requests get it.
    pub chat_template_problem: Option<String>,
    pub generation_defaults: GenerationDefaults,
    pub eos_token_ids: Vec<u32>,
    pub max_context: u32,
    /// `bos_token`, `eos_token`, ... from tokenizer_config.json, passed to the template.
    pub special_tokens: Vec<(String, String)>,
    pub files_digest: String,
    /// How the chat template teaches the model to write tool calls (forced calls use it).
    pub tool_call_syntax: ToolCallSyntax,
    /// What the model's images need; `None`: it reads text only.
    pub vision: Option<crate::images::ModelVision>,
}

impl ModelResources {
    /// Builds the resources from the engine's `ModelFiles` message (parses tokenizer and template).
    /// Prompts longer than the model's context are refused by the tokenizer before it does work
    /// in proportion to their length; `typed_control_tokens` says how control tokens typed in
    /// chat messages are encoded.
    pub fn from_model_files(
        files: &ninfer_protocol::v1::ModelFiles,
        typed_control_tokens: TypedControlTokens,
    ) -> Result<Self, GatewayError> {
        let tokenizer = ModelTokenizer::from_json_bytes(&files.tokenizer_json)?
            .with_token_limit(files.max_context as usize)
            .with_typed_control_tokens(typed_control_tokens);
        // A template minijinja cannot compile must not keep the model off the air: raw
        // completions still work, chat requests get the compile error.
        let (chat_template, chat_template_problem) = if files.chat_template.trim().is_empty() {
            (None, Some("the model ships no chat template".to_string()))
        } else {
            match ChatTemplate::compile(&files.chat_template) {
                Ok(template) => (Some(template), None),
                Err(error) => {
                    tracing::warn!(model = %files.model_name, %error, "chat template unusable");
                    (None, Some(error.to_string()))
                }
            }
        };
        let special_tokens = special_tokens_from_config(&files.tokenizer_config_json);
        let mut eos_token_ids = files.eos_token_ids.clone();
        if eos_token_ids.is_empty() {
            // Fall back to the conventional Qwen end-of-turn tokens the tokenizer knows.
            eos_token_ids = ["<|im_end|>", "<|endoftext|>"]
                .iter()
                .filter_map(|token| tokenizer.token_to_id(token))
                .collect();
        }
        let vision = crate::images::ModelVision::from_model_files(
            &files.preprocessor_config_json,
            &files.video_preprocessor_config_json,
            &tokenizer,
        )?;
        Ok(ModelResources {
            model_name: files.model_name.clone(),
            vision,
            tokenizer,
            chat_template,
            chat_template_problem,
            generation_defaults: files.generation_defaults.unwrap_or_default(),
            eos_token_ids,
            max_context: files.max_context,
            special_tokens,
            files_digest: files.model_files_digest.clone(),
            tool_call_syntax: ToolCallSyntax::of_template(&files.chat_template),
        })
    }
}

/// transformers passes the tokenizer's special tokens (`bos_token`, `eos_token`, `pad_token`,
/// `unk_token`) to the template; they are strings or `{"content": ...}` objects in the config.
fn special_tokens_from_config(config_json: &str) -> Vec<(String, String)> {
    let Ok(config) = serde_json::from_str::<serde_json::Value>(config_json) else {
        return Vec::new();
    };
    let mut tokens = Vec::new();
    for name in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        let text = match config.get(name) {
            Some(serde_json::Value::String(text)) => Some(text.clone()),
            Some(serde_json::Value::Object(object)) => object
                .get("content")
                .and_then(|c| c.as_str())
                .map(str::to_string),
            _ => None,
        };
        if let Some(text) = text {
            tokens.push((name.to_string(), text));
        }
    }
    tokens
}

/// A model as the APIs see it.
#[derive(Clone)]
pub struct ServedModel {
    pub name: String,
    pub architecture: String,
    pub created_unix_seconds: u64,
    pub resources: Arc<ModelResources>,
    /// Engines serving this model that are ready now (0 = known but down: 503).
    pub ready_engines: usize,
}

/// One engine as the pool last saw it.
#[derive(Clone, Debug, Default)]
pub struct EngineReport {
    pub address: String,
    pub ready: bool,
    pub model_name: Option<String>,
    pub status: Option<EngineStatus>,
    pub in_flight_requests: u32,
    pub last_error: Option<String>,
}

/// Everything handlers need to know about the backend at one instant.
#[derive(Clone, Default)]
pub struct BackendSnapshot {
    pub models: BTreeMap<String, ServedModel>,
    pub engines: Vec<EngineReport>,
}

impl BackendSnapshot {
    /// True when at least one engine can take requests (`/health` is 200).
    pub fn any_engine_ready(&self) -> bool {
        self.engines.iter().any(|engine| engine.ready)
    }

    /// Finds the model a request names: 404 when unknown (and something is up), 503 when nothing is
    /// ready or the model's engines are all down.
    pub fn resolve_model(&self, requested: &str) -> Result<ServedModel, GatewayError> {
        match self.models.get(requested) {
            Some(model) if model.ready_engines > 0 => Ok(model.clone()),
            Some(model) => Err(GatewayError::NoEngineAvailable(format!(
                "no engine serving `{}` is ready; retry when /health is 200",
                model.name
            ))),
            None if !self.any_engine_ready() => Err(GatewayError::NoEngineAvailable(
                "no engine is ready; retry when /health is 200".to_string(),
            )),
            None => Err(GatewayError::ModelNotFound(requested.to_string())),
        }
    }
}
