//! The OpenAI-compatible chat API, `/v1/chat/completions`, and the OpenAI pieces the text
//! completions (`openai_completions`) and the model list (`models`) share.
//!
//! Owns: OpenAI request/response JSON shapes, reading a request into the neutral
//! [`ChatGenerationRequest`] (messages, tools, `tool_choice`, `response_format`,
//! `reasoning_effort`, [`SamplingOptions`]) in one pass, SSE framing (`data: {...}`,
//! `data: [DONE]`, `stream_options.include_usage`), `reasoning_content`, logprobs, OpenAI's model
//! objects, and OpenAI error envelopes.
//! Must not touch: other APIs' shapes, planning (`generation_plan`), engine selection,
//! stop-string or detokenization logic (see `generation`).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value as JsonValue};

use crate::backend::ServedModel;
use crate::chat::{
    template_variables_from_object, ChatContent, ChatContentPart, ChatConversation, ChatMessage,
    ChatRole, ChatTool, ChatToolCall, ResponseFormat, ToolChoice,
};
use crate::error::{ApiDialect, GatewayError};
use crate::event_stream::{event_stream_response, Event};
use crate::generation::{
    collect_all_generations, ChoiceReceiver, FinishKind, GenerationEvent, GenerationSummary,
    StartedChat, TokenLogprobEntry,
};
use crate::generation_plan::{token_count_parameter, ChatGenerationRequest, SamplingOptions};
use crate::images::ChatImagePart;
use crate::inline_stream::InlineStream;
use crate::json_body::parse_json_body;
use crate::openai_chunks::ChatChunkText;
use crate::request_body::JsonRequestBody;
use crate::state::GatewayState;
use crate::tool_calls::{split_tool_calls, AnswerEnd, ParsedToolCall, ToolCallCapture};

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSequences {
    One(String),
    Many(Vec<String>),
}

impl StopSequences {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopSequences::One(stop) => vec![stop],
            StopSequences::Many(stops) => stops,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Message content: a string or a list of typed parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    /// `{"url": ..., "detail": ...}` (or the URL alone) of an `image_url` part.
    #[serde(default)]
    pub image_url: Option<serde_json::Value>,
    /// A `video` part's frames: a list of image URLs (data URLs), in order.
    #[serde(default)]
    pub video: Option<serde_json::Value>,
    /// A `video` part's frame rate (the model's video processor's when absent): frame `k` is at
    /// `k / fps` seconds.
    #[serde(default)]
    pub fps: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallFunction {
    pub name: String,
    /// A JSON string (OpenAI) or an object; templates need the object.
    #[serde(default)]
    pub arguments: Option<minijinja::Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ToolCall {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    pub function: ToolCallFunction,
}

/// One chat message as OpenAI clients send it.
#[derive(Debug, Clone, Deserialize)]
pub struct OpenAiMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default, alias = "reasoning")]
    pub reasoning_content: Option<String>,
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCall>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<OpenAiMessage>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: OpenAiSampling,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub tools: Option<Vec<minijinja::Value>>,
    /// Extra template variables, e.g. `{"enable_thinking": false}`.
    #[serde(default)]
    pub chat_template_kwargs: Option<minijinja::Value>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// `none`, `auto`, `required`, or `{"type": "function", "function": {"name": ...}}`.
    #[serde(default)]
    pub tool_choice: Option<JsonValue>,
    /// `false`: at most one tool call.
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`, enforced on the tokens.
    #[serde(default)]
    pub response_format: Option<JsonValue>,
    /// `none` turns thinking off; `minimal` to `high` keep the template's default.
    #[serde(default)]
    pub reasoning_effort: Option<String>,
}

/// OpenAI's `tool_choice` in the gateway's terms.
pub fn tool_choice(value: Option<&JsonValue>) -> Result<ToolChoice, GatewayError> {
    crate::chat::tool_choice_naming(
        value,
        |object| object.get("function")?.get("name")?.as_str(),
        "{\"type\": \"function\", \"function\": {\"name\": ...}}",
    )
}

/// Sampling fields shared by chat and completions.
#[derive(Debug, Default, Deserialize)]
pub struct OpenAiSampling {
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<StopSequences>,
    #[serde(default)]
    pub n: Option<i64>,
    /// Token id (as a string) → bias, -100..100.
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// NInfer extension: most MTP speculative drafts per step for this request (0: none),
    /// capped by the engine's `--draft-tokens`.
    #[serde(default)]
    pub draft_tokens: Option<u32>,
    /// vLLM's extension: keep generating past end-of-sequence tokens until `max_tokens`
    /// (benchmarks that need answers of one length).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

impl OpenAiSampling {
    pub(crate) fn to_options(
        &self,
        max_tokens: Option<u32>,
        logprobs: bool,
        top_logprobs: Option<i64>,
    ) -> Result<SamplingOptions, GatewayError> {
        crate::generation_plan::check_temperature(self.temperature, 2.0)?;
        let top_k =
            match self.top_k {
                None => None,
                // -1 is vLLM's spelling of "disabled".
                Some(-1) | Some(0) => Some(0),
                Some(k) if k < 0 => {
                    return Err(GatewayError::invalid_parameter(
                        "top_k",
                        format!("`top_k` must be -1, 0 or positive, got {k}"),
                    ))
                }
                Some(k) => Some(u32::try_from(k).map_err(|_| {
                    GatewayError::invalid_parameter("top_k", "`top_k` is too large")
                })?),
            };
        let choices = match self.n {
            None => 1,
            Some(n) => u32::try_from(n).map_err(|_| {
                GatewayError::invalid_parameter(
                    "n",
                    format!("`n` must be between 1 and 16, got {n}"),
                )
            })?,
        };
        let top_logprobs = match top_logprobs {
            None => 0,
            Some(k) => u32::try_from(k).map_err(|_| {
                GatewayError::invalid_parameter(
                    "top_logprobs",
                    format!("`top_logprobs` must be between 0 and 20, got {k}"),
                )
            })?,
        };
        let mut logit_bias = Vec::new();
        for (token, bias) in self.logit_bias.iter().flatten() {
            let token = token.trim().parse::<u32>().map_err(|_| {
                GatewayError::invalid_parameter(
                    "logit_bias",
                    format!("`logit_bias` keys are token ids, got `{token}`"),
                )
            })?;
            logit_bias.push((token, *bias));
        }
        Ok(SamplingOptions {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            // OpenAI seeds are any integer; the engine takes 64 bits.
            seed: self.seed.map(|seed| seed as u64),
            max_tokens,
            stop: self
                .stop
                .clone()
                .map(StopSequences::into_vec)
                .unwrap_or_default(),
            logprobs,
            top_logprobs,
            choices,
            logit_bias,
            draft_tokens: self.draft_tokens,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

/// Converts OpenAI messages (and tools, template switches) to the neutral conversation (shared
/// with `/tokenize`).
pub fn chat_conversation(
    messages: &[OpenAiMessage],
    tools: Option<&[minijinja::Value]>,
    add_generation_prompt: bool,
    template_kwargs: Option<&minijinja::Value>,
) -> Result<ChatConversation, GatewayError> {
    if messages.is_empty() {
        return Err(GatewayError::invalid_parameter(
            "messages",
            "`messages` must not be empty",
        ));
    }
    let mut converted = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        let role = ChatRole::from_name(&message.role)
            .ok_or_else(|| ChatRole::unknown_role_error(index, &message.role))?;
        let content = match &message.content {
            None => None,
            Some(MessageContent::Text(text)) => Some(ChatContent::Text(text.clone())),
            Some(MessageContent::Parts(parts)) => {
                let mut converted_parts = Vec::new();
                for (part_index, part) in parts.iter().enumerate() {
                    converted_parts.push(match part.kind.as_str() {
                        "text" => ChatContentPart::Text(part.text.clone().unwrap_or_default()),
                        "image_url" => {
                            let location = format!("messages[{index}].content[{part_index}]");
                            let url = part.image_url.as_ref().and_then(|image_url| {
                                image_url
                                    .as_str()
                                    .or_else(|| image_url.get("url").and_then(|u| u.as_str()))
                            });
                            let url = url.ok_or_else(|| {
                                GatewayError::invalid_parameter(
                                    "messages",
                                    format!("{location}: an `image_url` part needs `image_url.url`"),
                                )
                            })?;
                            ChatContentPart::Image(ChatImagePart::from_url(url, location)?)
                        }
                        "video" => {
                            let location = format!("messages[{index}].content[{part_index}]");
                            let frames = part
                                .video
                                .as_ref()
                                .and_then(|video| video.as_array())
                                .and_then(|frames| {
                                    frames.iter().map(|frame| frame.as_str()).collect::<Option<Vec<&str>>>()
                                })
                                .ok_or_else(|| {
                                    GatewayError::invalid_parameter(
                                        "messages",
                                        format!("{location}: a `video` part needs `video`, a list of frame image URLs"),
                                    )
                                })?;
                            ChatContentPart::Image(ChatImagePart::from_video_urls(&frames, part.fps, location))
                        }
                        other => {
                            return Err(GatewayError::invalid_parameter(
                                "messages",
                                format!("messages[{index}]: content parts of type `{other}` are not supported (text, image_url and video are)"),
                            ))
                        }
                    });
                }
                Some(ChatContent::Parts(converted_parts))
            }
        };
        let tool_calls = match &message.tool_calls {
            None => None,
            Some(tool_calls) => {
                let mut calls = Vec::new();
                for call in tool_calls {
                    let arguments = match &call.function.arguments {
                        // OpenAI sends arguments as a JSON string; templates iterate them as a mapping.
                        Some(value) if value.kind() == minijinja::value::ValueKind::String => {
                            let text = value.as_str().unwrap_or_default();
                            serde_json::from_str::<minijinja::Value>(text).map_err(|error| {
                                GatewayError::invalid_parameter(
                                    "messages",
                                    format!(
                                        "messages[{index}]: tool call arguments are not JSON: {error}"
                                    ),
                                )
                            })?
                        }
                        Some(value) => value.clone(),
                        None => {
                            minijinja::Value::from_iter(Vec::<(String, minijinja::Value)>::new())
                        }
                    };
                    calls.push(ChatToolCall {
                        id: call.id.clone(),
                        kind: call.kind.clone().unwrap_or_else(|| "function".to_string()),
                        name: call.function.name.clone(),
                        arguments,
                    });
                }
                Some(calls)
            }
        };
        converted.push(ChatMessage {
            role,
            content,
            reasoning: message.reasoning_content.clone(),
            tool_calls,
            tool_call_id: message.tool_call_id.clone(),
            name: message.name.clone(),
        });
    }
    let template_variables = match template_kwargs {
        Some(kwargs) => template_variables_from_object("chat_template_kwargs", kwargs)?,
        None => Vec::new(),
    };
    Ok(ChatConversation {
        messages: converted,
        tools: tools
            .unwrap_or_default()
            .iter()
            .map(|definition| ChatTool {
                definition: definition.clone(),
            })
            .collect(),
        add_generation_prompt,
        template_variables,
        tool_choice: ToolChoice::Auto,
        ..Default::default()
    })
}

pub(crate) fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A chat choice's `finish_reason`: `tool_calls` when the answer holds whole calls (a cut last
/// call is dropped, not reported), else `length` for an answer cut by `max_tokens` — never
/// `tool_calls` for half a call, as vLLM does.
fn chat_finish_reason(finish: FinishKind, made_calls: bool) -> &'static str {
    match finish {
        _ if made_calls => "tool_calls",
        other => finish_reason_text(other),
    }
}

pub(crate) fn finish_reason_text(finish: FinishKind) -> &'static str {
    match finish {
        FinishKind::Stop => "stop",
        FinishKind::Length => "length",
        // OpenAI has no "cancelled"; "abort" is vLLM's word for it.
        FinishKind::Cancelled => "abort",
    }
}

/// `cached_tokens`: prompt tokens the engine took from its prefix cache.
pub(crate) fn usage_json(
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
) -> JsonValue {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}})
}

/// Chat usage: also how many of the completion tokens were reasoning.
fn chat_usage_json(
    prompt_tokens: u32,
    completion_tokens: u32,
    reasoning_tokens: u32,
    cached_tokens: u32,
) -> JsonValue {
    let mut usage = usage_json(prompt_tokens, completion_tokens, cached_tokens);
    usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning_tokens});
    usage
}

fn chat_logprobs_json(entries: &[TokenLogprobEntry]) -> JsonValue {
    let content: Vec<JsonValue> = entries
        .iter()
        .map(|entry| {
            json!({
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": entry.token.as_bytes(),
                "top_logprobs": entry.top.iter().map(|(token, logprob)| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({"content": content})
}

pub(crate) fn openai_error(error: GatewayError) -> Response {
    error.into_response_for(ApiDialect::OpenAi)
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<GatewayState>>,
    body: JsonRequestBody,
) -> Response {
    match chat_completions_inner(state, body).await {
        Ok(response) => response,
        Err(error) => openai_error(error),
    }
}

async fn chat_completions_inner(
    state: Arc<GatewayState>,
    body: JsonRequestBody,
) -> Result<Response, GatewayError> {
    let request: ChatCompletionRequest = parse_json_body(body)?;
    let chat = chat_generation_request(&state, &request)?;
    let logprobs = chat.options.logprobs;
    // With tools declared, `<tool_call>` blocks in the answer become `tool_calls`.
    let StartedChat {
        plan,
        receivers,
        callable_tools: tools,
    } = state.generator.start_chat(&chat).await?;
    let id = format!("chatcmpl-{}", plan.request_id);
    let created = unix_seconds();
    if request.stream.unwrap_or(false) {
        let include_usage = request
            .stream_options
            .map(|o| o.include_usage)
            .unwrap_or(false);
        return Ok(stream_chat(
            id,
            created,
            plan.model.name.clone(),
            receivers,
            include_usage,
            logprobs,
            tools,
        ));
    }
    let mut choices = Vec::new();
    let (mut prompt_tokens, mut completion_tokens, mut reasoning_tokens, mut cached_tokens) =
        (0, 0, 0, 0);
    for (index, generation) in collect_all_generations(receivers)
        .await?
        .into_iter()
        .enumerate()
    {
        prompt_tokens = generation.summary.prompt_tokens;
        cached_tokens = generation.summary.cached_tokens;
        completion_tokens += generation.summary.completion_tokens;
        reasoning_tokens += generation.summary.reasoning_tokens;
        let reasoning_content = if generation.reasoning.is_empty() {
            JsonValue::Null
        } else {
            JsonValue::from(generation.reasoning)
        };
        let (content, calls) = match &tools {
            Some(tools) => split_tool_calls(
                &generation.content,
                tools,
                AnswerEnd::of(generation.summary.finish),
            ),
            None => (generation.content.clone(), Vec::new()),
        };
        let mut message = json!({"role": "assistant", "content": content, "reasoning_content": reasoning_content});
        let finish = chat_finish_reason(generation.summary.finish, !calls.is_empty());
        if !calls.is_empty() {
            message["tool_calls"] = tool_calls_json(&plan.request_id, index, &calls, false);
            if content.is_empty() {
                message["content"] = JsonValue::Null;
            }
        }
        choices.push(json!({
            "index": index,
            "message": message,
            "logprobs": if logprobs { chat_logprobs_json(&generation.logprobs) } else { JsonValue::Null },
            "finish_reason": finish,
            "stop_reason": generation.summary.matched_stop,
        }));
    }
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": plan.model.name,
        "choices": choices,
        "usage": chat_usage_json(prompt_tokens, completion_tokens, reasoning_tokens, cached_tokens),
    }))
    .into_response())
}

/// The chat request in the gateway's terms: the model, the sampling options and the
/// conversation with its tools, tool choice, response format and reasoning effort.
fn chat_generation_request(
    state: &GatewayState,
    request: &ChatCompletionRequest,
) -> Result<ChatGenerationRequest, GatewayError> {
    let model = state.generator.resolve_model(&request.model)?;
    let max_tokens =
        match token_count_parameter("max_completion_tokens", request.max_completion_tokens)? {
            Some(value) => Some(value),
            None => token_count_parameter("max_tokens", request.max_tokens)?,
        };
    let logprobs = request.logprobs.unwrap_or(false);
    let options = request
        .sampling
        .to_options(max_tokens, logprobs, request.top_logprobs)?;
    let mut conversation = chat_conversation(
        &request.messages,
        request.tools.as_deref(),
        request.add_generation_prompt.unwrap_or(true),
        request.chat_template_kwargs.as_ref(),
    )?;
    conversation.tool_choice = tool_choice(request.tool_choice.as_ref())?;
    conversation.response_format = openai_response_format(request.response_format.as_ref())?;
    conversation.single_tool_call = request.parallel_tool_calls == Some(false);
    conversation.non_text_content = state.settings.non_text_content;
    conversation.image_urls = state.settings.image_urls.clone();
    crate::chat::apply_reasoning_effort(
        &mut conversation,
        "reasoning_effort",
        request.reasoning_effort.as_deref(),
    )?;
    Ok(ChatGenerationRequest {
        model,
        conversation,
        options,
    })
}

/// OpenAI chat `response_format`: `{"type": "text" | "json_object"}` or
/// `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
fn openai_response_format(value: Option<&JsonValue>) -> Result<ResponseFormat, GatewayError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(ResponseFormat::Text);
    };
    let kind = value.get("type").and_then(JsonValue::as_str);
    match kind {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let schema = value
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .ok_or_else(|| {
                    GatewayError::invalid_parameter(
                        "response_format",
                        "`response_format.json_schema.schema` is required",
                    )
                })?;
            crate::structured::json_schema_format(schema, "response_format.json_schema.schema")
        }
        _ => Err(GatewayError::invalid_parameter(
            "response_format",
            "`response_format.type` must be `text`, `json_object` or `json_schema`",
        )),
    }
}

/// Merges the choices' event channels into one stream of `(choice index, event)`. One choice
/// (nearly every request) is read directly: a merge would route each of its wake-ups through
/// its own queue.
pub(crate) fn merged_choices(
    mut receivers: Vec<ChoiceReceiver>,
) -> impl futures_util::Stream<Item = (usize, Result<GenerationEvent, GatewayError>)> {
    if receivers.len() == 1 {
        if let Some(only) = receivers.pop() {
            return futures_util::future::Either::Left(only.map(|event| (0, event)));
        }
    }
    futures_util::future::Either::Right(futures_util::stream::select_all(
        receivers
            .into_iter()
            .enumerate()
            .map(|(index, receiver)| receiver.map(move |event| (index, event)).boxed()),
    ))
}

/// An API's event producer as an SSE response, run by the client's connection as it writes.
/// When the client disconnects, axum drops the stream, the producer with its generations, and
/// the engines cancel.
pub(crate) fn sse_response(events: InlineStream<Event>) -> Response {
    event_stream_response(events)
}

pub(crate) fn json_event(value: &JsonValue) -> Event {
    Event::data_only(&value.to_string())
}

/// OpenAI `tool_calls` array (`with_index` for streaming deltas).
fn tool_calls_json(
    request_id: &str,
    choice: usize,
    calls: &[ParsedToolCall],
    with_index: bool,
) -> JsonValue {
    let calls: Vec<JsonValue> = calls
        .iter()
        .enumerate()
        .map(|(position, call)| {
            let mut value = json!({
                "id": format!("call_{request_id}_{choice}_{position}"),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json()},
            });
            if with_index {
                value["index"] = JsonValue::from(position);
            }
            value
        })
        .collect();
    JsonValue::from(calls)
}

fn stream_chat(
    id: String,
    created: u64,
    model: String,
    receivers: Vec<ChoiceReceiver>,
    include_usage: bool,
    logprobs: bool,
    tools: Option<Vec<minijinja::Value>>,
) -> Response {
    let choice_count = receivers.len();
    let text_chunks = ChatChunkText::new(&id, created, &model, include_usage);
    let event_stream = InlineStream::new(|events| async move {
        let mut captures: Vec<Option<ToolCallCapture>> = (0..choice_count)
            .map(|_| tools.as_ref().map(|_| ToolCallCapture::default()))
            .collect();
        let chunk = |choices: JsonValue, usage: Option<JsonValue>| {
            let mut value = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices});
            if include_usage {
                value["usage"] = usage.unwrap_or(JsonValue::Null);
            }
            json_event(&value)
        };
        for index in 0..choice_count {
            let first = chunk(
                json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                None,
            );
            events.send(first).await;
        }
        let mut summaries: Vec<Option<GenerationSummary>> = vec![None; choice_count];
        let mut merged = merged_choices(receivers);
        while let Some((index, event)) = merged.next().await {
            let message = match event {
                Ok(GenerationEvent::Delta {
                    text,
                    logprobs: entries,
                }) => {
                    let content = match captures.get_mut(index).and_then(Option::as_mut) {
                        Some(capture) => capture.push(&text.content),
                        None => text.content,
                    };
                    if !logprobs {
                        // The chunk every token becomes: written directly, no `Value` per token.
                        if text.reasoning.is_empty() && content.is_empty() {
                            continue; // everything held back for tool-call parsing
                        }
                        text_chunks.delta_event(index, &text.reasoning, &content)
                    } else {
                        let mut delta = serde_json::Map::new();
                        if !text.reasoning.is_empty() {
                            delta.insert(
                                "reasoning_content".to_string(),
                                JsonValue::from(text.reasoning),
                            );
                        }
                        if !content.is_empty() {
                            delta.insert("content".to_string(), JsonValue::from(content));
                        }
                        if delta.is_empty() && entries.is_empty() {
                            continue; // everything held back for tool-call parsing
                        }
                        chunk(
                            json!([{"index": index, "delta": delta, "logprobs": chat_logprobs_json(&entries), "finish_reason": null}]),
                            None,
                        )
                    }
                }
                Ok(GenerationEvent::Finished(summary)) => {
                    let finish_kind = summary.finish;
                    let mut finish = finish_reason_text(finish_kind);
                    let stop_reason = summary.matched_stop.clone();
                    if let Some(slot) = summaries.get_mut(index) {
                        *slot = Some(summary);
                    }
                    if let (Some(Some(capture)), Some(tools)) =
                        (captures.get_mut(index), tools.as_ref())
                    {
                        let (rest, calls) = capture.finish(tools, AnswerEnd::of(finish_kind));
                        let mut delta = serde_json::Map::new();
                        if !rest.is_empty() {
                            delta.insert("content".to_string(), JsonValue::from(rest));
                        }
                        if !calls.is_empty() {
                            let request_id = id.trim_start_matches("chatcmpl-").to_string();
                            delta.insert(
                                "tool_calls".to_string(),
                                tool_calls_json(&request_id, index, &calls, true),
                            );
                        }
                        finish = chat_finish_reason(finish_kind, !calls.is_empty());
                        if !delta.is_empty() {
                            let held = chunk(
                                json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": null}]),
                                None,
                            );
                            events.send(held).await;
                        }
                    }
                    chunk(
                        json!([{"index": index, "delta": {}, "logprobs": null, "finish_reason": finish, "stop_reason": stop_reason}]),
                        None,
                    )
                }
                Err(error) => {
                    events
                        .send(json_event(&error.envelope(ApiDialect::OpenAi)))
                        .await;
                    events.send(Event::data_only("[DONE]")).await;
                    return;
                }
            };
            events.send(message).await; // client gone: dropping `merged` cancels every choice
        }
        if include_usage {
            let (prompt_tokens, cached_tokens) = summaries
                .iter()
                .flatten()
                .map(|s| (s.prompt_tokens, s.cached_tokens))
                .next()
                .unwrap_or((0, 0));
            let completion_tokens: u32 = summaries
                .iter()
                .flatten()
                .map(|s| s.completion_tokens)
                .sum();
            let reasoning_tokens: u32 =
                summaries.iter().flatten().map(|s| s.reasoning_tokens).sum();
            events
                .send(chunk(
                    json!([]),
                    Some(chat_usage_json(
                        prompt_tokens,
                        completion_tokens,
                        reasoning_tokens,
                        cached_tokens,
                    )),
                ))
                .await;
        }
        events.send(Event::data_only("[DONE]")).await;
    });
    sse_response(event_stream)
}

/// An OpenAI model object (with NInfer's readiness and context length).
pub fn model_json(model: &ServedModel) -> JsonValue {
    json!({
        "id": model.name,
        "object": "model",
        "created": model.created_unix_seconds,
        "owned_by": "ninfer",
        "max_model_len": model.resources.max_context,
        "ready": model.ready_engines > 0,
    })
}

/// OpenAI's model list.
pub fn model_list_json<'a>(models: impl Iterator<Item = &'a ServedModel>) -> JsonValue {
    let data: Vec<JsonValue> = models.map(model_json).collect();
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::openai_response_format;
    use crate::chat::ResponseFormat;

    #[test]
    fn response_formats_parse_and_refuse() {
        assert_eq!(
            openai_response_format(Some(&json!({"type": "json_object"}))).unwrap(),
            ResponseFormat::JsonObject
        );
        assert!(openai_response_format(Some(&json!({"type": "yaml"}))).is_err());
        assert!(openai_response_format(Some(&json!({"type": "json_schema"}))).is_err());
    }

    #[test]
    fn usage_reports_the_prompt_tokens_the_engine_cached() {
        let usage = super::usage_json(300, 7, 256);
        assert_eq!(usage["prompt_tokens"], 300);
        assert_eq!(usage["total_tokens"], 307);
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 256);
    }
}
