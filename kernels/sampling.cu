// Logit candidates on the GPU: per row of logits [rows, cols], its k largest logits (ids and
// values), its max and log-sum-exp, and the logits of some asked-for ids — what sampling needs,
// instead of the whole row (151,936 floats for Qwen3) crossing PCIe every token.
//
// Order: larger first by the f32 total order (Rust's f32::total_cmp), lower id first among
// equal values — the order the host's sampling sorts by, so the host picks the same tokens.
//
// Two launches. `logit_candidates_partial`: one block per (chunk of a row, row); each thread
// holds up to SAMPLING_PER_THREAD values of the chunk in registers; k rounds of a block-wide
// "best after the last one taken" give the chunk's k best, sorted; the chunk's max and
// Σ exp(x − max) (f64, the host's logprobs sum in f64) come with them. `logit_candidates_merge`:
// one block per row, one thread per chunk; k rounds of a block-wide best over the chunks'
// heads merge the sorted lists; the chunks' sums are rescaled to the row max; the extra ids'
// logits are copied out.
//
// Output, u32 per element, per row (stride 2k + 2): k ids, k value bit patterns, max, lse;
// after all rows the extra logits (bit patterns) at `extra_offsets[row]`. An id of 0xffffffff
// marks no value (a row shorter than k).

#include "common.cuh"

#define SAMPLING_THREADS 256
#define SAMPLING_PER_THREAD 16
#define SAMPLING_MAX_K 256
#define SAMPLING_NONE 0xffffffffu
#define NEGATIVE_INFINITY __int_as_float(0xff800000)

// The f32 total order as an int (larger int = later in f32::total_cmp).
__device__ __forceinline__ int total_order_key(float x) {
    int bits = __float_as_int(x);
    return bits ^ (int)(((unsigned int)(bits >> 31)) >> 1);
}

// True when (key_a, id_a) comes before (key_b, id_b): larger key first, lower id on ties.
// id < 0 is "nothing" and comes after everything.
__device__ __forceinline__ bool comes_before(int key_a, int id_a, int key_b, int id_b) {
    if (id_a < 0) return false;
    if (id_b < 0) return true;
    return key_a > key_b || (key_a == key_b && id_a < id_b);
}

// Block-wide best (key, id, owner) by `comes_before`; every thread gets the result.
// `owner` says which thread holds it (the merge advances that chunk's head).
__device__ void block_best(int& key, int& id, int& owner, int* shared_key, int* shared_id,
                           int* shared_owner) {
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) {
        int other_key = __shfl_down_sync(0xffffffffu, key, offset);
        int other_id = __shfl_down_sync(0xffffffffu, id, offset);
        int other_owner = __shfl_down_sync(0xffffffffu, owner, offset);
        if (comes_before(other_key, other_id, key, id)) {
            key = other_key;
            id = other_id;
            owner = other_owner;
        }
    }
    if (lane == 0) {
        shared_key[warp] = key;
        shared_id[warp] = id;
        shared_owner[warp] = owner;
    }
    __syncthreads();
    if (warp == 0) {
        int warps = (blockDim.x + 31) >> 5;
        key = lane < warps ? shared_key[lane] : 0;
        id = lane < warps ? shared_id[lane] : -1;
        owner = lane < warps ? shared_owner[lane] : -1;
        for (int offset = 16; offset > 0; offset >>= 1) {
            int other_key = __shfl_down_sync(0xffffffffu, key, offset);
            int other_id = __shfl_down_sync(0xffffffffu, id, offset);
            int other_owner = __shfl_down_sync(0xffffffffu, owner, offset);
            if (comes_before(other_key, other_id, key, id)) {
                key = other_key;
                id = other_id;
                owner = other_owner;
            }
        }
        if (lane == 0) {
            shared_key[32] = key;
            shared_id[32] = id;
            shared_owner[32] = owner;
        }
    }
    __syncthreads();
    key = shared_key[32];
    id = shared_id[32];
    owner = shared_owner[32];
    __syncthreads();
}

// grid (chunks, rows), block SAMPLING_THREADS; chunk_len ≤ SAMPLING_THREADS·SAMPLING_PER_THREAD.
// part_ids/part_values: [rows, chunks, k]; part_max/part_sum: [rows, chunks].
extern "C" __global__ void logit_candidates_partial(const float* logits, int cols, int chunk_len,
                                                    int k, unsigned int* part_ids,
                                                    float* part_values, float* part_max,
                                                    double* part_sum) {
    PDL_WAIT_AND_RELEASE();
    __shared__ int shared_key[33];
    __shared__ int shared_id[33];
    __shared__ int shared_owner[33];
    __shared__ float shared_float[32];
    __shared__ double shared_double[32];
    int chunk = blockIdx.x;
    int chunks = gridDim.x;
    int row = blockIdx.y;
    int tid = threadIdx.x;
    int lane = tid & 31;
    int warp = tid >> 5;
    int warps = (blockDim.x + 31) >> 5;
    const float* values = logits + (long long)row * cols;
    int start = chunk * chunk_len;
    int end = min(start + chunk_len, cols);

    float value[SAMPLING_PER_THREAD];
    int key[SAMPLING_PER_THREAD];
    float local_max = NEGATIVE_INFINITY;
#pragma unroll
    for (int j = 0; j < SAMPLING_PER_THREAD; ++j) {
        int e = start + tid + j * SAMPLING_THREADS;
        value[j] = e < end ? values[e] : NEGATIVE_INFINITY;
        key[j] = total_order_key(value[j]);
        if (e < end) local_max = fmaxf(local_max, value[j]);
    }
    // max (NaN ignored, like the host's fold of f32::max)
    for (int offset = 16; offset > 0; offset >>= 1)
        local_max = fmaxf(local_max, __shfl_down_sync(0xffffffffu, local_max, offset));
    if (lane == 0) shared_float[warp] = local_max;
    __syncthreads();
    float chunk_max = NEGATIVE_INFINITY;
    for (int w = 0; w < warps; ++w) chunk_max = fmaxf(chunk_max, shared_float[w]);
    // Σ exp(x − max) in f64
    double local_sum = 0.0;
    if (chunk_max != NEGATIVE_INFINITY) {
#pragma unroll
        for (int j = 0; j < SAMPLING_PER_THREAD; ++j) {
            int e = start + tid + j * SAMPLING_THREADS;
            if (e < end) local_sum += exp((double)(value[j] - chunk_max));
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1)
        local_sum += __shfl_down_sync(0xffffffffu, local_sum, offset);
    if (lane == 0) shared_double[warp] = local_sum;
    __syncthreads();
    if (tid == 0) {
        double sum = 0.0;
        for (int w = 0; w < warps; ++w) sum += shared_double[w];
        part_max[row * chunks + chunk] = chunk_max;
        part_sum[row * chunks + chunk] = sum;
    }

    // k rounds: the best value after the last one taken.
    int last_key = 0, last_id = -1;
    long long out = ((long long)row * chunks + chunk) * k;
    for (int round = 0; round < k; ++round) {
        int best_key = 0, best_id = -1;
#pragma unroll
        for (int j = 0; j < SAMPLING_PER_THREAD; ++j) {
            int e = start + tid + j * SAMPLING_THREADS;
            if (e < end && (last_id < 0 || comes_before(last_key, last_id, key[j], e)) &&
                comes_before(key[j], e, best_key, best_id)) {
                best_key = key[j];
                best_id = e;
            }
        }
        int owner = tid;
        block_best(best_key, best_id, owner, shared_key, shared_id, shared_owner);
        if (best_id < 0) {
            for (int r = round + tid; r < k; r += blockDim.x) {
                part_ids[out + r] = SAMPLING_NONE;
                part_values[out + r] = NEGATIVE_INFINITY;
            }
            break;
        }
        if (tid == 0) {
            part_ids[out + round] = (unsigned int)best_id;
            part_values[out + round] = values[best_id];
        }
        last_key = best_key;
        last_id = best_id;
    }
}

// grid (rows), block SAMPLING_THREADS ≥ chunks. See the file comment for `out`.
extern "C" __global__ void logit_candidates_merge(const unsigned int* part_ids,
                                                  const float* part_values,
                                                  const float* part_max, const double* part_sum,
                                                  int chunks, int k, const float* logits, int cols,
                                                  const unsigned int* extra_ids,
                                                  const int* extra_offsets, int rows,
                                                  unsigned int* out) {
    PDL_WAIT_AND_RELEASE();
    __shared__ int shared_key[33];
    __shared__ int shared_id[33];
    __shared__ int shared_owner[33];
    int row = blockIdx.x;
    int tid = threadIdx.x;
    long long stride = 2LL * k + 2;
    unsigned int* row_out = out + row * stride;

    // The row's max and log-sum-exp from the chunks'.
    if (tid == 0) {
        float row_max = NEGATIVE_INFINITY;
        for (int c = 0; c < chunks; ++c) row_max = fmaxf(row_max, part_max[row * chunks + c]);
        double sum = 0.0;
        for (int c = 0; c < chunks; ++c) {
            float chunk_max = part_max[row * chunks + c];
            if (chunk_max != NEGATIVE_INFINITY)
                sum += part_sum[row * chunks + c] * exp((double)(chunk_max - row_max));
        }
        row_out[2 * k] = __float_as_uint(row_max);
        row_out[2 * k + 1] = __float_as_uint((float)log(sum) + row_max);
    }

    // The extra ids' logits.
    int first = extra_offsets[row];
    int count = extra_offsets[row + 1] - first;
    unsigned int* extra_out = out + rows * stride + first;
    for (int i = tid; i < count; i += blockDim.x) {
        unsigned int id = extra_ids[first + i];
        float v = id < (unsigned int)cols ? logits[(long long)row * cols + id]
                                          : __int_as_float(0x7fc00000);
        extra_out[i] = __float_as_uint(v);
    }

    // k-way merge of the chunks' sorted lists, one thread per chunk.
    int head = 0;
    long long base = ((long long)row * chunks + tid) * k;
    for (int round = 0; round < k; ++round) {
        int key = 0, id = -1;
        if (tid < chunks && head < k) {
            unsigned int candidate = part_ids[base + head];
            if (candidate != SAMPLING_NONE) {
                id = (int)candidate;
                key = total_order_key(part_values[base + head]);
            }
        }
        int owner = tid;
        block_best(key, id, owner, shared_key, shared_id, shared_owner);
        if (tid == 0) {
            row_out[round] = id < 0 ? SAMPLING_NONE : (unsigned int)id;
            row_out[k + round] = id < 0 ? __float_as_uint(NEGATIVE_INFINITY)
                                        : __float_as_uint(logits[(long long)row * cols + id]);
        }
        if (id >= 0 && tid == owner) ++head;
    }
}
