/* kiln ls and kiln stats: read a cache database without changing it. */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

static const char ls_help[] =
    "usage: kiln ls [--db PATH] [--json]\n"
    "\n"
    "Lists the kernels of a cache database, in fingerprint order: fingerprint,\n"
    "template id, constants, architecture, NVRTC version, raw and stored (zstd)\n"
    "size in bytes, hits, created and last-used times (UTC). The database is\n"
    "opened read-only: nothing is created or changed.\n"
    "\n"
    "options:\n"
    "  -d, --db PATH   the database (default: $KILN_CACHE_DIR/kernels.db, else\n"
    "                  $XDG_CACHE_HOME/kiln/kernels.db, else $HOME/.cache/kiln/kernels.db)\n"
    "  -J, --json      print one JSON array of objects with the keys fingerprint,\n"
    "                  template_id, constants, arch, nvrtc_version, entry_points,\n"
    "                  raw_size, stored_size, hits, created, last_used (times in\n"
    "                  seconds since the epoch)\n"
    "  -h, --help      print this help and exit\n"
    "\n"
    "exit status: 0 success; 1 the database is missing or unreadable; 2 a usage error.\n";

static const char stats_help[] =
    "usage: kiln stats [--db PATH] [--json]\n"
    "\n"
    "Prints the totals of a cache database (entries, raw bytes, stored bytes,\n"
    "compression ratio, tuning rows, coverage records) and the kernels' per\n"
    "template. The database is opened\n"
    "read-only: nothing is created or changed.\n"
    "\n"
    "options:\n"
    "  -d, --db PATH   the database (default: $KILN_CACHE_DIR/kernels.db, else\n"
    "                  $XDG_CACHE_HOME/kiln/kernels.db, else $HOME/.cache/kiln/kernels.db)\n"
    "  -J, --json      print one JSON object: {\"path\", \"entries\", \"raw_bytes\",\n"
    "                  \"stored_bytes\", \"tuning_rows\", \"coverage_records\",\n"
    "                  \"ratio\" (raw / stored, null when empty),\n"
    "                  \"templates\": {<id>: {\"entries\", \"raw_bytes\", \"stored_bytes\"}}}\n"
    "  -h, --help      print this help and exit\n"
    "\n"
    "exit status: 0 success; 1 the database is missing or unreadable; 2 a usage error.\n";

/* The length of the valid UTF-8 sequence at p (not at its end): 0 for a byte
 * that starts none, an overlong form, a surrogate or a code point past
 * U+10FFFF. */
static size_t utf8_len(const unsigned char *p)
{
    if (p[0] < 0x80)
        return 1;
    size_t n = p[0] >= 0xc2 && p[0] <= 0xdf ? 2 : p[0] >= 0xe0 && p[0] <= 0xef ? 3 : p[0] >= 0xf0 && p[0] <= 0xf4 ? 4 : 0;
    unsigned lo = p[0] == 0xe0 ? 0xa0 : p[0] == 0xf0 ? 0x90 : 0x80, hi = p[0] == 0xed ? 0x9f : p[0] == 0xf4 ? 0x8f : 0xbf;
    if (!n || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < n; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    return n;
}

/* A copy of s: for a terminal, controls (C0, DEL, C1), bytes that are not
 * UTF-8 and '\' escaped; else (JSON, whose writer escapes controls itself)
 * only bytes that are not UTF-8 replaced by U+FFFD. */
static char *transcribe(const char *s, int terminal)
{
    const unsigned char *p = (const unsigned char *)(s ? s : "");
    char *out = malloc(4 * strlen((const char *)p) + 1), *w = out;
    if (!out)
        return NULL;
    while (*p) {
        size_t n = utf8_len(p);
        int control = *p < 0x20 || *p == 0x7f || (p[0] == 0xc2 && p[1] < 0xa0);
        if (terminal && *p == '\\') {
            w += sprintf(w, "\\\\");
            p++;
        } else if (terminal && (!n || control)) {
            w += sprintf(w, "\\x%02x", *p++);
        } else if (!n) {
            w += sprintf(w, "\xef\xbf\xbd");
            p++;
        } else {
            memcpy(w, p, n);
            w += n;
            p += n;
        }
    }
    *w = 0;
    return out;
}

char *cli_escape(const char *s) { return transcribe(s, 1); }

/* Parses [--db PATH] [--json]. Returns -1 to go on, else the exit status. */
static int parse_args(const char *cmd, const char *help, int argc, char **argv, const char **db, int *json)
{
    static const struct option longopts[] = {{"db", required_argument, NULL, 'd'},
                                             {"json", no_argument, NULL, 'J'},
                                             {"help", no_argument, NULL, 'h'},
                                             {NULL, 0, NULL, 0}};
    int c;
    *db = NULL;
    *json = 0;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":d:Jh", longopts, NULL)) != -1) {
        switch (c) {
        case 'd':
            *db = optarg;
            break;
        case 'J':
            *json = 1;
            break;
        case 'h':
            fputs(help, stdout);
            return CLI_EXIT_OK;
        default:
            return cli_getopt_error(cmd, c, argv);
        }
    }
    if (optind < argc)
        return cli_usage_error(cmd, "unexpected argument '%s'", argv[optind]);
    return -1;
}

/* Prints a JSON document and frees it; the exit status. */
static int print_json(const char *cmd, cJSON *doc)
{
    char *text = doc ? cJSON_Print(doc) : NULL;
    cJSON_Delete(doc);
    if (!text)
        return cli_fail(cmd, "out of memory building the JSON output");
    puts(text);
    cJSON_free(text);
    return CLI_EXIT_OK;
}

/* Output that could not be written (a full disk, a closed pipe) is a failure. */
static int finish_output(const char *cmd, int rc)
{
    if (fflush(stdout) != 0 || ferror(stdout))
        return cli_fail(cmd, "cannot write the output");
    return rc;
}

static int add_u64(cJSON *obj, const char *name, uint64_t v)
{
    char text[24];
    snprintf(text, sizeof text, "%" PRIu64, v);
    return cJSON_AddRawToObject(obj, name, text) != NULL;
}

static int add_i64(cJSON *obj, const char *name, int64_t v)
{
    char text[24];
    snprintf(text, sizeof text, "%" PRId64, v);
    return cJSON_AddRawToObject(obj, name, text) != NULL;
}

/* Text from the database is made valid UTF-8 first: JSON cannot hold other bytes. */
static int add_str(cJSON *obj, const char *name, const char *s)
{
    char *text = transcribe(s, 0);
    int ok = text && cJSON_AddStringToObject(obj, name, text) != NULL;
    free(text);
    return ok;
}

static void format_time(int64_t t, char *buf, size_t cap)
{
    struct tm tm;
    time_t tt = (time_t)t;
    if (t <= 0 || !gmtime_r(&tt, &tm) || !strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm))
        snprintf(buf, cap, "-");
}

/* ---- ls ---- */

typedef struct ls_state {
    cJSON *array; /* --json: the objects so far; NULL: print text */
    int oom;
} ls_state;

static int ls_row(void *user, const kiln_cache_entry_info *info)
{
    ls_state *s = user;
    char fp[2 * KILN_FINGERPRINT_SIZE + 1], nvrtc[32];
    kiln_fingerprint_hex(info->fingerprint, fp);
    snprintf(nvrtc, sizeof nvrtc, "%d.%d", info->nvrtc_major, info->nvrtc_minor);
    if (!s->array) {
        char created[32], last_used[32];
        format_time(info->created, created, sizeof created);
        format_time(info->last_used, last_used, sizeof last_used);
        char *id = cli_escape(info->template_id), *consts = cli_escape(info->constants), *arch = cli_escape(info->arch);
        if (id && consts && arch)
            printf("%s  %-16s %-36s %-7s %-6s %9" PRIu64 " %9" PRIu64 " %6" PRIu64 "  %s  %s\n", fp, id, consts, arch,
                   nvrtc, info->raw_size, info->stored_size, info->hits, created, last_used);
        s->oom = !id || !consts || !arch;
        free(id);
        free(consts);
        free(arch);
        return s->oom;
    }
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddItemToArray(s->array, o)) {
        cJSON_Delete(o);
        s->oom = 1;
        return 1;
    }
    if (!add_str(o, "fingerprint", fp) || !add_str(o, "template_id", info->template_id) ||
        !add_str(o, "constants", info->constants) || !add_str(o, "arch", info->arch) ||
        !add_str(o, "nvrtc_version", nvrtc) || !add_str(o, "entry_points", info->entries) ||
        !add_u64(o, "raw_size", info->raw_size) || !add_u64(o, "stored_size", info->stored_size) ||
        !add_u64(o, "hits", info->hits) || !add_i64(o, "created", info->created) ||
        !add_i64(o, "last_used", info->last_used)) {
        s->oom = 1;
        return 1;
    }
    return 0;
}

int cli_ls(int argc, char **argv)
{
    const char *cmd = "ls", *db;
    int json;
    int rc = parse_args(cmd, ls_help, argc, argv, &db, &json);
    if (rc >= 0)
        return rc;
    kiln_cache *cache;
    if ((rc = cli_open_existing(cmd, db, &cache)))
        return rc;
    ls_state s = {0};
    if (json && !(s.array = cJSON_CreateArray())) {
        rc = cli_fail(cmd, "out of memory");
        goto out_close;
    }
    if (!json)
        printf("%-64s  %-16s %-36s %-7s %-6s %9s %9s %6s  %-20s  %s\n", "fingerprint", "template", "constants", "arch",
               "nvrtc", "raw", "stored", "hits", "created", "last_used");
    if (kiln_cache_foreach(cache, ls_row, &s) != KILN_OK) {
        rc = cli_fail(cmd, "%s", kiln_errmsg());
        cJSON_Delete(s.array);
        goto out_close;
    }
    if (s.oom) {
        rc = cli_fail(cmd, "out of memory");
        cJSON_Delete(s.array);
        goto out_close;
    }
    rc = json ? print_json(cmd, s.array) : CLI_EXIT_OK;
    rc = finish_output(cmd, rc);
out_close:
    kiln_cache_close(cache);
    return rc;
}

/* ---- stats ---- */

typedef struct template_total {
    char *id;
    uint64_t entries, raw_bytes, stored_bytes;
} template_total;

typedef struct stats_state {
    template_total *items;
    size_t n, cap;
    int oom;
} stats_state;

static int stats_row(void *user, const kiln_cache_entry_info *info)
{
    stats_state *s = user;
    const char *id = info->template_id ? info->template_id : "";
    size_t i = 0;
    while (i < s->n && strcmp(s->items[i].id, id))
        i++;
    if (i == s->n) {
        if (s->n == s->cap) {
            size_t cap = s->cap ? 2 * s->cap : 8;
            template_total *p = realloc(s->items, cap * sizeof *p);
            if (!p) {
                s->oom = 1;
                return 1;
            }
            s->items = p;
            s->cap = cap;
        }
        template_total t = {.id = strdup(id)};
        if (!t.id) {
            s->oom = 1;
            return 1;
        }
        s->items[s->n++] = t;
    }
    s->items[i].entries++;
    s->items[i].raw_bytes += info->raw_size;
    s->items[i].stored_bytes += info->stored_size;
    return 0;
}

static int by_id(const void *a, const void *b)
{
    return strcmp(((const template_total *)a)->id, ((const template_total *)b)->id);
}

static cJSON *stats_json(const char *path, const kiln_cache_stats *st, const stats_state *s)
{
    cJSON *root = cJSON_CreateObject(), *templates = NULL;
    char ratio[32];
    if (st->stored_bytes)
        snprintf(ratio, sizeof ratio, "%.3f", (double)st->raw_bytes / (double)st->stored_bytes);
    else
        snprintf(ratio, sizeof ratio, "null");
    if (!root || !add_str(root, "path", path) || !add_u64(root, "entries", st->entries) ||
        !add_u64(root, "raw_bytes", st->raw_bytes) || !add_u64(root, "stored_bytes", st->stored_bytes) ||
        !add_u64(root, "tuning_rows", st->tuning_rows) || !add_u64(root, "coverage_records", st->coverage_rows) ||
        !cJSON_AddRawToObject(root, "ratio", ratio) || !(templates = cJSON_AddObjectToObject(root, "templates")))
        goto out_fail;
    for (size_t i = 0; i < s->n; i++) {
        char *id = transcribe(s->items[i].id, 0);
        cJSON *t = id ? cJSON_AddObjectToObject(templates, id) : NULL;
        free(id);
        if (!t || !add_u64(t, "entries", s->items[i].entries) || !add_u64(t, "raw_bytes", s->items[i].raw_bytes) ||
            !add_u64(t, "stored_bytes", s->items[i].stored_bytes))
            goto out_fail;
    }
    return root;
out_fail:
    cJSON_Delete(root);
    return NULL;
}

static int stats_text(const char *path, const kiln_cache_stats *st, const stats_state *s)
{
    printf("database      %s\n", path);
    printf("entries       %" PRIu64 "\n", st->entries);
    printf("raw bytes     %" PRIu64 "\n", st->raw_bytes);
    printf("stored bytes  %" PRIu64 "\n", st->stored_bytes);
    if (st->stored_bytes)
        printf("ratio         %.3f\n", (double)st->raw_bytes / (double)st->stored_bytes);
    else
        printf("ratio         -\n");
    printf("tuning rows   %" PRIu64 "\n", st->tuning_rows);
    printf("coverage      %" PRIu64 "\n", st->coverage_rows);
    if (!s->n)
        return 0;
    printf("\n%-24s %9s %12s %12s\n", "template", "entries", "raw bytes", "stored bytes");
    for (size_t i = 0; i < s->n; i++) {
        char *id = cli_escape(s->items[i].id);
        if (!id)
            return -1;
        printf("%-24s %9" PRIu64 " %12" PRIu64 " %12" PRIu64 "\n", id, s->items[i].entries, s->items[i].raw_bytes,
               s->items[i].stored_bytes);
        free(id);
    }
    return 0;
}

int cli_stats(int argc, char **argv)
{
    const char *cmd = "stats", *db;
    int json;
    int rc = parse_args(cmd, stats_help, argc, argv, &db, &json);
    if (rc >= 0)
        return rc;
    kiln_cache *cache;
    if ((rc = cli_open_existing(cmd, db, &cache)))
        return rc;
    kiln_cache_stats totals;
    stats_state s = {0};
    if (kiln_cache_get_stats(cache, &totals) != KILN_OK || kiln_cache_foreach(cache, stats_row, &s) != KILN_OK) {
        rc = cli_fail(cmd, "%s", kiln_errmsg());
        goto out_free;
    }
    if (s.oom) {
        rc = cli_fail(cmd, "out of memory");
        goto out_free;
    }
    if (s.n > 1)
        qsort(s.items, s.n, sizeof *s.items, by_id);
    if (json)
        rc = print_json(cmd, stats_json(kiln_cache_path(cache), &totals, &s));
    else if (stats_text(kiln_cache_path(cache), &totals, &s))
        rc = cli_fail(cmd, "out of memory");
    rc = finish_output(cmd, rc);
out_free:
    for (size_t i = 0; i < s.n; i++)
        free(s.items[i].id);
    free(s.items);
    kiln_cache_close(cache);
    return rc;
}
