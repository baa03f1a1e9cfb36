// Routed experts held in GPU slots (see services/engine/src/backend/cuda/device/experts.rs).
//
// Slots are one device buffer of `slots × stride` bytes; each slot holds one expert exactly as
// its bank stores it (docs/FORMAT.md): `gate_up` [2·I, H] at offset 0, `down` [H, I] at
// `down_offset`, each either f32, bf16, or int8 / int4 with one f16 scale per 32 inputs (the
// scales at `*_scales` from the matrix start). `slot_of_expert[e]` is e's slot or −1: the table
// is device data so a later expert cache can change residency between steps without touching
// the launches. Weights are dequantized in the kernel, accumulation is f32.
//
// One MoE layer is three launches over all (token, choice) pairs of the batch at once:
//   gate_up   activated[p, c] = silu(gate_c · x_t) · (up_c · x_t)     (slotted pairs only)
//   down      pair_out[p, r]  = w_p · (down_r · activated[p])         (0 for other pairs)
//   expert_pair_sum out[t, r] = Σ_j pair_out[t·k + j, r]              (fixed order)
// (`expert_down_sum`, below, is down and the pair sum in one launch, with their bits.)
// with three kernels for gate_up and down:
//   * per pair (`expert_gate_up`, `expert_down`; small batches, decode): each warp computes
//     GATE_UP_COLUMNS activated columns (gate_up) or DOWN_ROWS output rows (down) of one pair,
//     the pair's input vector sits in shared memory. Every pair reads
//     its expert's whole matrices.
//   * by expert (`expert_gate_up_by_expert`, `expert_down_by_expert`; decode batches of several
//     tokens): the per-pair grid and bits, each expert's weights read once for up to
//     EXPERT_GROUP_PAIRS of its pairs (groups found on the device, see below).
//   * grouped (`expert_gate_up_grouped`, `expert_down_grouped`; prefill): the host groups the
//     slotted pairs by expert and cuts each expert's list into tiles of ≤ TILE_TOKENS pairs
//     (`tiles[3·i ..]` = first index into `order`, count, slot; `order` = pair indices). A block
//     takes one tile and a range of output rows; the tile's inputs are staged in shared memory
//     CHUNK inputs at a time and each warp keeps GROUPED_ROWS rows × TILE_TOKENS accumulators in
//     registers, so each weight is read once per tile instead of once per pair.
//
// Reduction order (the same in both kernels, so results do not depend on the batch or on which
// kernel ran): lane l of a warp accumulates, in increasing input order, the inputs c ≡ l mod 32
// (f32, bf16) or the 16-input segments s ≡ l mod 32 (int8, int4: the weight is dequantized
// exactly, q · scale, then multiplied), with explicit fused multiply-adds; then the 32 lane sums
// are added by one xor butterfly. This depends only on the reduction length. Summing the pairs
// in a fixed order (no atomics) keeps results deterministic and independent of the batch.
//
// Inputs in shared memory are padded: input c lives at (c / 16) · 20 + c % 16, so the 16-input
// segments of 32 lanes fall in distinct banks (quantized reads are float4, conflict-free).
//
// Tensor-core kernels (`expert_gate_up_mma`, `expert_down_mma` in kernels/experts_mma.cu, the
// helpers both files use in kernels/experts_common.cuh; large prefill batches when the
// backend's tensor-core option is on, bf16 / int8 / int4 experts): the same tiles of one expert's
// pairs (up to MMA_TILE_TOKENS) as a GEMM on `mma.sync.m16n8k16` (bf16 inputs, f32 accumulation).
// Activations are rounded to bf16 (nearest even) when staged; weights are dequantized exactly
// (q · scale in f32) and rounded to bf16. So these do not give the SIMT kernels' bits: they are
// held to them and to the f32 reference within bf16 tolerances (tests/cuda_tensor_cores.rs).
//
// Quantized rows of any width: a row of `cols` inputs is stored as stored_cols(cols) codes (a
// last partial group padded with code 0, which decodes to exactly 0), so the quantized loops run
// over ceil(cols / 16) segments and the inputs past `cols` of the last one are staged as 0.

#include "common.cuh"
#include "experts_common.cuh"


// grid (ceil(intermediate / (warps · GATE_UP_COLUMNS)), pairs), dynamic shared memory
// ceil(hidden / 16) · 20 floats.
extern "C" __global__ void expert_gate_up(const unsigned char* slots, const int* slot_of_expert,
                                          const unsigned int* ids, const float* x,
                                          float* activated, int top_k, int num_experts,
                                          int hidden, int intermediate, long long stride,
                                          int dtype, long long gate_up_scales) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float shared_x[];
    int p = blockIdx.y;
    int slot = pair_slot(slot_of_expert, ids, p, num_experts);
    if (slot < 0) return;  // the whole block leaves together
    const float* xt = x + (long long)(p / top_k) * hidden;
    int warps = blockDim.x / 32;
    int lane = threadIdx.x % 32;
    int c0 = (blockIdx.x * warps + threadIdx.x / 32) * GATE_UP_COLUMNS;
    const unsigned char* matrix = slots + (long long)slot * stride;
#if GATE_UP_COLUMNS == 1
    // Quantized rows of at most 4 segments per lane: both rows' weights are loaded before the
    // input is staged, so the loads are in flight during the staging and its barrier.
    int segs = (segments_of(hidden) + 31) / 32;
    if ((dtype == DTYPE_INT8 || dtype == DTYPE_INT4) && segs <= 4) {
        uint4 gate_bits[4], up_bits[4];
        float gate_scale[4], up_scale[4];
        bool live = c0 < intermediate;
        if (live) {
            if (dtype == DTYPE_INT8) {
                load_row_segments<DTYPE_INT8, 4>(matrix, gate_up_scales, c0, hidden, lane,
                                                 gate_bits, gate_scale);
                load_row_segments<DTYPE_INT8, 4>(matrix, gate_up_scales, intermediate + c0,
                                                 hidden, lane, up_bits, up_scale);
            } else {
                load_row_segments<DTYPE_INT4, 4>(matrix, gate_up_scales, c0, hidden, lane,
                                                 gate_bits, gate_scale);
                load_row_segments<DTYPE_INT4, 4>(matrix, gate_up_scales, intermediate + c0,
                                                 hidden, lane, up_bits, up_scale);
            }
        }
        for (int c = threadIdx.x; c < segments_of(hidden) * SEG; c += blockDim.x)
            shared_x[padded(c)] = c < hidden ? xt[c] : 0.0f;
        __syncthreads();
        if (!live) return;
        float gate_partial, up_partial;
        if (dtype == DTYPE_INT8) {
            gate_partial = loaded_row_dot_partial<DTYPE_INT8, 4>(gate_bits, gate_scale, hidden,
                                                                 shared_x, lane);
            up_partial = loaded_row_dot_partial<DTYPE_INT8, 4>(up_bits, up_scale, hidden,
                                                               shared_x, lane);
        } else {
            gate_partial = loaded_row_dot_partial<DTYPE_INT4, 4>(gate_bits, gate_scale, hidden,
                                                                 shared_x, lane);
            up_partial = loaded_row_dot_partial<DTYPE_INT4, 4>(up_bits, up_scale, hidden,
                                                               shared_x, lane);
        }
        float gate = warp_sum(gate_partial);
        float up = warp_sum(up_partial);
        if (lane == 0) activated[(long long)p * intermediate + c0] = silu(gate) * up;
        return;
    }
#endif
    // Zero past `hidden` up to the last segment: a quantized row's padding meets 0.
    for (int c = threadIdx.x; c < segments_of(hidden) * SEG; c += blockDim.x)
        shared_x[padded(c)] = c < hidden ? xt[c] : 0.0f;
    __syncthreads();
    if (c0 >= intermediate) return;
    // Every row's loads before any butterfly.
    float gate_partial[GATE_UP_COLUMNS], up_partial[GATE_UP_COLUMNS];
#pragma unroll
    for (int i = 0; i < GATE_UP_COLUMNS; ++i) {
        int c = c0 + i;
        bool live = c < intermediate;
        gate_partial[i] =
            live ? row_dot_partial(matrix, gate_up_scales, dtype, c, hidden, shared_x, lane) : 0.0f;
        up_partial[i] = live ? row_dot_partial(matrix, gate_up_scales, dtype, intermediate + c,
                                               hidden, shared_x, lane)
                             : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < GATE_UP_COLUMNS; ++i) {
        float gate = warp_sum(gate_partial[i]);
        float up = warp_sum(up_partial[i]);
        if (lane == 0 && c0 + i < intermediate)
            activated[(long long)p * intermediate + c0 + i] = silu(gate) * up;
    }
}

// Decode of one token, quantized experts whose rows span at most 4 segments per lane: the
// activations of `expert_gate_up` (same sums, same order, same bits) from a grid that fits the
// GPU at once (GATE_UP_TASK_BLOCKS_PER_SM blocks per multiprocessor, as the host launches it),
// each warp walking (pair, column) tasks with the next task's rows loaded while the current
// one is computed. The per-pair grid's 768 blocks at Qwen3-30B-A3B's shapes take a second,
// mostly empty wave (4 blocks of 64 registers fit a multiprocessor); this takes none
// (kernel bench, H100, int8, 8 pairs: 15.80 against 17.65 µs).
// Dynamic shared memory: the token's input, padded (ceil(hidden / 16) · 20 floats); pairs ≤
// GATE_UP_TASK_MAX_PAIRS.
#define GATE_UP_TASK_BLOCKS_PER_SM 2
#define GATE_UP_TASK_MAX_PAIRS 64
// The next launch, `expert_down_sum`, reads the pairs' down matrices: the task grid asks L2 for
// them (`down_span` bytes from `down_offset` in each pair's slot; 0: nothing), spread over every
// warp of the grid, so they stream from HBM while this kernel's tail and the next launch leave
// it idle (DOWN_PREFETCH 1: after a warp's last task; 2: before its first).
#ifndef DOWN_PREFETCH
#define DOWN_PREFETCH 1
#endif
__device__ __forceinline__ void prefetch_down_matrices(const unsigned char* slots,
                                                       const int* slot_of, int pairs,
                                                       long long stride, long long down_offset,
                                                       long long down_span, int lane) {
    if (down_span <= 0) return;
    long long lines_per_pair = (down_span + 127) / 128;
    long long warps_total = (long long)gridDim.x * (blockDim.x / 32);
    long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    long long lines = lines_per_pair * pairs;
    for (long long line = warp * 32 + lane; line < lines; line += warps_total * 32) {
        int p = (int)(line / lines_per_pair);
        int slot = slot_of[p];
        if (slot < 0) continue;
        const unsigned char* at =
            slots + (long long)slot * stride + down_offset + (line % lines_per_pair) * 128;
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(at));
    }
}

// The block's tasks; the first one's rows are loaded before the token's input `x` is staged
// into `shared_x` (so they are in flight during the staging and its barrier).
template <int DT>
__device__ __forceinline__ void gate_up_tasks(const unsigned char* slots, const int* slot_of,
                                              const float* x, float* shared_x, float* activated,
                                              int intermediate, int hidden, long long stride,
                                              long long gate_up_scales, int tasks,
                                              int first_task, long long down_offset,
                                              long long down_span) {
    int lane = threadIdx.x % 32;
    int warps_total = gridDim.x * (blockDim.x / 32);
#if DOWN_PREFETCH == 2
    prefetch_down_matrices(slots, slot_of, tasks / intermediate, stride, down_offset, down_span,
                           lane);
#endif
    int task = first_task;
    uint4 gate_bits[4], up_bits[4];
    float gate_scale[4], up_scale[4];
    {
        int slot = task < tasks ? slot_of[task / intermediate] : -1;
        if (slot >= 0) {
            const unsigned char* matrix = slots + (long long)slot * stride;
            int c = task % intermediate;
            load_row_segments<DT, 4>(matrix, gate_up_scales, c, hidden, lane, gate_bits,
                                     gate_scale);
            load_row_segments<DT, 4>(matrix, gate_up_scales, intermediate + c, hidden, lane,
                                     up_bits, up_scale);
        }
    }
    stage_padded_rows(x, 1, hidden, nullptr, shared_x);
    __syncthreads();
    while (task < tasks) {
        int next = task + warps_total;
        uint4 next_gate_bits[4], next_up_bits[4];
        float next_gate_scale[4], next_up_scale[4];
        int next_slot = next < tasks ? slot_of[next / intermediate] : -1;
        if (next_slot >= 0) {
            const unsigned char* matrix = slots + (long long)next_slot * stride;
            int c = next % intermediate;
            load_row_segments<DT, 4>(matrix, gate_up_scales, c, hidden, lane, next_gate_bits,
                                     next_gate_scale);
            load_row_segments<DT, 4>(matrix, gate_up_scales, intermediate + c, hidden, lane,
                                     next_up_bits, next_up_scale);
        }
        int p = task / intermediate, c = task % intermediate;
        if (slot_of[p] >= 0) {
            float gate = warp_sum(
                loaded_row_dot_partial<DT, 4>(gate_bits, gate_scale, hidden, shared_x, lane));
            float up =
                warp_sum(loaded_row_dot_partial<DT, 4>(up_bits, up_scale, hidden, shared_x, lane));
            if (lane == 0) activated[(long long)p * intermediate + c] = silu(gate) * up;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            gate_bits[q] = next_gate_bits[q];
            up_bits[q] = next_up_bits[q];
            gate_scale[q] = next_gate_scale[q];
            up_scale[q] = next_up_scale[q];
        }
        task = next;
    }
#if DOWN_PREFETCH == 1
    prefetch_down_matrices(slots, slot_of, tasks / intermediate, stride, down_offset, down_span,
                           lane);
#endif
}

// grid (GATE_UP_TASK_BLOCKS_PER_SM · multiprocessors), 256 threads; the arguments of
// `expert_gate_up`, the pair count (the pairs of one token: ids[0 .. pairs)), and the down
// matrices to ask L2 for (`prefetch_down_matrices`; down_span 0: none).
extern "C" __global__ void __launch_bounds__(256, GATE_UP_TASK_BLOCKS_PER_SM)
    expert_gate_up_tasks(const unsigned char* slots,
                                                const int* slot_of_expert,
                                                const unsigned int* ids, const float* x,
                                                float* activated, int top_k, int num_experts,
                                                int hidden, int intermediate, long long stride,
                                                int dtype, long long gate_up_scales, int pairs,
                                                long long down_offset, long long down_span) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float shared_x[];
    __shared__ int slot_of[GATE_UP_TASK_MAX_PAIRS];
    if (pairs > GATE_UP_TASK_MAX_PAIRS || (dtype != DTYPE_INT8 && dtype != DTYPE_INT4)) return;
    for (int j = threadIdx.x; j < pairs; j += blockDim.x)
        slot_of[j] = pair_slot(slot_of_expert, ids, j, num_experts);
    __syncthreads();
    int first_task = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int tasks = pairs * intermediate;
    // dtype is the same for the whole block: the barrier inside is reached by every thread.
    if (dtype == DTYPE_INT8)
        gate_up_tasks<DTYPE_INT8>(slots, slot_of, x, shared_x, activated, intermediate, hidden,
                                  stride, gate_up_scales, tasks, first_task, down_offset,
                                  down_span);
    else
        gate_up_tasks<DTYPE_INT4>(slots, slot_of, x, shared_x, activated, intermediate, hidden,
                                  stride, gate_up_scales, tasks, first_task, down_offset,
                                  down_span);
}

// grid (ceil(hidden / (warps · DOWN_ROWS)), pairs), dynamic shared memory
// ceil(intermediate / 16) · 20 floats. Each warp computes DOWN_ROWS consecutive output rows (a
// row is short, intermediate values: several rows' loads in flight per warp), each row's sum
// formed exactly as one row per warp would form it.
extern "C" __global__ void expert_down(const unsigned char* slots, const int* slot_of_expert,
                                       const unsigned int* ids, const float* weights,
                                       const float* activated, float* pair_out, int num_experts,
                                       int hidden, int intermediate, long long stride, int dtype,
                                       long long down_offset, long long down_scales) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float shared_a[];
    int p = blockIdx.y;
    int slot = pair_slot(slot_of_expert, ids, p, num_experts);
    int warps = blockDim.x / 32;
    int lane = threadIdx.x % 32;
    int r0 = (blockIdx.x * warps + threadIdx.x / 32) * DOWN_ROWS;
    if (slot < 0) {
        // Other pairs add nothing: their experts run elsewhere.
        if (lane < DOWN_ROWS && r0 + lane < hidden) pair_out[(long long)p * hidden + r0 + lane] = 0.0f;
        return;
    }
    const float* ap = activated + (long long)p * intermediate;
    // Zero past `intermediate` up to the last segment: a quantized row's padding meets 0.
    for (int c = threadIdx.x; c < segments_of(intermediate) * SEG; c += blockDim.x)
        shared_a[padded(c)] = c < intermediate ? ap[c] : 0.0f;
    __syncthreads();
    if (r0 >= hidden) return;
    const unsigned char* matrix = slots + (long long)slot * stride + down_offset;
    float partial[DOWN_ROWS];
#pragma unroll
    for (int i = 0; i < DOWN_ROWS; ++i) {
        partial[i] = r0 + i < hidden
                         ? row_dot_partial(matrix, down_scales, dtype, r0 + i, intermediate,
                                           shared_a, lane)
                         : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < DOWN_ROWS; ++i) {
        float y = warp_sum(partial[i]);
        if (lane == 0 && r0 + i < hidden) pair_out[(long long)p * hidden + r0 + i] = weights[p] * y;
    }
}

// Down projection and pair sum in one launch (decode). ------------------------------------------
//
// out[t, r] = Σ_j w_(t·k+j) · (down_r · activated[t·k + j]), j in increasing order: the bits of
// `expert_down` then `expert_pair_sum` (each product rounded, then added to a sum that starts
// at 0, a pair without a slot adding 0), without the pair outputs' round trip and the third
// launch. Grid (ceil(hidden / warps), tokens), one output row per warp; dynamic shared memory
// top_k · ceil(intermediate / 16) · 20 floats (the token's activated rows, padded).
//
// Quantized experts whose rows span at most 4 segments per lane load the
// weights of DOWN_SUM_LOADS / segs pairs into registers before any is used (and the first
// batch before the activations are staged), so a lane keeps that many 16-byte loads in flight;
// the sums are formed exactly as `row_dot_partial` forms them.

// Stages the token's activated rows (pairs with a slot) into shared memory, padded, zero past
// `intermediate`; synchronises the block.
__device__ __forceinline__ void stage_token_activations(const float* activated, const int* slot_of,
                                                        int first_pair, int top_k,
                                                        int intermediate, float* shared_a) {
    stage_padded_rows(activated + (long long)first_pair * intermediate, top_k, intermediate,
                      slot_of, shared_a);
    __syncthreads();
}

// The pairs' sum for row r in pair order: the product rounded, then added (no contraction, as
// the two kernels it replaces round and add).
__device__ __forceinline__ float add_pair(float sum, float partial, int slot, float weight) {
    float y = warp_sum(partial);
    return __fadd_rn(sum, slot >= 0 ? __fmul_rn(weight, y) : 0.0f);
}

template <int DT, int SEGS>
__device__ __forceinline__ void down_sum_row_prefetched(
    const unsigned char* slots, const int* slot_of, const float* pair_weights, int top_k,
    const float* activated, float* shared_a, float* out, int first_pair, int row, bool live,
    int hidden, int intermediate, long long stride, long long down_offset, long long down_scales,
    int lane) {
    constexpr int BATCH = DOWN_SUM_LOADS / SEGS;
    int padded_width = segments_of(intermediate) * SEG_STRIDE;
    float sum = 0.0f;
    for (int j0 = 0; j0 < top_k; j0 += BATCH) {
        uint4 bits[BATCH][SEGS];
        float scale[BATCH][SEGS];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            int j = j0 + b;
            int slot = j < top_k ? slot_of[j] : -1;
            if (live && slot >= 0) {
                load_row_segments<DT, SEGS>(slots + (long long)slot * stride + down_offset,
                                            down_scales, row, intermediate, lane, bits[b],
                                            scale[b]);
            }
        }
        // The first batch's loads are in flight while the activations are staged.
        if (j0 == 0)
            stage_token_activations(activated, slot_of, first_pair, top_k, intermediate,
                                    shared_a);
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            int j = j0 + b;
            if (j < top_k) {
                int slot = slot_of[j];
                float partial = live && slot >= 0
                                    ? loaded_row_dot_partial<DT, SEGS>(
                                          bits[b], scale[b], intermediate,
                                          shared_a + j * padded_width, lane)
                                    : 0.0f;
                sum = add_pair(sum, partial, slot, pair_weights[first_pair + j]);
            }
        }
    }
    if (live && lane == 0) out[row] = sum;
}

extern "C" __global__ void expert_down_sum(const unsigned char* slots, const int* slot_of_expert,
                                           const unsigned int* ids, const float* weights,
                                           const float* activated, float* out, int top_k,
                                           int num_experts, int hidden, int intermediate,
                                           long long stride, int dtype, long long down_offset,
                                           long long down_scales) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float shared_a[];
    __shared__ int slot_of[DOWN_SUM_MAX_TOP_K];
    int t = blockIdx.y;
    int first_pair = t * top_k;
    for (int j = threadIdx.x; j < top_k; j += blockDim.x)
        slot_of[j] = pair_slot(slot_of_expert, ids, first_pair + j, num_experts);
    __syncthreads();
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    // Warps past the last row still take part in the block's staging barrier.
    bool live = row < hidden;
    float* out_row = out + (long long)t * hidden;
    int segs = (segments_of(intermediate) + 31) / 32;
    if (dtype == DTYPE_INT8 || dtype == DTYPE_INT4) {
#define DOWN_SUM_CASE(DT, S)                                                                     \
    if (dtype == DT && segs == S) {                                                              \
        down_sum_row_prefetched<DT, S>(slots, slot_of, weights, top_k, activated, shared_a,      \
                                       out_row, first_pair, row, live, hidden, intermediate,     \
                                       stride, down_offset, down_scales, lane);                  \
        return;                                                                                  \
    }
        DOWN_SUM_CASE(DTYPE_INT8, 1)
        DOWN_SUM_CASE(DTYPE_INT8, 2)
        DOWN_SUM_CASE(DTYPE_INT8, 3)
        DOWN_SUM_CASE(DTYPE_INT8, 4)
        DOWN_SUM_CASE(DTYPE_INT4, 1)
        DOWN_SUM_CASE(DTYPE_INT4, 2)
        DOWN_SUM_CASE(DTYPE_INT4, 3)
        DOWN_SUM_CASE(DTYPE_INT4, 4)
#undef DOWN_SUM_CASE
    }
    // Any other width or dtype: `row_dot_partial` pair by pair.
    stage_token_activations(activated, slot_of, first_pair, top_k, intermediate, shared_a);
    if (!live) return;
    int padded_width = segments_of(intermediate) * SEG_STRIDE;
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        int slot = slot_of[j];
        float partial =
            slot >= 0 ? row_dot_partial(slots + (long long)slot * stride + down_offset,
                                        down_scales, dtype, row, intermediate,
                                        shared_a + j * padded_width, lane)
                      : 0.0f;
        sum = add_pair(sum, partial, slot, weights[first_pair + j]);
    }
    if (lane == 0) out_row[row] = sum;
}

// By-expert kernels (decode batches of several tokens). -----------------------------------------
//
// The per-pair kernels' grid (one block row per pair) and bits, but each expert's weights are
// read once for up to `group_pairs` (≤ EXPERT_GROUP_PAIRS) of its pairs: the block of the first
// pair of each such group (the slot's pairs in pair order, cut into groups from the first)
// computes the whole group, the other blocks of the group leave at once. The groups are found on
// the device from the routing, so a step graph replays them with each step's routing. Each
// pair's sums are formed exactly as `row_dot_partial` forms them.

// Pairs one block computes against one read of their expert's weights (experts.rs mirrors it).
#define EXPERT_GROUP_PAIRS 4

// The group pair p leads, into `members` (shared): p and the next pairs of its slot, at most
// `group_pairs`; 0 when p is not the first pair of its group. Every thread of the block calls it
// (it synchronises the block); `slot` is p's slot (≥ 0).
__device__ __forceinline__ int expert_group_members(const int* slot_of_expert,
                                                    const unsigned int* ids, int p, int pairs,
                                                    int num_experts, int slot, int group_pairs,
                                                    int* members, int* member_count) {
    int rank = 0;  // pairs of this slot before p
    for (int base = 0; base < p; base += blockDim.x) {
        int q = base + threadIdx.x;
        rank += __syncthreads_count(q < p && pair_slot(slot_of_expert, ids, q, num_experts) == slot);
    }
    if (rank % group_pairs != 0) return 0;
    if (threadIdx.x == 0) {
        int count = 0;
        for (int q = p; q < pairs && count < group_pairs; ++q)
            if (pair_slot(slot_of_expert, ids, q, num_experts) == slot) members[count++] = q;
        *member_count = count;
    }
    __syncthreads();
    return *member_count;
}

// `row_dot_partial` of one weight row against `count` padded vectors `xs` (`x_stride` floats
// apart): each weight is read once, and each vector's sum takes row_dot_partial's exact order.
__device__ __forceinline__ void row_dot_partials(const unsigned char* matrix, long long scales,
                                                 int dtype, int row, int cols, const float* xs,
                                                 int x_stride, int count, int lane,
                                                 float (&acc)[EXPERT_GROUP_PAIRS]) {
#pragma unroll
    for (int m = 0; m < EXPERT_GROUP_PAIRS; ++m) acc[m] = 0.0f;
    if (dtype == DTYPE_F32 || dtype == DTYPE_BF16) {
        for (int c = lane; c < cols; c += 32) {
            float w = float_weight(matrix, dtype, row, cols, c);
#pragma unroll
            for (int m = 0; m < EXPERT_GROUP_PAIRS; ++m)
                if (m < count) acc[m] = __fmaf_rn(w, xs[m * x_stride + padded(c)], acc[m]);
        }
    } else {
        int segments = segments_of(cols);
        // Unrolled as in row_dot_partial: several segments' loads in flight.
#pragma unroll 4
        for (int s = lane; s < segments; s += 32) {
            float w[SEG];
            if (dtype == DTYPE_INT8)
                segment_weights<DTYPE_INT8>(matrix, scales, row, cols, s, w);
            else
                segment_weights<DTYPE_INT4>(matrix, scales, row, cols, s, w);
#pragma unroll
            for (int m = 0; m < EXPERT_GROUP_PAIRS; ++m) {
                if (m >= count) continue;
                const float4* xv = reinterpret_cast<const float4*>(xs + m * x_stride + s * SEG_STRIDE);
                float a = acc[m];
#pragma unroll
                for (int q = 0; q < SEG / 4; ++q) {
                    float4 v = xv[q];
                    a = __fmaf_rn(w[4 * q], v.x, a);
                    a = __fmaf_rn(w[4 * q + 1], v.y, a);
                    a = __fmaf_rn(w[4 * q + 2], v.z, a);
                    a = __fmaf_rn(w[4 * q + 3], v.w, a);
                }
                acc[m] = a;
            }
        }
    }
}

// grid (ceil(intermediate / warps), pairs); dynamic shared memory group_pairs ·
// ceil(hidden / 16) · 20 floats. One activated column per warp, for every pair of the group.
extern "C" __global__ void expert_gate_up_by_expert(const unsigned char* slots,
                                                    const int* slot_of_expert,
                                                    const unsigned int* ids, const float* x,
                                                    float* activated, int top_k, int num_experts,
                                                    int hidden, int intermediate, long long stride,
                                                    int dtype, long long gate_up_scales, int pairs,
                                                    int group_pairs) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float shared_x[];
    __shared__ int members[EXPERT_GROUP_PAIRS];
    __shared__ int member_count;
    int p = blockIdx.y;
    int slot = pair_slot(slot_of_expert, ids, p, num_experts);
    if (slot < 0) return;  // the whole block leaves together
    int count = expert_group_members(slot_of_expert, ids, p, pairs, num_experts, slot,
                                     group_pairs, members, &member_count);
    if (count == 0) return;
    int x_stride = segments_of(hidden) * SEG_STRIDE;
    // Zero past `hidden` up to the last segment: a quantized row's padding meets 0.
    for (int m = 0; m < count; ++m) {
        const float* xt = x + (long long)(members[m] / top_k) * hidden;
        for (int c = threadIdx.x; c < segments_of(hidden) * SEG; c += blockDim.x)
            shared_x[m * x_stride + padded(c)] = c < hidden ? xt[c] : 0.0f;
    }
    __syncthreads();
    int warps = blockDim.x / 32;
    int lane = threadIdx.x % 32;
    int c = blockIdx.x * warps + threadIdx.x / 32;
    if (c >= intermediate) return;
    const unsigned char* matrix = slots + (long long)slot * stride;
    float gate_partial[EXPERT_GROUP_PAIRS], up_partial[EXPERT_GROUP_PAIRS];
    row_dot_partials(matrix, gate_up_scales, dtype, c, hidden, shared_x, x_stride, count, lane,
                     gate_partial);
    row_dot_partials(matrix, gate_up_scales, dtype, intermediate + c, hidden, shared_x, x_stride,
                     count, lane, up_partial);
#pragma unroll
    for (int m = 0; m < EXPERT_GROUP_PAIRS; ++m) {
        if (m >= count) continue;
        float gate = warp_sum(gate_partial[m]);
        float up = warp_sum(up_partial[m]);
        if (lane == 0) activated[(long long)members[m] * intermediate + c] = silu(gate) * up;
    }
}

// grid (ceil(hidden / (warps · DOWN_ROWS)), pairs); dynamic shared memory group_pairs ·
// ceil(intermediate / 16) · 20 floats. DOWN_ROWS output rows per warp, for every pair of the
// group; pairs without a slot write zeros, as in `expert_down`.
extern "C" __global__ void expert_down_by_expert(const unsigned char* slots,
                                                 const int* slot_of_expert,
                                                 const unsigned int* ids, const float* weights,
                                                 const float* activated, float* pair_out,
                                                 int num_experts, int hidden, int intermediate,
                                                 long long stride, int dtype,
                                                 long long down_offset, long long down_scales,
                                                 int pairs, int group_pairs) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float shared_a[];
    __shared__ int members[EXPERT_GROUP_PAIRS];
    __shared__ int member_count;
    int p = blockIdx.y;
    int slot = pair_slot(slot_of_expert, ids, p, num_experts);
    int warps = blockDim.x / 32;
    int lane = threadIdx.x % 32;
    int r0 = (blockIdx.x * warps + threadIdx.x / 32) * DOWN_ROWS;
    if (slot < 0) {
        // Other pairs add nothing: their experts run elsewhere.
        if (lane < DOWN_ROWS && r0 + lane < hidden) pair_out[(long long)p * hidden + r0 + lane] = 0.0f;
        return;
    }
    int count = expert_group_members(slot_of_expert, ids, p, pairs, num_experts, slot,
                                     group_pairs, members, &member_count);
    if (count == 0) return;
    int a_stride = segments_of(intermediate) * SEG_STRIDE;
    for (int m = 0; m < count; ++m) {
        const float* ap = activated + (long long)members[m] * intermediate;
        // Zero past `intermediate` up to the last segment: a quantized row's padding meets 0.
        for (int c = threadIdx.x; c < segments_of(intermediate) * SEG; c += blockDim.x)
            shared_a[m * a_stride + padded(c)] = c < intermediate ? ap[c] : 0.0f;
    }
    __syncthreads();
    if (r0 >= hidden) return;
    const unsigned char* matrix = slots + (long long)slot * stride + down_offset;
    // Every row's loads before any butterfly.
    float partial[DOWN_ROWS][EXPERT_GROUP_PAIRS];
#pragma unroll
    for (int i = 0; i < DOWN_ROWS; ++i) {
        if (r0 + i < hidden)
            row_dot_partials(matrix, down_scales, dtype, r0 + i, intermediate, shared_a, a_stride,
                             count, lane, partial[i]);
    }
#pragma unroll
    for (int i = 0; i < DOWN_ROWS; ++i) {
        if (r0 + i >= hidden) break;
#pragma unroll
        for (int m = 0; m < EXPERT_GROUP_PAIRS; ++m) {
            if (m >= count) continue;
            float y = warp_sum(partial[i][m]);
            if (lane == 0)
                pair_out[(long long)members[m] * hidden + r0 + i] = weights[members[m]] * y;
        }
    }
}

// Grouped kernels. -----------------------------------------------------------------------------

// Stages inputs [k0, k0 + kc) of the tile's vectors — row order[first + t] / divisor of `src`
// ([*, cols]) for t < count — into xs[t · CHUNK_STRIDE + padded(j)]; the rest is 0.
__device__ __forceinline__ void stage_tile(float* xs, const float* src, const unsigned int* order,
                                           int first, int count, unsigned int divisor, int cols,
                                           int k0, int kc) {
    for (int idx = threadIdx.x; idx < TILE_TOKENS * CHUNK; idx += blockDim.x) {
        int t = idx / CHUNK;
        int j = idx % CHUNK;
        float v = 0.0f;
        if (t < count && j < kc)
            v = src[(long long)(order[first + t] / divisor) * cols + k0 + j];
        xs[t * CHUNK_STRIDE + padded(j)] = v;
    }
}

// acc[r][t] += rows[r][k0, k0 + kc) · xs[t], lane's share, quantized dtypes: lane l takes the
// chunk's segment l (global segment k0 / 16 + l), as row_dot_partial does.
template <int DT>
__device__ __forceinline__ void quantized_chunk(const unsigned char* matrix, long long scales,
                                                const int (&rows)[GROUPED_ROWS], int cols, int k0,
                                                int kc, const float* xs, int lane,
                                                float (&acc)[GROUPED_ROWS][TILE_TOKENS]) {
    // The chunk's inputs past kc are staged as 0 (stage_tile): a partial last segment is read.
    if (lane >= segments_of(kc)) return;
    int s = k0 / SEG + lane;
    uint4 bits[GROUPED_ROWS];
    float scale[GROUPED_ROWS];
#pragma unroll
    for (int r = 0; r < GROUPED_ROWS; ++r) {
        bits[r] = segment_bits<DT>(matrix, rows[r], cols, s);
        scale[r] = segment_scale(matrix, scales, rows[r], cols, s);
    }
    const float* xl = xs + lane * SEG_STRIDE;
#pragma unroll
    for (int q = 0; q < SEG / 4; ++q) {
        float w[GROUPED_ROWS][4];
#pragma unroll
        for (int r = 0; r < GROUPED_ROWS; ++r) quad_weights<DT>(bits[r], scale[r], q, w[r]);
#pragma unroll
        for (int t = 0; t < TILE_TOKENS; ++t) {
            float4 xv = *reinterpret_cast<const float4*>(xl + t * CHUNK_STRIDE + 4 * q);
#pragma unroll
            for (int r = 0; r < GROUPED_ROWS; ++r) {
                float a = acc[r][t];
                a = __fmaf_rn(w[r][0], xv.x, a);
                a = __fmaf_rn(w[r][1], xv.y, a);
                a = __fmaf_rn(w[r][2], xv.z, a);
                a = __fmaf_rn(w[r][3], xv.w, a);
                acc[r][t] = a;
            }
        }
    }
}

// As quantized_chunk for f32 / bf16: lane l takes inputs k0 + l, k0 + l + 32, …
__device__ __forceinline__ void float_chunk(const unsigned char* matrix, int dtype,
                                            const int (&rows)[GROUPED_ROWS], int cols, int k0,
                                            int kc, const float* xs, int lane,
                                            float (&acc)[GROUPED_ROWS][TILE_TOKENS]) {
    for (int c = lane; c < kc; c += 32) {
        float w[GROUPED_ROWS];
#pragma unroll
        for (int r = 0; r < GROUPED_ROWS; ++r)
            w[r] = float_weight(matrix, dtype, rows[r], cols, k0 + c);
        const float* xc = xs + padded(c);
#pragma unroll
        for (int t = 0; t < TILE_TOKENS; ++t) {
            float xv = xc[t * CHUNK_STRIDE];
#pragma unroll
            for (int r = 0; r < GROUPED_ROWS; ++r) acc[r][t] = __fmaf_rn(w[r], xv, acc[r][t]);
        }
    }
}

// Lane's shares of rows[r] · v_t for the tile's vectors v_t (see stage_tile), all of `cols`.
// Every thread of the block calls it (it synchronises the block).
__device__ __forceinline__ void grouped_rows(const unsigned char* matrix, long long scales,
                                             int dtype, const int (&rows)[GROUPED_ROWS], int cols,
                                             const float* src, const unsigned int* order,
                                             int first, int count, unsigned int divisor,
                                             float* xs, int lane,
                                             float (&acc)[GROUPED_ROWS][TILE_TOKENS]) {
    for (int k0 = 0; k0 < cols; k0 += CHUNK) {
        int kc = min(CHUNK, cols - k0);
        __syncthreads();  // the previous chunk is consumed
        stage_tile(xs, src, order, first, count, divisor, cols, k0, kc);
        __syncthreads();
        if (dtype == DTYPE_INT8)
            quantized_chunk<DTYPE_INT8>(matrix, scales, rows, cols, k0, kc, xs, lane, acc);
        else if (dtype == DTYPE_INT4)
            quantized_chunk<DTYPE_INT4>(matrix, scales, rows, cols, k0, kc, xs, lane, acc);
        else
            float_chunk(matrix, dtype, rows, cols, k0, kc, xs, lane, acc);
    }
}

// grid (ceil(intermediate / (2 · GROUPED_WARPS)), tiles), GROUPED_WARPS warps, no dynamic
// shared memory. Each warp: gate and up rows of 2 output columns, for the tile's ≤ TILE_TOKENS
// pairs; activated[p, c] as expert_gate_up computes it (same order, same bits).
extern "C" __global__ void __launch_bounds__(GROUPED_WARPS * 32, 2)
    expert_gate_up_grouped(const unsigned char* slots, const int* tiles,
                           const unsigned int* order, const float* x, float* activated,
                           int top_k, int hidden, int intermediate, long long stride, int dtype,
                           long long gate_up_scales) {
    PDL_WAIT_AND_RELEASE();
    __shared__ __align__(16) float xs[TILE_TOKENS * CHUNK_STRIDE];
    const int* tile = tiles + 3 * (long long)blockIdx.y;
    int first = tile[0], count = tile[1], slot = tile[2];
    int lane = threadIdx.x % 32;
    int c0 = (blockIdx.x * GROUPED_WARPS + threadIdx.x / 32) * 2;
    // Columns past the end compute a valid row and are not written.
    int ca = min(c0, intermediate - 1), cb = min(c0 + 1, intermediate - 1);
    int rows[GROUPED_ROWS] = {ca, intermediate + ca, cb, intermediate + cb};
    float acc[GROUPED_ROWS][TILE_TOKENS];
#pragma unroll
    for (int r = 0; r < GROUPED_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TILE_TOKENS; ++t) acc[r][t] = 0.0f;
    const unsigned char* matrix = slots + (long long)slot * stride;
    grouped_rows(matrix, gate_up_scales, dtype, rows, hidden, x, order, first, count,
                 (unsigned int)top_k, xs, lane, acc);
#pragma unroll
    for (int t = 0; t < TILE_TOKENS; ++t) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float gate = warp_sum(acc[2 * j][t]);
            float up = warp_sum(acc[2 * j + 1][t]);
            int c = c0 + j;
            if (lane == t && t < count && c < intermediate)
                activated[(long long)order[first + t] * intermediate + c] = silu(gate) * up;
        }
    }
}

// grid (ceil(hidden / (GROUPED_ROWS · GROUPED_WARPS)), tiles), GROUPED_WARPS warps, no dynamic
// shared memory. Each warp: GROUPED_ROWS output rows for the tile's pairs; pair_out[p, r] as
// expert_down computes it. Rows of pairs not in any tile are not written (the host zeroes them).
extern "C" __global__ void __launch_bounds__(GROUPED_WARPS * 32, 2)
    expert_down_grouped(const unsigned char* slots, const int* tiles, const unsigned int* order,
                        const float* weights, const float* activated, float* pair_out,
                        int hidden, int intermediate, long long stride, int dtype,
                        long long down_offset, long long down_scales) {
    PDL_WAIT_AND_RELEASE();
    __shared__ __align__(16) float xs[TILE_TOKENS * CHUNK_STRIDE];
    const int* tile = tiles + 3 * (long long)blockIdx.y;
    int first = tile[0], count = tile[1], slot = tile[2];
    int lane = threadIdx.x % 32;
    int r0 = (blockIdx.x * GROUPED_WARPS + threadIdx.x / 32) * GROUPED_ROWS;
    int rows[GROUPED_ROWS];
#pragma unroll
    for (int r = 0; r < GROUPED_ROWS; ++r) rows[r] = min(r0 + r, hidden - 1);
    float acc[GROUPED_ROWS][TILE_TOKENS];
#pragma unroll
    for (int r = 0; r < GROUPED_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TILE_TOKENS; ++t) acc[r][t] = 0.0f;
    const unsigned char* matrix = slots + (long long)slot * stride + down_offset;
    grouped_rows(matrix, down_scales, dtype, rows, intermediate, activated, order, first, count,
                 1u, xs, lane, acc);
#pragma unroll
    for (int t = 0; t < TILE_TOKENS; ++t) {
#pragma unroll
        for (int r = 0; r < GROUPED_ROWS; ++r) {
            float y = warp_sum(acc[r][t]);
            if (lane == t && t < count && r0 + r < hidden) {
                unsigned int p = order[first + t];
                pair_out[(long long)p * hidden + r0 + r] = weights[p] * y;
            }
        }
    }
}

// out[t, r] = Σ_j pair_out[t·k + j, r], j in increasing order. One thread per output,
// grid-stride (the launch caps the block count).
extern "C" __global__ void expert_pair_sum(const float* pair_out, float* out, int tokens, int top_k,
                                           int hidden) {
    PDL_WAIT_AND_RELEASE();
    long long total = (long long)tokens * hidden;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / hidden;
        int r = (int)(i % hidden);
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j) sum += pair_out[(t * top_k + j) * hidden + r];
        out[i] = sum;
    }
}

// One token's routed experts in one launch (decode): `expert_decode_fused`, the bits of the
// three launches it replaces (`expert_gate_up_tasks`, `expert_down`, `expert_pair_sum`).
// ---------------------------------------------------------------------------------------------
//
// The grid fits the GPU at once (FUSED_MIN_BLOCKS blocks per multiprocessor, as the host
// launches it), so a block may wait for all others. Phase 1 is `gate_up_tasks` unchanged; each
// block then counts itself done. Phase 2 is `expert_down_sum`'s row: a warp's output row from
// every pair in pair order, each product rounded, then added. A warp issues its first row's down
// weights (every pair's) before it waits for the other blocks, so those loads overlap phase 1's
// tail instead of a launch boundary. The last block out sets the two counters back to 0 for the
// next launch (they start at 0).
//
// Grid: FUSED_MIN_BLOCKS · multiprocessors, 256 threads; dynamic shared memory
// max(ceil(hidden / 16), top_k · ceil(intermediate / 16)) · 20 floats. Quantized experts whose
// rows span at most 4 segments per lane; top_k ≤ DOWN_SUM_MAX_TOP_K.

#ifndef FUSED_DOWN_LOADS
#define FUSED_DOWN_LOADS 8
#endif
// Blocks per multiprocessor the registers are sized for (the host launches at most as many as
// the occupancy calculator says fit: more would wait forever for blocks that never start).
#ifndef FUSED_MIN_BLOCKS
#define FUSED_MIN_BLOCKS 1
#endif
// A wait that spins this long gives up (its results are then wrong, which the tests would see)
// instead of hanging the GPU: it cannot happen while every block of the grid is resident.
#define FUSED_MAX_SPINS (1 << 22)

// Row `row`'s down segments of pairs [j0, j0 + BATCH) of the token (unset where absent).
template <int DT, int SEGS, int BATCH>
__device__ __forceinline__ void fused_load_down(const unsigned char* slots, const int* slot_of,
                                                int top_k, int j0, int row, bool live,
                                                int intermediate, long long stride,
                                                long long down_offset, long long down_scales,
                                                int lane, uint4 (&bits)[BATCH][SEGS],
                                                float (&scale)[BATCH][SEGS]) {
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
        int j = j0 + b;
        int slot = j < top_k ? slot_of[j] : -1;
        if (live && slot >= 0)
            load_row_segments<DT, SEGS>(slots + (long long)slot * stride + down_offset,
                                        down_scales, row, intermediate, lane, bits[b], scale[b]);
    }
}

template <int DT, int SEGS>
__device__ __forceinline__ void fused_phase_two(const unsigned char* slots, const int* slot_of,
                                                const float* pair_weights, int top_k,
                                                const float* activated, float* shared_a,
                                                float* out, int hidden, int intermediate,
                                                long long stride, long long down_offset,
                                                long long down_scales, unsigned int* counters) {
    constexpr int BATCH = FUSED_DOWN_LOADS / SEGS;
    int lane = threadIdx.x % 32;
    int warps_total = gridDim.x * (blockDim.x / 32);
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int padded_width = segments_of(intermediate) * SEG_STRIDE;
    uint4 bits[BATCH][SEGS];
    float scale[BATCH][SEGS];
    fused_load_down<DT, SEGS, BATCH>(slots, slot_of, top_k, 0, row, row < hidden, intermediate,
                                     stride, down_offset, down_scales, lane, bits, scale);
    // Every block's activations written (phase 1 everywhere), then staged here.
    if (threadIdx.x == 0) {
        for (int spins = 0; atomicAdd(&counters[0], 0u) < gridDim.x && spins < FUSED_MAX_SPINS;
             ++spins)
            __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
    stage_padded_rows(activated, top_k, intermediate, slot_of, shared_a, true);
    __syncthreads();
    for (bool first = true; row < hidden; row += warps_total, first = false) {
        float sum = 0.0f;
        for (int j0 = 0; j0 < top_k; j0 += BATCH) {
            if (!first || j0 > 0)
                fused_load_down<DT, SEGS, BATCH>(slots, slot_of, top_k, j0, row, true,
                                                 intermediate, stride, down_offset, down_scales,
                                                 lane, bits, scale);
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                int j = j0 + b;
                if (j < top_k) {
                    int slot = slot_of[j];
                    float partial = slot >= 0 ? loaded_row_dot_partial<DT, SEGS>(
                                                    bits[b], scale[b], intermediate,
                                                    shared_a + j * padded_width, lane)
                                              : 0.0f;
                    sum = add_pair(sum, partial, slot, pair_weights[j]);
                }
            }
        }
        if (lane == 0) out[row] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(256, FUSED_MIN_BLOCKS)
    expert_decode_fused(const unsigned char* slots, const int* slot_of_expert,
                        const unsigned int* ids, const float* x, const float* weights,
                        float* activated, float* out, unsigned int* counters, int top_k,
                        int num_experts, int hidden, int intermediate, long long stride,
                        int dtype, long long gate_up_scales, long long down_offset,
                        long long down_scales) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float fused_shared[];
    __shared__ int slot_of[DOWN_SUM_MAX_TOP_K];
    if (top_k > DOWN_SUM_MAX_TOP_K || (dtype != DTYPE_INT8 && dtype != DTYPE_INT4)) return;
    for (int j = threadIdx.x; j < top_k; j += blockDim.x)
        slot_of[j] = pair_slot(slot_of_expert, ids, j, num_experts);
    __syncthreads();
    int first_task = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int tasks = top_k * intermediate;
    int segs = (segments_of(intermediate) + 31) / 32;
    if (dtype == DTYPE_INT8)
        gate_up_tasks<DTYPE_INT8>(slots, slot_of, x, fused_shared, activated, intermediate,
                                  hidden, stride, gate_up_scales, tasks, first_task, 0, 0);
    else
        gate_up_tasks<DTYPE_INT4>(slots, slot_of, x, fused_shared, activated, intermediate,
                                  hidden, stride, gate_up_scales, tasks, first_task, 0, 0);
    __syncthreads();  // the block's tasks written; x no longer read
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&counters[0], 1u);
    }
#define FUSED_CASE(DT, S)                                                                        \
    if (dtype == DT && segs == S)                                                                \
        fused_phase_two<DT, S>(slots, slot_of, weights, top_k, activated, fused_shared, out,     \
                               hidden, intermediate, stride, down_offset, down_scales, counters);
    FUSED_CASE(DTYPE_INT8, 1)
    FUSED_CASE(DTYPE_INT8, 2)
    FUSED_CASE(DTYPE_INT8, 3)
    FUSED_CASE(DTYPE_INT8, 4)
    FUSED_CASE(DTYPE_INT4, 1)
    FUSED_CASE(DTYPE_INT4, 2)
    FUSED_CASE(DTYPE_INT4, 3)
    FUSED_CASE(DTYPE_INT4, 4)
#undef FUSED_CASE
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&counters[1], 1u) == gridDim.x - 1) {
            counters[0] = 0u;
            counters[1] = 0u;
            __threadfence();
        }
    }
}
