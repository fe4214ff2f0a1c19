/* Submission overhead: the host time of submitting a batch of 64 tiny kernels
 * through kiln, beside the raw driver launching the same kernels on the same
 * stream, in the same run.
 *
 * The kernels: token_embedding of one token each (vocab 64, hidden 64, f16),
 * command i gathering row ids[i] into its own output row. kiln encodes 64
 * commands once (kiln_op_token_embedding_encode) and each iteration submits
 * them with kiln_stream_submit. The peer acquires the same CUfunction from the
 * same jit and calls cuLaunchKernel 64 times with the arguments the provider
 * passes. Only the submit call, or the 64 launches, are timed (CLOCK_MONOTONIC);
 * the stream is synchronized outside the timed region after each iteration.
 * The raw launches and the two cheap kiln variants are interleaved, rotating
 * their order every iteration, so that drift hits them alike.
 *
 * Lines (see bench/README.md for the conventions):
 *   raw_launch    peer "driver": 64 x cuLaunchKernel;
 *   kiln_submit   timing off, eager-only path: the target line,
 *                 ratio_to_raw <= 1.3 (meets_target);
 *   kiln_submit   timing spans (an event pair per command): informational;
 *   kiln_submit   replayed-only: one launch of the resident graph (the stream's
 *                 graph cache; see bench_graph for replay in depth): informational;
 *   verify        the outputs of the raw, eager and replayed paths checked
 *                 against the table once, before timing.
 * Times: ns per command (batch time / 64): median, p10, p90, min; and the
 * median µs per batch.
 *
 * Usage: bench_submit [--iters 2000] [--warmup 100] [--replay-iters N] [--db-dir DIR]
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench_common.h"
#include "bench_cuda.h"
#include "kiln/kiln.h"
#include "runtime/internal.h"

#define BENCH "submit"
#define N_CMDS 64
#define VOCAB 64
#define HIDDEN 64
#define VEC 8
#define ROW_BYTES ((size_t)HIDDEN * 2)
#define TABLE_BYTES ((size_t)VOCAB * ROW_BYTES)
#define OUT_BYTES ((size_t)N_CMDS * ROW_BYTES)
#define IDS_BYTES ((size_t)N_CMDS * 4)
#define TARGET_RATIO 1.3

static const kiln__driver *g_d;
static bench_tempdb g_db;

/* Prints an error line and exits 1. */
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

/* The same launches the provider's enqueue makes, straight to the driver. */
typedef struct raw_peer {
    CUfunction fn;
    CUstream stream;
    unsigned threads;
    CUdeviceptr table, ids, out, fault;
} raw_peer;

/* Launches the 64 kernels; returns the first failure (checked after timing). */
static CUresult raw_launch_all(const raw_peer *p)
{
    CUresult first = CUDA_SUCCESS;
    for (unsigned i = 0; i < N_CMDS; i++) {
        CUdeviceptr table = p->table, ids = p->ids + 4u * i, out = p->out + ROW_BYTES * i, fault = p->fault;
        unsigned token_base = 0;
        void *args[] = {&table, &ids, &out, &token_base, &fault};
        CUresult r = g_d->cuLaunchKernel(p->fn, 1, 1, 1, p->threads, 1, 1, 0, p->stream, args, NULL);
        if (r != CUDA_SUCCESS && first == CUDA_SUCCESS)
            first = r;
    }
    return first;
}

typedef enum mode { MODE_RAW, MODE_KILN_OFF, MODE_KILN_SPANS, MODE_KILN_REPLAYED, N_MODES } mode;

typedef struct setup {
    kiln_runtime *rt;
    kiln_stream *s;
    kiln_command *cmds[N_CMDS];
    raw_peer raw;
    kiln_submit_options opts[N_MODES];
} setup;

/* One batch in the given mode: returns the host ns of the submission alone,
 * then synchronizes (untimed). */
static double run_once(setup *su, mode m)
{
    double t0, t1;
    if (m == MODE_RAW) {
        t0 = bench_now_ns();
        CUresult r = raw_launch_all(&su->raw);
        t1 = bench_now_ns();
        cu_check(r, "cuLaunchKernel");
        cu_check(g_d->cuStreamSynchronize(su->raw.stream), "cuStreamSynchronize");
    } else {
        t0 = bench_now_ns();
        kiln_status st = kiln_stream_submit(su->s, su->cmds, N_CMDS, &su->opts[m], NULL);
        t1 = bench_now_ns();
        if (st)
            fail("kiln_stream_submit", st, NULL);
        if ((st = kiln_stream_synchronize(su->s)))
            fail("kiln_stream_synchronize", st, NULL);
    }
    return t1 - t0;
}

/* Zeroes the outputs, runs one batch in mode m, and checks every output row
 * against its table row. */
static int verify(setup *su, mode m, kiln_buffer *out_buf, const uint16_t *table, const uint32_t *ids)
{
    kiln_status st;
    if ((st = kiln_buffer_fill(out_buf, 0, 0, OUT_BYTES)) || (st = kiln_runtime_synchronize(su->rt)))
        fail("verify", st, NULL);
    run_once(su, m);
    uint16_t *got = malloc(OUT_BYTES);
    if (!got)
        fail("verify", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    if ((st = kiln_buffer_readback(out_buf, 0, got, OUT_BYTES)))
        fail("verify", st, NULL);
    int ok = 1;
    for (size_t i = 0; i < N_CMDS && ok; i++)
        ok = memcmp(got + i * HIDDEN, table + (size_t)ids[i] * HIDDEN, ROW_BYTES) == 0;
    free(got);
    return ok;
}

static const char *const mode_names[N_MODES] = {"raw", "kiln_eager", "kiln_spans", "kiln_replayed"};

/* One timing line; sorts v (ns per batch). raw_median_ns <= 0: the raw line. */
static void print_line(mode m, double *v, size_t n, long warmup, double raw_median_ns, const char *arch)
{
    static const char *const what[N_MODES] = {
        "64 x cuLaunchKernel of the kiln-compiled kernel on the stream (the arguments the provider passes)",
        "kiln_stream_submit of 64 encoded commands, eager-only path, timing off, no fence",
        "kiln_stream_submit of 64 encoded commands, eager-only, timing spans (an event pair per command), no fence",
        ("kiln_stream_submit of 64 encoded commands, replayed-only: one launch of the resident graph from the "
         "stream's graph cache (made resident once by kiln_stream_prepare)")};
    bench_sort(v, n);
    double med = bench_quantile(v, n, 0.5);
    bench_json j;
    bench_json_begin(&j, BENCH);
    if (m == MODE_RAW)
        bench_json_str(&j, "peer", "driver");
    else
        bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "phase", m == MODE_RAW ? "raw_launch" : "kiln_submit");
    if (m != MODE_RAW) {
        bench_json_str(&j, "path", m == MODE_KILN_REPLAYED ? "replayed_only" : "eager_only");
        bench_json_str(&j, "timing", m == MODE_KILN_SPANS ? "spans" : "off");
    }
    bench_json_int(&j, "commands", N_CMDS);
    bench_json_int(&j, "iters", (long long)n);
    bench_json_int(&j, "warmup", warmup);
    bench_json_num(&j, "median_ns_per_command", med / N_CMDS);
    bench_json_num(&j, "p10_ns_per_command", bench_quantile(v, n, 0.1) / N_CMDS);
    bench_json_num(&j, "p90_ns_per_command", bench_quantile(v, n, 0.9) / N_CMDS);
    bench_json_num(&j, "min_ns_per_command", v[0] / N_CMDS);
    bench_json_num(&j, "median_us_per_batch", med / 1e3);
    if (m != MODE_RAW) {
        double ratio = med / raw_median_ns;
        bench_json_num(&j, "ratio_to_raw", ratio);
        if (m == MODE_KILN_OFF) {
            bench_json_num(&j, "target_ratio", TARGET_RATIO);
            bench_json_bool(&j, "meets_target", ratio <= TARGET_RATIO);
        } else {
            bench_json_bool(&j, "informational", 1);
        }
    }
    bench_json_int(&j, "vocab", VOCAB);
    bench_json_int(&j, "hidden", HIDDEN);
    bench_json_int(&j, "tokens_per_command", 1);
    bench_json_str(&j, "arch", arch);
    bench_json_str(&j, "what", what[m]);
    bench_json_end(&j);
}

static void usage(const char *argv0)
{
    fprintf(stderr, "usage: %s [--iters N] [--warmup N] [--replay-iters N] [--db-dir DIR]\n", argv0);
    exit(2);
}

int main(int argc, char **argv)
{
    long iters = 2000, warmup = 100, replay_iters = 0;
    const char *db_parent = getenv("TMPDIR");
    if (!db_parent || !*db_parent)
        db_parent = "/tmp";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
            if ((iters = bench_parse_positive(argv[++i])) < 1 || iters > 1000000)
                usage(argv[0]);
        } else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) {
            if ((warmup = bench_parse_positive(argv[++i])) < 1)
                usage(argv[0]);
        } else if (!strcmp(argv[i], "--replay-iters") && i + 1 < argc) {
            if ((replay_iters = bench_parse_positive(argv[++i])) < 1 || replay_iters > 1000000)
                usage(argv[0]);
        } else if (!strcmp(argv[i], "--db-dir") && i + 1 < argc) {
            db_parent = argv[++i];
        } else {
            usage(argv[0]);
        }
    }
    if (!replay_iters)
        replay_iters = iters;

    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        bench_skip_no_driver(BENCH, why);
        return 0;
    }
    kiln_status st;
    setup su = {0};
    kiln_runtime_options ro = {.size = sizeof ro, .device_ordinal = 0};
    if ((st = kiln_runtime_create(&ro, &su.rt))) {
        if (st == KILN_ERR_NO_DEVICE) {
            bench_skip_no_driver(BENCH, kiln_errmsg());
            return 0;
        }
        fail("setup", st, NULL);
    }
    kiln_runtime_info info;
    kiln_runtime_get_info(su.rt, &info);
    g_d = kiln__driver_get(NULL);

    /* A jit on a temporary cache database. */
    char why_not[4400];
    if (bench_tempdb_make(&g_db, db_parent, "submit", why_not, sizeof why_not))
        fail("setup", KILN_OK, why_not);
    kiln_cache *cache = NULL;
    kiln_cache_options co = {.size = sizeof co, .path = g_db.path};
    if ((st = kiln_cache_open(&co, &cache)))
        fail("setup", st, NULL);
    kiln_jit *jit = NULL;
    kiln_jit_options jo = {.size = sizeof jo, .cache = cache, .runtime = su.rt};
    if ((st = kiln_jit_create(&jo, &jit)))
        fail("setup", st, NULL);

    /* The table (distinct finite f16 values), a permutation of ids, the outputs. */
    static uint16_t table_host[VOCAB * HIDDEN];
    static uint32_t ids_host[N_CMDS];
    for (size_t i = 0; i < (size_t)VOCAB * HIDDEN; i++)
        table_host[i] = (uint16_t)(0x2000 + i);
    for (uint32_t i = 0; i < N_CMDS; i++)
        ids_host[i] = (i * 37u + 11u) % VOCAB;
    kiln_buffer *table_buf = NULL, *ids_buf = NULL, *out_buf = NULL;
    kiln_buffer_desc td = {.size = sizeof td, .bytes = TABLE_BYTES, .dtype = KILN_DTYPE_F16,
                           .usage = KILN_USAGE_WEIGHTS};
    kiln_buffer_desc id = {.size = sizeof id, .bytes = IDS_BYTES, .dtype = KILN_DTYPE_U32,
                           .usage = KILN_USAGE_ACTIVATIONS};
    kiln_buffer_desc od = {.size = sizeof od, .bytes = OUT_BYTES, .dtype = KILN_DTYPE_F16,
                           .usage = KILN_USAGE_ACTIVATIONS};
    if ((st = kiln_buffer_create_ex(su.rt, &td, &table_buf)) || (st = kiln_buffer_create_ex(su.rt, &id, &ids_buf)) ||
        (st = kiln_buffer_create_ex(su.rt, &od, &out_buf)) ||
        (st = kiln_buffer_upload(table_buf, 0, table_host, TABLE_BYTES)) ||
        (st = kiln_buffer_upload(ids_buf, 0, ids_host, IDS_BYTES)))
        fail("setup", st, NULL);

    /* 64 commands, each its own id and output row. */
    if ((st = kiln_stream_create(su.rt, &su.s)))
        fail("setup", st, NULL);
    kiln_tensor table = {.buffer = table_buf, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {VOCAB, HIDDEN}};
    for (size_t i = 0; i < N_CMDS; i++) {
        kiln_tensor ids = {.buffer = ids_buf, .offset = 4 * i, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {1}};
        kiln_tensor out = {.buffer = out_buf, .offset = ROW_BYTES * i, .dtype = KILN_DTYPE_F16, .rank = 2,
                           .dims = {1, HIDDEN}};
        if ((st = kiln_op_token_embedding_encode(jit, &table, &ids, &out, &su.cmds[i])))
            fail("encode", st, NULL);
    }

    /* The raw peer: the same kernel, from the jit's memory table (no compile). */
    kiln_spec spec;
    kiln_kernel *kernel = NULL;
    void *fn = NULL;
    kiln_jit_counters c0, c1;
    kiln_jit_get_counters(jit, &c0);
    if ((st = kiln_op_token_embedding_spec(KILN_DTYPE_F16, VOCAB, HIDDEN, VEC, &spec)) || (st = kiln_jit_acquire(jit, &spec, &kernel)) ||
        (st = kiln_kernel_function(kernel, NULL, &fn)))
        fail("setup", st, NULL);
    kiln_jit_get_counters(jit, &c1);
    if (c1.compiles != c0.compiles || c1.memory_hits != c0.memory_hits + 1)
        fail("setup", KILN_OK, "the raw peer's spec is not the kernel the commands use (it was not a memory hit)");
    long long threads = 0;
    for (uint32_t i = 0; i < spec.n_constants; i++)
        if (!strcmp(spec.constants[i].name, "THREADS"))
            threads = spec.constants[i].value;
    if (threads < 1 || threads > 1024)
        fail("setup", KILN_OK, "the spec has no THREADS constant");
    su.raw = (raw_peer){.fn = (CUfunction)fn,
                        .stream = (CUstream)kiln_stream_handle(su.s),
                        .threads = (unsigned)threads,
                        .table = (CUdeviceptr)kiln_buffer_device_address(table_buf),
                        .ids = (CUdeviceptr)kiln_buffer_device_address(ids_buf),
                        .out = (CUdeviceptr)kiln_buffer_device_address(out_buf),
                        .fault = su.s->fault};
    su.opts[MODE_KILN_OFF] = (kiln_submit_options){.size = sizeof(kiln_submit_options), .path = KILN_PATH_EAGER_ONLY,
                                                   .timing = KILN_TIMING_OFF};
    su.opts[MODE_KILN_SPANS] = su.opts[MODE_KILN_OFF];
    su.opts[MODE_KILN_SPANS].timing = KILN_TIMING_SPANS;
    su.opts[MODE_KILN_REPLAYED] = su.opts[MODE_KILN_OFF];
    su.opts[MODE_KILN_REPLAYED].path = KILN_PATH_REPLAYED_ONLY;
    if ((st = kiln__runtime_enter(su.rt)))
        fail("setup", st, NULL);
    if ((st = kiln_stream_prepare(su.s, su.cmds, N_CMDS, &su.opts[MODE_KILN_REPLAYED], NULL)))
        fail("kiln_stream_prepare", st, NULL);

    /* Correctness once, every path, before timing anything. */
    int ok[N_MODES];
    int all_ok = 1;
    for (int m = 0; m < N_MODES; m++) {
        ok[m] = verify(&su, (mode)m, out_buf, table_host, ids_host);
        all_ok &= ok[m];
    }
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "phase", "verify");
    for (int m = 0; m < N_MODES; m++)
        bench_json_bool(&j, mode_names[m], ok[m]);
    bench_json_bool(&j, "ok", all_ok);
    bench_json_str(&j, "what", "every output row equals the table row of its id, after one batch of each path");
    bench_json_end(&j);
    if (!all_ok)
        fail("verify", KILN_OK, "an output row differs from its table row");

    /* Raw, eager and spans interleaved, the order rotating each iteration. */
    double *t[N_MODES];
    for (int m = 0; m < N_MODES; m++)
        if (!(t[m] = calloc((size_t)(m == MODE_KILN_REPLAYED ? replay_iters : iters), sizeof(double))))
            fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (long i = 0; i < warmup + iters; i++) {
        for (int k = 0; k < 3; k++) {
            mode m = (mode)((i + k) % 3);
            double ns = run_once(&su, m);
            if (i >= warmup)
                t[m][i - warmup] = ns;
        }
    }
    /* Replayed alone, as before the graph cache (when it instantiated per submission). */
    for (long i = 0; i < warmup + replay_iters; i++) {
        double ns = run_once(&su, MODE_KILN_REPLAYED);
        if (i >= warmup)
            t[MODE_KILN_REPLAYED][i - warmup] = ns;
    }

    print_line(MODE_RAW, t[MODE_RAW], (size_t)iters, warmup, 0, info.arch);
    double raw_median = bench_quantile(t[MODE_RAW], (size_t)iters, 0.5);
    print_line(MODE_KILN_OFF, t[MODE_KILN_OFF], (size_t)iters, warmup, raw_median, info.arch);
    print_line(MODE_KILN_SPANS, t[MODE_KILN_SPANS], (size_t)iters, warmup, raw_median, info.arch);
    print_line(MODE_KILN_REPLAYED, t[MODE_KILN_REPLAYED], (size_t)replay_iters, warmup, raw_median, info.arch);

    for (int m = 0; m < N_MODES; m++)
        free(t[m]);
    for (size_t i = 0; i < N_CMDS; i++)
        kiln_command_release(su.cmds[i]);
    kiln_stream_destroy(su.s);
    kiln_buffer_destroy(table_buf);
    kiln_buffer_destroy(ids_buf);
    kiln_buffer_destroy(out_buf);
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
    kiln_runtime_destroy(su.rt);
    bench_tempdb_remove(&g_db);
    return 0;
}
