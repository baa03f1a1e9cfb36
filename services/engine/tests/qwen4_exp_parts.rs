//! The Qwen4-Exp pieces and ops, checked on their own:
//! * QSA token selection against a deliberately naive oracle written here (everything recomputed
//!   from the raw keys for every query, full sort, no dense shortcut) over random keys, and
//!   against the selections transformers' own indexer made (`tests/fixtures/qwen4_exp_parts/`,
//!   `scripts/make_qwen4_exp_part_references.py`);
//! * PLE hashed n-gram row ids against transformers' values from the same script;
//! * on every backend (`test_device!`): the hyper-connection ops and the PLE gate against host
//!   loops, and the sigmoid-gated Gated DeltaNet output norm as a device backend computes it
//!   (backend ops) against the host function, and the QSA ops (append and block pooling,
//!   indexer queries, block selection, sparse attention) against the host reference.

use std::path::PathBuf;
use std::sync::Arc;

use ninfer_artifact::Artifact;
use ninfer_engine::model::qwen4_exp::graph::{
    sigmoid_gated_rms_norm, sigmoid_gated_rms_norm_by_ops,
};

use ninfer_engine::backend::{AttentionSpec, NormStyle, Segment};
use ninfer_engine::model::qwen4_exp::ngram_hash::{NgramHashSettings, NgramHashTables};
use ninfer_engine::model::qwen4_exp::qsa_selection::{
    block_score, prepare_index_query, select_tokens, QsaBlockKeys, QsaSelectionSettings,
};
use ninfer_engine::model::qwen4_exp::torch_topk::torch_top_k_indices;
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::{golden_fixture_dir, max_abs_difference};
use ninfer_engine::{open_artifact, test_device, Backend};

mod support;

fn fixture(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen4_exp_parts")
        .join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

fn floats(value: &serde_json::Value) -> Vec<f32> {
    value
        .as_array()
        .expect("array of numbers")
        .iter()
        .map(|number| number.as_f64().expect("number") as f32)
        .collect()
}

fn integers(value: &serde_json::Value) -> Vec<u64> {
    value
        .as_array()
        .expect("array of integers")
        .iter()
        .map(|number| number.as_u64().expect("non-negative integer"))
        .collect()
}

fn random_values(rng: &mut Xoshiro256, count: usize, scale: f32) -> Vec<f32> {
    (0..count)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// The naive oracle: for one query, the visible tokens cut into blocks, every block pooled from
/// scratch, every block scored, all blocks sorted by score, plus the tail. The f32 arithmetic of
/// each value follows the same formulas in the same order as the reference (sum then divide;
/// `x / rms · (1 + w)`; `a·cos − b·sin`), so the scores are bit-identical. It returns the blocks
/// that must be kept (scored above the `budget / ratio`-th best), the blocks tied with that
/// score (of which the operator keeps as many as fill the budget; which ones follows PyTorch's
/// `topk`, checked against torch in `top_k_ties_resolve_as_torch_does`) and the tail tokens.
struct OracleSelection {
    ratio: usize,
    certain_blocks: Vec<usize>,
    boundary_blocks: Vec<usize>,
    boundary_keeps: usize,
    tail: Vec<usize>,
}

impl OracleSelection {
    fn check(&self, selected: &[usize], what: &str) {
        let mut expected_certain: Vec<usize> = self
            .certain_blocks
            .iter()
            .flat_map(|&block| block * self.ratio..(block + 1) * self.ratio)
            .collect();
        expected_certain.extend_from_slice(&self.tail);
        for token in &expected_certain {
            assert!(
                selected.contains(token),
                "{what}: token {token} must be selected"
            );
        }
        let extra: Vec<usize> = selected
            .iter()
            .copied()
            .filter(|token| !expected_certain.contains(token))
            .collect();
        assert_eq!(
            extra.len(),
            self.boundary_keeps * self.ratio,
            "{what}: {selected:?}"
        );
        for token in extra {
            assert!(
                self.boundary_blocks.contains(&(token / self.ratio)),
                "{what}: token {token} is in a block that must not be selected"
            );
        }
        let mut sorted = selected.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted, selected, "{what}: ascending without repeats");
    }
}

fn oracle_selection(
    settings: &QsaSelectionSettings,
    raw_query: &[f32],
    raw_keys: &[f32],
    query_norm: &[f32],
    key_norm: &[f32],
    query_index: usize,
) -> OracleSelection {
    let width = settings.index_head_dim;
    let ratio = settings.compress_ratio;
    let half = settings.rotary_dim / 2;
    let frequencies: Vec<f32> = (0..half)
        .map(|i| {
            1.0 / (settings.rope_theta as f32).powf((2 * i) as f32 / settings.rotary_dim as f32)
        })
        .collect();
    let norm = |values: &[f32], weight: &[f32]| -> Vec<f32> {
        let mut square_sum = 0.0f32;
        for v in values {
            square_sum += v * v;
        }
        let inverse = 1.0 / (square_sum / values.len() as f32 + settings.norm_eps).sqrt();
        values
            .iter()
            .zip(weight)
            .map(|(v, w)| v * inverse * (1.0 + w))
            .collect()
    };
    let rotate = |values: &mut Vec<f32>, position: usize| {
        let original = values.clone();
        for (i, frequency) in frequencies.iter().enumerate() {
            let angle = position as f32 * frequency;
            let (sin, cos) = angle.sin_cos();
            values[i] = original[i] * cos - original[i + half] * sin;
            values[i + half] = original[i + half] * cos + original[i] * sin;
        }
    };
    let mut query_heads: Vec<Vec<f32>> = Vec::new();
    for head in 0..settings.index_heads {
        let mut q = norm(&raw_query[head * width..(head + 1) * width], query_norm);
        rotate(&mut q, query_index);
        query_heads.push(q);
    }
    let visible: Vec<usize> = (0..=query_index).collect();
    let blocks: Vec<&[usize]> = visible.chunks(ratio).filter(|c| c.len() == ratio).collect();
    let mut scored: Vec<(f32, usize)> = Vec::new();
    for (block_index, block) in blocks.iter().enumerate() {
        let mut mean = vec![0.0f32; width];
        for &token in block.iter() {
            for (sum, value) in mean.iter_mut().zip(&raw_keys[token * width..]) {
                *sum += value;
            }
        }
        for value in &mut mean {
            *value /= ratio as f32;
        }
        let mut key = norm(&mean, key_norm);
        rotate(&mut key, block[0]);
        let mut score = 0.0f32;
        for q in &query_heads {
            let mut dot = 0.0f32;
            for (a, b) in q.iter().zip(&key) {
                dot += a * b;
            }
            score += if dot > 0.0 { dot } else { 0.0 };
        }
        scored.push((score / (width as f32).sqrt(), block_index));
    }
    scored.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
    let keep = (settings.budget / ratio).min(scored.len());
    let tail = visible[blocks.len() * ratio..].to_vec();
    if keep == scored.len() {
        return OracleSelection {
            ratio,
            certain_blocks: scored.iter().map(|s| s.1).collect(),
            boundary_blocks: Vec::new(),
            boundary_keeps: 0,
            tail,
        };
    }
    let boundary_score = scored[keep - 1].0;
    let certain_blocks: Vec<usize> = scored
        .iter()
        .filter(|s| s.0 > boundary_score)
        .map(|s| s.1)
        .collect();
    let boundary_blocks: Vec<usize> = scored
        .iter()
        .filter(|s| s.0 == boundary_score)
        .map(|s| s.1)
        .collect();
    OracleSelection {
        ratio,
        boundary_keeps: keep - certain_blocks.len(),
        certain_blocks,
        boundary_blocks,
        tail,
    }
}

fn settings(
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

#[test]
fn qsa_selection_matches_the_naive_oracle_on_random_keys() {
    let mut rng = Xoshiro256::seed_from_u64(77);
    // (length, budget, ratio): short ones check every query, long ones a spread of queries.
    let cases = [
        (1, 8, 4),
        (2, 4, 2),
        (11, 8, 4),
        (12, 8, 4),
        (13, 8, 4),
        (40, 8, 4),
        (64, 12, 4),
        (97, 6, 2),
        (130, 16, 8),
        (300, 32, 4),
        (1000, 64, 4),
        (2049, 128, 4),
        (8192, 2048, 4),
        (8192, 64, 4),
        (8192, 256, 8),
    ];
    let mut queries_past_dense = 0usize;
    for (length, budget, ratio) in cases {
        let settings = settings(budget, ratio, 3, 16, 8);
        let width = settings.index_head_dim;
        let query_norm = random_values(&mut rng, width, 0.3);
        let key_norm = random_values(&mut rng, width, 0.3);
        let raw_keys = random_values(&mut rng, length * width, 1.0);
        let mut block_keys = QsaBlockKeys::new(settings.clone(), key_norm.clone()).unwrap();
        for key in raw_keys.chunks_exact(width) {
            block_keys.push_raw_key(key).unwrap();
        }
        let queries: Vec<usize> = if length <= 130 {
            (0..length).collect()
        } else {
            let mut spread: Vec<usize> = (0..24).map(|i| i * (length - 1) / 23).collect();
            spread.extend([
                settings.dense_token_limit() - 1,
                settings.dense_token_limit(),
            ]);
            spread.extend(length.saturating_sub(5)..length);
            spread.retain(|&q| q < length);
            spread
        };
        for query_index in queries {
            let raw_query = random_values(&mut rng, settings.index_heads * width, 1.0);
            let prepared = prepare_index_query(&raw_query, &query_norm, query_index, &settings);
            let selected = block_keys.select_for_query(&prepared, query_index).unwrap();
            let expected = oracle_selection(
                &settings,
                &raw_query,
                &raw_keys,
                &query_norm,
                &key_norm,
                query_index,
            );
            expected.check(
                &selected,
                &format!("length {length}, budget {budget}, ratio {ratio}, query {query_index}"),
            );
            let visible = query_index + 1;
            if visible <= settings.dense_token_limit() {
                assert_eq!(selected, (0..visible).collect::<Vec<_>>(), "dense regime");
            } else {
                queries_past_dense += 1;
                assert_eq!(selected.len(), budget + visible % ratio);
            }
        }
    }
    assert!(
        queries_past_dense > 400,
        "only {queries_past_dense} queries were sparse"
    );
}

#[test]
fn qsa_selection_matches_transformers_indexer() {
    let reference = fixture("qsa_indexer.json");
    let cases = reference["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    let mut queries_past_dense = 0usize;
    for case in cases {
        let field = |name: &str| case[name].as_u64().expect(name) as usize;
        let settings = QsaSelectionSettings {
            budget: field("budget"),
            compress_ratio: field("compress_ratio"),
            index_heads: field("index_heads"),
            index_head_dim: field("index_head_dim"),
            rotary_dim: field("rotary_dim"),
            rope_theta: case["rope_theta"].as_f64().expect("rope_theta"),
            norm_eps: case["rms_norm_eps"].as_f64().expect("rms_norm_eps") as f32,
        };
        let length = field("length");
        let (heads, width) = (settings.index_heads, settings.index_head_dim);
        let projection = floats(&case["projection"]);
        assert_eq!(projection.len(), length * (heads + 1) * width);
        let query_norm = floats(&case["query_norm_weight"]);
        let key_norm = floats(&case["key_norm_weight"]);
        let mut block_keys = QsaBlockKeys::new(settings.clone(), key_norm).unwrap();
        let expected_selections = case["selected_tokens"].as_array().expect("selected_tokens");
        for (query_index, row) in projection.chunks_exact((heads + 1) * width).enumerate() {
            let (raw_query, raw_key) = row.split_at(heads * width);
            block_keys.push_raw_key(raw_key).unwrap();
            let prepared = prepare_index_query(raw_query, &query_norm, query_index, &settings);
            let selected = select_tokens(
                &prepared,
                block_keys.pooled_keys(),
                query_index + 1,
                &settings,
            )
            .unwrap();
            let expected: Vec<usize> = integers(&expected_selections[query_index])
                .into_iter()
                .map(|token| token as usize)
                .collect();
            assert_eq!(
                selected, expected,
                "case seed {}, query {query_index}",
                case["seed"]
            );
            if query_index + 1 > settings.dense_token_limit() {
                queries_past_dense += 1;
            }
        }
    }
    assert!(
        queries_past_dense > 200,
        "only {queries_past_dense} sparse queries"
    );
}

#[test]
fn top_k_ties_resolve_as_torch_does() {
    let reference = fixture("topk_ties.json");
    let cases = reference["cases"].as_array().expect("cases");
    assert!(cases.len() >= 100);
    let (mut partial_sort_path, mut selection_path) = (0, 0);
    for (number, case) in cases.iter().enumerate() {
        let values = floats(&case["values"]);
        let k = case["k"].as_u64().expect("k") as usize;
        if k * 64 <= values.len() {
            partial_sort_path += 1;
        } else {
            selection_path += 1;
        }
        let expected: Vec<usize> = integers(&case["indices"])
            .into_iter()
            .map(|index| index as usize)
            .collect();
        assert_eq!(
            torch_top_k_indices(&values, k),
            expected,
            "case {number}: k {k} of {}",
            values.len()
        );
    }
    assert!(partial_sort_path > 50 && selection_path > 50);
}

#[test]
fn qsa_settings_are_validated() {
    assert!(settings(8, 4, 2, 16, 8).validate().is_ok());
    let error = settings(10, 4, 2, 16, 8).validate().unwrap_err();
    assert!(error.to_string().contains("multiple"), "{error}");
    let error = settings(8, 4, 2, 16, 32).validate().unwrap_err();
    assert!(error.to_string().contains("indexer_head_dim"), "{error}");
    let error = QsaBlockKeys::new(settings(8, 4, 2, 16, 8), vec![0.0; 3]).unwrap_err();
    assert!(error.to_string().contains("key norm"), "{error}");
}

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

/// The qwen4_exp fixture converted with f32 weights (the directory it lives in goes with it).
fn converted_fixture() -> (tempfile::TempDir, Arc<Artifact>) {
    let fixture = golden_fixture_dir("qwen4_exp");
    let work = tempfile::tempdir().unwrap();
    let path = work.path().join("qwen4_exp-f32.ninfer");
    support::convert_f32(fixture, &path);
    let artifact = open_artifact(&path).unwrap();
    (work, artifact)
}

fn host_sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Asserts `got` is within `1e-5` of `expected`, relative to the largest expected value.
fn assert_close(what: &str, backend: &str, got: &[f32], expected: &[f32]) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let scale = expected.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let worst = max_abs_difference(got, expected);
    println!("{what} on {backend}: max |Δ| = {worst:.3e} of max |value| {scale:.3}");
    assert!(
        worst / scale < 1e-5,
        "{what} on {backend}: differs by {worst}"
    );
}

/// The hyper-connection ops (the streams' grouped norm with a weight per stream, the scaled
/// SiLU, the stream mix, the injection into the streams, the reshape that makes them) against plain host loops written
/// here from the model's formulas, with the fixture's own mixer norm weight (three streams of
/// 64) over random values; rows in odd numbers so no launch shape divides them evenly.
fn hyper_connection_ops_match_host_loops<B: Backend>(backend: Arc<B>) {
    let (_work, artifact) = converted_fixture();
    let name = "layers.0.attn_hc.norm";
    let host_weight = artifact.get(name).expect("the mixer norm").to_f32_vec();
    let weight = backend.load_parameter(&artifact, name).unwrap();
    let (rows, streams, eps) = (5, 3, 1e-6f32);
    let width = host_weight.len();
    let hidden = width / streams;
    let scale = 1.0 / streams as f32;
    let on = backend.name();
    let mut rng = Xoshiro256::seed_from_u64(17);
    let x = random_values(&mut rng, rows * width, 2.0);

    let mut expected = Vec::with_capacity(x.len());
    for row in x.chunks_exact(width) {
        for (stream, features) in row.chunks_exact(hidden).enumerate() {
            let mean_square = features.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
            let inverse = 1.0 / (mean_square + eps).sqrt();
            let weights = &host_weight[stream * hidden..(stream + 1) * hidden];
            expected.extend(
                features
                    .iter()
                    .zip(weights)
                    .map(|(v, w)| v * inverse * (1.0 + w)),
            );
        }
    }
    let x_tensor = backend.upload(&x, rows, width).unwrap();
    let normed = backend
        .row_weighted_rms_norm(&x_tensor, &weight, hidden, eps, NormStyle::ZeroCentred)
        .unwrap();
    assert_eq!(backend.shape(&normed), (rows, width));
    assert_close(
        "row_weighted_rms_norm",
        &on,
        &backend.download(&normed).unwrap(),
        &expected,
    );
    assert!(backend
        .row_weighted_rms_norm(&x_tensor, &weight, 7, eps, NormStyle::ZeroCentred)
        .is_err());

    let expected: Vec<f32> = x
        .iter()
        .map(|v| {
            let s = v * scale;
            s / (1.0 + (-s).exp())
        })
        .collect();
    let silu = backend.scaled_silu(&x_tensor, scale).unwrap();
    assert_close(
        "scaled_silu",
        &on,
        &backend.download(&silu).unwrap(),
        &expected,
    );

    let gate = random_values(&mut rng, rows * width, 3.0);
    let mut expected = vec![0.0f32; rows * hidden];
    for row in 0..rows {
        for stream in 0..streams {
            for i in 0..hidden {
                let at = row * width + stream * hidden + i;
                expected[row * hidden + i] += host_sigmoid(gate[at]) * x[at];
            }
        }
    }
    expected.iter_mut().for_each(|v| *v *= scale);
    let gate_tensor = backend.upload(&gate, rows, width).unwrap();
    let mixed = backend
        .stream_mix(&x_tensor, &gate_tensor, streams, scale)
        .unwrap();
    assert_eq!(backend.shape(&mixed), (rows, hidden));
    assert_close(
        "stream_mix",
        &on,
        &backend.download(&mixed).unwrap(),
        &expected,
    );

    let output = random_values(&mut rng, rows * hidden, 1.5);
    let shares = random_values(&mut rng, rows * streams, 4.0);
    let mut expected = x.clone();
    for row in 0..rows {
        for stream in 0..streams {
            let share = 2.0 * host_sigmoid(shares[row * streams + stream] * scale);
            for i in 0..hidden {
                expected[row * width + stream * hidden + i] += share * output[row * hidden + i];
            }
        }
    }
    let mut streams_tensor = backend.upload(&x, rows, width).unwrap();
    backend
        .inject_into_streams(
            &mut streams_tensor,
            &backend.upload(&output, rows, hidden).unwrap(),
            &backend.upload(&shares, rows, streams).unwrap(),
            scale,
        )
        .unwrap();
    assert_close(
        "inject_into_streams",
        &on,
        &backend.download(&streams_tensor).unwrap(),
        &expected,
    );

    // The streams are made as `[rows·n, H]` and read as `[rows, n·H]`.
    let reshaped = backend
        .reshape(
            backend.upload(&x, rows * streams, hidden).unwrap(),
            rows,
            width,
        )
        .unwrap();
    assert_eq!(backend.shape(&reshaped), (rows, width));
    assert_eq!(backend.download(&reshaped).unwrap(), x);
    assert!(backend
        .reshape(backend.upload(&x, rows, width).unwrap(), rows, hidden)
        .is_err());
}
test_device!(hyper_connection_ops_match_host_loops);

/// The PLE gate op against a host loop of the model's formula, on random keys, queries and
/// values of three streams, one row's keys zero (torch's sign(0) = 0: a gate of exactly 1/2)
/// and one row's dot products tiny (the `1e-6` floor under the square root).
fn ple_gate_matches_the_host_loop<B: Backend>(backend: Arc<B>) {
    let (rows, streams, hidden) = (6, 3, 40);
    let width = streams * hidden;
    let scale = 1.0 / (hidden as f32).sqrt();
    let mut rng = Xoshiro256::seed_from_u64(23);
    let mut keys = random_values(&mut rng, rows * width, 1.5);
    let queries = random_values(&mut rng, rows * width, 1.5);
    let values = random_values(&mut rng, rows * hidden, 2.0);
    keys[..width].iter_mut().for_each(|k| *k = 0.0);
    keys[width..2 * width].iter_mut().for_each(|k| *k *= 1e-6);
    let mut expected = Vec::with_capacity(rows * width);
    for row in 0..rows {
        for stream in 0..streams {
            let base = row * width + stream * hidden;
            let dot = (0..hidden)
                .map(|i| keys[base + i] * queries[base + i])
                .sum::<f32>()
                * scale;
            let signed_root = if dot == 0.0 {
                0.0
            } else {
                dot.signum() * dot.abs().max(1e-6).sqrt()
            };
            let gate = host_sigmoid(signed_root);
            expected.extend((0..hidden).map(|i| gate * values[row * hidden + i]));
        }
    }
    let gated = backend
        .ple_gate(
            &backend.upload(&keys, rows, width).unwrap(),
            &backend.upload(&queries, rows, width).unwrap(),
            &backend.upload(&values, rows, hidden).unwrap(),
            streams,
            scale,
        )
        .unwrap();
    assert_eq!(backend.shape(&gated), (rows, width));
    let got = backend.download(&gated).unwrap();
    assert_close("ple_gate", &backend.name(), &got, &expected);
    // The zero row's gate is exactly one half.
    for (got, value) in got[..hidden].iter().zip(&values[..hidden]) {
        assert_eq!(*got, 0.5 * value);
    }
}
test_device!(ple_gate_matches_the_host_loop);

/// The sigmoid-gated Gated DeltaNet output norm as a device backend computes it (a plain-weight
/// norm per value head, then a sigmoid gate, as two backend ops) against the host function the
/// CPU backend uses, with the fixture's own norm weight over random activations.
fn sigmoid_gated_norm_by_ops_matches_the_host_function<B: Backend>(backend: Arc<B>) {
    let (_work, artifact) = converted_fixture();
    // Layer 0 is a Gated DeltaNet layer in the fixture; its norm is one value head wide.
    let name = "layers.0.gdn.norm";
    let host_weight = artifact.get(name).expect("the norm weight").to_f32_vec();
    let weight = backend.load_parameter(&artifact, name).unwrap();
    let (rows, value_heads, eps) = (7, 4, 1e-6f32);
    let width = value_heads * host_weight.len();
    let mut rng = Xoshiro256::seed_from_u64(91);
    let x = random_values(&mut rng, rows * width, 3.0);
    let gate = random_values(&mut rng, rows * width, 4.0);
    let expected = sigmoid_gated_rms_norm(&x, &gate, &host_weight, eps);
    let by_ops = sigmoid_gated_rms_norm_by_ops(
        &*backend,
        &backend.upload(&x, rows, width).unwrap(),
        &backend.upload(&gate, rows, width).unwrap(),
        &weight,
        eps,
    )
    .unwrap();
    assert_eq!(backend.shape(&by_ops), (rows, width));
    let got = backend.download(&by_ops).unwrap();
    let scale = expected.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let worst = max_abs_difference(&got, &expected);
    println!(
        "sigmoid-gated norm on {}: max |Δ| = {worst:.3e} of max |value| {scale:.3}",
        backend.name()
    );
    assert!(worst / scale < 1e-5, "the two forms differ by {worst}");
}
test_device!(sigmoid_gated_norm_by_ops_matches_the_host_function);

/// One shape of QSA layer for [`qsa_ops_match_the_host_reference`].
struct QsaOpCase {
    settings: QsaSelectionSettings,
    spec: AttentionSpec,
    /// Tokens of the first sequence (the second holds about half as many).
    lengths: &'static [usize],
}

fn qsa_op_cases() -> Vec<QsaOpCase> {
    let spec = |heads, kv_heads, head_dim| AttentionSpec {
        heads,
        kv_heads,
        head_dim,
        sliding_window: None,
    };
    vec![
        // The fixture's shape: two indexer heads, so many blocks score exactly zero.
        QsaOpCase {
            settings: settings(8, 4, 2, 16, 8),
            spec: spec(4, 2, 32),
            lengths: &[1, 5, 11, 12, 13, 40, 301],
        },
        // One indexer head: half the blocks score zero, ties straddle the k-th place often.
        QsaOpCase {
            settings: settings(48, 16, 1, 32, 16),
            spec: spec(4, 1, 64),
            lengths: &[3, 63, 64, 65, 700, 2049],
        },
        // A ratio that is no power of two.
        QsaOpCase {
            settings: settings(12, 3, 2, 16, 16),
            spec: spec(2, 2, 32),
            lengths: &[14, 15, 16, 100, 1000],
        },
        QsaOpCase {
            settings: settings(256, 64, 4, 64, 32),
            spec: spec(8, 2, 128),
            lengths: &[100, 319, 320, 1000, 8192],
        },
        // A real model's budget and ratio: 32 kept blocks out of up to 128.
        QsaOpCase {
            settings: settings(2048, 64, 8, 128, 64),
            spec: spec(8, 2, 256),
            lengths: &[2111, 2112, 8192],
        },
    ]
}

/// Host scores of every complete block a query at `position` sees, best first.
fn sorted_host_scores(
    settings: &QsaSelectionSettings,
    index_query: &[f32],
    pooled: &[f32],
    position: usize,
) -> Vec<f32> {
    let width = settings.index_head_dim;
    let blocks = (position + 1) / settings.compress_ratio;
    let mut scores: Vec<f32> = pooled
        .chunks_exact(width)
        .take(blocks)
        .map(|key| block_score(index_query, key, width))
        .collect();
    scores.sort_by(|a, b| b.total_cmp(a));
    scores
}

/// Whether the host scores of the k-th and (k+1)-th best blocks are too close for two
/// summation orders to agree on their order: within `1e-5` of the largest score, unless both
/// are exactly zero (exact-zero ties are common, the scores being sums of ReLUs, and a backend
/// must resolve them as PyTorch's topk does, as the host does).
fn near_tie_at_the_boundary(scores: &[f32], keep: usize) -> bool {
    if scores.len() <= keep || keep == 0 {
        return false;
    }
    let (kth, next) = (scores[keep - 1], scores[keep]);
    if kth == 0.0 && next == 0.0 {
        return false;
    }
    (kth - next).abs() <= 1e-5 * scores[0].abs().max(f32::MIN_POSITIVE)
}

/// The backend's QSA ops (append with pooling, indexer queries, selection, sparse attention)
/// against the host reference (`QsaBlockKeys`, `prepare_index_query`, `select_tokens` and a
/// plain softmax here) over random keys: two sequences per batch (a multi-row segment, as in a
/// prefill, and a one-row one, as in decode), grown by a prefill and then token by token, the
/// first one cut back into a completed block and grown again with other keys (a rejected
/// speculative step), for lengths from 1 to 8192 tokens, several budgets and ratios. The
/// selected token sets must be equal except where [`near_tie_at_the_boundary`] (rows skipped,
/// counted); the outputs of the rows whose selection agrees within 1e-4 of the largest value.
fn qsa_ops_match_the_host_reference<B: Backend>(backend: Arc<B>) {
    let mut rng = Xoshiro256::seed_from_u64(4242);
    let mut skipped = 0usize;
    let mut compared = 0usize;
    for case in qsa_op_cases() {
        let settings = &case.settings;
        let spec = &case.spec;
        let (width, index_row) = (
            settings.index_head_dim,
            (settings.index_heads + 1) * settings.index_head_dim,
        );
        let kv_width = spec.kv_heads * spec.head_dim;
        let q_width = spec.heads * spec.head_dim;
        let query_norm = random_values(&mut rng, width, 0.5);
        let key_norm = random_values(&mut rng, width, 0.5);
        let query_norm_weight = backend
            .parameter_from_values(&query_norm, 1, width)
            .unwrap();
        let key_norm_weight = backend.parameter_from_values(&key_norm, 1, width).unwrap();
        for &length in case.lengths {
            let lengths = [length, length / 2 + 1];
            // Per sequence: keys, values, the indexer projection (query heads, then the raw
            // key) and the attention queries of every token.
            let mut keys: Vec<Vec<f32>> = Vec::new();
            let mut values: Vec<Vec<f32>> = Vec::new();
            let mut projections: Vec<Vec<f32>> = Vec::new();
            let mut queries: Vec<Vec<f32>> = Vec::new();
            for &n in &lengths {
                keys.push(random_values(&mut rng, n * kv_width, 1.0));
                values.push(random_values(&mut rng, n * kv_width, 1.0));
                projections.push(random_values(&mut rng, n * index_row, 1.0));
                queries.push(random_values(&mut rng, n * q_width, 1.0));
            }
            let mut caches: Vec<B::QsaCache> = lengths
                .iter()
                .map(|&n| backend.new_qsa_cache(n + 1, kv_width, settings).unwrap())
                .collect();
            // Appends tokens `from[i]..to[i]` of each sequence in one call.
            let append = |caches: &mut Vec<B::QsaCache>,
                          keys: &[Vec<f32>],
                          values: &[Vec<f32>],
                          projections: &[Vec<f32>],
                          from: [usize; 2],
                          to: [usize; 2]| {
                let (mut k, mut v, mut p) = (Vec::new(), Vec::new(), Vec::new());
                let mut ranges = Vec::new();
                for s in 0..2 {
                    let start = k.len() / kv_width;
                    k.extend_from_slice(&keys[s][from[s] * kv_width..to[s] * kv_width]);
                    v.extend_from_slice(&values[s][from[s] * kv_width..to[s] * kv_width]);
                    p.extend_from_slice(&projections[s][from[s] * index_row..to[s] * index_row]);
                    ranges.push(start..start + to[s] - from[s]);
                }
                let rows = k.len() / kv_width;
                let mut segments: Vec<Segment<'_, B::QsaCache>> = caches
                    .iter_mut()
                    .zip(ranges)
                    .zip(from)
                    .map(|((state, rows), start_position)| Segment {
                        rows,
                        start_position,
                        state,
                    })
                    .collect();
                backend
                    .qsa_append(
                        &backend.upload(&k, rows, kv_width).unwrap(),
                        &backend.upload(&v, rows, kv_width).unwrap(),
                        &backend.upload(&p, rows, index_row).unwrap(),
                        &key_norm_weight,
                        settings,
                        &mut segments,
                    )
                    .unwrap();
            };
            // A prefill of all but the last few tokens, then one token per call.
            let prefill = lengths.map(|n| n.saturating_sub(3));
            append(&mut caches, &keys, &values, &projections, [0, 0], prefill);
            let mut held = prefill;
            while held != lengths {
                let next = [0, 1].map(|s| (held[s] + 1).min(lengths[s]));
                append(&mut caches, &keys, &values, &projections, held, next);
                held = next;
            }
            // Cut the first sequence back into its last complete block and grow it again with
            // other keys: a stale pooled key would show.
            let cut = length.saturating_sub(settings.compress_ratio / 2 + 2);
            if cut < length {
                backend.truncate_qsa_cache(&mut caches[0], cut);
                assert_eq!(backend.qsa_cache_tokens(&caches[0]), cut);
                let fresh = random_values(&mut rng, (length - cut) * index_row, 1.0);
                projections[0][cut * index_row..].copy_from_slice(&fresh);
                let fresh = random_values(&mut rng, (length - cut) * kv_width, 1.0);
                keys[0][cut * kv_width..].copy_from_slice(&fresh);
                append(
                    &mut caches,
                    &keys,
                    &values,
                    &projections,
                    [cut, lengths[1]],
                    [length, lengths[1]],
                );
            }
            for (cache, &n) in caches.iter().zip(&lengths) {
                assert_eq!(backend.qsa_cache_tokens(cache), n);
            }
            // Queries: the last (up to) five tokens of the first sequence, the last of the
            // second.
            let first_rows = length.min(5);
            let query_positions: Vec<(usize, usize)> = (length - first_rows..length)
                .map(|position| (0, position))
                .chain(std::iter::once((1, lengths[1] - 1)))
                .collect();
            let rows = query_positions.len();
            let mut q = Vec::new();
            let mut projected = Vec::new();
            let positions: Vec<usize> = query_positions.iter().map(|&(_, p)| p).collect();
            for &(s, position) in &query_positions {
                q.extend_from_slice(&queries[s][position * q_width..(position + 1) * q_width]);
                projected.extend_from_slice(
                    &projections[s][position * index_row..(position + 1) * index_row],
                );
            }
            let index_queries = backend
                .qsa_index_queries(
                    &backend.upload(&projected, rows, index_row).unwrap(),
                    &query_norm_weight,
                    settings,
                    &positions,
                )
                .unwrap();
            let q_tensor = backend.upload(&q, rows, q_width).unwrap();
            let [first, second] = &mut caches[..] else {
                unreachable!("two caches")
            };
            let mut segments = vec![
                Segment {
                    rows: 0..first_rows,
                    start_position: length - first_rows,
                    state: first,
                },
                Segment {
                    rows: first_rows..rows,
                    start_position: lengths[1] - 1,
                    state: second,
                },
            ];
            let selected = backend
                .qsa_selected_tokens(&index_queries, settings, &mut segments)
                .unwrap();
            let attended = backend
                .download(
                    &backend
                        .qsa_attention(&q_tensor, &index_queries, spec, settings, &mut segments)
                        .unwrap(),
                )
                .unwrap();
            drop(segments);
            // The host reference.
            let mut block_keys = Vec::new();
            for s in 0..2 {
                let mut pooled = QsaBlockKeys::new(settings.clone(), key_norm.clone()).unwrap();
                for token in 0..lengths[s] {
                    pooled
                        .push_raw_key(
                            &projections[s][token * index_row + settings.index_heads * width
                                ..(token + 1) * index_row],
                        )
                        .unwrap();
                }
                block_keys.push(pooled);
            }
            for (row, &(s, position)) in query_positions.iter().enumerate() {
                let what = format!(
                    "{} budget {} ratio {} heads {}×{} length {length} sequence {s} position {position}",
                    backend.name(),
                    settings.budget,
                    settings.compress_ratio,
                    settings.index_heads,
                    width
                );
                let raw = &projections[s][position * index_row..];
                let index_query = prepare_index_query(
                    &raw[..settings.index_heads * width],
                    &query_norm,
                    position,
                    settings,
                );
                let pooled = block_keys[s].pooled_keys();
                let expected = select_tokens(&index_query, pooled, position + 1, settings).unwrap();
                let scores = sorted_host_scores(settings, &index_query, pooled, position);
                if near_tie_at_the_boundary(&scores, settings.top_blocks()) {
                    skipped += 1;
                    continue;
                }
                compared += 1;
                assert_eq!(selected[row], expected, "{what}: selected tokens");
                // Plain softmax attention over the expected tokens.
                let group = spec.heads / spec.kv_heads;
                let scale = 1.0 / (spec.head_dim as f32).sqrt();
                let mut out = vec![0.0f32; q_width];
                for head in 0..spec.heads {
                    let kv_head = head / group;
                    let query = &q[row * q_width + head * spec.head_dim..][..spec.head_dim];
                    let logits: Vec<f32> = expected
                        .iter()
                        .map(|&token| {
                            let key = &keys[s][token * kv_width + kv_head * spec.head_dim..]
                                [..spec.head_dim];
                            query.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * scale
                        })
                        .collect();
                    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let weights: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
                    let total: f32 = weights.iter().sum();
                    for (&token, weight) in expected.iter().zip(&weights) {
                        let value = &values[s][token * kv_width + kv_head * spec.head_dim..]
                            [..spec.head_dim];
                        for (o, v) in out[head * spec.head_dim..].iter_mut().zip(value) {
                            *o += weight / total * v;
                        }
                    }
                }
                let got = &attended[row * q_width..(row + 1) * q_width];
                let scale_of = out.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                let worst = max_abs_difference(got, &out);
                assert!(
                    worst / scale_of < 1e-4,
                    "{what}: attention differs by {worst} (largest value {scale_of})"
                );
            }
        }
    }
    println!(
        "qsa ops on {}: {compared} rows compared, {skipped} skipped as near ties at the k-th block",
        backend.name()
    );
    assert!(compared > 10 * skipped.max(1), "too many near ties skipped");
}
test_device!(qsa_ops_match_the_host_reference);
