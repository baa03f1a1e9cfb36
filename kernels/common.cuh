// Helpers shared by the kernel files, handed to NVRTC as the header `common.cuh` (every .cu file
// is compiled on its own: this is the one copy of each).

#pragma once

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// PyTorch's softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// bf16 bits (the low 16 bits of `bits`) to f32: exact.
__device__ __forceinline__ float bf16_bits_to_float(unsigned int bits) {
    return __uint_as_float(bits << 16);
}

// Round to nearest even, as `half::bf16::from_f32` and PyTorch do; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Sum over the warp; every lane gets the same total (each step adds two equal-valued
// operands in either order, and float addition is commutative).
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Maximum over the warp; every lane gets it.
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}
