//! The Anthropic-compatible API: `POST /v1/messages` and `/v1/messages/count_tokens`.
//!
//! Owns: Anthropic request/response shapes (system prompt — the `system` field and `system`
//! messages anywhere in `messages` — content blocks, `thinking`,
//! `tool_use`/`tool_result`, images (in user messages and tool results) for a model that sees
//! them or stood in for as text, documents stood in for as text, `stop_sequences`),
//! their mapping to the neutral chat model and
//! [`SamplingOptions`], the exact streaming event sequence (`message_start`, `ping`,
//! `content_block_start`/`content_block_delta`/`content_block_stop`, `message_delta`,
//! `message_stop`), Anthropic's model list and Anthropic error envelopes.
//! Must not touch: other APIs' shapes, planning (`generation_plan`), engine selection,
//! stop-string or detokenization logic (see `generation`).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value as JsonValue};

use crate::anthropic_stream_deltas::{anthropic_block_delta, AnthropicDelta};
use crate::backend::ServedModel;
use crate::chat::{
    ChatContent, ChatContentPart, ChatConversation, ChatMessage, ChatRole, ChatTool, ChatToolCall,
    NonTextContent, ToolChoice,
};
use crate::error::{ApiDialect, GatewayError};
use crate::event_stream::{event_stream_response, Event};
use crate::generation::{
    collect_generation, ChoiceReceiver, FinishKind, GenerationEvent, GenerationSummary,
};
use crate::generation_plan::{
    build_chat_prompt_with_images, token_count_parameter, ChatGenerationRequest, SamplingOptions,
};
use crate::images::ChatImagePart;
use crate::inline_stream::InlineStream;
use crate::json_body::parse_json_body;
use crate::request_body::JsonRequestBody;
use crate::state::GatewayState;
use crate::tool_calls::{split_tool_calls, AnswerEnd, ToolCallCapture};

/// A string, or a list of content blocks.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum AnthropicContent {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

/// Any content block; which fields matter depends on `type`.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentBlock {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub thinking: Option<String>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub input: Option<minijinja::Value>,
    #[serde(default)]
    pub tool_use_id: Option<String>,
    #[serde(default)]
    pub content: Option<Box<AnthropicContent>>,
    /// Of `image` and `document` blocks.
    #[serde(default)]
    pub source: Option<serde_json::Map<String, JsonValue>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct AnthropicMessage {
    pub role: String,
    pub content: AnthropicContent,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ThinkingConfig {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub budget_tokens: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct AnthropicTool {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub input_schema: Option<minijinja::Value>,
}

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    pub messages: Vec<AnthropicMessage>,
    #[serde(default)]
    pub system: Option<AnthropicContent>,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub thinking: Option<ThinkingConfig>,
    #[serde(default)]
    pub tools: Option<Vec<AnthropicTool>>,
    #[serde(default)]
    pub tool_choice: Option<AnthropicToolChoice>,
}

/// `{"type": "auto" | "any" | "tool" | "none", "name": ...}`.
#[derive(Debug, Clone, Deserialize)]
pub struct AnthropicToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub name: Option<String>,
    /// `true`: at most one tool call.
    #[serde(default)]
    pub disable_parallel_tool_use: Option<bool>,
}

impl AnthropicToolChoice {
    fn to_tool_choice(&self) -> Result<ToolChoice, GatewayError> {
        match (self.kind.as_str(), &self.name) {
            ("auto", _) => Ok(ToolChoice::Auto),
            ("none", _) => Ok(ToolChoice::None),
            ("any", _) => Ok(ToolChoice::Required),
            ("tool", Some(name)) => Ok(ToolChoice::Function(name.clone())),
            ("tool", None) => Err(GatewayError::invalid_parameter(
                "tool_choice",
                "tool_choice.name: Field required",
            )),
            (other, _) => Err(GatewayError::invalid_parameter(
                "tool_choice",
                format!("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none', got '{other}'"),
            )),
        }
    }
}

fn anthropic_error(error: GatewayError) -> Response {
    error.into_response_for(ApiDialect::Anthropic)
}

/// Concatenated text of blocks of type `text` (and of a plain string).
fn plain_text(content: &AnthropicContent, where_: &str) -> Result<String, GatewayError> {
    match content {
        AnthropicContent::Text(text) => Ok(text.clone()),
        AnthropicContent::Blocks(blocks) => {
            let mut text = String::new();
            for block in blocks {
                match block.kind.as_str() {
                    "text" => text.push_str(block.text.as_deref().unwrap_or_default()),
                    other => {
                        return Err(GatewayError::invalid(format!(
                            "{where_}: content blocks of type `{other}` are not supported here"
                        )))
                    }
                }
            }
            Ok(text)
        }
    }
}

/// The text standing for an `image` or `document` block: a plain-text document's own text, a
/// placeholder (or a refusal) for the rest. A block without a `source` object is malformed.
fn media_text(
    block: &ContentBlock,
    where_: &str,
    non_text: NonTextContent,
) -> Result<String, GatewayError> {
    let source = block_source(block, where_)?;
    if block.kind == "document" && source.get("type").and_then(JsonValue::as_str) == Some("text") {
        if let Some(data) = source.get("data").and_then(JsonValue::as_str) {
            return Ok(data.to_string());
        }
    }
    non_text.stand_in(&block.kind, where_)
}

/// The `source` object of an `image` or `document` block (malformed without one, or without
/// its `type`).
fn block_source<'a>(
    block: &'a ContentBlock,
    where_: &str,
) -> Result<&'a serde_json::Map<String, JsonValue>, GatewayError> {
    block
        .source
        .as_ref()
        .filter(|source| source.get("type").is_some_and(JsonValue::is_string))
        .ok_or_else(|| {
            GatewayError::invalid(format!(
                "{where_}: `{}` blocks need a `source` object with a `type`",
                block.kind
            ))
        })
}

/// An `image` block of a user message: a `base64` source's image, or a `url` source's (fetched
/// where the operator allows its host, else refused when the model sees images).
fn image_part(block: &ContentBlock, location: String) -> Result<ChatImagePart, GatewayError> {
    let source = block_source(block, &location)?;
    let field = |name: &str| source.get(name).and_then(JsonValue::as_str);
    Ok(match field("type") {
        Some("base64") => {
            let data = field("data").ok_or_else(|| {
                GatewayError::invalid(format!("{location}: a base64 image source needs `data`"))
            })?;
            ChatImagePart::from_base64(data, field("media_type"), location)
        }
        Some("url") => {
            let url = field("url").ok_or_else(|| {
                GatewayError::invalid(format!("{location}: a url image source needs `url`"))
            })?;
            ChatImagePart::from_remote_url(
                url,
                format!("{location}: image URLs are not fetched by this server; send the image as a base64 source"),
                location,
            )
        }
        other => {
            return Err(GatewayError::invalid(format!(
                "{location}: image source type `{}` is not supported (base64 is)",
                other.unwrap_or_default()
            )))
        }
    })
}

/// A tool result's content: its blocks joined by line breaks, documents stood in for as text
/// and images kept as images (the screenshot a client's tool took reaches a model that sees
/// images as an `image` block would, and a text-only model's stand-in takes its place).
fn tool_result_content(
    content: &AnthropicContent,
    where_: &str,
    non_text: NonTextContent,
) -> Result<ChatContent, GatewayError> {
    let blocks = match content {
        AnthropicContent::Text(text) => return Ok(ChatContent::Text(text.clone())),
        AnthropicContent::Blocks(blocks) => blocks,
    };
    let mut parts = Vec::new();
    let mut text = String::new();
    for (index, block) in blocks.iter().enumerate() {
        if index > 0 {
            text.push('\n');
        }
        match block.kind.as_str() {
            "text" => text.push_str(block.text.as_deref().unwrap_or_default()),
            "document" => text.push_str(&media_text(block, where_, non_text)?),
            "image" => {
                let image = image_part(block, format!("{where_}.content.{index}"))?;
                if !text.is_empty() {
                    parts.push(ChatContentPart::Text(std::mem::take(&mut text)));
                }
                parts.push(ChatContentPart::Image(image));
            }
            other => {
                return Err(GatewayError::invalid(format!(
                    "{where_}: content blocks of type `{other}` are not supported in tool results"
                )))
            }
        }
    }
    if parts.is_empty() {
        return Ok(ChatContent::Text(text));
    }
    if !text.is_empty() {
        parts.push(ChatContentPart::Text(text));
    }
    Ok(ChatContent::Parts(parts))
}

fn empty_mapping() -> minijinja::Value {
    minijinja::Value::from_iter(Vec::<(String, minijinja::Value)>::new())
}

/// Converts an Anthropic conversation to the neutral one (tool results become `tool` messages,
/// as the Qwen template expects).
fn chat_conversation(
    request: &MessagesRequest,
    non_text: NonTextContent,
) -> Result<ChatConversation, GatewayError> {
    if request.messages.is_empty() {
        return Err(GatewayError::invalid(
            "messages: at least one message is required",
        ));
    }
    // The system prompt: the `system` field, then every `role: "system"` message (clients such
    // as Claude Code send them inside `messages`), joined in order. Chat templates accept one
    // system message, first, so they all become that one.
    let mut system_parts = Vec::new();
    if let Some(system) = &request.system {
        system_parts.push(plain_text(system, "system")?);
    }
    for (index, message) in request.messages.iter().enumerate() {
        if message.role == "system" {
            system_parts.push(plain_text(&message.content, &format!("messages.{index}"))?);
        }
    }
    let mut messages = Vec::new();
    if !system_parts.is_empty() {
        messages.push(ChatMessage::text(
            ChatRole::System,
            system_parts.join("\n\n"),
        ));
    }
    for (index, message) in request.messages.iter().enumerate() {
        let where_ = format!("messages.{index}");
        match message.role.as_str() {
            "system" => {}
            "user" => match &message.content {
                AnthropicContent::Text(text) => {
                    messages.push(ChatMessage::text(ChatRole::User, text.as_str()));
                }
                AnthropicContent::Blocks(blocks) => {
                    let mut text = String::new();
                    // Images end the text before them (a text-only model reads the message
                    // as before: the stand-in on a line of its own).
                    let mut parts = Vec::new();
                    for (block_index, block) in blocks.iter().enumerate() {
                        match block.kind.as_str() {
                            "text" => text.push_str(block.text.as_deref().unwrap_or_default()),
                            "image" => {
                                let location = format!("{where_}.content.{block_index}");
                                let image = image_part(block, location)?;
                                if !text.is_empty() {
                                    text.push('\n');
                                }
                                parts.push(ChatContentPart::Text(std::mem::take(&mut text)));
                                parts.push(ChatContentPart::Image(image));
                            }
                            "document" => {
                                if !text.is_empty() {
                                    text.push('\n');
                                }
                                text.push_str(&media_text(block, &where_, non_text)?);
                            }
                            "tool_result" => {
                                let mut tool = ChatMessage::text(ChatRole::Tool, "");
                                if let Some(content) = &block.content {
                                    let location = format!("{where_}.content.{block_index}");
                                    tool.content =
                                        Some(tool_result_content(content, &location, non_text)?);
                                }
                                tool.tool_call_id = block.tool_use_id.clone();
                                messages.push(tool);
                            }
                            other => {
                                return Err(GatewayError::invalid(format!(
                                    "{where_}: content blocks of type `{other}` are not supported in user messages"
                                )))
                            }
                        }
                    }
                    if parts.is_empty() {
                        if !text.is_empty() {
                            messages.push(ChatMessage::text(ChatRole::User, text));
                        }
                    } else {
                        parts.push(ChatContentPart::Text(text));
                        let mut message = ChatMessage::text(ChatRole::User, "");
                        message.content = Some(ChatContent::Parts(parts));
                        messages.push(message);
                    }
                }
            },
            "assistant" => {
                let mut text = String::new();
                let mut reasoning: Option<String> = None;
                let mut tool_calls = Vec::new();
                match &message.content {
                    AnthropicContent::Text(content) => text.push_str(content),
                    AnthropicContent::Blocks(blocks) => {
                        for block in blocks {
                            match block.kind.as_str() {
                                "text" => text.push_str(block.text.as_deref().unwrap_or_default()),
                                "thinking" => reasoning.get_or_insert_with(String::new).push_str(block.thinking.as_deref().unwrap_or_default()),
                                "redacted_thinking" => {}
                                "tool_use" => tool_calls.push(ChatToolCall {
                                    id: block.id.clone(),
                                    kind: "function".to_string(),
                                    name: block.name.clone().unwrap_or_default(),
                                    arguments: block.input.clone().unwrap_or_else(empty_mapping),
                                }),
                                other => {
                                    return Err(GatewayError::invalid(format!(
                                        "{where_}: content blocks of type `{other}` are not supported in assistant messages"
                                    )))
                                }
                            }
                        }
                    }
                }
                let mut assistant = ChatMessage::text(ChatRole::Assistant, text);
                assistant.reasoning = reasoning;
                if !tool_calls.is_empty() {
                    assistant.tool_calls = Some(tool_calls);
                }
                messages.push(assistant);
            }
            _ => {
                // Anthropic's own wording for a role it does not know.
                return Err(GatewayError::invalid(format!(
                    "{where_}.role: Input should be 'user', 'assistant' or 'system'"
                )));
            }
        }
    }
    if !messages
        .iter()
        .any(|message| message.role != ChatRole::System)
    {
        return Err(GatewayError::invalid(
            "messages: at least one user or assistant message is required",
        ));
    }
    let tools = request
        .tools
        .iter()
        .flatten()
        .map(|tool| {
            ChatTool::function(
                &tool.name,
                tool.description.as_deref(),
                tool.input_schema.clone(),
            )
        })
        .collect();
    // Anthropic's default is no extended thinking; `thinking: {type: enabled}` (or `adaptive`)
    // turns it on, with `budget_tokens` as the most the thinking block may take.
    let thinking_enabled = request
        .thinking
        .as_ref()
        .is_some_and(|thinking| matches!(thinking.kind.as_str(), "enabled" | "adaptive"));
    let reasoning_budget = match request.thinking.as_ref() {
        Some(thinking) if thinking_enabled => match thinking.budget_tokens {
            None => None,
            Some(budget) => Some(u32::try_from(budget).ok().filter(|&b| b >= 1).ok_or_else(
                || {
                    GatewayError::invalid_parameter(
                        "thinking.budget_tokens",
                        format!("thinking.budget_tokens: Input should be a positive integer, got {budget}"),
                    )
                },
            )?),
        },
        Some(thinking) if thinking.kind != "disabled" => {
            return Err(GatewayError::invalid_parameter(
                "thinking.type",
                format!("thinking.type: Input should be 'enabled', 'adaptive' or 'disabled', got '{}'", thinking.kind),
            ))
        }
        _ => None,
    };
    Ok(ChatConversation {
        messages,
        tools,
        add_generation_prompt: true,
        template_variables: vec![(
            "enable_thinking".to_string(),
            minijinja::Value::from(thinking_enabled),
        )],
        non_text_content: non_text,
        tool_choice: match &request.tool_choice {
            Some(choice) => choice.to_tool_choice()?,
            None => ToolChoice::Auto,
        },
        single_tool_call: request
            .tool_choice
            .as_ref()
            .is_some_and(|choice| choice.disable_parallel_tool_use == Some(true)),
        reasoning_budget,
        ..Default::default()
    })
}

/// `stop_reason`: `tool_use` when the answer holds whole calls (a cut last call is dropped, not
/// reported), else `max_tokens` for an answer cut short — never `tool_use` for half a call.
fn messages_stop_reason(summary: &GenerationSummary, made_calls: bool) -> &'static str {
    if made_calls {
        "tool_use"
    } else {
        stop_reason_text(summary)
    }
}

fn stop_reason_text(summary: &GenerationSummary) -> &'static str {
    match (summary.finish, &summary.matched_stop) {
        (FinishKind::Stop, Some(_)) => "stop_sequence",
        (FinishKind::Stop, None) => "end_turn",
        (FinishKind::Length, _) => "max_tokens",
        (FinishKind::Cancelled, _) => "end_turn",
    }
}

/// `POST /v1/messages`.
pub async fn messages(State(state): State<Arc<GatewayState>>, body: JsonRequestBody) -> Response {
    match messages_inner(state, body).await {
        Ok(response) => response,
        Err(error) => anthropic_error(error),
    }
}

async fn messages_inner(
    state: Arc<GatewayState>,
    body: JsonRequestBody,
) -> Result<Response, GatewayError> {
    let request: MessagesRequest = parse_json_body(body)?;
    let chat = chat_generation_request(&state, &request)?;
    let started = state
        .generator
        .start_chat(&chat)
        .await?
        .into_only_choice()?;
    // With tools declared, `<tool_call>` blocks in the answer become `tool_use` blocks.
    let (plan, receiver, tools) = (started.plan, started.receiver, started.callable_tools);
    let id = format!("msg_{}", plan.request_id);
    let prompt_tokens = plan.prompt_token_ids.len() as u32;
    if request.stream.unwrap_or(false) {
        return Ok(stream_messages(
            id,
            plan.model.name.clone(),
            prompt_tokens,
            receiver,
            tools,
        ));
    }
    let generation = collect_generation(receiver).await?;
    let (text, calls) = match &tools {
        Some(tools) => split_tool_calls(
            &generation.content,
            tools,
            AnswerEnd::of(generation.summary.finish),
        ),
        None => (generation.content.clone(), Vec::new()),
    };
    let mut content = Vec::new();
    if !generation.reasoning.is_empty() {
        content
            .push(json!({"type": "thinking", "thinking": generation.reasoning, "signature": ""}));
    }
    if !text.is_empty() || (content.is_empty() && calls.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    for (position, call) in calls.iter().enumerate() {
        content.push(json!({"type": "tool_use", "id": format!("toolu_{}_{position}", plan.request_id), "name": call.name, "input": call.arguments}));
    }
    let stop_reason = messages_stop_reason(&generation.summary, !calls.is_empty());
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": plan.model.name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": generation.summary.matched_stop,
        "usage": usage_json(&generation.summary),
    }))
    .into_response())
}

/// The request in the gateway's terms: the model, the sampling options and the conversation.
fn chat_generation_request(
    state: &GatewayState,
    request: &MessagesRequest,
) -> Result<ChatGenerationRequest, GatewayError> {
    let model = state.generator.resolve_model(&request.model)?;
    let max_tokens = token_count_parameter("max_tokens", request.max_tokens)?.ok_or_else(|| {
        GatewayError::invalid_parameter("max_tokens", "max_tokens: Field required")
    })?;
    let top_k = match request.top_k {
        None => None,
        Some(k) if k < 0 => {
            return Err(GatewayError::invalid_parameter(
                "top_k",
                format!("top_k: must be non-negative, got {k}"),
            ))
        }
        Some(k) => Some(
            u32::try_from(k)
                .map_err(|_| GatewayError::invalid_parameter("top_k", "top_k: too large"))?,
        ),
    };
    crate::generation_plan::check_temperature(request.temperature, 1.0)?;
    let options = SamplingOptions {
        temperature: request.temperature,
        top_p: request.top_p,
        top_k,
        max_tokens: Some(max_tokens),
        stop: request.stop_sequences.clone().unwrap_or_default(),
        choices: 1,
        ..Default::default()
    };
    let mut conversation = chat_conversation(request, state.settings.non_text_content)?;
    conversation.image_urls = state.settings.image_urls.clone();
    Ok(ChatGenerationRequest {
        model,
        conversation,
        options,
    })
}

/// Anthropic's usage: `input_tokens` counts the prompt tokens computed, and those the engine
/// took from its prefix cache are `cache_read_input_tokens` (the total input is their sum).
fn usage_json(summary: &GenerationSummary) -> JsonValue {
    let cached = summary.cached_tokens.min(summary.prompt_tokens);
    json!({
        "input_tokens": summary.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": summary.completion_tokens,
    })
}

fn event(name: &str, data: JsonValue) -> Event {
    raw_event(name, data.to_string())
}

/// An event whose data is already JSON text (the per-token deltas).
fn raw_event(name: &str, data: String) -> Event {
    Event::named(name, &data)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum OpenBlock {
    Thinking,
    Text,
}

/// The Anthropic event sequence, produced as the client's connection reads it (a disconnect
/// drops it, which cancels the generation).
fn stream_messages(
    id: String,
    model: String,
    prompt_tokens: u32,
    mut receiver: ChoiceReceiver,
    tools: Option<Vec<minijinja::Value>>,
) -> Response {
    let event_stream = InlineStream::new(|events| async move {
        let start = json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }});
        events.send(event("message_start", start)).await;
        events.send(event("ping", json!({"type": "ping"}))).await;
        let mut open: Option<OpenBlock> = None;
        let mut capture = tools.as_ref().map(|_| ToolCallCapture::default());
        let mut block_index: i64 = -1;
        // Opens a block of `kind` (closing another one first); returns the events to send.
        let switch_to = |kind: OpenBlock,
                         open: &mut Option<OpenBlock>,
                         block_index: &mut i64|
         -> Vec<Event> {
            let mut out = Vec::new();
            if *open == Some(kind) {
                return out;
            }
            if open.is_some() {
                out.push(event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": *block_index}),
                ));
            }
            *block_index += 1;
            let block = match kind {
                OpenBlock::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                OpenBlock::Text => json!({"type": "text", "text": ""}),
            };
            out.push(event("content_block_start", json!({"type": "content_block_start", "index": *block_index, "content_block": block})));
            *open = Some(kind);
            out
        };
        while let Some(message) = receiver.recv().await {
            let mut outgoing = Vec::new();
            match message {
                Ok(GenerationEvent::Delta { text, .. }) => {
                    if !text.reasoning.is_empty() {
                        outgoing.extend(switch_to(
                            OpenBlock::Thinking,
                            &mut open,
                            &mut block_index,
                        ));
                        outgoing.push(raw_event(
                            "content_block_delta",
                            anthropic_block_delta(
                                block_index,
                                AnthropicDelta::Thinking,
                                &text.reasoning,
                            ),
                        ));
                    }
                    let content = match capture.as_mut() {
                        Some(capture) => capture.push(&text.content),
                        None => text.content,
                    };
                    if !content.is_empty() {
                        outgoing.extend(switch_to(OpenBlock::Text, &mut open, &mut block_index));
                        outgoing.push(raw_event(
                            "content_block_delta",
                            anthropic_block_delta(block_index, AnthropicDelta::Text, &content),
                        ));
                    }
                }
                Ok(GenerationEvent::Finished(summary)) => {
                    let (rest, calls) = match (capture.as_mut(), tools.as_ref()) {
                        (Some(capture), Some(tools)) => {
                            capture.finish(tools, AnswerEnd::of(summary.finish))
                        }
                        _ => (String::new(), Vec::new()),
                    };
                    if !rest.is_empty() {
                        outgoing.extend(switch_to(OpenBlock::Text, &mut open, &mut block_index));
                        outgoing.push(event(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": block_index, "delta": {"type": "text_delta", "text": rest}}),
                        ));
                    }
                    if open.is_none() && calls.is_empty() {
                        // Always at least one (possibly empty) text block, as the real API does.
                        outgoing.extend(switch_to(OpenBlock::Text, &mut open, &mut block_index));
                    }
                    if open.take().is_some() {
                        outgoing.push(event(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": block_index}),
                        ));
                    }
                    // Each tool call is one tool_use block: start (empty input), the whole input as
                    // one input_json_delta, stop.
                    for (position, call) in calls.iter().enumerate() {
                        block_index += 1;
                        let tool_id = format!("toolu_{}_{position}", id.trim_start_matches("msg_"));
                        outgoing.push(event(
                            "content_block_start",
                            json!({"type": "content_block_start", "index": block_index,
                                   "content_block": {"type": "tool_use", "id": tool_id, "name": call.name, "input": {}}}),
                        ));
                        outgoing.push(event(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": block_index,
                                   "delta": {"type": "input_json_delta", "partial_json": call.arguments_json()}}),
                        ));
                        outgoing.push(event(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": block_index}),
                        ));
                    }
                    let stop_reason = messages_stop_reason(&summary, !calls.is_empty());
                    outgoing.push(event(
                        "message_delta",
                        json!({"type": "message_delta",
                               "delta": {"stop_reason": stop_reason, "stop_sequence": summary.matched_stop},
                               "usage": usage_json(&summary)}),
                    ));
                    outgoing.push(event("message_stop", json!({"type": "message_stop"})));
                }
                Err(error) => outgoing.push(event("error", error.envelope(ApiDialect::Anthropic))),
            }
            for item in outgoing {
                events.send(item).await; // client gone: dropping `receiver` cancels the generation
            }
        }
    });
    event_stream_response(event_stream)
}

/// `POST /v1/messages/count_tokens`: the prompt's token count, exactly as `/v1/messages` would send it.
pub async fn count_tokens(
    State(state): State<Arc<GatewayState>>,
    body: JsonRequestBody,
) -> Response {
    let result = async {
        let request: MessagesRequest = parse_json_body(body)?;
        let model = state.generator.resolve_model(&request.model)?;
        let mut conversation = chat_conversation(&request, state.settings.non_text_content)?;
        conversation.image_urls = state.settings.image_urls.clone();
        let (_, prompt_token_ids, _) = build_chat_prompt_with_images(&model, &conversation).await?;
        Ok::<_, GatewayError>(json!({"input_tokens": prompt_token_ids.len()}))
    }
    .await;
    match result {
        Ok(body) => Json(body).into_response(),
        Err(error) => anthropic_error(error),
    }
}

/// Anthropic's model list.
pub fn model_list_json<'a>(models: impl Iterator<Item = &'a ServedModel>) -> JsonValue {
    let data: Vec<JsonValue> = models
        .map(|model| {
            json!({
                "type": "model",
                "id": model.name,
                "display_name": model.name,
                "created_at": rfc3339_utc(model.created_unix_seconds),
            })
        })
        .collect();
    let first_id = data.first().map(|model| model["id"].clone());
    let last_id = data.last().map(|model| model["id"].clone());
    json!({"data": data, "has_more": false, "first_id": first_id, "last_id": last_id})
}

/// `YYYY-MM-DDTHH:MM:SSZ` of a Unix time.
fn rfc3339_utc(unix_seconds: u64) -> String {
    let (year, month, day) = crate::chat_template::civil_from_days((unix_seconds / 86_400) as i64);
    let seconds_of_day = unix_seconds % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        seconds_of_day / 3600,
        seconds_of_day / 60 % 60,
        seconds_of_day % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_dates_of_known_instants() {
        assert_eq!(super::rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::rfc3339_utc(1_764_763_199), "2025-12-03T11:59:59Z");
    }

    use crate::generation::{FinishKind, GenerationSummary};

    #[test]
    fn cached_prompt_tokens_are_cache_reads_and_the_rest_is_input() {
        let usage = super::usage_json(&GenerationSummary {
            finish: FinishKind::Stop,
            matched_stop: None,
            prompt_tokens: 300,
            completion_tokens: 7,
            reasoning_tokens: 0,
            cached_tokens: 256,
        });
        assert_eq!(usage["input_tokens"], 44);
        assert_eq!(usage["cache_read_input_tokens"], 256);
        assert_eq!(usage["cache_creation_input_tokens"], 0);
        assert_eq!(usage["output_tokens"], 7);
    }
}
