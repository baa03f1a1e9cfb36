//! Scoring requests (`ScoreTokens`): the teacher-forced negative log-likelihood of a given
//! token sequence, computed by the scheduler's model between its generation steps.
//!
//! Owns: admission of a scoring request (length, vocabulary, slots), its sequence state, and one
//! chunk of its prefill per scheduler step (so a long text does not stall the sequences that
//! are generating). The NLL arithmetic is [`crate::perplexity::score_chunk`], the same code the
//! in-process perplexity runs, so both give the same bits for the same logits.
//! Must not touch: transport (the gRPC service converts [`ChunkScores`] and errors at its edge),
//! tokenization, windowing of texts longer than the context (the client's business).

use tokio::sync::mpsc as async_mpsc;

use crate::backend::Backend;
use crate::model::{Model, SequenceState};
use crate::perplexity::score_chunk;
use crate::service::scheduler::limits::SchedulerLimits;
use crate::service::scheduler::messages::SchedulerError;

/// Tokens per forward when the request leaves it to the engine.
pub const DEFAULT_SCORING_CHUNK_TOKENS: usize = 256;

/// The NLLs one chunk of a scoring request produced.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkScores {
    /// Index in the request's tokens of the token whose NLL is `nll[0]`.
    pub first_position: usize,
    /// NLL (nats) of the tokens from `first_position` on.
    pub nll: Vec<f64>,
    /// Tokens fed so far and in all.
    pub tokens_done: usize,
    pub tokens_total: usize,
}

/// What a scoring request's channel carries.
pub type ScoringResult = Result<ChunkScores, SchedulerError>;

/// One scoring request as the scheduler sees it.
pub struct ScoringRequest {
    pub request_id: String,
    pub tokens: Vec<u32>,
    /// Tokens per forward (0: [`DEFAULT_SCORING_CHUNK_TOKENS`]).
    pub chunk_tokens: usize,
    pub scores: async_mpsc::Sender<ScoringResult>,
}

/// An admitted scoring request and its sequence.
pub struct Scoring<B: Backend> {
    pub request: ScoringRequest,
    state: SequenceState<B>,
    /// Tokens already fed.
    fed: usize,
}

impl<B: Backend> Scoring<B> {
    /// Checks `request` against the model and the limits (`slots_taken`: sequences running or
    /// scoring now) and allocates its sequence; a refusal is sent on the request's channel.
    pub fn admit(
        model: &Model<B>,
        request: ScoringRequest,
        limits: SchedulerLimits,
        slots_taken: usize,
    ) -> Option<Self> {
        let refusal = refusal(&request, model.vocab_size(), limits, slots_taken);
        if let Some(error) = refusal {
            let _ = request.scores.try_send(Err(error));
            return None;
        }
        match model.new_sequence(request.tokens.len()) {
            Ok(state) => Some(Scoring {
                request,
                state,
                fed: 0,
            }),
            Err(error) => {
                let _ = request
                    .scores
                    .try_send(Err(SchedulerError::GenerationFailed(error.to_string())));
                None
            }
        }
    }

    /// Tokens held in the sequence's KV cache.
    pub fn position(&self) -> usize {
        self.state.position()
    }

    /// Feeds the next chunk and sends its NLLs; `true` when the request is over (every token
    /// fed, the forward failed, or the client went away).
    pub fn step(&mut self, model: &Model<B>) -> bool {
        let total = self.request.tokens.len();
        let chunk = match self.request.chunk_tokens {
            0 => DEFAULT_SCORING_CHUNK_TOKENS,
            n => n,
        };
        let end = (self.fed + chunk).min(total);
        let scored = score_chunk(model, &mut self.state, &self.request.tokens, self.fed..end);
        let message = match scored {
            Ok(nll) => Ok(ChunkScores {
                first_position: self.fed + 1,
                nll,
                tokens_done: end,
                tokens_total: total,
            }),
            Err(error) => {
                tracing::error!(request_id = %self.request.request_id, "scoring failed: {error}");
                let _ = self
                    .request
                    .scores
                    .try_send(Err(SchedulerError::GenerationFailed(error.to_string())));
                return true;
            }
        };
        self.fed = end;
        // The gRPC layer keeps a deep buffer; a full one means a stalled client, treated as gone.
        self.request.scores.try_send(message).is_err() || self.fed >= total
    }
}

/// Why `request` cannot be scored, if it cannot.
fn refusal(
    request: &ScoringRequest,
    vocab: usize,
    limits: SchedulerLimits,
    slots_taken: usize,
) -> Option<SchedulerError> {
    let tokens = &request.tokens;
    if tokens.len() < 2 {
        return Some(SchedulerError::InvalidRequest(format!(
            "scoring needs at least 2 tokens (the first is context only), got {}",
            tokens.len()
        )));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Some(SchedulerError::InvalidRequest(format!(
            "token id {bad} is outside the vocabulary of {vocab} tokens"
        )));
    }
    if tokens.len() > limits.max_context {
        return Some(SchedulerError::ScoringContextExceeded {
            tokens: tokens.len(),
            max_context: limits.max_context,
        });
    }
    if slots_taken >= limits.max_sequences {
        return Some(SchedulerError::Busy {
            max_sequences: limits.max_sequences,
        });
    }
    None
}
