/* The decoder's engine: buffers, the binding arena, the paged KV cache, the
 * commands of a step, prefill and decode, and the decode-step benchmark. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "decoder.h"

kiln_status dec_fail(kiln_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
kiln_status dec_kfail(kiln_status st, const char *what);

enum { SLOT_IDS, SLOT_POS, SLOT_LENS, SLOT_SPANS, SLOT_TABLE, N_SLOTS };

/* The commands of one step shape (tokens, participants). */
typedef struct step_cmds {
    kiln_command **cmd;
    const char **label; /* what each command is ("q_proj", ...): static strings */
    size_t n;
} step_cmds;

struct dec_engine {
    kiln_jit *jit;
    kiln_stream *s;
    kiln_runtime *rt;
    const dec_model *m;
    dec_engine_options o;
    int64_t H, I, V, NH, KVH, HD, QD, KVD, QKVD; /* QKVD: a fused q | k | v row */
    float eps, theta;
    uint32_t page_tokens, max_blocks, pages_per_layer, max_rows;
    kiln_buffer *res, *norm, *qkv, *attn, *act, *logits, *ws, *kv;
    kiln_buffer *valid, *rep_ids, *rep_off, *penalty, *am_ws, *next;
    kiln_binding_arena *arena;
    kiln_buffer *ab; /* the arena's buffer (borrowed) */
    kiln_binding_slot slots[N_SLOTS];
    step_cmds *decode; /* [max_participants + 1]: decode commands per batch size, encoded on first use */
    step_cmds prefill; /* the prefill benchmark's step, kept for its breakdown */
    uint32_t prefill_seqs, prefill_tokens;
    /* host staging of the arena's slots */
    uint32_t *ids, *pos, *lens, *spans, *table;
    uint16_t *logits_host;
    uint32_t *next_host;
};

static size_t up256(size_t n) { return (n + 255) / 256 * 256; }

static kiln_tensor tensor(kiln_buffer *b, size_t off, kiln_dtype dt, uint32_t rank, int64_t d0, int64_t d1,
                          int64_t d2)
{
    kiln_tensor t = {.buffer = b, .offset = off, .dtype = dt, .rank = rank, .dims = {d0, d1, d2, 0}};
    return t;
}

static kiln_status buf(dec_engine *e, size_t bytes, kiln_buffer **out, const char *what)
{
    kiln_status st = kiln_buffer_create(e->rt, bytes ? bytes : 256, 256, out);
    if (st) {
        char w[160];
        snprintf(w, sizeof w, "allocating %s (%zu bytes)", what, bytes);
        return dec_kfail(st, w);
    }
    return KILN_OK;
}

uint64_t dec_engine_kv_bytes(const dec_engine *e) { return kiln_buffer_size(e->kv); }

kiln_status dec_engine_create(kiln_jit *jit, kiln_stream *s, const dec_model *m, const dec_engine_options *o,
                              dec_engine **out)
{
    *out = NULL;
    if (!o->max_participants || !o->max_prefill_tokens || !o->max_seq_tokens || o->max_participants > 65535)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "engine: participants %u (1..65535), prefill tokens %u, "
                                                   "sequence tokens %u must be > 0",
                        o->max_participants, o->max_prefill_tokens, o->max_seq_tokens);
    dec_engine *e = calloc(1, sizeof *e);
    if (!e)
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    const kiln_model_config *c = &m->config.base;
    e->jit = jit;
    e->s = s;
    e->rt = m->rt;
    e->m = m;
    e->o = *o;
    e->H = c->hidden_size;
    e->I = c->intermediate_size;
    e->V = c->vocab_size;
    e->NH = c->num_attention_heads;
    e->KVH = c->num_key_value_heads;
    e->HD = c->head_dim;
    e->QD = e->NH * e->HD;
    e->KVD = e->KVH * e->HD;
    e->QKVD = e->QD + 2 * e->KVD;
    e->eps = (float)c->rms_norm_eps;
    e->theta = (float)c->rope_theta;
    const uint32_t P = o->max_participants;
    e->max_rows = o->max_prefill_tokens > P ? o->max_prefill_tokens : P;
    const size_t R = e->max_rows;
    kiln_status st = kiln_op_paged_attention_page_tokens(e->HD, e->KVH, &e->page_tokens);
    if (st) {
        dec_kfail(st, "page tokens");
        goto fail;
    }
    e->max_blocks = (o->max_seq_tokens + e->page_tokens - 1) / e->page_tokens;
    e->pages_per_layer = P * e->max_blocks;
    /* The workspace: the largest any command of a step asks for. */
    size_t ws = 0, w;
    const int64_t outs[3] = {e->QKVD, e->H, e->H};
    const int64_t ins[3] = {e->H, e->QD, e->I};
    for (int i = 0; i < 3; i++) {
        if ((st = kiln_op_dense_linear_workspace((int64_t)R, ins[i], outs[i], &w))) {
            dec_kfail(st, "linear workspace");
            goto fail;
        }
        ws = w > ws ? w : ws;
    }
    for (int i = 1; i < 3; i++) {
        if ((st = kiln_op_dense_linear_norm_workspace((int64_t)R, ins[i], e->H, &w))) {
            dec_kfail(st, "linear-norm workspace");
            goto fail;
        }
        ws = w > ws ? w : ws;
    }
    if ((st = kiln_op_dense_swiglu_workspace((int64_t)R, e->H, e->I, &w))) {
        dec_kfail(st, "swiglu workspace");
        goto fail;
    }
    ws = w > ws ? w : ws;
    if ((st = kiln_op_last_token_linear_workspace(P, e->H, e->V, &w))) {
        dec_kfail(st, "last-token linear workspace");
        goto fail;
    }
    ws = w > ws ? w : ws;
    /* Attention's split-KV decode: the most any batch size up to P asks for. */
    for (uint32_t b = 1; b <= P; b++) {
        if ((st = kiln_op_paged_attention_workspace(b, e->NH, e->KVH, e->HD, 1, &w))) {
            dec_kfail(st, "attention workspace");
            goto fail;
        }
        ws = w > ws ? w : ws;
    }
    size_t am_ws;
    if ((st = kiln_op_masked_argmax_workspace(e->V, P, &am_ws))) {
        dec_kfail(st, "argmax workspace");
        goto fail;
    }
    const size_t kv_bytes = (size_t)m->config.layers * e->pages_per_layer * (size_t)KILN_PAGED_KV_PAGE_BYTES;
    if ((st = buf(e, R * e->H * 2, &e->res, "residual")) ||
        (st = buf(e, R * e->H * 2, &e->norm, "normed")) || (st = buf(e, R * e->QKVD * 2, &e->qkv, "qkv")) ||
        (st = buf(e, R * e->QD * 2, &e->attn, "attention out")) ||
        (st = buf(e, R * e->I * 2, &e->act, "mlp activations")) ||
        (st = buf(e, (size_t)P * e->V * 2, &e->logits, "logits")) || (st = buf(e, ws, &e->ws, "workspace")) ||
        (st = buf(e, kv_bytes, &e->kv, "KV pages")) || (st = buf(e, (size_t)e->V, &e->valid, "valid mask")) ||
        (st = buf(e, 4, &e->rep_ids, "repetition ids")) ||
        (st = buf(e, (size_t)(P + 1) * 4, &e->rep_off, "repetition offsets")) ||
        (st = buf(e, 4, &e->penalty, "penalty")) || (st = buf(e, am_ws, &e->am_ws, "argmax workspace")) ||
        (st = buf(e, (size_t)P * 4, &e->next, "next tokens")))
        goto fail;
    const float one = 1.0f;
    if ((st = kiln_buffer_fill(e->valid, 0, 1, (size_t)e->V)) ||
        (st = kiln_buffer_fill(e->rep_off, 0, 0, (size_t)(P + 1) * 4)) ||
        (st = kiln_buffer_fill(e->rep_ids, 0, 0, 4)) || (st = kiln_buffer_upload(e->penalty, 0, &one, 4)) ||
        (st = kiln_buffer_fill(e->kv, 0, 0, kv_bytes)) || (st = kiln_runtime_synchronize(e->rt))) {
        dec_kfail(st, "initializing buffers");
        goto fail;
    }
    const size_t slot_bytes[N_SLOTS] = {R * 4, R * 4, (size_t)P * 4, (size_t)P * 8, (size_t)P * e->max_blocks * 4};
    size_t at = 0;
    for (int i = 0; i < N_SLOTS; i++) {
        e->slots[i].offset = at;
        e->slots[i].bytes = up256(slot_bytes[i]);
        at += e->slots[i].bytes;
    }
    if ((st = kiln_binding_arena_create(e->rt, e->slots, N_SLOTS, at, &e->arena))) {
        dec_kfail(st, "binding arena");
        goto fail;
    }
    e->ab = kiln_binding_arena_buffer(e->arena);
    e->decode = calloc((size_t)P + 1, sizeof *e->decode);
    e->ids = calloc(R, 4);
    e->pos = calloc(R, 4);
    e->lens = calloc(P, 4);
    e->spans = calloc(P, 8);
    e->table = calloc((size_t)P * e->max_blocks, 4);
    e->logits_host = malloc((size_t)P * e->V * 2);
    e->next_host = calloc(P, 4);
    if (!e->decode || !e->ids || !e->pos || !e->lens || !e->spans || !e->table || !e->logits_host ||
        !e->next_host) {
        st = dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        goto fail;
    }
    *out = e;
    return KILN_OK;
fail:
    dec_engine_free(e);
    return st;
}

static void cmds_release(step_cmds *c)
{
    for (size_t i = 0; i < c->n; i++)
        kiln_command_release(c->cmd[i]);
    free(c->cmd);
    free(c->label);
    c->cmd = NULL;
    c->label = NULL;
    c->n = 0;
}

void dec_engine_free(dec_engine *e)
{
    if (!e)
        return;
    if (e->s)
        kiln_stream_synchronize(e->s);
    if (e->decode)
        for (uint32_t p = 0; p <= e->o.max_participants; p++)
            cmds_release(&e->decode[p]);
    free(e->decode);
    cmds_release(&e->prefill);
    kiln_buffer *all[] = {e->res,    e->norm,  e->qkv,   e->attn,    e->act,
                          e->logits, e->ws,     e->kv,    e->valid, e->rep_ids, e->rep_off,
                          e->penalty, e->am_ws, e->next};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        kiln_buffer_destroy(all[i]);
    kiln_binding_arena_destroy(e->arena);
    free(e->ids);
    free(e->pos);
    free(e->lens);
    free(e->spans);
    free(e->table);
    free(e->logits_host);
    free(e->next_host);
    free(e);
}

/* ---- the commands of a step ---- */

/* st is the status of the encode call that set *cmdp (read here, after the
 * call: the order in which arguments are evaluated is unspecified). */
static kiln_status push(step_cmds *c, size_t cap, kiln_status st, kiln_command **cmdp, const char *what, int64_t layer)
{
    kiln_command *cmd = *cmdp;
    *cmdp = NULL;
    if (st) {
        char w[160];
        snprintf(w, sizeof w, "encoding %s (layer %lld)", what, (long long)layer);
        return dec_kfail(st, w);
    }
    if (c->n == cap) {
        kiln_command_release(cmd);
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "too many commands");
    }
    c->label[c->n] = what;
    c->cmd[c->n++] = cmd;
    return KILN_OK;
}

/* T tokens of S sequences; each has at most maxq new tokens (1: decode). */
static kiln_status encode_step(dec_engine *e, uint32_t T, uint32_t S, uint32_t maxq, step_cmds *out)
{
    const dec_model *m = e->m;
    const size_t cap = 4 + (size_t)m->config.layers * 7;
    step_cmds c = {calloc(cap, sizeof(kiln_command *)), calloc(cap, sizeof(const char *)), 0};
    if (!c.cmd || !c.label) {
        cmds_release(&c);
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    }
    const kiln_dtype F = KILN_DTYPE_F16, U = KILN_DTYPE_U32;
    kiln_tensor res = tensor(e->res, 0, F, 2, T, e->H, 0),
                nrm = tensor(e->norm, 0, F, 2, T, e->H, 0), qkv = tensor(e->qkv, 0, F, 2, T, e->QKVD, 0),
                at3 = tensor(e->attn, 0, F, 3, T, e->NH, e->HD),
                at = tensor(e->attn, 0, F, 2, T, e->QD, 0), act = tensor(e->act, 0, F, 2, T, e->I, 0),
                ids = tensor(e->ab, e->slots[SLOT_IDS].offset, U, 1, T, 0, 0),
                pos = tensor(e->ab, e->slots[SLOT_POS].offset, U, 1, T, 0, 0),
                lens = tensor(e->ab, e->slots[SLOT_LENS].offset, U, 1, S, 0, 0),
                spans = tensor(e->ab, e->slots[SLOT_SPANS].offset, U, 2, S, 2, 0),
                table = tensor(e->ab, e->slots[SLOT_TABLE].offset, U, 2, S, e->max_blocks, 0),
                embed = tensor(m->embed, 0, F, 2, e->V, e->H, 0),
                head = tensor(m->lm_head, 0, F, 2, e->V, e->H, 0),
                logits = tensor(e->logits, 0, F, 2, S, e->V, 0);
    const kiln_region ws = {e->ws, 0, kiln_buffer_size(e->ws)};
    kiln_command *cmd = NULL;
    kiln_status st;
    if ((st = push(&c, cap, kiln_op_token_embedding_encode(e->jit, &embed, &ids, &res, &cmd), &cmd, "embedding", -1)))
        goto fail;
    /* Layer 0 normalizes the embedding (already in the residual); each
     * product that adds to the residual (o_proj, down_proj) comes with the
     * norm after it (the post-attention norm; the next layer's input norm, or
     * the final norm): one command, kiln_op_dense_linear_norm. */
    kiln_tensor in0 = tensor(m->layer[0].in_norm, 0, F, 1, e->H, 0, 0);
    if ((st = push(&c, cap, kiln_op_rms_norm_encode(e->jit, &res, &in0, e->eps, &nrm, &cmd), &cmd, "input norm", 0)))
        goto fail;
    for (int64_t l = 0; l < m->config.layers; l++) {
        const dec_layer *L = &m->layer[l];
        kiln_buffer *next_norm = l + 1 < m->config.layers ? m->layer[l + 1].in_norm : m->final_norm;
        kiln_tensor post_w = tensor(L->post_norm, 0, F, 1, e->H, 0, 0),
                    next_w = tensor(next_norm, 0, F, 1, e->H, 0, 0),
                    wqkv = tensor(L->wqkv, 0, F, 2, e->QKVD, e->H, 0), wo = tensor(L->wo, 0, F, 2, e->H, e->QD, 0),
                    gu = tensor(L->w_gate_up, 0, F, 2, 2 * e->I, e->H, 0),
                    wd = tensor(L->w_down, 0, F, 2, e->H, e->I, 0), bqkv = tensor(L->bqkv, 0, F, 1, e->QKVD, 0, 0);
        if ((st = push(&c, cap,
                       kiln_op_dense_linear_encode(e->jit, &nrm, &wqkv, L->bqkv ? &bqkv : NULL, &qkv, &ws, &cmd), &cmd,
                       "qkv_proj", l)))
            goto fail;
        const size_t layer_bytes = (size_t)e->pages_per_layer * KILN_PAGED_KV_PAGE_BYTES;
        kiln_region pages = {e->kv, (size_t)l * layer_bytes, (size_t)(l + 1) * layer_bytes};
        kiln_paged_attention_desc d = {.size = sizeof d, .qkv = &qkv, .positions = &pos, .block_table = &table,
                                       .seq_lens = &lens, .query_spans = &spans, .out = &at3, .kv_pages = &pages,
                                       .rope_theta = e->theta, .max_query_tokens = maxq, .workspace = &ws};
        if ((st = push(&c, cap, kiln_op_paged_attention_encode(e->jit, &d, &cmd), &cmd, "attention", l)) ||
            (st = push(&c, cap,
                       kiln_op_dense_linear_norm_encode(e->jit, &at, &wo, &res, &post_w, e->eps, &nrm, &ws, &cmd), &cmd,
                       "o_proj", l)) ||
            (st = push(&c, cap, kiln_op_dense_swiglu_encode(e->jit, &nrm, &gu, &act, &ws, &cmd), &cmd, "swiglu", l)) ||
            (st = push(&c, cap,
                       kiln_op_dense_linear_norm_encode(e->jit, &act, &wd, &res, &next_w, e->eps, &nrm, &ws, &cmd),
                       &cmd, "down_proj", l)))
            goto fail;
    }
    kiln_tensor valid = tensor(e->valid, 0, KILN_DTYPE_U8, 1, e->V, 0, 0),
                rep_ids = tensor(e->rep_ids, 0, U, 1, 1, 0, 0), rep_off = tensor(e->rep_off, 0, U, 1, S + 1, 0, 0),
                pen = tensor(e->penalty, 0, KILN_DTYPE_F32, 1, 1, 0, 0),
                amws = tensor(e->am_ws, 0, KILN_DTYPE_U8, 1, (int64_t)kiln_buffer_size(e->am_ws), 0, 0),
                next = tensor(e->next, 0, U, 1, S, 0, 0);
    kiln_masked_argmax_bindings ab = {.size = sizeof ab, .logits = &logits, .valid = &valid, .rep_ids = &rep_ids,
                                      .rep_offsets = &rep_off, .penalty = &pen, .workspace = &amws, .out = &next};
    if ((st = push(&c, cap, kiln_op_last_token_linear_encode(e->jit, &nrm, &spans, &head, NULL, &logits, &ws, &cmd),
                   &cmd, "lm_head", -1)) ||
        (st = push(&c, cap, kiln_op_masked_argmax_encode(e->jit, &ab, &cmd), &cmd, "argmax", -1)))
        goto fail;
    *out = c;
    return KILN_OK;
fail:
    cmds_release(&c);
    return st;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Submits one step: ids and positions of T rows, lengths of S sequences,
 * and (when all) the spans and block table rows too. */
static kiln_status submit_step(dec_engine *e, const step_cmds *c, uint32_t T, uint32_t S, int all, const char *phase,
                               kiln_timing timing, kiln_fence **fence)
{
    kiln_binding_patch p[N_SLOTS] = {
        {SLOT_IDS, 0, e->ids, (size_t)T * 4},     {SLOT_POS, 0, e->pos, (size_t)T * 4},
        {SLOT_LENS, 0, e->lens, (size_t)S * 4},   {SLOT_SPANS, 0, e->spans, (size_t)S * 8},
        {SLOT_TABLE, 0, e->table, (size_t)S * e->max_blocks * 4}};
    kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_ADAPTIVE, .timing = timing, .phase = phase,
                              .arena = e->arena, .patches = p, .n_patches = all ? 5 : 3};
    kiln_status st = kiln_stream_submit(e->s, c->cmd, c->n, &so, fence);
    return st ? dec_kfail(st, phase) : KILN_OK;
}

/* Waits for a step, counts how its commands ran, reads back the next tokens
 * (and the logits when asked). */
static kiln_status finish_step(dec_engine *e, kiln_fence *fence, size_t n_cmds, uint32_t S, int want_logits,
                               dec_stats *stats)
{
    kiln_status st = kiln_fence_wait(fence);
    if (st) {
        kiln_fence_release(fence);
        return dec_kfail(st, "step");
    }
    for (size_t i = 0; i < n_cmds && stats; i++) {
        kiln_attribution a;
        if (kiln_fence_attribution(fence, i, &a) == KILN_OK) {
            if (a.path == KILN_EXEC_REPLAYED)
                stats->replayed_commands++;
            else
                stats->eager_commands++;
        }
    }
    kiln_fence_release(fence);
    kiln_region nr = {e->next, 0, (size_t)S * 4};
    if ((st = kiln_stream_readback(e->s, &nr, e->next_host)))
        return dec_kfail(st, "reading the next tokens");
    if (want_logits) {
        kiln_region lr = {e->logits, 0, (size_t)S * e->V * 2};
        if ((st = kiln_stream_readback(e->s, &lr, e->logits_host)))
            return dec_kfail(st, "reading the logits");
    }
    return KILN_OK;
}

static kiln_status decode_cmds(dec_engine *e, uint32_t P, dec_stats *stats, const step_cmds **out)
{
    step_cmds *c = &e->decode[P];
    if (!c->n) {
        double t0 = now_s();
        kiln_status st = encode_step(e, P, P, 1, c);
        if (stats)
            stats->encode_s += now_s() - t0;
        if (st)
            return st;
    }
    *out = c;
    return KILN_OK;
}

static void set_rows(dec_engine *e, uint32_t row, uint32_t seq_slot)
{
    for (uint32_t b = 0; b < e->max_blocks; b++)
        e->table[(size_t)row * e->max_blocks + b] = seq_slot * e->max_blocks + b;
}

static int is_eos(uint32_t t, const int64_t *eos, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((int64_t)t == eos[i])
            return 1;
    return 0;
}

kiln_status dec_generate(dec_engine *e, const dec_request *reqs, size_t n, const int64_t *eos, size_t n_eos,
                         dec_logits_fn logits_fn, void *user, dec_result *res, dec_stats *stats)
{
    dec_stats local;
    if (!stats)
        stats = &local;
    memset(stats, 0, sizeof *stats);
    if (!n || n > e->o.max_participants)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "generate: %zu requests; the engine takes 1 to %u", n,
                        e->o.max_participants);
    uint64_t total = 0;
    uint32_t maxq = 0;
    for (size_t i = 0; i < n; i++) {
        const dec_request *r = &reqs[i];
        if (!r->prompt_len || !r->max_new || (uint64_t)r->prompt_len + r->max_new - 1 > e->o.max_seq_tokens)
            return dec_fail(KILN_ERR_INVALID_ARGUMENT,
                            "generate: request %zu: prompt of %u tokens and %u new ones (each >= 1; together at "
                            "most %u + 1)",
                            i, r->prompt_len, r->max_new, e->o.max_seq_tokens);
        for (uint32_t t = 0; t < r->prompt_len; t++)
            if (r->prompt[t] >= (uint64_t)e->V)
                return dec_fail(KILN_ERR_INVALID_ARGUMENT, "generate: request %zu: token %u = %u is past the vocabulary (%lld)",
                                i, t, r->prompt[t], (long long)e->V);
        total += r->prompt_len;
        maxq = r->prompt_len > maxq ? r->prompt_len : maxq;
        res[i].n = 0;
        res[i].stopped_at_eos = 0;
    }
    if (total > e->o.max_prefill_tokens)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "generate: %llu prompt tokens; the engine takes at most %u",
                        (unsigned long long)total, e->o.max_prefill_tokens);
    /* ---- prefill: every prompt in one packed step ---- */
    const uint32_t T = (uint32_t)total, S = (uint32_t)n;
    uint32_t row = 0;
    for (uint32_t i = 0; i < S; i++) {
        for (uint32_t t = 0; t < reqs[i].prompt_len; t++) {
            e->ids[row + t] = reqs[i].prompt[t];
            e->pos[row + t] = t;
        }
        e->lens[i] = reqs[i].prompt_len;
        e->spans[2 * i] = row;
        e->spans[2 * i + 1] = reqs[i].prompt_len;
        set_rows(e, i, i);
        row += reqs[i].prompt_len;
    }
    step_cmds pre;
    double t0 = now_s();
    kiln_status st = encode_step(e, T, S, maxq, &pre);
    stats->encode_s += now_s() - t0;
    if (st)
        return st;
    kiln_fence *fence = NULL;
    t0 = now_s();
    st = submit_step(e, &pre, T, S, 1, "prefill", KILN_TIMING_OFF, &fence);
    if (!st)
        st = finish_step(e, fence, pre.n, S, logits_fn != NULL, stats);
    stats->prefill_s = now_s() - t0;
    cmds_release(&pre);
    if (st)
        return st;
    stats->prefill_tokens = T;
    uint32_t *active = malloc(n * sizeof *active);
    if (!active)
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    uint32_t P = 0;
    for (uint32_t i = 0; i < S; i++) {
        uint32_t tok = e->next_host[i];
        if (logits_fn)
            logits_fn(user, i, 0, e->logits_host + (size_t)i * e->V, (size_t)e->V);
        if (tok >= (uint64_t)e->V) {
            free(active);
            return dec_fail(KILN_ERR_DEVICE_CONTRACT, "prefill: participant %u: no token chosen (%u)", i, tok);
        }
        res[i].tokens[res[i].n++] = tok;
        if (is_eos(tok, eos, n_eos))
            res[i].stopped_at_eos = 1;
        else if (res[i].n < reqs[i].max_new)
            active[P++] = i;
    }
    /* ---- decode: one step per new token of the batch ---- */
    uint32_t last_P = 0;
    t0 = now_s();
    for (uint32_t step = 1; P; step++) {
        const step_cmds *c;
        if ((st = decode_cmds(e, P, stats, &c)))
            break;
        int changed = P != last_P;
        for (uint32_t j = 0; j < P; j++) {
            const uint32_t i = active[j];
            e->ids[j] = res[i].tokens[res[i].n - 1];
            e->pos[j] = reqs[i].prompt_len + res[i].n - 1;
            e->lens[j] = e->pos[j] + 1;
            e->spans[2 * j] = j;
            e->spans[2 * j + 1] = 1;
            set_rows(e, j, i);
        }
        if ((st = submit_step(e, c, P, P, changed, "decode", KILN_TIMING_OFF, &fence)) ||
            (st = finish_step(e, fence, c->n, P, logits_fn != NULL, stats)))
            break;
        last_P = P;
        stats->decode_steps++;
        uint32_t still = 0;
        for (uint32_t j = 0; j < P; j++) {
            const uint32_t i = active[j], tok = e->next_host[j];
            if (logits_fn)
                logits_fn(user, i, step, e->logits_host + (size_t)j * e->V, (size_t)e->V);
            if (tok >= (uint64_t)e->V) {
                st = dec_fail(KILN_ERR_DEVICE_CONTRACT, "decode step %u: participant %u: no token chosen (%u)", step,
                              i, tok);
                break;
            }
            res[i].tokens[res[i].n++] = tok;
            stats->decode_tokens++;
            if (is_eos(tok, eos, n_eos))
                res[i].stopped_at_eos = 1;
            else if (res[i].n < reqs[i].max_new)
                active[still++] = i;
        }
        if (st)
            break;
        P = still;
    }
    stats->decode_s = now_s() - t0;
    free(active);
    return st;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

kiln_status dec_bench_steps(dec_engine *e, uint32_t batch, uint32_t context, int warmup, int steps,
                            double *device_ms, double *wall_ms, uint64_t *replayed_commands)
{
    if (!batch || batch > e->o.max_participants || !context || context > e->o.max_seq_tokens || steps < 1)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "bench: batch %u (1..%u), context %u (1..%u), steps %d", batch,
                        e->o.max_participants, context, e->o.max_seq_tokens, steps);
    const step_cmds *c;
    dec_stats stats = {0};
    kiln_status st = decode_cmds(e, batch, &stats, &c);
    if (st)
        return st;
    for (uint32_t j = 0; j < batch; j++) {
        e->ids[j] = (j * 7919u + 1) % (uint32_t)e->V;
        e->pos[j] = context - 1;
        e->lens[j] = context;
        e->spans[2 * j] = j;
        e->spans[2 * j + 1] = 1;
        set_rows(e, j, j);
    }
    kiln_fence *fence;
    for (int i = 0; i < warmup; i++) {
        if ((st = submit_step(e, c, batch, batch, i == 0, "decode", KILN_TIMING_OFF, &fence)) ||
            (st = finish_step(e, fence, c->n, batch, 0, &stats)))
            return st;
    }
    double *ms = calloc((size_t)steps, sizeof *ms);
    if (!ms)
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (int i = 0; i < steps && !st; i++) {
        if ((st = submit_step(e, c, batch, batch, 1, "decode", KILN_TIMING_COMPLETION, &fence)))
            break;
        if ((st = kiln_fence_wait(fence))) {
            dec_kfail(st, "bench step");
        } else {
            kiln_receipt r;
            if ((st = kiln_fence_receipt(fence, &r)))
                dec_kfail(st, "receipt");
            ms[i] = r.elapsed_ms;
            for (size_t k = 0; k < c->n; k++) {
                kiln_attribution a;
                if (kiln_fence_attribution(fence, k, &a) == KILN_OK && a.path == KILN_EXEC_REPLAYED)
                    stats.replayed_commands++;
            }
        }
        kiln_fence_release(fence);
    }
    if (!st) {
        qsort(ms, (size_t)steps, sizeof *ms, cmp_double);
        *device_ms = ms[steps / 2];
        double t0 = now_s();
        for (int i = 0; i < steps && !st; i++)
            st = submit_step(e, c, batch, batch, 0, "decode", KILN_TIMING_OFF, NULL);
        if (!st && (st = kiln_stream_synchronize(e->s)))
            dec_kfail(st, "bench synchronize");
        *wall_ms = (now_s() - t0) * 1e3 / steps;
        *replayed_commands = stats.replayed_commands;
    }
    free(ms);
    return st;
}

/* Bytes a decode step's command of that label must read (weights, KV). */
static double label_bytes(const dec_engine *e, const char *label, uint32_t batch, uint32_t context)
{
    const double H = (double)e->H, I = (double)e->I, Q = (double)e->QD, KV = (double)e->KVD, L = (double)e->m->config.layers;
    if (!strcmp(label, "qkv_proj"))
        return 2 * H * (Q + 2 * KV) * L;
    if (!strcmp(label, "o_proj"))
        return 2 * H * Q * L;
    if (!strcmp(label, "swiglu"))
        return 2 * 2 * I * H * L;
    if (!strcmp(label, "down_proj"))
        return 2 * I * H * L;
    if (!strcmp(label, "lm_head"))
        return 2 * (double)e->V * H;
    if (!strcmp(label, "attention"))
        return 2 * 2 * (double)batch * context * KV * L;
    return 0;
}

enum { MAX_LABELS = 16 };

/* Milliseconds per kind of command (its label), in the order first met. */
typedef struct label_times {
    const char *name[MAX_LABELS];
    double ms[MAX_LABELS], total;
    size_t n;
} label_times;

/* Runs c once, eager, every command timed (spans), and sums the times by label. */
static kiln_status time_by_label(dec_engine *e, const step_cmds *c, const kiln_binding_patch *p, size_t n_patches,
                                 const char *phase, label_times *out)
{
    memset(out, 0, sizeof *out);
    kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_EAGER_ONLY, .timing = KILN_TIMING_SPANS,
                              .phase = phase, .arena = e->arena, .patches = p, .n_patches = n_patches};
    kiln_fence *fence;
    kiln_status st = kiln_stream_submit(e->s, c->cmd, c->n, &so, &fence);
    if (st)
        return dec_kfail(st, "breakdown");
    if ((st = kiln_fence_wait(fence))) {
        kiln_fence_release(fence);
        return dec_kfail(st, "breakdown");
    }
    for (size_t i = 0; i < c->n; i++) {
        kiln_attribution a;
        kiln_span sp;
        if (kiln_fence_attribution(fence, i, &a) || a.span < 0 || kiln_fence_span(fence, (size_t)a.span, &sp))
            continue;
        size_t k = 0;
        while (k < out->n && strcmp(out->name[k], c->label[i]))
            k++;
        if (k == out->n) {
            if (out->n == MAX_LABELS)
                continue;
            out->name[out->n++] = c->label[i];
        }
        out->ms[k] += sp.duration_ms;
        out->total += sp.duration_ms;
    }
    kiln_fence_release(fence);
    return KILN_OK;
}

kiln_status dec_bench_breakdown(dec_engine *e, uint32_t batch, uint32_t context, FILE *out)
{
    if (batch > e->o.max_participants || !e->decode[batch].n)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "breakdown: run dec_bench_steps for batch %u first", batch);
    kiln_binding_patch p[3] = {{SLOT_IDS, 0, e->ids, (size_t)batch * 4},
                               {SLOT_POS, 0, e->pos, (size_t)batch * 4},
                               {SLOT_LENS, 0, e->lens, (size_t)batch * 4}};
    label_times t;
    kiln_status st = time_by_label(e, &e->decode[batch], p, 3, "decode", &t);
    if (st)
        return st;
    fprintf(out, "{\"bench\":\"decode_step_ops\",\"impl\":\"kiln\",\"path\":\"eager\",\"batch\":%u,\"context\":%u,"
                 "\"sum_ms\":%.4f,\"ops\":{", batch, context, t.total);
    for (size_t k = 0; k < t.n; k++) {
        double b = label_bytes(e, t.name[k], batch, context);
        fprintf(out, "%s\"%s\":{\"ms\":%.4f", k ? "," : "", t.name[k], t.ms[k]);
        if (b > 0 && t.ms[k] > 0)
            fprintf(out, ",\"gb\":%.3f,\"gb_s\":%.0f", b / 1e9, b / (t.ms[k] * 1e-3) / 1e9);
        fprintf(out, "}");
    }
    fprintf(out, "}}\n");
    return KILN_OK;
}

/* ---- the prefill benchmark ---- */

double dec_prefill_flops(const dec_config *c, const char *label, uint32_t seqs, uint32_t tokens)
{
    const kiln_model_config *b = &c->base;
    const double H = (double)b->hidden_size, I = (double)b->intermediate_size, V = (double)b->vocab_size,
                 Q = (double)b->num_attention_heads * (double)b->head_dim,
                 KV = (double)b->num_key_value_heads * (double)b->head_dim, L = (double)c->layers,
                 S = (double)seqs, N = (double)tokens, T = S * N;
    const struct {
        const char *label;
        double flops;
    } parts[] = {
        {"qkv_proj", 2 * T * H * (Q + 2 * KV) * L},
        {"o_proj", 2 * T * Q * H * L},
        {"swiglu", 2 * T * H * 2 * I * L},
        {"down_proj", 2 * T * I * H * L},
        /* q.k and p.v, 2 x heads x head_dim each, over every (query, key at or before it) pair. */
        {"attention", 2 * 2 * Q * S * N * (N + 1) / 2 * L},
        {"lm_head", 2 * S * V * H},
    };
    double sum = 0;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        if (label && !strcmp(label, parts[i].label))
            return parts[i].flops;
        sum += parts[i].flops;
    }
    return label ? 0 : sum;
}

/* The patches of a prefill step of T rows and S sequences: every slot. */
static void prefill_patches(dec_engine *e, uint32_t T, uint32_t S, kiln_binding_patch p[N_SLOTS])
{
    const kiln_binding_patch all[N_SLOTS] = {
        {SLOT_IDS, 0, e->ids, (size_t)T * 4},     {SLOT_POS, 0, e->pos, (size_t)T * 4},
        {SLOT_LENS, 0, e->lens, (size_t)S * 4},   {SLOT_SPANS, 0, e->spans, (size_t)S * 8},
        {SLOT_TABLE, 0, e->table, (size_t)S * e->max_blocks * 4}};
    memcpy(p, all, sizeof all);
}

kiln_status dec_bench_prefill(dec_engine *e, uint32_t seqs, uint32_t tokens, int warmup, int iters,
                              double budget_ms, dec_prefill_times *out)
{
    memset(out, 0, sizeof *out);
    if (!seqs || seqs > e->o.max_participants || !tokens || tokens > e->o.max_seq_tokens ||
        (uint64_t)seqs * tokens > e->o.max_prefill_tokens || warmup < 0 || iters < 1)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT,
                        "prefill bench: %u sequences (1..%u) of %u tokens (1..%u, %u in all), warmup %d, iters %d",
                        seqs, e->o.max_participants, tokens, e->o.max_seq_tokens, e->o.max_prefill_tokens, warmup,
                        iters);
    const uint32_t T = seqs * tokens;
    for (uint32_t i = 0; i < seqs; i++) {
        for (uint32_t t = 0; t < tokens; t++) {
            const uint32_t row = i * tokens + t;
            e->ids[row] = (row * 7919u + 1) % (uint32_t)e->V;
            e->pos[row] = t;
        }
        e->lens[i] = tokens;
        e->spans[2 * i] = i * tokens;
        e->spans[2 * i + 1] = tokens;
        set_rows(e, i, i);
    }
    cmds_release(&e->prefill);
    kiln_status st = encode_step(e, T, seqs, tokens, &e->prefill);
    if (st)
        return st;
    e->prefill_seqs = seqs;
    e->prefill_tokens = tokens;
    const step_cmds *c = &e->prefill;
    out->commands = c->n;
    kiln_binding_patch p[N_SLOTS];
    prefill_patches(e, T, seqs, p);
    kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_ADAPTIVE, .timing = KILN_TIMING_OFF,
                              .phase = "prefill", .arena = e->arena, .patches = p, .n_patches = N_SLOTS};
    kiln_fence *fence;
    /* The first submission, on a quiet stream, captures the step's graph; the rest replay it. */
    for (int i = 0; i < warmup; i++) {
        if ((st = kiln_stream_submit(e->s, c->cmd, c->n, &so, &fence)))
            return dec_kfail(st, "prefill warmup");
        st = kiln_fence_wait(fence);
        kiln_fence_release(fence);
        if (st)
            return dec_kfail(st, "prefill warmup");
    }
    double *ms = calloc((size_t)iters * 2, sizeof *ms), *wall = ms + iters, spent = 0;
    if (!ms)
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    so.timing = KILN_TIMING_COMPLETION;
    int n = 0;
    while (n < iters && !st && (n < 3 || spent < budget_ms)) {
        const double t0 = now_s();
        if ((st = kiln_stream_submit(e->s, c->cmd, c->n, &so, &fence))) {
            dec_kfail(st, "prefill");
            break;
        }
        kiln_receipt r;
        if ((st = kiln_fence_wait(fence)) || (st = kiln_fence_receipt(fence, &r))) {
            dec_kfail(st, "prefill");
        } else {
            wall[n] = (now_s() - t0) * 1e3;
            ms[n] = r.elapsed_ms;
            spent += r.elapsed_ms;
            uint64_t replayed = 0;
            for (size_t k = 0; k < c->n; k++) {
                kiln_attribution a;
                if (kiln_fence_attribution(fence, k, &a) == KILN_OK && a.path == KILN_EXEC_REPLAYED)
                    replayed++;
            }
            out->replayed = replayed;
            n++;
        }
        kiln_fence_release(fence);
    }
    if (!st) {
        qsort(ms, (size_t)n, sizeof *ms, cmp_double);
        qsort(wall, (size_t)n, sizeof *wall, cmp_double);
        out->device_ms = ms[n / 2];
        out->min_ms = ms[0];
        out->wall_ms = wall[n / 2];
        out->iters = n;
    }
    free(ms);
    return st;
}

kiln_status dec_bench_prefill_breakdown(dec_engine *e, FILE *out)
{
    const step_cmds *c = &e->prefill;
    if (!c->n)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "prefill breakdown: run dec_bench_prefill first");
    const uint32_t S = e->prefill_seqs, N = e->prefill_tokens;
    kiln_binding_patch p[N_SLOTS];
    prefill_patches(e, S * N, S, p);
    label_times t;
    kiln_status st = time_by_label(e, c, p, N_SLOTS, "prefill", &t);
    if (st)
        return st;
    fprintf(out, "{\"bench\":\"prefill_ops\",\"impl\":\"kiln\",\"path\":\"eager\",\"shape\":\"%ux%u\",\"seqs\":%u,"
                 "\"tokens_each\":%u,\"sum_ms\":%.4f,\"ops\":{", S, N, S, N, t.total);
    for (size_t k = 0; k < t.n; k++) {
        const double f = dec_prefill_flops(&e->m->config, t.name[k], S, N);
        fprintf(out, "%s\"%s\":{\"ms\":%.4f", k ? "," : "", t.name[k], t.ms[k]);
        if (f > 0 && t.ms[k] > 0)
            fprintf(out, ",\"tflop\":%.4f,\"tflop_s\":%.1f", f / 1e12, f / (t.ms[k] * 1e-3) / 1e12);
        fprintf(out, "}");
    }
    fprintf(out, "}}\n");
    return KILN_OK;
}
