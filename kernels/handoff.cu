// The hand-off of a MoE layer's routed experts to the CPU expert workers, driven by the GPU:
// no host thread takes part per layer.
//
// Each worker's activation channel is a shared-memory segment the engine registered with CUDA,
// so the device reads and writes it over the bus (services/lib/channel says the layout and the
// protocol). `worker_words` holds, per worker, the device addresses of the words the kernels
// touch (HANDOFF_WORDS of them, in the order of the HANDOFF_* indices below).
//
// handoff_post (one block): writes every worker's request — the expert ids it owns that are not
// resident on the GPU (the others NO_EXPERT), the routing weights and, for a worker with work,
// the hidden rows — then fences system-wide and publishes each request by storing its sequence
// (the worker's last answer + 1), exactly as the host side of the channel does. Which workers got
// a request, and their sequences, go to `posted` in device memory for handoff_collect.
//
// handoff_collect (one block per row): waits for every posted worker's answer (polling its
// response sequence, and the segment's abort word, which the engine's host sets when no worker
// came back in time), then sums the workers' outputs in worker order starting from 0.0f — the
// additions the host side makes — so the result has the host path's bits. A refused or
// abandoned request leaves zeros and a non-zero `failure` word the host reads after the step:
// the reason in its low byte, the worker in the next, the layer in the high half.
//
// mapped_copy (a few blocks, on the expert cache's copy stream): copies a page-locked bank's
// expert into its GPU slot by reading the mapped bank, instead of a DMA copy. A DMA copy keeps
// so many reads in flight on the bus that the hand-off's own reads queue behind them; a few
// blocks keep a few kilobytes in flight (a paced fill, `--moe-cache-fill-copy-blocks`).

#include "common.cuh"

#define HANDOFF_MAX_WORKERS 8
#define HANDOFF_WORDS 11
#define HANDOFF_POST_THREADS 1024
#define HANDOFF_COLLECT_THREADS 256
#define HANDOFF_REQUEST_SEQUENCE 0
#define HANDOFF_RESPONSE_SEQUENCE 1
#define HANDOFF_LAYER 2
#define HANDOFF_TOKEN_COUNT 3
#define HANDOFF_TOP_K 4
#define HANDOFF_STATUS 5
#define HANDOFF_EXPERT_IDS 6
#define HANDOFF_ROUTING_WEIGHTS 7
#define HANDOFF_HIDDEN 8
#define HANDOFF_OUTPUT 9
#define HANDOFF_ABORT 10
#define HANDOFF_NO_EXPERT 0xffffffffu
#define HANDOFF_REFUSED 1
#define HANDOFF_ABANDONED 2

__device__ __forceinline__ volatile unsigned int* handoff_word(const unsigned long long* words,
                                                               int worker, int which) {
    return (volatile unsigned int*)words[worker * HANDOFF_WORDS + which];
}

extern "C" __global__ void handoff_post(const unsigned int* expert_ids, const float* weights,
                                        const float* hidden, const int* slot_of_expert,
                                        const int* owner_of_expert,
                                        const unsigned long long* worker_words, int workers,
                                        unsigned int* posted, int tokens, int top_k,
                                        int hidden_width, int layer, int num_experts) {
    PDL_WAIT_AND_RELEASE();
    __shared__ int has_work[HANDOFF_MAX_WORKERS];
    if (threadIdx.x < HANDOFF_MAX_WORKERS) has_work[threadIdx.x] = 0;
    __syncthreads();
    const int entries = tokens * top_k;
    for (int entry = threadIdx.x; entry < entries; entry += blockDim.x) {
        unsigned int expert = expert_ids[entry];
        float weight = weights[entry];
        bool known = expert < (unsigned int)num_experts;
        bool resident = known && slot_of_expert != nullptr && slot_of_expert[expert] >= 0;
        int owner = (known && !resident) ? owner_of_expert[expert] : -1;
        for (int worker = 0; worker < workers; ++worker) {
            volatile unsigned int* ids =
                (volatile unsigned int*)worker_words[worker * HANDOFF_WORDS + HANDOFF_EXPERT_IDS];
            volatile float* routing_weights =
                (volatile float*)worker_words[worker * HANDOFF_WORDS + HANDOFF_ROUTING_WEIGHTS];
            ids[entry] = owner == worker ? expert : HANDOFF_NO_EXPERT;
            routing_weights[entry] = weight;
        }
        if (owner >= 0 && owner < workers) has_work[owner] = 1;  // every writer writes 1
    }
    __syncthreads();
    const int values = tokens * hidden_width;
    for (int worker = 0; worker < workers; ++worker) {
        if (!has_work[worker]) continue;
        float* to = (float*)worker_words[worker * HANDOFF_WORDS + HANDOFF_HIDDEN];
        bool aligned = ((values & 3) == 0) && (((unsigned long long)to & 15) == 0) &&
                       (((unsigned long long)hidden & 15) == 0);
        if (aligned) {
            const float4* from4 = (const float4*)hidden;
            float4* to4 = (float4*)to;
            for (int i = threadIdx.x; i < values / 4; i += blockDim.x) to4[i] = from4[i];
        } else {
            for (int i = threadIdx.x; i < values; i += blockDim.x) to[i] = hidden[i];
        }
    }
    // Every thread's stores reach the host before the publication below.
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int worker = 0; worker < workers; ++worker) {
        if (!has_work[worker]) {
            posted[2 * worker] = 0;
            continue;
        }
        *handoff_word(worker_words, worker, HANDOFF_LAYER) = (unsigned int)layer;
        *handoff_word(worker_words, worker, HANDOFF_TOKEN_COUNT) = (unsigned int)tokens;
        *handoff_word(worker_words, worker, HANDOFF_TOP_K) = (unsigned int)top_k;
        __threadfence_system();
        unsigned int sequence = *handoff_word(worker_words, worker, HANDOFF_RESPONSE_SEQUENCE) + 1u;
        *handoff_word(worker_words, worker, HANDOFF_REQUEST_SEQUENCE) = sequence;
        posted[2 * worker] = 1;
        posted[2 * worker + 1] = sequence;
    }
    __threadfence_system();
}

// `wide`: the answers' reads below with every piece of a thread in flight (1), or one value
// per worker and round trip (0); the same bits.
extern "C" __global__ void handoff_collect(const unsigned long long* worker_words, int workers,
                                           const unsigned int* posted, int hidden_width,
                                           float* out, unsigned int* failure, int wide_reads) {
    PDL_WAIT_AND_RELEASE();
    __shared__ int outcome;
    const long long row = blockIdx.x;
    if (threadIdx.x == 0) {
        int result = 0;
        for (int worker = 0; worker < workers && result == 0; ++worker) {
            if (!posted[2 * worker]) continue;
            unsigned int wanted = posted[2 * worker + 1];
            volatile unsigned int* response =
                handoff_word(worker_words, worker, HANDOFF_RESPONSE_SEQUENCE);
            volatile unsigned int* abort = handoff_word(worker_words, worker, HANDOFF_ABORT);
            // Worker and layer ride along in the failure word, for the host's message.
            int where = (worker << 8) | ((int)(*handoff_word(worker_words, worker, HANDOFF_LAYER) & 0xffff) << 16);
            while (*response != wanted) {
                if (*abort != 0) {
                    result = HANDOFF_ABANDONED | where;
                    break;
                }
                __nanosleep(256);
            }
            if (result == 0 && *handoff_word(worker_words, worker, HANDOFF_STATUS) != 0) {
                result = HANDOFF_REFUSED | where;
            }
        }
        // The answer's bytes are read after its sequence was seen.
        __threadfence_system();
        outcome = result;
        if (result != 0) atomicCAS(failure, 0u, (unsigned int)result);
    }
    __syncthreads();
    // Each read of the answers is a round trip over the bus: a thread has every worker's piece
    // in flight at once (16-byte loads, fetched again past any cache), then sums them in
    // worker order from 0.0f, the additions of the loop below.
    bool wide = wide_reads && (hidden_width & 3) == 0 && ((unsigned long long)out & 15) == 0;
    for (int worker = 0; worker < workers; ++worker)
        if (posted[2 * worker] && (worker_words[worker * HANDOFF_WORDS + HANDOFF_OUTPUT] & 15) != 0)
            wide = false;
    if (wide && workers <= HANDOFF_MAX_WORKERS) {
        const int pieces = hidden_width / 4;
        for (int piece = threadIdx.x; piece < pieces; piece += blockDim.x) {
            float4 got[HANDOFF_MAX_WORKERS];
#pragma unroll
            for (int worker = 0; worker < HANDOFF_MAX_WORKERS; ++worker) {
                if (outcome == 0 && worker < workers && posted[2 * worker]) {
                    const float4* sums =
                        (const float4*)worker_words[worker * HANDOFF_WORDS + HANDOFF_OUTPUT];
                    got[worker] = __ldcv(sums + row * pieces + piece);
                }
            }
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int worker = 0; worker < HANDOFF_MAX_WORKERS; ++worker) {
                if (outcome == 0 && worker < workers && posted[2 * worker]) {
                    sum.x += got[worker].x;
                    sum.y += got[worker].y;
                    sum.z += got[worker].z;
                    sum.w += got[worker].w;
                }
            }
            ((float4*)out)[row * pieces + piece] = sum;
        }
        return;
    }
    for (int i = threadIdx.x; i < hidden_width; i += blockDim.x) {
        float sum = 0.0f;
        if (outcome == 0) {
            for (int worker = 0; worker < workers; ++worker) {
                if (!posted[2 * worker]) continue;
                volatile const float* sums =
                    (volatile const float*)worker_words[worker * HANDOFF_WORDS + HANDOFF_OUTPUT];
                sum += sums[row * hidden_width + i];
            }
        }
        out[row * hidden_width + i] = sum;
    }
}

// grid (blocks), 256 threads: `pieces` 16-byte pieces from `from` (mapped host memory) to `to`.
extern "C" __global__ void mapped_copy(const uint4* from, uint4* to, long long pieces) {
    PDL_WAIT_AND_RELEASE();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pieces;
         i += (long long)gridDim.x * blockDim.x)
        to[i] = __ldcv(from + i);
}
