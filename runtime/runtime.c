/* The runtime: one device's primary context, its descriptor, module loading
 * and the sticky-failure rule. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fault.h"
#include "runtime/internal.h"

static _Atomic uint64_t next_instance = 1;

static int is_sticky(kiln_status st)
{
    return st == KILN_ERR_CUDA_ILLEGAL_ADDRESS || st == KILN_ERR_CUDA_INVALID_CONTEXT;
}

kiln_status kiln__runtime_cu_fail(kiln_runtime *rt, CUresult r, const char *what)
{
    kiln_status st = kiln__cuda_fail(&rt->err, r, what);
    int none = 0;
    if (is_sticky(st))
        atomic_compare_exchange_strong(&rt->broken, &none, (int)st);
    return st;
}

kiln_status kiln__runtime_enter(kiln_runtime *rt)
{
    int broken = atomic_load(&rt->broken);
    if (broken)
        return kiln__fail(&rt->err, (kiln_status)broken,
                          "the runtime on device %d failed earlier (%s) and can only be destroyed",
                          rt->info.device_ordinal, kiln_status_code((kiln_status)broken));
    CUcontext cur = NULL;
    if (rt->d->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == rt->ctx)
        return KILN_OK;
    CUresult r = rt->d->cuCtxSetCurrent(rt->ctx);
    return r == CUDA_SUCCESS ? KILN_OK : kiln__runtime_cu_fail(rt, r, "cuCtxSetCurrent");
}

int kiln__runtime_usable(kiln_runtime *rt)
{
    if (atomic_load(&rt->broken))
        return 0;
    CUcontext cur = NULL;
    if (rt->d->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == rt->ctx)
        return 1;
    return rt->d->cuCtxSetCurrent(rt->ctx) == CUDA_SUCCESS;
}

kiln__errslot *kiln__runtime_errslot(kiln_runtime *rt) { return &rt->err; }

int kiln__runtime_pdl(const kiln_runtime *rt) { return rt->pdl; }

size_t kiln__runtime_l2_bytes(const kiln_runtime *rt)
{
    int bytes = 0;
    if (rt->d->cuDeviceGetAttribute(&bytes, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, rt->dev) != CUDA_SUCCESS || bytes < 0)
        return 0;
    return (size_t)bytes;
}

/* SHA-256 over every embedded template file and the operation catalog's
 * provider versions (providers/catalog.c). */
static void implementation_fingerprint(char out[65])
{
    uint8_t fp[32];
    kiln__implementation_digest(fp);
    kiln__hex(fp, sizeof fp, out);
}

static void describe(kiln_runtime *rt, int major)
{
    kiln_runtime_info *i = &rt->info;
    i->instance_id = atomic_fetch_add(&next_instance, 1);
    /* The runtime's own, then what the catalog's operations provide (bf16 from sm_80 only). */
    i->capabilities = (KILN_CAP_LAUNCH | KILN_CAP_TIMING | KILN_CAP_GRAPHS | kiln__catalog_capabilities()) &
                      (major >= 8 ? ~0u : ~(uint32_t)KILN_CAP_BF16);
    implementation_fingerprint(i->implementation_fingerprint);
    i->n_storage_profiles = 2;
    i->storage_profiles[0] = (kiln_storage_profile){"linear", KILN_STORAGE_LINEAR_ARENA, 0, 256};
    i->storage_profiles[1] = (kiln_storage_profile){"paged_kv", KILN_STORAGE_FIXED_BLOCK, 65536, 65536};
}

kiln_status kiln_runtime_create(const kiln_runtime_options *opts, kiln_runtime **out)
{
    const char *why = NULL;
    kiln_runtime_options o;
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_runtime_create: out is NULL");
    *out = NULL;
    kiln_status st = KILN__READ_SIZED(NULL, "kiln_runtime_create", kiln_runtime_options, o, opts);
    if (st)
        return st;
    const kiln__driver *d = kiln__driver_get(&why);
    if (!d)
        return kiln__fail(NULL, KILN_ERR_NO_DEVICE, "no device: %s", why);
    int count = 0;
    CUresult r = d->cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS)
        return kiln__cuda_fail(NULL, r, "cuDeviceGetCount");
    if (o.device_ordinal < 0 || o.device_ordinal >= count)
        return kiln__fail(NULL, KILN_ERR_NO_DEVICE, "no device: ordinal %d requested, %d device(s) present",
                          o.device_ordinal, count);
    kiln_runtime *rt = calloc(1, sizeof *rt);
    if (!rt)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln__errslot_init(&rt->err);
    rt->d = d;
    int major = 0, minor = 0;
    size_t total = 0;
    if ((r = d->cuDeviceGet(&rt->dev, o.device_ordinal)) != CUDA_SUCCESS ||
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
    rt->info.device_ordinal = o.device_ordinal;
    rt->info.total_memory = total;
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_%d%d", major, minor);
    describe(rt, major);
    /* KILN_PDL=0 turns programmatic dependent launch off (for comparisons). */
    const char *pdl = getenv("KILN_PDL");
    rt->pdl = major >= 9 && !(pdl && !strcmp(pdl, "0"));
    if ((r = d->cuDevicePrimaryCtxRetain(&rt->ctx, rt->dev)) != CUDA_SUCCESS) {
        rt->ctx = NULL;
        st = kiln__cuda_fail(NULL, r, "cuDevicePrimaryCtxRetain");
        goto out_free;
    }
    if ((st = kiln__runtime_enter(rt)) || (st = kiln__stream_init(rt, &rt->own)))
        goto out_free;
    /* The immediate calls submit one-off commands: capturing each would cost more than it saves. */
    kiln__graph_cache_set_capture(rt->own->graphs, 0);
    kiln__blas_warm_start(rt);
    *out = rt;
    return KILN_OK;
out_free:
    if (is_sticky(st))
        kiln__fail(NULL, st,
                   "%s (an earlier device fault in this process left the CUDA driver unusable, as the driver "
                   "documents; restart the process)",
                   kiln_errmsg());
    kiln_runtime_destroy(rt);
    return st;
}

void kiln_runtime_destroy(kiln_runtime *rt)
{
    if (!rt)
        return;
    if (rt->blas_warm_started)
        pthread_join(rt->blas_warm, NULL); /* it uses the context */
    kiln_stream_destroy(rt->own);
    if (rt->ctx) {
        /* A broken context is unusable for everyone sharing it (cuBLASLt's
         * runtime holds it too): reset it, so that a new runtime on the
         * device starts clean. */
        if (atomic_load(&rt->broken))
            rt->d->cuDevicePrimaryCtxReset(rt->dev);
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
kiln_stream *kiln_runtime_stream(kiln_runtime *rt) { return rt ? rt->own : NULL; }

kiln_status kiln_runtime_synchronize(kiln_runtime *rt)
{
    if (!rt)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_runtime_synchronize: runtime is NULL");
    kiln_status st = kiln_stream_synchronize(rt->own);
    return st ? kiln__propagate(&rt->err, st) : KILN_OK;
}

kiln_status kiln__runtime_load_module(kiln_runtime *rt, const void *cubin, CUmodule *out)
{
    kiln_status st = kiln__runtime_enter(rt);
    if (st)
        return st;
    CUresult r = rt->d->cuModuleLoadData(out, cubin);
    return r == CUDA_SUCCESS ? KILN_OK : kiln__runtime_cu_fail(rt, r, "cuModuleLoadData");
}

void kiln__runtime_unload_module(kiln_runtime *rt, CUmodule module)
{
    if (!module)
        return;
    /* Graphs captured earlier may hold functions of this module: none is
     * launched again, and none still running is cut short. */
    atomic_fetch_add(&rt->module_epoch, 1);
    if (kiln__runtime_usable(rt)) {
        rt->d->cuCtxSynchronize();
        rt->d->cuModuleUnload(module);
    }
}

void *kiln_launch_stream(const kiln_launch_context *ctx) { return ctx ? (void *)ctx->stream : NULL; }
void *kiln_launch_cublaslt(const kiln_launch_context *ctx) { return ctx ? ctx->cublaslt : NULL; }
uint64_t kiln_launch_fault_record(const kiln_launch_context *ctx) { return ctx ? (uint64_t)ctx->fault : 0; }

const void *kiln_launch_host_data(const kiln_launch_context *ctx, size_t *bytes)
{
    if (bytes)
        *bytes = ctx && ctx->cmd ? ctx->cmd->host_bytes : 0;
    return ctx && ctx->cmd ? ctx->cmd->host_data : NULL;
}
