//! A model split over pipeline stages (`Model::load_pipeline`) computes what the unsplit model
//! computes, bit for bit: the stages are backends of one device (`OpenOnSameDevice`: independent
//! CPU backends, or CUDA backends on GPU 0), so the check needs no second GPU.
//!
//! Every golden fixture (f32) and a tiny qwen3_next with tied embeddings and int8 experts, split
//! at every kind of boundary (one layer on the first stage, one on the last, halves, three
//! stages), runs one sequence alone (prefill with every position's logits, then greedy decode)
//! and three sequences of different lengths together (one batched prefill, then batched greedy
//! decode through `forward_logits_on_backend`, as the scheduler calls it). The logits of every
//! forward and the greedy tokens must equal the unsplit model's. The MoE models run three
//! times: every expert with the executor; half of each layer's experts in the slots of its own
//! stage with the dynamic expert cache moving them; batches of 4 rows and more staged (each
//! stage's staging slots computing its layers' routed experts). The dense model runs twice, its
//! last two MLPs on the backend or with the expert executor. An image prompt (embeddings
//! replaced on the first stage, three-stream rotation on every stage) gives the unsplit logits
//! too. Both models decode op by op (step graphs off), so the CUDA case compares the same
//! kernels; `cuda_model::split_step_graphs_give_the_unsplit_logits` holds split step graphs to
//! the unsplit logits.
//!
//! Served by the scheduler (the logits sampled where the last stage left them, prompts fed in
//! chunks), a split model gives every request, greedy or seeded sampling, the unsplit model's
//! tokens (one request at a time: which requests share a batch depends on timing, and the
//! batched forwards are checked above), with and without the prefix cache.
//!
//! On CUDA the stages of one card may also cross by the path between cards (a peer copy naming
//! both contexts): the same bits, and the crossings took that path.
//!
//! The refusals: stages that do not cover the layers once in order. (A split model's MTP head: `pipeline_split_mtp.rs`; its host KV pools:
//! `pipeline_split_host_kv.rs`.)

#![allow(clippy::single_range_in_vec_init)] // a stage's layers are one range

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ninfer_artifact::{Artifact, DType};
use ninfer_engine::backend::cuda::CudaOptions;
use ninfer_engine::backend::same_device::OpenOnSameDevice;
use ninfer_engine::prefix_cache::PrefixCacheSettings;
use ninfer_engine::sampling::argmax;
use ninfer_engine::service::scheduler::{
    self, SchedulerCommand, SchedulerCounters, SchedulerLimits, SpeculativeDecoding,
    DEFAULT_PREFILL_TIME_SHARE,
};
use ninfer_engine::testing::{
    collect_tokens, cuda_with_options_or_skip, golden_fixture_dir, greedy_request,
    image_prompt_patches, json_numbers, write_tiny_model, TinyArchitecture, TinyModelOptions,
    GOLDEN_FIXTURES,
};
use ninfer_engine::vision::{encode_images, VisionWeights};
use ninfer_engine::{
    open_artifact, test_device, Backend, ExpertExecutor, LogitsSelection, Model, PipelineStage,
    PrefillStagingOptions, PrefillThroughputs, ReferenceExpertExecutor, SamplingParams,
    SequenceInput,
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

const MAX_CONTEXT: usize = 64;
const DECODE_STEPS: usize = 5;

/// Every forward's logits and every sequence's greedy tokens, in the order they were computed,
/// and what the expert executor was asked to compute.
#[derive(Debug, Default)]
struct Trace {
    logits: Vec<Vec<f32>>,
    tokens: Vec<Vec<u32>>,
    /// (layer, rows) of each executor call, in order: which side computed an expert leaves the
    /// values alike on the CPU, so the routes are compared here.
    executor_calls: Vec<(usize, usize)>,
}

/// Where a model's routed experts (or a dense model's MLPs) are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Experts {
    /// Every routed expert by the expert executor; dense MLPs on the backend.
    Executor,
    /// Half of each MoE layer's experts in slots, the expert cache moving them.
    HalfResidentCached,
    /// A dense model's last two MLPs by the expert executor (`--dense-mlp-offload-layers 2`).
    OffloadedDenseMlps,
    /// Batches of 4 rows and more staged: their routed experts copied into each stage's
    /// staging slots and computed there.
    Staged,
    /// Batches of 4 rows and more streamed layer by layer: each stage's layerwise stream
    /// copies its layers' experts into its own two sets of staging slots.
    Layerwise,
}

impl Experts {
    /// Dense MLPs the expert executor computes.
    fn offloaded_layers(self) -> usize {
        match self {
            Experts::OffloadedDenseMlps => 2,
            Experts::Executor
            | Experts::HalfResidentCached
            | Experts::Staged
            | Experts::Layerwise => 0,
        }
    }
}

fn convert_f32(fixture: &str, output: &Path) -> PathBuf {
    let path = output.join(format!("{fixture}.ninfer"));
    support::convert_f32(golden_fixture_dir(fixture), &path);
    path
}

/// The models of the check: each golden fixture and qwen4_exp's (its residual streams cross
/// stages, each layer's stream mixers, indexer and PLE block on its stage, the final mixer on
/// the last), and a tiny qwen3_next whose head is its embedding table (a split loads the table
/// on the last stage too) with int8 experts.
fn models(directory: &Path) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = GOLDEN_FIXTURES
        .iter()
        .chain(&["qwen4_exp"])
        .map(|fixture| convert_f32(fixture, directory))
        .collect();
    let tied = directory.join("tiny-qwen3-next-tied.ninfer");
    write_tiny_model(
        &tied,
        TinyModelOptions {
            experts_dtype: DType::Int8,
            dense_dtype: DType::Bf16,
            ..TinyModelOptions::new(TinyArchitecture::Qwen3Next)
        },
    )
    .unwrap();
    paths.push(tied);
    paths
}

/// The splits each model is checked at: one layer on the first stage, one layer on the last,
/// halves, and three stages (one, one, the rest).
fn splits(layers: usize) -> Vec<Vec<Range<usize>>> {
    assert!(
        layers >= 3,
        "the splits need 3 layers, the model has {layers}"
    );
    vec![
        vec![0..1, 1..layers],
        vec![0..layers - 1, layers - 1..layers],
        vec![0..layers / 2, layers / 2..layers],
        vec![0..1, 1..2, 2..layers],
    ]
}

fn prepare<B: Backend>(mut model: Model<B>, experts: Experts) -> Model<B> {
    model.set_step_graphs(false);
    if experts == Experts::HalfResidentCached {
        place_half_under_the_cache(&mut model);
    }
    if experts == Experts::Staged {
        assert!(model.enable_prefill_staging(4).unwrap() > 0);
    }
    if experts == Experts::Layerwise {
        let options = PrefillStagingOptions {
            staged_min_tokens: 0,
            layerwise_min_tokens: 4,
        };
        assert!(model.enable_prefill_staging_with(options).unwrap() > 0);
        // A second per expert copied, and about as long per expert on the executor at the
        // batches here: each layer's experts split between the two sides, both of which run.
        let expert_bytes = model.expert_slot_bytes().unwrap() as f64;
        model
            .set_prefill_throughputs(PrefillThroughputs {
                copy_bytes_per_second: expert_bytes,
                backend_pairs_per_second: 1e12,
                executor_pairs_per_second: 2.0,
                flops_per_pair: 1.0,
            })
            .unwrap();
        let summary = model.layerwise_split_summary(9).unwrap();
        assert!(summary.mixed_layers > 0, "{summary:?}");
    }
    model
}

fn executor(artifact: &Arc<Artifact>) -> Arc<dyn ExpertExecutor> {
    Arc::new(ReferenceExpertExecutor::new(Arc::clone(artifact)))
}

/// One sequence alone, then three together: see the file's header.
fn run<B: Backend>(model: &Model<B>) -> Trace {
    let vocab = model.vocab_size();
    let mut trace = Trace::default();
    // One sequence: every position's logits of its prefill, then greedy decode.
    let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 11) % vocab as u32).collect();
    let mut alone = model.new_sequence(MAX_CONTEXT).unwrap();
    let all = model
        .forward(
            &mut [SequenceInput {
                state: &mut alone,
                tokens: &prompt,
            }],
            LogitsSelection::All,
        )
        .unwrap()
        .remove(0);
    let mut token = argmax(&all[all.len() - vocab..]);
    trace.logits.push(all);
    let mut tokens = vec![token];
    for _ in 0..DECODE_STEPS {
        let logits = model.prefill(&mut alone, &[token]).unwrap();
        token = argmax(&logits);
        tokens.push(token);
        trace.logits.push(logits);
    }
    trace.tokens.push(tokens);

    // Three sequences of different lengths: one batched prefill, then batched decode with the
    // logits left on the output stage.
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| {
            (0..4 + 3 * s)
                .map(|i| (i * 29 + 5 * s + 3) % vocab as u32)
                .collect()
        })
        .collect();
    let mut states: Vec<_> = prompts
        .iter()
        .map(|_| model.new_sequence(MAX_CONTEXT).unwrap())
        .collect();
    let mut batch: Vec<SequenceInput<'_, B>> = states
        .iter_mut()
        .zip(&prompts)
        .map(|(state, tokens)| SequenceInput { state, tokens })
        .collect();
    let prefilled = model.forward(&mut batch, LogitsSelection::Last).unwrap();
    let mut next: Vec<u32> = prefilled.iter().map(|logits| argmax(logits)).collect();
    trace.logits.extend(prefilled);
    let mut together: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    for _ in 0..DECODE_STEPS {
        let inputs: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut batch: Vec<SequenceInput<'_, B>> = states
            .iter_mut()
            .zip(&inputs)
            .map(|(state, tokens)| SequenceInput { state, tokens })
            .collect();
        let step = model.forward_logits_on_backend(&mut batch).unwrap();
        let values = model.output_backend().download(&step).unwrap();
        next = values.chunks(vocab).map(argmax).collect();
        for (sequence, &token) in together.iter_mut().zip(&next) {
            sequence.push(token);
        }
        trace.logits.push(values);
    }
    trace.tokens.extend(together);
    trace
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Where two traces first differ, if they do.
fn first_difference(split: &Trace, unsplit: &Trace) -> Option<String> {
    if split.tokens != unsplit.tokens {
        return Some(format!(
            "greedy tokens {:?}, unsplit {:?}",
            split.tokens, unsplit.tokens
        ));
    }
    if split.executor_calls != unsplit.executor_calls {
        return Some(format!(
            "executor calls (layer, rows) {:?}, unsplit {:?}",
            split.executor_calls, unsplit.executor_calls
        ));
    }
    if split.logits.len() != unsplit.logits.len() {
        return Some(format!(
            "{} forwards, unsplit {}",
            split.logits.len(),
            unsplit.logits.len()
        ));
    }
    split
        .logits
        .iter()
        .zip(&unsplit.logits)
        .position(|(a, b)| !same_bits(a, b))
        .map(|forward| {
            let (a, b) = (&split.logits[forward], &unsplit.logits[forward]);
            let largest = a
                .iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            format!("forward {forward}: logits differ (largest difference {largest:e})")
        })
}

/// The unsplit model on `backend` with `experts`, run (see `run`), with the executor's calls.
fn unsplit_trace<B: Backend>(
    backend: &Arc<B>,
    artifact: &Arc<Artifact>,
    experts: Experts,
) -> Trace {
    let noting = NotingExecutor::new(artifact);
    let unsplit = prepare(
        Model::load_offloading_dense_mlps(
            Arc::clone(backend),
            Arc::clone(artifact),
            Arc::clone(&noting) as Arc<dyn ExpertExecutor>,
            experts.offloaded_layers(),
        )
        .unwrap(),
        experts,
    );
    assert!(!unsplit.is_split());
    let mut trace = run(&unsplit);
    trace.executor_calls = noting.calls();
    trace
}

/// The model split at `split` over `backends` with `experts`, run as [`unsplit_trace`] runs the
/// unsplit one.
fn split_trace<B: Backend>(
    backends: &[Arc<B>],
    artifact: &Arc<Artifact>,
    split: &[Range<usize>],
    experts: Experts,
) -> Trace {
    let noting = NotingExecutor::new(artifact);
    let model = prepare(
        Model::load_pipeline(
            PipelineStage::over(backends, split),
            Arc::clone(artifact),
            Arc::clone(&noting) as Arc<dyn ExpertExecutor>,
            experts.offloaded_layers(),
        )
        .unwrap(),
        experts,
    );
    assert!(model.is_split());
    assert_eq!(
        model.offloaded_dense_mlp_layers(),
        experts.offloaded_layers()
    );
    assert_eq!(model.pipeline_stage_layers(), split);
    assert_eq!(
        model.has_mtp(),
        artifact.get("mtp.fc").is_some(),
        "the last stage loads the MTP head"
    );
    let mut trace = run(&model);
    trace.executor_calls = noting.calls();
    trace
}

fn a_split_model_computes_what_the_unsplit_one_computes<B: OpenOnSameDevice>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    // Three stages at most: the given backend and two more on its device.
    let backends: Vec<Arc<B>> = vec![
        Arc::clone(&backend),
        Arc::new(backend.open_on_same_device().unwrap()),
        Arc::new(backend.open_on_same_device().unwrap()),
    ];
    for path in models(directory.path()) {
        let artifact = open_artifact(&path).unwrap();
        let layers = artifact.config().common().num_hidden_layers;
        let has_experts = artifact.config().common().num_experts > 0
            && artifact.config().common().moe_layers.iter().any(|&moe| moe);
        let expert_modes: &[Experts] = match has_experts {
            true => &[
                Experts::Executor,
                Experts::HalfResidentCached,
                Experts::Staged,
                Experts::Layerwise,
            ],
            false => &[Experts::Executor, Experts::OffloadedDenseMlps],
        };
        for &experts in expert_modes {
            let expected = unsplit_trace(&backend, &artifact, experts);
            for split in splits(layers) {
                let got = split_trace(&backends, &artifact, &split, experts);
                if let Some(difference) = first_difference(&got, &expected) {
                    panic!(
                        "{} split {split:?} ({experts:?}, {}): {difference}",
                        path.display(),
                        backend.name()
                    );
                }
            }
        }
    }
}
test_device!(a_split_model_computes_what_the_unsplit_one_computes);

/// Stages of one card sent through the path between cards (`peer_stage_crossings`: a peer copy
/// naming both contexts, as between two GPUs) compute the unsplit model's logits bit for bit,
/// and their crossings took that path.
#[test]
fn peer_crossings_compute_what_the_unsplit_model_computes() {
    let options = CudaOptions {
        peer_stage_crossings: true,
        ..CudaOptions::exact()
    };
    let test = "peer_crossings_compute_what_the_unsplit_model_computes";
    let Some(backend) = cuda_with_options_or_skip(test, options) else {
        return;
    };
    let backends = vec![
        Arc::clone(&backend),
        Arc::new(backend.open_on_same_device().unwrap()),
    ];
    let directory = tempfile::tempdir().unwrap();
    for path in models(directory.path()) {
        let artifact = open_artifact(&path).unwrap();
        let layers = artifact.config().common().num_hidden_layers;
        let expected = unsplit_trace(&backend, &artifact, Experts::Executor);
        let crossings_before = backend.peer_stage_crossings();
        let split = [0..layers / 2, layers / 2..layers];
        let got = split_trace(&backends, &artifact, &split, Experts::Executor);
        if let Some(difference) = first_difference(&got, &expected) {
            panic!("{} split {split:?}: {difference}", path.display());
        }
        assert!(
            backend.peer_stage_crossings() > crossings_before,
            "{}: no crossing took the peer path",
            path.display()
        );
    }
}

/// One stage is the unsplit model.
fn one_stage_is_the_unsplit_model<B: OpenOnSameDevice>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let path = convert_f32("qwen3_5_moe", directory.path());
    let artifact = open_artifact(&path).unwrap();
    let layers = artifact.config().common().num_hidden_layers;
    let model = Model::load_pipeline(
        PipelineStage::over(&[Arc::clone(&backend)], &[0..layers]),
        Arc::clone(&artifact),
        executor(&artifact),
        0,
    )
    .unwrap();
    assert!(!model.is_split());
    assert!(model.has_mtp(), "one stage loads the MTP head as before");
    assert_eq!(model.pipeline_stage_layers(), [0..layers].to_vec());
}
test_device!(one_stage_is_the_unsplit_model);

fn load_error<B: Backend>(
    backends: &[Arc<B>],
    split: &[Range<usize>],
    artifact: &Arc<Artifact>,
) -> String {
    match Model::load_pipeline(
        PipelineStage::over(backends, split),
        Arc::clone(artifact),
        executor(artifact),
        0,
    ) {
        Ok(_) => panic!("the split {split:?} loaded"),
        Err(error) => error.to_string(),
    }
}

/// Stages that skip, repeat or leave out layers, or own none, are refused by name; every stage
/// of a split gets staging slots of its own (two sets with layerwise prefill).
fn wrong_splits_are_refused_and_every_stage_stages_its_own_layers<B: OpenOnSameDevice>(
    backend: Arc<B>,
) {
    let directory = tempfile::tempdir().unwrap();
    let backends = vec![
        Arc::clone(&backend),
        Arc::new(backend.open_on_same_device().unwrap()),
    ];
    let path = convert_f32("qwen3_moe", directory.path());
    let artifact = open_artifact(&path).unwrap();
    let layers = artifact.config().common().num_hidden_layers;
    for (split, expected) in [
        (vec![0..1, 2..layers], "one after another"),
        (vec![0..2, 1..layers], "one after another"),
        (vec![0..0, 0..layers], "at least one layer"),
        (vec![0..1, 1..layers - 1], "covers"),
        (vec![1..2, 2..layers], "from layer 0"),
    ] {
        let error = load_error(&backends, &split, &artifact);
        assert!(error.contains(expected), "{split:?}: {error}");
    }
    let mut model = Model::load_pipeline(
        PipelineStage::over(&backends, &[0..1, 1..layers]),
        Arc::clone(&artifact),
        executor(&artifact),
        0,
    )
    .unwrap();
    // The staged route: one set of staging slots per stage, each for its own MoE layers.
    let mut unsplit = Model::load(
        Arc::clone(&backend),
        Arc::clone(&artifact),
        executor(&artifact),
    )
    .unwrap();
    let one_set = unsplit.enable_prefill_staging(4).unwrap();
    assert!(one_set > 0);
    assert_eq!(model.enable_prefill_staging(4).unwrap(), 2 * one_set);
    // Layerwise prefill: two sets per stage, streamed into alternately.
    let layerwise = PrefillStagingOptions {
        staged_min_tokens: 4,
        layerwise_min_tokens: 8,
    };
    let two_sets = unsplit.enable_prefill_staging_with(layerwise).unwrap();
    assert_eq!(two_sets, 2 * one_set);
    assert_eq!(
        model.enable_prefill_staging_with(layerwise).unwrap(),
        2 * two_sets
    );
}
test_device!(wrong_splits_are_refused_and_every_stage_stages_its_own_layers);

/// Every request's tokens, and the prompt tokens the prefix cache gave it, from `model` served
/// by the scheduler one request after the other: even ones greedy, odd ones sampled with a
/// seed. Op by op (step graphs off, on both models alike).
fn served_tokens<B: Backend>(
    model: Model<B>,
    prompts: &[Vec<u32>],
    prefix_cache: PrefixCacheSettings,
) -> Vec<(Vec<u32>, u32)> {
    model.set_step_graphs(false);
    let commands = scheduler::start_serving(
        Arc::new(model),
        SchedulerLimits {
            max_context: 1024,
            max_sequences: 4,
            prefill_chunk_tokens: 48,
            prefill_time_share: DEFAULT_PREFILL_TIME_SHARE,
        },
        SpeculativeDecoding::default(),
        prefix_cache,
        Arc::new(SchedulerCounters::default()),
    )
    .expect("start the scheduler");
    let mut tokens = Vec::new();
    for (index, prompt) in prompts.iter().enumerate() {
        let (events, receiver) = tokio::sync::mpsc::channel(4096);
        let mut request = greedy_request(format!("request-{index}"), prompt.clone(), 8, events);
        if index % 2 == 1 {
            request.sampling = SamplingParams {
                temperature: 1.0,
                top_k: 20,
                top_p: 0.9,
                seed: 77 + index as u64,
                ..SamplingParams::default()
            };
        }
        commands
            .send(SchedulerCommand::Submit(request))
            .expect("submit");
        let mut receiver = receiver;
        tokens.push(collect_tokens(&mut receiver));
    }
    tokens
}

fn served_split_gives_the_unsplit_tokens<B: OpenOnSameDevice>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let second = Arc::new(backend.open_on_same_device().unwrap());
    for fixture in ["qwen3_moe", "qwen3_next"] {
        let path = convert_f32(fixture, directory.path());
        let artifact = open_artifact(&path).unwrap();
        let layers = artifact.config().common().num_hidden_layers;
        let vocab = artifact.config().common().vocab_size as u32;
        let prompts: Vec<Vec<u32>> = (0..4u32)
            .map(|s| {
                (0..3 + 4 * s)
                    .map(|i| (i * 53 + 7 * s + 1) % vocab)
                    .collect()
            })
            .collect();
        let unsplit = Model::load(
            Arc::clone(&backend),
            Arc::clone(&artifact),
            executor(&artifact),
        )
        .unwrap();
        let expected = served_tokens(unsplit, &prompts, PrefixCacheSettings::off());
        let split = Model::load_pipeline(
            PipelineStage::over(
                &[Arc::clone(&backend), Arc::clone(&second)],
                &[0..1, 1..layers],
            ),
            Arc::clone(&artifact),
            executor(&artifact),
            0,
        )
        .unwrap();
        assert_eq!(
            served_tokens(split, &prompts, PrefixCacheSettings::off()),
            expected,
            "{fixture} on {}",
            backend.name()
        );
    }
}
test_device!(served_split_gives_the_unsplit_tokens);

/// With the prefix cache, a split model reuses what the unsplit model reuses (each stage
/// copying its own layers' KV rows and, for a hybrid, recurrent-state checkpoints) and serves
/// the same tokens: a donor prompt, a later turn extending it, one sharing only its start, and
/// the donor again.
fn served_split_with_the_prefix_cache_gives_the_unsplit_tokens<B: OpenOnSameDevice>(
    backend: Arc<B>,
) {
    let directory = tempfile::tempdir().unwrap();
    let second = Arc::new(backend.open_on_same_device().unwrap());
    let cache = || PrefixCacheSettings {
        budget_bytes: 1 << 30,
        block_tokens: 64,
        checkpoint_interval_blocks: 2,
    };
    for fixture in ["qwen3_moe", "qwen3_next", "qwen4_exp"] {
        let path = convert_f32(fixture, directory.path());
        let artifact = open_artifact(&path).unwrap();
        let layers = artifact.config().common().num_hidden_layers;
        let vocab = artifact.config().common().vocab_size as u32;
        let prompts = turn_prompts(
            vocab,
            TurnLengths {
                system: 200,
                first: 70,
                later: 40,
                other: 30,
            },
        );
        let unsplit = Model::load(
            Arc::clone(&backend),
            Arc::clone(&artifact),
            executor(&artifact),
        )
        .unwrap();
        let expected = served_tokens(unsplit, &prompts, cache());
        assert!(
            expected.iter().skip(1).all(|(_, cached)| *cached > 0),
            "{fixture}: the later prompts reuse the donor's prefix: {expected:?}"
        );
        let split = Model::load_pipeline(
            PipelineStage::over(
                &[Arc::clone(&backend), Arc::clone(&second)],
                &[0..layers - 1, layers - 1..layers],
            ),
            Arc::clone(&artifact),
            executor(&artifact),
            0,
        )
        .unwrap();
        assert_eq!(
            served_tokens(split, &prompts, cache()),
            expected,
            "{fixture} on {}",
            backend.name()
        );
    }
}
test_device!(served_split_with_the_prefix_cache_gives_the_unsplit_tokens);

/// Every position's logits of the qwen3_5_moe fixture's image prompt (three images attached),
/// then a few greedy decode steps.
fn image_prompt_logits<B: Backend>(model: &Model<B>, reference: &serde_json::Value) -> Trace {
    let (grids, rows) = image_prompt_patches(reference);
    let weights = VisionWeights::load(model.artifact())
        .unwrap()
        .expect("the fixture has a vision tower");
    let embeddings = encode_images(&weights, &rows, &grids).unwrap().merged;
    let tokens: Vec<u32> = json_numbers(&reference["token_ids"])
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let vocab = model.vocab_size();
    let mut state = model.new_sequence(tokens.len() + DECODE_STEPS).unwrap();
    model
        .attach_images(&mut state, &tokens, &grids, embeddings)
        .unwrap();
    let all = model
        .forward(
            &mut [SequenceInput {
                state: &mut state,
                tokens: &tokens,
            }],
            LogitsSelection::All,
        )
        .unwrap()
        .remove(0);
    let mut trace = Trace::default();
    let mut token = argmax(&all[all.len() - vocab..]);
    trace.logits.push(all);
    let mut decoded = vec![token];
    for _ in 0..DECODE_STEPS {
        let logits = model.prefill(&mut state, &[token]).unwrap();
        token = argmax(&logits);
        decoded.push(token);
        trace.logits.push(logits);
    }
    trace.tokens.push(decoded);
    trace
}

fn an_image_prompt_split_gives_the_unsplit_logits<B: OpenOnSameDevice>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            golden_fixture_dir("qwen3_5_moe").join("image_prompt_reference.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let path = convert_f32("qwen3_5_moe", directory.path());
    let artifact = open_artifact(&path).unwrap();
    let layers = artifact.config().common().num_hidden_layers;
    let unsplit = Model::load(
        Arc::clone(&backend),
        Arc::clone(&artifact),
        executor(&artifact),
    )
    .unwrap();
    unsplit.set_step_graphs(false);
    let expected = image_prompt_logits(&unsplit, &reference);
    drop(unsplit);
    let second = Arc::new(backend.open_on_same_device().unwrap());
    let split = Model::load_pipeline(
        PipelineStage::over(&[Arc::clone(&backend), second], &[0..1, 1..layers]),
        Arc::clone(&artifact),
        executor(&artifact),
        0,
    )
    .unwrap();
    let got = image_prompt_logits(&split, &reference);
    if let Some(difference) = first_difference(&got, &expected) {
        panic!("image prompt split on {}: {difference}", backend.name());
    }
}
test_device!(an_image_prompt_split_gives_the_unsplit_logits);
