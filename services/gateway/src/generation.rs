//! The API-independent service layer (the shape of the TGI router's `Infer`): runs a
//! [`GenerationPlan`] through the [`GenerationBackend`] and turns the engine's token stream into a
//! stream of neutral text events.
//!
//! Owns: [`Generator`] (the one entry every API uses: [`Generator::start_chat`] for a chat,
//! [`Generator::start_all_choices`] for a planned text prompt), model names and aliases, the
//! per-choice stream (incremental detokenization, stop strings, reasoning split, metrics,
//! cancellation when the receiver is dropped; polled in the task of whoever reads it), and
//! [`collect_generation`] / [`collect_all_generations`] for non-streaming responses. Planning (template, grammar, sampling) is `generation_plan`.
//! Must not touch: JSON shapes of any API, the gateway's HTTP state, or engine selection (the
//! backend does that).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use ninfer_protocol::v1::FinishReason;

use crate::backend::{GenerationBackend, ServedModel};
use crate::error::GatewayError;
use crate::generation_plan::{plan_chat, ChatGenerationRequest, GenerationPlan};
use crate::inline_stream::{Emitter, InlineStream};
use crate::metrics::GatewayMetrics;
use crate::reasoning::{ReasoningSplitter, ReasoningStart, SplitText};
use crate::stop_strings::{StopCheck, StopStringMatcher};
use crate::tokenizer::IncrementalDetokenizer;

/// Where a tool call ends (both Qwen syntaxes).
const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// Why a choice ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishKind {
    /// End-of-sequence token or stop string.
    Stop,
    /// `max_tokens` or the context was reached.
    Length,
    /// The engine cancelled it.
    Cancelled,
}

/// Log-probability of one generated token.
#[derive(Debug, Clone)]
pub struct TokenLogprobEntry {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// Final accounting of one choice.
#[derive(Debug, Clone)]
pub struct GenerationSummary {
    pub finish: FinishKind,
    pub matched_stop: Option<String>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Generated tokens inside the thinking block (`<think>` … `</think>`, the tags included).
    pub reasoning_tokens: u32,
    /// Prompt tokens the engine took from its prefix cache.
    pub cached_tokens: u32,
}

/// What a choice's generation hands its API's handler.
#[derive(Debug, Clone)]
pub enum GenerationEvent {
    Delta {
        text: SplitText,
        logprobs: Vec<TokenLogprobEntry>,
    },
    Finished(GenerationSummary),
}

/// One choice's events, in order; dropping the receiver cancels the generation on the engine.
/// The generation runs as its reader polls it (in the reader's task, see `inline_stream`): a
/// token goes from the engine's stream to the client without waking another task.
pub struct ChoiceReceiver {
    events: InlineStream<Result<GenerationEvent, GatewayError>>,
}

impl ChoiceReceiver {
    /// The next event; `None` after the last.
    pub async fn recv(&mut self) -> Option<Result<GenerationEvent, GatewayError>> {
        self.events.next().await
    }
}

impl futures_util::Stream for ChoiceReceiver {
    type Item = Result<GenerationEvent, GatewayError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.events).poll_next(context)
    }
}

/// Counts a choice in flight until its generation ends or its receiver is dropped (a dropped
/// receiver before the end is a cancelled generation).
struct ChoiceInFlight {
    metrics: Arc<GatewayMetrics>,
    ended: bool,
}

impl ChoiceInFlight {
    fn new(metrics: Arc<GatewayMetrics>) -> Self {
        metrics.in_flight_requests.fetch_add(1, Ordering::Relaxed);
        ChoiceInFlight {
            metrics,
            ended: false,
        }
    }
}

impl ChoiceInFlight {
    /// The generation ran to its end (an answer, or an error sent to the reader).
    fn end(mut self) {
        self.ended = true;
    }
}

impl Drop for ChoiceInFlight {
    fn drop(&mut self) {
        self.metrics
            .in_flight_requests
            .fetch_sub(1, Ordering::Relaxed);
        if !self.ended {
            self.metrics
                .cancelled_generations
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A chat on its way: its plan, one receiver per choice (in order), and the tools whose calls
/// are read out of the answer.
pub struct StartedChat {
    pub plan: GenerationPlan,
    pub receivers: Vec<ChoiceReceiver>,
    /// `None`: no tools declared, or `tool_choice` is `none` (the answer stays text).
    pub callable_tools: Option<Vec<minijinja::Value>>,
}

impl StartedChat {
    /// The one choice of a chat from an API without `n`.
    pub fn into_only_choice(mut self) -> Result<StartedChoice, GatewayError> {
        match (self.receivers.pop(), self.receivers.is_empty()) {
            (Some(receiver), true) => Ok(StartedChoice {
                plan: self.plan,
                receiver,
                callable_tools: self.callable_tools,
            }),
            _ => Err(GatewayError::Internal(
                "a one-choice chat started another number of choices".to_string(),
            )),
        }
    }
}

/// A one-choice chat on its way (see [`StartedChat`]).
pub struct StartedChoice {
    pub plan: GenerationPlan,
    pub receiver: ChoiceReceiver,
    pub callable_tools: Option<Vec<minijinja::Value>>,
}

/// Validates, renders, tokenizes and schedules requests for every API; knows nothing of HTTP.
#[derive(Clone)]
pub struct Generator {
    backend: Arc<dyn GenerationBackend>,
    metrics: Arc<GatewayMetrics>,
    aliases: ModelAliases,
}

/// Other names for served models: `NAME=MODEL`, where a `NAME` ending in `*` matches every
/// name with that prefix (`claude-*=qwen3` answers whatever Claude model a client asks for).
/// A served model's own name always wins; among aliases the first match does.
#[derive(Debug, Clone, Default)]
pub struct ModelAliases {
    aliases: Vec<(String, String)>,
}

impl ModelAliases {
    /// Parses `NAME=MODEL` entries (both sides non-empty).
    pub fn parse(entries: &[String]) -> Result<Self, GatewayError> {
        let mut aliases = Vec::new();
        for entry in entries {
            match entry.split_once('=') {
                Some((name, model)) if !name.trim().is_empty() && !model.trim().is_empty() => {
                    aliases.push((name.trim().to_string(), model.trim().to_string()))
                }
                _ => {
                    return Err(GatewayError::invalid(format!(
                        "model alias `{entry}` is not NAME=MODEL"
                    )))
                }
            }
        }
        Ok(ModelAliases { aliases })
    }

    /// The model `requested` stands for, if an alias matches it.
    pub fn target(&self, requested: &str) -> Option<&str> {
        self.aliases.iter().find_map(|(name, model)| {
            let matches = match name.strip_suffix('*') {
                Some(prefix) => requested.starts_with(prefix),
                None => requested == name,
            };
            matches.then_some(model.as_str())
        })
    }
}

impl Generator {
    pub fn new(
        backend: Arc<dyn GenerationBackend>,
        metrics: Arc<GatewayMetrics>,
        aliases: ModelAliases,
    ) -> Self {
        Generator {
            backend,
            metrics,
            aliases,
        }
    }

    pub fn backend(&self) -> &Arc<dyn GenerationBackend> {
        &self.backend
    }

    /// The served model a request names, directly or through an alias (404/503 as
    /// [`crate::backend::BackendSnapshot::resolve_model`]).
    pub fn resolve_model(&self, requested: &str) -> Result<ServedModel, GatewayError> {
        let snapshot = self.backend.snapshot();
        if !snapshot.models.contains_key(requested) {
            if let Some(target) = self.aliases.target(requested) {
                return snapshot.resolve_model(target);
            }
        }
        snapshot.resolve_model(requested)
    }

    /// Plans a chat ([`plan_chat`]) and starts every choice: the one way each API's chat reaches
    /// the engine.
    pub async fn start_chat(
        &self,
        request: &ChatGenerationRequest,
    ) -> Result<StartedChat, GatewayError> {
        let plan = plan_chat(request).await?;
        let receivers = self.start_all_choices(&plan).await?;
        Ok(StartedChat {
            plan,
            receivers,
            callable_tools: request.conversation.callable_tool_definitions(),
        })
    }

    /// Starts choice `choice_index` of `plan`. Errors before the first token come back here;
    /// later ones arrive as events. Dropping the receiver cancels the generation.
    pub async fn start_choice(
        &self,
        plan: &GenerationPlan,
        choice_index: u32,
    ) -> Result<ChoiceReceiver, GatewayError> {
        let started = Instant::now();
        let token_stream = self
            .backend
            .generate(plan.engine_request(choice_index))
            .await?;
        let metrics = self.metrics.clone();
        let plan = plan.clone();
        metrics
            .prompt_tokens
            .fetch_add(plan.prompt_token_ids.len() as u64, Ordering::Relaxed);
        let in_flight = ChoiceInFlight::new(metrics.clone());
        let events = InlineStream::new(move |sender| async move {
            let last = run_generation(&metrics, plan, token_stream, &sender, started).await;
            // Ended here, not when the reader drops the receiver after the last event.
            in_flight.end();
            sender.send(last).await;
        });
        Ok(ChoiceReceiver { events })
    }

    /// Starts all choices of a plan (so their errors surface before any response is sent).
    pub async fn start_all_choices(
        &self,
        plan: &GenerationPlan,
    ) -> Result<Vec<ChoiceReceiver>, GatewayError> {
        let mut receivers = Vec::new();
        for choice_index in 0..plan.options.choices {
            receivers.push(self.start_choice(plan, choice_index).await?);
        }
        Ok(receivers)
    }
}

async fn run_generation(
    metrics: &GatewayMetrics,
    plan: GenerationPlan,
    mut token_stream: crate::backend::TokenStream,
    sender: &Emitter<Result<GenerationEvent, GatewayError>>,
    started: Instant,
) -> Result<GenerationEvent, GatewayError> {
    let tokenizer = &plan.model.resources.tokenizer;
    let mut detokenizer = IncrementalDetokenizer::new(true);
    let mut stop_matcher = StopStringMatcher::new(plan.options.stop.clone());
    let mut splitter = plan.reasoning.map(ReasoningSplitter::new);
    let mut completion_tokens: u32 = 0;
    // Reasoning is counted by token ids: the thinking block's tags are single tokens.
    let think_open = tokenizer.token_to_id("<think>");
    let think_close = tokenizer.token_to_id("</think>");
    let mut in_reasoning = plan.reasoning == Some(ReasoningStart::InsideThinking);
    let mut reasoning_tokens: u32 = 0;
    let mut cached_tokens: u32 = 0;
    let mut last_token_at: Option<Instant> = None;
    // With one tool call allowed, the answer ends at the first `</tool_call>`.
    let mut answer_so_far = String::new();
    let single_tool_call = plan.guidance.single_tool_call;
    let prompt_tokens = plan.prompt_token_ids.len() as u32;
    // The token's text is moved from stage to stage, not copied.
    let split = |splitter: &mut Option<ReasoningSplitter>, text: String| -> SplitText {
        match splitter {
            Some(splitter) => splitter.push(text),
            None => SplitText {
                reasoning: String::new(),
                content: text,
            },
        }
    };
    loop {
        // A client that went away drops this generation mid-wait, and with it the token
        // stream, which cancels the engine sequence.
        let token = match token_stream.next().await {
            Some(Ok(token)) => token,
            Some(Err(error)) => return Err(error),
            None => {
                // The engine closed the stream without a finish reason: it went away mid-answer.
                return Err(GatewayError::NoEngineAvailable(
                    "the engine stopped mid-generation".to_string(),
                ));
            }
        };
        cached_tokens = cached_tokens.max(token.cached_prompt_tokens);
        let now = Instant::now();
        let mut released = String::new();
        let mut logprobs = Vec::new();
        if !token.no_token {
            completion_tokens += 1;
            if plan.reasoning.is_some() {
                if Some(token.token_id) == think_open && completion_tokens == 1 {
                    in_reasoning = true;
                }
                if in_reasoning {
                    reasoning_tokens += 1;
                }
                if Some(token.token_id) == think_close {
                    in_reasoning = false;
                }
            }
            metrics.completion_tokens.fetch_add(1, Ordering::Relaxed);
            match last_token_at {
                None => metrics
                    .time_to_first_token
                    .observe(now.duration_since(started).as_secs_f64()),
                Some(previous) => metrics
                    .inter_token_latency
                    .observe(now.duration_since(previous).as_secs_f64()),
            }
            last_token_at = Some(now);
            match detokenizer.push(tokenizer, token.token_id) {
                Ok(text) => released = text,
                Err(error) => {
                    return Err(GatewayError::Internal(format!(
                        "engine sent an undecodable token: {error}"
                    )))
                }
            }
            if plan.options.logprobs {
                logprobs.push(TokenLogprobEntry {
                    token: tokenizer.token_text(token.token_id).unwrap_or_default(),
                    logprob: token.logprob,
                    top: token
                        .top_logprobs
                        .iter()
                        .map(|alternative| {
                            (
                                tokenizer
                                    .token_text(alternative.token_id)
                                    .unwrap_or_default(),
                                alternative.logprob,
                            )
                        })
                        .collect(),
                });
            }
        }
        let engine_finish =
            FinishReason::try_from(token.finish_reason).unwrap_or(FinishReason::Unspecified);
        if engine_finish != FinishReason::Unspecified {
            released.push_str(&detokenizer.finish(tokenizer).unwrap_or_default());
        }
        let mut matched_stop = None;
        let mut text = match stop_matcher.push(released) {
            StopCheck::Continue { release } => split(&mut splitter, release),
            StopCheck::Stopped { release, matched } => {
                matched_stop = Some(matched);
                split(&mut splitter, release)
            }
        };
        let mut tool_call_closed = false;
        if single_tool_call {
            let before = answer_so_far.len();
            answer_so_far.push_str(&text.content);
            // Only the new text and the tag's length before it can hold a new match: no
            // rescanning of the whole answer per token.
            let mut search_from = before.saturating_sub(TOOL_CALL_CLOSE.len());
            while !answer_so_far.is_char_boundary(search_from) {
                search_from -= 1;
            }
            if let Some(close) = answer_so_far[search_from..]
                .find(TOOL_CALL_CLOSE)
                .map(|at| at + search_from)
            {
                let end = close + TOOL_CALL_CLOSE.len();
                text.content
                    .truncate(end.saturating_sub(before).min(text.content.len()));
                tool_call_closed = true;
            }
        }
        let finish = if matched_stop.is_some() || tool_call_closed {
            Some(FinishKind::Stop)
        } else {
            match engine_finish {
                FinishReason::Unspecified => None,
                FinishReason::StopToken => Some(FinishKind::Stop),
                FinishReason::Length | FinishReason::ContextFull => Some(FinishKind::Length),
                FinishReason::Cancelled => Some(FinishKind::Cancelled),
            }
        };
        if let Some(finish) = finish {
            if matched_stop.is_none() && !tool_call_closed {
                let rest = stop_matcher.finish();
                append(&mut text, split(&mut splitter, rest));
            }
            // After the one allowed tool call nothing held back belongs to the answer.
            if let Some(splitter) = splitter.as_mut().filter(|_| !tool_call_closed) {
                append(&mut text, splitter.finish());
            }
            if !text.is_empty() || !logprobs.is_empty() {
                sender
                    .send(Ok(GenerationEvent::Delta { text, logprobs }))
                    .await;
            }
            // Engines that count the prompt differently (e.g. cached prefix) still report ours.
            let completion_tokens = if matched_stop.is_none() && token.completion_tokens > 0 {
                token.completion_tokens
            } else {
                completion_tokens
            };
            metrics
                .request_duration
                .observe(started.elapsed().as_secs_f64());
            let summary = GenerationSummary {
                finish,
                matched_stop,
                prompt_tokens,
                completion_tokens,
                reasoning_tokens: reasoning_tokens.min(completion_tokens),
                cached_tokens,
            };
            // Returning drops the token stream: after a stop string that cancels the engine.
            return Ok(GenerationEvent::Finished(summary));
        }
        if !text.is_empty() || !logprobs.is_empty() {
            sender
                .send(Ok(GenerationEvent::Delta { text, logprobs }))
                .await;
        }
    }
}

fn append(into: &mut SplitText, more: SplitText) {
    into.reasoning.push_str(&more.reasoning);
    into.content.push_str(&more.content);
}

/// A whole choice, for non-streaming responses.
#[derive(Debug, Clone)]
pub struct CollectedGeneration {
    pub content: String,
    pub reasoning: String,
    pub logprobs: Vec<TokenLogprobEntry>,
    pub summary: GenerationSummary,
}

/// Reads every choice to its end, all at once: each choice's tokens are taken as the engine
/// sends them, not after the choices before it (the generations run as they are read).
pub async fn collect_all_generations(
    receivers: Vec<ChoiceReceiver>,
) -> Result<Vec<CollectedGeneration>, GatewayError> {
    futures_util::future::try_join_all(receivers.into_iter().map(collect_generation)).await
}

/// Reads a choice to the end.
pub async fn collect_generation(
    mut receiver: ChoiceReceiver,
) -> Result<CollectedGeneration, GatewayError> {
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut logprobs = Vec::new();
    while let Some(event) = receiver.recv().await {
        match event? {
            GenerationEvent::Delta {
                text,
                logprobs: more,
            } => {
                content.push_str(&text.content);
                reasoning.push_str(&text.reasoning);
                logprobs.extend(more);
            }
            GenerationEvent::Finished(summary) => {
                return Ok(CollectedGeneration {
                    content,
                    reasoning,
                    logprobs,
                    summary,
                })
            }
        }
    }
    Err(GatewayError::Internal(
        "generation ended without a result".to_string(),
    ))
}
