//! Next-token sampling: penalties, temperature, top-k, top-p, min-p, seeded draws.
//!
//! Owns: turning one row of logits (plus the tokens seen so far) into a token id, reproducibly.
//! The PRNG is a self-contained xoshiro256** seeded through splitmix64, so a seed gives the same
//! tokens whatever crate versions are linked.
//! Must not touch: the model, tokenization, stop strings.
//!
//! This file holds the [`Sampler`], a request's state; the settings are `params.rs`, the PRNG
//! `rng.rs`, the filtering and drawing rules `distribution.rs`.

mod distribution;
mod params;
mod rng;

use crate::backend::LogitCandidates;
use crate::error::EngineError;
use distribution::{distribution_of_order, draw_without_top_k, penalise, without_top_k};

pub(crate) use distribution::draw_at;
pub use distribution::{
    apply_penalties, argmax, filtered_distribution, filtered_distribution_unordered,
};
pub use params::{SamplingParams, MAX_STREAM_POSITION};
pub use rng::Xoshiro256;

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
    /// so far, as the caller chooses). A sampled pick uses exactly one draw of the random stream
    /// (greedy: none), so the stream's position is the number of tokens sampled: drafts and
    /// their verification use no draw of their own, and a continuation skips to the same
    /// position by counting tokens.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32, EngineError> {
        if logits.is_empty() {
            return Err(EngineError::EmptyInput {
                what: "no logits to sample from".into(),
            });
        }
        let point = if self.params.temperature == 0.0 {
            0.0
        } else {
            self.rng.next_f64()
        };
        Ok(self.token_at(logits, history, point))
    }

    /// The token [`Sampler::sample`] would pick from `logits` as the pick `ahead` after the
    /// next (0: the next one), without using the random stream: the same rule at the same
    /// draw. A draft picked this way from the MTP head's row is the main model's own pick
    /// whenever the two rows put the draw on the same token, so verification can accept
    /// exactly the drafts sampling would have picked and drafting changes no token.
    pub fn token_ahead(
        &self,
        logits: &[f32],
        history: &[u32],
        ahead: usize,
    ) -> Result<u32, EngineError> {
        if logits.is_empty() {
            return Err(EngineError::EmptyInput {
                what: "no logits to draft from".into(),
            });
        }
        if self.params.temperature == 0.0 {
            return Ok(self.token_at(logits, history, 0.0));
        }
        let mut rng = self.rng.clone();
        for _ in 0..ahead {
            rng.next_u64();
        }
        Ok(self.token_at(logits, history, rng.next_f64()))
    }

    /// The token at `point` (uniform in `[0, 1)`; unused when greedy) of the request's
    /// distribution of `logits` after `history`.
    fn token_at(&self, logits: &[f32], history: &[u32], point: f64) -> u32 {
        let mut logits = logits.to_vec();
        apply_penalties(&mut logits, history, &self.params);
        if self.params.temperature == 0.0 {
            return argmax(&logits);
        }
        if without_top_k(&self.params, logits.len()) {
            if let Some(token) = draw_without_top_k(&logits, &self.params, point) {
                return token;
            }
        }
        let candidates = filtered_distribution(&logits, &self.params);
        draw_at(&candidates, point)
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
        if candidates.vocab == 0 {
            return Err(EngineError::EmptyInput {
                what: "no logits to sample from".into(),
            });
        }
        // None left (every largest logit was past the tokenizer's vocabulary, a random head's
        // padding rows): the whole row decides.
        if candidates.top.is_empty() {
            return Ok(None);
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

#[cfg(test)]
mod tests {
    use super::*;

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
            // As many largest logits as the scheduler asks for (where it asks for any; else
            // the most there are, which a small row's whole vocabulary fits in).
            let top_k = if params.temperature == 0.0 {
                1
            } else {
                params.top_k
            };
            let k =
                if from_candidates.candidates_suffice(crate::backend::candidates::MAX_CANDIDATES) {
                    crate::backend::candidates::candidates_needed(top_k, 0, extra.len())
                } else {
                    crate::backend::candidates::MAX_CANDIDATES
                };
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

    #[test]
    fn a_pick_ahead_is_the_pick_sampling_makes_there_and_uses_no_draw() {
        let mut rng = Xoshiro256::seed_from_u64(5);
        let rows: Vec<Vec<f32>> = (0..10).map(|_| random_row(&mut rng, 96)).collect();
        for params in [
            SamplingParams {
                temperature: 1.1,
                seed: 9,
                ..SamplingParams::default()
            },
            SamplingParams {
                temperature: 0.8,
                top_k: 12,
                top_p: 0.9,
                repetition_penalty: 1.3,
                seed: 10,
                ..SamplingParams::default()
            },
            SamplingParams::greedy(),
        ] {
            let history = [3u32, 7, 7];
            let sampler = Sampler::new(params.clone()).unwrap_or_else(|e| panic!("{e}"));
            let ahead: Vec<u32> = rows
                .iter()
                .enumerate()
                .map(|(index, row)| {
                    sampler
                        .token_ahead(row, &history, index)
                        .unwrap_or_else(|e| panic!("{e}"))
                })
                .collect();
            // Looking ahead used nothing: sampling the rows in turn picks the same tokens.
            let mut sampling = sampler.clone();
            let sampled: Vec<u32> = rows
                .iter()
                .map(|row| {
                    sampling
                        .sample(row, &history)
                        .unwrap_or_else(|e| panic!("{e}"))
                })
                .collect();
            assert_eq!(ahead, sampled, "{params:?}");
            assert_eq!(
                sampler.rng,
                Sampler::new(params.clone())
                    .unwrap_or_else(|e| panic!("{e}"))
                    .rng
            );
        }
        // The picks depend on the draws: another seed picks other tokens somewhere.
        let [seed_one, seed_two] = [1u64, 2].map(|seed| {
            let sampler = Sampler::new(SamplingParams {
                temperature: 1.5,
                seed,
                ..SamplingParams::default()
            })
            .unwrap_or_else(|e| panic!("{e}"));
            rows.iter()
                .enumerate()
                .map(|(index, row)| {
                    sampler
                        .token_ahead(row, &[], index)
                        .unwrap_or_else(|e| panic!("{e}"))
                })
                .collect::<Vec<u32>>()
        });
        assert_ne!(seed_one, seed_two);
    }
}
