//! What the files of this suite share: the reference files of
//! `tests/fixtures/qwen4_exp_parts/` and their numbers, random values and QSA selection settings.

use std::path::PathBuf;

use ninfer_engine::model::qwen4_exp::qsa_selection::QsaSelectionSettings;
use ninfer_engine::sampling::Xoshiro256;

pub fn fixture(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen4_exp_parts")
        .join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

pub fn floats(value: &serde_json::Value) -> Vec<f32> {
    value
        .as_array()
        .expect("array of numbers")
        .iter()
        .map(|number| number.as_f64().expect("number") as f32)
        .collect()
}

pub fn integers(value: &serde_json::Value) -> Vec<u64> {
    value
        .as_array()
        .expect("array of integers")
        .iter()
        .map(|number| number.as_u64().expect("non-negative integer"))
        .collect()
}

pub fn random_values(rng: &mut Xoshiro256, count: usize, scale: f32) -> Vec<f32> {
    (0..count)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

pub fn settings(
    budget: usize,
    ratio: usize,
    heads: usize,
    width: usize,
    rotary: usize,
) -> QsaSelectionSettings {
    QsaSelectionSettings {
        budget,
        compress_ratio: ratio,
        index_heads: heads,
        index_head_dim: width,
        rotary_dim: rotary,
        rope_theta: 10000.0,
        norm_eps: 1e-6,
    }
}
