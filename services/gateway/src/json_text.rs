//! JSON text written straight into a string by the per-token stream writers of every dialect
//! (`openai_chunks`, `anthropic_stream_deltas`, `responses_stream_events`).
//!
//! Owns: [`push_json_string`] and [`push_json_bytes`], a string escaped exactly as serde_json escapes it. Must not touch:
//! any event's shape (the dialects' writers).

/// Appends `text` as a JSON string, escaped as serde_json escapes it, to bytes being written.
pub fn push_json_bytes(into: &mut Vec<u8>, text: &str) {
    // Writing a `&str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(into, text);
}

/// Appends `text` as a JSON string, escaped as serde_json escapes it.
pub fn push_json_string(into: &mut String, text: &str) {
    let mut bytes = std::mem::take(into).into_bytes();
    push_json_bytes(&mut bytes, text);
    // serde_json writes valid UTF-8 after valid UTF-8.
    *into = String::from_utf8(bytes)
        .unwrap_or_else(|error| String::from_utf8_lossy(error.as_bytes()).into_owned());
}

/// Texts that exercise every escape serde_json writes (quotes, backslashes, control
/// characters, non-ASCII, line separators): the per-token writers' tests render each.
#[cfg(test)]
pub(crate) const ESCAPE_CASES: [&str; 7] = [
    "plain",
    " leading space",
    "quote \" backslash \\ slash /",
    "new\nline\ttab\r\u{0}\u{1f}\u{7f}",
    "naïve café — 漢字 🐉",
    "\u{2028}\u{2029}\u{FFFD}",
    "<think>\n</think>\n\n<tool_call>{\"a\":1}</tool_call>",
];
