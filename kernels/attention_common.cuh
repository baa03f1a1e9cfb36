// Decode attention's shared definitions, handed to NVRTC as the header `attention_common.cuh`:
// the chunking of a row's keys (which the split kernels, the combine and the host must agree on),
// the batched launch's row table and the split kernels' asynchronous copies; the tensor-core
// pieces come from mma_common.cuh. Included by attention.cu and attention_decode.cu.

#pragma once

#include "mma_common.cuh"

// Keys staged and scored together (one per lane); `chunk` is a multiple.
#define SPLIT_TILE 32
// At most this many chunks per row (`SPLIT_MAX_CHUNKS` in attention.rs).
#define COMBINE_MAX_CHUNKS 128
// At least this many tiles per chunk (`SPLIT_MIN_CHUNK_TILES` in attention.rs): fewer, longer
// chunks write and combine fewer partials at short contexts.
#define SPLIT_MIN_CHUNK_TILES 1

// Keys per chunk for a segment whose last row sits at `last_position`: `split_chunk` in
// attention.rs, so a step graph's rows get the bits the uncaptured launches give them.
__device__ __forceinline__ int split_chunk(int last_position) {
    int tiles = (last_position + 1 + SPLIT_TILE - 1) / SPLIT_TILE;
    int per_chunk = (tiles + COMBINE_MAX_CHUNKS - 1) / COMBINE_MAX_CHUNKS;
    return (per_chunk > SPLIT_MIN_CHUNK_TILES ? per_chunk : SPLIT_MIN_CHUNK_TILES) * SPLIT_TILE;
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


