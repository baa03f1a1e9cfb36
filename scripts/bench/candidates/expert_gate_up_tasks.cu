// A candidate `expert_gate_up` for decode, timed by kernel_microbench.py (appended to
// kernels/experts.cu, whose helpers it uses): a grid that fits the GPU at once, each warp
// walking (pair, column) tasks with the next task's weights loaded while the current one is
// computed, so no block waits for a second wave and every warp keeps one task's loads in
// flight. The same sums in the same order as `expert_gate_up` (same bits).
//
// grid: as many blocks of 256 threads as are resident at once; dynamic shared memory: every
// token's input, padded (tokens · ceil(hidden / 16) · 20 floats); pairs ≤ 64.
extern "C" __global__ void expert_gate_up_tasks(const unsigned char* slots,
                                                const int* slot_of_expert,
                                                const unsigned int* ids, const float* x,
                                                float* activated, int top_k, int num_experts,
                                                int hidden, int intermediate, long long stride,
                                                int dtype, long long gate_up_scales, int pairs) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float shared_x[];
    __shared__ int slot_of[64];
    for (int j = threadIdx.x; j < pairs; j += blockDim.x)
        slot_of[j] = pair_slot(slot_of_expert, ids, j, num_experts);
    __syncthreads();
    int lane = threadIdx.x % 32;
    int warps_total = gridDim.x * (blockDim.x / 32);
    int task = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int tasks = pairs * intermediate;
    int padded_width = segments_of(hidden) * SEG_STRIDE;
    uint4 gate_bits[4], up_bits[4];
    float gate_scale[4], up_scale[4];
    // The first task's loads fly while the inputs are staged.
    {
        int p = task / intermediate, c = task % intermediate;
        int slot = task < tasks ? slot_of[p] : -1;
        if (slot >= 0) {
            const unsigned char* matrix = slots + (long long)slot * stride;
            load_row_segments<DTYPE_INT8, 4>(matrix, gate_up_scales, c, hidden, lane, gate_bits,
                                             gate_scale);
            load_row_segments<DTYPE_INT8, 4>(matrix, gate_up_scales, intermediate + c, hidden,
                                             lane, up_bits, up_scale);
        }
    }
    stage_padded_rows(x, pairs / top_k, hidden, nullptr, shared_x);
    __syncthreads();
    while (task < tasks) {
        int next = task + warps_total;
        uint4 next_gate_bits[4], next_up_bits[4];
        float next_gate_scale[4], next_up_scale[4];
        int next_slot = -1, next_c = 0;
        if (next < tasks) {
            next_c = next % intermediate;
            next_slot = slot_of[next / intermediate];
        }
        if (next_slot >= 0) {
            const unsigned char* matrix = slots + (long long)next_slot * stride;
            load_row_segments<DTYPE_INT8, 4>(matrix, gate_up_scales, next_c, hidden, lane,
                                             next_gate_bits, next_gate_scale);
            load_row_segments<DTYPE_INT8, 4>(matrix, gate_up_scales, intermediate + next_c,
                                             hidden, lane, next_up_bits, next_up_scale);
        }
        int p = task / intermediate, c = task % intermediate;
        if (slot_of[p] >= 0) {
            const float* xs = shared_x + (p / top_k) * padded_width;
            float gate = warp_sum(
                loaded_row_dot_partial<DTYPE_INT8, 4>(gate_bits, gate_scale, hidden, xs, lane));
            float up = warp_sum(
                loaded_row_dot_partial<DTYPE_INT8, 4>(up_bits, up_scale, hidden, xs, lane));
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
}
