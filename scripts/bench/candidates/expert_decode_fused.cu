// Candidate, timed by kernel_microbench.py appended to kernels/experts.cu (it uses that file's
// helpers): one token's routed experts in one launch, with the bits of the three launches it
// would replace (`expert_gate_up_tasks`, `expert_down`, `expert_pair_sum`).
//
// The grid fits the GPU at once (as `expert_gate_up_tasks`' does), so a block may wait for all
// others. Phase 1 is `gate_up_tasks` unchanged; each block then counts itself done. Phase 2 is
// `expert_down_sum`'s row: a warp's output row from every pair in pair order, each product
// rounded, then added. A warp issues its first row's down weights (every pair's) before it waits
// for the other blocks, so those loads overlap phase 1's tail instead of a launch boundary. The
// last block out sets the two counters back to 0 for the next launch (they start at 0).
//
// Grid: up to FUSED_MIN_BLOCKS · multiprocessors (host), 256 threads; dynamic shared memory
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
// A bench safety: a wait that spins this long gives up (the bit check then fails) instead of
// hanging the GPU.
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
    stage_padded_rows(activated, top_k, intermediate, slot_of, shared_a);
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
