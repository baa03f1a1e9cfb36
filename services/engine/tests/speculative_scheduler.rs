//! MTP speculative decoding served by the scheduler, on the fixtures with an MTP head (the trained
//! Qwen3.5-MoE fixture, whose drafts are often right, and the random golden ones — MoE and dense,
//! whose drafts are almost always wrong): greedy output equals plain greedy decoding token for token at 1, 2 and 3
//! drafts, with speculating and plain sequences batched together and prompts arriving while
//! others verify drafts; sampled output is plain sampling's with the same seed, continued
//! answers included.
//!
//! `cargo test -p ninfer-engine --test speculative_scheduler -- --nocapture` prints the
//! acceptance per draft depth.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ninfer_engine::service::scheduler::{
    self, GenerationRequest, SchedulerCommand, SchedulerCounters, SchedulerLimits, SchedulerResult,
    SpeculativeDecoding,
};
use ninfer_engine::testing::{golden_fixture_dir, greedy_tokens, json_numbers};
use ninfer_engine::{test_device, Backend, Model, SamplingParams, SequenceState};
use tokio::sync::mpsc as async_mpsc;

mod support;

/// `fixture` converted with f32 weights under `work` and opened on `backend`.
fn open_fixture<B: Backend>(backend: &Arc<B>, fixture: &str, work: &Path) -> Arc<Model<B>> {
    let path: PathBuf = work.join(format!("{fixture}.ninfer"));
    support::convert_f32(golden_fixture_dir(fixture), &path);
    let model = Model::open(Arc::clone(backend), &path).expect("open the artifact");
    assert!(model.has_mtp(), "{fixture} has an MTP head");
    Arc::new(model)
}

/// The trained fixture's reference prompts.
fn trained_prompts() -> Vec<Vec<u32>> {
    let path = golden_fixture_dir("qwen3_5_moe_trained").join("reference.json");
    let text = std::fs::read_to_string(&path).expect("reference.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("reference.json is JSON");
    json["prompts"]
        .as_array()
        .expect("reference.json: prompts")
        .iter()
        .map(|p| {
            json_numbers(&p["prompt_token_ids"])
                .into_iter()
                .map(|x| x as u32)
                .collect()
        })
        .collect()
}

/// One request of a run.
struct Submission {
    prompt: Vec<u32>,
    max_new_tokens: usize,
    sampling: SamplingParams,
    /// The request's own draft limit (`None`: the engine's).
    draft_tokens: Option<usize>,
    /// Submitted once the first request has streamed this many tokens (0: at once).
    after_tokens: usize,
}

fn request(
    submission: &Submission,
    id: usize,
) -> (GenerationRequest, async_mpsc::Receiver<SchedulerResult>) {
    let (events, receiver) = async_mpsc::channel(4096);
    let request = GenerationRequest {
        request_id: format!("request-{id}"),
        prompt: submission.prompt.clone(),
        max_new_tokens: submission.max_new_tokens,
        sampling: submission.sampling.clone(),
        stop_token_ids: Vec::new(),
        top_logprobs: 0,
        sampleable_vocabulary: 0,
        logit_bias: Vec::new(),
        guide: None,
        draft_tokens: submission.draft_tokens,
        images: None,
        events,
    };
    (request, receiver)
}

/// Streams every event of one request; returns its tokens.
fn collect(receiver: &mut async_mpsc::Receiver<SchedulerResult>, limit: usize) -> Vec<u32> {
    let mut tokens = Vec::new();
    while tokens.len() < limit {
        let Some(event) = receiver.blocking_recv() else {
            break;
        };
        let event = event.unwrap_or_else(|e| panic!("{e}"));
        tokens.extend(event.token.map(|t| t.token_id));
        if event.finish.is_some() {
            break;
        }
    }
    tokens
}

/// Runs `submissions` through one scheduler with up to `draft_tokens` drafts; returns every
/// request's tokens and the counters.
fn serve<B: Backend + 'static>(
    model: &Arc<Model<B>>,
    draft_tokens: usize,
    submissions: &[Submission],
) -> (Vec<Vec<u32>>, Arc<SchedulerCounters>)
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let counters = Arc::new(SchedulerCounters::default());
    let limits = SchedulerLimits {
        max_context: 1024,
        max_sequences: 32,
        prefill_chunk_tokens: ninfer_engine::service::scheduler::DEFAULT_PREFILL_CHUNK_TOKENS,
        prefill_time_share: ninfer_engine::service::scheduler::DEFAULT_PREFILL_TIME_SHARE,
    };
    let commands = scheduler::start_speculative(
        Arc::clone(model),
        limits,
        SpeculativeDecoding {
            max_draft_tokens: draft_tokens,
        },
        Arc::clone(&counters),
    )
    .expect("start the scheduler");
    let mut receivers = Vec::new();
    for (id, submission) in submissions.iter().enumerate() {
        if submission.after_tokens > 0 {
            continue;
        }
        let (request, receiver) = request(submission, id);
        commands
            .send(SchedulerCommand::Submit(request))
            .expect("submit");
        receivers.push((id, receiver));
    }
    // The late requests arrive while the first one is decoding (and drafting).
    let mut first_tokens = Vec::new();
    let mut late: Vec<usize> = (0..submissions.len())
        .filter(|&id| submissions[id].after_tokens > 0)
        .collect();
    late.sort_by_key(|&id| submissions[id].after_tokens);
    let mut late_receivers = Vec::new();
    if !late.is_empty() {
        let (_, first) = receivers.first_mut().expect("a request submitted at once");
        for id in late {
            let wanted = submissions[id].after_tokens;
            let more = wanted.saturating_sub(first_tokens.len());
            first_tokens.extend(collect(first, more));
            let (request, receiver) = request(&submissions[id], id);
            commands
                .send(SchedulerCommand::Submit(request))
                .expect("submit");
            late_receivers.push((id, receiver));
        }
    }
    receivers.extend(late_receivers);
    let mut outputs = vec![Vec::new(); submissions.len()];
    for (position, (id, mut receiver)) in receivers.into_iter().enumerate() {
        let mut tokens = if position == 0 {
            std::mem::take(&mut first_tokens)
        } else {
            Vec::new()
        };
        tokens.extend(collect(&mut receiver, usize::MAX));
        outputs[id] = tokens;
    }
    (outputs, counters)
}

fn acceptance_by_depth(counters: &SchedulerCounters) -> Vec<String> {
    counters
        .drafted_at_depth
        .iter()
        .zip(&counters.accepted_at_depth)
        .map(|(d, a)| (d.load(Ordering::Relaxed), a.load(Ordering::Relaxed)))
        .take_while(|&(d, _)| d > 0)
        .map(|(d, a)| format!("{:.2}", a as f64 / d as f64))
        .collect()
}

/// Greedy requests through the speculating scheduler give plain greedy decoding's tokens, at 1,
/// 2 and 3 drafts, with one request that does not speculate in the same batch and two that
/// arrive (and prefill) while the others verify drafts.
fn greedy_output_is_plain_greedy_output<B: Backend + 'static>(backend: Arc<B>)
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let work = tempfile::tempdir().expect("temporary directory");
    let trained = trained_prompts();
    let random_prompts = vec![
        vec![1, 2, 3, 4, 5],
        vec![7, 8, 9],
        vec![10, 3, 3, 3, 3, 3, 3, 3],
        vec![11],
    ];
    // The dense `qwen3_5` fixture's MTP layer has a dense MLP instead of experts.
    let cases: [(&str, Vec<Vec<u32>>); 3] = [
        (
            "qwen3_5_moe_trained",
            trained.iter().take(4).cloned().collect(),
        ),
        ("qwen3_5_moe", random_prompts.clone()),
        ("qwen3_5", random_prompts),
    ];
    for (fixture, prompts) in cases {
        let model = open_fixture(&backend, fixture, work.path());
        let new_tokens = 24;
        let expected: Vec<Vec<u32>> = prompts
            .iter()
            .map(|prompt| greedy_tokens(&model, prompt, new_tokens).expect("greedy decoding"))
            .collect();
        let submissions: Vec<Submission> = prompts
            .iter()
            .enumerate()
            .map(|(index, prompt)| Submission {
                prompt: prompt.clone(),
                max_new_tokens: new_tokens,
                sampling: SamplingParams::greedy(),
                // The second request does not speculate; the last two arrive late.
                draft_tokens: (index == 1).then_some(0),
                after_tokens: match index {
                    2 => 3,
                    3 => 9,
                    _ => 0,
                },
            })
            .collect();
        for draft_tokens in 1..=3 {
            let (outputs, counters) = serve(&model, draft_tokens, &submissions);
            for (index, (output, expected)) in outputs.iter().zip(&expected).enumerate() {
                assert_eq!(
                    output, expected,
                    "{fixture}, {draft_tokens} drafts, request {index}: speculative greedy differs from greedy"
                );
            }
            let (drafted, accepted) = counters.draft_totals();
            let steps = counters.speculative_steps.load(Ordering::Relaxed);
            println!(
                "{fixture} on {}: up to {draft_tokens} drafts, {drafted} drafted, {accepted} accepted, acceptance by depth {}, {:.2} tokens per speculative step",
                backend.name(),
                acceptance_by_depth(&counters).join(" / "),
                (steps + accepted) as f64 / steps.max(1) as f64
            );
            assert!(drafted > 0, "{fixture}: nothing was drafted");
            if fixture == "qwen3_5_moe_trained" {
                assert!(accepted > 0, "{fixture}: no draft was accepted");
            }
        }
    }
}
test_device!(greedy_output_is_plain_greedy_output);

/// Sampled requests through the speculating scheduler give, token for token, what the same
/// seeds give without drafts, at 1, 2 and 3 drafts and under the sampling settings clients use
/// (top-k and top-p, the whole row, min-p with a penalty): drafting changes no draw. A request
/// continued at a random stream position (what the gateway submits when an engine went away)
/// gives the rest of the uninterrupted answer while it drafts. Prints the acceptance per
/// setting.
fn sampled_output_is_plain_sampled_output<B: Backend + 'static>(backend: Arc<B>)
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let work = tempfile::tempdir().expect("temporary directory");
    let model = open_fixture(&backend, "qwen3_5_moe_trained", work.path());
    let prompts: Vec<Vec<u32>> = trained_prompts().into_iter().take(2).collect();
    let new_tokens = 24;
    let settings = [
        (
            "T 0.7, top-k 20, top-p 0.95",
            SamplingParams {
                temperature: 0.7,
                top_k: 20,
                top_p: 0.95,
                ..SamplingParams::default()
            },
        ),
        (
            "T 1.0, whole row",
            SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            },
        ),
        (
            "T 0.9, top-p 0.9, min-p 0.05, repetition 1.1",
            SamplingParams {
                temperature: 0.9,
                top_p: 0.9,
                min_p: 0.05,
                repetition_penalty: 1.1,
                ..SamplingParams::default()
            },
        ),
    ];
    for (name, params) in settings {
        let submissions: Vec<Submission> = (0..8u64)
            .map(|seed| Submission {
                prompt: prompts[seed as usize % prompts.len()].clone(),
                max_new_tokens: new_tokens,
                sampling: SamplingParams {
                    seed,
                    ..params.clone()
                },
                draft_tokens: None,
                after_tokens: if seed == 7 { 5 } else { 0 },
            })
            .collect();
        let (plain, _) = serve(&model, 0, &submissions);
        for output in &plain {
            assert_eq!(output.len(), new_tokens, "{name}: a short answer");
        }
        for draft_tokens in 1..=3 {
            let (drafted, counters) = serve(&model, draft_tokens, &submissions);
            let (drafts, accepted) = counters.draft_totals();
            println!(
                "{name} on {}: up to {draft_tokens} drafts, {drafts} drafted, {accepted} accepted, acceptance by depth {}",
                backend.name(),
                acceptance_by_depth(&counters).join(" / ")
            );
            for (seed, (output, expected)) in drafted.iter().zip(&plain).enumerate() {
                assert_eq!(
                    output, expected,
                    "{name}, {draft_tokens} drafts, seed {seed}: drafting changed the sampled tokens"
                );
            }
            assert!(drafts > 0, "{name}: nothing was drafted");
        }
        // Continuations at each point of two answers: the prompt and the tokens so far, the
        // stream advanced past their draws, drafting from the start.
        let continuations: Vec<Submission> = [0usize, 3]
            .iter()
            .flat_map(|&seed| {
                let (plain, params, submissions) = (&plain, &params, &submissions);
                [1usize, 6, 17].map(move |sent| Submission {
                    prompt: submissions[seed]
                        .prompt
                        .iter()
                        .chain(&plain[seed][..sent])
                        .copied()
                        .collect(),
                    max_new_tokens: new_tokens - sent,
                    sampling: SamplingParams {
                        seed: seed as u64,
                        stream_position: sent as u64,
                        ..params.clone()
                    },
                    draft_tokens: None,
                    after_tokens: 0,
                })
            })
            .collect();
        let (continued, _) = serve(&model, 2, &continuations);
        for (index, output) in continued.iter().enumerate() {
            let (seed, sent) = ([0usize, 3][index / 3], [1usize, 6, 17][index % 3]);
            assert_eq!(
                output[..],
                plain[seed][sent..],
                "{name}, seed {seed}: continued after {sent} tokens while drafting, the rest differs"
            );
        }
    }
}
test_device!(sampled_output_is_plain_sampled_output);

/// With top-k 1, sampling through the speculating scheduler is greedy decoding.
fn top_one_sampling_with_drafts_is_greedy_decoding<B: Backend + 'static>(backend: Arc<B>)
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let work = tempfile::tempdir().expect("temporary directory");
    let model = open_fixture(&backend, "qwen3_5_moe_trained", work.path());
    let prompt = trained_prompts().swap_remove(0);
    let top_one = Submission {
        prompt: prompt.clone(),
        max_new_tokens: 16,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 1,
            seed: 3,
            ..SamplingParams::default()
        },
        draft_tokens: None,
        after_tokens: 0,
    };
    let (outputs, _) = serve(&model, 2, &[top_one]);
    assert_eq!(
        outputs[0],
        greedy_tokens(&model, &prompt, 16).expect("greedy"),
        "top-k 1 sampling with drafts must be greedy decoding"
    );
}
test_device!(top_one_sampling_with_drafts_is_greedy_decoding);

/// The reference executor, counting the calls it gets per layer (to tell which layers' routed
/// experts reached it rather than the resident slots).
struct CountingExecutor {
    inner: ninfer_engine::ReferenceExpertExecutor,
    calls_per_layer: std::sync::Mutex<std::collections::BTreeMap<usize, u64>>,
}

impl CountingExecutor {
    fn calls_at(&self, layer: usize) -> u64 {
        let calls = self.calls_per_layer.lock().expect("counter lock");
        calls.get(&layer).copied().unwrap_or(0)
    }

    fn reset(&self) {
        self.calls_per_layer.lock().expect("counter lock").clear();
    }
}

impl ninfer_engine::ExpertExecutor for CountingExecutor {
    fn name(&self) -> &str {
        "counting reference"
    }

    fn compute(
        &self,
        batch: &ninfer_engine::ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ninfer_engine::EngineError> {
        *self
            .calls_per_layer
            .lock()
            .expect("counter lock")
            .entry(batch.layer)
            .or_default() += 1;
        self.inner.compute(batch, out)
    }
}

/// How many of each MoE layer's routed experts a placement case makes resident.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ResidentShare {
    All,
    Half,
    None,
}

/// Greedy requests through the speculating scheduler under each expert placement (every
/// routed expert resident, half of them with the dynamic expert cache moving them, none): the
/// MTP layer's experts are placed like a main layer's (resident when theirs are, the executor
/// called for the MTP layer only when some of its experts are not resident, the cache counting
/// it), and the output equals plain greedy decoding at 1, 2 and 3 drafts.
fn greedy_output_is_plain_greedy_output_under_each_placement<B: Backend + 'static>(backend: Arc<B>)
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    use ninfer_engine::moe::expert_cache::ExpertCacheOptions;
    use ninfer_engine::moe::placement::{choose_gpu_experts, GpuExpertShape};

    let work = tempfile::tempdir().expect("temporary directory");
    let fixture = "qwen3_5_moe_trained";
    let path = work.path().join(format!("{fixture}.ninfer"));
    support::convert_f32(golden_fixture_dir(fixture), &path);
    let prompts: Vec<Vec<u32>> = trained_prompts().into_iter().take(3).collect();
    let new_tokens = 16;
    for share in [ResidentShare::All, ResidentShare::Half, ResidentShare::None] {
        let artifact = ninfer_engine::open_artifact(&path).expect("open the artifact");
        let executor = Arc::new(CountingExecutor {
            inner: ninfer_engine::ReferenceExpertExecutor::new(Arc::clone(&artifact)),
            calls_per_layer: Default::default(),
        });
        let mut model = Model::load(
            Arc::clone(&backend),
            artifact,
            Arc::clone(&executor) as Arc<dyn ninfer_engine::ExpertExecutor>,
        )
        .expect("load the model");
        assert!(model.has_mtp(), "{fixture} has an MTP head");
        let num_experts = model.spec().common.num_experts;
        let mtp_layer = model.mtp_layer_index();
        let placement_layers = model.placement_layers();
        assert_eq!(placement_layers.len(), mtp_layer + 1);
        assert!(
            placement_layers[mtp_layer],
            "{fixture}: the MTP layer has routed experts"
        );
        let per_layer = match share {
            ResidentShare::All => num_experts,
            ResidentShare::Half => num_experts / 2,
            ResidentShare::None => 0,
        };
        let shape = GpuExpertShape {
            num_experts,
            moe_layers: placement_layers.clone(),
            expert_bytes: model.expert_slot_bytes().expect("routed experts"),
        };
        let placement = choose_gpu_experts(&shape, per_layer, None);
        let report = model
            .place_resident_experts(&placement)
            .expect("place the experts");
        let moe_layers = placement_layers.iter().filter(|&&moe| moe).count();
        assert_eq!(
            report.experts,
            per_layer * moe_layers,
            "{share:?}: every MoE layer, the MTP layer included, gets its share"
        );
        assert_eq!(model.mtp_resident_experts(), Some(per_layer), "{share:?}");
        let cache = (share != ResidentShare::None).then(|| {
            let fills_per_layer = if share == ResidentShare::Half { 2 } else { 0 };
            model
                .enable_expert_cache(
                    ExpertCacheOptions {
                        fills_per_layer,
                        ..ExpertCacheOptions::default()
                    },
                    None,
                )
                .expect("start the expert cache")
        });
        let model = Arc::new(model);
        let expected: Vec<Vec<u32>> = prompts
            .iter()
            .map(|prompt| greedy_tokens(&model, prompt, new_tokens).expect("greedy decoding"))
            .collect();
        let submissions: Vec<Submission> = prompts
            .iter()
            .enumerate()
            .map(|(index, prompt)| Submission {
                prompt: prompt.clone(),
                max_new_tokens: new_tokens,
                sampling: SamplingParams::greedy(),
                draft_tokens: None,
                after_tokens: if index == 2 { 4 } else { 0 },
            })
            .collect();
        for draft_tokens in 1..=3 {
            executor.reset();
            let (outputs, counters) = serve(&model, draft_tokens, &submissions);
            for (index, (output, expected)) in outputs.iter().zip(&expected).enumerate() {
                assert_eq!(
                    output, expected,
                    "{share:?} resident, {draft_tokens} drafts, request {index}: speculative greedy differs from greedy"
                );
            }
            let drafted = counters.draft_totals().0;
            assert!(drafted > 0, "{share:?}: nothing was drafted");
            let mtp_calls = executor.calls_at(mtp_layer);
            let main_calls = executor.calls_at(0);
            println!(
                "{fixture} on {}, {share:?} resident, up to {draft_tokens} drafts: {drafted} drafted, executor calls: MTP layer {mtp_calls}, layer 0 {main_calls}",
                backend.name()
            );
            match share {
                ResidentShare::All => assert_eq!(
                    mtp_calls, 0,
                    "every MTP expert is resident: the executor must not be called for the MTP layer"
                ),
                // Half resident with 8+ experts: some draft routes to a non-resident expert.
                ResidentShare::Half | ResidentShare::None => assert!(
                    mtp_calls > 0,
                    "{share:?}: the MTP layer's non-resident experts go to the executor"
                ),
            }
        }
        if let Some(counters) = cache {
            let mtp_counts = counters.per_layer()[mtp_layer];
            println!("{share:?}: MTP layer cache counts {mtp_counts:?}");
            assert!(
                mtp_counts.hits > 0,
                "{share:?}: the cache counts the MTP layer's resident hits"
            );
            if share == ResidentShare::All {
                assert_eq!(mtp_counts.misses, 0, "every MTP expert is resident");
            } else {
                assert!(mtp_counts.misses > 0, "half resident: some MTP routes miss");
            }
        }
    }
}
test_device!(greedy_output_is_plain_greedy_output_under_each_placement);
