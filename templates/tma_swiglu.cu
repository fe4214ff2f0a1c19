// Dense SwiGLU of 9 to 32 tokens in one kernel, the weight streamed by TMA:
//   out[t, n] = silu(g) * u, g = sum_k x[t, k] w[n, k], u = sum_k x[t, k] w[I + n, k]
// (w: gate rows, then up rows, as HF's gate_proj and up_proj), g and u in f32
// on the tensor cores (mma.sync m16n8k16), never rounded before silu; x, w
// and out of kiln_elt (f16, or bf16 with KILN_BF16: the maps' type too).
// One block an SM (the grid is the SM count): block b serves outputs
// [8 u0, 8 u1), units of 8 dealt evenly over the blocks, so that every SM
// streams the same share of the weight (its bandwidth is what the SMs
// share). Per 64-wide K step, three TMA boxes land in one stage (128-byte
// swizzle): the block's gate rows, its up rows, and x's 32 rows (rows past
// the token count read as zero); a producer thread keeps `stages` stages in
// flight (full / empty mbarriers); consumer warp w takes outputs 8 w..8 w + 7:
// its mma A tile is their 8 gate rows over their 8 up rows, so that a lane's
// accumulators hold a gate and its up, and the epilogue needs no exchange.
// Programmatic dependent launch: the first `pre` stages' weight is requested
// before kiln_grid_dependency_sync() (the weight, a model parameter, is not
// written by the kernels ahead of this one: include/kiln/op_dense.h), under
// the tail of the kernel ahead; x only after it.
// Constants: KILN_HIDDEN (K, a multiple of 64), KILN_INTERMEDIATE (I), KILN_BF16.
// Arguments: the tensor maps of w ([2 I, K], box 64 x boxg) and of x
// ([tokens, K], box 64 x 32), out [tokens, I], tokens (1..32), stages, pre.
// Block: 32 (boxg / 8 + 1) threads, boxg = 8 x the most units a block has
// (at most 31);
// dynamic shared memory stages x (2 boxg + 32) x 128 bytes + 1024. Needs
// sm_90.
#include "kiln_tma.cuh"

//! kiln:entry kiln_tma_swiglu

#define K KILN_HIDDEN
#define I KILN_INTERMEDIATE
#define KB KILN_TMA_KB
#define NK (K / KB)
#define MAX_STAGES 8

#if K % KB != 0
#error "KILN_HIDDEN must be a multiple of 64"
#endif

extern "C" __global__ void __launch_bounds__(1024, 1)
kiln_tma_swiglu(const __grid_constant__ kiln_tmap wmap, const __grid_constant__ kiln_tmap xmap, kiln_elt *out,
                kiln_u32 tokens, kiln_u32 stages, kiln_u32 pre)
{
    KILN_WEIGHT_BEFORE_DEPENDENCY_SYNC; // kiln_prelude.cuh: the weight's first stages, then the sync
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
    kiln_grid_dependency_sync();
    __trap(); // TMA: providers/swiglu.c takes this kernel from sm_90 only
#else
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) kiln_u64 full[MAX_STAGES], empty[MAX_STAGES];
    unsigned char *sm = (unsigned char *)(((kiln_u64)smem_raw + 1023) & ~(kiln_u64)1023);
    const kiln_u32 warps = blockDim.x / 32 - 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const kiln_u32 boxg = 8 * warps, units = I / 8;
    const kiln_u32 u0 = (kiln_u32)((kiln_u64)blockIdx.x * units / gridDim.x),
                   u1 = (kiln_u32)((kiln_u64)(blockIdx.x + 1) * units / gridDim.x);
    const kiln_u32 r0 = 8 * u0, mine = 8 * (u1 - u0); // outputs [r0, r0 + mine)
    const kiln_u32 tile = boxg * 128, stage_bytes = 2 * tile + 32 * 128;
    const kiln_u32 S = stages < MAX_STAGES ? stages : MAX_STAGES;
    init_stages(full, empty, S, warps);
    const bool producer = warp == warps && lane == 0;
    const kiln_u32 early = pre < S ? (pre < NK ? pre : NK) : (S < NK ? S : NK);
    if (producer)
        for (kiln_u32 it = 0; it < early; it++) {
            const kiln_u32 st = saddr(sm + it * stage_bytes), bar = saddr(&full[it]);
            expect(bar, stage_bytes);
            tma(st, &wmap, it * KB, r0, bar);
            tma(st + tile, &wmap, it * KB, I + r0, bar);
        }
    kiln_grid_dependency_sync(); // x (and out) only past here
    if (producer) {
        for (kiln_u32 it = 0; it < early; it++)
            tma(saddr(sm + it * stage_bytes) + 2 * tile, &xmap, it * KB, 0, saddr(&full[it]));
        for (kiln_u32 it = early; it < NK; it++) {
            const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes), bar = saddr(&full[s]);
            if (it >= S)
                bar_wait(saddr(&empty[s]), (it / S - 1) & 1);
            expect(bar, stage_bytes);
            tma(st, &wmap, it * KB, r0, bar);
            tma(st + tile, &wmap, it * KB, I + r0, bar);
            tma(st + 2 * tile, &xmap, it * KB, 0, bar);
        }
        return;
    }
    if (warp >= warps)
        return;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    // ldmatrix x4, lane l gives matrix l / 8's row l % 8. A: matrices (gate,
    // chunk 2kk), (up, 2kk), (gate, 2kk + 1), (up, 2kk + 1) of this warp's 8
    // outputs; B: tokens 8 (l / 16) + l % 8 (+ 16), chunk 2kk + (l / 8) % 2.
    const kiln_u32 arow = 8 * warp + lane % 8, aup = ((lane / 8) & 1) * tile, ach = lane / 16;
    const kiln_u32 brow = lane % 8 + 8 * (lane / 16), bch = (lane / 8) & 1;
    for (kiln_u32 it = 0; it < NK; it++) {
        const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes), xt = st + 2 * tile;
        bar_wait(saddr(&full[s]), (it / S) & 1);
#pragma unroll
        for (kiln_u32 kk = 0; kk < 4; kk++) {
            kiln_u32 a[4], b0[4], b1[4];
            ldsm_x4(st + aup + swz(arow, 2 * kk + ach), a);
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
    // acc[j][i]: row g of the A tile (i < 2: gate of output 8 w + g) or g + 8
    // (its up), token 8 j + 2 (lane % 4) + (i & 1).
    const kiln_u32 o = 8 * warp + lane / 4;
    if (o >= mine)
        return;
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const kiln_u32 tok = 8 * j + 2 * (lane % 4) + i;
            if (tok >= tokens)
                continue;
            const float gate = acc[j][i], up = acc[j][i + 2];
            // silu(g) = g / (1 + exp(-g)); ex2.approx gives +inf for large
            // arguments, where g / inf = -0 is silu's limit.
            float e2;
            asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e2) : "f"(-gate * 1.4426950408889634f));
            out[(kiln_u64)tok * I + r0 + o] = kiln_f32_to_elt(gate / (1.0f + e2) * up);
        }
#endif
}
