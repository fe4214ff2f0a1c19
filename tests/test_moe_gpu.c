/* The MoE router on the GPU, in f16 and bf16: fresh random logits each run
 * (with planted exact ties, -inf and a NaN row), the outputs poisoned first,
 * every id and weight checked against a float64 host reference of the
 * contract (include/kiln/op_moe.h: softmax over the experts, the top k by
 * probability with the lower expert on ties, renormalized or not), at the
 * sizes of Mixtral, Qwen2-MoE, Qwen3-MoE, the limits and odd ones, 1 to
 * 1000 tokens; the command replayed. */
#include <math.h>

#include "f16_host.h"
#include "gpu_fixture.h"
#include "testutil.h"

typedef gpu_fixture fixture;

static kiln_buffer *buffer(kiln_runtime *rt, size_t bytes)
{
    kiln_buffer *b;
    KILN_CHECK(kiln_buffer_create(rt, bytes, 256, &b));
    return b;
}

static float to_f32(int bf16, uint16_t h) { return bf16 ? kiln_test_bf16_to_f32(h) : h2f(h); }
static uint16_t from_f32(int bf16, float x) { return bf16 ? kiln_test_bf16_from_f32(x) : f2h(x); }

/* Whether (va, ia) ranks before (vb, ib): the greater, then the lower expert; NaN last. */
static int ranks_before(double va, uint32_t ia, double vb, uint32_t ib)
{
    if (isnan(va) != isnan(vb))
        return isnan(vb);
    if (!isnan(va) && va != vb)
        return va > vb;
    return ia < ib;
}

static void check_case(fixture *f, int bf16, uint32_t E, uint32_t K, int norm, uint32_t T)
{
    const size_t n = (size_t)T * E;
    uint16_t *lg = malloc(n * 2);
    uint32_t *ids = malloc((size_t)T * K * 4);
    float *w = malloc((size_t)T * K * 4);
    assert_true(lg && ids && w);
    for (uint32_t t = 0; t < T; t++) {
        uint16_t *row = lg + (size_t)t * E;
        for (uint32_t e = 0; e < E; e++)
            row[e] = from_f32(bf16, (float)(8.0 * (double)(kiln_rng_next(&f->rng) >> 11) * ldexp(1, -53) - 4.0));
        if (t % 5 == 0) { /* exact ties at the top, among the rest */
            uint16_t top = row[0];
            for (uint32_t e = 1; e < E; e++)
                if (to_f32(bf16, row[e]) > to_f32(bf16, top))
                    top = row[e];
            for (uint32_t j = 0; j < 3 && E > 1; j++)
                row[kiln_rng_below(&f->rng, E)] = top;
        }
        if (t % 7 == 3)
            for (uint32_t j = 0; j < E / 2; j++)
                row[kiln_rng_below(&f->rng, E)] = row[kiln_rng_below(&f->rng, E)];
        if (t % 11 == 4 && E > K) /* experts no token may take, but for the count */
            row[kiln_rng_below(&f->rng, E)] = bf16 ? 0xff80 : 0xfc00;
    }
    const uint32_t nan_row = T > 2 ? 2 : UINT32_MAX;
    if (nan_row != UINT32_MAX)
        lg[(size_t)nan_row * E + kiln_rng_below(&f->rng, E)] = bf16 ? 0x7fc0 : 0x7e00;
    kiln_buffer *bl = buffer(f->rt, n * 2), *bi = buffer(f->rt, (size_t)T * K * 4), *bw = buffer(f->rt, (size_t)T * K * 4);
    KILN_CHECK(kiln_buffer_upload(bl, 0, lg, n * 2));
    KILN_CHECK(kiln_buffer_fill(bi, 0, 0xff, (size_t)T * K * 4));
    KILN_CHECK(kiln_buffer_fill(bw, 0, 0xff, (size_t)T * K * 4)); /* NaN */
    const kiln_dtype elt = bf16 ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
    kiln_tensor tl = {.buffer = bl, .dtype = elt, .rank = 2, .dims = {T, E}},
                ti = {.buffer = bi, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {T, K}},
                tw = {.buffer = bw, .dtype = KILN_DTYPE_F32, .rank = 2, .dims = {T, K}};
    kiln_moe_router_desc d = {.size = sizeof d, .logits = &tl, .ids = &ti, .weights = &tw, .top_k = K,
                              .normalize = norm};
    kiln_command *cmd;
    KILN_CHECK(kiln_op_moe_router_encode(f->jit, &d, &cmd));
    assert_true(kiln_command_replayable(cmd));
    KILN_CHECK(kiln_stream_submit(f->s, &cmd, 1, NULL, NULL));
    KILN_CHECK(kiln_stream_synchronize(f->s));
    kiln_command_release(cmd);
    KILN_CHECK(kiln_buffer_readback(bi, 0, ids, (size_t)T * K * 4));
    KILN_CHECK(kiln_buffer_readback(bw, 0, w, (size_t)T * K * 4));

    uint32_t *order = malloc((size_t)E * 4);
    double *p = malloc((size_t)E * sizeof *p);
    assert_true(order && p);
    size_t wrong = 0;
    double worst = 0;
    for (uint32_t t = 0; t < T; t++) {
        const uint16_t *row = lg + (size_t)t * E;
        const uint32_t *gi = ids + (size_t)t * K;
        const float *gw = w + (size_t)t * K;
        if (t == nan_row) { /* every weight NaN; the ids still distinct experts */
            for (uint32_t r = 0; r < K; r++) {
                if (gi[r] >= E || !isnan(gw[r]))
                    wrong++;
                for (uint32_t q = 0; q < r; q++)
                    wrong += gi[q] == gi[r];
            }
            continue;
        }
        double m = -INFINITY, s = 0;
        for (uint32_t e = 0; e < E; e++)
            m = fmax(m, (double)to_f32(bf16, row[e]));
        for (uint32_t e = 0; e < E; e++)
            s += (p[e] = exp((double)to_f32(bf16, row[e]) - m));
        for (uint32_t e = 0; e < E; e++) {
            p[e] /= s;
            order[e] = e;
        }
        for (uint32_t i = 1; i < E; i++) /* insertion sort by rank */
            for (uint32_t j = i; j > 0 && ranks_before(p[order[j]], order[j], p[order[j - 1]], order[j - 1]); j--) {
                const uint32_t x = order[j];
                order[j] = order[j - 1];
                order[j - 1] = x;
            }
        double sum = 0;
        for (uint32_t r = 0; r < K; r++)
            sum += p[order[r]];
        for (uint32_t r = 0; r < K; r++) {
            const double want = norm ? p[order[r]] / sum : p[order[r]];
            const double e = isfinite(gw[r]) ? fabs(gw[r] - want) / fmax(want, 1e-30) : INFINITY;
            worst = fmax(worst, gi[r] == order[r] ? e : INFINITY);
            if ((gi[r] != order[r] || e > 1e-5) && wrong++ < 5)
                fprintf(stderr, "E %u K %u T %u token %u choice %u: got expert %u weight %.9g, want %u %.9g\n", E, K, T,
                        t, r, gi[r], (double)gw[r], order[r], want);
        }
    }
    fprintf(stderr, "moe_router %s E %u K %u normalize %d T %u: %u outputs, max rel err %.3g\n", bf16 ? "bf16" : "f16",
            E, K, norm, T, T * K, worst);
    if (wrong)
        fail_msg("moe_router %s E %u K %u T %u: %zu outputs wrong", bf16 ? "bf16" : "f16", E, K, T, wrong);
    kiln_buffer_destroy(bl);
    kiln_buffer_destroy(bi);
    kiln_buffer_destroy(bw);
    free(order);
    free(p);
    free(lg);
    free(ids);
    free(w);
}

static void test_router_against_float64(void **state)
{
    fixture *f = *state;
    static const struct { uint32_t e, k; int norm; } sizes[] = {{8, 2, 1}, {60, 4, 0}, {128, 8, 1}, {512, 16, 0},
                                                               {1, 1, 0}, {33, 16, 1}, {256, 8, 1}};
    static const uint32_t tokens[] = {1, 7, 300, 1000};
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
            for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++)
                check_case(f, b, sizes[i].e, sizes[i].k, sizes[i].norm, tokens[t]);
}

int main(void)
{
    kiln_test_require_gpu();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_router_against_float64, gpu_fixture_setup, gpu_fixture_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
