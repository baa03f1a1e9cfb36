//! Speculative decoding with the model's MTP head: draft `N` tokens, verify them with one forward
//! of `N + 1` rows, keep what the verification accepts and one token of the main model's.
//! Greedy and sampled decoding keep the longest prefix of drafts that are the main model's own
//! picks and the main model's next token; a sampled draft is picked with the draw its position
//! uses, so a seeded answer is token for token the one sampling without drafts gives.
//!
//! Owns: the in-process draft → verify → accept → roll back loop of one sequence and its counts;
//! the rules it applies (picking, verifying, the draft controller) are `speculation_rules.rs`.
//! Rolling back: attention caches are cut back by position; Gated DeltaNet states are restored
//! from a checkpoint taken before the verification and the accepted rows recomputed (one extra
//! forward of `k + 1` rows when a draft is rejected, instead of a state copy per draft position).
//! The verification runs the delta rule token by token, so every row gets the bits a one-token
//! decode gives it and the output equals plain greedy decoding token for token.
//! The scheduler serves the same rules one step at a time.
//! Benchmarks only: [`ForcedAcceptance`] overrides the accept / reject decision at given rates
//! (a random-weight model's head drafts tokens its main model almost never accepts), keeping
//! every cost: drafts are still computed and verified, and the rollback runs as for a real
//! rejection.
//! Must not touch: the scheduler, how logits are filtered (`crate::sampling`), how the head and
//! layers compute.

use super::speculation_rules::{
    pick_draft, probe_draft, verify_drafts, DraftController, DraftPlan, ForcedAcceptance,
};
use super::{Model, SequenceInput};
use crate::backend::{Backend, DeltaRuleForm};
use crate::error::EngineError;
use crate::sampling::{Sampler, SamplingParams};

/// How a speculative generation drafts, beyond the sampling rule.
#[derive(Debug, Clone, Default)]
pub struct SpeculationOptions {
    /// Most drafts per step (0: no drafting).
    pub draft_tokens: usize,
    /// Size each step's drafts with a [`DraftController`] (as the server does) instead of
    /// always drafting `draft_tokens`.
    pub adaptive: bool,
    /// FOR BENCHMARKS ONLY: see [`ForcedAcceptance`].
    pub forced_acceptance: Option<ForcedAcceptance>,
}

/// What a speculative generation produced, and how the drafts fared.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpeculativeOutcome {
    /// The generated tokens (the same as greedy decoding without drafts).
    pub tokens: Vec<u32>,
    /// Verification forwards (main-model steps after the prompt).
    pub verifications: usize,
    /// `drafted[j]`: chains that had a draft at depth `j + 1`.
    pub drafted: Vec<usize>,
    /// `accepted[j]`: chains whose drafts 1..=j+1 were all accepted.
    pub accepted: Vec<usize>,
    /// Wall time after the prompt's forward and first token: drafting and verifying.
    pub decode_time: std::time::Duration,
    /// Rows of the verification forwards (the pending token and the drafts), summed.
    pub verified_rows: u64,
    /// MoE layer calls of the verification forwards (MoE layers × verifications).
    pub verify_moe_layer_calls: u64,
    /// Distinct routed experts the verification forwards read, summed over their MoE layer calls
    /// (per call: the union over its rows, as the model's profile counts it).
    pub verify_distinct_experts: u64,
    /// Steps whose one draft was a [`DraftPlan::Probe`] (counted in `drafted[0]` and
    /// `accepted[0]` too, but not verified as an input row).
    pub probes: usize,
    /// Every chain's first draft (probes' included), in order.
    pub first_drafts: Vec<FirstDraft>,
}

/// A chain's first draft: where it guessed, what, and the logit it had (the row's bits show
/// whether the MTP layer saw the same positions as another run).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstDraft {
    /// Index in [`SpeculativeOutcome::tokens`] of the token it guessed.
    pub position: usize,
    pub token: u32,
    /// The draft logits row's value at `token`.
    pub logit: f32,
}

impl SpeculativeOutcome {
    /// Tokens per main-model step after the prompt (1 without drafts).
    pub fn tokens_per_step(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.verifications.max(1) as f64
    }

    /// Mean distinct routed experts one MoE layer reads per verification: the union of the
    /// experts its rows route to (top-k without drafts; up to `(drafts + 1) · top-k`).
    pub fn experts_per_verify_layer(&self) -> f64 {
        self.verify_distinct_experts as f64 / self.verify_moe_layer_calls.max(1) as f64
    }

    /// Mean rows per verification (1 + drafts).
    pub fn rows_per_verification(&self) -> f64 {
        self.verified_rows as f64 / self.verifications.max(1) as f64
    }
}

/// `count` greedy tokens after `prompt`, drafting up to `draft_tokens` per step with the MTP head.
pub fn greedy_with_mtp<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    count: usize,
    draft_tokens: usize,
) -> Result<SpeculativeOutcome, EngineError> {
    greedy_with_mtp_options(
        model,
        prompt,
        count,
        SpeculationOptions {
            draft_tokens,
            ..SpeculationOptions::default()
        },
    )
}

/// [`greedy_with_mtp`] with every drafting option: adaptive drafts, and (benchmarks only)
/// forced acceptance, under which the tokens are no longer greedy decoding's.
pub fn greedy_with_mtp_options<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    count: usize,
    options: SpeculationOptions,
) -> Result<SpeculativeOutcome, EngineError> {
    speculate(
        model,
        prompt,
        count,
        options,
        Sampler::new(SamplingParams::greedy())?,
    )
}

/// `count` tokens sampled with `params` after `prompt`, drafting up to `draft_tokens` per step
/// with the MTP head: the tokens sampling without drafts gives with the same seed.
pub fn sample_with_mtp<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    count: usize,
    draft_tokens: usize,
    params: SamplingParams,
) -> Result<SpeculativeOutcome, EngineError> {
    let sampler = Sampler::new(params)?;
    speculate(
        model,
        prompt,
        count,
        SpeculationOptions {
            draft_tokens,
            ..SpeculationOptions::default()
        },
        sampler,
    )
}

/// Most pairs a sequence holds back from the MTP layer while it does not draft before they go
/// through it anyway (bounds the rows one catch-up forward takes; above `PROBE_INTERVAL`, so an
/// adaptive sequence catches up at its probes).
const PAIRS_HELD_WITHOUT_DRAFTS: usize = 64;

/// Pairs the MTP layer has not seen yet: the main model's final-normed rows (one tensor per
/// step, in order) and the token after each.
struct HeldPairs<B: Backend> {
    hidden: Vec<B::Tensor>,
    tokens: Vec<u32>,
}

/// Every held pair through the MTP layer in one forward; returns its output rows, or `None`
/// when nothing was held.
fn catch_up<B: Backend>(
    model: &Model<B>,
    mtp: &mut super::MtpState<B>,
    held: &mut HeldPairs<B>,
) -> Result<Option<B::Tensor>, EngineError> {
    let backend = model.output_backend();
    let hidden = match held.hidden.len() {
        0 => return Ok(None),
        1 => held.hidden.pop(),
        _ => {
            // One host round trip at the step that drafts, instead of one per step.
            let width = model.spec().common.hidden_size;
            let mut values = Vec::with_capacity(held.tokens.len() * width);
            for part in held.hidden.drain(..) {
                values.extend(backend.download(&part)?);
            }
            Some(backend.upload(&values, values.len() / width.max(1), width)?)
        }
    };
    let hidden = hidden.ok_or_else(|| EngineError::InvalidConfig {
        problem: "held MTP pairs without rows".into(),
    })?;
    let tokens = std::mem::take(&mut held.tokens);
    held.hidden.clear();
    model.mtp_forward(mtp, &hidden, &tokens).map(Some)
}

fn speculate<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    count: usize,
    options: SpeculationOptions,
    mut sampler: Sampler,
) -> Result<SpeculativeOutcome, EngineError> {
    let SpeculationOptions {
        draft_tokens,
        adaptive,
        mut forced_acceptance,
    } = options;
    let mut controller = adaptive.then(|| DraftController::new(draft_tokens));
    let mut outcome = SpeculativeOutcome {
        drafted: vec![0; draft_tokens],
        accepted: vec![0; draft_tokens],
        ..SpeculativeOutcome::default()
    };
    if count == 0 {
        return Ok(outcome);
    }
    let backend = model.output_backend();
    let max_context = prompt.len() + count + draft_tokens + 1;
    let mut state = model.new_sequence(max_context)?;
    let mut mtp = model.new_mtp_state(max_context)?;
    let hidden = model.forward_hidden(
        &mut [SequenceInput {
            state: &mut state,
            tokens: prompt,
        }],
        None,
    )?;
    let vocab = model.vocab_size().max(1);
    let last = backend.gather_rows(&hidden, &[prompt.len() - 1])?;
    let mut pending = sampler.sample(&model.head_logits(&last)?, &[])?;
    outcome.tokens.push(pending);
    // The MTP head's next input: (h_t, token t + 1) for every position the main model has done
    // and the MTP layer has not.
    let mut held = HeldPairs::<B> {
        hidden: vec![hidden],
        tokens: prompt[1..].iter().copied().chain([pending]).collect(),
    };
    let decode_started = std::time::Instant::now();

    while outcome.tokens.len() < count {
        // Drafts past the last wanted token would be thrown away.
        let draft_room = count - outcome.tokens.len() - 1;
        let plan = match controller.as_mut() {
            Some(controller) => controller.next_plan(draft_room),
            None => DraftPlan::fixed(draft_tokens.min(draft_room)),
        };
        let wanted = plan.drafts();
        let mut drafts = Vec::with_capacity(wanted);
        if wanted > 0 || held.tokens.len() >= PAIRS_HELD_WITHOUT_DRAFTS {
            let out = catch_up(model, &mut mtp, &mut held)?;
            if let (Some(out), true) = (out, wanted > 0) {
                let rows = backend.shape(&out).0;
                let mut chain = backend.gather_rows(&out, &[rows - 1])?;
                let committed_after_pairs = mtp.position();
                while drafts.len() < wanted {
                    let mut history = outcome.tokens.clone();
                    history.extend_from_slice(&drafts);
                    let row = model.mtp_draft_logits(&chain)?;
                    let token = pick_draft(&sampler, &row, &history, drafts.len())?;
                    if drafts.is_empty() {
                        outcome.first_drafts.push(FirstDraft {
                            position: outcome.tokens.len(),
                            token,
                            logit: row.get(token as usize).copied().unwrap_or(f32::NAN),
                        });
                    }
                    drafts.push(token);
                    if drafts.len() < wanted {
                        chain = model.mtp_forward(&mut mtp, &chain, &[token])?;
                    }
                }
                // The chain's own pairs are guesses: the next step pairs the verified states.
                mtp.truncate(committed_after_pairs);
            }
        }
        // A probe's draft is checked against the pending token's row, not verified as input.
        let verified_drafts = &drafts[..plan.verified_drafts().min(drafts.len())];

        // Linear-attention states are copied only when drafts may have to be rolled back.
        let checkpoint = (!verified_drafts.is_empty())
            .then(|| model.checkpoint(&state))
            .transpose()?;
        let input: Vec<u32> = std::iter::once(pending)
            .chain(verified_drafts.iter().copied())
            .collect();
        // The profile's expert counts around the verification alone (this loop is the
        // model's only user while it runs).
        let profile_before = model.profile().snapshot(false);
        let verified = model.forward_hidden(
            &mut [SequenceInput {
                state: &mut state,
                tokens: &input,
            }],
            Some(DeltaRuleForm::Recurrent),
        )?;
        let profile_after = model.profile().snapshot(false);
        let experts = |snapshot: &crate::profile::ProfileSnapshot| {
            let (prefill, decode) = (&snapshot.prefill, &snapshot.decode);
            (
                prefill.moe_layer_calls + decode.moe_layer_calls,
                prefill.cpu_experts
                    + prefill.resident_experts
                    + decode.cpu_experts
                    + decode.resident_experts,
            )
        };
        let ((calls_before, distinct_before), (calls_after, distinct_after)) =
            (experts(&profile_before), experts(&profile_after));
        outcome.verify_moe_layer_calls += calls_after.saturating_sub(calls_before);
        outcome.verify_distinct_experts += distinct_after.saturating_sub(distinct_before);
        outcome.verified_rows += input.len() as u64;
        outcome.verifications += 1;
        let logits = model.head_logits(&verified)?;
        let rows: Vec<&[f32]> = logits.chunks(vocab).collect();

        if plan == DraftPlan::Probe {
            let &draft = drafts.first().ok_or_else(|| EngineError::InvalidConfig {
                problem: "a probe without its draft".into(),
            })?;
            let (accepted, next) = match forced_acceptance.as_mut() {
                // Forced: an accepted draft is the next token (there is no row after it).
                Some(forced) => match forced.accepted_drafts(1) {
                    0 => (false, sampler.sample(rows[0], &outcome.tokens)?),
                    _ => (true, draft),
                },
                None => probe_draft(&mut sampler, rows[0], draft, &outcome.tokens)?,
            };
            if let Some(controller) = controller.as_mut() {
                controller.record(1, usize::from(accepted));
            }
            outcome.probes += 1;
            outcome.drafted[0] += 1;
            outcome.accepted[0] += usize::from(accepted);
            held.hidden.push(verified);
            held.tokens.push(next);
            pending = next;
            outcome.tokens.push(next);
            continue;
        }

        let (accepted, next) = match forced_acceptance.as_mut() {
            // Only the decision is forced: the token after the accepted drafts is still the
            // main model's, from the row that follows them.
            Some(forced) => {
                let accepted = forced.accepted_drafts(drafts.len());
                let mut history = outcome.tokens.clone();
                history.extend_from_slice(&drafts[..accepted]);
                (accepted, sampler.sample(rows[accepted], &history)?)
            }
            None => verify_drafts(&mut sampler, &rows, &drafts, &outcome.tokens)?,
        };
        if let Some(controller) = controller.as_mut() {
            controller.record(drafts.len(), accepted);
        }
        for depth in 0..drafts.len() {
            outcome.drafted[depth] += 1;
            if depth < accepted {
                outcome.accepted[depth] += 1;
            }
        }
        let kept_hidden = if accepted < drafts.len() {
            // A rejected draft's rows are in the state: back to the checkpoint, then the
            // accepted rows again.
            let checkpoint = checkpoint.ok_or_else(|| EngineError::InvalidConfig {
                problem: "rejected drafts without a checkpoint".into(),
            })?;
            model.restore(&mut state, checkpoint)?;
            model.forward_hidden(
                &mut [SequenceInput {
                    state: &mut state,
                    tokens: &input[..=accepted],
                }],
                Some(DeltaRuleForm::Recurrent),
            )?
        } else if drafts.is_empty() {
            // Without drafts the one row is the kept one.
            verified
        } else {
            let kept: Vec<usize> = (0..=accepted).collect();
            backend.gather_rows(&verified, &kept)?
        };
        let pair_tokens: Vec<u32> = drafts[..accepted].iter().copied().chain([next]).collect();
        held.hidden.push(kept_hidden);
        held.tokens.extend_from_slice(&pair_tokens);
        pending = next;
        let room = count - outcome.tokens.len();
        outcome
            .tokens
            .extend(pair_tokens.iter().copied().take(room));
    }
    outcome.decode_time = decode_started.elapsed();
    Ok(outcome)
}
