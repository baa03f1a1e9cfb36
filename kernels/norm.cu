// RMSNorm variants of the CUDA backend. One block per group (a row, or a head of a row for the
// per-head q/k norms); a fixed-shape tree reduction, so a group's result never depends on how
// many rows the batch has.

#include "common.cuh"
#include "norm_common.cuh"

// out = x / sqrt(mean(x²) + eps) * (offset + w), per group of `group` values. Launch with
// NORM_THREADS threads and one block per group (grid-stride over groups).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, long long groups,
                                    int group, float eps, float offset) {
    PDL_WAIT_AND_RELEASE();
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        const float* in = x + g * group;
        float cached[NORM_CACHED];
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < NORM_CACHED; ++j) {
            int i = threadIdx.x + j * NORM_THREADS;
            cached[j] = i < group ? in[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < NORM_CACHED; ++j) {
            if (threadIdx.x + j * NORM_THREADS < group) sum += cached[j] * cached[j];
        }
        for (int i = threadIdx.x + NORM_CACHED * NORM_THREADS; i < group; i += NORM_THREADS)
            sum += in[i] * in[i];
        float inverse = rsqrtf(block_sum(sum) / (float)group + eps);
#pragma unroll
        for (int j = 0; j < NORM_CACHED; ++j) {
            int i = threadIdx.x + j * NORM_THREADS;
            if (i < group) out[g * group + i] = cached[j] * inverse * (offset + w[i]);
        }
        for (int i = threadIdx.x + NORM_CACHED * NORM_THREADS; i < group; i += NORM_THREADS) {
            out[g * group + i] = in[i] * inverse * (offset + w[i]);
        }
    }
}

// `rms_norm` with a weight as wide as a row of `weight_groups` groups: group g is scaled by the
// weights of its place in the row, w + (g % weight_groups) · group (qwen4_exp's residual
// streams, one weight per stream). The arithmetic of `rms_norm`; one block per group.
extern "C" __global__ void row_weighted_rms_norm(const float* x, const float* w, float* out,
                                                 long long groups, int group, int weight_groups,
                                                 float eps, float offset) {
    PDL_WAIT_AND_RELEASE();
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        const float* in = x + g * group;
        const float* weights = w + (g % weight_groups) * group;
        float sum = 0.0f;
        for (int i = threadIdx.x; i < group; i += NORM_THREADS) sum += in[i] * in[i];
        float inverse = rsqrtf(block_sum(sum) / (float)group + eps);
        for (int i = threadIdx.x; i < group; i += NORM_THREADS) {
            out[g * group + i] = in[i] * inverse * (offset + weights[i]);
        }
    }
}

// RMSNorm of one group (a head) followed by the rotation of its first 2·half dims at
// `position`: the arithmetic of `rms_norm` and `rope` (elementwise.cu), in the same order. Every
// thread of the block calls it (it synchronises the block).
__device__ void norm_rope_group(const float* in, const float* w, float* o, int group, float eps,
                                float offset, float position, const float* inv_freq, int half) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < group; i += NORM_THREADS) sum += in[i] * in[i];
    float inverse = rsqrtf(block_sum(sum) / (float)group + eps);
    for (int i = threadIdx.x; i < group; i += NORM_THREADS) o[i] = in[i] * inverse * (offset + w[i]);
    __syncthreads();  // the rotation pairs values other threads normalised
    for (int p = threadIdx.x; p < half; p += NORM_THREADS) {
        float angle = position * inv_freq[p];
        float c = cosf(angle), s = sinf(angle);
        float u = o[p], v = o[p + half];
        o[p] = u * c - v * s;
        o[p + half] = v * c + u * s;
    }
    __syncthreads();  // before the next group's block_sum reuses shared memory
}

// `rms_norm` with one group per head (group = head_dim, `heads` groups per row) followed by
// `rope` (elementwise.cu) of the head's first 2·half dims at positions[row], in one launch: the
// same arithmetic as the two kernels, in the same order.
extern "C" __global__ void rms_norm_rope(const float* x, const float* w, float* out,
                                         long long groups, int group, float eps, float offset,
                                         const unsigned int* positions, const float* inv_freq,
                                         int heads, int half) {
    PDL_WAIT_AND_RELEASE();
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        norm_rope_group(x + g * group, w, out + g * group, group, eps, offset,
                        (float)positions[g / heads], inv_freq, half);
    }
}

// `rms_norm_rope` of two tensors with the same head size and rows (an attention layer's q and
// k) in one launch: groups [0, groups_a) are a's heads, the rest b's; each group's values are
// those `rms_norm_rope` gives it.
extern "C" __global__ void rms_norm_rope_pair(const float* x_a, const float* w_a, float* out_a,
                                              long long groups_a, int heads_a, const float* x_b,
                                              const float* w_b, float* out_b, long long groups_b,
                                              int heads_b, int group, float eps, float offset,
                                              const unsigned int* positions,
                                              const float* inv_freq, int half) {
    PDL_WAIT_AND_RELEASE();
    for (long long g = blockIdx.x; g < groups_a + groups_b; g += gridDim.x) {
        if (g < groups_a) {
            norm_rope_group(x_a + g * group, w_a, out_a + g * group, group, eps, offset,
                            (float)positions[g / heads_a], inv_freq, half);
        } else {
            long long h = g - groups_a;
            norm_rope_group(x_b + h * group, w_b, out_b + h * group, group, eps, offset,
                            (float)positions[h / heads_b], inv_freq, half);
        }
    }
}

// The residual add and the next RMSNorm in one pass: x += delta (written back), then
// out = rms_norm(x) exactly as `rms_norm` computes it (same threads, same summation order), so
// the fused op equals `add_assign` followed by `rms_norm` bit for bit.
extern "C" __global__ void add_rms_norm(float* x, const float* delta, const float* w, float* out,
                                        long long groups, int group, float eps, float offset) {
    PDL_WAIT_AND_RELEASE();
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        float* in = x + g * group;
        const float* d = delta + g * group;
        float cached[NORM_CACHED];
        float sum = add_into_registers(in, d, group, cached);
        for (int i = threadIdx.x + NORM_CACHED * NORM_THREADS; i < group; i += NORM_THREADS) {
            float v = in[i] + d[i];
            in[i] = v;
            sum += v * v;
        }
        float inverse = rsqrtf(block_sum(sum) / (float)group + eps);
#pragma unroll
        for (int j = 0; j < NORM_CACHED; ++j) {
            int i = threadIdx.x + j * NORM_THREADS;
            if (i < group) {
                in[i] = cached[j];
                out[g * group + i] = cached[j] * inverse * (offset + w[i]);
            }
        }
        for (int i = threadIdx.x + NORM_CACHED * NORM_THREADS; i < group; i += NORM_THREADS) {
            out[g * group + i] = in[i] * inverse * (offset + w[i]);
        }
    }
}

// GDN output norm: plain-weight RMSNorm per group, times silu(gate) (gate has x's shape).
extern "C" __global__ void gated_rms_norm(const float* x, const float* gate, const float* w,
                                          float* out, long long groups, int group, float eps) {
    PDL_WAIT_AND_RELEASE();
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        const float* in = x + g * group;
        float sum = 0.0f;
        for (int i = threadIdx.x; i < group; i += NORM_THREADS) sum += in[i] * in[i];
        float inverse = rsqrtf(block_sum(sum) / (float)group + eps);
        for (int i = threadIdx.x; i < group; i += NORM_THREADS) {
            long long at = g * group + i;
            out[at] = in[i] * inverse * w[i] * silu_f(gate[at]);
        }
    }
}
