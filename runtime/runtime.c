/* The runtime: one device's primary context, one stream, buffers, module
 * loading, launches and the device fault record. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fault.h"
#include "runtime/internal.h"

struct kiln_runtime {
    const kiln__driver *d;
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    CUdeviceptr fault; /* one kiln__fault */
    kiln_runtime_info info;
    kiln_status broken; /* a sticky device error: every later call fails with it */
    kiln__errslot err;
};

struct kiln_buffer {
    kiln_runtime *rt;
    CUdeviceptr base; /* what cuMemAlloc returned */
    CUdeviceptr ptr;  /* base rounded up to the alignment */
    size_t size;
};

static int is_sticky(kiln_status st)
{
    return st == KILN_ERR_CUDA_ILLEGAL_ADDRESS || st == KILN_ERR_CUDA_INVALID_CONTEXT;
}

/* Records a driver failure; a sticky one breaks the runtime for good. */
static kiln_status cu_fail(kiln_runtime *rt, CUresult r, const char *what)
{
    kiln_status st = kiln__cuda_fail(&rt->err, r, what);
    if (is_sticky(st) && !rt->broken)
        rt->broken = st;
    return st;
}

static kiln_status check_usable(kiln_runtime *rt)
{
    if (rt->broken)
        return kiln__fail(&rt->err, rt->broken,
                          "the runtime on device %d failed earlier (%s) and can only be destroyed",
                          rt->info.device_ordinal, kiln_status_code(rt->broken));
    return KILN_OK;
}

kiln_status kiln__runtime_enter(kiln_runtime *rt)
{
    kiln_status st = check_usable(rt);
    if (st)
        return st;
    CUcontext cur = NULL;
    if (rt->d->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == rt->ctx)
        return KILN_OK;
    CUresult r = rt->d->cuCtxSetCurrent(rt->ctx);
    return r == CUDA_SUCCESS ? KILN_OK : cu_fail(rt, r, "cuCtxSetCurrent");
}

kiln__errslot *kiln__runtime_errslot(kiln_runtime *rt) { return &rt->err; }
const kiln__driver *kiln__runtime_driver(const kiln_runtime *rt) { return rt->d; }
CUstream kiln__runtime_stream(const kiln_runtime *rt) { return rt->stream; }
CUdeviceptr kiln__runtime_fault(const kiln_runtime *rt) { return rt->fault; }

kiln_status kiln_runtime_create(const kiln_runtime_options *opts, kiln_runtime **out)
{
    const char *why = NULL;
    kiln_runtime_options def = {0};
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_runtime_create: out is NULL");
    *out = NULL;
    if (!opts)
        opts = &def;
    const kiln__driver *d = kiln__driver_get(&why);
    if (!d)
        return kiln__fail(NULL, KILN_ERR_NO_DEVICE, "no device: %s", why);
    int count = 0;
    CUresult r = d->cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS)
        return kiln__cuda_fail(NULL, r, "cuDeviceGetCount");
    if (opts->device_ordinal < 0 || opts->device_ordinal >= count)
        return kiln__fail(NULL, KILN_ERR_NO_DEVICE, "no device: ordinal %d requested, %d device(s) present",
                          opts->device_ordinal, count);
    kiln_runtime *rt = calloc(1, sizeof *rt);
    if (!rt)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln__errslot_init(&rt->err);
    rt->d = d;
    kiln_status st;
    int major = 0, minor = 0;
    size_t total = 0;
    if ((r = d->cuDeviceGet(&rt->dev, opts->device_ordinal)) != CUDA_SUCCESS ||
        (r = d->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, rt->dev)) != CUDA_SUCCESS ||
        (r = d->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, rt->dev)) != CUDA_SUCCESS ||
        (r = d->cuDeviceGetAttribute(&rt->info.multiprocessors, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, rt->dev)) !=
            CUDA_SUCCESS ||
        (r = d->cuDeviceTotalMem(&total, rt->dev)) != CUDA_SUCCESS ||
        (r = d->cuDeviceGetName(rt->info.name, sizeof rt->info.name, rt->dev)) != CUDA_SUCCESS ||
        (r = d->cuDriverGetVersion(&rt->info.driver_version)) != CUDA_SUCCESS) {
        st = kiln__cuda_fail(NULL, r, "querying the device");
        goto out_free;
    }
    rt->info.device_ordinal = opts->device_ordinal;
    rt->info.total_memory = total;
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_%d%d", major, minor);
    if ((r = d->cuDevicePrimaryCtxRetain(&rt->ctx, rt->dev)) != CUDA_SUCCESS) {
        rt->ctx = NULL;
        st = kiln__cuda_fail(NULL, r, "cuDevicePrimaryCtxRetain");
        goto out_free;
    }
    if ((r = d->cuCtxSetCurrent(rt->ctx)) != CUDA_SUCCESS ||
        (r = d->cuStreamCreate(&rt->stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
        rt->stream = NULL;
        st = kiln__cuda_fail(NULL, r, "creating the stream");
        goto out_free;
    }
    if ((r = d->cuMemAlloc(&rt->fault, sizeof(kiln__fault))) != CUDA_SUCCESS) {
        rt->fault = 0;
        st = kiln__cuda_fail(NULL, r, "allocating the fault record");
        goto out_free;
    }
    kiln__fault clean = {.first = UINT64_MAX};
    if ((r = d->cuMemcpyHtoD(rt->fault, &clean, sizeof clean)) != CUDA_SUCCESS) {
        st = kiln__cuda_fail(NULL, r, "clearing the fault record");
        goto out_free;
    }
    *out = rt;
    return KILN_OK;
out_free:
    kiln_runtime_destroy(rt);
    return st;
}

void kiln_runtime_destroy(kiln_runtime *rt)
{
    if (!rt)
        return;
    if (rt->ctx) {
        rt->d->cuCtxSetCurrent(rt->ctx);
        if (rt->stream)
            rt->d->cuStreamSynchronize(rt->stream);
        if (rt->fault)
            rt->d->cuMemFree(rt->fault);
        if (rt->stream)
            rt->d->cuStreamDestroy(rt->stream);
        rt->d->cuDevicePrimaryCtxRelease(rt->dev);
    }
    kiln__errslot_destroy(&rt->err);
    free(rt);
}

void kiln_runtime_get_info(const kiln_runtime *rt, kiln_runtime_info *out)
{
    if (out)
        *out = rt ? rt->info : (kiln_runtime_info){0};
}

const char *kiln_runtime_errmsg(const kiln_runtime *rt) { return rt ? rt->err.msg : ""; }

/* Turns a fault a kernel recorded into an error naming it, and clears it. */
static kiln_status fault_to_error(kiln_runtime *rt, const kiln__fault *f)
{
    uint32_t index = (uint32_t)(f->first >> 32), value = (uint32_t)f->first;
    kiln__fault clean = {.first = UINT64_MAX};
    CUresult r = rt->d->cuMemcpyHtoD(rt->fault, &clean, sizeof clean);
    if (r != CUDA_SUCCESS)
        return cu_fail(rt, r, "clearing the fault record");
    switch (f->code) {
    case KILN__FAULT_TOKEN_ID:
        return kiln__fail(&rt->err, KILN_ERR_DEVICE_CONTRACT,
                          "token_embedding: ids[%u] = %u is at or past the vocabulary size %llu (lowest bad index); "
                          "its output row was zeroed",
                          index, value, (unsigned long long)f->limit);
    default:
        return kiln__fail(&rt->err, KILN_ERR_DEVICE_CONTRACT, "a kernel reported fault code %u (index %u, value %u)",
                          f->code, index, value);
    }
}

kiln_status kiln_runtime_synchronize(kiln_runtime *rt)
{
    if (!rt)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_runtime_synchronize: runtime is NULL");
    kiln_status st = kiln__runtime_enter(rt);
    if (st)
        return st;
    kiln__fault f;
    CUresult r = rt->d->cuMemcpyDtoHAsync(&f, rt->fault, sizeof f, rt->stream);
    if (r == CUDA_SUCCESS)
        r = rt->d->cuStreamSynchronize(rt->stream);
    if (r != CUDA_SUCCESS)
        return cu_fail(rt, r, "synchronizing the stream");
    return f.code ? fault_to_error(rt, &f) : KILN_OK;
}

kiln_status kiln__runtime_load_module(kiln_runtime *rt, const void *cubin, CUmodule *out)
{
    kiln_status st = kiln__runtime_enter(rt);
    if (st)
        return st;
    CUresult r = rt->d->cuModuleLoadData(out, cubin);
    return r == CUDA_SUCCESS ? KILN_OK : cu_fail(rt, r, "cuModuleLoadData");
}

void kiln__runtime_unload_module(kiln_runtime *rt, CUmodule module)
{
    if (module && kiln__runtime_enter(rt) == KILN_OK)
        rt->d->cuModuleUnload(module);
}

kiln_status kiln__runtime_launch(kiln_runtime *rt, CUfunction fn, unsigned grid_x, unsigned block_x,
                                 unsigned shared_bytes, void **args)
{
    kiln_status st = kiln__runtime_enter(rt);
    if (st)
        return st;
    CUresult r = rt->d->cuLaunchKernel(fn, grid_x, 1, 1, block_x, 1, 1, shared_bytes, rt->stream, args, NULL);
    return r == CUDA_SUCCESS ? KILN_OK : cu_fail(rt, r, "cuLaunchKernel");
}

/* ---- buffers ---- */

kiln_runtime *kiln__buffer_runtime(const kiln_buffer *buf) { return buf->rt; }
CUdeviceptr kiln__buffer_ptr(const kiln_buffer *buf) { return buf->ptr; }
size_t kiln_buffer_size(const kiln_buffer *buf) { return buf ? buf->size : 0; }
uint64_t kiln_buffer_device_address(const kiln_buffer *buf) { return buf ? (uint64_t)buf->ptr : 0; }

kiln_status kiln_buffer_create(kiln_runtime *rt, size_t bytes, size_t align, kiln_buffer **out)
{
    if (!rt || !out)
        return kiln__fail(rt ? &rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_buffer_create: NULL argument");
    *out = NULL;
    if (!align)
        align = 256;
    if (bytes == 0 || (align & (align - 1)) != 0 || align > ((size_t)1 << 30))
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT,
                          "buffer: %zu bytes aligned to %zu; need bytes > 0 and a power-of-two alignment <= 2^30",
                          bytes, align);
    size_t total;
    /* cuMemAlloc gives 256-byte alignment; over-allocate for more. */
    if (kiln__add_overflows(bytes, align > 256 ? align - 256 : 0, &total))
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "buffer: %zu bytes + alignment %zu overflows", bytes,
                          align);
    kiln_status st = kiln__runtime_enter(rt);
    if (st)
        return st;
    kiln_buffer *b = calloc(1, sizeof *b);
    if (!b)
        return kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    CUresult r = rt->d->cuMemAlloc(&b->base, total);
    if (r != CUDA_SUCCESS) {
        free(b);
        char what[96];
        snprintf(what, sizeof what, "cuMemAlloc of %zu bytes", total);
        return cu_fail(rt, r, what);
    }
    b->rt = rt;
    b->size = bytes;
    b->ptr = (b->base + (align - 1)) & ~(CUdeviceptr)(align - 1);
    *out = b;
    return KILN_OK;
}

void kiln_buffer_destroy(kiln_buffer *b)
{
    if (!b)
        return;
    if (kiln__runtime_enter(b->rt) == KILN_OK) {
        /* The GPU may still use it: wait for the stream first. */
        b->rt->d->cuStreamSynchronize(b->rt->stream);
        b->rt->d->cuMemFree(b->base);
    }
    free(b);
}

static kiln_status check_region(kiln_buffer *b, size_t offset, size_t bytes, const void *host, const char *what)
{
    size_t end;
    if (!host)
        return kiln__fail(&b->rt->err, KILN_ERR_INVALID_ARGUMENT, "%s: host pointer is NULL", what);
    if (bytes == 0 || kiln__add_overflows(offset, bytes, &end) || end > b->size)
        return kiln__fail(&b->rt->err, KILN_ERR_RUNTIME_CONTRACT,
                          "%s: region [%zu, +%zu) is empty or outside the buffer of %zu bytes", what, offset, bytes,
                          b->size);
    return kiln__runtime_enter(b->rt);
}

kiln_status kiln_buffer_upload(kiln_buffer *b, size_t offset, const void *src, size_t bytes)
{
    if (!b)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_buffer_upload: buffer is NULL");
    kiln_status st = check_region(b, offset, bytes, src, "upload");
    if (st)
        return st;
    /* Ordered after the stream's earlier work that may read the region. */
    CUresult r = b->rt->d->cuStreamSynchronize(b->rt->stream);
    if (r == CUDA_SUCCESS)
        r = b->rt->d->cuMemcpyHtoD(b->ptr + offset, src, bytes);
    return r == CUDA_SUCCESS ? KILN_OK : cu_fail(b->rt, r, "upload");
}

kiln_status kiln_buffer_readback(kiln_buffer *b, size_t offset, void *dst, size_t bytes)
{
    if (!b)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_buffer_readback: buffer is NULL");
    kiln_status st = check_region(b, offset, bytes, dst, "readback");
    if (st)
        return st;
    CUresult r = b->rt->d->cuMemcpyDtoHAsync(dst, b->ptr + offset, bytes, b->rt->stream);
    if (r == CUDA_SUCCESS)
        r = b->rt->d->cuStreamSynchronize(b->rt->stream);
    return r == CUDA_SUCCESS ? KILN_OK : cu_fail(b->rt, r, "readback");
}

kiln_status kiln_buffer_fill(kiln_buffer *b, size_t offset, uint8_t value, size_t bytes)
{
    if (!b)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_buffer_fill: buffer is NULL");
    kiln_status st = check_region(b, offset, bytes, b, "fill");
    if (st)
        return st;
    CUresult r = b->rt->d->cuMemsetD8Async(b->ptr + offset, value, bytes, b->rt->stream);
    return r == CUDA_SUCCESS ? KILN_OK : cu_fail(b->rt, r, "fill");
}
