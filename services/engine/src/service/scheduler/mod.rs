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
//! work's share of the time is held by the accounting (`prefill_share.rs`).
//!
//! The parts, one job each: [`limits`] (settings), [`messages`] (events and errors),
//! [`requests`] (requests and commands), [`counters`], `admission.rs` (commands as they arrive),
//! `prompt_chunks.rs` and `prefill_share.rs` (long prompts beside decoding), `stepping.rs` (a
//! generation step), `speculative.rs` (drafting and verification), `row_sampling.rs` (a token
//! from each row), `sequence.rs` (a running sequence's state). This file starts the scheduler
//! thread and runs its loop.

mod admission;
pub(super) mod counters;
pub(super) mod limits;
pub(super) mod messages;
mod prefill_share;
mod prompt_chunks;
pub(super) mod requests;
mod row_sampling;
mod sequence;
mod speculative;
mod stepping;

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use counters::SchedulerCounters;
pub use limits::{
    SchedulerLimits, SpeculativeDecoding, DEFAULT_PREFILL_CHUNK_TOKENS, DEFAULT_PREFILL_TIME_SHARE,
    MAX_DRAFT_TOKENS,
};
pub use messages::{
    SampledToken, SchedulerError, SchedulerEvent, SchedulerResult, SequenceFinish, TokenProbability,
};
pub use prefill_share::PrefillShare;
pub use requests::{GenerationRequest, PromptImages, SchedulerCommand};

use admission::{handle, Admission};
use prompt_chunks::{feed_prompt_chunks, feed_to_checkpoints, record_prompt};
use sequence::{has_prompt_work, Running};
use stepping::generation_step;

use crate::backend::Backend;
use crate::model::{Model, SequenceState};
use crate::prefix_cache::{PrefixCache, PrefixCacheSettings};
use crate::service::scoring::Scoring;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constraint::Guide;
    use crate::sampling::SamplingParams;
    use crate::testing::{write_tiny_model, TinyArchitecture, TinyModelOptions};
    use tokio::sync::mpsc as async_mpsc;

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
            images: None,
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
            // One sampleable id: the backend's candidates (the row's largest logits) rarely
            // hold it, and a row whose candidates are all padding is sampled whole.
            let only_first = sampled_tokens(Arc::clone(&backend), 1, top_k, 16, &[]);
            assert!(
                only_first.iter().all(|&id| id == 0),
                "top_k {top_k}: {only_first:?}"
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
                images: None,
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

    /// A greedy request on `events`.
    fn greedy_request(
        id: &str,
        prompt: Vec<u32>,
        max_new_tokens: usize,
        events: async_mpsc::Sender<SchedulerResult>,
    ) -> GenerationRequest {
        crate::testing::greedy_request(id.to_string(), prompt, max_new_tokens, events)
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
