/* The device interface of runtime/device.h: function lookup, attributes and
 * occupancy, launches, tensor maps, scratch memory and the timer. */
#include <stdlib.h>

#include "runtime/internal.h"

kiln_status kiln__module_function(kiln_runtime *rt, CUmodule module, const char *name, CUfunction *out)
{
    CUresult r = rt->d->cuModuleGetFunction(out, module, name);
    return r == CUDA_SUCCESS ? KILN_OK : kiln__cuda_fail(NULL, r, "cuModuleGetFunction");
}

CUresult kiln__function_set_attribute(kiln_runtime *rt, CUfunction fn, CUfunction_attribute attr, int value)
{
    /* The dynamic shared memory limit is the function's, shared by every
     * command that launches it: a command asking for less than an earlier
     * one must not take the earlier one's launches away. */
    int now = 0;
    if (attr == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES &&
        rt->d->cuFuncGetAttribute(&now, attr, fn) == CUDA_SUCCESS && value <= now)
        return CUDA_SUCCESS;
    return rt->d->cuFuncSetAttribute(fn, attr, value);
}

int kiln__function_blocks_per_sm(kiln_runtime *rt, CUfunction fn, unsigned threads, unsigned shared_bytes)
{
    int per_sm = 0;
    if (kiln__runtime_enter(rt) ||
        rt->d->cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, (int)threads, shared_bytes) != CUDA_SUCCESS ||
        per_sm < 1)
        return 0;
    return per_sm;
}

/* Registers a block of fn takes: per warp, its threads' count rounded up to
 * the allocation unit of 8 (sm_70 and later), 32 lanes each. */
static int block_registers(kiln_runtime *rt, CUfunction fn, unsigned threads, int *smem)
{
    int regs = 0;
    if (rt->d->cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, fn) != CUDA_SUCCESS ||
        rt->d->cuFuncGetAttribute(smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn) != CUDA_SUCCESS || regs < 1)
        return -1;
    return (int)((threads + 31) / 32) * 32 * ((regs + 7) / 8 * 8);
}

size_t kiln__function_pair_shared_bytes(kiln_runtime *rt, CUfunction a, unsigned threads_a, CUfunction b,
                                        unsigned threads_b)
{
    int sm_smem = 0, reserved = 0, sm_regs = 0, sm_threads = 0, smem_a = 0, smem_b = 0;
    if (kiln__runtime_enter(rt) ||
        rt->d->cuDeviceGetAttribute(&sm_smem, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, rt->dev) ||
        rt->d->cuDeviceGetAttribute(&reserved, CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK, rt->dev) ||
        rt->d->cuDeviceGetAttribute(&sm_regs, CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, rt->dev) ||
        rt->d->cuDeviceGetAttribute(&sm_threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, rt->dev))
        return 0;
    const int ra = block_registers(rt, a, threads_a, &smem_a), rb = block_registers(rt, b, threads_b, &smem_b);
    if (ra < 0 || rb < 0 || (int64_t)ra + rb > sm_regs || (int64_t)threads_a + threads_b > sm_threads)
        return 0;
    const int64_t left = (int64_t)sm_smem - 2 * (int64_t)reserved - smem_a - smem_b;
    return left > 0 ? (size_t)left : 0;
}

int kiln__function_clusters(kiln_runtime *rt, CUfunction fn, unsigned cluster_x, unsigned block_x,
                            unsigned shared_bytes, unsigned flags)
{
    CUlaunchAttribute attr = {.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION};
    attr.value.clusterDim.x = cluster_x;
    attr.value.clusterDim.y = attr.value.clusterDim.z = 1;
    const int declared = (flags & KILN__CLUSTER_DECLARED) != 0;
    CUlaunchConfig cfg = {.gridDimX = cluster_x, .gridDimY = 1, .gridDimZ = 1, .blockDimX = block_x,
                          .blockDimY = 1, .blockDimZ = 1, .sharedMemBytes = shared_bytes,
                          .attrs = declared ? NULL : &attr, .numAttrs = declared ? 0 : 1};
    int clusters = 0;
    return rt->d->cuOccupancyMaxActiveClusters(&clusters, fn, &cfg) == CUDA_SUCCESS ? clusters : 0;
}

kiln_status kiln__launch_cluster(const kiln_launch_context *ctx, kiln_runtime *rt, CUfunction fn,
                                 const unsigned grid[3], unsigned cluster_x, unsigned block_x, unsigned shared_bytes,
                                 void **args, unsigned flags)
{
    CUlaunchAttribute attr[2] = {{0}};
    unsigned n = 0;
    if (cluster_x > 1) {
        attr[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attr[n].value.clusterDim.x = cluster_x;
        attr[n].value.clusterDim.y = attr[n].value.clusterDim.z = 1;
        n++;
    }
    if ((flags & KILN__LAUNCH_PDL) && rt->pdl) {
        attr[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr[n].value.programmaticStreamSerializationAllowed = 1;
        n++;
    }
    CUresult r;
    if (n) {
        CUlaunchConfig cfg = {.gridDimX = grid[0], .gridDimY = grid[1], .gridDimZ = grid[2], .blockDimX = block_x,
                              .blockDimY = 1, .blockDimZ = 1, .sharedMemBytes = shared_bytes,
                              .hStream = ctx->stream, .attrs = attr, .numAttrs = n};
        r = rt->d->cuLaunchKernelEx(&cfg, fn, args, NULL);
    } else {
        r = rt->d->cuLaunchKernel(fn, grid[0], grid[1], grid[2], block_x, 1, 1, shared_bytes, ctx->stream, args, NULL);
    }
    return r == CUDA_SUCCESS ? KILN_OK
                             : kiln__runtime_cu_fail(rt, r, n ? "cuLaunchKernelEx" : "cuLaunchKernel");
}

kiln_status kiln__launch_ex(const kiln_launch_context *ctx, kiln_runtime *rt, CUfunction fn, const unsigned grid[3],
                            unsigned block_x, unsigned shared_bytes, void **args, unsigned flags)
{
    return kiln__launch_cluster(ctx, rt, fn, grid, 1, block_x, shared_bytes, args, flags);
}

kiln_status kiln__launch(const kiln_launch_context *ctx, kiln_runtime *rt, CUfunction fn, unsigned grid_x,
                         unsigned block_x, unsigned shared_bytes, void **args)
{
    /* Every kiln template calls kiln_grid_dependency_sync() first thing. */
    const unsigned grid[3] = {grid_x, 1, 1};
    return kiln__launch_ex(ctx, rt, fn, grid, block_x, shared_bytes, args, KILN__LAUNCH_PDL);
}

CUresult kiln__tensor_map_encode_tiled(kiln_runtime *rt, CUtensorMap *map, CUtensorMapDataType type, cuuint32_t rank,
                                       void *base, const cuuint64_t *dims, const cuuint64_t *strides,
                                       const cuuint32_t *box, const cuuint32_t *element_strides,
                                       CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                       CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob)
{
    return rt->d->cuTensorMapEncodeTiled(map, type, rank, base, dims, strides, box, element_strides, interleave,
                                         swizzle, l2, oob);
}

CUresult kiln__device_alloc(kiln_runtime *rt, CUdeviceptr *out, size_t bytes)
{
    CUresult r = rt->d->cuMemAlloc(out, bytes);
    if (r != CUDA_SUCCESS)
        *out = 0;
    return r;
}

void kiln__device_free(kiln_runtime *rt, CUdeviceptr p)
{
    if (p)
        rt->d->cuMemFree(p);
}

/* ---- the timer ---- */

struct kiln__device_timer {
    kiln_runtime *rt;
    CUstream stream;
    CUevent start, end;
};

CUresult kiln__device_timer_create(kiln_runtime *rt, kiln__device_timer **out)
{
    *out = NULL;
    /* A runtime without a driver (the CPU tests' fake one) has nothing to time. */
    if (!rt->d || kiln__runtime_enter(rt))
        return CUDA_ERROR_NOT_INITIALIZED;
    kiln__device_timer *t = calloc(1, sizeof *t);
    if (!t)
        return CUDA_ERROR_OUT_OF_MEMORY;
    t->rt = rt;
    /* A failed create leaves its handle NULL: destroy frees what was made. */
    CUresult r;
    if ((r = rt->d->cuStreamCreate(&t->stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS ||
        (r = rt->d->cuEventCreate(&t->start, CU_EVENT_DEFAULT)) != CUDA_SUCCESS ||
        (r = rt->d->cuEventCreate(&t->end, CU_EVENT_DEFAULT)) != CUDA_SUCCESS) {
        kiln__device_timer_destroy(t);
        return r;
    }
    *out = t;
    return CUDA_SUCCESS;
}

void kiln__device_timer_destroy(kiln__device_timer *t)
{
    if (!t)
        return;
    const kiln__driver *d = t->rt->d;
    if (t->stream)
        d->cuStreamSynchronize(t->stream);
    if (t->start)
        d->cuEventDestroy(t->start);
    if (t->end)
        d->cuEventDestroy(t->end);
    if (t->stream)
        d->cuStreamDestroy(t->stream);
    free(t);
}

CUstream kiln__device_timer_stream(const kiln__device_timer *t) { return t->stream; }

CUresult kiln__device_timer_fill(kiln__device_timer *t, CUdeviceptr p, unsigned char value, size_t bytes)
{
    return t->rt->d->cuMemsetD8Async(p, value, bytes, t->stream);
}

CUresult kiln__device_timer_start(kiln__device_timer *t) { return t->rt->d->cuEventRecord(t->start, t->stream); }

CUresult kiln__device_timer_stop(kiln__device_timer *t, float *ms)
{
    const kiln__driver *d = t->rt->d;
    CUresult r;
    if ((r = d->cuEventRecord(t->end, t->stream)) != CUDA_SUCCESS ||
        (r = d->cuEventSynchronize(t->end)) != CUDA_SUCCESS)
        return r;
    return d->cuEventElapsedTime(ms, t->start, t->end);
}

CUresult kiln__device_timer_sync(kiln__device_timer *t) { return t->rt->d->cuStreamSynchronize(t->stream); }
