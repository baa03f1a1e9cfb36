// Routed experts held in GPU slots (see services/engine/src/backend/cuda/expert_slots.rs).
//
// Slots are one device buffer of `slots × stride` bytes; each slot holds one expert exactly as
// its bank stores it (docs/FORMAT.md): `gate_up` [2·I, H] at offset 0, `down` [H, I] at
// `down_offset`, each either f32, bf16, or int8 / int4 with one f16 scale per 32 inputs (the
// scales at `*_scales` from the matrix start). `slot_of_expert[e]` is e's slot or −1: the table
// is device data so a later expert cache can change residency between steps without touching
// the launches. Weights are dequantized in the kernel, accumulation is f32.
//
// One MoE layer is three launches over all (token, choice) pairs of the batch at once:
//   expert_gate_up  activated[p, c] = silu(gate_c · x_t) · (up_c · x_t)     (slotted pairs only)
//   expert_down     pair_out[p, r]  = w_p · (down_r · activated[p])         (0 for other pairs)
//   expert_pair_sum out[t, r]       = Σ_j pair_out[t·k + j, r]              (fixed order)
// Each warp computes one output row of one pair; its lanes read consecutive groups of the row
// (coalesced), the pair's input vector sits in shared memory. Summing the pairs in a fixed
// order (no atomics) keeps results deterministic and independent of the batch.

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_INT8 2
#define DTYPE_INT4 3
#define GROUP 32

__device__ __forceinline__ float f16_bits_to_float(unsigned short bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned int bits) {
    return __uint_as_float(bits << 16);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// Sum over the warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Lane's share of `row · x` for row `row` of a [rows, cols] matrix starting at `matrix`, whose
// f16 scales (quantized dtypes) start `scales` bytes after `matrix`. `x` is in shared memory.
__device__ float row_dot_partial(const unsigned char* matrix, long long scales, int dtype, int row,
                                 int cols, const float* x, int lane) {
    float acc = 0.0f;
    if (dtype == DTYPE_F32) {
        const float* w = reinterpret_cast<const float*>(matrix) + (long long)row * cols;
        for (int c = lane; c < cols; c += 32) acc += w[c] * x[c];
    } else if (dtype == DTYPE_BF16) {
        const unsigned short* w =
            reinterpret_cast<const unsigned short*>(matrix) + (long long)row * cols;
        for (int c = lane; c < cols; c += 32) acc += bf16_bits_to_float(w[c]) * x[c];
    } else {
        // cols is a multiple of 32 (the format requires it for quantized matrices).
        int groups = cols / GROUP;
        const unsigned short* scale_row =
            reinterpret_cast<const unsigned short*>(matrix + scales) + (long long)row * groups;
        if (dtype == DTYPE_INT8) {
            const unsigned char* values = matrix + (long long)row * cols;
            for (int g = lane; g < groups; g += 32) {
                // 32 signed bytes: two 16-byte loads (rows start 32-byte aligned).
                const uint4* p = reinterpret_cast<const uint4*>(values + g * GROUP);
                uint4 words[2] = {p[0], p[1]};
                const unsigned int* u = reinterpret_cast<const unsigned int*>(words);
                const float* xg = x + g * GROUP;
                float sum = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    unsigned int word = u[i];
#pragma unroll
                    for (int b = 0; b < 4; ++b) {
                        int q = (int)(signed char)((word >> (8 * b)) & 0xffu);
                        sum += (float)q * xg[4 * i + b];
                    }
                }
                acc += sum * f16_bits_to_float(scale_row[g]);
            }
        } else {
            const unsigned char* values = matrix + (long long)row * (cols / 2);
            for (int g = lane; g < groups; g += 32) {
                // 32 nibbles = 16 bytes, one load; element 2j is byte j's low nibble, stored + 8.
                uint4 word4 = *reinterpret_cast<const uint4*>(values + g * (GROUP / 2));
                const unsigned int* u = reinterpret_cast<const unsigned int*>(&word4);
                const float* xg = x + g * GROUP;
                float sum = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    unsigned int word = u[i];
#pragma unroll
                    for (int b = 0; b < 8; ++b) {
                        int q = (int)((word >> (4 * b)) & 0xfu) - 8;
                        sum += (float)q * xg[8 * i + b];
                    }
                }
                acc += sum * f16_bits_to_float(scale_row[g]);
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

// grid (ceil(intermediate / warps), pairs), dynamic shared memory hidden floats.
extern "C" __global__ void expert_gate_up(const unsigned char* slots, const int* slot_of_expert,
                                          const unsigned int* ids, const float* x,
                                          float* activated, int top_k, int num_experts,
                                          int hidden, int intermediate, long long stride,
                                          int dtype, long long gate_up_scales) {
    extern __shared__ float shared_x[];
    int p = blockIdx.y;
    int slot = pair_slot(slot_of_expert, ids, p, num_experts);
    if (slot < 0) return;  // the whole block leaves together
    const float* xt = x + (long long)(p / top_k) * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) shared_x[c] = xt[c];
    __syncthreads();
    int warps = blockDim.x / 32;
    int lane = threadIdx.x % 32;
    int c = blockIdx.x * warps + threadIdx.x / 32;
    if (c >= intermediate) return;
    const unsigned char* matrix = slots + (long long)slot * stride;
    float gate = warp_sum(row_dot_partial(matrix, gate_up_scales, dtype, c, hidden, shared_x, lane));
    float up = warp_sum(
        row_dot_partial(matrix, gate_up_scales, dtype, intermediate + c, hidden, shared_x, lane));
    if (lane == 0) activated[(long long)p * intermediate + c] = silu(gate) * up;
}

// grid (ceil(hidden / warps), pairs), dynamic shared memory intermediate floats.
extern "C" __global__ void expert_down(const unsigned char* slots, const int* slot_of_expert,
                                       const unsigned int* ids, const float* weights,
                                       const float* activated, float* pair_out, int num_experts,
                                       int hidden, int intermediate, long long stride, int dtype,
                                       long long down_offset, long long down_scales) {
    extern __shared__ float shared_a[];
    int p = blockIdx.y;
    int slot = pair_slot(slot_of_expert, ids, p, num_experts);
    int warps = blockDim.x / 32;
    int lane = threadIdx.x % 32;
    int r = blockIdx.x * warps + threadIdx.x / 32;
    if (slot < 0) {
        // Other pairs add nothing: their experts run elsewhere.
        if (r < hidden && lane == 0) pair_out[(long long)p * hidden + r] = 0.0f;
        return;
    }
    const float* ap = activated + (long long)p * intermediate;
    for (int c = threadIdx.x; c < intermediate; c += blockDim.x) shared_a[c] = ap[c];
    __syncthreads();
    if (r >= hidden) return;
    const unsigned char* matrix = slots + (long long)slot * stride + down_offset;
    float y = warp_sum(row_dot_partial(matrix, down_scales, dtype, r, intermediate, shared_a, lane));
    if (lane == 0) pair_out[(long long)p * hidden + r] = weights[p] * y;
}

// out[t, r] = Σ_j pair_out[t·k + j, r], j in increasing order. One thread per output,
// grid-stride (the launch caps the block count).
extern "C" __global__ void expert_pair_sum(const float* pair_out, float* out, int tokens, int top_k,
                                           int hidden) {
    long long total = (long long)tokens * hidden;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / hidden;
        int r = (int)(i % hidden);
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j) sum += pair_out[(t * top_k + j) * hidden + r];
        out[i] = sum;
    }
}
