//! Greedy speculative decoding with the model's MTP head: draft `N` tokens, verify them with one
//! forward of `N + 1` rows, keep the longest agreeing prefix and the main model's next token.
//!
//! Owns: the draft → verify → accept → roll back loop of one sequence, and its counts.
//! Rolling back: attention caches are cut back by position; Gated DeltaNet states are restored
//! from a checkpoint taken before the verification and the accepted rows recomputed (one extra
//! forward of `k + 1` rows when a draft is rejected, instead of a state copy per draft position).
//! The verification runs the delta rule token by token, so every row gets the bits a one-token
//! decode gives it and the output equals plain greedy decoding token for token.
//! Must not touch: sampling other than greedy, the scheduler, how the head and layers compute.

use super::{Model, SequenceInput};
use crate::backend::Backend;
use crate::error::EngineError;
use crate::sampling::argmax;

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
}

impl SpeculativeOutcome {
    /// Tokens per main-model step after the prompt (1 without drafts).
    pub fn tokens_per_step(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.verifications.max(1) as f64
    }
}

/// The greedy argmax of each row of final-normed hidden states.
fn greedy_rows<B: Backend>(model: &Model<B>, hidden: &B::Tensor) -> Result<Vec<u32>, EngineError> {
    let vocab = model.vocab_size().max(1);
    Ok(model
        .head_logits(hidden)?
        .chunks(vocab)
        .map(argmax)
        .collect())
}

/// `count` greedy tokens after `prompt`, drafting up to `draft_tokens` per step with the MTP head.
pub fn greedy_with_mtp<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    count: usize,
    draft_tokens: usize,
) -> Result<SpeculativeOutcome, EngineError> {
    let mut outcome = SpeculativeOutcome {
        drafted: vec![0; draft_tokens],
        accepted: vec![0; draft_tokens],
        ..SpeculativeOutcome::default()
    };
    if count == 0 {
        return Ok(outcome);
    }
    let backend = model.backend();
    let max_context = prompt.len() + count + draft_tokens + 1;
    let mut state = model.new_sequence(max_context)?;
    let mut mtp = model.new_mtp_state(max_context)?;
    let hidden = model.forward_hidden(&mut [SequenceInput {
        state: &mut state,
        tokens: prompt,
    }])?;
    let last = backend.gather_rows(&hidden, &[prompt.len() - 1])?;
    let mut pending = greedy_rows(model, &last)?[0];
    outcome.tokens.push(pending);
    // The MTP head's next input: (h_t, token t + 1) for every position the main model has done.
    let mut pair_hidden = hidden;
    let mut pair_tokens: Vec<u32> = prompt[1..].iter().copied().chain([pending]).collect();
    let decode_started = std::time::Instant::now();

    while outcome.tokens.len() < count {
        let wanted = draft_tokens.min(count - outcome.tokens.len() - 1);
        let committed = mtp.position();
        let mut drafts = Vec::with_capacity(wanted);
        if wanted > 0 {
            let out = model.mtp_forward(&mut mtp, &pair_hidden, &pair_tokens)?;
            let rows = backend.shape(&out).0;
            let mut chain = backend.gather_rows(&out, &[rows - 1])?;
            let committed_after_pairs = mtp.position();
            while drafts.len() < wanted {
                let draft = greedy_rows(model, &chain)?[0];
                drafts.push(draft);
                if drafts.len() < wanted {
                    chain = model.mtp_forward(&mut mtp, &chain, &[draft])?;
                }
            }
            // The chain's own pairs are guesses: the next step pairs the verified states.
            mtp.truncate(committed_after_pairs);
        } else {
            mtp.truncate(committed);
        }

        let checkpoint = model.checkpoint(&state)?;
        let input: Vec<u32> = std::iter::once(pending)
            .chain(drafts.iter().copied())
            .collect();
        let verified = model.forward_hidden_token_by_token(&mut [SequenceInput {
            state: &mut state,
            tokens: &input,
        }])?;
        outcome.verifications += 1;
        let predictions = greedy_rows(model, &verified)?;
        let accepted = drafts
            .iter()
            .zip(&predictions)
            .take_while(|(draft, prediction)| draft == prediction)
            .count();
        for depth in 0..drafts.len() {
            outcome.drafted[depth] += 1;
            if depth < accepted {
                outcome.accepted[depth] += 1;
            }
        }
        let rows: Vec<usize> = (0..=accepted).collect();
        pair_hidden = if accepted < drafts.len() {
            // A rejected draft's rows are in the state: back to the checkpoint, then the
            // accepted rows again.
            model.restore(&mut state, checkpoint)?;
            model.forward_hidden_token_by_token(&mut [SequenceInput {
                state: &mut state,
                tokens: &input[..=accepted],
            }])?
        } else {
            backend.gather_rows(&verified, &rows)?
        };
        pair_tokens = drafts[..accepted]
            .iter()
            .copied()
            .chain([predictions[accepted]])
            .collect();
        pending = predictions[accepted];
        let room = count - outcome.tokens.len();
        outcome
            .tokens
            .extend(pair_tokens.iter().copied().take(room));
    }
    outcome.decode_time = decode_started.elapsed();
    Ok(outcome)
}
