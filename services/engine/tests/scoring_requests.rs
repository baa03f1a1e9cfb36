//! Scoring requests (`ScoreTokens`) served by the scheduler, on the Qwen3-MoE golden fixture:
//!
//! * the NLLs equal the in-process `token_nlls` of the same model bit for bit (one scorer for
//!   both), in chunks that take turns with a generation running at the same time, whose tokens
//!   stay those it generates alone;
//! * a request the engine cannot score is refused with an error naming the problem: one token,
//!   a token outside the vocabulary, more tokens than the context (both numbers named), no free
//!   sequence slot.
//!
//! `cargo test -p ninfer-engine --test scoring_requests -- --nocapture`; the `cuda` variant
//! runs where a GPU opens (`NINFER_REQUIRE_GPU=1` makes its absence a failure).

use std::path::Path;
use std::sync::Arc;

use ninfer_engine::service::scheduler::{
    self, SchedulerCommand, SchedulerCounters, SchedulerError, SchedulerLimits, SchedulerResult,
};
use ninfer_engine::service::scoring::{ScoringRequest, ScoringResult};
use ninfer_engine::testing::{golden_fixture_dir, greedy_request, json_numbers};
use ninfer_engine::{test_device, token_nlls, Backend, Model, PerplexityOptions};
use tokio::sync::mpsc as async_mpsc;

mod support;

const FIXTURE: &str = "qwen3_moe";
const MAX_CONTEXT: usize = 160;

/// The fixture converted with f32 weights under `work` and opened on `backend`.
fn open_fixture<B: Backend>(backend: &Arc<B>, work: &Path) -> Arc<Model<B>> {
    let path = work.join(format!("{FIXTURE}.ninfer"));
    support::convert_f32(golden_fixture_dir(FIXTURE), &path);
    Arc::new(Model::open(Arc::clone(backend), &path).expect("opening the artifact"))
}

/// The fixture's perplexity text, as token ids.
fn text_tokens() -> Vec<u32> {
    let path = golden_fixture_dir(FIXTURE).join("reference.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("reference.json"))
            .expect("reference.json is JSON");
    json_numbers(&json["nll_token_ids"])
        .into_iter()
        .map(|id| id as u32)
        .collect()
}

fn scoring(tokens: Vec<u32>, chunk_tokens: usize) -> (SchedulerCommand, ScoringReceiver) {
    let (scores, receiver) = async_mpsc::channel(4096);
    let command = SchedulerCommand::Score(ScoringRequest {
        request_id: format!("score-{}", tokens.len()),
        tokens,
        chunk_tokens,
        scores,
    });
    (command, receiver)
}

type ScoringReceiver = async_mpsc::Receiver<ScoringResult>;

/// Every NLL of a scoring request in order, and the number of messages; `Err` on a refusal.
fn collect_scores(receiver: &mut ScoringReceiver) -> Result<(Vec<f64>, usize), SchedulerError> {
    let (mut nlls, mut messages) = (Vec::new(), 0);
    while let Some(message) = receiver.blocking_recv() {
        let chunk = message?;
        assert_eq!(chunk.first_position, nlls.len() + 1, "chunks in order");
        nlls.extend(chunk.nll);
        messages += 1;
        if chunk.tokens_done == chunk.tokens_total {
            break;
        }
    }
    Ok((nlls, messages))
}

fn greedy(prompt: &[u32], max_new_tokens: usize) -> (SchedulerCommand, GenerationReceiver) {
    let (events, receiver) = async_mpsc::channel(4096);
    let command = SchedulerCommand::Submit(greedy_request(
        "generation".into(),
        prompt.to_vec(),
        max_new_tokens,
        events,
    ));
    (command, receiver)
}

type GenerationReceiver = async_mpsc::Receiver<SchedulerResult>;

fn collect_tokens(receiver: &mut GenerationReceiver) -> Vec<u32> {
    let mut tokens = Vec::new();
    while let Some(event) = receiver.blocking_recv() {
        let event = event.unwrap_or_else(|e| panic!("generation failed: {e}"));
        tokens.extend(event.token.map(|t| t.token_id));
        if event.finish.is_some() {
            break;
        }
    }
    tokens
}

fn start<B: Backend + 'static>(
    model: &Arc<Model<B>>,
    max_sequences: usize,
) -> std::sync::mpsc::Sender<SchedulerCommand>
where
    B::Tensor: Send,
    ninfer_engine::SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let limits = SchedulerLimits {
        max_context: MAX_CONTEXT,
        max_sequences,
        prefill_chunk_tokens: ninfer_engine::service::scheduler::DEFAULT_PREFILL_CHUNK_TOKENS,
        prefill_time_share: ninfer_engine::service::scheduler::DEFAULT_PREFILL_TIME_SHARE,
    };
    scheduler::start(
        Arc::clone(model),
        limits,
        Arc::new(SchedulerCounters::default()),
    )
    .expect("starting the scheduler")
}

fn scores_equal_in_process_nll_while_a_generation_runs<B: Backend + 'static>(backend: Arc<B>)
where
    B::Tensor: Send,
    ninfer_engine::SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let work = tempfile::tempdir().expect("a scratch directory");
    let model = open_fixture(&backend, work.path());
    let tokens = text_tokens();
    assert!(tokens.len() > 100 && tokens.len() <= MAX_CONTEXT);
    let chunk = 16;
    let expected = token_nlls(
        &model,
        &tokens,
        PerplexityOptions {
            max_context: tokens.len(),
            chunk_tokens: chunk,
        },
        &mut |_, _| {},
    )
    .expect("in-process NLL");
    let expected: Vec<f64> = expected.iter().map(|scored| scored.nll).collect();

    let prompt = &tokens[..12];
    let commands = start(&model, 4);
    let (command, mut alone) = greedy(prompt, 24);
    commands.send(command).expect("scheduler running");
    let generated_alone = collect_tokens(&mut alone);
    assert_eq!(generated_alone.len(), 24);

    // Both at once: the scoring chunks take turns with the generation's steps.
    let (generate, mut generation) = greedy(prompt, 24);
    let (score, mut scores) = scoring(tokens.clone(), chunk);
    commands.send(generate).expect("scheduler running");
    commands.send(score).expect("scheduler running");
    let (nlls, messages) = collect_scores(&mut scores).expect("scored");
    let generated_beside = collect_tokens(&mut generation);
    assert_eq!(
        messages,
        tokens.len().div_ceil(chunk),
        "one message per chunk"
    );
    assert_eq!(nlls.len(), tokens.len() - 1);
    let mismatches = nlls
        .iter()
        .zip(&expected)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    println!(
        "{}: {} tokens scored in {messages} chunks, mean NLL {:.6}; {mismatches} differ from in-process",
        backend.name(),
        nlls.len(),
        nlls.iter().sum::<f64>() / nlls.len() as f64
    );
    assert_eq!(mismatches, 0, "scoring differs from the in-process NLL");
    assert_eq!(
        generated_beside, generated_alone,
        "a generation beside a scoring request changed its tokens"
    );
}
test_device!(scores_equal_in_process_nll_while_a_generation_runs);

fn unscorable_requests_are_refused_by_name<B: Backend + 'static>(backend: Arc<B>)
where
    B::Tensor: Send,
    ninfer_engine::SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let work = tempfile::tempdir().expect("a scratch directory");
    let model = open_fixture(&backend, work.path());
    let vocab = model.vocab_size() as u32;
    let commands = start(&model, 1);
    let refusal = |tokens: Vec<u32>| {
        let (command, mut receiver) = scoring(tokens, 0);
        commands.send(command).expect("scheduler running");
        collect_scores(&mut receiver).expect_err("refused")
    };

    let one = refusal(vec![1]);
    assert!(
        matches!(&one, SchedulerError::InvalidRequest(m) if m.contains("at least 2 tokens")),
        "{one}"
    );
    let outside = refusal(vec![1, vocab + 3]);
    assert!(
        matches!(&outside, SchedulerError::InvalidRequest(m) if m.contains(&format!("{}", vocab + 3))),
        "{outside}"
    );
    let long = refusal(vec![1; MAX_CONTEXT + 1]);
    assert_eq!(
        long,
        SchedulerError::ScoringContextExceeded {
            tokens: MAX_CONTEXT + 1,
            max_context: MAX_CONTEXT
        }
    );
    let message = long.to_string();
    assert!(
        message.contains(&(MAX_CONTEXT + 1).to_string())
            && message.contains(&MAX_CONTEXT.to_string()),
        "{message}"
    );

    // The one sequence slot is held by a generation: a scoring request waits for none.
    let (generate, mut generation) = greedy(&[1, 2, 3], MAX_CONTEXT - 3);
    commands.send(generate).expect("scheduler running");
    let busy = refusal(vec![1, 2, 3]);
    assert_eq!(busy, SchedulerError::Busy { max_sequences: 1 });
    assert_eq!(collect_tokens(&mut generation).len(), MAX_CONTEXT - 3);
    println!("refusals: {one}; {outside}; {long}; {busy}");
}
test_device!(unscorable_requests_are_refused_by_name);
