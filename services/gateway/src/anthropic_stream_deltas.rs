//! The JSON of the Anthropic `content_block_delta` event every generated token becomes, written
//! straight into a string, as `openai_chunks` does for chat completion chunks: byte for byte
//! what building the same `serde_json::Value` and printing it gives (key order as written,
//! serde_json's escaping), without building a map per token.
//!
//! Owns: [`anthropic_block_delta`]. Must not touch: which events a stream sends or when (that
//! is `anthropic`).

use crate::json_text::push_json_string;

/// What an Anthropic `content_block_delta` carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnthropicDelta {
    /// `{"type":"text_delta","text":…}`
    Text,
    /// `{"type":"thinking_delta","thinking":…}`
    Thinking,
}

/// `{"type":"content_block_delta","index":…,"delta":{"type":"text_delta","text":…}}` (or the
/// thinking delta).
pub fn anthropic_block_delta(index: i64, kind: AnthropicDelta, text: &str) -> String {
    let mut data = String::with_capacity(96 + text.len());
    data.push_str("{\"type\":\"content_block_delta\",\"index\":");
    data.push_str(&index.to_string());
    data.push_str(match kind {
        AnthropicDelta::Text => ",\"delta\":{\"type\":\"text_delta\",\"text\":",
        AnthropicDelta::Thinking => ",\"delta\":{\"type\":\"thinking_delta\",\"thinking\":",
    });
    push_json_string(&mut data, text);
    data.push_str("}}");
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use crate::json_text::ESCAPE_CASES as TEXTS;

    #[test]
    fn anthropic_deltas_are_the_bytes_of_the_printed_value() {
        for text in TEXTS {
            for index in [0i64, 3, 12] {
                assert_eq!(
                    anthropic_block_delta(index, AnthropicDelta::Text, text),
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}).to_string()
                );
                assert_eq!(
                    anthropic_block_delta(index, AnthropicDelta::Thinking, text),
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": text}}).to_string()
                );
            }
        }
    }
}
