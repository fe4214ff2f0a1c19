// What kiln's TMA kernels share (templates/tma_swiglu.cu, tma_linear.cu,
// moe_experts_tma.cu): the tensor map parameter, the stages' mbarriers and
// their waits, 2-D TMA loads into shared memory with
// the 128-byte swizzle (ldmatrix and mma.sync come from kiln_mma.cuh). Needs
// sm_90 for the TMA and mbarrier parts (guarded).
#pragma once
#include "kiln_mma.cuh" // saddr, ldsm_x4, mma

#define KILN_TMA_KB 64 // K per stage: one 128-byte swizzle row of kiln_elt (f16 or bf16)

// A CUtensorMap (cuda.h), passed by value as a __grid_constant__ parameter.
struct __align__(64) kiln_tmap {
    kiln_u64 opaque[16];
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Thread 0 initializes the stages' mbarriers, full[s] for the producer's one
// arrival (with its TMA bytes), empty[s] for one arrival of each of warps
// consumer warps; the block's barrier publishes them.
__device__ __forceinline__ void init_stages(kiln_u64 *full, kiln_u64 *empty, kiln_u32 stages, kiln_u32 warps)
{
    if (threadIdx.x == 0) {
        for (kiln_u32 s = 0; s < stages; s++) {
            asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(saddr(&full[s])));
            asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(saddr(&empty[s])), "r"(warps));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

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

// One arrival on the barrier.
__device__ __forceinline__ void bar_arrive(kiln_u32 bar)
{
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(bar) : "memory");
}

// This thread's arrival once its cp.async copies so far have landed, one of
// the arrivals the barrier was initialized to expect (.noinc).
__device__ __forceinline__ void bar_arrive_cp_async(kiln_u32 bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(bar) : "memory");
}

// Adds bytes to the barrier's expected transactions without arriving (for a
// thread whose arrival comes from cp.async.mbarrier.arrive).
__device__ __forceinline__ void expect_only(kiln_u32 bar, kiln_u32 bytes)
{
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma(kiln_u32 dst, const kiln_tmap *m, kiln_u32 c0, kiln_u32 c1, kiln_u32 bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(m), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void tma3(kiln_u32 dst, const kiln_tmap *m, kiln_u32 c0, kiln_u32 c1, kiln_u32 c2,
                                     kiln_u32 bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
                 "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

#endif

// Byte offset of (row r, 16-byte chunk c) in a tile of 128-byte rows whose
// base is 1024-byte aligned, as TMA's 128-byte swizzle lays it out.
__device__ __forceinline__ kiln_u32 swz(kiln_u32 r, kiln_u32 c) { return r * 128 + ((c ^ (r & 7)) << 4); }

