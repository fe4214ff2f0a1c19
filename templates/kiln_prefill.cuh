// What kiln's prefill attention kernels share (templates/paged_prefill.cu on
// wgmma, templates/paged_prefill_mma.cu on mma.sync): the 128-byte-swizzled
// tiles in shared memory, q rotated and scaled into them, the online softmax
// over a thread's two rows of the accumulator layout (a warp's 16 rows: a =
// lane / 4, b = a + 8; n8 block j holds columns 8j + 2 (lane % 4) and one
// more, in registers 4j, 4j + 1 (row a) and 4j + 2, 4j + 3 (row b): both
// mma.sync m16n8 and wgmma m64nN lay a warp's accumulators so), and the
// output. Include after kiln_paged.cuh, with D, HALF, NH, G defined.
#ifndef KILN_PREFILL_CUH
#define KILN_PREFILL_CUH

#include "kiln_mma.cuh" // saddr, cp_async16

// Byte offset of (row r, column c, c % 8 == 0) in a swizzled tile whose
// 64-column panels are panel bytes apart: row r of a panel is its 128 bytes
// at r * 128, 16-byte chunk k at chunk k ^ (r % 8).
__device__ __forceinline__ kiln_u32 swz_at(kiln_u32 r, kiln_u32 c, kiln_u32 panel)
{
    return (c / 64) * panel + r * 128 + ((((c % 64) / 8) ^ (r % 8)) << 4);
}

// K and V of keys [c0, c0 + NB) into the tiles at shared addresses kdst and
// vdst, zeros from key end on; thread `me` of `n` copies chunk me % (D / 8)
// of every n / (D / 8)-th key.
template <int NB>
__device__ __forceinline__ void prefill_load_kv(const unsigned char *__restrict__ pages,
                                                const kiln_u32 *__restrict__ trow, kiln_u32 h, kiln_u32 c0,
                                                kiln_u32 end, kiln_u32 kdst, kiln_u32 vdst, kiln_u32 me,
                                                kiln_u32 n)
{
    const kiln_u32 ch = me % (D / 8);
#pragma unroll 4
    for (kiln_u32 key = me / (D / 8); key < NB; key += n / (D / 8)) {
        const kiln_u32 c = c0 + key;
        const bool ok = c < end;
        const unsigned char *src = pages;
        if (ok)
            src = pages + (kiln_u64)trow[c / PT] * PAGE_BYTES + (((kiln_u64)h * PT + c % PT) * D + ch * 8) * 2;
        const kiln_u32 off = swz_at(key, ch * 8, NB * 128);
        cp_async16(kdst + off, src, ok ? 16 : 0);
        cp_async16(vdst + off, ok ? src + V_OFFSET : src, ok ? 16 : 0);
    }
}

// The sin and cos of RoPE slots [i0, i0 + N) at position pos, times qscale
// (and the rotation's scale): rope_sincos without a branch a slot, a slot
// past half taking angle 0, whose (sin, cos) is (0, 1). inv: as for
// prefill_load_q.
template <int N>
__device__ __forceinline__ void prefill_q_sincos(const rope_freqs &freqs, const float *inv, kiln_u32 i0, float pos,
                                                 float qscale, float *sn, float *cs)
{
    const float rs = freqs.scale * qscale;
    float iv[N];
#pragma unroll
    for (int j = 0; j < N; j++)
        iv[j] = inv ? inv[i0 + j] : freqs.inv[i0 + j];
#pragma unroll
    for (int j = 0; j < N; j++) {
        const bool rot = i0 + j < freqs.half;
        rope_angle_sincos(pos * (rot ? iv[j] : 0.0f), &sn[j], &cs[j]);
        const float m = rot ? rs : qscale;
        sn[j] *= m;
        cs[j] *= m;
    }
}

// Rows [r0, r0 + BMR) of the block's (row = token * G + head in the group),
// rotated, scaled by qscale and rounded to kiln_elt, into the swizzled tile at
// sm (panels BMR * 128 bytes apart), by threads me of n. Eight RoPE slots
// (rope_slot) of one token a step, their angles shared by the token's heads
// in the block; rows past the sequence's are zero (attending every key,
// never written). Where freqs.half is a multiple of 8 (the whole head
// rotated, or a partial rotary of 16 k dims) the eight slots' dims are two
// aligned runs of 8: with q 16-byte aligned they load as two 16-byte vectors
// a head, QV heads' loads issued before any is used (one round trip, not a
// load a dim: ncu had the scalar loads at a fifth of a 4 x 1024 block's
// time), and store as two; otherwise dim by dim. q and the positions are
// read through L2: the wgmma prefill reads them before its dependency sync.
// inv: freqs.inv copied to shared memory (prefill_inv_to_shared), or null to
// read the parameter itself, whose loads, an address a lane, serialize (ncu
// had them at 3% of a 4 x 1024 wgmma prefill's samples).
template <int BMR>
__device__ __forceinline__ void prefill_load_q(unsigned char *sm, const kiln_elt *__restrict__ qin, kiln_u32 q_stride,
                                               const kiln_u32 *__restrict__ positions, const rope_freqs &freqs,
                                               const float *inv, float qscale, const seq_info &q, kiln_u32 h,
                                               kiln_u32 r0, kiln_u32 me, kiln_u32 n)
{
    constexpr kiln_u32 QV = G < 4 ? G : 4; // heads whose vectors are in flight together
    const kiln_u32 tok0 = r0 / G, ntok = (r0 + BMR - 1) / G + 1 - tok0;
    const bool runs = freqs.half % 8 == 0, vec = runs && ((kiln_u64)qin & 15u) == 0;
    for (kiln_u32 idx = me; idx < ntok * (HALF / 8); idx += n) {
        const kiln_u32 tl = tok0 + idx / (HALF / 8), i0 = idx % (HALF / 8) * 8;
        const bool live = tl < q.count;
        const kiln_u32 t = q.start + (live ? tl : 0);
        const kiln_elt *src0 = qin + (kiln_u64)t * q_stride + (kiln_u64)(h * G) * D;
        kiln_u32 lo[8], hi[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            rope_slot(freqs, i0 + j, &lo[j], &hi[j]);
        kiln_u32x4 xv[QV][2];
        if (vec && live)
#pragma unroll
            for (kiln_u32 g = 0; g < QV; g++) {
                xv[g][0] = kiln_ldcg16(src0 + g * D + lo[0]);
                xv[g][1] = kiln_ldcg16(src0 + g * D + hi[0]);
            }
        float sn[8], cs[8];
        if (live)
            prefill_q_sincos<8>(freqs, inv, i0, (float)__ldcg(positions + t), qscale, sn, cs);
#pragma unroll
        for (kiln_u32 g = 0; g < G; g++) {
            const kiln_u32 row = tl * G + g;
            if (vec && live && g % QV == 0 && g > 0)
#pragma unroll
                for (kiln_u32 gg = 0; gg < QV; gg++)
                    if (g + gg < G) {
                        xv[gg][0] = kiln_ldcg16(src0 + (g + gg) * D + lo[0]);
                        xv[gg][1] = kiln_ldcg16(src0 + (g + gg) * D + hi[0]);
                    }
            if (BMR % G != 0 && (row < r0 || row >= r0 + BMR))
                continue; // a token's heads straddle the tile's edge
            float y0[8], y1[8];
            if (live) {
                float x0[8], x1[8];
                if (vec) {
                    kiln_e8_to_f32(xv[g % QV][0], x0);
                    kiln_e8_to_f32(xv[g % QV][1], x1);
                } else {
                    const kiln_elt *src = src0 + g * D;
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        x0[j] = kiln_elt_to_f32(__ldcg(src + lo[j]));
                        x1[j] = kiln_elt_to_f32(__ldcg(src + hi[j]));
                    }
                }
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    y0[j] = x0[j] * cs[j] - x1[j] * sn[j];
                    y1[j] = x1[j] * cs[j] + x0[j] * sn[j];
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++)
                    y0[j] = y1[j] = 0.0f;
            }
            if (runs) {
                *(kiln_u32x4 *)(sm + swz_at(row - r0, lo[0], BMR * 128)) = kiln_f32_to_e8(y0);
                *(kiln_u32x4 *)(sm + swz_at(row - r0, hi[0], BMR * 128)) = kiln_f32_to_e8(y1);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    *(kiln_elt *)(sm + swz_at(row - r0, lo[j] & ~7u, BMR * 128) + (lo[j] % 8) * 2) =
                        kiln_f32_to_elt(y0[j]);
                    *(kiln_elt *)(sm + swz_at(row - r0, hi[j] & ~7u, BMR * 128) + (hi[j] % 8) * 2) =
                        kiln_f32_to_elt(y1[j]);
                }
            }
        }
    }
}

// freqs.inv into inv (HALF floats of shared memory) by threads me of n, for
// prefill_load_q; a block-wide barrier must follow before it is read.
__device__ __forceinline__ void prefill_inv_to_shared(float *inv, const rope_freqs &freqs, kiln_u32 me, kiln_u32 n)
{
    for (kiln_u32 i = me; i < HALF; i += n)
        inv[i] = freqs.inv[i];
}

// What a block knows of its sequence and rows.
struct prefill_block {
    seq_info q;
    kiln_u32 tile, h, s;    // the row tile, kv head and sequence
    kiln_u32 nrows, r0;     // the sequence's rows and the block's first
    kiln_u32 base, ke;      // the cache index of the first new token; keys [ks, ke) are read
    kiln_u32 ks;            // the first row's first key: 0, or past a sliding window
};

// The first key the token at cache index c attends: its window (the window
// keys up to c; window 0xffffffff: no window) or key 0.
__device__ __forceinline__ kiln_u32 first_key(kiln_u32 c, kiln_u32 window)
{
    return c >= window ? c - window + 1 : 0u;
}

// The rows and keys of b's tile once its sequence b->q is read and checked:
// false when the tile has no row.
template <int BMR>
__device__ __forceinline__ bool prefill_block_rows(kiln_u32 window, prefill_block *b)
{
    b->nrows = b->q.count * G;
    b->r0 = b->tile * BMR;
    if (b->r0 >= b->nrows)
        return false;
    b->base = b->q.len - b->q.count;
    const kiln_u32 rlast = (b->r0 + BMR < b->nrows ? b->r0 + BMR : b->nrows) - 1;
    b->ke = b->base + rlast / G + 1;
    b->ks = first_key(b->base + b->r0 / G, window);
    return true;
}

// The block of BMR rows at (x, y, z) = (row tiles from the last, kv head,
// sequence): false when it has no row or its sequence is bad (checked and
// reported by the block of tile 0 and kv head 0; every thread calls this,
// it synchronizes).
template <int BMR>
__device__ __forceinline__ bool prefill_block_begin(const kiln_u32 *__restrict__ table,
                                                    const kiln_u32 *__restrict__ seq_lens,
                                                    const kiln_u32 *__restrict__ spans, kiln_u32 n_pages,
                                                    kiln_u32 max_blocks, kiln_u32 tokens, kiln_u32 max_query,
                                                    kiln_u32 window, kiln_fault *fault, prefill_block *b)
{
    b->tile = gridDim.x - 1 - blockIdx.x;
    b->h = blockIdx.y;
    b->s = blockIdx.z;
    if ((kiln_u64)b->tile * BMR >= (kiln_u64)spans[2 * b->s + 1] * G)
        return false; // no row here (a bad count is checked below, by tile 0)
    if (!load_sequence(b->s, table, seq_lens, spans, n_pages, max_blocks, tokens, max_query, fault,
                       b->tile == 0 && b->h == 0, &b->q))
        return false;
    return prefill_block_rows<BMR>(window, b);
}

// Work item i of a persistent prefill grid: rows tile `row_tiles - 1 - i /
// (KVH seqs)` (the longest tiles first), kv head i % KVH, sequence i / KVH
// % seqs; its sequence's span and length read in one round trip and
// checked, but not its pages: the caller checks them (first_bad_page)
// beside its first loads. False when the item has no row or the sequence is
// bad (reported by thread 0 of the item of tile 0 and kv head 0). No
// synchronization.
template <int BMR>
__device__ __forceinline__ bool prefill_item_head(kiln_u64 i, kiln_u32 row_tiles, kiln_u32 seqs,
                                                  const kiln_u32 *__restrict__ seq_lens,
                                                  const kiln_u32 *__restrict__ spans, kiln_u32 max_blocks,
                                                  kiln_u32 tokens, kiln_u32 max_query, kiln_u32 window,
                                                  kiln_fault *fault, prefill_block *b)
{
    const kiln_u64 per_rank = (kiln_u64)KVH * seqs;
    b->tile = row_tiles - 1 - (kiln_u32)(i / per_rank);
    b->h = (kiln_u32)(i % KVH);
    b->s = (kiln_u32)(i % per_rank / KVH);
    const bool report = b->tile == 0 && b->h == 0 && threadIdx.x == 0;
    if (!sequence_header(b->s, seq_lens, spans, max_blocks, tokens, max_query, fault, report, &b->q))
        return false;
    return prefill_block_rows<BMR>(window, b);
}

// A thread's two rows: the first and last key each attends (and the greater
// first, the lesser last), and their running max (log2 domain) and sum.
struct prefill_rows {
    kiln_u32 first_a, first_b, first_max, last_a, last_b, last_min;
    float m_a, m_b, l_a, l_b;
};

// Masks the scores of keys [c0, c0 + NB) outside each row's keys, updates
// the rows' running max and sum, turns sc into the probabilities (f32, in
// place) and says the factors the output must be rescaled by. Only tiles
// that cross a row's last key (the diagonal) or its first (a window's start)
// are masked. A row with no key yet (before its window) keeps max -inf: its
// exponents are taken against 0, so that they are 0, never NaN.
template <int NB>
__device__ __forceinline__ void prefill_softmax(float *sc, kiln_u32 c0, kiln_u32 lane, prefill_rows *r,
                                                float *scale_a, float *scale_b)
{
    if (c0 + NB - 1 > r->last_min || c0 < r->first_max) {
#pragma unroll
        for (int j = 0; j < NB / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const kiln_u32 c = c0 + 8 * j + 2 * (lane % 4) + e;
                if (c > r->last_a || c < r->first_a)
                    sc[4 * j + e] = neg_inf();
                if (c > r->last_b || c < r->first_b)
                    sc[4 * j + 2 + e] = neg_inf();
            }
    }
    float mx_a = r->m_a, mx_b = r->m_b;
#pragma unroll
    for (int j = 0; j < NB / 8; j++) {
        mx_a = fmaxf(mx_a, fmaxf(sc[4 * j], sc[4 * j + 1]));
        mx_b = fmaxf(mx_b, fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
    }
    mx_a = fmaxf(mx_a, kiln_shfl_xor_f32(mx_a, 1));
    mx_a = fmaxf(mx_a, kiln_shfl_xor_f32(mx_a, 2));
    mx_b = fmaxf(mx_b, kiln_shfl_xor_f32(mx_b, 1));
    mx_b = fmaxf(mx_b, kiln_shfl_xor_f32(mx_b, 2));
    const float ua = mx_a == neg_inf() ? 0.0f : mx_a, ub = mx_b == neg_inf() ? 0.0f : mx_b;
    *scale_a = fast_exp2(r->m_a - ua);
    *scale_b = fast_exp2(r->m_b - ub);
    r->m_a = mx_a;
    r->m_b = mx_b;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int j = 0; j < NB / 8; j++) {
        sc[4 * j] = fast_exp2(sc[4 * j] - ua);
        sc[4 * j + 1] = fast_exp2(sc[4 * j + 1] - ua);
        sc[4 * j + 2] = fast_exp2(sc[4 * j + 2] - ub);
        sc[4 * j + 3] = fast_exp2(sc[4 * j + 3] - ub);
        sum_a += sc[4 * j] + sc[4 * j + 1];
        sum_b += sc[4 * j + 2] + sc[4 * j + 3];
    }
    r->l_a = r->l_a * *scale_a + sum_a;
    r->l_b = r->l_b * *scale_b + sum_b;
}

// The probabilities in kiln_elt as P V's A operand: key block kk's registers
// are the score blocks 2 kk and 2 kk + 1, rows a and b.
template <int NB>
__device__ __forceinline__ void prefill_pack(const float *sc, kiln_u32 (*p)[4])
{
#pragma unroll
    for (int j = 0; j < NB / 8; j++) {
        p[j / 2][(j % 2) * 2] = kiln_f32_to_e2(sc[4 * j], sc[4 * j + 1]);
        p[j / 2][(j % 2) * 2 + 1] = kiln_f32_to_e2(sc[4 * j + 2], sc[4 * j + 3]);
    }
}

__device__ __forceinline__ void prefill_rescale(float *o, float scale_a, float scale_b)
{
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        o[4 * j] *= scale_a;
        o[4 * j + 1] *= scale_a;
        o[4 * j + 2] *= scale_b;
        o[4 * j + 3] *= scale_b;
    }
}

// Each row's sum over the quad that holds its columns.
__device__ __forceinline__ void prefill_row_sums(prefill_rows *r)
{
    r->l_a += kiln_shfl_xor_f32(r->l_a, 1);
    r->l_a += kiln_shfl_xor_f32(r->l_a, 2);
    r->l_b += kiln_shfl_xor_f32(r->l_b, 1);
    r->l_b += kiln_shfl_xor_f32(r->l_b, 2);
}

// The rows' sums over their quad, then rows r0 + ra and r0 + rb of out (those
// below nrows).
__device__ __forceinline__ void prefill_store(const float *o, prefill_rows *r, kiln_u32 r0, kiln_u32 ra,
                                              kiln_u32 nrows, const seq_info &q, kiln_u32 h, kiln_elt *out,
                                              kiln_u32 lane)
{
    prefill_row_sums(r);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const kiln_u32 row = r0 + ra + 8 * half;
        if (row >= nrows)
            continue;
        const float inv = 1.0f / (half ? r->l_b : r->l_a);
        const kiln_u32 t = q.start + row / G, head = h * G + row % G;
        kiln_elt *dst = out + ((kiln_u64)t * NH + head) * D + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *(kiln_u32 *)(dst + 8 * j) = kiln_f32_to_e2(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
    }
}

// The rows' sums over their quad, then rows ra and ra + 8 of the output,
// normalized and rounded, into the swizzled tile at sm (BMR rows, a kernel's
// q tile once nothing reads those rows of it), for prefill_store_rows.
template <int BMR>
__device__ __forceinline__ void prefill_stage(const float *o, prefill_rows *r, unsigned char *sm, kiln_u32 ra,
                                              kiln_u32 lane)
{
    prefill_row_sums(r);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const float inv = 1.0f / (half ? r->l_b : r->l_a);
        unsigned char *row = sm + 4 * (lane % 4);
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *(kiln_u32 *)(row + swz_at(ra + 8 * half, 8 * j, BMR * 128)) =
                kiln_f32_to_e2(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
    }
}

// Rows [w0, w0 + WR) of the staged tile at sm (prefill_stage) to out, those
// below nrows, by threads me of n: 16 bytes a copy, a row's D elements
// contiguous in out (rather than prefill_store's 4 bytes of 8 rows a warp
// instruction, whose stores ncu had draining at a tenth of a 4 x 1024
// block's time). out must be 16-byte aligned.
template <int BMR, int WR>
__device__ __forceinline__ void prefill_store_rows(const unsigned char *sm, kiln_u32 w0, kiln_u32 r0,
                                                   kiln_u32 nrows, const seq_info &q, kiln_u32 h, kiln_elt *out,
                                                   kiln_u32 me, kiln_u32 n)
{
#pragma unroll 4
    for (kiln_u32 e = me; e < WR * (D / 8); e += n) {
        const kiln_u32 row = w0 + e / (D / 8), c = e % (D / 8) * 8;
        if (r0 + row >= nrows)
            continue;
        const kiln_u32 t = q.start + (r0 + row) / G, head = h * G + (r0 + row) % G;
        kiln_stg16(out + ((kiln_u64)t * NH + head) * D + c, *(const kiln_u32x4 *)(sm + swz_at(row, c, BMR * 128)));
    }
}

// The row state of a thread whose rows are ra and ra + 8 of the block b's
// (rows past the sequence's attend the block's keys, and are never stored).
__device__ __forceinline__ prefill_rows prefill_rows_init(const prefill_block &b, kiln_u32 ra, kiln_u32 window)
{
    prefill_rows r;
    const bool live_a = b.r0 + ra < b.nrows, live_b = b.r0 + ra + 8 < b.nrows;
    r.last_a = live_a ? b.base + (b.r0 + ra) / G : b.ke - 1;
    r.last_b = live_b ? b.base + (b.r0 + ra + 8) / G : b.ke - 1;
    r.first_a = live_a ? first_key(r.last_a, window) : b.ks;
    r.first_b = live_b ? first_key(r.last_b, window) : b.ks;
    r.last_min = r.last_a < r.last_b ? r.last_a : r.last_b;
    r.first_max = r.first_a > r.first_b ? r.first_a : r.first_b;
    r.m_a = r.m_b = neg_inf();
    r.l_a = r.l_b = 0.0f;
    return r;
}

#endif
