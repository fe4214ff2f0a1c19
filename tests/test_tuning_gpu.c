/* cuBLASLt choices kept in the database: a product shape timed under one
 * runtime and cache is loaded, not timed, under the next (what a later
 * process, or a machine that receives the database, does); a damaged tuning
 * row is a miss that is timed and stored again. Skips without a driver. */
#include <sqlite3.h>

#include "testutil.h"

void kiln__blas_tuning_counters(uint64_t *timed, uint64_t *loaded, uint64_t *stored, uint64_t *stale);

typedef struct shape {
    int64_t tokens, in, out; /* narrow (timed L2-cold) and wide (timed back to back) */
} shape;
static const shape shapes[] = {{16, 4096, 4096}, {512, 4096, 4096}};
#define N_SHAPES (sizeof shapes / sizeof shapes[0])

typedef struct counts {
    uint64_t timed, loaded, stored, stale;
} counts;

static counts now(void)
{
    counts c;
    kiln__blas_tuning_counters(&c.timed, &c.loaded, &c.stored, &c.stale);
    return c;
}

/* One runtime, jit and cache open, as a process would: runs every shape. */
static void run_process(const char *path)
{
    kiln_cache *cache = NULL;
    kiln_runtime *rt = NULL;
    kiln_jit *jit = NULL;
    kiln_cache_options co = {.size = sizeof co, .path = path, .ignore_env = 1};
    KILN_CHECK(kiln_cache_open(&co, &cache));
    KILN_CHECK(kiln_runtime_create(NULL, &rt));
    kiln_jit_options jo = {.size = sizeof jo, .cache = cache, .runtime = rt};
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    for (size_t i = 0; i < N_SHAPES; i++) {
        const shape *s = &shapes[i];
        size_t ws_bytes;
        kiln_buffer *bx, *bw, *bo, *bws;
        KILN_CHECK(kiln_op_dense_linear_workspace(s->tokens, s->in, s->out, &ws_bytes));
        KILN_CHECK(kiln_buffer_create(rt, (size_t)(s->tokens * s->in * 2), 256, &bx));
        KILN_CHECK(kiln_buffer_create(rt, (size_t)(s->out * s->in * 2), 256, &bw));
        KILN_CHECK(kiln_buffer_create(rt, (size_t)(s->tokens * s->out * 2), 256, &bo));
        KILN_CHECK(kiln_buffer_create(rt, ws_bytes, 256, &bws));
        KILN_CHECK(kiln_buffer_fill(bx, 0, 0, kiln_buffer_size(bx)));
        KILN_CHECK(kiln_buffer_fill(bw, 0, 0, kiln_buffer_size(bw)));
        kiln_tensor x = {.buffer = bx, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {s->tokens, s->in}};
        kiln_tensor w = {.buffer = bw, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {s->out, s->in}};
        kiln_tensor o = {.buffer = bo, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {s->tokens, s->out}};
        kiln_region ws = {bws, 0, ws_bytes};
        KILN_CHECK(kiln_op_dense_linear(jit, &x, &w, NULL, &o, &ws));
        KILN_CHECK(kiln_runtime_synchronize(rt));
        kiln_buffer_destroy(bx);
        kiln_buffer_destroy(bw);
        kiln_buffer_destroy(bo);
        kiln_buffer_destroy(bws);
    }
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);
    kiln_cache_close(cache);
}

static uint64_t tuning_rows(const char *path)
{
    kiln_cache *c = NULL;
    kiln_cache_options co = {.size = sizeof co, .path = path, .read_only = 1, .ignore_env = 1};
    KILN_CHECK(kiln_cache_open(&co, &c));
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    kiln_cache_close(c);
    return s.tuning_rows;
}

static void test_second_open_times_nothing(void **state)
{
    (void)state;
    char dir[512], path[600];
    kiln_test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/kernels.db", dir);
    unsetenv("KILN_BLAS_TUNE");
    counts a = now();
    run_process(path);
    counts b = now();
    printf("first: %llu shapes timed, %llu rows stored\n", (unsigned long long)(b.timed - a.timed),
           (unsigned long long)(b.stored - a.stored));
    assert_int_equal(b.timed - a.timed, N_SHAPES);
    assert_int_equal(b.stored - a.stored, N_SHAPES);
    assert_int_equal(tuning_rows(path), N_SHAPES);

    run_process(path);
    counts c = now();
    printf("second: %llu shapes timed, %llu choices loaded, %llu stale\n", (unsigned long long)(c.timed - b.timed),
           (unsigned long long)(c.loaded - b.loaded), (unsigned long long)(c.stale - b.stale));
    assert_int_equal(c.timed - b.timed, 0);
    assert_int_equal(c.loaded - b.loaded, N_SHAPES);
    assert_int_equal(c.stale - b.stale, 0);

    /* A damaged row is a miss: that shape is timed and stored again. */
    sqlite3 *db;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "UPDATE tuning SET payload = x'00' || payload WHERE key LIKE '%;n=16;%'", NULL,
                                  NULL, NULL),
                     SQLITE_OK);
    assert_int_equal(sqlite3_changes(db), 1);
    sqlite3_close(db);
    run_process(path);
    counts d = now();
    printf("damaged: %llu shapes timed, %llu choices loaded\n", (unsigned long long)(d.timed - c.timed),
           (unsigned long long)(d.loaded - c.loaded));
    assert_int_equal(d.timed - c.timed, 1);
    assert_int_equal(d.loaded - c.loaded, N_SHAPES - 1);
    assert_int_equal(tuning_rows(path), N_SHAPES);
    kiln_test_rmrf(dir);
}

int main(void)
{
    kiln_test_require_gpu();
    kiln_test_filter();
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_second_open_times_nothing)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
