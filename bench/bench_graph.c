/* Graph replay: a 64-kernel decode-like segment, eager and replayed
 * through the stream's graph cache, beside the raw driver launching the same
 * kernels and a graph of them, in the same run (torch.cuda.CUDAGraph
 * replaying 64 small ops is bench/peer_torch_graph.py).
 *
 * The segment: a "flag" command that copies the step counter from the binding
 * arena into pinned, mapped host memory, then 64 token_embedding kernels of
 * one token each (vocab 64, hidden 64, f16), command i gathering row ids[i].
 * Each step patches the counter in the arena (one coalesced upload) and
 * submits the 65 commands.
 *
 * Lines:
 *   per_kernel   mode eager | replayed | raw_launch | raw_graph:
 *                host_ns_per_kernel: the submit (or launch) call alone, median;
 *                step_us: submit + synchronize, median (the GPU idle before);
 *                b2b_ns_per_kernel: 200 steps back to back, then one
 *                synchronize: wall time / (200 * 64), median of 5 runs.
 *                The target: replayed b2b_ns_per_kernel <= 1000.
 *   submit_to_busy  mode replayed | raw_graph | eager: time from the call
 *                that submits a step (the GPU idle) until the host sees the
 *                step's counter in the mapped flag, i.e. the GPU running the
 *                segment's first node; median and p90 over 2000 steps. The
 *                peer torch line comes from peer_torch_graph.py.
 *   verify       the replayed and eager outputs equal the table rows.
 *
 * Usage: bench_graph [--steps 2000] [--db-dir DIR]
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench_common.h"
#include "bench_cuda.h"
#include "kiln/kiln.h"
#include "runtime/internal.h"

#define BENCH "graph"
#define N_KERNELS 64
#define VOCAB 64
#define HIDDEN 64
#define ROW_BYTES ((size_t)HIDDEN * 2)
#define B2B_STEPS 200
#define B2B_RUNS 5
#define TARGET_NS_PER_KERNEL 1000.0

static const kiln__driver *g_d;
static bench_tempdb g_db;

static void fail(const char *phase, kiln_status st, const char *detail)
{
    bench_json_error(BENCH, phase, st ? kiln_status_code(st) : "bench", detail, kiln_errmsg());
    bench_tempdb_remove(&g_db);
    exit(1);
}

static void cu_check(CUresult r, const char *what)
{
    if (r == CUDA_SUCCESS)
        return;
    char msg[512];
    bench_cu_message(g_d, r, what, msg, sizeof msg);
    fail(what, KILN_ERR_CUDA_DRIVER, msg);
}

static void check(kiln_status st, const char *what)
{
    if (st)
        fail(what, st, NULL);
}

/* ---- the flag command: arena counter -> mapped host memory ---- */

typedef struct flag_cmd {
    CUdeviceptr src, dst;
} flag_cmd;

static kiln_status enqueue_flag(void *user, const kiln_launch_context *ctx)
{
    const flag_cmd *fc = user;
    CUresult r = g_d->cuMemcpyAsync(fc->dst, fc->src, 4, (CUstream)kiln_launch_stream(ctx));
    return r == CUDA_SUCCESS ? KILN_OK : KILN_ERR_CUDA_DRIVER;
}

/* ---- the setup ---- */

typedef struct setup {
    kiln_runtime *rt;
    kiln_stream *s;
    CUstream stream;
    kiln_binding_arena *arena;
    kiln_command *cmds[N_KERNELS + 1];
    flag_cmd flag;
    volatile uint32_t *host_flag;
    CUdeviceptr dev_flag, counter, table, ids, out;
    CUfunction fn;
    unsigned threads;
    CUgraphExec raw_exec;
    uint32_t step;
} setup;

static void raw_launches(setup *su)
{
    CUresult first = g_d->cuMemcpyAsync(su->dev_flag, su->counter, 4, su->stream);
    for (unsigned i = 0; i < N_KERNELS; i++) {
        CUdeviceptr table = su->table, ids = su->ids + 4u * i, out = su->out + ROW_BYTES * i, fault = su->s->fault;
        unsigned token_base = 0;
        void *args[] = {&table, &ids, &out, &token_base, &fault};
        CUresult r = g_d->cuLaunchKernel(su->fn, 1, 1, 1, su->threads, 1, 1, 0, su->stream, args, NULL);
        if (r != CUDA_SUCCESS && first == CUDA_SUCCESS)
            first = r;
    }
    cu_check(first, "cuLaunchKernel");
}

typedef enum mode { M_EAGER, M_REPLAYED, M_RAW_LAUNCH, M_RAW_GRAPH, N_MODES } mode;
static const char *const mode_names[N_MODES] = {"eager", "replayed", "raw_launch", "raw_graph"};

/* Submits one step in mode m (the counter patched to su->step); returns the host ns of the call. */
static double submit_step(setup *su, mode m)
{
    su->step++;
    double t0, t1;
    if (m == M_EAGER || m == M_REPLAYED) {
        kiln_binding_patch p = {0, 0, &su->step, 4};
        kiln_submit_options o = {.path = m == M_EAGER ? KILN_PATH_EAGER_ONLY : KILN_PATH_REPLAYED_ONLY,
                                 .arena = su->arena, .patches = &p, .n_patches = 1};
        t0 = bench_now_ns();
        kiln_status st = kiln_stream_submit(su->s, su->cmds, N_KERNELS + 1, &o, NULL);
        t1 = bench_now_ns();
        check(st, "kiln_stream_submit");
    } else {
        /* The same upload kiln's arena makes (from pageable memory), then the work. */
        t0 = bench_now_ns();
        CUresult r = g_d->cuMemcpyHtoDAsync(su->counter, &su->step, 4, su->stream);
        if (m == M_RAW_GRAPH)
            r = r ? r : g_d->cuGraphLaunch(su->raw_exec, su->stream);
        else
            raw_launches(su);
        t1 = bench_now_ns();
        cu_check(r, "raw step");
    }
    return t1 - t0;
}

static void sync_all(setup *su)
{
    check(kiln_stream_synchronize(su->s), "kiln_stream_synchronize");
    cu_check(g_d->cuStreamSynchronize(su->stream), "cuStreamSynchronize");
}

static int verify(setup *su, mode m, const uint16_t *table, const uint32_t *ids)
{
    cu_check(g_d->cuMemsetD8Async(su->out, 0, N_KERNELS * ROW_BYTES, su->stream), "memset");
    cu_check(g_d->cuStreamSynchronize(su->stream), "sync");
    submit_step(su, m);
    sync_all(su);
    static uint16_t got[N_KERNELS * HIDDEN];
    cu_check(g_d->cuMemcpyDtoH(got, su->out, sizeof got), "readback");
    int ok = *su->host_flag == su->step;
    for (size_t i = 0; i < N_KERNELS && ok; i++)
        ok = memcmp(got + i * HIDDEN, table + (size_t)ids[i] * HIDDEN, ROW_BYTES) == 0;
    return ok;
}

static void usage(const char *argv0)
{
    fprintf(stderr, "usage: %s [--steps N] [--db-dir DIR]\n", argv0);
    exit(2);
}

int main(int argc, char **argv)
{
    long steps = 2000;
    const char *db_parent = getenv("TMPDIR");
    if (!db_parent || !*db_parent)
        db_parent = "/tmp";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
            if ((steps = bench_parse_positive(argv[++i])) < 10 || steps > 1000000)
                usage(argv[0]);
        } else if (!strcmp(argv[i], "--db-dir") && i + 1 < argc) {
            db_parent = argv[++i];
        } else {
            usage(argv[0]);
        }
    }
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        bench_skip_no_driver(BENCH, why);
        return 0;
    }
    setup su = {0};
    check(kiln_runtime_create(NULL, &su.rt), "kiln_runtime_create");
    kiln_runtime_info info;
    kiln_runtime_get_info(su.rt, &info);
    g_d = kiln__driver_get(NULL);
    char why_not[4400];
    if (bench_tempdb_make(&g_db, db_parent, "graph", why_not, sizeof why_not))
        fail("setup", KILN_OK, why_not);
    kiln_cache *cache = NULL;
    kiln_cache_options co = {.size = sizeof co, .path = g_db.path};
    check(kiln_cache_open(&co, &cache), "kiln_cache_open");
    kiln_jit *jit = NULL;
    kiln_jit_options jo = {.size = sizeof jo, .cache = cache, .runtime = su.rt};
    check(kiln_jit_create(&jo, &jit), "kiln_jit_create");
    check(kiln_stream_create(su.rt, &su.s), "kiln_stream_create");
    check(kiln__runtime_enter(su.rt), "enter");
    su.stream = (CUstream)kiln_stream_handle(su.s);

    static uint16_t table_host[VOCAB * HIDDEN];
    static uint32_t ids_host[N_KERNELS];
    for (size_t i = 0; i < (size_t)VOCAB * HIDDEN; i++)
        table_host[i] = (uint16_t)(0x2000 + i);
    for (uint32_t i = 0; i < N_KERNELS; i++)
        ids_host[i] = (i * 37u + 11u) % VOCAB;
    kiln_buffer *tb, *ib, *ob;
    check(kiln_buffer_create(su.rt, sizeof table_host, 256, &tb), "buffer");
    check(kiln_buffer_create(su.rt, sizeof ids_host, 256, &ib), "buffer");
    check(kiln_buffer_create(su.rt, N_KERNELS * ROW_BYTES, 256, &ob), "buffer");
    check(kiln_buffer_upload(tb, 0, table_host, sizeof table_host), "upload");
    check(kiln_buffer_upload(ib, 0, ids_host, sizeof ids_host), "upload");
    su.table = (CUdeviceptr)kiln_buffer_device_address(tb);
    su.ids = (CUdeviceptr)kiln_buffer_device_address(ib);
    su.out = (CUdeviceptr)kiln_buffer_device_address(ob);

    /* The arena (the step counter) and the mapped flag. */
    kiln_binding_slot slot = {0, 256};
    check(kiln_binding_arena_create(su.rt, &slot, 1, 256, &su.arena), "arena");
    void *hp = NULL;
    cu_check(g_d->cuMemHostAlloc(&hp, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
    su.host_flag = hp;
    *su.host_flag = 0;
    cu_check(g_d->cuMemHostGetDevicePointer(&su.dev_flag, hp, 0), "cuMemHostGetDevicePointer");
    kiln_region counter;
    check(kiln_binding_arena_slot(su.arena, 0, &counter), "slot");
    su.counter = (CUdeviceptr)kiln_buffer_device_address(counter.buffer) + counter.start;
    su.flag = (flag_cmd){su.counter, su.dev_flag};
    struct {
        char tag[16];
        uint64_t src, dst;
    } key = {"bench.flag", su.counter, su.dev_flag};
    counter.end = counter.start + 4;
    kiln_command_desc fd = {.op_id = "bench.flag", .transfers = 1, .regions = &counter, .n_regions = 1,
                            .enqueue = enqueue_flag, .user = &su.flag, .replay_key = &key,
                            .replay_key_bytes = sizeof key};
    check(kiln_command_create(su.rt, &fd, &su.cmds[0]), "flag command");
    kiln_tensor table = {.buffer = tb, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {VOCAB, HIDDEN}};
    for (size_t i = 0; i < N_KERNELS; i++) {
        kiln_tensor ids = {.buffer = ib, .offset = 4 * i, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {1}};
        kiln_tensor out = {.buffer = ob, .offset = ROW_BYTES * i, .dtype = KILN_DTYPE_F16, .rank = 2,
                           .dims = {1, HIDDEN}};
        check(kiln_op_token_embedding_encode(jit, &table, &ids, &out, &su.cmds[i + 1]), "encode");
    }

    /* The raw peer: the same function (a memory hit in the jit). */
    kiln_spec spec;
    kiln_kernel *kernel;
    void *fn;
    check(kiln_op_token_embedding_spec(KILN_DTYPE_F16, VOCAB, HIDDEN, 8, &spec), "spec");
    check(kiln_jit_acquire(jit, &spec, &kernel), "acquire");
    check(kiln_kernel_function(kernel, NULL, &fn), "function");
    su.fn = (CUfunction)fn;
    for (uint32_t i = 0; i < spec.n_constants; i++)
        if (!strcmp(spec.constants[i].name, "THREADS"))
            su.threads = (unsigned)spec.constants[i].value;
    if (!su.threads)
        fail("setup", KILN_OK, "the spec has no THREADS constant");
    CUgraph graph;
    cu_check(g_d->cuStreamBeginCapture(su.stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "capture");
    raw_launches(&su);
    cu_check(g_d->cuStreamEndCapture(su.stream, &graph), "capture");
    cu_check(g_d->cuGraphInstantiateWithFlags(&su.raw_exec, graph, 0), "instantiate");
    cu_check(g_d->cuGraphUpload(su.raw_exec, su.stream), "upload");
    g_d->cuGraphDestroy(graph);

    /* kiln's graph: made resident once. */
    kiln_submit_options ro = {.path = KILN_PATH_REPLAYED_ONLY};
    double p0 = bench_now_ns();
    check(kiln_stream_prepare(su.s, su.cmds, N_KERNELS + 1, &ro, NULL), "kiln_stream_prepare");
    double prepare_us = (bench_now_ns() - p0) / 1e3;

    int ok[N_MODES], all = 1;
    for (int m = 0; m < N_MODES; m++)
        all &= ok[m] = verify(&su, (mode)m, table_host, ids_host);
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "phase", "verify");
    for (int m = 0; m < N_MODES; m++)
        bench_json_bool(&j, mode_names[m], ok[m]);
    bench_json_bool(&j, "ok", all);
    bench_json_num(&j, "prepare_us", prepare_us);
    bench_json_end(&j);
    if (!all)
        fail("verify", KILN_OK, "an output row or the flag differs");

    double *host = calloc((size_t)steps, sizeof *host), *step_us = calloc((size_t)steps, sizeof *step_us),
           *lat = calloc((size_t)steps, sizeof *lat);
    if (!host || !step_us || !lat)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (int m = 0; m < N_MODES; m++) {
        /* Host cost and the latency to "GPU busy", one step at a time, the GPU idle before each. */
        for (long i = 0; i < steps + 50; i++) {
            double t0 = bench_now_ns();
            double h = submit_step(&su, (mode)m);
            double t1;
            while (*su.host_flag != su.step)
                if ((t1 = bench_now_ns()) - t0 > 5e9)
                    fail("submit_to_busy", KILN_OK, "the flag did not arrive within 5 s");
            t1 = bench_now_ns();
            sync_all(&su);
            double t2 = bench_now_ns();
            if (i >= 50) {
                host[i - 50] = h;
                lat[i - 50] = t1 - t0;
                step_us[i - 50] = (t2 - t0) / 1e3;
            }
        }
        /* Back to back: the GPU's own pace. */
        double b2b[B2B_RUNS];
        for (int r = 0; r < B2B_RUNS; r++) {
            double t0 = bench_now_ns();
            for (int i = 0; i < B2B_STEPS; i++)
                submit_step(&su, (mode)m);
            sync_all(&su);
            b2b[r] = (bench_now_ns() - t0) / (B2B_STEPS * N_KERNELS);
        }
        bench_sort(host, (size_t)steps);
        bench_sort(lat, (size_t)steps);
        bench_sort(step_us, (size_t)steps);
        bench_sort(b2b, B2B_RUNS);
        double b2b_med = bench_quantile(b2b, B2B_RUNS, 0.5);
        bench_json_begin(&j, BENCH);
        if (m >= M_RAW_LAUNCH)
            bench_json_str(&j, "peer", "driver");
        else
            bench_json_bool(&j, "peer", 0);
        bench_json_str(&j, "phase", "per_kernel");
        bench_json_str(&j, "mode", mode_names[m]);
        bench_json_int(&j, "kernels", N_KERNELS);
        bench_json_int(&j, "steps", steps);
        bench_json_num(&j, "host_ns_per_kernel", bench_quantile(host, (size_t)steps, 0.5) / N_KERNELS);
        bench_json_num(&j, "host_us_per_step", bench_quantile(host, (size_t)steps, 0.5) / 1e3);
        bench_json_num(&j, "step_us", bench_quantile(step_us, (size_t)steps, 0.5));
        bench_json_num(&j, "b2b_ns_per_kernel", b2b_med);
        if (m == M_REPLAYED) {
            bench_json_num(&j, "target_ns_per_kernel", TARGET_NS_PER_KERNEL);
            bench_json_bool(&j, "meets_target", b2b_med <= TARGET_NS_PER_KERNEL);
        }
        bench_json_str(&j, "arch", info.arch);
        bench_json_end(&j);
        bench_json_begin(&j, BENCH);
        if (m >= M_RAW_LAUNCH)
            bench_json_str(&j, "peer", "driver");
        else
            bench_json_bool(&j, "peer", 0);
        bench_json_str(&j, "phase", "submit_to_busy");
        bench_json_str(&j, "mode", mode_names[m]);
        bench_json_num(&j, "median_us", bench_quantile(lat, (size_t)steps, 0.5) / 1e3);
        bench_json_num(&j, "p10_us", bench_quantile(lat, (size_t)steps, 0.1) / 1e3);
        bench_json_num(&j, "p90_us", bench_quantile(lat, (size_t)steps, 0.9) / 1e3);
        bench_json_str(&j, "what",
                       "from the submit call (GPU idle) until the host sees the step counter the segment's first "
                       "node copies into mapped host memory");
        bench_json_end(&j);
    }
    kiln_graph_stats g;
    kiln_stream_graph_stats(su.s, &g);
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "phase", "stats");
    bench_json_int(&j, "captured", (long long)g.captured);
    bench_json_int(&j, "hits", (long long)g.hits);
    bench_json_int(&j, "rejected", (long long)g.rejected);
    bench_json_int(&j, "deferred", (long long)g.deferred);
    bench_json_int(&j, "evicted", (long long)g.evicted);
    bench_json_int(&j, "resident_bytes", (long long)g.resident_bytes);
    bench_json_end(&j);

    free(host);
    free(step_us);
    free(lat);
    g_d->cuGraphExecDestroy(su.raw_exec);
    for (size_t i = 0; i <= N_KERNELS; i++)
        kiln_command_release(su.cmds[i]);
    kiln_stream_destroy(su.s);
    kiln_binding_arena_destroy(su.arena);
    g_d->cuMemFreeHost(hp);
    kiln_buffer_destroy(tb);
    kiln_buffer_destroy(ib);
    kiln_buffer_destroy(ob);
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
    kiln_runtime_destroy(su.rt);
    bench_tempdb_remove(&g_db);
    return 0;
}
