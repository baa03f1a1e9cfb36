// MoE router on the GPU: softmax over each token's expert logits (fp32), top-k (ties → lower
// expert id, as on the CPU backend), optional renormalisation of the chosen k. Only the k ids
// and weights per token go back to the host (the expert executor needs them there), instead of
// the whole [tokens, experts] logits.
//
// The host copy is written by this kernel itself when `mapped_ids` is not null: page-locked host
// memory mapped into the device's address space, stored to directly (a few bytes per token, and
// the token's hidden row when `mapped_hidden` is not null). A decode step then has no copy
// between the router and the experts that follow it: a device-to-host copy on the stream costs
// several microseconds per MoE layer, a store over the bus nothing the stream waits for.
//
// One warp per token (ROUTER_WARPS tokens per block); the row lives in shared memory (experts ≤
// ROUTER_MAX_EXPERTS) and lane l owns the experts e ≡ l (mod 32), so no step but the
// reductions crosses lanes. Top-k is k rounds of a warp-wide argmax over the experts not taken
// yet (a total order, so the winner does not depend on the reduction's shape).
//
// The softmax denominator is summed by the fixed tree of a ROUTER_TREE_WIDTH-thread block
// (position t sums e = t, t + W, … in order, then pairs t and t + s for s = W/2 … 1), kept
// lane-wise in registers and shuffles: the same additions as the one-block-per-token kernel this
// replaced, so the routing weights keep their bits.

#include "common.cuh"

#define ROUTER_WARPS 4
#define ROUTER_TREE_WIDTH 256
#define ROUTER_MAX_EXPERTS 1024
#define ROUTER_MAX_TOP_K 32
#define NEGATIVE_INFINITY __int_as_float(0xff800000)

// (value, index) reduction: larger value wins, ties → lower index; index < 0 is "none".
__device__ __forceinline__ void better(float& value, int& index, float other_value, int other_index) {
    if (other_index < 0) return;
    if (index < 0 || other_value > value || (other_value == value && other_index < index)) {
        value = other_value;
        index = other_index;
    }
}

extern "C" __global__ void route_top_k(const float* logits, unsigned int* expert_ids, float* weights,
                                       int tokens, int experts, int k, int normalize,
                                       unsigned int* mapped_ids, float* mapped_weights,
                                       const float* hidden, float* mapped_hidden,
                                       int hidden_width) {
    PDL_WAIT_AND_RELEASE();
    __shared__ float probabilities_of[ROUTER_WARPS][ROUTER_MAX_EXPERTS];
    __shared__ float chosen_probability_of[ROUTER_WARPS][ROUTER_MAX_TOP_K];
    const int slots = ROUTER_TREE_WIDTH / 32;  // tree positions per lane
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long token = (long long)blockIdx.x * ROUTER_WARPS + warp;
    if (token >= tokens) return;  // whole warps leave together
    float* probabilities = probabilities_of[warp];
    float* chosen_probability = chosen_probability_of[warp];
    const float* row = logits + token * experts;
    if (mapped_hidden) {
        const float* from = hidden + token * hidden_width;
        float* to = mapped_hidden + token * hidden_width;
        for (int i = lane; i < hidden_width; i += 32) to[i] = from[i];
    }

    float local_max = NEGATIVE_INFINITY;
    for (int e = lane; e < experts; e += 32) {
        float v = row[e];
        probabilities[e] = v;
        local_max = fmaxf(local_max, v);
    }
    float row_max = warp_max(local_max);

    // Σ exp, tree position t = lane + 32·m held in tree[m].
    float tree[slots];
#pragma unroll
    for (int m = 0; m < slots; ++m) {
        float sum = 0.0f;
        for (int e = lane + 32 * m; e < experts; e += ROUTER_TREE_WIDTH) {
            float v = expf(probabilities[e] - row_max);
            probabilities[e] = v;
            sum += v;
        }
        tree[m] = sum;
    }
#pragma unroll
    for (int stride = slots / 2; stride > 0; stride >>= 1) {
#pragma unroll
        for (int m = 0; m < stride; ++m) tree[m] = tree[m] + tree[m + stride];
    }
    float partial = tree[0];
    for (int stride = 16; stride > 0; stride >>= 1)
        partial = partial + __shfl_down_sync(0xffffffffu, partial, stride);
    float total = __shfl_sync(0xffffffffu, partial, 0);
    for (int e = lane; e < experts; e += 32) probabilities[e] = probabilities[e] / total;

    // k rounds of argmax; lane l's taken experts l + 32·i as bit i.
    unsigned int taken = 0;
    for (int round = 0; round < k; ++round) {
        float best_value = NEGATIVE_INFINITY;
        int best_index = -1;
        for (int e = lane, i = 0; e < experts; e += 32, ++i) {
            if (!((taken >> i) & 1u)) better(best_value, best_index, probabilities[e], e);
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            float other_value = __shfl_xor_sync(0xffffffffu, best_value, offset);
            int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
            better(best_value, best_index, other_value, other_index);
        }
        int chosen = best_index < 0 ? 0 : best_index;
        if (chosen % 32 == lane) {
            taken |= 1u << (chosen / 32);
            expert_ids[token * k + round] = (unsigned int)chosen;
            if (mapped_ids) mapped_ids[token * k + round] = (unsigned int)chosen;
            chosen_probability[round] = probabilities[chosen];
        }
    }
    __syncwarp();
    if (lane == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += chosen_probability[j];
        for (int j = 0; j < k; ++j) {
            float w = chosen_probability[j];
            float weight = (normalize && sum > 0.0f) ? w / sum : w;
            weights[token * k + j] = weight;
            if (mapped_weights) mapped_weights[token * k + j] = weight;
        }
    }
}
