/* Dense linear, residual add and RMSNorm in one command (op_dense.h): the
 * product into the workspace, then templates/rms_norm.cu's fused residual
 * form reads it. Three ways to the product:
 *   - skinny: 1 to 8 tokens where the skinny path applies (providers/
 *     skinny.h), its kernel writes the product (f16 or bf16, x's type);
 *   - parts: up to PARTS_MAX_TOKENS tokens, one cuBLASLt call writes P f32
 *     partial products (K split in P, providers/blas.h) and the norm kernel
 *     sums them (kiln_rms_norm_residual_parts): cuBLASLt's own split K runs
 *     a second kernel, and a launch, for that sum;
 *   - tma: 9 to 32 tokens on sm_90 (providers/tma.h), kiln's kernel
 *     (templates/tma_linear.cu) writes P f32 partial products, P the largest
 *     of 4, 2, 1 that divides the K steps, the weight streamed by TMA and its
 *     first stages requested before the kernel's dependency sync; the norm
 *     kernel sums them as for parts. Not where a way is forced (the test
 *     hook, $KILN_LINEAR_NORM_PARTS); $KILN_TMA=0 turns it off;
 *   - plain: one cuBLASLt call writes the product (x's type).
 * Every binding of the element type of x (f16, or bf16 on sm_80+).
 * Between parts (P = 1, 2, 4) and plain the times cuBLASLt's candidates took
 * when blas_cache.c timed them decide (the cold times of narrow products);
 * where nothing was timed, plain. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/blas.h"
#include "providers/catalog.h"
#include "providers/skinny.h"
#include "providers/tma.h"

#define OP "dense_linear_norm"
#define KEY_TAG KILN__KEY_TAG(OP, KILN__VERSION_DENSE_LINEAR_NORM)
#define PARTS_MAX_TOKENS 64
#define PARTS_MAX 4

enum { MODE_SKINNY = 1, MODE_PARTS, MODE_PLAIN, MODE_TMA };

/* Test hook (providers/internal.h): < 0 chooses by the times; 0 takes plain,
 * P > 0 parts with P where cuBLASLt has an algorithm (else an error), where
 * the skinny path does not apply. $KILN_LINEAR_NORM_PARTS (one digit) does
 * the same where the hook is not set (for comparisons). */
static _Atomic int forced_parts = -1;
void kiln__linear_norm_force_parts(int parts) { atomic_store(&forced_parts, parts < 0 ? -1 : parts); }

/* Test hook: the way the last encode took (its MODE_, 0 before any). */
static _Atomic int last_mode;
const char *kiln__linear_norm_last_way(void)
{
    static const char *const names[] = {"none", "skinny", "parts", "plain", "tma"};
    const int m = atomic_load(&last_mode);
    return m >= 0 && m <= MODE_TMA ? names[m] : "?";
}

static kiln_status sizes_check(int64_t tokens, int64_t in, int64_t hidden)
{
    if (tokens < 1 || tokens > INT32_MAX || in < 1 || in > INT32_MAX || hidden < 1 ||
        hidden > KILN_MODEL_MAX_HIDDEN)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": tokens %lld, in %lld, hidden %lld: tokens and in must be in [1, %d], hidden in [1, %d]",
                          (long long)tokens, (long long)in, (long long)hidden, INT32_MAX, KILN_MODEL_MAX_HIDDEN);
    return KILN_OK;
}

kiln_status kiln_op_dense_linear_norm_workspace(int64_t tokens, int64_t in, int64_t hidden, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    kiln_status st = sizes_check(tokens, in, hidden);
    if (st)
        return st;
    /* a 16-bit product, or up to PARTS_MAX f32 parts */
    const size_t each = tokens <= PARTS_MAX_TOKENS ? 4u * PARTS_MAX : 2u;
    size_t product, aligned, total;
    if (kiln__mul_overflows((size_t)tokens * (size_t)hidden, each, &product) || !kiln__ws_align(product, &aligned) ||
        kiln__add_overflows(KILN__BLAS_WORKSPACE, aligned, &total))
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": a workspace for %lld tokens x %lld overflows",
                          (long long)tokens, (long long)hidden);
    *bytes = total;
    return KILN_OK;
}

typedef struct ln_launch {
    kiln__tma tma; /* first: its tensor maps' alignment (kiln__tma_calloc) */
    int mode;
    kiln__skinny skinny;
    kiln__gemm gemm;
    kiln_runtime *rt;
    kiln_dtype elt;
    CUfunction norm;
    CUdeviceptr product, residual, weight, out;
    uint64_t part_stride;
    uint32_t parts, tokens;
    float eps;
    unsigned threads;
} ln_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    ln_launch *l = user;
    kiln_status st = l->mode == MODE_SKINNY ? kiln__skinny_enqueue(&l->skinny, ctx)
                     : l->mode == MODE_TMA  ? kiln__tma_enqueue(&l->tma, ctx)
                                            : kiln__gemm_enqueue(&l->gemm, ctx, OP);
    if (st)
        return st;
    /* One row a block: the residual forms hold no next row (rms_norm.cu). */
    if (l->mode == MODE_PARTS || l->mode == MODE_TMA) {
        void *args[] = {&l->product, &l->parts, &l->part_stride, &l->residual, &l->weight, &l->out, &l->eps, &l->tokens};
        return kiln__launch(ctx, l->rt, l->norm, l->tokens, l->threads, 0, args);
    }
    void *args[] = {&l->product, &l->residual, &l->weight, &l->out, &l->eps, &l->tokens};
    return kiln__launch(ctx, l->rt, l->norm, l->tokens, l->threads, 0, args);
}

static void launch_free(void *user)
{
    ln_launch *l = user;
    kiln__gemm_destroy(&l->gemm);
    free(l);
}

/* ---- tma: templates/tma_linear.cu ---- */
#define TMA_TEMPLATE "tma_linear"

/* The part count: the largest of 4, 2, 1 that cuts in into whole K steps. */
static int64_t tma_parts(int64_t in)
{
    int64_t p = 4;
    while (p > 1 && in % (KILN__TMA_K * p))
        p /= 2;
    return p;
}

static kiln_status tma_linear_spec(kiln_dtype elt, int64_t in, int64_t out, kiln_spec *spec)
{
    const int64_t p = tma_parts(in);
    if (in < KILN__TMA_K || in % (KILN__TMA_K * p) || in > INT32_MAX || out < 16 || out % 16 ||
        out > KILN_MODEL_MAX_HIDDEN)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          TMA_TEMPLATE ": in %lld (a multiple of 64), out %lld (a multiple of 16, at most %d)",
                          (long long)in, (long long)out, KILN_MODEL_MAX_HIDDEN);
    kiln_status st;
    if ((st = kiln_spec_init(spec, TMA_TEMPLATE)) || (st = kiln__spec_set_elt(spec, TMA_TEMPLATE, elt)) ||
        (st = kiln_spec_set(spec, "IN", in)) || (st = kiln_spec_set(spec, "OUT", out)) ||
        (st = kiln_spec_set(spec, "PARTS", p)))
        return st;
    return KILN_OK;
}

kiln_status kiln__linear_norm_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                         void *user)
{
    if (!kiln__tma_arch(arch))
        return KILN_OK; /* its kernel is the TMA one (9 to 32 tokens on sm_90); else cuBLASLt's or the skinny's */
    /* A decoder's o_proj (in heads x head_dim) and down_proj (in intermediate), both out hidden; a mixture
     * of experts adds its experts' sum to the residual apart (rms_norm_residual), not by a product. */
    const int64_t ins[2] = {cfg->num_attention_heads * cfg->head_dim, cfg->num_experts ? 0 : cfg->intermediate_size};
    for (int i = 0; i < 2; i++) {
        if (!ins[i] || ins[i] % KILN__TMA_K || cfg->hidden_size % 16 || (i == 1 && ins[1] == ins[0]))
            continue;
        kiln_spec spec;
        kiln_status st = tma_linear_spec(cfg->dtype, ins[i], cfg->hidden_size, &spec);
        if (st || (st = sink(user, &spec)))
            return st;
    }
    return KILN_OK;
}

/* Blocks a part, and the most 16-row units a block has, on sms SMs. */
static void tma_shape(int64_t hidden, int64_t parts, int sms, int64_t *per_part, int64_t *units)
{
    *per_part = sms / parts;
    *units = *per_part > 0 ? (hidden / 16 + *per_part - 1) / *per_part : 0;
}

static int tma_linear_applies(kiln_runtime *rt, int64_t tokens, int64_t in, int64_t hidden, uint64_t dx, uint64_t dw)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    const int64_t p = tma_parts(in);
    int64_t per_part, units;
    tma_shape(hidden, p, info.multiprocessors, &per_part, &units);
    return kiln__tma_applies(rt, tokens, in, p, dx, dw) && hidden % 16 == 0 && hidden <= KILN_MODEL_MAX_HIDDEN &&
           per_part >= 1 && units >= 1 && units <= KILN__TMA_MAX_WARPS && 16 * units <= KILN__TMA_MAX_BOX;
}

static kiln_status tma_linear_prepare(kiln_jit *jit, kiln__errslot *err, const kiln_tensor *x,
                                      const kiln_tensor *weight, ln_launch *l, kiln_kernel **kp)
{
    kiln_runtime *rt = l->rt;
    const int64_t tokens = x->dims[0], in = x->dims[1], hidden = weight->dims[0], p = tma_parts(in);
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    int64_t per_part, units;
    tma_shape(hidden, p, info.multiprocessors, &per_part, &units);
    kiln_spec spec;
    void *fn;
    kiln_status st;
    if ((st = tma_linear_spec(l->elt, in, hidden, &spec)) || (st = kiln_jit_acquire(jit, &spec, kp)) ||
        (st = kiln_kernel_function(*kp, NULL, &fn)))
        return kiln__propagate(err, st);
    const unsigned box = 16 * (unsigned)units;
    l->mode = MODE_TMA;
    l->parts = (uint32_t)p;
    return kiln__tma_prepare(rt, OP, (CUfunction)fn, l->elt, kiln__buffer_ptr(weight->buffer) + weight->offset,
                             hidden, box, kiln__buffer_ptr(x->buffer) + x->offset, tokens, in, (box + 32) * 128,
                             (unsigned)units, (unsigned)(p * per_part), l->product, &l->tma);
}

/* The product's way and, for parts and plain, its prepared call (see the top). */
static kiln_status choose(kiln_jit *jit, kiln__errslot *err, const kiln_tensor *x, const kiln_tensor *weight,
                          ln_launch *l, kiln_kernel **skinny_kernel)
{
    kiln_runtime *rt = l->rt;
    const int64_t tokens = x->dims[0], in = x->dims[1], hidden = weight->dims[0];
    const CUdeviceptr dx = kiln__buffer_ptr(x->buffer) + x->offset,
                      dw = kiln__buffer_ptr(weight->buffer) + weight->offset;
    if (kiln__skinny_linear_applies(rt, tokens, in, dx, dw)) {
        l->mode = MODE_SKINNY;
        return kiln__skinny_prepare(jit, x, weight, NULL, 0, l->product, &l->skinny, skinny_kernel);
    }
    kiln__gemm_desc d = {.rows = (uint64_t)tokens, .in = (uint64_t)in, .out = (uint64_t)hidden, .elt = l->elt};
    d.x = dx;
    d.w = dw;
    d.d = l->product;
    d.workspace = l->gemm.desc.workspace;
    d.tuning = kiln__jit_cache(jit);
    int forced = atomic_load(&forced_parts);
    const char *env = getenv("KILN_LINEAR_NORM_PARTS");
    if (forced < 0 && env && env[0] >= '0' && env[0] <= '9' && !env[1])
        forced = env[0] - '0';
    if (forced < 0 && tma_linear_applies(rt, tokens, in, hidden, dx, dw))
        return tma_linear_prepare(jit, err, x, weight, l, skinny_kernel);
    if (forced > 0) {
        if (forced > PARTS_MAX || in % (8 * (int64_t)forced))
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              OP ": %d parts forced; at most %d, and in %lld must be a multiple of 8 x parts", forced,
                              PARTS_MAX, (long long)in);
        d.parts = (uint32_t)forced;
        l->mode = MODE_PARTS;
        l->parts = d.parts;
        return kiln__gemm_prepare(rt, err, OP, &d, &l->gemm);
    }
    kiln_status st = kiln__gemm_prepare(rt, err, OP, &d, &l->gemm);
    if (st)
        return st;
    l->mode = MODE_PLAIN;
    if (forced == 0)
        return KILN_OK;
    if (tokens > PARTS_MAX_TOKENS || !(l->gemm.ms > 0))
        return KILN_OK;
    for (uint32_t p = 1; p <= PARTS_MAX; p *= 2) {
        if (in % (8 * (int64_t)p))
            break;
        kiln__gemm g;
        d.parts = p;
        /* A part count cuBLASLt has no algorithm for is passed over. */
        if (kiln__gemm_prepare(rt, err, OP, &d, &g))
            continue;
        if (g.ms > 0 && g.ms < l->gemm.ms) {
            kiln__gemm_destroy(&l->gemm);
            l->gemm = g;
            l->mode = MODE_PARTS;
            l->parts = p;
        } else {
            kiln__gemm_destroy(&g);
        }
    }
    return KILN_OK;
}

kiln_status kiln_op_dense_linear_norm_encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight,
                                             const kiln_tensor *residual, const kiln_tensor *norm_weight, float eps,
                                             const kiln_tensor *out, const kiln_region *workspace,
                                             kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    size_t xb, wb, rb, nb, ob;
    kiln_dtype elt;
    kiln_status st;
    /* The element type is x's; every other binding must have it too. */
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) || (st = kiln__check_elt(err, OP, "x", x, rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "x", x, rt, elt, 2, NULL, &xb)))
        return st;
    const int64_t tokens = x->dims[0], in = x->dims[1];
    size_t no_bias;
    if ((st = kiln__check_weight(err, OP, rt, elt, "weight", weight, in, NULL, &wb, &no_bias)))
        return st;
    const int64_t hidden = weight->dims[0];
    const int64_t want_r[2] = {tokens, hidden}, want_n[1] = {hidden};
    if ((st = kiln__check_tensor(err, OP, "residual", residual, rt, elt, 2, want_r, &rb)) ||
        (st = kiln__check_tensor(err, OP, "norm_weight", norm_weight, rt, elt, 1, want_n, &nb)) ||
        (st = kiln__check_tensor(err, OP, "out", out, rt, elt, 2, want_r, &ob)))
        return st;
    if ((st = sizes_check(tokens, in, hidden)))
        return kiln__propagate(err, st);
    if (!isfinite(eps) || !(eps > 0.0f))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": eps must be a finite number > 0, got %g", (double)eps);
    /* What is written (residual, out) overlaps nothing else. */
    const kiln_tensor *all[5] = {x, weight, norm_weight, residual, out};
    const size_t all_bytes[5] = {xb, wb, nb, rb, ob};
    static const char *const all_names[5] = {"x", "weight", "norm_weight", "residual", "out"};
    if ((st = kiln__check_disjoint(err, OP, residual, rb, "residual", all, all_bytes, all_names, 3)) ||
        (st = kiln__check_disjoint(err, OP, out, ob, "out", all, all_bytes, all_names, 4)))
        return st;
    size_t need;
    if ((st = kiln_op_dense_linear_norm_workspace(tokens, in, hidden, &need)))
        return kiln__propagate(err, st);
    if ((st = kiln__check_workspace(err, OP, workspace, rt, need, all, all_bytes, all_names, 5)))
        return st;

    ln_launch *l = kiln__tma_calloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    const CUdeviceptr ws = kiln__buffer_ptr(workspace->buffer) + workspace->start;
    l->rt = rt;
    l->elt = elt;
    l->product = ws + KILN__BLAS_WORKSPACE;
    l->gemm.desc.workspace = ws;
    l->residual = kiln__buffer_ptr(residual->buffer) + residual->offset;
    l->weight = kiln__buffer_ptr(norm_weight->buffer) + norm_weight->offset;
    l->out = kiln__buffer_ptr(out->buffer) + out->offset;
    l->eps = eps;
    l->tokens = (uint32_t)tokens;
    l->part_stride = (uint64_t)tokens * (uint64_t)hidden;
    kiln_kernel *sk = NULL, *nk;
    if ((st = choose(jit, err, x, weight, l, &sk))) {
        launch_free(l);
        return st;
    }
    atomic_store(&last_mode, l->mode);
    /* The norm kernel: vectors where hidden and every address it touches allow. */
    const uint64_t bits = l->residual | l->weight | l->out;
    const int vec = hidden % 8 == 0 && bits % 16 == 0 ? 8 : 1;
    kiln_spec spec;
    void *fn;
    if ((st = kiln_op_rms_norm_spec(elt, hidden, vec, &spec)) || (st = kiln_jit_acquire(jit, &spec, &nk)) ||
        (st = kiln_kernel_function(nk,
                                   l->mode == MODE_PARTS || l->mode == MODE_TMA ? "kiln_rms_norm_residual_parts"
                                                                                : "kiln_rms_norm_residual",
                                   &fn))) {
        launch_free(l);
        return kiln__propagate(err, st);
    }
    l->norm = (CUfunction)fn;
    l->threads = kiln__rms_norm_threads(hidden, vec);

    /* The replay key: the provider, both kernels or the product's algorithm, every size and address. */
    struct {
        char tag[sizeof KEY_TAG];
        uint8_t norm[KILN_FINGERPRINT_SIZE], skinny[KILN_FINGERPRINT_SIZE];
        uint64_t skinny_params[7], tma_params[KILN__TMA_PARAMS];
        kiln__gemm_key gemm;
        uint64_t mode, residual, weight, out, eps_tokens, threads;
    } key;
    memset(&key, 0, sizeof key);
    memcpy(key.tag, KEY_TAG, sizeof KEY_TAG);
    memcpy(key.norm, kiln_kernel_fingerprint(nk), KILN_FINGERPRINT_SIZE);
    if (l->mode == MODE_SKINNY) {
        memcpy(key.skinny, kiln_kernel_fingerprint(sk), KILN_FINGERPRINT_SIZE);
        kiln__skinny_params(&l->skinny, key.skinny_params);
    } else if (l->mode == MODE_TMA) { /* the TMA kernel in the skinny kernel's place */
        memcpy(key.skinny, kiln_kernel_fingerprint(sk), KILN_FINGERPRINT_SIZE);
        kiln__tma_params(&l->tma, kiln__buffer_ptr(weight->buffer) + weight->offset,
                         kiln__buffer_ptr(x->buffer) + x->offset, in, key.tma_params);
    } else {
        kiln__gemm_key_of(&l->gemm, &key.gemm);
    }
    uint32_t eps_bits;
    memcpy(&eps_bits, &eps, sizeof eps_bits);
    key.mode = (uint64_t)l->mode;
    key.residual = l->residual;
    key.weight = l->weight;
    key.out = l->out;
    key.eps_tokens = ((uint64_t)eps_bits << 32) | l->tokens;
    key.threads = l->threads;
    kiln_region regions[6] = {kiln__tensor_region(x, xb),        kiln__tensor_region(weight, wb),
                              kiln__tensor_region(residual, rb), kiln__tensor_region(norm_weight, nb),
                              kiln__tensor_region(out, ob),      *workspace};
    const kiln__kernel_command_desc cd = {.op = OP, .tokens = (uint32_t)tokens, .dispatches = 2, .regions = regions,
                                          .n_regions = 6, .enqueue = enqueue, .user = l, .user_free = launch_free,
                                          .key = &key, .key_bytes = sizeof key};
    return kiln__kernel_command(rt, &cd, cmd);
}

kiln_status kiln_op_dense_linear_norm(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight,
                                      const kiln_tensor *residual, const kiln_tensor *norm_weight, float eps,
                                      const kiln_tensor *out, const kiln_region *workspace)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(
        jit, kiln_op_dense_linear_norm_encode(jit, x, weight, residual, norm_weight, eps, out, workspace, &cmd), &cmd);
}
