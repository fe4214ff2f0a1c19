/* The graph executable cache on the GPU: a decoder-layer-like
 * sequence (embedding -> RMSNorm -> q/k/v linear -> paged attention decode ->
 * o linear -> fused residual RMSNorm -> SwiGLU -> down linear -> lm head ->
 * masked argmax) replayed equals eager bit for bit, with the per-step values
 * in a binding arena (new values between replays give the new results, one
 * graph for every step of the batch bucket); eviction by count and by bytes,
 * trim; capture deferred on a busy stream; a rejected capture runs eager with
 * the right result; a graph evicted while a batch uses it lives until the
 * batch is done; unloading a module drops older graphs. */
#include <math.h>

#include "f16_host.h"
#include "gpu_fixture.h"
#include "runtime/internal.h"
#include "testutil.h"

typedef gpu_fixture fixture;

/* The model: one layer, small. */
enum { V = 1000, H = 256, NH = 4, NKV = 2, D = 64, I = 512, R = 8, MAXB = 1 };
#define EPS 1e-5f
#define THETA 10000.0f

static void fill_f16(kiln_rng *r, uint16_t *p, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++)
        p[i] = f2h(((float)(kiln_rng_next(r) >> 40) / 8388608.0f - 1.0f) * scale);
}

static kiln_buffer *buf(fixture *f, const void *host, size_t bytes)
{
    kiln_buffer *b;
    KILN_CHECK(kiln_buffer_create(f->rt, bytes, 256, &b));
    if (host)
        KILN_CHECK(kiln_buffer_upload(b, 0, host, bytes));
    return b;
}

static kiln_buffer *rand_f16(fixture *f, size_t n, float scale)
{
    uint16_t *h = malloc(n * 2);
    assert_non_null(h);
    fill_f16(&f->rng, h, n, scale);
    kiln_buffer *b = buf(f, h, n * 2);
    free(h);
    return b;
}

static kiln_tensor t2(kiln_buffer *b, size_t off, kiln_dtype dt, int64_t d0, int64_t d1)
{
    return (kiln_tensor){.buffer = b, .offset = off, .dtype = dt, .rank = 2, .dims = {d0, d1}};
}

static kiln_tensor t1(kiln_buffer *b, size_t off, kiln_dtype dt, int64_t d0)
{
    return (kiln_tensor){.buffer = b, .offset = off, .dtype = dt, .rank = 1, .dims = {d0}};
}

static kiln_tensor t3(kiln_buffer *b, size_t off, kiln_dtype dt, int64_t d0, int64_t d1, int64_t d2)
{
    return (kiln_tensor){.buffer = b, .offset = off, .dtype = dt, .rank = 3, .dims = {d0, d1, d2}};
}

/* The binding arena's slots: what changes every step. */
enum { S_IDS, S_POS, S_TABLE, S_LENS, S_QSPANS, S_LMSPANS, S_REPIDS, S_REPOFF, N_SLOTS };
#define SLOT_BYTES 256

/* One decode step's values for B participants. */
typedef struct step {
    uint32_t ids[8], pos[8], table[8], lens[8], qspans[16], lmspans[16], repids[R], repoff[9];
} step;

typedef struct layer {
    uint32_t B;
    kiln_binding_arena *arena;
    kiln_buffer *table, *wn1, *wq, *wk, *wv, *wo, *wn2, *wgu, *wd, *wlm, *valid, *penalty;
    kiln_buffer *x, *xn, *q, *k, *v, *att, *o, *h2, *m, *d, *logits, *out, *pages, *ws[6];
    size_t pages_bytes;
    kiln_command *cmds[12];
    size_t n;
} layer;

static const char *const op_ids[12] = {"token_embedding", "rms_norm",          "dense_linear", "dense_linear",
                                        "dense_linear",    "paged_attention",   "dense_linear", "rms_norm_residual",
                                        "dense_swiglu",    "dense_linear",      "last_token_linear", "masked_argmax"};

static void layer_make(fixture *f, layer *L, uint32_t B)
{
    memset(L, 0, sizeof *L);
    L->B = B;
    kiln_binding_slot slots[N_SLOTS];
    for (int i = 0; i < N_SLOTS; i++)
        slots[i] = (kiln_binding_slot){(size_t)i * SLOT_BYTES, SLOT_BYTES};
    KILN_CHECK(kiln_binding_arena_create(f->rt, slots, N_SLOTS, N_SLOTS * SLOT_BYTES, &L->arena));
    kiln_buffer *ab = kiln_binding_arena_buffer(L->arena);

    L->table = rand_f16(f, (size_t)V * H, 1.0f);
    L->wn1 = rand_f16(f, H, 1.0f);
    L->wq = rand_f16(f, (size_t)NH * D * H, 0.125f);
    L->wk = rand_f16(f, (size_t)NKV * D * H, 0.125f);
    L->wv = rand_f16(f, (size_t)NKV * D * H, 0.125f);
    L->wo = rand_f16(f, (size_t)H * NH * D, 0.125f);
    L->wn2 = rand_f16(f, H, 1.0f);
    L->wgu = rand_f16(f, (size_t)2 * I * H, 0.125f);
    L->wd = rand_f16(f, (size_t)H * I, 0.125f);
    L->wlm = rand_f16(f, (size_t)V * H, 0.125f);
    uint8_t valid[V];
    for (int i = 0; i < V; i++)
        valid[i] = (uint8_t)(kiln_rng_below(&f->rng, 10) != 0);
    L->valid = buf(f, valid, V);
    float pen = 1.3f;
    L->penalty = buf(f, &pen, 4);
    /* One 64 KiB page per participant, its cached prefix random. */
    L->pages_bytes = (size_t)B * KILN_PAGED_KV_PAGE_BYTES;
    L->pages = rand_f16(f, L->pages_bytes / 2, 1.0f);
    L->x = buf(f, NULL, (size_t)B * H * 2);
    L->xn = buf(f, NULL, (size_t)B * H * 2);
    L->q = buf(f, NULL, (size_t)B * NH * D * 2);
    L->k = buf(f, NULL, (size_t)B * NKV * D * 2);
    L->v = buf(f, NULL, (size_t)B * NKV * D * 2);
    L->att = buf(f, NULL, (size_t)B * NH * D * 2);
    L->o = buf(f, NULL, (size_t)B * H * 2);
    L->h2 = buf(f, NULL, (size_t)B * H * 2);
    L->m = buf(f, NULL, (size_t)B * I * 2);
    L->d = buf(f, NULL, (size_t)B * H * 2);
    L->logits = buf(f, NULL, (size_t)B * V * 2);
    L->out = buf(f, NULL, (size_t)B * 4);

    size_t wsz[6];
    KILN_CHECK(kiln_op_dense_linear_workspace(B, H, NH * D, &wsz[0]));
    KILN_CHECK(kiln_op_dense_linear_workspace(B, H, NKV * D, &wsz[1]));
    KILN_CHECK(kiln_op_dense_linear_workspace(B, NH * D, H, &wsz[2]));
    KILN_CHECK(kiln_op_dense_swiglu_workspace(B, H, I, &wsz[3]));
    KILN_CHECK(kiln_op_dense_linear_workspace(B, I, H, &wsz[4]));
    KILN_CHECK(kiln_op_last_token_linear_workspace(B, H, V, &wsz[5]));
    kiln_region ws[6];
    for (int i = 0; i < 6; i++) {
        L->ws[i] = buf(f, NULL, wsz[i]);
        ws[i] = (kiln_region){L->ws[i], 0, wsz[i]};
    }
    size_t mask_ws;
    KILN_CHECK(kiln_op_masked_argmax_workspace(V, B, &mask_ws));
    kiln_buffer *aws = buf(f, NULL, mask_ws);

    kiln_tensor ids = t1(ab, S_IDS * SLOT_BYTES, KILN_DTYPE_U32, B),
                pos = t1(ab, S_POS * SLOT_BYTES, KILN_DTYPE_U32, B),
                tab = t2(ab, S_TABLE * SLOT_BYTES, KILN_DTYPE_U32, B, MAXB),
                lens = t1(ab, S_LENS * SLOT_BYTES, KILN_DTYPE_U32, B),
                qsp = t2(ab, S_QSPANS * SLOT_BYTES, KILN_DTYPE_U32, B, 2),
                lmsp = t2(ab, S_LMSPANS * SLOT_BYTES, KILN_DTYPE_U32, B, 2),
                rids = t1(ab, S_REPIDS * SLOT_BYTES, KILN_DTYPE_U32, R),
                roff = t1(ab, S_REPOFF * SLOT_BYTES, KILN_DTYPE_U32, B + 1);
    kiln_tensor table = t2(L->table, 0, KILN_DTYPE_F16, V, H), x = t2(L->x, 0, KILN_DTYPE_F16, B, H),
                xn = t2(L->xn, 0, KILN_DTYPE_F16, B, H), wn1 = t1(L->wn1, 0, KILN_DTYPE_F16, H),
                wn2 = t1(L->wn2, 0, KILN_DTYPE_F16, H), wq = t2(L->wq, 0, KILN_DTYPE_F16, NH * D, H),
                wk = t2(L->wk, 0, KILN_DTYPE_F16, NKV * D, H), wv = t2(L->wv, 0, KILN_DTYPE_F16, NKV * D, H),
                wo = t2(L->wo, 0, KILN_DTYPE_F16, H, NH * D), wgu = t2(L->wgu, 0, KILN_DTYPE_F16, 2 * I, H),
                wd = t2(L->wd, 0, KILN_DTYPE_F16, H, I), wlm = t2(L->wlm, 0, KILN_DTYPE_F16, V, H),
                q2 = t2(L->q, 0, KILN_DTYPE_F16, B, NH * D), k2 = t2(L->k, 0, KILN_DTYPE_F16, B, NKV * D),
                v2 = t2(L->v, 0, KILN_DTYPE_F16, B, NKV * D), q3 = t3(L->q, 0, KILN_DTYPE_F16, B, NH, D),
                k3 = t3(L->k, 0, KILN_DTYPE_F16, B, NKV, D), v3 = t3(L->v, 0, KILN_DTYPE_F16, B, NKV, D),
                att3 = t3(L->att, 0, KILN_DTYPE_F16, B, NH, D), att2 = t2(L->att, 0, KILN_DTYPE_F16, B, NH * D),
                o = t2(L->o, 0, KILN_DTYPE_F16, B, H), h2 = t2(L->h2, 0, KILN_DTYPE_F16, B, H),
                m = t2(L->m, 0, KILN_DTYPE_F16, B, I), d = t2(L->d, 0, KILN_DTYPE_F16, B, H),
                logits = t2(L->logits, 0, KILN_DTYPE_F16, B, V), valid_t = t1(L->valid, 0, KILN_DTYPE_U8, V),
                pen_t = t1(L->penalty, 0, KILN_DTYPE_F32, 1), aws_t = t1(aws, 0, KILN_DTYPE_U8, (int64_t)mask_ws),
                out = t1(L->out, 0, KILN_DTYPE_U32, B);
    kiln_region pages = {L->pages, 0, L->pages_bytes};
    kiln_command **c = L->cmds;
    KILN_CHECK(kiln_op_token_embedding_encode(f->jit, &table, &ids, &x, &c[0]));
    KILN_CHECK(kiln_op_rms_norm_encode(f->jit, &x, &wn1, EPS, &xn, &c[1]));
    KILN_CHECK(kiln_op_dense_linear_encode(f->jit, &xn, &wq, NULL, &q2, &ws[0], &c[2]));
    KILN_CHECK(kiln_op_dense_linear_encode(f->jit, &xn, &wk, NULL, &k2, &ws[1], &c[3]));
    KILN_CHECK(kiln_op_dense_linear_encode(f->jit, &xn, &wv, NULL, &v2, &ws[1], &c[4]));
    kiln_paged_attention_desc pd = {.size = sizeof pd, .q = &q3, .k = &k3, .v = &v3, .positions = &pos,
                                    .block_table = &tab, .seq_lens = &lens, .query_spans = &qsp, .out = &att3,
                                    .kv_pages = &pages, .rope_theta = THETA, .max_query_tokens = 1};
    KILN_CHECK(kiln_op_paged_attention_encode(f->jit, &pd, &c[5]));
    KILN_CHECK(kiln_op_dense_linear_encode(f->jit, &att2, &wo, NULL, &o, &ws[2], &c[6]));
    KILN_CHECK(kiln_op_rms_norm_residual_encode(f->jit, &o, &x, &wn2, EPS, &h2, &c[7]));
    KILN_CHECK(kiln_op_dense_swiglu_encode(f->jit, &h2, &wgu, &m, &ws[3], &c[8]));
    KILN_CHECK(kiln_op_dense_linear_encode(f->jit, &m, &wd, NULL, &d, &ws[4], &c[9]));
    KILN_CHECK(kiln_op_last_token_linear_encode(f->jit, &d, &lmsp, &wlm, NULL, &logits, &ws[5], &c[10]));
    kiln_masked_argmax_bindings mb = {sizeof mb, &logits, &valid_t, &rids, &roff, &pen_t, &aws_t, &out};
    KILN_CHECK(kiln_op_masked_argmax_encode(f->jit, &mb, &c[11]));
    kiln_buffer_destroy(aws); /* the command holds it */
    L->n = 12;
    for (size_t i = 0; i < L->n; i++) {
        assert_true(kiln_command_replayable(c[i]));
        assert_string_equal(kiln_command_op_id(c[i]), op_ids[i]);
    }
}

static void layer_free(layer *L)
{
    for (size_t i = 0; i < L->n; i++)
        kiln_command_release(L->cmds[i]);
    kiln_buffer *all[] = {L->table, L->wn1, L->wq, L->wk, L->wv, L->wo, L->wn2, L->wgu, L->wd, L->wlm,
                          L->valid, L->penalty, L->x, L->xn, L->q, L->k, L->v, L->att, L->o, L->h2,
                          L->m, L->d, L->logits, L->out, L->pages, L->ws[0], L->ws[1], L->ws[2], L->ws[3],
                          L->ws[4], L->ws[5]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        kiln_buffer_destroy(all[i]);
    kiln_binding_arena_destroy(L->arena);
}

/* Step values: real participants get random tokens and cached lengths; the
 * padding ones (index >= real) decode token 0 into their own page. */
static void step_make(kiln_rng *r, const layer *L, uint32_t real, uint32_t base_len, step *s)
{
    memset(s, 0, sizeof *s);
    uint32_t page_tokens;
    KILN_CHECK(kiln_op_paged_attention_page_tokens(D, NKV, &page_tokens));
    for (uint32_t p = 0; p < L->B; p++) {
        s->ids[p] = p < real ? kiln_rng_below(r, V) : 0;
        s->lens[p] = p < real ? base_len + p * 7 % 11 : 1;
        assert_true(s->lens[p] <= page_tokens);
        s->pos[p] = s->lens[p] - 1;
        s->table[p] = p;
        s->qspans[2 * p] = p;
        s->qspans[2 * p + 1] = 1;
        s->lmspans[2 * p] = p;
        s->lmspans[2 * p + 1] = 1;
    }
    for (int i = 0; i < R; i++)
        s->repids[i] = kiln_rng_below(r, V);
    for (uint32_t p = 0; p <= L->B; p++)
        s->repoff[p] = p * R / L->B;
}

static void patches(const layer *L, const step *s, kiln_binding_patch p[N_SLOTS])
{
    const uint32_t B = L->B;
    p[0] = (kiln_binding_patch){S_IDS, 0, s->ids, B * 4};
    p[1] = (kiln_binding_patch){S_POS, 0, s->pos, B * 4};
    p[2] = (kiln_binding_patch){S_TABLE, 0, s->table, B * MAXB * 4};
    p[3] = (kiln_binding_patch){S_LENS, 0, s->lens, B * 4};
    p[4] = (kiln_binding_patch){S_QSPANS, 0, s->qspans, B * 8};
    p[5] = (kiln_binding_patch){S_LMSPANS, 0, s->lmspans, B * 8};
    p[6] = (kiln_binding_patch){S_REPIDS, 0, s->repids, R * 4};
    p[7] = (kiln_binding_patch){S_REPOFF, 0, s->repoff, (B + 1) * 4};
}

/* What a step produced: the attention output, the logits, the chosen ids and the KV pages. */
typedef struct outputs {
    uint16_t *att, *logits;
    uint32_t out[8];
    uint8_t *pages;
} outputs;

static void poison(fixture *f, const layer *L)
{
    kiln_buffer *outs[] = {L->x, L->xn, L->q, L->k, L->v, L->att, L->o, L->h2, L->m, L->d, L->logits, L->out};
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++)
        KILN_CHECK(kiln_buffer_fill(outs[i], 0, 0xff, kiln_buffer_size(outs[i])));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
}

/* Runs the step on stream s under path; returns the fence's attribution paths in *paths (may be NULL). */
static kiln_status run_step(fixture *f, kiln_stream *s, layer *L, const step *st, kiln_compute_path path,
                            kiln_exec_path *paths)
{
    kiln_binding_patch p[N_SLOTS];
    patches(L, st, p);
    kiln_submit_options o = {.path = path, .timing = KILN_TIMING_SPANS, .phase = "decode", .arena = L->arena,
                             .patches = p, .n_patches = N_SLOTS};
    kiln_fence *fence;
    kiln_status rc = kiln_stream_submit(s, L->cmds, L->n, &o, &fence);
    if (rc)
        return rc;
    KILN_CHECK(kiln_fence_wait(fence));
    for (size_t i = 0; paths && i < L->n; i++) {
        kiln_attribution a;
        KILN_CHECK(kiln_fence_attribution(fence, i, &a));
        paths[i] = a.path;
    }
    kiln_fence_release(fence);
    (void)f;
    return KILN_OK;
}

static void read_outputs(const layer *L, outputs *o)
{
    o->att = malloc((size_t)L->B * NH * D * 2);
    o->logits = malloc((size_t)L->B * V * 2);
    o->pages = malloc(L->pages_bytes);
    assert_true(o->att && o->logits && o->pages);
    KILN_CHECK(kiln_buffer_readback(L->att, 0, o->att, (size_t)L->B * NH * D * 2));
    KILN_CHECK(kiln_buffer_readback(L->logits, 0, o->logits, (size_t)L->B * V * 2));
    KILN_CHECK(kiln_buffer_readback(L->out, 0, o->out, (size_t)L->B * 4));
    KILN_CHECK(kiln_buffer_readback(L->pages, 0, o->pages, L->pages_bytes));
}

static void outputs_free(outputs *o)
{
    free(o->att);
    free(o->logits);
    free(o->pages);
}

/* Bit for bit, every element; and the chosen ids agree with the logits read
 * back (the penalty and the mask applied on the host, in f32). */
static void expect_same(const layer *L, const outputs *a, const outputs *b, const step *st)
{
    assert_memory_equal(a->att, b->att, (size_t)L->B * NH * D * 2);
    assert_memory_equal(a->logits, b->logits, (size_t)L->B * V * 2);
    assert_memory_equal(a->out, b->out, (size_t)L->B * 4);
    assert_memory_equal(a->pages, b->pages, L->pages_bytes);
    uint8_t valid[V];
    KILN_CHECK(kiln_buffer_readback(L->valid, 0, valid, V));
    for (uint32_t p = 0; p < L->B; p++) {
        uint32_t best = KILN_ARGMAX_NONE;
        float bv = 0;
        for (uint32_t t = 0; t < V; t++) {
            float l = h2f(a->logits[(size_t)p * V + t]);
            for (uint32_t k = st->repoff[p]; k < st->repoff[p + 1]; k++)
                if (st->repids[k] == t) {
                    l = l > 0 ? l / 1.3f : l * 1.3f;
                    break;
                }
            if (!valid[t] || isnan(l))
                continue;
            if (best == KILN_ARGMAX_NONE || l > bv) {
                best = t;
                bv = l;
            }
        }
        assert_int_equal(a->out[p], best);
    }
}

static void stats(const kiln_stream *s, kiln_graph_stats *g) { kiln_stream_graph_stats(s, g); }

/* Eager, then captured (adaptive, quiet stream), then a hit; new step values
 * through the arena under replayed-only; padding to the bucket. */
static void test_replay_equals_eager(void **state)
{
    fixture *f = *state;
    uint32_t bucket;
    KILN_CHECK(kiln_stream_batch_bucket(f->s, 3, &bucket));
    assert_int_equal(bucket, 4);
    KILN_EXPECT(kiln_stream_batch_bucket(f->s, 65, &bucket), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "65 participants", "1 to 64");
    layer L;
    layer_make(f, &L, bucket);
    step st;
    step_make(&f->rng, &L, 3, 20, &st);
    kiln_exec_path paths[12];

    outputs eager, rep;
    poison(f, &L);
    KILN_CHECK(run_step(f, f->s, &L, &st, KILN_PATH_EAGER_ONLY, paths));
    for (int i = 0; i < 12; i++)
        assert_int_equal(paths[i], KILN_EXEC_EAGER);
    read_outputs(&L, &eager);
    kiln_graph_stats g;
    stats(f->s, &g);
    assert_int_equal(g.captured, 0);

    /* Replayed-only before anything is resident: refused, nothing enqueued. */
    KILN_EXPECT(run_step(f, f->s, &L, &st, KILN_PATH_REPLAYED_ONLY, NULL), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "commands 0 (token_embedding) to 11 (masked_argmax)", "not resident");
    assert_int_equal(kiln_stream_get_state(f->s), KILN_STREAM_READY);

    /* Adaptive on a quiet stream: captured, launched. */
    poison(f, &L);
    KILN_CHECK(run_step(f, f->s, &L, &st, KILN_PATH_ADAPTIVE, paths));
    for (int i = 0; i < 12; i++)
        assert_int_equal(paths[i], KILN_EXEC_REPLAYED);
    stats(f->s, &g);
    assert_int_equal(g.captured, 1);
    assert_int_equal(g.hits, 0);
    assert_int_equal(g.resident, 1);
    assert_true(g.resident_bytes >= 12 * KILN_GRAPH_NODE_BYTES);
    read_outputs(&L, &rep);
    expect_same(&L, &eager, &rep, &st);
    outputs_free(&rep);

    /* Again: a hit. */
    poison(f, &L);
    KILN_CHECK(run_step(f, f->s, &L, &st, KILN_PATH_REPLAYED_ONLY, paths));
    stats(f->s, &g);
    assert_int_equal(g.captured, 1);
    assert_int_equal(g.hits, 1);
    read_outputs(&L, &rep);
    expect_same(&L, &eager, &rep, &st);
    outputs_free(&rep);
    outputs_free(&eager);

    /* Next steps: new values in the arena (other tokens, one more cached
     * token, 2 then 4 real participants in the same bucket): the same graph. */
    uint32_t reals[2] = {2, 4};
    for (int k = 0; k < 2; k++) {
        step_make(&f->rng, &L, reals[k], 21 + (uint32_t)k, &st);
        poison(f, &L);
        KILN_CHECK(run_step(f, f->s, &L, &st, KILN_PATH_REPLAYED_ONLY, paths));
        read_outputs(&L, &rep);
        poison(f, &L);
        KILN_CHECK(run_step(f, f->s, &L, &st, KILN_PATH_EAGER_ONLY, NULL));
        read_outputs(&L, &eager);
        expect_same(&L, &eager, &rep, &st);
        outputs_free(&rep);
        outputs_free(&eager);
    }
    stats(f->s, &g);
    assert_int_equal(g.captured, 1);
    assert_int_equal(g.hits, 3);
    assert_int_equal(g.rejected, 0);
    assert_int_equal(g.deferred, 0);
    layer_free(&L);
}

/* ---- single-command segments for the cache's bookkeeping ---- */

typedef struct emb {
    kiln_buffer *table, *ids, *out;
    kiln_command *cmd;
    uint16_t host_table[64 * 64];
    uint32_t host_ids[16];
} emb;

static void emb_make(fixture *f, emb *e)
{
    fill_f16(&f->rng, e->host_table, 64 * 64, 1.0f);
    for (int i = 0; i < 16; i++)
        e->host_ids[i] = kiln_rng_below(&f->rng, 64);
    e->table = buf(f, e->host_table, sizeof e->host_table);
    e->ids = buf(f, e->host_ids, sizeof e->host_ids);
    e->out = buf(f, NULL, 16 * 64 * 2);
    kiln_tensor t = t2(e->table, 0, KILN_DTYPE_F16, 64, 64), i = t1(e->ids, 0, KILN_DTYPE_U32, 16),
                o = t2(e->out, 0, KILN_DTYPE_F16, 16, 64);
    KILN_CHECK(kiln_op_token_embedding_encode(f->jit, &t, &i, &o, &e->cmd));
}

static void emb_check(emb *e)
{
    uint16_t got[16 * 64];
    KILN_CHECK(kiln_buffer_readback(e->out, 0, got, sizeof got));
    for (int t = 0; t < 16; t++)
        assert_memory_equal(got + t * 64, e->host_table + e->host_ids[t] * 64, 128);
}

static void emb_free(emb *e)
{
    kiln_command_release(e->cmd);
    kiln_buffer_destroy(e->table);
    kiln_buffer_destroy(e->ids);
    kiln_buffer_destroy(e->out);
}

static kiln_status submit1(kiln_stream *s, kiln_command *c, kiln_compute_path path, kiln_fence **fence)
{
    kiln_submit_options o = {.path = path};
    return kiln_stream_submit(s, &c, 1, &o, fence);
}

/* A host function that keeps the stream busy. */
static void CUDA_CB sleep_ms(void *user)
{
    struct timespec ts = {0, (long)(uintptr_t)user * 1000000L};
    nanosleep(&ts, NULL);
}

static kiln_status enqueue_sleep(void *user, const kiln_launch_context *ctx)
{
    const kiln__driver *d = kiln__driver_get(NULL);
    CUresult r = d->cuLaunchHostFunc((CUstream)kiln_launch_stream(ctx), sleep_ms, user);
    return r == CUDA_SUCCESS ? KILN_OK : KILN_ERR_CUDA_DRIVER;
}

static kiln_command *sleeper(fixture *f, unsigned ms)
{
    kiln_command *c;
    kiln_command_desc d = {.op_id = "test.sleep", .enqueue = enqueue_sleep, .user = (void *)(uintptr_t)ms};
    KILN_CHECK(kiln_command_create(f->rt, &d, &c));
    return c;
}

static void test_eviction_and_trim(void **state)
{
    fixture *f = *state;
    emb e[3];
    for (int i = 0; i < 3; i++)
        emb_make(f, &e[i]);
    kiln_graph_options go = {.size = sizeof go, .max_graphs = 2};
    KILN_CHECK(kiln_stream_set_graph_options(f->s, &go));
    kiln_submit_options ro = {.path = KILN_PATH_REPLAYED_ONLY};
    size_t captured;
    for (int i = 0; i < 3; i++) {
        KILN_CHECK(kiln_stream_prepare(f->s, &e[i].cmd, 1, &ro, &captured));
        assert_int_equal(captured, 1);
    }
    kiln_graph_stats g;
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.captured, 3);
    assert_int_equal(g.resident, 2);
    assert_int_equal(g.evicted, 1);
    /* The least recently used (the first) went. */
    KILN_EXPECT(submit1(f->s, e[0].cmd, KILN_PATH_REPLAYED_ONLY, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "command 0 (token_embedding)", "not resident");
    for (int i = 1; i < 3; i++)
        KILN_CHECK(submit1(f->s, e[i].cmd, KILN_PATH_REPLAYED_ONLY, NULL));
    KILN_CHECK(kiln_stream_synchronize(f->s));
    emb_check(&e[1]);
    emb_check(&e[2]);
    /* Touch 1, then bring 0 back: 2 is now the coldest and goes. */
    KILN_CHECK(submit1(f->s, e[1].cmd, KILN_PATH_REPLAYED_ONLY, NULL));
    KILN_CHECK(kiln_stream_synchronize(f->s));
    KILN_CHECK(submit1(f->s, e[0].cmd, KILN_PATH_ADAPTIVE, NULL));
    KILN_CHECK(kiln_stream_synchronize(f->s));
    emb_check(&e[0]);
    KILN_EXPECT(submit1(f->s, e[2].cmd, KILN_PATH_REPLAYED_ONLY, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "command 0 (token_embedding)", "not resident");
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.captured, 4);
    assert_int_equal(g.evicted, 2);
    assert_int_equal(g.resident, 2);

    /* By bytes: a budget below one graph keeps only the newest. */
    go = (kiln_graph_options){.size = sizeof go, .max_graphs = 16, .max_bytes = 1};
    KILN_CHECK(kiln_stream_set_graph_options(f->s, &go));
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.resident, 0);
    KILN_CHECK(kiln_stream_prepare(f->s, &e[0].cmd, 1, &ro, NULL));
    KILN_CHECK(kiln_stream_prepare(f->s, &e[1].cmd, 1, &ro, NULL));
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.resident, 1);
    KILN_CHECK(submit1(f->s, e[1].cmd, KILN_PATH_REPLAYED_ONLY, NULL));

    /* Trim everything while a batch that launched the graph may still run: it completes. */
    go = (kiln_graph_options){.size = sizeof go};
    KILN_CHECK(kiln_stream_set_graph_options(f->s, &go));
    KILN_CHECK(kiln_buffer_fill(e[1].out, 0, 0, 16 * 64 * 2));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    kiln_fence *fence;
    kiln_command *busy = sleeper(f, 100);
    kiln_command *pair[2] = {busy, e[1].cmd}; /* the host function first: the batch is surely pending */
    kiln_submit_options ad = {.path = KILN_PATH_ADAPTIVE};
    KILN_CHECK(kiln_stream_submit(f->s, pair, 2, &ad, &fence));
    kiln_attribution row;
    KILN_CHECK(kiln_fence_attribution(fence, 1, &row));
    assert_int_equal(row.path, KILN_EXEC_REPLAYED);
    kiln_fence_state fs;
    KILN_CHECK(kiln_fence_query(fence, &fs));
    assert_int_equal(fs, KILN_FENCE_PENDING);
    KILN_CHECK(kiln_stream_graph_trim(f->s, 0, 0));
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.resident, 0);
    assert_int_equal(g.resident_bytes, 0);
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_command_release(busy);
    kiln_fence_release(fence);
    emb_check(&e[1]);

    /* Bad options are refused and change nothing. */
    uint32_t bad[3] = {1, 4, 4};
    go = (kiln_graph_options){.size = sizeof go, .buckets = bad, .n_buckets = 3};
    KILN_EXPECT(kiln_stream_set_graph_options(f->s, &go), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "bucket 2 is 4", "strictly increasing");
    uint32_t mine[3] = {3, 6, 12}, bucket;
    go.buckets = mine;
    KILN_CHECK(kiln_stream_set_graph_options(f->s, &go));
    KILN_CHECK(kiln_stream_batch_bucket(f->s, 4, &bucket));
    assert_int_equal(bucket, 6);
    KILN_EXPECT(kiln_stream_batch_bucket(f->s, 13, &bucket), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "13 participants", "1 to 12");
    for (int i = 0; i < 3; i++)
        emb_free(&e[i]);
}

static void test_deferred_on_busy_stream(void **state)
{
    fixture *f = *state;
    emb e;
    emb_make(f, &e);
    kiln_command *busy = sleeper(f, 200);
    KILN_CHECK(submit1(f->s, busy, KILN_PATH_EAGER_ONLY, NULL));
    kiln_fence *fence;
    KILN_CHECK(submit1(f->s, e.cmd, KILN_PATH_ADAPTIVE, &fence));
    kiln_attribution a;
    KILN_CHECK(kiln_fence_attribution(fence, 0, &a));
    assert_int_equal(a.path, KILN_EXEC_EAGER);
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_fence_release(fence);
    emb_check(&e);
    kiln_graph_stats g;
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.deferred, 1);
    assert_int_equal(g.captured, 0);
    /* Quiet now: captured at the next sight. */
    KILN_CHECK(kiln_buffer_fill(e.out, 0, 0, 16 * 64 * 2));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(submit1(f->s, e.cmd, KILN_PATH_ADAPTIVE, &fence));
    KILN_CHECK(kiln_fence_attribution(fence, 0, &a));
    assert_int_equal(a.path, KILN_EXEC_REPLAYED);
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_fence_release(fence);
    emb_check(&e);
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.captured, 1);
    /* A resident graph is launched on a busy stream too. */
    KILN_CHECK(submit1(f->s, busy, KILN_PATH_EAGER_ONLY, NULL));
    KILN_CHECK(submit1(f->s, e.cmd, KILN_PATH_ADAPTIVE, NULL));
    KILN_CHECK(kiln_stream_synchronize(f->s));
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.hits, 1);
    assert_int_equal(g.deferred, 1);
    kiln_command_release(busy);
    emb_free(&e);
}

/* A command that cannot be captured: it synchronizes its stream (illegal
 * while capturing), then fills its region. */
typedef struct filler {
    CUdeviceptr dst;
    size_t bytes;
    unsigned char value;
} filler;

static kiln_status enqueue_sync_fill(void *user, const kiln_launch_context *ctx)
{
    const filler *fl = user;
    const kiln__driver *d = kiln__driver_get(NULL);
    CUstream s = (CUstream)kiln_launch_stream(ctx);
    CUresult r = d->cuStreamSynchronize(s);
    if (r == CUDA_SUCCESS)
        r = d->cuMemsetD8Async(fl->dst, fl->value, fl->bytes, s);
    if (r != CUDA_SUCCESS) {
        const char *name = NULL;
        d->cuGetErrorName(r, &name);
        return kiln__fail(NULL, KILN_ERR_CUDA_DRIVER, "test.sync_fill: %s", name ? name : "?");
    }
    return KILN_OK;
}

static void test_rejected_capture_runs_eager(void **state)
{
    fixture *f = *state;
    emb e;
    emb_make(f, &e);
    kiln_buffer *target = buf(f, NULL, 4096);
    filler fl = {kiln_buffer_device_address(target), 4096, 0x5a};
    kiln_region reg = {target, 0, 4096};
    const char key[] = "test.sync_fill:v1";
    kiln_command_desc d = {.op_id = "test.sync_fill", .regions = &reg, .n_regions = 1, .enqueue = enqueue_sync_fill,
                           .user = &fl, .replay_key = key, .replay_key_bytes = sizeof key};
    kiln_command *c;
    KILN_CHECK(kiln_command_create(f->rt, &d, &c));
    kiln_command *pair[2] = {e.cmd, c};
    for (int round = 0; round < 2; round++) {
        KILN_CHECK(kiln_buffer_fill(target, 0, 0, 4096));
        KILN_CHECK(kiln_buffer_fill(e.out, 0, 0, 16 * 64 * 2));
        KILN_CHECK(kiln_runtime_synchronize(f->rt));
        kiln_fence *fence;
        kiln_submit_options o = {.path = KILN_PATH_ADAPTIVE, .timing = KILN_TIMING_SPANS};
        KILN_CHECK(kiln_stream_submit(f->s, pair, 2, &o, &fence));
        KILN_CHECK(kiln_fence_wait(fence));
        kiln_attribution a;
        for (int i = 0; i < 2; i++) {
            KILN_CHECK(kiln_fence_attribution(fence, (size_t)i, &a));
            assert_int_equal(a.path, KILN_EXEC_EAGER);
        }
        kiln_fence_release(fence);
        uint8_t got[4096];
        KILN_CHECK(kiln_buffer_readback(target, 0, got, sizeof got));
        for (int i = 0; i < 4096; i++)
            assert_int_equal(got[i], 0x5a);
        emb_check(&e);
        kiln_graph_stats g;
        kiln_stream_graph_stats(f->s, &g);
        assert_int_equal(g.rejected, 1); /* remembered: not tried again */
        assert_int_equal(g.captured, 0);
    }
    /* kiln_stream_prepare reports it; the replayed paths refuse it. */
    kiln_submit_options ro = {.path = KILN_PATH_REPLAYED_ONLY};
    KILN_EXPECT(kiln_stream_prepare(f->s, pair, 2, &ro, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "commands 0 (token_embedding) to 1 (test.sync_fill)", "rejected");
    KILN_EXPECT(kiln_stream_submit(f->s, pair, 2, &ro, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "not resident", "rejected");
    /* Trimmed, it is tried (and rejected) again, with the capture's error named. */
    KILN_CHECK(kiln_stream_graph_trim(f->s, 0, 0));
    KILN_EXPECT(kiln_stream_prepare(f->s, pair, 2, &ro, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "graph capture of commands 0 (token_embedding) to 1 (test.sync_fill)", "test.sync_fill: CUDA_ERROR");
    assert_int_equal(kiln_stream_get_state(f->s), KILN_STREAM_READY);
    kiln_command_release(c);
    kiln_buffer_destroy(target);
    emb_free(&e);
}

/* Unloading a module (a jit destroyed) drops graphs captured before it. */
static void test_module_unload_drops_graphs(void **state)
{
    fixture *f = *state;
    emb e;
    emb_make(f, &e);
    kiln_submit_options ro = {.path = KILN_PATH_REPLAYED_ONLY};
    KILN_CHECK(kiln_stream_prepare(f->s, &e.cmd, 1, &ro, NULL));
    kiln_jit *other;
    kiln_jit_options jo = {.cache = f->cache, .runtime = f->rt};
    KILN_CHECK(kiln_jit_create(&jo, &other));
    kiln_spec spec;
    kiln_kernel *k;
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 64, 64, 8, &spec));
    KILN_CHECK(kiln_jit_acquire(other, &spec, &k)); /* loads a module of its own */
    kiln_jit_destroy(other);
    kiln_graph_stats g;
    kiln_stream_graph_stats(f->s, &g);
    uint64_t evicted = g.evicted;
    KILN_EXPECT(submit1(f->s, e.cmd, KILN_PATH_REPLAYED_ONLY, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "command 0 (token_embedding)", "not resident");
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.evicted, evicted + 1);
    KILN_CHECK(kiln_buffer_fill(e.out, 0, 0, 16 * 64 * 2));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(submit1(f->s, e.cmd, KILN_PATH_ADAPTIVE, NULL));
    KILN_CHECK(kiln_stream_synchronize(f->s));
    emb_check(&e);
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.captured, 2);
    emb_free(&e);
}

/* A segment twice in one batch is captured once; prepare works on a busy
 * stream; a fence held across its stream's destroy reports the batch. */
static void test_repeats_busy_prepare_and_destroy(void **state)
{
    fixture *f = *state;
    emb e, e2;
    emb_make(f, &e);
    emb_make(f, &e2);
    kiln_buffer *scratch = buf(f, NULL, 4096);
    kiln_region r = {scratch, 0, 4096};
    kiln_command *z;
    KILN_CHECK(kiln_command_zero(f->rt, &r, &z)); /* no replay key: eager between the two */
    kiln_command *axa[3] = {e.cmd, z, e.cmd};
    kiln_submit_options ad = {.path = KILN_PATH_ADAPTIVE};
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_submit(f->s, axa, 3, &ad, &fence));
    static const kiln_exec_path want[3] = {KILN_EXEC_REPLAYED, KILN_EXEC_EAGER, KILN_EXEC_REPLAYED};
    for (size_t i = 0; i < 3; i++) {
        kiln_attribution a;
        KILN_CHECK(kiln_fence_attribution(fence, i, &a));
        assert_int_equal(a.path, want[i]);
    }
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_fence_release(fence);
    emb_check(&e);
    kiln_graph_stats g;
    kiln_stream_graph_stats(f->s, &g);
    assert_int_equal(g.captured, 1);
    assert_int_equal(g.hits, 1);

    kiln_command *busy = sleeper(f, 100);
    KILN_CHECK(submit1(f->s, busy, KILN_PATH_EAGER_ONLY, NULL));
    kiln_submit_options ro = {.path = KILN_PATH_REPLAYED_ONLY};
    size_t captured = 0;
    KILN_CHECK(kiln_stream_prepare(f->s, &e2.cmd, 1, &ro, &captured));
    assert_int_equal(captured, 1);
    KILN_CHECK(submit1(f->s, e2.cmd, KILN_PATH_REPLAYED_ONLY, NULL));
    KILN_CHECK(kiln_stream_synchronize(f->s));
    emb_check(&e2);

    kiln_stream *s2;
    KILN_CHECK(kiln_stream_create(f->rt, &s2));
    KILN_CHECK(kiln_buffer_fill(e.out, 0, 0, 16 * 64 * 2));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(submit1(s2, busy, KILN_PATH_EAGER_ONLY, NULL));
    kiln_fence *held;
    KILN_CHECK(submit1(s2, e.cmd, KILN_PATH_ADAPTIVE, &held)); /* busy: deferred, eager */
    kiln_stream_destroy(s2);                                    /* waits for it */
    kiln_fence_state fs;
    KILN_CHECK(kiln_fence_query(held, &fs));
    assert_int_equal(fs, KILN_FENCE_SUCCEEDED);
    KILN_CHECK(kiln_fence_wait(held));
    kiln_fence_release(held);
    emb_check(&e);

    kiln_command_release(busy);
    kiln_command_release(z);
    kiln_buffer_destroy(scratch);
    emb_free(&e);
    emb_free(&e2);
}

int main(void)
{
    kiln_test_require_gpu();
#define T(fn) cmocka_unit_test_setup_teardown(fn, gpu_fixture_setup, gpu_fixture_teardown)
    const struct CMUnitTest tests[] = {
        T(test_replay_equals_eager),
        T(test_eviction_and_trim),
        T(test_deferred_on_busy_stream),
        T(test_rejected_capture_runs_eager),
        T(test_module_unload_drops_graphs),
        T(test_repeats_busy_prepare_and_destroy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
