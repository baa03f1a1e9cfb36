// The helpers every routed-expert kernel file shares (kernels/experts.cu, kernels/experts_mma.cu):
// the slot layout's dtype codes, the quantization group and the padded input segments, reading
// and dequantizing a stored row, staging inputs in shared memory, a pair's slot.

#pragma once

#include "common.cuh"

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_INT8 2
#define DTYPE_INT4 3
#define GROUP 32
#define SEG 16
#define SEG_STRIDE 20
// Output rows per warp of `expert_down`, activated columns per warp of `expert_gate_up`
// (experts.rs mirrors both). Four short down rows per warp put more loads in flight; a gate/up
// column is already two long rows, and the kernel bench measured two or four columns per warp
// slower (fewer warps), so one stays the default.
#define DOWN_ROWS 4
// Most choices per token `expert_down_sum` takes (experts.rs mirrors it).
#define DOWN_SUM_MAX_TOP_K 32
#ifndef GATE_UP_COLUMNS
#define GATE_UP_COLUMNS 1
#endif

// Grouped kernels: pairs per tile, inputs staged per pass (one 16-input segment per lane),
// warps per block and weight rows per warp. experts.rs mirrors TILE_TOKENS, GROUPED_WARPS
// and the rows per block (GROUPED_WARPS · 2 columns for gate_up, GROUPED_WARPS · 4 rows for down).
#define TILE_TOKENS 16
#define CHUNK 512
#define CHUNK_STRIDE (CHUNK / SEG * SEG_STRIDE)
#define GROUPED_WARPS 8
#define GROUPED_ROWS 4

__device__ __forceinline__ float f16_bits_to_float(unsigned short bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }


// Where input c sits in a padded shared vector.
__device__ __forceinline__ int padded(int c) { return (c >> 4) * SEG_STRIDE + (c & 15); }

// Element c of row `row` of a float-typed [rows, cols] matrix.
__device__ __forceinline__ float float_weight(const unsigned char* matrix, int dtype, int row,
                                              int cols, int c) {
    long long at = (long long)row * cols + c;
    if (dtype == DTYPE_F32) return reinterpret_cast<const float*>(matrix)[at];
    return bf16_bits_to_float(reinterpret_cast<const unsigned short*>(matrix)[at]);
}

// Codes stored per row of a quantized matrix of `cols` inputs: whole groups of 32.
__device__ __forceinline__ int stored_cols(int cols) { return (cols + GROUP - 1) / GROUP * GROUP; }

// Segments of 16 inputs a quantized row of `cols` inputs spans (the last one may be partial).
__device__ __forceinline__ int segments_of(int cols) { return (cols + SEG - 1) / SEG; }

// Quantized [rows, cols] matrices: rows of stored_cols(cols) codes, 16-byte aligned; the
// 16-input segment s uses the f16 scale of group s / 2.
__device__ __forceinline__ float segment_scale(const unsigned char* matrix, long long scales,
                                               int row, int cols, int s) {
    const unsigned short* scale_row = reinterpret_cast<const unsigned short*>(matrix + scales) +
                                      (long long)row * (stored_cols(cols) / GROUP);
    return f16_bits_to_float(scale_row[s >> 1]);
}

// The raw bits of segment s of row `row` (int8: 16 bytes; int4: 8 bytes in .x, .y).
template <int DT>
__device__ __forceinline__ uint4 segment_bits(const unsigned char* matrix, int row, int cols,
                                              int s) {
    if (DT == DTYPE_INT8)
        return *reinterpret_cast<const uint4*>(matrix + (long long)row * stored_cols(cols) +
                                               s * SEG);
    uint2 half = *reinterpret_cast<const uint2*>(matrix + (long long)row * (stored_cols(cols) / 2) +
                                                 s * (SEG / 2));
    return make_uint4(half.x, half.y, 0u, 0u);
}

__device__ __forceinline__ unsigned int word_of(uint4 bits, int i) {
    return i == 0 ? bits.x : i == 1 ? bits.y : i == 2 ? bits.z : bits.w;
}

// Weights 4q … 4q+3 of a segment, dequantized exactly: q · scale.
//
// The integer q reaches f32 without an int-to-float conversion (a quarter-rate instruction, and
// decode's expert kernels issue one per weight): q + bias is written into the low mantissa bits
// of 2^23 (int8: the byte with its sign bit flipped is q + 128, placed by one byte permute; int4:
// the nibble is q + 8, placed by a shift and a mask-or), which is the float 2^23 + q + bias
// exactly, and subtracting 2^23 + bias leaves q exactly (integers below 2^24). The same value
// as `(float)q`, so the same bits downstream.
#define MAGIC_2_23 0x4B000000u
template <int DT>
__device__ __forceinline__ void quad_weights(uint4 bits, float scale, int q, float w[4]) {
    if (DT == DTYPE_INT8) {
        unsigned int biased = word_of(bits, q) ^ 0x80808080u;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            // Result bytes: the weight's biased byte, then 0x00, 0x00, 0x4B (bytes 4, 5, 7 of
            // the pair (biased, MAGIC_2_23)).
            unsigned int magic = __byte_perm(biased, MAGIC_2_23, 0x7540u + e);
            float value = __fsub_rn(__uint_as_float(magic), 8388736.0f);  // 2^23 + 128
            w[e] = __fmul_rn(value, scale);
        }
    } else {
        unsigned int word = word_of(bits, q >> 1) >> (16 * (q & 1));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            unsigned int magic = ((word >> (4 * e)) & 0xfu) | MAGIC_2_23;
            float value = __fsub_rn(__uint_as_float(magic), 8388616.0f);  // 2^23 + 8
            w[e] = __fmul_rn(value, scale);
        }
    }
}

// The 16 weights of segment s (inputs 16·s …) of row `row`, dequantized exactly (|q| ≤ 128
// times an f16 scale fits a float's mantissa).
template <int DT>
__device__ __forceinline__ void segment_weights(const unsigned char* matrix, long long scales,
                                                int row, int cols, int s, float w[SEG]) {
    uint4 bits = segment_bits<DT>(matrix, row, cols, s);
    float scale = segment_scale(matrix, scales, row, cols, s);
#pragma unroll
    for (int q = 0; q < SEG / 4; ++q) quad_weights<DT>(bits, scale, q, w + 4 * q);
}

// Lane's share of `row · x` for row `row` of a [rows, cols] matrix starting at `matrix`, whose
// f16 scales (quantized dtypes) start `scales` bytes after `matrix`. `x` is in shared memory,
// padded. The order is the one described at the top of the file.
__device__ __forceinline__ float row_dot_partial(const unsigned char* matrix, long long scales, int dtype, int row,
                                 int cols, const float* x, int lane) {
    float acc = 0.0f;
    if (dtype == DTYPE_F32 || dtype == DTYPE_BF16) {
        for (int c = lane; c < cols; c += 32)
            acc = __fmaf_rn(float_weight(matrix, dtype, row, cols, c), x[padded(c)], acc);
    } else {
        int segments = segments_of(cols);
        // Unrolled so several segments' loads are in flight (decode is latency-bound); the
        // order of the additions is unchanged.
#pragma unroll 4
        for (int s = lane; s < segments; s += 32) {
            float w[SEG];
            if (dtype == DTYPE_INT8)
                segment_weights<DTYPE_INT8>(matrix, scales, row, cols, s, w);
            else
                segment_weights<DTYPE_INT4>(matrix, scales, row, cols, s, w);
            const float4* xs = reinterpret_cast<const float4*>(x + s * SEG_STRIDE);
#pragma unroll
            for (int q = 0; q < SEG / 4; ++q) {
                float4 v = xs[q];
                acc = __fmaf_rn(w[4 * q], v.x, acc);
                acc = __fmaf_rn(w[4 * q + 1], v.y, acc);
                acc = __fmaf_rn(w[4 * q + 2], v.z, acc);
                acc = __fmaf_rn(w[4 * q + 3], v.w, acc);
            }
        }
    }
    return acc;
}

// Rows j < rows of `src` (row j at src + j·len, len inputs) into padded shared vectors (row j
// at dst + j·segments_of(len)·SEG_STRIDE), zero past `len` up to the last segment; rows with
// `skip[j] < 0` (when `skip` is given) are left alone. Each thread issues a pass's loads
// (STAGE_UNROLL, 16 bytes each where rows are whole, aligned quads) before its first store: a
// loop of load-then-store waits one L2 round trip per element. Copies values, so the bits
// downstream do not change. Does not synchronise.
#define STAGE_UNROLL 8
// `written_this_launch`: src was written by other blocks of this launch (the read-only data
// path, __ldg, is then not allowed: loads go through L2 only).
__device__ __forceinline__ void stage_padded_rows(const float* src, int rows, int len,
                                                  const int* skip, float* dst,
                                                  bool written_this_launch = false) {
    int width = segments_of(len) * SEG;
    int padded_width = segments_of(len) * SEG_STRIDE;
    if ((len & 3) == 0 && (reinterpret_cast<unsigned long long>(src) & 15) == 0) {
        int row_quads = width / 4, quads = rows * row_quads;
        for (int base = threadIdx.x; base < quads; base += STAGE_UNROLL * blockDim.x) {
            float4 v[STAGE_UNROLL];
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; ++u) {
                int i = base + u * blockDim.x;
                int j = i / row_quads, q = i % row_quads;
                bool load = i < quads && 4 * q < len && !(skip && skip[j] < 0);
                const float4* at = reinterpret_cast<const float4*>(src + (long long)j * len) + q;
                v[u] = !load                 ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                       : written_this_launch ? __ldcg(at)
                                             : __ldg(at);
            }
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; ++u) {
                int i = base + u * blockDim.x;
                int j = i / row_quads, q = i % row_quads;
                if (i < quads && !(skip && skip[j] < 0))
                    *reinterpret_cast<float4*>(dst + j * padded_width + padded(4 * q)) = v[u];
            }
        }
        return;
    }
    for (int base = threadIdx.x; base < rows * width; base += STAGE_UNROLL * blockDim.x) {
        float v[STAGE_UNROLL];
#pragma unroll
        for (int u = 0; u < STAGE_UNROLL; ++u) {
            int i = base + u * blockDim.x;
            int j = i / width, c = i % width;
            bool load = i < rows * width && c < len && !(skip && skip[j] < 0);
            const float* at = src + (long long)j * len + c;
            v[u] = !load ? 0.0f : written_this_launch ? __ldcg(at) : __ldg(at);
        }
#pragma unroll
        for (int u = 0; u < STAGE_UNROLL; ++u) {
            int i = base + u * blockDim.x;
            int j = i / width, c = i % width;
            if (i < rows * width && !(skip && skip[j] < 0)) dst[j * padded_width + padded(c)] = v[u];
        }
    }
}

// 16-byte weight loads a lane of `expert_down_sum` keeps in flight (more cost registers, and
// the blocks that fit a multiprocessor with them).
#ifndef DOWN_SUM_LOADS
#define DOWN_SUM_LOADS 8
#endif

// A lane's segments s = lane + 32·q (q < SEGS) of one quantized row: bits and scales.
template <int DT, int SEGS>
__device__ __forceinline__ void load_row_segments(const unsigned char* matrix, long long scales,
                                                  int row, int cols, int lane, uint4 (&bits)[SEGS],
                                                  float (&scale)[SEGS]) {
    int segments = segments_of(cols);
#pragma unroll
    for (int q = 0; q < SEGS; ++q) {
        int s = lane + 32 * q;
        if (s < segments) {
            bits[q] = segment_bits<DT>(matrix, row, cols, s);
            scale[q] = segment_scale(matrix, scales, row, cols, s);
        } else {
            bits[q] = make_uint4(0u, 0u, 0u, 0u);
            scale[q] = 0.0f;
        }
    }
}

// `row_dot_partial` of a row whose segments `load_row_segments` loaded: the same products in
// the same order.
template <int DT, int SEGS>
__device__ __forceinline__ float loaded_row_dot_partial(const uint4 (&bits)[SEGS],
                                                        const float (&scale)[SEGS], int cols,
                                                        const float* x, int lane) {
    int segments = segments_of(cols);
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < SEGS; ++q) {
        int s = lane + 32 * q;
        if (s < segments) {
            float w[SEG];
#pragma unroll
            for (int u = 0; u < SEG / 4; ++u) quad_weights<DT>(bits[q], scale[q], u, w + 4 * u);
            const float4* xs = reinterpret_cast<const float4*>(x + s * SEG_STRIDE);
#pragma unroll
            for (int u = 0; u < SEG / 4; ++u) {
                float4 v = xs[u];
                acc = __fmaf_rn(w[4 * u], v.x, acc);
                acc = __fmaf_rn(w[4 * u + 1], v.y, acc);
                acc = __fmaf_rn(w[4 * u + 2], v.z, acc);
                acc = __fmaf_rn(w[4 * u + 3], v.w, acc);
            }
        }
    }
    return acc;
}

// The slot of pair p's expert, or −1 (not resident, or not a valid expert id).
__device__ __forceinline__ int pair_slot(const int* slot_of_expert, const unsigned int* ids, int p,
                                         int num_experts) {
    unsigned int expert = ids[p];
    if (expert >= (unsigned int)num_experts) return -1;
    return slot_of_expert[expert];
}
