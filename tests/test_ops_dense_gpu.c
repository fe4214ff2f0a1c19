/* Dense linear, dense SwiGLU and last-token linear on the GPU: every output
 * element (poisoned first) against a float64 host reference on fresh random
 * data, at the sizes of Llama-3-8B, Qwen2.5-0.5B and odd ones, in f16 and
 * (every kernel and cuBLASLt path, tolerances of bf16's 8-bit mantissa) in
 * bf16; mixed f16/bf16 bindings refused naming both dtypes; replayed
 * commands with spans read from device memory; bad spans reported; bad
 * bindings refused naming the binding, the expected and the actual value; a
 * prewarmed model compiles nothing; one heuristic query per shape. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>

#include "providers/blas.h"
#include "providers/internal.h"
#include "f16_host.h"
#include "gpu_fixture.h"
#include "testutil.h"

#define MIB ((size_t)1 << 20)

typedef gpu_fixture fixture;

static float f16_table[65536], bf16_table[65536];

/* The values of an element type's bit patterns (f16 or bf16). */
static const float *table_of(kiln_dtype elt) { return elt == KILN_DTYPE_BF16 ? bf16_table : f16_table; }

/* Random values of the element type, uniform in (-scale, scale) before rounding. */
static void fill_elt(kiln_rng *r, kiln_dtype elt, uint16_t *p, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) {
        const float v = ((float)(kiln_rng_next(r) >> 40) / 8388608.0f - 1.0f) * scale;
        p[i] = elt == KILN_DTYPE_BF16 ? kiln_test_bf16_from_f32(v) : f2h(v);
    }
}

static void fill_f16(kiln_rng *r, uint16_t *p, size_t n, float scale) { fill_elt(r, KILN_DTYPE_F16, p, n, scale); }

/* The relative tolerance of one rounding to the element type, about twice
 * its unit roundoff (f16: 11 significant bits, u = 2^-11; bf16: 8 bits, u =
 * 2^-8, so 2^-7), and the absolute one (f16's subnormal spacing; bf16's is
 * below any value here). */
static double rel_tol(kiln_dtype elt) { return elt == KILN_DTYPE_BF16 ? 7.8125e-3 : 1e-3; }
static double abs_tol(kiln_dtype elt) { return elt == KILN_DTYPE_BF16 ? 1e-37 : 5.96e-8; }
static const char *elt_name(kiln_dtype elt) { return elt == KILN_DTYPE_BF16 ? "bf16" : "f16"; }

/* Whether the device takes bf16 (sm_80 and later); before, bf16 is refused
 * (test_bad_bindings_are_refused_before_launch checks how). */
static int bf16_available(void **state)
{
    fixture *f = *state;
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    int sm = 0;
    return sscanf(info.arch, "sm_%d", &sm) == 1 && sm >= 80;
}

static int setup(void **state)
{
    for (uint32_t i = 0; i < 65536; i++) {
        f16_table[i] = h2f((uint16_t)i);
        bf16_table[i] = kiln_test_bf16_to_f32((uint16_t)i);
    }
    return gpu_fixture_setup(state);
}


/* ---- the float64 reference: ref[t, o] = sum_k x[t, k] w[o, k] (+ bias[o]) ----
 * Products of two f16 (or two bf16) values are exact in float; sums are in
 * double. mag gets sum_k |x w|, the scale of the accumulation's own rounding. */
typedef struct ref_job {
    const float *table;  /* the element type's values */
    const float *x;      /* [rows, k] */
    const uint16_t *w;   /* [n, k] of the element type */
    const uint16_t *bias;/* [n] or NULL */
    double *ref, *mag;   /* [rows, n] */
    int64_t rows, k, n;
    _Atomic int64_t *next; /* the next block of 4 output columns */
} ref_job;

static void *ref_worker(void *arg)
{
    ref_job *j = arg;
    float *wf = malloc(sizeof(float) * 4 * (size_t)j->k);
    assert_non_null(wf);
    for (;;) {
        int64_t o0 = atomic_fetch_add(j->next, 4);
        if (o0 >= j->n)
            break;
        int64_t no = j->n - o0 < 4 ? j->n - o0 : 4;
        for (int64_t q = 0; q < 4; q++)
            for (int64_t i = 0; i < j->k; i++)
                wf[q * j->k + i] = q < no ? j->table[j->w[(size_t)(o0 + q) * j->k + i]] : 0.0f;
        for (int64_t t = 0; t < j->rows; t++) {
            const float *x = j->x + (size_t)t * j->k;
            double a0 = 0, a1 = 0, a2 = 0, a3 = 0, m0 = 0, m1 = 0, m2 = 0, m3 = 0;
            for (int64_t i = 0; i < j->k; i++) {
                const float p0 = x[i] * wf[i], p1 = x[i] * wf[j->k + i], p2 = x[i] * wf[2 * j->k + i],
                            p3 = x[i] * wf[3 * j->k + i];
                a0 += p0, a1 += p1, a2 += p2, a3 += p3;
                m0 += fabsf(p0), m1 += fabsf(p1), m2 += fabsf(p2), m3 += fabsf(p3);
            }
            const double a[4] = {a0, a1, a2, a3}, m[4] = {m0, m1, m2, m3};
            for (int64_t q = 0; q < no; q++) {
                double b = j->bias ? j->table[j->bias[o0 + q]] : 0.0;
                j->ref[(size_t)t * j->n + o0 + q] = a[q] + b;
                j->mag[(size_t)t * j->n + o0 + q] = m[q] + fabs(b);
            }
        }
    }
    free(wf);
    return NULL;
}

static void reference(kiln_dtype elt, const uint16_t *x16, int64_t rows, int64_t k, const uint16_t *w, int64_t n,
                      const uint16_t *bias, double *ref, double *mag)
{
    const float *table = table_of(elt);
    float *x = malloc(sizeof(float) * (size_t)rows * (size_t)k);
    assert_non_null(x);
    for (size_t i = 0; i < (size_t)rows * (size_t)k; i++)
        x[i] = table[x16[i]];
    _Atomic int64_t next = 0;
    long nt = sysconf(_SC_NPROCESSORS_ONLN);
    nt = nt < 1 ? 1 : nt > 64 ? 64 : nt;
    pthread_t th[64];
    ref_job job = {table, x, w, bias, ref, mag, rows, k, n, &next};
    for (long i = 0; i < nt; i++)
        assert_int_equal(pthread_create(&th[i], NULL, ref_worker, &job), 0);
    for (long i = 0; i < nt; i++)
        pthread_join(th[i], NULL);
    free(x);
}

/* Every element: |got - ref| <= rel |ref| + 1e-5 sum|x w| + abs (the output's
 * rounding to the element type: rel_tol(), 1e-3 for f16, 2^-7 for bf16; the
 * f32 accumulation's; f16 subnormal spacing). got holds elt values. Prints
 * the worst relative error over elements not dwarfed by the others. */
static void compare(const char *what, kiln_dtype elt, const uint16_t *got, const double *ref, const double *mag,
                    size_t n)
{
    const float *table = table_of(elt);
    const double rel = rel_tol(elt), abs_part = abs_tol(elt);
    double ss = 0, worst = 0, worst_frac = 0;
    for (size_t i = 0; i < n; i++)
        ss += ref[i] * ref[i];
    const double rms = sqrt(ss / (double)n);
    size_t wrong = 0;
    for (size_t i = 0; i < n; i++) {
        const double g = table[got[i]], e = fabs(g - ref[i]);
        const double tol = rel * fabs(ref[i]) + 1e-5 * mag[i] + abs_part;
        if (!(e <= tol) && wrong++ < 5)
            fprintf(stderr, "%s: element %zu = %.8g (0x%04x), want %.8g (tolerance %.3g)\n", what, i, g, got[i],
                    ref[i], tol);
        if (e / tol > worst_frac)
            worst_frac = e / tol;
        if (fabs(ref[i]) >= 0.1 * rms && e / fabs(ref[i]) > worst)
            worst = e / fabs(ref[i]);
    }
    fprintf(stderr, "%s: %zu elements, worst relative error %.3g (|ref| >= rms/10), worst %.2f of tolerance\n",
            what, n, worst, worst_frac);
    if (wrong)
        fail_msg("%s: %zu of %zu elements wrong", what, wrong, n);
}

/* ---- device helpers ---- */

static kiln_buffer *upload(kiln_runtime *rt, const void *p, size_t bytes, size_t pad)
{
    kiln_buffer *b;
    KILN_CHECK(kiln_buffer_create(rt, bytes + pad, 256, &b));
    if (p)
        KILN_CHECK(kiln_buffer_upload(b, pad, p, bytes));
    return b;
}

static kiln_tensor t2(kiln_buffer *b, size_t off, kiln_dtype dt, int64_t d0, int64_t d1)
{
    kiln_tensor t = {.buffer = b, .offset = off, .dtype = dt, .rank = 2, .dims = {d0, d1}};
    return t;
}

static kiln_tensor t1e(kiln_buffer *b, size_t off, kiln_dtype dt, int64_t d0)
{
    kiln_tensor t = {.buffer = b, .offset = off, .dtype = dt, .rank = 1, .dims = {d0}};
    return t;
}

static kiln_tensor t1(kiln_buffer *b, size_t off, int64_t d0) { return t1e(b, off, KILN_DTYPE_F16, d0); }

static kiln_region whole(kiln_buffer *b)
{
    kiln_region r = {b, 0, kiln_buffer_size(b)};
    return r;
}

/* ---- dense linear ---- */

typedef struct lin_case {
    int64_t tokens, in, out;
    int bias;
    size_t x_off, out_off; /* bytes; nonzero for misaligned views */
} lin_case;

static void run_linear(fixture *f, const lin_case *c, kiln_dtype elt)
{
    const size_t xn = (size_t)c->tokens * c->in, wn = (size_t)c->out * c->in, on = (size_t)c->tokens * c->out;
    uint16_t *x = malloc(xn * 2), *w = malloc(wn * 2), *b = malloc((size_t)c->out * 2), *got = malloc(on * 2);
    double *ref = malloc(on * 8), *mag = malloc(on * 8);
    assert_true(x && w && b && got && ref && mag);
    fill_elt(&f->rng, elt, x, xn, 1.0f);
    fill_elt(&f->rng, elt, w, wn, 2.0f / sqrtf((float)c->in));
    fill_elt(&f->rng, elt, b, (size_t)c->out, 1.0f);
    kiln_buffer *bx = upload(f->rt, x, xn * 2, c->x_off), *bw = upload(f->rt, w, wn * 2, 0),
                *bb = upload(f->rt, b, (size_t)c->out * 2, 0), *bo = upload(f->rt, NULL, on * 2, c->out_off);
    size_t ws_bytes;
    KILN_CHECK(kiln_op_dense_linear_workspace(c->tokens, c->in, c->out, &ws_bytes));
    kiln_buffer *bws = upload(f->rt, NULL, ws_bytes, 0);
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, kiln_buffer_size(bo)));
    kiln_tensor tx = t2(bx, c->x_off, elt, c->tokens, c->in), tw = t2(bw, 0, elt, c->out, c->in),
                tb = t1e(bb, 0, elt, c->out), to = t2(bo, c->out_off, elt, c->tokens, c->out);
    kiln_region ws = whole(bws);
    KILN_CHECK(kiln_op_dense_linear(f->jit, &tx, &tw, c->bias ? &tb : NULL, &to, &ws));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(kiln_buffer_readback(bo, c->out_off, got, on * 2));
    reference(elt, x, c->tokens, c->in, w, c->out, c->bias ? b : NULL, ref, mag);
    char what[128];
    snprintf(what, sizeof what, "%s linear %lldx%lld -> %lld%s", elt_name(elt), (long long)c->tokens,
             (long long)c->in, (long long)c->out, c->bias ? " +bias" : "");
    compare(what, elt, got, ref, mag, on);
    kiln_buffer_destroy(bx);
    kiln_buffer_destroy(bw);
    kiln_buffer_destroy(bb);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bws);
    free(x), free(w), free(b), free(got), free(ref), free(mag);
}

static void test_linear(void **state)
{
    static const lin_case cases[] = {
        {1, 4096, 4096, 1, 0, 0},      /* Llama-3-8B o_proj, decode */
        {7, 4096, 14336, 0, 0, 0},     /* Llama-3-8B up_proj */
        {300, 4096, 1024, 1, 0, 0},    /* Llama-3-8B k_proj */
        {4096, 4096, 1024, 0, 0, 0},   /* 4096 tokens */
        {4096, 896, 896, 1, 0, 0},     /* Qwen2.5-0.5B q_proj, with its bias */
        {33, 896, 151936, 0, 0, 0},    /* Qwen2.5-0.5B vocabulary */
        {1, 4096, 128256, 0, 0, 0},    /* Llama-3-8B vocabulary */
        {2048, 1000, 1000, 1, 0, 0},   /* odd: hidden 1000 */
        {5, 1000, 50001, 1, 0, 0},     /* odd: vocab 50001, rows of odd length */
        {3, 64, 40, 1, 2, 2},          /* misaligned views: 2-byte aligned x and out */
        {1, 1, 1, 0, 0, 0},            /* the smallest */
        /* The skinny kernel (1 to 8 tokens, in a multiple of 32), and past it: */
        {8, 4096, 6144, 1, 0, 0},      /* fused q/k/v of Llama-3-8B, batch 8, a bias */
        {32, 4096, 4096, 0, 0, 0},     /* 32 tokens: cuBLASLt */
        {5, 896, 4864, 1, 0, 0},       /* Qwen2.5-0.5B gate */
        {2, 14336, 4096, 0, 0, 0},     /* Llama-3-8B down_proj */
        {3, 96, 40, 1, 0, 0},          /* one warp per block; rows past out in the last block */
        {7, 64, 1000, 1, 0, 0},        /* two warps */
        {1, 4864, 24, 0, 0, 0},        /* fewer rows than one block */
    };
    /* KILN_LINEAR_MAX_TOKENS=N: only the cases of at most N tokens (the
     * skinny kernel's, small enough for compute-sanitizer). */
    const char *cap = getenv("KILN_LINEAR_MAX_TOKENS");
    const long max_tokens = cap && atol(cap) > 0 ? atol(cap) : 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!max_tokens || cases[i].tokens <= max_tokens)
            run_linear(*state, &cases[i], KILN_DTYPE_F16);
    /* bf16: the skinny kernel (narrow, wide on 132 SMs, one warp), cuBLASLt
     * with the bf16 bias epilogue, a timed product, misaligned views. */
    static const lin_case bf16_cases[] = {
        {1, 4096, 4096, 1, 0, 0},   {8, 4096, 6144, 1, 0, 0},  {3, 96, 40, 1, 0, 0},      {2, 14336, 4096, 0, 0, 0},
        {300, 4096, 1024, 1, 0, 0}, {33, 896, 151936, 0, 0, 0}, {2048, 1000, 1000, 1, 0, 0}, {5, 1000, 50001, 1, 0, 0},
        {3, 64, 40, 1, 2, 2},       {1, 1, 1, 0, 0, 0},
    };
    for (size_t i = 0; bf16_available(state) && i < sizeof bf16_cases / sizeof bf16_cases[0]; i++)
        if (!max_tokens || bf16_cases[i].tokens <= max_tokens)
            run_linear(*state, &bf16_cases[i], KILN_DTYPE_BF16);
}

/* providers/blas_cache.c's test hooks. */
void kiln__blas_force_candidate(int index);
void kiln__blas_forced_config(char *buf, size_t cap);
uint64_t kiln__blas_tuned_shapes(void);

/* A few tokens (<= 8) take kiln's skinny kernel (a kernel is acquired), more
 * and KILN_SKINNY=0 take cuBLASLt (none is). test_linear checks both paths'
 * results. */
static uint64_t acquired(kiln_jit *jit)
{
    kiln_jit_counters k;
    kiln_jit_get_counters(jit, &k);
    return k.compiles + k.database_hits + k.memory_hits;
}

static void test_few_tokens_take_the_skinny_kernel(void **state)
{
    fixture *f = *state;
    kiln_buffer *bx, *bw, *bo, *bws;
    size_t ws_bytes;
    KILN_CHECK(kiln_op_dense_linear_workspace(64, 4096, 1024, &ws_bytes));
    KILN_CHECK(kiln_buffer_create(f->rt, 64 * 4096 * 2, 0, &bx));
    KILN_CHECK(kiln_buffer_create(f->rt, 1024 * 4096 * 2, 0, &bw));
    KILN_CHECK(kiln_buffer_create(f->rt, 64 * 1024 * 2, 0, &bo));
    KILN_CHECK(kiln_buffer_create(f->rt, ws_bytes, 0, &bws));
    kiln_region ws = whole(bws);
    kiln_tensor w = t2(bw, 0, KILN_DTYPE_F16, 1024, 4096);
    static const struct {
        int64_t tokens;
        const char *env;
        int kernels;
    } cases[] = {{1, NULL, 1}, {8, NULL, 1}, {9, NULL, 0}, {64, NULL, 0}, {8, "0", 0}, {8, "1", 1}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].env)
            setenv("KILN_SKINNY", cases[i].env, 1);
        kiln_tensor x = t2(bx, 0, KILN_DTYPE_F16, cases[i].tokens, 4096),
                    o = t2(bo, 0, KILN_DTYPE_F16, cases[i].tokens, 1024);
        const uint64_t before = acquired(f->jit);
        kiln_command *cmd;
        KILN_CHECK(kiln_op_dense_linear_encode(f->jit, &x, &w, NULL, &o, &ws, &cmd));
        kiln_command_release(cmd);
        unsetenv("KILN_SKINNY");
        if (acquired(f->jit) - before != (uint64_t)cases[i].kernels)
            fail_msg("%lld tokens (KILN_SKINNY %s): %llu kernels acquired, expected %d", (long long)cases[i].tokens,
                     cases[i].env ? cases[i].env : "unset", (unsigned long long)(acquired(f->jit) - before),
                     cases[i].kernels);
    }
    kiln_buffer_destroy(bx);
    kiln_buffer_destroy(bw);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bws);
}

/* Large products time the heuristic's candidates on first sight and keep the
 * fastest: each candidate the timing may pick, forced one by one, gives the
 * right product (shapes of Llama-3-8B prefill and decode, a bias, odd sizes;
 * KILN_SKINNY=0, so that the 1-token product goes through cuBLASLt too).
 * 333 x 1000 -> 2731 with a bias is where the heuristic offered split-K
 * kernels that add the bias in f16 (blas_cache.c now asks it for none with a
 * bias): each candidate's configuration is printed beside its errors. */
static void test_linear_every_candidate(void **state)
{
    setenv("KILN_SKINNY", "0", 1); /* unset again by teardown_candidates */
    static const lin_case cases[] = {
        {512, 4096, 4096, 0, 0, 0},
        {1, 4096, 14336, 1, 0, 0},
        {333, 1000, 2731, 1, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int n = 0;
        for (int c = 0; c < 8; c++) {
            kiln__blas_force_candidate(c);
            lin_case lc = cases[i];
            /* Is there a candidate c? Ask with a tiny encode first. */
            fixture *f = *state;
            kiln_buffer *b;
            size_t ws_bytes;
            KILN_CHECK(kiln_op_dense_linear_workspace(lc.tokens, lc.in, lc.out, &ws_bytes));
            KILN_CHECK(kiln_buffer_create(f->rt, ws_bytes + ((size_t)lc.tokens * lc.in + (size_t)lc.out * lc.in +
                                                             (size_t)lc.out + (size_t)lc.tokens * lc.out) * 2 + 4096,
                                          256, &b));
            kiln_tensor tx = t2(b, 0, KILN_DTYPE_F16, lc.tokens, lc.in);
            size_t at = ((size_t)lc.tokens * lc.in * 2 + 255) & ~(size_t)255;
            kiln_tensor tw = t2(b, at, KILN_DTYPE_F16, lc.out, lc.in);
            at = (at + (size_t)lc.out * lc.in * 2 + 255) & ~(size_t)255;
            kiln_tensor tb = t1(b, at, lc.out);
            at = (at + (size_t)lc.out * 2 + 255) & ~(size_t)255;
            kiln_tensor to = t2(b, at, KILN_DTYPE_F16, lc.tokens, lc.out);
            at = (at + (size_t)lc.tokens * lc.out * 2 + 255) & ~(size_t)255;
            kiln_region ws = {b, at, at + ws_bytes};
            kiln_command *cmd = NULL;
            kiln_status st = kiln_op_dense_linear_encode(f->jit, &tx, &tw, lc.bias ? &tb : NULL, &to, &ws, &cmd);
            kiln_command_release(cmd);
            kiln_buffer_destroy(b);
            if (st == KILN_ERR_CUDA_BLAS && strstr(kiln_errmsg(), "candidate"))
                break;
            KILN_CHECK(st);
            char config[256];
            kiln__blas_forced_config(config, sizeof config);
            fprintf(stderr, "linear %lldx%lld -> %lld%s: %s\n", (long long)lc.tokens, (long long)lc.in,
                    (long long)lc.out, lc.bias ? " +bias" : "", config);
            run_linear(f, &lc, KILN_DTYPE_F16);
            n++;
        }
        kiln__blas_force_candidate(-1);
        fprintf(stderr, "linear %lldx%lld -> %lld: %d candidates checked\n", (long long)cases[i].tokens,
                (long long)cases[i].in, (long long)cases[i].out, n);
        assert_true(n >= 1);
    }
    /* A product past the timing threshold is timed once, then served from the cache. */
    uint64_t t0 = kiln__blas_tuned_shapes();
    lin_case big = {2048, 4096, 2304, 0, 0, 0};
    run_linear(*state, &big, KILN_DTYPE_F16);
    uint64_t t1 = kiln__blas_tuned_shapes();
    run_linear(*state, &big, KILN_DTYPE_F16);
    fprintf(stderr, "linear 2048x4096 -> 2304: %llu shape timed\n", (unsigned long long)(t1 - t0));
    assert_true(t1 <= t0 + 1); /* none when the heuristic offers one candidate, or KILN_BLAS_TUNE=0 */
    assert_int_equal(kiln__blas_tuned_shapes(), t1);
}

/* ---- dense SwiGLU ---- */

typedef struct swiglu_case {
    int64_t tokens, hidden, inter;
} swiglu_case;

/* Whether the providers' TMA kernels (providers/tma.c) may run here: sm_90
 * and later, unless $KILN_TMA is 0. */
static int tma_available(fixture *f)
{
    const char *env = getenv("KILN_TMA");
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    int sm = 0;
    return !(env && !strcmp(env, "0")) && sscanf(info.arch, "sm_%d", &sm) == 1 && sm >= 90 &&
           info.multiprocessors >= 1;
}

/* Whether providers/swiglu.c takes its TMA kernel (9 to 32 tokens, sm_90,
 * hidden a multiple of 64, intermediate of 8, at most 31 x 8 outputs a
 * block over the SMs): one kernel, g and u never stored. */
static int swiglu_takes_tma(fixture *f, const swiglu_case *c)
{
    if (!tma_available(f))
        return 0;
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    return c->tokens >= 9 && c->tokens <= 32 && c->hidden % 64 == 0 && c->inter % 8 == 0 &&
           (c->inter / 8 + info.multiprocessors - 1) / info.multiprocessors <= 31;
}

static void run_swiglu(fixture *f, const swiglu_case *c, kiln_dtype elt)
{
    const float *table = table_of(elt);
    const int64_t n2 = 2 * c->inter;
    const size_t xn = (size_t)c->tokens * c->hidden, wn = (size_t)n2 * c->hidden, pn = (size_t)c->tokens * n2,
                 on = (size_t)c->tokens * c->inter;
    uint16_t *x = malloc(xn * 2), *w = malloc(wn * 2), *prod = malloc(pn * 2), *got = malloc(on * 2);
    double *ref = malloc(pn * 8), *mag = malloc(pn * 8), *oref = calloc(on, 8), *omag = calloc(on, 8);
    assert_true(x && w && prod && got && ref && mag && oref && omag);
    fill_elt(&f->rng, elt, x, xn, 1.0f);
    /* Gate and up pre-activations of a few units: silu's both tails get exercised. */
    fill_elt(&f->rng, elt, w, wn, 6.0f / sqrtf((float)c->hidden));
    kiln_buffer *bx = upload(f->rt, x, xn * 2, 0), *bw = upload(f->rt, w, wn * 2, 0),
                *bo = upload(f->rt, NULL, on * 2, 0);
    size_t ws_bytes;
    KILN_CHECK(kiln_op_dense_swiglu_workspace(c->tokens, c->hidden, c->inter, &ws_bytes));
    kiln_buffer *bws = upload(f->rt, NULL, ws_bytes, 0);
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, on * 2));
    KILN_CHECK(kiln_buffer_fill(bws, 0, 0xff, ws_bytes));
    kiln_tensor tx = t2(bx, 0, elt, c->tokens, c->hidden), tw = t2(bw, 0, elt, n2, c->hidden),
                to = t2(bo, 0, elt, c->tokens, c->inter);
    kiln_region ws = whole(bws);
    /* 1 to 8 tokens and hidden a multiple of 32: one fused kernel (the
     * skinny path's gated form), gate and up never stored; 9 to 32 on sm_90
     * the TMA kernel, the same way; otherwise cuBLASLt into the workspace,
     * then the elementwise kernel. */
    const char *env = getenv("KILN_SKINNY");
    const int fused =
        (c->tokens <= 8 && c->hidden % 32 == 0 && !(env && !strcmp(env, "0"))) || swiglu_takes_tma(f, c);
    KILN_CHECK(kiln_op_dense_swiglu(f->jit, &tx, &tw, &to, &ws));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(kiln_buffer_readback(bo, 0, got, on * 2));
    char what[128];
    reference(elt, x, c->tokens, c->hidden, w, n2, NULL, ref, mag);
    KILN_CHECK(kiln_buffer_readback(bws, kiln_op_dense_swiglu_product_offset(), prod, pn * 2));
    if (fused) {
        /* The fused path keeps g and u in registers: the workspace's product
         * area still holds its poison (and so this case did take that path). */
        for (size_t i = 0; i < pn; i++)
            if (prod[i] != 0xffff)
                fail_msg("%s swiglu %lldx%lld -> %lld (fused): workspace element %zu is 0x%04x, not the poison",
                         elt_name(elt), (long long)c->tokens, (long long)c->hidden, (long long)c->inter, i, prod[i]);
    } else {
        /* 1. The gate/up product, every element. */
        snprintf(what, sizeof what, "%s swiglu %lldx%lld -> 2x%lld: gate|up", elt_name(elt), (long long)c->tokens,
                 (long long)c->hidden, (long long)c->inter);
        compare(what, elt, prod, ref, mag, pn);
    }
    double err2 = 0, ref2 = 0;
    for (int64_t t = 0; t < c->tokens; t++) {
        for (int64_t i = 0; i < c->inter; i++) {
            const size_t o = (size_t)t * c->inter + i, gi = (size_t)t * n2 + i, ui = gi + (size_t)c->inter;
            /* End to end, from the exact g and u. */
            const double ge = ref[gi], ue = ref[ui], sg = 1.0 / (1.0 + exp(-ge));
            const double exact = ge * sg * ue, d = table[got[o]] - exact;
            err2 += d * d;
            ref2 += exact * exact;
            if (fused) {
                /* 2a. Every element from the exact g and u: the f32 sums'
                 * errors (bounded by mag) carried through silu (|silu'| <= 1.1). */
                oref[o] = exact;
                omag[o] = 1.1 * fabs(ue) * mag[gi] + fabs(ge * sg) * mag[ui];
            } else {
                /* 2b. silu(g) * u from the g and u the product stored in
                 * the element type (that storage is the contract). */
                const double g = table[prod[gi]], u = table[prod[ui]];
                oref[o] = g / (1.0 + exp(-g)) * u;
                omag[o] = 1e-1 * fabs(oref[o]); /* silu in f32: ~1e-6 relative, well inside rel_tol() */
            }
        }
    }
    snprintf(what, sizeof what, "%s swiglu %lldx%lld -> %lld%s: silu(g)*u", elt_name(elt), (long long)c->tokens,
             (long long)c->hidden, (long long)c->inter, fused ? " (fused)" : "");
    compare(what, elt, got, oref, omag, on);
    const double norm_err = sqrt(err2 / (ref2 > 0 ? ref2 : 1));
    fprintf(stderr, "%s: end to end, norm-wise relative error %.3g\n", what, norm_err);
    /* Up to three roundings (g, u, out): f16's bound scaled by the ratio of
     * the unit roundoffs (2^-8 / 2^-11 = 8) for bf16. */
    assert_true(norm_err <= (elt == KILN_DTYPE_BF16 ? 8e-3 : 1e-3));
    kiln_buffer_destroy(bx);
    kiln_buffer_destroy(bw);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bws);
    free(x), free(w), free(prod), free(got), free(ref), free(mag), free(oref), free(omag);
}

static void test_swiglu(void **state)
{
    static const swiglu_case cases[] = {
        {1, 4096, 14336},   /* Llama-3-8B, decode: fused */
        {8, 4096, 14336},   /* batch 8: fused */
        {5, 896, 4864},     /* Qwen2.5-0.5B: fused */
        {3, 96, 20},        /* fused, one warp a block, outputs past 20 in the last block */
        {7, 1000, 2731},    /* hidden not a multiple of 32: not fused */
        {64, 4096, 14336},  /* Llama-3-8B */
        {4096, 896, 4864},  /* Qwen2.5-0.5B, 4096 tokens */
        {333, 1000, 2731},  /* odd: scalar kernel */
        {9, 64, 8},         /* the smallest vector kernel; on sm_90 the TMA kernel, one output unit */
        {32, 4096, 14336},  /* Llama-3-8B, batch 32: TMA on sm_90 */
        {17, 896, 4864},    /* Qwen2.5-0.5B, an odd batch: TMA */
        {24, 128, 1000},    /* TMA: 125 units, under one a block, two K steps */
        {12, 64, 40000},    /* more than 31 units a block: cuBLASLt */
        {16, 96, 20},       /* hidden not a multiple of 64: cuBLASLt */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_swiglu(*state, &cases[i], KILN_DTYPE_F16);
    /* bf16: the gated skinny kernel, the TMA kernel, cuBLASLt with the
     * vector and the scalar elementwise kernel. */
    static const swiglu_case bf16_cases[] = {
        {1, 4096, 14336}, {5, 896, 4864}, {3, 96, 20},     {7, 1000, 2731}, {64, 4096, 14336},
        {32, 4096, 14336}, {24, 128, 1000}, {9, 64, 8}, {16, 96, 20},
    };
    for (size_t i = 0; bf16_available(state) && i < sizeof bf16_cases / sizeof bf16_cases[0]; i++)
        run_swiglu(*state, &bf16_cases[i], KILN_DTYPE_BF16);
}

/* ---- dense linear, residual add, RMSNorm ---- */

typedef struct ln_case {
    int64_t tokens, in, hidden;
    int parts; /* -1: kiln's choice; 0: one f16 product; P: P f32 parts (where the skinny path does not apply) */
    int tma;   /* 1: kiln's choice is the TMA kernel on sm_90 and later (unless $KILN_TMA is 0); 2: not on 132 SMs, unchecked on others */
} ln_case;

static void run_linear_norm(fixture *f, const ln_case *c, kiln_dtype elt)
{
    const float *table = table_of(elt);
    const size_t xn = (size_t)c->tokens * c->in, wn = (size_t)c->hidden * c->in, on = (size_t)c->tokens * c->hidden;
    uint16_t *x = malloc(xn * 2), *w = malloc(wn * 2), *r0 = malloc(on * 2), *g = malloc((size_t)c->hidden * 2),
             *h = malloc(on * 2), *got = malloc(on * 2);
    double *ref = malloc(on * 8), *mag = malloc(on * 8), *oref = malloc(on * 8), *omag = malloc(on * 8);
    assert_true(x && w && r0 && g && h && got && ref && mag && oref && omag);
    fill_elt(&f->rng, elt, x, xn, 1.0f);
    fill_elt(&f->rng, elt, w, wn, 2.0f / sqrtf((float)c->in));
    fill_elt(&f->rng, elt, r0, on, 1.0f);
    fill_elt(&f->rng, elt, g, (size_t)c->hidden, 2.0f);
    const float eps = 1e-5f;
    kiln_buffer *bx = upload(f->rt, x, xn * 2, 0), *bw = upload(f->rt, w, wn * 2, 0), *br = upload(f->rt, r0, on * 2, 0),
                *bg = upload(f->rt, g, (size_t)c->hidden * 2, 0), *bo = upload(f->rt, NULL, on * 2, 0);
    size_t ws_bytes;
    KILN_CHECK(kiln_op_dense_linear_norm_workspace(c->tokens, c->in, c->hidden, &ws_bytes));
    kiln_buffer *bws = upload(f->rt, NULL, ws_bytes, 0);
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, on * 2));
    KILN_CHECK(kiln_buffer_fill(bws, 0, 0xff, ws_bytes));
    kiln_tensor tx = t2(bx, 0, elt, c->tokens, c->in), tw = t2(bw, 0, elt, c->hidden, c->in),
                tr = t2(br, 0, elt, c->tokens, c->hidden), tg = t1e(bg, 0, elt, c->hidden),
                to = t2(bo, 0, elt, c->tokens, c->hidden);
    kiln_region ws = whole(bws);
    kiln__linear_norm_force_parts(c->parts);
    KILN_CHECK(kiln_op_dense_linear_norm(f->jit, &tx, &tw, &tr, &tg, eps, &to, &ws));
    kiln__linear_norm_force_parts(-1);
    /* The TMA cases do take that kernel where it exists, and no other case does. */
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    const int tma = c->tma == 1 && tma_available(f);
    const char *way = kiln__linear_norm_last_way();
    if ((c->tma != 2 || info.multiprocessors == 132) && tma != !strcmp(way, "tma"))
        fail_msg("%s linear+norm %lldx%lld -> %lld (parts %d) on %s: took the %s way, expected %s",
                 elt_name(elt), (long long)c->tokens, (long long)c->in, (long long)c->hidden, c->parts, info.arch, way,
                 tma ? "tma" : "another");
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(kiln_buffer_readback(br, 0, h, on * 2));
    KILN_CHECK(kiln_buffer_readback(bo, 0, got, on * 2));
    reference(elt, x, c->tokens, c->in, w, c->hidden, NULL, ref, mag);
    /* 1. The residual, every element: y + r0 from the exact y, within the
     *    rounding of y to the element type (up to |y| u: as 1e-5 of mag
     *    rel_tol() 1e5 |y|, about 2 u |y|) and of the sum. */
    const double y_round = rel_tol(elt) * 1e5;
    for (size_t i = 0; i < on; i++) {
        mag[i] += y_round * fabs(ref[i]);
        ref[i] += table[r0[i]];
    }
    char what[160];
    snprintf(what, sizeof what, "%s linear+norm %lldx%lld -> %lld (parts %d): residual", elt_name(elt),
             (long long)c->tokens, (long long)c->in, (long long)c->hidden, c->parts);
    compare(what, elt, h, ref, mag, on);
    /* 2. out, every element, from the residual the command stored (storage
     *    in the element type is the contract): h g / sqrt(mean(h^2) + eps)
     *    in double. */
    for (int64_t t = 0; t < c->tokens; t++) {
        double ss = 0;
        for (int64_t i = 0; i < c->hidden; i++) {
            const double v = table[h[(size_t)t * c->hidden + i]];
            ss += v * v;
        }
        const double inv = 1.0 / sqrt(ss / (double)c->hidden + (double)eps);
        for (int64_t i = 0; i < c->hidden; i++) {
            const size_t o = (size_t)t * c->hidden + i;
            oref[o] = table[h[o]] * table[g[i]] * inv;
            omag[o] = 1e-1 * fabs(oref[o]);
        }
    }
    snprintf(what, sizeof what, "%s linear+norm %lldx%lld -> %lld (parts %d): out", elt_name(elt),
             (long long)c->tokens, (long long)c->in, (long long)c->hidden, c->parts);
    compare(what, elt, got, oref, omag, on);
    kiln_buffer_destroy(bx);
    kiln_buffer_destroy(bw);
    kiln_buffer_destroy(br);
    kiln_buffer_destroy(bg);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bws);
    free(x), free(w), free(r0), free(g), free(h), free(got), free(ref), free(mag), free(oref), free(omag);
}

static void test_linear_norm(void **state)
{
    static const ln_case cases[] = {
        {1, 4096, 4096, -1, 0},      /* Llama-3-8B o_proj, decode: skinny */
        {8, 14336, 4096, -1, 0},     /* down_proj, batch 8: skinny */
        {3, 96, 40, -1, 0},          /* skinny, a small odd hidden */
        {32, 4096, 4096, -1, 1},     /* batch 32: kiln's choice (on sm_90 the TMA kernel) */
        {32, 14336, 4096, -1, 1},
        {32, 4096, 4096, 0, 0},      /* ... and each way */
        {32, 4096, 4096, 1, 0},
        {32, 4096, 4096, 2, 0},
        {32, 14336, 4096, 4, 0},
        {17, 200, 1000, 1, 0},       /* parts: hidden 1000, in 200 */
        {64, 896, 896, 2, 0},        /* Qwen2.5-0.5B's hidden, 64 tokens */
        {19, 1000, 333, 1, 0},       /* hidden 333: the scalar norm, from parts */
        {19, 1000, 333, 0, 0},       /* ... and from the f16 product */
        {100, 4096, 4096, -1, 0},    /* past the parts' 64 tokens: one f16 product */
        {7, 1000, 2731, -1, 0},      /* in not a multiple of 32: no skinny path */
        {9, 4096, 4096, -1, 1},      /* 9 to 32 tokens on sm_90: the TMA kernel, 4 parts */
        {24, 896, 896, -1, 1},       /* ... 2 parts (896 is not a multiple of 256) */
        {32, 64, 48, -1, 1},         /* ... 1 part, 3 units over the SMs */
        {20, 4096, 1000, -1, 0},     /* hidden not a multiple of 16: cuBLASLt */
        {9, 256, 8976, -1, 2},       /* a block's rows past one TMA box (256) on 132 SMs: cuBLASLt */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_linear_norm(*state, &cases[i], KILN_DTYPE_F16);
    /* bf16: every way (skinny, TMA of 4 and 2 parts, plain, parts), the
     * scalar norm, past the parts' tokens. */
    static const ln_case bf16_cases[] = {
        {1, 4096, 4096, -1, 0}, {3, 96, 40, -1, 0},   {32, 4096, 4096, -1, 1}, {24, 896, 896, -1, 1},
        {32, 4096, 4096, 0, 0}, {32, 4096, 4096, 2, 0}, {19, 1000, 333, 1, 0},   {19, 1000, 333, 0, 0},
        {100, 4096, 4096, -1, 0},
    };
    for (size_t i = 0; bf16_available(state) && i < sizeof bf16_cases / sizeof bf16_cases[0]; i++)
        run_linear_norm(*state, &bf16_cases[i], KILN_DTYPE_BF16);
}

static int teardown_linear_norm(void **state)
{
    kiln__linear_norm_force_parts(-1);
    return gpu_fixture_teardown(state);
}

/* ---- last-token linear ---- */

typedef struct last_case {
    int64_t parts, in, out;
    int bias, source;
    int64_t seq; /* source: rows per participant */
} last_case;

/* Random spans: packed, consecutive with random lengths (a batch's layout);
 * source, a random (start, length) inside each participant's seq rows. */
static int64_t make_spans(kiln_rng *r, const last_case *c, uint32_t *spans, int64_t max_tokens)
{
    int64_t at = 0;
    for (int64_t p = 0; p < c->parts; p++) {
        if (c->source) {
            uint32_t len = 1 + kiln_rng_below(r, (uint32_t)c->seq);
            spans[2 * p] = kiln_rng_below(r, (uint32_t)(c->seq - len + 1));
            spans[2 * p + 1] = len;
        } else {
            int64_t room = max_tokens - at - (c->parts - p - 1);
            uint32_t len = 1 + kiln_rng_below(r, (uint32_t)(room / (c->parts - p) * 2 > 1 ? room / (c->parts - p) * 2 : 1));
            if (len > room)
                len = (uint32_t)room;
            spans[2 * p] = (uint32_t)at;
            spans[2 * p + 1] = len;
            at += len;
        }
    }
    return c->source ? c->parts * c->seq : at;
}

static void run_last(fixture *f, const last_case *c, kiln_dtype elt)
{
    uint32_t *spans = malloc(sizeof(uint32_t) * 2 * (size_t)c->parts);
    assert_non_null(spans);
    const int64_t rows = make_spans(&f->rng, c, spans, 4096);
    const size_t xn = (size_t)rows * c->in, wn = (size_t)c->out * c->in, on = (size_t)c->parts * c->out;
    uint16_t *x = malloc(xn * 2), *w = malloc(wn * 2), *b = malloc((size_t)c->out * 2), *got = malloc(on * 2),
             *sel = malloc((size_t)c->parts * c->in * 2);
    double *ref = malloc(on * 8), *mag = malloc(on * 8);
    assert_true(x && w && b && got && sel && ref && mag);
    fill_elt(&f->rng, elt, x, xn, 1.0f);
    fill_elt(&f->rng, elt, w, wn, 2.0f / sqrtf((float)c->in));
    fill_elt(&f->rng, elt, b, (size_t)c->out, 1.0f);
    for (int64_t p = 0; p < c->parts; p++) {
        int64_t row = (c->source ? p * c->seq : 0) + spans[2 * p] + spans[2 * p + 1] - 1;
        memcpy(sel + (size_t)p * c->in, x + (size_t)row * c->in, (size_t)c->in * 2);
    }
    kiln_buffer *bx = upload(f->rt, x, xn * 2, 0), *bs = upload(f->rt, spans, (size_t)c->parts * 8, 0),
                *bw = upload(f->rt, w, wn * 2, 0), *bb = upload(f->rt, b, (size_t)c->out * 2, 0),
                *bo = upload(f->rt, NULL, on * 2, 0);
    size_t ws_bytes;
    KILN_CHECK(kiln_op_last_token_linear_workspace(c->parts, c->in, c->out, &ws_bytes));
    kiln_buffer *bws = upload(f->rt, NULL, ws_bytes, 0);
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, on * 2));
    kiln_tensor tx = c->source ? (kiln_tensor){.buffer = bx, .dtype = elt, .rank = 3,
                                               .dims = {c->parts, c->seq, c->in}}
                               : t2(bx, 0, elt, rows, c->in);
    kiln_tensor ts = t2(bs, 0, KILN_DTYPE_U32, c->parts, 2), tw = t2(bw, 0, elt, c->out, c->in),
                tb = t1e(bb, 0, elt, c->out), to = t2(bo, 0, elt, c->parts, c->out);
    kiln_region ws = whole(bws);
    KILN_CHECK(kiln_op_last_token_linear(f->jit, &tx, &ts, &tw, c->bias ? &tb : NULL, &to, &ws));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    KILN_CHECK(kiln_buffer_readback(bo, 0, got, on * 2));
    reference(elt, sel, c->parts, c->in, w, c->out, c->bias ? b : NULL, ref, mag);
    char what[128];
    snprintf(what, sizeof what, "%s last_token_linear %lld participants (%s, %lld rows) x %lld -> %lld%s",
             elt_name(elt), (long long)c->parts, c->source ? "source" : "packed", (long long)rows, (long long)c->in,
             (long long)c->out, c->bias ? " +bias" : "");
    compare(what, elt, got, ref, mag, on);
    kiln_buffer_destroy(bx);
    kiln_buffer_destroy(bs);
    kiln_buffer_destroy(bw);
    kiln_buffer_destroy(bb);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bws);
    free(spans), free(x), free(w), free(b), free(got), free(sel), free(ref), free(mag);
}

static void test_last_token_linear(void **state)
{
    static const last_case cases[] = {
        {1, 4096, 128256, 0, 0, 0},   /* Llama-3-8B lm head, one sequence */
        {64, 4096, 128256, 0, 0, 0},  /* 64 participants, up to 4096 packed tokens */
        {1, 896, 151936, 0, 0, 0},    /* Qwen2.5-0.5B lm head */
        {17, 896, 151936, 1, 1, 300}, /* source coordinates */
        {37, 1000, 50001, 1, 0, 0},   /* odd sizes */
        {5, 1001, 77, 1, 1, 9},       /* odd row length: scalar gather */
        {8, 4096, 32000, 1, 1, 40},   /* 1 to 8 participants: the skinny kernel, a bias */
        {3, 2048, 50000, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_last(*state, &cases[i], KILN_DTYPE_F16);
    /* bf16: packed and source coordinates, the vector and the scalar gather, a bias. */
    static const last_case bf16_cases[] = {
        {1, 4096, 128256, 0, 0, 0},
        {17, 896, 151936, 1, 1, 300},
        {37, 1000, 50001, 1, 0, 0},
        {5, 1001, 77, 1, 1, 9},
        {8, 4096, 32000, 1, 1, 40},
    };
    for (size_t i = 0; bf16_available(state) && i < sizeof bf16_cases / sizeof bf16_cases[0]; i++)
        run_last(*state, &bf16_cases[i], KILN_DTYPE_BF16);
}

/* ---- commands: replayed, spans read from device memory, attribution ---- */

static void test_replayed_batch_reads_spans_from_device(void **state)
{
    fixture *f = *state;
    const int64_t T = 40, H = 256, I = 512, V = 1000, P = 4;
    uint16_t *x = malloc(T * H * 2), *wl = malloc(H * H * 2), *wg = malloc(2 * I * H * 2), *wv = malloc(V * H * 2);
    uint16_t *got_l = malloc(T * H * 2), *got_s = malloc(T * I * 2), *got_v = malloc(P * V * 2);
    uint16_t *want_s = malloc(T * I * 2), *sel = malloc(P * H * 2);
    double *ref = malloc(sizeof(double) * T * 2 * I), *mag = malloc(sizeof(double) * T * 2 * I);
    assert_true(x && wl && wg && wv && got_l && got_s && got_v && want_s && sel && ref && mag);
    fill_f16(&f->rng, x, T * H, 1.0f);
    fill_f16(&f->rng, wl, H * H, 0.125f);
    fill_f16(&f->rng, wg, 2 * I * H, 0.125f);
    fill_f16(&f->rng, wv, V * H, 0.125f);
    kiln_buffer *bx = upload(f->rt, x, T * H * 2, 0), *bwl = upload(f->rt, wl, H * H * 2, 0),
                *bwg = upload(f->rt, wg, 2 * I * H * 2, 0), *bwv = upload(f->rt, wv, V * H * 2, 0),
                *bol = upload(f->rt, NULL, T * H * 2, 0), *bos = upload(f->rt, NULL, T * I * 2, 0),
                *bov = upload(f->rt, NULL, P * V * 2, 0), *bsp = upload(f->rt, NULL, P * 8, 0);
    size_t a, b, c;
    KILN_CHECK(kiln_op_dense_linear_workspace(T, H, H, &a));
    KILN_CHECK(kiln_op_dense_swiglu_workspace(T, H, I, &b));
    KILN_CHECK(kiln_op_last_token_linear_workspace(P, H, V, &c));
    /* One workspace each: commands of one batch may not share one. */
    kiln_buffer *w1 = upload(f->rt, NULL, a, 0), *w2 = upload(f->rt, NULL, b, 0), *w3 = upload(f->rt, NULL, c, 0);
    kiln_tensor tx = t2(bx, 0, KILN_DTYPE_F16, T, H), twl = t2(bwl, 0, KILN_DTYPE_F16, H, H),
                twg = t2(bwg, 0, KILN_DTYPE_F16, 2 * I, H), twv = t2(bwv, 0, KILN_DTYPE_F16, V, H),
                tol = t2(bol, 0, KILN_DTYPE_F16, T, H), tos = t2(bos, 0, KILN_DTYPE_F16, T, I),
                tov = t2(bov, 0, KILN_DTYPE_F16, P, V), tsp = t2(bsp, 0, KILN_DTYPE_U32, P, 2);
    kiln_region r1 = whole(w1), r2 = whole(w2), r3 = whole(w3);
    kiln_command *cmds[3];
    KILN_CHECK(kiln_op_dense_linear_encode(f->jit, &tx, &twl, NULL, &tol, &r1, &cmds[0]));
    KILN_CHECK(kiln_op_dense_swiglu_encode(f->jit, &tx, &twg, &tos, &r2, &cmds[1]));
    KILN_CHECK(kiln_op_last_token_linear_encode(f->jit, &tx, &tsp, &twv, NULL, &tov, &r3, &cmds[2]));
    for (int i = 0; i < 3; i++)
        assert_true(kiln_command_replayable(cmds[i]));
    kiln_stream *s;
    KILN_CHECK(kiln_stream_create(f->rt, &s));
    /* Two batches, the same commands, different spans uploaded in between. */
    static const uint32_t spans[2][8] = {{0, 10, 10, 5, 15, 20, 35, 5}, {0, 1, 1, 38, 39, 1, 20, 3}};
    uint16_t *first_l = malloc(T * H * 2), *first_s = malloc(T * I * 2);
    assert_true(first_l && first_s);
    for (int round = 0; round < 2; round++) {
        KILN_CHECK(kiln_buffer_upload(bsp, 0, spans[round], sizeof spans[round]));
        KILN_CHECK(kiln_buffer_fill(bol, 0, 0xff, T * H * 2));
        KILN_CHECK(kiln_buffer_fill(bos, 0, 0xff, T * I * 2));
        KILN_CHECK(kiln_buffer_fill(bov, 0, 0xff, P * V * 2));
        KILN_CHECK(kiln_runtime_synchronize(f->rt));
        kiln_submit_options o = {.path = KILN_PATH_REPLAYED_ONLY, .timing = KILN_TIMING_SPANS, .phase = "decode"};
        kiln_fence *fence;
        KILN_CHECK(kiln_stream_prepare(s, cmds, 3, &o, NULL));
        KILN_CHECK(kiln_stream_submit(s, cmds, 3, &o, &fence));
        KILN_CHECK(kiln_fence_wait(fence));
        static const char *const ids[3] = {"dense_linear", "dense_swiglu", "last_token_linear"};
        static const uint32_t parts[3] = {1, 1, 4}, disp[3] = {1, 2, 2};
        for (size_t i = 0; i < 3; i++) {
            kiln_attribution row;
            KILN_CHECK(kiln_fence_attribution(fence, i, &row));
            assert_string_equal(row.op_id, ids[i]);
            assert_int_equal(row.path, KILN_EXEC_REPLAYED);
            assert_int_equal(row.batching, KILN_BATCHING_PACKED);
            assert_int_equal(row.participants, parts[i]);
            assert_int_equal(row.tokens, T);
            assert_int_equal(row.dispatches, disp[i]);
        }
        kiln_fence_release(fence);
        kiln_region ro = {bol, 0, T * H * 2}, rs = {bos, 0, T * I * 2}, rv = {bov, 0, P * V * 2};
        KILN_CHECK(kiln_stream_readback(s, &ro, got_l));
        KILN_CHECK(kiln_stream_readback(s, &rs, got_s));
        KILN_CHECK(kiln_stream_readback(s, &rv, got_v));
        if (round == 0) {
            /* The dense results, checked once against the reference... */
            reference(KILN_DTYPE_F16, x, T, H, wl, H, NULL, ref, mag);
            compare("replayed linear", KILN_DTYPE_F16, got_l, ref, mag, T * H);
            memcpy(first_l, got_l, T * H * 2);
            memcpy(first_s, got_s, T * I * 2);
        } else {
            /* ...and the same bits when replayed again. */
            assert_memory_equal(first_l, got_l, T * H * 2);
            assert_memory_equal(first_s, got_s, T * I * 2);
        }
        for (int64_t p = 0; p < P; p++)
            memcpy(sel + p * H, x + (spans[round][2 * p] + spans[round][2 * p + 1] - 1) * H, H * 2);
        reference(KILN_DTYPE_F16, sel, P, H, wv, V, NULL, ref, mag);
        compare(round ? "replayed last_token_linear, new spans" : "replayed last_token_linear", KILN_DTYPE_F16,
                got_v, ref, mag, P * V);
    }
    for (int64_t i = 0; i < T * I; i++)
        assert_int_not_equal(got_s[i], 0xffff);
    KILN_CHECK(kiln_stream_synchronize(s));
    kiln_stream_destroy(s);
    for (int i = 0; i < 3; i++)
        kiln_command_release(cmds[i]);
    kiln_buffer *bufs[] = {bx, bwl, bwg, bwv, bol, bos, bov, bsp, w1, w2, w3};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        kiln_buffer_destroy(bufs[i]);
    free(x), free(wl), free(wg), free(wv), free(got_l), free(got_s), free(got_v), free(want_s), free(sel);
    free(ref), free(mag), free(first_l), free(first_s);
}

/* ---- bad spans: reported through the fault record, never read ---- */

static void test_bad_spans_are_reported_not_read(void **state)
{
    fixture *f = *state;
    const int64_t T = 16, H = 64, V = 24, P = 6;
    uint16_t x[16 * 64], w[24 * 64], b[24], got[6 * 24];
    fill_f16(&f->rng, x, T * H, 1.0f);
    fill_f16(&f->rng, w, V * H, 0.25f);
    fill_f16(&f->rng, b, V, 1.0f);
    kiln_buffer *bx = upload(f->rt, x, sizeof x, 0), *bw = upload(f->rt, w, sizeof w, 0),
                *bb = upload(f->rt, b, sizeof b, 0), *bo = upload(f->rt, NULL, sizeof got, 0),
                *bs = upload(f->rt, NULL, P * 8, 0);
    size_t need;
    KILN_CHECK(kiln_op_last_token_linear_workspace(P, H, V, &need));
    kiln_buffer *bws = upload(f->rt, NULL, need, 0);
    kiln_tensor tx = t2(bx, 0, KILN_DTYPE_F16, T, H), tw = t2(bw, 0, KILN_DTYPE_F16, V, H), tb = t1(bb, 0, V),
                to = t2(bo, 0, KILN_DTYPE_F16, P, V), ts = t2(bs, 0, KILN_DTYPE_U32, P, 2);
    kiln_region ws = whole(bws);
    static const struct {
        uint32_t spans[12];
        uint32_t bad;
        const char *code, *index;
    } cases[] = {
        {{0, 2, 2, 2, 4, 2, 6, 0, 6, 2, 8, 2}, 3, "participant 3 has an empty span", "zeroed"},    /* empty span */
        {{0, 2, 2, 2, 4, 2, 6, 2, 8, 2, 10, 7}, 5, "participant 5's span ends at row 17", "past the 16 rows"},   /* 10 + 7 > 16 tokens */
        {{0, 1, 0xffffffffu, 2, 4, 2, 6, 2, 8, 2, 10, 2}, 1, "participant 1's span ends at row 4294967295", "past the"}, /* start + length wraps u32 */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        KILN_CHECK(kiln_buffer_upload(bs, 0, cases[k].spans, sizeof cases[k].spans));
        KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, sizeof got));
        KILN_CHECK(kiln_op_last_token_linear(f->jit, &tx, &ts, &tw, &tb, &to, &ws));
        KILN_EXPECT(kiln_runtime_synchronize(f->rt), KILN_ERR_DEVICE_CONTRACT, kiln_runtime_errmsg(f->rt),
                    cases[k].code, cases[k].index);
        KILN_CHECK(kiln_buffer_readback(bo, 0, got, sizeof got));
        /* The bad participant's row was zeroed: its output is the bias. */
        for (int64_t o = 0; o < V; o++)
            assert_int_equal(got[cases[k].bad * V + o], b[o]);
    }
    /* The fault is cleared: good spans work again. */
    static const uint32_t good[12] = {0, 2, 2, 2, 4, 2, 6, 2, 8, 2, 10, 6};
    KILN_CHECK(kiln_buffer_upload(bs, 0, good, sizeof good));
    KILN_CHECK(kiln_op_last_token_linear(f->jit, &tx, &ts, &tw, &tb, &to, &ws));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    kiln_buffer *bufs[] = {bx, bw, bb, bo, bs, bws};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        kiln_buffer_destroy(bufs[i]);
}

/* ---- validation: binding, expected, actual ---- */

static void test_bad_bindings_are_refused_before_launch(void **state)
{
    fixture *f = *state;
    kiln_buffer *b, *wsb, *small;
    KILN_CHECK(kiln_buffer_create(f->rt, 8 * MIB, 0, &b));
    KILN_CHECK(kiln_buffer_create(f->rt, 64 * MIB, 0, &wsb));
    KILN_CHECK(kiln_buffer_create(f->rt, 4096, 0, &small));
    kiln_tensor x = t2(b, 0, KILN_DTYPE_F16, 8, 512);                  /* [0, 8 KiB) */
    kiln_tensor w = t2(b, 65536, KILN_DTYPE_F16, 1024, 512);           /* [64 KiB, 1088 KiB) */
    kiln_tensor bias = t1(b, 2 * MIB, 1024);
    kiln_tensor out = t2(b, 3 * MIB, KILN_DTYPE_F16, 8, 1024);
    kiln_tensor gu = t2(b, 65536, KILN_DTYPE_F16, 1024, 512);          /* intermediate 512 */
    kiln_tensor sout = t2(b, 3 * MIB, KILN_DTYPE_F16, 8, 512);
    kiln_tensor spans = t2(b, 4 * MIB, KILN_DTYPE_U32, 3, 2);
    kiln_tensor lout = t2(b, 5 * MIB, KILN_DTYPE_F16, 3, 1024);
    kiln_region ws = whole(wsb);
    KILN_CHECK(kiln_buffer_fill(b, 0, 0, 8 * MIB));
    KILN_CHECK(kiln_op_dense_linear(f->jit, &x, &w, &bias, &out, &ws));
    KILN_CHECK(kiln_op_dense_swiglu(f->jit, &x, &gu, &sout, &ws));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));

    kiln_tensor t;
    kiln_region r;
    size_t wsz;
    t = x, t.dtype = KILN_DTYPE_F32;
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &t, &w, NULL, &out, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_runtime_errmsg(f->rt), "binding x must be f16", "got f32");
    t = w, t.dims[1] = 511;
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &t, NULL, &out, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding weight has dims [1024, 511]", "dim 1 must be 512");
    t = out, t.dims[1] = 1000;
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &w, NULL, &t, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out has dims [8, 1000]", "dim 1 must be 1024");
    t = bias, t.dims[0] = 1023;
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &w, &t, &out, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding bias has dims [1023]", "must be 1024");
    t = bias, t.offset += 2;
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &w, &t, &out, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "bias must start 16-byte aligned", "2 bytes past");
    r = ws, r.end = r.start + 32 * MIB - 256;
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &w, NULL, &out, &r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "workspace has 33554176 bytes", "at least 33554432");
    r = ws, r.start = 128;
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &w, NULL, &out, &r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "workspace must start 256-byte aligned", "offset 128");
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &w, NULL, &out, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "workspace has no buffer", "33554432");
    r = (kiln_region){small, 0, 4096};
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &w, NULL, &out, &r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "workspace has 4096 bytes", NULL);
    r = (kiln_region){b, 0, 8 * MIB};
    KILN_EXPECT(kiln_op_dense_linear_workspace(8, 512, 1024, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL,
                NULL);
    kiln_buffer *big;
    KILN_CHECK(kiln_buffer_create(f->rt, 40 * MIB, 0, &big));
    kiln_tensor xb = t2(big, 0, KILN_DTYPE_F16, 8, 512);
    r = (kiln_region){big, 0, 40 * MIB};
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &xb, &w, NULL, &out, &r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "workspace [0, 41943040) overlaps binding x", NULL);
    kiln_buffer_destroy(big);
    t = out, t.offset = 65536 + 4096;
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &w, NULL, &t, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out overlaps binding weight", NULL);

    t = gu, t.dims[0] = 1023;
    KILN_EXPECT(kiln_op_dense_swiglu(f->jit, &x, &t, &sout, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "gate_up has 1023 rows", "2 x intermediate");
    t = sout, t.dims[1] = 1024;
    KILN_EXPECT(kiln_op_dense_swiglu(f->jit, &x, &gu, &t, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out has dims [8, 1024]", "dim 1 must be 512");
    r = ws, r.end = r.start + 32 * MIB + 4096;
    KILN_EXPECT(kiln_op_dense_swiglu(f->jit, &x, &gu, &sout, &r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "workspace has 33558528 bytes", "at least 33570816");

    t = spans, t.dims[1] = 3;
    KILN_EXPECT(kiln_op_last_token_linear(f->jit, &x, &t, &w, NULL, &lout, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding spans has dims [3, 3]", "dim 1 must be 2");
    t = spans, t.dtype = KILN_DTYPE_I32;
    KILN_EXPECT(kiln_op_last_token_linear(f->jit, &x, &t, &w, NULL, &lout, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding spans must be u32", NULL);
    t = lout, t.dims[0] = 4;
    KILN_EXPECT(kiln_op_last_token_linear(f->jit, &x, &spans, &w, NULL, &t, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding out has dims [4, 1024]", "dim 0 must be 3");
    t = x, t.rank = 1;
    KILN_EXPECT(kiln_op_last_token_linear(f->jit, &t, &spans, &w, NULL, &lout, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding x must have rank 2", "got 1");
    t = (kiln_tensor){.buffer = b, .dtype = KILN_DTYPE_F16, .rank = 3, .dims = {4, 2, 512}};
    KILN_EXPECT(kiln_op_last_token_linear(f->jit, &t, &spans, &w, NULL, &lout, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding spans has dims [3, 2]", "dim 0 must be 4");
    /* Linear + norm: x [8, 512], w [1024, 512], residual and out [8, 1024]. */
    kiln_tensor nres = t2(b, 6 * MIB, KILN_DTYPE_F16, 8, 1024), nw = t1(b, 7 * MIB, 1024);
    KILN_CHECK(kiln_op_dense_linear_norm(f->jit, &x, &w, &nres, &nw, 1e-5f, &out, &ws));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    t = nres, t.dims[1] = 1000;
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &x, &w, &t, &nw, 1e-5f, &out, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding residual has dims [8, 1000]", "dim 1 must be 1024");
    t = nw, t.dims[0] = 512;
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &x, &w, &nres, &t, 1e-5f, &out, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding norm_weight has dims [512]", "must be 1024");
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &x, &w, &nres, &nw, 0.0f, &out, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "eps must be a finite number > 0", "got 0");
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &x, &w, &nres, &nw, 1e-5f, &nres, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding out overlaps binding residual", NULL);
    t = nres, t.offset = 4096;
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &x, &w, &t, &nw, 1e-5f, &out, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "binding residual overlaps binding x", NULL);
    r = ws, r.end = r.start + 32 * MIB + 4096;
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &x, &w, &nres, &nw, 1e-5f, &out, &r), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "workspace has 33558528 bytes", "at least 33685504");
    KILN_EXPECT(kiln_op_dense_linear_norm_workspace(0, 512, 1024, &wsz), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "tokens 0", NULL);
    /* Mixed element types: x's is the op's (here bf16), and every other
     * 16-bit binding must have it; each refusal names the binding and both
     * dtypes. Then the same bindings all in bf16 run. */
    kiln_tensor xh = x, wh = w, bh = bias, oh = out, guh = gu, soh = sout, loh = lout, rh = nres, nwh = nw;
    xh.dtype = wh.dtype = bh.dtype = oh.dtype = guh.dtype = soh.dtype = loh.dtype = rh.dtype = nwh.dtype =
        KILN_DTYPE_BF16;
    if (!bf16_available(state)) {
        KILN_EXPECT(kiln_op_dense_linear(f->jit, &xh, &wh, NULL, &oh, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                    "dense_linear: binding x is bf16", "before sm_80");
        goto out;
    }
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &xh, &w, NULL, &oh, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "dense_linear: binding weight must be bf16", "got f16");
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &x, &wh, NULL, &out, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "dense_linear: binding weight must be f16", "got bf16");
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &xh, &wh, &bias, &oh, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "dense_linear: binding bias must be bf16", "got f16");
    KILN_EXPECT(kiln_op_dense_linear(f->jit, &xh, &wh, NULL, &out, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "dense_linear: binding out must be bf16", "got f16");
    KILN_EXPECT(kiln_op_dense_swiglu(f->jit, &xh, &gu, &soh, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "dense_swiglu: binding gate_up must be bf16", "got f16");
    KILN_EXPECT(kiln_op_dense_swiglu(f->jit, &xh, &guh, &sout, &ws), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "dense_swiglu: binding out must be bf16", "got f16");
    KILN_EXPECT(kiln_op_last_token_linear(f->jit, &xh, &spans, &w, NULL, &loh, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "last_token_linear: binding weight must be bf16", "got f16");
    KILN_EXPECT(kiln_op_last_token_linear(f->jit, &xh, &spans, &wh, &bias, &loh, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "last_token_linear: binding bias must be bf16", "got f16");
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &xh, &w, &rh, &nwh, 1e-5f, &oh, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "dense_linear_norm: binding weight must be bf16", "got f16");
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &xh, &wh, &nres, &nwh, 1e-5f, &oh, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "dense_linear_norm: binding residual must be bf16", "got f16");
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &xh, &wh, &rh, &nw, 1e-5f, &oh, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "dense_linear_norm: binding norm_weight must be bf16", "got f16");
    KILN_EXPECT(kiln_op_dense_linear_norm(f->jit, &xh, &wh, &rh, &nwh, 1e-5f, &out, &ws), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "dense_linear_norm: binding out must be bf16", "got f16");
    KILN_CHECK(kiln_op_dense_linear(f->jit, &xh, &wh, &bh, &oh, &ws));
    KILN_CHECK(kiln_op_dense_swiglu(f->jit, &xh, &guh, &soh, &ws));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
out:
    /* Nothing was launched by the refused calls; the runtime is fine. */
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    kiln_buffer_destroy(small);
    kiln_buffer_destroy(wsb);
    kiln_buffer_destroy(b);
}

/* ---- prewarm, then encode: nothing compiles; the heuristic once per shape ---- */

static void test_prewarmed_model_compiles_nothing(void **state)
{
    fixture *f = *state;
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    char path[600];
    snprintf(path, sizeof path, "%s/prewarmed.db", f->dir);
    kiln_cache_options co = {.path = path};
    kiln_cache *cache;
    KILN_CHECK(kiln_cache_open(&co, &cache));
    static const char qwen[] = "{\"vocab_size\": 151936, \"hidden_size\": 896, \"intermediate_size\": 4864,"
                               " \"num_attention_heads\": 14, \"num_key_value_heads\": 2}";
    static const char odd[] = "{\"vocab_size\": 50001, \"hidden_size\": 1000, \"intermediate_size\": 2731,"
                              " \"num_attention_heads\": 8}";
    kiln_model_config cfg[3];
    kiln_model_config_default(&cfg[0]);
    KILN_CHECK(kiln_model_config_parse(qwen, strlen(qwen), &cfg[1]));
    KILN_CHECK(kiln_model_config_parse(odd, strlen(odd), &cfg[2]));
    /* `kiln prewarm`: an offline jit for the device's architecture. */
    kiln_jit_options po = {.cache = cache, .arch = info.arch};
    kiln_jit *pre;
    KILN_CHECK(kiln_jit_create(&po, &pre));
    for (int m = 0; m < 3; m++) {
        kiln_spec *specs;
        size_t n;
        KILN_CHECK(kiln_model_specializations(&cfg[m], &specs, &n));
        for (size_t i = 0; i < n; i++)
            KILN_CHECK(kiln_jit_prepare(pre, &specs[i], NULL));
        kiln_free(specs);
    }
    kiln_jit_destroy(pre);

    kiln_jit_options jo = {.cache = cache, .runtime = f->rt};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    uint64_t q0, h0, q1, h1;
    kiln_buffer *bw, *bx, *bo, *bws, *bs;
    KILN_CHECK(kiln_buffer_create(f->rt, (size_t)128256 * 4096 * 2, 0, &bw));
    KILN_CHECK(kiln_buffer_create(f->rt, 64 * MIB, 0, &bx));
    KILN_CHECK(kiln_buffer_create(f->rt, 64 * MIB, 0, &bo));
    KILN_CHECK(kiln_buffer_create(f->rt, 128 * MIB, 0, &bws));
    KILN_CHECK(kiln_buffer_create(f->rt, 4096, 0, &bs));
    KILN_CHECK(kiln_buffer_fill(bw, 0, 0, kiln_buffer_size(bw)));
    KILN_CHECK(kiln_buffer_fill(bx, 0, 0, kiln_buffer_size(bx)));
    static const uint32_t spans[4] = {0, 3, 3, 4};
    KILN_CHECK(kiln_buffer_upload(bs, 0, spans, sizeof spans));
    kiln_region ws = whole(bws);
    kiln__blas_cache_counters(&q0, &h0);
    for (int m = 0; m < 3; m++) {
        const int64_t H = cfg[m].hidden_size, I = cfg[m].intermediate_size, V = cfg[m].vocab_size, T = 7;
        kiln_tensor x = t2(bx, 0, KILN_DTYPE_F16, T, H), ids = {.buffer = bs, .dtype = KILN_DTYPE_U32, .rank = 1,
                                                                 .dims = {4}};
        kiln_tensor emb_table = t2(bw, 0, KILN_DTYPE_F16, V, H), emb_out = t2(bo, 0, KILN_DTYPE_F16, 4, H);
        kiln_tensor wl = t2(bw, 0, KILN_DTYPE_F16, H, H), lo = t2(bo, 0, KILN_DTYPE_F16, T, H);
        kiln_tensor wg = t2(bw, 0, KILN_DTYPE_F16, 2 * I, H), so = t2(bo, 0, KILN_DTYPE_F16, T, I);
        kiln_tensor wv = t2(bw, 0, KILN_DTYPE_F16, V, H), sp = t2(bs, 0, KILN_DTYPE_U32, 2, 2),
                    vo = t2(bo, 0, KILN_DTYPE_F16, 2, V);
        kiln_command *cmds[4];
        KILN_CHECK(kiln_op_token_embedding_encode(jit, &emb_table, &ids, &emb_out, &cmds[0]));
        KILN_CHECK(kiln_op_dense_linear_encode(jit, &x, &wl, NULL, &lo, &ws, &cmds[1]));
        KILN_CHECK(kiln_op_dense_swiglu_encode(jit, &x, &wg, &so, &ws, &cmds[2]));
        KILN_CHECK(kiln_op_last_token_linear_encode(jit, &x, &sp, &wv, NULL, &vo, &ws, &cmds[3]));
        /* One after the other on one stream: they may share the workspace. */
        for (int i = 0; i < 4; i++) {
            KILN_CHECK(kiln_stream_submit(kiln_runtime_stream(f->rt), &cmds[i], 1, NULL, NULL));
            kiln_command_release(cmds[i]);
        }
        KILN_CHECK(kiln_runtime_synchronize(f->rt));
    }
    kiln__blas_cache_counters(&q1, &h1);
    kiln_jit_counters k;
    kiln_jit_get_counters(jit, &k);
    fprintf(stderr, "prewarmed: compiles %llu, database hits %llu; heuristic queries %llu, hits %llu\n",
            (unsigned long long)k.compiles, (unsigned long long)k.database_hits, (unsigned long long)(q1 - q0),
            (unsigned long long)(h1 - h0));
    assert_int_equal(k.compiles, 0);
    /* Embedding and gather for each model; the 7-token linear's and SwiGLU's
     * skinny kernels (plain and gated) for Llama (in 4096) and Qwen (896);
     * the odd model's (in 1000) linear goes through cuBLASLt, its SwiGLU
     * through cuBLASLt and the elementwise kernel. */
    assert_int_equal(k.database_hits, 11);
    /* The same shape again: served by the heuristic cache, no new query. */
    kiln_command *again;
    kiln_tensor x = t2(bx, 0, KILN_DTYPE_F16, 7, 1000), wl = t2(bw, 0, KILN_DTYPE_F16, 1000, 1000),
                lo = t2(bo, 0, KILN_DTYPE_F16, 7, 1000);
    KILN_CHECK(kiln_op_dense_linear_encode(jit, &x, &wl, NULL, &lo, &ws, &again));
    kiln_command_release(again);
    uint64_t q2, h2;
    kiln__blas_cache_counters(&q2, &h2);
    assert_int_equal(q2, q1);
    assert_int_equal(h2, h1 + 1);
    kiln_buffer *bufs[] = {bw, bx, bo, bws, bs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        kiln_buffer_destroy(bufs[i]);
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
}

/* A bf16 model's dense kernels prewarmed from its config (dtype bf16): its
 * dense ops then compile nothing when they run in bf16: the skinny kernels (plain, gated), the TMA
 * SwiGLU (sm_90), the gather. And an f16 and a bf16 product of one shape
 * never share a cuBLASLt plan: the bf16 one is its own heuristic query. */
static void test_prewarmed_bf16_model_compiles_nothing(void **state)
{
    fixture *f = *state;
    if (!bf16_available(state))
        skip();
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    char path[600];
    snprintf(path, sizeof path, "%s/prewarmed-bf16.db", f->dir);
    kiln_cache_options co = {.path = path};
    kiln_cache *cache;
    KILN_CHECK(kiln_cache_open(&co, &cache));
    kiln_model_config cfg;
    kiln_model_config_default(&cfg); /* Llama-3-8B */
    cfg.dtype = KILN_DTYPE_BF16;
    kiln_jit_options po = {.cache = cache, .arch = info.arch};
    kiln_jit *pre;
    KILN_CHECK(kiln_jit_create(&po, &pre));
    kiln_spec *specs;
    size_t n;
    KILN_CHECK(kiln_model_specializations(&cfg, &specs, &n));
    /* The dense ops' kernels only (the other ops' are their tests'). */
    static const char *const dense[] = {"skinny_linear", "swiglu", "gather_last", "tma_linear", "tma_swiglu"};
    for (size_t i = 0; i < n; i++)
        for (size_t d = 0; d < sizeof dense / sizeof dense[0]; d++)
            if (!strcmp(specs[i].template_id, dense[d]))
                KILN_CHECK(kiln_jit_prepare(pre, &specs[i], NULL));
    kiln_free(specs);
    kiln_jit_destroy(pre);

    kiln_jit_options jo = {.cache = cache, .runtime = f->rt};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
    kiln_buffer *bw, *bx, *bo, *bws, *bs;
    KILN_CHECK(kiln_buffer_create(f->rt, (size_t)V * H * 2, 0, &bw));
    KILN_CHECK(kiln_buffer_create(f->rt, 64 * MIB, 0, &bx));
    KILN_CHECK(kiln_buffer_create(f->rt, 64 * MIB, 0, &bo));
    KILN_CHECK(kiln_buffer_create(f->rt, 128 * MIB, 0, &bws));
    KILN_CHECK(kiln_buffer_create(f->rt, 4096, 0, &bs));
    KILN_CHECK(kiln_buffer_fill(bw, 0, 0, kiln_buffer_size(bw)));
    KILN_CHECK(kiln_buffer_fill(bx, 0, 0, kiln_buffer_size(bx)));
    static const uint32_t spans[4] = {0, 3, 3, 4};
    KILN_CHECK(kiln_buffer_upload(bs, 0, spans, sizeof spans));
    kiln_region ws = whole(bws);
    const kiln_dtype B = KILN_DTYPE_BF16;
    static const int64_t tokens[2] = {7, 20}; /* the skinny kernels; the TMA SwiGLU on sm_90 */
    for (int i = 0; i < 2; i++) {
        const int64_t T = tokens[i];
        kiln_tensor x = t2(bx, 0, B, T, H), wl = t2(bw, 0, B, H, H), lo = t2(bo, 0, B, T, H);
        kiln_tensor wg = t2(bw, 0, B, 2 * I, H), so = t2(bo, 0, B, T, I);
        kiln_tensor wv = t2(bw, 0, B, V, H), sp = t2(bs, 0, KILN_DTYPE_U32, 2, 2), vo = t2(bo, 0, B, 2, V);
        kiln_command *cmds[3];
        KILN_CHECK(kiln_op_dense_linear_encode(jit, &x, &wl, NULL, &lo, &ws, &cmds[0]));
        KILN_CHECK(kiln_op_dense_swiglu_encode(jit, &x, &wg, &so, &ws, &cmds[1]));
        KILN_CHECK(kiln_op_last_token_linear_encode(jit, &x, &sp, &wv, NULL, &vo, &ws, &cmds[2]));
        for (int c = 0; c < 3; c++) {
            KILN_CHECK(kiln_stream_submit(kiln_runtime_stream(f->rt), &cmds[c], 1, NULL, NULL));
            kiln_command_release(cmds[c]);
        }
        KILN_CHECK(kiln_runtime_synchronize(f->rt));
    }
    kiln_jit_counters k;
    kiln_jit_get_counters(jit, &k);
    fprintf(stderr, "prewarmed bf16: compiles %llu, database hits %llu\n", (unsigned long long)k.compiles,
            (unsigned long long)k.database_hits);
    assert_int_equal(k.compiles, 0);
    assert_true(k.database_hits >= 3); /* skinny plain, skinny gated, gather (and TMA SwiGLU on sm_90) */

    /* 100 tokens: one cuBLASLt call, no kernel; f16, then bf16 of the same shape and addresses. */
    uint64_t q0, h0, q1, h1, q2, h2;
    kiln_tensor x16 = t2(bx, 0, KILN_DTYPE_F16, 100, H), w16 = t2(bw, 0, KILN_DTYPE_F16, H, H),
                o16 = t2(bo, 0, KILN_DTYPE_F16, 100, H);
    kiln_tensor xb = t2(bx, 0, B, 100, H), wb = t2(bw, 0, B, H, H), ob = t2(bo, 0, B, 100, H);
    kiln_command *cmd;
    KILN_CHECK(kiln_op_dense_linear_encode(jit, &x16, &w16, NULL, &o16, &ws, &cmd));
    kiln_command_release(cmd);
    kiln__blas_cache_counters(&q0, &h0);
    KILN_CHECK(kiln_op_dense_linear_encode(jit, &xb, &wb, NULL, &ob, &ws, &cmd));
    kiln_command_release(cmd);
    kiln__blas_cache_counters(&q1, &h1);
    KILN_CHECK(kiln_op_dense_linear_encode(jit, &xb, &wb, NULL, &ob, &ws, &cmd));
    kiln_command_release(cmd);
    kiln__blas_cache_counters(&q2, &h2);
    assert_int_equal(q1, q0 + 1); /* bf16: its own plan */
    assert_int_equal(h1, h0);
    assert_int_equal(q2, q1); /* and then served from the cache */
    assert_int_equal(h2, h1 + 1);
    kiln_buffer *bufs[] = {bw, bx, bo, bws, bs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        kiln_buffer_destroy(bufs[i]);
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
}

static int teardown_candidates(void **state)
{
    kiln__blas_force_candidate(-1); /* a failed check leaves it set */
    unsetenv("KILN_SKINNY");
    return gpu_fixture_teardown(state);
}

int main(void)
{
    kiln_test_require_gpu();
    kiln_test_filter();
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, gpu_fixture_teardown)
    const struct CMUnitTest tests[] = {
        T(test_linear),
        T(test_few_tokens_take_the_skinny_kernel),
        cmocka_unit_test_setup_teardown(test_linear_every_candidate, setup, teardown_candidates),
        T(test_swiglu),
        cmocka_unit_test_setup_teardown(test_linear_norm, setup, teardown_linear_norm),
        T(test_last_token_linear),
        T(test_replayed_batch_reads_spans_from_device),
        T(test_bad_spans_are_reported_not_read),
        T(test_bad_bindings_are_refused_before_launch),
        T(test_prewarmed_model_compiles_nothing),
        T(test_prewarmed_bf16_model_compiles_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
