//! Long prompts beside decoding sequences: which prompts go through in chunks of their own this
//! step, each chunk's forward, chunks that end at the prefix cache's checkpoints, and the prompt
//! blocks given to the prefix cache.
//!
//! Owns: feeding prompt tokens outside the generation step. Must not touch: the time share's
//! accounting (`prefill_share.rs`), sampling.

use std::time::{Duration, Instant};

use super::sequence::{fail, has_prompt_work, Running};
use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::{Model, SequenceCheckpoint, SequenceInput};
use crate::prefix_cache::{MtpProgress, PrefixCache};

/// Feeds the prompts that do not fit this step's budget of `chunk_tokens` prompt tokens one
/// chunk (while budget lasts, first come first served) and takes them out of `running` for
/// this step: a prompt that fits joins the step whole, as do decode rows. Nothing is held
/// while a sequence runs alone (its prompt goes whole) or with `chunk_tokens` 0. A prompt's
/// last token always joins a step, which samples its first token. Without `may_prefill` (the
/// time share's verdict) every prompt with work left sits out the step, no chunk runs.
/// Returns the held sequences and the wall time of the chunk forwards.
pub(super) fn feed_prompt_chunks<B: Backend>(
    model: &Model<B>,
    running: &mut Vec<Running<B>>,
    chunk_tokens: usize,
    may_prefill: bool,
    mut prefix: Option<&mut PrefixCache<B>>,
) -> (Vec<Running<B>>, Duration) {
    let mut held = Vec::new();
    if !may_prefill {
        let mut index = 0;
        while index < running.len() {
            if has_prompt_work(&running[index]) {
                held.push(running.remove(index));
            } else {
                index += 1;
            }
        }
        return (held, Duration::ZERO);
    }
    let mut took = Duration::ZERO;
    if chunk_tokens == 0 || running.len() < 2 {
        return (held, took);
    }
    let mut budget = chunk_tokens;
    let mut index = 0;
    while index < running.len() {
        let prompt_left = match &running[index] {
            r if r.generated == 0 => r.pending.len(),
            _ => 0,
        };
        if prompt_left <= 1 || prompt_left <= budget {
            budget -= prompt_left.min(budget);
            index += 1;
            continue;
        }
        let mut r = running.remove(index);
        if budget > 0 {
            let take = match prefix.as_deref() {
                Some(cache) => checkpoint_chunk(model, cache, &r, budget.min(prompt_left - 1)),
                None => budget.min(prompt_left - 1),
            };
            budget -= take;
            let started = Instant::now();
            let fed = feed_prompt_chunk(model, &mut r, take);
            if let (Ok(()), Some(cache)) = (&fed, prefix.as_deref_mut()) {
                record_blocks(model, cache, &r);
            }
            took += started.elapsed();
            if let Err(error) = fed {
                tracing::error!(request_id = %r.request.request_id, "a prompt chunk failed: {error}");
                fail(&r, &error);
                continue;
            }
        }
        held.push(r);
    }
    (held, took)
}

/// The first `take` tokens of a prompt through the model in a forward of their own (no
/// token is sampled); a speculating sequence keeps their rows for its MTP head, each paired
/// with the prompt token after it, as a whole prompt's step would.
fn feed_prompt_chunk<B: Backend>(
    model: &Model<B>,
    r: &mut Running<B>,
    take: usize,
) -> Result<(), EngineError> {
    let started = Instant::now();
    let chunk = r.pending.get(..take).unwrap_or_default().to_vec();
    let mut batch = [SequenceInput {
        state: &mut r.state,
        tokens: &chunk,
    }];
    let hidden = model.forward_hidden(&mut batch, None)?;
    if let Some(s) = r.speculating.as_mut() {
        s.pair_hidden
            .extend(model.output_backend().download(&hidden)?);
        s.pair_tokens
            .extend_from_slice(r.pending.get(1..=take).unwrap_or_default());
    }
    r.pending.drain(..take.min(r.pending.len()));
    r.prompt_pieces_time += started.elapsed();
    Ok(())
}

/// Puts the longest reusable cached prefix of `request`'s prompt into the fresh `state` and
/// A chunk of at most `take` prompt tokens for `r` that ends at the prefix cache's next
/// checkpoint when it would pass it, and otherwise keeps chunk ends on the model's prefix
/// alignment, so the states the cache keeps are those of a whole prompt's forward.
fn checkpoint_chunk<B: Backend>(
    model: &Model<B>,
    cache: &PrefixCache<B>,
    r: &Running<B>,
    take: usize,
) -> usize {
    let position = r.state.position();
    if let Some(end) = cache.next_checkpoint(position, r.request.prompt.len()) {
        if end - position <= take {
            return end - position;
        }
    }
    let alignment = model.prefix_alignment();
    match take / alignment * alignment {
        0 => take,
        aligned => aligned,
    }
}

/// Feeds each sequence's prompt up to every checkpoint of the prefix cache it passes, one
/// forward per piece, and gives the cache the blocks and states there; the rest of the prompt
/// joins the generation step as usual. A sequence that runs alone takes its last checkpoint in
/// the generation step instead, as that forward's rows pass it
/// ([`Model::request_checkpoint_at`]): the tokens after the checkpoint then cost no forward of
/// their own (with experts in RAM a forward's cost is mostly its experts, whatever its
/// length), and the prompt's rows are computed exactly as without a cache.
pub(super) fn feed_to_checkpoints<B: Backend>(
    model: &Model<B>,
    running: &mut Vec<Running<B>>,
    cache: &mut PrefixCache<B>,
) {
    let alone = running.len() == 1;
    let mut index = 0;
    while index < running.len() {
        let r = &mut running[index];
        let prompt = r.request.prompt.len();
        let mut fed = Ok(());
        while let Some(end) = has_prompt_work(r)
            .then(|| cache.next_checkpoint(r.state.position(), prompt))
            .flatten()
        {
            let last_checkpoint = cache.next_checkpoint(end, prompt).is_none();
            if alone && last_checkpoint && model.request_checkpoint_at(&mut r.state, end) {
                break;
            }
            fed = feed_prompt_chunk(model, r, end - r.state.position());
            if fed.is_err() {
                break;
            }
            record_blocks(model, cache, r);
        }
        if let Err(error) = fed {
            tracing::error!(request_id = %r.request.request_id, "a prompt piece failed: {error}");
            fail(r, &error);
            running.remove(index);
            continue;
        }
        index += 1;
    }
}

/// [`record_blocks`] after a forward that went past a checkpoint it took mid-forward.
fn record_blocks_with_checkpoint<B: Backend>(
    model: &Model<B>,
    cache: &mut PrefixCache<B>,
    r: &Running<B>,
    taken: SequenceCheckpoint<B>,
) {
    let mtp = r.speculating.as_ref().map(|s| MtpProgress {
        state: &s.mtp,
        pending_hidden: &s.pair_hidden,
    });
    let recorded = cache.record_passed_checkpoint(model, &r.state, mtp, &r.request.prompt, taken);
    if let Err(error) = recorded {
        tracing::warn!(request_id = %r.request.request_id, "prefix cache: keeping prompt blocks failed: {error}");
    }
}

/// Gives the prefix cache the prompt blocks `r` holds, with what its MTP head holds of them
/// when it speculates (a failure costs only later reuse).
fn record_blocks<B: Backend>(model: &Model<B>, cache: &mut PrefixCache<B>, r: &Running<B>) {
    let recorded = match &r.speculating {
        Some(s) => {
            let mtp = MtpProgress {
                state: &s.mtp,
                pending_hidden: &s.pair_hidden,
            };
            cache.record_speculating(model, &r.state, mtp, &r.request.prompt)
        }
        None => cache.record(model, &r.state, &r.request.prompt),
    };
    if let Err(error) = recorded {
        tracing::warn!(request_id = %r.request.request_id, "prefix cache: keeping prompt blocks failed: {error}");
    }
}

/// Once `r`'s whole prompt went through the model, gives the prefix cache its blocks.
pub(super) fn record_prompt<B: Backend>(
    model: &Model<B>,
    cache: &mut PrefixCache<B>,
    r: &mut Running<B>,
) {
    if r.prompt_recorded || r.state.position() < r.request.prompt.len() {
        return;
    }
    // A speculating sequence's head consumes the prompt's pairs in a later step's drafting:
    // its blocks get their MTP rows then, by one more recording.
    let head_done = r
        .speculating
        .as_ref()
        .is_none_or(|s| s.mtp.position() + 1 >= r.request.prompt.len());
    match model.take_checkpoint_taken(&mut r.state) {
        Some(taken) => record_blocks_with_checkpoint(model, cache, r, taken),
        None => record_blocks(model, cache, r),
    }
    r.prompt_recorded = head_done;
}
