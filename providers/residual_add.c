/* Residual add: out = a + b, f16 or bf16 rows (templates/residual_add.cu). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/internal.h"

#define OP "residual_add"
#define MAX_TOKENS 0x7fffffffu
/* One vector per thread: blocks of SMALL_THREADS up to SMALL_VECTORS vectors
 * (16 tokens of hidden 8192: the rows spread over many SMs), THREADS past it;
 * bench/bench_norm_argmax times both sizes. */
#define SMALL_VECTORS 16384u
#define SMALL_THREADS 128u
#define THREADS 512u
#define MAX_GRID 0x7fffffffu

static int64_t threads_for(int64_t hidden, int vec)
{
    (void)hidden;
    (void)vec;
    return THREADS;
}

kiln_status kiln_op_residual_add_spec(kiln_dtype elt, int64_t hidden, int vec, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (hidden < 1 || hidden > KILN_MODEL_MAX_HIDDEN || (vec != 1 && vec != 8) || hidden % vec)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": hidden %lld (1..%d), vector width %d (1, or 8 dividing hidden)", (long long)hidden,
                          KILN_MODEL_MAX_HIDDEN, vec);
    kiln_status st;
    if ((st = kiln_spec_init(out, OP)) || (st = kiln__spec_set_elt(out, OP, elt)) ||
        (st = kiln_spec_set(out, "HIDDEN", hidden)) || (st = kiln_spec_set(out, "VEC", vec)) ||
        (st = kiln_spec_set(out, "THREADS", threads_for(hidden, vec))))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_residual_add_workspace(int64_t tokens, int64_t hidden, size_t *bytes)
{
    (void)tokens;
    (void)hidden;
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    *bytes = 0;
    return KILN_OK;
}

kiln_status kiln__residual_add_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user)
{
    kiln_spec spec;
    kiln_status st = kiln_op_residual_add_spec(cfg->dtype, cfg->hidden_size, cfg->hidden_size % 8 ? 1 : 8, &spec);
    return st ? st : sink(user, &spec);
}

static int same_view(const kiln_tensor *a, const kiln_tensor *b)
{
    return a->buffer == b->buffer && a->offset == b->offset;
}

kiln_status kiln__residual_add_check(kiln_runtime *rt, const kiln_tensor *a, const kiln_tensor *b,
                                     const kiln_tensor *out, int *vec)
{
    kiln__errslot *err = kiln__runtime_errslot(rt);
    size_t ab, bb, ob;
    kiln_dtype elt;
    kiln_status st;
    /* a names the element type (f16 or bf16); b and out are of the same. */
    if ((st = kiln__check_elt(err, OP, "a", a, rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "a", a, rt, elt, 2, NULL, &ab)))
        return st;
    const int64_t tokens = a->dims[0], hidden = a->dims[1];
    const int64_t want[2] = {tokens, hidden};
    if ((st = kiln__check_tensor(err, OP, "b", b, rt, elt, 2, want, &bb)) ||
        (st = kiln__check_tensor(err, OP, "out", out, rt, elt, 2, want, &ob)))
        return st;
    if (hidden > KILN_MODEL_MAX_HIDDEN)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding a has hidden %lld; at most %d",
                          (long long)hidden, KILN_MODEL_MAX_HIDDEN);
    if (tokens > (int64_t)MAX_TOKENS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding a has %lld tokens; at most %u",
                          (long long)tokens, MAX_TOKENS);
    /* In place is fine (out is a or b); a partial overlap would read what another thread wrote. */
    if (kiln__tensors_overlap(out, ob, a, ab) && !same_view(out, a))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": out (offset %zu) partly overlaps a (offset %zu); it may only be a itself", out->offset,
                          a->offset);
    if (kiln__tensors_overlap(out, ob, b, bb) && !same_view(out, b))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": out (offset %zu) partly overlaps b (offset %zu); it may only be b itself", out->offset,
                          b->offset);
    uint64_t addr_bits = kiln__buffer_ptr(a->buffer) | kiln__buffer_ptr(b->buffer) | kiln__buffer_ptr(out->buffer) |
                         a->offset | b->offset | out->offset;
    *vec = (hidden % 8 == 0 && addr_bits % 16 == 0) ? 8 : 1;
    return KILN_OK;
}

typedef struct add_launch {
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr a, b, out;
    uint64_t n; /* vectors */
    unsigned grid, threads;
} add_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    add_launch *l = user;
    void *args[] = {&l->a, &l->b, &l->out, &l->n};
    return kiln__launch(ctx, l->rt, l->fn, l->grid, l->threads, 0, args);
}

kiln_status kiln_op_residual_add_encode(kiln_jit *jit, const kiln_tensor *a, const kiln_tensor *b,
                                        const kiln_tensor *out, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    int vec;
    kiln_status st;
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) || (st = kiln__residual_add_check(rt, a, b, out, &vec)))
        return st;
    const int64_t tokens = a->dims[0], hidden = a->dims[1];
    kiln_spec spec;
    /* The check passed: a's dtype is the element type of every binding. */
    if ((st = kiln_op_residual_add_spec(a->dtype, hidden, vec, &spec)))
        return kiln__propagate(err, st);
    const size_t bytes = (size_t)tokens * (size_t)hidden * 2;
    const uint64_t n = (uint64_t)tokens * (uint64_t)hidden / (uint64_t)vec;
    const unsigned threads = n <= SMALL_VECTORS ? SMALL_THREADS : THREADS;
    const uint64_t blocks = (n + threads - 1) / threads;
    kiln_kernel *k;
    void *fn;
    if ((st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, NULL, &fn)))
        return kiln__propagate(err, st);
    add_launch *l = malloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    *l = (add_launch){.rt = rt,
                      .fn = (CUfunction)fn,
                      .a = kiln__buffer_ptr(a->buffer) + a->offset,
                      .b = kiln__buffer_ptr(b->buffer) + b->offset,
                      .out = kiln__buffer_ptr(out->buffer) + out->offset,
                      .n = n,
                      .grid = (unsigned)(blocks < MAX_GRID ? blocks : MAX_GRID),
                      .threads = threads};
    const uint64_t params[6] = {l->a, l->b, l->out, bytes, l->n, ((uint64_t)l->grid << 32) | l->threads};
    kiln_region regions[3] = {{a->buffer, a->offset, a->offset + bytes},
                              {b->buffer, b->offset, b->offset + bytes},
                              {out->buffer, out->offset, out->offset + bytes}};
    const kiln__kernel_command_desc d = {.op = OP, .tokens = (uint32_t)tokens, .regions = regions, .n_regions = 3,
                                         .enqueue = enqueue, .user = l, .kernel = k, KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &d, cmd);
}

kiln_status kiln_op_residual_add(kiln_jit *jit, const kiln_tensor *a, const kiln_tensor *b, const kiln_tensor *out)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_residual_add_encode(jit, a, b, out, &cmd), &cmd);
}
