/* Kernel acquisition: what it costs to get a CUfunction for a specialization
 * kiln has never seen (cold compile), one that is in the cache database (a new
 * jit on a reopened cache: a new process in all but the driver context), and
 * one the jit already holds (in-memory table), and one in a signed read-only
 * layer, without and with a trust policy that lists its key (the manifest
 * check on each row loaded: docs/cache.md, "Signed layers").
 *
 * The specializations are token_embedding's with vocab 128256 and n distinct
 * hidden sizes 1024, 1088, ... (multiples of 64). One extra specialization
 * (vocab 1000, hidden 64) warms every phase up and is never timed.
 *
 * Output: JSON lines on stdout, one per measurement (see bench/README.md).
 * Usage: bench_acquire [--n 60] [--reps 1000] [--db-dir DIR] [--arch sm_90] [--keep]
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_common.h"
#include "kiln/kiln.h"

#define BENCH "acquire"
#define VOCAB 128256
#define TARGET_DATABASE_HIT_US 300.0
#define TARGET_MEMORY_HIT_US 1.0

typedef struct tempdb {
    char dir[4096];
    char path[4200];
    int made;
} tempdb;

static tempdb g_offline, g_online, g_layered;

/* A key for this benchmark alone (it signs a temporary file): a fixed one,
 * so that the benchmark needs no key generation of its own. */
static const char bench_key_pem[] = "-----BEGIN PRIVATE KEY-----\n"
                                    "MC4CAQAwBQYDK2VwBCIEICCrsyZ3pnhh2czZBkxOVJ5ldg4inXWP3detE23b64/C\n"
                                    "-----END PRIVATE KEY-----\n";
static const char bench_pub_pem[] = "-----BEGIN PUBLIC KEY-----\n"
                                    "MCowBQYDK2VwAyEAY6EzlHWgQJfwZjadItH+sPTBVvfmp/UywkH2uVAbmks=\n"
                                    "-----END PUBLIC KEY-----\n";
static const char *const key_files[] = {"bench-key.pem", "bench-key.pub"};
static int g_keep;

static void tempdb_remove(tempdb *t)
{
    if (!t->made || g_keep)
        return;
    static const char *const suffixes[] = {"", "-wal", "-shm", "-journal"};
    char p[4300];
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        snprintf(p, sizeof p, "%s%s", t->path, suffixes[i]);
        unlink(p);
    }
    for (size_t i = 0; i < sizeof key_files / sizeof key_files[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", t->dir, key_files[i]);
        unlink(p);
    }
    rmdir(t->dir);
    t->made = 0;
}

static void cleanup(void)
{
    tempdb_remove(&g_offline);
    tempdb_remove(&g_online);
    tempdb_remove(&g_layered);
}

/* Prints an error line and exits 1. */
static void fail(const char *phase, kiln_status st, const char *detail)
{
    bench_json_error(BENCH, phase, st ? kiln_status_code(st) : "bench", detail, kiln_errmsg());
    cleanup();
    exit(1);
}

static void tempdb_make(tempdb *t, const char *parent, const char *tag)
{
    snprintf(t->dir, sizeof t->dir, "%s/kiln-bench-%s-XXXXXX", parent, tag);
    if (!mkdtemp(t->dir)) {
        char msg[4400];
        snprintf(msg, sizeof msg, "mkdtemp(%s): %s", t->dir, strerror(errno));
        fail("setup", KILN_OK, msg);
    }
    t->made = 1;
    snprintf(t->path, sizeof t->path, "%s/kernels.db", t->dir);
}

static kiln_cache *cache_open(const tempdb *t, const char *phase)
{
    kiln_cache_options o = {.size = sizeof o, .path = t->path};
    kiln_cache *c = NULL;
    kiln_status st = kiln_cache_open(&o, &c);
    if (st)
        fail(phase, st, NULL);
    return c;
}

/* Writes text to t->dir/name, its path in out. */
static void write_key(const tempdb *t, const char *name, const char *text, char *out, size_t cap)
{
    snprintf(out, cap, "%s/%s", t->dir, name);
    FILE *f = fopen(out, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0)
        fail("signed_layer", KILN_OK, "cannot write the benchmark's key");
}

/* Signs the database at t with the key at key_path and seals it. */
static void sign_database(const tempdb *t, const char *key_path)
{
    kiln_cache *c = cache_open(t, "signed_layer");
    kiln_status st = kiln_cache_sign(c, key_path, NULL);
    if (!st)
        st = kiln_cache_seal(c);
    if (st)
        fail("signed_layer", st, NULL);
    kiln_cache_close(c);
}

/* A fresh writable database at t with layer as its read-only layer, under
 * the policy of pub_path (NULL: none); the layer must be searched. */
static kiln_cache *layered_open(const tempdb *t, const char *layer, const char *pub_path, const char *phase)
{
    const char *layers[] = {layer}, *keys[] = {pub_path};
    kiln_cache_options o = {.size = sizeof o, .path = t->path, .ignore_env = 1, .readonly_paths = layers,
                            .n_readonly_paths = 1, .trusted_keys = pub_path ? keys : NULL,
                            .n_trusted_keys = pub_path ? 1 : 0};
    kiln_cache *c = NULL;
    kiln_cache_layer_info info;
    kiln_status st = kiln_cache_open(&o, &c);
    if (st)
        fail(phase, st, NULL);
    if ((st = kiln_cache_layer(c, 0, &info)) || !info.active)
        fail(phase, st, st ? NULL : info.reason);
    return c;
}

static kiln_jit *jit_create(kiln_cache *cache, kiln_runtime *rt, const char *arch, const char *phase)
{
    kiln_jit_options o = {.size = sizeof o, .cache = cache, .runtime = rt, .arch = arch};
    kiln_jit *j = NULL;
    kiln_status st = kiln_jit_create(&o, &j);
    if (st)
        fail(phase, st, NULL);
    return j;
}

static void counters_delta(const kiln_jit_counters *a, const kiln_jit_counters *b, kiln_jit_counters *d)
{
    d->compiles = b->compiles - a->compiles;
    d->compile_errors = b->compile_errors - a->compile_errors;
    d->database_hits = b->database_hits - a->database_hits;
    d->memory_hits = b->memory_hits - a->memory_hits;
    d->corrupt_dropped = b->corrupt_dropped - a->corrupt_dropped;
}

/* One counters line: what the timed loop of a phase did, and whether it is
 * what the phase claims to measure. Returns the verdict. */
static int print_counters(const char *of, const kiln_jit_counters *d, uint64_t want_compiles, uint64_t want_db,
                          uint64_t want_mem)
{
    int ok = d->compiles == want_compiles && d->database_hits == want_db && d->memory_hits == want_mem &&
             d->compile_errors == 0 && d->corrupt_dropped == 0;
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_str(&j, "phase", "counters");
    bench_json_str(&j, "of", of);
    bench_json_bool(&j, "peer", 0);
    bench_json_int(&j, "compiles", (long long)d->compiles);
    bench_json_int(&j, "compile_errors", (long long)d->compile_errors);
    bench_json_int(&j, "database_hits", (long long)d->database_hits);
    bench_json_int(&j, "memory_hits", (long long)d->memory_hits);
    bench_json_int(&j, "corrupt_dropped", (long long)d->corrupt_dropped);
    bench_json_int(&j, "expect_compiles", (long long)want_compiles);
    bench_json_int(&j, "expect_database_hits", (long long)want_db);
    bench_json_int(&j, "expect_memory_hits", (long long)want_mem);
    bench_json_bool(&j, "ok", ok);
    bench_json_end(&j);
    return ok;
}

/* One timing line; sorts v. target <= 0: no target. */
static void print_timing(const char *phase, const char *what, const char *arch, double *v, size_t n, long reps,
                         double target)
{
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_str(&j, "phase", phase);
    bench_json_bool(&j, "peer", 0);
    bench_json_int(&j, "n", (long long)n);
    bench_json_stats_us(&j, v, n);
    if (reps > 1)
        bench_json_int(&j, "reps_per_spec", reps);
    if (target > 0) {
        bench_json_num(&j, "target_median_us", target);
        bench_json_bool(&j, "meets_target", bench_quantile(v, n, 0.5) <= target);
    }
    bench_json_str(&j, "arch", arch);
    bench_json_str(&j, "what", what);
    bench_json_end(&j);
}

static void usage(const char *argv0)
{
    fprintf(stderr, "usage: %s [--n N] [--reps R] [--db-dir DIR] [--arch sm_XY] [--keep]\n", argv0);
    exit(2);
}

/* Times kiln_jit_acquire of every spec, reps calls each (the mean per call),
 * into t[]; the counters before and after go to *delta. */
static void time_acquire_all(kiln_jit *jit, const kiln_spec *specs, long n, long reps, double *t, const char *phase,
                             kiln_jit_counters *delta)
{
    kiln_jit_counters c0, c1;
    kiln_kernel *k = NULL;
    kiln_jit_get_counters(jit, &c0);
    for (long i = 0; i < n; i++) {
        kiln_status st = KILN_OK;
        double t0 = bench_now_us();
        for (long r = 0; r < reps && !st; r++)
            st = kiln_jit_acquire(jit, &specs[i], &k);
        t[i] = (bench_now_us() - t0) / (double)reps;
        if (st)
            fail(phase, st, NULL);
    }
    kiln_jit_get_counters(jit, &c1);
    counters_delta(&c0, &c1, delta);
}

int main(int argc, char **argv)
{
    long n = 60, reps = 1000;
    const char *db_parent = getenv("TMPDIR");
    const char *arch_opt = NULL;
    if (!db_parent || !*db_parent)
        db_parent = "/tmp";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--n") && i + 1 < argc) {
            n = bench_parse_positive(argv[++i]);
            if (n < 1 || n > 1000)
                usage(argv[0]);
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = bench_parse_positive(argv[++i]);
            if (reps < 1)
                usage(argv[0]);
        } else if (!strcmp(argv[i], "--db-dir") && i + 1 < argc) {
            db_parent = argv[++i];
        } else if (!strcmp(argv[i], "--arch") && i + 1 < argc) {
            arch_opt = argv[++i];
        } else if (!strcmp(argv[i], "--keep")) {
            g_keep = 1;
        } else {
            usage(argv[0]);
        }
    }

    kiln_spec *specs = calloc((size_t)n, sizeof *specs);
    double *t = calloc((size_t)n, sizeof *t);
    if (!specs || !t)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln_status st;
    for (long i = 0; i < n; i++)
        if ((st = kiln_op_token_embedding_spec(KILN_DTYPE_F16, VOCAB, 1024 + 64 * i, 8, &specs[i])))
            fail("setup", st, NULL);
    kiln_spec warm;
    if ((st = kiln_op_token_embedding_spec(KILN_DTYPE_F16, 1000, 64, 8, &warm)))
        fail("setup", st, NULL);

    const char *why = NULL;
    int have_driver = kiln_driver_available(&why);
    kiln_runtime *rt = NULL;
    char arch[16];
    snprintf(arch, sizeof arch, "%s", arch_opt ? arch_opt : "sm_90");
    if (have_driver) {
        kiln_runtime_options ro = {.size = sizeof ro, .device_ordinal = 0};
        if ((st = kiln_runtime_create(&ro, &rt)))
            fail("setup", st, NULL);
        kiln_runtime_info info;
        kiln_runtime_get_info(rt, &info);
        if (!arch_opt)
            snprintf(arch, sizeof arch, "%s", info.arch);
    }

    kiln_jit_counters c0, c1, d_offline, d_cold, d_db, d_mem;
    int compiled = 0;

    /* (a') The compile alone: an offline jit (no device) into a fresh database.
     * Runs on machines without a GPU too. */
    tempdb_make(&g_offline, db_parent, "offline");
    kiln_cache *cache = cache_open(&g_offline, "cold_compile_offline");
    kiln_jit *jit = jit_create(cache, NULL, arch, "cold_compile_offline");
    if ((st = kiln_jit_prepare(jit, &warm, &compiled)))
        fail("cold_compile_offline", st, NULL);
    kiln_jit_get_counters(jit, &c0);
    for (long i = 0; i < n; i++) {
        double t0 = bench_now_us();
        st = kiln_jit_prepare(jit, &specs[i], &compiled);
        t[i] = bench_now_us() - t0;
        if (st)
            fail("cold_compile_offline", st, NULL);
        if (!compiled)
            fail("cold_compile_offline", KILN_OK, "kiln_jit_prepare did not compile a spec of a fresh database");
    }
    kiln_jit_get_counters(jit, &c1);
    counters_delta(&c0, &c1, &d_offline);
    print_timing("cold_compile_offline", "kiln_jit_prepare, offline jit, fresh database: fingerprint + NVRTC "
                 "compile to cubin + zstd + SQLite insert (no module load)", arch, t, (size_t)n, 1, 0);
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
    tempdb_remove(&g_offline);

    if (!have_driver) {
        print_counters("cold_compile_offline", &d_offline, (uint64_t)n, 0, 0);
        bench_json j;
        bench_json_begin(&j, BENCH);
        bench_json_bool(&j, "peer", 0);
        char msg[512];
        snprintf(msg, sizeof msg, "no driver: %s", why ? why : "unknown");
        bench_json_str(&j, "skipped", msg);
        bench_json_str(&j, "phases_skipped",
                       "cold_compile,database_hit,database_read,memory_hit,signed_layer_hit,signed_layer_hit_trusted");
        bench_json_end(&j);
        free(specs);
        free(t);
        return 0;
    }

    /* (a) Cold: a jit with a runtime on a fresh database; acquire compiles,
     * stores and loads. */
    tempdb_make(&g_online, db_parent, "acquire");
    cache = cache_open(&g_online, "cold_compile");
    jit = jit_create(cache, rt, arch, "cold_compile");
    kiln_kernel *k = NULL;
    if ((st = kiln_jit_acquire(jit, &warm, &k)))
        fail("cold_compile", st, NULL);
    time_acquire_all(jit, specs, n, 1, t, "cold_compile", &d_cold);
    print_timing("cold_compile", "kiln_jit_acquire, fresh database: fingerprint + SQLite miss + NVRTC compile + "
                 "zstd + SQLite insert + cuModuleLoadData + cuModuleGetFunction", arch, t, (size_t)n, 1, 0);

    /* (b) Database hit: a new jit (empty memory table) on the reopened database. */
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
    cache = cache_open(&g_online, "database_hit");
    jit = jit_create(cache, rt, arch, "database_hit");
    if ((st = kiln_jit_acquire(jit, &warm, &k)))
        fail("database_hit", st, NULL);
    time_acquire_all(jit, specs, n, 1, t, "database_hit", &d_db);
    print_timing("database_hit", "kiln_jit_acquire, new jit on the reopened database: fingerprint + SQLite read + "
                 "zstd decode + SHA-256 check + cuModuleLoadData + cuModuleGetFunction", arch, t, (size_t)n, 1,
                 TARGET_DATABASE_HIT_US);

    /* (c) Memory hit: the same jit again, reps calls per spec. */
    time_acquire_all(jit, specs, n, reps, t, "memory_hit", &d_mem);
    print_timing("memory_hit", "kiln_jit_acquire on the same jit: the in-memory table (mean of reps calls per spec)",
                 arch, t, (size_t)n, reps, TARGET_MEMORY_HIT_US);

    /* The database part of a hit alone, for the breakdown: kiln_cache_get
     * (SQLite read + zstd + checksum) without the module load. */
    for (long i = 0; i < n; i++) {
        uint8_t fp[KILN_FINGERPRINT_SIZE];
        if ((st = kiln_jit_fingerprint(jit, &specs[i], fp)))
            fail("database_read", st, NULL);
        void *cubin = NULL;
        size_t size = 0;
        int found = 0;
        double t0 = bench_now_us();
        st = kiln_cache_get(cache, fp, &cubin, &size, &found);
        t[i] = bench_now_us() - t0;
        kiln_free(cubin);
        if (st)
            fail("database_read", st, NULL);
        if (!found)
            fail("database_read", KILN_OK, "a compiled spec is missing from the database");
    }
    print_timing("database_read", "kiln_cache_get alone: SQLite read + zstd decode + SHA-256 check (no module load)",
                 arch, t, (size_t)n, 1, 0);

    kiln_jit_destroy(jit);
    kiln_cache_close(cache);

    /* (d) The same database signed and shipped: the read-only layer of a
     * fresh writable one, each time with a new jit; first without a trust
     * policy, then with one that lists the key. */
    kiln_jit_counters d_layer[2];
    char key_path[4300], pub_path[4300];
    tempdb_make(&g_layered, db_parent, "layered");
    write_key(&g_layered, key_files[0], bench_key_pem, key_path, sizeof key_path);
    write_key(&g_layered, key_files[1], bench_pub_pem, pub_path, sizeof pub_path);
    sign_database(&g_online, key_path);
    for (int trusted = 0; trusted < 2; trusted++) {
        const char *phase = trusted ? "signed_layer_hit_trusted" : "signed_layer_hit";
        cache = layered_open(&g_layered, g_online.path, trusted ? pub_path : NULL, phase);
        jit = jit_create(cache, rt, arch, phase);
        if ((st = kiln_jit_acquire(jit, &warm, &k)))
            fail(phase, st, NULL);
        time_acquire_all(jit, specs, n, 1, t, phase, &d_layer[trusted]);
        print_timing(phase,
                     trusted ? "kiln_jit_acquire, new jit, a signed read-only layer under a trust policy: a database"
                               " hit + the manifest check (a binary search, a SHA-256 of the row's columns)"
                             : "kiln_jit_acquire, new jit, a signed read-only layer without a trust policy: a"
                               " database hit from a layer",
                     arch, t, (size_t)n, 1, TARGET_DATABASE_HIT_US);
        kiln_jit_destroy(jit);
        kiln_cache_close(cache);
    }
    tempdb_remove(&g_layered);
    tempdb_remove(&g_online);
    kiln_runtime_destroy(rt);

    /* The counters prove each phase measured what it says. */
    int ok = print_counters("cold_compile_offline", &d_offline, (uint64_t)n, 0, 0);
    ok &= print_counters("cold_compile", &d_cold, (uint64_t)n, 0, 0);
    ok &= print_counters("database_hit", &d_db, 0, (uint64_t)n, 0);
    ok &= print_counters("memory_hit", &d_mem, 0, 0, (uint64_t)n * (uint64_t)reps);
    ok &= print_counters("signed_layer_hit", &d_layer[0], 0, (uint64_t)n, 0);
    ok &= print_counters("signed_layer_hit_trusted", &d_layer[1], 0, (uint64_t)n, 0);
    free(specs);
    free(t);
    return ok ? 0 : 1;
}
