// Causal GQA attention of the CUDA backend over a sequence's KV cache.
//
// Three kernel families over one segment (one sequence's rows) per launch, and the decode
// family again over a whole batch of one-row segments per launch (`*_batched`, below):
//
// * `attention` / `attention_bf16` — the reference: one warp per (query row, head) walks the
//   visible keys in order with an online softmax. Simple and obviously right; the start-up
//   self-check (device/attention.rs) holds the two faster paths to it, and the backend falls back
//   to it for the life of the process if they disagree.
// * `attention_split[_bf16]` + `attention_combine` — decode (segments of at most a few rows):
//   split-K / flash-decoding. The keys of a row are cut into chunks aligned to absolute key
//   positions (`chunk` keys, a multiple of SPLIT_TILE, chosen by the host from the segment's last
//   position only); one block per (chunk, kv head × slice of its q heads, row) scores its chunk
//   against up to SPLIT_HEADS q heads of the group (each K/V element read once per group) and
//   writes an unnormalised partial (max, sum, Σ p·v); the combine kernel merges a row's chunks in
//   ascending order with the log-sum-exp rule.
// * `attention_tiled[_bf16]` — prefill: a block takes TILE_ROWS query rows of one head and walks
//   key tiles of TILE_KEYS keys (aligned to absolute key positions) staged in shared memory,
//   each K and V tile loaded once and used by all rows of the block; online softmax per row, the
//   causal mask and sliding window per element, and no key tile past the block's last row.
//
// * `attention_mma_{64,128,256}` — prefill on the tensor cores (sm_80+, bf16 cache, head_dim 64,
//   128 or 256): flash-attention-2. A block takes MMA_ROWS query rows of one head (16 per warp)
//   and walks key tiles of MMA_KEYS keys (aligned to absolute key positions), K and V staged
//   with asynchronous copies (the next tile's K while this tile's V is used, and so on);
//   S = Q·Kᵀ and O += P·V on `mma.sync.m16n8k16` with q and p rounded to bf16 (K, V are bf16
//   already), the online softmax in f32 on the accumulators. Not bit-equal to the tiled kernel:
//   held to the reference within bf16 tolerances (start-up check and tests/cuda_tensor_core_attention.rs).
//
// Batch invariance: every row's arithmetic depends only on its own position, window and key
// range (and, for the split path, the segment's chunk size), never on the other rows of the
// block or the batch: key tiles/chunks are aligned to absolute positions, a key tile that is
// fully masked for a row leaves its state bit-for-bit unchanged (correction 1, p 0), and every
// reduction runs in a fixed order. f32 accumulation everywhere.
//
// The cache holds f32 (`attention`, `kv_append` in elementwise.cu) or bf16 (`*_bf16`,
// `kv_append_bf16` here: half the memory; keys and values are rounded to nearest even when they
// are appended, and widened exactly when read, so the math after the read is the same f32).

#include "common.cuh"
#include "attention_common.cuh"

#define MAX_DIMS_PER_LANE 8

__device__ __forceinline__ float load_kv(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_kv(const unsigned short* p, long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void store_kv(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_kv(unsigned short* p, float x) { *p = f32_to_bf16_bits(x); }

// Appends one sequence's k, v rows [row_start, row_start + n) ([*, width] f32) to its bf16
// cache ([max_tokens, width]) at position `at` (`row_positions[row_start]` when
// `row_positions` is given: a step graph's positions live in device memory). One thread per
// element, grid-stride.
extern "C" __global__ void kv_append_bf16(const float* k, const float* v, unsigned short* keys,
                                          unsigned short* values, int row_start, int n, int at,
                                          int width, const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    if (row_positions) at = (int)row_positions[row_start];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)n * width;
         i += (long long)blockDim.x * gridDim.x) {
        long long src = (long long)row_start * width + i;
        long long dst = (long long)at * width + i;
        keys[dst] = f32_to_bf16_bits(k[src]);
        values[dst] = f32_to_bf16_bits(v[src]);
    }
}

// q: [*, heads·hd] (rows row_start..row_start+n of this sequence), keys/values: the sequence's
// cache [max_tokens, kv_heads·hd] with positions 0..start_position+n filled; out like q.
// window = 0 means full causal; else keys within `window` positions (self included).
template <typename KV>
__device__ void attention_warp(const float* q, const KV* keys, const KV* values, float* out,
                               int row_start, int n, int start_position, int heads, int kv_heads,
                               int hd, int window, float scale) {
    int warps_per_block = blockDim.x / 32;
    long long task = (long long)blockIdx.x * warps_per_block + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (task >= (long long)n * heads) return;
    int t = (int)(task / heads), head = (int)(task % heads);
    int group = heads / kv_heads;
    int kv_head = head / group;
    int position = start_position + t;
    int first = window > 0 ? max(0, position + 1 - window) : 0;
    int q_width = heads * hd, kv_width = kv_heads * hd;
    const float* query = q + (long long)(row_start + t) * q_width + (long long)head * hd;

    float qd[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
        int d = lane + 32 * j;
        qd[j] = d < hd ? query[d] : 0.0f;
        acc[j] = 0.0f;
    }
    float running_max = __int_as_float(0xff800000), total = 0.0f;  // -inf
    for (int key = first; key <= position; ++key) {
        const KV* kr = keys + (long long)key * kv_width + (long long)kv_head * hd;
        float partial = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
            int d = lane + 32 * j;
            if (d < hd) partial += qd[j] * load_kv(kr, d);
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            partial += __shfl_xor_sync(0xffffffffu, partial, offset);
        }
        float score = partial * scale;
        float new_max = fmaxf(running_max, score);
        float correction = expf(running_max - new_max);  // 0 on the first key (max was -inf)
        float p = expf(score - new_max);
        total = total * correction + p;
        const KV* vr = values + (long long)key * kv_width + (long long)kv_head * hd;
#pragma unroll
        for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
            int d = lane + 32 * j;
            if (d < hd) acc[j] = acc[j] * correction + p * load_kv(vr, d);
        }
        running_max = new_max;
    }
    float* o = out + (long long)(row_start + t) * q_width + (long long)head * hd;
    float inverse = 1.0f / total;
#pragma unroll
    for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
        int d = lane + 32 * j;
        if (d < hd) o[d] = acc[j] * inverse;
    }
}

extern "C" __global__ void attention(const float* q, const float* keys, const float* values,
                                     float* out, int row_start, int n, int start_position,
                                     int heads, int kv_heads, int hd, int window, float scale) {
    PDL_WAIT_AND_RELEASE();
    attention_warp(q, keys, values, out, row_start, n, start_position, heads, kv_heads, hd, window,
                   scale);
}

extern "C" __global__ void attention_bf16(const float* q, const unsigned short* keys,
                                          const unsigned short* values, float* out, int row_start,
                                          int n, int start_position, int heads, int kv_heads,
                                          int hd, int window, float scale) {
    PDL_WAIT_AND_RELEASE();
    attention_warp(q, keys, values, out, row_start, n, start_position, heads, kv_heads, hd, window,
                   scale);
}

// ---------------------------------------------------------------------------------------------
// Shared helpers of the split and tiled kernels.

extern __shared__ float attention_smem[];


// ---------------------------------------------------------------------------------------------
// Split-K decode.
//
// Decode is bound by latency, not bytes (a 4K context is 8 MB of bf16 K/V per layer, ~3 µs of
// HBM): so many small blocks, each staging its whole key tile with asynchronous copies (every
// load in flight at once, `cp.async`, sm_80+), then scoring from shared memory with no
// cross-lane reductions.

#define SPLIT_THREADS 128
#define SPLIT_WARPS 4
// q heads one block serves (a whole GQA group up to this size, else a slice of it); each warp
// scores heads warp and warp + SPLIT_WARPS.
#define SPLIT_HEADS 8
// hd ≤ SPLIT_THREADS * SPLIT_DIMS.
#define SPLIT_DIMS 2


// The cache's elements as 4-byte words: one f32, or two bf16 (element 2w in the low half).
template <typename KV> struct KvWords;
template <> struct KvWords<float> {
    static constexpr int per_word = 1;
    __device__ static __forceinline__ void widen(unsigned int word, float* x) {
        x[0] = __uint_as_float(word);
    }
};
template <> struct KvWords<unsigned short> {
    static constexpr int per_word = 2;
    __device__ static __forceinline__ void widen(unsigned int word, float* x) {
        x[0] = __uint_as_float(word << 16);
        x[1] = __uint_as_float(word & 0xffff0000u);
    }
};

// A 4-byte global → shared copy that does not wait (sm_80+); `split_copies_wait` waits for all.
__device__ __forceinline__ void split_copy_word(unsigned int* shared_word,
                                                const unsigned int* global_word) {
    unsigned int address = (unsigned int)__cvta_generic_to_shared(shared_word);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(address), "l"(global_word)
                 : "memory");
}

// Grid: x = chunk (absolute: keys [x·chunk, x·chunk + chunk) ∩ the row's visible keys),
// y = kv_head · slices + slice (slices = ceil(group / SPLIT_HEADS)); `t` is the row of the
// segment (grid z of `attention_split`).
// Partial (t, head, chunk) sits at index part_base + (t·heads + head)·chunks + chunk:
// part_o[index·hd + d] = Σ p·v (relative to the max), part_ml[2·index] = max,
// part_ml[2·index + 1] = Σ p. Dynamic shared memory: `split_smem_bytes` (attention.rs). For bf16
// the host sends only an even hd here (a row is whole words).
template <typename KV>
__device__ void attention_split_block(const float* q, const KV* keys, const KV* values,
                                      float* part_o, float* part_ml, int row_start,
                                      int start_position, int heads, int kv_heads, int hd,
                                      int window, float scale, int chunk, int chunks,
                                      int part_base, int t) {
    const int per_word = KvWords<KV>::per_word;
    const int words = hd / per_word;  // of one K or V row of one kv head
    // Rows of whole 16-byte quads (`quads`) are staged and scored 16 bytes at a time, with a
    // stride of words + 4: 8 lanes reading 16 bytes each hit distinct bank quads when
    // words / 4 is even. Otherwise 4 bytes at a time with an odd stride (lane j's row starts
    // on bank j). `split_smem_bytes` in attention.rs mirrors the stride.
    const bool quads = (words & 3) == 0;
    const int stride = quads ? words + 4 : words + 1;
    float* q_s = attention_smem;                                   // [SPLIT_HEADS][hd]
    float* p_s = q_s + SPLIT_HEADS * hd;                           // [SPLIT_HEADS][SPLIT_TILE]
    float* m_s = p_s + SPLIT_HEADS * SPLIT_TILE;                   // running max per head
    float* l_s = m_s + SPLIT_HEADS;                                // running sum per head
    float* c_s = l_s + SPLIT_HEADS;                                // this tile's correction
    unsigned int* k_s = (unsigned int*)(c_s + SPLIT_HEADS);        // [SPLIT_TILE][stride]
    unsigned int* v_s = k_s + SPLIT_TILE * stride;                 // [SPLIT_TILE][stride]

    int group = heads / kv_heads;
    int slices = (group + SPLIT_HEADS - 1) / SPLIT_HEADS;
    int c = blockIdx.x;
    int kv_head = blockIdx.y / slices;
    int h0 = (blockIdx.y % slices) * SPLIT_HEADS;  // first q head of the slice, within the group
    int hg = min(SPLIT_HEADS, group - h0);
    int position = start_position + t;
    int first = window > 0 ? max(0, position + 1 - window) : 0;
    int k0 = max(c * chunk, first);
    int k1 = min(c * chunk + chunk - 1, position);
    if (k0 > k1) return;  // the whole block: nothing of this row in this chunk

    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    int q_width = heads * hd;
    long long kv_row_words = (long long)kv_heads * words;
    const unsigned int* key_words = (const unsigned int*)keys + (long long)kv_head * words;
    const unsigned int* value_words = (const unsigned int*)values + (long long)kv_head * words;
    int head0 = kv_head * group + h0;
    // The slice's q heads are consecutive in the row (head-major).
    const float* query = q + (long long)(row_start + t) * q_width + (long long)head0 * hd;
    for (int i = tid; i < hg * hd; i += SPLIT_THREADS) q_s[i] = query[i];
    if (tid < SPLIT_HEADS) {
        m_s[tid] = __int_as_float(0xff800000);  // -inf
        l_s[tid] = 0.0f;
        c_s[tid] = 0.0f;
    }
    float acc[SPLIT_HEADS][SPLIT_DIMS];
#pragma unroll
    for (int h = 0; h < SPLIT_HEADS; ++h) {
#pragma unroll
        for (int e = 0; e < SPLIT_DIMS; ++e) acc[h][e] = 0.0f;
    }

    for (int s0 = k0; s0 <= k1; s0 += SPLIT_TILE) {
        int len = min(SPLIT_TILE, k1 - s0 + 1);
        // Stage the tile's K and V rows: every copy issued before any is waited for.
        if (quads) {
            int row_quads = words / 4;
            for (int i = tid; i < len * row_quads; i += SPLIT_THREADS) {
                int j = i / row_quads, w = (i % row_quads) * 4;
                long long row = (long long)(s0 + j) * kv_row_words;
                split_copy_quad(k_s + j * stride + w, key_words + row + w);
                split_copy_quad(v_s + j * stride + w, value_words + row + w);
            }
        } else {
            for (int j = warp; j < len; j += SPLIT_WARPS) {
                const unsigned int* kr = key_words + (long long)(s0 + j) * kv_row_words;
                const unsigned int* vr = value_words + (long long)(s0 + j) * kv_row_words;
                for (int w = lane; w < words; w += 32) {
                    split_copy_word(k_s + j * stride + w, kr + w);
                    split_copy_word(v_s + j * stride + w, vr + w);
                }
            }
        }
        split_copies_wait();
        __syncthreads();  // the tile (and, the first time, q_s) visible to every thread
        // Scores: lane ↔ key, warp ↔ heads warp and warp + SPLIT_WARPS; q_s reads broadcast.
        if (lane < len) {
            const unsigned int* kr = k_s + lane * stride;
            int ha = warp, hb = warp + SPLIT_WARPS;
            const float* qa = q_s + ha * hd;
            const float* qb = q_s + hb * hd;
            float sa = 0.0f, sb = 0.0f;
            bool has_b = hb < hg;
            if (ha < hg && quads) {
                // The same products in the same order as below, read 16 bytes at a time (q rows
                // are 16-byte aligned: hd · 4 bytes is a multiple of 16 here).
                const int per_quad = 4 * per_word;  // elements in 16 bytes of the cache
#pragma unroll 2
                for (int w = 0; w < words; w += 4) {
                    uint4 quad = *reinterpret_cast<const uint4*>(kr + w);
                    unsigned int quad_words[4] = {quad.x, quad.y, quad.z, quad.w};
                    float x[8], a[8], b[8];
#pragma unroll
                    for (int u = 0; u < 4; ++u) KvWords<KV>::widen(quad_words[u], x + u * per_word);
#pragma unroll
                    for (int f = 0; f < per_quad; f += 4) {
                        float4 qa4 = *reinterpret_cast<const float4*>(qa + w * per_word + f);
                        a[f] = qa4.x, a[f + 1] = qa4.y, a[f + 2] = qa4.z, a[f + 3] = qa4.w;
                        if (has_b) {
                            float4 qb4 = *reinterpret_cast<const float4*>(qb + w * per_word + f);
                            b[f] = qb4.x, b[f + 1] = qb4.y, b[f + 2] = qb4.z, b[f + 3] = qb4.w;
                        }
                    }
#pragma unroll
                    for (int e = 0; e < per_quad; ++e) {
                        sa += a[e] * x[e];
                        if (has_b) sb += b[e] * x[e];
                    }
                }
            } else if (ha < hg) {
#pragma unroll 4
                for (int w = 0; w < words; ++w) {
                    float x[2];
                    KvWords<KV>::widen(kr[w], x);
#pragma unroll
                    for (int e = 0; e < per_word; ++e) {
                        sa += qa[w * per_word + e] * x[e];
                        if (has_b) sb += qb[w * per_word + e] * x[e];
                    }
                }
            }
            if (ha < hg) {
                p_s[ha * SPLIT_TILE + lane] = sa * scale;
                if (has_b) p_s[hb * SPLIT_TILE + lane] = sb * scale;
            }
        }
        __syncthreads();
        // Online softmax statistics: one warp per head. Every tile holds at least one key, so
        // the new max is finite.
        for (int h = warp; h < hg; h += SPLIT_WARPS) {
            float old_max = m_s[h], old_sum = l_s[h];
            float score = lane < len ? p_s[h * SPLIT_TILE + lane] : __int_as_float(0xff800000);
            float new_max = fmaxf(old_max, warp_max(score));
            float p = lane < len ? expf(score - new_max) : 0.0f;
            if (lane < len) p_s[h * SPLIT_TILE + lane] = p;
            float sum = warp_sum(p);
            if (lane == 0) {
                float correction = expf(old_max - new_max);  // 0 on the first tile
                c_s[h] = correction;
                l_s[h] = old_sum * correction + sum;
                m_s[h] = new_max;
            }
        }
        __syncthreads();
        // Σ p·v: thread ↔ output dims, every head of the slice; V from shared memory.
#pragma unroll
        for (int h = 0; h < SPLIT_HEADS; ++h) {
            float correction = h < hg ? c_s[h] : 0.0f;
#pragma unroll
            for (int e = 0; e < SPLIT_DIMS; ++e) acc[h][e] *= correction;
        }
        const KV* v_tile = (const KV*)v_s;
#pragma unroll 8
        for (int j = 0; j < len; ++j) {
            float v[SPLIT_DIMS];
#pragma unroll
            for (int e = 0; e < SPLIT_DIMS; ++e) {
                int d = tid + SPLIT_THREADS * e;
                v[e] = d < hd ? load_kv(v_tile, (long long)j * stride * per_word + d) : 0.0f;
            }
#pragma unroll
            for (int h = 0; h < SPLIT_HEADS; ++h) {
                if (h < hg) {
                    float p = p_s[h * SPLIT_TILE + j];
#pragma unroll
                    for (int e = 0; e < SPLIT_DIMS; ++e) acc[h][e] += p * v[e];
                }
            }
        }
        __syncthreads();  // k_s, v_s, p_s and c_s are rewritten by the next tile
    }

#pragma unroll
    for (int h = 0; h < SPLIT_HEADS; ++h) {
        if (h < hg) {
            long long index =
                (long long)part_base + ((long long)t * heads + head0 + h) * chunks + c;
#pragma unroll
            for (int e = 0; e < SPLIT_DIMS; ++e) {
                int d = tid + SPLIT_THREADS * e;
                if (d < hd) part_o[index * hd + d] = acc[h][e];
            }
            if (tid == 0) {
                part_ml[2 * index] = m_s[h];
                part_ml[2 * index + 1] = l_s[h];
            }
        }
    }
}

// One segment's rows (grid z = row t). In a step graph (`row_positions` given) the position
// comes from device memory, the chunk from it as the host chooses it (`split_chunk`), and the
// grid covers `chunks` = SPLIT_MAX_CHUNKS.
template <typename KV>
__device__ __forceinline__ void attention_split_segment(
    const float* q, const KV* keys, const KV* values, float* part_o, float* part_ml,
    int row_start, int start_position, int heads, int kv_heads, int hd, int window, float scale,
    int chunk, int chunks, int part_base, const unsigned int* row_positions) {
    if (row_positions) {
        start_position = (int)row_positions[row_start];
        chunk = split_chunk(start_position + (int)gridDim.z - 1);
    }
    attention_split_block(q, keys, values, part_o, part_ml, row_start, start_position, heads,
                          kv_heads, hd, window, scale, chunk, chunks, part_base, (int)blockIdx.z);
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    attention_split(const float* q, const float* keys, const float* values, float* part_o,
                    float* part_ml, int row_start, int start_position, int heads, int kv_heads,
                    int hd, int window, float scale, int chunk, int chunks, int part_base,
                    const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_split_segment(q, keys, values, part_o, part_ml, row_start, start_position, heads,
                            kv_heads, hd, window, scale, chunk, chunks, part_base, row_positions);
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    attention_split_bf16(const float* q, const unsigned short* keys,
                         const unsigned short* values, float* part_o, float* part_ml,
                         int row_start, int start_position, int heads, int kv_heads, int hd,
                         int window, float scale, int chunk, int chunks, int part_base,
                         const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_split_segment(q, keys, values, part_o, part_ml, row_start, start_position, heads,
                            kv_heads, hd, window, scale, chunk, chunks, part_base, row_positions);
}

// ---------------------------------------------------------------------------------------------
// Batched decode: one launch for a whole batch of one-row segments.
//
// Row t of the launch is batch row row_start + t, one new token of its own sequence: its cache
// and (outside a step graph) its position come from `DecodeRows` (kernel parameters, so a step
// graph keeps them with the recording, as it keeps a segment launch's cache addresses); inside
// a step graph its position comes from `row_positions`. Each row's chunk is `split_chunk` of its
// own position, exactly the chunk a one-row segment launch takes, and each row's partials sit
// at part_base + t · heads · chunks: so every row gets the bits of its own segment launches.


// Appends each row's k, v ([*, width] f32) to its cache at its position. One thread per
// element, grid-stride over rows × width.
template <typename KV>
__device__ __forceinline__ void kv_append_rows(const float* k, const float* v,
                                               const DecodeRows& batch, int row_start, int n,
                                               int width, const unsigned int* row_positions) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)n * width;
         i += (long long)blockDim.x * gridDim.x) {
        int t = (int)(i / width);
        long long column = i % width;
        long long src = (long long)(row_start + t) * width + column;
        long long dst = (long long)decode_row_position(batch, row_start, t, row_positions) * width +
                        column;
        KV* keys = reinterpret_cast<KV*>(batch.keys[t]);
        KV* values = reinterpret_cast<KV*>(batch.values[t]);
        store_kv(keys + dst, k[src]);
        store_kv(values + dst, v[src]);
    }
}

extern "C" __global__ void kv_append_batched(const float* k, const float* v, DecodeRows batch,
                                             int row_start, int n, int width,
                                             const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    kv_append_rows<float>(k, v, batch, row_start, n, width, row_positions);
}

extern "C" __global__ void kv_append_batched_bf16(const float* k, const float* v,
                                                  DecodeRows batch, int row_start, int n,
                                                  int width, const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    kv_append_rows<unsigned short>(k, v, batch, row_start, n, width, row_positions);
}

// Grid: x = chunk (up to `chunks`), y = kv_head · slices + slice, z = row t of the launch.
template <typename KV>
__device__ __forceinline__ void attention_split_rows(const float* q, float* part_o, float* part_ml,
                                                     const DecodeRows& batch, int row_start,
                                                     int heads, int kv_heads, int hd, int window,
                                                     float scale, int chunks, int part_base,
                                                     const unsigned int* row_positions) {
    int t = blockIdx.z;
    int position = decode_row_position(batch, row_start, t, row_positions);
    attention_split_block(q, reinterpret_cast<const KV*>(batch.keys[t]),
                          reinterpret_cast<const KV*>(batch.values[t]), part_o, part_ml,
                          row_start + t, position, heads, kv_heads, hd, window, scale,
                          split_chunk(position), chunks, part_base + t * heads * chunks, 0);
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    attention_split_batched(const float* q, float* part_o, float* part_ml, DecodeRows batch,
                            int row_start, int heads, int kv_heads, int hd, int window,
                            float scale, int chunks, int part_base,
                            const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_split_rows<float>(q, part_o, part_ml, batch, row_start, heads, kv_heads, hd, window,
                                scale, chunks, part_base, row_positions);
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    attention_split_batched_bf16(const float* q, float* part_o, float* part_ml, DecodeRows batch,
                                 int row_start, int heads, int kv_heads, int hd, int window,
                                 float scale, int chunks, int part_base,
                                 const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_split_rows<unsigned short>(q, part_o, part_ml, batch, row_start, heads, kv_heads,
                                         hd, window, scale, chunks, part_base, row_positions);
}

// Warps of a combine block; each sums every COMBINE_WARPS-th chunk.
#define COMBINE_WARPS 8

// One block per (row t, head, 32 of the head's dims) of the segment (grid x = n·heads,
// y = ceil(hd / 32)), COMBINE_WARPS warps: merges the row's chunks first/chunk ..= position/chunk
// (every one of them non-empty): M = max m_c, L = Σ l_c·e^(m_c − M),
// out = Σ o_c·e^(m_c − M) / L. The first warp computes the chunks' weights once into shared
// memory (and L, by a fixed lane tree); warp w sums chunks w, w + COMBINE_WARPS, … in ascending
// order for its lane's dim, and the warps' sums are added in warp order: a fixed order that
// depends only on the chunk count, with every chunk's load in flight at once.
// Merges the chunks of one (row, head) for the 32 dims of block y: the row sits at `position`,
// its output at row `out_row`, its partials at `base` + head · chunks + chunk.
__device__ __forceinline__ void combine_row_head(const float* part_o, const float* part_ml,
                                                 float* out, int out_row, int position, int head,
                                                 int heads, int hd, int window, int chunk,
                                                 int chunks, long long base) {
    __shared__ float weight_s[COMBINE_MAX_CHUNKS];
    __shared__ float partial_s[COMBINE_WARPS][32];
    __shared__ float scalar_s[1];  // 1 / L
    int first = window > 0 ? max(0, position + 1 - window) : 0;
    int c0 = first / chunk, c1 = position / chunk;
    int count = c1 - c0 + 1;
    base += (long long)head * chunks + c0;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0) {
        float top = __int_as_float(0xff800000);
        for (int i = lane; i < count; i += 32) top = fmaxf(top, part_ml[2 * (base + i)]);
        top = warp_max(top);
        float total = 0.0f;
        for (int i = lane; i < count; i += 32) {
            float weight = expf(part_ml[2 * (base + i)] - top);
            weight_s[i] = weight;
            total += part_ml[2 * (base + i) + 1] * weight;
        }
        total = warp_sum(total);
        if (lane == 0) scalar_s[0] = 1.0f / total;
    }
    __syncthreads();
    int d = blockIdx.y * 32 + lane;
    float sum = 0.0f;
    if (d < hd) {
#pragma unroll 16
        for (int i = warp; i < count; i += COMBINE_WARPS)
            sum += part_o[(base + i) * hd + d] * weight_s[i];
    }
    partial_s[warp][lane] = sum;
    __syncthreads();
    if (warp == 0 && d < hd) {
        float total = partial_s[0][lane];
#pragma unroll
        for (int w = 1; w < COMBINE_WARPS; ++w) total += partial_s[w][lane];
        out[(long long)out_row * heads * hd + (long long)head * hd + d] = total * scalar_s[0];
    }
}

extern "C" __global__ void __launch_bounds__(32 * COMBINE_WARPS)
    attention_combine(const float* part_o, const float* part_ml, float* out, int row_start, int n,
                      int start_position, int heads, int hd, int window, int chunk, int chunks,
                      int part_base, const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    if (row_positions) {
        start_position = (int)row_positions[row_start];
        chunk = split_chunk(start_position + n - 1);
    }
    int task = blockIdx.x;
    if (task >= n * heads) return;
    int t = task / heads, head = task % heads;
    combine_row_head(part_o, part_ml, out, row_start + t, start_position + t, head, heads, hd,
                     window, chunk, chunks, (long long)part_base + (long long)t * heads * chunks);
}

// The combine of a batched split launch: grid x = n · heads (row t, head), y = ceil(hd / 32);
// each row's chunk and partials as `attention_split_rows` left them.
extern "C" __global__ void __launch_bounds__(32 * COMBINE_WARPS)
    attention_combine_batched(const float* part_o, const float* part_ml, float* out,
                              DecodeRows batch, int row_start, int n, int heads, int hd,
                              int window, int chunks, int part_base,
                              const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    int task = blockIdx.x;
    if (task >= n * heads) return;
    int t = task / heads, head = task % heads;
    int position = decode_row_position(batch, row_start, t, row_positions);
    combine_row_head(part_o, part_ml, out, row_start + t, position, head, heads, hd, window,
                     split_chunk(position), chunks,
                     (long long)part_base + (long long)t * heads * chunks);
}

// ---------------------------------------------------------------------------------------------
// Tiled prefill.

#define TILE_THREADS 128
#define TILE_WARPS 4
#define TILE_ROWS_PER_WARP 8
#define TILE_ROWS (TILE_WARPS * TILE_ROWS_PER_WARP)
// One key per lane when scoring.
#define TILE_KEYS 32

// Grid: x = tile of TILE_ROWS rows of the segment, y = head. Dynamic shared memory:
// TILE_ROWS·hd (q) + TILE_KEYS·(hd + 1) (the K tile, then the V tile; +1 keeps the lanes'
// rows on distinct banks) + TILE_ROWS·TILE_KEYS (p) floats.
template <typename KV>
__device__ void attention_tiled_block(const float* q, const KV* keys, const KV* values,
                                      float* out, int row_start, int n, int start_position,
                                      int heads, int kv_heads, int hd, int window, float scale) {
    int stride = hd + 1;
    float* q_s = attention_smem;               // [TILE_ROWS][hd]
    float* kv_s = q_s + TILE_ROWS * hd;         // [TILE_KEYS][hd + 1]
    float* p_s = kv_s + TILE_KEYS * stride;     // [TILE_ROWS][TILE_KEYS]

    int group = heads / kv_heads;
    int head = blockIdx.y, kv_head = head / group;
    int t0 = blockIdx.x * TILE_ROWS;
    if (t0 >= n) return;
    int t_last = min(t0 + TILE_ROWS, n) - 1;
    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    int q_width = heads * hd, kv_width = kv_heads * hd;
    const float neg_inf = __int_as_float(0xff800000);

    for (int i = tid; i < TILE_ROWS * hd; i += TILE_THREADS) {
        int r = i / hd, d = i - r * hd;
        int t = t0 + r;
        q_s[i] = t < n ? q[(long long)(row_start + t) * q_width + (long long)head * hd + d] : 0.0f;
    }
    // Keys any row of the block sees: from the first row's window start to the last row.
    int first_key = window > 0 ? max(0, start_position + t0 + 1 - window) : 0;
    int last_key = start_position + t_last;

    float row_max[TILE_ROWS_PER_WARP], row_sum[TILE_ROWS_PER_WARP];
    float acc[TILE_ROWS_PER_WARP][MAX_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < TILE_ROWS_PER_WARP; ++i) {
        row_max[i] = neg_inf;
        row_sum[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) acc[i][e] = 0.0f;
    }

    for (int tile = first_key / TILE_KEYS; tile <= last_key / TILE_KEYS; ++tile) {
        int key0 = tile * TILE_KEYS;
        __syncthreads();  // q_s stored (first tile); the previous tile's V reads done
        for (int i = tid; i < TILE_KEYS * hd; i += TILE_THREADS) {
            int j = i / hd, d = i - j * hd;
            int key = key0 + j;
            kv_s[j * stride + d] =
                key <= last_key
                    ? load_kv(keys, (long long)key * kv_width + (long long)kv_head * hd + d)
                    : 0.0f;
        }
        __syncthreads();
        // Scores: lane ↔ key, the warp's rows.
        float s[TILE_ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < TILE_ROWS_PER_WARP; ++i) s[i] = 0.0f;
        const float* kr = kv_s + lane * stride;
        const float* qr = q_s + warp * TILE_ROWS_PER_WARP * hd;
        for (int d = 0; d < hd; ++d) {
            float kd = kr[d];
#pragma unroll
            for (int i = 0; i < TILE_ROWS_PER_WARP; ++i) s[i] += qr[i * hd + d] * kd;
        }
        int key = key0 + lane;
        float correction[TILE_ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < TILE_ROWS_PER_WARP; ++i) {
            int r = warp * TILE_ROWS_PER_WARP + i;
            int t = t0 + r;
            int position = start_position + t;
            int first = window > 0 ? max(0, position + 1 - window) : 0;
            bool visible = t < n && key >= first && key <= position;
            float score = visible ? s[i] * scale : neg_inf;
            float new_max = fmaxf(row_max[i], warp_max(score));
            float p = 0.0f;
            correction[i] = 1.0f;
            // Warp-uniform. A tile with nothing visible for this row leaves its state exactly
            // as it was (correction e^0 = 1 or the -inf guard, p = 0).
            if (new_max != neg_inf) {
                correction[i] = expf(row_max[i] - new_max);
                p = visible ? expf(score - new_max) : 0.0f;
            }
            row_sum[i] = row_sum[i] * correction[i] + warp_sum(p);
            row_max[i] = new_max;
            p_s[r * TILE_KEYS + lane] = p;
        }
        __syncthreads();  // every warp done with the K tile
        for (int i = tid; i < TILE_KEYS * hd; i += TILE_THREADS) {
            int j = i / hd, d = i - j * hd;
            int k = key0 + j;
            kv_s[j * stride + d] =
                k <= last_key
                    ? load_kv(values, (long long)k * kv_width + (long long)kv_head * hd + d)
                    : 0.0f;
        }
        __syncthreads();
        // Σ p·v: lane ↔ output dims, the warp's rows.
#pragma unroll
        for (int i = 0; i < TILE_ROWS_PER_WARP; ++i) {
#pragma unroll
            for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) acc[i][e] *= correction[i];
        }
        const float* pr = p_s + warp * TILE_ROWS_PER_WARP * TILE_KEYS;
        for (int j = 0; j < TILE_KEYS; ++j) {
            float v[MAX_DIMS_PER_LANE];
#pragma unroll
            for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) {
                int d = lane + 32 * e;
                v[e] = d < hd ? kv_s[j * stride + d] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < TILE_ROWS_PER_WARP; ++i) {
                float p = pr[i * TILE_KEYS + j];
#pragma unroll
                for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) acc[i][e] += p * v[e];
            }
        }
    }

#pragma unroll
    for (int i = 0; i < TILE_ROWS_PER_WARP; ++i) {
        int t = t0 + warp * TILE_ROWS_PER_WARP + i;
        if (t < n) {
            float* o = out + (long long)(row_start + t) * q_width + (long long)head * hd;
            float inverse = 1.0f / row_sum[i];
#pragma unroll
            for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) {
                int d = lane + 32 * e;
                if (d < hd) o[d] = acc[i][e] * inverse;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(TILE_THREADS)
    attention_tiled(const float* q, const float* keys, const float* values, float* out,
                    int row_start, int n, int start_position, int heads, int kv_heads, int hd,
                    int window, float scale) {
    PDL_WAIT_AND_RELEASE();
    attention_tiled_block(q, keys, values, out, row_start, n, start_position, heads, kv_heads,
                          hd, window, scale);
}

extern "C" __global__ void __launch_bounds__(TILE_THREADS)
    attention_tiled_bf16(const float* q, const unsigned short* keys,
                         const unsigned short* values, float* out, int row_start, int n,
                         int start_position, int heads, int kv_heads, int hd, int window,
                         float scale) {
    PDL_WAIT_AND_RELEASE();
    attention_tiled_block(q, keys, values, out, row_start, n, start_position, heads, kv_heads,
                          hd, window, scale);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core prefill (flash-attention-2 on mma.sync).

#define MMA_ROWS 64
#define MMA_KEYS 64
#define MMA_THREADS 128
// bf16 of padding per staged row: rows 16·(hd / 8 + 1) bytes apart put the 8 rows an ldmatrix
// reads on distinct banks.
#define MMA_PAD 8

// Stages keys [key0, key0 + MMA_KEYS) of one kv head (rows past last_key as 0: a cache row past
// the filled length may hold anything, and 0 · NaN would poison the PV product).
template <int HD>
__device__ __forceinline__ void mma_stage_keys(unsigned short* tile, const unsigned short* cache,
                                               int key0, int last_key, long long kv_width,
                                               int kv_head) {
    const int chunks = HD / 8;  // 16-byte copies per row
    for (int i = threadIdx.x; i < MMA_KEYS * chunks; i += MMA_THREADS) {
        int j = i / chunks, c = (i % chunks) * 8;
        int key = key0 + j;
        bool valid = key <= last_key;
        const unsigned short* from =
            cache + (valid ? (long long)key * kv_width + (long long)kv_head * HD + c : 0);
        mma_copy_16(tile + j * (HD + MMA_PAD) + c, from, valid);
    }
}

// Grid: x = tile of MMA_ROWS rows (the last tile first: causal blocks near the end have the most
// keys), y = head. MMA_THREADS threads. Dynamic shared memory 3 · MMA_ROWS · (HD + MMA_PAD) bf16
// (q, the K tile, the V tile; MMA_ROWS = MMA_KEYS).
template <int HD>
__device__ void attention_mma_block(const float* q, const unsigned short* keys,
                                    const unsigned short* values, float* out, int row_start,
                                    int n, int start_position, int heads, int kv_heads, int window,
                                    float scale) {
    const int stride = HD + MMA_PAD;
    unsigned short* q_s = reinterpret_cast<unsigned short*>(attention_smem);
    unsigned short* k_s = q_s + MMA_ROWS * stride;
    unsigned short* v_s = k_s + MMA_KEYS * stride;

    int group = heads / kv_heads;
    int head = blockIdx.y, kv_head = head / group;
    int t0 = (gridDim.x - 1 - blockIdx.x) * MMA_ROWS;
    if (t0 >= n) return;
    int t_last = min(t0 + MMA_ROWS, n) - 1;
    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    long long q_width = (long long)heads * HD, kv_width = (long long)kv_heads * HD;
    const float neg_inf = __int_as_float(0xff800000);
    // exp(x) = 2^(x · log2 e): scores are kept in base 2.
    const float scale_log2 = scale * 1.4426950408889634f;

    int first_key = window > 0 ? max(0, start_position + t0 + 1 - window) : 0;
    int last_key = start_position + t_last;
    int tile_first = first_key / MMA_KEYS, tile_last = last_key / MMA_KEYS;
    mma_stage_keys<HD>(k_s, keys, tile_first * MMA_KEYS, last_key, kv_width, kv_head);
    mma_copies_commit();
    mma_stage_keys<HD>(v_s, values, tile_first * MMA_KEYS, last_key, kv_width, kv_head);
    mma_copies_commit();
    // q rows as bf16 (rows past the segment as 0), while the first tile lands.
    for (int i = tid; i < MMA_ROWS * (HD / 4); i += MMA_THREADS) {
        int r = i / (HD / 4), d = (i % (HD / 4)) * 4;
        int t = t0 + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (t < n)
            v = *reinterpret_cast<const float4*>(q + (long long)(row_start + t) * q_width +
                                                 (long long)head * HD + d);
        *reinterpret_cast<uint2*>(q_s + r * stride + d) =
            make_uint2(mma_pack_bf16x2(v.x, v.y), mma_pack_bf16x2(v.z, v.w));
    }

    // This thread's two rows: r_a = warp·16 + lane / 4 and r_a + 8 of the block.
    int r_a = warp * 16 + lane / 4;
    int t_rows[2] = {t0 + r_a, t0 + r_a + 8};
    int positions[2], firsts[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        positions[h] = start_position + t_rows[h];
        firsts[h] = window > 0 ? max(0, positions[h] + 1 - window) : 0;
    }
    float row_max[2] = {neg_inf, neg_inf}, row_sum[2] = {0.0f, 0.0f};
    float acc[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

    for (int tile = tile_first; tile <= tile_last; ++tile) {
        int key0 = tile * MMA_KEYS;
        bool more = tile < tile_last;
        mma_copies_wait<1>();  // this tile's K (its V may still be in flight)
        __syncthreads();       // … for every thread's copies; q_s stored
        float s[MMA_KEYS / 8][4];
        mma_tile_scores<HD, MMA_KEYS>(q_s, warp * 16, k_s, stride, lane, s);
        mma_online_softmax<HD, MMA_KEYS>(
            s, key0, lane, scale_log2,
            [&](int h, int key) {
                return t_rows[h] < n && key >= firsts[h] && key <= positions[h];
            },
            row_max, row_sum, acc);
        __syncthreads();  // every warp is done with the K tile
        if (more) {
            mma_stage_keys<HD>(k_s, keys, key0 + MMA_KEYS, last_key, kv_width, kv_head);
            mma_copies_commit();
            mma_copies_wait<1>();  // this tile's V
        } else {
            mma_copies_wait<0>();
        }
        __syncthreads();
        mma_add_pv<HD, MMA_KEYS>(s, v_s, stride, lane, acc);
        __syncthreads();  // every warp is done with the V tile
        if (more) {
            mma_stage_keys<HD>(v_s, values, key0 + MMA_KEYS, last_key, kv_width, kv_head);
            mma_copies_commit();
        }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float total = row_sum[h];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        if (t_rows[h] >= n) continue;
        float inverse = 1.0f / total;
        float* o = out + (long long)(row_start + t_rows[h]) * q_width + (long long)head * HD;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
            *reinterpret_cast<float2*>(o + j * 8 + 2 * (lane % 4)) =
                make_float2(acc[j][2 * h] * inverse, acc[j][2 * h + 1] * inverse);
        }
    }
}

// One kernel per head_dim (attention.rs picks it).
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    attention_mma_64(const float* q, const unsigned short* keys, const unsigned short* values,
                     float* out, int row_start, int n, int start_position, int heads,
                     int kv_heads, int window, float scale) {
    PDL_WAIT_AND_RELEASE();
    attention_mma_block<64>(q, keys, values, out, row_start, n, start_position, heads, kv_heads,
                            window, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    attention_mma_128(const float* q, const unsigned short* keys, const unsigned short* values,
                     float* out, int row_start, int n, int start_position, int heads,
                     int kv_heads, int window, float scale) {
    PDL_WAIT_AND_RELEASE();
    attention_mma_block<128>(q, keys, values, out, row_start, n, start_position, heads, kv_heads,
                            window, scale);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    attention_mma_256(const float* q, const unsigned short* keys, const unsigned short* values,
                     float* out, int row_start, int n, int start_position, int heads,
                     int kv_heads, int window, float scale) {
    PDL_WAIT_AND_RELEASE();
    attention_mma_block<256>(q, keys, values, out, row_start, n, start_position, heads, kv_heads,
                            window, scale);
}
