// Dense matmul of the CUDA backend: out[n, m] = x[n, k] · W[m, k]ᵀ, f32 activations, f32
// accumulation, weights stored as f32 or bf16 (bf16 → f32 is exact, so both compute the same
// function as the CPU backend on the same stored weights).
//
// Batch invariance: every output's sum is formed in an order that depends only on k, never on
// n or on where the row sits in the batch, so a row's result does not depend on the batch it
// is in (the golden tests require batched and single prefills to agree bit for bit).
//
// `matmul` / `matmul_bf16` (used for every n): one warp per (1 or MAX_COLS output features,
// group of up to ROWS rows); each lane sums its own k positions (bf16 with k % 8 == 0: 8-wide chunks 256
// apart; else 4-wide chunks 128 apart when k % 4 == 0; else k ≡ lane mod 32) in increasing
// order for each row of the group, then a fixed butterfly adds the 32 lane sums. Weight reads
// are coalesced (a warp reads 32 consecutive values of one row) and each weight is reused for
// ROWS rows; at decode (n = 1) this streams the weights once.
//
// Prefill with bf16 weights goes through cuBLAS instead (device/matmul.rs, above a row threshold): the
// activations are rounded to bf16 by `f32_to_bf16` below and multiplied on tensor cores with f32
// accumulation. That path is neither batch invariant nor bit-equal to this kernel; the tests that
// need either run with cuBLAS off (`CudaOptions::exact`).

#include "common.cuh"
#include "matmul_common.cuh"
#include "norm_common.cuh"

// `prefetch` (0 or 1): ask L2 for the warp's weights before the PDL wait (decode).
extern "C" __global__ void matmul(const float* x, const float* w, float* out, int n, int k, int m,
                                  int cols, int prefetch) {
    PDL_L2_PREFETCH(prefetch, prefetch_feature_group(w, n, k, m, cols, warp_task()));
    PDL_WAIT_AND_RELEASE();
    matmul_warp(PlainRows{x, k}, w, out, n, k, m, cols);
}

extern "C" __global__ void matmul_bf16(const float* x, const unsigned short* w, float* out, int n,
                                       int k, int m, int cols, int prefetch) {
    PDL_L2_PREFETCH(prefetch, prefetch_feature_group(w, n, k, m, cols, warp_task()));
    PDL_WAIT_AND_RELEASE();
    matmul_warp(PlainRows{x, k}, w, out, n, k, m, cols);
}

// out = silu(gate) · up, then · wᵀ, in one launch: the values of `silu_mul` then `matmul_bf16`
// (an MLP's down projection at decode, without the activated rows' own launch and round trip).
extern "C" __global__ void matmul_bf16_silu_mul(const float* gate, const float* up,
                                                const unsigned short* w, float* out, int n,
                                                int k, int m, int cols, int prefetch) {
    PDL_L2_PREFETCH(prefetch, prefetch_feature_group(w, n, k, m, cols, warp_task()));
    PDL_WAIT_AND_RELEASE();
    matmul_warp(SiluMulRows{gate, up, k}, w, out, n, k, m, cols);
}

// out = (x · sigmoid(gate)) · wᵀ in one launch: the values of `mul_sigmoid` then `matmul_bf16`
// (a gated attention's output projection at decode).
extern "C" __global__ void matmul_bf16_mul_sigmoid(const float* x, const float* gate,
                                                   const unsigned short* w, float* out, int n,
                                                   int k, int m, int cols, int prefetch) {
    PDL_L2_PREFETCH(prefetch, prefetch_feature_group(w, n, k, m, cols, warp_task()));
    PDL_WAIT_AND_RELEASE();
    matmul_warp(MulSigmoidRows{x, gate, k}, w, out, n, k, m, cols);
}

// matmul3_bf16's feature group `group` of the three matrices' groups, asked of L2.
__device__ __forceinline__ void prefetch_matmul3_group(const unsigned short* w0,
                                                       const unsigned short* w1,
                                                       const unsigned short* w2, int n, int k,
                                                       int m0, int m1, int m2, int cols,
                                                       long long group) {
    long long g0 = (m0 + cols - 1) / cols, g1 = (m1 + cols - 1) / cols;
    if (group < g0)
        prefetch_feature_group(w0, n, k, m0, cols, group);
    else if (group < g0 + g1)
        prefetch_feature_group(w1, n, k, m1, cols, group - g0);
    else
        prefetch_feature_group(w2, n, k, m2, cols, group - g0 - g1);
}

// Warp task `task` of three projections of the rows `x` gives (matmul3_bf16's grid: feature
// groups of the three matrices, then row groups); whole warps past the last task do nothing.
template <typename X>
__device__ __forceinline__ void matmul3_task(const X& x, const unsigned short* w0,
                                             const unsigned short* w1, const unsigned short* w2,
                                             float* out0, float* out1, float* out2, int n, int k,
                                             int m0, int m1, int m2, int cols, long long task) {
    long long groups = (n + ROWS - 1) / ROWS;
    int g0 = (m0 + cols - 1) / cols, g1 = (m1 + cols - 1) / cols, g2 = (m2 + cols - 1) / cols;
    int total = g0 + g1 + g2;
    if (task >= groups * total) return;  // whole warps leave together
    int column_group = (int)(task % total);
    int r0 = (int)(task / total) * ROWS;
    int lane = threadIdx.x % 32;
    if (column_group < g0) {
        matmul_task(x, w0, out0, n, k, m0, cols, column_group * cols, r0, lane);
    } else if (column_group < g0 + g1) {
        matmul_task(x, w1, out1, n, k, m1, cols, (column_group - g0) * cols, r0, lane);
    } else {
        matmul_task(x, w2, out2, n, k, m2, cols, (column_group - g0 - g1) * cols, r0, lane);
    }
}

// Three projections of one input in one launch (an attention layer's q, k and v at decode):
// out_i[n, m_i] = x · w_iᵀ, each output computed exactly as `matmul_bf16` computes it (the same
// warp body), so the values equal three launches'. A matrix with m_i = 0 is skipped. Feature
// groups never straddle two matrices: each matrix has ceil(m_i / cols) of them.
extern "C" __global__ void matmul3_bf16(const float* x, const unsigned short* w0,
                                        const unsigned short* w1, const unsigned short* w2,
                                        float* out0, float* out1, float* out2, int n, int k,
                                        int m0, int m1, int m2, int cols, int prefetch) {
    PDL_L2_PREFETCH(prefetch, prefetch_matmul3_group(w0, w1, w2, n, k, m0, m1, m2, cols,
                                                     warp_task()));
    PDL_WAIT_AND_RELEASE();
    matmul3_task(PlainRows{x, k}, w0, w1, w2, out0, out1, out2, n, k, m0, m1, m2, cols,
                 warp_task());
}

// add_norm_matmul3_bf16's blocks per SM in the grid the engine launches: one wave at its
// occupancy (104 registers a thread on sm_90: two 256-thread blocks an SM; launch bounds of two
// make ptxas spill).
#define ADD_NORM_MATMUL_BLOCKS_PER_SM 2

// The warp tasks of three projections of one row: one per feature group of each matrix.
__device__ __forceinline__ long long matmul3_row_tasks(int m0, int m1, int m2, int cols) {
    return (long long)((m0 + cols - 1) / cols) + (m1 + cols - 1) / cols + (m2 + cols - 1) / cols;
}

// Every task this warp takes of a one-row matmul3 grid-strided over the launch, asked of L2.
__device__ __forceinline__ void prefetch_matmul3_row_tasks(const unsigned short* w0,
                                                           const unsigned short* w1,
                                                           const unsigned short* w2, int k, int m0,
                                                           int m1, int m2, int cols) {
    long long tasks = matmul3_row_tasks(m0, m1, m2, cols);
    long long stride = (long long)gridDim.x * (blockDim.x / 32);
    for (long long task = warp_task(); task < tasks; task += stride)
        prefetch_matmul3_group(w0, w1, w2, 1, k, m0, m1, m2, cols, task);
}

// `matmul3_bf16` of one token with the residual add and RMSNorm before it in the same launch
// (decode, the layer after a feed-forward): residual += delta, x = the norm of it as
// `add_rms_norm` computes it, then x's three projections, instead of `add_rms_norm` then
// `matmul3_bf16`. Every block forms the whole normed row in shared memory with `add_rms_norm`'s
// threads and tree (norm_common.cuh), so every block has the norm's bits, and its warps take
// matmul3_bf16's tasks over that row (the same warp body: the same bits); each block stores its
// slice of the normed row to `normed` where that is not null (a reader besides the three
// projections). The last block out, once every block has read the residual, stores residual +
// delta and sets the ticket counter back to 0.
//
// Grid: any number of blocks of NORM_THREADS threads (each block's warps take every
// gridDim.x · NORM_THREADS / 32-th task, so fewer blocks form the norm fewer times; the engine
// launches ADD_NORM_MATMUL_BLOCKS_PER_SM blocks per SM at most, matmul3_bf16's grid at n = 1
// gives each warp one task); dynamic shared memory k floats; k ≤ NORM_THREADS · NORM_CACHED (the
// values stay in registers).
extern "C" __global__ void add_norm_matmul3_bf16(
    float* residual, const float* delta, const float* norm_weight, float eps, float offset,
    float* normed, const unsigned short* w0, const unsigned short* w1, const unsigned short* w2, float* out0,
    float* out1, float* out2, unsigned int* counter, int k, int m0, int m1, int m2, int cols,
    int prefetch) {
    PDL_L2_PREFETCH(prefetch, prefetch_matmul3_row_tasks(w0, w1, w2, k, m0, m1, m2, cols));
    PDL_WAIT_AND_RELEASE();
    long long tasks = matmul3_row_tasks(m0, m1, m2, cols);
    long long stride = (long long)gridDim.x * (blockDim.x / 32);
    extern __shared__ __align__(16) float normed_row[];
    float cached[NORM_CACHED];
    form_normed_row(residual, delta, norm_weight, eps, offset, k, cached, normed_row);
    if (normed) {
        for (int i = blockIdx.x * NORM_THREADS + threadIdx.x; i < k; i += gridDim.x * NORM_THREADS)
            normed[i] = normed_row[i];
    }
    for (long long task = warp_task(); task < tasks; task += stride)
        matmul3_task(PlainRows{normed_row, k}, w0, w1, w2, out0, out1, out2, 1, k, m0, m1, m2,
                     cols, task);
    // Past the ticket every block has read the residual.
    if (!last_block_out(counter)) return;
    store_cached_sum(residual, k, cached);
    if (threadIdx.x == 0) *counter = 0;
}

// out[i] = bf16(x[i]) for the cuBLAS path's activations. One thread per element, grid-stride.
extern "C" __global__ void f32_to_bf16(const float* x, unsigned short* out, long long n) {
    PDL_WAIT_AND_RELEASE();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        out[i] = f32_to_bf16_bits(x[i]);
    }
}

// x = hi + lo with hi = bf16(x), lo = bf16(x − hi): two bf16 GEMMs (hi, then lo accumulated)
// carry ~16 mantissa bits of the activations instead of 8, so the tensor-core prefill path
// stays within f32-level tolerance of the exact kernel (bf16 weights are exact either way).
extern "C" __global__ void f32_to_bf16_split(const float* x, unsigned short* hi, unsigned short* lo,
                                             long long n) {
    PDL_WAIT_AND_RELEASE();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        unsigned short h = f32_to_bf16_bits(x[i]);
        float rest = x[i] - __uint_as_float(((unsigned int)h) << 16);
        hi[i] = h;
        lo[i] = f32_to_bf16_bits(rest);
    }
}
