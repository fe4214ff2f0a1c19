// Dense SwiGLU, the elementwise half: out[t, i] = silu(gu[t, i]) * gu[t, I + i]
// with silu(g) = g / (1 + exp(-g)), computed in f32, stored as kiln_elt (f16,
// or bf16 with KILN_BF16: kiln_prelude.cuh).
// gu [tokens, 2 * I] is the gate/up product (gate first: the weight's first I
// rows are HF's gate_proj, the next I its up_proj); out is [tokens, I].
// Constants: KILN_INTERMEDIATE (I), KILN_VEC (elements per access: 8 = 16-byte
// vectors, 1 = scalar), KILN_THREADS (threads per block; the provider
// computes it). Each block covers KILN_THREADS * KILN_ITEMS vectors of one
// token's row: gridDim.x = tokens, gridDim.y = the blocks a row takes (the
// provider's blocks_for()), so a batch of tokens spreads over the SMs. The
// token count is a launch parameter, not a constant: one kernel serves every
// batch.
#include "kiln_reduce.cuh" // kiln_e2_to_f32, kiln_f32_to_e2 (and the prelude)

//! kiln:entry kiln_swiglu

#if KILN_INTERMEDIATE % KILN_VEC != 0
#error "KILN_VEC must divide KILN_INTERMEDIATE"
#endif
#define KILN_VECS (KILN_INTERMEDIATE / KILN_VEC)
#define KILN_ITEMS 2

__device__ __forceinline__ float silu_mul(float g, float u)
{
    float e;
    // exp(-g) = 2^(-g * log2(e)); ex2.approx is exact to about 2 ulp and gives
    // +inf for large arguments, where g / inf = -0 is silu's limit.
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-g * 1.4426950408889634f));
    return g / (1.0f + e) * u;
}

#if KILN_VEC == 8
__device__ __forceinline__ kiln_u32 pair(kiln_u32 g, kiln_u32 u)
{
    float g0, g1, u0, u1;
    kiln_e2_to_f32(g, &g0, &g1);
    kiln_e2_to_f32(u, &u0, &u1);
    return kiln_f32_to_e2(silu_mul(g0, u0), silu_mul(g1, u1));
}
#elif KILN_VEC != 1
#error "KILN_VEC must be 8 or 1"
#endif

extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_swiglu(const kiln_elt *__restrict__ gu, kiln_elt *__restrict__ out)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    const kiln_u64 t = blockIdx.x;
    const kiln_elt *gate = gu + t * (2ull * KILN_INTERMEDIATE);
    const kiln_elt *up = gate + KILN_INTERMEDIATE;
    kiln_elt *dst = out + t * (kiln_u64)KILN_INTERMEDIATE;
    const int first = blockIdx.y * (KILN_THREADS * KILN_ITEMS) + threadIdx.x;
#if KILN_VEC == 8
    // Both vectors' loads first, then their arithmetic and stores.
    kiln_u32x4 g[KILN_ITEMS], u[KILN_ITEMS];
#pragma unroll
    for (int i = 0; i < KILN_ITEMS; i++) {
        const int k = first + i * KILN_THREADS;
        if (k < KILN_VECS) {
            g[i] = kiln_ldg16(gate + k * 8);
            u[i] = kiln_ldg16(up + k * 8);
        }
    }
#pragma unroll
    for (int i = 0; i < KILN_ITEMS; i++) {
        const int k = first + i * KILN_THREADS;
        if (k < KILN_VECS) {
            kiln_u32x4 r;
            r.x = pair(g[i].x, u[i].x);
            r.y = pair(g[i].y, u[i].y);
            r.z = pair(g[i].z, u[i].z);
            r.w = pair(g[i].w, u[i].w);
            kiln_stg16(dst + k * 8, r);
        }
    }
#else
#pragma unroll
    for (int i = 0; i < KILN_ITEMS; i++) {
        const int k = first + i * KILN_THREADS;
        if (k < KILN_INTERMEDIATE)
            dst[k] = kiln_f32_to_elt(silu_mul(kiln_elt_to_f32(gate[k]), kiln_elt_to_f32(up[k])));
    }
#endif
}
