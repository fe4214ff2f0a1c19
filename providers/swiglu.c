/* Dense SwiGLU: [g | u] = x · gate_upᵀ through cuBLASLt into the workspace,
 * then out = silu(g) · u in the kernel of templates/swiglu.cu; for a few
 * tokens, one kernel that does both (the skinny path's gated form,
 * providers/skinny.h), g and u never leaving the registers; for 9 to 32
 * tokens on sm_90, one kernel that streams the weight by TMA
 * (templates/tma_swiglu.cu). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/blas.h"
#include "providers/catalog.h"
#include "providers/skinny.h"
#include "providers/tma.h"

#define OP "dense_swiglu"
#define KEY_TAG KILN__KEY_TAG(OP, KILN__VERSION_DENSE_SWIGLU)

/* Two vectors per thread (the template's KILN_ITEMS), a whole number of
 * warps, 32..128 threads; a row takes blocks_for() blocks. Small blocks so
 * that a batch of 32 tokens of Llama-3-8B (1792 vectors a row) fills 224
 * blocks, more than the SMs, where one block a row would leave the step
 * latency bound. */
#define ITEMS 2
static int64_t threads_for(int64_t n, int vec)
{
    int64_t vecs = n / vec, t = ((vecs + ITEMS - 1) / ITEMS + 31) / 32 * 32;
    return t < 32 ? 32 : t > 128 ? 128 : t;
}

static int64_t blocks_for(int64_t n, int vec)
{
    const int64_t per = threads_for(n, vec) * ITEMS;
    return (n / vec + per - 1) / per;
}

kiln_status kiln_op_dense_swiglu_spec(kiln_dtype elt, int64_t intermediate, int vec, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (intermediate < 1 || intermediate > KILN_MODEL_MAX_INTERMEDIATE || (vec != 1 && vec != 8) ||
        intermediate % vec)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": intermediate %lld (1..%d), vector width %d (1, or 8 dividing intermediate)",
                          (long long)intermediate, KILN_MODEL_MAX_INTERMEDIATE, vec);
    kiln_status st;
    if ((st = kiln_spec_init(out, "swiglu")) || (st = kiln__spec_set_elt(out, "swiglu", elt)) ||
        (st = kiln_spec_set(out, "INTERMEDIATE", intermediate)) || (st = kiln_spec_set(out, "VEC", vec)) ||
        (st = kiln_spec_set(out, "THREADS", threads_for(intermediate, vec))))
        return st;
    return KILN_OK;
}

/* ---- 9 to 32 tokens on sm_90: templates/tma_swiglu.cu (providers/tma.h) ---- */
#define TMA_TEMPLATE "tma_swiglu"

static kiln_status tma_swiglu_spec(kiln_dtype elt, int64_t hidden, int64_t intermediate, kiln_spec *out)
{
    if (hidden < KILN__TMA_K || hidden % KILN__TMA_K || hidden > INT32_MAX || intermediate < 8 || intermediate % 8 ||
        intermediate > INT32_MAX / 2)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          TMA_TEMPLATE ": hidden %lld (a multiple of 64), intermediate %lld (a multiple of 8)",
                          (long long)hidden, (long long)intermediate);
    kiln_status st;
    if ((st = kiln_spec_init(out, TMA_TEMPLATE)) || (st = kiln__spec_set_elt(out, TMA_TEMPLATE, elt)) ||
        (st = kiln_spec_set(out, "HIDDEN", hidden)) || (st = kiln_spec_set(out, "INTERMEDIATE", intermediate)))
        return st;
    return KILN_OK;
}

kiln_status kiln__dense_swiglu_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                          void *user)
{
    kiln_spec spec;
    const int64_t inter = kiln__dense_intermediate(cfg);
    if (!inter)
        return KILN_OK;
    /* Buffers from kiln_buffer_create are aligned: encode takes the vector path when the size allows. */
    kiln_status st = kiln_op_dense_swiglu_spec(cfg->dtype, inter, inter % 8 ? 1 : 8, &spec);
    if (st || (st = sink(user, &spec)))
        return st;
    /* 9 to 32 tokens on sm_90 (the TMA kernel), where the sizes allow it. */
    if (!kiln__tma_arch(arch) || cfg->hidden_size % KILN__TMA_K || inter % 8)
        return KILN_OK;
    return (st = tma_swiglu_spec(cfg->dtype, cfg->hidden_size, inter, &spec)) ? st : sink(user, &spec);
}

/* The most 8-output units a block has when the grid is the SM count. */
static int64_t tma_units_per_block(int64_t intermediate, int sms)
{
    return (intermediate / 8 + sms - 1) / sms;
}

static int tma_applies(kiln_runtime *rt, int64_t tokens, int64_t hidden, int64_t inter, uint64_t dx, uint64_t dw)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    return kiln__tma_applies(rt, tokens, hidden, 1, dx, dw) && inter % 8 == 0 &&
           tma_units_per_block(inter, info.multiprocessors) <= KILN__TMA_MAX_WARPS &&
           8 * tma_units_per_block(inter, info.multiprocessors) <= KILN__TMA_MAX_BOX;
}

static kiln_status tma_enqueue(void *user, const kiln_launch_context *ctx) { return kiln__tma_enqueue(user, ctx); }

static kiln_status tma_encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *gate_up, const kiln_tensor *out,
                              const kiln_region *regions, kiln_command **cmd)
{
    kiln_runtime *rt = kiln__jit_runtime(jit);
    kiln__errslot *err = kiln__runtime_errslot(rt);
    const int64_t tokens = x->dims[0], hidden = x->dims[1], inter = gate_up->dims[0] / 2;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    kiln_spec spec;
    kiln_kernel *k;
    void *fn;
    kiln_status st;
    if ((st = tma_swiglu_spec(x->dtype, hidden, inter, &spec)) || (st = kiln_jit_acquire(jit, &spec, &k)) ||
        (st = kiln_kernel_function(k, NULL, &fn)))
        return kiln__propagate(err, st);
    kiln__tma *l = kiln__tma_calloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    const unsigned warps = (unsigned)tma_units_per_block(inter, info.multiprocessors), box = 8 * warps;
    const CUdeviceptr dw = kiln__buffer_ptr(gate_up->buffer) + gate_up->offset, dx = kiln__buffer_ptr(x->buffer) + x->offset;
    if ((st = kiln__tma_prepare(rt, OP, (CUfunction)fn, x->dtype, dw, 2 * inter, box, dx, tokens, hidden,
                                (2 * box + 32) * 128, warps, (unsigned)info.multiprocessors,
                                kiln__buffer_ptr(out->buffer) + out->offset, l))) {
        free(l);
        return st;
    }
    /* The replay key: the kernel, every address and size, the launch shape. */
    uint64_t params[KILN__TMA_PARAMS + 1];
    kiln__tma_params(l, dw, dx, hidden, params);
    params[KILN__TMA_PARAMS] = (uint64_t)inter;
    const kiln__kernel_command_desc d = {.op = OP, .tokens = l->tokens, .regions = regions, .n_regions = 4,
                                         .enqueue = tma_enqueue, .user = l, .kernel = k, .params = params,
                                         .n_params = KILN__TMA_PARAMS + 1};
    return kiln__kernel_command(rt, &d, cmd);
}

size_t kiln_op_dense_swiglu_product_offset(void) { return KILN__BLAS_WORKSPACE; }

static kiln_status sizes_check(int64_t tokens, int64_t hidden, int64_t intermediate)
{
    if (tokens < 1 || tokens > INT32_MAX || hidden < 1 || hidden > INT32_MAX || intermediate < 1 ||
        intermediate > INT32_MAX / 2)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": tokens %lld, hidden %lld, intermediate %lld: tokens and hidden must be in [1, %d], "
                          "intermediate in [1, %d]",
                          (long long)tokens, (long long)hidden, (long long)intermediate, INT32_MAX, INT32_MAX / 2);
    return KILN_OK;
}

kiln_status kiln_op_dense_swiglu_workspace(int64_t tokens, int64_t hidden, int64_t intermediate, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    kiln_status st = sizes_check(tokens, hidden, intermediate);
    if (st)
        return st;
    size_t product, aligned, total;
    if (kiln__mul_overflows((size_t)tokens, (size_t)intermediate * 4, &product) || !kiln__ws_align(product, &aligned) ||
        kiln__add_overflows(KILN__BLAS_WORKSPACE, aligned, &total))
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": a workspace for %lld tokens x %lld overflows",
                          (long long)tokens, (long long)(2 * intermediate));
    *bytes = total;
    return KILN_OK;
}

typedef struct swiglu_launch {
    kiln__gemm gemm;
    CUfunction fn;
    CUdeviceptr product, out;
    unsigned grid[3]; /* tokens, blocks a row, 1 */
    unsigned threads;
} swiglu_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    swiglu_launch *l = user;
    kiln_status st = kiln__gemm_enqueue(&l->gemm, ctx, OP);
    if (st)
        return st;
    void *args[] = {&l->product, &l->out};
    return kiln__launch_ex(ctx, l->gemm.rt, l->fn, l->grid, l->threads, 0, args, KILN__LAUNCH_PDL);
}

kiln_status kiln_op_dense_swiglu_encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *gate_up,
                                        const kiln_tensor *out, const kiln_region *workspace, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    size_t x_bytes, w_bytes, o_bytes;
    kiln_dtype elt;
    kiln_status st;
    /* The element type is x's; gate_up and out must have it too. */
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) || (st = kiln__check_elt(err, OP, "x", x, rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "x", x, rt, elt, 2, NULL, &x_bytes)))
        return st;
    const int64_t tokens = x->dims[0], hidden = x->dims[1];
    size_t no_bias;
    if ((st = kiln__check_weight(err, OP, rt, elt, "gate_up", gate_up, hidden, NULL, &w_bytes, &no_bias)))
        return st;
    if (gate_up->dims[0] % 2)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding gate_up has %lld rows; it must have 2 x intermediate (gate rows, then up "
                          "rows), an even number",
                          (long long)gate_up->dims[0]);
    const int64_t inter = gate_up->dims[0] / 2;
    const int64_t want_o[2] = {tokens, inter};
    if ((st = kiln__check_tensor(err, OP, "out", out, rt, elt, 2, want_o, &o_bytes)))
        return st;
    size_t need;
    if ((st = kiln_op_dense_swiglu_workspace(tokens, hidden, inter, &need)))
        return kiln__propagate(err, st);
    const kiln_tensor *all[3] = {x, gate_up, out};
    const size_t all_bytes[3] = {x_bytes, w_bytes, o_bytes};
    static const char *const all_names[3] = {"x", "gate_up", "out"};
    if ((st = kiln__check_disjoint(err, OP, out, o_bytes, "out", all, all_bytes, all_names, 2)) ||
        (st = kiln__check_workspace(err, OP, workspace, rt, need, all, all_bytes, all_names, 3)))
        return st;
    kiln_region regions[4] = {kiln__tensor_region(x, x_bytes), kiln__tensor_region(gate_up, w_bytes),
                              kiln__tensor_region(out, o_bytes), *workspace};
    const uint64_t dx = kiln__buffer_ptr(x->buffer) + x->offset,
                   dw = kiln__buffer_ptr(gate_up->buffer) + gate_up->offset;
    if (kiln__skinny_linear_applies(rt, tokens, hidden, dx, dw))
        return kiln__skinny_linear_encode(jit, OP, x, gate_up, NULL, 1, out, regions, 4, cmd);
    if (tma_applies(rt, tokens, hidden, inter, dx, dw))
        return tma_encode(jit, x, gate_up, out, regions, cmd);

    swiglu_launch *l = calloc(1, sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    CUdeviceptr ws = kiln__buffer_ptr(workspace->buffer) + workspace->start;
    l->product = ws + KILN__BLAS_WORKSPACE;
    l->out = kiln__buffer_ptr(out->buffer) + out->offset;
    const int vec = (inter % 8 == 0 && l->out % 16 == 0) ? 8 : 1;
    l->threads = (unsigned)threads_for(inter, vec);
    l->grid[0] = (unsigned)tokens; /* x: up to 2^31 - 1; y (the blocks a row, at most 128) to 65535 */
    l->grid[1] = (unsigned)blocks_for(inter, vec);
    l->grid[2] = 1;
    kiln__gemm_desc d = {.rows = (uint64_t)tokens, .in = (uint64_t)hidden, .out = (uint64_t)(2 * inter), .elt = elt};
    d.x = dx;
    d.w = dw;
    d.d = l->product;
    d.workspace = ws;
    kiln_spec spec;
    kiln_kernel *k;
    if ((st = kiln_op_dense_swiglu_spec(elt, inter, vec, &spec)) ||
        (st = kiln__kernel_and_gemm(jit, rt, err, OP, &spec, &k, &l->fn, &d, &l->gemm))) {
        free(l);
        return kiln__propagate(err, st);
    }
    /* The replay key: the provider, the kernel, the algorithm, every size and address. */
    struct {
        char tag[sizeof KEY_TAG];
        uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
        kiln__gemm_key gemm;
        uint64_t out, tokens, threads;
    } key;
    memset(&key, 0, sizeof key);
    memcpy(key.tag, KEY_TAG, sizeof KEY_TAG);
    memcpy(key.fingerprint, kiln_kernel_fingerprint(k), KILN_FINGERPRINT_SIZE);
    kiln__gemm_key_of(&l->gemm, &key.gemm);
    key.out = l->out;
    key.tokens = l->grid[0];
    key.threads = l->threads;
    const kiln__kernel_command_desc cd = {.op = OP, .tokens = (uint32_t)tokens, .dispatches = 2, .regions = regions,
                                          .n_regions = 4, .enqueue = enqueue, .user = l, .user_free = kiln__gemm_free,
                                          .key = &key, .key_bytes = sizeof key};
    return kiln__kernel_command(rt, &cd, cmd);
}

kiln_status kiln_op_dense_swiglu(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *gate_up,
                                 const kiln_tensor *out, const kiln_region *workspace)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_dense_swiglu_encode(jit, x, gate_up, out, workspace, &cmd), &cmd);
}
