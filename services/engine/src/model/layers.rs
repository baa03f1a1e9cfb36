//! A model's layers and a sequence's state: a decoder layer's weights (mixer and feed-forward),
//! each layer's state of a sequence (KV cache, conv and recurrent states, QSA cache), the state
//! a sequence carries between forwards and its checkpoints, and a forward's batch and scratch.
//!
//! Owns: these types and the segments of a batched op over them. Must not touch: loading or the
//! forward itself.

use ninfer_artifact::ExpertBank;

use crate::backend::{Backend, DeltaRuleForm, DeltaRuleSpec, Segment};
use crate::error::EngineError;
use crate::model::pipeline::NextStage;
use crate::model::worker_handoff::BackendHandoff;
use crate::moe::layer::{DeferredRouting, MoeContext, MoeLayer};
use crate::moe::layerwise::LayerwiseStream;
use crate::profile::PhaseTotals;

/// Which positions' logits a forward returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsSelection {
    /// Only each sequence's last new token (prefill and decode).
    Last,
    /// Every new token (perplexity).
    All,
}

pub(in crate::model) enum Mixer<B: Backend> {
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

pub(in crate::model) enum FeedForward<B: Backend> {
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

pub(in crate::model) struct Layer<B: Backend> {
    /// Absent in qwen4_exp, whose hyper-connection norms take the layer norms' place.
    pub(in crate::model) input_norm: Option<B::Weight>,
    pub(in crate::model) post_attention_norm: Option<B::Weight>,
    pub(in crate::model) mixer: Mixer<B>,
    pub(in crate::model) feed_forward: FeedForward<B>,
}

impl<B: Backend> Layer<B> {
    pub(in crate::model) fn input_norm(&self) -> Result<&B::Weight, EngineError> {
        self.input_norm
            .as_ref()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "a decoder layer without an input norm".into(),
            })
    }

    pub(in crate::model) fn post_attention_norm(&self) -> Result<&B::Weight, EngineError> {
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
    pub(in crate::model) max_context: usize,
    pub(in crate::model) position: usize,
    pub(in crate::model) layers: Vec<LayerState<B>>,
    /// Per layer, a qwen4_exp PLE block's state (empty for other architectures).
    pub(in crate::model) ple: Vec<Option<crate::model::qwen4_exp::ple_state::PleState<B>>>,
    /// Names these states' buffers for the step graphs that record them: new for every new
    /// sequence and whenever a buffer is replaced ([`Model::restore`]).
    pub(in crate::model) graph_key: u64,
    /// The prompt's images, when it has any ([`Model::attach_images`]).
    pub(in crate::model) images: Option<std::sync::Arc<SequenceImages>>,
    /// A checkpoint to take in the middle of the next forward
    /// ([`Model::forward_hidden_with_checkpoint`]).
    pub(in crate::model) capture: Option<MidForwardCapture<B>>,
}

/// A checkpoint taken while a forward passes a position: the Gated DeltaNet layers copy their
/// states there as the forward reaches them.
pub(in crate::model) struct MidForwardCapture<B: Backend> {
    /// The sequence position the checkpoint is of.
    pub(in crate::model) position: usize,
    /// Per layer, as in [`SequenceCheckpoint`], filled layer by layer.
    pub(in crate::model) layers: Vec<Option<(B::ConvState, B::RecurrentState)>>,
}

/// One attached image as the prefix cache tells images apart: the prompt indices of its
/// placeholder run and a 128-bit hash of its grid and its tokens' embeddings (everything of
/// the image the decoder's computation reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageKey {
    pub first_token: usize,
    pub tokens: usize,
    pub content: u128,
}

impl ImageKey {
    /// Whether the image has a token in the prompt indices `range`.
    pub fn overlaps(&self, range: &std::ops::Range<usize>) -> bool {
        self.first_token < range.end && self.first_token + self.tokens > range.start
    }
}

/// A prompt's images as the decoder sees them: every prompt token's three rotary positions,
/// what later tokens add to their index, and the embeddings that replace the image tokens'.
#[derive(Debug)]
pub struct SequenceImages {
    /// (temporal, height, width) of each prompt token.
    pub(in crate::model) streams: Vec<[usize; 3]>,
    /// A token at index `i` past the prompt turns by `i + delta` in every stream.
    pub(in crate::model) delta: i64,
    /// `mrope_section` of the model.
    pub(in crate::model) section: [usize; 3],
    /// Prompt indices of the image tokens, ascending, one per row of `embeddings`.
    pub(in crate::model) image_tokens: Vec<usize>,
    /// `[image_tokens.len(), hidden]`.
    pub(in crate::model) embeddings: Vec<f32>,
    /// Each image's key, in prompt order.
    pub(in crate::model) keys: Vec<ImageKey>,
}

impl SequenceImages {
    /// The three rotary positions of the token at `index`.
    pub(in crate::model) fn streams_at(&self, index: usize) -> [usize; 3] {
        match self.streams.get(index) {
            Some(streams) => *streams,
            None => [(index as i64 + self.delta).max(0) as usize; 3],
        }
    }
}

impl<B: Backend> SequenceState<B> {
    /// Tokens processed so far (= position of the next token).
    pub fn position(&self) -> usize {
        self.position
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// The keys of the images attached to the sequence's prompt (none: a text prompt).
    pub fn image_keys(&self) -> &[ImageKey] {
        self.images.as_deref().map_or(&[], |images| &images.keys)
    }

    /// Moves the attached images to `fresh`, a new sequence that replaces this one.
    pub fn move_images_to(&mut self, fresh: &mut SequenceState<B>) {
        fresh.images = self.images.take();
    }
}

/// What the layers of one forward share: the MoE context, and what the MoE layers count and
/// leave to be finished at the end.
pub(in crate::model) struct LayerScratch<'a, B: Backend> {
    pub(in crate::model) moe_context: MoeContext<'a, B>,
    pub(in crate::model) tally: PhaseTotals,
    pub(in crate::model) deferred: Vec<DeferredRouting<B>>,
    /// This forward's layerwise stream of each stage (empty: none), which a crossing hands on.
    pub(in crate::model) layerwise_by_stage: &'a [Option<LayerwiseStream<'a, B>>],
    /// The later stages' hand-offs to the workers when this forward's layers are handed off
    /// by the backends (empty: by the host, or unsplit).
    pub(in crate::model) later_handoffs: &'a [BackendHandoff<B>],
}

impl<'a, B: Backend> LayerScratch<'a, B> {
    pub(in crate::model) fn new(moe_context: MoeContext<'a, B>) -> Self {
        LayerScratch {
            moe_context,
            tally: PhaseTotals::default(),
            deferred: Vec::new(),
            layerwise_by_stage: &[],
            later_handoffs: &[],
        }
    }

    /// The MoE layers from here on run on `next`: its backend, its staging slots and this
    /// forward's layerwise stream of that stage and, when the backends hand this forward's
    /// layers off, that stage's hand-off.
    pub(in crate::model) fn enter_stage(&mut self, next: NextStage<'a, B>) {
        self.moe_context.backend = next.backend;
        self.moe_context.staging = next.staging;
        self.moe_context.layerwise = self
            .layerwise_by_stage
            .get(next.stage)
            .and_then(Option::as_ref);
        if self.moe_context.worker_handoff.is_some() {
            self.moe_context.worker_handoff = next
                .stage
                .checked_sub(1)
                .and_then(|later| self.later_handoffs.get(later))
                .map(|stage| &stage.handoff);
        }
    }
}

/// A sequence's state at one point, to go back to ([`Model::checkpoint`], [`Model::restore`]).
pub struct SequenceCheckpoint<B: Backend> {
    pub(in crate::model) position: usize,
    /// Per layer: copies of a Gated DeltaNet layer's conv and recurrent states.
    pub(in crate::model) layers: Vec<Option<(B::ConvState, B::RecurrentState)>>,
    /// Copies of the PLE states (qwen4_exp).
    pub(in crate::model) ple: Vec<Option<crate::model::qwen4_exp::ple_state::PleState<B>>>,
}

/// One Gated DeltaNet layer's weights of its short convolution and delta rule, and the rule's
/// form for this forward.
pub(in crate::model) struct DeltaRuleMix<'a, B: Backend> {
    pub(in crate::model) index: usize,
    pub(in crate::model) conv1d: &'a B::Weight,
    pub(in crate::model) a_log: &'a B::Weight,
    pub(in crate::model) dt_bias: &'a B::Weight,
    pub(in crate::model) delta: &'a DeltaRuleSpec,
    pub(in crate::model) form: DeltaRuleForm,
}

/// A checked batch: its token ids, each sequence's rows, each row's position.
#[derive(Default)]
pub(in crate::model) struct BatchPlan {
    pub(in crate::model) ids: Vec<u32>,
    pub(in crate::model) ranges: Vec<std::ops::Range<usize>>,
    /// Each row's rotary position (for a row of an image prompt, its temporal stream).
    pub(in crate::model) positions: Vec<usize>,
    /// Every row's three streams and the section, when a row's streams differ (an image
    /// token); text rows alone turn by `positions`.
    pub(in crate::model) multimodal: Option<(Vec<[usize; 3]>, [usize; 3])>,
    /// Rows whose embedding an image replaces: (batch row, images, embedding row).
    pub(in crate::model) image_rows: Vec<(usize, std::sync::Arc<SequenceImages>, usize)>,
}

impl BatchPlan {
    /// Whether the batch needs the image paths (replaced embeddings or three-stream rotation).
    pub(in crate::model) fn has_images(&self) -> bool {
        self.multimodal.is_some() || !self.image_rows.is_empty()
    }
}

/// How a forward's rows turn: one position each, or three streams each for an image prompt.
#[derive(Clone, Copy)]
pub(in crate::model) struct RowPositions<'a> {
    pub(in crate::model) positions: &'a [usize],
    pub(in crate::model) multimodal: Option<crate::backend::MultimodalRotation<'a>>,
}

/// New tokens of one sequence in a batched forward.
pub struct SequenceInput<'a, B: Backend> {
    pub state: &'a mut SequenceState<B>,
    pub tokens: &'a [u32],
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
