//! PLE hashed n-gram row ids against transformers' values, and the refusal of tokens outside
//! the vocabulary and of a bad context.

use ninfer_engine::model::qwen4_exp::ngram_hash::{NgramHashSettings, NgramHashTables};

use crate::helpers::{fixture, integers};

fn hash_settings(reference: &serde_json::Value) -> NgramHashSettings {
    NgramHashSettings {
        vocab_size: reference["vocab_size"].as_u64().expect("vocab_size"),
        ngram_size: 3,
        heads_per_ngram: 8,
        ngram_vocab_size_base: 20_000_000,
        table_rows_divisor: 128,
        seed: reference["seed"].as_u64().expect("seed"),
        eos_token_id: reference["eos_token_id"].as_u64().expect("eos") as u32,
    }
}

#[test]
fn ngram_row_ids_match_transformers() {
    let reference = fixture("ngram_hash.json");
    let settings = hash_settings(&reference);
    let cases = reference["cases"].as_array().expect("cases");
    assert!(cases.len() >= 12);
    for case in cases {
        let layer = case["ple_layer_index"].as_u64().expect("layer") as usize;
        let tables = NgramHashTables::for_layer(&settings, layer).unwrap();
        assert_eq!(
            tables.multipliers,
            integers(&case["multipliers"]),
            "layer {layer}"
        );
        assert_eq!(
            tables.head_sizes,
            integers(&case["head_sizes"]),
            "layer {layer}"
        );
        assert_eq!(
            tables.head_offsets,
            integers(&case["head_offsets"]),
            "layer {layer}"
        );
        assert_eq!(tables.padded_rows, case["padded_rows"].as_u64().unwrap());
        let tokens: Vec<u32> = integers(&case["tokens"])
            .into_iter()
            .map(|t| t as u32)
            .collect();
        let context: Vec<u32> = match case["previous_context"].as_array() {
            Some(_) => integers(&case["previous_context"])
                .into_iter()
                .map(|t| t as u32)
                .collect(),
            None => settings.sequence_start_context(),
        };
        let row_ids = tables.row_ids(&settings, &context, &tokens).unwrap();
        let expected: Vec<u64> = case["row_ids"]
            .as_array()
            .expect("row_ids")
            .iter()
            .flat_map(integers)
            .collect();
        assert_eq!(
            row_ids, expected,
            "layer {layer}, tokens {tokens:?}, context {context:?}"
        );
        for (index, id) in row_ids.iter().enumerate() {
            let head = index % settings.heads();
            assert!(*id >= tables.head_offsets[head]);
            assert!(*id < tables.head_offsets[head] + tables.head_sizes[head]);
        }
    }
}

#[test]
fn ngram_row_ids_refuse_tokens_outside_the_vocabulary_and_bad_context() {
    let reference = fixture("ngram_hash.json");
    let settings = hash_settings(&reference);
    let tables = NgramHashTables::for_layer(&settings, 0).unwrap();
    let start = settings.sequence_start_context();
    let error = tables.row_ids(&settings, &start, &[1, 248320]).unwrap_err();
    assert!(error.to_string().contains("248320"), "{error}");
    let error = tables.row_ids(&settings, &[1], &[1]).unwrap_err();
    assert!(error.to_string().contains("carried context"), "{error}");
}
