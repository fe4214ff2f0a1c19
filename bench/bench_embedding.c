/* Token embedding bandwidth: kiln_op_token_embedding on an f16 (or, with
 * --dtype bf16, bf16) table of vocab x hidden and random u32 ids, timed with CUDA events on the runtime's
 * stream (the driver reached through kiln's driver table).
 *
 * Two timings per shape and mode:
 *   per_launch: an event pair around each launch; median, p10, p90;
 *   back_to_back: one kiln submission of iters pre-encoded launches, timed by
 *   its fence (KILN_TIMING_COMPLETION), divided by iters.
 * Bytes moved per launch: tokens*hidden*2 read + tokens*hidden*2 written +
 * tokens*4 of ids.
 *
 * Two modes:
 *   hot: the same ids and output every launch (the gathered rows and the
 *        output may stay in the 50 MB L2 between launches);
 *   rotated: launches cycle through up to 16 distinct id sets and output
 *        regions (about 256 MiB of output in all), so that L2 cannot hold
 *        the previous launch's data; closer to HBM bandwidth.
 *
 * Every line names the element type ("dtype"), so that an f16 and a bf16
 * run can be put side by side.
 *
 * Usage: bench_embedding [--iters 200] [--warmup 20] [--vocab 128256] [--dtype f16|bf16]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "bench_cuda.h"
#include "kiln/kiln.h"
#include "runtime/internal.h"

#define BENCH "embedding"
#define TARGET_TBPS 3.8
#define MAX_SETS 16
#define ROTATE_BYTES ((size_t)256 << 20)
#define HOST_CHUNK ((size_t)32 << 20) /* random bytes repeated over the table */

typedef struct shape {
    int64_t tokens, hidden;
} shape;

static const shape g_shapes[] = {
    {2048, 4096}, /* the target shape, first */
    {2048, 896},  {2048, 5120}, {1, 4096}, {7, 4096}, {70000, 4096},
};
#define N_SHAPES (sizeof g_shapes / sizeof g_shapes[0])

static const kiln__driver *g_d;

static void fail(const char *what, kiln_status st, const char *detail)
{
    bench_json_error(BENCH, what, st ? kiln_status_code(st) : "bench", detail, kiln_errmsg());
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

static uint64_t g_rng = 0x9e3779b97f4a7c15ULL;
static uint64_t rng_next(void) { return bench_xorshift64(&g_rng); }

static size_t sets_for(const shape *s, int rotated)
{
    if (!rotated)
        return 1;
    size_t out_bytes = (size_t)s->tokens * (size_t)s->hidden * 2;
    size_t sets = (ROTATE_BYTES + out_bytes - 1) / out_bytes;
    return sets < 1 ? 1 : sets > MAX_SETS ? MAX_SETS : sets;
}

int main(int argc, char **argv)
{
    long iters = 200, warmup = 20, vocab = 128256;
    kiln_dtype elt = KILN_DTYPE_F16;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc)
            warmup = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--vocab") && i + 1 < argc)
            vocab = bench_parse_positive(argv[++i]);
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc && !strcmp(argv[i + 1], "f16"))
            elt = KILN_DTYPE_F16, i++;
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc && !strcmp(argv[i + 1], "bf16"))
            elt = KILN_DTYPE_BF16, i++;
        else
            iters = 0;
        if (iters < 1 || warmup < 1 || vocab < 1 || iters > 100000 || vocab > KILN_MODEL_MAX_VOCAB) {
            fprintf(stderr, "usage: %s [--iters N] [--warmup N] [--vocab N] [--dtype f16|bf16]\n", argv[0]);
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
    kiln_runtime_options ro = {.size = sizeof ro, .device_ordinal = 0};
    if ((st = kiln_runtime_create(&ro, &rt)))
        fail("setup", st, NULL);
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    kiln_jit *jit = NULL;
    kiln_jit_options jo = {.size = sizeof jo, .runtime = rt}; /* no cache: nothing persists */
    if ((st = kiln_jit_create(&jo, &jit)))
        fail("setup", st, NULL);
    g_d = kiln__driver_get(NULL);
    if ((st = kiln__runtime_enter(rt)))
        fail("setup", st, NULL);
    CUstream stream = (CUstream)kiln_stream_handle(kiln_runtime_stream(rt));

    /* Sizes: one table for the widest row, one ids and one out buffer for the largest need. */
    int64_t max_hidden = 0;
    size_t max_out = 0, max_ids = 0;
    for (size_t s = 0; s < N_SHAPES; s++) {
        const shape *sh = &g_shapes[s];
        if (sh->hidden > max_hidden)
            max_hidden = sh->hidden;
        for (int rot = 0; rot < 2; rot++) {
            size_t sets = sets_for(sh, rot);
            size_t o = sets * (size_t)sh->tokens * (size_t)sh->hidden * 2, d = sets * (size_t)sh->tokens * 4;
            if (o > max_out)
                max_out = o;
            if (d > max_ids)
                max_ids = d;
        }
    }
    size_t table_bytes = (size_t)vocab * (size_t)max_hidden * 2;
    kiln_buffer *table_buf = NULL, *ids_buf = NULL, *out_buf = NULL;
    if ((st = kiln_buffer_create(rt, table_bytes, 0, &table_buf)) || (st = kiln_buffer_create(rt, max_ids, 0, &ids_buf)) ||
        (st = kiln_buffer_create(rt, max_out, 0, &out_buf)))
        fail("setup", st, NULL);

    /* The table: random bits (NaNs included: a gather moves bits, it does no
     * arithmetic), HOST_CHUNK random bytes repeated; byte b holds chunk[b % HOST_CHUNK]. */
    unsigned char *chunk = malloc(HOST_CHUNK);
    uint32_t *ids_host = malloc(max_ids);
    if (!chunk || !ids_host)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (size_t i = 0; i < HOST_CHUNK; i += 8) {
        uint64_t r = rng_next();
        memcpy(chunk + i, &r, 8);
    }
    for (size_t off = 0; off < table_bytes; off += HOST_CHUNK) {
        size_t len = table_bytes - off < HOST_CHUNK ? table_bytes - off : HOST_CHUNK;
        if ((st = kiln_buffer_upload(table_buf, off, chunk, len)))
            fail("setup", st, NULL);
    }
    for (size_t i = 0; i < max_ids / 4; i++)
        ids_host[i] = (uint32_t)(rng_next() % (uint64_t)vocab);
    if ((st = kiln_buffer_upload(ids_buf, 0, ids_host, max_ids)))
        fail("setup", st, NULL);

    CUevent *ev = calloc((size_t)iters * 2 + 2, sizeof *ev);
    double *per = calloc((size_t)iters, sizeof *per);
    uint16_t *row = malloc((size_t)max_hidden * 2);
    if (!ev || !per || !row)
        fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (long i = 0; i < iters * 2 + 2; i++)
        cu_check(g_d->cuEventCreate(&ev[i], CU_EVENT_DEFAULT), "cuEventCreate");

    double target_hot = 0, target_rot = 0, target_b2b_hot = 0, target_b2b_rot = 0;
    int all_verified = 1;
    for (size_t s = 0; s < N_SHAPES; s++) {
        const shape *sh = &g_shapes[s];
        const size_t row_bytes = (size_t)sh->hidden * 2;
        const size_t out_set_bytes = (size_t)sh->tokens * row_bytes, ids_set_bytes = (size_t)sh->tokens * 4;
        const double bytes = (double)sh->tokens * (double)sh->hidden * 2.0 * 2.0 + (double)sh->tokens * 4.0;
        for (int rot = 0; rot < 2; rot++) {
            const size_t sets = sets_for(sh, rot);
            kiln_tensor table = {.buffer = table_buf, .dtype = elt, .rank = 2, .dims = {vocab, sh->hidden}};
            kiln_tensor ids[MAX_SETS], out[MAX_SETS];
            for (size_t k = 0; k < sets; k++) {
                ids[k] = (kiln_tensor){.buffer = ids_buf, .offset = k * ids_set_bytes, .dtype = KILN_DTYPE_U32,
                                       .rank = 1, .dims = {sh->tokens}};
                out[k] = (kiln_tensor){.buffer = out_buf, .offset = k * out_set_bytes, .dtype = elt,
                                       .rank = 2, .dims = {sh->tokens, sh->hidden}};
            }
#define LAUNCH(i)                                                                                                   \
    do {                                                                                                            \
        size_t k_ = (size_t)(i) % sets;                                                                             \
        if ((st = kiln_op_token_embedding(jit, &table, &ids[k_], &out[k_])))                                        \
            fail("launch", st, NULL);                                                                               \
    } while (0)
            /* Warm-up: compiles the specialization on its first use, touches every set. */
            for (long i = 0; i < warmup + (long)sets; i++)
                LAUNCH(i);
            if ((st = kiln_runtime_synchronize(rt)))
                fail("warmup", st, NULL);

            /* Per launch: an event pair around each one. */
            for (long i = 0; i < iters; i++) {
                cu_check(g_d->cuEventRecord(ev[2 * i], stream), "cuEventRecord");
                LAUNCH(i);
                cu_check(g_d->cuEventRecord(ev[2 * i + 1], stream), "cuEventRecord");
            }
            cu_check(g_d->cuEventSynchronize(ev[2 * iters - 1]), "cuEventSynchronize");
            for (long i = 0; i < iters; i++) {
                float ms = 0;
                cu_check(g_d->cuEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cuEventElapsedTime");
                per[i] = (double)ms * 1e3;
            }

            /* Back to back: the commands encoded once, then one submission
             * of iters of them, timed by the device (the fence's receipt):
             * the GPU time per launch without the host's encode in the way. */
            kiln_command *set_cmds[MAX_SETS];
            for (size_t k = 0; k < sets; k++)
                if ((st = kiln_op_token_embedding_encode(jit, &table, &ids[k], &out[k], &set_cmds[k])))
                    fail("encode", st, NULL);
            kiln_command **batch = malloc((size_t)iters * sizeof *batch);
            if (!batch)
                fail("setup", KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
            for (long i = 0; i < iters; i++)
                batch[i] = set_cmds[(size_t)i % sets];
            kiln_submit_options bo = {.timing = KILN_TIMING_COMPLETION};
            kiln_fence *fence = NULL;
            kiln_receipt receipt;
            if ((st = kiln_stream_submit(kiln_runtime_stream(rt), batch, (size_t)iters, &bo, &fence)) ||
                (st = kiln_fence_wait(fence)) || (st = kiln_fence_receipt(fence, &receipt)))
                fail("back to back", st, NULL);
            double b2b_us = receipt.elapsed_ms * 1e3 / (double)iters;
            kiln_fence_release(fence);
            free(batch);
            for (size_t k = 0; k < sets; k++)
                kiln_command_release(set_cmds[k]);
            if ((st = kiln_runtime_synchronize(rt)))
                fail("timed launches", st, NULL);

            /* Check a few rows of set 0 against the host's copy of the table. */
            LAUNCH(0);
            int verified = 1;
            const int64_t probe[3] = {0, sh->tokens / 2, sh->tokens - 1};
            for (int p = 0; p < 3; p++) {
                int64_t tk = probe[p];
                if ((st = kiln_buffer_readback(out_buf, out[0].offset + (size_t)tk * row_bytes, row, row_bytes)))
                    fail("verify", st, NULL);
                size_t base = (size_t)ids_host[tk] * row_bytes; /* set 0 ids start at element 0 */
                for (size_t b = 0; b < row_bytes && verified; b++)
                    if (((const unsigned char *)row)[b] != chunk[(base + b) % HOST_CHUNK])
                        verified = 0;
            }
            all_verified &= verified;
#undef LAUNCH

            bench_sort(per, (size_t)iters);
            double med = bench_quantile(per, (size_t)iters, 0.5);
            bench_json j;
            bench_json_begin(&j, BENCH);
            bench_json_bool(&j, "peer", 0);
            bench_json_str(&j, "mode", rot ? "rotated" : "hot");
            bench_json_int(&j, "tokens", sh->tokens);
            bench_json_int(&j, "hidden", sh->hidden);
            bench_json_int(&j, "vocab", vocab);
            bench_json_str(&j, "dtype", kiln_dtype_name(elt));
            bench_json_int(&j, "iters", iters);
            bench_json_int(&j, "sets", (long long)sets);
            bench_json_int(&j, "bytes", (long long)bytes);
            bench_json_num(&j, "per_launch_median_us", med);
            bench_json_num(&j, "per_launch_p10_us", bench_quantile(per, (size_t)iters, 0.1));
            bench_json_num(&j, "per_launch_p90_us", bench_quantile(per, (size_t)iters, 0.9));
            bench_json_num(&j, "per_launch_min_us", per[0]);
            bench_json_num(&j, "back_to_back_avg_us", b2b_us);
            bench_json_num(&j, "per_launch_gbps", bytes / (med * 1e3));
            bench_json_num(&j, "per_launch_tbps", bytes / (med * 1e6));
            bench_json_num(&j, "back_to_back_gbps", bytes / (b2b_us * 1e3));
            bench_json_num(&j, "back_to_back_tbps", bytes / (b2b_us * 1e6));
            bench_json_bool(&j, "verified", verified);
            bench_json_str(&j, "device", info.name);
            bench_json_end(&j);
            if (s == 0) {
                if (rot) {
                    target_rot = bytes / (med * 1e6);
                    target_b2b_rot = bytes / (b2b_us * 1e6);
                } else {
                    target_hot = bytes / (med * 1e6);
                    target_b2b_hot = bytes / (b2b_us * 1e6);
                }
            }
        }
    }

    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "dtype", kiln_dtype_name(elt));
    bench_json_str(&j, "phase", "target");
    bench_json_int(&j, "tokens", g_shapes[0].tokens);
    bench_json_int(&j, "hidden", g_shapes[0].hidden);
    bench_json_num(&j, "target_tbps", TARGET_TBPS);
    bench_json_num(&j, "per_launch_tbps_hot", target_hot);
    bench_json_num(&j, "per_launch_tbps_rotated", target_rot);
    bench_json_num(&j, "back_to_back_tbps_hot", target_b2b_hot);
    bench_json_num(&j, "back_to_back_tbps_rotated", target_b2b_rot);
    bench_json_bool(&j, "meets_target", target_hot >= TARGET_TBPS);
    bench_json_bool(&j, "meets_target_rotated", target_rot >= TARGET_TBPS);
    bench_json_bool(&j, "all_verified", all_verified);
    bench_json_end(&j);

    for (long i = 0; i < iters * 2 + 2; i++)
        g_d->cuEventDestroy(ev[i]);
    free(ev);
    free(per);
    free(row);
    free(chunk);
    free(ids_host);
    kiln_buffer_destroy(out_buf);
    kiln_buffer_destroy(ids_buf);
    kiln_buffer_destroy(table_buf);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);
    return all_verified ? 0 : 1;
}
