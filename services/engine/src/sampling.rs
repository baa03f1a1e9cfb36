//! Next-token sampling: penalties, temperature, top-k, top-p, min-p, seeded draws.
//!
//! Owns: turning one row of logits (plus the tokens seen so far) into a token id, reproducibly.
//! The PRNG is a self-contained xoshiro256** seeded through splitmix64, so a seed gives the same
//! tokens whatever crate versions are linked.
//! Must not touch: the model, tokenization, stop strings.

use crate::backend::LogitCandidates;
use crate::error::EngineError;

/// Sampling settings of one request. `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0 = off).
    pub min_p: f32,
    /// transformers-style: a seen token's logit is divided by it if positive, multiplied if not
    /// (1 = off).
    pub repetition_penalty: f32,
    /// OpenAI-style: subtracted once from every seen token's logit (0 = off).
    pub presence_penalty: f32,
    /// OpenAI-style: subtracted per occurrence of a seen token (0 = off).
    pub frequency_penalty: f32,
    pub seed: u64,
    /// Draws of the random stream an earlier part of this generation already used (a resumed
    /// generation continues the stream there); 0: from the start.
    pub stream_position: u64,
}

/// Most draws a sampler skips at its start (far more than any context's tokens).
pub const MAX_STREAM_POSITION: u64 = 1 << 24;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            stream_position: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams::default()
    }

    pub fn validate(&self) -> Result<(), EngineError> {
        let invalid = |problem: String| Err(EngineError::InvalidSampling { problem });
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return invalid(format!("temperature {} must be ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return invalid(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return invalid(format!(
                "repetition_penalty {} must be > 0",
                self.repetition_penalty
            ));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return invalid("presence and frequency penalties must be finite".into());
        }
        if self.stream_position > MAX_STREAM_POSITION {
            return invalid(format!(
                "random stream position {} must be at most {MAX_STREAM_POSITION}",
                self.stream_position
            ));
        }
        Ok(())
    }
}

/// splitmix64 step (seeding).
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256** — small, fast, and fixed forever by its definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut state = seed;
        Xoshiro256 {
            s: [
                splitmix64(&mut state),
                splitmix64(&mut state),
                splitmix64(&mut state),
                splitmix64(&mut state),
            ],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A per-sequence sampler: its parameters and its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self, EngineError> {
        params.validate()?;
        let mut rng = Xoshiro256::seed_from_u64(params.seed);
        // A resumed generation: the draws its earlier part used are skipped, not repeated.
        for _ in 0..params.stream_position {
            rng.next_u64();
        }
        Ok(Sampler { params, rng })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits`, penalising tokens of `history` (prompt and output
    /// so far, as the caller chooses).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32, EngineError> {
        if logits.is_empty() {
            return Err(EngineError::EmptyInput {
                what: "no logits to sample from".into(),
            });
        }
        let mut logits = logits.to_vec();
        apply_penalties(&mut logits, history, &self.params);
        if self.params.temperature == 0.0 {
            return Ok(argmax(&logits));
        }
        let point = self.rng.next_f64();
        if without_top_k(&self.params, logits.len()) {
            if let Some(token) = draw_without_top_k(&logits, &self.params, point) {
                return Ok(token);
            }
        }
        let candidates = filtered_distribution(&logits, &self.params);
        Ok(draw_at(&candidates, point))
    }

    /// One draw from a filtered distribution.
    fn draw(&mut self, candidates: &[(u32, f64)]) -> u32 {
        draw_at(candidates, self.rng.next_f64())
    }

    /// True when any penalty changes logits (then the penalised tokens must come with the
    /// candidates: [`Sampler::penalised_tokens`]).
    pub fn penalises(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// Whether [`Sampler::sample_from_candidates`] can pick this request's tokens from
    /// candidates with `k` largest logits (it may still ask for the whole row when penalties
    /// push too many of them down): greedy, or `0 < top_k ≤ k`.
    pub fn candidates_suffice(&self, k: usize) -> bool {
        self.params.temperature == 0.0 || (self.params.top_k > 0 && self.params.top_k <= k)
    }

    /// The distinct tokens of `history` inside a `vocab`-token row that penalties change,
    /// ascending (none without penalties): the extra logits a candidate read-back must carry.
    pub fn penalised_tokens(&self, history: &[u32], vocab: usize) -> Vec<u32> {
        if !self.penalises() {
            return Vec::new();
        }
        let mut tokens: Vec<u32> = history
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        tokens.sort_unstable();
        tokens.dedup();
        tokens
    }

    /// [`Sampler::sample`] from the row's [`LogitCandidates`] (made with the extra tokens of
    /// [`Sampler::penalised_tokens`]): the same token and the same random draws as `sample` on
    /// the whole row, or `Ok(None)` without drawing when the candidates cannot decide exactly
    /// (not [`Sampler::candidates_suffice`], a penalised token missing, or fewer than `top_k`
    /// (greedy: 1) unpenalised tokens among the largest logits); then the caller samples from
    /// the whole row.
    ///
    /// Why it is exact: tokens outside the candidates keep their logits (no penalty applies to
    /// them) and each comes after every unpenalised candidate in `sample`'s order, so with at
    /// least `top_k` unpenalised candidates none of them survives top-k.
    pub fn sample_from_candidates(
        &mut self,
        candidates: &LogitCandidates,
        history: &[u32],
    ) -> Result<Option<u32>, EngineError> {
        if candidates.vocab == 0 || candidates.top.is_empty() {
            return Err(EngineError::EmptyInput {
                what: "no logits to sample from".into(),
            });
        }
        if candidates.covers_vocab() {
            let mut row = vec![f32::NEG_INFINITY; candidates.vocab];
            for &(token, logit) in &candidates.top {
                if let Some(slot) = row.get_mut(token as usize) {
                    *slot = logit;
                }
            }
            return self.sample(&row, history).map(Some);
        }
        if !self.candidates_suffice(candidates.top.len()) {
            return Ok(None);
        }
        let mut values: std::collections::BTreeMap<u32, f32> = candidates
            .top
            .iter()
            .chain(&candidates.extra)
            .copied()
            .collect();
        let mut unpenalised = candidates.top.len();
        if self.penalises() {
            let mut counts = std::collections::HashMap::<u32, u32>::new();
            for &token in history {
                if (token as usize) < candidates.vocab {
                    *counts.entry(token).or_default() += 1;
                }
            }
            for (&token, &count) in &counts {
                let Some(logit) = values.get_mut(&token) else {
                    return Ok(None);
                };
                penalise(logit, count, &self.params);
            }
            unpenalised = candidates
                .top
                .iter()
                .filter(|(token, _)| !counts.contains_key(token))
                .count();
        }
        if self.params.temperature == 0.0 {
            if unpenalised == 0 {
                return Ok(None);
            }
            // `argmax` over the candidates in token order: the lowest token among equal maxima.
            let mut best: Option<(u32, f32)> = None;
            for (&token, &logit) in &values {
                if best.is_none_or(|(_, value)| logit > value) {
                    best = Some((token, logit));
                }
            }
            return Ok(best.map(|(token, _)| token));
        }
        let top_k = self.params.top_k;
        if unpenalised < top_k {
            return Ok(None);
        }
        let mut order: Vec<u32> = values.keys().copied().collect();
        order.sort_unstable_by(|a, b| values[b].total_cmp(&values[a]).then(a.cmp(b)));
        order.truncate(top_k);
        let distribution = distribution_of_order(&order, |t| values[&t], &self.params);
        Ok(Some(self.draw(&distribution)))
    }
}

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
const TOP_P_SORTED_TAIL: usize = 256;

/// The weights of [`filtered_distribution`] without top-k (temperature, top-p, min-p over the
/// whole row), found without sorting the whole vocabulary.
///
/// The weights are `exp((logit − max) / T)`, so the most likely token weighs 1 and min-p keeps
/// exactly the tokens weighing at least `min_p`. Without top-p every token may be kept; with
/// top-p the smallest most-likely-first set reaching `top_p` of the total is found by selections
/// that halve the undecided tokens (O(vocabulary) expected). Sorting the 151,936 logits of a
/// Qwen vocabulary at every step cost ~6 ms (`ninfer bench sampling`).
struct WholeRowWeights {
    weights: Vec<f64>,
    min_weight: f64,
    /// The top-p set, in no particular order; `None` without top-p.
    top_p_set: Option<Vec<u32>>,
}

impl WholeRowWeights {
    /// `None` when a logit is NaN or the largest is not finite (the sorting path defines those
    /// cases).
    fn new(logits: &[f32], params: &SamplingParams) -> Option<Self> {
        if logits.iter().any(|logit| logit.is_nan()) {
            return None;
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return None;
        }
        let temperature = params.temperature.max(1e-6) as f64;
        let weights: Vec<f64> = logits
            .iter()
            .map(|&logit| ((logit as f64 - max as f64) / temperature).exp())
            .collect();
        let top_p_set = (params.top_p < 1.0).then(|| top_p_set(logits, &weights, params.top_p));
        Some(Self {
            weights,
            min_weight: params.min_p as f64,
            top_p_set,
        })
    }

    fn kept(&self, weight: f64) -> bool {
        weight > 0.0 && weight >= self.min_weight
    }

    /// The tokens top-p leaves (every token without top-p, in token order), before min-p.
    fn candidates(&self) -> impl Iterator<Item = u32> + '_ {
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
    fn draw(&self, point: f64) -> Option<u32> {
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
    fn kept_weights(&self) -> impl Iterator<Item = (u32, f64)> + '_ {
        self.candidates()
            .map(|token| (token, self.weights[token as usize]))
            .filter(|&(_, weight)| self.kept(weight))
    }

    /// The kept tokens with their probabilities, in the order of the candidates.
    fn distribution(&self) -> Vec<(u32, f64)> {
        let mut distribution: Vec<(u32, f64)> = self.kept_weights().collect();
        let total: f64 = distribution.iter().map(|&(_, weight)| weight).sum();
        distribution
            .iter_mut()
            .for_each(|(_, weight)| *weight /= total);
        distribution
    }
}

/// The smallest most-likely-first set of tokens whose `weights` reach `top_p` of their total,
/// in no particular order: selections halve the undecided tokens until
/// [`TOP_P_SORTED_TAIL`] are left, and only those are sorted.
fn top_p_set(logits: &[f32], weights: &[f64], top_p: f32) -> Vec<u32> {
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
fn draw_without_top_k(logits: &[f32], params: &SamplingParams, point: f64) -> Option<u32> {
    WholeRowWeights::new(logits, params)?.draw(point)
}

/// Whether a request's top-k leaves the whole row (0 means none).
fn without_top_k(params: &SamplingParams, vocab: usize) -> bool {
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
fn penalise(logit: &mut f32, count: u32, params: &SamplingParams) {
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
fn distribution_of_order(
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

    #[test]
    fn xoshiro_matches_its_reference_stream() {
        // Reference: xoshiro256** with state [1, 2, 3, 4] (from the authors' C code).
        let mut rng = Xoshiro256 { s: [1, 2, 3, 4] };
        let expected = [11520u64, 0, 1509978240, 1215971899390074240];
        for value in expected {
            assert_eq!(rng.next_u64(), value);
        }
    }

    #[test]
    fn greedy_picks_the_argmax() {
        let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(sampler.sample(&[0.1, 2.0, -1.0, 2.0], &[]).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 * 0.3).collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..SamplingParams::default()
        };
        let draw = |params: &SamplingParams| {
            let mut sampler = Sampler::new(params.clone()).unwrap();
            (0..64)
                .map(|_| sampler.sample(&logits, &[]).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(&params), draw(&params));
        let other = SamplingParams {
            seed: 43,
            ..params.clone()
        };
        assert_ne!(draw(&params), draw(&other));
    }

    #[test]
    fn top_k_top_p_and_min_p_restrict_the_candidates() {
        let logits = [4.0f32, 3.0, 2.0, 1.0, 0.0];
        let base = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let top_k = filtered_distribution(
            &logits,
            &SamplingParams {
                top_k: 2,
                ..base.clone()
            },
        );
        assert_eq!(top_k.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1]);
        // p(0) ≈ 0.636, p(0)+p(1) ≈ 0.87.
        let top_p = filtered_distribution(
            &logits,
            &SamplingParams {
                top_p: 0.8,
                ..base.clone()
            },
        );
        assert_eq!(top_p.len(), 2);
        let min_p = filtered_distribution(
            &logits,
            &SamplingParams {
                min_p: 0.3,
                ..base.clone()
            },
        );
        // p(1)/p(0) = e^-1 ≈ 0.37 ≥ 0.3, p(2)/p(0) = e^-2 ≈ 0.135 < 0.3.
        assert_eq!(min_p.len(), 2);
        let total: f64 = min_p.iter().map(|c| c.1).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }

    #[test]
    fn temperature_scales_the_logits_before_the_softmax() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        for temperature in [0.5f32, 1.0, 2.0] {
            let candidates = filtered_distribution(
                &logits,
                &SamplingParams {
                    temperature,
                    ..SamplingParams::default()
                },
            );
            let total: f64 = logits
                .iter()
                .map(|&x| (x as f64 / temperature as f64).exp())
                .sum();
            for (token, probability) in candidates {
                let expected = (logits[token as usize] as f64 / temperature as f64).exp() / total;
                assert!(
                    (probability - expected).abs() < 1e-12,
                    "T={temperature} token {token}: {probability} vs {expected}"
                );
            }
        }
        // Draws follow the tempered distribution: at T = 2, p(1)/p(0) = e^-0.5 ≈ 0.607.
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 2.0,
            seed: 11,
            ..SamplingParams::default()
        })
        .unwrap();
        let ones = (0..20000)
            .filter(|_| sampler.sample(&[1.0, 0.0], &[]).unwrap() == 1)
            .count();
        let expected = 1.0 / (1.0 + 0.5f64.exp());
        let fraction = ones as f64 / 20000.0;
        assert!(
            (fraction - expected).abs() < 0.02,
            "{fraction} vs {expected}"
        );
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..SamplingParams::default()
        })
        .unwrap();
        let ones = (0..20000)
            .filter(|_| sampler.sample(&logits, &[]).unwrap() == 1)
            .count();
        let fraction = ones as f64 / 20000.0;
        assert!((fraction - 0.75).abs() < 0.02, "{fraction}");
    }

    #[test]
    fn penalties_follow_their_conventions() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::default()
        };
        let mut logits = vec![2.0f32, -2.0, 1.0];
        apply_penalties(&mut logits, &[0, 1, 1], &params);
        assert_eq!(
            logits,
            vec![2.0 / 2.0 - 0.5 - 0.25, -2.0 * 2.0 - 0.5 - 0.5, 1.0]
        );
        // A repeated token loses to a fresh one under greedy sampling with a penalty.
        let mut sampler = Sampler::new(SamplingParams {
            repetition_penalty: 3.0,
            ..SamplingParams::default()
        })
        .unwrap();
        assert_eq!(sampler.sample(&[2.0, 1.0], &[0]).unwrap(), 1);
    }

    fn random_row(rng: &mut Xoshiro256, vocab: usize) -> Vec<f32> {
        (0..vocab)
            .map(|_| (rng.next_f64() * 16.0 - 8.0) as f32)
            .collect()
    }

    /// Draws `steps` tokens twice with the same seed, once from whole rows (`sample`) and once
    /// from candidates (`sample_from_candidates`, the whole row only when it says `None`), on
    /// fresh random logits each step with the drawn tokens added to the history. Returns how
    /// often the candidates could not decide.
    fn candidates_follow_the_whole_row(
        params: &SamplingParams,
        vocab: usize,
        steps: usize,
    ) -> usize {
        let mut whole = Sampler::new(params.clone()).unwrap();
        let mut from_candidates = Sampler::new(params.clone()).unwrap();
        let mut rng = Xoshiro256::seed_from_u64(params.seed ^ 0x5eed);
        // A history whose tokens are often among the largest logits (a low token id gets a
        // boost below), so penalties move candidates.
        let mut history: Vec<u32> = (0..30).map(|i| (i * 7) % 50).collect();
        let mut undecided = 0;
        for step in 0..steps {
            let mut row = random_row(&mut rng, vocab);
            for (token, logit) in row.iter_mut().enumerate().take(50) {
                *logit += 4.0 + (token % 3) as f32;
            }
            let expected = whole.sample(&row, &history).unwrap();
            let extra = from_candidates.penalised_tokens(&history, vocab);
            // As many largest logits as the scheduler asks for.
            let k = (params.top_k * 2).clamp(
                crate::backend::candidates::DEFAULT_CANDIDATES,
                crate::backend::candidates::MAX_CANDIDATES,
            );
            let candidates = crate::backend::candidates::row_candidates(&row, k, &extra);
            let got = match from_candidates
                .sample_from_candidates(&candidates, &history)
                .unwrap()
            {
                Some(token) => token,
                None => {
                    undecided += 1;
                    from_candidates.sample(&row, &history).unwrap()
                }
            };
            assert_eq!(got, expected, "{params:?}: step {step}");
            history.push(expected);
        }
        // Same random stream consumed: the next draws agree too.
        assert_eq!(whole.rng, from_candidates.rng, "{params:?}");
        undecided
    }

    #[test]
    fn sampling_from_candidates_equals_sampling_from_the_whole_row() {
        let penalties = SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.2,
            ..SamplingParams::default()
        };
        let mut cases = vec![SamplingParams::greedy(), penalties.clone()];
        for (seed, temperature) in [(1u64, 0.7f32), (2, 1.0), (3, 1.6)] {
            for top_k in [1usize, 5, 40, 64] {
                for (top_p, min_p) in [(1.0f32, 0.0f32), (0.9, 0.0), (1.0, 0.05), (0.8, 0.1)] {
                    let plain = SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        seed: seed * 100 + top_k as u64,
                        ..SamplingParams::default()
                    };
                    cases.push(SamplingParams {
                        repetition_penalty: penalties.repetition_penalty,
                        presence_penalty: penalties.presence_penalty,
                        frequency_penalty: penalties.frequency_penalty,
                        ..plain.clone()
                    });
                    cases.push(plain);
                }
            }
        }
        // A repetition penalty below 1 raises seen tokens; a negative presence penalty too.
        cases.push(SamplingParams {
            temperature: 1.0,
            top_k: 20,
            repetition_penalty: 0.7,
            presence_penalty: -0.5,
            seed: 9,
            ..SamplingParams::default()
        });
        let mut undecided = 0;
        for params in &cases {
            undecided += candidates_follow_the_whole_row(params, 1000, 60);
        }
        // Fallbacks happen only when penalties push enough of the largest logits down (this
        // history is made to: its tokens are the likeliest).
        println!(
            "{undecided} of {} draws needed the whole row",
            cases.len() * 60
        );
        assert!(undecided * 5 < cases.len() * 60, "{undecided} fallbacks");
        // A row smaller than the candidate count is covered whole: any parameters work.
        let open = SamplingParams {
            temperature: 1.0,
            seed: 4,
            ..SamplingParams::default()
        };
        assert_eq!(candidates_follow_the_whole_row(&open, 50, 40), 0);
    }

    #[test]
    fn candidates_that_cannot_decide_say_so_without_drawing() {
        let mut rng = Xoshiro256::seed_from_u64(8);
        let row = random_row(&mut rng, 500);
        let candidates = crate::backend::candidates::row_candidates(&row, 64, &[]);
        // No top-k with a temperature: the whole row decides.
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 1,
            ..SamplingParams::default()
        })
        .unwrap();
        let rng_before = sampler.rng.clone();
        assert_eq!(
            sampler.sample_from_candidates(&candidates, &[]).unwrap(),
            None
        );
        assert_eq!(sampler.rng, rng_before);
        // Every one of the 64 largest logits penalised, top-k 10: tokens outside may win.
        let history: Vec<u32> = candidates.top.iter().map(|c| c.0).collect();
        let mut penalised = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 10,
            presence_penalty: 20.0,
            seed: 1,
            ..SamplingParams::default()
        })
        .unwrap();
        let extra = penalised.penalised_tokens(&history, 500);
        let candidates = crate::backend::candidates::row_candidates(&row, 64, &extra);
        assert_eq!(
            penalised
                .sample_from_candidates(&candidates, &history)
                .unwrap(),
            None
        );
        // A penalised token missing from the candidates: no guess either.
        let without_extra = crate::backend::candidates::row_candidates(&row, 64, &[]);
        let outside: Vec<u32> = (0..500)
            .filter(|&t| without_extra.logit(t).is_none())
            .take(3)
            .collect();
        assert_eq!(
            penalised
                .sample_from_candidates(&without_extra, &outside)
                .unwrap(),
            None
        );
    }

    #[test]
    fn invalid_parameters_are_refused() {
        for params in [
            SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                min_p: 1.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..SamplingParams::default()
            },
        ] {
            assert!(Sampler::new(params).is_err());
        }
    }

    /// How many of `points` evenly spaced points of `[0, 1)` land on each token, against the
    /// probabilities of [`filtered_distribution`]: every token gets its share to within one
    /// point, and no token outside the distribution is drawn.
    fn assert_shares_match(logits: &[f32], params: &SamplingParams, points: usize) {
        let distribution = filtered_distribution(logits, params);
        let mut counts = std::collections::HashMap::<u32, usize>::new();
        for i in 0..points {
            let point = (i as f64 + 0.5) / points as f64;
            let token = draw_without_top_k(logits, params, point).expect("finite logits");
            *counts.entry(token).or_default() += 1;
        }
        let expected: std::collections::HashMap<u32, f64> = distribution.iter().copied().collect();
        for token in counts.keys() {
            assert!(
                expected.get(token).is_some_and(|&p| p > 0.0),
                "{params:?}: token {token} drawn, outside the distribution"
            );
        }
        for (token, p) in &expected {
            let count = counts.get(token).copied().unwrap_or(0) as f64;
            assert!(
                (count - p * points as f64).abs() <= 1.0 + 1e-6 * points as f64,
                "{params:?}: token {token} drawn {count} of {points} times, probability {p}"
            );
        }
    }

    #[test]
    fn drawing_without_top_k_gives_each_token_its_share() {
        let mut rng = Xoshiro256::seed_from_u64(23);
        for vocab in [1usize, 7, 300, 1000] {
            let mut logits = random_row(&mut rng, vocab);
            // Masked tokens (a grammar, an unsampleable id) are never drawn.
            for token in (3..vocab).step_by(5) {
                logits[token] = f32::NEG_INFINITY;
            }
            // Ties: equal logits keep their token order.
            if vocab > 10 {
                logits[9] = logits[2];
            }
            for (temperature, top_p, min_p) in [
                (1.0, 1.0, 0.0),
                (0.7, 0.9, 0.0),
                (1.3, 0.5, 0.05),
                (1.0, 1.0, 0.2),
                (2.0, 0.999, 0.0),
            ] {
                let params = SamplingParams {
                    temperature,
                    top_p,
                    min_p,
                    ..SamplingParams::default()
                };
                assert_shares_match(&logits, &params, 20_000);
            }
        }
    }

    #[test]
    fn drawing_without_top_k_over_a_whole_vocabulary() {
        let mut rng = Xoshiro256::seed_from_u64(29);
        // A Qwen vocabulary's width; the logits spread as a trained model's do (a few far ahead).
        let mut logits = random_row(&mut rng, 151_936);
        for (token, boost) in [(17usize, 14.0f32), (90_001, 13.0), (151_935, 12.5)] {
            logits[token] += boost;
        }
        for top_p in [1.0f32, 0.95, 0.5] {
            let params = SamplingParams {
                temperature: 1.0,
                top_p,
                ..SamplingParams::default()
            };
            assert_shares_match(&logits, &params, 256);
        }
    }

    /// The unordered distribution holds the same tokens as the sorted one, each with the same
    /// probability up to the order of the sums (a few ulps). Tokens of probability 0 (masked)
    /// may be listed by the sorted one and left out by the unordered one.
    fn assert_same_distribution(logits: &[f32], params: &SamplingParams) {
        let positive = |distribution: Vec<(u32, f64)>| -> Vec<(u32, f64)> {
            distribution.into_iter().filter(|&(_, p)| p > 0.0).collect()
        };
        let sorted = positive(filtered_distribution(logits, params));
        let unordered = positive(filtered_distribution_unordered(logits, params));
        assert_eq!(unordered.len(), sorted.len(), "{params:?}");
        let by_token: std::collections::HashMap<u32, f64> = unordered.iter().copied().collect();
        assert_eq!(by_token.len(), unordered.len(), "{params:?}: a token twice");
        for (token, p) in sorted {
            let q = by_token.get(&token).copied();
            assert!(
                q.is_some_and(|q| (q - p).abs() <= 1e-12 * p.max(1e-300) + 1e-15),
                "{params:?}: token {token} has {q:?}, the sorted distribution {p}"
            );
        }
    }

    #[test]
    fn the_unordered_distribution_equals_the_sorted_one() {
        let mut rng = Xoshiro256::seed_from_u64(31);
        for vocab in [1usize, 7, 300, 1000, 151_936] {
            let mut logits = random_row(&mut rng, vocab);
            for token in (3..vocab).step_by(5) {
                logits[token] = f32::NEG_INFINITY;
            }
            if vocab > 10 {
                logits[9] = logits[2];
            }
            for (temperature, top_k, top_p, min_p) in [
                (1.0, 0, 1.0, 0.0),
                (0.7, 0, 0.9, 0.0),
                (1.3, 0, 0.5, 0.05),
                (1.0, 0, 1.0, 0.2),
                (2.0, 0, 0.999, 0.0),
                (1.0, 20, 0.95, 0.0),
                (1.0, vocab, 0.8, 0.0),
            ] {
                let params = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    ..SamplingParams::default()
                };
                assert_same_distribution(&logits, &params);
            }
        }
        // Rows the sorting path defines are left to it.
        let params = SamplingParams::default();
        for row in [[0.0, f32::NAN], [0.0, f32::INFINITY]] {
            assert_eq!(
                filtered_distribution_unordered(&row, &params).len(),
                filtered_distribution(&row, &params).len()
            );
        }
    }

    #[test]
    fn drawing_without_top_k_leaves_nan_and_infinite_rows_to_the_sorting_path() {
        let params = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        assert_eq!(draw_without_top_k(&[0.0, f32::NAN], &params, 0.5), None);
        assert_eq!(
            draw_without_top_k(&[0.0, f32::INFINITY], &params, 0.5),
            None
        );
        assert_eq!(
            draw_without_top_k(&[f32::NEG_INFINITY, f32::NEG_INFINITY], &params, 0.5),
            None
        );
        // The largest point below 1 still lands on a kept token.
        let almost_one = 1.0 - f64::EPSILON / 2.0;
        let token = draw_without_top_k(&[1.0, f32::NEG_INFINITY, 0.5], &params, almost_one);
        assert!(matches!(token, Some(0) | Some(2)), "{token:?}");
    }

    #[test]
    fn a_sampler_started_at_a_stream_position_continues_the_uninterrupted_draws() {
        let params = SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: 77,
            ..SamplingParams::default()
        };
        let mut rng = Xoshiro256::seed_from_u64(3);
        let rows: Vec<Vec<f32>> = (0..12).map(|_| random_row(&mut rng, 64)).collect();
        let mut uninterrupted = Sampler::new(params.clone()).unwrap_or_else(|e| panic!("{e}"));
        let whole: Vec<u32> = rows
            .iter()
            .map(|row| {
                uninterrupted
                    .sample(row, &[])
                    .unwrap_or_else(|e| panic!("{e}"))
            })
            .collect();
        let mut first = Sampler::new(params.clone()).unwrap_or_else(|e| panic!("{e}"));
        let mut resumed_tokens: Vec<u32> = rows[..5]
            .iter()
            .map(|row| first.sample(row, &[]).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        let mut resumed = Sampler::new(SamplingParams {
            stream_position: 5,
            ..params.clone()
        })
        .unwrap_or_else(|e| panic!("{e}"));
        resumed_tokens.extend(
            rows[5..]
                .iter()
                .map(|row| resumed.sample(row, &[]).unwrap_or_else(|e| panic!("{e}"))),
        );
        assert_eq!(resumed_tokens, whole);
        let too_far = SamplingParams {
            stream_position: MAX_STREAM_POSITION + 1,
            ..params
        };
        assert!(Sampler::new(too_far).is_err());
    }
}
