//! Admission: the scheduler's commands as they arrive. A generation request is checked against
//! the vocabulary and the limits, gets its sequence (its prompt's encoded images attached, then
//! the prefix cache's reusable prefix and, when it speculates, its MTP state); a scoring request is handed to [`Scoring`]; a cancel
//! ends its sequence.
//!
//! Owns: the checks and refusals of a request, building its running state. Must not touch: the
//! steps.

use std::sync::atomic::Ordering;

use super::counters::SchedulerCounters;
use super::limits::{SchedulerLimits, SpeculativeDecoding};
use super::messages::{SchedulerError, SequenceFinish};
use super::requests::{GenerationRequest, SchedulerCommand};
use super::sequence::{finish_message, Running, Speculating};
use crate::backend::{Backend, KvPlacement};
use crate::error::EngineError;
use crate::model::{DraftController, Model, SequenceState};
use crate::prefix_cache::PrefixCache;
use crate::sampling::Sampler;
use crate::service::scoring::Scoring;

/// What admission checks against.
pub(super) struct Admission {
    pub(super) limits: SchedulerLimits,
    pub(super) speculation: SpeculativeDecoding,
    pub(super) vocab: usize,
}

/// Applies one command: admits (or refuses) a request, or cancels one.
pub(super) fn handle<B: Backend>(
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
        SchedulerCommand::Submit(mut request) => {
            let images = request.images.take();
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
            let before = model.kv_placement();
            let mut state = match model.new_sequence(needed) {
                Ok(state) => state,
                Err(error) => return reject(SchedulerError::GenerationFailed(error.to_string())),
            };
            log_host_kv(model, before, &request.request_id);
            if let Some(images) = images {
                let attached = model.attach_images(
                    &mut state,
                    &request.prompt,
                    &images.grids,
                    images.embeddings,
                );
                if let Err(error) = attached {
                    return reject(SchedulerError::InvalidRequest(error.to_string()));
                }
            }
            let max_drafts = admission.speculation.max_draft_tokens;
            let drafts = request
                .draft_tokens
                .map_or(max_drafts, |n| n.min(max_drafts));
            let mtp_context = needed + drafts + 1;
            let mut speculating = if drafts > 0 && request.guide.is_none() {
                match model.new_mtp_state(mtp_context) {
                    Ok(mtp) => Some(Speculating {
                        mtp,
                        controller: DraftController::new(drafts),
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
            let admitted_at = std::time::Instant::now();
            let reused = match (prefix, speculating.as_mut()) {
                (Some(cache), None) => reuse_prefix(model, cache, &mut state, &request, needed),
                (Some(cache), Some(s)) => {
                    reuse_prefix_speculating(model, cache, &mut state, s, &request, mtp_context)
                }
                (None, _) => Ok(0),
            };
            let cached_tokens = match reused {
                Ok(cached) => cached,
                Err(error) => return reject(SchedulerError::GenerationFailed(error.to_string())),
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
                admitted_at,
                restore_time: admitted_at.elapsed(),
                prompt_pieces_time: std::time::Duration::ZERO,
            });
        }
    }
}

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
            let mut fresh = model.new_sequence(needed)?;
            state.move_images_to(&mut fresh);
            *state = fresh;
            Ok(0)
        }
    }
}

/// [`reuse_prefix`] for a speculating sequence: the MTP head's state comes with the prefix, and
/// the pair at the prefix's last position (its hidden row, the prompt's next token) waits for
/// the head like every prompt row's pair.
fn reuse_prefix_speculating<B: Backend>(
    model: &Model<B>,
    cache: &mut PrefixCache<B>,
    state: &mut SequenceState<B>,
    s: &mut Speculating<B>,
    request: &GenerationRequest,
    mtp_context: usize,
) -> Result<usize, EngineError> {
    let restored = cache.restore_speculating(model, state, &mut s.mtp, &request.prompt);
    match restored {
        Ok((cached, hidden)) => {
            if let (true, Some(&next)) = (cached > 0, request.prompt.get(cached)) {
                s.pair_hidden = hidden;
                s.pair_tokens = vec![next];
            }
            Ok(cached)
        }
        Err(error) => {
            tracing::warn!(request_id = %request.request_id, "prefix cache: restoring failed, the prompt is computed whole: {error}");
            let mut fresh = model.new_sequence(state.max_context())?;
            state.move_images_to(&mut fresh);
            *state = fresh;
            s.mtp = model.new_mtp_state(mtp_context)?;
            Ok(0)
        }
    }
}

/// With a host KV pool (`--host-kv-mib`): where the new sequence's KV caches went, and the
/// totals, when any of them is in host memory.
fn log_host_kv<B: Backend>(model: &Model<B>, before: Option<KvPlacement>, request_id: &str) {
    let (Some(before), Some(after)) = (before, model.kv_placement()) else {
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
