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
// One warp per token (ROUTER_WARPS tokens per block); lane l owns the experts e ≡ l (mod 32),
// held in registers (experts ≤ ROUTER_MAX_EXPERTS, `per_lane` = ceil(experts / 32) rounded up to
// a compiled width), so no step but the reductions crosses lanes.
//
// Top-k: each lane keeps its best remaining expert (larger probability, ties → lower id); a
// round is one warp-wide max of the lanes' candidates (`redux.sync` on the probability's bits:
// probabilities are ≥ 0, where the bits order as the values do), then the lowest id among the
// lanes holding that value (a second `redux.sync`), and only the winning lane looks for its next
// candidate. The same total order as k rounds of a shuffle argmax, in a few instructions a round.
//
// The softmax denominator is summed by the fixed tree of a ROUTER_TREE_WIDTH-thread block
// (position t sums e = t, t + W, … in order, then pairs t and t + s for s = W/2 … 1), kept
// lane-wise in registers and shuffles: the same additions as the one-block-per-token kernel this
// replaced, so the routing weights keep their bits.

#include "common.cuh"
#include "matmul_common.cuh"
#include "norm_common.cuh"

#define ROUTER_WARPS 4
#define ROUTER_TREE_WIDTH 256
#define ROUTER_MAX_EXPERTS 1024
#define ROUTER_MAX_TOP_K 32
#define NEGATIVE_INFINITY __int_as_float(0xff800000)

// The lane's best expert not taken yet among its `P` (larger probability, ties → lower id,
// i.e. lower i), as (probability bits, i); i = -1 when none is left.
template <int P>
__device__ __forceinline__ void lane_candidate(const float (&probability)[P], unsigned int taken,
                                               int lane, int experts, unsigned int& key, int& at) {
    key = 0u;
    at = -1;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        unsigned int bits = __float_as_uint(probability[i]);
        bool open = lane + 32 * i < experts && !((taken >> i) & 1u);
        if (open && (at < 0 || bits > key)) {
            key = bits;
            at = i;
        }
    }
}

__device__ __forceinline__ unsigned int warp_reduce_max_u32(unsigned int v) {
    unsigned int r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ unsigned int warp_reduce_min_u32(unsigned int v) {
    unsigned int r;
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}

// One token's routing by one warp, experts ≤ 32·P.
template <int P>
__device__ __forceinline__ void route_token(const float* row, unsigned int* expert_ids,
                                            float* weights, long long token, int experts, int k,
                                            int normalize, unsigned int* mapped_ids,
                                            float* mapped_weights, float* chosen_probability,
                                            int lane) {
    const int slots = ROUTER_TREE_WIDTH / 32;  // tree positions per lane
    float probability[P];
    float local_max = NEGATIVE_INFINITY;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        int e = lane + 32 * i;
        probability[i] = e < experts ? row[e] : 0.0f;
        if (e < experts) local_max = fmaxf(local_max, probability[i]);
    }
    float row_max = warp_max(local_max);

    // Σ exp, tree position t = lane + 32·m held in tree[m]: experts lane + 32·(m + slots·j).
    float tree[slots];
#pragma unroll
    for (int m = 0; m < slots; ++m) tree[m] = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        if (lane + 32 * i < experts) {
            float v = expf(probability[i] - row_max);
            probability[i] = v;
            tree[i % slots] += v;
        }
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
#pragma unroll
    for (int i = 0; i < P; ++i) probability[i] = probability[i] / total;
    // k > experts: the rounds past the last expert take expert 0 again.
    float first = __shfl_sync(0xffffffffu, probability[0], 0);

    unsigned int taken = 0, key;
    int at;
    lane_candidate<P>(probability, taken, lane, experts, key, at);
    for (int round = 0; round < k; ++round) {
        unsigned int top = warp_reduce_max_u32(at < 0 ? 0u : key);
        bool holds = at >= 0 && key == top;
        unsigned int chosen = warp_reduce_min_u32(holds ? (unsigned int)(lane + 32 * at) : 0xffffffffu);
        float chosen_value = __uint_as_float(top);
        if (chosen == 0xffffffffu) {
            chosen = 0;
            chosen_value = first;
        } else if (chosen % 32 == (unsigned int)lane) {
            taken |= 1u << at;
            lane_candidate<P>(probability, taken, lane, experts, key, at);
        }
        if (lane == 0) {
            expert_ids[token * k + round] = chosen;
            if (mapped_ids) mapped_ids[token * k + round] = chosen;
            chosen_probability[round] = chosen_value;
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

// One token's routing from its logits `row` (experts ≤ ROUTER_MAX_EXPERTS) by one warp, at the
// narrowest compiled width that holds the row.
__device__ __forceinline__ void route_row(const float* row, unsigned int* expert_ids,
                                          float* weights, long long token, int experts, int k,
                                          int normalize, unsigned int* mapped_ids,
                                          float* mapped_weights, float* chosen_probability,
                                          int lane) {
    if (experts <= 128)
        route_token<4>(row, expert_ids, weights, token, experts, k, normalize, mapped_ids,
                       mapped_weights, chosen_probability, lane);
    else if (experts <= 256)
        route_token<8>(row, expert_ids, weights, token, experts, k, normalize, mapped_ids,
                       mapped_weights, chosen_probability, lane);
    else if (experts <= 512)
        route_token<16>(row, expert_ids, weights, token, experts, k, normalize, mapped_ids,
                        mapped_weights, chosen_probability, lane);
    else
        route_token<ROUTER_MAX_EXPERTS / 32>(row, expert_ids, weights, token, experts, k,
                                             normalize, mapped_ids, mapped_weights,
                                             chosen_probability, lane);
}

extern "C" __global__ void route_top_k(const float* logits, unsigned int* expert_ids, float* weights,
                                       int tokens, int experts, int k, int normalize,
                                       unsigned int* mapped_ids, float* mapped_weights,
                                       const float* hidden, float* mapped_hidden,
                                       int hidden_width) {
    PDL_WAIT_AND_RELEASE();
    __shared__ float chosen_probability_of[ROUTER_WARPS][ROUTER_MAX_TOP_K];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long token = (long long)blockIdx.x * ROUTER_WARPS + warp;
    if (token >= tokens) return;  // whole warps leave together
    float* chosen_probability = chosen_probability_of[warp];
    const float* row = logits + token * experts;
    if (mapped_hidden) {
        const float* from = hidden + token * hidden_width;
        float* to = mapped_hidden + token * hidden_width;
        for (int i = lane; i < hidden_width; i += 32) to[i] = from[i];
    }
    route_row(row, expert_ids, weights, token, experts, k, normalize, mapped_ids, mapped_weights,
              chosen_probability, lane);
}

// The last block out routes every block's logits (read from L2, never from this
// multiprocessor's L1) with `route_row`, then sets the ticket counter back to 0.
__device__ __forceinline__ void route_every_blocks_logits(
    const float* logits, unsigned int* counter, unsigned int* expert_ids, float* weights,
    int experts, int k, int normalize, unsigned int* mapped_ids, float* mapped_weights) {
    __shared__ float row[ROUTER_MAX_EXPERTS];
    __shared__ float chosen_probability[ROUTER_MAX_TOP_K];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) row[e] = __ldcg(logits + e);
    __syncthreads();
    if (threadIdx.x >= 32) return;
    int lane = threadIdx.x % 32;
    route_row(row, expert_ids, weights, 0, experts, k, normalize, mapped_ids, mapped_weights,
              chosen_probability, lane);
    if (lane == 0) *counter = 0u;
}

// Decode of one token: the router's f32 logits and their routing in one launch, instead of
// `matmul` then `route_top_k` (two launches and a round trip of the logits between them, ~8 µs
// at Qwen3-30B-A3B's shapes for 1 MB of weights). Each warp computes one logit with `matmul`'s
// warp body (matmul_common.cuh: the same sum in the same order, so the same bits) and stores it
// in `logits`; the last block out (a ticket on `counter`, 0 at the start and set back to 0 by
// that block) reads them all from L2 and routes them as `route_top_k` does (`route_row`: the same
// bits). The hidden row goes to `mapped_hidden` (when not null) from every block's threads.
//
// Grid: ceil(experts / ROUTER_FUSED_WARPS) blocks of 32 · ROUTER_FUSED_WARPS threads; `prefetch`
// (0 or 1) asks L2 for each warp's router row before the PDL wait.
#define ROUTER_FUSED_WARPS 4
extern "C" __global__ void route_decode_fused(const float* x, const float* router, float* logits,
                                              unsigned int* counter, unsigned int* expert_ids,
                                              float* weights, int hidden, int experts, int k,
                                              int normalize, unsigned int* mapped_ids,
                                              float* mapped_weights, float* mapped_hidden,
                                              int prefetch) {
    PDL_L2_PREFETCH(prefetch, prefetch_feature_group(router, 1, hidden, experts, 1, warp_task()));
    PDL_WAIT_AND_RELEASE();
    int lane = threadIdx.x % 32;
    long long expert = warp_task();
    if (expert < experts)
        matmul_output<float, 1, 1>(PlainRows{x, hidden}, router, logits, 1, hidden, experts,
                                   (int)expert, 0, lane);
    if (mapped_hidden) {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hidden; i += gridDim.x * blockDim.x)
            mapped_hidden[i] = x[i];
    }
    if (!last_block_out(counter)) return;
    route_every_blocks_logits(logits, counter, expert_ids, weights, experts, k, normalize,
                              mapped_ids, mapped_weights);
}

// `route_decode_fused` with the residual add and RMSNorm before it in the same launch (decode
// of one token, the MoE layer right after attention): residual += delta, normed = the norm of it
// as `add_rms_norm` computes it, then the router's logits of `normed` and their routing, instead
// of `add_rms_norm` then `route_decode_fused`. Every block forms the whole normed row itself in
// shared memory, with `add_rms_norm`'s threads and tree (NORM_THREADS threads, each holding the
// values t + j · NORM_THREADS; `block_sum`), so every block has the norm's bits; its warps then
// compute logits with the matmul warp body over that row. Each block stores its slice of the
// normed row to `normed` (and `mapped_hidden`); the last block out, once every block has read
// the residual, stores residual + delta back and routes the logits.
//
// Grid: ceil(experts / (NORM_THREADS / 32)) blocks of NORM_THREADS threads; dynamic shared
// memory hidden floats; hidden ≤ NORM_THREADS · NORM_CACHED (the values stay in registers).
extern "C" __global__ void route_decode_add_norm_fused(
    float* residual, const float* delta, const float* norm_weight, float eps, float offset,
    float* normed, const float* router, float* logits, unsigned int* counter,
    unsigned int* expert_ids, float* weights, int hidden, int experts, int k, int normalize,
    unsigned int* mapped_ids, float* mapped_weights, float* mapped_hidden, int prefetch) {
    PDL_L2_PREFETCH(prefetch, prefetch_feature_group(router, 1, hidden, experts, 1, warp_task()));
    PDL_WAIT_AND_RELEASE();
    extern __shared__ __align__(16) float normed_row[];
    int lane = threadIdx.x % 32;
    float cached[NORM_CACHED];
    form_normed_row(residual, delta, norm_weight, eps, offset, hidden, cached, normed_row);
    for (int i = blockIdx.x * NORM_THREADS + threadIdx.x; i < hidden;
         i += gridDim.x * NORM_THREADS) {
        normed[i] = normed_row[i];
        if (mapped_hidden) mapped_hidden[i] = normed_row[i];
    }
    long long expert = warp_task();
    if (expert < experts)
        matmul_output<float, 1, 1>(PlainRows{normed_row, hidden}, router, logits, 1, hidden,
                                   experts, (int)expert, 0, lane);
    // Past the ticket every block has stored its logits and read the residual.
    if (!last_block_out(counter)) return;
    store_cached_sum(residual, hidden, cached);
    route_every_blocks_logits(logits, counter, expert_ids, weights, experts, k, normalize,
                              mapped_ids, mapped_weights);
}
