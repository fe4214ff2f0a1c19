// Causal paged attention for prefill on Hopper's warpgroup MMA (sm_90a): the
// attention half of include/kiln/op_attention.h for commands of more than one
// new token a sequence; kiln_paged_append (templates/paged_attention.cu) runs
// first and writes the rotated k and v to the pages.
// A work item is 128 query rows of one sequence and kv head, row r = token *
// G + head within the group, so a GQA group's query heads share every K and
// V tile. Warp specialized, 384 threads:
//   warps 8-11, the producer: copy the K and V tiles of 128 keys from the
//     sequence's pages into shared memory through KSTAGES stages of K and V
//     together, each with a full and an empty mbarrier (SPLIT_KV, head_dim
//     256: K through KSTAGES slots and V through VSTAGES, each slot with its
//     own pair, so that a K slot is free once its scores are done while V is
//     read a turn later; stages of both left its two no slot to fill ahead),
//     into 128-byte-swizzled panels
//     (templates/kiln_wgmma.cuh): where a tile's keys are whole pages (KV_TMA:
//     the page's tokens a multiple of 8 dividing 128) and all below the
//     sequence's end, one thread asks TMA for each page's box of 64 columns
//     (the map kvmap views the arena as rows of D elements); otherwise, and
//     for the tile that holds the end, cp.async, 16 bytes a copy, a page
//     lookup a key, zeros past the end (ncu had the cp.async producer at a
//     quarter of a 4 x 1024 block's issued samples);
//   warpgroups 0 and 1, the consumers, 64 rows each:
//     S = Q K^T   wgmma m64n128k16, Q and K from shared memory (K-major);
//     O += P V    wgmma m64n{D}k16, P from registers (the f32 scores turned
//                 into kiln_elt in place: the accumulator's layout is the A
//                 operand's), V from shared memory (N-major).
//     They take turns to issue their products (two named barriers, as
//     FlashAttention-3's ping-pong): one warpgroup's softmax runs on the
//     CUDA cores while the other's product runs on the tensor cores.
// q is rotated (RoPE in f32), scaled by log2(e) / sqrt(D) and rounded to kiln_elt
// once, in shared memory for the whole block; the softmax runs online in f32
// with exp2, and P is rounded to kiln_elt for its product, as FlashAttention
// does. The causal mask is applied only on the tiles that cross a row's last
// key (and, with a sliding window, the tiles that cross a row's first: a
// block reads the keys from its first row's first on). Items are taken from
// the last row tiles (the longest) down.
// Device data is checked as in templates/kiln_paged.cuh: a bad sequence is
// skipped and reported through the fault record.
// The argument window: a token attends the window keys up to its own
// (Mistral's sliding_window), 0xffffffff for every key before it; kvmap, the
// arena as RPP rows of D elements a page in boxes of 64 x PT, 128-byte
// swizzle, read where KV_TMA and kv_tma bit 0 is set; kvmap3, the arena as
// (D columns, RPP rows, pages) in boxes of 64 x PT x BN / PT, read for a
// tile whose pages follow one another where bit 1 is set.
// Constants: KILN_BF16 (the element type), KILN_HEAD_DIM (64, 128, 256),
// KILN_HEADS, KILN_KV_HEADS, KILN_PAGE_TOKENS. Grid: x = blocks, each taking
// work items of (row tile, kv head, sequence), row_tiles x KVH x seqs of
// them, until they run out (kiln_paged_prefill); THREADS threads; dynamic
// shared memory SMEM_BYTES (providers/paged_attention.c restates both).
#include "kiln_reduce.cuh"

//! kiln:entry kiln_paged_prefill
//! kiln:arch-specific

#define D KILN_HEAD_DIM
#define HALF (D / 2)
#define NH KILN_HEADS
#define KVH KILN_KV_HEADS
#define G (NH / KVH)
#define PT KILN_PAGE_TOKENS
#define THREADS 384             // two consumer warpgroups and the producer warpgroup
#define CONSUMERS 256
#define BM 128                  // query rows a block: 64 a warpgroup
#define BN (D == 256 ? 64 : 128) // keys a tile (64 at head_dim 256: two stages and q fit)
#define SPLIT_KV (D == 256)     // K and V in rings of their own (bench_attention --prefill)
#define KSTAGES (D == 256 ? 2 : D == 128 ? 3 : 4) // K slots (or stages of K and V): free after a turn's scores
#define VSTAGES (D == 256 ? 3 : KSTAGES)          // V slots: free after the next turn's product
#if SPLIT_KV
#define SLOT_BYTES TILE_BYTES                // a K slot; the V slots follow the K slots
#define V_AT(sk, s) ((sk) + (KSTAGES + (s)) * TILE_BYTES)
#else
#define SLOT_BYTES (2 * TILE_BYTES)          // a stage, K then V
#define V_AT(sk, s) ((sk) + (s) * SLOT_BYTES + TILE_BYTES)
#endif
#define K_AT(sk, s) ((sk) + (s) * SLOT_BYTES)
#define Q_PANEL (BM * 128)      // bytes of a 64-column panel of Q
#define KV_PANEL (BN * 128)     // and of K or V
#define Q_BYTES (BM * D * 2)
#define TILE_BYTES (BN * D * 2) // K (or V) of one tile
#define SMEM_BYTES (Q_BYTES + (KSTAGES + VSTAGES) * TILE_BYTES + 1024) // and the slack to align to 1024
#define PRODUCER_REGS 40        // after setmaxnreg: 128 x 40 + 256 x 232 = 384 x 168, all a block has
#define CONSUMER_REGS 232
#define BAR_Q 1                 // named barriers: the consumers' q is in shared memory,
#define BAR_TURN 2              // and 2 + w: warpgroup w's turn to issue a product,
#define BAR_OUT 4               // and 4 + w: warpgroup w's output is staged
#define KV_TMA (PT % 8 == 0 && BN % PT == 0) // whole pages a tile, 8-row aligned boxes
#define RPP (65536 / (2 * D))   // rows of D elements a page (K's, then V's from RPP / 2)

#if KILN_HEAD_DIM != 64 && KILN_HEAD_DIM != 128 && KILN_HEAD_DIM != 256
#error "this kernel takes head_dim 64, 128 or 256"
#endif
#include "kiln_paged.cuh" // the page layout, fault codes, RoPE, load_sequence
#include "kiln_prefill.cuh"
#include "kiln_tma.cuh"   // saddr, bar_wait, expect, tma, kiln_tmap
#include "kiln_wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
static_assert(KILN_SPLIT_FITS(THREADS - CONSUMERS, PRODUCER_REGS, CONSUMERS, CONSUMER_REGS),
              "the setmaxnreg split passes the block's registers at launch (kiln_wgmma.cuh)");

__device__ __forceinline__ void named_sync(kiln_u32 id)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(CONSUMERS) : "memory");
}

__device__ __forceinline__ void named_arrive(kiln_u32 id)
{
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(CONSUMERS) : "memory");
}

// Waits for the block's tile n's slot of a ring of S to be full, then makes
// the producer's copies visible to wgmma's proxy. (Fencing only the tiles
// that cp.async brought cost head_dim 64 4% at 1 x 16384: bench_attention
// --prefill.)
template <kiln_u32 S> __device__ __forceinline__ void wait_tile(kiln_u64 *full, kiln_u32 n)
{
    bar_wait(saddr(&full[n % S]), (n / S) & 1);
    fence_proxy_async();
}

// The producer's wait for tile n's slot of a ring of S to be empty (its last
// use, tile n - S, over).
template <kiln_u32 S> __device__ __forceinline__ void wait_empty(kiln_u64 *empty, kiln_u32 n)
{
    if (n >= S)
        bar_wait(saddr(&empty[n % S]), (n / S - 1) & 1);
}

#if KV_TMA
// Whether the pages of the tile of keys [c0, c0 + BN) (table row trow)
// follow one another in the arena, where kv_tma allows a box of several.
__device__ __forceinline__ bool tile_run(const kiln_u32 *trow, kiln_u32 c0, kiln_u32 kv_tma)
{
    bool run = (kv_tma & 2u) != 0;
#pragma unroll
    for (kiln_u32 pg = 1; pg < BN / PT; pg++)
        run = run && trow[c0 / PT + pg] == trow[c0 / PT] + pg;
    return run;
}

// One thread's TMA copies of the K (half 0) or V (half 1) tile of keys
// [c0, c0 + BN), whole pages of table row trow (run: tile_run's answer),
// into the tile at dst, completing on bar (whose bytes the caller expects).
__device__ __forceinline__ void tma_tile(kiln_u32 dst, const kiln_tmap *kvmap, const kiln_tmap *kvmap3,
                                         const kiln_u32 *trow, kiln_u32 h, kiln_u32 c0, kiln_u32 half, bool run,
                                         kiln_u32 bar)
{
    if (run) {
        // One box of the tile's BN / PT pages a panel (kvmap3: columns, a
        // page's rows, pages), 2 copies a tile at head_dim 128 rather than 16.
#pragma unroll
        for (kiln_u32 panel = 0; panel < D / 64; panel++)
            tma3(dst + panel * KV_PANEL, kvmap3, panel * 64, h * PT + half * (RPP / 2), trow[c0 / PT], bar);
        return;
    }
#pragma unroll
    for (kiln_u32 pg = 0; pg < BN / PT; pg++)
#pragma unroll
        for (kiln_u32 panel = 0; panel < D / 64; panel++)
            tma(dst + panel * KV_PANEL + pg * PT * 128, kvmap, panel * 64,
                trow[c0 / PT + pg] * RPP + h * PT + half * (RPP / 2), bar);
}
#endif

// Issues sc = Q K^T for warpgroup wg's 64 rows, K the tile at shared address
// kst (one commit group).
__device__ __forceinline__ void scores(float *sc, kiln_u32 sq, kiln_u32 kst, kiln_u32 wg)
{
#if BN == 128
#define SCORES_FIRST wgmma_ss_n128_first
#define SCORES_NEXT wgmma_ss_n128
#else
#define SCORES_FIRST wgmma_ss_n64_first
#define SCORES_NEXT wgmma_ss_n64
#endif
    // Q's rows opaque here, so that its descriptors are made at each call
    // rather than hoisted out of the item loop into registers (spilled there).
    kiln_u32 qa = sq + wg * 8192;
    asm volatile("" : "+r"(qa));
    SCORES_FIRST(sc, wgmma_desc(qa, 16, 1024), wgmma_desc(kst, 16, 1024));
#pragma unroll
    for (int kk = 1; kk < D / 16; kk++)
        SCORES_NEXT(sc, wgmma_desc(qa + (kk / 4) * Q_PANEL + (kk % 4) * 32, 16, 1024),
                    wgmma_desc(kst + (kk / 4) * KV_PANEL + (kk % 4) * 32, 16, 1024));
#undef SCORES_FIRST
#undef SCORES_NEXT
    wgmma_commit();
}

// Issues o += P V with V at shared address vst (one commit group).
__device__ __forceinline__ void product(float *o, kiln_u32 (*p)[4], kiln_u32 vst)
{
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
#if D == 256
        // Two of N = 128: columns [0, 128) from V's first two panels, then the rest.
        wgmma_rs_n128(o, p[kk], wgmma_desc(vst + kk * 16 * 128, KV_PANEL, 1024));
        wgmma_rs_n128(o + 64, p[kk], wgmma_desc(vst + 2 * KV_PANEL + kk * 16 * 128, KV_PANEL, 1024));
#elif D == 128
        wgmma_rs_n128(o, p[kk], wgmma_desc(vst + kk * 16 * 128, KV_PANEL, 1024));
#else
        wgmma_rs_n64(o, p[kk], wgmma_desc(vst + kk * 16 * 128, KV_PANEL, 1024));
#endif
    }
    wgmma_commit();
}

#endif

// Round k's work item of this block: the items in snake order (block b takes
// item b of round 0, gridDim.x - 1 - b of round 1, ...), so that the blocks
// that took the longest items of one round take the shortest of the next.
__device__ __forceinline__ kiln_u64 work_item(kiln_u32 k)
{
    return (kiln_u64)k * gridDim.x + (k & 1u ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Asks L2 for the q rows of item b (the producer, while the consumers are on
// the item before): the consumers' loads of them then wait on L2, not DRAM.
__device__ __forceinline__ void prefetch_q(const kiln_elt *__restrict__ qin, kiln_u32 q_stride, const prefill_block &b,
                                           kiln_u32 me, kiln_u32 n)
{
    constexpr kiln_u32 LINES = (G * D * 2 + 127) / 128 + 1; // a token's G heads, unaligned
    const kiln_u32 tok0 = b.r0 / G, rend = b.r0 + BM < b.nrows ? b.r0 + BM : b.nrows;
    const kiln_u32 ntok = (rend - 1) / G + 1 - tok0;
    for (kiln_u32 idx = me; idx < ntok * LINES; idx += n) {
        const kiln_elt *row = qin + (kiln_u64)(b.q.start + tok0 + idx / LINES) * q_stride + (kiln_u64)(b.h * G) * D;
        const unsigned char *line = (const unsigned char *)row + idx % LINES * 128;
        if (line < (const unsigned char *)(row + G * D))
            asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
    }
}
#endif

// Grid: x = blocks, each taking work items (prefill_item_head) in snake order
// (work_item) until they run out: one a block where the grid is all of them,
// or a persistent grid of one block an SM, whose producer copies the next
// item's first tiles while the consumers finish the last.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_paged_prefill(const kiln_elt *__restrict__ qin, kiln_u32 q_stride, const kiln_u32 *__restrict__ positions,
                   const kiln_u32 *__restrict__ table, const kiln_u32 *__restrict__ seq_lens,
                   const kiln_u32 *__restrict__ spans, const unsigned char *__restrict__ pages, kiln_elt *out,
                   kiln_u32 n_pages, kiln_u32 max_blocks, kiln_u32 tokens, kiln_u32 max_query, kiln_u32 window,
                   float qscale, rope_freqs freqs, kiln_fault *fault, const __grid_constant__ kiln_tmap kvmap,
                   const __grid_constant__ kiln_tmap kvmap3, kiln_u32 kv_tma, kiln_u32 row_tiles, kiln_u32 seqs)
{
    KILN_INPUT_BEFORE_DEPENDENCY_SYNC;
    // Before the sync, while the append runs: the spans, the lengths, the
    // positions and the first item's q, which kernels ahead of the append
    // wrote (they are complete: the append lets this kernel launch only after
    // its own wait) and the append does not write, read through L2. The
    // block table and the pages follow the sync.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) kiln_u64 kfull[KSTAGES], kempty[KSTAGES];
#if SPLIT_KV
    __shared__ __align__(8) kiln_u64 vfull[VSTAGES], vempty[VSTAGES];
#else
    kiln_u64 *const vfull = kfull, *const vempty = kempty; // V's stage is K's
    (void)vfull;
#endif
    // Set by the producer for the K slot it fills with nothing (and the V
    // slot beside it) when an item's pages fail their check; the consumers
    // clear it.
    __shared__ kiln_u32 bad_pages[KSTAGES];
    __shared__ float inv[HALF]; // RoPE's inverse frequencies (prefill_load_q)
    const kiln_u32 tid = threadIdx.x, lane = tid % 32;
    const kiln_u64 items = (kiln_u64)row_tiles * KVH * seqs;
    unsigned char *sm = smem_raw + ((1024u - (saddr(smem_raw) & 1023u)) & 1023u);
    const kiln_u32 sq = saddr(sm), sk = sq + Q_BYTES;
    stage_barriers_init<KSTAGES, THREADS - CONSUMERS, CONSUMERS>(kfull, kempty);
#if SPLIT_KV
    stage_barriers_init<VSTAGES, THREADS - CONSUMERS, CONSUMERS>(vfull, vempty);
#endif
    if (tid < KSTAGES)
        bad_pages[tid] = 0;
    prefill_inv_to_shared(inv, freqs, tid, THREADS);
    __syncthreads(); // the last block-wide barrier: the roles part here

    if (tid >= CONSUMERS) {
        // The producer: the items' tiles, in order, tile g (of all the
        // block's) into stage g % KSTAGES (SPLIT_KV: K slot g % KSTAGES and
        // V slot g % VSTAGES) once its last use is over. It gives
        // registers to the consumers, which hold two tiles' P.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        // The scan after the sync, through L1: through L2 before it, every
        // block's scan of a long table cost head_dim 256 at 16384 tokens 7%
        // (bench_attention --prefill).
        kiln_grid_dependency_sync();
        kiln_u64 checked = 0; // sequences s < 64 whose pages passed the check
        kiln_u32 g = 0;
        for (kiln_u32 k = 0; work_item(k) < items; k++) {
            const kiln_u64 i = work_item(k);
            prefill_block blk;
            if (!prefill_item_head<BM>(i, row_tiles, seqs, seq_lens, spans, max_blocks, tokens, max_query, window,
                                       fault, &blk))
                continue;
            if (k > 0)
                prefetch_q(qin, q_stride, blk, tid - CONSUMERS, THREADS - CONSUMERS);
            const kiln_u32 h = blk.h, s = blk.s, ke = blk.ke;
            const kiln_u32 kb = blk.ks / BN * BN, ntiles = (ke - kb + BN - 1) / BN;
            const kiln_u32 *trow = table + (kiln_u64)s * max_blocks;
            // Every page the sequence reads must lie in the arena (each warp
            // checks, so that none waits on another): if one does not, the
            // item's first slot is made full with nothing in it and flagged.
            if (s >= 64 || !(checked >> s & 1u)) {
                const kiln_u32 bad = __reduce_min_sync(0xffffffffu, first_bad_page(trow, blk.q.len, n_pages, lane, 32));
                if (bad != 0xffffffffu) {
                    wait_empty<KSTAGES>(kempty, g);
#if SPLIT_KV
                    wait_empty<VSTAGES>(vempty, g);
#endif
                    if (tid == CONSUMERS) {
                        bad_pages[g % KSTAGES] = 1;
                        if (blk.tile == 0 && h == 0)
                            report_bad_page(fault, s, trow, bad, n_pages);
                    }
                    bar_arrive(saddr(&kfull[g % KSTAGES]));
#if SPLIT_KV
                    bar_arrive(saddr(&vfull[g % VSTAGES]));
#endif
                    g++;
                    continue;
                }
                if (s < 64)
                    checked |= 1ull << s;
            }
            for (kiln_u32 n = 0; n < ntiles; n++, g++) {
                const kiln_u32 c0 = kb + n * BN, kdst = K_AT(sk, g % KSTAGES), vdst = V_AT(sk, g % VSTAGES);
                const kiln_u32 kbar = saddr(&kfull[g % KSTAGES]);
                wait_empty<KSTAGES>(kempty, g);
#if KV_TMA
                if (kv_tma && c0 + BN <= ke) {
                    // The pages were checked against the arena (above). K is
                    // asked for before the wait for V's slot, which frees later.
                    const bool run = tid == CONSUMERS && tile_run(trow, c0, kv_tma);
                    if (tid == CONSUMERS) {
                        expect(kbar, SPLIT_KV ? TILE_BYTES : 2 * TILE_BYTES);
                        tma_tile(kdst, &kvmap, &kvmap3, trow, h, c0, 0, run, kbar);
#if !SPLIT_KV
                        tma_tile(vdst, &kvmap, &kvmap3, trow, h, c0, 1, run, kbar);
#endif
                    } else {
                        bar_arrive(kbar);
                    }
#if SPLIT_KV
                    wait_empty<VSTAGES>(vempty, g);
                    if (tid == CONSUMERS) {
                        expect(saddr(&vfull[g % VSTAGES]), TILE_BYTES);
                        tma_tile(vdst, &kvmap, &kvmap3, trow, h, c0, 1, run, saddr(&vfull[g % VSTAGES]));
                    } else {
                        bar_arrive(saddr(&vfull[g % VSTAGES]));
                    }
#endif
                    continue;
                }
#endif
#if SPLIT_KV
                wait_empty<VSTAGES>(vempty, g);
#endif
                prefill_load_kv<BN>(pages, trow, h, c0, ke, kdst, vdst, tid - CONSUMERS, THREADS - CONSUMERS);
                // An arrival waits for all of this thread's copies, K's and V's.
                bar_arrive_cp_async(kbar);
#if SPLIT_KV
                bar_arrive_cp_async(saddr(&vfull[g % VSTAGES]));
#endif
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    // This thread's two rows (of its warp's 16).
    const kiln_u32 wg = tid / 128, warp = tid % 128 / 32, ra = wg * 64 + warp * 16 + lane / 4;
    const kiln_u32 my_turn = BAR_TURN + wg, other_turn = BAR_TURN + (wg ^ 1u);
    bool synced = false;
    kiln_u32 g = 0; // the tiles of the block's items so far, as the producer counts them
    for (kiln_u32 k = 0; work_item(k) < items; k++) {
        const kiln_u64 i = work_item(k);
        prefill_block blk;
        if (!prefill_item_head<BM>(i, row_tiles, seqs, seq_lens, spans, max_blocks, tokens, max_query, window, fault,
                                   &blk))
            continue;
        const seq_info q = blk.q;
        const kiln_u32 h = blk.h, nrows = blk.nrows, r0 = blk.r0, ke = blk.ke;
        // Tiles of keys kb + n BN, n < ntiles: from the tile of the item's first key.
        const kiln_u32 kb = blk.ks / BN * BN, ntiles = (ke - kb + BN - 1) / BN;
        // q in shared memory first, once the last item's output has left it.
        named_sync(BAR_Q);
        prefill_load_q<BM>(sm, qin, q_stride, positions, freqs, inv, qscale, q, h, r0, tid, CONSUMERS);
        fence_proxy_async();
        named_sync(BAR_Q);
        if (!synced) {
            kiln_grid_dependency_sync(); // costs nothing here: tile 0 comes after the producer's
            synced = true;
        }
        wait_tile<KSTAGES>(kfull, g);
        if (bad_pages[g % KSTAGES]) {
#if SPLIT_KV
            wait_tile<VSTAGES>(vfull, g);
#endif
            named_sync(BAR_Q); // every consumer has read the flag
            if (tid == 0)
                bad_pages[g % KSTAGES] = 0;
            bar_arrive(saddr(&kempty[g % KSTAGES]));
#if SPLIT_KV
            bar_arrive(saddr(&vempty[g % VSTAGES]));
#endif
            g++;
            continue;
        }

        prefill_rows rows = prefill_rows_init(blk, ra, window);
        float o[D / 2];
#pragma unroll
        for (int j = 0; j < D / 2; j++)
            o[j] = 0.0f;
        // Turns: warpgroup 0 issues first; each issue hands the turn over, and
        // warpgroup 1 skips the last hand-over so that no arrival is left over.
        if (wg == 1)
            named_arrive(other_turn);

        // Tile n's scores come while tile n - 1's P V is computed (as
        // FlashAttention-3 overlaps them within a warpgroup): a turn issues S_n =
        // Q K_n^T, then O += P_{n-1} V_{n-1}; the softmax of S_n runs while the
        // second product is on the tensor cores, and O is rescaled once it is done.
        // A K slot is given back once its scores are done, a V slot once its
        // product is.
        float sc[BN / 2], scale_a, scale_b;
        kiln_u32 p[BN / 16][4];
        named_sync(my_turn);
        wgmma_fence();
        scores(sc, sq, K_AT(sk, g % KSTAGES), wg);
        named_arrive(other_turn);
        wgmma_wait<0>();
#if SPLIT_KV
        bar_arrive(saddr(&kempty[g % KSTAGES]));
#endif
        prefill_softmax<BN>(sc, kb, lane, &rows, &scale_a, &scale_b);
        prefill_pack<BN>(sc, p);
        for (kiln_u32 n = 1; n < ntiles; n++) {
            const kiln_u32 vs = (g + n - 1) % VSTAGES;
            wait_tile<KSTAGES>(kfull, g + n);
#if SPLIT_KV
            wait_tile<VSTAGES>(vfull, g + n - 1);
#endif
            named_sync(my_turn);
            wgmma_fence();
            scores(sc, sq, K_AT(sk, (g + n) % KSTAGES), wg);
            product(o, p, V_AT(sk, vs));
            named_arrive(other_turn);
            wgmma_wait<1>(); // S_n is done; P_{n-1} V_{n-1} may still run
#if SPLIT_KV
            bar_arrive(saddr(&kempty[(g + n) % KSTAGES]));
#endif
            prefill_softmax<BN>(sc, kb + n * BN, lane, &rows, &scale_a, &scale_b);
            wgmma_wait<0>(); // P_{n-1} V_{n-1} is done: its slot is free, O and P may change
            bar_arrive(saddr(&vempty[vs]));
            prefill_rescale(o, scale_a, scale_b);
            prefill_pack<BN>(sc, p);
        }
        {
            const kiln_u32 vs = (g + ntiles - 1) % VSTAGES;
#if SPLIT_KV
            wait_tile<VSTAGES>(vfull, g + ntiles - 1);
#endif
            named_sync(my_turn);
            wgmma_fence();
            product(o, p, V_AT(sk, vs));
            if (wg == 0)
                named_arrive(other_turn);
            wgmma_wait<0>();
            bar_arrive(saddr(&vempty[vs]));
        }
        g += ntiles;

        // The output through this warpgroup's rows of the q tile (its last
        // product that reads them is done), then out 16 bytes a copy.
        if (((kiln_u64)out & 15u) == 0) {
            prefill_stage<BM>(o, &rows, sm, ra, lane);
            asm volatile("bar.sync %0, 128;" ::"r"(BAR_OUT + wg) : "memory");
            prefill_store_rows<BM, 64>(sm, wg * 64, r0, nrows, q, h, out, tid % 128, 128);
        } else {
            prefill_store(o, &rows, r0, ra, nrows, q, h, out, lane);
        }
    }
    if (!synced)
        kiln_grid_dependency_sync(); // no block leaves before the append is done
#else
    kiln_grid_dependency_sync();
    __trap(); // wgmma needs sm_90a: providers/paged_attention.c takes it only there
#endif
}
