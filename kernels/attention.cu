// Causal GQA attention of the CUDA backend over a sequence's KV cache.
//
// One warp per (query row, head) walks the visible keys in order with an online softmax, so no
// score matrix is ever stored and each output depends only on its own row's keys (batch
// invariant). Each lane holds head_dim / 32 output dims; head_dim ≤ 32 * MAX_DIMS_PER_LANE.
// This is the simple correct kernel; split-K decoding and tiled prefill come later.
//
// The cache holds f32 (`attention`, `kv_append` in elementwise.cu) or bf16 (`attention_bf16`,
// `kv_append_bf16` here: half the memory; keys and values are rounded to nearest even when they
// are appended, and widened exactly when read, so the math after the read is the same f32).

#define MAX_DIMS_PER_LANE 8

__device__ __forceinline__ float load_kv(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_kv(const unsigned short* p, long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}

// Round to nearest even, as `half::bf16::from_f32` does; NaN stays a (quiet) NaN. (Same as in
// matmul.cu: every kernel file is compiled on its own.)
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Appends one sequence's k, v rows [row_start, row_start + n) ([*, width] f32) to its bf16
// cache ([max_tokens, width]) at position `at`. One thread per element, grid-stride.
extern "C" __global__ void kv_append_bf16(const float* k, const float* v, unsigned short* keys,
                                          unsigned short* values, int row_start, int n, int at,
                                          int width) {
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
    attention_warp(q, keys, values, out, row_start, n, start_position, heads, kv_heads, hd, window,
                   scale);
}

extern "C" __global__ void attention_bf16(const float* q, const unsigned short* keys,
                                          const unsigned short* values, float* out, int row_start,
                                          int n, int start_position, int heads, int kv_heads,
                                          int hd, int window, float scale) {
    attention_warp(q, keys, values, out, row_start, n, start_position, heads, kv_heads, hd, window,
                   scale);
}
