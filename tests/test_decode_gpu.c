/* examples/decode on the GPU: tiny Llama (GQA), Qwen2 (tied, q/k/v biases)
 * and Qwen3 (q/k norms; head_dim 128, heads * head_dim != hidden)
 * checkpoints written here with random weights, decoded as one batch of prompts of different lengths and limits, and checked against the
 * same prompts decoded one at a time (tokens identical but at near ties of
 * the single run's logits; last-position logits within 2e-2 relative); an
 * EOS stops its participant while the others go on; a second jit on the same
 * database compiles nothing; bad requests are refused. transformers is the
 * reference in examples/decode/check.py; this test needs no Python. */
#include <math.h>
#include <sys/stat.h>

#include "gpu_fixture.h"
#include "decoder.h"
#include "f16_host.h"
#include "st_writer.h"

#define NP 3
#define MAXN 24
#define TOL 2e-2
#define TIE 0.02 /* a top-2 gap below this many standard deviations is a near tie */

#define N_MODELS 3
static const tiny_model MODELS[N_MODELS] = {
    {"llama", 0, 512, 128, 256, 2, 2, 1, 64, 10000.0, 0.12f, 11},
    {"qwen2", 1, 768, 256, 512, 2, 4, 2, 64, 1e6, 0.08f, 13},
    {"qwen3", 0, 640, 256, 512, 2, 4, 2, 128, 1e6, 0.08f, 17},
};

typedef struct capture {
    int64_t vocab;
    float *rows; /* [NP][MAXN][vocab] */
    int seen[NP][MAXN];
    uint32_t remap[NP]; /* participant index -> slot here */
} capture;

static void on_logits(void *user, uint32_t p, uint32_t step, const uint16_t *l, size_t vocab)
{
    capture *c = user;
    assert_int_equal(vocab, c->vocab);
    assert_true(p < NP && step < MAXN);
    uint32_t slot = c->remap[p];
    for (size_t i = 0; i < vocab; i++)
        c->rows[((size_t)slot * MAXN + step) * vocab + i] = h2f(l[i]);
    c->seen[slot][step] = 1;
}

static const float *row(const capture *c, uint32_t slot, uint32_t step)
{
    return c->rows + ((size_t)slot * MAXN + step) * c->vocab;
}

/* (top1 - top2) / std of a logits row. */
static double gap(const float *r, int64_t v)
{
    double a = -INFINITY, b = -INFINITY, s = 0, s2 = 0;
    for (int64_t i = 0; i < v; i++) {
        double x = r[i];
        if (x > a) {
            b = a;
            a = x;
        } else if (x > b)
            b = x;
        s += x;
        s2 += x * x;
    }
    double var = s2 / (double)v - (s / (double)v) * (s / (double)v);
    return (a - b) / sqrt(var > 0 ? var : 1e-30);
}

static double rel_err(const float *got, const float *ref, int64_t v)
{
    double d = 0, m = 0;
    for (int64_t i = 0; i < v; i++) {
        d = fmax(d, fabs((double)got[i] - ref[i]));
        m = fmax(m, fabs((double)ref[i]));
    }
    return d / (m > 0 ? m : 1);
}

typedef struct run {
    uint32_t tokens[NP][MAXN];
    dec_result res[NP];
    dec_stats stats;
} run;

static void generate(dec_engine *e, const dec_request *reqs, size_t n, const int64_t *eos, size_t n_eos,
                     capture *cap, run *r)
{
    for (size_t i = 0; i < n; i++)
        r->res[i].tokens = r->tokens[i];
    kiln_status st = dec_generate(e, reqs, n, eos, n_eos, cap ? on_logits : NULL, cap, r->res, &r->stats);
    if (st)
        fail_msg("dec_generate: %s: %s", kiln_status_code(st), dec_errmsg());
}

/* Tokens of a against reference b (and its logits): identical until the
 * reference's gap says near tie; logits within TOL on the compared steps.
 * 1: every token compared; 0: stopped at a near tie. */
static int compare(const char *what, const dec_result *a, const capture *ca, uint32_t sa, const dec_result *b,
                    const capture *cb, uint32_t sb, uint32_t n)
{
    for (uint32_t s = 0; s < n; s++) {
        if (ca && cb) {
            double e = rel_err(row(ca, sa, s), row(cb, sb, s), ca->vocab);
            if (e > TOL)
                fail_msg("%s: step %u: logits differ by %.3g relative", what, s, e);
        }
        if (a->tokens[s] != b->tokens[s]) {
            double g = cb ? gap(row(cb, sb, s), cb->vocab) : 0;
            if (!cb || g >= TIE)
                fail_msg("%s: token %u: %u, reference %u (reference gap %.4f std)", what, s, a->tokens[s],
                         b->tokens[s], g);
            fprintf(stderr, "%s: near tie at token %u (gap %.4f std): compared up to there\n", what, s, g);
            return 0;
        }
    }
    return 1;
}

static void test_decode(void **state)
{
    gpu_fixture *f = *state;
    for (int mi = 0; mi < N_MODELS; mi++) {
        const tiny_model *tm = &MODELS[mi];
        char dir[700];
        snprintf(dir, sizeof dir, "%s/%s", f->dir, tm->type);
        assert_int_equal(mkdir(dir, 0700), 0);
        assert_true(tiny_write(tm, dir));
        dec_checkpoint ck;
        dec_model *m;
        kiln_status st = dec_checkpoint_open(dir, &ck);
        if (st)
            fail_msg("open: %s", dec_errmsg());
        if ((st = dec_model_load(f->rt, &ck, &m)))
            fail_msg("load: %s", dec_errmsg());
        const uint32_t lens[NP] = {3, 41, 300}, limits[NP] = {MAXN, 17, 9};
        uint32_t *prompts[NP];
        dec_request reqs[NP];
        uint32_t total = 0;
        for (int p = 0; p < NP; p++) {
            prompts[p] = malloc(lens[p] * 4);
            for (uint32_t t = 0; t < lens[p]; t++)
                prompts[p][t] = 3 + kiln_rng_below(&f->rng, (uint32_t)tm->vocab - 3);
            reqs[p] = (dec_request){prompts[p], lens[p], limits[p]};
            total += lens[p];
        }
        dec_engine_options eo = {.max_participants = NP, .max_prefill_tokens = total, .max_seq_tokens = 300 + MAXN};
        dec_engine *e;
        if ((st = dec_engine_create(f->jit, f->s, m, &eo, &e)))
            fail_msg("engine: %s", dec_errmsg());
        capture cb = {.vocab = tm->vocab, .rows = calloc((size_t)NP * MAXN * tm->vocab, 4), .remap = {0, 1, 2}};
        capture cs = {.vocab = tm->vocab, .rows = calloc((size_t)NP * MAXN * tm->vocab, 4)};
        run *batch = calloc(1, sizeof *batch), *single = calloc(NP, sizeof *single), *eosr = calloc(1, sizeof *eosr);
        generate(e, reqs, NP, NULL, 0, &cb, batch);
        for (int p = 0; p < NP; p++) {
            assert_int_equal(batch->res[p].n, limits[p]);
            assert_false(batch->res[p].stopped_at_eos);
            for (uint32_t s = 0; s < limits[p]; s++) {
                assert_true(batch->res[p].tokens[s] < (uint32_t)tm->vocab);
                assert_true(cb.seen[p][s]);
            }
        }
        assert_int_equal(batch->stats.prefill_tokens, total);
        assert_int_equal(batch->stats.decode_steps, MAXN - 1);
        assert_int_equal(batch->stats.decode_tokens, (MAXN - 1) + (17 - 1) + (9 - 1));
        /* Each prompt alone. */
        for (int p = 0; p < NP; p++) {
            cs.remap[0] = (uint32_t)p;
            generate(e, &reqs[p], 1, NULL, 0, &cs, &single[p]);
            char what[64];
            snprintf(what, sizeof what, "%s participant %d, batch vs alone", tm->type, p);
            compare(what, &batch->res[p], &cb, (uint32_t)p, &single[p].res[0], &cs, (uint32_t)p, limits[p]);
        }
        /* EOS: participant 0's token 4 (when it is new there) stops it at 5 tokens. */
        const uint32_t *t0 = batch->res[0].tokens;
        int fresh = 1;
        for (int s = 0; s < 4; s++)
            fresh &= t0[s] != t0[4];
        if (fresh) {
            const int64_t eos = t0[4];
            generate(e, reqs, NP, &eos, 1, NULL, eosr);
            assert_int_equal(eosr->res[0].n, 5);
            assert_true(eosr->res[0].stopped_at_eos);
            for (int p = 1; p < NP; p++) {
                uint32_t want = limits[p];
                for (uint32_t s = 0; s < limits[p]; s++)
                    if (batch->res[p].tokens[s] == (uint32_t)eos) {
                        want = s + 1;
                        break;
                    }
                char what[64];
                snprintf(what, sizeof what, "%s participant %d, EOS run", tm->type, p);
                uint32_t n = eosr->res[p].n < want ? eosr->res[p].n : want;
                if (compare(what, &eosr->res[p], NULL, 0, &batch->res[p], &cb, (uint32_t)p, n) &&
                    (eosr->res[p].n != want || eosr->res[p].stopped_at_eos != (want < limits[p] ||
                                                                              batch->res[p].tokens[want - 1] == (uint32_t)eos)))
                    fail_msg("participant %d with EOS %lld: %u tokens, want %u", p, (long long)eos,
                             eosr->res[p].n, want);
            }
        } else {
            fprintf(stderr, "%s: EOS check skipped (token 4 repeats an earlier one)\n", tm->type);
        }
        /* Bad requests. */
        uint32_t bad_ids[2] = {1, (uint32_t)tm->vocab};
        dec_request bad = {bad_ids, 2, 4};
        dec_result br = {.tokens = batch->tokens[0]};
        assert_int_equal(dec_generate(e, &bad, 1, NULL, 0, NULL, NULL, &br, NULL), KILN_ERR_INVALID_ARGUMENT);
        assert_non_null(strstr(dec_errmsg(), "past the vocabulary"));
        dec_request four[4] = {reqs[0], reqs[0], reqs[0], reqs[0]};
        dec_result fr[4];
        assert_int_equal(dec_generate(e, four, 4, NULL, 0, NULL, NULL, fr, NULL), KILN_ERR_INVALID_ARGUMENT);
        dec_request longp = {prompts[2], 300, MAXN + 2};
        assert_int_equal(dec_generate(e, &longp, 1, NULL, 0, NULL, NULL, &br, NULL), KILN_ERR_INVALID_ARGUMENT);
        dec_engine_free(e);

        /* A second jit on the same database: nothing to compile. */
        kiln_jit *j2;
        kiln_jit_options jo = {.cache = f->cache, .runtime = f->rt};
        KILN_CHECK(kiln_jit_create(&jo, &j2));
        if ((st = dec_engine_create(j2, f->s, m, &eo, &e)))
            fail_msg("engine 2: %s", dec_errmsg());
        run *again = calloc(1, sizeof *again);
        generate(e, reqs, NP, NULL, 0, NULL, again);
        kiln_jit_counters jc;
        kiln_jit_get_counters(j2, &jc);
        assert_int_equal(jc.compiles, 0);
        assert_true(jc.database_hits > 0);
        for (int p = 0; p < NP; p++)
            assert_memory_equal(again->res[p].tokens, batch->res[p].tokens, limits[p] * 4);
        dec_engine_free(e);
        kiln_jit_destroy(j2);
        free(again);
        free(batch);
        free(single);
        free(eosr);
        free(cb.rows);
        free(cs.rows);
        for (int p = 0; p < NP; p++)
            free(prompts[p]);
        dec_model_free(m);
        dec_checkpoint_close(&ck);
    }
}

int main(void)
{
    kiln_test_require_gpu();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_decode, gpu_fixture_setup, gpu_fixture_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
