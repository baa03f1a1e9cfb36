//! The CPU backend's attention: KV cache rows and causal grouped-query attention over segments.
//!
//! Owns: those ops. Must not touch: QSA selection (`qsa.rs`).

use std::ops::Range;

use super::tensors::{CpuBackend, CpuKvCache, CpuTensor};
use crate::backend::{AttentionSpec, Segment};
use crate::error::EngineError;
use crate::weights::dot;

impl CpuBackend {
    /// [`Backend::copy_kv_rows`](crate::backend::Backend::copy_kv_rows) on the host.
    pub(super) fn copy_kv_rows_on_host(
        &self,
        source: &CpuKvCache,
        from: Range<usize>,
        target: &mut CpuKvCache,
        to: usize,
    ) -> Result<(), EngineError> {
        let width = source.kv_width;
        let end = to + from.len();
        if target.kv_width != width || from.end > source.max_tokens || end > target.max_tokens {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "copy_kv_rows: positions {from:?} of a {}-position cache of width {width} to {to}.. of a {}-position cache of width {}",
                    source.max_tokens, target.max_tokens, target.kv_width
                ),
            });
        }
        let (source_rows, target_rows) = (
            from.start * width..from.end * width,
            to * width..end * width,
        );
        target.keys[target_rows.clone()].copy_from_slice(&source.keys[source_rows.clone()]);
        target.values[target_rows].copy_from_slice(&source.values[source_rows]);
        target.len = target.len.max(end);
        Ok(())
    }

    /// [`Backend::attention`](crate::backend::Backend::attention) on the host.
    pub(super) fn attention_on_host(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, CpuKvCache>],
    ) -> Result<CpuTensor, EngineError> {
        let hd = spec.head_dim;
        let group = spec.heads / spec.kv_heads.max(1);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = CpuTensor::zeros(q.rows, spec.heads * hd);
        for segment in segments.iter_mut() {
            let cache = &mut *segment.state;
            let width = cache.kv_width;
            let end = segment.start_position + segment.rows.len();
            if end > cache.max_tokens {
                return Err(EngineError::ContextFull {
                    held: segment.start_position,
                    added: segment.rows.len(),
                    max_context: cache.max_tokens,
                });
            }
            for (offset, row) in segment.rows.clone().enumerate() {
                let at = (segment.start_position + offset) * width;
                cache.keys[at..at + width].copy_from_slice(k.row(row));
                cache.values[at..at + width].copy_from_slice(v.row(row));
            }
            cache.len = end;
            let mut scores = vec![0.0f32; end];
            for (offset, row) in segment.rows.clone().enumerate() {
                let position = segment.start_position + offset;
                let first_key = match spec.sliding_window {
                    Some(window) => (position + 1).saturating_sub(window),
                    None => 0,
                };
                for head in 0..spec.heads {
                    let kv_head = head / group.max(1);
                    let query = &q.row(row)[head * hd..(head + 1) * hd];
                    let mut max_score = f32::NEG_INFINITY;
                    for key_position in first_key..=position {
                        let at = key_position * width + kv_head * hd;
                        let score = dot(query, &cache.keys[at..at + hd]) * scale;
                        scores[key_position] = score;
                        max_score = max_score.max(score);
                    }
                    let mut total = 0.0f32;
                    for score in &mut scores[first_key..=position] {
                        *score = (*score - max_score).exp();
                        total += *score;
                    }
                    let output = &mut out.row_mut(row)[head * hd..(head + 1) * hd];
                    for key_position in first_key..=position {
                        let weight = scores[key_position] / total;
                        let at = key_position * width + kv_head * hd;
                        for (o, value) in output.iter_mut().zip(&cache.values[at..at + hd]) {
                            *o += weight * value;
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}
