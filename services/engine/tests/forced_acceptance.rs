//! The benchmarks' forced acceptance of MTP drafts, on the trained fixture (which has an MTP
//! head) on the CPU: at rate 0 every step yields one token, as decoding without drafts does, and
//! the tokens are plain greedy decoding's (each rejection rolled back); at rate 1 every draft is
//! accepted (N + 1 tokens per step); the union of routed experts per verification that the
//! outcome reports equals the one counted independently from the routing the expert executor
//! saw; adaptive drafting at rate 0 falls back to probes, and runs the MTP head (its layer and
//! the vocabulary head) at those probes only, while the MTP layer still sees every position:
//! held-back pairs go through it in one batched forward, with the bits and the drafts of a run
//! that never skips.

use std::sync::{Arc, Mutex};

use ninfer_engine::model::{
    greedy_with_mtp, greedy_with_mtp_options, DraftController, DraftPlan, ForcedAcceptance,
    SpeculationOptions,
};
use ninfer_engine::testing::golden_fixture_dir;
use ninfer_engine::Backend;
use ninfer_engine::{
    open_artifact, CpuBackend, EngineError, ExpertBatch, ExpertExecutor, Model,
    ReferenceExpertExecutor,
};

mod support;

const FIXTURE: &str = "qwen3_5_moe_trained";

/// The reference executor, recording every routing it is shown: `(layer, distinct experts)`.
struct RecordingExecutor {
    inner: ReferenceExpertExecutor,
    calls: Mutex<Vec<(usize, u64)>>,
}

impl ExpertExecutor for RecordingExecutor {
    fn name(&self) -> &str {
        "recording reference"
    }

    fn observe_routing(&self, layer: usize, expert_ids: &[u32], _tokens: usize) {
        let mut distinct: Vec<u32> = expert_ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        self.calls
            .lock()
            .expect("recording lock")
            .push((layer, distinct.len() as u64));
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        self.inner.compute(batch, out)
    }
}

/// The fixture converted to f32 and opened on the CPU with a recording executor.
fn open_recording(work: &std::path::Path) -> (Model<CpuBackend>, Arc<RecordingExecutor>) {
    let path = work.join("trained.ninfer");
    support::convert_f32(golden_fixture_dir(FIXTURE), &path);
    let artifact = open_artifact(&path).expect("opening the artifact");
    let executor = Arc::new(RecordingExecutor {
        inner: ReferenceExpertExecutor::new(Arc::clone(&artifact)),
        calls: Mutex::new(Vec::new()),
    });
    let model = Model::load(
        Arc::new(CpuBackend::new()),
        artifact,
        Arc::clone(&executor) as Arc<dyn ExpertExecutor>,
    )
    .expect("loading the model");
    (model, executor)
}

fn forced(rates: &[f64], draft_tokens: usize, adaptive: bool) -> SpeculationOptions {
    SpeculationOptions {
        draft_tokens,
        adaptive,
        forced_acceptance: Some(ForcedAcceptance::new(rates, 7).expect("valid rates")),
    }
}

/// The fixture's first reference prompt.
fn prompt() -> Vec<u32> {
    let path = golden_fixture_dir(FIXTURE).join("reference.json");
    let text = std::fs::read_to_string(&path).expect("reading reference.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("parsing reference.json");
    json["prompts"][0]["prompt_token_ids"]
        .as_array()
        .expect("reference.json: prompts[0].prompt_token_ids")
        .iter()
        .map(|id| id.as_u64().expect("a token id") as u32)
        .collect()
}

#[test]
fn forced_acceptance_at_zero_and_one_gives_one_and_n_plus_one_tokens_per_step() {
    let work = tempfile::tempdir().expect("temporary directory");
    let (model, _) = open_recording(work.path());
    let prompt = prompt();
    let count = 25;
    let off = greedy_with_mtp(&model, &prompt, count, 0).expect("decoding without drafts");
    assert_eq!(off.tokens_per_step(), 1.0);

    for draft_tokens in 1..=3 {
        // Rate 0: every draft computed and verified, every one rejected and rolled back.
        let none =
            greedy_with_mtp_options(&model, &prompt, count, forced(&[0.0], draft_tokens, false))
                .expect("forced rejection");
        assert_eq!(
            none.tokens_per_step(),
            off.tokens_per_step(),
            "{draft_tokens} drafts"
        );
        assert_eq!(none.verifications, off.verifications);
        assert_eq!(
            none.tokens, off.tokens,
            "{draft_tokens} drafts, all rejected: the rollback must give greedy decoding's tokens"
        );
        assert!(none.drafted[0] > 0 && none.accepted.iter().all(|&a| a == 0));
        assert!(
            none.rows_per_verification() > 1.0,
            "drafts were not verified: {} rows per verification",
            none.rows_per_verification()
        );

        // Rate 1: every draft accepted. 24 tokens after the first are exactly 24 / (N + 1)
        // steps for N = 1, 2, 3.
        let all =
            greedy_with_mtp_options(&model, &prompt, count, forced(&[1.0], draft_tokens, false))
                .expect("forced acceptance");
        assert_eq!(all.tokens.len(), count);
        assert_eq!(
            all.tokens_per_step(),
            (draft_tokens + 1) as f64,
            "{draft_tokens} drafts"
        );
        assert_eq!(all.accepted, all.drafted);
        assert_eq!(all.rows_per_verification(), (draft_tokens + 1) as f64);
        // Seeded: the same run gives the same tokens.
        let again =
            greedy_with_mtp_options(&model, &prompt, count, forced(&[1.0], draft_tokens, false))
                .expect("forced acceptance again");
        assert_eq!(again.tokens, all.tokens);
    }

    // Rates by depth: the cumulative shares come out near the asked ones over many steps.
    let long = greedy_with_mtp_options(&model, &prompt, 160, forced(&[0.8, 0.56, 0.41], 3, false))
        .expect("forced fixture rates");
    let rate = |depth: usize| long.accepted[depth] as f64 / long.drafted[depth].max(1) as f64;
    for (depth, asked) in [0.8, 0.56, 0.41].into_iter().enumerate() {
        assert!(
            (rate(depth) - asked).abs() < 0.2,
            "depth {}: {:.2} accepted, {asked} asked",
            depth + 1,
            rate(depth)
        );
    }
}

#[test]
fn adaptive_drafting_at_rate_zero_falls_back_to_probes() {
    let work = tempfile::tempdir().expect("temporary directory");
    let (model, _) = open_recording(work.path());
    let prompt = prompt();
    let count = 120;
    let adaptive = greedy_with_mtp_options(&model, &prompt, count, forced(&[0.0], 3, true))
        .expect("adaptive drafting, every draft rejected");
    let fixed = greedy_with_mtp_options(&model, &prompt, count, forced(&[0.0], 3, false))
        .expect("fixed drafting, every draft rejected");
    assert_eq!(adaptive.tokens, fixed.tokens);
    assert_eq!(adaptive.tokens_per_step(), 1.0);
    // Fixed: 3 drafts per step; adaptive: a few steps while the estimate falls, then one
    // single-draft probe per PROBE_INTERVAL steps.
    let drafted_rows = |outcome: &ninfer_engine::model::SpeculativeOutcome| {
        outcome.verified_rows - outcome.verifications as u64
    };
    assert!(drafted_rows(&fixed) >= 3 * (count as u64 - 4));
    let most = 3 * 3 + (count / DraftController::PROBE_INTERVAL) as u64 + 1;
    assert!(
        drafted_rows(&adaptive) <= most,
        "adaptive drafting verified {} drafts at rate 0 (at most {most} expected)",
        drafted_rows(&adaptive)
    );
}

/// At rate 0 an adaptive sequence runs the MTP layer and the vocabulary head for drafts at its
/// probes only (counted by the model, not by the loop): as many head rows and MTP-layer
/// forwards as a controller fed the same rejections plans probes, never a verified draft row,
/// and every position through the MTP layer once. Without forcing, its tokens are plain greedy
/// decoding's.
#[test]
fn adaptive_drafting_at_rate_zero_runs_the_mtp_head_only_at_probes() {
    let work = tempfile::tempdir().expect("temporary directory");
    let (model, _) = open_recording(work.path());
    let prompt = prompt();
    let count = 120;
    let off = greedy_with_mtp(&model, &prompt, count, 0).expect("decoding without drafts");

    // The probes a controller plans when every check is rejected: one token per step.
    let mut controller = DraftController::new(3);
    let mut expected_probes = 0;
    for produced in 1..count {
        let plan = controller.next_plan(count - produced - 1);
        assert!(
            matches!(plan, DraftPlan::Skip | DraftPlan::Probe),
            "step {produced}: {plan:?} at rate 0"
        );
        controller.record(plan.drafts(), 0);
        expected_probes += usize::from(plan == DraftPlan::Probe);
    }
    assert!(expected_probes >= count / DraftController::PROBE_INTERVAL);

    let before = model.mtp_usage();
    let adaptive = greedy_with_mtp_options(&model, &prompt, count, forced(&[0.0], 3, true))
        .expect("adaptive drafting, every draft rejected");
    let after = model.mtp_usage();
    assert_eq!(adaptive.tokens, off.tokens);
    assert_eq!(adaptive.probes, expected_probes);
    assert_eq!(adaptive.drafted[0], expected_probes);
    assert_eq!(
        after.draft_head_rows - before.draft_head_rows,
        expected_probes as u64,
        "the vocabulary head drafted outside the probes"
    );
    assert_eq!(
        after.layer_forwards - before.layer_forwards,
        expected_probes as u64,
        "one batched MTP-layer forward per probe, none between"
    );
    // Every pair up to the last probe, once: the prompt's and one per step before it.
    let last_probe_token = adaptive
        .first_drafts
        .last()
        .map(|draft| draft.position)
        .expect("a probe");
    assert_eq!(
        after.layer_rows - before.layer_rows,
        (prompt.len() - 1 + last_probe_token) as u64
    );
    assert_eq!(
        adaptive.verified_rows, adaptive.verifications as u64,
        "a probe's draft became an input row"
    );

    // Unforced: probes and drafts through the model's own decisions keep greedy's tokens.
    let options = SpeculationOptions {
        draft_tokens: 3,
        adaptive: true,
        forced_acceptance: None,
    };
    let unforced =
        greedy_with_mtp_options(&model, &prompt, count, options).expect("adaptive drafting");
    assert_eq!(unforced.tokens, off.tokens);
    assert!(unforced.probes >= 1, "a new sequence starts with a probe");
}

/// Drafts made after a long run of skipped positions (their pairs held back, then one batched
/// MTP-layer forward) are the drafts a run that drafts at every position makes there.
#[test]
fn drafts_after_skipped_positions_equal_drafts_of_a_run_that_never_skips() {
    let work = tempfile::tempdir().expect("temporary directory");
    let (model, _) = open_recording(work.path());
    let prompt = prompt();
    let count = 110;
    // Rate 0 keeps one token per step in both runs, so both have a draft for every position
    // the adaptive run probes at.
    let every_step = greedy_with_mtp_options(&model, &prompt, count, forced(&[0.0], 1, false))
        .expect("a draft at every step");
    let skipping = greedy_with_mtp_options(&model, &prompt, count, forced(&[0.0], 3, true))
        .expect("adaptive drafting, every draft rejected");
    assert_eq!(skipping.tokens, every_step.tokens);
    // Every step but the last (which leaves no room for a draft).
    assert_eq!(every_step.first_drafts.len(), count - 2);
    let probed: Vec<usize> = skipping.first_drafts.iter().map(|d| d.position).collect();
    assert!(
        probed
            .windows(2)
            .any(|pair| pair[1] - pair[0] >= DraftController::PROBE_INTERVAL),
        "no long run of skipped positions: probes at {probed:?}"
    );
    for draft in &skipping.first_drafts {
        let reference = every_step
            .first_drafts
            .iter()
            .find(|d| d.position == draft.position)
            .map(|d| (d.token, d.logit.to_bits()));
        // The logit's bits: a draft from an MTP layer that missed positions can still pick
        // the same token.
        assert_eq!(
            reference,
            Some((draft.token, draft.logit.to_bits())),
            "the draft for token {} after skipped positions differs",
            draft.position
        );
    }
}

/// The MTP layer over held-back pairs in one forward gives the bits of one forward per pair:
/// the last row's output and its draft logits are equal, bit for bit (on this backend).
#[test]
fn one_batched_mtp_forward_equals_one_forward_per_pair() {
    let work = tempfile::tempdir().expect("temporary directory");
    let (model, _) = open_recording(work.path());
    let backend = model.backend();
    let mut tokens = prompt();
    tokens.extend(
        greedy_with_mtp(&model, &tokens.clone(), 40, 0)
            .expect("decoding")
            .tokens,
    );
    let mut state = model.new_sequence(tokens.len()).expect("sequence");
    let hidden = model
        .forward_hidden(
            &mut [ninfer_engine::SequenceInput {
                state: &mut state,
                tokens: &tokens,
            }],
            None,
        )
        .expect("forward");
    let pairs = tokens.len() - 1;
    // The first `start` pairs one by one in both, then the rest batched or one by one.
    let start = 5;
    let mut batched = model.new_mtp_state(tokens.len()).expect("MTP state");
    let mut single = model.new_mtp_state(tokens.len()).expect("MTP state");
    let rows = |range: std::ops::Range<usize>| {
        backend
            .gather_rows(&hidden, &range.collect::<Vec<_>>())
            .expect("rows")
    };
    let mut last_single = None;
    for position in 0..pairs {
        let out = model
            .mtp_forward(
                &mut single,
                &rows(position..position + 1),
                &tokens[position + 1..position + 2],
            )
            .expect("one pair");
        if position < start {
            model
                .mtp_forward(
                    &mut batched,
                    &rows(position..position + 1),
                    &tokens[position + 1..position + 2],
                )
                .expect("one pair");
        }
        last_single = Some(out);
    }
    let out = model
        .mtp_forward(&mut batched, &rows(start..pairs), &tokens[start + 1..])
        .expect("held pairs in one forward");
    let last_batched = backend
        .gather_rows(&out, &[pairs - start - 1])
        .expect("last row");
    let last_single = last_single.expect("a pair");
    let bits = |tensor| -> Vec<u32> {
        backend
            .download(tensor)
            .expect("download")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(bits(&last_batched), bits(&last_single));
    let logits_bits = |tensor| -> Vec<u32> {
        model
            .mtp_draft_logits(tensor)
            .expect("draft logits")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(logits_bits(&last_batched), logits_bits(&last_single));
    assert_eq!(batched.position(), single.position());
}

#[test]
fn reported_expert_union_equals_the_routing_of_the_verifications() {
    let work = tempfile::tempdir().expect("temporary directory");
    let (model, executor) = open_recording(work.path());
    let prompt = prompt();
    let main_layers = model.spec().common.num_hidden_layers;
    let moe_layers = model
        .spec()
        .common
        .moe_layers
        .iter()
        .filter(|&&moe| moe)
        .count() as u64;
    for draft_tokens in [0, 1, 3] {
        executor.calls.lock().expect("recording lock").clear();
        // At rate 1 nothing is recomputed: after the prompt's forward, every forward of the
        // main model is a verification.
        let options = if draft_tokens == 0 {
            SpeculationOptions::default()
        } else {
            forced(&[1.0], draft_tokens, false)
        };
        let outcome =
            greedy_with_mtp_options(&model, &prompt, 17, options).expect("speculative decoding");
        let calls = executor.calls.lock().expect("recording lock").clone();
        // The main model's MoE calls (the MTP layer's index follows the main layers), cut into
        // forwards where the layer index starts again.
        let mut forwards: Vec<Vec<u64>> = Vec::new();
        let mut last_layer = usize::MAX;
        for (layer, distinct) in calls.into_iter().filter(|(layer, _)| *layer < main_layers) {
            if last_layer == usize::MAX || layer <= last_layer {
                forwards.push(Vec::new());
            }
            last_layer = layer;
            forwards.last_mut().expect("a forward").push(distinct);
        }
        let verifications = &forwards[1..];
        assert_eq!(
            verifications.len(),
            outcome.verifications,
            "{draft_tokens} drafts"
        );
        assert!(verifications.iter().all(|f| f.len() as u64 == moe_layers));
        let calls: u64 = verifications.iter().map(|f| f.len() as u64).sum();
        let distinct: u64 = verifications.iter().flatten().sum();
        assert_eq!(
            outcome.verify_moe_layer_calls, calls,
            "{draft_tokens} drafts"
        );
        assert_eq!(
            outcome.verify_distinct_experts, distinct,
            "{draft_tokens} drafts"
        );
        let top_k = model.spec().common.num_experts_per_tok as f64;
        let union = outcome.experts_per_verify_layer();
        if draft_tokens == 0 {
            assert_eq!(union, top_k, "one row reads exactly top-k experts");
        } else {
            assert!(union > top_k && union <= (draft_tokens + 1) as f64 * top_k);
        }
    }
}

#[test]
fn forced_acceptance_refuses_rates_that_cannot_be() {
    for (rates, word) in [
        (&[][..], "no rate"),
        (&[1.5][..], "0..=1"),
        (&[-0.1][..], "0..=1"),
        (&[0.5, 0.6][..], "above depth 1"),
    ] {
        let message = ForcedAcceptance::new(rates, 1)
            .expect_err("a bad rate list")
            .to_string();
        assert!(message.contains(word), "{rates:?}: {message}");
    }
}
