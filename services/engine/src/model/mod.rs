//! The model graph of qwen3_moe, qwen3_next, qwen3_5_moe and the dense qwen3_5, written once
//! over [`Backend`].
//!
//! Owns: loading the weights a model needs (by the artifact's internal names), per-sequence state
//! (`SequenceState`: KV caches, conv and recurrent states sized from a max context), and the
//! batched forward pass (prefill, continuation and single-token decode of several sequences at
//! once), and the MTP draft head (`mtp`). A MoE layer's feed-forward is `MoeLayer::forward` (`crate::moe::layer`): this module
//! loads its weights, places its resident experts and calls it.
//! Must not touch: op implementations (backends), how routed experts are split and computed
//! (`crate::moe`), sampling, tokenization.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ninfer_artifact::{Artifact, ArtifactError, ExpertBank, TensorClass};

use crate::backend::{
    Backend, DeltaRuleForm, ExpertSlotFills, Rotation, Routing, Segment, WithExpertSlotTable,
};
use crate::error::EngineError;
use crate::moe::expert_cache::{ExpertCache, ExpertCacheCounters, ExpertCacheOptions};
use crate::moe::layer::{
    DeferredRouting, LayerwiseSettings, MoeContext, MoeLayer, PrefillStaging, SharedExpert,
};
use crate::moe::layerwise::{
    layer_split, streamed_expert_count, LayerBatch, LayerPlan, LayerSplit, LayerwiseStream,
    PrefillThroughputs,
};
use crate::moe::{ExpertBatch, ExpertExecutor, ReferenceExpertExecutor};
use crate::profile::{nanos, ForwardProfile, Phase, PhaseTotals};
use crate::service::routing_stats::ExpertStatistics;
use crate::spec::{check_architecture_name, FeedForwardKind, MixerKind, ModelSpec};

mod mtp;
mod prefix_blocks;
pub mod qwen4_exp;
mod speculative;
mod step_graphs;
mod worker_handoff;
pub use mtp::{mtp_pairs_of_block, MtpPrefixRows, MtpState, MtpUsage};
pub use prefix_blocks::PrefixBlock;
pub use speculative::{
    greedy_with_mtp, greedy_with_mtp_options, pick_draft, probe_draft, sample_with_mtp,
    speculative_sampling_step, verify_drafts, DraftController, DraftPlan, DraftToken, FirstDraft,
    ForcedAcceptance, SpeculationOptions, SpeculativeOutcome,
};
pub use step_graphs::StepGraphCounts;

/// Which positions' logits a forward returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsSelection {
    /// Only each sequence's last new token (prefill and decode).
    Last,
    /// Every new token (perplexity).
    All,
}

enum Mixer<B: Backend> {
    Attention {
        q_proj: B::Weight,
        k_proj: B::Weight,
        v_proj: B::Weight,
        o_proj: B::Weight,
        q_norm: B::Weight,
        k_norm: B::Weight,
    },
    GatedDeltaNet {
        in_proj_qkv: B::Weight,
        in_proj_z: B::Weight,
        in_proj_b: B::Weight,
        in_proj_a: B::Weight,
        conv1d: B::Weight,
        dt_bias: B::Weight,
        a_log: B::Weight,
        norm: B::Weight,
        out_proj: B::Weight,
    },
}

enum FeedForward<B: Backend> {
    Dense {
        gate_proj: B::Weight,
        up_proj: B::Weight,
        down_proj: B::Weight,
    },
    /// A dense MLP computed by the expert executor (the CPU workers) from its one-expert bank
    /// (`layers.L.mlp.experts`): no copy on the backend.
    OffloadedDense {
        bank: ExpertBank,
    },
    Moe(MoeLayer<B>),
}

/// What [`Model::place_resident_experts`] put where.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResidentExpertsReport {
    /// MoE layers with at least one resident expert.
    pub layers: usize,
    /// Resident experts over all layers.
    pub experts: usize,
    /// Bytes of expert weights copied to the backend.
    pub bytes: u64,
}

struct Layer<B: Backend> {
    /// Absent in qwen4_exp, whose hyper-connection norms take the layer norms' place.
    input_norm: Option<B::Weight>,
    post_attention_norm: Option<B::Weight>,
    mixer: Mixer<B>,
    feed_forward: FeedForward<B>,
}

impl<B: Backend> Layer<B> {
    fn input_norm(&self) -> Result<&B::Weight, EngineError> {
        self.input_norm
            .as_ref()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "a decoder layer without an input norm".into(),
            })
    }

    fn post_attention_norm(&self) -> Result<&B::Weight, EngineError> {
        self.post_attention_norm
            .as_ref()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "a decoder layer without a post-attention norm".into(),
            })
    }
}

/// State of one layer of one sequence.
pub enum LayerState<B: Backend> {
    Attention(B::KvCache),
    GatedDeltaNet {
        conv: B::ConvState,
        recurrent: B::RecurrentState,
    },
    /// A qwen4_exp QSA attention layer's cache, where the backend computes.
    SparseAttention(B::QsaCache),
}

/// Everything a sequence carries between forwards.
pub struct SequenceState<B: Backend> {
    max_context: usize,
    position: usize,
    layers: Vec<LayerState<B>>,
    /// Per layer, a qwen4_exp PLE block's state (empty for other architectures).
    ple: Vec<Option<qwen4_exp::graph::PleState<B>>>,
    /// Names these states' buffers for the step graphs that record them: new for every new
    /// sequence and whenever a buffer is replaced ([`Model::restore`]).
    graph_key: u64,
}

impl<B: Backend> SequenceState<B> {
    /// Tokens processed so far (= position of the next token).
    pub fn position(&self) -> usize {
        self.position
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }
}

/// What the layers of one forward share: the MoE context, and what the MoE layers count and
/// leave to be finished at the end.
struct LayerScratch<'a, B: Backend> {
    moe_context: MoeContext<'a, B>,
    tally: PhaseTotals,
    deferred: Vec<DeferredRouting<B>>,
}

impl<'a, B: Backend> LayerScratch<'a, B> {
    fn new(moe_context: MoeContext<'a, B>) -> Self {
        LayerScratch {
            moe_context,
            tally: PhaseTotals::default(),
            deferred: Vec::new(),
        }
    }
}

/// A sequence's state at one point, to go back to ([`Model::checkpoint`], [`Model::restore`]).
pub struct SequenceCheckpoint<B: Backend> {
    position: usize,
    /// Per layer: copies of a Gated DeltaNet layer's conv and recurrent states.
    layers: Vec<Option<(B::ConvState, B::RecurrentState)>>,
    /// Copies of the PLE states (qwen4_exp).
    ple: Vec<Option<qwen4_exp::graph::PleState<B>>>,
}

/// A checked batch: its token ids, each sequence's rows, each row's position.
#[derive(Default)]
struct BatchPlan {
    ids: Vec<u32>,
    ranges: Vec<std::ops::Range<usize>>,
    positions: Vec<usize>,
}

/// New tokens of one sequence in a batched forward.
pub struct SequenceInput<'a, B: Backend> {
    pub state: &'a mut SequenceState<B>,
    pub tokens: &'a [u32],
}

/// [`Model::enable_prefill_staging_with`]'s thresholds (rows of a forward's batch; 0: off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillStagingOptions {
    /// The staged route: the routed non-resident experts copied after the routing, no overlap.
    pub staged_min_tokens: usize,
    /// Layerwise prefill: every layer's experts streamed while the layer before computes.
    pub layerwise_min_tokens: usize,
}

/// [`Model::layerwise_split_summary`]: a batch's layers by split, the estimated seconds of
/// their non-resident experts and the expert bytes the streaming would copy.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LayerwiseSummary {
    pub layerwise_gpu_layers: usize,
    pub mixed_layers: usize,
    pub cpu_layers: usize,
    pub seconds: f64,
    pub streamed_bytes: u64,
}

/// A loaded model on a backend.
pub struct Model<B: Backend> {
    backend: Arc<B>,
    artifact: Arc<Artifact>,
    spec: ModelSpec,
    embed_tokens: B::Weight,
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

/// Opens an artifact; if the reader rejects its header, says which architecture it names when
/// that is one the engine does not implement (the likelier cause than corruption).
pub fn open_artifact(path: &Path) -> Result<Arc<Artifact>, EngineError> {
    match Artifact::open(path) {
        Ok(artifact) => {
            check_architecture_name(artifact.config().architecture().name())?;
            Ok(Arc::new(artifact))
        }
        Err(error @ ArtifactError::Corrupt { .. }) => {
            if let Some(name) = header_architecture(path) {
                check_architecture_name(&name)?;
            }
            Err(error.into())
        }
        Err(error) => Err(error.into()),
    }
}

/// The `architecture` string of an artifact's header, read without interpreting the config.
fn header_architecture(path: &Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).ok()?;
    let mut preamble = vec![0u8; ninfer_artifact::header::PREAMBLE_LENGTH as usize];
    file.read_exact(&mut preamble).ok()?;
    let preamble = ninfer_artifact::header::Preamble::decode(&preamble, path).ok()?;
    // Only headers inside part 0 are probed; this is a diagnostic, not a reader.
    let length = usize::try_from(preamble.header_length).ok()?;
    if length > 256 << 20 {
        return None;
    }
    file.seek(SeekFrom::Start(preamble.header_offset)).ok()?;
    let mut header = vec![0u8; length];
    file.read_exact(&mut header).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&header).ok()?;
    value.get("architecture")?.as_str().map(str::to_string)
}

impl<B: Backend> Model<B> {
    /// Opens the artifact at `path` and loads it with the f32 reference expert executor.
    pub fn open(backend: Arc<B>, path: &Path) -> Result<Self, EngineError> {
        let artifact = open_artifact(path)?;
        let experts: Arc<dyn ExpertExecutor> =
            Arc::new(ReferenceExpertExecutor::new(Arc::clone(&artifact)));
        Self::load(backend, artifact, experts)
    }

    /// Loads every non-expert weight onto the backend; experts stay with `experts`.
    pub fn load(
        backend: Arc<B>,
        artifact: Arc<Artifact>,
        experts: Arc<dyn ExpertExecutor>,
    ) -> Result<Self, EngineError> {
        Self::load_offloading_dense_mlps(backend, artifact, experts, 0)
    }

    /// [`Model::load`] with the dense MLPs of the last `offloaded_layers` dense-MLP layers left
    /// in host RAM: `experts` computes them from their one-expert banks (`layers.L.mlp.experts`)
    /// as one expert of routing weight 1, so the backend holds no copy of them.
    pub fn load_offloading_dense_mlps(
        backend: Arc<B>,
        artifact: Arc<Artifact>,
        experts: Arc<dyn ExpertExecutor>,
        offloaded_layers: usize,
    ) -> Result<Self, EngineError> {
        let spec = ModelSpec::from_config(artifact.config())?;
        let offloaded = dense_mlp_offload_plan(&spec, offloaded_layers)?;
        let common = &spec.common;
        let (hidden, vocab) = (common.hidden_size, common.vocab_size);
        let loader = Loader {
            backend: &*backend,
            artifact: &artifact,
        };
        let embed_tokens = loader.matrix("embed_tokens", (vocab, hidden))?;
        let lm_head = if common.tie_word_embeddings {
            None
        } else {
            Some(loader.matrix("lm_head", (vocab, hidden))?)
        };
        let qwen4_exp = match artifact.config().qwen4_exp() {
            Some(config) => Some(qwen4_exp::graph::Qwen4ExpGraph::load(
                &loader,
                config,
                &spec.mixers,
            )?),
            None => None,
        };
        // qwen4_exp has no final norm (its final stream mixer takes that place).
        let final_norm = match qwen4_exp {
            Some(_) => None,
            None => Some(loader.parameter("final_norm", (1, hidden))?),
        };
        let layers = offloaded
            .iter()
            .enumerate()
            .map(|(layer, &offload)| loader.layer(&spec, layer, offload))
            .collect::<Result<Vec<_>, _>>()?;
        let mtp = loader.mtp_head(&spec)?;
        let profile = Arc::new(ForwardProfile::new(dense_weight_bytes(
            &artifact,
            common.tie_word_embeddings,
        )));
        let worker_handoff = worker_handoff::BackendHandoff::open(&*backend, &experts, common);
        Ok(Model {
            backend,
            artifact,
            spec,
            embed_tokens,
            lm_head,
            final_norm,
            layers,
            mtp,
            experts,
            delta_rule_form: DeltaRuleForm::Auto,
            profile,
            prefill_staging: None,
            step_graphs: Default::default(),
            expert_cache: None,
            qwen4_exp,
            worker_handoff,
        })
    }

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

    /// Puts experts of each MoE layer in the backend's expert slots (GPU expert slots):
    /// `placement[layer]` lists the experts of that layer to make resident (empty: none; dense
    /// layers must be empty). The layers are those of [`Model::placement_layers`]: the decoder
    /// layers, then the MTP layer; a placement that stops after the decoder layers leaves the
    /// MTP layer's experts with the executor. Replaces any earlier placement. Resident experts
    /// are computed by the backend while the expert executor computes the others; the sum is
    /// the same.
    pub fn place_resident_experts(
        &mut self,
        placement: &[Vec<u32>],
    ) -> Result<ResidentExpertsReport, EngineError> {
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        let with_mtp = self.layers.len() + usize::from(self.mtp.is_some());
        if placement.len() != self.layers.len() && placement.len() != with_mtp {
            return Err(invalid(format!(
                "expert placement lists {} layers, the model has {} (and {} with its MTP layer)",
                placement.len(),
                self.layers.len(),
                with_mtp
            )));
        }
        let common = self.spec.common.clone();
        let mut report = ResidentExpertsReport::default();
        let no_experts = Vec::new();
        let feed_forwards = self
            .layers
            .iter_mut()
            .map(|layer| &mut layer.feed_forward)
            .chain(self.mtp.as_mut().map(|head| &mut head.layer.feed_forward));
        for (index, feed_forward) in feed_forwards.enumerate() {
            let experts = placement.get(index).unwrap_or(&no_experts);
            let FeedForward::Moe(moe) = feed_forward else {
                if experts.is_empty() {
                    continue;
                }
                return Err(invalid(format!(
                    "layer {index} has no routed experts, the placement lists {}",
                    experts.len()
                )));
            };
            let bytes =
                moe.place_resident(&self.backend, &self.artifact, &common, index, experts)?;
            if !experts.is_empty() {
                report.layers += 1;
                report.experts += experts.len();
                report.bytes += bytes;
            }
        }
        Ok(report)
    }

    /// How many of the MTP layer's routed experts are resident now; `None` when the model has
    /// no MTP head or its layer has no routed experts.
    pub fn mtp_resident_experts(&self) -> Option<usize> {
        match self.mtp.as_ref().map(|head| &head.layer.feed_forward) {
            Some(FeedForward::Moe(moe)) => Some(moe.resident_expert_count()),
            _ => None,
        }
    }

    /// The placement index of the MTP layer (it follows the decoder layers).
    pub fn mtp_layer_index(&self) -> usize {
        self.layers.len()
    }

    /// From batches of `min_tokens` rows on (a long prompt's prefill), every MoE layer copies
    /// the non-resident experts its tokens route to into one set of backend slots (room for all
    /// experts of one layer, reused layer after layer) and computes them there, instead of
    /// sending the batch to the expert executor. On a GPU the copies are DMAs from the
    /// page-locked banks: a layer's experts cross PCIe in milliseconds, where the CPU would
    /// need tens of milliseconds per hundred tokens (DESIGN.md, "Prefill of long prompts").
    /// Returns the bytes the slots take; a model without routed experts needs none.
    pub fn enable_prefill_staging(&mut self, min_tokens: usize) -> Result<u64, EngineError> {
        self.enable_prefill_staging_with(PrefillStagingOptions {
            staged_min_tokens: min_tokens,
            layerwise_min_tokens: 0,
        })
    }

    /// [`Model::enable_prefill_staging`] with layerwise prefill beside it: from
    /// `layerwise_min_tokens` rows on (0: never) a forward streams each MoE layer's
    /// non-resident experts into one half of two layer-sized sets of staging slots while the
    /// layer before computes, and leaves as many of them to the expert executor as the
    /// throughputs ([`Model::set_prefill_throughputs`], [`Model::measure_prefill_throughputs`])
    /// say is fastest (DESIGN.md, "Prefill of long prompts"). `staged_min_tokens` 0: no staged
    /// route. Returns the bytes the slots take.
    pub fn enable_prefill_staging_with(
        &mut self,
        options: PrefillStagingOptions,
    ) -> Result<u64, EngineError> {
        let common = &self.spec.common;
        let mut layouts = self.placed_moe_layers().map(|moe| moe.layout(common));
        let Some(first) = layouts.next() else {
            return Ok(0);
        };
        let layout = first?;
        for other in layouts {
            if other? != layout {
                return Err(EngineError::InvalidConfig {
                    problem: "prefill staging needs every MoE layer's experts in one layout".into(),
                });
            }
        }
        let halves = if options.layerwise_min_tokens > 0 {
            2
        } else {
            1
        };
        let mut slots = self.backend.new_expert_slots(
            &layout,
            common.num_experts,
            halves * common.num_experts,
        )?;
        // Ready every bank now (on a GPU: page-lock it), so the first long prompt does not
        // pay for it: the first 4K prefill measured 30% slower than the second before this.
        let started = std::time::Instant::now();
        for moe in self.placed_moe_layers() {
            self.backend
                .prepare_expert_source(&mut slots, &self.artifact, &moe.bank);
        }
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            "prefill staging: expert banks readied as copy sources"
        );
        let flops_per_pair = 6.0 * common.hidden_size as f64 * common.moe_intermediate_size as f64;
        self.prefill_staging = Some(PrefillStaging {
            min_tokens: match options.staged_min_tokens {
                0 => usize::MAX,
                tokens => tokens,
            },
            slots: Mutex::new(slots),
            layerwise: (options.layerwise_min_tokens > 0).then(|| LayerwiseSettings {
                min_tokens: options.layerwise_min_tokens,
                throughputs: std::sync::RwLock::new(PrefillThroughputs::unmeasured(flops_per_pair)),
            }),
        });
        Ok((halves * common.num_experts * layout.stride) as u64)
    }

    fn layerwise_settings(&self) -> Result<&LayerwiseSettings, EngineError> {
        self.prefill_staging
            .as_ref()
            .and_then(|staging| staging.layerwise.as_ref())
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "layerwise prefill is not enabled".into(),
            })
    }

    /// What layerwise prefill chooses each layer's split from, from now on.
    pub fn set_prefill_throughputs(
        &self,
        throughputs: PrefillThroughputs,
    ) -> Result<(), EngineError> {
        let settings = self.layerwise_settings()?;
        *settings
            .throughputs
            .write()
            .map_err(|_| EngineError::InvalidConfig {
                problem: "the prefill throughputs' lock is poisoned".into(),
            })? = throughputs;
        Ok(())
    }

    /// The throughputs layerwise prefill uses now (`None` when it is off).
    pub fn prefill_throughputs(&self) -> Option<PrefillThroughputs> {
        let settings = self.layerwise_settings().ok()?;
        settings.throughputs.read().ok().map(|t| *t)
    }

    /// Measures the three rates layerwise prefill chooses from and uses them from now on:
    /// the copy of the first MoE layer's experts into the staging slots (bytes / time, the
    /// fastest of three; on a GPU the pinned host-to-device rate), the backend's slotted
    /// experts over `backend_tokens` rows of uniform routing (pairs / time), and the expert
    /// executor over `executor_tokens` rows (0 rows, or a failure: rate 0, nothing is left to
    /// it). Each timed run follows an untimed one.
    pub fn measure_prefill_throughputs(
        &self,
        backend_tokens: usize,
        executor_tokens: usize,
    ) -> Result<PrefillThroughputs, EngineError> {
        let settings = self.layerwise_settings()?;
        let staging = self
            .prefill_staging
            .as_ref()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "layerwise prefill is not enabled".into(),
            })?;
        let Some((layer, moe)) = self.indexed_moe_layers().next() else {
            return Err(EngineError::InvalidConfig {
                problem: "the model has no MoE layer to measure".into(),
            });
        };
        let common = &self.spec.common;
        let (experts, k, hidden) = (
            common.num_experts,
            common.num_experts_per_tok,
            common.hidden_size,
        );
        let flops_per_pair = 6.0 * hidden as f64 * common.moe_intermediate_size as f64;
        let all: Vec<usize> = (0..experts).collect();
        let mut slots = staging
            .slots
            .lock()
            .map_err(|_| EngineError::InvalidConfig {
                problem: "the prefill staging slots' lock is poisoned".into(),
            })?;
        slots.complete_fills()?;
        let mut copy_seconds = f64::INFINITY;
        for run in 0..4 {
            self.backend.wait_for_queued_ops()?;
            let started = Instant::now();
            slots.start_batch_fill(0, &all, &self.artifact, &moe.bank)?;
            slots.complete_batch_fill()?;
            self.backend.wait_for_queued_ops()?;
            if run > 0 {
                copy_seconds = copy_seconds.min(started.elapsed().as_secs_f64());
            }
        }
        let bytes = (experts as u64 * moe.bank.expert_stride) as f64;
        // A uniform routing: token t's choice j is expert (t·k + j) mod E, weight 1/k.
        let uniform = |tokens: usize| Routing {
            experts_per_token: k,
            expert_ids: (0..tokens * k)
                .map(|pair| (pair % experts) as u32)
                .collect(),
            weights: vec![1.0 / k as f32; tokens * k],
        };
        let hidden_values = |tokens: usize| -> Vec<f32> {
            (0..tokens * hidden)
                .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
                .collect()
        };
        let backend_tokens = backend_tokens.max(1);
        let x = self
            .backend
            .upload(&hidden_values(backend_tokens), backend_tokens, hidden)?;
        let routing = uniform(backend_tokens);
        let mut backend_seconds = f64::INFINITY;
        for run in 0..2 {
            self.backend.wait_for_queued_ops()?;
            let started = Instant::now();
            let out = self.backend.slotted_experts(&slots, &x, &routing)?;
            self.backend.wait_for_queued_ops()?;
            drop(out);
            if run > 0 {
                backend_seconds = started.elapsed().as_secs_f64();
            }
        }
        drop(slots);
        let executor_pairs_per_second = if executor_tokens == 0 {
            0.0
        } else {
            let values = hidden_values(executor_tokens);
            let routing = uniform(executor_tokens);
            let mut out = vec![0.0f32; values.len()];
            let mut seconds = f64::INFINITY;
            let mut failed = None;
            for run in 0..2 {
                let started = Instant::now();
                let computed = self.experts.compute(
                    &ExpertBatch {
                        layer,
                        bank: &moe.bank,
                        hidden_size: hidden,
                        intermediate_size: common.moe_intermediate_size,
                        hidden: &values,
                        experts_per_token: k,
                        expert_ids: &routing.expert_ids,
                        weights: &routing.weights,
                    },
                    &mut out,
                );
                if let Err(error) = computed {
                    failed = Some(error);
                    break;
                }
                if run > 0 {
                    seconds = started.elapsed().as_secs_f64();
                }
            }
            match failed {
                Some(error) => {
                    tracing::warn!("measuring the expert executor failed ({error}); layerwise prefill leaves it nothing");
                    0.0
                }
                None => (executor_tokens * k) as f64 / seconds.max(1e-9),
            }
        };
        let throughputs = PrefillThroughputs {
            copy_bytes_per_second: bytes / copy_seconds.max(1e-9),
            backend_pairs_per_second: (backend_tokens * k) as f64 / backend_seconds.max(1e-9),
            executor_pairs_per_second,
            flops_per_pair,
        };
        *settings
            .throughputs
            .write()
            .map_err(|_| EngineError::InvalidConfig {
                problem: "the prefill throughputs' lock is poisoned".into(),
            })? = throughputs;
        Ok(throughputs)
    }

    /// How a batch of `tokens` rows would be split, layer by layer, under the current
    /// throughputs: counts of layers per split and the estimated seconds of all MoE layers'
    /// non-resident experts (`None` below the layerwise threshold or without it).
    pub fn layerwise_split_summary(&self, tokens: usize) -> Option<LayerwiseSummary> {
        let settings = self.layerwise_settings().ok()?;
        if tokens < settings.min_tokens {
            return None;
        }
        let throughputs = self.prefill_throughputs()?;
        let mut summary = LayerwiseSummary::default();
        for (_, moe) in self.indexed_moe_layers() {
            let batch = self.layer_batch(moe, tokens);
            let streamed = streamed_expert_count(&throughputs, &batch);
            summary.seconds += batch.estimated_seconds(&throughputs, streamed);
            summary.streamed_bytes += (streamed * batch.expert_bytes) as u64;
            match layer_split(streamed, batch.non_resident) {
                LayerSplit::Backend => summary.layerwise_gpu_layers += 1,
                LayerSplit::Mixed => summary.mixed_layers += 1,
                LayerSplit::Executor => summary.cpu_layers += 1,
            }
        }
        Some(summary)
    }

    /// The decoder layers' MoE layers with their layer index.
    fn indexed_moe_layers(&self) -> impl Iterator<Item = (usize, &MoeLayer<B>)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(index, layer)| match &layer.feed_forward {
                FeedForward::Moe(moe) => Some((index, moe)),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
            })
    }

    /// A batch of `tokens` rows through `moe`, as the streaming rule sees it.
    fn layer_batch(&self, moe: &MoeLayer<B>, tokens: usize) -> LayerBatch {
        let common = &self.spec.common;
        LayerBatch {
            tokens,
            experts_per_token: common.num_experts_per_tok,
            num_experts: common.num_experts,
            non_resident: common.num_experts - moe.resident_expert_count().min(common.num_experts),
            expert_bytes: usize::try_from(moe.bank.expert_stride).unwrap_or(usize::MAX),
            hidden_size: common.hidden_size,
        }
    }

    /// The layerwise stream of a forward of `rows` rows, when layerwise prefill is on and the
    /// batch is big enough: the split of each decoder MoE layer with experts outside its
    /// resident slots, then the first copies started.
    fn layerwise_stream(&self, rows: usize) -> Result<Option<LayerwiseStream<'_, B>>, EngineError> {
        let Some(staging) = self.prefill_staging.as_ref() else {
            return Ok(None);
        };
        if staging
            .layerwise
            .as_ref()
            .is_none_or(|settings| rows < settings.min_tokens)
        {
            return Ok(None);
        }
        let throughputs = self
            .prefill_throughputs()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "the prefill throughputs' lock is poisoned".into(),
            })?;
        let mut plans = Vec::new();
        for (layer, moe) in self.indexed_moe_layers() {
            let batch = self.layer_batch(moe, rows);
            if batch.non_resident == 0 {
                // All resident: the resident route, which does not wait for the routing.
                continue;
            }
            let count = streamed_expert_count(&throughputs, &batch);
            let mut streamed = moe.non_resident_experts()?;
            streamed.truncate(count);
            plans.push(LayerPlan {
                layer,
                bank: &moe.bank,
                executor_experts: batch.non_resident - streamed.len().min(batch.non_resident),
                streamed,
            });
        }
        if plans.is_empty() {
            return Ok(None);
        }
        LayerwiseStream::start(
            &staging.slots,
            &self.artifact,
            plans,
            self.spec.common.num_experts,
        )
        .map(Some)
    }

    /// Turns on the dynamic expert cache over the experts placed by
    /// [`Model::place_resident_experts`] (call it after): from the next forward on, the slots
    /// follow the routing (`options.fills_per_layer` 0: they keep the placement, only the
    /// counters count). Scores start from `statistics`. Returns the counters.
    pub fn enable_expert_cache(
        &mut self,
        options: ExpertCacheOptions,
        statistics: Option<&ExpertStatistics>,
    ) -> Result<Arc<ExpertCacheCounters>, EngineError> {
        let mut slot_layers = Vec::with_capacity(self.layers.len() + 1);
        let mut slots_per_layer = 0;
        // The MTP layer, after the decoder layers, is one more cached layer.
        for feed_forward in self.feed_forwards() {
            let slots = match feed_forward {
                FeedForward::Moe(moe) => moe
                    .resident_slots_mut()?
                    .as_ref()
                    .map(|slots| slots.slot_table().slot_count()),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
            };
            slots_per_layer = slots_per_layer.max(slots.unwrap_or(0));
            slot_layers.push(slots.is_some());
        }
        let common = &self.spec.common;
        let cache = ExpertCache::new(
            options,
            &slot_layers,
            slots_per_layer,
            common.num_experts,
            common.num_experts_per_tok,
            statistics,
        );
        let counters = Arc::clone(cache.counters());
        self.expert_cache = Some(cache);
        Ok(counters)
    }

    /// Bytes one expert of this model takes in a slot (its bank stride), or `None` for a model
    /// without routed experts.
    pub fn expert_slot_bytes(&self) -> Option<u64> {
        self.moe_layers().next().map(|moe| moe.bank.expert_stride)
    }

    /// The MoE layers that placement covers: the decoder layers', then the MTP layer's.
    fn placed_moe_layers(&self) -> impl Iterator<Item = &MoeLayer<B>> {
        self.feed_forwards()
            .filter_map(|feed_forward| match feed_forward {
                FeedForward::Moe(moe) => Some(moe),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
            })
    }

    /// The decoder layers' MoE layers, in order (the step graphs cover these only).
    fn moe_layers(&self) -> impl Iterator<Item = &MoeLayer<B>> {
        self.layers
            .iter()
            .filter_map(|layer| match &layer.feed_forward {
                FeedForward::Moe(moe) => Some(moe),
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => None,
            })
    }

    /// What the MoE layers use during a forward that hands layers off through the host.
    fn moe_context(&self) -> MoeContext<'_, B> {
        self.moe_context_with(None, None)
    }

    /// What the MoE layers use during a forward, with the backend's own hand-off if given.
    fn moe_context_with<'a>(
        &'a self,
        worker_handoff: Option<&'a B::WorkerHandoff>,
        layerwise: Option<&'a LayerwiseStream<'a, B>>,
    ) -> MoeContext<'a, B> {
        MoeContext {
            backend: &self.backend,
            artifact: &self.artifact,
            executor: &*self.experts,
            profile: &self.profile,
            common: &self.spec.common,
            normalize_routing: self.spec.normalize_routing,
            staging: self.prefill_staging.as_ref(),
            expert_cache: self.expert_cache.as_ref(),
            worker_handoff,
            layerwise,
        }
    }

    /// Forces one form of the gated delta rule (tests compare the two).
    pub fn set_delta_rule_form(&mut self, form: DeltaRuleForm) {
        self.delta_rule_form = form;
    }

    /// Empty state for a sequence of at most `max_context` tokens.
    pub fn new_sequence(&self, max_context: usize) -> Result<SequenceState<B>, EngineError> {
        let kv_width = self.spec.attention.kv_heads * self.spec.attention.head_dim;
        let layers = self
            .spec
            .mixers
            .iter()
            .map(|mixer| {
                Ok(match (mixer, &self.spec.delta_rule) {
                    (MixerKind::GatedDeltaNet, Some(delta)) => {
                        let channels = 2 * delta.key_heads * delta.key_head_dim
                            + delta.value_heads * delta.value_head_dim;
                        LayerState::GatedDeltaNet {
                            conv: self
                                .backend
                                .new_conv_state(channels, self.spec.conv_kernel)?,
                            recurrent: self.backend.new_recurrent_state(delta)?,
                        }
                    }
                    _ => match &self.qwen4_exp {
                        Some(graph) => LayerState::SparseAttention(self.backend.new_qsa_cache(
                            max_context,
                            kv_width,
                            graph.qsa_settings(),
                        )?),
                        None => {
                            LayerState::Attention(self.backend.new_kv_cache(max_context, kv_width)?)
                        }
                    },
                })
            })
            .collect::<Result<_, EngineError>>()?;
        let ple = match &self.qwen4_exp {
            Some(graph) => graph.new_ple_states(&self.backend)?,
            None => Vec::new(),
        };
        Ok(SequenceState {
            max_context,
            position: 0,
            layers,
            ple,
            graph_key: step_graphs::new_graph_key(),
        })
    }

    /// Prefill (or continue) one sequence; returns the logits of its last token.
    pub fn prefill(
        &self,
        state: &mut SequenceState<B>,
        tokens: &[u32],
    ) -> Result<Vec<f32>, EngineError> {
        let mut batch = [SequenceInput { state, tokens }];
        let mut logits = self.forward(&mut batch, LogitsSelection::Last)?;
        Ok(logits.pop().unwrap_or_default())
    }

    /// One forward over several sequences at once. Returns, per sequence, its logits
    /// (`[vocab]` for `Last`, `[new tokens · vocab]` for `All`).
    ///
    /// Input errors (too long, empty, unknown token) are found before any state changes, so the
    /// sequences stay usable. An error from the expert executor mid-forward leaves the states of
    /// this batch half-updated: their owners must drop them.
    pub fn forward(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        selection: LogitsSelection,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let vocab = self.vocab_size();
        let rows: Vec<usize> = batch
            .iter()
            .map(|item| match selection {
                LogitsSelection::Last => 1,
                LogitsSelection::All => item.tokens.len(),
            })
            .collect();
        let logits =
            self.forward_then(batch, selection, self.delta_rule_form, |backend, normed| {
                backend.download(&backend.matmul(&normed, self.head())?)
            })?;
        let mut out = Vec::with_capacity(rows.len());
        let mut row = 0;
        for rows in rows {
            let part = logits.get(row * vocab..(row + rows) * vocab);
            out.push(part.map(<[f32]>::to_vec).unwrap_or_default());
            row += rows;
        }
        Ok(out)
    }

    /// [`Model::forward`] with `LogitsSelection::Last`, the logits left on the backend
    /// (`[sequences, vocab]`): sampling reads back only what it needs
    /// ([`Backend::logit_candidates`]).
    pub fn forward_logits_on_backend(
        &self,
        batch: &mut [SequenceInput<'_, B>],
    ) -> Result<B::Tensor, EngineError> {
        if let Some(logits) = self.decode_through_step_graph(batch)? {
            return Ok(logits);
        }
        self.forward_then(
            batch,
            LogitsSelection::Last,
            self.delta_rule_form,
            |backend, normed| backend.matmul(&normed, self.head()),
        )
    }

    /// [`Model::forward`] with `LogitsSelection::All`, stopping before the head: every new
    /// row's last hidden state after the final norm (`[new tokens, hidden]`, sequences in batch
    /// order), what the head and the MTP head read. `delta_rule_form` overrides the model's
    /// (`Recurrent`: every row gets the bits a one-token forward gives it, as speculative
    /// verification needs).
    pub fn forward_hidden(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        delta_rule_form: Option<DeltaRuleForm>,
    ) -> Result<B::Tensor, EngineError> {
        let form = delta_rule_form.unwrap_or(self.delta_rule_form);
        self.forward_then(batch, LogitsSelection::All, form, |_, normed| Ok(normed))
    }

    /// What [`Model::restore`] needs to put `state` back where it is now: its position, and a
    /// copy of every Gated DeltaNet state (attention caches are cut back by position alone).
    pub fn checkpoint(
        &self,
        state: &SequenceState<B>,
    ) -> Result<SequenceCheckpoint<B>, EngineError> {
        let backend = &*self.backend;
        let layers = state
            .layers
            .iter()
            .map(|layer| match layer {
                // Caches are cut back by position alone.
                LayerState::Attention(_) | LayerState::SparseAttention(_) => Ok(None),
                LayerState::GatedDeltaNet { conv, recurrent } => Ok(Some((
                    backend.copy_conv_state(conv)?,
                    backend.copy_recurrent_state(recurrent)?,
                ))),
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(SequenceCheckpoint {
            position: state.position,
            layers,
            ple: state
                .ple
                .iter()
                .map(|ple| ple.as_ref().map(|ple| ple.copy(backend)).transpose())
                .collect::<Result<_, EngineError>>()?,
        })
    }

    /// Puts `state` back to `checkpoint` (taken from it by [`Model::checkpoint`]): what it
    /// processed after that is forgotten.
    pub fn restore(
        &self,
        state: &mut SequenceState<B>,
        checkpoint: SequenceCheckpoint<B>,
    ) -> Result<(), EngineError> {
        if checkpoint.layers.len() != state.layers.len() || checkpoint.position > state.position {
            return Err(EngineError::InvalidConfig {
                problem: "a checkpoint restored into a sequence it was not taken from".into(),
            });
        }
        let mut replaced_buffers = false;
        for layer in state.layers.iter_mut() {
            if let LayerState::SparseAttention(cache) = layer {
                self.backend.truncate_qsa_cache(cache, checkpoint.position);
            }
        }
        state.ple = checkpoint.ple;
        for (layer, saved) in state.layers.iter_mut().zip(checkpoint.layers) {
            if let (LayerState::GatedDeltaNet { conv, recurrent }, Some((saved_conv, saved))) =
                (layer, saved)
            {
                *conv = saved_conv;
                *recurrent = saved;
                replaced_buffers = true;
            }
        }
        state.position = checkpoint.position;
        if replaced_buffers {
            // New Gated DeltaNet buffers: no recorded step may write the old ones. (Attention
            // caches are cut back by position alone and keep their buffers.)
            state.graph_key = step_graphs::new_graph_key();
        }
        Ok(())
    }

    /// The output projection (`lm_head`, or the embedding when they are tied).
    fn head(&self) -> &B::Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// The logits of final-normed hidden rows (`[rows · vocab]`).
    pub fn head_logits(&self, normed: &B::Tensor) -> Result<Vec<f32>, EngineError> {
        let backend = &*self.backend;
        backend.download(&backend.matmul(normed, self.head())?)
    }

    /// [`Model::head_logits`] left on the backend (`[rows, vocab]`).
    pub fn head_logits_on_backend(&self, normed: &B::Tensor) -> Result<B::Tensor, EngineError> {
        self.backend.matmul(normed, self.head())
    }

    /// Finishes the routings left on the backend during a forward and counts them.
    fn finish_deferred_routing(
        &self,
        scratch: &mut LayerScratch<'_, B>,
    ) -> Result<(), EngineError> {
        for DeferredRouting { layer, pending } in scratch.deferred.drain(..) {
            let (routing, _) = self.backend.finish_routing(pending)?;
            if let Some(FeedForward::Moe(moe)) = self.moe_layer_at(layer) {
                moe.account_deferred_routing(
                    &scratch.moe_context,
                    layer,
                    &routing,
                    &mut scratch.tally,
                )?;
            }
        }
        Ok(())
    }

    /// The feed-forward of layer `index`: the decoder layers, then the MTP layer after them.
    fn moe_layer_at(&self, index: usize) -> Option<&FeedForward<B>> {
        match self.layers.get(index) {
            Some(layer) => Some(&layer.feed_forward),
            None if index == self.layers.len() => {
                self.mtp.as_ref().map(|head| &head.layer.feed_forward)
            }
            None => None,
        }
    }

    /// A layer's feed-forward of its post-attention-normed input `x`.
    fn feed_forward(
        &self,
        scratch: &mut LayerScratch<'_, B>,
        index: usize,
        feed_forward: &FeedForward<B>,
        x: &B::Tensor,
    ) -> Result<B::Tensor, EngineError> {
        let backend = &*self.backend;
        match feed_forward {
            FeedForward::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } => {
                let activated = backend
                    .silu_mul(&backend.matmul(x, gate_proj)?, &backend.matmul(x, up_proj)?)?;
                backend.matmul(&activated, down_proj)
            }
            FeedForward::OffloadedDense { bank } => {
                self.offloaded_dense_mlp(scratch, index, bank, x)
            }
            FeedForward::Moe(moe) => moe.forward(
                &scratch.moe_context,
                index,
                x,
                &mut scratch.tally,
                &mut scratch.deferred,
            ),
        }
    }

    /// An offloaded dense MLP: every token to the expert executor as expert 0 of the layer's
    /// one-expert bank with routing weight 1, which is the SwiGLU of the layer's MLP.
    fn offloaded_dense_mlp(
        &self,
        scratch: &mut LayerScratch<'_, B>,
        index: usize,
        bank: &ExpertBank,
        x: &B::Tensor,
    ) -> Result<B::Tensor, EngineError> {
        let backend = &*self.backend;
        let (rows, cols) = backend.shape(x);
        let copying = Instant::now();
        let hidden = backend.download(x)?;
        scratch.tally.transfer_nanos += nanos(copying.elapsed());
        let mut out = vec![0.0f32; hidden.len()];
        let waiting = Instant::now();
        self.experts.compute(
            &ExpertBatch {
                layer: index,
                bank,
                hidden_size: cols,
                intermediate_size: self.spec.common.intermediate_size,
                hidden: &hidden,
                experts_per_token: 1,
                expert_ids: &vec![0; rows],
                weights: &vec![1.0; rows],
            },
            &mut out,
        )?;
        scratch.tally.expert_wait_nanos += nanos(waiting.elapsed());
        let copying = Instant::now();
        let output = backend.upload(&out, rows, cols)?;
        scratch.tally.transfer_nanos += nanos(copying.elapsed());
        Ok(output)
    }

    /// Dense-MLP layers whose MLP the expert executor computes.
    pub fn offloaded_dense_mlp_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|layer| matches!(layer.feed_forward, FeedForward::OffloadedDense { .. }))
            .count()
    }

    /// The forward pass; `finish` takes the logits where [`Model::forward`] reads them back.
    fn forward_then<T>(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        selection: LogitsSelection,
        delta_rule_form: DeltaRuleForm,
        finish: impl FnOnce(&B, B::Tensor) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let plan = self.batch_plan(batch)?;
        let started = Instant::now();
        self.expert_cache_between_steps()?;
        let handoff = self.ready_worker_handoff(plan.ids.len())?;
        let layerwise = self.layerwise_stream(plan.ids.len())?;
        let mut scratch = LayerScratch::new(
            self.moe_context_with(handoff.map(|h| h.handoff), layerwise.as_ref()),
        );
        let out = self.run_layers(
            batch,
            &plan,
            selection,
            delta_rule_form,
            &mut scratch,
            finish,
        )?;
        if let Some(handoff) = handoff {
            self.finish_worker_handoff(handoff, &mut scratch.tally)?;
        }
        self.finish_deferred_routing(&mut scratch)?;
        self.account_forward(batch, &plan, scratch.tally, started);
        Ok(out)
    }

    /// The expert cache's work between two steps (fills decided, finished fills put in the
    /// slot tables): before any op of the next step, outside any step graph.
    fn expert_cache_between_steps(&self) -> Result<(), EngineError> {
        if let Some(cache) = &self.expert_cache {
            for (index, feed_forward) in self.feed_forwards().enumerate() {
                if let FeedForward::Moe(moe) = feed_forward {
                    cache.between_steps(index, moe, &self.artifact)?;
                }
            }
        }
        Ok(())
    }

    /// The token ids, row ranges and positions of a batch, once every input was checked: a
    /// batch that fails here leaves every sequence as it was.
    fn batch_plan(&self, batch: &[SequenceInput<'_, B>]) -> Result<BatchPlan, EngineError> {
        let vocab = self.vocab_size();
        let mut plan = BatchPlan::default();
        for item in batch.iter() {
            let state = &*item.state;
            if item.tokens.is_empty() {
                return Err(EngineError::EmptyInput {
                    what: "a sequence in the batch has no new tokens".into(),
                });
            }
            if state.layers.len() != self.layers.len() {
                return Err(EngineError::InvalidConfig {
                    problem: format!(
                        "sequence state has {} layers, the model {}",
                        state.layers.len(),
                        self.layers.len()
                    ),
                });
            }
            let end = state.position + item.tokens.len();
            if end > state.max_context {
                return Err(if state.position == 0 {
                    EngineError::PromptTooLong {
                        tokens: item.tokens.len(),
                        max_context: state.max_context,
                    }
                } else {
                    EngineError::ContextFull {
                        held: state.position,
                        added: item.tokens.len(),
                        max_context: state.max_context,
                    }
                });
            }
            if let Some(&token) = item.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::TokenOutOfVocabulary {
                    token,
                    vocab_size: vocab,
                });
            }
            let first = plan.ids.len();
            plan.ids.extend_from_slice(item.tokens);
            plan.ranges.push(first..plan.ids.len());
            plan.positions.extend(state.position..end);
        }
        if plan.ids.is_empty() {
            return Err(EngineError::EmptyInput {
                what: "the batch has no sequences".into(),
            });
        }
        Ok(plan)
    }

    /// Every layer's ops and the final norm, then `finish`; the routings of all-resident MoE
    /// layers are left in `scratch.deferred`, and no sequence's position moves.
    fn run_layers<T>(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        plan: &BatchPlan,
        selection: LogitsSelection,
        delta_rule_form: DeltaRuleForm,
        scratch: &mut LayerScratch<'_, B>,
        finish: impl FnOnce(&B, B::Tensor) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        if let Some(graph) = &self.qwen4_exp {
            return self.run_qwen4_exp_layers(
                graph,
                batch,
                plan,
                selection,
                delta_rule_form,
                scratch,
                finish,
            );
        }
        let BatchPlan {
            ids,
            ranges,
            positions,
        } = plan;
        let backend = &*self.backend;
        let eps = self.spec.eps();
        let style = self.spec.norm_style;
        let final_norm = self
            .final_norm
            .as_ref()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "the model has no final norm".into(),
            })?;
        let mut hidden = backend.embed(&self.embed_tokens, ids)?;
        // Each residual add is fused with the norm after it (Backend::add_rms_norm): `next`
        // holds the next layer's normed input.
        let mut next = self
            .layers
            .first()
            .map(|layer| backend.rms_norm(&hidden, layer.input_norm()?, eps, style))
            .transpose()?;
        for (index, layer) in self.layers.iter().enumerate() {
            let x = next.take().ok_or_else(|| EngineError::InvalidConfig {
                problem: format!("layer {index} has no normed input"),
            })?;
            let mixed = match &layer.mixer {
                Mixer::Attention { .. } => {
                    self.attention(index, &layer.mixer, &x, positions, batch, ranges)?
                }
                Mixer::GatedDeltaNet { .. } => {
                    self.gated_delta_net(index, &layer.mixer, &x, batch, ranges, delta_rule_form)?
                }
            };
            let x = backend.add_rms_norm(
                &mut hidden,
                &mixed,
                layer.post_attention_norm()?,
                eps,
                style,
            )?;
            let fed = self.feed_forward(scratch, index, &layer.feed_forward, &x)?;
            match self.layers.get(index + 1) {
                Some(following) => {
                    next = Some(backend.add_rms_norm(
                        &mut hidden,
                        &fed,
                        following.input_norm()?,
                        eps,
                        style,
                    )?);
                }
                None => backend.add_assign(&mut hidden, &fed)?,
            }
        }

        let selected_rows: Vec<usize> = match selection {
            LogitsSelection::Last => ranges.iter().map(|r| r.end - 1).collect(),
            LogitsSelection::All => (0..ids.len()).collect(),
        };
        // Every row, in order (decode): no gather.
        let every_row = selected_rows.iter().copied().eq(0..ids.len());
        let normed = if every_row {
            backend.rms_norm(&hidden, final_norm, eps, style)?
        } else {
            let selected = backend.gather_rows(&hidden, &selected_rows)?;
            backend.rms_norm(&selected, final_norm, eps, style)?
        };
        finish(backend, normed)
    }

    /// After a forward's ops: every sequence moves past its new tokens, and the forward is
    /// counted in the profile.
    fn account_forward(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        plan: &BatchPlan,
        mut tally: PhaseTotals,
        started: Instant,
    ) {
        for (item, range) in batch.iter_mut().zip(&plan.ranges) {
            item.state.position += range.len();
        }
        tally.forwards = 1;
        tally.tokens = plan.ids.len() as u64;
        tally.forward_nanos = nanos(started.elapsed());
        let phase = if plan.ids.len() == batch.len() {
            Phase::Decode
        } else {
            Phase::Prefill
        };
        self.profile.record(phase, &tally);
    }

    fn attention(
        &self,
        index: usize,
        mixer: &Mixer<B>,
        x: &B::Tensor,
        positions: &[usize],
        batch: &mut [SequenceInput<'_, B>],
        ranges: &[std::ops::Range<usize>],
    ) -> Result<B::Tensor, EngineError> {
        let mut segments = layer_segments(batch, ranges, index, |layer| match layer {
            LayerState::Attention(cache) => Some(cache),
            _ => None,
        })?;
        self.attention_over(index, mixer, x, positions, &mut segments)
    }

    /// An attention mixer over rows whose caches the caller hands in (`positions` per row).
    fn attention_over(
        &self,
        index: usize,
        mixer: &Mixer<B>,
        x: &B::Tensor,
        positions: &[usize],
        segments: &mut [Segment<'_, B::KvCache>],
    ) -> Result<B::Tensor, EngineError> {
        let Mixer::Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
        } = mixer
        else {
            return Err(state_mismatch(index));
        };
        let backend = &*self.backend;
        let spec = &self.spec.attention;
        let (eps, style) = (self.spec.eps(), self.spec.norm_style);
        let [projected, k, v] = backend.matmul3(x, [q_proj, k_proj, v_proj])?;
        let (q, gate) = if self.spec.gated_attention {
            let (q, gate) =
                backend.split_interleaved(&projected, spec.heads, spec.head_dim, spec.head_dim)?;
            (q, Some(gate))
        } else {
            (projected, None)
        };
        let rotation = Rotation {
            positions,
            head_dim: spec.head_dim,
            rotary_dim: self.spec.common.rotary_dim,
            theta: self.spec.common.rope_theta,
        };
        let (q, k) = backend.rms_norm_rope_pair(&q, q_norm, &k, k_norm, eps, style, &rotation)?;
        let mut output = backend.attention(&q, &k, &v, spec, segments)?;
        if let Some(gate) = gate {
            output = backend.mul_sigmoid(&output, &gate)?;
        }
        backend.matmul(&output, o_proj)
    }

    fn gated_delta_net(
        &self,
        index: usize,
        mixer: &Mixer<B>,
        x: &B::Tensor,
        batch: &mut [SequenceInput<'_, B>],
        ranges: &[std::ops::Range<usize>],
        delta_rule_form: DeltaRuleForm,
    ) -> Result<B::Tensor, EngineError> {
        let (
            Mixer::GatedDeltaNet {
                in_proj_qkv,
                in_proj_z,
                in_proj_b,
                in_proj_a,
                conv1d,
                dt_bias,
                a_log,
                norm,
                out_proj,
            },
            Some(delta),
        ) = (mixer, &self.spec.delta_rule)
        else {
            return Err(state_mismatch(index));
        };
        let backend = &*self.backend;
        let qkv = backend.matmul(x, in_proj_qkv)?;
        let z = backend.matmul(x, in_proj_z)?;
        let b = backend.matmul(x, in_proj_b)?;
        let a = backend.matmul(x, in_proj_a)?;

        let mut conv_segments = layer_segments(batch, ranges, index, |layer| match layer {
            LayerState::GatedDeltaNet { conv, .. } => Some(conv),
            _ => None,
        })?;
        let convolved = backend.causal_conv1d_silu(&qkv, conv1d, &mut conv_segments)?;
        drop(conv_segments);

        let key_width = delta.key_heads * delta.key_head_dim;
        let value_width = delta.value_heads * delta.value_head_dim;
        let q = backend.columns(&convolved, 0..key_width)?;
        let k = backend.columns(&convolved, key_width..2 * key_width)?;
        let v = backend.columns(&convolved, 2 * key_width..2 * key_width + value_width)?;
        let (g, beta) = backend.delta_rule_gates(&a, &b, a_log, dt_bias)?;

        let mut recurrent_segments = layer_segments(batch, ranges, index, |layer| match layer {
            LayerState::GatedDeltaNet { recurrent, .. } => Some(recurrent),
            _ => None,
        })?;
        let output = backend.gated_delta_rule(
            &q,
            &k,
            &v,
            &g,
            &beta,
            delta,
            delta_rule_form,
            &mut recurrent_segments,
        )?;
        // qwen4_exp may gate with a sigmoid, which the backend's gated norm does not: on the
        // CPU backend the host function (bit for bit what it always computed), elsewhere a
        // norm and a sigmoid gate as two ops.
        let sigmoid_norm = self
            .qwen4_exp
            .as_ref()
            .and_then(|graph| graph.sigmoid_gated_norm(index));
        let normed = match sigmoid_norm {
            Some(_) if !backend.computes_on_host() => {
                qwen4_exp::graph::sigmoid_gated_rms_norm_by_ops(
                    backend,
                    &output,
                    &z,
                    norm,
                    self.spec.eps(),
                )?
            }
            Some(weight) => {
                let (rows, cols) = backend.shape(&output);
                let normed = qwen4_exp::graph::sigmoid_gated_rms_norm(
                    &backend.download(&output)?,
                    &backend.download(&z)?,
                    weight,
                    self.spec.eps(),
                );
                backend.upload(&normed, rows, cols)?
            }
            None => backend.gated_rms_norm(&output, &z, norm, self.spec.eps())?,
        };
        backend.matmul(&normed, out_proj)
    }
}

/// Per decoder layer, whether its dense MLP is offloaded: the last `offloaded_layers` dense-MLP
/// layers (which ones does not change the math; the last ones, so a growing count moves layers
/// one end first).
fn dense_mlp_offload_plan(
    spec: &ModelSpec,
    offloaded_layers: usize,
) -> Result<Vec<bool>, EngineError> {
    let dense: Vec<usize> = (0..spec.layers())
        .filter(|&layer| spec.feed_forwards[layer] == FeedForwardKind::Dense)
        .collect();
    if offloaded_layers > dense.len() {
        return Err(EngineError::InvalidConfig {
            problem: format!(
                "{offloaded_layers} dense MLPs to offload, the model has {} dense-MLP layers",
                dense.len()
            ),
        });
    }
    let mut offloaded = vec![false; spec.layers()];
    for &layer in &dense[dense.len() - offloaded_layers..] {
        offloaded[layer] = true;
    }
    Ok(offloaded)
}

/// Bytes of the non-expert weights a forward reads, as the artifact stores them (see
/// [`crate::profile::ProfileSnapshot::dense_weight_bytes_per_forward`]).
fn dense_weight_bytes(artifact: &Artifact, tied_embeddings: bool) -> u64 {
    artifact
        .header()
        .tensors
        .iter()
        .filter(|tensor| match tensor.class {
            TensorClass::Dense | TensorClass::DenseMlp => true,
            // Looking up embeddings reads a few rows; the table is read whole only as the head.
            TensorClass::Embedding => tied_embeddings || tensor.name != "embed_tokens",
            // The n-gram tables stay in host RAM; a step reads a few rows per token.
            // A dense MLP's bank is a second copy, read by the workers for offloaded layers.
            TensorClass::RoutedExpert
            | TensorClass::DenseMlpExpert
            | TensorClass::Mtp
            | TensorClass::Vision
            | TensorClass::NgramEmbedding => false,
        })
        .map(|tensor| tensor.length)
        .sum()
}

/// Layer `index`'s state of every sequence in `batch`, as the segments of a batched op (`pick`
/// returns `None` for a state of the wrong kind).
pub(crate) fn layer_segments<'s, B: Backend, S>(
    batch: &'s mut [SequenceInput<'_, B>],
    ranges: &[std::ops::Range<usize>],
    index: usize,
    pick: impl Fn(&mut LayerState<B>) -> Option<&mut S>,
) -> Result<Vec<Segment<'s, S>>, EngineError> {
    let mut segments = Vec::with_capacity(batch.len());
    for (item, range) in batch.iter_mut().zip(ranges) {
        let start_position = item.state.position;
        let state = pick(&mut item.state.layers[index]).ok_or_else(|| state_mismatch(index))?;
        segments.push(Segment {
            rows: range.clone(),
            start_position,
            state,
        });
    }
    Ok(segments)
}

pub(crate) fn state_mismatch(layer: usize) -> EngineError {
    EngineError::InvalidConfig {
        problem: format!("layer {layer}: the sequence state does not match the model's layer type"),
    }
}

/// Loads weights by internal name and checks their shapes.
struct Loader<'a, B: Backend> {
    backend: &'a B,
    artifact: &'a Arc<Artifact>,
}

impl<B: Backend> Loader<'_, B> {
    fn check(
        &self,
        name: &str,
        weight: &B::Weight,
        expected: (usize, usize),
    ) -> Result<(), EngineError> {
        let found = self.backend.weight_shape(weight);
        if found != expected {
            return Err(EngineError::InvalidWeight {
                name: name.to_string(),
                problem: format!(
                    "shape {}×{} where the config implies {}×{}",
                    found.0, found.1, expected.0, expected.1
                ),
            });
        }
        Ok(())
    }

    fn matrix(&self, name: &str, shape: (usize, usize)) -> Result<B::Weight, EngineError> {
        let weight = self.backend.load_matrix(self.artifact, name)?;
        self.check(name, &weight, shape)?;
        Ok(weight)
    }

    /// `shape` counts a 1-D `[n]` tensor as `(1, n)`.
    fn parameter(&self, name: &str, shape: (usize, usize)) -> Result<B::Weight, EngineError> {
        let weight = self.backend.load_parameter(self.artifact, name)?;
        self.check(name, &weight, shape)?;
        Ok(weight)
    }

    /// Decoder layer `layer`; `offload_mlp`: its dense MLP stays with the expert executor.
    fn layer(
        &self,
        spec: &ModelSpec,
        layer: usize,
        offload_mlp: bool,
    ) -> Result<Layer<B>, EngineError> {
        let prefix = format!("layers.{layer}");
        let kind = spec.feed_forwards[layer];
        if !offload_mlp {
            return self.decoder_layer(spec, &prefix, spec.mixers[layer], kind, None);
        }
        let bank_prefix = format!("{prefix}.mlp.experts");
        let bank = self
            .artifact
            .expert_bank(&bank_prefix)
            .cloned()
            .ok_or_else(|| EngineError::InvalidWeight {
                name: bank_prefix.clone(),
                problem: "a dense MLP to offload needs its one-expert bank; convert the model again with this version".into(),
            })?;
        if bank.num_experts != 1 {
            return Err(EngineError::InvalidWeight {
                name: bank_prefix,
                problem: format!(
                    "a dense MLP's bank holds 1 expert, this one {}",
                    bank.num_experts
                ),
            });
        }
        self.decoder_layer(spec, &prefix, spec.mixers[layer], kind, Some(bank))
    }

    /// A decoder layer whose tensors are named `{prefix}.…` (a main layer, or the MTP block's).
    fn decoder_layer(
        &self,
        spec: &ModelSpec,
        prefix: &str,
        mixer_kind: MixerKind,
        feed_forward_kind: FeedForwardKind,
        offloaded_dense_bank: Option<ExpertBank>,
    ) -> Result<Layer<B>, EngineError> {
        let common = &spec.common;
        let hidden = common.hidden_size;
        let name = |suffix: &str| format!("{prefix}.{suffix}");
        let mixer = match mixer_kind {
            MixerKind::Attention => {
                let attention = &spec.attention;
                let (hd, heads, kv) = (attention.head_dim, attention.heads, attention.kv_heads);
                let q_rows = if spec.gated_attention {
                    2 * heads * hd
                } else {
                    heads * hd
                };
                Mixer::Attention {
                    q_proj: self.matrix(&name("attn.q_proj"), (q_rows, hidden))?,
                    k_proj: self.matrix(&name("attn.k_proj"), (kv * hd, hidden))?,
                    v_proj: self.matrix(&name("attn.v_proj"), (kv * hd, hidden))?,
                    o_proj: self.matrix(&name("attn.o_proj"), (hidden, heads * hd))?,
                    q_norm: self.parameter(&name("attn.q_norm"), (1, hd))?,
                    k_norm: self.parameter(&name("attn.k_norm"), (1, hd))?,
                }
            }
            MixerKind::GatedDeltaNet => {
                let Some(delta) = &spec.delta_rule else {
                    return Err(EngineError::InvalidConfig {
                        problem: format!("{prefix} is linear attention in a model without linear-attention dimensions"),
                    });
                };
                let key_width = delta.key_heads * delta.key_head_dim;
                let value_width = delta.value_heads * delta.value_head_dim;
                let conv_dim = 2 * key_width + value_width;
                let nv = delta.value_heads;
                Mixer::GatedDeltaNet {
                    in_proj_qkv: self.matrix(&name("gdn.in_proj_qkv"), (conv_dim, hidden))?,
                    in_proj_z: self.matrix(&name("gdn.in_proj_z"), (value_width, hidden))?,
                    in_proj_b: self.matrix(&name("gdn.in_proj_b"), (nv, hidden))?,
                    in_proj_a: self.matrix(&name("gdn.in_proj_a"), (nv, hidden))?,
                    conv1d: self.parameter(&name("gdn.conv1d"), (conv_dim, spec.conv_kernel))?,
                    dt_bias: self.parameter(&name("gdn.dt_bias"), (1, nv))?,
                    a_log: self.parameter(&name("gdn.A_log"), (1, nv))?,
                    norm: self.parameter(&name("gdn.norm"), (1, delta.value_head_dim))?,
                    out_proj: self.matrix(&name("gdn.out_proj"), (hidden, value_width))?,
                }
            }
        };
        let feed_forward = match (feed_forward_kind, offloaded_dense_bank) {
            (FeedForwardKind::Dense, Some(bank)) => FeedForward::OffloadedDense { bank },
            (FeedForwardKind::Moe, Some(_)) => {
                return Err(EngineError::InvalidConfig {
                    problem: format!("{prefix} is a MoE layer, not a dense MLP to offload"),
                })
            }
            (FeedForwardKind::Dense, None) => {
                let intermediate = common.intermediate_size;
                FeedForward::Dense {
                    gate_proj: self.matrix(&name("mlp.gate_proj"), (intermediate, hidden))?,
                    up_proj: self.matrix(&name("mlp.up_proj"), (intermediate, hidden))?,
                    down_proj: self.matrix(&name("mlp.down_proj"), (hidden, intermediate))?,
                }
            }
            (FeedForwardKind::Moe, None) => {
                let bank_prefix = name("moe.experts");
                let bank = self
                    .artifact
                    .expert_bank(&bank_prefix)
                    .cloned()
                    .ok_or_else(|| EngineError::InvalidWeight {
                        name: bank_prefix.clone(),
                        problem: "MoE layer without an expert bank".into(),
                    })?;
                if bank.num_experts as usize != common.num_experts {
                    return Err(EngineError::InvalidWeight {
                        name: bank_prefix,
                        problem: format!(
                            "bank holds {} experts, the config says {}",
                            bank.num_experts, common.num_experts
                        ),
                    });
                }
                let shared = if spec.has_shared_expert() {
                    let size = spec.shared_expert_intermediate_size;
                    Some(SharedExpert {
                        gate_proj: self
                            .matrix(&name("moe.shared_expert.gate_proj"), (size, hidden))?,
                        up_proj: self.matrix(&name("moe.shared_expert.up_proj"), (size, hidden))?,
                        down_proj: self
                            .matrix(&name("moe.shared_expert.down_proj"), (hidden, size))?,
                        gate: self.matrix(&name("moe.shared_expert_gate"), (1, hidden))?,
                    })
                } else {
                    None
                };
                FeedForward::Moe(MoeLayer {
                    router: self.matrix(&name("moe.router"), (common.num_experts, hidden))?,
                    bank,
                    shared,
                    resident: Default::default(),
                })
            }
        };
        // qwen4_exp layers have no norms of their own (the hyper-connections normalise).
        let norm = |suffix: &str| -> Result<Option<B::Weight>, EngineError> {
            match spec.qwen4_exp {
                Some(_) => Ok(None),
                None => Ok(Some(self.parameter(&name(suffix), (1, hidden))?)),
            }
        };
        Ok(Layer {
            input_norm: norm("input_norm")?,
            post_attention_norm: norm("post_attention_norm")?,
            mixer,
            feed_forward,
        })
    }
}
