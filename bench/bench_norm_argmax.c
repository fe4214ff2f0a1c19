/* RMSNorm, fused RMSNorm + residual, residual add and the masked argmax with
 * repetition penalty: GPU time through kiln, in three timings per shape:
 *   per_launch    an event pair around each kiln_stream_submit of the
 *                 pre-encoded command (eager; the host's submit cost shows
 *                 when the kernel is shorter than it);
 *   back_to_back  one event pair around iters submits, divided by iters;
 *   graph         the command's enqueue captured GRAPH_OPS times into one CUDA
 *                 graph, launched reps times between an event pair: GPU time
 *                 per operation, launch gaps included, host cost excluded.
 * Norms and the add at tokens x hidden: 2048x4096 (the bandwidth target:
 * >= 3.8 TB/s counting bytes read plus written), 1x4096 and 16x4096 (the
 * latency targets: less GPU time than torch's, compared on the graph
 * timing), 2048x896 and 4096x4096. Modes: hot (the same buffers each time)
 * and rotated (up to 16 sets of buffers, about 256 MiB, so that L2 cannot
 * hold the previous launch's data). Bytes: rms_norm 2*T*H*2 + H*2;
 * rms_norm_residual 4*T*H*2 + H*2; residual_add 3*T*H*2. A peer beside them:
 * d2d_copy, the driver's copy of T*H*2 bytes (a kiln copy command), 2*T*H*2,
 * the ceiling a kernel that reads and writes those bytes meets; the target
 * lines quote it.
 * The argmax: vocab 151936 (target <= 6 us) and 128256, P 1 and 64, 512
 * repetition ids per participant, 90% of the vocabulary valid.
 * --dtype picks the element type of every tensor (f16, the default, or
 * bf16); every line names it ("dtype"), so that the two runs can be put side
 * by side.
 *
 * Usage: bench_norm_argmax [--iters 200] [--warmup 20] [--dtype f16|bf16]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "bench_cuda.h"
#include "kiln/kiln.h"
#include "runtime/internal.h"

#define BENCH "norm_argmax"
#define TARGET_TBPS 3.8
#define TARGET_ARGMAX_US 6.0
#define MAX_SETS 16
#define ROTATE_BYTES ((size_t)256 << 20)
#define GRAPH_OPS 64
#define GRAPH_REPS 20

static const kiln__driver *g_d;
static kiln_dtype g_elt = KILN_DTYPE_F16;
static kiln_runtime *g_rt;
static kiln_runtime_info g_info;
static CUstream g_stream;

static void fail(const char *what, kiln_status st, const char *detail)
{
    bench_json_error_dtype(BENCH, kiln_dtype_name(g_elt), what, st ? kiln_status_code(st) : "bench", detail,
                           kiln_errmsg());
    exit(1);
}

static void cu_check(CUresult r, const char *what)
{
    if (r == CUDA_SUCCESS)
        return;
    const char *name = NULL;
    g_d->cuGetErrorName(r, &name);
    char msg[256];
    snprintf(msg, sizeof msg, "%s: %s (%d)", what, name ? name : "?", (int)r);
    fail(what, KILN_ERR_CUDA_DRIVER, msg);
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ULL;
static uint64_t rng_next(void) { return bench_xorshift64(&g_rng); }

/* Random finite elements of g_elt in about [-4, 4]. */
static void fill_elt(kiln_buffer *b, size_t bytes)
{
    size_t n = bytes / 2, chunk = (size_t)1 << 22;
    uint16_t *h = malloc(chunk * 2);
    if (!h)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (size_t i = 0; i < chunk; i++) {
        const uint64_t u = rng_next();
        if (g_elt == KILN_DTYPE_BF16) {
            /* The top half of an f32 in [-4, 4): a bf16 of that range. */
            float f = (float)((double)(u >> 11) * 0x1p-53 * 8.0 - 4.0);
            uint32_t bits;
            memcpy(&bits, &f, 4);
            h[i] = (uint16_t)(bits >> 16);
        } else {
            h[i] = (uint16_t)(u >> 48) & 0xc3ff; /* exponent <= 16: |x| < 4 */
        }
    }
    for (size_t off = 0; off < n; off += chunk) {
        size_t len = n - off < chunk ? n - off : chunk;
        kiln_status st = kiln_buffer_upload(b, off * 2, h, len * 2);
        if (st)
            fail("setup", st, NULL);
    }
    free(h);
}

typedef struct timing {
    double per_median, per_p10, per_p90, b2b, graph;
} timing;

/* Times commands cmds[i % n]: see the header for the three timings. */
static timing time_commands(kiln_command **cmds, size_t n, long iters, long warmup)
{
    kiln_stream *s = kiln_runtime_stream(g_rt);
    kiln_status st;
    timing t;
    CUevent *ev = calloc((size_t)iters * 2, sizeof *ev);
    double *per = calloc((size_t)iters, sizeof *per);
    if (!ev || !per)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (long i = 0; i < iters * 2; i++)
        cu_check(g_d->cuEventCreate(&ev[i], CU_EVENT_DEFAULT), "cuEventCreate");
    for (long i = 0; i < warmup + (long)n; i++)
        if ((st = kiln_stream_submit(s, &cmds[(size_t)i % n], 1, NULL, NULL)))
            fail("warmup", st, NULL);
    if ((st = kiln_stream_synchronize(s)))
        fail("warmup", st, NULL);
    for (long i = 0; i < iters; i++) {
        cu_check(g_d->cuEventRecord(ev[2 * i], g_stream), "cuEventRecord");
        if ((st = kiln_stream_submit(s, &cmds[(size_t)i % n], 1, NULL, NULL)))
            fail("launch", st, NULL);
        cu_check(g_d->cuEventRecord(ev[2 * i + 1], g_stream), "cuEventRecord");
    }
    if ((st = kiln_stream_synchronize(s)))
        fail("launch", st, NULL);
    for (long i = 0; i < iters; i++) {
        float ms;
        cu_check(g_d->cuEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cuEventElapsedTime");
        per[i] = (double)ms * 1e3;
    }
    bench_sort(per, (size_t)iters);
    t.per_median = bench_quantile(per, (size_t)iters, 0.5);
    t.per_p10 = bench_quantile(per, (size_t)iters, 0.1);
    t.per_p90 = bench_quantile(per, (size_t)iters, 0.9);

    cu_check(g_d->cuEventRecord(ev[0], g_stream), "cuEventRecord");
    for (long i = 0; i < iters; i++)
        if ((st = kiln_stream_submit(s, &cmds[(size_t)i % n], 1, NULL, NULL)))
            fail("launch", st, NULL);
    cu_check(g_d->cuEventRecord(ev[1], g_stream), "cuEventRecord");
    if ((st = kiln_stream_synchronize(s)))
        fail("launch", st, NULL);
    float ms;
    cu_check(g_d->cuEventElapsedTime(&ms, ev[0], ev[1]), "cuEventElapsedTime");
    t.b2b = (double)ms * 1e3 / (double)iters;

    /* The graph: GRAPH_OPS enqueues, captured on the runtime's stream. */
    CUgraph graph;
    CUgraphExec exec;
    cu_check(g_d->cuStreamBeginCapture(g_stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
    for (int i = 0; i < GRAPH_OPS; i++) {
        kiln_command *c = cmds[(size_t)i % n];
        kiln_launch_context ctx = {g_stream, s->fault, c, s->cublaslt};
        if ((st = c->enqueue(c->user, &ctx)))
            fail("capture", st, NULL);
    }
    cu_check(g_d->cuStreamEndCapture(g_stream, &graph), "cuStreamEndCapture");
    cu_check(g_d->cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
    cu_check(g_d->cuGraphLaunch(exec, g_stream), "cuGraphLaunch");
    cu_check(g_d->cuEventRecord(ev[0], g_stream), "cuEventRecord");
    for (int r = 0; r < GRAPH_REPS; r++)
        cu_check(g_d->cuGraphLaunch(exec, g_stream), "cuGraphLaunch");
    cu_check(g_d->cuEventRecord(ev[1], g_stream), "cuEventRecord");
    cu_check(g_d->cuEventSynchronize(ev[1]), "cuEventSynchronize");
    cu_check(g_d->cuEventElapsedTime(&ms, ev[0], ev[1]), "cuEventElapsedTime");
    t.graph = (double)ms * 1e3 / (GRAPH_REPS * GRAPH_OPS);
    g_d->cuGraphExecDestroy(exec);
    g_d->cuGraphDestroy(graph);
    for (long i = 0; i < iters * 2; i++)
        g_d->cuEventDestroy(ev[i]);
    free(ev);
    free(per);
    return t;
}

static void emit(const char *op, const char *mode, long long tokens, long long hidden, long long vocab,
                 long long participants, size_t sets, double bytes, const timing *t)
{
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", !strcmp(op, "d2d_copy"));
    bench_json_str(&j, "dtype", kiln_dtype_name(g_elt));
    bench_json_str(&j, "op", op);
    bench_json_str(&j, "mode", mode);
    if (tokens)
        bench_json_int(&j, "tokens", tokens);
    if (hidden)
        bench_json_int(&j, "hidden", hidden);
    if (vocab)
        bench_json_int(&j, "vocab", vocab);
    if (participants)
        bench_json_int(&j, "participants", participants);
    bench_json_int(&j, "sets", (long long)sets);
    bench_json_num(&j, "per_launch_median_us", t->per_median);
    bench_json_num(&j, "per_launch_p10_us", t->per_p10);
    bench_json_num(&j, "per_launch_p90_us", t->per_p90);
    bench_json_num(&j, "back_to_back_avg_us", t->b2b);
    bench_json_num(&j, "graph_avg_us", t->graph);
    if (bytes > 0) {
        bench_json_int(&j, "bytes", (long long)bytes);
        bench_json_num(&j, "per_launch_tbps", bytes / (t->per_median * 1e6));
        bench_json_num(&j, "back_to_back_tbps", bytes / (t->b2b * 1e6));
        bench_json_num(&j, "graph_tbps", bytes / (t->graph * 1e6));
    }
    bench_json_str(&j, "device", g_info.name);
    bench_json_end(&j);
}

typedef struct shape {
    int64_t tokens, hidden;
} shape;
static const shape g_shapes[] = {{2048, 4096}, {1, 4096}, {16, 4096}, {2048, 896}, {4096, 4096}};
#define N_SHAPES (sizeof g_shapes / sizeof g_shapes[0])
/* The ops, and a peer: the driver's device-to-device copy (cuMemcpyAsync, a
 * kiln copy command) of the norm's bytes, timed the same way: what moving
 * tokens x hidden in and out costs at best, launch gaps and L2 included. */
#define N_OPS 4
static const char *const g_ops[N_OPS] = {"rms_norm", "rms_norm_residual", "residual_add", "d2d_copy"};

int main(int argc, char **argv)
{
    long iters = 200, warmup = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc)
            warmup = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc && !strcmp(argv[i + 1], "f16"))
            g_elt = KILN_DTYPE_F16, i++;
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc && !strcmp(argv[i + 1], "bf16"))
            g_elt = KILN_DTYPE_BF16, i++;
        else
            iters = 0;
        if (iters < 1 || warmup < 1 || iters > 100000) {
            fprintf(stderr, "usage: %s [--iters N] [--warmup N] [--dtype f16|bf16]\n", argv[0]);
            return 2;
        }
    }
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        bench_skip_no_driver(BENCH, why);
        return 0;
    }
    kiln_status st;
    if ((st = kiln_runtime_create(NULL, &g_rt)))
        fail("setup", st, NULL);
    kiln_runtime_get_info(g_rt, &g_info);
    kiln_jit *jit;
    kiln_jit_options jo = {.size = sizeof jo, .runtime = g_rt};
    if ((st = kiln_jit_create(&jo, &jit)))
        fail("setup", st, NULL);
    g_d = kiln__driver_get(NULL);
    if ((st = kiln__runtime_enter(g_rt)))
        fail("setup", st, NULL);
    g_stream = (CUstream)kiln_stream_handle(kiln_runtime_stream(g_rt));

    /* Three pools (x, residual, out) of 256 MiB + one set, and the weight. */
    const size_t pool = ROTATE_BYTES + ((size_t)4096 * 4096 * 2);
    kiln_buffer *bx, *br, *bo, *bw;
    if ((st = kiln_buffer_create(g_rt, pool, 0, &bx)) || (st = kiln_buffer_create(g_rt, pool, 0, &br)) ||
        (st = kiln_buffer_create(g_rt, pool, 0, &bo)) || (st = kiln_buffer_create(g_rt, 65536 * 2, 0, &bw)))
        fail("setup", st, NULL);
    fill_elt(bx, pool);
    fill_elt(br, pool);
    fill_elt(bw, 65536 * 2);

    double target[N_OPS][2] = {{0}};
    for (size_t s = 0; s < N_SHAPES; s++) {
        const int64_t T = g_shapes[s].tokens, H = g_shapes[s].hidden;
        const size_t set_bytes = (size_t)T * H * 2;
        for (int op = 0; op < N_OPS; op++) {
            for (int rot = 0; rot < 2; rot++) {
                size_t sets = rot ? (ROTATE_BYTES + set_bytes - 1) / set_bytes : 1;
                sets = sets > MAX_SETS ? MAX_SETS : sets;
                kiln_command *cmds[MAX_SETS];
                kiln_tensor w = {.buffer = bw, .dtype = g_elt, .rank = 1, .dims = {H}};
                for (size_t k = 0; k < sets; k++) {
                    kiln_tensor x = {.buffer = bx, .offset = k * set_bytes, .dtype = g_elt, .rank = 2,
                                     .dims = {T, H}},
                                r = x, o = x;
                    r.buffer = br;
                    o.buffer = bo;
                    const kiln_region src = {bx, k * set_bytes, (k + 1) * set_bytes},
                                      dst = {bo, k * set_bytes, (k + 1) * set_bytes};
                    st = op == 0   ? kiln_op_rms_norm_encode(jit, &x, &w, 1e-5f, &o, &cmds[k])
                         : op == 1 ? kiln_op_rms_norm_residual_encode(jit, &x, &r, &w, 1e-5f, &o, &cmds[k])
                         : op == 2 ? kiln_op_residual_add_encode(jit, &x, &r, &o, &cmds[k])
                                   : kiln_command_copy(g_rt, &src, &dst, &cmds[k]);
                    if (st)
                        fail("encode", st, NULL);
                }
                timing t = time_commands(cmds, sets, iters, warmup);
                double bytes = op == 0   ? 2.0 * set_bytes + H * 2.0
                               : op == 1 ? 4.0 * set_bytes + H * 2.0
                               : op == 2 ? 3.0 * set_bytes
                                         : 2.0 * set_bytes;
                emit(g_ops[op], rot ? "rotated" : "hot", T, H, 0, 0, sets, bytes, &t);
                if (s == 0)
                    target[op][rot] = bytes / (t.graph * 1e6);
                for (size_t k = 0; k < sets; k++)
                    kiln_command_release(cmds[k]);
            }
        }
    }
    for (int op = 0; op < 3; op++) {
        bench_json j;
        bench_json_begin(&j, BENCH);
        bench_json_bool(&j, "peer", 0);
        bench_json_str(&j, "dtype", kiln_dtype_name(g_elt));
        bench_json_str(&j, "phase", "target");
        bench_json_str(&j, "op", g_ops[op]);
        bench_json_int(&j, "tokens", g_shapes[0].tokens);
        bench_json_int(&j, "hidden", g_shapes[0].hidden);
        bench_json_num(&j, "target_tbps", TARGET_TBPS);
        bench_json_num(&j, "graph_tbps_hot", target[op][0]);
        bench_json_num(&j, "graph_tbps_rotated", target[op][1]);
        bench_json_bool(&j, "meets_target", target[op][0] >= TARGET_TBPS);
        bench_json_bool(&j, "meets_target_rotated", target[op][1] >= TARGET_TBPS);
        bench_json_num(&j, "d2d_copy_graph_tbps_hot", target[N_OPS - 1][0]);
        bench_json_num(&j, "d2d_copy_graph_tbps_rotated", target[N_OPS - 1][1]);
        bench_json_end(&j);
    }

    /* The argmax. */
    static const struct { int64_t vocab, P; } acases[] = {{151936, 1}, {151936, 64}, {128256, 1}, {128256, 64}};
    const uint32_t R = 512;
    for (size_t c = 0; c < sizeof acases / sizeof acases[0]; c++) {
        const int64_t V = acases[c].vocab, P = acases[c].P;
        size_t ws;
        if ((st = kiln_op_masked_argmax_workspace(V, P, &ws)))
            fail("setup", st, NULL);
        kiln_buffer *bl, *bv, *bi, *bf, *bp, *bws, *bout;
        if ((st = kiln_buffer_create(g_rt, (size_t)P * V * 2, 0, &bl)) || (st = kiln_buffer_create(g_rt, (size_t)V, 0, &bv)) ||
            (st = kiln_buffer_create(g_rt, (size_t)P * R * 4, 0, &bi)) ||
            (st = kiln_buffer_create(g_rt, ((size_t)P + 1) * 4, 0, &bf)) || (st = kiln_buffer_create(g_rt, 4, 0, &bp)) ||
            (st = kiln_buffer_create(g_rt, ws, 0, &bws)) || (st = kiln_buffer_create(g_rt, (size_t)P * 4, 0, &bout)))
            fail("setup", st, NULL);
        fill_elt(bl, (size_t)P * V * 2);
        uint8_t *valid = malloc((size_t)V);
        uint32_t *ids = malloc((size_t)P * R * 4), *offs = malloc(((size_t)P + 1) * 4);
        if (!valid || !ids || !offs)
            fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        for (int64_t t = 0; t < V; t++)
            valid[t] = rng_next() % 10 != 0;
        for (size_t i = 0; i < (size_t)P * R; i++)
            ids[i] = (uint32_t)(rng_next() % (uint64_t)V);
        for (int64_t p = 0; p <= P; p++)
            offs[p] = (uint32_t)p * R;
        float pen = 1.3f;
        if ((st = kiln_buffer_upload(bv, 0, valid, (size_t)V)) || (st = kiln_buffer_upload(bi, 0, ids, (size_t)P * R * 4)) ||
            (st = kiln_buffer_upload(bf, 0, offs, ((size_t)P + 1) * 4)) || (st = kiln_buffer_upload(bp, 0, &pen, 4)))
            fail("setup", st, NULL);
        kiln_tensor tl = {.buffer = bl, .dtype = g_elt, .rank = 2, .dims = {P, V}},
                    tv = {.buffer = bv, .dtype = KILN_DTYPE_U8, .rank = 1, .dims = {V}},
                    ti = {.buffer = bi, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P * R}},
                    tf = {.buffer = bf, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P + 1}},
                    tp = {.buffer = bp, .dtype = KILN_DTYPE_F32, .rank = 1, .dims = {1}},
                    tw = {.buffer = bws, .dtype = KILN_DTYPE_U8, .rank = 1, .dims = {(int64_t)ws}},
                    to = {.buffer = bout, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {P}};
        kiln_masked_argmax_bindings mb = {sizeof mb, &tl, &tv, &ti, &tf, &tp, &tw, &to};
        kiln_command *cmd;
        if ((st = kiln_op_masked_argmax_encode(jit, &mb, &cmd)))
            fail("encode", st, NULL);
        timing t = time_commands(&cmd, 1, iters, warmup);
        emit("masked_argmax", "hot", 0, 0, V, P, 1, 0, &t);
        if (c == 0) {
            bench_json j;
            bench_json_begin(&j, BENCH);
            bench_json_bool(&j, "peer", 0);
            bench_json_str(&j, "dtype", kiln_dtype_name(g_elt));
            bench_json_str(&j, "phase", "target");
            bench_json_str(&j, "op", "masked_argmax");
            bench_json_int(&j, "vocab", V);
            bench_json_num(&j, "target_us", TARGET_ARGMAX_US);
            bench_json_num(&j, "per_launch_median_us", t.per_median);
            bench_json_num(&j, "graph_avg_us", t.graph);
            bench_json_bool(&j, "meets_target", t.per_median <= TARGET_ARGMAX_US);
            bench_json_bool(&j, "meets_target_graph", t.graph <= TARGET_ARGMAX_US);
            bench_json_end(&j);
        }
        kiln_command_release(cmd);
        free(valid);
        free(ids);
        free(offs);
        kiln_buffer_destroy(bl);
        kiln_buffer_destroy(bv);
        kiln_buffer_destroy(bi);
        kiln_buffer_destroy(bf);
        kiln_buffer_destroy(bp);
        kiln_buffer_destroy(bws);
        kiln_buffer_destroy(bout);
    }
    kiln_buffer_destroy(bx);
    kiln_buffer_destroy(br);
    kiln_buffer_destroy(bo);
    kiln_buffer_destroy(bw);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(g_rt);
    return 0;
}
