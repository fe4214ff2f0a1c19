/* Dense linear: out[t, o] = sum_i x[t, i] · weight[o, i] (+ bias[o]), one
 * cuBLASLt call (providers/blas.h has the layout algebra), or for a few tokens
 * kiln's own weight-streaming kernel (providers/skinny.h). */
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/blas.h"
#include "providers/catalog.h"
#include "providers/skinny.h"

#define OP "dense_linear"
/* The provider's part of the replay key; bumped when what it enqueues changes. */
#define KEY_TAG KILN__KEY_TAG(OP, KILN__VERSION_DENSE_LINEAR)

static kiln_status check_size(const char *name, int64_t v)
{
    if (v < 1 || v > INT32_MAX)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": %s = %lld; it must be in [1, %d]", name,
                          (long long)v, INT32_MAX);
    return KILN_OK;
}

kiln_status kiln_op_dense_linear_workspace(int64_t tokens, int64_t in, int64_t out, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    kiln_status st;
    if ((st = check_size("tokens", tokens)) || (st = check_size("in", in)) || (st = check_size("out", out)))
        return st;
    *bytes = KILN__BLAS_WORKSPACE;
    return KILN_OK;
}

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    return kiln__gemm_enqueue(user, ctx, OP);
}

kiln_status kiln_op_dense_linear_encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight,
                                        const kiln_tensor *bias, const kiln_tensor *out, const kiln_region *workspace,
                                        kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    size_t x_bytes, w_bytes, b_bytes = 0, o_bytes;
    kiln_dtype elt;
    kiln_status st;
    /* The element type is x's; weight, bias and out must have it too. */
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) || (st = kiln__check_elt(err, OP, "x", x, rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "x", x, rt, elt, 2, NULL, &x_bytes)))
        return st;
    const int64_t tokens = x->dims[0], in = x->dims[1];
    if ((st = kiln__check_weight(err, OP, rt, elt, "weight", weight, in, bias, &w_bytes, &b_bytes)))
        return st;
    const int64_t n_out = weight->dims[0];
    const int64_t want_o[2] = {tokens, n_out};
    if ((st = kiln__check_tensor(err, OP, "out", out, rt, elt, 2, want_o, &o_bytes)))
        return st;
    size_t need;
    if ((st = kiln_op_dense_linear_workspace(tokens, in, n_out, &need)))
        return kiln__propagate(err, st);
    const kiln_tensor *all[4] = {x, weight, bias, out};
    const size_t all_bytes[4] = {x_bytes, w_bytes, b_bytes, o_bytes};
    static const char *const all_names[4] = {"x", "weight", "bias", "out"};
    if ((st = kiln__check_disjoint(err, OP, out, o_bytes, "out", all, all_bytes, all_names, 3)) ||
        (st = kiln__check_workspace(err, OP, workspace, rt, need, all, all_bytes, all_names, 4)))
        return st;

    kiln_region regions[5];
    size_t n = 0;
    for (int i = 0; i < 4; i++)
        if (all[i])
            regions[n++] = kiln__tensor_region(all[i], all_bytes[i]);
    regions[n++] = *workspace;
    const uint64_t dx = kiln__buffer_ptr(x->buffer) + x->offset, dw = kiln__buffer_ptr(weight->buffer) + weight->offset;
    if (kiln__skinny_linear_applies(rt, tokens, in, dx, dw))
        return kiln__skinny_linear_encode(jit, OP, x, weight, bias, 0, out, regions, n, cmd);
    kiln__gemm *g = malloc(sizeof *g);
    if (!g)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln__gemm_desc d = {.rows = (uint64_t)tokens, .in = (uint64_t)in, .out = (uint64_t)n_out, .elt = elt};
    d.x = kiln__buffer_ptr(x->buffer) + x->offset;
    d.w = kiln__buffer_ptr(weight->buffer) + weight->offset;
    d.bias = bias ? kiln__buffer_ptr(bias->buffer) + bias->offset : 0;
    d.d = kiln__buffer_ptr(out->buffer) + out->offset;
    d.workspace = kiln__buffer_ptr(workspace->buffer) + workspace->start;
    d.tuning = kiln__jit_cache(jit);
    if ((st = kiln__gemm_prepare(rt, err, OP, &d, g))) {
        free(g);
        return st;
    }
    /* The replay key: the provider, the algorithm, every size and address. */
    uint8_t key[sizeof KEY_TAG + sizeof(kiln__gemm_key)];
    kiln__gemm_key gk;
    kiln__gemm_key_of(g, &gk);
    memcpy(key, KEY_TAG, sizeof KEY_TAG);
    memcpy(key + sizeof KEY_TAG, &gk, sizeof gk);
    const kiln__kernel_command_desc cd = {.op = OP, .tokens = (uint32_t)tokens, .regions = regions, .n_regions = n,
                                          .enqueue = enqueue, .user = g, .user_free = kiln__gemm_free, .key = key,
                                          .key_bytes = sizeof key};
    return kiln__kernel_command(rt, &cd, cmd);
}

kiln_status kiln_op_dense_linear(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight,
                                 const kiln_tensor *bias, const kiln_tensor *out, const kiln_region *workspace)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_dense_linear_encode(jit, x, weight, bias, out, workspace, &cmd), &cmd);
}
