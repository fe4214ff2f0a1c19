/* Gated delta recurrent attention at Qwen3-Next-80B-A3B's shapes (16 key
 * heads, 32 value heads, dims 128): GPU time per call through kiln, from one
 * submission of iters pre-encoded commands timed by its fence
 * (KILN_TIMING_COMPLETION), the median of reps such submissions.
 *   decode: S sequences of one token (the sequential scan); the state
 *           (S x 32 x 128 x 128 f32) is read and written once per call:
 *           state_tbps counts those bytes;
 *   prefill: S sequences of L tokens each, the chunked kernel (the encode's
 *           choice) and the scan (max_span_tokens 1): tokens_per_s.
 * "kernel" names the kernel the encode took ("chunk32"/"chunk64": the chunked
 * kernel with that many rows of the state a block). Each chunked prefill
 * shape runs three times ("form"): "single", no workspace (the single
 * chunked kernel); "keyed", a workspace bound, $KILN_GATED_DELTA_PREP=1
 * and $KILN_GATED_DELTA_ROWS=0 (the pre-pass and the keyed kernel, timed
 * together); "rows", the same with $KILN_GATED_DELTA_ROWS=1 (the pre-pass
 * and the rows kernel). Each form runs with the f32 operands of the chained
 * products in two f16 terms ("terms" 2, $KILN_GATED_DELTA_TERMS=2), then
 * in one (the default). "streamed": the rows kernel ran beside the
 * pre-pass (one sequence on sm_90; $KILN_GATED_DELTA_STREAM=0 for a run
 * without). The single form
 * against the keyed ones at each
 * shape is what sets KILN_GATED_DELTA_PREP_MIN_TOKENS; the rows kernel
 * against the keyed one, where the encode takes the rows kernel. The peer is
 * bench/peer_fla_gated_delta.py (fla's chunk_gated_delta_rule) at the same
 * prefill shapes. --dtype picks the element type of q, k, v and out (f16 or
 * bf16; the state, g and beta are f32 either way), named in each line.
 *
 * --only S,L: the shapes of S sequences of L tokens alone (for a profiler:
 * e.g. --only 1,16384, the chunked kernel at one long sequence). --form
 * single|keyed|rows and --terms 1|2: the chunked shapes' runs of that form
 * or that many terms alone (the scan's shapes run either way).
 *
 * Usage: bench_recurrent [--iters 20] [--reps 5] [--dtype f16|bf16] [--only S,L]
 *                        [--form single|keyed|rows] [--terms 1|2]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "kiln/kiln.h"
#include "providers/internal.h"

#define BENCH "recurrent"
#define KH 16
#define VH 32
#define DK 128
#define DV 128

typedef struct shape {
    const char *phase;
    int64_t seqs, span;
    uint32_t max_span; /* the bindings' max_span_tokens: 1 keeps the scan */
} shape;

static const shape g_shapes[] = {
    {"decode", 1, 1, 1},        {"decode", 8, 1, 1},       {"decode", 64, 1, 1},     {"decode", 256, 1, 1},
    {"prefill", 1, 4096, 0},    {"prefill", 4, 1024, 0},   {"prefill", 16, 256, 0},  {"prefill", 1, 16384, 0},
    {"prefill", 1, 4096, 1},    {"prefill", 4, 1024, 1},   {"prefill", 16, 256, 1},
};

static void fail(const char *what, kiln_status st)
{
    bench_json_error(BENCH, what, kiln_status_code(st), NULL, kiln_errmsg());
    exit(1);
}

#define CHECK(what, call)                                                                                         \
    do {                                                                                                          \
        kiln_status st_ = (call);                                                                                 \
        if (st_)                                                                                                  \
            fail(what, st_);                                                                                      \
    } while (0)

static kiln_buffer *filled(kiln_runtime *rt, size_t bytes, uint8_t value)
{
    kiln_buffer *b;
    CHECK("setup", kiln_buffer_create(rt, bytes, 256, &b));
    CHECK("setup", kiln_buffer_fill(b, 0, value, bytes));
    return b;
}

int main(int argc, char **argv)
{
    long iters = 20, reps = 5;
    kiln_dtype elt = KILN_DTYPE_F16;
    int bad = 0;
    long only_s = 0, only_l = 0;
    int only_form = -1, only_terms = 0; /* -1, 0: every form, both term counts */
    static const char *const form_names[] = {"single", "keyed", "rows"};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--iters"))
            iters = bench_parse_positive(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps"))
            reps = bench_parse_positive(argv[i + 1]);
        else if (!strcmp(argv[i], "--dtype") && !strcmp(argv[i + 1], "f16"))
            elt = KILN_DTYPE_F16;
        else if (!strcmp(argv[i], "--dtype") && !strcmp(argv[i + 1], "bf16"))
            elt = KILN_DTYPE_BF16;
        else if (!strcmp(argv[i], "--only")) {
            char tail;
            if (sscanf(argv[i + 1], "%ld,%ld%c", &only_s, &only_l, &tail) != 2 || only_s <= 0 || only_l <= 0)
                bad = 1;
        } else if (!strcmp(argv[i], "--form")) {
            only_form = -2;
            for (int f = 0; f < 3; f++)
                if (!strcmp(argv[i + 1], form_names[f]))
                    only_form = f;
            bad |= only_form < 0;
        } else if (!strcmp(argv[i], "--terms")) {
            only_terms = !strcmp(argv[i + 1], "1") ? 1 : !strcmp(argv[i + 1], "2") ? 2 : -1;
            bad |= only_terms < 0;
        } else
            bad = 1;
    }
    if (iters <= 0 || reps <= 0 || bad || argc % 2 == 0) {
        fprintf(stderr, "usage: bench_recurrent [--iters N] [--reps N] [--dtype f16|bf16] [--only S,L] "
                        "[--form single|keyed|rows] [--terms 1|2]\n");
        return 2;
    }
    /* q, k, v filled with one byte: about 1.06, 0.9 and 1.06 in f16; 0.75 in bf16. */
    const int bf16 = elt == KILN_DTYPE_BF16;
    const uint8_t fq = bf16 ? 0x3f : 0x3c, fk = bf16 ? 0x3f : 0x3b, fv = bf16 ? 0x3f : 0x3c;
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        bench_json j;
        bench_json_begin(&j, BENCH);
        bench_json_str(&j, "skipped", why ? why : "no driver");
        bench_json_end(&j);
        return 0;
    }
    kiln_runtime *rt;
    kiln_jit *jit;
    kiln_stream *s;
    CHECK("setup", kiln_runtime_create(NULL, &rt));
    kiln_jit_options jo = {.runtime = rt};
    CHECK("setup", kiln_jit_create(&jo, &jit));
    CHECK("setup", kiln_stream_create(rt, &s));
    kiln_command **cmds = calloc((size_t)iters, sizeof *cmds);
    double *us = calloc((size_t)reps, sizeof *us);
    if (!cmds || !us)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY);
    for (size_t i = 0; i < sizeof g_shapes / sizeof g_shapes[0]; i++) {
        const shape *sh = &g_shapes[i];
        if (only_s && (sh->seqs != only_s || sh->span != only_l))
            continue;
        const int64_t S = sh->seqs, T = S * sh->span;
        size_t state_bytes;
        CHECK("setup", kiln_op_gated_delta_state_bytes(S, VH, DV, DK, &state_bytes));
        /* g 0 (no decay); beta about 0.19; state zeros. */
        kiln_buffer *bq = filled(rt, (size_t)T * KH * DK * 2, fq), *bk = filled(rt, (size_t)T * KH * DK * 2, fk),
                    *bv = filled(rt, (size_t)T * VH * DV * 2, fv), *bg = filled(rt, (size_t)T * VH * 4, 0),
                    *bb = filled(rt, (size_t)T * VH * 4, 0x3e), *bs = filled(rt, state_bytes, 0),
                    *bo = filled(rt, (size_t)T * VH * DV * 2, 0), *bsp;
        CHECK("setup", kiln_buffer_create(rt, (size_t)S * 8, 256, &bsp));
        uint32_t *spans = malloc((size_t)S * 8);
        if (!spans)
            fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY);
        for (int64_t p = 0; p < S; p++) {
            spans[2 * p] = (uint32_t)(p * sh->span);
            spans[2 * p + 1] = (uint32_t)sh->span;
        }
        CHECK("setup", kiln_buffer_upload(bsp, 0, spans, (size_t)S * 8));
        free(spans);
        kiln_tensor tq = {.buffer = bq, .dtype = elt, .rank = 3, .dims = {T, KH, DK}}, tk = tq,
                    tv = {.buffer = bv, .dtype = elt, .rank = 3, .dims = {T, VH, DV}}, to = tv,
                    tg = {.buffer = bg, .dtype = KILN_DTYPE_F32, .rank = 2, .dims = {T, VH}}, tb = tg,
                    ts = {.buffer = bs, .dtype = KILN_DTYPE_F32, .rank = 4, .dims = {S, VH, DV, DK}},
                    tsp = {.buffer = bsp, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {S, 2}};
        tk.buffer = bk;
        to.buffer = bo;
        tb.buffer = bb;
        /* The keyed form (a workspace bound) beside the single kernel at the
         * chunked shapes, each in two terms and in one. */
        const int forms = sh->max_span == 1 ? 1 : 3, runs = sh->max_span == 1 ? 1 : 2 * forms;
        kiln_buffer *bw = NULL;
        size_t ws_bytes = 0;
        if (forms > 1) {
            CHECK("setup", kiln_op_gated_delta_workspace(elt, T, S, VH, &ws_bytes));
            bw = filled(rt, ws_bytes, 0);
        }
        const kiln_region ws = {bw, 0, ws_bytes};
        for (int run = 0; run < runs; run++) {
            const int form = run % forms, keyed = form > 0, run_terms = run >= forms ? 1 : 2;
            if (forms > 1 && ((only_form >= 0 && form != only_form) || (only_terms && run_terms != only_terms)))
                continue;
            kiln_gated_delta_bindings b = {sizeof b, &tq, &tk, &tv, &tg, &tb, &ts, &tsp, &to, sh->max_span,
                                           keyed ? &ws : NULL};
            kiln_command *cmd;
            setenv("KILN_GATED_DELTA_PREP", keyed ? "1" : "0", 1);
            setenv("KILN_GATED_DELTA_ROWS", form == 2 ? "1" : "0", 1);
            setenv("KILN_GATED_DELTA_TERMS", run_terms == 1 ? "1" : "2", 1);
            const kiln_status est = kiln_op_gated_delta_encode(jit, &b, &cmd);
            unsetenv("KILN_GATED_DELTA_PREP");
            unsetenv("KILN_GATED_DELTA_ROWS");
            unsetenv("KILN_GATED_DELTA_TERMS");
            CHECK("encode", est);
            const int rows = kiln__gated_delta_last_rows(), took = kiln__gated_delta_last_keyed(),
                      terms = kiln__gated_delta_last_terms();
            for (long k = 0; k < iters; k++)
                cmds[k] = cmd;
            kiln_submit_options so = {.timing = KILN_TIMING_COMPLETION, .path = KILN_PATH_EAGER_ONLY};
            for (long r = -1; r < reps; r++) { /* r = -1: warm-up */
                kiln_fence *fence;
                kiln_receipt receipt;
                CHECK("launch", kiln_stream_submit(s, cmds, (size_t)iters, &so, &fence));
                CHECK("launch", kiln_fence_wait(fence));
                CHECK("launch", kiln_fence_receipt(fence, &receipt));
                kiln_fence_release(fence);
                if (r >= 0)
                    us[r] = receipt.elapsed_ms * 1e3 / (double)iters;
            }
            bench_sort(us, (size_t)reps);
            const double med = bench_quantile(us, (size_t)reps, 0.5);
            bench_json j;
            bench_json_begin(&j, BENCH);
            bench_json_bool(&j, "peer", 0);
            bench_json_str(&j, "phase", sh->phase);
            bench_json_str(&j, "dtype", kiln_dtype_name(elt));
            bench_json_str(&j, "kernel", rows == 64 ? "chunk64" : rows == 32 ? "chunk32" : "scan");
            bench_json_bool(&j, "keyed", took > 0);
            bench_json_str(&j, "form", took == 2 ? "rows" : took == 1 ? "keyed" : "single");
            bench_json_int(&j, "terms", terms);
            bench_json_bool(&j, "streamed", kiln__gated_delta_last_streamed());
            bench_json_int(&j, "seqs", S);
            bench_json_int(&j, "span", sh->span);
            bench_json_int(&j, "dk", DK);
            bench_json_int(&j, "dv", DV);
            bench_json_int(&j, "key_heads", KH);
            bench_json_int(&j, "value_heads", VH);
            bench_json_int(&j, "iters", iters);
            bench_json_num(&j, "median_us", med);
            bench_json_num(&j, "min_us", us[0]);
            bench_json_num(&j, "state_tbps", 2.0 * (double)state_bytes / (med * 1e-6) / 1e12);
            bench_json_num(&j, "tokens_per_s", (double)T / (med * 1e-6));
            bench_json_int(&j, "workspace_bytes", keyed ? (int64_t)ws_bytes : 0);
            bench_json_end(&j);
            kiln_command_release(cmd);
        }
        kiln_buffer_destroy(bw);
        kiln_buffer_destroy(bq);
        kiln_buffer_destroy(bk);
        kiln_buffer_destroy(bv);
        kiln_buffer_destroy(bg);
        kiln_buffer_destroy(bb);
        kiln_buffer_destroy(bs);
        kiln_buffer_destroy(bo);
        kiln_buffer_destroy(bsp);
    }
    free(cmds);
    free(us);
    kiln_stream_destroy(s);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);
    return 0;
}
