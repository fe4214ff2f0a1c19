// Decode paged attention (one new token per sequence) with RoPE, the append
// folded in: one kernel per command (include/kiln/op_attention.h is the
// contract; templates/paged_attention.cu serves prefill and keeps the page
// layout: 65536-byte pages, K at [0, 32768), V at [32768, 65536), each
// [KV_HEADS][PAGE_TOKENS][HEAD_DIM] kiln_elt (f16 or bf16); token c of a
// sequence lives in page table[c / PAGE_TOKENS], slot c % PAGE_TOKENS).
// A block serves one sequence, one kv head and up to 8 of its query heads
// (a row tile), over one chunk of the sequence's keys. Keys stream through
// shared memory in tiles of 64 (cp.async, stages - 1 tiles in flight, 16-byte
// chunks XOR-swizzled so that ldmatrix reads are free of bank conflicts);
// each of the 4 warps takes 16 keys of a tile and keeps its own online
// softmax: scores S^T = K Q^T on the tensor cores (mma.sync m16n8k16, keys
// as M, the rows as N, f32 accumulation), then O^T += V^T P^T (V^T through
// ldmatrix.trans, P^T made the B operand with movmatrix). The f32 q and p
// go in as two kiln_elt terms each (hi = elt(x), lo = elt(x - hi): about 22
// bits in f16, 16 in bf16), so that the result is about as exact as f32
// arithmetic would give (well within bf16's own rounding): for a
// group of at most 4 rows both terms share one mma (columns 0-3 hi, 4-7 lo,
// summed across lanes), else each term has its own.
// The warps' partials are combined in warp order through shared memory.
// The new token (key len - 1): the block whose chunk holds it rotates k
// (rotate-half RoPE in f32, rounded to kiln_elt, the prefill append's arithmetic)
// and, in row tile 0, writes k and v to the page; it puts them into its
// shared tile itself, so that no block reads that slot of the page.
// Split-KV: the grid's x holds row tiles times n, n blocks of a row tile form
// a thread block cluster (n = 1, 2, 4, 8 or 16, a launch attribute; 1 without
// one); the keys of a sequence are cut in at most n chunks of whole 64-key
// tiles, one block each, on the device from its length; each block sends
// each slice of its partial (unnormalized output, max, sum) into the shared
// memory of the block that combines that slice, and after a cluster barrier
// each block combines its slice from every block's, in rank order: the same
// bits whatever order the blocks ran in, replayed or eager, and no
// workspace.
// Everything that lives in device memory (spans, lengths, block table) is
// checked: a bad sequence is skipped (nothing of it written, no page past the
// arena read) and reported through the fault record. The prologue asks for
// all it reads at once (q, the new k and v, the first tiles' pages, the
// table entries to check), so that its latency is one round trip; the first
// tiles are requested while the check is pending, a page past the arena
// reading as zero. The split's blocks send their partials into the shared
// memory of the rank that combines them (no block reads another's memory).
// The argument window: a token attends the window keys up to its own
// (Mistral's sliding_window), 0xffffffff for every key before it.
// Constants: KILN_BF16 (the element type), KILN_HEAD_DIM (64, 128),
// KILN_HEADS, KILN_KV_HEADS, KILN_PAGE_TOKENS. Grid: x = row tiles x n, y = kv head, z = sequence;
// 128 threads; dynamic shared memory stages x 2 x 64 x HEAD_DIM halves.
// stages (an argument, 3 or 4): 3 at head_dim 128 (96 KiB: two blocks an
// SM), 4 there where the grid takes at most one block an SM (128 KiB: a
// deeper pipeline for the SM's one block), 4 at head_dim 64 (64 KiB).
// Needs sm_80 (sm_90 for n > 1).
#include "kiln_mma.cuh" // saddr, cp.async, ldmatrix, mma
#include "kiln_reduce.cuh"

//! kiln:entry kiln_paged_decode

#define D KILN_HEAD_DIM
#define HALF (D / 2)
#define NH KILN_HEADS
#define KVH KILN_KV_HEADS
#define G (NH / KVH)
#define PT KILN_PAGE_TOKENS
#define THREADS 128
#define WARPS 4
#define KT 64              // keys per tile: 16 per warp
#define ROWS 8             // query rows per block: the mma's N
#define PACK (G <= 4)      // q and p's hi and lo terms share one n-tile (4 rows a block)
#define CH (D / 8)         // 16-byte chunks per key
#define MIN_STAGES (D == 128 ? 3 : 4) // the fewest stages a launch has
#define TILE_BYTES (KT * D * 2)   // K (or V) of one tile
#define STAGE_BYTES (2 * TILE_BYTES)
#define OPAD (D + 4)       // f32 row stride of the warps' outputs in the epilogue
#define QI (ROWS * HALF / THREADS) // q's rotated pairs a thread makes
#define MAX_SPLIT 16       // blocks of a cluster at most (providers/paged_attention.c's DECODE_MAX_CLUSTER)

#if WARPS * ROWS * OPAD * 4 > MIN_STAGES * STAGE_BYTES
#error "the epilogue does not fit the tiles' shared memory"
#endif

#if KILN_HEAD_DIM > 128
#error "this kernel takes head_dim 64 or 128 (256 runs on templates/paged_attention.cu)"
#endif
#include "kiln_paged.cuh" // the page layout, fault codes, RoPE, load_sequence

// Eight halves at p (4-byte aligned: out's rows are only that).
__device__ __forceinline__ void st_e8(kiln_elt *p, const float *y)
{
    const kiln_u32x4 w = kiln_f32_to_e8(y);
    kiln_u32 *d = (kiln_u32 *)p;
    d[0] = w.x;
    d[1] = w.y;
    d[2] = w.z;
    d[3] = w.w;
}

__device__ __forceinline__ kiln_u32 movmatrix_trans(kiln_u32 a)
{
    kiln_u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(a));
    return r;
}


#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ kiln_u32 cluster_size()
{
    kiln_u32 r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

// Stores v[0..3] at the place p (16-byte aligned, this block's shared
// memory) has in the shared memory of the cluster's block rank.
__device__ __forceinline__ void st_cluster_f32x4(float *p, kiln_u32 rank, float v0, float v1, float v2, float v3)
{
    kiln_u32 d;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(saddr(p)), "r"(rank));
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(d), "f"(v0), "f"(v1), "f"(v2), "f"(v3)
                 : "memory");
}
#endif

// Byte offset of (key, 16-byte chunk) in a K or V tile: chunks swizzled by key.
__device__ __forceinline__ kiln_u32 tile_off(kiln_u32 key, kiln_u32 ch)
{
    return (key * CH + (ch ^ (key & 7))) * 16;
}

#define PER_THREAD (KT * CH / THREADS) // 16-byte chunks of K (and of V) a thread loads a tile

// The page rows of this thread's keys in the tile of keys [c0, c0 + KT)
// (keys from end on: none, nothing read). Loaded a tile ahead of
// issue_tile, so that the table's latency is not in the way of the copies.
__device__ __forceinline__ void tile_pages(kiln_u32 *pg, const kiln_u32 *trow, kiln_u32 c0, kiln_u32 end)
{
#pragma unroll
    for (int e = 0; e < PER_THREAD; e++) {
        const kiln_u32 c = c0 + (threadIdx.x + e * THREADS) / CH;
        pg[e] = c < end ? trow[c / PT] : 0u;
    }
}

// Starts the loads of keys [c0, c0 + KT) into a stage, pg from tile_pages;
// keys from end on, the new token's (its block writes it) and any in a page
// past the arena (the sequence is then dropped) read as zero.
__device__ __forceinline__ void issue_tile(kiln_u32 stage, const unsigned char *pages, const kiln_u32 *pg,
                                           kiln_u32 h, kiln_u32 c0, kiln_u32 end, kiln_u32 cnew, kiln_u32 n_pages)
{
#pragma unroll
    for (int e = 0; e < PER_THREAD; e++) {
        const kiln_u32 idx = threadIdx.x + e * THREADS, key = idx / CH, ch = idx % CH, c = c0 + key;
        const bool ok = c < end && c != cnew && pg[e] < n_pages;
        const unsigned char *src = pages;
        if (ok)
            src = pages + (kiln_u64)pg[e] * PAGE_BYTES + (((kiln_u64)h * PT + c % PT) * D + ch * 8) * 2;
        const kiln_u32 dst = stage + tile_off(key, ch);
        cp_async16(dst, src, ok ? 16 : 0);
        cp_async16(dst + TILE_BYTES, ok ? src + V_OFFSET : src, ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
kiln_paged_decode(const kiln_elt *__restrict__ qin, kiln_u32 q_stride, const kiln_elt *__restrict__ k,
                  const kiln_elt *__restrict__ v, kiln_u32 kv_stride, const kiln_u32 *__restrict__ positions,
                  const kiln_u32 *__restrict__ table, const kiln_u32 *__restrict__ seq_lens,
                  const kiln_u32 *__restrict__ spans, unsigned char *pages, kiln_elt *out, kiln_u32 n_pages,
                  kiln_u32 max_blocks, kiln_u32 tokens, kiln_u32 max_query, kiln_u32 window, kiln_u32 stages,
                  float qscale, rope_freqs freqs, kiln_fault *fault)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(16) kiln_elt sq[2][ROWS][D]; // q's hi and lo terms
    __shared__ __align__(16) kiln_elt snew[2][D]; // the new token's rotated k, and v
    __shared__ float swm[WARPS][ROWS], swl[WARPS][ROWS];
    // Split: what the cluster's blocks send this one to combine, per item
    // slot: the output's 8 dims, the row's max and sum (and 2 unused).
#if __CUDA_ARCH__ >= 900
    __shared__ __align__(16) float rcv[(ROWS * CH + MAX_SPLIT) * 12];
#endif
    __shared__ kiln_u32 sbad[WARPS];

#if __CUDA_ARCH__ >= 900
    const kiln_u32 nsplit = cluster_size(), split = kiln_cluster_rank();
#else
    const kiln_u32 nsplit = 1, split = 0;
#endif
    const kiln_u32 tile = blockIdx.x / nsplit, s = blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
    const kiln_u32 lane = tid % 32, warp = tid / 32, g = lane / 4, t4 = lane % 4;
    seq_info q;
    // The same outcome for every block of a cluster (it depends on s only):
    // all of them leave here, or none.
    const bool report = blockIdx.x == 0 && blockIdx.y == 0;
    if (!sequence_header(s, seq_lens, spans, max_blocks, tokens, max_query, fault, report, &q))
        return;
    const kiln_u32 r0 = tile * ROWS;
    if (r0 >= G)
        return;
    const kiln_u32 len = q.len, cnew = len - 1, t = q.start; // one new token: count is 1
    // The keys attended: [ks, len), the last window of them (window
    // 0xffffffff: none); this block's: [kb, ke), whole tiles but the last.
    const kiln_u32 ks = len > window ? len - window : 0u;
    const kiln_u32 per = (len - ks + nsplit - 1) / nsplit, chunk = (per + KT - 1) / KT * KT;
    const kiln_u64 kb64 = ks + (kiln_u64)split * chunk;
    const kiln_u32 kb = kb64 < len ? (kiln_u32)kb64 : len;
    const kiln_u32 ke = kb64 + chunk < len ? (kiln_u32)(kb64 + chunk) : len;
    const kiln_u32 ntiles = (ke - kb + KT - 1) / KT;
    const bool has_new = kb <= cnew && cnew < ke;
    const kiln_u32 *trow = table + (kiln_u64)s * max_blocks;
    const kiln_u32 sbase = saddr(smem);

    // Everything the prologue reads, in one round trip: the position, q, the
    // new token's k and v and its page, the pages of the first two tiles, and
    // the table entries this thread checks. The tiles are requested before
    // the check's outcome is known (a page past the arena reads as zero);
    // nothing is written before it.
    const kiln_u32 pos = positions[t];
    // Slot i of RoPE rotates (or passes through) dims lo and hi (rope_slot).
    kiln_elt qx[QI][2];
#pragma unroll
    for (int j = 0; j < QI; j++) {
        const kiln_u32 idx = tid + j * THREADS, r = idx / HALF, i = idx % HALF, row = r0 + r;
        kiln_u32 lo, hi;
        rope_slot(freqs, i, &lo, &hi);
        const kiln_elt *src = qin + (kiln_u64)t * q_stride + (kiln_u64)(h * G + (row < G ? row : 0)) * D;
        qx[j][0] = row < G ? src[lo] : (kiln_elt)0;
        qx[j][1] = row < G ? src[hi] : (kiln_elt)0;
    }
    const bool new_lane = has_new && tid < HALF;
    kiln_u32 nlo, nhi;
    rope_slot(freqs, new_lane ? tid : 0, &nlo, &nhi);
    const kiln_u64 kbase = (kiln_u64)t * kv_stride + (kiln_u64)h * D;
    const kiln_u64 nsrc = kbase + (new_lane ? tid : 0);
    const kiln_elt nk0 = new_lane ? k[kbase + nlo] : (kiln_elt)0, nk1 = new_lane ? k[kbase + nhi] : (kiln_elt)0;
    const kiln_elt nv0 = new_lane ? v[nsrc] : (kiln_elt)0, nv1 = new_lane ? v[nsrc + HALF] : (kiln_elt)0;
    const kiln_u32 new_page = has_new ? trow[cnew / PT] : 0u;
    kiln_u32 pg[PER_THREAD], pg1[PER_THREAD];
    tile_pages(pg, trow, kb, ke);
    tile_pages(pg1, trow, kb + KT, ke);
    kiln_u32 bad = first_bad_page(trow, len, n_pages);

    // The first tiles in flight while q and the new k are rotated; then the
    // pages of the next tile to issue.
    const kiln_u32 nst = stages > 3 ? 4 : 3; // the host passes 3 or 4
    if (ntiles > 0)
        issue_tile(sbase, pages, pg, h, kb, ke, cnew, n_pages);
    cp_async_commit();
    if (ntiles > 1)
        issue_tile(sbase + STAGE_BYTES, pages, pg1, h, kb + KT, ke, cnew, n_pages);
    cp_async_commit();
    if (nst == 4) {
        tile_pages(pg, trow, kb + 2 * KT, ke);
        if (ntiles > 2)
            issue_tile(sbase + 2 * STAGE_BYTES, pages, pg, h, kb + 2 * KT, ke, cnew, n_pages);
        cp_async_commit();
    }
    tile_pages(pg, trow, kb + (nst - 1) * KT, ke);

    if (new_lane) {
        float y0, y1;
        rope(freqs, tid, kiln_elt_to_f32(nk0), kiln_elt_to_f32(nk1), pos, &y0, &y1);
        snew[0][nlo] = kiln_f32_to_elt(y0);
        snew[0][nhi] = kiln_f32_to_elt(y1);
        snew[1][tid] = nv0;
        snew[1][tid + HALF] = nv1;
    }
    // Rotated, scaled queries as two kiln_elt terms (rows past the group's: zero).
#pragma unroll
    for (int j = 0; j < QI; j++) {
        const kiln_u32 idx = tid + j * THREADS, r = idx / HALF, i = idx % HALF;
        kiln_u32 lo, hi;
        rope_slot(freqs, i, &lo, &hi);
        float y0, y1;
        rope(freqs, i, kiln_elt_to_f32(qx[j][0]), kiln_elt_to_f32(qx[j][1]), pos, &y0, &y1);
        y0 *= qscale;
        y1 *= qscale;
        const kiln_elt h0 = kiln_f32_to_elt(y0), h1 = kiln_f32_to_elt(y1);
        sq[0][r][lo] = h0;
        sq[0][r][hi] = h1;
        sq[1][r][lo] = kiln_f32_to_elt(y0 - kiln_elt_to_f32(h0));
        sq[1][r][hi] = kiln_f32_to_elt(y1 - kiln_elt_to_f32(h1));
    }
    // The table check's outcome: every page of the sequence in the arena.
    bad = __reduce_min_sync(0xffffffffu, bad);
    if (lane == 0)
        sbad[warp] = bad;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < WARPS; w++)
        bad = sbad[w] < bad ? sbad[w] : bad;
    if (bad != 0xffffffffu) {
        if (report && tid == 0)
            report_bad_page(fault, s, trow, bad, n_pages);
        cp_async_wait<0>(); // nothing lands in the shared memory of a block that has left
        return;
    }
#if __CUDA_ARCH__ >= 900
    if (nsplit > 1) // pairs with the wait before the partials are sent: every block of the cluster has started
        kiln_cluster_arrive_relaxed();
#endif
    if (new_lane && tile == 0) { // one row tile writes the cache
        unsigned char *page = pages + (kiln_u64)new_page * PAGE_BYTES;
        const kiln_u64 dst = ((kiln_u64)h * PT + cnew % PT) * D + tid;
        kiln_elt *kd = (kiln_elt *)page + dst, *vd = (kiln_elt *)(page + V_OFFSET) + dst;
        st_elt(kd, snew[0][tid]);
        st_elt(kd + HALF, snew[0][tid + HALF]);
        st_elt(vd, nv0);
        st_elt(vd + HALF, nv1);
    }
    // B fragments of Q^T, column g, dims 16 kk + 2 t4 (+1) and + 8: packed,
    // row g % 4's term g / 4; else row g's hi (qf) and lo (ql) terms.
    kiln_u32 qf[D / 16][2], ql[D / 16][2];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const kiln_elt *qr = PACK ? sq[g >> 2][g & 3] : sq[0][g];
        qf[kk][0] = *(const kiln_u32 *)&qr[16 * kk + 2 * t4];
        qf[kk][1] = *(const kiln_u32 *)&qr[16 * kk + 2 * t4 + 8];
        ql[kk][0] = *(const kiln_u32 *)&sq[1][g][16 * kk + 2 * t4];
        ql[kk][1] = *(const kiln_u32 *)&sq[1][g][16 * kk + 2 * t4 + 8];
    }

    // Per thread: columns 2 t4 and 2 t4 + 1, which are rows 2 t4 and 2 t4 + 1
    // (packed: rows 2 (t4 % 2) and + 1, lanes t4 and t4 ^ 2 the same values);
    // the output's dims 16 mm + g and + 8.
    float m0 = neg_inf(), m1 = neg_inf(), l0 = 0.0f, l1 = 0.0f;
    float acc[D / 16][4];
#pragma unroll
    for (int mm = 0; mm < D / 16; mm++)
        acc[mm][0] = acc[mm][1] = acc[mm][2] = acc[mm][3] = 0.0f;
    const kiln_u32 kw = warp * 16; // this warp's keys in a tile

    for (kiln_u32 i = 0; i < ntiles; i++) {
        if (nst == 4) // all but the nst - 2 latest tiles
            cp_async_wait<2>();
        else
            cp_async_wait<1>();
        __syncthreads(); // tile i landed for every thread; tile i - 1 is consumed
        const kiln_u32 c0 = kb + i * KT, stage = sbase + (i % nst) * STAGE_BYTES;
        if (has_new && cnew - c0 < KT) { // the new token: from this block, not the page
            const kiln_u32 key = cnew - c0;
            if (tid < 2 * CH) {
                const kiln_u32 ch = tid % CH, which = tid / CH;
                const kiln_u32x4 val = *(const kiln_u32x4 *)&snew[which][ch * 8];
                unsigned char *p = smem + (i % nst) * STAGE_BYTES + which * TILE_BYTES + tile_off(key, ch);
                *(kiln_u32x4 *)p = val;
            }
            __syncthreads();
        }
        {
            const kiln_u32 n = i + nst - 1;
            if (n < ntiles) {
                issue_tile(sbase + (n % nst) * STAGE_BYTES, pages, pg, h, kb + n * KT, ke, cnew, n_pages);
                tile_pages(pg, trow, kb + (n + 1) * KT, ke); // in flight while this tile is computed
            }
            cp_async_commit();
        }
        if (c0 + kw >= ke)
            continue; // no key of this warp's
        // Scores of keys kw + g (s[0], s[1]) and kw + g + 8 (s[2], s[3]), rows 2 t4 and 2 t4 + 1.
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        {
            const kiln_u32 key = kw + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                kiln_u32 a[4];
                ldsm_x4(stage + tile_off(key, 2 * kk + (lane >> 4)), a);
                mma(sc, a, qf[kk][0], qf[kk][1]);
                if (!PACK)
                    mma(sc, a, ql[kk][0], ql[kk][1]);
            }
        }
        if (PACK) // column c + 4 holds the lo term of column c's row
#pragma unroll
            for (int j = 0; j < 4; j++)
                sc[j] += kiln_shfl_xor_f32(sc[j], 2);
        const kiln_u32 ka = c0 + kw + g;
        if (ka >= ke)
            sc[0] = sc[1] = neg_inf();
        if (ka + 8 >= ke)
            sc[2] = sc[3] = neg_inf();
        float mx0 = fmaxf(sc[0], sc[2]), mx1 = fmaxf(sc[1], sc[3]);
#pragma unroll
        for (int m = 4; m < 32; m <<= 1) {
            mx0 = fmaxf(mx0, kiln_shfl_xor_f32(mx0, m));
            mx1 = fmaxf(mx1, kiln_shfl_xor_f32(mx1, m));
        }
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float u0 = n0 == neg_inf() ? 0.0f : n0, u1 = n1 == neg_inf() ? 0.0f : n1;
        const float a0 = fast_exp2(m0 - u0), a1 = fast_exp2(m1 - u1);
        const float p0 = fast_exp2(sc[0] - u0), p1 = fast_exp2(sc[1] - u1);
        const float p2 = fast_exp2(sc[2] - u0), p3 = fast_exp2(sc[3] - u1);
        m0 = n0;
        m1 = n1;
        l0 = l0 * a0 + p0 + p2;
        l1 = l1 * a1 + p1 + p3;
        // P as hi and lo terms: packed, lanes t4 < 2 give the hi columns, the others the lo.
        const kiln_u32 h01 = kiln_f32_to_e2(p0, p1), h23 = kiln_f32_to_e2(p2, p3);
        float f[4];
        kiln_e2_to_f32(h01, &f[0], &f[1]);
        kiln_e2_to_f32(h23, &f[2], &f[3]);
        const kiln_u32 l01 = kiln_f32_to_e2(p0 - f[0], p1 - f[1]), l23 = kiln_f32_to_e2(p2 - f[2], p3 - f[3]);
        const bool lo_lane = PACK && t4 >= 2;
        const kiln_u32 b0 = movmatrix_trans(lo_lane ? l01 : h01), b1 = movmatrix_trans(lo_lane ? l23 : h23);
        kiln_u32 c0l = 0, c1l = 0;
        if (!PACK) {
            c0l = movmatrix_trans(l01);
            c1l = movmatrix_trans(l23);
        }
        const kiln_u32 key = kw + (lane & 7) + (lane >> 4) * 8;
#pragma unroll
        for (int mm = 0; mm < D / 16; mm++) {
            acc[mm][0] *= a0;
            acc[mm][1] *= a1;
            acc[mm][2] *= a0;
            acc[mm][3] *= a1;
            kiln_u32 a[4];
            ldsm_x4_trans(stage + TILE_BYTES + tile_off(key, 2 * mm + ((lane >> 3) & 1)), a);
            mma(acc[mm], a, b0, b1);
            if (!PACK)
                mma(acc[mm], a, c0l, c1l);
        }
    }
    cp_async_wait<0>();

    // The warps' partials: sums over the lanes of a row, then through shared memory.
#pragma unroll
    for (int m = 4; m < 32; m <<= 1) {
        l0 += kiln_shfl_xor_f32(l0, m);
        l1 += kiln_shfl_xor_f32(l1, m);
    }
    if (PACK) // the lo columns' part of the output joins the hi columns'
#pragma unroll
        for (int mm = 0; mm < D / 16; mm++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                acc[mm][j] += kiln_shfl_xor_f32(acc[mm][j], 2);
    // Packed, lanes t4 and t4 ^ 2 hold the same rows' values (the sums above
    // made acc the same too): lanes t4 >= 2 write them again as rows 4-7,
    // never output, so that every row the epilogue reads has been written.
    if (g == 0) {
        swm[warp][2 * t4] = m0;
        swm[warp][2 * t4 + 1] = m1;
        swl[warp][2 * t4] = l0;
        swl[warp][2 * t4 + 1] = l1;
    }
    __syncthreads(); // the tiles are consumed: their memory holds the epilogue now
    float *so = (float *)smem;               // [WARPS][ROWS][OPAD]: each warp's output, weighted
    {
        float bm0 = neg_inf(), bm1 = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            bm0 = fmaxf(bm0, swm[w][2 * t4]);
            bm1 = fmaxf(bm1, swm[w][2 * t4 + 1]);
        }
        const float w0 = fast_exp2(m0 - (bm0 == neg_inf() ? 0.0f : bm0));
        const float w1 = fast_exp2(m1 - (bm1 == neg_inf() ? 0.0f : bm1));
        float *r0p = so + (warp * ROWS + 2 * t4) * OPAD, *r1p = r0p + OPAD;
#pragma unroll
        for (int mm = 0; mm < D / 16; mm++) {
            r0p[16 * mm + g] = acc[mm][0] * w0;
            r1p[16 * mm + g] = acc[mm][1] * w1;
            r0p[16 * mm + g + 8] = acc[mm][2] * w0;
            r1p[16 * mm + g + 8] = acc[mm][3] * w1;
        }
    }
    __syncthreads();
    // Row r's max and sum over the block (every thread that needs them).
    float o[8];
    kiln_u32 item = tid, r = item / CH, d0 = (item % CH) * 8;
    float bm = neg_inf(), bl = 0.0f;
    if (item < ROWS * CH) {
#pragma unroll
        for (int w = 0; w < WARPS; w++)
            bm = fmaxf(bm, swm[w][r]);
        const float u = bm == neg_inf() ? 0.0f : bm;
#pragma unroll
        for (int w = 0; w < WARPS; w++)
            bl += fast_exp2(swm[w][r] - u) * swl[w][r];
#pragma unroll
        for (int j = 0; j < 8; j++)
            o[j] = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            const float *src = so + (w * ROWS + r) * OPAD + d0;
#pragma unroll
            for (int j = 0; j < 8; j++)
                o[j] += src[j];
        }
    }
    if (nsplit == 1) {
        if (item < ROWS * CH && r0 + r < G) {
            const float inv = 1.0f / bl;
            float y[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                y[j] = o[j] * inv;
            st_e8(out + ((kiln_u64)t * NH + h * G + r0 + r) * D + d0, y);
        }
        return;
    }
#if __CUDA_ARCH__ >= 900
    // Split: each block sends each item of its partial (the tile's real rows
    // only) into the shared memory of the rank that combines it, dealt
    // evenly over the ranks; after one cluster barrier every rank combines
    // its items from its own memory, in rank order. No block reads another's
    // memory, so none waits for the others to leave.
    {
        const kiln_u32 rows = G - r0 < ROWS ? G - r0 : ROWS, items = rows * CH;
        const kiln_u32 per_rank = (items + nsplit - 1) / nsplit;
        kiln_cluster_wait();
        if (item < items) {
            const kiln_u32 owner = item / per_rank, slot = item % per_rank;
            float *dst = &rcv[(split * per_rank + slot) * 12];
            st_cluster_f32x4(dst, owner, o[0], o[1], o[2], o[3]);
            st_cluster_f32x4(dst + 4, owner, o[4], o[5], o[6], o[7]);
            st_cluster_f32x4(dst + 8, owner, bm, bl, 0.0f, 0.0f);
        }
        kiln_cluster_arrive();
        kiln_cluster_wait();
        item = split * per_rank + tid;
        r = item / CH;
        d0 = (item % CH) * 8;
        if (tid < per_rank && item < items) {
            // Finite: rank 0's chunk starts at key ks, and every sequence has one.
            float M = neg_inf();
            for (kiln_u32 b = 0; b < nsplit; b++)
                M = fmaxf(M, rcv[(b * per_rank + tid) * 12 + 8]);
            float L = 0.0f, y[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                y[j] = 0.0f;
            for (kiln_u32 b = 0; b < nsplit; b++) {
                const float *src = &rcv[(b * per_rank + tid) * 12];
                const float w = fast_exp2(src[8] - M);
                L += w * src[9];
#pragma unroll
                for (int j = 0; j < 8; j++)
                    y[j] += w * src[j];
            }
            const float inv = 1.0f / L;
#pragma unroll
            for (int j = 0; j < 8; j++)
                y[j] *= inv;
            st_e8(out + ((kiln_u64)t * NH + h * G + r0 + r) * D + d0, y);
        }
    }
#endif
#else
    __trap(); // the provider takes paged_attention.cu's decode before sm_80
#endif
}
