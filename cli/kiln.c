/* kiln — the command-line tool: dispatch, global options, shared helpers. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

static const char usage_text[] =
    "usage: kiln <command> [options]\n"
    "       kiln --help | --version\n"
    "\n"
    "kiln generates CUDA kernels with NVRTC and keeps the cubins in a SQLite\n"
    "database. None of these commands needs a GPU.\n"
    "\n"
    "commands:\n"
    "  prewarm   compile every kernel a model needs into the cache database\n"
    "  ls        list the kernels in a cache database\n"
    "  stats     totals of a cache database, per template\n"
    "  verify    decode every row and check its checksum, and SQLite's integrity\n"
    "  gc        drop the least recently used kernels (--max-bytes, --older-than)\n"
    "  export    a new database of exactly what one model needs, for shipping\n"
    "  merge     a new database holding the rows of several\n"
    "  sign      sign a database with an Ed25519 key, for a trust policy\n"
    "  explain   why a model's kernel would miss: the nearest row, the parts that differ\n"
    "  ls-ops    the operations kiln provides: id, version, capabilities, kernels\n"
    "  check     whether the databases hold every kernel a model needs (nothing to compile)\n"
    "\n"
    "'kiln <command> --help' describes a command's options.\n"
    "\n"
    "The default database is $KILN_CACHE_DIR/kernels.db, else\n"
    "$XDG_CACHE_HOME/kiln/kernels.db, else $HOME/.cache/kiln/kernels.db.\n"
    "\n"
    "exit status: 0 success, 1 failure (a bad config, architecture or database,\n"
    "a compile error), 2 usage error (unknown command or option, bad value).\n";

static void vreport(const char *cmd, const char *fmt, va_list ap)
{
    fprintf(stderr, "kiln%s%s: ", cmd ? " " : "", cmd ? cmd : "");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

int cli_fail(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vreport(cmd, fmt, ap);
    va_end(ap);
    return CLI_EXIT_FAILURE;
}

int cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vreport(cmd, fmt, ap);
    va_end(ap);
    fprintf(stderr, "try 'kiln%s%s --help'\n", cmd ? " " : "", cmd ? cmd : "");
    return CLI_EXIT_USAGE;
}

int cli_getopt_error(const char *cmd, int c, char **argv)
{
    /* getopt has stepped past the offending word, except inside "-xyz" clusters. */
    const char *arg = optind > 0 ? argv[optind - 1] : "?";
    if (c == ':')
        return cli_usage_error(cmd, "option %s needs a value", arg);
    if (optopt)
        return cli_usage_error(cmd, "unknown option -%c", optopt);
    return cli_usage_error(cmd, "unknown option %s", arg);
}

int cli_parse_long(const char *text, long lo, long hi, long *out)
{
    char *end = NULL;
    if (!text || !*text)
        return -1;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

int cli_db_path(const char *cmd, const char *db, char *buf, size_t cap)
{
    if (db) {
        if (!*db)
            return cli_fail(cmd, "--db: empty path");
        if (strlen(db) >= cap)
            return cli_fail(cmd, "--db: path longer than %zu bytes", cap - 1);
        strcpy(buf, db);
        return CLI_EXIT_OK;
    }
    if (kiln_cache_default_path(buf, cap) != KILN_OK)
        return cli_fail(cmd, "%s (use --db PATH)", kiln_errmsg());
    return CLI_EXIT_OK;
}

static int open_existing(const char *cmd, const char *db, int read_only, int layers, kiln_cache **out)
{
    char path[CLI_PATH_MAX];
    struct stat sb;
    *out = NULL;
    int rc = cli_db_path(cmd, db, path, sizeof path);
    if (rc)
        return rc;
    /* Say plainly that there is nothing there, rather than SQLite's "unable to open". */
    if (stat(path, &sb) != 0)
        return cli_fail(cmd, "cannot use cache database %s: %s%s", path, strerror(errno),
                        errno == ENOENT ? " ('kiln prewarm' creates one)" : "");
    if (!S_ISREG(sb.st_mode))
        return cli_fail(cmd, "cache database %s is not a regular file", path);
    /* The commands work on this one file, an existing kiln database: no
     * shipped layers from the environment (unless layers: check), never the
     * remote layer (check answers for the files, which a server may evict
     * from), and never a new database. */
    const char *follow = getenv("KILN_CACHE_FOLLOW_SYMLINKS");
    kiln_cache_options opts = {.size = sizeof opts,
                               .path = path,
                               .read_only = read_only,
                               .ignore_env = !layers,
                               .remote = "",
                               .existing_only = 1,
                               .follow_symlinks = follow && !strcmp(follow, "1")};
    if (kiln_cache_open(&opts, out) != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    return CLI_EXIT_OK;
}

void cli_report_skipped_layers(const kiln_cache *cache)
{
    for (size_t i = 0; i < kiln_cache_layer_count(cache); i++) {
        kiln_cache_layer_info info;
        if (kiln_cache_layer(cache, i, &info) == KILN_OK && !info.active)
            fprintf(stderr, "kiln: %s layer %s skipped: %s\n", info.remote ? "remote" : "read-only", info.path,
                    info.reason);
    }
}

int cli_open_existing(const char *cmd, const char *db, kiln_cache **out) { return open_existing(cmd, db, 1, 0, out); }
int cli_open_existing_layered(const char *cmd, const char *db, kiln_cache **out)
{
    return open_existing(cmd, db, 1, 1, out);
}

int cli_open_existing_writable(const char *cmd, const char *db, kiln_cache **out)
{
    return open_existing(cmd, db, 0, 0, out);
}

int main(int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*run)(int argc, char **argv);
    } commands[] = {{"prewarm", cli_prewarm}, {"ls", cli_ls},         {"stats", cli_stats},
                    {"verify", cli_verify},   {"gc", cli_gc},         {"export", cli_export},
                    {"merge", cli_merge},     {"explain", cli_explain}, {"ls-ops", cli_ls_ops},
                    {"check", cli_check},     {"sign", cli_sign}};

    if (argc < 2) {
        fputs(usage_text, stderr);
        return CLI_EXIT_USAGE;
    }
    const char *first = argv[1];
    if (!strcmp(first, "--help") || !strcmp(first, "-h") || !strcmp(first, "help")) {
        if (argc > 2 && strcmp(first, "help") == 0) {
            /* "kiln help prewarm" is "kiln prewarm --help". */
            for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
                if (!strcmp(argv[2], commands[i].name)) {
                    char help[] = "--help";
                    char *sub[] = {argv[2], help, NULL};
                    return commands[i].run(2, sub);
                }
            }
            return cli_usage_error(NULL, "unknown command '%s'", argv[2]);
        }
        fputs(usage_text, stdout);
        return CLI_EXIT_OK;
    }
    if (!strcmp(first, "--version") || !strcmp(first, "-V")) {
        if (argc > 2)
            return cli_usage_error(NULL, "--version takes no arguments");
        printf("kiln %s\n", kiln_version_string());
        return CLI_EXIT_OK;
    }
    if (first[0] == '-')
        return cli_usage_error(NULL, "unknown option %s", first);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(first, commands[i].name))
            return commands[i].run(argc - 1, argv + 1);
    return cli_usage_error(NULL, "unknown command '%s'", first);
}
