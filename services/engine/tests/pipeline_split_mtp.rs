//! A model split over pipeline stages speculates exactly as the unsplit one: the MTP head runs
//! on the last stage (beside the output head its rows draft through), its token embeddings are
//! looked up on the first stage and cross to the last, and its layer's routed experts take the
//! last stage's slots and staging slots. The stages are backends of one device
//! (`OpenOnSameDevice`), so the check needs no second GPU.
//!
//! Every fixture with an MTP head (random MoE, random dense, and the trained MoE whose drafts are
//! often right), split with one layer on the first stage, one on the last, and over three
//! stages: greedy and seeded speculative generation give the unsplit model's tokens, the same
//! drafts at every depth, the same first-draft logits bit for bit and the same head usage; the
//! MoE models also with half of every layer's experts (the MTP layer's too) resident under the
//! expert cache, and with batches of 4 rows and more staged (the prompt's pairs through the MTP
//! layer are such a batch). Served by the scheduler with drafting and the prefix cache on, a
//! split model gives every request the unsplit model's tokens, cached prompt tokens and draft
//! acceptance.

#![allow(clippy::single_range_in_vec_init)] // a stage's layers are one range

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ninfer_artifact::Artifact;
use ninfer_engine::backend::same_device::OpenOnSameDevice;
use ninfer_engine::model::{greedy_with_mtp, sample_with_mtp, MtpUsage, SpeculativeOutcome};
use ninfer_engine::prefix_cache::PrefixCacheSettings;
use ninfer_engine::service::scheduler::{
    self, SchedulerCommand, SchedulerCounters, SchedulerLimits, SpeculativeDecoding,
    DEFAULT_PREFILL_TIME_SHARE,
};
use ninfer_engine::testing::{collect_tokens, golden_fixture_dir, greedy_request};
use ninfer_engine::{
    open_artifact, test_device, Backend, ExpertExecutor, Model, PipelineStage,
    ReferenceExpertExecutor, SamplingParams,
};

#[path = "support/half_resident.rs"]
mod half_resident;
#[path = "support/noting_executor.rs"]
mod noting_executor;
mod support;
#[path = "support/turn_prompts.rs"]
mod turn_prompts;

use half_resident::place_half_under_the_cache;
use noting_executor::NotingExecutor;
use turn_prompts::{turn_prompts, TurnLengths};

/// The fixtures with an MTP head.
const MTP_FIXTURES: [&str; 3] = ["qwen3_5_moe", "qwen3_5", "qwen3_5_moe_trained"];
const DRAFT_TOKENS: usize = 2;
const GENERATED: usize = 12;

/// Where the routed experts are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Experts {
    /// Every routed expert by the expert executor.
    Executor,
    /// Half of every MoE layer's experts (the MTP layer's too) in slots, the cache moving them.
    HalfResidentCached,
    /// Batches of 4 rows and more staged on each stage's staging slots.
    Staged,
}

fn convert(fixture: &str, output: &Path) -> PathBuf {
    let path = output.join(format!("{fixture}.ninfer"));
    support::convert_f32(golden_fixture_dir(fixture), &path);
    path
}

/// One layer on the first stage, one on the last, and three stages.
fn splits(layers: usize) -> Vec<Vec<Range<usize>>> {
    vec![
        vec![0..1, 1..layers],
        vec![0..layers - 1, layers - 1..layers],
        vec![0..1, 1..2, 2..layers],
    ]
}

/// The model on `stages` (one stage: the unsplit model), step graphs off (the same kernels on
/// both), its experts placed as `experts` says, computing the others with `executor`.
fn load<B: Backend>(
    stages: Vec<PipelineStage<B>>,
    artifact: &Arc<Artifact>,
    experts: Experts,
    executor: Arc<dyn ExpertExecutor>,
) -> Model<B> {
    let mut model = Model::load_pipeline(stages, Arc::clone(artifact), executor, 0).unwrap();
    model.set_step_graphs(false);
    assert!(model.has_mtp(), "every stage count loads the MTP head");
    match experts {
        Experts::Executor => {}
        Experts::HalfResidentCached => {
            let placement = place_half_under_the_cache(&mut model);
            assert!(
                placement.last().is_some_and(|mtp| !mtp.is_empty()),
                "the MTP layer holds its half too"
            );
        }
        Experts::Staged => {
            assert!(model.enable_prefill_staging(4).unwrap() > 0);
        }
    }
    model
}

/// Greedy and seeded speculative generation, and the head's use over both.
fn speculate<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
) -> (SpeculativeOutcome, SpeculativeOutcome, MtpUsage) {
    let mut greedy = greedy_with_mtp(model, prompt, GENERATED, DRAFT_TOKENS).unwrap();
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.95,
        seed: 11,
        ..SamplingParams::default()
    };
    let mut sampled = sample_with_mtp(model, prompt, GENERATED, DRAFT_TOKENS, params).unwrap();
    // Wall time is the one field that may differ.
    greedy.decode_time = Default::default();
    sampled.decode_time = Default::default();
    (greedy, sampled, model.mtp_usage())
}

/// The first-draft logits as bits (NaN-safe equality, and bit for bit).
fn first_draft_bits(outcome: &SpeculativeOutcome) -> Vec<(usize, u32, u32)> {
    outcome
        .first_drafts
        .iter()
        .map(|draft| (draft.position, draft.token, draft.logit.to_bits()))
        .collect()
}

fn a_split_model_speculates_as_the_unsplit_one<B: OpenOnSameDevice>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let backends: Vec<Arc<B>> = vec![
        Arc::clone(&backend),
        Arc::new(backend.open_on_same_device().unwrap()),
        Arc::new(backend.open_on_same_device().unwrap()),
    ];
    for fixture in MTP_FIXTURES {
        let artifact = open_artifact(&convert(fixture, directory.path())).unwrap();
        let common = artifact.config().common();
        let (layers, vocab) = (common.num_hidden_layers, common.vocab_size as u32);
        let has_experts = common.num_experts > 0;
        let prompt: Vec<u32> = (0..23u32).map(|i| (i * 37 + 5) % vocab).collect();
        let modes: &[Experts] = match has_experts {
            true => &[
                Experts::Executor,
                Experts::HalfResidentCached,
                Experts::Staged,
            ],
            false => &[Experts::Executor],
        };
        for &experts in modes {
            let noting = NotingExecutor::new(&artifact);
            let unsplit = load(
                PipelineStage::over(&backends[..1], &[0..layers]),
                &artifact,
                experts,
                Arc::clone(&noting) as Arc<dyn ExpertExecutor>,
            );
            assert!(!unsplit.is_split());
            let (greedy, sampled, usage) = speculate(&unsplit, &prompt);
            let calls = noting.calls();
            assert!(
                greedy.drafted.iter().sum::<usize>() > 0,
                "{fixture}: the unsplit model drafted nothing"
            );
            for split in splits(layers) {
                let noting = NotingExecutor::new(&artifact);
                let model = load(
                    PipelineStage::over(&backends, &split),
                    &artifact,
                    experts,
                    Arc::clone(&noting) as Arc<dyn ExpertExecutor>,
                );
                assert!(model.is_split());
                let (got_greedy, got_sampled, got_usage) = speculate(&model, &prompt);
                let what = format!(
                    "{fixture} split {split:?} ({experts:?}, {})",
                    backend.name()
                );
                for (kind, got, expected) in [
                    ("greedy", &got_greedy, &greedy),
                    ("sampled", &got_sampled, &sampled),
                ] {
                    assert_eq!(got.tokens, expected.tokens, "{what}: {kind} tokens");
                    assert_eq!(
                        first_draft_bits(got),
                        first_draft_bits(expected),
                        "{what}: {kind} first drafts"
                    );
                    assert_eq!(got, expected, "{what}: {kind} outcome");
                }
                assert_eq!(got_usage, usage, "{what}: the head's use");
                // The same routes: (layer, rows) of every executor call, the MTP layer's too.
                assert_eq!(noting.calls(), calls, "{what}: the executor's calls");
            }
        }
    }
}
test_device!(a_split_model_speculates_as_the_unsplit_one);

/// Each request's tokens and cached prompt tokens, and the drafts made and accepted at each
/// depth over all of them, from `model` served by a scheduler that drafts and keeps prefixes.
type Served = (Vec<(Vec<u32>, u32)>, Vec<(u64, u64)>);

fn served<B: Backend>(model: Model<B>, prompts: &[Vec<u32>]) -> Served {
    let counters = Arc::new(SchedulerCounters::default());
    let commands = scheduler::start_serving(
        Arc::new(model),
        SchedulerLimits {
            max_context: 1024,
            max_sequences: 4,
            prefill_chunk_tokens: 48,
            prefill_time_share: DEFAULT_PREFILL_TIME_SHARE,
        },
        SpeculativeDecoding {
            max_draft_tokens: DRAFT_TOKENS,
        },
        PrefixCacheSettings {
            budget_bytes: 1 << 30,
            block_tokens: 64,
            checkpoint_interval_blocks: 2,
        },
        Arc::clone(&counters),
    )
    .expect("start the scheduler");
    let mut tokens = Vec::new();
    for (index, prompt) in prompts.iter().enumerate() {
        let (events, mut receiver) = tokio::sync::mpsc::channel(4096);
        let request = greedy_request(format!("request-{index}"), prompt.clone(), 10, events);
        commands
            .send(SchedulerCommand::Submit(request))
            .expect("submit");
        tokens.push(collect_tokens(&mut receiver));
    }
    let acceptance = counters
        .drafted_at_depth
        .iter()
        .zip(&counters.accepted_at_depth)
        .map(|(d, a)| (d.load(Ordering::Relaxed), a.load(Ordering::Relaxed)))
        .collect();
    (tokens, acceptance)
}

fn served_split_speculates_the_unsplit_tokens<B: OpenOnSameDevice>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let second = Arc::new(backend.open_on_same_device().unwrap());
    for fixture in MTP_FIXTURES {
        let artifact = open_artifact(&convert(fixture, directory.path())).unwrap();
        let common = artifact.config().common();
        let (layers, vocab) = (common.num_hidden_layers, common.vocab_size as u32);
        let prompts = turn_prompts(
            vocab,
            TurnLengths {
                system: 150,
                first: 40,
                later: 30,
                other: 20,
            },
        );
        let unsplit = load(
            PipelineStage::over(&[Arc::clone(&backend)], &[0..layers]),
            &artifact,
            Experts::Executor,
            Arc::new(ReferenceExpertExecutor::new(Arc::clone(&artifact))),
        );
        let expected = served(unsplit, &prompts);
        assert!(
            expected.0.iter().skip(1).all(|(_, cached)| *cached > 0),
            "{fixture}: the later prompts reuse the first one's prefix: {expected:?}"
        );
        let split = load(
            PipelineStage::over(
                &[Arc::clone(&backend), Arc::clone(&second)],
                &[0..layers / 2, layers / 2..layers],
            ),
            &artifact,
            Experts::Executor,
            Arc::new(ReferenceExpertExecutor::new(Arc::clone(&artifact))),
        );
        assert_eq!(
            served(split, &prompts),
            expected,
            "{fixture} on {}",
            backend.name()
        );
    }
}
test_device!(served_split_speculates_the_unsplit_tokens);
