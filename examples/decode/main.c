/* decode: greedy decoding of a Llama / Qwen2 checkpoint on kiln, or the
 * decode-step benchmark of a model of random weights (--bench).
 *
 *   decode --model DIR --prompt 1,2,3[:MAX_NEW] [--prompt ...] [--max-new N]
 *          [--eos ID|none] [--db PATH] [--dump-logits FILE]
 *   decode --bench [--config config.json] [--layers N] [--batch 1,8,32]
 *          [--context 1024] [--steps N] [--chunk-file FILE] [--db PATH]
 *
 * Output: JSON lines on stdout. Generation prints one line per prompt (the
 * generated token ids and why it stopped) and a summary (prefill and decode
 * tokens/s, compiles and cache hits, replayed and eager commands). The bench
 * prints the measured device-to-device copy bandwidth, then one line per
 * batch size: the decode step's latency and its floor (the weight bytes plus
 * the KV bytes a step reads, over that bandwidth).
 * --dump-logits writes, per participant and step, a record: u32 participant,
 * u32 step, u32 vocab, then vocab f32 logits (little-endian). Exit codes: 0
 * ok, 1 failure, 2 usage.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decoder.h"

#define MAX_PROMPTS 256

static int usage(const char *msg)
{
    if (msg)
        fprintf(stderr, "decode: %s\n", msg);
    fprintf(stderr,
            "usage: decode --model DIR --prompt IDS[:MAX_NEW] [--prompt ...] [--max-new N] [--eos ID|none]\n"
            "              [--db PATH] [--dump-logits FILE]\n"
            "       decode --bench [--config config.json] [--layers N] [--batch 1,8,32] [--context 1024]\n"
            "              [--steps N] [--chunk-file FILE] [--db PATH]\n");
    return 2;
}

static float h2f(uint16_t h)
{
    uint32_t e = (h >> 10) & 31, m = h & 1023;
    float v = e ? ldexpf((float)(m | 1024), (int)e - 25) : ldexpf((float)m, -24);
    if (e == 31)
        v = m ? NAN : INFINITY;
    return (h & 0x8000) ? -v : v;
}

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

static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v < lo || v > hi)
        return 0;
    *out = (uint32_t)v;
    return 1;
}

typedef struct prompt {
    uint32_t *ids;
    uint32_t n, max_new; /* max_new 0: --max-new */
} prompt;

/* "1,2,3" or "1,2,3:40". */
static int parse_prompt(const char *text, prompt *p)
{
    char *copy = strdup(text), *colon = strchr(copy, ':');
    p->max_new = 0;
    if (colon) {
        *colon = 0;
        if (!parse_u32(colon + 1, 1, 1u << 20, &p->max_new)) {
            free(copy);
            return 0;
        }
    }
    size_t cap = 1;
    for (const char *c = copy; *c; c++)
        cap += *c == ',';
    p->ids = calloc(cap, sizeof *p->ids);
    p->n = 0;
    int ok = p->ids != NULL;
    for (char *tok = strtok(copy, ","); ok && tok; tok = strtok(NULL, ","))
        ok = parse_u32(tok, 0, UINT32_MAX - 1, &p->ids[p->n++]);
    free(copy);
    return ok && p->n > 0;
}

typedef struct dump {
    FILE *f;
    int failed;
} dump;

static void dump_logits(void *user, uint32_t participant, uint32_t step, const uint16_t *logits, size_t vocab)
{
    dump *d = user;
    uint32_t head[3] = {participant, step, (uint32_t)vocab};
    float row[4096];
    if (fwrite(head, 4, 3, d->f) != 3)
        d->failed = 1;
    for (size_t i = 0; i < vocab; i += 4096) {
        size_t n = vocab - i < 4096 ? vocab - i : 4096;
        for (size_t j = 0; j < n; j++)
            row[j] = h2f(logits[i + j]);
        if (fwrite(row, 4, n, d->f) != n)
            d->failed = 1;
    }
}

typedef struct session {
    kiln_cache *cache;
    kiln_runtime *rt;
    kiln_jit *jit;
    kiln_stream *s;
} session;

static int open_session(const char *db, session *x)
{
    memset(x, 0, sizeof *x);
    kiln_cache_options co = {.path = db};
    kiln_status st;
    if ((st = kiln_cache_open(db ? &co : NULL, &x->cache))) {
        fprintf(stderr, "decode: cache: %s: %s\n", kiln_status_code(st), kiln_errmsg());
        return 0;
    }
    if ((st = kiln_runtime_create(NULL, &x->rt))) {
        fprintf(stderr, "decode: runtime: %s: %s\n", kiln_status_code(st), kiln_errmsg());
        return 0;
    }
    kiln_jit_options jo = {.cache = x->cache, .runtime = x->rt};
    if ((st = kiln_jit_create(&jo, &x->jit)) || (st = kiln_stream_create(x->rt, &x->s))) {
        fprintf(stderr, "decode: jit or stream: %s: %s\n", kiln_status_code(st), kiln_errmsg());
        return 0;
    }
    return 1;
}

static void close_session(session *x)
{
    kiln_stream_destroy(x->s);
    kiln_jit_destroy(x->jit);
    kiln_runtime_destroy(x->rt);
    kiln_cache_close(x->cache);
}

static int fail(kiln_status st)
{
    fprintf(stderr, "decode: %s: %s\n", kiln_status_code(st), dec_errmsg());
    return 1;
}

/* ---- generation ---- */

static int run_generate(const char *dir, prompt *prompts, size_t n, uint32_t max_new, const int64_t *eos_override,
                        int eos_given, const char *db, const char *dump_path)
{
    dec_checkpoint ck;
    kiln_status st = dec_checkpoint_open(dir, &ck);
    if (st)
        return fail(st);
    session x;
    int rc = 1;
    dec_model *m = NULL;
    dec_engine *e = NULL;
    dec_request reqs[MAX_PROMPTS];
    dec_result res[MAX_PROMPTS];
    memset(res, 0, sizeof res);
    dump d = {0};
    if (!open_session(db, &x))
        goto out;
    if ((st = dec_model_load(x.rt, &ck, &m))) {
        fail(st);
        goto out;
    }
    uint32_t total = 0, longest = 0;
    for (size_t i = 0; i < n; i++) {
        reqs[i] = (dec_request){prompts[i].ids, prompts[i].n, prompts[i].max_new ? prompts[i].max_new : max_new};
        res[i].tokens = calloc(reqs[i].max_new, sizeof *res[i].tokens);
        total += prompts[i].n;
        if (prompts[i].n + reqs[i].max_new > longest)
            longest = prompts[i].n + reqs[i].max_new;
    }
    dec_engine_options eo = {.max_participants = (uint32_t)n, .max_prefill_tokens = total, .max_seq_tokens = longest};
    if ((st = dec_engine_create(x.jit, x.s, m, &eo, &e))) {
        fail(st);
        goto out;
    }
    if (dump_path && !(d.f = fopen(dump_path, "wb"))) {
        fprintf(stderr, "decode: %s: %s\n", dump_path, strerror(errno));
        goto out;
    }
    const int64_t *eos = eos_given ? eos_override : m->config.eos;
    size_t n_eos = eos_given ? (eos_override ? 1 : 0) : m->config.n_eos;
    dec_stats stats;
    if ((st = dec_generate(e, reqs, n, eos, n_eos, d.f ? dump_logits : NULL, &d, res, &stats))) {
        fail(st);
        goto out;
    }
    if (d.f && (fclose(d.f) != 0 || d.failed)) {
        d.f = NULL;
        fprintf(stderr, "decode: writing %s failed\n", dump_path);
        goto out;
    }
    d.f = NULL;
    for (size_t i = 0; i < n; i++) {
        printf("{\"participant\":%zu,\"prompt_tokens\":%u,\"max_new\":%u,\"stop\":\"%s\",\"tokens\":[", i,
               reqs[i].prompt_len, reqs[i].max_new, res[i].stopped_at_eos ? "eos" : "limit");
        for (uint32_t t = 0; t < res[i].n; t++)
            printf("%s%u", t ? "," : "", res[i].tokens[t]);
        printf("]}\n");
    }
    kiln_jit_counters jc;
    kiln_jit_get_counters(x.jit, &jc);
    printf("{\"summary\":\"%s\",\"layers\":%lld,\"participants\":%zu,\"prefill_tokens\":%llu,\"prefill_s\":%.6f,"
           "\"prefill_tok_s\":%.1f,\"decode_steps\":%llu,\"decode_tokens\":%llu,\"decode_s\":%.6f,"
           "\"decode_tok_s\":%.1f,\"encode_s\":%.6f,\"compiles\":%llu,\"database_hits\":%llu,\"memory_hits\":%llu,"
           "\"replayed_commands\":%llu,\"eager_commands\":%llu,\"weights_bytes\":%llu}\n",
           m->config.model_type, (long long)m->config.layers, n, (unsigned long long)stats.prefill_tokens,
           stats.prefill_s, stats.prefill_s > 0 ? (double)stats.prefill_tokens / stats.prefill_s : 0.0,
           (unsigned long long)stats.decode_steps, (unsigned long long)stats.decode_tokens, stats.decode_s,
           stats.decode_s > 0 ? (double)stats.decode_tokens / stats.decode_s : 0.0, stats.encode_s,
           (unsigned long long)jc.compiles, (unsigned long long)jc.database_hits, (unsigned long long)jc.memory_hits,
           (unsigned long long)stats.replayed_commands, (unsigned long long)stats.eager_commands,
           (unsigned long long)m->uploaded_bytes);
    rc = 0;
out:
    if (d.f)
        fclose(d.f);
    for (size_t i = 0; i < n; i++)
        free(res[i].tokens);
    dec_engine_free(e);
    dec_model_free(m);
    close_session(&x);
    dec_checkpoint_close(&ck);
    return rc;
}

/* ---- the benchmark ---- */

/* Median milliseconds of one device-to-device copy of bytes. */
static kiln_status copy_ms(session *x, size_t bytes, double *ms)
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

static int run_bench(const char *config_path, int64_t layers, const uint32_t *batches, size_t n_batches,
                     uint32_t context, int steps, const char *chunk_path, const char *db)
{
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        printf("{\"bench\":\"decode_step\",\"skipped\":\"no driver: %s\"}\n", why ? why : "?");
        return 0;
    }
    dec_config c;
    memset(&c, 0, sizeof c);
    if (config_path) {
        kiln_status st = dec_config_load(config_path, &c);
        if (st)
            return fail(st);
    } else {
        kiln_model_config_default(&c.base);
        snprintf(c.model_type, sizeof c.model_type, "llama");
        c.layers = 32;
    }
    if (layers)
        c.layers = layers;
    /* 64 MiB of N(0, 0.02)-like halves (a sum of four uniforms), tiled into every tensor. */
    const size_t halves = (size_t)32 << 20;
    uint16_t *chunk = malloc(halves * 2);
    if (!chunk)
        return 1;
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < halves; i++) {
        float s = 0;
        for (int k = 0; k < 4; k++) {
            r ^= r >> 12;
            r ^= r << 25;
            r ^= r >> 27;
            s += (float)((r * 2685821657736338717ull) >> 40) / 16777216.0f - 0.5f;
        }
        chunk[i] = f2h(s * 0.02f * 1.7320508f);
    }
    if (chunk_path) {
        FILE *f = fopen(chunk_path, "wb");
        if (!f || fwrite(chunk, 2, halves, f) != halves || fclose(f) != 0) {
            fprintf(stderr, "decode: cannot write %s\n", chunk_path);
            free(chunk);
            return 1;
        }
    }
    session x;
    int rc = 1;
    dec_model *m = NULL;
    if (!open_session(db, &x))
        goto out;
    kiln_status st;
    if ((st = dec_model_random(x.rt, x.s, &c, chunk, halves, &m))) {
        fail(st);
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
    for (size_t i = 0; i < n_batches; i++) {
        const uint32_t B = batches[i];
        dec_engine *e = NULL;
        dec_engine_options eo = {.max_participants = B, .max_prefill_tokens = B, .max_seq_tokens = context};
        kiln_jit_counters before, after;
        kiln_jit_get_counters(x.jit, &before);
        if ((st = dec_engine_create(x.jit, x.s, m, &eo, &e))) {
            fail(st);
            goto out;
        }
        double dev = 0, wall = 0;
        uint64_t replayed = 0;
        st = dec_bench_steps(e, B, context, 5, steps, &dev, &wall, &replayed);
        if (!st)
            st = dec_bench_breakdown(e, B, context, stdout);
        dec_engine_free(e);
        if (st) {
            fail(st);
            goto out;
        }
        kiln_jit_get_counters(x.jit, &after);
        const double kv = (double)B * (double)c.layers * context * (double)b->num_key_value_heads *
                          (double)b->head_dim * 2.0 * 2.0;
        const double floor_ms = ((double)m->weight_bytes + kv) / bw * 1e3;
        printf("{\"bench\":\"decode_step\",\"impl\":\"kiln\",\"model\":\"%s\",\"layers\":%lld,\"batch\":%u,"
               "\"context\":%u,\"steps\":%d,\"device_ms\":%.4f,\"wall_ms\":%.4f,\"floor_ms\":%.4f,"
               "\"device_over_floor\":%.3f,\"wall_over_floor\":%.3f,\"weight_bytes\":%llu,\"kv_bytes\":%.0f,"
               "\"d2d_gb_s\":%.1f,\"replayed_commands\":%llu,\"compiles\":%llu}\n",
               config_path ? "config" : "llama-3-8b", (long long)c.layers, B, context, steps, dev, wall, floor_ms,
               dev / floor_ms, wall / floor_ms, (unsigned long long)m->weight_bytes, kv, bw / 1e9,
               (unsigned long long)replayed, (unsigned long long)(after.compiles - before.compiles));
        fflush(stdout);
    }
    rc = 0;
out:
    dec_model_free(m);
    close_session(&x);
    free(chunk);
    return rc;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *db = NULL, *dump_path = NULL, *config = NULL, *chunk = NULL;
    static prompt prompts[MAX_PROMPTS];
    size_t n_prompts = 0, n_batches = 0;
    uint32_t max_new = 32, context = 1024, steps = 30, layers = 0, batches[16];
    int bench = 0, eos_given = 0, rc;
    int64_t eos_value = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(NULL);
            return 0;
        }
        if (!strcmp(a, "--bench")) {
            bench = 1;
            continue;
        }
        if (!v)
            return usage("an option lacks its value");
        i++;
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--db"))
            db = v;
        else if (!strcmp(a, "--dump-logits"))
            dump_path = v;
        else if (!strcmp(a, "--config"))
            config = v;
        else if (!strcmp(a, "--chunk-file"))
            chunk = v;
        else if (!strcmp(a, "--prompt")) {
            if (n_prompts == MAX_PROMPTS || !parse_prompt(v, &prompts[n_prompts]))
                return usage("--prompt takes token ids separated by commas, optionally :MAX_NEW");
            n_prompts++;
        } else if (!strcmp(a, "--max-new")) {
            if (!parse_u32(v, 1, 1u << 20, &max_new))
                return usage("--max-new takes a count >= 1");
        } else if (!strcmp(a, "--eos")) {
            uint32_t t;
            eos_given = 1;
            if (!strcmp(v, "none"))
                eos_value = -1;
            else if (parse_u32(v, 0, UINT32_MAX - 1, &t))
                eos_value = t;
            else
                return usage("--eos takes a token id or none");
        } else if (!strcmp(a, "--context")) {
            if (!parse_u32(v, 1, 1u << 20, &context))
                return usage("--context takes a count >= 1");
        } else if (!strcmp(a, "--steps")) {
            if (!parse_u32(v, 1, 100000, &steps))
                return usage("--steps takes a count >= 1");
        } else if (!strcmp(a, "--layers")) {
            if (!parse_u32(v, 1, 4096, &layers))
                return usage("--layers takes a count >= 1");
        } else if (!strcmp(a, "--batch")) {
            char *copy = strdup(v);
            n_batches = 0;
            for (char *t = strtok(copy, ","); t; t = strtok(NULL, ",")) {
                if (n_batches == 16 || !parse_u32(t, 1, 65535, &batches[n_batches++])) {
                    free(copy);
                    return usage("--batch takes up to 16 sizes separated by commas");
                }
            }
            free(copy);
        } else {
            fprintf(stderr, "decode: unknown option %s\n", a);
            return usage(NULL);
        }
    }
    if (bench) {
        if (!n_batches) {
            batches[0] = 1, batches[1] = 8, batches[2] = 32;
            n_batches = 3;
        }
        rc = run_bench(config, layers, batches, n_batches, context, (int)steps, chunk, db);
    } else {
        if (!model || !n_prompts)
            return usage("--model and at least one --prompt are needed");
        rc = run_generate(model, prompts, n_prompts, max_new, eos_given && eos_value >= 0 ? &eos_value : NULL,
                          eos_given, db, dump_path);
    }
    for (size_t i = 0; i < n_prompts; i++)
        free(prompts[i].ids);
    return rc;
}
