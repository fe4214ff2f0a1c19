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

/* One submission's capture: a call of its own. */
static kiln__graph *insert(cache_fixture *f, uint32_t first, uint32_t last, size_t bytes)
{
    kiln__graph *g;
    kiln__graph_cache_begin_call(f->stream.graphs);
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

/* One call (a batch or a prepare) never evicts what it uses itself: the
 * capacity holds again from the next call on. */
static void test_a_call_keeps_what_it_uses(void **state)
{
    cache_fixture *f = *state;
    kiln_graph_options o = {.size = sizeof o, .max_graphs = 1};
    KILN_CHECK(kiln_stream_set_graph_options(&f->stream, &o));
    kiln__graph_cache *c = f->stream.graphs;
    kiln__graph_cache_begin_call(c);
    kiln__graph *a, *b;
    KILN_CHECK(kiln__graph_insert(c, f->cmds, 0, 0, kiln__segment_hash(f->cmds, 0, 0), fake_exec(0), 10, &a));
    KILN_CHECK(kiln__graph_insert(c, f->cmds, 1, 1, kiln__segment_hash(f->cmds, 1, 1), fake_exec(1), 10, &b));
    kiln_graph_stats s;
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.resident, 2); /* over capacity within the call */
    assert_int_equal(s.evicted, 0);
    /* The next call: its first capture brings the count back to 1. */
    insert(f, 2, 2, 10);
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.resident, 1);
    assert_int_equal(s.evicted, 2);
    /* A resident graph the call found (kiln__graph_use) is kept too. */
    kiln__graph_cache_begin_call(c);
    kiln__graph *g2 = find(f, 2, 2, NULL);
    assert_non_null(g2);
    kiln__graph_use(c, g2);
    kiln__graph *g3;
    KILN_CHECK(kiln__graph_insert(c, f->cmds, 3, 3, kiln__segment_hash(f->cmds, 3, 3), fake_exec(3), 10, &g3));
    assert_ptr_equal(find(f, 2, 2, NULL), g2);
    /* Trim is not a call's capacity check: it takes everything asked. */
    KILN_CHECK(kiln_stream_graph_trim(&f->stream, 1, 0)); /* keep 1 graph, no byte limit */
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.resident, 1);
    assert_non_null(find(f, 3, 3, NULL)); /* the most recent stays */
    KILN_CHECK(kiln_stream_graph_trim(&f->stream, 0, 15)); /* no count limit, 15 bytes: one graph of 10 */
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.resident, 1);
    KILN_CHECK(kiln_stream_graph_trim(&f->stream, 0, 0));
    kiln_stream_graph_stats(&f->stream, &s);
    assert_int_equal(s.resident, 0);
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
    for (int i = 1; i < N; i++) /* [0, 0] is resident: never also rejected */
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

/* ---- stream.c's graph paths against a stub driver ----
 * Captures always "succeed" unless a command that cannot be captured is
 * enqueued while capturing (then the capture is invalidated, as CUDA does);
 * "busy" makes every event report not-ready (earlier batches still running). */

static struct {
    int capturing, invalidated, busy, launches, instantiates, events_live;
    uintptr_t next;
} stub;

static CUresult s_ev_create(CUevent *e, unsigned fl) { (void)fl; *e = (CUevent)++stub.next; stub.events_live++; return CUDA_SUCCESS; }
static CUresult s_ev_destroy(CUevent e) { (void)e; stub.events_live--; return CUDA_SUCCESS; }
static CUresult s_ev_record(CUevent e, CUstream s) { (void)e; (void)s; return CUDA_SUCCESS; }
static CUresult s_ev_query(CUevent e) { (void)e; return stub.busy ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS; }
static CUresult s_ev_sync(CUevent e) { (void)e; stub.busy = 0; return CUDA_SUCCESS; }
static CUresult s_elapsed(float *ms, CUevent a, CUevent b) { (void)a; (void)b; *ms = 1; return CUDA_SUCCESS; }
static CUresult s_begin(CUstream s, CUstreamCaptureMode m) { (void)s; (void)m; stub.capturing = 1; stub.invalidated = 0; return CUDA_SUCCESS; }
static CUresult s_end(CUstream s, CUgraph *g)
{
    (void)s;
    stub.capturing = 0;
    *g = stub.invalidated ? NULL : (CUgraph)++stub.next;
    return stub.invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}
static CUresult s_nodes(CUgraph g, CUgraphNode *n, size_t *c) { (void)g; (void)n; *c = 3; return CUDA_SUCCESS; }
static CUresult s_meminfo(size_t *f, size_t *t) { *f = *t = (size_t)1 << 30; return CUDA_SUCCESS; }
static CUresult s_inst(CUgraphExec *e, CUgraph g, unsigned long long fl) { (void)g; (void)fl; stub.instantiates++; *e = (CUgraphExec)++stub.next; return CUDA_SUCCESS; }
static CUresult s_gdestroy(CUgraph g) { (void)g; return CUDA_SUCCESS; }
static CUresult s_upload(CUgraphExec e, CUstream s) { (void)e; (void)s; return CUDA_SUCCESS; }
static CUresult s_launch(CUgraphExec e, CUstream s) { (void)e; (void)s; stub.launches++; return CUDA_SUCCESS; }
static CUresult s_dtoh(void *d, CUdeviceptr p, size_t n) { if (!p) return CUDA_ERROR_INVALID_VALUE; memset(d, 0, n); return CUDA_SUCCESS; }
static CUresult s_ok_stream(CUstream s) { (void)s; return CUDA_SUCCESS; }
static CUresult s_name(CUresult r, const char **t) { (void)r; *t = "STUB"; return CUDA_SUCCESS; }
static CUresult s_free(CUdeviceptr p) { (void)p; return CUDA_SUCCESS; }

/* user: 0 an ordinary command; 1 cannot be captured; 2 always fails on its own. */
static kiln_status stub_enqueue(void *user, const kiln_launch_context *ctx)
{
    (void)ctx;
    uintptr_t kind = (uintptr_t)user;
    if (kind == 1 && stub.capturing) {
        stub.invalidated = 1;
        return kiln__fail(NULL, KILN_ERR_CUDA_DRIVER, "stub: not while capturing");
    }
    if (kind == 2)
        return kiln__fail(NULL, KILN_ERR_CUDA_OUT_OF_MEMORY, "stub: out of memory");
    return KILN_OK;
}

typedef struct stream_fixture {
    kiln_runtime *rt;
    kiln__driver d;
    kiln_command *A, *B, *X, *U, *F; /* replayable A, B; X no key; U uncapturable; F failing */
} stream_fixture;

static kiln_command *stub_cmd(kiln_runtime *rt, const char *key, uintptr_t kind)
{
    kiln_command *c;
    kiln_command_desc d = {.op_id = "test.op", .enqueue = stub_enqueue, .user = (void *)kind, .replay_key = key,
                           .replay_key_bytes = key ? strlen(key) : 0};
    KILN_CHECK(kiln_command_create(rt, &d, &c));
    return c;
}

static int stream_setup(void **state)
{
    stream_fixture *f = calloc(1, sizeof *f);
    memset(&stub, 0, sizeof stub);
    f->d.cuCtxGetCurrent = stub_ctx_get;
    f->d.cuEventCreate = s_ev_create;
    f->d.cuEventDestroy = s_ev_destroy;
    f->d.cuEventRecord = s_ev_record;
    f->d.cuEventQuery = s_ev_query;
    f->d.cuEventSynchronize = s_ev_sync;
    f->d.cuEventElapsedTime = s_elapsed;
    f->d.cuStreamBeginCapture = s_begin;
    f->d.cuStreamEndCapture = s_end;
    f->d.cuGraphGetNodes = s_nodes;
    f->d.cuMemGetInfo = s_meminfo;
    f->d.cuGraphInstantiateWithFlags = s_inst;
    f->d.cuGraphDestroy = s_gdestroy;
    f->d.cuGraphUpload = s_upload;
    f->d.cuGraphLaunch = s_launch;
    f->d.cuGraphExecDestroy = stub_exec_destroy;
    f->d.cuMemcpyDtoH = s_dtoh;
    f->d.cuStreamSynchronize = s_ok_stream;
    f->d.cuStreamDestroy = s_ok_stream;
    f->d.cuGetErrorName = s_name;
    f->d.cuGetErrorString = s_name;
    f->d.cuMemFree = s_free;
    f->rt = fake_runtime(7);
    f->rt->d = &f->d;
    f->rt->ctx = (CUcontext)0x1;
    f->A = stub_cmd(f->rt, "A", 0);
    f->B = stub_cmd(f->rt, "B", 0);
    f->X = stub_cmd(f->rt, NULL, 0);
    f->U = stub_cmd(f->rt, "U", 1);
    f->F = stub_cmd(f->rt, "F", 2);
    destroyed = 0;
    *state = f;
    return 0;
}

static int stream_teardown(void **state)
{
    stream_fixture *f = *state;
    kiln_command *all[] = {f->A, f->B, f->X, f->U, f->F};
    for (size_t i = 0; i < 5; i++)
        kiln_command_release(all[i]);
    fake_runtime_free(f->rt);
    free(f);
    return 0;
}

/* A stream built by hand: what stream.c needs, no CUDA. */
static kiln_stream *stub_stream(stream_fixture *f)
{
    kiln_stream *s = calloc(1, sizeof *s);
    assert_non_null(s);
    s->rt = f->rt;
    s->refs = 1;
    s->state = KILN_STREAM_READY;
    s->handle = (CUstream)0x2;
    s->fault = 0x1000;
    KILN_CHECK(kiln__graph_cache_create(f->rt, &s->graphs));
    return s;
}

static kiln_graph_stats stats_of(kiln_stream *s)
{
    kiln_graph_stats g;
    kiln_stream_graph_stats(s, &g);
    return g;
}

static void test_stream_repeated_segment_is_captured_once(void **state)
{
    stream_fixture *f = *state;
    kiln_stream *s = stub_stream(f);
    kiln_command *axa[3] = {f->A, f->X, f->A};
    KILN_CHECK(kiln_stream_submit(s, axa, 3, NULL, NULL));
    kiln_graph_stats g = stats_of(s);
    assert_int_equal(g.captured, 1);
    assert_int_equal(g.hits, 1); /* the second A launched the first's graph */
    assert_int_equal(stub.launches, 2);
    /* With room for one graph, [A X B X A] captures A and B once each. */
    KILN_CHECK(kiln_stream_synchronize(s));
    kiln_graph_options o = {.size = sizeof o, .max_graphs = 1};
    KILN_CHECK(kiln_stream_set_graph_options(s, &o));
    KILN_CHECK(kiln_stream_graph_trim(s, 0, 0));
    kiln_command *axbxa[5] = {f->A, f->X, f->B, f->X, f->A};
    KILN_CHECK(kiln_stream_submit(s, axbxa, 5, NULL, NULL));
    g = stats_of(s);
    assert_int_equal(g.captured, 3);
    assert_int_equal(g.resident, 2); /* over capacity until the next call */
    KILN_CHECK(kiln_stream_synchronize(s));
    kiln_stream_destroy(s);
    assert_int_equal(stub.events_live, 0);
}

static void test_stream_deferred_once_per_segment(void **state)
{
    stream_fixture *f = *state;
    kiln_stream *s = stub_stream(f);
    KILN_CHECK(kiln_stream_submit(s, &f->X, 1, NULL, NULL));
    stub.busy = 1; /* the first batch is still running */
    kiln_command *bxb[3] = {f->B, f->X, f->B};
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_submit(s, bxb, 3, NULL, &fence));
    kiln_graph_stats g = stats_of(s);
    assert_int_equal(g.deferred, 1);
    assert_int_equal(g.captured, 0);
    for (size_t i = 0; i < 3; i++) {
        kiln_attribution a;
        KILN_CHECK(kiln_fence_attribution(fence, i, &a));
        assert_int_equal(a.path, KILN_EXEC_EAGER);
    }
    stub.busy = 0;
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_fence_release(fence);
    KILN_CHECK(kiln_stream_submit(s, bxb, 3, NULL, NULL)); /* quiet: captured */
    g = stats_of(s);
    assert_int_equal(g.captured, 1);
    assert_int_equal(g.deferred, 1);
    KILN_CHECK(kiln_stream_synchronize(s));
    kiln_stream_destroy(s);
}

static void test_stream_rejected_capture(void **state)
{
    stream_fixture *f = *state;
    kiln_stream *s = stub_stream(f);
    kiln_command *bu[2] = {f->B, f->U};
    kiln_submit_options so = {.timing = KILN_TIMING_SPANS};
    for (int round = 0; round < 2; round++) {
        kiln_fence *fence;
        KILN_CHECK(kiln_stream_submit(s, bu, 2, &so, &fence));
        assert_string_equal(kiln_errmsg(), ""); /* the handled capture failure left no message */
        kiln_receipt r;
        KILN_CHECK(kiln_fence_receipt(fence, &r));
        /* Rejected while enqueueing: one eager span; known rejected: a span per command. */
        assert_int_equal(r.n_spans, round == 0 ? 1 : 2);
        for (size_t i = 0; i < 2; i++) {
            kiln_attribution a;
            KILN_CHECK(kiln_fence_attribution(fence, i, &a));
            assert_int_equal(a.path, KILN_EXEC_EAGER);
            assert_int_equal(a.span, round == 0 ? 0 : (int32_t)i);
        }
        kiln_fence_release(fence);
        kiln_graph_stats g = stats_of(s);
        assert_int_equal(g.rejected, 1);
        assert_int_equal(g.captured, 0);
    }
    /* A command that fails on its own is not a rejection: the batch fails with its error. */
    kiln_command *bf[2] = {f->B, f->F};
    KILN_EXPECT(kiln_stream_submit(s, bf, 2, NULL, NULL), KILN_ERR_CUDA_OUT_OF_MEMORY, kiln_errmsg(),
                "command 1 (test.op)", "stub: out of memory");
    assert_int_equal(stats_of(s).rejected, 1);
    assert_int_equal(kiln_stream_get_state(s), KILN_STREAM_FAILED);
    KILN_CHECK(kiln_stream_synchronize(s));
    kiln_stream_destroy(s);
}

static void test_stream_prepare_then_replayed_paths(void **state)
{
    stream_fixture *f = *state;
    kiln_stream *s = stub_stream(f);
    kiln_graph_options o = {.size = sizeof o, .max_graphs = 1};
    KILN_CHECK(kiln_stream_set_graph_options(s, &o));
    kiln_command *axb[3] = {f->A, f->X, f->B};
    uint32_t boundary = 1;
    kiln_submit_options eb = {.path = KILN_PATH_REPLAYED_WITH_EAGER_BOUNDARIES, .eager_boundaries = &boundary,
                              .n_eager_boundaries = 1};
    KILN_EXPECT(kiln_stream_submit(s, axb, 3, &eb, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "command 0 (test.op)", "not resident");
    size_t captured = 0;
    KILN_CHECK(kiln_stream_prepare(s, axb, 3, &eb, &captured));
    assert_int_equal(captured, 2);
    assert_int_equal(stub.launches, 0); /* nothing ran */
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_submit(s, axb, 3, &eb, &fence)); /* both still resident */
    assert_int_equal(stub.launches, 2);
    kiln_attribution a;
    KILN_CHECK(kiln_fence_attribution(fence, 1, &a));
    assert_int_equal(a.path, KILN_EXEC_EAGER);
    KILN_CHECK(kiln_fence_attribution(fence, 2, &a));
    assert_int_equal(a.path, KILN_EXEC_REPLAYED);
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_fence_release(fence);
    /* An uncapturable segment: prepare names it, the replayed paths refuse it. */
    kiln_command *u = f->U;
    kiln_submit_options ro = {.path = KILN_PATH_REPLAYED_ONLY};
    KILN_EXPECT(kiln_stream_prepare(s, &u, 1, &ro, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "graph capture of command 0 (test.op)", "stub: not while capturing");
    KILN_EXPECT(kiln_stream_submit(s, &u, 1, &ro, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "not resident",
                "rejected");
    KILN_CHECK(kiln_stream_synchronize(s));
    kiln_stream_destroy(s);
}

static void test_stream_fences_outlive_their_stream(void **state)
{
    stream_fixture *f = *state;
    kiln_stream *s = stub_stream(f);
    kiln_command *axa[3] = {f->A, f->X, f->A};
    kiln_fence *done, *running;
    KILN_CHECK(kiln_stream_submit(s, axa, 3, NULL, &done));
    kiln_fence_state fs;
    KILN_CHECK(kiln_fence_query(done, &fs));
    assert_int_equal(fs, KILN_FENCE_SUCCEEDED);
    stub.busy = 1;
    KILN_CHECK(kiln_stream_submit(s, axa, 3, NULL, &running));
    stub.busy = 0; /* the device finishes; destroy synchronizes */
    kiln_stream_destroy(s);
    KILN_CHECK(kiln_fence_wait(done));
    KILN_CHECK(kiln_fence_query(running, &fs));
    assert_int_equal(fs, KILN_FENCE_SUCCEEDED);
    KILN_CHECK(kiln_fence_wait(running));
    kiln_receipt r;
    KILN_CHECK(kiln_fence_receipt(running, &r));
    assert_int_equal(r.n_commands, 3);
    assert_int_equal(destroyed, 0); /* the graph lives while a fence holds it */
    kiln_fence_release(done);
    kiln_fence_release(running);
    assert_int_equal(destroyed, 1);
    assert_int_equal(stub.events_live, 0);
}

int main(void)
{
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(test_keys_and_lookup),          T(test_rejected_is_remembered),
        T(test_lru_by_count_and_bytes),   T(test_batches_keep_evicted_graphs),
        T(test_a_call_keeps_what_it_uses),
        T(test_module_epoch_drops_older_graphs), T(test_many_segments_grow_the_table),
        T(test_buckets),
        cmocka_unit_test_setup_teardown(test_stream_repeated_segment_is_captured_once, stream_setup, stream_teardown),
        cmocka_unit_test_setup_teardown(test_stream_deferred_once_per_segment, stream_setup, stream_teardown),
        cmocka_unit_test_setup_teardown(test_stream_rejected_capture, stream_setup, stream_teardown),
        cmocka_unit_test_setup_teardown(test_stream_prepare_then_replayed_paths, stream_setup, stream_teardown),
        cmocka_unit_test_setup_teardown(test_stream_fences_outlive_their_stream, stream_setup, stream_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
