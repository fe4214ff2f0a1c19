// What kiln's tensor-core templates share from sm_80 on (paged_decode.cu,
// paged_prefill_mma.cu, the prefill helpers, the TMA kernels): the shared
// address of a pointer, cp.async, ldmatrix and mma.sync m16n8k16.
#pragma once
#include "kiln_prelude.cuh"

// The 32-bit shared-memory address of p.
__device__ __forceinline__ kiln_u32 saddr(const void *p)
{
    kiln_u32 a;
    asm("{\n\t.reg .u64 g;\n\tcvta.to.shared.u64 g, %1;\n\tcvt.u32.u64 %0, g;\n\t}" : "=r"(a) : "l"(p));
    return a;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// 16 bytes global -> shared, L2 only; bytes 0 zero-fills (src then unread).
__device__ __forceinline__ void cp_async16(kiln_u32 dst, const void *src, kiln_u32 bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(kiln_u32 addr, kiln_u32 *r)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(kiln_u32 addr, kiln_u32 *r)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// c += a (16 x 16, row) . b (16 x 8, col), kiln_elt in (f16 or bf16), f32
// accumulate.
__device__ __forceinline__ void mma(float *c, const kiln_u32 *a, kiln_u32 b0, kiln_u32 b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32." KILN_ELT_PTX "." KILN_ELT_PTX
        ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
