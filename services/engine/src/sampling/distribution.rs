//! A logits row as a distribution: penalties, the top-k / top-p / min-p filters, the whole-row
//! weights and a draw from them, in order or not (speculative verification needs no order).
//!
//! Owns: the filtering and drawing rules. Must not touch: the request's state (`Sampler`).

use crate::sampling::params::SamplingParams;

/// The token at `point` of a distribution (uniform in `[0, 1)` for a normalised one; in
/// `[0, total)` otherwise): the first whose cumulative probability passes it.
pub(crate) fn draw_at(candidates: &[(u32, f64)], point: f64) -> u32 {
    let mut cumulative = 0.0f64;
    for &(token, probability) in candidates {
        cumulative += probability;
        if point < cumulative {
            return token;
        }
    }
    // Rounding left the cumulative sum a hair under 1: the last candidate takes the rest.
    candidates.last().map(|&(token, _)| token).unwrap_or(0)
}

/// Top-p narrows the tokens it has not yet placed in or out of its set by halving selections
/// until this many are left, then sorts those.
pub(crate) const TOP_P_SORTED_TAIL: usize = 256;

/// The weights of [`filtered_distribution`] without top-k (temperature, top-p, min-p over the
/// whole row), found without sorting the whole vocabulary.
///
/// The weights are `exp((logit − max) / T)`, so the most likely token weighs 1 and min-p keeps
/// exactly the tokens weighing at least `min_p`. Without top-p every token may be kept; with
/// top-p the smallest most-likely-first set reaching `top_p` of the total is found by selections
/// that halve the undecided tokens (O(vocabulary) expected). Sorting the 151,936 logits of a
/// Qwen vocabulary at every step cost ~6 ms (`ninfer bench sampling`).
pub(crate) struct WholeRowWeights {
    pub(crate) weights: Vec<f64>,
    pub(crate) min_weight: f64,
    /// The top-p set, in no particular order; `None` without top-p.
    pub(crate) top_p_set: Option<Vec<u32>>,
}

impl WholeRowWeights {
    /// `None` when a logit is NaN or the largest is not finite (the sorting path defines those
    /// cases).
    pub(crate) fn new(logits: &[f32], params: &SamplingParams) -> Option<Self> {
        if logits.iter().any(|logit| logit.is_nan()) {
            return None;
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return None;
        }
        let temperature = params.temperature.max(1e-6) as f64;
        let weights = whole_row_weights(logits, max, temperature);
        let top_p_set = (params.top_p < 1.0).then(|| top_p_set(logits, &weights, params.top_p));
        Some(Self {
            weights,
            min_weight: params.min_p as f64,
            top_p_set,
        })
    }

    pub(crate) fn kept(&self, weight: f64) -> bool {
        weight > 0.0 && weight >= self.min_weight
    }

    /// The tokens top-p leaves (every token without top-p, in token order), before min-p.
    pub(crate) fn candidates(&self) -> impl Iterator<Item = u32> + '_ {
        let every_token = match self.top_p_set {
            Some(_) => 0..0,
            None => 0..self.weights.len() as u32,
        };
        let top_p_set = self.top_p_set.as_deref().unwrap_or_default();
        top_p_set.iter().copied().chain(every_token)
    }

    /// The token at `point` (uniform in `[0, 1)`): the kept tokens are walked in the order
    /// [`WholeRowWeights::candidates`] gives. Each token gets exactly its share of `[0, 1)`;
    /// the order only decides which token a given point lands on. The last kept token when
    /// rounding leaves the sum a hair short.
    pub(crate) fn draw(&self, point: f64) -> Option<u32> {
        let total: f64 = self.kept_weights().map(|(_, weight)| weight).sum();
        let target = point * total;
        let mut cumulative = 0.0f64;
        let mut last = None;
        for (token, weight) in self.kept_weights() {
            cumulative += weight;
            last = Some(token);
            if target < cumulative {
                return last;
            }
        }
        last
    }

    /// The kept tokens with their unnormalised weights.
    pub(crate) fn kept_weights(&self) -> impl Iterator<Item = (u32, f64)> + '_ {
        self.candidates()
            .map(|token| (token, self.weights[token as usize]))
            .filter(|&(_, weight)| self.kept(weight))
    }

    /// The kept tokens with their probabilities, in the order of the candidates.
    pub(crate) fn distribution(&self) -> Vec<(u32, f64)> {
        let mut distribution: Vec<(u32, f64)> = self.kept_weights().collect();
        let total: f64 = distribution.iter().map(|&(_, weight)| weight).sum();
        distribution
            .iter_mut()
            .for_each(|(_, weight)| *weight /= total);
        distribution
    }
}

/// Rows at least this long compute their weights on several cores: a Qwen vocabulary's
/// 151,936–248,320 `exp`s took most of a whole-row draw's ~0.5 ms on one core, once per token.
const PARALLEL_WEIGHTS_MIN_TOKENS: usize = 32 * 1024;
/// Tokens per parallel piece (an `exp` is a few ns: a piece is tens of µs of work).
const PARALLEL_WEIGHTS_PIECE: usize = 8 * 1024;

/// `exp((logit − max) / temperature)` per token, in f64; each value is computed alone, so
/// splitting the row over threads gives the same bits as one loop.
fn whole_row_weights(logits: &[f32], max: f32, temperature: f64) -> Vec<f64> {
    let weight = |logit: f32| ((logit as f64 - max as f64) / temperature).exp();
    let mut weights = vec![0.0f64; logits.len()];
    if logits.len() < PARALLEL_WEIGHTS_MIN_TOKENS {
        for (out, &logit) in weights.iter_mut().zip(logits) {
            *out = weight(logit);
        }
        return weights;
    }
    use rayon::prelude::*;
    weights
        .par_chunks_mut(PARALLEL_WEIGHTS_PIECE)
        .zip(logits.par_chunks(PARALLEL_WEIGHTS_PIECE))
        .for_each(|(out, piece)| {
            for (out, &logit) in out.iter_mut().zip(piece) {
                *out = weight(logit);
            }
        });
    weights
}

/// The smallest most-likely-first set of tokens whose `weights` reach `top_p` of their total,
/// in no particular order: selections halve the undecided tokens until
/// [`TOP_P_SORTED_TAIL`] are left, and only those are sorted.
pub(crate) fn top_p_set(logits: &[f32], weights: &[f64], top_p: f32) -> Vec<u32> {
    let goal = top_p as f64 * weights.iter().sum::<f64>();
    let most_likely_first = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    // order[..low] is in the set (more likely than every token after it), order[high..] out;
    // `placed` is the weight of order[..low].
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let (mut low, mut high, mut placed) = (0usize, order.len(), 0.0f64);
    while high - low > TOP_P_SORTED_TAIL {
        let half = (high - low) / 2;
        order[low..high].select_nth_unstable_by(half, most_likely_first);
        let upper: f64 = order[low..=low + half]
            .iter()
            .map(|&token| weights[token as usize])
            .sum();
        if placed + upper >= goal {
            high = low + half + 1;
        } else {
            placed += upper;
            low += half + 1;
        }
    }
    order[low..high].sort_unstable_by(most_likely_first);
    let mut cumulative = placed;
    let reached = order[low..high].iter().position(|&token| {
        cumulative += weights[token as usize];
        cumulative >= goal
    });
    // Rounding may leave the goal a hair out of reach: then every undecided token is in.
    order.truncate(reached.map_or(high, |index| low + index + 1));
    order
}

/// The token at `point` (uniform in `[0, 1)`) of [`filtered_distribution`] without top-k,
/// without sorting the whole vocabulary ([`WholeRowWeights`]). `None` when the row needs the
/// sorting path (a NaN logit, or no finite one).
pub(crate) fn draw_without_top_k(
    logits: &[f32],
    params: &SamplingParams,
    point: f64,
) -> Option<u32> {
    WholeRowWeights::new(logits, params)?.draw(point)
}

/// Whether a request's top-k leaves the whole row (0 means none).
pub(crate) fn without_top_k(params: &SamplingParams, vocab: usize) -> bool {
    params.top_k == 0 || params.top_k >= vocab
}

/// The tokens and probabilities of [`filtered_distribution`] in no particular order: without
/// top-k the whole row is not sorted ([`WholeRowWeights`]), which is what speculative
/// decoding's verification needs (it looks tokens up and draws; the order only decides which
/// token a given random point lands on).
pub fn filtered_distribution_unordered(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    if without_top_k(params, logits.len()) {
        if let Some(weights) = WholeRowWeights::new(logits, params) {
            return weights.distribution();
        }
    }
    filtered_distribution(logits, params)
}

/// Index of the largest logit (lowest index on ties, like `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &value) in logits.iter().enumerate() {
        if value > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Repetition, presence and frequency penalties, in place.
pub fn apply_penalties(logits: &mut [f32], history: &[u32], params: &SamplingParams) {
    if history.is_empty() {
        return;
    }
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for &token in history {
        if (token as usize) < logits.len() {
            *counts.entry(token).or_default() += 1;
        }
    }
    for (&token, &count) in &counts {
        penalise(&mut logits[token as usize], count, params);
    }
}

/// The penalties of a token seen `count` times, on its logit.
pub(crate) fn penalise(logit: &mut f32, count: u32, params: &SamplingParams) {
    if params.repetition_penalty != 1.0 {
        *logit = if *logit > 0.0 {
            *logit / params.repetition_penalty
        } else {
            *logit * params.repetition_penalty
        };
    }
    *logit -= params.presence_penalty + params.frequency_penalty * count as f32;
}

/// The candidates left after temperature, top-k, top-p and min-p, with renormalised
/// probabilities, most likely first.
pub fn filtered_distribution(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    if logits.is_empty() {
        return Vec::new();
    }
    let most_likely_first = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    // With top-k only the k best can survive: select them in O(vocab) and sort just those (the
    // same tokens in the same order as sorting the whole vocabulary — ~150k entries — each step).
    if params.top_k > 0 && params.top_k < order.len() {
        order.select_nth_unstable_by(params.top_k - 1, most_likely_first);
        order.truncate(params.top_k);
    }
    order.sort_unstable_by(most_likely_first);
    distribution_of_order(&order, |t| logits[t as usize], params)
}

/// The rest of [`filtered_distribution`] once `order` holds the surviving tokens (after top-k),
/// most likely first: temperature, softmax, top-p, min-p, renormalisation.
pub(crate) fn distribution_of_order(
    order: &[u32],
    logit: impl Fn(u32) -> f32,
    params: &SamplingParams,
) -> Vec<(u32, f64)> {
    let Some(&first) = order.first() else {
        return Vec::new();
    };
    let temperature = params.temperature.max(1e-6) as f64;
    let max = logit(first) as f64;
    let mut candidates: Vec<(u32, f64)> = order
        .iter()
        .map(|&t| (t, ((logit(t) as f64 - max) / temperature).exp()))
        .collect();
    let normalise = |candidates: &mut Vec<(u32, f64)>| {
        let total: f64 = candidates.iter().map(|c| c.1).sum();
        candidates.iter_mut().for_each(|c| c.1 /= total);
    };
    normalise(&mut candidates);
    if params.top_p < 1.0 {
        let mut cumulative = 0.0;
        let mut keep = candidates.len();
        for (i, c) in candidates.iter().enumerate() {
            cumulative += c.1;
            if cumulative >= params.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        candidates.truncate(keep.max(1));
    }
    if params.min_p > 0.0 {
        let threshold = candidates[0].1 * params.min_p as f64;
        candidates.retain(|c| c.1 >= threshold);
    }
    normalise(&mut candidates);
    candidates
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole vocabulary's weights, computed in parallel pieces, are the bits of one loop's
    /// (a draw's cumulative sums, and so the sampled tokens, depend on every bit).
    #[test]
    fn parallel_weights_equal_one_loop() {
        let vocab = 248_320;
        assert!(vocab >= PARALLEL_WEIGHTS_MIN_TOKENS);
        // Logits spread over a wide range, irregularly (not powers of two apart).
        let logits: Vec<f32> = (0..vocab)
            .map(|i| ((i as u64 * 2_654_435_761) % 100_003) as f32 * 3.7e-4 - 18.0)
            .collect();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for temperature in [1.0f64, 0.7, 1.3] {
            let parallel = whole_row_weights(&logits, max, temperature);
            let one_loop: Vec<f64> = logits
                .iter()
                .map(|&logit| ((logit as f64 - max as f64) / temperature).exp())
                .collect();
            assert_eq!(parallel.len(), one_loop.len());
            let same = parallel
                .iter()
                .zip(&one_loop)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "temperature {temperature}: the weights differ");
        }
    }
}
