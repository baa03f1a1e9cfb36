//! The OpenAI text completions API, `/v1/completions`: a raw prompt (text or token ids), no chat
//! template.
//!
//! Owns: the request's JSON shape, its plan (the prompt tokenized as given) and the response,
//! streamed (`text_completion` chunks over SSE) or whole, with logprobs and text offsets.
//! Must not touch: chat (`openai`, whose sampling fields, SSE framing and usage it shares).

use std::sync::Arc;

use crate::event_stream::Event;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value as JsonValue};

use crate::error::{ApiDialect, GatewayError};
use crate::generation::{collect_all_generations, GenerationEvent, TokenLogprobEntry};
use crate::generation_plan::{encode_text, token_count_parameter, GenerationPlan};
use crate::inline_stream::InlineStream;
use crate::json_body::parse_json_body;
use crate::openai::{
    finish_reason_text, json_event, merged_choices, openai_error, sse_response, unix_seconds,
    usage_json, OpenAiSampling, StreamOptions,
};
use crate::request_body::JsonRequestBody;
use crate::state::GatewayState;

fn completion_logprobs_json(entries: &[TokenLogprobEntry], text_start: usize) -> JsonValue {
    let mut offset = text_start;
    let mut text_offsets = Vec::new();
    for entry in entries {
        text_offsets.push(offset);
        offset += entry.token.len();
    }
    json!({
        "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(|e| e.top.iter().map(|(t, l)| (t.clone(), JsonValue::from(*l))).collect::<serde_json::Map<String, JsonValue>>()).collect::<Vec<_>>(),
        "text_offset": text_offsets,
    })
}

/// `prompt` of `/v1/completions`: text, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum CompletionPrompt {
    Text(String),
    Texts(Vec<String>),
    TokenIds(Vec<u32>),
    TokenIdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: CompletionPrompt,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: OpenAiSampling,
    /// Completions API: number of top alternatives (0 = chosen token only).
    #[serde(default)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: Option<bool>,
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<GatewayState>>,
    body: JsonRequestBody,
) -> Response {
    match completions_inner(state, body).await {
        Ok(response) => response,
        Err(error) => openai_error(error),
    }
}

async fn completions_inner(
    state: Arc<GatewayState>,
    body: JsonRequestBody,
) -> Result<Response, GatewayError> {
    let request: CompletionRequest = parse_json_body(body)?;
    let model = state.generator.resolve_model(&request.model)?;
    if request.echo.unwrap_or(false) {
        return Err(GatewayError::invalid_parameter(
            "echo",
            "`echo` is not supported",
        ));
    }
    // The legacy default of the completions API is 16 tokens.
    let max_tokens = token_count_parameter("max_tokens", request.max_tokens)?.or(Some(16));
    let logprobs = request.logprobs.is_some();
    let options = request
        .sampling
        .to_options(max_tokens, logprobs, request.logprobs)?;
    let prompt_token_ids = match request.prompt {
        CompletionPrompt::Text(text) => encode_text(&model, text, true).await?,
        CompletionPrompt::Texts(texts) if texts.len() == 1 => {
            encode_text(&model, texts[0].clone(), true).await?
        }
        CompletionPrompt::TokenIds(ids) => {
            let vocabulary = model.resources.tokenizer.vocabulary_size() as u32;
            if let Some(bad) = ids.iter().find(|id| **id >= vocabulary) {
                return Err(GatewayError::invalid_parameter(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary (size {vocabulary})"),
                ));
            }
            ids
        }
        CompletionPrompt::TokenIdLists(lists) if lists.len() == 1 => {
            lists.into_iter().next().unwrap_or_default()
        }
        _ => {
            return Err(GatewayError::invalid_parameter(
                "prompt",
                "exactly one prompt per request is supported",
            ))
        }
    };
    let plan = GenerationPlan::new(model, prompt_token_ids, options, None)?;
    let receivers = state.generator.start_all_choices(&plan).await?;
    let id = format!("cmpl-{}", plan.request_id);
    let created = unix_seconds();
    let model_name = plan.model.name.clone();
    if request.stream.unwrap_or(false) {
        let include_usage = request
            .stream_options
            .map(|o| o.include_usage)
            .unwrap_or(false);
        let event_stream = InlineStream::new(|events| async move {
            let chunk = |choices: JsonValue, usage: Option<JsonValue>| {
                let mut value = json!({"id": id, "object": "text_completion", "created": created, "model": model_name, "choices": choices});
                if include_usage {
                    value["usage"] = usage.unwrap_or(JsonValue::Null);
                }
                json_event(&value)
            };
            let mut text_lengths = vec![0usize; receivers.len()];
            let (mut prompt_tokens, mut completion_tokens, mut cached_tokens) = (0u32, 0u32, 0u32);
            let mut merged = merged_choices(receivers);
            while let Some((index, event)) = merged.next().await {
                let message = match event {
                    Ok(GenerationEvent::Delta {
                        text,
                        logprobs: entries,
                    }) => {
                        let start = text_lengths.get(index).copied().unwrap_or(0);
                        if let Some(length) = text_lengths.get_mut(index) {
                            *length += text.content.len();
                        }
                        let logprobs_value = if logprobs {
                            completion_logprobs_json(&entries, start)
                        } else {
                            JsonValue::Null
                        };
                        chunk(
                            json!([{"index": index, "text": text.content, "logprobs": logprobs_value, "finish_reason": null}]),
                            None,
                        )
                    }
                    Ok(GenerationEvent::Finished(summary)) => {
                        prompt_tokens = summary.prompt_tokens;
                        cached_tokens = summary.cached_tokens;
                        completion_tokens += summary.completion_tokens;
                        chunk(
                            json!([{"index": index, "text": "", "logprobs": null, "finish_reason": finish_reason_text(summary.finish), "stop_reason": summary.matched_stop}]),
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
                events.send(message).await;
            }
            if include_usage {
                events
                    .send(chunk(
                        json!([]),
                        Some(usage_json(prompt_tokens, completion_tokens, cached_tokens)),
                    ))
                    .await;
            }
            events.send(Event::data_only("[DONE]")).await;
        });
        return Ok(sse_response(event_stream));
    }
    let mut choices = Vec::new();
    let (mut prompt_tokens, mut completion_tokens, mut cached_tokens) = (0, 0, 0);
    for (index, generation) in collect_all_generations(receivers)
        .await?
        .into_iter()
        .enumerate()
    {
        prompt_tokens = generation.summary.prompt_tokens;
        cached_tokens = generation.summary.cached_tokens;
        completion_tokens += generation.summary.completion_tokens;
        choices.push(json!({
            "index": index,
            "text": generation.content,
            "logprobs": if logprobs { completion_logprobs_json(&generation.logprobs, 0) } else { JsonValue::Null },
            "finish_reason": finish_reason_text(generation.summary.finish),
            "stop_reason": generation.summary.matched_stop,
        }));
    }
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage_json(prompt_tokens, completion_tokens, cached_tokens),
    }))
    .into_response())
}
