// The routed experts' two products for a decode step on sm_90 (at most 8
// tokens and 64 pairs), the experts' weights streamed by TMA as
// templates/tma_swiglu.cu streams a dense one: one block an SM, each taking
// groups of its expert's rows in turn, a group's weight one TMA box a
// k-step (small boxes stream slowly: 8-row boxes a warp ran gate_up at 1.5
// TB/s). The contract is moe_experts.cu's; its combine kernel runs after
// these, no group kernel before them.
//   The plan, in every block: the distinct experts the ids name, in expert
//   order (rank q of D), from the ids alone.
//   kiln_moe_gate_up_t  groups of W units of 8 h columns (G = ceil(I / 8W)
//                       an expert, D G in all): the group's 8W gate rows and
//                       8W up rows in two boxes, warp w's mma A tile their
//                       rows 8w..8w+7, every token of the step as its B
//                       (x's 8 rows, those past the token count read as
//                       zero); h[q, t, c] = elt(silu(g) u) for all 8 token
//                       slots (the combine reads only the pairs that exist).
//                       Block 0 writes inv[p] = 8 q + t, the row of pair p's
//                       y, and reports ids at or past E.
//   kiln_moe_down_t     groups of W units of 16 y columns (a box of 16W rows
//                       of the expert's down weight), h[q]'s 8 token rows as
//                       every warp's B, y[q, t, c] = elt(h down^T). Its first
//                       stages' weight is requested before its dependency
//                       sync: gate_up launched it only after its own wait,
//                       so the router's ids are complete, and the plan is
//                       made from them then.
// A group's rows past its expert's (the last group of one, when W does not
// divide the units) are read and dropped. A producer thread keeps the stages
// full (full and empty mbarriers, 128-byte swizzle); the W consumer warps
// read them by ldmatrix.
// Constants: KILN_BF16, KILN_HIDDEN (H), KILN_INTER (I), KILN_EXPERTS (E),
// KILN_TOP_K (K): moe_experts' spec. Arguments: tensor maps of the weight
// (gate_up [E 2I, H], boxes of 8W rows; down [E H, I], boxes of 16W) and of
// B (x [tokens, H]; h [64 x 8, I], boxes of 8 rows), the output, ids, pairs,
// stages, and for gate_up inv and the fault record. Block: 32 (W + 1)
// threads; dynamic shared memory stages x (2W + 1) KiB + 1024.
#include "kiln_tma.cuh" // saddr, swz, init_stages, bar_wait, expect, tma, ldsm_x4, mma

//! kiln:entry kiln_moe_gate_up_t
//! kiln:entry kiln_moe_down_t

#define H KILN_HIDDEN
#define I KILN_INTER
#define E KILN_EXPERTS
#define K KILN_TOP_K
#define KB KILN_TMA_KB
#define MAX_PAIRS 64
#define MAX_STAGES 8
#define NO_ROW 0xffffffffu
#define KILN_FAULT_MOE_EXPERT_ID 24u
#define EBITS ((E + 31) / 32)

#if H % 128 != 0 || I % 64 != 0 || E < 1 || E > 512 || K < 1 || K > 16 || K > E
#error "KILN_HIDDEN must be a multiple of 128, KILN_INTER of 64, KILN_EXPERTS in [1, 512], KILN_TOP_K in [1, min(16, experts)]"
#endif

struct plan {
    kiln_u32 ids[MAX_PAIRS], bits[EBITS];
    unsigned short experts[MAX_PAIRS];  // rank q -> expert
    unsigned char rank[E];              // expert -> rank (valid where named)
    kiln_u32 distinct;
};

// The plan of the ids (read through L2: down makes it before its sync).
__device__ __forceinline__ kiln_u32 make_plan(plan *pl, const kiln_u32 *__restrict__ ids, kiln_u32 pairs)
{
    const kiln_u32 tid = threadIdx.x;
    for (kiln_u32 i = tid; i < EBITS; i += blockDim.x)
        pl->bits[i] = 0;
    __syncthreads();
    for (kiln_u32 p = tid; p < pairs; p += blockDim.x) {
        const kiln_u32 id = __ldcg(ids + p);
        pl->ids[p] = id;
        if (id < E)
            atomicOr(&pl->bits[id / 32], 1u << (id % 32));
    }
    __syncthreads();
    if (tid == 0) {
        kiln_u32 n = 0;
        for (int i = 0; i < EBITS; i++)
            for (kiln_u32 m = pl->bits[i]; m; m &= m - 1) {
                const kiln_u32 e = i * 32 + __ffs(m) - 1;
                pl->experts[n] = (unsigned short)e;
                pl->rank[e] = (unsigned char)n;
                n++;
            }
        pl->distinct = n;
    }
    __syncthreads();
    return pl->distinct;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// B (8 token rows of a 64-wide k-step, a box at b) for mma k-steps 2j and
// 2j + 1: lane l reads row l % 8, chunk 4 j + l / 8.
__device__ __forceinline__ void load_b(kiln_u32 b, kiln_u32 j, kiln_u32 *r)
{
    const kiln_u32 lane = threadIdx.x % 32;
    ldsm_x4(b + swz(lane % 8, 4 * j + lane / 8), r);
}
#endif

extern "C" __global__ void __launch_bounds__(544, 1)
kiln_moe_gate_up_t(const __grid_constant__ kiln_tmap wmap, const __grid_constant__ kiln_tmap xmap,
                   kiln_elt *__restrict__ h, const kiln_u32 *__restrict__ ids, kiln_u32 pairs, kiln_u32 stages,
                   kiln_u32 *__restrict__ inv, kiln_fault *fault)
{
    kiln_grid_dependency_wait_then_launch(); // kiln_moe_down_t reads ids before its sync
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
    __trap(); // TMA: providers/moe_experts.c takes these kernels from sm_90 only
#else
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) kiln_u64 full[MAX_STAGES], empty[MAX_STAGES];
    __shared__ plan pl;
    unsigned char *sm = (unsigned char *)(((kiln_u64)smem_raw + 1023) & ~(kiln_u64)1023);
    const kiln_u32 warps = blockDim.x / 32 - 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const kiln_u32 stage_bytes = (2 * warps + 1) * 1024, S = stages < MAX_STAGES ? stages : MAX_STAGES;
    constexpr kiln_u32 NK = H / KB, COLS = I / 8; // units of 8 columns an expert
    const kiln_u32 d = make_plan(&pl, ids, pairs);
    if (blockIdx.x == 0)
        for (kiln_u32 p = threadIdx.x; p < pairs; p += blockDim.x) {
            const kiln_u32 id = pl.ids[p];
            if (id < E)
                inv[p] = 8 * pl.rank[id] + p / K;
            else {
                inv[p] = NO_ROW;
                kiln_report_fault(fault, KILN_FAULT_MOE_EXPERT_ID, p, id, E);
            }
        }
    const kiln_u32 G = (COLS + warps - 1) / warps, groups = d * G;
    const kiln_u32 rounds = blockIdx.x < groups ? (groups - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const kiln_u32 tile = warps * 1024; // 8W rows of 128 bytes
    init_stages(full, empty, S, warps);
    if (warp == warps) { // the producer
        if (lane)
            return;
        for (kiln_u32 r = 0, it = 0; r < rounds; r++) {
            const kiln_u32 grp = blockIdx.x + r * gridDim.x;
            const kiln_u32 row = pl.experts[grp / G] * 2 * I + grp % G * 8 * warps;
            for (kiln_u32 k = 0; k < NK; k++, it++) {
                const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes), bar = saddr(&full[s]);
                if (it >= S)
                    bar_wait(saddr(&empty[s]), (it / S - 1) & 1);
                expect(bar, stage_bytes);
                tma(st, &wmap, k * KB, row, bar);
                tma(st + tile, &wmap, k * KB, row + I, bar);
                tma(st + 2 * tile, &xmap, k * KB, 0, bar);
            }
        }
        return;
    }
    // ldmatrix x4 of the A tile: matrices (gate, chunk 2kk), (up, 2kk),
    // (gate, 2kk + 1), (up, 2kk + 1) of this warp's 8 rows, lane l giving
    // matrix l / 8's row l % 8.
    const kiln_u32 a_off = ((lane / 8) & 1) * tile, a_row = 8 * warp + lane % 8, a_ch = lane / 16;
    for (kiln_u32 r = 0, it = 0; r < rounds; r++) {
        const kiln_u32 grp = blockIdx.x + r * gridDim.x, q = grp / G, c0 = (grp % G * warps + warp) * 8;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (kiln_u32 k = 0; k < NK; k++, it++) {
            const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes);
            bar_wait(saddr(&full[s]), (it / S) & 1);
#pragma unroll
            for (kiln_u32 j = 0; j < 2; j++) {
                kiln_u32 b[4], a0[4], a1[4];
                load_b(st + 2 * tile, j, b);
                ldsm_x4(st + a_off + swz(a_row, 4 * j + a_ch), a0);
                ldsm_x4(st + a_off + swz(a_row, 4 * j + 2 + a_ch), a1);
                mma(acc, a0, b[0], b[1]);
                mma(acc, a1, b[2], b[3]);
            }
            __syncwarp();
            if (lane == 0)
                bar_arrive(saddr(&empty[s]));
        }
        if (c0 >= I)
            continue; // the rows past the expert's last group
        // acc[i]: row g (i < 2: the gate of column c0 + g) or g + 8 (its
        // up), token slot 2 (lane % 4) + (i & 1).
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float gate = acc[i], up = acc[i + 2];
            float e2;
            asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e2) : "f"(-gate * 1.4426950408889634f));
            h[(kiln_u64)(8 * q + 2 * (lane % 4) + i) * I + c0 + lane / 4] = kiln_f32_to_elt(gate / (1.0f + e2) * up);
        }
    }
#endif
}

extern "C" __global__ void __launch_bounds__(544, 1)
kiln_moe_down_t(const __grid_constant__ kiln_tmap wmap, const __grid_constant__ kiln_tmap hmap,
                kiln_elt *__restrict__ y, const kiln_u32 *__restrict__ ids, kiln_u32 pairs, kiln_u32 stages)
{
    KILN_INPUT_BEFORE_DEPENDENCY_SYNC; // the plan and the first stages' weight: see the header
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
    kiln_grid_dependency_sync();
    __trap();
#else
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) kiln_u64 full[MAX_STAGES], empty[MAX_STAGES];
    __shared__ plan pl;
    unsigned char *sm = (unsigned char *)(((kiln_u64)smem_raw + 1023) & ~(kiln_u64)1023);
    const kiln_u32 warps = blockDim.x / 32 - 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const kiln_u32 stage_bytes = (2 * warps + 1) * 1024, S = stages < MAX_STAGES ? stages : MAX_STAGES;
    constexpr kiln_u32 NK = I / KB, COLS = H / 16; // units of 16 columns an expert
    const kiln_u32 d = make_plan(&pl, ids, pairs);
    const kiln_u32 G = (COLS + warps - 1) / warps, groups = d * G;
    const kiln_u32 rounds = blockIdx.x < groups ? (groups - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const kiln_u32 total = rounds * NK, tile = warps * 2048; // 16W rows of 128 bytes
    init_stages(full, empty, S, warps);
    const bool producer = warp == warps && lane == 0;
    // Stage it's boxes: the group's 16W weight rows, then h's 8 rows.
    auto group_of = [&](kiln_u32 it) { return blockIdx.x + it / NK * gridDim.x; };
    auto weight = [&](kiln_u32 it) {
        const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes), bar = saddr(&full[s]), grp = group_of(it);
        expect(bar, stage_bytes);
        tma(st, &wmap, it % NK * KB, pl.experts[grp / G] * H + grp % G * 16 * warps, bar);
    };
    auto activations = [&](kiln_u32 it) {
        const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes), bar = saddr(&full[s]);
        tma(st + tile, &hmap, it % NK * KB, 8 * (group_of(it) / G), bar);
    };
    const kiln_u32 early = S < total ? S : total;
    if (producer)
        for (kiln_u32 it = 0; it < early; it++)
            weight(it);
    kiln_grid_dependency_sync(); // h only past here
    if (warp == warps) {
        if (lane)
            return;
        for (kiln_u32 it = 0; it < early; it++)
            activations(it);
        for (kiln_u32 it = early; it < total; it++) {
            bar_wait(saddr(&empty[it % S]), (it / S - 1) & 1);
            weight(it);
            activations(it);
        }
        return;
    }
    // ldmatrix x4 of this warp's 16 rows of the box: matrices (rows 0-7,
    // chunk 2kk), (rows 8-15, 2kk), (rows 0-7, 2kk + 1), (rows 8-15, 2kk + 1).
    const kiln_u32 a_row = 16 * warp + lane % 8 + 8 * ((lane / 8) & 1), a_ch = lane / 16;
    for (kiln_u32 r = 0, it = 0; r < rounds; r++) {
        const kiln_u32 grp = blockIdx.x + r * gridDim.x, q = grp / G, c0 = (grp % G * warps + warp) * 16;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (kiln_u32 k = 0; k < NK; k++, it++) {
            const kiln_u32 s = it % S, st = saddr(sm + s * stage_bytes);
            bar_wait(saddr(&full[s]), (it / S) & 1);
#pragma unroll
            for (kiln_u32 j = 0; j < 2; j++) {
                kiln_u32 b[4], a0[4], a1[4];
                load_b(st + tile, j, b);
                ldsm_x4(st + swz(a_row, 4 * j + a_ch), a0);
                ldsm_x4(st + swz(a_row, 4 * j + 2 + a_ch), a1);
                mma(acc, a0, b[0], b[1]);
                mma(acc, a1, b[2], b[3]);
            }
            __syncwarp();
            if (lane == 0)
                bar_arrive(saddr(&empty[s]));
        }
        if (c0 >= H)
            continue;
        // acc[i]: row g (i < 2) or g + 8 of the warp's 16, token slot 2 (lane % 4) + (i & 1).
#pragma unroll
        for (int i = 0; i < 4; i++)
            y[(kiln_u64)(8 * q + 2 * (lane % 4) + (i & 1)) * H + c0 + lane / 4 + (i >= 2 ? 8 : 0)] =
                kiln_f32_to_elt(acc[i]);
    }
#endif
}
