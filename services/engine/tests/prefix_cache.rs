//! Prefix reuse gives the bits of a whole prompt: on every golden fixture (full attention,
//! Gated DeltaNet hybrids, the dense hybrid and qwen4_exp's QSA + PLE), a prompt whose prefix
//! comes out of the prefix cache has the last-position logits and greedy tokens of the same
//! prompt prefilled whole (bit for bit on the CPU backend, within the CUDA bars on a GPU), at a
//! reuse point on a checkpoint and off it (the rest since the last checkpoint recomputed),
//! and for a prompt sent twice; a checkpoint taken in the middle of a forward equals that of a
//! forward stopped there. The store's bookkeeping (budget, least-recently-used leaves
//! evicted first, checkpoints' bytes counted against the budget, counters, nothing served to
//! another model or after a weight change) is held here too.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ninfer_engine::prefix_cache::{PrefixCache, PrefixCacheCounters, PrefixCacheSettings};
use ninfer_engine::sampling::{argmax, Xoshiro256};
use ninfer_engine::testing::{golden_fixture_dir, max_abs_difference, GOLDEN_FIXTURES};
use ninfer_engine::{test_device, Backend, CpuBackend, Model, SequenceState};

mod support;

/// Blocks of the delta rule's chunk (the smallest length a hybrid model allows), a checkpoint
/// every second block.
const BLOCK: usize = 64;
const GREEDY_TOKENS: usize = 6;

fn convert(fixture: &Path, output: &Path) -> PathBuf {
    let path = output.join("model.ninfer");
    support::convert_f32(fixture, &path);
    path
}

fn settings(budget_bytes: u64) -> PrefixCacheSettings {
    PrefixCacheSettings {
        budget_bytes,
        block_tokens: BLOCK,
        checkpoint_interval_blocks: 2,
    }
}

fn random_tokens(rng: &mut Xoshiro256, count: usize, vocab: usize) -> Vec<u32> {
    (0..count)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Feeds `prompt` as the scheduler does with a prefix cache: restored prefix first, then pieces
/// ending at the cache's checkpoints, recording after each; returns the state, the reused
/// tokens and the last position's logits.
fn prefill_with_cache<B: Backend>(
    model: &Model<B>,
    cache: &mut PrefixCache<B>,
    prompt: &[u32],
) -> (SequenceState<B>, usize, Vec<f32>) {
    let mut state = model
        .new_sequence(prompt.len() + GREEDY_TOKENS + 1)
        .unwrap();
    let reused = cache.restore(model, &mut state, prompt).unwrap();
    assert_eq!(state.position(), reused);
    while let Some(end) = cache.next_checkpoint(state.position(), prompt.len()) {
        let piece = &prompt[state.position()..end];
        model.prefill(&mut state, piece).unwrap();
        cache.record(model, &state, prompt).unwrap();
    }
    let rest = &prompt[state.position()..];
    let logits = model.prefill(&mut state, rest).unwrap();
    cache.record(model, &state, prompt).unwrap();
    (state, reused, logits)
}

/// [`prefill_with_cache`] as the scheduler feeds a prompt past its last checkpoint: one forward
/// from the checkpoint before it to all but the prompt's last token, the checkpoint taken
/// mid-forward ([`Model::forward_hidden_with_checkpoint`]).
fn prefill_with_cache_mid_forward<B: Backend>(
    model: &Model<B>,
    cache: &mut PrefixCache<B>,
    prompt: &[u32],
) -> (SequenceState<B>, usize, Vec<f32>) {
    let mut state = model
        .new_sequence(prompt.len() + GREEDY_TOKENS + 1)
        .unwrap();
    let reused = cache.restore(model, &mut state, prompt).unwrap();
    while let Some(end) = cache.next_checkpoint(state.position(), prompt.len()) {
        let position = state.position();
        let through = prompt.len() - 1;
        if cache.next_checkpoint(end, prompt.len()).is_none() && through > end {
            let (_, taken) = model
                .forward_hidden_with_checkpoint(
                    &mut state,
                    &prompt[position..through],
                    end - position,
                )
                .unwrap();
            assert_eq!(taken.position(), end);
            cache
                .record_passed_checkpoint(model, &state, None, prompt, taken)
                .unwrap();
            break;
        }
        model.prefill(&mut state, &prompt[position..end]).unwrap();
        cache.record(model, &state, prompt).unwrap();
    }
    let rest = &prompt[state.position()..];
    let logits = model.prefill(&mut state, rest).unwrap();
    cache.record(model, &state, prompt).unwrap();
    (state, reused, logits)
}

/// Greedy tokens and each step's logits after a prefill that ended with `logits`.
fn greedy<B: Backend>(
    model: &Model<B>,
    state: &mut SequenceState<B>,
    mut logits: Vec<f32>,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut tokens = Vec::new();
    let mut rows = Vec::new();
    for _ in 0..GREEDY_TOKENS {
        let token = argmax(&logits);
        tokens.push(token);
        rows.push(logits);
        logits = model.prefill(state, &[token]).unwrap();
    }
    (tokens, rows)
}

/// The whole prompt in one forward, no cache.
fn reference<B: Backend>(model: &Model<B>, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut state = model
        .new_sequence(prompt.len() + GREEDY_TOKENS + 1)
        .unwrap();
    let logits = model.prefill(&mut state, prompt).unwrap();
    greedy(model, &mut state, logits)
}

fn assert_same<B: Backend>(
    backend: &B,
    what: &str,
    expected: &(Vec<u32>, Vec<Vec<f32>>),
    got: &(Vec<u32>, Vec<Vec<f32>>),
) {
    assert_eq!(expected.0, got.0, "{what}: greedy tokens");
    for (step, (a, b)) in expected.1.iter().zip(&got.1).enumerate() {
        assert_close(backend, &format!("{what}: logits of step {step}"), a, b);
    }
}

fn reuse_gives_the_bits_of_a_whole_prompt<B: Backend>(backend: Arc<B>) {
    let mut rng = Xoshiro256::seed_from_u64(7);
    for name in GOLDEN_FIXTURES.iter().chain(&["qwen4_exp"]) {
        let work = tempfile::tempdir().unwrap();
        let path = convert(&golden_fixture_dir(name), work.path());
        let model = Model::open(Arc::clone(&backend), &path).unwrap();
        let vocab = model.vocab_size();
        let hybrid = model.needs_prefix_checkpoints();
        let counters = Arc::new(PrefixCacheCounters::default());
        let mut cache = PrefixCache::new(&model, settings(1 << 30), Arc::clone(&counters))
            .expect("a cache for the fixture");

        // The donor: 200 shared tokens and its own 70.
        let shared = random_tokens(&mut rng, 200, vocab);
        let donor = [shared.clone(), random_tokens(&mut rng, 70, vocab)].concat();
        let (_, reused, _) = prefill_with_cache(&model, &mut cache, &donor);
        assert_eq!(reused, 0, "{name}: nothing to reuse in an empty cache");
        // Blocks ending at 64, 128, 192 and 256; checkpoints at 128 and 256 on hybrids.
        assert_eq!(cache.blocks(), 4, "{name}: blocks of the donor");
        assert_eq!(cache.checkpoints(), if hybrid { 2 } else { 0 }, "{name}");

        // Off a checkpoint: 200 shared tokens reach into the third block; a hybrid restarts
        // from its checkpoint at 128, full attention from the block end at 192.
        let other = [shared.clone(), random_tokens(&mut rng, 50, vocab)].concat();
        let (mut state, reused, logits) = prefill_with_cache(&model, &mut cache, &other);
        assert_eq!(
            reused,
            if hybrid { 128 } else { 192 },
            "{name}: off a checkpoint"
        );
        let got = greedy(&model, &mut state, logits);
        assert_same(
            &*backend,
            &format!("{name}, off a checkpoint"),
            &reference(&model, &other),
            &got,
        );

        // On a checkpoint: exactly the first 128 tokens shared.
        let on = [donor[..128].to_vec(), random_tokens(&mut rng, 90, vocab)].concat();
        let (mut state, reused, logits) = prefill_with_cache(&model, &mut cache, &on);
        assert_eq!(reused, 128, "{name}: on a checkpoint");
        let got = greedy(&model, &mut state, logits);
        assert_same(
            &*backend,
            &format!("{name}, on a checkpoint"),
            &reference(&model, &on),
            &got,
        );

        // The same prompt again: everything up to the last block end that leaves a rest.
        let (mut state, reused, logits) = prefill_with_cache(&model, &mut cache, &donor);
        assert_eq!(reused, 256, "{name}: the donor again");
        let got = greedy(&model, &mut state, logits);
        assert_same(
            &*backend,
            &format!("{name}, the same prompt"),
            &reference(&model, &donor),
            &got,
        );

        // A prompt that ends two tokens after a block end (the shortest rest a hybrid takes).
        let short = donor[..130].to_vec();
        let (mut state, reused, logits) = prefill_with_cache(&model, &mut cache, &short);
        assert_eq!(reused, 128, "{name}: a two-token rest");
        let got = greedy(&model, &mut state, logits);
        assert_same(
            &*backend,
            &format!("{name}, a two-token rest"),
            &reference(&model, &short),
            &got,
        );

        assert_eq!(
            counters.lookups.load(Ordering::Relaxed),
            5,
            "{name}: lookups"
        );
        assert_eq!(counters.hits.load(Ordering::Relaxed), 4, "{name}: hits");
        assert_eq!(
            counters.hit_tokens.load(Ordering::Relaxed),
            if hybrid {
                128 * 3 + 256
            } else {
                192 + 128 * 2 + 256
            },
            "{name}: reused tokens"
        );
        assert_eq!(counters.bytes.load(Ordering::Relaxed), cache.bytes());
    }
}
test_device!(reuse_gives_the_bits_of_a_whole_prompt);

/// A checkpoint taken in the middle of a forward is the checkpoint of a forward that stopped
/// there: the forward's rows are those of two forwards, and a prompt restored at that
/// checkpoint has the logits and greedy tokens of the prompt prefilled whole.
fn a_checkpoint_taken_mid_forward_is_that_of_a_forward_stopped_there<B: Backend>(backend: Arc<B>) {
    let mut rng = Xoshiro256::seed_from_u64(11);
    for name in GOLDEN_FIXTURES {
        let work = tempfile::tempdir().unwrap();
        let path = convert(&golden_fixture_dir(name), work.path());
        let model = Model::open(Arc::clone(&backend), &path).unwrap();
        assert!(model.checkpoints_mid_forward(), "{name}");
        let vocab = model.vocab_size();
        let hybrid = model.needs_prefix_checkpoints();
        let prompt = random_tokens(&mut rng, 200, vocab);

        // One forward of 199 tokens taking the checkpoint after 128, against 128 then 71.
        let mut whole = model
            .new_sequence(prompt.len() + GREEDY_TOKENS + 1)
            .unwrap();
        let (hidden, taken) = model
            .forward_hidden_with_checkpoint(&mut whole, &prompt[..199], 2 * BLOCK)
            .unwrap();
        assert_eq!(
            (taken.position(), whole.position()),
            (2 * BLOCK, 199),
            "{name}"
        );
        let mut split = model
            .new_sequence(prompt.len() + GREEDY_TOKENS + 1)
            .unwrap();
        let head = forward_rows(&model, &mut split, &prompt[..2 * BLOCK]);
        let stopped = model.checkpoint(&split).unwrap();
        let tail = forward_rows(&model, &mut split, &prompt[2 * BLOCK..199]);
        let one = backend.download(&hidden).unwrap();
        let two = [head, tail].concat();
        assert_close(&*backend, &format!("{name}: hidden rows"), &one, &two);

        // Both checkpoints restored, the prompt's rest prefilled: the whole prompt's logits.
        let expected = reference(&model, &prompt);
        for (what, mut state, checkpoint) in
            [("mid-forward", whole, taken), ("stopped", split, stopped)]
        {
            model.restore(&mut state, checkpoint).unwrap();
            let logits = model.prefill(&mut state, &prompt[2 * BLOCK..]).unwrap();
            let got = greedy(&model, &mut state, logits);
            assert_same(
                &*backend,
                &format!("{name}: {what} checkpoint"),
                &expected,
                &got,
            );
        }

        // Through the cache: the donor's last checkpoint (256) taken mid-forward is reused.
        let counters = Arc::new(PrefixCacheCounters::default());
        let mut cache = PrefixCache::new(&model, settings(1 << 30), counters).unwrap();
        let donor = random_tokens(&mut rng, 270, vocab);
        prefill_with_cache_mid_forward(&model, &mut cache, &donor);
        assert_eq!(cache.checkpoints(), if hybrid { 2 } else { 0 }, "{name}");
        let again = [donor.clone(), random_tokens(&mut rng, 20, vocab)].concat();
        let (mut state, reused, logits) = prefill_with_cache(&model, &mut cache, &again);
        assert_eq!(
            reused,
            4 * BLOCK,
            "{name}: the donor's blocks and checkpoint"
        );
        let got = greedy(&model, &mut state, logits);
        assert_same(
            &*backend,
            &format!("{name}: reused"),
            &reference(&model, &again),
            &got,
        );
    }
}
test_device!(a_checkpoint_taken_mid_forward_is_that_of_a_forward_stopped_there);

/// Every new row's final hidden state of one forward of `tokens`, on the host.
fn forward_rows<B: Backend>(
    model: &Model<B>,
    state: &mut SequenceState<B>,
    tokens: &[u32],
) -> Vec<f32> {
    let mut batch = [ninfer_engine::SequenceInput { state, tokens }];
    let hidden = model.forward_hidden(&mut batch, None).unwrap();
    model.backend().download(&hidden).unwrap()
}

/// Equal bits on the CPU backend, within the CUDA bars elsewhere.
fn assert_close<B: Backend>(backend: &B, what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if backend.computes_on_host() {
        let same_bits = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same_bits,
            "{what}: differ (max |Δ| {})",
            max_abs_difference(a, b)
        );
    } else {
        let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1.0);
        let worst = max_abs_difference(a, b);
        assert!(
            worst <= 1e-4 * scale,
            "{what}: differ by {worst} (scale {scale})"
        );
    }
}

/// A budget of three blocks keeps the most recently used chain and evicts leaves first; a
/// prefix is never left without its earlier blocks.
#[test]
fn the_budget_evicts_least_recently_used_leaves() {
    let backend = Arc::new(CpuBackend::new());
    let work = tempfile::tempdir().unwrap();
    let path = convert(&golden_fixture_dir("qwen3_moe"), work.path());
    let model = Model::open(backend, &path).unwrap();
    let mut rng = Xoshiro256::seed_from_u64(11);
    let vocab = model.vocab_size();
    // One block's bytes, from a cache that keeps everything.
    let mut probe = PrefixCache::new(&model, settings(1 << 30), Default::default()).unwrap();
    let first = random_tokens(&mut rng, 3 * BLOCK + 5, vocab);
    prefill_with_cache(&model, &mut probe, &first);
    let block_bytes = probe.bytes() / 3;
    assert_eq!(probe.blocks(), 3);

    let counters = Arc::new(PrefixCacheCounters::default());
    let mut cache =
        PrefixCache::new(&model, settings(3 * block_bytes), Arc::clone(&counters)).unwrap();
    prefill_with_cache(&model, &mut cache, &first);
    assert_eq!(cache.blocks(), 3);
    // A second prompt sharing the first block: its two new blocks push out the first
    // prompt's last two, one leaf at a time.
    let second = [
        first[..BLOCK].to_vec(),
        random_tokens(&mut rng, 2 * BLOCK + 5, vocab),
    ]
    .concat();
    let (_, reused, _) = prefill_with_cache(&model, &mut cache, &second);
    assert_eq!(reused, BLOCK);
    assert_eq!(cache.blocks(), 3);
    assert!(cache.bytes() <= 3 * block_bytes);
    assert_eq!(counters.evictions.load(Ordering::Relaxed), 2);
    // The first prompt now finds only the shared block; the second all of its own.
    let mut state = model.new_sequence(first.len()).unwrap();
    assert_eq!(cache.restore(&model, &mut state, &first).unwrap(), BLOCK);
    let mut state = model.new_sequence(second.len()).unwrap();
    assert_eq!(
        cache.restore(&model, &mut state, &second).unwrap(),
        3 * BLOCK
    );
    // A budget under one block keeps nothing.
    let mut tiny = PrefixCache::new(&model, settings(block_bytes - 1), Default::default()).unwrap();
    prefill_with_cache(&model, &mut tiny, &first);
    assert_eq!((tiny.blocks(), tiny.bytes()), (0, 0));
}

/// A store holds one model's blocks: asked with another model (same tokens), it neither
/// reuses nor records anything.
#[test]
fn nothing_is_reused_across_models() {
    let backend = Arc::new(CpuBackend::new());
    let work = tempfile::tempdir().unwrap();
    let a = Model::open(
        Arc::clone(&backend),
        &convert(&golden_fixture_dir("qwen3_moe"), work.path()),
    )
    .unwrap();
    let work_b = tempfile::tempdir().unwrap();
    let b = Model::open(
        Arc::clone(&backend),
        &convert(&golden_fixture_dir("qwen3_5"), work_b.path()),
    )
    .unwrap();
    let mut rng = Xoshiro256::seed_from_u64(3);
    let prompt = random_tokens(&mut rng, 3 * BLOCK, a.vocab_size().min(b.vocab_size()));
    let mut cache = PrefixCache::new(&a, settings(1 << 30), Default::default()).unwrap();
    prefill_with_cache(&a, &mut cache, &prompt);
    let blocks = cache.blocks();
    assert!(blocks > 0);
    let mut state = b.new_sequence(prompt.len() + GREEDY_TOKENS + 1).unwrap();
    assert_eq!(cache.restore(&b, &mut state, &prompt).unwrap(), 0);
    assert_eq!(state.position(), 0);
    b.prefill(&mut state, &prompt).unwrap();
    cache.record(&b, &state, &prompt).unwrap();
    assert_eq!(cache.blocks(), blocks);

    // The same model with one weight changed (same config, tensors and dtypes): a new
    // identity, so nothing computed with the old weights is served.
    let changed = tempfile::tempdir().unwrap();
    let fixture = changed.path().join("qwen3_moe");
    copy_fixture_changing_one_weight(&golden_fixture_dir("qwen3_moe"), &fixture);
    let work_c = tempfile::tempdir().unwrap();
    let c = Model::open(backend, &convert(&fixture, work_c.path())).unwrap();
    assert_ne!(a.artifact().model_id(), c.artifact().model_id());
    let mut state = c.new_sequence(prompt.len() + GREEDY_TOKENS + 1).unwrap();
    assert_eq!(cache.restore(&c, &mut state, &prompt).unwrap(), 0);
    assert_eq!(state.position(), 0);
    c.prefill(&mut state, &prompt).unwrap();
    cache.record(&c, &state, &prompt).unwrap();
    assert_eq!(cache.blocks(), blocks);
    // The unchanged model still finds its own blocks.
    let mut state = a.new_sequence(prompt.len() + GREEDY_TOKENS + 1).unwrap();
    assert_eq!(cache.restore(&a, &mut state, &prompt).unwrap(), 2 * BLOCK);
}

/// Copies the fixture directory `from` to `to`, with the lowest mantissa bit of the first
/// element of `model.embed_tokens.weight` flipped.
fn copy_fixture_changing_one_weight(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    let path = to.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let tensor = &header["model.embed_tokens.weight"];
    assert_eq!(tensor["dtype"], "F32", "{tensor}");
    let start = tensor["data_offsets"][0].as_u64().unwrap() as usize;
    // Little-endian f32: the first byte holds the lowest mantissa bits.
    bytes[8 + header_len + start] ^= 1;
    std::fs::write(&path, bytes).unwrap();
}

/// On models with recurrent states (Gated DeltaNet, qwen4_exp's PLE), checkpoints count
/// against the budget: the store's bytes are its blocks' and checkpoints' bytes, and a budget
/// one byte short of a prompt's blocks and two checkpoints keeps less, yet what it keeps
/// still gives the bits of a whole prompt.
#[test]
fn checkpoints_are_counted_and_bounded_by_the_budget() {
    let backend = Arc::new(CpuBackend::new());
    let mut rng = Xoshiro256::seed_from_u64(13);
    for name in ["qwen3_next", "qwen4_exp"] {
        let work = tempfile::tempdir().unwrap();
        let path = convert(&golden_fixture_dir(name), work.path());
        let model = Model::open(Arc::clone(&backend), &path).unwrap();
        assert!(model.needs_prefix_checkpoints(), "{name}");
        let donor = random_tokens(&mut rng, 4 * BLOCK + 14, model.vocab_size());
        // One block's and one checkpoint's bytes, from a sequence that holds the donor.
        let mut whole = model.new_sequence(donor.len()).unwrap();
        model.prefill(&mut whole, &donor).unwrap();
        let block = model.prefix_block(&whole, 0..BLOCK).unwrap().bytes() as u64;
        let checkpoint = model.checkpoint_bytes(&model.checkpoint(&whole).unwrap()) as u64;
        assert!(block > 0 && checkpoint > 0, "{name}: {block}, {checkpoint}");

        // Blocks ending at 64..256, checkpoints at 128 and 256.
        let mut all = PrefixCache::new(&model, settings(1 << 30), Default::default()).unwrap();
        prefill_with_cache(&model, &mut all, &donor);
        assert_eq!((all.blocks(), all.checkpoints()), (4, 2), "{name}");
        assert_eq!(all.bytes(), 4 * block + 2 * checkpoint, "{name}");

        let budget = 4 * block + 2 * checkpoint - 1;
        let counters = Arc::new(PrefixCacheCounters::default());
        let mut cache = PrefixCache::new(&model, settings(budget), Arc::clone(&counters)).unwrap();
        prefill_with_cache(&model, &mut cache, &donor);
        let kept = cache.blocks() as u64 * block + cache.checkpoints() as u64 * checkpoint;
        assert_eq!(cache.bytes(), kept, "{name}: bytes counted");
        assert!(cache.bytes() <= budget, "{name}: {} bytes", cache.bytes());
        assert!(cache.checkpoints() < 2, "{name}");
        assert!(counters.evictions.load(Ordering::Relaxed) > 0, "{name}");
        assert_eq!(counters.bytes.load(Ordering::Relaxed), cache.bytes());

        // What is left is reused exactly: back to the checkpoint at 128.
        let again = [
            donor.clone(),
            random_tokens(&mut rng, 9, model.vocab_size()),
        ]
        .concat();
        let (mut state, reused, logits) = prefill_with_cache(&model, &mut cache, &again);
        assert_eq!(reused, 2 * BLOCK, "{name}: the checkpoint kept");
        let got = greedy(&model, &mut state, logits);
        assert_same(
            &*backend,
            &format!("{name}, within a tight budget"),
            &reference(&model, &again),
            &got,
        );
    }
}
