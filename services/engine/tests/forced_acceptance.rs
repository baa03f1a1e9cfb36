//! The benchmarks' forced acceptance of MTP drafts, on the trained fixture (which has an MTP
//! head) on the CPU: at rate 0 every step yields one token, as decoding without drafts does, and
//! the tokens are plain greedy decoding's (each rejection rolled back); at rate 1 every draft is
//! accepted (N + 1 tokens per step); the union of routed experts per verification that the
//! outcome reports equals the one counted independently from the routing the expert executor
//! saw; adaptive drafting at rate 0 falls back to single-draft probes.

use std::sync::{Arc, Mutex};

use ninfer_artifact::DType;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::model::{
    greedy_with_mtp, greedy_with_mtp_options, DraftController, ForcedAcceptance, SpeculationOptions,
};
use ninfer_engine::testing::golden_fixture_dir;
use ninfer_engine::{
    open_artifact, CpuBackend, EngineError, ExpertBatch, ExpertExecutor, Model,
    ReferenceExpertExecutor,
};

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
    convert_checkpoint(
        &ConvertOptions {
            experts_dtype: DType::F32,
            dense_dtype: DType::F32,
            ..ConvertOptions::new(golden_fixture_dir(FIXTURE), &path)
        },
        &NoProgress,
    )
    .expect("converting the trained fixture");
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
