// RMSNorm over rows of kiln_elt (f16, or bf16 when KILN_BF16 = 1), f32
// accumulation, one block per row at a time:
//   kiln_rms_norm:          out = x * w / sqrt(mean(x^2) + eps)
//   kiln_rms_norm_residual: h = elt(x + residual); residual = h;
//                           out = h * w / sqrt(mean(h^2) + eps)
//   kiln_rms_norm_residual_parts: the same with x = elt(sum of n_parts f32
//                           partial products, part_stride elements apart): a
//                           product whose K was split (providers/
//                           linear_norm.c), summed here instead of by a
//                           kernel of its own
// (the fused form equals residual_add then rms_norm, bit for bit: h is one
// add rounded to the element type, as residual_add's). One rounding to the
// element type per output. Constants: KILN_BF16, KILN_HIDDEN (row length),
// KILN_VEC (elements per access: 8 = 16-byte vectors, 1 = scalar),
// KILN_THREADS. The row count is a launch argument and block b
// takes rows b, b + grid, ...: one kernel serves every batch. The plain form,
// launched with a grid that fits the device at once, streams: each block's
// next row in flight while it reduces and stores the current one (rows that
// fit in registers; the weight is read once per block). The fused form has
// twice the rows to hold, so it is launched one row per block and holds no
// next row: fewer registers, more blocks per SM (build/bench/bench_norm_argmax,
// rms_norm_residual rotated, shows it). out may be x itself (in place): each
// element is read by the thread that writes it, before it writes it.
#include "kiln_reduce.cuh"

//! kiln:entry kiln_rms_norm
//! kiln:entry kiln_rms_norm_residual
//! kiln:entry kiln_rms_norm_residual_parts

#if KILN_HIDDEN % KILN_VEC != 0
#error "KILN_VEC must divide KILN_HIDDEN"
#endif
#if KILN_THREADS % 32 != 0 || KILN_THREADS > 1024
#error "KILN_THREADS must be a multiple of 32, at most 1024"
#endif
#define VECS (KILN_HIDDEN / KILN_VEC)
#define ITEMS ((VECS + KILN_THREADS - 1) / KILN_THREADS)
#define WARPS (KILN_THREADS / 32)
#define FULL (ITEMS * KILN_THREADS == VECS)
// Rows that fit keep x (and w) in registers; longer rows are read twice.
#define CACHED (ITEMS * (KILN_VEC == 8 ? 4 : 1) <= 16)

#if KILN_VEC == 8
typedef kiln_u32x4 vec_t;
__device__ __forceinline__ vec_t load_nc(const vec_t *p) { return kiln_ldg16(p); }
__device__ __forceinline__ vec_t load_co(const vec_t *p) { return kiln_ld16(p); }
__device__ __forceinline__ void store(vec_t *p, vec_t v) { kiln_stg16(p, v); }
__device__ __forceinline__ void to_f32(vec_t v, float *f) { kiln_e8_to_f32(v, f); }
__device__ __forceinline__ vec_t from_f32(const float *f) { return kiln_f32_to_e8(f); }
#elif KILN_VEC == 1
typedef kiln_elt vec_t;
__device__ __forceinline__ vec_t load_nc(const vec_t *p)
{
    kiln_elt v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ vec_t load_co(const vec_t *p)
{
    kiln_elt v;
    asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void store(vec_t *p, vec_t v) { asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory"); }
__device__ __forceinline__ void to_f32(vec_t v, float *f) { f[0] = kiln_elt_to_f32(v); }
__device__ __forceinline__ vec_t from_f32(const float *f) { return kiln_f32_to_elt(f[0]); }
#else
#error "KILN_VEC must be 8 or 1"
#endif

__device__ __forceinline__ bool in_row(int i, int k) { return FULL || (i < ITEMS - 1) || k < VECS; }

__device__ __forceinline__ float sum_squares(vec_t v)
{
    float f[KILN_VEC], s = 0.0f;
    to_f32(v, f);
#pragma unroll
    for (int e = 0; e < KILN_VEC; e++)
        s += f[e] * f[e];
    return s;
}

// h = elt(x + r) (the value residual keeps): correctly rounded, the same
// bits as templates/residual_add.cu gives (kiln_reduce.cuh's adds).
#if KILN_VEC == 8
__device__ __forceinline__ vec_t add_round(vec_t x, vec_t r) { return kiln_e8_add(x, r); }
#else
__device__ __forceinline__ vec_t add_round(vec_t x, vec_t r) { return kiln_elt_add(x, r); }
#endif

__device__ __forceinline__ vec_t scale(vec_t h, vec_t w, float inv)
{
    float a[KILN_VEC], b[KILN_VEC];
    to_f32(h, a);
    to_f32(w, b);
#pragma unroll
    for (int e = 0; e < KILN_VEC; e++)
        a[e] = a[e] * inv * b[e];
    return from_f32(a);
}

__device__ __forceinline__ float inverse_rms(float sum_sq, float eps)
{
    return 1.0f / kiln_sqrt_rn(sum_sq / (float)KILN_HIDDEN + eps);
}

// Loads row r's part of this thread (CACHED rows).
__device__ __forceinline__ void load_row(vec_t *v, const vec_t *base)
{
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int k = threadIdx.x + i * KILN_THREADS;
        if (in_row(i, k))
            v[i] = load_nc(base + k);
    }
}

extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_rms_norm(const kiln_elt *x, const kiln_elt *__restrict__ weight, kiln_elt *out, float eps, kiln_u32 rows)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    __shared__ float scratch[2][WARPS]; // alternate rows: one __syncthreads per row
    kiln_u32 r = blockIdx.x;
    if (r >= rows)
        return;
    const vec_t *wr = (const vec_t *)weight;
#if CACHED
    vec_t v[ITEMS], w[ITEMS];
    load_row(v, (const vec_t *)(x + (kiln_u64)r * KILN_HIDDEN));
    load_row(w, wr);
    for (int parity = 0;; parity ^= 1) {
        const kiln_u32 next = r + gridDim.x;
        vec_t nv[ITEMS];
        if (next < rows)
            load_row(nv, (const vec_t *)(x + (kiln_u64)next * KILN_HIDDEN));
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int k = threadIdx.x + i * KILN_THREADS;
            if (in_row(i, k))
                ss += sum_squares(v[i]);
        }
        const float inv = inverse_rms(kiln_block_sum<WARPS>(ss, scratch[parity]), eps);
        vec_t *orow = (vec_t *)(out + (kiln_u64)r * KILN_HIDDEN);
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int k = threadIdx.x + i * KILN_THREADS;
            if (in_row(i, k))
                store(orow + k, scale(v[i], w[i], inv));
        }
        if (next >= rows)
            break;
        r = next;
#pragma unroll
        for (int i = 0; i < ITEMS; i++)
            v[i] = nv[i];
    }
#else
    for (int parity = 0; r < rows; r += gridDim.x, parity ^= 1) {
        const vec_t *xr = (const vec_t *)(x + (kiln_u64)r * KILN_HIDDEN);
        vec_t *orow = (vec_t *)(out + (kiln_u64)r * KILN_HIDDEN);
        float ss = 0.0f;
        for (int k = threadIdx.x; k < VECS; k += KILN_THREADS)
            ss += sum_squares(load_nc(xr + k));
        const float inv = inverse_rms(kiln_block_sum<WARPS>(ss, scratch[parity]), eps);
        for (int k = threadIdx.x; k < VECS; k += KILN_THREADS)
            store(orow + k, scale(load_nc(xr + k), load_nc(wr + k), inv));
    }
#endif
}

extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_rms_norm_residual(const kiln_elt *x, kiln_elt *residual, const kiln_elt *__restrict__ weight, kiln_elt *out,
                       float eps, kiln_u32 rows)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    __shared__ float scratch[2][WARPS];
    kiln_u32 r = blockIdx.x;
    if (r >= rows)
        return;
    const vec_t *wr = (const vec_t *)weight;
#if CACHED
    vec_t h[ITEMS], w[ITEMS], res[ITEMS];
    load_row(h, (const vec_t *)(x + (kiln_u64)r * KILN_HIDDEN));
    load_row(res, (const vec_t *)(residual + (kiln_u64)r * KILN_HIDDEN));
    load_row(w, wr);
    for (int parity = 0;; parity ^= 1) {
        const kiln_u32 next = r + gridDim.x;
        vec_t *rr = (vec_t *)(residual + (kiln_u64)r * KILN_HIDDEN), *orow = (vec_t *)(out + (kiln_u64)r * KILN_HIDDEN);
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int k = threadIdx.x + i * KILN_THREADS;
            if (in_row(i, k)) {
                h[i] = add_round(h[i], res[i]);
                store(rr + k, h[i]);
                ss += sum_squares(h[i]);
            }
        }
        const float inv = inverse_rms(kiln_block_sum<WARPS>(ss, scratch[parity]), eps);
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int k = threadIdx.x + i * KILN_THREADS;
            if (in_row(i, k))
                store(orow + k, scale(h[i], w[i], inv));
        }
        if (next >= rows)
            break;
        r = next;
        load_row(h, (const vec_t *)(x + (kiln_u64)r * KILN_HIDDEN));
        load_row(res, (const vec_t *)(residual + (kiln_u64)r * KILN_HIDDEN));
    }
#else
    for (int parity = 0; r < rows; r += gridDim.x, parity ^= 1) {
        const vec_t *xr = (const vec_t *)(x + (kiln_u64)r * KILN_HIDDEN);
        vec_t *rr = (vec_t *)(residual + (kiln_u64)r * KILN_HIDDEN), *orow = (vec_t *)(out + (kiln_u64)r * KILN_HIDDEN);
        float ss = 0.0f;
        for (int k = threadIdx.x; k < VECS; k += KILN_THREADS) {
            const vec_t h = add_round(load_nc(xr + k), load_co(rr + k));
            store(rr + k, h);
            ss += sum_squares(h);
        }
        const float inv = inverse_rms(kiln_block_sum<WARPS>(ss, scratch[parity]), eps);
        // The second pass reads back what this thread stored: a coherent load.
        for (int k = threadIdx.x; k < VECS; k += KILN_THREADS)
            store(orow + k, scale(load_co(rr + k), load_nc(wr + k), inv));
    }
#endif
}

// A part's f32 values at vector k of a row, raw (two 16-byte loads, or one
// float), and their sum into f: the loads of several parts issued before any
// add waits on them.
__device__ __forceinline__ void load_part(kiln_u32x4 *raw, const float *p, int k)
{
#if KILN_VEC == 8
    raw[0] = kiln_ldg16(p + k * 8);
    raw[1] = kiln_ldg16(p + k * 8 + 4);
#else
    raw[0].x = __float_as_uint(__ldg(p + k));
#endif
}

__device__ __forceinline__ void add_part(float *f, const kiln_u32x4 *raw)
{
#if KILN_VEC == 8
    f[0] += __uint_as_float(raw[0].x), f[1] += __uint_as_float(raw[0].y), f[2] += __uint_as_float(raw[0].z);
    f[3] += __uint_as_float(raw[0].w), f[4] += __uint_as_float(raw[1].x), f[5] += __uint_as_float(raw[1].y);
    f[6] += __uint_as_float(raw[1].z), f[7] += __uint_as_float(raw[1].w);
#else
    f[0] += __uint_as_float(raw[0].x);
#endif
}

// One row a block, rows b, b + grid, ...; x = elt(part 0 + part 1 + ...), in
// that order. Rows that fit (CACHED) load the residual and the weight first,
// then the parts two at a time (every load of both in flight before an add
// waits), and keep h in registers; longer rows go a vector at a time and
// read h back from residual (a coherent load).
extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_rms_norm_residual_parts(const float *parts, kiln_u32 n_parts, kiln_u64 part_stride, kiln_elt *residual,
                             const kiln_elt *__restrict__ weight, kiln_elt *out, float eps, kiln_u32 rows)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    __shared__ float scratch[2][WARPS];
    const vec_t *wr = (const vec_t *)weight;
    for (kiln_u32 r = blockIdx.x, parity = 0; r < rows; r += gridDim.x, parity ^= 1) {
        const float *pr = parts + (kiln_u64)r * KILN_HIDDEN;
        vec_t *rr = (vec_t *)(residual + (kiln_u64)r * KILN_HIDDEN), *orow = (vec_t *)(out + (kiln_u64)r * KILN_HIDDEN);
        float ss = 0.0f;
#if CACHED
        float f[ITEMS][KILN_VEC];
        vec_t h[ITEMS], res[ITEMS], w[ITEMS];
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int k = threadIdx.x + i * KILN_THREADS;
#pragma unroll
            for (int e = 0; e < KILN_VEC; e++)
                f[i][e] = 0.0f;
            if (in_row(i, k)) {
                res[i] = load_co(rr + k);
                w[i] = load_nc(wr + k);
            }
        }
        for (kiln_u32 q = 0; q < n_parts; q += 2) {
            const bool two = q + 1 < n_parts;
            const float *p0 = pr + q * part_stride, *p1 = p0 + part_stride;
            kiln_u32x4 a[ITEMS][2], b[ITEMS][2];
#pragma unroll
            for (int i = 0; i < ITEMS; i++) {
                const int k = threadIdx.x + i * KILN_THREADS;
                if (in_row(i, k)) {
                    load_part(a[i], p0, k);
                    if (two)
                        load_part(b[i], p1, k);
                }
            }
#pragma unroll
            for (int i = 0; i < ITEMS; i++) {
                const int k = threadIdx.x + i * KILN_THREADS;
                if (in_row(i, k)) {
                    add_part(f[i], a[i]);
                    if (two)
                        add_part(f[i], b[i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int k = threadIdx.x + i * KILN_THREADS;
            if (in_row(i, k)) {
                h[i] = add_round(from_f32(f[i]), res[i]);
                store(rr + k, h[i]);
                ss += sum_squares(h[i]);
            }
        }
        const float inv = inverse_rms(kiln_block_sum<WARPS>(ss, scratch[parity]), eps);
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int k = threadIdx.x + i * KILN_THREADS;
            if (in_row(i, k))
                store(orow + k, scale(h[i], w[i], inv));
        }
#else
        for (int k = threadIdx.x; k < VECS; k += KILN_THREADS) {
            float f[KILN_VEC];
#pragma unroll
            for (int e = 0; e < KILN_VEC; e++)
                f[e] = 0.0f;
            for (kiln_u32 q = 0; q < n_parts; q++) {
                kiln_u32x4 raw[2];
                load_part(raw, pr + q * part_stride, k);
                add_part(f, raw);
            }
            const vec_t h = add_round(from_f32(f), load_co(rr + k));
            store(rr + k, h);
            ss += sum_squares(h);
        }
        const float inv = inverse_rms(kiln_block_sum<WARPS>(ss, scratch[parity]), eps);
        for (int k = threadIdx.x; k < VECS; k += KILN_THREADS)
            store(orow + k, scale(load_co(rr + k), load_nc(wr + k), inv));
#endif
    }
}
