/* kiln runtime internals: the driver table and what jit and providers need
 * of the runtime. Not API. */
#ifndef KILN_RUNTIME_INTERNAL_H
#define KILN_RUNTIME_INTERNAL_H

#include <cuda.h>
#include <cudaTypedefs.h>

#include "common/internal.h"
#include "kiln/runtime.h"

/* Every driver entry point kiln uses: name, PFN type. */
#define KILN__DRIVER_FUNCS(X)                                                                                       \
    X(cuInit, PFN_cuInit_v2000)                                                                                     \
    X(cuDriverGetVersion, PFN_cuDriverGetVersion_v2020)                                                             \
    X(cuGetErrorName, PFN_cuGetErrorName_v6000)                                                                     \
    X(cuGetErrorString, PFN_cuGetErrorString_v6000)                                                                 \
    X(cuDeviceGetCount, PFN_cuDeviceGetCount_v2000)                                                                 \
    X(cuDeviceGet, PFN_cuDeviceGet_v2000)                                                                           \
    X(cuDeviceGetName, PFN_cuDeviceGetName_v2000)                                                                   \
    X(cuDeviceGetAttribute, PFN_cuDeviceGetAttribute_v2000)                                                         \
    X(cuDeviceTotalMem, PFN_cuDeviceTotalMem_v3020)                                                                 \
    X(cuDevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain_v7000)                                                 \
    X(cuDevicePrimaryCtxRelease, PFN_cuDevicePrimaryCtxRelease_v11000)                                              \
    X(cuCtxSetCurrent, PFN_cuCtxSetCurrent_v4000)                                                                   \
    X(cuCtxGetCurrent, PFN_cuCtxGetCurrent_v4000)                                                                   \
    X(cuCtxSynchronize, PFN_cuCtxSynchronize_v2000)                                                                 \
    X(cuStreamCreate, PFN_cuStreamCreate_v2000)                                                                     \
    X(cuStreamDestroy, PFN_cuStreamDestroy_v4000)                                                                   \
    X(cuStreamSynchronize, PFN_cuStreamSynchronize_v2000)                                                           \
    X(cuMemAlloc, PFN_cuMemAlloc_v3020)                                                                             \
    X(cuMemFree, PFN_cuMemFree_v3020)                                                                               \
    X(cuMemcpyHtoD, PFN_cuMemcpyHtoD_v3020)                                                                         \
    X(cuMemcpyDtoHAsync, PFN_cuMemcpyDtoHAsync_v3020)                                                               \
    X(cuMemsetD8Async, PFN_cuMemsetD8Async_v3020)                                                                   \
    X(cuModuleLoadData, PFN_cuModuleLoadData_v2000)                                                                 \
    X(cuModuleUnload, PFN_cuModuleUnload_v2000)                                                                     \
    X(cuModuleGetFunction, PFN_cuModuleGetFunction_v2000)                                                           \
    X(cuLaunchKernel, PFN_cuLaunchKernel_v4000)                                                                     \
    X(cuEventCreate, PFN_cuEventCreate_v2000)                                                                       \
    X(cuEventDestroy, PFN_cuEventDestroy_v4000)                                                                     \
    X(cuEventRecord, PFN_cuEventRecord_v2000)                                                                       \
    X(cuEventSynchronize, PFN_cuEventSynchronize_v2000)                                                             \
    X(cuEventElapsedTime, PFN_cuEventElapsedTime_v2000)

typedef struct kiln__driver {
#define KILN__DRIVER_FIELD(name, type) type name;
    KILN__DRIVER_FUNCS(KILN__DRIVER_FIELD)
#undef KILN__DRIVER_FIELD
} kiln__driver;

/* The loaded driver, or NULL with *why saying what failed (dlopen, a missing
 * entry point, cuInit). Loaded once per process; thread-safe. */
const kiln__driver *kiln__driver_get(const char **why);

/* Maps a CUresult to a status and records "what: NAME (code): text". */
kiln_status kiln__cuda_fail(kiln__errslot *slot, CUresult r, const char *what);

/* Makes the runtime's context current on the calling thread. */
kiln_status kiln__runtime_enter(kiln_runtime *rt);
kiln__errslot *kiln__runtime_errslot(kiln_runtime *rt);
CUstream kiln__runtime_stream(const kiln_runtime *rt);
CUdeviceptr kiln__runtime_fault(const kiln_runtime *rt);
kiln_status kiln__runtime_load_module(kiln_runtime *rt, const void *cubin, CUmodule *out);
void kiln__runtime_unload_module(kiln_runtime *rt, CUmodule module);
kiln_status kiln__runtime_launch(kiln_runtime *rt, CUfunction fn, unsigned grid_x, unsigned block_x,
                                 unsigned shared_bytes, void **args);
const kiln__driver *kiln__runtime_driver(const kiln_runtime *rt);
kiln_runtime *kiln__buffer_runtime(const kiln_buffer *buf);
CUdeviceptr kiln__buffer_ptr(const kiln_buffer *buf);

#endif
