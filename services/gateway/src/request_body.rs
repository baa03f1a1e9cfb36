//! Reading a request body: within the size limit, and refusing a large input while the body
//! still arrives, before anything is parsed.
//!
//! Owns: [`JsonRequestBody`], the extractor every JSON endpoint reads its body with, and the
//! limits the body's scan (`body_scan`) is held to as chunks arrive: prompt text that even at
//! the most bytes a token can cover has more tokens than the model's context (the tokenizer's
//! own error), and [`InputLimits`] — tool definitions larger than that much text, more token
//! ids than the context, more than [`MAX_STOP_STRINGS`] stop sequences or
//! [`MAX_STOP_SEQUENCE_BYTES`] of them, more than [`MAX_LOGIT_BIAS_ENTRIES`] `logit_bias`
//! entries, document, image or video-frame data larger than the context's text, a video of more
//! frames than one may have (each a 400 naming the field and its limit). Once one is refused
//! the body is no longer kept: the rest is read and dropped chunk by chunk without parsing
//! megabytes into JSON values (after a prompt's refusal still scanned, for the model the body
//! names; after another input's not even that). A body within every limit is kept whole and
//! parsed as before.
//! Must not touch: what a request means (handlers parse it), tokenization itself (`tokenizer`).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header::CONTENT_LENGTH;
use futures_util::StreamExt;

use crate::backend::ServedModel;
use crate::body_scan::{BodyScan, InputSizes, PromptFields};
use crate::error::GatewayError;
pub use crate::generation_plan::MAX_STOP_STRINGS;
use crate::state::GatewayState;
use ninfer_vision_input::MAX_VIDEO_FRAMES;

/// Most bytes of stop sequences a request may send, all together as written in its JSON.
pub const MAX_STOP_SEQUENCE_BYTES: usize = 16 * 1024;
/// Most `logit_bias` entries a request may send.
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 1024;

/// A request body read whole, or why it was refused (too large, unreadable, or carrying a
/// prompt too long for the context).
pub struct JsonRequestBody(pub Result<Bytes, GatewayError>);

impl FromRequest<Arc<GatewayState>> for JsonRequestBody {
    type Rejection = Infallible;

    async fn from_request(
        request: Request,
        state: &Arc<GatewayState>,
    ) -> Result<Self, Self::Rejection> {
        Ok(JsonRequestBody(read_request_body(request, state).await))
    }
}

async fn read_request_body(
    request: Request,
    state: &Arc<GatewayState>,
) -> Result<Bytes, GatewayError> {
    let limit = state.settings.max_body_bytes;
    let declared_length = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared_length.is_some_and(|length| length > limit as u64) {
        return Err(GatewayError::BodyTooLarge { limit_bytes: limit });
    }
    let path = request.uri().path().to_string();
    let mut scan = BodyScan::new(PromptFields::for_path(&path));
    let mut kept: Vec<Bytes> = Vec::new();
    let mut received = 0usize;
    let mut refused_input: Option<GatewayError> = None;
    let mut refusing_prompt = false;
    let mut stream = request.into_body().into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|error| {
            GatewayError::invalid(format!("could not read the request body: {error}"))
        })?;
        received += chunk.len();
        if received > limit {
            return Err(GatewayError::BodyTooLarge { limit_bytes: limit });
        }
        if refused_input.is_some() {
            // Its error names the field and the limit, not a size: the rest is not even scanned
            // (scanning the megabytes of eight such bodies at once took up to 0.3 s).
            continue;
        }
        scan.feed(&chunk);
        if refusing_prompt {
            // Still scanned: the model may be named after the prompt, and its error is the one
            // to give.
            continue;
        }
        if scan.counting() {
            let models = candidate_models(state, &scan);
            if prompt_refusal(&models, &scan).is_some() {
                // Certainly too long: keep nothing more; the rest is only counted.
                refusing_prompt = true;
                kept = Vec::new();
                continue;
            }
            if let Some(error) = InputLimits::of_models(&models).refusal(&scan.sizes(), &path) {
                refused_input = Some(error);
                kept = Vec::new();
                continue;
            }
        }
        kept.push(chunk);
    }
    if refusing_prompt {
        if let Some(error) = prompt_refusal(&candidate_models(state, &scan), &scan) {
            return Err(error);
        }
    }
    if let Some(error) = refused_input {
        return Err(error);
    }
    Ok(match kept.len() {
        0 => Bytes::new(),
        1 => kept.remove(0),
        _ => {
            let mut whole = Vec::with_capacity(received);
            for chunk in kept {
                whole.extend_from_slice(&chunk);
            }
            Bytes::from(whole)
        }
    })
}

/// The models a body may be meant for: the one it names, else (not named yet, or unknown) every
/// served model, so that a limit holds whichever is meant.
fn candidate_models(state: &Arc<GatewayState>, scan: &BodyScan) -> Vec<ServedModel> {
    let snapshot = state.backend.snapshot();
    let named = scan
        .model_name()
        .and_then(|name| std::str::from_utf8(name).ok())
        .and_then(|name| snapshot.models.get(name));
    match named {
        Some(model) => vec![model.clone()],
        None => snapshot.models.values().cloned().collect(),
    }
}

/// The error the model the request names would give a prompt of the scan's prompt bytes from
/// its size alone; `None` when it might fit (or when it is not clear which model is meant).
fn prompt_refusal(models: &[ServedModel], scan: &BodyScan) -> Option<GatewayError> {
    // With several models and none named, the prompt might be for any: no refusal from size.
    let [model] = models else {
        return None;
    };
    model
        .resources
        .tokenizer
        .check_size_alone(scan.prompt_bytes())
        .err()
}

/// The limits of a request's large inputs other than prompt text, for the model it names (or
/// the most generous of the served ones while that is unclear).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputLimits {
    /// The model's context in tokens; `None`: unbounded.
    pub context_tokens: Option<usize>,
    /// The most bytes of text that could fit that context; `None`: unbounded.
    pub most_text_bytes: Option<usize>,
}

impl InputLimits {
    fn of_models(models: &[ServedModel]) -> InputLimits {
        let most_generous = |values: Vec<Option<usize>>| -> Option<usize> {
            if values.is_empty() || values.iter().any(Option::is_none) {
                return None;
            }
            values.into_iter().flatten().max()
        };
        InputLimits {
            context_tokens: most_generous(
                models
                    .iter()
                    .map(|model| {
                        (model.resources.max_context > 0)
                            .then_some(model.resources.max_context as usize)
                    })
                    .collect(),
            ),
            most_text_bytes: most_generous(
                models
                    .iter()
                    .map(|model| model.resources.tokenizer.most_bytes_within_limit())
                    .collect(),
            ),
        }
    }

    /// The 400 for the first input over its limit, naming the field and the limit; `None` while
    /// every one is within.
    pub fn refusal(&self, sizes: &InputSizes, path: &str) -> Option<GatewayError> {
        let anthropic = path.starts_with("/v1/messages");
        let stop_field = if anthropic { "stop_sequences" } else { "stop" };
        let token_field = if path == "/detokenize" {
            "tokens"
        } else {
            "prompt"
        };
        // The frame count first: a long clip's frames pass both limits together, and this
        // refusal says more.
        if sizes.most_video_frames > MAX_VIDEO_FRAMES {
            return Some(GatewayError::invalid_parameter(
                "messages",
                format!(
                    "a `video` part has more than {MAX_VIDEO_FRAMES} frames, the most one video may have"
                ),
            ));
        }
        if let Some(most) = self.most_text_bytes {
            if sizes.tool_definition_bytes > most {
                return Some(GatewayError::invalid_parameter(
                    "tools",
                    format!(
                        "`tools` is larger than {most} bytes: tool definitions are part of the prompt, and at most {most} bytes of text can fit this model's context of {} tokens",
                        self.context_tokens.unwrap_or(0)
                    ),
                ));
            }
            if sizes.document_bytes > most {
                return Some(GatewayError::invalid_parameter(
                    "messages",
                    format!(
                        "the documents, images and video frames sent inline (`data` / `file_data`, image and frame data URLs) are larger than {most} bytes, the most this model's context of {} tokens can take",
                        self.context_tokens.unwrap_or(0)
                    ),
                ));
            }
        }
        if let Some(context) = self.context_tokens {
            if sizes.token_ids > context {
                return Some(GatewayError::invalid_parameter(
                    token_field,
                    format!(
                        "`{token_field}` has more than {context} token ids; this model's context is {context} tokens"
                    ),
                ));
            }
        }
        if sizes.stop_sequences > MAX_STOP_STRINGS {
            return Some(GatewayError::invalid_parameter(
                stop_field,
                format!("`{stop_field}` has more than {MAX_STOP_STRINGS} entries; at most {MAX_STOP_STRINGS} stop sequences are allowed"),
            ));
        }
        if sizes.stop_sequence_bytes > MAX_STOP_SEQUENCE_BYTES {
            return Some(GatewayError::invalid_parameter(
                stop_field,
                format!("`{stop_field}` is larger than {MAX_STOP_SEQUENCE_BYTES} bytes, the most stop sequences may take"),
            ));
        }
        if sizes.logit_bias_entries > MAX_LOGIT_BIAS_ENTRIES {
            return Some(GatewayError::invalid_parameter(
                "logit_bias",
                format!(
                    "`logit_bias` has more than {MAX_LOGIT_BIAS_ENTRIES} entries, the most allowed"
                ),
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_input_over_its_limit_is_refused_naming_the_field_and_the_limit() {
        let limits = InputLimits {
            context_tokens: Some(4096),
            most_text_bytes: Some(100_000),
        };
        let within = InputSizes {
            tool_definition_bytes: 100_000,
            token_ids: 4096,
            stop_sequences: MAX_STOP_STRINGS,
            stop_sequence_bytes: MAX_STOP_SEQUENCE_BYTES,
            logit_bias_entries: MAX_LOGIT_BIAS_ENTRIES,
            document_bytes: 100_000,
            most_video_frames: MAX_VIDEO_FRAMES,
        };
        assert!(limits.refusal(&within, "/v1/chat/completions").is_none());
        let cases: [(InputSizes, &str, &str, &str); 8] = [
            (
                InputSizes {
                    tool_definition_bytes: 100_001,
                    ..within
                },
                "/v1/chat/completions",
                "tools",
                "100000 bytes",
            ),
            (
                InputSizes {
                    token_ids: 4097,
                    ..within
                },
                "/v1/completions",
                "prompt",
                "4096 token ids",
            ),
            (
                InputSizes {
                    token_ids: 4097,
                    ..within
                },
                "/detokenize",
                "tokens",
                "4096 token ids",
            ),
            (
                InputSizes {
                    stop_sequences: MAX_STOP_STRINGS + 1,
                    ..within
                },
                "/v1/chat/completions",
                "stop",
                "16 stop sequences",
            ),
            (
                InputSizes {
                    stop_sequence_bytes: MAX_STOP_SEQUENCE_BYTES + 1,
                    ..within
                },
                "/v1/messages",
                "stop_sequences",
                "16384 bytes",
            ),
            (
                InputSizes {
                    logit_bias_entries: MAX_LOGIT_BIAS_ENTRIES + 1,
                    ..within
                },
                "/v1/chat/completions",
                "logit_bias",
                "1024 entries",
            ),
            (
                InputSizes {
                    document_bytes: 100_001,
                    ..within
                },
                "/v1/messages",
                "messages",
                "100000 bytes",
            ),
            (
                InputSizes {
                    most_video_frames: MAX_VIDEO_FRAMES + 1,
                    ..within
                },
                "/v1/chat/completions",
                "messages",
                "64 frames",
            ),
        ];
        for (sizes, path, field, limit) in cases {
            match limits.refusal(&sizes, path) {
                Some(GatewayError::InvalidRequest { message, parameter }) => {
                    assert_eq!(parameter.as_deref(), Some(field), "{message}");
                    assert!(message.contains(limit), "{message}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
        let unbounded = InputLimits {
            context_tokens: None,
            most_text_bytes: None,
        };
        let large = InputSizes {
            tool_definition_bytes: usize::MAX,
            token_ids: usize::MAX,
            document_bytes: usize::MAX,
            ..within
        };
        assert!(unbounded.refusal(&large, "/v1/completions").is_none());
    }
}
