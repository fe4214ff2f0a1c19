// Causal paged attention for prefill on mma.sync (sm_80 on), the design of
// FlashAttention-2: the attention half of include/kiln/op_attention.h where
// wgmma is not (sm_80, sm_86, sm_89, sm_100 on); kiln_paged_append
// (templates/paged_attention.cu) runs first and writes the rotated k and v.
// A block takes 64 query rows of one sequence and kv head (row r = token * G
// + head within the group: a GQA group's heads share every K and V tile),
// four warps of 16 rows each. Keys come in tiles of 64 from the sequence's
// pages (cp.async by every thread, two stages: the next tile lands while
// this one is computed) into 128-byte-swizzled shared memory
// (templates/kiln_prefill.cuh), read with ldmatrix without bank conflicts:
//   S = Q K^T   mma m16n8k16, q's fragments in registers for the whole block;
//   O += P V    mma m16n8k16, P from registers (the f32 scores turned into
//               kiln_elt in place), V through ldmatrix.trans.
// q is rotated, scaled and rounded to kiln_elt (f16 or bf16) once; the
// softmax runs online in f32 with exp2, P is rounded to kiln_elt for its product, as FlashAttention
// does; the causal mask only on the tiles that cross a row's last key.
// Blocks take row tiles from the last (the longest) down. Device data is
// checked as in templates/kiln_paged.cuh.
// The argument window: a token attends the window keys up to its own
// (Mistral's sliding_window), 0xffffffff for every key before it.
// Constants: KILN_BF16 (the element type), KILN_HEAD_DIM (64, 128),
// KILN_HEADS, KILN_KV_HEADS, KILN_PAGE_TOKENS. Grid: x = row tiles, y = kv head, z = sequence; 128
// threads; dynamic shared memory SMEM_BYTES (providers/paged_attention.c
// restates both).
#include "kiln_reduce.cuh"

//! kiln:entry kiln_paged_prefill_mma

#define D KILN_HEAD_DIM
#define HALF (D / 2)
#define NH KILN_HEADS
#define KVH KILN_KV_HEADS
#define G (NH / KVH)
#define PT KILN_PAGE_TOKENS
#define THREADS 128
#define BM 64                   // query rows a block: 16 a warp
#define BN 64                   // keys a tile
#define Q_BYTES (BM * D * 2)
#define TILE_BYTES (BN * D * 2) // K (or V) of one tile
#define STAGE_BYTES (2 * TILE_BYTES)
#define SMEM_BYTES (Q_BYTES + 2 * STAGE_BYTES + 1024) // and the slack to align to 1024

#if KILN_HEAD_DIM > 128
#error "this kernel takes head_dim 64 or 128 (256 runs on templates/paged_attention.cu)"
#endif
#include "kiln_paged.cuh" // the page layout, fault codes, RoPE, load_sequence
#include "kiln_prefill.cuh" // and kiln_mma.cuh


extern "C" __global__ void __launch_bounds__(THREADS)
kiln_paged_prefill_mma(const kiln_elt *__restrict__ qin, kiln_u32 q_stride, const kiln_u32 *__restrict__ positions,
                       const kiln_u32 *__restrict__ table, const kiln_u32 *__restrict__ seq_lens,
                       const kiln_u32 *__restrict__ spans, const unsigned char *__restrict__ pages, kiln_elt *out,
                       kiln_u32 n_pages, kiln_u32 max_blocks, kiln_u32 tokens, kiln_u32 max_query, kiln_u32 window,
                       float qscale, rope_freqs freqs, kiln_fault *fault)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    extern __shared__ unsigned char smem_raw[];
    const kiln_u32 tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    prefill_block blk;
    if (!prefill_block_begin<BM>(table, seq_lens, spans, n_pages, max_blocks, tokens, max_query, window, fault,
                                 &blk))
        return;
    const seq_info q = blk.q;
    const kiln_u32 h = blk.h, s = blk.s, nrows = blk.nrows, r0 = blk.r0, ke = blk.ke;
    // Tiles of keys kb + n BN, n < ntiles: from the tile of the block's first key.
    const kiln_u32 kb = blk.ks / BN * BN, ntiles = (ke - kb + BN - 1) / BN;
    const kiln_u32 *trow = table + (kiln_u64)s * max_blocks;
    unsigned char *sm = smem_raw + ((1024u - (saddr(smem_raw) & 1023u)) & 1023u);
    const kiln_u32 sq = saddr(sm), skv = sq + Q_BYTES;

    // The first tile in flight while the queries are rotated.
    prefill_load_kv<BN>(pages, trow, h, kb, ke, skv, skv + TILE_BYTES, tid, THREADS);
    cp_async_commit();
    prefill_load_q<BM>(sm, qin, q_stride, positions, freqs, nullptr, qscale, q, h, r0, tid, THREADS);
    __syncthreads();

    // This warp's q fragments (rows 16 warp .. + 15), kept for the whole block:
    // lane l addresses row l % 8 + 8 (m % 2), column 8 (m / 2) of the k-step
    // (m = l / 8, the 8 x 8 matrix it addresses).
    const kiln_u32 m8 = lane / 8, i8 = lane % 8;
    kiln_u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        ldsm_x4(sq + swz_at(warp * 16 + i8 + 8 * (m8 % 2), kk * 16 + 8 * (m8 / 2), BM * 128), qf[kk]);

    prefill_rows rows = prefill_rows_init(blk, warp * 16 + lane / 4, window);
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        o[i] = 0.0f;
    for (kiln_u32 n = 0; n < ntiles; n++) {
        if (n + 1 < ntiles)
            prefill_load_kv<BN>(pages, trow, h, kb + (n + 1) * BN, ke, skv + ((n + 1) & 1) * STAGE_BYTES,
                                skv + ((n + 1) & 1) * STAGE_BYTES + TILE_BYTES, tid, THREADS);
        cp_async_commit();
        cp_async_wait<1>(); // this thread's copies of tile n have landed
        __syncthreads();                                      // and everyone's
        const kiln_u32 kst = skv + (n & 1) * STAGE_BYTES, vst = kst + TILE_BYTES;

        // S: K's 8 x 8 matrices m are keys 16 j + i8 + 8 (m / 2), columns 8 (m % 2)
        // of the k-step: b0, b1 of key block 2 j, then of 2 j + 1.
        float sc[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            sc[i] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int j = 0; j < BN / 16; j++) {
                kiln_u32 b[4];
                ldsm_x4(kst + swz_at(16 * j + i8 + 8 * (m8 / 2), kk * 16 + 8 * (m8 % 2), BN * 128), b);
                mma(sc + 8 * j, qf[kk], b[0], b[1]);
                mma(sc + 8 * j + 4, qf[kk], b[2], b[3]);
            }
        float scale_a, scale_b;
        prefill_softmax<BN>(sc, kb + n * BN, lane, &rows, &scale_a, &scale_b);
        prefill_rescale(o, scale_a, scale_b);
        kiln_u32 p[BN / 16][4];
        prefill_pack<BN>(sc, p);
        // O += P V: V's matrices m (transposed) are keys 16 kk + i8 + 8 (m % 2),
        // columns 16 j + 8 (m / 2): b0, b1 of column block 2 j, then 2 j + 1.
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
            for (int j = 0; j < D / 16; j++) {
                kiln_u32 b[4];
                ldsm_x4_trans(vst + swz_at(16 * kk + i8 + 8 * (m8 % 2), 16 * j + 8 * (m8 / 2), BN * 128), b);
                mma(o + 8 * j, p[kk], b[0], b[1]);
                mma(o + 8 * j + 4, p[kk], b[2], b[3]);
            }
        __syncthreads(); // the stage is consumed before the next tile's loads reuse it
    }
    // The output through this warp's rows of the q tile (read once, into
    // qf, before the loop), then out 16 bytes a copy.
    if (((kiln_u64)out & 15u) == 0) {
        prefill_stage<BM>(o, &rows, sm, warp * 16 + lane / 4, lane);
        __syncwarp();
        prefill_store_rows<BM, 16>(sm, warp * 16, r0, nrows, q, h, out, lane, 32);
    } else {
        prefill_store(o, &rows, r0, warp * 16 + lane / 4, nrows, q, h, out, lane);
    }
#else
    __trap(); // no mma.sync m16n8k16: providers/paged_attention.c takes the CUDA-core kernel before sm_80
#endif
}
