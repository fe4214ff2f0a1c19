/* The mixture-of-experts layer at Qwen3-30B-A3B's shape (hidden 2048, 128
 * experts, top 8, expert intermediate 768, bf16): the router's gate product
 * (kiln_op_dense_linear, x [T, H] · gate [E, H]ᵀ -> logits [T, E]), the
 * router (kiln_op_moe_router, normalized top k) and the routed SwiGLU experts
 * (kiln_op_moe_experts, gate_up [E, 2I, H], down [E, H, I]), for decode
 * (T = 1, 8, 32, 64) and prefill (T = 4096).
 *
 * Weights are random, uniform with variance 1/fan_in (the router's and the
 * gate_up's fan_in H, down's I; each expert set's weights repeat a 16 MiB
 * random block), x uniform with variance 1: the router's logits then have a
 * variance of about 1 and the routing spreads over the experts as a model's
 * untrained router would. The ids are read back once per T and the distinct
 * experts counted ("distinct_experts").
 *
 * Timing: on a stream of kiln's own, each list of commands (the layer: linear,
 * router, experts; or the experts alone) repeated --reps times in one
 * submission is captured into one graph by kiln_stream_prepare and replayed
 * (KILN_PATH_REPLAYED_ONLY), an event pair around each of --iters
 * submissions, submitted back to back: the time per layer is the pair's
 * elapsed over reps, the median of iters. The reps cycle through --sets
 * copies of the experts' weights (the router's weight and x are shared, so
 * that every set routes alike), so that the selected experts' weights are
 * not still in L2 from the previous layer, as in a model of many layers.
 *
 * The floor: what the layer must move at least (the distinct experts'
 * weights, 3·I·H elements each, the router's weight E·H, x and out T·H each)
 * at the device-to-device copy bandwidth measured in the same run (a kiln
 * copy command of 1 GiB, bytes read plus written over its median time):
 * floor_us; ratio = layer_us / floor_us. Prefill lines (T > 64) add TFLOP/s,
 * 2·T·K·3·I·H over the time (the router's product not counted).
 *
 * Lines: one "phase":"copy" line, then one "decode" or "prefill" line per T.
 * The peer is bench/peer_torch_moe.py (transformers' Qwen3MoeSparseMoeBlock).
 *
 * Usage: bench_moe [--hidden 2048] [--inter 768] [--experts 128] [--top-k 8]
 *        [--dtype bf16|f16] [--tokens 1,8,32,64,4096] [--iters 50] [--reps 8]
 *        [--sets 4]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "bench_cuda.h"
#include "../tests/f16_host.h" /* the tests' f16 and bf16 rounding */
#include "kiln/kiln.h"
#include "runtime/internal.h"

#define BENCH "moe"
#define COPY_BYTES ((size_t)1 << 30)
#define COPY_ITERS 20
#define BLOCK_ELEMS ((size_t)8 << 20) /* the repeated random block: 16 MiB of 16-bit elements */
#define MAX_TOKENS_LIST 16
#define MAX_SETS 16
#define MAX_REPS 64
#define DECODE_MAX_T 64

static const kiln__driver *g_d;
static kiln_dtype g_elt = KILN_DTYPE_BF16;
static kiln_runtime *g_rt;
static kiln_stream *g_s;
static CUstream g_cs;

static void fail(const char *what, kiln_status st, const char *detail)
{
    bench_json_error_dtype(BENCH, kiln_dtype_name(g_elt), what, st ? kiln_status_code(st) : "bench", detail,
                           kiln_errmsg());
    exit(1);
}

static void check(kiln_status st, const char *what)
{
    if (st)
        fail(what, st, NULL);
}

static void cu_check(CUresult r, const char *what)
{
    if (r == CUDA_SUCCESS)
        return;
    char msg[512];
    bench_cu_message(g_d, r, what, msg, sizeof msg);
    fail(what, KILN_ERR_CUDA_DRIVER, msg);
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ULL;
static uint64_t rng_next(void) { return bench_xorshift64(&g_rng); }

static uint16_t to_elt(float f) { return g_elt == KILN_DTYPE_F16 ? f2h(f) : kiln_test_bf16_from_f32(f); }

/* A buffer of bytes filled with uniform elements of variance scale² (a
 * random block of at most BLOCK_ELEMS elements, repeated). */
static kiln_buffer *random_buffer(size_t bytes, double scale)
{
    kiln_buffer *b;
    check(kiln_buffer_create(g_rt, bytes, 256, &b), "setup");
    const size_t n = bytes / 2, block = n < BLOCK_ELEMS ? n : BLOCK_ELEMS;
    uint16_t *h = malloc(block * 2);
    if (!h)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    const double half_width = sqrt(3.0) * scale;
    for (size_t i = 0; i < block; i++)
        h[i] = to_elt((float)(((double)(rng_next() >> 11) * 0x1p-53 * 2.0 - 1.0) * half_width));
    for (size_t off = 0; off < n; off += block)
        check(kiln_buffer_upload(b, off * 2, h, (n - off < block ? n - off : block) * 2), "setup");
    free(h);
    return b;
}

static kiln_buffer *plain_buffer(size_t bytes)
{
    kiln_buffer *b;
    check(kiln_buffer_create(g_rt, bytes ? bytes : 256, 256, &b), "setup");
    return b;
}

typedef struct timing {
    double median, p10, p90;
} timing;

/* Times the submission of cmds[0..n) (one layer per reps-th of it): see the
 * header. path EAGER_ONLY runs the list eager, else replayed. */
static timing time_list(kiln_command **cmds, size_t n, long reps, long iters, kiln_compute_path path,
                        CUevent *ev, double *per)
{
    kiln_submit_options so = {.size = sizeof so, .path = path};
    for (int w = 0; w < 3; w++)
        check(kiln_stream_submit(g_s, cmds, n, &so, NULL), "warmup");
    check(kiln_stream_synchronize(g_s), "warmup");
    for (long i = 0; i < iters; i++) {
        cu_check(g_d->cuEventRecord(ev[2 * i], g_cs), "cuEventRecord");
        check(kiln_stream_submit(g_s, cmds, n, &so, NULL), "launch");
        cu_check(g_d->cuEventRecord(ev[2 * i + 1], g_cs), "cuEventRecord");
    }
    check(kiln_stream_synchronize(g_s), "launch");
    for (long i = 0; i < iters; i++) {
        float ms = 0;
        cu_check(g_d->cuEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cuEventElapsedTime");
        per[i] = (double)ms * 1e3 / (double)reps;
    }
    bench_sort(per, (size_t)iters);
    timing t = {bench_quantile(per, (size_t)iters, 0.5), bench_quantile(per, (size_t)iters, 0.1),
                bench_quantile(per, (size_t)iters, 0.9)};
    return t;
}

/* The copy bandwidth (bytes read plus written per second) of a 1 GiB kiln
 * copy command on the stream, median of COPY_ITERS; prints its line. */
static double copy_bandwidth(CUevent *ev, double *per)
{
    kiln_buffer *src = plain_buffer(COPY_BYTES), *dst = plain_buffer(COPY_BYTES);
    check(kiln_buffer_fill(src, 0, 0x3c, COPY_BYTES), "setup");
    const kiln_region rs = {src, 0, COPY_BYTES}, rd = {dst, 0, COPY_BYTES};
    kiln_command *cmd;
    check(kiln_command_copy(g_rt, &rs, &rd, &cmd), "encode");
    check(kiln_runtime_synchronize(g_rt), "setup");
    timing t = time_list(&cmd, 1, 1, COPY_ITERS, KILN_PATH_EAGER_ONLY, ev, per);
    kiln_command_release(cmd);
    kiln_buffer_destroy(src);
    kiln_buffer_destroy(dst);
    const double bps = 2.0 * (double)COPY_BYTES / (t.median * 1e-6);
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "phase", "copy");
    bench_json_str(&j, "dtype", kiln_dtype_name(g_elt));
    bench_json_int(&j, "copy_bytes", (long long)COPY_BYTES);
    bench_json_int(&j, "iters", COPY_ITERS);
    bench_json_num(&j, "median_us", t.median);
    bench_json_num(&j, "p10_us", t.p10);
    bench_json_num(&j, "p90_us", t.p90);
    bench_json_num(&j, "tbps", bps / 1e12);
    bench_json_end(&j);
    return bps;
}

/* Captures the list's graph for the replayed-only path; 0, or the status
 * with its message in why. */
static kiln_status prepare(kiln_command **cmds, size_t n, char *why, size_t cap)
{
    kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_REPLAYED_ONLY};
    kiln_status st = kiln_stream_prepare(g_s, cmds, n, &so, NULL);
    if (st)
        snprintf(why, cap, "%s: %s", kiln_status_code(st), kiln_errmsg());
    return st;
}

/* "T,T,...": positive counts, at most MAX_TOKENS_LIST; 0, or -1 when not that. */
static int parse_tokens(const char *s, int64_t *out, int *n)
{
    *n = 0;
    for (const char *p = s;; p++) {
        char *end = NULL;
        long v = strtol(p, &end, 10);
        if (end == p || v <= 0 || *n >= MAX_TOKENS_LIST || (*end && *end != ','))
            return -1;
        out[(*n)++] = v;
        if (!*end)
            return 0;
        p = end;
    }
}

int main(int argc, char **argv)
{
    long H = 2048, I = 768, E = 128, K = 8, iters = 50, reps = 8, sets = 4;
    int64_t tokens[MAX_TOKENS_LIST] = {1, 8, 32, 64, 4096};
    int n_tokens = 5, bad = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            bad = 1;
        else if (!strcmp(a, "--hidden"))
            H = bench_parse_positive(v);
        else if (!strcmp(a, "--inter"))
            I = bench_parse_positive(v);
        else if (!strcmp(a, "--experts"))
            E = bench_parse_positive(v);
        else if (!strcmp(a, "--top-k"))
            K = bench_parse_positive(v);
        else if (!strcmp(a, "--iters"))
            iters = bench_parse_positive(v);
        else if (!strcmp(a, "--reps"))
            reps = bench_parse_positive(v);
        else if (!strcmp(a, "--sets"))
            sets = bench_parse_positive(v);
        else if (!strcmp(a, "--dtype") && !strcmp(v, "bf16"))
            g_elt = KILN_DTYPE_BF16;
        else if (!strcmp(a, "--dtype") && !strcmp(v, "f16"))
            g_elt = KILN_DTYPE_F16;
        else if (!strcmp(a, "--tokens"))
            bad |= parse_tokens(v, tokens, &n_tokens) != 0;
        else
            bad = 1;
        i++;
        if (bad || H <= 0 || I <= 0 || E <= 0 || K <= 0 || K > E || iters <= 0 || iters > 100000 || reps <= 0 ||
            reps > MAX_REPS || sets <= 0 || sets > MAX_SETS) {
            fprintf(stderr,
                    "usage: %s [--hidden N] [--inter N] [--experts N] [--top-k N] [--dtype bf16|f16]\n"
                    "       [--tokens T,T,...] [--iters N] [--reps N (<= %d)] [--sets N (<= %d)]\n",
                    argv[0], MAX_REPS, MAX_SETS);
            return 2;
        }
    }
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        bench_skip_no_driver(BENCH, why);
        return 0;
    }
    check(kiln_runtime_create(NULL, &g_rt), "setup");
    kiln_runtime_info info;
    kiln_runtime_get_info(g_rt, &info);
    kiln_jit *jit;
    kiln_jit_options jo = {.size = sizeof jo, .runtime = g_rt};
    check(kiln_jit_create(&jo, &jit), "setup");
    g_d = kiln__driver_get(NULL);
    check(kiln__runtime_enter(g_rt), "setup");
    check(kiln_stream_create(g_rt, &g_s), "setup");
    g_cs = (CUstream)kiln_stream_handle(g_s);
    CUevent *ev = calloc((size_t)iters * 2 + 2 * COPY_ITERS, sizeof *ev);
    double *per = calloc((size_t)iters + COPY_ITERS, sizeof *per);
    if (!ev || !per)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    const long n_ev = iters * 2 + 2 * COPY_ITERS;
    for (long i = 0; i < n_ev; i++)
        cu_check(g_d->cuEventCreate(&ev[i], CU_EVENT_DEFAULT), "cuEventCreate");

    const double copy_bps = copy_bandwidth(ev, per);

    /* The weights: the router's gate, and sets copies of the experts' (fewer
     * where they would take more than half the device's memory). */
    const size_t eb = 2, gu_bytes = (size_t)E * 2 * I * H * eb, down_bytes = (size_t)E * H * I * eb;
    while (sets > 1 && (double)sets * (double)(gu_bytes + down_bytes) > 0.5 * (double)info.total_memory)
        sets--;
    int64_t max_t = 0;
    for (int i = 0; i < n_tokens; i++)
        max_t = tokens[i] > max_t ? tokens[i] : max_t;
    kiln_buffer *bgate = random_buffer((size_t)E * H * eb, 1.0 / sqrt((double)H));
    kiln_buffer *bx = random_buffer((size_t)max_t * H * eb, 1.0);
    kiln_buffer *bgu[MAX_SETS], *bdown[MAX_SETS];
    for (long s = 0; s < sets; s++) {
        bgu[s] = random_buffer(gu_bytes, 1.0 / sqrt((double)H));
        bdown[s] = random_buffer(down_bytes, 1.0 / sqrt((double)I));
    }
    check(kiln_runtime_synchronize(g_rt), "setup");

    for (int ti = 0; ti < n_tokens; ti++) {
        const int64_t T = tokens[ti];
        size_t lin_ws, exp_ws;
        check(kiln_op_dense_linear_workspace(T, H, E, &lin_ws), "setup");
        check(kiln_op_moe_experts_workspace(T, H, I, E, K, &exp_ws), "setup");
        kiln_buffer *blog = plain_buffer((size_t)T * E * eb), *bids = plain_buffer((size_t)T * K * 4),
                    *bw = plain_buffer((size_t)T * K * 4), *bout = plain_buffer((size_t)T * H * eb),
                    *blws = plain_buffer(lin_ws), *bews = plain_buffer(exp_ws);
        kiln_tensor tx = {.buffer = bx, .dtype = g_elt, .rank = 2, .dims = {T, H}},
                    tg = {.buffer = bgate, .dtype = g_elt, .rank = 2, .dims = {E, H}},
                    tl = {.buffer = blog, .dtype = g_elt, .rank = 2, .dims = {T, E}},
                    tid = {.buffer = bids, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {T, K}},
                    tw = {.buffer = bw, .dtype = KILN_DTYPE_F32, .rank = 2, .dims = {T, K}},
                    to = {.buffer = bout, .dtype = g_elt, .rank = 2, .dims = {T, H}};
        const kiln_region rlws = {blws, 0, lin_ws ? lin_ws : 256}, rews = {bews, 0, exp_ws ? exp_ws : 256};
        kiln_command *lin, *router, *experts[MAX_SETS];
        check(kiln_op_dense_linear_encode(jit, &tx, &tg, NULL, &tl, &rlws, &lin), "encode");
        kiln_moe_router_desc rd = {.size = sizeof rd, .logits = &tl, .ids = &tid, .weights = &tw,
                                   .top_k = (uint32_t)K, .normalize = 1};
        check(kiln_op_moe_router_encode(jit, &rd, &router), "encode");
        for (long s = 0; s < sets; s++) {
            kiln_tensor tgu = {.buffer = bgu[s], .dtype = g_elt, .rank = 3, .dims = {E, 2 * I, H}},
                        tdn = {.buffer = bdown[s], .dtype = g_elt, .rank = 3, .dims = {E, H, I}};
            kiln_moe_experts_desc ed = {.size = sizeof ed, .x = &tx, .ids = &tid, .weights = &tw,
                                        .gate_up = &tgu, .down = &tdn, .out = &to, .workspace = &rews};
            check(kiln_op_moe_experts_encode(jit, &ed, &experts[s]), "encode");
        }
        /* The lists: reps layers (or experts), cycling through the sets. */
        kiln_command *layer[3 * MAX_REPS], *alone[MAX_REPS];
        for (long r = 0; r < reps; r++) {
            layer[3 * r] = lin;
            layer[3 * r + 1] = router;
            layer[3 * r + 2] = alone[r] = experts[r % sets];
        }
        char replay_why[1024] = "";
        int replayed = !prepare(layer, (size_t)reps * 3, replay_why, sizeof replay_why) &&
                       !prepare(alone, (size_t)reps, replay_why, sizeof replay_why);
        const kiln_compute_path path = replayed ? KILN_PATH_REPLAYED_ONLY : KILN_PATH_EAGER_ONLY;
        kiln_graph_stats g0, g1;
        kiln_stream_graph_stats(g_s, &g0);
        timing tlay = time_list(layer, (size_t)reps * 3, reps, iters, path, ev, per);
        timing texp = time_list(alone, (size_t)reps, reps, iters, path, ev, per);
        kiln_stream_graph_stats(g_s, &g1);

        /* The routing of the last run (every set routes alike), and out's
         * elements all finite. */
        uint32_t *ids = malloc((size_t)T * K * 4);
        uint16_t *out = malloc((size_t)T * H * eb);
        uint8_t *seen = calloc((size_t)E, 1);
        if (!ids || !out || !seen)
            fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        const kiln_region rid = {bids, 0, (size_t)T * K * 4}, rout = {bout, 0, (size_t)T * H * eb};
        check(kiln_stream_readback(g_s, &rid, ids), "readback");
        check(kiln_stream_readback(g_s, &rout, out), "readback");
        long long distinct = 0, bad_ids = 0, nonfinite = 0;
        for (size_t i = 0; i < (size_t)T * K; i++) {
            if (ids[i] >= (uint32_t)E)
                bad_ids++;
            else if (!seen[ids[i]])
                seen[ids[i]] = 1, distinct++;
        }
        const uint16_t exp_mask = g_elt == KILN_DTYPE_BF16 ? 0x7f80u : 0x7c00u;
        for (size_t i = 0; i < (size_t)T * H; i++)
            nonfinite += (out[i] & exp_mask) == exp_mask;
        free(ids);
        free(out);
        free(seen);

        const double expert_bytes = 3.0 * (double)I * (double)H * (double)eb;
        const double io_bytes = 2.0 * (double)T * (double)H * (double)eb;
        const double floor_bytes = (double)distinct * expert_bytes + (double)E * H * eb + io_bytes;
        const double exp_floor_bytes = (double)distinct * expert_bytes + io_bytes;
        const double floor_us = floor_bytes / copy_bps * 1e6, exp_floor_us = exp_floor_bytes / copy_bps * 1e6;
        const double flop = 2.0 * (double)T * (double)K * 3.0 * (double)I * (double)H;
        bench_json j;
        bench_json_begin(&j, BENCH);
        bench_json_bool(&j, "peer", 0);
        bench_json_str(&j, "phase", T <= DECODE_MAX_T ? "decode" : "prefill");
        bench_json_str(&j, "dtype", kiln_dtype_name(g_elt));
        bench_json_int(&j, "tokens", T);
        bench_json_int(&j, "hidden", H);
        bench_json_int(&j, "inter", I);
        bench_json_int(&j, "experts", E);
        bench_json_int(&j, "top_k", K);
        bench_json_int(&j, "iters", iters);
        bench_json_int(&j, "reps", reps);
        bench_json_int(&j, "sets", sets);
        /* What the provider reads: the sm_90 wgmma products at prefill unless 0. */
        bench_json_bool(&j, "moe_wgmma", !getenv("KILN_MOE_WGMMA") || strcmp(getenv("KILN_MOE_WGMMA"), "0"));
        bench_json_bool(&j, "replayed", replayed && g1.hits - g0.hits >= (uint64_t)(2 * (iters + 3)));
        if (!replayed)
            bench_json_str(&j, "replay_error", replay_why);
        bench_json_num(&j, "layer_us", tlay.median);
        bench_json_num(&j, "layer_p10_us", tlay.p10);
        bench_json_num(&j, "layer_p90_us", tlay.p90);
        bench_json_num(&j, "experts_us", texp.median);
        bench_json_num(&j, "experts_p10_us", texp.p10);
        bench_json_num(&j, "experts_p90_us", texp.p90);
        bench_json_int(&j, "distinct_experts", distinct);
        bench_json_int(&j, "bad_ids", bad_ids);
        bench_json_int(&j, "out_nonfinite", nonfinite);
        bench_json_int(&j, "floor_bytes", (long long)floor_bytes);
        bench_json_num(&j, "copy_tbps", copy_bps / 1e12);
        bench_json_num(&j, "floor_us", floor_us);
        bench_json_num(&j, "ratio", tlay.median / floor_us);
        bench_json_num(&j, "experts_floor_us", exp_floor_us);
        bench_json_num(&j, "experts_ratio", texp.median / exp_floor_us);
        bench_json_num(&j, "layer_tbps", floor_bytes / (tlay.median * 1e6));
        if (T > DECODE_MAX_T) {
            bench_json_num(&j, "flop", flop);
            bench_json_num(&j, "tflops", flop / (tlay.median * 1e6));
            bench_json_num(&j, "experts_tflops", flop / (texp.median * 1e6));
        }
        bench_json_str(&j, "device", info.name);
        bench_json_end(&j);

        check(kiln_stream_synchronize(g_s), "run");
        kiln_command_release(lin);
        kiln_command_release(router);
        for (long s = 0; s < sets; s++)
            kiln_command_release(experts[s]);
        check(kiln_stream_graph_trim(g_s, 0, 0), "run");
        kiln_buffer *all[6] = {blog, bids, bw, bout, blws, bews};
        for (int b = 0; b < 6; b++)
            kiln_buffer_destroy(all[b]);
    }
    for (long i = 0; i < n_ev; i++)
        g_d->cuEventDestroy(ev[i]);
    free(ev);
    free(per);
    for (long s = 0; s < sets; s++) {
        kiln_buffer_destroy(bgu[s]);
        kiln_buffer_destroy(bdown[s]);
    }
    kiln_buffer_destroy(bgate);
    kiln_buffer_destroy(bx);
    kiln_stream_destroy(g_s);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(g_rt);
    return 0;
}
