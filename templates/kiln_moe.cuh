// What the routed experts' kernels share: the arguments of the grouped
// products, one list for the mma.sync tiles (moe_experts.cu) and the wgmma
// ones (moe_experts_wgmma.cu): the A rows' source (x, or h), the experts'
// weights, the output (h, or y), and the group kernel's tile list and
// permutation; and the combine's step (moe_experts.cu's combine kernel, the
// TMA down kernel's last blocks in moe_experts_tma.cu).
#pragma once
#include "kiln_prelude.cuh"
#include "kiln_reduce.cuh" // kiln_e8_to_f32, kiln_f32_to_e8

#define KILN_MOE_GEMM_ARGS                                                                                        \
    const kiln_elt *__restrict__ src, const kiln_elt *__restrict__ w, kiln_elt *__restrict__ dst,              \
        const kiln_u32 *__restrict__ n_tiles, const kiln_u32 *__restrict__ offsets,                              \
        const kiln_u32 *__restrict__ tile_e, const kiln_u32 *__restrict__ tile_r,                                \
        const kiln_u32 *__restrict__ sorted

// 16-byte load through L2 (not L1: other blocks of the kernel wrote it).
__device__ __forceinline__ kiln_u32x4 kiln_moe_ldcg16(const void *p)
{
    kiln_u32x4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// Elements [8 v, 8 v + 8) of token t's output: out[t] = elt(sum_s wt[s]
// y[pos[s]] + c shared[t]) over the slots that have a row (pos[s] is not
// 0xffffffff), f32 sums in slot order, one rounding; the shared term only
// with shared. Rows of KILN_HIDDEN elements; y through L2 where L2 (a
// kernel's other blocks wrote it), else the read-only path.
template <bool L2>
__device__ __forceinline__ void kiln_moe_combine_piece(const kiln_elt *__restrict__ y, const kiln_u32 *pos,
                                                       const float *wt, const kiln_elt *__restrict__ shared, float c,
                                                       kiln_elt *__restrict__ out, kiln_u64 t, kiln_u32 v)
{
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int s = 0; s < KILN_TOP_K; s++) {
        if (pos[s] == 0xffffffffu)
            continue;
        const kiln_elt *p = y + (kiln_u64)pos[s] * KILN_HIDDEN + v * 8;
        float f[8];
        kiln_e8_to_f32(L2 ? kiln_moe_ldcg16(p) : kiln_ldg16(p), f);
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc[j] += wt[s] * f[j];
    }
    if (shared) {
        float f[8];
        kiln_e8_to_f32(kiln_ldg16(shared + t * KILN_HIDDEN + v * 8), f);
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc[j] += c * f[j];
    }
    kiln_stg16(out + t * KILN_HIDDEN + v * 8, kiln_f32_to_e8(acc));
}
