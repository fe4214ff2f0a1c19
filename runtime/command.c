/* Commands: units of device work with what they retain; transfers. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"

/* Portable op ids: lowercase letters, digits, dots and underscores, starting
 * with a letter ("token_embedding", "transfer.copy"). */
static int valid_op_id(const char *s)
{
    if (!s || !(*s >= 'a' && *s <= 'z') || strlen(s) >= KILN_OP_ID_MAX)
        return 0;
    for (const char *p = s; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '.' || *p == '_'))
            return 0;
    return 1;
}

void kiln__command_retain(kiln_command *cmd) { atomic_fetch_add(&cmd->refs, 1); }

static void command_free(kiln_command *c)
{
    for (size_t i = 0; i < c->n_regions; i++)
        kiln_buffer_destroy(c->regions[i].buffer);
    if (c->user_free)
        c->user_free(c->user);
    free(c->regions);
    free(c->host_data);
    free(c->replay_key);
    free(c);
}

void kiln_command_release(kiln_command *c)
{
    if (c && atomic_fetch_sub(&c->refs, 1) == 1)
        command_free(c);
}

const char *kiln_command_op_id(const kiln_command *c) { return c ? c->op_id : ""; }
int kiln_command_replayable(const kiln_command *c) { return c && c->replay_key_bytes > 0; }

kiln_status kiln_command_create(kiln_runtime *rt, const kiln_command_desc *desc, kiln_command **out)
{
    if (!rt || !desc || !out)
        return kiln__fail(rt ? &rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_command_create: NULL argument");
    *out = NULL;
    kiln__errslot *err = &rt->err;
    kiln_command_desc copy;
    kiln_status st = KILN__READ_SIZED(err, "kiln_command_create", kiln_command_desc, copy, desc);
    if (st)
        return st;
    const kiln_command_desc *d = &copy;
    if (!valid_op_id(d->op_id))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "command: op id \"%s\" is not portable ([a-z][a-z0-9._]*, under %d characters)",
                          d->op_id ? d->op_id : "(null)", KILN_OP_ID_MAX);
    if (!d->enqueue)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "command %s: no enqueue function", d->op_id);
    if ((unsigned)d->batching > KILN_BATCHING_PACKED)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "command %s: unknown batching form %d", d->op_id,
                          (int)d->batching);
    if (d->replay_key_bytes > KILN_REPLAY_KEY_MAX || (d->replay_key_bytes && !d->replay_key))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "command %s: replay key of %zu bytes%s (at most %d)",
                          d->op_id, d->replay_key_bytes, d->replay_key ? "" : " and no key", KILN_REPLAY_KEY_MAX);
    if ((d->n_regions && !d->regions) || (d->host_bytes && !d->host_data))
        return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, "command %s: regions or host data missing", d->op_id);
    for (size_t i = 0; i < d->n_regions; i++) {
        if ((st = kiln_region_check(&d->regions[i])))
            return kiln__fail(err, st, "command %s: region %zu: %s", d->op_id, i, kiln_errmsg());
        if (d->regions[i].buffer->rt != rt)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "command %s: region %zu is a buffer of another runtime (instance %llu, not %llu)",
                              d->op_id, i, (unsigned long long)d->regions[i].buffer->rt->info.instance_id,
                              (unsigned long long)rt->info.instance_id);
    }
    kiln_command *c = calloc(1, sizeof *c);
    if (!c)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    if ((d->n_regions && !(c->regions = malloc(d->n_regions * sizeof *c->regions))) ||
        (d->host_bytes && !(c->host_data = malloc(d->host_bytes))) ||
        (d->replay_key_bytes && !(c->replay_key = malloc(d->replay_key_bytes)))) {
        free(c->regions);
        free(c->host_data);
        free(c);
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for command %s", d->op_id);
    }
    c->rt = rt;
    atomic_init(&c->refs, 1);
    strcpy(c->op_id, d->op_id);
    c->batching = d->batching;
    c->participants = d->participants;
    c->tokens = d->tokens;
    c->dispatches = d->dispatches;
    c->transfers = d->transfers;
    for (size_t i = 0; i < d->n_regions; i++) {
        c->regions[i] = d->regions[i];
        kiln__buffer_retain(c->regions[i].buffer);
    }
    c->n_regions = d->n_regions;
    if (d->host_bytes)
        memcpy(c->host_data, d->host_data, d->host_bytes);
    c->host_bytes = d->host_bytes;
    if (d->replay_key_bytes)
        memcpy(c->replay_key, d->replay_key, d->replay_key_bytes);
    c->replay_key_bytes = d->replay_key_bytes;
    if (d->replay_key_bytes)
        c->key_hash = kiln__key_hash(c->replay_key, c->replay_key_bytes);
    c->enqueue = d->enqueue;
    c->user = d->user;
    c->user_free = d->user_free;
    *out = c;
    return KILN_OK;
}

/* ---- transfers ---- */

static kiln_status cu(kiln_runtime *rt, CUresult r, const char *what)
{
    return r == CUDA_SUCCESS ? KILN_OK : kiln__runtime_cu_fail(rt, r, what);
}

static kiln_status enqueue_copy(void *user, const kiln_launch_context *ctx)
{
    (void)user;
    const kiln_command *c = ctx->cmd;
    const kiln_region *src = &c->regions[0], *dst = &c->regions[1];
    kiln_runtime *rt = c->rt;
    return cu(rt,
              rt->d->cuMemcpyAsync(dst->buffer->ptr + dst->start, src->buffer->ptr + src->start,
                                   src->end - src->start, ctx->stream),
              "copy");
}

static kiln_status enqueue_upload(void *user, const kiln_launch_context *ctx)
{
    (void)user;
    const kiln_command *c = ctx->cmd;
    const kiln_region *dst = &c->regions[0];
    kiln_runtime *rt = c->rt;
    /* The command retains its own copy of the bytes until it is released. */
    return cu(rt, rt->d->cuMemcpyHtoDAsync(dst->buffer->ptr + dst->start, c->host_data, c->host_bytes, ctx->stream),
              "upload");
}

static kiln_status enqueue_fill(void *user, const kiln_launch_context *ctx)
{
    const kiln_command *c = ctx->cmd;
    const kiln_region *dst = &c->regions[0];
    kiln_runtime *rt = c->rt;
    return cu(rt,
              rt->d->cuMemsetD8Async(dst->buffer->ptr + dst->start, (unsigned char)(uintptr_t)user,
                                     dst->end - dst->start, ctx->stream),
              "fill");
}

static kiln_status transfer(kiln_runtime *rt, const char *op, const kiln_region *regions, size_t n,
                            const void *host, size_t host_bytes, kiln_enqueue_fn fn, void *user, kiln_command **out)
{
    kiln_command_desc d = {.op_id = op,
                           .batching = KILN_BATCHING_SCALAR,
                           .transfers = 1,
                           .regions = regions,
                           .n_regions = n,
                           .host_data = host,
                           .host_bytes = host_bytes,
                           .enqueue = fn,
                           .user = user};
    return kiln_command_create(rt, &d, out);
}

kiln_status kiln_command_copy(kiln_runtime *rt, const kiln_region *src, const kiln_region *dst, kiln_command **out)
{
    if (!rt || !src || !dst || !out)
        return kiln__fail(rt ? &rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_command_copy: NULL argument");
    kiln_status st;
    if ((st = kiln_region_check(src)) || (st = kiln_region_check(dst)))
        return kiln__fail(&rt->err, st, "copy: %s", kiln_errmsg());
    if (src->buffer->dtype != dst->buffer->dtype)
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "copy: element types differ (source %s, destination %s)",
                          kiln_dtype_name(src->buffer->dtype), kiln_dtype_name(dst->buffer->dtype));
    if (src->end - src->start != dst->end - dst->start)
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "copy: source has %zu bytes, destination %zu",
                          src->end - src->start, dst->end - dst->start);
    if (kiln_region_overlaps(src, dst))
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "copy: source [%zu, %zu) overlaps destination [%zu, %zu)",
                          src->start, src->end, dst->start, dst->end);
    kiln_region both[2] = {*src, *dst};
    return transfer(rt, "transfer.copy", both, 2, NULL, 0, enqueue_copy, NULL, out);
}

kiln_status kiln_command_upload(kiln_runtime *rt, const kiln_region *dst, const void *src, size_t bytes,
                                kiln_command **out)
{
    if (!rt || !dst || !src || !out)
        return kiln__fail(rt ? &rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_command_upload: NULL argument");
    kiln_status st = kiln_region_check(dst);
    if (st)
        return kiln__fail(&rt->err, st, "upload: %s", kiln_errmsg());
    if (bytes != dst->end - dst->start)
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "upload: %zu host bytes into a region of %zu", bytes,
                          dst->end - dst->start);
    return transfer(rt, "transfer.upload", dst, 1, src, bytes, enqueue_upload, NULL, out);
}

kiln_status kiln__command_fill(kiln_runtime *rt, const kiln_region *dst, uint8_t value, kiln_command **out)
{
    kiln_status st = kiln_region_check(dst);
    if (st)
        return kiln__fail(&rt->err, st, "fill: %s", kiln_errmsg());
    return transfer(rt, value ? "transfer.fill" : "transfer.zero", dst, 1, NULL, 0, enqueue_fill,
                    (void *)(uintptr_t)value, out);
}

kiln_status kiln_command_zero(kiln_runtime *rt, const kiln_region *dst, kiln_command **out)
{
    if (!rt || !dst || !out)
        return kiln__fail(rt ? &rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_command_zero: NULL argument");
    return kiln__command_fill(rt, dst, 0, out);
}
