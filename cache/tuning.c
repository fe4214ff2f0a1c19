/* Schema 3's tuning rows and coverage records: stores, verified loads,
 * listings, and their parts of verify and merge. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/internal.h"

const char kiln__schema3_sql[] =
    "CREATE TABLE IF NOT EXISTS tuning ("
    "  id BLOB PRIMARY KEY NOT NULL CHECK (length(id) = 32)," /* SHA-256 of kind and key */
    "  kind TEXT NOT NULL,"
    "  key TEXT NOT NULL,"
    "  payload BLOB NOT NULL,"
    "  checksum BLOB NOT NULL," /* kiln__tuning_checksum */
    "  created INTEGER NOT NULL,"
    "  last_used INTEGER NOT NULL,"
    "  hits INTEGER NOT NULL DEFAULT 0"
    ") WITHOUT ROWID;"
    "CREATE TABLE IF NOT EXISTS coverage ("
    "  id BLOB PRIMARY KEY NOT NULL CHECK (length(id) = 32)," /* SHA-256 of digest, envelope, arch, NVRTC */
    "  model_name TEXT NOT NULL,"
    "  config_digest TEXT NOT NULL,"
    "  envelope TEXT NOT NULL,"
    "  arch TEXT NOT NULL,"
    "  nvrtc_major INTEGER NOT NULL,"
    "  nvrtc_minor INTEGER NOT NULL,"
    "  needs TEXT NOT NULL,"
    "  checksum BLOB NOT NULL," /* kiln__coverage_checksum */
    "  created INTEGER NOT NULL"
    ") WITHOUT ROWID;";

/* A tuning row's use is written at most this often (seconds): a process
 * loads each choice once, and a write per load would cost a transaction. */
#define TOUCH_EVERY 3600

/* ---- digests ---- */

static int hash_parts(const void *const *parts, const size_t *sizes, size_t n, uint8_t out[32])
{
    kiln__hasher *h = kiln__hasher_new();
    if (!h)
        return -1;
    for (size_t i = 0; i < n; i++)
        kiln__hasher_part(h, parts[i], sizes[i]);
    return kiln__hasher_final(h, out);
}

int kiln__tuning_id(const char *kind, const char *key, uint8_t out[32])
{
    const void *p[] = {"kiln-tuning-id-1", kind, key};
    const size_t n[] = {16, strlen(kind), strlen(key)};
    return hash_parts(p, n, 3, out);
}

int kiln__tuning_checksum(const uint8_t id[32], const char *kind, const char *key, const void *payload, size_t size,
                          uint8_t out[32])
{
    const void *p[] = {"kiln-tuning-1", id, kind, key, payload ? payload : ""};
    const size_t n[] = {13, 32, strlen(kind), strlen(key), size};
    return hash_parts(p, n, 5, out);
}

static int coverage_id(const kiln_coverage_record *r, uint8_t out[32])
{
    char nvrtc[32];
    snprintf(nvrtc, sizeof nvrtc, "%d.%d", r->nvrtc_major, r->nvrtc_minor);
    const void *p[] = {"kiln-coverage-id-1", r->config_digest, r->envelope, r->arch, nvrtc};
    const size_t n[] = {18, strlen(r->config_digest), strlen(r->envelope), strlen(r->arch), strlen(nvrtc)};
    return hash_parts(p, n, 5, out);
}

static int coverage_checksum(const uint8_t id[32], const kiln_coverage_record *r, uint8_t out[32])
{
    char nvrtc[32];
    snprintf(nvrtc, sizeof nvrtc, "%d.%d", r->nvrtc_major, r->nvrtc_minor);
    const void *p[] = {"kiln-coverage-1", id, r->model_name, r->config_digest, r->envelope, r->arch, nvrtc, r->needs};
    const size_t n[] = {15, 32, strlen(r->model_name), strlen(r->config_digest), strlen(r->envelope),
                        strlen(r->arch), strlen(nvrtc), strlen(r->needs)};
    return hash_parts(p, n, 8, out);
}

/* ---- checks: what a row must be, shared by loads, verify, merge and the fuzzer ---- */

static int is_hex64(const char *s, size_t len)
{
    if (len != 64)
        return 0;
    for (size_t i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

static int text_ok(const char *s, size_t len, size_t max)
{
    return s && len > 0 && len <= max && strlen(s) == len;
}

int kiln__tuning_row_check(const void *id, size_t id_size, const char *kind, size_t kind_len, const char *key,
                           size_t key_len, const void *payload, size_t payload_size, const void *checksum,
                           size_t checksum_size, char *detail, size_t cap)
{
    uint8_t want[32];
    if (id_size != 32 || !id) {
        snprintf(detail, cap, "id of %zu bytes (expected 32)", id_size);
        return 0;
    }
    if (!text_ok(kind, kind_len, KILN_TUNING_KIND_MAX) || !text_ok(key, key_len, KILN_TUNING_KEY_MAX)) {
        snprintf(detail, cap, "kind (%zu bytes) or key (%zu bytes) is not text of 1 to %d and %d bytes", kind_len,
                 key_len, KILN_TUNING_KIND_MAX, KILN_TUNING_KEY_MAX);
        return 0;
    }
    if (!payload || payload_size == 0 || payload_size > KILN_TUNING_PAYLOAD_MAX) {
        snprintf(detail, cap, "payload of %zu bytes outside [1, %d]", payload_size, KILN_TUNING_PAYLOAD_MAX);
        return 0;
    }
    if (checksum_size != 32 || !checksum) {
        snprintf(detail, cap, "checksum of %zu bytes (expected 32)", checksum_size);
        return 0;
    }
    if (kiln__tuning_id(kind, key, want) != 0 || memcmp(want, id, 32)) {
        snprintf(detail, cap, "the id is not that of its kind and key (a row filed under another key)");
        return 0;
    }
    if (kiln__tuning_checksum(id, kind, key, payload, payload_size, want) != 0 || memcmp(want, checksum, 32)) {
        snprintf(detail, cap, "checksum mismatch over its %zu-byte payload", payload_size);
        return 0;
    }
    return 1;
}

int kiln__coverage_needs_check(const char *needs, size_t len, size_t *n_lines, char *detail, size_t cap)
{
    size_t n = 0;
    *n_lines = 0;
    if (!needs || memchr(needs, 0, len)) {
        snprintf(detail, cap, "needs is not text");
        return 0;
    }
    for (size_t at = 0; at < len;) {
        const char *line = needs + at, *end = memchr(line, '\n', len - at);
        if (!end) {
            snprintf(detail, cap, "needs line %zu does not end in a newline", n + 1);
            return 0;
        }
        size_t l = (size_t)(end - line), tabs = 0;
        for (size_t i = 0; i < l; i++)
            tabs += line[i] == '\t';
        if (l < 65 || !is_hex64(line, 64) || line[64] != '\t' || tabs != 3) {
            snprintf(detail, cap, "needs line %zu is not <64 hex>\\t<template>\\t<constants>\\t<parts>", n + 1);
            return 0;
        }
        n++;
        at += l + 1;
    }
    *n_lines = n;
    return 1;
}

static int coverage_fields_ok(const kiln_coverage_record *r, size_t *n_lines, char *detail, size_t cap)
{
    if (!r->model_name || !*r->model_name || !r->config_digest || !r->envelope || !r->arch || !*r->arch ||
        !r->needs) {
        snprintf(detail, cap, "a field is missing or empty");
        return 0;
    }
    if (!is_hex64(r->config_digest, strlen(r->config_digest))) {
        snprintf(detail, cap, "config digest \"%.80s\" is not 64 lowercase hex digits", r->config_digest);
        return 0;
    }
    return kiln__coverage_needs_check(r->needs, strlen(r->needs), n_lines, detail, cap);
}

int kiln__coverage_row_check(const void *id, size_t id_size, const kiln_coverage_record *r, const void *checksum,
                             size_t checksum_size, size_t *n_lines, char *detail, size_t cap)
{
    uint8_t want[32];
    *n_lines = 0;
    if (!id || id_size != 32) {
        snprintf(detail, cap, "id of %zu bytes (expected 32)", id_size);
        return 0;
    }
    if (!coverage_fields_ok(r, n_lines, detail, cap))
        return 0;
    if (!checksum || checksum_size != 32) {
        snprintf(detail, cap, "checksum of %zu bytes (expected 32)", checksum_size);
        return 0;
    }
    if (coverage_id(r, want) != 0 || memcmp(want, id, 32)) {
        snprintf(detail, cap, "the id is not that of its config digest, envelope, arch and NVRTC");
        return 0;
    }
    if (coverage_checksum(id, r, want) != 0 || memcmp(want, checksum, 32)) {
        snprintf(detail, cap, "checksum mismatch");
        return 0;
    }
    return 1;
}

/* ---- tuning rows ---- */

/* Steps q while it yields rows, after a prepare whose result is *rc. */
static int next_row(sqlite3_stmt *q, int *rc)
{
    if (*rc != SQLITE_OK && *rc != SQLITE_ROW)
        return 0;
    return (*rc = sqlite3_step(q)) == SQLITE_ROW;
}

static int has_schema3(const kiln__db *d) { return d->db && d->schema >= 3; }

static const char *col_text(sqlite3_stmt *q, int i, size_t *len)
{
    *len = (size_t)sqlite3_column_bytes(q, i);
    return sqlite3_column_type(q, i) == SQLITE_TEXT ? (const char *)sqlite3_column_text(q, i) : NULL;
}

/* Verifies a row read as (id, kind, key, payload, checksum) at columns 0..4. */
static int tuning_row_ok(sqlite3_stmt *q, char *detail, size_t cap)
{
    size_t kind_len, key_len;
    const char *kind = col_text(q, 1, &kind_len), *key = col_text(q, 2, &key_len);
    if (sqlite3_column_type(q, 3) != SQLITE_BLOB) {
        snprintf(detail, cap, "payload stored as %s, not a blob",
                 sqlite3_column_type(q, 3) == SQLITE_TEXT ? "text" : "a number or NULL");
        return 0;
    }
    const void *payload = sqlite3_column_type(q, 3) == SQLITE_BLOB ? sqlite3_column_blob(q, 3) : NULL;
    size_t payload_size = payload ? (size_t)sqlite3_column_bytes(q, 3) : 0;
    return kiln__tuning_row_check(sqlite3_column_blob(q, 0), (size_t)sqlite3_column_bytes(q, 0), kind, kind_len, key,
                                  key_len, payload, payload_size, sqlite3_column_blob(q, 4),
                                  (size_t)sqlite3_column_bytes(q, 4), detail, cap);
}

static kiln_status args_ok(kiln_cache *c, const char *fn, const char *kind, const char *key)
{
    if (!c)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "%s: cache is NULL", fn);
    if (!kind || !*kind || strlen(kind) > KILN_TUNING_KIND_MAX || !key || !*key || strlen(key) > KILN_TUNING_KEY_MAX)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT,
                          "%s: kind and key must be text of 1 to %d and %d bytes (kind %zu, key %zu)", fn,
                          KILN_TUNING_KIND_MAX, KILN_TUNING_KEY_MAX, kind ? strlen(kind) : 0,
                          key ? strlen(key) : 0);
    return KILN_OK;
}

static kiln_status writable(kiln_cache *c, const char *fn)
{
    if (c->main.read_only)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "%s: cache %s is read-only", fn, c->main.path);
    if (!has_schema3(&c->main))
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "%s: cache %s has schema %d, tuning rows need 3", fn,
                          c->main.path, c->main.schema);
    return KILN_OK;
}

kiln_status kiln_cache_tuning_put(kiln_cache *c, const char *kind, const char *key, const void *payload,
                                  size_t payload_size)
{
    kiln_status st = args_ok(c, "kiln_cache_tuning_put", kind, key);
    if (st || (st = writable(c, "kiln_cache_tuning_put")))
        return st;
    if (!payload || !payload_size || payload_size > KILN_TUNING_PAYLOAD_MAX)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_cache_tuning_put: payload of %zu bytes outside [1, %d]", payload_size,
                          KILN_TUNING_PAYLOAD_MAX);
    uint8_t id[32], sum[32];
    if (kiln__tuning_id(kind, key, id) || kiln__tuning_checksum(id, kind, key, payload, payload_size, sum))
        return kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory hashing a tuning row");
    sqlite3_stmt *q = NULL;
    pthread_mutex_lock(&c->lock);
    int rc = sqlite3_prepare_v2(c->main.db,
                                "INSERT OR REPLACE INTO tuning (id, kind, key, payload, checksum, created, last_used,"
                                " hits) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, 0)",
                                -1, &q, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_bind_blob(q, 1, id, 32, SQLITE_STATIC);
        sqlite3_bind_text(q, 2, kind, -1, SQLITE_STATIC);
        sqlite3_bind_text(q, 3, key, -1, SQLITE_STATIC);
        sqlite3_bind_blob(q, 4, payload, (int)payload_size, SQLITE_STATIC);
        sqlite3_bind_blob(q, 5, sum, 32, SQLITE_STATIC);
        sqlite3_bind_int64(q, 6, (sqlite3_int64)time(NULL));
        rc = sqlite3_step(q);
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        st = kiln__db_fail(c, &c->main, rc, "storing a tuning row");
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Reports a bad tuning row and drops it when d is writable. */
static void drop_bad_locked(kiln_cache *c, kiln__db *d, const uint8_t *id, const char *detail)
{
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(id, hex);
    kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT, "cache %s: tuning row %s %s: %s", d->path, hex,
               d->read_only ? "skipped (read-only layer)" : "dropped", detail);
    if (!d->read_only) {
        sqlite3_stmt *q = NULL;
        if (sqlite3_prepare_v2(d->db, "DELETE FROM tuning WHERE id = ?1", -1, &q, NULL) == SQLITE_OK) {
            sqlite3_bind_blob(q, 1, id, 32, SQLITE_STATIC);
            sqlite3_step(q);
        }
        sqlite3_finalize(q);
    }
    c->counters.corrupt_dropped++;
    if (c->on_event) {
        kiln_cache_event ev = {.kind = KILN_CACHE_EVENT_CORRUPT_DROPPED, .detail = detail};
        memcpy(ev.fingerprint, id, 32);
        c->on_event(c->user, &ev);
    }
}

/* Looks id up in d: 1 found (payload copied), 0 not, -1 an SQLite failure. */
static int get_in_locked(kiln_cache *c, kiln__db *d, const uint8_t *id, void **payload, size_t *size)
{
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(d->db, "SELECT id, kind, key, payload, checksum, last_used FROM tuning WHERE id = ?1",
                                -1, &q, NULL);
    if (rc != SQLITE_OK) {
        kiln__db_fail(c, d, rc, "reading a tuning row");
        return -1;
    }
    sqlite3_bind_blob(q, 1, id, 32, SQLITE_STATIC);
    int found = 0;
    rc = sqlite3_step(q);
    if (rc == SQLITE_ROW) {
        char detail[256];
        if (!tuning_row_ok(q, detail, sizeof detail)) {
            sqlite3_finalize(q);
            drop_bad_locked(c, d, id, detail);
            return 0;
        }
        size_t n = (size_t)sqlite3_column_bytes(q, 3);
        int64_t last_used = sqlite3_column_int64(q, 5), now = (int64_t)time(NULL);
        void *p = malloc(n);
        if (!p) {
            sqlite3_finalize(q);
            kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
            return -1;
        }
        memcpy(p, sqlite3_column_blob(q, 3), n);
        *payload = p;
        *size = n;
        found = 1;
        sqlite3_finalize(q);
        q = NULL;
        /* The use, so that gc keeps what is used; advisory, like kernels' hits. */
        if (!d->read_only && now - last_used >= TOUCH_EVERY &&
            sqlite3_prepare_v2(d->db, "UPDATE tuning SET hits = hits + 1, last_used = ?2 WHERE id = ?1", -1, &q,
                               NULL) == SQLITE_OK) {
            sqlite3_bind_blob(q, 1, id, 32, SQLITE_STATIC);
            sqlite3_bind_int64(q, 2, now);
            sqlite3_step(q);
        }
    } else if (rc != SQLITE_DONE) {
        kiln__db_fail(c, d, rc, "reading a tuning row");
        found = -1;
    }
    sqlite3_finalize(q);
    return found;
}

kiln_status kiln_cache_tuning_get(kiln_cache *c, const char *kind, const char *key, void **payload, size_t *size,
                                  int *found)
{
    if (payload)
        *payload = NULL;
    if (size)
        *size = 0;
    if (found)
        *found = 0;
    kiln_status st = args_ok(c, "kiln_cache_tuning_get", kind, key);
    if (st)
        return st;
    if (!payload || !size || !found)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_tuning_get: NULL argument");
    uint8_t id[32];
    if (kiln__tuning_id(kind, key, id))
        return kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory hashing a tuning key");
    pthread_mutex_lock(&c->lock);
    int r = has_schema3(&c->main) ? get_in_locked(c, &c->main, id, payload, size) : 0;
    /* Under a trust policy a layer's tuning rows are not read: its signature covers kernels only. */
    for (size_t i = 0; r == 0 && !c->n_trusted && i < c->n_layers; i++)
        if (has_schema3(&c->layers[i]))
            r = get_in_locked(c, &c->layers[i], id, payload, size);
    if (r < 0)
        st = kiln__sqlite_status(sqlite3_errcode(c->main.db)) == KILN_ERR_CACHE_CORRUPT ? KILN_ERR_CACHE_CORRUPT
                                                                                         : KILN_ERR_CACHE_IO;
    else
        *found = r;
    pthread_mutex_unlock(&c->lock);
    return st;
}

kiln_status kiln_cache_tuning_drop(kiln_cache *c, const char *kind, const char *key)
{
    kiln_status st = args_ok(c, "kiln_cache_tuning_drop", kind, key);
    if (st || (st = writable(c, "kiln_cache_tuning_drop")))
        return st;
    uint8_t id[32];
    if (kiln__tuning_id(kind, key, id))
        return kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory hashing a tuning key");
    sqlite3_stmt *q = NULL;
    pthread_mutex_lock(&c->lock);
    int rc = sqlite3_prepare_v2(c->main.db, "DELETE FROM tuning WHERE id = ?1", -1, &q, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_bind_blob(q, 1, id, 32, SQLITE_STATIC);
        rc = sqlite3_step(q);
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        st = kiln__db_fail(c, &c->main, rc, "dropping a tuning row");
    pthread_mutex_unlock(&c->lock);
    return st;
}

kiln_status kiln_cache_tuning_foreach(kiln_cache *c, int (*fn)(void *user, const kiln_tuning_info *info), void *user)
{
    if (!c || !fn)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_tuning_foreach: NULL argument");
    if (!has_schema3(&c->main))
        return KILN_OK;
    sqlite3_stmt *q = NULL;
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->lock);
    int rc = sqlite3_prepare_v2(c->main.db,
                                "SELECT id, kind, key, payload, hits, created, last_used FROM tuning ORDER BY id", -1,
                                &q, NULL);
    while (next_row(q, &rc)) {
        kiln_tuning_info info;
        size_t n;
        memset(&info, 0, sizeof info);
        const void *id = sqlite3_column_blob(q, 0);
        int id_size = sqlite3_column_bytes(q, 0);
        if (id)
            memcpy(info.id, id, id_size < 32 ? (size_t)id_size : 32);
        info.kind = col_text(q, 1, &n);
        info.key = col_text(q, 2, &n);
        info.kind = info.kind ? info.kind : "";
        info.key = info.key ? info.key : "";
        info.payload = sqlite3_column_blob(q, 3);
        info.payload_size = (size_t)sqlite3_column_bytes(q, 3);
        info.hits = (uint64_t)sqlite3_column_int64(q, 4);
        info.created = sqlite3_column_int64(q, 5);
        info.last_used = sqlite3_column_int64(q, 6);
        /* The callback may not call into the cache: the lock is held. */
        if (fn(user, &info)) {
            rc = SQLITE_DONE;
            break;
        }
    }
    if (rc != SQLITE_DONE)
        st = kiln__db_fail(c, &c->main, rc, "listing tuning rows");
    sqlite3_finalize(q);
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- coverage records ---- */

kiln_status kiln_cache_coverage_put(kiln_cache *c, const kiln_coverage_record *r)
{
    if (!c || !r)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_coverage_put: NULL argument");
    kiln_status st = writable(c, "kiln_cache_coverage_put");
    if (st)
        return st;
    char detail[256];
    size_t n_lines;
    if (!coverage_fields_ok(r, &n_lines, detail, sizeof detail))
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_coverage_put: %s", detail);
    uint8_t id[32], sum[32];
    if (coverage_id(r, id) || coverage_checksum(id, r, sum))
        return kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory hashing a coverage record");
    sqlite3_stmt *q = NULL;
    pthread_mutex_lock(&c->lock);
    int rc = sqlite3_prepare_v2(c->main.db,
                                "INSERT OR REPLACE INTO coverage (id, model_name, config_digest, envelope, arch,"
                                " nvrtc_major, nvrtc_minor, needs, checksum, created)"
                                " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                                -1, &q, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_bind_blob(q, 1, id, 32, SQLITE_STATIC);
        sqlite3_bind_text(q, 2, r->model_name, -1, SQLITE_STATIC);
        sqlite3_bind_text(q, 3, r->config_digest, -1, SQLITE_STATIC);
        sqlite3_bind_text(q, 4, r->envelope, -1, SQLITE_STATIC);
        sqlite3_bind_text(q, 5, r->arch, -1, SQLITE_STATIC);
        sqlite3_bind_int(q, 6, r->nvrtc_major);
        sqlite3_bind_int(q, 7, r->nvrtc_minor);
        sqlite3_bind_text(q, 8, r->needs, -1, SQLITE_STATIC);
        sqlite3_bind_blob(q, 9, sum, 32, SQLITE_STATIC);
        sqlite3_bind_int64(q, 10, (sqlite3_int64)time(NULL));
        rc = sqlite3_step(q);
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        st = kiln__db_fail(c, &c->main, rc, "storing a coverage record");
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* A coverage row read as (id, model_name, config_digest, envelope, arch,
 * nvrtc_major, nvrtc_minor, needs, checksum, created) into info, checked. */
static void coverage_of(sqlite3_stmt *q, kiln_coverage_info *info, char *detail, size_t cap)
{
    size_t n;
    memset(info, 0, sizeof *info);
    const void *id = sqlite3_column_blob(q, 0);
    size_t id_size = (size_t)sqlite3_column_bytes(q, 0);
    if (id)
        memcpy(info->id, id, id_size < 32 ? id_size : 32);
    kiln_coverage_record *r = &info->record;
    /* The text columns, and the first that holds a NUL byte: the record's
     * checks read them as C strings, which would stop there. */
    static const char *const names[] = {"model name", "config digest", "envelope", "architecture", "needs"};
    static const int cols[] = {1, 2, 3, 4, 7};
    const char **texts[] = {&r->model_name, &r->config_digest, &r->envelope, &r->arch, &r->needs};
    const char *nul = NULL;
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++) {
        *texts[i] = col_text(q, cols[i], &n);
        if (*texts[i] && !nul && memchr(*texts[i], 0, n))
            nul = names[i];
    }
    int ints = sqlite3_column_type(q, 5) == SQLITE_INTEGER && sqlite3_column_type(q, 6) == SQLITE_INTEGER;
    r->nvrtc_major = sqlite3_column_int(q, 5);
    r->nvrtc_minor = sqlite3_column_int(q, 6);
    info->created = sqlite3_column_int64(q, 9);
    detail[0] = 0;
    if (!ints)
        snprintf(detail, cap, "the NVRTC version is not integers");
    else if (nul)
        snprintf(detail, cap, "its %s holds a NUL byte", nul);
    else
        info->valid = kiln__coverage_row_check(id, id_size, r, sqlite3_column_blob(q, 8),
                                               (size_t)sqlite3_column_bytes(q, 8), &info->n_needs, detail, cap);
    info->detail = detail;
    if (!r->model_name)
        r->model_name = "";
    if (!r->config_digest)
        r->config_digest = "";
    if (!r->envelope)
        r->envelope = "";
    if (!r->arch)
        r->arch = "";
    if (!r->needs)
        r->needs = "";
}

#define COVERAGE_COLUMNS                                                                                              \
    "id, model_name, config_digest, envelope, arch, nvrtc_major, nvrtc_minor, needs, checksum, created"

kiln_status kiln_cache_coverage_foreach(kiln_cache *c, int (*fn)(void *user, const kiln_coverage_info *info),
                                        void *user)
{
    if (!c || !fn)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_cache_coverage_foreach: NULL argument");
    if (!has_schema3(&c->main))
        return KILN_OK;
    sqlite3_stmt *q = NULL;
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->lock);
    int rc = sqlite3_prepare_v2(c->main.db, "SELECT " COVERAGE_COLUMNS " FROM coverage ORDER BY model_name, id", -1,
                                &q, NULL);
    while (next_row(q, &rc)) {
        kiln_coverage_info info;
        char detail[256];
        coverage_of(q, &info, detail, sizeof detail);
        if (fn(user, &info)) {
            rc = SQLITE_DONE;
            break;
        }
    }
    if (rc != SQLITE_DONE)
        st = kiln__db_fail(c, &c->main, rc, "listing coverage records");
    sqlite3_finalize(q);
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- verify and merge (called with the lock held, inside their transaction) ---- */

int kiln__verify_schema3_locked(kiln_cache *c,
                                void (*on_bad)(void *user, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                                               const char *detail),
                                void *user, kiln_cache_verify_report *out)
{
    if (!has_schema3(&c->main))
        return SQLITE_DONE;
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(c->main.db, "SELECT id, kind, key, payload, checksum FROM tuning", -1, &q, NULL);
    while (next_row(q, &rc)) {
        char detail[256], text[300];
        uint8_t id[32] = {0};
        out->tuning_rows++;
        if (tuning_row_ok(q, detail, sizeof detail))
            continue;
        out->bad_tuning_rows++;
        const void *p = sqlite3_column_blob(q, 0);
        int n = sqlite3_column_bytes(q, 0);
        if (p)
            memcpy(id, p, n < 32 ? (size_t)n : 32);
        snprintf(text, sizeof text, "tuning row: %s", detail);
        if (on_bad)
            on_bad(user, id, text);
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE)
        return rc;
    rc = sqlite3_prepare_v2(c->main.db, "SELECT " COVERAGE_COLUMNS " FROM coverage", -1, &q, NULL);
    while (next_row(q, &rc)) {
        kiln_coverage_info info;
        char detail[256], text[300];
        out->coverage_rows++;
        coverage_of(q, &info, detail, sizeof detail);
        if (info.valid)
            continue;
        out->bad_coverage_rows++;
        snprintf(text, sizeof text, "coverage record: %s", detail);
        if (on_bad)
            on_bad(user, info.id, text);
    }
    sqlite3_finalize(q);
    return rc;
}

/* Whether src has table name. */
static int has_table(sqlite3 *src, const char *name)
{
    sqlite3_stmt *q = NULL;
    int found = 0;
    if (sqlite3_prepare_v2(src, "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1", -1, &q, NULL) ==
        SQLITE_OK) {
        sqlite3_bind_text(q, 1, name, -1, SQLITE_STATIC);
        found = sqlite3_step(q) == SQLITE_ROW;
    }
    sqlite3_finalize(q);
    return found;
}

/* Copies src's verified rows of one table (INSERT OR IGNORE: the first
 * source's row of an id is kept). ok judges a row of the select. */
static int copy_table(kiln_cache *c, sqlite3 *src, const char *select, const char *insert, int n_cols,
                      int (*ok)(sqlite3_stmt *q, char *detail, size_t cap), uint64_t *copied, uint64_t *skipped)
{
    sqlite3_stmt *q = NULL, *ins = NULL;
    int rc = sqlite3_prepare_v2(src, select, -1, &q, NULL);
    if (rc != SQLITE_OK)
        return rc;
    if ((rc = sqlite3_prepare_v2(c->main.db, insert, -1, &ins, NULL)) != SQLITE_OK) {
        sqlite3_finalize(q);
        return rc;
    }
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        char detail[256];
        if (!ok(q, detail, sizeof detail)) {
            (*skipped)++;
            continue;
        }
        for (int i = 0; i < n_cols; i++)
            sqlite3_bind_value(ins, i + 1, sqlite3_column_value(q, i));
        int irc = sqlite3_step(ins);
        sqlite3_reset(ins);
        sqlite3_clear_bindings(ins);
        if (irc != SQLITE_DONE) {
            rc = irc;
            break;
        }
        if (sqlite3_changes(c->main.db) > 0)
            (*copied)++;
    }
    sqlite3_finalize(ins);
    sqlite3_finalize(q);
    return rc == SQLITE_ROW ? SQLITE_DONE : rc;
}

static int tuning_copy_ok(sqlite3_stmt *q, char *detail, size_t cap)
{
    if (!tuning_row_ok(q, detail, cap))
        return 0;
    for (int i = 5; i < 8; i++)
        if (sqlite3_column_type(q, i) != SQLITE_INTEGER) {
            snprintf(detail, cap, "created, last_used or hits is not an integer");
            return 0;
        }
    return 1;
}

static int coverage_copy_ok(sqlite3_stmt *q, char *detail, size_t cap)
{
    kiln_coverage_info info;
    coverage_of(q, &info, detail, cap);
    return info.valid && sqlite3_column_type(q, 9) == SQLITE_INTEGER;
}

int kiln__merge_schema3_locked(kiln_cache *c, sqlite3 *src, uint64_t *copied, uint64_t *skipped)
{
    int rc = SQLITE_DONE;
    if (!has_schema3(&c->main))
        return rc;
    if (has_table(src, "tuning"))
        rc = copy_table(c, src, "SELECT id, kind, key, payload, checksum, created, last_used, hits FROM tuning",
                        "INSERT OR IGNORE INTO tuning (id, kind, key, payload, checksum, created, last_used, hits)"
                        " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                        8, tuning_copy_ok, copied, skipped);
    if (rc == SQLITE_DONE && has_table(src, "coverage"))
        rc = copy_table(c, src, "SELECT " COVERAGE_COLUMNS " FROM coverage",
                        "INSERT OR IGNORE INTO coverage (" COVERAGE_COLUMNS ")"
                        " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                        10, coverage_copy_ok, copied, skipped);
    return rc;
}
