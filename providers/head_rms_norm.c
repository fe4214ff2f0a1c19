/* Per-head RMSNorm of q and k, fused q | k | v rows or separate tensors (templates/head_rms_norm.cu). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/internal.h"

#define OP "head_rms_norm"
#define MAX_TOKENS 0x7fffffffu
#define MAX_GRID 0x7fffffffu
/* Small blocks: a decode step has few head vectors (Qwen3-8B: 40 a token),
 * spread over as many SMs as they fill. */
#define THREADS 128

kiln_status kiln_op_head_rms_norm_spec(kiln_dtype elt, int64_t head_dim, int64_t heads, int64_t kv_heads, int vec,
                                       kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (head_dim < 1 || head_dim > KILN_MODEL_MAX_HEAD_DIM || (vec != 1 && vec != 8) || head_dim % vec ||
        heads < 1 || heads > KILN_MODEL_MAX_HEADS || kv_heads < 1 || kv_heads > KILN_MODEL_MAX_HEADS)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": head_dim %lld (1..%d), vector width %d (1, or 8 dividing head_dim), heads %lld and "
                             "kv_heads %lld (1..%d)",
                          (long long)head_dim, KILN_MODEL_MAX_HEAD_DIM, vec, (long long)heads, (long long)kv_heads,
                          KILN_MODEL_MAX_HEADS);
    kiln_status st;
    if ((st = kiln_spec_init(out, OP)) || (st = kiln__spec_set_elt(out, OP, elt)) ||
        (st = kiln_spec_set(out, "HEAD_DIM", head_dim)) || (st = kiln_spec_set(out, "HEADS", heads)) ||
        (st = kiln_spec_set(out, "KV_HEADS", kv_heads)) || (st = kiln_spec_set(out, "VEC", vec)) ||
        (st = kiln_spec_set(out, "THREADS", THREADS)))
        return st;
    return KILN_OK;
}

kiln_status kiln__head_rms_norm_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user)
{
    if (!cfg->qk_norm)
        return KILN_OK;
    kiln_spec spec;
    /* Aligned buffers (kiln_buffer_create): encode takes the vector path when head_dim allows it. */
    kiln_status st = kiln_op_head_rms_norm_spec(cfg->dtype, cfg->head_dim, cfg->num_attention_heads,
                                                cfg->num_key_value_heads, cfg->head_dim % 8 ? 1 : 8, &spec);
    return st ? st : sink(user, &spec);
}

/* out, written, may be in exactly (the same bytes) and overlap nothing else of others. */
static kiln_status check_written(kiln__errslot *err, const char *name, const kiln_tensor *out, size_t bytes,
                                 const kiln_tensor *in, const char *in_name, const kiln_tensor *const *others,
                                 const size_t *other_bytes, const char *const *names, size_t n)
{
    const int same = out->buffer == in->buffer && out->offset == in->offset;
    if (!same && kiln__tensors_overlap(out, bytes, in, bytes))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": %s (offset %zu) partly overlaps %s (offset %zu); it may only be %s itself", name,
                          out->offset, in_name, in->offset, in_name);
    return kiln__check_disjoint(err, OP, out, bytes, name, others, other_bytes, names, n);
}

static CUdeviceptr address(const kiln_tensor *t) { return kiln__buffer_ptr(t->buffer) + t->offset; }

kiln_status kiln__head_rms_norm_check(kiln_runtime *rt, const kiln_head_rms_norm_bindings *b,
                                      kiln__head_norm_info *info)
{
    kiln__errslot *err = kiln__runtime_errslot(rt);
    kiln_head_rms_norm_bindings l;
    kiln_status st = kiln__copy_bindings(err, OP, "bindings", "kiln_head_rms_norm_bindings", &l, sizeof l,
                                         sizeof l, b);
    if (st)
        return st;
    memset(info, 0, sizeof *info);
    const int fused = l.qkv != NULL;
    if (fused && (l.q || l.k || l.q_out || l.k_out))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding qkv given with q, k, q_out or k_out; the fused form takes qkv and out only");
    if (!fused && l.out)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding out given without qkv; the separate form "
                                                             "takes q_out and k_out");
    kiln_dtype elt;
    const kiln_tensor *first = fused ? l.qkv : l.q;
    if ((st = kiln__check_elt(err, OP, fused ? "qkv" : "q", first, rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "q_weight", l.q_weight, rt, elt, 1, NULL, &info->bytes[4])))
        return st;
    const int64_t D = l.q_weight->dims[0], want_w[1] = {D};
    if ((st = kiln__check_tensor(err, OP, "k_weight", l.k_weight, rt, elt, 1, want_w, &info->bytes[5])))
        return st;
    if (D > KILN_MODEL_MAX_HEAD_DIM)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding q_weight has head_dim %lld; at most %d",
                          (long long)D, KILN_MODEL_MAX_HEAD_DIM);
    int64_t T;
    if (fused) {
        if (l.heads < 1 || l.heads > KILN_MODEL_MAX_HEADS || l.kv_heads < 1 || l.kv_heads > KILN_MODEL_MAX_HEADS)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              OP ": heads %lld and kv_heads %lld must be in [1, %d] (the fused form)",
                              (long long)l.heads, (long long)l.kv_heads, KILN_MODEL_MAX_HEADS);
        const int64_t want_qkv[2] = {-1, (l.heads + 2 * l.kv_heads) * D};
        if ((st = kiln__check_tensor(err, OP, "qkv", l.qkv, rt, elt, 2, want_qkv, &info->bytes[0])))
            return st;
        T = l.qkv->dims[0];
        const int64_t want_out[2] = {T, want_qkv[1]};
        if ((st = kiln__check_tensor(err, OP, "out", l.out, rt, elt, 2, want_out, &info->bytes[2])))
            return st;
        const kiln_tensor *others[2] = {l.q_weight, l.k_weight};
        const size_t ob[2] = {info->bytes[4], info->bytes[5]};
        const char *const names[2] = {"q_weight", "k_weight"};
        if ((st = check_written(err, "out", l.out, info->bytes[2], l.qkv, "qkv", others, ob, names, 2)))
            return st;
        info->q = address(l.qkv);
        info->k = info->q + (uint64_t)(l.heads * D) * 2;
        info->q_out = address(l.out);
        info->k_out = info->q_out + (uint64_t)(l.heads * D) * 2;
        info->q_stride = info->k_stride = (uint64_t)want_qkv[1];
        info->regions[0] = kiln__tensor_region(l.qkv, info->bytes[0]);
        info->regions[1] = kiln__tensor_region(l.out, info->bytes[2]);
        info->n_regions = 2;
    } else {
        if ((st = kiln__check_tensor(err, OP, "q", l.q, rt, elt, 3, NULL, &info->bytes[0])))
            return st;
        T = l.q->dims[0];
        const int64_t H = l.q->dims[1];
        const int64_t want_q[3] = {T, H, D}, want_k[3] = {T, l.kv_heads ? l.kv_heads : -1, D};
        if (l.heads && l.heads != H)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": heads %lld, but binding q has %lld heads",
                              (long long)l.heads, (long long)H);
        if ((st = kiln__check_tensor(err, OP, "q", l.q, rt, elt, 3, want_q, &info->bytes[0])) ||
            (st = kiln__check_tensor(err, OP, "k", l.k, rt, elt, 3, want_k, &info->bytes[1])))
            return st;
        const int64_t KV = l.k->dims[1], want_ko[3] = {T, KV, D};
        if ((st = kiln__check_tensor(err, OP, "q_out", l.q_out, rt, elt, 3, want_q, &info->bytes[2])) ||
            (st = kiln__check_tensor(err, OP, "k_out", l.k_out, rt, elt, 3, want_ko, &info->bytes[3])))
            return st;
        if (H > KILN_MODEL_MAX_HEADS || KV > KILN_MODEL_MAX_HEADS)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": bindings q and k have %lld and %lld heads; at "
                                                                 "most %d", (long long)H, (long long)KV,
                              KILN_MODEL_MAX_HEADS);
        l.heads = H;
        l.kv_heads = KV;
        const kiln_tensor *others[4] = {l.q_weight, l.k_weight, l.k, l.k_out};
        const size_t ob[4] = {info->bytes[4], info->bytes[5], info->bytes[1], info->bytes[3]};
        const char *const names[4] = {"q_weight", "k_weight", "k", "k_out"};
        if ((st = check_written(err, "q_out", l.q_out, info->bytes[2], l.q, "q", others, ob, names, 4)) ||
            (st = check_written(err, "k_out", l.k_out, info->bytes[3], l.k, "k", others, ob, names, 2)))
            return st;
        const kiln_tensor *q_side[1] = {l.q};
        const char *const q_name[1] = {"q"};
        if ((st = kiln__check_disjoint(err, OP, l.k_out, info->bytes[3], "k_out", q_side, &info->bytes[0], q_name,
                                       1)))
            return st;
        info->q = address(l.q);
        info->k = address(l.k);
        info->q_out = address(l.q_out);
        info->k_out = address(l.k_out);
        info->q_stride = (uint64_t)(H * D);
        info->k_stride = (uint64_t)(KV * D);
        info->regions[0] = kiln__tensor_region(l.q, info->bytes[0]);
        info->regions[1] = kiln__tensor_region(l.k, info->bytes[1]);
        info->regions[2] = kiln__tensor_region(l.q_out, info->bytes[2]);
        info->regions[3] = kiln__tensor_region(l.k_out, info->bytes[3]);
        info->n_regions = 4;
    }
    if (T > (int64_t)MAX_TOKENS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": %lld tokens; at most %u", (long long)T, MAX_TOKENS);
    if (!isfinite(l.eps) || !(l.eps > 0.0f))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": eps must be a finite number > 0, got %g",
                          (double)l.eps);
    info->regions[info->n_regions++] = kiln__tensor_region(l.q_weight, info->bytes[4]);
    info->regions[info->n_regions++] = kiln__tensor_region(l.k_weight, info->bytes[5]);
    info->qw = address(l.q_weight);
    info->kw = address(l.k_weight);
    info->elt = elt;
    info->tokens = T;
    info->head_dim = D;
    info->heads = l.heads;
    info->kv_heads = l.kv_heads;
    info->eps = l.eps;
    const uint64_t bits = info->q | info->k | info->q_out | info->k_out | info->qw | info->kw;
    info->vec = D % 8 == 0 && bits % 16 == 0 ? 8 : 1;
    return KILN_OK;
}

typedef struct head_launch {
    kiln_runtime *rt;
    CUfunction fn;
    kiln__head_norm_info i;
    uint32_t rows;
    unsigned grid;
} head_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    head_launch *l = user;
    kiln__head_norm_info *i = &l->i;
    void *args[] = {&i->q, &i->k, &i->q_out, &i->k_out, &i->qw, &i->kw, &i->q_stride, &i->k_stride, &i->eps,
                    &l->rows};
    return kiln__launch(ctx, l->rt, l->fn, l->grid, THREADS, 0, args);
}

kiln_status kiln_op_head_rms_norm_encode(kiln_jit *jit, const kiln_head_rms_norm_bindings *b, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    kiln__head_norm_info info;
    kiln_status st;
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) || (st = kiln__head_rms_norm_check(rt, b, &info)))
        return st;
    kiln_spec spec;
    kiln_kernel *k;
    void *fn;
    if ((st = kiln_op_head_rms_norm_spec(info.elt, info.head_dim, info.heads, info.kv_heads, info.vec, &spec)) ||
        (st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, NULL, &fn)))
        return kiln__propagate(err, st);
    head_launch *l = malloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    /* Head vectors a block takes at once (the template's GROUPS); the kernel
     * strides over its grid, so this only sizes it. */
    const int64_t vecs = info.head_dim / info.vec;
    int64_t lanes = 1;
    while (lanes < vecs && lanes < 32)
        lanes *= 2;
    const uint64_t groups = THREADS / (uint64_t)lanes,
                   vectors = (uint64_t)info.tokens * (uint64_t)(info.heads + info.kv_heads),
                   blocks = (vectors + groups - 1) / groups;
    *l = (head_launch){.rt = rt, .fn = (CUfunction)fn, .i = info, .rows = (uint32_t)info.tokens,
                       .grid = (unsigned)(blocks < MAX_GRID ? blocks : MAX_GRID)};
    uint32_t eps_bits;
    memcpy(&eps_bits, &info.eps, sizeof eps_bits);
    const uint64_t params[13] = {info.q,        info.k,        info.q_out,    info.k_out,    info.qw,
                                 info.kw,       info.q_stride, info.k_stride, info.bytes[0], info.bytes[1],
                                 info.bytes[4], ((uint64_t)eps_bits << 32) | l->rows, l->grid};
    const kiln__kernel_command_desc d = {.op = OP, .tokens = l->rows, .regions = info.regions,
                                         .n_regions = info.n_regions, .enqueue = enqueue, .user = l, .kernel = k,
                                         KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &d, cmd);
}

kiln_status kiln_op_head_rms_norm(kiln_jit *jit, const kiln_head_rms_norm_bindings *b)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_head_rms_norm_encode(jit, b, &cmd), &cmd);
}
