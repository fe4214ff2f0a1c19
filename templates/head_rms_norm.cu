// Per-head RMSNorm of q and k (Qwen3's q_norm / k_norm) over kiln_elt (f16,
// or bf16 when KILN_BF16 = 1), f32 accumulation, one rounding per output:
//   v = v * w / sqrt(mean(v^2) + eps) for every head vector v of head_dim
// elements; each token's KILN_HEADS q heads take q_weight and its
// KILN_KV_HEADS k heads k_weight. q and k are row bases with their own row
// strides (elements): one fused q | k | v row (k = q + heads * head_dim, both
// strides the row's; v is never touched), or separate tensors. A group of
// LANES lanes (a power of two, at most a warp) holds one head vector, VEC
// elements a lane per item (16-byte vectors when VEC = 8), and sums with
// shuffles inside the group: no shared memory, no barrier. Blocks take
// GROUPS head vectors at a time, strided over the grid; the token count is a
// launch argument. Constants: KILN_BF16, KILN_HEAD_DIM, KILN_HEADS,
// KILN_KV_HEADS, KILN_VEC (8 or 1), KILN_THREADS. out may be the input (in
// place): each element is read by the thread that writes it, before it
// writes it.
#include "kiln_reduce.cuh"

//! kiln:entry kiln_head_rms_norm

#if KILN_HEAD_DIM % KILN_VEC != 0
#error "KILN_VEC must divide KILN_HEAD_DIM"
#endif
#if KILN_THREADS % 32 != 0 || KILN_THREADS > 1024
#error "KILN_THREADS must be a multiple of 32, at most 1024"
#endif
#define VECS (KILN_HEAD_DIM / KILN_VEC)
#define LANES (VECS > 16 ? 32 : VECS > 8 ? 16 : VECS > 4 ? 8 : VECS > 2 ? 4 : VECS > 1 ? 2 : 1)
#define ITEMS ((VECS + LANES - 1) / LANES)
#define GROUPS (KILN_THREADS / LANES)
#define NORMED (KILN_HEADS + KILN_KV_HEADS)

// A lane's item: KILN_VEC elements, loaded (non-coherent: nothing this
// kernel writes is read by another thread), widened, and stored rounded.
#if KILN_VEC == 8
__device__ __forceinline__ void load_f32(const kiln_elt *p, float *f) { kiln_e8_to_f32(kiln_ldg16(p), f); }
__device__ __forceinline__ void store_f32(kiln_elt *p, const float *f) { kiln_stg16(p, kiln_f32_to_e8(f)); }
#elif KILN_VEC == 1
__device__ __forceinline__ void load_f32(const kiln_elt *p, float *f)
{
    kiln_elt v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    f[0] = kiln_elt_to_f32(v);
}
__device__ __forceinline__ void store_f32(kiln_elt *p, const float *f)
{
    asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(kiln_f32_to_elt(f[0])) : "memory");
}
#else
#error "KILN_VEC must be 8 or 1"
#endif

extern "C" __global__ void __launch_bounds__(KILN_THREADS)
kiln_head_rms_norm(const kiln_elt *q, const kiln_elt *k, kiln_elt *q_out, kiln_elt *k_out,
                   const kiln_elt *__restrict__ q_weight, const kiln_elt *__restrict__ k_weight, kiln_u64 q_stride,
                   kiln_u64 k_stride, float eps, kiln_u32 rows)
{
    kiln_grid_dependency_sync(); // first: see kiln_prelude.cuh
    const int lane = threadIdx.x % LANES;
    const kiln_u64 total = (kiln_u64)rows * NORMED;
    // The loop is uniform over the block: every lane of a warp reaches the
    // shuffles, those of a group past the end with zeros.
    for (kiln_u64 base = (kiln_u64)blockIdx.x * GROUPS; base < total; base += (kiln_u64)gridDim.x * GROUPS) {
        const kiln_u64 g = base + threadIdx.x / LANES;
        const bool live = g < total;
        const kiln_u64 t = g / NORMED;
        const kiln_u32 h = (kiln_u32)(g % NORMED);
        const bool is_q = h < KILN_HEADS;
        const kiln_u64 off = is_q ? t * q_stride + (kiln_u64)h * KILN_HEAD_DIM
                                  : t * k_stride + (kiln_u64)(h - KILN_HEADS) * KILN_HEAD_DIM;
        const kiln_elt *src = (is_q ? q : k) + off, *w = is_q ? q_weight : k_weight;
        kiln_elt *dst = (is_q ? q_out : k_out) + off;
        float v[ITEMS][KILN_VEC], ss = 0.0f;
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int e = (lane + i * LANES) * KILN_VEC;
            if (live && e < KILN_HEAD_DIM) {
                load_f32(src + e, v[i]);
#pragma unroll
                for (int j = 0; j < KILN_VEC; j++)
                    ss += v[i][j] * v[i][j];
            }
        }
#pragma unroll
        for (int m = LANES / 2; m; m >>= 1)
            ss += kiln_shfl_xor_f32(ss, m);
        const float inv = 1.0f / kiln_sqrt_rn(ss / (float)KILN_HEAD_DIM + eps);
#pragma unroll
        for (int i = 0; i < ITEMS; i++) {
            const int e = (lane + i * LANES) * KILN_VEC;
            if (live && e < KILN_HEAD_DIM) {
                float wf[KILN_VEC];
                load_f32(w + e, wf);
#pragma unroll
                for (int j = 0; j < KILN_VEC; j++)
                    v[i][j] = v[i][j] * inv * wf[j];
                store_f32(dst + e, v[i]);
            }
        }
    }
}
