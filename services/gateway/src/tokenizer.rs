//! The model's tokenizer, text ↔ token ids, and streaming detokenization.
//!
//! Owns: parsing the engine-supplied `tokenizer.json` with the `tokenizers` crate, encoding
//! prompts within the context (a prompt too long for it is refused after counting at most the
//! context's worth of tokens, never by tokenizing all of it), encoding a rendered chat so that
//! special tokens typed in messages stay text (only the template's own are control tokens),
//! reusing the ids of long pieces between the template's control tokens that an earlier request
//! already encoded (an agent's system prompt and tools, every turn; see `prompt_token_cache`),
//! decoding ids, and [`IncrementalDetokenizer`], which turns a token stream into text deltas
//! without ever emitting half a UTF-8 character or a byte-level fragment.
//! Must not touch: stop strings or reasoning splitting (see `stop_strings`, `reasoning`).

use minijinja::value::ValueKind;
use minijinja::Value;
use tokenizers::Tokenizer;

use crate::chat_template::{ChatTemplate, ChatTemplateInput};
use crate::error::GatewayError;
use crate::prompt_token_cache::{
    PromptTokenCache, PromptTokenCacheStats, DEFAULT_PROMPT_TOKEN_CACHE_BYTES,
};
use crate::token_bytes::TokenBytes;

/// Texts up to this size are encoded in one go; larger ones are first counted in chunks of about
/// this size, so a prompt far beyond the context costs a context's worth of work and memory.
const CHUNK_BYTES: usize = 64 * 1024;

/// How far past a chunk's nominal end a clean split point (before a space-led word) is looked
/// for; past it the chunk is cut at a character boundary and its count may be off by a token.
const SPLIT_SEARCH_BYTES: usize = 4 * 1024;

/// Stands for a special token a client typed, while the chat template renders: a private-use
/// character, the token's index among the special tokens, another private-use character.
const TYPED_SPECIAL_OPEN: char = '\u{F0000}';
const TYPED_SPECIAL_CLOSE: char = '\u{F0001}';

/// Whether control tokens typed in chat messages are encoded as control tokens (the raw,
/// forgeable behaviour some deployments want) or as the text they spell (the default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TypedControlTokens {
    /// `<|im_end|>` in a message is the text `<|im_end|>`: many ordinary tokens.
    #[default]
    AsText,
    /// `<|im_end|>` in a message is the control token: a client can forge chat-role boundaries.
    AsControlTokens,
}

/// A loaded tokenizer; cheap to share behind an `Arc`.
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    /// The same tokenizer with special tokens matched as plain text (for what clients typed).
    plain_text_tokenizer: Tokenizer,
    /// The special tokens' texts, longest first (so the longest match wins at a position).
    special_token_texts: Vec<(String, u32)>,
    /// Bytes of input one token covers at most, when that can be bounded (byte-level BPE
    /// under a normalizer that shrinks text by a bounded factor): a text longer than the limit
    /// times this is refused from its length alone.
    most_bytes_per_token: Option<usize>,
    /// Most tokens a prompt may have (the context); `None`: unbounded.
    token_limit: Option<usize>,
    /// Tokens in the vocabulary, added tokens included. Counted once at load: the `tokenizers`
    /// crate builds the whole vocabulary map to count it, far too slow for every token.
    vocabulary_size: usize,
    /// Every token's bytes, for byte-level vocabularies: decoding without the crate's
    /// per-call work (see `token_bytes`).
    token_bytes: Option<TokenBytes>,
    typed_control_tokens: TypedControlTokens,
    /// Ids of long rendered-chat pieces from earlier requests; `None` when cutting at the
    /// special tokens is not exactly what the tokenizer itself does (see
    /// [`cuts_as_the_tokenizer_does`]), so reusing pieces' ids could change a prompt's.
    prompt_token_cache: Option<PromptTokenCache>,
}

impl ModelTokenizer {
    /// Parses the bytes of a Hugging Face `tokenizer.json`.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self, GatewayError> {
        let parse = || {
            Tokenizer::from_bytes(bytes).map_err(|error| {
                GatewayError::Internal(format!(
                    "the engine's tokenizer.json does not parse: {error}"
                ))
            })
        };
        let tokenizer = parse()?;
        let mut plain_text_tokenizer = parse()?;
        plain_text_tokenizer.set_encode_special_tokens(true);
        let mut special_token_texts: Vec<(String, u32)> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special && !token.content.is_empty())
            .map(|(id, token)| (token.content, id))
            .collect();
        special_token_texts.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let most_bytes_per_token = most_bytes_per_token(&tokenizer, bytes);
        let vocabulary_size = tokenizer.get_vocab_size(true);
        let token_bytes = TokenBytes::of(&tokenizer, vocabulary_size);
        let prompt_token_cache = cuts_as_the_tokenizer_does(&tokenizer)
            .then(|| PromptTokenCache::new(DEFAULT_PROMPT_TOKEN_CACHE_BYTES));
        Ok(ModelTokenizer {
            prompt_token_cache,
            vocabulary_size,
            token_bytes,
            tokenizer,
            plain_text_tokenizer,
            special_token_texts,
            most_bytes_per_token,
            token_limit: None,
            typed_control_tokens: TypedControlTokens::default(),
        })
    }

    /// Refuses (as a context overflow) any prompt of more than `limit` tokens; 0 = no limit.
    pub fn with_token_limit(mut self, limit: usize) -> Self {
        self.token_limit = (limit > 0).then_some(limit);
        self
    }

    /// Keeps at most `budget_bytes` of long prompt pieces' ids between requests (0: none), when
    /// this tokenizer allows reusing them exactly.
    pub fn with_prompt_token_cache_bytes(mut self, budget_bytes: usize) -> Self {
        if self.prompt_token_cache.is_some() {
            self.prompt_token_cache = Some(PromptTokenCache::new(budget_bytes));
        }
        self
    }

    /// What the prompt-token cache has done and holds; `None` when this tokenizer has none.
    pub fn prompt_token_cache_stats(&self) -> Option<PromptTokenCacheStats> {
        self.prompt_token_cache
            .as_ref()
            .map(PromptTokenCache::stats)
    }

    /// How control tokens typed in chat messages are encoded.
    pub fn with_typed_control_tokens(mut self, typed: TypedControlTokens) -> Self {
        self.typed_control_tokens = typed;
        self
    }

    /// Encodes `text`. Chat prompts are encoded without added special tokens, as transformers does
    /// after `apply_chat_template`; raw completions with them (a no-op for Qwen tokenizers).
    /// A text of more tokens than the limit is refused after counting at most about the limit.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, GatewayError> {
        self.check_length(&self.tokenizer, &[text], 0)?;
        encode_with(&self.tokenizer, text, add_special_tokens)
    }

    /// Renders a chat with `template` and encodes it. Special tokens the template writes are
    /// control tokens; those typed in messages or tool definitions are encoded as the text they
    /// spell (unless [`TypedControlTokens::AsControlTokens`]), as transformers does with
    /// `split_special_tokens=True`. Returns the prompt text (with the typed tokens as typed).
    pub fn render_and_encode_chat(
        &self,
        template: &ChatTemplate,
        mut input: ChatTemplateInput,
    ) -> Result<(String, Vec<u32>), GatewayError> {
        // What the client sent is in the prompt whatever the template adds: refuse a conversation
        // too long for the context from its size, before rendering copies it around.
        let client_bytes: usize = input
            .messages
            .iter()
            .chain(input.tools.iter().flatten())
            .map(string_bytes)
            .sum();
        self.check_size(client_bytes)?;
        if self.typed_control_tokens == TypedControlTokens::AsControlTokens
            || self.special_token_texts.is_empty()
        {
            let prompt = template.render(&input)?;
            let token_ids = self.encode(&prompt, false)?;
            return Ok((prompt, token_ids));
        }
        input.messages = input
            .messages
            .iter()
            .map(|message| self.neutralize_value(message))
            .collect();
        input.tools = input.tools.map(|tools| {
            tools
                .iter()
                .map(|tool| self.neutralize_value(tool))
                .collect()
        });
        let rendered = template.render(&input)?;
        // Cut the render at the template's own special tokens (the typed ones are placeholders
        // now); every piece between them is text.
        let mut pieces: Vec<PromptPiece> = Vec::new();
        let mut rest = rendered.as_str();
        while let Some((position, text, id)) = self.first_special_token(rest) {
            if position > 0 {
                pieces.push(PromptPiece::Text(
                    self.restore_typed_tokens(&rest[..position]),
                ));
            }
            pieces.push(PromptPiece::Control(id));
            rest = &rest[position + text.len()..];
        }
        if !rest.is_empty() {
            pieces.push(PromptPiece::Text(self.restore_typed_tokens(rest)));
        }
        let token_ids = self.encode_chat_pieces(pieces)?;
        Ok((self.restore_typed_tokens(&rendered), token_ids))
    }

    /// The ids of a rendered chat's pieces, in order: control tokens as they are, long texts from
    /// the prompt-token cache when an earlier request encoded the same text, the rest encoded
    /// (and kept when long). Refuses a prompt over the limit after counting at most about the
    /// limit, as [`Self::check_length`] does: cached pieces count their known ids.
    fn encode_chat_pieces(&self, pieces: Vec<PromptPiece>) -> Result<Vec<u32>, GatewayError> {
        let cache = self.prompt_token_cache.as_ref();
        let cached: Vec<Option<std::sync::Arc<[u32]>>> = pieces
            .iter()
            .map(|piece| match (piece, cache) {
                (PromptPiece::Text(text), Some(cache)) => cache.get(text),
                _ => None,
            })
            .collect();
        let mut known_tokens = 0;
        let mut texts_to_encode: Vec<&str> = Vec::new();
        for (piece, cached) in pieces.iter().zip(&cached) {
            match (piece, cached) {
                (PromptPiece::Control(_), _) => known_tokens += 1,
                (PromptPiece::Text(_), Some(ids)) => known_tokens += ids.len(),
                (PromptPiece::Text(text), None) => texts_to_encode.push(text),
            }
        }
        self.check_length(&self.plain_text_tokenizer, &texts_to_encode, known_tokens)?;
        let mut token_ids = Vec::with_capacity(known_tokens);
        for (piece, cached) in pieces.iter().zip(cached) {
            match (piece, cached) {
                (PromptPiece::Control(id), _) => token_ids.push(*id),
                (PromptPiece::Text(_), Some(ids)) => token_ids.extend_from_slice(&ids),
                (PromptPiece::Text(text), None) => {
                    let ids = encode_with(&self.plain_text_tokenizer, text, false)?;
                    if let Some(cache) = cache {
                        cache.insert(text, &ids);
                    }
                    token_ids.extend(ids);
                }
            }
        }
        Ok(token_ids)
    }

    /// The earliest special token in `text`: (byte position, its text, its id).
    fn first_special_token<'a>(&'a self, text: &str) -> Option<(usize, &'a str, u32)> {
        self.special_token_texts
            .iter()
            .filter_map(|(special, id)| text.find(special.as_str()).map(|at| (at, special, *id)))
            // Earliest first; at the same position the longest (listed first) wins.
            .min_by_key(|(at, _, _)| *at)
            .map(|(at, special, id)| (at, special.as_str(), id))
    }

    /// Whether any string inside `value` holds a special token.
    fn holds_special_token(&self, value: &Value) -> bool {
        match value.kind() {
            ValueKind::String => value
                .as_str()
                .is_some_and(|text| self.first_special_token(text).is_some()),
            ValueKind::Seq | ValueKind::Map => value.try_iter().is_ok_and(|mut items| {
                items.any(|item| {
                    let nested = if value.kind() == ValueKind::Map {
                        value.get_item(&item).unwrap_or_default()
                    } else {
                        item
                    };
                    self.holds_special_token(&nested)
                })
            }),
            _ => false,
        }
    }

    /// `value` with every special token inside its strings replaced by a placeholder; values
    /// without one are kept as they are (not rebuilt).
    fn neutralize_value(&self, value: &Value) -> Value {
        if !self.holds_special_token(value) {
            return value.clone();
        }
        match value.kind() {
            ValueKind::String => match value.as_str() {
                Some(text) if self.first_special_token(text).is_some() => {
                    Value::from(self.neutralize_text(text))
                }
                _ => value.clone(),
            },
            ValueKind::Seq => match value.try_iter() {
                Ok(items) => Value::from(
                    items
                        .map(|item| self.neutralize_value(&item))
                        .collect::<Vec<_>>(),
                ),
                Err(_) => value.clone(),
            },
            ValueKind::Map => match value.try_iter() {
                Ok(keys) => Value::from_iter(
                    keys.map(|key| {
                        let item = value.get_item(&key).unwrap_or_default();
                        (key, self.neutralize_value(&item))
                    })
                    .collect::<Vec<_>>(),
                ),
                Err(_) => value.clone(),
            },
            _ => value.clone(),
        }
    }

    fn neutralize_text(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some((position, special, id)) = self.first_special_token(rest) {
            out.push_str(&rest[..position]);
            out.push(TYPED_SPECIAL_OPEN);
            out.push_str(&id.to_string());
            out.push(TYPED_SPECIAL_CLOSE);
            rest = &rest[position + special.len()..];
        }
        out.push_str(rest);
        out
    }

    /// Puts back the text of the special tokens a client typed (placeholders from
    /// [`Self::neutralize_text`]); anything that only looks like a placeholder stays as it is.
    fn restore_typed_tokens(&self, text: &str) -> String {
        if !text.contains(TYPED_SPECIAL_OPEN) {
            return text.to_string();
        }
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(open) = rest.find(TYPED_SPECIAL_OPEN) {
            out.push_str(&rest[..open]);
            let after_open = &rest[open + TYPED_SPECIAL_OPEN.len_utf8()..];
            let restored = after_open.find(TYPED_SPECIAL_CLOSE).and_then(|close| {
                let id: u32 = after_open[..close].parse().ok()?;
                let (special, _) = self.special_token_texts.iter().find(|(_, i)| *i == id)?;
                Some((special.as_str(), close))
            });
            match restored {
                Some((special, close)) => {
                    out.push_str(special);
                    rest = &after_open[close + TYPED_SPECIAL_CLOSE.len_utf8()..];
                }
                None => {
                    out.push(TYPED_SPECIAL_OPEN);
                    rest = after_open;
                }
            }
        }
        out.push_str(rest);
        out
    }

    /// The most bytes of text that could fit the token limit (the limit times the most bytes a
    /// token covers); `None` when either is unbounded.
    pub fn most_bytes_within_limit(&self) -> Option<usize> {
        let (limit, most_bytes) = (self.token_limit?, self.most_bytes_per_token?);
        Some(limit.saturating_mul(most_bytes.max(1)))
    }

    /// Refuses text of `bytes` bytes when even at the most bytes a token can cover it has more
    /// tokens than the limit (the same refusal as encoding it would give; `Ok` when it may fit
    /// or a token's bytes are not bounded).
    pub fn check_size_alone(&self, bytes: usize) -> Result<(), GatewayError> {
        self.check_size(bytes)
    }

    fn check_size(&self, bytes: usize) -> Result<(), GatewayError> {
        if let (Some(limit), Some(most_bytes)) = (self.token_limit, self.most_bytes_per_token) {
            let fewest_tokens = bytes / most_bytes.max(1);
            if fewest_tokens > limit {
                return Err(too_long(limit, fewest_tokens));
            }
        }
        Ok(())
    }

    /// Refuses `texts` (plus `known_tokens` already counted: control tokens, cached pieces) when
    /// they have more tokens than the limit, doing work and using memory in proportion to the limit, not to the text: first
    /// from the length alone (when a token's bytes are bounded), then by counting chunk by chunk
    /// and stopping past the limit.
    fn check_length(
        &self,
        tokenizer: &Tokenizer,
        texts: &[&str],
        known_tokens: usize,
    ) -> Result<(), GatewayError> {
        let Some(limit) = self.token_limit else {
            return Ok(());
        };
        let bytes: usize = texts.iter().map(|text| text.len()).sum();
        self.check_size(bytes + known_tokens * self.most_bytes_per_token.unwrap_or(0))?;
        if bytes <= CHUNK_BYTES {
            return Ok(());
        }
        let (mut counted, mut chunks) = (known_tokens, 0usize);
        for text in texts {
            let mut rest = *text;
            while !rest.is_empty() {
                let cut = chunk_end(rest, CHUNK_BYTES);
                counted += encode_with(tokenizer, &rest[..cut], false)?.len();
                chunks += 1;
                // A cut inside a word may split one token in two: allow a token per chunk.
                if counted > limit + chunks {
                    return Err(too_long(limit, counted - chunks));
                }
                rest = &rest[cut..];
            }
        }
        Ok(())
    }

    /// Decodes ids to text; an id outside the vocabulary is a client error.
    pub fn decode(
        &self,
        token_ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, GatewayError> {
        self.check_ids(token_ids)?;
        if let Some(table) = &self.token_bytes {
            return Ok(table.decode(token_ids, skip_special_tokens));
        }
        self.tokenizer
            .decode(token_ids, skip_special_tokens)
            .map_err(|error| GatewayError::invalid(format!("cannot decode token ids: {error}")))
    }

    /// Appends the UTF-8 bytes `decode` would read `token_ids` from to `out` (invalid sequences
    /// and all); `Ok(false)` when this vocabulary is not byte-level (use `decode`).
    fn decode_bytes(
        &self,
        token_ids: &[u32],
        skip_special_tokens: bool,
        out: &mut Vec<u8>,
    ) -> Result<bool, GatewayError> {
        let Some(table) = &self.token_bytes else {
            return Ok(false);
        };
        self.check_ids(token_ids)?;
        table.append(token_ids, skip_special_tokens, out);
        Ok(true)
    }

    /// An id outside the vocabulary is a client error.
    fn check_ids(&self, token_ids: &[u32]) -> Result<(), GatewayError> {
        let vocabulary_size = self.vocabulary_size as u32;
        match token_ids.iter().find(|id| **id >= vocabulary_size) {
            Some(bad) => Err(GatewayError::invalid(format!(
                "token id {bad} is outside the vocabulary (size {vocabulary_size})"
            ))),
            None => Ok(()),
        }
    }

    /// The string form of one token (for logprobs), `None` if unknown.
    pub fn token_text(&self, token_id: u32) -> Option<String> {
        self.decode(&[token_id], false).ok()
    }

    /// Id of a token given by its text (e.g. `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Tokens in the vocabulary, added tokens included (counted once at load).
    pub fn vocabulary_size(&self) -> usize {
        self.vocabulary_size
    }
}

/// Bytes of every string inside a template value (messages, tool definitions).
fn string_bytes(value: &Value) -> usize {
    match value.kind() {
        ValueKind::String => value.as_str().map_or(0, str::len),
        ValueKind::Seq | ValueKind::Map => value.try_iter().map_or(0, |items| {
            items
                .map(|item| {
                    let nested = if value.kind() == ValueKind::Map {
                        value.get_item(&item).unwrap_or_default()
                    } else {
                        item.clone()
                    };
                    // Keys are the client's too (tool argument names).
                    let key = if value.kind() == ValueKind::Map {
                        string_bytes(&item)
                    } else {
                        0
                    };
                    key + string_bytes(&nested)
                })
                .sum()
        }),
        _ => 0,
    }
}

/// One piece of a rendered chat: text, or a control token the template wrote.
enum PromptPiece {
    Text(String),
    Control(u32),
}

/// Whether cutting a text at the special tokens and encoding each piece apart gives the ids the
/// tokenizer gives the whole text: true when every special token is matched on the raw text as
/// it is (not normalized, no whitespace absorbed on either side, not only as a whole word), since
/// the tokenizer itself extracts such tokens first and then normalizes, pre-tokenizes and merges
/// each piece between them alone.
fn cuts_as_the_tokenizer_does(tokenizer: &Tokenizer) -> bool {
    tokenizer
        .get_added_tokens_decoder()
        .values()
        .filter(|token| token.special && !token.content.is_empty())
        .all(|token| !token.normalized && !token.lstrip && !token.rstrip && !token.single_word)
}

fn encode_with(
    tokenizer: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, GatewayError> {
    let encoding = tokenizer
        .encode(text, add_special_tokens)
        .map_err(|error| GatewayError::invalid(format!("cannot tokenize the prompt: {error}")))?;
    Ok(encoding.get_ids().to_vec())
}

fn too_long(limit: usize, at_least_tokens: usize) -> GatewayError {
    let prompt_tokens = u32::try_from(at_least_tokens).unwrap_or(u32::MAX);
    GatewayError::ContextLengthExceeded {
        max_context: u32::try_from(limit).unwrap_or(u32::MAX),
        prompt_tokens,
        completion_tokens: 0,
        requested_total: u64::from(prompt_tokens),
    }
}

/// Where to end a chunk of about `size` bytes of `text`: before a space that follows a
/// non-space and precedes a letter or digit (where byte-level pre-tokenizers split anyway, so
/// the chunks' counts add up to the whole text's), else at a character boundary.
fn chunk_end(text: &str, size: usize) -> usize {
    if text.len() <= size {
        return text.len();
    }
    let bytes = text.as_bytes();
    let search_end = (size + SPLIT_SEARCH_BYTES).min(bytes.len() - 1);
    for at in size.max(1)..search_end {
        if bytes[at] == b' '
            && !bytes[at - 1].is_ascii_whitespace()
            && bytes[at + 1].is_ascii_alphanumeric()
        {
            return at;
        }
    }
    let mut at = size;
    while !text.is_char_boundary(at) {
        at += 1;
    }
    at
}

/// Most input bytes one token can stand for, when bounded: the longest token (in bytes of its
/// text) times how much the normalizer may shrink a text (composition joins at most three
/// characters into one); `None` for normalizers that may delete text (accent stripping,
/// replacements) or models that map unknown text to one token.
fn most_bytes_per_token(tokenizer: &Tokenizer, json: &[u8]) -> Option<usize> {
    let parsed: serde_json::Value = serde_json::from_slice(json).ok()?;
    let shrink = match parsed.get("normalizer") {
        None | Some(serde_json::Value::Null) => 1,
        Some(normalizer) => match normalizer.get("type").and_then(|t| t.as_str()) {
            Some("NFC") | Some("NFKC") | Some("NFD") | Some("NFKD") => 3,
            _ => return None,
        },
    };
    let model = parsed.get("model")?;
    let is_byte_level_bpe = model.get("type").and_then(|t| t.as_str()) == Some("BPE")
        && model.get("unk_token").is_none_or(|unk| unk.is_null())
        && parsed.to_string().contains("\"ByteLevel\"");
    if !is_byte_level_bpe {
        return None;
    }
    let longest = tokenizer
        .get_vocab(true)
        .keys()
        .map(|token| token.len())
        .max()?;
    Some(longest * shrink)
}

/// Streams text out of a growing token sequence (the prefix/read offset scheme of TGI and vLLM):
/// decode a short window before and after the newest tokens and emit only the difference, and only
/// once it no longer ends in U+FFFD (an incomplete byte sequence). For byte-level vocabularies the
/// window's bytes are kept between tokens and each token's bytes are looked up once, as it
/// arrives (the table is megabytes, so every lookup is a cache miss): no allocation per token
/// but the delta's.
pub struct IncrementalDetokenizer {
    token_ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
    /// The bytes of `token_ids[prefix_offset..window_end]` (byte-level vocabularies).
    window_bytes: Vec<u8>,
    window_end: usize,
    /// Where the bytes of `token_ids[read_offset..]` begin in `window_bytes`.
    read_byte: usize,
}

impl IncrementalDetokenizer {
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDetokenizer {
            token_ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special_tokens,
            window_bytes: Vec::new(),
            window_end: 0,
            read_byte: 0,
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(
        &mut self,
        tokenizer: &ModelTokenizer,
        token_id: u32,
    ) -> Result<String, GatewayError> {
        self.token_ids.push(token_id);
        let delta = self.window_delta(tokenizer, true)?;
        if delta.is_some() {
            self.emitted_to_the_end();
        }
        Ok(delta.unwrap_or_default())
    }

    /// Text still held back at the end of the stream (an incomplete character, shown as U+FFFD).
    pub fn finish(&mut self, tokenizer: &ModelTokenizer) -> Result<String, GatewayError> {
        if self.read_offset >= self.token_ids.len() {
            return Ok(String::new());
        }
        let delta = self.window_delta(tokenizer, false)?;
        self.emitted_to_the_end();
        Ok(delta.unwrap_or_default())
    }

    /// Every token's text is out: the unread tokens become the next window's prefix.
    fn emitted_to_the_end(&mut self) {
        self.prefix_offset = self.read_offset;
        self.read_offset = self.token_ids.len();
        self.window_bytes.drain(..self.read_byte);
        self.read_byte = self.window_bytes.len();
    }

    /// The text the tokens after the read offset add to the window's prefix, `None` when they add
    /// none (or, with `complete_only`, when it ends in an incomplete character).
    fn window_delta(
        &mut self,
        tokenizer: &ModelTokenizer,
        complete_only: bool,
    ) -> Result<Option<String>, GatewayError> {
        let unseen_ids = &self.token_ids[self.window_end..];
        if tokenizer.decode_bytes(unseen_ids, self.skip_special_tokens, &mut self.window_bytes)? {
            self.window_end = self.token_ids.len();
            let prefix_end = self.read_byte;
            // Valid UTF-8 (nearly always): the prefix is valid too where it ends on a character
            // boundary, and the lossy reading of either is itself.
            if let Ok(whole) = std::str::from_utf8(&self.window_bytes) {
                if whole.is_char_boundary(prefix_end) {
                    return Ok(
                        text_delta(&whole[..prefix_end], whole, complete_only).map(str::to_string)
                    );
                }
            }
            let prefix_text = String::from_utf8_lossy(&self.window_bytes[..prefix_end]);
            let new_text = String::from_utf8_lossy(&self.window_bytes);
            return Ok(text_delta(&prefix_text, &new_text, complete_only).map(str::to_string));
        }
        let prefix_ids = &self.token_ids[self.prefix_offset..self.read_offset];
        let prefix_text = tokenizer.decode(prefix_ids, self.skip_special_tokens)?;
        let new_text = tokenizer.decode(
            &self.token_ids[self.prefix_offset..],
            self.skip_special_tokens,
        )?;
        Ok(text_delta(&prefix_text, &new_text, complete_only).map(str::to_string))
    }
}

/// What `new_text` adds after `prefix_text`, if it extends it at a character boundary (and, with
/// `complete_only`, does not end in U+FFFD).
fn text_delta<'a>(prefix_text: &str, new_text: &'a str, complete_only: bool) -> Option<&'a str> {
    (new_text.len() > prefix_text.len()
        && !(complete_only && new_text.ends_with('\u{FFFD}'))
        && new_text.is_char_boundary(prefix_text.len()))
    .then(|| &new_text[prefix_text.len()..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_tokenizer() -> ModelTokenizer {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen3_moe/tokenizer.json");
        let bytes = std::fs::read(path).unwrap_or_else(|error| panic!("{error}"));
        ModelTokenizer::from_json_bytes(&bytes).unwrap_or_else(|error| panic!("{error}"))
    }

    #[test]
    fn chunks_end_where_the_whole_text_would_split_anyway() {
        let tokenizer = fixture_tokenizer();
        let text = "lorem ipsum dolor sit amet, consectetur adipiscing elit. ".repeat(4000);
        let whole = tokenizer.encode(&text, false).unwrap_or_default().len();
        let mut chunked = 0;
        let mut rest = text.as_str();
        while !rest.is_empty() {
            let cut = chunk_end(rest, 10_000);
            chunked += tokenizer
                .encode(&rest[..cut], false)
                .unwrap_or_default()
                .len();
            rest = &rest[cut..];
        }
        assert_eq!(chunked, whole);
    }

    #[test]
    fn a_text_over_the_limit_is_refused_from_its_size_or_after_counting_about_the_limit() {
        let limit = 4096;
        let mut tokenizer = fixture_tokenizer().with_token_limit(limit);
        assert!(tokenizer.most_bytes_per_token.is_some());
        let huge = "lorem ipsum ".repeat(600_000);
        let started = std::time::Instant::now();
        let refused = tokenizer.encode(&huge, false);
        assert!(
            matches!(refused, Err(GatewayError::ContextLengthExceeded { .. })),
            "{refused:?}"
        );
        assert!(started.elapsed() < std::time::Duration::from_millis(50));
        // Without a byte bound (a tokenizer whose tokens may cover any length) the text is
        // counted chunk by chunk and refused once past the limit.
        tokenizer.most_bytes_per_token = None;
        let started = std::time::Instant::now();
        let refused = tokenizer.encode(&huge, false);
        let counted = started.elapsed();
        match refused {
            Err(GatewayError::ContextLengthExceeded { prompt_tokens, .. }) => {
                assert!(prompt_tokens as usize > limit);
                // It stopped within a chunk or two of the limit, not at the 1.2 M tokens.
                assert!(
                    (prompt_tokens as usize) < limit + 2 * CHUNK_BYTES,
                    "{prompt_tokens}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(counted < std::time::Duration::from_secs(2), "{counted:?}");
        // A text within the limit is encoded exactly as without one.
        let fits = "lorem ipsum ".repeat(300);
        assert_eq!(
            tokenizer.encode(&fits, false).unwrap_or_default(),
            fixture_tokenizer().encode(&fits, false).unwrap_or_default()
        );
    }
}
