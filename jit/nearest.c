/* The nearest row to a missing key, part by part of the fingerprint. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nearest.h"

/* The parts kiln__fingerprint_parts writes, in its order; constants last
 * (its value holds ';' and '=' of its own). */
#define N_PARTS 8
static const char *const part_names[N_PARTS] = {"schema",  "template", "source", "headers",
                                                "options", "arch",     "nvrtc",  "constants"};

typedef struct collector {
    kiln__rows *rows;
    int oom;
} collector;

static int collect(void *user, const kiln_cache_entry_info *info)
{
    collector *c = user;
    kiln__rows *r = c->rows;
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 64;
        kiln__row *p = realloc(r->items, cap * sizeof *p);
        if (!p) {
            c->oom = 1;
            return 1;
        }
        r->items = p;
        r->cap = cap;
    }
    kiln__row *w = &r->items[r->n];
    kiln_fingerprint_hex(info->fingerprint, w->fp);
    w->known = info->parts && *info->parts;
    char made[KILN__PARTS_MAX];
    if (!w->known)
        snprintf(made, sizeof made, "template=%s;arch=%s;nvrtc=%d.%d;constants=%s", info->template_id, info->arch,
                 info->nvrtc_major, info->nvrtc_minor, info->constants);
    w->parts = strdup(w->known ? info->parts : made);
    if (!w->parts) {
        c->oom = 1;
        return 1;
    }
    r->n++;
    return 0;
}

static kiln_status collect_one(kiln_cache *cache, kiln__rows *rows)
{
    collector c = {.rows = rows};
    kiln_status st = kiln_cache_foreach(cache, collect, &c);
    return c.oom ? KILN_ERR_HOST_OUT_OF_MEMORY : st;
}

kiln_status kiln__rows_collect(kiln_cache *cache, kiln__rows *rows)
{
    kiln_status st = collect_one(cache, rows);
    /* kiln_cache_foreach lists the writable database only: each layer the
     * cache searches is listed through a handle of its own. */
    for (size_t i = 0; !st && i < kiln_cache_layer_count(cache); i++) {
        kiln_cache_layer_info layer;
        if (kiln_cache_layer(cache, i, &layer) != KILN_OK || !layer.active || layer.remote)
            continue; /* the remote layer lists nothing: explain sees the databases */
        kiln_cache_options o = {.size = sizeof o,
                                .path = layer.path,
                                .read_only = 1,
                                .ignore_env = 1,
                                .existing_only = 1,
                                .follow_symlinks = 1}; /* the cache has accepted this path already */
        kiln_cache *c = NULL;
        if ((st = kiln_cache_open(&o, &c)) == KILN_OK)
            st = collect_one(c, rows);
        kiln_cache_close(c);
    }
    return st;
}

void kiln__rows_free(kiln__rows *rows)
{
    for (size_t i = 0; i < rows->n; i++)
        free(rows->items[i].parts);
    free(rows->items);
    *rows = (kiln__rows){0};
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

/* Text of a row fit for a message: controls, DEL, non-ASCII and '\' escaped. */
static char *plain_escape(const char *s)
{
    char *out = malloc(4 * strlen(s) + 1), *w = out;
    if (!out)
        return NULL;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '\\')
            w += sprintf(w, "\\\\");
        else if (*p < 0x20 || *p >= 0x7f)
            w += sprintf(w, "\\x%02x", *p);
        else
            *w++ = (char)*p;
    }
    *w = 0;
    return out;
}

/* Appends to buf as snprintf would, keeping *len within cap (truncating). */
static void append(char *buf, size_t cap, size_t *len, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void append(char *buf, size_t cap, size_t *len, const char *fmt, ...)
{
    if (*len + 1 >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *len, cap - *len, fmt, ap);
    va_end(ap);
    if (n > 0)
        *len = *len + (size_t)n < cap ? *len + (size_t)n : cap - 1;
}

void kiln__rows_explain_miss(const kiln__rows *rows, const char *want_parts, char *(*escape)(const char *),
                             char *buf, size_t cap)
{
    char want_buf[KILN__PARTS_MAX], have_buf[KILN__PARTS_MAX];
    const char *want[N_PARTS], *have[N_PARTS];
    size_t len = 0;
    if (!cap)
        return;
    buf[0] = 0;
    snprintf(want_buf, sizeof want_buf, "%s", want_parts);
    split_parts(want_buf, want);
    const kiln__row *best = NULL;
    int best_score = -1;
    for (size_t i = 0; i < rows->n; i++) {
        snprintf(have_buf, sizeof have_buf, "%s", rows->items[i].parts);
        split_parts(have_buf, have);
        int score = agreement(want, have);
        /* A row with stored parts explains more than one without. */
        if (score > best_score || (score == best_score && best && !best->known && rows->items[i].known)) {
            best = &rows->items[i];
            best_score = score;
        }
    }
    if (!best) {
        append(buf, cap, &len, "nearest none (the database is empty)");
        return;
    }
    snprintf(have_buf, sizeof have_buf, "%s", best->parts);
    split_parts(have_buf, have);
    append(buf, cap, &len, "nearest %s differs:", best->fp);
    int first = 1;
    for (int i = 0; i < N_PARTS; i++) {
        if (!want[i] || !have[i] || !strcmp(want[i], have[i]))
            continue;
        char *shown = (escape ? escape : plain_escape)(have[i]); /* the row's text, from the database */
        append(buf, cap, &len, "%s %s %s -> %s", first ? "" : ",", part_names[i], shown ? shown : "?", want[i]);
        free(shown);
        first = 0;
    }
    if (first)
        append(buf, cap, &len, " nothing it stores (another part of the key)");
    if (!best->known)
        append(buf, cap, &len, " (parts unknown: a schema 1 row)");
}
