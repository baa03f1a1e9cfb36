//! The rules of speculative decoding that the in-process loop and the scheduler share: a draft
//! picked from an MTP row, the verification of drafts against the main model's rows, the probe
//! of one draft, and the controller that sizes each sequence's drafts by their acceptance.
//! Benchmarks only: [`ForcedAcceptance`] forces the accept / reject decision at given rates,
//! every cost kept.
//!
//! The tokens are always the ones plain decoding picks from the main model's rows: greedy and
//! sampled requests alike accept a draft when it is the main model's pick, and a sampled draft
//! is picked with the draw its position will use ([`Sampler::token_ahead`]), so a seeded answer
//! is the same with drafts or without, and the random stream's position depends on the tokens
//! alone (an answer continued elsewhere picks up the same draws).
//!
//! Owns: those rules. Must not touch: the forwards, rolling states back (`speculative.rs`).

use crate::error::EngineError;
use crate::sampling::{Sampler, Xoshiro256};

/// Drafts one token from an MTP logits row (the request's bias and masks already applied) as
/// the pick `ahead` positions after the sampler's next (0: the token after the pending input):
/// the token sampling would pick there if the row were the main model's, after `history`.
pub fn pick_draft(
    sampler: &Sampler,
    row: &[f32],
    history: &[u32],
    ahead: usize,
) -> Result<u32, EngineError> {
    sampler.token_ahead(row, history, ahead)
}

/// Verifies `drafts` against the main model's rows of one verification (`rows[j]` follows the
/// input before draft `j`; one row more than drafts; bias and masks already applied): how many
/// drafts are accepted, and the token that follows them. A draft is accepted when it is the
/// token `sampler` picks from its row, so the tokens are those of plain decoding with the same
/// draws; the token after the accepted drafts is `sampler`'s pick from the next row.
pub fn verify_drafts<Row: AsRef<[f32]>>(
    sampler: &mut Sampler,
    rows: &[Row],
    drafts: &[u32],
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
    for (row, &draft) in rows.iter().zip(drafts) {
        let main = sampler.sample(row.as_ref(), &seen)?;
        if main != draft {
            return Ok((seen.len() - history.len(), main));
        }
        seen.push(draft);
    }
    Ok((
        drafts.len(),
        sampler.sample(rows[drafts.len()].as_ref(), &seen)?,
    ))
}

/// Checks a probe's one draft against `row`, the main model's row after the input before the
/// draft (bias and masks already applied), without the draft being an input row: `sampler`'s
/// pick from the row, and whether it is the draft. The token is plain decoding's, and no state
/// needs rolling back.
pub fn probe_draft(
    sampler: &mut Sampler,
    row: &[f32],
    draft: u32,
    history: &[u32],
) -> Result<(bool, u32), EngineError> {
    let main = sampler.sample(row, history)?;
    Ok((main == draft, main))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

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

    /// Decodes `rows` (the main model's row at each position) drafting `drafts` per step from
    /// `draft_rows`; returns the tokens and how many drafts were accepted.
    fn decode_with_drafts(
        params: &SamplingParams,
        rows: &[Vec<f32>],
        draft_rows: &[Vec<f32>],
        drafts: usize,
    ) -> (Vec<u32>, usize) {
        let mut sampler = Sampler::new(params.clone()).unwrap_or_else(|e| panic!("{e}"));
        let (mut tokens, mut accepted_total) = (Vec::new(), 0);
        while tokens.len() < rows.len() {
            let at = tokens.len();
            let count = drafts.min(rows.len() - at - 1);
            let mut history = tokens.clone();
            let mut chain = Vec::new();
            for j in 0..count {
                let draft = pick_draft(&sampler, &draft_rows[at + j], &history, j)
                    .unwrap_or_else(|e| panic!("{e}"));
                history.push(draft);
                chain.push(draft);
            }
            let (accepted, next) =
                verify_drafts(&mut sampler, &rows[at..=at + count], &chain, &tokens)
                    .unwrap_or_else(|e| panic!("{e}"));
            accepted_total += accepted;
            tokens.extend_from_slice(&chain[..accepted]);
            tokens.push(next);
        }
        (tokens, accepted_total)
    }

    #[test]
    fn verified_tokens_are_plain_sampling_whatever_the_drafts() {
        let mut rng = Xoshiro256::seed_from_u64(17);
        let mut row = || -> Vec<f32> {
            (0..48)
                .map(|_| (rng.next_f64() * 8.0 - 4.0) as f32)
                .collect()
        };
        let rows: Vec<Vec<f32>> = (0..40).map(|_| row()).collect();
        let unrelated: Vec<Vec<f32>> = (0..40).map(|_| row()).collect();
        // Rows close to the main model's: each logit moved a little.
        let close: Vec<Vec<f32>> = rows
            .iter()
            .zip(&unrelated)
            .map(|(main, noise)| main.iter().zip(noise).map(|(m, n)| m + 0.05 * n).collect())
            .collect();
        for params in [
            SamplingParams {
                temperature: 0.9,
                top_p: 0.95,
                seed: 4,
                ..SamplingParams::default()
            },
            SamplingParams {
                temperature: 0.7,
                top_k: 8,
                presence_penalty: 0.5,
                seed: 5,
                ..SamplingParams::default()
            },
            SamplingParams::greedy(),
        ] {
            let mut sampler = Sampler::new(params.clone()).unwrap_or_else(|e| panic!("{e}"));
            let mut plain: Vec<u32> = Vec::new();
            for row in &rows {
                let token = sampler
                    .sample(row, &plain)
                    .unwrap_or_else(|e| panic!("{e}"));
                plain.push(token);
            }
            for drafts in 1..=3 {
                let (same, accepted) = decode_with_drafts(&params, &rows, &rows, drafts);
                assert_eq!(
                    same, plain,
                    "{params:?}, {drafts} drafts from the main rows"
                );
                // Drafts from the main model's own rows are always its picks.
                let steps = rows.len().div_ceil(drafts + 1);
                assert!(
                    accepted + steps >= rows.len(),
                    "{params:?}: {accepted} accepted"
                );
                let (near, accepted_near) = decode_with_drafts(&params, &rows, &close, drafts);
                assert_eq!(near, plain, "{params:?}, {drafts} drafts from close rows");
                let (far, accepted_far) = decode_with_drafts(&params, &rows, &unrelated, drafts);
                assert_eq!(
                    far, plain,
                    "{params:?}, {drafts} drafts from unrelated rows"
                );
                // Close rows draft better than unrelated ones.
                assert!(
                    accepted_near > accepted_far,
                    "{params:?}: {accepted_near} ≤ {accepted_far}"
                );
            }
        }
    }
}
