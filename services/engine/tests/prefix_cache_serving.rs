//! The prefix cache through the scheduler: prompts that share a start with earlier ones report
//! the tokens they took from the cache on their events and get the greedy tokens of a
//! scheduler without a cache (sampled ones too), on a full-attention, a Gated DeltaNet and the
//! QSA fixture, also when a long prompt goes in chunks beside a decoding stream.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ninfer_engine::prefix_cache::PrefixCacheSettings;
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::service::scheduler::{
    self, SchedulerCommand, SchedulerCounters, SchedulerLimits, SchedulerResult,
    SpeculativeDecoding, DEFAULT_PREFILL_TIME_SHARE,
};
use ninfer_engine::testing::{collect_tokens, golden_fixture_dir, greedy_request};
use ninfer_engine::{test_device, Backend, Model, SamplingParams, SequenceState};
use tokio::sync::mpsc as async_mpsc;

mod support;

const NEW_TOKENS: usize = 5;
const SAMPLED_TOKENS: usize = 12;

fn open<B: Backend>(backend: &Arc<B>, fixture: &str, work: &Path) -> Arc<Model<B>> {
    let path = work.join(format!("{fixture}.ninfer"));
    support::convert_f32(golden_fixture_dir(fixture), &path);
    Arc::new(Model::open(Arc::clone(backend), &path).expect("open the artifact"))
}

struct Scheduler {
    commands: std::sync::mpsc::Sender<SchedulerCommand>,
    counters: Arc<SchedulerCounters>,
    next_id: usize,
}

impl Scheduler {
    fn start<B: Backend + 'static>(
        model: &Arc<Model<B>>,
        prefix: PrefixCacheSettings,
        chunk_tokens: usize,
    ) -> Self
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        let counters = Arc::new(SchedulerCounters::default());
        let limits = SchedulerLimits {
            max_context: 1024,
            max_sequences: 8,
            prefill_chunk_tokens: chunk_tokens,
            prefill_time_share: DEFAULT_PREFILL_TIME_SHARE,
        };
        let commands = scheduler::start_serving(
            Arc::clone(model),
            limits,
            SpeculativeDecoding::default(),
            prefix,
            Arc::clone(&counters),
        )
        .expect("start the scheduler");
        Scheduler {
            commands,
            counters,
            next_id: 0,
        }
    }

    fn submit(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
    ) -> async_mpsc::Receiver<SchedulerResult> {
        let (events, receiver) = async_mpsc::channel(4096);
        self.next_id += 1;
        let request = greedy_request(
            format!("request-{}", self.next_id),
            prompt.to_vec(),
            max_new_tokens,
            events,
        );
        self.commands
            .send(SchedulerCommand::Submit(request))
            .expect("submit");
        receiver
    }

    /// Greedy tokens and the cached prompt tokens the last event reports.
    fn generate(&mut self, prompt: &[u32]) -> (Vec<u32>, u32) {
        let mut receiver = self.submit(prompt, NEW_TOKENS);
        collect_tokens(&mut receiver)
    }

    /// [`Scheduler::generate`] with sampling: temperature, top-k, top-p, penalties and a seed.
    fn sample(&mut self, prompt: &[u32]) -> (Vec<u32>, u32) {
        let (events, mut receiver) = async_mpsc::channel(4096);
        self.next_id += 1;
        let mut request = greedy_request(
            format!("request-{}", self.next_id),
            prompt.to_vec(),
            SAMPLED_TOKENS,
            events,
        );
        request.sampling = SamplingParams {
            temperature: 1.0,
            top_k: 50,
            top_p: 0.95,
            repetition_penalty: 1.1,
            presence_penalty: 0.3,
            seed: 1234,
            ..SamplingParams::default()
        };
        self.commands
            .send(SchedulerCommand::Submit(request))
            .expect("submit");
        collect_tokens(&mut receiver)
    }
}

fn settings() -> PrefixCacheSettings {
    PrefixCacheSettings {
        budget_bytes: 1 << 30,
        block_tokens: 64,
        checkpoint_interval_blocks: 2,
    }
}

fn random_tokens(rng: &mut Xoshiro256, count: usize, vocab: usize) -> Vec<u32> {
    (0..count)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Waits for a stream's first token (events before it carry none).
fn first_stream_token(receiver: &mut async_mpsc::Receiver<SchedulerResult>) -> u32 {
    while let Some(event) = receiver.blocking_recv() {
        let event = event.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            event.finish.is_none(),
            "the stream ended before its first token"
        );
        if let Some(token) = event.token {
            return token.token_id;
        }
    }
    panic!("the stream closed before its first token");
}

fn served_prompts_reuse_prefixes_and_keep_their_tokens<B: Backend + 'static>(backend: Arc<B>)
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    for fixture in ["qwen3_moe", "qwen3_next", "qwen4_exp"] {
        let work = tempfile::tempdir().unwrap();
        let model = open(&backend, fixture, work.path());
        let hybrid = model.needs_prefix_checkpoints();
        let vocab = model.vocab_size();
        let mut rng = Xoshiro256::seed_from_u64(5);
        let system = random_tokens(&mut rng, 200, vocab);
        let turn = |rng: &mut Xoshiro256, count| {
            [system.clone(), random_tokens(rng, count, vocab)].concat()
        };
        let first = turn(&mut rng, 70);
        let second = [first.clone(), random_tokens(&mut rng, 40, vocab)].concat();
        let third = turn(&mut rng, 30);

        let mut plain = Scheduler::start(&model, PrefixCacheSettings::off(), 0);
        let mut cached = Scheduler::start(&model, settings(), 0);
        // The donor: nothing cached yet; then a later turn that extends it (its last block
        // end with room for a rest is 256) and another that shares only the system prompt.
        let expected = [
            (&first, 0),
            (&second, 256),
            (&third, if hybrid { 128 } else { 192 }),
            (&first, 256),
        ];
        for (index, (prompt, reused)) in expected.into_iter().enumerate() {
            let (reference, none) = plain.generate(prompt);
            assert_eq!(none, 0, "{fixture}: no cache, nothing reused");
            model.profile().snapshot(true);
            let (tokens, cached_tokens) = cached.generate(prompt);
            let prompt_forwards = model.profile().snapshot(true).prefill.forwards;
            assert_eq!(
                cached_tokens, reused,
                "{fixture}: prompt {index}'s cached tokens"
            );
            if index == 0 && fixture != "qwen4_exp" {
                // A hybrid's donor: a piece to its checkpoint at 128, then one forward for the
                // rest that takes the checkpoint at 256 as it passes (no forward of its own).
                assert_eq!(
                    prompt_forwards,
                    if hybrid { 2 } else { 1 },
                    "{fixture}: the donor's prompt forwards"
                );
            }
            assert_eq!(tokens, reference, "{fixture}: prompt {index}'s tokens");
        }
        let prefix = &cached.counters.prefix_cache;
        assert_eq!(prefix.lookups.load(Ordering::Relaxed), 4, "{fixture}");
        assert_eq!(prefix.hits.load(Ordering::Relaxed), 3, "{fixture}");
        assert!(prefix.bytes.load(Ordering::Relaxed) > 0, "{fixture}");

        // Sampled answers (a seed, temperature, top-k, top-p and penalties over the whole
        // prompt) are those of the plain scheduler too: reuse changes neither the logits nor
        // the sampler's draws. Where logits are equal bits (the CPU backend) only: elsewhere a
        // draw near a probability boundary may go either way within the bars.
        let mut unlike_greedy = !backend.computes_on_host();
        let sampled = match backend.computes_on_host() {
            true => vec![&second, &third],
            false => Vec::new(),
        };
        for (index, prompt) in sampled.into_iter().enumerate() {
            let (reference, _) = plain.sample(prompt);
            let (tokens, cached_tokens) = cached.sample(prompt);
            assert!(
                cached_tokens > 0,
                "{fixture}: sampled prompt {index} reused nothing"
            );
            assert_eq!(
                tokens, reference,
                "{fixture}: sampled prompt {index}'s tokens"
            );
            let (greedy, _) = plain.generate(prompt);
            let shared = tokens.len().min(greedy.len());
            unlike_greedy |= tokens[..shared] != greedy[..shared];
        }
        assert!(
            unlike_greedy,
            "{fixture}: the sampled answers are the greedy ones"
        );

        // A long prompt in chunks of 100 tokens beside a decoding stream: chunks end on the
        // cache's checkpoints and alignment, and the tokens are those of the plain scheduler
        // under the same chunking. The long prompt goes in once the stream has its first token
        // (its prompt recorded), so what it finds cached does not hang on thread timing.
        let long = turn(&mut rng, 300);
        let mut outputs = Vec::new();
        for prefix in [PrefixCacheSettings::off(), settings()] {
            let mut scheduler = Scheduler::start(&model, prefix, 100);
            scheduler.generate(&first);
            let mut stream = scheduler.submit(&third, 40);
            let first_token = first_stream_token(&mut stream);
            let mut long_events = scheduler.submit(&long, NEW_TOKENS);
            let (long_tokens, long_cached) = collect_tokens(&mut long_events);
            let (rest, _) = collect_tokens(&mut stream);
            let stream_tokens = [vec![first_token], rest].concat();
            outputs.push((long_tokens, stream_tokens, long_cached));
        }
        assert_eq!(
            outputs[0].0, outputs[1].0,
            "{fixture}: the chunked long prompt's tokens"
        );
        assert_eq!(outputs[0].1, outputs[1].1, "{fixture}: the stream's tokens");
        // The system prompt's last whole block: a block of the first turn's for full attention,
        // the stream's checkpoint at its last block end for a hybrid.
        assert_eq!(
            outputs[1].2, 192,
            "{fixture}: the long prompt's cached tokens"
        );
    }
}
test_device!(served_prompts_reuse_prefixes_and_keep_their_tokens);
