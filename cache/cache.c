/* The cubin database's operations: verified loads through the layers, one-
 * transaction stores, listings, totals, batched hit counts. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include "cache/internal.h"

/* A damaged b-tree does not heal by retrying: the message says what the user can do. */
static kiln_status damaged_fail(kiln_cache *c, kiln__db *d, const char *what)
{
    return kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT,
                      "cache %s: %s: the database file is damaged; run `kiln verify --db %s` to see what is lost,"
                      " then delete and rebuild it, or `kiln merge %s -o NEW.db` to copy its good rows into a new file",
                      d->path, what, d->path, d->path);
}

kiln_status kiln__db_fail(kiln_cache *c, kiln__db *d, int rc, const char *what)
{
    kiln_status st = kiln__sqlite_status(rc);
    /* The connection's message only when it is about rc: a later statement may have replaced it. */
    const char *msg = sqlite3_extended_errcode(d->db) == rc ? sqlite3_errmsg(d->db) : sqlite3_errstr(rc);
    if (st != KILN_ERR_CACHE_CORRUPT)
        return kiln__fail(&c->err, st, "cache %s: %s: %s (sqlite code %d)", d->path, what, msg, rc);
    char text[512];
    snprintf(text, sizeof text, "%s: %s (sqlite code %d)", what, msg, rc);
    return damaged_fail(c, d, text);
}

static kiln_status flush_locked(kiln_cache *c)
{
    kiln__db *d = &c->main;
    if (d->read_only || !c->n_pending)
        return KILN_OK;
    int rc = sqlite3_exec(d->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK)
        return kiln__db_fail(c, d, rc, "recording hits");
    for (size_t i = 0; i < c->n_pending; i++) {
        sqlite3_bind_blob(d->st_hit, 1, c->pending[i].fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
        sqlite3_bind_int64(d->st_hit, 2, (sqlite3_int64)c->pending[i].count);
        sqlite3_bind_int64(d->st_hit, 3, c->pending[i].last_used);
        rc = sqlite3_step(d->st_hit);
        sqlite3_reset(d->st_hit);
        if (rc != SQLITE_DONE) {
            kiln_status st = kiln__db_fail(c, d, rc, "recording hits");
            sqlite3_exec(d->db, "ROLLBACK", NULL, NULL, NULL);
            return st;
        }
    }
    rc = sqlite3_exec(d->db, "COMMIT", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        kiln_status st = kiln__db_fail(c, d, rc, "recording hits");
        sqlite3_exec(d->db, "ROLLBACK", NULL, NULL, NULL);
        return st;
    }
    c->n_pending = 0;
    return KILN_OK;
}

kiln_status kiln_cache_flush(kiln_cache *c)
{
    if (!c)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_flush: cache is NULL");
    pthread_mutex_lock(&c->lock);
    kiln_status st = flush_locked(c);
    pthread_mutex_unlock(&c->lock);
    return st;
}

static void record_hit_locked(kiln_cache *c, const uint8_t *fp)
{
    int64_t now = (int64_t)time(NULL);
    for (size_t i = 0; i < c->n_pending; i++) {
        if (!memcmp(c->pending[i].fp, fp, KILN_FINGERPRINT_SIZE)) {
            c->pending[i].count++;
            c->pending[i].last_used = now;
            return;
        }
    }
    if (c->n_pending == KILN__PENDING_HITS_MAX && flush_locked(c) != KILN_OK)
        return; /* hit counts are advisory: losing some never loses a kernel */
    memcpy(c->pending[c->n_pending].fp, fp, KILN_FINGERPRINT_SIZE);
    c->pending[c->n_pending].count = 1;
    c->pending[c->n_pending].last_used = now;
    c->n_pending++;
}

/* Reports a row that failed verification; drops it when its database is
 * writable. KILN_OK, or the delete's failure (the message says so). */
static kiln_status drop_corrupt_locked(kiln_cache *c, kiln__db *d, const uint8_t *fp, const char *detail)
{
    char hex[2 * KILN_FINGERPRINT_SIZE + 1], what[2 * KILN_FINGERPRINT_SIZE + 600];
    kiln_status st = KILN_OK;
    kiln_fingerprint_hex(fp, hex);
    kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT, "cache %s: entry %s %s: %s", d->path, hex,
               d->read_only ? "skipped (read-only layer)" : "dropped", detail);
    if (!d->read_only) {
        sqlite3_bind_blob(d->st_delete, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
        int rc = sqlite3_step(d->st_delete);
        if (rc != SQLITE_DONE) {
            snprintf(what, sizeof what, "entry %s (%s) could not be dropped", hex, detail);
            st = kiln__db_fail(c, d, rc, what);
        }
        sqlite3_reset(d->st_delete);
    }
    if (!st)
        c->counters.corrupt_dropped++;
    if (c->on_event) {
        kiln_cache_event ev = {.kind = KILN_CACHE_EVENT_CORRUPT_DROPPED, .detail = detail};
        memcpy(ev.fingerprint, fp, KILN_FINGERPRINT_SIZE);
        c->on_event(c->user, &ev);
    }
    return st;
}

kiln_status kiln__row_decode(const void *blob, size_t blob_size, sqlite3_int64 raw_size, int raw_size_is_integer,
                             const void *checksum, size_t checksum_size, void **raw_out, char *detail, size_t cap)
{
    *raw_out = NULL;
    /* Every check guards against a row that lies about itself. */
    if (raw_size <= 0 || raw_size > KILN_CACHE_MAX_CUBIN || !raw_size_is_integer) {
        snprintf(detail, cap, "raw_size %lld outside (0, %u]", (long long)raw_size, KILN_CACHE_MAX_CUBIN);
        return KILN_ERR_CACHE_CORRUPT;
    }
    if (!blob || !blob_size || checksum_size != 32 || !checksum) {
        snprintf(detail, cap, "blob of %zu bytes, checksum of %zu bytes (expected 32)", blob_size, checksum_size);
        return KILN_ERR_CACHE_CORRUPT;
    }
    unsigned long long frame = ZSTD_getFrameContentSize(blob, blob_size);
    if (frame != (unsigned long long)raw_size) {
        snprintf(detail, cap, "zstd frame declares %s%llu bytes, row says %lld",
                 frame >= ZSTD_CONTENTSIZE_ERROR ? "no size / " : "", frame >= ZSTD_CONTENTSIZE_ERROR ? 0ULL : frame,
                 (long long)raw_size);
        return KILN_ERR_CACHE_CORRUPT;
    }
    uint8_t *raw = malloc((size_t)raw_size);
    if (!raw)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a %lld-byte cubin",
                          (long long)raw_size);
    size_t got = ZSTD_decompress(raw, (size_t)raw_size, blob, blob_size);
    if (ZSTD_isError(got) || got != (size_t)raw_size) {
        snprintf(detail, cap, "zstd: %s (%zu of %lld bytes)", ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short frame",
                 ZSTD_isError(got) ? 0 : got, (long long)raw_size);
        free(raw);
        return KILN_ERR_CACHE_CORRUPT;
    }
    uint8_t sum[32];
    if (kiln__sha256(raw, (size_t)raw_size, sum) != 0 || memcmp(sum, checksum, 32) != 0) {
        snprintf(detail, cap, "checksum mismatch over %lld bytes", (long long)raw_size);
        free(raw);
        return KILN_ERR_CACHE_CORRUPT;
    }
    *raw_out = raw;
    return KILN_OK;
}

int kiln__parts_field(const char *parts, const char *name, const char **value, size_t *len)
{
    size_t n = strlen(name);
    for (const char *p = parts; p && *p;) {
        if (!strncmp(p, name, n) && p[n] == '=') {
            *value = p + n + 1;
            *len = !strcmp(name, "constants") ? strlen(*value) : strcspn(*value, ";");
            return 1;
        }
        const char *semi = strchr(p, ';');
        p = semi ? semi + 1 : NULL;
    }
    return 0;
}

/* A text column, or NULL when the row holds something else there. */
static const char *text_or_null(sqlite3_stmt *q, int i)
{
    return sqlite3_column_type(q, i) == SQLITE_TEXT ? (const char *)sqlite3_column_text(q, i) : NULL;
}

static const char *text_or_empty(sqlite3_stmt *q, int i)
{
    const char *t = text_or_null(q, i);
    return t ? t : "";
}

int kiln__row_is(const kiln__row_meta *m, const kiln_cache_record *x, char *detail, size_t cap)
{
    static const char *const names[] = {"template_id", "constants", "arch"};
    const char *got_text[] = {m->template_id, m->constants, m->arch};
    const char *want[] = {x->template_id, x->constants, x->arch};
    for (int i = 0; i < 3; i++) {
        const char *got = got_text[i];
        if (!want[i] || (got && !strcmp(got, want[i])))
            continue;
        snprintf(detail, cap, "the row is of another kernel than its key: its %s is %s%.100s%s, the key's %.100s",
                 names[i], got ? "\"" : "", got ? got : "not text", got ? "\"" : "", want[i]);
        return 0;
    }
    if (!m->nvrtc_is_integer || m->nvrtc_major != x->nvrtc_major || m->nvrtc_minor != x->nvrtc_minor) {
        if (m->nvrtc_is_integer)
            snprintf(detail, cap, "the row is of another kernel than its key: its NVRTC is %lld.%lld, the key's %d.%d",
                     (long long)m->nvrtc_major, (long long)m->nvrtc_minor, x->nvrtc_major, x->nvrtc_minor);
        else
            snprintf(detail, cap,
                     "the row is of another kernel than its key: its NVRTC version is not an integer, the key's %d.%d",
                     x->nvrtc_major, x->nvrtc_minor);
        return 0;
    }
    /* Part by part, each one both texts have: a kiln that writes more parts
     * (or fewer) still agrees on the ones they share. */
    static const char *const parts[] = {"schema", "template", "source", "headers",
                                        "options", "arch", "nvrtc", "constants"};
    const char *row = m->parts;
    for (size_t i = 0; row && *row && x->parts && *x->parts && i < sizeof parts / sizeof parts[0]; i++) {
        const char *a, *b;
        size_t na, nb;
        if (!kiln__parts_field(row, parts[i], &a, &na) || !kiln__parts_field(x->parts, parts[i], &b, &nb))
            continue;
        if (na == nb && !memcmp(a, b, na))
            continue;
        snprintf(detail, cap,
                 "the row is of another kernel than its key: its fingerprint part %s is %.*s, the key's %.*s",
                 parts[i], (int)(na < 100 ? na : 100), a, (int)(nb < 100 ? nb : 100), b);
        return 0;
    }
    return 1;
}

/* The row of st_get (columns 3 to 8: template_id, constants, arch,
 * nvrtc_major, nvrtc_minor, parts) as kiln__row_is reads it. */
static int row_is(sqlite3_stmt *q, const kiln_cache_record *x, char *detail, size_t cap)
{
    kiln__row_meta m = {.template_id = text_or_null(q, 3),
                        .constants = text_or_null(q, 4),
                        .arch = text_or_null(q, 5),
                        .parts = text_or_null(q, 8),
                        .nvrtc_is_integer = sqlite3_column_type(q, 6) == SQLITE_INTEGER &&
                                            sqlite3_column_type(q, 7) == SQLITE_INTEGER,
                        .nvrtc_major = sqlite3_column_int64(q, 6),
                        .nvrtc_minor = sqlite3_column_int64(q, 7)};
    return kiln__row_is(&m, x, detail, cap);
}

/* Looks fp up in one database: 1 with *raw on a verified hit, 0 on a miss or
 * a corrupt row (reported and added to *dropped; *drop_st, when not NULL,
 * says whether its delete failed), -1 on an SQLite failure (*st set). With
 * expect, a row of another kernel than expect is corrupt too. */
static int lookup_locked(kiln_cache *c, kiln__db *d, const uint8_t *fp, const kiln_cache_record *expect, void **raw,
                         sqlite3_int64 *size, unsigned *dropped, kiln_status *st, kiln_status *drop_st)
{
    char detail[512];
    sqlite3_stmt *q = d->st_get;
    int result = 0;
    sqlite3_bind_blob(q, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    int rc = sqlite3_step(q);
    if (rc == SQLITE_ROW) {
        *size = sqlite3_column_int64(q, 1);
        kiln_status dst = KILN_ERR_CACHE_CORRUPT;
        if (!expect || row_is(q, expect, detail, sizeof detail))
            dst = kiln__row_decode(sqlite3_column_blob(q, 0), (size_t)sqlite3_column_bytes(q, 0), *size,
                                   sqlite3_column_type(q, 1) == SQLITE_INTEGER, sqlite3_column_blob(q, 2),
                                   (size_t)sqlite3_column_bytes(q, 2), raw, detail, sizeof detail);
        /* A layer admitted by a trust policy: the row must be one it signed
         * (its checksum was just checked against the cubin). */
        if (dst == KILN_OK && d->manifest &&
            !kiln__manifest_row_ok(d->manifest, fp, sqlite3_column_blob(q, 2), (size_t)sqlite3_column_bytes(q, 2),
                                   text_or_empty(q, 3), text_or_empty(q, 4), text_or_empty(q, 5),
                                   sqlite3_column_int64(q, 6), sqlite3_column_int64(q, 7), text_or_empty(q, 9),
                                   text_or_empty(q, 8), detail, sizeof detail)) {
            free(*raw);
            *raw = NULL;
            dst = KILN_ERR_CACHE_CORRUPT;
        }
        if (dst == KILN_OK) {
            result = 1;
        } else if (dst == KILN_ERR_CACHE_CORRUPT) {
            sqlite3_reset(q);
            /* A load misses either way; a put over a row that stays fails. */
            kiln_status dropst = drop_corrupt_locked(c, d, fp, detail);
            if (drop_st)
                *drop_st = dropst;
            (*dropped)++;
        } else {
            *st = kiln__propagate(&c->err, dst);
            result = -1;
        }
    } else if (rc != SQLITE_DONE) {
        *st = kiln__db_fail(c, d, rc, "looking up a kernel");
        result = -1;
    }
    sqlite3_reset(q);
    sqlite3_clear_bindings(q);
    return result;
}

/* A verified remote row goes into the writable database as it came (its
 * frame is not compressed again), so that the next load is local. A store
 * that fails loses nothing: the row is still remote. */
static void adopt_locked(kiln_cache *c, const kiln__remote_row *row)
{
    if (c->main.read_only)
        return;
    kiln_cache_record rec = {.template_id = row->template_id,
                             .constants = row->constants,
                             .arch = row->arch,
                             .nvrtc_major = (int)row->nvrtc_major,
                             .nvrtc_minor = (int)row->nvrtc_minor,
                             .entries = row->entries,
                             .parts = row->parts,
                             .cubin_size = (size_t)row->raw_size};
    memcpy(rec.fingerprint, row->fingerprint, KILN_FINGERPRINT_SIZE);
    kiln__store_locked(c, &rec, row->blob, row->blob_size, row->checksum);
}

kiln_status kiln_cache_get(kiln_cache *c, const uint8_t fp[KILN_FINGERPRINT_SIZE], void **cubin, size_t *size,
                           int *found)
{
    return kiln__cache_load(c, fp, NULL, 1, cubin, size, found, NULL);
}

kiln_status kiln__cache_load(kiln_cache *c, const uint8_t fp[KILN_FINGERPRINT_SIZE], const kiln_cache_record *expect,
                             int count_hit, void **cubin, size_t *size, int *found, unsigned *corrupt_dropped)
{
    unsigned dropped = 0;
    if (corrupt_dropped)
        *corrupt_dropped = 0;
    if (!c || !fp || !cubin || !size || !found)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_get: NULL argument");
    *cubin = NULL;
    *size = 0;
    *found = 0;
    kiln_status st = KILN_OK;
    void *raw = NULL;
    sqlite3_int64 raw_size = 0;
    pthread_mutex_lock(&c->lock);
    /* The shipped layers first, in order; a hit there is not copied. */
    int r = 0;
    kiln__db *where = NULL;
    for (size_t i = 0; i < c->n_layers && r == 0; i++)
        if ((r = lookup_locked(c, &c->layers[i], fp, expect, &raw, &raw_size, &dropped, &st, NULL)) == 1)
            where = &c->layers[i];
    if (r == 0 && (r = lookup_locked(c, &c->main, fp, expect, &raw, &raw_size, &dropped, &st, NULL)) == 1)
        where = &c->main;
    if (r == 0 && c->remote) {
        /* The network is waited on without the lock that local loads take. */
        pthread_mutex_unlock(&c->lock);
        kiln__remote_row row;
        size_t n = 0;
        if (kiln__remote_fetch(c, fp, expect, &row, &raw, &n) == 1) {
            raw_size = (sqlite3_int64)n;
            r = 1;
        }
        pthread_mutex_lock(&c->lock);
        if (r == 1) {
            adopt_locked(c, &row);
            kiln__remote_row_free(&row);
        }
    }
    if (r == 1) {
        if (count_hit) {
            c->counters.hits++;
            if (where == &c->main)
                record_hit_locked(c, fp);
        }
        *cubin = raw;
        *size = (size_t)raw_size;
        *found = 1;
    } else if (r == 0) {
        c->counters.misses++;
    }
    pthread_mutex_unlock(&c->lock);
    if (corrupt_dropped)
        *corrupt_dropped = dropped;
    return st;
}

kiln_status kiln_cache_contains(kiln_cache *c, const uint8_t fp[KILN_FINGERPRINT_SIZE], int *found)
{
    if (!c || !fp || !found)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_contains: NULL argument");
    kiln_status st = KILN_OK;
    *found = 0;
    pthread_mutex_lock(&c->lock);
    for (size_t i = 0; i <= c->n_layers && !*found && !st; i++) {
        kiln__db *d = i < c->n_layers ? &c->layers[i] : &c->main;
        sqlite3_bind_blob(d->st_contains, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
        int rc = sqlite3_step(d->st_contains);
        *found = rc == SQLITE_ROW;
        if (rc != SQLITE_ROW && rc != SQLITE_DONE)
            st = kiln__db_fail(c, d, rc, "looking up a kernel");
        sqlite3_reset(d->st_contains);
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* After an insert q (still bound) of r that changed nothing: another
 * writer's row that verifies and is r's kernel is kept; a corrupt one, or
 * one of another kernel, is dropped and q run again; a store that still
 * stored nothing is an error, never taken for success. */
static kiln_status keep_or_replace_locked(kiln_cache *c, kiln__db *d, sqlite3_stmt *q, const kiln_cache_record *rec)
{
    const uint8_t *fp = rec->fingerprint;
    char hex[2 * KILN_FINGERPRINT_SIZE + 1], what[2 * KILN_FINGERPRINT_SIZE + 120];
    void *raw = NULL;
    sqlite3_int64 size = 0;
    unsigned dropped = 0;
    kiln_status st = KILN_OK, drop_st = KILN_OK;
    int r = lookup_locked(c, d, fp, rec, &raw, &size, &dropped, &st, &drop_st);
    free(raw);
    if (r)
        return r == 1 ? KILN_OK : st;
    if (drop_st)
        return drop_st;
    int rc = sqlite3_step(q);
    sqlite3_reset(q);
    if (rc != SQLITE_DONE)
        return kiln__db_fail(c, d, rc, "storing a kernel");
    if (sqlite3_changes(d->db) > 0) {
        c->counters.inserts++;
        return KILN_OK;
    }
    kiln_fingerprint_hex(fp, hex);
    snprintf(what, sizeof what, "kernel %s was not stored: the insert changed nothing, yet no row of it reads back",
             hex);
    return damaged_fail(c, d, what);
}

kiln_status kiln_cache_put(kiln_cache *c, const kiln_cache_record *r)
{
    if (!c || !r)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_put: NULL argument");
    kiln__db *d = &c->main;
    if (d->read_only)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "cache %s is read-only", d->path);
    if (!r->cubin || !r->cubin_size || r->cubin_size > KILN_CACHE_MAX_CUBIN || !r->template_id || !r->constants ||
        !r->arch || !r->entries)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_cache_put: a record needs a cubin of 1..%u bytes (got %zu) and every text field",
                          KILN_CACHE_MAX_CUBIN, r->cubin_size);
    uint8_t sum[32];
    if (kiln__sha256(r->cubin, r->cubin_size, sum) != 0)
        return kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "SHA-256 failed");
    size_t cap = ZSTD_compressBound(r->cubin_size);
    void *z = malloc(cap);
    if (!z)
        return kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory compressing %zu bytes", r->cubin_size);
    size_t zn = ZSTD_compress(z, cap, r->cubin, r->cubin_size, KILN_CACHE_ZSTD_LEVEL);
    if (ZSTD_isError(zn)) {
        free(z);
        return kiln__fail(&c->err, KILN_ERR_CACHE_IO, "zstd: %s", ZSTD_getErrorName(zn));
    }
    pthread_mutex_lock(&c->lock);
    kiln_status st = kiln__store_locked(c, r, z, zn, sum);
    pthread_mutex_unlock(&c->lock);
    /* Stored here first: a fleet never holds a row its publisher lacks. */
    if (!st && c->remote)
        kiln__remote_publish(c, r, z, zn, sum);
    free(z);
    return st;
}

kiln_status kiln__store_locked(kiln_cache *c, const kiln_cache_record *r, const void *z, size_t zn,
                               const uint8_t sum[32])
{
    kiln__db *d = &c->main;
    kiln_status st = KILN_OK;
    sqlite3_stmt *q = d->st_put;
    sqlite3_bind_blob(q, 1, r->fingerprint, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    sqlite3_bind_text(q, 2, r->template_id, -1, SQLITE_STATIC);
    sqlite3_bind_text(q, 3, r->constants, -1, SQLITE_STATIC);
    sqlite3_bind_text(q, 4, r->arch, -1, SQLITE_STATIC);
    sqlite3_bind_int(q, 5, r->nvrtc_major);
    sqlite3_bind_int(q, 6, r->nvrtc_minor);
    sqlite3_bind_text(q, 7, r->entries, -1, SQLITE_STATIC);
    sqlite3_bind_blob(q, 8, z, (int)zn, SQLITE_STATIC);
    sqlite3_bind_int64(q, 9, (sqlite3_int64)r->cubin_size);
    sqlite3_bind_blob(q, 10, sum, 32, SQLITE_STATIC);
    sqlite3_bind_int64(q, 11, (sqlite3_int64)time(NULL));
    sqlite3_bind_text(q, 12, r->parts ? r->parts : "", -1, SQLITE_STATIC);
    /* One statement in autocommit mode is one transaction. */
    int rc = sqlite3_step(q);
    sqlite3_reset(q);
    if ((rc & 0xff) == SQLITE_FULL && kiln__rollback_journal(d->db) == SQLITE_OK) {
        /* The WAL could not grow: the rollback journal stores into freed pages. */
        rc = sqlite3_step(q);
        sqlite3_reset(q);
    }
    if (rc != SQLITE_DONE)
        st = kiln__db_fail(c, d, rc, "storing a kernel");
    else if (sqlite3_changes(d->db) > 0)
        c->counters.inserts++;
    else
        st = keep_or_replace_locked(c, d, q, r);
    sqlite3_clear_bindings(q);
    return st;
}

/* Single flight across processes: lease, or wait for the holder's row. */
void kiln__cache_remote_wait(kiln_cache *c, const uint8_t fp[KILN_FINGERPRINT_SIZE], const kiln_cache_record *expect,
                             int count_hit, void **cubin, size_t *size, int *found, int *leased)
{
    *cubin = NULL;
    *size = 0;
    *found = 0;
    *leased = 0;
    if (!c || !c->remote)
        return;
    double deadline = kiln__now() + kiln__remote_lease_ms(c) / 1000.0;
    useconds_t backoff = 2000;
    int waited = 0;
    for (;;) {
        int lease = kiln__remote_lease(c, fp);
        if (lease == 1) {
            /* The holder before may have published and given the lease back
             * since this process looked: then its row is the answer. */
            kiln__remote_row row;
            void *raw = NULL;
            size_t n = 0;
            if (kiln__remote_fetch(c, fp, expect, &row, &raw, &n) == 1) {
                kiln__remote_release(c, fp);
                pthread_mutex_lock(&c->lock);
                adopt_locked(c, &row);
                if (count_hit)
                    c->counters.hits++;
                pthread_mutex_unlock(&c->lock);
                kiln__remote_row_free(&row);
                *cubin = raw;
                *size = n;
                *found = 1;
                return;
            }
        }
        if (lease != 0) {
            *leased = lease == 1;
            break;
        }
        /* Another process compiles it: its row, when published, is the answer. */
        kiln__remote_row row;
        void *raw = NULL;
        size_t n = 0;
        waited = 1;
        if (kiln__remote_fetch(c, fp, expect, &row, &raw, &n) == 1) {
            pthread_mutex_lock(&c->lock);
            adopt_locked(c, &row);
            if (count_hit)
                c->counters.hits++;
            c->counters.remote_waits_filled++;
            pthread_mutex_unlock(&c->lock);
            kiln__remote_row_free(&row);
            *cubin = raw;
            *size = n;
            *found = 1;
            return;
        }
        if (kiln__now() >= deadline)
            break;
        usleep(backoff);
        backoff = backoff * 2 > 100000 ? 100000 : backoff * 2;
    }
    if (waited && !*leased) {
        pthread_mutex_lock(&c->lock);
        c->counters.remote_waits_expired++;
        pthread_mutex_unlock(&c->lock);
    }
}

void kiln__cache_remote_release(kiln_cache *c, const uint8_t fp[KILN_FINGERPRINT_SIZE])
{
    if (c && c->remote)
        kiln__remote_release(c, fp);
}

int kiln__rollback_journal(sqlite3 *db)
{
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(db, "PRAGMA journal_mode=DELETE", -1, &q, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(q)) == SQLITE_ROW)
        rc = sqlite3_strnicmp((const char *)sqlite3_column_text(q, 0), "delete", 7) ? SQLITE_BUSY : SQLITE_OK;
    sqlite3_finalize(q);
    return rc;
}

static const char *col_text(sqlite3_stmt *q, int i)
{
    const unsigned char *t = sqlite3_column_text(q, i);
    return t ? (const char *)t : "";
}

kiln_status kiln_cache_foreach(kiln_cache *c, int (*fn)(void *user, const kiln_cache_entry_info *info), void *user)
{
    if (!c || !fn)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_foreach: NULL argument");
    sqlite3_stmt *q = NULL;
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->lock);
    flush_locked(c);
    int rc = sqlite3_prepare_v2(c->main.db,
                                c->main.schema >= 2
                                    ? "SELECT fingerprint, template_id, constants, arch, entries, nvrtc_major,"
                                      " nvrtc_minor, raw_size, length(cubin), hits, created, last_used, parts"
                                      " FROM kernels ORDER BY fingerprint"
                                    : "SELECT fingerprint, template_id, constants, arch, entries, nvrtc_major,"
                                      " nvrtc_minor, raw_size, length(cubin), hits, created, last_used, ''"
                                      " FROM kernels ORDER BY fingerprint",
                                -1, &q, NULL);
    if (rc != SQLITE_OK) {
        st = kiln__db_fail(c, &c->main, rc, "listing kernels");
        goto out;
    }
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        kiln_cache_entry_info info = {0};
        const void *fp = sqlite3_column_blob(q, 0);
        if (fp && sqlite3_column_bytes(q, 0) == KILN_FINGERPRINT_SIZE)
            memcpy(info.fingerprint, fp, KILN_FINGERPRINT_SIZE);
        info.template_id = col_text(q, 1);
        info.constants = col_text(q, 2);
        info.arch = col_text(q, 3);
        info.entries = col_text(q, 4);
        info.nvrtc_major = sqlite3_column_int(q, 5);
        info.nvrtc_minor = sqlite3_column_int(q, 6);
        info.raw_size = (uint64_t)sqlite3_column_int64(q, 7);
        info.stored_size = (uint64_t)sqlite3_column_int64(q, 8);
        info.hits = (uint64_t)sqlite3_column_int64(q, 9);
        info.created = sqlite3_column_int64(q, 10);
        info.last_used = sqlite3_column_int64(q, 11);
        info.parts = col_text(q, 12);
        if (fn(user, &info))
            break;
    }
    if (rc != SQLITE_ROW && rc != SQLITE_DONE)
        st = kiln__db_fail(c, &c->main, rc, "listing kernels");
out:
    sqlite3_finalize(q);
    pthread_mutex_unlock(&c->lock);
    return st;
}

kiln_status kiln_cache_get_stats(kiln_cache *c, kiln_cache_stats *out)
{
    if (!c || !out)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_get_stats: NULL argument");
    memset(out, 0, sizeof *out);
    sqlite3_stmt *q = NULL;
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->lock);
    int rc = sqlite3_prepare_v2(
        c->main.db,
        /* total() never overflows, and a row lying about its size (dropped at
         * its next load) must not poison the sums meanwhile. */
        "SELECT count(*), total(CASE WHEN typeof(raw_size) = 'integer' AND raw_size BETWEEN 1 AND ?1"
        " THEN raw_size ELSE 0 END), total(length(cubin)) FROM kernels",
        -1, &q, NULL);
    if (rc == SQLITE_OK)
        sqlite3_bind_int64(q, 1, KILN_CACHE_MAX_CUBIN);
    if (rc == SQLITE_OK && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        out->entries = (uint64_t)sqlite3_column_int64(q, 0);
        out->raw_bytes = (uint64_t)sqlite3_column_double(q, 1);
        out->stored_bytes = (uint64_t)sqlite3_column_double(q, 2);
    } else {
        st = kiln__db_fail(c, &c->main, rc, "counting kernels");
    }
    sqlite3_finalize(q);
    q = NULL;
    if (!st && c->main.schema >= 3) {
        rc = sqlite3_prepare_v2(c->main.db, "SELECT (SELECT count(*) FROM tuning), (SELECT count(*) FROM coverage)",
                                -1, &q, NULL);
        if (rc == SQLITE_OK && (rc = sqlite3_step(q)) == SQLITE_ROW) {
            out->tuning_rows = (uint64_t)sqlite3_column_int64(q, 0);
            out->coverage_rows = (uint64_t)sqlite3_column_int64(q, 1);
        } else {
            st = kiln__db_fail(c, &c->main, rc, "counting tuning and coverage rows");
        }
        sqlite3_finalize(q);
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

void kiln_cache_get_counters(const kiln_cache *c, kiln_cache_counters *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (!c)
        return;
    pthread_mutex_lock((pthread_mutex_t *)&c->lock);
    *out = c->counters;
    pthread_mutex_unlock((pthread_mutex_t *)&c->lock);
}
