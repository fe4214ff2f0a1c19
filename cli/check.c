/* kiln check: whether the databases hold every kernel a model needs, so that
 * a server in strict mode (KILN_JIT=off) never has to compile. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../jit/nearest.h" /* compiled into the CLI too: it links only the API */
#include "cli.h"

#define CMD "check"

static const char help_text[] =
    "usage: kiln check [--model CONFIG.json] [--dtype f16|bf16] [--arch ARCH] [--db PATH]\n"
    "       kiln check [--db PATH]\n"
    "\n"
    "Says whether the database and the read-only layers of $KILN_CACHE_READONLY\n"
    "hold every kernel the model needs on ARCH with this NVRTC, each row verified\n"
    "as a load would verify it: what a process with KILN_JIT=off needs in order\n"
    "never to fail with jit_disabled. Nothing is compiled, written or created.\n"
    "Without --model, every coverage record in the database (what 'kiln prewarm'\n"
    "stores: a model, its serving envelope, the kernels they need, an arch and an\n"
    "NVRTC version) is checked that way instead; a database without records is\n"
    "checked for the built-in Llama-3-8B shape.\n"
    "\n"
    "options:\n"
    CLI_HELP_MODEL_DTYPE
    "  -a, --arch ARCH          target architecture (default: " CLI_DEFAULT_ARCH ")\n"
    CLI_HELP_DB
    "  -h, --help               print this help and exit\n"
    "\n"
    "output: one line per missing kernel, with explain's reason,\n"
    "  <template> <constants> missing <fingerprint> nearest <fingerprint> differs: <part> <have> -> <want>, ...\n"
    "then one summary line,\n"
    "  summary: model <name>, arch <arch>: <N> needed, <M> present, <K> missing, database <path>, <L> layers\n"
    "or, per coverage record,\n"
    "  summary: coverage <name> (<envelope>), arch <arch>, NVRTC <v>: <N> needed, <M> present, <K> missing, ...\n"
    "(a damaged record: coverage <id> bad: <reason>; one made for another NVRTC says so)\n"
    "\n"
    "exit status: 0 every kernel is present; 1 a kernel is missing, or a bad\n"
    "config, architecture or database (a missing one is not created); 2 a usage\n"
    "error.\n";

int cli_check(int argc, char **argv)
{
    cli_build_args a;
    int rc = cli_parse_model_args(CMD, argc, argv, help_text, &a);
    if (rc >= 0)
        return rc;
    kiln_model_config config;
    kiln_spec *specs = NULL;
    size_t n_specs = 0, n_missing = 0;
    kiln_cache *cache = NULL;
    kiln_jit *jit = NULL;
    kiln__rows rows = {0};
    int listed = 0;
    if ((rc = cli_open_existing_layered(CMD, a.path, &cache)))
        goto out;
    cli_report_skipped_layers(cache);
    /* Without --model, the database's coverage records say what to check. */
    if (!a.model_path && (rc = cli_check_records(CMD, cache)) >= 0)
        goto out;
    if ((rc = cli_load_model(CMD, a.model_path, a.arch, a.dtype, &config, &specs, &n_specs)))
        goto out;
    /* Strict mode: a kernel no layer holds is reported, never compiled. */
    kiln_jit_options jo = {.size = sizeof jo, .cache = cache, .arch = a.arch, .compile = KILN_JIT_COMPILE_OFF};
    if (kiln_jit_create(&jo, &jit) != KILN_OK) {
        rc = cli_fail(CMD, "--arch %s: %s", a.arch, kiln_errmsg());
        goto out;
    }
    for (size_t i = 0; i < n_specs; i++) {
        kiln_status st = kiln_jit_prepare(jit, &specs[i], NULL);
        if (st == KILN_OK)
            continue;
        if (st != KILN_ERR_JIT_DISABLED) {
            rc = cli_fail(CMD, "%s", kiln_errmsg());
            goto out;
        }
        char hex[2 * KILN_FINGERPRINT_SIZE + 1], consts[KILN__PARTS_MAX], parts[KILN__PARTS_MAX];
        char why[KILN__EXPLAIN_MAX];
        if ((rc = cli_spec_texts(CMD, jit, &specs[i], hex, consts, parts)))
            goto out;
        /* The rows are listed once, at the first miss, for every miss. */
        if (!listed && (st = kiln__rows_collect(cache, &rows)) != KILN_OK) {
            rc = cli_fail(CMD, "%s", st == KILN_ERR_HOST_OUT_OF_MEMORY ? "out of memory" : kiln_errmsg());
            goto out;
        }
        listed = 1;
        kiln__rows_explain_miss(&rows, parts, cli_escape, why, sizeof why);
        printf("%s %s missing %s %s\n", specs[i].template_id, consts, hex, why);
        n_missing++;
    }
    printf("summary: model %s, arch %s: %zu needed, %zu present, %zu missing, database %s, %zu layers\n",
           config.name, kiln_jit_arch(jit), n_specs, n_specs - n_missing, n_missing, kiln_cache_path(cache),
           kiln_cache_layer_count(cache));
    if (fflush(stdout) != 0 || ferror(stdout))
        rc = cli_fail(CMD, "cannot write the output");
    else if (n_missing)
        rc = cli_fail(CMD, "%zu of %zu kernels are missing: 'kiln prewarm' with the same --model, --dtype and --arch "
                           "compiles them", n_missing, n_specs);
out:
    kiln__rows_free(&rows);
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
    kiln_free(specs);
    return rc;
}
