//! The scheduler actor: one thread owns the model and every running sequence; requests arrive on
//! a channel and join the running batch at the next step (continuous batching: a new request's
//! prefill runs in the same forward as the others' decode steps).
//!
//! Owns: admission (context and queue limits), per-sequence state, sampling, finish reasons,
//! cancellation (explicit, or the client's stream going away), and its own event and error types
//! ([`SchedulerEvent`], [`SchedulerError`]).
//! With speculative decoding ([`start_speculative`]) a sequence drafts tokens with the model's
//! MTP head, verifies them in the same batched forward as the other sequences' steps and emits
//! every accepted draft and the main model's next token; sequences that do not speculate (a
//! guided request, a request that turned it off) batch with them unchanged.
//! Must not touch: transport (the gRPC service converts the events and errors to messages and
//! statuses at its edge), text.
//!
//! Long prompts beside decoding sequences: while a sequence decodes, a prompt longer than
//! [`SchedulerLimits::prefill_chunk_tokens`] goes through the model in chunks of at most that
//! many tokens, each in a forward of its own, and prompt work takes at most
//! [`SchedulerLimits::prefill_time_share`] of the wall time ([`PrefillShare`]): after a chunk
//! (or a step that a prompt's rest joined) the prompts sit out decode-only steps until those
//! have taken `(1 − share) / share` times the prompt work's wall time. A prompt chunk costs far
//! more than a decode step (a chunk of even 64 tokens touches nearly all of a MoE layer's
//! experts), so a smaller chunk alone would not keep a stream decoding. With nothing decoding,
//! prompts go whole (or, several arriving at once, in chunks one step after another).
//! Invariants (tests in this module): the decoding stream gets a token between any two chunks,
//! and a chunked prompt's greedy tokens are those of the prompt fed whole
//! (`a_long_prompt_goes_in_chunks_while_a_stream_keeps_decoding`,
//! `a_time_shared_prompt_keeps_its_tokens_and_the_stream_decodes_between_chunks`); prompt
//! work's share of the time is held by the accounting (`prefill_share_*`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc as async_mpsc;

use crate::backend::candidates::{DEFAULT_CANDIDATES, MAX_CANDIDATES};
use crate::backend::DeltaRuleForm;
use crate::backend::{Backend, KvPlacement, LogitCandidates};
use crate::constraint::{Allowed, Guide};
use crate::error::EngineError;
use crate::model::{
    pick_draft, probe_draft, verify_drafts, DraftController, DraftPlan, DraftToken, Model,
    MtpState, SequenceCheckpoint, SequenceInput, SequenceState,
};
use crate::prefix_cache::{PrefixCache, PrefixCacheCounters, PrefixCacheSettings};
use crate::sampling::{Sampler, SamplingParams, Xoshiro256};
use crate::service::scoring::{Scoring, ScoringRequest};
use crate::spec::MixerKind;

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
    pub events: async_mpsc::Sender<SchedulerResult>,
}

pub enum SchedulerCommand {
    Submit(GenerationRequest),
    /// A teacher-forced scoring request (see [`crate::service::scoring`]).
    Score(ScoringRequest),
    Cancel(String, tokio::sync::oneshot::Sender<bool>),
}

/// Counters the status RPC reports.
#[derive(Default)]
pub struct SchedulerCounters {
    /// The prefix cache's counters (all zero while it is off).
    pub prefix_cache: Arc<PrefixCacheCounters>,
    pub running: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub kv_used_tokens: AtomicU64,
    /// Verification steps of sequences that drafted, probes included.
    pub speculative_steps: AtomicU64,
    /// Probes (one draft checked against the pending token's row; counted at depth 1 too) and
    /// those whose draft was accepted (each yields one token, not two).
    pub probes: AtomicU64,
    pub accepted_probes: AtomicU64,
    /// `drafted_at_depth[j]`: drafts made at depth `j + 1` of a chain.
    pub drafted_at_depth: [AtomicU64; MAX_DRAFT_TOKENS],
    /// `accepted_at_depth[j]`: chains whose drafts `1..=j + 1` were all accepted.
    pub accepted_at_depth: [AtomicU64; MAX_DRAFT_TOKENS],
}

impl SchedulerCounters {
    /// Counts one verification of `drafted` drafts whose first `accepted` were accepted.
    pub fn record_verification(&self, drafted: usize, accepted: usize) {
        self.speculative_steps.fetch_add(1, Ordering::Relaxed);
        for depth in 0..drafted.min(MAX_DRAFT_TOKENS) {
            self.drafted_at_depth[depth].fetch_add(1, Ordering::Relaxed);
            if depth < accepted {
                self.accepted_at_depth[depth].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Counts one probe ([`DraftPlan::Probe`]), accepted or not.
    pub fn record_probe(&self, accepted: bool) {
        self.record_verification(1, usize::from(accepted));
        self.probes.fetch_add(1, Ordering::Relaxed);
        self.accepted_probes
            .fetch_add(u64::from(accepted), Ordering::Relaxed);
    }

    /// `(drafted, accepted)` over every depth.
    pub fn draft_totals(&self) -> (u64, u64) {
        let sum = |counters: &[AtomicU64]| {
            counters
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .sum::<u64>()
        };
        (sum(&self.drafted_at_depth), sum(&self.accepted_at_depth))
    }

    /// Logs the drafts' acceptance overall and per depth (nothing when no sequence drafted).
    pub fn log_speculation_summary(&self) {
        let (drafted, accepted) = self.draft_totals();
        let steps = self.speculative_steps.load(Ordering::Relaxed);
        let (probes, accepted_probes) = (
            self.probes.load(Ordering::Relaxed),
            self.accepted_probes.load(Ordering::Relaxed),
        );
        if drafted == 0 {
            return;
        }
        let per_depth: Vec<String> = self
            .drafted_at_depth
            .iter()
            .zip(&self.accepted_at_depth)
            .map(|(d, a)| (d.load(Ordering::Relaxed), a.load(Ordering::Relaxed)))
            .take_while(|&(d, _)| d > 0)
            .map(|(d, a)| format!("{:.1}%", 100.0 * a as f64 / d as f64))
            .collect();
        tracing::info!(
            drafted,
            accepted,
            acceptance = format!("{:.1}%", 100.0 * accepted as f64 / drafted as f64),
            acceptance_per_depth = per_depth.join(" "),
            probes,
            // An accepted probe's draft is its step's one token.
            tokens_per_speculative_step = format!(
                "{:.2}",
                (steps + accepted - accepted_probes.min(accepted)) as f64 / steps.max(1) as f64
            ),
            "MTP speculative decoding"
        );
    }
}

/// Most MTP drafts per step the engine takes (`--draft-tokens`).
pub const MAX_DRAFT_TOKENS: usize = 8;

/// Speculative decoding with the model's MTP head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpeculativeDecoding {
    /// Most drafts per step and sequence, at most [`MAX_DRAFT_TOKENS`] (0: off). Each
    /// sequence drafts fewer while its drafts are rejected ([`DraftController`]).
    pub max_draft_tokens: usize,
}

/// Verified pairs a sequence that is not drafting keeps for the MTP head before feeding them
/// to it anyway (bounds the host memory they take).
const PAIRS_HELD_WITHOUT_DRAFTS: usize = 64;

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
    /// steps a prompt's rest joins) may take, in (0, 1] ([`PrefillShare`]); 1: a chunk every
    /// step.
    pub prefill_time_share: f64,
}

/// [`SchedulerLimits::prefill_time_share`] by default: a running stream decodes at more than
/// half its solo speed while a long prompt is prefilled (decode steps take at least 55% of
/// the time, each a little slower than alone beside the chunks' cache traffic).
pub const DEFAULT_PREFILL_TIME_SHARE: f64 = 0.45;

/// Debt of decode time below which [`PrefillShare`] counts it paid.
const PREFILL_SHARE_ROUNDING_SECONDS: f64 = 1e-6;

/// The time-share rule between prompt work and decode steps while both exist.
///
/// Prompt work (a prompt chunk's own forward, or a generation step that a prompt's rest
/// joins) that ran beside decoding sequences adds its wall time × `(1 − share) / share` to a
/// debt of decode time; each decode-only step pays its wall time off the debt, never below
/// zero. Prompt work may run only while nothing is owed, so the first chunk runs at once and
/// each later one waits until the decode steps since the last have taken `(1 − share) /
/// share` of its time: the cumulative rule `prompt time ≤ share / (1 − share) × decode time`
/// with no credit banked (decode time with no prompt waiting never pays for a later
/// prompt's chunks), overshooting by at most one decode step per chunk. With nothing
/// decoding there is nothing to protect and the debt is forgotten ([`PrefillShare::reset`]).
/// Share 1: no debt ever, a chunk every step.
#[derive(Debug, Clone)]
pub struct PrefillShare {
    /// Decode seconds owed per second of prompt work: `(1 − share) / share`.
    decode_per_prefill: f64,
    /// Decode seconds still owed before the next prompt work.
    owed: f64,
}

impl PrefillShare {
    /// `share` in (0, 1]; anything else is taken as 1 (flags are checked where parsed).
    pub fn new(share: f64) -> Self {
        let share = if share > 0.0 && share <= 1.0 {
            share
        } else {
            1.0
        };
        PrefillShare {
            decode_per_prefill: (1.0 - share) / share,
            owed: 0.0,
        }
    }

    /// Whether prompt work may run beside the decoding sequences now (a debt under a
    /// microsecond is rounding left by paying seconds off in floating point).
    pub fn may_prefill(&self) -> bool {
        self.owed <= PREFILL_SHARE_ROUNDING_SECONDS
    }

    /// Prompt work that took `took` beside decoding sequences.
    pub fn record_prefill(&mut self, took: Duration) {
        self.owed += took.as_secs_f64() * self.decode_per_prefill;
    }

    /// A decode-only step that took `took`.
    pub fn record_decode(&mut self, took: Duration) {
        self.owed = (self.owed - took.as_secs_f64()).max(0.0);
    }

    /// Nothing is decoding: what was owed is forgotten.
    pub fn reset(&mut self) {
        self.owed = 0.0;
    }

    /// Decode time still owed before the next prompt work.
    pub fn owed(&self) -> Duration {
        Duration::from_secs_f64(self.owed)
    }
}

/// [`SchedulerLimits::prefill_chunk_tokens`] by default: a chunk's forward is a fraction of a
/// second at prefill speed on a GPU, and big enough that layerwise prefill's per-forward copy
/// of every layer's experts is spread over many tokens.
pub const DEFAULT_PREFILL_CHUNK_TOKENS: usize = 4096;

struct Running<B: Backend> {
    request: GenerationRequest,
    state: SequenceState<B>,
    /// Prompt tokens the prefix cache gave the sequence.
    cached_tokens: usize,
    /// Whether the prefix cache has been given the whole prompt's blocks.
    prompt_recorded: bool,
    sampler: Sampler,
    history: Vec<u32>,
    /// The next forward's input: the prompt, or the last token and this step's drafts.
    pending: Vec<u32>,
    generated: usize,
    guide: Option<Box<Guide>>,
    speculating: Option<Speculating<B>>,
}

/// A speculating sequence's MTP side.
struct Speculating<B: Backend> {
    mtp: MtpState<B>,
    controller: DraftController,
    /// Draws of the drafts and of the rejection rule (the sampler keeps its own stream).
    rng: Xoshiro256,
    /// Pairs the MTP head has not seen: the main model's final-normed hidden rows (host,
    /// `[rows, hidden]`) and the token after each.
    pair_hidden: Vec<f32>,
    pair_tokens: Vec<u32>,
    /// This step's drafts (the tail of `pending`).
    drafts: Vec<DraftToken>,
    /// This step's probe: a draft checked against the pending token's row, not an input row.
    probe: Option<DraftToken>,
}

/// What admission checks against.
struct Admission {
    limits: SchedulerLimits,
    speculation: SpeculativeDecoding,
    vocab: usize,
}

/// Starts the scheduler thread; returns the command sender.
pub fn start<B: Backend + 'static>(
    model: Arc<Model<B>>,
    limits: SchedulerLimits,
    counters: Arc<SchedulerCounters>,
) -> std::io::Result<mpsc::Sender<SchedulerCommand>>
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    start_speculative(model, limits, SpeculativeDecoding::default(), counters)
}

/// [`start_speculative`] without a prefix cache.
pub fn start_speculative<B: Backend + 'static>(
    model: Arc<Model<B>>,
    limits: SchedulerLimits,
    speculation: SpeculativeDecoding,
    counters: Arc<SchedulerCounters>,
) -> std::io::Result<mpsc::Sender<SchedulerCommand>>
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    start_serving(
        model,
        limits,
        speculation,
        PrefixCacheSettings::off(),
        counters,
    )
}

/// [`start`] with speculative decoding (requests draft with the model's MTP head; the caller
/// checks that the model has one, without it requests do not speculate) and a prefix cache
/// (prompts reuse what earlier prompts computed; off with a zero budget).
pub fn start_serving<B: Backend + 'static>(
    model: Arc<Model<B>>,
    limits: SchedulerLimits,
    speculation: SpeculativeDecoding,
    prefix_cache: PrefixCacheSettings,
    counters: Arc<SchedulerCounters>,
) -> std::io::Result<mpsc::Sender<SchedulerCommand>>
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let speculation = SpeculativeDecoding {
        max_draft_tokens: if model.has_mtp() {
            speculation.max_draft_tokens.min(MAX_DRAFT_TOKENS)
        } else {
            0
        },
    };
    let (sender, receiver) = mpsc::channel();
    std::thread::Builder::new()
        .name("ninfer-scheduler".into())
        .spawn(move || {
            let prefix = PrefixCache::new(&model, prefix_cache, Arc::clone(&counters.prefix_cache));
            run(&model, limits, speculation, prefix, &counters, &receiver)
        })?;
    Ok(sender)
}

fn finish_message<B: Backend>(reason: SequenceFinish, r: &Running<B>) -> SchedulerEvent {
    SchedulerEvent {
        token: None,
        finish: Some(reason),
        prompt_tokens: r.request.prompt.len() as u32,
        completion_tokens: r.generated as u32,
        cached_tokens: r.cached_tokens as u32,
    }
}

fn run<B: Backend>(
    model: &Model<B>,
    limits: SchedulerLimits,
    speculation: SpeculativeDecoding,
    mut prefix: Option<PrefixCache<B>>,
    counters: &SchedulerCounters,
    commands: &mpsc::Receiver<SchedulerCommand>,
) {
    let vocab = model.vocab_size();
    let admission = Admission {
        limits,
        speculation,
        vocab,
    };
    let mut running: Vec<Running<B>> = Vec::new();
    let mut share = PrefillShare::new(limits.prefill_time_share);
    // Scoring requests, first come first served: one chunk of the first per step.
    let mut scoring: std::collections::VecDeque<Scoring<B>> = std::collections::VecDeque::new();
    loop {
        // Block only when idle; otherwise take what arrived and go on decoding.
        if running.is_empty() && scoring.is_empty() {
            match commands.recv() {
                Ok(command) => handle(
                    model,
                    command,
                    &mut running,
                    &mut scoring,
                    &admission,
                    prefix.as_mut(),
                    counters,
                ),
                Err(_) => return,
            }
        }
        while let Ok(command) = commands.try_recv() {
            handle(
                model,
                command,
                &mut running,
                &mut scoring,
                &admission,
                prefix.as_mut(),
                counters,
            );
        }
        // A client that went away cancels its sequence.
        running.retain(|r| !r.request.events.is_closed());
        scoring.retain(|s| !s.request.scores.is_closed());
        counters
            .running
            .store(running.len() + scoring.len(), Ordering::Relaxed);
        // One chunk of a scoring request in its own forward (it keeps every position's
        // logits, the generating sequences only their last), then the generation step.
        if let Some(first) = scoring.front_mut() {
            if first.step(model) {
                scoring.pop_front();
            }
        }
        // Prompts past this step's budget of prompt tokens sit out the step (after a chunk,
        // if some budget is left), so the others' decode steps keep coming; beside decoding
        // sequences, every prompt sits out while prompt work has had its share of the time.
        let decoding = running.iter().any(|r| r.generated > 0);
        if !decoding {
            share.reset();
        }
        let (held, mut chunks_took) = feed_prompt_chunks(
            model,
            &mut running,
            limits.prefill_chunk_tokens,
            !decoding || share.may_prefill(),
            prefix.as_mut(),
        );
        if let Some(cache) = prefix.as_mut() {
            let started = Instant::now();
            feed_to_checkpoints(model, &mut running, cache);
            chunks_took += started.elapsed();
        }
        if decoding && chunks_took > Duration::ZERO {
            share.record_prefill(chunks_took);
        }
        if !running.is_empty() {
            let with_prompt = running.iter().any(has_prompt_work);
            let started = Instant::now();
            generation_step(model, &mut running, speculation, prefix.as_mut(), counters);
            if let Some(cache) = prefix.as_mut() {
                for r in running.iter_mut() {
                    record_prompt(model, cache, r);
                }
            }
            if decoding {
                if with_prompt {
                    share.record_prefill(started.elapsed());
                } else {
                    share.record_decode(started.elapsed());
                }
            }
        }
        running.extend(held);
        let kv_used: u64 = running
            .iter()
            .map(|r| r.state.position() as u64)
            .sum::<u64>()
            + scoring.iter().map(|s| s.position() as u64).sum::<u64>();
        counters.kv_used_tokens.store(kv_used, Ordering::Relaxed);
        counters
            .running
            .store(running.len() + scoring.len(), Ordering::Relaxed);
    }
}

/// Whether `r` still has prompt tokens to feed besides its last (which samples its first
/// token, a decode-sized row).
fn has_prompt_work<B: Backend>(r: &Running<B>) -> bool {
    r.generated == 0 && r.pending.len() > 1
}

/// Feeds the prompts that do not fit this step's budget of `chunk_tokens` prompt tokens one
/// chunk (while budget lasts, first come first served) and takes them out of `running` for
/// this step: a prompt that fits joins the step whole, as do decode rows. Nothing is held
/// while a sequence runs alone (its prompt goes whole) or with `chunk_tokens` 0. A prompt's
/// last token always joins a step, which samples its first token. Without `may_prefill` (the
/// time share's verdict) every prompt with work left sits out the step, no chunk runs.
/// Returns the held sequences and the wall time of the chunk forwards.
fn feed_prompt_chunks<B: Backend>(
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
    let chunk = r.pending.get(..take).unwrap_or_default().to_vec();
    let mut batch = [SequenceInput {
        state: &mut r.state,
        tokens: &chunk,
    }];
    let hidden = model.forward_hidden(&mut batch, None)?;
    if let Some(s) = r.speculating.as_mut() {
        s.pair_hidden.extend(model.backend().download(&hidden)?);
        s.pair_tokens
            .extend_from_slice(r.pending.get(1..=take).unwrap_or_default());
    }
    r.pending.drain(..take.min(r.pending.len()));
    Ok(())
}

/// Puts the longest reusable cached prefix of `request`'s prompt into the fresh `state` and
/// returns its tokens. A restore that fails leaves a new empty state (the prompt is computed
/// whole) rather than failing the request; only making that state can fail.
fn reuse_prefix<B: Backend>(
    model: &Model<B>,
    cache: &mut PrefixCache<B>,
    state: &mut SequenceState<B>,
    request: &GenerationRequest,
    needed: usize,
) -> Result<usize, EngineError> {
    match cache.restore(model, state, &request.prompt) {
        Ok(cached) => Ok(cached),
        Err(error) => {
            tracing::warn!(request_id = %request.request_id, "prefix cache: restoring failed, the prompt is computed whole: {error}");
            *state = model.new_sequence(needed)?;
            Ok(0)
        }
    }
}

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
/// forward per piece, and gives the cache the blocks and states there (what a forward cannot
/// keep from its middle); the rest of the prompt joins the generation step as usual.
fn feed_to_checkpoints<B: Backend>(
    model: &Model<B>,
    running: &mut Vec<Running<B>>,
    cache: &mut PrefixCache<B>,
) {
    let mut index = 0;
    while index < running.len() {
        let r = &mut running[index];
        let prompt = r.request.prompt.len();
        let mut fed = Ok(());
        while let Some(end) = has_prompt_work(r)
            .then(|| cache.next_checkpoint(r.state.position(), prompt))
            .flatten()
        {
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

/// Gives the prefix cache the prompt blocks `r` holds (a failure costs only later reuse).
fn record_blocks<B: Backend>(model: &Model<B>, cache: &mut PrefixCache<B>, r: &Running<B>) {
    if let Err(error) = cache.record(model, &r.state, &r.request.prompt) {
        tracing::warn!(request_id = %r.request.request_id, "prefix cache: keeping prompt blocks failed: {error}");
    }
}

/// Once `r`'s whole prompt went through the model, gives the prefix cache its blocks.
fn record_prompt<B: Backend>(model: &Model<B>, cache: &mut PrefixCache<B>, r: &mut Running<B>) {
    if !r.prompt_recorded && r.state.position() >= r.request.prompt.len() {
        r.prompt_recorded = true;
        record_blocks(model, cache, r);
    }
}

/// One generation step of `running` (not empty): drafts, grammar masks, the forward, the
/// sampled tokens; sequences that end leave `running`.
fn generation_step<B: Backend>(
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

/// Samples one token for each of `members` (indices into `running`) from `logits` (row `i`:
/// the last position of `running[members[i]]`), sends the events and pushes the sequences that
/// end (finished, failed, or gone) to `finished`. `Err`: the logits could not be read back.
fn sample_rows<B: Backend>(
    model: &Model<B>,
    running: &mut [Running<B>],
    members: &[usize],
    logits: &B::Tensor,
    allowed: &[Allowed],
    counters: &SchedulerCounters,
    finished: &mut Vec<usize>,
) -> Result<(), EngineError> {
    let vocab = model.vocab_size();
    let backend = model.backend();
    // Sampling on the backend's candidates when every request allows it (a few KB per
    // token read back instead of the whole logits rows). Guided rows are read whole.
    let candidate_k = candidate_count(running, members, allowed);
    let extra: Vec<Vec<u32>> = match candidate_k {
        Some(_) => members
            .iter()
            .map(|&index| {
                let r = &running[index];
                r.sampler.penalised_tokens(&r.history, vocab)
            })
            .collect(),
        None => Vec::new(),
    };
    let candidates = candidate_k.and_then(|k| {
        backend
            .logit_candidates(logits, k, &extra)
            .map_err(|error| {
                tracing::warn!("logit candidates failed, sampling from the whole rows: {error}")
            })
            .ok()
    });
    // Without candidates every row comes back at once, as one read-back.
    let all_rows = candidates
        .is_none()
        .then(|| backend.download(logits))
        .transpose()
        .inspect_err(|error| tracing::error!("reading the logits back failed: {error}"))?;
    let row_of = |row: usize| match &all_rows {
        Some(values) => Ok(values
            .get(row * vocab..(row + 1) * vocab)
            .map(<[f32]>::to_vec)
            .unwrap_or_default()),
        None => backend.download(&backend.gather_rows(logits, &[row])?),
    };
    for (logits_row, &index) in members.iter().enumerate() {
        let r = &mut running[index];
        let sampleable = sampleable_vocabulary(r.request.sampleable_vocabulary, vocab);
        let step = &allowed[index];
        let masked_candidates = candidates
            .as_ref()
            .filter(|_| step.is_any())
            .and_then(|c| c.get(logits_row))
            .map(|c| without_unsampleable(c, sampleable));
        let row_candidates = masked_candidates.as_deref();
        let mut row: Option<Vec<f32>> = None;
        let logit_bias = &r.request.logit_bias;
        let row_of = || {
            row_of(logits_row).and_then(|mut row| {
                apply_logit_bias(&mut row, logit_bias);
                mask_unsampleable(&mut row, sampleable);
                step.apply(&mut row)
                    .map_err(|error| EngineError::InvalidSampling {
                        problem: error.to_string(),
                    })?;
                Ok(row)
            })
        };
        let sampled = match row_candidates {
            Some(c) => r.sampler.sample_from_candidates(c, &r.history),
            None => Ok(None),
        };
        let sampled = match sampled {
            Ok(Some(token)) => Ok(token),
            Ok(None) => match row_of() {
                Ok(values) => r.sampler.sample(row.insert(values), &r.history),
                Err(error) => {
                    fail(r, &error);
                    finished.push(index);
                    continue;
                }
            },
            Err(error) => Err(error),
        };
        let token = match sampled {
            Ok(token) => token,
            Err(error) => {
                let _ = r
                    .request
                    .events
                    .try_send(Err(SchedulerError::InvalidRequest(error.to_string())));
                finished.push(index);
                continue;
            }
        };
        if let Some(guide) = r.guide.as_mut() {
            if let Err(error) = guide.accept(token) {
                let _ = r
                    .request
                    .events
                    .try_send(Err(SchedulerError::InvalidRequest(error.to_string())));
                finished.push(index);
                continue;
            }
        }
        let top_logprobs = r.request.top_logprobs;
        let (logprob, top) =
            match row_candidates.and_then(|c| candidate_logprobs(c, token, top_logprobs)) {
                Some(found) => found,
                None => {
                    let values = match row.take().map_or_else(row_of, Ok) {
                        Ok(values) => values,
                        Err(error) => {
                            fail(r, &error);
                            finished.push(index);
                            continue;
                        }
                    };
                    logprobs(&values, token, top_logprobs)
                }
            };
        r.pending.clear();
        r.pending.push(token);
        if !emit(r, token, logprob, top, counters) {
            finished.push(index);
        }
    }
    Ok(())
}

/// Counts `token` as generated and sends its event; `false` when the sequence ends with it (a
/// finish, or a client that no longer takes events).
fn emit<B: Backend>(
    r: &mut Running<B>,
    token: u32,
    logprob: f32,
    top_logprobs: Vec<TokenProbability>,
    counters: &SchedulerCounters,
) -> bool {
    r.generated += 1;
    r.history.push(token);
    counters.generated_tokens.fetch_add(1, Ordering::Relaxed);
    // The position the sequence would be at without drafts: the prompt and every generated
    // token but this one processed.
    let position = r.request.prompt.len() + r.generated - 1;
    let finish = if r.request.stop_token_ids.contains(&token) {
        Some(SequenceFinish::StopToken)
    } else if r.generated >= r.request.max_new_tokens {
        Some(SequenceFinish::Length)
    } else if position >= r.state.max_context() {
        Some(SequenceFinish::ContextFull)
    } else {
        None
    };
    let message = SchedulerEvent {
        token: Some(SampledToken {
            token_id: token,
            logprob,
            top_logprobs,
        }),
        finish,
        prompt_tokens: r.request.prompt.len() as u32,
        completion_tokens: r.generated as u32,
        cached_tokens: r.cached_tokens as u32,
    };
    // The gRPC layer keeps a deep buffer; a full one means a stalled client, treated as gone.
    r.request.events.try_send(Ok(message)).is_ok() && finish.is_none()
}

/// The request's bias and vocabulary limit on one logits row (what every speculative row gets
/// before a token is picked from it; guided requests do not speculate).
fn prepare_row(row: &mut [f32], request: &GenerationRequest, vocab: usize) {
    apply_logit_bias(row, &request.logit_bias);
    mask_unsampleable(
        row,
        sampleable_vocabulary(request.sampleable_vocabulary, vocab),
    );
}

/// Drafts this step's tokens of a speculating sequence with the MTP head and appends them to
/// its pending input: first the pairs the head has not seen (the main model's verified rows),
/// then a chain of drafts, each from the head's output for the one before. The chain's own
/// pairs are guesses and are cut off again; the next step pairs the verified rows. A step
/// without drafts holds its pairs back (up to [`PAIRS_HELD_WITHOUT_DRAFTS`]) and runs neither
/// the MTP layer nor the head; a probe's one draft is kept aside, not appended.
fn draft<B: Backend>(model: &Model<B>, r: &mut Running<B>) -> Result<(), EngineError> {
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
    let backend = model.backend();
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
        let drafted = pick_draft(sampler.params(), &row, &seen, &mut s.rng);
        let token = drafted.token;
        seen.push(token);
        s.drafts.push(drafted);
        if s.drafts.len() < count {
            chain = model.mtp_forward(&mut s.mtp, &chain, &[token])?;
        }
    }
    s.mtp.truncate(committed);
    if plan == DraftPlan::Probe {
        s.probe = s.drafts.pop();
    } else {
        pending.extend(s.drafts.iter().map(|d| d.token));
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
fn speculative_step<B: Backend>(
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
    let backend = model.backend();
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
                probe_draft(&mut r.sampler, &mut s.rng, row, &probe, &r.history)
                    .map_err(invalid)?;
            s.controller.record(1, usize::from(probe_accepted));
            counters.record_probe(probe_accepted);
            (0, token)
        }
        _ => {
            let (accepted, next) =
                verify_drafts(&mut r.sampler, &mut s.rng, &rows, &drafts, &r.history)
                    .map_err(invalid)?;
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
    let emitted = drafts[..accepted].iter().map(|d| d.token).chain([next]);
    for (row, token) in raw_rows.into_iter().zip(emitted) {
        let (logprob, top) = logprobs(row, token, r.request.top_logprobs);
        if !emit(r, token, logprob, top, counters) {
            return Ok(Verified::Ended);
        }
    }
    Ok(Verified::Continues { rollback })
}

/// Ends every running sequence with `error` (a failed forward or read-back).
fn fail_all<B: Backend>(running: &mut Vec<Running<B>>, error: &EngineError) {
    for r in running.drain(..) {
        fail(&r, error);
    }
}

/// Ends one sequence's stream with `error`.
fn fail<B: Backend>(r: &Running<B>, error: &EngineError) {
    let error = match error {
        // The request's own settings leave nothing to sample (a constraint against its bans).
        EngineError::InvalidSampling { .. } => SchedulerError::InvalidRequest(error.to_string()),
        _ => SchedulerError::GenerationFailed(error.to_string()),
    };
    let _ = r.request.events.try_send(Err(error));
}

fn handle<B: Backend>(
    model: &Model<B>,
    command: SchedulerCommand,
    running: &mut Vec<Running<B>>,
    scoring: &mut std::collections::VecDeque<Scoring<B>>,
    admission: &Admission,
    prefix: Option<&mut PrefixCache<B>>,
    counters: &SchedulerCounters,
) {
    let (limits, vocab) = (admission.limits, admission.vocab);
    match command {
        SchedulerCommand::Score(request) => {
            let slots_taken = running.len() + scoring.len();
            if let Some(admitted) = Scoring::admit(model, request, limits, slots_taken) {
                counters
                    .prompt_tokens
                    .fetch_add(admitted.request.tokens.len() as u64, Ordering::Relaxed);
                scoring.push_back(admitted);
            }
        }
        SchedulerCommand::Cancel(id, reply) => {
            // A scoring request ends with its stream closed (no finish message to send).
            let scored = scoring.iter().position(|s| s.request.request_id == id);
            if let Some(index) = scored {
                scoring.remove(index);
                let _ = reply.send(true);
                return;
            }
            let position = running.iter().position(|r| r.request.request_id == id);
            if let Some(index) = position {
                let r = running.swap_remove(index);
                let _ = r
                    .request
                    .events
                    .try_send(Ok(finish_message(SequenceFinish::Cancelled, &r)));
            }
            let _ = reply.send(position.is_some());
        }
        SchedulerCommand::Submit(request) => {
            let reject = |error: SchedulerError| {
                let _ = request.events.try_send(Err(error));
            };
            if request.prompt.is_empty() {
                return reject(SchedulerError::InvalidRequest(
                    "the prompt has no tokens".to_string(),
                ));
            }
            if let Some(&bad) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
                return reject(SchedulerError::InvalidRequest(format!(
                    "token id {bad} is outside the vocabulary of {vocab} tokens"
                )));
            }
            if request.max_new_tokens == 0 {
                return reject(SchedulerError::InvalidRequest(
                    "max_new_tokens must be at least 1".to_string(),
                ));
            }
            let needed = request.prompt.len() + request.max_new_tokens;
            if needed > limits.max_context {
                return reject(SchedulerError::ContextExceeded {
                    prompt_tokens: request.prompt.len(),
                    max_new_tokens: request.max_new_tokens,
                    max_context: limits.max_context,
                });
            }
            if running.len() + scoring.len() >= limits.max_sequences {
                return reject(SchedulerError::Busy {
                    max_sequences: limits.max_sequences,
                });
            }
            let sampler = match Sampler::new(request.sampling.clone()) {
                Ok(sampler) => sampler,
                Err(error) => return reject(SchedulerError::InvalidRequest(error.to_string())),
            };
            counters
                .prompt_tokens
                .fetch_add(request.prompt.len() as u64, Ordering::Relaxed);
            let before = model.backend().kv_placement();
            let state = match model.new_sequence(needed) {
                Ok(state) => state,
                Err(error) => return reject(SchedulerError::GenerationFailed(error.to_string())),
            };
            log_host_kv(model, before, &request.request_id);
            let max_drafts = admission.speculation.max_draft_tokens;
            let drafts = request
                .draft_tokens
                .map_or(max_drafts, |n| n.min(max_drafts));
            let speculating = if drafts > 0 && request.guide.is_none() {
                match model.new_mtp_state(needed + drafts + 1) {
                    Ok(mtp) => Some(Speculating {
                        mtp,
                        controller: DraftController::new(drafts),
                        rng: Xoshiro256::seed_from_u64(request.sampling.seed ^ DRAFT_STREAM),
                        pair_hidden: Vec::new(),
                        pair_tokens: Vec::new(),
                        drafts: Vec::new(),
                        probe: None,
                    }),
                    Err(error) => {
                        return reject(SchedulerError::GenerationFailed(error.to_string()))
                    }
                }
            } else {
                None
            };
            let mut state = state;
            // A speculating sequence's MTP head needs every prompt position's pair, so it
            // computes its whole prompt (it still gives the cache its blocks).
            let cached_tokens = match (prefix, &speculating) {
                (Some(cache), None) => {
                    match reuse_prefix(model, cache, &mut state, &request, needed) {
                        Ok(cached) => cached,
                        Err(error) => {
                            return reject(SchedulerError::GenerationFailed(error.to_string()))
                        }
                    }
                }
                _ => 0,
            };
            let mut request = request;
            let guide = request.guide.take();
            running.push(Running {
                guide,
                history: request.prompt.clone(),
                pending: request.prompt[cached_tokens..].to_vec(),
                cached_tokens,
                prompt_recorded: false,
                request,
                state,
                sampler,
                generated: 0,
                speculating,
            });
        }
    }
}

/// Mixed into a request's seed for its drafts' stream, so it differs from the sampler's.
const DRAFT_STREAM: u64 = 0x9e37_79b9_7f4a_7c15;

/// The number of ids a request may sample: its limit, or the whole vocabulary.
fn sampleable_vocabulary(requested: usize, vocab: usize) -> usize {
    if requested == 0 {
        vocab
    } else {
        requested.min(vocab)
    }
}

/// Adds each `(token, bias)` to the row. As OpenAI documents `logit_bias`, -100 bans a token
/// and 100 selects it exclusively (among the tokens biased by 100) whatever the temperature:
/// those become −∞ for the banned, and for everything else respectively.
fn apply_logit_bias(row: &mut [f32], logit_bias: &[(u32, f32)]) {
    if logit_bias.is_empty() {
        return;
    }
    let exclusive: Vec<u32> = logit_bias
        .iter()
        .filter(|(_, bias)| *bias >= 100.0)
        .map(|&(token, _)| token)
        .collect();
    if !exclusive.is_empty() {
        for (token, logit) in row.iter_mut().enumerate() {
            if !exclusive.contains(&(token as u32)) {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
    for &(token, bias) in logit_bias {
        if let Some(logit) = row.get_mut(token as usize) {
            *logit = if bias <= -100.0 {
                f32::NEG_INFINITY
            } else if bias >= 100.0 {
                *logit
            } else {
                *logit + bias
            };
        }
    }
}

/// Sets the logits of ids at or above `sampleable` to −∞, so no sampler can pick them.
fn mask_unsampleable(row: &mut [f32], sampleable: usize) {
    if let Some(padded) = row.get_mut(sampleable..) {
        padded.fill(f32::NEG_INFINITY);
    }
}

/// `candidates` without ids at or above `sampleable`. Sampling from what is left stays exact:
/// masked ids sort after every other token, so dropping them removes nothing a sampler could
/// pick. (`log_sum_exp` still counts their mass, so logprobs from candidates are those of the
/// unmasked row.)
fn without_unsampleable(
    candidates: &LogitCandidates,
    sampleable: usize,
) -> std::borrow::Cow<'_, LogitCandidates> {
    if sampleable >= candidates.vocab {
        return std::borrow::Cow::Borrowed(candidates);
    }
    let keep = |&(id, _): &(u32, f32)| (id as usize) < sampleable;
    std::borrow::Cow::Owned(LogitCandidates {
        vocab: candidates.vocab,
        top: candidates.top.iter().copied().filter(keep).collect(),
        max: candidates.max,
        log_sum_exp: candidates.log_sum_exp,
        extra: candidates.extra.iter().copied().filter(keep).collect(),
    })
}

/// With a host KV pool (`--host-kv-mib`): where the new sequence's KV caches went, and the
/// totals, when any of them is in host memory.
fn log_host_kv<B: Backend>(model: &Model<B>, before: Option<KvPlacement>, request_id: &str) {
    let (Some(before), Some(after)) = (before, model.backend().kv_placement()) else {
        return;
    };
    let host_layers = after.host_caches.saturating_sub(before.host_caches);
    if host_layers == 0 {
        return;
    }
    let mib = |bytes: u64| format!("{:.1}", bytes as f64 / (1u64 << 20) as f64);
    tracing::info!(
        request_id,
        host_layers,
        device_layers = after.device_caches.saturating_sub(before.device_caches),
        host_kv_mib = mib(after.host_bytes.saturating_sub(before.host_bytes)),
        total_host_layers = after.host_caches,
        total_host_kv_mib = mib(after.host_bytes),
        total_device_kv_mib = mib(after.device_bytes),
        pool_mib = mib(after.host_pool_bytes),
        "attention layers' KV caches in page-locked host memory"
    );
}

/// The number of largest logits to read back per row when every running request can sample
/// from candidates ([`Sampler::candidates_suffice`], `top_logprobs` within them), with room for
/// penalised tokens among them (`members`: the sequences whose rows are read); `None`: read
/// back whole rows. `NINFER_FULL_LOGITS=1` always
/// reads whole rows.
fn candidate_count<B: Backend>(
    running: &[Running<B>],
    members: &[usize],
    allowed: &[Allowed],
) -> Option<usize> {
    if std::env::var("NINFER_FULL_LOGITS").is_ok_and(|v| v == "1") {
        return None;
    }
    let mut needed = 1usize;
    for (r, step) in members
        .iter()
        .map(|&index| (&running[index], &allowed[index]))
    {
        if !step.is_any() {
            // Read whole on its own; the others keep their candidates.
            continue;
        }
        if !r.sampler.candidates_suffice(MAX_CANDIDATES)
            || r.request.top_logprobs > MAX_CANDIDATES
            || !r.request.logit_bias.is_empty()
        {
            return None;
        }
        let top_k = if r.sampler.params().temperature == 0.0 {
            1
        } else {
            r.sampler.params().top_k
        };
        needed = needed.max(top_k).max(r.request.top_logprobs);
    }
    Some(
        needed
            .saturating_mul(2)
            .clamp(DEFAULT_CANDIDATES, MAX_CANDIDATES),
    )
}

/// [`logprobs`] from a row's candidates: the same values when they carry `token` and the `top`
/// largest logits (else `None`: the caller reads the row).
fn candidate_logprobs(
    candidates: &LogitCandidates,
    token: u32,
    top: usize,
) -> Option<(f32, Vec<TokenProbability>)> {
    let log_sum = candidates.log_sum_exp;
    let logprob = candidates.logit(token)? - log_sum;
    let top = if candidates.covers_vocab() {
        top.min(candidates.top.len())
    } else {
        top
    };
    let top = candidates
        .top
        .get(..top)?
        .iter()
        .map(|&(id, logit)| TokenProbability {
            token_id: id,
            logprob: logit - log_sum,
        })
        .collect();
    Some((logprob, top))
}

/// Log-probability of `token` and the `top` most likely tokens, from raw logits.
fn logprobs(logits: &[f32], token: u32, top: usize) -> (f32, Vec<TokenProbability>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = logits
        .iter()
        .map(|&x| ((x - max) as f64).exp())
        .sum::<f64>()
        .ln() as f32
        + max;
    let logprob = logits
        .get(token as usize)
        .map(|&x| x - log_sum)
        .unwrap_or(f32::NEG_INFINITY);
    if top == 0 {
        return (logprob, Vec::new());
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let top = top.min(order.len());
    order.select_nth_unstable_by(top - 1, |&a, &b| {
        logits[b as usize].total_cmp(&logits[a as usize])
    });
    order.truncate(top);
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let top = order
        .into_iter()
        .map(|id| TokenProbability {
            token_id: id,
            logprob: logits[id as usize] - log_sum,
        })
        .collect();
    (logprob, top)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::candidates::row_candidates;
    use crate::sampling::Xoshiro256;
    use crate::testing::{write_tiny_model, TinyArchitecture, TinyModelOptions};

    /// Samples `tokens` tokens at a high temperature from a tiny random model (97 ids) through
    /// the scheduler thread, with `top_k` (0: whole rows; >0: the candidates path).
    fn sampled_tokens<B: Backend + 'static>(
        backend: Arc<B>,
        sampleable_vocabulary: usize,
        top_k: usize,
        tokens: usize,
        logit_bias: &[(u32, f32)],
    ) -> Vec<u32>
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("tiny.ninfer");
        write_tiny_model(&path, TinyModelOptions::new(TinyArchitecture::Qwen3Moe)).unwrap();
        let model = Arc::new(Model::open(backend, &path).unwrap());
        let limits = SchedulerLimits {
            max_context: 256,
            max_sequences: 4,
            prefill_chunk_tokens: DEFAULT_PREFILL_CHUNK_TOKENS,
            prefill_time_share: DEFAULT_PREFILL_TIME_SHARE,
        };
        let commands = start(model, limits, Arc::new(SchedulerCounters::default())).unwrap();
        let (events, mut receiver) = async_mpsc::channel(4096);
        let request = GenerationRequest {
            request_id: "padded".to_string(),
            prompt: vec![1, 2, 3, 4],
            max_new_tokens: tokens,
            sampling: SamplingParams {
                temperature: 20.0,
                top_k,
                seed: 3,
                ..SamplingParams::default()
            },
            stop_token_ids: Vec::new(),
            top_logprobs: 0,
            sampleable_vocabulary,
            logit_bias: logit_bias.to_vec(),
            guide: None,
            draft_tokens: None,
            events,
        };
        commands.send(SchedulerCommand::Submit(request)).unwrap();
        let mut sampled = Vec::new();
        while let Some(event) = receiver.blocking_recv() {
            let event = event.unwrap();
            sampled.extend(event.token.map(|token| token.token_id));
            if event.finish.is_some() {
                break;
            }
        }
        assert_eq!(sampled.len(), tokens);
        sampled
    }

    /// Ids at or above the request's sampleable vocabulary never come out, on the whole-row and
    /// the candidates paths; without the limit the same sampling does produce them (so the
    /// check can fail).
    fn padded_vocabulary_ids_are_never_sampled<B: Backend + 'static>(backend: Arc<B>)
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        let limit = 40usize;
        for top_k in [0usize, 8] {
            let unmasked = sampled_tokens(Arc::clone(&backend), 0, top_k, 64, &[]);
            assert!(
                unmasked.iter().any(|&id| id as usize >= limit),
                "top_k {top_k}: the unmasked run never reached the padded ids: {unmasked:?}"
            );
            let masked = sampled_tokens(Arc::clone(&backend), limit, top_k, 64, &[]);
            assert!(
                masked.iter().all(|&id| (id as usize) < limit),
                "top_k {top_k}: a padded id was sampled: {masked:?}"
            );
        }
    }

    crate::test_device!(padded_vocabulary_ids_are_never_sampled);

    /// A +100 bias makes its token the only one drawn even at a high temperature; a -100 bias
    /// (the OpenAI ban) keeps a token out, on both sampling paths.
    fn logit_bias_pulls_and_bans_tokens<B: Backend + 'static>(backend: Arc<B>)
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        for top_k in [0usize, 8] {
            let pulled = sampled_tokens(Arc::clone(&backend), 0, top_k, 16, &[(11, 100.0)]);
            assert!(
                pulled.iter().all(|&id| id == 11),
                "top_k {top_k}: {pulled:?}"
            );
            let free = sampled_tokens(Arc::clone(&backend), 0, top_k, 64, &[]);
            let banned: Vec<(u32, f32)> = free.iter().map(|&id| (id, -100.0)).collect();
            let after = sampled_tokens(Arc::clone(&backend), 0, top_k, 64, &banned);
            assert!(
                after.iter().all(|id| !free.contains(id)),
                "top_k {top_k}: banned ids came back: {after:?} (banned {free:?})"
            );
        }
    }

    crate::test_device!(logit_bias_pulls_and_bans_tokens);

    /// Generates from a tiny random model whose rows match the fixtures' tokenizer (512 ids),
    /// under `guide`, and returns the tokens and the finish.
    fn guided_tokens<B: Backend + 'static>(
        backend: Arc<B>,
        guide: Option<Box<Guide>>,
        sampling: SamplingParams,
        max_new_tokens: usize,
    ) -> (Vec<u32>, Option<SequenceFinish>)
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("tiny512.ninfer");
        let mut config = crate::testing::tiny_config(TinyArchitecture::Qwen3Moe);
        if let ninfer_artifact::ModelConfig::Qwen3Moe(c) = &mut config {
            c.common.vocab_size = 512;
        }
        crate::testing::write_model(
            &path,
            &config,
            TinyModelOptions::new(TinyArchitecture::Qwen3Moe),
        )
        .unwrap();
        let model = Arc::new(Model::open(backend, &path).unwrap());
        let limits = SchedulerLimits {
            max_context: 512,
            max_sequences: 4,
            prefill_chunk_tokens: DEFAULT_PREFILL_CHUNK_TOKENS,
            prefill_time_share: DEFAULT_PREFILL_TIME_SHARE,
        };
        let commands = start(model, limits, Arc::new(SchedulerCounters::default())).unwrap();
        let (events, mut receiver) = async_mpsc::channel(4096);
        commands
            .send(SchedulerCommand::Submit(GenerationRequest {
                request_id: "guided".to_string(),
                prompt: vec![481, 100, 200, 300, 482],
                max_new_tokens,
                sampling,
                stop_token_ids: vec![482, 480],
                top_logprobs: 0,
                sampleable_vocabulary: 493,
                logit_bias: Vec::new(),
                guide,
                draft_tokens: None,
                events,
            }))
            .unwrap();
        let mut tokens = Vec::new();
        while let Some(event) = receiver.blocking_recv() {
            let event = event.unwrap_or_else(|e| panic!("{e}"));
            tokens.extend(event.token.map(|token| token.token_id));
            if event.finish.is_some() {
                return (tokens, event.finish);
            }
        }
        (tokens, None)
    }

    /// A random-weight model under a JSON schema (greedy and sampled, whole-row and candidate
    /// settings alike) writes JSON that parses and fits the schema, then stops; without the
    /// grammar the same model writes no JSON at all (so the check can fail).
    fn json_schema_output_is_valid_json<B: Backend + 'static>(backend: Arc<B>)
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        let path = crate::testing::golden_fixture_dir("qwen3_moe").join("tokenizer.json");
        let tokenizer_json = std::fs::read(path).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&tokenizer_json).unwrap();
        let words = crate::constraint::token_bytes(&json).unwrap();
        let text_of = |tokens: &[u32]| -> String {
            let bytes: Vec<u8> = tokens
                .iter()
                .filter(|&&t| t != 482 && t != 480)
                .flat_map(|&t| words[t as usize].clone())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        let cache = crate::constraint::GuidanceCache::default();
        let grammar = r#"start: %json {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "member": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
            "nothing": {"type": "null"}},
            "required": ["name", "age", "member", "tags", "nothing"], "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}"#;
        let guide = || {
            crate::constraint::guide_for_request(
                &cache,
                &tokenizer_json,
                512,
                &[482, 480],
                None,
                grammar,
                vec![482, 480],
            )
            .unwrap()
        };
        let mut settings = vec![SamplingParams::greedy()];
        for seed in 0..4u64 {
            for top_k in [0usize, 20] {
                settings.push(SamplingParams {
                    temperature: 1.5,
                    top_k,
                    seed,
                    ..SamplingParams::default()
                });
            }
        }
        for sampling in settings {
            let (tokens, finish) = guided_tokens(
                Arc::clone(&backend),
                guide().map(Box::new),
                sampling.clone(),
                200,
            );
            let text = text_of(&tokens);
            assert_eq!(
                finish,
                Some(SequenceFinish::StopToken),
                "{sampling:?}: {text:?}"
            );
            let value: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{sampling:?}: {e}: {text:?}"));
            let object = value.as_object().unwrap();
            assert_eq!(object.len(), 5, "{text}");
            assert!(
                object["name"]
                    .as_str()
                    .is_some_and(|n| n.chars().count() <= 12),
                "{text}"
            );
            assert!(
                object["age"]
                    .as_i64()
                    .is_some_and(|a| (0..=99).contains(&a)),
                "{text}"
            );
            assert!(object["member"].is_boolean(), "{text}");
            assert!(
                object["tags"]
                    .as_array()
                    .is_some_and(|t| t.len() <= 2 && t.iter().all(|v| v == "red" || v == "green")),
                "{text}"
            );
            assert!(object["nothing"].is_null(), "{text}");
        }
        let (free, _) = guided_tokens(Arc::clone(&backend), None, SamplingParams::greedy(), 60);
        let free = text_of(&free);
        assert!(
            serde_json::from_str::<serde_json::Value>(&free).is_err(),
            "{free:?}"
        );
    }

    crate::test_device!(json_schema_output_is_valid_json);

    /// A reasoning budget of 4: four free tokens, then the forced close, then the grammar.
    fn reasoning_budget_closes_the_block<B: Backend + 'static>(backend: Arc<B>)
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        let path = crate::testing::golden_fixture_dir("qwen3_moe").join("tokenizer.json");
        let tokenizer_json = std::fs::read(path).unwrap();
        let cache = crate::constraint::GuidanceCache::default();
        let rule = crate::constraint::ReasoningRule {
            start_token: None,
            end_token: 484,
            budget: 4,
            close_tokens: vec![484],
        };
        let guide = crate::constraint::guide_for_request(
            &cache,
            &tokenizer_json,
            512,
            &[482],
            Some(rule),
            r#"start: "yes" | "no""#,
            vec![482],
        )
        .unwrap();
        let sampling = SamplingParams {
            temperature: 1.0,
            seed: 5,
            ..SamplingParams::default()
        };
        let (tokens, finish) = guided_tokens(backend, guide.map(Box::new), sampling, 40);
        assert_eq!(tokens[4], 484, "{tokens:?}");
        assert!(!tokens[..4].contains(&484), "{tokens:?}");
        assert_eq!(finish, Some(SequenceFinish::StopToken), "{tokens:?}");
        assert_eq!(tokens.last(), Some(&482), "{tokens:?}");
    }

    crate::test_device!(reasoning_budget_closes_the_block);

    #[test]
    fn candidate_logprobs_equal_the_whole_row_logprobs() {
        let mut rng = Xoshiro256::seed_from_u64(5);
        for vocab in [40usize, 1000, 20_000] {
            let row: Vec<f32> = (0..vocab)
                .map(|_| (rng.next_f64() * 30.0 - 15.0) as f32)
                .collect();
            let extra = [3u32, 17, 39];
            let candidates = row_candidates(&row, DEFAULT_CANDIDATES, &extra);
            let tokens = candidates.top.iter().map(|c| c.0).take(5).chain(extra);
            for token in tokens {
                for top in [0usize, 1, 5, 64] {
                    let expected = logprobs(&row, token, top);
                    let got = candidate_logprobs(&candidates, token, top);
                    if top > candidates.top.len() && !candidates.covers_vocab() {
                        assert_eq!(got, None);
                        continue;
                    }
                    assert_eq!(got, Some(expected), "vocab {vocab} token {token} top {top}");
                }
            }
            // A token the candidates do not carry sends the caller to the row.
            let outside = (0..vocab as u32).find(|&t| candidates.logit(t).is_none());
            if let Some(outside) = outside {
                assert_eq!(candidate_logprobs(&candidates, outside, 1), None);
            }
        }
    }

    /// A greedy request on `events`.
    fn greedy_request(
        id: &str,
        prompt: Vec<u32>,
        max_new_tokens: usize,
        events: async_mpsc::Sender<SchedulerResult>,
    ) -> GenerationRequest {
        GenerationRequest {
            request_id: id.to_string(),
            prompt,
            max_new_tokens,
            sampling: SamplingParams::default(),
            stop_token_ids: Vec::new(),
            top_logprobs: 0,
            sampleable_vocabulary: 0,
            logit_bias: Vec::new(),
            guide: None,
            draft_tokens: None,
            events,
        }
    }

    /// The tiny MoE model on the CPU backend (the scheduler tests' model).
    fn tiny_cpu_model(directory: &std::path::Path) -> Arc<Model<crate::backend::cpu::CpuBackend>> {
        let path = directory.join("tiny.ninfer");
        write_tiny_model(&path, TinyModelOptions::new(TinyArchitecture::Qwen3Moe)).unwrap();
        let backend = Arc::new(crate::backend::cpu::CpuBackend::new());
        Arc::new(Model::open(backend, &path).unwrap())
    }

    /// What a scheduler run under `limits` gave a greedy 4-token request for `long_prompt`,
    /// queued with (when `stream_tokens` is given) a greedy stream of that many tokens from a
    /// 4-token prompt: the stream's tokens before the long prompt's first, the stream's tokens
    /// in all, and the long prompt's tokens. Both are queued before the scheduler starts, so
    /// both join its first step; one event channel holds their events in the order the
    /// scheduler sent them (told apart by their prompt lengths).
    fn long_prompt_beside_a_stream(
        model: &Arc<Model<crate::backend::cpu::CpuBackend>>,
        limits: SchedulerLimits,
        long_prompt: &[u32],
        stream_tokens: Option<usize>,
    ) -> (usize, usize, Vec<u32>) {
        let (commands, receiver) = mpsc::channel();
        let (events, mut received) = async_mpsc::channel(4096);
        if let Some(stream_tokens) = stream_tokens {
            commands
                .send(SchedulerCommand::Submit(greedy_request(
                    "stream",
                    vec![5, 6, 7, 8],
                    stream_tokens,
                    events.clone(),
                )))
                .unwrap();
        }
        commands
            .send(SchedulerCommand::Submit(greedy_request(
                "long",
                long_prompt.to_vec(),
                4,
                events,
            )))
            .unwrap();
        let model = Arc::clone(model);
        let scheduler = std::thread::spawn(move || {
            run(
                &model,
                limits,
                SpeculativeDecoding::default(),
                None,
                &SchedulerCounters::default(),
                &receiver,
            )
        });
        let (mut stream_before, mut stream_total, mut long_tokens) = (0, 0, Vec::new());
        while let Some(event) = received.blocking_recv() {
            let event = event.unwrap_or_else(|e| panic!("{e}"));
            let Some(token) = event.token else { continue };
            if event.prompt_tokens as usize == long_prompt.len() {
                long_tokens.push(token.token_id);
            } else {
                stream_total += 1;
                if long_tokens.is_empty() {
                    stream_before += 1;
                }
            }
        }
        drop(commands);
        scheduler.join().unwrap();
        (stream_before, stream_total, long_tokens)
    }

    /// A 48-token prompt arriving beside a generating stream, with chunks of 8 tokens: the
    /// prompt goes through in chunks, one per step, and the stream gets a token at each of
    /// those steps (at least 5 before the prompt's first token; fed whole, the prompt's first
    /// token would come in the first step). The chunked prompt's greedy tokens are those of the
    /// same prompt fed whole.
    #[test]
    fn a_long_prompt_goes_in_chunks_while_a_stream_keeps_decoding() {
        let directory = tempfile::tempdir().unwrap();
        let model = tiny_cpu_model(directory.path());
        let long_prompt: Vec<u32> = (0..48).map(|i| (i * 7 + 3) % 90 + 1).collect();
        let run_with = |chunk_tokens: usize, with_stream: bool| {
            let limits = SchedulerLimits {
                max_context: 256,
                max_sequences: 4,
                prefill_chunk_tokens: chunk_tokens,
                // A chunk every step: the chunking alone.
                prefill_time_share: 1.0,
            };
            let (before, _, long_tokens) = long_prompt_beside_a_stream(
                &model,
                limits,
                &long_prompt,
                with_stream.then_some(16),
            );
            (before, long_tokens)
        };
        let (alone_before, alone_tokens) = run_with(8, false);
        assert_eq!(alone_before, 0);
        let (chunked_before, chunked_tokens) = run_with(8, true);
        let (whole_before, whole_tokens) = run_with(0, true);
        println!(
            "stream tokens before the long prompt's first: chunked {chunked_before}, whole {whole_before}"
        );
        assert!(
            chunked_before >= 5,
            "the stream got {chunked_before} tokens while the prompt was chunked"
        );
        assert!(whole_before <= 1, "fed whole, the prompt waits for nothing");
        assert_eq!(chunked_tokens, alone_tokens, "chunking changed the tokens");
        assert_eq!(whole_tokens, alone_tokens);
        assert_eq!(alone_tokens.len(), 4);
    }

    fn ms(milliseconds: u64) -> Duration {
        Duration::from_millis(milliseconds)
    }

    /// Share 0.45: after a 300 ms chunk, prompts wait for 300 × 0.55 / 0.45 ≈ 366.7 ms of
    /// decode steps (five of 80 ms: four are 320 ms); the first chunk runs at once.
    #[test]
    fn prefill_share_waits_for_the_decode_time_a_chunk_owes() {
        let mut share = PrefillShare::new(0.45);
        assert!(share.may_prefill(), "the first chunk runs at once");
        share.record_prefill(ms(300));
        let owed = share.owed().as_secs_f64();
        assert!((owed - 0.3 * 0.55 / 0.45).abs() < 1e-9, "{owed}");
        let mut steps = 0;
        while !share.may_prefill() {
            share.record_decode(ms(80));
            steps += 1;
        }
        assert_eq!(steps, 5);
    }

    /// Over many chunk/decode cycles prompt work never takes more than its share of the time
    /// (decode steps overshoot by at most one step per chunk), at several shares and step
    /// sizes.
    #[test]
    fn prefill_share_holds_the_prompt_work_to_its_share() {
        for share_value in [0.1, 0.25, 0.45, 0.5, 0.8] {
            for (chunk, step) in [(300, 5), (600, 20), (40, 40), (10, 70)] {
                let mut share = PrefillShare::new(share_value);
                let (mut prefill, mut decode) = (0u64, 0u64);
                let mut chunks = 0;
                // Whole cycles (a chunk, then the decode steps that pay for it): the share
                // holds at every cycle's end, not in the middle of one.
                while chunks < 50 || !share.may_prefill() {
                    if share.may_prefill() {
                        share.record_prefill(ms(chunk));
                        prefill += chunk;
                        chunks += 1;
                    }
                    // A decode step follows every chunk (the scheduler's step).
                    share.record_decode(ms(step));
                    decode += step;
                }
                let fraction = prefill as f64 / (prefill + decode) as f64;
                assert!(
                    fraction <= share_value + 1e-9,
                    "share {share_value}, chunk {chunk} ms, step {step} ms: {fraction}"
                );
                // And not much less: the overshoot is under one decode step per chunk.
                let floor =
                    prefill as f64 / (prefill as f64 / share_value + (chunks * step) as f64);
                assert!(
                    fraction >= floor - 1e-9,
                    "share {share_value}, chunk {chunk} ms, step {step} ms: {fraction} < {floor}"
                );
            }
        }
    }

    /// Decode time with no prompt waiting is not banked: a chunk after a long solo decode
    /// still owes its decode time before the next one.
    #[test]
    fn prefill_share_banks_no_credit() {
        let mut share = PrefillShare::new(0.5);
        for _ in 0..1000 {
            share.record_decode(ms(10));
        }
        share.record_prefill(ms(100));
        assert!(!share.may_prefill());
        share.record_decode(ms(99));
        assert!(!share.may_prefill());
        share.record_decode(ms(1));
        assert!(share.may_prefill());
    }

    /// Share 1 never holds a prompt (a chunk every step); a reset (nothing decoding) forgets
    /// the debt; shares outside (0, 1] are taken as 1.
    #[test]
    fn prefill_share_of_one_never_waits_and_a_reset_forgets() {
        let mut share = PrefillShare::new(1.0);
        share.record_prefill(ms(10_000));
        assert!(share.may_prefill());
        for bad in [0.0, -1.0, 1.5, f64::NAN] {
            let mut share = PrefillShare::new(bad);
            share.record_prefill(ms(10_000));
            assert!(share.may_prefill(), "{bad}");
        }
        let mut share = PrefillShare::new(0.2);
        share.record_prefill(ms(10));
        assert!(!share.may_prefill());
        share.reset();
        assert!(share.may_prefill());
        assert_eq!(share.owed(), Duration::ZERO);
    }

    /// A 48-token prompt in chunks of 8 beside a long greedy stream, under the time share:
    /// the stream decodes between the chunks (at least one token per chunk; at a share of 10%
    /// at least two per chunk, as every chunk then owes 9 times its time to decode steps),
    /// the prompt completes while the stream is still running (no starvation), and its
    /// greedy tokens are those of the prompt fed alone.
    #[test]
    fn a_time_shared_prompt_keeps_its_tokens_and_the_stream_decodes_between_chunks() {
        let directory = tempfile::tempdir().unwrap();
        let model = tiny_cpu_model(directory.path());
        let long_prompt: Vec<u32> = (0..48).map(|i| (i * 5 + 2) % 90 + 1).collect();
        // The long prompt's own forwards: 5 chunks of 8 in steps of their own, the last 8
        // tokens joining a step (the first step, where both are prompts, takes 4 of its 8).
        let chunks = 6;
        // Far more than the decode steps the chunks owe (a tiny model's chunk of 8 costs a few
        // decode steps), so the prompt completes while the stream still runs.
        let stream_tokens = 1500;
        let run_with = |share: f64, with_stream: bool| {
            let limits = SchedulerLimits {
                max_context: 2048,
                max_sequences: 4,
                prefill_chunk_tokens: 8,
                prefill_time_share: share,
            };
            long_prompt_beside_a_stream(
                &model,
                limits,
                &long_prompt,
                with_stream.then_some(stream_tokens),
            )
        };
        let (_, _, alone) = run_with(DEFAULT_PREFILL_TIME_SHARE, false);
        assert_eq!(alone.len(), 4);
        for (share, per_chunk) in [(DEFAULT_PREFILL_TIME_SHARE, 1), (0.1, 2)] {
            let (before, total, tokens) = run_with(share, true);
            println!("share {share}: {before} stream tokens before the long prompt's first");
            assert_eq!(total, stream_tokens);
            assert_eq!(
                tokens, alone,
                "share {share}: the time share changed the tokens"
            );
            assert!(
                before >= per_chunk * (chunks - 1),
                "share {share}: the stream got {before} tokens during {chunks} chunks"
            );
            assert!(
                before < stream_tokens,
                "share {share}: the prompt waited for the stream to end"
            );
        }
    }
}
