// Token embedding: out[t, :] = table[ids[t], :], rows of kiln_elt (f16, or
// bf16 when KILN_BF16 = 1: the bytes are copied as they are, so the two
// differ only in their fingerprint and the dtype the provider checks).
// Constants: KILN_BF16, KILN_HIDDEN (row length), KILN_VOCAB (rows in the
// table), KILN_VEC (elements per access: 8 = 16-byte vectors, 1 = scalar),
// KILN_THREADS (threads per block; the provider computes it).
// One block per token; launches of at most 65535 tokens start at token_base.
// A token id at or past KILN_VOCAB is never read: its row is zeroed and the
// fault record names the lowest such index.
#include "kiln_prelude.cuh"

//! kiln:entry kiln_token_embedding

#if KILN_HIDDEN % KILN_VEC != 0
#error "KILN_VEC must divide KILN_HIDDEN"
#endif
#define KILN_VECS (KILN_HIDDEN / KILN_VEC)
#define KILN_ITEMS ((KILN_VECS + KILN_THREADS - 1) / KILN_THREADS)

#if KILN_VEC == 8
typedef kiln_u32x4 kiln_vec;
__device__ __forceinline__ kiln_vec load_vec(const kiln_vec *p) { return kiln_ldg16(p); }
__device__ __forceinline__ void store_vec(kiln_vec *p, kiln_vec v) { kiln_stg16(p, v); }
__device__ __forceinline__ kiln_vec zero_vec() { kiln_vec v = {0, 0, 0, 0}; return v; }
#elif KILN_VEC == 1
typedef kiln_elt kiln_vec;
__device__ __forceinline__ kiln_vec load_vec(const kiln_vec *p) { return *p; }
__device__ __forceinline__ void store_vec(kiln_vec *p, kiln_vec v) { *p = v; }
__device__ __forceinline__ kiln_vec zero_vec() { return 0; }
#else
#error "KILN_VEC must be 8 or 1"
#endif

extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_token_embedding(const kiln_elt *__restrict__ table, const kiln_u32 *__restrict__ ids,
                     kiln_elt *__restrict__ out, kiln_u32 token_base, kiln_fault *fault)
{
    kiln_grid_dependency_sync();
    const kiln_u32 t = token_base + blockIdx.x;
    const kiln_u32 id = ids[t];
    kiln_vec *dst = (kiln_vec *)(out + (kiln_u64)t * KILN_HIDDEN);
    if (id >= (kiln_u32)KILN_VOCAB) {
        if (threadIdx.x == 0)
            kiln_report_fault(fault, KILN_FAULT_TOKEN_ID, t, id, KILN_VOCAB);
#pragma unroll
        for (int i = 0; i < KILN_ITEMS; i++) {
            const int k = threadIdx.x + i * KILN_THREADS;
            if (KILN_ITEMS * KILN_THREADS == KILN_VECS || k < KILN_VECS)
                store_vec(dst + k, zero_vec());
        }
        return;
    }
    const kiln_vec *src = (const kiln_vec *)(table + (kiln_u64)id * KILN_HIDDEN);
    kiln_vec v[KILN_ITEMS];
    // All loads first, then all stores: more bytes in flight per thread.
#pragma unroll
    for (int i = 0; i < KILN_ITEMS; i++) {
        const int k = threadIdx.x + i * KILN_THREADS;
        if (KILN_ITEMS * KILN_THREADS == KILN_VECS || k < KILN_VECS)
            v[i] = load_vec(src + k);
    }
#pragma unroll
    for (int i = 0; i < KILN_ITEMS; i++) {
        const int k = threadIdx.x + i * KILN_THREADS;
        if (KILN_ITEMS * KILN_THREADS == KILN_VECS || k < KILN_VECS)
            store_vec(dst + k, v[i]);
    }
}
