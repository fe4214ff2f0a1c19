// Dense linear for a few tokens (1 to 8, a decode step's batch):
//   out[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n])
// or, with KILN_GLU, the gated form of a SwiGLU MLP over a weight of 2 n_out
// rows (gate rows first, then up rows, as HF's gate_proj and up_proj):
//   out[t, n] = silu(g) * u, g = sum_k x[t, k] w[n, k], u = sum_k x[t, k] w[n_out + n, k]
// with g and u in f32 (no rounding between the product and silu).
// kiln_elt in (f16, or bf16 with KILN_BF16), products and sums in f32 on the
// tensor cores (mma.sync m16n8k16), the bias added in f32, one rounding to
// kiln_elt. At so few tokens the weight is
// the whole cost: each byte of it is read once, streamed through 16-byte loads
// with several in flight per thread. (No L2 warm-up before the dependency
// sync: providers/skinny_linear.c says why.)
//
// Block b takes output rows [16 RG b, 16 RG (b + 1)) (GLU: outputs [8 RG b,
// 8 RG (b + 1)), each 16-row group holding 8 gate rows then their 8 up rows,
// so that each lane's accumulators hold a gate and its up: the epilogue needs
// no exchange); its WARPS warps split K in equal
// slices and their partial sums are added in a fixed order (deterministic).
// The order of a dot product's terms does not matter to the tensor core's
// result beyond rounding, so each lane feeds the mma fragments from one
// contiguous 16-byte piece of a weight row and the same piece of x: lane
// (g = lane / 4, q = lane % 4) loads elements [8q, 8q + 8) of a 32-wide K step
// for rows g and g + 8 (the A operand) and for token g of each 8-token tile
// (the B operand, tokens past the count read as 0); elements 0-3 make one mma's k slots {2q, 2q+1, 2q+8, 2q+9},
// elements 4-7 the next one's, the same slots for A and B.
// Constants: KILN_IN (K, a multiple of 32 * KILN_WARPS), KILN_WARPS,
// KILN_UNROLL (32-wide K steps per load stage), KILN_ROW_GROUPS (RG),
// KILN_MIN_BLOCKS (resident blocks per SM asked of
// the compiler, 0: none), KILN_GLU (1: the gated form, bias not read),
// KILN_BF16 (kiln_prelude.cuh: the element type).
// Arguments: x [tokens, K], w [n_out, K] (GLU: [2 n_out, K]), bias [n_out] or
// 0, out [tokens, n_out]; x, w 16-byte aligned; tokens in [1, 8]; grid = ceil(n_out / ROWS).
#include "kiln_prelude.cuh"

//! kiln:entry kiln_skinny_linear

#define K KILN_IN
#define WARPS KILN_WARPS
#define UNROLL KILN_UNROLL // K steps whose weight loads are in flight together
#define RG KILN_ROW_GROUPS // 16-row groups per warp
#define THREADS (WARPS * 32)
#define GLU KILN_GLU
#define ROWS ((GLU ? 8 : 16) * RG) // outputs per block
#define KW (K / WARPS)    // K per warp
#define STEPS (KW / 32)   // 32-wide K steps per warp
#if KILN_MIN_BLOCKS > 0
#define BOUNDS __launch_bounds__(THREADS, KILN_MIN_BLOCKS)
#else
#define BOUNDS __launch_bounds__(THREADS)
#endif

#if GLU != 0 && GLU != 1
#error "KILN_GLU must be 0 or 1"
#endif
#if K % (32 * WARPS) != 0
#error "KILN_IN must be a multiple of 32 * KILN_WARPS"
#endif

// Streaming load of the weight: read once, kept out of L1.
__device__ __forceinline__ kiln_u32x4 ld_stream(const kiln_elt *p)
{
    kiln_u32x4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void mma(float *c, kiln_u32 a0, kiln_u32 a1, kiln_u32 a2, kiln_u32 a3, kiln_u32 b0,
                                    kiln_u32 b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." KILN_ELT_PTX "." KILN_ELT_PTX
                 ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct stage {
    kiln_u32x4 a[RG][2][UNROLL]; // [row group][rows g, g + 8][step]
};

__device__ __forceinline__ void load_stage(stage *st, const kiln_elt *const *wr, kiln_u32 s)
{
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
        if (STEPS % UNROLL == 0 || s + u < STEPS) {
#pragma unroll
            for (int r = 0; r < RG; r++) {
                st->a[r][0][u] = ld_stream(wr[2 * r] + (s + u) * 32);
                st->a[r][1][u] = ld_stream(wr[2 * r + 1] + (s + u) * 32);
            }
        }
}

// The weight row behind row i (0..15) of 16-row group r of the block whose
// first output is n0; outputs past n_out (the last block) read the last
// output's row, their sums dropped.
__device__ __forceinline__ kiln_u64 weight_row(kiln_u32 n0, kiln_u32 r, kiln_u32 i, kiln_u32 n_out)
{
#if GLU
    const kiln_u32 o = n0 + 8 * r + i % 8;
    return (o < n_out ? o : n_out - 1) + (i >= 8 ? (kiln_u64)n_out : 0);
#else
    const kiln_u32 o = n0 + 16 * r + i;
    return o < n_out ? o : n_out - 1;
#endif
}

extern "C" __global__ void BOUNDS
kiln_skinny_linear(const kiln_elt *__restrict__ x, const kiln_elt *__restrict__ w, const kiln_elt *__restrict__ bias,
                   kiln_elt *__restrict__ out, kiln_u32 n_out, kiln_u32 tokens)
{
    kiln_grid_dependency_sync(); // first: kiln_prelude.cuh
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); // no mma.sync m16n8k16: providers/skinny_linear.c takes cuBLASLt before sm_80
#else
    __shared__ float red[WARPS][RG][4][32];
    const kiln_u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const kiln_u32 n0 = blockIdx.x * ROWS;
    const kiln_u64 k0 = (kiln_u64)warp * KW + 8 * q;
    const kiln_elt *wr[2 * RG];
#pragma unroll
    for (int r = 0; r < 2 * RG; r++)
        wr[r] = w + weight_row(n0, r / 2, g + 8 * (r % 2), n_out) * K + k0;
    const bool has_token = g < tokens;
    const kiln_elt *xs = x + (kiln_u64)(has_token ? g : 0) * K + k0;

    float acc[RG][4];
#pragma unroll
    for (int r = 0; r < RG; r++)
        acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.0f;

    // Two stages: the next steps' weight loads are in flight while these are multiplied.
    stage cur, nxt;
    load_stage(&cur, wr, 0);
#pragma unroll 1
    for (kiln_u32 s = 0; s < STEPS; s += UNROLL) {
        if (s + UNROLL < STEPS)
            load_stage(&nxt, wr, s + UNROLL);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (STEPS % UNROLL != 0 && s + u >= STEPS)
                break;
            kiln_u32x4 b = {0u, 0u, 0u, 0u};
            if (has_token)
                b = kiln_ldg16(xs + (s + u) * 32);
#pragma unroll
            for (int r = 0; r < RG; r++) {
                const kiln_u32x4 a0 = cur.a[r][0][u], a1 = cur.a[r][1][u];
                mma(acc[r], a0.x, a1.x, a0.y, a1.y, b.x, b.y);
                mma(acc[r], a0.z, a1.z, a0.w, a1.w, b.z, b.w);
            }
        }
        cur = nxt; // past the last stage nxt holds nothing, and cur is not read again
    }

    // acc[r][i]: row g (i < 2) or g + 8 (i >= 2) of group r, token 2q + (i & 1).
#pragma unroll
    for (int r = 0; r < RG; r++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            red[warp][r][i][lane] = acc[r][i];
    __syncthreads();
#if GLU
    // Output n0 + 8r + l / 4, token 2 (l % 4) + i: gate at slot i, up at i + 2.
    for (kiln_u32 e = threadIdx.x; e < RG * 64; e += THREADS) {
        const kiln_u32 r = e / 64, i = (e / 32) % 2, l = e % 32;
        const kiln_u32 col = n0 + 8 * r + l / 4, tok = 2 * (l % 4) + i;
        if (col >= n_out || tok >= tokens)
            continue;
        float gate = 0.0f, up = 0.0f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) {
            gate += red[v][r][i][l];
            up += red[v][r][i + 2][l];
        }
        // silu(g) = g / (1 + exp(-g)); ex2.approx gives +inf for large
        // arguments, where g / inf = -0 is silu's limit.
        float e2;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e2) : "f"(-gate * 1.4426950408889634f));
        out[(kiln_u64)tok * n_out + col] = kiln_f32_to_elt(gate / (1.0f + e2) * up);
    }
#else
    for (kiln_u32 e = threadIdx.x; e < RG * 128; e += THREADS) {
        const kiln_u32 r = e / 128, i = (e / 32) % 4, l = e % 32;
        const kiln_u32 row = n0 + 16 * r + l / 4 + (i >= 2 ? 8 : 0), tok = 2 * (l % 4) + (i & 1);
        if (row >= n_out || tok >= tokens)
            continue;
        float sum = 0.0f;
#pragma unroll
        for (int v = 0; v < WARPS; v++)
            sum += red[v][r][i][l];
        if (bias)
            sum += kiln_elt_to_f32(bias[row]);
        out[(kiln_u64)tok * n_out + row] = kiln_f32_to_elt(sum);
    }
#endif
#endif
}
