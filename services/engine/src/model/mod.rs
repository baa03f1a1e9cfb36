//! The model graph of qwen3_moe, qwen3_next, qwen3_5_moe and the dense qwen3_5, written once
//! over [`Backend`].
//!
//! Owns: loading the weights a model needs (by the artifact's internal names), per-sequence state
//! (`SequenceState`: KV caches, conv and recurrent states sized from a max context), and the
//! batched forward pass (prefill, continuation and single-token decode of several sequences at
//! once), and the MTP draft head (`mtp`). A MoE layer's feed-forward is `MoeLayer::forward` (`crate::moe::layer`): this module
//! loads its weights, places its resident experts and calls it.
//!
//! This file holds [`Model`] and its accessors; the jobs are `loading.rs`, `expert_placement.rs`,
//! `sequences.rs`, `forward.rs` (with `layers.rs` the types they share), `step_graphs.rs`,
//! `mtp.rs`, `speculative.rs`, `prefill_staging.rs` (staging slots and layerwise prefill),
//! `prefix_blocks.rs`, `worker_handoff.rs`, `images.rs` (a prompt's
//! images), `pipeline.rs` (the layers split over several backends) and `qwen4_exp/`.
//! Must not touch: op implementations (backends), how routed experts are split and computed
//! (`crate::moe`), sampling, tokenization.

mod expert_placement;
mod forward;
mod images;
mod layers;
mod loader;
mod loading;
mod mid_forward_checkpoint;
mod mtp;
mod pipeline;
mod prefill_staging;
mod prefix_blocks;
pub mod qwen4_exp;
mod sequences;
mod speculation_rules;
mod speculative;
mod step_graphs;
mod worker_handoff;

use std::sync::{Arc, Mutex};

use ninfer_artifact::Artifact;

use crate::backend::{Backend, DeltaRuleForm};
use crate::moe::expert_cache::ExpertCache;
use crate::moe::layer::PrefillStaging;
use crate::moe::ExpertExecutor;
use crate::profile::ForwardProfile;
use crate::spec::ModelSpec;
use layers::{FeedForward, Layer};

pub use expert_placement::{LayerwiseSummary, PrefillStagingOptions, ResidentExpertsReport};
pub use layers::{
    ImageKey, LayerState, LogitsSelection, SequenceCheckpoint, SequenceImages, SequenceInput,
    SequenceState,
};
pub use loading::open_artifact;
pub use mtp::{mtp_pairs_of_block, MtpPrefixRows, MtpState, MtpUsage};
pub use pipeline::PipelineStage;
pub use prefix_blocks::PrefixBlock;
pub use speculation_rules::{
    pick_draft, probe_draft, verify_drafts, DraftController, DraftPlan, ForcedAcceptance,
};
pub use speculative::{
    greedy_with_mtp, greedy_with_mtp_options, sample_with_mtp, FirstDraft, SpeculationOptions,
    SpeculativeOutcome,
};
pub use step_graphs::StepGraphCounts;

/// A loaded model on a backend, or split over several ([`Model::load_pipeline`]).
pub struct Model<B: Backend> {
    /// The backend of every layer, or with a layer split the first stage's (embeddings).
    backend: Arc<B>,
    /// The other stages of a layer split (`pipeline.rs`); `None`: one backend runs it all.
    pipeline: Option<pipeline::PipelineStages<B>>,
    artifact: Arc<Artifact>,
    spec: ModelSpec,
    embed_tokens: B::Weight,
    /// On the last stage; with tied embeddings a split model loads the table there again.
    lm_head: Option<B::Weight>,
    /// Absent in qwen4_exp (its final stream mixer takes the place).
    final_norm: Option<B::Weight>,
    layers: Vec<Layer<B>>,
    /// The MTP draft head, when the artifact has one.
    mtp: Option<mtp::MtpHead<B>>,
    experts: Arc<dyn ExpertExecutor>,
    delta_rule_form: DeltaRuleForm,
    profile: Arc<ForwardProfile>,
    /// Batches of at least its `min_tokens` rows compute their non-resident routed experts on
    /// the backend from one layer-sized set of staging slots ([`Model::enable_prefill_staging`]).
    prefill_staging: Option<PrefillStaging<B>>,
    /// Decode steps recorded once and replayed, per batch of sequences (`step_graphs`).
    step_graphs: Mutex<step_graphs::StepGraphs<B>>,
    /// The dynamic expert cache over the resident slots ([`Model::enable_expert_cache`]).
    expert_cache: Option<ExpertCache>,
    /// The qwen4_exp parts (hyper-connections, QSA indexers, PLE blocks).
    qwen4_exp: Option<qwen4_exp::graph::Qwen4ExpGraph<B>>,
    /// The backend's own hand-off to the expert workers, when both have one
    /// (`worker_handoff`).
    worker_handoff: Option<worker_handoff::BackendHandoff<B>>,
}

impl<B: Backend> Model<B> {
    /// The always-on profile counters of this model's forwards.
    pub fn profile(&self) -> &Arc<ForwardProfile> {
        &self.profile
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn artifact(&self) -> &Arc<Artifact> {
        &self.artifact
    }

    /// The backend of the embeddings: the only one, or with a layer split the first stage's
    /// (logits and final hidden states are on [`Model::output_backend`]).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn vocab_size(&self) -> usize {
        self.spec.common.vocab_size
    }

    /// A qwen4_exp model: whether its n-gram tables are locked in RAM (they never go to the
    /// device; when the RAM or `RLIMIT_MEMLOCK` does not allow it, they stay mapped). `None`
    /// for other architectures.
    pub fn ngram_tables_locked_in_ram(&self) -> Option<bool> {
        self.qwen4_exp
            .as_ref()
            .map(|graph| graph.ngram_tables_locked_in_ram())
    }

    /// Per placement layer, whether it has routed experts: the decoder layers in order, then
    /// the MTP head's layer when the model has one (it takes part in placement like one more
    /// MoE layer, so its experts go where the main layers' go).
    pub fn placement_layers(&self) -> Vec<bool> {
        self.feed_forwards()
            .map(|feed_forward| matches!(feed_forward, FeedForward::Moe(_)))
            .collect()
    }

    /// Every feed-forward that placement covers: the decoder layers', then the MTP layer's.
    fn feed_forwards(&self) -> impl Iterator<Item = &FeedForward<B>> {
        self.layers
            .iter()
            .map(|layer| &layer.feed_forward)
            .chain(self.mtp.as_ref().map(|head| &head.layer.feed_forward))
    }
}
