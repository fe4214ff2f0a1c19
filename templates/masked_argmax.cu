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
// participant's repetition ids into a shared-memory bitmap of its slice while
// its logits are in flight. Each thread keeps its best value and token,
// visiting its tokens in increasing order (a strictly larger value replaces,
// so the first of equal values stays). Logits are kiln_elt (f16, or bf16 when
// KILN_BF16 = 1). On the 16-byte path a vector of 8 logits is reduced in
// pairs, max.f16x2 or max.bf16x2 (an ineligible token becomes NaN, which max
// ignores; the element type's order is f32 order) unless one of its tokens
// is repeated, and only a vector that beats the thread's best is looked at
// token by token.
// The block's best, keyed as (order-preserving bits of l) << 32 | ~t, goes to
// the shared memory of the cluster's first block, which writes out[p]. No
// workspace, no counters: nothing persists between launches.
//
// Constants: KILN_BF16, KILN_VOCAB, KILN_VEC (8: 16-byte logit vectors, needs vocab % 8
// == 0; 1: scalar), KILN_THREADS, KILN_CLUSTER (blocks per participant, <= 16:
// past 8 the launch needs the non-portable cluster size allowed; 1: one block
// a participant and no cluster, for devices before sm_90), KILN_UNROLL
// (vectors per thread per pass).
#include "kiln_reduce.cuh"

//! kiln:entry kiln_masked_argmax

#if KILN_VOCAB % KILN_VEC != 0
#error "KILN_VEC must divide KILN_VOCAB"
#endif
#if KILN_CLUSTER < 1 || KILN_CLUSTER > 16
#error "KILN_CLUSTER must be 1..16"
#endif
#if KILN_THREADS % 32 != 0 || KILN_THREADS > 1024
#error "KILN_THREADS must be a multiple of 32, at most 1024"
#endif
#if KILN_UNROLL < 1 || KILN_UNROLL > 8
#error "KILN_UNROLL must be 1..8"
#endif

#define NV (KILN_VOCAB / KILN_VEC)                          // vectors in a row
#define CHUNKV ((NV + KILN_CLUSTER - 1) / KILN_CLUSTER)     // vectors per block
#define UNROLL KILN_UNROLL
#define BATCHV (KILN_THREADS * UNROLL)
#define SUB_TOKENS 131072                                   // bitmap of 16 KiB
#define SUBV (CHUNKV * KILN_VEC < SUB_TOKENS ? CHUNKV : SUB_TOKENS / KILN_VEC)
#define BITMAP_WORDS ((SUBV * KILN_VEC + 31) / 32)
// A slice that one pass covers: loads go out before the bitmap is built.
#define ONE_PASS (CHUNKV <= BATCHV && SUBV == CHUNKV)
#define WARPS (KILN_THREADS / 32)

#define KILN_ARGMAX_NONE 0xffffffffu

__device__ __forceinline__ float penalized(float x, float penalty) { return x > 0.0f ? x / penalty : x * penalty; }

// max.f32: when one operand is NaN, the other.
__device__ __forceinline__ float fmax_nan_ignoring(float a, float b)
{
    float r;
    asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ bool repeated(const kiln_u32 *bits, kiln_u32 rel)
{
    return (bits[rel >> 5] >> (rel & 31)) & 1u;
}

// A thread's best so far: the value and its token (KILN_ARGMAX_NONE: none yet).
struct best_t {
    float v;
    kiln_u32 t;
};

// Whether x (NaN: ineligible) replaces best: larger, or the first eligible
// value at all (-inf included).
__device__ __forceinline__ bool beats(float x, const best_t &b)
{
    return x > b.v || (b.t == KILN_ARGMAX_NONE && x == x);
}

#if KILN_VEC == 8
typedef kiln_u32x4 lvec_t;  // 8 logits
typedef kiln_u64 mvec_t;    // 8 mask bytes
__device__ __forceinline__ lvec_t load_logits(const kiln_elt *row, kiln_u32 v) { return kiln_ldg16(row + (kiln_u64)v * 8); }
__device__ __forceinline__ mvec_t load_mask(const unsigned char *m, kiln_u32 v) { return kiln_ldg8(m + (kiln_u64)v * 8); }

// Bit 7 of each byte: set when the byte is nonzero.
__device__ __forceinline__ kiln_u32 nonzero_bytes(kiln_u32 w)
{
    return (((w & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w) & 0x80808080u;
}

// Each element of a pair: all ones when its mask byte (bit 7 of bytes lo, lo + 1 of nz) is set.
template <int LO>
__device__ __forceinline__ kiln_u32 half_mask(kiln_u32 nz)
{
    kiln_u32 r;
    // prmt with bit 3 of a selector nibble set replicates the selected byte's sign bit.
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(nz), "n"(LO == 0 ? 0x9988 : 0xbbaa));
    return r;
}

// An ineligible element becomes a quiet NaN of the element type.
#if KILN_BF16
#define QNAN2 0x7fc07fc0u
#else
#define QNAN2 0x7e007e00u
#endif
__device__ __forceinline__ kiln_u32 mask_nan(kiln_u32 h, kiln_u32 keep) { return (h & keep) | (QNAN2 & ~keep); }

// Elementwise max of two pairs; a NaN loses to the other operand.
__device__ __forceinline__ kiln_u32 max2(kiln_u32 a, kiln_u32 b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    // max.f16x2 needs sm_80: in f32, where an f16 value and its order are exact.
    float a0, a1, b0, b1;
    kiln_e2_to_f32(a, &a0, &a1);
    kiln_e2_to_f32(b, &b0, &b1);
    return kiln_f32_to_e2(fmax_nan_ignoring(a0, b0), fmax_nan_ignoring(a1, b1));
#else
    kiln_u32 r;
    asm("max." KILN_ELT_PTX "x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
#endif
}

// Folds the 8 tokens of vector v (rb: their repetition bits) into best.
__device__ __forceinline__ void consider(best_t &best, lvec_t l, mvec_t m, kiln_u32 v, kiln_u32 rb, float penalty)
{
    const kiln_u32 nz0 = nonzero_bytes((kiln_u32)m), nz1 = nonzero_bytes((kiln_u32)(m >> 32));
    kiln_u32 h[4] = {mask_nan(l.x, half_mask<0>(nz0)), mask_nan(l.y, half_mask<1>(nz0)),
                     mask_nan(l.z, half_mask<0>(nz1)), mask_nan(l.w, half_mask<1>(nz1))};
    float f[8], vm;
    if (rb == 0) {
        const kiln_u32 m2 = max2(max2(h[0], h[1]), max2(h[2], h[3]));
        float lo, hi;
        kiln_e2_to_f32(m2, &lo, &hi);
        vm = fmax_nan_ignoring(lo, hi);
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++)
            kiln_e2_to_f32(h[e], &f[2 * e], &f[2 * e + 1]);
#pragma unroll
        for (int e = 0; e < 8; e++)
            if ((rb >> e) & 1u)
                f[e] = penalized(f[e], penalty);
        vm = f[0];
#pragma unroll
        for (int e = 1; e < 8; e++)
            vm = fmax_nan_ignoring(vm, f[e]);
    }
    if (beats(vm, best)) {
        // Rare: the first token of the vector that holds vm.
#pragma unroll
        for (int e = 0; e < 4; e++)
            kiln_e2_to_f32(h[e], &f[2 * e], &f[2 * e + 1]);
        kiln_u32 at = 7;
#pragma unroll
        for (int e = 7; e >= 0; e--) {
            const float x = ((rb >> e) & 1u) ? penalized(f[e], penalty) : f[e];
            at = x == vm ? (kiln_u32)e : at;
        }
        best.v = vm;
        best.t = v * 8 + at;
    }
}
#elif KILN_VEC == 1
typedef kiln_elt lvec_t;
typedef kiln_u32 mvec_t;
__device__ __forceinline__ lvec_t load_logits(const kiln_elt *row, kiln_u32 v)
{
    kiln_elt h;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(h) : "l"(row + v));
    return h;
}
__device__ __forceinline__ mvec_t load_mask(const unsigned char *m, kiln_u32 v)
{
    kiln_u32 b;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(b) : "l"(m + v));
    return b;
}
__device__ __forceinline__ void consider(best_t &best, lvec_t l, mvec_t m, kiln_u32 v, kiln_u32 rb, float penalty)
{
    float x = kiln_elt_to_f32(l);
    if (rb & 1u)
        x = penalized(x, penalty);
    if ((m & 0xffu) && beats(x, best)) {
        best.v = x;
        best.t = v;
    }
}
#else
#error "KILN_VEC must be 8 or 1"
#endif

// The repetition bits of vector v's tokens; base: the first token the bitmap covers.
__device__ __forceinline__ kiln_u32 rep_bits(const kiln_u32 *bits, kiln_u32 v, kiln_u32 base)
{
    const kiln_u32 rel = v * KILN_VEC - base;
#if KILN_VEC == 8
    return (bits[rel >> 5] >> (rel & 31)) & 0xffu;
#else
    return repeated(bits, rel);
#endif
}

// The key of a thread's best: order-preserving bits of the value (-0 as +0)
// and ~t, so that among equal values the lowest token has the largest key;
// 0 when there is none.
__device__ __forceinline__ kiln_u64 key_of(const best_t &b)
{
    if (b.t == KILN_ARGMAX_NONE)
        return 0;
    kiln_u32 u = kiln_f32_bits(b.v);
    if (u == 0x80000000u)
        u = 0;
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((kiln_u64)u << 32) | (kiln_u32)~b.t;
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

#if KILN_CLUSTER > 1
#define CLUSTER_DIMS __cluster_dims__(KILN_CLUSTER, 1, 1)
#else
#define CLUSTER_DIMS
#endif

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(KILN_THREADS)
kiln_masked_argmax(const kiln_elt *__restrict__ logits, const unsigned char *__restrict__ valid,
                   const kiln_u32 *__restrict__ rep_ids, const kiln_u32 *__restrict__ rep_offsets,
                   const float *__restrict__ penalty_ptr, kiln_u32 rep_capacity, kiln_u32 *__restrict__ out)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    __shared__ kiln_u32 bits[BITMAP_WORDS];
    __shared__ kiln_u64 scratch[WARPS];
#if KILN_CLUSTER > 1
    __shared__ kiln_u64 parts[KILN_CLUSTER];
    kiln_cluster_arrive_relaxed();
    const kiln_u32 rank = kiln_cluster_rank();
#else
    const kiln_u32 rank = 0;
#endif
    const kiln_u32 p = blockIdx.x / KILN_CLUSTER;
    const kiln_elt *row = logits + (kiln_u64)p * KILN_VOCAB;
    const kiln_u32 v_lo = rank * CHUNKV, v_hi = v_lo + CHUNKV < NV ? v_lo + CHUNKV : NV;
    kiln_u32 b = rep_offsets[p + 1], a = rep_offsets[p];
    const float penalty = *penalty_ptr;
    best_t best = {0.0f, KILN_ARGMAX_NONE};

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
    b = b < rep_capacity ? b : rep_capacity;
    a = a < b ? a : b;
    __syncthreads();
    mark(bits, rep_ids, a, b, v_lo * KILN_VEC, v_hi * KILN_VEC);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < UNROLL; i++) {
        const kiln_u32 v = v_lo + threadIdx.x + i * KILN_THREADS;
        if (v < v_hi)
            consider(best, l[i], m[i], v, rep_bits(bits, v, v_lo * KILN_VEC), penalty);
    }
#else
    b = b < rep_capacity ? b : rep_capacity;
    a = a < b ? a : b;
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
                    consider(best, l[i], m[i], v, rep_bits(bits, v, s_lo * KILN_VEC), penalty);
            }
        }
        __syncthreads(); // the bitmap is cleared again for the next slice
    }
#endif

    const kiln_u64 key = kiln_block_max_u64<WARPS>(key_of(best), scratch);
#if KILN_CLUSTER == 1
    if (threadIdx.x == 0)
        out[p] = key ? ~(kiln_u32)key : KILN_ARGMAX_NONE;
#else
    kiln_cluster_wait(); // every block of the cluster has started
    if (threadIdx.x == 0)
        kiln_cluster_store_u64(&parts[rank], 0, key);
    kiln_cluster_arrive();
    kiln_cluster_wait();
    if (rank == 0 && threadIdx.x == 0) {
        kiln_u64 mx = 0;
#pragma unroll
        for (int r = 0; r < KILN_CLUSTER; r++)
            mx = parts[r] > mx ? parts[r] : mx;
        out[p] = mx ? ~(kiln_u32)mx : KILN_ARGMAX_NONE;
    }
#endif
}
