//! The scheduler actor: one thread owns the model and every running sequence; requests arrive on
//! a channel and join the running batch at the next step (continuous batching: a new request's
//! prefill runs in the same forward as the others' decode steps).
//!
//! Owns: admission (context and queue limits), per-sequence state, sampling, finish reasons,
//! cancellation (explicit, or the client's stream going away).
//! Must not touch: transport (the gRPC layer turns these events into messages), text.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use ninfer_protocol::v1::{FinishReason, GeneratedToken, TokenLogprob};
use tokio::sync::mpsc as async_mpsc;
use tonic::Status;

use crate::backend::Backend;
use crate::model::{LogitsSelection, Model, SequenceInput, SequenceState};
use crate::sampling::{Sampler, SamplingParams};

/// One generation request as the scheduler sees it.
pub struct GenerationRequest {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_token_ids: Vec<u32>,
    pub top_logprobs: usize,
    pub events: async_mpsc::Sender<Result<GeneratedToken, Status>>,
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

fn finish_message(reason: FinishReason, prompt: usize, generated: usize) -> GeneratedToken {
    GeneratedToken {
        finish_reason: reason as i32,
        prompt_tokens: prompt as u32,
        completion_tokens: generated as u32,
        no_token: true,
        ..Default::default()
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
        let mut batch: Vec<SequenceInput<'_, B>> = running
            .iter_mut()
            .map(|r| SequenceInput {
                state: &mut r.state,
                tokens: &r.pending,
            })
            .collect();
        let result = model.forward(&mut batch, LogitsSelection::Last);
        drop(batch);
        let logits = match result {
            Ok(logits) => logits,
            Err(error) => {
                tracing::error!("forward pass failed: {error}");
                for r in running.drain(..) {
                    let _ = r
                        .request
                        .events
                        .try_send(Err(Status::internal(format!("generation failed: {error}"))));
                }
                continue;
            }
        };
        let mut finished = Vec::new();
        let mut kv_used = 0u64;
        for (index, (r, row)) in running.iter_mut().zip(logits).enumerate() {
            let token = match r.sampler.sample(&row, &r.history) {
                Ok(token) => token,
                Err(error) => {
                    let _ = r
                        .request
                        .events
                        .try_send(Err(Status::invalid_argument(error.to_string())));
                    finished.push(index);
                    continue;
                }
            };
            r.generated += 1;
            r.history.push(token);
            r.pending.clear();
            r.pending.push(token);
            counters.generated_tokens.fetch_add(1, Ordering::Relaxed);
            let (logprob, top) = logprobs(&row, token, r.request.top_logprobs);
            let reason = if r.request.stop_token_ids.contains(&token) {
                FinishReason::StopToken
            } else if r.generated >= r.request.max_new_tokens {
                FinishReason::Length
            } else if r.state.position() >= r.state.max_context() {
                FinishReason::ContextFull
            } else {
                FinishReason::Unspecified
            };
            let message = GeneratedToken {
                token_id: token,
                logprob,
                top_logprobs: top,
                finish_reason: reason as i32,
                prompt_tokens: r.request.prompt.len() as u32,
                completion_tokens: r.generated as u32,
                no_token: false,
            };
            // The gRPC layer keeps a deep buffer; a full one means a stalled client, treated as gone.
            if r.request.events.try_send(Ok(message)).is_err()
                || reason != FinishReason::Unspecified
            {
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
                    FinishReason::Cancelled,
                    r.request.prompt.len(),
                    r.generated,
                )));
            }
            let _ = reply.send(position.is_some());
        }
        SchedulerCommand::Submit(request) => {
            let reject = |status: Status| {
                let _ = request.events.try_send(Err(status));
            };
            if request.prompt.is_empty() {
                return reject(Status::invalid_argument("the prompt has no tokens"));
            }
            if let Some(&bad) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
                return reject(Status::invalid_argument(format!(
                    "token id {bad} is outside the vocabulary of {vocab} tokens"
                )));
            }
            if request.max_new_tokens == 0 {
                return reject(Status::invalid_argument(
                    "max_new_tokens must be at least 1",
                ));
            }
            let needed = request.prompt.len() + request.max_new_tokens;
            if needed > limits.max_context {
                return reject(Status::out_of_range(format!(
                    "prompt of {} tokens + max_new_tokens {} = {needed} exceeds the maximum context of {} tokens",
                    request.prompt.len(),
                    request.max_new_tokens,
                    limits.max_context
                )));
            }
            if running.len() >= limits.max_sequences {
                return reject(Status::resource_exhausted(format!(
                    "the engine is running its maximum of {} sequences; retry later",
                    limits.max_sequences
                )));
            }
            let sampler = match Sampler::new(request.sampling.clone()) {
                Ok(sampler) => sampler,
                Err(error) => return reject(Status::invalid_argument(error.to_string())),
            };
            counters
                .prompt_tokens
                .fetch_add(request.prompt.len() as u64, Ordering::Relaxed);
            let state = model.new_sequence(needed);
            running.push(Running {
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

/// Log-probability of `token` and the `top` most likely tokens, from raw logits.
fn logprobs(logits: &[f32], token: u32, top: usize) -> (f32, Vec<TokenLogprob>) {
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
        .map(|id| TokenLogprob {
            token_id: id,
            logprob: logits[id as usize] - log_sum,
        })
        .collect();
    (logprob, top)
}
