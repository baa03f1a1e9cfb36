//! A sequence's state in the pieces the prefix cache keeps: the rows of one block of positions
//! of every attention and QSA layer ([`PrefixBlock`]), and checkpoints (the Gated DeltaNet and
//! PLE states at one position, [`SequenceCheckpoint`]).
//!
//! Owns: copying a block's rows out of a sequence and a chain of blocks (plus the checkpoint at
//! its end) back into a fresh one, and the bytes these pieces take.
//! Must not touch: which blocks are kept, matched or evicted (`crate::prefix_cache`), when a
//! forward ends (the scheduler).
//!
//! Why restoring is exact: attention and QSA rows are copied bit for bit and every op of the
//! forward computes a row from its own inputs and the cached rows alone, so the rows after a
//! restored prefix see what they would have seen. A Gated DeltaNet layer carries its whole past
//! in its states, so a prefix is restored only at a position where they were copied, and that
//! position is a multiple of the delta rule's chunk ([`Model::prefix_alignment`]): the chunks of
//! the rest then start where a whole prompt's chunks start.

use std::ops::Range;

use super::{LayerState, Model, SequenceCheckpoint, SequenceState};
use crate::backend::cpu::DELTA_RULE_CHUNK;
use crate::backend::Backend;
use crate::error::EngineError;

/// One layer's rows of a block.
enum BlockRows<B: Backend> {
    /// A Gated DeltaNet layer: nothing per block (its states live in checkpoints).
    None,
    Attention(B::KvCache),
    SparseAttention(B::QsaCache),
}

/// The rows of positions `start..start + tokens` of every attention and QSA layer of a
/// sequence, copied out of its caches.
pub struct PrefixBlock<B: Backend> {
    start: usize,
    tokens: usize,
    layers: Vec<BlockRows<B>>,
    bytes: usize,
}

impl<B: Backend> PrefixBlock<B> {
    /// The positions it holds.
    pub fn positions(&self) -> Range<usize> {
        self.start..self.start + self.tokens
    }

    /// Bytes its rows take where the backend keeps them.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl<B: Backend> SequenceCheckpoint<B> {
    /// The position it was taken at.
    pub fn position(&self) -> usize {
        self.position
    }
}

impl<B: Backend> Model<B> {
    /// Whether a prefix can be restored only where its recurrent states were copied (a model
    /// with Gated DeltaNet layers or PLE blocks): then only checkpoints are reuse points.
    pub fn needs_prefix_checkpoints(&self) -> bool {
        let recurrent = self
            .spec
            .mixers
            .iter()
            .any(|mixer| matches!(mixer, crate::spec::MixerKind::GatedDeltaNet));
        recurrent || self.qwen4_exp.is_some()
    }

    /// What a prefix block's length must be a multiple of for restored prefixes to give the
    /// bits of a whole prompt: the delta rule's chunk on a model with Gated DeltaNet layers
    /// (chunks of the rest then start where the whole prompt's do), and the QSA block on
    /// qwen4_exp (blocks are copied with their pooled keys). 1 otherwise.
    pub fn prefix_alignment(&self) -> usize {
        let mut alignment = 1;
        if self.needs_prefix_checkpoints() {
            alignment = DELTA_RULE_CHUNK;
        }
        if let Some(graph) = &self.qwen4_exp {
            alignment = lcm(alignment, graph.qsa_settings().compress_ratio);
        }
        alignment
    }

    /// Tokens of the rest a restored prefix leaves at least: one for a model without
    /// recurrent layers (the last token's logits), two with them (a one-token rest would run
    /// the delta rule's recurrent form where a whole prompt runs the chunked one).
    pub fn prefix_min_rest(&self) -> usize {
        if self.needs_prefix_checkpoints() {
            2
        } else {
            1
        }
    }

    /// A copy of positions `positions` of every attention and QSA layer of `state`, which must
    /// hold them.
    pub fn prefix_block(
        &self,
        state: &SequenceState<B>,
        positions: Range<usize>,
    ) -> Result<PrefixBlock<B>, EngineError> {
        if positions.end > state.position || positions.is_empty() {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "a prefix block of positions {positions:?} from a sequence at position {}",
                    state.position
                ),
            });
        }
        let kv_width = self.spec.attention.kv_heads * self.spec.attention.head_dim;
        let tokens = positions.len();
        let mut bytes = 0;
        let layers = state
            .layers
            .iter()
            .enumerate()
            .map(|(index, layer)| {
                let backend = self.layer_backend(index);
                Ok(match layer {
                    LayerState::GatedDeltaNet { .. } => BlockRows::None,
                    LayerState::Attention(cache) => {
                        let mut block = backend.new_kv_cache(tokens, kv_width)?;
                        backend.copy_kv_rows(cache, positions.clone(), &mut block, 0)?;
                        bytes += backend.kv_cache_bytes(&block);
                        BlockRows::Attention(block)
                    }
                    LayerState::SparseAttention(cache) => {
                        let settings = self
                            .qwen4_exp
                            .as_ref()
                            .map(|graph| graph.qsa_settings())
                            .ok_or_else(|| EngineError::InvalidConfig {
                                problem: "a QSA layer in a model without QSA settings".into(),
                            })?;
                        let mut block = backend.new_qsa_cache(tokens, kv_width, settings)?;
                        backend.copy_qsa_rows(cache, positions.clone(), &mut block, 0)?;
                        bytes += backend.qsa_cache_bytes(&block);
                        BlockRows::SparseAttention(block)
                    }
                })
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(PrefixBlock {
            start: positions.start,
            tokens,
            layers,
            bytes,
        })
    }

    /// Bytes a checkpoint's copies take (Gated DeltaNet conv and recurrent states and PLE conv
    /// states are f32 on every backend).
    pub fn checkpoint_bytes(&self, checkpoint: &SequenceCheckpoint<B>) -> usize {
        let f32_bytes = std::mem::size_of::<f32>();
        let delta = match &self.spec.delta_rule {
            Some(delta) => {
                let channels = 2 * delta.key_heads * delta.key_head_dim
                    + delta.value_heads * delta.value_head_dim;
                let conv = channels * self.spec.conv_kernel.saturating_sub(1);
                let recurrent = delta.value_heads * delta.key_head_dim * delta.value_head_dim;
                (conv + recurrent) * f32_bytes
            }
            None => 0,
        };
        let layers = checkpoint.layers.iter().flatten().count();
        let ple = match &self.qwen4_exp {
            Some(graph) => graph.ple_state_bytes() * checkpoint.ple.iter().flatten().count(),
            None => 0,
        };
        layers * delta + ple
    }

    /// Puts the prefix `blocks` (consecutive from position 0) into the fresh `state`, and the
    /// recurrent states of `checkpoint`, taken where the blocks end (required on a model that
    /// [needs checkpoints](Model::needs_prefix_checkpoints)): `state` then stands where a
    /// sequence that processed those positions stands. On an error `state` must be dropped.
    pub fn restore_prefix(
        &self,
        state: &mut SequenceState<B>,
        blocks: &[&PrefixBlock<B>],
        checkpoint: Option<&SequenceCheckpoint<B>>,
    ) -> Result<(), EngineError> {
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        if state.position != 0 {
            return Err(invalid(format!(
                "a prefix restored into a sequence at position {}",
                state.position
            )));
        }
        let mut end = 0;
        for block in blocks {
            if block.start != end || block.layers.len() != state.layers.len() {
                return Err(invalid(format!(
                    "prefix block at {} after position {end}",
                    block.start
                )));
            }
            end += block.tokens;
        }
        if end > state.max_context {
            return Err(invalid(format!(
                "a prefix of {end} tokens into a context of {}",
                state.max_context
            )));
        }
        match checkpoint {
            Some(checkpoint)
                if checkpoint.position != end || checkpoint.layers.len() != state.layers.len() =>
            {
                return Err(invalid(format!(
                    "a checkpoint at {} for a prefix of {end} tokens",
                    checkpoint.position
                )));
            }
            None if self.needs_prefix_checkpoints() && end > 0 => {
                return Err(invalid(
                    "a prefix restored without the recurrent states at its end".into(),
                ));
            }
            _ => {}
        }
        for block in blocks {
            for (index, (layer, rows)) in state.layers.iter_mut().zip(&block.layers).enumerate() {
                let backend = self.layer_backend(index);
                match (layer, rows) {
                    (LayerState::Attention(cache), BlockRows::Attention(rows)) => {
                        backend.copy_kv_rows(rows, 0..block.tokens, cache, block.start)?
                    }
                    (LayerState::SparseAttention(cache), BlockRows::SparseAttention(rows)) => {
                        backend.copy_qsa_rows(rows, 0..block.tokens, cache, block.start)?
                    }
                    (LayerState::GatedDeltaNet { .. }, BlockRows::None) => {}
                    _ => return Err(invalid("a prefix block of another model".into())),
                }
            }
        }
        if let Some(checkpoint) = checkpoint {
            for (index, (layer, saved)) in
                state.layers.iter_mut().zip(&checkpoint.layers).enumerate()
            {
                if let (LayerState::GatedDeltaNet { conv, recurrent }, Some((saved_conv, saved))) =
                    (layer, saved)
                {
                    let backend = self.layer_backend(index);
                    *conv = backend.copy_conv_state(saved_conv)?;
                    *recurrent = backend.copy_recurrent_state(saved)?;
                }
            }
            if checkpoint.ple.len() == state.ple.len() {
                state.ple = self.copy_ple_states(&checkpoint.ple)?;
            }
        }
        state.position = end;
        // New recurrent buffers: no recorded step may write the old ones.
        state.graph_key = super::step_graphs::new_graph_key();
        Ok(())
    }
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    if a == 0 || b == 0 {
        a.max(b)
    } else {
        a / gcd(a, b) * b
    }
}
