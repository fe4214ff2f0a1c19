/* Token embedding: out[t, :] = table[ids[t], :], f16 or bf16 rows. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/internal.h"

#define OP "token_embedding"
/* The seed launches at most 65535 blocks per launch; so does kiln. */
#define MAX_TOKENS_PER_LAUNCH 65535u

/* About four vectors per thread, a whole number of warps, 32..256 threads. */
static int64_t threads_for(int64_t hidden, int vec)
{
    int64_t vecs = hidden / vec, t = ((vecs + 3) / 4 + 31) / 32 * 32;
    return t < 32 ? 32 : t > 256 ? 256 : t;
}

kiln_status kiln_op_token_embedding_spec(kiln_dtype elt, int64_t vocab, int64_t hidden, int vec, kiln_spec *out)
{
    if (vocab < 1 || vocab > KILN_MODEL_MAX_VOCAB || hidden < 1 || hidden > KILN_MODEL_MAX_HIDDEN ||
        (vec != 1 && vec != 8) || hidden % vec)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": vocab %lld (1..%d), hidden %lld (1..%d), vector width %d (1, or 8 dividing hidden)",
                          (long long)vocab, KILN_MODEL_MAX_VOCAB, (long long)hidden, KILN_MODEL_MAX_HIDDEN, vec);
    kiln_status st;
    if ((st = kiln_spec_init(out, OP)) || (st = kiln__spec_set_elt(out, OP, elt)) ||
        (st = kiln_spec_set(out, "HIDDEN", hidden)) || (st = kiln_spec_set(out, "VOCAB", vocab)) ||
        (st = kiln_spec_set(out, "VEC", vec)) ||
        (st = kiln_spec_set(out, "THREADS", threads_for(hidden, vec))))
        return st;
    return KILN_OK;
}

kiln_status kiln__token_embedding_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user)
{
    kiln_spec spec;
    /* Buffers from kiln_buffer_create are aligned, so encode takes the vector path when hidden allows it. */
    kiln_status st = kiln_op_token_embedding_spec(cfg->dtype, cfg->vocab_size, cfg->hidden_size,
                                                  cfg->hidden_size % 8 ? 1 : 8, &spec);
    return st ? st : sink(user, &spec);
}

/* What the command launches: the kernel and its fixed arguments. */
typedef struct embedding_launch {
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr table, ids, out;
    uint32_t tokens;
    unsigned threads;
} embedding_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    embedding_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    for (uint64_t base = 0; base < l->tokens; base += MAX_TOKENS_PER_LAUNCH) {
        uint64_t n = l->tokens - base;
        unsigned grid = n > MAX_TOKENS_PER_LAUNCH ? MAX_TOKENS_PER_LAUNCH : (unsigned)n;
        unsigned token_base = (unsigned)base;
        void *args[] = {&l->table, &l->ids, &l->out, &token_base, &fault};
        const unsigned dims[3] = {grid, 1, 1};
        kiln_status st = kiln__launch_ex(ctx, l->rt, l->fn, dims, l->threads, 0, args, KILN__LAUNCH_PDL);
        if (st)
            return st;
    }
    return KILN_OK;
}

kiln_status kiln_op_token_embedding_encode(kiln_jit *jit, const kiln_tensor *table, const kiln_tensor *ids,
                                           const kiln_tensor *out, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    size_t table_bytes, ids_bytes, out_bytes;
    kiln_dtype elt;
    kiln_status st;
    /* The table names the element type (f16 or bf16); out is of the same. */
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) ||
        (st = kiln__check_elt(err, OP, "table", table, rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "table", table, rt, elt, 2, NULL, &table_bytes)))
        return st;
    int64_t vocab = table->dims[0], hidden = table->dims[1];
    if ((st = kiln__check_tensor(err, OP, "ids", ids, rt, KILN_DTYPE_U32, 1, NULL, &ids_bytes)))
        return st;
    int64_t tokens = ids->dims[0];
    const int64_t want_out[2] = {tokens, hidden};
    if ((st = kiln__check_tensor(err, OP, "out", out, rt, elt, 2, want_out, &out_bytes)))
        return st;
    if (tokens > UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": %lld tokens; at most %u", (long long)tokens,
                          UINT32_MAX);
    if (kiln__tensors_overlap(out, out_bytes, table, table_bytes) ||
        kiln__tensors_overlap(out, out_bytes, ids, ids_bytes))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": out overlaps %s",
                          kiln__tensors_overlap(out, out_bytes, table, table_bytes) ? "table" : "ids");
    embedding_launch l = {.rt = rt, .tokens = (uint32_t)tokens};
    l.table = kiln__buffer_ptr(table->buffer) + table->offset;
    l.ids = kiln__buffer_ptr(ids->buffer) + ids->offset;
    l.out = kiln__buffer_ptr(out->buffer) + out->offset;
    int vec = (hidden % 8 == 0 && l.table % 16 == 0 && l.out % 16 == 0) ? 8 : 1;
    l.threads = (unsigned)threads_for(hidden, vec);
    kiln_spec spec;
    if ((st = kiln_op_token_embedding_spec(elt, vocab, hidden, vec, &spec)))
        return kiln__propagate(err, st);
    kiln_kernel *k;
    void *fn;
    if ((st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, NULL, &fn)))
        return kiln__propagate(err, st);
    l.fn = (CUfunction)fn;
    embedding_launch *user = malloc(sizeof *user);
    if (!user)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    *user = l;
    /* The replay key: the kernel (its fingerprint) and everything it is launched with. */
    uint64_t params[4] = {l.table, l.ids, l.out, l.tokens};
    kiln_region regions[3] = {{table->buffer, table->offset, table->offset + table_bytes},
                              {ids->buffer, ids->offset, ids->offset + ids_bytes},
                              {out->buffer, out->offset, out->offset + out_bytes}};
    const uint32_t launches = (uint32_t)((tokens + MAX_TOKENS_PER_LAUNCH - 1) / MAX_TOKENS_PER_LAUNCH);
    const kiln__kernel_command_desc d = {.op = OP, .tokens = (uint32_t)tokens, .dispatches = launches,
                                         .regions = regions, .n_regions = 3, .enqueue = enqueue, .user = user,
                                         .kernel = k, KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &d, cmd);
}

kiln_status kiln_op_token_embedding(kiln_jit *jit, const kiln_tensor *table, const kiln_tensor *ids,
                                    const kiln_tensor *out)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_token_embedding_encode(jit, table, ids, out, &cmd), &cmd);
}
