//! QSA ("Qwen sparse attention") token selection of one attention layer, on the host in f32.
//!
//! Each query token attends only to a subset of the keys before it. The subset is chosen by a
//! small indexer: the sequence's raw indexer keys are cut into blocks of `compress_ratio`
//! consecutive tokens aligned at position 0; each complete block is pooled into one key (mean of
//! its raw keys, zero-centred RMSNorm, RoPE at the block's first position). A query scores a
//! block as `Σ_heads relu(q_h · k̄) / √head_dim` and keeps the `budget / compress_ratio` best
//! blocks plus the incomplete tail block (its most recent `visible mod compress_ratio` tokens).
//! While a query sees at most `budget + compress_ratio − 1` tokens every block is kept, so
//! attention is exactly dense causal there.
//!
//! Positions are token indices (one unpadded sequence from position 0), as in the engine.
//! A pooled block key depends only on that block, so [`QsaBlockKeys`] computes each once, when
//! its last raw key arrives, and keeps the raw keys of the incomplete block only.
//!
//! Owns: the indexer's query preparation, block pooling and the per-query selection.
//! Must not touch: the indexer projection (a matmul the model graph does) and attention itself.

use crate::error::EngineError;
use crate::host_math::rope_inverse_frequencies;
// The settings are the backend's type (its QSA ops take them); the model's code names them here.
pub use crate::backend::qsa_settings::QsaSelectionSettings;

use super::torch_topk::torch_top_k_indices;

/// Zero-centred RMSNorm of one vector in place: `x / rms(x) · (1 + w)`.
fn zero_centred_rms_norm(values: &mut [f32], weight: &[f32], eps: f32) {
    let mean_square = values.iter().map(|v| v * v).sum::<f32>() / values.len().max(1) as f32;
    let inverse = 1.0 / (mean_square + eps).sqrt();
    for (value, w) in values.iter_mut().zip(weight) {
        *value = *value * inverse * (1.0 + w);
    }
}

/// RoPE of one head in place over its first `inverse_frequencies.len() · 2` dims (pairs half
/// the rotary width apart), at `position`.
fn rotate_head(head: &mut [f32], inverse_frequencies: &[f32], position: usize) {
    let half = inverse_frequencies.len();
    for (i, &frequency) in inverse_frequencies.iter().enumerate() {
        let angle = position as f32 * frequency;
        let (sin, cos) = angle.sin_cos();
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = b * cos + a * sin;
    }
}

/// The indexer query of one token from its raw projection `[index_heads · index_head_dim]`:
/// each head RMS-normalised with `query_norm_weight` and rotated at the token's position.
pub fn prepare_index_query(
    raw_query: &[f32],
    query_norm_weight: &[f32],
    position: usize,
    settings: &QsaSelectionSettings,
) -> Vec<f32> {
    let inverse_frequencies = rope_inverse_frequencies(settings.rotary_dim, settings.rope_theta);
    let mut query = raw_query.to_vec();
    for head in query.chunks_exact_mut(settings.index_head_dim) {
        zero_centred_rms_norm(head, query_norm_weight, settings.norm_eps);
        rotate_head(head, &inverse_frequencies, position);
    }
    query
}

/// Pooled key of one complete block from its `compress_ratio` raw keys (row-major): the f32
/// mean, RMS-normalised with `key_norm_weight`, rotated at the block's first position.
pub fn pooled_block_key(
    raw_block_keys: &[f32],
    first_position: usize,
    key_norm_weight: &[f32],
    settings: &QsaSelectionSettings,
) -> Vec<f32> {
    let width = settings.index_head_dim;
    let mut pooled = vec![0.0f32; width];
    for key in raw_block_keys.chunks_exact(width) {
        for (sum, value) in pooled.iter_mut().zip(key) {
            *sum += value;
        }
    }
    let count = (raw_block_keys.len() / width.max(1)) as f32;
    for value in pooled.iter_mut() {
        *value /= count;
    }
    zero_centred_rms_norm(&mut pooled, key_norm_weight, settings.norm_eps);
    let inverse_frequencies = rope_inverse_frequencies(settings.rotary_dim, settings.rope_theta);
    rotate_head(&mut pooled, &inverse_frequencies, first_position);
    pooled
}

/// The pooled keys of a sequence's complete blocks, grown one raw key at a time.
#[derive(Debug, Clone)]
pub struct QsaBlockKeys {
    settings: QsaSelectionSettings,
    key_norm_weight: Vec<f32>,
    /// `[blocks, index_head_dim]`, block `j` covering tokens `[j·ratio, (j+1)·ratio)`.
    pooled: Vec<f32>,
    /// Raw keys of the incomplete block (fewer than `compress_ratio` rows).
    pending_raw: Vec<f32>,
    tokens: usize,
}

impl QsaBlockKeys {
    pub fn new(
        settings: QsaSelectionSettings,
        key_norm_weight: Vec<f32>,
    ) -> Result<Self, EngineError> {
        settings.validate()?;
        if key_norm_weight.len() != settings.index_head_dim {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "QSA key norm weight has {} values, indexer_head_dim is {}",
                    key_norm_weight.len(),
                    settings.index_head_dim
                ),
            });
        }
        Ok(Self {
            settings,
            key_norm_weight,
            pooled: Vec::new(),
            pending_raw: Vec::new(),
            tokens: 0,
        })
    }

    /// Appends the raw indexer key of the next token (`[index_head_dim]`).
    pub fn push_raw_key(&mut self, raw_key: &[f32]) -> Result<(), EngineError> {
        let width = self.settings.index_head_dim;
        if raw_key.len() != width {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "QSA raw key has {} values, indexer_head_dim is {width}",
                    raw_key.len()
                ),
            });
        }
        self.pending_raw.extend_from_slice(raw_key);
        self.tokens += 1;
        if self.pending_raw.len() == width * self.settings.compress_ratio {
            let first_position = self.tokens - self.settings.compress_ratio;
            let pooled = pooled_block_key(
                &self.pending_raw,
                first_position,
                &self.key_norm_weight,
                &self.settings,
            );
            self.pooled.extend_from_slice(&pooled);
            self.pending_raw.clear();
        }
        Ok(())
    }

    /// Tokens pushed so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// `[complete_blocks, index_head_dim]`.
    pub fn pooled_keys(&self) -> &[f32] {
        &self.pooled
    }

    pub fn settings(&self) -> &QsaSelectionSettings {
        &self.settings
    }

    /// The tokens the query at token index `query_index` attends (see [`select_tokens`]); the
    /// keys of tokens `0..=query_index` must have been pushed.
    pub fn select_for_query(
        &self,
        prepared_query: &[f32],
        query_index: usize,
    ) -> Result<Vec<usize>, EngineError> {
        if query_index >= self.tokens {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "QSA query at token {query_index} but only {} keys were pushed",
                    self.tokens
                ),
            });
        }
        select_tokens(
            prepared_query,
            &self.pooled,
            query_index + 1,
            &self.settings,
        )
    }
}

/// Score of one pooled block key against a prepared query: `Σ_h relu(q_h · k̄) / √head_dim`.
pub fn block_score(prepared_query: &[f32], pooled_key: &[f32], index_head_dim: usize) -> f32 {
    let mut total = 0.0f32;
    for head in prepared_query.chunks_exact(index_head_dim) {
        let dot: f32 = head.iter().zip(pooled_key).map(|(q, k)| q * k).sum();
        total += dot.max(0.0);
    }
    total / (index_head_dim as f32).sqrt()
}

/// The token indices (ascending) a query attends when it sees tokens `0..visible_tokens`, from
/// the pooled keys of (at least) every complete block among them. Within the dense limit all
/// tokens; beyond it the `budget / compress_ratio` best-scoring blocks (ties resolved as
/// PyTorch's `topk` resolves them, see [`torch_top_k_indices`]) plus the incomplete tail block.
pub fn select_tokens(
    prepared_query: &[f32],
    pooled_keys: &[f32],
    visible_tokens: usize,
    settings: &QsaSelectionSettings,
) -> Result<Vec<usize>, EngineError> {
    let ratio = settings.compress_ratio;
    let width = settings.index_head_dim;
    if prepared_query.len() != settings.index_heads * width {
        return Err(EngineError::InvalidConfig {
            problem: format!(
                "QSA query has {} values, expected {} heads of {width}",
                prepared_query.len(),
                settings.index_heads
            ),
        });
    }
    let complete_blocks = visible_tokens / ratio;
    if complete_blocks <= settings.top_blocks() {
        return Ok((0..visible_tokens).collect());
    }
    if pooled_keys.len() < complete_blocks * width {
        return Err(EngineError::InvalidConfig {
            problem: format!(
                "QSA selection over {visible_tokens} tokens needs {complete_blocks} pooled block keys, got {}",
                pooled_keys.len() / width
            ),
        });
    }
    let scores: Vec<f32> = pooled_keys
        .chunks_exact(width)
        .take(complete_blocks)
        .map(|key| block_score(prepared_query, key, width))
        .collect();
    let keep = settings.top_blocks();
    let kept_blocks = torch_top_k_indices(&scores, keep);
    let mut tokens: Vec<usize> = Vec::with_capacity(keep * ratio + ratio - 1);
    for block in kept_blocks {
        tokens.extend(block * ratio..(block + 1) * ratio);
    }
    tokens.extend(complete_blocks * ratio..visible_tokens);
    Ok(tokens)
}
