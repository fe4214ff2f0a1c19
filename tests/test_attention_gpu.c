/* Causal paged attention on the GPU: fresh random data each run, out
 * poisoned first, every output element checked against a float64 host
 * reference (relative error <= 2e-3 against max(|ref|, 2^-12), and for
 * prefill, whose p is rounded to f16 for the tensor cores, also 2^-10 of
 * sum p |v| / sum p), and the
 * whole KV page arena read back after every step: the new tokens' slots
 * hold the rotated k (within one f16 rounding of the float64 rotation) and v
 * (exact), every other byte is unchanged. Head dims 64 and 128, group sizes
 * 1, 4 and 7; prefill of 1 to 4096 tokens, several sequences packed with
 * cached prefixes (chunked prefill); decode at 1 to 64 sequences with
 * contexts over many pages and lengths that are not multiples of a page;
 * block tables scattered over the arena, unused entries garbage; split-KV
 * decode (one kernel, the splits of a sequence one thread block cluster) at
 * the lengths where its chunking changes (1, 2, a page, a tile and one past
 * each, 1024 at 8 and 32 sequences, 16384 at one), at every cluster size
 * (1, 2, 4, 8, 16: short sequences leave blocks of a cluster without keys), and
 * unsplit decode (the split target at 1), and the two-kernel decode of
 * devices short of shared memory; q, k and v
 * fused in one tensor, prefill and decode; one decode command replayed from
 * a graph over several steps with its per-step values in a binding arena,
 * and bit for bit the same as the same command run eager; bad device data
 * reported through the fault record (the bad sequence skipped, the others
 * right), in prefill and split decode; contract errors at encode. bf16
 * (q, k, v, the pages and out) on every kernel (wgmma, mma.sync and CUDA-core
 * prefill, chunked prefill after a cached prefix, split, unsplit and
 * two-kernel decode) against the same reference, within 2^-7 (two bf16
 * roundings) and 2^-7 of sum p |v| / sum p for prefill; scaled, partial
 * RoPE (a caller's table of inverse frequencies, cos and sin times 1.3,
 * half the head rotated, and 20 dims) in f16 and bf16 on every kernel; one
 * sequence of 32768 tokens against the CUDA-core kernel.
 * KILN_ATTN_QUICK=1 runs a reduced set (for compute-sanitizer). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "f16_host.h"
#include "gpu_fixture.h"
#include "providers/internal.h"

#define TOL 2e-3
#define FLOOR (1.0 / 4096)
#define PAGE_HALVES (KILN_PAGED_KV_PAGE_BYTES / 2)
#define GARBAGE 0xdeadbeefu

static int quick(void)
{
    const char *e = getenv("KILN_ATTN_QUICK");
    return e && *e && *e != '0';
}

/* ---- f16 and bf16 on the host ---- */

static double h2f_slow(uint16_t h)
{
    uint32_t e = (h >> 10) & 31, m = h & 1023;
    double v = e ? ldexp((double)(m | 1024), (int)e - 25) : ldexp((double)m, -24);
    if (e == 31)
        v = m ? NAN : INFINITY;
    return (h & 0x8000) ? -v : v;
}

/* Every element's value, once per type: the float64 reference converts
 * billions of them. */
static double f16_table[65536], bf16_table[65536];

static void tables_init(void)
{
    for (uint32_t h = 0; h < 65536; h++) {
        f16_table[h] = h2f_slow((uint16_t)h);
        bf16_table[h] = (double)kiln_test_bf16_to_f32((uint16_t)h);
    }
}

/* Random finite elements with |x| in [2^-6, 1): fast enough for arenas of
 * pages. f16: exponent 9..14 of bias 15; bf16: 121..126 of bias 127. */
static inline uint16_t rand_e(kiln_rng *r, int bf16)
{
    uint64_t u = kiln_rng_next(r);
    if (bf16)
        return (uint16_t)(((u >> 20) & 0x8000) | ((121 + (u >> 40) % 6) << 7) | (u & 127));
    return (uint16_t)(((u >> 20) & 0x8000) | ((9 + (u >> 40) % 6) << 10) | (u & 1023));
}

static void fill_e(kiln_rng *r, int bf16, uint16_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = rand_e(r, bf16);
}

/* What the sessions a test starts next take (sess_init reads it; every
 * test's teardown puts back the default: f16, RoPE from theta over the
 * whole head). inv: rope_inv_freq (rope_dim / 2 of them; NULL: from theta). */
static struct {
    kiln_dtype elt;
    const float *inv;
    float scaling;     /* the desc's rope_attention_scaling (0: 1) */
    int64_t rope_dim;  /* 0: head_dim */
    uint32_t window;   /* the desc's sliding_window (0: none) */
} next_cfg = {KILN_DTYPE_F16, NULL, 0.0f, 0, 0};

static kiln_buffer *buffer(kiln_runtime *rt, size_t bytes)
{
    kiln_buffer *b;
    KILN_CHECK(kiln_buffer_create(rt, bytes ? bytes : 4, 256, &b));
    return b;
}

/* ---- a KV cache session ---- */

typedef struct layout {
    int64_t D, H, KVH;
} layout;

typedef struct sess {
    gpu_fixture *f;
    layout L;
    int64_t G;
    uint32_t pt, S, MB, n_pages;
    float theta, inv[128];
    kiln_dtype elt;        /* of q, k, v, out and the pages */
    int bf16;
    const double *dec;     /* an element's value: f16_table or bf16_table */
    const float *inv_given; /* the desc's rope_inv_freq (inv holds the same), or NULL */
    float scaling;         /* the desc's rope_attention_scaling */
    double rope_m;         /* cos and sin multiplied by it: scaling, or 1 for 0 */
    int64_t rope_dim;      /* the desc's (0: head_dim) */
    int64_t rh;            /* rotated pairs: rope_dim / 2 */
    uint32_t window;       /* the desc's sliding_window (0: none) */
    uint16_t *img;     /* the arena as it must be: n_pages * PAGE_HALVES */
    uint16_t *back;    /* read back */
    uint32_t *table;   /* S * MB */
    uint32_t *len;     /* cached length of each sequence */
    kiln_buffer *pages;
} sess;

/* Sequence s may grow to cap[s] tokens; it starts with ctx[s] cached (random) tokens. */
static void sess_init(sess *s, gpu_fixture *f, layout L, uint32_t S, const uint32_t *ctx, const uint32_t *cap,
                      float theta)
{
    memset(s, 0, sizeof *s);
    s->f = f;
    s->L = L;
    s->G = L.H / L.KVH;
    s->S = S;
    s->theta = theta;
    s->elt = next_cfg.elt;
    s->bf16 = s->elt == KILN_DTYPE_BF16;
    s->dec = s->bf16 ? bf16_table : f16_table;
    s->inv_given = next_cfg.inv;
    s->scaling = next_cfg.scaling;
    s->rope_m = s->scaling != 0.0f ? (double)s->scaling : 1.0;
    s->rope_dim = next_cfg.rope_dim;
    s->rh = (s->rope_dim ? s->rope_dim : L.D) / 2;
    s->window = next_cfg.window;
    KILN_CHECK(kiln_op_paged_attention_page_tokens(L.D, L.KVH, &s->pt));
    uint32_t total = 0, mb = 0;
    for (uint32_t i = 0; i < S; i++) {
        uint32_t b = (cap[i] + s->pt - 1) / s->pt;
        total += b;
        mb = b > mb ? b : mb;
    }
    s->MB = mb + 1 + kiln_rng_below(&f->rng, 3); /* unused entries: garbage */
    s->n_pages = total + 3;
    s->table = malloc((size_t)S * s->MB * 4);
    s->len = malloc((size_t)S * 4);
    uint32_t *perm = malloc((size_t)s->n_pages * 4);
    s->img = malloc((size_t)s->n_pages * KILN_PAGED_KV_PAGE_BYTES);
    s->back = malloc((size_t)s->n_pages * KILN_PAGED_KV_PAGE_BYTES);
    assert_true(s->table && s->len && perm && s->img && s->back);
    /* The arena's pages in runs of 1 to 16 in a random order: a tile's pages
     * follow one another in the arena in some tiles (one TMA box a panel in
     * the wgmma prefill) and not in others. */
    uint32_t *start = malloc((size_t)s->n_pages * 4), *lens = malloc((size_t)s->n_pages * 4), runs = 0;
    assert_true(start && lens);
    for (uint32_t p = 0; p < s->n_pages; runs++) {
        const uint32_t want = 1 + kiln_rng_below(&f->rng, 16), left = s->n_pages - p;
        start[runs] = p;
        lens[runs] = want < left ? want : left;
        p += lens[runs];
    }
    for (uint32_t n = runs; n > 1; n--) {
        const uint32_t i = n - 1, j = kiln_rng_below(&f->rng, n), ts = start[i], tl = lens[i];
        start[i] = start[j];
        lens[i] = lens[j];
        start[j] = ts;
        lens[j] = tl;
    }
    for (uint32_t r = 0, i = 0; r < runs; r++)
        for (uint32_t k = 0; k < lens[r]; k++)
            perm[i++] = start[r] + k;
    free(start);
    free(lens);
    uint32_t next = 0;
    for (uint32_t i = 0; i < S; i++) {
        uint32_t b = (cap[i] + s->pt - 1) / s->pt;
        for (uint32_t k = 0; k < s->MB; k++)
            s->table[(size_t)i * s->MB + k] = k < b ? perm[next++] : GARBAGE;
        s->len[i] = ctx[i];
    }
    free(perm);
    /* Cached tokens and unused slots alike: random finite values. */
    fill_e(&f->rng, s->bf16, s->img, (size_t)s->n_pages * PAGE_HALVES);
    s->pages = buffer(f->rt, (size_t)s->n_pages * KILN_PAGED_KV_PAGE_BYTES);
    KILN_CHECK(kiln_buffer_upload(s->pages, 0, s->img, (size_t)s->n_pages * KILN_PAGED_KV_PAGE_BYTES));
    for (int64_t i = 0; i < s->rh; i++)
        s->inv[i] = s->inv_given ? s->inv_given[i]
                                 : (float)pow((double)theta, -2.0 * (double)i / (double)(2 * s->rh));
}

static void sess_free(sess *s)
{
    kiln_buffer_destroy(s->pages);
    free(s->img);
    free(s->back);
    free(s->table);
    free(s->len);
}

/* The half at (page, K or V, kv head, slot, d). */
static size_t at(const sess *s, uint32_t page, int is_v, int64_t h, uint32_t slot, int64_t d)
{
    return (size_t)page * PAGE_HALVES + (is_v ? PAGE_HALVES / 2 : 0) + ((size_t)h * s->pt + slot) * s->L.D + d;
}

static inline double dec(const sess *s, uint16_t h) { return s->dec[h]; }

/* Rotated pair i < rh: (x[i], x[i + rh]); dims from 2 rh on pass through. */
static void rope_ref(const sess *s, double x0, double x1, uint32_t pos, int64_t i, double *y0, double *y1)
{
    volatile float a = (float)pos * s->inv[i]; /* the kernel's f32 angle */
    double c = cos((double)a) * s->rope_m, sn = sin((double)a) * s->rope_m;
    *y0 = x0 * c - x1 * sn;
    *y1 = x1 * c + x0 * sn;
}

/* ---- one step: new tokens for each sequence ---- */

typedef enum { BAD_NONE, BAD_TABLE, BAD_TABLE_FIRST, BAD_LEN, BAD_SPAN, BAD_COUNT, BAD_OVER_MAX } bad_kind;

/* What a step hands to whoever runs it: host inputs and the out buffer to fill. */
typedef struct step_io {
    uint32_t T, S, MB;
    const uint32_t *pos, *table, *lens, *spans;
    const uint16_t *q, *k, *v;
    kiln_buffer *out;
} step_io;

typedef struct step {
    const uint32_t *count; /* new tokens per sequence */
    uint32_t max_query;    /* 0: T */
    bad_kind bad;          /* applied to sequence 1 */
    int no_workspace;      /* eager: no workspace binding, and a decode unsplit (split target 1) */
    int fused;             /* eager: q, k and v in one qkv tensor */
    int misalign;          /* eager: 1, q 2 bytes and out 4 bytes past 16-byte alignment; 2, out alone */
    kiln_status (*runner)(void *user, const step_io *io); /* NULL: encode and run eagerly here */
    void *user;
} step;

typedef struct ref_ctx {
    const sess *s;
    const uint16_t *q, *out;
    const uint32_t *pos, *spans, *lens;
    const uint8_t *skip;
    /* Prefill rounds p to the element type for its product with v, as
     * FlashAttention does: an output may be off by up to 2^-11 (f16; 2^-8 in
     * bf16) (sum p |v|) / (sum p) from that and about as much from q rounded,
     * beyond tol. f16 decode: 0, its kernels keep f32 accuracy; bf16 decode:
     * 2^-12, for q's and p's two bf16 terms (16 bits). */
    double p_round;
    double tol; /* TOL (f16), 2^-7 (bf16: two roundings of 8 bits) */
    _Atomic uint32_t next;
    pthread_mutex_t lock;
    double worst;
    size_t wrong, checked;
} ref_ctx;

/* (token row, head) pairs, one at a time, vs float64: a single long
 * sequence still spreads over every thread. */
static void *ref_worker(void *arg)
{
    ref_ctx *r = arg;
    const sess *s = r->s;
    const int64_t D = s->L.D, H = s->L.H, G = s->G;
    double *p = NULL, q[256];
    size_t pcap = 0, wrong = 0, checked = 0;
    double worst = 0;
    for (;;) {
        const uint32_t item = atomic_fetch_add(&r->next, 1);
        const int64_t hq = item % H;
        /* Find (sequence, j) of row item / H. */
        uint32_t seq = 0, j = item / (uint32_t)H;
        while (seq < s->S && (r->skip[seq] || j >= r->spans[2 * seq + 1])) {
            if (!r->skip[seq])
                j -= r->spans[2 * seq + 1];
            seq++;
        }
        if (seq == s->S)
            break;
        const uint32_t start = r->spans[2 * seq], count = r->spans[2 * seq + 1], L = r->lens[seq];
        const uint32_t t = start + j, c = L - count + j;
        if (pcap < (size_t)c + 1) {
            pcap = (size_t)c + 1;
            p = realloc(p, pcap * sizeof *p);
            assert_non_null(p);
        }
        const uint32_t *trow = s->table + (size_t)seq * s->MB;
        {
            const int64_t kh = hq / G;
            const uint16_t *src = r->q + ((size_t)t * H + hq) * D;
            const int64_t rh = s->rh;
            for (int64_t i = 0; i < rh; i++)
                rope_ref(s, dec(s, src[i]), dec(s, src[i + rh]), r->pos[t], i, &q[i], &q[i + rh]);
            for (int64_t i = 2 * rh; i < D; i++)
                q[i] = dec(s, src[i]);
            /* The keys attended: the window's up to c, or all up to c. */
            const uint32_t k0 = s->window && c >= s->window ? c - s->window + 1 : 0;
            double m = -INFINITY, sum = 0;
            for (uint32_t k = k0; k <= c; k++) {
                const uint16_t *kr = s->img + at(s, trow[k / s->pt], 0, kh, k % s->pt, 0);
                double dot = 0;
                for (int64_t d = 0; d < D; d++)
                    dot += q[d] * dec(s, kr[d]);
                p[k] = dot / sqrt((double)D);
                m = p[k] > m ? p[k] : m;
            }
            for (uint32_t k = k0; k <= c; k++)
                sum += (p[k] = exp(p[k] - m));
            double o[256] = {0}, mag[256] = {0};
            for (uint32_t k = k0; k <= c; k++) {
                const uint16_t *vr = s->img + at(s, trow[k / s->pt], 1, kh, k % s->pt, 0);
                for (int64_t d = 0; d < D; d++) {
                    o[d] += p[k] * dec(s, vr[d]);
                    mag[d] += p[k] * fabs(dec(s, vr[d]));
                }
            }
            const uint16_t *got = r->out + ((size_t)t * H + hq) * D;
            for (int64_t d = 0; d < D; d++) {
                const double ref = o[d] / sum, g = dec(s, got[d]);
                const double scale = fmax(fabs(ref), FLOOR) + r->p_round / r->tol * mag[d] / sum;
                const double e = isfinite(g) ? fabs(g - ref) / scale : INFINITY;
                worst = e > worst ? e : worst;
                checked++;
                if (e > r->tol && wrong++ < 5)
                    fprintf(stderr, "seq %u token %u (cache %u of %u) head %lld d %lld: got %.6g, want %.6g\n", seq,
                            t, c, L, (long long)hq, (long long)d, g, ref);
            }
        }
    }
    free(p);
    pthread_mutex_lock(&r->lock);
    r->wrong += wrong;
    r->checked += checked;
    r->worst = worst > r->worst ? worst : r->worst;
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

/* Runs one step and checks it all; returns the status synchronize gave. */
static kiln_status run_step(sess *s, const step *st, const char *label)
{
    gpu_fixture *f = s->f;
    const int64_t D = s->L.D, H = s->L.H, KVH = s->L.KVH;
    const uint32_t S = s->S;
    uint32_t T = 0;
    for (uint32_t i = 0; i < S; i++)
        T += st->count[i];
    const uint32_t Tb = T ? T : 1;
    uint32_t *spans = malloc((size_t)S * 8), *lens = malloc((size_t)S * 4), *pos = malloc((size_t)Tb * 4),
             *table = malloc((size_t)S * s->MB * 4);
    uint16_t *q = malloc((size_t)Tb * H * D * 2), *k = malloc((size_t)Tb * KVH * D * 2),
             *v = malloc((size_t)Tb * KVH * D * 2), *out = malloc((size_t)Tb * H * D * 2);
    uint8_t *skip = calloc(S, 1);
    assert_true(spans && lens && pos && table && q && k && v && out && skip);
    memcpy(table, s->table, (size_t)S * s->MB * 4);
    /* Sequences packed in a shuffled order: spans need not follow sequence order. */
    uint32_t *order = malloc((size_t)S * 4);
    for (uint32_t i = 0; i < S; i++)
        order[i] = i;
    for (uint32_t i = S - 1; i > 0; i--) {
        uint32_t j = kiln_rng_below(&f->rng, i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    uint32_t at_tok = 0;
    for (uint32_t n = 0; n < S; n++) {
        uint32_t i = order[n];
        spans[2 * i] = at_tok;
        spans[2 * i + 1] = st->count[i];
        lens[i] = s->len[i] + st->count[i];
        const uint32_t shift = i % 3 == 2 ? 1000 : 0; /* positions need not equal cache indices */
        for (uint32_t j = 0; j < st->count[i]; j++)
            pos[at_tok + j] = s->len[i] + j + shift;
        at_tok += st->count[i];
    }
    free(order);
    fill_e(&f->rng, s->bf16, q, (size_t)T * H * D);
    fill_e(&f->rng, s->bf16, k, (size_t)T * KVH * D);
    fill_e(&f->rng, s->bf16, v, (size_t)T * KVH * D);
    if (S > 1 && st->bad != BAD_NONE) {
        skip[1] = 1;
        switch (st->bad) {
        case BAD_TABLE: table[(size_t)1 * s->MB + (lens[1] - 1) / s->pt] = s->n_pages + 5; break;
        /* A page the first key tile reads: the decode requests it before its check ends. */
        case BAD_TABLE_FIRST: table[(size_t)1 * s->MB] = s->n_pages; break;
        case BAD_LEN: lens[1] = s->MB * s->pt + 1; break;
        case BAD_SPAN: spans[2] = T - st->count[1] + 1; break;
        case BAD_COUNT: lens[1] = st->count[1] - 1; break;
        default: break;
        }
    }

    const size_t qoff = st->misalign == 1 ? 2 : 0, ooff = st->misalign ? 4 : 0;
    kiln_buffer *bq = buffer(f->rt, (size_t)Tb * H * D * 2 + 16), *bk = buffer(f->rt, (size_t)Tb * KVH * D * 2),
                *bv = buffer(f->rt, (size_t)Tb * KVH * D * 2), *bo = buffer(f->rt, (size_t)Tb * H * D * 2 + 16);
    KILN_CHECK(kiln_buffer_upload(bq, qoff, q, (size_t)Tb * H * D * 2));
    KILN_CHECK(kiln_buffer_upload(bk, 0, k, (size_t)Tb * KVH * D * 2));
    KILN_CHECK(kiln_buffer_upload(bv, 0, v, (size_t)Tb * KVH * D * 2));
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, (size_t)Tb * H * D * 2 + 16)); /* NaN */
    kiln_status result;
    if (st->runner) {
        step_io io = {T, S, s->MB, pos, table, lens, spans, q, k, v, bo};
        result = st->runner(st->user, &io);
    } else {
        kiln_buffer *bp = buffer(f->rt, (size_t)Tb * 4), *bt = buffer(f->rt, (size_t)S * s->MB * 4),
                    *bl = buffer(f->rt, (size_t)S * 4), *bs = buffer(f->rt, (size_t)S * 8);
        KILN_CHECK(kiln_buffer_upload(bp, 0, pos, (size_t)Tb * 4));
        KILN_CHECK(kiln_buffer_upload(bt, 0, table, (size_t)S * s->MB * 4));
        KILN_CHECK(kiln_buffer_upload(bl, 0, lens, (size_t)S * 4));
        KILN_CHECK(kiln_buffer_upload(bs, 0, spans, (size_t)S * 8));
        kiln_tensor tq = {.buffer = bq, .offset = qoff, .dtype = s->elt, .rank = 3, .dims = {T, H, D}},
                    tk = {.buffer = bk, .dtype = s->elt, .rank = 3, .dims = {T, KVH, D}},
                    tv = {.buffer = bv, .dtype = s->elt, .rank = 3, .dims = {T, KVH, D}},
                    to = {.buffer = bo, .offset = ooff, .dtype = s->elt, .rank = 3, .dims = {T, H, D}},
                    tp = {.buffer = bp, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {T}},
                    tt = {.buffer = bt, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {S, s->MB}},
                    tl = {.buffer = bl, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {S}},
                    ts = {.buffer = bs, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {S, 2}};
        kiln_region pr = {s->pages, 0, (size_t)s->n_pages * KILN_PAGED_KV_PAGE_BYTES};
        /* The workspace starts as garbage (the counters too): the command needs no zeroed scratch. */
        size_t ws_need = 0;
        kiln_buffer *bw = NULL;
        kiln_region wr = {0};
        if (!st->no_workspace) {
            KILN_CHECK(kiln_op_paged_attention_workspace(S, H, KVH, D, st->max_query ? st->max_query : Tb, &ws_need));
            bw = buffer(f->rt, ws_need + 256);
            KILN_CHECK(kiln_buffer_fill(bw, 0, 0xff, ws_need + 256));
            wr = (kiln_region){bw, 0, ws_need ? ws_need : 256};
        }
        /* Fused: each row q | k | v. */
        const int64_t W = (H + 2 * KVH) * D;
        kiln_buffer *bf = NULL;
        kiln_tensor tf = {.dtype = s->elt, .rank = 2, .dims = {T, W}};
        if (st->fused) {
            uint16_t *packed = malloc((size_t)Tb * W * 2);
            assert_non_null(packed);
            for (uint32_t t = 0; t < T; t++) {
                memcpy(packed + (size_t)t * W, q + (size_t)t * H * D, (size_t)H * D * 2);
                memcpy(packed + (size_t)t * W + H * D, k + (size_t)t * KVH * D, (size_t)KVH * D * 2);
                memcpy(packed + (size_t)t * W + (H + KVH) * D, v + (size_t)t * KVH * D, (size_t)KVH * D * 2);
            }
            bf = buffer(f->rt, (size_t)Tb * W * 2);
            KILN_CHECK(kiln_buffer_upload(bf, 0, packed, (size_t)Tb * W * 2));
            free(packed);
            tf.buffer = bf;
        }
        kiln_paged_attention_desc d = {.size = sizeof d, .q = st->fused ? NULL : &tq, .k = st->fused ? NULL : &tk,
                                       .v = st->fused ? NULL : &tv, .positions = &tp, .block_table = &tt,
                                       .seq_lens = &tl, .query_spans = &ts, .out = &to, .kv_pages = &pr,
                                       .rope_theta = s->theta, .max_query_tokens = st->max_query,
                                       .workspace = bw ? &wr : NULL, .qkv = st->fused ? &tf : NULL,
                                       .rope_inv_freq = s->inv_given, .rope_attention_scaling = s->scaling,
                                       .rope_dim = s->rope_dim, .sliding_window = s->window};
        kiln_command *cmd;
        if (st->no_workspace)
            kiln__paged_attention_set_split_target(1);
        KILN_CHECK(kiln_op_paged_attention_encode(f->jit, &d, &cmd));
        if (st->no_workspace)
            kiln__paged_attention_set_split_target(0);
        assert_true(kiln_command_replayable(cmd));
        KILN_CHECK(kiln_stream_submit(f->s, &cmd, 1, NULL, NULL));
        result = kiln_stream_synchronize(f->s);
        kiln_command_release(cmd);
        kiln_buffer_destroy(bw);
        kiln_buffer_destroy(bf);
        kiln_buffer_destroy(bp);
        kiln_buffer_destroy(bt);
        kiln_buffer_destroy(bl);
        kiln_buffer_destroy(bs);
    }
    KILN_CHECK(kiln_buffer_readback(bo, ooff, out, (size_t)Tb * H * D * 2));
    KILN_CHECK(kiln_buffer_readback(s->pages, 0, s->back, (size_t)s->n_pages * KILN_PAGED_KV_PAGE_BYTES));

    /* The cache: new slots hold rotated k and v; then adopt them and compare everything. */
    size_t cache_wrong = 0;
    for (uint32_t i = 0; i < S; i++) {
        if (skip[i])
            continue;
        for (uint32_t j = 0; j < st->count[i]; j++) {
            const uint32_t t = spans[2 * i] + j, c = s->len[i] + j, page = s->table[(size_t)i * s->MB + c / s->pt];
            for (int64_t h = 0; h < KVH; h++) {
                const uint16_t *src = k + ((size_t)t * KVH + h) * D, *vs = v + ((size_t)t * KVH + h) * D;
                const int64_t rh = s->rh;
                /* One rounding: 2^-11 (f16) or 2^-8 (bf16) relative at most. */
                const int rel = s->bf16 ? -7 : -10;
                for (int64_t e = 0; e < rh; e++) {
                    double y0, y1;
                    rope_ref(s, dec(s, src[e]), dec(s, src[e + rh]), pos[t], e, &y0, &y1);
                    const size_t a0 = at(s, page, 0, h, c % s->pt, e), a1 = a0 + (size_t)rh;
                    const double g0 = dec(s, s->back[a0]), g1 = dec(s, s->back[a1]);
                    /* One rounding of the result, plus what the kernel's
                     * sin and cos are off by (the SFU's, within 2^-21.4
                     * absolute after the reduction: templates/kiln_paged.cuh)
                     * times each term, and its f32 products: what is left
                     * where the two terms cancel (seen: want 6.856e-5 from
                     * terms near 1, got 4e-7 off). */
                    const double x0 = dec(s, src[e]), x1 = dec(s, src[e + rh]);
                    const double abs_tol = (ldexp(fabs(x0) + fabs(x1), -20) + ldexp(1, -24)) * fmax(s->rope_m, 1.0);
                    if ((fabs(g0 - y0) > ldexp(fabs(y0), rel) + abs_tol ||
                         fabs(g1 - y1) > ldexp(fabs(y1), rel) + abs_tol) &&
                        cache_wrong++ < 5)
                        fprintf(stderr, "%s: seq %u cache %u kv head %lld k[%lld]: got %.6g %.6g, want %.6g %.6g\n",
                                label, i, c, (long long)h, (long long)e, g0, g1, y0, y1);
                    s->img[a0] = s->back[a0];
                    s->img[a1] = s->back[a1];
                }
                /* Past the rotated dims k passes through: the same bits. */
                for (int64_t e = 2 * rh; e < D; e++) {
                    const size_t a = at(s, page, 0, h, c % s->pt, e);
                    if (s->back[a] != src[e] && cache_wrong++ < 5)
                        fprintf(stderr, "%s: seq %u cache %u k[%lld] (not rotated) = 0x%04x, want 0x%04x\n", label, i,
                                c, (long long)e, s->back[a], src[e]);
                    s->img[a] = src[e];
                }
                for (int64_t e = 0; e < D; e++) {
                    const size_t a = at(s, page, 1, h, c % s->pt, e);
                    if (s->back[a] != vs[e] && cache_wrong++ < 5)
                        fprintf(stderr, "%s: seq %u cache %u v[%lld] = 0x%04x, want 0x%04x\n", label, i, c,
                                (long long)e, s->back[a], vs[e]);
                    s->img[a] = vs[e];
                }
            }
        }
    }
    if (cache_wrong)
        fail_msg("%s: %zu cache values wrong", label, cache_wrong);
    if (memcmp(s->img, s->back, (size_t)s->n_pages * KILN_PAGED_KV_PAGE_BYTES))
        fail_msg("%s: bytes of the page arena changed that no new token owns", label);

    /* Outputs: skipped sequences keep the poison; the rest against float64. */
    for (uint32_t i = 0; i < S; i++)
        if (skip[i] && st->bad != BAD_SPAN)
            for (size_t e = 0; e < (size_t)st->count[i] * H * D; e++)
                if (out[(size_t)spans[2 * i] * H * D + e] != 0xffff)
                    fail_msg("%s: skipped sequence %u's out was written", label, i);
    const uint32_t maxq = st->max_query ? st->max_query : T;
    ref_ctx r = {.s = s, .q = q, .out = out, .pos = pos, .spans = spans, .lens = lens, .skip = skip,
                 .p_round = maxq > 1 ? ldexp(1, s->bf16 ? -7 : -10) : s->bf16 ? ldexp(1, -12) : 0,
                 .tol = s->bf16 ? ldexp(1, -7) : TOL};
    pthread_mutex_init(&r.lock, NULL);
    pthread_t th[16];
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int n = ncpu < 1 ? 1 : ncpu > 16 ? 16 : (int)ncpu;
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, ref_worker, &r);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    pthread_mutex_destroy(&r.lock);
    fprintf(stderr, "%s: %s D %lld H %lld KVH %lld S %u T %u max_query %u rope_dim %lld window %u%s%s: %zu outputs, max rel err %.3g\n",
            label, s->bf16 ? "bf16" : "f16", (long long)D, (long long)H, (long long)KVH, S, T, st->max_query,
            (long long)(2 * s->rh), s->window, st->no_workspace ? " unsplit" : "", st->fused ? " fused" : "", r.checked,
            r.worst);
    if (r.wrong)
        fail_msg("%s: %zu of %zu outputs wrong", label, r.wrong, r.checked);
    for (uint32_t i = 0; i < S; i++)
        if (!skip[i])
            s->len[i] += st->count[i];
    kiln_buffer_destroy(bq);
    kiln_buffer_destroy(bk);
    kiln_buffer_destroy(bv);
    kiln_buffer_destroy(bo);
    free(spans);
    free(lens);
    free(pos);
    free(table);
    free(q);
    free(k);
    free(v);
    free(out);
    free(skip);
    return result;
}

static const layout layouts[] = {
    {128, 8, 8},  /* group 1 */
    {128, 32, 8}, /* group 4: Llama-3-8B */
    {128, 28, 4}, /* group 7: Qwen2.5-7B */
    {64, 4, 4},   /* group 1 */
    {64, 16, 4},  /* group 4 */
    {64, 14, 2},  /* group 7: Qwen2.5-0.5B */
    {128, 64, 8}, /* group 8: Llama-3-70B */
};
#define N_LAYOUTS (sizeof layouts / sizeof layouts[0])

/* One sequence, no cached prefix: prefill of n tokens. */
/* q and out off 16-byte alignment (the kernels' scalar loads and 4-byte
 * stores), then out alone (q's 16-byte loads beside out's 4-byte stores). */
static void prefill_misaligned(gpu_fixture *f)
{
    for (size_t l = 0; l < 2; l++)
        for (int m = 1; m <= 2; m++) {
            sess s;
            uint32_t ctx = 0, n = 300;
            sess_init(&s, f, layouts[l], 1, &ctx, &n, 1e6f);
            step st = {.count = &n, .misalign = m};
            KILN_CHECK(run_step(&s, &st, m == 1 ? "prefill 300, q and out misaligned" : "prefill 300, out misaligned"));
            sess_free(&s);
        }
}

static void prefill_one(gpu_fixture *f, layout L, uint32_t n, float theta)
{
    sess s;
    uint32_t ctx = 0, cap = n;
    sess_init(&s, f, L, 1, &ctx, &cap, theta);
    step st = {.count = &n};
    char label[64];
    snprintf(label, sizeof label, "prefill %u", n);
    KILN_CHECK(run_step(&s, &st, label));
    sess_free(&s);
}

static void test_prefill_single_sequence(void **state)
{
    gpu_fixture *f = *state;
    static const uint32_t lens[] = {1, 2, 37, 300, 1000};
    for (size_t l = 0; l < N_LAYOUTS; l++)
        for (size_t i = 0; i < (quick() ? 3 : 5); i++)
            prefill_one(f, layouts[l], lens[i], l % 2 ? 1e6f : 10000.0f);
    prefill_misaligned(f);
    if (!quick()) {
        prefill_one(f, layouts[2], 4096, 1e6f); /* group 7, head_dim 128 */
        prefill_one(f, layouts[5], 4096, 1e6f); /* group 7, head_dim 64 */
        prefill_one(f, layouts[0], 4096, 500000.0f);
        /* Chunked prefill after a long cached prefix. */
        sess s;
        uint32_t ctx = 8000, count = 300, cap = ctx + count;
        sess_init(&s, f, layouts[1], 1, &ctx, &cap, 500000.0f);
        step st = {.count = &count};
        KILN_CHECK(run_step(&s, &st, "prefill after 8000 cached"));
        sess_free(&s);
    }
}

static void prefill_packed(gpu_fixture *f);

/* The prefill kernels other devices take, where this one takes another:
 * mma.sync (sm_80 on without wgmma) and the CUDA cores (before sm_80). */
static void prefill_forced(gpu_fixture *f, int which)
{
    kiln__paged_attention_set_prefill_kernel(which);
    static const uint32_t lens[] = {1, 37, 300, 1000};
    for (size_t l = 0; l < N_LAYOUTS; l++)
        for (size_t i = 0; i < (quick() ? 2 : 4); i++)
            prefill_one(f, layouts[l], lens[i], 1e6f);
    prefill_misaligned(f);
    prefill_packed(f);
    kiln__paged_attention_set_prefill_kernel(0);
}

static void test_prefill_mma(void **state) { prefill_forced(*state, KILN__PREFILL_MMA); }

static void test_prefill_cuda_core(void **state) { prefill_forced(*state, KILN__PREFILL_CUDA_CORE); }

/* Several sequences packed, each with a cached prefix (chunked prefill). */
/* Packed prefill with cached prefixes, then the same on a wgmma prefill grid
 * of 3 blocks: each block walks many work items of several sequences (and
 * the idle one), its producer running into the next item's tiles. */
static void test_prefill_packed_with_prefixes(void **state)
{
    prefill_packed(*state);
    kiln__paged_attention_set_prefill_blocks(3);
    prefill_packed(*state);
    kiln__paged_attention_set_prefill_blocks(0);
}

static void prefill_packed(gpu_fixture *f)
{
    for (size_t l = 0; l < N_LAYOUTS; l++) {
        enum { S = 5 };
        uint32_t ctx[S], cap[S], count[S];
        for (uint32_t i = 0; i < S; i++) {
            ctx[i] = i == 0 ? 0 : kiln_rng_below(&f->rng, quick() ? 200 : 1500);
            count[i] = i == 3 ? 0 : 1 + kiln_rng_below(&f->rng, quick() ? 60 : 400); /* one idle sequence */
            cap[i] = ctx[i] + count[i];
        }
        sess s;
        sess_init(&s, f, layouts[l], S, ctx, cap, 1e6f);
        step st = {.count = count};
        KILN_CHECK(run_step(&s, &st, "packed prefill"));
        sess_free(&s);
    }
}

/* Decode: one token per sequence, contexts over many pages; the second step
 * of 7 sequences without a workspace (one block per sequence and kv head). */
static void test_decode(void **state)
{
    gpu_fixture *f = *state;
    static const uint32_t seqs[] = {1, 7, 64};
    for (size_t l = 0; l < N_LAYOUTS; l++)
        for (size_t n = 0; n < 3; n++) {
            const uint32_t S = seqs[n];
            uint32_t *ctx = malloc(S * 4), *cap = malloc(S * 4), *count = malloc(S * 4);
            for (uint32_t i = 0; i < S; i++) {
                ctx[i] = (i == 0 ? 0 : 1) + kiln_rng_below(&f->rng, quick() ? 300 : (S == 64 ? 1200 : 3000));
                cap[i] = ctx[i] + 2;
                count[i] = 1;
            }
            sess s;
            sess_init(&s, f, layouts[l], S, ctx, cap, 500000.0f);
            step st = {.count = count, .max_query = 1};
            KILN_CHECK(run_step(&s, &st, "decode"));
            st.no_workspace = n == 1;
            KILN_CHECK(run_step(&s, &st, "decode 2")); /* the next token too */
            sess_free(&s);
            free(ctx);
            free(cap);
            free(count);
        }
}

/* Split-KV decode at the lengths where its chunking changes: 1 and 2 keys,
 * a page and one past it, one 64-key tile and one past it, two tiles; 1024
 * keys at 8 and 32 sequences (16 and 4 chunks a sequence); 1 sequence of
 * 16384 keys (64 chunks); group 32 (two row tiles per kv head, each with
 * its own partials). Each case runs two steps (every length + 1 next). */
static void decode_case(gpu_fixture *f, layout L, uint32_t S, const uint32_t *special, uint32_t n_special,
                        uint32_t random_below, int fused, const char *label)
{
    uint32_t *ctx = malloc(S * 4), *cap = malloc(S * 4), *count = malloc(S * 4);
    assert_true(ctx && cap && count);
    for (uint32_t i = 0; i < S; i++) {
        ctx[i] = i < n_special ? special[i] : kiln_rng_below(&f->rng, random_below);
        cap[i] = ctx[i] + 2;
        count[i] = 1;
    }
    sess s;
    sess_init(&s, f, L, S, ctx, cap, 500000.0f);
    step st = {.count = count, .max_query = 1, .fused = fused};
    KILN_CHECK(run_step(&s, &st, label));
    KILN_CHECK(run_step(&s, &st, label));
    sess_free(&s);
    free(ctx);
    free(cap);
    free(count);
}

/* decode_case at 8 sequences of the edge lengths, cached before the step (the
 * step adds one): 0, 1, a page and one less, one 64-key tile and one past it,
 * two tiles, 1024 keys. */
static void decode_edges(gpu_fixture *f, layout L, int fused, const char *label)
{
    uint32_t pt;
    KILN_CHECK(kiln_op_paged_attention_page_tokens(L.D, L.KVH, &pt));
    const uint32_t edges[8] = {0, 1, pt - 1, pt, 63, 64, 127, 1023};
    decode_case(f, L, 8, edges, 8, 1500, fused, label);
}

static void test_decode_split_lengths(void **state)
{
    gpu_fixture *f = *state;
    static const layout ls[] = {{128, 32, 8}, {64, 14, 2}, {128, 8, 8}, {64, 64, 2}};
    for (size_t l = 0; l < sizeof ls / sizeof ls[0]; l++) {
        decode_edges(f, ls[l], l == 1, "decode edges");
        if (quick())
            continue;
        const uint32_t k1023[8] = {1023, 1023, 1023, 1023, 1023, 1023, 1023, 1023};
        decode_case(f, ls[l], 8, k1023, 8, 1, 0, "decode 8 x 1024");
        decode_case(f, ls[l], 32, k1023, 8, 1100, l == 0, "decode 32 x ~1024");
        const uint32_t longest[1] = {16383};
        decode_case(f, ls[l], 1, longest, 1, 1, l == 2, "decode 1 x 16384");
        const uint32_t one[1] = {0};
        decode_case(f, ls[l], 1, one, 1, 1, 0, "decode 1 x 1");
    }
}

/* Every cluster size of the split decode (the split target picks it: the
 * largest n with pairs x n <= target), at lengths that leave blocks of a
 * cluster without keys (cached 0, 1 and 64, then one more) and longer ones,
 * head_dim 128 (groups 4 and 7) and 64 (group 7). */
static void test_decode_every_cluster_size(void **state)
{
    gpu_fixture *f = *state;
    static const layout ls[] = {{128, 32, 8}, {128, 28, 4}, {64, 14, 2}};
    enum { S = 5 };
    const uint32_t lens[S] = {0, 1, 64, 700, 3000};
    for (size_t l = 0; l < sizeof ls / sizeof ls[0]; l++)
        for (uint32_t n = 1; n <= 16; n *= 2) {
            if (quick() && l == 1)
                continue;
            const uint32_t pairs = S * (uint32_t)ls[l].KVH * (uint32_t)((ls[l].H / ls[l].KVH + 7) / 8);
            kiln__paged_attention_set_split_target(pairs * n);
            char label[64];
            snprintf(label, sizeof label, "decode cluster %u", n);
            decode_case(f, ls[l], S, lens, S, 1, 0, label);
            kiln__paged_attention_set_split_target(0);
        }
}

/* Both stage counts of the one-kernel decode, forced (the encode takes 4
 * only where the grid is resident at one block an SM, so which cases take
 * which depends on the device's SMs): edge lengths at 8 sequences (clusters
 * of 2 on 132 SMs), 32 x ~1024 (unsplit), 1 x 16384 (clusters of 8), head_dim
 * 128 (group 4); head_dim 64 (group 7) once, its 4 stages being all it takes. */
static void test_decode_both_stage_counts(void **state)
{
    gpu_fixture *f = *state;
    static const layout ls[] = {{128, 32, 8}, {64, 14, 2}};
    for (int stages = 3; stages <= 4; stages++) {
        kiln__paged_attention_set_decode_stages(stages);
        for (size_t l = 0; l < sizeof ls / sizeof ls[0]; l++) {
            if (ls[l].D == 64 && stages == 3)
                continue; /* head_dim 64 takes 4 whatever is forced: run once */
            char label[64];
            snprintf(label, sizeof label, "decode %d stages edges", stages);
            decode_edges(f, ls[l], 0, label);
            if (quick() || l)
                continue;
            const uint32_t k1023[8] = {1023, 1023, 1023, 1023, 1023, 1023, 1023, 1023};
            snprintf(label, sizeof label, "decode %d stages 32 x ~1024", stages);
            decode_case(f, ls[l], 32, k1023, 8, 1100, 1, label);
            const uint32_t longest[1] = {16383};
            snprintf(label, sizeof label, "decode %d stages 1 x 16384", stages);
            decode_case(f, ls[l], 1, longest, 1, 1, 0, label);
        }
    }
    kiln__paged_attention_set_decode_stages(0);
}

/* The two-kernel decode (templates/paged_attention.cu, unsplit), which a
 * device short of the one-kernel decode's shared memory takes (sm_86, sm_89,
 * sm_12x at head_dim 128): groups 4 (4 rows a block), 7 (8 rows) and 32 (the
 * prefill's 16 rows, two row tiles), the same edge lengths as the split
 * decode, fused qkv once. */
static void test_decode_two_kernel(void **state)
{
    gpu_fixture *f = *state;
    static const layout ls[] = {{128, 32, 8}, {64, 14, 2}, {64, 64, 2}};
    kiln__paged_attention_set_two_kernel_decode(1);
    for (size_t l = 0; l < sizeof ls / sizeof ls[0]; l++) {
        decode_edges(f, ls[l], l == 1, "two-kernel decode edges");
        if (quick())
            continue;
        const uint32_t longest[1] = {16383};
        decode_case(f, ls[l], 1, longest, 1, 1, 0, "two-kernel decode 1 x 16384");
        decode_case(f, ls[l], 32, NULL, 0, 3000, l == 0, "two-kernel decode 32 x ~3000");
    }
    kiln__paged_attention_set_two_kernel_decode(0);
}

/* q, k and v from one fused tensor: chunked prefill and decode, with and
 * without the workspace. */
static void test_fused_qkv(void **state)
{
    gpu_fixture *f = *state;
    for (size_t l = 1; l < N_LAYOUTS; l += 2) {
        enum { S = 5 };
        uint32_t ctx[S], cap[S], count[S], one[S];
        for (uint32_t i = 0; i < S; i++) {
            ctx[i] = i == 0 ? 0 : kiln_rng_below(&f->rng, quick() ? 200 : 1500);
            count[i] = i == 3 ? 0 : 1 + kiln_rng_below(&f->rng, quick() ? 60 : 300);
            cap[i] = ctx[i] + count[i] + 2;
            one[i] = 1;
        }
        sess s;
        sess_init(&s, f, layouts[l], S, ctx, cap, 1e6f);
        step pre = {.count = count, .fused = 1};
        KILN_CHECK(run_step(&s, &pre, "fused prefill"));
        step dec = {.count = one, .max_query = 1, .fused = 1};
        KILN_CHECK(run_step(&s, &dec, "fused decode"));
        dec.no_workspace = 1;
        KILN_CHECK(run_step(&s, &dec, "fused decode"));
        sess_free(&s);
    }
}

/* Bad device data: the lowest bad sequence named, the others computed. */
static void test_bad_device_data_is_reported(void **state)
{
    gpu_fixture *f = *state;
    static const struct {
        bad_kind bad;
        uint32_t max_query;
        const char *n1, *n2;
    } cases[] = {
        {BAD_TABLE, 0, "sequence 1's block table entry", "pages of kv_pages"},
        {BAD_LEN, 0, "sequence 1 has seq_len", "longer than its block table holds"},
        {BAD_SPAN, 0, "sequence 1's query span ends at token", "past the"},
        {BAD_COUNT, 0, "sequence 1 has", "more than its limit"},
        {BAD_OVER_MAX, 1, "sequence 1 has 3 new tokens", "limit 1"}, /* a decode command given 3 tokens */
        {BAD_TABLE, 1, "sequence 1's block table entry", "pages of kv_pages"}, /* split decode */
        {BAD_TABLE_FIRST, 1, "sequence 1's block table entry", "pages of kv_pages"},
        {BAD_TABLE_FIRST, 0, "sequence 1's block table entry", "pages of kv_pages"},
        {BAD_LEN, 1, "sequence 1 has seq_len", "longer than its block table holds"},
    };
    /* Twice: then prefill on a grid of 2 blocks, so that a block meets the
     * bad sequence's items between good ones (the wgmma prefill's work
     * items; the other kernels ignore it). */
    for (size_t i = 0; i < 2 * (sizeof cases / sizeof cases[0]); i++) {
        enum { S = 4 };
        const size_t c = i % (sizeof cases / sizeof cases[0]);
        kiln__paged_attention_set_prefill_blocks(i == c ? 0 : 2);
        uint32_t ctx[S] = {5, 100, 40, 1077}, cap[S], count[S] = {3, 3, 3, 3};
        if (cases[c].max_query == 1)
            count[0] = count[2] = count[3] = 1;
        if (cases[c].max_query == 1 && cases[c].bad != BAD_OVER_MAX)
            count[1] = 1;
        for (uint32_t k = 0; k < S; k++)
            cap[k] = ctx[k] + 2 * count[k]; /* room for the clean step after */
        sess s;
        sess_init(&s, f, layouts[1], S, ctx, cap, 10000.0f);
        step st = {.count = count, .max_query = cases[c].max_query, .bad = cases[c].bad};
        kiln_status got = run_step(&s, &st, "bad data");
        kiln_test_expect(got, KILN_ERR_DEVICE_CONTRACT, kiln_errmsg(), cases[c].n1, cases[c].n2);
        fprintf(stderr, "reported: %s\n", kiln_errmsg());
        /* The stream goes on: a clean step afterwards. */
        step ok = {.count = count};
        KILN_CHECK(run_step(&s, &ok, "after bad data"));
        sess_free(&s);
    }
    kiln__paged_attention_set_prefill_blocks(0);
}

/* One decode command, encoded once on a binding arena, replayed from a graph
 * over several steps: positions, lengths, spans and block tables change
 * every step without a new command. Each step then runs the same command
 * eager on the same inputs: the same bits (split-KV combines in a fixed
 * order whatever order its blocks finish in). */
typedef struct replay {
    gpu_fixture *f;
    kiln_binding_arena *arena;
    kiln_buffer *q, *k, *v, *qkv, *out, *ws;
    kiln_command *cmd;
    size_t q_bytes, kv_bytes;
    int64_t H, KVH, D;
    int steps;
} replay;

static kiln_status replay_runner(void *user, const step_io *io)
{
    replay *r = user;
    if (r->qkv) {
        const int64_t W = (r->H + 2 * r->KVH) * r->D, QW = r->H * r->D, KW = r->KVH * r->D;
        uint16_t *packed = malloc((size_t)io->T * W * 2);
        assert_non_null(packed);
        for (uint32_t t = 0; t < io->T; t++) {
            memcpy(packed + (size_t)t * W, io->q + (size_t)t * QW, (size_t)QW * 2);
            memcpy(packed + (size_t)t * W + QW, io->k + (size_t)t * KW, (size_t)KW * 2);
            memcpy(packed + (size_t)t * W + QW + KW, io->v + (size_t)t * KW, (size_t)KW * 2);
        }
        KILN_CHECK(kiln_buffer_upload(r->qkv, 0, packed, (size_t)io->T * W * 2));
        free(packed);
    } else {
        KILN_CHECK(kiln_buffer_upload(r->q, 0, io->q, r->q_bytes));
        KILN_CHECK(kiln_buffer_upload(r->k, 0, io->k, r->kv_bytes));
        KILN_CHECK(kiln_buffer_upload(r->v, 0, io->v, r->kv_bytes));
    }
    KILN_CHECK(kiln_buffer_fill(r->out, 0, 0xff, r->q_bytes));
    KILN_CHECK(kiln_runtime_synchronize(r->f->rt));
    kiln_binding_patch p[4] = {{0, 0, io->pos, (size_t)io->T * 4},
                               {1, 0, io->table, (size_t)io->S * io->MB * 4},
                               {2, 0, io->lens, (size_t)io->S * 4},
                               {3, 0, io->spans, (size_t)io->S * 8}};
    kiln_submit_options so = {.path = KILN_PATH_REPLAYED_ONLY, .phase = "decode", .arena = r->arena,
                              .patches = p, .n_patches = 4};
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_prepare(r->f->s, &r->cmd, 1, &so, NULL));
    KILN_CHECK(kiln_stream_submit(r->f->s, &r->cmd, 1, &so, &fence));
    kiln_status st = kiln_fence_wait(fence);
    kiln_attribution a;
    KILN_CHECK(kiln_fence_attribution(fence, 0, &a));
    assert_int_equal(a.path, KILN_EXEC_REPLAYED);
    assert_string_equal(a.op_id, "paged_attention");
    assert_int_equal(a.dispatches, 1); /* decode: append and attention in one kernel */
    kiln_fence_release(fence);
    KILN_CHECK(kiln_stream_synchronize(r->f->s));
    void *tmp = malloc(r->q_bytes), *eager = malloc(r->q_bytes);
    assert_true(tmp && eager);
    KILN_CHECK(kiln_buffer_readback(r->out, 0, tmp, r->q_bytes));
    /* Eager, same inputs (the append writes the same k and v again). */
    KILN_CHECK(kiln_buffer_fill(r->out, 0, 0xff, r->q_bytes));
    KILN_CHECK(kiln_buffer_fill(r->ws, 0, 0xff, kiln_buffer_size(r->ws)));
    KILN_CHECK(kiln_runtime_synchronize(r->f->rt));
    so.path = KILN_PATH_EAGER_ONLY;
    KILN_CHECK(kiln_stream_submit(r->f->s, &r->cmd, 1, &so, NULL));
    KILN_CHECK(kiln_stream_synchronize(r->f->s));
    KILN_CHECK(kiln_buffer_readback(r->out, 0, eager, r->q_bytes));
    if (memcmp(tmp, eager, r->q_bytes))
        fail_msg("decode replayed: the eager run of the same command gave other bits");
    KILN_CHECK(kiln_buffer_upload(io->out, 0, tmp, r->q_bytes));
    free(tmp);
    free(eager);
    r->steps++;
    return st;
}

static void test_decode_replayed_over_steps(void **state)
{
    gpu_fixture *f = *state;
    for (size_t l = 1; l < N_LAYOUTS; l += 2) {
        const layout L = layouts[l];
        const int fused = l != 3;
        enum { S = 9, STEPS = 4 };
        uint32_t ctx[S], cap[S], count[S];
        for (uint32_t i = 0; i < S; i++) {
            ctx[i] = i == 0 ? 0 : 1 + kiln_rng_below(&f->rng, i == 1 ? 5000 : 700);
            cap[i] = ctx[i] + STEPS;
            count[i] = 1;
        }
        sess s;
        sess_init(&s, f, L, S, ctx, cap, 1e6f);
        replay r = {.f = f, .q_bytes = (size_t)S * L.H * L.D * 2, .kv_bytes = (size_t)S * L.KVH * L.D * 2,
                    .H = L.H, .KVH = L.KVH, .D = L.D};
        const size_t tb = (size_t)S * s.MB * 4;
        kiln_binding_slot slots[4] = {{0, 256}, {256, (tb + 255) / 256 * 256}, {0, 256}, {0, 256}};
        slots[2].offset = slots[1].offset + slots[1].bytes;
        slots[3].offset = slots[2].offset + 256;
        KILN_CHECK(kiln_binding_arena_create(f->rt, slots, 4, slots[3].offset + 256, &r.arena));
        kiln_buffer *ab = kiln_binding_arena_buffer(r.arena);
        const int64_t W = (L.H + 2 * L.KVH) * L.D;
        size_t ws_bytes;
        KILN_CHECK(kiln_op_paged_attention_workspace(S, L.H, L.KVH, L.D, 1, &ws_bytes));
        assert_int_equal(ws_bytes, 0); /* none needed; one given is left alone */
        ws_bytes = 4096;
        r.ws = buffer(f->rt, ws_bytes);
        r.out = buffer(f->rt, r.q_bytes);
        if (fused) {
            r.qkv = buffer(f->rt, (size_t)S * W * 2);
        } else {
            r.q = buffer(f->rt, r.q_bytes);
            r.k = buffer(f->rt, r.kv_bytes);
            r.v = buffer(f->rt, r.kv_bytes);
        }
        kiln_tensor tq = {.buffer = r.q, .dtype = KILN_DTYPE_F16, .rank = 3, .dims = {S, L.H, L.D}},
                    to = {.buffer = r.out, .dtype = KILN_DTYPE_F16, .rank = 3, .dims = {S, L.H, L.D}},
                    tk = {.buffer = r.k, .dtype = KILN_DTYPE_F16, .rank = 3, .dims = {S, L.KVH, L.D}},
                    tv = {.buffer = r.v, .dtype = KILN_DTYPE_F16, .rank = 3, .dims = {S, L.KVH, L.D}},
                    tf = {.buffer = r.qkv, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {S, W}},
                    tp = {.buffer = ab, .offset = slots[0].offset, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {S}},
                    tt = {.buffer = ab, .offset = slots[1].offset, .dtype = KILN_DTYPE_U32, .rank = 2,
                          .dims = {S, s.MB}},
                    tl = {.buffer = ab, .offset = slots[2].offset, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {S}},
                    ts = {.buffer = ab, .offset = slots[3].offset, .dtype = KILN_DTYPE_U32, .rank = 2,
                          .dims = {S, 2}};
        kiln_region pr = {s.pages, 0, (size_t)s.n_pages * KILN_PAGED_KV_PAGE_BYTES}, wr = {r.ws, 0, ws_bytes};
        kiln_paged_attention_desc d = {.size = sizeof d, .q = fused ? NULL : &tq, .k = fused ? NULL : &tk,
                                       .v = fused ? NULL : &tv, .positions = &tp, .block_table = &tt,
                                       .seq_lens = &tl, .query_spans = &ts, .out = &to, .kv_pages = &pr,
                                       .rope_theta = s.theta, .max_query_tokens = 1, .workspace = &wr,
                                       .qkv = fused ? &tf : NULL};
        KILN_CHECK(kiln_op_paged_attention_encode(f->jit, &d, &r.cmd));
        for (int k = 0; k < STEPS; k++) {
            step st = {.count = count, .max_query = 1, .runner = replay_runner, .user = &r};
            KILN_CHECK(run_step(&s, &st, fused ? "decode replayed fused" : "decode replayed"));
        }
        assert_int_equal(r.steps, STEPS);
        assert_int_equal(kiln_binding_arena_uploads(r.arena), 2 * STEPS);
        kiln_command_release(r.cmd);
        kiln_buffer *all[6] = {r.q, r.k, r.v, r.qkv, r.out, r.ws};
        for (int i = 0; i < 6; i++)
            kiln_buffer_destroy(all[i]);
        kiln_binding_arena_destroy(r.arena);
        sess_free(&s);
    }
}

/* ---- bf16, and scaled and partial RoPE ---- */

/* bf16 prefill on the kernel this device takes (wgmma on sm_90, mma.sync
 * elsewhere): single sequences, packed sequences with cached prefixes, and a
 * chunk after a long cached prefix, every layout. */
static void test_bf16_prefill(void **state)
{
    gpu_fixture *f = *state;
    next_cfg.elt = KILN_DTYPE_BF16;
    static const uint32_t lens[] = {1, 37, 300, 1000};
    for (size_t l = 0; l < N_LAYOUTS; l++)
        for (size_t i = 0; i < (quick() ? 2 : 4); i++)
            prefill_one(f, layouts[l], lens[i], l % 2 ? 1e6f : 10000.0f);
    prefill_packed(f);
    static const size_t chunked[] = {1, 5};
    for (size_t i = 0; i < 2; i++) {
        sess s;
        uint32_t ctx = quick() ? 1000 : 5000, count = 300, cap = ctx + count;
        sess_init(&s, f, layouts[chunked[i]], 1, &ctx, &cap, 500000.0f);
        step st = {.count = &count};
        KILN_CHECK(run_step(&s, &st, "bf16 prefill after a cached prefix"));
        sess_free(&s);
    }
}

/* The other prefill kernels in bf16: mma.sync and the CUDA cores. */
static void test_bf16_prefill_mma(void **state)
{
    next_cfg.elt = KILN_DTYPE_BF16;
    prefill_forced(*state, KILN__PREFILL_MMA);
}

static void test_bf16_prefill_cuda_core(void **state)
{
    next_cfg.elt = KILN_DTYPE_BF16;
    prefill_forced(*state, KILN__PREFILL_CUDA_CORE);
}

/* bf16 decode: the one-kernel decode (split at the edge lengths, unsplit at
 * 32 sequences, fused once, a long sequence) and the two-kernel decode. */
static void test_bf16_decode(void **state)
{
    gpu_fixture *f = *state;
    next_cfg.elt = KILN_DTYPE_BF16;
    static const layout ls[] = {{128, 32, 8}, {64, 14, 2}, {128, 8, 8}, {64, 64, 2}};
    for (size_t l = 0; l < sizeof ls / sizeof ls[0]; l++) {
        decode_edges(f, ls[l], l == 1, "bf16 decode edges");
        if (quick())
            continue;
        decode_case(f, ls[l], 32, NULL, 0, 1100, l == 0, "bf16 decode 32 x ~1024");
        const uint32_t longest[1] = {16383};
        decode_case(f, ls[l], 1, longest, 1, 1, 0, "bf16 decode 1 x 16384");
    }
    kiln__paged_attention_set_two_kernel_decode(1);
    for (size_t l = 0; l < 2; l++)
        decode_edges(f, ls[l], l == 1, "bf16 two-kernel decode edges");
    kiln__paged_attention_set_two_kernel_decode(0);
}

/* Scaled, partial RoPE (an arbitrary table of inverse frequencies, as the
 * caller computes for llama3 or yarn, cos and sin times scaling, rope_dim of
 * the head_dim dims rotated) in elt, on one session of 3 sequences with
 * cached prefixes, every kernel in turn: chunked prefill on this device's
 * tensor-core kernel, on mma.sync, on the CUDA cores, then the one-kernel
 * decode, then the two-kernel decode. */
static void rope_case(gpu_fixture *f, layout L, kiln_dtype elt, int64_t rope_dim, float scaling)
{
    float inv[64];
    for (int64_t i = 0; i < rope_dim / 2; i++) /* log-uniform in [1e-4, 2] */
        inv[i] = (float)exp(log(1e-4) + (log(2.0) - log(1e-4)) * (double)kiln_rng_below(&f->rng, 1u << 20) /
                                            (double)(1u << 20));
    next_cfg.elt = elt;
    next_cfg.inv = inv;
    next_cfg.scaling = scaling;
    next_cfg.rope_dim = rope_dim;
    enum { S = 3 };
    uint32_t ctx[S], cap[S], count[S][3], one[S] = {1, 1, 1};
    for (uint32_t i = 0; i < S; i++) {
        ctx[i] = i == 0 ? 0 : kiln_rng_below(&f->rng, quick() ? 200 : 1500);
        cap[i] = ctx[i] + 2;
        for (int k = 0; k < 3; k++) {
            count[i][k] = 1 + kiln_rng_below(&f->rng, quick() ? 40 : 200);
            cap[i] += count[i][k];
        }
    }
    sess s;
    sess_init(&s, f, L, S, ctx, cap, 10000.0f);
    static const int kernels[3] = {0, KILN__PREFILL_MMA, KILN__PREFILL_CUDA_CORE};
    static const char *const names[3] = {"rope prefill", "rope prefill mma", "rope prefill cuda-core"};
    for (int k = 0; k < 3; k++) {
        uint32_t c[S] = {count[0][k], count[1][k], count[2][k]};
        kiln__paged_attention_set_prefill_kernel(kernels[k]);
        step st = {.count = c};
        KILN_CHECK(run_step(&s, &st, names[k]));
    }
    kiln__paged_attention_set_prefill_kernel(0);
    step dec = {.count = one, .max_query = 1};
    KILN_CHECK(run_step(&s, &dec, "rope decode"));
    kiln__paged_attention_set_two_kernel_decode(1);
    KILN_CHECK(run_step(&s, &dec, "rope two-kernel decode"));
    kiln__paged_attention_set_two_kernel_decode(0);
    sess_free(&s);
    next_cfg.inv = NULL;
    next_cfg.scaling = 0.0f;
    next_cfg.rope_dim = 0;
}

static void test_scaled_partial_rope(void **state)
{
    gpu_fixture *f = *state;
    static const layout ls[] = {{128, 32, 8}, {64, 14, 2}};
    for (int b = 0; b < 2; b++) {
        const kiln_dtype elt = b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
        for (size_t l = 0; l < 2; l++) {
            rope_case(f, ls[l], elt, ls[l].D / 2, 1.3f); /* half the head: pairs of 8-dim runs */
            rope_case(f, ls[l], elt, ls[l].D, 1.3f);     /* the whole head, a table */
        }
        rope_case(f, ls[0], elt, 20, 0.0f); /* 10 pairs: runs that are not whole 16-byte vectors */
    }
}

/* A sliding window (Mistral's sliding_window) of W keys, in elt, on one
 * session of 4 sequences: the first with no cached prefix, the others with
 * prefixes shorter and longer than W; chunked prefill on every prefill
 * kernel in turn, then decode on the one-kernel and the two-kernel paths,
 * split and unsplit. W = 1 leaves each token its own key. */
static void window_case(gpu_fixture *f, layout L, kiln_dtype elt, uint32_t W)
{
    next_cfg.elt = elt;
    next_cfg.window = W;
    enum { S = 4 };
    uint32_t ctx[S], cap[S], count[S][3], one[S] = {1, 1, 1, 1};
    for (uint32_t i = 0; i < S; i++) {
        ctx[i] = i == 0 ? 0 : i == 1 ? kiln_rng_below(&f->rng, W + 1) : W + kiln_rng_below(&f->rng, quick() ? 300 : 3000);
        cap[i] = ctx[i] + 3;
        for (int k = 0; k < 3; k++) {
            count[i][k] = 1 + kiln_rng_below(&f->rng, quick() ? 100 : 2 * W + 300);
            cap[i] += count[i][k];
        }
    }
    sess s;
    sess_init(&s, f, L, S, ctx, cap, 10000.0f);
    static const int kernels[3] = {0, KILN__PREFILL_MMA, KILN__PREFILL_CUDA_CORE};
    static const char *const names[3] = {"window prefill", "window prefill mma", "window prefill cuda-core"};
    for (int k = 0; k < 3; k++) {
        uint32_t c[S] = {count[0][k], count[1][k], count[2][k], count[3][k]};
        kiln__paged_attention_set_prefill_kernel(kernels[k]);
        step st = {.count = c};
        KILN_CHECK(run_step(&s, &st, names[k]));
    }
    kiln__paged_attention_set_prefill_kernel(0);
    step dec = {.count = one, .max_query = 1};
    KILN_CHECK(run_step(&s, &dec, "window decode"));
    dec.no_workspace = 1; /* one block per sequence and kv head: no split */
    KILN_CHECK(run_step(&s, &dec, "window decode unsplit"));
    dec.no_workspace = 0;
    kiln__paged_attention_set_two_kernel_decode(1);
    KILN_CHECK(run_step(&s, &dec, "window two-kernel decode"));
    kiln__paged_attention_set_two_kernel_decode(0);
    sess_free(&s);
    next_cfg.window = 0;
}

static void test_sliding_window(void **state)
{
    gpu_fixture *f = *state;
    static const layout ls[] = {{128, 32, 8}, {64, 14, 2}, {128, 8, 8}};
    static const uint32_t windows[] = {1, 37, 128, 200, 1000};
    for (int b = 0; b < 2; b++)
        for (size_t l = 0; l < 3; l++)
            for (size_t w = 0; w < (quick() ? 3 : 5); w++)
                if (!b || w % 2 == 0)
                    window_case(f, ls[l], b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16, windows[w]);
}

/* head_dim 256 (Qwen3-Next's attention layers: 16 / 2 heads; Gemma's): the
 * wgmma prefill on sm_90, the CUDA-core kernel elsewhere and for decode:
 * prefills of one sequence, packed chunked prefill, decode (one and seven
 * sequences, two steps), a sliding window, in f16 and bf16. */
static void test_head_dim_256(void **state)
{
    gpu_fixture *f = *state;
    static const layout ls[] = {{256, 16, 2}, {256, 8, 8}, {256, 32, 16}};
    static const uint32_t lens[] = {1, 37, 300, 1000};
    for (int b = 0; b < 2; b++) {
        next_cfg.elt = b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
        for (size_t l = 0; l < 3; l++) {
            for (size_t i = 0; i < (quick() ? 2 : 4); i++)
                prefill_one(f, ls[l], lens[i], 1e7f);
            enum { S = 3 };
            uint32_t ctx[S], cap[S], count[S], one[S] = {1, 1, 1};
            for (uint32_t i = 0; i < S; i++) {
                ctx[i] = i == 0 ? 0 : kiln_rng_below(&f->rng, quick() ? 300 : 2000);
                count[i] = 1 + kiln_rng_below(&f->rng, quick() ? 60 : 300);
                cap[i] = ctx[i] + count[i] + 2;
            }
            sess s;
            sess_init(&s, f, ls[l], S, ctx, cap, 1e7f);
            step st = {.count = count};
            KILN_CHECK(run_step(&s, &st, "hd256 packed prefill"));
            step dec = {.count = one, .max_query = 1};
            KILN_CHECK(run_step(&s, &dec, "hd256 decode"));
            KILN_CHECK(run_step(&s, &dec, "hd256 decode 2"));
            sess_free(&s);
        }
        window_case(f, ls[0], next_cfg.elt, 100);
    }
    next_cfg.elt = KILN_DTYPE_F16;
}

/* One sequence of T new tokens (prefill, no cached prefix) on this device's
 * prefill kernel, every output element checked against the CUDA-core prefill
 * (templates/paged_attention.cu: f32 scores and P.V, an independent
 * implementation that the tests above check against float64) on the same
 * inputs: at 32768 tokens a float64 host reference of 2^29 scores a head is
 * too slow. A third run, of the CUDA-core kernel on |v|, gives each
 * element's sum p |v| / sum p, the scale of the tensor-core kernel's p
 * rounding. Both sides round their output: the tolerance is twice run_step's. */
static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void long_prefill(gpu_fixture *f, layout L, uint32_t T, kiln_dtype elt)
{
    next_cfg.elt = elt;
    sess s;
    uint32_t ctx = 0, cap = T;
    sess_init(&s, f, L, 1, &ctx, &cap, 500000.0f);
    const int64_t H = L.H, KVH = L.KVH, D = L.D;
    const size_t qn = (size_t)T * H * D, kn = (size_t)T * KVH * D;
    uint16_t *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2), *vabs = malloc(kn * 2), *outs[3];
    uint32_t *pos = malloc((size_t)T * 4), spans[2] = {0, T}, lens[1] = {T};
    assert_true(q && k && v && vabs && pos);
    fill_e(&f->rng, s.bf16, q, qn);
    fill_e(&f->rng, s.bf16, k, kn);
    fill_e(&f->rng, s.bf16, v, kn);
    for (size_t i = 0; i < kn; i++)
        vabs[i] = v[i] & 0x7fff;
    for (uint32_t t = 0; t < T; t++)
        pos[t] = t;
    kiln_buffer *bq = buffer(f->rt, qn * 2), *bk = buffer(f->rt, kn * 2), *bv = buffer(f->rt, kn * 2),
                *bva = buffer(f->rt, kn * 2), *bo = buffer(f->rt, qn * 2), *bp = buffer(f->rt, (size_t)T * 4),
                *bt = buffer(f->rt, (size_t)s.MB * 4), *bl = buffer(f->rt, 4), *bs = buffer(f->rt, 8);
    KILN_CHECK(kiln_buffer_upload(bq, 0, q, qn * 2));
    KILN_CHECK(kiln_buffer_upload(bk, 0, k, kn * 2));
    KILN_CHECK(kiln_buffer_upload(bv, 0, v, kn * 2));
    KILN_CHECK(kiln_buffer_upload(bva, 0, vabs, kn * 2));
    KILN_CHECK(kiln_buffer_upload(bp, 0, pos, (size_t)T * 4));
    KILN_CHECK(kiln_buffer_upload(bt, 0, s.table, (size_t)s.MB * 4));
    KILN_CHECK(kiln_buffer_upload(bl, 0, lens, 4));
    KILN_CHECK(kiln_buffer_upload(bs, 0, spans, 8));
    kiln_tensor tq = {.buffer = bq, .dtype = elt, .rank = 3, .dims = {T, H, D}},
                tk = {.buffer = bk, .dtype = elt, .rank = 3, .dims = {T, KVH, D}},
                tv = {.buffer = bv, .dtype = elt, .rank = 3, .dims = {T, KVH, D}},
                to = {.buffer = bo, .dtype = elt, .rank = 3, .dims = {T, H, D}},
                tp = {.buffer = bp, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {T}},
                tt = {.buffer = bt, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {1, s.MB}},
                tl = {.buffer = bl, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {1}},
                ts = {.buffer = bs, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {1, 2}};
    kiln_region pr = {s.pages, 0, (size_t)s.n_pages * KILN_PAGED_KV_PAGE_BYTES};
    kiln_paged_attention_desc d = {.size = sizeof d, .q = &tq, .k = &tk, .v = &tv, .positions = &tp,
                                   .block_table = &tt, .seq_lens = &tl, .query_spans = &ts, .out = &to,
                                   .kv_pages = &pr, .rope_theta = s.theta};
    double secs[3];
    for (int run = 0; run < 3; run++) {
        outs[run] = malloc(qn * 2);
        assert_non_null(outs[run]);
        kiln__paged_attention_set_prefill_kernel(run ? KILN__PREFILL_CUDA_CORE : 0);
        tv.buffer = run == 2 ? bva : bv;
        KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, qn * 2)); /* NaN */
        kiln_command *cmd;
        KILN_CHECK(kiln_op_paged_attention_encode(f->jit, &d, &cmd));
        KILN_CHECK(kiln_runtime_synchronize(f->rt));
        const double t0 = now_s();
        KILN_CHECK(kiln_stream_submit(f->s, &cmd, 1, NULL, NULL));
        KILN_CHECK(kiln_stream_synchronize(f->s));
        secs[run] = now_s() - t0;
        kiln_command_release(cmd);
        KILN_CHECK(kiln_buffer_readback(bo, 0, outs[run], qn * 2));
    }
    kiln__paged_attention_set_prefill_kernel(0);
    const double tol = s.bf16 ? ldexp(1, -6) : 2 * TOL, p_round = ldexp(1, s.bf16 ? -7 : -10);
    size_t wrong = 0;
    double worst = 0;
    for (size_t e = 0; e < qn; e++) {
        const double tc = dec(&s, outs[0][e]), cc = dec(&s, outs[1][e]), mag = dec(&s, outs[2][e]);
        /* |sum p v| <= sum p |v|: the |v| run is the same softmax's. */
        const int sane = isfinite(cc) && isfinite(mag) && fabs(cc) <= mag * (1 + tol);
        const double err = isfinite(tc) && sane ? fabs(tc - cc) / (fmax(fabs(cc), FLOOR) + p_round / tol * mag)
                                                : INFINITY;
        worst = err > worst ? err : worst;
        if (err > tol && wrong++ < 5)
            fprintf(stderr, "token %zu head %lld d %lld: got %.6g, CUDA-core %.6g (sum p|v| / sum p %.6g)\n",
                    e / (size_t)(H * D), (long long)(e / D % H), (long long)(e % D), tc, cc, mag);
    }
    fprintf(stderr, "prefill %u vs the CUDA cores: %s D %lld H %lld KVH %lld: %zu outputs, max rel err %.3g "
                    "(%.3f s, CUDA cores %.3f s, %.3f s)\n",
            T, s.bf16 ? "bf16" : "f16", (long long)D, (long long)H, (long long)KVH, qn, worst, secs[0], secs[1],
            secs[2]);
    if (wrong)
        fail_msg("prefill %u: %zu of %zu outputs off the CUDA-core kernel's", T, wrong, qn);
    kiln_buffer *all[9] = {bq, bk, bv, bva, bo, bp, bt, bl, bs};
    for (int i = 0; i < 9; i++)
        kiln_buffer_destroy(all[i]);
    for (int run = 0; run < 3; run++)
        free(outs[run]);
    free(q);
    free(k);
    free(v);
    free(vabs);
    free(pos);
    sess_free(&s);
}

/* 32768 tokens: f16 at head_dim 128 (group 1), bf16 at head_dim 64 (group 7). */
static void test_prefill_32768_tokens(void **state)
{
    gpu_fixture *f = *state;
    if (quick())
        return;
    long_prefill(f, (layout){128, 8, 8}, 32768, KILN_DTYPE_F16);
    long_prefill(f, (layout){64, 14, 2}, 32768, KILN_DTYPE_BF16);
}

/* Refused at encode, before anything runs. */
static void test_contract_errors_at_encode(void **state)
{
    gpu_fixture *f = *state;
    kiln_buffer *b = buffer(f->rt, 8 << 20), *kv = buffer(f->rt, 4 * KILN_PAGED_KV_PAGE_BYTES);
    kiln_tensor tq = {.buffer = b, .offset = 0, .dtype = KILN_DTYPE_F16, .rank = 3, .dims = {4, 28, 128}},
                tk = {.buffer = b, .offset = 1 << 20, .dtype = KILN_DTYPE_F16, .rank = 3, .dims = {4, 3, 128}},
                tv = tk, to = tq,
                tp = {.buffer = b, .offset = 4 << 20, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {4}},
                tt = {.buffer = b, .offset = 5 << 20, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {2, 8}},
                tl = {.buffer = b, .offset = 6 << 20, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {2}},
                ts = {.buffer = b, .offset = 7 << 20, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {2, 2}};
    tv.offset = 2 << 20;
    to.offset = 3 << 20;
    kiln_region pr = {kv, 0, 4 * KILN_PAGED_KV_PAGE_BYTES};
    kiln_paged_attention_desc d = {0, &tq, &tk, &tv, &tp, &tt, &tl, &ts, &to, &pr, 10000.0f, 0, NULL, NULL, NULL, 0.0f, 0, 0};
    kiln_command *cmd = NULL;
    KILN_EXPECT(kiln_op_paged_attention_encode(f->jit, &d, &cmd), KILN_ERR_RUNTIME_CONTRACT,
                kiln_runtime_errmsg(f->rt), "3 kv heads", "does not divide the 28 heads");
    assert_null(cmd);
    tk.dims[1] = tv.dims[1] = 4;
    KILN_CHECK(kiln_op_paged_attention_encode(f->jit, &d, &cmd));
    kiln_command_release(cmd);
    /* bf16 x with an f16 k, and a bf16 cache with f16 q: refused naming both dtypes. */
    tq.dtype = KILN_DTYPE_BF16;
    KILN_EXPECT(kiln_op_paged_attention_encode(f->jit, &d, &cmd), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding k must be bf16", "got f16");
    tq.dtype = KILN_DTYPE_F16;
    kiln_buffer_desc bd = {.size = sizeof bd, .bytes = 4 * KILN_PAGED_KV_PAGE_BYTES, .dtype = KILN_DTYPE_BF16,
                           .usage = KILN_USAGE_KV_CACHE};
    kiln_buffer *kvb;
    KILN_CHECK(kiln_buffer_create_ex(f->rt, &bd, &kvb));
    pr.buffer = kvb;
    KILN_EXPECT(kiln_op_paged_attention_encode(f->jit, &d, &cmd), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages is a bf16 buffer", "q is f16");
    pr.buffer = kv;
    kiln_buffer_destroy(kvb);
    /* rope_dim odd. */
    d.rope_dim = 33;
    KILN_EXPECT(kiln_op_paged_attention_encode(f->jit, &d, &cmd), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rope_dim 33", "even");
    d.rope_dim = 0;
    pr.end = 4 * KILN_PAGED_KV_PAGE_BYTES - 256;
    KILN_EXPECT(kiln_op_paged_attention_encode(f->jit, &d, &cmd), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "whole 65536-byte pages", NULL);
    KILN_CHECK(kiln_stream_synchronize(f->s));
    kiln_buffer_destroy(b);
    kiln_buffer_destroy(kv);
}

/* Every test's teardown: the provider's test hooks back to their defaults, so
 * that a test failing halfway does not leave its switch to the ones after it. */
static int teardown_hooks(void **state)
{
    kiln__paged_attention_set_two_kernel_decode(0);
    kiln__paged_attention_set_prefill_kernel(0);
    kiln__paged_attention_set_split_target(0);
    kiln__paged_attention_set_decode_stages(0);
    kiln__paged_attention_set_prefill_blocks(0);
    next_cfg.elt = KILN_DTYPE_F16;
    next_cfg.inv = NULL;
    next_cfg.scaling = 0.0f;
    next_cfg.rope_dim = 0;
    next_cfg.window = 0;
    return gpu_fixture_teardown(state);
}

int main(void)
{
    kiln_test_require_gpu();
    kiln_test_filter();
    tables_init();
#define T(fn) cmocka_unit_test_setup_teardown(fn, gpu_fixture_setup, teardown_hooks)
    const struct CMUnitTest tests[] = {
        T(test_prefill_single_sequence),
        T(test_prefill_packed_with_prefixes),
        T(test_prefill_mma),
        T(test_prefill_cuda_core),
        T(test_decode),
        T(test_decode_split_lengths),
        T(test_decode_every_cluster_size),
        T(test_decode_both_stage_counts),
        T(test_decode_two_kernel),
        T(test_fused_qkv),
        T(test_decode_replayed_over_steps),
        T(test_bad_device_data_is_reported),
        T(test_bf16_prefill),
        T(test_bf16_prefill_mma),
        T(test_bf16_prefill_cuda_core),
        T(test_bf16_decode),
        T(test_scaled_partial_rope),
        T(test_sliding_window),
        T(test_head_dim_256),
        T(test_prefill_32768_tokens),
        T(test_contract_errors_at_encode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
