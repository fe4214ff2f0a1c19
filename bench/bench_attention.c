/* Causal paged attention (RoPE, append, attention; one command: one
 * dispatch for decode, two for prefill): GPU time through kiln with CUDA events, back to back over
 * iters submissions of the pre-encoded command, divided by iters (median of
 * 5 such runs). Shapes: Llama-3-8B heads (32 q, 8 kv, head_dim 128) and
 * Qwen2.5-7B heads (28 q, 4 kv, 128); decode of 1, 8, 32 and 64 sequences
 * at context 1024 and 4096 split as kiln picks (split-KV over a cluster),
 * and at 1024 unsplit (split target 1: one block per sequence, kv head and
 * row tile) (reported: KV bytes read per second: 2 * seqs * context *
 * kv_heads * head_dim * 2), prefill of 512 and 4096 tokens of one sequence and
 * 4 x 1024 packed (reported: attention TFLOP/s, 4 * heads * head_dim * causal
 * pairs). --sweep: Llama decode at 1, 8 and 32 sequences, context 1024, for
 * several split targets (blocks a split decode aims at; kiln's is the
 * SMs: 132 on an H200). --prefill: prefill alone at Llama-3-8B's heads with
 * head_dim 128, 64 and 256: 1 x 512, 1 x 4096, 4 x 1024, 1 x 16384 tokens, 512
 * new tokens after 3584 cached (chunked prefill), each through the kernel
 * kiln picks ("kernel":"picked": wgmma on sm_90), the mma.sync one (head_dim 64
 * and 128) and the CUDA-core one ("kernel":"cuda_core"); bench/peer_torch_sdpa.py times torch's
 * scaled_dot_product_attention at the same shapes.
 *
 * --only S,CTX,N: that prefill shape alone (for a profiler). --head-dim D:
 * prefill at that head_dim alone; --kernel picked|mma|cuda_core: that prefill
 * kernel alone (both to spend less GPU time on an A/B of one kernel). --dtype bf16:
 * q, k, v, the KV pages and out in bf16 (default f16; reported as "dtype").
 * --pages runs: each sequence's pages one run of the arena (a fresh
 * allocator's), rather than the sequences' pages interleaved (reported as
 * "pages"). --prefill-blocks N: the wgmma prefill's grid at most N blocks
 * (default: the SMs, each block taking work items until they run out; a
 * large N: a block an item; reported as "prefill_blocks" when given).
 *
 * Usage: bench_attention [--iters 50] [--dtype f16|bf16] [--pages interleaved|runs]
 *                        [--prefill-blocks N]
 *                        [--sweep | --prefill [--only S,CTX,N] [--head-dim D] [--kernel K]]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "kiln/kiln.h"
#include "providers/internal.h"
#include "runtime/internal.h"

#define BENCH "attention"

static const kiln__driver *g_d;
static kiln_runtime *g_rt;
static kiln_jit *g_jit;
static kiln_runtime_info g_info;

static void fail(const char *what, kiln_status st, const char *detail)
{
    bench_json_error(BENCH, what, st ? kiln_status_code(st) : "bench", detail, kiln_errmsg());
    exit(1);
}

static void ck(kiln_status st, const char *what)
{
    if (st)
        fail(what, st, NULL);
}

static kiln_buffer *buf(size_t bytes)
{
    kiln_buffer *b;
    ck(kiln_buffer_create(g_rt, bytes, 256, &b), "alloc");
    return b;
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ULL;
static kiln_dtype g_elt = KILN_DTYPE_F16; /* --dtype */
static int g_runs;                        /* --pages runs */

static void fill_random(kiln_buffer *b, size_t bytes)
{
    size_t n = bytes / 2;
    uint16_t *h = malloc(n * 2);
    if (!h)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (size_t i = 0; i < n; i++) {
        g_rng ^= g_rng << 13;
        g_rng ^= g_rng >> 7;
        g_rng ^= g_rng << 17;
        /* |x| in [2^-6, 1), in the element type's encoding. */
        h[i] = g_elt == KILN_DTYPE_BF16
                   ? (uint16_t)(((g_rng >> 20) & 0x8000) | ((121 + (g_rng >> 40) % 6) << 7) | (g_rng & 127))
                   : (uint16_t)(((g_rng >> 20) & 0x8000) | ((9 + (g_rng >> 40) % 6) << 10) | (g_rng & 1023));
    }
    ck(kiln_buffer_upload(b, 0, h, n * 2), "upload");
    free(h);
}

/* One case: S sequences, each with ctx cached tokens before and count new ones. */
static long g_prefill_blocks; /* --prefill-blocks; 0: not given */
static const char *g_kernel; /* prefill: "picked" or "cuda_core"; NULL: not reported */

static void run_case(const char *phase, int64_t H, int64_t KVH, int64_t D, uint32_t S, uint32_t ctx, uint32_t count,
                     long iters, int split, uint32_t target)
{
    uint32_t pt;
    ck(kiln_op_paged_attention_page_tokens(D, KVH, &pt), "page_tokens");
    const uint32_t T = S * count, L = ctx + count, blocks = (L + pt - 1) / pt, pages = S * blocks;
    kiln_buffer *bq = buf((size_t)T * H * D * 2), *bk = buf((size_t)T * KVH * D * 2), *bv = buf((size_t)T * KVH * D * 2),
                *bo = buf((size_t)T * H * D * 2), *bi = buf(((size_t)T + (size_t)S * blocks + 3 * (size_t)S) * 4),
                *bp = buf((size_t)pages * KILN_PAGED_KV_PAGE_BYTES);
    fill_random(bq, (size_t)T * H * D * 2);
    fill_random(bk, (size_t)T * KVH * D * 2);
    fill_random(bv, (size_t)T * KVH * D * 2);
    fill_random(bp, (size_t)pages * KILN_PAGED_KV_PAGE_BYTES);
    uint32_t *ints = malloc(((size_t)T + (size_t)S * blocks + 3 * (size_t)S) * 4);
    uint32_t *pos = ints, *table = pos + T, *lens = table + (size_t)S * blocks, *spans = lens + S;
    for (uint32_t s = 0; s < S; s++) {
        for (uint32_t j = 0; j < count; j++)
            pos[s * count + j] = ctx + j;
        for (uint32_t b = 0; b < blocks; b++)
            table[(size_t)s * blocks + b] =
                (uint32_t)((g_runs ? (uint64_t)s * blocks + b : (uint64_t)b * S + s) % pages);
        lens[s] = L;
        spans[2 * s] = s * count;
        spans[2 * s + 1] = count;
    }
    ck(kiln_buffer_upload(bi, 0, ints, ((size_t)T + (size_t)S * blocks + 3 * (size_t)S) * 4), "upload");
    free(ints);
    kiln_tensor tq = {.buffer = bq, .dtype = g_elt, .rank = 3, .dims = {T, H, D}},
                to = {.buffer = bo, .dtype = g_elt, .rank = 3, .dims = {T, H, D}},
                tk = {.buffer = bk, .dtype = g_elt, .rank = 3, .dims = {T, KVH, D}},
                tv = {.buffer = bv, .dtype = g_elt, .rank = 3, .dims = {T, KVH, D}},
                tp = {.buffer = bi, .offset = 0, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {T}},
                tt = {.buffer = bi, .offset = (size_t)T * 4, .dtype = KILN_DTYPE_U32, .rank = 2, .dims = {S, blocks}},
                tl = {.buffer = bi, .offset = ((size_t)T + (size_t)S * blocks) * 4, .dtype = KILN_DTYPE_U32,
                      .rank = 1, .dims = {S}},
                ts = {.buffer = bi, .offset = ((size_t)T + (size_t)S * blocks + S) * 4, .dtype = KILN_DTYPE_U32,
                      .rank = 2, .dims = {S, 2}};
    kiln_region pr = {bp, 0, (size_t)pages * KILN_PAGED_KV_PAGE_BYTES};
    kiln__paged_attention_set_split_target(split ? target : 1);
    size_t ws_bytes = 0;
    ck(kiln_op_paged_attention_workspace(S, H, KVH, D, count == 1 ? 1 : T, &ws_bytes), "workspace");
    kiln_buffer *bw = buf(ws_bytes ? ws_bytes : 256);
    kiln_region wr = {bw, 0, ws_bytes ? ws_bytes : 256};
    kiln_paged_attention_desc d = {.size = sizeof d, .q = &tq, .k = &tk, .v = &tv, .positions = &tp,
                                   .block_table = &tt, .seq_lens = &tl, .query_spans = &ts, .out = &to,
                                   .kv_pages = &pr, .rope_theta = 500000.0f, .max_query_tokens = count,
                                   .workspace = split ? &wr : NULL};
    kiln_command *cmd;
    ck(kiln_op_paged_attention_encode(g_jit, &d, &cmd), "encode");
    /* iters copies of the command in one submission on a stream of its own:
     * captured into one graph the first time, replayed after (what a decode
     * step does), so the host's submission cost is not what is timed. */
    kiln_stream *s;
    ck(kiln_stream_create(g_rt, &s), "stream");
    kiln_command **cmds = malloc((size_t)iters * sizeof *cmds);
    if (!cmds)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (long i = 0; i < iters; i++)
        cmds[i] = cmd;
    CUstream cs = (CUstream)kiln_stream_handle(s);
    CUevent e0, e1;
    g_d->cuEventCreate(&e0, CU_EVENT_DEFAULT);
    g_d->cuEventCreate(&e1, CU_EVENT_DEFAULT);
    for (int i = 0; i < 3; i++) {
        ck(kiln_stream_submit(s, cmds, (size_t)iters, NULL, NULL), "warmup");
        ck(kiln_stream_synchronize(s), "warmup");
    }
    double runs[5];
    for (int r = 0; r < 5; r++) {
        g_d->cuEventRecord(e0, cs);
        ck(kiln_stream_submit(s, cmds, (size_t)iters, NULL, NULL), "launch");
        g_d->cuEventRecord(e1, cs);
        ck(kiln_stream_synchronize(s), "launch");
        float ms = 0;
        g_d->cuEventElapsedTime(&ms, e0, e1);
        runs[r] = (double)ms * 1e3 / (double)iters;
    }
    kiln_graph_stats gs;
    kiln_stream_graph_stats(s, &gs);
    free(cmds);
    kiln_stream_destroy(s);
    bench_sort(runs, 5);
    const double us = runs[2];
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "phase", phase);
    bench_json_str(&j, "dtype", g_elt == KILN_DTYPE_BF16 ? "bf16" : "f16");
    bench_json_str(&j, "pages", g_runs ? "runs" : "interleaved");
    bench_json_int(&j, "heads", H);
    bench_json_int(&j, "kv_heads", KVH);
    bench_json_int(&j, "head_dim", D);
    bench_json_int(&j, "seqs", S);
    bench_json_int(&j, "context", ctx);
    bench_json_int(&j, "new_tokens", count);
    if (g_kernel)
        bench_json_str(&j, "kernel", g_kernel);
    if (g_prefill_blocks && count > 1)
        bench_json_int(&j, "prefill_blocks", g_prefill_blocks);
    if (count == 1) {
        bench_json_bool(&j, "split", split);
        bench_json_int(&j, "split_target", split ? target : 1);
        bench_json_int(&j, "workspace_bytes", split ? (long long)ws_bytes : 0);
    }
    bench_json_num(&j, "median_us", us);
    bench_json_bool(&j, "replayed", gs.hits >= 5);
    if (count == 1) {
        const double kv = 2.0 * S * (double)L * (double)KVH * (double)D * 2;
        bench_json_num(&j, "kv_gbps", kv / (us * 1e3));
    } else {
        const double pairs = (double)S * ((double)count * ctx + (double)count * (count + 1) / 2);
        bench_json_num(&j, "tflops", 4.0 * pairs * (double)H * (double)D / (us * 1e6));
    }
    bench_json_str(&j, "device", g_info.name);
    bench_json_end(&j);
    g_d->cuEventDestroy(e0);
    g_d->cuEventDestroy(e1);
    kiln_command_release(cmd);
    kiln__paged_attention_set_split_target(0);
    kiln_buffer *all[7] = {bq, bk, bv, bo, bi, bp, bw};
    for (int i = 0; i < 7; i++)
        kiln_buffer_destroy(all[i]);
}

static int kernel_index(const char *const *names, int n, const char *s)
{
    for (int k = 0; k < n; k++)
        if (!strcmp(names[k], s))
            return k;
    return -1;
}

int main(int argc, char **argv)
{
    long iters = 50;
    int sweep = 0, prefill = 0;
    unsigned only[3] = {0, 0, 0};
    long only_dim = 0;
    int only_kernel = -1;
    /* In the order of KILN__PREFILL_* (0: picked). */
    static const char *const kernels[] = {"picked", "mma", "cuda_core"};
    enum { N_KERNELS = sizeof kernels / sizeof kernels[0] };
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sweep"))
            sweep = 1;
        else if (!strcmp(argv[i], "--prefill"))
            prefill = 1;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc &&
                 sscanf(argv[i + 1], "%u,%u,%u", &only[0], &only[1], &only[2]) == 3)
            i++;
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc && bench_parse_positive(argv[i + 1]))
            iters = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "f16") || !strcmp(argv[i + 1], "bf16")))
            g_elt = !strcmp(argv[++i], "bf16") ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
        else if (!strcmp(argv[i], "--pages") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "interleaved") || !strcmp(argv[i + 1], "runs")))
            g_runs = !strcmp(argv[++i], "runs");
        else if (!strcmp(argv[i], "--prefill-blocks") && i + 1 < argc && bench_parse_positive(argv[i + 1]))
            g_prefill_blocks = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--head-dim") && i + 1 < argc &&
                 (bench_parse_positive(argv[i + 1]) == 64 || bench_parse_positive(argv[i + 1]) == 128 ||
                  bench_parse_positive(argv[i + 1]) == 256))
            only_dim = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--kernel") && i + 1 < argc && kernel_index(kernels, N_KERNELS, argv[i + 1]) >= 0)
            only_kernel = kernel_index(kernels, N_KERNELS, argv[++i]);
        else {
            fprintf(stderr, "bench_attention: unknown argument %s\nusage: bench_attention [--iters N] "
                            "[--dtype f16|bf16] [--pages interleaved|runs] [--prefill-blocks N] "
                            "[--sweep | --prefill [--only S,CTX,N] [--head-dim 64|128|256] "
                            "[--kernel picked|mma|cuda_core]]\n",
                    argv[i]);
            return 2;
        }
    }
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        bench_json j;
        bench_json_begin(&j, BENCH);
        bench_json_str(&j, "skipped", why ? why : "no driver");
        bench_json_end(&j);
        return 0;
    }
    g_d = kiln__driver_get(NULL);
    ck(kiln_runtime_create(NULL, &g_rt), "runtime");
    kiln_runtime_get_info(g_rt, &g_info);
    kiln_jit_options jo = {.runtime = g_rt};
    ck(kiln_jit_create(&jo, &g_jit), "jit");
    kiln__paged_attention_set_prefill_blocks(g_prefill_blocks > UINT32_MAX ? UINT32_MAX : (uint32_t)g_prefill_blocks);
    if (prefill) {
        static const struct { uint32_t S, ctx, count; } shapes[] = {
            {1, 0, 512}, {1, 0, 4096}, {4, 0, 1024}, {1, 0, 16384}, {1, 3584, 512}};
        static const int64_t dims[] = {128, 64, 256};
        for (int k = 0; k < N_KERNELS; k++) {
            if (only_kernel >= 0 && k != only_kernel)
                continue;
            g_kernel = kernels[k];
            kiln__paged_attention_set_prefill_kernel(k);
            for (int d = 0; d < 3; d++)
                for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
                    if ((k == KILN__PREFILL_MMA && dims[d] == 256) /* mma.sync takes head_dim 64 and 128 */ ||
                        (only_dim && dims[d] != only_dim))
                        continue;
                    if (only[0] && (only[0] != shapes[i].S || only[1] != shapes[i].ctx || only[2] != shapes[i].count))
                        continue;
                    const double work = (double)shapes[i].S * shapes[i].count * (shapes[i].ctx + shapes[i].count);
                    const long n = (long)(iters * 4e6 / work) + 1; /* about the same time a shape */
                    /* The CUDA-core kernel is slow at 16384: fewer runs. */
                    run_case("prefill", 32, 8, dims[d], shapes[i].S, shapes[i].ctx, shapes[i].count,
                             k == 2 && n > 3 ? 3 : n, 0, 0);
                }
        }
        kiln__paged_attention_set_prefill_kernel(0);
    } else if (sweep) {
        static const uint32_t targets[] = {132, 264, 528, 1056, 2112}, seqs[] = {1, 8, 32};
        for (int n = 0; n < 3; n++)
            for (int t = 0; t < 5; t++)
                run_case("decode", 32, 8, 128, seqs[n], 1023, 1, iters, 1, targets[t]);
    } else {
        static const struct { int64_t H, KVH; } heads[] = {{32, 8}, {28, 4}};
        for (int h = 0; h < 2; h++) {
            static const uint32_t seqs[] = {1, 8, 32, 64}, ctxs[] = {1024, 4096};
            for (int c = 0; c < 2; c++)
                for (int n = 0; n < 4; n++)
                    run_case("decode", heads[h].H, heads[h].KVH, 128, seqs[n], ctxs[c] - 1, 1, iters, 1, 0);
            for (int n = 0; n < 4; n++)
                run_case("decode", heads[h].H, heads[h].KVH, 128, seqs[n], 1023, 1, iters, 0, 0);
            run_case("prefill", heads[h].H, heads[h].KVH, 128, 1, 0, 512, iters / 5 + 1, 0, 0);
            run_case("prefill", heads[h].H, heads[h].KVH, 128, 1, 0, 4096, iters / 10 + 1, 0, 0);
            run_case("prefill", heads[h].H, heads[h].KVH, 128, 4, 0, 1024, iters / 10 + 1, 0, 0);
        }
    }
    kiln_jit_destroy(g_jit);
    kiln_runtime_destroy(g_rt);
    return 0;
}
