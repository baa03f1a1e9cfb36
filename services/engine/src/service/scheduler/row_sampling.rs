//! Sampling the rows of a forward: a token per sequence from the backend's logit candidates or
//! the whole row (bias, vocabulary limit and grammar mask applied), its log-probabilities, and
//! the token's event.
//!
//! Owns: reading logits back, a request's row preparation, log-probabilities, emitting a token.
//! Must not touch: the forwards, drafting.

use std::sync::atomic::Ordering;

use super::counters::SchedulerCounters;
use super::messages::{
    SampledToken, SchedulerError, SchedulerEvent, SequenceFinish, TokenProbability,
};
use super::requests::GenerationRequest;
use super::sequence::{fail, Running};
use crate::backend::candidates::{candidates_needed, MAX_CANDIDATES};
use crate::backend::{Backend, LogitCandidates};
use crate::constraint::Allowed;
use crate::error::EngineError;
use crate::model::Model;

/// Samples one token for each of `members` (indices into `running`) from `logits` (row `i`:
/// the last position of `running[members[i]]`), sends the events and pushes the sequences that
/// end (finished, failed, or gone) to `finished`. `Err`: the logits could not be read back.
pub(super) fn sample_rows<B: Backend>(
    model: &Model<B>,
    running: &mut [Running<B>],
    members: &[usize],
    logits: &B::Tensor,
    allowed: &[Allowed],
    counters: &SchedulerCounters,
    finished: &mut Vec<usize>,
) -> Result<(), EngineError> {
    let vocab = model.vocab_size();
    let backend = model.output_backend();
    // Sampling on the backend's candidates when every request allows it (a few KB per
    // token read back instead of the whole logits rows). Guided rows are read whole.
    // The penalised tokens (a sort of each history) only where candidates are read.
    let needs = candidate_needs(running, members, allowed);
    let extra: Vec<Vec<u32>> = match &needs {
        Some(_) => members
            .iter()
            .map(|&index| {
                let r = &running[index];
                r.sampler.penalised_tokens(&r.history, vocab)
            })
            .collect(),
        None => Vec::new(),
    };
    let candidate_k = needs.map(|needs| candidate_count(&needs, &extra));
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
pub(super) fn emit<B: Backend>(
    r: &mut Running<B>,
    token: u32,
    logprob: f32,
    top_logprobs: Vec<TokenProbability>,
    counters: &SchedulerCounters,
) -> bool {
    r.generated += 1;
    if r.generated == 1 {
        let milliseconds = |d: std::time::Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
        tracing::info!(
            request_id = %r.request.request_id,
            prompt_tokens = r.request.prompt.len(),
            cached_tokens = r.cached_tokens,
            restore_ms = milliseconds(r.restore_time),
            prompt_pieces_ms = milliseconds(r.prompt_pieces_time),
            first_token_ms = milliseconds(r.admitted_at.elapsed()),
            "first token (times from admission)"
        );
    }
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
pub(super) fn prepare_row(row: &mut [f32], request: &GenerationRequest, vocab: usize) {
    apply_logit_bias(row, &request.logit_bias);
    mask_unsampleable(
        row,
        sampleable_vocabulary(request.sampleable_vocabulary, vocab),
    );
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

/// Each member's top-k (greedy: 1) or `top_logprobs`, whichever is more, when every running
/// request can sample from candidates ([`Sampler::candidates_suffice`](crate::sampling::Sampler::candidates_suffice),
/// `top_logprobs` within them; a guided row, read whole on its own, needs 0, every other at
/// least 1); `None`: read
/// back whole rows. `NINFER_FULL_LOGITS=1` always reads whole rows.
fn candidate_needs<B: Backend>(
    running: &[Running<B>],
    members: &[usize],
    allowed: &[Allowed],
) -> Option<Vec<usize>> {
    if std::env::var("NINFER_FULL_LOGITS").is_ok_and(|v| v == "1") {
        return None;
    }
    members
        .iter()
        .map(|&index| {
            let (r, step) = (&running[index], &allowed[index]);
            if !step.is_any() {
                return Some(0);
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
            Some(top_k.max(r.request.top_logprobs))
        })
        .collect()
}

/// The number of largest logits to read back per row: the most any row needs, its
/// [`candidate_needs`] plus its penalised tokens (`extra`, per member), which could all rank
/// above the others. Fewer candidates cost the GPU fewer selection rounds per token; a row
/// they cannot decide is read whole.
fn candidate_count(needs: &[usize], extra: &[Vec<u32>]) -> usize {
    needs
        .iter()
        .zip(extra)
        // 0: a guided row, which the candidates do not serve.
        .filter(|(&need, _)| need > 0)
        .map(|(&need, penalised)| candidates_needed(need, 0, penalised.len()))
        .max()
        .unwrap_or(1)
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
pub(super) fn logprobs(logits: &[f32], token: u32, top: usize) -> (f32, Vec<TokenProbability>) {
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
    use crate::backend::candidates::{row_candidates, DEFAULT_CANDIDATES};
    use crate::sampling::Xoshiro256;

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
