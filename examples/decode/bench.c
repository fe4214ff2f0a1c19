/* The decode program's benchmarks, on a model of random f16 or bf16 weights
 * of a config's shapes (Llama-3-8B's by default): the decode step at each
 * context and batch size (--bench), and the prefill of each shape beside the
 * dense peak of the same element type measured in the same run
 * (--bench-prefill). JSON lines on stdout. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"

static uint16_t f2h(float f)
{
    /* Round to nearest even through the bits; values here are small and finite. */
    union { float f; uint32_t u; } x = {f};
    uint32_t sign = (x.u >> 16) & 0x8000, e = (x.u >> 23) & 0xff, m = x.u & 0x7fffff;
    int ee = (int)e - 127 + 15;
    if (ee >= 31)
        return (uint16_t)(sign | 0x7c00);
    if (ee <= 0) {
        if (ee < -10)
            return (uint16_t)sign;
        m |= 0x800000;
        uint32_t shift = (uint32_t)(14 - ee), half = m >> shift, rem = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = ((uint32_t)ee << 10) | (m >> 13), rem = m & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
        h++;
    return (uint16_t)(sign | h);
}

/* Round to nearest even; values here are small and finite. */
static uint16_t f2bf(float f)
{
    union { float f; uint32_t u; } x = {f};
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* 64 MiB of N(0, 0.02)-like halves (a sum of four uniforms), tiled into every
 * tensor: the torch peer of the decode step reads the same chunk. */
#define CHUNK_HALVES ((size_t)32 << 20)

static uint16_t *make_chunk(kiln_dtype dtype)
{
    uint16_t *chunk = malloc(CHUNK_HALVES * 2);
    if (!chunk)
        return NULL;
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < CHUNK_HALVES; i++) {
        float s = 0;
        for (int k = 0; k < 4; k++) {
            r ^= r >> 12;
            r ^= r << 25;
            r ^= r >> 27;
            s += (float)((r * 2685821657736338717ull) >> 40) / 16777216.0f - 0.5f;
        }
        const float v = s * 0.02f * 1.7320508f;
        chunk[i] = dtype == KILN_DTYPE_BF16 ? f2bf(v) : f2h(v);
    }
    return chunk;
}

/* The model's shape: the config file's, or Llama-3-8B's; then --layers. */
static int load_config(const dec_bench_args *a, dec_config *c)
{
    memset(c, 0, sizeof *c);
    if (a->config) {
        kiln_status st = dec_config_load(a->config, c);
        if (st) {
            dec_report(st);
            return 0;
        }
    } else {
        kiln_model_config_default(&c->base);
        snprintf(c->model_type, sizeof c->model_type, "llama");
        c->layers = 32;
    }
    if (a->layers)
        c->layers = a->layers;
    if (a->dtype)
        c->base.dtype = a->dtype;
    return 1;
}

/* Prints s as a JSON string (quotes, backslashes and control bytes escaped). */
static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        const unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

/* Median milliseconds of one device-to-device copy of bytes. */
static kiln_status copy_ms(dec_session *x, size_t bytes, double *ms)
{
    kiln_buffer *a = NULL, *b = NULL;
    kiln_command *cmd = NULL;
    double v[10] = {0};
    kiln_status st;
    if ((st = kiln_buffer_create(x->rt, bytes, 256, &a)) || (st = kiln_buffer_create(x->rt, bytes, 256, &b)) ||
        (st = kiln_buffer_fill(a, 0, 1, bytes)))
        goto out;
    kiln_region ra = {a, 0, bytes}, rb = {b, 0, bytes};
    if ((st = kiln_command_copy(x->rt, &ra, &rb, &cmd)))
        goto out;
    for (int i = 0; i < 13 && !st; i++) {
        kiln_submit_options so = {.size = sizeof so, .timing = KILN_TIMING_COMPLETION};
        kiln_fence *f;
        if ((st = kiln_stream_submit(x->s, &cmd, 1, &so, &f)))
            break;
        kiln_receipt r;
        if (!(st = kiln_fence_wait(f)) && !(st = kiln_fence_receipt(f, &r)) && i >= 3)
            v[i - 3] = r.elapsed_ms;
        kiln_fence_release(f);
    }
    for (int i = 0; i < 10; i++)
        for (int j = i + 1; j < 10; j++)
            if (v[j] < v[i]) {
                double t = v[i];
                v[i] = v[j];
                v[j] = t;
            }
    *ms = (v[4] + v[5]) / 2;
out:
    kiln_command_release(cmd);
    kiln_buffer_destroy(a);
    kiln_buffer_destroy(b);
    return st;
}

/* Without a driver: prints bench's "skipped" line and says so. */
static int skipped_without_driver(const char *bench)
{
    const char *why = NULL;
    if (kiln_driver_available(&why))
        return 0;
    char text[512];
    snprintf(text, sizeof text, "no driver: %s", why ? why : "?");
    printf("{\"bench\":\"%s\",\"skipped\":", bench);
    json_string(text);
    printf("}\n");
    return 1;
}

/* ---- the decode step ---- */

double dec_bench_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int dec_run_bench_startup(const dec_bench_args *a, double t_main)
{
    if (skipped_without_driver("startup"))
        return 0;
    dec_config c;
    if (!load_config(a, &c))
        return 1;
    /* The random weights are made on the host and put on the device: not counted. */
    const double t_config = dec_bench_now_s();
    uint16_t *chunk = make_chunk(c.base.dtype);
    if (!chunk)
        return 1;
    dec_session x;
    int rc = 1;
    dec_model *m = NULL;
    dec_engine *e = NULL;
    const double t_chunk = dec_bench_now_s();
    if (!dec_session_open(a->db, &x))
        goto out;
    const double t_session = dec_bench_now_s();
    kiln_status st;
    if ((st = dec_model_random(x.rt, x.s, &c, chunk, CHUNK_HALVES, &m)) || (st = kiln_stream_synchronize(x.s))) {
        dec_report(st);
        goto out;
    }
    const double t_weights = dec_bench_now_s();
    const uint32_t B = a->n_batches ? a->batches[0] : 1, context = a->n_contexts ? a->contexts[0] : 1024;
    dec_engine_options eo = {.max_participants = B, .max_prefill_tokens = B, .max_seq_tokens = context};
    if ((st = dec_engine_create(x.jit, x.s, m, &eo, &e))) {
        dec_report(st);
        goto out;
    }
    const double t_engine = dec_bench_now_s();
    double encode_ms = 0, step_ms = 0;
    if ((st = dec_bench_first_step(e, B, context, &encode_ms, &step_ms))) {
        dec_report(st);
        goto out;
    }
    kiln_jit_counters k;
    kiln_jit_get_counters(x.jit, &k);
    const double session_ms = (t_session - t_chunk) * 1e3, engine_ms = (t_engine - t_weights) * 1e3;
    const double before_ms = (t_config - t_main) * 1e3; /* main to the config read */
    const double after_ms = engine_ms + encode_ms + step_ms;
    printf("{\"bench\":\"startup\",\"model\":\"%s\",\"dtype\":\"%s\",\"layers\":%lld,\"batch\":%u,\"context\":%u,"
           "\"main_ms\":%.3f,\"session_ms\":%.3f,\"weights_ms\":%.3f,\"engine_ms\":%.3f,\"encode_ms\":%.3f,"
           "\"first_step_ms\":%.3f,\"after_weights_ms\":%.3f,\"to_first_step_ms\":%.3f,\"compiles\":%llu,"
           "\"database_hits\":%llu,\"memory_hits\":%llu,\"what\":\"after_weights_ms: the weights on the device to the "
           "first decode step done (engine, encode, first submission); to_first_step_ms: the same from main's start, "
           "the session (database, driver, runtime, jit) included, the host's random weights and their upload "
           "(weights_ms) not\"}\n",
           a->config ? "config" : "llama-3-8b", kiln_dtype_name(c.base.dtype), (long long)c.layers, B, context,
           before_ms, session_ms, (t_weights - t_session) * 1e3, engine_ms, encode_ms, step_ms, after_ms,
           before_ms + session_ms + after_ms, (unsigned long long)k.compiles,
           (unsigned long long)k.database_hits, (unsigned long long)k.memory_hits);
    fflush(stdout);
    rc = 0;
out:
    dec_engine_free(e);
    dec_model_free(m);
    dec_session_close(&x);
    free(chunk);
    return rc;
}

int dec_run_bench_decode(const dec_bench_args *a)
{
    if (skipped_without_driver("decode_step"))
        return 0;
    dec_config c;
    if (!load_config(a, &c))
        return 1;
    uint16_t *chunk = make_chunk(c.base.dtype);
    if (!chunk)
        return 1;
    if (a->chunk_file) {
        FILE *f = fopen(a->chunk_file, "wb");
        if (!f || fwrite(chunk, 2, CHUNK_HALVES, f) != CHUNK_HALVES || fclose(f) != 0) {
            fprintf(stderr, "decode: cannot write %s\n", a->chunk_file);
            free(chunk);
            return 1;
        }
    }
    dec_session x;
    int rc = 1;
    dec_model *m = NULL;
    uint32_t *distinct = NULL;
    if (!dec_session_open(a->db, &x))
        goto out;
    kiln_status st;
    if ((st = dec_model_random(x.rt, x.s, &c, chunk, CHUNK_HALVES, &m))) {
        dec_report(st);
        goto out;
    }
    const size_t copy_bytes = (size_t)1 << 30;
    double cms;
    if ((st = copy_ms(&x, copy_bytes, &cms))) {
        fprintf(stderr, "decode: copy bandwidth: %s: %s\n", kiln_status_code(st), kiln_errmsg());
        goto out;
    }
    const double bw = 2.0 * (double)copy_bytes / (cms * 1e-3); /* read + write bytes per second */
    printf("{\"bench\":\"d2d_copy\",\"bytes\":%zu,\"ms\":%.4f,\"gb_s\":%.1f}\n", copy_bytes, cms, bw / 1e9);
    fflush(stdout);
    const kiln_model_config *b = &c.base;
    const char *model = a->config ? "config" : "llama-3-8b";
    /* A mixture of experts: one expert's gate, up and down weights, and the
     * experts each layer's routing chose in the last step measured. */
    const int moe = b->num_experts > 0;
    const double expert_bytes = 3.0 * (double)b->moe_intermediate_size * (double)b->hidden_size * 2.0;
    if (moe && !(distinct = calloc((size_t)c.layers, sizeof *distinct))) {
        fprintf(stderr, "decode: out of memory\n");
        goto out;
    }
    for (size_t ci = 0; ci < a->n_contexts; ci++) {
        const uint32_t context = a->contexts[ci];
        for (size_t i = 0; i < a->n_batches; i++) {
            const uint32_t B = a->batches[i];
            dec_engine *e = NULL;
            dec_engine_options eo = {.max_participants = B, .max_prefill_tokens = B, .max_seq_tokens = context};
            kiln_jit_counters before, after;
            kiln_jit_get_counters(x.jit, &before);
            const double kv = (double)B * (double)c.layers * context * (double)b->num_key_value_heads *
                              (double)b->head_dim * 2.0 * 2.0;
            if ((st = dec_engine_create(x.jit, x.s, m, &eo, &e))) {
                if (st != KILN_ERR_CUDA_OUT_OF_MEMORY) {
                    dec_report(st);
                    goto out;
                }
                /* A long context at a large batch may not fit beside the weights: the sweep goes on. */
                printf("{\"bench\":\"decode_step\",\"impl\":\"kiln\",\"model\":\"%s\",\"layers\":%lld,\"batch\":%u,"
                       "\"context\":%u,\"kv_bytes\":%.0f,\"skipped\":",
                       model, (long long)c.layers, B, context, kv);
                json_string(dec_errmsg());
                printf("}\n");
                fflush(stdout);
                continue;
            }
            double dev = 0, wall = 0;
            uint64_t replayed = 0;
            st = dec_bench_steps(e, B, context, 5, (int)a->steps, &dev, &wall, &replayed);
            if (!st && moe)
                st = dec_bench_routing(e, B, context, distinct);
            if (!st)
                st = dec_bench_breakdown(e, B, context, stdout);
            dec_engine_free(e);
            if (st) {
                dec_report(st);
                goto out;
            }
            kiln_jit_get_counters(x.jit, &after);
            /* A mixture of experts' step reads only the experts its routing chose, layer by layer. */
            double read_bytes = (double)m->weight_bytes;
            uint32_t dmin = UINT32_MAX, dmax = 0;
            uint64_t dsum = 0;
            if (moe) {
                for (int64_t l = 0; l < c.layers; l++) {
                    dsum += distinct[l];
                    dmin = distinct[l] < dmin ? distinct[l] : dmin;
                    dmax = distinct[l] > dmax ? distinct[l] : dmax;
                }
                read_bytes += ((double)dsum - (double)c.layers * (double)b->num_experts) * expert_bytes;
            }
            const double floor_ms = (read_bytes + kv) / bw * 1e3;
            printf("{\"bench\":\"decode_step\",\"impl\":\"kiln\",\"model\":\"%s\",\"dtype\":\"%s\","
                   "\"layers\":%lld,\"batch\":%u,\"context\":%u,\"steps\":%u,\"device_ms\":%.4f,\"wall_ms\":%.4f,\"floor_ms\":%.4f,"
                   "\"device_over_floor\":%.3f,\"wall_over_floor\":%.3f,\"weight_bytes\":%llu,\"kv_bytes\":%.0f,"
                   "\"d2d_gb_s\":%.1f,\"replayed_commands\":%llu,\"compiles\":%llu",
                   model, kiln_dtype_name(b->dtype), (long long)c.layers, B, context, a->steps, dev, wall, floor_ms, dev / floor_ms,
                   wall / floor_ms, (unsigned long long)read_bytes, kv, bw / 1e9,
                   (unsigned long long)replayed, (unsigned long long)(after.compiles - before.compiles));
            if (moe) {
                const double E = (double)b->num_experts, K = (double)b->num_experts_per_tok;
                printf(",\"model_type\":");
                json_string(c.model_type);
                printf(",\"experts\":%lld,\"top_k\":%lld,\"distinct_experts\":%.2f,\"distinct_experts_min\":%u,"
                       "\"distinct_experts_max\":%u,\"expected_distinct_experts\":%.2f,\"floor_experts\":\"measured\","
                       "\"model_weight_bytes\":%llu",
                       (long long)b->num_experts, (long long)b->num_experts_per_tok, (double)dsum / (double)c.layers,
                       dmin, dmax, E * (1 - pow(1 - K / E, (double)B)), (unsigned long long)m->weight_bytes);
            }
            printf("}\n");
            fflush(stdout);
        }
    }
    rc = 0;
out:
    free(distinct);
    dec_model_free(m);
    dec_session_close(&x);
    free(chunk);
    return rc;
}

/* ---- the prefill ---- */

#define PEAK_N 8192             /* the peak's product: [N, N] by [N, N] */
#define PREFILL_WARMUP 2        /* untimed prefills per shape (the first captures the graph) */
#define PREFILL_BUDGET_MS 10000 /* past this much device time a shape stops at 3 timed prefills */

/* The dense peak: the median milliseconds of one product X[n, n] · W[n, n]ᵀ
 * through kiln_op_dense_linear, which at this size is one cuBLASLt call with
 * inputs and output of dtype and f32 accumulation (CUBLAS_COMPUTE_32F, as
 * torch's f16 and bf16 matmuls); eight products a submission, back to back as a
 * prefill runs its products, the inputs tiled from the random chunk. */
static kiln_status peak_ms(dec_session *x, const uint16_t *chunk, kiln_dtype dtype, int64_t n, double *ms)
{
    enum { PER = 8, WARM = 3, TIMED = 11 };
    const size_t bytes = (size_t)n * (size_t)n * 2;
    kiln_buffer *xb = NULL, *wb = NULL, *ob = NULL, *wsb = NULL;
    kiln_command *cmd[PER] = {0};
    double v[TIMED];
    size_t ws = 0;
    kiln_status st;
    if ((st = kiln_op_dense_linear_workspace(n, n, n, &ws)) || (st = kiln_buffer_create(x->rt, bytes, 256, &xb)) ||
        (st = kiln_buffer_create(x->rt, bytes, 256, &wb)) || (st = kiln_buffer_create(x->rt, bytes, 256, &ob)) ||
        (st = kiln_buffer_create(x->rt, ws ? ws : 256, 256, &wsb)))
        goto out;
    for (size_t at = 0; at < bytes && !st; at += CHUNK_HALVES * 2) {
        const size_t len = bytes - at < CHUNK_HALVES * 2 ? bytes - at : CHUNK_HALVES * 2;
        if (!(st = kiln_buffer_upload(xb, at, chunk, len)))
            st = kiln_buffer_upload(wb, at, chunk, len);
    }
    if (st || (st = kiln_runtime_synchronize(x->rt)))
        goto out;
    const kiln_tensor tx = {.buffer = xb, .dtype = dtype, .rank = 2, .dims = {n, n}},
                      tw = {.buffer = wb, .dtype = dtype, .rank = 2, .dims = {n, n}},
                      to = {.buffer = ob, .dtype = dtype, .rank = 2, .dims = {n, n}};
    const kiln_region wsr = {wsb, 0, kiln_buffer_size(wsb)};
    for (int i = 0; i < PER && !st; i++)
        st = kiln_op_dense_linear_encode(x->jit, &tx, &tw, NULL, &to, &wsr, &cmd[i]);
    for (int i = 0; i < WARM + TIMED && !st; i++) {
        kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_EAGER_ONLY, .timing = KILN_TIMING_COMPLETION};
        kiln_fence *f;
        if ((st = kiln_stream_submit(x->s, cmd, PER, &so, &f)))
            break;
        kiln_receipt r;
        if (!(st = kiln_fence_wait(f)) && !(st = kiln_fence_receipt(f, &r)) && i >= WARM)
            v[i - WARM] = r.elapsed_ms / PER;
        kiln_fence_release(f);
    }
    if (!st) {
        for (int i = 0; i < TIMED; i++)
            for (int j = i + 1; j < TIMED; j++)
                if (v[j] < v[i]) {
                    double t = v[i];
                    v[i] = v[j];
                    v[j] = t;
                }
        *ms = v[TIMED / 2];
    }
out:
    for (int i = 0; i < PER; i++)
        kiln_command_release(cmd[i]);
    kiln_buffer_destroy(xb);
    kiln_buffer_destroy(wb);
    kiln_buffer_destroy(ob);
    kiln_buffer_destroy(wsb);
    return st;
}

int dec_run_bench_prefill(const dec_bench_args *a)
{
    if (skipped_without_driver("prefill"))
        return 0;
    dec_config c;
    if (!load_config(a, &c))
        return 1;
    uint16_t *chunk = make_chunk(c.base.dtype);
    if (!chunk)
        return 1;
    dec_session x;
    int rc = 1;
    dec_model *m = NULL;
    if (!dec_session_open(a->db, &x))
        goto out;
    kiln_status st;
    double pms = 0;
    if ((st = peak_ms(&x, chunk, c.base.dtype, PEAK_N, &pms))) {
        fprintf(stderr, "decode: dense peak: %s: %s\n", kiln_status_code(st), kiln_errmsg());
        goto out;
    }
    if (!(pms > 0)) { /* a receipt without a time would make every rate below infinite, and no JSON */
        fprintf(stderr, "decode: dense peak: the device reported no time (%g ms)\n", pms);
        goto out;
    }
    const double peak = 2.0 * PEAK_N * PEAK_N * (double)PEAK_N / (pms * 1e-3); /* FLOP/s */
    printf("{\"bench\":\"dense_peak\",\"impl\":\"kiln\",\"op\":\"kiln_op_dense_linear\",\"m\":%d,\"n\":%d,\"k\":%d,"
           "\"dtype\":\"%s\",\"accumulate\":\"f32\",\"ms\":%.4f,\"tflop_s\":%.1f}\n",
           PEAK_N, PEAK_N, PEAK_N, kiln_dtype_name(c.base.dtype), pms, peak / 1e12);
    fflush(stdout);
    if ((st = dec_model_random(x.rt, x.s, &c, chunk, CHUNK_HALVES, &m))) {
        dec_report(st);
        goto out;
    }
    const char *model = a->config ? "config" : "llama-3-8b";
    for (size_t i = 0; i < a->n_shapes; i++) {
        const uint32_t S = a->shapes[i].seqs, N = a->shapes[i].tokens;
        dec_engine *e = NULL;
        dec_engine_options eo = {.max_participants = S, .max_prefill_tokens = S * N, .max_seq_tokens = N};
        kiln_jit_counters before, after;
        kiln_jit_get_counters(x.jit, &before);
        if ((st = dec_engine_create(x.jit, x.s, m, &eo, &e))) {
            if (st != KILN_ERR_CUDA_OUT_OF_MEMORY) {
                dec_report(st);
                goto out;
            }
            printf("{\"bench\":\"prefill\",\"impl\":\"kiln\",\"model\":\"%s\",\"layers\":%lld,\"shape\":\"%ux%u\","
                   "\"skipped\":",
                   model, (long long)c.layers, S, N);
            json_string(dec_errmsg());
            printf("}\n");
            fflush(stdout);
            continue;
        }
        dec_prefill_times t;
        st = dec_bench_prefill(e, S, N, PREFILL_WARMUP, (int)a->iters, PREFILL_BUDGET_MS, &t);
        kiln_jit_get_counters(x.jit, &after);
        if (!st && !(t.device_ms > 0)) {
            fprintf(stderr, "decode: prefill %ux%u: the device reported no time (%g ms)\n", S, N, t.device_ms);
            dec_engine_free(e);
            goto out;
        }
        if (!st) {
            const double flops = dec_prefill_flops(&c, NULL, S, N), achieved = flops / (t.device_ms * 1e-3);
            printf("{\"bench\":\"prefill\",\"impl\":\"kiln\",\"model\":\"%s\",\"dtype\":\"%s\",\"layers\":%lld,"
                   "\"shape\":\"%ux%u\",\"seqs\":%u,\"tokens_each\":%u,\"tokens\":%u,\"path\":\"%s\",\"warmup\":%d,\"iters\":%d,"
                   "\"time_ms\":%.4f,\"min_ms\":%.4f,\"wall_ms\":%.4f,\"tokens_per_s\":%.1f,\"model_tflop\":%.4f,"
                   "\"tflop_s\":%.1f,\"peak_tflop_s\":%.1f,\"mfu\":%.4f,\"commands\":%llu,"
                   "\"replayed_commands\":%llu,\"compiles\":%llu}\n",
                   model, kiln_dtype_name(c.base.dtype), (long long)c.layers, S, N, S, N, S * N,
                   t.replayed == t.commands ? "graph" : t.replayed ? "mixed" : "eager", PREFILL_WARMUP, t.iters,
                   t.device_ms, t.min_ms, t.wall_ms, (double)S * N / (t.device_ms * 1e-3), flops / 1e12,
                   achieved / 1e12, peak / 1e12, achieved / peak, (unsigned long long)t.commands,
                   (unsigned long long)t.replayed, (unsigned long long)(after.compiles - before.compiles));
            fflush(stdout);
            st = dec_bench_prefill_breakdown(e, stdout);
            fflush(stdout);
        }
        dec_engine_free(e);
        if (st) {
            dec_report(st);
            goto out;
        }
    }
    rc = 0;
out:
    dec_model_free(m);
    dec_session_close(&x);
    free(chunk);
    return rc;
}
