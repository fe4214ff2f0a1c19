/* kiln CLI internals: the commands and the helpers they share. Not API. */
#ifndef KILN_CLI_H
#define KILN_CLI_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <kiln/kiln.h>

/* Exit statuses, the same for every command. */
#define CLI_EXIT_OK 0
#define CLI_EXIT_FAILURE 1 /* the command ran and failed: bad config, arch, database, compile error */
#define CLI_EXIT_USAGE 2   /* the command line is wrong: unknown option, bad -j, stray argument */

/* Room for a database path (kiln_cache_open accepts up to 4095 bytes). */
#define CLI_PATH_MAX 4096
/* prewarm's and export's defaults and limits. */
#define CLI_DEFAULT_ARCH "sm_90"
#define CLI_MAX_JOBS 256

/* The help lines of --model, --dtype and a read --db, one text for every
 * command that takes them. */
#define CLI_HELP_MODEL_DTYPE                                                                                           \
    "  -m, --model CONFIG.json  a Hugging Face config.json (default: the built-in\n"                                  \
    "                           Llama-3-8B shape)\n"                                                                  \
    "  -t, --dtype f16|bf16     the element type (default: the config's dtype or\n"                                   \
    "                           torch_dtype; f16 without one)\n"
#define CLI_HELP_DB                                                                                                    \
    "  -d, --db PATH            the database (default: $KILN_CACHE_DIR/kernels.db, else\n"                            \
    "                           $XDG_CACHE_HOME/kiln/kernels.db, else $HOME/.cache/kiln/kernels.db)\n"

/* Each command takes argv with argv[0] = its name ("prewarm") and returns an exit status. */
int cli_prewarm(int argc, char **argv);
int cli_ls(int argc, char **argv);
int cli_stats(int argc, char **argv);
int cli_verify(int argc, char **argv);
int cli_gc(int argc, char **argv);
int cli_export(int argc, char **argv);
int cli_merge(int argc, char **argv);
int cli_explain(int argc, char **argv);
int cli_ls_ops(int argc, char **argv);
int cli_check(int argc, char **argv);
int cli_sign(int argc, char **argv);

/* Prints "kiln <cmd>: <message>" to stderr and returns CLI_EXIT_FAILURE. */
int cli_fail(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints "kiln <cmd>: <message>" and a pointer to --help to stderr; returns CLI_EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The database a command works on: db when given, else the default path
 * (KILN_CACHE_DIR, XDG_CACHE_HOME, HOME). Returns CLI_EXIT_OK or reports the
 * failure and returns CLI_EXIT_FAILURE. */
int cli_db_path(const char *cmd, const char *db, char *buf, size_t cap);
/* Opens an existing database read-only (nothing is created or written).
 * Returns CLI_EXIT_OK or reports the failure and returns CLI_EXIT_FAILURE. */
int cli_open_existing(const char *cmd, const char *db, kiln_cache **out);
/* The same, opened for writing (gc): still nothing is created. */
int cli_open_existing_writable(const char *cmd, const char *db, kiln_cache **out);
/* The same read-only database with the layers a server would search
 * ($KILN_CACHE_READONLY), as check needs. */
int cli_open_existing_layered(const char *cmd, const char *db, kiln_cache **out);

/* Prints "kiln: read-only layer PATH skipped: REASON" to stderr for each
 * read-only layer the cache opened without (the library never prints). */
void cli_report_skipped_layers(const kiln_cache *cache);

/* Loads the model (model_path, or the built-in shape when NULL), checks arch
 * and lists the specializations (*specs freed with kiln_free). dtype
 * (KILN_DTYPE_F16 or BF16; 0: the config's) overrides the config's element
 * type. Returns CLI_EXIT_OK or reports the failure and returns
 * CLI_EXIT_FAILURE. */
int cli_load_model(const char *cmd, const char *model_path, const char *arch, kiln_dtype dtype,
                   kiln_model_config *config, kiln_spec **specs, size_t *n_specs);
/* --dtype's value: "f16" or "bf16". Returns CLI_EXIT_OK, or reports the usage
 * error and returns CLI_EXIT_USAGE. */
int cli_parse_dtype(const char *cmd, const char *text, kiln_dtype *out);
/* Compiles the specs that cache lacks on up to jobs threads, printing one line
 * per spec and the summary on stdout (progress on stderr when it is a
 * terminal). Returns CLI_EXIT_OK when every spec is in the cache. */
int cli_prewarm_into(const char *cmd, const kiln_model_config *config, const kiln_spec *specs, size_t n_specs,
                     const char *arch, kiln_cache *cache, long jobs);
/* Verifies every row of cache (kiln_cache_verify), printing "bad <fingerprint>
 * <detail>" per bad row and a "verified" line on stdout. CLI_EXIT_OK when all
 * is whole; otherwise reports and returns CLI_EXIT_FAILURE. */
int cli_verify_cache(const char *cmd, kiln_cache *cache);
/* The same, naming the database shown (the path it will have) instead of its own. */
int cli_verify_cache_as(const char *cmd, kiln_cache *cache, const char *shown);
/* kiln verify's signature check of the database at path, under the trust
 * policy of $KILN_TRUSTED_KEYS: prints "bad <fingerprint> <detail>" per row
 * that is not as signed and one "signature <path>: ..." line. CLI_EXIT_OK
 * when unsigned without a policy, or validly signed (by a listed key under
 * a policy); otherwise reports and returns CLI_EXIT_FAILURE. */
int cli_verify_signature(const char *cmd, const char *path);
/* The number of online CPUs, in [1, CLI_MAX_JOBS]. */
long cli_default_jobs(void);

/* prewarm's and export's command line: --model, --dtype, --arch, -j, --help and one
 * database path option, path_opt: 'd' (--db) or 'o' (--output). Returns -1
 * when the command should go on with *out, else the exit status to return
 * (help printed: CLI_EXIT_OK; a usage error reported: CLI_EXIT_USAGE). */
#define CLI_MAX_BUCKETS 32
#define CLI_MAX_BUCKET_TOKENS 65536
typedef struct cli_build_args {
    const char *model_path, *arch, *path;
    long jobs;        /* cli_default_jobs() when -j is not given */
    kiln_dtype dtype; /* --dtype; 0 when not given (the config's) */
    int dry_run;      /* prewarm's --dry-run (path_opt 'd' only) */
    /* prewarm's serving envelope: batch buckets (tokens per step; default
     * 1), largest context and prefill chunk (0: not given), and --tune. */
    int64_t batch[CLI_MAX_BUCKETS];
    size_t n_batch;
    long max_context, prefill_chunk;
    int tune;
} cli_build_args;
/* --batch's list: increasing whole numbers in [1, CLI_MAX_BUCKET_TOKENS],
 * comma-separated, at most CLI_MAX_BUCKETS. 0, or -1 for a bad list. */
int cli_parse_buckets(const char *text, int64_t *out, size_t *n_out);

/* The canonical envelope text of a coverage record:
 * "dtype=f16;batch=1,8;context=8192;chunk=512" (context and chunk 0 when unset). */
void cli_envelope_text(const cli_build_args *a, const kiln_model_config *config, char *buf, size_t cap);
/* Writes the coverage record of the model (its config file at model_path, or
 * the built-in shape when NULL), the envelope and specs on arch into cache.
 * Prints "coverage <name>: <N> kernels, envelope <text>". */
int cli_write_coverage(const char *cmd, const char *model_path, const kiln_model_config *config,
                       const kiln_spec *specs, size_t n_specs, const char *arch, const char *envelope,
                       kiln_cache *cache);
/* check without --model: checks every coverage record of the database
 * against the layers. -1 when it holds none (check the built-in shape). */
int cli_check_records(const char *cmd, kiln_cache *cache);
/* Copies from's tuning rows that verify into to (export --tuning-from),
 * printing "tuning from <path>: <C> copied, <S> skipped". */
int cli_copy_tuning(const char *cmd, kiln_cache *from, kiln_cache *to);
/* --tune: a clear failure when no driver is present, else CLI_EXIT_OK. */
int cli_tune_check_gpu(const char *cmd);
/* Times the model's dense products for each bucket into cache's tuning rows. */
int cli_tune_model(const char *cmd, const kiln_model_config *m, const int64_t *buckets, size_t n_buckets,
                   kiln_cache *cache);
int cli_parse_build_args(const char *cmd, int argc, char **argv, const char *help, int path_opt,
                         cli_build_args *out);
/* check's: --model, --dtype, --arch, --db and --help (no -j, no --dry-run). */
int cli_parse_model_args(const char *cmd, int argc, char **argv, const char *help, cli_build_args *out);

/* What explain and check print of a spec: its fingerprint in hex, its
 * constants text and its fingerprint parts (KILN__PARTS_MAX bytes each).
 * Returns CLI_EXIT_OK or reports the failure and returns CLI_EXIT_FAILURE. */
int cli_spec_texts(const char *cmd, kiln_jit *jit, const kiln_spec *spec, char hex[2 * KILN_FINGERPRINT_SIZE + 1],
                   char *consts, char *parts);

/* Reports what getopt_long (run with opterr = 0 and an optstring that starts
 * with ':') returned for c = '?' or ':'; returns CLI_EXIT_USAGE. */
int cli_getopt_error(const char *cmd, int c, char **argv);

/* A copy of s (NULL: "") fit for a terminal, freed with free(): C0 and C1
 * controls, DEL and bytes that are not UTF-8 become \xNN and a backslash
 * \\, so that text read from a database cannot move the cursor, retitle the
 * window or start a line. NULL when out of memory. */
char *cli_escape(const char *s);

/* Parses a whole decimal number in [lo, hi]; 0 on success, -1 otherwise. */
int cli_parse_long(const char *text, long lo, long hi, long *out);

#endif
