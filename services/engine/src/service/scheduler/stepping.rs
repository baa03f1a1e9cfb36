//! One generation step of the running sequences: their drafts, the grammar masks, then a plain
//! forward with a token sampled per sequence, or a speculative step.
//!
//! Owns: the order of a step and the sequences that leave it. Must not touch: sampling a row
//! (`row_sampling.rs`), drafting and verification (`speculative.rs`).

use super::counters::SchedulerCounters;
use super::limits::SpeculativeDecoding;
use super::messages::SchedulerError;
use super::prompt_chunks::record_prompt;
use super::row_sampling::sample_rows;
use super::sequence::{fail, fail_all, Running};
use super::speculative::{draft, speculative_step};
use crate::backend::Backend;
use crate::constraint::Allowed;
use crate::error::EngineError;
use crate::model::{Model, SequenceInput};
use crate::prefix_cache::PrefixCache;

/// One generation step of `running` (not empty): drafts, grammar masks, the forward, the
/// sampled tokens; sequences that end leave `running`.
pub(super) fn generation_step<B: Backend>(
    model: &Model<B>,
    running: &mut Vec<Running<B>>,
    speculation: SpeculativeDecoding,
    mut prefix: Option<&mut PrefixCache<B>>,
    counters: &SchedulerCounters,
) {
    {
        // Speculating sequences draft with the MTP head first: the drafts join their input.
        if speculation.max_draft_tokens > 0 {
            let mut failed = Vec::new();
            for (index, r) in running.iter_mut().enumerate() {
                if let Err(error) = draft(model, r) {
                    tracing::error!(request_id = %r.request.request_id, "drafting failed: {error}");
                    fail(r, &error);
                    failed.push(index);
                }
            }
            for index in failed.into_iter().rev() {
                running.swap_remove(index);
            }
            if running.is_empty() {
                return;
            }
        }
        // What each guided sequence may sample this step (a grammar mask, a forced token).
        let mut allowed = Vec::with_capacity(running.len());
        let mut refused = Vec::new();
        for (index, r) in running.iter_mut().enumerate() {
            match r.guide.as_mut().map(|guide| guide.allowed()).transpose() {
                Ok(step) => allowed.push(step.unwrap_or(Allowed::Any)),
                Err(error) => {
                    let _ = r
                        .request
                        .events
                        .try_send(Err(SchedulerError::InvalidRequest(error.to_string())));
                    refused.push(index);
                    allowed.push(Allowed::Any);
                }
            }
        }
        for index in refused.into_iter().rev() {
            running.swap_remove(index);
            allowed.swap_remove(index);
        }
        if running.is_empty() {
            return;
        }
        let mut finished = Vec::new();
        let stepped = if speculation.max_draft_tokens == 0 {
            plain_step(model, running, &allowed, counters, &mut finished)
        } else {
            speculative_step(model, running, &allowed, counters, &mut finished)
        };
        if let Err(error) = stepped {
            tracing::error!("forward pass failed: {error}");
            fail_all(running, &error);
            return;
        }
        finished.sort_unstable();
        finished.dedup();
        for index in finished.into_iter().rev() {
            let mut r = running.swap_remove(index);
            if let Some(cache) = prefix.as_deref_mut() {
                record_prompt(model, cache, &mut r);
            }
        }
    }
}

/// One forward of every running sequence's pending tokens and one token sampled per sequence.
fn plain_step<B: Backend>(
    model: &Model<B>,
    running: &mut [Running<B>],
    allowed: &[Allowed],
    counters: &SchedulerCounters,
    finished: &mut Vec<usize>,
) -> Result<(), EngineError> {
    let mut batch: Vec<SequenceInput<'_, B>> = running
        .iter_mut()
        .map(|r| SequenceInput {
            state: &mut r.state,
            tokens: &r.pending,
        })
        .collect();
    let logits = model.forward_logits_on_backend(&mut batch)?;
    drop(batch);
    let members: Vec<usize> = (0..running.len()).collect();
    sample_rows(
        model, running, &members, &logits, allowed, counters, finished,
    )
}
