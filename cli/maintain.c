/* kiln verify and kiln gc: check a cache database, shrink it. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char verify_help[] =
    "usage: kiln verify [--db PATH]\n"
    "\n"
    "Decodes every kernel of a cache database and checks its size and SHA-256\n"
    "checksum and that its columns agree with its fingerprint parts; recomputes\n"
    "the key of every row this kiln can (same templates, options and NVRTC) and\n"
    "checks it is the row's own; then runs SQLite's integrity check. Nothing is\n"
    "changed: a bad row is reported, not removed (the next load of it drops it).\n"
    "\n"
    "options:\n"
    "  -d, --db PATH   the database (default: $KILN_CACHE_DIR/kernels.db, else\n"
    "                  $XDG_CACHE_HOME/kiln/kernels.db, else $HOME/.cache/kiln/kernels.db)\n"
    "  -h, --help      print this help and exit\n"
    "\n"
    "output: one line per bad row,\n"
    "  bad <fingerprint> <what failed>\n"
    "then, when the integrity check passed,\n"
    "  keys <path>: <K> of <N> recomputed from their rows (...)\n"
    "and one line,\n"
    "  verified <path>: <N> rows, <B> bad, integrity ok|failed\n"
    "and one of the tuning rows and coverage records (checksums, ids, payloads),\n"
    "  tuning and coverage <path>: <T> tuning rows, <B> bad, <C> coverage records, <D> bad\n"
    "then its signature ('kiln sign'), a line per row that is not as signed\n"
    "  bad <fingerprint> <what differs>\n"
    "and one line,\n"
    "  signature <path>: unsigned | valid, key <key id>, <N> rows as signed[, trusted\n"
    "                    | , not trusted] | invalid: <why>\n"
    "(trusted or not: whether $KILN_TRUSTED_KEYS, when set, lists the key).\n"
    "When $KILN_CACHE_REMOTE names a remote tier, every row under its prefix is\n"
    "then read (SCAN, then GET) and checked as a fetch checks it: a line per bad\n"
    "row,\n"
    "  bad <key> <what failed>\n"
    "and one line,\n"
    "  remote <url>: <N> rows verified, <B> bad[ (first: <key>: <what failed>)],\n"
    "                <L> leases, <K> other keys\n"
    "                | failed: <why> (<N> rows verified, <B> bad before it)\n"
    "                | skipped: <why>   (a trust policy keeps the tier off)\n"
    "\n"
    "exit status: 0 every row is whole, the integrity check passed and the\n"
    "signature is valid or absent; 1 a bad row, a failed integrity check, an\n"
    "invalid signature, under $KILN_TRUSTED_KEYS a database unsigned or signed by\n"
    "a key it does not list, a missing or unreadable database, a bad remote row,\n"
    "a remote tier that cannot be read or is skipped; 2 a usage error.\n";

static const char gc_help[] =
    "usage: kiln gc [--db PATH] --max-bytes N | --older-than DAYS\n"
    "\n"
    "Drops kernels from a cache database in one transaction, least recently used\n"
    "first (then the oldest created): with --older-than, every kernel not used for\n"
    "DAYS days; with --max-bytes, as many more as it takes for the stored (zstd)\n"
    "bytes to fit in N. Both may be given. A dropped kernel is compiled again\n"
    "when next needed. The freed pages are then given back to the filesystem: the\n"
    "file shrinks (in a database made by an older kiln, only when the disk has\n"
    "room for a copy of it; else gc says so and exits 1, the rows deleted).\n"
    "\n"
    "options:\n"
    "  -d, --db PATH        the database (default: $KILN_CACHE_DIR/kernels.db, else\n"
    "                       $XDG_CACHE_HOME/kiln/kernels.db, else $HOME/.cache/kiln/kernels.db)\n"
    "  -b, --max-bytes N    keep at most N stored bytes; N >= 1, with an optional\n"
    "                       suffix K, M, G or T (powers of 1024)\n"
    "  -o, --older-than DAYS  drop kernels unused for more than DAYS days (> 0,\n"
    "                       fractions allowed: 0.5 is twelve hours)\n"
    "  -h, --help           print this help and exit\n"
    "\n"
    "output: one line,\n"
    "  gc <path>: removed <R> rows (<B> bytes), kept <K> rows (<S> bytes)\n"
    "\n"
    "exit status: 0 success; 1 a missing, read-only or unusable database, or a\n"
    "file that could not shrink; 2 a usage error (no limit, a bad number).\n";

/* The key check: each row's fingerprint recomputed from its columns, with
 * one offline jit per architecture (no cache: nothing is compiled). */
#define KEY_JITS 8
typedef struct key_check {
    kiln_jit *jits[KEY_JITS];
    char arch[KEY_JITS][16];
    size_t n_jits;
    uint64_t rows, checked, bad;
    uint8_t (*found_bad)[KILN_FINGERPRINT_SIZE]; /* rows kiln_cache_verify reported, not counted twice */
    size_t n_found_bad, cap_found_bad;
} key_check;

static void print_bad(void *user, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE], const char *detail)
{
    key_check *k = user;
    if (k->n_found_bad == k->cap_found_bad) {
        size_t cap = k->cap_found_bad ? 2 * k->cap_found_bad : 16;
        void *p = realloc(k->found_bad, cap * sizeof *k->found_bad);
        if (p) {
            k->found_bad = p;
            k->cap_found_bad = cap;
        }
    }
    if (k->n_found_bad < k->cap_found_bad)
        memcpy(k->found_bad[k->n_found_bad++], fingerprint, KILN_FINGERPRINT_SIZE);
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fingerprint, hex);
    char *shown = cli_escape(detail ? detail : ""); /* it may quote the row's text */
    printf("bad %s %s\n", hex, shown ? shown : "(out of memory)");
    free(shown);
}

static kiln_jit *jit_for(key_check *k, const char *arch)
{
    for (size_t i = 0; i < k->n_jits; i++)
        if (!strcmp(k->arch[i], arch))
            return k->jits[i];
    kiln_jit *j = NULL;
    kiln_jit_options o = {.size = sizeof o, .arch = arch, .compile = KILN_JIT_COMPILE_ON}; /* keys only */
    if (k->n_jits == KEY_JITS || strlen(arch) >= sizeof k->arch[0] || kiln_jit_create(&o, &j) != KILN_OK)
        return NULL;
    snprintf(k->arch[k->n_jits], sizeof k->arch[0], "%s", arch);
    k->jits[k->n_jits++] = j;
    return j;
}

/* A spec from a row's template_id and "NAME=value;..." constants: 0, or -1
 * when they make none. */
static int spec_of(const kiln_cache_entry_info *info, kiln_spec *spec)
{
    char text[KILN_SPEC_MAX_CONSTANTS * (KILN_NAME_MAX + 24)];
    if (kiln_spec_init(spec, info->template_id) != KILN_OK || strlen(info->constants) >= sizeof text)
        return -1;
    strcpy(text, info->constants);
    for (char *save = NULL, *item = strtok_r(text, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
        char *eq = strchr(item, '='), *end = NULL;
        if (!eq)
            return -1;
        *eq = 0;
        errno = 0;
        long long v = strtoll(eq + 1, &end, 10);
        if (errno || end == eq + 1 || *end || kiln_spec_set(spec, item, v) != KILN_OK)
            return -1;
    }
    return 0;
}

/* A row whose parts are the ones this kiln computes from its columns (same
 * templates, options and NVRTC) has a key that can be recomputed: it must
 * be the row's own. Other rows (another kiln's, schema 1's) are counted as
 * not checked. */
static int check_key(void *user, const kiln_cache_entry_info *info)
{
    key_check *k = user;
    kiln_spec spec;
    char parts[2048], hex[2 * KILN_FINGERPRINT_SIZE + 1], want[2 * KILN_FINGERPRINT_SIZE + 1];
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    k->rows++;
    for (size_t i = 0; i < k->n_found_bad; i++)
        if (!memcmp(k->found_bad[i], info->fingerprint, KILN_FINGERPRINT_SIZE))
            return 0;
    kiln_jit *j = *info->parts && !spec_of(info, &spec) ? jit_for(k, info->arch) : NULL;
    if (!j || kiln_jit_fingerprint_parts(j, &spec, parts, sizeof parts) != KILN_OK || strcmp(parts, info->parts) ||
        kiln_jit_fingerprint(j, &spec, fp) != KILN_OK)
        return 0;
    k->checked++;
    if (!memcmp(fp, info->fingerprint, KILN_FINGERPRINT_SIZE))
        return 0;
    k->bad++;
    kiln_fingerprint_hex(info->fingerprint, hex);
    kiln_fingerprint_hex(fp, want);
    /* The row's text, escaped for a terminal. */
    char *id = cli_escape(info->template_id), *consts = cli_escape(info->constants), *arch = cli_escape(info->arch);
    printf("bad %s the key is not the fingerprint of the row's kernel, %s %s for %s with NVRTC %d.%d, which is %s:"
           " the key was edited or swapped with another row's; no load takes this row (a prewarm that needs the"
           " kernel stores it again; gc drops the row in time)\n",
           hex, id ? id : "?", consts ? consts : "?", arch ? arch : "?", info->nvrtc_major, info->nvrtc_minor, want);
    free(id);
    free(consts);
    free(arch);
    return 0;
}

int cli_verify_cache(const char *cmd, kiln_cache *cache) { return cli_verify_cache_as(cmd, cache, NULL); }

int cli_verify_cache_as(const char *cmd, kiln_cache *cache, const char *shown)
{
    kiln_cache_verify_report report;
    key_check keys = {0};
    kiln_status st = kiln_cache_verify(cache, print_bad, &keys, &report);
    if (st == KILN_OK && report.integrity_ok)
        st = kiln_cache_foreach(cache, check_key, &keys);
    for (size_t i = 0; i < keys.n_jits; i++)
        kiln_jit_destroy(keys.jits[i]);
    free(keys.found_bad);
    if (st != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    report.bad_rows += keys.bad;
    if (report.integrity_ok)
        printf("keys %s: %" PRIu64 " of %" PRIu64 " recomputed from their rows (the others were made by another"
               " kiln, NVRTC or options)\n",
               shown ? shown : kiln_cache_path(cache), keys.checked, keys.rows);
    printf("verified %s: %" PRIu64 " rows, %" PRIu64 " bad, integrity %s\n", shown ? shown : kiln_cache_path(cache),
           report.rows, report.bad_rows, report.integrity_ok ? "ok" : "failed");
    printf("tuning and coverage %s: %" PRIu64 " tuning rows, %" PRIu64 " bad, %" PRIu64 " coverage records, %" PRIu64
           " bad\n",
           shown ? shown : kiln_cache_path(cache), report.tuning_rows, report.bad_tuning_rows, report.coverage_rows,
           report.bad_coverage_rows);
    if (fflush(stdout) != 0 || ferror(stdout))
        return cli_fail(cmd, "cannot write the output");
    if (!report.integrity_ok)
        return cli_fail(cmd, "%s", kiln_cache_errmsg(cache));
    if (report.bad_rows)
        return cli_fail(cmd, "%" PRIu64 " of %" PRIu64 " rows failed verification", report.bad_rows, report.rows);
    if (report.bad_tuning_rows || report.bad_coverage_rows)
        return cli_fail(cmd, "%" PRIu64 " of %" PRIu64 " tuning rows and %" PRIu64 " of %" PRIu64
                             " coverage records failed verification (a bad tuning row is timed again at its next"
                             " use; a bad coverage record is written again by the next prewarm of its model)",
                        report.bad_tuning_rows, report.tuning_rows, report.bad_coverage_rows, report.coverage_rows);
    return CLI_EXIT_OK;
}

static void print_bad_remote(void *user, const char *key, const char *detail)
{
    (void)user;
    char *k = cli_escape(key), *shown = cli_escape(detail ? detail : "");
    printf("bad %s %s\n", k ? k : "(out of memory)", shown ? shown : "(out of memory)");
    free(k);
    free(shown);
}

/* The remote tier of $KILN_CACHE_REMOTE, through a handle of its own on the
 * same file, under the trust policy a serving process would have. */
static int verify_remote(const char *cmd, const char *path, const char *url)
{
    static const char *const no_layers[1] = {NULL};
    kiln_cache_options opts = {.size = sizeof opts,
                               .path = path,
                               .read_only = 1,
                               .existing_only = 1,
                               .remote = url,
                               .readonly_paths = no_layers,
                               .n_readonly_paths = 0};
    kiln_cache *cache = NULL;
    kiln_cache_remote_verify_report r = {.size = sizeof r};
    if (kiln_cache_open(&opts, &cache) != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    kiln_status st = kiln_cache_verify_remote(cache, print_bad_remote, NULL, &r);
    kiln_cache_close(cache);
    if (st != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    char *reason = cli_escape(r.reason), *first = cli_escape(r.first_bad[0]);
    int rc = CLI_EXIT_OK;
    if (r.state == KILN_CACHE_REMOTE_SKIPPED) {
        printf("remote %s: skipped: %s\n", url, reason ? reason : "(out of memory)");
        rc = cli_fail(cmd, "remote %s is skipped: nothing was verified", url);
    } else if (r.state == KILN_CACHE_REMOTE_FAILED) {
        printf("remote %s: failed: %s (%" PRIu64 " rows verified, %" PRIu64 " bad before it)\n", url,
               reason ? reason : "(out of memory)", r.rows, r.bad_rows);
        rc = cli_fail(cmd, "remote %s could not be read to the end", url);
    } else {
        printf("remote %s: %" PRIu64 " rows verified, %" PRIu64 " bad", url, r.rows, r.bad_rows);
        if (r.bad_rows)
            printf(" (first: %s)", first ? first : "(out of memory)");
        printf(", %" PRIu64 " leases, %" PRIu64 " other keys\n", r.leases, r.other_keys);
        if (r.bad_rows)
            rc = cli_fail(cmd, "%" PRIu64 " of %" PRIu64 " remote rows failed verification (a fetch refuses each;"
                               " the next compile of its kernel publishes a good row over it)",
                          r.bad_rows, r.rows);
    }
    free(reason);
    free(first);
    if (fflush(stdout) != 0 || ferror(stdout))
        return cli_fail(cmd, "cannot write the output");
    return rc;
}

int cli_verify(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"db", required_argument, NULL, 'd'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    const char *cmd = "verify", *db = NULL;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":d:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'd':
            db = optarg;
            break;
        case 'h':
            fputs(verify_help, stdout);
            return CLI_EXIT_OK;
        default:
            return cli_getopt_error(cmd, c, argv);
        }
    }
    if (optind < argc)
        return cli_usage_error(cmd, "unexpected argument '%s'", argv[optind]);
    kiln_cache *cache;
    int rc = cli_open_existing(cmd, db, &cache);
    if (rc)
        return rc;
    rc = cli_verify_cache(cmd, cache);
    int sig_rc = cli_verify_signature(cmd, kiln_cache_path(cache));
    const char *url = getenv("KILN_CACHE_REMOTE");
    int remote_rc = url && *url ? verify_remote(cmd, kiln_cache_path(cache), url) : CLI_EXIT_OK;
    kiln_cache_close(cache);
    return rc ? rc : sig_rc ? sig_rc : remote_rc;
}

/* "4096", "64K", "2G": a byte count >= 1. 0 on success, -1 otherwise. */
static int parse_bytes(const char *text, uint64_t *out)
{
    char *end = NULL;
    if (!text || *text < '0' || *text > '9')
        return -1;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno)
        return -1;
    unsigned shift = 0;
    if (*end) {
        const char *units = "KMGT";
        const char *u = strchr(units, *end >= 'a' && *end <= 'z' ? *end - 'a' + 'A' : *end);
        if (!u || end[1])
            return -1;
        shift = 10u * (unsigned)(u - units + 1);
    }
    if (v == 0 || (shift && v > (UINT64_MAX >> shift)))
        return -1;
    *out = (uint64_t)v << shift;
    return 0;
}

/* "30", "0.5": days > 0, as seconds >= 1. 0 on success, -1 otherwise. */
static int parse_days(const char *text, int64_t *seconds)
{
    char *end = NULL;
    if (!text || !*text)
        return -1;
    errno = 0;
    double d = strtod(text, &end);
    /* A century is more than any cache lives; beyond it the number is a typo. */
    if (errno || *end || !isfinite(d) || d <= 0 || d > 36525)
        return -1;
    double s = d * 86400.0;
    *seconds = s < 1 ? 1 : (int64_t)(s + 0.5);
    return 0;
}

int cli_gc(int argc, char **argv)
{
    static const struct option longopts[] = {{"db", required_argument, NULL, 'd'},
                                             {"max-bytes", required_argument, NULL, 'b'},
                                             {"older-than", required_argument, NULL, 'o'},
                                             {"help", no_argument, NULL, 'h'},
                                             {NULL, 0, NULL, 0}};
    const char *cmd = "gc", *db = NULL;
    kiln_cache_gc_options opts = {.size = sizeof opts};
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":d:b:o:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'd':
            db = optarg;
            break;
        case 'b':
            if (parse_bytes(optarg, &opts.max_bytes))
                return cli_usage_error(cmd, "--max-bytes %s: must be a whole number >= 1, with an optional "
                                            "K, M, G or T suffix", optarg);
            break;
        case 'o':
            if (parse_days(optarg, &opts.older_than_seconds))
                return cli_usage_error(cmd, "--older-than %s: must be a number of days in (0, 36525]", optarg);
            break;
        case 'h':
            fputs(gc_help, stdout);
            return CLI_EXIT_OK;
        default:
            return cli_getopt_error(cmd, c, argv);
        }
    }
    if (optind < argc)
        return cli_usage_error(cmd, "unexpected argument '%s'", argv[optind]);
    if (!opts.max_bytes && !opts.older_than_seconds)
        return cli_usage_error(cmd, "give --max-bytes N or --older-than DAYS (or both)");
    kiln_cache *cache;
    int rc = cli_open_existing_writable(cmd, db, &cache);
    if (rc)
        return rc;
    uint64_t rows = 0, bytes = 0;
    kiln_cache_stats left;
    char *gc_failure = NULL;
    /* Rows deleted but a file that could not shrink: the rows line, then why. */
    if (kiln_cache_gc(cache, &opts, &rows, &bytes) != KILN_OK &&
        !(rows && (gc_failure = strdup(kiln_errmsg())))) {
        rc = cli_fail(cmd, "%s", kiln_errmsg());
        goto out_close;
    }
    if (kiln_cache_get_stats(cache, &left) != KILN_OK) {
        rc = cli_fail(cmd, "%s", kiln_errmsg());
        goto out_close;
    }
    printf("gc %s: removed %" PRIu64 " rows (%" PRIu64 " bytes), kept %" PRIu64 " rows (%" PRIu64 " bytes)\n",
           kiln_cache_path(cache), rows, bytes, left.entries, left.stored_bytes);
    if (fflush(stdout) != 0 || ferror(stdout))
        rc = cli_fail(cmd, "cannot write the output");
    else if (gc_failure)
        rc = cli_fail(cmd, "%s", gc_failure);
out_close:
    free(gc_failure);
    kiln_cache_close(cache);
    return rc;
}
