// QSA ("Qwen sparse attention", qwen4_exp) on the GPU: the append of a layer's keys, values and
// raw indexer keys to the sequences' caches, the pooling of completed indexer blocks, the
// per-query block selection and the attention over the selected tokens. The host reference is
// `model/qwen4_exp/qsa_selection.rs` and `backend/qsa_host.rs`; MODELS.md §5.5 has the math.
//
// Every launch takes a row table, QSA_ROW_WORDS 64-bit words per query row, built by the host
// per call: the row's cache buffers (keys, values: [max_tokens, kv_width] f32 or bf16; raw
// indexer keys: [max_tokens, Di] f32; pooled keys: [max_tokens / ratio, Di] f32), its position
// and its row in the batch tensors. A batch of sequences (decode or prefill) is one launch.

#include "common.cuh"

#define QSA_ROW_WORDS 6
#define QSA_KEYS 0
#define QSA_VALUES 1
#define QSA_RAW 2
#define QSA_POOLED 3
#define QSA_POSITION 4
#define QSA_BATCH_ROW 5

// Threads of a pooling block; the widest indexer head it takes.
#define QSA_POOL_THREADS 128
#define QSA_MAX_INDEX_DIM 256
// Threads of a selection block (one block per query row).
#define QSA_SELECT_THREADS 256
// (value, index) pairs the tie-break may keep in dynamic shared memory (44 KiB: with the
// kernel's static arrays, under the 48 KiB every GPU gives without opting in).
#define QSA_SHARED_PAIRS 5632
// Warps of an attention block (one block per (query row, head)); dims per lane.
#define QSA_ATTEND_WARPS 4
#define QSA_MAX_DIMS_PER_LANE 8
#define QSA_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float qsa_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float qsa_load(const unsigned short* p, long long i) {
    return bf16_bits_to_float(p[i]);
}
__device__ __forceinline__ void qsa_store(float* p, long long i, float x) { p[i] = x; }
__device__ __forceinline__ void qsa_store(unsigned short* p, long long i, float x) {
    p[i] = f32_to_bf16_bits(x);
}

// Each listed row's k and v ([*, kv_width] f32, batch row) into its cache at its position, and
// its raw indexer key (columns raw_start.. of index_qk, [*, index_cols]) into its raw keys. One
// thread per element, grid-stride.
template <typename KV>
__device__ void qsa_append_rows(const float* k, const float* v, const float* index_qk,
                                const unsigned long long* table, int rows, int kv_width,
                                int index_cols, int raw_start, int width) {
    long long per_row = (long long)kv_width + width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * per_row;
         i += (long long)blockDim.x * gridDim.x) {
        long long r = i / per_row;
        int c = (int)(i % per_row);
        const unsigned long long* entry = table + r * QSA_ROW_WORDS;
        long long position = (long long)entry[QSA_POSITION];
        long long batch_row = (long long)entry[QSA_BATCH_ROW];
        if (c < kv_width) {
            KV* keys = (KV*)entry[QSA_KEYS];
            KV* values = (KV*)entry[QSA_VALUES];
            qsa_store(keys, position * kv_width + c, k[batch_row * kv_width + c]);
            qsa_store(values, position * kv_width + c, v[batch_row * kv_width + c]);
        } else {
            int d = c - kv_width;
            float* raw = (float*)entry[QSA_RAW];
            raw[position * width + d] = index_qk[batch_row * index_cols + raw_start + d];
        }
    }
}

extern "C" __global__ void qsa_append(const float* k, const float* v, const float* index_qk,
                                      const unsigned long long* table, int rows, int kv_width,
                                      int index_cols, int raw_start, int width) {
    PDL_WAIT_AND_RELEASE();
    qsa_append_rows<float>(k, v, index_qk, table, rows, kv_width, index_cols, raw_start, width);
}

extern "C" __global__ void qsa_append_bf16(const float* k, const float* v, const float* index_qk,
                                           const unsigned long long* table, int rows,
                                           int kv_width, int index_cols, int raw_start,
                                           int width) {
    PDL_WAIT_AND_RELEASE();
    qsa_append_rows<unsigned short>(k, v, index_qk, table, rows, kv_width, index_cols, raw_start,
                                    width);
}

// One pooled key per job (jobs: [n, 3] words: raw keys, pooled keys, block index): the f32 mean
// of the block's `ratio` raw keys (summed in token order, then divided, as the host does),
// zero-centred RMSNorm with key_norm, RoPE of its first 2·half dims at the block's first
// position. One block of QSA_POOL_THREADS threads per job; width ≤ QSA_MAX_INDEX_DIM.
extern "C" __global__ void qsa_pool_blocks(const unsigned long long* jobs, int n_jobs,
                                           const float* key_norm, const float* inv_freq,
                                           int ratio, int width, int half, float eps) {
    PDL_WAIT_AND_RELEASE();
    __shared__ float pooled[QSA_MAX_INDEX_DIM];
    __shared__ float partial[QSA_POOL_THREADS / 32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int job = blockIdx.x; job < n_jobs; job += gridDim.x) {
        const float* raw = (const float*)jobs[job * 3 + 0];
        float* out = (float*)jobs[job * 3 + 1];
        long long block = (long long)jobs[job * 3 + 2];
        long long first = block * ratio;
        float square = 0.0f;
        for (int d = threadIdx.x; d < width; d += blockDim.x) {
            float sum = 0.0f;
            for (int t = 0; t < ratio; ++t) sum += raw[(first + t) * width + d];
            float mean = sum / (float)ratio;
            pooled[d] = mean;
            square += mean * mean;
        }
        square = warp_sum(square);
        if (lane == 0) partial[warp] = square;
        __syncthreads();
        float total = 0.0f;
        for (int w = 0; w < QSA_POOL_THREADS / 32; ++w) total += partial[w];
        float inverse = 1.0f / sqrtf(total / (float)width + eps);
        for (int d = threadIdx.x; d < width; d += blockDim.x) {
            pooled[d] = pooled[d] * inverse * (1.0f + key_norm[d]);
        }
        __syncthreads();
        float* key = out + block * width;
        for (int p = threadIdx.x; p < half; p += blockDim.x) {
            float angle = (float)first * inv_freq[p];
            float c = cosf(angle), s = sinf(angle);
            float a = pooled[p], b = pooled[p + half];
            key[p] = a * c - b * s;
            key[p + half] = b * c + a * s;
        }
        for (int d = 2 * half + threadIdx.x; d < width; d += blockDim.x) key[d] = pooled[d];
        __syncthreads();  // pooled and partial are reused by the next job
    }
}

// A float's bits mapped so that unsigned order is float order.
__device__ __forceinline__ unsigned int qsa_order_key(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// PyTorch's CPU topk tie resolution (libstdc++ partial_sort / nth_element over (value, index)
// pairs with a comparison that ignores the index), step for step as `torch_topk.rs`: run by one
// thread, only when tied scores straddle the k-th place.
struct QsaPair {
    float value;
    int index;
};

__device__ __forceinline__ bool qsa_greater(QsaPair a, QsaPair b) { return a.value > b.value; }

__device__ void qsa_adjust_heap(QsaPair* heap, long long hole, long long length, QsaPair value) {
    long long top = hole, second = hole;
    while (second < (length - 1) / 2) {
        second = 2 * (second + 1);
        if (qsa_greater(heap[second], heap[second - 1])) second -= 1;
        heap[hole] = heap[second];
        hole = second;
    }
    if ((length & 1) == 0 && second == (length - 2) / 2) {
        second = 2 * (second + 1);
        heap[hole] = heap[second - 1];
        hole = second - 1;
    }
    while (hole > top) {
        long long parent = (hole - 1) / 2;
        if (!qsa_greater(heap[parent], value)) break;
        heap[hole] = heap[parent];
        hole = parent;
    }
    heap[hole] = value;
}

__device__ void qsa_make_heap(QsaPair* heap, long long length) {
    if (length < 2) return;
    long long parent = (length - 2) / 2;
    for (;;) {
        QsaPair value = heap[parent];
        qsa_adjust_heap(heap, parent, length, value);
        if (parent == 0) return;
        parent -= 1;
    }
}

__device__ void qsa_heap_select(QsaPair* pairs, long long length, long long middle) {
    qsa_make_heap(pairs, middle);
    for (long long i = middle; i < length; ++i) {
        if (qsa_greater(pairs[i], pairs[0])) {
            QsaPair value = pairs[i];
            pairs[i] = pairs[0];
            qsa_adjust_heap(pairs, 0, middle, value);
        }
    }
}

__device__ void qsa_insertion_sort(QsaPair* pairs, long long length) {
    for (long long i = 1; i < length; ++i) {
        QsaPair value = pairs[i];
        if (qsa_greater(value, pairs[0])) {
            for (long long j = i; j > 0; --j) pairs[j] = pairs[j - 1];
            pairs[0] = value;
        } else {
            long long j = i;
            while (qsa_greater(value, pairs[j - 1])) {
                pairs[j] = pairs[j - 1];
                j -= 1;
            }
            pairs[j] = value;
        }
    }
}

__device__ __forceinline__ void qsa_swap(QsaPair* pairs, long long a, long long b) {
    QsaPair t = pairs[a];
    pairs[a] = pairs[b];
    pairs[b] = t;
}

__device__ void qsa_move_median_to_first(QsaPair* pairs, long long result, long long a,
                                         long long b, long long c) {
    long long chosen;
    if (qsa_greater(pairs[a], pairs[b])) {
        if (qsa_greater(pairs[b], pairs[c])) chosen = b;
        else if (qsa_greater(pairs[a], pairs[c])) chosen = c;
        else chosen = a;
    } else if (qsa_greater(pairs[a], pairs[c])) {
        chosen = a;
    } else if (qsa_greater(pairs[b], pairs[c])) {
        chosen = c;
    } else {
        chosen = b;
    }
    qsa_swap(pairs, result, chosen);
}

__device__ long long qsa_unguarded_partition(QsaPair* pairs, long long first, long long last,
                                             long long pivot) {
    for (;;) {
        while (qsa_greater(pairs[first], pairs[pivot])) first += 1;
        last -= 1;
        while (qsa_greater(pairs[pivot], pairs[last])) last -= 1;
        if (first >= last) return first;
        qsa_swap(pairs, first, last);
        first += 1;
    }
}

__device__ void qsa_nth_element(QsaPair* pairs, long long length, long long nth) {
    long long first = 0, last = length;
    if (first == last || nth == last) return;
    long long depth_limit = 2 * (63 - __clzll((unsigned long long)length));
    while (last - first > 3) {
        if (depth_limit == 0) {
            qsa_heap_select(pairs + first, last - first, nth + 1 - first);
            qsa_swap(pairs, first, nth);
            return;
        }
        depth_limit -= 1;
        long long middle = first + (last - first) / 2;
        qsa_move_median_to_first(pairs, first, first + 1, middle, last - 1);
        long long cut = qsa_unguarded_partition(pairs, first + 1, last, first);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    qsa_insertion_sort(pairs + first, last - first);
}

// Per listed row past the dense regime (complete blocks > top): the score of every complete
// block, Σ_heads relu(q_h · k̄_b) / √width, one warp per block. Grid (rows of this launch,
// splits): the blocks of a row are spread over `gridDim.y` CUDA blocks, so one decode row keeps
// the GPU busy; a score is the same bits whichever CUDA block computes it (one warp, fixed
// order). Row `first_row + blockIdx.x` of the table, scores at workspace[blockIdx.x · 3·stride].
extern "C" __global__ void qsa_score_blocks(const float* index_queries,
                                            const unsigned long long* table, int first_row,
                                            int rows, float* workspace, int stride, int heads,
                                            int width, int ratio, int top) {
    PDL_WAIT_AND_RELEASE();
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = QSA_SELECT_THREADS / 32;
    for (int i = blockIdx.x; i < rows; i += gridDim.x) {
        const unsigned long long* entry = table + (long long)(first_row + i) * QSA_ROW_WORDS;
        long long position = (long long)entry[QSA_POSITION];
        long long batch_row = (long long)entry[QSA_BATCH_ROW];
        const float* pooled = (const float*)entry[QSA_POOLED];
        long long blocks = (position + 1) / ratio;
        if (blocks <= top) continue;
        float* scores = workspace + (long long)i * 3 * stride;
        const float* q = index_queries + batch_row * heads * width;
        for (long long b = (long long)blockIdx.y * warps + warp; b < blocks;
             b += (long long)gridDim.y * warps) {
            float key[QSA_MAX_DIMS_PER_LANE];
#pragma unroll
            for (int j = 0; j < QSA_MAX_DIMS_PER_LANE; ++j) {
                int d = lane + 32 * j;
                key[j] = d < width ? pooled[b * width + d] : 0.0f;
            }
            float total = 0.0f;
            for (int h = 0; h < heads; ++h) {
                float dot = 0.0f;
#pragma unroll
                for (int j = 0; j < QSA_MAX_DIMS_PER_LANE; ++j) {
                    int d = lane + 32 * j;
                    if (d < width) dot += q[h * width + d] * key[j];
                }
                dot = warp_sum(dot);
                total += fmaxf(dot, 0.0f);
            }
            if (lane == 0) scores[b] = total / sqrtf((float)width);
        }
    }
}

// Per listed row past the dense regime, from the scores qsa_score_blocks wrote: the `top` best
// blocks, written ascending to selected[row · top ..]. The k-th largest score is found by a radix
// select over the scores' ordered bits (4 passes of 8 bits); every block above it is kept, and
// the ties at it, when all of them fit; when tied blocks straddle the k-th place, thread 0 picks
// them as PyTorch's topk does. Rows in the dense regime are skipped (the attention kernel takes
// every token). One CUDA block per row: row `first_row + i` of the table, its scores and pairs
// at workspace[i · 3·stride] (scores, then (value, index) pairs); stride ≥ the row's complete
// blocks, even. The tie-break replays the library's algorithm on one thread, whose every step
// waits on the memory it compares: in the dynamic shared memory (`shared_pairs` pairs of it)
// when the row's blocks fit, the global workspace only beyond.
extern "C" __global__ void qsa_select(const unsigned long long* table, int first_row, int rows,
                                      int* selected, float* workspace, int stride, int ratio,
                                      int top, int shared_pairs) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ QsaPair pairs_in_shared[];
    __shared__ unsigned int histogram[256];
    __shared__ unsigned int prefix, mask, remaining;
    __shared__ int warp_counts[QSA_SELECT_THREADS / 32];
    __shared__ int written;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = QSA_SELECT_THREADS / 32;
    for (int i = blockIdx.x; i < rows; i += gridDim.x) {
        int r = first_row + i;
        const unsigned long long* entry = table + (long long)r * QSA_ROW_WORDS;
        long long position = (long long)entry[QSA_POSITION];
        long long blocks = (position + 1) / ratio;
        if (blocks <= top) continue;  // uniform over the block
        float* scores = workspace + (long long)i * 3 * stride;
        QsaPair* pairs = (QsaPair*)(scores + stride);
        if (threadIdx.x == 0) {
            prefix = 0u;
            mask = 0u;
            remaining = (unsigned int)top;
        }
        __syncthreads();
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0u;
            __syncthreads();
            unsigned int want = prefix, within = mask;
            for (long long b = threadIdx.x; b < blocks; b += blockDim.x) {
                unsigned int k = qsa_order_key(scores[b]);
                if ((k & within) == want) atomicAdd(&histogram[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                unsigned int left = remaining;
                for (int bin = 255; bin >= 0; --bin) {
                    unsigned int count = histogram[bin];
                    if (left <= count) {
                        prefix |= (unsigned int)bin << shift;
                        mask |= 255u << shift;
                        remaining = left;
                        break;
                    }
                    left -= count;
                }
            }
            __syncthreads();
        }
        unsigned int threshold = prefix;
        // After the last pass the threshold's bin counts the scores equal to it.
        bool straddles = histogram[threshold & 255u] > remaining;
        __syncthreads();
        int* out = selected + (long long)r * top;
        // Tied blocks straddle the k-th place: which of them PyTorch keeps depends on its
        // algorithm's whole sequence of swaps, so one thread replays it (in shared memory when
        // the row's blocks fit), then marks the kept blocks in place of their scores.
        int* kept_mark = (int*)scores;  // pairs start past the scores: no overlap
        if (straddles) {
            if (blocks <= shared_pairs) pairs = pairs_in_shared;
            for (long long b = threadIdx.x; b < blocks; b += blockDim.x) {
                pairs[b].value = scores[b];
                pairs[b].index = (int)b;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                if ((long long)top * 64 <= blocks) {
                    qsa_heap_select(pairs, blocks, top);
                } else {
                    qsa_nth_element(pairs, blocks, top - 1);
                }
            }
            __syncthreads();
            for (long long b = threadIdx.x; b < blocks; b += blockDim.x) kept_mark[b] = 0;
            __syncthreads();
            for (int k = threadIdx.x; k < top; k += blockDim.x) kept_mark[pairs[k].index] = 1;
            __syncthreads();
        }
        // The kept blocks, ascending: an ordered compaction over the row's blocks (every
        // block above the threshold, and the ties at it when they all fit; or the marked ones).
        if (threadIdx.x == 0) written = 0;
        __syncthreads();
        for (long long base = 0; base < blocks; base += blockDim.x) {
            long long b = base + threadIdx.x;
            bool keep = b < blocks && (straddles ? kept_mark[b] != 0
                                                 : qsa_order_key(scores[b]) >= threshold);
            unsigned int ballot = __ballot_sync(0xffffffffu, keep);
            if (lane == 0) warp_counts[warp] = __popc(ballot);
            __syncthreads();
            int offset = written;
            for (int w = 0; w < warp; ++w) offset += warp_counts[w];
            offset += __popc(ballot & ((1u << lane) - 1u));
            if (keep && offset < top) out[offset] = (int)b;
            __syncthreads();
            if (threadIdx.x == 0) {
                for (int w = 0; w < warps; ++w) written += warp_counts[w];
            }
            __syncthreads();
        }
        __syncthreads();  // shared state is reused by the next row
    }
}

// Token `i` of a row's attended list: every token in the dense regime; else the selected
// blocks' tokens (blocks ascending), then the tail after the last complete block.
__device__ __forceinline__ long long qsa_token(long long i, bool dense, const int* blocks_kept,
                                               int ratio, int top, long long complete) {
    if (dense) return i;
    long long kept = (long long)top * ratio;
    if (i < kept) return (long long)blocks_kept[i / ratio] * ratio + i % ratio;
    return complete * ratio + (i - kept);
}

// Softmax attention of one (listed row, head) over the row's attended tokens, f32: each warp an
// online softmax over every QSA_ATTEND_WARPS-th token, then the warps merged. hd ≤ 256.
// With `splits` > 1 (a decode batch, whose few (row, head) pairs would leave most of the GPU
// idle and each warp waiting on one token's loads after another) the tokens are cut into
// `splits` ranges, blockIdx.z one of them, and the block writes its range's running maximum,
// sum and unnormalised output to partial[((row · heads + head) · splits + split) · (hd + 2)]
// for qsa_attend_merge.
template <typename KV>
__device__ void qsa_attend_rows(const float* q, const unsigned long long* table,
                                const int* selected, float* out, int heads, int kv_heads, int hd,
                                int ratio, int top, float scale, int splits, float* partial) {
    __shared__ float warp_max_s[QSA_ATTEND_WARPS];
    __shared__ float warp_sum_s[QSA_ATTEND_WARPS];
    __shared__ float warp_acc[QSA_ATTEND_WARPS][32 * QSA_MAX_DIMS_PER_LANE];
    int r = blockIdx.x, head = blockIdx.y, split = blockIdx.z;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned long long* entry = table + (long long)r * QSA_ROW_WORDS;
    const KV* keys = (const KV*)entry[QSA_KEYS];
    const KV* values = (const KV*)entry[QSA_VALUES];
    long long position = (long long)entry[QSA_POSITION];
    long long batch_row = (long long)entry[QSA_BATCH_ROW];
    long long visible = position + 1;
    long long complete = visible / ratio;
    bool dense = complete <= top;
    long long count = dense ? visible : (long long)top * ratio + (visible - complete * ratio);
    long long per_split = (count + splits - 1) / splits;
    long long first = (long long)split * per_split;
    long long last = min(count, first + per_split);
    int kv_width = kv_heads * hd;
    int kv_head = head / (heads / kv_heads);
    const int* kept = selected + (long long)r * top;
    const float* query = q + batch_row * heads * hd + (long long)head * hd;
    float qr[QSA_MAX_DIMS_PER_LANE], acc[QSA_MAX_DIMS_PER_LANE];
#pragma unroll
    for (int j = 0; j < QSA_MAX_DIMS_PER_LANE; ++j) {
        int d = lane + 32 * j;
        qr[j] = d < hd ? query[d] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = QSA_NEG_INF, l = 0.0f;
    for (long long i = first + warp; i < last; i += QSA_ATTEND_WARPS) {
        long long token = qsa_token(i, dense, kept, ratio, top, complete);
        long long base = token * kv_width + (long long)kv_head * hd;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < QSA_MAX_DIMS_PER_LANE; ++j) {
            int d = lane + 32 * j;
            if (d < hd) s += qr[j] * qsa_load(keys, base + d);
        }
        s = warp_sum(s) * scale;
        float m_new = fmaxf(m, s);
        float correction = expf(m - m_new);
        float p = expf(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int j = 0; j < QSA_MAX_DIMS_PER_LANE; ++j) {
            int d = lane + 32 * j;
            if (d < hd) acc[j] = acc[j] * correction + p * qsa_load(values, base + d);
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_max_s[warp] = m;
        warp_sum_s[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < QSA_MAX_DIMS_PER_LANE; ++j) warp_acc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    float best = QSA_NEG_INF;
    for (int w = 0; w < QSA_ATTEND_WARPS; ++w) best = fmaxf(best, warp_max_s[w]);
    float total = 0.0f;
    for (int w = 0; w < QSA_ATTEND_WARPS; ++w) {
        if (warp_max_s[w] > QSA_NEG_INF) total += warp_sum_s[w] * expf(warp_max_s[w] - best);
    }
    if (splits > 1) {
        // An empty range leaves best = -inf and total = 0: the merge skips it.
        float* slot = partial + (((long long)r * heads + head) * splits + split) * (hd + 2);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float sum = 0.0f;
            for (int w = 0; w < QSA_ATTEND_WARPS; ++w) {
                if (warp_max_s[w] > QSA_NEG_INF) sum += warp_acc[w][d] * expf(warp_max_s[w] - best);
            }
            slot[d] = sum;
        }
        if (threadIdx.x == 0) {
            slot[hd] = best;
            slot[hd + 1] = total;
        }
        return;
    }
    float* o = out + batch_row * heads * hd + (long long)head * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < QSA_ATTEND_WARPS; ++w) {
            if (warp_max_s[w] > QSA_NEG_INF) sum += warp_acc[w][d] * expf(warp_max_s[w] - best);
        }
        o[d] = sum / total;
    }
}

// Grid (listed rows, heads, splits), QSA_ATTEND_WARPS warps per block.
extern "C" __global__ void qsa_attend(const float* q, const unsigned long long* table,
                                      const int* selected, float* out, int heads, int kv_heads,
                                      int hd, int ratio, int top, float scale, int splits,
                                      float* partial) {
    PDL_WAIT_AND_RELEASE();
    qsa_attend_rows<float>(q, table, selected, out, heads, kv_heads, hd, ratio, top, scale,
                           splits, partial);
}

extern "C" __global__ void qsa_attend_bf16(const float* q, const unsigned long long* table,
                                           const int* selected, float* out, int heads,
                                           int kv_heads, int hd, int ratio, int top,
                                           float scale, int splits, float* partial) {
    PDL_WAIT_AND_RELEASE();
    qsa_attend_rows<unsigned short>(q, table, selected, out, heads, kv_heads, hd, ratio, top,
                                    scale, splits, partial);
}

// The `splits` partial results of each (listed row, head) merged into the output row: grid
// (listed rows, heads), QSA_ATTEND_WARPS · 32 threads.
extern "C" __global__ void qsa_attend_merge(const unsigned long long* table, const float* partial,
                                            float* out, int heads, int hd, int splits) {
    PDL_WAIT_AND_RELEASE();
    int r = blockIdx.x, head = blockIdx.y;
    const unsigned long long* entry = table + (long long)r * QSA_ROW_WORDS;
    long long batch_row = (long long)entry[QSA_BATCH_ROW];
    const float* slots = partial + ((long long)r * heads + head) * splits * (hd + 2);
    float best = QSA_NEG_INF;
    for (int s = 0; s < splits; ++s) best = fmaxf(best, slots[s * (hd + 2) + hd]);
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) {
        float m = slots[s * (hd + 2) + hd];
        if (m > QSA_NEG_INF) total += slots[s * (hd + 2) + hd + 1] * expf(m - best);
    }
    float* o = out + batch_row * heads * hd + (long long)head * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float sum = 0.0f;
        for (int s = 0; s < splits; ++s) {
            float m = slots[s * (hd + 2) + hd];
            if (m > QSA_NEG_INF) sum += slots[s * (hd + 2) + d] * expf(m - best);
        }
        o[d] = sum / total;
    }
}
