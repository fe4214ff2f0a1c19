// Mixture-of-experts routing after the gate product (include/kiln/op_moe.h
// is the contract): per token, softmax over the experts' logits in f32, the
// top k experts by probability (the lower expert on ties), their weights,
// optionally renormalized to sum 1. A warp a token: lane l holds experts l,
// l + 32, ... in registers; k rounds of a warp-wide selection.
// Constants: KILN_BF16 (the logits' element type), KILN_EXPERTS (1..512),
// KILN_TOP_K (1..min(16, experts)), KILN_NORMALIZE (0, 1). Grid: ceil(T / 8)
// blocks of 256 threads.
#include "kiln_reduce.cuh"

//! kiln:entry kiln_moe_router

#define E KILN_EXPERTS
#define K KILN_TOP_K
#define EPL ((E + 31) / 32) // experts a lane holds
#define WARPS 8

__device__ __forceinline__ float neg_inf_f32() { return __int_as_float(0xff800000); }

#if E < 1 || E > 512 || K < 1 || K > 16 || K > E
#error "KILN_EXPERTS must be in [1, 512] and KILN_TOP_K in [1, min(16, experts)]"
#endif

// Whether candidate (va, ia) ranks before (vb, ib): the greater value, then
// the lower expert; a NaN below every number.
__device__ __forceinline__ bool ranks_before(float va, kiln_u32 ia, float vb, kiln_u32 ib)
{
    const bool na = va != va, nb = vb != vb;
    if (na != nb)
        return nb;
    if (!na && va != vb)
        return va > vb;
    return ia < ib;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
kiln_moe_router(const kiln_elt *__restrict__ logits, kiln_u32 *__restrict__ ids, float *__restrict__ weights,
                kiln_u32 tokens)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    const kiln_u32 lane = threadIdx.x % 32, t = blockIdx.x * WARPS + threadIdx.x / 32;
    if (t >= tokens)
        return;
    const kiln_elt *row = logits + (kiln_u64)t * E;
    float p[EPL];
    float mx = neg_inf_f32();
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const kiln_u32 e = lane + 32 * j;
        p[j] = e < E ? kiln_elt_to_f32(row[e]) : neg_inf_f32();
        mx = fmaxf(mx, p[j]); // fmaxf drops a NaN: the row's max of its numbers
    }
#pragma unroll
    for (int m = 16; m; m >>= 1)
        mx = fmaxf(mx, kiln_shfl_xor_f32(mx, m));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        p[j] = lane + 32 * j < E ? expf(p[j] - mx) : 0.0f;
        sum += p[j];
    }
#pragma unroll
    for (int m = 16; m; m >>= 1)
        sum += kiln_shfl_xor_f32(sum, m);
#pragma unroll
    for (int j = 0; j < EPL; j++)
        p[j] /= sum;

    kiln_u32 used = 0; // bit j: expert lane + 32 j is chosen
    float w[K];
    kiln_u32 id[K];
#pragma unroll
    for (int r = 0; r < K; r++) {
        // This lane's best unused expert (none: index 0xffffffff).
        float bv = 0.0f;
        kiln_u32 bi = 0xffffffffu;
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            const kiln_u32 e = lane + 32 * j;
            if (e < E && !(used >> j & 1u) && (bi == 0xffffffffu || ranks_before(p[j], e, bv, bi))) {
                bv = p[j];
                bi = e;
            }
        }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        // Two warp reductions (redux.sync): the greatest key, then the lowest
        // expert holding it. A probability is >= 0, so its bits order as it
        // does; + 1 puts every number above a NaN, and a NaN level with a lane
        // that has none left (key 0, index 0xffffffff never the minimum).
        const kiln_u32 key = bi == 0xffffffffu || bv != bv ? 0u : __float_as_uint(bv) + 1u;
        const kiln_u32 top = __reduce_max_sync(0xffffffffu, key);
        bi = __reduce_min_sync(0xffffffffu, key == top ? bi : 0xffffffffu);
        bv = __shfl_sync(0xffffffffu, bv, bi % 32);
#else
#pragma unroll
        for (int m = 16; m; m >>= 1) {
            const float ov = kiln_shfl_xor_f32(bv, m);
            const kiln_u32 oi = __shfl_xor_sync(0xffffffffu, bi, m);
            if (oi != 0xffffffffu && (bi == 0xffffffffu || ranks_before(ov, oi, bv, bi))) {
                bv = ov;
                bi = oi;
            }
        }
#endif
        // K <= E: an unused expert is left, so bi is one.
        if (bi % 32 == lane)
            used |= 1u << (bi / 32);
        w[r] = bv;
        id[r] = bi;
    }
    float norm = 1.0f;
#if KILN_NORMALIZE
    float s = 0.0f;
#pragma unroll
    for (int r = 0; r < K; r++)
        s += w[r];
    norm = s;
#endif
    if (lane < K) {
        // Lane r stores the r-th choice (registers are indexed statically).
        float wr = 0.0f;
        kiln_u32 ir = 0;
#pragma unroll
        for (int r = 0; r < K; r++)
            if (lane == r) {
                wr = w[r];
                ir = id[r];
            }
        ids[(kiln_u64)t * K + lane] = ir;
        weights[(kiln_u64)t * K + lane] = KILN_NORMALIZE ? wr / norm : wr;
    }
}
