/* Dense operations: kiln's cuBLASLt-backed ops, timed with CUDA events on the
 * runtime's stream. Each shape's command is encoded once and submitted iters
 * times; one event pair around each submission (per_launch: median, p10,
 * p90) and one around all of them (back_to_back, divided by iters).
 *
 * Shapes (the targets first):
 *   lm_head       last_token_linear, 1 participant, 4096 -> 151936 (16-bit
 *                 weight 1.24 GB, far past L2): GB/s over weight + row + output bytes;
 *   linear        dense_linear, 2048 tokens, 4096 -> 28672: TFLOP/s (2·t·in·out);
 *   swiglu        dense_swiglu, 2048 tokens, 4096 -> 2 x 14336 (Llama-3-8B);
 *   lm_head_p64   last_token_linear, 64 participants, 4096 -> 128256.
 * peer_torch_dense.py measures the same with torch and compares (--kiln).
 *
 * --dtype f16|bf16 (default f16): the element type of activations and
 * weights; each JSON line carries it as "dtype".
 *
 * Usage: bench_dense [--iters 200] [--warmup 10] [--dtype f16|bf16]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "bench_cuda.h"
#include "kiln/kiln.h"
#include "runtime/internal.h"

#define BENCH "dense"
#define WARM_US 300000.0 /* the least warm-up per shape */

static const kiln__driver *g_d;

static void fail(const char *what, kiln_status st, const char *detail)
{
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "phase", what);
    bench_json_str(&j, "error", st ? kiln_status_code(st) : "bench");
    bench_json_str(&j, "message", detail && *detail ? detail : kiln_errmsg());
    bench_json_end(&j);
    exit(1);
}

static void cu_check(CUresult r, const char *what)
{
    if (r != CUDA_SUCCESS) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s: CUresult %d", what, (int)r);
        fail(what, KILN_ERR_CUDA_DRIVER, msg);
    }
}

static kiln_buffer *random_buffer(kiln_runtime *rt, size_t bytes, kiln_dtype elt)
{
    kiln_buffer *b;
    kiln_status st = kiln_buffer_create(rt, bytes, 256, &b);
    if (st)
        fail("setup", st, NULL);
    /* Small random values, 16 MiB repeated: f16 |v| < 2^-4; bf16 in [2^-7, 2^-3). */
    size_t chunk = bytes < ((size_t)16 << 20) ? bytes : (size_t)16 << 20;
    uint16_t *h = malloc(chunk);
    if (!h)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    uint64_t s = 0x9e3779b97f4a7c15ULL ^ bytes;
    for (size_t i = 0; i < chunk / 2; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        const uint16_t mag =
            elt == KILN_DTYPE_BF16 ? (uint16_t)(0x3c00u + (s & 0x01ffu)) : (uint16_t)(0x2000u + (s & 0x0fffu));
        h[i] = mag | (uint16_t)((s >> 20) & 0x8000u);
    }
    for (size_t off = 0; off < bytes; off += chunk)
        if ((st = kiln_buffer_upload(b, off, h, bytes - off < chunk ? bytes - off : chunk)))
            fail("setup", st, NULL);
    free(h);
    return b;
}

typedef struct shape {
    const char *name, *op;
    int64_t tokens, in, out, participants;
} shape;

static const shape g_shapes[] = {
    {"lm_head", "last_token_linear", 1, 4096, 151936, 1},
    {"linear", "dense_linear", 2048, 4096, 28672, 1},
    {"swiglu", "dense_swiglu", 2048, 4096, 14336, 1},
    {"lm_head_p64", "last_token_linear", 4096, 4096, 128256, 64},
};

int main(int argc, char **argv)
{
    long iters = 200, warmup = 10;
    kiln_dtype elt = KILN_DTYPE_F16;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc)
            warmup = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc && !strcmp(argv[i + 1], "f16"))
            elt = KILN_DTYPE_F16, i++;
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc && !strcmp(argv[i + 1], "bf16"))
            elt = KILN_DTYPE_BF16, i++;
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
    kiln_runtime *rt = NULL;
    kiln_jit *jit = NULL;
    if ((st = kiln_runtime_create(NULL, &rt)))
        fail("setup", st, NULL);
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    kiln_jit_options jo = {.size = sizeof jo, .runtime = rt};
    if ((st = kiln_jit_create(&jo, &jit)))
        fail("setup", st, NULL);
    g_d = kiln__driver_get(NULL);
    if ((st = kiln__runtime_enter(rt)))
        fail("setup", st, NULL);
    kiln_stream *stream = kiln_runtime_stream(rt);
    CUstream cs = (CUstream)kiln_stream_handle(stream);
    CUevent *ev = calloc((size_t)iters * 2 + 2, sizeof *ev);
    double *per = calloc((size_t)iters, sizeof *per);
    if (!ev || !per)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (long i = 0; i < iters * 2 + 2; i++)
        cu_check(g_d->cuEventCreate(&ev[i], CU_EVENT_DEFAULT), "cuEventCreate");

    for (size_t s = 0; s < sizeof g_shapes / sizeof g_shapes[0]; s++) {
        const shape *sh = &g_shapes[s];
        const int swiglu = !strcmp(sh->op, "dense_swiglu"), last = !strcmp(sh->op, "last_token_linear");
        const int64_t wrows = swiglu ? 2 * sh->out : sh->out, orows = last ? sh->participants : sh->tokens;
        kiln_buffer *bw = random_buffer(rt, (size_t)wrows * sh->in * 2, elt);
        kiln_buffer *bx = random_buffer(rt, (size_t)sh->tokens * sh->in * 2, elt);
        kiln_buffer *bo = NULL, *bws = NULL, *bs = NULL;
        size_t ws;
        if (swiglu)
            st = kiln_op_dense_swiglu_workspace(sh->tokens, sh->in, sh->out, &ws);
        else if (last)
            st = kiln_op_last_token_linear_workspace(sh->participants, sh->in, sh->out, &ws);
        else
            st = kiln_op_dense_linear_workspace(sh->tokens, sh->in, sh->out, &ws);
        if (st || (st = kiln_buffer_create(rt, (size_t)orows * sh->out * 2, 256, &bo)) ||
            (st = kiln_buffer_create(rt, ws, 256, &bws)) || (st = kiln_buffer_create(rt, 8 * 4096, 256, &bs)))
            fail("setup", st, NULL);
        uint32_t spans[2 * 64];
        for (int64_t p = 0; p < sh->participants; p++) {
            int64_t len = sh->tokens / sh->participants;
            spans[2 * p] = (uint32_t)(p * len);
            spans[2 * p + 1] = (uint32_t)len;
        }
        if ((st = kiln_buffer_upload(bs, 0, spans, (size_t)sh->participants * 8)))
            fail("setup", st, NULL);
        kiln_tensor x = {.buffer = bx, .dtype = elt, .rank = 2, .dims = {sh->tokens, sh->in}};
        kiln_tensor w = {.buffer = bw, .dtype = elt, .rank = 2, .dims = {wrows, sh->in}};
        kiln_tensor o = {.buffer = bo, .dtype = elt, .rank = 2, .dims = {orows, sh->out}};
        kiln_tensor sp = {.buffer = bs, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {sh->participants, 2}};
        kiln_region wsr = {bws, 0, ws};
        kiln_command *cmd = NULL;
        if (swiglu)
            st = kiln_op_dense_swiglu_encode(jit, &x, &w, &o, &wsr, &cmd);
        else if (last)
            st = kiln_op_last_token_linear_encode(jit, &x, &sp, &w, NULL, &o, &wsr, &cmd);
        else
            st = kiln_op_dense_linear_encode(jit, &x, &w, NULL, &o, &wsr, &cmd);
        if (st)
            fail("encode", st, NULL);
#define SUBMIT()                                                                                                   \
    do {                                                                                                           \
        if ((st = kiln_stream_submit(stream, &cmd, 1, NULL, NULL)))                                                \
            fail("submit", st, NULL);                                                                              \
    } while (0)
        /* Warm-up: at least warmup submissions and WARM_US of them (clocks
         * settle), as the peer does. */
        for (double t0 = bench_now_us(), n = 0; n < warmup || bench_now_us() - t0 < WARM_US; n++) {
            SUBMIT();
            if ((long)n % 8 == 7 && (st = kiln_stream_synchronize(stream)))
                fail("warmup", st, NULL);
        }
        if ((st = kiln_stream_synchronize(stream)))
            fail("warmup", st, NULL);
        for (long i = 0; i < iters; i++) {
            cu_check(g_d->cuEventRecord(ev[2 * i], cs), "cuEventRecord");
            SUBMIT();
            cu_check(g_d->cuEventRecord(ev[2 * i + 1], cs), "cuEventRecord");
        }
        cu_check(g_d->cuEventSynchronize(ev[2 * iters - 1]), "cuEventSynchronize");
        for (long i = 0; i < iters; i++) {
            float ms = 0;
            cu_check(g_d->cuEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cuEventElapsedTime");
            per[i] = (double)ms * 1e3;
        }
        cu_check(g_d->cuEventRecord(ev[2 * iters], cs), "cuEventRecord");
        for (long i = 0; i < iters; i++)
            SUBMIT();
        cu_check(g_d->cuEventRecord(ev[2 * iters + 1], cs), "cuEventRecord");
        cu_check(g_d->cuEventSynchronize(ev[2 * iters + 1]), "cuEventSynchronize");
        float b2b_ms = 0;
        cu_check(g_d->cuEventElapsedTime(&b2b_ms, ev[2 * iters], ev[2 * iters + 1]), "cuEventElapsedTime");
        if ((st = kiln_stream_synchronize(stream)))
            fail("run", st, NULL);
        const double b2b_us = (double)b2b_ms * 1e3 / (double)iters;
        bench_sort(per, (size_t)iters);
        const double med = bench_quantile(per, (size_t)iters, 0.5);
        const double rows = (double)(last ? sh->participants : sh->tokens);
        const double flop = 2.0 * rows * (double)sh->in * (double)wrows;
        const double bytes = (double)wrows * sh->in * 2 + rows * sh->in * 2 + rows * sh->out * 2 +
                             (swiglu ? rows * (double)wrows * 2 * 2 : 0);
        bench_json j;
        bench_json_begin(&j, BENCH);
        bench_json_bool(&j, "peer", 0);
        bench_json_str(&j, "shape", sh->name);
        bench_json_str(&j, "op", sh->op);
        bench_json_str(&j, "dtype", kiln_dtype_name(elt));
        bench_json_int(&j, "tokens", sh->tokens);
        bench_json_int(&j, "participants", sh->participants);
        bench_json_int(&j, "in", sh->in);
        bench_json_int(&j, "out", sh->out);
        bench_json_int(&j, "iters", iters);
        bench_json_num(&j, "per_launch_median_us", med);
        bench_json_num(&j, "per_launch_p10_us", bench_quantile(per, (size_t)iters, 0.1));
        bench_json_num(&j, "per_launch_p90_us", bench_quantile(per, (size_t)iters, 0.9));
        bench_json_num(&j, "back_to_back_avg_us", b2b_us);
        bench_json_num(&j, "bytes", bytes);
        bench_json_num(&j, "flop", flop);
        bench_json_num(&j, "per_launch_gbps", bytes / (med * 1e3));
        bench_json_num(&j, "per_launch_tflops", flop / (med * 1e6));
        bench_json_num(&j, "back_to_back_gbps", bytes / (b2b_us * 1e3));
        bench_json_num(&j, "back_to_back_tflops", flop / (b2b_us * 1e6));
        bench_json_str(&j, "device", info.name);
        bench_json_end(&j);
        kiln_command_release(cmd);
        kiln_buffer_destroy(bw);
        kiln_buffer_destroy(bx);
        kiln_buffer_destroy(bo);
        kiln_buffer_destroy(bws);
        kiln_buffer_destroy(bs);
    }
    for (long i = 0; i < iters * 2 + 2; i++)
        g_d->cuEventDestroy(ev[i]);
    free(ev);
    free(per);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);
    return 0;
}
