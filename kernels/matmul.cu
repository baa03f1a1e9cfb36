// Dense matmul of the CUDA backend: out[n, m] = x[n, k] · W[m, k]ᵀ, f32 accumulation.
//
// A plain shared-memory tiled kernel: every output is one thread's sum over k in increasing
// order, whatever n is, so a row's result does not depend on the batch it is in (the golden
// tests require batched and single prefills to agree bit for bit). cuBLAS(Lt) with bf16 weights
// is the fast path still to come; it must keep that property or the tests must relax it.

#define TILE 16

extern "C" __global__ void matmul(const float* x, const float* w, float* out, int n, int k,
                                  int m) {
    __shared__ float xs[TILE][TILE];
    __shared__ float ws[TILE][TILE + 1];  // +1: column reads of ws hit different banks
    int row = blockIdx.y * TILE + threadIdx.y;  // token
    int col = blockIdx.x * TILE + threadIdx.x;  // output feature
    float sum = 0.0f;
    for (int k0 = 0; k0 < k; k0 += TILE) {
        int kx = k0 + threadIdx.x;
        xs[threadIdx.y][threadIdx.x] = (row < n && kx < k) ? x[(long long)row * k + kx] : 0.0f;
        // Thread (y, x) loads W[blockIdx.x*TILE + y, k0 + x]: consecutive threads read
        // consecutive k, so the loads are coalesced.
        int wrow = blockIdx.x * TILE + threadIdx.y;
        ws[threadIdx.y][threadIdx.x] = (wrow < m && kx < k) ? w[(long long)wrow * k + kx] : 0.0f;
        __syncthreads();
        int steps = min(TILE, k - k0);
        for (int j = 0; j < steps; ++j) sum += xs[threadIdx.y][j] * ws[threadIdx.x][j];
        __syncthreads();
    }
    if (row < n && col < m) out[(long long)row * m + col] = sum;
}
