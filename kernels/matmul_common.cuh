// The warp body of the dense matmuls (kernels/matmul.cu), for kernels that compute a small
// matmul's outputs themselves and must give its bits (the decode router in kernels/router.cu):
// one warp forms each output's sum in an order that depends only on k (see matmul.cu's notes).
#pragma once

#include "common.cuh"

#define ROWS 8
// Most output features one warp computes together (more weight loads in flight per warp; the
// values do not depend on it).
#define MAX_COLS 2
// Steps of a lane's k loop unrolled (loads in flight per feature). Overridable so the kernel
// bench can compare settings.
#ifndef UNROLL
#define UNROLL 4
#endif
#define MATMUL_STRINGIFY(text) #text
#define MATMUL_PRAGMA(text) _Pragma(MATMUL_STRINGIFY(text))
#define UNROLL_STEPS MATMUL_PRAGMA(unroll UNROLL)

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

// Where a matmul's activations come from: `PlainRows` reads x ([n, k] f32); `SiluMulRows`
// forms silu(gate) · up ([n, k] each) as it reads, exactly as `silu_mul` (elementwise.cu) would
// have stored it, so the products and sums after are those of `silu_mul` then the matmul;
// `MulSigmoidRows` forms x · sigmoid(gate) as `mul_sigmoid` does.
struct PlainRows {
    const float* x;
    int k;
    __device__ __forceinline__ float4 load4(long long r, int kk) const {
        return *reinterpret_cast<const float4*>(x + r * k + kk);
    }
    __device__ __forceinline__ void load8(long long r, int kk, float4& a, float4& b) const {
        const float* at = x + r * k + kk;
        a = *reinterpret_cast<const float4*>(at);
        b = *reinterpret_cast<const float4*>(at + 4);
    }
    __device__ __forceinline__ float load1(long long r, int kk) const { return x[r * k + kk]; }
};
// Rows formed from two tensors a and b ([n, k] each) element by element with Op::of(a, b).
template <typename Op>
struct PairRows {
    const float* a;
    const float* b;
    int k;
    __device__ __forceinline__ float4 load4(long long r, int kk) const {
        float4 u = *reinterpret_cast<const float4*>(a + r * k + kk);
        float4 v = *reinterpret_cast<const float4*>(b + r * k + kk);
        return make_float4(Op::of(u.x, v.x), Op::of(u.y, v.y), Op::of(u.z, v.z),
                           Op::of(u.w, v.w));
    }
    __device__ __forceinline__ void load8(long long r, int kk, float4& lo, float4& hi) const {
        lo = load4(r, kk);
        hi = load4(r, kk + 4);
    }
    __device__ __forceinline__ float load1(long long r, int kk) const {
        return Op::of(a[r * k + kk], b[r * k + kk]);
    }
};
// silu(gate) · up, as `silu_mul` stores it.
struct SiluMul {
    static __device__ __forceinline__ float of(float gate, float up) { return silu_f(gate) * up; }
};
// x · sigmoid(gate), as `mul_sigmoid` stores it.
struct MulSigmoid {
    static __device__ __forceinline__ float of(float x, float gate) { return x * sigmoid_f(gate); }
};
using SiluMulRows = PairRows<SiluMul>;
using MulSigmoidRows = PairRows<MulSigmoid>;

// Output features col .. col + C (those < m) of rows r0 .. r0 + R (those < n) of
// out[n, m] = x · wᵀ, by one warp. Each output's sum is formed exactly the same way whatever C
// and R are (the same lane chunks in the same order, then the same butterfly): C only puts more
// weight loads in flight per warp and reuses each activation load for C features, and R is the
// row group's size rounded up (a warp with one row runs no code for seven others).
template <typename W, int C, int R, typename X>
__device__ void matmul_output(const X& x, const W* w, float* out, int n, int k, int m, int col,
                              int r0, int lane) {
    const W* wr[C];
    bool live[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        live[c] = col + c < m;
        wr[c] = w + (long long)(live[c] ? col + c : col) * k;
    }
    float acc[C][R];
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[c][r] = 0.0f;
    }
    bool eight_wide = false;
    if constexpr (sizeof(W) == 2) eight_wide = (k & 7) == 0;
    if (eight_wide) {
        // bf16, k % 8 == 0: lane l takes k in [8l, 8l + 8) + 256 i, one 16-byte load per lane
        // per step and feature (decode is bound by the bytes in flight).
        UNROLL_STEPS
        for (int kk = lane * 8; kk < k; kk += 256) {
            float wv[C][8];
#pragma unroll
            for (int c = 0; c < C; ++c) {
                uint4 raw = live[c] ? *reinterpret_cast<const uint4*>(wr[c] + kk) : make_uint4(0, 0, 0, 0);
                wv[c][0] = __uint_as_float(raw.x << 16);
                wv[c][1] = __uint_as_float(raw.x & 0xffff0000u);
                wv[c][2] = __uint_as_float(raw.y << 16);
                wv[c][3] = __uint_as_float(raw.y & 0xffff0000u);
                wv[c][4] = __uint_as_float(raw.z << 16);
                wv[c][5] = __uint_as_float(raw.z & 0xffff0000u);
                wv[c][6] = __uint_as_float(raw.w << 16);
                wv[c][7] = __uint_as_float(raw.w & 0xffff0000u);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r0 + r < n) {
                    float4 xa, xb;
                    x.load8(r0 + r, kk, xa, xb);
#pragma unroll
                    for (int c = 0; c < C; ++c) {
                        acc[c][r] += wv[c][0] * xa.x;
                        acc[c][r] += wv[c][1] * xa.y;
                        acc[c][r] += wv[c][2] * xa.z;
                        acc[c][r] += wv[c][3] * xa.w;
                        acc[c][r] += wv[c][4] * xb.x;
                        acc[c][r] += wv[c][5] * xb.y;
                        acc[c][r] += wv[c][6] * xb.z;
                        acc[c][r] += wv[c][7] * xb.w;
                    }
                }
            }
        }
    } else if ((k & 3) == 0) {
        // Lane l takes k in [4l, 4l + 4) + 128 i: one 16-byte (f32) or 8-byte (bf16) load per
        // lane per step and feature, several steps in flight.
        UNROLL_STEPS
        for (int kk = lane * 4; kk < k; kk += 128) {
            float4 wv[C];
#pragma unroll
            for (int c = 0; c < C; ++c)
                wv[c] = live[c] ? load_weight4(wr[c], kk) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r0 + r < n) {
                    float4 xv = x.load4(r0 + r, kk);
#pragma unroll
                    for (int c = 0; c < C; ++c) {
                        acc[c][r] += wv[c].x * xv.x;
                        acc[c][r] += wv[c].y * xv.y;
                        acc[c][r] += wv[c].z * xv.z;
                        acc[c][r] += wv[c].w * xv.w;
                    }
                }
            }
        }
    } else {
        for (int kk = lane; kk < k; kk += 32) {
            float wv[C];
#pragma unroll
            for (int c = 0; c < C; ++c) wv[c] = live[c] ? load_weight(wr[c], kk) : 0.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r0 + r < n) {
                    float xv = x.load1(r0 + r, kk);
#pragma unroll
                    for (int c = 0; c < C; ++c) acc[c][r] += wv[c] * xv;
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[c][r];
            for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
            if (lane == 0 && live[c] && r0 + r < n) out[(long long)(r0 + r) * m + col + c] = v;
        }
    }
}

// The row group r0 .. min(r0 + ROWS, n) with R = its size rounded up to 1, 2, 4 or ROWS.
template <typename W, int C, typename X>
__device__ void matmul_row_group(const X& x, const W* w, float* out, int n, int k, int m,
                                 int col, int r0, int lane) {
    int rows_here = n - r0;
    if (rows_here == 1) {
        matmul_output<W, C, 1>(x, w, out, n, k, m, col, r0, lane);
    } else if (rows_here <= 2) {
        matmul_output<W, C, 2>(x, w, out, n, k, m, col, r0, lane);
    } else if (rows_here <= 4) {
        matmul_output<W, C, 4>(x, w, out, n, k, m, col, r0, lane);
    } else {
        matmul_output<W, C, ROWS>(x, w, out, n, k, m, col, r0, lane);
    }
}

// `cols` output features per warp: 1, or MAX_COLS (the host's choice per shape: more features
// per warp means fewer warps, which pays only when there are many).
template <typename W, typename X>
__device__ void matmul_task(const X& x, const W* w, float* out, int n, int k, int m, int cols,
                            int col, int r0, int lane) {
    if (cols == MAX_COLS) {
        matmul_row_group<W, MAX_COLS>(x, w, out, n, k, m, col, r0, lane);
    } else {
        matmul_row_group<W, 1>(x, w, out, n, k, m, col, r0, lane);
    }
}

// Tasks: (group of `cols` output features, group of ROWS rows), feature groups fastest.
template <typename W, typename X>
__device__ void matmul_warp(const X& x, const W* w, float* out, int n, int k, int m, int cols) {
    int warps_per_block = blockDim.x / 32;
    long long task = (long long)blockIdx.x * warps_per_block + threadIdx.x / 32;
    long long groups = (n + ROWS - 1) / ROWS;
    long long column_groups = (m + cols - 1) / cols;
    if (task >= groups * column_groups) return;  // whole warps leave together
    matmul_task(x, w, out, n, k, m, cols, (int)(task % column_groups) * cols,
                (int)(task / column_groups) * ROWS, threadIdx.x % 32);
}

// Decode (one row group): the weight rows of the warp's feature group `group` asked of L2
// before the PDL wait, so they stream in while the kernel before this one finishes (its
// weights are what a decode matmul waits for; they do not depend on the predecessor).
template <typename W>
__device__ __forceinline__ void prefetch_feature_group(const W* w, int n, int k, int m, int cols,
                                                       long long group) {
    if (n > ROWS) return;
    long long col = group * cols;
    if (col >= m) return;
    long long rows = m - col < cols ? m - col : cols;
    prefetch_l2_span(w + col * k, rows * k * (long long)sizeof(W), threadIdx.x % 32, 32);
}

__device__ __forceinline__ long long warp_task() {
    return (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
}
