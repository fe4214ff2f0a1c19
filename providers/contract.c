/* Contract checks shared by every provider. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/internal.h"

static void dims_text(const kiln_tensor *t, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (uint32_t i = 0; i < t->rank && i < KILN_TENSOR_MAX_RANK && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, i ? ", " : "", t->dims[i]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
}

kiln_status kiln__check_tensor(kiln__errslot *err, const char *op, const char *binding, const kiln_tensor *t,
                               kiln_runtime *rt, kiln_dtype dtype, uint32_t rank, const int64_t *want,
                               size_t *bytes)
{
    char dims[128];
    if (!t || !t->buffer)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s has no buffer", op, binding);
    if (kiln__buffer_runtime(t->buffer) != rt)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s belongs to another runtime", op, binding);
    if (t->dtype != dtype)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s must be %s, got %s", op, binding,
                          kiln_dtype_name(dtype), kiln_dtype_name(t->dtype));
    if (t->rank != rank)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s must have rank %u, got %u", op, binding,
                          rank, t->rank);
    dims_text(t, dims, sizeof dims);
    size_t n = kiln_dtype_size(dtype);
    for (uint32_t i = 0; i < rank; i++) {
        if (t->dims[i] <= 0 || (want && want[i] >= 0 && t->dims[i] != want[i]))
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "%s: binding %s has dims %s; dim %u must be %s%" PRId64, op, binding, dims, i,
                              want && want[i] >= 0 ? "" : "> 0, got ", want && want[i] >= 0 ? want[i] : t->dims[i]);
        if (kiln__mul_overflows(n, (size_t)t->dims[i], &n))
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s dims %s overflow", op, binding, dims);
    }
    size_t end, size = kiln_buffer_size(t->buffer);
    if (kiln__add_overflows(t->offset, n, &end) || end > size)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "%s: binding %s %s at offset %zu needs %zu bytes; the buffer has %zu", op, binding, dims,
                          t->offset, n, size);
    if (t->offset % kiln_dtype_size(dtype))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s offset %zu is not a multiple of %zu", op,
                          binding, t->offset, kiln_dtype_size(dtype));
    *bytes = n;
    return KILN_OK;
}

int kiln__arch_number(const char *arch)
{
    int sm = 0;
    return arch && sscanf(arch, "sm_%d", &sm) == 1 && sm >= 1 ? sm : 0;
}

kiln_status kiln__check_elt(kiln__errslot *err, const char *op, const char *binding, const kiln_tensor *t,
                            kiln_runtime *rt, kiln_dtype *elt)
{
    if (!t || !t->buffer)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s has no buffer", op, binding);
    if (t->dtype != KILN_DTYPE_F16 && t->dtype != KILN_DTYPE_BF16)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s must be f16 or bf16, got %s", op, binding,
                          kiln_dtype_name(t->dtype));
    if (t->dtype == KILN_DTYPE_BF16 && rt) {
        kiln_runtime_info info;
        kiln_runtime_get_info(rt, &info);
        if (kiln__arch_number(info.arch) < 80)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s is bf16, which %s (before sm_80) lacks",
                              op, binding, info.arch);
    }
    *elt = t->dtype;
    return KILN_OK;
}

kiln_status kiln__spec_set_elt(kiln_spec *spec, const char *op, kiln_dtype elt)
{
    if (elt != KILN_DTYPE_F16 && elt != KILN_DTYPE_BF16)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, "%s: element type must be f16 or bf16, got %s", op,
                          kiln_dtype_name(elt));
    return kiln_spec_set(spec, "BF16", elt == KILN_DTYPE_BF16);
}

int kiln__tensors_overlap(const kiln_tensor *a, size_t a_bytes, const kiln_tensor *b, size_t b_bytes)
{
    return a->buffer == b->buffer && a->offset < b->offset + b_bytes && b->offset < a->offset + a_bytes;
}

kiln_status kiln__encode_begin(kiln_jit *jit, const char *op, kiln_command **cmd, kiln_runtime **rt,
                               kiln__errslot **err)
{
    if (!jit || !cmd)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "%s: jit or cmd is NULL", op);
    *cmd = NULL;
    *rt = kiln__jit_runtime(jit);
    if (!*rt)
        return kiln__fail(kiln__jit_errslot(jit), KILN_ERR_NO_DEVICE, "%s: the jit has no runtime (offline)", op);
    *err = kiln__runtime_errslot(*rt);
    return KILN_OK;
}

kiln_status kiln__copy_bindings(kiln__errslot *err, const char *op, const char *what, const char *type, void *dst,
                                size_t dst_size, size_t min_size, const void *src)
{
    if (!src)
        return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, "%s: %s is NULL", op, what);
    const uint32_t size = *(const uint32_t *)src;
    /* 0, one inside the size field itself, or one that holds the first layout. */
    if (size < sizeof(uint32_t) || size >= min_size)
        return kiln__read_sized(err, op, type, dst, dst_size, src);
    char earlier[64] = "";
    if (min_size < dst_size)
        snprintf(earlier, sizeof earlier, ", or at least %zu (an earlier layout)", min_size);
    return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, "%s: %s size %u (%s); expected %zu%s", op, what,
                      (unsigned)size, type, dst_size, earlier);
}

kiln_status kiln__check_weight(kiln__errslot *err, const char *op, kiln_runtime *rt, kiln_dtype elt,
                               const char *name, const kiln_tensor *weight, int64_t in, const kiln_tensor *bias,
                               size_t *w_bytes, size_t *b_bytes)
{
    const int64_t want_w[2] = {-1, in};
    kiln_status st = kiln__check_tensor(err, op, name, weight, rt, elt, 2, want_w, w_bytes);
    *b_bytes = 0;
    if (st || !bias)
        return st;
    const int64_t want_b[1] = {weight->dims[0]};
    if ((st = kiln__check_tensor(err, op, "bias", bias, rt, elt, 1, want_b, b_bytes)))
        return st;
    const uint64_t b = kiln__buffer_ptr(bias->buffer) + bias->offset;
    if (b % 16)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "%s: binding bias must start 16-byte aligned; it starts %llu bytes past that", op,
                          (unsigned long long)(b % 16));
    return KILN_OK;
}

kiln_status kiln__check_disjoint(kiln__errslot *err, const char *op, const kiln_tensor *written, size_t bytes,
                                 const char *name, const kiln_tensor *const *others, const size_t *other_bytes,
                                 const char *const *names, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (others[i] && kiln__tensors_overlap(written, bytes, others[i], other_bytes[i]))
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding %s overlaps binding %s", op, name,
                              names[i]);
    return KILN_OK;
}

kiln_status kiln__submit_encoded(kiln_jit *jit, kiln_status encoded, kiln_command **cmd)
{
    if (encoded)
        return encoded;
    kiln_status st = kiln_stream_submit(kiln_runtime_stream(kiln__jit_runtime(jit)), cmd, 1, NULL, NULL);
    kiln_command_release(*cmd);
    return st;
}

kiln_status kiln__kernel_command(kiln_runtime *rt, const kiln__kernel_command_desc *d, kiln_command **cmd)
{
    void (*user_free)(void *) = d->user_free ? d->user_free : free;
    uint8_t key[KILN_REPLAY_KEY_MAX];
    const size_t key_bytes = d->kernel ? KILN_FINGERPRINT_SIZE + d->n_params * sizeof(uint64_t) : d->key_bytes;
    if (d->kernel && d->n_params > (KILN_REPLAY_KEY_MAX - KILN_FINGERPRINT_SIZE) / sizeof(uint64_t)) {
        user_free(d->user);
        return kiln__fail(kiln__runtime_errslot(rt), KILN_ERR_INVALID_ARGUMENT,
                          "%s: %zu launch parameters do not fit a replay key", d->op, d->n_params);
    }
    if (d->kernel) {
        memcpy(key, kiln_kernel_fingerprint(d->kernel), KILN_FINGERPRINT_SIZE);
        memcpy(key + KILN_FINGERPRINT_SIZE, d->params, d->n_params * sizeof(uint64_t));
    }
    kiln_command_desc cd = {.op_id = d->op,
                            .batching = KILN_BATCHING_PACKED,
                            .participants = d->participants ? d->participants : 1,
                            .tokens = d->tokens,
                            .dispatches = d->dispatches ? d->dispatches : 1,
                            .regions = d->regions,
                            .n_regions = d->n_regions,
                            .enqueue = d->enqueue,
                            .user = d->user,
                            .user_free = user_free,
                            .replay_key = d->kernel ? (const void *)key : d->key,
                            .replay_key_bytes = key_bytes};
    kiln_status st = kiln_command_create(rt, &cd, cmd);
    if (st)
        user_free(d->user);
    return st;
}

int kiln__blocks_per_sm(kiln_runtime *rt, CUfunction fn, unsigned threads)
{
    return kiln__function_blocks_per_sm(rt, fn, threads, 0);
}
