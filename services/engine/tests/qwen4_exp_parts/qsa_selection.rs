//! QSA token selection against a deliberately naive oracle written here over random keys and
//! against the selections transformers' own indexer made; ties resolved as PyTorch's `topk`
//! resolves them; the settings' validation.

use ninfer_engine::model::qwen4_exp::qsa_selection::{
    prepare_index_query, select_tokens, QsaBlockKeys, QsaSelectionSettings,
};
use ninfer_engine::model::qwen4_exp::torch_topk::torch_top_k_indices;
use ninfer_engine::sampling::Xoshiro256;

use crate::helpers::{fixture, floats, integers, random_values, settings};

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
