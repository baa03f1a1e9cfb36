//! One sequence's state of a Qwen4-Exp PLE block: its conv inputs and last token ids.
//!
//! Owns: [`PleState`]. Must not touch: the PLE block's computation.

use crate::backend::Backend;
use crate::error::EngineError;

/// One sequence's state of a PLE block.
pub struct PleState<B: Backend> {
    /// The last `(kernel − 1)·ngram_size` normalised conv inputs (`n·H` channels), zeros
    /// before the sequence start, where the backend computes.
    pub(in crate::model) conv: B::ConvState,
    /// The last `ngram_size − 1` token ids, EOS before the sequence start.
    pub(in crate::model) context: Vec<u32>,
}

impl<B: Backend> PleState<B> {
    /// A copy (a sequence's checkpoint).
    pub(crate) fn copy(&self, backend: &B) -> Result<Self, EngineError> {
        Ok(PleState {
            conv: backend.copy_conv_state(&self.conv)?,
            context: self.context.clone(),
        })
    }
}
