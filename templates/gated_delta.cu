// Gated delta rule (the linear-attention layer of Qwen3-Next), a sequential
// scan over each sequence's span of tokens. For sequence s with span
// (start, count) = spans[s], value head h and its key head kh = h / (VH / KH),
// for t = start .. start + count - 1:
//   k̂ = k[t, kh] / sqrt(|k[t, kh]|^2 + 1e-6)                  (L2 norm, as Qwen3-Next)
//   q̂ = q[t, kh] / sqrt(|q[t, kh]|^2 + 1e-6) / sqrt(DK)       (and its scale)
//   a = exp(g[t, h]), b = beta[t, h]
//   S = a S;  S += b (v[t, h] - S k̂) k̂ᵀ;  out[t, h] = S q̂
// with S = state[s, h], f32 [DV, DK] (row i: value component i; rows are
// contiguous along the key dimension), updated in place.
//
// Row i of S evolves on its own: its next value needs only k̂, q̂, a, b and
// v[t, h, i]. So a group of KILN_G lanes keeps one row in registers for the
// whole span (lane l holds the vectors at columns VEC * (l + m * G), m < CH),
// reads the token's k and q itself (the other groups read the same bytes,
// from L1) and reduces its five dot products (k·k, q·q, k·q, S·k, S·q) over
// its G lanes with shuffles: no shared memory and no barrier. With
//   u = a (S k) / |k|,  d = b (v - u),
// the output is a (S q̂) + d (k̂·q̂) and the update S = a S + d k̂ᵀ.
//
// A span that ends past `tokens` is never read: the sequence's state and
// outputs are left alone and the fault record names the lowest such sequence
// (KILN_FAULT_GATED_DELTA_SPAN: value start + count saturated to 2^32 - 1,
// limit tokens). An empty span leaves the state alone.
//
// Constants: KILN_BF16 (q, k, v and out in bf16 rather than f16; the state,
// g and beta are f32 either way), KILN_DK, KILN_DV (head dims), KILN_KH, KILN_VH (key and value
// heads, KH dividing VH), KILN_G (lanes per row: 1..32, a power of two),
// KILN_VEC (4: 8-byte k/q and 16-byte state vectors, needs DK % 4 == 0 and
// aligned bindings; 1: scalar), KILN_THREADS. One block per (sequence, value
// head, THREADS / G rows); tokens and the number of sequences are launch
// arguments, so one kernel serves every batch (decode: spans of one token;
// prefill: long spans).
#include "kiln_prelude.cuh"

//! kiln:entry kiln_gated_delta

#define KILN_FAULT_GATED_DELTA_SPAN 8u

#if KILN_VH % KILN_KH != 0
#error "KILN_KH must divide KILN_VH"
#endif
#if KILN_G < 1 || KILN_G > 32 || (KILN_G & (KILN_G - 1)) != 0
#error "KILN_G must be a power of two, 1..32"
#endif
#if KILN_THREADS % 32 != 0 || KILN_THREADS > 1024
#error "KILN_THREADS must be a multiple of 32, at most 1024"
#endif
#if KILN_VEC != 1 && KILN_VEC != 4
#error "KILN_VEC must be 4 or 1"
#endif
#if KILN_DK % KILN_VEC != 0
#error "KILN_VEC must divide KILN_DK"
#endif

#define GROUP (KILN_VH / KILN_KH)
#define CH ((KILN_DK + KILN_VEC * KILN_G - 1) / (KILN_VEC * KILN_G)) // vectors per lane
#define FULL (CH * KILN_VEC * KILN_G == KILN_DK)
#define ROWS (KILN_THREADS / KILN_G)                                  // rows per block
#define ROW_BLOCKS ((KILN_DV + ROWS - 1) / ROWS)
#define QK_EPS 1e-6f

// One token's inputs for one lane: its columns of k and q (raw, in the
// element type), and the row's v, g and beta.
struct token_in {
    kiln_elt k[CH][KILN_VEC], q[CH][KILN_VEC], v;
    float g, beta;
};

__device__ __forceinline__ float shfl_xor(float v, int m)
{
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(m));
    return r;
}

__device__ __forceinline__ float ld_f32(const float *p)
{
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ kiln_elt ld_elt(const kiln_elt *p)
{
    kiln_elt v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// The lane's columns of one head row of k or q ([DK] elements); columns past DK are 0.
__device__ __forceinline__ void load_cols(const kiln_elt *row, int lane, kiln_elt (&dst)[CH][KILN_VEC])
{
#pragma unroll
    for (int m = 0; m < CH; m++) {
        const int c = KILN_VEC * (lane + m * KILN_G);
        if (FULL || c < KILN_DK) {
#if KILN_VEC == 4
            kiln_u32 lo, hi;
            asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(lo), "=r"(hi) : "l"(row + c));
            dst[m][0] = (kiln_elt)(lo & 0xffffu);
            dst[m][1] = (kiln_elt)(lo >> 16);
            dst[m][2] = (kiln_elt)(hi & 0xffffu);
            dst[m][3] = (kiln_elt)(hi >> 16);
#else
            dst[m][0] = ld_elt(row + c);
#endif
        } else {
#pragma unroll
            for (int e = 0; e < KILN_VEC; e++)
                dst[m][e] = 0;
        }
    }
}

__device__ __forceinline__ void load_token(token_in &in, const kiln_elt *q, const kiln_elt *k, const kiln_elt *v,
                                           const float *g, const float *beta, kiln_u64 t, kiln_u32 h, kiln_u32 kh,
                                           int row, int lane)
{
    const kiln_u64 qk_row = (t * KILN_KH + kh) * KILN_DK, vh = t * KILN_VH + h;
    load_cols(k + qk_row, lane, in.k);
    load_cols(q + qk_row, lane, in.q);
    in.v = ld_elt(v + vh * KILN_DV + row);
    in.g = ld_f32(g + vh);
    in.beta = ld_f32(beta + vh);
}

__device__ __forceinline__ float rsqrt_approx(float x)
{
    float r;
    asm("rsqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float exp_approx(float x)
{
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
    return r;
}

extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_gated_delta(const kiln_elt *__restrict__ q, const kiln_elt *__restrict__ k, const kiln_elt *__restrict__ v,
                 const float *__restrict__ g, const float *__restrict__ beta, float *__restrict__ state,
                 const kiln_u32 *__restrict__ spans, kiln_elt *__restrict__ out, kiln_u32 tokens, kiln_fault *fault)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    const kiln_u32 rb = blockIdx.x % ROW_BLOCKS, sh = blockIdx.x / ROW_BLOCKS; // sh = seq * VH + h
    const kiln_u32 h = sh % KILN_VH, seq = sh / KILN_VH, kh = h / GROUP;
    const int lane = threadIdx.x % KILN_G;
    const int row_wanted = rb * ROWS + threadIdx.x / KILN_G;
    // Groups past the last row run along on a real row (the shuffles need the
    // whole warp) but store nothing.
    const bool live = row_wanted < KILN_DV;
    const int row = live ? row_wanted : KILN_DV - 1;
    const kiln_u32 start = spans[2 * seq], count = spans[2 * seq + 1];
    const kiln_u64 end = (kiln_u64)start + count;
    if (end > tokens) {
        if (h == 0 && rb == 0 && threadIdx.x == 0)
            kiln_report_fault(fault, KILN_FAULT_GATED_DELTA_SPAN, seq,
                              end > 0xffffffffull ? 0xffffffffu : (kiln_u32)end, tokens);
        return;
    }
    if (count == 0)
        return;

    float *srow = state + ((kiln_u64)sh * KILN_DV + row) * KILN_DK;
    float s[CH][KILN_VEC];
#pragma unroll
    for (int m = 0; m < CH; m++) {
        const int c = KILN_VEC * (lane + m * KILN_G);
        if (FULL || c < KILN_DK) {
#if KILN_VEC == 4
            asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(s[m][0]), "=f"(s[m][1]), "=f"(s[m][2]), "=f"(s[m][3])
                         : "l"(srow + c));
#else
            s[m][0] = srow[c];
#endif
        } else {
#pragma unroll
            for (int e = 0; e < KILN_VEC; e++)
                s[m][e] = 0.0f;
        }
    }

    const float scale = rsqrt_approx((float)KILN_DK);
    token_in cur, nxt;
    load_token(cur, q, k, v, g, beta, start, h, kh, row, lane);
#pragma unroll 1
    for (kiln_u32 i = 0; i < count; i++) {
        const kiln_u64 t = (kiln_u64)start + i;
        // The next token's loads go out before this token's arithmetic.
        if (i + 1 < count)
            load_token(nxt, q, k, v, g, beta, t + 1, h, kh, row, lane);
        float kf[CH][KILN_VEC], qf[CH][KILN_VEC];
        float kk = 0.0f, qq = 0.0f, kq = 0.0f, sk = 0.0f, sq = 0.0f;
#pragma unroll
        for (int m = 0; m < CH; m++)
#pragma unroll
            for (int e = 0; e < KILN_VEC; e++) {
                kf[m][e] = kiln_elt_to_f32(cur.k[m][e]);
                qf[m][e] = kiln_elt_to_f32(cur.q[m][e]);
                kk += kf[m][e] * kf[m][e];
                qq += qf[m][e] * qf[m][e];
                kq += kf[m][e] * qf[m][e];
                sk += s[m][e] * kf[m][e];
                sq += s[m][e] * qf[m][e];
            }
#pragma unroll
        for (int w = KILN_G / 2; w; w >>= 1) {
            kk += shfl_xor(kk, w);
            qq += shfl_xor(qq, w);
            kq += shfl_xor(kq, w);
            sk += shfl_xor(sk, w);
            sq += shfl_xor(sq, w);
        }
        const float rk = rsqrt_approx(kk + QK_EPS), rq = rsqrt_approx(qq + QK_EPS) * scale;
        const float a = exp_approx(cur.g);
        const float d = cur.beta * (kiln_elt_to_f32(cur.v) - a * sk * rk);
        const float o = a * sq * rq + d * kq * rk * rq;
        const float dk = d * rk;
#pragma unroll
        for (int m = 0; m < CH; m++)
#pragma unroll
            for (int e = 0; e < KILN_VEC; e++)
                s[m][e] = a * s[m][e] + dk * kf[m][e];
        if (live && lane == 0)
            out[(t * KILN_VH + h) * KILN_DV + row] = kiln_f32_to_elt(o);
        if (i + 1 < count)
            cur = nxt;
    }

    if (!live)
        return;
#pragma unroll
    for (int m = 0; m < CH; m++) {
        const int c = KILN_VEC * (lane + m * KILN_G);
        if (FULL || c < KILN_DK) {
#if KILN_VEC == 4
            asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(srow + c), "f"(s[m][0]), "f"(s[m][1]),
                         "f"(s[m][2]), "f"(s[m][3])
                         : "memory");
#else
            srow[c] = s[m][0];
#endif
        }
    }
}
