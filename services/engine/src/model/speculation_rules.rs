//! The rules of speculative decoding that the in-process loop and the scheduler share: a draft
//! picked from an MTP row, the verification of drafts against the main model's rows (greedy:
//! the agreeing prefix; sampled: the speculative-sampling rule, so tokens follow exactly the
//! distribution of sampling without drafts), the probe of one draft, and the controller that
//! sizes each sequence's drafts by their acceptance. Benchmarks only: [`ForcedAcceptance`]
//! forces the accept / reject decision at given rates, every cost kept.
//!
//! Owns: those rules. Must not touch: the forwards, rolling states back (`speculative.rs`).

use crate::error::EngineError;
use crate::sampling::{
    apply_penalties, argmax, draw_at, filtered_distribution_unordered, Sampler, SamplingParams,
    Xoshiro256,
};

/// A drafted token and the distribution it was drawn from (empty when drafted greedily).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftToken {
    pub token: u32,
    pub distribution: Vec<(u32, f64)>,
}

/// Drafts one token from an MTP logits row (the request's bias and masks already applied):
/// greedy requests take the penalised argmax, sampled ones draw from the request's distribution
/// after `history` with `rng` and keep that distribution for [`verify_drafts`].
pub fn pick_draft(
    params: &SamplingParams,
    row: &[f32],
    history: &[u32],
    rng: &mut Xoshiro256,
) -> DraftToken {
    if params.temperature == 0.0 {
        let mut row = row.to_vec();
        apply_penalties(&mut row, history, params);
        return DraftToken {
            token: argmax(&row),
            distribution: Vec::new(),
        };
    }
    let distribution = Picker::distribution(params, row, history);
    DraftToken {
        token: draw(&distribution, rng),
        distribution,
    }
}

/// Verifies `drafts` against the main model's rows of one verification (`rows[j]` follows the
/// input before draft `j`; one row more than drafts; bias and masks already applied): how many
/// drafts are accepted, and the token that follows them. Greedy requests accept a draft when it
/// is the token `sampler` picks from the row (so the tokens are those of plain greedy decoding);
/// sampled ones use [`speculative_sampling_step`] with `rng`. The token after the accepted
/// drafts, when all were accepted, is `sampler`'s pick from the last row.
pub fn verify_drafts(
    sampler: &mut Sampler,
    rng: &mut Xoshiro256,
    rows: &[Vec<f32>],
    drafts: &[DraftToken],
    history: &[u32],
) -> Result<(usize, u32), EngineError> {
    if rows.len() != drafts.len() + 1 {
        return Err(EngineError::InvalidConfig {
            problem: format!(
                "{} verification rows for {} drafts",
                rows.len(),
                drafts.len()
            ),
        });
    }
    let mut seen = history.to_vec();
    for (j, draft) in drafts.iter().enumerate() {
        if sampler.params().temperature == 0.0 {
            let main = sampler.sample(&rows[j], &seen)?;
            if main != draft.token {
                return Ok((j, main));
            }
        } else {
            let target = Picker::distribution(sampler.params(), &rows[j], &seen);
            let (token, accepted) =
                speculative_sampling_step(&target, &draft.distribution, draft.token, rng);
            if !accepted {
                return Ok((j, token));
            }
        }
        seen.push(draft.token);
    }
    Ok((drafts.len(), sampler.sample(&rows[drafts.len()], &seen)?))
}

/// Checks a probe's one draft against `row`, the main model's row after the input before the
/// draft (bias and masks already applied), without the draft being an input row: returns
/// whether [`verify_drafts`] would have accepted it and the token that follows the input.
/// Greedy requests: `sampler`'s pick from the row, accepted when it is the draft. Sampled ones:
/// [`speculative_sampling_step`] with `rng` (the draft when accepted, else the residual's draw),
/// distributed as plain sampling's token. Either way the token is one plain decoding could
/// give, and no state needs rolling back.
pub fn probe_draft(
    sampler: &mut Sampler,
    rng: &mut Xoshiro256,
    row: &[f32],
    draft: &DraftToken,
    history: &[u32],
) -> Result<(bool, u32), EngineError> {
    if sampler.params().temperature == 0.0 {
        let main = sampler.sample(row, history)?;
        return Ok((main == draft.token, main));
    }
    let target = Picker::distribution(sampler.params(), row, history);
    let (token, accepted) =
        speculative_sampling_step(&target, &draft.distribution, draft.token, rng);
    Ok((accepted, token))
}

/// How many drafts one sequence makes per step, from the acceptance it has seen.
///
/// The rule: with a per-draft acceptance rate `a` (drafts accepted independently), a step with
/// `n` drafts yields `1 + a + … + aⁿ` tokens on average and costs about `1 + DRAFT_COST · n`
/// plain decode steps (a draft costs an MTP-layer forward and one more verified row; rejections
/// cost a recompute on models with linear attention, which `DRAFT_COST` includes). The
/// controller picks the `n` in `0..=max` with the most tokens per unit of cost, so drafts stop
/// where `a` falls below about `DRAFT_COST`. `a` is a decayed count of accepted drafts over
/// verified draft positions (each step adds its accepted drafts, and its first rejected one),
/// starting from a prior below `DRAFT_COST`, so the rate follows what the sequence is writing
/// (code drafts well, prose less). At 0 drafts nothing would be measured any more: a new
/// sequence's first step and every `PROBE_INTERVAL`-th step after that are a
/// [`DraftPlan::Probe`], one draft checked against the row the main model picks its next token
/// from, which costs no verified row and no rollback. The MTP layer still has to see every
/// position, but steps that skip it hold their pairs back for the next step that drafts (one
/// batched forward), so a sequence whose drafts are never accepted pays about one MTP-layer
/// forward and one head row per `PROBE_INTERVAL` steps.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftController {
    max_drafts: usize,
    accepted: f64,
    verified: f64,
    steps_without_drafts: usize,
}

/// What one step of a sequence does with the MTP head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftPlan {
    /// No draft: the main model processes the pending token alone and its pair waits for the
    /// next step that drafts.
    Skip,
    /// One draft, checked against the row the main model picks its next token from
    /// ([`probe_draft`]); the main model processes the pending token alone, so the check costs
    /// no verified row and nothing is rolled back.
    Probe,
    /// `n ≥ 1` drafts verified by one forward of `n + 1` rows.
    Drafts(usize),
}

impl DraftPlan {
    /// Drafts the MTP head makes for this step.
    pub fn drafts(self) -> usize {
        match self {
            DraftPlan::Skip => 0,
            DraftPlan::Probe => 1,
            DraftPlan::Drafts(n) => n,
        }
    }

    /// Drafts the main model verifies as input rows (a probe's draft is not one).
    pub fn verified_drafts(self) -> usize {
        match self {
            DraftPlan::Drafts(n) => n,
            DraftPlan::Skip | DraftPlan::Probe => 0,
        }
    }

    /// `n` drafts verified as input, or a skip at 0 (the fixed, non-adaptive plan).
    pub fn fixed(drafts: usize) -> Self {
        if drafts == 0 {
            DraftPlan::Skip
        } else {
            DraftPlan::Drafts(drafts)
        }
    }
}

impl DraftController {
    /// Cost of one draft position relative to a plain decode step.
    pub const DRAFT_COST: f64 = 0.25;
    /// Steps at 0 drafts before a probe.
    pub const PROBE_INTERVAL: usize = 32;
    /// Weight the history keeps per verification (about the last 10 verifications count).
    const DECAY: f64 = 0.9;

    pub fn new(max_drafts: usize) -> Self {
        // A prior rate of 0.2 (below `DRAFT_COST`): a new sequence looks with a probe before it
        // drafts; one accepted probe lifts the rate to about 0.49 (one draft), one rejected one
        // drops it to about 0.13.
        DraftController {
            max_drafts,
            accepted: 0.4,
            verified: 2.0,
            // The first step probes.
            steps_without_drafts: Self::PROBE_INTERVAL - 1,
        }
    }

    /// The running acceptance estimate.
    pub fn acceptance(&self) -> f64 {
        self.accepted / self.verified.max(f64::MIN_POSITIVE)
    }

    /// What the next step does, with at most `room` drafts (what the request and its context
    /// leave; a probe needs room for its one draft too).
    pub fn next_plan(&mut self, room: usize) -> DraftPlan {
        let limit = self.max_drafts.min(room);
        if limit == 0 {
            return DraftPlan::Skip;
        }
        let a = self.acceptance();
        let mut best = (0usize, 1.0f64);
        let (mut expected_tokens, mut power) = (1.0f64, 1.0f64);
        for n in 1..=limit {
            power *= a;
            expected_tokens += power;
            let gain = expected_tokens / (1.0 + Self::DRAFT_COST * n as f64);
            if gain > best.1 {
                best = (n, gain);
            }
        }
        if best.0 > 0 {
            self.steps_without_drafts = 0;
            return DraftPlan::Drafts(best.0);
        }
        self.steps_without_drafts += 1;
        if self.steps_without_drafts >= Self::PROBE_INTERVAL {
            self.steps_without_drafts = 0;
            return DraftPlan::Probe;
        }
        DraftPlan::Skip
    }

    /// Records a verification of `drafted` drafts (a probe: 1) of which the first `accepted`
    /// were accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let rejected = usize::from(accepted < drafted);
        self.accepted = Self::DECAY * self.accepted + accepted as f64;
        self.verified = Self::DECAY * self.verified + (accepted + rejected) as f64;
    }
}

/// FOR BENCHMARKS ONLY: replaces the verifier's accept / reject decision by seeded coin flips at
/// given rates per draft depth, so a model whose head drafts badly (random weights) can be
/// measured at a trained head's acceptance. Everything else is real: the drafts are computed by
/// the MTP head and verified by one batched forward, the accepted drafts become the sequence's
/// tokens (whatever the main model would have picked), the token after them is the main model's
/// pick from the row that follows them, and a rejection rolls the states back as a real one.
///
/// The rates are the fractions a benchmark reports per depth: `rates[j]` is the share of chains
/// whose drafts `1..=j+1` are all accepted (the trained fixture measures 0.80 / 0.56 / 0.41).
/// Draft `j + 1` is therefore accepted, after draft `j` was, with probability
/// `rates[j] / rates[j − 1]`; depths past the list keep the last conditional probability.
#[derive(Debug, Clone)]
pub struct ForcedAcceptance {
    rates_by_depth: Vec<f64>,
    /// `conditional[j]`: probability of accepting draft `j + 1` once drafts `1..=j` were.
    conditional: Vec<f64>,
    rng: Xoshiro256,
}

impl ForcedAcceptance {
    /// Rates per depth (each in `0..=1`, none above the one before it) and the coin's seed.
    pub fn new(rates_by_depth: &[f64], seed: u64) -> Result<Self, EngineError> {
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        if rates_by_depth.is_empty() {
            return Err(invalid("forced acceptance: no rate given".into()));
        }
        let mut conditional = Vec::with_capacity(rates_by_depth.len());
        let mut before = 1.0f64;
        for (depth, &rate) in rates_by_depth.iter().enumerate() {
            if !(0.0..=1.0).contains(&rate) {
                return Err(invalid(format!(
                    "forced acceptance at depth {}: {rate} is not a rate in 0..=1",
                    depth + 1
                )));
            }
            if rate > before {
                return Err(invalid(format!(
                    "forced acceptance at depth {}: {rate} is above depth {}'s {before} (a chain \
                     reaches depth {} only through every depth before it)",
                    depth + 1,
                    depth,
                    depth + 1
                )));
            }
            conditional.push(if before > 0.0 { rate / before } else { 0.0 });
            before = rate;
        }
        Ok(ForcedAcceptance {
            rates_by_depth: rates_by_depth.to_vec(),
            conditional,
            rng: Xoshiro256::seed_from_u64(seed),
        })
    }

    /// The rates it was made with.
    pub fn rates_by_depth(&self) -> &[f64] {
        &self.rates_by_depth
    }

    /// How many of `drafts` drafts to accept: coin flips down the chain until one fails.
    pub(in crate::model) fn accepted_drafts(&mut self, drafts: usize) -> usize {
        let last = self.conditional.last().copied().unwrap_or(0.0);
        for depth in 0..drafts {
            let probability = self.conditional.get(depth).copied().unwrap_or(last);
            // `<` never accepts at 0 and always at 1.
            if self.rng.next_f64() >= probability {
                return depth;
            }
        }
        drafts
    }
}

/// How a speculative generation picks tokens from logits rows.
pub(in crate::model) enum Picker {
    Greedy,
    Sampled {
        params: SamplingParams,
        rng: Xoshiro256,
    },
}

/// A draft and the distribution it was drawn from (empty for greedy).
pub(in crate::model) struct Draft {
    pub(in crate::model) token: u32,
    pub(in crate::model) distribution: Vec<(u32, f64)>,
}

impl Picker {
    /// The request's distribution of one logits row after `history` (penalties, temperature,
    /// top-k, top-p, min-p), in no particular order: without top-k it covers the whole
    /// vocabulary, and sorting that for every draft and verified row would cost ~6 ms each.
    pub(in crate::model) fn distribution(
        params: &SamplingParams,
        row: &[f32],
        history: &[u32],
    ) -> Vec<(u32, f64)> {
        let mut row = row.to_vec();
        apply_penalties(&mut row, history, params);
        filtered_distribution_unordered(&row, params)
    }

    /// A token from one row (the prompt's next token, a draft, or the bonus token).
    pub(in crate::model) fn pick(&mut self, row: &[f32], history: &[u32]) -> Draft {
        match self {
            Picker::Greedy => Draft {
                token: argmax(row),
                distribution: Vec::new(),
            },
            Picker::Sampled { params, rng } => {
                let distribution = Self::distribution(params, row, history);
                Draft {
                    token: draw(&distribution, rng),
                    distribution,
                }
            }
        }
    }

    /// Checks a probe's draft against `row` (see [`probe_draft`]): whether it is accepted, and
    /// the token that follows the input.
    pub(in crate::model) fn probe(
        &mut self,
        row: &[f32],
        draft: &Draft,
        history: &[u32],
    ) -> (bool, u32) {
        match self {
            Picker::Greedy => {
                let main = argmax(row);
                (main == draft.token, main)
            }
            Picker::Sampled { params, rng } => {
                let target = Self::distribution(params, row, history);
                let (token, accepted) =
                    speculative_sampling_step(&target, &draft.distribution, draft.token, rng);
                (accepted, token)
            }
        }
    }

    /// Verifies `drafts` against the main model's rows (`rows[j]` follows the input before
    /// draft `j`; there is one row more than drafts): how many are accepted, and the token that
    /// follows them.
    pub(in crate::model) fn verify(
        &mut self,
        rows: &[&[f32]],
        drafts: &[Draft],
        history: &[u32],
    ) -> (usize, u32) {
        let mut seen = history.to_vec();
        for (j, draft) in drafts.iter().enumerate() {
            match self {
                Picker::Greedy => {
                    let main = argmax(rows[j]);
                    if main != draft.token {
                        return (j, main);
                    }
                }
                Picker::Sampled { params, rng } => {
                    let target = Self::distribution(params, rows[j], &seen);
                    let (token, accepted) =
                        speculative_sampling_step(&target, &draft.distribution, draft.token, rng);
                    if !accepted {
                        return (j, token);
                    }
                }
            }
            seen.push(draft.token);
        }
        let bonus = self.pick(rows[drafts.len()], &seen).token;
        (drafts.len(), bonus)
    }
}

/// One draw from a distribution (the last token takes a rounding remainder).
pub(in crate::model) fn draw(distribution: &[(u32, f64)], rng: &mut Xoshiro256) -> u32 {
    // Scaled by the total: a residual is not normalised.
    let point = rng.next_f64() * distribution.iter().map(|&(_, p)| p).sum::<f64>();
    draw_at(distribution, point)
}

/// The speculative-sampling rule for one draft `x ~ q`: accepted with probability
/// `min(1, p(x) / q(x))`; else a token from the normalised residual `max(0, p − q)`. The token
/// that comes out is distributed as `p` (Leviathan et al., Chen et al.). Returns it and whether
/// the draft was accepted.
pub fn speculative_sampling_step(
    target: &[(u32, f64)],
    draft_distribution: &[(u32, f64)],
    draft: u32,
    rng: &mut Xoshiro256,
) -> (u32, bool) {
    let probability = |distribution: &[(u32, f64)], token: u32| {
        distribution
            .iter()
            .find(|&&(t, _)| t == token)
            .map_or(0.0, |&(_, p)| p)
    };
    let (p, q) = (
        probability(target, draft),
        probability(draft_distribution, draft),
    );
    if q > 0.0 && rng.next_f64() < (p / q).min(1.0) {
        return (draft, true);
    }
    // Looked up by token in a table indexed by it: a request without top-k has a whole
    // vocabulary in both distributions, and a scan per token would be quadratic in it (~10^10
    // steps at 151,936 tokens).
    let table_len = draft_distribution
        .iter()
        .map(|&(token, _)| token as usize + 1)
        .max()
        .unwrap_or(0);
    let mut draft_probability = vec![0.0f64; table_len];
    for &(token, q) in draft_distribution {
        draft_probability[token as usize] = q;
    }
    let residual: Vec<(u32, f64)> = target
        .iter()
        .map(|&(token, p)| {
            let q = draft_probability
                .get(token as usize)
                .copied()
                .unwrap_or(0.0);
            (token, (p - q).max(0.0))
        })
        .filter(|&(_, r)| r > 0.0)
        .collect();
    let token = if residual.is_empty() {
        draw(target, rng)
    } else {
        draw(&residual, rng)
    };
    (token, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pearson's statistic of `counts` against the probabilities `expected`.
    fn chi_square(counts: &[u64], expected: &[f64]) -> f64 {
        let total: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(expected)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&count, &p)| {
                let e = p * total as f64;
                (count as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn drafts_shrink_to_zero_when_rejected_and_grow_when_accepted() {
        let mut controller = DraftController::new(3);
        // A new sequence looks before it drafts: its first step is a probe.
        assert_eq!(controller.next_plan(3), DraftPlan::Probe);
        // One accepted probe is enough to start drafting.
        let mut accepting = controller.clone();
        accepting.record(1, 1);
        assert_eq!(accepting.next_plan(3), DraftPlan::Drafts(1));
        // A rejected one drops to skipping, then a probe every PROBE_INTERVAL steps.
        controller.record(1, 0);
        assert!(controller.acceptance() < DraftController::DRAFT_COST);
        let mut plans = Vec::new();
        for _ in 0..4 * DraftController::PROBE_INTERVAL {
            let plan = controller.next_plan(3);
            controller.record(plan.drafts(), 0);
            plans.push(plan);
        }
        assert!(plans
            .iter()
            .all(|&plan| plan == DraftPlan::Skip || plan == DraftPlan::Probe));
        let probes: Vec<usize> = (0..plans.len())
            .filter(|&step| plans[step] == DraftPlan::Probe)
            .collect();
        let interval = DraftController::PROBE_INTERVAL;
        assert_eq!(
            probes,
            (1..=4).map(|k| k * interval - 1).collect::<Vec<_>>(),
            "one probe per interval"
        );
        // Every draft accepted from then on: a probe finds it and the count climbs to the
        // maximum.
        let mut last = DraftPlan::Skip;
        for _ in 0..3 * interval {
            last = controller.next_plan(3);
            controller.record(last.drafts(), last.drafts());
        }
        assert_eq!(last, DraftPlan::Drafts(3));
        assert!(controller.acceptance() > 0.9);
        // Never more than the room the request leaves.
        assert_eq!(controller.next_plan(1), DraftPlan::Drafts(1));
        assert_eq!(controller.next_plan(0), DraftPlan::Skip);
        // The count follows the rate: 1 + a + … + aⁿ over 1 + n/4 is best at n = 1 for
        // a = 0.5, n = 2 for a = 0.7 and n = 3 for a = 0.8; none below a = 1/4.
        for (rate, expected) in [(0.5, 1), (0.7, 2), (0.8, 3)] {
            let mut controller = DraftController {
                accepted: 100.0 * rate,
                verified: 100.0,
                ..DraftController::new(3)
            };
            assert_eq!(
                controller.next_plan(3),
                DraftPlan::Drafts(expected),
                "rate {rate}"
            );
        }
        let mut low = DraftController {
            accepted: 20.0,
            verified: 100.0,
            steps_without_drafts: 0,
            ..DraftController::new(3)
        };
        assert_eq!(low.next_plan(3), DraftPlan::Skip, "rate 0.2");
    }

    #[test]
    fn the_speculative_sampling_rule_gives_the_target_distribution() {
        // p and q disagree everywhere, and each has a token the other gives no mass to.
        let target = [
            (0, 0.35),
            (1, 0.25),
            (2, 0.2),
            (3, 0.15),
            (4, 0.05),
            (5, 0.0),
        ];
        let draft = [(0, 0.1), (1, 0.4), (2, 0.05), (3, 0.0), (4, 0.3), (5, 0.15)];
        let expected: Vec<f64> = target.iter().map(|&(_, p)| p).collect();
        let mut rng = Xoshiro256::seed_from_u64(7);
        let (mut counts, mut naive) = ([0u64; 6], [0u64; 6]);
        let trials = 200_000;
        for _ in 0..trials {
            let drafted = draw(&draft, &mut rng);
            let (token, _) = speculative_sampling_step(&target, &draft, drafted, &mut rng);
            counts[token as usize] += 1;
            naive[drafted as usize] += 1;
        }
        assert_eq!(counts[5], 0, "a token the target excludes came out");
        // 5 degrees of freedom: 20.5 is the 0.1% point.
        let statistic = chi_square(&counts, &expected);
        assert!(statistic < 20.5, "χ² {statistic:.1} over {counts:?}");
        // The same test rejects keeping every draft (the draft distribution), so it has power.
        assert!(chi_square(&naive, &expected) > 1000.0);
    }

    #[test]
    fn a_rejected_draft_over_a_whole_vocabulary_draws_from_the_residual() {
        // Two distributions over 151,936 tokens (a request without top-k), most likely first,
        // in different orders; the draft gives its token far more than the target does, so most
        // steps reject it and draw from max(0, p − q).
        let vocab = 151_936u32;
        let mut rng = Xoshiro256::seed_from_u64(11);
        let normalised = |mut weights: Vec<(u32, f64)>| {
            let total: f64 = weights.iter().map(|&(_, w)| w).sum();
            weights.iter_mut().for_each(|entry| entry.1 /= total);
            weights.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            weights
        };
        let target = normalised((0..vocab).map(|t| (t, rng.next_f64())).collect());
        let mut draft_weights: Vec<(u32, f64)> = (0..vocab).map(|t| (t, rng.next_f64())).collect();
        draft_weights[5].1 = vocab as f64; // token 5 takes about 2/3 of the draft's mass
        let draft = normalised(draft_weights);
        let q5 = draft
            .iter()
            .find(|&&(t, _)| t == 5)
            .map(|&(_, q)| q)
            .unwrap();
        let p5 = target
            .iter()
            .find(|&&(t, _)| t == 5)
            .map(|&(_, p)| p)
            .unwrap();
        let mut rejected = 0;
        for _ in 0..20 {
            let (token, accepted) = speculative_sampling_step(&target, &draft, 5, &mut rng);
            if accepted {
                assert_eq!(token, 5);
                continue;
            }
            rejected += 1;
            // The residual: tokens the target gives more than the draft does; never token 5.
            let q = draft
                .iter()
                .find(|&&(t, _)| t == token)
                .map(|&(_, q)| q)
                .unwrap();
            let p = target
                .iter()
                .find(|&&(t, _)| t == token)
                .map(|&(_, p)| p)
                .unwrap();
            assert!(p > q, "token {token}: p {p} ≤ q {q}");
        }
        assert!(p5 / q5 < 0.01 && rejected > 10, "{rejected} of 20 rejected");
    }
}
