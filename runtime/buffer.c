/* Buffers (reference counted device allocations) and regions. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"

kiln_runtime *kiln__buffer_runtime(const kiln_buffer *buf) { return buf->rt; }
CUdeviceptr kiln__buffer_ptr(const kiln_buffer *buf) { return buf->ptr; }
size_t kiln_buffer_size(const kiln_buffer *buf) { return buf ? buf->size : 0; }
kiln_dtype kiln_buffer_dtype(const kiln_buffer *buf) { return buf ? buf->dtype : KILN_DTYPE_BYTES; }
kiln_buffer_usage kiln_buffer_usage_of(const kiln_buffer *buf) { return buf ? buf->usage : KILN_USAGE_GENERAL; }
uint64_t kiln_buffer_device_address(const kiln_buffer *buf) { return buf ? (uint64_t)buf->ptr : 0; }

int kiln__alloc_size(size_t bytes, size_t align, size_t *total)
{
    /* cuMemAlloc gives 256-byte alignment; over-allocate and align for more. */
    return kiln__add_overflows(bytes, align > 256 ? align - 256 : 0, total) ? -1 : 0;
}

uint64_t kiln__align_up(uint64_t base, size_t align) { return (base + (align - 1)) & ~(uint64_t)(align - 1); }

void kiln__buffer_retain(kiln_buffer *buf) { atomic_fetch_add(&buf->refs, 1); }

static int valid_dtype(kiln_dtype t) { return t == KILN_DTYPE_BYTES || kiln_dtype_size(t) != 0; }

kiln_status kiln_buffer_create_ex(kiln_runtime *rt, const kiln_buffer_desc *desc, kiln_buffer **out)
{
    if (!rt || !desc || !out)
        return kiln__fail(rt ? &rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_buffer_create_ex: NULL argument");
    *out = NULL;
    kiln_buffer_desc d;
    kiln_status st = KILN__READ_SIZED(&rt->err, "kiln_buffer_create_ex", kiln_buffer_desc, d, desc);
    if (st)
        return st;
    size_t align = d.alignment ? d.alignment : 256;
    if (d.bytes == 0 || (align & (align - 1)) != 0 || align > ((size_t)1 << 30))
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT,
                          "buffer: %zu bytes aligned to %zu; need bytes > 0 and a power-of-two alignment <= 2^30",
                          d.bytes, align);
    if (!valid_dtype(d.dtype) || d.bytes % kiln_dtype_size(d.dtype))
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT,
                          "buffer: %zu bytes is not a whole number of %s elements (dtype %d)", d.bytes,
                          kiln_dtype_name(d.dtype), (int)d.dtype);
    if ((unsigned)d.usage > KILN_USAGE_WORKSPACE)
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "buffer: unknown usage %d", (int)d.usage);
    size_t total;
    if (kiln__alloc_size(d.bytes, align, &total))
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "buffer: %zu bytes + alignment %zu overflows",
                          d.bytes, align);
    if ((st = kiln__runtime_enter(rt)))
        return st;
    kiln_buffer *b = calloc(1, sizeof *b);
    if (!b)
        return kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    CUresult r = rt->d->cuMemAlloc(&b->base, total);
    if (r != CUDA_SUCCESS) {
        free(b);
        char what[96];
        snprintf(what, sizeof what, "cuMemAlloc of %zu bytes", total);
        return kiln__runtime_cu_fail(rt, r, what);
    }
    b->rt = rt;
    atomic_init(&b->refs, 1);
    b->size = d.bytes;
    b->dtype = d.dtype;
    b->usage = d.usage;
    b->ptr = kiln__align_up(b->base, align);
    *out = b;
    return KILN_OK;
}

kiln_status kiln_buffer_create(kiln_runtime *rt, size_t bytes, size_t align, kiln_buffer **out)
{
    kiln_buffer_desc d = {.bytes = bytes, .alignment = align};
    return kiln_buffer_create_ex(rt, &d, out);
}

void kiln_buffer_destroy(kiln_buffer *b)
{
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1)
        return;
    /* The last user is gone: no command, fence or quarantined batch names it,
     * so no submitted work can touch it. */
    if (kiln__runtime_usable(b->rt))
        b->rt->d->cuMemFree(b->base);
    free(b);
}

kiln_status kiln_region_check(const kiln_region *r)
{
    if (!r || !r->buffer)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, "region has no buffer");
    if (r->start >= r->end)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, "region [%zu, %zu) is empty%s", r->start,
                          r->end, r->start > r->end ? " (start past end)" : "");
    if (r->end > r->buffer->size)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          "region [%zu, %zu) is outside the buffer of %zu bytes", r->start, r->end, r->buffer->size);
    return KILN_OK;
}

int kiln_region_overlaps(const kiln_region *a, const kiln_region *b)
{
    return a && b && a->buffer == b->buffer && a->start < a->end && b->start < b->end && a->start < b->end &&
           b->start < a->end;
}

/* A region of [offset, offset + bytes), checked for overflow and bounds. */
static kiln_status region_of(kiln_buffer *b, size_t offset, size_t bytes, const void *host, const char *what,
                             kiln_region *out)
{
    size_t end;
    if (!host)
        return kiln__fail(&b->rt->err, KILN_ERR_INVALID_ARGUMENT, "%s: host pointer is NULL", what);
    if (bytes == 0 || kiln__add_overflows(offset, bytes, &end) || end > b->size)
        return kiln__fail(&b->rt->err, KILN_ERR_RUNTIME_CONTRACT,
                          "%s: region [%zu, +%zu) is empty or outside the buffer of %zu bytes", what, offset, bytes,
                          b->size);
    *out = (kiln_region){b, offset, end};
    return KILN_OK;
}

/* Runs one transfer command on the runtime's own stream. */
static kiln_status run_own(kiln_runtime *rt, kiln_status st, kiln_command *cmd)
{
    if (st)
        return st;
    st = kiln_stream_submit(rt->own, &cmd, 1, NULL, NULL);
    kiln_command_release(cmd);
    return st;
}

kiln_status kiln_buffer_upload(kiln_buffer *b, size_t offset, const void *src, size_t bytes)
{
    if (!b)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_buffer_upload: buffer is NULL");
    kiln_region r;
    kiln_command *cmd = NULL;
    kiln_status st = region_of(b, offset, bytes, src, "upload", &r);
    if (!st)
        st = kiln_command_upload(b->rt, &r, src, bytes, &cmd);
    if ((st = run_own(b->rt, st, cmd)))
        return st;
    /* Synchronous for the caller: the data is on the device on return. */
    return kiln_stream_synchronize(b->rt->own);
}

kiln_status kiln_buffer_readback(kiln_buffer *b, size_t offset, void *dst, size_t bytes)
{
    if (!b)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_buffer_readback: buffer is NULL");
    kiln_region r;
    kiln_status st = region_of(b, offset, bytes, dst, "readback", &r);
    if (st || (st = kiln__runtime_enter(b->rt)))
        return st;
    /* After all streams' work: a context-wide synchronize. */
    CUresult res = b->rt->d->cuCtxSynchronize();
    if (res == CUDA_SUCCESS)
        res = b->rt->d->cuMemcpyDtoH(dst, b->ptr + offset, bytes);
    return res == CUDA_SUCCESS ? KILN_OK : kiln__runtime_cu_fail(b->rt, res, "readback");
}

kiln_status kiln_buffer_fill(kiln_buffer *b, size_t offset, uint8_t value, size_t bytes)
{
    if (!b)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_buffer_fill: buffer is NULL");
    kiln_region r;
    kiln_command *cmd = NULL;
    kiln_status st = region_of(b, offset, bytes, b, "fill", &r);
    if (!st)
        st = kiln__command_fill(b->rt, &r, value, &cmd);
    return run_own(b->rt, st, cmd);
}
