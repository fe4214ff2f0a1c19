/* RMSNorm, plain and fused with the residual add, over f16 or bf16 rows (templates/rms_norm.cu). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/internal.h"

#define TEMPLATE "rms_norm"
#define MAX_TOKENS 0x7fffffffu /* the grid's x limit */

/* About four vectors per thread, a whole number of warps, 32..1024 threads. */
static int64_t threads_for(int64_t hidden, int vec)
{
    int64_t vecs = hidden / vec, t = ((vecs + 3) / 4 + 31) / 32 * 32;
    return t < 32 ? 32 : t > 1024 ? 1024 : t;
}

unsigned kiln__rms_norm_threads(int64_t hidden, int vec) { return (unsigned)threads_for(hidden, vec); }

kiln_status kiln_op_rms_norm_spec(kiln_dtype elt, int64_t hidden, int vec, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, TEMPLATE ": out is NULL");
    if (hidden < 1 || hidden > KILN_MODEL_MAX_HIDDEN || (vec != 1 && vec != 8) || hidden % vec)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          TEMPLATE ": hidden %lld (1..%d), vector width %d (1, or 8 dividing hidden)",
                          (long long)hidden, KILN_MODEL_MAX_HIDDEN, vec);
    kiln_status st;
    if ((st = kiln_spec_init(out, TEMPLATE)) || (st = kiln__spec_set_elt(out, TEMPLATE, elt)) ||
        (st = kiln_spec_set(out, "HIDDEN", hidden)) || (st = kiln_spec_set(out, "VEC", vec)) ||
        (st = kiln_spec_set(out, "THREADS", threads_for(hidden, vec))))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_rms_norm_workspace(int64_t tokens, int64_t hidden, size_t *bytes)
{
    (void)tokens;
    (void)hidden;
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, TEMPLATE ": bytes is NULL");
    *bytes = 0;
    return KILN_OK;
}

kiln_status kiln__rms_norm_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user)
{
    kiln_spec spec;
    /* Buffers from kiln_buffer_create are aligned: encode takes the vector path when hidden allows it. */
    kiln_status st = kiln_op_rms_norm_spec(cfg->dtype, cfg->hidden_size, cfg->hidden_size % 8 ? 1 : 8, &spec);
    return st ? st : sink(user, &spec);
}

/* Overlap rules: out may be x exactly; residual overlaps nothing; nothing written overlaps weight. */
static int same_view(const kiln_tensor *a, size_t a_bytes, const kiln_tensor *b, size_t b_bytes)
{
    return a->buffer == b->buffer && a->offset == b->offset && a_bytes == b_bytes;
}

kiln_status kiln__rms_norm_check(kiln_runtime *rt, const kiln_tensor *x, const kiln_tensor *residual,
                                 const kiln_tensor *weight, float eps, const kiln_tensor *out, int *vec)
{
    kiln__errslot *err = kiln__runtime_errslot(rt);
    const char *op = residual ? "rms_norm_residual" : "rms_norm";
    size_t xb, rb = 0, wb, ob;
    kiln_dtype elt;
    kiln_status st;
    /* x names the element type (f16 or bf16); weight, residual and out are of the same. */
    if ((st = kiln__check_elt(err, op, "x", x, rt, &elt)) ||
        (st = kiln__check_tensor(err, op, "x", x, rt, elt, 2, NULL, &xb)))
        return st;
    const int64_t tokens = x->dims[0], hidden = x->dims[1];
    const int64_t want_w[1] = {hidden}, want_x[2] = {tokens, hidden};
    if ((st = kiln__check_tensor(err, op, "weight", weight, rt, elt, 1, want_w, &wb)) ||
        (residual && (st = kiln__check_tensor(err, op, "residual", residual, rt, elt, 2, want_x, &rb))) ||
        (st = kiln__check_tensor(err, op, "out", out, rt, elt, 2, want_x, &ob)))
        return st;
    if (hidden > KILN_MODEL_MAX_HIDDEN)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding x has hidden %lld; at most %d", op,
                          (long long)hidden, KILN_MODEL_MAX_HIDDEN);
    if (tokens > (int64_t)MAX_TOKENS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding x has %lld tokens; at most %u", op,
                          (long long)tokens, MAX_TOKENS);
    if (!isfinite(eps) || !(eps > 0.0f))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: eps must be a finite number > 0, got %g", op,
                          (double)eps);
    if (kiln__tensors_overlap(out, ob, weight, wb))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: out overlaps weight", op);
    if (kiln__tensors_overlap(out, ob, x, xb) && !same_view(out, ob, x, xb))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "%s: out (offset %zu) partly overlaps x (offset %zu); it may only be x itself", op,
                          out->offset, x->offset);
    if (residual) {
        const char *other = kiln__tensors_overlap(residual, rb, x, xb)        ? "x"
                            : kiln__tensors_overlap(residual, rb, weight, wb) ? "weight"
                            : kiln__tensors_overlap(residual, rb, out, ob)    ? "out"
                                                                              : NULL;
        if (other)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: residual (updated in place) overlaps %s", op,
                              other);
    }
    uint64_t addr_bits = kiln__buffer_ptr(x->buffer) | kiln__buffer_ptr(weight->buffer) | kiln__buffer_ptr(out->buffer);
    addr_bits |= x->offset | weight->offset | out->offset;
    if (residual)
        addr_bits |= kiln__buffer_ptr(residual->buffer) | residual->offset;
    *vec = (hidden % 8 == 0 && addr_bits % 16 == 0) ? 8 : 1;
    return KILN_OK;
}

typedef struct norm_launch {
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr x, residual, weight, out;
    float eps;
    uint32_t tokens;
    unsigned grid, threads;
} norm_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    norm_launch *l = user;
    if (l->residual) {
        void *args[] = {&l->x, &l->residual, &l->weight, &l->out, &l->eps, &l->tokens};
        return kiln__launch(ctx, l->rt, l->fn, l->grid, l->threads, 0, args);
    }
    void *args[] = {&l->x, &l->weight, &l->out, &l->eps, &l->tokens};
    return kiln__launch(ctx, l->rt, l->fn, l->grid, l->threads, 0, args);
}

/* Blocks take rows b, b + grid, ...: one per row, or as many as the device
 * holds at once, fewer when that evens the rows per block (the plain form:
 * each block has its next row in flight). */
static unsigned grid_for(kiln_runtime *rt, CUfunction fn, unsigned threads, uint32_t rows)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    const int known = kiln__blocks_per_sm(rt, fn, threads), per_sm = known ? known : 1;
    const uint64_t most = (uint64_t)(info.multiprocessors > 0 ? info.multiprocessors : 1) * (uint64_t)per_sm;
    if (rows <= most)
        return rows;
    const uint64_t each = (rows + most - 1) / most;
    return (unsigned)((rows + each - 1) / each);
}

static kiln_status encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *residual, const kiln_tensor *weight,
                          float eps, const kiln_tensor *out, kiln_command **cmd)
{
    const char *op = residual ? "rms_norm_residual" : "rms_norm";
    kiln_runtime *rt;
    kiln__errslot *err;
    int vec;
    kiln_status st;
    if ((st = kiln__encode_begin(jit, op, cmd, &rt, &err)) ||
        (st = kiln__rms_norm_check(rt, x, residual, weight, eps, out, &vec)))
        return st;
    const int64_t tokens = x->dims[0], hidden = x->dims[1];
    kiln_spec spec;
    /* The check passed: x's dtype is the element type of every binding. */
    if ((st = kiln_op_rms_norm_spec(x->dtype, hidden, vec, &spec)))
        return kiln__propagate(err, st);
    kiln_kernel *k;
    void *fn;
    if ((st = kiln_jit_acquire(jit, &spec, &k)) ||
        (st = kiln_kernel_function(k, residual ? "kiln_rms_norm_residual" : "kiln_rms_norm", &fn)))
        return kiln__propagate(err, st);
    norm_launch *l = malloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    const size_t bytes = (size_t)tokens * (size_t)hidden * 2, wbytes = (size_t)hidden * 2;
    *l = (norm_launch){.rt = rt,
                       .fn = (CUfunction)fn,
                       .x = kiln__buffer_ptr(x->buffer) + x->offset,
                       .residual = residual ? kiln__buffer_ptr(residual->buffer) + residual->offset : 0,
                       .weight = kiln__buffer_ptr(weight->buffer) + weight->offset,
                       .out = kiln__buffer_ptr(out->buffer) + out->offset,
                       .eps = eps,
                       .tokens = (uint32_t)tokens,
                       .threads = (unsigned)threads_for(hidden, vec)};
    /* The fused form holds no next row (templates/rms_norm.cu): one row per
     * block, and the block scheduler keeps the SMs busy to the end. */
    l->grid = residual ? l->tokens : grid_for(rt, l->fn, l->threads, l->tokens);
    /* The replay key: the kernel, its entry, and everything it is launched with. */
    uint32_t eps_bits;
    memcpy(&eps_bits, &eps, sizeof eps_bits);
    const uint64_t params[9] = {residual ? 2 : 1, l->x,   l->residual, l->weight, l->out, bytes, wbytes,
                                ((uint64_t)eps_bits << 32) | l->tokens, l->grid};
    kiln_region regions[4] = {{x->buffer, x->offset, x->offset + bytes},
                              {weight->buffer, weight->offset, weight->offset + wbytes},
                              {out->buffer, out->offset, out->offset + bytes},
                              {0}};
    size_t n_regions = 3;
    if (residual)
        regions[n_regions++] = (kiln_region){residual->buffer, residual->offset, residual->offset + bytes};
    const kiln__kernel_command_desc d = {.op = op, .tokens = (uint32_t)tokens, .regions = regions,
                                         .n_regions = n_regions, .enqueue = enqueue, .user = l, .kernel = k,
                                         KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &d, cmd);
}

kiln_status kiln_op_rms_norm_encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight, float eps,
                                    const kiln_tensor *out, kiln_command **cmd)
{
    return encode(jit, x, NULL, weight, eps, out, cmd);
}

kiln_status kiln_op_rms_norm(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight, float eps,
                             const kiln_tensor *out)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, encode(jit, x, NULL, weight, eps, out, &cmd), &cmd);
}

kiln_status kiln_op_rms_norm_residual_encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *residual,
                                             const kiln_tensor *weight, float eps, const kiln_tensor *out,
                                             kiln_command **cmd)
{
    if (!residual)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, "rms_norm_residual: binding residual has no buffer");
    return encode(jit, x, residual, weight, eps, out, cmd);
}

kiln_status kiln_op_rms_norm_residual(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *residual,
                                      const kiln_tensor *weight, float eps, const kiln_tensor *out)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_rms_norm_residual_encode(jit, x, residual, weight, eps, out, &cmd),
                                &cmd);
}
