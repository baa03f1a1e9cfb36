//! The JSON of a streamed chat completion's text chunks, written straight into a string.
//!
//! Owns: [`ChatChunkText`], which renders the chunk every generated token becomes
//! (`{"id":…,"object":"chat.completion.chunk",…,"choices":[{"index":…,"delta":{…},
//! "logprobs":null,"finish_reason":null}]}`) from a prefix made once per request — byte for
//! byte what building the same object as a `serde_json::Value` and printing it gives (key order
//! as written, serde_json's string escaping), without building a map per token.
//! Must not touch: which chunks a stream sends or when (that is `openai`), other chunk shapes
//! (the first, the finishing and the usage chunks are rare and stay `Value`s).

use crate::event_stream::Event;
use crate::json_text::{push_json_bytes, push_json_string};

/// Renders the text chunks of one streamed chat completion.
pub struct ChatChunkText {
    /// `{"id":…,"object":"chat.completion.chunk","created":…,"model":…,"choices":[{"index":`
    prefix: String,
    /// `stream_options.include_usage`: every chunk but the last carries `"usage":null`.
    include_usage: bool,
}

impl ChatChunkText {
    pub fn new(id: &str, created: u64, model: &str, include_usage: bool) -> Self {
        let mut prefix = String::from("{\"id\":");
        push_json_string(&mut prefix, id);
        prefix.push_str(",\"object\":\"chat.completion.chunk\",\"created\":");
        prefix.push_str(&created.to_string());
        prefix.push_str(",\"model\":");
        push_json_string(&mut prefix, model);
        prefix.push_str(",\"choices\":[{\"index\":");
        ChatChunkText {
            prefix,
            include_usage,
        }
    }

    /// The chunk of choice `index` carrying `reasoning` as `reasoning_content` and `content`,
    /// each left out when empty; no logprobs.
    pub fn delta(&self, index: usize, reasoning: &str, content: &str) -> String {
        let mut chunk = Vec::with_capacity(self.delta_capacity(reasoning, content));
        self.write_delta(&mut chunk, index, reasoning, content);
        // Only strings and ASCII were written.
        String::from_utf8(chunk)
            .unwrap_or_else(|error| String::from_utf8_lossy(error.as_bytes()).into_owned())
    }

    /// [`Self::delta`] as the server-sent event it is streamed in, written in place.
    pub fn delta_event(&self, index: usize, reasoning: &str, content: &str) -> Event {
        Event::data_written(self.delta_capacity(reasoning, content), |line| {
            self.write_delta(line, index, reasoning, content)
        })
    }

    fn delta_capacity(&self, reasoning: &str, content: &str) -> usize {
        // Escapes rarely add more than a few bytes; a longer chunk grows once.
        self.prefix.len() + 112 + reasoning.len() + content.len()
    }

    fn write_delta(&self, chunk: &mut Vec<u8>, index: usize, reasoning: &str, content: &str) {
        chunk.extend_from_slice(self.prefix.as_bytes());
        push_decimal(chunk, index);
        chunk.extend_from_slice(b",\"delta\":{");
        if !reasoning.is_empty() {
            chunk.extend_from_slice(b"\"reasoning_content\":");
            push_json_bytes(chunk, reasoning);
        }
        if !content.is_empty() {
            if !reasoning.is_empty() {
                chunk.push(b',');
            }
            chunk.extend_from_slice(b"\"content\":");
            push_json_bytes(chunk, content);
        }
        chunk.extend_from_slice(b"},\"logprobs\":null,\"finish_reason\":null}]");
        if self.include_usage {
            chunk.extend_from_slice(b",\"usage\":null");
        }
        chunk.push(b'}');
    }
}

/// Appends `value` in decimal.
fn push_decimal(into: &mut Vec<u8>, value: usize) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    let mut rest = value;
    loop {
        start -= 1;
        digits[start] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    into.extend_from_slice(&digits[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// The chunk as `openai` builds the rare ones: a `Value`, printed.
    fn as_value(
        id: &str,
        model: &str,
        index: usize,
        reasoning: &str,
        content: &str,
        usage: bool,
    ) -> String {
        let mut delta = serde_json::Map::new();
        if !reasoning.is_empty() {
            delta.insert("reasoning_content".to_string(), Value::from(reasoning));
        }
        if !content.is_empty() {
            delta.insert("content".to_string(), Value::from(content));
        }
        let mut value = json!({"id": id, "object": "chat.completion.chunk", "created": 1_796_535_894u64, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": null}]});
        if usage {
            value["usage"] = Value::Null;
        }
        value.to_string()
    }

    #[test]
    fn text_chunks_are_the_bytes_of_the_printed_value() {
        let texts = [
            "",
            "plain",
            " leading space",
            "quote \" backslash \\ slash /",
            "new\nline\ttab\r\u{0}\u{1f}\u{7f}",
            "naïve café — 漢字 🐉",
            "\u{2028}\u{2029}\u{FFFD}",
            "<think>\n</think>\n\n<tool_call>{\"a\":1}</tool_call>",
        ];
        for (id, model) in [
            ("chatcmpl-9219a4571a3b000025", "tiny"),
            ("chatcmpl-\"odd\"", "qwen/ä\\b"),
        ] {
            for usage in [false, true] {
                let writer = ChatChunkText::new(id, 1_796_535_894, model, usage);
                for reasoning in texts {
                    for content in texts {
                        for index in [0, 7, 15, 10, 123_456] {
                            let expected = as_value(id, model, index, reasoning, content, usage);
                            assert_eq!(
                                writer.delta(index, reasoning, content),
                                expected,
                                "{reasoning:?} {content:?}"
                            );
                            assert_eq!(
                                writer.delta_event(index, reasoning, content).into_frame(),
                                format!("data: {expected}\n\n").as_bytes(),
                                "{reasoning:?} {content:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
