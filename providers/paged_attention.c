/* Causal paged attention with RoPE (templates/paged_attention.cu): the
 * contract of include/kiln/op_attention.h, checked here for what the host
 * knows; the kernels check what lives in device memory. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/internal.h"

#define OP "paged_attention"
#define KEY_TAG "kiln.paged_attention.1"
#define THREADS 128
#define APPEND_TOKENS 16 /* new tokens per append block (the template's) */
#define PREFILL_ROWS 16
#define MAX_SEQS 65535u  /* the grid's z */
#define GRID_X_MAX 0x7fffffffu

kiln_status kiln_op_paged_attention_page_tokens(int64_t head_dim, int64_t kv_heads, uint32_t *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (head_dim != 64 && head_dim != 128)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": head_dim %lld; supported: 64, 128",
                          (long long)head_dim);
    if (kv_heads < 1 || kv_heads * head_dim * 2 > KILN_PAGED_KV_PAGE_BYTES / 2)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": kv_heads %lld x head_dim %lld: a %u-byte page (K and V halves) must hold at least one "
                          "token, so kv_heads x head_dim must be in [1, %u]",
                          (long long)kv_heads, (long long)head_dim, KILN_PAGED_KV_PAGE_BYTES,
                          KILN_PAGED_KV_PAGE_BYTES / 4);
    *out = (uint32_t)(KILN_PAGED_KV_PAGE_BYTES / 2 / (uint64_t)(kv_heads * head_dim * 2));
    return KILN_OK;
}

static int64_t rows_for(int64_t group, int decode)
{
    if (!decode)
        return PREFILL_ROWS;
    return group <= 4 ? 4 : group <= 8 ? 8 : 16;
}

kiln_status kiln_op_paged_attention_spec(int64_t head_dim, int64_t heads, int64_t kv_heads, int decode,
                                         kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    uint32_t pt;
    kiln_status st = kiln_op_paged_attention_page_tokens(head_dim, kv_heads, &pt);
    if (st)
        return st;
    if (heads < 1 || heads > KILN_MODEL_MAX_HEADS || heads % kv_heads)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": heads %lld must be in [1, %d] and a multiple of kv_heads %lld", (long long)heads,
                          KILN_MODEL_MAX_HEADS, (long long)kv_heads);
    if ((st = kiln_spec_init(out, OP)) || (st = kiln_spec_set(out, "HEAD_DIM", head_dim)) ||
        (st = kiln_spec_set(out, "HEADS", heads)) || (st = kiln_spec_set(out, "KV_HEADS", kv_heads)) ||
        (st = kiln_spec_set(out, "PAGE_TOKENS", pt)) ||
        (st = kiln_spec_set(out, "ROWS", rows_for(heads / kv_heads, decode))))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_paged_attention_workspace(int64_t tokens, int64_t heads, int64_t head_dim, size_t *bytes)
{
    (void)tokens;
    (void)heads;
    (void)head_dim;
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    *bytes = 0;
    return KILN_OK;
}

/* Prefill and decode for the model's head layout; a layout the kernels do
 * not serve (another head_dim) adds nothing rather than failing prewarm. */
kiln_status kiln__paged_attention_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user)
{
    const int64_t d = cfg->head_dim, h = cfg->num_attention_heads, kvh = cfg->num_key_value_heads;
    if ((d != 64 && d != 128) || kvh < 1 || h % kvh || kvh * d > KILN_PAGED_KV_PAGE_BYTES / 4)
        return KILN_OK;
    kiln_spec spec;
    kiln_status st;
    for (int decode = 0; decode < 2; decode++)
        if ((st = kiln_op_paged_attention_spec(d, h, kvh, decode, &spec)) || (st = sink(user, &spec)))
            return st;
    return KILN_OK;
}

enum { B_Q, B_K, B_V, B_POS, B_TABLE, B_LENS, B_SPANS, B_OUT, B_PAGES, N_BINDINGS };
static const char *const names[N_BINDINGS] = {"q",        "k",           "v",   "positions", "block_table",
                                              "seq_lens", "query_spans", "out", "kv_pages"};

kiln_status kiln__paged_attention_check(kiln_runtime *rt, const kiln_paged_attention_desc *d,
                                        kiln__paged_attention_info *info)
{
    kiln__errslot *err = kiln__runtime_errslot(rt);
    if (!d || !info)
        return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, OP ": desc is NULL");
    if (d->size && d->size < sizeof *d)
        return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, OP ": desc size %u; expected %zu", d->size, sizeof *d);
    memset(info, 0, sizeof *info);
    size_t *bytes = info->bytes;
    kiln_status st;
    if ((st = kiln__check_tensor(err, OP, "q", d->q, rt, KILN_DTYPE_F16, 3, NULL, &bytes[B_Q])))
        return st;
    const int64_t T = d->q->dims[0], H = d->q->dims[1], D = d->q->dims[2];
    if (D != 64 && D != 128)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding q has head_dim %lld; supported: 64, 128",
                          (long long)D);
    if (T > INT32_MAX || H > KILN_MODEL_MAX_HEADS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding q is [%lld, %lld, %lld]; at most %d tokens and %d heads", (long long)T,
                          (long long)H, (long long)D, INT32_MAX, KILN_MODEL_MAX_HEADS);
    const int64_t want_kv[3] = {T, -1, D};
    if ((st = kiln__check_tensor(err, OP, "k", d->k, rt, KILN_DTYPE_F16, 3, want_kv, &bytes[B_K])))
        return st;
    const int64_t KVH = d->k->dims[1];
    if (H % KVH)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding k has %lld kv heads, which does not divide the %lld heads of q", (long long)KVH,
                          (long long)H);
    uint32_t pt;
    if ((st = kiln_op_paged_attention_page_tokens(D, KVH, &pt)))
        return kiln__propagate(err, st);
    const int64_t want_v[3] = {T, KVH, D}, want_out[3] = {T, H, D}, want_pos[1] = {T};
    if ((st = kiln__check_tensor(err, OP, "v", d->v, rt, KILN_DTYPE_F16, 3, want_v, &bytes[B_V])) ||
        (st = kiln__check_tensor(err, OP, "out", d->out, rt, KILN_DTYPE_F16, 3, want_out, &bytes[B_OUT])) ||
        (st = kiln__check_tensor(err, OP, "positions", d->positions, rt, KILN_DTYPE_U32, 1, want_pos, &bytes[B_POS])) ||
        (st = kiln__check_tensor(err, OP, "block_table", d->block_table, rt, KILN_DTYPE_U32, 2, NULL,
                                 &bytes[B_TABLE])))
        return st;
    const int64_t S = d->block_table->dims[0], MB = d->block_table->dims[1];
    if (S > (int64_t)MAX_SEQS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding block_table has %lld sequences; at most %u",
                          (long long)S, MAX_SEQS);
    if ((uint64_t)MB * pt > UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding block_table has %lld blocks per sequence of %u tokens: more than 2^32 - 1 tokens",
                          (long long)MB, pt);
    const int64_t want_lens[1] = {S}, want_spans[2] = {S, 2};
    if ((st = kiln__check_tensor(err, OP, "seq_lens", d->seq_lens, rt, KILN_DTYPE_U32, 1, want_lens, &bytes[B_LENS])) ||
        (st = kiln__check_tensor(err, OP, "query_spans", d->query_spans, rt, KILN_DTYPE_U32, 2, want_spans,
                                 &bytes[B_SPANS])))
        return st;
    /* The page arena. */
    const kiln_region *pg = d->kv_pages;
    if (!pg || !pg->buffer)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding kv_pages has no buffer");
    if (kiln__buffer_runtime(pg->buffer) != rt)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding kv_pages belongs to another runtime");
    if (pg->start >= pg->end || pg->end > kiln_buffer_size(pg->buffer))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding kv_pages [%zu, %zu) is empty or past its buffer of %zu bytes", pg->start,
                          pg->end, kiln_buffer_size(pg->buffer));
    const size_t pbytes = pg->end - pg->start;
    if (pbytes % KILN_PAGED_KV_PAGE_BYTES || pbytes / KILN_PAGED_KV_PAGE_BYTES > UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding kv_pages has %zu bytes; it must be whole %u-byte pages (at most 2^32 - 1)",
                          pbytes, KILN_PAGED_KV_PAGE_BYTES);
    if ((kiln__buffer_ptr(pg->buffer) + pg->start) % 16)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding kv_pages starts at offset %zu: its device address must be 16-byte aligned",
                          pg->start);
    bytes[B_PAGES] = pbytes;
    const uint64_t maxq = d->max_query_tokens ? d->max_query_tokens : (uint64_t)T;
    if (maxq > (uint64_t)T)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": max_query_tokens %u exceeds the %lld tokens of q",
                          d->max_query_tokens, (long long)T);
    const int64_t G = H / KVH;
    const int decode = maxq == 1;
    const uint64_t rows = (uint64_t)rows_for(G, decode), tiles = (maxq * (uint64_t)G + rows - 1) / rows;
    if (maxq * (uint64_t)G > INT32_MAX || tiles > GRID_X_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": max_query_tokens %llu x %lld heads per kv head exceeds 2^31 - 1 query rows",
                          (unsigned long long)maxq, (long long)G);
    if (!isfinite(d->rope_theta) || !(d->rope_theta > 0.0f))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": rope_theta must be a finite number > 0, got %g",
                          (double)d->rope_theta);
    /* What is written (out, kv_pages) overlaps nothing else. */
    const kiln_tensor pages_view = {.buffer = pg->buffer, .offset = pg->start};
    const kiln_tensor *t[N_BINDINGS] = {d->q, d->k, d->v, d->positions, d->block_table, d->seq_lens,
                                        d->query_spans, d->out, &pages_view};
    for (int w = B_OUT; w <= B_PAGES; w++)
        for (int i = 0; i < N_BINDINGS; i++)
            if (i != w && kiln__tensors_overlap(t[w], bytes[w], t[i], bytes[i]))
                return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding %s overlaps binding %s", names[w],
                                  names[i]);
    info->tokens = (uint32_t)T;
    info->seqs = (uint32_t)S;
    info->max_blocks = (uint32_t)MB;
    info->max_query = (uint32_t)maxq;
    info->heads = H;
    info->kv_heads = KVH;
    info->head_dim = D;
    info->page_tokens = pt;
    info->pages = (uint32_t)(pbytes / KILN_PAGED_KV_PAGE_BYTES);
    info->decode = decode;
    info->append_tiles = (uint32_t)((maxq + APPEND_TOKENS - 1) / APPEND_TOKENS);
    info->attention_tiles = (uint32_t)tiles;
    return KILN_OK;
}

typedef struct attn_launch {
    kiln_runtime *rt;
    CUfunction append, attention;
    CUdeviceptr q, k, v, pos, table, lens, spans, pages, out;
    uint32_t n_pages, max_blocks, tokens, max_query, seqs, kv_heads, append_tiles, attention_tiles;
    float qscale;
    float inv_freq[64]; /* head_dim / 2 used: the kernels' rope_freqs, by value */
} attn_launch;

static kiln_status launch3(const kiln_launch_context *ctx, kiln_runtime *rt, CUfunction fn, unsigned x, unsigned y,
                           unsigned z, void **args, const char *what)
{
    const unsigned grid[3] = {x, y, z};
    kiln_status st = kiln__launch_ex(ctx, rt, fn, grid, THREADS, 0, args, KILN__LAUNCH_PDL);
    return st ? kiln__fail(kiln__runtime_errslot(rt), st, "%s: %s", what, kiln_errmsg()) : KILN_OK;
}

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    attn_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    void *append_args[] = {&l->k,          &l->v,      &l->pos,       &l->table,     &l->lens,
                           &l->spans,      &l->pages,  &l->n_pages,   &l->max_blocks, &l->tokens,
                           &l->max_query,  l->inv_freq, &fault};
    kiln_status st = launch3(ctx, l->rt, l->append, l->append_tiles, l->kv_heads, l->seqs, append_args,
                             "cuLaunchKernel (paged_attention append)");
    if (st)
        return st;
    void *attn_args[] = {&l->q,         &l->pos,      &l->table,     &l->lens,   &l->spans,
                         &l->pages,     &l->out,      &l->n_pages,   &l->max_blocks, &l->tokens,
                         &l->max_query, &l->qscale,   l->inv_freq,   &fault};
    return launch3(ctx, l->rt, l->attention, l->attention_tiles, l->kv_heads, l->seqs, attn_args,
                   "cuLaunchKernel (paged_attention)");
}

kiln_status kiln_op_paged_attention_encode(kiln_jit *jit, const kiln_paged_attention_desc *d, kiln_command **cmd)
{
    if (!jit || !cmd)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": jit or cmd is NULL");
    *cmd = NULL;
    kiln_runtime *rt = kiln__jit_runtime(jit);
    if (!rt)
        return kiln__fail(kiln__jit_errslot(jit), KILN_ERR_NO_DEVICE, OP ": the jit has no runtime (offline)");
    kiln__errslot *err = kiln__runtime_errslot(rt);
    kiln__paged_attention_info in;
    kiln_status st = kiln__paged_attention_check(rt, d, &in);
    if (st)
        return st;
    kiln_spec spec;
    kiln_kernel *k;
    void *fa, *fb;
    if ((st = kiln_op_paged_attention_spec(in.head_dim, in.heads, in.kv_heads, in.decode, &spec)) ||
        (st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, "kiln_paged_append", &fa)) ||
        (st = kiln_kernel_function(k, "kiln_paged_attention", &fb)))
        return kiln__propagate(err, st);
    attn_launch *l = calloc(1, sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
#define PTR(t) (kiln__buffer_ptr((t)->buffer) + (t)->offset)
    l->rt = rt;
    l->append = (CUfunction)fa;
    l->attention = (CUfunction)fb;
    l->q = PTR(d->q);
    l->k = PTR(d->k);
    l->v = PTR(d->v);
    l->pos = PTR(d->positions);
    l->table = PTR(d->block_table);
    l->lens = PTR(d->seq_lens);
    l->spans = PTR(d->query_spans);
    l->out = PTR(d->out);
#undef PTR
    l->pages = kiln__buffer_ptr(d->kv_pages->buffer) + d->kv_pages->start;
    l->n_pages = in.pages;
    l->max_blocks = in.max_blocks;
    l->tokens = in.tokens;
    l->max_query = in.max_query;
    l->seqs = in.seqs;
    l->kv_heads = (uint32_t)in.kv_heads;
    l->append_tiles = in.append_tiles;
    l->attention_tiles = in.attention_tiles;
    /* Scores in the log2 domain: the kernel's softmax uses exp2. */
    l->qscale = (float)(1.4426950408889634 / sqrt((double)in.head_dim));
    for (int64_t i = 0; i < in.head_dim / 2; i++)
        l->inv_freq[i] = (float)pow((double)d->rope_theta, -2.0 * (double)i / (double)in.head_dim);

    struct {
        char tag[sizeof KEY_TAG];
        uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
        uint64_t ptrs[N_BINDINGS], bytes[N_BINDINGS];
        uint32_t tokens, seqs, max_blocks, max_query;
        float theta;
    } key;
    memset(&key, 0, sizeof key);
    memcpy(key.tag, KEY_TAG, sizeof KEY_TAG);
    memcpy(key.fingerprint, kiln_kernel_fingerprint(k), KILN_FINGERPRINT_SIZE);
    const uint64_t ptrs[N_BINDINGS] = {l->q, l->k, l->v, l->pos, l->table, l->lens, l->spans, l->out, l->pages};
    const kiln_tensor *t[N_BINDINGS - 1] = {d->q, d->k, d->v, d->positions, d->block_table, d->seq_lens,
                                            d->query_spans, d->out};
    kiln_region regions[N_BINDINGS];
    for (int i = 0; i < N_BINDINGS; i++) {
        key.ptrs[i] = ptrs[i];
        key.bytes[i] = in.bytes[i];
        regions[i] = i == B_PAGES ? *d->kv_pages
                                  : (kiln_region){t[i]->buffer, t[i]->offset, t[i]->offset + in.bytes[i]};
    }
    key.tokens = in.tokens;
    key.seqs = in.seqs;
    key.max_blocks = in.max_blocks;
    key.max_query = in.max_query;
    key.theta = d->rope_theta;
    kiln_command_desc cd = {.op_id = OP,
                            .batching = KILN_BATCHING_PACKED,
                            .participants = in.seqs,
                            .tokens = in.tokens,
                            .dispatches = 2,
                            .regions = regions,
                            .n_regions = N_BINDINGS,
                            .enqueue = enqueue,
                            .user = l,
                            .user_free = free,
                            .replay_key = &key,
                            .replay_key_bytes = sizeof key};
    if ((st = kiln_command_create(rt, &cd, cmd)))
        free(l);
    return st;
}

kiln_status kiln_op_paged_attention(kiln_jit *jit, const kiln_paged_attention_desc *d)
{
    kiln_command *cmd;
    kiln_status st = kiln_op_paged_attention_encode(jit, d, &cmd);
    if (st)
        return st;
    st = kiln_stream_submit(kiln_runtime_stream(kiln__jit_runtime(jit)), &cmd, 1, NULL, NULL);
    kiln_command_release(cmd);
    return st;
}
