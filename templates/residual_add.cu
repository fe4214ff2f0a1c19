// Residual add: out = elt(a + b) over tensors of n kiln_elt (f16, or bf16
// when KILN_BF16 = 1; rows of KILN_HIDDEN, contiguous: the sum is
// elementwise). The sum is the f32 sum rounded to nearest: f32 carries
// 24 >= 2p + 2 significant bits (p = 11 for f16, 8 for bf16), so the double
// rounding is innocuous and the result is the correctly rounded sum. f16 does
// it in one add.rn.f16x2; bf16 adds in f32 and rounds (add.bf16x2 needs
// sm_90). out may be a or b itself (in place): each element is read by the
// thread that writes it, before it writes it.
//
// One vector (VEC elements) per thread, n (vectors: elements / VEC) a launch
// argument, so one kernel serves every token count; the block size is chosen
// at launch (small blocks for few tokens spread the rows over many SMs, large
// ones for many tokens), and a grid smaller than n / block strides: faster
// than several vectors a thread, a block a row or a resident grid with the
// next chunk in flight, at every size build/bench/bench_norm_argmax times.
// Constants: KILN_BF16, KILN_HIDDEN, KILN_VEC (8 = 16-byte vectors, 1 = scalar),
// KILN_THREADS (the largest block it is launched with).
#include "kiln_reduce.cuh"

//! kiln:entry kiln_residual_add

#if KILN_HIDDEN % KILN_VEC != 0
#error "KILN_VEC must divide KILN_HIDDEN"
#endif
#if KILN_THREADS % 32 != 0 || KILN_THREADS > 1024
#error "KILN_THREADS must be a multiple of 32, at most 1024"
#endif

#if KILN_VEC == 8
typedef kiln_u32x4 vec_t;
__device__ __forceinline__ vec_t load(const vec_t *p) { return kiln_ldg16(p); }
__device__ __forceinline__ void store(vec_t *p, vec_t v) { kiln_stg16(p, v); }
__device__ __forceinline__ kiln_u32 add2(kiln_u32 a, kiln_u32 b)
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
__device__ __forceinline__ vec_t add(vec_t a, vec_t b)
{
    vec_t r;
    r.x = add2(a.x, b.x);
    r.y = add2(a.y, b.y);
    r.z = add2(a.z, b.z);
    r.w = add2(a.w, b.w);
    return r;
}
#elif KILN_VEC == 1
typedef kiln_elt vec_t;
__device__ __forceinline__ vec_t load(const vec_t *p)
{
    kiln_elt v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void store(vec_t *p, vec_t v) { asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory"); }
__device__ __forceinline__ vec_t add(vec_t a, vec_t b)
{
#if KILN_BF16
    return kiln_f32_to_elt(kiln_elt_to_f32(a) + kiln_elt_to_f32(b));
#else
    kiln_f16 r;
    asm("add.rn.f16 %0, %1, %2;" : "=h"(r) : "h"(a), "h"(b));
    return r;
#endif
}
#else
#error "KILN_VEC must be 8 or 1"
#endif

extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_residual_add(const kiln_elt *a, const kiln_elt *b, kiln_elt *out, kiln_u64 n)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    const kiln_u64 step = (kiln_u64)gridDim.x * blockDim.x;
    for (kiln_u64 k = (kiln_u64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += step)
        store((vec_t *)out + k, add(load((const vec_t *)a + k), load((const vec_t *)b + k)));
}
