//! Resuming a generation whose engine went away mid-answer (killed, crashed or restarted).
//!
//! Owns: what a generation keeps to continue elsewhere (its request and the tokens already
//! passed on), the continuation request — the prompt followed by those tokens, marked as the
//! generation's own output (the engine moves the reasoning block and the grammar past them), the
//! rest of the token budget, the seeded random stream advanced past the draws they used — and
//! [`ResumeCounters`]. Greedy continuations are exactly the uninterrupted text, and so are
//! seeded sampled ones, drafting or not (the engine uses one draw per token).
//! The stream that does it ([`resuming_token_stream`]) waits for a ready engine and restarts the
//! generation there through [`EngineSource`].
//! Must not touch: picking or watching engines (`engine_pool` does, as the [`EngineSource`]),
//! HTTP or API shapes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{Stream, StreamExt};
use ninfer_protocol::v1::{FinishReason, GenerateRequest, GeneratedToken};

use super::{ResumeCounts, TokenStream};
use crate::error::{error_from_engine_status, GatewayError};

/// Where a resumed generation gets its engine streams: the engine pool, as this module sees it.
pub trait EngineSource: Clone + Send + Sync + 'static {
    /// One engine call's tokens; dropping it cancels the generation there.
    type Stream: Stream<Item = Result<GeneratedToken, tonic::Status>> + Send + Unpin + 'static;

    /// Starts `request` on a ready engine.
    fn start(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'static, Result<Self::Stream, GatewayError>>;

    /// Whether an engine serving `model_name` is ready now.
    fn model_ready(&self, model_name: &str) -> bool;

    /// The engine behind `stream` went away (marked down until it answers again).
    fn report_lost(&self, stream: &Self::Stream, error: String);

    /// How long an answer waits for a ready engine (zero: it does not resume).
    fn resume_timeout(&self) -> Duration;

    fn counters(&self) -> &ResumeCounters;
}

/// How often an answer waiting to resume looks for a ready engine.
const RESUME_POLL: Duration = Duration::from_millis(50);

/// Streams resumed after their engine went away, and resumptions that gave up.
#[derive(Debug, Default)]
pub struct ResumeCounters {
    pub resumed: AtomicU64,
    pub abandoned: AtomicU64,
}

impl ResumeCounters {
    pub fn counts(&self) -> ResumeCounts {
        ResumeCounts {
            resumed: self.resumed.load(Ordering::Relaxed),
            abandoned: self.abandoned.load(Ordering::Relaxed),
        }
    }
}

/// One generation as far as it got: the request it started with and every token passed on.
#[derive(Debug, Clone)]
pub struct GenerationProgress {
    original: GenerateRequest,
    received: Vec<u32>,
    resumptions: u32,
    /// Tokens generated before the continuation now running (its prompt holds them).
    carried: u32,
}

impl GenerationProgress {
    pub fn new(original: GenerateRequest) -> Self {
        GenerationProgress {
            original,
            received: Vec::new(),
            resumptions: 0,
            carried: 0,
        }
    }

    pub fn model_name(&self) -> &str {
        &self.original.model_name
    }

    pub fn request_id(&self) -> &str {
        &self.original.request_id
    }

    pub fn tokens_received(&self) -> usize {
        self.received.len()
    }

    /// Records a token about to be passed on and, for a token of a continuation, rewrites its
    /// usage figures to the whole generation's (the continuation's prompt holds the tokens
    /// generated before it).
    pub fn record(&mut self, mut token: GeneratedToken) -> GeneratedToken {
        let carried = self.carried;
        if token.finish_reason != FinishReason::Cancelled as i32 {
            self.received.push(token.token_id);
        }
        if carried > 0 {
            token.prompt_tokens = token.prompt_tokens.saturating_sub(carried);
            token.completion_tokens = token.completion_tokens.saturating_add(carried);
            token.cached_prompt_tokens = token.cached_prompt_tokens.min(token.prompt_tokens);
        }
        token
    }

    /// The request that continues this generation on another engine (the engine moves its
    /// reasoning block and grammar past the tokens already produced), or `None` when nothing
    /// is left of its token budget.
    pub fn continuation(&mut self) -> Option<GenerateRequest> {
        let original = &self.original;
        let received = &self.received;
        let generated = u32::try_from(received.len()).ok()?;
        let max_new_tokens = original.max_new_tokens.checked_sub(generated)?;
        if max_new_tokens == 0 {
            return None;
        }
        let mut next = original.clone();
        next.request_id = format!("{}-resumed-{}", original.request_id, self.resumptions + 1);
        next.prompt_token_ids.extend_from_slice(received);
        next.max_new_tokens = max_new_tokens;
        next.resumed_output_tokens = generated;
        if let Some(sampling) = next.sampling.as_mut() {
            // One draw per sampled token, drafted or not (greedy draws none).
            if sampling.temperature > 0.0 {
                sampling.random_stream_position += u64::from(generated);
            }
        }
        self.resumptions += 1;
        self.carried = generated;
        Some(next)
    }
}

/// A generation's tokens across engines: when its engine goes away mid-answer, it waits (at
/// most the pool's resume timeout) for a ready engine and continues there, so the caller sees
/// one uninterrupted stream; if it cannot, the caller gets the error the engine's loss gave.
pub fn resuming_token_stream<S: EngineSource>(
    pool: S,
    request: GenerateRequest,
    first: S::Stream,
) -> TokenStream {
    let state = ResumingGeneration {
        pool,
        progress: GenerationProgress::new(request),
        current: Some(first),
        finished: false,
    };
    Box::pin(ResumingTokenStream {
        generation: Some(state),
        resuming: None,
    })
}

/// The token stream of a [`ResumingGeneration`], polled by hand: a token goes straight from
/// the engine stream to the reader (no future rebuilt per token, no state moved), and only a
/// lost engine starts the resumption, a future that owns the generation until it is done.
struct ResumingTokenStream<S: EngineSource> {
    /// `None` while `resuming` holds it.
    generation: Option<ResumingGeneration<S>>,
    resuming: Option<Resumption<S>>,
}

/// A resumption in progress: it gives the generation back with its outcome.
type Resumption<S> = BoxFuture<'static, (ResumingGeneration<S>, Result<(), GatewayError>)>;

// Nothing in it is ever pinned in place: the generation is moved in and out of the
// resumption's future, which is boxed.
impl<S: EngineSource> Unpin for ResumingTokenStream<S> {}

impl<S: EngineSource> Stream for ResumingTokenStream<S> {
    type Item = Result<GeneratedToken, GatewayError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        loop {
            if let Some(resuming) = self.resuming.as_mut() {
                let Poll::Ready((mut generation, resumed)) = resuming.as_mut().poll(context) else {
                    return Poll::Pending;
                };
                self.resuming = None;
                if let Err(error) = resumed {
                    generation.finished = true;
                    self.generation = Some(generation);
                    return Poll::Ready(Some(Err(error)));
                }
                self.generation = Some(generation);
            }
            let Some(generation) = self.generation.as_mut() else {
                return Poll::Ready(None);
            };
            if generation.finished {
                return Poll::Ready(None);
            }
            let Some(stream) = generation.current.as_mut() else {
                generation.finished = true;
                return Poll::Ready(Some(Err(GatewayError::Internal(
                    "the generation lost its engine stream".to_string(),
                ))));
            };
            let failure = match stream.poll_next_unpin(context) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(token))) => {
                    if token.finish_reason != FinishReason::Unspecified as i32 {
                        generation.finished = true;
                    }
                    return Poll::Ready(Some(Ok(generation.progress.record(token))));
                }
                Poll::Ready(Some(Err(status))) if is_connection_failure(&status) => status,
                Poll::Ready(Some(Err(status))) => {
                    generation.finished = true;
                    return Poll::Ready(Some(Err(error_from_engine_status(&status))));
                }
                Poll::Ready(None) => tonic::Status::unavailable(
                    "the engine's stream ended before the generation's last token",
                ),
            };
            let Some(mut generation) = self.generation.take() else {
                return Poll::Ready(None);
            };
            self.resuming = Some(Box::pin(async move {
                let resumed = generation.resume(&failure).await;
                (generation, resumed)
            }));
        }
    }
}

struct ResumingGeneration<S: EngineSource> {
    pool: S,
    progress: GenerationProgress,
    /// The engine stream now running (dropping it cancels the generation there).
    current: Option<S::Stream>,
    finished: bool,
}

impl<S: EngineSource> ResumingGeneration<S> {
    /// Continues the generation on a ready engine after `failure` took its engine away.
    async fn resume(&mut self, failure: &tonic::Status) -> Result<(), GatewayError> {
        let pool = self.pool.clone();
        if let Some(lost) = self.current.take() {
            pool.report_lost(&lost, failure.message().to_string());
        }
        let lost_error = error_from_engine_status(failure);
        if pool.resume_timeout().is_zero() {
            return Err(lost_error);
        }
        let request_id = self.progress.request_id().to_string();
        let abandon = |why: &str| {
            pool.counters().abandoned.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%request_id, why, "an answer whose engine went away could not be resumed");
            Err(error_from_engine_status(failure))
        };
        let Some(continuation) = self.progress.continuation() else {
            return abandon("nothing is left of its token budget");
        };
        tracing::warn!(
            %request_id,
            tokens_sent = self.progress.tokens_received(),
            error = %failure.message(),
            "the engine went away mid-answer; resuming on the next ready engine"
        );
        let deadline = tokio::time::Instant::now() + pool.resume_timeout();
        loop {
            if pool.model_ready(self.progress.model_name()) {
                match pool.start(continuation.clone()).await {
                    Ok(stream) => {
                        self.current = Some(stream);
                        pool.counters().resumed.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(%request_id, "resumed");
                        return Ok(());
                    }
                    // Not back yet (or busy): keep waiting within the deadline.
                    Err(
                        GatewayError::NoEngineAvailable(_)
                        | GatewayError::Overloaded(_)
                        | GatewayError::ModelNotFound(_),
                    ) => {}
                    Err(error) => {
                        pool.counters().abandoned.fetch_add(1, Ordering::Relaxed);
                        return Err(error);
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return abandon("no engine was ready within the resume timeout");
            }
            tokio::time::sleep(RESUME_POLL).await;
        }
    }
}

/// Whether `status` means the engine (or the connection to it) is gone, not that it refused.
pub fn is_connection_failure(status: &tonic::Status) -> bool {
    match status.code() {
        tonic::Code::Unavailable => true,
        tonic::Code::Unknown | tonic::Code::Cancelled => {
            let message = status.message().to_ascii_lowercase();
            // "operation was canceled": hyper's answer when the connection dies under the call.
            [
                "transport",
                "connection",
                "broken pipe",
                "reset",
                "h2 protocol",
                "closed",
                "canceled",
            ]
            .iter()
            .any(|needle| message.contains(needle))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ninfer_protocol::v1::SamplingParameters;

    fn request(temperature: f32) -> GenerateRequest {
        GenerateRequest {
            request_id: "r".into(),
            prompt_token_ids: vec![1, 2, 3],
            max_new_tokens: 10,
            sampling: Some(SamplingParameters {
                temperature,
                seed: Some(9),
                ..Default::default()
            }),
            model_name: "m".into(),
            ..Default::default()
        }
    }

    fn token(id: u32, prompt: u32, completion: u32) -> GeneratedToken {
        GeneratedToken {
            token_id: id,
            prompt_tokens: prompt,
            completion_tokens: completion,
            ..Default::default()
        }
    }

    #[test]
    fn a_continuation_carries_the_sent_tokens_the_rest_of_the_budget_and_the_stream_position() {
        let mut progress = GenerationProgress::new(request(0.7));
        progress.record(token(40, 3, 1));
        progress.record(token(41, 3, 2));
        let next = progress.continuation().unwrap_or_default();
        assert_eq!(next.prompt_token_ids, vec![1, 2, 3, 40, 41]);
        assert_eq!(next.max_new_tokens, 8);
        assert_eq!(next.request_id, "r-resumed-1");
        assert_eq!(next.resumed_output_tokens, 2);
        let sampling = next.sampling.unwrap_or_default();
        assert_eq!(
            (sampling.seed, sampling.random_stream_position),
            (Some(9), 2)
        );
        // The continuation's usage reads as the whole generation's.
        let third = progress.record(token(42, 5, 1));
        assert_eq!((third.prompt_tokens, third.completion_tokens), (3, 3));
        let again = progress.continuation().unwrap_or_default();
        assert_eq!(again.prompt_token_ids, vec![1, 2, 3, 40, 41, 42]);
        assert_eq!(again.resumed_output_tokens, 3);
        assert_eq!(again.sampling.unwrap_or_default().random_stream_position, 3);
        // Greedy draws nothing.
        let mut greedy = GenerationProgress::new(request(0.0));
        greedy.record(token(40, 3, 1));
        let next = greedy.continuation().unwrap_or_default();
        assert_eq!(next.sampling.unwrap_or_default().random_stream_position, 0);
        // Nothing left to generate: nothing to continue.
        let mut spent = GenerationProgress::new(GenerateRequest {
            max_new_tokens: 1,
            ..request(0.0)
        });
        spent.record(token(40, 3, 1));
        assert!(spent.continuation().is_none());
    }

    type Scripted = futures_util::stream::BoxStream<'static, Result<GeneratedToken, tonic::Status>>;

    /// An engine pool whose engine comes back `ready_after` polls of `model_ready` (never when
    /// `None`) and then answers a continuation with `continuation_tokens`.
    #[derive(Clone)]
    struct ScriptedPool {
        ready_after: Option<usize>,
        readiness_checks: std::sync::Arc<AtomicU64>,
        continuation_tokens: Vec<u32>,
        started: std::sync::Arc<std::sync::Mutex<Vec<GenerateRequest>>>,
        counters: std::sync::Arc<ResumeCounters>,
    }

    impl ScriptedPool {
        fn new(ready_after: Option<usize>, continuation_tokens: Vec<u32>) -> Self {
            ScriptedPool {
                ready_after,
                readiness_checks: Default::default(),
                continuation_tokens,
                started: Default::default(),
                counters: Default::default(),
            }
        }
    }

    impl EngineSource for ScriptedPool {
        type Stream = Scripted;

        fn start(
            &self,
            request: GenerateRequest,
        ) -> BoxFuture<'static, Result<Self::Stream, GatewayError>> {
            let tokens: Vec<_> = self
                .continuation_tokens
                .iter()
                .enumerate()
                .map(|(index, &id)| {
                    let last = index + 1 == self.continuation_tokens.len();
                    Ok(GeneratedToken {
                        token_id: id,
                        finish_reason: if last {
                            FinishReason::Length as i32
                        } else {
                            FinishReason::Unspecified as i32
                        },
                        ..Default::default()
                    })
                })
                .collect();
            self.started
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(request);
            Box::pin(async move { Ok(futures_util::stream::iter(tokens).boxed()) })
        }

        fn model_ready(&self, _model_name: &str) -> bool {
            let checks = self.readiness_checks.fetch_add(1, Ordering::SeqCst) as usize;
            self.ready_after.is_some_and(|after| checks >= after)
        }

        fn report_lost(&self, _stream: &Self::Stream, _error: String) {}

        fn resume_timeout(&self) -> Duration {
            Duration::from_millis(300)
        }

        fn counters(&self) -> &ResumeCounters {
            &self.counters
        }
    }

    /// Two tokens, then `failure`: an engine that went away (or refused) mid-answer.
    fn failing_engine(failure: tonic::Status) -> Scripted {
        futures_util::stream::iter(vec![Ok(token(40, 3, 1)), Ok(token(41, 3, 2)), Err(failure)])
            .boxed()
    }

    async fn drain(stream: TokenStream) -> (Vec<u32>, Option<GatewayError>) {
        let mut tokens = Vec::new();
        let mut stream = stream;
        while let Some(item) = stream.next().await {
            match item {
                Ok(token) => tokens.push(token.token_id),
                Err(error) => return (tokens, Some(error)),
            }
        }
        (tokens, None)
    }

    #[tokio::test]
    async fn a_lost_engine_that_comes_back_continues_the_answer_without_a_seam() {
        let pool = ScriptedPool::new(Some(3), vec![42, 43]);
        let stream = resuming_token_stream(
            pool.clone(),
            request(0.7),
            failing_engine(tonic::Status::unavailable("transport error")),
        );
        let (tokens, error) = drain(stream).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(tokens, vec![40, 41, 42, 43]);
        let started = pool
            .started
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        assert_eq!(started.len(), 1);
        assert_eq!(started[0].prompt_token_ids, vec![1, 2, 3, 40, 41]);
        let counts = pool.counters.counts();
        assert_eq!((counts.resumed, counts.abandoned), (1, 0));
    }

    #[tokio::test]
    async fn a_lost_engine_that_does_not_come_back_in_time_ends_with_the_error_it_gave() {
        let pool = ScriptedPool::new(None, vec![42]);
        let lost = tonic::Status::unavailable("transport error");
        let expected = error_from_engine_status(&lost).to_string();
        let stream = resuming_token_stream(pool.clone(), request(0.0), failing_engine(lost));
        let started = std::time::Instant::now();
        let (tokens, error) = drain(stream).await;
        assert_eq!(tokens, vec![40, 41]);
        let error = error.unwrap_or_else(|| panic!("the answer ended without an error"));
        assert!(
            matches!(error, GatewayError::NoEngineAvailable(_)),
            "{error:?}"
        );
        assert_eq!(error.to_string(), expected);
        // It waited for the engine as long as the pool allows (and then gave up).
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        assert!(pool
            .started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty());
        let counts = pool.counters.counts();
        assert_eq!((counts.resumed, counts.abandoned), (0, 1));
    }

    #[tokio::test]
    async fn an_engine_that_refuses_mid_answer_is_not_resumed() {
        let pool = ScriptedPool::new(Some(0), vec![42]);
        let stream = resuming_token_stream(
            pool.clone(),
            request(0.0),
            failing_engine(tonic::Status::invalid_argument("bad grammar")),
        );
        let (tokens, error) = drain(stream).await;
        assert_eq!(tokens, vec![40, 41]);
        assert!(
            matches!(error, Some(GatewayError::InvalidRequest { .. })),
            "{error:?}"
        );
        let counts = pool.counters.counts();
        assert_eq!((counts.resumed, counts.abandoned), (0, 0));
    }
}
