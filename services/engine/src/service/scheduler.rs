//! The scheduler actor: one thread owns the model and every running sequence; requests arrive on
//! a channel and join the running batch at the next step (continuous batching: a new request's
//! prefill runs in the same forward as the others' decode steps).
//!
//! Owns: admission (context and queue limits), per-sequence state, sampling, finish reasons,
//! cancellation (explicit, or the client's stream going away), and its own event and error types
//! ([`SchedulerEvent`], [`SchedulerError`]).
//! Must not touch: transport (the gRPC service converts the events and errors to messages and
//! statuses at its edge), text.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use tokio::sync::mpsc as async_mpsc;

use crate::backend::candidates::{DEFAULT_CANDIDATES, MAX_CANDIDATES};
use crate::backend::{Backend, KvPlacement, LogitCandidates};
use crate::constraint::{Allowed, Guide};
use crate::error::EngineError;
use crate::model::{Model, SequenceInput, SequenceState};
use crate::sampling::{Sampler, SamplingParams};

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
    /// row, masked to what the guide allows.
    pub guide: Option<Box<Guide>>,
    pub events: async_mpsc::Sender<SchedulerResult>,
}

pub enum SchedulerCommand {
    Submit(GenerationRequest),
    Cancel(String, tokio::sync::oneshot::Sender<bool>),
}

/// Counters the status RPC reports.
#[derive(Default)]
pub struct SchedulerCounters {
    pub running: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub kv_used_tokens: AtomicU64,
}

/// Limits of admission.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerLimits {
    pub max_context: usize,
    pub max_sequences: usize,
}

struct Running<B: Backend> {
    request: GenerationRequest,
    state: SequenceState<B>,
    sampler: Sampler,
    history: Vec<u32>,
    pending: Vec<u32>,
    generated: usize,
    guide: Option<Box<Guide>>,
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
    let (sender, receiver) = mpsc::channel();
    std::thread::Builder::new()
        .name("ninfer-scheduler".into())
        .spawn(move || run(&model, limits, &counters, &receiver))?;
    Ok(sender)
}

fn finish_message(reason: SequenceFinish, prompt: usize, generated: usize) -> SchedulerEvent {
    SchedulerEvent {
        token: None,
        finish: Some(reason),
        prompt_tokens: prompt as u32,
        completion_tokens: generated as u32,
    }
}

fn run<B: Backend>(
    model: &Model<B>,
    limits: SchedulerLimits,
    counters: &SchedulerCounters,
    commands: &mpsc::Receiver<SchedulerCommand>,
) {
    let vocab = model.vocab_size();
    let mut running: Vec<Running<B>> = Vec::new();
    loop {
        // Block only when idle; otherwise take what arrived and go on decoding.
        if running.is_empty() {
            match commands.recv() {
                Ok(command) => handle(model, command, &mut running, limits, vocab, counters),
                Err(_) => return,
            }
        }
        while let Ok(command) = commands.try_recv() {
            handle(model, command, &mut running, limits, vocab, counters);
        }
        // A client that went away cancels its sequence.
        running.retain(|r| !r.request.events.is_closed());
        counters.running.store(running.len(), Ordering::Relaxed);
        if running.is_empty() {
            continue;
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
            continue;
        }
        // Sampling on the backend's candidates when every request allows it (a few KB per
        // token read back instead of the whole logits rows). Guided rows are read whole.
        let candidate_k = candidate_count(&running, &allowed);
        let extra: Vec<Vec<u32>> = match candidate_k {
            Some(_) => running
                .iter()
                .map(|r| r.sampler.penalised_tokens(&r.history, vocab))
                .collect(),
            None => Vec::new(),
        };
        let mut batch: Vec<SequenceInput<'_, B>> = running
            .iter_mut()
            .map(|r| SequenceInput {
                state: &mut r.state,
                tokens: &r.pending,
            })
            .collect();
        let result = model.forward_logits_on_backend(&mut batch);
        drop(batch);
        let logits = match result {
            Ok(logits) => logits,
            Err(error) => {
                tracing::error!("forward pass failed: {error}");
                fail_all(&mut running, &error);
                continue;
            }
        };
        let backend = model.backend();
        let candidates = candidate_k.and_then(|k| {
            backend
                .logit_candidates(&logits, k, &extra)
                .map_err(|error| {
                    tracing::warn!("logit candidates failed, sampling from the whole rows: {error}")
                })
                .ok()
        });
        // Without candidates every row comes back at once, as one read-back.
        let all_rows = match candidates
            .is_none()
            .then(|| backend.download(&logits))
            .transpose()
        {
            Ok(all_rows) => all_rows,
            Err(error) => {
                tracing::error!("reading the logits back failed: {error}");
                fail_all(&mut running, &error);
                continue;
            }
        };
        let row_of = |index: usize| match &all_rows {
            Some(values) => Ok(values
                .get(index * vocab..(index + 1) * vocab)
                .map(<[f32]>::to_vec)
                .unwrap_or_default()),
            None => backend.download(&backend.gather_rows(&logits, &[index])?),
        };
        let mut finished = Vec::new();
        let mut kv_used = 0u64;
        for (index, r) in running.iter_mut().enumerate() {
            let sampleable = sampleable_vocabulary(r.request.sampleable_vocabulary, vocab);
            let step = &allowed[index];
            let masked_candidates = candidates
                .as_ref()
                .filter(|_| step.is_any())
                .and_then(|c| c.get(index))
                .map(|c| without_unsampleable(c, sampleable));
            let row_candidates = masked_candidates.as_deref();
            let mut row: Option<Vec<f32>> = None;
            let logit_bias = &r.request.logit_bias;
            let row_of = |index: usize| {
                row_of(index).and_then(|mut row| {
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
                Ok(None) => match row_of(index) {
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
            r.generated += 1;
            r.history.push(token);
            r.pending.clear();
            r.pending.push(token);
            counters.generated_tokens.fetch_add(1, Ordering::Relaxed);
            let top_logprobs = r.request.top_logprobs;
            let (logprob, top) =
                match row_candidates.and_then(|c| candidate_logprobs(c, token, top_logprobs)) {
                    Some(found) => found,
                    None => {
                        let values = match row.take().map_or_else(|| row_of(index), Ok) {
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
            let finish = if r.request.stop_token_ids.contains(&token) {
                Some(SequenceFinish::StopToken)
            } else if r.generated >= r.request.max_new_tokens {
                Some(SequenceFinish::Length)
            } else if r.state.position() >= r.state.max_context() {
                Some(SequenceFinish::ContextFull)
            } else {
                None
            };
            let message = SchedulerEvent {
                token: Some(SampledToken {
                    token_id: token,
                    logprob,
                    top_logprobs: top,
                }),
                finish,
                prompt_tokens: r.request.prompt.len() as u32,
                completion_tokens: r.generated as u32,
            };
            // The gRPC layer keeps a deep buffer; a full one means a stalled client, treated as gone.
            if r.request.events.try_send(Ok(message)).is_err() || finish.is_some() {
                finished.push(index);
            }
            kv_used += r.state.position() as u64;
        }
        counters.kv_used_tokens.store(kv_used, Ordering::Relaxed);
        for index in finished.into_iter().rev() {
            running.swap_remove(index);
        }
        counters.running.store(running.len(), Ordering::Relaxed);
    }
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
    limits: SchedulerLimits,
    vocab: usize,
    counters: &SchedulerCounters,
) {
    match command {
        SchedulerCommand::Cancel(id, reply) => {
            let position = running.iter().position(|r| r.request.request_id == id);
            if let Some(index) = position {
                let r = running.swap_remove(index);
                let _ = r.request.events.try_send(Ok(finish_message(
                    SequenceFinish::Cancelled,
                    r.request.prompt.len(),
                    r.generated,
                )));
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
            if running.len() >= limits.max_sequences {
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
            let mut request = request;
            let guide = request.guide.take();
            running.push(Running {
                guide,
                history: request.prompt.clone(),
                pending: request.prompt.clone(),
                request,
                state,
                sampler,
                generated: 0,
            });
        }
    }
}

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
/// penalised tokens among them; `None`: read back whole rows. `NINFER_FULL_LOGITS=1` always
/// reads whole rows.
fn candidate_count<B: Backend>(running: &[Running<B>], allowed: &[Allowed]) -> Option<usize> {
    if std::env::var("NINFER_FULL_LOGITS").is_ok_and(|v| v == "1") {
        return None;
    }
    let mut needed = 1usize;
    for (r, step) in running.iter().zip(allowed) {
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
}
