/* What the hosts of kiln's TMA kernels share (providers/tma.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "providers/tma.h"

#define MAX_STAGES 7 /* of 32 KiB at Llama-3-8B's sizes: 224 KiB with the alignment slack */

void *kiln__tma_calloc(size_t size)
{
    const size_t align = _Alignof(CUtensorMap) > 64 ? _Alignof(CUtensorMap) : 64;
    void *p = aligned_alloc(align, (size + align - 1) / align * align);
    if (p)
        memset(p, 0, size);
    return p;
}

int kiln__tma_applies(kiln_runtime *rt, int64_t tokens, int64_t in, int64_t k_parts, uint64_t dx, uint64_t dw)
{
    const char *env = getenv("KILN_TMA");
    if (env && !strcmp(env, "0"))
        return 0;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    if (kiln__arch_number(info.arch) < 90 || info.multiprocessors < 1 || k_parts < 1)
        return 0;
    return tokens >= KILN__TMA_MIN_TOKENS && tokens <= KILN__TMA_MAX_TOKENS && in % (KILN__TMA_K * k_parts) == 0 &&
           in <= INT32_MAX && (dx | dw) % 16 == 0;
}

kiln_status kiln__tma_map(kiln_runtime *rt, const char *op, kiln_dtype elt, CUtensorMap *m, CUdeviceptr base,
                          int64_t k, int64_t rows, unsigned box_rows)
{
    const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)k * 2};
    const cuuint32_t box[2] = {KILN__TMA_K, box_rows}, es[2] = {1, 1};
    const CUtensorMapDataType type =
        elt == KILN_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    CUresult r = kiln__tensor_map_encode_tiled(
        rt, m, type, 2, (void *)base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r == CUDA_SUCCESS)
        return KILN_OK;
    char what[96];
    snprintf(what, sizeof what, "cuTensorMapEncodeTiled (%s)", op);
    return kiln__runtime_cu_fail(rt, r, what);
}

CUresult kiln__tma_fit_stages(kiln_runtime *rt, CUfunction fn, unsigned stage_bytes, uint32_t most, uint32_t *stages,
                              unsigned *smem)
{
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    *smem = 2 * stage_bytes + 1024u;
    for (*stages = most; *stages >= 2; (*stages)--) {
        *smem = *stages * stage_bytes + 1024u;
        r = kiln__function_set_attribute(rt, fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)*smem);
        if (r != CUDA_ERROR_INVALID_VALUE)
            break;
    }
    return r;
}

kiln_status kiln__tma_prepare(kiln_runtime *rt, const char *op, CUfunction fn, kiln_dtype elt, CUdeviceptr w,
                              int64_t w_rows, unsigned box_rows, CUdeviceptr x, int64_t tokens, int64_t in,
                              unsigned stage_bytes, unsigned warps, unsigned grid, CUdeviceptr out, kiln__tma *t)
{
    t->rt = rt;
    t->fn = fn;
    t->out = out;
    t->tokens = (uint32_t)tokens;
    t->grid = grid;
    t->threads = 32 * (warps + 1);
    /* As many stages as the device's shared memory takes, all of them
     * requested before the dependency sync. */
    const CUresult r = kiln__tma_fit_stages(rt, fn, stage_bytes, MAX_STAGES, &t->stages, &t->smem);
    if (r != CUDA_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "cuFuncSetAttribute (%s TMA shared memory)", op);
        return kiln__runtime_cu_fail(rt, r, what);
    }
    t->pre = t->stages;
    kiln_status st = kiln__tma_map(rt, op, elt, &t->w, w, in, w_rows, box_rows);
    return st ? st : kiln__tma_map(rt, op, elt, &t->x, x, in, tokens, 32);
}

kiln_status kiln__tma_enqueue(const kiln__tma *t, const kiln_launch_context *ctx)
{
    const void *args[] = {&t->w, &t->x, &t->out, &t->tokens, &t->stages, &t->pre};
    const unsigned grid[3] = {t->grid, 1, 1};
    return kiln__launch_ex(ctx, t->rt, t->fn, grid, t->threads, t->smem, (void **)args, KILN__LAUNCH_PDL);
}

void kiln__tma_params(const kiln__tma *t, CUdeviceptr w, CUdeviceptr x, int64_t in, uint64_t params[KILN__TMA_PARAMS])
{
    params[0] = w;
    params[1] = x;
    params[2] = t->out;
    params[3] = (uint64_t)in;
    params[4] = t->tokens;
    params[5] = ((uint64_t)t->grid << 32) | t->threads;
    params[6] = ((uint64_t)t->stages << 32) | t->pre;
    params[7] = t->smem;
}
