/* The jit offline, with the real NVRTC and a real database file: compile once,
 * single flight, logs of failed compiles, corrupt rows recompiled. */
#include <pthread.h>
#include <sqlite3.h>

#include "jit/embedded.h"
#include "jit/internal.h"
#include "testutil.h"

typedef struct fixture {
    char dir[512];
    char path[600];
    kiln_cache *cache;
    kiln_jit *jit;
} fixture;

static kiln_jit *new_jit(kiln_cache *cache)
{
    kiln_jit_options o = {.cache = cache, .arch = "sm_90"};
    kiln_jit *j = NULL;
    KILN_CHECK(kiln_jit_create(&o, &j));
    return j;
}

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(f->path, sizeof f->path, "%s/kernels.db", f->dir);
    kiln_cache_options co = {.path = f->path};
    KILN_CHECK(kiln_cache_open(&co, &f->cache));
    f->jit = new_jit(f->cache);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    kiln_jit_destroy(f->jit);
    kiln_cache_close(f->cache);
    kiln_test_rmrf(f->dir);
    free(f);
    return 0;
}

static kiln_jit_counters counters(kiln_jit *j)
{
    kiln_jit_counters k;
    kiln_jit_get_counters(j, &k);
    return k;
}

static void test_compiles_once_then_memory_then_database(void **state)
{
    fixture *f = *state;
    kiln_spec s;
    int compiled = 0;
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 151936, 896, 8, &s));
    KILN_CHECK(kiln_jit_prepare(f->jit, &s, &compiled));
    assert_int_equal(compiled, 1);
    KILN_CHECK(kiln_jit_prepare(f->jit, &s, &compiled));
    assert_int_equal(compiled, 0);
    kiln_jit_counters k = counters(f->jit);
    assert_int_equal(k.compiles, 1);
    assert_int_equal(k.memory_hits, 1);

    /* A new jit (a new process, as far as memory goes) finds it in the database. */
    kiln_jit *j2 = new_jit(f->cache);
    KILN_CHECK(kiln_jit_prepare(j2, &s, &compiled));
    assert_int_equal(compiled, 0);
    assert_int_equal(counters(j2).compiles, 0);
    kiln_jit_destroy(j2);

    /* The row is what the jit says it is. */
    uint8_t fp[32];
    KILN_CHECK(kiln_jit_fingerprint(f->jit, &s, fp));
    void *cubin;
    size_t size;
    int found;
    KILN_CHECK(kiln_cache_get(f->cache, fp, &cubin, &size, &found));
    assert_int_equal(found, 1);
    /* An ELF file for the GPU. */
    assert_true(size > 64);
    assert_memory_equal(cubin, "\x7f" "ELF", 4);
    kiln_free(cubin);

    /* Offline, a jit can prepare but not load. */
    kiln_kernel *k2;
    KILN_EXPECT(kiln_jit_acquire(f->jit, &s, &k2), KILN_ERR_NO_DEVICE, kiln_errmsg(), "offline", NULL);
}

/* Whether the cubin holds line information (the section -lineinfo adds). */
static int has_line_info(const void *cubin, size_t size)
{
    static const char name[] = ".nv_debug_line_sass";
    for (size_t i = 0; i + sizeof name <= size; i++)
        if (!memcmp((const char *)cubin + i, name, sizeof name - 1))
            return 1;
    return 0;
}

/* $KILN_NVRTC_LINEINFO=1 compiles with -lineinfo: another fingerprint, a
 * cubin with line information beside the one without; 0 is unset; any
 * other value is refused by name. */
static void test_lineinfo_from_the_environment(void **state)
{
    fixture *f = *state;
    kiln_spec s;
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 1000, 256, 8, &s));
    uint8_t plain[32], zero[32], lined[32];
    KILN_CHECK(kiln_jit_fingerprint(f->jit, &s, plain));
    setenv("KILN_NVRTC_LINEINFO", "0", 1);
    kiln_jit *j0 = new_jit(f->cache);
    KILN_CHECK(kiln_jit_fingerprint(j0, &s, zero));
    kiln_jit_destroy(j0);
    assert_memory_equal(plain, zero, sizeof plain);
    setenv("KILN_NVRTC_LINEINFO", "1", 1);
    kiln_jit *j1 = new_jit(f->cache);
    unsetenv("KILN_NVRTC_LINEINFO");
    KILN_CHECK(kiln_jit_fingerprint(j1, &s, lined));
    assert_memory_not_equal(plain, lined, sizeof plain);
    KILN_CHECK(kiln_jit_prepare(j1, &s, NULL));
    KILN_CHECK(kiln_jit_prepare(f->jit, &s, NULL));
    kiln_jit_destroy(j1);
    const uint8_t *fps[2] = {plain, lined};
    for (int i = 0; i < 2; i++) {
        void *cubin;
        size_t size;
        int found;
        KILN_CHECK(kiln_cache_get(f->cache, fps[i], &cubin, &size, &found));
        assert_int_equal(found, 1);
        assert_int_equal(has_line_info(cubin, size), i);
        kiln_free(cubin);
    }

    setenv("KILN_NVRTC_LINEINFO", "yes", 1);
    kiln_jit *bad = (kiln_jit *)1;
    kiln_jit_options o = {.arch = "sm_90"};
    KILN_EXPECT(kiln_jit_create(&o, &bad), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "KILN_NVRTC_LINEINFO=\"yes\"",
                NULL);
    assert_null(bad);
    unsetenv("KILN_NVRTC_LINEINFO");
    /* Options named as many but not given. */
    o.n_nvrtc_options = 2;
    KILN_EXPECT(kiln_jit_create(&o, &bad), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "nvrtc_options is NULL",
                "n_nvrtc_options is 2");
    assert_null(bad);
}

typedef struct racer {
    kiln_jit *jit;
    kiln_spec spec;
    pthread_barrier_t *barrier;
    kiln_status st;
    int compiled;
} racer;

static void *race(void *arg)
{
    racer *r = arg;
    pthread_barrier_wait(r->barrier);
    r->st = kiln_jit_prepare(r->jit, &r->spec, &r->compiled);
    return NULL;
}

static void run_racers(kiln_jit *jit, const kiln_spec *specs, int n)
{
    pthread_t th[16];
    racer rs[16];
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, (unsigned)n);
    for (int i = 0; i < n; i++) {
        rs[i] = (racer){.jit = jit, .spec = specs[i], .barrier = &barrier};
        pthread_create(&th[i], NULL, race, &rs[i]);
    }
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        if (rs[i].st)
            fail_msg("thread %d: %s", i, kiln_status_code(rs[i].st));
    }
    pthread_barrier_destroy(&barrier);
}

static void test_eight_threads_one_key_one_compile(void **state)
{
    fixture *f = *state;
    kiln_spec specs[8];
    for (int i = 0; i < 8; i++)
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 32000, 2048, 8, &specs[i]));
    run_racers(f->jit, specs, 8);
    kiln_jit_counters k = counters(f->jit);
    assert_int_equal(k.compiles, 1);
    assert_int_equal(k.memory_hits, 7);
}

static void test_different_keys_compile_in_parallel(void **state)
{
    fixture *f = *state;
    kiln_spec specs[4];
    for (int i = 0; i < 4; i++)
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 32000, 1024 + 8 * i, 8, &specs[i]));
    run_racers(f->jit, specs, 4);
    kiln_jit_counters k = counters(f->jit);
    assert_int_equal(k.compiles, 4);
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(f->cache, &s));
    assert_int_equal(s.entries, 4);
}

static void test_compiles_are_bounded(void **state)
{
    fixture *f = *state;
    kiln_jit_options o = {.cache = f->cache, .arch = "sm_90", .max_parallel_compiles = 1};
    kiln_jit *j;
    KILN_CHECK(kiln_jit_create(&o, &j));
    kiln_spec specs[4];
    for (int i = 0; i < 4; i++)
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 4000, 512 + 8 * i, 8, &specs[i]));
    run_racers(j, specs, 4);
    assert_int_equal(counters(j).compiles, 4);
    assert_int_equal(kiln__jit_peak_compiles(j), 1);
    kiln_jit_destroy(j);
}

static void test_compile_error_carries_the_log(void **state)
{
    fixture *f = *state;
    kiln_spec s;
    KILN_CHECK(kiln_spec_init(&s, "token_embedding"));
    KILN_CHECK(kiln_spec_set(&s, "HIDDEN", 4096));
    KILN_CHECK(kiln_spec_set(&s, "VOCAB", 100));
    KILN_CHECK(kiln_spec_set(&s, "VEC", 3)); /* the template refuses it with #error */
    KILN_CHECK(kiln_spec_set(&s, "THREADS", 128));
    int compiled = 0;
    kiln_status st = kiln_jit_prepare(f->jit, &s, &compiled);
    KILN_EXPECT(st, KILN_ERR_NVRTC_COMPILE, kiln_errmsg(), "KILN_VEC must", "token_embedding");
    assert_non_null(strstr(kiln_jit_errmsg(f->jit), "KILN_VEC must"));
    assert_int_equal(counters(f->jit).compile_errors, 1);
    /* Nothing is stored, and a later call tries again (and fails again). */
    kiln_cache_stats cs;
    KILN_CHECK(kiln_cache_get_stats(f->cache, &cs));
    assert_int_equal(cs.entries, 0);
    assert_int_equal(kiln_jit_prepare(f->jit, &s, &compiled), KILN_ERR_NVRTC_COMPILE);
    assert_int_equal(counters(f->jit).compile_errors, 2);
}

static void test_unknown_template_and_bad_options(void **state)
{
    fixture *f = *state;
    kiln_spec s;
    KILN_CHECK(kiln_spec_init(&s, "no_such_op"));
    KILN_EXPECT(kiln_jit_prepare(f->jit, &s, NULL), KILN_ERR_NOT_FOUND, kiln_errmsg(), "no_such_op",
                     "token_embedding");
    kiln_jit *j = NULL;
    const char *bad[] = {"-arch=sm_80"};
    kiln_jit_options o = {.arch = "sm_90", .nvrtc_options = bad, .n_nvrtc_options = 1};
    KILN_EXPECT(kiln_jit_create(&o, &j), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "-arch=sm_80", NULL);
    assert_null(j);
    kiln_jit_options none = {0};
    KILN_EXPECT(kiln_jit_create(&none, &j), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "architecture", NULL);
    kiln_jit_options badarch = {.arch = "gfx90a"};
    KILN_EXPECT(kiln_jit_create(&badarch, &j), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "gfx90a", NULL);
    /* Fields past the caller's size take their defaults: the bad option is not read. */
    o.size = offsetof(kiln_jit_options, nvrtc_options);
    KILN_CHECK(kiln_jit_create(&o, &j));
    kiln_jit_destroy(j);
    o.size = 2;
    j = (kiln_jit *)1;
    KILN_EXPECT(kiln_jit_create(&o, &j), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "kiln_jit_options.size is 2", NULL);
    assert_null(j);
    assert_non_null(kiln_template_id(0));
    int seen = 0;
    for (size_t i = 0; kiln_template_id(i); i++)
        seen |= !strcmp(kiln_template_id(i), "token_embedding");
    assert_true(seen);
}

static void test_corrupt_row_is_recompiled(void **state)
{
    fixture *f = *state;
    kiln_spec s;
    int compiled = 0;
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 50001, 1000, 1, &s));
    KILN_CHECK(kiln_jit_prepare(f->jit, &s, &compiled));
    assert_int_equal(compiled, 1);
    /* Another process corrupts the row behind our back. */
    sqlite3 *db;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "UPDATE kernels SET checksum = zeroblob(32)", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    kiln_jit *j2 = new_jit(f->cache);
    KILN_CHECK(kiln_jit_prepare(j2, &s, &compiled));
    assert_int_equal(compiled, 1); /* a miss, recompiled */
    kiln_jit_counters k = counters(j2);
    assert_int_equal(k.corrupt_dropped, 1);
    assert_int_equal(k.compiles, 1);
    kiln_jit_destroy(j2);
    /* And the new row is whole. */
    kiln_jit *j3 = new_jit(f->cache);
    KILN_CHECK(kiln_jit_prepare(j3, &s, &compiled));
    assert_int_equal(compiled, 0);
    assert_int_equal(counters(j3).corrupt_dropped, 0);
    kiln_jit_destroy(j3);
}

/* Rows the test writes itself: prepare verifies a row but never loads its
 * cubin, so any bytes do; the other columns are the spec's, as the jit
 * checks a row is of the kernel its key is for. */
static void put_fake_row(kiln_cache *cache, kiln_jit *jit, const kiln_spec *spec)
{
    static const char cubin[] = "not a cubin: prepare only verifies it";
    char consts[512], parts[2048];
    KILN_CHECK(kiln_spec_constants_text(spec, consts, sizeof consts));
    KILN_CHECK(kiln_jit_fingerprint_parts(jit, spec, parts, sizeof parts));
    kiln_cache_record r = {.template_id = spec->template_id, .constants = consts, .arch = "sm_90", .entries = "k",
                           .parts = parts, .cubin = cubin, .cubin_size = sizeof cubin};
    const char *nvrtc = strstr(parts, ";nvrtc=");
    assert_non_null(nvrtc);
    assert_int_equal(sscanf(nvrtc, ";nvrtc=%d.%d", &r.nvrtc_major, &r.nvrtc_minor), 2);
    KILN_CHECK(kiln_jit_fingerprint(jit, spec, r.fingerprint));
    KILN_CHECK(kiln_cache_put(cache, &r));
}

#define CORRUPT_RACE_KEYS 256

typedef struct prepare_loop {
    kiln_jit *jit;
    const kiln_spec *specs;
    pthread_barrier_t *barrier;
    kiln_status st;
} prepare_loop;

static void *prepare_all(void *arg)
{
    prepare_loop *l = arg;
    pthread_barrier_wait(l->barrier);
    for (int i = 0; i < CORRUPT_RACE_KEYS && !l->st; i++)
        l->st = kiln_jit_prepare(l->jit, &l->specs[i], NULL);
    return NULL;
}

/* One thread's keys each meet a corrupt row in a read-only layer (skipped and
 * counted, the main database's row then found, so nothing compiles) while
 * another thread's keys meet only whole rows: the jit counts each corrupt row
 * once, however the two threads' loads interleave. */
static void test_corrupt_rows_counted_once_across_threads(void **state)
{
    fixture *f = *state;
    kiln_spec corrupt[CORRUPT_RACE_KEYS], whole[CORRUPT_RACE_KEYS];
    for (int i = 0; i < CORRUPT_RACE_KEYS; i++) {
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 7000 + i, 256, 8, &corrupt[i]));
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 9000 + i, 256, 8, &whole[i]));
    }
    char layer_path[640];
    snprintf(layer_path, sizeof layer_path, "%s/layer.db", f->dir);
    kiln_cache_options lo = {.path = layer_path};
    kiln_cache *layer;
    KILN_CHECK(kiln_cache_open(&lo, &layer));
    for (int i = 0; i < CORRUPT_RACE_KEYS; i++)
        put_fake_row(layer, f->jit, &corrupt[i]);
    kiln_cache_close(layer);
    sqlite3 *db;
    assert_int_equal(sqlite3_open(layer_path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "UPDATE kernels SET checksum = zeroblob(32)", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);

    const char *layers[] = {layer_path};
    kiln_cache_options co = {.path = f->path, .readonly_paths = layers, .n_readonly_paths = 1, .ignore_env = 1};
    kiln_cache *cache;
    KILN_CHECK(kiln_cache_open(&co, &cache));
    for (int i = 0; i < CORRUPT_RACE_KEYS; i++) {
        put_fake_row(cache, f->jit, &corrupt[i]);
        put_fake_row(cache, f->jit, &whole[i]);
    }
    kiln_jit *j = new_jit(cache);
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, 2);
    prepare_loop loops[2] = {{.jit = j, .specs = corrupt, .barrier = &barrier},
                             {.jit = j, .specs = whole, .barrier = &barrier}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, prepare_all, &loops[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        KILN_CHECK(loops[i].st);
    }
    pthread_barrier_destroy(&barrier);
    kiln_jit_counters k = counters(j);
    assert_int_equal(k.corrupt_dropped, CORRUPT_RACE_KEYS);
    assert_int_equal(k.compiles, 0);
    assert_int_equal(k.cache_errors, 0);
    kiln_cache_counters cc;
    kiln_cache_get_counters(cache, &cc);
    assert_int_equal(cc.corrupt_dropped, CORRUPT_RACE_KEYS);
    kiln_jit_destroy(j);
    kiln_cache_close(cache);
}

static void test_without_a_database(void **state)
{
    (void)state;
    kiln_jit *j = new_jit(NULL);
    kiln_spec s;
    int compiled = 0;
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 1000, 64, 8, &s));
    KILN_CHECK(kiln_jit_prepare(j, &s, &compiled));
    assert_int_equal(compiled, 1);
    KILN_CHECK(kiln_jit_prepare(j, &s, &compiled));
    assert_int_equal(compiled, 0);
    kiln_jit_destroy(j);
    kiln_jit_destroy(NULL);
}

/* kiln launches every kernel with programmatic dependent launch: a kernel may
 * start before the one ahead of it has finished, so each must call
 * kiln_grid_dependency_sync() (or kiln_grid_dependency_wait_then_launch(),
 * or kiln_grid_dependency_wait() with a kiln_grid_launch_dependents() after
 * it) before anything else, or start with the marker of a prologue the sync
 * follows (kiln_prelude.cuh). Every __global__ function of every embedded
 * template: its body's first statement. */
static void test_every_kernel_syncs_on_the_grid_before_it(void **state)
{
    (void)state;
    size_t kernels = 0;
    for (size_t i = 0; i < kiln__embedded_count; i++) {
        const kiln__embedded_file *f = &kiln__embedded_files[i];
        for (const char *p = strstr(f->data, "__global__"); p; p = strstr(p + 1, "__global__")) {
            const char *body = strchr(p, '{');
            assert_non_null(body);
            body++;
            while (*body == ' ' || *body == '\n' || *body == '\t')
                body++;
            static const char want[] = "kiln_grid_dependency_sync();",
                              other[] = "kiln_grid_dependency_wait_then_launch();",
                              wait[] = "kiln_grid_dependency_wait();", launch[] = "kiln_grid_launch_dependents();",
                              early[] = "KILN_WEIGHT_BEFORE_DEPENDENCY_SYNC;",
                              input[] = "KILN_INPUT_BEFORE_DEPENDENCY_SYNC;";
            const int weight_first = !strncmp(body, early, sizeof early - 1);
            if (weight_first || !strncmp(body, input, sizeof input - 1)) {
                /* A prologue before the sync: the sync must come in the same body. */
                const char *next = strstr(body, "__global__"), *sync = strstr(body, want);
                if (!sync || (next && sync > next))
                    fail_msg("%s: a kernel starts with %s but has no %s after it", f->name,
                             weight_first ? early : input, want);
                kernels++;
                continue;
            }
            if (!strncmp(body, wait, sizeof wait - 1)) {
                /* The wait alone: the kernel must let its dependents launch in the same body. */
                const char *next = strstr(body, "__global__"), *go = strstr(body, launch);
                if (!go || (next && go > next))
                    fail_msg("%s: a kernel starts with %s but has no %s after it", f->name, wait, launch);
                kernels++;
                continue;
            }
            if (strncmp(body, want, sizeof want - 1) && strncmp(body, other, sizeof other - 1)) {
                char line[80];
                snprintf(line, sizeof line, "%.60s", body);
                fail_msg("%s: a kernel body starts with \"%s\", not %s", f->name, line, want);
            }
            kernels++;
        }
    }
    fprintf(stderr, "%zu kernels start with kiln_grid_dependency_sync()\n", kernels);
    assert_true(kernels >= 10);
}

int main(void)
{
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(test_compiles_once_then_memory_then_database),
        T(test_lineinfo_from_the_environment),
        T(test_eight_threads_one_key_one_compile),
        T(test_different_keys_compile_in_parallel),
        T(test_compiles_are_bounded),
        T(test_compile_error_carries_the_log),
        T(test_unknown_template_and_bad_options),
        T(test_corrupt_row_is_recompiled),
        T(test_corrupt_rows_counted_once_across_threads),
        T(test_without_a_database),
        cmocka_unit_test(test_every_kernel_syncs_on_the_grid_before_it),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
