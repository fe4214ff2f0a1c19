#include "common/internal.h"
#include "kiln/version.h"

typedef struct {
    const char *code;
    const char *text;
    int retryable;
} status_row;

static const status_row rows[] = {
    [KILN_OK] = {"ok", "success", 0},
    [KILN_ERR_INVALID_ARGUMENT] = {"invalid_argument", "an argument is invalid", 0},
    [KILN_ERR_HOST_OUT_OF_MEMORY] = {"host_out_of_memory", "host memory is exhausted", 1},
    [KILN_ERR_NO_DEVICE] = {"no_device", "no CUDA driver or device is available", 0},
    [KILN_ERR_CUDA_OUT_OF_MEMORY] = {"cuda_out_of_memory", "device memory is exhausted", 1},
    [KILN_ERR_CUDA_ILLEGAL_ADDRESS] = {"cuda_illegal_address", "a kernel accessed an illegal address", 0},
    [KILN_ERR_CUDA_INVALID_CONTEXT] = {"cuda_invalid_context", "the CUDA context is invalid", 0},
    [KILN_ERR_CUDA_DRIVER] = {"cuda_driver_error", "the CUDA driver reported an error", 0},
    [KILN_ERR_CUDA_BLAS] = {"cuda_blas_error", "cuBLASLt reported an error", 0},
    [KILN_ERR_RUNTIME_CONTRACT] = {"runtime_contract", "an invocation violates its contract", 0},
    [KILN_ERR_NVRTC_COMPILE] = {"nvrtc_compile_error", "NVRTC failed to compile a kernel", 0},
    [KILN_ERR_NVRTC] = {"nvrtc_error", "NVRTC reported an error", 0},
    [KILN_ERR_CACHE_CORRUPT] = {"cache_corrupt", "a cache entry is corrupt", 0},
    [KILN_ERR_CACHE_IO] = {"cache_io", "the cache database cannot be read or written", 0},
    [KILN_ERR_CACHE_SCHEMA] = {"cache_schema", "the cache database has an unsupported schema", 0},
    [KILN_ERR_CACHE_BUSY] = {"cache_busy", "the cache database is locked", 1},
    [KILN_ERR_CONFIG] = {"config_invalid", "the model configuration is invalid", 0},
    [KILN_ERR_IO] = {"io_error", "a file cannot be read or written", 0},
    [KILN_ERR_DEVICE_CONTRACT] = {"device_contract", "a kernel found data that violates its contract", 0},
    [KILN_ERR_NOT_FOUND] = {"not_found", "no such item", 0},
    [KILN_ERR_UNSUPPORTED] = {"unsupported", "the operation is not supported here", 0},
    [KILN_ERR_JIT_DISABLED] = {"jit_disabled", "a kernel is missing and compiling is disabled", 0},
};

static const status_row *row(kiln_status s)
{
    static const status_row unknown = {"unknown", "unknown status", 0};
    if ((unsigned)s >= sizeof rows / sizeof rows[0] || !rows[s].code)
        return &unknown;
    return &rows[s];
}

const char *kiln_status_string(kiln_status s) { return row(s)->text; }
const char *kiln_status_code(kiln_status s) { return row(s)->code; }
int kiln_status_retryable(kiln_status s) { return row(s)->retryable; }

unsigned kiln_version_number(void) { return KILN_VERSION_NUMBER; }
const char *kiln_version_string(void) { return KILN_VERSION_STRING; }
