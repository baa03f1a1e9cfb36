//! The dynamic expert cache on a real model: the trained fixture
//! (`tests/fixtures/qwen3_5_moe_trained/`, real routing with preferences and reuse), converted
//! with f32 experts.
//!
//! * greedy decoding with the cache gives the tokens of static placement and of another start
//!   placement, and two runs with the cache give the same logits bit for bit, with and without a
//!   slow copy (which side computes an expert never depends on timing);
//! * a background fill leaves its slot out of the table until completed, then computes what a
//!   direct fill computes, bit for bit (CPU and CUDA: the copy stream and its event);
//! * a long prompt streamed through layerwise prefill re-places the slots from the staging by
//!   its routing (device copies), without changing its logits or the greedy tokens after it;
//! * a fill is never waited for by the step that started it (a CPU backend whose copies sleep);
//! * the hit / miss / fill / eviction counters equal the routing replayed through
//!   [`simulate_hit_rates`] with the documented timing, and hits + misses equal the routed
//!   choices;
//! * `hit_rate_curve_on_the_trained_fixture` (ignored; run it with
//!   `cargo test --release -p ninfer-engine --test expert_cache -- --ignored --nocapture`)
//!   prints the hit rate, fills per token and modelled cost against the slot count, static
//!   placement by statistics vs the cache before and with its admission policy.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ninfer_artifact::Artifact;
use ninfer_cpu_experts::ExpertLayout;
use ninfer_engine::backend::{ExpertSlotFills, Routing, WithExpertSlotTable};
use ninfer_engine::moe::expert_cache::{
    simulate_hit_rates, CacheCounts, ExpertCacheCounters, ExpertCacheOptions, LayerRoutingTrace,
};
use ninfer_engine::moe::placement::{choose_gpu_experts, GpuExpertShape};
use ninfer_engine::sampling::argmax;
use ninfer_engine::service::routing_stats::ExpertStatistics;
use ninfer_engine::testing::{golden_fixture_dir, json_numbers};
use ninfer_engine::{
    open_artifact, test_device, Backend, CpuBackend, EngineError, ExpertBatch, ExpertExecutor,
    Model, PrefillStagingOptions, PrefillThroughputs, ReferenceExpertExecutor,
};

mod support;

const FIXTURE: &str = "qwen3_5_moe_trained";
const DECODE_STEPS: usize = 24;

/// The fixture converted once per test (f32 dense weights and experts), or `None` when it is
/// not committed.
fn converted(work: &Path) -> Option<PathBuf> {
    let fixture = golden_fixture_dir(FIXTURE);
    if !fixture.join("config.json").exists() {
        println!("SKIPPED: the trained fixture is not under tests/fixtures/");
        return None;
    }
    let path = work.join("trained-f32.ninfer");
    support::convert_f32(fixture, &path);
    Some(path)
}

/// The fixture's held-out texts (`code`, `docs`) and its prompts, as token ids.
fn reference_tokens() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let text = std::fs::read_to_string(golden_fixture_dir(FIXTURE).join("reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |value: &serde_json::Value| -> Vec<u32> {
        json_numbers(value).into_iter().map(|x| x as u32).collect()
    };
    let texts = json["nll_texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| ids(&t["token_ids"]))
        .collect();
    let prompts = json["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(&p["prompt_token_ids"]))
        .collect();
    (texts, prompts)
}

/// The reference executor, recording every layer call's routing in order.
struct RecordingExecutor {
    inner: ReferenceExpertExecutor,
    /// `[layer]` → one entry per call (a step).
    trace: Mutex<Vec<LayerRoutingTrace>>,
}

impl RecordingExecutor {
    fn new(artifact: &Arc<Artifact>, layers: usize) -> Self {
        RecordingExecutor {
            inner: ReferenceExpertExecutor::new(Arc::clone(artifact)),
            trace: Mutex::new(vec![Vec::new(); layers]),
        }
    }

    fn trace(&self) -> Vec<LayerRoutingTrace> {
        self.trace.lock().unwrap().clone()
    }
}

impl ExpertExecutor for RecordingExecutor {
    fn name(&self) -> &str {
        "recording-reference"
    }

    fn observe_routing(&self, layer: usize, expert_ids: &[u32], tokens: usize) {
        if let Some(calls) = self.trace.lock().unwrap().get_mut(layer) {
            calls.push((expert_ids.to_vec(), tokens));
        }
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        self.inner.compute(batch, out)
    }
}

/// How a run places and moves the experts.
#[derive(Clone, Copy)]
struct Setup<'a> {
    slots: usize,
    statistics: Option<&'a ExpertStatistics>,
    fills_per_layer: usize,
    /// The policy without the fill's cost, the settled horizon and the copy budget, which
    /// moves slots within a short run.
    single_horizon: bool,
}

struct Run {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    counters: Arc<ExpertCacheCounters>,
    trace: Vec<LayerRoutingTrace>,
    /// Per forward: its time and the fills its start-of-step hook started.
    forward_times: Vec<(Duration, u64)>,
}

/// Prefill `prompt`, then `DECODE_STEPS` greedy steps, on a model set up by `setup`.
fn greedy_run<B: Backend>(backend: Arc<B>, path: &Path, prompt: &[u32], setup: Setup) -> Run {
    let artifact = open_artifact(path).unwrap();
    let common = artifact.config().common().clone();
    let recording = Arc::new(RecordingExecutor::new(&artifact, common.num_hidden_layers));
    let mut model = Model::load(backend, artifact, Arc::clone(&recording) as _).unwrap();
    let shape = GpuExpertShape {
        num_experts: common.num_experts,
        moe_layers: common.moe_layers.clone(),
        expert_bytes: model.expert_slot_bytes().unwrap(),
    };
    let placement = choose_gpu_experts(&shape, setup.slots, setup.statistics);
    model.place_resident_experts(&placement).unwrap();
    let counters = model
        .enable_expert_cache(
            if setup.single_horizon {
                ExpertCacheOptions {
                    fills_per_layer: setup.fills_per_layer,
                    ..ExpertCacheOptions::default()
                }
                .single_horizon()
            } else {
                ExpertCacheOptions {
                    fills_per_layer: setup.fills_per_layer,
                    ..ExpertCacheOptions::default()
                }
            },
            setup.statistics,
        )
        .unwrap();
    let mut state = model.new_sequence(prompt.len() + DECODE_STEPS).unwrap();
    let mut forward_times = Vec::new();
    let mut timed = |tokens: &[u32], state: &mut _| {
        let fills_before = counters.total().fills;
        let started = Instant::now();
        let logits = model.prefill(state, tokens).unwrap();
        forward_times.push((started.elapsed(), counters.total().fills - fills_before));
        logits
    };
    let mut logits = vec![timed(prompt, &mut state)];
    let mut tokens = Vec::new();
    while tokens.len() < DECODE_STEPS {
        let next = argmax(logits.last().unwrap());
        tokens.push(next);
        logits.push(timed(&[next], &mut state));
    }
    Run {
        tokens,
        logits,
        counters: Arc::clone(&counters),
        trace: recording.trace(),
        forward_times,
    }
}

/// Every layer's routing calls in one prefill of `tokens` with no slots.
fn prefill_routing(path: &Path, tokens: &[u32]) -> Vec<LayerRoutingTrace> {
    let artifact = open_artifact(path).unwrap();
    let layers = artifact.config().common().num_hidden_layers;
    let recording = Arc::new(RecordingExecutor::new(&artifact, layers));
    let model = Model::load(
        Arc::new(CpuBackend::new()),
        artifact,
        Arc::clone(&recording) as _,
    )
    .unwrap();
    let mut state = model.new_sequence(tokens.len()).unwrap();
    model.prefill(&mut state, tokens).unwrap();
    recording.trace()
}

/// Routing statistics of `tokens` in one forward with no slots (the seed a previous run leaves).
fn statistics_of(path: &Path, tokens: &[u32]) -> ExpertStatistics {
    let common = open_artifact(path).unwrap().config().common().clone();
    let counts = prefill_routing(path, tokens)
        .iter()
        .map(|calls| {
            let mut row = vec![0u64; common.num_experts];
            for (ids, _) in calls {
                for &id in ids {
                    if let Some(count) = row.get_mut(id as usize) {
                        *count += 1;
                    }
                }
            }
            row
        })
        .collect();
    ExpertStatistics { counts }
}

fn bits(logits: &[Vec<f32>]) -> Vec<Vec<u32>> {
    logits
        .iter()
        .map(|row| row.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Greedy tokens with the cache equal static placement's and another placement's; two cache
/// runs give the same bits. The cache runs the single-horizon policy, which moves slots within
/// these few steps (the default admission policy rarely copies in so short a run; its
/// determinism under timing is `a_slow_fill_is_never_waited_for_by_the_step_that_started_it`).
fn the_cache_moves_experts_never_the_tokens<B: Backend>(backend: Arc<B>) {
    let work = tempfile::tempdir().unwrap();
    let Some(path) = converted(work.path()) else {
        return;
    };
    let (texts, prompts) = reference_tokens();
    let statistics = statistics_of(&path, &texts[1]);
    let prompt = &prompts[0];
    let slots = 8;
    let static_run = greedy_run(
        Arc::clone(&backend),
        &path,
        prompt,
        Setup {
            slots,
            statistics: Some(&statistics),
            fills_per_layer: 0,
            single_horizon: false,
        },
    );
    let cached = |statistics| {
        greedy_run(
            Arc::clone(&backend),
            &path,
            prompt,
            Setup {
                slots,
                statistics,
                fills_per_layer: 2,
                single_horizon: true,
            },
        )
    };
    let cache_run = cached(Some(&statistics));
    let again = cached(Some(&statistics));
    let other_start = cached(None);
    let (fixed, moving) = (static_run.counters.total(), cache_run.counters.total());
    println!(
        "{} on {}: static hit rate {:.1}%, cache {:.1}% ({} fills, {} evictions)",
        FIXTURE,
        backend.name(),
        100.0 * fixed.hit_rate(),
        100.0 * moving.hit_rate(),
        moving.fills,
        moving.evictions
    );
    assert_eq!(fixed.fills, 0, "--moe-static-experts moved experts");
    assert!(moving.fills > 0, "the cache never filled a slot");
    assert_eq!(
        cache_run.tokens, static_run.tokens,
        "cache vs static placement"
    );
    assert_eq!(
        other_start.tokens, static_run.tokens,
        "cache from another placement"
    );
    assert_eq!(
        bits(&again.logits),
        bits(&cache_run.logits),
        "two runs of the cache differ"
    );
    assert_eq!(again.counters.per_layer(), cache_run.counters.per_layer());
    for (cached, fixed) in cache_run.logits.iter().zip(&static_run.logits) {
        let largest = cached
            .iter()
            .zip(fixed)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(largest < 1e-3, "logits moved by {largest} with the cache");
    }
}
test_device!(the_cache_moves_experts_never_the_tokens);

/// Background fills ([`ExpertSlotFills`]) leave the slot out of the table until completed, then
/// compute what direct fills compute, bit for bit; a refill evicts the slot's expert at its start.
fn background_fills_equal_direct_fills<B: Backend>(backend: Arc<B>) {
    let work = tempfile::tempdir().unwrap();
    let Some(path) = converted(work.path()) else {
        return;
    };
    let artifact = open_artifact(&path).unwrap();
    let common = artifact.config().common().clone();
    let layer = (0..common.num_hidden_layers)
        .find(|&l| common.moe_layers[l])
        .unwrap();
    let bank = artifact
        .expert_bank(&format!("layers.{layer}.moe.experts"))
        .unwrap()
        .clone();
    let layout =
        ExpertLayout::for_bank(&bank, common.hidden_size, common.moe_intermediate_size).unwrap();
    let placed = [(0, 5), (1, 9), (2, 17)];
    let mut direct = backend
        .new_expert_slots(&layout, common.num_experts, 3)
        .unwrap();
    let mut background = backend
        .new_expert_slots(&layout, common.num_experts, 3)
        .unwrap();
    for (slot, expert) in placed {
        backend
            .fill_expert_slot(&mut direct, slot, expert, &artifact, &bank)
            .unwrap();
        backend
            .fill_expert_slot(&mut background, slot, expert, &artifact, &bank)
            .unwrap();
    }
    // Slot 1: expert 9 → 30, directly and in the background.
    backend
        .fill_expert_slot(&mut direct, 1, 30, &artifact, &bank)
        .unwrap();
    background.start_fill(1, 30, &artifact, &bank).unwrap();
    assert_eq!(background.fills_in_flight(), 1);
    let table = background.slot_table();
    assert!(!table.is_resident(9) && !table.is_resident(30) && table.expert_in(1).is_none());
    background.complete_fills().unwrap();
    assert_eq!(background.fills_in_flight(), 0);
    assert_eq!(background.slot_table(), direct.slot_table());
    let tokens = 5;
    let k = common.num_experts_per_tok;
    let x: Vec<f32> = (0..tokens * common.hidden_size)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let routing = Routing {
        experts_per_token: k,
        expert_ids: (0..tokens * k)
            .map(|i| [5u32, 9, 17, 30, 2, 11][i % 6])
            .collect(),
        weights: (0..tokens * k).map(|i| 0.1 + 0.05 * i as f32).collect(),
    };
    let x = backend.upload(&x, tokens, common.hidden_size).unwrap();
    let expected = backend
        .download(&backend.slotted_experts(&direct, &x, &routing).unwrap())
        .unwrap();
    let got = backend
        .download(&backend.slotted_experts(&background, &x, &routing).unwrap())
        .unwrap();
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert!(expected.iter().any(|&v| v != 0.0));
}
test_device!(background_fills_equal_direct_fills);

/// A long prompt streamed through layerwise prefill re-places the cache's slots from the
/// staging slots its experts were streamed into: right after the prompt each MoE layer holds
/// experts the prompt used at least as often as any it left out (from a start with the first
/// experts), without a fill over the bus; the prompt's logits are those without it bit for
/// bit (each layer re-places after it computed), the greedy tokens after it too, and decode
/// finds more of its experts in the slots. On CUDA the copies are device to device.
fn a_long_prompt_places_its_most_used_experts_from_the_staging<B: Backend>(backend: Arc<B>) {
    let work = tempfile::tempdir().unwrap();
    let Some(path) = converted(work.path()) else {
        return;
    };
    let (texts, _) = reference_tokens();
    let prompt = &texts[0];
    let prompt_counts = statistics_of(&path, prompt).counts;
    let slots = 8;
    let run = |prompt_placement: bool| {
        let artifact = open_artifact(&path).unwrap();
        let common = artifact.config().common().clone();
        let executor = Arc::new(ReferenceExpertExecutor::new(Arc::clone(&artifact)));
        let mut model = Model::load(Arc::clone(&backend), artifact, executor).unwrap();
        let shape = GpuExpertShape {
            num_experts: common.num_experts,
            moe_layers: common.moe_layers.clone(),
            expert_bytes: model.expert_slot_bytes().unwrap(),
        };
        model
            .place_resident_experts(&choose_gpu_experts(&shape, slots, None))
            .unwrap();
        let counters = model
            .enable_expert_cache(
                ExpertCacheOptions {
                    prompt_placement,
                    ..ExpertCacheOptions::default()
                },
                None,
            )
            .unwrap();
        model
            .enable_prefill_staging_with(PrefillStagingOptions {
                staged_min_tokens: 0,
                layerwise_min_tokens: 2,
            })
            .unwrap();
        // Every non-resident expert streamed (the executor's rate unknown).
        model
            .set_prefill_throughputs(PrefillThroughputs {
                copy_bytes_per_second: 1e15,
                backend_pairs_per_second: 1e15,
                executor_pairs_per_second: 0.0,
                flops_per_pair: 1.0,
            })
            .unwrap();
        let mut state = model.new_sequence(prompt.len() + DECODE_STEPS).unwrap();
        let prompt_logits = model.prefill(&mut state, prompt).unwrap();
        let placed = model.resident_experts().unwrap();
        let after_prompt = counters.total();
        let mut tokens = vec![argmax(&prompt_logits)];
        while tokens.len() < DECODE_STEPS {
            let logits = model
                .prefill(&mut state, &tokens[tokens.len() - 1..])
                .unwrap();
            tokens.push(argmax(&logits));
        }
        let decode = less(counters.total(), after_prompt);
        let staging_fills: u64 = counters
            .layers
            .iter()
            .map(|layer| {
                layer
                    .staging_fills
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
            .sum();
        (
            bits(&[prompt_logits]),
            tokens,
            placed,
            after_prompt,
            decode,
            staging_fills,
        )
    };
    let (logits_on, tokens_on, placed, after_prompt, decode_on, staging_fills) = run(true);
    let (logits_off, tokens_off, unplaced, _, decode_off, no_staging_fills) = run(false);
    println!(
        "{}: {staging_fills} experts placed from the staging; decode hit rate {:.1}% with, {:.1}% without",
        backend.name(),
        100.0 * decode_on.hit_rate(),
        100.0 * decode_off.hit_rate()
    );
    assert_eq!(logits_on, logits_off, "the prompt's logits");
    assert_eq!(tokens_on, tokens_off, "greedy tokens");
    assert_eq!(no_staging_fills, 0);
    assert!(staging_fills > 0, "nothing placed from the staging");
    assert_eq!(
        after_prompt.fills, 0,
        "a fill over the bus during the prompt"
    );
    assert!(
        decode_on.hits >= decode_off.hits,
        "decode hits {} with prompt placement, {} without",
        decode_on.hits,
        decode_off.hits
    );
    for (layer, counts) in prompt_counts.iter().enumerate() {
        let resident = &placed[layer];
        if resident.is_empty() {
            continue;
        }
        assert_eq!(resident.len(), slots, "layer {layer}");
        assert_eq!(
            unplaced[layer],
            (0..slots).collect::<Vec<_>>(),
            "layer {layer}"
        );
        let coldest_resident = resident.iter().map(|&e| counts[e]).min().unwrap();
        let hottest_left_out = (0..counts.len())
            .filter(|e| !resident.contains(e))
            .map(|e| counts[e])
            .max()
            .unwrap();
        assert!(
            coldest_resident >= hottest_left_out,
            "layer {layer}: resident {resident:?} (least used {coldest_resident}), an expert left out used {hottest_left_out} times"
        );
    }
}
test_device!(a_long_prompt_places_its_most_used_experts_from_the_staging);

/// With copies that sleep far longer than a step, the step that starts fills returns before
/// they land, and the results equal those of instant copies bit for bit.
#[test]
fn a_slow_fill_is_never_waited_for_by_the_step_that_started_it() {
    let work = tempfile::tempdir().unwrap();
    let Some(path) = converted(work.path()) else {
        return;
    };
    let (_, prompts) = reference_tokens();
    let delay = Duration::from_millis(400);
    let setup = Setup {
        slots: 8,
        statistics: None,
        fills_per_layer: 2,
        single_horizon: false,
    };
    let slow = greedy_run(
        Arc::new(CpuBackend::with_expert_fill_delay(delay)),
        &path,
        &prompts[1],
        setup,
    );
    let fast = greedy_run(Arc::new(CpuBackend::new()), &path, &prompts[1], setup);
    assert_eq!(bits(&slow.logits), bits(&fast.logits));
    assert_eq!(slow.counters.per_layer(), fast.counters.per_layer());
    // The first forward that starts fills (the second: the hook after the prompt's routing)
    // has nothing earlier to complete, so its time is its own.
    let (elapsed, fills) = slow.forward_times[1];
    assert!(fills > 0, "the step after the prompt started no fill");
    assert!(
        elapsed < delay,
        "the step that started {fills} fills took {elapsed:?}: it waited for a {delay:?} copy"
    );
}

/// The counters equal the recorded routing replayed through the simulation (same placement,
/// policy and timing), and hits + misses are every routed choice.
#[test]
fn metric_counts_equal_the_routing() {
    let work = tempfile::tempdir().unwrap();
    let Some(path) = converted(work.path()) else {
        return;
    };
    let (texts, prompts) = reference_tokens();
    let statistics = statistics_of(&path, &texts[0]);
    let common = open_artifact(&path).unwrap().config().common().clone();
    for (slots, fills_per_layer) in [(4, 2), (12, 1), (8, 0)] {
        let run = greedy_run(
            Arc::new(CpuBackend::new()),
            &path,
            &prompts[2],
            Setup {
                slots,
                statistics: Some(&statistics),
                fills_per_layer,
                single_horizon: false,
            },
        );
        let per_layer = run.counters.per_layer();
        for (layer, trace) in run.trace.iter().enumerate() {
            if !common.moe_layers[layer] {
                continue;
            }
            let routed: usize = trace.iter().map(|(ids, _)| ids.len()).sum();
            let counts = per_layer[layer];
            assert_eq!(counts.hits + counts.misses, routed as u64, "layer {layer}");
            let (fixed, moving) = simulate_hit_rates(
                trace,
                common.num_experts,
                common.num_experts_per_tok,
                Some(&statistics.counts[layer]),
                slots,
                ExpertCacheOptions {
                    fills_per_layer,
                    ..ExpertCacheOptions::default()
                },
                None,
            );
            let simulated = if fills_per_layer == 0 { fixed } else { moving };
            let stride = counts.bytes_copied.checked_div(counts.fills).unwrap_or(0);
            assert_eq!(
                counts,
                CacheCounts {
                    bytes_copied: simulated.fills * stride,
                    ..simulated
                },
                "layer {layer}, {slots} slots, {fills_per_layer} fills per step"
            );
        }
    }
}

/// Hit rate and fills against slots per layer on the trained fixture, static placement by
/// statistics vs the cache before its admission policy (one horizon, a plain margin) and with
/// it: the statistics of one held-out text seed the other (both ways), every MoE layer counted.
/// Two shapes of routing: decode-like (one token a step) and a prompt of the text's first half
/// in one step followed by its second half one token a step (counted over those tokens). The
/// modelled cost is the CPU's routed choices per token plus each fill at its cost in choices.
#[test]
#[ignore = "prints the replay of docs/BENCHMARKS.md; run with --ignored --nocapture"]
fn hit_rate_curve_on_the_trained_fixture() {
    let work = tempfile::tempdir().unwrap();
    let Some(path) = converted(work.path()) else {
        return;
    };
    let (texts, _) = reference_tokens();
    let common = open_artifact(&path).unwrap().config().common().clone();
    let k = common.num_experts_per_tok;
    let statistics: Vec<ExpertStatistics> = texts.iter().map(|t| statistics_of(&path, t)).collect();
    // One token a step: the prefill's routing cut per token.
    let per_token: Vec<Vec<LayerRoutingTrace>> = texts
        .iter()
        .map(|text| {
            prefill_routing(&path, text)
                .into_iter()
                .map(|calls| {
                    calls
                        .iter()
                        .flat_map(|(ids, _)| ids.chunks(k).map(|token| (token.to_vec(), 1)))
                        .collect()
                })
                .collect()
        })
        .collect();
    // The first half as one prompt step, then one token a step.
    let prompted: Vec<Vec<LayerRoutingTrace>> = per_token
        .iter()
        .map(|layers| {
            layers
                .iter()
                .map(|steps: &LayerRoutingTrace| {
                    let half = steps.len() / 2;
                    let prompt: Vec<u32> = steps[..half]
                        .iter()
                        .flat_map(|(ids, _)| ids.iter().copied())
                        .collect();
                    std::iter::once((prompt, half))
                        .chain(steps[half..].iter().cloned())
                        .collect()
                })
                .collect()
        })
        .collect();
    let env = |name: &str, default: f64| {
        std::env::var(name)
            .ok()
            .and_then(|text| text.parse().ok())
            .unwrap_or(default)
    };
    let defaults = ExpertCacheOptions::default();
    let after = ExpertCacheOptions {
        fills_per_layer: 2,
        eviction_margin: env("NINFER_CACHE_MARGIN", defaults.eviction_margin),
        fill_cost_choices: env("NINFER_CACHE_FILL_COST", defaults.fill_cost_choices),
        settled_decay_per_token: env(
            "NINFER_CACHE_SETTLED_DECAY",
            defaults.settled_decay_per_token,
        ),
        ..defaults
    };
    let before = ExpertCacheOptions {
        eviction_margin: defaults.eviction_margin,
        ..after
    }
    .single_horizon();
    let fill_cost = after.fill_cost_choices;
    println!(
        "before: one horizon (decay {}), margin {}; after: settled decay {}, fill cost {} choices, margin {}, copy share {}",
        before.decay_per_token,
        before.eviction_margin,
        after.settled_decay_per_token,
        after.fill_cost_choices,
        after.eviction_margin,
        after.copy_share_of_step
    );
    for (shape, traces, skip) in [
        ("decode", &per_token, false),
        ("prompt + decode", &prompted, true),
    ] {
        println!("{shape}: slots/layer | static by statistics | before | after | after, the prompt placing the slots (hit rate, fills per layer and token, modelled cost)");
        for slots in [2, 4, 6, 8, 12, 16, 24] {
            let mut totals = [CacheCounts::default(); 4];
            for (measured, seed) in [(0, 1), (1, 0)] {
                for (layer, trace) in traces[measured].iter().enumerate() {
                    if !common.moe_layers[layer] {
                        continue;
                    }
                    let seed = Some(statistics[seed].counts[layer].as_slice());
                    // `layerwise`: steps from this many tokens re-place the slots as a
                    // layerwise prompt does (the prompt step; decode steps are one token).
                    let replay = |options: ExpertCacheOptions, layerwise: Option<usize>| {
                        let run = |trace: &[(Vec<u32>, usize)]| {
                            simulate_hit_rates(
                                trace,
                                common.num_experts,
                                k,
                                seed,
                                slots,
                                options,
                                layerwise,
                            )
                        };
                        let (fixed, moving) = run(trace);
                        if !skip {
                            return (fixed, moving);
                        }
                        // Counted after the prompt step.
                        let (head_fixed, head_moving) = run(&trace[..1]);
                        (less(fixed, head_fixed), less(moving, head_moving))
                    };
                    let (fixed, old) = replay(before, None);
                    let (_, new) = replay(after, None);
                    let (_, placed) = replay(after, Some(2));
                    add(&mut totals[0], &fixed);
                    add(&mut totals[1], &old);
                    add(&mut totals[2], &new);
                    add(&mut totals[3], &placed);
                }
            }
            let figures = |counts: &CacheCounts| {
                let tokens = (counts.hits + counts.misses) as f64 / k as f64;
                let layers = common.moe_layers.iter().filter(|&&moe| moe).count() as f64;
                format!(
                    "{:.1}% {:.3} {:.2}",
                    100.0 * counts.hit_rate(),
                    counts.fills as f64 / tokens,
                    (counts.misses as f64 + fill_cost * counts.fills as f64) / tokens * layers
                )
            };
            println!(
                "{slots:>2} of {} | {} | {} | {} | {}",
                common.num_experts,
                figures(&totals[0]),
                figures(&totals[1]),
                figures(&totals[2]),
                figures(&totals[3])
            );
        }
    }
}

fn less(a: CacheCounts, b: CacheCounts) -> CacheCounts {
    CacheCounts {
        hits: a.hits - b.hits,
        misses: a.misses - b.misses,
        fills: a.fills - b.fills,
        evictions: a.evictions - b.evictions,
        bytes_copied: a.bytes_copied - b.bytes_copied,
    }
}

fn add(total: &mut CacheCounts, part: &CacheCounts) {
    total.hits += part.hits;
    total.misses += part.misses;
    total.fills += part.fills;
    total.evictions += part.evictions;
}
