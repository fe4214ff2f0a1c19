/* The shipping scenario: a database prewarmed on a machine without a GPU
 * (`kiln prewarm`, at build time) is carried here; running the embedding
 * compiles nothing. */
#include "embedding_check.h"

static void copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    if (!a)
        fail_msg("no prewarmed database at %s", from);
    assert_non_null(b);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a)) > 0)
        assert_int_equal(fwrite(buf, 1, n, b), n);
    fclose(a);
    fclose(b);
}

static void test_prewarmed_database_compiles_nothing(void **state)
{
    (void)state;
    const char *shipped = getenv("KILN_SHIPPED_DB");
    if (!shipped)
        shipped = KILN_SHIPPED_DB;
    char dir[512], path[600];
    kiln_test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/kernels.db", dir);
    copy_file(shipped, path);

    kiln_cache *cache;
    kiln_runtime *rt;
    kiln_jit *jit;
    kiln_cache_options co = {.path = path};
    KILN_CHECK(kiln_cache_open(&co, &cache));
    KILN_CHECK(kiln_runtime_create(NULL, &rt));
    kiln_jit_options jo = {.cache = cache, .runtime = rt};
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    kiln_rng rng = kiln_rng_new();
    /* The two models prewarmed at build time: the default and Qwen2.5-0.5B. */
    const emb_case cases[] = {
        {128256, 4096, 2048, 0, 0, UINT32_MAX},
        {151936, 896, 2048, 0, 0, UINT32_MAX},
    };
    for (size_t i = 0; i < 2; i++)
        KILN_CHECK(run_embedding_case(rt, jit, &rng, &cases[i]));
    kiln_jit_counters k;
    kiln_jit_get_counters(jit, &k);
    fprintf(stderr, "compiles %llu, database hits %llu, memory hits %llu\n", (unsigned long long)k.compiles,
            (unsigned long long)k.database_hits, (unsigned long long)k.memory_hits);
    assert_int_equal(k.compiles, 0);
    assert_int_equal(k.database_hits, 2);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);
    kiln_cache_close(cache);
    kiln_test_rmrf(dir);
}

int main(void)
{
    kiln_test_require_gpu();
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_prewarmed_database_compiles_nothing)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
