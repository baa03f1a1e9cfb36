// The tensor-core pieces every tensor-core kernel shares (prefill and decode attention, the
// routed experts' GEMMs, the vision tower's attention): bf16 packing, ldmatrix, mma.sync
// m16n8k16 with f32 accumulators (sm_80 and up), and zero-filling asynchronous copies.
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
