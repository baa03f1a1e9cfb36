// The tensor-core pieces every tensor-core kernel shares (prefill and decode attention, the
// routed experts' GEMMs, the vision tower's attention): bf16 packing, ldmatrix, mma.sync
// m16n8k16 with f32 accumulators (sm_80 and up), zero-filling asynchronous copies, and the
// steps of attention on them (a tile's scores, its online softmax, the P·V product).
#pragma once

// Two f32 as a bf16x2 word (nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned int mma_pack_bf16x2(float lo, float hi) {
    unsigned int packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

__device__ __forceinline__ void mma_ldmatrix_x4(unsigned int (&r)[4], const unsigned short* at) {
    unsigned int address = (unsigned int)__cvta_generic_to_shared(at);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void mma_ldmatrix_x4_trans(unsigned int (&r)[4],
                                                      const unsigned short* at) {
    unsigned int address = (unsigned int)__cvta_generic_to_shared(at);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const unsigned int (&a)[4],
                                             unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global → shared without waiting; `valid` false zero-fills (nothing is read).
__device__ __forceinline__ void mma_copy_16(unsigned short* shared, const unsigned short* global,
                                            bool valid) {
    unsigned int address = (unsigned int)__cvta_generic_to_shared(shared);
    int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mma_copies_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void mma_copies_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// The tensor-core attention steps the prefill and decode kernels (attention.cu,
// attention_decode.cu) share, and the vision tower's attention its online softmax. A warp holds 16 q rows; lane l's rows are l / 4 and l / 4 + 8
// (h = 0, 1), its keys of an 8-key tile j are j · 8 + 2 · (l % 4) + e (e = 0, 1), and each row's
// output columns are spread over a quad as the m16n8 accumulators lay them out.

// S = Q·Kᵀ of the warp's 16 staged q rows (rows q_row0 … of `q_s`, bf16, `stride` per row)
// against KEYS staged keys: KEYS / 8 m16n8 accumulator tiles.
template <int HD, int KEYS>
__device__ __forceinline__ void mma_tile_scores(const unsigned short* q_s, int q_row0,
                                                const unsigned short* k_s, int stride, int lane,
                                                float (&s)[KEYS / 8][4]) {
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
#pragma unroll
    for (int kd = 0; kd < HD; kd += 16) {
        unsigned int a[4];
        mma_ldmatrix_x4(a, q_s + (q_row0 + (lane & 15)) * stride + kd + (lane >> 4) * 8);
#pragma unroll
        for (int jj = 0; jj < KEYS / 16; ++jj) {
            unsigned int b[4];
            mma_ldmatrix_x4(b, k_s + (jj * 16 + (lane & 7) + ((lane >> 4) << 3)) * stride + kd +
                                   ((lane >> 3) & 1) * 8);
            mma_m16n8k16(s[2 * jj], a, b[0], b[1]);
            mma_m16n8k16(s[2 * jj + 1], a, b[2], b[3]);
        }
    }
}

// One tile's online softmax in base 2 (exp(x) = 2^(x · log2 e)): the scores of keys
// key0 + j · 8 + 2 · (lane % 4) + e that `visible(h, key)` lets row h see are scaled, the rest
// are −∞; the scores become p, each row's running max and this lane's share of its sum move on,
// and the accumulators take the correction of the new max.
template <int HD, int KEYS, class Visible>
__device__ __forceinline__ void mma_online_softmax(float (&s)[KEYS / 8][4], int key0, int lane,
                                                   float scale_log2, Visible visible,
                                                   float (&row_max)[2], float (&row_sum)[2],
                                                   float (&acc)[HD / 8][4]) {
    const float neg_inf = __int_as_float(0xff800000);
    float correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float top = neg_inf;
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int key = key0 + j * 8 + 2 * (lane % 4) + e;
                float score = visible(h, key) ? s[j][2 * h + e] * scale_log2 : neg_inf;
                s[j][2 * h + e] = score;
                top = fmaxf(top, score);
            }
        }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        float new_max = fmaxf(row_max[h], top);
        // Nothing visible yet: exponents against 0 give p = 0 and keep the state at 0.
        float base = new_max == neg_inf ? 0.0f : new_max;
        correction[h] = exp2f(row_max[h] - base);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float p = exp2f(s[j][2 * h + e] - base);
                s[j][2 * h + e] = p;
                sum += p;
            }
        }
        row_sum[h] = row_sum[h] * correction[h] + sum;  // this lane's share
        row_max[h] = new_max;
    }
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
        acc[j][0] *= correction[0], acc[j][1] *= correction[0];
        acc[j][2] *= correction[1], acc[j][3] *= correction[1];
    }
}

// O += P·V over KEYS staged values: P's accumulators (rounded to bf16) are the A fragments of
// 16-key steps.
template <int HD, int KEYS>
__device__ __forceinline__ void mma_add_pv(const float (&p)[KEYS / 8][4], const unsigned short* v_s,
                                           int stride, int lane, float (&acc)[HD / 8][4]) {
#pragma unroll
    for (int kc = 0; kc < KEYS / 16; ++kc) {
        unsigned int a[4] = {
            mma_pack_bf16x2(p[2 * kc][0], p[2 * kc][1]),
            mma_pack_bf16x2(p[2 * kc][2], p[2 * kc][3]),
            mma_pack_bf16x2(p[2 * kc + 1][0], p[2 * kc + 1][1]),
            mma_pack_bf16x2(p[2 * kc + 1][2], p[2 * kc + 1][3]),
        };
#pragma unroll
        for (int dd = 0; dd < HD / 16; ++dd) {
            unsigned int b[4];
            mma_ldmatrix_x4_trans(b, v_s + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride +
                                         dd * 16 + (lane >> 4) * 8);
            mma_m16n8k16(acc[2 * dd], a, b[0], b[1]);
            mma_m16n8k16(acc[2 * dd + 1], a, b[2], b[3]);
        }
    }
}
