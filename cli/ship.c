/* kiln export and kiln merge: make a new database to ship. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

static const char export_help[] =
    "usage: kiln export [--model CONFIG.json] [--arch ARCH] [-j N] -o OUT.db\n"
    "\n"
    "Creates OUT.db holding exactly the kernels the model needs for ARCH, for\n"
    "shipping: every specialization is compiled into it (as 'kiln prewarm' does,\n"
    "with the same output), then every row is verified (as 'kiln verify' does).\n"
    "OUT.db must not exist yet; on any failure it is removed again. Read-only\n"
    "layers named in $KILN_CACHE_READONLY are not used: the result stands alone.\n"
    "Needs no GPU.\n"
    "\n"
    "options:\n"
    "  -m, --model CONFIG.json  a Hugging Face config.json (default: the built-in\n"
    "                           Llama-3-8B shape)\n"
    "  -a, --arch ARCH          target architecture, sm_XY[a|f] (default: " CLI_DEFAULT_ARCH ")\n"
    "  -o, --output OUT.db      the database to create (required)\n"
    "  -j, --jobs N             compile with N threads, 1..256 (default: the number\n"
    "                           of online CPUs)\n"
    "  -h, --help               print this help and exit\n"
    "\n"
    "output: prewarm's lines and summary, verify's lines, then\n"
    "  export <path>: <N> kernels\n"
    "\n"
    "exit status: 0 OUT.db is complete and verified; 1 a bad config or\n"
    "architecture, OUT.db exists already or cannot be created, a failed compile\n"
    "or verification; 2 a usage error.\n";

static const char merge_help[] =
    "usage: kiln merge SRC.db [SRC.db...] -o OUT.db\n"
    "\n"
    "Creates OUT.db holding the rows of every SRC.db (the union; a kernel in\n"
    "several is kept once, from the first). Every row is verified before it is\n"
    "copied: one that fails is skipped, counted and reported on stderr. The\n"
    "sources are only read. OUT.db must not exist yet; on a failure it is removed\n"
    "again. OUT.db is verified as 'kiln verify' does at the end.\n"
    "\n"
    "options:\n"
    "  -o, --output OUT.db  the database to create (required)\n"
    "  -h, --help           print this help and exit\n"
    "\n"
    "output: one line per source,\n"
    "  merged <src>: <C> copied, <S> skipped\n"
    "then verify's lines, then\n"
    "  merge <path>: <N> kernels from <K> databases\n"
    "\n"
    "exit status: 0 OUT.db is complete and verified (skipped rows are reported,\n"
    "not fatal); 1 a source is missing or not a kiln database, OUT.db exists\n"
    "already or cannot be created, a failed verification; 2 a usage error (no\n"
    "source, no -o).\n";

/* Removes a database and the files SQLite keeps beside it. */
static void remove_db(const char *path)
{
    static const char *const suffixes[] = {"", "-wal", "-shm", "-journal"};
    char buf[CLI_PATH_MAX + 16];
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        snprintf(buf, sizeof buf, "%s%s", path, suffixes[i]);
        unlink(buf);
    }
}

/* Creates path, which must not exist (O_EXCL: two runs cannot both win),
 * and opens it as a new, empty cache of its own. */
static int create_fresh(const char *cmd, const char *path, kiln_cache **out)
{
    *out = NULL;
    if (!*path)
        return cli_fail(cmd, "-o: empty path");
    if (strlen(path) >= CLI_PATH_MAX)
        return cli_fail(cmd, "-o: path longer than %d bytes", CLI_PATH_MAX - 1);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0)
        return cli_fail(cmd, "cannot create %s: %s%s", path, strerror(errno),
                        errno == EEXIST ? " (the output must be a new file)" : "");
    close(fd);
    /* SQLite takes an empty file for an empty database: kiln makes the schema. */
    kiln_cache_options opts = {.size = sizeof opts, .path = path, .ignore_env = 1};
    if (kiln_cache_open(&opts, out) != KILN_OK) {
        int rc = cli_fail(cmd, "%s", kiln_errmsg());
        remove_db(path);
        return rc;
    }
    return CLI_EXIT_OK;
}

/* Closes the new database; on failure removes it. The exit status. */
static int finish(const char *cmd, const char *path, kiln_cache *cache, int rc)
{
    /* A file to ship: no WAL beside it, every page in use. */
    if (rc == CLI_EXIT_OK && kiln_cache_seal(cache) != KILN_OK)
        rc = cli_fail(cmd, "%s", kiln_errmsg());
    kiln_cache_close(cache);
    if (rc == CLI_EXIT_OK && (fflush(stdout) != 0 || ferror(stdout)))
        rc = cli_fail(cmd, "cannot write the output");
    if (rc != CLI_EXIT_OK) {
        remove_db(path);
        fprintf(stderr, "kiln %s: removed %s\n", cmd, path);
    }
    return rc;
}

static int count_rows(const char *cmd, kiln_cache *cache, uint64_t *n)
{
    kiln_cache_stats s;
    if (kiln_cache_get_stats(cache, &s) != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    *n = s.entries;
    return CLI_EXIT_OK;
}

int cli_export(int argc, char **argv)
{
    const char *cmd = "export";
    cli_build_args a;
    int parsed = cli_parse_build_args(cmd, argc, argv, export_help, 'o', &a);
    if (parsed >= 0)
        return parsed;
    const char *model_path = a.model_path, *arch = a.arch, *out = a.path;
    long jobs = a.jobs;
    if (!out)
        return cli_usage_error(cmd, "no output: give -o OUT.db");

    /* A bad request is found before the output is created. */
    kiln_model_config config;
    kiln_spec *specs = NULL;
    size_t n_specs = 0;
    kiln_cache *cache = NULL;
    int rc = cli_load_model(cmd, model_path, arch, &config, &specs, &n_specs);
    if (rc || (rc = create_fresh(cmd, out, &cache)))
        goto out_free_specs;
    uint64_t rows = 0;
    if (!(rc = cli_prewarm_into(cmd, &config, specs, n_specs, arch, cache, jobs)) &&
        !(rc = cli_verify_cache(cmd, cache)) && !(rc = count_rows(cmd, cache, &rows)))
        printf("export %s: %" PRIu64 " kernels\n", out, rows);
    rc = finish(cmd, out, cache, rc);
out_free_specs:
    kiln_free(specs);
    return rc;
}

int cli_merge(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"output", required_argument, NULL, 'o'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    const char *cmd = "merge", *out = NULL;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":o:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'o':
            out = optarg;
            break;
        case 'h':
            fputs(merge_help, stdout);
            return CLI_EXIT_OK;
        default:
            return cli_getopt_error(cmd, c, argv);
        }
    }
    if (optind >= argc)
        return cli_usage_error(cmd, "no source database: give SRC.db [SRC.db...] -o OUT.db");
    if (!out)
        return cli_usage_error(cmd, "no output: give -o OUT.db");
    /* Every source is looked at before the output is created. */
    for (int i = optind; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0)
            return cli_fail(cmd, "cannot use %s: %s", argv[i], strerror(errno));
        if (!S_ISREG(sb.st_mode))
            return cli_fail(cmd, "%s is not a regular file", argv[i]);
    }
    kiln_cache *cache = NULL;
    int rc = create_fresh(cmd, out, &cache);
    if (rc)
        return rc;
    uint64_t rows = 0;
    for (int i = optind; i < argc; i++) {
        uint64_t copied = 0, skipped = 0;
        if (kiln_cache_merge(cache, argv[i], &copied, &skipped) != KILN_OK) {
            rc = cli_fail(cmd, "%s", kiln_errmsg());
            goto out_finish;
        }
        printf("merged %s: %" PRIu64 " copied, %" PRIu64 " skipped\n", argv[i], copied, skipped);
        if (skipped)
            fprintf(stderr, "kiln %s: %s: %" PRIu64 " rows failed verification and were not copied\n", cmd, argv[i],
                    skipped);
    }
    if (!(rc = cli_verify_cache(cmd, cache)) && !(rc = count_rows(cmd, cache, &rows)))
        printf("merge %s: %" PRIu64 " kernels from %d databases\n", out, rows, argc - optind);
out_finish:
    return finish(cmd, out, cache, rc);
}
