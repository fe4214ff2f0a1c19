// Residual add: out = elt(a + b) over tensors of n kiln_elt (f16, or bf16
// when KILN_BF16 = 1; rows of KILN_HIDDEN, contiguous: the sum is
// elementwise), correctly rounded (kiln_reduce.cuh's kiln_e8_add and
// kiln_elt_add). out may be a or b itself (in place): each element is read by the
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
__device__ __forceinline__ vec_t add(vec_t a, vec_t b) { return kiln_e8_add(a, b); }
#elif KILN_VEC == 1
typedef kiln_elt vec_t;
__device__ __forceinline__ vec_t load(const vec_t *p)
{
    kiln_elt v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void store(vec_t *p, vec_t v) { asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory"); }
__device__ __forceinline__ vec_t add(vec_t a, vec_t b) { return kiln_elt_add(a, b); }
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
