/* Loads the CUDA driver at run time: dlopen("libcuda.so.1"), then every entry
 * point through cuGetProcAddress, so that nothing links libcuda and kiln starts
 * on machines that have no driver. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "runtime/internal.h"

/* The API version the PFN types above were written for. */
#define KILN__DRIVER_API_VERSION 12000

static pthread_once_t once = PTHREAD_ONCE_INIT;
static kiln__driver driver;
static const kiln__driver *loaded;
static char why_not[512];

static void load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(why_not, sizeof why_not, "the CUDA driver (libcuda.so.1) cannot be loaded: %s",
                 e ? e : "not found");
        return;
    }
    PFN_cuGetProcAddress_v12000 get = (PFN_cuGetProcAddress_v12000)dlsym(lib, "cuGetProcAddress_v2");
    if (!get) {
        snprintf(why_not, sizeof why_not, "libcuda.so.1 has no cuGetProcAddress_v2: the driver is older than CUDA 12");
        return;
    }
#define KILN__DRIVER_LOAD(name, type)                                                                               \
    {                                                                                                               \
        void *fn = NULL;                                                                                            \
        CUdriverProcAddressQueryResult q;                                                                           \
        if (get(#name, &fn, KILN__DRIVER_API_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS || !fn) {     \
            snprintf(why_not, sizeof why_not, "the CUDA driver lacks %s", #name);                                    \
            return;                                                                                                 \
        }                                                                                                           \
        driver.name = (type)fn;                                                                                     \
    }
    KILN__DRIVER_FUNCS(KILN__DRIVER_LOAD)
#undef KILN__DRIVER_LOAD
    CUresult r = driver.cuInit(0);
    if (r != CUDA_SUCCESS) {
        const char *name = NULL;
        driver.cuGetErrorName(r, &name);
        snprintf(why_not, sizeof why_not, "cuInit failed: %s (%d): no usable GPU", name ? name : "?", (int)r);
        return;
    }
    loaded = &driver;
}

const kiln__driver *kiln__driver_get(const char **why)
{
    pthread_once(&once, load);
    if (!loaded && why)
        *why = why_not;
    return loaded;
}

int kiln_driver_available(const char **why)
{
    const kiln__driver *d = kiln__driver_get(why);
    if (!d)
        return 0;
    int n = 0;
    if (d->cuDeviceGetCount(&n) != CUDA_SUCCESS || n < 1) {
        if (why)
            *why = "the CUDA driver reports no device";
        return 0;
    }
    return 1;
}

kiln_status kiln__cuda_fail(kiln__errslot *slot, CUresult r, const char *what)
{
    const char *name = NULL, *text = NULL;
    if (loaded) {
        loaded->cuGetErrorName(r, &name);
        loaded->cuGetErrorString(r, &text);
    }
    kiln_status st;
    switch (r) {
    case CUDA_ERROR_OUT_OF_MEMORY:
        st = KILN_ERR_CUDA_OUT_OF_MEMORY;
        break;
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_LAUNCH_FAILED:
        st = KILN_ERR_CUDA_ILLEGAL_ADDRESS;
        break;
    case CUDA_ERROR_INVALID_CONTEXT:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
        st = KILN_ERR_CUDA_INVALID_CONTEXT;
        break;
    case CUDA_ERROR_NO_DEVICE:
        st = KILN_ERR_NO_DEVICE;
        break;
    default:
        st = KILN_ERR_CUDA_DRIVER;
    }
    return kiln__fail(slot, st, "%s: %s (%d): %s", what, name ? name : "CUDA error", (int)r, text ? text : "");
}
