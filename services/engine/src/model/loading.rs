//! Loading a model: the artifact's architecture checked against the engine's, every layer's
//! weights by internal name with their shapes checked, dense MLPs offloaded to the expert
//! executor when asked.
//!
//! Owns: [`Model::open`], [`Model::load`], [`Model::load_pipeline`] and the loader's layer methods. Must not touch: expert
//! placement (`expert_placement.rs`), the forward.

use std::path::Path;
use std::sync::Arc;

use ninfer_artifact::{Artifact, ArtifactError, ExpertBank, TensorClass};

use crate::backend::{Backend, DeltaRuleForm};
use crate::error::EngineError;
use crate::model::layers::{FeedForward, Layer, Mixer};
use crate::model::loader::Loader;
use crate::model::pipeline::{stage_backend, PipelineStage, PipelineStages};
use crate::model::Model;
use crate::model::{qwen4_exp, worker_handoff};
use crate::moe::layer::{MoeLayer, SharedExpert};
use crate::moe::{ExpertExecutor, ReferenceExpertExecutor};
use crate::profile::ForwardProfile;
use crate::spec::{check_architecture_name, FeedForwardKind, MixerKind, ModelSpec};

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
pub(in crate::model) fn header_architecture(path: &Path) -> Option<String> {
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
        Self::load_stages(backend, None, artifact, experts, offloaded_layers)
    }

    /// [`Model::load_offloading_dense_mlps`] split over several backends, as a pipeline
    /// (`pipeline.rs`): `stages` cover the decoder layers once, in order. One stage is the
    /// unsplit model. A split model loads the MTP head (and a qwen4_exp model's final stream
    /// mixer) on the last stage.
    pub fn load_pipeline(
        stages: Vec<PipelineStage<B>>,
        artifact: Arc<Artifact>,
        experts: Arc<dyn ExpertExecutor>,
        offloaded_layers: usize,
    ) -> Result<Self, EngineError> {
        let layers = artifact.config().common().num_hidden_layers;
        let (backend, pipeline) = PipelineStages::new(stages, layers)?;
        Self::load_stages(backend, pipeline, artifact, experts, offloaded_layers)
    }

    fn load_stages(
        backend: Arc<B>,
        pipeline: Option<PipelineStages<B>>,
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
        // The head and final norm go to the last stage (the first and only one, unsplit).
        let head_loader = Loader {
            backend: pipeline.as_ref().map_or(&*backend, |stages| stages.last()),
            artifact: &artifact,
        };
        let embed_tokens = loader.matrix("embed_tokens", (vocab, hidden))?;
        let lm_head = match (common.tie_word_embeddings, &pipeline) {
            (true, None) => None,
            // Tied: the last stage needs the table as its head.
            (true, Some(_)) => Some(head_loader.matrix("embed_tokens", (vocab, hidden))?),
            (false, _) => Some(head_loader.matrix("lm_head", (vocab, hidden))?),
        };
        // Each layer's hyper-connections, indexer and PLE block on its stage; the final mixer
        // beside the head.
        let qwen4_exp = match artifact.config().qwen4_exp() {
            Some(config) => Some(qwen4_exp::graph::Qwen4ExpGraph::load(
                |layer| Loader {
                    backend: stage_backend(&backend, &pipeline, layer),
                    artifact: &artifact,
                },
                &head_loader,
                config,
                &spec.mixers,
            )?),
            None => None,
        };
        // qwen4_exp has no final norm (its final stream mixer takes that place).
        let final_norm = match qwen4_exp {
            Some(_) => None,
            None => Some(head_loader.parameter("final_norm", (1, hidden))?),
        };
        let layers = offloaded
            .iter()
            .enumerate()
            .map(|(layer, &offload)| {
                let loader = Loader {
                    backend: stage_backend(&backend, &pipeline, layer),
                    artifact: &artifact,
                };
                loader.layer(&spec, layer, offload)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The MTP head follows the last decoder layer: it goes to the last stage, beside the
        // head whose logits its rows draft from.
        let mtp = head_loader.mtp_head(&spec)?;
        let profile = Arc::new(ForwardProfile::new(dense_weight_bytes(
            &artifact,
            common.tie_word_embeddings,
        )));
        // Every stage of a split drives its own hand-off (the first one registers the
        // channels), or none does: the host then hands every layer off.
        let mut pipeline = pipeline;
        let mut worker_handoff = worker_handoff::BackendHandoff::open(&*backend, &experts, common);
        if let (Some(_), Some(stages)) = (&worker_handoff, pipeline.as_mut()) {
            if !stages.open_later_handoffs(&experts, common) {
                tracing::warn!("a later stage of the layer split cannot hand MoE layers to the workers itself; the host hands off every stage's layers");
                worker_handoff = None;
            }
        }
        Ok(Model {
            backend,
            pipeline,
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
}

/// Per decoder layer, whether its dense MLP is offloaded: the last `offloaded_layers` dense-MLP
/// layers (which ones does not change the math; the last ones, so a growing count moves layers
/// one end first).
pub(in crate::model) fn dense_mlp_offload_plan(
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
pub(in crate::model) fn dense_weight_bytes(artifact: &Artifact, tied_embeddings: bool) -> u64 {
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

impl<B: Backend> Loader<'_, B> {
    pub(in crate::model) fn check(
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

    pub(in crate::model) fn matrix(
        &self,
        name: &str,
        shape: (usize, usize),
    ) -> Result<B::Weight, EngineError> {
        let weight = self.backend.load_matrix(self.artifact, name)?;
        self.check(name, &weight, shape)?;
        Ok(weight)
    }

    /// `shape` counts a 1-D `[n]` tensor as `(1, n)`.
    pub(in crate::model) fn parameter(
        &self,
        name: &str,
        shape: (usize, usize),
    ) -> Result<B::Weight, EngineError> {
        let weight = self.backend.load_parameter(self.artifact, name)?;
        self.check(name, &weight, shape)?;
        Ok(weight)
    }

    /// Decoder layer `layer`; `offload_mlp`: its dense MLP stays with the expert executor.
    pub(in crate::model) fn layer(
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
    pub(in crate::model) fn decoder_layer(
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
