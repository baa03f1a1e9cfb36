//! QSA attention on the host in f32: the CPU backend's QSA ops and the reference the device
//! kernels are held to (the qwen4_exp QSA layers ran exactly this before they had backend ops).
//!
//! Owns: the host QSA cache (keys, values, raw indexer keys, pooled block keys of one layer of
//! one sequence) and attention over the tokens [`select_tokens`] picks.
//! Must not touch: the selection math itself (`model::qwen4_exp::qsa_selection`).

use crate::error::EngineError;
use crate::model::qwen4_exp::qsa_selection::{
    pooled_block_key, select_tokens, QsaSelectionSettings,
};

/// One QSA layer of one sequence in host memory.
#[derive(Debug, Clone)]
pub struct HostQsaCache {
    pub max_tokens: usize,
    pub kv_width: usize,
    /// `[tokens, kv_width]`, after k_norm and RoPE.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// `[tokens, Di]`, as projected (the pooled keys are made from them; all of them are kept
    /// so a truncation into a completed block can pool it again).
    raw_index_keys: Vec<f32>,
    /// `[tokens / ratio, Di]`: one pooled key per completed block.
    pooled_keys: Vec<f32>,
    tokens: usize,
    compress_ratio: usize,
    index_head_dim: usize,
}

impl HostQsaCache {
    pub fn new(
        max_tokens: usize,
        kv_width: usize,
        settings: &QsaSelectionSettings,
    ) -> Result<Self, EngineError> {
        settings.validate()?;
        Ok(HostQsaCache {
            max_tokens,
            kv_width,
            keys: Vec::new(),
            values: Vec::new(),
            raw_index_keys: Vec::new(),
            pooled_keys: Vec::new(),
            tokens: 0,
            compress_ratio: settings.compress_ratio,
            index_head_dim: settings.index_head_dim,
        })
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// `[complete_blocks, Di]`.
    pub fn pooled_keys(&self) -> &[f32] {
        &self.pooled_keys
    }

    /// Appends one token at position [`HostQsaCache::tokens`]; pools the block it completes.
    pub fn push(
        &mut self,
        key: &[f32],
        value: &[f32],
        raw_index_key: &[f32],
        key_norm: &[f32],
        settings: &QsaSelectionSettings,
    ) -> Result<(), EngineError> {
        let width = self.index_head_dim;
        if key.len() != self.kv_width
            || value.len() != self.kv_width
            || raw_index_key.len() != width
            || key_norm.len() != width
        {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "QSA append of a key of {}, a value of {} and a raw index key of {} values with a key norm of {} (cache: {} and {})",
                    key.len(),
                    value.len(),
                    raw_index_key.len(),
                    key_norm.len(),
                    self.kv_width,
                    width
                ),
            });
        }
        if self.tokens >= self.max_tokens {
            return Err(EngineError::ContextFull {
                held: self.tokens,
                added: 1,
                max_context: self.max_tokens,
            });
        }
        self.keys.extend_from_slice(key);
        self.values.extend_from_slice(value);
        self.raw_index_keys.extend_from_slice(raw_index_key);
        self.tokens += 1;
        let ratio = self.compress_ratio;
        if self.tokens % ratio == 0 {
            let first = self.tokens - ratio;
            let block = &self.raw_index_keys[first * width..self.tokens * width];
            let pooled = pooled_block_key(block, first, key_norm, settings);
            self.pooled_keys.extend_from_slice(&pooled);
        }
        Ok(())
    }

    /// Appends positions `from` of `source` (keys, values, raw indexer keys, and the pooled
    /// keys of the blocks they complete, as they are) to this cache, which holds exactly `to`
    /// tokens ([`Backend::copy_qsa_rows`](crate::backend::Backend::copy_qsa_rows)).
    pub fn append_rows_of(
        &mut self,
        source: &HostQsaCache,
        from: std::ops::Range<usize>,
        to: usize,
    ) -> Result<(), EngineError> {
        let ratio = self.compress_ratio;
        let end = to + from.len();
        if source.kv_width != self.kv_width
            || source.index_head_dim != self.index_head_dim
            || source.compress_ratio != ratio
            || to != self.tokens
            || from.end > source.tokens
            || end > self.max_tokens
            || from.start % ratio != 0
            || to % ratio != 0
        {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "QSA copy of positions {from:?} of a cache holding {} tokens to position {to} of one holding {} (room for {}, ratio {ratio})",
                    source.tokens, self.tokens, self.max_tokens
                ),
            });
        }
        let (kv, width) = (self.kv_width, self.index_head_dim);
        self.keys
            .extend_from_slice(&source.keys[from.start * kv..from.end * kv]);
        self.values
            .extend_from_slice(&source.values[from.start * kv..from.end * kv]);
        self.raw_index_keys
            .extend_from_slice(&source.raw_index_keys[from.start * width..from.end * width]);
        let blocks = from.start / ratio..from.end / ratio;
        self.pooled_keys
            .extend_from_slice(&source.pooled_keys[blocks.start * width..blocks.end * width]);
        self.tokens = end;
        Ok(())
    }

    /// Bytes the cache holds.
    pub fn bytes(&self) -> usize {
        (self.keys.len() + self.values.len() + self.raw_index_keys.len() + self.pooled_keys.len())
            * std::mem::size_of::<f32>()
    }

    /// Forgets everything from token `tokens` on.
    pub fn truncate(&mut self, tokens: usize) {
        if tokens >= self.tokens {
            return;
        }
        self.keys.truncate(tokens * self.kv_width);
        self.values.truncate(tokens * self.kv_width);
        self.raw_index_keys.truncate(tokens * self.index_head_dim);
        self.pooled_keys
            .truncate(tokens / self.compress_ratio * self.index_head_dim);
        self.tokens = tokens;
    }

    /// The tokens the query at `position` attends ([`select_tokens`]); its own key must be held.
    pub fn select(
        &self,
        index_query: &[f32],
        position: usize,
        settings: &QsaSelectionSettings,
    ) -> Result<Vec<usize>, EngineError> {
        if position >= self.tokens {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "QSA query at position {position} of a cache holding {} tokens",
                    self.tokens
                ),
            });
        }
        select_tokens(index_query, &self.pooled_keys, position + 1, settings)
    }

    /// Softmax attention of one query row (`heads · hd`) over `selected` tokens, added into
    /// `out` (zeros): per head, f32 scores over the selected keys of its kv head, their softmax,
    /// the weighted sum of the values, in the order of `selected`.
    pub fn attend(&self, query: &[f32], selected: &[usize], spec: AttendShape, out: &mut [f32]) {
        let AttendShape {
            heads,
            kv_heads,
            head_dim,
        } = spec;
        let kv_width = self.kv_width;
        let group = heads / kv_heads.max(1);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut scores = Vec::with_capacity(selected.len());
        for head in 0..heads {
            let kv_head = head / group.max(1);
            let query = &query[head * head_dim..(head + 1) * head_dim];
            scores.clear();
            scores.extend(selected.iter().map(|&token| {
                let key = &self.keys[token * kv_width + kv_head * head_dim..][..head_dim];
                query.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * scale
            }));
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0f32;
            for score in scores.iter_mut() {
                *score = (*score - max).exp();
                total += *score;
            }
            let out = &mut out[head * head_dim..][..head_dim];
            for (&token, weight) in selected.iter().zip(&scores) {
                let value = &self.values[token * kv_width + kv_head * head_dim..][..head_dim];
                let weight = weight / total;
                for (o, v) in out.iter_mut().zip(value) {
                    *o += weight * v;
                }
            }
        }
    }
}

/// The head layout [`HostQsaCache::attend`] reads.
#[derive(Debug, Clone, Copy)]
pub struct AttendShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}
