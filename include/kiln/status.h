/* kiln — status codes and error messages.
 *
 * Every fallible kiln function returns a kiln_status; KILN_OK is 0. The values
 * are pinned: new ones are appended, none is ever renumbered or reused.
 *
 * Two levels of text describe a failure:
 *   - kiln_status_string(s) and kiln_status_code(s): static strings, the second
 *     a stable lowercase code (for logs and for programs that match on it);
 *   - a detailed message (the NVRTC log, the SQLite message, the violated
 *     contract with the values that violated it), owned by the object that
 *     failed (kiln_cache_errmsg, kiln_jit_errmsg, kiln_runtime_errmsg) and
 *     valid until that object's next failing call. kiln_errmsg() gives the
 *     detailed message of the last failing call on the calling thread,
 *     including calls that have no object yet (open, create, parse).
 */
#ifndef KILN_STATUS_H
#define KILN_STATUS_H

#include "kiln/export.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kiln_status {
    KILN_OK = 0,
    KILN_ERR_INVALID_ARGUMENT = 1,    /* "invalid_argument" */
    KILN_ERR_HOST_OUT_OF_MEMORY = 2,  /* "host_out_of_memory" (retryable) */
    KILN_ERR_NO_DEVICE = 3,           /* "no_device": no driver or no GPU */
    KILN_ERR_CUDA_OUT_OF_MEMORY = 4,  /* "cuda_out_of_memory" (retryable) */
    KILN_ERR_CUDA_ILLEGAL_ADDRESS = 5,/* "cuda_illegal_address" */
    KILN_ERR_CUDA_INVALID_CONTEXT = 6,/* "cuda_invalid_context" */
    KILN_ERR_CUDA_DRIVER = 7,         /* "cuda_driver_error" */
    KILN_ERR_CUDA_BLAS = 8,           /* "cuda_blas_error" */
    KILN_ERR_RUNTIME_CONTRACT = 9,    /* "runtime_contract": an invocation broke a contract */
    KILN_ERR_NVRTC_COMPILE = 10,      /* "nvrtc_compile_error": the message holds the log */
    KILN_ERR_NVRTC = 11,              /* "nvrtc_error": NVRTC failed other than by compiling */
    KILN_ERR_CACHE_CORRUPT = 12,      /* "cache_corrupt" */
    KILN_ERR_CACHE_IO = 13,           /* "cache_io": SQLite could not read or write */
    KILN_ERR_CACHE_SCHEMA = 14,       /* "cache_schema": a database of another schema */
    KILN_ERR_CACHE_BUSY = 15,         /* "cache_busy": locked past the busy timeout (retryable) */
    KILN_ERR_CONFIG = 16,             /* "config_invalid": a model config kiln cannot use */
    KILN_ERR_IO = 17,                 /* "io_error": a file could not be read or written */
    KILN_ERR_DEVICE_CONTRACT = 18,    /* "device_contract": a kernel found bad data (a token id past the vocabulary) */
    KILN_ERR_NOT_FOUND = 19,          /* "not_found": no such template, entry or record */
    KILN_ERR_UNSUPPORTED = 20,        /* "unsupported": the device or build lacks a capability */
    KILN_ERR_JIT_DISABLED = 21        /* "jit_disabled": a kernel missing from every database, and compiling is off (KILN_JIT=off) */
} kiln_status;

/* A short English sentence for s; never NULL, static storage. */
KILN_API const char *kiln_status_string(kiln_status s);
/* The stable code of s ("cuda_out_of_memory", ...); never NULL, static. */
KILN_API const char *kiln_status_code(kiln_status s);
/* 1 when the same call may succeed if tried again later, else 0. */
KILN_API int kiln_status_retryable(kiln_status s);
/* The detailed message of the last failing kiln call on this thread, or ""
 * when none failed. Valid until the next failing call on this thread. */
KILN_API const char *kiln_errmsg(void);

#ifdef __cplusplus
}
#endif
#endif
