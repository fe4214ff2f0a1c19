/* The decoder's engine: buffers, the binding arena, the paged KV cache, the
 * commands of a step, prefill and decode. Its benchmarks are in engine_bench.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine_int.h"

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

/* Bytes of one layer's slice of moe_ids: rows x K u32, rounded up to 256 so
 * that every slice starts as aligned as the buffer (the experts need 16). */
static size_t ids_slice(const dec_engine *e) { return ((size_t)e->max_rows * (size_t)e->K * 4 + 255) & ~(size_t)255; }

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
    e->window = (uint32_t)c->sliding_window; /* the loader checked it fits */
    e->E = c->num_experts;
    e->K = e->E ? c->num_experts_per_tok : 0;
    e->XI = e->E ? c->moe_intermediate_size : 0;
    e->SI = e->E ? m->config.shared_inter : 0;
    const uint32_t P = o->max_participants;
    e->max_rows = o->max_prefill_tokens > P ? o->max_prefill_tokens : P;
    const size_t R = e->max_rows;
    e->rope_dim = c->rope_dim ? c->rope_dim : c->head_dim;
    kiln_status st = kiln_model_rope_frequencies(c, o->max_seq_tokens, e->rope_inv_freq, (size_t)(e->rope_dim / 2),
                                                 &e->rope_scaling);
    if (st) {
        dec_kfail(st, "RoPE frequencies");
        goto fail;
    }
    if ((st = kiln_op_paged_attention_page_tokens(e->HD, e->KVH, &e->page_tokens))) {
        dec_kfail(st, "page tokens");
        goto fail;
    }
    e->max_blocks = (o->max_seq_tokens + e->page_tokens - 1) / e->page_tokens;
    e->pages_per_layer = P * e->max_blocks;
    /* The workspace: the largest any command of a step asks for. */
    size_t ws = 0, w;
    const int64_t outs[3] = {e->QKVD, e->H, e->H};
    const int64_t ins[3] = {e->H, e->QD, e->E ? e->QD : e->I}; /* a MoE layer has no dense down_proj */
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
    /* The MLP: the dense SwiGLU, or the experts with the router's product
     * (and the shared expert's SwiGLU and down product). */
    const int64_t act_cols = e->E ? e->SI : e->I;
    if (act_cols) {
        if ((st = kiln_op_dense_swiglu_workspace((int64_t)R, e->H, act_cols, &w))) {
            dec_kfail(st, "swiglu workspace");
            goto fail;
        }
        ws = w > ws ? w : ws;
    }
    if (e->E) {
        size_t moe[4] = {0, 0, 0, 0};
        if ((st = kiln_op_dense_linear_workspace((int64_t)R, e->H, e->E, &moe[0])) ||
            (st = kiln_op_moe_router_workspace((int64_t)R, e->E, &moe[1])) ||
            (st = kiln_op_moe_experts_workspace((int64_t)R, e->H, e->XI, e->E, e->K, &moe[2])) ||
            (e->SI && (st = kiln_op_dense_linear_workspace((int64_t)R, e->SI, e->H, &moe[3])))) {
            dec_kfail(st, "experts workspace");
            goto fail;
        }
        for (int i = 0; i < 4; i++)
            ws = moe[i] > ws ? moe[i] : ws;
    }
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
        (st = buf(e, R * (size_t)act_cols * 2, &e->act, "mlp activations")) ||
        (st = buf(e, (size_t)P * e->V * 2, &e->logits, "logits")) || (st = buf(e, ws, &e->ws, "workspace")) ||
        (st = buf(e, kv_bytes, &e->kv, "KV pages")) || (st = buf(e, (size_t)e->V, &e->valid, "valid mask")) ||
        (st = buf(e, 4, &e->rep_ids, "repetition ids")) ||
        (st = buf(e, (size_t)(P + 1) * 4, &e->rep_off, "repetition offsets")) ||
        (st = buf(e, 4, &e->penalty, "penalty")) || (st = buf(e, am_ws, &e->am_ws, "argmax workspace")) ||
        (st = buf(e, (size_t)P * 4, &e->next, "next tokens")))
        goto fail;
    if (e->E && ((st = buf(e, R * (size_t)e->E * 2, &e->moe_logits, "router logits")) ||
                 (st = buf(e, (size_t)m->config.layers * ids_slice(e), &e->moe_ids, "chosen experts")) ||
                 (st = buf(e, R * (size_t)e->K * 4, &e->moe_weights, "expert weights")) ||
                 (st = buf(e, R * e->H * 2, &e->moe_out, "experts out")) ||
                 (e->SI && (st = buf(e, R * e->H * 2, &e->shared_out, "shared expert out")))))
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

void dec__cmds_release(step_cmds *c)
{
    for (size_t i = 0; i < c->n; i++)
        kiln_command_release(c->cmd[i]);
    free(c->cmd);
    free(c->label);
    free(c->encode_s);
    c->cmd = NULL;
    c->label = NULL;
    c->encode_s = NULL;
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
            dec__cmds_release(&e->decode[p]);
    free(e->decode);
    dec__cmds_release(&e->prefill);
    kiln_buffer *all[] = {e->res,    e->norm,  e->qkv,   e->attn,    e->act,
                          e->logits, e->ws,     e->kv,    e->valid, e->rep_ids, e->rep_off,
                          e->penalty, e->am_ws, e->next, e->moe_logits, e->moe_ids, e->moe_weights,
                          e->moe_out, e->shared_out};
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
    free(e->routing_host);
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
    const double now = dec__now_s();
    c->label[c->n] = what;
    c->encode_s[c->n] = now - c->mark; /* this command's encode, with its few tensor set-ups */
    c->mark = now;
    c->cmd[c->n++] = cmd;
    return KILN_OK;
}

/* A mixture of experts' MLP on the post-attention norm nrm of T rows: the
 * router's product and top-k, the shared expert (Qwen2-MoE: its SwiGLU into
 * act, its down product), the routed experts (with the shared term, gated),
 * then the residual add with the next norm (next_w) into nrm, as the dense
 * path's down_proj does in one command. */
static kiln_status encode_experts(dec_engine *e, step_cmds *c, size_t cap, const dec_layer *L, uint32_t T,
                                  const kiln_tensor *nrm, const kiln_tensor *res, const kiln_tensor *act,
                                  const kiln_tensor *next_w, const kiln_region *ws, int64_t l)
{
    const kiln_dtype F = e->m->config.base.dtype;
    kiln_tensor wr = tensor(L->router, 0, F, 2, e->E, e->H, 0), logits = tensor(e->moe_logits, 0, F, 2, T, e->E, 0),
                ids = tensor(e->moe_ids, (size_t)l * ids_slice(e), KILN_DTYPE_U32, 2, T, e->K, 0),
                weights = tensor(e->moe_weights, 0, KILN_DTYPE_F32, 2, T, e->K, 0),
                gu = tensor(L->x_gate_up, 0, F, 3, e->E, 2 * e->XI, e->H),
                down = tensor(L->x_down, 0, F, 3, e->E, e->H, e->XI), out = tensor(e->moe_out, 0, F, 2, T, e->H, 0),
                sgu = tensor(L->sh_gate_up, 0, F, 2, 2 * e->SI, e->H, 0),
                sdown = tensor(L->sh_down, 0, F, 2, e->H, e->SI, 0),
                sgate = tensor(L->sh_gate, 0, F, 1, e->H, 0, 0), shared = tensor(e->shared_out, 0, F, 2, T, e->H, 0);
    kiln_moe_router_desc rd = {.size = sizeof rd, .logits = &logits, .ids = &ids, .weights = &weights,
                               .top_k = (uint32_t)e->K, .normalize = e->m->config.base.norm_topk_prob};
    kiln_moe_experts_desc xd = {.size = sizeof xd, .x = nrm, .ids = &ids, .weights = &weights, .gate_up = &gu,
                                .down = &down, .shared = e->SI ? &shared : NULL,
                                .shared_gate = e->SI ? &sgate : NULL, .out = &out, .workspace = ws};
    kiln_command *cmd = NULL;
    kiln_status st;
    if ((st = push(c, cap, kiln_op_dense_linear_encode(e->jit, nrm, &wr, NULL, &logits, ws, &cmd), &cmd, "router_proj",
                   l)) ||
        (st = push(c, cap, kiln_op_moe_router_encode(e->jit, &rd, &cmd), &cmd, "router", l)))
        return st;
    if (e->SI && ((st = push(c, cap, kiln_op_dense_swiglu_encode(e->jit, nrm, &sgu, act, ws, &cmd), &cmd,
                             "shared_swiglu", l)) ||
                  (st = push(c, cap, kiln_op_dense_linear_encode(e->jit, act, &sdown, NULL, &shared, ws, &cmd), &cmd,
                             "shared_down", l))))
        return st;
    if ((st = push(c, cap, kiln_op_moe_experts_encode(e->jit, &xd, &cmd), &cmd, "experts", l)) ||
        (st = push(c, cap, kiln_op_rms_norm_residual_encode(e->jit, &out, res, next_w, e->eps, nrm, &cmd), &cmd,
                   "residual_norm", l)))
        return st;
    return KILN_OK;
}

/* T tokens of S sequences; each has at most maxq new tokens (1: decode). */
kiln_status dec__encode_step(dec_engine *e, uint32_t T, uint32_t S, uint32_t maxq, step_cmds *out)
{
    const dec_model *m = e->m;
    const int qk_norm = m->config.base.qk_norm;
    /* Per layer: qkv, qk_norm, attention, o_proj, and the MLP: swiglu and
     * down_proj, or the router's product, the router, the shared expert's
     * swiglu and down product, the experts and the residual's norm. */
    const size_t cap = 4 + (size_t)m->config.layers * (4 + (e->E ? 6 : 2));
    step_cmds c = {calloc(cap, sizeof(kiln_command *)), calloc(cap, sizeof(const char *)), 0,
                   calloc(cap, sizeof(double)), dec__now_s()};
    if (!c.cmd || !c.label || !c.encode_s) {
        dec__cmds_release(&c);
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    }
    const kiln_dtype F = m->config.base.dtype, U = KILN_DTYPE_U32;
    kiln_tensor res = tensor(e->res, 0, F, 2, T, e->H, 0),
                nrm = tensor(e->norm, 0, F, 2, T, e->H, 0), qkv = tensor(e->qkv, 0, F, 2, T, e->QKVD, 0),
                at3 = tensor(e->attn, 0, F, 3, T, e->NH, e->HD),
                at = tensor(e->attn, 0, F, 2, T, e->QD, 0),
                act = tensor(e->act, 0, F, 2, T, e->E ? e->SI : e->I, 0),
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
        /* Qwen3: each q and k head RMSNormed in place, before the attention's RoPE. */
        if (qk_norm) {
            kiln_tensor qn = tensor(L->q_norm, 0, F, 1, e->HD, 0, 0), kn = tensor(L->k_norm, 0, F, 1, e->HD, 0, 0);
            kiln_head_rms_norm_bindings hb = {.size = sizeof hb, .qkv = &qkv, .out = &qkv, .q_weight = &qn,
                                              .k_weight = &kn, .heads = e->NH, .kv_heads = e->KVH, .eps = e->eps};
            if ((st = push(&c, cap, kiln_op_head_rms_norm_encode(e->jit, &hb, &cmd), &cmd, "qk_norm", l)))
                goto fail;
        }
        const size_t layer_bytes = (size_t)e->pages_per_layer * KILN_PAGED_KV_PAGE_BYTES;
        kiln_region pages = {e->kv, (size_t)l * layer_bytes, (size_t)(l + 1) * layer_bytes};
        kiln_paged_attention_desc d = {.size = sizeof d, .qkv = &qkv, .positions = &pos, .block_table = &table,
                                       .seq_lens = &lens, .query_spans = &spans, .out = &at3, .kv_pages = &pages,
                                       .rope_theta = e->theta, .max_query_tokens = maxq, .workspace = &ws,
                                       .rope_inv_freq = e->rope_inv_freq, .rope_attention_scaling = e->rope_scaling,
                                       .rope_dim = e->rope_dim,
                                       .sliding_window = e->window};
        if ((st = push(&c, cap, kiln_op_paged_attention_encode(e->jit, &d, &cmd), &cmd, "attention", l)) ||
            (st = push(&c, cap,
                       kiln_op_dense_linear_norm_encode(e->jit, &at, &wo, &res, &post_w, e->eps, &nrm, &ws, &cmd), &cmd,
                       "o_proj", l)) ||
            (!e->E && (st = push(&c, cap, kiln_op_dense_swiglu_encode(e->jit, &nrm, &gu, &act, &ws, &cmd), &cmd,
                                 "swiglu", l))) ||
            (!e->E && (st = push(&c, cap,
                                 kiln_op_dense_linear_norm_encode(e->jit, &act, &wd, &res, &next_w, e->eps, &nrm, &ws,
                                                                  &cmd),
                                 &cmd, "down_proj", l))) ||
            (e->E && (st = encode_experts(e, &c, cap, L, T, &nrm, &res, &act, &next_w, &ws, l))))
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
    dec__cmds_release(&c);
    return st;
}

double dec__now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Submits one step: ids and positions of T rows, lengths of S sequences,
 * and (when all) the spans and block table rows too. */
kiln_status dec__submit_step(dec_engine *e, const step_cmds *c, uint32_t T, uint32_t S, int all, const char *phase,
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
kiln_status dec__finish_step(dec_engine *e, kiln_fence *fence, size_t n_cmds, uint32_t S, int want_logits,
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

kiln_status dec__read_routing(dec_engine *e, uint32_t T, uint32_t *host)
{
    const size_t per = (size_t)T * (size_t)e->K * 4, slice = ids_slice(e);
    for (int64_t l = 0; l < e->m->config.layers; l++) {
        const kiln_region r = {e->moe_ids, (size_t)l * slice, (size_t)l * slice + per};
        kiln_status st = kiln_stream_readback(e->s, &r, (unsigned char *)host + (size_t)l * per);
        if (st)
            return dec_kfail(st, "reading a layer's chosen experts");
    }
    return KILN_OK;
}

void dec_record_routing(dec_engine *e, dec_routing_fn fn, void *user)
{
    e->routing_fn = fn;
    e->routing_user = user;
}

/* Reports the last step's T rows to the routing callback: row j is
 * participant who[j] at position pos[j]. */
static kiln_status report_routing(dec_engine *e, uint32_t T, const uint32_t *who, const uint32_t *pos)
{
    if (!e->E || !e->routing_fn)
        return KILN_OK;
    if (!e->routing_host &&
        !(e->routing_host = malloc((size_t)e->m->config.layers * e->max_rows * (size_t)e->K * 4)))
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln_status st = dec__read_routing(e, T, e->routing_host);
    for (uint32_t j = 0; !st && j < T; j++)
        e->routing_fn(e->routing_user, who[j], pos[j], e->routing_host + (size_t)j * e->K, (size_t)T * e->K);
    return st;
}

kiln_status dec__decode_cmds(dec_engine *e, uint32_t P, dec_stats *stats, const step_cmds **out)
{
    step_cmds *c = &e->decode[P];
    if (!c->n) {
        double t0 = dec__now_s();
        kiln_status st = dec__encode_step(e, P, P, 1, c);
        if (stats)
            stats->encode_s += dec__now_s() - t0;
        if (st)
            return st;
    }
    *out = c;
    return KILN_OK;
}

void dec__set_rows(dec_engine *e, uint32_t row, uint32_t seq_slot)
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
        dec__set_rows(e, i, i);
        row += reqs[i].prompt_len;
    }
    step_cmds pre;
    double t0 = dec__now_s();
    kiln_status st = dec__encode_step(e, T, S, maxq, &pre);
    stats->encode_s += dec__now_s() - t0;
    if (st)
        return st;
    kiln_fence *fence = NULL;
    t0 = dec__now_s();
    st = dec__submit_step(e, &pre, T, S, 1, "prefill", KILN_TIMING_OFF, &fence);
    if (!st)
        st = dec__finish_step(e, fence, pre.n, S, logits_fn != NULL, stats);
    stats->prefill_s = dec__now_s() - t0;
    dec__cmds_release(&pre);
    if (!st && e->E && e->routing_fn) {
        uint32_t *who = malloc((size_t)T * sizeof *who);
        if (!who)
            return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        for (uint32_t i = 0; i < S; i++)
            for (uint32_t t = 0; t < reqs[i].prompt_len; t++)
                who[e->spans[2 * i] + t] = i;
        st = report_routing(e, T, who, e->pos);
        free(who);
    }
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
    t0 = dec__now_s();
    for (uint32_t step = 1; P; step++) {
        const step_cmds *c;
        if ((st = dec__decode_cmds(e, P, stats, &c)))
            break;
        int changed = P != last_P;
        for (uint32_t j = 0; j < P; j++) {
            const uint32_t i = active[j];
            e->ids[j] = res[i].tokens[res[i].n - 1];
            e->pos[j] = reqs[i].prompt_len + res[i].n - 1;
            e->lens[j] = e->pos[j] + 1;
            e->spans[2 * j] = j;
            e->spans[2 * j + 1] = 1;
            dec__set_rows(e, j, i);
        }
        if ((st = dec__submit_step(e, c, P, P, changed, "decode", KILN_TIMING_OFF, &fence)) ||
            (st = dec__finish_step(e, fence, c->n, P, logits_fn != NULL, stats)) ||
            (st = report_routing(e, P, active, e->pos)))
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
    stats->decode_s = dec__now_s() - t0;
    free(active);
    return st;
}
