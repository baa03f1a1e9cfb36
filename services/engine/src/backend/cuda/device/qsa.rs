//! QSA attention of qwen4_exp on the GPU (`kernels/qsa.cu`): the per-sequence QSA cache, the
//! append (keys and values in the backend's KV dtype, raw indexer keys in f32), the pooling of
//! each block once when it completes, the indexer queries (the fused norm + RoPE kernel of
//! `norm.cu`), the per-query block selection and the sparse attention.
//!
//! Owns: [`CudaQsaCache`], the row table the QSA kernels read (one entry per query row: its
//! cache buffers, position and batch row, so a decode batch of many sequences or a long prefill
//! is one launch per kernel), and the checks before the launches.
//! Must not touch: the selection math (the host reference is `backend/qsa_host.rs` and
//! `model/qwen4_exp/qsa_selection.rs`, which the op tests hold these kernels to).
//!
//! The per-call row table and pooling jobs are small host uploads queued on the stream (no
//! synchronisation), so these ops cannot run inside a recorded step graph: they refuse to.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{
    elementwise, int, CudaBackend, CudaKvCache, CudaTensor, CudaWeight, KvBuffer, KvDtype,
};
use crate::backend::cuda::CudaError;
use crate::backend::{AttentionSpec, NormStyle, Rotation, Segment};
use crate::model::qwen4_exp::qsa_selection::QsaSelectionSettings;

/// `QSA_ROW_WORDS` in `kernels/qsa.cu`: words of a row table entry (keys, values, raw keys,
/// pooled keys, position, batch row).
const ROW_WORDS: usize = 6;
/// `QSA_POOL_THREADS` and `QSA_MAX_INDEX_DIM` in `kernels/qsa.cu`.
const POOL_THREADS: u32 = 128;
const MAX_INDEX_DIM: usize = 256;
/// `QSA_SELECT_THREADS` and `QSA_SHARED_PAIRS` in `kernels/qsa.cu`.
const SELECT_THREADS: u32 = 256;
const SHARED_PAIRS: usize = 5632;
/// Bytes of a (value, index) pair of the selection.
const PAIR_BYTES: usize = 8;
/// `QSA_ATTEND_WARPS · 32` and `32 · QSA_MAX_DIMS_PER_LANE` in `kernels/qsa.cu`.
const ATTEND_THREADS: u32 = 128;
const MAX_HEAD_DIM: usize = 256;
/// The most selection workspace floats one launch takes (256 MiB).
const SELECT_WORKSPACE_FLOATS: usize = 64 << 20;
/// Pooled blocks per CUDA block of the score launch (about 16 per warp).
const SCORE_BLOCKS_PER_SPLIT: usize = 128;
/// Attention blocks a decode batch's launch aims at (a few per SM of a large GPU).
const ATTEND_TARGET_BLOCKS: usize = 1024;
/// The fewest attended tokens a split of the attention takes.
const ATTEND_MIN_TOKENS_PER_SPLIT: usize = 64;
/// Grid limits of the y and z dimensions.
const MAX_GRID_Y: usize = 65535;
const MAX_GRID_Z: usize = 65535;

/// Tokens a query row at `position` attends to: every visible token in the dense regime, else
/// the kept blocks' tokens and the tail after the last complete block.
fn attended_tokens(position: usize, settings: &QsaSelectionSettings) -> usize {
    let visible = position + 1;
    let ratio = settings.compress_ratio.max(1);
    let complete = visible / ratio;
    let top = settings.top_blocks();
    if complete <= top {
        visible
    } else {
        top * ratio + (visible - complete * ratio)
    }
}

/// One QSA attention layer of one sequence on the GPU: keys and values as an ordinary KV cache
/// (the backend's KV dtype, GPU memory or the host KV pool), all raw indexer keys in f32 (a
/// truncation into a completed block pools it again from them) and one pooled key per
/// completed block.
pub struct CudaQsaCache {
    kv: CudaKvCache,
    /// `[max_tokens, Di]` f32.
    raw: CudaSlice<f32>,
    /// `[max_tokens / ratio, Di]` f32; block `j` valid once `tokens ≥ (j + 1)·ratio`.
    pooled: CudaSlice<f32>,
    tokens: usize,
    compress_ratio: usize,
    index_head_dim: usize,
}

impl CudaQsaCache {
    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Positions the cache has room for.
    pub fn max_tokens(&self) -> usize {
        self.kv.max_tokens
    }

    /// Cuts back to `tokens` (positions are passed with every op, so this is bookkeeping only:
    /// a block that lost a token is pooled again when it completes again).
    pub(super) fn truncate(&mut self, tokens: usize) {
        self.tokens = self.tokens.min(tokens);
        self.kv.len = self.kv.len.min(tokens);
    }

    /// Bytes the cache takes on the GPU (KV, raw and pooled keys).
    pub fn device_bytes(&self) -> usize {
        self.kv.device_bytes() + (self.raw.len() + self.pooled.len()) * 4
    }
}

/// Where one row of a QSA launch reads and writes.
struct RowEntry {
    position: usize,
}

impl CudaBackend {
    /// An empty QSA cache for `max_tokens` positions.
    pub(super) fn allocate_qsa_cache(
        &self,
        max_tokens: usize,
        kv_width: usize,
        settings: &QsaSelectionSettings,
    ) -> Result<CudaQsaCache, CudaError> {
        settings.validate().map_err(|error| CudaError::Invalid {
            problem: error.to_string(),
        })?;
        let width = settings.index_head_dim;
        if width == 0 || width > MAX_INDEX_DIM {
            return Err(CudaError::Unsupported {
                problem: format!(
                    "QSA indexer_head_dim {width}: the kernels take 1 to {MAX_INDEX_DIM}"
                ),
            });
        }
        let kv = self.allocate_kv_cache(max_tokens, kv_width)?;
        let blocks = max_tokens / settings.compress_ratio;
        Ok(CudaQsaCache {
            kv,
            raw: self.alloc(max_tokens * width)?,
            pooled: self.alloc(blocks * width)?,
            tokens: 0,
            compress_ratio: settings.compress_ratio,
            index_head_dim: width,
        })
    }

    /// [`Backend::copy_qsa_rows`](crate::backend::Backend::copy_qsa_rows) on the GPU: the KV,
    /// raw-key and pooled-key rows of `from` appended to `target` at `to`.
    pub(super) fn copy_qsa_rows_on(
        &self,
        source: &CudaQsaCache,
        from: std::ops::Range<usize>,
        target: &mut CudaQsaCache,
        to: usize,
    ) -> Result<(), CudaError> {
        let ratio = target.compress_ratio;
        let width = target.index_head_dim;
        if source.compress_ratio != ratio
            || source.index_head_dim != width
            || to != target.tokens
            || from.end > source.tokens
            || from.start % ratio != 0
            || to % ratio != 0
        {
            return Err(CudaError::Invalid {
                problem: format!(
                    "QSA copy of positions {from:?} of a cache holding {} tokens to position {to} of one holding {} (ratio {ratio})",
                    source.tokens, target.tokens
                ),
            });
        }
        let end = to + from.len();
        self.copy_kv_rows_on(&source.kv, from.clone(), &mut target.kv, to)?;
        self.copy_range(
            &source.raw,
            from.start * width..from.end * width,
            &mut target.raw,
            to * width..end * width,
        )?;
        let blocks = from.start / ratio..from.end / ratio;
        let first = to / ratio;
        self.copy_range(
            &source.pooled,
            blocks.start * width..blocks.end * width,
            &mut target.pooled,
            first * width..(first + blocks.len()) * width,
        )?;
        target.tokens = end;
        Ok(())
    }

    /// Refuses a call inside a step graph (the row table is a per-call upload).
    fn refuse_step_graph(&self, op: &str) -> Result<(), CudaError> {
        if self.active_step_graph().is_some() {
            return Err(CudaError::Invalid {
                problem: format!("{op} cannot run inside a step graph"),
            });
        }
        Ok(())
    }

    /// The row table of `segments` (rows in segment order) and the KV dtype they share;
    /// `appended`: the rows are being appended now (else their keys must be held already).
    fn qsa_row_table(
        &self,
        segments: &mut [Segment<'_, CudaQsaCache>],
        tensor_rows: usize,
        settings: &QsaSelectionSettings,
        appended: bool,
        op: &str,
    ) -> Result<(CudaSlice<u64>, Vec<RowEntry>, KvDtype), CudaError> {
        let invalid = |problem: String| CudaError::Invalid {
            problem: format!("{op}: {problem}"),
        };
        let mut table: Vec<u64> = Vec::new();
        let mut rows = Vec::new();
        let mut dtype = None;
        for segment in segments.iter_mut() {
            let (start, n) = (segment.start_position, segment.rows.len());
            if segment.rows.end > tensor_rows {
                return Err(invalid(format!(
                    "segment rows {:?} of a {tensor_rows}-row tensor",
                    segment.rows
                )));
            }
            let cache = &mut *segment.state;
            if cache.compress_ratio != settings.compress_ratio
                || cache.index_head_dim != settings.index_head_dim
            {
                return Err(invalid(
                    "a QSA cache made for other indexer settings".to_string(),
                ));
            }
            if start + n > cache.kv.max_tokens {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "{op}: the context is full ({start} tokens held, {n} added, room for {})",
                        cache.kv.max_tokens
                    ),
                });
            }
            let held = if appended { start } else { start + n };
            if held > cache.tokens {
                return Err(invalid(format!(
                    "rows at positions {start}..{} of a cache holding {} tokens",
                    start + n,
                    cache.tokens
                )));
            }
            if *dtype.get_or_insert(cache.kv.dtype) != cache.kv.dtype {
                return Err(invalid("caches of different KV dtypes in one batch".into()));
            }
            let (keys, values) = match (&mut *cache.kv.keys, &mut *cache.kv.values) {
                (KvBuffer::F32(keys), KvBuffer::F32(values)) => (
                    keys.device_ptr_mut(&self.stream).0,
                    values.device_ptr_mut(&self.stream).0,
                ),
                (KvBuffer::Bf16(keys), KvBuffer::Bf16(values)) => (
                    keys.device_ptr_mut(&self.stream).0,
                    values.device_ptr_mut(&self.stream).0,
                ),
                _ => {
                    return Err(invalid(
                        "keys and values of one cache differ in dtype".into(),
                    ))
                }
            };
            let raw = cache.raw.device_ptr_mut(&self.stream).0;
            let pooled = cache.pooled.device_ptr_mut(&self.stream).0;
            for (offset, row) in segment.rows.clone().enumerate() {
                let position = start + offset;
                let entry: [u64; ROW_WORDS] =
                    [keys, values, raw, pooled, position as u64, row as u64];
                table.extend(entry);
                rows.push(RowEntry { position });
            }
        }
        let dtype = dtype.unwrap_or(self.options.kv_dtype);
        let uploaded = self
            .stream
            .memcpy_stod(if table.is_empty() {
                &[0u64][..]
            } else {
                &table
            })
            .map_err(super::driver_error("copying the QSA row table to the GPU"))?;
        Ok((uploaded, rows, dtype))
    }

    /// [`Backend::qsa_append`](crate::backend::Backend::qsa_append): one launch appends every
    /// row, one more pools every block the rows complete.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_qsa_append(
        &self,
        k: &CudaTensor,
        v: &CudaTensor,
        index_qk: &CudaTensor,
        key_norm: &CudaWeight,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, CudaQsaCache>],
    ) -> Result<(), CudaError> {
        self.refuse_step_graph("qsa_append")?;
        let width = settings.index_head_dim;
        let raw_start = settings.index_heads * width;
        let key_norm = key_norm.f32()?;
        if index_qk.cols != raw_start + width
            || k.rows != v.rows
            || k.cols != v.cols
            || k.rows != index_qk.rows
            || key_norm.len() != width
        {
            return Err(CudaError::Invalid {
                problem: format!(
                    "qsa_append: index projection {}×{} (expected {} columns), k {}×{}, v {}×{}, key norm of {}",
                    index_qk.rows,
                    index_qk.cols,
                    raw_start + width,
                    k.rows,
                    k.cols,
                    v.rows,
                    v.cols,
                    key_norm.len()
                ),
            });
        }
        for segment in segments.iter() {
            if segment.state.kv.kv_width != k.cols {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "qsa_append: k of {} columns into a cache of {}",
                        k.cols, segment.state.kv.kv_width
                    ),
                });
            }
        }
        let (table, rows, dtype) =
            self.qsa_row_table(segments, k.rows, settings, true, "qsa_append")?;
        if rows.is_empty() {
            return Ok(());
        }
        let total = rows.len() * (k.cols + width);
        let (row_count, kv_width, index_cols, raw_start_arg, width_arg) = (
            int(rows.len(), "rows")?,
            int(k.cols, "kv width")?,
            int(index_qk.cols, "index columns")?,
            int(raw_start, "raw key column")?,
            int(width, "indexer head dim")?,
        );
        let (k_data, v_data, qk_data) = (&*k.data, &*v.data, &*index_qk.data);
        match dtype {
            KvDtype::F32 => launch!(self, "qsa_append", elementwise(total);
                k_data, v_data, qk_data, &table, &row_count, &kv_width, &index_cols,
                &raw_start_arg, &width_arg)?,
            KvDtype::Bf16 => launch!(self, "qsa_append_bf16", elementwise(total);
                k_data, v_data, qk_data, &table, &row_count, &kv_width, &index_cols,
                &raw_start_arg, &width_arg)?,
        }
        // The blocks these rows complete, pooled once each.
        let ratio = settings.compress_ratio;
        let mut jobs: Vec<u64> = Vec::new();
        for segment in segments.iter_mut() {
            let (start, end) = (
                segment.start_position,
                segment.start_position + segment.rows.len(),
            );
            let cache = &mut *segment.state;
            let raw = cache.raw.device_ptr(&self.stream).0;
            let pooled = cache.pooled.device_ptr_mut(&self.stream).0;
            for block in start / ratio..end / ratio {
                jobs.extend([raw, pooled, block as u64]);
            }
            cache.tokens = end;
            cache.kv.len = end;
        }
        if jobs.is_empty() {
            return Ok(());
        }
        let job_count = jobs.len() / 3;
        let jobs = self.stream.memcpy_stod(&jobs).map_err(super::driver_error(
            "copying the QSA pooling jobs to the GPU",
        ))?;
        let (job_arg, ratio_arg, half, eps) = (
            int(job_count, "pooling jobs")?,
            int(ratio, "compress ratio")?,
            int(settings.rotary_dim / 2, "rotary half")?,
            settings.norm_eps,
        );
        let inverse = self.rope_inverse_table(settings.rotary_dim, settings.rope_theta)?;
        let config = LaunchConfig {
            grid_dim: (job_count.clamp(1, 1 << 16) as u32, 1, 1),
            block_dim: (POOL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "qsa_pool_blocks", config;
            &jobs, &job_arg, key_norm, &inverse, &ratio_arg, &width_arg, &half, &eps)
    }

    /// [`Backend::qsa_index_queries`](crate::backend::Backend::qsa_index_queries): the query
    /// heads' columns, then the fused zero-centred norm + RoPE per indexer head.
    pub(super) fn launch_qsa_index_queries(
        &self,
        index_qk: &CudaTensor,
        query_norm: &CudaWeight,
        settings: &QsaSelectionSettings,
        positions: &[usize],
    ) -> Result<CudaTensor, CudaError> {
        let width = settings.index_heads * settings.index_head_dim;
        if index_qk.cols < width
            || positions.len() != index_qk.rows
            || query_norm.f32()?.len() != settings.index_head_dim
        {
            return Err(CudaError::Invalid {
                problem: format!(
                    "qsa_index_queries: projection {}×{}, {} positions, a query norm of {} for {} heads of {}",
                    index_qk.rows,
                    index_qk.cols,
                    positions.len(),
                    query_norm.f32()?.len(),
                    settings.index_heads,
                    settings.index_head_dim
                ),
            });
        }
        let heads = self.launch_columns(index_qk, 0..width)?;
        let rotation = Rotation {
            positions,
            head_dim: settings.index_head_dim,
            rotary_dim: settings.rotary_dim,
            theta: settings.rope_theta,
            multimodal: None,
        };
        self.launch_rms_norm_rope(
            &heads,
            query_norm,
            settings.norm_eps,
            NormStyle::ZeroCentred,
            &rotation,
        )
    }

    /// The selection launch: `[rows, top]` block indices (i32 bits in an f32 buffer) for the
    /// rows past the dense regime; nothing is launched when every row is dense.
    fn launch_qsa_select(
        &self,
        index_queries: &CudaTensor,
        table: &CudaSlice<u64>,
        rows: &[RowEntry],
        settings: &QsaSelectionSettings,
    ) -> Result<CudaTensor, CudaError> {
        let top = settings.top_blocks();
        let width = settings.index_head_dim;
        if index_queries.cols != settings.index_heads * width {
            return Err(CudaError::Invalid {
                problem: format!(
                    "qsa_select: index queries of {} columns for {} heads of {width}",
                    index_queries.cols, settings.index_heads
                ),
            });
        }
        // Never read for dense rows: left as it comes.
        let mut selected = self.output_uninit(rows.len(), top)?;
        let most_blocks = rows
            .iter()
            .map(|row| (row.position + 1) / settings.compress_ratio)
            .max()
            .unwrap_or(0);
        if most_blocks <= top {
            return Ok(selected);
        }
        let _timer = self.op_timer_by_rows("qsa_select", rows.len());
        // Per row: the scores, then as many (value, index) pairs; an even stride keeps the
        // pairs 8-byte aligned. Rows go in launches whose workspace stays under
        // SELECT_WORKSPACE_FLOATS (a 64K-token prompt would otherwise want gigabytes).
        let stride = most_blocks.next_multiple_of(2);
        let rows_per_launch = (SELECT_WORKSPACE_FLOATS / (3 * stride)).clamp(1, rows.len());
        let mut workspace = self.output_uninit(rows_per_launch, 3 * stride)?;
        let (stride_arg, heads, width_arg, ratio, top_arg) = (
            int(stride, "selection stride")?,
            int(settings.index_heads, "indexer heads")?,
            int(width, "indexer head dim")?,
            int(settings.compress_ratio, "compress ratio")?,
            int(top, "kept blocks")?,
        );
        int(rows_per_launch * 3 * stride, "selection workspace")?;
        // The score launch spreads a row's blocks over enough CUDA blocks for about
        // SCORE_BLOCKS_PER_SPLIT each (8 warps, one pooled block per warp at a time).
        let splits = most_blocks
            .div_ceil(SCORE_BLOCKS_PER_SPLIT)
            .clamp(1, MAX_GRID_Y);
        // The tie-break's pairs in shared memory when every row's blocks fit.
        let shared_pairs = if stride <= SHARED_PAIRS { stride } else { 0 };
        let shared_pairs_arg = int(shared_pairs, "shared pairs")?;
        let queries = &*index_queries.data;
        let selected_data = &mut *selected.data;
        let workspace_data = &mut *workspace.data;
        for first in (0..rows.len()).step_by(rows_per_launch) {
            let count = rows_per_launch.min(rows.len() - first);
            let (first_arg, count_arg) = (int(first, "first row")?, int(count, "rows")?);
            let grid_rows = u32::try_from(count).map_err(|_| CudaError::Invalid {
                problem: format!("qsa_select: {count} rows in one launch"),
            })?;
            let score_config = LaunchConfig {
                grid_dim: (grid_rows, splits as u32, 1),
                block_dim: (SELECT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self, "qsa_score_blocks", score_config;
                queries, table, &first_arg, &count_arg, &mut *workspace_data, &stride_arg,
                &heads, &width_arg, &ratio, &top_arg)?;
            let select_config = LaunchConfig {
                grid_dim: (grid_rows, 1, 1),
                block_dim: (SELECT_THREADS, 1, 1),
                shared_mem_bytes: (shared_pairs * PAIR_BYTES) as u32,
            };
            launch!(self, "qsa_select", select_config;
                table, &first_arg, &count_arg, &mut *selected_data, &mut *workspace_data,
                &stride_arg, &ratio, &top_arg, &shared_pairs_arg)?;
        }
        Ok(selected)
    }

    fn check_qsa_attention_shape(
        q: &CudaTensor,
        spec: &AttentionSpec,
        index_queries: &CudaTensor,
    ) -> Result<(), CudaError> {
        let hd = spec.head_dim;
        if hd == 0
            || hd > MAX_HEAD_DIM
            || spec.kv_heads == 0
            || spec.heads % spec.kv_heads != 0
            || q.cols != spec.heads * hd
            || q.rows != index_queries.rows
        {
            return Err(CudaError::Invalid {
                problem: format!(
                    "qsa_attention: q {}×{} for {} heads of {hd} (at most {MAX_HEAD_DIM}) over {} kv heads, {} index query rows",
                    q.rows, q.cols, spec.heads, spec.kv_heads, index_queries.rows
                ),
            });
        }
        Ok(())
    }

    /// [`Backend::qsa_attention`](crate::backend::Backend::qsa_attention): the selection, then
    /// one attention launch over every (row, head).
    pub(super) fn launch_qsa_attention(
        &self,
        q: &CudaTensor,
        index_queries: &CudaTensor,
        spec: &AttentionSpec,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, CudaQsaCache>],
    ) -> Result<CudaTensor, CudaError> {
        self.refuse_step_graph("qsa_attention")?;
        Self::check_qsa_attention_shape(q, spec, index_queries)?;
        for segment in segments.iter() {
            if segment.state.kv.kv_width != spec.kv_heads * spec.head_dim {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "qsa_attention: {} kv heads of {} over a cache of width {}",
                        spec.kv_heads, spec.head_dim, segment.state.kv.kv_width
                    ),
                });
            }
        }
        let (table, rows, dtype) =
            self.qsa_row_table(segments, q.rows, settings, false, "qsa_attention")?;
        // Rows outside every segment stay zero.
        let mut out = self.output(q.rows, spec.heads * spec.head_dim)?;
        if rows.is_empty() {
            return Ok(out);
        }
        let selected = self.launch_qsa_select(index_queries, &table, &rows, settings)?;
        let _timer = self.op_timer_by_rows("qsa_attend", rows.len());
        let (heads, kv_heads, hd, ratio, top) = (
            int(spec.heads, "heads")?,
            int(spec.kv_heads, "kv heads")?,
            int(spec.head_dim, "head_dim")?,
            int(settings.compress_ratio, "compress ratio")?,
            int(settings.top_blocks(), "kept blocks")?,
        );
        let scale = 1.0 / (spec.head_dim as f32).sqrt();
        let grid_rows = u32::try_from(rows.len()).map_err(|_| CudaError::Invalid {
            problem: format!("qsa_attention: {} rows", rows.len()),
        })?;
        // A decode batch has few (row, head) pairs: the tokens are split over more blocks
        // (merged by `qsa_attend_merge`) until about ATTEND_TARGET_BLOCKS run, each split
        // keeping at least ATTEND_MIN_TOKENS_PER_SPLIT tokens. A prefill fills the GPU without.
        let most_tokens = rows
            .iter()
            .map(|row| attended_tokens(row.position, settings))
            .max()
            .unwrap_or(0);
        let pairs = rows.len() * spec.heads;
        let splits = ATTEND_TARGET_BLOCKS
            .div_ceil(pairs.max(1))
            .min(most_tokens.div_ceil(ATTEND_MIN_TOKENS_PER_SPLIT))
            .clamp(1, MAX_GRID_Z);
        let splits_arg = int(splits, "attention splits")?;
        let config = LaunchConfig {
            grid_dim: (grid_rows, spec.heads as u32, splits as u32),
            block_dim: (ATTEND_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // One float when unused (the kernel never reads it then).
        let mut partial = self.output_uninit(
            1,
            if splits > 1 {
                pairs * splits * (spec.head_dim + 2)
            } else {
                1
            },
        )?;
        let (q_data, selected_data) = (&*q.data, &*selected.data);
        let (output, partial_data) = (&mut *out.data, &mut *partial.data);
        match dtype {
            KvDtype::F32 => launch!(self, "qsa_attend", config;
                q_data, &table, selected_data, &mut *output, &heads, &kv_heads, &hd, &ratio,
                &top, &scale, &splits_arg, &mut *partial_data)?,
            KvDtype::Bf16 => launch!(self, "qsa_attend_bf16", config;
                q_data, &table, selected_data, &mut *output, &heads, &kv_heads, &hd, &ratio,
                &top, &scale, &splits_arg, &mut *partial_data)?,
        }
        if splits > 1 {
            let merge_config = LaunchConfig {
                grid_dim: (grid_rows, spec.heads as u32, 1),
                block_dim: (ATTEND_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self, "qsa_attend_merge", merge_config;
                &table, &*partial_data, output, &heads, &hd, &splits_arg)?;
        }
        Ok(out)
    }

    /// [`Backend::qsa_selected_tokens`](crate::backend::Backend::qsa_selected_tokens): the
    /// selection launch, read back and spelled out as tokens as the attention kernel walks them.
    pub(super) fn qsa_selected_tokens_on_device(
        &self,
        index_queries: &CudaTensor,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, CudaQsaCache>],
    ) -> Result<Vec<Vec<usize>>, CudaError> {
        self.refuse_step_graph("qsa_selected_tokens")?;
        let rows_in_tensor = index_queries.rows;
        let (table, rows, _) = self.qsa_row_table(
            segments,
            rows_in_tensor,
            settings,
            false,
            "qsa_selected_tokens",
        )?;
        let batch_rows: Vec<usize> = segments
            .iter()
            .flat_map(|segment| segment.rows.clone())
            .collect();
        let selected = self.launch_qsa_select(index_queries, &table, &rows, settings)?;
        let bits = self.download_values(&selected)?;
        let (ratio, top) = (settings.compress_ratio, settings.top_blocks());
        let mut tokens = vec![Vec::new(); rows_in_tensor];
        for (entry, (row, batch_row)) in rows.iter().zip(batch_rows).enumerate() {
            let visible = row.position + 1;
            let complete = visible / ratio;
            let list = if complete <= top {
                (0..visible).collect()
            } else {
                let mut list = Vec::with_capacity(top * ratio + ratio);
                for &word in &bits[entry * top..(entry + 1) * top] {
                    let block = word.to_bits() as i32;
                    let block = usize::try_from(block)
                        .ok()
                        .filter(|&block| block < complete)
                        .ok_or_else(|| CudaError::Invalid {
                            problem: format!(
                                "qsa_select chose block {block} of {complete} for position {}",
                                row.position
                            ),
                        })?;
                    list.extend(block * ratio..(block + 1) * ratio);
                }
                list.extend(complete * ratio..visible);
                list
            };
            if let Some(slot) = tokens.get_mut(batch_row) {
                *slot = list;
            }
        }
        Ok(tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::kernel_define;

    #[test]
    fn constants_match_the_kernels() {
        let mirrored = [
            (ROW_WORDS as i64, "QSA_ROW_WORDS"),
            (i64::from(POOL_THREADS), "QSA_POOL_THREADS"),
            (MAX_INDEX_DIM as i64, "QSA_MAX_INDEX_DIM"),
            (i64::from(SELECT_THREADS), "QSA_SELECT_THREADS"),
            (SHARED_PAIRS as i64, "QSA_SHARED_PAIRS"),
            (i64::from(ATTEND_THREADS / 32), "QSA_ATTEND_WARPS"),
            ((MAX_HEAD_DIM / 32) as i64, "QSA_MAX_DIMS_PER_LANE"),
        ];
        for (value, name) in mirrored {
            assert_eq!(value, kernel_define("qsa", name), "{name}");
        }
    }

    /// The pairs of the tie-break and the kernel's static shared arrays fit the 48 KiB a
    /// launch gets without opting in.
    #[test]
    fn the_selection_fits_the_default_shared_memory() {
        let static_bytes = 4 * 256 + 3 * 4 + 4 * (SELECT_THREADS as usize / 32) + 4;
        assert!(SHARED_PAIRS * PAIR_BYTES + static_bytes <= 48 * 1024);
    }

    #[test]
    fn attended_tokens_are_the_dense_context_then_budget_plus_tail() {
        let settings = QsaSelectionSettings {
            budget: 16,
            compress_ratio: 4,
            index_heads: 1,
            index_head_dim: 32,
            rotary_dim: 16,
            rope_theta: 1e4,
            norm_eps: 1e-6,
        };
        // 16 / 4 = 4 kept blocks: dense while at most 4 blocks are complete (19 visible
        // tokens), then 16 kept tokens and a tail of 0 to 3.
        assert_eq!(attended_tokens(0, &settings), 1);
        assert_eq!(attended_tokens(18, &settings), 19);
        assert_eq!(attended_tokens(19, &settings), 16);
        assert_eq!(attended_tokens(22, &settings), 19);
        assert_eq!(attended_tokens(1000, &settings), 16 + 1);
    }
}
