// The routed experts' two grouped products on Hopper's warpgroup MMA
// (sm_90a), for prefill-sized commands: the same contract, workspace and
// grid as kiln_moe_gate_up_l / kiln_moe_down_l (templates/moe_experts.cu,
// whose group and combine kernels run around these), with row tiles of 128
// rows (the group kernel's bm) and column tiles of 256 weight rows:
//   kiln_moe_gate_up_w  h[r, n0 + c] = elt(silu(g) u), c < 128: g from the
//                       expert's gate rows n0 + c, u from its up rows I + n0 + c;
//   kiln_moe_down_w     y[r, n0 + c] = elt(h[r] down[e][n0 + c]^T), c < 256.
// Warp specialized, 384 threads, as templates/paged_prefill.cu:
//   warpgroup 2, the producer: each 64-wide k-step's A rows (x gathered by
//     token through the sorted pairs by cp.async, rows past the tile's zero;
//     or h's 128 rows from the tile's first by TMA, amap, boxes of 64 x 128)
//     and the 256 weight rows by TMA (wmap: the experts' weights as rows of
//     the inner dimension, boxes of 64 x 128 for gate_up's two halves, 64 x
//     256 for down); cp.async for all of them where w_tma is 0,
//     into 128-byte-swizzled stages (kiln_wgmma.cuh's layout), STAGES of
//     them, full and empty mbarriers;
//   warpgroups 0 and 1, 64 rows each: a wgmma m64n256k16 a 16-wide step
//     (the stage's 256 weight rows), f32 accumulators in
//     registers, one commit group kept in flight; the tile's outputs
//     staged in shared memory (the stages, free by then) and written 16
//     bytes a copy.
// Constants: KILN_BF16, KILN_HIDDEN (H, a multiple of 256 here), KILN_INTER
// (I, a multiple of 128 here), KILN_EXPERTS, KILN_TOP_K: the moe_experts
// spec's (providers/moe_experts.c takes this kernel only for such sizes).
// Dynamic shared memory SMEM_BYTES; grid x = column tiles (I / 128 for
// gate_up, H / 256 for down), y = the most row tiles a routing can have.
#include "kiln_tma.cuh"    // saddr, swz, bar_wait, cp_async16
#include "kiln_reduce.cuh" // kiln_f32_to_e2
#include "kiln_wgmma.cuh"
#include "kiln_moe.cuh"     // KILN_MOE_GEMM_ARGS

//! kiln:entry kiln_moe_gate_up_w
//! kiln:entry kiln_moe_down_w
//! kiln:arch-specific

#define H KILN_HIDDEN
#define I KILN_INTER
#define K KILN_TOP_K
#define THREADS 384
#define CONSUMERS 256
#define BM 128                        // rows a tile: 64 a consumer warpgroup
#define BN 256                        // weight rows a column tile: two n128 halves
#define BK 64                         // a k-step: one 128-byte swizzled row
#define A_BYTES (BM * 128)
#define STAGE_BYTES (A_BYTES + BN * 128)
#define STAGES 4
#define SMEM_BYTES (STAGES * STAGE_BYTES + 1024) // and the slack to align to 1024
#define OUT_LD(cols) ((cols) * 2 + 16) // bytes a staged output row: 16 more, no bank conflicts
#define PRODUCER_REGS 80              // the rows' sources in registers: 56 spills them
#define CONSUMER_REGS 208             // 128 x 80 + 256 x 208 = 384 x 168, all a block has

#if H % 256 != 0 || I % 128 != 0
#error "the wgmma experts take KILN_HIDDEN a multiple of 256 and KILN_INTER of 128"
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
static_assert(KILN_SPLIT_FITS(THREADS - CONSUMERS, PRODUCER_REGS, CONSUMERS, CONSUMER_REGS),
              "the setmaxnreg split passes the block's registers at launch (kiln_wgmma.cuh)");

template <bool GATED>
__device__ __forceinline__ void grouped_wgmma(const kiln_elt *__restrict__ src, const kiln_elt *__restrict__ w,
                                              kiln_elt *__restrict__ dst, const kiln_u32 *__restrict__ n_tiles,
                                              const kiln_u32 *__restrict__ offsets,
                                              const kiln_u32 *__restrict__ tile_e,
                                              const kiln_u32 *__restrict__ tile_r,
                                              const kiln_u32 *__restrict__ sorted, unsigned char *smem_raw,
                                              const kiln_tmap *wmap, const kiln_tmap *amap, kiln_u32 w_tma)
{
    constexpr kiln_u32 KD = GATED ? H : I;   // the inner dimension
    constexpr kiln_u32 NOUT = GATED ? I : H; // output columns of a row
    constexpr kiln_u32 KSTEPS = KD / BK;
    __shared__ __align__(8) kiln_u64 full[STAGES], empty[STAGES];
    __shared__ kiln_u32 arow[BM]; // the source row of each tile row (0xffffffff: past the tile)
    const kiln_u32 tile = blockIdx.y;
    if (tile >= *n_tiles)
        return;
    const kiln_u32 e = tile_e[tile], r0 = tile_r[tile], end = offsets[e + 1];
    const kiln_u32 nrows = end - r0 < (kiln_u32)BM ? end - r0 : (kiln_u32)BM;
    const kiln_u32 n0 = blockIdx.x * (GATED ? BN / 2 : BN);
    const kiln_u32 tid = threadIdx.x;
    unsigned char *sm = smem_raw + ((1024u - (saddr(smem_raw) & 1023u)) & 1023u);
    const kiln_u32 s0 = saddr(sm);
    if (tid < BM)
        arow[tid] = tid < nrows ? (GATED ? sorted[r0 + tid] / K : r0 + tid) : 0xffffffffu;
    stage_barriers_init<STAGES, THREADS - CONSUMERS, CONSUMERS>(full, empty);
    __syncthreads(); // the last block-wide barrier: the roles part here

    if (tid >= CONSUMERS) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        // Thread p copies chunk p % 8 of rows p / 8 + 16 i: A's 8 rows, B's
        // 16. The A rows' sources are read once: reading arow[] a k-step,
        // each load waited behind the cp.async before it (the asm's memory
        // clobber), a sixth of the products' warp samples (ncu's source
        // page, bench_moe at 4096 tokens).
        const kiln_u32 p = tid - CONSUMERS, ch = p % 8, rr = p / 8;
        const bool a_tma = !GATED && w_tma; // h's rows are in order: one box a k-step
        const kiln_elt *we = w + (kiln_u64)e * (GATED ? 2 * I : H) * KD + ch * 8;
        const kiln_elt *asrc[BM / 16]; // row 0 where the row is past the tile (and nothing read)
        kiln_u32 live = 0;             // bit i: row rr + 16 i is the tile's
#pragma unroll
        for (kiln_u32 i = 0; i < BM / 16; i++) {
            const kiln_u32 row = arow[rr + 16 * i];
            live |= row != 0xffffffffu ? 1u << i : 0u;
            asrc[i] = src + (row != 0xffffffffu ? (kiln_u64)row * KD : 0) + ch * 8;
        }
        for (kiln_u32 ks = 0; ks < KSTEPS; ks++) {
            const kiln_u32 st = ks % STAGES, sa = s0 + st * STAGE_BYTES, sb = sa + A_BYTES;
            if (ks >= STAGES)
                bar_wait(saddr(&empty[st]), (ks / STAGES - 1) & 1);
            if (!a_tma)
#pragma unroll
                for (kiln_u32 i = 0; i < BM / 16; i++)
                    cp_async16(sa + swz(rr + 16 * i, ch), asrc[i] + ks * BK, live >> i & 1 ? 16 : 0);
            if (!w_tma)
#pragma unroll
                for (kiln_u32 i = 0; i < BN / 16; i++) {
                    const kiln_u32 rho = rr + 16 * i;
                    // gate_up: rows n0 + c of the gate half, then I + n0 + c of the up half.
                    const kiln_u32 grow = GATED ? (rho / 128) * I + n0 + rho % 128 : n0 + rho;
                    cp_async16(sb + swz(rho, ch), we + (kiln_u64)grow * KD + ks * BK, 16);
                }
            if (w_tma && p == 0) {
                // The weight's rows by TMA, counted before this thread's
                // cp.async arrival (which the phase waits for).
                const kiln_u32 bar = saddr(&full[st]), wrow = e * (GATED ? 2 * I : H) + n0;
                expect_only(bar, BN * 128 + (a_tma ? A_BYTES : 0));
                if (GATED) {
                    tma(sb, wmap, ks * BK, wrow, bar);
                    tma(sb + 128 * 128, wmap, ks * BK, wrow + I, bar);
                } else {
                    // Rows past the tile are the next expert's or, past h's
                    // pairs, TMA's zeros: the epilogue stores none of them.
                    tma(sa, amap, ks * BK, r0, bar);
                    tma(sb, wmap, ks * BK, wrow, bar);
                }
            }
            bar_arrive_cp_async(saddr(&full[st]));
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    const kiln_u32 wg = tid / 128, warp = tid % 128 / 32, lane = tid % 32;
    float d[128]; // columns 0-127 of the tile in 0-63, 128-255 in 64-127
#pragma unroll
    for (int i = 0; i < 128; i++)
        d[i] = 0.0f;
    for (kiln_u32 ks = 0; ks < KSTEPS; ks++) {
        const kiln_u32 st = ks % STAGES, sa = s0 + st * STAGE_BYTES + wg * 8192, sb = s0 + st * STAGE_BYTES + A_BYTES;
        bar_wait(saddr(&full[st]), (ks / STAGES) & 1);
        fence_proxy_async(); // the producer's cp.async writes, to wgmma's proxy
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            wgmma_ss_n256(d, wgmma_desc(sa + kk * 32, 16, 1024), wgmma_desc(sb + kk * 32, 16, 1024));
        }
        wgmma_commit();
        wgmma_wait<1>(); // step ks - 1's products are done: its stage is free
        if (ks > 0)
            bar_arrive(saddr(&empty[(ks - 1) % STAGES]));
    }
    wgmma_wait<0>();

    // Registers 4 j + {0, 1}: row ra, columns 8 j + 2 (lane % 4) + {0, 1} of
    // a half; 4 j + {2, 3}: row ra + 8. Each warpgroup stages its 64 rows
    // in the stages once both warpgroups' products are done (the other may
    // still read any stage until then), then copies them out 16 bytes a copy.
    asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
    constexpr kiln_u32 COLS = GATED ? BN / 2 : BN, LD = OUT_LD(COLS);
    const kiln_u32 ra = wg * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        unsigned char *row = sm + (ra + 8 * half) * LD + 4 * (lane % 4);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const float *g = &d[4 * j + 2 * half], *u = &d[64 + 4 * j + 2 * half];
            if (GATED) {
                // silu(g) u; __fdividef gives 0 where 1 + exp(-g) passes
                // 2^126 (silu's limit). The division's slow-path branch a
                // value was a tenth of gate_up's warp samples (ncu's source
                // page, bench_moe at 4096 tokens).
                *(kiln_u32 *)(row + 16 * j) = kiln_f32_to_e2(__fdividef(g[0], 1.0f + __expf(-g[0])) * u[0],
                                                             __fdividef(g[1], 1.0f + __expf(-g[1])) * u[1]);
            } else {
                *(kiln_u32 *)(row + 16 * j) = kiln_f32_to_e2(g[0], g[1]);
                *(kiln_u32 *)(row + 256 + 16 * j) = kiln_f32_to_e2(u[0], u[1]);
            }
        }
    }
    asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");
    constexpr kiln_u32 CH = COLS / 8; // 16-byte chunks a row
#pragma unroll 4
    for (kiln_u32 c = tid % 128; c < 64 * CH; c += 128) {
        const kiln_u32 r = wg * 64 + c / CH, q = c % CH;
        if (r < nrows)
            kiln_stg16(dst + (kiln_u64)(r0 + r) * NOUT + n0 + q * 8, *(const kiln_u32x4 *)(sm + r * LD + q * 16));
    }
}
#endif

extern __shared__ __align__(1024) unsigned char smem[];

extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_moe_gate_up_w(KILN_MOE_GEMM_ARGS, const __grid_constant__ kiln_tmap wmap, kiln_u32 w_tma)
{
    kiln_grid_dependency_sync();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_wgmma<true>(src, w, dst, n_tiles, offsets, tile_e, tile_r, sorted, smem, &wmap, &wmap, w_tma);
#else
    __trap(); // wgmma needs sm_90a: providers/moe_experts.c takes this kernel only there
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_moe_down_w(KILN_MOE_GEMM_ARGS, const __grid_constant__ kiln_tmap wmap, kiln_u32 w_tma,
                const __grid_constant__ kiln_tmap amap)
{
    kiln_grid_dependency_sync();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_wgmma<false>(src, w, dst, n_tiles, offsets, tile_e, tile_r, sorted, smem, &wmap, &amap, w_tma);
#else
    __trap();
#endif
}
