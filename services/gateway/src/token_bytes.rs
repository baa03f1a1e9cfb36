//! Every token's bytes, laid out once at load, for decoding a byte-level BPE vocabulary (the
//! GPT-2 scheme of the Qwen tokenizers) without the `tokenizers` crate's per-call work.
//!
//! Owns: [`TokenBytes`], built from a tokenizer whose decoder is plain `ByteLevel`, and the
//! decode it does: the bytes of each id (special tokens left out on request) joined and read as
//! UTF-8 with U+FFFD for what is not — exactly what `Tokenizer::decode` returns for such a
//! tokenizer (its `ByteLevel` decoder maps each token's characters back to bytes, or keeps the
//! token's own UTF-8 when a character is outside the byte alphabet, and reads the whole as
//! lossy UTF-8). Streaming detokenization decodes a few tokens per generated token; through the
//! crate that is a string per token and a hash lookup per character, here a copy.
//! Must not touch: encoding, or tokenizers with any other decoder (they keep the crate's decode).

use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

/// The bytes of every token of one vocabulary, and which tokens are special.
pub struct TokenBytes {
    /// All tokens' bytes back to back.
    bytes: Vec<u8>,
    /// Where token `id`'s bytes end in `bytes` (they start where the previous token's end), with
    /// [`SPECIAL`] set for tokens left out when special tokens are skipped: one table, so a
    /// token costs one cache miss less than with a second one.
    ends: Vec<u32>,
}

/// The flag of a special token in [`TokenBytes::ends`].
const SPECIAL: u32 = 1 << 31;

impl TokenBytes {
    /// The table of a tokenizer whose decoder is `ByteLevel` alone, over ids `0..vocabulary_size`;
    /// `None` for other decoders (or a vocabulary beyond 2 GiB of text).
    pub fn of(tokenizer: &Tokenizer, vocabulary_size: usize) -> Option<Self> {
        if !matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let char_bytes = byte_level_char_bytes();
        let added = tokenizer.get_added_vocabulary();
        let mut table = TokenBytes {
            bytes: Vec::with_capacity(vocabulary_size * 8),
            ends: Vec::with_capacity(vocabulary_size),
        };
        for id in 0..vocabulary_size {
            let id = u32::try_from(id).ok()?;
            // Ids without a token (holes in the vocabulary) decode to nothing, as in the crate.
            let (token_bytes, special) = match tokenizer.id_to_token(id) {
                Some(token) => (
                    byte_level_bytes(&token, &char_bytes),
                    added.is_special_token(&token),
                ),
                None => (Vec::new(), false),
            };
            table.bytes.extend_from_slice(&token_bytes);
            let end = u32::try_from(table.bytes.len())
                .ok()
                .filter(|end| end & SPECIAL == 0)?;
            table.ends.push(if special { end | SPECIAL } else { end });
        }
        table.bytes.shrink_to_fit();
        Some(table)
    }

    /// Appends the bytes of `ids` to `out`. Ids outside the table are the caller's to refuse
    /// first (they add nothing here).
    pub fn append(&self, ids: &[u32], skip_special_tokens: bool, out: &mut Vec<u8>) {
        for &id in ids {
            let index = id as usize;
            let Some(&end) = self.ends.get(index) else {
                continue;
            };
            if skip_special_tokens && end & SPECIAL != 0 {
                continue;
            }
            let start = match index {
                0 => 0,
                _ => self.ends[index - 1] & !SPECIAL,
            };
            out.extend_from_slice(&self.bytes[start as usize..(end & !SPECIAL) as usize]);
        }
    }

    /// The text of `ids`, as `Tokenizer::decode` gives it.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut bytes = Vec::new();
        self.append(ids, skip_special_tokens, &mut bytes);
        match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(error) => String::from_utf8_lossy(error.as_bytes()).into_owned(),
        }
    }
}

/// A token's bytes: each character mapped back to its byte, or, when a character is outside
/// the byte alphabet (an added token such as `<think>` written in plain text may be), the
/// token's own UTF-8.
fn byte_level_bytes(token: &str, char_bytes: &[Option<u8>]) -> Vec<u8> {
    token
        .chars()
        .map(|c| char_bytes.get(c as usize).copied().flatten())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// The byte each character of the GPT-2 byte alphabet stands for, indexed by the character:
/// printable Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 onwards in order.
fn byte_level_char_bytes() -> Vec<Option<u8>> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut char_bytes = vec![None; 256 + 256];
    let mut next_unprintable = 256usize;
    for byte in 0..=255u8 {
        if printable(byte) {
            char_bytes[usize::from(byte)] = Some(byte);
        } else {
            char_bytes[next_unprintable] = Some(byte);
            next_unprintable += 1;
        }
    }
    char_bytes
}
