//! The CPU backend's QSA ops: the sparse attention cache, the indexer queries, the selection and
//! attention over the selected tokens (through the host QSA code the CUDA checks share).
//!
//! Owns: those ops. Must not touch: the selection rule (`model/qwen4_exp/qsa_selection.rs`).

use super::tensors::{check_segment_rows, CpuBackend, CpuTensor, CpuWeight};
use crate::backend::qsa_host::{AttendShape, HostQsaCache};
use crate::backend::{AttentionSpec, QsaSelectionSettings, Segment};
use crate::error::EngineError;
use crate::model::qwen4_exp::qsa_selection::prepare_index_query;

impl CpuBackend {
    /// [`Backend::qsa_append`](crate::backend::Backend::qsa_append) on the host.
    pub(super) fn qsa_append_on_host(
        &self,
        k: &CpuTensor,
        v: &CpuTensor,
        index_qk: &CpuTensor,
        key_norm: &CpuWeight,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, HostQsaCache>],
    ) -> Result<(), EngineError> {
        let width = settings.index_head_dim;
        let raw_start = settings.index_heads * width;
        if index_qk.cols != raw_start + width || k.rows != v.rows || k.rows != index_qk.rows {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "qsa_append: index projection {}×{} (expected {} columns), k {} rows, v {} rows",
                    index_qk.rows,
                    index_qk.cols,
                    raw_start + width,
                    k.rows,
                    v.rows
                ),
            });
        }
        for segment in segments.iter() {
            let cache = &*segment.state;
            let end = segment.start_position + segment.rows.len();
            check_segment_rows(&segment.rows, k.rows, "qsa_append")?;
            if end > cache.max_tokens {
                return Err(EngineError::ContextFull {
                    held: segment.start_position,
                    added: segment.rows.len(),
                    max_context: cache.max_tokens,
                });
            }
        }
        for segment in segments.iter_mut() {
            let cache = &mut *segment.state;
            // Appending at the start position: a cache that holds more is cut back first.
            cache.truncate(segment.start_position);
            if cache.tokens() != segment.start_position {
                return Err(EngineError::InvalidConfig {
                    problem: format!(
                        "qsa_append at position {} of a cache holding {} tokens",
                        segment.start_position,
                        cache.tokens()
                    ),
                });
            }
            for row in segment.rows.clone() {
                cache.push(
                    k.row(row),
                    v.row(row),
                    &index_qk.row(row)[raw_start..],
                    key_norm.parameter(),
                    settings,
                )?;
            }
        }
        Ok(())
    }

    /// [`Backend::qsa_index_queries`](crate::backend::Backend::qsa_index_queries) on the host.
    pub(super) fn qsa_index_queries_on_host(
        &self,
        index_qk: &CpuTensor,
        query_norm: &CpuWeight,
        settings: &QsaSelectionSettings,
        positions: &[usize],
    ) -> Result<CpuTensor, EngineError> {
        let width = settings.index_heads * settings.index_head_dim;
        if index_qk.cols < width
            || positions.len() != index_qk.rows
            || query_norm.parameter().len() != settings.index_head_dim
        {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "qsa_index_queries: projection {}×{}, {} positions, a query norm of {} for {} heads of {}",
                    index_qk.rows,
                    index_qk.cols,
                    positions.len(),
                    query_norm.parameter().len(),
                    settings.index_heads,
                    settings.index_head_dim
                ),
            });
        }
        let mut data = Vec::with_capacity(index_qk.rows * width);
        for (row, &position) in positions.iter().enumerate() {
            data.extend(prepare_index_query(
                &index_qk.row(row)[..width],
                query_norm.parameter(),
                position,
                settings,
            ));
        }
        Ok(CpuTensor {
            rows: index_qk.rows,
            cols: width,
            data,
        })
    }

    /// [`Backend::qsa_attention`](crate::backend::Backend::qsa_attention) on the host.
    pub(super) fn qsa_attention_on_host(
        &self,
        q: &CpuTensor,
        index_queries: &CpuTensor,
        spec: &AttentionSpec,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, HostQsaCache>],
    ) -> Result<CpuTensor, EngineError> {
        let width = spec.heads * spec.head_dim;
        if q.cols != width || q.rows != index_queries.rows || spec.kv_heads == 0 {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "qsa_attention: q {}×{} for {} heads of {}, {} index query rows",
                    q.rows, q.cols, spec.heads, spec.head_dim, index_queries.rows
                ),
            });
        }
        let shape = AttendShape {
            heads: spec.heads,
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
        };
        let mut out = CpuTensor::zeros(q.rows, width);
        for segment in segments.iter() {
            check_segment_rows(&segment.rows, q.rows, "qsa_attention")?;
            let cache = &*segment.state;
            for (offset, row) in segment.rows.clone().enumerate() {
                let position = segment.start_position + offset;
                let selected = cache.select(index_queries.row(row), position, settings)?;
                cache.attend(q.row(row), &selected, shape, out.row_mut(row));
            }
        }
        Ok(out)
    }

    /// [`Backend::qsa_selected_tokens`](crate::backend::Backend::qsa_selected_tokens) on the host.
    pub(super) fn qsa_selected_tokens_on_host(
        &self,
        index_queries: &CpuTensor,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, HostQsaCache>],
    ) -> Result<Vec<Vec<usize>>, EngineError> {
        let mut selected = vec![Vec::new(); index_queries.rows];
        for segment in segments.iter() {
            check_segment_rows(&segment.rows, index_queries.rows, "qsa_selected_tokens")?;
            for (offset, row) in segment.rows.clone().enumerate() {
                let position = segment.start_position + offset;
                let tokens = segment
                    .state
                    .select(index_queries.row(row), position, settings)?;
                if let Some(slot) = selected.get_mut(row) {
                    *slot = tokens;
                }
            }
        }
        Ok(selected)
    }
}
