/* kiln's TMA kernels for 9 to 32 tokens on sm_90 (templates/kiln_tma.cuh):
 * the dense SwiGLU (templates/tma_swiglu.cu, providers/swiglu.c) and the
 * dense linear as f32 parts (templates/tma_linear.cu, providers/
 * linear_norm.c). What their hosts share: when they apply, the tensor maps,
 * the stages the device's shared memory takes, the launch. */
#ifndef KILN_PROVIDERS_TMA_H
#define KILN_PROVIDERS_TMA_H

#include "providers/internal.h"

#define KILN__TMA_MIN_TOKENS 9
#define KILN__TMA_MAX_TOKENS 32
#define KILN__TMA_MAX_WARPS 31 /* consumer warps; one more produces */
#define KILN__TMA_K 64         /* K per stage: one 128-byte swizzle row of 16-bit elements */
#define KILN__TMA_MAX_BOX 256  /* rows of a TMA box (cuTensorMapEncodeTiled's limit) */

/* A 2-D map of 16-bit elements (elt: f16 or bf16; the swizzle and the boxes
 * depend on the size only, the type tells the TMA unit what it copies):
 * rows of k elements at base, boxes of 64 x box_rows, 128-byte swizzle. op
 * names the caller in errors. */
kiln_status kiln__tma_map(kiln_runtime *rt, const char *op, kiln_dtype elt, CUtensorMap *m, CUdeviceptr base,
                          int64_t k, int64_t rows, unsigned box_rows);

/* Sets fn's dynamic shared memory limit for the most stages of stage_bytes,
 * from most down to 2, that the device takes (stages x stage_bytes and 1024
 * bytes of alignment slack; the driver refuses more than its opt-in limit
 * less the kernel's static bytes). Fills *stages and *smem (on failure the
 * last size tried); returns the driver's result. */
CUresult kiln__tma_fit_stages(kiln_runtime *rt, CUfunction fn, unsigned stage_bytes, uint32_t most, uint32_t *stages,
                              unsigned *smem);

/* A prepared launch: the kernel's parameters are the two maps, out, tokens,
 * stages, pre. Aligned as CUtensorMap wants: allocate a struct holding it
 * with kiln__tma_calloc. */
typedef struct kiln__tma {
    CUtensorMap w, x;
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr out;
    uint32_t tokens, stages, pre;
    unsigned grid, threads, smem;
} kiln__tma;

/* Zeroed memory aligned for a struct holding a kiln__tma (free() frees it). */
void *kiln__tma_calloc(size_t size);
/* Whether prewarm for arch (NULL: the default, sm_90) lists the TMA kernels:
 * from sm_90 on, as kiln__tma_applies takes them. */
static inline int kiln__tma_arch(const char *arch)
{
    return !arch || kiln__arch_number(arch) >= 90;
}

/* Whether a TMA kernel may serve tokens rows of x [tokens, in] by a weight at
 * dw: sm_90 or later, $KILN_TMA not "0", 9 to 32 tokens, in a multiple of
 * 64 x k_parts, x and the weight 16-byte aligned. */
int kiln__tma_applies(kiln_runtime *rt, int64_t tokens, int64_t in, int64_t k_parts, uint64_t dx, uint64_t dw);
/* Fills t for fn: the weight's map ([w_rows, in], boxes of box_rows rows),
 * x's ([tokens, in], boxes of 32 rows), both of elements elt (f16 or bf16), grid blocks of 32 (warps + 1)
 * threads, as many stages of stage_bytes as the device takes (2 to 7), all
 * requested before the dependency sync. op names the caller in errors. */
kiln_status kiln__tma_prepare(kiln_runtime *rt, const char *op, CUfunction fn, kiln_dtype elt, CUdeviceptr w,
                              int64_t w_rows, unsigned box_rows, CUdeviceptr x, int64_t tokens, int64_t in,
                              unsigned stage_bytes, unsigned warps, unsigned grid, CUdeviceptr out, kiln__tma *t);
kiln_status kiln__tma_enqueue(const kiln__tma *t, const kiln_launch_context *ctx);
/* The launch as replay-key words: the maps' addresses and sizes, out, the shape. */
#define KILN__TMA_PARAMS 8
void kiln__tma_params(const kiln__tma *t, CUdeviceptr w, CUdeviceptr x, int64_t in, uint64_t params[KILN__TMA_PARAMS]);

#endif
