// Routed SwiGLU experts (include/kiln/op_moe.h is the contract), four or
// five launches over a workspace the provider lays out:
//   kiln_moe_count     where the pairs need more than one grouping block:
//                      each slice's pairs counted per expert;
//   kiln_moe_group     the (token, slot) pairs' offsets per expert, a list of
//                      row tiles of bm rows (each within one expert) and the
//                      permutation both ways, a block a slice;
//   kiln_moe_gate_up_* per (column tile, row tile): h = elt(silu(g) u) of the
//                      tile's rows, [g | u] = x[token] gate_up[e]^T in f32;
//   kiln_moe_down_*    per (column tile, row tile): y = elt(h down[e]^T);
//   kiln_moe_combine   per token: out = elt(sum_s w y + c shared).
// The products are mma.sync m16n8k16 tiles over 128-byte-swizzled shared
// memory, fed by a cp.async pipeline: A rows gathered (x by token, h by
// sorted row), B the expert's weight rows, read once per row tile. _s tiles
// are 16 rows (the decode step: a few rows an expert), _l 64. Blocks past the
// tile count the group kernel wrote exit at once, so the grid is sized for
// the worst routing and one launch serves every routing.
// Constants: KILN_BF16, KILN_HIDDEN (H, a multiple of 128), KILN_INTER (I, a
// multiple of 64), KILN_EXPERTS (E, 1..512), KILN_TOP_K (K, 1..min(16, E)).
#include "kiln_mma.cuh"    // saddr, cp_async16, ldsm_x4, mma
#include "kiln_reduce.cuh" // kiln_block_sum, kiln_e8_to_f32, kiln_f32_to_e8
#include "kiln_moe.cuh"     // KILN_MOE_GEMM_ARGS

//! kiln:entry kiln_moe_count
//! kiln:entry kiln_moe_group
//! kiln:entry kiln_moe_gate_up_s
//! kiln:entry kiln_moe_down_s
//! kiln:entry kiln_moe_gate_up_l
//! kiln:entry kiln_moe_down_l
//! kiln:entry kiln_moe_combine

#define H KILN_HIDDEN
#define I KILN_INTER
#define E KILN_EXPERTS
#define K KILN_TOP_K
#define BK 64 // elements of a k-step: one 128-byte swizzled row
#define GROUP_THREADS 1024
#define COMBINE_THREADS 256
#define NO_ROW 0xffffffffu
#define KILN_FAULT_MOE_EXPERT_ID 24u

#if H % 128 != 0 || I % 64 != 0 || E < 1 || E > 512 || K < 1 || K > 16 || K > E
#error "KILN_HIDDEN must be a multiple of 128, KILN_INTER of 64, KILN_EXPERTS in [1, 512], KILN_TOP_K in [1, min(16, experts)]"
#endif

// Grouping. Where the pairs pass SLICE, kiln_moe_count writes each slice's
// counts an expert (hist[b E + e], slice b) and kiln_moe_group runs a block
// a slice, each placing its own pairs after the slices before it; else one
// block counts and places every pair. A block of one slice reads its ids
// once, all in flight before any is used: one block of 1024 threads taking
// 32768 pairs a load at a time was 49 us of the 4096-token layer (ncu,
// bench_moe --tokens 4096), two dependent loads a pair and every scattered
// store from one SM. The scan is one warp's: lane l owns experts
// [l EPL, (l + 1) EPL).
#define EPL ((E + 31) / 32)
#define SLICE 2048                       // pairs a block where there are several blocks
#define PER (SLICE / GROUP_THREADS)      // a thread's pairs of a slice

// Thread tid's PER ids of pairs [p0, p1) (NO_ROW past p1), all loads issued first.
__device__ __forceinline__ void load_ids(const kiln_u32 *__restrict__ ids, kiln_u32 p0, kiln_u32 p1,
                                         kiln_u32 (&v)[PER])
{
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const kiln_u32 p = p0 + threadIdx.x + j * GROUP_THREADS;
        v[j] = p < p1 ? ids[p] : NO_ROW;
    }
}

// Counts ids v of pairs [q, p1) (load_ids') into cnt; reports an id past the experts.
__device__ __forceinline__ void count_slice(const kiln_u32 (&v)[PER], kiln_u32 q, kiln_u32 p1, kiln_u32 *cnt,
                                            kiln_fault *fault)
{
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const kiln_u32 p = q + threadIdx.x + j * GROUP_THREADS;
        if (v[j] < E)
            atomicAdd(&cnt[v[j]], 1u);
        else if (p < p1)
            kiln_report_fault(fault, KILN_FAULT_MOE_EXPERT_ID, p, v[j], E);
    }
}

// Counts the ids of pairs [p0, p1) into cnt.
__device__ __forceinline__ void count_ids(const kiln_u32 *__restrict__ ids, kiln_u32 p0, kiln_u32 p1,
                                          kiln_u32 *cnt, kiln_fault *fault)
{
    for (kiln_u32 q = p0; q < p1; q += SLICE) {
        kiln_u32 v[PER];
        load_ids(ids, q, p1, v);
        count_slice(v, q, p1, cnt, fault);
    }
}

extern "C" __global__ void __launch_bounds__(GROUP_THREADS)
kiln_moe_count(const kiln_u32 *__restrict__ ids, kiln_u32 pairs, kiln_u32 *__restrict__ hist, kiln_fault *fault)
{
    kiln_grid_dependency_sync();
    __shared__ kiln_u32 cnt[E];
    for (kiln_u32 e = threadIdx.x; e < E; e += GROUP_THREADS)
        cnt[e] = 0;
    __syncthreads();
    const kiln_u32 p0 = blockIdx.x * SLICE;
    count_ids(ids, p0, min(p0 + SLICE, pairs), cnt, fault);
    __syncthreads();
    for (kiln_u32 e = threadIdx.x; e < E; e += GROUP_THREADS)
        hist[blockIdx.x * E + e] = cnt[e];
}

extern "C" __global__ void __launch_bounds__(GROUP_THREADS)
kiln_moe_group(const kiln_u32 *__restrict__ ids, kiln_u32 pairs, kiln_u32 bm, const kiln_u32 *__restrict__ hist,
               kiln_u32 *__restrict__ n_tiles, kiln_u32 *__restrict__ offsets, kiln_u32 *__restrict__ tile_e,
               kiln_u32 *__restrict__ tile_r, kiln_u32 *__restrict__ sorted, kiln_u32 *__restrict__ inv,
               kiln_fault *fault)
{
    kiln_grid_dependency_sync();
    __shared__ kiln_u32 cnt[E], before[E], off[E + 1], toff[E + 1];
    const kiln_u32 tid = threadIdx.x, b = blockIdx.x, nb = gridDim.x;
    const kiln_u32 p0 = b * SLICE, p1 = nb > 1 ? min(p0 + SLICE, pairs) : pairs;
    kiln_u32 v[PER]; // the first slice's ids, asked for before the counts: the two loads overlap
    load_ids(ids, p0, p1, v);
    for (kiln_u32 e = tid; e < E; e += GROUP_THREADS) {
        cnt[e] = 0;
        before[e] = 0;
    }
    __syncthreads();
    if (nb == 1) {
        count_slice(v, p0, p1, cnt, fault);
        count_ids(ids, p0 + SLICE, p1, cnt, fault);
    } else {
        // Every slice's counts (kiln_moe_count's), and those of the slices before this one.
        for (kiln_u32 i0 = 0; i0 < nb * E; i0 += 4 * GROUP_THREADS) {
            kiln_u32 h[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const kiln_u32 i = i0 + tid + j * GROUP_THREADS;
                h[j] = i < nb * E ? hist[i] : 0;
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const kiln_u32 i = i0 + tid + j * GROUP_THREADS;
                if (h[j]) {
                    atomicAdd(&cnt[i % E], h[j]);
                    if (i / E < b)
                        atomicAdd(&before[i % E], h[j]);
                }
            }
        }
    }
    __syncthreads();
    if (tid < 32) {
        kiln_u32 rows = 0, tiles = 0;
        for (kiln_u32 j = 0; j < EPL; j++) {
            const kiln_u32 e = tid * EPL + j;
            if (e < E) {
                rows += cnt[e];
                tiles += (cnt[e] + bm - 1) / bm;
            }
        }
        kiln_u32 r = rows, t = tiles; // inclusive scans over the lanes
        for (int d = 1; d < 32; d *= 2) {
            const kiln_u32 ur = __shfl_up_sync(0xffffffffu, r, d), ut = __shfl_up_sync(0xffffffffu, t, d);
            if (tid >= (kiln_u32)d) {
                r += ur;
                t += ut;
            }
        }
        r -= rows;
        t -= tiles;
        for (kiln_u32 j = 0; j < EPL; j++) {
            const kiln_u32 e = tid * EPL + j;
            if (e < E) {
                off[e] = r;
                toff[e] = t;
                r += cnt[e];
                t += (cnt[e] + bm - 1) / bm;
            }
        }
        if (tid == 31) {
            off[E] = r;
            toff[E] = t;
            if (b == 0)
                *n_tiles = t;
        }
    }
    __syncthreads();
    if (b == 0) {
        for (kiln_u32 e = tid; e <= E; e += GROUP_THREADS)
            offsets[e] = off[e];
        // Tile i belongs to the first expert e with toff[e + 1] > i (one that
        // has tiles: toff[e] <= i); a thread a tile, whatever the routing.
        for (kiln_u32 i = tid, n = toff[E]; i < n; i += GROUP_THREADS) {
            kiln_u32 lo = 0, hi = E - 1;
            while (lo < hi) {
                const kiln_u32 mid = (lo + hi) / 2;
                if (toff[mid + 1] > i)
                    hi = mid;
                else
                    lo = mid + 1;
            }
            tile_e[i] = lo;
            tile_r[i] = off[lo] + (i - toff[lo]) * bm;
        }
    }
    // This block's pairs, after the slices before it: the next free row of
    // their expert (before[] counts on as the fill).
    for (kiln_u32 q = p0; q < p1; q += SLICE) {
        if (q != p0)
            load_ids(ids, q, p1, v);
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const kiln_u32 p = q + tid + j * GROUP_THREADS;
            if (p < p1) {
                kiln_u32 pos = NO_ROW;
                if (v[j] < E) {
                    pos = off[v[j]] + atomicAdd(&before[v[j]], 1u);
                    sorted[pos] = p;
                }
                inv[p] = pos;
            }
        }
    }
}

// Byte offset of (row r, 16-byte chunk c) in a tile of 128-byte rows.
__device__ __forceinline__ kiln_u32 swz(kiln_u32 r, kiln_u32 c) { return r * 128 + ((c ^ (r % 8)) << 4); }

// One row tile of one expert times a column tile of its weight. WM x WN
// warps; a warp's MI m16 blocks by its NB n8 blocks, whose weight rows lie
// together in shared memory (GATED: NI blocks of gate rows, then the same NI
// columns' up rows; the epilogue pairs block b with b + NI). One ldmatrix x4
// reads blocks 2j and 2j + 1. The tile's nrows rows (at most BM): row r reads
// src row a_row(r) and writes dst row o_row(r); n0 is its first column.
template <int WM, int WN, int MI, int NI, int STAGES, bool GATED, class ARow, class ORow>
__device__ __forceinline__ void tile_product(const kiln_elt *__restrict__ src, const kiln_elt *__restrict__ w,
                                             kiln_elt *__restrict__ dst, kiln_u32 e, kiln_u32 nrows, kiln_u32 n0,
                                             ARow a_row, ORow o_row, unsigned char *smem_raw)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int KD = GATED ? H : I;   // the inner dimension
    constexpr int NOUT = GATED ? I : H; // output columns of a row
    constexpr int NB = GATED ? 2 * NI : NI;
    constexpr int BM = WM * MI * 16, BROWS = WN * NB * 8, BOUT = WN * NI * 8, THREADS = WM * WN * 32;
    constexpr int A_BYTES = BM * 128, STAGE = A_BYTES + BROWS * 128, KSTEPS = KD / BK;
    constexpr int A_CH = BM * 8 / THREADS, B_CH = BROWS * 8 / THREADS;
    static_assert(NB % 2 == 0 && BM * 8 % THREADS == 0 && BROWS * 8 % THREADS == 0 && NOUT % BOUT == 0, "tile");
    const kiln_u32 tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wm = warp / WN, wn = warp % WN;
    unsigned char *sm = smem_raw + ((128u - (saddr(smem_raw) & 127u)) & 127u);
    const kiln_u32 s0 = saddr(sm);

    // Each thread's chunks: A rows gathered (zero-filled past the tile's
    // rows), B the expert's weight rows.
    const kiln_elt *arow[A_CH];
    kiln_u32 aoff[A_CH], abytes[A_CH];
#pragma unroll
    for (int i = 0; i < A_CH; i++) {
        const kiln_u32 c = tid + i * THREADS, r = c / 8;
        const bool ok = r < nrows;
        kiln_u64 row = 0;
        if (ok)
            row = a_row(r);
        arow[i] = src + row * KD + (c % 8) * 8;
        aoff[i] = swz(r, c % 8);
        abytes[i] = ok ? 16 : 0;
    }
    const kiln_elt *brow[B_CH];
    kiln_u32 boff[B_CH];
    const kiln_elt *we = w + (kiln_u64)e * (GATED ? 2 * I : H) * KD;
#pragma unroll
    for (int i = 0; i < B_CH; i++) {
        const kiln_u32 c = tid + i * THREADS, rho = c / 8, bw = rho / (NB * 8), loc = rho % (NB * 8);
        kiln_u32 grow;
        if (GATED)
            grow = (loc / (NI * 8)) * I + n0 + bw * NI * 8 + loc % (NI * 8);
        else
            grow = n0 + bw * NB * 8 + loc;
        brow[i] = we + (kiln_u64)grow * KD + (c % 8) * 8;
        boff[i] = A_BYTES + swz(rho, c % 8);
    }
    auto load = [&](int ks) {
        const kiln_u32 st = s0 + (ks % STAGES) * STAGE;
#pragma unroll
        for (int i = 0; i < A_CH; i++)
            cp_async16(st + aoff[i], abytes[i] ? arow[i] + ks * BK : src, abytes[i]);
#pragma unroll
        for (int i = 0; i < B_CH; i++)
            cp_async16(st + boff[i], brow[i] + ks * BK, 16);
    };

    float acc[MI][NB][4];
#pragma unroll
    for (int a = 0; a < MI; a++)
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                acc[a][b][c] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < KSTEPS)
            load(s);
        cp_async_commit();
    }
    const kiln_u32 m8 = lane / 8, i8 = lane % 8;
    for (int ks = 0; ks < KSTEPS; ks++) {
        cp_async_wait<STAGES - 2>(); // this thread's copies of step ks have landed
        __syncthreads();             // and everyone's; step ks - 1's stage is free
        if (ks + STAGES - 1 < KSTEPS)
            load(ks + STAGES - 1);
        cp_async_commit();
        const kiln_u32 sa = s0 + (ks % STAGES) * STAGE, sb = sa + A_BYTES;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            kiln_u32 af[MI][4];
#pragma unroll
            for (int a = 0; a < MI; a++)
                ldsm_x4(sa + swz(wm * MI * 16 + a * 16 + i8 + 8 * (m8 % 2), kk * 2 + m8 / 2), af[a]);
#pragma unroll
            for (int j = 0; j < NB / 2; j++) {
                kiln_u32 b[4];
                ldsm_x4(sb + swz(wn * NB * 8 + 16 * j + i8 + 8 * (m8 / 2), kk * 2 + m8 % 2), b);
#pragma unroll
                for (int a = 0; a < MI; a++) {
                    mma(acc[a][2 * j], af[a], b[0], b[1]);
                    mma(acc[a][2 * j + 1], af[a], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // Registers 0, 1: row lane / 4, columns 2 (lane % 4) + {0, 1} of the n8
    // block; 2, 3: row lane / 4 + 8.
#pragma unroll
    for (int a = 0; a < MI; a++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const kiln_u32 r = wm * MI * 16 + a * 16 + lane / 4 + 8 * half;
            if (r >= nrows)
                continue;
            kiln_elt *out = dst + (kiln_u64)o_row(r) * NOUT;
#pragma unroll
            for (int b = 0; b < (GATED ? NI : NB); b++) {
                const kiln_u32 col = n0 + wn * (GATED ? NI : NB) * 8 + b * 8 + 2 * (lane % 4);
                float v0, v1;
                if (GATED) {
                    const float *g = &acc[a][b][2 * half], *u = &acc[a][b + NI][2 * half];
                    v0 = g[0] / (1.0f + __expf(-g[0])) * u[0];
                    v1 = g[1] / (1.0f + __expf(-g[1])) * u[1];
                } else {
                    v0 = acc[a][b][2 * half];
                    v1 = acc[a][b][2 * half + 1];
                }
                *(kiln_u32 *)(out + col) = kiln_f32_to_e2(v0, v1);
            }
        }
#else
    __trap(); // no mma.sync m16n8k16: the provider refuses devices before sm_80
#endif
}

// Row tile blockIdx.y of the group kernel's list (none past its count) by
// column tile blockIdx.x: rows in expert order, A gathered (x by token).
template <int WM, int WN, int MI, int NI, int STAGES, bool GATED>
__device__ __forceinline__ void grouped_tile(const kiln_elt *__restrict__ src, const kiln_elt *__restrict__ w,
                                             kiln_elt *__restrict__ dst, const kiln_u32 *__restrict__ n_tiles,
                                             const kiln_u32 *__restrict__ offsets,
                                             const kiln_u32 *__restrict__ tile_e,
                                             const kiln_u32 *__restrict__ tile_r,
                                             const kiln_u32 *__restrict__ sorted, unsigned char *smem_raw)
{
    constexpr kiln_u32 BM = WM * MI * 16, BOUT = WN * NI * 8;
    const kiln_u32 tile = blockIdx.y;
    if (tile >= *n_tiles)
        return;
    const kiln_u32 e = tile_e[tile], r0 = tile_r[tile], end = offsets[e + 1];
    const kiln_u32 nrows = end - r0 < BM ? end - r0 : BM;
    tile_product<WM, WN, MI, NI, STAGES, GATED>(
        src, w, dst, e, nrows, blockIdx.x * BOUT,
        [&](kiln_u32 r) { return GATED ? (kiln_u64)(sorted[r0 + r] / K) : (kiln_u64)(r0 + r); },
        [&](kiln_u32 r) { return (kiln_u64)(r0 + r); }, smem_raw);
}

#define GEMM_PASS src, w, dst, n_tiles, offsets, tile_e, tile_r, sorted, smem
extern __shared__ __align__(128) unsigned char smem[];

// Small tiles: 16 rows, 4 warps across the columns, 6 stages in flight (the
// weight stream is the cost). Large: 64 rows, 2 x 2 warps of 32 x 64
// columns. The provider's tile constants (providers/moe_experts.c) follow.
extern "C" __global__ void __launch_bounds__(128) kiln_moe_gate_up_s(KILN_MOE_GEMM_ARGS)
{
    kiln_grid_dependency_sync();
    grouped_tile<1, 4, 1, 1, 6, true>(GEMM_PASS);
}

extern "C" __global__ void __launch_bounds__(128) kiln_moe_down_s(KILN_MOE_GEMM_ARGS)
{
    kiln_grid_dependency_sync();
    grouped_tile<1, 4, 1, 2, 6, false>(GEMM_PASS);
}

extern "C" __global__ void __launch_bounds__(128) kiln_moe_gate_up_l(KILN_MOE_GEMM_ARGS)
{
    kiln_grid_dependency_sync();
    grouped_tile<2, 2, 2, 4, 3, true>(GEMM_PASS);
}

extern "C" __global__ void __launch_bounds__(128) kiln_moe_down_l(KILN_MOE_GEMM_ARGS)
{
    kiln_grid_dependency_sync();
    grouped_tile<2, 2, 2, 8, 3, false>(GEMM_PASS);
}

// out[t] = elt(sum_s weights[t, s] y[inv[t, s]] + c shared[t]), c =
// sigmoid(x[t] . shared_gate) with a gate, else 1. A block a token, 8
// elements a thread per item.
#define VECS (H / 8)
#define ITEMS ((VECS + COMBINE_THREADS - 1) / COMBINE_THREADS)

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
kiln_moe_combine(const kiln_elt *__restrict__ y, const kiln_u32 *__restrict__ inv, const float *__restrict__ weights,
                 const kiln_elt *__restrict__ x, const kiln_elt *__restrict__ shared,
                 const kiln_elt *__restrict__ shared_gate, kiln_elt *__restrict__ out)
{
    kiln_grid_dependency_sync();
    __shared__ float scratch[COMBINE_THREADS / 32];
    const kiln_u64 t = blockIdx.x;
    float c = 1.0f;
    if (shared_gate) {
        float dot = 0.0f;
        for (int i = 0; i < ITEMS; i++) {
            const int v = threadIdx.x + i * COMBINE_THREADS;
            if (v < VECS) {
                float a[8], b[8];
                kiln_e8_to_f32(kiln_ldg16(x + t * H + v * 8), a);
                kiln_e8_to_f32(kiln_ldg16(shared_gate + v * 8), b);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    dot += a[j] * b[j];
            }
        }
        dot = kiln_block_sum<COMBINE_THREADS / 32>(dot, scratch);
        c = 1.0f / (1.0f + __expf(-dot));
    }
    kiln_u32 pos[K];
    float wt[K];
#pragma unroll
    for (int s = 0; s < K; s++) {
        pos[s] = inv[t * K + s];
        wt[s] = weights[t * K + s];
    }
    for (int i = 0; i < ITEMS; i++) {
        const int v = threadIdx.x + i * COMBINE_THREADS;
        if (v >= VECS)
            break;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int s = 0; s < K; s++) {
            if (pos[s] == NO_ROW)
                continue;
            float f[8];
            kiln_e8_to_f32(kiln_ldg16(y + (kiln_u64)pos[s] * H + v * 8), f);
#pragma unroll
            for (int j = 0; j < 8; j++)
                acc[j] += wt[s] * f[j];
        }
        if (shared) {
            float f[8];
            kiln_e8_to_f32(kiln_ldg16(shared + t * H + v * 8), f);
#pragma unroll
            for (int j = 0; j < 8; j++)
                acc[j] += c * f[j];
        }
        kiln_stg16(out + t * H + v * 8, kiln_f32_to_e8(acc));
    }
}
