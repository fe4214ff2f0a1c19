// Reductions and small helpers shared by kiln's normalization and sampling
// templates: warp shuffles and block reductions through inline PTX, f16x8
// vector conversions, and the sm_90 cluster primitives the multi-block argmax
// uses. No toolkit header, like the prelude; its bytes are part of the
// fingerprint of every template that includes it.
#pragma once
#include "kiln_prelude.cuh"

__device__ __forceinline__ kiln_u32 kiln_shfl_xor_u32(kiln_u32 v, int lane_mask)
{
    kiln_u32 r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(v), "r"(lane_mask));
    return r;
}

__device__ __forceinline__ float kiln_shfl_xor_f32(float v, int lane_mask)
{
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(lane_mask));
    return r;
}

__device__ __forceinline__ float kiln_warp_sum(float v)
{
#pragma unroll
    for (int m = 16; m; m >>= 1)
        v += kiln_shfl_xor_f32(v, m);
    return v;
}

__device__ __forceinline__ kiln_u64 kiln_warp_max_u64(kiln_u64 v)
{
#pragma unroll
    for (int m = 16; m; m >>= 1) {
        kiln_u64 o = ((kiln_u64)kiln_shfl_xor_u32((kiln_u32)(v >> 32), m) << 32) | kiln_shfl_xor_u32((kiln_u32)v, m);
        v = o > v ? o : v;
    }
    return v;
}

// The sum over the block, returned to every thread. scratch holds WARPS
// floats; one __syncthreads, so a second reduction needs its own scratch.
template <int WARPS>
__device__ __forceinline__ float kiln_block_sum(float v, float *scratch)
{
    v = kiln_warp_sum(v);
    if (WARPS == 1)
        return v;
    if ((threadIdx.x & 31) == 0)
        scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = (threadIdx.x & 31) < WARPS ? scratch[threadIdx.x & 31] : 0.0f;
    return kiln_warp_sum(t);
}

template <int WARPS>
__device__ __forceinline__ kiln_u64 kiln_block_max_u64(kiln_u64 v, kiln_u64 *scratch)
{
    v = kiln_warp_max_u64(v);
    if (WARPS == 1)
        return v;
    if ((threadIdx.x & 31) == 0)
        scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    kiln_u64 t = (threadIdx.x & 31) < WARPS ? scratch[threadIdx.x & 31] : 0ull;
    return kiln_warp_max_u64(t);
}

__device__ __forceinline__ kiln_u32 kiln_f32_bits(float f)
{
    kiln_u32 u;
    asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f));
    return u;
}

__device__ __forceinline__ float kiln_sqrt_rn(float f)
{
    float r;
    asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(f));
    return r;
}

// Coherent 16-byte load (for data this kernel may itself have written).
__device__ __forceinline__ kiln_u32x4 kiln_ld16(const void *p)
{
    kiln_u32x4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ kiln_u64 kiln_ldg8(const void *p)
{
    kiln_u64 v;
    asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

// Two kiln_elt (f16 or bf16 by KILN_BF16) of a 32-bit word to f32 (low half
// first) and back (rounding to nearest even), and eight of a 16-byte vector.
__device__ __forceinline__ void kiln_e2_to_f32(kiln_u32 w, float *lo, float *hi)
{
#if KILN_BF16
    *lo = __uint_as_float(w << 16);
    *hi = __uint_as_float(w & 0xffff0000u);
#else
    *lo = kiln_f16_to_f32((kiln_f16)(w & 0xffffu));
    *hi = kiln_f16_to_f32((kiln_f16)(w >> 16));
#endif
}

__device__ __forceinline__ kiln_u32 kiln_f32_to_e2(float lo, float hi)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    // The paired conversion needs sm_80; f16 rounds each half alone (bf16
    // never compiles before sm_80).
    return (kiln_u32)kiln_f32_to_f16(lo) | (kiln_u32)kiln_f32_to_f16(hi) << 16;
#else
    kiln_u32 w;
    asm("cvt.rn." KILN_ELT_PTX "x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
#endif
}

__device__ __forceinline__ void kiln_e8_to_f32(kiln_u32x4 v, float *f)
{
    kiln_e2_to_f32(v.x, &f[0], &f[1]);
    kiln_e2_to_f32(v.y, &f[2], &f[3]);
    kiln_e2_to_f32(v.z, &f[4], &f[5]);
    kiln_e2_to_f32(v.w, &f[6], &f[7]);
}

__device__ __forceinline__ kiln_u32x4 kiln_f32_to_e8(const float *f)
{
    kiln_u32x4 v;
    v.x = kiln_f32_to_e2(f[0], f[1]);
    v.y = kiln_f32_to_e2(f[2], f[3]);
    v.z = kiln_f32_to_e2(f[4], f[5]);
    v.w = kiln_f32_to_e2(f[6], f[7]);
    return v;
}

// The correctly rounded sum of two kiln_elt (one, two in a word, eight in a
// 16-byte vector): f16 in add.rn.f16 / add.rn.f16x2; bf16 adds in f32 and
// rounds (add.bf16x2 needs sm_90). f32 carries 24 >= 2p + 2 significant bits
// (p = 11 for f16, 8 for bf16), so rounding the f32 sum is correct rounding.
__device__ __forceinline__ kiln_elt kiln_elt_add(kiln_elt a, kiln_elt b)
{
#if KILN_BF16
    return kiln_f32_to_elt(kiln_elt_to_f32(a) + kiln_elt_to_f32(b));
#else
    kiln_f16 r;
    asm("add.rn.f16 %0, %1, %2;" : "=h"(r) : "h"(a), "h"(b));
    return r;
#endif
}

__device__ __forceinline__ kiln_u32 kiln_e2_add(kiln_u32 a, kiln_u32 b)
{
#if KILN_BF16
    float a0, a1, b0, b1;
    kiln_e2_to_f32(a, &a0, &a1);
    kiln_e2_to_f32(b, &b0, &b1);
    return kiln_f32_to_e2(a0 + b0, a1 + b1);
#else
    kiln_u32 r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
#endif
}

__device__ __forceinline__ kiln_u32x4 kiln_e8_add(kiln_u32x4 a, kiln_u32x4 b)
{
    kiln_u32x4 r;
    r.x = kiln_e2_add(a.x, b.x);
    r.y = kiln_e2_add(a.y, b.y);
    r.z = kiln_e2_add(a.z, b.z);
    r.w = kiln_e2_add(a.w, b.w);
    return r;
}

// ---- sm_90 thread block clusters ----

__device__ __forceinline__ kiln_u32 kiln_cluster_rank()
{
    kiln_u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// Arrive without ordering: pairs with a later kiln_cluster_wait, which then
// guarantees every block of the cluster has started (before touching another
// block's shared memory).
__device__ __forceinline__ void kiln_cluster_arrive_relaxed()
{
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void kiln_cluster_arrive()
{
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void kiln_cluster_wait()
{
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Stores v at the address that p (this block's shared memory) has in the
// shared memory of the cluster's block rank.
__device__ __forceinline__ void kiln_cluster_store_u64(const void *p, kiln_u32 rank, kiln_u64 v)
{
    asm volatile("{\n\t.reg .u64 g;\n\t.reg .u32 s, d;\n\t"
                 "cvta.to.shared.u64 g, %0;\n\tcvt.u32.u64 s, g;\n\t"
                 "mapa.shared::cluster.u32 d, s, %1;\n\t"
                 "st.shared::cluster.u64 [d], %2;\n\t}"
                 ::"l"(p), "r"(rank), "l"(v)
                 : "memory");
}
