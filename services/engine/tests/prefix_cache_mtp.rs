//! Prefix reuse for sequences that draft with the MTP head: a restored prefix brings the head's
//! state with it, so the head's draft logits after a reused prefix equal those after the whole
//! prompt (bit for bit on the CPU backend, within the CUDA bars on a GPU) on every fixture with
//! an MTP head, on and off checkpoints; blocks a sequence without the head kept serve a
//! speculating one only once a speculating sequence added the head's share. Through the
//! scheduler, speculating requests report cached prompt tokens and keep both their greedy
//! tokens and their drafts' acceptance (the drafts come from the restored head state) equal to
//! a scheduler without a cache.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ninfer_engine::model::MtpState;
use ninfer_engine::prefix_cache::{
    MtpProgress, PrefixCache, PrefixCacheCounters, PrefixCacheSettings,
};
use ninfer_engine::sampling::{argmax, Xoshiro256};
use ninfer_engine::service::scheduler::{
    self, SchedulerCommand, SchedulerCounters, SchedulerLimits, SpeculativeDecoding,
    DEFAULT_PREFILL_TIME_SHARE,
};
use ninfer_engine::testing::{
    collect_tokens, golden_fixture_dir, greedy_request, json_numbers, max_abs_difference,
};
use ninfer_engine::{test_device, Backend, Model, SequenceInput, SequenceState};
use tokio::sync::mpsc as async_mpsc;

mod support;

/// Blocks of the delta rule's chunk, a checkpoint every second block (as `prefix_cache.rs`).
const BLOCK: usize = 64;
/// The fixtures with an MTP head: random MoE, random dense, and the trained MoE whose drafts
/// are often right.
const MTP_FIXTURES: [&str; 3] = ["qwen3_5_moe", "qwen3_5", "qwen3_5_moe_trained"];

fn convert(fixture: &str, output: &Path) -> PathBuf {
    let path = output.join(format!("{fixture}.ninfer"));
    support::convert_f32(golden_fixture_dir(fixture), &path);
    path
}

fn settings() -> PrefixCacheSettings {
    PrefixCacheSettings {
        budget_bytes: 1 << 30,
        block_tokens: BLOCK,
        checkpoint_interval_blocks: 2,
    }
}

fn random_tokens(rng: &mut Xoshiro256, count: usize, vocab: usize) -> Vec<u32> {
    (0..count)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// What a prompt's prefill gives a speculating sequence: the main model's last logits and the
/// head's draft logits for the token after the greedy next one.
struct Drafted {
    reused: usize,
    logits: Vec<f32>,
    draft_logits: Vec<f32>,
}

/// The main model over `tokens` from `state`'s position: the final-normed hidden rows (host)
/// and the last row's logits.
fn forward<B: Backend>(
    model: &Model<B>,
    state: &mut SequenceState<B>,
    tokens: &[u32],
) -> (Vec<f32>, Vec<f32>) {
    let backend = model.backend();
    let hidden = model
        .forward_hidden(&mut [SequenceInput { state, tokens }], None)
        .unwrap();
    let last = backend.gather_rows(&hidden, &[tokens.len() - 1]).unwrap();
    (
        backend.download(&hidden).unwrap(),
        model.head_logits(&last).unwrap(),
    )
}

/// The head over every pending pair; the draft logits of the last.
fn head<B: Backend>(
    model: &Model<B>,
    mtp: &mut MtpState<B>,
    hidden: &[f32],
    tokens: &[u32],
) -> Vec<f32> {
    let backend = model.backend();
    let rows = backend
        .upload(hidden, tokens.len(), model.spec().common.hidden_size)
        .unwrap();
    let out = model.mtp_forward(mtp, &rows, tokens).unwrap();
    let last = backend.gather_rows(&out, &[tokens.len() - 1]).unwrap();
    model.mtp_draft_logits(&last).unwrap()
}

/// The whole prompt, no cache: its logits, then the head over all its pairs (the last paired
/// with the greedy next token).
fn reference<B: Backend>(model: &Model<B>, prompt: &[u32]) -> Drafted {
    let mut state = model.new_sequence(prompt.len() + 2).unwrap();
    let mut mtp = model.new_mtp_state(prompt.len() + 2).unwrap();
    let (hidden, logits) = forward(model, &mut state, prompt);
    let next = argmax(&logits);
    let tokens = [&prompt[1..], &[next]].concat();
    let draft_logits = head(model, &mut mtp, &hidden, &tokens);
    Drafted {
        reused: 0,
        logits,
        draft_logits,
    }
}

/// Feeds `prompt` as the scheduler feeds a speculating sequence with a prefix cache: the
/// restored prefix with the head's state and the pending pair at its end, pieces up to the
/// cache's checkpoints (recorded after each), the rest, a recording, the head over the pending
/// pairs, and one more recording (the head's rows of the prompt's blocks).
fn prefill_speculating<B: Backend>(
    model: &Model<B>,
    cache: &mut PrefixCache<B>,
    prompt: &[u32],
) -> Drafted {
    let mut state = model.new_sequence(prompt.len() + 2).unwrap();
    let mut mtp = model.new_mtp_state(prompt.len() + 2).unwrap();
    let (reused, restored_hidden) = cache
        .restore_speculating(model, &mut state, &mut mtp, prompt)
        .unwrap();
    assert_eq!(state.position(), reused);
    assert_eq!(mtp.position(), reused.saturating_sub(1));
    let (mut hidden, mut tokens) = match reused {
        0 => (Vec::new(), Vec::new()),
        _ => (restored_hidden, vec![prompt[reused]]),
    };
    let record = |cache: &mut PrefixCache<B>,
                  state: &SequenceState<B>,
                  mtp: &MtpState<B>,
                  hidden: &[f32]| {
        let progress = MtpProgress {
            state: mtp,
            pending_hidden: hidden,
        };
        cache
            .record_speculating(model, state, progress, prompt)
            .unwrap();
    };
    while let Some(end) = cache.next_checkpoint(state.position(), prompt.len()) {
        let start = state.position();
        let (rows, _) = forward(model, &mut state, &prompt[start..end]);
        hidden.extend(rows);
        tokens.extend_from_slice(&prompt[start + 1..=end]);
        record(cache, &state, &mtp, &hidden);
    }
    let start = state.position();
    let (rows, logits) = forward(model, &mut state, &prompt[start..]);
    hidden.extend(rows);
    tokens.extend_from_slice(&prompt[start + 1..]);
    tokens.push(argmax(&logits));
    record(cache, &state, &mtp, &hidden);
    let draft_logits = head(model, &mut mtp, &hidden, &tokens);
    record(cache, &state, &mtp, &[]);
    Drafted {
        reused,
        logits,
        draft_logits,
    }
}

fn assert_same<B: Backend>(backend: &B, what: &str, expected: &Drafted, got: &Drafted) {
    for (name, a, b) in [
        ("logits", &expected.logits, &got.logits),
        ("draft logits", &expected.draft_logits, &got.draft_logits),
    ] {
        if backend.computes_on_host() {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{what}: {name} differ (max |Δ| {})",
                max_abs_difference(a, b)
            );
        } else {
            let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1.0);
            let worst = max_abs_difference(a, b);
            assert!(
                worst <= 1e-4 * scale,
                "{what}: {name} differ by {worst} (scale {scale})"
            );
        }
    }
}

fn restored_head_drafts_as_after_the_whole_prompt<B: Backend>(backend: Arc<B>) {
    let mut rng = Xoshiro256::seed_from_u64(11);
    for name in MTP_FIXTURES {
        let work = tempfile::tempdir().unwrap();
        let model = Model::open(Arc::clone(&backend), &convert(name, work.path())).unwrap();
        assert!(model.has_mtp(), "{name} has an MTP head");
        let vocab = model.vocab_size();
        let counters = Arc::new(PrefixCacheCounters::default());
        let mut cache = PrefixCache::new(&model, settings(), Arc::clone(&counters))
            .expect("a cache for the fixture");
        let shared = random_tokens(&mut rng, 200, vocab);
        let donor = [shared.clone(), random_tokens(&mut rng, 70, vocab)].concat();

        // A sequence without the head keeps the donor's blocks without the head's share: a
        // speculating sequence cannot reuse them, computes the prompt and adds the share.
        let mut state = model.new_sequence(donor.len()).unwrap();
        assert_eq!(cache.restore(&model, &mut state, &donor).unwrap(), 0);
        while let Some(end) = cache.next_checkpoint(state.position(), donor.len()) {
            let start = state.position();
            model.prefill(&mut state, &donor[start..end]).unwrap();
            cache.record(&model, &state, &donor).unwrap();
        }
        let start = state.position();
        model.prefill(&mut state, &donor[start..]).unwrap();
        cache.record(&model, &state, &donor).unwrap();
        assert_eq!((cache.blocks(), cache.blocks_with_mtp()), (4, 0), "{name}");
        let got = prefill_speculating(&model, &mut cache, &donor);
        assert_eq!(got.reused, 0, "{name}: blocks without the head's share");
        assert_same(&*backend, name, &reference(&model, &donor), &got);
        assert_eq!(cache.blocks_with_mtp(), 4, "{name}: the share added");

        // The donor again (its last checkpoint at 256), off a checkpoint (200 shared tokens:
        // back to the checkpoint at 128) and on one (exactly 128 shared).
        let off = [shared.clone(), random_tokens(&mut rng, 50, vocab)].concat();
        let on = [donor[..128].to_vec(), random_tokens(&mut rng, 90, vocab)].concat();
        for (what, prompt, reused) in [
            ("the donor again", &donor, 256),
            ("off a checkpoint", &off, 128),
            ("on a checkpoint", &on, 128),
        ] {
            let got = prefill_speculating(&model, &mut cache, prompt);
            assert_eq!(got.reused, reused, "{name}, {what}: reused tokens");
            assert_same(
                &*backend,
                &format!("{name}, {what}"),
                &reference(&model, prompt),
                &got,
            );
        }
        assert_eq!(counters.bytes.load(Ordering::Relaxed), cache.bytes());
    }
}
test_device!(restored_head_drafts_as_after_the_whole_prompt);

struct Scheduler {
    commands: std::sync::mpsc::Sender<SchedulerCommand>,
    counters: Arc<SchedulerCounters>,
    next_id: usize,
}

impl Scheduler {
    fn start<B: Backend + 'static>(model: &Arc<Model<B>>, prefix: PrefixCacheSettings) -> Self
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        let counters = Arc::new(SchedulerCounters::default());
        let limits = SchedulerLimits {
            max_context: 1024,
            max_sequences: 8,
            prefill_chunk_tokens: 0,
            prefill_time_share: DEFAULT_PREFILL_TIME_SHARE,
        };
        let speculation = SpeculativeDecoding {
            max_draft_tokens: 2,
        };
        let commands = scheduler::start_serving(
            Arc::clone(model),
            limits,
            speculation,
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

    /// Greedy tokens and the cached prompt tokens the last event reports.
    fn generate(&mut self, prompt: &[u32], max_new_tokens: usize) -> (Vec<u32>, u32) {
        let (events, mut receiver) = async_mpsc::channel(4096);
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
        collect_tokens(&mut receiver)
    }

    /// Drafts made and accepted at each depth.
    fn acceptance(&self) -> Vec<(u64, u64)> {
        let counters = &self.counters;
        counters
            .drafted_at_depth
            .iter()
            .zip(&counters.accepted_at_depth)
            .map(|(d, a)| (d.load(Ordering::Relaxed), a.load(Ordering::Relaxed)))
            .collect()
    }
}

/// The trained fixture's reference prompts, one after another: text its head drafts well.
fn trained_text() -> Vec<u32> {
    let path = golden_fixture_dir("qwen3_5_moe_trained").join("reference.json");
    let text = std::fs::read_to_string(&path).expect("reference.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("reference.json is JSON");
    json["prompts"]
        .as_array()
        .expect("reference.json: prompts")
        .iter()
        .flat_map(|p| json_numbers(&p["prompt_token_ids"]))
        .map(|x| x as u32)
        .collect()
}

fn speculating_requests_reuse_prefixes_and_keep_tokens_and_drafts<B: Backend + 'static>(
    backend: Arc<B>,
) where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let text = trained_text();
    for name in ["qwen3_5_moe_trained", "qwen3_5_moe"] {
        let work = tempfile::tempdir().unwrap();
        let path = convert(name, work.path());
        let model = Arc::new(Model::open(Arc::clone(&backend), &path).unwrap());
        // An agent's turns: the same 200-token system prompt, a conversation that grows.
        let words = |from: usize, count: usize| -> Vec<u32> {
            let vocab = model.vocab_size() as u32;
            (from..from + count)
                .map(|i| text[i % text.len()] % vocab)
                .collect()
        };
        let system = words(0, 200);
        let first = [system.clone(), words(400, 70)].concat();
        let second = [first.clone(), words(600, 40)].concat();
        let third = [system.clone(), words(800, 30)].concat();
        let mut plain = Scheduler::start(&model, PrefixCacheSettings::off());
        let mut cached = Scheduler::start(&model, settings());
        for (index, (prompt, reused)) in [(&first, 0), (&second, 256), (&third, 128), (&first, 256)]
            .into_iter()
            .enumerate()
        {
            let (reference, _) = plain.generate(prompt, 16);
            let (tokens, cached_tokens) = cached.generate(prompt, 16);
            assert_eq!(
                cached_tokens, reused,
                "{name}: prompt {index}'s cached tokens"
            );
            assert_eq!(tokens, reference, "{name}: prompt {index}'s tokens");
            assert_eq!(
                cached.acceptance(),
                plain.acceptance(),
                "{name}: drafts made and accepted per depth after prompt {index}"
            );
        }
        let (drafted, accepted) = cached.counters.draft_totals();
        assert!(drafted > 0, "{name}: nothing was drafted");
        if name == "qwen3_5_moe_trained" {
            assert!(accepted > 0, "{name}: no draft was accepted");
        }
        let prefix = &cached.counters.prefix_cache;
        assert_eq!(prefix.hits.load(Ordering::Relaxed), 3, "{name}");
    }
}
test_device!(speculating_requests_reuse_prefixes_and_keep_tokens_and_drafts);
