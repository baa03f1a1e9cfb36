//! What the scheduler sends back on a request's channel: sampled tokens with their
//! log-probabilities, finish reasons, and the errors of refused or dropped requests.
//!
//! Owns: the scheduler's event and error types. Must not touch: transport (the gRPC service
//! converts them at its edge), scheduling.

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceFinish {
    /// It emitted one of its stop tokens (sent with the event).
    StopToken,
    /// `max_new_tokens` reached.
    Length,
    /// The sequence filled its context.
    ContextFull,
    /// Cancelled by request.
    Cancelled,
}

/// The log-probability of one token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenProbability {
    pub token_id: u32,
    pub logprob: f32,
}

/// A token the scheduler sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token_id: u32,
    pub logprob: f32,
    pub top_logprobs: Vec<TokenProbability>,
}

/// One step of a sequence: a token, an end, or both.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerEvent {
    /// `None` for an end without a token (cancellation).
    pub token: Option<SampledToken>,
    /// `Some` on the last event of the sequence.
    pub finish: Option<SequenceFinish>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens taken from the prefix cache instead of computed.
    pub cached_tokens: u32,
}

/// Why the scheduler refused or dropped a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchedulerError {
    /// The request itself is unusable (empty prompt, unknown token, bad sampling settings).
    #[error("{0}")]
    InvalidRequest(String),
    /// Prompt plus completion do not fit the context.
    #[error("prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} = {needed} exceeds the maximum context of {max_context} tokens", needed = prompt_tokens + max_new_tokens)]
    ContextExceeded {
        prompt_tokens: usize,
        max_new_tokens: usize,
        max_context: usize,
    },
    /// A scoring request has more tokens than the context holds.
    #[error("{tokens} tokens to score exceed the maximum context of {max_context} tokens (score it in windows of at most {max_context})")]
    ScoringContextExceeded { tokens: usize, max_context: usize },
    /// Every sequence slot is taken.
    #[error("the engine is running its maximum of {max_sequences} sequences; retry later")]
    Busy { max_sequences: usize },
    /// The forward pass failed; every running sequence is dropped.
    #[error("generation failed: {0}")]
    GenerationFailed(String),
}

/// What a request's event channel carries.
pub type SchedulerResult = Result<SchedulerEvent, SchedulerError>;
