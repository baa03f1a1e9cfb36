//! The shapes and settings single backend ops take: how a norm applies its weight, an attention
//! or Gated DeltaNet layer's shape, which delta-rule form runs, and a rotary embedding's
//! positions (1-D or the three multimodal streams).
//!
//! Owns: these plain values (re-exported from `crate::backend`). Must not touch: the ops
//! themselves (the `Backend` trait and its implementations).

/// How an RMSNorm applies its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormStyle {
    /// `w ⊙ x̂` (qwen3_moe, and the gated GDN norm).
    Plain,
    /// `(1 + w) ⊙ x̂` (qwen3_next / qwen3_5_moe).
    ZeroCentred,
}

/// Shape of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSpec {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Keys within this many positions (self included) are visible; `None` = full causal.
    pub sliding_window: Option<usize>,
}

/// Shape of one Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleSpec {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
}

/// Which form of the gated delta rule to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaRuleForm {
    /// Chunked for multi-token segments, recurrent for single tokens (what transformers does).
    Auto,
    /// Chunked (chunk size 64) for every segment.
    Chunked,
    /// Token-by-token recurrence for every segment.
    Recurrent,
}

/// What [`Backend::rope`](super::Backend::rope) takes besides the tensor: row `r` at `positions[r]`, the first
/// `rotary_dim` dims of each `head_dim` head rotated with base `theta`.
#[derive(Debug, Clone, Copy)]
pub struct Rotation<'a> {
    pub positions: &'a [usize],
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub theta: f64,
    /// The three position streams of image prompts (docs/MODELS.md §1.2, §10.6); `None` when
    /// every stream equals `positions` (text), which is the 1-D rotation.
    pub multimodal: Option<MultimodalRotation<'a>>,
}

/// Interleaved M-RoPE: row `r`'s frequency `i` turns by `streams[r][stream(i)]`, the stream
/// chosen by [`MultimodalRotation::stream_of_frequency`].
#[derive(Debug, Clone, Copy)]
pub struct MultimodalRotation<'a> {
    /// (temporal, height, width) position of each row.
    pub streams: &'a [[usize; 3]],
    /// `mrope_section`: how many frequencies each stream may take.
    pub section: [usize; 3],
}

impl MultimodalRotation<'_> {
    /// Height for `i % 3 == 1` below `3·section[1]`, width for `i % 3 == 2` below
    /// `3·section[2]`, temporal otherwise.
    pub fn stream_of_frequency(&self, frequency: usize) -> usize {
        match frequency % 3 {
            1 if frequency < 3 * self.section[1] => 1,
            2 if frequency < 3 * self.section[2] => 2,
            _ => 0,
        }
    }
}
