// Dense linear of 9 to 32 tokens as P f32 partial products, the weight
// streamed by TMA (the design of tma_swiglu.cu; docs/performance.md says why):
//   parts[p, t, n] = sum over k in part p of x[t, k] w[n, k]
// K is cut in P equal parts; the grid is P x bp blocks, one an SM: block b
// serves part b / bp and a run of 16-row units of it, the units dealt evenly
// over the bp blocks of a part. Per 64-wide K step two TMA boxes land in a
// stage (128-byte swizzle): the block's rows and x's 32 rows (rows past the
// token count read as zero); a producer thread keeps `stages` stages in
// flight; consumer warp w takes rows 16 w..16 w + 15 (ldmatrix, mma.sync
// m16n8k16, 4 token tiles). The sum of the parts is the reader's
// (templates/rms_norm.cu's kiln_rms_norm_residual_parts).
// Programmatic dependent launch: the first `pre` stages' weight is requested
// before kiln_grid_dependency_sync() (a model weight, which no kernel ahead of
// this one writes: include/kiln/op_dense.h), x only after it.
// Constants: KILN_IN (K, a multiple of 64 P), KILN_OUT (N, a multiple of 16),
// KILN_PARTS (P), KILN_BF16 (x and w of kiln_elt, f16 or bf16, as the maps
// say; the mma multiplies that type, kiln_mma.cuh). Arguments: the tensor maps of w ([N, K], box 64 x boxr) and
// of x ([tokens, K], box 64 x 32), parts [P, tokens, N] f32, tokens (1..32),
// stages, pre. Block: 32 (boxr / 16 + 1) threads, boxr = 16 x the most units
// a block has (at most 31 x 16); dynamic shared memory stages x (boxr + 32) x
// 128 bytes + 1024. Needs sm_90.
#include "kiln_tma.cuh"

//! kiln:entry kiln_tma_linear_parts

#define K KILN_IN
#define N KILN_OUT
#define P KILN_PARTS
#define KB KILN_TMA_KB
#define NK (K / P / KB) // K steps a part
#define MAX_STAGES 8

#if K % (KB * P) != 0 || N % 16 != 0
#error "KILN_IN must be a multiple of 64 x KILN_PARTS and KILN_OUT of 16"
#endif

extern "C" __global__ void __launch_bounds__(1024, 1)
kiln_tma_linear_parts(const __grid_constant__ kiln_tmap wmap, const __grid_constant__ kiln_tmap xmap,
                      float *parts, kiln_u32 tokens, kiln_u32 stages, kiln_u32 pre)
{
    KILN_WEIGHT_BEFORE_DEPENDENCY_SYNC; // kiln_prelude.cuh: the weight's first stages, then the sync
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
    kiln_grid_dependency_sync();
    __trap(); // TMA: providers/tma.c takes this kernel from sm_90 only
#else
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) kiln_u64 full[MAX_STAGES], empty[MAX_STAGES];
    unsigned char *sm = (unsigned char *)(((kiln_u64)smem_raw + 1023) & ~(kiln_u64)1023);
    const kiln_u32 warps = blockDim.x / 32 - 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const kiln_u32 boxr = 16 * warps, units = N / 16, bp = gridDim.x / P;
    const kiln_u32 p = blockIdx.x / bp, q = blockIdx.x % bp;
    const kiln_u32 u0 = (kiln_u32)((kiln_u64)q * units / bp), u1 = (kiln_u32)((kiln_u64)(q + 1) * units / bp);
    const kiln_u32 r0 = 16 * u0, mine = 16 * (u1 - u0), k0 = p * (K / P); // rows [r0, r0 + mine)
    const kiln_u32 tile = boxr * 128, stage_bytes = tile + 32 * 128;
    const kiln_u32 S = stages < MAX_STAGES ? stages : MAX_STAGES;
    init_stages(full, empty, S, warps);
    const bool producer = warp == warps && lane == 0;
    const kiln_u32 early = pre < S ? (pre < NK ? pre : NK) : (S < NK ? S : NK);
    if (producer)
        for (kiln_u32 it = 0; it < early; it++) {
            const kiln_u32 bar = saddr(&full[it]);
            expect(bar, stage_bytes);
            tma(saddr(sm + it * stage_bytes), &wmap, k0 + it * KB, r0, bar);
        }
    kiln_grid_dependency_sync(); // x (and parts) only past here
    if (producer) {
        for (kiln_u32 it = 0; it < early; it++)
            tma(saddr(sm + it * stage_bytes) + tile, &xmap, k0 + it * KB, 0, saddr(&full[it]));
        for (kiln_u32 it = early; it < NK; it++) {
            const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes), bar = saddr(&full[s]);
            if (it >= S)
                bar_wait(saddr(&empty[s]), (it / S - 1) & 1);
            expect(bar, stage_bytes);
            tma(st, &wmap, k0 + it * KB, r0, bar);
            tma(st + tile, &xmap, k0 + it * KB, 0, bar);
        }
        return;
    }
    if (warp >= warps)
        return;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    // ldmatrix x4, lane l gives matrix l / 8's row l % 8. A: rows 16 w + l % 8
    // (+ 8 for matrices 1 and 3), chunk 2kk + l / 16; B: tokens 8 (l / 16) +
    // l % 8 (+ 16), chunk 2kk + (l / 8) % 2.
    const kiln_u32 arow = 16 * warp + lane % 8 + 8 * ((lane / 8) & 1), ach = lane / 16;
    const kiln_u32 brow = lane % 8 + 8 * (lane / 16), bch = (lane / 8) & 1;
    for (kiln_u32 it = 0; it < NK; it++) {
        const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes), xt = st + tile;
        bar_wait(saddr(&full[s]), (it / S) & 1);
#pragma unroll
        for (kiln_u32 kk = 0; kk < 4; kk++) {
            kiln_u32 a[4], b0[4], b1[4];
            ldsm_x4(st + swz(arow, 2 * kk + ach), a);
            ldsm_x4(xt + swz(brow, 2 * kk + bch), b0);
            ldsm_x4(xt + swz(brow + 16, 2 * kk + bch), b1);
            mma(acc[0], a, b0[0], b0[1]);
            mma(acc[1], a, b0[2], b0[3]);
            mma(acc[2], a, b1[0], b1[1]);
            mma(acc[3], a, b1[2], b1[3]);
        }
        __syncwarp();
        if (lane == 0)
            bar_arrive(saddr(&empty[s]));
    }
    // acc[j][i]: row 16 w + g (i < 2) or + 8, token 8 j + 2 (lane % 4) + (i & 1).
    const kiln_u32 g = lane / 4;
    float *out = parts + (kiln_u64)p * tokens * N;
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const kiln_u32 row = 16 * warp + g + (i >= 2 ? 8 : 0), tok = 8 * j + 2 * (lane % 4) + (i & 1);
            if (row < mine && tok < tokens)
                out[(kiln_u64)tok * N + r0 + row] = acc[j][i];
        }
#endif
}
