//! The JSON of the Responses API's streaming events, numbered in the order they are made, the
//! text and reasoning deltas every generated token becomes written straight into a string:
//! byte for byte what building the same `serde_json::Value` and printing it gives (key order as
//! written, serde_json's escaping), without building a map per token.
//!
//! Owns: [`ResponseEventSequence`] and [`ResponseDelta`]. Must not touch: which events a stream
//! sends or when (that is `responses`).

use serde_json::Value as JsonValue;

use crate::event_stream::Event;
use crate::json_text::push_json_string;

/// What a Responses delta event carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseDelta {
    /// `response.output_text.delta` (with `"logprobs":[]`).
    OutputText,
    /// `response.reasoning_text.delta`.
    ReasoningText,
}

impl ResponseDelta {
    pub fn event_type(self) -> &'static str {
        match self {
            ResponseDelta::OutputText => "response.output_text.delta",
            ResponseDelta::ReasoningText => "response.reasoning_text.delta",
        }
    }
}

/// The events of one streamed response, numbered in the order they are made: each event's data
/// ends with its `type` and `sequence_number`.
#[derive(Debug, Default)]
pub struct ResponseEventSequence {
    next: u64,
}

impl ResponseEventSequence {
    /// An event from its data as a `Value` (the rare events: items added and done, the end).
    pub fn value(&mut self, kind: &str, mut data: JsonValue) -> Event {
        data["type"] = JsonValue::from(kind);
        data["sequence_number"] = JsonValue::from(self.take_number());
        Event::named(kind, &data.to_string())
    }

    /// A delta event: `{"item_id":…,"output_index":…,"content_index":0,"delta":…` (then
    /// `"logprobs":[]` for output text), `"type"`, `"sequence_number"`.
    pub fn delta(
        &mut self,
        kind: ResponseDelta,
        item_id: &str,
        output_index: usize,
        delta: &str,
    ) -> Event {
        let data = self.delta_data(kind, item_id, output_index, delta);
        Event::named(kind.event_type(), &data)
    }

    fn delta_data(
        &mut self,
        kind: ResponseDelta,
        item_id: &str,
        output_index: usize,
        delta: &str,
    ) -> String {
        let mut data = String::with_capacity(160 + item_id.len() + delta.len());
        data.push_str("{\"item_id\":");
        push_json_string(&mut data, item_id);
        data.push_str(",\"output_index\":");
        data.push_str(&output_index.to_string());
        data.push_str(",\"content_index\":0,\"delta\":");
        push_json_string(&mut data, delta);
        if kind == ResponseDelta::OutputText {
            data.push_str(",\"logprobs\":[]");
        }
        data.push_str(",\"type\":\"");
        data.push_str(kind.event_type());
        data.push_str("\",\"sequence_number\":");
        data.push_str(&self.take_number().to_string());
        data.push('}');
        data
    }

    fn take_number(&mut self) -> u64 {
        let number = self.next;
        self.next += 1;
        number
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use crate::json_text::ESCAPE_CASES as TEXTS;

    #[test]
    fn response_deltas_are_the_bytes_of_the_printed_value_and_share_the_numbering() {
        let mut written = ResponseEventSequence::default();
        let mut expected_number = 0u64;
        for text in TEXTS {
            for (item_id, index) in [("msg_abc", 0), ("rs_\"odd\"", 4)] {
                for kind in [ResponseDelta::OutputText, ResponseDelta::ReasoningText] {
                    let mut value = match kind {
                        ResponseDelta::OutputText => {
                            json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []})
                        }
                        ResponseDelta::ReasoningText => {
                            json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": text})
                        }
                    };
                    value["type"] = JsonValue::from(kind.event_type());
                    value["sequence_number"] = JsonValue::from(expected_number);
                    expected_number += 1;
                    assert_eq!(
                        written.delta_data(kind, item_id, index, text),
                        value.to_string()
                    );
                }
            }
            // A `Value` event between deltas takes the next number.
            let _ = written.value("response.output_item.added", json!({"output_index": 0}));
            expected_number += 1;
        }
    }
}
