//! Attention on the GPU (`kernels/attention.cu`): the KV append, the choice between the reference
//! kernel and the "flash" kernels (split-K decode + combine, tiled prefill), their launches, and
//! the start-up self-check that holds the flash kernels to the reference.
//!
//! Owns: how a batch's segments map onto attention launches, the split workspace, and which
//! path is active ([`AttentionPath`], in [`DeviceInfo`](super::DeviceInfo)).
//! Must not touch: the model's use of attention (q/k/v projections, gating, RoPE).
//!
//! A decode batch (one-row segments of consecutive rows, `CudaOptions::batched_decode`) takes one
//! KV append, one split and one combine launch for all its sequences (up to
//! [`DECODE_BATCH_ROWS`] per launch; device/attention_batched.rs), each row reading its own cache
//! and position; every row gets the bits its own segment's launches give it. Over a bf16 cache,
//! the split launch is one of the group kernels where one serves the shape
//! (device/attention_decode.rs).
//!
//! Path per segment (flash): at most [`SPLIT_MAX_ROWS`] rows (decode, a few speculative rows) go
//! through split-K with a chunk size chosen from the segment's last position only; longer
//! segments (prefill) through the tiled kernel, or with [`AttentionPath::TensorCore`] (the
//! default options, after its own start-up check) through the tensor-core kernel when the cache
//! is bf16, head_dim is 64, 128 or 256 and the segment has at least [`MMA_MIN_ROWS`] rows. All
//! compute each row from its own keys in an
//! order fixed by absolute key positions, so a row's result never depends on the other
//! sequences of the batch (batch invariance, as the matmul kernel).

use cudarc::driver::LaunchConfig;

use super::self_checks::self_check_values;
use super::{
    driver_error, elementwise, int, CudaBackend, CudaKvCache, CudaTensor, KvBuffer, KvDtype,
};
use crate::backend::cuda::CudaError;
use crate::backend::{AttentionSpec, Segment};
use crate::error::EngineError;

/// Warps per block of `kernels/attention.cu`.
pub(super) const ATTENTION_WARPS: u32 = 4;
/// `32 * MAX_DIMS_PER_LANE` in `kernels/attention.cu`.
pub(super) const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// `SPLIT_THREADS` in `kernels/attention.cu`.
pub(super) const SPLIT_THREADS: u32 = 128;
/// `SPLIT_TILE`: keys staged and scored together (one per lane); chunks are multiples of it.
const SPLIT_TILE: usize = 32;
/// `SPLIT_HEADS`: q heads one split block serves.
pub(super) const SPLIT_HEADS: usize = 8;
/// Segments of at most this many rows take the split-K path (one block row per query row).
pub(super) const SPLIT_MAX_ROWS: usize = 8;
/// At most this many chunks per row (the chunk grows with the context beyond
/// `SPLIT_MAX_CHUNKS · SPLIT_TILE` keys, which bounds the workspace).
/// Decode is latency-bound, so a row's keys are cut into many small blocks: 4K keys still make
/// 128 one-tile chunks per kv head. `COMBINE_MAX_CHUNKS` in `kernels/attention.cu`.
pub(super) const SPLIT_MAX_CHUNKS: usize = 128;
/// At least this many tiles per chunk (`SPLIT_MIN_CHUNK_TILES` in
/// `kernels/attention_common.cuh`): longer chunks write and combine fewer partials at short
/// contexts, at the price of fewer blocks. The kernel bench times chunks of 1, 2 and 4 tiles.
const SPLIT_MIN_CHUNK_TILES: usize = 1;
/// `COMBINE_WARPS` in `kernels/attention.cu`: warps of a combine block (each sums a share of
/// the chunks for 32 of a head's dims).
pub(super) const COMBINE_WARPS: u32 = 8;
/// `TILE_THREADS`, `TILE_ROWS`, `TILE_KEYS` in `kernels/attention.cu`.
const TILE_THREADS: u32 = 128;
const TILE_ROWS: usize = 32;
const TILE_KEYS: usize = 32;
/// `DECODE_BATCH_ROWS` in `kernels/attention.cu`: one-row segments one batched decode launch
/// takes (their caches and positions travel as kernel parameters, [`DecodeRows`]).
pub(super) const DECODE_BATCH_ROWS: usize = 64;
/// Relative difference the self-check allows between the flash and reference kernels.
const SELF_CHECK_TOLERANCE: f32 = 1e-4;
/// `MMA_ROWS` (= `MMA_KEYS`), `MMA_THREADS` and `MMA_PAD` in `kernels/attention.cu`.
const MMA_ROWS: usize = 64;
const MMA_THREADS: u32 = 128;
const MMA_PAD: usize = 8;
/// Head dims with a tensor-core kernel (`attention_mma_{hd}`).
const MMA_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Segments of at least this many rows take the tensor-core kernel (shorter ones, the tiled
/// kernel: a block of `MMA_ROWS` rows would be mostly padding).
pub(super) const MMA_MIN_ROWS: usize = 16;
/// What the tensor-core kernel's start-up check allows (relative to the largest output): q and
/// the softmax weights are rounded to bf16 (relative error 2⁻⁹ each).
const MMA_SELF_CHECK_TOLERANCE: f32 = 1e-2;

/// Which attention kernels the backend runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionPath {
    /// Split-K decode + tiled prefill (the default once the start-up self-check passed).
    Flash,
    /// One warp per (row, head) over all keys: forced by `CudaOptions::reference_attention`,
    /// or the fallback when the flash kernels failed their self-check.
    Reference,
    /// As `Flash`, with prefill segments over a bf16 cache on the tensor-core kernel
    /// (`attention_mma_*`, see [`MMA_MIN_ROWS`]): the default options once it passed its own
    /// start-up check.
    TensorCore,
}

impl std::fmt::Display for AttentionPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AttentionPath::Flash => "flash",
            AttentionPath::Reference => "reference",
            AttentionPath::TensorCore => "tensor-core",
        })
    }
}

/// Keys per split chunk for a segment whose last row sits at `last_position`:
/// `SPLIT_MIN_CHUNK_TILES` tiles up to `SPLIT_MAX_CHUNKS` chunks of them, then as many tiles as
/// keep the chunk count at that bound.
pub(super) fn split_chunk(last_position: usize) -> usize {
    let tiles = (last_position + 1).div_ceil(SPLIT_TILE);
    tiles.div_ceil(SPLIT_MAX_CHUNKS).max(SPLIT_MIN_CHUNK_TILES) * SPLIT_TILE
}

/// Dynamic shared memory of a split block.
/// q, scores and statistics in f32, then the staged K and V tiles as 4-byte words with one
/// quad (rows of whole 16-byte quads) or one word of padding per row.
pub(super) fn split_smem_bytes(hd: usize, dtype: KvDtype) -> usize {
    // The kernel's row stride: whole 16-byte quads are padded by one quad, else by one word.
    let words = (hd * dtype.bytes()).div_ceil(4);
    let words_per_row = if words % 4 == 0 { words + 4 } else { words + 1 };
    (SPLIT_HEADS * hd + SPLIT_HEADS * SPLIT_TILE + 3 * SPLIT_HEADS + 2 * SPLIT_TILE * words_per_row)
        * 4
}

/// Dynamic shared memory of a tensor-core block: q, one K and one V tile of `MMA_ROWS` rows of
/// `hd + MMA_PAD` bf16.
fn mma_smem_bytes(hd: usize) -> usize {
    3 * MMA_ROWS * (hd + MMA_PAD) * 2
}

/// Dynamic shared memory of a tiled block.
fn tiled_smem_bytes(hd: usize) -> usize {
    (TILE_ROWS * hd + TILE_KEYS * (hd + 1) + TILE_ROWS * TILE_KEYS) * 4
}

/// A self-check case: (heads, kv_heads, head_dim, prefill lengths of two sequences, window).
type CheckCase = (usize, usize, usize, [usize; 2], Option<usize>);

/// The self-check's cases; every head_dim has a tensor-core kernel.
const CHECK_CASES: [CheckCase; 3] = [
    (8, 2, 128, [37, 700], None),
    (16, 2, 256, [70, 1], None),
    (4, 1, 64, [300, 9], Some(100)),
];

/// Whether `segments` are one-row segments of consecutive rows in order (a decode batch), every
/// cache of one dtype and width, which the batched decode kernels take in one launch each.
fn one_row_segments_in_order(segments: &[Segment<'_, CudaKvCache>], hd: usize) -> bool {
    let Some(first) = segments.first() else {
        return false;
    };
    let (dtype, width) = (first.state.dtype, first.state.kv_width);
    // The split kernel stages whole 4-byte words: a bf16 row needs an even head_dim.
    let whole_words = dtype == KvDtype::F32 || hd % 2 == 0;
    whole_words
        && segments.iter().enumerate().all(|(index, segment)| {
            segment.rows.len() == 1
                && segment.rows.start == first.rows.start + index
                && segment.state.dtype == dtype
                && segment.state.kv_width == width
        })
}

/// Where one split segment's partials sit in the workspace.
struct SplitPlan {
    chunk: usize,
    chunks: usize,
    part_base: usize,
}

impl CudaBackend {
    /// An empty K/V cache in the backend's [`KvDtype`]: in GPU memory, or in the host KV pool
    /// once the device share is used up (device/host_kv.rs).
    pub(super) fn allocate_kv_cache(
        &self,
        max_tokens: usize,
        kv_width: usize,
    ) -> Result<CudaKvCache, CudaError> {
        let placement = match self.place_kv_cache(max_tokens, kv_width)? {
            super::host_kv::KvPlace::Host(cache) => return Ok(cache),
            super::host_kv::KvPlace::Device(placement) => placement,
        };
        let mut cache = self.kv_cache_of(self.options.kv_dtype, max_tokens, kv_width)?;
        cache.placement = placement;
        Ok(cache)
    }

    /// Picks the attention path at start-up: allows the tiled kernels their shared memory, then
    /// (unless the options force the reference) runs the self-check; any failure is logged and
    /// leaves the reference kernel for the life of the process.
    pub(super) fn start_attention(&self) -> AttentionPath {
        if let Err(error) = self.allow_tiled_shared_memory() {
            tracing::warn!(
                "flash attention unusable, the reference kernel does all attention: {error}"
            );
            return AttentionPath::Reference;
        }
        if self.options.reference_attention {
            tracing::info!("attention: the reference kernel (forced by the options)");
            return AttentionPath::Reference;
        }
        match self.check_against_reference(
            AttentionPath::Flash,
            &[KvDtype::F32, KvDtype::Bf16],
            SELF_CHECK_TOLERANCE,
        ) {
            Ok(worst) => {
                tracing::info!(
                    "flash attention passed its start-up check (max |Δ| / scale {worst:.1e} vs the reference kernel)"
                );
                self.start_tensor_core_attention()
            }
            Err(error) => {
                tracing::warn!(
                    "flash attention failed its start-up check, the reference kernel does all attention: {error}"
                );
                let _ = self.stream.synchronize();
                AttentionPath::Reference
            }
        }
    }

    /// `TensorCore` when the options ask for it, the GPU gives the kernels their shared memory
    /// and they pass their check against the reference (bf16 cache), else `Flash`.
    fn start_tensor_core_attention(&self) -> AttentionPath {
        if !self.options.tensor_core_prefill {
            return AttentionPath::Flash;
        }
        let limit = self.info.shared_memory_per_block;
        for hd in MMA_HEAD_DIMS {
            let bytes = mma_smem_bytes(hd);
            if bytes > limit {
                tracing::info!(
                    "tensor-core prefill attention: head_dim {hd} needs {bytes} bytes of shared memory per block, the limit is {limit}; the tiled kernel does its prefill"
                );
            }
        }
        if !MMA_HEAD_DIMS.iter().any(|&hd| self.mma_fits(hd)) {
            return AttentionPath::Flash;
        }
        let allowed = MMA_HEAD_DIMS
            .iter()
            .filter(|&&hd| self.mma_fits(hd))
            .try_for_each(|&hd| {
                self.allow_shared_memory(&format!("attention_mma_{hd}"), mma_smem_bytes(hd))
            });
        let allowed = allowed.and_then(|()| self.allow_tensor_core_decode_shared_memory());
        let checked = allowed.and_then(|()| {
            self.check_against_reference(
                AttentionPath::TensorCore,
                &[KvDtype::Bf16],
                MMA_SELF_CHECK_TOLERANCE,
            )
        });
        match checked {
            Ok(worst) => {
                tracing::info!(
                    "tensor-core prefill attention passed its start-up check (max |Δ| / scale {worst:.1e} vs the reference kernel)"
                );
                AttentionPath::TensorCore
            }
            Err(error) => {
                tracing::warn!(
                    "tensor-core prefill attention unusable, the tiled kernel does prefill: {error}"
                );
                let _ = self.stream.synchronize();
                AttentionPath::Flash
            }
        }
    }

    /// Whether the tensor-core kernel of `hd` fits this backend's shared memory per block.
    fn mma_fits(&self, hd: usize) -> bool {
        MMA_HEAD_DIMS.contains(&hd) && mma_smem_bytes(hd) <= self.info.shared_memory_per_block
    }

    /// `attention_mma_{hd}`.
    fn mma_function(&self, hd: usize) -> Result<&super::launch::Kernel, CudaError> {
        match hd {
            64 => self.function("attention_mma_64"),
            128 => self.function("attention_mma_128"),
            256 => self.function("attention_mma_256"),
            _ => Err(CudaError::Invalid {
                problem: format!("no tensor-core attention kernel for head_dim {hd}"),
            }),
        }
    }

    /// The tiled kernels, and the split kernel over an f32 cache, need more than the default
    /// 48 KiB of dynamic shared memory at head_dim 256.
    fn allow_tiled_shared_memory(&self) -> Result<(), CudaError> {
        let tiled = tiled_smem_bytes(ATTENTION_MAX_HEAD_DIM);
        for (name, bytes) in [
            ("attention_tiled", tiled),
            ("attention_tiled_bf16", tiled),
            (
                "attention_split",
                split_smem_bytes(ATTENTION_MAX_HEAD_DIM, KvDtype::F32),
            ),
            (
                "attention_split_bf16",
                split_smem_bytes(ATTENTION_MAX_HEAD_DIM, KvDtype::Bf16),
            ),
            (
                "attention_split_batched",
                split_smem_bytes(ATTENTION_MAX_HEAD_DIM, KvDtype::F32),
            ),
            (
                "attention_split_batched_bf16",
                split_smem_bytes(ATTENTION_MAX_HEAD_DIM, KvDtype::Bf16),
            ),
        ] {
            if bytes > self.info.shared_memory_per_block {
                return Err(CudaError::Unsupported {
                    problem: format!(
                        "`{name}` needs {bytes} bytes of shared memory per block at head_dim {ATTENTION_MAX_HEAD_DIM}; the limit is {}",
                        self.info.shared_memory_per_block
                    ),
                });
            }
            self.allow_shared_memory(name, bytes)?;
        }
        Ok(())
    }

    /// Two sequences (a 37-row and a 700-row prefill, then one decode step each) at GQA 4,
    /// head_dim 128, and a short one at GQA 8, head_dim 256, with the caches of `dtypes`,
    /// through `path` and the reference kernel: the largest difference relative to the largest
    /// output must stay under `tolerance`.
    fn check_against_reference(
        &self,
        path: AttentionPath,
        dtypes: &[KvDtype],
        tolerance: f32,
    ) -> Result<f32, CudaError> {
        let mut next = self_check_values(0x2545_f491_4f6c_dd1d);
        let mut worst = 0.0f32;
        for (heads, kv_heads, hd, lengths, window) in CHECK_CASES {
            let spec = AttentionSpec {
                heads,
                kv_heads,
                head_dim: hd,
                sliding_window: window,
            };
            let kv_width = kv_heads * hd;
            let max_tokens = lengths[0].max(lengths[1]) + 1;
            for &dtype in dtypes {
                let mut flash = [
                    self.kv_cache_of(dtype, max_tokens, kv_width)?,
                    self.kv_cache_of(dtype, max_tokens, kv_width)?,
                ];
                let mut reference = [
                    self.kv_cache_of(dtype, max_tokens, kv_width)?,
                    self.kv_cache_of(dtype, max_tokens, kv_width)?,
                ];
                let mut positions = [0usize; 2];
                for step in 0..2 {
                    let new = if step == 0 { lengths } else { [1, 1] };
                    let total = new[0] + new[1];
                    let mut tensor = |cols: usize| -> Result<CudaTensor, CudaError> {
                        let values: Vec<f32> = (0..total * cols).map(|_| 1.5 * next()).collect();
                        Ok(CudaTensor {
                            rows: total,
                            cols,
                            data: std::mem::ManuallyDrop::new(self.upload_f32(&values)?),
                            pool: None,
                        })
                    };
                    let (q, k, v) = (tensor(heads * hd)?, tensor(kv_width)?, tensor(kv_width)?);
                    let mut outputs = Vec::new();
                    for (path, caches) in [
                        (path, &mut flash),
                        (AttentionPath::Reference, &mut reference),
                    ] {
                        let [c0, c1] = caches;
                        let mut segments = vec![
                            Segment {
                                rows: 0..new[0],
                                start_position: positions[0],
                                state: c0,
                            },
                            Segment {
                                rows: new[0]..total,
                                start_position: positions[1],
                                state: c1,
                            },
                        ];
                        let out = self
                            .attention_on(path, &q, &k, &v, &spec, &mut segments)
                            .map_err(|error| CudaError::Invalid {
                                problem: format!("attention self-check: {error}"),
                            })?;
                        outputs.push(
                            self.stream
                                .memcpy_dtov(&*out.data)
                                .map_err(driver_error("reading the attention check back"))?,
                        );
                    }
                    let (got, expected) = (&outputs[0], &outputs[1]);
                    let scale = expected.iter().fold(1.0f32, |a, x| a.max(x.abs()));
                    let difference = got
                        .iter()
                        .zip(expected)
                        .take(total * heads * hd)
                        .map(|(a, b)| (a - b).abs())
                        .fold(
                            0.0f32,
                            |a, d| if d.is_nan() { f32::INFINITY } else { a.max(d) },
                        )
                        / scale;
                    if difference.is_nan() || difference > tolerance {
                        return Err(CudaError::Invalid {
                            problem: format!(
                                "heads {heads}/{kv_heads} head_dim {hd} window {window:?} {dtype} KV, rows {new:?} at positions {positions:?}: {path} differs from the reference by {difference:.2e} of the largest value (allowed {tolerance:.0e})"
                            ),
                        });
                    }
                    worst = worst.max(difference);
                    positions[0] += new[0];
                    positions[1] += new[1];
                }
            }
        }
        Ok(worst)
    }

    /// An empty cache of `dtype` in GPU memory, whatever the backend's option (the self-check
    /// runs both).
    fn kv_cache_of(
        &self,
        dtype: KvDtype,
        max_tokens: usize,
        kv_width: usize,
    ) -> Result<CudaKvCache, CudaError> {
        let count = max_tokens * kv_width;
        let allocate = || -> Result<KvBuffer, CudaError> {
            Ok(match dtype {
                KvDtype::F32 => KvBuffer::F32(self.alloc(count)?),
                // Zero-length device allocations are an error in CUDA: keep one element.
                KvDtype::Bf16 => {
                    KvBuffer::Bf16(self.stream.alloc_zeros::<u16>(count.max(1)).map_err(
                        driver_error(format!(
                            "allocating {count} bf16 KV values ({} bytes)",
                            count * 2
                        )),
                    )?)
                }
            })
        };
        Ok(CudaKvCache {
            max_tokens,
            kv_width,
            len: 0,
            dtype,
            keys: std::mem::ManuallyDrop::new(allocate()?),
            values: std::mem::ManuallyDrop::new(allocate()?),
            placement: Default::default(),
        })
    }

    /// [`Backend::attention`](crate::backend::Backend::attention) through the given path,
    /// whatever path the backend chose at start-up (the tests compare the two).
    pub fn attention_with_path(
        &self,
        path: AttentionPath,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, CudaKvCache>],
    ) -> Result<CudaTensor, EngineError> {
        self.attention_on(path, q, k, v, spec, segments)
    }

    /// Appends each segment's keys and values to its cache, then attention of its rows through
    /// `path`. A segment that does not fit its cache fails the call before anything is appended.
    pub(super) fn attention_on(
        &self,
        path: AttentionPath,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, CudaKvCache>],
    ) -> Result<CudaTensor, EngineError> {
        let device = |source| EngineError::Device {
            op: "attention",
            source,
        };
        let hd = spec.head_dim;
        if hd == 0
            || hd > ATTENTION_MAX_HEAD_DIM
            || spec.kv_heads == 0
            || spec.heads % spec.kv_heads != 0
        {
            return Err(device(CudaError::Invalid {
                problem: format!(
                    "attention: head_dim {hd} (at most {ATTENTION_MAX_HEAD_DIM}), {} heads over {} kv heads",
                    spec.heads, spec.kv_heads
                ),
            }));
        }
        for segment in segments.iter() {
            let n = segment.rows.len();
            if segment.start_position + n > segment.state.max_tokens {
                return Err(EngineError::ContextFull {
                    held: segment.start_position,
                    added: n,
                    max_context: segment.state.max_tokens,
                });
            }
        }
        self.launch_attention(path, q, k, v, spec, segments)
            .map_err(device)
    }

    /// The appends and attention launches of [`CudaBackend::attention_on`], its checks passed.
    fn launch_attention(
        &self,
        path: AttentionPath,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, CudaKvCache>],
    ) -> Result<CudaTensor, CudaError> {
        let hd = spec.head_dim;
        let (q_data, k_data, v_data) = (&*q.data, &*k.data, &*v.data);
        // Every kernel writes all of its segment's rows.
        let mut out = self.output_for_segments(
            q.rows,
            spec.heads * hd,
            segments.iter().map(|segment| segment.rows.clone()),
        )?;
        let scale = 1.0 / (hd as f32).sqrt();
        let (heads, kv_heads, head_dim) = (
            int(spec.heads, "heads")?,
            int(spec.kv_heads, "kv heads")?,
            int(hd, "head_dim")?,
        );
        let window = int(spec.sliding_window.unwrap_or(0), "sliding window")?;

        // In a step graph the positions are device memory (`row_positions[row]`), read by the
        // kernels; 0 (null) otherwise.
        let step_graph = self.active_step_graph();
        let row_positions: u64 = step_graph.as_ref().map_or(0, |graph| graph.positions);
        if let Some(graph) = &step_graph {
            let decode_rows = segments
                .iter()
                .all(|segment| segment.rows.len() <= 1 && segment.rows.end <= graph.rows);
            if path == AttentionPath::Reference || !decode_rows {
                return Err(CudaError::Invalid {
                    problem: "a step graph takes one-row segments through the flash kernels only"
                        .into(),
                });
            }
        }

        if self.options.batched_decode
            && path != AttentionPath::Reference
            && one_row_segments_in_order(segments, hd)
        {
            let first_row = segments.first().map_or(0, |segment| segment.rows.start);
            for (group_index, group) in segments.chunks_mut(DECODE_BATCH_ROWS).enumerate() {
                let row_start = first_row + group_index * DECODE_BATCH_ROWS;
                self.launch_batched_decode_attention(
                    q,
                    k,
                    v,
                    spec,
                    group,
                    row_start,
                    &mut out,
                    step_graph.is_some(),
                    row_positions,
                    path == AttentionPath::TensorCore,
                )?;
            }
            return Ok(out);
        }

        // Appends (each segment's rows touch only its own cache).
        for segment in segments.iter_mut() {
            let cache = &mut *segment.state;
            let n = segment.rows.len();
            if n == 0 {
                continue;
            }
            let width = cache.kv_width;
            let (row_start, rows, at, width_arg) = (
                int(segment.rows.start, "row")?,
                int(n, "rows")?,
                int(segment.start_position, "position")?,
                int(width, "kv width")?,
            );
            match (&mut *cache.keys, &mut *cache.values) {
                (KvBuffer::F32(keys), KvBuffer::F32(values)) => {
                    launch!(self, "kv_append", elementwise(n * width);
                        k_data, v_data, keys, values, &row_start, &rows, &at, &width_arg,
                        &row_positions)?
                }
                (KvBuffer::Bf16(keys), KvBuffer::Bf16(values)) => {
                    launch!(self, "kv_append_bf16", elementwise(n * width);
                        k_data, v_data, keys, values, &row_start, &rows, &at, &width_arg,
                        &row_positions)?
                }
                _ => {
                    return Err(CudaError::Invalid {
                        problem: "attention: keys and values of one cache differ in dtype".into(),
                    })
                }
            }
            cache.len = segment.start_position + n;
        }

        // The split workspace: every split segment's partials in one pair of buffers.
        let mut plans: Vec<Option<SplitPlan>> = Vec::with_capacity(segments.len());
        let mut entries = 0usize;
        for segment in segments.iter() {
            let n = segment.rows.len();
            // The split kernel stages whole 4-byte words: a bf16 row needs an even head_dim
            // (any real model's); an odd one takes the tiled kernel.
            let whole_words = segment.state.dtype == KvDtype::F32 || hd % 2 == 0;
            if path != AttentionPath::Reference && n > 0 && n <= SPLIT_MAX_ROWS && whole_words {
                let last = segment.start_position + n - 1;
                let chunk = split_chunk(last);
                // A step graph serves every position: its grid covers the most chunks a row
                // can have, and the kernels skip the chunks past the row's position.
                let chunks = if step_graph.is_some() {
                    SPLIT_MAX_CHUNKS
                } else {
                    last / chunk + 1
                };
                plans.push(Some(SplitPlan {
                    chunk,
                    chunks,
                    part_base: entries,
                }));
                entries += n * spec.heads * chunks;
            } else {
                plans.push(None);
            }
        }
        // Recycled buffers, not zeroed: the combine reads only the partials of non-empty
        // chunks, and the split kernel writes every one of those.
        let mut workspace: Option<(CudaTensor, CudaTensor)> = if entries > 0 {
            int(entries * hd, "split workspace")?;
            Some((
                self.output_uninit(1, entries * hd)?,
                self.output_uninit(1, 2 * entries)?,
            ))
        } else {
            None
        };

        for (segment, plan) in segments.iter().zip(&plans) {
            let cache = &*segment.state;
            let n = segment.rows.len();
            if n == 0 {
                continue;
            }
            let (row_start, rows, at) = (
                int(segment.rows.start, "row")?,
                int(n, "rows")?,
                int(segment.start_position, "position")?,
            );
            let output = &mut *out.data;
            let (keys, values) = (&*cache.keys, &*cache.values);
            if !matches!(
                (keys, values),
                (KvBuffer::F32(_), KvBuffer::F32(_)) | (KvBuffer::Bf16(_), KvBuffer::Bf16(_))
            ) {
                return Err(CudaError::Invalid {
                    problem: "attention: keys and values of one cache differ in dtype".into(),
                });
            }
            match (path, plan, workspace.as_mut()) {
                (
                    AttentionPath::Flash | AttentionPath::TensorCore,
                    Some(plan),
                    Some((part_o, part_ml)),
                ) => {
                    let (part_o, part_ml) = (&mut *part_o.data, &mut *part_ml.data);
                    let group = spec.heads / spec.kv_heads;
                    let slices = group.div_ceil(SPLIT_HEADS);
                    let (chunk, chunks, part_base) = (
                        int(plan.chunk, "chunk")?,
                        int(plan.chunks, "chunks")?,
                        int(plan.part_base, "split base")?,
                    );
                    let config = LaunchConfig {
                        grid_dim: (
                            plan.chunks as u32,
                            (spec.kv_heads * slices) as u32,
                            n as u32,
                        ),
                        block_dim: (SPLIT_THREADS, 1, 1),
                        shared_mem_bytes: split_smem_bytes(hd, cache.dtype) as u32,
                    };
                    match (
                        keys,
                        values,
                        self.decode_kernel(
                            cache.dtype,
                            hd,
                            group,
                            path == AttentionPath::TensorCore,
                        ),
                    ) {
                        (KvBuffer::Bf16(keys), KvBuffer::Bf16(values), Some(kernel)) => {
                            let function = self.function(kernel.segment)?;
                            let mut builder = super::launch::KernelArgs::new(&self.stream);
                            builder
                                .arg(q_data)
                                .arg(keys)
                                .arg(values)
                                .arg(&mut *part_o)
                                .arg(&mut *part_ml)
                                .arg(&row_start)
                                .arg(&at)
                                .arg(&heads)
                                .arg(&kv_heads)
                                .arg(&head_dim)
                                .arg(&window)
                                .arg(&scale)
                                .arg(&chunk)
                                .arg(&chunks)
                                .arg(&part_base)
                                .arg(&row_positions);
                            let config = kernel.config(plan.chunks, spec.kv_heads, n);
                            // SAFETY: the arguments match `attention_decode_bf16_*` and
                            // `attention_decode_mma_bf16_*` in kernels/attention_decode.cu, which
                            // take those of `attention_split_bf16` (types and order); the grid
                            // covers the split launch's chunks with the group's heads in a block.
                            unsafe { self.launch_kernel(function, config, &mut builder) }?;
                        }
                        (KvBuffer::F32(keys), KvBuffer::F32(values), _) => {
                            launch!(self, "attention_split", config;
                                q_data, keys, values, &mut *part_o, &mut *part_ml, &row_start,
                                &at, &heads, &kv_heads, &head_dim, &window, &scale, &chunk,
                                &chunks, &part_base, &row_positions)?
                        }
                        (KvBuffer::Bf16(keys), KvBuffer::Bf16(values), None) => {
                            launch!(self, "attention_split_bf16", config;
                                q_data, keys, values, &mut *part_o, &mut *part_ml, &row_start,
                                &at, &heads, &kv_heads, &head_dim, &window, &scale, &chunk,
                                &chunks, &part_base, &row_positions)?
                        }
                        _ => unreachable!("checked above"),
                    }
                    let combine = LaunchConfig {
                        grid_dim: ((n * spec.heads) as u32, hd.div_ceil(32) as u32, 1),
                        block_dim: (32 * COMBINE_WARPS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    launch!(self, "attention_combine", combine;
                        &*part_o, &*part_ml, output, &row_start, &rows, &at, &heads, &head_dim,
                        &window, &chunk, &chunks, &part_base, &row_positions)?;
                }
                // An f32 cache keeps the tiled kernel.
                (AttentionPath::TensorCore, _, _)
                    if n >= MMA_MIN_ROWS && self.mma_fits(hd) && cache.dtype == KvDtype::Bf16 =>
                {
                    let (KvBuffer::Bf16(keys), KvBuffer::Bf16(values)) = (keys, values) else {
                        return Err(CudaError::Invalid {
                            problem: "attention: a bf16 cache holds f32 buffers".into(),
                        });
                    };
                    let tiles =
                        u32::try_from(n.div_ceil(MMA_ROWS)).map_err(|_| CudaError::Invalid {
                            problem: format!("attention: {n} rows"),
                        })?;
                    let config = LaunchConfig {
                        grid_dim: (tiles, spec.heads as u32, 1),
                        block_dim: (MMA_THREADS, 1, 1),
                        shared_mem_bytes: mma_smem_bytes(hd) as u32,
                    };
                    let function = self.mma_function(hd)?;
                    let mut builder = super::launch::KernelArgs::new(&self.stream);
                    builder
                        .arg(q_data)
                        .arg(keys)
                        .arg(values)
                        .arg(output)
                        .arg(&row_start)
                        .arg(&rows)
                        .arg(&at)
                        .arg(&heads)
                        .arg(&kv_heads)
                        .arg(&window)
                        .arg(&scale);
                    // SAFETY: the arguments match `attention_mma_{hd}` in kernels/attention.cu
                    // (types and order); the grid covers the segment's rows, which lie in q and
                    // out, and its keys lie in the cache (checked by `attention_on`).
                    unsafe { self.launch_kernel(function, config, &mut builder) }?;
                }
                (AttentionPath::Flash | AttentionPath::TensorCore, _, _) => {
                    let tiles =
                        u32::try_from(n.div_ceil(TILE_ROWS)).map_err(|_| CudaError::Invalid {
                            problem: format!("attention: {n} rows"),
                        })?;
                    let config = LaunchConfig {
                        grid_dim: (tiles, spec.heads as u32, 1),
                        block_dim: (TILE_THREADS, 1, 1),
                        shared_mem_bytes: tiled_smem_bytes(hd) as u32,
                    };
                    match (keys, values) {
                        (KvBuffer::F32(keys), KvBuffer::F32(values)) => {
                            launch!(self, "attention_tiled", config;
                                q_data, keys, values, output, &row_start, &rows, &at, &heads,
                                &kv_heads, &head_dim, &window, &scale)?
                        }
                        (KvBuffer::Bf16(keys), KvBuffer::Bf16(values)) => {
                            launch!(self, "attention_tiled_bf16", config;
                                q_data, keys, values, output, &row_start, &rows, &at, &heads,
                                &kv_heads, &head_dim, &window, &scale)?
                        }
                        _ => unreachable!("checked above"),
                    }
                }
                (AttentionPath::Reference, _, _) => {
                    let tasks = u32::try_from(n * spec.heads).map_err(|_| CudaError::Invalid {
                        problem: format!("attention: {n} rows × {} heads", spec.heads),
                    })?;
                    let config = LaunchConfig {
                        grid_dim: (tasks.div_ceil(ATTENTION_WARPS), 1, 1),
                        block_dim: (32 * ATTENTION_WARPS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    match (keys, values) {
                        (KvBuffer::F32(keys), KvBuffer::F32(values)) => {
                            launch!(self, "attention", config;
                                q_data, keys, values, output, &row_start, &rows, &at, &heads,
                                &kv_heads, &head_dim, &window, &scale)?
                        }
                        (KvBuffer::Bf16(keys), KvBuffer::Bf16(values)) => {
                            launch!(self, "attention_bf16", config;
                                q_data, keys, values, output, &row_start, &rows, &at, &heads,
                                &kv_heads, &head_dim, &window, &scale)?
                        }
                        _ => unreachable!("checked above"),
                    }
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use crate::backend::cuda::kernels::kernel_define;
        let define = |name| kernel_define("attention", name);
        assert_eq!(i64::from(SPLIT_THREADS), define("SPLIT_THREADS"));
        assert_eq!(SPLIT_TILE as i64, define("SPLIT_TILE"));
        assert_eq!(SPLIT_HEADS as i64, define("SPLIT_HEADS"));
        assert_eq!(SPLIT_MAX_CHUNKS as i64, define("COMBINE_MAX_CHUNKS"));
        assert_eq!(
            SPLIT_MIN_CHUNK_TILES as i64,
            define("SPLIT_MIN_CHUNK_TILES")
        );
        assert_eq!(i64::from(COMBINE_WARPS), define("COMBINE_WARPS"));
        assert_eq!(i64::from(TILE_THREADS), define("TILE_THREADS"));
        assert_eq!(TILE_ROWS as i64, define("TILE_ROWS"));
        assert_eq!(TILE_KEYS as i64, define("TILE_KEYS"));
        assert_eq!(
            ATTENTION_MAX_HEAD_DIM as i64,
            32 * define("MAX_DIMS_PER_LANE")
        );
        assert_eq!(DECODE_BATCH_ROWS as i64, define("DECODE_BATCH_ROWS"));
        assert_eq!(MMA_ROWS as i64, define("MMA_ROWS"));
        // One tile size stages q and the K / V tiles (mma_smem_bytes).
        assert_eq!(define("MMA_KEYS"), define("MMA_ROWS"));
        assert_eq!(i64::from(MMA_THREADS), define("MMA_THREADS"));
        assert_eq!(MMA_PAD as i64, define("MMA_PAD"));
        // 16 rows per warp.
        assert_eq!(define("MMA_ROWS"), 16 * define("MMA_THREADS") / 32);
        for hd in MMA_HEAD_DIMS {
            assert!(hd % 16 == 0 && hd <= ATTENTION_MAX_HEAD_DIM);
        }
        // The largest block fits an sm_86 / sm_89 GPU's 99 KiB.
        assert!(mma_smem_bytes(256) <= 99 * 1024);
        // The split kernel's threads cover a head's dims, its warps a tile's keys (one per lane).
        assert!(define("SPLIT_THREADS") * define("SPLIT_DIMS") >= ATTENTION_MAX_HEAD_DIM as i64);
        assert_eq!(define("SPLIT_WARPS") * 32, define("SPLIT_THREADS"));
        assert_eq!(define("SPLIT_TILE"), 32);
        // Every row's chunks fit the combine's weights.
        for last in [0usize, 31, 32, 4095, 4096, 100_000, 1_000_000] {
            assert!(last / split_chunk(last) < SPLIT_MAX_CHUNKS, "{last}");
        }
    }
}
