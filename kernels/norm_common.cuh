// The RMSNorm block shape and reduction the norm kernels share (norm.cu) with the kernels that
// fold a residual add and its norm into their own launch (router.cu): one fixed tree, so a
// group's 1 / rms has the same bits wherever it is computed.
#pragma once

#define NORM_THREADS 256
// Values a thread keeps in registers from the sum pass to the scaling pass: every load of a
// group is issued before the first is waited for (one block per row at decode is latency-bound),
// and x is not re-read. Groups past NORM_THREADS · NORM_CACHED values re-read the rest.
#define NORM_CACHED 16

__device__ float block_sum(float value) {
    __shared__ float partial[NORM_THREADS / 32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < NORM_THREADS / 32; ++w) total += partial[w];
    __syncthreads();  // partial is reused by the next call
    return total;
}

// x + delta of a group's first NORM_THREADS · NORM_CACHED values into `cached` (thread t holds
// t + j · NORM_THREADS; 0 past the group) and the sum of their squares, every load issued before
// the first is used: the first pass of `add_rms_norm`, and of the kernels that fold it in.
__device__ __forceinline__ float add_into_registers(const float* x, const float* delta, int group,
                                                   float (&cached)[NORM_CACHED]) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_CACHED; ++j) {
        int i = threadIdx.x + j * NORM_THREADS;
        cached[j] = i < group ? x[i] + delta[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < NORM_CACHED; ++j) {
        if (threadIdx.x + j * NORM_THREADS < group) sum += cached[j] * cached[j];
    }
    return sum;
}

// The first pass of a kernel that folds a residual add and its norm into its own launch, in every
// block: x + delta into `cached` (as `add_into_registers`), then the whole normed row into
// `normed_row` (shared memory) with `add_rms_norm`'s tree and products, so every block has the
// norm's bits; synchronises the block. group ≤ NORM_THREADS · NORM_CACHED.
__device__ __forceinline__ void form_normed_row(const float* x, const float* delta,
                                                const float* weight, float eps, float offset,
                                                int group, float (&cached)[NORM_CACHED],
                                                float* normed_row) {
    float sum = add_into_registers(x, delta, group, cached);
    float inverse = rsqrtf(block_sum(sum) / (float)group + eps);
#pragma unroll
    for (int j = 0; j < NORM_CACHED; ++j) {
        int i = threadIdx.x + j * NORM_THREADS;
        if (i < group) normed_row[i] = cached[j] * inverse * (offset + weight[i]);
    }
    __syncthreads();  // the normed row complete
}

// The last block's store of x + delta, held in `cached` since `form_normed_row`.
__device__ __forceinline__ void store_cached_sum(float* x, int group,
                                                 const float (&cached)[NORM_CACHED]) {
#pragma unroll
    for (int j = 0; j < NORM_CACHED; ++j) {
        int i = threadIdx.x + j * NORM_THREADS;
        if (i < group) x[i] = cached[j];
    }
}
