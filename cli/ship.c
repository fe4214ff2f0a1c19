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
    "usage: kiln export [--model CONFIG.json] [--dtype f16|bf16] [--arch ARCH] [-j N]\n"
    "                   [--tuning-from DB] -o OUT.db\n"
    "\n"
    "Creates OUT.db holding exactly the kernels the model needs for ARCH, for\n"
    "shipping: every specialization is compiled into it (as 'kiln prewarm' does,\n"
    "with the same output), then every row is verified (as 'kiln verify' does).\n"
    "OUT.db must not exist yet. It is built as .OUT.db.kiln-tmp-XXXXXX beside it\n"
    "(the file prewarm's summary names) and renamed to OUT.db only once complete,\n"
    "sealed and verified: after a failure, or a kill, there is no OUT.db (a killed\n"
    "run leaves its temporary file, which may be deleted). Read-only layers named\n"
    "in $KILN_CACHE_READONLY are not used: the result stands alone. Needs no GPU.\n"
    "\n"
    "options:\n"
    "  -m, --model CONFIG.json  a Hugging Face config.json (default: the built-in\n"
    "                           Llama-3-8B shape)\n"
    "  -t, --dtype f16|bf16     the element type (default: the config's dtype or\n"
    "                           torch_dtype; f16 without one)\n"
    "  -a, --arch ARCH          target architecture, sm_XY[a|f] (default: " CLI_DEFAULT_ARCH ")\n"
    "  -o, --output OUT.db      the database to create (required)\n"
    "  -j, --jobs N             compile with N threads, 1..256 (default: the number\n"
    "                           of online CPUs)\n"
    "      --tuning-from DB     also copy DB's tuning rows (what 'kiln prewarm --tune'\n"
    "                           timed on the target GPU), each verified first\n"
    "  -h, --help               print this help and exit\n"
    "\n"
    "output: prewarm's lines and summary, the coverage record's line, with\n"
    "--tuning-from\n"
    "  tuning from <DB>: <C> copied, <S> skipped\n"
    "then verify's lines, then\n"
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
    "sources are only read. OUT.db must not exist yet; it is built under a\n"
    "temporary name beside it, as export's is, sealed, verified as 'kiln verify'\n"
    "does, and only then renamed to OUT.db.\n"
    "\n"
    "options:\n"
    "  -o, --output OUT.db  the database to create (required)\n"
    "  -h, --help           print this help and exit\n"
    "\n"
    "output: one line per source (rows of every kind: kernels, tuning rows,\n"
    "coverage records),\n"
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
    char buf[CLI_PATH_MAX + 48];
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        snprintf(buf, sizeof buf, "%s%s", path, suffixes[i]);
        unlink(buf);
    }
}

/* A new database is built under a temporary name beside its final path and
 * renamed into place only once complete, verified and sealed: a run killed
 * on the way leaves a ".NAME.kiln-tmp-XXXXXX" file, never NAME. */
typedef struct staged {
    const char *path;            /* the path asked for */
    char tmp[CLI_PATH_MAX + 32]; /* where it is built; empty before it exists */
} staged;

/* Checks that path does not exist, creates its temporary file (mkstemp:
 * O_EXCL, so a stale one from a killed run is never reused) and opens it as a
 * new, empty cache of its own. */
static int create_fresh(const char *cmd, const char *path, staged *out, kiln_cache **cache)
{
    *cache = NULL;
    out->path = path;
    out->tmp[0] = 0;
    if (!*path)
        return cli_fail(cmd, "-o: empty path");
    if (strlen(path) >= CLI_PATH_MAX)
        return cli_fail(cmd, "-o: path longer than %d bytes", CLI_PATH_MAX - 1);
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    if (!*base || !strcmp(base, ".") || !strcmp(base, ".."))
        return cli_fail(cmd, "-o: %s names a folder, not a file", path);
    struct stat sb;
    if (lstat(path, &sb) == 0)
        return cli_fail(cmd, "cannot create %s: it exists (the output must be a new file)", path);
    char tmp[sizeof out->tmp];
    snprintf(tmp, sizeof tmp, "%.*s.%s.kiln-tmp-XXXXXX", (int)(base - path), path, base);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0)
        return cli_fail(cmd, "cannot create %s: %s", path, strerror(errno));
    memcpy(out->tmp, tmp, sizeof tmp);
    /* mkstemp makes it 0600; the output is read by others as a new file would be. */
    mode_t mask = umask(0);
    umask(mask);
    int rc = fchmod(fd, 0644 & ~mask) == 0 ? CLI_EXIT_OK : cli_fail(cmd, "%s: %s", tmp, strerror(errno));
    close(fd);
    /* SQLite takes an empty file for an empty database: kiln makes the schema. */
    kiln_cache_options opts = {.size = sizeof opts, .path = out->tmp, .ignore_env = 1};
    if (rc == CLI_EXIT_OK && kiln_cache_open(&opts, cache) != KILN_OK)
        rc = cli_fail(cmd, "%s", kiln_errmsg());
    if (rc != CLI_EXIT_OK) {
        remove_db(out->tmp);
        out->tmp[0] = 0;
    }
    return rc;
}

/* Seals the new database (no WAL beside it, every page in use), then
 * verifies it and counts its rows: what is renamed into place is what was
 * verified. */
static int seal_and_verify(const char *cmd, const staged *out, kiln_cache *cache, uint64_t *rows)
{
    kiln_cache_stats s;
    if (kiln_cache_seal(cache) != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    int rc = cli_verify_cache_as(cmd, cache, out->path);
    if (rc)
        return rc;
    if (kiln_cache_get_stats(cache, &s) != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    *rows = s.entries;
    return CLI_EXIT_OK;
}

/* Flushes path's bytes to disk (a rename must not land before them). */
static int sync_path(const char *path, int flags)
{
    int fd = open(path, flags | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* Renames tmp to path unless path exists by then (another run's output is
 * never replaced). */
static int rename_new(const char *tmp, const char *path)
{
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RENAME_NOREPLACE) == 0)
        return 0;
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
        return -1;
    /* A filesystem without RENAME_NOREPLACE: a hard link refuses an existing name too. */
    if (link(tmp, path) != 0)
        return -1;
    unlink(tmp);
    return 0;
}

/* Closes the new database and, on success, renames it into place; on
 * failure removes it. The exit status. */
static int finish(const char *cmd, staged *out, kiln_cache *cache, int rc)
{
    kiln_cache_close(cache);
    if (!out->tmp[0])
        return rc;
    if (rc == CLI_EXIT_OK && (fflush(stdout) != 0 || ferror(stdout)))
        rc = cli_fail(cmd, "cannot write the output");
    if (rc == CLI_EXIT_OK && sync_path(out->tmp, O_RDONLY) != 0)
        rc = cli_fail(cmd, "cannot write %s: %s", out->tmp, strerror(errno));
    if (rc == CLI_EXIT_OK && rename_new(out->tmp, out->path) != 0)
        rc = cli_fail(cmd, "cannot create %s: %s%s", out->path, strerror(errno),
                      errno == EEXIST ? " (another run created it meanwhile)" : "");
    if (rc != CLI_EXIT_OK) {
        remove_db(out->tmp);
        fprintf(stderr, "kiln %s: removed %s\n", cmd, out->tmp);
        return rc;
    }
    /* The folder is synced too, so that the new name survives a power loss. */
    const char *slash = strrchr(out->path, '/');
    char dir[CLI_PATH_MAX];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - out->path + 1) : 1, slash ? out->path : ".");
    sync_path(dir, O_RDONLY | O_DIRECTORY);
    return rc;
}

int cli_export(int argc, char **argv)
{
    const char *cmd = "export", *tuning_from = NULL;
    cli_build_args a;
    /* --tuning-from is export's alone: taken out before the shared parser. */
    char *args[256];
    int n_args = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--tuning-from") || !strncmp(argv[i], "--tuning-from=", 14)) {
            if (argv[i][13] == '=')
                tuning_from = argv[i] + 14;
            else if (i + 1 < argc)
                tuning_from = argv[++i];
            else
                return cli_usage_error(cmd, "option --tuning-from needs a value");
            continue;
        }
        if (n_args == (int)(sizeof args / sizeof args[0]) - 1)
            return cli_usage_error(cmd, "too many arguments");
        args[n_args++] = argv[i];
    }
    args[n_args] = NULL;
    int parsed = cli_parse_build_args(cmd, n_args, args, export_help, 'o', &a);
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
    staged st = {0};
    kiln_cache *from = NULL;
    int rc = cli_load_model(cmd, model_path, arch, a.dtype, &config, &specs, &n_specs);
    if (rc || (tuning_from && (rc = cli_open_existing(cmd, tuning_from, &from))) ||
        (rc = create_fresh(cmd, out, &st, &cache)))
        goto out_free_specs;
    uint64_t rows = 0;
    char envelope[1024];
    cli_envelope_text(&a, &config, envelope, sizeof envelope);
    if (!(rc = cli_prewarm_into(cmd, &config, specs, n_specs, arch, cache, jobs)) &&
        !(rc = cli_write_coverage(cmd, model_path, &config, specs, n_specs, arch, envelope, cache)) &&
        !(rc = from ? cli_copy_tuning(cmd, from, cache) : 0) && !(rc = seal_and_verify(cmd, &st, cache, &rows)))
        printf("export %s: %" PRIu64 " kernels\n", out, rows);
    rc = finish(cmd, &st, cache, rc);
out_free_specs:
    kiln_cache_close(from);
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
    staged st;
    int rc = create_fresh(cmd, out, &st, &cache);
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
    if (!(rc = seal_and_verify(cmd, &st, cache, &rows)))
        printf("merge %s: %" PRIu64 " kernels from %d databases\n", out, rows, argc - optind);
out_finish:
    return finish(cmd, &st, cache, rc);
}
