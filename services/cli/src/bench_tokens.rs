//! What every serving benchmark shares: seeded random prompts, the sampled bench request, and
//! the gaps between token arrivals with their percentiles.
//!
//! Owns: those helpers. Must not touch: any one benchmark's measurement or report.

use std::time::{Duration, Instant};

use ninfer_protocol::v1::{GenerateRequest, SamplingParameters};
use serde::Serialize;

/// Time between consecutive tokens of a sequence at the client (ms): how even the decode
/// steps are, which a mean rate hides (a slow step every so often, a stall behind a prompt).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct StepLatency {
    /// Gaps measured.
    pub steps: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl StepLatency {
    /// Nearest-rank percentiles of `gaps`; all zero when there are none.
    pub(crate) fn of(gaps: &[Duration]) -> Self {
        let mut ms: Vec<f64> = gaps.iter().map(|gap| gap.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            if ms.is_empty() {
                return 0.0;
            }
            let index = ((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1;
            ms[index]
        };
        StepLatency {
            steps: ms.len(),
            p50_ms: rank(0.50),
            p99_ms: rank(0.99),
            max_ms: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// The gaps between consecutive arrivals.
pub(crate) fn gaps(arrivals: &[Instant]) -> Vec<Duration> {
    arrivals
        .windows(2)
        .map(|pair| pair[1].saturating_duration_since(pair[0]))
        .collect()
}

/// Seeded pseudo-random token ids below `vocab` (splitmix64).
pub(crate) fn random_tokens(count: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % u64::from(vocab.max(1))) as u32
        })
        .collect()
}

/// A bench generation: `new_tokens` sampled at temperature 1 (top-20) with `seed` (greedy
/// decoding of random weights loops over a few tokens, and so over a few experts).
pub(crate) fn bench_request(
    request_id: String,
    prompt: Vec<u32>,
    new_tokens: usize,
    seed: u64,
) -> GenerateRequest {
    GenerateRequest {
        request_id,
        prompt_token_ids: prompt,
        max_new_tokens: new_tokens as u32,
        sampling: Some(SamplingParameters {
            temperature: 1.0,
            top_k: 20,
            seed: Some(seed),
            ..Default::default()
        }),
        ..Default::default()
    }
}
