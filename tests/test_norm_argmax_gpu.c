/* RMSNorm (plain and fused with the residual), residual add and the masked
 * argmax with repetition penalty on the GPU, in f16 and in bf16: fresh random
 * data each run, outputs poisoned first, every output element checked against
 * a float64 host reference (norms: relative error measured against
 * max(|ref|, 2^-14), at most 1e-3 for f16, about two of its half-ulps 2^-11,
 * and 5e-3 for bf16, its half-ulp 2^-8 and a margin for the f32 sums) or,
 * for the argmax, against an exact host emulation of its f32 arithmetic
 * (NaN, -inf and +inf, ties). Shapes of Llama-3-8B, Qwen2.5-0.5B and odd
 * ones, 1 to 4096 tokens, 1 to 64 participants; in-place forms, scalar paths,
 * long rows, vocabularies in several slices; replay through a graph; a
 * prewarmed database that leaves nothing to compile; mixed element types
 * refused. */
#include <math.h>

#include "f16_host.h"
#include "gpu_fixture.h"
#include "testutil.h"

typedef gpu_fixture fixture;

/* The element type a case runs in: its dtype, the host conversions, the
 * tolerance of one rounding to it, and bit patterns the cases plant. */
typedef struct elt_t {
    kiln_dtype dtype;
    const char *name;
    float (*to_f32)(uint16_t);
    uint16_t (*from)(double);
    double tol;
    uint16_t qnan_neg, max_finite, inf, neg_inf, one, half;
} elt_t;

/* Through f32: x is a random input, or a sum of two bf16 values, which f32
 * holds to 24 >= 2 * 8 + 2 bits (the double rounding is innocuous). */
static uint16_t bf16_from_double(double x) { return kiln_test_bf16_from_f32((float)x); }

static const elt_t F16 = {KILN_DTYPE_F16, "f16", h2f, f2h, 1e-3, 0xfe00, 0x7bff, 0x7c00, 0xfc00, 0x3c00, 0x3800};
static const elt_t BF16 = {KILN_DTYPE_BF16, "bf16", kiln_test_bf16_to_f32, bf16_from_double, 5e-3, 0xffc0,
                           0x7f7f, 0x7f80, 0xff80, 0x3f80, 0x3f00};

/* A NaN of either sign and any payload, from random bits. */
static uint16_t random_nan(const elt_t *e, uint64_t u)
{
    const uint16_t sign = (u >> 20) & 1 ? 0x8000 : 0;
    if (e->dtype == KILN_DTYPE_BF16)
        return (uint16_t)(0x7f81 | ((u >> 8) & 0x7f) | sign);
    return (uint16_t)(0x7c01 | ((u >> 8) & 0x3ff) | sign);
}


static double uniform(kiln_rng *r, double lo, double hi)
{
    return lo + (hi - lo) * (double)(kiln_rng_next(r) >> 11) * ldexp(1, -53);
}

static kiln_buffer *buffer(kiln_runtime *rt, size_t bytes)
{
    kiln_buffer *b;
    KILN_CHECK(kiln_buffer_create(rt, bytes, 256, &b));
    return b;
}

/* ---- norms and residual add ---- */

typedef enum { K_NORM, K_FUSED, K_ADD } kind;

typedef struct norm_case {
    kind k;
    int64_t hidden, tokens;
    size_t skew;   /* bytes added to every offset: 2 leaves the 16-byte path */
    int in_place;  /* norm: out = x; add: 1 out = a, 2 out = b */
} norm_case;

static double rel_err(double got, double ref)
{
    double d = fabs(got - ref), m = fmax(fabs(ref), ldexp(1, -14));
    return isfinite(got) ? d / m : INFINITY;
}

static void run_norm_case(fixture *f, const norm_case *c, const elt_t *e)
{
    const size_t n = (size_t)c->tokens * (size_t)c->hidden, bytes = n * 2, H = (size_t)c->hidden;
    uint16_t *x = malloc(bytes), *r = malloc(bytes), *w = malloc(H * 2), *got = malloc(bytes), *res = malloc(bytes);
    assert_true(x && r && w && got && res);
    /* Rows of different scales, so that the norm matters. */
    for (int64_t t = 0; t < c->tokens; t++) {
        double scale = ldexp(1, (int)kiln_rng_below(&f->rng, 8) - 4);
        for (size_t h = 0; h < H; h++) {
            x[t * H + h] = e->from(uniform(&f->rng, -scale, scale));
            r[t * H + h] = e->from(uniform(&f->rng, -scale, scale));
        }
    }
    for (size_t h = 0; h < H; h++)
        w[h] = e->from(uniform(&f->rng, -2, 2));
    const float eps = c->hidden % 2 ? 1e-6f : 1e-5f;

    kiln_buffer *bx = buffer(f->rt, bytes + c->skew), *br = buffer(f->rt, bytes + c->skew),
                *bw = buffer(f->rt, H * 2 + c->skew), *bo = buffer(f->rt, bytes + c->skew);
    KILN_CHECK(kiln_buffer_upload(bx, c->skew, x, bytes));
    KILN_CHECK(kiln_buffer_upload(br, c->skew, r, bytes));
    KILN_CHECK(kiln_buffer_upload(bw, c->skew, w, H * 2));
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, bytes + c->skew)); /* NaN everywhere */
    kiln_tensor tx = {.buffer = bx, .offset = c->skew, .dtype = e->dtype, .rank = 2,
                      .dims = {c->tokens, c->hidden}};
    kiln_tensor tr = tx, to = tx, tw = {.buffer = bw, .offset = c->skew, .dtype = e->dtype, .rank = 1,
                                        .dims = {c->hidden}};
    tr.buffer = br;
    to.buffer = bo;
    if (c->in_place == 1)
        to = tx;
    else if (c->in_place == 2)
        to = tr;
    switch (c->k) {
    case K_NORM: KILN_CHECK(kiln_op_rms_norm(f->jit, &tx, &tw, eps, &to)); break;
    case K_FUSED: KILN_CHECK(kiln_op_rms_norm_residual(f->jit, &tx, &tr, &tw, eps, &to)); break;
    case K_ADD: KILN_CHECK(kiln_op_residual_add(f->jit, &tx, &tr, &to)); break;
    }
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(kiln_buffer_readback(to.buffer, to.offset, got, bytes));
    if (c->k == K_FUSED)
        KILN_CHECK(kiln_buffer_readback(br, c->skew, res, bytes));

    size_t wrong = 0;
    double worst = 0;
    for (int64_t t = 0; t < c->tokens; t++) {
        const size_t row = (size_t)t * H;
        double ss = 0, hrow_ok = 1;
        (void)hrow_ok;
        /* h: x, or elt(x + r) for the fused form (what residual must hold). */
        for (size_t h = 0; h < H; h++) {
            double v = e->to_f32(x[row + h]);
            if (c->k != K_NORM)
                v = e->to_f32(e->from(v + e->to_f32(r[row + h])));
            if (c->k == K_FUSED) {
                double d = rel_err(e->to_f32(res[row + h]), v);
                if (d > e->tol && wrong++ < 5)
                    fprintf(stderr, "%s hidden %lld tokens %lld: residual[%lld][%zu] = %g, want %g\n", e->name,
                            (long long)c->hidden, (long long)c->tokens, (long long)t, h,
                            e->to_f32(res[row + h]), v);
            }
            ss += v * v;
        }
        const double inv = 1.0 / sqrt(ss / (double)H + (double)eps);
        for (size_t h = 0; h < H; h++) {
            double v = e->to_f32(x[row + h]), ref;
            if (c->k == K_ADD) {
                ref = v + e->to_f32(r[row + h]);
            } else {
                if (c->k == K_FUSED)
                    v = e->to_f32(e->from(v + e->to_f32(r[row + h])));
                ref = v * inv * e->to_f32(w[h]);
            }
            double d = rel_err(e->to_f32(got[row + h]), ref);
            if (d > worst)
                worst = d;
            if (d > e->tol && wrong++ < 5)
                fprintf(stderr, "%s kind %d hidden %lld tokens %lld: out[%lld][%zu] = %g (0x%04x), want %.9g\n",
                        e->name, c->k, (long long)c->hidden, (long long)c->tokens, (long long)t, h,
                        e->to_f32(got[row + h]), got[row + h], ref);
        }
    }
    fprintf(stderr, "%s kind %d hidden %lld tokens %lld skew %zu in_place %d: max rel err %.3g\n", e->name, c->k,
            (long long)c->hidden, (long long)c->tokens, c->skew, c->in_place, worst);
    if (wrong)
        fail_msg("%s kind %d hidden %lld tokens %lld: %zu of %zu elements wrong", e->name, c->k,
                 (long long)c->hidden, (long long)c->tokens, wrong, n);
    kiln_buffer_destroy(bx);
    kiln_buffer_destroy(br);
    kiln_buffer_destroy(bw);
    kiln_buffer_destroy(bo);
    free(x);
    free(r);
    free(w);
    free(got);
    free(res);
}

static const int64_t model_hiddens[] = {4096, 896, 1000};
static const int64_t token_counts[] = {1, 16, 37, 2048, 4096};

static void run_kind_at_model_sizes(fixture *f, kind k, const elt_t *e)
{
    for (size_t h = 0; h < 3; h++)
        for (size_t t = 0; t < 5; t++) {
            norm_case c = {k, model_hiddens[h], token_counts[t], 0, 0};
            run_norm_case(f, &c, e);
        }
    static const norm_case odd[] = {
        {0, 1001, 5, 0, 0},   /* scalar path */
        {0, 1001, 300, 0, 0},
        {0, 4096, 9, 2, 0},   /* misaligned views: scalar path */
        {0, 65536, 3, 0, 0},  /* the longest row: read twice */
        {0, 65535, 2, 0, 0},  /* and scalar */
        {0, 65536, 300, 0, 0}, /* read twice, several rows a block */
        {0, 20001, 700, 0, 0}, /* scalar, read twice, several rows a block */
        {0, 8, 100, 0, 0},    /* one vector a row */
        {0, 1, 7, 0, 0},      /* one element a row */
    };
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        norm_case c = odd[i];
        c.k = k;
        run_norm_case(f, &c, e);
    }
}

static void rms_norm_cases(fixture *f, const elt_t *e)
{
    run_kind_at_model_sizes(f, K_NORM, e);
    norm_case c = {K_NORM, 4096, 300, 0, 1}; /* in place */
    run_norm_case(f, &c, e);
    /* One kernel per hidden size and vector width: the token count is not a constant. */
    kiln_jit_counters k;
    kiln_jit_get_counters(f->jit, &k);
    assert_int_equal(k.compiles, 3 + 6 /* 1001, 4096 scalar, 65536, 65535, 20001, 8 */ + 1 /* 1 */);
}

static void test_rms_norm(void **state) { rms_norm_cases(*state, &F16); }
static void test_rms_norm_bf16(void **state) { rms_norm_cases(*state, &BF16); }

static void rms_norm_residual_cases(fixture *f, const elt_t *e)
{
    run_kind_at_model_sizes(f, K_FUSED, e);
    norm_case c = {K_FUSED, 896, 513, 0, 1};
    run_norm_case(f, &c, e);
}

static void test_rms_norm_residual(void **state) { rms_norm_residual_cases(*state, &F16); }
static void test_rms_norm_residual_bf16(void **state) { rms_norm_residual_cases(*state, &BF16); }

static void residual_add_cases(fixture *f, const elt_t *e)
{
    run_kind_at_model_sizes(f, K_ADD, e);
    norm_case a = {K_ADD, 4096, 64, 0, 1}, b = {K_ADD, 1000, 64, 0, 2};
    run_norm_case(f, &a, e);
    run_norm_case(f, &b, e);
}

static void test_residual_add(void **state) { residual_add_cases(*state, &F16); }
static void test_residual_add_bf16(void **state) { residual_add_cases(*state, &BF16); }

/* The fused form gives the same bits as residual add followed by RMSNorm. */
static void fused_equals_add_then_norm(fixture *f, const elt_t *e)
{
    const int64_t T = 100, H = 4096;
    const size_t bytes = (size_t)T * H * 2;
    uint16_t *host = malloc(bytes), *a = malloc(bytes), *b = malloc(bytes);
    assert_true(host && a && b);
    for (size_t i = 0; i < (size_t)T * H; i++)
        host[i] = e->from(uniform(&f->rng, -3, 3));
    kiln_buffer *x = buffer(f->rt, bytes), *r1 = buffer(f->rt, bytes), *r2 = buffer(f->rt, bytes),
                *o1 = buffer(f->rt, bytes), *o2 = buffer(f->rt, bytes), *w = buffer(f->rt, H * 2);
    KILN_CHECK(kiln_buffer_upload(x, 0, host, bytes));
    for (size_t i = 0; i < (size_t)T * H; i++)
        host[i] = e->from(uniform(&f->rng, -3, 3));
    KILN_CHECK(kiln_buffer_upload(r1, 0, host, bytes));
    KILN_CHECK(kiln_buffer_upload(r2, 0, host, bytes));
    KILN_CHECK(kiln_buffer_upload(w, 0, host, H * 2));
    kiln_tensor tx = {.buffer = x, .dtype = e->dtype, .rank = 2, .dims = {T, H}}, tr1 = tx, tr2 = tx, to1 = tx,
                to2 = tx, tw = {.buffer = w, .dtype = e->dtype, .rank = 1, .dims = {H}};
    tr1.buffer = r1;
    tr2.buffer = r2;
    to1.buffer = o1;
    to2.buffer = o2;
    KILN_CHECK(kiln_op_rms_norm_residual(f->jit, &tx, &tr1, &tw, 1e-5f, &to1));
    KILN_CHECK(kiln_op_residual_add(f->jit, &tx, &tr2, &tr2));
    KILN_CHECK(kiln_op_rms_norm(f->jit, &tr2, &tw, 1e-5f, &to2));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(kiln_buffer_readback(r1, 0, a, bytes));
    KILN_CHECK(kiln_buffer_readback(r2, 0, b, bytes));
    assert_memory_equal(a, b, bytes);
    KILN_CHECK(kiln_buffer_readback(o1, 0, a, bytes));
    KILN_CHECK(kiln_buffer_readback(o2, 0, b, bytes));
    assert_memory_equal(a, b, bytes);
    kiln_buffer_destroy(x);
    kiln_buffer_destroy(r1);
    kiln_buffer_destroy(r2);
    kiln_buffer_destroy(o1);
    kiln_buffer_destroy(o2);
    kiln_buffer_destroy(w);
    free(host);
    free(a);
    free(b);
}

static void test_fused_equals_add_then_norm(void **state) { fused_equals_add_then_norm(*state, &F16); }
static void test_fused_equals_add_then_norm_bf16(void **state) { fused_equals_add_then_norm(*state, &BF16); }

/* ---- masked argmax ---- */

typedef struct argmax_case {
    int64_t vocab, P;
    uint32_t max_rep;     /* repetition ids per participant: 0..max_rep */
    float penalty;        /* 0: random in [1, 2] */
    double valid_density; /* of the mask */
    size_t logits_skew;   /* bytes: 2 leaves the vector path */
    int special;          /* see below */
} argmax_case;

enum { S_NONE, S_ALL_MASKED, S_NAN_ROW, S_TIES, S_ZEROS, S_BAD_OFFSETS, S_INF };

static uint32_t reference(const elt_t *e, const uint16_t *row, const uint8_t *valid, int64_t V, const uint32_t *ids,
                          uint32_t a, uint32_t b, float penalty, uint8_t *rep /* V bytes scratch */)
{
    memset(rep, 0, (size_t)V);
    for (uint32_t j = a; j < b; j++)
        if (ids[j] < (uint64_t)V)
            rep[ids[j]] = 1;
    uint32_t best = KILN_ARGMAX_NONE;
    float bv = 0;
    for (int64_t t = 0; t < V; t++) {
        if (!valid[t])
            continue;
        volatile float l = e->to_f32(row[t]); /* f32 arithmetic, as the kernel */
        if (rep[t])
            l = l > 0.0f ? l / penalty : l * penalty;
        if (isnan(l))
            continue;
        if (best == KILN_ARGMAX_NONE || l > bv) {
            best = (uint32_t)t;
            bv = l;
        }
    }
    return best;
}

static void run_argmax_case(fixture *f, const argmax_case *c, const elt_t *e)
{
    kiln_rng *g = &f->rng;
    const int64_t V = c->vocab, P = c->P;
    const size_t lbytes = (size_t)P * V * 2;
    uint16_t *logits = malloc(lbytes), *back = malloc(lbytes);
    uint8_t *valid = malloc((size_t)V), *scratch = malloc((size_t)V);
    uint32_t *offs = malloc(((size_t)P + 1) * 4), *got = malloc((size_t)P * 4);
    const size_t cap = (size_t)P * c->max_rep + 7;
    uint32_t *ids = malloc(cap * 4);
    assert_true(logits && back && valid && scratch && offs && got && ids);

    for (size_t i = 0; i < (size_t)P * V; i++) {
        uint64_t u = kiln_rng_next(g);
        if ((u & 127) == 0) /* about 1% NaN of either sign and payload */
            logits[i] = random_nan(e, u);
        else
            logits[i] = e->from(uniform(g, -8, 8));
    }
    for (int64_t t = 0; t < V; t++)
        valid[t] = uniform(g, 0, 1) < c->valid_density ? (uint8_t)(1 + kiln_rng_below(g, 255)) : 0;
    if (c->special == S_ALL_MASKED)
        memset(valid, 0, (size_t)V);
    if (c->special == S_NAN_ROW)
        for (int64_t t = 0; t < V; t++)
            logits[(size_t)(P - 1) * V + t] = e->qnan_neg; /* the last participant: NaN only */
    if (c->special == S_ZEROS)
        for (size_t i = 0; i < (size_t)P * V; i++)
            logits[i] = kiln_rng_below(g, 2) ? 0x8000 : 0x0000; /* -0 and +0 tie */
    if (c->special == S_INF)
        for (size_t i = 0; i < (size_t)P * V; i++) /* -inf everywhere but NaNs: the first valid wins */
            if (e->to_f32(logits[i]) == e->to_f32(logits[i]))
                logits[i] = e->neg_inf;
    float penalty = c->penalty ? c->penalty : (float)uniform(g, 1.0, 2.0);

    /* Repetition ids: duplicates, ids past the vocabulary, often the unpenalized winner. */
    size_t n = 0;
    offs[0] = 0;
    for (int64_t p = 0; p < P; p++) {
        uint32_t len = c->max_rep ? kiln_rng_below(g, c->max_rep + 1) : 0;
        if (c->special == S_TIES && len == 0)
            len = 1;
        uint32_t winner = reference(e, logits + (size_t)p * V, valid, V, ids, 0, 0, 1.0f, scratch);
        for (uint32_t j = 0; j < len; j++) {
            uint32_t u = kiln_rng_below(g, 16), id;
            if (u == 0)
                id = (uint32_t)V + kiln_rng_below(g, 1000); /* ignored */
            else if (u == 1)
                id = 0xffffffffu;
            else if (u < 4 && n > offs[p])
                id = ids[offs[p] + kiln_rng_below(g, (uint32_t)(n - offs[p]))]; /* a duplicate */
            else if (u < 6 && winner != KILN_ARGMAX_NONE)
                id = winner;
            else
                id = kiln_rng_below(g, (uint32_t)V);
            ids[n++] = id;
        }
        offs[p + 1] = (uint32_t)n;
    }
    for (size_t j = n; j < cap; j++)
        ids[j] = kiln_rng_below(g, (uint32_t)V); /* past the last offset: never read as repetitions */
    if (c->special == S_TIES && P >= 2) {
        /* Participant 0: a repeated 4 (-> 2 with penalty 2) before a plain 2: the repeated one wins the tie. */
        uint16_t *row = logits;
        for (int64_t t = 0; t < V; t++)
            if (e->to_f32(row[t]) >= 2.0f)
                row[t] = e->from(1.0);
        row[V / 3] = e->from(4.0);
        row[V / 2] = e->from(2.0);
        valid[V / 3] = valid[V / 2] = 1;
        ids[offs[0]] = (uint32_t)(V / 3);
        if (offs[1] == offs[0])
            fail_msg("the ties case needs repetition ids");
        /* Participant 1: the largest value at many places; the first wins. */
        row = logits + V;
        for (int k = 0; k < 50; k++) {
            int64_t t = V - 1 - kiln_rng_below(g, (uint32_t)(V / 2));
            row[t] = e->max_finite;
            valid[t] = 1;
        }
    }
    if (c->special == S_INF && P >= 2) {
        /* Participant 1: +inf at many places (some repeated: inf / penalty is inf); the first wins. */
        uint16_t *row = logits + V;
        for (int k = 0; k < 20; k++) {
            int64_t t = kiln_rng_below(g, (uint32_t)V);
            row[t] = e->inf;
            valid[t] = 1;
        }
    }
    if (c->special == S_BAD_OFFSETS && P >= 3) {
        offs[1] = offs[2] + 5;           /* participant 0 ends after 1 ends: 1 is empty */
        offs[P] = (uint32_t)cap + 1000;  /* past the capacity: clamped */
    }

    kiln_buffer *bl = buffer(f->rt, lbytes + c->logits_skew), *bv = buffer(f->rt, (size_t)V),
                *bi = buffer(f->rt, cap * 4), *bf = buffer(f->rt, ((size_t)P + 1) * 4), *bp = buffer(f->rt, 4),
                *bo = buffer(f->rt, (size_t)P * 4);
    size_t ws_bytes;
    KILN_CHECK(kiln_op_masked_argmax_workspace(V, P, &ws_bytes));
    kiln_buffer *bw = buffer(f->rt, ws_bytes);
    KILN_CHECK(kiln_buffer_upload(bl, c->logits_skew, logits, lbytes));
    KILN_CHECK(kiln_buffer_upload(bv, 0, valid, (size_t)V));
    KILN_CHECK(kiln_buffer_upload(bi, 0, ids, cap * 4));
    KILN_CHECK(kiln_buffer_upload(bf, 0, offs, ((size_t)P + 1) * 4));
    KILN_CHECK(kiln_buffer_upload(bp, 0, &penalty, 4));
    KILN_CHECK(kiln_buffer_fill(bw, 0, 0xab, ws_bytes));
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xee, (size_t)P * 4));
    kiln_tensor tl = {.buffer = bl, .offset = c->logits_skew, .dtype = e->dtype, .rank = 2, .dims = {P, V}},
                tv = {.buffer = bv, .dtype = KILN_DTYPE_U8, .rank = 1, .dims = {V}},
                ti = {.buffer = bi, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {(int64_t)cap}},
                tf = {.buffer = bf, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P + 1}},
                tp = {.buffer = bp, .dtype = KILN_DTYPE_F32, .rank = 1, .dims = {1}},
                tw = {.buffer = bw, .dtype = KILN_DTYPE_U8, .rank = 1, .dims = {(int64_t)ws_bytes}},
                to = {.buffer = bo, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P}};
    kiln_masked_argmax_bindings b = {sizeof b, &tl, &tv, &ti, &tf, &tp, &tw, &to};
    KILN_CHECK(kiln_op_masked_argmax(f->jit, &b));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(kiln_buffer_readback(bo, 0, got, (size_t)P * 4));
    KILN_CHECK(kiln_buffer_readback(bl, c->logits_skew, back, lbytes));
    assert_memory_equal(back, logits, lbytes); /* left unchanged */

    size_t wrong = 0, none = 0;
    for (int64_t p = 0; p < P; p++) {
        uint32_t b_ = offs[p + 1] < cap ? offs[p + 1] : (uint32_t)cap, a_ = offs[p] < b_ ? offs[p] : b_;
        uint32_t want = reference(e, logits + (size_t)p * V, valid, V, ids, a_, b_, penalty, scratch);
        none += want == KILN_ARGMAX_NONE;
        if (got[p] != want && wrong++ < 5)
            fprintf(stderr, "%s vocab %lld P %lld: out[%lld] = %u (%g), want %u (%g); repetitions %u, penalty %g\n",
                    e->name, (long long)V, (long long)P, (long long)p, got[p],
                    got[p] < (uint64_t)V ? e->to_f32(logits[(size_t)p * V + got[p]]) : NAN, want,
                    want < (uint64_t)V ? e->to_f32(logits[(size_t)p * V + want]) : NAN, b_ - a_, penalty);
    }
    fprintf(stderr, "%s argmax vocab %lld P %lld max_rep %u special %d: %lld checked, %zu without a token\n",
            e->name, (long long)V, (long long)P, c->max_rep, c->special, (long long)P, none);
    if (wrong)
        fail_msg("%s vocab %lld P %lld: %zu of %lld wrong", e->name, (long long)V, (long long)P, wrong,
                 (long long)P);
    if (c->special == S_ALL_MASKED)
        assert_int_equal(none, P);
    if (c->special == S_NAN_ROW)
        assert_int_equal(got[P - 1], KILN_ARGMAX_NONE);
    if (c->special == S_TIES && P >= 2)
        assert_int_equal(got[0], (uint32_t)(V / 3));
    if (c->special == S_INF && P >= 2) /* the reference agreed: the lowest +inf of participant 1 */
        assert_true(got[1] < (uint64_t)V && logits[(size_t)V + got[1]] == e->inf);
    kiln_buffer_destroy(bl);
    kiln_buffer_destroy(bv);
    kiln_buffer_destroy(bi);
    kiln_buffer_destroy(bf);
    kiln_buffer_destroy(bp);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bw);
    free(logits);
    free(back);
    free(valid);
    free(scratch);
    free(offs);
    free(got);
    free(ids);
}

static void masked_argmax_model_vocabularies(fixture *f, const elt_t *e)
{
    static const argmax_case cases[] = {
        {151936, 1, 0, 1.0f, 0.9, 0, S_NONE},    /* Qwen2.5: no repetitions */
        {151936, 1, 64, 0, 0.9, 0, S_NONE},
        {151936, 3, 2000, 0, 0.5, 0, S_NONE},
        {151936, 64, 300, 0, 0.95, 0, S_NONE},
        {128256, 1, 100, 0, 1.0, 0, S_NONE},     /* Llama-3 */
        {128256, 16, 4000, 1.3f, 0.9, 0, S_NONE},
        {128256, 5, 200, 0.5f, 0.9, 0, S_NONE},  /* a penalty below 1 favours repeated tokens */
        {50001, 1, 50, 0, 0.9, 0, S_NONE},       /* odd: scalar path */
        {50001, 7, 500, 0, 0.3, 0, S_NONE},
        {151936, 2, 100, 0, 0.9, 2, S_NONE},     /* misaligned logits: scalar path */
        {2000000, 2, 3000, 0, 0.9, 0, S_NONE},   /* slices in several passes */
        {1999999, 2, 100, 0, 0.9, 0, S_NONE},
        {7, 4, 3, 0, 0.7, 0, S_NONE},            /* most blocks of a cluster have nothing */
        {1, 2, 2, 0, 1.0, 0, S_NONE},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_argmax_case(f, &cases[i], e);
}

static void test_masked_argmax_model_vocabularies(void **state) { masked_argmax_model_vocabularies(*state, &F16); }
static void test_masked_argmax_model_vocabularies_bf16(void **state)
{
    masked_argmax_model_vocabularies(*state, &BF16);
}

static void masked_argmax_edges(fixture *f, const elt_t *e)
{
    static const argmax_case cases[] = {
        {151936, 3, 10, 0, 0.9, 0, S_ALL_MASKED},  /* the sentinel */
        {151936, 3, 10, 0, 0.9, 0, S_NAN_ROW},     /* NaN never wins */
        {50001, 3, 10, 0, 0.9, 0, S_NAN_ROW},
        {151936, 2, 20, 2.0f, 0.9, 0, S_TIES},     /* ties: the lowest index */
        {50001, 2, 20, 2.0f, 0.9, 0, S_TIES},
        {128256, 4, 20, 0, 0.6, 0, S_ZEROS},       /* -0 equals +0 */
        {151936, 4, 40, 0, 0.9, 0, S_BAD_OFFSETS}, /* clamped, never read out of bounds */
        {151936, 3, 20, 0, 0.6, 0, S_INF},         /* -inf is eligible; +inf beats it; first wins */
        {50001, 3, 20, 0.5f, 0.6, 0, S_INF},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_argmax_case(f, &cases[i], e);
}

static void test_masked_argmax_edges(void **state) { masked_argmax_edges(*state, &F16); }
static void test_masked_argmax_edges_bf16(void **state) { masked_argmax_edges(*state, &BF16); }

/* providers/masked_argmax.c: the largest cluster encode may use (16, the
 * portable 8, or 1: the one-block kernel of devices before sm_90). */
void kiln__masked_argmax_set_max_cluster(int cluster);

/* The portable cluster of 8 blocks (taken where 16 cannot be scheduled), and
 * one block a participant (devices before sm_90). */
static void masked_argmax_smaller_clusters(fixture *f, const elt_t *e, int cluster)
{
    static const argmax_case cases[] = {
        {151936, 64, 300, 0, 0.95, 0, S_NONE},
        {128256, 5, 200, 0.5f, 0.9, 0, S_NONE},
        {50001, 7, 500, 0, 0.3, 0, S_NONE},
        {2000000, 2, 3000, 0, 0.9, 0, S_NONE},
        {151936, 2, 20, 2.0f, 0.9, 0, S_TIES},
        {128256, 4, 20, 0, 0.6, 0, S_ZEROS},
        {7, 4, 3, 0, 0.7, 0, S_NONE},
    };
    kiln__masked_argmax_set_max_cluster(cluster);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_argmax_case(f, &cases[i], e);
    kiln__masked_argmax_set_max_cluster(16);
}

static void test_masked_argmax_portable_cluster(void **state) { masked_argmax_smaller_clusters(*state, &F16, 8); }
static void test_masked_argmax_portable_cluster_bf16(void **state) { masked_argmax_smaller_clusters(*state, &BF16, 8); }
static void test_masked_argmax_one_block(void **state) { masked_argmax_smaller_clusters(*state, &F16, 1); }
static void test_masked_argmax_one_block_bf16(void **state) { masked_argmax_smaller_clusters(*state, &BF16, 1); }

/* ---- replay and prewarm ---- */

/* Every operation as a command, replayed from a graph, with attribution. */
static void commands_replay(fixture *f, const elt_t *e)
{
    const int64_t T = 16, H = 896, V = 151936, P = 2;
    kiln_buffer *b = buffer(f->rt, 8 << 20);
    kiln_tensor x = {.buffer = b, .offset = 0, .dtype = e->dtype, .rank = 2, .dims = {T, H}}, r = x, o = x,
                w = {.buffer = b, .offset = 3 << 20, .dtype = e->dtype, .rank = 1, .dims = {H}};
    r.offset = 1 << 20;
    o.offset = 2 << 20;
    kiln_tensor tl = {.buffer = b, .offset = 4 << 20, .dtype = e->dtype, .rank = 2, .dims = {P, V}},
                tv = {.buffer = b, .offset = 5 << 20, .dtype = KILN_DTYPE_U8, .rank = 1, .dims = {V}},
                ti = {.buffer = b, .offset = (5 << 20) + (256 << 10), .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {64}},
                tf = {.buffer = b, .offset = (5 << 20) + (260 << 10), .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P + 1}},
                tp = {.buffer = b, .offset = (5 << 20) + (264 << 10), .dtype = KILN_DTYPE_F32, .rank = 1, .dims = {1}},
                tw = {.buffer = b, .offset = 6 << 20, .dtype = KILN_DTYPE_U8, .rank = 1, .dims = {P * 303872}},
                to = {.buffer = b, .offset = (5 << 20) + (268 << 10), .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P}};
    KILN_CHECK(kiln_buffer_fill(b, 0, 0, 8 << 20));
    uint16_t one = e->one;
    for (int64_t h = 0; h < H; h++)
        KILN_CHECK(kiln_buffer_upload(b, w.offset + (size_t)h * 2, &one, 2));
    /* Logits: token 77 (1.0, then 78 with 0.5) of participant 0 and 12345 of participant 1 stand
     * out; all valid; penalty 1. */
    uint8_t *ones = malloc((size_t)V);
    memset(ones, 1, (size_t)V);
    KILN_CHECK(kiln_buffer_upload(b, tv.offset, ones, (size_t)V));
    free(ones);
    KILN_CHECK(kiln_buffer_upload(b, tl.offset + 77 * 2, &one, 2));
    uint16_t half = e->half;
    KILN_CHECK(kiln_buffer_upload(b, tl.offset + 78 * 2, &half, 2));
    KILN_CHECK(kiln_buffer_upload(b, tl.offset + (size_t)(V + 12345) * 2, &one, 2));
    float pen = 1.0f;
    KILN_CHECK(kiln_buffer_upload(b, tp.offset, &pen, 4));
    kiln_masked_argmax_bindings mb = {0, &tl, &tv, &ti, &tf, &tp, &tw, &to};
    kiln_command *cmds[4];
    KILN_CHECK(kiln_op_residual_add_encode(f->jit, &x, &r, &r, &cmds[0]));
    KILN_CHECK(kiln_op_rms_norm_encode(f->jit, &r, &w, 1e-6f, &o, &cmds[1]));
    KILN_CHECK(kiln_op_rms_norm_residual_encode(f->jit, &x, &r, &w, 1e-6f, &o, &cmds[2]));
    KILN_CHECK(kiln_op_masked_argmax_encode(f->jit, &mb, &cmds[3]));
    static const char *const ids[4] = {"residual_add", "rms_norm", "rms_norm_residual", "masked_argmax"};
    for (int i = 0; i < 4; i++) {
        assert_true(kiln_command_replayable(cmds[i]));
        assert_string_equal(kiln_command_op_id(cmds[i]), ids[i]);
    }
    kiln_stream *s;
    KILN_CHECK(kiln_stream_create(f->rt, &s));
    for (int round = 0; round < 2; round++) {
        kiln_submit_options so = {.path = KILN_PATH_REPLAYED_ONLY, .timing = KILN_TIMING_SPANS, .phase = "decode"};
        kiln_fence *fence;
        KILN_CHECK(kiln_stream_prepare(s, cmds, 4, &so, NULL));
        KILN_CHECK(kiln_stream_submit(s, cmds, 4, &so, &fence));
        KILN_CHECK(kiln_fence_wait(fence));
        for (size_t i = 0; i < 4; i++) {
            kiln_attribution a;
            KILN_CHECK(kiln_fence_attribution(fence, i, &a));
            assert_string_equal(a.op_id, ids[i]);
            assert_int_equal(a.path, KILN_EXEC_REPLAYED);
            assert_int_equal(a.batching, KILN_BATCHING_PACKED);
            assert_int_equal(a.dispatches, 1);
            assert_int_equal(a.tokens, i == 3 ? (uint32_t)P : (uint32_t)T);
            assert_int_equal(a.participants, i == 3 ? (uint32_t)P : 1);
        }
        kiln_fence_release(fence);
        uint32_t got[2];
        kiln_region rg = {b, to.offset, to.offset + 8};
        KILN_CHECK(kiln_stream_readback(s, &rg, got));
        assert_int_equal(got[0], 77);
        assert_int_equal(got[1], 12345);
        /* Offsets and ids live on the device: a new step changes them without a new command. */
        uint32_t offs[3] = {0, 1, 1}, id = 77;
        pen = 4.0f;
        KILN_CHECK(kiln_stream_synchronize(s));
        KILN_CHECK(kiln_buffer_upload(b, tf.offset, offs, sizeof offs));
        KILN_CHECK(kiln_buffer_upload(b, ti.offset, &id, 4));
        KILN_CHECK(kiln_buffer_upload(b, tp.offset, &pen, 4));
        /* Alone, a segment of its own: adaptive (a replayed-only path may ask for resident graphs). */
        kiln_submit_options one = {.timing = KILN_TIMING_SPANS, .phase = "decode"};
        KILN_CHECK(kiln_stream_submit(s, &cmds[3], 1, &one, NULL));
        KILN_CHECK(kiln_stream_readback(s, &rg, got));
        assert_int_equal(got[0], 78); /* 77 repeated: 1 / 4 = 0.25 < 0.5 */
        assert_int_equal(got[1], 12345);
        KILN_CHECK(kiln_stream_synchronize(s));
        offs[1] = 0;
        offs[2] = 0;
        pen = 1.0f;
        KILN_CHECK(kiln_buffer_upload(b, tf.offset, offs, sizeof offs));
        KILN_CHECK(kiln_buffer_upload(b, tp.offset, &pen, 4));
    }
    KILN_CHECK(kiln_stream_synchronize(s));
    kiln_stream_destroy(s);
    for (int i = 0; i < 4; i++)
        kiln_command_release(cmds[i]);
    kiln_buffer_destroy(b);
}

static void test_commands_replay(void **state) { commands_replay(*state, &F16); }
static void test_commands_replay_bf16(void **state) { commands_replay(*state, &BF16); }

static void model_configs(kiln_model_config c[3])
{
    kiln_model_config_default(&c[0]);
    c[1] = c[0];
    c[1].vocab_size = 151936;
    c[1].hidden_size = 896;
    c[1].intermediate_size = 4864;
    c[2] = c[0];
    c[2].vocab_size = 50001;
    c[2].hidden_size = 1000;
}

static int ours(const kiln_spec *s)
{
    return !strcmp(s->template_id, "rms_norm") || !strcmp(s->template_id, "residual_add") ||
           !strcmp(s->template_id, "masked_argmax");
}

/* Prewarm (offline, as `kiln prewarm` does), then encode every operation at
 * each model's sizes on a new jit: nothing is compiled. The models' element
 * type is the tensors' (the specs list cfg.dtype's kernels). */
static void prewarmed_model_compiles_nothing(fixture *f, const elt_t *e)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    kiln_model_config cfg[3];
    model_configs(cfg);
    for (int m = 0; m < 3; m++)
        cfg[m].dtype = e->dtype;
    kiln_jit_options off = {.cache = f->cache, .arch = info.arch};
    kiln_jit *pre;
    KILN_CHECK(kiln_jit_create(&off, &pre));
    size_t n_ours = 0;
    for (int m = 0; m < 3; m++) {
        kiln_spec *specs;
        size_t n;
        KILN_CHECK(kiln_model_specializations(&cfg[m], &specs, &n));
        for (size_t i = 0; i < n; i++) {
            if (!ours(&specs[i]))
                continue;
            int compiled;
            KILN_CHECK(kiln_jit_prepare(pre, &specs[i], &compiled));
            n_ours++;
        }
        kiln_free(specs);
    }
    kiln_jit_destroy(pre);
    assert_int_equal(n_ours, 9);

    kiln_jit_options jo = {.cache = f->cache, .runtime = f->rt};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    kiln_buffer *b = buffer(f->rt, 16 << 20);
    for (int m = 0; m < 3; m++) {
        const int64_t H = cfg[m].hidden_size, V = cfg[m].vocab_size, T = 3, P = 2;
        size_t ws;
        KILN_CHECK(kiln_op_masked_argmax_workspace(V, P, &ws));
        kiln_tensor x = {.buffer = b, .offset = 0, .dtype = e->dtype, .rank = 2, .dims = {T, H}}, r = x, o = x,
                    w = {.buffer = b, .offset = 3 << 20, .dtype = e->dtype, .rank = 1, .dims = {H}};
        r.offset = 1 << 20;
        o.offset = 2 << 20;
        kiln_tensor tl = {.buffer = b, .offset = 4 << 20, .dtype = e->dtype, .rank = 2, .dims = {P, V}},
                    tv = {.buffer = b, .offset = 6 << 20, .dtype = KILN_DTYPE_U8, .rank = 1, .dims = {V}},
                    ti = {.buffer = b, .offset = 7 << 20, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {16}},
                    tf = {.buffer = b, .offset = (7 << 20) + 4096, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P + 1}},
                    tp = {.buffer = b, .offset = (7 << 20) + 8192, .dtype = KILN_DTYPE_F32, .rank = 1, .dims = {1}},
                    to = {.buffer = b, .offset = (7 << 20) + 12288, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P}},
                    tw = {.buffer = b, .offset = 8 << 20, .dtype = KILN_DTYPE_U8, .rank = 1, .dims = {(int64_t)ws}};
        kiln_masked_argmax_bindings mb = {0, &tl, &tv, &ti, &tf, &tp, &tw, &to};
        kiln_command *c;
        KILN_CHECK(kiln_op_rms_norm_encode(jit, &x, &w, 1e-5f, &o, &c));
        kiln_command_release(c);
        KILN_CHECK(kiln_op_rms_norm_residual_encode(jit, &x, &r, &w, 1e-5f, &o, &c));
        kiln_command_release(c);
        KILN_CHECK(kiln_op_residual_add_encode(jit, &x, &r, &o, &c));
        kiln_command_release(c);
        KILN_CHECK(kiln_op_masked_argmax_encode(jit, &mb, &c));
        kiln_command_release(c);
    }
    kiln_jit_counters k;
    kiln_jit_get_counters(jit, &k);
    assert_int_equal(k.compiles, 0);
    assert_int_equal(k.database_hits, 9);
    kiln_buffer_destroy(b);
    kiln_jit_destroy(jit);
}

static void test_prewarmed_model_compiles_nothing(void **state) { prewarmed_model_compiles_nothing(*state, &F16); }
static void test_prewarmed_model_compiles_nothing_bf16(void **state)
{
    prewarmed_model_compiles_nothing(*state, &BF16);
}

static void test_bad_bindings_are_refused_before_launch(void **state)
{
    fixture *f = *state;
    kiln_buffer *b = buffer(f->rt, 1 << 20);
    kiln_tensor x = {.buffer = b, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {4, 1024}}, o = x,
                w = {.buffer = b, .offset = 65536, .dtype = KILN_DTYPE_F16, .rank = 1, .dims = {1024}};
    o.offset = 131072;
    kiln_tensor w2 = w;
    w2.dims[0] = 1000;
    KILN_EXPECT(kiln_op_rms_norm(f->jit, &x, &w2, 1e-5f, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(f->rt),
                "binding weight has dims [1000]", "must be 1024");
    KILN_EXPECT(kiln_op_rms_norm(f->jit, &x, &w, -1.0f, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "eps", "-1");
    kiln_tensor o2 = o;
    o2.offset = 8;
    KILN_EXPECT(kiln_op_residual_add(f->jit, &x, &x, &o2), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "partly overlaps a", NULL);
    kiln_command *c = NULL;
    KILN_EXPECT(kiln_op_rms_norm_residual_encode(f->jit, &x, NULL, &w, 1e-5f, &o, &c), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "residual", NULL);
    assert_null(c);
    /* One element type per call: a bf16 x with an f16 weight (or out, or b) is refused, naming both. */
    kiln_tensor xb = x, ob = o;
    xb.dtype = ob.dtype = KILN_DTYPE_BF16;
    KILN_EXPECT(kiln_op_rms_norm(f->jit, &xb, &w, 1e-5f, &ob), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rms_norm: binding weight must be bf16", "got f16");
    KILN_EXPECT(kiln_op_rms_norm_residual_encode(f->jit, &xb, &ob, &w, 1e-5f, &o, &c), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "rms_norm_residual: binding weight must be bf16", "got f16");
    assert_null(c);
    KILN_EXPECT(kiln_op_residual_add(f->jit, &xb, &o, &ob), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual_add: binding b must be bf16", "got f16");
    KILN_EXPECT(kiln_op_residual_add(f->jit, &xb, &ob, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual_add: binding out must be bf16", "got f16");
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    kiln_buffer_destroy(b);
}

int main(void)
{
    kiln_test_require_gpu();
    kiln_test_filter();
#define T(fn) cmocka_unit_test_setup_teardown(fn, gpu_fixture_setup, gpu_fixture_teardown)
    const struct CMUnitTest tests[] = {
        T(test_rms_norm),
        T(test_rms_norm_bf16),
        T(test_rms_norm_residual),
        T(test_rms_norm_residual_bf16),
        T(test_residual_add),
        T(test_residual_add_bf16),
        T(test_fused_equals_add_then_norm),
        T(test_fused_equals_add_then_norm_bf16),
        T(test_masked_argmax_model_vocabularies),
        T(test_masked_argmax_model_vocabularies_bf16),
        T(test_masked_argmax_edges),
        T(test_masked_argmax_edges_bf16),
        T(test_masked_argmax_portable_cluster),
        T(test_masked_argmax_portable_cluster_bf16),
        T(test_masked_argmax_one_block),
        T(test_masked_argmax_one_block_bf16),
        T(test_commands_replay),
        T(test_commands_replay_bf16),
        T(test_prewarmed_model_compiles_nothing),
        T(test_prewarmed_model_compiles_nothing_bf16),
        T(test_bad_bindings_are_refused_before_launch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
