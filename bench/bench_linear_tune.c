/* Dense linear at decode shapes: every cuBLASLt candidate of the heuristic's
 * list beside the one kiln chooses by itself, to see what choosing costs at
 * the narrow shapes a decode step runs (1, 8 and 32 tokens by the
 * projections of Llama-3-8B). The weights rotate through enough copies
 * (>= 256 MiB) that none is in L2 when it is read, as in a decoder whose
 * layers each have their own. Time: one event pair around rounds of
 * submissions back to back, per call.
 *
 * One line per shape and candidate: "candidate" -1 is kiln's own choice;
 * us_per_call, weight_gb_s (weight bytes over time), config (the
 * candidate's cuBLASLt configuration). Then one "best" line per shape.
 *
 * Usage: bench_linear_tune [--rounds 40] [--own]   (--own: kiln's choice only)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "bench_cuda.h"
#include "kiln/kiln.h"
#include "runtime/internal.h"

#define BENCH "linear_tune"
#define ROTATE_BYTES ((size_t)256 << 20)
#define MAX_COPIES 64
#define MAX_CANDIDATES 8

void kiln__blas_force_candidate(int index);
void kiln__blas_forced_config(char *buf, size_t cap);

static void fail(const char *what, kiln_status st, const char *detail)
{
    bench_json_error(BENCH, what, st ? kiln_status_code(st) : "bench", detail, kiln_errmsg());
    exit(1);
}

static const kiln__driver *g_d;

static void cu_check(CUresult r, const char *what)
{
    if (r != CUDA_SUCCESS) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s: CUresult %d", what, (int)r);
        fail(what, KILN_ERR_CUDA_DRIVER, msg);
    }
}

typedef struct shape {
    const char *name;
    int64_t in, out;
} shape;

static const shape g_shapes[] = {
    {"q_proj/o_proj", 4096, 4096},
    {"qkv_proj", 4096, 6144},
    {"gate_up", 4096, 28672},
    {"down_proj", 14336, 4096},
};
static const int64_t g_tokens[] = {1, 8, 32};

int main(int argc, char **argv)
{
    long rounds = 40;
    int own_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--own"))
            own_only = 1;
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
            rounds = bench_parse_positive(argv[++i]);
        else
            rounds = 0;
        if (rounds < 1 || rounds > 10000) {
            fprintf(stderr, "usage: %s [--rounds N] [--own]\n", argv[0]);
            return 2;
        }
    }
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        bench_skip_no_driver(BENCH, why);
        return 0;
    }
    kiln_status st;
    kiln_runtime *rt = NULL;
    kiln_jit *jit = NULL;
    if ((st = kiln_runtime_create(NULL, &rt)))
        fail("setup", st, NULL);
    kiln_jit_options jo = {.size = sizeof jo, .runtime = rt};
    if ((st = kiln_jit_create(&jo, &jit)))
        fail("setup", st, NULL);
    g_d = kiln__driver_get(NULL);
    if ((st = kiln__runtime_enter(rt)))
        fail("setup", st, NULL);
    kiln_stream *stream = kiln_runtime_stream(rt);
    CUstream cs = (CUstream)kiln_stream_handle(stream);
    CUevent e0, e1;
    cu_check(g_d->cuEventCreate(&e0, CU_EVENT_DEFAULT), "cuEventCreate");
    cu_check(g_d->cuEventCreate(&e1, CU_EVENT_DEFAULT), "cuEventCreate");

    for (size_t s = 0; s < sizeof g_shapes / sizeof g_shapes[0]; s++) {
        const shape *sh = &g_shapes[s];
        const size_t wbytes = (size_t)sh->in * sh->out * 2;
        int copies = (int)((ROTATE_BYTES + wbytes - 1) / wbytes);
        copies = copies < 2 ? 2 : copies > MAX_COPIES ? MAX_COPIES : copies;
        kiln_buffer *bw = NULL, *bx = NULL, *bo = NULL, *bws = NULL;
        size_t ws = 0;
        if ((st = kiln_op_dense_linear_workspace(32, sh->in, sh->out, &ws)) ||
            (st = kiln_buffer_create(rt, wbytes * (size_t)copies, 256, &bw)) ||
            (st = kiln_buffer_create(rt, (size_t)32 * sh->in * 2, 256, &bx)) ||
            (st = kiln_buffer_create(rt, (size_t)32 * sh->out * 2, 256, &bo)) ||
            (st = kiln_buffer_create(rt, ws ? ws : 256, 256, &bws)) ||
            (st = kiln_buffer_fill(bw, 0, 0x2a, wbytes * (size_t)copies)) ||
            (st = kiln_buffer_fill(bx, 0, 0x2c, (size_t)32 * sh->in * 2)))
            fail("setup", st, NULL);
        for (size_t t = 0; t < sizeof g_tokens / sizeof g_tokens[0]; t++) {
            const int64_t tokens = g_tokens[t];
            double best_us = 0, own_us = 0;
            int best = -2;
            for (int c = -1; c < (own_only ? 0 : MAX_CANDIDATES); c++) {
                kiln__blas_force_candidate(c);
                kiln_command *cmds[MAX_COPIES] = {0};
                char config[256] = "kiln's choice";
                int ok = 1;
                for (int k = 0; k < copies && ok; k++) {
                    kiln_tensor x = {.buffer = bx, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {tokens, sh->in}};
                    kiln_tensor w = {.buffer = bw, .offset = wbytes * (size_t)k, .dtype = KILN_DTYPE_F16, .rank = 2,
                                     .dims = {sh->out, sh->in}};
                    kiln_tensor o = {.buffer = bo, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {tokens, sh->out}};
                    kiln_region wsr = {bws, 0, ws};
                    if (kiln_op_dense_linear_encode(jit, &x, &w, NULL, &o, &wsr, &cmds[k]))
                        ok = 0; /* past the end of the heuristic's list */
                }
                if (c >= 0 && ok)
                    kiln__blas_forced_config(config, sizeof config);
                kiln__blas_force_candidate(-1);
                if (!ok) {
                    for (int k = 0; k < copies; k++)
                        kiln_command_release(cmds[k]);
                    break;
                }
                for (long r = 0; r < 3; r++) /* warm-up */
                    if ((st = kiln_stream_submit(stream, cmds, (uint32_t)copies, NULL, NULL)))
                        fail("submit", st, NULL);
                if ((st = kiln_stream_synchronize(stream)))
                    fail("warmup", st, NULL);
                cu_check(g_d->cuEventRecord(e0, cs), "cuEventRecord");
                for (long r = 0; r < rounds; r++)
                    if ((st = kiln_stream_submit(stream, cmds, (uint32_t)copies, NULL, NULL)))
                        fail("submit", st, NULL);
                cu_check(g_d->cuEventRecord(e1, cs), "cuEventRecord");
                cu_check(g_d->cuEventSynchronize(e1), "cuEventSynchronize");
                float ms = 0;
                cu_check(g_d->cuEventElapsedTime(&ms, e0, e1), "cuEventElapsedTime");
                if ((st = kiln_stream_synchronize(stream)))
                    fail("run", st, NULL);
                for (int k = 0; k < copies; k++)
                    kiln_command_release(cmds[k]);
                const double us = (double)ms * 1e3 / ((double)rounds * copies);
                if (c < 0)
                    own_us = us;
                else if (best < -1 || us < best_us)
                    best = c, best_us = us;
                bench_json j;
                bench_json_begin(&j, BENCH);
                bench_json_bool(&j, "peer", 0);
                bench_json_str(&j, "shape", sh->name);
                bench_json_int(&j, "tokens", tokens);
                bench_json_int(&j, "in", sh->in);
                bench_json_int(&j, "out", sh->out);
                bench_json_int(&j, "candidate", c);
                bench_json_num(&j, "us_per_call", us);
                bench_json_num(&j, "weight_gb_s", (double)wbytes / (us * 1e3));
                bench_json_str(&j, "config", config);
                bench_json_end(&j);
            }
            bench_json j;
            bench_json_begin(&j, BENCH);
            bench_json_bool(&j, "peer", 0);
            bench_json_str(&j, "phase", "best");
            bench_json_str(&j, "shape", sh->name);
            bench_json_int(&j, "tokens", tokens);
            bench_json_num(&j, "own_us", own_us);
            bench_json_int(&j, "best_candidate", best);
            bench_json_num(&j, "best_us", best_us);
            bench_json_num(&j, "own_over_best", best_us > 0 ? own_us / best_us : 0);
            bench_json_end(&j);
        }
        kiln_buffer_destroy(bw);
        kiln_buffer_destroy(bx);
        kiln_buffer_destroy(bo);
        kiln_buffer_destroy(bws);
    }
    g_d->cuEventDestroy(e0);
    g_d->cuEventDestroy(e1);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);
    return 0;
}
