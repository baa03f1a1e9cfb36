//! The MTP draft head (`mtp.*`): from the main model's last hidden state at position `t` and the
//! token at `t + 1`, the hidden state whose logits draft the token at `t + 2`.
//!
//! Owns: loading the head (two pre-norms, the `fc` projection of their concatenation, one
//! full-attention decoder layer with the model's usual feed-forward, a final norm; the embedding
//! and the head are the main model's), its per-sequence state (the layer's own KV cache and
//! position), its forward, the vocabulary head over its rows for drafts, and the counts of what
//! it computed ([`MtpUsage`]: how callers show that steps without drafts skip it), and a prefix
//! block's share of its state ([`MtpPrefixRows`], copied out and back for the prefix cache). Chaining
//! drafts, verifying them, holding back pairs and rolling states back belong to the caller.
//! Must not touch: the main model's layers or sequence state, op implementations, sampling.

use std::sync::atomic::AtomicU64;

mod steps;

use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::layers::Layer;
use crate::model::loader::Loader;
use crate::spec::{FeedForwardKind, MixerKind, ModelSpec};

/// The MTP block's weights.
pub(super) struct MtpHead<B: Backend> {
    pre_fc_norm_embedding: B::Weight,
    pre_fc_norm_hidden: B::Weight,
    /// `[hidden, 2 · hidden]`: the embedding half first, then the hidden-state half.
    fc: B::Weight,
    pub(super) layer: Layer<B>,
    norm: B::Weight,
    usage: MtpUsageCounters,
}

/// What the MTP head computed since the model was loaded, over every sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MtpUsage {
    /// Forwards of the MTP layer ([`Model::mtp_forward`] calls).
    pub layer_forwards: u64,
    /// Rows those forwards processed (pairs and chained drafts).
    pub layer_rows: u64,
    /// Rows taken through the vocabulary head to draft ([`Model::mtp_draft_logits`]).
    pub draft_head_rows: u64,
}

#[derive(Default)]
struct MtpUsageCounters {
    layer_forwards: AtomicU64,
    layer_rows: AtomicU64,
    draft_head_rows: AtomicU64,
}

/// One sequence's MTP state: the MTP layer's KV cache over the pairs it has processed.
pub struct MtpState<B: Backend> {
    max_context: usize,
    position: usize,
    cache: B::KvCache,
}

impl<B: Backend> MtpState<B> {
    /// Pairs processed so far (= the position of the next one).
    pub fn position(&self) -> usize {
        self.position
    }

    /// Forgets the pairs at `position` and after (attention caches are cut back by position).
    pub fn truncate(&mut self, position: usize) {
        self.position = self.position.min(position);
    }
}

impl<B: Backend> Loader<'_, B> {
    /// The MTP head, when the artifact has one (`mtp.fc` present).
    pub(super) fn mtp_head(&self, spec: &ModelSpec) -> Result<Option<MtpHead<B>>, EngineError> {
        if self.artifact.get("mtp.fc").is_none() {
            return Ok(None);
        }
        let hidden = spec.common.hidden_size;
        // The head's layer is full attention with the model's usual feed-forward.
        let feed_forward = if spec.feed_forwards.contains(&FeedForwardKind::Moe) {
            FeedForwardKind::Moe
        } else {
            FeedForwardKind::Dense
        };
        Ok(Some(MtpHead {
            pre_fc_norm_embedding: self.parameter("mtp.pre_fc_norm_embedding", (1, hidden))?,
            pre_fc_norm_hidden: self.parameter("mtp.pre_fc_norm_hidden", (1, hidden))?,
            fc: self.matrix("mtp.fc", (hidden, 2 * hidden))?,
            layer: self.decoder_layer(
                spec,
                "mtp.layers.0",
                MixerKind::Attention,
                feed_forward,
                None,
            )?,
            norm: self.parameter("mtp.norm", (1, hidden))?,
            usage: MtpUsageCounters::default(),
        }))
    }
}

/// A prefix block's share of a speculating sequence's MTP state: the MTP layer's KV rows of the
/// pairs whose tokens all lie in the prefix up to the block's end (pair `i` joins the main
/// hidden row at `i` with the token at `i + 1`, so a block of positions `s..e` holds pairs
/// `s - 1..e - 1`, the first block `0..e - 1`). The pair at `e - 1` also needs the token after
/// the prefix: a restored sequence forms it from the main model's final-normed hidden row at
/// `e - 1`, which the prefix cache keeps beside the block.
pub struct MtpPrefixRows<B: Backend> {
    pairs: std::ops::Range<usize>,
    rows: B::KvCache,
    bytes: usize,
}

impl<B: Backend> MtpPrefixRows<B> {
    /// Bytes its rows take where the backend keeps them.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// The pairs a prefix block of `positions` holds MTP rows of ([`MtpPrefixRows`]).
pub fn mtp_pairs_of_block(positions: std::ops::Range<usize>) -> std::ops::Range<usize> {
    positions.start.saturating_sub(1)..positions.end.saturating_sub(1)
}
