/* cuBLASLt products for the dense providers, and the per-process cache of
 * their heuristic results (see providers/blas.h for the layout algebra). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/blas.h"

/* Candidates asked of the heuristic for a shape. When a product is large
 * enough for the choice to matter (TUNE_MIN_FLOP), or narrow (at most
 * NARROW_ROWS tokens: a decode step's, whose cost is reading the weight) with a
 * weight of NARROW_MIN_BYTES or more, each candidate is timed once, on first
 * sight of the shape, on a private stream into private scratch (the bindings'
 * output and workspace are not touched: commands encoded earlier may still
 * read them), and the fastest is kept; else, or when timing fails, the
 * heuristic's first. KILN_BLAS_TUNE=0 turns timing off.
 * A narrow product is timed as a decoder runs it, its weight not in L2 (each
 * layer has its own): each timed call follows a write of twice the L2's bytes,
 * the median of NARROW_REPS calls. Timed back to back, a weight that fits in
 * L2 would be read from there after the first call and rank the candidates
 * wrongly; bench/bench_linear_tune times every candidate L2-cold. */
#define CANDIDATES 8
/* Asked of the heuristic, before the ones kiln never runs are dropped (see accurate()). */
#define ASKED 16
#define TUNE_MIN_FLOP (1ull << 34)
#define TUNE_TARGET_MS 2.0f /* timed per candidate */
#define TUNE_MAX_REPS 20
#define NARROW_ROWS 64
#define NARROW_MIN_BYTES ((uint64_t)8 << 20)
#define NARROW_REPS 7

/* Test hook: >= 0 takes that candidate of the heuristic's list (uncached). */
static _Atomic int forced_candidate = -1;
void kiln__blas_force_candidate(int index);
void kiln__blas_force_candidate(int index) { atomic_store(&forced_candidate, index < 0 ? -1 : index); }

/* Test hook: the configuration of the candidate last taken through
 * kiln__blas_force_candidate, as text (tests print it beside its errors). */
static char forced_config[256];
void kiln__blas_forced_config(char *buf, size_t cap);

/* The cache: 64 sets of 8 ways, least recently used evicted within a set.
 * Token counts change from batch to batch, so shapes keep coming; a bound
 * keeps a long-running process from growing without end. */
#define SETS 64
#define WAYS 8

typedef struct heur_key {
    uint64_t instance; /* the runtime (instance ids are never reused) */
    uint64_t m, n, k;
    uint32_t elt; /* an f16 and a bf16 product of one shape never share a plan */
    uint64_t workspace;
    uint32_t align_a, align_b, align_d, bias, parts;
} heur_key;

typedef struct heur_entry {
    heur_key key;
    cublasLtMatmulAlgo_t algo;
    float ms; /* the pick's time, 0 when not timed */
    uint64_t used; /* 0: empty */
} heur_entry;

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static heur_entry cache[SETS][WAYS];
static uint64_t tick, queries, hits, tuned, tuning_loaded, tuning_stored, tuning_stale;

/* What decides a timed choice besides the shape, in a tuning row's key: the
 * timing policy's constants (a change to them re-times). */
#define KILN__STR2(x) #x
#define KILN__STR(x) KILN__STR2(x)
#define TUNE_POLICY                                                                                                   \
    "candidates=" KILN__STR(CANDIDATES) "/" KILN__STR(ASKED) ",wide=hot:" KILN__STR(TUNE_TARGET_MS) "ms/"             \
    KILN__STR(TUNE_MAX_REPS) ",narrow=cold-median:" KILN__STR(NARROW_REPS) ",rows<=" KILN__STR(NARROW_ROWS)

void kiln__blas_tuning_counters(uint64_t *timed, uint64_t *loaded, uint64_t *stored, uint64_t *stale)
{
    pthread_mutex_lock(&cache_lock);
    if (timed)
        *timed = tuned;
    if (loaded)
        *loaded = tuning_loaded;
    if (stored)
        *stored = tuning_stored;
    if (stale)
        *stale = tuning_stale;
    pthread_mutex_unlock(&cache_lock);
}

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int kiln__blas_tuning_decode(const void *payload, size_t size, cublasLtMatmulAlgo_t *algo, float *ms)
{
    const uint8_t *p = payload;
    if (!p || size != KILN__BLAS_TUNING_PAYLOAD || memcmp(p, "KTL1", 4) || get_u32(p + 4) != sizeof *algo)
        return -1;
    uint32_t bits = get_u32(p + 8 + sizeof *algo), pick = get_u32(p + 12 + sizeof *algo),
             n = get_u32(p + 16 + sizeof *algo);
    float t;
    memcpy(&t, &bits, sizeof t);
    if (!(t >= 0 && t < 1e6f) || n < 1 || n > ASKED || pick >= n)
        return -1;
    memcpy(algo, p + 8, sizeof *algo);
    *ms = t;
    return 0;
}

static void tuning_encode(uint8_t out[KILN__BLAS_TUNING_PAYLOAD], const cublasLtMatmulAlgo_t *algo, float ms, int pick,
                          int n)
{
    uint32_t bits;
    memcpy(&bits, &ms, sizeof bits);
    memcpy(out, "KTL1", 4);
    put_u32(out + 4, (uint32_t)sizeof *algo);
    memcpy(out + 8, algo, sizeof *algo);
    put_u32(out + 8 + sizeof *algo, bits);
    put_u32(out + 12 + sizeof *algo, (uint32_t)pick);
    put_u32(out + 16 + sizeof *algo, (uint32_t)n);
}

/* Test hook: shapes whose candidates were timed. */
void kiln__blas_forced_config(char *buf, size_t cap)
{
    pthread_mutex_lock(&cache_lock);
    snprintf(buf, cap, "%s", forced_config);
    pthread_mutex_unlock(&cache_lock);
}

uint64_t kiln__blas_tuned_shapes(void);
uint64_t kiln__blas_tuned_shapes(void)
{
    pthread_mutex_lock(&cache_lock);
    uint64_t t = tuned;
    pthread_mutex_unlock(&cache_lock);
    return t;
}

void kiln__blas_cache_counters(uint64_t *q, uint64_t *h)
{
    pthread_mutex_lock(&cache_lock);
    if (q)
        *q = queries;
    if (h)
        *h = hits;
    pthread_mutex_unlock(&cache_lock);
}

static size_t set_of(const heur_key *k)
{
    /* FNV-1a over the key's bytes (the key is zeroed before it is filled). */
    uint64_t h = 1469598103934665603ULL;
    const uint8_t *p = (const uint8_t *)k;
    for (size_t i = 0; i < sizeof *k; i++)
        h = (h ^ p[i]) * 1099511628211ULL;
    return (size_t)(h % SETS);
}

/* The largest power of two dividing the address, at most 256 (the heuristic's default). */
static uint32_t alignment_of(CUdeviceptr p)
{
    uint32_t a = 1;
    while (a < 256 && !(p & a))
        a <<= 1;
    return a;
}

static kiln_status blas_fail(kiln__errslot *err, const kiln__blas *lt, const char *op, const char *what,
                             cublasStatus_t s)
{
    return kiln__fail(err, KILN_ERR_CUDA_BLAS, "%s: %s: %s (%d)", op, what, lt->cublasLtGetStatusString(s), (int)s);
}

static int tuning_enabled(void)
{
    const char *e = getenv("KILN_BLAS_TUNE");
    return !(e && !strcmp(e, "0"));
}

typedef struct algo_config {
    int32_t id, split_k;
    uint32_t tile, reduction, swizzle, custom, stages;
    uint16_t inner, cluster;
} algo_config;

/* An attribute cuBLASLt cannot report reads as 0 (split_k: 1, the default).
 * Returns 0 when the split-K count or the reduction scheme, which accurate()
 * judges the candidate by, could not be read: such a candidate is dropped. */
static int config_of(const kiln__blas *lt, const cublasLtMatmulAlgo_t *a, algo_config *c)
{
    memset(c, 0, sizeof *c);
    c->split_k = 1;
    size_t w = 0;
#define KILN__GET(attr, field)                                                                                       \
    (lt->cublasLtMatmulAlgoConfigGetAttribute(a, attr, &c->field, sizeof c->field, &w) == CUBLAS_STATUS_SUCCESS &&    \
     w == sizeof c->field)
    const int known = KILN__GET(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, split_k) &&
                      KILN__GET(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, reduction);
    (void)KILN__GET(CUBLASLT_ALGO_CONFIG_ID, id);
    (void)KILN__GET(CUBLASLT_ALGO_CONFIG_TILE_ID, tile);
    (void)KILN__GET(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swizzle);
    (void)KILN__GET(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, custom);
    (void)KILN__GET(CUBLASLT_ALGO_CONFIG_STAGES_ID, stages);
    (void)KILN__GET(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, inner);
    (void)KILN__GET(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster);
#undef KILN__GET
    return known;
}

/* Whether a candidate keeps the f32 accumulation up to the 16-bit output's
 * one rounding. Split K must keep its partial sums in f32 (the preference's
 * reduction mask asks for that; checked again here). And with the bias
 * epilogue, split K is refused altogether: cuBLASLt 13's split-K kernels of
 * algorithm 24 round the product to f16 and add the bias in f16 (two
 * roundings; where bias and product cancel, the error is the product's ulp,
 * not the sum's): tests/test_ops_dense_gpu.c's 333 x 1000 -> 2731 product
 * with a bias shows it. Other split-K kernels are exact with the bias, but
 * nothing documented tells the two kinds apart. */
static int accurate(const algo_config *c, int bias)
{
    if (c->split_k > 1 && c->reduction != CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE)
        return 0;
    return !(bias && c->split_k > 1);
}

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* One call of candidate algo into out on s. */
static int run_candidate(const kiln__gemm *g, const cublasLtMatmulAlgo_t *algo, void *out, CUdeviceptr ws, CUstream s)
{
    const float alpha = 1.0f, beta = 0.0f;
    const kiln__gemm_desc *gd = &g->desc;
    return g->lt->cublasLtMatmul(g->handle, g->op, &alpha, (const void *)(uintptr_t)gd->w, g->a,
                                 (const void *)(uintptr_t)gd->x, g->b, &beta, out, g->d, out, g->d, algo,
                                 (void *)(uintptr_t)ws, KILN__BLAS_WORKSPACE, (cudaStream_t)s) == CUBLAS_STATUS_SUCCESS;
}

/* The median time (ms) of NARROW_REPS calls of algo, each after a write of
 * flush_bytes at flush (which evicts the weight from L2); < 0 on failure. */
static float time_cold(const kiln__gemm *g, kiln__device_timer *timer, const cublasLtMatmulAlgo_t *algo, void *out,
                       CUdeviceptr ws, CUdeviceptr flush, size_t flush_bytes)
{
    float t[NARROW_REPS];
    CUstream s = kiln__device_timer_stream(timer);
    if (!run_candidate(g, algo, out, ws, s)) /* untimed: the first call's setup */
        return -1;
    for (int i = 0; i < NARROW_REPS; i++) {
        if (kiln__device_timer_fill(timer, flush, (unsigned char)i, flush_bytes) != CUDA_SUCCESS ||
            kiln__device_timer_start(timer) != CUDA_SUCCESS || !run_candidate(g, algo, out, ws, s) ||
            kiln__device_timer_stop(timer, &t[i]) != CUDA_SUCCESS)
            return -1;
    }
    qsort(t, NARROW_REPS, sizeof t[0], cmp_float);
    return t[NARROW_REPS / 2];
}

/* The time (ms) of a call of algo, calls back to back: one untimed, one
 * timed, then enough for TUNE_TARGET_MS; < 0 on failure. */
static float time_hot(const kiln__gemm *g, kiln__device_timer *timer, const cublasLtMatmulAlgo_t *algo, void *out,
                      CUdeviceptr ws)
{
    int reps = 1;
    float ms = 0;
    CUstream s = kiln__device_timer_stream(timer);
    for (int round = 0; round < 3; round++) {
        if (round > 0 && kiln__device_timer_start(timer) != CUDA_SUCCESS)
            return -1;
        for (int k = 0; k < reps; k++)
            if (!run_candidate(g, algo, out, ws, s))
                return -1;
        if (round == 0)
            continue;
        if (kiln__device_timer_stop(timer, &ms) != CUDA_SUCCESS)
            return -1;
        ms /= (float)reps;
        if (round == 1) {
            reps = ms > 0 ? (int)(TUNE_TARGET_MS / ms) : TUNE_MAX_REPS;
            reps = reps < 2 ? 2 : reps > TUNE_MAX_REPS ? TUNE_MAX_REPS : reps;
        }
    }
    return ms;
}

/* Times each of the n candidates (see CANDIDATES), L2-cold when cold (a
 * narrow product: time_cold), and returns the index of the fastest, or -1
 * when timing was not possible (nothing is reported: the caller takes the
 * heuristic's first). */
static int fastest(const kiln__gemm *g, const heur_key *key, const cublasLtMatmulHeuristicResult_t *r, int n,
                   int cold, float *ms_out)
{
    kiln__device_timer *timer = NULL;
    if (kiln__device_timer_create(g->rt, &timer) != CUDA_SUCCESS)
        return -1;
    /* f32 parts, or the 16-bit product (f16 or bf16) */
    const size_t d_bytes = (size_t)key->m * (size_t)key->n * (key->parts ? 4u * key->parts : 2u);
    size_t flush_bytes = 0;
    CUdeviceptr dp = 0, ws = 0, flush = 0;
    int best = -1;
    float best_ms = 0;
    const kiln__gemm_desc *gd = &g->desc;
    /* The scratch output keeps the bindings' alignment, so every candidate applies. */
    if (kiln__device_alloc(g->rt, &dp, d_bytes + 256) != CUDA_SUCCESS ||
        kiln__device_alloc(g->rt, &ws, KILN__BLAS_WORKSPACE) != CUDA_SUCCESS)
        goto out;
    /* Without memory for the flush, the narrow product is timed back to back. */
    if (cold) {
        flush_bytes = 2 * kiln__runtime_l2_bytes(g->rt);
        if (flush_bytes < ((size_t)16 << 20))
            flush_bytes = (size_t)16 << 20;
        if (kiln__device_alloc(g->rt, &flush, flush_bytes) != CUDA_SUCCESS)
            flush = 0;
    }
    void *out = (void *)(uintptr_t)(dp + (gd->d & 255));
    for (int i = 0; i < n; i++) {
        const float ms = flush ? time_cold(g, timer, &r[i].algo, out, ws, flush, flush_bytes)
                               : time_hot(g, timer, &r[i].algo, out, ws);
        if (kiln__device_timer_sync(timer) != CUDA_SUCCESS)
            goto out;
        if (ms >= 0 && (best < 0 || ms < best_ms)) {
            best = i;
            best_ms = ms;
        }
    }
    *ms_out = best >= 0 ? best_ms : 0;
out:
    /* The timer waits for its stream before the scratch goes. */
    kiln__device_timer_destroy(timer);
    kiln__device_free(g->rt, flush);
    kiln__device_free(g->rt, ws);
    kiln__device_free(g->rt, dp);
    return best;
}

/* A tuning row's key: the GPU (name, SMs), the driver and cuBLASLt, the
 * shape and its element type, bias, parts, alignments and workspace, and the
 * timing policy. */
static void tuning_key(const kiln__gemm *g, const heur_key *key, char *buf, size_t cap)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(g->rt, &info);
    /* The name is free text: the key's separators are kept out of it. */
    for (char *c = info.name; *c; c++)
        if (*c == ';' || *c == '=')
            *c = '_';
    snprintf(buf, cap,
             "gpu=%s;sms=%d;driver=%d;cublaslt=%zu;m=%llu;n=%llu;k=%llu;elt=%s;bias=%u;parts=%u;align=%u/%u/%u;"
             "workspace=%llu;policy=" TUNE_POLICY,
             info.name, info.multiprocessors, info.driver_version, g->lt->cublasLtGetVersion(),
             (unsigned long long)key->m, (unsigned long long)key->n, (unsigned long long)key->k,
             kiln_dtype_name((kiln_dtype)key->elt), key->bias, key->parts, key->align_a, key->align_b, key->align_d,
             (unsigned long long)key->workspace);
}

/* The stored choice for the shape, when the database has one that still
 * applies: 1 with *algo and *ms. One that cuBLASLt no longer takes (another
 * library build under the same version, a descriptor changed) or that
 * accurate() refuses is dropped and timed again. */
static int load_choice(const kiln__gemm *g, const heur_key *key, const char *text, cublasLtMatmulAlgo_t *algo,
                       float *ms)
{
    void *payload = NULL;
    size_t size = 0;
    int found = 0;
    if (kiln_cache_tuning_get(g->desc.tuning, KILN__BLAS_TUNING_KIND, text, &payload, &size, &found) != KILN_OK ||
        !found)
        return 0;
    cublasLtMatmulAlgo_t a;
    cublasLtMatmulHeuristicResult_t check;
    algo_config cfg;
    float t = 0;
    int ok = kiln__blas_tuning_decode(payload, size, &a, &t) == 0;
    kiln_free(payload);
    memset(&check, 0, sizeof check);
    ok = ok && g->lt->cublasLtMatmulAlgoCheck(g->handle, g->op, g->a, g->b, g->d, g->d, &a, &check) ==
                   CUBLAS_STATUS_SUCCESS &&
         check.state == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= key->workspace && config_of(g->lt, &a, &cfg) &&
         accurate(&cfg, key->bias != 0) && (!key->parts || cfg.split_k <= 1);
    if (!ok) {
        tuning_stale++;
        kiln_cache_tuning_drop(g->desc.tuning, KILN__BLAS_TUNING_KIND, text); /* a read-only cache keeps it */
        return 0;
    }
    tuning_loaded++;
    *algo = a;
    *ms = t;
    return 1;
}

/* Finds the algorithm for key, querying the heuristic on a miss (under the
 * lock, so that each shape is queried, and timed, once however many threads
 * ask). A shape that is timed looks for its tuning row first, and stores one
 * once timed. */
static kiln_status find_algo(kiln__errslot *err, const char *op, const kiln__gemm *g, const heur_key *key,
                             cublasLtMatmulAlgo_t *algo, float *ms)
{
    kiln_status st = KILN_OK;
    const int forced = atomic_load(&forced_candidate);
    pthread_mutex_lock(&cache_lock);
    heur_entry *set = cache[set_of(key)], *victim = &set[0];
    for (int w = 0; w < WAYS && forced < 0; w++) {
        if (set[w].used && !memcmp(&set[w].key, key, sizeof *key)) {
            set[w].used = ++tick;
            hits++;
            *algo = set[w].algo;
            *ms = set[w].ms;
            goto out_unlock;
        }
        if (set[w].used < victim->used)
            victim = &set[w];
    }
    const kiln__blas *lt = g->lt;
    const int wide = 2.0 * (double)key->m * (double)key->n * (double)key->k >= (double)TUNE_MIN_FLOP;
    const int narrow = !wide && key->n <= NARROW_ROWS && key->m * key->k * 2 >= NARROW_MIN_BYTES;
    const int timed = forced < 0 && (wide || narrow) && tuning_enabled();
    char text[KILN_TUNING_KEY_MAX];
    if (timed && g->desc.tuning) {
        tuning_key(g, key, text, sizeof text);
        if (load_choice(g, key, text, algo, ms)) {
            victim->key = *key;
            victim->algo = *algo;
            victim->ms = *ms;
            victim->used = ++tick;
            goto out_unlock;
        }
    }
    cublasLtMatmulPreference_t pref = NULL;
    cublasStatus_t s = lt->cublasLtMatmulPreferenceCreate(&pref);
    if (s != CUBLAS_STATUS_SUCCESS) {
        st = blas_fail(err, lt, op, "cublasLtMatmulPreferenceCreate", s);
        goto out_unlock;
    }
    uint64_t ws = key->workspace;
    /* With the bias epilogue no split K at all (accurate() says why): the
     * heuristic is asked for algorithms without a reduction, so that a
     * product whose best candidates split K still gets the best that do not
     * (rather than none left after the filter). */
    uint32_t c_align = key->align_d,
             schemes = key->bias || key->parts ? CUBLASLT_REDUCTION_SCHEME_NONE : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    if ((s = lt->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                      sizeof ws)) ||
        (s = lt->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                      &key->align_a, sizeof key->align_a)) ||
        (s = lt->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                      &key->align_b, sizeof key->align_b)) ||
        (s = lt->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c_align,
                                                      sizeof c_align)) ||
        (s = lt->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                      &key->align_d, sizeof key->align_d)) ||
        (s = lt->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                      sizeof schemes))) {
        st = blas_fail(err, lt, op, "cublasLtMatmulPreferenceSetAttribute", s);
        goto out_pref;
    }
    /* Split K only with partial sums in f32: partial sums in f16 or bf16 (the
     * output type, also what the in-place scheme adds in) lose the accuracy of the
     * f32 accumulation (tests/test_ops_dense_gpu.c's 333 x 1000 -> 2731
     * product shows it). The heuristic's list, less what
     * accurate() refuses: its first candidate, or up to CANDIDATES when the
     * product is timed. */
    const int want = forced >= 0 || timed ? CANDIDATES : 1;
    cublasLtMatmulHeuristicResult_t results[ASKED];
    algo_config configs[ASKED];
    int found = 0, n = 0;
    memset(results, 0, sizeof results);
    s = lt->cublasLtMatmulAlgoGetHeuristic(g->handle, g->op, g->a, g->b, g->d, g->d, pref, ASKED, results, &found);
    queries++;
    for (int i = 0; s == CUBLAS_STATUS_SUCCESS && i < found && i < ASKED && n < want; i++) {
        if (results[i].state != CUBLAS_STATUS_SUCCESS)
            continue;
        if (config_of(lt, &results[i].algo, &configs[n]) && accurate(&configs[n], key->bias != 0) &&
            (!key->parts || configs[n].split_k <= 1))
            results[n++] = results[i];
    }
    if (s != CUBLAS_STATUS_SUCCESS || n < 1) {
        st = kiln__fail(err, KILN_ERR_CUDA_BLAS,
                        "%s: cuBLASLt has no algorithm for m=%llu n=%llu k=%llu (%s, f32 compute%s, alignments "
                        "%u/%u/%u bytes, %llu workspace bytes): %s",
                        op, (unsigned long long)key->m, (unsigned long long)key->n, (unsigned long long)key->k,
                        kiln_dtype_name((kiln_dtype)key->elt), key->bias ? ", bias" : "", key->align_a, key->align_b, key->align_d,
                        (unsigned long long)key->workspace,
                        lt->cublasLtGetStatusString(s != CUBLAS_STATUS_SUCCESS ? s : CUBLAS_STATUS_NOT_SUPPORTED));
        goto out_pref;
    }
    if (forced >= 0) {
        if (forced >= n) {
            st = kiln__fail(err, KILN_ERR_CUDA_BLAS, "%s: the heuristic has %d candidates; candidate %d asked", op,
                            n, forced);
            goto out_pref;
        }
        *algo = results[forced].algo;
        const algo_config *c = &configs[forced];
        snprintf(forced_config, sizeof forced_config,
                 "candidate %d of %d: id %d tile %u stages %u split-K %d reduction %u swizzle %u custom %u inner %u "
                 "cluster %u, workspace %zu, waves %.2f, epilogue %s",
                 forced, n, (int)c->id, c->tile, c->stages, (int)c->split_k, c->reduction, c->swizzle, c->custom,
                 (unsigned)c->inner, (unsigned)c->cluster, results[forced].workspaceSize,
                 (double)results[forced].wavesCount, key->bias ? "bias" : "default");
        goto out_pref;
    }
    int pick = 0;
    float best_ms = 0;
    /* A parted product is timed even as the only candidate: its caller
     * compares part counts by these times. */
    if ((n > 1 || key->parts) && timed) {
        const int f = fastest(g, key, results, n, narrow, &best_ms);
        pick = f < 0 ? 0 : f;
        tuned += f >= 0;
        /* Kept for later processes; a database that cannot take it (read-only) only costs them the timing. */
        if (f >= 0 && g->desc.tuning) {
            uint8_t payload[KILN__BLAS_TUNING_PAYLOAD];
            tuning_encode(payload, &results[pick].algo, best_ms, pick, n);
            tuning_stored += kiln_cache_tuning_put(g->desc.tuning, KILN__BLAS_TUNING_KIND, text, payload,
                                                   sizeof payload) == KILN_OK;
        }
    }
    victim->key = *key;
    victim->algo = results[pick].algo;
    victim->ms = best_ms;
    victim->used = ++tick;
    *algo = results[pick].algo;
    *ms = best_ms;
out_pref:
    lt->cublasLtMatmulPreferenceDestroy(pref);
out_unlock:
    pthread_mutex_unlock(&cache_lock);
    return st;
}

void kiln__gemm_destroy(kiln__gemm *g)
{
    if (!g || !g->lt)
        return;
    if (g->a)
        g->lt->cublasLtMatrixLayoutDestroy(g->a);
    if (g->b)
        g->lt->cublasLtMatrixLayoutDestroy(g->b);
    if (g->d)
        g->lt->cublasLtMatrixLayoutDestroy(g->d);
    if (g->op)
        g->lt->cublasLtMatmulDescDestroy(g->op);
    memset(g, 0, sizeof *g);
}

void kiln__gemm_free(void *launch)
{
    kiln__gemm_destroy(launch);
    free(launch);
}

kiln_status kiln__kernel_and_gemm(kiln_jit *jit, kiln_runtime *rt, kiln__errslot *err, const char *op,
                                  const kiln_spec *spec, kiln_kernel **k, CUfunction *fn, const kiln__gemm_desc *d,
                                  kiln__gemm *g)
{
    void *f;
    kiln_status st;
    if ((st = kiln_jit_acquire(jit, spec, k)) || (st = kiln_kernel_function(*k, NULL, &f)))
        return kiln__propagate(err, st);
    *fn = (CUfunction)f;
    kiln__gemm_desc with = *d;
    if (!with.tuning)
        with.tuning = kiln__jit_cache(jit);
    return kiln__gemm_prepare(rt, err, op, &with, g);
}

kiln_status kiln__gemm_prepare(kiln_runtime *rt, kiln__errslot *err, const char *op, const kiln__gemm_desc *desc,
                               kiln__gemm *g)
{
    memset(g, 0, sizeof *g);
    /* cuBLASLt takes sizes as uint64 but leading dimensions as int64, and m, n
     * past 2^31 are outside what its kernels are tested for. */
    if (desc->rows > INT32_MAX || desc->in > INT32_MAX || desc->out > INT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: rows %llu, in %llu, out %llu: each at most %d", op,
                          (unsigned long long)desc->rows, (unsigned long long)desc->in,
                          (unsigned long long)desc->out, INT32_MAX);
    if (desc->elt != KILN_DTYPE_F16 && desc->elt != KILN_DTYPE_BF16)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: the product's element type must be f16 or bf16, got %s",
                          op, kiln_dtype_name(desc->elt));
    if (desc->parts && (desc->bias || desc->parts > 64 || desc->in % (8ull * desc->parts)))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "%s: %u partial products of in %llu%s: in must be a multiple of 8 x parts, parts at most "
                          "64, no bias",
                          op, desc->parts, (unsigned long long)desc->in, desc->bias ? " with a bias" : "");
    const char *why = NULL;
    const kiln__blas *lt = kiln__blas_get(&why);
    if (!lt)
        return kiln__fail(err, KILN_ERR_CUDA_BLAS, "%s: %s", op, why ? why : "cuBLASLt is not loaded");
    /* The runtime's own stream's handle: cuBLASLt takes the CUDA stream on
     * each call, and a handle keeps no per-stream state. The launch context
     * does not say which kiln stream it belongs to (see the report). */
    cublasLtHandle_t handle = (cublasLtHandle_t)kiln_stream_cublaslt(kiln_runtime_stream(rt));
    if (!handle)
        return kiln__fail(err, KILN_ERR_CUDA_BLAS, "%s: the runtime's stream has no cuBLASLt handle", op);
    g->rt = rt;
    g->lt = lt;
    g->handle = handle;
    g->desc = *desc;
    const uint64_t m = desc->out, n = desc->rows, k = desc->in;
    cublasStatus_t s;
    const char *what = "cublasLtMatmulDescCreate";
    if ((s = lt->cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F)))
        goto out_blas;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    what = "cublasLtMatmulDescSetAttribute";
    if ((s = lt->cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) ||
        (s = lt->cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)))
        goto out_blas;
    if (desc->bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        const void *bias = (const void *)(uintptr_t)desc->bias;
        if ((s = lt->cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi)) ||
            (s = lt->cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias)))
            goto out_blas;
        /* The bias is of D's type by default (cublasLt.h); bf16 says so
         * explicitly, and the f16 descriptor stays as it always was. */
        const int32_t bias_type = CUDA_R_16BF;
        if (desc->elt == KILN_DTYPE_BF16 &&
            (s = lt->cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                    sizeof bias_type)))
            goto out_blas;
    }
    what = "cublasLtMatrixLayoutCreate";
    /* Parts: batch p reads rows [p kp, (p+1) kp) of the column-major A and B
     * (an offset of p kp elements, the leading dimension still k) and writes
     * the p-th f32 [m, n] of D. */
    const uint64_t kp = desc->parts ? k / desc->parts : k;
    const cudaDataType_t et = desc->elt == KILN_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    if ((s = lt->cublasLtMatrixLayoutCreate(&g->a, et, kp, m, (int64_t)k)) ||
        (s = lt->cublasLtMatrixLayoutCreate(&g->b, et, kp, n, (int64_t)k)) ||
        (s = lt->cublasLtMatrixLayoutCreate(&g->d, desc->parts ? CUDA_R_32F : et, m, n, (int64_t)m)))
        goto out_blas;
    if (desc->parts) {
        const int32_t count = (int32_t)desc->parts;
        const int64_t ab_stride = (int64_t)kp, d_stride = (int64_t)(m * n);
        what = "cublasLtMatrixLayoutSetAttribute";
        if ((s = lt->cublasLtMatrixLayoutSetAttribute(g->a, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                      sizeof count)) ||
            (s = lt->cublasLtMatrixLayoutSetAttribute(g->a, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &ab_stride,
                                                      sizeof ab_stride)) ||
            (s = lt->cublasLtMatrixLayoutSetAttribute(g->b, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                      sizeof count)) ||
            (s = lt->cublasLtMatrixLayoutSetAttribute(g->b, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &ab_stride,
                                                      sizeof ab_stride)) ||
            (s = lt->cublasLtMatrixLayoutSetAttribute(g->d, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                      sizeof count)) ||
            (s = lt->cublasLtMatrixLayoutSetAttribute(g->d, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &d_stride,
                                                      sizeof d_stride)))
            goto out_blas;
    }
    heur_key key;
    memset(&key, 0, sizeof key);
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    key.instance = info.instance_id;
    key.m = m;
    key.n = n;
    key.k = k;
    key.elt = (uint32_t)desc->elt;
    key.workspace = KILN__BLAS_WORKSPACE;
    key.align_a = alignment_of(desc->w);
    key.align_b = alignment_of(desc->x);
    key.align_d = alignment_of(desc->d);
    key.bias = desc->bias != 0;
    key.parts = desc->parts;
    kiln_status st = find_algo(err, op, g, &key, &g->algo, &g->ms);
    if (st)
        kiln__gemm_destroy(g);
    return st;
out_blas:
    st = blas_fail(err, lt, op, what, s);
    kiln__gemm_destroy(g);
    return st;
}

kiln_status kiln__gemm_enqueue(const kiln__gemm *g, const kiln_launch_context *ctx, const char *op)
{
    const float alpha = 1.0f, beta = 0.0f;
    const kiln__gemm_desc *d = &g->desc;
    void *dp = (void *)(uintptr_t)d->d;
    cublasStatus_t s = g->lt->cublasLtMatmul(g->handle, g->op, &alpha, (const void *)(uintptr_t)d->w, g->a,
                                             (const void *)(uintptr_t)d->x, g->b, &beta, dp, g->d, dp, g->d,
                                             &g->algo, (void *)(uintptr_t)d->workspace, KILN__BLAS_WORKSPACE,
                                             (cudaStream_t)kiln_launch_stream(ctx));
    if (s != CUBLAS_STATUS_SUCCESS)
        return kiln__fail(kiln__runtime_errslot(g->rt), KILN_ERR_CUDA_BLAS,
                          "%s: cublasLtMatmul (m=%llu n=%llu k=%llu): %s (%d)", op, (unsigned long long)d->out,
                          (unsigned long long)d->rows, (unsigned long long)d->in,
                          g->lt->cublasLtGetStatusString(s), (int)s);
    return KILN_OK;
}

void kiln__gemm_key_of(const kiln__gemm *g, kiln__gemm_key *out)
{
    memset(out, 0, sizeof *out);
    out->algo = g->algo;
    out->rows = g->desc.rows;
    out->in = g->desc.in;
    out->out = g->desc.out;
    out->x = g->desc.x;
    out->w = g->desc.w;
    out->bias = g->desc.bias;
    out->d = g->desc.d;
    out->workspace = g->desc.workspace;
    out->parts = g->desc.parts;
    out->elt = (uint64_t)g->desc.elt;
}

kiln_status kiln__check_workspace(kiln__errslot *err, const char *op, const kiln_region *ws, kiln_runtime *rt,
                                  size_t need, const kiln_tensor *const *bindings, const size_t *bytes,
                                  const char *const *names, size_t n)
{
    if (!ws || !ws->buffer)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding workspace has no buffer; it needs %zu bytes",
                          op, need);
    if (kiln__buffer_runtime(ws->buffer) != rt)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding workspace belongs to another runtime", op);
    if (kiln_region_check(ws))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "%s: binding workspace: %s", op, kiln_errmsg());
    size_t have = ws->end - ws->start;
    if (have < need)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "%s: binding workspace has %zu bytes; it must have at least %zu", op, have, need);
    CUdeviceptr at = kiln__buffer_ptr(ws->buffer) + ws->start;
    if (at % KILN__WORKSPACE_ALIGN)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "%s: binding workspace must start %zu-byte aligned; it starts at offset %zu of a buffer "
                          "aligned to %llu",
                          op, KILN__WORKSPACE_ALIGN, ws->start,
                          (unsigned long long)(kiln__buffer_ptr(ws->buffer) & -kiln__buffer_ptr(ws->buffer)));
    for (size_t i = 0; i < n; i++) {
        if (!bindings[i])
            continue;
        kiln_region r = {bindings[i]->buffer, bindings[i]->offset, bindings[i]->offset + bytes[i]};
        if (kiln_region_overlaps(ws, &r))
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "%s: binding workspace [%zu, %zu) overlaps binding %s [%zu, %zu)", op, ws->start,
                              ws->end, names[i], r.start, r.end);
    }
    return KILN_OK;
}
