/* Dense linear for a few tokens: templates/skinny_linear.cu (providers/skinny.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/skinny.h"

#define TEMPLATE "skinny_linear"
/* 8 warps splitting K, 4 steps per load stage, one 16-row group per warp
 * (bench/bench_linear_tune shows them at 1 and 8 tokens). The registers this
 * takes leave 2 blocks an SM; a product whose blocks take two waves at that
 * and one at WIDE_MIN_BLOCKS an SM runs the variant compiled for
 * WIDE_MIN_BLOCKS (fewer registers), which costs the products that fit one
 * wave anyway. */
#define WARPS 8
#define UNROLL 4
#define ROW_GROUPS 1
#define MIN_BLOCKS 0
#define WIDE_MIN_BLOCKS 3
/* Outputs per block: 16 rows, or 8 gated outputs (their gate and up rows). */
#define ROWS_PER_BLOCK(glu) ((glu) ? 8 * ROW_GROUPS : 16 * ROW_GROUPS)

/* Warps per block: 8 splitting K where it divides, fewer for short rows. */
static int warps_for(int64_t in)
{
    for (int w = WARPS; w > 1; w /= 2)
        if (in % (32 * w) == 0)
            return w;
    return 1;
}

kiln_status kiln__skinny_linear_spec(kiln_dtype elt, int64_t in, int glu, int wide, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, TEMPLATE ": out is NULL");
    if (in < 32 || in > INT32_MAX || in % 32)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, TEMPLATE ": in = %lld; it must be a multiple of 32 in [32, %d]",
                          (long long)in, INT32_MAX);
    kiln_status st;
    if ((st = kiln_spec_init(out, TEMPLATE)) || (st = kiln__spec_set_elt(out, TEMPLATE, elt)) ||
        (st = kiln_spec_set(out, "IN", in)) || (st = kiln_spec_set(out, "WARPS", warps_for(in))) ||
        (st = kiln_spec_set(out, "UNROLL", UNROLL)) || (st = kiln_spec_set(out, "ROW_GROUPS", ROW_GROUPS)) ||
        (st = kiln_spec_set(out, "MIN_BLOCKS", wide ? WIDE_MIN_BLOCKS : MIN_BLOCKS)) ||
        (st = kiln_spec_set(out, "GLU", glu ? 1 : 0)))
        return st;
    return KILN_OK;
}

kiln_status kiln__skinny_linear_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user)
{
    /* The plain products' ins, each in both variants (which one a product
     * takes depends on the device's SM count: encode); then the gated one's
     * (gate/up reads hidden). */
    const int64_t ins[4] = {cfg->hidden_size, kiln__dense_intermediate(cfg), cfg->num_attention_heads * cfg->head_dim,
                            cfg->hidden_size};
    for (int i = 0; i < 4; i++) {
        const int glu = i == 3;
        if (glu && !kiln__dense_intermediate(cfg))
            continue; /* no dense SwiGLU */
        int seen = 0;
        for (int j = 0; j < i && !glu; j++)
            seen |= ins[j] == ins[i];
        if (seen || ins[i] < 32 || ins[i] % 32 || ins[i] > INT32_MAX)
            continue;
        for (int wide = 0; wide <= !glu; wide++) {
            kiln_spec spec;
            kiln_status st = kiln__skinny_linear_spec(cfg->dtype, ins[i], glu, wide, &spec);
            if (st || (st = sink(user, &spec)))
                return st;
        }
    }
    return KILN_OK;
}

int kiln__skinny_linear_applies(kiln_runtime *rt, int64_t tokens, int64_t in, uint64_t dx, uint64_t dw)
{
    const char *env = getenv("KILN_SKINNY");
    if (env && !strcmp(env, "0"))
        return 0;
    if (tokens < 1 || tokens > KILN__SKINNY_MAX_TOKENS || in < 32 || in % 32 || in > INT32_MAX || (dx | dw) % 16)
        return 0;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    return kiln__arch_number(info.arch) >= 80; /* tensor-core mma.sync m16n8k16 from sm_80 */
}

/* Whether grid blocks of fn take more than one wave of the SMs and fit in
 * one at WIDE_MIN_BLOCKS an SM. */
static int takes_wide(kiln_runtime *rt, CUfunction fn, unsigned grid, unsigned threads)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    const int per_sm = kiln__blocks_per_sm(rt, fn, threads);
    if (info.multiprocessors < 1 || per_sm < 1 || per_sm >= WIDE_MIN_BLOCKS)
        return 0;
    const uint64_t sms = (uint64_t)info.multiprocessors;
    return grid > sms * (uint64_t)per_sm && grid <= sms * WIDE_MIN_BLOCKS;
}

/* Programmatic dependent launch for the gated form and the wide variant
 * only: they follow an RMSNorm of a few blocks, whose launch and run they
 * overlap, while the plain narrow products follow the decode attention or
 * the gated form, whose SMs their early blocks would hold (bench/
 * bench_decode.sh shows the step). Which product is wide depends on the SM
 * count; PDL needs sm_90. */
kiln_status kiln__skinny_enqueue(const kiln__skinny *l, const kiln_launch_context *ctx)
{
    const void *args[] = {&l->x, &l->w, &l->bias, &l->out, &l->n_out, &l->tokens};
    const unsigned grid[3] = {l->grid, 1, 1};
    return kiln__launch_ex(ctx, l->rt, l->fn, grid, l->threads, 0, (void **)args, l->flags);
}

static kiln_status enqueue(void *user, const kiln_launch_context *ctx) { return kiln__skinny_enqueue(user, ctx); }

void kiln__skinny_params(const kiln__skinny *l, uint64_t params[7])
{
    params[0] = l->x;
    params[1] = l->w;
    params[2] = l->bias;
    params[3] = l->out;
    params[4] = l->in;
    params[5] = ((uint64_t)l->n_out << 32) | l->tokens;
    params[6] = ((uint64_t)l->grid << 32) | l->threads;
}

kiln_status kiln__skinny_prepare(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight,
                                 const kiln_tensor *bias, int glu, CUdeviceptr out, kiln__skinny *l, kiln_kernel **kp)
{
    kiln_runtime *rt = kiln__jit_runtime(jit);
    kiln__errslot *err = kiln__runtime_errslot(rt);
    const int64_t tokens = x->dims[0], in = x->dims[1], n_out = glu ? weight->dims[0] / 2 : weight->dims[0];
    const unsigned grid = (unsigned)((n_out + ROWS_PER_BLOCK(glu) - 1) / ROWS_PER_BLOCK(glu)),
                   threads = 32u * (unsigned)warps_for(in);
    kiln_spec spec;
    kiln_status st;
    kiln_kernel *k;
    void *fn;
    /* The element type is x's (the caller checked weight and out against it). */
    if ((st = kiln__skinny_linear_spec(x->dtype, in, glu, 0, &spec)) || (st = kiln_jit_acquire(jit, &spec, &k)) ||
        (st = kiln_kernel_function(k, NULL, &fn)))
        return kiln__propagate(err, st);
    const int wide = !glu && takes_wide(rt, (CUfunction)fn, grid, threads);
    if (wide &&
        ((st = kiln__skinny_linear_spec(x->dtype, in, 0, 1, &spec)) || (st = kiln_jit_acquire(jit, &spec, &k)) ||
         (st = kiln_kernel_function(k, NULL, &fn))))
        return kiln__propagate(err, st);
    *l = (kiln__skinny){.rt = rt,
                        .fn = (CUfunction)fn,
                        .x = kiln__buffer_ptr(x->buffer) + x->offset,
                        .w = kiln__buffer_ptr(weight->buffer) + weight->offset,
                        .bias = bias && !glu ? kiln__buffer_ptr(bias->buffer) + bias->offset : 0,
                        .out = out,
                        .in = (uint64_t)in,
                        .n_out = (uint32_t)n_out,
                        .tokens = (uint32_t)tokens,
                        .grid = grid,
                        .threads = threads,
                        .flags = glu || wide ? KILN__LAUNCH_PDL : 0u};
    *kp = k;
    return KILN_OK;
}

kiln_status kiln__skinny_linear_encode(kiln_jit *jit, const char *op, const kiln_tensor *x,
                                       const kiln_tensor *weight, const kiln_tensor *bias, int glu,
                                       const kiln_tensor *out, const kiln_region *regions, size_t n_regions,
                                       kiln_command **cmd)
{
    kiln_runtime *rt = kiln__jit_runtime(jit);
    kiln__skinny *l = malloc(sizeof *l);
    if (!l)
        return kiln__fail(kiln__runtime_errslot(rt), KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln_kernel *k;
    kiln_status st = kiln__skinny_prepare(jit, x, weight, bias, glu, kiln__buffer_ptr(out->buffer) + out->offset, l, &k);
    if (st) {
        free(l);
        return st;
    }
    /* The replay key: the kernel, every address and size, the grid. */
    uint64_t params[7];
    kiln__skinny_params(l, params);
    const kiln__kernel_command_desc d = {.op = op, .tokens = l->tokens, .regions = regions, .n_regions = n_regions,
                                         .enqueue = enqueue, .user = l, .kernel = k, KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &d, cmd);
}
