// Element-wise and row-shuffling ops of the CUDA backend (f32 activations).
//
// Every kernel here computes each output element from inputs at fixed positions, so results do
// not depend on the batch shape (batched and single-sequence forwards give identical bits).
// Launch shapes: one thread per output element unless a kernel says otherwise; grid-stride
// loops make any grid size correct.

#include "common.cuh"

#define GRID_STRIDE(i, n)                                                                   \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)blockDim.x * gridDim.x)

// out[r, c] = table[ids[r], c]; ids outside the vocabulary give zeros (the model checks ids
// before any op runs; this keeps a bad id from reading out of bounds).
extern "C" __global__ void embed(const float* table, const unsigned int* ids, float* out, int rows,
                                 int cols, int vocab) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, (long long)rows * cols) {
        long long r = i / cols, c = i % cols;
        unsigned int id = ids[r];
        out[i] = id < (unsigned int)vocab ? table[(long long)id * cols + c] : 0.0f;
    }
}

// The same with a bf16 table (bf16 → f32 is exact).
extern "C" __global__ void embed_bf16(const unsigned short* table, const unsigned int* ids,
                                      float* out, int rows, int cols, int vocab) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, (long long)rows * cols) {
        long long r = i / cols, c = i % cols;
        unsigned int id = ids[r];
        out[i] = id < (unsigned int)vocab
                     ? __uint_as_float(((unsigned int)table[(long long)id * cols + c]) << 16)
                     : 0.0f;
    }
}

// out[r, c] = x[rows[r], c].
extern "C" __global__ void gather_rows(const float* x, const unsigned int* rows, float* out,
                                       int count, int cols) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, (long long)count * cols) {
        long long r = i / cols, c = i % cols;
        out[i] = x[(long long)rows[r] * cols + c];
    }
}

// out[r, c] = x[r, start + c] for c < width.
extern "C" __global__ void columns(const float* x, float* out, int rows, int cols, int start,
                                   int width) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, (long long)rows * width) {
        long long r = i / width, c = i % width;
        out[i] = x[r * cols + start + c];
    }
}

// Row = groups × [first | second] → a = groups × first, b = groups × second.
extern "C" __global__ void split_interleaved(const float* x, float* a, float* b, int rows,
                                             int groups, int first, int second) {
    PDL_WAIT_AND_RELEASE();
    int width = first + second;
    GRID_STRIDE(i, (long long)rows * groups * width) {
        long long r = i / ((long long)groups * width);
        int rest = (int)(i % ((long long)groups * width));
        int g = rest / width, c = rest % width;
        if (c < first) {
            a[(r * groups + g) * first + c] = x[i];
        } else {
            b[(r * groups + g) * second + (c - first)] = x[i];
        }
    }
}

extern "C" __global__ void add_assign(float* a, const float* b, long long n) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, n) { a[i] += b[i]; }
}

// out[r, c] = silu(x[r, c]) * x[r, half + c].
extern "C" __global__ void silu_mul_halves(const float* x, float* out, int rows, int half) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, (long long)rows * half) {
        long long r = i / half, c = i % half;
        const float* row = x + r * 2 * half;
        out[i] = silu_f(row[c]) * row[half + c];
    }
}

extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, long long n) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, n) { out[i] = silu_f(gate[i]) * up[i]; }
}

extern "C" __global__ void mul_sigmoid(const float* x, const float* gate, float* out, long long n) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, n) { out[i] = x[i] * sigmoid_f(gate[i]); }
}

// a[r, c] += sigmoid(gate[r, 0]) * b[r, c].
extern "C" __global__ void add_sigmoid_scaled_rows(float* a, const float* b, const float* gate,
                                                   int rows, int cols, int gate_cols) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, (long long)rows * cols) {
        long long r = i / cols;
        a[i] += sigmoid_f(gate[r * gate_cols]) * b[i];
    }
}

// out = silu(scale * x).
extern "C" __global__ void scaled_silu(const float* x, float* out, float scale, long long n) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, n) { out[i] = silu_f(x[i] * scale); }
}

// qwen4_exp's stream mix: x and gate are [rows, streams * width], out is [rows, width];
// out[r, c] = scale * sum over s (in order) of sigmoid(gate[r, s, c]) * x[r, s, c].
extern "C" __global__ void stream_mix(const float* x, const float* gate, float* out, int rows,
                                      int width, int streams, float scale) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, (long long)rows * width) {
        long long r = i / width, c = i % width;
        long long base = r * streams * width + c;
        float sum = 0.0f;
        for (int s = 0; s < streams; ++s) {
            sum += sigmoid_f(gate[base + (long long)s * width]) * x[base + (long long)s * width];
        }
        out[i] = sum * scale;
    }
}

// qwen4_exp's injection of a block output into the streams [rows, count * width]:
// streams[r, s, c] += 2 * sigmoid(shares[r, s] * scale) * output[r, c].
extern "C" __global__ void inject_into_streams(float* streams, const float* output,
                                               const float* shares, int rows, int width,
                                               int count, float scale) {
    PDL_WAIT_AND_RELEASE();
    long long row_width = (long long)count * width;
    GRID_STRIDE(i, (long long)rows * row_width) {
        long long r = i / row_width, within = i % row_width;
        long long s = within / width, c = within % width;
        float share = 2.0f * sigmoid_f(shares[r * count + s] * scale);
        streams[i] += share * output[r * width + c];
    }
}

// qwen4_exp's PLE gate: keys, queries [rows, streams * width], values [rows, width]; per (r, s),
// d = scale * dot(keys[r, s], queries[r, s]), g = sign(d) * sqrt(max(|d|, 1e-6)) (0 where d is
// 0, as torch's sign), out[r, s, i] = sigmoid(g) * values[r, i]. Launch with PLE_GATE_THREADS
// (one warp) per block, one block per (r, s) pair (grid-stride over pairs).
#define PLE_GATE_THREADS 32
extern "C" __global__ void ple_gate(const float* keys, const float* queries, const float* values,
                                    float* out, int rows, int width, int streams, float scale) {
    PDL_WAIT_AND_RELEASE();
    long long pairs = (long long)rows * streams;
    for (long long p = blockIdx.x; p < pairs; p += gridDim.x) {
        long long r = p / streams;
        const float* k = keys + p * width;
        const float* q = queries + p * width;
        float sum = 0.0f;
        for (int i = threadIdx.x; i < width; i += PLE_GATE_THREADS) sum += k[i] * q[i];
        for (int offset = 16; offset > 0; offset >>= 1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        float d = sum * scale;
        float g = d == 0.0f ? 0.0f : copysignf(sqrtf(fmaxf(fabsf(d), 1e-6f)), d);
        float gate = sigmoid_f(g);
        const float* v = values + r * width;
        for (int i = threadIdx.x; i < width; i += PLE_GATE_THREADS) out[p * width + i] = gate * v[i];
    }
}

// g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); a, b, g, beta are [rows, nv].
extern "C" __global__ void delta_rule_gates(const float* a, const float* b, const float* a_log,
                                            const float* dt_bias, float* g, float* beta, int rows,
                                            int nv) {
    PDL_WAIT_AND_RELEASE();
    GRID_STRIDE(i, (long long)rows * nv) {
        int h = (int)(i % nv);
        g[i] = -expf(a_log[h]) * softplus_f(a[i] + dt_bias[h]);
        beta[i] = sigmoid_f(b[i]);
    }
}

// Rotate-half RoPE on the first 2*half dims of every head_dim head of row r at positions[r].
// One thread per (row, head, pair). inv_freq is computed on the host exactly as the CPU backend
// does (f32 powf), so the angles match it.
extern "C" __global__ void rope(float* x, const unsigned int* positions, const float* inv_freq,
                                int rows, int cols, int head_dim, int half) {
    PDL_WAIT_AND_RELEASE();
    int heads = cols / head_dim;
    GRID_STRIDE(i, (long long)rows * heads * half) {
        long long r = i / ((long long)heads * half);
        int rest = (int)(i % ((long long)heads * half));
        int h = rest / half, p = rest % half;
        float angle = (float)positions[r] * inv_freq[p];
        float c = cosf(angle), s = sinf(angle);
        float* head = x + r * cols + (long long)h * head_dim;
        float u = head[p], v = head[p + half];
        head[p] = u * c - v * s;
        head[p + half] = v * c + u * s;
    }
}

// Interleaved M-RoPE of image prompts: `rope` with frequency p of row r turned by
// positions[r * half + p] (the host picks each frequency's stream: temporal, height or width).
extern "C" __global__ void rope_per_frequency(float* x, const unsigned int* positions,
                                              const float* inv_freq, int rows, int cols,
                                              int head_dim, int half) {
    PDL_WAIT_AND_RELEASE();
    int heads = cols / head_dim;
    GRID_STRIDE(i, (long long)rows * heads * half) {
        long long r = i / ((long long)heads * half);
        int rest = (int)(i % ((long long)heads * half));
        int h = rest / half, p = rest % half;
        float angle = (float)positions[r * half + p] * inv_freq[p];
        float c = cosf(angle), s = sinf(angle);
        float* head = x + r * cols + (long long)h * head_dim;
        float u = head[p], v = head[p + half];
        head[p] = u * c - v * s;
        head[p + half] = v * c + u * s;
    }
}

// One channel `c` of `causal_conv1d_silu` over rows [row_start, row_start + n): each output
// (rows × channels, this channel's column) through `store`, then the channel's new history.
template <typename Store>
__device__ __forceinline__ void conv1d_silu_channel(const float* x, const float* taps,
                                                    float* history, int row_start, int n,
                                                    int channels, int kernel, int c,
                                                    Store store) {
    int context = kernel - 1;
    const float* w = taps + (long long)c * kernel;
    for (int t = 0; t < n; ++t) {
        float sum = 0.0f;
        for (int j = 0; j < kernel; ++j) {
            int e = t + j;  // index into [history ‖ rows]
            float v = e < context ? history[(long long)e * channels + c]
                                  : x[(long long)(row_start + e - context) * channels + c];
            sum += w[j] * v;
        }
        store(row_start + t, silu_f(sum));
    }
    // New history row i = extended[n + i]; n >= 1 so index n + i > i is read before row
    // n + i is overwritten (rows are rewritten in increasing order).
    for (int i = 0; i < context; ++i) {
        int e = n + i;
        float v = e < context ? history[(long long)e * channels + c]
                              : x[(long long)(row_start + e - context) * channels + c];
        history[(long long)i * channels + c] = v;
    }
}

// Depthwise causal conv1d + SiLU over one sequence's rows [row_start, row_start + n) of x
// ([*, channels]), continuing from history ([kernel - 1, channels], oldest first) and leaving
// the last kernel - 1 inputs in it. One thread per channel walks the rows in order, so the
// history update needs no synchronisation between threads.
extern "C" __global__ void causal_conv1d_silu(const float* x, const float* taps, float* history,
                                              float* out, int row_start, int n, int channels,
                                              int kernel) {
    PDL_WAIT_AND_RELEASE();
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels;
         c += blockDim.x * gridDim.x) {
        conv1d_silu_channel(x, taps, history, row_start, n, channels, kernel, c,
                            [&](long long row, float value) { out[row * channels + c] = value; });
    }
}

// `causal_conv1d_silu` whose output channels [0, w0), [w0, w0 + w1) and the rest go to a, b and
// c (the q, k and v of a Gated DeltaNet layer): the conv and three `columns` in one launch.
extern "C" __global__ void causal_conv1d_silu_split3(const float* x, const float* taps,
                                                     float* history, float* a, float* b,
                                                     float* c_out, int row_start, int n,
                                                     int channels, int kernel, int w0, int w1) {
    PDL_WAIT_AND_RELEASE();
    int w2 = channels - w0 - w1;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels;
         c += blockDim.x * gridDim.x) {
        conv1d_silu_channel(x, taps, history, row_start, n, channels, kernel, c,
                            [&](long long row, float value) {
                                if (c < w0) {
                                    a[row * w0 + c] = value;
                                } else if (c < w0 + w1) {
                                    b[row * w1 + (c - w0)] = value;
                                } else {
                                    c_out[row * w2 + (c - w0 - w1)] = value;
                                }
                            });
    }
}

// Appends one sequence's k, v rows [row_start, row_start + n) to its cache at position `at`
// (`row_positions[row_start]` when given: a step graph's positions live in device memory).
extern "C" __global__ void kv_append(const float* k, const float* v, float* keys, float* values,
                                     int row_start, int n, int at, int width,
                                     const unsigned int* row_positions) {
    PDL_WAIT_AND_RELEASE();
    if (row_positions) at = (int)row_positions[row_start];
    GRID_STRIDE(i, (long long)n * width) {
        long long src = (long long)row_start * width + i;
        long long dst = (long long)at * width + i;
        keys[dst] = k[src];
        values[dst] = v[src];
    }
}
