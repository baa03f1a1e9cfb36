// The gated delta rule of the CUDA backend, recurrent form (MODELS.md §1.5): for each step,
// S ← e^g S; δ = β (v − Sᵀk); S ← S + k δᵀ; o = Sᵀq, with q, k l2-normalised (eps 1e-6) and q
// scaled by dk^-1/2.
//
// One block per value head, one thread per value column j: thread j owns column S[:, j] of the
// head's state ([dk, dv] row-major, in global memory), so the only cooperation is staging q and
// k in shared memory. Sums over the key dim run in increasing order, as in the CPU reference.
// The chunked (prefill) form is still to come; it computes the same function.

// q, k: [*, nk·dk]; v, out: [*, nv·dv]; g, beta: [*, nv]; state: [nv, dk, dv]. Rows
// row_start..row_start+n belong to this sequence. Dynamic shared memory: 2·dk floats.
extern "C" __global__ void gated_delta_rule_recurrent(const float* q, const float* k,
                                                      const float* v, const float* g,
                                                      const float* beta, float* state, float* out,
                                                      int row_start, int n, int nk, int nv,
                                                      int dk, int dv) {
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
