//! The tokenizer a synthetic artifact carries: the fixtures' small byte-level BPE built into the
//! binary (the default), or a real one read from a directory (`--tokenizer DIR`), so that a
//! benchmark pays the real vocabulary's head, sampling and detokenisation costs.
//!
//! Owns: reading a tokenizer directory (`tokenizer.json`, or `tokenizer.json.gz` where the file is
//! kept compressed, plus `tokenizer_config.json`, the chat template and `generation_config.json`),
//! the token count a preset's vocabulary must hold, and the end-of-turn ids.
//! Must not touch: weights or the preset's shapes (`synthetic` decides what to do with the
//! vocabulary size given here).

use std::io::Read;
use std::path::{Path, PathBuf};

use ninfer_artifact::GenerationDefaults;
use serde_json::Value;

use crate::error::ConvertError;
use crate::side_files::read_side_files;
use crate::ConvertProgress;

// The fixtures' byte-level BPE (493 tokens, Qwen's special tokens) and the Qwen3.5 chat template:
// small, so an installed binary needs no data files. Every preset's vocabulary is larger, as
// real Qwen embeddings are larger than their tokenizers.
const BUILT_IN_TOKENIZER_JSON: &[u8] =
    include_bytes!("../../../../tests/fixtures/qwen3_moe/tokenizer.json");
const BUILT_IN_TOKENIZER_CONFIG_JSON: &[u8] =
    include_bytes!("../../../../tests/fixtures/qwen3_moe/tokenizer_config.json");
const BUILT_IN_CHAT_TEMPLATE: &str =
    include_str!("../../../../tests/fixtures/qwen3_moe/chat_template.jinja");

/// The text of the token that ends an assistant turn in Qwen chat templates.
const END_OF_TURN: &str = "<|im_end|>";
/// The text of Qwen's end-of-text token (the pad and n-gram context end).
const END_OF_TEXT: &str = "<|endoftext|>";

/// Tokenizer files and the generation defaults that go with them.
#[derive(Debug, Clone)]
pub struct SyntheticTokenizer {
    pub tokenizer_json: Vec<u8>,
    pub tokenizer_config_json: Option<Vec<u8>>,
    pub chat_template: Option<String>,
    pub generation: GenerationDefaults,
    /// One past the largest token id (vocabulary and added tokens): the embedding must have at
    /// least this many rows.
    pub token_count: usize,
    /// `<|im_end|>`'s id.
    pub end_of_turn_id: u32,
    /// `<|endoftext|>`'s id.
    pub end_of_text_id: u32,
}

impl SyntheticTokenizer {
    /// The fixtures' small tokenizer (`<|im_end|>` 482, `<|endoftext|>` 480) with Qwen's
    /// sampling defaults.
    pub fn built_in() -> Result<Self, ConvertError> {
        let source = PathBuf::from("<built-in tokenizer>");
        let config: Value = serde_json::from_slice(BUILT_IN_TOKENIZER_CONFIG_JSON)
            .map_err(|e| invalid(&source, format!("tokenizer_config.json: {e}")))?;
        let config = serde_json::to_vec(&config)
            .map_err(|e| invalid(&source, format!("tokenizer_config.json: {e}")))?;
        let ids = TokenIds::of(BUILT_IN_TOKENIZER_JSON, &source)?;
        let (end_of_turn_id, end_of_text_id) = ids.end_tokens(&source)?;
        Ok(SyntheticTokenizer {
            tokenizer_json: BUILT_IN_TOKENIZER_JSON.to_vec(),
            tokenizer_config_json: Some(config),
            chat_template: Some(BUILT_IN_CHAT_TEMPLATE.to_string()),
            generation: qwen_defaults(end_of_turn_id, end_of_text_id),
            token_count: ids.token_count,
            end_of_turn_id,
            end_of_text_id,
        })
    }

    /// The tokenizer of a Hugging Face checkpoint directory (or one holding only its tokenizer
    /// files). Without `generation_config.json` the defaults are Qwen's, ending at `<|im_end|>`
    /// and `<|endoftext|>`.
    pub fn from_directory(
        directory: &Path,
        progress: &dyn ConvertProgress,
    ) -> Result<Self, ConvertError> {
        if !directory.is_dir() {
            return Err(invalid(directory, "is not a directory".to_string()));
        }
        let side = read_side_files(directory, progress)?;
        let (tokenizer_json, source) = match side.tokenizer_json {
            Some(bytes) => (bytes, directory.join("tokenizer.json")),
            None => read_compressed_tokenizer(directory)?,
        };
        let ids = TokenIds::of(&tokenizer_json, &source)?;
        let (end_of_turn_id, end_of_text_id) = ids.end_tokens(&source)?;
        let mut generation = side.generation;
        if generation.eos_token_ids.is_empty() {
            let defaults = qwen_defaults(end_of_turn_id, end_of_text_id);
            generation = GenerationDefaults {
                temperature: generation.temperature.or(defaults.temperature),
                top_p: generation.top_p.or(defaults.top_p),
                top_k: generation.top_k.or(defaults.top_k),
                do_sample: generation.do_sample.or(defaults.do_sample),
                ..defaults
            };
        }
        if let Some(bad) = generation
            .eos_token_ids
            .iter()
            .find(|id| **id as usize >= ids.token_count)
        {
            return Err(invalid(
                &directory.join("generation_config.json"),
                format!(
                    "eos_token_id {bad} is outside the tokenizer's {} tokens",
                    ids.token_count
                ),
            ));
        }
        Ok(SyntheticTokenizer {
            tokenizer_json,
            tokenizer_config_json: side.tokenizer_config_json,
            chat_template: side.chat_template,
            generation,
            token_count: ids.token_count,
            end_of_turn_id,
            end_of_text_id,
        })
    }
}

/// `tokenizer.json.gz`, decompressed (a large vocabulary kept small in a repository).
fn read_compressed_tokenizer(directory: &Path) -> Result<(Vec<u8>, PathBuf), ConvertError> {
    let path = directory.join("tokenizer.json.gz");
    let file = match std::fs::File::open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(invalid(
                directory,
                "holds neither tokenizer.json nor tokenizer.json.gz".to_string(),
            ))
        }
        Err(e) => return Err(ConvertError::io(&path, "reading", e)),
    };
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut bytes)
        .map_err(|e| invalid(&path, format!("not a readable gzip file: {e}")))?;
    Ok((bytes, path))
}

/// The ids a `tokenizer.json` defines that a synthetic model needs.
struct TokenIds {
    token_count: usize,
    /// `<|im_end|>`'s and `<|endoftext|>`'s ids, where the file has them.
    end_of_turn: Option<u32>,
    end_of_text: Option<u32>,
}

impl TokenIds {
    fn of(tokenizer_json: &[u8], source: &Path) -> Result<Self, ConvertError> {
        let parsed: Value = serde_json::from_slice(tokenizer_json)
            .map_err(|e| invalid(source, format!("not valid JSON: {e}")))?;
        let vocabulary = parsed
            .get("model")
            .and_then(|model| model.get("vocab"))
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(source, "has no `model.vocab` object".to_string()))?;
        let added: Vec<(&str, u32)> = parsed
            .get("added_tokens")
            .and_then(Value::as_array)
            .map(|tokens| {
                tokens
                    .iter()
                    .filter_map(|token| {
                        let text = token.get("content")?.as_str()?;
                        let id = u32::try_from(token.get("id")?.as_u64()?).ok()?;
                        Some((text, id))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let largest = vocabulary
            .values()
            .filter_map(Value::as_u64)
            .chain(added.iter().map(|(_, id)| u64::from(*id)))
            .max()
            .ok_or_else(|| invalid(source, "defines no tokens".to_string()))?;
        let id_of = |text: &str| {
            added
                .iter()
                .find(|(added, _)| *added == text)
                .map(|(_, id)| *id)
                .or_else(|| {
                    vocabulary
                        .get(text)
                        .and_then(Value::as_u64)
                        .and_then(|id| u32::try_from(id).ok())
                })
        };
        Ok(TokenIds {
            token_count: usize::try_from(largest + 1).unwrap_or(usize::MAX),
            end_of_turn: id_of(END_OF_TURN),
            end_of_text: id_of(END_OF_TEXT),
        })
    }

    /// `(<|im_end|>, <|endoftext|>)`: a synthetic model is a Qwen chat model.
    fn end_tokens(&self, source: &Path) -> Result<(u32, u32), ConvertError> {
        let missing = |text: &str| {
            invalid(
                source,
                format!("has no `{text}` token (a Qwen chat tokenizer is needed)"),
            )
        };
        Ok((
            self.end_of_turn.ok_or_else(|| missing(END_OF_TURN))?,
            self.end_of_text.ok_or_else(|| missing(END_OF_TEXT))?,
        ))
    }
}

/// Qwen's released sampling defaults, ending at `<|im_end|>` and `<|endoftext|>`.
fn qwen_defaults(end_of_turn_id: u32, end_of_text_id: u32) -> GenerationDefaults {
    GenerationDefaults {
        bos_token_id: Some(end_of_text_id),
        eos_token_ids: vec![end_of_turn_id, end_of_text_id],
        pad_token_id: Some(end_of_text_id),
        temperature: Some(0.6),
        top_p: Some(0.95),
        top_k: Some(20),
        min_p: None,
        repetition_penalty: None,
        do_sample: Some(true),
    }
}

fn invalid(file: &Path, problem: String) -> ConvertError {
    ConvertError::Input {
        file: file.to_path_buf(),
        problem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_tokenizer_ends_turns_at_the_fixtures_ids() {
        let tokenizer = SyntheticTokenizer::built_in().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tokenizer.end_of_turn_id, 482);
        assert_eq!(tokenizer.end_of_text_id, 480);
        assert_eq!(tokenizer.generation.eos_token_ids, vec![482, 480]);
        assert_eq!(tokenizer.token_count, 493);
    }

    #[test]
    fn the_real_qwen3_5_tokenizer_is_read_from_its_compressed_file() {
        let directory =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../tests/fixtures/qwen3_5_tokenizer");
        let tokenizer = SyntheticTokenizer::from_directory(&directory, &crate::NoProgress)
            .unwrap_or_else(|e| panic!("{e}"));
        // 248,044 ranks and 33 added tokens; the released embeddings have 248,320 rows.
        assert_eq!(tokenizer.token_count, 248_077);
        assert_eq!(tokenizer.end_of_text_id, 248_044);
        assert_eq!(tokenizer.end_of_turn_id, 248_046);
        assert!(tokenizer
            .chat_template
            .as_deref()
            .is_some_and(|template| template.contains("<|im_start|>")));
    }

    #[test]
    fn a_directory_without_a_tokenizer_is_refused_by_name() {
        let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let error = SyntheticTokenizer::from_directory(directory.path(), &crate::NoProgress)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("neither tokenizer.json"), "{error}");
    }
}
