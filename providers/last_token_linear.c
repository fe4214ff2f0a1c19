/* Last-token dense linear: each participant's last token (spans in device
 * memory) gathered by the kernel of templates/gather_last.cu into the
 * workspace, then one cuBLASLt call for all participants. */
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/blas.h"
#include "providers/catalog.h"

#define OP "last_token_linear"
#define KEY_TAG KILN__KEY_TAG(OP, KILN__VERSION_LAST_TOKEN_LINEAR)

static int64_t threads_for(int64_t n, int vec)
{
    int64_t vecs = n / vec, t = ((vecs + 3) / 4 + 31) / 32 * 32;
    return t < 32 ? 32 : t > 256 ? 256 : t;
}

kiln_status kiln_op_last_token_linear_spec(kiln_dtype elt, int64_t in, int vec, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (in < 1 || in > KILN_MODEL_MAX_HIDDEN || (vec != 1 && vec != 8) || in % vec)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": in %lld (1..%d), vector width %d (1, or 8 dividing in)",
                          (long long)in, KILN_MODEL_MAX_HIDDEN, vec);
    kiln_status st;
    if ((st = kiln_spec_init(out, "gather_last")) || (st = kiln__spec_set_elt(out, "gather_last", elt)) ||
        (st = kiln_spec_set(out, "IN", in)) || (st = kiln_spec_set(out, "VEC", vec)) ||
        (st = kiln_spec_set(out, "THREADS", threads_for(in, vec))))
        return st;
    return KILN_OK;
}

/* The model's lm head: the last token's hidden state times the vocabulary. */
kiln_status kiln__last_token_linear_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user)
{
    kiln_spec spec;
    kiln_status st =
        kiln_op_last_token_linear_spec(cfg->dtype, cfg->hidden_size, cfg->hidden_size % 8 ? 1 : 8, &spec);
    return st ? st : sink(user, &spec);
}

kiln_status kiln_op_last_token_linear_workspace(int64_t participants, int64_t in, int64_t out, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    if (participants < 1 || participants > INT32_MAX || in < 1 || in > INT32_MAX || out < 1 || out > INT32_MAX)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": participants %lld, in %lld, out %lld: each must be in [1, %d]", (long long)participants,
                          (long long)in, (long long)out, INT32_MAX);
    size_t rows, aligned, total;
    if (kiln__mul_overflows((size_t)participants, (size_t)in * 2, &rows) || !kiln__ws_align(rows, &aligned) ||
        kiln__add_overflows(KILN__BLAS_WORKSPACE, aligned, &total))
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": a workspace for %lld participants x %lld overflows",
                          (long long)participants, (long long)in);
    *bytes = total;
    return KILN_OK;
}

typedef struct last_launch {
    kiln__gemm gemm;
    CUfunction fn;
    CUdeviceptr x, spans, rows;
    uint32_t participants, part_rows, limit;
    unsigned threads;
} last_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    last_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    void *args[] = {&l->x, &l->spans, &l->rows, &l->part_rows, &l->limit, &fault};
    kiln_status st = kiln__launch(ctx, l->gemm.rt, l->fn, l->participants, l->threads, 0, args);
    return st ? st : kiln__gemm_enqueue(&l->gemm, ctx, OP);
}

kiln_status kiln_op_last_token_linear_encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *spans,
                                             const kiln_tensor *weight, const kiln_tensor *bias,
                                             const kiln_tensor *out, const kiln_region *workspace, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    kiln_status st = kiln__encode_begin(jit, OP, cmd, &rt, &err);
    if (st)
        return st;
    size_t x_bytes, s_bytes, w_bytes, b_bytes = 0, o_bytes;
    if (x && x->buffer && x->rank != 2 && x->rank != 3)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding x must have rank 2 ([tokens, in], packed coordinates) or 3 ([participants, "
                          "seq, in], source coordinates), got %u",
                          x->rank);
    /* The element type is x's; weight, bias and out must have it too. */
    kiln_dtype elt;
    if ((st = kiln__check_elt(err, OP, "x", x, rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "x", x, rt, elt, x->rank == 3 ? 3 : 2, NULL, &x_bytes)))
        return st;
    const int source = x->rank == 3;
    const int64_t in = x->dims[x->rank - 1];
    const int64_t want_s[2] = {source ? x->dims[0] : -1, 2};
    if ((st = kiln__check_tensor(err, OP, "spans", spans, rt, KILN_DTYPE_U32, 2, want_s, &s_bytes)))
        return st;
    const int64_t parts = spans->dims[0];
    const int64_t limit = source ? x->dims[1] : x->dims[0];
    if (limit > UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding x has %lld rows per %s; at most %u",
                          (long long)limit, source ? "participant" : "batch", UINT32_MAX);
    if ((st = kiln__check_weight(err, OP, rt, elt, "weight", weight, in, bias, &w_bytes, &b_bytes)))
        return st;
    const int64_t n_out = weight->dims[0];
    const int64_t want_o[2] = {parts, n_out};
    if ((st = kiln__check_tensor(err, OP, "out", out, rt, elt, 2, want_o, &o_bytes)))
        return st;
    size_t need;
    if ((st = kiln_op_last_token_linear_workspace(parts, in, n_out, &need)))
        return kiln__propagate(err, st);
    static const char *const names[5] = {"x", "spans", "weight", "bias", "out"};
    const kiln_tensor *all[5] = {x, spans, weight, bias, out};
    const size_t all_bytes[5] = {x_bytes, s_bytes, w_bytes, b_bytes, o_bytes};
    if ((st = kiln__check_disjoint(err, OP, out, o_bytes, "out", all, all_bytes, names, 4)) ||
        (st = kiln__check_workspace(err, OP, workspace, rt, need, all, all_bytes, names, 5)))
        return st;

    last_launch *l = calloc(1, sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    CUdeviceptr ws = kiln__buffer_ptr(workspace->buffer) + workspace->start;
    l->x = kiln__buffer_ptr(x->buffer) + x->offset;
    l->spans = kiln__buffer_ptr(spans->buffer) + spans->offset;
    l->rows = ws + KILN__BLAS_WORKSPACE;
    l->participants = (uint32_t)parts;
    l->part_rows = source ? (uint32_t)limit : 0;
    l->limit = (uint32_t)limit;
    const int vec = (in % 8 == 0 && l->x % 16 == 0) ? 8 : 1;
    l->threads = (unsigned)threads_for(in, vec);
    kiln__gemm_desc d = {.rows = (uint64_t)parts, .in = (uint64_t)in, .out = (uint64_t)n_out, .elt = elt};
    d.x = l->rows;
    d.w = kiln__buffer_ptr(weight->buffer) + weight->offset;
    d.bias = bias ? kiln__buffer_ptr(bias->buffer) + bias->offset : 0;
    d.d = kiln__buffer_ptr(out->buffer) + out->offset;
    d.workspace = ws;
    kiln_spec spec;
    kiln_kernel *k;
    if ((st = kiln_op_last_token_linear_spec(elt, in, vec, &spec)) ||
        (st = kiln__kernel_and_gemm(jit, rt, err, OP, &spec, &k, &l->fn, &d, &l->gemm))) {
        free(l);
        return kiln__propagate(err, st);
    }
    struct {
        char tag[sizeof KEY_TAG];
        uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
        kiln__gemm_key gemm;
        uint64_t x, spans, participants, part_rows, limit, threads;
    } key;
    memset(&key, 0, sizeof key);
    memcpy(key.tag, KEY_TAG, sizeof KEY_TAG);
    memcpy(key.fingerprint, kiln_kernel_fingerprint(k), KILN_FINGERPRINT_SIZE);
    kiln__gemm_key_of(&l->gemm, &key.gemm);
    key.x = l->x;
    key.spans = l->spans;
    key.participants = l->participants;
    key.part_rows = l->part_rows;
    key.limit = l->limit;
    key.threads = l->threads;
    kiln_region regions[6];
    size_t n = 0;
    for (int i = 0; i < 5; i++)
        if (all[i])
            regions[n++] = kiln__tensor_region(all[i], all_bytes[i]);
    regions[n++] = *workspace;
    const uint64_t rows = source ? (uint64_t)parts * (uint64_t)limit : (uint64_t)limit;
    const kiln__kernel_command_desc cd = {.op = OP, .participants = (uint32_t)parts,
                                          .tokens = rows > UINT32_MAX ? UINT32_MAX : (uint32_t)rows, .dispatches = 2,
                                          .regions = regions, .n_regions = n, .enqueue = enqueue, .user = l,
                                          .user_free = kiln__gemm_free, .key = &key, .key_bytes = sizeof key};
    return kiln__kernel_command(rt, &cd, cmd);
}

kiln_status kiln_op_last_token_linear(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *spans,
                                      const kiln_tensor *weight, const kiln_tensor *bias, const kiln_tensor *out,
                                      const kiln_region *workspace)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_last_token_linear_encode(jit, x, spans, weight, bias, out, workspace, &cmd), &cmd);
}
