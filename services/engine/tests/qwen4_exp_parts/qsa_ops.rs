//! On every backend: the QSA ops (append and block pooling, indexer queries, block selection,
//! sparse attention) against the host reference over random keys.

use std::sync::Arc;

use ninfer_engine::backend::{AttentionSpec, Segment};
use ninfer_engine::model::qwen4_exp::qsa_selection::{
    block_score, prepare_index_query, select_tokens, QsaBlockKeys, QsaSelectionSettings,
};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::max_abs_difference;
use ninfer_engine::{test_device, Backend};

use crate::helpers::{random_values, settings};

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
