/* kiln — the device boundary.
 *
 * The CUDA driver is loaded at run time (dlopen of libcuda.so.1, entry points
 * through cuGetProcAddress), never linked: on a machine without a driver every
 * call here returns KILN_ERR_NO_DEVICE with a message saying why, and the rest
 * of kiln (jit, cache, prewarm) works offline for a named architecture.
 *
 * A kiln_runtime holds the primary context of one device and one stream; its
 * work runs in order on that stream. Buffers are byte allocations with a
 * power-of-two alignment. Threading: a runtime and its buffers are used by one
 * thread at a time.
 */
#ifndef KILN_RUNTIME_H
#define KILN_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_runtime kiln_runtime;
typedef struct kiln_buffer kiln_buffer;

typedef struct kiln_runtime_options {
    uint32_t size;      /* sizeof(kiln_runtime_options), or 0 */
    int device_ordinal; /* 0: the first device */
} kiln_runtime_options;

typedef struct kiln_runtime_info {
    int device_ordinal;
    char arch[16];        /* "sm_90" */
    char name[128];       /* the device's name */
    uint64_t total_memory;
    int multiprocessors;
    int driver_version;   /* 13000 for CUDA 13.0 */
} kiln_runtime_info;

/* Whether the driver loads and reports at least one device: 1 or 0. When 0
 * and why is not NULL, *why names the reason (static or thread-local text). */
KILN_API int kiln_driver_available(const char **why);

/* KILN_ERR_NO_DEVICE (no driver, no device, bad ordinal), KILN_ERR_CUDA_*. */
KILN_API kiln_status kiln_runtime_create(const kiln_runtime_options *opts, kiln_runtime **out);
/* Waits for the runtime's work, then frees it. NULL is a no-op. */
KILN_API void kiln_runtime_destroy(kiln_runtime *rt);
KILN_API void kiln_runtime_get_info(const kiln_runtime *rt, kiln_runtime_info *out);
KILN_API const char *kiln_runtime_errmsg(const kiln_runtime *rt);
/* Waits for all enqueued work. A kernel that found bad data (a token id past
 * the vocabulary) makes this return KILN_ERR_DEVICE_CONTRACT naming the op,
 * the index and the value; a device fault returns its KILN_ERR_CUDA_* code. */
KILN_API kiln_status kiln_runtime_synchronize(kiln_runtime *rt);

/* A device allocation of bytes (> 0) aligned to align (a power of two, 0: 256). */
KILN_API kiln_status kiln_buffer_create(kiln_runtime *rt, size_t bytes, size_t align, kiln_buffer **out);
/* Waits for the runtime's work, then frees. NULL is a no-op. */
KILN_API void kiln_buffer_destroy(kiln_buffer *buf);
KILN_API size_t kiln_buffer_size(const kiln_buffer *buf);
/* The device address (a CUdeviceptr), for interoperation. */
KILN_API uint64_t kiln_buffer_device_address(const kiln_buffer *buf);
/* Copies host bytes into [offset, offset + bytes); synchronous.
 * KILN_ERR_RUNTIME_CONTRACT when the region is empty or out of bounds. */
KILN_API kiln_status kiln_buffer_upload(kiln_buffer *buf, size_t offset, const void *src, size_t bytes);
/* Copies [offset, offset + bytes) to host memory after the enqueued work. */
KILN_API kiln_status kiln_buffer_readback(kiln_buffer *buf, size_t offset, void *dst, size_t bytes);
/* Sets every byte of [offset, offset + bytes) to value (enqueued). */
KILN_API kiln_status kiln_buffer_fill(kiln_buffer *buf, size_t offset, uint8_t value, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif
