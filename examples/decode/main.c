/* decode: greedy decoding of a Llama / Qwen2 checkpoint on kiln, or the
 * benchmarks of a model of random weights: the decode step (--bench) and
 * the prefill (--bench-prefill), in bench.c.
 *
 *   decode --model DIR --prompt 1,2,3[:MAX_NEW] [--prompt ...] [--max-new N]
 *          [--eos ID|none] [--db PATH] [--dump-logits FILE] [--dump-routing FILE]
 *   decode --bench [--config config.json] [--layers N] [--dtype f16|bf16]
 *          [--batch 1,8,32] [--context 1024[,4096,...]] [--steps N]
 *          [--chunk-file FILE] [--db PATH]
 *   decode --bench-prefill [--config config.json] [--layers N] [--dtype f16|bf16]
 *          [--shapes 1x512,1x4096,4x1024,1x16384] [--iters N] [--db PATH]
 *   decode --bench-startup [--config config.json] [--layers N] [--dtype f16|bf16]
 *          [--batch 1] [--context 1024] [--db PATH]
 *
 * Output: JSON lines on stdout. Generation prints one line per prompt (the
 * generated token ids and why it stopped) and a summary (prefill and decode
 * tokens/s, compiles and cache hits, replayed and eager commands). --bench
 * prints the measured device-to-device copy bandwidth, then one line per
 * context and batch size: the decode step's latency and its floor (the
 * weight bytes plus the KV bytes a step reads, over that bandwidth).
 * --dtype sets the benchmarks' element type (default: the config's, f16 for
 * the built-in shape).
 * --bench-prefill prints the dense throughput of a large cuBLASLt product
 * in the model's element type, then per shape the prefill's time, tokens/s, TFLOP/s and MFU.
 * --bench-startup prints the time from main's start to the first decode
 * step done (the database, runtime and jit, the engine, the step's encode
 * and its first submission), the weights' upload apart: run it against a
 * database that already holds the model's kernels.
 * --dump-logits writes, per participant and step, a record: u32 participant,
 * u32 step, u32 vocab, then vocab f32 logits (little-endian).
 * --dump-routing (a mixture of experts) writes, per participant and position
 * the model computed (the prompt's, then one a decode step), a record: u32
 * participant, u32 position, u32 layers, u32 top_k, then layers x top_k u32
 * expert ids, layer by layer in the router's order. Exit codes: 0 ok, 1
 * failure, 2 usage.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#define MAX_PROMPTS 256

static int usage(const char *msg)
{
    if (msg)
        fprintf(stderr, "decode: %s\n", msg);
    fprintf(stderr,
            "usage: decode --model DIR --prompt IDS[:MAX_NEW] [--prompt ...] [--max-new N] [--eos ID|none]\n"
            "              [--db PATH] [--dump-logits FILE] [--dump-routing FILE]\n"
            "       decode --bench [--config config.json] [--layers N] [--dtype f16|bf16] [--batch 1,8,32]\n"
            "              [--context 1024[,4096,...]] [--steps N] [--chunk-file FILE] [--db PATH]\n"
            "       decode --bench-prefill [--config config.json] [--layers N] [--dtype f16|bf16]\n"
            "              [--shapes 1x512,1x4096,4x1024,1x16384] [--iters N] [--db PATH]\n");
    return 2;
}

static float bf2f(uint16_t h)
{
    union { uint32_t u; float f; } x = {(uint32_t)h << 16};
    return x.f;
}

static float h2f(uint16_t h)
{
    uint32_t e = (h >> 10) & 31, m = h & 1023;
    float v = e ? ldexpf((float)(m | 1024), (int)e - 25) : ldexpf((float)m, -24);
    if (e == 31)
        v = m ? NAN : INFINITY;
    return (h & 0x8000) ? -v : v;
}

/* A decimal count in [lo, hi]: digits only, no sign, space or suffix. */
static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
    char *end;
    if (s[0] < '0' || s[0] > '9')
        return 0;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return 0;
    *out = (uint32_t)v;
    return 1;
}

/* Copies the next item of a comma-separated list into item (cap bytes) and
 * moves *s past it and its comma; 0 for an empty or overlong item. */
static int next_item(const char **s, char *item, size_t cap)
{
    const char *comma = strchr(*s, ',');
    const size_t len = comma ? (size_t)(comma - *s) : strlen(*s);
    if (!len || len >= cap)
        return 0;
    memcpy(item, *s, len);
    item[len] = 0;
    *s = comma ? comma + 1 : *s + len;
    return comma == NULL || comma[1] != 0; /* "1," ends in an empty item */
}

/* "1,8,32": 1 to DEC_MAX_LIST counts in [lo, hi]. */
static int parse_counts(const char *text, uint32_t lo, uint32_t hi, uint32_t *out, size_t *n)
{
    char item[32];
    *n = 0;
    for (const char *s = text; *s || !*n;) {
        if (*n == DEC_MAX_LIST || !next_item(&s, item, sizeof item) || !parse_u32(item, lo, hi, &out[*n]))
            return 0;
        ++*n;
    }
    return 1;
}

/* "1x512,4x1024": 1 to DEC_MAX_LIST shapes, SEQSxTOKENS, at most max_tokens in all each. */
static int parse_shapes(const char *text, uint32_t max_tokens, dec_shape *out, size_t *n)
{
    char item[32];
    *n = 0;
    for (const char *s = text; *s || !*n;) {
        if (*n == DEC_MAX_LIST || !next_item(&s, item, sizeof item))
            return 0;
        char *x = strchr(item, 'x');
        if (!x)
            return 0;
        *x = 0;
        dec_shape *sh = &out[*n];
        if (!parse_u32(item, 1, 65535, &sh->seqs) || !parse_u32(x + 1, 1, max_tokens, &sh->tokens) ||
            (uint64_t)sh->seqs * sh->tokens > max_tokens)
            return 0;
        ++*n;
    }
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
    int bf16; /* the logits' element type: bf16, else f16 */
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
            row[j] = d->bf16 ? bf2f(logits[i + j]) : h2f(logits[i + j]);
        if (fwrite(row, 4, n, d->f) != n)
            d->failed = 1;
    }
}

typedef struct routing_dump {
    FILE *f;
    int failed;
    uint32_t layers, k;
} routing_dump;

static void dump_routing(void *user, uint32_t participant, uint32_t position, const uint32_t *ids,
                         size_t layer_stride)
{
    routing_dump *d = user;
    const uint32_t head[4] = {participant, position, d->layers, d->k};
    if (fwrite(head, 4, 4, d->f) != 4)
        d->failed = 1;
    for (uint32_t l = 0; l < d->layers; l++)
        if (fwrite(ids + (size_t)l * layer_stride, 4, d->k, d->f) != d->k)
            d->failed = 1;
}

/* Opens path for writing into *f; 0 (and a message) when it cannot. */
static int open_dump(const char *path, FILE **f)
{
    if (path && !(*f = fopen(path, "wb"))) {
        fprintf(stderr, "decode: %s: %s\n", path, strerror(errno));
        return 0;
    }
    return 1;
}

/* Closes a dump; 0 (and a message) when it was not all written. */
static int close_dump(const char *path, FILE **f, int failed)
{
    if (!*f)
        return 1;
    const int ok = fclose(*f) == 0 && !failed;
    *f = NULL;
    if (!ok)
        fprintf(stderr, "decode: writing %s failed\n", path);
    return ok;
}

int dec_session_open(const char *db, dec_session *x)
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

void dec_session_close(dec_session *x)
{
    kiln_stream_destroy(x->s);
    kiln_jit_destroy(x->jit);
    kiln_runtime_destroy(x->rt);
    kiln_cache_close(x->cache);
}

int dec_report(kiln_status st)
{
    fprintf(stderr, "decode: %s: %s\n", kiln_status_code(st), dec_errmsg());
    return 1;
}

/* ---- generation ---- */

static int run_generate(const char *dir, prompt *prompts, size_t n, uint32_t max_new, const int64_t *eos_override,
                        int eos_given, const char *db, const char *dump_path, const char *routing_path)
{
    dec_checkpoint ck;
    kiln_status st = dec_checkpoint_open(dir, &ck);
    if (st)
        return dec_report(st);
    dec_session x;
    int rc = 1;
    dec_model *m = NULL;
    dec_engine *e = NULL;
    dec_request reqs[MAX_PROMPTS];
    dec_result res[MAX_PROMPTS];
    memset(res, 0, sizeof res);
    dump d = {0};
    routing_dump rd = {0};
    if (!dec_session_open(db, &x))
        goto out;
    if ((st = dec_model_load(x.rt, &ck, &m))) {
        dec_report(st);
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
        dec_report(st);
        goto out;
    }
    d.bf16 = ck.config.base.dtype == KILN_DTYPE_BF16;
    if (routing_path && !m->config.base.num_experts) {
        fprintf(stderr, "decode: --dump-routing: %s is not a mixture of experts\n", m->config.model_type);
        goto out;
    }
    if (!open_dump(dump_path, &d.f) || !open_dump(routing_path, &rd.f))
        goto out;
    rd.layers = (uint32_t)m->config.layers;
    rd.k = (uint32_t)m->config.base.num_experts_per_tok;
    dec_record_routing(e, rd.f ? dump_routing : NULL, &rd);
    const int64_t *eos = eos_given ? eos_override : m->config.eos;
    size_t n_eos = eos_given ? (eos_override ? 1 : 0) : m->config.n_eos;
    dec_stats stats;
    if ((st = dec_generate(e, reqs, n, eos, n_eos, d.f ? dump_logits : NULL, &d, res, &stats))) {
        dec_report(st);
        goto out;
    }
    if (!close_dump(dump_path, &d.f, d.failed) || !close_dump(routing_path, &rd.f, rd.failed))
        goto out;
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
    if (rd.f)
        fclose(rd.f);
    for (size_t i = 0; i < n; i++)
        free(res[i].tokens);
    dec_engine_free(e);
    dec_model_free(m);
    dec_session_close(&x);
    dec_checkpoint_close(&ck);
    return rc;
}

int main(int argc, char **argv)
{
    const double t_main = dec_bench_now_s();
    const char *model = NULL, *db = NULL, *dump_path = NULL, *routing_path = NULL, *config = NULL, *chunk = NULL;
    static prompt prompts[MAX_PROMPTS];
    size_t n_prompts = 0, n_batches = 0, n_contexts = 0, n_shapes = 0;
    uint32_t max_new = 32, steps = 30, iters = 10, layers = 0, batches[DEC_MAX_LIST], contexts[DEC_MAX_LIST];
    dec_shape shapes[DEC_MAX_LIST];
    int bench = 0, bench_prefill = 0, bench_startup = 0, decode_opts = 0, prefill_opts = 0, eos_given = 0, rc;
    int64_t eos_value = 0;
    kiln_dtype dtype = KILN_DTYPE_BYTES;
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
        if (!strcmp(a, "--bench-prefill")) {
            bench_prefill = 1;
            continue;
        }
        if (!strcmp(a, "--bench-startup")) {
            bench_startup = 1;
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
        else if (!strcmp(a, "--dump-routing"))
            routing_path = v;
        else if (!strcmp(a, "--config"))
            config = v;
        else if (!strcmp(a, "--chunk-file")) {
            chunk = v;
            decode_opts = 1;
        } else if (!strcmp(a, "--prompt")) {
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
            decode_opts = 1;
            if (!parse_counts(v, 1, 1u << 20, contexts, &n_contexts))
                return usage("--context takes 1 to 16 token counts (1 to 1048576) separated by commas");
        } else if (!strcmp(a, "--steps")) {
            decode_opts = 1;
            if (!parse_u32(v, 1, 100000, &steps))
                return usage("--steps takes a count >= 1");
        } else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "f16"))
                dtype = KILN_DTYPE_F16;
            else if (!strcmp(v, "bf16"))
                dtype = KILN_DTYPE_BF16;
            else
                return usage("--dtype takes f16 or bf16");
        } else if (!strcmp(a, "--layers")) {
            if (!parse_u32(v, 1, 4096, &layers))
                return usage("--layers takes a count >= 1");
        } else if (!strcmp(a, "--batch")) {
            decode_opts = 1;
            if (!parse_counts(v, 1, 65535, batches, &n_batches))
                return usage("--batch takes 1 to 16 sizes (1 to 65535) separated by commas");
        } else if (!strcmp(a, "--shapes")) {
            prefill_opts = 1;
            if (!parse_shapes(v, 1u << 20, shapes, &n_shapes))
                return usage("--shapes takes 1 to 16 shapes SEQSxTOKENS (sequences x tokens each, 1x4096) "
                             "separated by commas, each of 1 to 1048576 tokens in all");
        } else if (!strcmp(a, "--iters")) {
            prefill_opts = 1;
            if (!parse_u32(v, 1, 100000, &iters))
                return usage("--iters takes a count >= 1");
        } else {
            fprintf(stderr, "decode: unknown option %s\n", a);
            return usage(NULL);
        }
    }
    if (bench + bench_prefill + bench_startup > 1)
        return usage("--bench, --bench-prefill and --bench-startup are separate runs");
    if (prefill_opts && !bench_prefill)
        return usage("--shapes and --iters are --bench-prefill options");
    if (decode_opts && bench_prefill)
        return usage("--batch, --context, --steps and --chunk-file are --bench options");
    if (dtype && !bench && !bench_prefill && !bench_startup)
        return usage("--dtype is a benchmark option (a checkpoint's dtype is its own)");
    dec_bench_args ba = {.config = config, .db = db, .layers = layers, .dtype = dtype, .batches = batches, .n_batches = n_batches,
                         .contexts = contexts, .n_contexts = n_contexts, .steps = steps, .chunk_file = chunk,
                         .shapes = shapes, .n_shapes = n_shapes, .iters = iters};
    if (bench_startup) {
        rc = dec_run_bench_startup(&ba, t_main);
    } else if (bench) {
        if (!n_batches) {
            batches[0] = 1, batches[1] = 8, batches[2] = 32;
            ba.n_batches = 3;
        }
        if (!n_contexts) {
            contexts[0] = 1024;
            ba.n_contexts = 1;
        }
        rc = dec_run_bench_decode(&ba);
    } else if (bench_prefill) {
        if (!n_shapes) {
            const dec_shape defaults[] = {{1, 512}, {1, 4096}, {4, 1024}, {1, 16384}};
            memcpy(shapes, defaults, sizeof defaults);
            ba.n_shapes = sizeof defaults / sizeof defaults[0];
        }
        rc = dec_run_bench_prefill(&ba);
    } else {
        if (!model || !n_prompts)
            return usage("--model and at least one --prompt are needed");
        rc = run_generate(model, prompts, n_prompts, max_new, eos_given && eos_value >= 0 ? &eos_value : NULL,
                          eos_given, db, dump_path, routing_path);
    }
    for (size_t i = 0; i < n_prompts; i++)
        free(prompts[i].ids);
    return rc;
}
