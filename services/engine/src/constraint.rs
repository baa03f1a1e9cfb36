//! Constrained decoding: which tokens a sequence may sample next.
//!
//! Owns: the tokenizer's token byte strings as the grammar engine (llguidance) sees them
//! ([`GuidanceTokens`], built once per model on first use and shared), compiling a request's
//! grammar into a matcher, and the per-sequence [`Guide`]: the reasoning block at the start of
//! the output (opened by the model or by the prompt, closed by the model or by the engine when
//! its budget is spent) and the grammar that applies after it.
//! Must not touch: sampling itself (the scheduler masks the row, then samples as usual), text.
//!
//! Why llguidance: it computes a token mask from a grammar's lexer and Earley state over a
//! token trie in tens of microseconds for 200K-token vocabularies, takes JSON schemas and Lark
//! grammars, and is maintained with the inference servers that use it; a mask is exact, so a
//! constrained sequence only ever holds text the grammar can complete.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

/// Why a constraint could not be set up or followed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConstraintError {
    /// The model's tokenizer cannot be read as byte strings per token.
    #[error("constrained decoding is not available for this model's tokenizer: {0}")]
    Tokenizer(String),
    /// The request's grammar does not compile.
    #[error("the output grammar is invalid: {0}")]
    Grammar(String),
    /// The request's reasoning settings do not fit the vocabulary.
    #[error("invalid reasoning settings: {0}")]
    Reasoning(String),
    /// The matcher refused a token or failed (a bug or an impossible grammar).
    #[error("constrained decoding failed: {0}")]
    Matcher(String),
    /// Every token the grammar allows is banned (by `logit_bias` or the sampleable vocabulary).
    #[error("no token that the output grammar allows can be sampled")]
    NothingAllowed,
}

/// The token byte strings of one model's tokenizer, as a trie, with the grammar compiler.
pub struct GuidanceTokens {
    factory: ParserFactory,
    vocab: usize,
}

impl GuidanceTokens {
    /// From a Hugging Face `tokenizer.json` (byte-level BPE, or byte-fallback pieces), for a
    /// model whose rows number `vocab` (ids the tokenizer lacks are never allowed) and which
    /// ends with any of `eos_token_ids`.
    pub fn from_tokenizer_json(
        tokenizer_json: &[u8],
        vocab: usize,
        eos_token_ids: &[u32],
    ) -> Result<Self, ConstraintError> {
        let json: serde_json::Value = serde_json::from_slice(tokenizer_json)
            .map_err(|error| ConstraintError::Tokenizer(format!("tokenizer.json: {error}")))?;
        let mut words = token_bytes(&json)?;
        if words.len() > vocab {
            return Err(ConstraintError::Tokenizer(format!(
                "the tokenizer has {} tokens, more than the model's {vocab}",
                words.len()
            )));
        }
        words.resize(vocab, Vec::new());
        let eos: Vec<u32> = eos_token_ids
            .iter()
            .copied()
            .filter(|&id| (id as usize) < vocab)
            .collect();
        let Some(&first_eos) = eos.first() else {
            return Err(ConstraintError::Tokenizer(
                "the model has no end-of-sequence token".into(),
            ));
        };
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|error| ConstraintError::Tokenizer(error.to_string()))?;
        factory.quiet();
        Ok(GuidanceTokens { factory, vocab })
    }

    /// A matcher at the start of `lark` (llguidance's Lark dialect).
    pub fn matcher(&self, lark: &str) -> Result<Matcher, ConstraintError> {
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|error| ConstraintError::Grammar(error.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(ConstraintError::Grammar(error));
        }
        Ok(matcher)
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }
}

/// [`GuidanceTokens`] built on the first constrained request (a trie over the whole vocabulary
/// costs a fraction of a second, which unconstrained serving never pays).
#[derive(Default)]
pub struct GuidanceCache {
    tokens: OnceLock<Result<Arc<GuidanceTokens>, ConstraintError>>,
}

impl GuidanceCache {
    pub fn get_or_build(
        &self,
        build: impl FnOnce() -> Result<GuidanceTokens, ConstraintError>,
    ) -> Result<Arc<GuidanceTokens>, ConstraintError> {
        self.tokens.get_or_init(|| build().map(Arc::new)).clone()
    }
}

/// The byte string of every token id of a `tokenizer.json`; special added tokens start with
/// llguidance's marker byte so grammar text never matches them. Unused ids are empty.
pub fn token_bytes(json: &serde_json::Value) -> Result<Vec<Vec<u8>>, ConstraintError> {
    let decoder = &json["decoder"];
    let decoders: Vec<&serde_json::Value> = match decoder["decoders"].as_array() {
        Some(list) => list.iter().collect(),
        None => vec![decoder],
    };
    let kind = |value: &serde_json::Value| value["type"].as_str().unwrap_or("").to_string();
    let byte_level = decoders.iter().any(|d| kind(d) == "ByteLevel");
    let byte_fallback = decoders.iter().any(|d| kind(d) == "ByteFallback");
    // Sentencepiece-style pieces spell a space as `▁` (a Replace or Metaspace decoder).
    let space = decoders
        .iter()
        .find_map(|d| match kind(d).as_str() {
            "Replace" if d["content"].as_str() == Some(" ") => d["pattern"]["String"]
                .as_str()
                .and_then(|s| s.chars().next()),
            "Metaspace" => Some(d["replacement"].as_str().and_then(|s| s.chars().next())?),
            _ => None,
        })
        .unwrap_or('\u{2581}');
    if !byte_level && !byte_fallback {
        return Err(ConstraintError::Tokenizer(format!(
            "its decoder ({}) is neither byte-level nor byte-fallback",
            kind(decoder)
        )));
    }
    let unicode_to_byte = byte_level_alphabet();
    let mut words: Vec<Vec<u8>> = Vec::new();
    let mut put = |id: usize, bytes: Vec<u8>| {
        if words.len() <= id {
            words.resize(id + 1, Vec::new());
        }
        words[id] = bytes;
    };
    let vocab = json["model"]["vocab"]
        .as_object()
        .ok_or_else(|| ConstraintError::Tokenizer("tokenizer.json has no model.vocab".into()))?;
    for (piece, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| ConstraintError::Tokenizer(format!("token `{piece}` has no id")))?
            as usize;
        let bytes = if byte_level {
            piece
                .chars()
                .map(|c| unicode_to_byte.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .ok_or_else(|| {
                    ConstraintError::Tokenizer(format!("token `{piece}` is not byte-level"))
                })?
        } else if let Some(byte) = piece
            .strip_prefix("<0x")
            .and_then(|rest| rest.strip_suffix('>'))
            .filter(|hex| hex.len() == 2)
            .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        {
            vec![byte]
        } else {
            piece.replace(space, " ").into_bytes()
        };
        put(id, bytes);
    }
    // Added tokens override the model's pieces (their text is literal, not byte-encoded).
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else {
            return Err(ConstraintError::Tokenizer(
                "an added token has no id or content".into(),
            ));
        };
        let mut bytes = Vec::with_capacity(content.len() + 1);
        if added["special"].as_bool().unwrap_or(false) {
            bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
        }
        bytes.extend_from_slice(content.as_bytes());
        put(id as usize, bytes);
    }
    Ok(words)
}

/// GPT-2's byte-level alphabet, reversed: printable bytes stand for themselves, the others for
/// the code points from U+0100 on, in byte order.
fn byte_level_alphabet() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut map = std::collections::HashMap::with_capacity(256);
    for byte in 0..=255u8 {
        let c = if printable(byte) {
            char::from(byte)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
        map.insert(c, byte);
    }
    map
}

/// A reasoning block at the start of the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ReasoningRule {
    /// The model opens the block with this token first; `None`: the output starts inside it.
    pub start_token: Option<u32>,
    /// The token that closes it.
    pub end_token: u32,
    /// At most this many tokens inside (0 = no limit).
    pub budget: usize,
    /// What the engine emits to close it when the budget is spent (ends with or contains
    /// `end_token`).
    pub close_tokens: Vec<u32>,
}

impl ReasoningRule {
    /// Checks the token ids against a `vocab`-token model.
    pub fn validate(&self, vocab: usize) -> Result<(), ConstraintError> {
        let outside = self
            .start_token
            .iter()
            .chain([&self.end_token])
            .chain(&self.close_tokens)
            .find(|&&id| id as usize >= vocab);
        if let Some(id) = outside {
            return Err(ConstraintError::Reasoning(format!(
                "token id {id} is outside the vocabulary of {vocab} tokens"
            )));
        }
        if !self.close_tokens.is_empty() && !self.close_tokens.contains(&self.end_token) {
            return Err(ConstraintError::Reasoning(
                "close_token_ids must contain end_token_id".into(),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// Before the first token: the model may open the reasoning block.
    MayOpen,
    /// Inside the block, with `used` tokens so far.
    Reasoning { used: usize },
    /// The engine is writing the block's close.
    Closing(VecDeque<u32>),
    /// After the block (or without one): the grammar, if any, applies.
    Answer,
}

/// What the next token may be.
#[derive(Debug, Clone)]
pub enum Allowed {
    /// Anything (sampling as usual, candidates path included).
    Any,
    /// Exactly this token (a forced close of the reasoning block).
    Only(u32),
    /// The set bits.
    Mask(SimpleVob),
}

impl Allowed {
    pub fn is_any(&self) -> bool {
        matches!(self, Allowed::Any)
    }

    /// Sets every disallowed logit of `row` to −∞; an error when nothing finite is left.
    pub fn apply(&self, row: &mut [f32]) -> Result<(), ConstraintError> {
        match self {
            Allowed::Any => return Ok(()),
            Allowed::Only(token) => {
                let kept = row.get(*token as usize).copied();
                row.fill(f32::NEG_INFINITY);
                if let (Some(slot), Some(value)) = (row.get_mut(*token as usize), kept) {
                    // A forced token is emitted whatever its logit (even a banned one).
                    *slot = if value.is_finite() { value } else { 0.0 };
                }
            }
            Allowed::Mask(mask) => {
                let words = mask.as_slice();
                for (w, chunk) in row.chunks_mut(32).enumerate() {
                    let bits = words.get(w).copied().unwrap_or(0);
                    if bits == u32::MAX {
                        continue;
                    }
                    if bits == 0 {
                        chunk.fill(f32::NEG_INFINITY);
                        continue;
                    }
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if bits & (1 << bit) == 0 {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        if row.iter().any(|logit| logit.is_finite()) {
            Ok(())
        } else {
            Err(ConstraintError::NothingAllowed)
        }
    }
}

/// One sequence's constraint: its reasoning block and its grammar.
pub struct Guide {
    phase: Phase,
    reasoning: Option<ReasoningRule>,
    matcher: Option<Matcher>,
    /// The request's stop tokens: allowed wherever the grammar may end.
    stop_tokens: Vec<u32>,
}

impl Guide {
    /// `None` when nothing constrains the sequence.
    pub fn new(
        reasoning: Option<ReasoningRule>,
        matcher: Option<Matcher>,
        stop_tokens: Vec<u32>,
    ) -> Option<Self> {
        let phase = match &reasoning {
            None => Phase::Answer,
            Some(rule) if rule.start_token.is_some() => Phase::MayOpen,
            Some(_) => Phase::Reasoning { used: 0 },
        };
        if matcher.is_none() && reasoning.as_ref().is_none_or(|rule| rule.budget == 0) {
            return None;
        }
        Some(Guide {
            phase,
            reasoning,
            matcher,
            stop_tokens,
        })
    }

    /// What the next token may be. Cheap when [`Allowed::Any`]; a grammar mask costs one
    /// llguidance step.
    pub fn allowed(&mut self) -> Result<Allowed, ConstraintError> {
        if let Phase::Reasoning { used } = self.phase {
            if let Some(rule) = &self.reasoning {
                if rule.budget > 0 && used >= rule.budget {
                    let close: VecDeque<u32> = if rule.close_tokens.is_empty() {
                        VecDeque::from([rule.end_token])
                    } else {
                        rule.close_tokens.iter().copied().collect()
                    };
                    self.phase = Phase::Closing(close);
                }
            }
        }
        match &self.phase {
            Phase::Reasoning { .. } => Ok(Allowed::Any),
            Phase::Closing(queue) => Ok(queue.front().map_or(Allowed::Any, |&t| Allowed::Only(t))),
            Phase::MayOpen => {
                let start = self.reasoning.as_ref().and_then(|rule| rule.start_token);
                match self.grammar_mask()? {
                    None => Ok(Allowed::Any),
                    Some(mut mask) => {
                        if let Some(start) = start {
                            if (start as usize) < mask.len() {
                                mask.allow_token(start);
                            }
                        }
                        Ok(Allowed::Mask(mask))
                    }
                }
            }
            Phase::Answer => Ok(self.grammar_mask()?.map_or(Allowed::Any, Allowed::Mask)),
        }
    }

    /// The grammar's mask with the stop tokens wherever it may end; `None` without a grammar.
    fn grammar_mask(&mut self) -> Result<Option<SimpleVob>, ConstraintError> {
        let Some(matcher) = self.matcher.as_mut() else {
            return Ok(None);
        };
        let mut mask = matcher
            .compute_mask_or_eos()
            .map_err(|error| ConstraintError::Matcher(error.to_string()))?;
        let may_end = matcher.is_stopped()
            || matcher
                .is_accepting()
                .map_err(|error| ConstraintError::Matcher(error.to_string()))?;
        if may_end {
            for &stop in &self.stop_tokens {
                if (stop as usize) < mask.len() {
                    mask.allow_token(stop);
                }
            }
        }
        Ok(Some(mask))
    }

    /// Moves past `token`, the one sampled from [`Guide::allowed`].
    pub fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        let end = self.reasoning.as_ref().map(|rule| rule.end_token);
        match &mut self.phase {
            Phase::MayOpen => {
                let start = self.reasoning.as_ref().and_then(|rule| rule.start_token);
                if start == Some(token) {
                    self.phase = Phase::Reasoning { used: 0 };
                    return Ok(());
                }
                self.phase = Phase::Answer;
                self.consume(token)
            }
            Phase::Reasoning { used } => {
                *used += 1;
                if end == Some(token) {
                    self.phase = Phase::Answer;
                }
                Ok(())
            }
            Phase::Closing(queue) => {
                if queue.front() == Some(&token) {
                    queue.pop_front();
                }
                if queue.is_empty() {
                    self.phase = Phase::Answer;
                }
                Ok(())
            }
            Phase::Answer => self.consume(token),
        }
    }

    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        if self.stop_tokens.contains(&token) {
            return Ok(());
        }
        match self.matcher.as_mut() {
            Some(matcher) => matcher
                .consume_token(token)
                .map_err(|error| ConstraintError::Matcher(error.to_string())),
            None => Ok(()),
        }
    }

    /// Whether the sequence is inside its reasoning block (opened or being closed).
    pub fn in_reasoning(&self) -> bool {
        matches!(self.phase, Phase::Reasoning { .. } | Phase::Closing(_))
    }
}

/// The guide of one request: its reasoning block and its grammar compiled against the model's
/// tokens (built into `cache` on first use from `tokenizer_json`); `None` when neither
/// constrains anything.
pub fn guide_for_request(
    cache: &GuidanceCache,
    tokenizer_json: &[u8],
    vocab: usize,
    eos_token_ids: &[u32],
    reasoning: Option<ReasoningRule>,
    lark_grammar: &str,
    stop_tokens: Vec<u32>,
) -> Result<Option<Guide>, ConstraintError> {
    if let Some(rule) = &reasoning {
        rule.validate(vocab)?;
    }
    if lark_grammar.trim().is_empty() {
        return Ok(Guide::new(reasoning, None, stop_tokens));
    }
    let tokens = cache.get_or_build(|| {
        GuidanceTokens::from_tokenizer_json(tokenizer_json, vocab, eos_token_ids)
    })?;
    let matcher = tokens.matcher(lark_grammar)?;
    Ok(Guide::new(reasoning, Some(matcher), stop_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixtures' byte-level BPE tokenizer (493 tokens, model rows 512).
    pub(crate) fn fixture_tokens() -> (Vec<u8>, GuidanceTokens) {
        let path = crate::testing::golden_fixture_dir("qwen3_moe").join("tokenizer.json");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let tokens = GuidanceTokens::from_tokenizer_json(&bytes, 512, &[482, 480]).unwrap();
        (bytes, tokens)
    }

    #[test]
    fn token_bytes_follow_the_byte_level_alphabet() {
        let (bytes, _) = fixture_tokens();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let words = token_bytes(&json).unwrap();
        assert_eq!(words.len(), 493);
        // `Ġ` is the byte-level spelling of a space, `Ċ` of a newline.
        let vocab = json["model"]["vocab"].as_object().unwrap();
        for (piece, id) in vocab {
            let expected: String = piece.replace('Ġ', " ").replace('Ċ', "\n");
            if piece
                .chars()
                .all(|c| c.is_ascii_graphic() || c == 'Ġ' || c == 'Ċ')
            {
                assert_eq!(
                    words[id.as_u64().unwrap() as usize],
                    expected.as_bytes(),
                    "{piece}"
                );
            }
        }
        // Special added tokens carry the marker; the others are their literal text.
        assert_eq!(words[482], b"\xff<|im_end|>");
        assert_eq!(words[485], b"<tool_call>");
    }

    #[test]
    fn a_tokenizer_without_byte_pieces_is_refused() {
        let json =
            serde_json::json!({"decoder": {"type": "WordPiece"}, "model": {"vocab": {"a": 0}}});
        assert!(matches!(
            token_bytes(&json),
            Err(ConstraintError::Tokenizer(_))
        ));
    }

    #[test]
    fn a_bad_grammar_is_an_error_not_a_panic() {
        let (_, tokens) = fixture_tokens();
        for bad in [
            "start: %json {",
            "start: undefined_rule",
            "start: %json { \"if\": {} }",
        ] {
            assert!(
                matches!(tokens.matcher(bad), Err(ConstraintError::Grammar(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn masks_keep_only_what_the_grammar_allows() {
        let (_, tokens) = fixture_tokens();
        let matcher = tokens.matcher("start: \"yes\" | \"no\"").unwrap();
        let mut guide = Guide::new(None, Some(matcher), vec![482]).unwrap();
        let Allowed::Mask(mask) = guide.allowed().unwrap() else {
            panic!("a grammar gives a mask");
        };
        let json: serde_json::Value = serde_json::from_slice(&fixture_tokens().0).unwrap();
        let words = token_bytes(&json).unwrap();
        for id in 0..512u32 {
            let word = words.get(id as usize).cloned().unwrap_or_default();
            let allowed =
                !word.is_empty() && (b"yes".starts_with(&word) || b"no".starts_with(&word));
            assert_eq!(mask.is_allowed(id), allowed, "token {id} {word:?}");
        }
        let mut row = vec![1.0f32; 512];
        Allowed::Mask(mask).apply(&mut row).unwrap();
        assert!(
            row[482].is_infinite(),
            "the stop token waits for a complete answer"
        );
    }

    #[test]
    fn the_reasoning_budget_forces_the_close_then_the_grammar_applies() {
        let (_, tokens) = fixture_tokens();
        let rule = ReasoningRule {
            start_token: None,
            end_token: 484,
            budget: 3,
            close_tokens: vec![198, 484, 198],
        };
        let matcher = tokens.matcher("start: \"yes\"").unwrap();
        let mut guide = Guide::new(Some(rule), Some(matcher), vec![482]).unwrap();
        for token in [10u32, 11, 12] {
            assert!(guide.allowed().unwrap().is_any());
            guide.accept(token).unwrap();
        }
        for forced in [198u32, 484, 198] {
            assert!(matches!(guide.allowed().unwrap(), Allowed::Only(t) if t == forced));
            guide.accept(forced).unwrap();
        }
        assert!(!guide.in_reasoning());
        assert!(matches!(guide.allowed().unwrap(), Allowed::Mask(_)));
        // Without a grammar and without a budget nothing is constrained.
        assert!(Guide::new(
            Some(ReasoningRule {
                start_token: Some(483),
                end_token: 484,
                budget: 0,
                close_tokens: Vec::new(),
            }),
            None,
            vec![482]
        )
        .is_none());
    }

    /// The per-step cost of a JSON-schema mask over a vocabulary of released size: the
    /// fixture's pieces plus random byte strings up to 248,320 ids (`cargo test -p
    /// ninfer-engine --release --lib mask_cost -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn mask_cost_on_a_large_vocabulary() {
        let (bytes, _) = fixture_tokens();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let mut words = token_bytes(&json).unwrap();
        let mut rng = crate::sampling::Xoshiro256::seed_from_u64(1);
        let alphabet =
            b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]\":,._-\n";
        while words.len() < 248_077 {
            let len = 1 + (rng.next_u64() % 9) as usize;
            words.push(
                (0..len)
                    .map(|_| alphabet[(rng.next_u64() % alphabet.len() as u64) as usize])
                    .collect(),
            );
        }
        words.resize(248_320, Vec::new());
        let info = TokRxInfo::new(248_320, 482);
        let started = std::time::Instant::now();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        println!("trie and slices: {:?}", started.elapsed());
        let schema = r#"start: %json {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}"#;
        let mut matcher =
            Matcher::new(factory.create_parser(TopLevelGrammar::from_lark(schema.into())));
        let text =
            br#"{"name": "Ada Lovelace and friends", "age": 36, "tags": ["math", "poetry"]}"#;
        let mut steps = 0u32;
        let mut total = std::time::Duration::ZERO;
        let mut worst = std::time::Duration::ZERO;
        let mut rest: &[u8] = text;
        let mut row = vec![0.0f32; 248_320];
        while !rest.is_empty() {
            let started = std::time::Instant::now();
            let mask = matcher.compute_mask().unwrap();
            Allowed::Mask(mask.clone()).apply(&mut row).unwrap();
            let elapsed = started.elapsed();
            total += elapsed;
            worst = worst.max(elapsed);
            steps += 1;
            // The longest allowed token that spells the text next.
            let next = (0..248_320u32)
                .filter(|&t| {
                    mask.is_allowed(t)
                        && !words[t as usize].is_empty()
                        && rest.starts_with(&words[t as usize])
                })
                .max_by_key(|&t| words[t as usize].len())
                .unwrap();
            rest = &rest[words[next as usize].len()..];
            matcher.consume_token(next).unwrap();
            row.fill(0.0);
        }
        println!(
            "{steps} steps: mean {:?}, worst {:?} per step (mask + applying it to a 248,320 row)",
            total / steps,
            worst
        );
    }
}
