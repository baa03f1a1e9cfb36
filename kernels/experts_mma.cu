// Routed experts in GPU slots on the tensor cores: the grouped kernels of kernels/experts.cu as
// GEMMs (see the comment there for the slots, the tiles and the reduction order of the SIMT
// kernels these are held to within bf16 tolerances).

#include "common.cuh"
#include "experts_common.cuh"
#include "mma_common.cuh"

// Tensor-core grouped kernels. --------------------------------------------------------------------
//
// A block computes a [MMA_TILE_TOKENS pairs × MMA_TILE_ROWS weight rows] product of one tile over
// the whole reduction, MMA_K inputs per stage: the stage's activations (f32, gathered by `order`)
// and weights (any stored dtype) are loaded into registers while the tensor cores work on the
// previous stage, then converted to bf16 into the other of two shared-memory buffers. Four warps,
// 2 × 2 over (pairs, weight rows), each 32 pairs × 64 weight rows. MMA_K is one quantization
// group, so a stage needs one scale per weight row. Inputs past the reduction length are staged
// as 0 on both sides (a quantized row's padding codes are 0 too).
//
// expert_gate_up_mma: the block's 128 weight rows are MMA_COLUMNS activated columns' gate and up
// rows, ordered so a warp holds the gate and the up row of the same 32 columns: staged row b is
// column c0 + (b / 64) · 32 + b % 32, its gate row if b % 64 < 32, else its up row. SwiGLU runs
// on the accumulators. expert_down_mma: staged row b is output row r0 + b.

#define MMA_TILE_TOKENS 64
#define MMA_TILE_ROWS 128
#define MMA_COLUMNS (MMA_TILE_ROWS / 2)
#define MMA_K 32
// bf16 per staged row: 8 of padding puts the 8 rows an ldmatrix reads on distinct banks.
#define MMA_STRIDE (MMA_K + 8)
#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)

// One stage's global loads, held in registers until the tensor cores are done with the buffer
// they go to. Thread tid loads 16 activations of pair row tid / 2 (inputs (tid % 2) · 16 …) and
// the MMA_K weights of staged weight row tid.
struct MmaStage {
    float a[16];
    uint4 w[4];   // bf16: 32 values; int8: 32 codes in w[0..2]; int4: 32 codes in w[0]
    float scale;  // quantized dtypes
};

// Activations [k0, k0 + MMA_K) of the tile's pair `row` (source row order[first + row] / divisor
// of `src`, [*, cols]); 0 past `cols` or past the tile.
__device__ __forceinline__ void mma_load_activations(MmaStage& st, const float* src,
                                                     const unsigned int* order, int first,
                                                     int count, unsigned int divisor, int cols,
                                                     int k0) {
    int row = threadIdx.x >> 1;
    int k = k0 + (threadIdx.x & 1) * 16;
    if (row >= count) {
#pragma unroll
        for (int i = 0; i < 16; ++i) st.a[i] = 0.0f;
        return;
    }
    const float* at = src + (long long)(order[first + row] / divisor) * cols + k;
    if ((cols & 3) == 0 && k + 16 <= cols) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float4 v = reinterpret_cast<const float4*>(at)[i];
            st.a[4 * i] = v.x, st.a[4 * i + 1] = v.y, st.a[4 * i + 2] = v.z, st.a[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) st.a[i] = k + i < cols ? at[i] : 0.0f;
    }
}

// Weights [k0, k0 + MMA_K) of row `row` of a [*, cols] matrix (`valid` false: zeros).
template <int DT>
__device__ __forceinline__ void mma_load_weights(MmaStage& st, const unsigned char* matrix,
                                                 long long scales, int row, bool valid, int cols,
                                                 int k0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) st.w[i] = make_uint4(0u, 0u, 0u, 0u);
    st.scale = 0.0f;
    if (!valid) return;
    if (DT == DTYPE_BF16) {
        const unsigned short* at =
            reinterpret_cast<const unsigned short*>(matrix) + (long long)row * cols + k0;
        if ((cols & 7) == 0 && k0 + MMA_K <= cols) {
#pragma unroll
            for (int i = 0; i < 4; ++i) st.w[i] = reinterpret_cast<const uint4*>(at)[i];
        } else {
            unsigned int words[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                unsigned int lo = k0 + 2 * i < cols ? at[2 * i] : 0u;
                unsigned int hi = k0 + 2 * i + 1 < cols ? at[2 * i + 1] : 0u;
                words[i] = lo | (hi << 16);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
                st.w[i] = make_uint4(words[4 * i], words[4 * i + 1], words[4 * i + 2],
                                     words[4 * i + 3]);
        }
    } else {
        // k0 is a multiple of MMA_K = GROUP: the stage is one whole stored group.
        if (DT == DTYPE_INT8) {
            const uint4* at = reinterpret_cast<const uint4*>(
                matrix + (long long)row * stored_cols(cols) + k0);
            st.w[0] = at[0];
            st.w[1] = at[1];
        } else {
            st.w[0] = *reinterpret_cast<const uint4*>(
                matrix + (long long)row * (stored_cols(cols) / 2) + k0 / 2);
        }
        st.scale = segment_scale(matrix, scales, row, cols, k0 / SEG);
    }
}

template <int DT>
__device__ __forceinline__ void mma_store_dequantized(const MmaStage& st, uint4* w_at);

// The stage's registers into buffer `a_s` / `w_s` as bf16 (weights dequantized first).
template <int DT>
__device__ __forceinline__ void mma_store_stage(const MmaStage& st, unsigned short* a_s,
                                                unsigned short* w_s) {
    uint4* a_at = reinterpret_cast<uint4*>(a_s + (threadIdx.x >> 1) * MMA_STRIDE +
                                           (threadIdx.x & 1) * 16);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float* v = st.a + 8 * i;
        a_at[i] = make_uint4(mma_pack_bf16x2(v[0], v[1]), mma_pack_bf16x2(v[2], v[3]),
                             mma_pack_bf16x2(v[4], v[5]), mma_pack_bf16x2(v[6], v[7]));
    }
    uint4* w_at = reinterpret_cast<uint4*>(w_s + threadIdx.x * MMA_STRIDE);
    if (DT == DTYPE_BF16) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w_at[i] = st.w[i];
    } else {
        mma_store_dequantized<DT>(st, w_at);
    }
}

// Weight j of the group: int8 byte j; int4 nibble j % 8 of word j / 8, minus 8; times the
// group's scale (exact in f32), rounded to bf16.
template <int DT>
__device__ __forceinline__ void mma_store_dequantized(const MmaStage& st, uint4* w_at) {
    unsigned int words[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float w[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            int j = 2 * i + e;
            int value;
            if (DT == DTYPE_INT8) {
                unsigned int word = word_of(st.w[j / 16], (j / 4) % 4);
                value = (int)(signed char)((word >> (8 * (j % 4))) & 0xffu);
            } else {
                unsigned int word = word_of(st.w[0], j / 8);
                value = (int)((word >> (4 * (j % 8))) & 0xfu) - 8;
            }
            w[e] = __fmul_rn((float)value, st.scale);
        }
        words[i] = mma_pack_bf16x2(w[0], w[1]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w_at[i] = make_uint4(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]);
}

// acc += the stage's product for this warp: pairs wm·32 … (2 m-tiles), staged weight rows
// wn·64 … (8 n-tiles), MMA_K inputs (2 k-steps).
__device__ __forceinline__ void mma_stage_product(const unsigned short* a_s,
                                                  const unsigned short* w_s, int wm, int wn,
                                                  int lane, float (&acc)[2][8][4]) {
#pragma unroll
    for (int kk = 0; kk < MMA_K; kk += 16) {
        unsigned int a[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
            mma_ldmatrix_x4(a[i], a_s + (wm * 32 + i * 16 + (lane & 15)) * MMA_STRIDE + kk +
                                  (lane >> 4) * 8);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            unsigned int b[4];
            mma_ldmatrix_x4(b, w_s + (wn * 64 + jj * 16 + (lane & 7) + ((lane >> 4) << 3)) *
                                     MMA_STRIDE +
                               kk + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mma_m16n8k16(acc[i][2 * jj], a[i], b[0], b[1]);
                mma_m16n8k16(acc[i][2 * jj + 1], a[i], b[2], b[3]);
            }
        }
    }
}

// Both stages' buffers (activations, then weights), in bf16 values.
#define MMA_SHARED (2 * (MMA_TILE_TOKENS + MMA_TILE_ROWS) * MMA_STRIDE)

// The whole reduction of one block, staged in `shared` (MMA_SHARED values): acc[i][j][e] for pair wm·32 + i·16 + lane / 4 (+ 8 for
// e ≥ 2) and staged weight row wn·64 + j·8 + 2·(lane % 4) + e % 2. `weight_row` is this thread's
// staged row's matrix row (valid or not).
template <int DT>
__device__ __forceinline__ void mma_tile_product(const unsigned char* matrix, long long scales,
                                                 int weight_row, bool weight_valid, int cols,
                                                 const float* src, const unsigned int* order,
                                                 int first, int count, unsigned int divisor,
                                                 unsigned short* shared,
                                                 float (&acc)[2][8][4]) {
    // Stage buffer i: activations at a_s + i · A_SIZE, weights at w_s + i · W_SIZE.
    const int A_SIZE = MMA_TILE_TOKENS * MMA_STRIDE, W_SIZE = MMA_TILE_ROWS * MMA_STRIDE;
    unsigned short* a_s = shared;
    unsigned short* w_s = shared + 2 * A_SIZE;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int wm = warp & 1, wn = warp >> 1;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    int stages = (cols + MMA_K - 1) / MMA_K;
    MmaStage st;
    mma_load_activations(st, src, order, first, count, divisor, cols, 0);
    mma_load_weights<DT>(st, matrix, scales, weight_row, weight_valid, cols, 0);
    mma_store_stage<DT>(st, a_s, w_s);
    __syncthreads();
    for (int s = 0; s < stages; ++s) {
        bool next = s + 1 < stages;
        if (next) {
            int k0 = (s + 1) * MMA_K;
            mma_load_activations(st, src, order, first, count, divisor, cols, k0);
            mma_load_weights<DT>(st, matrix, scales, weight_row, weight_valid, cols, k0);
        }
        mma_stage_product(a_s + (s & 1) * A_SIZE, w_s + (s & 1) * W_SIZE, wm, wn, lane, acc);
        // The other buffer was last read in the previous stage, before the barrier below.
        if (next) mma_store_stage<DT>(st, a_s + ((s + 1) & 1) * A_SIZE, w_s + ((s + 1) & 1) * W_SIZE);
        __syncthreads();
    }
}

template <int DT>
__device__ __forceinline__ void gate_up_mma_block(const unsigned char* slots, const int* tiles,
                                                  const unsigned int* order, const float* x,
                                                  float* activated, int top_k, int hidden,
                                                  int intermediate, long long stride,
                                                  long long gate_up_scales,
                                                  unsigned short* shared) {
    const int* tile = tiles + 3 * (long long)blockIdx.y;
    int first = tile[0], count = tile[1], slot = tile[2];
    int c0 = blockIdx.x * MMA_COLUMNS;
    int b = threadIdx.x;  // this thread's staged weight row
    int column = c0 + (b / 64) * 32 + b % 32;
    int weight_row = (b % 64) < 32 ? column : intermediate + column;
    const unsigned char* matrix = slots + (long long)slot * stride;
    float acc[2][8][4];
    mma_tile_product<DT>(matrix, gate_up_scales, weight_row, column < intermediate, hidden, x,
                         order, first, count, (unsigned int)top_k, shared, acc);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int wm = warp & 1, wn = warp >> 1;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int t = wm * 32 + i * 16 + lane / 4 + 8 * half;
            if (t >= count) continue;
            long long p = order[first + t];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int c = c0 + wn * 32 + j * 8 + 2 * (lane % 4) + e;
                    float gate = acc[i][j][2 * half + e], up = acc[i][j + 4][2 * half + e];
                    if (c < intermediate) activated[p * intermediate + c] = silu(gate) * up;
                }
            }
        }
    }
}

template <int DT>
__device__ __forceinline__ void down_mma_block(const unsigned char* slots, const int* tiles,
                                               const unsigned int* order, const float* weights,
                                               const float* activated, float* pair_out,
                                               int hidden, int intermediate, long long stride,
                                               long long down_offset, long long down_scales,
                                               unsigned short* shared) {
    const int* tile = tiles + 3 * (long long)blockIdx.y;
    int first = tile[0], count = tile[1], slot = tile[2];
    int r0 = blockIdx.x * MMA_TILE_ROWS;
    int weight_row = r0 + threadIdx.x;
    const unsigned char* matrix = slots + (long long)slot * stride + down_offset;
    float acc[2][8][4];
    mma_tile_product<DT>(matrix, down_scales, weight_row, weight_row < hidden, intermediate,
                         activated, order, first, count, 1u, shared, acc);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int wm = warp & 1, wn = warp >> 1;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int t = wm * 32 + i * 16 + lane / 4 + 8 * half;
            if (t >= count) continue;
            long long p = order[first + t];
            float w = weights[p];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int r = r0 + wn * 64 + j * 8 + 2 * (lane % 4) + e;
                    if (r < hidden) pair_out[p * hidden + r] = w * acc[i][j][2 * half + e];
                }
            }
        }
    }
}

// grid (ceil(intermediate / MMA_COLUMNS), tiles), MMA_THREADS threads, no dynamic shared memory;
// `dtype` bf16, int8 or int4. activated[p, c] for the tile's pairs.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    expert_gate_up_mma(const unsigned char* slots, const int* tiles, const unsigned int* order,
                       const float* x, float* activated, int top_k, int hidden, int intermediate,
                       long long stride, int dtype, long long gate_up_scales) {
    PDL_WAIT_AND_RELEASE();
    __shared__ __align__(16) unsigned short shared[MMA_SHARED];
    if (dtype == DTYPE_INT8)
        gate_up_mma_block<DTYPE_INT8>(slots, tiles, order, x, activated, top_k, hidden,
                                      intermediate, stride, gate_up_scales, shared);
    else if (dtype == DTYPE_INT4)
        gate_up_mma_block<DTYPE_INT4>(slots, tiles, order, x, activated, top_k, hidden,
                                      intermediate, stride, gate_up_scales, shared);
    else
        gate_up_mma_block<DTYPE_BF16>(slots, tiles, order, x, activated, top_k, hidden,
                                      intermediate, stride, gate_up_scales, shared);
}

// grid (ceil(hidden / MMA_TILE_ROWS), tiles), MMA_THREADS threads, no dynamic shared memory.
// pair_out[p, r] = w_p · (down_r · activated[p]) for the tile's pairs; other pairs' rows are not
// written (the host zeroes them).
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    expert_down_mma(const unsigned char* slots, const int* tiles, const unsigned int* order,
                    const float* weights, const float* activated, float* pair_out, int hidden,
                    int intermediate, long long stride, int dtype, long long down_offset,
                    long long down_scales) {
    PDL_WAIT_AND_RELEASE();
    __shared__ __align__(16) unsigned short shared[MMA_SHARED];
    if (dtype == DTYPE_INT8)
        down_mma_block<DTYPE_INT8>(slots, tiles, order, weights, activated, pair_out, hidden,
                                   intermediate, stride, down_offset, down_scales, shared);
    else if (dtype == DTYPE_INT4)
        down_mma_block<DTYPE_INT4>(slots, tiles, order, weights, activated, pair_out, hidden,
                                   intermediate, stride, down_offset, down_scales, shared);
    else
        down_mma_block<DTYPE_BF16>(slots, tiles, order, weights, activated, pair_out, hidden,
                                   intermediate, stride, down_offset, down_scales, shared);
}
