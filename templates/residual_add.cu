// Residual add: out = f16(a + b) over rows of f16 (the sum in f32, one
// rounding). One block per token; the grid is the token count, a launch
// argument. Constants: KILN_HIDDEN, KILN_VEC (8 = 16-byte vectors, 1 =
// scalar), KILN_THREADS. out may be a or b itself (in place): each element is
// read by the thread that writes it, before it writes it.
#include "kiln_reduce.cuh"

//! kiln:entry kiln_residual_add

#if KILN_HIDDEN % KILN_VEC != 0
#error "KILN_VEC must divide KILN_HIDDEN"
#endif
#define VECS (KILN_HIDDEN / KILN_VEC)
#define ITEMS ((VECS + KILN_THREADS - 1) / KILN_THREADS)
#define FULL (ITEMS * KILN_THREADS == VECS)
#define CACHED (ITEMS * (KILN_VEC == 8 ? 4 : 1) <= 16)

#if KILN_VEC == 8
typedef kiln_u32x4 vec_t;
__device__ __forceinline__ vec_t load(const vec_t *p) { return kiln_ldg16(p); }
__device__ __forceinline__ void store(vec_t *p, vec_t v) { kiln_stg16(p, v); }
__device__ __forceinline__ vec_t add(vec_t a, vec_t b)
{
    float x[8], y[8];
    kiln_h8_to_f32(a, x);
    kiln_h8_to_f32(b, y);
#pragma unroll
    for (int e = 0; e < 8; e++)
        x[e] += y[e];
    return kiln_f32_to_h8(x);
}
#elif KILN_VEC == 1
typedef kiln_f16 vec_t;
__device__ __forceinline__ vec_t load(const vec_t *p)
{
    kiln_f16 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void store(vec_t *p, vec_t v) { asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory"); }
__device__ __forceinline__ vec_t add(vec_t a, vec_t b) { return kiln_f32_to_f16(kiln_f16_to_f32(a) + kiln_f16_to_f32(b)); }
#else
#error "KILN_VEC must be 8 or 1"
#endif

extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_residual_add(const kiln_f16 *a, const kiln_f16 *b, kiln_f16 *out)
{
    const kiln_u64 row = (kiln_u64)blockIdx.x * KILN_HIDDEN;
    const vec_t *ar = (const vec_t *)(a + row), *br = (const vec_t *)(b + row);
    vec_t *orow = (vec_t *)(out + row);
#if CACHED
    vec_t va[ITEMS], vb[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int k = threadIdx.x + i * KILN_THREADS;
        if (FULL || i < ITEMS - 1 || k < VECS) {
            va[i] = load(ar + k);
            vb[i] = load(br + k);
        }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int k = threadIdx.x + i * KILN_THREADS;
        if (FULL || i < ITEMS - 1 || k < VECS)
            store(orow + k, add(va[i], vb[i]));
    }
#else
    for (int k = threadIdx.x; k < VECS; k += KILN_THREADS)
        store(orow + k, add(load(ar + k), load(br + k)));
#endif
}
