//! Reading a request body: within the size limit, and refusing a prompt that is certainly too
//! long for the context while the body still arrives.
//!
//! Owns: [`JsonRequestBody`], the extractor every JSON endpoint reads its body with, and the
//! streaming scan behind it. As chunks arrive, the decoded bytes of the prompt texts the
//! endpoint's JSON carries (message contents and their text parts, a completion prompt, a system
//! prompt or instructions) are counted; once even the most bytes a token can cover make that
//! more tokens than the model's context, the body is no longer kept: the rest is read and
//! dropped chunk by chunk (still counted, for the figure in the error) and the request is
//! refused with the same error the tokenizer gives, without parsing megabytes into JSON values.
//! A body that is not certainly too long is kept whole and parsed as before.
//! Must not touch: what a request means (handlers parse it), tokenization itself (`tokenizer`).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header::CONTENT_LENGTH;
use futures_util::StreamExt;

use crate::error::GatewayError;
use crate::state::GatewayState;

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
    let mut scan = PromptTextScan::new(PromptFields::for_path(request.uri().path()));
    let mut kept: Vec<Bytes> = Vec::new();
    let mut received = 0usize;
    let mut refusing = false;
    let mut stream = request.into_body().into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|error| {
            GatewayError::invalid(format!("could not read the request body: {error}"))
        })?;
        received += chunk.len();
        if received > limit {
            return Err(GatewayError::BodyTooLarge { limit_bytes: limit });
        }
        scan.feed(&chunk);
        if refusing {
            continue;
        }
        if scan.counting() && refusal(state, &scan, scan.prompt_bytes).is_some() {
            // Certainly too long: keep nothing more; the rest is only counted.
            refusing = true;
            kept = Vec::new();
            continue;
        }
        kept.push(chunk);
    }
    if refusing {
        if let Some(error) = refusal(state, &scan, scan.prompt_bytes) {
            return Err(error);
        }
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

/// The error the model the request names would give a prompt of `prompt_bytes` from its size
/// alone; `None` when it might fit (or when it is not clear which model is meant).
fn refusal(
    state: &Arc<GatewayState>,
    scan: &PromptTextScan,
    prompt_bytes: usize,
) -> Option<GatewayError> {
    let snapshot = state.backend.snapshot();
    let model = if snapshot.models.len() == 1 {
        snapshot.models.values().next()
    } else {
        let named = std::str::from_utf8(scan.model_name.as_deref()?).ok()?;
        snapshot.models.get(named)
    }?;
    model
        .resources
        .tokenizer
        .check_size_alone(prompt_bytes)
        .err()
}

/// Which JSON fields carry prompt text for an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromptFields {
    /// OpenAI chat: `messages[].content` (a string or text parts).
    Chat,
    /// OpenAI completions: `prompt` when it is one string.
    Completion,
    /// Anthropic messages: `system` and `messages[].content`.
    AnthropicMessages,
    /// OpenAI Responses: `instructions` and `input` (a string or items with content).
    Responses,
    /// Nothing is counted.
    None,
}

impl PromptFields {
    fn for_path(path: &str) -> Self {
        match path {
            "/v1/chat/completions" => PromptFields::Chat,
            "/v1/completions" => PromptFields::Completion,
            "/v1/messages" => PromptFields::AnthropicMessages,
            "/v1/responses" => PromptFields::Responses,
            _ => PromptFields::None,
        }
    }

    /// Whether a string at `path` is text that goes into the prompt as it is.
    fn counts(self, path: &[Step]) -> bool {
        use Field::*;
        use Step::{Item, Key};
        // A message list's contents: a string, or text parts.
        let contents = |list: Field| {
            matches!(path, [Key(f), Item, Key(Content)] if *f == list)
                || matches!(path, [Key(f), Item, Key(Content), Item, Key(Text)] if *f == list)
        };
        match self {
            PromptFields::Chat => contents(Messages),
            PromptFields::Completion => matches!(path, [Key(Prompt)]),
            PromptFields::AnthropicMessages => {
                contents(Messages) || matches!(path, [Key(System)] | [Key(System), Item, Key(Text)])
            }
            PromptFields::Responses => {
                contents(Input) || matches!(path, [Key(Input)] | [Key(Instructions)])
            }
            PromptFields::None => false,
        }
    }
}

/// The object keys the scan tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Messages,
    Content,
    Text,
    Prompt,
    System,
    Input,
    Instructions,
    Model,
    Other,
}

impl Field {
    fn of_key(key: &[u8]) -> Field {
        match key {
            b"messages" => Field::Messages,
            b"content" => Field::Content,
            b"text" => Field::Text,
            b"prompt" => Field::Prompt,
            b"system" => Field::System,
            b"input" => Field::Input,
            b"instructions" => Field::Instructions,
            b"model" => Field::Model,
            _ => Field::Other,
        }
    }
}

/// One step of the path to a value: an object's field or an array's item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Key(Field),
    Item,
}

/// An open object or array.
#[derive(Debug, Clone, Copy)]
struct Container {
    is_object: bool,
    /// Objects: the field whose value comes next (or is being read).
    field: Field,
    /// Objects: a key is expected next (after `{` or `,`), not a value.
    expecting_key: bool,
}

/// Deeper bodies are not scanned further (serde refuses them anyway); nothing is counted.
const DEEPEST_SCANNED: usize = 64;
/// Longest key told apart, and longest model name kept.
const LONGEST_KEY: usize = 16;
const LONGEST_MODEL_NAME: usize = 256;

/// What the string being read is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StringRole {
    Key,
    CountedText,
    ModelName,
    Ignored,
}

/// A byte-by-byte JSON scan that counts the decoded bytes of prompt text (an escape counts as
/// one byte: a lower bound) without keeping the body. It trusts the JSON to be well formed; a
/// body that is not is refused by the parser when it is not certainly too long.
struct PromptTextScan {
    fields: PromptFields,
    stack: Vec<Container>,
    path: Vec<Step>,
    in_string: Option<StringRole>,
    /// 0: none; 1: after a backslash; 2..=5: hex digits of `\u` still to skip.
    escape: u8,
    key: Vec<u8>,
    model_name: Option<Vec<u8>>,
    prompt_bytes: usize,
    gave_up: bool,
}

impl PromptTextScan {
    fn new(fields: PromptFields) -> Self {
        PromptTextScan {
            fields,
            stack: Vec::new(),
            path: Vec::new(),
            in_string: None,
            escape: 0,
            key: Vec::new(),
            model_name: None,
            prompt_bytes: 0,
            gave_up: fields == PromptFields::None,
        }
    }

    /// Whether the count means anything (an endpoint with a prompt, a body still followed).
    fn counting(&self) -> bool {
        !self.gave_up
    }

    fn feed(&mut self, bytes: &[u8]) {
        if self.gave_up {
            return;
        }
        let mut index = 0;
        while index < bytes.len() {
            if let Some(role) = self.in_string {
                // Fast path through ordinary string bytes.
                if self.escape == 0 {
                    let run = memchr::memchr2(b'"', b'\\', &bytes[index..])
                        .unwrap_or(bytes.len() - index);
                    self.take_string_bytes(role, &bytes[index..index + run], run);
                    index += run;
                    if index == bytes.len() {
                        break;
                    }
                }
                let byte = bytes[index];
                index += 1;
                match self.escape {
                    0 if byte == b'\\' => self.escape = 1,
                    0 => self.end_string(role),
                    1 => {
                        // One escaped character: at least one byte of text.
                        self.take_string_bytes(role, &[byte], 1);
                        self.escape = if byte == b'u' { 5 } else { 0 };
                    }
                    2 => self.escape = 0,
                    _ => self.escape -= 1,
                }
                continue;
            }
            let byte = bytes[index];
            index += 1;
            match byte {
                b'{' | b'[' => {
                    if self.stack.len() >= DEEPEST_SCANNED {
                        self.gave_up = true;
                        return;
                    }
                    self.enter_value();
                    self.stack.push(Container {
                        is_object: byte == b'{',
                        field: Field::Other,
                        expecting_key: byte == b'{',
                    });
                }
                b'}' | b']' => {
                    self.stack.pop();
                    self.path.pop();
                }
                b':' => {
                    if let Some(top) = self.stack.last_mut() {
                        top.expecting_key = false;
                    }
                }
                b',' => {
                    if let Some(top) = self.stack.last_mut() {
                        top.expecting_key = top.is_object;
                    }
                }
                b'"' => {
                    let role = match self.stack.last() {
                        Some(top) if top.is_object && top.expecting_key => {
                            self.key.clear();
                            StringRole::Key
                        }
                        _ => {
                            self.enter_value();
                            if self.fields.counts(&self.path) {
                                StringRole::CountedText
                            } else if self.path == [Step::Key(Field::Model)] {
                                self.model_name = Some(Vec::new());
                                StringRole::ModelName
                            } else {
                                StringRole::Ignored
                            }
                        }
                    };
                    self.in_string = Some(role);
                }
                _ => {}
            }
        }
    }

    /// A value starts in the innermost container: the path gains its step (replacing the
    /// previous sibling's).
    fn enter_value(&mut self) {
        let depth = self.stack.len();
        self.path.truncate(depth.saturating_sub(1));
        if let Some(top) = self.stack.last() {
            self.path.push(if top.is_object {
                Step::Key(top.field)
            } else {
                Step::Item
            });
        }
    }

    fn take_string_bytes(&mut self, role: StringRole, bytes: &[u8], decoded: usize) {
        match role {
            StringRole::CountedText => self.prompt_bytes += decoded,
            StringRole::Key => {
                if self.key.len() <= LONGEST_KEY {
                    let room = LONGEST_KEY + 1 - self.key.len();
                    self.key.extend_from_slice(&bytes[..bytes.len().min(room)]);
                }
            }
            StringRole::ModelName => {
                if let Some(name) = self.model_name.as_mut() {
                    if name.len() <= LONGEST_MODEL_NAME {
                        name.extend_from_slice(bytes);
                    }
                }
            }
            StringRole::Ignored => {}
        }
    }

    fn end_string(&mut self, role: StringRole) {
        self.in_string = None;
        match role {
            StringRole::Key => {
                let field = Field::of_key(&self.key);
                if let Some(top) = self.stack.last_mut() {
                    top.field = field;
                }
            }
            // A string value ends: the next value of this container replaces its path step.
            _ => {
                if self.path.len() > self.stack.len().saturating_sub(1) {
                    self.path.truncate(self.stack.len().saturating_sub(1));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanned(fields: PromptFields, body: &str, chunk: usize) -> PromptTextScan {
        let mut scan = PromptTextScan::new(fields);
        for piece in body.as_bytes().chunks(chunk.max(1)) {
            scan.feed(piece);
        }
        scan
    }

    #[test]
    fn counts_only_prompt_text_whatever_the_chunking() {
        let body = r#"{"model":"m1","tools":[{"content":"zzzz"}],"messages":[{"role":"user","content":"abc\"d\u00e9"},{"role":"assistant","content":[{"type":"text","text":"xy"},{"type":"image_url","image_url":{"url":"qqqq"}}]}],"stop":["0123456789"]}"#;
        for chunk in [1, 2, 3, 7, 1000] {
            let scan = scanned(PromptFields::Chat, body, chunk);
            // `abc\"d\u00e9`: 3 + 1 + 1 + 1 (an escape counts as one byte); `xy`: 2.
            assert_eq!(scan.prompt_bytes, 8, "chunk {chunk}");
            assert_eq!(scan.model_name.as_deref(), Some(&b"m1"[..]));
            assert!(scan.counting());
        }
    }

    #[test]
    fn each_endpoint_counts_its_own_fields() {
        let completion = r#"{"prompt":"hello","suffix":"zz","model":"m"}"#;
        assert_eq!(
            scanned(PromptFields::Completion, completion, 4).prompt_bytes,
            5
        );
        let batch = r#"{"prompt":["hello","world"]}"#;
        assert_eq!(scanned(PromptFields::Completion, batch, 4).prompt_bytes, 0);
        let anthropic = r#"{"system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"tool_result","content":"not counted"}]}]}"#;
        assert_eq!(
            scanned(PromptFields::AnthropicMessages, anthropic, 5).prompt_bytes,
            5
        );
        let responses = r#"{"instructions":"be","input":[{"role":"user","content":[{"type":"input_text","text":"abc"}]}]}"#;
        assert_eq!(
            scanned(PromptFields::Responses, responses, 3).prompt_bytes,
            5
        );
        assert!(!scanned(PromptFields::None, responses, 3).counting());
    }
}
