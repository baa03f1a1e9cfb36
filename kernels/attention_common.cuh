// Decode attention's shared definitions, handed to NVRTC as the header `attention_common.cuh`:
// the chunking of a row's keys (which the split kernels, the combine and the host must agree on),
// the batched launch's row table, the asynchronous copies and the tensor-core pieces (mma.sync,
// ldmatrix). Included by attention.cu and attention_decode.cu.

#pragma once

// Keys staged and scored together (one per lane); `chunk` is a multiple.
#define SPLIT_TILE 32
// At most this many chunks per row (`SPLIT_MAX_CHUNKS` in attention.rs).
#define COMBINE_MAX_CHUNKS 128

// Keys per chunk for a segment whose last row sits at `last_position`: `split_chunk` in
// attention.rs, so a step graph's rows get the bits the uncaptured launches give them.
__device__ __forceinline__ int split_chunk(int last_position) {
    int tiles = (last_position + 1 + SPLIT_TILE - 1) / SPLIT_TILE;
    int per_chunk = (tiles + COMBINE_MAX_CHUNKS - 1) / COMBINE_MAX_CHUNKS;
    return (per_chunk > 1 ? per_chunk : 1) * SPLIT_TILE;
}

// A 16-byte global → shared copy that does not wait (both addresses 16-byte aligned).
__device__ __forceinline__ void split_copy_quad(unsigned int* shared_words,
                                                const unsigned int* global_words) {
    unsigned int address = (unsigned int)__cvta_generic_to_shared(shared_words);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address),
                 "l"(global_words)
                 : "memory");
}
__device__ __forceinline__ void split_copies_wait() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Rows one batched launch takes (`DECODE_BATCH_ROWS` in attention.rs).
#define DECODE_BATCH_ROWS 64

struct DecodeRows {
    unsigned long long keys[DECODE_BATCH_ROWS];    // each row's key cache (f32 or bf16 elements)
    unsigned long long values[DECODE_BATCH_ROWS];  // each row's value cache
    int positions[DECODE_BATCH_ROWS];              // each row's position (its cache length)
};

__device__ __forceinline__ int decode_row_position(const DecodeRows& batch, int row_start, int t,
                                                   const unsigned int* row_positions) {
    return row_positions ? (int)row_positions[row_start + t] : batch.positions[t];
}

// The tensor-core pieces of the prefill kernel (attention.cu) and the tensor-core decode kernel
// (attention_decode.cu): bf16 packing, ldmatrix, mma.sync m16n8k16 with f32 accumulators, and
// zero-filling asynchronous copies.
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
