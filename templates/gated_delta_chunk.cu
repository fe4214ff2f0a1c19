// Gated delta rule, the chunked form for prefill (the recurrence of
// templates/gated_delta.cu, whose header states it; the scan there serves
// decode). Within a chunk of C = 64 tokens of a span, with γ_i the inclusive
// sum of g over the chunk's tokens up to i, k̂ and q̂ normalized as the
// contract says, S the state at the chunk's start and b = beta:
//   A_ij = b_i e^(γ_i − γ_j) k̂_i·k̂_j  (j < i),  T = (I + A)^-1   (the UT form)
//   R_i  = b_i (v_i − e^γ_i S k̂_i)                 (values less the state's part)
//   U    = T R                                      (the corrected values)
//   out_i = e^γ_i S q̂_i + Σ_{j<=i} e^(γ_i − γ_j) (q̂_i·k̂_j) U_j
//   S    ← e^γ_L S + Σ_j e^(γ_L − γ_j) U_j k̂_jᵀ     (L the chunk's last token)
// which is the sequential recurrence exactly (U_i is its b_i (v_i − a_i S_{i−1} k̂_i)).
// R folds fla's W = T (b e^γ k̂) into one product: U = T R needs no W.
//
// One block per (sequence, value head, ROWS rows of the state), 8 warps,
// looping over the span's chunks in order; the block's rows of S stay in
// registers (mma accumulators, f32) for the whole span, so a span of any
// length is one launch. Every exponent is a
// difference γ_i − γ_j with i >= j (or γ_i alone), never positive for a
// decay, and masked entries are selected away, never multiplied: strong
// gates underflow to 0 and weak ones keep f32 accuracy.
//
// Products run on mma.sync m16n8k16 (f16 in, f32 accumulate). k and q enter
// raw (exact f16; bf16 as below); their norms scale the f32 results. f32
// operands (S, T, R, U, the scores P) enter as one f16 term hi = f16(x)
// (TERMS 1, the default, as fla's kernels take their input type), or
// (TERMS 2) as two f16 terms hi = f16(x),
// lo = f16(x − hi), about 22 bits: S k and S q take hi and lo against exact k and q, T R and
// P U take hi·hi + hi·lo + lo·hi. A split's absolute error is about 2^-25
// (f16's subnormal step), so the operands whose small rows or columns would
// reach it enter scaled by a power of two that puts each row's (or
// column's) maximum in [2^13, 2^14), and the products are unscaled by the
// same exact factor: the rows of S, the columns of R, the rows of P and the
// columns of U' (one for each row of S). A state row, an output row and
// every value in them then keep about 22 bits however small they are. T
// (unit diagonal) and U in P U (its output rows are as large as v's) are not
// scaled.
// bf16 inputs (KILN_BF16) take the same f16 products: each row of k and q,
// once loaded, is scaled by a power of two putting its maximum in [2^13,
// 2^14) and rewritten in shared memory as f16, exactly (bf16's 8 bits fit
// f16's 11 at every exponent from 2^-17 up, so what is lost is below 2^-30
// of the row's maximum), and its norm's factor absorbs the scale, since only
// k̂ and q̂ enter the recurrence. So bf16 rows outside f16's range lose
// nothing, and the f32 operands keep their f16 hi + lo split, whose 22 bits
// a bf16 split would need three terms (and half again the products) to match.
// T is found in f32: the four 16 x 16 diagonal blocks by forward
// substitution on the CUDA cores (a lane a column), then the blocks below
// them by distance (T_ij = −T_ii Σ_k A_ik T_kj, products in hi and lo terms).
//
// Per chunk: the next chunk's k, q, v, g, beta load (cp.async, two stages)
// while this one computes; norms and γ; K Kᵀ and K Sᵀ (warps 0-3) beside
// Q Kᵀ and Q Sᵀ (warps 4-7); T; U = T R; out (warps 4-7, their scores kept
// in registers) and the state's update (all warps).
//
// The keyed form. Of a chunk's steps, the norms rk and rq, γ, T and the
// scores P depend on its k, q, g and beta alone, not on the state: the
// single kernel (kiln_gated_delta_chunk) finds them on every block of a head
// alike, on the chain of each chunk. kiln_gated_delta_keys, a pre-pass with
// a block per (record, value head), finds them by the same functions into a
// workspace; kiln_gated_delta_chunk_keyed is the loop above without those
// steps: the next chunk's γ and norms load with its k, q, v and beta (two
// stages), and the chunk's own T and P at its start into the space of A and
// T, read at U = T R and at out, after the products with the state, which
// hide the copy. Its outputs and state are the single kernel's, bit for bit.
// In bf16 the keyed kernel still rescales each raw k and q row and rewrites
// it as f16 (the row's maximum, no norm), the same bits as the norms'
// step: one pass over rows it loads anyway. The rows kernel instead reads
// them as the pre-pass's norms rewrote them, from its split records (32 KiB
// more a record, REC_KQ): done in the rows kernel, by warps of its own, the
// rewrite slowed its chain (bench_recurrent --dtype bf16).
// Workspace (floats; ceil(T / C) + S records a value head, the capacity the
// keyed kernels take): record (r, h) at (r VH + h) REC_STRIDE; sequence s's
// chunk c is record base(s) + c, base(s) the chunks of the spans before s
// in sequence order (spans past the tokens have none). Spans may lie in any
// order, so the records follow the sequences, not the tokens; each block
// sums base from spans itself. Spans that share no tokens have at most
// ceil(T / C) + S chunks (each span at most one partial); a sequence whose
// records would pass the capacity (spans sharing tokens) is left alone. A
// record: γ's two floats [C] each, rk [C], rq [C], then T's 10 blocks of
// 16 x 16 on and below the diagonal, then P's, block (i, j) (j <= i) the
// (i (i + 1) / 2 + j)-th, each in the mma fragment order: lane 4 g + t holds
// 8 floats at 8 (4 g + t), float 2 e + b element (16 i + g + 8 (e & 1),
// 16 j + 8 (e >> 1) + 2 t + b), as afrag_f32 reads an A operand and as the
// accumulators of n-tiles 2 j, 2 j + 1 hold it; then 3 C floats that only a
// split record fills. A split record (the pre-pass's argument split, for the
// rows kernel) holds each lane's 8 words of a block as the A fragment's four
// hi and four lo f16x2 terms (split2, in store_frag's order and places)
// rather than the floats: T's as they are, P's with each row i scaled by
// psc_i, the power of two putting the row's largest |P_ij| into [2^13,
// 2^14) (as the keyed kernel scales P's rows for its out), and psc [C],
// then its inverse [C], after P's blocks, and the chunk's beta [C] (so
// that the rows kernel reads no input of the op but q, k and v); in bf16
// then the chunk's k and q rows as f16 (REC_KQ; the rows kernel reads them
// in place of q and k).
// A record is written by the pre-pass of the same command before the keyed
// kernel (or the rows kernel) reads it. After the (ceil(T / C) + S) VH
// records, a word each: the streamed form's flags (record (r, h)'s at r VH +
// h), cleared and set by the pre-pass, polled by the rows kernel.
//
// A span that ends past `tokens` is never read: the sequence's state and
// outputs are left alone and the fault record names the lowest such sequence
// (KILN_FAULT_GATED_DELTA_SPAN), as the scan does. An empty span leaves the
// state alone. Tokens past a span's end within its last chunk load as zeros
// with beta 0 and g 0: they add nothing and are not stored.
//
// Constants: KILN_BF16 (q, k, v and out in bf16 rather than f16; state, g
// and beta are f32 either way), KILN_DK (1..128), KILN_DV, KILN_KH, KILN_VH
// (KH dividing VH), KILN_ROWS (32 or 64: rows of the state a block),
// KILN_VEC (8: 16-byte loads of k, q, v with DK and DV multiples of 8,
// 16-byte aligned k, q, v and 8-byte aligned state; 1: scalar). 256 threads
// (the rows kernel: 2 KILN_ROWS, + 32 streamed) and dynamic shared memory
// sizeof(chunk_smem) for both chunked kernels (sizeof(rows_smem) for the rows kernel),
// sizeof(keys_smem) for the pre-pass, which the provider computes by the
// same layouts (a chunked or rows launch with less, or with other threads,
// reports KILN_FAULT_GATED_DELTA_SMEM or _THREADS and touches nothing; a
// pre-pass with less writes nothing). Grids: the chunked kernels S VH ROW_BLOCKS blocks, the
// pre-pass (ceil(T / C) + S) x VH. Needs sm_80 (mma.sync, cp.async).
#include "kiln_reduce.cuh" // kiln_shfl_xor_f32, kiln_f32_bits, kiln_e8_to_f32, kiln_stg16

//! kiln:entry kiln_gated_delta_chunk
//! kiln:entry kiln_gated_delta_keys
//! kiln:entry kiln_gated_delta_chunk_keyed
//! kiln:entry kiln_gated_delta_rows

#define KILN_FAULT_GATED_DELTA_SPAN 8u
#define KILN_FAULT_GATED_DELTA_THREADS 9u // value: blockDim.x, limit: the threads the kernel was built for
#define KILN_FAULT_GATED_DELTA_SMEM 10u   // value: the dynamic shared memory, limit: the bytes it needs

#if KILN_VH % KILN_KH != 0
#error "KILN_KH must divide KILN_VH"
#endif
#if KILN_DK < 1 || KILN_DK > 128
#error "KILN_DK must be 1..128"
#endif
#if KILN_ROWS != 32 && KILN_ROWS != 64
#error "KILN_ROWS must be 32 or 64"
#endif
#if KILN_VEC != 1 && KILN_VEC != 8
#error "KILN_VEC must be 8 or 1"
#endif
#ifndef KILN_TERMS
#define KILN_TERMS 1
#endif
#if KILN_TERMS != 1 && KILN_TERMS != 2
#error "KILN_TERMS must be 1 or 2"
#endif
// Whether the chain's products take their f32 operands' lo terms (TERMS 2;
// the default, 1, takes hi alone).
#define LO (KILN_TERMS == 2)
#if KILN_VEC == 8 && (KILN_DK % 8 != 0 || KILN_DV % 8 != 0)
#error "KILN_VEC 8 needs DK and DV multiples of 8"
#endif

#define C 64                        // tokens a chunk
#define THREADS 256
#define GROUP (KILN_VH / KILN_KH)
#define DKP ((KILN_DK + 15) / 16 * 16) // the key dim padded with zeros to whole k-steps
#define LDK (DKP + 8)               // halves a row of k, q and the state's terms (+8: no ldmatrix conflicts)
#define LDV (KILN_ROWS + 8)         // halves a row of v, U and U'
#define LDF (C + 4)                 // floats a row of A and T
#define LDR (KILN_ROWS + 4)         // floats a row of R
#define ROW_BLOCKS ((KILN_DV + KILN_ROWS - 1) / KILN_ROWS)
#define NTV (KILN_ROWS / 8)         // n-tiles across a block's rows (X, Y, R, U, out)
#define WM (KILN_ROWS / 16)         // m-blocks of the state
#define WPM (8 / WM)                // warps per m-block of the state
#define NPK (DKP / 16)              // pairs of n-tiles across the key dim
#define NPW ((NPK + WPM - 1) / WPM) // of them a warp
#define NPK_OK(p) (NPK % WPM == 0 || (p) < NPK) // a warp's pair p = wr + i WPM is within the key dim
#define QK_EPS 1e-6f
#define BLK 256                       // floats of a 16 x 16 block of T or P
#define REC_T (4 * C)                 // a record's floats before T's blocks
#define REC_P (REC_T + 10 * BLK)      // and before P's
#define REC_S (REC_P + 10 * BLK)      // and before P's row scales (split records)
#define REC_B (REC_S + 2 * C)         // and before beta (split records)
#define REC_FLOATS (REC_S + 3 * C)    // a record: 5568 floats, 22272 bytes
// bf16: a record then holds the chunk's k and q rows as the norms' step
// rewrote them in f16, [2][C][DKP] halves (room for DK 128), which the rows
// kernel reads rather than rewriting them itself; the records' stride.
#if KILN_BF16
#define REC_KQ REC_FLOATS
#define REC_STRIDE (REC_FLOATS + C * 128) // 13760 floats, 55040 bytes
#else
#define REC_STRIDE REC_FLOATS
#endif

struct chunk_at {
    float a[C][LDF]; // A, strictly lower (block rows' lower blocks only)
    float t[C][LDF]; // T, lower block-triangular
};
struct chunk_u {
    kiln_f16 hi[C][LDV], lo[C][LDV];   // U
    kiln_f16 phi[C][LDV], plo[C][LDV]; // U' = e^(γ_L − γ_j) rk_j U_j
};
// What the pre-pass writes first in a record, and a stage of the keyed kernel's.
struct chunk_keys {
    float gam[C], gaml[C], rk[C], rq[C]; // γ as two floats: gam + gaml
};
struct chunk_smem {
    // Raw inputs, two stages: k and q in the element type as loaded, f16 (of
    // the scaled rows, for bf16) once their norms are taken; v as loaded.
    kiln_f16 k[2][C][LDK], q[2][C][LDK];
    kiln_elt v[2][C][LDV];
    float g[2][C], beta[2][C];
    kiln_f16 shi[KILN_ROWS][LDK], slo[KILN_ROWS][LDK]; // the state's rows at the chunk's start
    float rf[C][LDR];                                  // R
    union {
        chunk_at at; // A and T live until U is computed (keyed: T's and P's blocks as a record holds them)
        chunk_u u;   // then U and U' take their place
    } x;
    float m[3][16][16]; // T's partial sums, a warp's each
    chunk_keys kv[2];   // two stages: the keyed kernel loads the next chunk's
    float ucmax[4][KILN_ROWS];             // max |U'| of a column over 16 tokens
    float usc[KILN_ROWS], usci[KILN_ROWS]; // a column's power-of-two scale of U', and its inverse
    float rcmax[4][KILN_ROWS];             // max |R| of a column over 16 tokens
    float srmax[4][KILN_ROWS];             // max |S| of a row over a warp's columns
    float srinv[KILN_ROWS];                // the inverse of a row's scale of S
    kiln_u32 red[16];                      // the block's sums of records
};
// The keyed kernel's T and P blocks in sm.x: T's at its start (U's hi and lo
// take their place), P's at P_AT floats, where U' goes (read before it does).
#define P_AT (C * LDV) // floats of U's hi and lo (2 C LDV halves)
static_assert(P_AT * 4 >= 10 * BLK * 4 && (P_AT + 10 * BLK) * 4 <= sizeof(chunk_at), "T's and P's blocks fit in sm.x");
// The pre-pass's: one stage of the inputs, A and T, T's sums and one stage of
// the keys (members named as chunk_smem's, for the functions both use).
struct keys_smem {
    kiln_f16 k[1][C][LDK], q[1][C][LDK];
    float g[1][C], beta[1][C];
    struct {
        chunk_at at;
    } x;
    float m[3][16][16];
    chunk_keys kv[1];
    kiln_u32 red[16];
};


// The builtin rather than cvta in asm: the compiler then keeps shared
// addresses in 32 bits and folds their offsets (no 64-bit generic address
// a row of an operand held across the chunk loop).
__device__ __forceinline__ kiln_u32 sh_addr(const void *p) { return (kiln_u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm4(const void *p, kiln_u32 *r)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sh_addr(p)));
}

__device__ __forceinline__ void ldsm4t(const void *p, kiln_u32 *r)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sh_addr(p)));
}

__device__ __forceinline__ void mma16816(float *c, const kiln_u32 *a, kiln_u32 b0, kiln_u32 b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 as f16x2 (x0 in the low half: the lower column).
__device__ __forceinline__ kiln_u32 pack2(float x0, float x1)
{
    kiln_u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
    return r;
}

// x0, x1 as hi + lo f16x2 terms.
__device__ __forceinline__ void split2(float x0, float x1, kiln_u32 &hi, kiln_u32 &lo)
{
    hi = pack2(x0, x1);
    lo = pack2(x0 - kiln_f16_to_f32((kiln_f16)(hi & 0xffffu)), x1 - kiln_f16_to_f32((kiln_f16)(hi >> 16)));
}

__device__ __forceinline__ float exp_approx(float x)
{
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
    return r;
}

__device__ __forceinline__ float rsqrt_approx(float x)
{
    float r;
    asm("rsqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float bits_f32(kiln_u32 x)
{
    float r;
    asm("mov.b32 %0, %1;" : "=f"(r) : "r"(x));
    return r;
}

__device__ __forceinline__ float max_f32(float a, float b)
{
    float r;
    asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float abs_f32(float x)
{
    float r;
    asm("abs.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void syncwarp() { asm volatile("bar.warp.sync 0xffffffff;" ::: "memory"); }

__device__ __forceinline__ double shfl_up_f64(double v, int d)
{
    kiln_u32 lo, hi;
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "d"(v));
    asm volatile("shfl.sync.up.b32 %0, %0, %1, 0, 0xffffffff;" : "+r"(lo) : "r"(d));
    asm volatile("shfl.sync.up.b32 %0, %0, %1, 0, 0xffffffff;" : "+r"(hi) : "r"(d));
    double r;
    asm("mov.b64 %0, {%1, %2};" : "=d"(r) : "r"(lo), "r"(hi));
    return r;
}

__device__ __forceinline__ float f16_lo(kiln_u32 x) { return kiln_f16_to_f32((kiln_f16)(x & 0xffffu)); }
__device__ __forceinline__ float f16_hi(kiln_u32 x) { return kiln_f16_to_f32((kiln_f16)(x >> 16)); }
__device__ __forceinline__ float elt_lo(kiln_u32 x) { return kiln_elt_to_f32((kiln_elt)(x & 0xffffu)); }
__device__ __forceinline__ float elt_hi(kiln_u32 x) { return kiln_elt_to_f32((kiln_elt)(x >> 16)); }

__device__ __forceinline__ kiln_u32 shfl_up_u32(kiln_u32 v, int d)
{
    asm volatile("shfl.sync.up.b32 %0, %0, %1, 0, 0xffffffff;" : "+r"(v) : "r"(d));
    return v;
}

// a + b, or 2^32 - 1 past it: sums of records that only spans sharing tokens
// could carry past the capacity.
__device__ __forceinline__ kiln_u32 sat_add(kiln_u32 a, kiln_u32 b) { return a + b < a ? 0xffffffffu : a + b; }

// 16 bytes global -> shared, or 16 zero bytes when !ok (src is then not read).
__device__ __forceinline__ void cp16(void *dst, const void *src, bool ok)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sh_addr(dst)), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

#if KILN_VEC == 8
__device__ __forceinline__ void cp4(void *dst, const void *src, bool ok)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(sh_addr(dst)), "l"(src), "r"(ok ? 4 : 0)
                 : "memory");
}
#else
__device__ __forceinline__ kiln_elt ld_elt(const kiln_elt *p)
{
    kiln_elt v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
#endif

__device__ __forceinline__ float ld_f32(const float *p)
{
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// Chunk c of the span (tokens start + c·C ...) into stage st, in three
// parts (the caller commits the copies): k, q rows [C][DKP], zeros past the
// span and the key dim; the block's columns of v [C][ROWS], zeros past the
// span and the value dim; g (where G) and beta, 0 past the span.
template <class SM, int NT = THREADS>
__device__ __forceinline__ void load_kq(SM &sm, int st, const kiln_elt *q, const kiln_elt *k, kiln_u32 start,
                                        kiln_u32 count, kiln_u32 c, kiln_u32 kh, int tid)
{
    const kiln_u64 base = (kiln_u64)c * C; // 64-bit: a span may end near 2^32
#if KILN_VEC == 8
    constexpr int KP = DKP / 8, NKQ = 2 * C * KP;
    if constexpr (NT % KP == 0 && C * KP % NT == 0) {
        // A thread's 16-byte column p is the same in every row it copies,
        // rows r0, r0 + NT / KP, ...: one address a chunk, the rest
        // immediate offsets, and one compare a copy (the bare form below
        // spent about a quarter of the rows kernel's instructions on its
        // divisions and 64-bit products: ncu of bench_recurrent --only 4,1024).
        constexpr int RS = NT / KP;
        const int p = tid % KP, r0 = tid / KP;
        const int rem = base < count ? (int)min((kiln_u64)count - base, (kiln_u64)C) - r0 : 0;
        const bool pok = p * 8 < KILN_DK;
        const kiln_u64 o = (((kiln_u64)start + base + r0) * KILN_KH + kh) * KILN_DK + p * 8;
        const kiln_elt *kp = k + o, *qp = q + o;
#pragma unroll
        for (int i = 0; i < C / RS; i++) {
            const bool ok = pok && i * RS < rem; // src is not read where !ok
            cp16(&sm.k[st][r0 + i * RS][p * 8], kp + (kiln_u64)i * RS * KILN_KH * KILN_DK, ok);
            cp16(&sm.q[st][r0 + i * RS][p * 8], qp + (kiln_u64)i * RS * KILN_KH * KILN_DK, ok);
        }
    } else {
        // Loops of a fixed count a thread, unrolled (a thread's e = tid + i
        // THREADS): the chunk's loads are on its chain, and a loop whose count
        // the compiler cannot see is a branch and a convergence barrier a copy.
#pragma unroll 4 // fully: spills at 64 rows a block
        for (int i = 0; i < (NKQ + NT - 1) / NT; i++) {
            const int e = tid + i * NT;
            if (NKQ % NT == 0 || e < NKQ) {
                const int which = e / (C * KP), r = (e / KP) % C, p = e % KP;
                const bool ok = base + r < count && p * 8 < KILN_DK;
                const kiln_elt *src = which ? q : k;
                const kiln_u64 t = (kiln_u64)start + base + r;
                const kiln_elt *at = ok ? src + (t * KILN_KH + kh) * KILN_DK + p * 8 : src;
                cp16(which ? &sm.q[st][r][p * 8] : &sm.k[st][r][p * 8], at, ok);
            }
        }
    }
#else
    for (int e = tid; e < 2 * C * DKP; e += NT) {
        const int which = e / (C * DKP), r = (e / DKP) % C, col = e % DKP;
        const bool ok = base + r < count && col < KILN_DK;
        const kiln_elt *src = which ? q : k;
        const kiln_u64 t = (kiln_u64)start + base + r;
        const kiln_elt x = ok ? ld_elt(src + (t * KILN_KH + kh) * KILN_DK + col) : 0;
        (which ? sm.q[st][r] : sm.k[st][r])[col] = x;
    }
#endif
}

template <class SM, int NT = THREADS>
__device__ __forceinline__ void load_v(SM &sm, int st, const kiln_elt *v, kiln_u32 start, kiln_u32 count,
                                       kiln_u32 c, kiln_u32 h, int row0, int tid)
{
    const kiln_u64 base = (kiln_u64)c * C;
#if KILN_VEC == 8
    constexpr int VP = KILN_ROWS / 8, NV = C * VP;
    // As load_kq's first form: every block size (64, 128 or 256 threads at
    // 32 or 64 rows) tiles the rows evenly.
    static_assert(NT % VP == 0 && NV % NT == 0, "threads tile v's rows");
    constexpr int RS = NT / VP;
    const int p = tid % VP, r0 = tid / VP;
    const int rem = base < count ? (int)min((kiln_u64)count - base, (kiln_u64)C) - r0 : 0;
    const bool pok = row0 + p * 8 < KILN_DV;
    const kiln_elt *vp = v + (((kiln_u64)start + base + r0) * KILN_VH + h) * KILN_DV + row0 + p * 8;
#pragma unroll
    for (int i = 0; i < C / RS; i++)
        cp16(&sm.v[st][r0 + i * RS][p * 8], vp + (kiln_u64)i * RS * KILN_VH * KILN_DV, pok && i * RS < rem);
#else
    for (int e = tid; e < C * KILN_ROWS; e += NT) {
        const int r = e / KILN_ROWS, col = e % KILN_ROWS;
        const bool ok = base + r < count && row0 + col < KILN_DV;
        const kiln_u64 t = (kiln_u64)start + base + r;
        sm.v[st][r][col] = ok ? ld_elt(v + (t * KILN_VH + h) * KILN_DV + row0 + col) : 0;
    }
#endif
}

template <bool G, class SM, int NT = THREADS>
__device__ __forceinline__ void load_gb(SM &sm, int st, const float *g, const float *beta, kiln_u32 start,
                                        kiln_u32 count, kiln_u32 c, kiln_u32 h, int tid)
{
    const kiln_u64 base = (kiln_u64)c * C;
#if KILN_VEC == 8
    static_assert(G ? 2 * C <= NT : C <= NT, "one g or beta a thread");
    if (G ? tid < 2 * C : tid < C) {
        const int e = G ? tid : C + tid, r = e % C;
        const bool ok = base + r < count;
        const float *src = e < C ? g : beta;
        const float *at = ok ? src + ((kiln_u64)start + base + r) * KILN_VH + h : src;
        cp4(e < C ? &sm.g[st][r] : &sm.beta[st][r], at, ok);
    }
#else
    for (int e = G ? tid : C + tid; e < 2 * C; e += NT) {
        const int r = e % C;
        const bool ok = base + r < count;
        const float x = ok ? ld_f32((e < C ? g : beta) + ((kiln_u64)start + base + r) * KILN_VH + h) : 0.0f;
        (e < C ? sm.g[st] : sm.beta[st])[r] = x;
    }
#endif
}

// A chunk's inputs (G: with g, which the keyed and rows kernels do not read).
template <bool G, class SM = chunk_smem, int NT = THREADS>
__device__ __forceinline__ void load_chunk(SM &sm, int st, const kiln_elt *q, const kiln_elt *k,
                                           const kiln_elt *v, const float *g, const float *beta, kiln_u32 start,
                                           kiln_u32 count, kiln_u32 c, kiln_u32 h, kiln_u32 kh, int row0, int tid)
{
    load_kq<SM, NT>(sm, st, q, k, start, count, c, kh, tid);
    load_v<SM, NT>(sm, st, v, start, count, c, h, row0, tid);
    load_gb<G, SM, NT>(sm, st, g, beta, start, count, c, h, tid);
}

// The keyed kernel's parts of a record rec: its keys into stage st (one
// chunk ahead), and its T's and P's blocks into the space of A and T (at
// the chunk's start).
__device__ __forceinline__ void load_keys(chunk_smem &sm, int st, const float *rec, int tid)
{
    if (tid < REC_T / 4)
        cp16(reinterpret_cast<float *>(&sm.kv[st]) + tid * 4, rec + tid * 4, true);
}

__device__ __forceinline__ void load_blocks(chunk_smem &sm, const float *rec, int tid)
{
    constexpr int NB = 10 * BLK / 4; // 16-byte copies of T's blocks, and as many of P's
    static_assert(2 * NB % THREADS == 0, "whole copies a thread");
    float *dst = reinterpret_cast<float *>(&sm.x.at);
#pragma unroll
    for (int i = 0; i < 2 * NB / THREADS; i++) {
        const int e = tid + i * THREADS;
        cp16(dst + (e < NB ? e * 4 : P_AT + (e - NB) * 4), rec + REC_T + e * 4, true);
    }
}

// The power of two sc = 2^(13 - floor(log2 m)) that puts m in [2^13, 2^14),
// within 2^-64 .. 2^64 (2^64 for m = 0), and its inverse: both exact.
__device__ __forceinline__ void pow2_scale(float m, float &sc, float &inv)
{
    int f = 267 - (int)((kiln_f32_bits(m) >> 23) & 0xffu); // sc's biased exponent
    f = f < 63 ? 63 : f > 191 ? 191 : f;
    sc = bits_f32((kiln_u32)f << 23);
    inv = bits_f32((kiln_u32)(254 - f) << 23);
}

// The power-of-two scales of a lane's two rows (g4, g4 + 8) of n accumulator
// tiles, from their largest |x| over the row's four lanes.
template <int N> __device__ __forceinline__ void row_scales(const float (&x)[N][4], float *sc, float *inv)
{
    // A tree of maxima, not a chain: the step is on a warp's dependent path.
    float t[2][N];
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++)
            t[e2][n] = max_f32(abs_f32(x[n][2 * e2]), abs_f32(x[n][2 * e2 + 1]));
#pragma unroll
    for (int w = 1; w < N; w *= 2)
#pragma unroll
        for (int n = 0; n + w < N; n += 2 * w)
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++)
                t[e2][n] = max_f32(t[e2][n], t[e2][n + w]);
    float m[2] = {t[0][0], t[1][0]};
#pragma unroll
    for (int e2 = 0; e2 < 2; e2++) {
        m[e2] = max_f32(m[e2], kiln_shfl_xor_f32(m[e2], 1));
        m[e2] = max_f32(m[e2], kiln_shfl_xor_f32(m[e2], 2));
        pow2_scale(m[e2], sc[e2], inv[e2]);
    }
}

#if KILN_BF16
// The power of two sc that puts m (a row's largest |x|, any finite float) in
// [2^13, 2^14), or as near as a normal float allows, and its inverse: both
// exact (pow2_scale's range is too narrow for bf16's exponents).
__device__ __forceinline__ void row_scale(float m, float &sc, float &inv)
{
    int f = 267 - (int)((kiln_f32_bits(m) >> 23) & 0xffu);
    f = f > 253 ? 253 : f;
    sc = bits_f32((kiln_u32)f << 23);
    inv = bits_f32((kiln_u32)(254 - f) << 23);
}
#endif

// The largest of the four partial maxima of column c.
__device__ __forceinline__ float max4(const float (*m)[KILN_ROWS], int c)
{
    return max_f32(max_f32(m[0][c], m[1][c]), max_f32(m[2][c], m[3][c]));
}

// The A fragment (16 x 16) at p of a row-major f32 matrix (row stride ld)
// as hi and lo terms.
__device__ __forceinline__ void afrag_f32(const float *p, int ld, int g4, int t4, kiln_u32 *hi, kiln_u32 *lo)
{
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float *x = p + (g4 + (e & 1) * 8) * ld + (e >> 1) * 8 + 2 * t4;
        split2(x[0], x[1], hi[e], lo[e]);
    }
}

// The B fragment (16 x 8, k down the rows) at p of a row-major f32 matrix.
__device__ __forceinline__ void bfrag_f32(const float *p, int ld, int g4, int t4, kiln_u32 *hi, kiln_u32 *lo)
{
#pragma unroll
    for (int e = 0; e < 2; e++)
        split2(p[(2 * t4 + 8 * e) * ld + g4], p[(2 * t4 + 8 * e + 1) * ld + g4], hi[e], lo[e]);
}

#if KILN_BF16
// A bf16 row of k or q (this lane's vector hl of the half-warp's row) scaled
// by 2^s and rewritten in place as f16 (see the header; DKP <= 128: at most
// one vector a lane): f, this lane's scaled values, and inv = 2^-s.
__device__ __forceinline__ void rescale_row(kiln_f16 *row, int hl, float (&f)[8], float &inv)
{
    const bool mine = hl < DKP / 8;
    kiln_u32x4 x = {0u, 0u, 0u, 0u};
    if (mine)
        x = *reinterpret_cast<const kiln_u32x4 *>(row + hl * 8);
    float m = 0.0f;
    kiln_e8_to_f32(x, f);
#pragma unroll
    for (int e = 0; e < 8; e++)
        m = max_f32(m, abs_f32(f[e]));
#pragma unroll
    for (int o = 8; o; o >>= 1)
        m = max_f32(m, kiln_shfl_xor_f32(m, o));
    float sc;
    row_scale(m, sc, inv);
#pragma unroll
    for (int e = 0; e < 8; e++)
        f[e] *= sc;
    if (mine)
        *reinterpret_cast<kiln_u32x4 *>(row + hl * 8) =
            kiln_u32x4{pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7])};
}

// The keyed kernel's part of the norms' step: every k and q row of stage st
// rewritten as the pre-pass's norms rewrote it (a half-warp a row).
template <class SM, int NT = THREADS> __device__ __forceinline__ void rescale_rows(SM &sm, int st, int tid)
{
    const int hw = tid / 16, hl = tid % 16;
#pragma unroll
    for (int i = 0; i < 2 * C / (NT / 16); i++) {
        const int r = hw + i * (NT / 16);
        float f[8], inv;
        rescale_row(r < C ? sm.k[st][r] : sm.q[st][r - C], hl, f, inv);
    }
}
#endif

// Norms of the raw k and q rows (a half-warp a row) and γ (warp 0) of stage
// st into the keys kv[st].
template <class SM> __device__ __forceinline__ void norms_gamma(SM &sm, int st, float scale, int tid, int w, int lane)
{
    chunk_keys &kv = sm.kv[st];
    const int hw = tid / 16, hl = tid % 16;
#pragma unroll
    for (int i = 0; i < 2 * C / (THREADS / 16); i++) { // independent rows: their loads overlap
        const int r = hw + i * (THREADS / 16);
#if KILN_BF16
        // The row rewritten as f16, its factor 1 / sqrt(|x|² + eps) / 2^s
        // from the scaled sum of squares.
        float f[8], inv, ss = 0.0f;
        rescale_row(r < C ? sm.k[st][r] : sm.q[st][r - C], hl, f, inv);
#pragma unroll
        for (int e = 0; e < 8; e++)
            ss += f[e] * f[e];
#pragma unroll
        for (int o = 8; o; o >>= 1)
            ss += kiln_shfl_xor_f32(ss, o);
        if (hl == 0) {
            const float n = rsqrt_approx(ss * inv * inv + QK_EPS) * inv;
            if (r < C)
                kv.rk[r] = n;
            else
                kv.rq[r - C] = n * scale;
        }
#else
        const kiln_f16 *row = r < C ? sm.k[st][r] : sm.q[st][r - C];
        float ss = 0.0f;
        // A fixed count of vectors a lane (DKP / 8 <= 16: at most
        // one), so that the rows' loads and sums interleave.
        constexpr int PV = DKP / 8;
        if (PV == 16 || hl < PV) {
            const kiln_u32x4 x = *reinterpret_cast<const kiln_u32x4 *>(row + hl * 8);
            const kiln_u32 words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float a = f16_lo(words[e]), b = f16_hi(words[e]);
                ss += a * a + b * b;
            }
        }
#pragma unroll
        for (int m = 8; m; m >>= 1)
            ss += kiln_shfl_xor_f32(ss, m);
        if (hl == 0) {
            if (r < C)
                kv.rk[r] = rsqrt_approx(ss + QK_EPS);
            else
                kv.rq[r - C] = rsqrt_approx(ss + QK_EPS) * scale;
        }
#endif
    }
    // γ summed in f64 and kept as two floats, so that the difference
    // of two close sums deep into a chunk of strong gates keeps f32's
    // relative accuracy (one float's sum of -1000 would lose 1e-4).
    if (w == 0) {
        const double g0 = sm.g[st][2 * lane], g1 = sm.g[st][2 * lane + 1];
        double x = g0 + g1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double y = shfl_up_f64(x, o);
            if (lane >= o)
                x += y;
        }
        const double a0 = x - g1;
        kv.gam[2 * lane] = (float)a0;
        kv.gaml[2 * lane] = (float)(a0 - (double)(float)a0);
        kv.gam[2 * lane + 1] = (float)x;
        kv.gaml[2 * lane + 1] = (float)(x - (double)(float)x);
    }
}

// The chunk's products for rows mb * 16 .. of warp w: KEYS, K Kᵀ (warps
// 0-3) or Q Kᵀ (warps 4-7, isq) into acc; STATE, K Sᵀ or Q Sᵀ into xs.
template <bool KEYS, bool STATE, class SM>
__device__ __forceinline__ void products(SM &sm, int st, int mb, bool isq, int lane, float (&acc)[8][4],
                                         float (&xs)[NTV][4])
{
    const kiln_f16(*src)[LDK] = isq ? sm.q[st] : sm.k[st];
    const int bn = (lane & 7) + ((lane >> 4) << 3), bk = ((lane >> 3) & 1) * 8; // B rows (n), k offset
#pragma unroll
    for (int ks = 0; ks < DKP / 16; ks++) {
        kiln_u32 a[4], b[4];
        ldsm4(&src[mb * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8], a);
        if constexpr (KEYS) {
#pragma unroll
            for (int np = 0; np < 4; np++)
                if (np <= mb) {
                    ldsm4(&sm.k[st][np * 16 + bn][ks * 16 + bk], b);
                    mma16816(acc[2 * np], a, b[0], b[1]);
                    mma16816(acc[2 * np + 1], a, b[2], b[3]);
                }
        }
        if constexpr (STATE) {
#pragma unroll
            for (int np = 0; np < NTV / 2; np++) {
                ldsm4(&sm.shi[np * 16 + bn][ks * 16 + bk], b);
                mma16816(xs[2 * np], a, b[0], b[1]);
                mma16816(xs[2 * np + 1], a, b[2], b[3]);
                if constexpr (LO) {
                    ldsm4(&sm.slo[np * 16 + bn][ks * 16 + bk], b);
                    mma16816(xs[2 * np], a, b[0], b[1]);
                    mma16816(xs[2 * np + 1], a, b[2], b[3]);
                }
            }
        }
    }
}

// The key side of the products: acc scaled by the norms and decayed, A
// (warps 0-3, into sm.x.at.a) strictly below the diagonal, P (warps 4-7,
// kept in acc) on and below it.
template <class SM>
__device__ __forceinline__ void key_post(SM &sm, int st, int mb, bool isq, int g4, int t4, float (&acc)[8][4])
{
    const chunk_keys &kv = sm.kv[st];
    const int i0 = mb * 16 + g4;
    const float gi[2] = {kv.gam[i0], kv.gam[i0 + 8]}, gil[2] = {kv.gaml[i0], kv.gaml[i0 + 8]};
    const float ri[2] = {isq ? kv.rq[i0] : kv.rk[i0], isq ? kv.rq[i0 + 8] : kv.rk[i0 + 8]};
    const float bi[2] = {sm.beta[st][i0], sm.beta[st][i0 + 8]};
#pragma unroll
    for (int n = 0; n < 8; n++)
        if (n / 2 <= mb)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = i0 + (e >> 1) * 8, j = n * 8 + 2 * t4 + (e & 1);
                const float f = ri[e >> 1] * kv.rk[j] * acc[n][e];
                const float d = exp_approx((gi[e >> 1] - kv.gam[j]) + (gil[e >> 1] - kv.gaml[j]));
                // A strictly below the diagonal; P on and below it.
                acc[n][e] = (isq ? j <= i : j < i) ? (isq ? f : bi[e >> 1] * f) * d : 0.0f;
            }
    if (!isq) {
#pragma unroll
        for (int n = 0; n < 8; n++)
            if (n / 2 <= mb)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    float *d = &sm.x.at.a[i0 + e2 * 8][n * 8 + 2 * t4];
                    d[0] = acc[n][2 * e2];
                    d[1] = acc[n][2 * e2 + 1];
                }
    }
}

// The state side: xs, S's row scale undone, times e^γ_i and the row's norm;
// for warps 0-3 then R = b (v − that), f32, and each column's maximum over
// the warp's 16 tokens.
__device__ __forceinline__ void state_post(chunk_smem &sm, int st, int mb, bool isq, int g4, int t4,
                                           float (&xs)[NTV][4])
{
    const chunk_keys &kv = sm.kv[st];
    const int i0 = mb * 16 + g4;
    const float gi[2] = {kv.gam[i0], kv.gam[i0 + 8]};
    const float ri[2] = {isq ? kv.rq[i0] : kv.rk[i0], isq ? kv.rq[i0 + 8] : kv.rk[i0 + 8]};
    const float bi[2] = {sm.beta[st][i0], sm.beta[st][i0 + 8]};
    const float eg[2] = {exp_approx(gi[0]) * ri[0], exp_approx(gi[1]) * ri[1]};
#pragma unroll
    for (int n = 0; n < NTV; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            xs[n][e] *= sm.srinv[n * 8 + 2 * t4 + (e & 1)] * eg[e >> 1]; // S's row scale undone
    if (!isq) {
#pragma unroll
        for (int n = 0; n < NTV; n++) {
            const int col = n * 8 + 2 * t4;
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
                const int i = i0 + e2 * 8;
                const kiln_u32 vv = *reinterpret_cast<const kiln_u32 *>(&sm.v[st][i][col]);
                xs[n][2 * e2] = bi[e2] * (elt_lo(vv) - xs[n][2 * e2]);
                xs[n][2 * e2 + 1] = bi[e2] * (elt_hi(vv) - xs[n][2 * e2 + 1]);
                sm.rf[i][col] = xs[n][2 * e2];
                sm.rf[i][col + 1] = xs[n][2 * e2 + 1];
            }
#pragma unroll
            for (int e1 = 0; e1 < 2; e1++) {
                float m = max_f32(abs_f32(xs[n][e1]), abs_f32(xs[n][2 + e1]));
#pragma unroll
                for (int o = 4; o < 32; o <<= 1)
                    m = max_f32(m, kiln_shfl_xor_f32(m, o));
                if (g4 == 0)
                    sm.rcmax[mb][col + e1] = m;
            }
        }
    }
}

// T = (I + A)^-1 into sm.x.at.t from A (written before a barrier); ends
// with a barrier.
template <class SM> __device__ __forceinline__ void t_inverse(SM &sm, int w, int lane, int g4, int t4)
{
    // T's diagonal blocks: lane 16 d + c finds column c of block d, top down.
    if (w < 2) {
        const int d = 2 * w + (lane >> 4), cc = lane & 15, o = d * 16;
        float t[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float x = r == cc ? 1.0f : 0.0f;
#pragma unroll
            for (int m = 0; m < r; m++)
                x -= sm.x.at.a[o + r][o + m] * t[m];
            t[r] = x;
        }
#pragma unroll
        for (int r = 0; r < 16; r++)
            sm.x.at.t[o + r][o + cc] = t[r];
    }
    __syncthreads();
    // The blocks below, by distance d: block (j + d, j) is warp j's,
    // T_ij = −T_ii Σ_{k=j}^{i−1} A_ik T_kj as two products on the tensor
    // cores (hi and lo terms), the sum through the warp's own scratch.
#pragma unroll 1
    for (int dist = 1; dist < 4; dist++) {
        if (w + dist < 4) {
            const int bj = w, bi = w + dist;
            float m[2][4], o[2][4];
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    m[j][e] = o[j][e] = 0.0f;
            kiln_u32 ah[4], al[4], bh[2], bl[2];
            for (int bk = bj; bk < bi; bk++) {
                afrag_f32(&sm.x.at.a[16 * bi][16 * bk], LDF, g4, t4, ah, al);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    bfrag_f32(&sm.x.at.t[16 * bk][16 * bj + 8 * j], LDF, g4, t4, bh, bl);
                    mma16816(m[j], ah, bh[0], bh[1]);
                    mma16816(m[j], ah, bl[0], bl[1]);
                    mma16816(m[j], al, bh[0], bh[1]);
                }
            }
            float *scr = &sm.m[w][0][0]; // 16 x 16
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    scr[(g4 + (e >> 1) * 8) * 16 + 8 * j + 2 * t4 + (e & 1)] = m[j][e];
            syncwarp();
            afrag_f32(&sm.x.at.t[16 * bi][16 * bi], LDF, g4, t4, ah, al);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                bfrag_f32(scr + 8 * j, 16, g4, t4, bh, bl);
                mma16816(o[j], ah, bh[0], bh[1]);
                mma16816(o[j], ah, bl[0], bl[1]);
                mma16816(o[j], al, bh[0], bh[1]);
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    sm.x.at.t[16 * bi + g4 + (e >> 1) * 8][16 * bj + 8 * j + 2 * t4 + (e & 1)] = -o[j][e];
        }
        __syncthreads();
    }
}

// A record's block (i, j), j <= i: its index among the 10.
__device__ __forceinline__ int blk_index(int i, int j) { return i * (i + 1) / 2 + j; }

// The A fragment of a record's block at p (fragment order) as hi and lo
// terms: afrag_f32's values, read where the pre-pass wrote them.
__device__ __forceinline__ void afrag_blk(const float *p, int lane, kiln_u32 *hi, kiln_u32 *lo)
{
    const float *x = p + lane * 8;
#pragma unroll
    for (int e = 0; e < 4; e++)
        split2(x[2 * e], x[2 * e + 1], hi[e], lo[e]);
}

// The chunks of sequence s's span; none for a span past the tokens.
__device__ __forceinline__ kiln_u32 span_chunks(const kiln_u32 *spans, kiln_u32 s, kiln_u32 tokens)
{
    const kiln_u32 start = __ldcg(spans + 2 * s), count = __ldcg(spans + 2 * s + 1); // as span_begin
    return (kiln_u64)start + count > tokens ? 0u : count / C + (count % C != 0);
}

// base(seq): the records of the sequences before seq (saturated), by the
// whole block.
template <int NT = THREADS>
__device__ kiln_u32 records_before(const kiln_u32 *spans, kiln_u32 seq, kiln_u32 tokens, kiln_u32 *red, int tid)
{
    kiln_u32 n = 0;
    for (kiln_u32 s = tid; s < seq; s += NT)
        n = sat_add(n, span_chunks(spans, s, tokens));
#pragma unroll
    for (int o = 16; o; o >>= 1)
        n = sat_add(n, kiln_shfl_xor_u32(n, o));
    if (tid % 32 == 0)
        red[tid / 32] = n;
    __syncthreads();
    n = 0;
#pragma unroll
    for (int i = 0; i < NT / 32; i++)
        n = sat_add(n, red[i]);
    return n;
}

// The block's span of sequence seq (start, count and its chunks), or false
// where the block has nothing to do: a span past `tokens` (reported by the
// sequence's first block, first) or an empty one.
__device__ __forceinline__ bool span_begin(const kiln_u32 *spans, kiln_u32 seq, kiln_u32 tokens, bool first,
                                           kiln_fault *fault, kiln_u32 &start, kiln_u32 &count, kiln_u32 &chunks)
{
    start = __ldcg(spans + 2 * seq); // through L2: the streamed rows kernel reads them before any wait
    count = __ldcg(spans + 2 * seq + 1);
    const kiln_u64 end = (kiln_u64)start + count;
    if (end > tokens) {
        if (first)
            kiln_report_fault(fault, KILN_FAULT_GATED_DELTA_SPAN, seq,
                              end > 0xffffffffull ? 0xffffffffu : (kiln_u32)end, tokens);
        return false;
    }
    chunks = count / C + (count % C != 0);
    return count != 0;
}

// The sequence's first record of value head h in ws (its chunk c's at
// c · VH · REC_STRIDE past it) into rec, by the whole block of NT threads;
// false where its records would pass the `records` capacity (only spans
// that share tokens do).
template <int NT = THREADS>
__device__ bool seq_records(const kiln_u32 *spans, kiln_u32 seq, kiln_u32 tokens, kiln_u32 chunks, kiln_u32 h,
                            const float *ws, kiln_u32 records, kiln_u32 *red, int tid, const float *&rec)
{
    const kiln_u32 base = records_before<NT>(spans, seq, tokens, red, tid);
    rec = ws + ((kiln_u64)base * KILN_VH + h) * REC_STRIDE;
    return base <= records && chunks <= records - base;
}

// The sequence and chunk whose record is r, by the whole block, a tile of
// THREADS sequences at a time; false when r is past every sequence's.
__device__ bool find_record(const kiln_u32 *spans, kiln_u32 seqs, kiln_u32 tokens, kiln_u32 r, kiln_u32 *red,
                            int tid, kiln_u32 &seq, kiln_u32 &c)
{
    const int w = tid / 32, lane = tid % 32;
    constexpr int NW = THREADS / 32;
    if (tid == 0)
        red[NW + 2] = 0u;
    kiln_u32 base = 0;
    for (kiln_u32 s0 = 0; s0 < seqs; s0 += THREADS) {
        const kiln_u32 s = s0 + tid, n = s < seqs ? span_chunks(spans, s, tokens) : 0u;
        kiln_u32 x = n; // the inclusive sum over the warp's lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const kiln_u32 y = shfl_up_u32(x, o);
            if (lane >= o)
                x = sat_add(x, y);
        }
        if (lane == 31)
            red[w] = x;
        __syncthreads();
        kiln_u32 before = base, total = base;
#pragma unroll
        for (int i = 0; i < NW; i++) {
            if (i < w)
                before = sat_add(before, red[i]);
            total = sat_add(total, red[i]);
        }
        const kiln_u32 hi = sat_add(before, x);
        if (n && hi != 0xffffffffu && hi - n <= r && r < hi) {
            red[NW] = s;
            red[NW + 1] = r - (hi - n);
            red[NW + 2] = 1u;
        }
        __syncthreads();
        if (red[NW + 2] || total > r)
            break;
        base = total;
    }
    seq = red[NW];
    c = red[NW + 1];
    return red[NW + 2] != 0u;
}


// The launch's dynamic shared memory a block, in bytes.
__device__ __forceinline__ kiln_u32 dynamic_smem()
{
    kiln_u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    return dyn;
}

// Whether the launch gave the block at least bytes of dynamic shared memory.
__device__ __forceinline__ bool smem_holds(kiln_u64 bytes) { return dynamic_smem() >= bytes; }

// Whether the launch gave the block the threads and the shared memory the
// kernel was built for; else (the host's sizes against the template's: an
// internal error) each block's thread 0 reports it, so that it surfaces at
// the next synchronize rather than as outputs never written.
__device__ __forceinline__ bool launch_holds(kiln_u64 bytes, kiln_u32 threads, kiln_fault *fault)
{
    const kiln_u32 dyn = dynamic_smem();
    if (dyn >= bytes && blockDim.x == threads)
        return true;
    if (threadIdx.x == 0) {
        if (dyn < bytes)
            kiln_report_fault(fault, KILN_FAULT_GATED_DELTA_SMEM, blockIdx.x, dyn, bytes);
        else
            kiln_report_fault(fault, KILN_FAULT_GATED_DELTA_THREADS, blockIdx.x, blockDim.x, threads);
    }
    return false;
}

template <int N> __device__ __forceinline__ void zero_tiles(float (&x)[N][4])
{
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            x[n][e] = 0.0f;
}

// The chunked loop of a block, single (KEYED false: every step) or keyed
// (rk, rq, γ, T and P from the workspace ws of `records` records a head).
template <bool KEYED>
__device__ __forceinline__ void chunk_run(chunk_smem &sm, const kiln_elt *__restrict__ q,
                                          const kiln_elt *__restrict__ k, const kiln_elt *__restrict__ v,
                                          const float *__restrict__ g, const float *__restrict__ beta,
                                          float *__restrict__ state, const kiln_u32 *__restrict__ spans,
                                          kiln_elt *__restrict__ out, kiln_u32 tokens, kiln_fault *fault,
                                          const float *__restrict__ ws, kiln_u32 records)
{

    const kiln_u32 rb = blockIdx.x % ROW_BLOCKS, sh = blockIdx.x / ROW_BLOCKS; // sh = seq * VH + h
    const kiln_u32 h = sh % KILN_VH, seq = sh / KILN_VH, kh = h / GROUP;
    const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, g4 = lane / 4, t4 = lane % 4;
    const int row0 = rb * KILN_ROWS;
    kiln_u32 start, count, chunks;
    if (!span_begin(spans, seq, tokens, h == 0 && rb == 0 && tid == 0, fault, start, count, chunks))
        return;
    // The sequence's records: chunk c's at rec + c · VH · REC_STRIDE.
    const float *rec = ws;
    if constexpr (KEYED) {
        if (!seq_records(spans, seq, tokens, chunks, h, ws, records, sm.red, tid, rec))
            return;
    }
    constexpr kiln_u64 REC_STEP = (kiln_u64)KILN_VH * REC_STRIDE;
    load_chunk<!KEYED>(sm, 0, q, k, v, g, beta, start, count, 0, h, kh, row0, tid);
    if constexpr (KEYED)
        load_keys(sm, 0, rec, tid);
    cp_commit();

    // The block's rows of S: warp w holds rows (w % WM) * 16 .. + 15 and the
    // n-tile pairs p = w / WM + i * WPM of the key dim, in the mma
    // accumulator layout (row g4 / g4 + 8, columns 2 t4, 2 t4 + 1 of an n-tile).
    const int mbs = w % WM, wr = w / WM;
    float s[NPW][2][4];
    float *srow = state + (kiln_u64)sh * KILN_DV * KILN_DK;
#pragma unroll
    for (int i = 0; i < NPW; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int p = wr + i * WPM, r = row0 + mbs * 16 + g4 + (e >> 1) * 8,
                          col = p * 16 + j * 8 + 2 * t4 + (e & 1);
                s[i][j][e] = p < NPK && r < KILN_DV && col < KILN_DK ? srow[(kiln_u64)r * KILN_DK + col] : 0.0f;
            }

    const float scale = rsqrt_approx((float)KILN_DK);
#pragma unroll 1
    for (kiln_u32 c = 0; c < chunks; c++) {
        const int st = c & 1;
        // Each row of S enters this chunk's products as hi and lo terms of
        // S 2^s, s putting the row's maximum in [2^13, 2^14) (so that a small
        // row keeps 22 bits), and the products are unscaled. The warp's part
        // of each row's maximum first (the previous chunk's readers of these
        // are past several barriers).
        {
            float m[2] = {0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < NPW; i++)
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        m[e >> 1] = max_f32(m[e >> 1], abs_f32(s[i][j][e])); // zeros past the key dim
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
                m[e2] = max_f32(m[e2], kiln_shfl_xor_f32(m[e2], 1));
                m[e2] = max_f32(m[e2], kiln_shfl_xor_f32(m[e2], 2));
                if (t4 == 0)
                    sm.srmax[wr][mbs * 16 + g4 + e2 * 8] = m[e2];
            }
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        if constexpr (KEYED) { // this chunk's T and P: the first group of two
            load_blocks(sm, rec + c * REC_STEP, tid);
            cp_commit();
        }
        if (c + 1 < chunks) {
            load_chunk<!KEYED>(sm, st ^ 1, q, k, v, g, beta, start, count, c + 1, h, kh, row0, tid);
            if constexpr (KEYED)
                load_keys(sm, st ^ 1, rec + (c + 1) * REC_STEP, tid);
        }
        cp_commit();
        // The state's terms (read after the barrier that ends the norms).
        {
            float sc[2];
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
                const int r = mbs * 16 + g4 + e2 * 8;
                float m = sm.srmax[0][r], inv;
#pragma unroll
                for (int o = 1; o < WPM; o++)
                    m = max_f32(m, sm.srmax[o][r]);
                pow2_scale(m, sc[e2], inv);
                if (wr == 0 && t4 == 0)
                    sm.srinv[r] = inv;
            }
#pragma unroll
            for (int i = 0; i < NPW; i++) {
                const int p = wr + i * WPM;
                if (NPK_OK(p))
#pragma unroll
                    for (int j = 0; j < 2; j++)
#pragma unroll
                        for (int e2 = 0; e2 < 2; e2++) {
                            kiln_u32 hi, lo;
                            split2(s[i][j][2 * e2] * sc[e2], s[i][j][2 * e2 + 1] * sc[e2], hi, lo);
                            const int r = mbs * 16 + g4 + e2 * 8, col = p * 16 + j * 8 + 2 * t4;
                            *reinterpret_cast<kiln_u32 *>(&sm.shi[r][col]) = hi;
                            if constexpr (LO)
                                *reinterpret_cast<kiln_u32 *>(&sm.slo[r][col]) = lo;
                        }
            }
        }

        if constexpr (!KEYED)
            norms_gamma(sm, st, scale, tid, w, lane);
#if KILN_BF16
        else
            rescale_rows(sm, st, tid);
#endif
        __syncthreads();

        // Warps 0-3: K Kᵀ -> A and K Sᵀ -> R for rows mb * 16 ..; warps 4-7:
        // Q Kᵀ -> the scores P (kept in registers) and Q Sᵀ -> out's state part.
        const int mb = w & 3;
        const bool isq = w >= 4;
        float acc[8][4], xs[NTV][4];
        zero_tiles(acc);
        zero_tiles(xs);
        products<!KEYED, true>(sm, st, mb, isq, lane, acc, xs);
        if constexpr (!KEYED)
            key_post(sm, st, mb, isq, g4, t4, acc);
        state_post(sm, st, mb, isq, g4, t4, xs);
        if constexpr (KEYED)
            asm volatile("cp.async.wait_group 1;" ::: "memory"); // T and P
        __syncthreads();
        if constexpr (!KEYED)
            t_inverse(sm, w, lane, g4, t4);

        // U = T R: warp w takes rows mb * 16 .. and half nh of the columns.
        {
            const int nh = w >> 2;
            kiln_u32 th[4][4], tl[4][4];
            const float *tp = reinterpret_cast<const float *>(&sm.x.at);
#pragma unroll
            for (int ks = 0; ks < 4; ks++)
                if (ks <= mb) {
                    if constexpr (KEYED)
                        afrag_blk(tp + blk_index(mb, ks) * BLK, lane, th[ks], tl[ks]);
                    else
                        afrag_f32(&sm.x.at.t[mb * 16][ks * 16], LDF, g4, t4, th[ks], tl[ks]);
                }
            __syncthreads(); // every read of T before U takes its place
            float u[NTV / 2][4];
#pragma unroll
            for (int n = 0; n < NTV / 2; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    u[n][e] = 0.0f;
            // R's columns enter scaled as S's rows do (column n0 + g4 of an
            // n-tile is this lane's in B; 2 t4, 2 t4 + 1 in the accumulator).
            const int c0 = nh * (NTV / 2) * 8;
            float bsc[NTV / 2], uinv[NTV / 2][2];
#pragma unroll
            for (int n = 0; n < NTV / 2; n++) {
                float unused;
                pow2_scale(max4(sm.rcmax, c0 + n * 8 + g4), bsc[n], unused);
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++)
                    pow2_scale(max4(sm.rcmax, c0 + n * 8 + 2 * t4 + e1), unused, uinv[n][e1]);
            }
#pragma unroll
            for (int ks = 0; ks < 4; ks++)
                if (ks <= mb)
#pragma unroll
                    for (int n = 0; n < NTV / 2; n++) {
                        kiln_u32 bh[2], bl[2];
                        const float *rp = &sm.rf[ks * 16 + 2 * t4][c0 + n * 8 + g4];
#pragma unroll
                        for (int e = 0; e < 2; e++)
                            split2(rp[(8 * e) * LDR] * bsc[n], rp[(8 * e + 1) * LDR] * bsc[n], bh[e], bl[e]);
                        mma16816(u[n], th[ks], bh[0], bh[1]);
                        if constexpr (LO) {
                            mma16816(u[n], th[ks], bl[0], bl[1]);
                            mma16816(u[n], tl[ks], bh[0], bh[1]);
                        }
                    }
#pragma unroll
            for (int n = 0; n < NTV / 2; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    u[n][e] *= uinv[n][e & 1];
            // U' = e^(γ_L − γ_i) rk_i U_i, then each column's maximum over the chunk.
            const float gl = sm.kv[st].gam[C - 1], gll = sm.kv[st].gaml[C - 1];
            float up[NTV / 2][4];
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
                const int i = mb * 16 + g4 + e2 * 8;
                const float el = exp_approx((gl - sm.kv[st].gam[i]) + (gll - sm.kv[st].gaml[i])) * sm.kv[st].rk[i];
#pragma unroll
                for (int n = 0; n < NTV / 2; n++) {
                    const int col = nh * (NTV / 2) * 8 + n * 8 + 2 * t4;
                    kiln_u32 hi, lo;
                    split2(u[n][2 * e2], u[n][2 * e2 + 1], hi, lo);
                    *reinterpret_cast<kiln_u32 *>(&sm.x.u.hi[i][col]) = hi;
                    if constexpr (LO)
                        *reinterpret_cast<kiln_u32 *>(&sm.x.u.lo[i][col]) = lo;
                    up[n][2 * e2] = u[n][2 * e2] * el;
                    up[n][2 * e2 + 1] = u[n][2 * e2 + 1] * el;
                }
            }
#pragma unroll
            for (int n = 0; n < NTV / 2; n++)
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    float m = max_f32(abs_f32(up[n][e1]), abs_f32(up[n][2 + e1]));
#pragma unroll
                    for (int o = 4; o < 32; o <<= 1)
                        m = max_f32(m, kiln_shfl_xor_f32(m, o));
                    if (g4 == 0)
                        sm.ucmax[mb][nh * (NTV / 2) * 8 + n * 8 + 2 * t4 + e1] = m;
                }
            if constexpr (KEYED) { // P as key_post leaves it in acc, before U' takes its place
                if (isq) {
                    const float *pp = reinterpret_cast<const float *>(&sm.x.at) + P_AT;
#pragma unroll
                    for (int np = 0; np < 4; np++)
                        if (np <= mb) {
                            const float *p = pp + blk_index(mb, np) * BLK + lane * 8;
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                acc[2 * np][e] = p[e];
                                acc[2 * np + 1][e] = p[4 + e];
                            }
                        }
                }
            }
            __syncthreads();
            // U' enters the state's update as hi and lo terms of U' 2^s, s per
            // column (a row of S) putting its maximum in [2^13, 2^14): the
            // terms keep 22 bits however small a row of S is.
#pragma unroll
            for (int n = 0; n < NTV / 2; n++) {
                const int col = nh * (NTV / 2) * 8 + n * 8 + 2 * t4;
                float sc[2];
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    float inv;
                    pow2_scale(max4(sm.ucmax, col + e1), sc[e1], inv);
                    if (mb == 0 && g4 == 0) {
                        sm.usc[col + e1] = sc[e1];
                        sm.usci[col + e1] = inv;
                    }
                }
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    const int i = mb * 16 + g4 + e2 * 8;
                    kiln_u32 hi, lo;
                    split2(up[n][2 * e2] * sc[0], up[n][2 * e2 + 1] * sc[1], hi, lo);
                    *reinterpret_cast<kiln_u32 *>(&sm.x.u.phi[i][col]) = hi;
                    if constexpr (LO)
                        *reinterpret_cast<kiln_u32 *>(&sm.x.u.plo[i][col]) = lo;
                }
            }
        }
        __syncthreads();

        const int tk = ((lane >> 3) & 1) * 8 + (lane & 7), tn = (lane >> 4) * 8;
        // out = its state part + P U (warps 4-7; P's accumulators are the A
        // fragments), each row of P scaled by a power of two putting its
        // maximum in [2^13, 2^14), so that small scores keep 22 bits: out 2^s
        // = (state part) 2^s + (P 2^s) U.
        if (isq) {
            float psc[2], psci[2];
            row_scales(acc, psc, psci); // tiles past the diagonal hold zeros
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
#pragma unroll
                for (int n = 0; n < NTV; n++) {
                    xs[n][2 * e2] *= psc[e2];
                    xs[n][2 * e2 + 1] *= psc[e2];
                }
            }
#pragma unroll
            for (int ks = 0; ks < 4; ks++)
                if (ks <= mb) {
                    kiln_u32 ph[4], pl[4];
                    split2(acc[2 * ks][0] * psc[0], acc[2 * ks][1] * psc[0], ph[0], pl[0]);
                    split2(acc[2 * ks][2] * psc[1], acc[2 * ks][3] * psc[1], ph[1], pl[1]);
                    split2(acc[2 * ks + 1][0] * psc[0], acc[2 * ks + 1][1] * psc[0], ph[2], pl[2]);
                    split2(acc[2 * ks + 1][2] * psc[1], acc[2 * ks + 1][3] * psc[1], ph[3], pl[3]);
#pragma unroll
                    for (int np = 0; np < NTV / 2; np++) {
                        kiln_u32 bh[4], bl[4];
                        ldsm4t(&sm.x.u.hi[ks * 16 + tk][np * 16 + tn], bh);
                        if constexpr (LO)
                            ldsm4t(&sm.x.u.lo[ks * 16 + tk][np * 16 + tn], bl);
#pragma unroll
                        for (int j = 0; j < 2; j++) {
                            mma16816(xs[2 * np + j], ph, bh[2 * j], bh[2 * j + 1]);
                            if constexpr (LO) {
                                mma16816(xs[2 * np + j], ph, bl[2 * j], bl[2 * j + 1]);
                                mma16816(xs[2 * np + j], pl, bh[2 * j], bh[2 * j + 1]);
                            }
                        }
                    }
                }
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
                const int i = mb * 16 + g4 + e2 * 8;
                if ((kiln_u64)c * C + i < count) {
                    kiln_elt *orow = out + ((kiln_u64)start + (kiln_u64)c * C + i) * (KILN_VH * KILN_DV) + h * KILN_DV;
#pragma unroll
                    for (int n = 0; n < NTV; n++) {
                        const int col = row0 + n * 8 + 2 * t4;
                        if (col < KILN_DV)
                            orow[col] = kiln_f32_to_elt(xs[n][2 * e2] * psci[e2]);
                        if (col + 1 < KILN_DV)
                            orow[col + 1] = kiln_f32_to_elt(xs[n][2 * e2 + 1] * psci[e2]);
                    }
                }
            }
        }
        // S = e^γ_L S + U'ᵀ K (all warps, each on its own rows and columns),
        // in the scaled rows of U': S 2^s = e^γ_L S 2^s + (U' 2^s)ᵀ K.
        {
            const float al = exp_approx(sm.kv[st].gam[C - 1]);
            const int r0 = mbs * 16 + g4;
            const float pre[2] = {al * sm.usc[r0], al * sm.usc[r0 + 8]};
#pragma unroll
            for (int i = 0; i < NPW; i++)
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[i][j][e] *= pre[e >> 1];
            const int am = (lane >> 3 & 1) * 8, ak = (lane >> 4) * 8; // trans A: m offset, k offset
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                kiln_u32 ah[4], alo[4];
                ldsm4t(&sm.x.u.phi[ks * 16 + ak + (lane & 7)][mbs * 16 + am], ah);
                if constexpr (LO)
                    ldsm4t(&sm.x.u.plo[ks * 16 + ak + (lane & 7)][mbs * 16 + am], alo);
#pragma unroll
                for (int i = 0; i < NPW; i++) {
                    const int p = wr + i * WPM;
                    if (NPK_OK(p)) {
                        kiln_u32 b[4];
                        ldsm4t(&sm.k[st][ks * 16 + tk][p * 16 + tn], b);
#pragma unroll
                        for (int j = 0; j < 2; j++) {
                            mma16816(s[i][j], ah, b[2 * j], b[2 * j + 1]);
                            if constexpr (LO)
                                mma16816(s[i][j], alo, b[2 * j], b[2 * j + 1]);
                        }
                    }
                }
            }
            const float post[2] = {sm.usci[r0], sm.usci[r0 + 8]};
#pragma unroll
            for (int i = 0; i < NPW; i++)
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[i][j][e] *= post[e >> 1];
        }
        // The barrier at the next chunk's start orders these reads of shared
        // memory before its writes.
    }

#pragma unroll
    for (int i = 0; i < NPW; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int p = wr + i * WPM, r = row0 + mbs * 16 + g4 + (e >> 1) * 8,
                          col = p * 16 + j * 8 + 2 * t4 + (e & 1);
                if (p < NPK && r < KILN_DV && col < KILN_DK)
                    srow[(kiln_u64)r * KILN_DK + col] = s[i][j][e];
            }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_gated_delta_chunk(const kiln_elt *__restrict__ q, const kiln_elt *__restrict__ k,
                       const kiln_elt *__restrict__ v, const float *__restrict__ g, const float *__restrict__ beta,
                       float *__restrict__ state, const kiln_u32 *__restrict__ spans, kiln_elt *__restrict__ out,
                       kiln_u32 tokens, kiln_fault *fault)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (!launch_holds(sizeof(chunk_smem), THREADS, fault))
        return;
    chunk_run<false>(*reinterpret_cast<chunk_smem *>(smem_raw), q, k, v, g, beta, state, spans, out, tokens, fault,
                     nullptr, 0u);
}

// The keyed chunked kernel: kiln_gated_delta_chunk's arguments, then the
// workspace the pre-pass wrote and its records a value head.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_gated_delta_chunk_keyed(const kiln_elt *__restrict__ q, const kiln_elt *__restrict__ k,
                             const kiln_elt *__restrict__ v, const float *__restrict__ g,
                             const float *__restrict__ beta, float *__restrict__ state,
                             const kiln_u32 *__restrict__ spans, kiln_elt *__restrict__ out, kiln_u32 tokens,
                             kiln_fault *fault, const float *__restrict__ ws, kiln_u32 records)
{
    kiln_grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (!launch_holds(sizeof(chunk_smem), THREADS, fault))
        return;
    chunk_run<true>(*reinterpret_cast<chunk_smem *>(smem_raw), q, k, v, g, beta, state, spans, out, tokens, fault,
                    ws, records);
}

// A lane's 8 floats of a record's block blk, in fragment order (float 2 e +
// b: row g4 + 8 (e & 1)): as they are, at 8 lane; or (split) as the A
// fragment's hi terms of the floats times sc0 (row g4) or sc1 (row g4 + 8),
// registers 0, 2, 1, 3 (the B fragments of the transpose's n-tiles 2 i and
// 2 i + 1, each a register pair), at 4 lane, and its lo terms in that order
// at 128 + 4 lane (a warp's 16-byte loads of either then take one pass).
__device__ __forceinline__ void store_frag(float *blk, int lane, const float *f, float sc0, float sc1,
                                           kiln_u32 split)
{
    kiln_u32 x[8];
    if (split) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float sc = e & 1 ? sc1 : sc0;
            const int at = (e & 1) * 2 + (e >> 1); // 0, 2, 1, 3
            split2(f[2 * e] * sc, f[2 * e + 1] * sc, x[at], x[4 + at]);
        }
        kiln_stg16(blk + 4 * lane, kiln_u32x4{x[0], x[1], x[2], x[3]});
        if constexpr (LO) // no reader of the lo terms in one term
            kiln_stg16(blk + 128 + 4 * lane, kiln_u32x4{x[4], x[5], x[6], x[7]});
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        x[i] = kiln_f32_bits(f[i]);
    kiln_stg16(blk + 8 * lane, kiln_u32x4{x[0], x[1], x[2], x[3]});
    kiln_stg16(blk + 8 * lane + 4, kiln_u32x4{x[4], x[5], x[6], x[7]});
}

// A flag of the streamed form (see kiln_gated_delta_keys), set with release
// semantics at the GPU's scope once the block's stores before it are done.
__device__ __forceinline__ void flag_release(kiln_u32 *f)
{
    __threadfence();
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(f), "r"(1u) : "memory");
}

// Waits until the flag at f is set (acquire at the GPU's scope).
__device__ __forceinline__ void flag_wait(const kiln_u32 *f)
{
    for (;;) {
        kiln_u32 x;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(x) : "l"(f) : "memory");
        if (x)
            return;
        __nanosleep(128);
    }
}

// Record r of value head h, or false (nothing written) where r is no
// sequence's: the body of the pre-pass, by the whole block.
__device__ __forceinline__ bool keys_record(keys_smem &sm, const kiln_elt *__restrict__ q,
                                            const kiln_elt *__restrict__ k, const float *__restrict__ g,
                                            const float *__restrict__ beta, const kiln_u32 *__restrict__ spans,
                                            float *__restrict__ ws, kiln_u32 tokens, kiln_u32 seqs, kiln_u32 split,
                                            kiln_u32 r, kiln_u32 h)
{
    const kiln_u32 kh = h / GROUP;
    const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, g4 = lane / 4, t4 = lane % 4;
    kiln_u32 seq, c;
    if (!find_record(spans, seqs, tokens, r, sm.red, tid, seq, c))
        return false;
    const kiln_u32 start = spans[2 * seq], count = spans[2 * seq + 1];
    load_kq(sm, 0, q, k, start, count, c, kh, tid);
    load_gb<true>(sm, 0, g, beta, start, count, c, h, tid);
    cp_commit();
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    norms_gamma(sm, 0, rsqrt_approx((float)KILN_DK), tid, w, lane);
    __syncthreads();
#if KILN_BF16
    // The rows kernel's k and q (a split record's), as the norms rewrote
    // them: [2][C][DKP] halves at REC_KQ.
    if (split) {
        constexpr int KP = DKP / 8;
        kiln_f16 *kq = reinterpret_cast<kiln_f16 *>(ws + ((kiln_u64)r * KILN_VH + h) * REC_STRIDE + REC_KQ);
#pragma unroll
        for (int i = 0; i < (2 * C * KP + THREADS - 1) / THREADS; i++) {
            const int e = tid + i * THREADS, r2 = e / KP, p = e % KP;
            if (2 * C * KP % THREADS == 0 || e < 2 * C * KP)
                kiln_stg16(kq + r2 * DKP + p * 8,
                           *reinterpret_cast<const kiln_u32x4 *>(r2 < C ? &sm.k[0][r2][p * 8]
                                                                        : &sm.q[0][r2 - C][p * 8]));
        }
    }
#endif
    const int mb = w & 3;
    const bool isq = w >= 4;
    float acc[8][4], xs[NTV][4];
    zero_tiles(acc);
    products<true, false>(sm, 0, mb, isq, lane, acc, xs);
    key_post(sm, 0, mb, isq, g4, t4, acc);
    __syncthreads();
    t_inverse(sm, w, lane, g4, t4);

    float *rec = ws + ((kiln_u64)r * KILN_VH + h) * REC_STRIDE;
    if (tid < REC_T / 4)
        kiln_stg16(rec + tid * 4, reinterpret_cast<const kiln_u32x4 *>(&sm.kv[0])[tid]);
    // T's blocks, a warp's each (fragment order: afrag_f32's reads); split:
    // the A fragment's hi and lo terms instead, afrag_blk's results.
    for (int b = w; b < 10; b += THREADS / 32) {
        const int bi = b < 1 ? 0 : b < 3 ? 1 : b < 6 ? 2 : 3, bj = b - blk_index(bi, 0);
        float f[8];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float *x = &sm.x.at.t[16 * bi + g4 + (e & 1) * 8][16 * bj + (e >> 1) * 8 + 2 * t4];
            f[2 * e] = x[0];
            f[2 * e + 1] = x[1];
        }
        store_frag(rec + REC_T + b * BLK, lane, f, 1.0f, 1.0f, split);
    }
    // P's blocks from the accumulators of warps 4-7 (n-tiles 2 j, 2 j + 1 of
    // block (mb, j)); split: each row scaled as the keyed kernel's out scales
    // it (its largest |P_ij| into [2^13, 2^14)) before its hi and lo terms,
    // and the row's scale and inverse at REC_S.
    if (isq) {
        float psc[2] = {1.0f, 1.0f}, psci[2];
        if (split) {
            row_scales(acc, psc, psci); // tiles past the diagonal hold zeros
            if (t4 == 0)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    rec[REC_S + mb * 16 + g4 + 8 * e2] = psc[e2];
                    rec[REC_S + C + mb * 16 + g4 + 8 * e2] = psci[e2];
                    rec[REC_B + mb * 16 + g4 + 8 * e2] = sm.beta[0][mb * 16 + g4 + 8 * e2];
                }
        }
#pragma unroll
        for (int np = 0; np < 4; np++)
            if (np <= mb) {
                const float *a0 = acc[2 * np], *a1 = acc[2 * np + 1];
                const float f[8] = {a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]};
                store_frag(rec + REC_P + blk_index(mb, np) * BLK, lane, f, psc[0], psc[1], split);
            }
    }
    return true;
}

// The pre-pass. Without flags (NULL): block (r, h) writes record r of value
// head h (grid x: the records, y: VH; S = seqs), or nothing where r is no
// sequence's. A span past the tokens has no records (the chunked kernel
// reports it). Three blocks an SM (80 registers), so that one's loads and
// barriers hide behind the others' work.
// Streamed (flags: a word a record, (ceil(T / C) + S) VH of them): a grid of
// at most one block an SM deals the records round the blocks, record-major
// (item i = r VH + h, so one sequence's chunks come in order), and sets
// flags[i] once record i is written. It first waits for the kernels ahead,
// clears its own items' flags and only then lets the next kernel (the rows
// kernel, which waits on the flags rather than on this grid) launch, so
// that it runs beside this one: the chain of chunks starts once its first
// record is in, not once the last one is.
extern "C" __global__ void __launch_bounds__(THREADS, 3)
kiln_gated_delta_keys(const kiln_elt *__restrict__ q, const kiln_elt *__restrict__ k, const float *__restrict__ g,
                      const float *__restrict__ beta, const kiln_u32 *__restrict__ spans, float *__restrict__ ws,
                      kiln_u32 tokens, kiln_u32 seqs, kiln_u32 split, kiln_u32 *__restrict__ flags)
{
    kiln_grid_dependency_wait();
    const kiln_u64 items = ((kiln_u64)tokens / C + (tokens % C != 0) + seqs) * KILN_VH;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    keys_smem &sm = *reinterpret_cast<keys_smem *>(smem_raw);
    const bool holds = smem_holds(sizeof(keys_smem));
    if (flags) {
        // Cleared (set where this launch writes nothing, so that no reader
        // waits forever), and the clears performed at the GPU's scope before
        // the rows kernel may launch and poll them. The trigger itself orders
        // no memory: the fence does, as it does for the inputs the prelude's
        // KILN_INPUT_BEFORE_DEPENDENCY_SYNC kernels read before their sync.
        for (kiln_u64 i = blockIdx.x + (kiln_u64)threadIdx.x * gridDim.x; i < items;
             i += (kiln_u64)THREADS * gridDim.x)
            flags[i] = holds ? 0u : 1u;
        __threadfence();
        __syncthreads();
    }
    kiln_grid_launch_dependents();
    if (!holds)
        return;
    if (!flags) {
        (void)keys_record(sm, q, k, g, beta, spans, ws, tokens, seqs, split, blockIdx.x, blockIdx.y);
        return;
    }
    for (kiln_u64 i = blockIdx.x; i < items; i += gridDim.x) {
        const bool wrote =
            keys_record(sm, q, k, g, beta, spans, ws, tokens, seqs, split, (kiln_u32)(i / KILN_VH), i % KILN_VH);
        __syncthreads(); // the record's stores and every read of shared memory, before the flag and the next item
        if (wrote && threadIdx.x == 0)
            flag_release(flags + i);
    }
}

// The rows kernel: the keyed form with each warp owning 16 rows of the state
// for the whole span, so that a chunk needs no barrier but the one that
// hands its inputs over. Every product is the transpose of the keyed
// kernel's (rows of S down the m dimension, tokens across n):
//   Xᵀ = S Kᵀ, Yᵀ = S Qᵀ, Rᵀ = b (vᵀ − e^γ rk Xᵀ), Uᵀ = Rᵀ Tᵀ,
//   outᵀ = e^γ rq Yᵀ + Uᵀ Pᵀ,  S ← e^γ_L S + U'ᵀ K,
// so that one product's accumulators are the next one's A fragments and
// each row's scale (of S, R, U') is the warp's own: the scales and the hi
// and lo terms are the keyed kernel's. It reads split records (see the
// workspace above): T's and P's blocks already in hi and lo terms, whose A
// fragments hold Tᵀ's and Pᵀ's B fragments, P's rows (outᵀ's columns)
// scaled as the keyed kernel scales them, so that no warp splits or scales
// them again (nor, in bf16, rewrites k and q: load_rec). A block is a warp
// to 16 rows (four at 64 rows, two at 32) for a (sequence, value head,
// KILN_ROWS rows). A chunk is then a warp's own
// dependent products rather than the keyed kernel's phases between eight
// barriers. Its results match the keyed kernel's within rounding, not bit
// for bit (the sums run in another order). With a warp a scheduler it is
// latency-bound (a quarter of the issue slots); in two terms it beats the
// keyed kernel where that one needs more than a wave of blocks
// (bench_recurrent's 4 x 1024 and 16 x 256), not on one sequence (1 x 4096,
// 1 x 16384), where a pair of warps to 16 rows, each with half the key dim,
// was slower still; in one term it beats it everywhere.
#define RWARPS (KILN_ROWS / 16)
#define RTHREADS (RWARPS * 32)
#define LDO 24 // elements a row of a warp's output tile (16 columns, +8)
#define KSW (DKP / 16) // k-steps of the key dim
struct rows_smem {
    kiln_f16 k[2][C][LDK], q[2][C][LDK]; // raw (bf16: rewritten as f16, as the keyed kernel does)
    kiln_elt v[2][C][LDV];
    float rec[2][REC_FLOATS]; // the chunk's record: keys, T's blocks, P's blocks, P's row scales, beta
    kiln_elt o[RWARPS][C][LDO]; // a warp's outputs, tokens by its 16 columns, for 16-byte stores
    kiln_u32 red[16];
};

// A bf16 split record's k and q rows (REC_KQ, as the pre-pass rewrote them
// in f16) into stage st's k and q, for load_rec: where NT is a multiple of
// a row's 16-byte copies, a thread's column the same in every row, else a
// bare loop. (f16 loads k and q from the inputs.)
#if KILN_BF16
template <int NT> __device__ __forceinline__ void load_rkq(rows_smem &sm, int st, const float *rec, int tid)
{
    constexpr int KP = DKP / 8, N = 2 * C * KP;
    const kiln_f16 *kq = reinterpret_cast<const kiln_f16 *>(rec + REC_KQ);
    if constexpr (NT % KP == 0 && C % (NT / KP) == 0) {
        constexpr int RS = NT / KP;
        const int p = tid % KP, r0 = tid / KP;
        const kiln_f16 *src = kq + r0 * DKP + p * 8;
#pragma unroll 8
        for (int i = 0; i < C / RS; i++)
            cp16(&sm.k[st][r0 + i * RS][p * 8], src + i * RS * DKP, true);
#pragma unroll 8
        for (int i = 0; i < C / RS; i++)
            cp16(&sm.q[st][r0 + i * RS][p * 8], src + (C + i * RS) * DKP, true);
    } else {
#pragma unroll 4
        for (int i = 0; i < (N + NT - 1) / NT; i++) {
            const int e = tid + i * NT, r = e / KP, p = e % KP;
            if (N % NT == 0 || e < N)
                cp16(r < C ? &sm.k[st][r][p * 8] : &sm.q[st][r - C][p * 8], kq + r * DKP + p * 8, true);
        }
    }
}
#endif

// A split record into stage st by NT threads (tid: 0 .. NT - 1), in 16-byte
// copies: whole, or in one term (no lo terms read) its keys, the hi halves
// of its 20 blocks, P's scales and beta; in bf16 then its k and q rows.
template <int NT> __device__ __forceinline__ void load_rec(rows_smem &sm, int st, const float *rec, int tid)
{
    constexpr int HEAD = REC_T / 4, HALF = BLK / 8, N = LO ? REC_FLOATS / 4 : HEAD + 20 * HALF + 3 * C / 4;
#pragma unroll
    for (int i = 0; i < (N + NT - 1) / NT; i++) {
        const int e = tid + i * NT;
        int at = e; // the copy's place in the record, in 16-byte units
        if (!LO && e >= HEAD)
            at = e < HEAD + 20 * HALF ? HEAD + (e - HEAD) / HALF * (2 * HALF) + (e - HEAD) % HALF : e + 20 * HALF;
        if (N % NT == 0 || e < N)
            cp16(&sm.rec[st][at * 4], rec + at * 4, true);
    }
#if KILN_BF16
    load_rkq<NT>(sm, st, rec, tid);
#endif
}

// The A fragment of a 16 x 16 block whose two n-tiles of accumulators are
// x0 and x1, row g4 scaled by sc[0] and row g4 + 8 by sc[1], as hi and lo terms.
__device__ __forceinline__ void afrag_acc(const float *x0, const float *x1, const float *sc, kiln_u32 *hi,
                                          kiln_u32 *lo)
{
    split2(x0[0] * sc[0], x0[1] * sc[0], hi[0], lo[0]);
    split2(x0[2] * sc[1], x0[3] * sc[1], hi[1], lo[1]);
    split2(x1[0] * sc[0], x1[1] * sc[0], hi[2], lo[2]);
    split2(x1[2] * sc[1], x1[3] * sc[1], hi[3], lo[3]);
}

// acc[2 (I − I0) + j] (n-tiles 2 I + j, I0 <= I < I1) += A Mᵀ over a split
// record's blocks (I, J), J <= I, of a lower block-triangular 64 x 64 matrix
// M (T or P), each its A fragment's hi and lo terms, which hold Mᵀ's B
// fragments (store_frag's order: n-tile 2 I's pair, then 2 I + 1's). A's
// k-step J from afrag(J). Products in hi and lo terms: A hi · M hi, A hi ·
// M lo, A lo · M hi.
template <int I0, int I1, int N, class AF>
__device__ __forceinline__ void tri_products(float (&acc)[N][4], const float *blk, int lane, AF afrag)
{
    static_assert(N == 2 * (I1 - I0), "two n-tiles a block row");
#pragma unroll
    for (int J = 0; J < I1; J++) {
        kiln_u32 ah[4], al[4];
        afrag(J, ah, al);
#pragma unroll
        for (int I = J < I0 ? I0 : J; I < I1; I++) {
            const float *f = blk + blk_index(I, J) * BLK + lane * 4;
            const kiln_u32x4 bh = *reinterpret_cast<const kiln_u32x4 *>(f),
                             bl = *reinterpret_cast<const kiln_u32x4 *>(f + 128);
            float *a0 = acc[2 * (I - I0)], *a1 = acc[2 * (I - I0) + 1];
            mma16816(a0, ah, bh.x, bh.y);
            mma16816(a1, ah, bh.z, bh.w);
            if constexpr (LO) {
                mma16816(a0, ah, bl.x, bl.y);
                mma16816(a0, al, bh.x, bh.y);
                mma16816(a1, ah, bl.z, bl.w);
                mma16816(a1, al, bh.z, bh.w);
            }
        }
    }
}

// acc = S Mᵀ for rows 16 NP0 .. of M (k or q, f16 [C][LDK]), N n-tiles of
// them: S's rows (its n-tiles s, the accumulator layout) times sc as hi and
// lo terms against exact M.
template <int NP0, int N>
__device__ __forceinline__ void state_products(float (&acc)[N][4], const float (&s)[2 * KSW][4], const float *sc,
                                               const kiln_f16 (*M)[LDK], int bn, int bk)
{
    zero_tiles(acc);
#pragma unroll
    for (int ks = 0; ks < KSW; ks++) {
        kiln_u32 ah[4], al[4];
        afrag_acc(s[2 * ks], s[2 * ks + 1], sc, ah, al);
#pragma unroll
        for (int np = 0; np < N / 2; np++) {
            kiln_u32 b[4];
            ldsm4(&M[(NP0 + np) * 16 + bn][ks * 16 + bk], b);
            mma16816(acc[2 * np], ah, b[0], b[1]);
            mma16816(acc[2 * np + 1], ah, b[2], b[3]);
            if constexpr (LO) {
                mma16816(acc[2 * np], al, b[0], b[1]);
                mma16816(acc[2 * np + 1], al, b[2], b[3]);
            }
        }
    }
}

// outᵀ's tokens 32 H .. 32 H + 31 for the warp's rows into its tile O, from
// y, their Yᵀ = S Qᵀ with S's row scale (inverse sinv) not yet undone.
template <int H>
__device__ __forceinline__ void out_finish(kiln_elt (*O)[LDO], float (&y)[4][4], const float *sinv,
                                           const float (&u)[8][4], const float *R, const chunk_keys &kv, int lane)
{
    const int g4 = lane / 4, t4 = lane % 4;
    // The state part, e^γ rq Yᵀ with S's scale undone, in outᵀ's column
    // scales (column i: P's row i's psc_i, as the record's P blocks hold it).
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int b1 = 0; b1 < 2; b1++) {
            const int i = 32 * H + n * 8 + 2 * t4 + b1;
            const float sc = R[REC_S + i] * exp_approx(kv.gam[i]) * kv.rq[i];
            y[n][b1] *= sc * sinv[0];
            y[n][2 + b1] *= sc * sinv[1];
        }
    const float one[2] = {1.0f, 1.0f};
    tri_products<2 * H, 2 * H + 2>(y, R + REC_P, lane, [&](int J, kiln_u32 *ah, kiln_u32 *al) {
        afrag_acc(u[2 * J], u[2 * J + 1], one, ah, al);
    });
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = 32 * H + n * 8 + 2 * t4 + (e & 1);
            O[i][g4 + 8 * (e >> 1)] = kiln_f32_to_elt(y[n][e] * R[REC_S + C + i]);
        }
}

// A warp's tile O to out at obase, the tokens within the span (c: the
// chunk) and the columns within the value dim (col0: the tile's first).
__device__ __forceinline__ void store_tile(kiln_elt (*O)[LDO], kiln_elt *obase, kiln_u32 c, kiln_u32 count, int col0,
                                           int lane)
{
#if KILN_VEC == 8
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const int id = lane + 32 * m, i = id >> 1, part = id & 1;
        if ((kiln_u64)c * C + i < count && col0 + part * 8 < KILN_DV)
            kiln_stg16(obase + (kiln_u64)i * (KILN_VH * KILN_DV) + part * 8,
                       *reinterpret_cast<const kiln_u32x4 *>(&O[i][part * 8]));
    }
#else
#pragma unroll 4
    for (int m = 0; m < 32; m++) {
        const int id = lane + 32 * m, i = id >> 4, col = id & 15;
        if ((kiln_u64)c * C + i < count && col0 + col < KILN_DV)
            obase[(kiln_u64)i * (KILN_VH * KILN_DV) + col] = O[i][col];
    }
#endif
}

// The streamed rows kernel's last warp: the sequence's records (chunk c's
// at rec + c VH REC_STRIDE, its flag at fl[c VH]) into their stages, each
// once its flag is set, while the other warps compute, so that the waits
// stay off their chain; at the block's barrier of the compute loop, one a
// chunk. These barriers are the compute warps' at other call sites, as
// warp-specialized kernels have them; each warp reaches the same count.
// Lane 0 acquires a flag; the warp barrier orders the other lanes' copies
// after it.
__device__ __noinline__ void rows_poll(rows_smem &sm, const kiln_u32 *fl, const float *rec, kiln_u32 chunks,
                                       int lane)
{
    constexpr kiln_u64 REC_STEP = (kiln_u64)KILN_VH * REC_STRIDE;
    if (lane == 0)
        flag_wait(fl);
    syncwarp();
    load_rec<32>(sm, 0, rec, lane);
    cp_commit();
#pragma unroll 1
    for (kiln_u32 c = 0; c < chunks; c++) {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        if (c + 1 < chunks) {
            if (lane == 0)
                flag_wait(fl + (kiln_u64)(c + 1) * KILN_VH);
            syncwarp();
            load_rec<32>(sm, (c + 1) & 1, rec + (c + 1) * REC_STEP, lane);
        }
        cp_commit();
    }
}

// The rows kernel's body (kiln_gated_delta_rows).
__device__ __forceinline__ void rows_run(const kiln_elt *__restrict__ q, const kiln_elt *__restrict__ k,
                                         const kiln_elt *__restrict__ v, float *__restrict__ state,
                                         const kiln_u32 *__restrict__ spans, kiln_elt *__restrict__ out,
                                         kiln_u32 tokens, kiln_fault *fault, const float *__restrict__ ws,
                                         kiln_u32 records, const kiln_u32 *__restrict__ flags)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (!launch_holds(sizeof(rows_smem), RTHREADS + (flags ? 32u : 0u), fault))
        return;
    rows_smem &sm = *reinterpret_cast<rows_smem *>(smem_raw);
    const kiln_u32 rb = blockIdx.x % ROW_BLOCKS, sh = blockIdx.x / ROW_BLOCKS;
    const kiln_u32 h = sh % KILN_VH, seq = sh / KILN_VH, kh = h / GROUP;
    const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, g4 = lane / 4, t4 = lane % 4;
    // The block's first row and the warp's 16 rows within it.
    const int brow = rb * KILN_ROWS, wrow = w * 16;
    kiln_u32 start, count, chunks;
    if (!span_begin(spans, seq, tokens, h == 0 && rb == 0 && tid == 0, fault, start, count, chunks))
        return;
    const float *rec;
    if (!seq_records<RTHREADS>(spans, seq, tokens, chunks, h, ws, records, sm.red, tid, rec))
        return;
    constexpr kiln_u64 REC_STEP = (kiln_u64)KILN_VH * REC_STRIDE;
    // Streamed, the last warp loads the records (record base(seq) + c of
    // head h, chunk c's, has its flag at flags[(base(seq) + c) VH + h]).
    if (flags && tid >= RTHREADS) {
        rows_poll(sm, flags + (rec - ws) / REC_STRIDE, rec, chunks, lane);
        return;
    }
    // k and q: in f16 the inputs; in bf16 the records' (load_rec).
#if KILN_BF16
    (void)q, (void)k, (void)kh;
#else
    load_kq<rows_smem, RTHREADS>(sm, 0, q, k, start, count, 0, kh, tid);
#endif
    load_v<rows_smem, RTHREADS>(sm, 0, v, start, count, 0, h, brow, tid);
    if (!flags)
        load_rec<RTHREADS>(sm, 0, rec, tid);
    cp_commit();

    // The warp's rows of S (rows brow + wrow + g4, + 8), n-tile n the
    // columns 8 n + 2 t4, + 1, in the accumulator layout (zeros past the
    // key dim).
    float s[2 * KSW][4];
    float *srow = state + (kiln_u64)sh * KILN_DV * KILN_DK;
#pragma unroll
    for (int n = 0; n < 2 * KSW; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = brow + wrow + g4 + (e >> 1) * 8, col = n * 8 + 2 * t4 + (e & 1);
            s[n][e] = r < KILN_DV && col < KILN_DK ? __ldcg(srow + (kiln_u64)r * KILN_DK + col) : 0.0f;
        }
    const int bn = (lane & 7) + ((lane >> 4) << 3), bk = ((lane >> 3) & 1) * 8; // B rows (n), k offset
    const int tk = ((lane >> 3) & 1) * 8 + (lane & 7), tn = (lane >> 4) * 8;    // trans B: k row, n offset

#pragma unroll 1
    for (kiln_u32 c = 0; c < chunks; c++) {
        const int st = c & 1;
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads(); // stage st is in; every warp is done with the other
        if (c + 1 < chunks) {
#if !KILN_BF16
            load_kq<rows_smem, RTHREADS>(sm, st ^ 1, q, k, start, count, c + 1, kh, tid);
#endif
            load_v<rows_smem, RTHREADS>(sm, st ^ 1, v, start, count, c + 1, h, brow, tid);
            if (!flags)
                load_rec<RTHREADS>(sm, st ^ 1, rec + (c + 1) * REC_STEP, tid);
        }
        cp_commit();
        const kiln_f16(*K)[LDK] = sm.k[st];
        const kiln_f16(*Q)[LDK] = sm.q[st];
        const float *R = sm.rec[st];
        const chunk_keys &kv = *reinterpret_cast<const chunk_keys *>(R);
        kiln_elt(*O)[LDO] = sm.o[w];

        // Xᵀ = S Kᵀ (Yᵀ = S Qᵀ comes once U is found: fewer live registers),
        // S's rows scaled into [2^13, 2^14) and split into hi and lo terms
        // against exact k and q.
        float ssc[2], sinv[2];
        row_scales(s, ssc, sinv);
        float x[8][4];
        state_products<0>(x, s, ssc, K, bn, bk);
        // Rᵀ = b (vᵀ − e^γ rk Xᵀ), S's scale undone.
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int b1 = 0; b1 < 2; b1++) {
                const int i = n * 8 + 2 * t4 + b1;
                const float fk = exp_approx(kv.gam[i]) * kv.rk[i], bt = R[REC_B + i];
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    const float vv = kiln_elt_to_f32(sm.v[st][i][wrow + g4 + 8 * e2]);
                    x[n][2 * e2 + b1] = bt * (vv - fk * (x[n][2 * e2 + b1] * sinv[e2]));
                }
            }
        // Uᵀ = Rᵀ Tᵀ, R's rows scaled as S's.
        float u[8][4];
        {
            float rsc[2], rinv[2];
            row_scales(x, rsc, rinv);
            zero_tiles(u);
            tri_products<0, 4>(u, R + REC_T, lane, [&](int J, kiln_u32 *ah, kiln_u32 *al) {
                afrag_acc(x[2 * J], x[2 * J + 1], rsc, ah, al);
            });
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    u[n][e] *= rinv[e >> 1];
        }
        // outᵀ = e^γ rq Yᵀ + Uᵀ Pᵀ, P's row i (outᵀ's column i) scaled by a
        // power of two putting its largest |P_ij| in [2^13, 2^14), 32 tokens
        // at a time.
        kiln_elt *obase = out + ((kiln_u64)start + (kiln_u64)c * C) * (KILN_VH * KILN_DV) + h * KILN_DV + brow + wrow;
        {
            float y4[4][4];
            state_products<0>(y4, s, ssc, Q, bn, bk);
            out_finish<0>(O, y4, sinv, u, R, kv, lane);
            state_products<2>(y4, s, ssc, Q, bn, bk);
            out_finish<1>(O, y4, sinv, u, R, kv, lane);
            syncwarp();
            store_tile(O, obase, c, count, brow + wrow, lane);
        }
        syncwarp(); // the tile's reads before the next chunk's writes
        // S = e^γ_L S + U'ᵀ K, U' = e^(γ_L − γ_j) rk_j U_j with each row scaled
        // as S's: S 2^s = e^γ_L S 2^s + (U' 2^s)ᵀ K.
        {
            const float gl = kv.gam[C - 1], gll = kv.gaml[C - 1];
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int b1 = 0; b1 < 2; b1++) {
                    const int j = n * 8 + 2 * t4 + b1;
                    const float d = exp_approx((gl - kv.gam[j]) + (gll - kv.gaml[j])) * kv.rk[j];
                    u[n][b1] *= d;
                    u[n][2 + b1] *= d;
                }
            float usc[2], usci[2];
            row_scales(u, usc, usci);
            const float al = exp_approx(gl);
#pragma unroll
            for (int n = 0; n < 2 * KSW; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[n][e] *= al * usc[e >> 1];
#pragma unroll
            for (int J = 0; J < 4; J++) {
                kiln_u32 ah[4], alo[4];
                afrag_acc(u[2 * J], u[2 * J + 1], usc, ah, alo);
#pragma unroll
                for (int np = 0; np < KSW; np++) {
                    kiln_u32 b[4];
                    ldsm4t(&K[J * 16 + tk][np * 16 + tn], b);
                    mma16816(s[2 * np], ah, b[0], b[1]);
                    mma16816(s[2 * np + 1], ah, b[2], b[3]);
                    if constexpr (LO) {
                        mma16816(s[2 * np], alo, b[0], b[1]);
                        mma16816(s[2 * np + 1], alo, b[2], b[3]);
                    }
                }
            }
#pragma unroll
            for (int n = 0; n < 2 * KSW; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[n][e] *= usci[e >> 1];
        }
    }

    // srow through an empty asm: its addresses are found here, not kept
    // from the loads above across the loop (ptxas spilled them).
    asm("" : "+l"(srow));
#pragma unroll
    for (int n = 0; n < 2 * KSW; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = brow + wrow + g4 + (e >> 1) * 8, col = n * 8 + 2 * t4 + (e & 1);
            if (r < KILN_DV && col < KILN_DK)
                srow[(kiln_u64)r * KILN_DK + col] = s[n][e];
        }
}

// kiln_gated_delta_chunk_keyed's arguments and the streamed pre-pass's flags
// (or NULL); grid S VH ROW_BLOCKS, RTHREADS threads (streamed:
// 32 more, the last warp loading the records), sizeof(rows_smem) of dynamic
// shared memory. Streamed, it launches beside the pre-pass once that
// one has waited for the kernels ahead of it (so it reads its inputs, the
// state and the spans through L2, before any wait of its own), waits on each
// record's flag rather than on the pre-pass's grid, and waits for the
// pre-pass at its end, so that this grid completes only after it (the
// kernels after this one wait on this grid alone).
extern "C" __global__ void __launch_bounds__(RTHREADS + 32, 1)
kiln_gated_delta_rows(const kiln_elt *__restrict__ q, const kiln_elt *__restrict__ k,
                      const kiln_elt *__restrict__ v, const float *__restrict__ g, const float *__restrict__ beta,
                      float *__restrict__ state, const kiln_u32 *__restrict__ spans, kiln_elt *__restrict__ out,
                      kiln_u32 tokens, kiln_fault *fault, const float *__restrict__ ws, kiln_u32 records,
                      const kiln_u32 *__restrict__ flags)
{
    KILN_INPUT_BEFORE_DEPENDENCY_SYNC;
    if (!flags)
        kiln_grid_dependency_sync();
    else
        kiln_grid_launch_dependents();
    (void)g; // g and beta: the keyed kernel's arguments, read by the pre-pass (beta from the records)
    (void)beta;
    rows_run(q, k, v, state, spans, out, tokens, fault, ws, records, flags);
    if (flags)
        kiln_grid_dependency_sync();
}
