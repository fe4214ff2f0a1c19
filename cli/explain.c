/* kiln explain: why a lookup would miss, part by part of the fingerprint. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#define CMD "explain"
/* The parts kiln_jit_fingerprint_parts writes, in its order; constants last
 * (its value holds ';' and '=' of its own). */
#define N_PARTS 8
static const char *const part_names[N_PARTS] = {"schema",  "template", "source", "headers",
                                                "options", "arch",     "nvrtc",  "constants"};
#define PARTS_MAX 2048

static const char help_text[] =
    "usage: kiln explain [--model CONFIG.json] [--dtype f16|bf16] --op NAME [--arch ARCH] [--db PATH]\n"
    "\n"
    "For each kernel of NAME that the model needs on ARCH, says whether the\n"
    "database holds it and, when not, which row is nearest (the most fingerprint\n"
    "parts in common) and which parts differ: schema, template, source, headers,\n"
    "options (digests), arch, nvrtc, constants. NAME is a template id\n"
    "(token_embedding, rms_norm, paged_attention, ...) or, where no kernel of the\n"
    "model has that template, an operation id of 'kiln ls-ops' (dense_swiglu, ...),\n"
    "which names each of its templates. The database is opened read-only.\n"
    "\n"
    "options:\n"
    "  -m, --model CONFIG.json  a Hugging Face config.json (default: the built-in\n"
    "                           Llama-3-8B shape)\n"
    "  -t, --dtype f16|bf16     the element type (default: the config's dtype or\n"
    "                           torch_dtype; f16 without one)\n"
    "  -p, --op NAME            the template or operation id to explain (required)\n"
    "  -a, --arch ARCH          target architecture (default: " CLI_DEFAULT_ARCH ")\n"
    "  -d, --db PATH            the database (default: $KILN_CACHE_DIR/kernels.db, else\n"
    "                           $XDG_CACHE_HOME/kiln/kernels.db, else $HOME/.cache/kiln/kernels.db)\n"
    "  -h, --help               print this help and exit\n"
    "\n"
    "output: one line per kernel (<template>: its template id),\n"
    "  <template> <constants> hit <fingerprint>\n"
    "  <template> <constants> miss <fingerprint> nearest <fingerprint> differs: <part> <have> -> <want>, ...\n"
    "  <template> <constants> miss <fingerprint> nearest none (the database is empty)\n"
    "(a row stored by schema 1 has no parts: only template, arch, nvrtc and\n"
    "constants are compared, and the line says 'parts unknown').\n"
    "\n"
    "exit status: 0 every kernel was explained (hit or miss); 1 a bad config or\n"
    "architecture, an operation the model does not use, a missing database; 2 a\n"
    "usage error.\n";

typedef struct row {
    char fp[2 * KILN_FINGERPRINT_SIZE + 1];
    char *parts; /* as stored; for schema 1 rows, made from the row's columns */
    int known;   /* parts were stored (schema 2) */
} row;

typedef struct rows {
    row *items;
    size_t n, cap;
    int oom;
} rows;

static int collect(void *user, const kiln_cache_entry_info *info)
{
    rows *r = user;
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 64;
        row *p = realloc(r->items, cap * sizeof *p);
        if (!p) {
            r->oom = 1;
            return 1;
        }
        r->items = p;
        r->cap = cap;
    }
    row *w = &r->items[r->n];
    kiln_fingerprint_hex(info->fingerprint, w->fp);
    w->known = info->parts && *info->parts;
    char made[PARTS_MAX];
    if (!w->known)
        snprintf(made, sizeof made, "template=%s;arch=%s;nvrtc=%d.%d;constants=%s", info->template_id, info->arch,
                 info->nvrtc_major, info->nvrtc_minor, info->constants);
    w->parts = strdup(w->known ? info->parts : made);
    if (!w->parts) {
        r->oom = 1;
        return 1;
    }
    r->n++;
    return 0;
}

/* Splits "name=value;..." into values by part (NULL when absent). text is changed. */
static void split_parts(char *text, const char *values[N_PARTS])
{
    for (int i = 0; i < N_PARTS; i++)
        values[i] = NULL;
    char *p = text;
    while (p && *p) {
        char *eq = strchr(p, '=');
        if (!eq)
            break;
        *eq = 0;
        int k = -1;
        for (int i = 0; i < N_PARTS; i++)
            if (!strcmp(p, part_names[i]))
                k = i;
        char *value = eq + 1;
        if (k == N_PARTS - 1) { /* constants: the rest */
            values[k] = value;
            break;
        }
        char *semi = strchr(value, ';');
        if (semi)
            *semi = 0;
        if (k >= 0)
            values[k] = value;
        p = semi ? semi + 1 : NULL;
    }
}

/* Parts that both have and that are equal; -1 when they share none. */
static int agreement(const char *const want[N_PARTS], const char *const have[N_PARTS])
{
    int same = 0, compared = 0;
    for (int i = 0; i < N_PARTS; i++) {
        if (!want[i] || !have[i])
            continue;
        compared++;
        same += !strcmp(want[i], have[i]);
    }
    return compared ? same : -1;
}

/* Whether NAME selects a kernel of template id: the id itself, or, where
 * templates (an operation's, space-separated) is given, one of them. */
static int selects(const char *name, const char *templates, const char *id)
{
    if (!templates)
        return !strcmp(name, id);
    const size_t len = strlen(id);
    for (const char *p = templates; *p;) {
        const size_t n = strcspn(p, " ");
        if (n == len && !strncmp(p, id, len))
            return 1;
        p += n + (p[n] == ' ');
    }
    return 0;
}

static void explain_miss(const char *want_text, const rows *db)
{
    char want_buf[PARTS_MAX], have_buf[PARTS_MAX];
    const char *want[N_PARTS], *have[N_PARTS];
    snprintf(want_buf, sizeof want_buf, "%s", want_text);
    split_parts(want_buf, want);
    const row *best = NULL;
    int best_score = -1;
    for (size_t i = 0; i < db->n; i++) {
        snprintf(have_buf, sizeof have_buf, "%s", db->items[i].parts);
        split_parts(have_buf, have);
        int score = agreement(want, have);
        /* A row with stored parts explains more than one without. */
        if (score > best_score || (score == best_score && best && !best->known && db->items[i].known)) {
            best = &db->items[i];
            best_score = score;
        }
    }
    if (!best) {
        printf(" nearest none (the database is empty)\n");
        return;
    }
    snprintf(have_buf, sizeof have_buf, "%s", best->parts);
    split_parts(have_buf, have);
    printf(" nearest %s differs:", best->fp);
    int first = 1;
    for (int i = 0; i < N_PARTS; i++) {
        if (!want[i] || !have[i] || !strcmp(want[i], have[i]))
            continue;
        char *shown = cli_escape(have[i]); /* the row's text, from the database */
        printf("%s %s %s -> %s", first ? "" : ",", part_names[i], shown ? shown : "?", want[i]);
        free(shown);
        first = 0;
    }
    if (first)
        printf(" nothing it stores (another part of the key)");
    if (!best->known)
        printf(" (parts unknown: a schema 1 row)");
    putchar('\n');
}

int cli_explain(int argc, char **argv)
{
    static const struct option longopts[] = {{"model", required_argument, NULL, 'm'},
                                             {"dtype", required_argument, NULL, 't'},
                                             {"op", required_argument, NULL, 'p'},
                                             {"arch", required_argument, NULL, 'a'},
                                             {"db", required_argument, NULL, 'd'},
                                             {"help", no_argument, NULL, 'h'},
                                             {NULL, 0, NULL, 0}};
    const char *model_path = NULL, *op = NULL, *arch = CLI_DEFAULT_ARCH, *db = NULL;
    kiln_dtype dtype = 0;
    int c, parsed;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":m:t:p:a:d:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm':
            model_path = optarg;
            break;
        case 't':
            if ((parsed = cli_parse_dtype(CMD, optarg, &dtype)))
                return parsed;
            break;
        case 'p':
            op = optarg;
            break;
        case 'a':
            arch = optarg;
            break;
        case 'd':
            db = optarg;
            break;
        case 'h':
            fputs(help_text, stdout);
            return CLI_EXIT_OK;
        default:
            return cli_getopt_error(CMD, c, argv);
        }
    }
    if (optind < argc)
        return cli_usage_error(CMD, "unexpected argument '%s'", argv[optind]);
    if (!op)
        return cli_usage_error(CMD, "no operation: give --op NAME");

    kiln_model_config config;
    kiln_spec *specs = NULL;
    size_t n_specs = 0, n_op = 0;
    kiln_cache *cache = NULL;
    kiln_jit *jit = NULL;
    rows r = {0};
    int rc = cli_load_model(CMD, model_path, arch, dtype, &config, &specs, &n_specs);
    if (rc)
        goto out;
    /* A template id the model uses; else an operation id: its templates. */
    const char *templates = NULL;
    for (size_t i = 0; i < n_specs; i++)
        n_op += selects(op, NULL, specs[i].template_id);
    kiln_op_info info = {.size = sizeof info};
    if (!n_op && kiln_op_catalog_find(op, &info) == KILN_OK) {
        templates = info.templates;
        for (size_t i = 0; i < n_specs; i++)
            n_op += selects(op, templates, specs[i].template_id);
    }
    if (!n_op) {
        fprintf(stderr, "kiln " CMD ": model %s uses no operation '%s'; it uses:", config.name, op);
        for (size_t i = 0; i < n_specs; i++) {
            size_t j = 0;
            while (j < i && strcmp(specs[j].template_id, specs[i].template_id))
                j++;
            if (j == i)
                fprintf(stderr, " %s", specs[i].template_id);
        }
        fputc('\n', stderr);
        rc = CLI_EXIT_FAILURE;
        goto out;
    }
    if ((rc = cli_open_existing(CMD, db, &cache)))
        goto out;
    /* The keys are computed as a lookup would; nothing is compiled. */
    kiln_jit_options jo = {.size = sizeof jo, .arch = arch};
    if (kiln_jit_create(&jo, &jit) != KILN_OK) {
        rc = cli_fail(CMD, "--arch %s: %s", arch, kiln_errmsg());
        goto out;
    }
    if (kiln_cache_foreach(cache, collect, &r) != KILN_OK || r.oom) {
        rc = cli_fail(CMD, "%s", r.oom ? "out of memory" : kiln_errmsg());
        goto out;
    }
    for (size_t i = 0; i < n_specs; i++) {
        if (!selects(op, templates, specs[i].template_id))
            continue;
        uint8_t fp[KILN_FINGERPRINT_SIZE];
        char hex[2 * KILN_FINGERPRINT_SIZE + 1], consts[PARTS_MAX], parts[PARTS_MAX];
        if (kiln_jit_fingerprint(jit, &specs[i], fp) != KILN_OK ||
            kiln_spec_constants_text(&specs[i], consts, sizeof consts) != KILN_OK ||
            kiln_jit_fingerprint_parts(jit, &specs[i], parts, sizeof parts) != KILN_OK) {
            rc = cli_fail(CMD, "%s", kiln_errmsg());
            goto out;
        }
        kiln_fingerprint_hex(fp, hex);
        int found = 0;
        for (size_t k = 0; k < r.n && !found; k++)
            found = !strcmp(r.items[k].fp, hex);
        printf("%s %s %s %s", specs[i].template_id, consts, found ? "hit" : "miss", hex);
        if (found)
            putchar('\n');
        else
            explain_miss(parts, &r);
    }
    if (fflush(stdout) != 0 || ferror(stdout))
        rc = cli_fail(CMD, "cannot write the output");
out:
    for (size_t i = 0; i < r.n; i++)
        free(r.items[i].parts);
    free(r.items);
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
    kiln_free(specs);
    return rc;
}
