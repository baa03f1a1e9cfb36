//! One MoE layer's routed experts on the CPU: the API the engine's expert executor calls.
//!
//! Owns: `compute_layer` and `LayerScratch`. For a layer it takes a set of
//! (expert weights, token indices, routing weights) and *adds*
//! `Σ_e w_{t,e} · down_e(silu(gate_e · x_t) ⊙ (up_e · x_t))` into `output[t, :]`.
//!
//! The work runs on the pool in three phases separated by spin barriers:
//! 0. each thread prepares its share of (expert, token) input rows in the forms the path reads;
//! 1. units of (expert, 32 intermediate features) are split across threads: each computes the
//!    32 gate and 32 up rows for the expert's tokens, applies SwiGLU and prepares the result
//!    (one quantization group) for the down projection — activations never leave the cache;
//! 2. the output features are split into blocks of 16 across threads: each streams the `down`
//!    rows of its blocks for every expert and accumulates into its own output columns, so
//!    threads read disjoint weight memory and write disjoint output without atomics.
//!
//! Phases 1 and 2 hand out their work items from per-thread contiguous shares; a thread that
//! finishes its share takes unstarted items of the others' shares (one claim counter per share,
//! `KernelTuning::steal`), so a phase ends with its work rather than with its slowest thread. A
//! one-token batch (decode) prepares its input once, not once per expert.
//!
//! Nothing on this path allocates or locks: all buffers live in `LayerScratch`, sized once.
//! The scheduling and prefetch choices are the scratch's `KernelTuning` value, set by whoever
//! builds the scratch (`LayerScratch::with_tuning`); this module keeps no tuning state of its own.

use std::time::{Duration, Instant};

use crate::isa::{KernelIsa, AMX_MIN_TOKENS};
use crate::kernel_shared::ThreadBuffers;
use crate::kernels::{matmul_row_pairs, matmul_rows};
use crate::layout::{ExpertLayout, MatrixView, WeightDType, GROUP};
use crate::pool::{split_range, ThreadPool, WorkerContext};
use crate::prepare::{FormNeeds, Forms, FormsPtr, InputRows};
use crate::tuning::{DownSplit, KernelTuning};
use crate::KernelError;

/// Tokens one row-kernel call handles (bounds the per-thread output buffers).
const TOKEN_CHUNK: usize = 256;
/// Output rows per phase-2 work item (one AMX tile of rows).
const ROW_BLOCK: usize = 16;
/// Largest tokens-per-expert for which phase 2 splits (expert, row block) items across threads
/// and reduces afterwards (see `KernelTuning::down_split`).
const REDUCE_MAX_TOKENS: usize = 8;

/// One thread's claim counter for one phase, alone on its cache lines.
#[repr(align(128))]
struct ClaimCounter(std::sync::atomic::AtomicUsize);

/// The two matrices of one expert, as stored (`docs/FORMAT.md`).
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// `[2·Im, H]`: gate rows then up rows.
    pub gate_up: &'a [u8],
    /// `[H, Im]`.
    pub down: &'a [u8],
}

impl<'a> ExpertWeights<'a> {
    /// Splits one expert's slot of an expert bank (`bank_offset + E · stride`, `stride` bytes).
    pub fn from_slot(slot: &'a [u8], layout: &ExpertLayout) -> Result<Self, KernelError> {
        let end = layout.down_offset + layout.down.total_bytes;
        if slot.len() < end {
            return Err(KernelError::Input(format!(
                "expert slot of {} bytes is shorter than its {end}-byte layout",
                slot.len()
            )));
        }
        Ok(ExpertWeights {
            gate_up: &slot[..layout.gate_up.total_bytes],
            down: &slot[layout.down_offset..end],
        })
    }
}

/// One expert of a layer and the tokens routed to it.
#[derive(Debug, Clone, Copy)]
pub struct ExpertTask<'a> {
    pub weights: ExpertWeights<'a>,
    /// Row indices into `hidden` / `output`.
    pub tokens: &'a [u32],
    /// Routing weight of each of those tokens (same length).
    pub routing_weights: &'a [f32],
}

/// Upper bounds the scratch is sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchCapacity {
    /// Experts per call.
    pub max_tasks: usize,
    /// Σ over experts of their token counts per call (tokens × top-k for a full batch).
    pub max_pairs: usize,
}

#[derive(Clone, Copy)]
struct TaskInfo {
    gate_up: MatrixView,
    down: MatrixView,
    tokens: *const u32,
    routing_weights: *const f32,
    count: usize,
    first_slot: usize,
    amx_input: Option<usize>,
    amx_act: Option<usize>,
}

/// Every buffer `compute_layer` needs, for one expert layout, path and pool size.
pub struct LayerScratch {
    layout: ExpertLayout,
    isa: KernelIsa,
    threads: usize,
    capacity: ScratchCapacity,
    input: Forms,
    act: Forms,
    tasks: Vec<TaskInfo>,
    row_buffers: Vec<Vec<f32>>,
    strips: Vec<Vec<u16>>,
    tiles: Vec<Vec<f32>>,
    gate: Vec<Vec<f32>>,
    up: Vec<Vec<f32>>,
    thread_buffers: Vec<ThreadBuffers>,
    /// `[pairs, H]` down outputs for the reduce split (small batches only).
    down_out: Vec<f32>,
    down_out_pairs: usize,
    /// `[phase (gate_up, down), thread]`: items of the thread's share claimed so far.
    claims: Vec<ClaimCounter>,
    /// The choices every `compute_layer` call with this scratch runs with.
    tuning: KernelTuning,
    /// When thread 0 left barriers 1 and 2 in the last call.
    marks: [Option<Instant>; 2],
    last_phases: [Duration; 3],
}

// SAFETY: the raw pointers inside (task views, thread buffers) point into memory this scratch
// owns or into weights borrowed only for the duration of one `compute_layer` call.
unsafe impl Send for LayerScratch {}

impl LayerScratch {
    pub fn new(
        layout: ExpertLayout,
        isa: KernelIsa,
        threads: usize,
        capacity: ScratchCapacity,
    ) -> Result<Self, KernelError> {
        isa.require_supported()?;
        let threads = threads.max(1);
        if threads > MAX_THREADS {
            return Err(KernelError::Pool(format!(
                "{threads} threads, at most {MAX_THREADS} supported"
            )));
        }
        let needs = FormNeeds::of(isa, layout.dtype);
        // AMX tiles pad each expert's tokens to a multiple of 16.
        let amx_slots = capacity.max_pairs + 16 * capacity.max_tasks;
        let input = Forms::new(needs, layout.hidden, capacity.max_pairs, amx_slots);
        let act = Forms::new(needs, layout.intermediate, capacity.max_pairs, amx_slots);
        let widest = layout.hidden.max(layout.intermediate);
        let mut scratch = LayerScratch {
            layout,
            isa,
            threads,
            capacity,
            input,
            act,
            tasks: Vec::with_capacity(capacity.max_tasks),
            row_buffers: (0..threads).map(|_| vec![0.0; widest]).collect(),
            strips: (0..threads)
                .map(|_| {
                    let len = if isa == KernelIsa::Amx {
                        16 * widest.next_multiple_of(GROUP)
                    } else {
                        0
                    };
                    vec![0; len]
                })
                .collect(),
            tiles: (0..threads).map(|_| vec![0.0; 512]).collect(),
            gate: (0..threads)
                .map(|_| vec![0.0; TOKEN_CHUNK * GROUP.max(ROW_BLOCK)])
                .collect(),
            up: (0..threads)
                .map(|_| vec![0.0; TOKEN_CHUNK * GROUP])
                .collect(),
            thread_buffers: Vec::with_capacity(threads),
            down_out: vec![
                0.0;
                capacity
                    .max_pairs
                    .min(REDUCE_MAX_TOKENS * capacity.max_tasks)
                    * layout.hidden
            ],
            down_out_pairs: capacity
                .max_pairs
                .min(REDUCE_MAX_TOKENS * capacity.max_tasks),
            claims: (0..2 * threads)
                .map(|_| ClaimCounter(std::sync::atomic::AtomicUsize::new(0)))
                .collect(),
            tuning: KernelTuning::default(),
            marks: [None; 2],
            last_phases: [Duration::ZERO; 3],
        };
        for thread in 0..threads {
            scratch.thread_buffers.push(ThreadBuffers {
                row: scratch.row_buffers[thread].as_mut_ptr(),
                row_len: widest,
                strip: scratch.strips[thread].as_mut_ptr(),
                tiles: scratch.tiles[thread].as_mut_ptr(),
            });
        }
        Ok(scratch)
    }

    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    pub fn isa(&self) -> KernelIsa {
        self.isa
    }

    pub fn capacity(&self) -> ScratchCapacity {
        self.capacity
    }

    /// This scratch with `tuning` for every later `compute_layer` call (a new scratch runs
    /// `KernelTuning::default()`).
    pub fn with_tuning(mut self, tuning: KernelTuning) -> Self {
        self.tuning = tuning;
        self
    }

    pub fn tuning(&self) -> KernelTuning {
        self.tuning
    }

    /// Wall time of the last call's phases: input preparation, gate/up + SwiGLU, down.
    pub fn last_phase_times(&self) -> [Duration; 3] {
        self.last_phases
    }
}

/// Everything the pool's threads share during one call (raw pointers into the scratch, the
/// input and the output; see the SAFETY notes where they are used).
#[derive(Clone, Copy)]
struct LayerJob {
    isa: KernelIsa,
    layout: ExpertLayout,
    tasks: *const TaskInfo,
    task_count: usize,
    pairs: usize,
    hidden: *const f32,
    output: *mut f32,
    input: FormsPtr,
    act: FormsPtr,
    threads: *const ThreadBuffers,
    marks: *mut [Option<Instant>; 2],
    claims: *const ClaimCounter,
    tuning: KernelTuning,
    /// Every pair is token 0 of a one-token batch and its input forms are prepared in slot 0
    /// only (`KernelTuning::shared_decode_input`).
    shared_input: bool,
    /// Null unless phase 2 uses the reduce split.
    down_out: *mut f32,
}

// SAFETY: threads only write disjoint parts (their own pairs, units, output columns and thread
// buffers) between barriers; everything else is read-only during the call.
unsafe impl Sync for LayerJob {}

/// Adds this layer's routed-expert outputs into `output` (`[tokens, H]` f32, row-major).
///
/// `hidden` is `[tokens, H]` f32. Each task names an expert's weights, the token rows routed to
/// it and their routing weights. Runs on every thread of `pool` with `scratch`'s path.
pub fn compute_layer(
    pool: &ThreadPool,
    scratch: &mut LayerScratch,
    hidden: &[f32],
    tokens: usize,
    tasks: &[ExpertTask<'_>],
    output: &mut [f32],
) -> Result<(), KernelError> {
    let layout = scratch.layout;
    let h = layout.hidden;
    if scratch.threads != pool.threads() {
        return Err(KernelError::ScratchTooSmall(format!(
            "scratch was made for {} threads, the pool has {}",
            scratch.threads,
            pool.threads()
        )));
    }
    if hidden.len() < tokens * h || output.len() < tokens * h {
        return Err(KernelError::Input(format!(
            "hidden ({}) and output ({}) must hold {tokens} × {h} values",
            hidden.len(),
            output.len()
        )));
    }
    if tasks.len() > scratch.capacity.max_tasks {
        return Err(KernelError::ScratchTooSmall(format!(
            "{} experts in one call, scratch holds {}",
            tasks.len(),
            scratch.capacity.max_tasks
        )));
    }
    scratch.tasks.clear();
    let mut pairs = 0usize;
    let mut amx_input = 0usize;
    let mut amx_act = 0usize;
    for (index, task) in tasks.iter().enumerate() {
        let count = task.tokens.len();
        if task.routing_weights.len() != count {
            return Err(KernelError::Input(format!(
                "expert task {index}: {count} tokens but {} routing weights",
                task.routing_weights.len()
            )));
        }
        if let Some(&bad) = task.tokens.iter().find(|&&t| t as usize >= tokens) {
            return Err(KernelError::Input(format!(
                "expert task {index}: token {bad} out of range (batch of {tokens})"
            )));
        }
        // AMX multiplies bf16 tiles: f32 experts would lose their precision there (near-tied
        // logits of an f32 model then flip), so they stay on the f32 FMA kernels.
        let uses_amx = scratch.isa == KernelIsa::Amx
            && count >= AMX_MIN_TOKENS
            && layout.dtype != WeightDType::F32;
        let (task_amx_input, task_amx_act) = if uses_amx {
            let slots = count.next_multiple_of(16);
            let bases = (amx_input, amx_act);
            amx_input += slots * scratch.input.amx_padded / 2;
            amx_act += slots * scratch.act.amx_padded / 2;
            (Some(bases.0), Some(bases.1))
        } else {
            (None, None)
        };
        scratch.tasks.push(TaskInfo {
            gate_up: MatrixView::new(task.weights.gate_up, layout.gate_up)?,
            down: MatrixView::new(task.weights.down, layout.down)?,
            tokens: task.tokens.as_ptr(),
            routing_weights: task.routing_weights.as_ptr(),
            count,
            first_slot: pairs,
            amx_input: task_amx_input,
            amx_act: task_amx_act,
        });
        pairs += count;
    }
    if pairs > scratch.capacity.max_pairs {
        return Err(KernelError::ScratchTooSmall(format!(
            "{pairs} (expert, token) pairs in one call, scratch holds {}",
            scratch.capacity.max_pairs
        )));
    }
    if pairs == 0 {
        return Ok(());
    }
    let tuning = scratch.tuning;
    let reduce = tuning.down_split == DownSplit::Auto
        && pairs <= scratch.down_out_pairs
        && scratch
            .tasks
            .iter()
            .all(|task| task.count <= REDUCE_MAX_TOKENS);
    let shared_input = tuning.shared_decode_input
        && tokens == 1
        && scratch
            .tasks
            .iter()
            .all(|task| task.count <= 1 && task.amx_input.is_none());
    for claim in &scratch.claims {
        claim.0.store(0, std::sync::atomic::Ordering::Relaxed);
    }
    let job = LayerJob {
        isa: scratch.isa,
        layout,
        tasks: scratch.tasks.as_ptr(),
        task_count: scratch.tasks.len(),
        pairs,
        hidden: hidden.as_ptr(),
        output: output.as_mut_ptr(),
        input: scratch.input.pointers(),
        act: scratch.act.pointers(),
        threads: scratch.thread_buffers.as_ptr(),
        marks: &mut scratch.marks,
        claims: scratch.claims.as_ptr(),
        tuning,
        shared_input,
        down_out: if reduce {
            scratch.down_out.as_mut_ptr()
        } else {
            std::ptr::null_mut()
        },
    };
    let gate_ptrs = GatePointers::of(scratch);
    let start = Instant::now();
    pool.run(&|context: &WorkerContext<'_>| {
        // SAFETY: see LayerJob: every phase writes only this thread's share.
        unsafe { job.run(context, &gate_ptrs) }
    })?;
    let end = Instant::now();
    if let [Some(first), Some(second)] = scratch.marks {
        scratch.last_phases = [first - start, second - first, end - second];
    }
    Ok(())
}

/// Per-thread SwiGLU buffers, indexed by pool thread.
struct GatePointers {
    gate: [*mut f32; MAX_THREADS],
    up: [*mut f32; MAX_THREADS],
}

/// Most threads one pool may have (a fixed table avoids a per-call allocation).
pub const MAX_THREADS: usize = 256;

// SAFETY: thread i only uses entry i.
unsafe impl Sync for GatePointers {}

impl GatePointers {
    fn of(scratch: &mut LayerScratch) -> GatePointers {
        let mut pointers = GatePointers {
            gate: [std::ptr::null_mut(); MAX_THREADS],
            up: [std::ptr::null_mut(); MAX_THREADS],
        };
        for thread in 0..scratch.threads.min(MAX_THREADS) {
            pointers.gate[thread] = scratch.gate[thread].as_mut_ptr();
            pointers.up[thread] = scratch.up[thread].as_mut_ptr();
        }
        pointers
    }
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

impl LayerJob {
    unsafe fn task(&self, index: usize) -> &TaskInfo {
        &*self.tasks.add(index)
    }

    /// Claims the next work item of `phase` (0: gate_up, 1: down) out of `0..total`: this
    /// thread's own share first, in order, then (with `KernelTuning::steal`) unstarted items of
    /// the other threads' shares. `victim` is the caller's cursor over the shares (start at 0).
    unsafe fn claim(
        &self,
        phase: usize,
        context: &WorkerContext<'_>,
        total: usize,
        victim: &mut usize,
    ) -> Option<usize> {
        let count = context.count;
        let shares = if self.tuning.steal { count } else { 1 };
        while *victim < shares {
            let owner = (context.index + *victim) % count;
            let share = split_range(total, owner, count);
            let counter = &(*self.claims.add(phase * count + owner)).0;
            // Relaxed: the counter only hands out indices; data is published by the barriers.
            let taken = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if taken < share.len() {
                return Some(share.start + taken);
            }
            *victim += 1;
        }
        None
    }

    /// Rows `first..first + rows` of a task's down projection times `input`, with this
    /// layer's kernel and prefetch distance.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn down_rows(
        &self,
        task: &TaskInfo,
        first: usize,
        rows: usize,
        input: &InputRows,
        out: *mut f32,
        token_stride: usize,
        buffers: &ThreadBuffers,
    ) {
        let prefetch = self.tuning.prefetch;
        matmul_rows(
            self.isa,
            &task.down,
            first,
            rows,
            input,
            out,
            token_stride,
            buffers,
            prefetch,
        );
    }

    /// Adds `Σ_task weight · down_out` of the given row blocks into the output, tasks in order.
    unsafe fn add_down_outputs(&self, blocks: std::ops::Range<usize>) {
        let h = self.layout.hidden;
        let (first, last) = (blocks.start * ROW_BLOCK, (blocks.end * ROW_BLOCK).min(h));
        for task_index in 0..self.task_count {
            let task = self.task(task_index);
            for t in 0..task.count {
                let token = *task.tokens.add(t) as usize;
                let weight = *task.routing_weights.add(t);
                let source = self.down_out.add((task.first_slot + t) * h);
                let destination = self.output.add(token * h);
                for column in first..last {
                    *destination.add(column) += weight * *source.add(column);
                }
            }
        }
    }

    unsafe fn run(&self, context: &WorkerContext<'_>, gates: &GatePointers) {
        let buffers = &*self.threads.add(context.index);
        let h = self.layout.hidden;
        let im = self.layout.intermediate;
        let int4 = self.layout.dtype == crate::layout::WeightDType::Int4;

        let units_per_task = im.div_ceil(GROUP);
        let gate_up_items = self.task_count * units_per_task;
        let row_blocks = h.div_ceil(ROW_BLOCK);
        // Phase 0: input rows of (expert, token) pairs, split by (pair, group of 32) so even
        // one decode token is shared by all threads. With a shared decode input only slot 0
        // (token 0, which every pair reads) is prepared.
        let groups = h.div_ceil(GROUP);
        if self.shared_input {
            let task = self.task(0);
            for group in context.split(groups) {
                let first = group * GROUP;
                let values =
                    std::slice::from_raw_parts(self.hidden.add(first), GROUP.min(h - first));
                self.input.write_group(task.first_slot, group, values);
            }
        } else {
            let mine = context.split(self.pairs * groups);
            for task_index in 0..self.task_count {
                let task = self.task(task_index);
                let start = mine.start.max(task.first_slot * groups);
                let end = mine.end.min((task.first_slot + task.count) * groups);
                for item in start..end {
                    let slot = item / groups;
                    let group = item % groups;
                    let local = slot - task.first_slot;
                    let token = *task.tokens.add(local) as usize;
                    let first = group * GROUP;
                    let values = std::slice::from_raw_parts(
                        self.hidden.add(token * h + first),
                        GROUP.min(h - first),
                    );
                    self.input.write_group(slot, group, values);
                    if let Some(base) = task.amx_input {
                        self.input.write_amx(base, local, group, values, int4);
                    }
                }
            }
        }
        context.barrier();
        if context.index == 0 {
            (*self.marks)[0] = Some(Instant::now());
        }

        // Phase 1: gate/up rows + SwiGLU, per (expert, 32 intermediate features).
        let gate = gates.gate[context.index];
        let up = gates.up[context.index];
        let input_slot0 = self.task(0).first_slot;
        let mut victim = 0;
        while let Some(unit) = self.claim(0, context, gate_up_items, &mut victim) {
            let task = self.task(unit / units_per_task);
            let chunk = unit % units_per_task;
            let first = chunk * GROUP;
            let rows = GROUP.min(im - first);
            let mut t0 = 0;
            while t0 < task.count {
                let tokens = TOKEN_CHUNK.min(task.count - t0);
                let input = InputRows {
                    forms: self.input,
                    first_slot: if self.shared_input {
                        input_slot0
                    } else {
                        task.first_slot + t0
                    },
                    tokens,
                    amx_base: task
                        .amx_input
                        .map(|base| base + (t0 / 16) * self.input.amx_padded / 2 * 16),
                };
                matmul_row_pairs(
                    self.isa,
                    &task.gate_up,
                    first,
                    im + first,
                    rows,
                    &input,
                    gate,
                    up,
                    GROUP,
                    buffers,
                    self.tuning.prefetch,
                );
                for t in 0..tokens {
                    let g = std::slice::from_raw_parts_mut(gate.add(t * GROUP), rows);
                    let u = std::slice::from_raw_parts(up.add(t * GROUP), rows);
                    for (gv, &uv) in g.iter_mut().zip(u) {
                        *gv = silu(*gv) * uv;
                    }
                    self.act.write_group(task.first_slot + t0 + t, chunk, g);
                    if let Some(base) = task.amx_act {
                        self.act.write_amx(base, t0 + t, chunk, g, int4);
                    }
                }
                t0 += tokens;
            }
        }
        context.barrier();
        if context.index == 0 {
            (*self.marks)[1] = Some(Instant::now());
        }

        if !self.down_out.is_null() {
            // Phase 2 (reduce split): (expert, row block) items, one contiguous run per thread.
            let mut victim = 0;
            while let Some(item) = self.claim(1, context, self.task_count * row_blocks, &mut victim)
            {
                let task = self.task(item / row_blocks);
                let first = (item % row_blocks) * ROW_BLOCK;
                let rows = ROW_BLOCK.min(h - first);
                let input = InputRows {
                    forms: self.act,
                    first_slot: task.first_slot,
                    tokens: task.count,
                    amx_base: None,
                };
                let destination = self.down_out.add(task.first_slot * h + first);
                if rows == ROW_BLOCK {
                    // Two 8-row halves as two streams in one pass (see `matmul_row_pairs`).
                    let half = ROW_BLOCK / 2;
                    matmul_row_pairs(
                        self.isa,
                        &task.down,
                        first,
                        first + half,
                        half,
                        &input,
                        destination,
                        destination.add(half),
                        h,
                        buffers,
                        self.tuning.prefetch,
                    );
                } else {
                    self.down_rows(task, first, rows, &input, destination, h, buffers);
                }
            }
            context.barrier();
            // Phase 3: each thread adds its output columns.
            self.add_down_outputs(split_range(row_blocks, context.index, context.count));
            return;
        }

        // Phase 2 (rows split): output features split in blocks of 16.
        let blocks = split_range(row_blocks, context.index, context.count);
        let y = gate;
        for task_index in 0..self.task_count {
            let task = self.task(task_index);
            let mut t0 = 0;
            while t0 < task.count {
                let tokens = TOKEN_CHUNK.min(task.count - t0);
                let input = InputRows {
                    forms: self.act,
                    first_slot: task.first_slot + t0,
                    tokens,
                    amx_base: task
                        .amx_act
                        .map(|base| base + (t0 / 16) * self.act.amx_padded / 2 * 16),
                };
                for block in blocks.clone() {
                    let first = block * ROW_BLOCK;
                    let rows = ROW_BLOCK.min(h - first);
                    self.down_rows(task, first, rows, &input, y, ROW_BLOCK, buffers);
                    for t in 0..tokens {
                        let token = *task.tokens.add(t0 + t) as usize;
                        let weight = *task.routing_weights.add(t0 + t);
                        let destination = self.output.add(token * h + first);
                        for r in 0..rows {
                            *destination.add(r) += weight * *y.add(t * ROW_BLOCK + r);
                        }
                    }
                }
                t0 += tokens;
            }
        }
    }
}
