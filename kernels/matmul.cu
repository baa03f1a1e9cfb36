// Dense matmul of the CUDA backend: out[n, m] = x[n, k] · W[m, k]ᵀ, f32 activations, f32
// accumulation, weights stored as f32 or bf16 (bf16 → f32 is exact, so both compute the same
// function as the CPU backend on the same stored weights).
//
// Batch invariance: every output's sum is formed in an order that depends only on k, never on
// n or on where the row sits in the batch, so a row's result does not depend on the batch it
// is in (the golden tests require batched and single prefills to agree bit for bit).
//
// `matmul` / `matmul_bf16` (used for every n): one warp per (output feature, group of up to
// ROWS rows); each lane sums its own k positions (bf16 with k % 8 == 0: 8-wide chunks 256
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

#define ROWS 8

__device__ __forceinline__ float load_weight(const float* w, long long i) { return w[i]; }
__device__ __forceinline__ float load_weight(const unsigned short* w, long long i) {
    return __uint_as_float(((unsigned int)w[i]) << 16);
}

// Four consecutive weights as floats (k % 4 == 0 keeps every row 16-byte (f32) / 8-byte (bf16)
// aligned, k % 8 == 0 a bf16 row 16-byte aligned: device buffers start 256-byte aligned).
__device__ __forceinline__ float4 load_weight4(const float* w, long long i) {
    return *reinterpret_cast<const float4*>(w + i);
}
__device__ __forceinline__ float4 load_weight4(const unsigned short* w, long long i) {
    uint2 raw = *reinterpret_cast<const uint2*>(w + i);  // little-endian: low half first
    return make_float4(__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                       __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u));
}

// Output feature `col` of rows r0 .. r0 + ROWS (those < n) of out[n, m] = x · wᵀ, by one warp.
template <typename W>
__device__ void matmul_output(const float* x, const W* w, float* out, int n, int k, int m, int col,
                              int r0, int lane) {
    const W* wr = w + (long long)col * k;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    bool eight_wide = false;
    if constexpr (sizeof(W) == 2) eight_wide = (k & 7) == 0;
    if (eight_wide) {
        // bf16, k % 8 == 0: lane l takes k in [8l, 8l + 8) + 256 i, one 16-byte load per lane
        // per step (decode is bound by the bytes in flight, and 8-byte loads halved them).
#pragma unroll 4
        for (int kk = lane * 8; kk < k; kk += 256) {
            uint4 raw = *reinterpret_cast<const uint4*>(wr + kk);
            float wv[8] = {__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                           __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u),
                           __uint_as_float(raw.z << 16), __uint_as_float(raw.z & 0xffff0000u),
                           __uint_as_float(raw.w << 16), __uint_as_float(raw.w & 0xffff0000u)};
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r0 + r < n) {
                    const float* xr = x + (long long)(r0 + r) * k + kk;
                    float4 xa = *reinterpret_cast<const float4*>(xr);
                    float4 xb = *reinterpret_cast<const float4*>(xr + 4);
                    acc[r] += wv[0] * xa.x;
                    acc[r] += wv[1] * xa.y;
                    acc[r] += wv[2] * xa.z;
                    acc[r] += wv[3] * xa.w;
                    acc[r] += wv[4] * xb.x;
                    acc[r] += wv[5] * xb.y;
                    acc[r] += wv[6] * xb.z;
                    acc[r] += wv[7] * xb.w;
                }
            }
        }
    } else if ((k & 3) == 0) {
        // Lane l takes k in [4l, 4l + 4) + 128 i: one 16-byte (f32) or 8-byte (bf16) load per
        // lane per step, several steps in flight.
#pragma unroll 4
        for (int kk = lane * 4; kk < k; kk += 128) {
            float4 wv = load_weight4(wr, kk);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r0 + r < n) {
                    float4 xv = *reinterpret_cast<const float4*>(x + (long long)(r0 + r) * k + kk);
                    acc[r] += wv.x * xv.x;
                    acc[r] += wv.y * xv.y;
                    acc[r] += wv.z * xv.z;
                    acc[r] += wv.w * xv.w;
                }
            }
        }
    } else {
        for (int kk = lane; kk < k; kk += 32) {
            float wv = load_weight(wr, kk);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r0 + r < n) acc[r] += wv * x[(long long)(r0 + r) * k + kk];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float v = acc[r];
        for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
        if (lane == 0 && r0 + r < n) out[(long long)(r0 + r) * m + col] = v;
    }
}

template <typename W>
__device__ void matmul_warp(const float* x, const W* w, float* out, int n, int k, int m) {
    int warps_per_block = blockDim.x / 32;
    long long task = (long long)blockIdx.x * warps_per_block + threadIdx.x / 32;
    long long groups = (n + ROWS - 1) / ROWS;
    if (task >= groups * m) return;  // whole warps leave together
    matmul_output(x, w, out, n, k, m, (int)(task % m), (int)(task / m) * ROWS, threadIdx.x % 32);
}

extern "C" __global__ void matmul(const float* x, const float* w, float* out, int n, int k, int m) {
    matmul_warp(x, w, out, n, k, m);
}

extern "C" __global__ void matmul_bf16(const float* x, const unsigned short* w, float* out, int n,
                                       int k, int m) {
    matmul_warp(x, w, out, n, k, m);
}

// Three projections of one input in one launch (an attention layer's q, k and v at decode):
// out_i[n, m_i] = x · w_iᵀ, each output computed exactly as `matmul_bf16` computes it (the same
// warp body), so the values equal three launches'. A matrix with m_i = 0 is skipped.
extern "C" __global__ void matmul3_bf16(const float* x, const unsigned short* w0,
                                        const unsigned short* w1, const unsigned short* w2,
                                        float* out0, float* out1, float* out2, int n, int k,
                                        int m0, int m1, int m2) {
    int warps_per_block = blockDim.x / 32;
    long long task = (long long)blockIdx.x * warps_per_block + threadIdx.x / 32;
    long long groups = (n + ROWS - 1) / ROWS;
    int total = m0 + m1 + m2;
    if (task >= groups * total) return;  // whole warps leave together
    int col = (int)(task % total);
    int r0 = (int)(task / total) * ROWS;
    int lane = threadIdx.x % 32;
    if (col < m0) {
        matmul_output(x, w0, out0, n, k, m0, col, r0, lane);
    } else if (col < m0 + m1) {
        matmul_output(x, w1, out1, n, k, m1, col - m0, r0, lane);
    } else {
        matmul_output(x, w2, out2, n, k, m2, col - m0 - m1, r0, lane);
    }
}

// out[i] = bf16(x[i]) for the cuBLAS path's activations. One thread per element, grid-stride.
extern "C" __global__ void f32_to_bf16(const float* x, unsigned short* out, long long n) {
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
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        unsigned short h = f32_to_bf16_bits(x[i]);
        float rest = x[i] - __uint_as_float(((unsigned int)h) << 16);
        hi[i] = h;
        lo[i] = f32_to_bf16_bits(rest);
    }
}
