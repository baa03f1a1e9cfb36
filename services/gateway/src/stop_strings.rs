//! Stop strings, checked on detokenized text across token boundaries.
//!
//! Owns: [`StopStringMatcher`], which releases text only once it can no longer be the start of a
//! stop string, so a client never sees any part of a stop string, even one split over tokens.
//! Must not touch: tokens or the engine; the generation driver cancels the engine on a match.

/// Outcome of feeding text to the matcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopCheck {
    /// No stop string yet; `release` is safe to show.
    Continue { release: String },
    /// A stop string matched: show `release` (the text before it) and stop.
    Stopped { release: String, matched: String },
}

/// Holds back the longest suffix of the text that is a prefix of a stop string.
#[derive(Debug, Default)]
pub struct StopStringMatcher {
    stop_strings: Vec<String>,
    pending: String,
}

impl StopStringMatcher {
    pub fn new(stop_strings: Vec<String>) -> Self {
        let stop_strings = stop_strings
            .into_iter()
            .filter(|stop| !stop.is_empty())
            .collect();
        StopStringMatcher {
            stop_strings,
            pending: String::new(),
        }
    }

    /// Feeds the next text; without stop strings it is released as it is (no copy).
    pub fn push(&mut self, text: impl Into<String> + AsRef<str>) -> StopCheck {
        if self.stop_strings.is_empty() {
            return StopCheck::Continue {
                release: text.into(),
            };
        }
        self.pending.push_str(text.as_ref());
        // The earliest match wins; among matches at the same place, the longest.
        let earliest = self
            .stop_strings
            .iter()
            .filter_map(|stop| {
                self.pending
                    .find(stop.as_str())
                    .map(|position| (position, std::cmp::Reverse(stop.len()), stop))
            })
            .min();
        if let Some((position, _, stop)) = earliest {
            let release = self.pending[..position].to_string();
            let matched = stop.clone();
            self.pending.clear();
            return StopCheck::Stopped { release, matched };
        }
        let held_from = self.start_of_longest_partial_match();
        let release = self.pending[..held_from].to_string();
        self.pending.drain(..held_from);
        StopCheck::Continue { release }
    }

    /// End of generation without a match: whatever was held back is ordinary text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Byte index where the longest suffix of `pending` that is a proper prefix of a stop string
    /// begins (`pending.len()` when there is none).
    fn start_of_longest_partial_match(&self) -> usize {
        for (start, _) in self.pending.char_indices() {
            let suffix = &self.pending[start..];
            if self
                .stop_strings
                .iter()
                .any(|stop| stop.len() > suffix.len() && stop.starts_with(suffix))
            {
                return start;
            }
        }
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_split_over_tokens_is_never_emitted() {
        let mut matcher = StopStringMatcher::new(vec!["STOP".to_string()]);
        assert_eq!(
            matcher.push("hello S"),
            StopCheck::Continue {
                release: "hello ".to_string()
            }
        );
        assert_eq!(
            matcher.push("T"),
            StopCheck::Continue {
                release: String::new()
            }
        );
        assert_eq!(
            matcher.push("OP and more"),
            StopCheck::Stopped {
                release: String::new(),
                matched: "STOP".to_string()
            }
        );
    }

    #[test]
    fn false_start_is_released() {
        let mut matcher = StopStringMatcher::new(vec!["STOP".to_string()]);
        assert_eq!(
            matcher.push("ST"),
            StopCheck::Continue {
                release: String::new()
            }
        );
        assert_eq!(
            matcher.push("ay"),
            StopCheck::Continue {
                release: "STay".to_string()
            }
        );
        assert_eq!(
            matcher.push("ST"),
            StopCheck::Continue {
                release: String::new()
            }
        );
        assert_eq!(matcher.finish(), "ST");
    }

    #[test]
    fn earliest_of_several_wins() {
        let mut matcher = StopStringMatcher::new(vec!["world".to_string(), "lo".to_string()]);
        assert_eq!(
            matcher.push("hello world"),
            StopCheck::Stopped {
                release: "hel".to_string(),
                matched: "lo".to_string()
            }
        );
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let mut matcher = StopStringMatcher::new(vec!["éx".to_string()]);
        assert_eq!(
            matcher.push("aé"),
            StopCheck::Continue {
                release: "a".to_string()
            }
        );
        assert_eq!(
            matcher.push("y"),
            StopCheck::Continue {
                release: "éy".to_string()
            }
        );
    }
}
