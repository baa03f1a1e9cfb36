// The gated delta rule of the CUDA backend (MODELS.md §1.5), in both forms; they compute the same
// function (to f32 reassociation), with q, k l2-normalised (eps 1e-6) and q scaled by dk^-1/2,
// v-head h using k-head h / (nv / nk), state [nv, dk, dv] f32 (row index = key dim) carried in
// and out. Rows row_start..row_start+n of the batch belong to the sequence being run.
//
// gated_delta_rule_recurrent (decode): for each step, S ← e^g S; δ = β (v − Sᵀk); S ← S + k δᵀ;
// o = Sᵀq. One block per value head, one thread per value column j: thread j owns column S[:, j]
// of the head's state (in global memory), so the only cooperation is staging q and k in shared
// memory. Sums over the key dim run in increasing order, as in the CPU reference.
//
// gated_delta_rule_chunked (prefill): the chunked form of `delta_rule_chunked` in
// services/engine/src/backend/cpu.rs (chunks of 64), the same operations in the same order per
// output element (dot products with the host's eight-lane order). One block per (value head,
// tile of 32 value columns), sequential over chunks; the block keeps its tile of the state in
// shared memory for the whole sequence and writes it back at the end. Per chunk:
//   γ_i = Σ_{j≤i} g_j;  A_ij = β_i (k_i·k_j) e^{γ_i−γ_j} (j < i);
//   U = (I + A)⁻¹ (β V), W = (I + A)⁻¹ (β e^γ K)   (forward substitution, one thread per column);
//   V' = U − W S;  O_i = e^{γ_i} q_i S + Σ_{j≤i} (q_i·k_j) e^{γ_i−γ_j} V'_j;
//   S ← e^{γ_last} S + Σ_j e^{γ_last−γ_j} k_j ⊗ V'_j.
// A, W and the intra-chunk products are recomputed by every column tile of a head (they do not
// depend on the columns); that buys four times the blocks at dv = 128.

#include "common.cuh"

// q, k: [*, nk·dk]; v, out: [*, nv·dv]; g, beta: [*, nv]; state: [nv, dk, dv].
// Grid (nv); block dv rounded up to a warp. Dynamic shared memory: 2·dk floats.
extern "C" __global__ void gated_delta_rule_recurrent(const float* q, const float* k,
                                                      const float* v, const float* g,
                                                      const float* beta, float* state, float* out,
                                                      int row_start, int n, int nk, int nv,
                                                      int dk, int dv) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ float staged[];
    float* qs = staged;
    float* ks = staged + dk;
    int head = blockIdx.x;
    int ratio = max(nv / max(nk, 1), 1);
    int key_head = head / ratio;
    int j = threadIdx.x;
    float* s = state + (long long)head * dk * dv;
    float scale = rsqrtf((float)dk);
    for (int t = 0; t < n; ++t) {
        long long row = row_start + t;
        __syncthreads();  // everyone is done with the previous step's qs / ks
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = q[row * nk * dk + (long long)key_head * dk + i];
            ks[i] = k[row * nk * dk + (long long)key_head * dk + i];
        }
        __syncthreads();
        // Every thread computes the two norms itself (same order as the CPU reference).
        float q_sum = 0.0f, k_sum = 0.0f;
        for (int i = 0; i < dk; ++i) {
            q_sum += qs[i] * qs[i];
            k_sum += ks[i] * ks[i];
        }
        float q_scale = scale / sqrtf(q_sum + 1e-6f);
        float k_scale = 1.0f / sqrtf(k_sum + 1e-6f);
        if (j < dv) {
            float decay = expf(g[row * nv + head]);
            float b = beta[row * nv + head];
            float delta = v[row * nv * dv + (long long)head * dv + j];
            for (int i = 0; i < dk; ++i) {
                float decayed = s[(long long)i * dv + j] * decay;
                s[(long long)i * dv + j] = decayed;
                delta -= decayed * (ks[i] * k_scale);
            }
            delta *= b;
            float o = 0.0f;
            for (int i = 0; i < dk; ++i) {
                float updated = s[(long long)i * dv + j] + (ks[i] * k_scale) * delta;
                s[(long long)i * dv + j] = updated;
                o += updated * (qs[i] * q_scale);
            }
            out[row * nv * dv + (long long)head * dv + j] = o;
        }
    }
}

// Tokens per chunk (DELTA_RULE_CHUNK on the host).
#define DR_CHUNK 64
// Value columns per block (one per lane of a warp).
#define DR_COLUMNS 32
// Threads per block: 8 warps; in the column phases warp w takes rows w, w + 8, … of a chunk.
#define DR_THREADS 256
#define DR_WARPS (DR_THREADS / 32)
#define DR_ROWS_PER_WARP (DR_CHUNK / DR_WARPS)

// The host's `dot` (services/engine/src/weights.rs): eight running lanes, the tail, then
// sum + (l0+l4 + l2+l6) + (l1+l5 + l3+l7).
__device__ __forceinline__ float dot_host_order(const float* a, const float* b, int n) {
    float lanes[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int chunks = n / 8;
    for (int i = 0; i < chunks; ++i) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            lanes[l] += a[i * 8 + l] * b[i * 8 + l];
        }
    }
    float sum = 0.0f;
    for (int i = chunks * 8; i < n; ++i) {
        sum += a[i] * b[i];
    }
    float p0 = lanes[0] + lanes[4];
    float p1 = lanes[1] + lanes[5];
    float p2 = lanes[2] + lanes[6];
    float p3 = lanes[3] + lanes[7];
    return sum + (p0 + p2) + (p1 + p3);
}

// Normalises the first m rows of `rows` (row stride `stride`, dk used columns) in place:
// x · rsqrt(Σx² + 1e-6) · scale, written (x · inverse) · scale as on the host. `inverse` is
// scratch of DR_CHUNK floats. Starts and ends with the block in step.
__device__ __forceinline__ void l2_normalise_rows(float* rows, int stride, int m, int dk,
                                                  float scale, float* inverse) {
    __syncthreads();
    if ((int)threadIdx.x < m) {
        const float* row = rows + threadIdx.x * stride;
        float sum = 0.0f;
        for (int d = 0; d < dk; ++d) {
            sum += row[d] * row[d];
        }
        inverse[threadIdx.x] = 1.0f / sqrtf(sum + 1e-6f);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < m * dk; e += DR_THREADS) {
        int t = e / dk, d = e - t * dk;
        rows[t * stride + d] = rows[t * stride + d] * inverse[t] * scale;
    }
    __syncthreads();
}

// Same arguments as the recurrent kernel. Grid (nv, ceil(dv / 32)); block DR_THREADS; dk ≤ 256
// (the host checks), any dv. Dynamic shared memory, in floats, with ks = dk | 1 (an odd row
// stride keeps the row-parallel reads of K free of bank conflicts):
//   2·64·ks (K̂; W then Q̂) + 64·64 (A, then the intra-chunk Q̂K̂ᵀ) + 64·32 (U, then V')
//   + dk·32 (the state tile) + 4·64 (γ, β, inverse norms, e^{γ_last−γ_j}).
extern "C" __global__ void __launch_bounds__(DR_THREADS)
    gated_delta_rule_chunked(const float* q, const float* k, const float* v, const float* g,
                             const float* beta, float* state, float* out, int row_start, int n,
                             int nk, int nv, int dk, int dv) {
    PDL_WAIT_AND_RELEASE();
    extern __shared__ float shared[];
    const int ks = dk | 1;
    float* s_k = shared;                              // [64][ks]  k̂ rows of the chunk
    float* s_x = s_k + DR_CHUNK * ks;                 // [64][ks]  W, then q̂ (then q̂ e^γ)
    float* s_a = s_x + DR_CHUNK * ks;                 // [64][64]  A (j < i), then P (j ≤ i)
    float* s_u = s_a + DR_CHUNK * DR_CHUNK;           // [64][32]  U, then V'
    float* s_s = s_u + DR_CHUNK * DR_COLUMNS;         // [dk][32]  the state tile
    float* s_gamma = s_s + dk * DR_COLUMNS;           // [64]
    float* s_beta = s_gamma + DR_CHUNK;               // [64]
    float* s_inverse = s_beta + DR_CHUNK;             // [64]
    float* s_factor = s_inverse + DR_CHUNK;           // [64]

    const int head = blockIdx.x;
    const int column0 = blockIdx.y * DR_COLUMNS;
    const int ratio = max(nv / max(nk, 1), 1);
    const int key_head = head / ratio;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int column = column0 + lane;
    const bool column_in = column < dv;
    const long long q_stride = (long long)nk * dk;
    const long long v_stride = (long long)nv * dv;
    float* s_head = state + (long long)head * dk * dv;
    const float scale = 1.0f / sqrtf((float)dk);

    for (int e = tid; e < dk * DR_COLUMNS; e += DR_THREADS) {
        int d = e / DR_COLUMNS, c = column0 + (e - d * DR_COLUMNS);
        s_s[e] = c < dv ? s_head[(long long)d * dv + c] : 0.0f;
    }

    for (int chunk = 0; chunk < n; chunk += DR_CHUNK) {
        const int m = min(DR_CHUNK, n - chunk);
        const long long row0 = (long long)row_start + chunk;
        __syncthreads();  // the previous chunk is done with every buffer

        // Raw k rows, γ (one running sum, as on the host), β.
        for (int e = tid; e < m * dk; e += DR_THREADS) {
            int t = e / dk, d = e - t * dk;
            s_k[t * ks + d] = k[(row0 + t) * q_stride + (long long)key_head * dk + d];
        }
        if (tid == 0) {
            float running = 0.0f;
            for (int t = 0; t < m; ++t) {
                running += g[(row0 + t) * nv + head];
                s_gamma[t] = running;
            }
        }
        for (int t = tid; t < m; t += DR_THREADS) {
            s_beta[t] = beta[(row0 + t) * nv + head];
        }
        l2_normalise_rows(s_k, ks, m, dk, 1.0f, s_inverse);

        // A (strictly lower), the right-hand sides β e^γ K → s_x and β V → s_u.
        for (int e = tid; e < DR_CHUNK * DR_CHUNK; e += DR_THREADS) {
            int i = e / DR_CHUNK, j = e - i * DR_CHUNK;
            if (i < m && j < i) {
                s_a[e] = s_beta[i] * dot_host_order(s_k + i * ks, s_k + j * ks, dk) *
                         expf(s_gamma[i] - s_gamma[j]);
            }
        }
        for (int e = tid; e < m * dk; e += DR_THREADS) {
            int t = e / dk, d = e - t * dk;
            float row_scale = s_beta[t] * expf(s_gamma[t]);
            s_x[t * ks + d] = row_scale * s_k[t * ks + d];
        }
        for (int e = tid; e < m * DR_COLUMNS; e += DR_THREADS) {
            int t = e / DR_COLUMNS, c = column0 + (e - t * DR_COLUMNS);
            s_u[e] = c < dv ? s_beta[t] * v[(row0 + t) * v_stride + (long long)head * dv + c]
                            : 0.0f;
        }
        __syncthreads();

        // Forward substitution with T = I + A, one thread per column of W (dk) and of U (32).
        for (int col = tid; col < dk + DR_COLUMNS; col += DR_THREADS) {
            float* base = col < dk ? s_x + col : s_u + (col - dk);
            const int stride = col < dk ? ks : DR_COLUMNS;
            for (int i = 0; i < m; ++i) {
                float x = base[i * stride];
                for (int j = 0; j < i; ++j) {
                    float coefficient = s_a[i * DR_CHUNK + j];
                    if (coefficient != 0.0f) {
                        x -= coefficient * base[j * stride];
                    }
                }
                base[i * stride] = x;
            }
        }
        __syncthreads();

        // V' = U − W S, in place in s_u (each element read and written by one thread).
        {
            float acc[DR_ROWS_PER_WARP];
#pragma unroll
            for (int r = 0; r < DR_ROWS_PER_WARP; ++r) {
                int i = warp + DR_WARPS * r;
                acc[r] = i < m ? s_u[i * DR_COLUMNS + lane] : 0.0f;
            }
            for (int d = 0; d < dk; ++d) {
                float s = s_s[d * DR_COLUMNS + lane];
#pragma unroll
                for (int r = 0; r < DR_ROWS_PER_WARP; ++r) {
                    int i = warp + DR_WARPS * r;
                    if (i < m) {
                        acc[r] -= s_x[i * ks + d] * s;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < DR_ROWS_PER_WARP; ++r) {
                int i = warp + DR_WARPS * r;
                if (i < m) {
                    s_u[i * DR_COLUMNS + lane] = acc[r];
                }
            }
        }
        __syncthreads();  // W is no longer needed: s_x takes q

        for (int e = tid; e < m * dk; e += DR_THREADS) {
            int t = e / dk, d = e - t * dk;
            s_x[t * ks + d] = q[(row0 + t) * q_stride + (long long)key_head * dk + d];
        }
        l2_normalise_rows(s_x, ks, m, dk, scale, s_inverse);

        // P_ij = (q̂_i·k̂_j) e^{γ_i−γ_j} (j ≤ i) over A; e^{γ_last−γ_j} for the state update.
        for (int e = tid; e < DR_CHUNK * DR_CHUNK; e += DR_THREADS) {
            int i = e / DR_CHUNK, j = e - i * DR_CHUNK;
            if (i < m && j <= i) {
                s_a[e] = dot_host_order(s_x + i * ks, s_k + j * ks, dk) *
                         expf(s_gamma[i] - s_gamma[j]);
            }
        }
        for (int t = tid; t < m; t += DR_THREADS) {
            s_factor[t] = expf(s_gamma[m - 1] - s_gamma[t]);
        }
        __syncthreads();
        for (int e = tid; e < m * dk; e += DR_THREADS) {
            int t = e / dk, d = e - t * dk;
            s_x[t * ks + d] = s_x[t * ks + d] * expf(s_gamma[t]);
        }
        __syncthreads();

        // O_i = Σ_d (q̂_i[d] e^{γ_i}) S[d] + Σ_{j≤i} P_ij V'_j.
        {
            float acc[DR_ROWS_PER_WARP];
#pragma unroll
            for (int r = 0; r < DR_ROWS_PER_WARP; ++r) {
                acc[r] = 0.0f;
            }
            for (int d = 0; d < dk; ++d) {
                float s = s_s[d * DR_COLUMNS + lane];
#pragma unroll
                for (int r = 0; r < DR_ROWS_PER_WARP; ++r) {
                    int i = warp + DR_WARPS * r;
                    if (i < m) {
                        acc[r] += s_x[i * ks + d] * s;
                    }
                }
            }
            for (int j = 0; j < m; ++j) {
                float x = s_u[j * DR_COLUMNS + lane];
#pragma unroll
                for (int r = 0; r < DR_ROWS_PER_WARP; ++r) {
                    int i = warp + DR_WARPS * r;
                    if (i < m && j <= i) {
                        acc[r] += s_a[i * DR_CHUNK + j] * x;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < DR_ROWS_PER_WARP; ++r) {
                int i = warp + DR_WARPS * r;
                if (i < m && column_in) {
                    out[(row0 + i) * v_stride + (long long)head * dv + column] = acc[r];
                }
            }
        }
        __syncthreads();  // every read of the state tile for this chunk is done

        // S ← e^{γ_last} S + Σ_j (e^{γ_last−γ_j} k̂_j[d]) V'_j; warp w owns rows 8w.., 8w+64.., ….
        {
            const float decay = expf(s_gamma[m - 1]);
            for (int d0 = warp * 8; d0 < dk; d0 += DR_WARPS * 8) {
                float acc[8];
#pragma unroll
                for (int r = 0; r < 8; ++r) {
                    int d = d0 + r;
                    acc[r] = d < dk ? s_s[d * DR_COLUMNS + lane] * decay : 0.0f;
                }
                for (int j = 0; j < m; ++j) {
                    float x = s_u[j * DR_COLUMNS + lane];
                    float factor = s_factor[j];
#pragma unroll
                    for (int r = 0; r < 8; ++r) {
                        int d = d0 + r;
                        if (d < dk) {
                            float row_scale = factor * s_k[j * ks + d];
                            acc[r] += row_scale * x;
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < 8; ++r) {
                    int d = d0 + r;
                    if (d < dk) {
                        s_s[d * DR_COLUMNS + lane] = acc[r];
                    }
                }
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < dk * DR_COLUMNS; e += DR_THREADS) {
        int d = e / DR_COLUMNS, c = column0 + (e - d * DR_COLUMNS);
        if (c < dv) {
            s_head[(long long)d * dv + c] = s_s[e];
        }
    }
}
