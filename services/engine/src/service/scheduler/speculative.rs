//! Speculative stepping: drafting with the model's MTP head, the forwards that verify the drafts
//! beside the plain sequences' steps, acceptance, and rollback of rejected rows.
//!
//! Owns: a speculating sequence's drafts, verification and MTP pairs. Must not touch: the
//! sampling of a plain row (`row_sampling.rs`), admission.

use super::counters::SchedulerCounters;
use super::row_sampling::{emit, logprobs, prepare_row, sample_rows};
use super::sequence::{fail, Running};
use crate::backend::{Backend, DeltaRuleForm};
use crate::constraint::Allowed;
use crate::error::EngineError;
use crate::model::{
    pick_draft, probe_draft, verify_drafts, DraftPlan, Model, SequenceCheckpoint, SequenceInput,
};
use crate::spec::MixerKind;

/// Verified pairs a sequence that is not drafting keeps for the MTP head before feeding them
/// to it anyway (bounds the host memory they take).
const PAIRS_HELD_WITHOUT_DRAFTS: usize = 64;

/// Drafts this step's tokens of a speculating sequence with the MTP head and appends them to
/// its pending input: first the pairs the head has not seen (the main model's verified rows),
/// then a chain of drafts, each from the head's output for the one before. The chain's own
/// pairs are guesses and are cut off again; the next step pairs the verified rows. A step
/// without drafts holds its pairs back (up to [`PAIRS_HELD_WITHOUT_DRAFTS`]) and runs neither
/// the MTP layer nor the head; a probe's one draft is kept aside, not appended.
pub(super) fn draft<B: Backend>(model: &Model<B>, r: &mut Running<B>) -> Result<(), EngineError> {
    let Running {
        request,
        sampler,
        history,
        pending,
        generated,
        speculating: Some(s),
        ..
    } = r
    else {
        return Ok(());
    };
    s.drafts.clear();
    s.probe = None;
    if *generated == 0 {
        // The prompt's step: nothing to draft from yet.
        return Ok(());
    }
    let backend = model.output_backend();
    let hidden_size = model.spec().common.hidden_size;
    let vocab = model.vocab_size();
    // The request's last token is a plain pick: at most `remaining - 1` drafts.
    let room = request.max_new_tokens.saturating_sub(*generated + 1);
    let plan = s.controller.next_plan(room);
    let count = plan.drafts();
    let pairs = s.pair_tokens.len();
    if pairs == 0 || (count == 0 && pairs < PAIRS_HELD_WITHOUT_DRAFTS) {
        return Ok(());
    }
    let hidden = backend.upload(&s.pair_hidden, pairs, hidden_size)?;
    let out = model.mtp_forward(&mut s.mtp, &hidden, &s.pair_tokens)?;
    s.pair_hidden.clear();
    s.pair_tokens.clear();
    if count == 0 {
        return Ok(());
    }
    let committed = s.mtp.position();
    let mut chain = backend.gather_rows(&out, &[pairs - 1])?;
    let mut seen = history.clone();
    while s.drafts.len() < count {
        let mut row = model.mtp_draft_logits(&chain)?;
        prepare_row(&mut row, request, vocab);
        // Draft `j` guesses the token picked after the pending one and `j` drafts: the
        // sampler's pick `j` ahead.
        let token = pick_draft(sampler, &row, &seen, s.drafts.len())?;
        seen.push(token);
        s.drafts.push(token);
        if s.drafts.len() < count {
            chain = model.mtp_forward(&mut s.mtp, &chain, &[token])?;
        }
    }
    s.mtp.truncate(committed);
    if plan == DraftPlan::Probe {
        s.probe = s.drafts.pop();
    } else {
        pending.extend_from_slice(&s.drafts);
    }
    Ok(())
}

/// One step with speculating sequences: forwards, verification of the drafts, rollback of the
/// rejected rows.
///
/// Verification rows run the gated delta rule token by token (every row gets the bits a
/// one-token decode gives it), prompts the model's usual form, and the form is one per forward:
/// on a model with linear attention, a step with both goes in two forwards (prompts first).
/// Otherwise every sequence is in one forward, speculating or not.
pub(super) fn speculative_step<B: Backend>(
    model: &Model<B>,
    running: &mut [Running<B>],
    allowed: &[Allowed],
    counters: &SchedulerCounters,
    finished: &mut Vec<usize>,
) -> Result<(), EngineError> {
    let verifying: Vec<bool> = running
        .iter()
        .map(|r| r.speculating.as_ref().is_some_and(|s| !s.drafts.is_empty()))
        .collect();
    let prompt = |r: &Running<B>| r.generated == 0 && r.pending.len() > 1;
    let linear_attention = model.spec().mixers.contains(&MixerKind::GatedDeltaNet);
    let any_verifying = verifying.contains(&true);
    let groups: Vec<(Vec<usize>, Option<DeltaRuleForm>)> =
        if linear_attention && any_verifying && running.iter().any(prompt) {
            let (verify, rest): (Vec<usize>, Vec<usize>) =
                (0..running.len()).partition(|&index| verifying[index]);
            vec![(rest, None), (verify, Some(DeltaRuleForm::Recurrent))]
        } else {
            let form = any_verifying.then_some(DeltaRuleForm::Recurrent);
            vec![((0..running.len()).collect(), form)]
        };
    let mut rollbacks: Vec<(usize, Vec<u32>)> = Vec::new();
    for (members, form) in groups {
        step_group(
            model,
            running,
            &members,
            form,
            allowed,
            counters,
            finished,
            &mut rollbacks,
        )?;
    }
    rollbacks.retain(|(index, _)| !finished.contains(index));
    if rollbacks.is_empty() {
        return Ok(());
    }
    // The states went back to before the verification; the accepted rows go through again so
    // the states hold exactly them (their outputs were already taken from the verification,
    // which computed the same bits).
    rollbacks.sort_unstable_by_key(|(index, _)| *index);
    let mut batch: Vec<SequenceInput<'_, B>> = running
        .iter_mut()
        .enumerate()
        .filter_map(|(index, r)| {
            let at = rollbacks
                .binary_search_by_key(&index, |(index, _)| *index)
                .ok()?;
            Some(SequenceInput {
                state: &mut r.state,
                tokens: &rollbacks[at].1,
            })
        })
        .collect();
    model.forward_hidden(&mut batch, Some(DeltaRuleForm::Recurrent))?;
    Ok(())
}

/// One forward of `members` (ascending indices into `running`) and what follows it: a token for
/// each plain sequence, verification for each speculating one.
#[allow(clippy::too_many_arguments)]
fn step_group<B: Backend>(
    model: &Model<B>,
    running: &mut [Running<B>],
    members: &[usize],
    form: Option<DeltaRuleForm>,
    allowed: &[Allowed],
    counters: &SchedulerCounters,
    finished: &mut Vec<usize>,
    rollbacks: &mut Vec<(usize, Vec<u32>)>,
) -> Result<(), EngineError> {
    if members.is_empty() {
        return Ok(());
    }
    let backend = model.output_backend();
    let vocab = model.vocab_size();
    let hidden_size = model.spec().common.hidden_size;
    // Linear-attention states cannot be cut back: a copy before a verification, to go back to
    // when drafts are rejected (attention caches need only the position).
    let mut checkpoints = Vec::with_capacity(members.len());
    for &index in members {
        let r = &running[index];
        let drafted = r.speculating.as_ref().is_some_and(|s| !s.drafts.is_empty());
        checkpoints.push(drafted.then(|| model.checkpoint(&r.state)).transpose()?);
    }
    let mut batch: Vec<SequenceInput<'_, B>> = running
        .iter_mut()
        .enumerate()
        .filter(|(index, _)| members.binary_search(index).is_ok())
        .map(|(_, r)| SequenceInput {
            state: &mut r.state,
            tokens: &r.pending,
        })
        .collect();
    let hidden = model.forward_hidden(&mut batch, form)?;
    drop(batch);

    // Rows of the forward. A sequence without drafts this step picks its token from its last
    // row as plain decoding does (backend candidates when they suffice); a speculating one also
    // keeps every row it processed for the MTP head. A verification reads all its rows.
    let (mut picking, mut picking_rows) = (Vec::new(), Vec::new());
    // Speculating sequences: (index, its input, where its rows start among the kept rows,
    // whether it verifies drafts or checks a probe: then its token comes from its whole row).
    let mut speculating: Vec<(usize, Vec<u32>, usize, bool)> = Vec::new();
    let mut kept_rows = Vec::new();
    let mut start = 0;
    for &index in members {
        let r = &running[index];
        let end = start + r.pending.len();
        let verifies = r
            .speculating
            .as_ref()
            .is_some_and(|s| !s.drafts.is_empty() || s.probe.is_some());
        if !verifies {
            picking.push(index);
            picking_rows.push(end - 1);
        }
        if r.speculating.is_some() {
            speculating.push((index, r.pending.clone(), kept_rows.len(), verifies));
            kept_rows.extend(start..end);
        }
        start = end;
    }
    let kept = (!kept_rows.is_empty())
        .then(|| backend.gather_rows(&hidden, &kept_rows))
        .transpose()?;
    let kept_host = kept.as_ref().map(|k| backend.download(k)).transpose()?;
    let verify_rows: Vec<usize> = speculating
        .iter()
        .filter(|(_, _, _, verifies)| *verifies)
        .flat_map(|(_, input, at, _)| *at..*at + input.len())
        .collect();
    let verify_logits = match &kept {
        Some(kept) if !verify_rows.is_empty() => {
            Some(model.head_logits(&backend.gather_rows(kept, &verify_rows)?)?)
        }
        _ => None,
    };
    if !picking.is_empty() {
        let logits = model.head_logits_on_backend(&backend.gather_rows(&hidden, &picking_rows)?)?;
        sample_rows(
            model, running, &picking, &logits, allowed, counters, finished,
        )?;
    }
    let short = || EngineError::InvalidConfig {
        problem: "the backend returned fewer rows than the forward had".into(),
    };
    let mut checkpoints: std::collections::HashMap<usize, SequenceCheckpoint<B>> = members
        .iter()
        .copied()
        .zip(checkpoints)
        .filter_map(|(index, checkpoint)| checkpoint.map(|c| (index, c)))
        .collect();
    let mut logits_at = 0;
    for (index, input, at, verifies) in speculating {
        let rows = input.len();
        let own_hidden = kept_host
            .as_ref()
            .and_then(|values| values.get(at * hidden_size..(at + rows) * hidden_size))
            .ok_or_else(short)?;
        if !verifies {
            // Picked like a plain sequence: every row it processed pairs with the token after it.
            if finished.contains(&index) {
                continue;
            }
            let r = &mut running[index];
            let (Some(s), Some(&token)) = (r.speculating.as_mut(), r.pending.first()) else {
                continue;
            };
            s.pair_hidden.extend_from_slice(own_hidden);
            s.pair_tokens.extend_from_slice(&input[1..]);
            s.pair_tokens.push(token);
            continue;
        }
        let own_logits = verify_logits
            .as_ref()
            .and_then(|values| values.get(logits_at * vocab..(logits_at + rows) * vocab))
            .ok_or_else(short)?;
        logits_at += rows;
        let r = &mut running[index];
        let checkpoint = checkpoints.remove(&index);
        match verify_and_emit(model, r, own_hidden, own_logits, checkpoint, counters) {
            Ok(Verified::Continues { rollback: None }) => {}
            Ok(Verified::Continues {
                rollback: Some(tokens),
            }) => rollbacks.push((index, tokens)),
            Ok(Verified::Ended) => finished.push(index),
            Err(error) => {
                fail(r, &error);
                finished.push(index);
            }
        }
    }
    Ok(())
}

/// What became of a speculating sequence after its verification.
enum Verified {
    /// It goes on; `rollback`: the accepted input its linear-attention states must process
    /// again (some drafts were rejected and the state went back to its checkpoint).
    Continues { rollback: Option<Vec<u32>> },
    /// It finished or its client went away.
    Ended,
}

/// Verifies a speculating sequence's drafts against its rows of the forward (`hidden`: every
/// input row; `logits`: the rows that pick tokens), emits the accepted drafts and the token
/// after them, keeps the verified rows as the MTP head's next pairs, and puts the sequence back
/// to its checkpoint when drafts were rejected (the caller recomputes the accepted rows).
fn verify_and_emit<B: Backend>(
    model: &Model<B>,
    r: &mut Running<B>,
    hidden: &[f32],
    logits: &[f32],
    checkpoint: Option<SequenceCheckpoint<B>>,
    counters: &SchedulerCounters,
) -> Result<Verified, EngineError> {
    let vocab = model.vocab_size();
    let hidden_size = model.spec().common.hidden_size;
    let Some(s) = r.speculating.as_mut() else {
        return Err(EngineError::InvalidConfig {
            problem: "verification of a sequence that does not speculate".into(),
        });
    };
    // Tokens are picked from the rows with the request's bias and mask; logprobs are those of
    // the unmodified logits (as engine.proto defines them).
    let raw_rows: Vec<&[f32]> = logits.chunks(vocab).collect();
    let mut rows: Vec<Vec<f32>> = raw_rows.iter().map(|row| row.to_vec()).collect();
    for row in &mut rows {
        prepare_row(row, &r.request, vocab);
    }
    let drafts = std::mem::take(&mut s.drafts);
    let invalid = |error: EngineError| EngineError::InvalidSampling {
        problem: error.to_string(),
    };
    let (accepted, next) = match (s.probe.take(), rows.first()) {
        // A probe: its draft against the pending token's row; the token is one plain decoding
        // could give, and the probe's draft is never an input row.
        (Some(probe), Some(row)) => {
            let (probe_accepted, token) =
                probe_draft(&mut r.sampler, row, probe, &r.history).map_err(invalid)?;
            s.controller.record(1, usize::from(probe_accepted));
            counters.record_probe(probe_accepted);
            (0, token)
        }
        _ => {
            let (accepted, next) =
                verify_drafts(&mut r.sampler, &rows, &drafts, &r.history).map_err(invalid)?;
            if !drafts.is_empty() {
                s.controller.record(drafts.len(), accepted);
                counters.record_verification(drafts.len(), accepted);
            }
            (accepted, next)
        }
    };
    // The rows the sequence keeps, and the token after each: the MTP head's next pairs.
    let input = std::mem::take(&mut r.pending);
    let kept = input.len() - drafts.len() + accepted;
    s.pair_hidden
        .extend_from_slice(&hidden[..kept * hidden_size]);
    s.pair_tokens.extend_from_slice(&input[1..kept]);
    s.pair_tokens.push(next);
    let rollback = match checkpoint {
        _ if accepted == drafts.len() => None,
        Some(checkpoint) => {
            model.restore(&mut r.state, checkpoint)?;
            Some(input[..kept].to_vec())
        }
        None => {
            return Err(EngineError::InvalidConfig {
                problem: "rejected drafts without a checkpoint".into(),
            })
        }
    };
    r.pending.push(next);
    let emitted = drafts[..accepted].iter().copied().chain([next]);
    for (row, token) in raw_rows.into_iter().zip(emitted) {
        let (logprob, top) = logprobs(row, token, r.request.top_logprobs);
        if !emit(r, token, logprob, top, counters) {
            return Ok(Verified::Ended);
        }
    }
    Ok(Verified::Continues { rollback })
}
