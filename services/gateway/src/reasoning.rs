//! Splits Qwen `<think>…</think>` output into reasoning and answer, while streaming.
//!
//! Owns: [`ReasoningSplitter`], a small state machine over text deltas. It holds back only what
//! could still be part of `<think>`/`</think>` (or the newlines around them) so streamed reasoning
//! and content are exactly what the non-streamed response holds.
//! Must not touch: stop strings (applied before this) or token ids.

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// Where generation starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningStart {
    /// The prompt ended with an open `<think>` (Qwen thinking mode): output starts as reasoning.
    InsideThinking,
    /// Output is content unless it opens with `<think>`.
    DetectOpeningTag,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SplitterState {
    AwaitingOpeningTag,
    Reasoning { at_start: bool },
    Content { at_start: bool },
}

/// Text split into the two channels.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SplitText {
    pub reasoning: String,
    pub content: String,
}

impl SplitText {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
}

pub struct ReasoningSplitter {
    state: SplitterState,
    pending: String,
}

impl ReasoningSplitter {
    pub fn new(start: ReasoningStart) -> Self {
        let state = match start {
            ReasoningStart::InsideThinking => SplitterState::Reasoning { at_start: true },
            ReasoningStart::DetectOpeningTag => SplitterState::AwaitingOpeningTag,
        };
        ReasoningSplitter {
            state,
            pending: String::new(),
        }
    }

    /// Feeds a text delta; returns what can be shown now. Text that passes whole is moved, not
    /// copied.
    pub fn push(&mut self, text: impl Into<String> + AsRef<str>) -> SplitText {
        if self.pending.is_empty() {
            self.pending = text.into();
        } else {
            self.pending.push_str(text.as_ref());
        }
        let mut output = SplitText::default();
        self.advance(&mut output, false);
        output
    }

    /// End of generation: flushes everything held back.
    pub fn finish(&mut self) -> SplitText {
        let mut output = SplitText::default();
        self.advance(&mut output, true);
        output
    }

    fn advance(&mut self, output: &mut SplitText, at_end: bool) {
        loop {
            match self.state {
                SplitterState::AwaitingOpeningTag => {
                    let trimmed = self.pending.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(THINK_OPEN) {
                        self.pending = rest.to_string();
                        self.state = SplitterState::Reasoning { at_start: true };
                        continue;
                    }
                    if !at_end && THINK_OPEN.starts_with(trimmed) {
                        return; // could still become `<think>`
                    }
                    self.state = SplitterState::Content { at_start: false };
                    continue;
                }
                SplitterState::Reasoning { at_start } => {
                    let mut text = std::mem::take(&mut self.pending);
                    if at_start {
                        let stripped = text.trim_start_matches('\n');
                        if stripped.is_empty() && !at_end {
                            self.pending = text; // only newlines so far: keep waiting
                            return;
                        }
                        text = stripped.to_string();
                    }
                    // Most tokens hold no `<`: no search for the tag then.
                    let close = match memchr::memchr(b'<', text.as_bytes()) {
                        Some(_) => text.find(THINK_CLOSE),
                        None => None,
                    };
                    if let Some(position) = close {
                        output
                            .reasoning
                            .push_str(text[..position].trim_end_matches('\n'));
                        self.pending = text[position + THINK_CLOSE.len()..].to_string();
                        self.state = SplitterState::Content { at_start: true };
                        continue;
                    }
                    if at_end {
                        push_or_move(&mut output.reasoning, text);
                        self.state = SplitterState::Reasoning { at_start: false };
                        return;
                    }
                    let held_from = hold_back_start(&text, THINK_CLOSE);
                    if held_from == text.len() {
                        push_or_move(&mut output.reasoning, text);
                    } else {
                        output.reasoning.push_str(&text[..held_from]);
                        self.pending = text[held_from..].to_string();
                    }
                    self.state = SplitterState::Reasoning {
                        at_start: at_start && held_from == 0,
                    };
                    return;
                }
                SplitterState::Content { at_start } => {
                    let text = std::mem::take(&mut self.pending);
                    if at_start {
                        let stripped = text.trim_start_matches('\n');
                        if stripped.is_empty() && !at_end {
                            self.pending = text;
                            return;
                        }
                        output.content.push_str(stripped);
                    } else {
                        push_or_move(&mut output.content, text);
                    }
                    self.state = SplitterState::Content { at_start: false };
                    return;
                }
            }
        }
    }
}

/// Appends `text` to `into`, moving it when `into` is empty.
fn push_or_move(into: &mut String, text: String) {
    if into.is_empty() {
        *into = text;
    } else {
        into.push_str(&text);
    }
}

/// Index from which `text` must be held back: the longest suffix that is a proper prefix of `tag`,
/// extended backwards over the newlines before it (they belong before the tag and are dropped).
fn hold_back_start(text: &str, tag: &str) -> usize {
    let mut start = text.len();
    // Only a suffix from the tag's first byte on can begin the tag.
    let first_candidate = tag
        .as_bytes()
        .first()
        .and_then(|first| memchr::memchr(*first, text.as_bytes()))
        .unwrap_or(text.len());
    for (index, _) in text[first_candidate..].char_indices() {
        let index = first_candidate + index;
        let suffix = &text[index..];
        if tag.len() > suffix.len() && tag.starts_with(suffix) {
            start = index;
            break;
        }
    }
    let before = &text[..start];
    before.trim_end_matches('\n').len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(start: ReasoningStart, pieces: &[&str]) -> SplitText {
        let mut splitter = ReasoningSplitter::new(start);
        let mut all = SplitText::default();
        for piece in pieces {
            let out = splitter.push(*piece);
            all.reasoning.push_str(&out.reasoning);
            all.content.push_str(&out.content);
        }
        let out = splitter.finish();
        all.reasoning.push_str(&out.reasoning);
        all.content.push_str(&out.content);
        all
    }

    #[test]
    fn thinking_prompt_splits_at_close_tag_in_any_chunking() {
        let text = "Let me think.\nDone.\n</think>\n\nThe answer.";
        for split in 0..text.len() {
            if !text.is_char_boundary(split) {
                continue;
            }
            let result = run(
                ReasoningStart::InsideThinking,
                &[&text[..split], &text[split..]],
            );
            assert_eq!(result.reasoning, "Let me think.\nDone.", "split at {split}");
            assert_eq!(result.content, "The answer.", "split at {split}");
        }
    }

    #[test]
    fn opening_tag_is_detected() {
        let result = run(
            ReasoningStart::DetectOpeningTag,
            &["<thi", "nk>\nhmm</think>\n\nyes"],
        );
        assert_eq!(
            result,
            SplitText {
                reasoning: "hmm".into(),
                content: "yes".into()
            }
        );
        let result = run(ReasoningStart::DetectOpeningTag, &["<b>plain"]);
        assert_eq!(
            result,
            SplitText {
                reasoning: String::new(),
                content: "<b>plain".into()
            }
        );
    }

    #[test]
    fn unfinished_reasoning_is_flushed_as_reasoning() {
        let result = run(ReasoningStart::InsideThinking, &["still thinking</thi"]);
        assert_eq!(result.reasoning, "still thinking</thi");
        assert_eq!(result.content, "");
    }
}
