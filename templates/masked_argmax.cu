// Last-token masked argmax with repetition penalty, one cluster of
// KILN_CLUSTER blocks per participant (sm_90 thread block clusters):
//   for token t of participant p, with l = logits[p, t] in f32:
//     eligible when valid[t] != 0 and l is not NaN (after the penalty);
//     repeated (t among rep_ids[rep_offsets[p] .. rep_offsets[p + 1])):
//       l = l > 0 ? l / penalty : l * penalty  (f32, round to nearest; once,
//       however often t is listed);
//   out[p] = the eligible t of largest l, the lowest t on ties (-0 == +0),
//   or 0xffffffff (KILN_ARGMAX_NONE) when no token is eligible.
// Logits are read, never written. Ids at or past the vocabulary are ignored;
// offsets are clamped to [0, rep_capacity] (a range that ends before it
// starts is empty).
//
// Each block reduces a contiguous slice of the vocabulary: it scans the
// participant's repetition ids into a shared-memory bitmap of its slice, then
// keys every token as (order-preserving bits of l) << 32 | ~t, so that the
// largest key is the answer, and stores its block maximum into the shared
// memory of the cluster's first block, which writes out[p]. No workspace, no
// counters: nothing persists between launches.
//
// Constants: KILN_VOCAB, KILN_VEC (8: 16-byte logit vectors, needs vocab % 8
// == 0; 1: scalar), KILN_THREADS, KILN_CLUSTER (blocks per participant, <= 8).
#include "kiln_reduce.cuh"

//! kiln:entry kiln_masked_argmax

#if KILN_VOCAB % KILN_VEC != 0
#error "KILN_VEC must divide KILN_VOCAB"
#endif
#if KILN_CLUSTER < 1 || KILN_CLUSTER > 8
#error "KILN_CLUSTER must be 1..8 (the portable cluster size)"
#endif
#if KILN_THREADS % 32 != 0 || KILN_THREADS > 1024
#error "KILN_THREADS must be a multiple of 32, at most 1024"
#endif

#define NV (KILN_VOCAB / KILN_VEC)                          // vectors in a row
#define CHUNKV ((NV + KILN_CLUSTER - 1) / KILN_CLUSTER)     // vectors per block
#define UNROLL (KILN_VEC == 8 ? 4 : 8)                      // vectors per thread per pass
#define BATCHV (KILN_THREADS * UNROLL)
#define SUB_TOKENS 131072                                   // bitmap of 16 KiB
#define SUBV (CHUNKV * KILN_VEC < SUB_TOKENS ? CHUNKV : SUB_TOKENS / KILN_VEC)
#define BITMAP_WORDS ((SUBV * KILN_VEC + 31) / 32)
// A slice that one pass covers: loads go out before the bitmap is built.
#define ONE_PASS (CHUNKV <= BATCHV && SUBV == CHUNKV)
#define WARPS (KILN_THREADS / 32)

#define KILN_ARGMAX_NONE 0xffffffffu

#if KILN_VEC == 8
typedef kiln_u32x4 lvec_t;  // 8 logits
typedef kiln_u64 mvec_t;    // 8 mask bytes
__device__ __forceinline__ lvec_t load_logits(const kiln_f16 *row, kiln_u32 v) { return kiln_ldg16(row + (kiln_u64)v * 8); }
__device__ __forceinline__ mvec_t load_mask(const unsigned char *m, kiln_u32 v) { return kiln_ldg8(m + (kiln_u64)v * 8); }
__device__ __forceinline__ void unpack(lvec_t l, mvec_t m, float *f, kiln_u32 *ok)
{
    kiln_h8_to_f32(l, f);
#pragma unroll
    for (int e = 0; e < 8; e++)
        ok[e] = (kiln_u32)(m >> (8 * e)) & 0xffu;
}
#elif KILN_VEC == 1
typedef kiln_f16 lvec_t;
typedef kiln_u32 mvec_t;
__device__ __forceinline__ lvec_t load_logits(const kiln_f16 *row, kiln_u32 v)
{
    kiln_f16 h;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(h) : "l"(row + v));
    return h;
}
__device__ __forceinline__ mvec_t load_mask(const unsigned char *m, kiln_u32 v)
{
    kiln_u32 b;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(b) : "l"(m + v));
    return b;
}
__device__ __forceinline__ void unpack(lvec_t l, mvec_t m, float *f, kiln_u32 *ok)
{
    f[0] = kiln_f16_to_f32(l);
    ok[0] = m & 0xffu;
}
#else
#error "KILN_VEC must be 8 or 1"
#endif

// The key of an eligible value: order-preserving bits, -0 as +0, and ~t so
// that among equal values the lowest token has the largest key. Never 0.
__device__ __forceinline__ kiln_u64 key_of(float f, kiln_u32 t)
{
    kiln_u32 b = kiln_f32_bits(f);
    if (b == 0x80000000u)
        b = 0;
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((kiln_u64)b << 32) | (kiln_u32)~t;
}

__device__ __forceinline__ bool repeated(const kiln_u32 *bits, kiln_u32 rel)
{
    return (bits[rel >> 5] >> (rel & 31)) & 1u;
}

// Folds vector v (tokens v*VEC ..) into best; base is the first token the bitmap covers.
__device__ __forceinline__ kiln_u64 consider(kiln_u64 best, lvec_t l, mvec_t m, kiln_u32 v, kiln_u32 base,
                                             const kiln_u32 *bits, float penalty)
{
    float f[KILN_VEC];
    kiln_u32 ok[KILN_VEC];
    unpack(l, m, f, ok);
#pragma unroll
    for (int e = 0; e < KILN_VEC; e++) {
        const kiln_u32 t = v * KILN_VEC + e;
        float x = f[e];
        if (repeated(bits, t - base))
            x = x > 0.0f ? x / penalty : x * penalty;
        if (ok[e] && x == x) {
            const kiln_u64 k = key_of(x, t);
            best = k > best ? k : best;
        }
    }
    return best;
}

// Marks the participant's repetition ids that fall in tokens [lo, hi).
__device__ __forceinline__ void mark(kiln_u32 *bits, const kiln_u32 *rep_ids, kiln_u32 a, kiln_u32 b, kiln_u32 lo,
                                     kiln_u32 hi)
{
    for (kiln_u32 j = a + threadIdx.x; j < b; j += KILN_THREADS) {
        const kiln_u32 id = rep_ids[j];
        if (id >= lo && id < hi)
            atomicOr(&bits[(id - lo) >> 5], 1u << ((id - lo) & 31));
    }
}

extern "C" __global__ void __cluster_dims__(KILN_CLUSTER, 1, 1) __launch_bounds__(KILN_THREADS)
kiln_masked_argmax(const kiln_f16 *__restrict__ logits, const unsigned char *__restrict__ valid,
                   const kiln_u32 *__restrict__ rep_ids, const kiln_u32 *__restrict__ rep_offsets,
                   const float *__restrict__ penalty_ptr, kiln_u32 rep_capacity, kiln_u32 *__restrict__ out)
{
    __shared__ kiln_u32 bits[BITMAP_WORDS];
    __shared__ kiln_u64 scratch[WARPS];
    __shared__ kiln_u64 parts[KILN_CLUSTER];
    kiln_cluster_arrive_relaxed();

    const kiln_u32 p = blockIdx.x / KILN_CLUSTER, rank = kiln_cluster_rank();
    const kiln_f16 *row = logits + (kiln_u64)p * KILN_VOCAB;
    const kiln_u32 v_lo = rank * CHUNKV, v_hi = v_lo + CHUNKV < NV ? v_lo + CHUNKV : NV;
    kiln_u32 b = rep_offsets[p + 1], a = rep_offsets[p];
    b = b < rep_capacity ? b : rep_capacity;
    a = a < b ? a : b;
    const float penalty = *penalty_ptr;
    kiln_u64 best = 0;

#if ONE_PASS
    lvec_t l[UNROLL];
    mvec_t m[UNROLL];
#pragma unroll
    for (int i = 0; i < UNROLL; i++) {
        const kiln_u32 v = v_lo + threadIdx.x + i * KILN_THREADS;
        if (v < v_hi) {
            l[i] = load_logits(row, v);
            m[i] = load_mask(valid, v);
        }
    }
    for (int w = threadIdx.x; w < BITMAP_WORDS; w += KILN_THREADS)
        bits[w] = 0;
    __syncthreads();
    mark(bits, rep_ids, a, b, v_lo * KILN_VEC, v_hi * KILN_VEC);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < UNROLL; i++) {
        const kiln_u32 v = v_lo + threadIdx.x + i * KILN_THREADS;
        if (v < v_hi)
            best = consider(best, l[i], m[i], v, v_lo * KILN_VEC, bits, penalty);
    }
#else
    for (kiln_u32 s_lo = v_lo; s_lo < v_hi; s_lo += SUBV) {
        const kiln_u32 s_hi = s_lo + SUBV < v_hi ? s_lo + SUBV : v_hi;
        for (int w = threadIdx.x; w < BITMAP_WORDS; w += KILN_THREADS)
            bits[w] = 0;
        __syncthreads();
        mark(bits, rep_ids, a, b, s_lo * KILN_VEC, s_hi * KILN_VEC);
        __syncthreads();
        for (kiln_u32 base = s_lo; base < s_hi; base += BATCHV) {
            lvec_t l[UNROLL];
            mvec_t m[UNROLL];
#pragma unroll
            for (int i = 0; i < UNROLL; i++) {
                const kiln_u32 v = base + threadIdx.x + i * KILN_THREADS;
                if (v < s_hi) {
                    l[i] = load_logits(row, v);
                    m[i] = load_mask(valid, v);
                }
            }
#pragma unroll
            for (int i = 0; i < UNROLL; i++) {
                const kiln_u32 v = base + threadIdx.x + i * KILN_THREADS;
                if (v < s_hi)
                    best = consider(best, l[i], m[i], v, s_lo * KILN_VEC, bits, penalty);
            }
        }
        __syncthreads(); // the bitmap is cleared again for the next slice
    }
#endif

    best = kiln_block_max_u64<WARPS>(best, scratch);
    kiln_cluster_wait(); // every block of the cluster has started
    if (threadIdx.x == 0)
        kiln_cluster_store_u64(&parts[rank], 0, best);
    kiln_cluster_arrive();
    kiln_cluster_wait();
    if (rank == 0 && threadIdx.x == 0) {
        kiln_u64 m = 0;
#pragma unroll
        for (int r = 0; r < KILN_CLUSTER; r++)
            m = parts[r] > m ? parts[r] : m;
        out[p] = m ? ~(kiln_u32)m : KILN_ARGMAX_NONE;
    }
}
