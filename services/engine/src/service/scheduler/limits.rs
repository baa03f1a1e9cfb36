//! The scheduler's settings: admission limits, a long prompt's chunking and time share, and the
//! cap on MTP drafts, with their defaults.
//!
//! Owns: the settings types and defaults. Must not touch: how they are applied (admission,
//! the prompt time share, speculative stepping).

/// Most MTP drafts per step the engine takes (`--draft-tokens`).
pub const MAX_DRAFT_TOKENS: usize = 8;

/// Speculative decoding with the model's MTP head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpeculativeDecoding {
    /// Most drafts per step and sequence, at most [`MAX_DRAFT_TOKENS`] (0: off). Each
    /// sequence drafts fewer while its drafts are rejected ([`DraftController`](crate::model::DraftController)).
    pub max_draft_tokens: usize,
}

/// Limits of admission, and the bound on a long prompt's work per step.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerLimits {
    pub max_context: usize,
    pub max_sequences: usize,
    /// While other sequences are running, at most this many prompt tokens go through the model
    /// per scheduler step: a longer prompt is fed in chunks of this size, one chunk per step,
    /// each step also running the other sequences' decode. 0: prompts go whole.
    pub prefill_chunk_tokens: usize,
    /// While other sequences decode, the most of the wall time that prompt work (chunks, and
    /// steps a prompt's rest joins) may take, in (0, 1] ([`PrefillShare`](super::PrefillShare)); 1: a chunk every
    /// step.
    pub prefill_time_share: f64,
}

/// [`SchedulerLimits::prefill_time_share`] by default: a running stream decodes at more than
/// half its solo speed while a long prompt is prefilled (decode steps take at least 55% of
/// the time, each a little slower than alone beside the chunks' cache traffic).
pub const DEFAULT_PREFILL_TIME_SHARE: f64 = 0.45;

/// [`SchedulerLimits::prefill_chunk_tokens`] by default: a chunk's forward is a fraction of a
/// second at prefill speed on a GPU, and big enough that layerwise prefill's per-forward copy
/// of every layer's experts is spread over many tokens.
pub const DEFAULT_PREFILL_CHUNK_TOKENS: usize = 4096;
