//! `ninfer bench MODEL --decode-during-prefill N`: one stream's decode alone, then while a
//! second request's prompt of N tokens is prefilled beside it in the same engine: what a
//! running conversation keeps of its speed when someone pastes a long document.
//!
//! Owns: the two requests, their timing at the client and the figures made from it.
//! Must not touch: the scheduler's policy (`--prefill-time-share`, `--prefill-chunk-tokens`
//! reach the engine through `--engine-arg`), the rest of the bench's report (`bench_model_report.rs`).

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::{CancelRequest, FinishReason};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::bench_tokens::{bench_request, gaps, random_tokens, StepLatency};

/// Stream tokens awaited after the long prompt's first token, so the gap spanning the end of
/// its prefill is measured and the stream is seen decoding again before it is cancelled.
pub(crate) const TOKENS_AFTER_PREFILL: usize = 4;

/// Tokens the stream should be able to generate: its solo window, two per token of the long
/// prompt, and the tail. At the default share a stream decodes about 1.2 tokens per decode
/// step's worth of prompt work, and a prompt token costs far less than a decode step wherever
/// batching pays, so this is far more than it needs; it is cancelled once the tail has come.
pub(crate) fn stream_tokens_wanted(decode_tokens: usize, prompt_tokens: usize) -> usize {
    decode_tokens
        .saturating_add(prompt_tokens.saturating_mul(2))
        .saturating_add(1 + TOKENS_AFTER_PREFILL)
}

/// The stream's tokens over one window of the client's clock.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct StreamWindow {
    /// Stream tokens that arrived in the window.
    pub tokens: usize,
    pub window_ms: f64,
    pub tok_s: f64,
    /// Gaps between consecutive stream tokens that overlap the window.
    pub step_ms: StepLatency,
}

/// `--decode-during-prefill`'s figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DecodeDuringPrefill {
    /// The long prompt, tokens.
    pub prompt_tokens: usize,
    /// The stream's own prompt (the first of `--prompt-lengths`) and the tokens it asked for.
    pub stream_prompt_tokens: usize,
    pub stream_max_new_tokens: usize,
    /// From the stream's first token to its `--decode-tokens`-th decoded one, nothing else in
    /// the engine.
    pub solo: StreamWindow,
    /// From the long prompt's submission to its first token.
    pub during_prefill: StreamWindow,
    /// `during_prefill.tok_s / solo.tok_s`.
    pub during_over_solo: f64,
    /// The longest gap between two consecutive stream tokens during the prefill (ms),
    /// including the gaps that span its start and its end.
    pub longest_gap_ms: f64,
    /// The long prompt's time to first token at the client (ms) and prompt tokens per second
    /// of it.
    pub time_to_first_token_ms: f64,
    pub prefill_tok_s: f64,
}

/// Starts the stream, lets it decode `solo_tokens` alone, submits the long prompt, records the
/// stream's tokens until the prompt's first token and [`TOKENS_AFTER_PREFILL`] more, then
/// cancels the stream.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn measure(
    client: &EngineClient<Channel>,
    prompt_tokens: usize,
    stream_prompt_tokens: usize,
    stream_max_new_tokens: usize,
    solo_tokens: usize,
    vocab: u32,
    seed: u64,
) -> anyhow::Result<DecodeDuringPrefill> {
    let stream_id = format!("bench-stream-{seed}");
    let (arrived, mut arrivals_rx) = mpsc::unbounded_channel::<Instant>();
    let stream_task = tokio::spawn(stream(
        client.clone(),
        bench_request(
            stream_id.clone(),
            random_tokens(stream_prompt_tokens, vocab, seed),
            stream_max_new_tokens,
            seed,
        ),
        arrived,
    ));
    let mut arrivals: Vec<Instant> = Vec::with_capacity(solo_tokens + 64);
    // The solo window: the stream's first token (its own prefill's) and `solo_tokens` more.
    while arrivals.len() < solo_tokens + 1 {
        match arrivals_rx.recv().await {
            Some(arrival) => arrivals.push(arrival),
            None => {
                return Err(
                    stream_stopped(stream_task, arrivals.len(), stream_max_new_tokens).await,
                )
            }
        }
    }
    let solo_end = arrivals.len();
    let submitted = Instant::now();
    let long = first_token(
        client.clone(),
        bench_request(
            format!("bench-long-{seed}"),
            random_tokens(prompt_tokens, vocab, seed ^ 0x10_4e5d),
            1,
            seed,
        ),
    );
    tokio::pin!(long);
    let first = loop {
        tokio::select! {
            result = &mut long => match result {
                Ok(first) => break first,
                Err(problem) => {
                    cancel(client, &stream_id).await;
                    return Err(problem.context(format!("the prompt of {prompt_tokens} tokens")));
                }
            },
            arrival = arrivals_rx.recv() => match arrival {
                Some(arrival) => arrivals.push(arrival),
                None => {
                    return Err(stream_stopped(stream_task, arrivals.len(), stream_max_new_tokens)
                        .await
                        .context("before the long prompt's first token"))
                }
            },
        }
    };
    while arrivals.iter().filter(|&&arrival| arrival > first).count() < TOKENS_AFTER_PREFILL {
        match arrivals_rx.recv().await {
            Some(arrival) => arrivals.push(arrival),
            None => {
                return Err(
                    stream_stopped(stream_task, arrivals.len(), stream_max_new_tokens).await,
                )
            }
        }
    }
    // Cancelled through the engine, so its slot is free before the next measurement.
    let mut canceller = client.clone();
    canceller
        .cancel(CancelRequest {
            request_id: stream_id,
        })
        .await
        .context("cancelling the stream")?;
    drop(arrivals_rx);
    stream_task
        .await
        .context("the stream's task")?
        .context("the stream")?;

    let millis = |span: Duration| span.as_secs_f64() * 1e3;
    let solo_span = arrivals[solo_end - 1].saturating_duration_since(arrivals[0]);
    let solo = StreamWindow {
        tokens: solo_tokens,
        window_ms: millis(solo_span),
        tok_s: solo_tokens as f64 / solo_span.as_secs_f64().max(1e-12),
        step_ms: StepLatency::of(&gaps(&arrivals[..solo_end])),
    };
    let prefill = first.saturating_duration_since(submitted);
    let tokens = arrivals
        .iter()
        .filter(|&&arrival| arrival > submitted && arrival <= first)
        .count();
    let overlapping: Vec<Duration> = arrivals
        .windows(2)
        .filter(|pair| pair[1] > submitted && pair[0] < first)
        .map(|pair| pair[1].saturating_duration_since(pair[0]))
        .collect();
    let step_ms = StepLatency::of(&overlapping);
    let during_prefill = StreamWindow {
        tokens,
        window_ms: millis(prefill),
        tok_s: tokens as f64 / prefill.as_secs_f64().max(1e-12),
        step_ms,
    };
    Ok(DecodeDuringPrefill {
        prompt_tokens,
        stream_prompt_tokens,
        stream_max_new_tokens,
        during_over_solo: during_prefill.tok_s / solo.tok_s.max(1e-12),
        longest_gap_ms: step_ms.max_ms,
        time_to_first_token_ms: millis(prefill),
        prefill_tok_s: prompt_tokens as f64 / prefill.as_secs_f64().max(1e-12),
        solo,
        during_prefill,
    })
}

/// The stream: sends each token's arrival time; returns how it finished.
async fn stream(
    mut client: EngineClient<Channel>,
    request: ninfer_protocol::v1::GenerateRequest,
    arrived: mpsc::UnboundedSender<Instant>,
) -> anyhow::Result<FinishReason> {
    let mut stream = client
        .generate(request)
        .await
        .context("starting the stream")?
        .into_inner();
    let mut finish = FinishReason::Unspecified;
    while let Some(message) = stream.message().await.context("the stream's generation")? {
        // A closed receiver means the measurement is over or gave up: stop reading.
        if !message.no_token && arrived.send(Instant::now()).is_err() {
            break;
        }
        let reason =
            FinishReason::try_from(message.finish_reason).unwrap_or(FinishReason::Unspecified);
        if reason != FinishReason::Unspecified {
            finish = reason;
        }
    }
    Ok(finish)
}

/// The arrival time of a generation's first token.
async fn first_token(
    mut client: EngineClient<Channel>,
    request: ninfer_protocol::v1::GenerateRequest,
) -> anyhow::Result<Instant> {
    let mut stream = client
        .generate(request)
        .await
        .context("submitting the long prompt")?
        .into_inner();
    let mut first = None;
    while let Some(message) = stream
        .message()
        .await
        .context("prefilling the long prompt")?
    {
        if !message.no_token {
            first.get_or_insert_with(Instant::now);
        }
    }
    first.context("the long prompt's generation produced no token")
}

/// Why the stream stopped sending tokens before the measurement was done.
async fn stream_stopped(
    task: JoinHandle<anyhow::Result<FinishReason>>,
    tokens: usize,
    asked: usize,
) -> anyhow::Error {
    match task.await {
        Ok(Ok(finish)) => anyhow!(
            "the decoding stream ended ({finish:?}) after {tokens} of its {asked} tokens, before \
             the measurement was done (a small --prefill-time-share makes it decode more per \
             prompt token; a long first --prompt-lengths entry leaves it less of the context)"
        ),
        Ok(Err(problem)) => problem.context("the decoding stream"),
        Err(problem) => anyhow!(problem).context("the decoding stream's task"),
    }
}

/// Best effort on a path that already failed: the engine is stopped after it anyway.
async fn cancel(client: &EngineClient<Channel>, request_id: &str) {
    let mut client = client.clone();
    if let Err(problem) = client
        .cancel(CancelRequest {
            request_id: request_id.to_string(),
        })
        .await
    {
        tracing::warn!("cancelling the decoding stream: {problem}");
    }
}

pub(crate) fn print(figures: &DecodeDuringPrefill) {
    println!(
        "decode during a prefill of {} tokens (one stream, its prompt {} tokens; the long prompt \
         submitted after {} decoded tokens):",
        figures.prompt_tokens, figures.stream_prompt_tokens, figures.solo.tokens
    );
    println!(
        "{:>16} {:>9} {:>7} {:>10} {:>8} {:>8} {:>12}",
        "stream", "tok/s", "tokens", "window ms", "p50 ms", "p99 ms", "max gap ms"
    );
    for (name, window) in [
        ("solo", &figures.solo),
        ("during prefill", &figures.during_prefill),
    ] {
        println!(
            "{:>16} {:>9.2} {:>7} {:>10.1} {:>8.2} {:>8.2} {:>12.2}",
            name,
            window.tok_s,
            window.tokens,
            window.window_ms,
            window.step_ms.p50_ms,
            window.step_ms.p99_ms,
            window.step_ms.max_ms
        );
    }
    println!(
        "  during / solo {:.0}%; longest gap {:.1} ms; long prompt: time to first token {:.1} ms, \
         prefill {:.1} tok/s",
        100.0 * figures.during_over_solo,
        figures.longest_gap_ms,
        figures.time_to_first_token_ms,
        figures.prefill_tok_s
    );
}
