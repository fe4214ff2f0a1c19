// What the paged attention templates share (templates/paged_attention.cu:
// prefill, and decode where paged_decode.cu does not run;
// templates/paged_decode.cu): the page layout, the fault codes, RoPE, and the
// checks of a sequence's data in device memory. Include it after
// kiln_reduce.cuh, with D (head_dim), HALF (D / 2), NH, KVH (query and kv
// heads), PT (tokens a page) and THREADS (the block's threads) defined.
#ifndef KILN_PAGED_CUH
#define KILN_PAGED_CUH

// A page (65536 bytes): K at [0, 32768), V at [32768, 65536), each
// [KV_HEADS][PAGE_TOKENS][HEAD_DIM] kiln_elt (f16, or bf16 where KILN_BF16 =
// 1: q, k, v, the pages and out all have the one element type); token c of a
// sequence lives in page table[c / PAGE_TOKENS], slot c % PAGE_TOKENS.
#define PAGE_BYTES 65536ull
#define V_OFFSET 32768ull

#if D != 64 && D != 128 && D != 256
#error "KILN_HEAD_DIM must be 64, 128 or 256"
#endif
#if NH % KVH != 0
#error "KILN_KV_HEADS must divide KILN_HEADS"
#endif
#if PT < 1 || (KVH * PT * D * 2) > 32768
#error "KILN_PAGE_TOKENS does not fit a page"
#endif

#define KILN_FAULT_KV_SPAN 16u         // value: start + count (saturated), limit: tokens
#define KILN_FAULT_KV_QUERY_COUNT 17u  // value: count, limit: min(seq_len, max_query_tokens)
#define KILN_FAULT_KV_SEQ_PAST_TABLE 18u // value: seq_len, limit: max_blocks * PAGE_TOKENS
#define KILN_FAULT_KV_BLOCK_PAST_ARENA 19u // value: the entry, limit: block << 32 | pages

// RoPE's parameters, by value (providers/paged_attention.c lays them out
// the same: HALF floats, the scale, the half as a u32). Rotate-half over the
// first 2 half dims of each head (partial rotary: half <= HALF): pair i <
// half is (x[i], x[i + half]), the rest pass through unchanged.
struct rope_freqs {
    float inv[HALF]; // inv[i], i < half: the pair's inverse frequency, f32 from the host
    float scale;     // cos and sin multiplied by it (yarn's attention factor; 1 otherwise)
    kiln_u32 half;   // the rotated pairs: rope_dim / 2, in [1, HALF]
};

// Slot i (0 <= i < HALF) of a head: the two dims it computes, (i, i + half)
// for a rotated pair, and for i >= half two of the dims past the rotated
// ones that pass through (i + half and i + HALF: every dim of [2 half, D)
// once). With half = HALF, (i, i + HALF) as rotate-half over the whole head.
__device__ __forceinline__ void rope_slot(const rope_freqs &f, kiln_u32 i, kiln_u32 *lo, kiln_u32 *hi)
{
    *lo = i < f.half ? i : i + f.half;
    *hi = i < f.half ? i + f.half : i + HALF;
}

// sin and cos of the angle x on the SFU, x reduced to [-pi, pi] first (a
// two-term Cody-Waite step: within about an f32 rounding of the remainder
// for angles below 2^24), where __sinf and __cosf are within 2^-21.4
// absolute (the CUDA programming guide): far below an f16 q's or k's
// rounding. sincosf's branches and slow path were a tenth of a 4 x 1024
// prefill (bench_attention --prefill).
__device__ __forceinline__ void rope_angle_sincos(float x, float *s, float *c)
{
    const float k = rintf(x * 0.159154943091895336f); // x / (2 pi)
    float r = fmaf(k, -6.28318548202514648f, x);      // 2 pi rounded to f32, up by 1.7484555e-7
    r = fmaf(k, 1.74845553e-7f, r);
    *s = __sinf(r);
    *c = __cosf(r);
}

// Slot i's sin and cos at position pos: a rotated pair's, times the scale;
// (0, 1) exactly for a slot that passes through.
__device__ __forceinline__ void rope_sincos(const rope_freqs &f, kiln_u32 i, float pos, float *s, float *c)
{
    if (i < f.half) {
        rope_angle_sincos(pos * f.inv[i], s, c);
        *s *= f.scale;
        *c *= f.scale;
    } else {
        *s = 0.0f;
        *c = 1.0f;
    }
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float fast_exp2(float x)
{
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ kiln_elt ld_elt(const kiln_elt *p)
{
    kiln_elt v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ void st_elt(kiln_elt *p, kiln_elt v)
{
    asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory");
}

// RoPE of slot i's dims (x0, x1) = (x[lo], x[hi]) at position pos (rope_slot).
__device__ __forceinline__ void rope(const rope_freqs &f, kiln_u32 i, float x0, float x1, kiln_u32 pos, float *y0,
                                     float *y1)
{
    float s, c;
    rope_sincos(f, i, (float)pos, &s, &c);
    *y0 = x0 * c - x1 * s;
    *y1 = x1 * c + x0 * s;
}

struct seq_info {
    kiln_u32 start, count, len;
};

// Reads and checks sequence s's span and length (no synchronization).
// Returns false when the sequence has no new tokens or is bad; a bad one is
// reported when report is set.
__device__ bool sequence_header(kiln_u32 s, const kiln_u32 *__restrict__ seq_lens, const kiln_u32 *__restrict__ spans,
                                kiln_u32 max_blocks, kiln_u32 tokens, kiln_u32 max_query, kiln_fault *fault,
                                bool report, seq_info *out)
{
    // Through L2: the wgmma prefill reads these before its dependency sync.
    const kiln_u32 start = __ldcg(spans + 2 * s), count = __ldcg(spans + 2 * s + 1), len = __ldcg(seq_lens + s);
    out->start = start;
    out->count = count;
    out->len = len;
    if (count == 0)
        return false;
    const kiln_u64 end = (kiln_u64)start + count;
    kiln_u32 code = 0, value = 0;
    kiln_u64 limit = 0;
    if (end > tokens) {
        code = KILN_FAULT_KV_SPAN;
        value = end > 0xffffffffull ? 0xffffffffu : (kiln_u32)end;
        limit = tokens;
    } else if (count > max_query || count > len) {
        code = KILN_FAULT_KV_QUERY_COUNT;
        value = count;
        limit = max_query < len ? max_query : len;
    } else if ((kiln_u64)len > (kiln_u64)max_blocks * PT) {
        code = KILN_FAULT_KV_SEQ_PAST_TABLE;
        value = len;
        limit = (kiln_u64)max_blocks * PT;
    }
    if (code) {
        if (report && threadIdx.x == 0)
            kiln_report_fault(fault, code, s, value, limit);
        return false;
    }
    return true;
}

// The lowest of the table entries b = first, + step, ... (by default
// threadIdx.x, + THREADS, ...) below the sequence's page count that lies past
// the arena (0xffffffff: none); the block's is the least over its threads.
__device__ __forceinline__ kiln_u32 first_bad_page(const kiln_u32 *__restrict__ row, kiln_u32 len, kiln_u32 n_pages,
                                                   kiln_u32 first = threadIdx.x, kiln_u32 step = THREADS)
{
    const kiln_u32 blocks = (len + PT - 1) / PT;
    kiln_u32 bad = 0xffffffffu;
    for (kiln_u32 b = first; b < blocks; b += step)
        if (row[b] >= n_pages && b < bad)
            bad = b;
    return bad;
}

__device__ __forceinline__ void report_bad_page(kiln_fault *fault, kiln_u32 s, const kiln_u32 *row, kiln_u32 b,
                                                kiln_u32 n_pages)
{
    kiln_report_fault(fault, KILN_FAULT_KV_BLOCK_PAST_ARENA, s, row[b], ((kiln_u64)b << 32) | n_pages);
}

// Reads and checks sequence s (every thread of the block calls it: it
// synchronizes). Returns false when the sequence has no new tokens or is bad;
// a bad one is reported when report is set.
__device__ bool load_sequence(kiln_u32 s, const kiln_u32 *__restrict__ table, const kiln_u32 *__restrict__ seq_lens,
                              const kiln_u32 *__restrict__ spans, kiln_u32 n_pages, kiln_u32 max_blocks,
                              kiln_u32 tokens, kiln_u32 max_query, kiln_fault *fault, bool report, seq_info *out)
{
    __shared__ kiln_u32 bad_block;
    if (!sequence_header(s, seq_lens, spans, max_blocks, tokens, max_query, fault, report, out))
        return false;
    // Every page the sequence reads must lie in the arena.
    if (threadIdx.x == 0)
        bad_block = 0xffffffffu;
    __syncthreads();
    const kiln_u32 *row = table + (kiln_u64)s * max_blocks;
    const kiln_u32 mine = first_bad_page(row, out->len, n_pages);
    if (mine != 0xffffffffu)
        atomicMin(&bad_block, mine);
    __syncthreads();
    const kiln_u32 b = bad_block;
    if (b != 0xffffffffu) {
        if (report && threadIdx.x == 0)
            report_bad_page(fault, s, row, b, n_pages);
        return false;
    }
    return true;
}

#endif
