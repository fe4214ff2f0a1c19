// The arguments of the routed experts' grouped products, one list for the
// mma.sync tiles (moe_experts.cu) and the wgmma ones (moe_experts_wgmma.cu):
// the A rows' source (x, or h), the experts' weights, the output (h, or y),
// and the group kernel's tile list and permutation.
#pragma once
#include "kiln_prelude.cuh"

#define KILN_MOE_GEMM_ARGS                                                                                        \
    const kiln_elt *__restrict__ src, const kiln_elt *__restrict__ w, kiln_elt *__restrict__ dst,              \
        const kiln_u32 *__restrict__ n_tiles, const kiln_u32 *__restrict__ offsets,                              \
        const kiln_u32 *__restrict__ tile_e, const kiln_u32 *__restrict__ tile_r,                                \
        const kiln_u32 *__restrict__ sorted
