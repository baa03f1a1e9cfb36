// Decode attention over a bf16 KV cache with a GQA group's q heads spread across the lanes.
//
// The same split-K scheme, partials and combine as `attention_split_bf16` (attention.cu): one
// block per (chunk, kv head, row) writes, for every q head of the kv head's group, the
// unnormalised partial (max, Σ p, Σ p·v) of the chunk's keys, at the same index; the chunk is
// `split_chunk` of the row's position. What differs is the inner loop. The split kernel gives a
// lane one key and reads the q heads from shared memory, so each K element costs a shared-memory
// read per four multiply-adds and the kernel is bound by shared memory, not HBM (25–41% of the
// copy rate). Here lane l serves q head l / L of the group (L = 32 / the group rounded up to a
// power of two) and DPL = head_dim / L of its dims, held in registers with its accumulators:
// a key's score is DPL multiply-adds per lane and log2(L) shuffles, its value DPL more, and each
// 16-byte read of the staged K or V row (all lanes of a head part read the same bytes: a
// broadcast) feeds 8 of them.
//
// Lane l = head · L + part holds the dims of the 16-byte pieces part, part + L, part + 2L, …
// (8 dims each), so one read instruction of a warp touches L consecutive 16-byte pieces of a row:
// no bank conflict.
//
// Keys are staged by tiles of DECODE_TILE_BYTES of K (and as much V) with asynchronous copies,
// two tiles in flight: the next tile's copies are issued before this one is computed. Each of
// the DECODE_WARPS warps keeps an online softmax over its own quarter of every tile; at the end
// the warps' states are merged in warp order through shared memory. A fixed order everywhere:
// a row's bits depend only on its own position and cache, not on the batch.
//
// Not the split kernel's bits (the sums run in another order): held to the reference within f32
// rounding by the start-up check (device/attention.rs) and the GPU tests.

#include "common.cuh"
#include "attention_common.cuh"

#ifndef DECODE_WARPS
#define DECODE_WARPS 4
#endif
#define DECODE_THREADS (32 * DECODE_WARPS)
// Bytes of K staged per tile (as many of V): tile keys = DECODE_TILE_BYTES / (2 · head_dim).
#ifndef DECODE_TILE_BYTES
#define DECODE_TILE_BYTES 8192
#endif

extern __shared__ __align__(16) unsigned char decode_smem[];

// Eight bf16 (16 bytes) to f32, exactly.
__device__ __forceinline__ void widen8(uint4 bits, float* x) {
    unsigned int words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = __uint_as_float(words[i] << 16);
        x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// Stages keys [s0, s0 + len) of one kv head's K and V rows (hd bf16 each) into k_s, v_s
// ([tile][hd]), every copy issued without waiting.
__device__ __forceinline__ void decode_stage_tile(const unsigned short* keys,
                                                  const unsigned short* values, int s0, int len,
                                                  long long row_elements, int hd,
                                                  unsigned short* k_s, unsigned short* v_s) {
    int quads = hd / 8;  // 16-byte pieces of a row
    for (int i = threadIdx.x; i < len * quads; i += DECODE_THREADS) {
        int j = i / quads, w = (i - j * quads) * 8;
        long long row = (long long)(s0 + j) * row_elements + w;
        split_copy_quad(reinterpret_cast<unsigned int*>(k_s + j * hd + w),
                        reinterpret_cast<const unsigned int*>(keys + row));
        split_copy_quad(reinterpret_cast<unsigned int*>(v_s + j * hd + w),
                        reinterpret_cast<const unsigned int*>(values + row));
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// One (chunk blockIdx.x, kv head blockIdx.y) of the row at `position` whose q row is `q_row`
// (head dim HD, DPL dims per lane);
// its partials at part_row_base + (kv_head · group + h) · chunks + chunk. `keys`, `values`:
// the sequence's cache ([max_tokens, kv_heads · hd] bf16). Dynamic shared memory: 4 ·
// DECODE_TILE_BYTES (two tiles of K and V), which the end reuses for the warps' states
// (DECODE_WARPS · group_pow2 · hd floats + 2 · DECODE_WARPS · group_pow2).
template <int HD, int DPL>
__device__ __forceinline__ void attention_decode_block(
    const float* q, const unsigned short* keys, const unsigned short* values, float* part_o,
    float* part_ml, int q_row, int position, int heads, int kv_heads, int window, float scale,
    int chunk, int chunks, long long part_row_base) {
    constexpr int hd = HD;
    constexpr int lanes_per_head = HD / DPL;  // L; the host sends group ≤ 32 / L
    constexpr int tile = DECODE_TILE_BYTES / (2 * HD);
    constexpr int warp_keys = tile / DECODE_WARPS;
    static_assert(HD % DPL == 0 && DPL % 8 == 0 && lanes_per_head <= 32, "lane layout");
    static_assert(warp_keys >= 1, "a tile gives every warp a key");
    const float neg_inf = __int_as_float(0xff800000);
    int c = blockIdx.x, kv_head = blockIdx.y;
    int first = window > 0 ? max(0, position + 1 - window) : 0;
    int k0 = max(c * chunk, first);
    int k1 = min(c * chunk + chunk - 1, position);
    if (k0 > k1) return;  // the whole block: nothing of this row in this chunk

    int group = heads / kv_heads;
    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    int head = lane / lanes_per_head, part = lane % lanes_per_head;
    bool live_head = head < group;

    // q and the accumulators: dims (i · L + part) · 8 + e of the lane's head.
    float qr[DPL], acc[DPL];
    const float* query = q + (long long)q_row * heads * hd + (long long)(kv_head * group + head) * hd;
#pragma unroll
    for (int i = 0; i < DPL / 8; ++i) {
        int d = (i * lanes_per_head + part) * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            qr[i * 8 + e] = live_head ? query[d + e] : 0.0f;
            acc[i * 8 + e] = 0.0f;
        }
    }
    float running_max = neg_inf, running_sum = 0.0f;

    // Stage s: K at stages + 2·s·tile·hd, V after it.
    unsigned short* stages = reinterpret_cast<unsigned short*>(decode_smem);
    long long row_elements = (long long)kv_heads * hd;
    const unsigned short* head_keys = keys + (long long)kv_head * hd;
    const unsigned short* head_values = values + (long long)kv_head * hd;

    // Tiles start at the chunk's first key (aligned to absolute positions), from the one that
    // holds k0.
    int base = c * chunk;
    int s_first = base + (k0 - base) / tile * tile;
    decode_stage_tile(head_keys, head_values, s_first, min(tile, k1 - s_first + 1), row_elements,
                      hd, stages, stages + tile * hd);
    int stage = 0;
    for (int s0 = s_first; s0 <= k1; s0 += tile, stage ^= 1) {
        int next = s0 + tile;
        if (next <= k1) {
            unsigned short* other = stages + 2 * (stage ^ 1) * tile * hd;
            decode_stage_tile(head_keys, head_values, next, min(tile, k1 - next + 1),
                              row_elements, hd, other, other + tile * hd);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        __syncthreads();  // this tile visible to every warp

        const unsigned short* k_tile = stages + 2 * stage * tile * hd;
        const unsigned short* v_tile = k_tile + tile * hd;
        int j0 = warp * warp_keys;
        // Scores of the warp's keys (every lane of a head gets its head's score): the keys'
        // dot products advance together (independent chains), each summed in the same order.
        // Rows outside [k0, k1] (not staged: any bits) are scored too and masked after.
        float dot[warp_keys];
#pragma unroll
        for (int jj = 0; jj < warp_keys; ++jj) dot[jj] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL / 8; ++i) {
#pragma unroll
            for (int jj = 0; jj < warp_keys; ++jj) {
                float x[8];
                widen8(*reinterpret_cast<const uint4*>(k_tile + (j0 + jj) * hd +
                                                       (i * lanes_per_head + part) * 8),
                       x);
#pragma unroll
                for (int e = 0; e < 8; ++e) dot[jj] = fmaf(qr[i * 8 + e], x[e], dot[jj]);
            }
        }
        float score[warp_keys];
        float tile_max = neg_inf;
#pragma unroll
        for (int jj = 0; jj < warp_keys; ++jj) {
#pragma unroll
            for (int offset = 1; offset < lanes_per_head; offset <<= 1)
                dot[jj] += __shfl_xor_sync(0xffffffffu, dot[jj], offset);
            int key = s0 + j0 + jj;
            // The same for every lane of the warp: it depends only on the key.
            score[jj] = key >= k0 && key <= k1 ? dot[jj] * scale : neg_inf;
            tile_max = fmaxf(tile_max, score[jj]);
        }
        if (tile_max != neg_inf) {
            float new_max = fmaxf(running_max, tile_max);
            float correction = expf(running_max - new_max);  // 0 while the max was -inf
            running_sum *= correction;
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[e] *= correction;
            float p[warp_keys];
#pragma unroll
            for (int jj = 0; jj < warp_keys; ++jj) {
                p[jj] = score[jj] != neg_inf ? expf(score[jj] - new_max) : 0.0f;
                running_sum += p[jj];
            }
#pragma unroll
            for (int jj = 0; jj < warp_keys; ++jj) {
                if (score[jj] != neg_inf) {
                    const unsigned short* vr = v_tile + (j0 + jj) * hd;
#pragma unroll
                    for (int i = 0; i < DPL / 8; ++i) {
                        float x[8];
                        widen8(*reinterpret_cast<const uint4*>(vr + (i * lanes_per_head + part) * 8),
                               x);
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[i * 8 + e] = fmaf(p[jj], x[e], acc[i * 8 + e]);
                    }
                }
            }
            running_max = new_max;
        }
        __syncthreads();  // every warp done with this stage before it is staged again
    }

    // Merge the warps' states in warp order. The stages are free now (the last wait_group 0 and
    // barrier above).
    int group_lanes = 32 / lanes_per_head;  // heads a warp holds, the group rounded up
    float* state_o = reinterpret_cast<float*>(decode_smem);          // [warp][head][hd]
    float* state_ml = state_o + DECODE_WARPS * group_lanes * hd;    // [warp][head][2]
    float* warp_o = state_o + (long long)(warp * group_lanes + head) * hd;
#pragma unroll
    for (int i = 0; i < DPL / 8; ++i) {
        int d = (i * lanes_per_head + part) * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) warp_o[d + e] = acc[i * 8 + e];
    }
    if (part == 0) {
        state_ml[2 * (warp * group_lanes + head)] = running_max;
        state_ml[2 * (warp * group_lanes + head) + 1] = running_sum;
    }
    __syncthreads();
    for (int i = tid; i < group * hd; i += DECODE_THREADS) {
        int h = i / hd, d = i - h * hd;
        float top = neg_inf;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w)
            top = fmaxf(top, state_ml[2 * (w * group_lanes + h)]);
        float total = 0.0f, sum = 0.0f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) {
            float m = state_ml[2 * (w * group_lanes + h)];
            float weight = m == neg_inf ? 0.0f : expf(m - top);
            total += state_ml[2 * (w * group_lanes + h) + 1] * weight;
            sum += state_o[(long long)(w * group_lanes + h) * hd + d] * weight;
        }
        long long index = part_row_base + (long long)(kv_head * group + h) * chunks + c;
        part_o[index * hd + d] = sum;
        if (d == 0) {
            part_ml[2 * index] = top;
            part_ml[2 * index + 1] = total;
        }
    }
}

// One segment's rows: grid (chunks, kv_heads, n); the arguments of `attention_split_bf16` (the
// head dim is the kernel's: `hd` equals HD).
template <int HD, int DPL>
__device__ __forceinline__ void attention_decode_segment(
    const float* q, const unsigned short* keys, const unsigned short* values, float* part_o,
    float* part_ml, int row_start, int start_position, int heads, int kv_heads, int window,
    float scale, int chunk, int chunks, int part_base, const unsigned int* row_positions) {
    if (row_positions) {
        start_position = (int)row_positions[row_start];
        chunk = split_chunk(start_position + (int)gridDim.z - 1);
    }
    int t = blockIdx.z;
    attention_decode_block<HD, DPL>(q, keys, values, part_o, part_ml, row_start + t,
                                    start_position + t, heads, kv_heads, window, scale, chunk,
                                    chunks, (long long)part_base + (long long)t * heads * chunks);
}

// A batch of one-row segments: grid (chunks, kv_heads, n); the arguments of
// `attention_split_batched_bf16`.
template <int HD, int DPL>
__device__ __forceinline__ void attention_decode_rows(
    const float* q, float* part_o, float* part_ml, const DecodeRows& batch, int row_start,
    int heads, int kv_heads, int window, float scale, int chunks, int part_base,
    const unsigned int* row_positions) {
    int t = blockIdx.z;
    int position = decode_row_position(batch, row_start, t, row_positions);
    attention_decode_block<HD, DPL>(q, reinterpret_cast<const unsigned short*>(batch.keys[t]),
                                    reinterpret_cast<const unsigned short*>(batch.values[t]),
                                    part_o, part_ml, row_start + t, position, heads, kv_heads,
                                    window, scale, split_chunk(position), chunks,
                                    (long long)part_base + (long long)t * heads * chunks);
}

// The instantiations, attention_decode[_batched]_bf16_HD_DPL (`DECODE_SHAPES` in
// device/attention_decode.rs): head dim HD, DPL dims per lane, for groups of up to
// 32 · DPL / HD q heads per kv head. None with 64 dims per lane (head dim 256 with a group of
// 8, 128 with 16): on an H100 those measured slower than the split kernel at a 4K context
// (14.3 against 10.3 µs at head dim 256) and no faster in the whole step at 16K.

// DECODE_KERNELS(64, 16)
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_bf16_64_16(const float* q, const unsigned short* keys,
                              const unsigned short* values, float* part_o, float* part_ml,
                              int row_start, int start_position, int heads, int kv_heads, int hd,
                              int window, float scale, int chunk, int chunks, int part_base,
                              const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_segment<64, 16>(q, keys, values, part_o, part_ml, row_start,
                                    start_position, heads, kv_heads, window, scale, chunk,
                                    chunks, part_base, row_positions);
}
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_batched_bf16_64_16(const float* q, float* part_o, float* part_ml,
                                      DecodeRows batch, int row_start, int heads, int kv_heads,
                                      int hd, int window, float scale, int chunks, int part_base,
                                      const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_rows<64, 16>(q, part_o, part_ml, batch, row_start, heads, kv_heads,
                                 window, scale, chunks, part_base, row_positions);
}

// DECODE_KERNELS(64, 32)
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_bf16_64_32(const float* q, const unsigned short* keys,
                              const unsigned short* values, float* part_o, float* part_ml,
                              int row_start, int start_position, int heads, int kv_heads, int hd,
                              int window, float scale, int chunk, int chunks, int part_base,
                              const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_segment<64, 32>(q, keys, values, part_o, part_ml, row_start,
                                    start_position, heads, kv_heads, window, scale, chunk,
                                    chunks, part_base, row_positions);
}
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_batched_bf16_64_32(const float* q, float* part_o, float* part_ml,
                                      DecodeRows batch, int row_start, int heads, int kv_heads,
                                      int hd, int window, float scale, int chunks, int part_base,
                                      const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_rows<64, 32>(q, part_o, part_ml, batch, row_start, heads, kv_heads,
                                 window, scale, chunks, part_base, row_positions);
}

// DECODE_KERNELS(128, 16)
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_bf16_128_16(const float* q, const unsigned short* keys,
                              const unsigned short* values, float* part_o, float* part_ml,
                              int row_start, int start_position, int heads, int kv_heads, int hd,
                              int window, float scale, int chunk, int chunks, int part_base,
                              const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_segment<128, 16>(q, keys, values, part_o, part_ml, row_start,
                                    start_position, heads, kv_heads, window, scale, chunk,
                                    chunks, part_base, row_positions);
}
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_batched_bf16_128_16(const float* q, float* part_o, float* part_ml,
                                      DecodeRows batch, int row_start, int heads, int kv_heads,
                                      int hd, int window, float scale, int chunks, int part_base,
                                      const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_rows<128, 16>(q, part_o, part_ml, batch, row_start, heads, kv_heads,
                                 window, scale, chunks, part_base, row_positions);
}

// DECODE_KERNELS(128, 32)
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_bf16_128_32(const float* q, const unsigned short* keys,
                              const unsigned short* values, float* part_o, float* part_ml,
                              int row_start, int start_position, int heads, int kv_heads, int hd,
                              int window, float scale, int chunk, int chunks, int part_base,
                              const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_segment<128, 32>(q, keys, values, part_o, part_ml, row_start,
                                    start_position, heads, kv_heads, window, scale, chunk,
                                    chunks, part_base, row_positions);
}
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_batched_bf16_128_32(const float* q, float* part_o, float* part_ml,
                                      DecodeRows batch, int row_start, int heads, int kv_heads,
                                      int hd, int window, float scale, int chunks, int part_base,
                                      const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_rows<128, 32>(q, part_o, part_ml, batch, row_start, heads, kv_heads,
                                 window, scale, chunks, part_base, row_positions);
}

// DECODE_KERNELS(256, 32)
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_bf16_256_32(const float* q, const unsigned short* keys,
                              const unsigned short* values, float* part_o, float* part_ml,
                              int row_start, int start_position, int heads, int kv_heads, int hd,
                              int window, float scale, int chunk, int chunks, int part_base,
                              const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_segment<256, 32>(q, keys, values, part_o, part_ml, row_start,
                                    start_position, heads, kv_heads, window, scale, chunk,
                                    chunks, part_base, row_positions);
}
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    attention_decode_batched_bf16_256_32(const float* q, float* part_o, float* part_ml,
                                      DecodeRows batch, int row_start, int heads, int kv_heads,
                                      int hd, int window, float scale, int chunks, int part_base,
                                      const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    attention_decode_rows<256, 32>(q, part_o, part_ml, batch, row_start, heads, kv_heads,
                                 window, scale, chunks, part_base, row_positions);
}

// ---------------------------------------------------------------------------------------------
// Decode attention on the tensor cores: `attention_decode_mma_bf16_HD[_batched]`.
//
// The group's q heads (up to 16, padded with zero rows) are the 16 rows of an m16n8k16 tile, so
// a key's scores for the whole group are one column of S = Q·Kᵀ and O += P·V is one more
// product: the multiply-adds the lanes of the kernels above spend per key run on the tensor
// cores, and the kernel reads K and V at the rate it can stage them. Each warp takes one chunk
// of the row's keys (the same chunks, partials and combine as the split kernel: `split_chunk`),
// walks it in sub-tiles of DM_KEYS keys staged by its own asynchronous copies (two in flight),
// keeps an online softmax per q head (in base 2, like the prefill kernel), and writes the
// chunk's partial with the max in natural units. A block's DM_WARPS warps take consecutive
// chunks of one (kv head, row) and share its q, rounded to bf16 once; P is rounded to bf16 for
// the second product, as in the prefill kernel. Not the bits of the f32 kernels: held to the
// reference within bf16 tolerances (start-up check, GPU tests).

// Warps (chunks) per block: DM_WARPS at head dims 64 and 128, DM_WARPS_256 at 256 (whose
// stages are twice the bytes: two warps keep a block within an RTX card's 99 KB).
#ifndef DM_WARPS
#define DM_WARPS 4
#endif
#ifndef DM_WARPS_256
#define DM_WARPS_256 2
#endif
#ifndef DM_KEYS
#define DM_KEYS 16
#endif
// 0 (what the engine compiles): a partial per warp, one chunk each. 1 (a kernel-bench variant):
// a block's warps split one chunk of WARPS times the keys and merge before writing its
// partial, so the combine reads WARPS times fewer; the host passes that chunk and launches a
// block per chunk (the in-kernel chunking of step graphs is the per-warp one).
#ifndef DM_MERGE
#define DM_MERGE 0
#endif
// bf16 of padding per staged row (as MMA_PAD in attention.cu): ldmatrix rows on distinct banks.
#define DM_PAD 8

// Dynamic shared memory of a block (bytes): q (16 rows), then per warp two stages of K and V.
__host__ __device__ constexpr int decode_mma_smem_bytes(int hd, int warps) {
    return (16 + warps * 2 * 2 * DM_KEYS) * (hd + DM_PAD) * 2;
}

// Stages keys [key0, key0 + DM_KEYS) of one kv head into a warp's K and V stage (rows past
// `last_key` zero-filled: 0 · NaN would poison P·V).
template <int HD>
__device__ __forceinline__ void decode_mma_stage(const unsigned short* keys,
                                                 const unsigned short* values, int key0,
                                                 int last_key, long long row_elements,
                                                 unsigned short* k_s, unsigned short* v_s,
                                                 int lane) {
    constexpr int pieces = HD / 8;  // 16-byte copies per row
    for (int i = lane; i < DM_KEYS * pieces; i += 32) {
        int j = i / pieces, w = (i - j * pieces) * 8;
        int key = key0 + j;
        bool valid = key <= last_key;
        long long at = valid ? (long long)key * row_elements + w : 0;
        mma_copy_16(k_s + j * (HD + DM_PAD) + w, keys + at, valid);
        mma_copy_16(v_s + j * (HD + DM_PAD) + w, values + at, valid);
    }
    mma_copies_commit();
}

// The group's q rows of `query` (16 rows, those past `group` zero) as bf16 into `q_s`; every
// thread of the block takes part (no barrier here).
template <int HD, int WARPS>
__device__ __forceinline__ void decode_mma_stage_q(const float* query, int group,
                                                   unsigned short* q_s) {
    constexpr int stride = HD + DM_PAD;
    for (int i = threadIdx.x; i < 16 * (HD / 4); i += 32 * WARPS) {
        int r = i / (HD / 4), d = (i - r * (HD / 4)) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < group) v = *reinterpret_cast<const float4*>(query + (long long)r * HD + d);
        *reinterpret_cast<uint2*>(q_s + r * stride + d) =
            make_uint2(mma_pack_bf16x2(v.x, v.y), mma_pack_bf16x2(v.z, v.w));
    }
}

// One warp's online softmax over keys [k0, k1] of one kv head (k0 ≤ k1), walked in sub-tiles
// of DM_KEYS keys aligned to `base` (an absolute position, a multiple of DM_KEYS): the lane's
// two q heads lane / 4 and lane / 4 + 8 get their running max (base 2), their share of the sum
// (the quad's lanes add up) and Σ p·v over the lane's columns.
template <int HD>
__device__ __forceinline__ void decode_mma_warp_keys(
    const unsigned short* q_s, const unsigned short* head_keys,
    const unsigned short* head_values, unsigned short* stages, long long row_elements, int base,
    int k0, int k1, float scale_log2, int lane, float (&row_max)[2], float (&row_sum)[2],
    float (&acc)[HD / 8][4]) {
    constexpr int stride = HD + DM_PAD;
    int s_first = base + (k0 - base) / DM_KEYS * DM_KEYS;
    decode_mma_stage<HD>(head_keys, head_values, s_first, k1, row_elements, stages,
                         stages + DM_KEYS * stride, lane);
    int stage = 0;
    for (int key0 = s_first; key0 <= k1; key0 += DM_KEYS, stage ^= 1) {
        if (key0 + DM_KEYS <= k1) {
            unsigned short* other = stages + (stage ^ 1) * 2 * DM_KEYS * stride;
            decode_mma_stage<HD>(head_keys, head_values, key0 + DM_KEYS, k1, row_elements, other,
                                 other + DM_KEYS * stride, lane);
            mma_copies_wait<1>();
        } else {
            mma_copies_wait<0>();
        }
        __syncwarp();  // every lane's copies of this sub-tile visible to the warp
        const unsigned short* k_s = stages + stage * 2 * DM_KEYS * stride;
        const unsigned short* v_s = k_s + DM_KEYS * stride;

        float s[DM_KEYS / 8][4];
        mma_tile_scores<HD, DM_KEYS>(q_s, 0, k_s, stride, lane, s);
        mma_online_softmax<HD, DM_KEYS>(
            s, key0, lane, scale_log2, [&](int, int key) { return key >= k0 && key <= k1; },
            row_max, row_sum, acc);
        mma_add_pv<HD, DM_KEYS>(s, v_s, stride, lane, acc);
        __syncwarp();  // the warp is done with this stage before it is staged again
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
        row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
    }
}

#if DM_MERGE == 0
// One block of WARPS warps: chunks blockIdx.x · WARPS + warp of kv head blockIdx.y of the row at
// `position` whose q row is `q_row`; partials at part_row_base + (kv_head · group + h) · chunks
// + chunk.
template <int HD, int WARPS>
__device__ __forceinline__ void attention_decode_mma_block(
    const float* q, const unsigned short* keys, const unsigned short* values, float* part_o,
    float* part_ml, int q_row, int position, int heads, int kv_heads, int window, float scale,
    int chunk, int chunks, long long part_row_base) {
    constexpr int stride = HD + DM_PAD;
    static_assert(DM_KEYS % 16 == 0, "sub-tiles of whole 16-key steps");
    const float neg_inf = __int_as_float(0xff800000);
    int kv_head = blockIdx.y, group = heads / kv_heads;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned short* q_s = reinterpret_cast<unsigned short*>(decode_smem);
    decode_mma_stage_q<HD, WARPS>(
        q + (long long)q_row * heads * HD + (long long)kv_head * group * HD, group, q_s);
    __syncthreads();

    int c = blockIdx.x * WARPS + warp;
    int first = window > 0 ? max(0, position + 1 - window) : 0;
    int k0 = max(c * chunk, first);
    int k1 = min(c * chunk + chunk - 1, position);
    if (c >= chunks || k0 > k1) return;  // this warp: nothing of the row in its chunk

    float row_max[2] = {neg_inf, neg_inf}, row_sum[2] = {0.0f, 0.0f};
    float acc[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    decode_mma_warp_keys<HD>(q_s, keys + (long long)kv_head * HD, values + (long long)kv_head * HD,
                             q_s + 16 * stride + warp * 2 * 2 * DM_KEYS * stride,
                             (long long)kv_heads * HD, c * chunk, k0, k1,
                             scale * 1.4426950408889634f, lane, row_max, row_sum, acc);

    // The chunk's partial of each live q head: max in natural units (the combine's expf).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int r = lane / 4 + 8 * h;
        if (r >= group) continue;
        long long index = part_row_base + (long long)(kv_head * group + r) * chunks + c;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j)
            *reinterpret_cast<float2*>(part_o + index * HD + j * 8 + 2 * (lane % 4)) =
                make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
        if (lane % 4 == 0) {
            part_ml[2 * index] = row_max[h] * 0.6931471805599453f;
            part_ml[2 * index + 1] = row_sum[h];
        }
    }
}
#else
// DM_MERGE: one block per chunk of the combine's (blockIdx.x), its WARPS warps splitting it
// into WARPS equal parts (chunk a multiple of WARPS · DM_KEYS), merged in the block in warp
// order before the one partial is written: the combine reads WARPS times fewer partials.
template <int HD, int WARPS>
__device__ __forceinline__ void attention_decode_mma_block(
    const float* q, const unsigned short* keys, const unsigned short* values, float* part_o,
    float* part_ml, int q_row, int position, int heads, int kv_heads, int window, float scale,
    int chunk, int chunks, long long part_row_base) {
    constexpr int stride = HD + DM_PAD;
    const float neg_inf = __int_as_float(0xff800000);
    int kv_head = blockIdx.y, group = heads / kv_heads;
    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    int c = blockIdx.x;
    int first = window > 0 ? max(0, position + 1 - window) : 0;
    if (c >= chunks || max(c * chunk, first) > min(c * chunk + chunk - 1, position)) return;
    unsigned short* q_s = reinterpret_cast<unsigned short*>(decode_smem);
    decode_mma_stage_q<HD, WARPS>(
        q + (long long)q_row * heads * HD + (long long)kv_head * group * HD, group, q_s);
    __syncthreads();

    int part = chunk / WARPS;
    int base = c * chunk + warp * part;
    int k0 = max(base, first), k1 = min(base + part - 1, position);
    float row_max[2] = {neg_inf, neg_inf}, row_sum[2] = {0.0f, 0.0f};
    float acc[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    if (k0 <= k1)
        decode_mma_warp_keys<HD>(q_s, keys + (long long)kv_head * HD,
                                 values + (long long)kv_head * HD,
                                 q_s + 16 * stride + warp * 2 * 2 * DM_KEYS * stride,
                                 (long long)kv_heads * HD, base, k0, k1,
                                 scale * 1.4426950408889634f, lane, row_max, row_sum, acc);
    __syncthreads();  // every warp's copies done: the stages (and q) are free
    float* merge_o = reinterpret_cast<float*>(decode_smem);  // [warp][16][HD]
    float* merge_ml = merge_o + WARPS * 16 * HD;             // [warp][16][2]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int r = lane / 4 + 8 * h;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j)
            *reinterpret_cast<float2*>(merge_o + (warp * 16 + r) * HD + j * 8 + 2 * (lane % 4)) =
                make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
        if (lane % 4 == 0) {
            merge_ml[2 * (warp * 16 + r)] = row_max[h];
            merge_ml[2 * (warp * 16 + r) + 1] = row_sum[h];
        }
    }
    __syncthreads();
    for (int i = tid; i < group * HD; i += 32 * WARPS) {
        int r = i / HD, d = i - r * HD;
        float top = neg_inf;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, merge_ml[2 * (w * 16 + r)]);
        float total = 0.0f, sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            float m = merge_ml[2 * (w * 16 + r)];
            float weight = m == neg_inf ? 0.0f : exp2f(m - top);
            total += merge_ml[2 * (w * 16 + r) + 1] * weight;
            sum += merge_o[(w * 16 + r) * HD + d] * weight;
        }
        long long index = part_row_base + (long long)(kv_head * group + r) * chunks + c;
        part_o[index * HD + d] = sum;
        if (d == 0) {
            part_ml[2 * index] = top * 0.6931471805599453f;
            part_ml[2 * index + 1] = total;
        }
    }
}
#endif

// The instantiations, attention_decode_mma[_batched]_bf16_HD (`DECODE_MMA_HEAD_DIMS` in
// device/attention_decode.rs): grid (ceil(chunks / W), kv_heads, n), 32 · W threads and
// decode_mma_smem_bytes(HD, W) of dynamic shared memory, W the head dim's warps; the arguments
// of the kernels above.

// DECODE_MMA_KERNELS(64)
extern "C" __global__ void __launch_bounds__(32 * DM_WARPS)
    attention_decode_mma_bf16_64(const float* q, const unsigned short* keys,
                                 const unsigned short* values, float* part_o, float* part_ml,
                                 int row_start, int start_position, int heads, int kv_heads, int hd,
                                 int window, float scale, int chunk, int chunks, int part_base,
                                 const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    if (row_positions) {
        start_position = (int)row_positions[row_start];
        chunk = split_chunk(start_position + (int)gridDim.z - 1);
    }
    int t = blockIdx.z;
    attention_decode_mma_block<64, DM_WARPS>(q, keys, values, part_o, part_ml, row_start + t,
                                   start_position + t, heads, kv_heads, window, scale, chunk,
                                   chunks, (long long)part_base + (long long)t * heads * chunks);
}
extern "C" __global__ void __launch_bounds__(32 * DM_WARPS)
    attention_decode_mma_batched_bf16_64(const float* q, float* part_o, float* part_ml,
                                         DecodeRows batch, int row_start, int heads, int kv_heads,
                                         int hd, int window, float scale, int chunks,
                                         int part_base, const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    int t = blockIdx.z;
    int position = decode_row_position(batch, row_start, t, row_positions);
    attention_decode_mma_block<64, DM_WARPS>(q, reinterpret_cast<const unsigned short*>(batch.keys[t]),
                                   reinterpret_cast<const unsigned short*>(batch.values[t]),
                                   part_o, part_ml, row_start + t, position, heads, kv_heads,
                                   window, scale, split_chunk(position), chunks,
                                   (long long)part_base + (long long)t * heads * chunks);
}

// DECODE_MMA_KERNELS(128)
extern "C" __global__ void __launch_bounds__(32 * DM_WARPS)
    attention_decode_mma_bf16_128(const float* q, const unsigned short* keys,
                                 const unsigned short* values, float* part_o, float* part_ml,
                                 int row_start, int start_position, int heads, int kv_heads, int hd,
                                 int window, float scale, int chunk, int chunks, int part_base,
                                 const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    if (row_positions) {
        start_position = (int)row_positions[row_start];
        chunk = split_chunk(start_position + (int)gridDim.z - 1);
    }
    int t = blockIdx.z;
    attention_decode_mma_block<128, DM_WARPS>(q, keys, values, part_o, part_ml, row_start + t,
                                   start_position + t, heads, kv_heads, window, scale, chunk,
                                   chunks, (long long)part_base + (long long)t * heads * chunks);
}
extern "C" __global__ void __launch_bounds__(32 * DM_WARPS)
    attention_decode_mma_batched_bf16_128(const float* q, float* part_o, float* part_ml,
                                         DecodeRows batch, int row_start, int heads, int kv_heads,
                                         int hd, int window, float scale, int chunks,
                                         int part_base, const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    int t = blockIdx.z;
    int position = decode_row_position(batch, row_start, t, row_positions);
    attention_decode_mma_block<128, DM_WARPS>(q, reinterpret_cast<const unsigned short*>(batch.keys[t]),
                                   reinterpret_cast<const unsigned short*>(batch.values[t]),
                                   part_o, part_ml, row_start + t, position, heads, kv_heads,
                                   window, scale, split_chunk(position), chunks,
                                   (long long)part_base + (long long)t * heads * chunks);
}

// DECODE_MMA_KERNELS(256)
extern "C" __global__ void __launch_bounds__(32 * DM_WARPS_256)
    attention_decode_mma_bf16_256(const float* q, const unsigned short* keys,
                                 const unsigned short* values, float* part_o, float* part_ml,
                                 int row_start, int start_position, int heads, int kv_heads, int hd,
                                 int window, float scale, int chunk, int chunks, int part_base,
                                 const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    if (row_positions) {
        start_position = (int)row_positions[row_start];
        chunk = split_chunk(start_position + (int)gridDim.z - 1);
    }
    int t = blockIdx.z;
    attention_decode_mma_block<256, DM_WARPS_256>(q, keys, values, part_o, part_ml, row_start + t,
                                   start_position + t, heads, kv_heads, window, scale, chunk,
                                   chunks, (long long)part_base + (long long)t * heads * chunks);
}
extern "C" __global__ void __launch_bounds__(32 * DM_WARPS_256)
    attention_decode_mma_batched_bf16_256(const float* q, float* part_o, float* part_ml,
                                         DecodeRows batch, int row_start, int heads, int kv_heads,
                                         int hd, int window, float scale, int chunks,
                                         int part_base, const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    int t = blockIdx.z;
    int position = decode_row_position(batch, row_start, t, row_positions);
    attention_decode_mma_block<256, DM_WARPS_256>(q, reinterpret_cast<const unsigned short*>(batch.keys[t]),
                                   reinterpret_cast<const unsigned short*>(batch.values[t]),
                                   part_o, part_ml, row_start + t, position, heads, kv_heads,
                                   window, scale, split_chunk(position), chunks,
                                   (long long)part_base + (long long)t * heads * chunks);
}
