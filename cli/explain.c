/* kiln explain: why a lookup would miss, part by part of the fingerprint. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "../jit/nearest.h" /* compiled into the CLI too: it links only the API */

#define CMD "explain"

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
    CLI_HELP_MODEL_DTYPE
    "  -p, --op NAME            the template or operation id to explain (required)\n"
    "  -a, --arch ARCH          target architecture (default: " CLI_DEFAULT_ARCH ")\n"
    CLI_HELP_DB
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

int cli_spec_texts(const char *cmd, kiln_jit *jit, const kiln_spec *spec, char hex[2 * KILN_FINGERPRINT_SIZE + 1],
                   char *consts, char *parts)
{
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    if (kiln_jit_fingerprint(jit, spec, fp) != KILN_OK ||
        kiln_spec_constants_text(spec, consts, KILN__PARTS_MAX) != KILN_OK ||
        kiln_jit_fingerprint_parts(jit, spec, parts, KILN__PARTS_MAX) != KILN_OK)
        return cli_fail(cmd, "%s: %s", spec->template_id, kiln_errmsg());
    kiln_fingerprint_hex(fp, hex);
    return CLI_EXIT_OK;
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
    kiln__rows r = {0};
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
    kiln_jit_options jo = {.size = sizeof jo, .arch = arch, .compile = KILN_JIT_COMPILE_ON};
    if (kiln_jit_create(&jo, &jit) != KILN_OK) {
        rc = cli_fail(CMD, "--arch %s: %s", arch, kiln_errmsg());
        goto out;
    }
    kiln_status st = kiln__rows_collect(cache, &r);
    if (st != KILN_OK) {
        rc = cli_fail(CMD, "%s", st == KILN_ERR_HOST_OUT_OF_MEMORY ? "out of memory" : kiln_errmsg());
        goto out;
    }
    for (size_t i = 0; i < n_specs; i++) {
        if (!selects(op, templates, specs[i].template_id))
            continue;
        char hex[2 * KILN_FINGERPRINT_SIZE + 1], consts[KILN__PARTS_MAX], parts[KILN__PARTS_MAX];
        if ((rc = cli_spec_texts(CMD, jit, &specs[i], hex, consts, parts)))
            goto out;
        int found = 0;
        for (size_t k = 0; k < r.n && !found; k++)
            found = !strcmp(r.items[k].fp, hex);
        printf("%s %s %s %s", specs[i].template_id, consts, found ? "hit" : "miss", hex);
        if (found) {
            putchar('\n');
        } else {
            char why[KILN__EXPLAIN_MAX];
            kiln__rows_explain_miss(&r, parts, cli_escape, why, sizeof why);
            printf(" %s\n", why);
        }
    }
    if (fflush(stdout) != 0 || ferror(stdout))
        rc = cli_fail(CMD, "cannot write the output");
out:
    kiln__rows_free(&r);
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
    kiln_free(specs);
    return rc;
}
