// The Qwen3.5 vision tower's own kernels (services/engine/src/backend/cuda/device/vision.rs runs
// the tower; docs/MODELS.md §10.5 has the math). The residual stream stays f32. A tower of bf16
// weights gives every matrix product bf16 inputs on the tensor cores with f32 accumulation
// (cuBLAS for the linear layers, `vision_attention_{16,…}` here), so the kernels below also
// write the bf16 copies the next product reads; a tower of f32 weights runs the `*_f32` forms,
// f32 inputs throughout (cuBLAS f32, `vision_attention_f32`).
//
// * `vision_patch_positions` — after the patch embedding's GEMM: its bias, then the learned
//   position embeddings blended by the four bilinear taps the host computed per patch row.
// * `vision_layer_norm` — one warp per row: first adds a bias still owed to the residual (a
//   linear layer whose GEMM accumulated into it; zeros where none is), then LayerNorm (biased
//   variance) → bf16.
// * `vision_rope_pack` — the qkv GEMM's output plus its bias; q and k turned by their patch's
//   2-D angles (rotate-half over the whole head); q, k, v as bf16 `[heads, rows, HDP]`, each head
//   zero-padded to HDP (a multiple of 16, the tensor cores' k step).
// * `vision_attention_{16,32,64,80,128}` — flash-attention-2 on `mma.sync.m16n8k16` over those
//   padded heads: a block of VA_WARPS warps takes 16 · VA_WARPS · tiles query rows of one head
//   (each warp `tiles` row tiles of 16, so every K and V fragment it reads from shared memory
//   serves that many tiles: VA_TILES_NARROW for heads up to 80 wide, VA_TILES_WIDE beyond,
//   where the accumulators would not fit the registers) and walks key tiles of VA_KEYS, K and V
//   staged with asynchronous copies; each row sees only the keys of its own image
//   (`[first_key[row], end_key[row])`; a key tile inside every row's image skips the mask), no
//   causal mask. Online softmax in f32, p rounded to bf16 for P·V. Writes bf16
//   `[rows, heads · hd]` (the projection's input).
// * `vision_bias_gelu` — a GEMM's output plus bias through GELU (tanh or exact) → bf16.
// * `vision_add_bias` — a GEMM's output plus bias, in place.

#include "common.cuh"
#include "mma_common.cuh"

// LayerNorm: warps per block (one row each).
#define VLN_WARPS 8

// f32 attention: warps per block (one row each), head dims per lane (heads up to 128).
#define VAF_WARPS 8
#define VAF_DIMS_PER_LANE 4

// Attention tiles.
#define VA_KEYS 64
#define VA_WARPS 4
#define VA_THREADS (VA_WARPS * 32)
// Row tiles of 16 per warp: heads padded to at most 80, and wider.
#define VA_TILES_NARROW 2
#define VA_TILES_WIDE 1
// bf16 of padding per staged row: rows 16·(HDP / 8 + 1) bytes apart put the 8 rows an ldmatrix
// reads on distinct banks.
#define VA_PAD 8

// The row-wise kernels below take one block per row (grid x = rows), their threads striding
// over its columns: no index division per element.

// x[r, c] += bias[c] + Σ_t weight[r, t] · table[index[r, t], c] (four taps, summed in order, as
// the host reference does).
extern "C" __global__ void vision_patch_positions(float* x, const float* bias, const float* table,
                                                  const unsigned int* tap_index,
                                                  const float* tap_weight, int hidden) {
    PDL_WAIT_AND_RELEASE();
    long long r = blockIdx.x;
    float* xr = x + r * hidden;
    const float* rows[4];
    float weights[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        rows[t] = table + (long long)tap_index[r * 4 + t] * hidden;
        weights[t] = tap_weight[r * 4 + t];
    }
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float position = 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) position += rows[t][c] * weights[t];
        xr[c] = (xr[c] + bias[c]) + position;
    }
}

// A product's input as the tower's precision stores it: bf16 bits (nearest even) or f32.
__device__ __forceinline__ void store_input(unsigned short* p, float v) { *p = f32_to_bf16_bits(v); }
__device__ __forceinline__ void store_input(float* p, float v) { *p = v; }

// One warp per row of x ([rows, width] f32): x += owed (zeros where nothing is owed; written
// back), then out = (x − mean) / sqrt(var + eps) · weight + bias. Statistics in f32 over the
// lanes' partial sums.
template <typename Out>
__device__ void vision_layer_norm_rows(float* x, const float* owed, const float* weight,
                                       const float* bias, Out* out, int rows, int width,
                                       float eps) {
    int row = blockIdx.x * VLN_WARPS + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    float* xr = x + (long long)row * width;
    float sum = 0.0f;
    for (int c = lane; c < width; c += 32) {
        float v = xr[c] + owed[c];
        xr[c] = v;
        sum += v;
    }
    float mean = warp_sum(sum) / (float)width;
    float squares = 0.0f;
    for (int c = lane; c < width; c += 32) {
        float d = xr[c] - mean;
        squares += d * d;
    }
    float scale = rsqrtf(warp_sum(squares) / (float)width + eps);
    Out* o = out + (long long)row * width;
    for (int c = lane; c < width; c += 32)
        store_input(o + c, (xr[c] - mean) * scale * weight[c] + bias[c]);
}

extern "C" __global__ void vision_layer_norm(float* x, const float* owed, const float* weight,
                                             const float* bias, unsigned short* out, int rows,
                                             int width, float eps) {
    PDL_WAIT_AND_RELEASE();
    vision_layer_norm_rows(x, owed, weight, bias, out, rows, width, eps);
}

extern "C" __global__ void vision_layer_norm_f32(float* x, const float* owed,
                                                 const float* weight, const float* bias,
                                                 float* out, int rows, int width, float eps) {
    PDL_WAIT_AND_RELEASE();
    vision_layer_norm_rows(x, owed, weight, bias, out, rows, width, eps);
}

// qkv: [rows, 3 · heads · hd] f32 (q, then k, then v); cos, sin: [rows, hd / 2]. One block per
// row, its threads over (part, head, padded dim); writes q, k, v as [heads, rows, hdp].
template <typename Out>
__device__ void vision_rope_pack_row(const float* qkv, const float* qkv_bias,
                                     const float* cos_table, const float* sin_table, Out* q,
                                     Out* k, Out* v, int rows, int heads, int hd, int hdp) {
    int row = blockIdx.x;
    int hidden = heads * hd, half = hd / 2, per_part = heads * hdp;
    const float* x = qkv + (long long)row * 3 * hidden;
    const float* cos_row = cos_table + (long long)row * half;
    const float* sin_row = sin_table + (long long)row * half;
    for (int i = threadIdx.x; i < 3 * per_part; i += blockDim.x) {
        int part = i / per_part, within = i - part * per_part;
        int head = within / hdp, d = within - head * hdp;
        float value = 0.0f;
        if (d < hd) {
            int base = part * hidden + head * hd;
            float a = x[base + d] + qkv_bias[base + d];
            if (part == 2) {
                value = a;
            } else if (d < half) {
                float partner = x[base + d + half] + qkv_bias[base + d + half];
                value = a * cos_row[d] - partner * sin_row[d];
            } else {
                float partner = x[base + d - half] + qkv_bias[base + d - half];
                value = a * cos_row[d - half] + partner * sin_row[d - half];
            }
        }
        Out* out = part == 0 ? q : (part == 1 ? k : v);
        store_input(out + ((long long)head * rows + row) * hdp + d, value);
    }
}

extern "C" __global__ void vision_rope_pack(const float* qkv, const float* qkv_bias,
                                            const float* cos_table, const float* sin_table,
                                            unsigned short* q, unsigned short* k,
                                            unsigned short* v, int rows, int heads, int hd,
                                            int hdp) {
    PDL_WAIT_AND_RELEASE();
    vision_rope_pack_row(qkv, qkv_bias, cos_table, sin_table, q, k, v, rows, heads, hd, hdp);
}

extern "C" __global__ void vision_rope_pack_f32(const float* qkv, const float* qkv_bias,
                                                const float* cos_table, const float* sin_table,
                                                float* q, float* k, float* v, int rows, int heads,
                                                int hd, int hdp) {
    PDL_WAIT_AND_RELEASE();
    vision_rope_pack_row(qkv, qkv_bias, cos_table, sin_table, q, k, v, rows, heads, hd, hdp);
}

// GELU of (y + bias) per row of `width`: the tanh form (`gelu_pytorch_tanh`) or the exact one
// (`nn.GELU()`).
template <typename Out>
__device__ void vision_bias_gelu_row(const float* y, const float* bias, Out* out, int width,
                                     int exact) {
    long long offset = (long long)blockIdx.x * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float x = y[offset + c] + bias[c];
        float g;
        if (exact) {
            g = 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        } else {
            g = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        }
        store_input(out + offset + c, g);
    }
}

extern "C" __global__ void vision_bias_gelu(const float* y, const float* bias, unsigned short* out,
                                            int width, int exact) {
    PDL_WAIT_AND_RELEASE();
    vision_bias_gelu_row(y, bias, out, width, exact);
}

extern "C" __global__ void vision_bias_gelu_f32(const float* y, const float* bias, float* out,
                                                int width, int exact) {
    PDL_WAIT_AND_RELEASE();
    vision_bias_gelu_row(y, bias, out, width, exact);
}

// Attention within each image in f32 (the f32 precision: towers whose weights are f32): one
// warp per (row, head) walks the row's keys in order with an online softmax, each lane holding
// dims lane, lane + 32, … of the head (at most VAF_DIMS_PER_LANE). q, k, v: f32
// [heads, rows, hd]; out: f32 [rows, heads · hd]. Grid: x = groups of VAF_WARPS rows, y = head.
template <int N>
__device__ __forceinline__ void vaf_load(float (&r)[N], const float* p, int lane, int hd) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        int d = lane + 32 * i;
        r[i] = d < hd ? p[d] : 0.0f;
    }
}

extern "C" __global__ void vision_attention_f32(const float* q, const float* k, const float* v,
                                                const unsigned int* first_key,
                                                const unsigned int* end_key, float* out,
                                                int rows, int heads, int hd, float scale) {
    PDL_WAIT_AND_RELEASE();
    int row = blockIdx.x * VAF_WARPS + threadIdx.x / 32;
    int lane = threadIdx.x % 32, head = blockIdx.y;
    if (row >= rows) return;
    long long head_offset = (long long)head * rows * hd;
    float qr[VAF_DIMS_PER_LANE], acc[VAF_DIMS_PER_LANE];
    vaf_load(qr, q + head_offset + (long long)row * hd, lane, hd);
#pragma unroll
    for (int i = 0; i < VAF_DIMS_PER_LANE; ++i) acc[i] = 0.0f;
    float running_max = __int_as_float(0xff800000), total = 0.0f;
    for (int key = (int)first_key[row]; key < (int)end_key[row]; ++key) {
        float kr[VAF_DIMS_PER_LANE], vr[VAF_DIMS_PER_LANE];
        vaf_load(kr, k + head_offset + (long long)key * hd, lane, hd);
        vaf_load(vr, v + head_offset + (long long)key * hd, lane, hd);
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < VAF_DIMS_PER_LANE; ++i) dot += qr[i] * kr[i];
        float score = warp_sum(dot) * scale;
        float new_max = fmaxf(running_max, score);
        float correction = expf(running_max - new_max);
        float p = expf(score - new_max);
        total = total * correction + p;
#pragma unroll
        for (int i = 0; i < VAF_DIMS_PER_LANE; ++i) acc[i] = acc[i] * correction + p * vr[i];
        running_max = new_max;
    }
    float* o = out + (long long)row * heads * hd + (long long)head * hd;
#pragma unroll
    for (int i = 0; i < VAF_DIMS_PER_LANE; ++i) {
        int d = lane + 32 * i;
        if (d < hd) o[d] = acc[i] / total;
    }
}

// y += bias per row of `width`, in place.
extern "C" __global__ void vision_add_bias(float* y, const float* bias, int width) {
    PDL_WAIT_AND_RELEASE();
    long long offset = (long long)blockIdx.x * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) y[offset + c] += bias[c];
}

// ---------------------------------------------------------------------------------------------
// Attention within each image on the tensor cores.

extern __shared__ __align__(16) unsigned char vision_smem[];

// Stages `count` rows from row0 of one head of a packed [rows, HDP] bf16 part (rows past `rows`
// as 0).
template <int HDP>
__device__ __forceinline__ void va_stage(unsigned short* tile, const unsigned short* part,
                                         int row0, int count, int rows) {
    const int chunks = HDP / 8;  // 16-byte copies per row
    for (int i = threadIdx.x; i < count * chunks; i += VA_THREADS) {
        int j = i / chunks, c = (i % chunks) * 8;
        int row = row0 + j;
        bool valid = row < rows;
        const unsigned short* from = part + (valid ? (long long)row * HDP + c : 0);
        mma_copy_16(tile + j * (HDP + VA_PAD) + c, from, valid);
    }
}

// Grid: x = block of 16 · VA_WARPS · MT query rows, y = head. VA_THREADS threads. Dynamic shared
// memory (16 · VA_WARPS · MT + 2 · VA_KEYS) · (HDP + VA_PAD) bf16 (q, the K tile, the V tile).
template <int HDP, int MT>
__device__ void vision_attention_block(const unsigned short* q, const unsigned short* k,
                                       const unsigned short* v, const unsigned int* first_key,
                                       const unsigned int* end_key, unsigned short* out, int rows,
                                       int heads, int hd, float scale) {
    const int stride = HDP + VA_PAD;
    const int block_rows = 16 * VA_WARPS * MT;
    unsigned short* q_s = reinterpret_cast<unsigned short*>(vision_smem);
    unsigned short* k_s = q_s + block_rows * stride;
    unsigned short* v_s = k_s + VA_KEYS * stride;

    int head = blockIdx.y;
    int t0 = blockIdx.x * block_rows;
    if (t0 >= rows) return;
    int t_last = min(t0 + block_rows, rows) - 1;
    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const float neg_inf = __int_as_float(0xff800000);
    // exp(x) = 2^(x · log2 e): scores are kept in base 2.
    const float scale_log2 = scale * 1.4426950408889634f;
    long long head_offset = (long long)head * rows * HDP;
    const unsigned short* q_head = q + head_offset;
    const unsigned short* k_head = k + head_offset;
    const unsigned short* v_head = v + head_offset;

    // Segments are consecutive: the block's keys run from its first row's first key to its last
    // row's end, and a key tile within [its last row's first key, its first row's end) is
    // visible to every row of the block.
    int block_first = (int)first_key[t0], block_end = (int)end_key[t_last];
    int common_first = (int)first_key[t_last], common_end = (int)end_key[t0];
    int tile_first = block_first / VA_KEYS, tile_last = (block_end - 1) / VA_KEYS;
    va_stage<HDP>(q_s, q_head, t0, block_rows, rows);
    va_stage<HDP>(k_s, k_head, tile_first * VA_KEYS, VA_KEYS, rows);
    mma_copies_commit();
    va_stage<HDP>(v_s, v_head, tile_first * VA_KEYS, VA_KEYS, rows);
    mma_copies_commit();

    // Row tile m of this warp holds block rows (warp · MT + m) · 16 + lane / 4 (half h = 0)
    // and 8 more (h = 1).
    int t_rows[MT][2], firsts[MT][2], ends[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int t = t0 + (warp * MT + m) * 16 + lane / 4 + 8 * h;
            bool live = t < rows;
            t_rows[m][h] = t;
            firsts[m][h] = live ? (int)first_key[t] : 0;
            ends[m][h] = live ? (int)end_key[t] : 0;
        }
    float row_max[MT][2], row_sum[MT][2];
    float acc[MT][HDP / 8][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) row_max[m][h] = neg_inf, row_sum[m][h] = 0.0f;
#pragma unroll
        for (int j = 0; j < HDP / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.0f;
    }

    for (int tile = tile_first; tile <= tile_last; ++tile) {
        int key0 = tile * VA_KEYS;
        bool more = tile < tile_last;
        bool unmasked = key0 >= common_first && key0 + VA_KEYS <= common_end;
        mma_copies_wait<1>();     // q and this tile's K (its V may still be in flight)
        __syncthreads();  // … for every thread's copies
        float s[MT][VA_KEYS / 8][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < VA_KEYS / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[m][j][e] = 0.0f;
#pragma unroll
        for (int kd = 0; kd < HDP; kd += 16) {
            unsigned int a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
                mma_ldmatrix_x4(a[m], q_s + ((warp * MT + m) * 16 + (lane & 15)) * stride + kd +
                                         (lane >> 4) * 8);
#pragma unroll
            for (int jj = 0; jj < VA_KEYS / 16; ++jj) {
                unsigned int b[4];
                mma_ldmatrix_x4(b, k_s + (jj * 16 + (lane & 7) + ((lane >> 4) << 3)) * stride +
                                      kd + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    mma_m16n8k16(s[m][2 * jj], a[m], b[0], b[1]);
                    mma_m16n8k16(s[m][2 * jj + 1], a[m], b[2], b[3]);
                }
            }
        }
        // Mask, scale, online softmax: row (m, h)'s values are s[m][j][2h], s[m][j][2h + 1],
        // spread over the 4 lanes of a quad.
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            mma_online_softmax<HDP, VA_KEYS>(
                s[m], key0, lane, scale_log2,
                [&](int h, int key) {
                    return unmasked || (key >= firsts[m][h] && key < ends[m][h]);
                },
                row_max[m], row_sum[m], acc[m]);
        }
        __syncthreads();  // every warp is done with the K tile
        if (more) {
            va_stage<HDP>(k_s, k_head, key0 + VA_KEYS, VA_KEYS, rows);
            mma_copies_commit();
            mma_copies_wait<1>();  // this tile's V
        } else {
            mma_copies_wait<0>();
        }
        __syncthreads();
        // O += P·V: P's accumulators are the A fragments of 16-key steps.
#pragma unroll
        for (int kc = 0; kc < VA_KEYS / 16; ++kc) {
            unsigned int a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                a[m][0] = mma_pack_bf16x2(s[m][2 * kc][0], s[m][2 * kc][1]);
                a[m][1] = mma_pack_bf16x2(s[m][2 * kc][2], s[m][2 * kc][3]);
                a[m][2] = mma_pack_bf16x2(s[m][2 * kc + 1][0], s[m][2 * kc + 1][1]);
                a[m][3] = mma_pack_bf16x2(s[m][2 * kc + 1][2], s[m][2 * kc + 1][3]);
            }
#pragma unroll
            for (int dd = 0; dd < HDP / 16; ++dd) {
                unsigned int b[4];
                mma_ldmatrix_x4_trans(
                    b, v_s + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + dd * 16 +
                           (lane >> 4) * 8);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    mma_m16n8k16(acc[m][2 * dd], a[m], b[0], b[1]);
                    mma_m16n8k16(acc[m][2 * dd + 1], a[m], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with the V tile
        if (more) {
            va_stage<HDP>(v_s, v_head, key0 + VA_KEYS, VA_KEYS, rows);
            mma_copies_commit();
        }
    }

    long long width = (long long)heads * hd;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float total = row_sum[m][h];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            if (t_rows[m][h] >= rows) continue;
            float inverse = total > 0.0f ? 1.0f / total : 0.0f;
            unsigned short* o = out + (long long)t_rows[m][h] * width + (long long)head * hd;
#pragma unroll
            for (int j = 0; j < HDP / 8; ++j) {
                int d = j * 8 + 2 * (lane % 4);
                if (d < hd)
                    *reinterpret_cast<unsigned int*>(o + d) = mma_pack_bf16x2(
                        acc[m][j][2 * h] * inverse, acc[m][j][2 * h + 1] * inverse);
            }
        }
}

// One kernel per padded head width (vision.rs picks the smallest that holds the head).
extern "C" __global__ void __launch_bounds__(VA_THREADS)
    vision_attention_16(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                        const unsigned int* first_key, const unsigned int* end_key,
                        unsigned short* out, int rows, int heads, int hd, float scale) {
    PDL_WAIT_AND_RELEASE();
    vision_attention_block<16, VA_TILES_NARROW>(q, k, v, first_key, end_key, out, rows, heads, hd,
                                      scale);
}

extern "C" __global__ void __launch_bounds__(VA_THREADS)
    vision_attention_32(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                        const unsigned int* first_key, const unsigned int* end_key,
                        unsigned short* out, int rows, int heads, int hd, float scale) {
    PDL_WAIT_AND_RELEASE();
    vision_attention_block<32, VA_TILES_NARROW>(q, k, v, first_key, end_key, out, rows, heads, hd,
                                      scale);
}

extern "C" __global__ void __launch_bounds__(VA_THREADS)
    vision_attention_64(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                        const unsigned int* first_key, const unsigned int* end_key,
                        unsigned short* out, int rows, int heads, int hd, float scale) {
    PDL_WAIT_AND_RELEASE();
    vision_attention_block<64, VA_TILES_NARROW>(q, k, v, first_key, end_key, out, rows, heads, hd,
                                      scale);
}

extern "C" __global__ void __launch_bounds__(VA_THREADS)
    vision_attention_80(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                        const unsigned int* first_key, const unsigned int* end_key,
                        unsigned short* out, int rows, int heads, int hd, float scale) {
    PDL_WAIT_AND_RELEASE();
    vision_attention_block<80, VA_TILES_NARROW>(q, k, v, first_key, end_key, out, rows, heads, hd,
                                      scale);
}

extern "C" __global__ void __launch_bounds__(VA_THREADS)
    vision_attention_128(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                        const unsigned int* first_key, const unsigned int* end_key,
                        unsigned short* out, int rows, int heads, int hd, float scale) {
    PDL_WAIT_AND_RELEASE();
    vision_attention_block<128, VA_TILES_WIDE>(q, k, v, first_key, end_key, out, rows, heads, hd,
                                      scale);
}
