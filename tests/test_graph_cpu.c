/* The graph executable cache's bookkeeping on the CPU (runtime/graph.c):
 * segment keys, lookup, rejected segments, LRU eviction by count and bytes,
 * trim, references held by batches, module epochs, batch buckets. The driver
 * table is a stub that counts destroyed executables; no GPU is involved. */
#include <stdatomic.h>

#include "runtime/internal.h"
#include "fake_runtime.h"
#include "testutil.h"

static int destroyed;

static CUresult stub_ctx_get(CUcontext *c)
{
    *c = (CUcontext)0x1;
    return CUDA_SUCCESS;
}

static CUresult stub_exec_destroy(CUgraphExec e)
{
    (void)e;
    destroyed++;
    return CUDA_SUCCESS;
}

static kiln__driver stub_driver;

typedef struct cache_fixture {
    kiln_runtime *rt;
    kiln_stream stream; /* only what graph.c reads: rt and graphs */
    kiln_command *cmds[6];
} cache_fixture;

static kiln_status enqueue_nothing(void *user, const kiln_launch_context *ctx)
{
    (void)user;
    (void)ctx;
    return KILN_OK;
}

static int setup(void **state)
{
    cache_fixture *f = calloc(1, sizeof *f);
    stub_driver.cuCtxGetCurrent = stub_ctx_get;
    stub_driver.cuGraphExecDestroy = stub_exec_destroy;
    f->rt = fake_runtime(1);
    f->rt->d = &stub_driver;
    f->rt->ctx = (CUcontext)0x1;
    f->stream.rt = f->rt;
    KILN_CHECK(kiln__graph_cache_create(f->rt, &f->stream.graphs));
    for (int i = 0; i < 6; i++) {
        char key[32];
        int n = snprintf(key, sizeof key, "key-%d", i % 5); /* commands 0 and 5 have one key */
        kiln_command_desc d = {.op_id = "test.op", .enqueue = enqueue_nothing, .replay_key = key,
                               .replay_key_bytes = (size_t)n};
        KILN_CHECK(kiln_command_create(f->rt, &d, &f->cmds[i]));
    }
    destroyed = 0;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    cache_fixture *f = *state;
    kiln__graph_cache_destroy(f->stream.graphs);
    for (int i = 0; i < 6; i++)
        kiln_command_release(f->cmds[i]);
    fake_runtime_free(f->rt);
    free(f);
    return 0;
}

static CUgraphExec fake_exec(int i) { return (CUgraphExec)(uintptr_t)(0x1000 + i); }

static kiln__graph *insert(cache_fixture *f, uint32_t first, uint32_t last, size_t bytes)
{
    kiln__graph *g;
    uint64_t h = kiln__segment_hash(f->cmds, first, last);
    KILN_CHECK(kiln__graph_insert(f->stream.graphs, f->cmds, first, last, h, fake_exec((int)first), bytes, &g));
    return g;
}

static kiln__graph *find(cache_fixture *f, uint32_t first, uint32_t last, int *rejected)
{
    int dummy;
    return kiln__graph_find(f->stream.graphs, f->cmds, first, last, kiln__segment_hash(f->cmds, first, last),
                            rejected ? rejected : &dummy);
}

static void test_keys_and_lookup(void **state)
{
    cache_fixture *f = *state;
    /* The hash covers the keys in order; equal keys in other commands match. */
    assert_true(kiln__segment_hash(f->cmds, 0, 1) != kiln__segment_hash(f->cmds, 1, 2));
    assert_int_equal(kiln__segment_hash(f->cmds, 0, 0), kiln__segment_hash(f->cmds, 5, 5));
    assert_null(find(f, 0, 1, NULL));
    kiln__graph *g = insert(f, 0, 1, 4096);
    assert_ptr_equal(find(f, 0, 1, NULL), g);
    assert_null(find(f, 0, 0, NULL)); /* a prefix is another segment */
    assert_null(find(f, 1, 2, NULL));
    kiln__graph *g5 = insert(f, 5, 5, 4096);
    assert_ptr_equal(find(f, 0, 0, NULL), g5); /* command 0's key equals command 5's */
    kiln_graph_stats s;
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.captured, 2);
    assert_int_equal(s.resident, 2);
    assert_int_equal(s.resident_bytes, 8192);
}

static void test_rejected_is_remembered(void **state)
{
    cache_fixture *f = *state;
    int rejected = 0;
    uint64_t h = kiln__segment_hash(f->cmds, 1, 3);
    kiln__graph_reject(f->stream.graphs, f->cmds, 1, 3, h);
    assert_null(find(f, 1, 3, &rejected));
    assert_int_equal(rejected, 1);
    assert_null(find(f, 1, 3, &rejected));
    assert_int_equal(rejected, 1);
    assert_null(find(f, 1, 2, &rejected));
    assert_int_equal(rejected, 0);
    kiln_graph_stats s;
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.rejected, 1);
    assert_int_equal(s.resident, 0);
    /* Trim forgets it: tried again later. */
    KILN_CHECK(kiln_stream_graph_trim(&f->stream, 0, 0));
    assert_null(find(f, 1, 3, &rejected));
    assert_int_equal(rejected, 0);
}

static void test_lru_by_count_and_bytes(void **state)
{
    cache_fixture *f = *state;
    kiln_graph_options o = {.size = sizeof o, .max_graphs = 3, .max_bytes = 10000};
    KILN_CHECK(kiln_stream_set_graph_options(&f->stream, &o));
    insert(f, 0, 0, 1000);
    insert(f, 1, 1, 1000);
    insert(f, 2, 2, 1000);
    kiln__graph_hit(f->stream.graphs, find(f, 0, 0, NULL)); /* 1 is now the coldest */
    insert(f, 3, 3, 1000);
    assert_null(find(f, 1, 1, NULL));
    assert_non_null(find(f, 0, 0, NULL));
    assert_int_equal(destroyed, 1);
    /* Bytes: a big one pushes out the cold ones, never itself. */
    insert(f, 4, 4, 9000); /* 12000 bytes: the two coldest go, 10000 stay */
    kiln_graph_stats s;
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.resident, 2);
    assert_int_equal(s.resident_bytes, 10000);
    assert_int_equal(s.evicted, 3);
    assert_non_null(find(f, 3, 3, NULL));
    assert_null(find(f, 2, 2, NULL));
    assert_non_null(find(f, 4, 4, NULL));
    insert(f, 2, 2, 11000); /* bigger than the budget alone: kept, everything else goes */
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.resident, 1);
    assert_int_equal(s.resident_bytes, 11000);
    o.max_bytes = 1;
    KILN_CHECK(kiln_stream_set_graph_options(&f->stream, &o));
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.resident, 0);
    assert_int_equal(destroyed, 6);
}

static void test_batches_keep_evicted_graphs(void **state)
{
    cache_fixture *f = *state;
    kiln__graph *g = insert(f, 2, 3, 1000);
    kiln__graph_ref(g); /* a pending batch */
    KILN_CHECK(kiln_stream_graph_trim(&f->stream, 0, 0));
    assert_null(find(f, 2, 3, NULL));
    assert_int_equal(destroyed, 0);
    assert_ptr_equal(kiln__graph_exec(g), fake_exec(2));
    kiln__graph_unref(g); /* the batch is freed */
    assert_int_equal(destroyed, 1);
}

static void test_module_epoch_drops_older_graphs(void **state)
{
    cache_fixture *f = *state;
    insert(f, 0, 0, 1000);
    atomic_fetch_add(&f->rt->module_epoch, 1);
    assert_null(find(f, 0, 0, NULL));
    kiln_graph_stats s;
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.evicted, 1);
    assert_int_equal(s.resident, 0);
    insert(f, 0, 0, 1000);
    assert_non_null(find(f, 0, 0, NULL));
}

static void test_many_segments_grow_the_table(void **state)
{
    cache_fixture *f = *state;
    enum { N = 300 };
    kiln_command *c[N];
    for (int i = 0; i < N; i++) {
        uint32_t key = (uint32_t)i * 2654435761u;
        kiln_command_desc d = {.op_id = "test.op", .enqueue = enqueue_nothing, .replay_key = &key,
                               .replay_key_bytes = sizeof key};
        KILN_CHECK(kiln_command_create(f->rt, &d, &c[i]));
    }
    kiln_graph_options o = {.size = sizeof o, .max_graphs = 1000};
    KILN_CHECK(kiln_stream_set_graph_options(&f->stream, &o));
    for (int i = 0; i < N; i++) {
        kiln__graph *g;
        KILN_CHECK(kiln__graph_insert(f->stream.graphs, c, (uint32_t)i, (uint32_t)i,
                                      kiln__segment_hash(c, (uint32_t)i, (uint32_t)i), fake_exec(i), 10, &g));
    }
    for (int i = 0; i < N; i++) {
        int rej;
        kiln__graph *g = kiln__graph_find(f->stream.graphs, c, (uint32_t)i, (uint32_t)i,
                                          kiln__segment_hash(c, (uint32_t)i, (uint32_t)i), &rej);
        assert_non_null(g);
        assert_ptr_equal(kiln__graph_exec(g), fake_exec(i));
    }
    /* Rejections are bounded (256 remembered, the oldest forgotten). */
    for (int i = 0; i < N; i++)
        kiln__graph_reject(f->stream.graphs, c, 0, (uint32_t)i, kiln__segment_hash(c, 0, (uint32_t)i));
    int rej = 0;
    assert_null(kiln__graph_find(f->stream.graphs, c, 0, N - 1, kiln__segment_hash(c, 0, N - 1), &rej));
    assert_int_equal(rej, 1);
    assert_null(kiln__graph_find(f->stream.graphs, c, 0, 1, kiln__segment_hash(c, 0, 1), &rej));
    assert_int_equal(rej, 0);
    KILN_CHECK(kiln_stream_graph_trim(&f->stream, 0, 0));
    assert_int_equal(destroyed, N);
    for (int i = 0; i < N; i++)
        kiln_command_release(c[i]);
}

static void test_buckets(void **state)
{
    cache_fixture *f = *state;
    uint32_t b;
    static const uint32_t want[][2] = {{1, 1}, {2, 2}, {3, 4}, {5, 8}, {9, 16}, {17, 32}, {33, 64}, {64, 64}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        KILN_CHECK(kiln_stream_batch_bucket(&f->stream, want[i][0], &b));
        assert_int_equal(b, want[i][1]);
    }
    KILN_EXPECT(kiln_stream_batch_bucket(&f->stream, 0, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "0 participants", "1 to 64");
    uint32_t too_many[KILN_MAX_BATCH_BUCKETS + 1];
    for (int i = 0; i <= KILN_MAX_BATCH_BUCKETS; i++)
        too_many[i] = (uint32_t)i + 1;
    kiln_graph_options o = {.size = sizeof o, .buckets = too_many, .n_buckets = KILN_MAX_BATCH_BUCKETS + 1};
    KILN_EXPECT(kiln_stream_set_graph_options(&f->stream, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "33 batch buckets", "at most 32");
    uint32_t zero[2] = {0, 4};
    o.buckets = zero;
    o.n_buckets = 2;
    KILN_EXPECT(kiln_stream_set_graph_options(&f->stream, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "bucket 0 is 0", "> 0");
    KILN_CHECK(kiln_stream_batch_bucket(&f->stream, 3, &b));
    assert_int_equal(b, 4); /* unchanged */
}

int main(void)
{
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(test_keys_and_lookup),          T(test_rejected_is_remembered),
        T(test_lru_by_count_and_bytes),   T(test_batches_keep_evicted_graphs),
        T(test_module_epoch_drops_older_graphs), T(test_many_segments_grow_the_table),
        T(test_buckets),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
