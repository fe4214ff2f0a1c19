/* kiln prewarm: compile every kernel a model needs into the cache database. */
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

#define CMD "prewarm"
/* Characters of the fingerprint shown per kernel (ls shows all 64). */
#define FP_SHORT 16
/* What kiln_spec_constants_text can need for a full spec. */
#define CONSTANTS_TEXT_MAX (KILN_SPEC_MAX_CONSTANTS * (KILN_NAME_MAX + 24))

static const char help_text[] =
    "usage: kiln prewarm [--model CONFIG.json] [--dtype f16|bf16] [--arch ARCH] [--db PATH] [-j N]\n"
    "                    [--batch LIST] [--max-context N] [--prefill-chunk N] [--tune] [--dry-run]\n"
    "\n"
    "Compiles every kernel specialization the model needs for ARCH and stores\n"
    "the cubins in the cache database; kernels already there are not compiled\n"
    "again. Needs no GPU.\n"
    "\n"
    "options:\n"
    "  -m, --model CONFIG.json  a Hugging Face config.json (default: the built-in\n"
    "                           Llama-3-8B shape)\n"
    "  -t, --dtype f16|bf16     the element type of activations, weights and the KV\n"
    "                           cache (default: the config's dtype or torch_dtype,\n"
    "                           float16 or bfloat16; f16 without one)\n"
    "  -a, --arch ARCH          target architecture, sm_XY[a|f] (default: " CLI_DEFAULT_ARCH ")\n"
    "  -d, --db PATH            the database to fill (default: $KILN_CACHE_DIR/kernels.db,\n"
    "                           else $XDG_CACHE_HOME/kiln/kernels.db, else\n"
    "                           $HOME/.cache/kiln/kernels.db); created when missing\n"
    "  -j, --jobs N             compile with N threads, 1..256 (default: the number\n"
    "                           of online CPUs)\n"
    "      --batch LIST         the serving envelope's batch buckets, tokens per step,\n"
    "                           increasing, comma-separated (default: 1)\n"
    "      --max-context N      the envelope's largest context, in tokens (default:\n"
    "                           the config's max_position_embeddings)\n"
    "      --prefill-chunk N    the envelope's prefill chunk, in tokens (default: none)\n"
    "      --tune               also time the model's dense products for each batch\n"
    "                           bucket on this GPU and keep the choices in the\n"
    "                           database as tuning rows (needs a GPU and its driver)\n"
    "  -n, --dry-run            list the specializations, compile nothing, touch no\n"
    "                           database: one line each, <template id> <constants>\n"
    "                           <fingerprint prefix>, then\n"
    "                           dry run: model <name> (...), arch <arch>: <N> specializations\n"
    "  -h, --help               print this help and exit\n"
    "\n"
    "output: one line per specialization, in order,\n"
    "  <template id> <constants> compiled|cached|failed <fingerprint prefix>\n"
    "then one summary line,\n"
    "  summary: model <name> (vocab_size V, hidden_size H, intermediate_size I,\n"
    "  num_attention_heads A, num_key_value_heads K, head_dim D, dtype f16|bf16),\n"
    "  arch <arch>:\n"
    "  <N> specializations, <C> compiled, <R> already cached, <F> failed,\n"
    "  <S> s, database <path>\n"
    "(on one line); a mixture of experts adds \", E experts (K a token, I wide\"\n"
    "and \"; a shared expert S wide\" where it has one, then \")\") before the dtype.\n"
    "When stderr is a terminal, a progress line (done/total,\n"
    "kernels per second, ETA) is drawn there meanwhile and erased at the end.\n"
    "Once every kernel is in the database, a coverage record of the model, the\n"
    "envelope and every fingerprint they need is stored (what 'kiln check' checks):\n"
    "  coverage <name>: <N> kernels, envelope <text>\n"
    "With --tune, a line per batch bucket and\n"
    "  tune: model <name>, <B> batch buckets, <P> products, <R> tuning rows (<N> new), database <path>\n"
    "\n"
    "The config and the architecture are checked before the database is opened:\n"
    "when either is bad, the database is neither created nor changed.\n"
    "\n"
    "exit status: 0 every kernel is in the database; 1 a bad config (the message\n"
    "names the field and its value), a bad architecture, a database error or a\n"
    "failed compile; 2 a usage error (unknown option, -j out of range).\n";

typedef struct spec_result {
    int done;      /* finished, successfully or not */
    int compiled;  /* this run compiled it (else it was already cached) */
    kiln_status st;
    char *error;   /* the library's message when st != KILN_OK; may be NULL on OOM */
    char fingerprint[2 * KILN_FINGERPRINT_SIZE + 1];
} spec_result;

/* Shared by the workers; lock guards next, printed and every result's done flag. */
typedef struct prewarm_run {
    const char *cmd; /* the command reporting ("prewarm", "export") */
    kiln_jit *jit;
    const kiln_spec *specs;
    size_t n;
    spec_result *results;
    pthread_mutex_t lock;
    size_t *order;  /* the specs by falling compile cost: the dearest start first */
    size_t next;    /* the next position of order to hand out */
    size_t printed; /* specs [0, printed) have been reported */
    /* Progress on a terminal (stderr is one): a line redrawn in place. */
    int progress;
    int progress_shown; /* the line is on the screen now */
    size_t n_done;
    double start, last_draw;
} prewarm_run;

/* "model NAME (sizes..., dtype D)" for the summaries; a mixture of experts
 * names its experts before the dtype. */
static void describe_model(const kiln_model_config *c, char *buf, size_t cap)
{
    char experts[160] = "", shared[64] = "";
    if (c->shared_expert_intermediate_size)
        snprintf(shared, sizeof shared, "; a shared expert %lld wide", (long long)c->shared_expert_intermediate_size);
    if (c->num_experts)
        snprintf(experts, sizeof experts, ", %lld experts (%lld a token, %lld wide%s)", (long long)c->num_experts,
                 (long long)c->num_experts_per_tok, (long long)c->moe_intermediate_size, shared);
    snprintf(buf, cap,
             "model %s (vocab_size %lld, hidden_size %lld, intermediate_size %lld, num_attention_heads %lld, "
             "num_key_value_heads %lld, head_dim %lld%s, dtype %s)",
             c->name, (long long)c->vocab_size, (long long)c->hidden_size, (long long)c->intermediate_size,
             (long long)c->num_attention_heads, (long long)c->num_key_value_heads, (long long)c->head_dim, experts,
             c->dtype == KILN_DTYPE_BF16 ? "bf16" : "f16");
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void prepare_one(prewarm_run *r, size_t i)
{
    spec_result *res = &r->results[i];
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    int compiled = 0;
    kiln_status st = kiln_jit_prepare(r->jit, &r->specs[i], &compiled);
    if (st == KILN_OK)
        st = kiln_jit_fingerprint(r->jit, &r->specs[i], fp);
    res->st = st;
    res->compiled = compiled;
    if (st == KILN_OK) {
        kiln_fingerprint_hex(fp, res->fingerprint);
    } else {
        /* kiln_errmsg() is per thread: copy it while still on this one. */
        res->error = strdup(kiln_errmsg());
        /* An NVRTC log ends in a newline; the report adds its own. */
        for (size_t len = res->error ? strlen(res->error) : 0;
             len && (res->error[len - 1] == '\n' || res->error[len - 1] == ' '); len--)
            res->error[len - 1] = 0;
    }
}

/* Erases the progress line, so that what follows starts on a clean line. */
static void progress_clear_locked(prewarm_run *r)
{
    if (!r->progress_shown)
        return;
    fputs("\r\033[K", stderr);
    fflush(stderr);
    r->progress_shown = 0;
}

/* Draws "[done/total] rate, ETA" at most ten times a second, and at the end. */
static void progress_draw_locked(prewarm_run *r)
{
    if (!r->progress)
        return;
    double now = now_seconds();
    if (r->n_done < r->n && r->progress_shown && now - r->last_draw < 0.1)
        return;
    r->last_draw = now;
    double elapsed = now - r->start;
    double rate = elapsed > 0 ? (double)r->n_done / elapsed : 0;
    char eta[32] = "?";
    if (r->n_done == r->n)
        snprintf(eta, sizeof eta, "0s");
    else if (rate > 0)
        snprintf(eta, sizeof eta, "%.0fs", (double)(r->n - r->n_done) / rate);
    fprintf(stderr, "\r\033[K[%zu/%zu] %.1f kernels/s, ETA %s", r->n_done, r->n, rate, eta);
    fflush(stderr);
    r->progress_shown = 1;
}

/* Reports the finished specs that follow the last reported one, so lines come
 * out in spec order whatever order the workers finish in. */
static void report_locked(prewarm_run *r)
{
    if (r->printed < r->n && r->results[r->printed].done)
        progress_clear_locked(r);
    while (r->printed < r->n && r->results[r->printed].done) {
        size_t i = r->printed++;
        const spec_result *res = &r->results[i];
        char consts[CONSTANTS_TEXT_MAX];
        if (kiln_spec_constants_text(&r->specs[i], consts, sizeof consts) != KILN_OK)
            snprintf(consts, sizeof consts, "?");
        if (res->st == KILN_OK) {
            printf("%s %s %s %.*s\n", r->specs[i].template_id, consts, res->compiled ? "compiled" : "cached",
                   FP_SHORT, res->fingerprint);
        } else {
            printf("%s %s failed -\n", r->specs[i].template_id, consts);
            fprintf(stderr, "kiln %s: %s %s: %s: %s\n", r->cmd, r->specs[i].template_id, consts,
                    kiln_status_code(res->st), res->error && *res->error ? res->error : kiln_status_string(res->st));
        }
        fflush(stdout);
    }
}

static void *worker(void *arg)
{
    prewarm_run *r = arg;
    for (;;) {
        pthread_mutex_lock(&r->lock);
        if (r->next >= r->n) {
            pthread_mutex_unlock(&r->lock);
            return NULL;
        }
        size_t i = r->order[r->next++];
        pthread_mutex_unlock(&r->lock);

        prepare_one(r, i);

        pthread_mutex_lock(&r->lock);
        r->results[i].done = 1;
        r->n_done++;
        report_locked(r);
        progress_draw_locked(r);
        pthread_mutex_unlock(&r->lock);
    }
}

/* Runs the specs on up to jobs threads; the calling thread works too. */
static void run_all(prewarm_run *r, long jobs)
{
    size_t n_threads = (size_t)jobs < r->n ? (size_t)jobs : r->n;
    pthread_t *threads = NULL;
    size_t started = 0;
    if (n_threads > 1) {
        threads = calloc(n_threads - 1, sizeof *threads);
        /* Fewer threads (even none) still finish the work: the caller is one. */
        for (size_t t = 0; threads && t < n_threads - 1; t++) {
            if (pthread_create(&threads[t], NULL, worker, r) != 0)
                break;
            started++;
        }
    }
    worker(r);
    for (size_t t = 0; t < started; t++)
        pthread_join(threads[t], NULL);
    free(threads);
}

long cli_default_jobs(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1)
        return 1;
    return n > CLI_MAX_JOBS ? CLI_MAX_JOBS : n;
}

int cli_parse_dtype(const char *cmd, const char *text, kiln_dtype *out)
{
    if (!strcmp(text, "f16"))
        *out = KILN_DTYPE_F16;
    else if (!strcmp(text, "bf16"))
        *out = KILN_DTYPE_BF16;
    else
        return cli_usage_error(cmd, "--dtype %s: must be f16 or bf16", text);
    return CLI_EXIT_OK;
}

int cli_load_model(const char *cmd, const char *model_path, const char *arch, kiln_dtype dtype,
                   kiln_model_config *config, kiln_spec **specs, size_t *n_specs)
{
    *specs = NULL;
    *n_specs = 0;
    if (model_path) {
        kiln_model_config_options opts = {.size = sizeof opts, .dtype = dtype};
        if (kiln_model_config_load_with(model_path, &opts, config) != KILN_OK)
            return cli_fail(cmd, "bad model config: %s", kiln_errmsg());
    } else {
        kiln_model_config_default(config);
        if (dtype)
            config->dtype = dtype;
    }
    kiln_jit *probe = NULL;
    /* prewarm and export compile whatever $KILN_JIT says for serving. */
    kiln_jit_options probe_opts = {.size = sizeof probe_opts, .arch = arch, .compile = KILN_JIT_COMPILE_ON};
    if (kiln_jit_create(&probe_opts, &probe) != KILN_OK)
        return cli_fail(cmd, "--arch %s: %s", arch, kiln_errmsg());
    /* The probe's architecture (--arch, CLI_DEFAULT_ARCH without it), so that
     * what only that architecture takes is listed. */
    kiln_status st = kiln_model_specializations_for_arch(config, kiln_jit_arch(probe), specs, n_specs);
    kiln_jit_destroy(probe);
    if (st != KILN_OK) {
        /* Named once: the refusals of a model already begin "model NAME: ". */
        const char *msg = kiln_errmsg();
        const size_t len = strlen(config->name);
        const int named = !strncmp(msg, "model ", 6) && !strncmp(msg + 6, config->name, len) && msg[6 + len] == ':';
        return named ? cli_fail(cmd, "%s", msg) : cli_fail(cmd, "model %s: %s", config->name, msg);
    }
    return CLI_EXIT_OK;
}

int cli_prewarm_into(const char *cmd, const kiln_model_config *config, const kiln_spec *specs, size_t n_specs,
                     const char *arch, kiln_cache *cache, long jobs)
{
    int rc = CLI_EXIT_FAILURE;
    kiln_jit *jit = NULL;
    prewarm_run run = {.cmd = cmd, .specs = specs, .n = n_specs, .next = 0, .printed = 0};
    /* -j is what the user asked for: the jit may run that many compiles at once. */
    kiln_jit_options jit_opts = {.size = sizeof jit_opts,
                                 .cache = cache,
                                 .arch = arch,
                                 .max_parallel_compiles = (unsigned)jobs,
                                 .compile = KILN_JIT_COMPILE_ON};
    if (kiln_jit_create(&jit_opts, &jit) != KILN_OK) {
        cli_fail(cmd, "%s", kiln_errmsg());
        return rc;
    }
    run.jit = jit;
    run.results = calloc(n_specs ? n_specs : 1, sizeof *run.results);
    run.order = calloc(n_specs ? n_specs : 1, sizeof *run.order);
    if (!run.results || !run.order) {
        free(run.results);
        free(run.order);
        cli_fail(cmd, "out of memory");
        goto out_destroy_jit;
    }
    /* Longest first (insertion sort: a model has tens of specs). */
    for (size_t i = 0; i < n_specs; i++) {
        size_t k = i, cost = kiln_spec_compile_cost(&specs[i]);
        while (k > 0 && kiln_spec_compile_cost(&specs[run.order[k - 1]]) < cost) {
            run.order[k] = run.order[k - 1];
            k--;
        }
        run.order[k] = i;
    }
    if (pthread_mutex_init(&run.lock, NULL) != 0) {
        cli_fail(cmd, "cannot create a mutex");
        goto out_free_results;
    }

    /* Progress is for a person watching; logs and pipes get the lines only. */
    run.progress = isatty(STDERR_FILENO) && n_specs > 0;
    double start = now_seconds();
    run.start = start;
    run_all(&run, jobs);
    double elapsed = now_seconds() - start;
    progress_clear_locked(&run);

    size_t n_compiled = 0, n_cached = 0, n_failed = 0;
    for (size_t i = 0; i < n_specs; i++) {
        if (run.results[i].st != KILN_OK)
            n_failed++;
        else if (run.results[i].compiled)
            n_compiled++;
        else
            n_cached++;
    }
    char model[512];
    describe_model(config, model, sizeof model);
    printf("summary: %s, arch %s: %zu specializations, %zu compiled, %zu already cached, %zu failed, %.2f s, "
           "database %s\n",
           model, kiln_jit_arch(jit), n_specs, n_compiled, n_cached, n_failed, elapsed, kiln_cache_path(cache));
    fflush(stdout);
    if (n_failed)
        cli_fail(cmd, "%zu of %zu specializations failed", n_failed, n_specs);
    else
        rc = CLI_EXIT_OK;

    pthread_mutex_destroy(&run.lock);
out_free_results:
    for (size_t i = 0; i < n_specs; i++)
        free(run.results[i].error);
    free(run.results);
    free(run.order);
out_destroy_jit:
    kiln_jit_destroy(jit);
    return rc;
}

/* The command lines of prewarm, export and check: model_only (check) takes
 * neither -j nor --dry-run; the serving envelope and --tune are prewarm's. */
static int parse_model_args(const char *cmd, int argc, char **argv, const char *help, int path_opt, int model_only,
                            cli_build_args *out)
{
    enum { OPT_BATCH = 256, OPT_CONTEXT, OPT_CHUNK, OPT_TUNE };
    const int prewarm = path_opt == 'd' && !model_only;
    struct option longopts[12] = {{"model", required_argument, NULL, 'm'},
                                  {"dtype", required_argument, NULL, 't'},
                                  {"arch", required_argument, NULL, 'a'},
                                  {"help", no_argument, NULL, 'h'},
                                  {path_opt == 'o' ? "output" : "db", required_argument, NULL, path_opt}};
    size_t n = 5;
    char optstring[24] = ":m:t:a:h";
    strcat(optstring, path_opt == 'o' ? "o:" : "d:");
    if (!model_only) {
        longopts[n++] = (struct option){"jobs", required_argument, NULL, 'j'};
        strcat(optstring, "j:");
    }
    if (prewarm) {
        longopts[n++] = (struct option){"dry-run", no_argument, NULL, 'n'};
        longopts[n++] = (struct option){"batch", required_argument, NULL, OPT_BATCH};
        longopts[n++] = (struct option){"max-context", required_argument, NULL, OPT_CONTEXT};
        longopts[n++] = (struct option){"prefill-chunk", required_argument, NULL, OPT_CHUNK};
        longopts[n++] = (struct option){"tune", no_argument, NULL, OPT_TUNE};
        strcat(optstring, "n");
    }
    longopts[n] = (struct option){NULL, 0, NULL, 0};
    *out = (cli_build_args){.arch = CLI_DEFAULT_ARCH, .batch = {1}, .n_batch = 1};
    int c;
    long v;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, optstring, longopts, NULL)) != -1) {
        if (c == 'm') {
            out->model_path = optarg;
        } else if (c == 't') {
            int rc = cli_parse_dtype(cmd, optarg, &out->dtype);
            if (rc)
                return rc;
        } else if (c == 'a') {
            out->arch = optarg;
        } else if (c == path_opt) {
            out->path = optarg;
        } else if (c == 'j') {
            if (cli_parse_long(optarg, 1, CLI_MAX_JOBS, &out->jobs))
                return cli_usage_error(cmd, "-j %s: must be a whole number in [1, %d]", optarg, CLI_MAX_JOBS);
        } else if (c == 'n') {
            out->dry_run = 1;
        } else if (c == OPT_BATCH) {
            if (cli_parse_buckets(optarg, out->batch, &out->n_batch))
                return cli_usage_error(cmd, "--batch %s: must be 1 to %d increasing token counts in [1, %d],"
                                            " comma-separated",
                                       optarg, CLI_MAX_BUCKETS, CLI_MAX_BUCKET_TOKENS);
        } else if (c == OPT_CONTEXT || c == OPT_CHUNK) {
            if (cli_parse_long(optarg, 1, 1L << 24, &v))
                return cli_usage_error(cmd, "--%s %s: must be a whole number in [1, %ld]",
                                       c == OPT_CONTEXT ? "max-context" : "prefill-chunk", optarg, 1L << 24);
            *(c == OPT_CONTEXT ? &out->max_context : &out->prefill_chunk) = v;
        } else if (c == OPT_TUNE) {
            out->tune = 1;
        } else if (c == 'h') {
            fputs(help, stdout);
            return CLI_EXIT_OK;
        } else {
            return cli_getopt_error(cmd, c, argv);
        }
    }
    if (optind < argc)
        return cli_usage_error(cmd, "unexpected argument '%s'", argv[optind]);
    if (out->tune && out->dry_run)
        return cli_usage_error(cmd, "--tune and --dry-run: a dry run touches no database");
    if (!out->jobs)
        out->jobs = cli_default_jobs();
    return -1;
}

int cli_parse_buckets(const char *text, int64_t *out, size_t *n_out)
{
    size_t n = 0;
    long prev = 0;
    const char *p = text;
    if (!text || !*text)
        return -1;
    for (;;) {
        char item[32];
        size_t len = strcspn(p, ",");
        long v;
        if (!len || len >= sizeof item || n == CLI_MAX_BUCKETS)
            return -1;
        memcpy(item, p, len);
        item[len] = 0;
        if (cli_parse_long(item, prev + 1, CLI_MAX_BUCKET_TOKENS, &v))
            return -1;
        out[n++] = v;
        prev = v;
        if (!p[len])
            break;
        p += len + 1;
    }
    *n_out = n;
    return 0;
}

int cli_parse_build_args(const char *cmd, int argc, char **argv, const char *help, int path_opt,
                         cli_build_args *out)
{
    return parse_model_args(cmd, argc, argv, help, path_opt, 0, out);
}

int cli_parse_model_args(const char *cmd, int argc, char **argv, const char *help, cli_build_args *out)
{
    return parse_model_args(cmd, argc, argv, help, 'd', 1, out);
}

/* --dry-run: the specializations and their keys, nothing compiled or opened. */
static int dry_run(const kiln_model_config *config, const kiln_spec *specs, size_t n_specs, const char *arch)
{
    kiln_jit *jit = NULL;
    kiln_jit_options jo = {.size = sizeof jo, .arch = arch, .compile = KILN_JIT_COMPILE_ON};
    if (kiln_jit_create(&jo, &jit) != KILN_OK)
        return cli_fail(CMD, "--arch %s: %s", arch, kiln_errmsg());
    int rc = CLI_EXIT_OK;
    for (size_t i = 0; i < n_specs && !rc; i++) {
        uint8_t fp[KILN_FINGERPRINT_SIZE];
        char hex[2 * KILN_FINGERPRINT_SIZE + 1], consts[CONSTANTS_TEXT_MAX];
        if (kiln_jit_fingerprint(jit, &specs[i], fp) != KILN_OK ||
            kiln_spec_constants_text(&specs[i], consts, sizeof consts) != KILN_OK) {
            rc = cli_fail(CMD, "%s: %s", specs[i].template_id, kiln_errmsg());
            break;
        }
        kiln_fingerprint_hex(fp, hex);
        printf("%s %s %.*s\n", specs[i].template_id, consts, FP_SHORT, hex);
    }
    if (!rc) {
        char model[512];
        describe_model(config, model, sizeof model);
        printf("dry run: %s, arch %s: %zu specializations\n", model, kiln_jit_arch(jit), n_specs);
    }
    if (!rc && (fflush(stdout) != 0 || ferror(stdout)))
        rc = cli_fail(CMD, "cannot write the output");
    kiln_jit_destroy(jit);
    return rc;
}

int cli_prewarm(int argc, char **argv)
{
    cli_build_args a;
    int parsed = cli_parse_build_args(CMD, argc, argv, help_text, 'd', &a);
    if (parsed >= 0)
        return parsed;
    const char *model_path = a.model_path, *arch = a.arch, *db = a.path;
    long jobs = a.jobs;

    /* Everything that can be wrong with the request is found before the
     * database is touched, so a bad request leaves it as it was. */
    kiln_model_config config;
    kiln_spec *specs = NULL;
    size_t n_specs = 0;
    char path[CLI_PATH_MAX];
    int rc = cli_load_model(CMD, model_path, arch, a.dtype, &config, &specs, &n_specs);
    if (rc)
        goto out_free_specs;
    if (a.dry_run) {
        rc = dry_run(&config, specs, n_specs, arch);
        goto out_free_specs;
    }
    /* Without a GPU, --tune fails before the database is touched. */
    if ((a.tune && (rc = cli_tune_check_gpu(CMD))) || (rc = cli_db_path(CMD, db, path, sizeof path)))
        goto out_free_specs;
    kiln_cache *cache = NULL;
    kiln_cache_options cache_opts = {.size = sizeof cache_opts, .path = path};
    if (kiln_cache_open(&cache_opts, &cache) != KILN_OK) {
        rc = cli_fail(CMD, "%s", kiln_errmsg());
        goto out_free_specs;
    }
    cli_report_skipped_layers(cache);
    rc = cli_prewarm_into(CMD, &config, specs, n_specs, arch, cache, jobs);
    char envelope[1024];
    cli_envelope_text(&a, &config, envelope, sizeof envelope);
    if (!rc)
        rc = cli_write_coverage(CMD, model_path, &config, specs, n_specs, arch, envelope, cache);
    if (!rc && a.tune)
        rc = cli_tune_model(CMD, &config, a.batch, a.n_batch, cache);
    kiln_cache_close(cache);
out_free_specs:
    kiln_free(specs);
    return rc;
}
