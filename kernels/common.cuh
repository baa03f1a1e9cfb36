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

// Programmatic dependent launch (PDL, sm_90+). The backend may launch kernels with the attribute
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (services/engine/src/backend/cuda/device/
// launch.rs), which lets the driver start a kernel's blocks while the kernel before it on the
// stream is still running. Every __global__ function must therefore begin with this prologue,
// before any global-memory read or write and before any early return (a unit test in
// kernels.rs checks that each one does):
//
// - `griddepcontrol.wait` blocks until every grid this one depends on programmatically has
//   completed and its memory operations are visible; on a launch without the attribute it
//   returns at once. Nothing in the kernel touches memory before it, so a kernel observes
//   exactly what it would under plain stream order.
// - `griddepcontrol.launch_dependents` then lets the next kernel on the stream be scheduled.
//   Its blocks only get as far as their own wait, which cannot return before this grid has
//   completed, and this grid's blocks are all past their own wait, so the predecessor has
//   completed too: the order is transitive, and no more than two grids overlap. The next grid
//   is only scheduled once every block of this one has triggered or exited, so its waiting
//   blocks cannot keep any block of this grid from being resident (no deadlock, also for
//   kernels that spin, like handoff_collect's poll of host memory).
// - Only kernel-to-kernel edges are relaxed: memcpy, memset, event records and waits, stream
//   memory operations and kernels launched without the attribute (cuBLAS) keep the full
//   serialization, and a kernel that follows one that never triggers (cuBLAS) starts when that
//   one completes. Host-mapped memory (routing stores, the worker hand-off) is read by the host
//   only after an event or a synchronisation, i.e. after kernel completion, as before.
//
// Below sm_90 the prologue is empty (the backend never uses PDL there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT_AND_RELEASE()                              \
    do {                                                    \
        asm volatile("griddepcontrol.wait;" ::: "memory"); \
        asm volatile("griddepcontrol.launch_dependents;");  \
    } while (0)
#else
#define PDL_WAIT_AND_RELEASE() \
    do {                       \
    } while (0)
#endif

// The one thing a kernel may do before its PDL prologue: ask L2 for bytes no kernel writes (its
// weights) while the kernel before it still runs. A prefetch returns no value and stores
// nothing, so what the kernel observes is still ordered after its predecessor; the prologue
// follows at once (the same unit test checks the pair). Under plain launches (below sm_90) the
// kernel starts after its predecessor anyway, and nothing is asked.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_L2_PREFETCH(when, statement) \
    do {                                 \
        if (when) {                      \
            statement;                   \
        }                                \
    } while (0)
#else
#define PDL_L2_PREFETCH(when, statement) \
    do {                                 \
    } while (0)
#endif

// `bytes` from `base` asked of L2, a 128-byte line per lane and step over `lanes` lanes.
__device__ __forceinline__ void prefetch_l2_span(const void* base, long long bytes, int lane,
                                                 int lanes) {
    const char* at = static_cast<const char*>(base);
    for (long long offset = (long long)lane * 128; offset < bytes; offset += (long long)lanes * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(at + offset));
}

// Whether this block is the last of the grid to get here: a ticket on `counter` once the block's
// stores are done (every thread of the block calls it; the last block then sees every block's
// stores).
__device__ __forceinline__ bool last_block_out(unsigned int* counter) {
    __shared__ bool last_block;
    __syncthreads();  // the block's stores done
    if (threadIdx.x == 0) {
        __threadfence();
        last_block = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last_block) __threadfence();
    return last_block;
}
