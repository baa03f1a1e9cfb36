//! The model's MTP steps: the draft head's forward over verified pairs, its logits, and a new
//! sequence's MTP state.
//!
//! Owns: running the head on the model. Must not touch: the head's weights and state (`mtp.rs`).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{mtp_pairs_of_block, MtpHead, MtpPrefixRows, MtpState, MtpUsage};
use crate::backend::{Backend, LayerInput, Segment};
use crate::error::EngineError;
use crate::model::layers::{LayerScratch, RowPositions};
use crate::model::Model;

impl<B: Backend> Model<B> {
    /// Whether the artifact carries an MTP head.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    pub(in crate::model) fn mtp_head(&self) -> Result<&MtpHead<B>, EngineError> {
        self.mtp.as_ref().ok_or_else(|| EngineError::InvalidConfig {
            problem: "this model has no MTP head (no `mtp.*` tensors in the artifact)".into(),
        })
    }

    /// What the MTP head computed so far (all zero without a head).
    pub fn mtp_usage(&self) -> MtpUsage {
        self.mtp.as_ref().map_or_else(MtpUsage::default, |head| {
            let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
            MtpUsage {
                layer_forwards: load(&head.usage.layer_forwards),
                layer_rows: load(&head.usage.layer_rows),
                draft_head_rows: load(&head.usage.draft_head_rows),
            }
        })
    }

    /// The logits that draft from MTP output rows (`[rows, hidden]`, as [`Model::mtp_forward`]
    /// returns them): the main model's head, counted as the MTP head's use.
    pub fn mtp_draft_logits(&self, rows: &B::Tensor) -> Result<Vec<f32>, EngineError> {
        let head = self.mtp_head()?;
        let logits = self.head_logits(rows)?;
        let (count, _) = self.output_backend().shape(rows);
        head.usage
            .draft_head_rows
            .fetch_add(count as u64, Ordering::Relaxed);
        Ok(logits)
    }

    /// Empty MTP state for a sequence of at most `max_context` positions.
    pub fn new_mtp_state(&self, max_context: usize) -> Result<MtpState<B>, EngineError> {
        self.mtp_head()?;
        let attention = &self.spec.attention;
        let cache = self
            .output_backend()
            .new_kv_cache(max_context, attention.kv_heads * attention.head_dim)?;
        Ok(MtpState {
            max_context,
            position: 0,
            cache,
        })
    }

    /// The MTP head over `hidden.rows` consecutive pairs starting at the state's position: row
    /// `r` pairs `hidden[r]` (the main model's final-normed state at position `p + r`, or an
    /// earlier draft's output) with `next_tokens[r]` (the token at `p + r + 1`). Returns the
    /// rows after `mtp.norm` (`[rows, hidden]`): [`Model::head_logits`] of row `r` drafts the
    /// token at `p + r + 2`, and the row itself is the `hidden` of the next draft step.
    pub fn mtp_forward(
        &self,
        state: &mut MtpState<B>,
        hidden: &B::Tensor,
        next_tokens: &[u32],
    ) -> Result<B::Tensor, EngineError> {
        let head = self.mtp_head()?;
        // The head is on the last stage (the only one unsplit), as `hidden` is.
        let backend = self.output_backend();
        let (rows, width) = backend.shape(hidden);
        let vocab = self.vocab_size();
        if rows == 0 || rows != next_tokens.len() || width != self.spec.common.hidden_size {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "MTP input of {rows}×{width} hidden rows with {} next tokens (hidden size {})",
                    next_tokens.len(),
                    self.spec.common.hidden_size
                ),
            });
        }
        if let Some(&token) = next_tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::TokenOutOfVocabulary {
                token,
                vocab_size: vocab,
            });
        }
        let end = state.position + rows;
        if end > state.max_context {
            return Err(EngineError::ContextFull {
                held: state.position,
                added: rows,
                max_context: state.max_context,
            });
        }
        let (eps, style) = (self.spec.eps(), self.spec.norm_style);
        let embedded = backend.rms_norm(
            &self.embed_on_output_stage(next_tokens)?,
            &head.pre_fc_norm_embedding,
            eps,
            style,
        )?;
        let normed_hidden = backend.rms_norm(hidden, &head.pre_fc_norm_hidden, eps, style)?;
        let mut residual = backend.matmul(
            &backend.concat_columns(&embedded, &normed_hidden)?,
            &head.fc,
        )?;

        // One decoder layer, the main layers' code; its index follows the main layers.
        let index = self.layers.len();
        let layer = &head.layer;
        let positions: Vec<usize> = (state.position..end).collect();
        let x = backend.rms_norm(&residual, layer.input_norm()?, eps, style)?;
        let mut segments = [Segment {
            rows: 0..rows,
            start_position: state.position,
            state: &mut state.cache,
        }];
        let mixed = self.attention_over(
            index,
            &layer.mixer,
            LayerInput::Normed(&x),
            RowPositions {
                positions: &positions,
                multimodal: None,
            },
            &mut segments,
        )?;
        let x = backend.add_rms_norm(
            &mut residual,
            &mixed,
            layer.post_attention_norm()?,
            eps,
            style,
        )?;
        let mut scratch = LayerScratch::new(self.output_stage_moe_context());
        let fed = self.feed_forward(&mut scratch, index, &layer.feed_forward, &x)?;
        backend.add_assign(&mut residual, &fed)?;
        let out = backend.rms_norm(&residual, &head.norm, eps, style)?;
        self.finish_deferred_routing(&mut scratch)?;
        state.position = end;
        head.usage.layer_forwards.fetch_add(1, Ordering::Relaxed);
        head.usage
            .layer_rows
            .fetch_add(rows as u64, Ordering::Relaxed);
        Ok(out)
    }
}

impl<B: Backend> Model<B> {
    /// A copy of the MTP rows of the prefix block of `positions` out of `state`, `None` while
    /// the head has not processed those pairs yet.
    pub fn mtp_prefix_rows(
        &self,
        state: &MtpState<B>,
        positions: std::ops::Range<usize>,
    ) -> Result<Option<MtpPrefixRows<B>>, EngineError> {
        let pairs = mtp_pairs_of_block(positions);
        if pairs.end > state.position {
            return Ok(None);
        }
        let attention = &self.spec.attention;
        let backend = self.output_backend();
        let mut rows =
            backend.new_kv_cache(pairs.len().max(1), attention.kv_heads * attention.head_dim)?;
        if !pairs.is_empty() {
            backend.copy_kv_rows(&state.cache, pairs.clone(), &mut rows, 0)?;
        }
        let bytes = backend.kv_cache_bytes(&rows);
        Ok(Some(MtpPrefixRows { pairs, rows, bytes }))
    }

    /// Puts the MTP rows of a restored prefix of `blocks` (consecutive, from the first block)
    /// into the fresh `state`: it then stands at the prefix's last position, whose pair (that
    /// position's hidden row and the token after the prefix) is the caller's next input. On an
    /// error `state` must be dropped.
    pub fn restore_mtp_prefix(
        &self,
        state: &mut MtpState<B>,
        blocks: &[&MtpPrefixRows<B>],
    ) -> Result<(), EngineError> {
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        if state.position != 0 {
            return Err(invalid(format!(
                "MTP prefix rows restored into a state at position {}",
                state.position
            )));
        }
        let mut end = 0;
        for block in blocks {
            if block.pairs.start != end {
                return Err(invalid(format!(
                    "MTP prefix rows of pairs {:?} after pair {end}",
                    block.pairs
                )));
            }
            end = block.pairs.end;
        }
        if end > state.max_context {
            return Err(invalid(format!(
                "MTP prefix rows of {end} pairs into a context of {}",
                state.max_context
            )));
        }
        for block in blocks {
            if !block.pairs.is_empty() {
                self.output_backend().copy_kv_rows(
                    &block.rows,
                    0..block.pairs.len(),
                    &mut state.cache,
                    block.pairs.start,
                )?;
            }
        }
        state.position = end;
        Ok(())
    }
}
