/* The per-head q/k RMSNorm on the GPU, in f16 and bf16: fresh random data
 * each run, outputs poisoned first (NaN), every element checked against a
 * float64 host reference (relative error against max(|ref|, 2^-14): at most
 * 1e-3 for f16 and 5e-3 for bf16, as tests/test_norm_argmax_gpu.c's norms).
 * head_dim 64, 128 and 256 (and a scalar one), GQA 32/8, 16/2 and 8/8, 1, 7
 * and 300 tokens; the fused q | k | v rows in place (v keeps its bits) and
 * out of place (out's v columns keep the poison), separate q and k in and
 * out of place; misaligned bindings (the scalar path); replay through a
 * graph; contract errors before any launch. */
#include <math.h>

#include "f16_host.h"
#include "gpu_fixture.h"
#include "testutil.h"

typedef gpu_fixture fixture;

/* An element type's host conversions and the tolerance of one rounding to it. */
static double to_double(kiln_dtype dt, uint16_t h) { return dt == KILN_DTYPE_BF16 ? kiln_test_bf16_to_f32(h) : h2f(h); }
static uint16_t from_double(kiln_dtype dt, double x)
{
    return dt == KILN_DTYPE_BF16 ? kiln_test_bf16_from_f32((float)x) : f2h(x);
}
static double tolerance(kiln_dtype dt) { return dt == KILN_DTYPE_BF16 ? 5e-3 : 1e-3; }
static const char *elt_name(kiln_dtype dt) { return dt == KILN_DTYPE_BF16 ? "bf16" : "f16"; }

static double rel_err(double got, double ref)
{
    double d = fabs(got - ref), m = fmax(fabs(ref), ldexp(1, -14));
    return isfinite(got) ? d / m : INFINITY;
}

typedef enum { FUSED_IN_PLACE, FUSED, SEPARATE, SEPARATE_IN_PLACE } form;
static const char *const form_names[] = {"fused in place", "fused", "separate", "separate in place"};

typedef struct head_case {
    int64_t d, heads, kv_heads, tokens;
    form how;
    size_t skew; /* bytes added to every offset: 2 leaves the 16-byte path */
} head_case;

/* Runs one case; the host arrays are the fused rows [T, (heads + 2 kv) * d]
 * whatever the form (the separate form uploads their q and k parts). */
static void run_case(fixture *f, const head_case *c, kiln_dtype dt)
{
    const size_t D = (size_t)c->d, NH = (size_t)c->heads, KV = (size_t)c->kv_heads, T = (size_t)c->tokens;
    const size_t W = (NH + 2 * KV) * D, n = T * W, bytes = n * 2, qb = T * NH * D * 2, kb = T * KV * D * 2;
    uint16_t *x = malloc(bytes), *got = malloc(bytes), *w = malloc(2 * D * 2);
    assert_true(x && got && w);
    /* Heads of different scales, so that the norm matters. */
    for (size_t v = 0; v < n / D; v++) {
        const double scale = ldexp(1, (int)kiln_rng_below(&f->rng, 10) - 5);
        for (size_t i = 0; i < D; i++)
            x[v * D + i] = from_double(dt, kiln_rng_uniform(&f->rng, -scale, scale));
    }
    for (size_t i = 0; i < 2 * D; i++)
        w[i] = from_double(dt, kiln_rng_uniform(&f->rng, -2, 2));
    const float eps = 1e-6f;
    const size_t sk = c->skew;
    kiln_buffer *bx = gpu_buffer(f->rt, bytes + sk), *bo = gpu_buffer(f->rt, bytes + sk),
                *bw = gpu_buffer(f->rt, 4 * D + 2 * sk);
    KILN_CHECK(kiln_buffer_upload(bw, sk, w, 2 * D));
    KILN_CHECK(kiln_buffer_upload(bw, 2 * D + 2 * sk, w + D, 2 * D));
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, bytes + sk)); /* NaN everywhere */
    kiln_tensor qw = {.buffer = bw, .offset = sk, .dtype = dt, .rank = 1, .dims = {c->d}}, kw = qw;
    kw.offset = 2 * D + 2 * sk;
    kiln_head_rms_norm_bindings b = {.size = sizeof b, .q_weight = &qw, .k_weight = &kw, .eps = eps};
    kiln_tensor qkv = {.buffer = bx, .offset = sk, .dtype = dt, .rank = 2, .dims = {c->tokens, (int64_t)W}},
                out = qkv, q, k, qo, ko;
    if (c->how == FUSED_IN_PLACE || c->how == FUSED) {
        KILN_CHECK(kiln_buffer_upload(bx, sk, x, bytes));
        out.buffer = c->how == FUSED ? bo : bx;
        b.qkv = &qkv;
        b.out = &out;
        b.heads = c->heads;
        b.kv_heads = c->kv_heads;
    } else {
        /* q at the start of bx, k after it; outputs likewise in bo (or bx in place). */
        uint16_t *sq = malloc(qb), *sk_ = malloc(kb);
        assert_true(sq && sk_);
        for (size_t t = 0; t < T; t++) {
            memcpy(sq + t * NH * D, x + t * W, NH * D * 2);
            memcpy(sk_ + t * KV * D, x + t * W + NH * D, KV * D * 2);
        }
        KILN_CHECK(kiln_buffer_upload(bx, sk, sq, qb));
        KILN_CHECK(kiln_buffer_upload(bx, sk + qb, sk_, kb));
        free(sq);
        free(sk_);
        q = (kiln_tensor){.buffer = bx, .offset = sk, .dtype = dt, .rank = 3,
                          .dims = {c->tokens, c->heads, c->d}};
        k = q;
        k.offset = sk + qb;
        k.dims[1] = c->kv_heads;
        qo = q;
        ko = k;
        if (c->how == SEPARATE)
            qo.buffer = ko.buffer = bo;
        b.q = &q;
        b.k = &k;
        b.q_out = &qo;
        b.k_out = &ko;
    }
    KILN_CHECK(kiln_op_head_rms_norm(f->jit, &b));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    /* got: the fused rows again, v from the buffer read back (fused) or the input (separate, never written). */
    kiln_buffer *rb = c->how == FUSED ? bo : c->how == SEPARATE ? bo : bx;
    if (c->how == FUSED_IN_PLACE || c->how == FUSED) {
        KILN_CHECK(kiln_buffer_readback(rb, sk, got, bytes));
    } else {
        uint16_t *gq = malloc(qb), *gk = malloc(kb);
        assert_true(gq && gk);
        KILN_CHECK(kiln_buffer_readback(rb, sk, gq, qb));
        KILN_CHECK(kiln_buffer_readback(rb, sk + qb, gk, kb));
        memcpy(got, x, bytes);
        for (size_t t = 0; t < T; t++) {
            memcpy(got + t * W, gq + t * NH * D, NH * D * 2);
            memcpy(got + t * W + NH * D, gk + t * KV * D, KV * D * 2);
        }
        free(gq);
        free(gk);
    }
    size_t wrong = 0;
    double worst = 0;
    for (size_t t = 0; t < T; t++)
        for (size_t h = 0; h < NH + 2 * KV; h++) {
            const size_t at = t * W + h * D;
            if (h >= NH + KV) {
                /* v: untouched, so the input's bits in place and the poison out of place. */
                for (size_t i = 0; i < D; i++) {
                    const uint16_t want = c->how == FUSED ? 0xffff : x[at + i];
                    if (got[at + i] != want && wrong++ < 5)
                        fprintf(stderr, "%s %s d %zu: v[%zu][%zu][%zu] = 0x%04x, want 0x%04x\n", elt_name(dt),
                                form_names[c->how], D, t, h, i, got[at + i], want);
                }
                continue;
            }
            const uint16_t *wt = h < NH ? w : w + D;
            double ss = 0;
            for (size_t i = 0; i < D; i++) {
                const double v = to_double(dt, x[at + i]);
                ss += v * v;
            }
            const double inv = 1.0 / sqrt(ss / (double)D + (double)eps);
            for (size_t i = 0; i < D; i++) {
                const double ref = to_double(dt, x[at + i]) * inv * to_double(dt, wt[i]), g = to_double(dt, got[at + i]),
                             d = rel_err(g, ref);
                worst = fmax(worst, d);
                if (d > tolerance(dt) && wrong++ < 5)
                    fprintf(stderr, "%s %s d %zu heads %zu/%zu T %zu: [%zu][%zu][%zu] = %g, want %g\n", elt_name(dt),
                            form_names[c->how], D, NH, KV, T, t, h, i, g, ref);
            }
        }
    if (wrong)
        fail_msg("%s %s d %zu heads %zu/%zu T %zu skew %zu: %zu wrong (worst %g)", elt_name(dt), form_names[c->how], D, NH,
                 KV, T, sk, wrong, worst);
    kiln_buffer_destroy(bx);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bw);
    free(x);
    free(got);
    free(w);
}

static void every_shape(fixture *f, kiln_dtype dt)
{
    static const int64_t dims[] = {64, 128, 256}, tokens[] = {1, 7, 300};
    static const int64_t gqa[][2] = {{32, 8}, {16, 2}, {8, 8}};
    for (size_t d = 0; d < 3; d++)
        for (size_t g = 0; g < 3; g++)
            for (size_t t = 0; t < 3; t++)
                for (int how = 0; how < 4; how++) {
                    const head_case c = {dims[d], gqa[g][0], gqa[g][1], tokens[t], (form)how, 0};
                    run_case(f, &c, dt);
                }
}

static void test_every_shape(void **state) { every_shape(*state, KILN_DTYPE_F16); }
static void test_every_shape_bf16(void **state) { every_shape(*state, KILN_DTYPE_BF16); }

/* The scalar path: misaligned bindings, and a head_dim of no whole vectors. */
static void scalar_paths(fixture *f, kiln_dtype dt)
{
    static const head_case cases[] = {{128, 32, 8, 7, FUSED_IN_PLACE, 2}, {128, 16, 2, 300, FUSED, 2},
                                      {64, 16, 2, 7, SEPARATE, 2},        {100, 12, 3, 7, FUSED_IN_PLACE, 0},
                                      {100, 12, 3, 300, SEPARATE, 0},     {1, 3, 1, 5, FUSED, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(f, &cases[i], dt);
}

static void test_scalar_paths(void **state) { scalar_paths(*state, KILN_DTYPE_F16); }
static void test_scalar_paths_bf16(void **state) { scalar_paths(*state, KILN_DTYPE_BF16); }

/* The fused form in place over one buffer: qkv [T, (NH + 2 KV) * D] at 0,
 * q_weight at 512 KiB, k_weight 4 KiB past it. */
typedef struct fused_views {
    kiln_buffer *b;
    kiln_tensor qkv, qw, kw;
    kiln_head_rms_norm_bindings hb;
} fused_views;

static void fused_views_make(fixture *f, fused_views *v, kiln_dtype dt, int64_t T, int64_t NH, int64_t KV, int64_t D)
{
    v->b = gpu_buffer(f->rt, 1 << 20);
    v->qkv = (kiln_tensor){.buffer = v->b, .dtype = dt, .rank = 2, .dims = {T, (NH + 2 * KV) * D}};
    v->qw = (kiln_tensor){.buffer = v->b, .offset = 512 << 10, .dtype = dt, .rank = 1, .dims = {D}};
    v->kw = v->qw;
    v->kw.offset += 4096;
    v->hb = (kiln_head_rms_norm_bindings){.qkv = &v->qkv, .out = &v->qkv, .q_weight = &v->qw, .k_weight = &v->kw,
                                          .heads = NH, .kv_heads = KV, .eps = 1e-6f};
}

/* A command is replayable, its key stable: submitted twice through a graph
 * it normalizes the current contents each time. */
static void test_command_replays(void **state)
{
    fixture *f = *state;
    const int64_t T = 4, NH = 8, KV = 2, D = 128, W = (NH + 2 * KV) * D;
    fused_views v;
    fused_views_make(f, &v, KILN_DTYPE_BF16, T, NH, KV, D);
    kiln_buffer *b = v.b;
    uint16_t one = 0x3f80, two = 0x4000;
    KILN_CHECK(kiln_buffer_fill(b, 0, 0, 1 << 20));
    for (int64_t i = 0; i < D; i++) {
        KILN_CHECK(kiln_buffer_upload(b, v.qw.offset + (size_t)i * 2, &one, 2));
        KILN_CHECK(kiln_buffer_upload(b, v.kw.offset + (size_t)i * 2, &one, 2));
    }
    kiln_command *cmd;
    KILN_CHECK(kiln_op_head_rms_norm_encode(f->jit, &v.hb, &cmd));
    assert_true(kiln_command_replayable(cmd));
    assert_string_equal(kiln_command_op_id(cmd), "head_rms_norm");
    for (int round = 0; round < 2; round++) {
        /* Every q and k element 2 (then, in round 1, a head of all 2 but one 0): normalized to 1 (then ~1.0039, 0). */
        uint16_t *row = malloc((size_t)(T * W) * 2);
        for (int64_t i = 0; i < T * W; i++)
            row[i] = two;
        if (round)
            row[0] = 0;
        KILN_CHECK(kiln_buffer_upload(b, 0, row, (size_t)(T * W) * 2));
        kiln_attribution a;
        gpu_submit_replayed(f->s, cmd, &a);
        assert_int_equal(a.tokens, (uint32_t)T);
        KILN_CHECK(kiln_buffer_readback(b, 0, row, (size_t)(T * W) * 2));
        const double first = round ? sqrt(128.0 / 127.0) : 1.0;
        assert_true(fabs(kiln_test_bf16_to_f32(row[1]) - first) < 1e-2);
        assert_int_equal(row[0], round ? 0 : one);
        assert_int_equal(row[D], one);                 /* the next q head */
        assert_int_equal(row[(NH + KV) * D], two);     /* v */
        assert_int_equal(row[W + (NH + 1) * D], one);  /* token 1's second k head */
        free(row);
    }
    kiln_command_release(cmd);
    kiln_buffer_destroy(b);
}

/* A prewarmed Qwen3-8B-shaped config leaves nothing to compile. */
static void test_prewarmed_config_compiles_nothing(void **state)
{
    fixture *f = *state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    c.qk_norm = 1;
    c.dtype = KILN_DTYPE_BF16;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
    kiln_spec *specs = NULL;
    size_t n = 0;
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    for (size_t i = 0; i < n; i++)
        if (!strcmp(specs[i].template_id, "head_rms_norm")) {
            int compiled = 0;
            KILN_CHECK(kiln_jit_prepare(f->jit, &specs[i], &compiled));
        }
    kiln_free(specs);
    kiln_jit_options jo = {.cache = f->cache, .runtime = f->rt};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    fused_views v;
    fused_views_make(f, &v, KILN_DTYPE_BF16, 3, 32, 8, 128);
    kiln_command *cmd;
    KILN_CHECK(kiln_op_head_rms_norm_encode(jit, &v.hb, &cmd));
    kiln_command_release(cmd);
    kiln_jit_counters k;
    kiln_jit_get_counters(jit, &k);
    assert_int_equal(k.compiles, 0);
    assert_int_equal(k.database_hits, 1);
    kiln_buffer_destroy(v.b);
    kiln_jit_destroy(jit);
}

static void test_bad_bindings_are_refused_before_launch(void **state)
{
    fixture *f = *state;
    fused_views v;
    fused_views_make(f, &v, KILN_DTYPE_F16, 4, 8, 2, 64);
    const kiln_head_rms_norm_bindings hb = v.hb;
    kiln_tensor bad = v.kw;
    bad.dims[0] = 32;
    kiln_head_rms_norm_bindings c = hb;
    c.k_weight = &bad;
    KILN_EXPECT(kiln_op_head_rms_norm(f->jit, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(f->rt),
                "binding k_weight has dims [32]", "must be 64");
    bad = v.qw;
    bad.dtype = KILN_DTYPE_BF16;
    c = hb;
    c.q_weight = &bad;
    KILN_EXPECT(kiln_op_head_rms_norm(f->jit, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding q_weight must be f16", "got bf16");
    c = hb;
    c.heads = 16;
    kiln_command *cmd = NULL;
    KILN_EXPECT(kiln_op_head_rms_norm_encode(f->jit, &c, &cmd), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv has dims [4, 768]", NULL);
    assert_null(cmd);
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    kiln_buffer_destroy(v.b);
}

int main(void)
{
    kiln_test_require_gpu();
    kiln_test_filter();
#define T(fn) cmocka_unit_test_setup_teardown(fn, gpu_fixture_setup, gpu_fixture_teardown)
    const struct CMUnitTest tests[] = {
        T(test_every_shape),
        T(test_every_shape_bf16),
        T(test_scalar_paths),
        T(test_scalar_paths_bf16),
        T(test_command_replays),
        T(test_prewarmed_config_compiles_nothing),
        T(test_bad_bindings_are_refused_before_launch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
