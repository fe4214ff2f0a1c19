/* Strict mode (KILN_JIT=off, kiln_jit_options.compile): hits work, a miss
 * fails with jit_disabled naming the kernel and the nearest row, and nothing
 * compiles. The rows are compiled by the real NVRTC into a real database. */
#include <stdlib.h>

#include "testutil.h"

typedef struct fixture {
    char dir[512];
    char path[600];
    kiln_cache *cache;
    kiln_spec have;                     /* in the database */
    char have_hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_spec want;                     /* another VOCAB: in no database */
} fixture;

static kiln_jit *new_jit(kiln_cache *cache, int compile)
{
    kiln_jit_options o = {.size = sizeof o, .cache = cache, .arch = "sm_90", .compile = compile};
    kiln_jit *j = NULL;
    KILN_CHECK(kiln_jit_create(&o, &j));
    return j;
}

static void embedding(kiln_spec *s, int64_t vocab)
{
    KILN_CHECK(kiln_spec_init(s, "token_embedding"));
    KILN_CHECK(kiln_spec_set(s, "HIDDEN", 256));
    KILN_CHECK(kiln_spec_set(s, "VOCAB", vocab));
    KILN_CHECK(kiln_spec_set(s, "VEC", 8));
    KILN_CHECK(kiln_spec_set(s, "THREADS", 32));
}

static uint64_t compiles(kiln_jit *j)
{
    kiln_jit_counters k;
    kiln_jit_get_counters(j, &k);
    return k.compiles;
}

/* A database holding one kernel, compiled by an offline jit that may compile. */
static int setup(void **state)
{
    unsetenv("KILN_JIT");
    fixture *f = calloc(1, sizeof *f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(f->path, sizeof f->path, "%s/kernels.db", f->dir);
    kiln_cache_options co = {.size = sizeof co, .path = f->path, .ignore_env = 1};
    KILN_CHECK(kiln_cache_open(&co, &f->cache));
    embedding(&f->have, 1000);
    embedding(&f->want, 2000);
    kiln_jit *j = new_jit(f->cache, KILN_JIT_COMPILE_ON);
    int compiled = 0;
    KILN_CHECK(kiln_jit_prepare(j, &f->have, &compiled));
    assert_int_equal(compiled, 1);
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    KILN_CHECK(kiln_jit_fingerprint(j, &f->have, fp));
    kiln_fingerprint_hex(fp, f->have_hex);
    kiln_jit_destroy(j);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    kiln_cache_close(f->cache);
    kiln_test_rmrf(f->dir);
    free(f);
    unsetenv("KILN_JIT");
    return 0;
}

/* The message of a refused miss: the kernel, its constants, the arch, and
 * the nearest row with only the differing constant named. */
static void expect_refused(kiln_jit *j, const kiln_spec *want, const char *nearest_hex)
{
    int compiled = 1;
    kiln_status st = kiln_jit_prepare(j, want, &compiled);
    const char *msg = kiln_jit_errmsg(j);
    KILN_EXPECT(st, KILN_ERR_JIT_DISABLED, msg, "template token_embedding", "HIDDEN=256;THREADS=32;VEC=8;VOCAB=2000");
    assert_int_equal(compiled, 0);
    assert_non_null(strstr(msg, "arch sm_90"));
    char nearest[128];
    snprintf(nearest, sizeof nearest, "nearest %s differs: constants ", nearest_hex);
    const char *differs = strstr(msg, nearest);
    assert_non_null(differs);
    assert_non_null(strstr(differs, "VOCAB=1000 -> HIDDEN=256;THREADS=32;VEC=8;VOCAB=2000"));
    assert_null(strstr(differs, ", ")); /* the parts that agree are not listed */
    assert_string_equal(kiln_errmsg(), msg);
}

static void test_hit_and_miss(void **state)
{
    fixture *f = *state;
    kiln_jit *j = new_jit(f->cache, KILN_JIT_COMPILE_OFF);
    int compiled = 1;
    KILN_CHECK(kiln_jit_prepare(j, &f->have, &compiled)); /* a database hit */
    assert_int_equal(compiled, 0);
    KILN_CHECK(kiln_jit_prepare(j, &f->have, &compiled)); /* a memory hit */
    expect_refused(j, &f->want, f->have_hex);
    expect_refused(j, &f->want, f->have_hex); /* a retry is refused again, not compiled */
    assert_int_equal(compiles(j), 0);
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    int found = 1;
    KILN_CHECK(kiln_jit_fingerprint(j, &f->want, fp));
    KILN_CHECK(kiln_cache_contains(f->cache, fp, &found));
    assert_int_equal(found, 0);
    /* Offline, an acquire cannot load; strict mode changes nothing there. */
    kiln_kernel *k = NULL;
    assert_int_equal(kiln_jit_acquire(j, &f->have, &k), KILN_ERR_NO_DEVICE);
    kiln_jit_destroy(j);
}

/* A shipped layer: its rows are hits, and the nearest row of a miss is found
 * in it though the writable database is empty. */
static void test_layer(void **state)
{
    fixture *f = *state;
    char empty[700];
    snprintf(empty, sizeof empty, "%s/empty.db", f->dir);
    const char *layers[] = {f->path};
    kiln_cache_options co = {
        .size = sizeof co, .path = empty, .ignore_env = 1, .readonly_paths = layers, .n_readonly_paths = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&co, &c));
    kiln_cache_layer_info li;
    KILN_CHECK(kiln_cache_layer(c, 0, &li));
    assert_true(li.active);
    kiln_jit *j = new_jit(c, KILN_JIT_COMPILE_OFF);
    int compiled = 1;
    KILN_CHECK(kiln_jit_prepare(j, &f->have, &compiled));
    assert_int_equal(compiled, 0);
    expect_refused(j, &f->want, f->have_hex);
    kiln_jit_destroy(j);
    kiln_cache_close(c);
}

static void test_no_database(void **state)
{
    fixture *f = *state;
    kiln_jit *j = new_jit(NULL, KILN_JIT_COMPILE_OFF);
    KILN_EXPECT(kiln_jit_prepare(j, &f->have, NULL), KILN_ERR_JIT_DISABLED, kiln_jit_errmsg(j), "VOCAB=1000",
                "the jit has no database");
    assert_int_equal(compiles(j), 0);
    kiln_jit_destroy(j);
}

static void test_environment(void **state)
{
    fixture *f = *state;
    kiln_jit_options o = {.size = sizeof o, .cache = f->cache, .arch = "sm_90"};
    kiln_jit *j = (kiln_jit *)1;
    setenv("KILN_JIT", "bogus", 1);
    KILN_EXPECT(kiln_jit_create(&o, &j), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "KILN_JIT", "\"bogus\"");
    assert_null(j);
    setenv("KILN_JIT", "", 1);
    KILN_EXPECT(kiln_jit_create(&o, &j), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "KILN_JIT=\"\"", NULL);
    o.compile = 7;
    unsetenv("KILN_JIT");
    KILN_EXPECT(kiln_jit_create(&o, &j), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "compile mode 7", NULL);

    /* off: the default mode is strict. */
    setenv("KILN_JIT", "off", 1);
    j = new_jit(f->cache, KILN_JIT_COMPILE_ENV);
    KILN_CHECK(kiln_jit_prepare(j, &f->have, NULL));
    expect_refused(j, &f->want, f->have_hex);
    kiln_jit_destroy(j);
    /* A caller that asks to compile is not overruled by the environment. */
    j = new_jit(f->cache, KILN_JIT_COMPILE_ON);
    int compiled = 0;
    KILN_CHECK(kiln_jit_prepare(j, &f->want, &compiled));
    assert_int_equal(compiled, 1);
    kiln_jit_destroy(j);
    /* on: compiles as without the variable (want is stored now: a hit). */
    setenv("KILN_JIT", "on", 1);
    j = new_jit(f->cache, KILN_JIT_COMPILE_ENV);
    kiln_spec third;
    embedding(&third, 3000);
    KILN_CHECK(kiln_jit_prepare(j, &third, &compiled));
    assert_int_equal(compiled, 1);
    kiln_jit_destroy(j);
}

/* With a GPU: an acquire in strict mode loads a database hit. */
static void test_acquire_hit_on_device(void **state)
{
    fixture *f = *state;
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        skip();
        return;
    }
    kiln_runtime *rt = NULL;
    KILN_CHECK(kiln_runtime_create(NULL, &rt));
    kiln_jit_options o = {.size = sizeof o, .cache = f->cache, .runtime = rt, .arch = "sm_90",
                          .compile = KILN_JIT_COMPILE_OFF};
    kiln_jit *j = NULL;
    KILN_CHECK(kiln_jit_create(&o, &j));
    kiln_kernel *k = NULL;
    KILN_CHECK(kiln_jit_acquire(j, &f->have, &k));
    void *fn = NULL;
    KILN_CHECK(kiln_kernel_function(k, NULL, &fn));
    assert_non_null(fn);
    assert_int_equal(kiln_jit_acquire(j, &f->want, &k), KILN_ERR_JIT_DISABLED);
    assert_int_equal(compiles(j), 0);
    kiln_jit_destroy(j);
    kiln_runtime_destroy(rt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hit_and_miss, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_no_database, setup, teardown),
        cmocka_unit_test_setup_teardown(test_environment, setup, teardown),
        cmocka_unit_test_setup_teardown(test_acquire_hit_on_device, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
