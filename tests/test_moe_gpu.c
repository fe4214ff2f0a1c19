/* The MoE router and routed experts on the GPU, in f16 and bf16.
 * Router: fresh random logits each run (with planted exact ties, -inf and a
 * NaN row), the outputs poisoned first, every id and weight checked against a
 * float64 host reference of the contract (include/kiln/op_moe.h: softmax over
 * the experts, the top k by probability with the lower expert on ties,
 * renormalized or not), at the sizes of Mixtral, Qwen2-MoE, Qwen3-MoE, the
 * limits and odd ones, 1 to 1000 tokens; the command replayed.
 * Experts: fresh random tokens, routing and weights each run, out and the
 * workspace poisoned first (and guarded past their ends), every element
 * against a float64 reference of the contract at decode and prefill tile
 * sizes, one expert set for every token, the shared expert with and without
 * its gate; out-of-range ids reported with their slot adding nothing; one
 * command replayed from a graph over new routings; bad bindings refused;
 * on sm_90 prefill-sized checks through the wgmma products and, with
 * KILN_MOE_WGMMA=0, through the 64-row mma.sync tiles sm_80 to sm_120 run. */
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

/* ---- routed experts ---- */

/* Bytes past out and past the workspace, poisoned and checked untouched. */
#define GUARD 4096u
/* A device-found bad id comes back as the runtime's fault record reports
 * every kernel's bad data (kiln_stream_synchronize in kiln/runtime.h). */
#define BAD_ID_STATUS KILN_ERR_DEVICE_CONTRACT

typedef struct moe_case {
    uint32_t T, H, I, E, K;
    int shared, gate; /* the shared expert's output added; gated by sigmoid(x · shared_gate) */
} moe_case;

typedef struct moe {
    kiln_runtime *rt;
    moe_case c;
    int bf16;
    uint16_t *x, *gu, *dn, *sh, *sg, *out; /* host copies */
    uint32_t *ids;
    float *w, *gu_f, *dn_f; /* gate_up and down decoded, for the reference */
    kiln_buffer *bx, *bi, *bw, *bgu, *bdn, *bsh, *bsg, *bo, *bws;
    kiln_tensor x_t, ids_t, w_t, gu_t, dn_t, sh_t, sg_t, out_t;
    kiln_region ws;
    size_t ws_bytes;
    kiln_moe_experts_desc d;
} moe;

static double round_elt(int bf16, double v) { return to_f32(bf16, from_f32(bf16, (float)v)); }

/* n elements uniform in [-a, a), rounded to the element type. */
static void fill_elt(kiln_rng *r, int bf16, uint16_t *p, size_t n, double a)
{
    for (size_t i = 0; i < n; i++)
        p[i] = from_f32(bf16, (float)kiln_rng_uniform(r, -a, a));
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    assert_non_null(p);
    return p;
}

static void upload(kiln_buffer *b, const void *src, size_t bytes) { KILN_CHECK(kiln_buffer_upload(b, 0, src, bytes)); }

/* Host data and device bindings for c, a workspace for ws_tokens tokens;
 * the routing is left to moe_route. Values stay O(1): x in ±1, each weight
 * matrix in ±2/sqrt(its fan-in). */
static void moe_make(fixture *f, int bf16, const moe_case *c, uint32_t ws_tokens, moe *m)
{
    memset(m, 0, sizeof *m);
    m->rt = f->rt;
    m->c = *c;
    m->bf16 = bf16;
    const uint32_t T = c->T, H = c->H, I = c->I, E = c->E, K = c->K;
    const size_t nx = (size_t)T * H, ngu = (size_t)E * 2 * I * H, ndn = (size_t)E * H * I, np = (size_t)T * K;
    m->x = xmalloc(nx * 2);
    m->gu = xmalloc(ngu * 2);
    m->dn = xmalloc(ndn * 2);
    m->out = xmalloc(nx * 2 + GUARD);
    m->ids = xmalloc(np * 4);
    m->w = xmalloc(np * 4);
    m->gu_f = xmalloc(ngu * sizeof(float));
    m->dn_f = xmalloc(ndn * sizeof(float));
    fill_elt(&f->rng, bf16, m->x, nx, 1.0);
    fill_elt(&f->rng, bf16, m->gu, ngu, 2.0 / sqrt((double)H));
    fill_elt(&f->rng, bf16, m->dn, ndn, 2.0 / sqrt((double)I));
    for (size_t i = 0; i < ngu; i++)
        m->gu_f[i] = to_f32(bf16, m->gu[i]);
    for (size_t i = 0; i < ndn; i++)
        m->dn_f[i] = to_f32(bf16, m->dn[i]);
    const kiln_dtype elt = bf16 ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
    m->bx = buffer(f->rt, nx * 2);
    m->bi = buffer(f->rt, np * 4);
    m->bw = buffer(f->rt, np * 4);
    m->bgu = buffer(f->rt, ngu * 2);
    m->bdn = buffer(f->rt, ndn * 2);
    m->bo = buffer(f->rt, nx * 2 + GUARD);
    upload(m->bx, m->x, nx * 2);
    upload(m->bgu, m->gu, ngu * 2);
    upload(m->bdn, m->dn, ndn * 2);
    m->x_t = (kiln_tensor){.buffer = m->bx, .dtype = elt, .rank = 2, .dims = {T, H}};
    m->ids_t = (kiln_tensor){.buffer = m->bi, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {T, K}};
    m->w_t = (kiln_tensor){.buffer = m->bw, .dtype = KILN_DTYPE_F32, .rank = 2, .dims = {T, K}};
    m->gu_t = (kiln_tensor){.buffer = m->bgu, .dtype = elt, .rank = 3, .dims = {E, 2 * I, H}};
    m->dn_t = (kiln_tensor){.buffer = m->bdn, .dtype = elt, .rank = 3, .dims = {E, H, I}};
    m->out_t = (kiln_tensor){.buffer = m->bo, .dtype = elt, .rank = 2, .dims = {T, H}};
    m->d = (kiln_moe_experts_desc){.size = sizeof m->d, .x = &m->x_t, .ids = &m->ids_t, .weights = &m->w_t,
                                   .gate_up = &m->gu_t, .down = &m->dn_t, .out = &m->out_t, .workspace = &m->ws};
    if (c->shared) {
        m->sh = xmalloc(nx * 2);
        fill_elt(&f->rng, bf16, m->sh, nx, 0.5);
        m->bsh = buffer(f->rt, nx * 2);
        upload(m->bsh, m->sh, nx * 2);
        m->sh_t = (kiln_tensor){.buffer = m->bsh, .dtype = elt, .rank = 2, .dims = {T, H}};
        m->d.shared = &m->sh_t;
    }
    if (c->gate) {
        m->sg = xmalloc((size_t)H * 2);
        fill_elt(&f->rng, bf16, m->sg, H, 2.0 / sqrt((double)H));
        m->bsg = buffer(f->rt, (size_t)H * 2);
        upload(m->bsg, m->sg, (size_t)H * 2);
        m->sg_t = (kiln_tensor){.buffer = m->bsg, .dtype = elt, .rank = 1, .dims = {H}};
        m->d.shared_gate = &m->sg_t;
    }
    KILN_CHECK(kiln_op_moe_experts_workspace(ws_tokens, H, I, E, K, &m->ws_bytes));
    assert_true(m->ws_bytes > 0);
    m->bws = buffer(f->rt, m->ws_bytes + GUARD);
    m->ws = (kiln_region){m->bws, 0, m->ws_bytes};
}

static void moe_free(moe *m)
{
    kiln_buffer *b[] = {m->bx, m->bi, m->bw, m->bgu, m->bdn, m->bsh, m->bsg, m->bo, m->bws};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++)
        kiln_buffer_destroy(b[i]);
    void *p[] = {m->x, m->gu, m->dn, m->sh, m->sg, m->out, m->ids, m->w, m->gu_f, m->dn_f};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
}

/* A fresh routing, uploaded: each token's K distinct experts drawn from the
 * first pool of a random permutation of the experts (pool E: anywhere; pool
 * K: every token the same experts, in its own order), weights in [0.05, 1). */
static void moe_route(kiln_rng *r, moe *m, uint32_t pool)
{
    const uint32_t E = m->c.E, K = m->c.K;
    assert_true(pool >= K && pool <= E);
    uint32_t *perm = xmalloc((size_t)E * 4), *mine = xmalloc((size_t)pool * 4);
    for (uint32_t e = 0; e < E; e++)
        perm[e] = e;
    for (uint32_t e = E; e > 1; e--) {
        const uint32_t j = kiln_rng_below(r, e), v = perm[e - 1];
        perm[e - 1] = perm[j];
        perm[j] = v;
    }
    for (uint32_t t = 0; t < m->c.T; t++) {
        memcpy(mine, perm, (size_t)pool * 4);
        for (uint32_t s = 0; s < K; s++) { /* a partial Fisher-Yates shuffle of the pool */
            const uint32_t j = s + kiln_rng_below(r, pool - s), v = mine[s];
            mine[s] = mine[j];
            mine[j] = v;
            m->ids[(size_t)t * K + s] = mine[s];
            m->w[(size_t)t * K + s] = (float)kiln_rng_uniform(r, 0.05, 1.0);
        }
    }
    upload(m->bi, m->ids, (size_t)m->c.T * K * 4);
    upload(m->bw, m->w, (size_t)m->c.T * K * 4);
    free(perm);
    free(mine);
}

/* out and the workspace, guards included, all 0xff bytes (a NaN in f16 and
 * bf16): the kernel may assume nothing of the workspace's contents. */
static void moe_poison(moe *m)
{
    KILN_CHECK(kiln_buffer_fill(m->bo, 0, 0xff, (size_t)m->c.T * m->c.H * 2 + GUARD));
    KILN_CHECK(kiln_buffer_fill(m->bws, 0, 0xff, m->ws_bytes + GUARD));
    KILN_CHECK(kiln_runtime_synchronize(m->rt)); /* the fills ran on the runtime's stream */
}

static double dot_df(const double *a, const float *b, uint32_t n)
{
    double s = 0;
    for (uint32_t i = 0; i < n; i++)
        s += a[i] * (double)b[i];
    return s;
}

static void moe_label(const moe *m, char *buf, size_t cap, const char *what)
{
    snprintf(buf, cap, "moe_experts %s %s T %u H %u I %u E %u K %u%s%s", what, m->bf16 ? "bf16" : "f16", m->c.T,
             m->c.H, m->c.I, m->c.E, m->c.K, m->c.shared ? " shared" : "", m->c.gate ? " gated" : "");
}

/* Reads out back and compares every element with the float64 reference of
 * the contract (a slot whose id is at or past experts adds nothing); checks
 * the guards; returns the count of elements and rows out of bounds. The
 * bound of an element is rtol · (|want| + Σ|w·y| + |c·shared| + 0.25 · that
 * sum's RMS over the token's row): the kernel sums in f32 in its own order,
 * so a rounding of y may land one ulp (2^-7 of it at most, in bf16) from the
 * reference's and the final rounding may too, which stays under 0.4 of the
 * bound; a flipped rounding of h moves near-cancelling sums, hence the
 * floor. Each token's row also as a whole: its RMS error under row_tol of
 * its RMS (a few flipped roundings are a fraction of an ulp there; a slot
 * left out, even of weight 0.05 among 16, is 2% or more). */
static size_t moe_check(moe *m, const char *what)
{
    const int bf16 = m->bf16;
    const uint32_t T = m->c.T, H = m->c.H, I = m->c.I, E = m->c.E, K = m->c.K;
    const double rtol = bf16 ? 2e-2 : 1e-2, row_tol = bf16 ? 1.5e-2 : 5e-3;
    const size_t nx = (size_t)T * H;
    char label[160];
    moe_label(m, label, sizeof label, what);
    KILN_CHECK(kiln_buffer_readback(m->bo, 0, m->out, nx * 2 + GUARD));
    for (size_t i = nx * 2; i < nx * 2 + GUARD; i++)
        if (((uint8_t *)m->out)[i] != 0xff)
            fail_msg("%s: out's guard byte %zu past the end written", label, i - nx * 2);
    uint8_t *guard = xmalloc(GUARD);
    KILN_CHECK(kiln_buffer_readback(m->bws, m->ws_bytes, guard, GUARD));
    for (size_t i = 0; i < GUARD; i++)
        if (guard[i] != 0xff)
            fail_msg("%s: the workspace's guard byte %zu past its %zu bytes written", label, i, m->ws_bytes);
    free(guard);
    double *xr = xmalloc((size_t)H * sizeof(double)), *g = xmalloc((size_t)2 * I * sizeof(double)),
           *h = xmalloc((size_t)I * sizeof(double)), *acc = xmalloc((size_t)H * sizeof(double)),
           *mag = xmalloc((size_t)H * sizeof(double)), *sg = NULL;
    if (m->sg) {
        sg = xmalloc((size_t)H * sizeof(double));
        for (uint32_t j = 0; j < H; j++)
            sg[j] = to_f32(bf16, m->sg[j]);
    }
    size_t wrong = 0;
    double worst = -1, worst_err = 0, worst_want = 0, worst_got = 0, worst_row = 0;
    uint32_t worst_t = 0, worst_j = 0, worst_row_t = 0;
    for (uint32_t t = 0; t < T; t++) {
        for (uint32_t j = 0; j < H; j++) {
            xr[j] = to_f32(bf16, m->x[(size_t)t * H + j]);
            acc[j] = mag[j] = 0;
        }
        for (uint32_t s = 0; s < K; s++) {
            const uint32_t e = m->ids[(size_t)t * K + s];
            const double w = m->w[(size_t)t * K + s];
            if (e >= E)
                continue;
            const float *gu = m->gu_f + (size_t)e * 2 * I * H, *dn = m->dn_f + (size_t)e * H * I;
            for (uint32_t i = 0; i < 2 * I; i++)
                g[i] = dot_df(xr, gu + (size_t)i * H, H);
            for (uint32_t i = 0; i < I; i++)
                h[i] = round_elt(bf16, g[i] / (1 + exp(-g[i])) * g[I + i]);
            for (uint32_t j = 0; j < H; j++) {
                const double y = round_elt(bf16, dot_df(h, dn + (size_t)j * I, I));
                acc[j] += w * y;
                mag[j] += fabs(w * y);
            }
        }
        double cgate = 1;
        if (sg) {
            double z = 0;
            for (uint32_t j = 0; j < H; j++)
                z += xr[j] * sg[j];
            cgate = 1 / (1 + exp(-z));
        }
        if (m->sh)
            for (uint32_t j = 0; j < H; j++) {
                const double v = cgate * to_f32(bf16, m->sh[(size_t)t * H + j]);
                acc[j] += v;
                mag[j] += fabs(v);
            }
        double rms = 0;
        for (uint32_t j = 0; j < H; j++)
            rms += mag[j] * mag[j];
        rms = sqrt(rms / H);
        double err2 = 0, want2 = 0;
        for (uint32_t j = 0; j < H; j++) {
            const double want = round_elt(bf16, acc[j]), got = to_f32(bf16, m->out[(size_t)t * H + j]);
            err2 += (got - want) * (got - want);
            want2 += want * want;
            const double err = fabs(got - want), bound = rtol * (fabs(want) + mag[j] + 0.25 * rms);
            const double ratio = !isfinite(got) ? INFINITY : err == 0 ? 0 : err / bound;
            if (ratio > worst) {
                worst = ratio;
                worst_err = err;
                worst_want = want;
                worst_got = got;
                worst_t = t;
                worst_j = j;
            }
            if (!(ratio <= 1) && wrong++ < 5)
                fprintf(stderr, "%s: out[%u, %u] = %.6g, want %.6g (bound %.3g)\n", label, t, j, got, want, bound);
        }
        const double row = want2 > 0 ? sqrt(err2 / want2) : sqrt(err2);
        if (!(row <= worst_row)) {
            worst_row = row;
            worst_row_t = t;
        }
        if (!(row <= row_tol) && wrong++ < 5)
            fprintf(stderr, "%s: token %u's row off by %.3g of its RMS (at most %.3g)\n", label, t, row, row_tol);
    }
    fprintf(stderr,
            "%s: %zu outputs, worst |err| %.3g at [%u, %u] (want %.6g, got %.6g), %.3g of its bound; worst row "
            "%u, %.3g of its RMS\n",
            label, nx, worst_err, worst_t, worst_j, worst_want, worst_got, worst, worst_row_t, worst_row);
    free(xr);
    free(g);
    free(h);
    free(acc);
    free(mag);
    free(sg);
    return wrong;
}

static void moe_expect_right(moe *m, const char *what)
{
    const size_t wrong = moe_check(m, what);
    if (wrong) {
        char label[160];
        moe_label(m, label, sizeof label, what);
        fail_msg("%s: %zu outputs or rows out of bounds", label, wrong);
    }
}

/* The launches of a command of T tokens of top_k K: on sm_90 for at most 8
 * tokens and 16 pairs (64 with KILN_MOE_TMA=1; none with KILN_MOE_TMA=0),
 * the TMA decode products and the combine; else the group (after the count,
 * past 2048 pairs), the two products and the combine. */
static uint32_t moe_dispatches(fixture *f, uint32_t tokens, uint32_t top_k)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    const char *env = getenv("KILN_MOE_TMA");
    const uint32_t most = env && !strcmp(env, "1") ? 64 : 16;
    const int tma = !strcmp(info.arch, "sm_90") && tokens <= 8 && tokens * top_k <= most && (!env || strcmp(env, "0"));
    return tma ? 3 : tokens * top_k > 2048 ? 5 : 4; /* kiln_moe_count past 2048 pairs */
}

/* Replays cmd (encoded for m) once per pool, each time over a new routing
 * of experts drawn from the first pools[r]: the attribution (op, tokens,
 * dispatches) and every output checked, each run labelled label r. */
static void replay_right(fixture *f, moe *m, kiln_command *cmd, const uint32_t *pools, size_t n, const char *label)
{
    for (size_t r = 0; r < n; r++) {
        moe_route(&f->rng, m, pools[r]);
        moe_poison(m);
        kiln_attribution a;
        gpu_submit_replayed(f->s, cmd, &a);
        assert_string_equal(a.op_id, "moe_experts");
        assert_int_equal(a.tokens, m->c.T);
        assert_int_equal(a.dispatches, moe_dispatches(f, m->c.T, m->c.K));
        char what[48];
        snprintf(what, sizeof what, "%s %zu (pool %u)", label, r, pools[r]);
        moe_expect_right(m, what);
    }
}

/* Submits cmd eager on f's stream and waits; checks its attribution. */
static kiln_status moe_submit_eager(fixture *f, kiln_command *cmd, uint32_t tokens, uint32_t top_k)
{
    kiln_submit_options so = {.path = KILN_PATH_EAGER_ONLY};
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_submit(f->s, &cmd, 1, &so, &fence));
    kiln_attribution a;
    KILN_CHECK(kiln_fence_attribution(fence, 0, &a));
    assert_string_equal(a.op_id, "moe_experts");
    assert_int_equal(a.path, KILN_EXEC_EAGER);
    assert_int_equal(a.tokens, tokens);
    assert_int_equal(a.dispatches, moe_dispatches(f, tokens, top_k));
    const kiln_status st = kiln_fence_wait(fence);
    kiln_fence_release(fence);
    return st;
}

/* One run of fresh data: encoded, submitted eager, every element checked. */
static void experts_case(fixture *f, int bf16, const moe_case *c, uint32_t pool)
{
    moe m;
    moe_make(f, bf16, c, c->T, &m);
    moe_route(&f->rng, &m, pool);
    moe_poison(&m);
    kiln_command *cmd;
    KILN_CHECK(kiln_op_moe_experts_encode(f->jit, &m.d, &cmd));
    assert_true(kiln_command_replayable(cmd));
    assert_string_equal(kiln_command_op_id(cmd), "moe_experts");
    KILN_CHECK(moe_submit_eager(f, cmd, c->T, c->K));
    kiln_command_release(cmd);
    moe_expect_right(&m, pool == c->K ? "one expert set" : "routed");
    moe_free(&m);
}

/* A decode step's batches (Qwen3-30B-A3B's hidden and inter among them),
 * the 16-row tile (under 32 rows an expert on average) and the prefill tile
 * (rows per expert not a multiple of 64), a single expert, the limits, and
 * 512 experts grouped by three blocks (4800 pairs: slices of 2048). */
static void test_experts_against_float64(void **state)
{
    fixture *f = *state;
    static const moe_case cases[] = {
        {1, 256, 128, 8, 2, 0, 0},     {5, 256, 192, 16, 4, 0, 0},  {64, 512, 256, 64, 8, 0, 0},
        {600, 256, 128, 8, 2, 0, 0},   {300, 384, 128, 128, 8, 0, 0}, {9, 128, 64, 1, 1, 0, 0},
        {20, 256, 64, 512, 16, 0, 0},  {1000, 128, 64, 4, 4, 0, 0}, {8, 256, 128, 64, 8, 0, 0},
        {9, 256, 128, 64, 8, 0, 0},    {4, 256, 64, 512, 16, 0, 0}, {7, 128, 64, 1, 1, 0, 0},
        {2, 2048, 768, 8, 8, 0, 0},    {16, 256, 128, 64, 16, 0, 0}, {300, 256, 64, 512, 16, 0, 0},
    };
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            experts_case(f, b, &cases[i], cases[i].E);
}

/* Every token the same experts: all rows of the batch in each of them. */
static void test_experts_one_expert_set(void **state)
{
    fixture *f = *state;
    static const moe_case cases[] = {{200, 256, 128, 32, 4, 0, 0}, {3, 256, 128, 64, 8, 0, 0},
                                     {129, 384, 192, 8, 2, 0, 0}};
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            experts_case(f, b, &cases[i], cases[i].K);
}

/* The shared expert's output added (Qwen3-MoE has none; Qwen2-MoE gates it). */
static void test_experts_shared(void **state)
{
    fixture *f = *state;
    static const moe_case cases[] = {{37, 256, 128, 8, 2, 1, 0},  {100, 512, 256, 60, 4, 1, 1},
                                     {3, 256, 128, 16, 4, 1, 1},  {700, 256, 64, 8, 2, 1, 1}};
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            experts_case(f, b, &cases[i], cases[i].E);
}

/* m's ids uploaded and run through the immediate call, every element then
 * checked; with bad, the synchronization must report the fault record
 * naming moe_experts (and needle), else succeed. */
static void run_ids_right(fixture *f, moe *m, int bad, const char *needle, const char *what)
{
    upload(m->bi, m->ids, (size_t)m->c.T * m->c.K * 4);
    moe_poison(m);
    KILN_CHECK(kiln_op_moe_experts(f->jit, &m->d));
    if (bad)
        KILN_EXPECT(kiln_runtime_synchronize(f->rt), BAD_ID_STATUS, kiln_runtime_errmsg(f->rt), "moe_experts",
                    needle);
    else
        KILN_CHECK(kiln_runtime_synchronize(f->rt));
    moe_expect_right(m, what);
}

/* Ids at or past experts: the fault record names moe_experts and the lowest
 * bad pair's id at the next synchronization, the bad slots add nothing, every
 * other slot is right; the fault clears and the op goes on, with one
 * grouping block and with three (4400 pairs). Through the immediate call
 * (the runtime's stream). */
static void test_experts_bad_ids_reported(void **state)
{
    fixture *f = *state;
    static const moe_case cases[] = {{50, 256, 128, 16, 4, 0, 0}, {600, 256, 128, 8, 2, 1, 1},
                                     {6, 256, 128, 16, 4, 1, 1},  {1100, 256, 128, 16, 4, 0, 0}};
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            const moe_case *c = &cases[i];
            moe m;
            moe_make(f, b, c, c->T, &m);
            moe_route(&f->rng, &m, c->E);
            m.ids[2 * c->K + 1] = c->E; /* exactly experts */
            run_ids_right(f, &m, 1, NULL, "id = experts");
            /* Two more; the lowest pair is reported. */
            m.ids[1 * c->K + 0] = 4000000000u;
            m.ids[(size_t)(c->T - 2) * c->K + c->K - 1] = c->E + 1;
            run_ids_right(f, &m, 1, "4000000000", "three bad ids");
            /* Every id bad: out is the shared term alone, or zeros. */
            for (size_t p = 0; p < (size_t)c->T * c->K; p++)
                m.ids[p] = c->E + (uint32_t)p;
            run_ids_right(f, &m, 1, NULL, "every id bad");
            /* The fault was cleared: a good routing runs clean. */
            moe_route(&f->rng, &m, c->E);
            moe_poison(&m);
            KILN_CHECK(kiln_op_moe_experts(f->jit, &m.d));
            KILN_CHECK(kiln_runtime_synchronize(f->rt));
            moe_expect_right(&m, "after the fault");
            moe_free(&m);
        }
}

/* One command, encoded once and captured once, replayed over routings
 * written to the device between replays (anywhere, one expert set, a few
 * experts, anywhere again): the host never sees the routing. Its workspace
 * is sized for more tokens than it has. */
static void test_experts_replayed_over_routings(void **state)
{
    fixture *f = *state;
    static const struct { int bf16; moe_case c; } cases[] = {
        {0, {40, 256, 128, 16, 4, 0, 0}}, /* 16-row tiles; one expert set: 40 rows each */
        {1, {600, 256, 128, 8, 2, 0, 0}}, /* 64-row tiles */
        {0, {300, 384, 128, 128, 8, 1, 1}},
        {1, {8, 256, 128, 64, 8, 1, 1}}, /* a decode step's batch */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const moe_case *c = &cases[i].c;
        moe m;
        moe_make(f, cases[i].bf16, c, 2 * c->T, &m);
        moe_route(&f->rng, &m, c->E);
        kiln_command *cmd;
        KILN_CHECK(kiln_op_moe_experts_encode(f->jit, &m.d, &cmd));
        assert_true(kiln_command_replayable(cmd));
        kiln_graph_stats g0, g1;
        kiln_stream_graph_stats(f->s, &g0);
        const uint32_t pools[] = {c->E, c->K, c->K + 1 < c->E ? c->K + 1 : c->E, c->E};
        replay_right(f, &m, cmd, pools, sizeof pools / sizeof pools[0], "replay");
        kiln_stream_graph_stats(f->s, &g1);
        assert_int_equal(g1.captured - g0.captured, 1);
        assert_int_equal(g1.rejected - g0.rejected, 0);
        /* Eager after replayed, the same command: right too. */
        moe_route(&f->rng, &m, c->E);
        moe_poison(&m);
        KILN_CHECK(moe_submit_eager(f, cmd, c->T, c->K));
        moe_expect_right(&m, "eager after replays");
        kiln_command_release(cmd);
        moe_free(&m);
    }
}

/* Ids repeated within a token's slots (the contract allows them): every
 * slot one expert (6 tokens: 24 rows of it, more than a 16-row tile; 40
 * tokens), and 5 tokens over 3 experts, each two or three times a token. */
static void test_experts_repeated_ids(void **state)
{
    fixture *f = *state;
    static const moe_case cases[] = {{6, 256, 128, 8, 4, 1, 0}, {40, 256, 128, 8, 4, 0, 0}, {5, 256, 128, 8, 8, 0, 0}};
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            const moe_case *c = &cases[i];
            moe m;
            moe_make(f, b, c, c->T, &m);
            moe_route(&f->rng, &m, c->E);
            for (size_t p = 0; p < (size_t)c->T * c->K; p++)
                m.ids[p] = i == 2 ? (uint32_t)(p % 3) : 3; /* the last: three experts, each twice or thrice a token */
            run_ids_right(f, &m, 0, NULL, "repeated ids");
            moe_free(&m);
        }
}

/* On sm_90: the TMA decode products over all they can serve (KILN_MOE_TMA=1:
 * at most 8 tokens and 64 pairs; by default 16 pairs) at one token of
 * Qwen3-30B-A3B's sizes, 8 tokens of top_k 8, 4 of top_k 16, a single
 * expert, a gated shared expert, every token the same experts, groups of
 * warps that do not divide an expert's columns (inter 1088: 9 warps), an
 * expert named twice by a token, bad ids, and a replayed command over new
 * routings; then the same with the default choice, and on the 16-row tiles
 * with KILN_MOE_TMA=0; then two commands of different shared memory. */
static void test_experts_tma(void **state)
{
    fixture *f = *state;
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    if (strcmp(info.arch, "sm_90")) {
        printf("TMA experts: the device is %s, not sm_90: not run\n", info.arch);
        return;
    }
    static const struct { moe_case c; int one_set; } cases[] = {
        {{1, 2048, 768, 16, 8, 0, 0}, 0}, {{8, 256, 128, 64, 8, 0, 0}, 0}, {{4, 512, 192, 512, 16, 0, 0}, 0},
        {{7, 128, 64, 1, 1, 0, 0}, 0},    {{3, 256, 128, 16, 4, 1, 1}, 0}, {{6, 384, 256, 32, 8, 1, 0}, 1},
        {{2, 1024, 512, 8, 2, 0, 0}, 0},  {{1, 256, 1088, 16, 8, 0, 0}, 0},
    };
    static const char *const modes[] = {"1", NULL, "0"};
    for (int mode = 0; mode < 3; mode++) {
        const int bf16 = mode != 1;
        if (modes[mode])
            setenv("KILN_MOE_TMA", modes[mode], 1);
        else
            unsetenv("KILN_MOE_TMA");
        for (int b = 0; b < 2; b++)
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
                experts_case(f, b, &cases[i].c, cases[i].one_set ? cases[i].c.K : cases[i].c.E);
        /* A token naming one expert in two slots, and a bad id (15 pairs:
         * the TMA products by default too). */
        const moe_case c = {5, 256, 128, 8, 3, 1, 0};
        moe m;
        moe_make(f, bf16, &c, c.T, &m);
        moe_route(&f->rng, &m, c.E);
        m.ids[1] = m.ids[0];
        m.ids[2 * c.K + 2] = m.ids[2 * c.K];
        upload(m.bi, m.ids, (size_t)c.T * c.K * 4);
        moe_poison(&m);
        KILN_CHECK(kiln_op_moe_experts(f->jit, &m.d));
        KILN_CHECK(kiln_runtime_synchronize(f->rt));
        moe_expect_right(&m, "an expert twice a token");
        m.ids[3 * c.K + 1] = c.E + 7;
        upload(m.bi, m.ids, (size_t)c.T * c.K * 4);
        moe_poison(&m);
        KILN_CHECK(kiln_op_moe_experts(f->jit, &m.d));
        KILN_EXPECT(kiln_runtime_synchronize(f->rt), BAD_ID_STATUS, kiln_runtime_errmsg(f->rt), "moe_experts", NULL);
        moe_expect_right(&m, "a bad id");
        /* One command replayed over new routings, its workspace for more tokens. */
        moe_free(&m);
        moe_make(f, 1, &c, 8, &m);
        kiln_command *cmd;
        moe_route(&f->rng, &m, c.E);
        KILN_CHECK(kiln_op_moe_experts_encode(f->jit, &m.d, &cmd));
        const uint32_t pools[] = {c.E, c.K, c.E};
        replay_right(f, &m, cmd, pools, sizeof pools / sizeof pools[0], "replay");
        kiln_command_release(cmd);
        moe_free(&m);
    }
    unsetenv("KILN_MOE_TMA");
    /* Two commands whose TMA products take different shared memory (1 and 2
     * tokens: 8 and 16 experts named), the larger's first: the later encode
     * must leave the earlier command's launches. */
    const moe_case c1 = {1, 2048, 768, 16, 8, 0, 0}, c2 = {2, 2048, 768, 16, 8, 0, 0};
    moe m1, m2;
    moe_make(f, 1, &c1, c1.T, &m1);
    moe_make(f, 1, &c2, c2.T, &m2);
    moe_route(&f->rng, &m1, c1.E);
    moe_route(&f->rng, &m2, c2.E);
    kiln_command *cmd1, *cmd2;
    KILN_CHECK(kiln_op_moe_experts_encode(f->jit, &m1.d, &cmd1));
    KILN_CHECK(kiln_op_moe_experts_encode(f->jit, &m2.d, &cmd2));
    moe_poison(&m1);
    KILN_CHECK(moe_submit_eager(f, cmd1, c1.T, c1.K));
    moe_expect_right(&m1, "1 token after a 2-token encode");
    moe_poison(&m2);
    KILN_CHECK(moe_submit_eager(f, cmd2, c2.T, c2.K));
    moe_expect_right(&m2, "2 tokens");
    kiln_command_release(cmd1);
    kiln_command_release(cmd2);
    moe_free(&m1);
    moe_free(&m2);
}

static uint64_t acquisitions(fixture *f)
{
    kiln_jit_counters k;
    kiln_jit_get_counters(f->jit, &k);
    return k.compiles + k.database_hits + k.memory_hits;
}

/* On sm_90: the wgmma products (the default there) over partial and full
 * 128-row tiles, several column tiles, one expert set, a shared expert,
 * then one command replayed over new routings, each encode acquiring both
 * kernels (moe_experts and moe_experts_wgmma); then the same cases with
 * KILN_MOE_WGMMA=0 on the 64-row mma.sync tiles, one kernel each. */
static void test_experts_wgmma(void **state)
{
    fixture *f = *state;
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    if (strncmp(info.arch, "sm_90", 5)) {
        printf("wgmma experts: the device is %s, not sm_90: not run\n", info.arch);
        return;
    }
    unsetenv("KILN_MOE_WGMMA");
    static const struct { moe_case c; int one_set; } cases[] = {
        {{600, 256, 128, 8, 2, 0, 0}, 0},   {{2048, 512, 256, 16, 4, 0, 0}, 0}, {{1000, 768, 384, 8, 2, 1, 1}, 0},
        {{300, 256, 128, 2, 1, 0, 0}, 0},   {{129, 512, 128, 8, 8, 0, 0}, 1},   {{4096, 256, 256, 64, 4, 1, 0}, 0},
    };
    for (int mma = 0; mma < 2; mma++) {
        if (mma)
            setenv("KILN_MOE_WGMMA", "0", 1);
        for (int b = 0; b < 2; b++)
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                const uint64_t before = acquisitions(f);
                experts_case(f, b, &cases[i].c, cases[i].one_set ? cases[i].c.K : cases[i].c.E);
                assert_int_equal(acquisitions(f) - before, mma ? 1 : 2);
            }
    }
    unsetenv("KILN_MOE_WGMMA");
    const moe_case c = {1500, 512, 256, 8, 2, 0, 0};
    moe m;
    moe_make(f, 1, &c, c.T, &m);
    moe_route(&f->rng, &m, c.E);
    kiln_command *cmd;
    KILN_CHECK(kiln_op_moe_experts_encode(f->jit, &m.d, &cmd));
    const uint32_t pools[] = {c.E, c.K, c.E};
    replay_right(f, &m, cmd, pools, sizeof pools / sizeof pools[0], "wgmma replay");
    kiln_command_release(cmd);
    moe_free(&m);
}

/* Refused at encode with KILN_ERR_RUNTIME_CONTRACT, a message naming the op
 * and needle (and needle2, or either of them with either set) and no command. */
static void expect_refused(fixture *f, const kiln_moe_experts_desc *d, const char *needle, const char *needle2,
                           int either)
{
    kiln_command *cmd = (kiln_command *)1;
    const kiln_status st = kiln_op_moe_experts_encode(f->jit, d, &cmd);
    const char *msg = kiln_errmsg();
    kiln_test_expect(st, KILN_ERR_RUNTIME_CONTRACT, msg, "moe_experts", NULL);
    if (either) {
        if (!strstr(msg, needle) && !strstr(msg, needle2))
            fail_msg("message names neither \"%s\" nor \"%s\": %s", needle, needle2, msg);
    } else
        kiln_test_expect(st, KILN_ERR_RUNTIME_CONTRACT, msg, needle, needle2);
    assert_null(cmd);
}

static void test_experts_bad_bindings_refused(void **state)
{
    fixture *f = *state;
    const moe_case c = {4, 256, 128, 8, 2, 1, 1};
    const uint32_t T = c.T, H = c.H, I = c.I, E = c.E;
    moe m;
    moe_make(f, 0, &c, T, &m);
    moe_route(&f->rng, &m, E);
    kiln_command *cmd;
    KILN_CHECK(kiln_op_moe_experts_encode(f->jit, &m.d, &cmd));
    kiln_command_release(cmd);
    kiln_moe_experts_desc d = m.d;
    d.size = 0; /* the same */
    KILN_CHECK(kiln_op_moe_experts_encode(f->jit, &d, &cmd));
    kiln_command_release(cmd);

    kiln_tensor t;
#define REFUSE_WITH(field, edit, n1, n2, either)                                                                  \
    do {                                                                                                          \
        d = m.d;                                                                                                  \
        t = *m.d.field;                                                                                           \
        edit;                                                                                                     \
        d.field = &t;                                                                                             \
        expect_refused(f, &d, n1, n2, either);                                                                    \
    } while (0)
    REFUSE_WITH(ids, t.dtype = KILN_DTYPE_I32, "binding ids", "u32", 0);
    REFUSE_WITH(weights, t.dtype = KILN_DTYPE_F16, "binding weights", "f32", 0);
    REFUSE_WITH(x, t.dtype = KILN_DTYPE_F32, "binding x", "f32", 0);
    /* gate_up [E, I, H]: inconsistent with down [E, H, I], whichever of the two sets inter. */
    REFUSE_WITH(gate_up, t.dims[1] = I, "binding gate_up", "binding down", 1);
    REFUSE_WITH(gate_up, (t.dims[1] = 2 * I, t.dims[2] = 2 * H), "binding gate_up", NULL, 0);
    REFUSE_WITH(gate_up, (t.rank = 2, t.dims[0] = (int64_t)E * 2 * I, t.dims[1] = H, t.dims[2] = 0),
                "binding gate_up", NULL, 0);
    REFUSE_WITH(gate_up, t.dtype = KILN_DTYPE_BF16, "binding gate_up", "bf16", 0);
    REFUSE_WITH(down, (t.dims[1] = I, t.dims[2] = H), "binding down", NULL, 0); /* transposed */
    REFUSE_WITH(down, t.dims[0] = E - 1, "binding down", "binding gate_up", 1);
    REFUSE_WITH(shared, t.dims[0] = T + 1, "binding shared", NULL, 0);
    REFUSE_WITH(shared_gate, t.dims[0] = H / 2, "binding shared_gate", NULL, 0);
    REFUSE_WITH(out, t.dims[1] = H / 2, "binding out", NULL, 0);
#undef REFUSE_WITH

    d = m.d;
    d.shared = NULL; /* a gate without the shared output */
    expect_refused(f, &d, "shared_gate", NULL, 0);

    /* out over x: in place is not allowed. */
    d = m.d;
    t = m.x_t;
    d.out = &t;
    expect_refused(f, &d, "overlaps", "binding out", 0);
    assert_non_null(strstr(kiln_errmsg(), "binding x"));

    /* The workspace: too small by a byte, missing, not 256-byte aligned, over ids. */
    kiln_region r = m.ws;
    d = m.d;
    d.workspace = &r;
    r.end = m.ws_bytes - 1;
    expect_refused(f, &d, "workspace", NULL, 0);
    r = (kiln_region){m.bws, 16, 16 + m.ws_bytes};
    expect_refused(f, &d, "workspace", NULL, 0);
    d.workspace = NULL;
    expect_refused(f, &d, "workspace", NULL, 0);
    kiln_buffer *big = buffer(f->rt, m.ws_bytes + 4096);
    kiln_tensor ids = m.ids_t;
    ids.buffer = big;
    r = (kiln_region){big, 0, m.ws_bytes};
    d = m.d;
    d.ids = &ids;
    d.workspace = &r;
    expect_refused(f, &d, "overlaps", "workspace", 0);

    /* A binding not 16-byte aligned. */
    kiln_buffer *roomy = buffer(f->rt, (size_t)T * H * 2 + 64);
    t = m.x_t;
    t.buffer = roomy;
    t.offset = 8;
    d = m.d;
    d.x = &t;
    expect_refused(f, &d, "binding x", NULL, 0);

    /* top_k past experts: ids and weights [T, E + 1]. */
    kiln_buffer *wide = buffer(f->rt, 2 * (size_t)T * (E + 1) * 4);
    kiln_tensor wi = {.buffer = wide, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {T, E + 1}},
                ww = {.buffer = wide, .offset = (size_t)T * (E + 1) * 4, .dtype = KILN_DTYPE_F32, .rank = 2,
                      .dims = {T, E + 1}};
    d = m.d;
    d.ids = &wi;
    d.weights = &ww;
    expect_refused(f, &d, "top_k 9", "binding ids", 1);

    /* Nothing was launched by the refused calls; the valid one still runs right. */
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    moe_poison(&m);
    KILN_CHECK(kiln_op_moe_experts(f->jit, &m.d));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    moe_expect_right(&m, "after refusals");
    kiln_buffer_destroy(wide);
    kiln_buffer_destroy(roomy);
    kiln_buffer_destroy(big);
    moe_free(&m);
}

int main(void)
{
    kiln_test_require_gpu();
    kiln_test_filter();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_router_against_float64, gpu_fixture_setup, gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_against_float64, gpu_fixture_setup, gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_one_expert_set, gpu_fixture_setup, gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_shared, gpu_fixture_setup, gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_bad_ids_reported, gpu_fixture_setup, gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_replayed_over_routings, gpu_fixture_setup,
                                        gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_bad_bindings_refused, gpu_fixture_setup,
                                        gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_wgmma, gpu_fixture_setup, gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_repeated_ids, gpu_fixture_setup, gpu_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_tma, gpu_fixture_setup, gpu_fixture_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
