//! Logit candidates: what sampling needs from one row of logits, small enough to leave the GPU
//! every token instead of the whole `[vocab]` row (151,936 floats for Qwen3).
//!
//! Owns: the [`LogitCandidates`] of a row (its `k` largest logits, its max and log-sum-exp, the
//! logits of some asked-for ids) and the host computation of them, which the CPU backend runs
//! and the CUDA backend's tests check against.
//! Must not touch: sampling itself (`crate::sampling` decides when candidates suffice).

use crate::error::EngineError;

/// A number of largest logits that leaves room for sampling settings the tests vary.
pub const DEFAULT_CANDIDATES: usize = 64;
/// Most largest logits one candidate read-back carries per row (`SAMPLING_MAX_K` in
/// `kernels/sampling.cu`).
pub const MAX_CANDIDATES: usize = 256;

/// What sampling needs from one row of logits.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitCandidates {
    /// Columns of the row (the vocabulary size).
    pub vocab: usize,
    /// The `min(k, vocab)` largest logits as `(token, logit)`, largest first in the order of
    /// `f32::total_cmp`, lower token first among equal values (the order
    /// [`crate::sampling::filtered_distribution`] sorts by).
    pub top: Vec<(u32, f32)>,
    /// The row's largest logit.
    pub max: f32,
    /// `ln Σ exp(logit)` over the whole row, as the scheduler's logprobs compute it: `max` +
    /// the f32 of `ln Σ exp(logit − max)` summed in f64.
    pub log_sum_exp: f32,
    /// `(token, logit)` of each asked-for extra token, in the order asked.
    pub extra: Vec<(u32, f32)>,
}

impl LogitCandidates {
    /// The logit of `token`, if the candidates carry it.
    pub fn logit(&self, token: u32) -> Option<f32> {
        self.top
            .iter()
            .chain(&self.extra)
            .find(|(id, _)| *id == token)
            .map(|&(_, logit)| logit)
    }

    /// True when `top` holds every token of the row.
    pub fn covers_vocab(&self) -> bool {
        self.top.len() >= self.vocab
    }
}

/// The largest logits a row's sampling needs to decide exactly from candidates: its top-k
/// (greedy: 1) or `top_logprobs`, whichever is more, plus its `penalised` tokens (penalties
/// can move each of them out of the way), within [`MAX_CANDIDATES`]. With fewer, sampling
/// reads the row whole.
pub fn candidates_needed(top_k: usize, top_logprobs: usize, penalised: usize) -> usize {
    top_k
        .max(top_logprobs)
        .saturating_add(penalised)
        .clamp(1, MAX_CANDIDATES)
}

/// Checks the arguments of a candidates op: `k` within [`MAX_CANDIDATES`], one extra list per
/// row, every extra id inside the row.
pub fn check_candidate_request(
    rows: usize,
    cols: usize,
    k: usize,
    extra: &[Vec<u32>],
) -> Result<(), EngineError> {
    let invalid = |problem: String| Err(EngineError::InvalidConfig { problem });
    if k == 0 || k > MAX_CANDIDATES {
        return invalid(format!(
            "logit candidates: k = {k} outside 1..={MAX_CANDIDATES}"
        ));
    }
    if extra.len() != rows {
        return invalid(format!(
            "logit candidates: {} extra-token lists for {rows} rows",
            extra.len()
        ));
    }
    if let Some(&bad) = extra.iter().flatten().find(|&&id| id as usize >= cols) {
        return invalid(format!(
            "logit candidates: extra token {bad} outside the {cols} logits of a row"
        ));
    }
    Ok(())
}

/// `(max, log-sum-exp)` of a row exactly as the scheduler's logprobs compute them.
pub fn max_and_log_sum_exp(row: &[f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = row
        .iter()
        .map(|&x| ((x - max) as f64).exp())
        .sum::<f64>()
        .ln() as f32
        + max;
    (max, log_sum)
}

/// The candidates of one row on the host.
pub fn row_candidates(row: &[f32], k: usize, extra: &[u32]) -> LogitCandidates {
    let most_likely_first =
        |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    let k = k.min(order.len());
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, most_likely_first);
    }
    order.truncate(k);
    order.sort_unstable_by(most_likely_first);
    let (max, log_sum_exp) = max_and_log_sum_exp(row);
    LogitCandidates {
        vocab: row.len(),
        top: order.iter().map(|&t| (t, row[t as usize])).collect(),
        max,
        log_sum_exp,
        extra: extra
            .iter()
            .filter_map(|&t| row.get(t as usize).map(|&logit| (t, logit)))
            .collect(),
    }
}

/// The candidates of every row of a row-major `[rows, cols]` buffer, after
/// [`check_candidate_request`].
pub fn host_candidates(
    values: &[f32],
    cols: usize,
    k: usize,
    extra: &[Vec<u32>],
) -> Result<Vec<LogitCandidates>, EngineError> {
    let rows = values.len().checked_div(cols).unwrap_or(0);
    check_candidate_request(rows, cols, k, extra)?;
    Ok(values
        .chunks(cols.max(1))
        .zip(extra)
        .map(|(row, extra)| row_candidates(row, k, extra))
        .collect())
}
