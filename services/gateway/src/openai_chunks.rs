//! The JSON of a streamed chat completion's text chunks, written straight into a string.
//!
//! Owns: [`ChatChunkText`], which renders the chunk every generated token becomes
//! (`{"id":…,"object":"chat.completion.chunk",…,"choices":[{"index":…,"delta":{…},
//! "logprobs":null,"finish_reason":null}]}`) from a prefix made once per request — byte for
//! byte what building the same object as a `serde_json::Value` and printing it gives (key order
//! as written, serde_json's string escaping), without building a map per token.
//! Must not touch: which chunks a stream sends or when (that is `openai`), other chunk shapes
//! (the first, the finishing and the usage chunks are rare and stay `Value`s).

use crate::json_text::push_json_string;

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
        let mut chunk =
            String::with_capacity(self.prefix.len() + 96 + reasoning.len() + content.len());
        chunk.push_str(&self.prefix);
        chunk.push_str(&index.to_string());
        chunk.push_str(",\"delta\":{");
        if !reasoning.is_empty() {
            chunk.push_str("\"reasoning_content\":");
            push_json_string(&mut chunk, reasoning);
        }
        if !content.is_empty() {
            if !reasoning.is_empty() {
                chunk.push(',');
            }
            chunk.push_str("\"content\":");
            push_json_string(&mut chunk, content);
        }
        chunk.push_str("},\"logprobs\":null,\"finish_reason\":null}]");
        if self.include_usage {
            chunk.push_str(",\"usage\":null");
        }
        chunk.push('}');
        chunk
    }
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
                        for index in [0, 7, 15] {
                            assert_eq!(
                                writer.delta(index, reasoning, content),
                                as_value(id, model, index, reasoning, content, usage),
                                "{reasoning:?} {content:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
