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
// One block per token; the row lives in shared memory (experts ≤ ROUTER_MAX_EXPERTS). Top-k is k
// rounds of a block-wide argmax over the experts not taken yet.

#define ROUTER_THREADS 256
#define ROUTER_MAX_EXPERTS 1024
#define NEGATIVE_INFINITY __int_as_float(0xff800000)

// Block-wide reduction of (value, index): larger value wins, ties → lower index.
__device__ __forceinline__ void better(float& value, int& index, float other_value, int other_index) {
    if (other_index < 0) return;
    if (index < 0 || other_value > value || (other_value == value && other_index < index)) {
        value = other_value;
        index = other_index;
    }
}

extern "C" __global__ void route_top_k(const float* logits, unsigned int* expert_ids, float* weights,
                                       int experts, int k, int normalize,
                                       unsigned int* mapped_ids, float* mapped_weights,
                                       const float* hidden, float* mapped_hidden,
                                       int hidden_width) {
    __shared__ float probabilities[ROUTER_MAX_EXPERTS];
    __shared__ unsigned char taken[ROUTER_MAX_EXPERTS];
    __shared__ float reduce_value[ROUTER_THREADS];
    __shared__ int reduce_index[ROUTER_THREADS];
    __shared__ float chosen_probability[32];
    const float* row = logits + (long long)blockIdx.x * experts;
    int tid = threadIdx.x;
    if (mapped_hidden) {
        const float* from = hidden + (long long)blockIdx.x * hidden_width;
        float* to = mapped_hidden + (long long)blockIdx.x * hidden_width;
        for (int i = tid; i < hidden_width; i += blockDim.x) to[i] = from[i];
    }

    // max
    float local_max = NEGATIVE_INFINITY;
    for (int e = tid; e < experts; e += blockDim.x) {
        float v = row[e];
        probabilities[e] = v;
        taken[e] = 0;
        local_max = fmaxf(local_max, v);
    }
    reduce_value[tid] = local_max;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) reduce_value[tid] = fmaxf(reduce_value[tid], reduce_value[tid + stride]);
        __syncthreads();
    }
    float row_max = reduce_value[0];
    __syncthreads();

    // Σ exp
    float local_sum = 0.0f;
    for (int e = tid; e < experts; e += blockDim.x) {
        float v = expf(probabilities[e] - row_max);
        probabilities[e] = v;
        local_sum += v;
    }
    reduce_value[tid] = local_sum;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) reduce_value[tid] += reduce_value[tid + stride];
        __syncthreads();
    }
    float total = reduce_value[0];
    __syncthreads();
    for (int e = tid; e < experts; e += blockDim.x) probabilities[e] = probabilities[e] / total;
    __syncthreads();

    // k rounds of argmax over the experts not taken yet.
    for (int round = 0; round < k; ++round) {
        float best_value = NEGATIVE_INFINITY;
        int best_index = -1;
        for (int e = tid; e < experts; e += blockDim.x) {
            if (!taken[e]) better(best_value, best_index, probabilities[e], e);
        }
        reduce_value[tid] = best_value;
        reduce_index[tid] = best_index;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
            if (tid < stride) {
                float v = reduce_value[tid];
                int i = reduce_index[tid];
                better(v, i, reduce_value[tid + stride], reduce_index[tid + stride]);
                reduce_value[tid] = v;
                reduce_index[tid] = i;
            }
            __syncthreads();
        }
        if (tid == 0) {
            int chosen = reduce_index[0] < 0 ? 0 : reduce_index[0];
            taken[chosen] = 1;
            expert_ids[(long long)blockIdx.x * k + round] = (unsigned int)chosen;
            if (mapped_ids) mapped_ids[(long long)blockIdx.x * k + round] = (unsigned int)chosen;
            chosen_probability[round] = probabilities[chosen];
        }
        __syncthreads();
    }
    if (tid == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += chosen_probability[j];
        for (int j = 0; j < k; ++j) {
            float w = chosen_probability[j];
            float weight = (normalize && sum > 0.0f) ? w / sum : w;
            weights[(long long)blockIdx.x * k + j] = weight;
            if (mapped_weights) mapped_weights[(long long)blockIdx.x * k + j] = weight;
        }
    }
}
