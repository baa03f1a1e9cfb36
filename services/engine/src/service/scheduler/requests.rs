//! What the scheduler is asked: a generation request as it sees one (with its prompt's images
//! already encoded), and the commands its channel carries (submit, score, cancel).
//!
//! Owns: the request and command types. Must not touch: admission (`admission.rs`),
//! scheduling.

use tokio::sync::mpsc as async_mpsc;

use super::messages::SchedulerResult;
use crate::constraint::Guide;
use crate::sampling::SamplingParams;
use crate::service::scoring::ScoringRequest;

/// One generation request as the scheduler sees it.
pub struct GenerationRequest {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_token_ids: Vec<u32>,
    pub top_logprobs: usize,
    /// Ids at or above this are never sampled: a model's embedding rows are often padded past
    /// its tokenizer (to a multiple of 64 or 128), and those ids decode to nothing. 0 or more
    /// than the model's vocabulary: the whole vocabulary.
    pub sampleable_vocabulary: usize,
    /// `(token, bias)` added to the logits before sampling. A biased request samples from whole
    /// rows (the candidates are the unbiased largest logits).
    pub logit_bias: Vec<(u32, f32)>,
    /// The output grammar and reasoning block, if any: a guided step samples from its whole
    /// row, masked to what the guide allows. Guided requests do not speculate.
    pub guide: Option<Box<Guide>>,
    /// Most MTP drafts per step for this request, capped by the engine's; `None`: the
    /// engine's. 0 turns speculation off for it.
    pub draft_tokens: Option<usize>,
    /// The prompt's images, encoded ([`crate::service::images`]): attached to the sequence
    /// before its prompt is fed or its prefix looked up.
    pub images: Option<PromptImages>,
    pub events: async_mpsc::Sender<SchedulerResult>,
}

/// A prompt's images as the vision tower encoded them: each image's grid, in the order of
/// the prompt's placeholder runs, and the image tokens' embeddings (`[tokens, hidden]`).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptImages {
    pub grids: Vec<crate::vision::ImageGrid>,
    pub embeddings: Vec<f32>,
}

pub enum SchedulerCommand {
    Submit(GenerationRequest),
    /// A teacher-forced scoring request (see [`crate::service::scoring`]).
    Score(ScoringRequest),
    Cancel(String, tokio::sync::oneshot::Sender<bool>),
}
