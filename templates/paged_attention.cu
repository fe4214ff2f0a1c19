// Causal paged attention with RoPE over a paged KV cache (include/kiln/op_attention.h
// is the contract). Two entries, launched one after the other on one stream:
//   kiln_paged_append     rotates the new tokens' k (rotate-half RoPE, f32,
//                         over the first 2 freqs.half dims of a head) and
//                         writes k and v into their sequence's pages;
//   kiln_paged_attention  rotates q, then causal attention of every new token
//                         over its sequence's cached tokens (grouped-query heads,
//                         f32 scores, online softmax with a running max).
// Page layout (65536 bytes): K at [0, 32768), V at [32768, 65536), each
// [KV_HEADS][PAGE_TOKENS][HEAD_DIM] kiln_elt (f16 or bf16, KILN_BF16); token c
// of a sequence lives in page table[c / PAGE_TOKENS], slot c % PAGE_TOKENS.
// q, k and v rows are q_stride / kv_stride halves apart (a fused [T, q | k | v]
// tensor, or three packed ones).
// A block attends all the keys its rows see (no split): decode here is the
// fallback where paged_decode.cu cannot run, one new token per sequence.
// Everything that lives in device memory (spans, lengths, block table) is
// checked here before it is used: a bad sequence is skipped (nothing of it
// read or written) and reported through the fault record.
// The argument window: a token attends the window keys up to its own
// (Mistral's sliding_window), 0xffffffff for every key before it.
// Constants: KILN_BF16 (the element type), KILN_HEAD_DIM (64, 128, 256),
// KILN_HEADS, KILN_KV_HEADS, KILN_PAGE_TOKENS, KILN_ROWS (query rows per
// attention block: 4, 8 or 16; at most 8 at head_dim 256).
// Grids: x = tiles of a sequence's new tokens, y = kv head (append: 1, it
// writes every kv head), z = sequence; 128 threads.
#include "kiln_reduce.cuh"

//! kiln:entry kiln_paged_attention
//! kiln:entry kiln_paged_append

#define D KILN_HEAD_DIM
#define HALF (D / 2)
#define NH KILN_HEADS
#define KVH KILN_KV_HEADS
#define G (NH / KVH)
#define PT KILN_PAGE_TOKENS
#define ROWS KILN_ROWS
#define THREADS 128
#define KC (D == 256 ? 32 : 64) // keys per tile: at head_dim 256 the tiles' shared memory stays under 48 KiB
#define KPAD 8             // halves of padding per K row: conflict-free 16-byte reads
#define APPEND_TOKENS 4    // new tokens per append block (providers/paged_attention.c restates it)
#define APPEND_HEADS 8     // kv heads whose loads an append thread has in flight at once

#if ROWS != 4 && ROWS != 8 && ROWS != 16
#error "KILN_ROWS must be 4, 8 or 16"
#endif
#if D == 256 && ROWS > 8
#error "KILN_ROWS must be 4 or 8 at head_dim 256 (shared memory)"
#endif

#include "kiln_paged.cuh" // the page layout, fault codes, RoPE, load_sequence

struct __align__(16) f32x4 { float x, y, z, w; };

extern "C" __global__ void __launch_bounds__(THREADS)
kiln_paged_append(const kiln_elt *__restrict__ k, const kiln_elt *__restrict__ v, kiln_u32 kv_stride,
                  const kiln_u32 *__restrict__ positions, const kiln_u32 *__restrict__ table,
                  const kiln_u32 *__restrict__ seq_lens, const kiln_u32 *__restrict__ spans, unsigned char *pages,
                  kiln_u32 n_pages, kiln_u32 max_blocks, kiln_u32 tokens, kiln_u32 max_query, rope_freqs freqs,
                  kiln_fault *fault)
{
    kiln_grid_dependency_wait_then_launch();
    // (Wait, then launch: the attention kernel after this one reads its
    // inputs, which kernels ahead of this one wrote, before its sync
    // (templates/paged_prefill.cu); it may launch only once they are complete.)
    const kiln_u32 s = blockIdx.z, j0 = blockIdx.x * APPEND_TOKENS;
    if (j0 >= spans[2 * s + 1])
        return; // no new token here (a bad count is checked below)
    seq_info q;
    // The attention kernel reports; this one only skips.
    if (!load_sequence(s, table, seq_lens, spans, n_pages, max_blocks, tokens, max_query, fault, false, &q))
        return;
    const kiln_u32 n = q.count - j0 < APPEND_TOKENS ? q.count - j0 : APPEND_TOKENS;
    const kiln_u32 base = q.len - q.count; // the cache index of the first new token
    const kiln_u32 *row = table + (kiln_u64)s * max_blocks;
    // One angle per (token, pair), for every kv head; a group of heads'
    // loads are all in flight before the first store.
    for (kiln_u32 idx = threadIdx.x; idx < n * HALF; idx += THREADS) {
        const kiln_u32 j = j0 + idx / HALF, i = idx % HALF;
        const kiln_u32 t = q.start + j, c = base + j;
        float sn, cs;
        kiln_u32 lo, hi;
        rope_sincos(freqs, i, (float)positions[t], &sn, &cs);
        rope_slot(freqs, i, &lo, &hi);
        unsigned char *page = pages + (kiln_u64)row[c / PT] * PAGE_BYTES;
        const kiln_elt *ks = k + (kiln_u64)t * kv_stride, *vs = v + (kiln_u64)t * kv_stride;
        kiln_elt *kd = (kiln_elt *)page + (kiln_u64)(c % PT) * D, *vd = (kiln_elt *)(page + V_OFFSET) + (kiln_u64)(c % PT) * D;
        for (kiln_u32 h0 = 0; h0 < KVH; h0 += APPEND_HEADS) {
            kiln_elt x[APPEND_HEADS][4];
#pragma unroll
            for (kiln_u32 e = 0; e < APPEND_HEADS; e++)
                if (h0 + e < KVH) {
                    const kiln_u32 o = (h0 + e) * D;
                    x[e][0] = ks[o + lo];
                    x[e][1] = ks[o + hi];
                    x[e][2] = vs[o + lo];
                    x[e][3] = vs[o + hi];
                }
#pragma unroll
            for (kiln_u32 e = 0; e < APPEND_HEADS; e++)
                if (h0 + e < KVH) {
                    const kiln_u64 o = (kiln_u64)(h0 + e) * PT * D;
                    const float x0 = kiln_elt_to_f32(x[e][0]), x1 = kiln_elt_to_f32(x[e][1]);
                    kd[o + lo] = kiln_f32_to_elt(x0 * cs - x1 * sn);
                    kd[o + hi] = kiln_f32_to_elt(x1 * cs + x0 * sn);
                    vd[o + lo] = x[e][2];
                    vd[o + hi] = x[e][3];
                }
        }
    }
}

// Rows of a block: ROWS consecutive (new token, group head) pairs of one
// sequence and kv head, row r = token * G + head within the group.
#define QK_GROUPS (THREADS / KC)          // row groups in the scores (2 or 4)
#define QK_RPT (ROWS / QK_GROUPS)         // rows per thread in the scores
#define PV_GROUPS (THREADS / HALF)        // row groups in P.V (1, 2 or 4)
#define PV_RPT (ROWS / PV_GROUPS)
#define LPR (THREADS / ROWS)              // lanes per row in the softmax
#define VECS_PER_KEY (D / 8)
#define TILE_VECS (KC * VECS_PER_KEY / THREADS) // 16-byte vectors of K (and of V) per thread per tile

// Blocks per SM the attention kernel's registers must allow, so that enough
// warps keep the next tiles' loads in flight: 4 (128 registers a thread),
// except 3 for 16 rows at head_dim 128, whose shared memory allows no more,
// and 2 at head_dim 256 (a thread's P.V covers every row of the block).
#define MIN_BLOCKS (D == 256 ? 2 : ROWS == 16 && D == 128 ? 3 : 4)

// K and V of keys [c0, c0 + KC) into registers, zero from key end on.
__device__ __forceinline__ void load_tile(const unsigned char *__restrict__ pages, const kiln_u32 *__restrict__ trow,
                                          kiln_u32 h, kiln_u32 c0, kiln_u32 end, kiln_u32x4 *kv, kiln_u32x4 *vv)
{
#pragma unroll
    for (int e = 0; e < TILE_VECS; e++) {
        const kiln_u32 idx = threadIdx.x + e * THREADS, key = idx / VECS_PER_KEY, vec = idx % VECS_PER_KEY;
        const kiln_u32 c = c0 + key;
        if (c < end) {
            const unsigned char *page = pages + (kiln_u64)trow[c / PT] * PAGE_BYTES;
            const kiln_u64 off = (((kiln_u64)h * PT + c % PT) * D + vec * 8) * 2;
            kv[e] = kiln_ldg16(page + off);
            vv[e] = kiln_ldg16(page + V_OFFSET + off);
        } else {
            kv[e].x = kv[e].y = kv[e].z = kv[e].w = 0;
            vv[e] = kv[e];
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
kiln_paged_attention(const kiln_elt *__restrict__ qin, kiln_u32 q_stride, const kiln_u32 *__restrict__ positions,
                     const kiln_u32 *__restrict__ table, const kiln_u32 *__restrict__ seq_lens,
                     const kiln_u32 *__restrict__ spans, const unsigned char *__restrict__ pages, kiln_elt *out,
                     kiln_u32 n_pages, kiln_u32 max_blocks, kiln_u32 tokens, kiln_u32 max_query, kiln_u32 window,
                     float qscale, rope_freqs freqs, kiln_fault *fault)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    __shared__ __align__(16) float sq[ROWS][D];
    __shared__ __align__(16) kiln_elt sk[KC][D + KPAD];
    __shared__ __align__(16) kiln_elt sv[KC][D];
    __shared__ __align__(16) float sp[ROWS][KC];
    __shared__ float sm[ROWS], sl[ROWS], sscale[ROWS];
    __shared__ kiln_u32 sfirst[ROWS], slast[ROWS];

    const kiln_u32 tile = blockIdx.x, s = blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
    if ((kiln_u64)tile * ROWS >= (kiln_u64)spans[2 * s + 1] * G)
        return; // no row here (a bad count is checked below, by tile 0)
    seq_info q;
    if (!load_sequence(s, table, seq_lens, spans, n_pages, max_blocks, tokens, max_query, fault,
                       blockIdx.x == 0 && blockIdx.y == 0, &q))
        return;
    const kiln_u32 nrows = q.count * G, r0 = tile * ROWS;
    if (r0 >= nrows)
        return;
    const kiln_u32 base = q.len - q.count;
    const kiln_u32 rlast = (r0 + ROWS < nrows ? r0 + ROWS : nrows) - 1;
    const kiln_u32 ke = base + rlast / G + 1; // keys [ks, ke) are read
    // The first row's first key: 0, or the start of its sliding window
    // (window 0xffffffff: none); each row attends its window's keys up to its own.
    const kiln_u32 ks = base + r0 / G >= window ? base + r0 / G - window + 1 : 0u;
    const kiln_u32 *trow = table + (kiln_u64)s * max_blocks;

    // The first tile in flight while the queries are rotated.
    kiln_u32x4 kv[TILE_VECS], vv[TILE_VECS];
    load_tile(pages, trow, h, ks, ke, kv, vv);

    // Rotated, scaled queries (rows past the sequence's: zero, attending every key).
    for (kiln_u32 idx = tid; idx < ROWS * HALF; idx += THREADS) {
        const kiln_u32 r = idx / HALF, i = idx % HALF, row = r0 + r;
        kiln_u32 lo, hi;
        rope_slot(freqs, i, &lo, &hi);
        float y0 = 0.0f, y1 = 0.0f;
        if (row < nrows) {
            const kiln_u32 t = q.start + row / G, head = h * G + row % G;
            const kiln_elt *src = qin + (kiln_u64)t * q_stride + (kiln_u64)head * D;
            rope(freqs, i, kiln_elt_to_f32(ld_elt(src + lo)), kiln_elt_to_f32(ld_elt(src + hi)), positions[t], &y0,
                 &y1);
        }
        sq[r][lo] = y0 * qscale;
        sq[r][hi] = y1 * qscale;
    }
    if (tid < ROWS) {
        const kiln_u32 row = r0 + tid;
        slast[tid] = row < nrows ? base + row / G : ke - 1;
        sfirst[tid] = row < nrows && slast[tid] >= window ? slast[tid] - window + 1 : ks;
        sm[tid] = neg_inf();
        sl[tid] = 0.0f;
    }

    float acc[PV_RPT][2];
#pragma unroll
    for (int r = 0; r < PV_RPT; r++)
        acc[r][0] = acc[r][1] = 0.0f;
    const kiln_u32 cp = tid % HALF, pg = tid / HALF;

    for (kiln_u32 c0 = ks; c0 < ke; c0 += KC) {
        __syncthreads(); // the previous tile is consumed (and the setup is visible)
#pragma unroll
        for (int e = 0; e < TILE_VECS; e++) {
            const kiln_u32 idx = tid + e * THREADS, key = idx / VECS_PER_KEY, vec = idx % VECS_PER_KEY;
            *(kiln_u32x4 *)&sk[key][vec * 8] = kv[e];
            *(kiln_u32x4 *)&sv[key][vec * 8] = vv[e];
        }
        __syncthreads();
        // The next tile's loads fly while this one is computed.
        if (ke - c0 > KC)
            load_tile(pages, trow, h, c0 + KC, ke, kv, vv);
        // Scores: thread (key j, row group) computes QK_RPT rows.
        {
            const kiln_u32 j = tid % KC, rg = tid / KC;
            float sc[QK_RPT];
#pragma unroll
            for (int r = 0; r < QK_RPT; r++)
                sc[r] = 0.0f;
#pragma unroll 4
            for (int d = 0; d < D; d += 8) {
                float kf[8];
                kiln_e8_to_f32(*(const kiln_u32x4 *)&sk[j][d], kf);
#pragma unroll
                for (int r = 0; r < QK_RPT; r++) {
                    const f32x4 a = *(const f32x4 *)&sq[rg * QK_RPT + r][d];
                    const f32x4 b = *(const f32x4 *)&sq[rg * QK_RPT + r][d + 4];
                    sc[r] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] + b.y * kf[5] +
                             b.z * kf[6] + b.w * kf[7];
                }
            }
            const kiln_u32 c = c0 + j;
#pragma unroll
            for (int r = 0; r < QK_RPT; r++) {
                const int row = rg * QK_RPT + r;
                sp[row][j] = c < ke && c <= slast[row] && c >= sfirst[row] ? sc[r] : neg_inf();
            }
        }
        __syncthreads();
        // Online softmax: LPR lanes of one warp per row.
        {
            const kiln_u32 r = tid / LPR, l = tid % LPR;
            const float m_old = sm[r];
            float mx = neg_inf();
#pragma unroll
            for (int e = 0; e < KC / LPR; e++)
                mx = fmaxf(mx, sp[r][l + e * LPR]);
#pragma unroll
            for (int m = LPR / 2; m; m >>= 1)
                mx = fmaxf(mx, kiln_shfl_xor_f32(mx, m));
            // -inf for a row with no key yet (before its window): its
            // exponents are taken against 0, so that they are 0, never NaN.
            const float m_new = fmaxf(m_old, mx), u = m_new == neg_inf() ? 0.0f : m_new;
            float sum = 0.0f;
#pragma unroll
            for (int e = 0; e < KC / LPR; e++) {
                const float p = fast_exp2(sp[r][l + e * LPR] - u);
                sp[r][l + e * LPR] = p;
                sum += p;
            }
#pragma unroll
            for (int m = LPR / 2; m; m >>= 1)
                sum += kiln_shfl_xor_f32(sum, m);
            __syncwarp();
            if (l == 0) {
                const float scale = fast_exp2(m_old - u);
                sscale[r] = scale;
                sl[r] = sl[r] * scale + sum;
                sm[r] = m_new;
            }
        }
        __syncthreads();
        // P.V: thread (column pair cp, row group pg).
        {
#pragma unroll
            for (int r = 0; r < PV_RPT; r++) {
                const float scale = sscale[pg * PV_RPT + r];
                acc[r][0] *= scale;
                acc[r][1] *= scale;
            }
            const kiln_u32 kn = ke - c0 < KC ? ke - c0 : KC;
#pragma unroll 4
            for (kiln_u32 j = 0; j < kn; j++) {
                float v0, v1;
                kiln_e2_to_f32(*(const kiln_u32 *)&sv[j][2 * cp], &v0, &v1);
#pragma unroll
                for (int r = 0; r < PV_RPT; r++) {
                    const float p = sp[pg * PV_RPT + r][j];
                    acc[r][0] += p * v0;
                    acc[r][1] += p * v1;
                }
            }
        }
    }
    // sl is final: the last softmax step was followed by a barrier.
#pragma unroll
    for (int r = 0; r < PV_RPT; r++) {
        const kiln_u32 rr = pg * PV_RPT + r, row = r0 + rr;
        if (row < nrows) {
            const kiln_u32 t = q.start + row / G, head = h * G + row % G;
            const float inv = 1.0f / sl[rr];
            kiln_u32 *dst = (kiln_u32 *)(out + ((kiln_u64)t * NH + head) * D + 2 * cp);
            *dst = kiln_f32_to_e2(acc[r][0] * inv, acc[r][1] * inv);
        }
    }
}
