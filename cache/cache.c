/* The cubin database: SQLite rows of zstd-compressed cubins, verified on load. */
#include <errno.h>
#include <limits.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <zstd.h>

#include "common/internal.h"
#include "cache/internal.h"

/* PRAGMA application_id: "KILN" in ASCII. */
#define KILN_APPLICATION_ID 0x4b494c4e
/* No cubin kiln makes comes near this; a larger raw_size is a corrupt row. */
#define KILN_CACHE_MAX_CUBIN (256u << 20)
#define KILN_CACHE_ZSTD_LEVEL 9
#define PENDING_HITS_MAX 256

typedef struct pending_hit {
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    uint64_t count;
    int64_t last_used;
} pending_hit;

struct kiln_cache {
    sqlite3 *db;
    char *path;
    int read_only;
    pthread_mutex_t lock; /* guards the statements, counters and pending hits */
    sqlite3_stmt *st_get, *st_contains, *st_put, *st_delete, *st_hit;
    kiln_cache_counters counters;
    pending_hit pending[PENDING_HITS_MAX];
    size_t n_pending;
    void (*on_event)(void *user, const kiln_cache_event *event);
    void *user;
    kiln__errslot err;
};

static const char schema_sql[] =
    "CREATE TABLE IF NOT EXISTS kernels ("
    "  fingerprint BLOB PRIMARY KEY NOT NULL CHECK (length(fingerprint) = 32),"
    "  template_id TEXT NOT NULL,"
    "  constants TEXT NOT NULL,"
    "  arch TEXT NOT NULL,"
    "  nvrtc_major INTEGER NOT NULL,"
    "  nvrtc_minor INTEGER NOT NULL,"
    "  entries TEXT NOT NULL,"
    "  cubin BLOB NOT NULL,"      /* zstd frame of the raw cubin */
    "  raw_size INTEGER NOT NULL,"
    "  checksum BLOB NOT NULL,"   /* SHA-256 of the raw cubin */
    "  created INTEGER NOT NULL,"
    "  last_used INTEGER NOT NULL,"
    "  hits INTEGER NOT NULL DEFAULT 0"
    ") WITHOUT ROWID;"
    "CREATE INDEX IF NOT EXISTS kernels_by_template ON kernels (template_id);";

static kiln_status sqlite_status(int rc)
{
    switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
        return KILN_ERR_CACHE_BUSY;
    case SQLITE_NOMEM:
        return KILN_ERR_HOST_OUT_OF_MEMORY;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
        return KILN_ERR_CACHE_CORRUPT;
    default:
        return KILN_ERR_CACHE_IO;
    }
}

static kiln_status db_fail(kiln_cache *c, int rc, const char *what)
{
    return kiln__fail(&c->err, sqlite_status(rc), "cache %s: %s: %s (sqlite code %d)", c->path, what,
                      sqlite3_errmsg(c->db), rc);
}

kiln_status kiln_cache_default_path(char *buf, size_t cap)
{
    const char *dir = getenv("KILN_CACHE_DIR");
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    int n;
    if (!buf || !cap)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_default_path: no buffer");
    if (dir && *dir)
        n = snprintf(buf, cap, "%s/kernels.db", dir);
    else if (xdg && *xdg)
        n = snprintf(buf, cap, "%s/kiln/kernels.db", xdg);
    else if (home && *home)
        n = snprintf(buf, cap, "%s/.cache/kiln/kernels.db", home);
    else
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                          "no cache location: none of KILN_CACHE_DIR, XDG_CACHE_HOME, HOME is set");
    if (n < 0 || (size_t)n >= cap)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "cache path longer than %zu bytes", cap - 1);
    return KILN_OK;
}

/* mkdir -p of the folder that holds path. */
static kiln_status make_parent_dirs(const char *path)
{
    char *dir = kiln__strdup(path);
    if (!dir)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    char *slash = strrchr(dir, '/');
    kiln_status st = KILN_OK;
    if (slash && slash != dir) {
        *slash = 0;
        for (char *p = dir + 1; *p; p++) {
            if (*p != '/')
                continue;
            *p = 0;
            if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
                st = kiln__fail(NULL, KILN_ERR_CACHE_IO, "cannot create cache folder %s: %s", dir, strerror(errno));
                goto out;
            }
            *p = '/';
        }
        if (mkdir(dir, 0755) != 0 && errno != EEXIST)
            st = kiln__fail(NULL, KILN_ERR_CACHE_IO, "cannot create cache folder %s: %s", dir, strerror(errno));
    }
out:
    free(dir);
    return st;
}

static int pragma_int(sqlite3 *db, const char *sql, int64_t *out)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db, sql, -1, &st, NULL);
    if (rc != SQLITE_OK)
        return rc;
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        *out = sqlite3_column_int64(st, 0);
        rc = SQLITE_OK;
    }
    sqlite3_finalize(st);
    return rc;
}

/* Creates the schema in an empty database, accepts ours, refuses the rest. */
static kiln_status check_schema(kiln_cache *c)
{
    int64_t app_id = 0, version = 0, n_tables = 0;
    int rc;
    if ((rc = pragma_int(c->db, "PRAGMA application_id", &app_id)) != SQLITE_OK ||
        (rc = pragma_int(c->db, "PRAGMA user_version", &version)) != SQLITE_OK ||
        (rc = pragma_int(c->db, "SELECT count(*) FROM sqlite_master", &n_tables)) != SQLITE_OK)
        return db_fail(c, rc, "reading the schema");
    if (app_id == 0 && version == 0 && n_tables == 0) {
        if (c->read_only)
            return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA, "cache %s: empty database opened read-only", c->path);
        char *msg = NULL;
        char sql[sizeof schema_sql + 128];
        snprintf(sql, sizeof sql, "BEGIN IMMEDIATE;%sPRAGMA application_id = %d;PRAGMA user_version = %d;COMMIT;",
                 schema_sql, KILN_APPLICATION_ID, KILN_CACHE_SCHEMA_VERSION);
        rc = sqlite3_exec(c->db, sql, NULL, NULL, &msg);
        if (rc != SQLITE_OK) {
            kiln_status st = kiln__fail(&c->err, sqlite_status(rc), "cache %s: creating the schema: %s", c->path,
                                        msg ? msg : sqlite3_errstr(rc));
            sqlite3_free(msg);
            sqlite3_exec(c->db, "ROLLBACK", NULL, NULL, NULL);
            /* Another process may have created it at the same time. */
            if (st == KILN_ERR_CACHE_BUSY || st == KILN_ERR_CACHE_IO) {
                if (pragma_int(c->db, "PRAGMA user_version", &version) == SQLITE_OK &&
                    version == KILN_CACHE_SCHEMA_VERSION)
                    return KILN_OK;
            }
            return st;
        }
        return KILN_OK;
    }
    if (app_id != KILN_APPLICATION_ID)
        return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA,
                          "cache %s: not a kiln cache database (application_id 0x%llx, expected 0x%x)", c->path,
                          (unsigned long long)app_id, KILN_APPLICATION_ID);
    if (version != KILN_CACHE_SCHEMA_VERSION)
        return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA,
                          "cache %s: schema version %lld, this library reads version %d%s", c->path,
                          (long long)version, KILN_CACHE_SCHEMA_VERSION,
                          version > KILN_CACHE_SCHEMA_VERSION ? " (made by a newer kiln)" : "");
    return KILN_OK;
}

static kiln_status prepare(kiln_cache *c, sqlite3_stmt **st, const char *sql)
{
    int rc = sqlite3_prepare_v3(c->db, sql, -1, SQLITE_PREPARE_PERSISTENT, st, NULL);
    return rc == SQLITE_OK ? KILN_OK : db_fail(c, rc, "preparing a statement");
}

kiln_status kiln_cache_open(const kiln_cache_options *opts, kiln_cache **out)
{
    kiln_cache_options def = {0};
    char path[4096];
    kiln_status st;
    int rc;
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_open: out is NULL");
    *out = NULL;
    if (!opts)
        opts = &def;
    if (opts->path && *opts->path) {
        if (strlen(opts->path) >= sizeof path)
            return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "cache path longer than %zu bytes", sizeof path - 1);
        strcpy(path, opts->path);
    } else if ((st = kiln_cache_default_path(path, sizeof path)) != KILN_OK) {
        return st;
    }
    kiln_cache *c = calloc(1, sizeof *c);
    if (!c)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln__errslot_init(&c->err);
    pthread_mutex_init(&c->lock, NULL);
    c->read_only = opts->read_only;
    c->on_event = opts->on_event;
    c->user = opts->user;
    c->path = kiln__strdup(path);
    if (!c->path) {
        st = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        goto out_free;
    }
    if (!c->read_only && (st = make_parent_dirs(path)) != KILN_OK)
        goto out_free;
    int flags = (c->read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
                SQLITE_OPEN_FULLMUTEX;
    rc = sqlite3_open_v2(path, &c->db, flags, NULL);
    if (rc != SQLITE_OK) {
        st = kiln__fail(&c->err, sqlite_status(rc) == KILN_ERR_CACHE_CORRUPT ? KILN_ERR_CACHE_SCHEMA : KILN_ERR_CACHE_IO,
                        "cannot open cache database %s: %s", path, c->db ? sqlite3_errmsg(c->db) : sqlite3_errstr(rc));
        goto out_free;
    }
    sqlite3_extended_result_codes(c->db, 1);
    sqlite3_busy_timeout(c->db, opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : 10000);
    if (!c->read_only) {
        /* WAL where the filesystem allows it; the rollback journal otherwise. */
        sqlite3_exec(c->db, "PRAGMA journal_mode=WAL", NULL, NULL, NULL);
        sqlite3_exec(c->db, "PRAGMA synchronous=NORMAL", NULL, NULL, NULL);
    }
    if ((st = check_schema(c)) != KILN_OK) {
        /* A file that is not a database at all reads as a schema problem. */
        if (st == KILN_ERR_CACHE_CORRUPT)
            st = kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA, "cache %s: not a kiln cache database (%s)", path,
                            sqlite3_errmsg(c->db));
        goto out_free;
    }
    if ((st = prepare(c, &c->st_get, "SELECT cubin, raw_size, checksum FROM kernels WHERE fingerprint = ?1")) ||
        (st = prepare(c, &c->st_contains, "SELECT 1 FROM kernels WHERE fingerprint = ?1")))
        goto out_free;
    if (!c->read_only &&
        ((st = prepare(c, &c->st_put,
                       "INSERT OR IGNORE INTO kernels (fingerprint, template_id, constants, arch, nvrtc_major,"
                       " nvrtc_minor, entries, cubin, raw_size, checksum, created, last_used, hits)"
                       " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11, 0)")) ||
         (st = prepare(c, &c->st_delete, "DELETE FROM kernels WHERE fingerprint = ?1")) ||
         (st = prepare(c, &c->st_hit,
                       "UPDATE kernels SET hits = hits + ?2, last_used = max(last_used, ?3) WHERE fingerprint = ?1"))))
        goto out_free;
    *out = c;
    return KILN_OK;
out_free:
    kiln__propagate(NULL, st);
    kiln_cache_close(c);
    return st;
}

static kiln_status flush_locked(kiln_cache *c)
{
    if (c->read_only || !c->n_pending)
        return KILN_OK;
    int rc = sqlite3_exec(c->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK)
        return db_fail(c, rc, "recording hits");
    for (size_t i = 0; i < c->n_pending; i++) {
        sqlite3_bind_blob(c->st_hit, 1, c->pending[i].fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
        sqlite3_bind_int64(c->st_hit, 2, (sqlite3_int64)c->pending[i].count);
        sqlite3_bind_int64(c->st_hit, 3, c->pending[i].last_used);
        rc = sqlite3_step(c->st_hit);
        sqlite3_reset(c->st_hit);
        if (rc != SQLITE_DONE) {
            kiln_status st = db_fail(c, rc, "recording hits");
            sqlite3_exec(c->db, "ROLLBACK", NULL, NULL, NULL);
            return st;
        }
    }
    rc = sqlite3_exec(c->db, "COMMIT", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        kiln_status st = db_fail(c, rc, "recording hits");
        sqlite3_exec(c->db, "ROLLBACK", NULL, NULL, NULL);
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

void kiln_cache_close(kiln_cache *c)
{
    if (!c)
        return;
    if (c->db) {
        flush_locked(c);
        sqlite3_finalize(c->st_get);
        sqlite3_finalize(c->st_contains);
        sqlite3_finalize(c->st_put);
        sqlite3_finalize(c->st_delete);
        sqlite3_finalize(c->st_hit);
        sqlite3_close(c->db);
    }
    pthread_mutex_destroy(&c->lock);
    kiln__errslot_destroy(&c->err);
    free(c->path);
    free(c);
}

const char *kiln_cache_path(const kiln_cache *c) { return c ? c->path : ""; }
const char *kiln_cache_errmsg(const kiln_cache *c) { return c ? c->err.msg : ""; }

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
    if (c->n_pending == PENDING_HITS_MAX && flush_locked(c) != KILN_OK)
        return; /* hit counts are advisory: losing some never loses a kernel */
    memcpy(c->pending[c->n_pending].fp, fp, KILN_FINGERPRINT_SIZE);
    c->pending[c->n_pending].count = 1;
    c->pending[c->n_pending].last_used = now;
    c->n_pending++;
}

/* Drops a row that failed verification and tells whoever listens. */
static void drop_corrupt_locked(kiln_cache *c, const uint8_t *fp, const char *detail)
{
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fp, hex);
    c->counters.corrupt_dropped++;
    kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT, "cache %s: entry %s dropped: %s", c->path, hex, detail);
    if (!c->read_only) {
        sqlite3_bind_blob(c->st_delete, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
        sqlite3_step(c->st_delete);
        sqlite3_reset(c->st_delete);
    }
    if (c->on_event) {
        kiln_cache_event ev = {.kind = KILN_CACHE_EVENT_CORRUPT_DROPPED, .detail = detail};
        memcpy(ev.fingerprint, fp, KILN_FINGERPRINT_SIZE);
        c->on_event(c->user, &ev);
    }
}

kiln_status kiln_cache_get(kiln_cache *c, const uint8_t fp[KILN_FINGERPRINT_SIZE], void **cubin, size_t *size,
                           int *found)
{
    return kiln__cache_load(c, fp, 1, cubin, size, found);
}

kiln_status kiln__cache_load(kiln_cache *c, const uint8_t fp[KILN_FINGERPRINT_SIZE], int count_hit, void **cubin,
                             size_t *size, int *found)
{
    if (!c || !fp || !cubin || !size || !found)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_get: NULL argument");
    *cubin = NULL;
    *size = 0;
    *found = 0;
    char detail[160];
    uint8_t *raw = NULL;
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->lock);
    sqlite3_stmt *q = c->st_get;
    sqlite3_bind_blob(q, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    int rc = sqlite3_step(q);
    if (rc == SQLITE_DONE) {
        c->counters.misses++;
        goto out_reset;
    }
    if (rc != SQLITE_ROW) {
        st = db_fail(c, rc, "looking up a kernel");
        goto out_reset;
    }
    const void *blob = sqlite3_column_blob(q, 0);
    size_t blob_size = (size_t)sqlite3_column_bytes(q, 0);
    sqlite3_int64 raw_size = sqlite3_column_int64(q, 1);
    const void *checksum = sqlite3_column_blob(q, 2);
    int checksum_size = sqlite3_column_bytes(q, 2);
    /* Every check below guards against a row that lies about itself. */
    if (raw_size <= 0 || raw_size > KILN_CACHE_MAX_CUBIN || sqlite3_column_type(q, 1) != SQLITE_INTEGER) {
        snprintf(detail, sizeof detail, "raw_size %lld outside (0, %u]", (long long)raw_size, KILN_CACHE_MAX_CUBIN);
        goto corrupt;
    }
    if (!blob || !blob_size || checksum_size != 32 || !checksum) {
        snprintf(detail, sizeof detail, "blob of %zu bytes, checksum of %d bytes (expected 32)", blob_size,
                 checksum_size);
        goto corrupt;
    }
    unsigned long long frame = ZSTD_getFrameContentSize(blob, blob_size);
    if (frame != (unsigned long long)raw_size) {
        snprintf(detail, sizeof detail, "zstd frame declares %s%llu bytes, row says %lld",
                 frame >= ZSTD_CONTENTSIZE_ERROR ? "no size / " : "", frame >= ZSTD_CONTENTSIZE_ERROR ? 0ULL : frame,
                 (long long)raw_size);
        goto corrupt;
    }
    raw = malloc((size_t)raw_size);
    if (!raw) {
        st = kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a %lld-byte cubin",
                        (long long)raw_size);
        goto out_reset;
    }
    size_t got = ZSTD_decompress(raw, (size_t)raw_size, blob, blob_size);
    if (ZSTD_isError(got) || got != (size_t)raw_size) {
        snprintf(detail, sizeof detail, "zstd: %s (%zu of %lld bytes)",
                 ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short frame", ZSTD_isError(got) ? 0 : got,
                 (long long)raw_size);
        goto corrupt;
    }
    uint8_t sum[32];
    if (kiln__sha256(raw, (size_t)raw_size, sum) != 0 || memcmp(sum, checksum, 32) != 0) {
        snprintf(detail, sizeof detail, "checksum mismatch over %lld bytes", (long long)raw_size);
        goto corrupt;
    }
    if (count_hit) {
        c->counters.hits++;
        record_hit_locked(c, fp);
    }
    *cubin = raw;
    *size = (size_t)raw_size;
    *found = 1;
    raw = NULL;
    goto out_reset;
corrupt:
    sqlite3_reset(q);
    drop_corrupt_locked(c, fp, detail);
    c->counters.misses++;
out_reset:
    sqlite3_reset(q);
    sqlite3_clear_bindings(q);
    pthread_mutex_unlock(&c->lock);
    free(raw);
    return st;
}

kiln_status kiln_cache_contains(kiln_cache *c, const uint8_t fp[KILN_FINGERPRINT_SIZE], int *found)
{
    if (!c || !fp || !found)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_contains: NULL argument");
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->lock);
    sqlite3_bind_blob(c->st_contains, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    int rc = sqlite3_step(c->st_contains);
    *found = rc == SQLITE_ROW;
    if (rc != SQLITE_ROW && rc != SQLITE_DONE)
        st = db_fail(c, rc, "looking up a kernel");
    sqlite3_reset(c->st_contains);
    pthread_mutex_unlock(&c->lock);
    return st;
}

kiln_status kiln_cache_put(kiln_cache *c, const kiln_cache_record *r)
{
    if (!c || !r)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_put: NULL argument");
    if (c->read_only)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "cache %s is read-only", c->path);
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
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->lock);
    sqlite3_stmt *q = c->st_put;
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
    /* One statement in autocommit mode is one transaction. */
    int rc = sqlite3_step(q);
    if (rc != SQLITE_DONE)
        st = db_fail(c, rc, "storing a kernel");
    else if (sqlite3_changes(c->db) > 0)
        c->counters.inserts++;
    sqlite3_reset(q);
    sqlite3_clear_bindings(q);
    pthread_mutex_unlock(&c->lock);
    free(z);
    return st;
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
    int rc = sqlite3_prepare_v2(c->db,
                                "SELECT fingerprint, template_id, constants, arch, entries, nvrtc_major, nvrtc_minor,"
                                " raw_size, length(cubin), hits, created, last_used FROM kernels ORDER BY fingerprint",
                                -1, &q, NULL);
    if (rc != SQLITE_OK) {
        st = db_fail(c, rc, "listing kernels");
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
        if (fn(user, &info))
            break;
    }
    if (rc != SQLITE_ROW && rc != SQLITE_DONE)
        st = db_fail(c, rc, "listing kernels");
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
        c->db,
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
        st = db_fail(c, rc, "counting kernels");
    }
    sqlite3_finalize(q);
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
