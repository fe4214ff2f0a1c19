// What kiln's TMA kernels share (templates/tma_swiglu.cu, tma_linear.cu): the
// tensor map parameter, mbarrier waits, 2-D TMA loads into shared memory with
// the 128-byte swizzle, ldmatrix and mma.sync m16n8k16. Needs sm_90 for the
// TMA and mbarrier parts (guarded).
#pragma once
#include "kiln_prelude.cuh"

#define KILN_TMA_KB 64 // K per stage: one 128-byte swizzle row of f16

// A CUtensorMap (cuda.h), passed by value as a __grid_constant__ parameter.
struct __align__(64) kiln_tmap {
    kiln_u64 opaque[16];
};

__device__ __forceinline__ kiln_u32 saddr(const void *p)
{
    kiln_u32 a;
    asm("{\n\t.reg .u64 g;\n\tcvta.to.shared.u64 g, %1;\n\tcvt.u32.u64 %0, g;\n\t}" : "=r"(a) : "l"(p));
    return a;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void bar_wait(kiln_u32 bar, kiln_u32 parity)
{
    asm volatile("{\n\t.reg .pred p;\n\tWAIT_%=:\n\tmbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n\t@!p bra WAIT_%=;\n\t}" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

__device__ __forceinline__ void expect(kiln_u32 bar, kiln_u32 bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma(kiln_u32 dst, const kiln_tmap *m, kiln_u32 c0, kiln_u32 c1, kiln_u32 bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(m), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void ldsm4(kiln_u32 a, kiln_u32 *r)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void mma(float *c, const kiln_u32 *a, kiln_u32 b0, kiln_u32 b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// Byte offset of (row r, 16-byte chunk c) in a tile of 128-byte rows whose
// base is 1024-byte aligned, as TMA's 128-byte swizzle lays it out.
__device__ __forceinline__ kiln_u32 swz(kiln_u32 r, kiln_u32 c) { return r * 128 + ((c ^ (r & 7)) << 4); }

