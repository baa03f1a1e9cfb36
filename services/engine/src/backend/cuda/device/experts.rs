//! Routed experts computed from their GPU slots (`kernels/experts.cu`, `experts_mma.cu`).
//!
//! Owns: the launches of a layer's slotted experts: per pair for small batches (one token's
//! gate/up from a grid that fits the GPU at once; by expert for a decode batch of several
//! tokens: the per-pair bits, each expert read once for up to `EXPERT_GROUP_PAIRS` of its pairs),
//! grouped by expert (each weight read once per tile of up to `TILE_TOKENS` pairs, or on the
//! tensor cores) from `GROUPED_MIN_TOKENS` tokens on, and the pair sum. The SIMT paths give the
//! same bits (see `kernels/experts.cu`). The slots themselves are `expert_slots.rs`, their
//! background fills `expert_fills.rs`.
//! Must not touch: which experts go to slots (the model's placement), routing, the CPU side.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};
use ninfer_cpu_experts::{ExpertLayout, WeightDType};

use super::expert_slots::CudaExpertSlots;
use super::{driver_error, elementwise, int, CudaBackend, CudaTensor};
use crate::backend::cuda::CudaError;
use crate::backend::ExpertSlotTable;
use crate::backend::Routing;
use crate::error::EngineError;

/// Warps per block of `expert_gate_up` / `expert_down`: `EXPERT_GATE_UP_COLUMNS` activated
/// columns (their gate and up rows) per warp in `expert_gate_up`, `EXPERT_DOWN_ROWS` output rows
/// per warp in `expert_down`.
const EXPERT_WARPS: u32 = 8;
/// `DOWN_ROWS` and `GATE_UP_COLUMNS` in kernels/experts.cu.
const EXPERT_DOWN_ROWS: u32 = 4;
const EXPERT_GATE_UP_COLUMNS: u32 = 1;
/// Batches of at least this many tokens (per launch chunk) take the grouped kernels
/// (`expert_gate_up_grouped` / `expert_down_grouped`) when their slotted pairs average at least
/// `GROUPED_MIN_PAIRS_PER_EXPERT` per distinct slotted expert: below that a tile of
/// `TILE_TOKENS` holds a pair or two, its FMAs on padding cost more than the weight reads it
/// saves, and the per-pair kernels (one warp per output row, memory-bound) are faster. The
/// choice never changes the result: both paths sum in the same order.
const GROUPED_MIN_TOKENS: usize = 16;
const GROUPED_MIN_PAIRS_PER_EXPERT: usize = 4;
/// Pairs per tile of the grouped kernels (`TILE_TOKENS` in kernels/experts.cu).
const TILE_TOKENS: usize = 16;
/// Warps per block of the grouped kernels (`GROUPED_WARPS`): each warp computes 2 activated
/// columns (their gate and up rows) in `expert_gate_up_grouped` and `GROUPED_ROWS` = 4 output
/// rows in `expert_down_grouped`.
const GROUPED_WARPS: u32 = 8;
const GROUPED_COLUMNS_PER_BLOCK: u32 = 2 * GROUPED_WARPS;
const GROUPED_ROWS_PER_BLOCK: u32 = 4 * GROUPED_WARPS;
/// Pairs per tile of the tensor-core grouped kernels (`MMA_TILE_TOKENS` in kernels/experts_mma.cu):
/// the rows of one block's GEMM.
const MMA_TILE_TOKENS: usize = 64;
/// Threads per block of the tensor-core kernels (`MMA_THREADS`), activated columns per
/// `expert_gate_up_mma` block (`MMA_COLUMNS`) and output rows per `expert_down_mma` block
/// (`MMA_TILE_ROWS`).
const MMA_THREADS: u32 = 128;
const MMA_COLUMNS_PER_BLOCK: u32 = 64;
const MMA_ROWS_PER_BLOCK: u32 = 128;
/// Pairs one block of the by-expert kernels computes against one read of their expert's
/// weights (`EXPERT_GROUP_PAIRS` in kernels/experts.cu).
const EXPERT_GROUP_PAIRS: usize = 4;
/// Most choices per token `expert_down_sum` takes (`DOWN_SUM_MAX_TOP_K` in kernels/experts.cu).
const DOWN_SUM_MAX_TOP_K: usize = 32;
/// `FUSED_MIN_BLOCKS` in kernels/experts.cu: blocks per multiprocessor of an
/// `expert_decode_fused` grid, which must all be resident at once (its registers are sized for
/// that many).
const FUSED_MIN_BLOCKS: usize = 1;
/// `GATE_UP_TASK_BLOCKS_PER_SM` / `GATE_UP_TASK_MAX_PAIRS` in kernels/experts.cu: the grid of
/// `expert_gate_up_tasks` (blocks per multiprocessor) and the most pairs it takes.
const GATE_UP_TASK_BLOCKS_PER_SM: usize = 2;
const GATE_UP_TASK_MAX_PAIRS: usize = 64;
/// Widest hidden size `expert_gate_up_tasks` takes: 4 segments of 16 inputs per lane.
const GATE_UP_TASK_MAX_HIDDEN: usize = 4 * 32 * 16;
/// Dynamic shared memory a block gets without asking for more (48 KiB, less 1 KiB for the
/// kernels' static shared memory): the by-expert kernels stage as many of a group's input
/// vectors as fit in it (fewer pairs per group for wide models).
const DEFAULT_DYNAMIC_SHARED_BYTES: usize = 47 * 1024;
/// The grid's y dimension (tiles or pairs per launch).
const MAX_GRID_Y: usize = 65_535;
/// Pairs (token × choice) per launch: the grid's y dimension (pairs, or tiles of the grouped
/// kernels, at most one per pair) is limited to 65 535, and the per-pair scratch
/// (`pairs × (hidden + intermediate)` floats) stays bounded at prefill.
const MAX_PAIRS_PER_LAUNCH: usize = 16_384;

/// Which kernels compute a batch that takes the grouped path (see `GROUPED_MIN_TOKENS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupedExpertKernels {
    /// `expert_gate_up_grouped` / `expert_down_grouped`: f32 FMAs, the per-pair kernels' bits.
    Simt,
    /// `expert_gate_up_mma` / `expert_down_mma` (bf16 tensor cores, f32 accumulation) for bf16,
    /// int8 and int4 experts; f32 experts keep the SIMT kernels.
    TensorCore,
}

impl std::fmt::Display for GroupedExpertKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GroupedExpertKernels::Simt => "simt",
            GroupedExpertKernels::TensorCore => "tensor-core",
        })
    }
}

fn dtype_code(dtype: WeightDType) -> i32 {
    // DTYPE_* in kernels/experts.cu.
    match dtype {
        WeightDType::F32 => 0,
        WeightDType::Bf16 => 1,
        WeightDType::Int8 => 2,
        WeightDType::Int4 => 3,
    }
}

fn long(value: usize) -> i64 {
    // Byte offsets of an expert are far below 2^63.
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The slotted pairs of one launch grouped by expert, for the grouped kernels.
#[derive(Debug, PartialEq, Eq)]
struct PairGroups {
    /// Pair indices (within the launch), expert by expert in increasing expert id, each
    /// expert's pairs in increasing pair index.
    order: Vec<u32>,
    /// `[first index into order, count ≤ the tile size, slot]` per tile; a tile holds pairs of
    /// one expert.
    tiles: Vec<i32>,
    /// Distinct experts with a slotted pair.
    experts: usize,
}

impl PairGroups {
    fn tile_count(&self) -> usize {
        self.tiles.len() / 3
    }

    /// Whether the grouped kernels pay off for `tokens` tokens (see `GROUPED_MIN_TOKENS`).
    fn worth_it(&self, tokens: usize) -> bool {
        tokens >= GROUPED_MIN_TOKENS
            && self.order.len() >= GROUPED_MIN_PAIRS_PER_EXPERT.saturating_mul(self.experts)
    }
}

fn too_large(what: &str, value: usize) -> CudaError {
    CudaError::Invalid {
        problem: format!("{what} = {value} does not fit a kernel argument"),
    }
}

/// Groups the pairs with expert ids `ids` whose expert has a slot in `table` (ids of no expert
/// have none) by expert, cut into tiles of at most `tile_tokens`.
fn group_pairs(
    ids: &[u32],
    table: &ExpertSlotTable,
    tile_tokens: usize,
) -> Result<PairGroups, CudaError> {
    let num_experts = table.num_experts();
    let mut by_expert: Vec<Vec<u32>> = vec![Vec::new(); num_experts];
    for (pair, &id) in ids.iter().enumerate() {
        let expert = id as usize;
        if table.is_resident(expert) {
            let pair = u32::try_from(pair).map_err(|_| too_large("pair index", pair))?;
            by_expert[expert].push(pair);
        }
    }
    let mut groups = PairGroups {
        order: Vec::new(),
        tiles: Vec::new(),
        experts: 0,
    };
    for (expert, pairs) in by_expert.iter().enumerate() {
        let Some(slot) = table.slot_of(expert).filter(|_| !pairs.is_empty()) else {
            continue;
        };
        groups.experts += 1;
        let slot = i32::try_from(slot).map_err(|_| too_large("slot", slot))?;
        for tile in pairs.chunks(tile_tokens) {
            let first = groups.order.len();
            groups.tiles.extend([
                i32::try_from(first).map_err(|_| too_large("tile start", first))?,
                i32::try_from(tile.len()).map_err(|_| too_large("tile size", tile.len()))?,
                slot,
            ]);
            groups.order.extend_from_slice(tile);
        }
    }
    Ok(groups)
}

/// `value` (1 ..= `max`) as a grid dimension.
fn grid(value: usize, max: usize, what: &str) -> Result<u32, CudaError> {
    if value == 0 || value > max {
        return Err(too_large(what, value));
    }
    u32::try_from(value).map_err(|_| too_large(what, value))
}

/// The grid's x dimension limit.
const MAX_GRID_X: usize = (1 << 31) - 1;

/// Dynamic shared memory for a padded vector of `len` inputs (kernels/experts.cu: 20 floats per
/// 16 inputs, `SEG_STRIDE` / `SEG`).
fn shared_bytes(len: usize) -> Result<u32, CudaError> {
    len.div_ceil(16)
        .checked_mul(20 * 4)
        .and_then(|bytes| u32::try_from(bytes).ok())
        .ok_or_else(|| too_large("shared memory bytes", len))
}

/// Pairs per group of the by-expert kernels for these widths: as many input vectors of either
/// kernel as fit the default dynamic shared memory, at most `EXPERT_GROUP_PAIRS`; 0 when not
/// even one fits (the per-pair kernels then run).
fn by_expert_group_pairs(hidden: usize, intermediate: usize) -> Result<usize, CudaError> {
    let widest = shared_bytes(hidden)?.max(shared_bytes(intermediate)?) as usize;
    Ok((DEFAULT_DYNAMIC_SHARED_BYTES / widest.max(1)).min(EXPERT_GROUP_PAIRS))
}

/// What a per-pair launch left: each pair's weighted output in `pair_out` (the pair sum still
/// to run), or the tokens' sums in the output already (`expert_down_sum`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PairOutputs {
    PerPair,
    Summed,
}

/// The expert layout's scalars as the expert kernels take them.
struct ExpertKernelArgs {
    hidden: i32,
    intermediate: i32,
    stride: i64,
    dtype: i32,
    gate_up_scales: i64,
    down_offset: i64,
    down_scales: i64,
}

impl ExpertKernelArgs {
    fn new(layout: &ExpertLayout) -> Result<Self, CudaError> {
        Ok(ExpertKernelArgs {
            hidden: int(layout.hidden, "hidden")?,
            intermediate: int(layout.intermediate, "intermediate")?,
            stride: long(layout.stride),
            dtype: dtype_code(layout.dtype),
            gate_up_scales: long(layout.gate_up.scales_offset),
            down_offset: long(layout.down_offset),
            down_scales: long(layout.down.scales_offset),
        })
    }
}

/// A launch over `outputs` outputs in blocks of `per_block` (x) for each of `rows` pairs or
/// tiles (y), `warps` warps per block.
fn expert_launch(
    outputs: usize,
    per_block: u32,
    rows: u32,
    warps: u32,
    shared_mem_bytes: u32,
    what: &str,
) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (
            grid(outputs.div_ceil(per_block as usize), MAX_GRID_X, what)?,
            rows,
            1,
        ),
        block_dim: (32 * warps, 1, 1),
        shared_mem_bytes,
    })
}

/// A tensor-core launch over `outputs` outputs in blocks of `per_block` (x) for each of `tiles`
/// tiles (y), `MMA_THREADS` threads per block.
fn mma_launch(
    outputs: usize,
    per_block: u32,
    tiles: u32,
    what: &str,
) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (
            grid(outputs.div_ceil(per_block as usize), MAX_GRID_X, what)?,
            tiles,
            1,
        ),
        block_dim: (MMA_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl CudaBackend {
    /// The kernels a grouped batch takes under this backend's options.
    pub(super) fn grouped_expert_kernels(&self) -> GroupedExpertKernels {
        if self.options.tensor_core_prefill {
            GroupedExpertKernels::TensorCore
        } else {
            GroupedExpertKernels::Simt
        }
    }

    pub(super) fn launch_slotted_experts(
        &self,
        slots: &CudaExpertSlots,
        x: &CudaTensor,
        routing: &Routing,
    ) -> Result<CudaTensor, CudaError> {
        self.launch_slotted_experts_with(self.grouped_expert_kernels(), slots, x, routing)
    }

    /// [`Backend::slotted_experts`](crate::backend::Backend::slotted_experts) with a grouped
    /// batch on the given kernels, whatever the options say (the tests compare them).
    pub fn slotted_experts_through(
        &self,
        kernels: GroupedExpertKernels,
        slots: &CudaExpertSlots,
        x: &CudaTensor,
        routing: &Routing,
    ) -> Result<CudaTensor, EngineError> {
        self.launch_slotted_experts_with(kernels, slots, x, routing)
            .map_err(|source| EngineError::Device {
                op: "slotted_experts",
                source,
            })
    }

    fn launch_slotted_experts_with(
        &self,
        kernels: GroupedExpertKernels,
        slots: &CudaExpertSlots,
        x: &CudaTensor,
        routing: &Routing,
    ) -> Result<CudaTensor, CudaError> {
        let layout = &slots.layout;
        let (hidden, intermediate) = (layout.hidden, layout.intermediate);
        let tokens = x.rows;
        let k = routing.experts_per_token;
        let mut out = self.output(tokens, x.cols)?;
        if x.cols != hidden
            || k == 0
            || tokens == 0
            || intermediate == 0
            || tokens.checked_mul(k) != Some(routing.expert_ids.len())
            || routing.weights.len() != routing.expert_ids.len()
        {
            // Same contract as the CPU backend: an inconsistent call leaves zeros.
            return Ok(out);
        }
        // Nothing resident for this batch: skip the launches (the common case at decode when
        // the slots hold few experts).
        if !routing
            .expert_ids
            .iter()
            .any(|&id| slots.slot_table.is_resident(id as usize))
        {
            return Ok(out);
        }
        let input = &*x.data;
        let storage = &slots.storage;
        let chunk_tokens = (MAX_PAIRS_PER_LAUNCH / k).max(1);
        let chunk_pairs = chunk_tokens.min(tokens) * k;
        let scratch = |width: usize| {
            chunk_pairs
                .checked_mul(width)
                .ok_or_else(|| CudaError::Invalid {
                    problem: format!("{chunk_pairs} expert pairs × {width} floats overflow"),
                })
        };
        // Recycled scratch: the kernels write every element a later kernel reads (activations
        // of slotted pairs; pair outputs of every pair, zeroed below where the grouped kernel
        // skips pairs).
        let mut activated_buffer = self.output_uninit(1, scratch(intermediate)?)?;
        let mut pair_out_buffer = self.output_uninit(1, scratch(hidden)?)?;
        let activated = &mut *activated_buffer.data;
        let pair_out = &mut *pair_out_buffer.data;
        let args = ExpertKernelArgs::new(layout)?;
        let top_k = int(k, "top-k")?;
        let output = &mut *out.data;
        let mut first = 0;
        while first < tokens {
            let count = chunk_tokens.min(tokens - first);
            let pairs = count * k;
            let chunk_ids = &routing.expert_ids[first * k..(first + count) * k];
            let weights = self.upload_f32(&routing.weights[first * k..(first + count) * k])?;
            let x_chunk = input.slice(first * hidden..(first + count) * hidden);
            let groups = if count >= GROUPED_MIN_TOKENS {
                Some(group_pairs(chunk_ids, &slots.slot_table, TILE_TOKENS)?)
            } else {
                None
            };
            let tensor_cores =
                kernels == GroupedExpertKernels::TensorCore && layout.dtype != WeightDType::F32;
            match groups {
                Some(groups) if groups.worth_it(count) && tensor_cores => {
                    // The same pairs, in the tensor-core kernels' larger tiles.
                    let groups = group_pairs(chunk_ids, &slots.slot_table, MMA_TILE_TOKENS)?;
                    if groups.order.len() < pairs {
                        let mut rows = pair_out.slice_mut(0..pairs * hidden);
                        self.stream
                            .memset_zeros(&mut rows)
                            .map_err(driver_error("zeroing the expert pair outputs"))?;
                    }
                    let order = self.upload_u32(&groups.order)?;
                    let tiles = self
                        .stream
                        .memcpy_stod(&groups.tiles)
                        .map_err(driver_error("copying the expert tiles to the GPU"))?;
                    let tile_count = grid(groups.tile_count(), MAX_GRID_Y, "expert tiles")?;
                    let gate_up_config = mma_launch(
                        intermediate,
                        MMA_COLUMNS_PER_BLOCK,
                        tile_count,
                        "expert column blocks",
                    )?;
                    launch!(self, "expert_gate_up_mma", gate_up_config;
                        storage, &tiles, &order, &x_chunk, &mut *activated, &top_k,
                        &args.hidden, &args.intermediate, &args.stride, &args.dtype,
                        &args.gate_up_scales)?;
                    let down_config =
                        mma_launch(hidden, MMA_ROWS_PER_BLOCK, tile_count, "expert row blocks")?;
                    launch!(self, "expert_down_mma", down_config;
                        storage, &tiles, &order, &weights, &*activated, &mut *pair_out,
                        &args.hidden, &args.intermediate, &args.stride, &args.dtype,
                        &args.down_offset, &args.down_scales)?;
                }
                Some(groups) if groups.worth_it(count) => {
                    if groups.order.is_empty() {
                        // Nothing resident in this chunk: its rows of `out` stay zero.
                        first += count;
                        continue;
                    }
                    if groups.order.len() < pairs {
                        // The grouped down kernel writes only slotted pairs; the others add 0.
                        let mut rows = pair_out.slice_mut(0..pairs * hidden);
                        self.stream
                            .memset_zeros(&mut rows)
                            .map_err(driver_error("zeroing the expert pair outputs"))?;
                    }
                    let order = self.upload_u32(&groups.order)?;
                    let tiles = self
                        .stream
                        .memcpy_stod(&groups.tiles)
                        .map_err(driver_error("copying the expert tiles to the GPU"))?;
                    let tile_count = grid(groups.tile_count(), MAX_GRID_Y, "expert tiles")?;
                    let gate_up_config = expert_launch(
                        intermediate,
                        GROUPED_COLUMNS_PER_BLOCK,
                        tile_count,
                        GROUPED_WARPS,
                        0,
                        "expert column blocks",
                    )?;
                    launch!(self, "expert_gate_up_grouped", gate_up_config;
                        storage, &tiles, &order, &x_chunk, &mut *activated, &top_k,
                        &args.hidden, &args.intermediate, &args.stride, &args.dtype,
                        &args.gate_up_scales)?;
                    let down_config = expert_launch(
                        hidden,
                        GROUPED_ROWS_PER_BLOCK,
                        tile_count,
                        GROUPED_WARPS,
                        0,
                        "expert row blocks",
                    )?;
                    launch!(self, "expert_down_grouped", down_config;
                        storage, &tiles, &order, &weights, &*activated, &mut *pair_out,
                        &args.hidden, &args.intermediate, &args.stride, &args.dtype,
                        &args.down_offset, &args.down_scales)?;
                }
                _ => {
                    let ids = self.upload_u32(chunk_ids)?;
                    let mut out_chunk = output.slice_mut(first * hidden..(first + count) * hidden);
                    let outputs = self.launch_pairwise_experts(
                        slots,
                        &ids.slice(..),
                        &weights.slice(..),
                        &x_chunk,
                        pairs,
                        k,
                        &mut *activated,
                        &mut *pair_out,
                        Some(&mut out_chunk),
                    )?;
                    if outputs == PairOutputs::Summed {
                        first += count;
                        continue;
                    }
                }
            }
            let mut out_chunk = output.slice_mut(first * hidden..(first + count) * hidden);
            self.launch_pair_sum(pair_out, &mut out_chunk, count, k, hidden)?;
            first += count;
        }
        Ok(out)
    }

    /// The per-pair kernels: one block row per (token, choice) pair of `ids` / `weights`
    /// (`pairs` of them, `k` per token of `x`), the gated-up activations into `activated` and
    /// each pair's weighted down projection into `pair_out`; a pair whose expert has no slot
    /// writes zeros. Each pair streams its expert's weights: the decode shape.
    #[allow(clippy::too_many_arguments)]
    fn launch_pairwise_experts(
        &self,
        slots: &CudaExpertSlots,
        ids: &CudaView<'_, u32>,
        weights: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        pairs: usize,
        k: usize,
        activated: &mut CudaSlice<f32>,
        pair_out: &mut CudaSlice<f32>,
        mut summed: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<PairOutputs, CudaError> {
        let layout = &slots.layout;
        let (hidden, intermediate) = (layout.hidden, layout.intermediate);
        let storage = &slots.storage;
        let table = &slots.table;
        let args = ExpertKernelArgs::new(layout)?;
        let (top_k, num_experts) = (
            int(k, "top-k")?,
            int(slots.slot_table.num_experts(), "experts")?,
        );
        let pairs_arg = grid(pairs, MAX_GRID_Y, "expert pairs in one launch")?;
        // Several tokens of a decode-sized batch: each expert read once for up to a group of its
        // pairs. Only below the grouped kernels' size: every block scans the pairs before its own.
        let group_pairs = by_expert_group_pairs(hidden, intermediate)?;
        let tokens = pairs / k.max(1);
        if self.options.batched_decode
            && self.options.decode_experts_by_expert
            && tokens > 1
            && tokens < GROUPED_MIN_TOKENS
            && group_pairs > 0
        {
            let (pairs_count, group) = (int(pairs, "pairs")?, int(group_pairs, "group pairs")?);
            let gate_up_config = expert_launch(
                intermediate,
                EXPERT_WARPS,
                pairs_arg,
                EXPERT_WARPS,
                group_pairs as u32 * shared_bytes(hidden)?,
                "expert row blocks",
            )?;
            launch!(self, "expert_gate_up_by_expert", gate_up_config;
                storage, table, ids, x, &mut *activated, &top_k, &num_experts,
                &args.hidden, &args.intermediate, &args.stride, &args.dtype, &args.gate_up_scales,
                &pairs_count, &group)?;
            let down_config = expert_launch(
                hidden,
                EXPERT_WARPS * EXPERT_DOWN_ROWS,
                pairs_arg,
                EXPERT_WARPS,
                group_pairs as u32 * shared_bytes(intermediate)?,
                "expert row blocks",
            )?;
            launch!(self, "expert_down_by_expert", down_config;
                storage, table, ids, weights, &*activated, pair_out,
                &num_experts, &args.hidden, &args.intermediate, &args.stride, &args.dtype,
                &args.down_offset, &args.down_scales, &pairs_count, &group)?;
            return Ok(PairOutputs::PerPair);
        }
        let quantized = matches!(layout.dtype, WeightDType::Int8 | WeightDType::Int4);
        let fused = self
            .fused_expert_counters
            .as_ref()
            .filter(|_| tokens == 1 && quantized && k <= DOWN_SUM_MAX_TOP_K)
            .filter(|_| {
                hidden <= GATE_UP_TASK_MAX_HIDDEN && intermediate <= GATE_UP_TASK_MAX_HIDDEN
            });
        if let (Some(counters), Some(out)) = (fused, summed.as_mut()) {
            let shared = shared_bytes(hidden)?.max(
                shared_bytes(intermediate)?
                    .checked_mul(top_k as u32)
                    .ok_or_else(|| too_large("shared memory bytes", intermediate))?,
            );
            if shared as usize <= DEFAULT_DYNAMIC_SHARED_BYTES {
                let blocks = FUSED_MIN_BLOCKS * self.info.multiprocessor_count.max(1);
                let config = LaunchConfig {
                    grid_dim: (grid(blocks, MAX_GRID_X, "fused expert blocks")?, 1, 1),
                    block_dim: (32 * EXPERT_WARPS, 1, 1),
                    shared_mem_bytes: shared,
                };
                launch!(self, "expert_decode_fused", config;
                    storage, table, ids, x, weights, &mut *activated, &mut **out, counters,
                    &top_k, &num_experts, &args.hidden, &args.intermediate, &args.stride,
                    &args.dtype, &args.gate_up_scales, &args.down_offset, &args.down_scales)?;
                return Ok(PairOutputs::Summed);
            }
        }
        let gate_up_config = expert_launch(
            intermediate,
            EXPERT_WARPS * EXPERT_GATE_UP_COLUMNS,
            pairs_arg,
            EXPERT_WARPS,
            shared_bytes(hidden)?,
            "expert row blocks",
        )?;
        if self.options.decode_gate_up_tasks
            && tokens == 1
            && pairs <= GATE_UP_TASK_MAX_PAIRS
            && quantized
            && hidden <= GATE_UP_TASK_MAX_HIDDEN
        {
            let blocks = GATE_UP_TASK_BLOCKS_PER_SM * self.info.multiprocessor_count.max(1);
            let config = LaunchConfig {
                grid_dim: (grid(blocks, MAX_GRID_X, "gate/up task blocks")?, 1, 1),
                block_dim: (32 * EXPERT_WARPS, 1, 1),
                shared_mem_bytes: shared_bytes(hidden)?,
            };
            let pairs_count = int(pairs, "pairs")?;
            // The down matrices the next launch reads, asked of L2 by this one's warps.
            let down_span = if self.options.decode_down_prefetch {
                args.stride - args.down_offset
            } else {
                0
            };
            launch!(self, "expert_gate_up_tasks", config;
                storage, table, ids, x, &mut *activated, &top_k, &num_experts,
                &args.hidden, &args.intermediate, &args.stride, &args.dtype, &args.gate_up_scales,
                &pairs_count, &args.down_offset, &down_span)?;
        } else {
            launch!(self, "expert_gate_up", gate_up_config;
                storage, table, ids, x, &mut *activated, &top_k, &num_experts,
                &args.hidden, &args.intermediate, &args.stride, &args.dtype, &args.gate_up_scales)?;
        }
        if let (Some(out), Some(shared)) = (summed, self.down_sum_shared_bytes(k, intermediate)?) {
            let rows = grid(tokens, MAX_GRID_Y, "expert tokens in one launch")?;
            let config = expert_launch(
                hidden,
                EXPERT_WARPS,
                rows,
                EXPERT_WARPS,
                shared,
                "expert row blocks",
            )?;
            launch!(self, "expert_down_sum", config;
                storage, table, ids, weights, &*activated, out, &top_k,
                &num_experts, &args.hidden, &args.intermediate, &args.stride, &args.dtype,
                &args.down_offset, &args.down_scales)?;
            return Ok(PairOutputs::Summed);
        }
        let down_config = expert_launch(
            hidden,
            EXPERT_WARPS * EXPERT_DOWN_ROWS,
            pairs_arg,
            EXPERT_WARPS,
            shared_bytes(intermediate)?,
            "expert row blocks",
        )?;
        launch!(self, "expert_down", down_config;
            storage, table, ids, weights, &*activated, pair_out,
            &num_experts, &args.hidden, &args.intermediate, &args.stride, &args.dtype,
            &args.down_offset, &args.down_scales)?;
        Ok(PairOutputs::PerPair)
    }

    /// The dynamic shared memory of an `expert_down_sum` launch (a token's `k` activated rows,
    /// padded), or `None` where it does not run: the option off, more choices than the kernel
    /// takes, or rows that do not fit the default dynamic shared memory.
    fn down_sum_shared_bytes(
        &self,
        k: usize,
        intermediate: usize,
    ) -> Result<Option<u32>, CudaError> {
        if !self.options.fused_expert_sum || k == 0 || k > DOWN_SUM_MAX_TOP_K {
            return Ok(None);
        }
        let bytes = (shared_bytes(intermediate)? as usize).checked_mul(k);
        Ok(bytes
            .filter(|&bytes| bytes <= DEFAULT_DYNAMIC_SHARED_BYTES)
            .and_then(|bytes| u32::try_from(bytes).ok()))
    }

    /// Whether a batch of `tokens` tokens with `k` choices each runs the per-pair kernels in
    /// one launch (what [`CudaBackend::launch_slotted_experts_by_device_routing`] takes).
    pub(super) fn pairwise_in_one_launch(tokens: usize, k: usize) -> bool {
        tokens < GROUPED_MIN_TOKENS && tokens.saturating_mul(k) <= MAX_PAIRS_PER_LAUNCH
    }

    /// [`CudaBackend::launch_slotted_experts`] with the routing still on the GPU (`ids`, u32 bits
    /// in an f32 buffer, and `weights`, `[tokens, k]`): no read-back, so nothing waits. Only for batches that
    /// [`CudaBackend::pairwise_in_one_launch`] takes; an empty slot set skips the launches.
    pub(super) fn launch_slotted_experts_by_device_routing(
        &self,
        slots: &CudaExpertSlots,
        x: &CudaTensor,
        ids: &CudaTensor,
        weights: &CudaTensor,
        k: usize,
    ) -> Result<CudaTensor, CudaError> {
        let layout = &slots.layout;
        let (hidden, intermediate) = (layout.hidden, layout.intermediate);
        let tokens = x.rows;
        let pairs = tokens * k;
        if x.cols != hidden
            || k == 0
            || tokens == 0
            || intermediate == 0
            || ids.rows * ids.cols < pairs
            || weights.rows * weights.cols < pairs
            || !Self::pairwise_in_one_launch(tokens, k)
            || slots.slot_table.is_empty()
        {
            // Same contract as the host-routing op: an inconsistent call (or no slot) leaves
            // zeros.
            return self.output(tokens, x.cols);
        }
        // `expert_pair_sum` (or `expert_down_sum`) writes every element, a pair whose expert
        // has no slot adding zeros: no zeroing launch, which in a step graph would also stand
        // between two kernels that otherwise overlap their launches (programmatic dependent
        // launch).
        let mut out = self.output_uninit(tokens, x.cols)?;
        let input = &*x.data;
        // SAFETY: u32 and f32 have the same size and every bit pattern is valid in both.
        let ids =
            unsafe { ids.data.transmute::<u32>(pairs) }.ok_or_else(|| CudaError::Invalid {
                problem: "the routing ids' buffer is too small".into(),
            })?;
        let weights = &*weights.data;
        // Recycled scratch: the per-pair kernels write every element the next one reads.
        let mut activated = self.output_uninit(1, pairs * intermediate)?;
        let mut pair_out = self.output_uninit(1, pairs * hidden)?;
        let pair_out = &mut *pair_out.data;
        let output = &mut *out.data;
        let outputs = self.launch_pairwise_experts(
            slots,
            &ids,
            &weights.slice(0..pairs),
            &input.slice(0..tokens * hidden),
            pairs,
            k,
            &mut activated.data,
            pair_out,
            Some(&mut output.slice_mut(0..tokens * hidden)),
        )?;
        if outputs == PairOutputs::Summed {
            return Ok(out);
        }
        self.launch_pair_sum(
            pair_out,
            &mut output.slice_mut(0..tokens * hidden),
            tokens,
            k,
            hidden,
        )?;
        Ok(out)
    }

    /// `out[t] = Σ_j pair_out[t·k + j]` for `tokens` tokens of `hidden` values, j in order.
    fn launch_pair_sum(
        &self,
        pair_out: &CudaSlice<f32>,
        out: &mut CudaViewMut<'_, f32>,
        tokens: usize,
        k: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let (count_arg, top_k, hidden_arg) = (
            int(tokens, "tokens")?,
            int(k, "top-k")?,
            int(hidden, "hidden")?,
        );
        launch!(self, "expert_pair_sum", elementwise(tokens * hidden);
            pair_out, out, &count_arg, &top_k, &hidden_arg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use crate::backend::cuda::kernels::kernel_define;
        assert_eq!(TILE_TOKENS as i64, kernel_define("experts", "TILE_TOKENS"));
        assert_eq!(
            FUSED_MIN_BLOCKS as i64,
            kernel_define("experts", "FUSED_MIN_BLOCKS")
        );
        assert_eq!(
            GATE_UP_TASK_BLOCKS_PER_SM as i64,
            kernel_define("experts", "GATE_UP_TASK_BLOCKS_PER_SM")
        );
        assert_eq!(
            GATE_UP_TASK_MAX_PAIRS as i64,
            kernel_define("experts", "GATE_UP_TASK_MAX_PAIRS")
        );
        assert_eq!(
            EXPERT_GROUP_PAIRS as i64,
            kernel_define("experts", "EXPERT_GROUP_PAIRS")
        );
        // Qwen3-30B-A3B's widths stage a whole group; twice the hidden width, half of one.
        assert_eq!(by_expert_group_pairs(2048, 768).ok(), Some(4));
        assert_eq!(by_expert_group_pairs(4096, 1536).ok(), Some(2));
        assert_eq!(
            i64::from(EXPERT_DOWN_ROWS),
            kernel_define("experts", "DOWN_ROWS")
        );
        assert_eq!(
            DOWN_SUM_MAX_TOP_K as i64,
            kernel_define("experts", "DOWN_SUM_MAX_TOP_K")
        );
        assert_eq!(
            i64::from(EXPERT_GATE_UP_COLUMNS),
            kernel_define("experts", "GATE_UP_COLUMNS")
        );
        assert_eq!(
            i64::from(GROUPED_WARPS),
            kernel_define("experts", "GROUPED_WARPS")
        );
        assert_eq!(
            i64::from(GROUPED_ROWS_PER_BLOCK),
            kernel_define("experts", "GROUPED_ROWS") * kernel_define("experts", "GROUPED_WARPS")
        );
        assert_eq!(
            MMA_TILE_TOKENS as i64,
            kernel_define("experts_mma", "MMA_TILE_TOKENS")
        );
        assert_eq!(
            i64::from(MMA_THREADS),
            kernel_define("experts_mma", "MMA_THREADS")
        );
        assert_eq!(
            i64::from(MMA_COLUMNS_PER_BLOCK),
            kernel_define("experts_mma", "MMA_COLUMNS")
        );
        assert_eq!(
            i64::from(MMA_ROWS_PER_BLOCK),
            kernel_define("experts_mma", "MMA_TILE_ROWS")
        );
        // The kernels' fixed thread roles: two threads stage each pair row, one each weight
        // row, four warps 2 × 2 of 32 pairs × 64 weight rows; a stage is one quantization group.
        assert_eq!(
            2 * MMA_TILE_TOKENS as i64,
            kernel_define("experts_mma", "MMA_THREADS")
        );
        assert_eq!(i64::from(MMA_ROWS_PER_BLOCK), i64::from(MMA_THREADS));
        assert_eq!(kernel_define("experts_mma", "MMA_WARPS"), 4);
        assert_eq!(
            kernel_define("experts_mma", "MMA_K"),
            kernel_define("experts", "GROUP")
        );
    }

    #[test]
    fn pairs_group_by_expert_in_tiles_of_at_most_tile_tokens() {
        // Experts 0..5; 1, 3 and 4 have slots 7, 0, 2. Expert 3 gets 35 pairs (three tiles),
        // expert 1 one pair, expert 4 none; expert 9 does not exist.
        let mut table = ExpertSlotTable::new(6, 8);
        for (slot, expert) in [(7, 1), (0, 3), (2, 4)] {
            table.assign(slot, expert).unwrap();
        }
        let mut ids = vec![3u32; 35];
        ids.extend([0, 1, 2, 9, 5]);
        ids.swap(3, 36); // pair 3 → expert 1, pair 36 → expert 3
        let groups = group_pairs(&ids, &table, TILE_TOKENS).unwrap();
        assert_eq!(groups.experts, 2);
        let expected_order: Vec<u32> = std::iter::once(3)
            .chain((0..37).filter(|&p| p != 3 && p != 35))
            .collect();
        assert_eq!(groups.order, expected_order);
        assert_eq!(
            groups.tiles,
            vec![0, 1, 7, 1, 16, 0, 17, 16, 0, 33, 3, 0],
            "[first, count, slot] per tile"
        );
        assert!(groups.worth_it(GROUPED_MIN_TOKENS));
        assert!(!groups.worth_it(GROUPED_MIN_TOKENS - 1));
        let none = group_pairs(&[0, 2, 5], &table, TILE_TOKENS).unwrap();
        assert!(none.order.is_empty() && none.tiles.is_empty() && none.experts == 0);
        // One pair for each of many experts: tiles of one pair, not worth grouping.
        let sparse = group_pairs(&[1, 3, 4], &table, TILE_TOKENS).unwrap();
        // The tensor-core tiles: expert 3's 35 pairs in one.
        let wide = group_pairs(&ids, &table, MMA_TILE_TOKENS).unwrap();
        assert_eq!(wide.order, groups.order);
        assert_eq!(wide.tiles, vec![0, 1, 7, 1, 35, 0]);
        assert_eq!(sparse.tile_count(), 3);
        assert!(!sparse.worth_it(64));
    }
}
