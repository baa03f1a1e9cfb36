//! The model's tokenizer, text ↔ token ids, and streaming detokenization.
//!
//! Owns: parsing the engine-supplied `tokenizer.json` with the `tokenizers` crate, encoding
//! prompts, decoding ids, and [`IncrementalDetokenizer`], which turns a token stream into text
//! deltas without ever emitting half a UTF-8 character or a byte-level fragment.
//! Must not touch: stop strings or reasoning splitting (see `stop_strings`, `reasoning`).

use tokenizers::Tokenizer;

use crate::error::GatewayError;

/// A loaded tokenizer; cheap to share behind an `Arc`.
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
}

impl ModelTokenizer {
    /// Parses the bytes of a Hugging Face `tokenizer.json`.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self, GatewayError> {
        let tokenizer = Tokenizer::from_bytes(bytes).map_err(|error| {
            GatewayError::Internal(format!(
                "the engine's tokenizer.json does not parse: {error}"
            ))
        })?;
        Ok(ModelTokenizer { tokenizer })
    }

    /// Encodes `text`. Chat prompts are encoded without added special tokens, as transformers does
    /// after `apply_chat_template`; raw completions with them (a no-op for Qwen tokenizers).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, GatewayError> {
        let encoding = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|error| {
                GatewayError::invalid(format!("cannot tokenize the prompt: {error}"))
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes ids to text; an id outside the vocabulary is a client error.
    pub fn decode(
        &self,
        token_ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, GatewayError> {
        let vocabulary_size = self.tokenizer.get_vocab_size(true) as u32;
        if let Some(bad) = token_ids.iter().find(|id| **id >= vocabulary_size) {
            return Err(GatewayError::invalid(format!(
                "token id {bad} is outside the vocabulary (size {vocabulary_size})"
            )));
        }
        self.tokenizer
            .decode(token_ids, skip_special_tokens)
            .map_err(|error| GatewayError::invalid(format!("cannot decode token ids: {error}")))
    }

    /// The string form of one token (for logprobs), `None` if unknown.
    pub fn token_text(&self, token_id: u32) -> Option<String> {
        self.decode(&[token_id], false).ok()
    }

    /// Id of a token given by its text (e.g. `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    pub fn vocabulary_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}

/// Streams text out of a growing token sequence (the prefix/read offset scheme of TGI and vLLM):
/// decode a short window before and after the newest tokens and emit only the difference, and only
/// once it no longer ends in U+FFFD (an incomplete byte sequence).
pub struct IncrementalDetokenizer {
    token_ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDetokenizer {
            token_ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special_tokens,
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(
        &mut self,
        tokenizer: &ModelTokenizer,
        token_id: u32,
    ) -> Result<String, GatewayError> {
        self.token_ids.push(token_id);
        let prefix_text = tokenizer.decode(
            &self.token_ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let new_text = tokenizer.decode(
            &self.token_ids[self.prefix_offset..],
            self.skip_special_tokens,
        )?;
        if new_text.len() > prefix_text.len()
            && !new_text.ends_with('\u{FFFD}')
            && new_text.is_char_boundary(prefix_text.len())
        {
            let delta = new_text[prefix_text.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.token_ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back at the end of the stream (an incomplete character, shown as U+FFFD).
    pub fn finish(&mut self, tokenizer: &ModelTokenizer) -> Result<String, GatewayError> {
        if self.read_offset >= self.token_ids.len() {
            return Ok(String::new());
        }
        let prefix_text = tokenizer.decode(
            &self.token_ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let new_text = tokenizer.decode(
            &self.token_ids[self.prefix_offset..],
            self.skip_special_tokens,
        )?;
        self.read_offset = self.token_ids.len();
        self.prefix_offset = self.read_offset;
        if new_text.len() > prefix_text.len() && new_text.is_char_boundary(prefix_text.len()) {
            Ok(new_text[prefix_text.len()..].to_string())
        } else {
            Ok(String::new())
        }
    }
}
