//! Tool calls in generated text (Qwen formats) turned into structured calls.
//!
//! Owns: parsing `<tool_call>…</tool_call>` blocks, both the Qwen3.5/3.6 XML form
//! (`<function=NAME>` + `<parameter=KEY>value</parameter>`) and the Qwen3 JSON form
//! (`{"name": ..., "arguments": {...}}`); typing parameter values from the tool's JSON schema;
//! and [`ToolCallCapture`], which streams the text before the first `<tool_call>` and keeps the
//! rest for parsing at the end.
//! Must not touch: API JSON shapes (handlers build `tool_calls` / `tool_use` from the result).

use serde_json::{Map, Value as JsonValue};

const OPEN_TAG: &str = "<tool_call>";
const CLOSE_TAG: &str = "</tool_call>";

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedToolCall {
    pub name: String,
    pub arguments: Map<String, JsonValue>,
}

impl ParsedToolCall {
    /// Arguments as the JSON string OpenAI puts in `function.arguments`.
    pub fn arguments_json(&self) -> String {
        JsonValue::Object(self.arguments.clone()).to_string()
    }
}

/// How an answer ended, as far as its last tool call is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerEnd {
    /// The model ended it (end-of-sequence, a stop string): an unclosed last block is the
    /// model's whole call and is parsed to the end.
    Finished,
    /// `max_tokens` or the context cut it: an unclosed last block is half a call, neither a
    /// call nor text (the client is told `length` / `max_tokens`).
    Cut,
}

impl AnswerEnd {
    pub fn of(finish: crate::generation::FinishKind) -> Self {
        match finish {
            crate::generation::FinishKind::Length => AnswerEnd::Cut,
            _ => AnswerEnd::Finished,
        }
    }
}

/// Splits a whole answer into the text before the first tool call and the calls.
/// Text that looks like a call but does not parse stays text, except half a call in a cut
/// answer, which is dropped.
pub fn split_tool_calls(
    content: &str,
    tools: &[minijinja::Value],
    end: AnswerEnd,
) -> (String, Vec<ParsedToolCall>) {
    let Some(start) = content.find(OPEN_TAG) else {
        return (content.to_string(), Vec::new());
    };
    let blocks = parse_tool_call_blocks(&content[start..], tools, end);
    if blocks.calls.is_empty() && !blocks.dropped_cut_call {
        return (content.to_string(), Vec::new());
    }
    (content[..start].trim_end().to_string(), blocks.calls)
}

/// The calls of a run of `<tool_call>` blocks.
struct ParsedBlocks {
    calls: Vec<ParsedToolCall>,
    /// A cut answer's unclosed last block was left out.
    dropped_cut_call: bool,
}

/// Parses every `<tool_call>` block of `text` (an unclosed last block is parsed to the end when
/// the model finished the answer, dropped when the answer was cut).
fn parse_tool_call_blocks(text: &str, tools: &[minijinja::Value], end: AnswerEnd) -> ParsedBlocks {
    let mut blocks = ParsedBlocks {
        calls: Vec::new(),
        dropped_cut_call: false,
    };
    let mut rest = text;
    while let Some(start) = rest.find(OPEN_TAG) {
        let after_open = &rest[start + OPEN_TAG.len()..];
        let (body, next) = match after_open.find(CLOSE_TAG) {
            Some(close) => (&after_open[..close], &after_open[close + CLOSE_TAG.len()..]),
            None if end == AnswerEnd::Cut => {
                blocks.dropped_cut_call = true;
                break;
            }
            None => (after_open, ""),
        };
        if let Some(call) = parse_one_call(body.trim(), tools) {
            blocks.calls.push(call);
        }
        rest = next;
    }
    blocks
}

fn parse_one_call(body: &str, tools: &[minijinja::Value]) -> Option<ParsedToolCall> {
    if body.starts_with('{') {
        // Qwen3: {"name": "...", "arguments": {...}}
        let value: JsonValue = serde_json::from_str(body).ok()?;
        let name = value.get("name")?.as_str()?.to_string();
        let arguments = match value.get("arguments") {
            Some(JsonValue::Object(map)) => map.clone(),
            Some(JsonValue::String(text)) => serde_json::from_str(text).ok()?,
            _ => Map::new(),
        };
        return Some(ParsedToolCall { name, arguments });
    }
    // Qwen3.5/3.6: <function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>
    let after_function = body.strip_prefix("<function=")?;
    let name_end = after_function.find('>')?;
    let name = after_function[..name_end].trim().to_string();
    let mut parameters_text = &after_function[name_end + 1..];
    if let Some(end) = parameters_text.rfind("</function>") {
        parameters_text = &parameters_text[..end];
    }
    let mut arguments = Map::new();
    let mut rest = parameters_text;
    while let Some(start) = rest.find("<parameter=") {
        let after = &rest[start + "<parameter=".len()..];
        let key_end = after.find('>')?;
        let key = after[..key_end].trim().to_string();
        let value_text = &after[key_end + 1..];
        let (raw_value, next) = match value_text.find("</parameter>") {
            Some(end) => (
                &value_text[..end],
                &value_text[end + "</parameter>".len()..],
            ),
            None => (value_text, ""),
        };
        // The template writes "\n" around each value; take exactly those off.
        let value = raw_value.strip_prefix('\n').unwrap_or(raw_value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        arguments.insert(
            key.clone(),
            typed_value(value, schema_type(tools, &name, &key).as_deref()),
        );
        rest = next;
    }
    Some(ParsedToolCall { name, arguments })
}

/// `parameters.properties[key].type` of tool `name`, if declared.
fn schema_type(tools: &[minijinja::Value], name: &str, key: &str) -> Option<String> {
    let attribute = |value: &minijinja::Value, field: &str| {
        value
            .get_item(&minijinja::Value::from(field))
            .ok()
            .filter(|v| !v.is_undefined())
    };
    for tool in tools {
        let function = attribute(tool, "function").unwrap_or_else(|| tool.clone());
        if attribute(&function, "name")
            .map(|n| n.to_string())
            .as_deref()
            != Some(name)
        {
            continue;
        }
        let parameters =
            attribute(&function, "parameters").or_else(|| attribute(&function, "input_schema"))?;
        let property = attribute(&attribute(&parameters, "properties")?, key)?;
        return attribute(&property, "type").map(|t| t.to_string());
    }
    None
}

/// A parameter value: a string unless the schema says otherwise and it parses as JSON.
fn typed_value(text: &str, schema_type: Option<&str>) -> JsonValue {
    match schema_type {
        Some("string") => JsonValue::String(text.to_string()),
        Some(_) => serde_json::from_str(text.trim())
            .unwrap_or_else(|_| JsonValue::String(text.to_string())),
        // Undeclared: numbers, booleans, objects stay typed when they parse; anything else is text.
        None => match serde_json::from_str::<JsonValue>(text.trim()) {
            Ok(value) if !value.is_string() => value,
            _ => JsonValue::String(text.to_string()),
        },
    }
}

/// Streaming: passes text through until `<tool_call>` appears, then keeps everything for parsing.
#[derive(Debug, Default)]
pub struct ToolCallCapture {
    pending: String,
    captured: Option<String>,
}

impl ToolCallCapture {
    /// Feeds content; returns what can be shown now.
    pub fn push(&mut self, text: &str) -> String {
        if let Some(captured) = self.captured.as_mut() {
            captured.push_str(text);
            return String::new();
        }
        self.pending.push_str(text);
        if let Some(start) = self.pending.find(OPEN_TAG) {
            // The whitespace before the call is dropped, as in the unstreamed answer.
            let release = self.pending[..start].trim_end().to_string();
            self.captured = Some(self.pending[start..].to_string());
            self.pending.clear();
            return release;
        }
        let held_from = self
            .pending
            .char_indices()
            .map(|(index, _)| index)
            .find(|index| {
                let suffix = &self.pending[*index..];
                OPEN_TAG.len() > suffix.len() && OPEN_TAG.starts_with(suffix)
            })
            .unwrap_or(self.pending.len());
        // Trailing whitespace waits too: it is dropped if a call follows.
        let held_from = self.pending[..held_from].trim_end().len();
        let release = self.pending[..held_from].to_string();
        self.pending.drain(..held_from);
        release
    }

    /// End of the answer: the calls, and any text that turned out not to be a call (never
    /// half a call of a cut answer).
    pub fn finish(
        &mut self,
        tools: &[minijinja::Value],
        end: AnswerEnd,
    ) -> (String, Vec<ParsedToolCall>) {
        let pending = std::mem::take(&mut self.pending);
        match self.captured.take() {
            None => (pending, Vec::new()),
            Some(captured) => {
                let blocks = parse_tool_call_blocks(&captured, tools, end);
                if blocks.calls.is_empty() && !blocks.dropped_cut_call {
                    (captured, Vec::new())
                } else {
                    (String::new(), blocks.calls)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather_tool() -> minijinja::Value {
        serde_json::from_str(
            r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}"#,
        )
        .unwrap_or_default()
    }

    #[test]
    fn xml_calls_are_parsed_with_schema_types() {
        let text = "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n94107\n</parameter>\n</function>\n</tool_call>";
        let (content, calls) = split_tool_calls(text, &[weather_tool()], AnswerEnd::Finished);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments["city"], "San Francisco");
        assert_eq!(calls[0].arguments["days"], 3);
        assert_eq!(calls[0].arguments["zip"], "94107");
    }

    #[test]
    fn json_calls_and_several_blocks() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>";
        let (content, calls) = split_tool_calls(text, &[], AnswerEnd::Finished);
        assert_eq!(content, "");
        assert_eq!(
            calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(calls[0].arguments_json(), "{\"x\":1}");
    }

    #[test]
    fn streaming_capture_holds_back_a_split_tag() {
        let mut capture = ToolCallCapture::default();
        let mut shown = String::new();
        for piece in ["Sure. <tool", "_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"] {
            shown.push_str(&capture.push(piece));
        }
        let (rest, calls) = capture.finish(&[weather_tool()], AnswerEnd::Finished);
        assert_eq!(shown, "Sure.");
        assert_eq!(rest, "");
        assert_eq!(calls[0].arguments["city"], "Oslo");
        let mut plain = ToolCallCapture::default();
        assert_eq!(plain.push("a <b>"), "a <b>");
        assert_eq!(plain.push(" <tool"), "");
        assert_eq!(
            plain.finish(&[], AnswerEnd::Finished),
            (" <tool".to_string(), Vec::new())
        );
    }

    #[test]
    fn half_a_call_in_a_cut_answer_is_neither_a_call_nor_text() {
        let cut = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOs";
        // The model's own end: the unclosed block is its whole call.
        let (content, calls) = split_tool_calls(cut, &[weather_tool()], AnswerEnd::Finished);
        assert_eq!((content.as_str(), calls.len()), ("Checking.", 1));
        // Cut by max_tokens: no call, and no half block in the text.
        let (content, calls) = split_tool_calls(cut, &[weather_tool()], AnswerEnd::Cut);
        assert_eq!(content, "Checking.");
        assert!(calls.is_empty());
        // A complete call before the cut one is kept.
        let two = format!(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n{}",
            &cut[10..]
        );
        let (content, calls) = split_tool_calls(&two, &[weather_tool()], AnswerEnd::Cut);
        assert_eq!((content.as_str(), calls.len()), ("", 1));
        // Streaming: what was held back is dropped, not released as text.
        let mut capture = ToolCallCapture::default();
        assert_eq!(capture.push(cut), "Checking.");
        assert_eq!(
            capture.finish(&[weather_tool()], AnswerEnd::Cut),
            (String::new(), Vec::new())
        );
    }
}
