/* Gated delta recurrent attention on the GPU, both kernels (the sequential
 * scan and the chunked form), in f16 and in bf16 (q, k, v and out; every case
 * in both): fresh random data each run, outputs poisoned first, every output
 * element and every state element checked against a float64 host reference
 * of the recurrence (from the same f16 or bf16 inputs and f32 initial state).
 * Error of an element: |got - ref| / max(|ref|, rms, floor), where rms is the
 * root mean square of the reference's row (the DV outputs of one token and
 * head, or the DK columns of one state row): an element that cancels to near
 * zero carries the rounding error of terms of the row's size; floor is 2^-14
 * for the f16 outputs (below it f16 is subnormal, with a fixed step of 2^-24,
 * as in test_norm_argmax_gpu) and 0 for the bf16 outputs (f32's exponents)
 * and the f32 state. At most 2e-3 for both kernels, and for bf16 outputs 2e-3
 * plus bf16's rounding of them (2^-8, 8 significant bits): the arithmetic is
 * f32 either way, and the bf16 test's q and k rows also take scales outside
 * f16's range (2^-23 .. 2^23). Shapes of Qwen3-Next-80B-A3B (16 key heads, 32 value
 * heads, dims 128) and odd ones (64 x 96 with 3 key heads shared by 6 value
 * heads; 63 x 17 scalar; 200 x 40 with a partial vector per lane; 72 x 40, a
 * padded k-step); decode (one token per sequence) and prefill spans, packed
 * in any order with gaps (whose outputs stay untouched), empty spans (state
 * left alone), spans continued over several replayed submissions (chunked
 * prefill after a prefix), lengths that are not multiples of the chunk
 * (1, 63, 64, 65, 300, 1000, 4096), gates near 0 and near 1, decode and
 * prefill spans in one chunked launch, a span past the end (a device fault,
 * nothing of that sequence touched), and a prewarmed database that leaves
 * nothing to compile. Each case says which kernel it takes, and the test
 * checks the encode took it. */
#include <math.h>

#include "f16_host.h"
#include "gpu_fixture.h"
#include "providers/internal.h"

#define TOL 2e-3
#define TOL_BF16_OUT (TOL + 0x1p-8)
/* TOL holds the scan and the chunked kernels in two f16 terms an f32
 * operand ($KILN_GATED_DELTA_TERMS=2). In one (the default): out within
 * 1.2e-2 and the state within 4e-3 of a row's scale (two H100 runs printed
 * at most 6.9e-3 and 2.2e-3), an out row's scale floored at 2^-10: each
 * operand's rounding is relative to the operand (a state row, U), not to an
 * out row that cancels to 1e-4 of them (such rows were 1.3% off, 4e-6 in
 * absolute terms). */
#define TOL1 1.2e-2
#define TOL1_STATE 4e-3
#define TOL1_BF16_OUT (TOL1 + 0x1p-8)
#define POISON 0xffffu /* a NaN in f16 and in bf16 */

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

/* ---- the problem and its reference ---- */

typedef struct problem {
    int64_t dk, dv, kh, vh, seqs, tokens;
    kiln_dtype elt;        /* of q, k, v and out: f16 or bf16 */
    uint16_t *q, *k, *v;   /* [T, KH, DK], [T, KH, DK], [T, VH, DV] */
    float *g, *beta;       /* [T, VH] */
    float *state0;         /* [S, VH, DV, DK]: the initial state */
    uint32_t *spans;       /* [S, 2] */
    uint8_t *covered;      /* [T]: a token of some span */
} problem;

/* x rounded to the element type, and an element's value. */
static uint16_t enc(kiln_dtype elt, double x)
{
    return elt == KILN_DTYPE_BF16 ? kiln_test_bf16_from_f32((float)x) : f2h(x);
}

static double dec(kiln_dtype elt, uint16_t h)
{
    return elt == KILN_DTYPE_BF16 ? kiln_test_bf16_to_f32(h) : h2f(h);
}

static void problem_free(problem *p)
{
    free(p->q);
    free(p->k);
    free(p->v);
    free(p->g);
    free(p->beta);
    free(p->state0);
    free(p->spans);
    free(p->covered);
}

/* The gates g of a case: */
enum {
    GATES_MOSTLY_OPEN, /* -2 u^3: mostly near 0, some decay */
    GATES_NEAR_1,      /* exp(g) within 1e-4 of 1: errors last longest */
    GATES_NEAR_0,      /* g in [-60, -20]: every token all but forgets the past */
    GATES_MIXED,       /* each token one of the above, at random */
};

static double gate(kiln_rng *r, int gates)
{
    if (gates == GATES_MIXED)
        gates = (int)kiln_rng_below(r, 3);
    const double u = uniform(r, 0, 1);
    switch (gates) {
    case GATES_NEAR_1:
        return -1e-4 * u;
    case GATES_NEAR_0:
        return -20 - 40 * u;
    default:
        return -2.0 * u * u * u;
    }
}

/* Random inputs: q and k rows of random scale (the normalization matters;
 * in bf16 a quarter of the rows 2^20 larger or smaller still, outside f16's
 * range, which the chunked kernel's f16 products must absorb), g as the case
 * says, beta in (0.02, 0.98), the state either zeros or a
 * carried one in [-1, 1]. */
static void problem_fill(problem *p, kiln_rng *r, int zero_state, int gates)
{
    const size_t T = (size_t)p->tokens, nqk = T * (size_t)(p->kh * p->dk), nv = T * (size_t)(p->vh * p->dv),
                 ng = T * (size_t)p->vh, ns = (size_t)(p->seqs * p->vh * p->dv * p->dk);
    p->q = malloc(nqk * 2);
    p->k = malloc(nqk * 2);
    p->v = malloc(nv * 2);
    p->g = malloc(ng * 4);
    p->beta = malloc(ng * 4);
    p->state0 = malloc(ns * 4);
    assert_true(p->q && p->k && p->v && p->g && p->beta && p->state0);
    for (size_t row = 0; row < T * (size_t)p->kh; row++) {
        int eq = (int)kiln_rng_below(r, 7) - 3, ek = (int)kiln_rng_below(r, 7) - 3;
        if (p->elt == KILN_DTYPE_BF16) {
            const int wide[4] = {0, 0, 20, -20};
            eq += wide[kiln_rng_below(r, 4)];
            ek += wide[kiln_rng_below(r, 4)];
        }
        const double sq = ldexp(1, eq), sk = ldexp(1, ek);
        for (int64_t j = 0; j < p->dk; j++) {
            p->q[row * (size_t)p->dk + (size_t)j] = enc(p->elt, uniform(r, -sq, sq));
            p->k[row * (size_t)p->dk + (size_t)j] = enc(p->elt, uniform(r, -sk, sk));
        }
    }
    for (size_t i = 0; i < nv; i++)
        p->v[i] = enc(p->elt, uniform(r, -1, 1));
    for (size_t i = 0; i < ng; i++) {
        p->g[i] = (float)gate(r, gates);
        p->beta[i] = (float)uniform(r, 0.02, 0.98);
    }
    for (size_t i = 0; i < ns; i++)
        p->state0[i] = zero_state ? 0.0f : (float)uniform(r, -1, 1);
}

/* The recurrence in float64 over every sequence's span: out [T, VH, DV] (NAN
 * where no span covers) and the final state [S, VH, DV, DK]. */
static void reference(const problem *p, const uint32_t *const *call_spans, int calls, double *out, double *state)
{
    const int64_t DK = p->dk, DV = p->dv, VH = p->vh, KH = p->kh;
    const size_t ns = (size_t)(p->seqs * VH * DV * DK);
    for (size_t i = 0; i < ns; i++)
        state[i] = p->state0[i];
    for (size_t i = 0; i < (size_t)(p->tokens * VH * DV); i++)
        out[i] = NAN;
    double *kh_ = malloc((size_t)DK * 8), *qh = malloc((size_t)DK * 8);
    assert_true(kh_ && qh);
    for (int c = 0; c < calls; c++)
        for (int64_t s = 0; s < p->seqs; s++) {
            const uint32_t start = call_spans[c][2 * s], count = call_spans[c][2 * s + 1];
            for (int64_t h = 0; h < VH; h++) {
                double *S = state + (size_t)((s * VH + h) * DV * DK);
                const int64_t kv = h / (VH / KH);
                for (uint32_t i = 0; i < count; i++) {
                    const size_t t = (size_t)start + i;
                    const uint16_t *kr = p->k + (t * (size_t)KH + (size_t)kv) * (size_t)DK,
                                   *qr = p->q + (t * (size_t)KH + (size_t)kv) * (size_t)DK;
                    double nk = 0, nq = 0;
                    for (int64_t j = 0; j < DK; j++) {
                        kh_[j] = dec(p->elt, kr[j]);
                        qh[j] = dec(p->elt, qr[j]);
                        nk += kh_[j] * kh_[j];
                        nq += qh[j] * qh[j];
                    }
                    nk = 1 / sqrt(nk + 1e-6);
                    nq = 1 / sqrt(nq + 1e-6) / sqrt((double)DK);
                    for (int64_t j = 0; j < DK; j++) {
                        kh_[j] *= nk;
                        qh[j] *= nq;
                    }
                    const size_t gi = t * (size_t)VH + (size_t)h;
                    const double a = exp((double)p->g[gi]), b = p->beta[gi];
                    for (int64_t row = 0; row < DV; row++) {
                        double *Sr = S + row * DK, u = 0, o = 0;
                        for (int64_t j = 0; j < DK; j++) {
                            Sr[j] *= a;
                            u += Sr[j] * kh_[j];
                        }
                        const double d = b * (dec(p->elt, p->v[gi * (size_t)DV + (size_t)row]) - u);
                        for (int64_t j = 0; j < DK; j++) {
                            Sr[j] += d * kh_[j];
                            o += Sr[j] * qh[j];
                        }
                        out[gi * (size_t)DV + (size_t)row] = o;
                    }
                }
            }
        }
    free(kh_);
    free(qh);
}

/* Checks rows of n values against the reference; returns the number wrong
 * and raises *worst. */
static size_t check_rows(const char *what, const char *name, size_t rows, size_t n, const double *ref,
                         double (*got)(const void *, size_t), const void *data, double floor, double tol,
                         double *worst)
{
    size_t wrong = 0;
    for (size_t r = 0; r < rows; r++) {
        const double *rr = ref + r * n;
        if (isnan(rr[0]))
            continue; /* not covered: checked elsewhere */
        double ss = 0;
        for (size_t i = 0; i < n; i++)
            ss += rr[i] * rr[i];
        const double rms = fmax(sqrt(ss / (double)n), floor);
        for (size_t i = 0; i < n; i++) {
            const double x = got(data, r * n + i), e = fabs(x - rr[i]) / fmax(fmax(fabs(rr[i]), rms), 1e-30);
            const double err = isfinite(x) ? e : INFINITY;
            if (err > *worst)
                *worst = err;
            if (err > tol && wrong++ < 5)
                fprintf(stderr, "%s: %s row %zu [%zu] = %.9g, want %.9g (row scale %.3g)\n", name, what, r, i, x, rr[i],
                        rms);
        }
    }
    return wrong;
}

static double got_f16(const void *d, size_t i) { return h2f(((const uint16_t *)d)[i]); }
static double got_bf16(const void *d, size_t i) { return kiln_test_bf16_to_f32(((const uint16_t *)d)[i]); }
static double got_f32(const void *d, size_t i) { return ((const float *)d)[i]; }

/* ---- cases ---- */

typedef struct delta_case {
    const char *name;
    int64_t dk, dv, kh, vh, seqs;
    uint32_t count;          /* every sequence's count, when counts is NULL */
    const uint32_t *counts;
    uint32_t gap;            /* uncovered tokens before each span and at the end */
    int reversed;            /* spans laid out from the last sequence to the first */
    size_t state_skew;       /* bytes added to the state's offset: 8 takes the scalar path */
    int zero_state;
    int calls;               /* each span split over this many submissions of one command */
    int gates;               /* GATES_* */
    uint32_t max_span;       /* the bindings' max_span_tokens */
    int kernel;              /* SCAN or CHUNK: the kernel the encode must take */
} delta_case;

enum { SCAN = 1, CHUNK };

/* Clears every $KILN_GATED_DELTA_* knob a check set, right after its
 * encode and before its assertions: a failure must not leave them to later
 * checks. */
static void knobs_clear(void)
{
    static const char *const names[] = {"KILN_GATED_DELTA_PREP", "KILN_GATED_DELTA_ROWS", "KILN_GATED_DELTA_CHUNK",
                                        "KILN_GATED_DELTA_TERMS", "KILN_GATED_DELTA_STREAM"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        unsetenv(names[i]);
}

/* Whether the device runs the chunked kernel at all (kiln/op_recurrent.h). */
static int chunk_device(gpu_fixture *f)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    int sm = 0;
    if (sscanf(info.arch, "sm_%d", &sm) != 1)
        return 0;
    return sm == 80 || sm == 87 || (sm >= 90 && sm < 120);
}

static int streamed_paths; /* run_case's paths that the encode ran streamed */

static void run_case(gpu_fixture *f, const delta_case *c, kiln_dtype elt)
{
    problem p = {.dk = c->dk, .dv = c->dv, .kh = c->kh, .vh = c->vh, .seqs = c->seqs, .elt = elt};
    const int calls = c->calls ? c->calls : 1;
    uint32_t *counts = malloc((size_t)c->seqs * 4);
    p.spans = malloc((size_t)c->seqs * 8);
    assert_true(counts && p.spans);
    uint64_t T = c->gap;
    for (int64_t i = 0; i < c->seqs; i++) {
        const int64_t s = c->reversed ? c->seqs - 1 - i : i;
        counts[s] = c->counts ? c->counts[s] : c->count;
        p.spans[2 * s] = (uint32_t)T;
        p.spans[2 * s + 1] = counts[s];
        T += counts[s] + c->gap;
    }
    if (T == 0)
        T = 1;
    p.tokens = (int64_t)T;
    p.covered = calloc(T, 1);
    for (int64_t s = 0; s < c->seqs; s++)
        memset(p.covered + p.spans[2 * s], 1, counts[s]);
    problem_fill(&p, &f->rng, c->zero_state, c->gates);
    /* The spans of each submission: consecutive parts of each span. */
    uint32_t *call_spans[8];
    assert_true(calls <= 8);
    for (int k = 0; k < calls; k++) {
        call_spans[k] = malloc((size_t)c->seqs * 8);
        for (int64_t s = 0; s < c->seqs; s++) {
            const uint32_t n = counts[s], a = (uint32_t)((uint64_t)n * k / calls),
                           b = (uint32_t)((uint64_t)n * (k + 1) / calls);
            call_spans[k][2 * s] = p.spans[2 * s] + a;
            call_spans[k][2 * s + 1] = b - a;
        }
    }

    const size_t nqk = T * (size_t)(c->kh * c->dk), nv = T * (size_t)(c->vh * c->dv), ng = T * (size_t)c->vh,
                 ns = (size_t)(c->seqs * c->vh * c->dv * c->dk);
    kiln_buffer *bq = buffer(f->rt, nqk * 2), *bk = buffer(f->rt, nqk * 2), *bv = buffer(f->rt, nv * 2),
                *bg = buffer(f->rt, ng * 4), *bb = buffer(f->rt, ng * 4), *bs = buffer(f->rt, ns * 4 + c->state_skew),
                *bsp = buffer(f->rt, (size_t)c->seqs * 8), *bo = buffer(f->rt, nv * 2);
    KILN_CHECK(kiln_buffer_upload(bq, 0, p.q, nqk * 2));
    KILN_CHECK(kiln_buffer_upload(bk, 0, p.k, nqk * 2));
    KILN_CHECK(kiln_buffer_upload(bv, 0, p.v, nv * 2));
    KILN_CHECK(kiln_buffer_upload(bg, 0, p.g, ng * 4));
    KILN_CHECK(kiln_buffer_upload(bb, 0, p.beta, ng * 4));
    kiln_tensor tq = {.buffer = bq, .dtype = elt, .rank = 3, .dims = {p.tokens, c->kh, c->dk}}, tk = tq,
                tv = {.buffer = bv, .dtype = elt, .rank = 3, .dims = {p.tokens, c->vh, c->dv}},
                tg = {.buffer = bg, .dtype = KILN_DTYPE_F32, .rank = 2, .dims = {p.tokens, c->vh}}, tb = tg,
                ts = {.buffer = bs, .offset = c->state_skew, .dtype = KILN_DTYPE_F32, .rank = 4,
                      .dims = {c->seqs, c->vh, c->dv, c->dk}},
                tsp = {.buffer = bsp, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {c->seqs, 2}}, to = tv;
    tk.buffer = bk;
    tb.buffer = bb;
    to.buffer = bo;
    /* Every chunked case runs the single kernel, then the keyed form (a
     * workspace bound, $KILN_GATED_DELTA_PREP=1; poisoned too) by the keyed
     * kernel ($KILN_GATED_DELTA_ROWS=0), then, where the rows kernel serves
     * (vectors of 8: dk and dv multiples of 8, the state 8-byte aligned), by
     * it ($KILN_GATED_DELTA_ROWS=1) at 32 rows a block (two warps of the
     * state, in bf16 two more) and at 64 (four; $KILN_GATED_DELTA_CHUNK),
     * each from the same initial state and poisoned outputs, with two f16
     * terms an f32 operand
     * ($KILN_GATED_DELTA_TERMS=2); then the same forms again in one (=1, the
     * default). Each runs with $KILN_GATED_DELTA_STREAM unset (streamed
     * wherever it can), and a path the encode ran streamed (the
     * rows kernel beside the pre-pass) runs again unstreamed
     * ($KILN_GATED_DELTA_STREAM=0), to the same bits. */
    const int rows_kernel = c->dk % 8 == 0 && c->dv % 8 == 0 && c->state_skew % 8 == 0;
    const int forms = c->kernel == CHUNK ? 2 + 2 * rows_kernel : 1, paths = c->kernel == CHUNK ? 2 * forms : 1;
    size_t ws_bytes;
    KILN_CHECK(kiln_op_gated_delta_workspace(elt, p.tokens, c->seqs, c->vh, &ws_bytes));
    kiln_buffer *bw = paths > 1 ? buffer(f->rt, ws_bytes) : NULL;
    const kiln_region ws = {bw, 0, ws_bytes};
    uint16_t *got_os[8] = {NULL};
    float *got_ss[8] = {NULL};
    int rows = 0, streamed[8] = {0};
    for (int path = 0; path < paths; path++) {
        const int form = path % forms, terms = c->kernel == CHUNK ? 2 - path / forms : 0;
        /* Pass 1, where pass 0 ran streamed: the same path unstreamed. */
        for (int pass = 0; pass < 1 + streamed[path]; pass++) {
            KILN_CHECK(kiln_buffer_upload(bs, c->state_skew, p.state0, ns * 4));
            KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, nv * 2));
            if (bw)
                KILN_CHECK(kiln_buffer_fill(bw, 0, 0xff, ws_bytes));
            setenv("KILN_GATED_DELTA_PREP", form ? "1" : "0", 1);
            setenv("KILN_GATED_DELTA_ROWS", form >= 2 ? "1" : "0", 1);
            if (form >= 2)
                setenv("KILN_GATED_DELTA_CHUNK", form == 2 ? "32" : "64", 1);
            if (terms)
                setenv("KILN_GATED_DELTA_TERMS", terms == 1 ? "1" : "2", 1);
            if (pass)
                setenv("KILN_GATED_DELTA_STREAM", "0", 1);
            else
                unsetenv("KILN_GATED_DELTA_STREAM");
            kiln_gated_delta_bindings bind = {sizeof bind, &tq, &tk,        &tv,           &tg, &tb, &ts, &tsp,
                                              &to,         c->max_span, form ? &ws : NULL};
            kiln_command *cmd;
            const kiln_status est = kiln_op_gated_delta_encode(f->jit, &bind, &cmd);
            knobs_clear();
            KILN_CHECK(est);
            assert_true(kiln_command_replayable(cmd));
            rows = kiln__gated_delta_last_rows();
            if (!pass)
                streamed_paths += streamed[path] = kiln__gated_delta_last_streamed();
            else if (kiln__gated_delta_last_streamed())
                fail_msg("%s: the encode ran streamed under $KILN_GATED_DELTA_STREAM=0", c->name);
            const int want_chunk = c->kernel == CHUNK && chunk_device(f) && c->dk <= 128;
            if (want_chunk ? rows <= 0 : rows != 0)
                fail_msg("%s: the encode took %s, want %s", c->name, rows > 0 ? "the chunked kernel" : "the scan",
                         want_chunk ? "the chunked kernel" : "the scan");
            const int want_keyed = want_chunk ? (form < 2 ? form : 2) : 0;
            if (want_chunk && form >= 2 && rows != (form == 2 ? 32 : 64))
                fail_msg("%s: the rows kernel took %d rows a block, want %d", c->name, rows, form == 2 ? 32 : 64);
            if (kiln__gated_delta_last_keyed() != want_keyed)
                fail_msg("%s: the encode took form %d, want %d (0 single, 1 keyed, 2 rows)", c->name,
                         kiln__gated_delta_last_keyed(), want_keyed);
            if (kiln__gated_delta_last_terms() != (want_chunk ? terms : 0))
                fail_msg("%s: the encode took %d terms, want %d", c->name, kiln__gated_delta_last_terms(),
                         want_chunk ? terms : 0);
            for (int k = 0; k < calls; k++) {
                KILN_CHECK(kiln_buffer_upload(bsp, 0, call_spans[k], (size_t)c->seqs * 8));
                kiln_submit_options so = {.path = k ? KILN_PATH_REPLAYED_ONLY : KILN_PATH_EAGER_ONLY,
                                          .phase = k ? "decode" : "prefill"};
                kiln_fence *fence;
                KILN_CHECK(kiln_stream_prepare(f->s, &cmd, 1, &so, NULL));
                KILN_CHECK(kiln_stream_submit(f->s, &cmd, 1, &so, &fence));
                KILN_CHECK(kiln_fence_wait(fence));
                kiln_attribution a;
                KILN_CHECK(kiln_fence_attribution(fence, 0, &a));
                assert_string_equal(a.op_id, "gated_delta");
                assert_int_equal(a.path, k ? KILN_EXEC_REPLAYED : KILN_EXEC_EAGER);
                assert_int_equal(a.participants, (uint32_t)c->seqs);
                assert_int_equal(a.tokens, (uint32_t)T);
                kiln_fence_release(fence);
                KILN_CHECK(kiln_stream_synchronize(f->s));
            }
            kiln_command_release(cmd);
            uint16_t *o = malloc(nv * 2);
            float *st = malloc(ns * 4);
            assert_true(o && st);
            KILN_CHECK(kiln_buffer_readback(bo, 0, o, nv * 2));
            KILN_CHECK(kiln_buffer_readback(bs, c->state_skew, st, ns * 4));
            if (!pass) {
                got_os[path] = o;
                got_ss[path] = st;
                continue;
            }
            /* Unstreamed, the same records in the same order: the same bits. */
            for (size_t i = 0; i < nv; i++)
                if (o[i] != got_os[path][i])
                    fail_msg("%s (%s): out[%zu] = 0x%04x unstreamed, 0x%04x streamed", c->name, kiln_dtype_name(elt), i,
                             o[i], got_os[path][i]);
            if (memcmp(st, got_ss[path], ns * 4))
                fail_msg("%s (%s): the state unstreamed differs from the streamed one", c->name, kiln_dtype_name(elt));
            free(o);
            free(st);
        }
    }
    /* The keyed kernel's out and state are the single kernel's, bit for bit,
     * at either count of terms (the rows kernel's sums run in another order:
     * checked below). */
    for (int b = 0; paths > 1 && b < paths; b += forms) {
        for (size_t i = 0; i < nv; i++)
            if (got_os[b][i] != got_os[b + 1][i])
                fail_msg("%s (%s): keyed out[%zu] = 0x%04x, the single kernel's 0x%04x", c->name,
                         kiln_dtype_name(elt), i, got_os[b + 1][i], got_os[b][i]);
        if (memcmp(got_ss[b], got_ss[b + 1], ns * 4))
            for (size_t i = 0; i < ns; i++)
                if (memcmp(&got_ss[b][i], &got_ss[b + 1][i], 4))
                    fail_msg("%s (%s): keyed state[%zu] = %.9g, the single kernel's %.9g", c->name,
                             kiln_dtype_name(elt), i, got_ss[b + 1][i], got_ss[b][i]);
    }

    double *ref_o = malloc(nv * 8), *ref_s = malloc(ns * 8);
    assert_true(ref_o && ref_s);
    reference(&p, (const uint32_t *const *)call_spans, calls, ref_o, ref_s);
    for (int path = 0; path < paths; path++) {
        const int form = path % forms, terms = c->kernel == CHUNK ? 2 - path / forms : 0, one = terms == 1;
        const int bf16 = elt == KILN_DTYPE_BF16;
        const double tol = one ? TOL1_STATE : TOL,
                     tol_out = bf16 ? (one ? TOL1_BF16_OUT : TOL_BF16_OUT) : one ? TOL1 : TOL;
        const uint16_t *got_o = got_os[path];
        const float *got_s = got_ss[path];
        double worst_o = 0, worst_s = 0;
        /* A row's scale floored at 2^-14 in both types: f16's subnormals
         * start there, and a row that far below its inputs' scale (a gate
         * near 0 has decayed the state away) is a sum of terms near that
         * scale, each rounded to the element type in the chunked form's
         * products (bf16 rows of 2e-9 were 1.4% off); at 2^-10 with one term. */
        size_t wrong = check_rows("out", c->name, T * (size_t)c->vh, (size_t)c->dv, ref_o,
                                  bf16 ? got_bf16 : got_f16, got_o, ldexp(1, one ? -10 : -14),
                                  tol_out, &worst_o);
        wrong += check_rows("state", c->name, (size_t)(c->seqs * c->vh * c->dv), (size_t)c->dk, ref_s, got_f32,
                            got_s, 0, tol, &worst_s);
        /* Tokens of no span keep the poison; empty spans keep their state's bits. */
        size_t touched = 0;
        for (size_t t = 0; t < T; t++)
            if (!p.covered[t])
                for (size_t i = 0; i < (size_t)(c->vh * c->dv); i++)
                    touched += got_o[t * (size_t)(c->vh * c->dv) + i] != POISON;
        const size_t per_seq = (size_t)(c->vh * c->dv * c->dk);
        for (int64_t s = 0; s < c->seqs; s++)
            if (!counts[s] && memcmp(got_s + (size_t)s * per_seq, p.state0 + (size_t)s * per_seq, per_seq * 4))
                fail_msg("%s: sequence %lld has an empty span, but its state changed", c->name, (long long)s);
        fprintf(stderr,
                "%s (%s%s%s): dk %lld dv %lld heads %lld->%lld seqs %lld tokens %llu calls %d, %s %d: max err out "
                "%.3g state %.3g\n",
                c->name, kiln_dtype_name(elt),
                form >= 2 ? (streamed[path] ? ", rows streamed" : ", rows") : form ? ", keyed" : "",
                one ? ", one term" : "", (long long)c->dk, (long long)c->dv, (long long)c->kh, (long long)c->vh,
                (long long)c->seqs, (unsigned long long)T, calls, rows ? "chunked, rows" : "scan", rows, worst_o,
                worst_s);
        if (touched)
            fail_msg("%s (%s): %zu output elements of uncovered tokens were written", c->name, kiln_dtype_name(elt),
                     touched);
        if (wrong)
            fail_msg("%s (%s): %zu elements off by more than %g (out) or %g (state)", c->name, kiln_dtype_name(elt),
                     wrong, tol_out, tol);
        free(got_os[path]);
        free(got_ss[path]);
    }

    kiln_buffer_destroy(bq);
    kiln_buffer_destroy(bk);
    kiln_buffer_destroy(bv);
    kiln_buffer_destroy(bg);
    kiln_buffer_destroy(bb);
    kiln_buffer_destroy(bs);
    kiln_buffer_destroy(bsp);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bw);
    for (int k = 0; k < calls; k++)
        free(call_spans[k]);
    free(ref_o);
    free(ref_s);
    free(counts);
    problem_free(&p);
}

#define QWEN 128, 128, 16, 32
#define ODD 64, 96, 3, 6

static void decode_qwen3_next(gpu_fixture *f, kiln_dtype elt)
{
    static const delta_case cases[] = {
        {"decode q3n 1", QWEN, 1, 1, NULL, 0, 0, 0, 0, 0, 0, 0, SCAN},
        {"decode q3n 8 reversed, gaps", QWEN, 8, 1, NULL, 2, 1, 0, 0, 0, 0, 0, SCAN},
        {"decode q3n 64", QWEN, 64, 1, NULL, 0, 0, 0, 0, 0, 0, 0, SCAN},
        {"decode q3n fresh state", QWEN, 4, 1, NULL, 0, 0, 0, 1, 0, 0, 0, SCAN},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(f, &cases[i], elt);
}

static void prefill_qwen3_next(gpu_fixture *f, kiln_dtype elt)
{
    static const uint32_t mixed[] = {1, 300, 0, 77};
    static const uint32_t cont[] = {200, 5};
    static const delta_case cases[] = {
        {"prefill q3n 1x1024 fresh", QWEN, 1, 1024, NULL, 0, 0, 0, 1, 0, 0, 0, CHUNK},
        {"prefill q3n mixed spans", QWEN, 4, 0, mixed, 3, 1, 0, 0, 0, 0, 0, CHUNK},
        /* A prefill continued by two more submissions of one replayed command. */
        {"prefill q3n continued", QWEN, 2, 0, cont, 1, 0, 0, 0, 3, 0, 0, CHUNK},
        /* The scan's prefill, where the caller says spans are short. */
        {"prefill q3n scan", QWEN, 4, 0, mixed, 3, 1, 0, 0, 0, 0, 1, SCAN},
        {"prefill q3n scan, gates near 1", QWEN, 1, 300, NULL, 0, 0, 0, 0, 0, GATES_NEAR_1, 8, SCAN},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(f, &cases[i], elt);
}

/* The chunked form: long spans, packed lengths that are not multiples of the
 * chunk, gates at both ends, a prefill continued from a carried state,
 * decode spans beside a prefill in one launch. */
static void chunked_prefill_qwen3_next(gpu_fixture *f, kiln_dtype elt)
{
    static const uint32_t packed[] = {1, 63, 64, 65, 300, 1000};
    static const uint32_t pair[] = {700, 129};
    static const uint32_t prefix[] = {1000, 64, 1};
    static const uint32_t mixed[] = {1, 1, 200, 0, 1, 17};
    static const delta_case cases[] = {
        {"chunk q3n 1x4096", QWEN, 1, 4096, NULL, 0, 0, 0, 0, 0, GATES_MOSTLY_OPEN, 0, CHUNK},
        {"chunk q3n packed 1..1000", QWEN, 6, 0, packed, 3, 1, 0, 0, 0, GATES_MOSTLY_OPEN, 0, CHUNK},
        {"chunk q3n gates near 1", QWEN, 2, 0, pair, 1, 0, 0, 0, 0, GATES_NEAR_1, 0, CHUNK},
        {"chunk q3n gates near 0", QWEN, 2, 0, pair, 0, 1, 0, 0, 0, GATES_NEAR_0, 0, CHUNK},
        {"chunk q3n gates mixed", QWEN, 6, 0, packed, 0, 0, 0, 0, 0, GATES_MIXED, 0, CHUNK},
        /* Chunked prefill after a prefix: the state carried over 4 submissions. */
        {"chunk q3n after a prefix", QWEN, 3, 0, prefix, 2, 0, 0, 0, 4, GATES_MOSTLY_OPEN, 300, CHUNK},
        {"chunk q3n fresh, many heads' blocks", QWEN, 8, 130, NULL, 0, 1, 0, 1, 0, GATES_MOSTLY_OPEN, 0, CHUNK},
        {"chunk q3n decode beside prefill", QWEN, 6, 0, mixed, 1, 0, 0, 0, 0, GATES_MIXED, 200, CHUNK},
    };
    streamed_paths = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(f, &cases[i], elt);
    /* One sequence's rows kernel at 32 rows is 128 blocks: on sm_90 with
     * programmatic dependent launch and at least 128 SMs (an H100 or H200)
     * the encode streams it beside the pre-pass under
     * $KILN_GATED_DELTA_STREAM unset, so the streamed form ran. */
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    const char *pdl = getenv("KILN_PDL");
    if (!strcmp(info.arch, "sm_90") && info.multiprocessors >= 128 && !(pdl && !strcmp(pdl, "0")) &&
        !streamed_paths)
        fail_msg("no path ran streamed on %s with %d SMs", info.arch, info.multiprocessors);
}

/* Qwen3-Next's gated delta bindings (16 key heads, 32 value heads, dims 128)
 * of T <= 256 tokens and S <= 2 sequences, laid out in b (16 MiB), for
 * tests that only encode; the workspace is the caller's. */
typedef struct qwen_views {
    kiln_tensor q, k, v, g, beta, state, spans, out;
} qwen_views;

static void qwen_bindings(kiln_buffer *b, kiln_dtype elt, int64_t T, int64_t S, qwen_views *x,
                          kiln_gated_delta_bindings *bind)
{
    const size_t MB = 1 << 20;
    x->q = (kiln_tensor){.buffer = b, .dtype = elt, .rank = 3, .dims = {T, 16, 128}};
    x->k = x->q;
    x->k.offset = MB;
    x->v = (kiln_tensor){.buffer = b, .offset = 2 * MB, .dtype = elt, .rank = 3, .dims = {T, 32, 128}};
    x->g = (kiln_tensor){.buffer = b, .offset = 4 * MB, .dtype = KILN_DTYPE_F32, .rank = 2, .dims = {T, 32}};
    x->beta = x->g;
    x->beta.offset = 4 * MB + MB / 2;
    x->state = (kiln_tensor){.buffer = b, .offset = 8 * MB, .dtype = KILN_DTYPE_F32, .rank = 4,
                             .dims = {S, 32, 128, 128}};
    x->spans = (kiln_tensor){.buffer = b, .offset = 5 * MB, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {S, 2}};
    x->out = (kiln_tensor){.buffer = b, .offset = 6 * MB, .dtype = elt, .rank = 3, .dims = {T, 32, 128}};
    *bind = (kiln_gated_delta_bindings){sizeof *bind, &x->q,     &x->k,   &x->v, &x->g, &x->beta,
                                        &x->state,    &x->spans, &x->out, 0,     NULL};
}

/* The default stream policy ($KILN_GATED_DELTA_STREAM unset): one sequence's
 * rows kernel at 32 rows (128 blocks) runs streamed beside the pre-pass
 * where the device can (sm_90 with programmatic dependent launch and at
 * least 128 SMs), in either element type; never under
 * $KILN_GATED_DELTA_STREAM=0. The encode alone decides; nothing runs. */
static void default_stream_policy(gpu_fixture *f, kiln_dtype elt)
{
    if (!chunk_device(f))
        skip();
    const int64_t T = 256, S = 1;
    kiln_buffer *b = buffer(f->rt, 16 << 20);
    qwen_views x;
    kiln_gated_delta_bindings bind;
    qwen_bindings(b, elt, T, S, &x, &bind);
    size_t need;
    KILN_CHECK(kiln_op_gated_delta_workspace(elt, T, S, 32, &need));
    kiln_buffer *bw = buffer(f->rt, need);
    const kiln_region ws = {bw, 0, need};
    bind.max_span_tokens = (uint32_t)T;
    bind.workspace = &ws;
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    const int can = !strcmp(info.arch, "sm_90") && info.multiprocessors >= 128 && kiln__runtime_pdl(f->rt);
    for (int off = 0; off < 2; off++) {
        setenv("KILN_GATED_DELTA_PREP", "1", 1);
        setenv("KILN_GATED_DELTA_ROWS", "1", 1);
        setenv("KILN_GATED_DELTA_CHUNK", "32", 1);
        if (off)
            setenv("KILN_GATED_DELTA_STREAM", "0", 1);
        else
            unsetenv("KILN_GATED_DELTA_STREAM");
        kiln_command *cmd = NULL;
        const kiln_status st = kiln_op_gated_delta_encode(f->jit, &bind, &cmd);
        knobs_clear();
        KILN_CHECK(st);
        kiln_command_release(cmd);
        assert_int_equal(kiln__gated_delta_last_keyed(), 2);
        assert_int_equal(kiln__gated_delta_last_rows(), 32);
        fprintf(stderr, "stream policy (%s, %s, %d SMs, %s): %s\n", elt == KILN_DTYPE_BF16 ? "bf16" : "f16",
                info.arch, info.multiprocessors, off ? "=0" : "unset",
                kiln__gated_delta_last_streamed() ? "streamed" : "unstreamed");
        assert_int_equal(kiln__gated_delta_last_streamed(), can && !off);
    }
    kiln_buffer_destroy(bw);
    kiln_buffer_destroy(b);
}

/* The chunked form at small and odd shapes: a block partly past the value
 * dim, a key dim padded to a whole k-step, scalar loads (odd dims, a state 4
 * bytes off), gates at both ends. */
static void chunked_odd_shapes(gpu_fixture *f, kiln_dtype elt)
{
    static const uint32_t three[] = {65, 0, 200};
    static const uint32_t two[] = {130, 63};
    static const delta_case cases[] = {
        {"chunk odd", ODD, 3, 0, three, 1, 1, 0, 0, 0, GATES_MIXED, 0, CHUNK},
        {"chunk odd, state 4 bytes off (scalar)", ODD, 3, 0, three, 0, 0, 4, 0, 0, GATES_MOSTLY_OPEN, 0, CHUNK},
        {"chunk odd gates near 0", ODD, 2, 0, two, 2, 0, 0, 1, 0, GATES_NEAR_0, 0, CHUNK},
        {"chunk dk 63 dv 17 (scalar)", 63, 17, 1, 2, 2, 0, two, 1, 0, 0, 0, 2, GATES_NEAR_1, 0, CHUNK},
        {"chunk dk 72 dv 40 (padded k-step)", 72, 40, 2, 4, 2, 0, two, 0, 1, 0, 0, 0, GATES_MIXED, 0, CHUNK},
        {"chunk dk 16 dv 8", 16, 8, 1, 1, 2, 0, two, 0, 0, 0, 0, 0, GATES_MOSTLY_OPEN, 0, CHUNK},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(f, &cases[i], elt);
}

static void odd_shapes(gpu_fixture *f, kiln_dtype elt)
{
    static const uint32_t mixed[] = {0, 33, 1, 130};
    static const uint32_t some[] = {17, 0, 40};
    static const uint32_t two[] = {9, 50};
    static const delta_case cases[] = {
        {"decode odd", ODD, 5, 1, NULL, 1, 0, 0, 0, 0, 0, 0, SCAN},
        {"prefill odd mixed", ODD, 4, 0, mixed, 2, 1, 0, 0, 0, 0, 0, CHUNK},
        {"prefill odd scalar (state misaligned)", ODD, 3, 0, some, 0, 0, 8, 0, 0, 0, 0, CHUNK},
        {"odd decode steps (4 replays)", ODD, 3, 4, NULL, 0, 0, 0, 1, 4, 0, 0, SCAN},
        {"dk 63 dv 17 (scalar, partial)", 63, 17, 1, 2, 2, 0, two, 1, 0, 0, 0, 0, 0, 0, CHUNK},
        {"dk 200 dv 40 (partial vectors)", 200, 40, 2, 2, 2, 0, two, 0, 1, 0, 0, 0, 0, 0, SCAN},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(f, &cases[i], elt);
}

/* A span past the end: a device fault naming the sequence; that sequence's
 * state is untouched; the others are computed. max_span picks the kernel;
 * keyed, the chunked kernel's keyed form (1 by the keyed kernel, 2 by the
 * rows kernel), whose workspace a byte short is refused first. */
static void span_past_end(gpu_fixture *f, uint32_t max_span, int keyed, kiln_dtype elt)
{
    const int64_t DK = 64, DV = 96, KH = 3, VH = 6, S = 3, T = 10;
    const size_t nqk = (size_t)(T * KH * DK), nv = (size_t)(T * VH * DV), ng = (size_t)(T * VH),
                 ns = (size_t)(S * VH * DV * DK);
    /* 16 MiB: the bf16 workspace at 7 MiB runs past 8 MiB. */
    kiln_buffer *b = buffer(f->rt, 16 << 20);
    KILN_CHECK(kiln_buffer_fill(b, 0, 0, 16 << 20));
    const size_t MB = 1 << 20;
    kiln_tensor tq = {.buffer = b, .dtype = elt, .rank = 3, .dims = {T, KH, DK}}, tk = tq,
                tv = {.buffer = b, .offset = MB, .dtype = elt, .rank = 3, .dims = {T, VH, DV}},
                tg = {.buffer = b, .offset = 2 * MB, .dtype = KILN_DTYPE_F32, .rank = 2, .dims = {T, VH}}, tb = tg,
                ts = {.buffer = b, .offset = 3 * MB, .dtype = KILN_DTYPE_F32, .rank = 4, .dims = {S, VH, DV, DK}},
                tsp = {.buffer = b, .offset = 5 * MB, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {S, 2}},
                to = {.buffer = b, .offset = 6 * MB, .dtype = elt, .rank = 3, .dims = {T, VH, DV}};
    tk.offset = MB / 2;
    tb.offset = 2 * MB + MB / 2;
    float *st = malloc(ns * 4), *got = malloc(ns * 4);
    uint16_t *x = malloc(nv * 2);
    assert_true(st && got && x);
    for (size_t i = 0; i < ns; i++)
        st[i] = (float)uniform(&f->rng, -1, 1);
    for (size_t i = 0; i < nv; i++)
        x[i] = enc(elt, uniform(&f->rng, -1, 1));
    KILN_CHECK(kiln_buffer_upload(b, ts.offset, st, ns * 4));
    KILN_CHECK(kiln_buffer_upload(b, tq.offset, x, nqk * 2));
    KILN_CHECK(kiln_buffer_upload(b, tk.offset, x + 7, nqk * 2));
    KILN_CHECK(kiln_buffer_upload(b, tv.offset, x, nv * 2));
    float half[60];
    for (size_t i = 0; i < ng; i++)
        half[i] = 0.5f;
    KILN_CHECK(kiln_buffer_upload(b, tb.offset, half, ng * 4));
    const uint32_t spans[6] = {0, 4, 5, 6, 4, 1}; /* sequence 1 ends at 11 > 10 */
    KILN_CHECK(kiln_buffer_upload(b, tsp.offset, spans, sizeof spans));
    kiln_gated_delta_bindings bind = {sizeof bind, &tq, &tk, &tv, &tg, &tb, &ts, &tsp, &to, max_span, NULL};
    size_t need;
    KILN_CHECK(kiln_op_gated_delta_workspace(elt, T, S, VH, &need));
    kiln_region ws = {b, 7 * MB, 7 * MB + need - 1};
    if (keyed) {
        char msg[96];
        snprintf(msg, sizeof msg, "has %zu bytes; it must have at least %zu", need - 1, need);
        bind.workspace = &ws;
        KILN_EXPECT(kiln_op_gated_delta(f->jit, &bind), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                    "gated_delta: binding workspace", msg);
        ws.end += 1;
        setenv("KILN_GATED_DELTA_PREP", "1", 1);
        setenv("KILN_GATED_DELTA_ROWS", keyed == 2 ? "1" : "0", 1);
    }
    const kiln_status est = kiln_op_gated_delta(f->jit, &bind);
    knobs_clear();
    KILN_CHECK(est);
    assert_int_equal(kiln__gated_delta_last_rows() > 0, max_span > 1 && chunk_device(f));
    assert_int_equal(kiln__gated_delta_last_keyed(), chunk_device(f) ? keyed : 0);
    kiln_status s = kiln_runtime_synchronize(f->rt);
    KILN_EXPECT(s, KILN_ERR_DEVICE_CONTRACT, kiln_runtime_errmsg(f->rt), "sequence 1's span ends at token 11",
                "past the 10 tokens");
    KILN_CHECK(kiln_buffer_readback(b, ts.offset, got, ns * 4));
    const size_t per = (size_t)(VH * DV * DK);
    assert_memory_equal(got + per, st + per, per * 4);          /* sequence 1: untouched */
    assert_memory_not_equal(got, st, per * 4);                  /* sequences 0 and 2: updated */
    assert_memory_not_equal(got + 2 * per, st + 2 * per, per * 4);
    /* The stream goes on. */
    KILN_CHECK(kiln_op_gated_delta(f->jit, &bind));
    KILN_EXPECT(kiln_runtime_synchronize(f->rt), KILN_ERR_DEVICE_CONTRACT, kiln_runtime_errmsg(f->rt),
                "gated_delta: sequence 1", NULL);
    const uint32_t good[6] = {0, 4, 5, 5, 4, 1};
    KILN_CHECK(kiln_buffer_upload(b, tsp.offset, good, sizeof good));
    KILN_CHECK(kiln_op_gated_delta(f->jit, &bind));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    /* And a bad binding is refused before any launch. */
    kiln_tensor bad = ts;
    bad.dims[2] = 64;
    bind.state = &bad;
    KILN_EXPECT(kiln_op_gated_delta(f->jit, &bind), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding state has dims [3, 6, 64, 64]", "must be 96");
    free(st);
    free(got);
    free(x);
    kiln_buffer_destroy(b);
}

static void span_past_end_faults(gpu_fixture *f, kiln_dtype elt)
{
    span_past_end(f, 1, 0, elt);  /* the scan */
    span_past_end(f, 64, 0, elt); /* the chunked kernel */
    span_past_end(f, 64, 1, elt); /* keyed, the keyed kernel */
    span_past_end(f, 64, 2, elt); /* keyed, the rows kernel */
}

/* The rows kernel launched unlike its template (an internal error the host
 * must never make): a device fault naming what disagreed, nothing touched.
 * With no shared memory it names the bytes it needs; with those and too few
 * threads, the threads. */
typedef struct odd_launch {
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr q, v, g, state, spans, out;
    unsigned threads, smem;
} odd_launch;

static kiln_status enqueue_odd(void *user, const kiln_launch_context *ctx)
{
    odd_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx), ws = l->out, flags = 0;
    uint32_t tokens = 64, records = 2;
    void *args[] = {&l->q,     &l->q,     &l->v,   &l->g,  &l->g,  &l->state, &l->spans,
                    &l->out,   &tokens,   &fault,  &ws,    &records, &flags};
    return kiln__launch(ctx, l->rt, l->fn, 1, l->threads, l->smem, args);
}

static void launch_mismatch_faults(gpu_fixture *f, kiln_dtype elt)
{
    if (!chunk_device(f))
        skip();
    kiln_spec spec;
    KILN_CHECK(kiln_op_gated_delta_chunk_spec(elt, 32, 32, 1, 1, 32, 8, &spec));
    kiln_kernel *k;
    void *fn;
    KILN_CHECK(kiln_jit_acquire(f->jit, &spec, &k));
    KILN_CHECK(kiln_kernel_function(k, "kiln_gated_delta_rows", &fn));
    const size_t MB = 1 << 20;
    kiln_buffer *b = buffer(f->rt, 4 * MB);
    KILN_CHECK(kiln_buffer_fill(b, 0, 0x3c, 4 * MB)); /* inputs and outputs: a pattern */
    const uint32_t spans[2] = {0, 64};
    KILN_CHECK(kiln_buffer_upload(b, 3 * MB, spans, sizeof spans));
    const CUdeviceptr base = kiln__buffer_ptr(b);
    odd_launch l = {f->rt, (CUfunction)fn, base, base + MB / 2, base + MB, base + 2 * MB, base + 3 * MB,
                    base + 3 * MB + 4096, 32, 0};
    uint8_t *before = malloc(2 * MB), *after = malloc(2 * MB);
    assert_true(before && after);
    KILN_CHECK(kiln_buffer_readback(b, 2 * MB, before, 2 * MB));
    for (int pass = 0; pass < 2; pass++) {
        kiln_region r = {b, 2 * MB, 4 * MB};
        kiln_command_desc d = {.op_id = "test.odd_launch", .regions = &r, .n_regions = 1, .enqueue = enqueue_odd,
                               .user = &l, .dispatches = 1};
        kiln_command *cmd;
        KILN_CHECK(kiln_command_create(f->rt, &d, &cmd));
        KILN_CHECK(kiln_stream_submit(kiln_runtime_stream(f->rt), &cmd, 1, NULL, NULL));
        kiln_command_release(cmd);
        const kiln_status st = kiln_runtime_synchronize(f->rt);
        const char *msg = kiln_runtime_errmsg(f->rt);
        fprintf(stderr, "launch mismatch (%s): %s\n", elt == KILN_DTYPE_BF16 ? "bf16" : "f16", msg);
        if (!pass) {
            KILN_EXPECT(st, KILN_ERR_DEVICE_CONTRACT, msg, "block 0 had 0 bytes of shared memory, below the",
                        "(an internal error); it touched nothing");
            const char *at = strstr(msg, "below the ");
            unsigned bytes = 0;
            assert_int_equal(sscanf(at, "below the %u", &bytes), 1);
            assert_true(bytes > 1024);
            assert_int_equal(kiln__function_set_attribute(f->rt, l.fn,
                                                          CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                          (int)bytes),
                             CUDA_SUCCESS);
            l.smem = bytes;
        } else {
            /* 32 rows a block: two warps, in either element type. */
            KILN_EXPECT(st, KILN_ERR_DEVICE_CONTRACT, msg, "block 0 ran with 32 threads", "not the 64 its template");
        }
        KILN_CHECK(kiln_buffer_readback(b, 2 * MB, after, 2 * MB));
        assert_memory_equal(after, before, 2 * MB); /* the state, the spans and out untouched */
    }
    free(before);
    free(after);
    kiln_buffer_destroy(b);
}

/* Prewarm a Qwen3-Next config offline (in the element type), then encode on
 * a fresh jit: nothing compiles. */
static void prewarmed_model_compiles_nothing(gpu_fixture *f, kiln_dtype elt)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    kiln_model_config cfg;
    kiln_model_config_default(&cfg);
    cfg.linear_num_key_heads = 16;
    cfg.linear_num_value_heads = 32;
    cfg.linear_key_head_dim = 128;
    cfg.linear_value_head_dim = 128;
    cfg.dtype = elt;
    kiln_jit_options off = {.cache = f->cache, .arch = info.arch};
    kiln_jit *pre;
    KILN_CHECK(kiln_jit_create(&off, &pre));
    kiln_spec *specs;
    size_t n, ours = 0;
    KILN_CHECK(kiln_model_specializations(&cfg, &specs, &n));
    size_t chunked = 0;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(specs[i].template_id, "gated_delta") || !strcmp(specs[i].template_id, "gated_delta_chunk")) {
            int compiled;
            KILN_CHECK(kiln_jit_prepare(pre, &specs[i], &compiled));
            ours++;
            chunked += !strcmp(specs[i].template_id, "gated_delta_chunk");
        }
    kiln_free(specs);
    kiln_jit_destroy(pre);
    assert_int_equal(ours - chunked, 1);
    assert_int_equal(chunked, 2);
    kiln_jit_options jo = {.cache = f->cache, .runtime = f->rt};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    const int64_t T = 4, S = 2;
    kiln_buffer *b = buffer(f->rt, 16 << 20);
    qwen_views x;
    kiln_gated_delta_bindings bind;
    qwen_bindings(b, elt, T, S, &x, &bind);
    bind.size = 0; /* 0 reads as sizeof, as this test always took it */
    kiln_command *c;
    KILN_CHECK(kiln_op_gated_delta_encode(jit, &bind, &c));
    kiln_command_release(c);
    assert_int_equal(kiln__gated_delta_last_rows(), 0);
    /* A prefill of 2 x 64 tokens takes the chunked kernel, also prewarmed. */
    kiln_tensor *const longer[] = {&x.q, &x.k, &x.v, &x.g, &x.beta, &x.out};
    for (size_t i = 0; i < sizeof longer / sizeof longer[0]; i++)
        longer[i]->dims[0] = 128;
    KILN_CHECK(kiln_op_gated_delta_encode(jit, &bind, &c));
    kiln_command_release(c);
    const int want = chunk_device(f);
    assert_int_equal(kiln__gated_delta_last_rows() > 0, want);
    kiln_jit_counters k;
    kiln_jit_get_counters(jit, &k);
    assert_int_equal(k.compiles, 0);
    assert_int_equal(k.database_hits, 1 + want);
    kiln_buffer_destroy(b);
    kiln_jit_destroy(jit);
}

/* Each group of cases in f16, and in bf16 where the device has it (sm_80 on). */
static int bf16_device(gpu_fixture *f)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    int sm = 0;
    return sscanf(info.arch, "sm_%d", &sm) == 1 && sm >= 80;
}

#define BOTH(fn)                                                                                                  \
    static void test_##fn(void **state) { fn(*state, KILN_DTYPE_F16); }                                          \
    static void test_##fn##_bf16(void **state)                                                                    \
    {                                                                                                             \
        if (!bf16_device(*state))                                                                                 \
            skip();                                                                                               \
        fn(*state, KILN_DTYPE_BF16);                                                                              \
    }
BOTH(decode_qwen3_next)
BOTH(prefill_qwen3_next)
BOTH(chunked_prefill_qwen3_next)
BOTH(chunked_odd_shapes)
BOTH(odd_shapes)
BOTH(span_past_end_faults)
BOTH(launch_mismatch_faults)
BOTH(default_stream_policy)
BOTH(prewarmed_model_compiles_nothing)
#undef BOTH

int main(void)
{
    kiln_test_require_gpu();
    kiln_test_filter();
#define T(fn) cmocka_unit_test_setup_teardown(fn, gpu_fixture_setup, gpu_fixture_teardown)
    const struct CMUnitTest tests[] = {
        T(test_decode_qwen3_next),
        T(test_prefill_qwen3_next),
        T(test_chunked_prefill_qwen3_next),
        T(test_chunked_odd_shapes),
        T(test_odd_shapes),
        T(test_span_past_end_faults),
        T(test_launch_mismatch_faults),
        T(test_default_stream_policy),
        T(test_prewarmed_model_compiles_nothing),
        T(test_decode_qwen3_next_bf16),
        T(test_prefill_qwen3_next_bf16),
        T(test_chunked_prefill_qwen3_next_bf16),
        T(test_chunked_odd_shapes_bf16),
        T(test_odd_shapes_bf16),
        T(test_span_past_end_faults_bf16),
        T(test_launch_mismatch_faults_bf16),
        T(test_default_stream_policy_bf16),
        T(test_prewarmed_model_compiles_nothing_bf16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
