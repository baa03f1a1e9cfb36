//! The OpenAI Responses API: `POST /v1/responses`.
//!
//! Owns: the Responses request shape (`input` as text or items, `instructions`,
//! `max_output_tokens`, function tools and their call/output items, `text.format`,
//! `previous_response_id`), its mapping to the neutral chat conversation, the response object
//! (`output` items: reasoning, message, function calls; `usage`), the streaming event sequence
//! (`response.created` … `response.completed`, each with its `sequence_number`), and the
//! in-process store of recent responses that `previous_response_id` continues from.
//! Must not touch: generation, stop strings, detokenization (see `generation`), other APIs'
//! shapes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value as JsonValue};

use crate::chat::{
    template_variables_from_object, ChatContent, ChatContentPart, ChatConversation, ChatMessage,
    ChatRole, ChatTool, ChatToolCall, ResponseFormat, ToolChoice,
};
use crate::error::{ApiDialect, GatewayError};
use crate::event_stream::event_stream_response;
use crate::generation::{ChoiceReceiver, FinishKind, GenerationEvent, GenerationSummary};
use crate::generation_plan::{token_count_parameter, ChatGenerationRequest, SamplingOptions};
use crate::images::ChatImagePart;
use crate::inline_stream::InlineStream;
use crate::json_body::parse_json_body;
use crate::request_body::JsonRequestBody;
use crate::responses_stream_events::{ResponseDelta, ResponseEventSequence};
use crate::state::GatewayState;
use crate::tool_calls::{split_tool_calls, AnswerEnd, ParsedToolCall};

/// Responses kept for `previous_response_id` (oldest dropped first).
const STORED_RESPONSES: usize = 1024;

#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: String,
    pub input: Option<JsonValue>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub tools: Option<Vec<JsonValue>>,
    pub tool_choice: Option<JsonValue>,
    pub parallel_tool_calls: Option<bool>,
    pub stream: Option<bool>,
    pub text: Option<JsonValue>,
    pub previous_response_id: Option<String>,
    pub store: Option<bool>,
    pub metadata: Option<JsonValue>,
    pub seed: Option<i64>,
    /// Extra template variables, as for chat (`{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<minijinja::Value>,
    /// `{"effort": "none" | "minimal" | "low" | "medium" | "high", ...}`: `none` turns
    /// thinking off.
    pub reasoning: Option<JsonValue>,
}

/// A finished response's conversation: what `previous_response_id` continues.
#[derive(Clone)]
struct StoredResponse {
    /// The messages before the output, instructions excluded (they do not carry over).
    messages: Vec<ChatMessage>,
    /// The output as conversation messages.
    output: Vec<ChatMessage>,
    /// The finished response object (`GET /v1/responses/{id}`).
    object: JsonValue,
}

/// Stored responses by id, and their ids oldest first.
type ResponseStore = (HashMap<String, StoredResponse>, VecDeque<String>);

fn store() -> &'static Mutex<ResponseStore> {
    static STORE: OnceLock<Mutex<ResponseStore>> = OnceLock::new();
    STORE.get_or_init(Default::default)
}

fn remember(id: &str, response: StoredResponse) {
    if let Ok(mut guard) = store().lock() {
        let (map, order) = &mut *guard;
        map.insert(id.to_string(), response);
        order.push_back(id.to_string());
        while order.len() > STORED_RESPONSES {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }
}

fn recall(id: &str) -> Option<StoredResponse> {
    store().lock().ok()?.0.get(id).cloned()
}

fn invalid(parameter: &str, message: impl Into<String>) -> GatewayError {
    GatewayError::invalid_parameter(parameter, message)
}

/// The text of a message's `content`: a string, or a list of `input_text` / `output_text`
/// parts (images get the text-only note).
fn content_text(
    content: &JsonValue,
    index: usize,
    state: &GatewayState,
) -> Result<String, GatewayError> {
    match content {
        JsonValue::String(text) => Ok(text.clone()),
        JsonValue::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match part.get("type").and_then(JsonValue::as_str) {
                    Some("input_text" | "output_text" | "text" | "summary_text") => {
                        text.push_str(part.get("text").and_then(JsonValue::as_str).unwrap_or(""))
                    }
                    Some("input_image") => text.push_str(
                        &state
                            .settings
                            .non_text_content
                            .stand_in("image", &format!("input[{index}]"))?,
                    ),
                    Some("input_file") => text.push_str(
                        &state
                            .settings
                            .non_text_content
                            .stand_in("document", &format!("input[{index}]"))?,
                    ),
                    other => {
                        return Err(invalid(
                            "input",
                            format!(
                                "input[{index}]: content parts of type `{}` are not supported",
                                other.unwrap_or("(none)")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        JsonValue::Null => Ok(String::new()),
        _ => Err(invalid(
            "input",
            format!("input[{index}].content must be a string or a list of parts"),
        )),
    }
}

/// A message content's parts when it holds `input_image` parts (`None` otherwise): text parts
/// as text, images from their `image_url` (a data URL), files stood in for.
fn image_parts(
    content: &JsonValue,
    index: usize,
    state: &GatewayState,
) -> Result<Option<Vec<ChatContentPart>>, GatewayError> {
    let JsonValue::Array(items) = content else {
        return Ok(None);
    };
    let kind = |part: &JsonValue| {
        part.get("type")
            .and_then(JsonValue::as_str)
            .map(str::to_string)
    };
    if !items
        .iter()
        .any(|part| kind(part).as_deref() == Some("input_image"))
    {
        return Ok(None);
    }
    let mut parts = Vec::with_capacity(items.len());
    for (part_index, part) in items.iter().enumerate() {
        let location = format!("input[{index}].content[{part_index}]");
        if kind(part).as_deref() != Some("input_image") {
            // Every other part reads as before, one at a time.
            let text = content_text(&JsonValue::Array(vec![part.clone()]), index, state)?;
            parts.push(ChatContentPart::Text(text));
            continue;
        }
        let url = part.get("image_url").and_then(JsonValue::as_str).ok_or_else(|| {
            invalid(
                "input",
                format!("{location}: an `input_image` part needs `image_url` (a data URL; file ids are not supported)"),
            )
        })?;
        parts.push(ChatContentPart::Image(ChatImagePart::from_url(
            url, location,
        )?));
    }
    Ok(Some(parts))
}

/// The request's `input` as conversation messages.
fn input_messages(
    input: &JsonValue,
    state: &GatewayState,
) -> Result<Vec<ChatMessage>, GatewayError> {
    let items = match input {
        JsonValue::String(text) => {
            return Ok(vec![ChatMessage::text(ChatRole::User, text.clone())])
        }
        JsonValue::Array(items) => items,
        _ => {
            return Err(invalid(
                "input",
                "`input` must be a string or a list of items",
            ))
        }
    };
    let mut messages: Vec<ChatMessage> = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let kind = item
            .get("type")
            .and_then(JsonValue::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role_name = item.get("role").and_then(JsonValue::as_str).unwrap_or("");
                let role = match role_name {
                    "developer" => ChatRole::System,
                    name => ChatRole::from_name(name)
                        .filter(|role| *role != ChatRole::Tool)
                        .ok_or_else(|| {
                            invalid(
                                "input",
                                format!("input[{index}].role must be user, assistant, system or developer, got `{role_name}`"),
                            )
                        })?,
                };
                let content = item.get("content").unwrap_or(&JsonValue::Null);
                let mut message = ChatMessage::text(role, "");
                message.content = Some(match image_parts(content, index, state)? {
                    Some(parts) => ChatContent::Parts(parts),
                    None => ChatContent::Text(content_text(content, index, state)?),
                });
                messages.push(message);
            }
            "function_call" => {
                let name = item.get("name").and_then(JsonValue::as_str).ok_or_else(|| {
                    invalid("input", format!("input[{index}]: a function_call needs `name`"))
                })?;
                let arguments_text = item.get("arguments").and_then(JsonValue::as_str).unwrap_or("{}");
                let arguments: minijinja::Value = serde_json::from_str(arguments_text).map_err(|error| {
                    invalid("input", format!("input[{index}]: function_call arguments are not JSON: {error}"))
                })?;
                let call = ChatToolCall {
                    id: item.get("call_id").and_then(JsonValue::as_str).map(str::to_string),
                    kind: "function".to_string(),
                    name: name.to_string(),
                    arguments,
                };
                // Calls made in one turn belong to one assistant message.
                match messages.last_mut() {
                    Some(last) if last.role == ChatRole::Assistant && last.tool_calls.is_some() => {
                        last.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => messages.push(ChatMessage {
                        role: ChatRole::Assistant,
                        content: None,
                        reasoning: None,
                        tool_calls: Some(vec![call]),
                        tool_call_id: None,
                        name: None,
                    }),
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(JsonValue::String(text)) => text.clone(),
                    Some(other) => content_text(other, index, state)?,
                    None => String::new(),
                };
                messages.push(ChatMessage {
                    role: ChatRole::Tool,
                    content: Some(ChatContent::Text(output)),
                    reasoning: None,
                    tool_calls: None,
                    tool_call_id: item.get("call_id").and_then(JsonValue::as_str).map(str::to_string),
                    name: None,
                });
            }
            // Earlier reasoning is not replayed (the templates drop it from past turns).
            "reasoning" => {}
            other => {
                return Err(invalid(
                    "input",
                    format!("input[{index}]: items of type `{other}` are not supported (message, function_call, function_call_output, reasoning)"),
                ))
            }
        }
    }
    Ok(messages)
}

/// Function tools (`{"type": "function", "name", "description", "parameters"}`).
fn chat_tools(tools: Option<&[JsonValue]>) -> Result<Vec<ChatTool>, GatewayError> {
    let mut converted = Vec::new();
    for (index, tool) in tools.unwrap_or_default().iter().enumerate() {
        if tool.get("type").and_then(JsonValue::as_str) != Some("function") {
            return Err(invalid(
                "tools",
                format!("tools[{index}]: only `function` tools are supported"),
            ));
        }
        let name = tool
            .get("name")
            .and_then(JsonValue::as_str)
            .ok_or_else(|| invalid("tools", format!("tools[{index}]: `name` is required")))?;
        converted.push(ChatTool::function(
            name,
            tool.get("description").and_then(JsonValue::as_str),
            tool.get("parameters")
                .filter(|p| !p.is_null())
                .map(minijinja::Value::from_serialize),
        ));
    }
    Ok(converted)
}

/// `auto` / `none` / `required` / `{"type": "function", "name": ...}`.
fn responses_tool_choice(value: Option<&JsonValue>) -> Result<ToolChoice, GatewayError> {
    crate::chat::tool_choice_naming(
        value,
        |object| object.get("name")?.as_str(),
        "{\"type\": \"function\", \"name\": ...}",
    )
}

fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The echo of the request's settings every response object carries.
struct ResponseFrame {
    id: String,
    /// The request's `reasoning.effort`, echoed as the API does.
    reasoning_effort: Option<String>,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    max_output_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    tools: Vec<JsonValue>,
    tool_choice: JsonValue,
    parallel_tool_calls: bool,
    previous_response_id: Option<String>,
    text: JsonValue,
    metadata: JsonValue,
    store: bool,
}

impl ResponseFrame {
    /// Keeps the finished conversation for `previous_response_id`, when the request asked to.
    fn remember(
        &self,
        history: Vec<ChatMessage>,
        text: &str,
        calls: &[(String, ParsedToolCall)],
        object: &JsonValue,
    ) {
        if self.store {
            remember(
                &self.id,
                StoredResponse {
                    messages: history,
                    output: output_messages(text, calls),
                    object: object.clone(),
                },
            );
        }
    }

    fn object(
        &self,
        status: &str,
        output: Vec<JsonValue>,
        usage: Option<JsonValue>,
        incomplete: Option<&str>,
    ) -> JsonValue {
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete.map(|reason| json!({"reason": reason})),
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": self.reasoning_effort, "summary": null},
            "store": self.store,
            "temperature": self.temperature,
            "text": self.text,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": null,
            "metadata": self.metadata,
        })
    }
}

/// Usage, with the reasoning tokens among the output tokens.
fn usage(summary: &GenerationSummary) -> JsonValue {
    json!({
        "input_tokens": summary.prompt_tokens,
        "input_tokens_details": {"cached_tokens": summary.cached_tokens},
        "output_tokens": summary.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": summary.reasoning_tokens},
        "total_tokens": summary.prompt_tokens + summary.completion_tokens,
    })
}

fn message_item(id: &str, text: &str, status: &str) -> JsonValue {
    json!({
        "type": "message",
        "id": id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    })
}

fn reasoning_item(id: &str, text: &str) -> JsonValue {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}

fn function_call_item(id: &str, call_id: &str, call: &ParsedToolCall) -> JsonValue {
    json!({
        "type": "function_call",
        "id": id,
        "call_id": call_id,
        "name": call.name,
        "arguments": call.arguments_json(),
        "status": "completed",
    })
}

/// `status` and `incomplete_details.reason` of a finished generation.
fn completion_status(summary: &GenerationSummary) -> (&'static str, Option<&'static str>) {
    match summary.finish {
        FinishKind::Length => ("incomplete", Some("max_output_tokens")),
        FinishKind::Stop | FinishKind::Cancelled => ("completed", None),
    }
}

/// The output turned back into conversation messages (for `previous_response_id`).
fn output_messages(text: &str, calls: &[(String, ParsedToolCall)]) -> Vec<ChatMessage> {
    let tool_calls: Vec<ChatToolCall> = calls
        .iter()
        .map(|(call_id, call)| ChatToolCall {
            id: Some(call_id.clone()),
            kind: "function".to_string(),
            name: call.name.clone(),
            arguments: minijinja::Value::from_serialize(&call.arguments),
        })
        .collect();
    vec![ChatMessage {
        role: ChatRole::Assistant,
        content: Some(ChatContent::Text(text.to_string())),
        reasoning: None,
        tool_calls: (!tool_calls.is_empty()).then_some(tool_calls),
        tool_call_id: None,
        name: None,
    }]
}

/// `POST /v1/responses`.
/// `GET /v1/responses/{id}`: a stored response (one created with `store` left on), as it
/// finished; 404 in OpenAI's error shape for an unknown or expired id.
pub async fn get_response(axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    match recall(&id) {
        Some(stored) => Json(stored.object).into_response(),
        None => GatewayError::RouteNotFound(format!(
            "no response with id `{id}` (responses are kept in memory, the latest {STORED_RESPONSES}, when created with `store` on)"
        ))
        .into_response_for(ApiDialect::OpenAi),
    }
}

pub async fn create_response(
    State(state): State<Arc<GatewayState>>,
    body: JsonRequestBody,
) -> Response {
    match create_response_inner(state, body).await {
        Ok(response) => response,
        Err(error) => error.into_response_for(ApiDialect::OpenAi),
    }
}

async fn create_response_inner(
    state: Arc<GatewayState>,
    body: JsonRequestBody,
) -> Result<Response, GatewayError> {
    let request: ResponsesRequest = parse_json_body(body)?;
    let (chat, history) = chat_generation_request(&state, &request)?;
    let max_output_tokens = chat.options.max_tokens;
    let started = state
        .generator
        .start_chat(&chat)
        .await?
        .into_only_choice()?;
    let (plan, receiver, callable) = (started.plan, started.receiver, started.callable_tools);
    let frame = ResponseFrame {
        id: format!("resp_{}", plan.request_id),
        reasoning_effort: request
            .reasoning
            .as_ref()
            .and_then(|reasoning| reasoning.get("effort"))
            .and_then(JsonValue::as_str)
            .map(str::to_string),
        created_at: unix_seconds(),
        model: plan.model.name.clone(),
        instructions: request.instructions.clone(),
        max_output_tokens,
        temperature: request.temperature,
        top_p: request.top_p,
        tools: request.tools.clone().unwrap_or_default(),
        tool_choice: request
            .tool_choice
            .clone()
            .unwrap_or(JsonValue::from("auto")),
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        previous_response_id: request.previous_response_id.clone(),
        text: request
            .text
            .clone()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
        metadata: request.metadata.clone().unwrap_or_else(|| json!({})),
        store: request.store.unwrap_or(true),
    };
    if request.stream.unwrap_or(false) {
        return Ok(stream_response(frame, receiver, callable, history));
    }
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut receiver = receiver;
    let summary = loop {
        match receiver.recv().await {
            Some(Ok(GenerationEvent::Delta { text, .. })) => {
                content.push_str(&text.content);
                reasoning.push_str(&text.reasoning);
            }
            Some(Ok(GenerationEvent::Finished(summary))) => break summary,
            Some(Err(error)) => return Err(error),
            None => {
                return Err(GatewayError::Internal(
                    "generation ended without a result".to_string(),
                ))
            }
        }
    };
    let (text, calls) = match &callable {
        Some(tools) => split_tool_calls(&content, tools, AnswerEnd::of(summary.finish)),
        None => (content.clone(), Vec::new()),
    };
    let mut output = Vec::new();
    if !reasoning.is_empty() {
        output.push(reasoning_item(
            &format!("rs_{}", plan.request_id),
            &reasoning,
        ));
    }
    let (status, incomplete) = completion_status(&summary);
    if !text.is_empty() || calls.is_empty() {
        output.push(message_item(
            &format!("msg_{}", plan.request_id),
            &text,
            status,
        ));
    }
    let mut named_calls = Vec::new();
    for (position, call) in calls.into_iter().enumerate() {
        let call_id = format!("call_{}_{position}", plan.request_id);
        output.push(function_call_item(
            &format!("fc_{}_{position}", plan.request_id),
            &call_id,
            &call,
        ));
        named_calls.push((call_id, call));
    }
    let body = frame.object(status, output, Some(usage(&summary)), incomplete);
    frame.remember(history, &text, &named_calls, &body);
    Ok(Json(body).into_response())
}

/// The request in the gateway's terms (the model, the conversation after the stored history
/// it continues, the sampling options), and that history (stored with the answer).
fn chat_generation_request(
    state: &GatewayState,
    request: &ResponsesRequest,
) -> Result<(ChatGenerationRequest, Vec<ChatMessage>), GatewayError> {
    let model = state.generator.resolve_model(&request.model)?;
    let max_output_tokens = token_count_parameter("max_output_tokens", request.max_output_tokens)?;
    let mut history = Vec::new();
    if let Some(previous) = &request.previous_response_id {
        let stored = recall(previous).ok_or_else(|| {
            GatewayError::invalid_parameter(
                "previous_response_id",
                format!("Previous response with id '{previous}' not found."),
            )
        })?;
        history.extend(stored.messages);
        history.extend(stored.output);
    }
    let input = request
        .input
        .as_ref()
        .ok_or_else(|| invalid("input", "`input` is required"))?;
    history.extend(input_messages(input, state)?);
    if history.is_empty() {
        return Err(invalid("input", "`input` must not be empty"));
    }
    let mut messages = Vec::new();
    if let Some(instructions) = &request.instructions {
        messages.push(ChatMessage::text(ChatRole::System, instructions.clone()));
    }
    messages.extend(history.iter().cloned());
    let tools = chat_tools(request.tools.as_deref())?;
    let mut conversation = ChatConversation {
        messages,
        tools,
        add_generation_prompt: true,
        template_variables: match &request.chat_template_kwargs {
            Some(kwargs) => template_variables_from_object("chat_template_kwargs", kwargs)?,
            None => Vec::new(),
        },
        tool_choice: responses_tool_choice(request.tool_choice.as_ref())?,
        response_format: responses_text_format(request.text.as_ref())?,
        single_tool_call: request.parallel_tool_calls == Some(false),
        reasoning_budget: None,
        non_text_content: state.settings.non_text_content,
        image_urls: state.settings.image_urls.clone(),
    };
    crate::chat::apply_reasoning_effort(
        &mut conversation,
        "reasoning.effort",
        request
            .reasoning
            .as_ref()
            .and_then(|reasoning| reasoning.get("effort"))
            .and_then(JsonValue::as_str),
    )?;
    crate::generation_plan::check_temperature(request.temperature, 2.0)?;
    let options = SamplingOptions {
        temperature: request.temperature,
        top_p: request.top_p,
        max_tokens: max_output_tokens,
        seed: request.seed.map(|seed| seed as u64),
        choices: 1,
        ..Default::default()
    };
    Ok((
        ChatGenerationRequest {
            model,
            conversation,
            options,
        },
        history,
    ))
}

/// The Responses API's `text.format`: `{"type": "text" | "json_object"}` or
/// `{"type": "json_schema", "name": ..., "schema": {...}, "strict": ...}`.
fn responses_text_format(value: Option<&JsonValue>) -> Result<ResponseFormat, GatewayError> {
    let Some(format) = value.and_then(|text| text.get("format")) else {
        return Ok(ResponseFormat::Text);
    };
    match format.get("type").and_then(JsonValue::as_str) {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let schema = format.get("schema").ok_or_else(|| {
                GatewayError::invalid_parameter("text", "`text.format.schema` is required")
            })?;
            crate::structured::json_schema_format(schema, "text.format.schema")
        }
        _ => Err(GatewayError::invalid_parameter(
            "text",
            "`text.format.type` must be `text`, `json_object` or `json_schema`",
        )),
    }
}

/// The streamed response: `response.created`, `response.in_progress`, then items as they
/// happen (reasoning text, output text, function calls at the end), then `response.completed`
/// (or `response.incomplete`, or an `error` event).
fn stream_response(
    frame: ResponseFrame,
    mut receiver: ChoiceReceiver,
    callable: Option<Vec<minijinja::Value>>,
    history: Vec<ChatMessage>,
) -> Response {
    let event_stream = InlineStream::new(|events| async move {
        let mut sequence = ResponseEventSequence::default();
        let base = frame.id.trim_start_matches("resp_").to_string();
        let created = frame.object("in_progress", Vec::new(), None, None);
        for (kind, value) in [
            ("response.created", json!({"response": created.clone()})),
            ("response.in_progress", json!({"response": created})),
        ] {
            events.send(sequence.value(kind, value)).await;
        }
        let mut output: Vec<JsonValue> = Vec::new();
        let mut reasoning = String::new();
        let mut reasoning_index: Option<usize> = None;
        let mut text = String::new();
        let mut message_index: Option<usize> = None;
        // Once a `<tool_call>` may have started, text waits for the end to be parsed.
        let mut capture = callable
            .as_ref()
            .map(|_| crate::tool_calls::ToolCallCapture::default());
        let reasoning_id = format!("rs_{base}");
        let message_id = format!("msg_{base}");
        let summary = loop {
            let event = match receiver.recv().await {
                Some(Ok(event)) => event,
                Some(Err(error)) => {
                    let envelope = error.envelope(ApiDialect::OpenAi);
                    let detail = &envelope["error"];
                    events
                        .send(sequence.value(
                            "error",
                            json!({"code": detail["code"], "message": detail["message"], "param": detail["param"]}),
                        ))
                        .await;
                    return;
                }
                None => return,
            };
            let delta = match event {
                GenerationEvent::Delta { text: delta, .. } => delta,
                GenerationEvent::Finished(summary) => break summary,
            };
            // The rare events as values, numbered as they go out; the deltas written directly.
            let mut outgoing = Vec::new();
            let mut pending = Vec::new();
            if !delta.reasoning.is_empty() {
                let index = *reasoning_index.get_or_insert_with(|| {
                    output.push(json!({"type": "reasoning", "id": reasoning_id, "summary": [], "content": []}));
                    pending.push(("response.output_item.added", json!({"output_index": output.len() - 1, "item": output[output.len() - 1]})));
                    output.len() - 1
                });
                reasoning.push_str(&delta.reasoning);
                outgoing.extend(
                    pending
                        .drain(..)
                        .map(|(kind, value)| sequence.value(kind, value)),
                );
                outgoing.push(sequence.delta(
                    ResponseDelta::ReasoningText,
                    &reasoning_id,
                    index,
                    &delta.reasoning,
                ));
            }
            let shown = match capture.as_mut() {
                Some(capture) => capture.push(&delta.content),
                None => delta.content,
            };
            if !shown.is_empty() {
                let index = message_output_index(
                    &mut message_index,
                    &mut output,
                    &mut pending,
                    &message_id,
                );
                text.push_str(&shown);
                outgoing.extend(
                    pending
                        .drain(..)
                        .map(|(kind, value)| sequence.value(kind, value)),
                );
                outgoing.push(sequence.delta(
                    ResponseDelta::OutputText,
                    &message_id,
                    index,
                    &shown,
                ));
            }
            for event in outgoing {
                events.send(event).await; // client gone: dropping the receiver cancels the generation
            }
        };
        let (rest, calls) = match (capture.as_mut(), callable.as_ref()) {
            (Some(capture), Some(tools)) => capture.finish(tools, AnswerEnd::of(summary.finish)),
            _ => (String::new(), Vec::new()),
        };
        let (status, incomplete) = completion_status(&summary);
        let mut pending = Vec::new();
        if let Some(index) = reasoning_index {
            output[index] = reasoning_item(&reasoning_id, &reasoning);
            pending.push(("response.reasoning_text.done", json!({"item_id": reasoning_id, "output_index": index, "content_index": 0, "text": reasoning})));
            pending.push((
                "response.output_item.done",
                json!({"output_index": index, "item": output[index]}),
            ));
        }
        if !rest.is_empty() || (message_index.is_none() && calls.is_empty()) {
            let index =
                message_output_index(&mut message_index, &mut output, &mut pending, &message_id);
            if !rest.is_empty() {
                text.push_str(&rest);
                pending.push(("response.output_text.delta", json!({"item_id": message_id, "output_index": index, "content_index": 0, "delta": rest, "logprobs": []})));
            }
        }
        if let Some(index) = message_index {
            output[index] = message_item(&message_id, &text, status);
            pending.push(("response.output_text.done", json!({"item_id": message_id, "output_index": index, "content_index": 0, "text": text, "logprobs": []})));
            pending.push(("response.content_part.done", json!({"item_id": message_id, "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}})));
            pending.push((
                "response.output_item.done",
                json!({"output_index": index, "item": output[index]}),
            ));
        }
        let mut named_calls = Vec::new();
        for (position, call) in calls.into_iter().enumerate() {
            let item_id = format!("fc_{base}_{position}");
            let call_id = format!("call_{base}_{position}");
            let mut item = function_call_item(&item_id, &call_id, &call);
            item["status"] = JsonValue::from("in_progress");
            item["arguments"] = JsonValue::from("");
            output.push(item.clone());
            let index = output.len() - 1;
            let arguments = call.arguments_json();
            pending.push((
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            ));
            pending.push((
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": index, "delta": arguments}),
            ));
            pending.push(("response.function_call_arguments.done", json!({"item_id": item_id, "output_index": index, "name": call.name, "arguments": arguments})));
            output[index] = function_call_item(&item_id, &call_id, &call);
            pending.push((
                "response.output_item.done",
                json!({"output_index": index, "item": output[index]}),
            ));
            named_calls.push((call_id, call));
        }
        let finished = frame.object(status, output, Some(usage(&summary)), incomplete);
        let last = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        frame.remember(history, &text, &named_calls, &finished);
        pending.push((last, json!({"response": finished})));
        for (kind, value) in pending {
            events.send(sequence.value(kind, value)).await;
        }
    });
    event_stream_response(event_stream)
}

/// The index of the answer's message item in `output`: added, with its two announcing events,
/// the first time text needs it.
fn message_output_index(
    message_index: &mut Option<usize>,
    output: &mut Vec<JsonValue>,
    pending: &mut Vec<(&'static str, JsonValue)>,
    message_id: &str,
) -> usize {
    if let Some(index) = *message_index {
        return index;
    }
    output.push(json!({"type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []}));
    let index = output.len() - 1;
    pending.push((
        "response.output_item.added",
        json!({"output_index": index, "item": output[index]}),
    ));
    pending.push(("response.content_part.added", json!({"item_id": message_id, "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})));
    *message_index = Some(index);
    index
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::responses_text_format;
    use crate::chat::ResponseFormat;

    #[test]
    fn text_formats_parse_and_refuse() {
        let format = responses_text_format(Some(
            &json!({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}),
        ))
        .unwrap();
        assert!(matches!(format, ResponseFormat::JsonSchema(_)));
        assert!(responses_text_format(Some(&json!({"format": {"type": "yaml"}}))).is_err());
        assert!(responses_text_format(Some(&json!({"format": {"type": "json_schema"}}))).is_err());
    }
}
