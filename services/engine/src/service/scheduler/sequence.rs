//! A running sequence's state as the scheduler keeps it (its request, model state, sampler,
//! pending input and MTP side), and how a sequence ends: a finish message or an error.
//!
//! Owns: the per-sequence state. Must not touch: the steps that advance it.

use super::messages::{SchedulerError, SchedulerEvent, SequenceFinish};
use super::requests::GenerationRequest;
use crate::backend::Backend;
use crate::constraint::Guide;
use crate::error::EngineError;
use crate::model::{DraftController, MtpState, SequenceState};
use crate::sampling::Sampler;

/// One admitted generation request and its sequence.
pub(super) struct Running<B: Backend> {
    pub(super) request: GenerationRequest,
    pub(super) state: SequenceState<B>,
    /// Prompt tokens the prefix cache gave the sequence.
    pub(super) cached_tokens: usize,
    /// Whether the prefix cache has been given all it keeps of the prompt: its blocks, and
    /// when the sequence speculates their MTP share (a step after the prompt's).
    pub(super) prompt_recorded: bool,
    pub(super) sampler: Sampler,
    pub(super) history: Vec<u32>,
    /// The next forward's input: the prompt, or the last token and this step's drafts.
    pub(super) pending: Vec<u32>,
    pub(super) generated: usize,
    pub(super) guide: Option<Box<Guide>>,
    pub(super) speculating: Option<Speculating<B>>,
    /// When the sequence was admitted, how long its prefix took to restore and its prompt's
    /// pieces outside the generation step took: the first token's log line says where its time
    /// to first token went.
    pub(super) admitted_at: std::time::Instant,
    pub(super) restore_time: std::time::Duration,
    pub(super) prompt_pieces_time: std::time::Duration,
}

/// A speculating sequence's MTP side.
pub(super) struct Speculating<B: Backend> {
    pub(super) mtp: MtpState<B>,
    pub(super) controller: DraftController,
    /// Pairs the MTP head has not seen: the main model's final-normed hidden rows (host,
    /// `[rows, hidden]`) and the token after each.
    pub(super) pair_hidden: Vec<f32>,
    pub(super) pair_tokens: Vec<u32>,
    /// This step's drafts (the tail of `pending`).
    pub(super) drafts: Vec<u32>,
    /// This step's probe: a draft checked against the pending token's row, not an input row.
    pub(super) probe: Option<u32>,
}

/// The event that ends `r` without a token (a cancellation).
pub(super) fn finish_message<B: Backend>(reason: SequenceFinish, r: &Running<B>) -> SchedulerEvent {
    SchedulerEvent {
        token: None,
        finish: Some(reason),
        prompt_tokens: r.request.prompt.len() as u32,
        completion_tokens: r.generated as u32,
        cached_tokens: r.cached_tokens as u32,
    }
}

/// Whether `r` still has prompt tokens to feed besides its last (which samples its first
/// token, a decode-sized row).
pub(super) fn has_prompt_work<B: Backend>(r: &Running<B>) -> bool {
    r.generated == 0 && r.pending.len() > 1
}

/// Ends every running sequence with `error` (a failed forward or read-back).
pub(super) fn fail_all<B: Backend>(running: &mut Vec<Running<B>>, error: &EngineError) {
    for r in running.drain(..) {
        fail(&r, error);
    }
}

/// Ends one sequence's stream with `error`.
pub(super) fn fail<B: Backend>(r: &Running<B>, error: &EngineError) {
    let error = match error {
        // The request's own settings leave nothing to sample (a constraint against its bans).
        EngineError::InvalidSampling { .. } => SchedulerError::InvalidRequest(error.to_string()),
        _ => SchedulerError::GenerationFailed(error.to_string()),
    };
    let _ = r.request.events.try_send(Err(error));
}
