//! The QSA indexer settings of a model: what the backends' QSA selection ops and the model's
//! host selection both take, kept with the backend so that the backend depends on no model.
//!
//! Owns: the settings, their validation and the block counts they imply. Must not touch: the
//! selection itself (`model/qwen4_exp/qsa_selection.rs`, the backends' QSA ops).

use crate::error::EngineError;

/// The indexer settings of a model (`indexer_*` config fields plus the shared RoPE and norm eps).
#[derive(Debug, Clone, PartialEq)]
pub struct QsaSelectionSettings {
    /// Tokens a query may attend beyond its tail (`indexer_budget`), a multiple of the ratio.
    pub budget: usize,
    /// Tokens per block (`indexer_compress_ratio`).
    pub compress_ratio: usize,
    /// Query heads of the indexer (`indexer_n_heads`); there is one key head.
    pub index_heads: usize,
    /// Width of an indexer head (`indexer_head_dim`).
    pub index_head_dim: usize,
    /// Rotary width of the main attention, applied to the first dims of each indexer head.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub norm_eps: f32,
}

impl QsaSelectionSettings {
    /// Refuses settings transformers refuses too, and ones the selection cannot run with.
    pub fn validate(&self) -> Result<(), EngineError> {
        let invalid = |problem: String| Err(EngineError::InvalidConfig { problem });
        if self.budget == 0 || self.compress_ratio == 0 || self.index_heads == 0 {
            return invalid(format!(
                "QSA indexer_budget ({}), indexer_compress_ratio ({}) and indexer_n_heads ({}) must be positive",
                self.budget, self.compress_ratio, self.index_heads
            ));
        }
        if self.budget % self.compress_ratio != 0 {
            return invalid(format!(
                "QSA indexer_budget ({}) must be a multiple of indexer_compress_ratio ({})",
                self.budget, self.compress_ratio
            ));
        }
        if self.rotary_dim > self.index_head_dim || self.rotary_dim % 2 != 0 {
            return invalid(format!(
                "QSA rotary width {} must be even and at most indexer_head_dim ({})",
                self.rotary_dim, self.index_head_dim
            ));
        }
        Ok(())
    }

    /// Blocks a query keeps once past the dense regime.
    pub fn top_blocks(&self) -> usize {
        self.budget / self.compress_ratio
    }

    /// The largest number of visible tokens for which attention is still dense causal.
    pub fn dense_token_limit(&self) -> usize {
        self.budget + self.compress_ratio - 1
    }
}
