//! The split of a staged layer call (a batch big enough to copy its experts, too small to stream
//! layerwise) once its routing is known: the most-used non-resident experts are copied into the
//! staging slots and computed on the backend, and the executor computes the least-used ones at
//! the same time, when that is estimated to finish sooner than copying them all.
//!
//! With known routing the estimate counts each expert's real pairs, so it does not share the
//! layerwise plan's uncertainty about which experts a batch routes to: an expert with a handful
//! of pairs costs the CPU less than its copy costs the link (a few hundred tokens of an agent's
//! turn route to most experts, many of them with few pairs).
//!
//! Owns: the choice. Must not touch: the copies and computations (`moe/layer.rs`).

use ninfer_artifact::NO_EXPERT;

use crate::moe::layerwise::{PrefillThroughputs, EXECUTOR_SHARE_MARGIN};

/// What a layer call's split is chosen from.
#[derive(Debug, Clone, Copy)]
pub struct RoutedBatch {
    pub num_experts: usize,
    pub expert_bytes: usize,
    pub tokens: usize,
    pub hidden_size: usize,
}

/// Per expert, whether it is copied and computed on the backend: of the experts `expert_ids`
/// routes to (one id per pair, [`NO_EXPERT`] for pairs computed elsewhere), the `n` most-used,
/// with `n` the count of the smallest estimated time (every routed one unless leaving some to the
/// executor saves [`EXECUTOR_SHARE_MARGIN`] of it).
pub fn routed_streamed_experts(
    expert_ids: &[u32],
    batch: RoutedBatch,
    throughputs: &PrefillThroughputs,
) -> Vec<bool> {
    let mut pairs = vec![0usize; batch.num_experts];
    for &id in expert_ids {
        if id != NO_EXPERT {
            if let Some(count) = pairs.get_mut(id as usize) {
                *count += 1;
            }
        }
    }
    let mut routed: Vec<usize> = (0..batch.num_experts).filter(|&e| pairs[e] > 0).collect();
    // Most pairs first; equal counts by expert index, so the choice is deterministic.
    routed.sort_by(|&a, &b| pairs[b].cmp(&pairs[a]).then(a.cmp(&b)));
    let counts: Vec<usize> = routed.iter().map(|&e| pairs[e]).collect();
    let streamed = streamed_count(&counts, batch, throughputs);
    let mut is_streamed = vec![false; batch.num_experts];
    for &expert in routed.iter().take(streamed) {
        is_streamed[expert] = true;
    }
    is_streamed
}

/// How many of the experts with these pair counts (most first) to copy.
fn streamed_count(counts: &[usize], batch: RoutedBatch, throughputs: &PrefillThroughputs) -> usize {
    let all = counts.len();
    if throughputs.executor_pairs_per_second <= 0.0 {
        return all;
    }
    let link = throughputs.copy_bytes_per_second.max(1e-9);
    let copy = batch.expert_bytes as f64 / link;
    let backend_rate = throughputs.backend_pairs_per_second.max(1e-9);
    // One f32 row per token each way when the executor has work: down, and its sum up.
    let activations = (4 * batch.tokens * batch.hidden_size) as f64 / link;
    let total_pairs: usize = counts.iter().sum();
    let seconds = |streamed: usize, executor_pairs: usize| {
        let backend_pairs = total_pairs - executor_pairs;
        let backend_side = streamed as f64 * copy + backend_pairs as f64 / backend_rate;
        if executor_pairs == 0 {
            return backend_side;
        }
        let executor_side =
            executor_pairs as f64 / throughputs.executor_pairs_per_second + activations;
        (backend_side + activations).max(executor_side)
    };
    let all_seconds = seconds(all, 0);
    let mut best = (all, all_seconds);
    let mut executor_pairs = 0;
    for streamed in (0..all).rev() {
        executor_pairs += counts[streamed];
        let estimate = seconds(streamed, executor_pairs);
        if estimate < best.1 {
            best = (streamed, estimate);
        }
    }
    if best.1 > all_seconds * (1.0 - EXECUTOR_SHARE_MARGIN) {
        return all;
    }
    best.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(executor_pairs_per_second: f64) -> PrefillThroughputs {
        PrefillThroughputs {
            // 1.77 MB experts in 35 µs; the backend fast; the CPU 5 µs a pair.
            copy_bytes_per_second: 50e9,
            backend_pairs_per_second: 1e9,
            executor_pairs_per_second,
            flops_per_pair: 6.0 * 2048.0 * 512.0,
        }
    }

    const BATCH: RoutedBatch = RoutedBatch {
        num_experts: 8,
        expert_bytes: 1_770_000,
        tokens: 600,
        hidden_size: 2048,
    };

    fn ids(pairs_per_expert: &[usize]) -> Vec<u32> {
        let mut ids = Vec::new();
        for (expert, &count) in pairs_per_expert.iter().enumerate() {
            ids.extend(std::iter::repeat_n(expert as u32, count));
        }
        ids.push(NO_EXPERT);
        ids
    }

    #[test]
    fn experts_with_few_pairs_go_to_the_executor_and_busy_ones_are_copied() {
        // Two busy experts, five with one or two pairs, one not routed.
        let streamed =
            routed_streamed_experts(&ids(&[40, 1, 2, 30, 1, 2, 1, 0]), BATCH, &rates(2e5));
        assert_eq!(
            streamed,
            [true, false, false, true, false, false, false, false]
        );
    }

    #[test]
    fn everything_routed_is_copied_without_an_executor_rate_or_when_it_saves_too_little() {
        let routing = ids(&[40, 1, 2, 30, 1, 2, 1, 0]);
        let all = [true, true, true, true, true, true, true, false];
        assert_eq!(routed_streamed_experts(&routing, BATCH, &rates(0.0)), all);
        // A CPU so slow that even one pair costs more than a copy.
        assert_eq!(routed_streamed_experts(&routing, BATCH, &rates(1e3)), all);
        // Nothing routed: nothing copied.
        assert_eq!(
            routed_streamed_experts(&[NO_EXPERT; 4], BATCH, &rates(2e5)),
            [false; 8]
        );
    }
}
