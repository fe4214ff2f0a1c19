// Last-token gather: rows[p, :] = x[row(p), :] for each participant p, where
// spans[p] = (start, length), u32 pairs in device memory, and
//     row(p) = p * part_rows + start + length - 1.
// Packed coordinates: x is [tokens, IN], part_rows = 0 and limit = tokens
// (start indexes the packed rows). Source coordinates: x is [P, S, IN],
// part_rows = limit = S (start indexes the participant's own rows).
// A span with length 0, or with start + length past limit, is never read: its
// row is zeroed and the fault record names the lowest such participant
// (KILN_FAULT_EMPTY_SPAN: value 0, limit 0; KILN_FAULT_SPAN_PAST_END: value
// start + length, saturated to 2^32 - 1, and limit).
// Constants: KILN_IN (row length), KILN_VEC (8 = 16-byte vectors, 1 = scalar),
// KILN_THREADS, KILN_BF16 (the element type: rows are copied, not converted,
// so only the spec tells f16 and bf16 apart). One block per participant; the
// participant count, token count and coordinates are launch parameters, so
// one kernel serves every batch.
#include "kiln_prelude.cuh"

//! kiln:entry kiln_gather_last

#define KILN_FAULT_EMPTY_SPAN 2u
#define KILN_FAULT_SPAN_PAST_END 3u

#if KILN_IN % KILN_VEC != 0
#error "KILN_VEC must divide KILN_IN"
#endif
#define KILN_VECS (KILN_IN / KILN_VEC)
#define KILN_ITEMS ((KILN_VECS + KILN_THREADS - 1) / KILN_THREADS)
#define KILN_CHUNK (KILN_ITEMS < 8 ? KILN_ITEMS : 8)

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
kiln_gather_last(const kiln_elt *__restrict__ x, const kiln_u32 *__restrict__ spans, kiln_elt *__restrict__ rows,
                 kiln_u32 part_rows, kiln_u32 limit, kiln_fault *fault)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    const kiln_u32 p = blockIdx.x;
    const kiln_u32 start = spans[2 * p], length = spans[2 * p + 1];
    const kiln_u64 end = (kiln_u64)start + length;
    kiln_vec *dst = (kiln_vec *)(rows + (kiln_u64)p * KILN_IN);
    if (length == 0 || end > limit) {
        if (threadIdx.x == 0) {
            if (length == 0)
                kiln_report_fault(fault, KILN_FAULT_EMPTY_SPAN, p, 0, 0);
            else
                kiln_report_fault(fault, KILN_FAULT_SPAN_PAST_END, p,
                                  end > 0xffffffffull ? 0xffffffffu : (kiln_u32)end, limit);
        }
        for (int k = threadIdx.x; k < KILN_VECS; k += KILN_THREADS)
            store_vec(dst + k, zero_vec());
        return;
    }
    const kiln_u64 row = (kiln_u64)p * part_rows + end - 1;
    const kiln_vec *src = (const kiln_vec *)(x + row * KILN_IN);
#pragma unroll 1
    for (int base = 0; base < KILN_ITEMS; base += KILN_CHUNK) {
        kiln_vec v[KILN_CHUNK];
#pragma unroll
        for (int i = 0; i < KILN_CHUNK; i++) {
            const int k = threadIdx.x + (base + i) * KILN_THREADS;
            if (k < KILN_VECS)
                v[i] = load_vec(src + k);
        }
#pragma unroll
        for (int i = 0; i < KILN_CHUNK; i++) {
            const int k = threadIdx.x + (base + i) * KILN_THREADS;
            if (k < KILN_VECS)
                store_vec(dst + k, v[i]);
        }
    }
}
