/* Mixture-of-experts routing: softmax, top-k and renormalization of the
 * gate's logits (templates/moe_router.cu; include/kiln/op_moe.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/internal.h"

#define OP "moe_router"
#define WARPS 8u /* tokens a block: the template's */
#define MAX_TOKENS 0x7fffffffu

kiln_status kiln_op_moe_router_spec(kiln_dtype elt, int64_t experts, int64_t top_k, int normalize, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (experts < 1 || experts > KILN_MOE_MAX_EXPERTS || top_k < 1 || top_k > KILN_MOE_MAX_TOP_K || top_k > experts ||
        (normalize != 0 && normalize != 1))
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": experts %lld (1..%d), top_k %lld (1..min(experts, %d)), normalize %d (0 or 1)",
                          (long long)experts, KILN_MOE_MAX_EXPERTS, (long long)top_k, KILN_MOE_MAX_TOP_K, normalize);
    kiln_status st;
    if ((st = kiln_spec_init(out, OP)) || (st = kiln__spec_set_elt(out, OP, elt)) ||
        (st = kiln_spec_set(out, "EXPERTS", experts)) || (st = kiln_spec_set(out, "TOP_K", top_k)) ||
        (st = kiln_spec_set(out, "NORMALIZE", normalize)))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_moe_router_workspace(int64_t tokens, int64_t experts, size_t *bytes)
{
    (void)tokens;
    (void)experts;
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    *bytes = 0;
    return KILN_OK;
}

kiln_status kiln__moe_router_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user)
{
    if (!cfg->num_experts)
        return KILN_OK;
    kiln_spec spec;
    kiln_status st =
        kiln_op_moe_router_spec(cfg->dtype, cfg->num_experts, cfg->num_experts_per_tok, cfg->norm_topk_prob, &spec);
    return st ? st : sink(user, &spec);
}

typedef struct router_launch {
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr logits, ids, weights;
    uint32_t tokens;
} router_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    router_launch *l = user;
    void *args[] = {&l->logits, &l->ids, &l->weights, &l->tokens};
    return kiln__launch(ctx, l->rt, l->fn, (l->tokens + WARPS - 1) / WARPS, WARPS * 32, 0, args);
}

kiln_status kiln__moe_router_check(kiln_runtime *rt, const kiln_moe_router_desc *d, kiln_dtype *elt, size_t bytes[3])
{
    kiln__errslot *err = kiln__runtime_errslot(rt);
    kiln_status st;
    if ((st = kiln__check_elt(err, OP, "logits", d->logits, rt, elt)) ||
        (st = kiln__check_tensor(err, OP, "logits", d->logits, rt, *elt, 2, NULL, &bytes[0])))
        return st;
    const int64_t T = d->logits->dims[0], E = d->logits->dims[1];
    if (E > KILN_MOE_MAX_EXPERTS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding logits has %lld experts; at most %d",
                          (long long)E, KILN_MOE_MAX_EXPERTS);
    if (T > (int64_t)MAX_TOKENS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding logits has %lld tokens; at most %u",
                          (long long)T, MAX_TOKENS);
    if (d->top_k < 1 || d->top_k > KILN_MOE_MAX_TOP_K || (int64_t)d->top_k > E)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": top_k %u must be in [1, min(experts %lld, %d)]",
                          d->top_k, (long long)E, KILN_MOE_MAX_TOP_K);
    const int64_t want[2] = {T, d->top_k};
    if ((st = kiln__check_tensor(err, OP, "ids", d->ids, rt, KILN_DTYPE_U32, 2, want, &bytes[1])) ||
        (st = kiln__check_tensor(err, OP, "weights", d->weights, rt, KILN_DTYPE_F32, 2, want, &bytes[2])))
        return st;
    const kiln_tensor *t[3] = {d->logits, d->ids, d->weights};
    static const char *const names[3] = {"logits", "ids", "weights"};
    for (int w = 1; w < 3; w++)
        for (int i = 0; i < 3; i++)
            if (i != w && kiln__tensors_overlap(t[w], bytes[w], t[i], bytes[i]))
                return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding %s overlaps binding %s", names[w],
                                  names[i]);
    return KILN_OK;
}

kiln_status kiln_op_moe_router_encode(kiln_jit *jit, const kiln_moe_router_desc *desc, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    kiln_status st;
    kiln_moe_router_desc d;
    kiln_dtype elt;
    size_t bytes[3];
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) ||
        (st = kiln__copy_bindings(err, OP, "desc", "kiln_moe_router_desc", &d, sizeof d, sizeof d, desc)) ||
        (st = kiln__moe_router_check(rt, &d, &elt, bytes)))
        return st;
    const int64_t T = d.logits->dims[0], E = d.logits->dims[1];
    const kiln_tensor *t[3] = {d.logits, d.ids, d.weights};
    kiln_spec spec;
    kiln_kernel *k;
    void *fn;
    if ((st = kiln_op_moe_router_spec(elt, E, d.top_k, d.normalize != 0, &spec)) ||
        (st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, NULL, &fn)))
        return kiln__propagate(err, st);
    router_launch *l = malloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    *l = (router_launch){.rt = rt,
                         .fn = (CUfunction)fn,
                         .logits = kiln__buffer_ptr(d.logits->buffer) + d.logits->offset,
                         .ids = kiln__buffer_ptr(d.ids->buffer) + d.ids->offset,
                         .weights = kiln__buffer_ptr(d.weights->buffer) + d.weights->offset,
                         .tokens = (uint32_t)T};
    const uint64_t params[5] = {l->logits, l->ids, l->weights, bytes[0], l->tokens};
    kiln_region regions[3];
    for (int i = 0; i < 3; i++)
        regions[i] = (kiln_region){t[i]->buffer, t[i]->offset, t[i]->offset + bytes[i]};
    const kiln__kernel_command_desc cd = {.op = OP, .tokens = (uint32_t)T, .regions = regions, .n_regions = 3,
                                          .enqueue = enqueue, .user = l, .kernel = k, KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &cd, cmd);
}

kiln_status kiln_op_moe_router(kiln_jit *jit, const kiln_moe_router_desc *desc)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_moe_router_encode(jit, desc, &cmd), &cmd);
}
