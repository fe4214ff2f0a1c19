/* Maintenance of the writable database: verify every row, collect the least
 * recently used, merge another kiln database in. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "cache/internal.h"

/* What a bad row's detail can need: the decoder's text and its prefix. */
#define DETAIL_CAP 256

static kiln_status main_fail(kiln_cache *c, int rc, const char *what) { return kiln__db_fail(c, &c->main, rc, what); }

/* A text column that is really text (NOT NULL in the schema, but a row may lie). */
static int is_text(sqlite3_stmt *q, int i) { return sqlite3_column_type(q, i) == SQLITE_TEXT; }

/* Checks one row of (fingerprint, cubin, raw_size, checksum) at columns
 * first..first+3: KILN_OK, KILN_ERR_CACHE_CORRUPT with detail, or
 * KILN_ERR_HOST_OUT_OF_MEMORY. fp gets the fingerprint (zero-padded when the
 * row's is not 32 bytes). */
static kiln_status check_row(sqlite3_stmt *q, int first, uint8_t fp[KILN_FINGERPRINT_SIZE], char *detail,
                             size_t cap)
{
    const void *key = sqlite3_column_blob(q, first);
    int key_size = sqlite3_column_bytes(q, first);
    memset(fp, 0, KILN_FINGERPRINT_SIZE);
    if (key)
        memcpy(fp, key, key_size < KILN_FINGERPRINT_SIZE ? (size_t)key_size : KILN_FINGERPRINT_SIZE);
    if (key_size != KILN_FINGERPRINT_SIZE) {
        snprintf(detail, cap, "fingerprint of %d bytes (expected %d)", key_size, KILN_FINGERPRINT_SIZE);
        return KILN_ERR_CACHE_CORRUPT;
    }
    const void *blob = sqlite3_column_blob(q, first + 1);
    size_t blob_size = (size_t)sqlite3_column_bytes(q, first + 1);
    sqlite3_int64 raw_size = sqlite3_column_int64(q, first + 2);
    int raw_is_int = sqlite3_column_type(q, first + 2) == SQLITE_INTEGER;
    const void *sum = sqlite3_column_blob(q, first + 3);
    size_t sum_size = (size_t)sqlite3_column_bytes(q, first + 3);
    void *raw = NULL;
    kiln_status st = kiln__row_decode(blob, blob_size, raw_size, raw_is_int, sum, sum_size, &raw, detail, cap);
    free(raw);
    return st;
}

/* ---- verify ---- */

int kiln__row_parts_agree(const kiln__row_meta *m, char *detail, size_t cap)
{
    if (!m->parts || !*m->parts)
        return 1;
    char nvrtc[48];
    snprintf(nvrtc, sizeof nvrtc, "%lld.%lld", (long long)m->nvrtc_major, (long long)m->nvrtc_minor);
    static const char *const names[] = {"template", "constants", "arch", "nvrtc"};
    static const char *const columns[] = {"template_id", "constants", "arch", "NVRTC"};
    const char *have[4] = {m->template_id, m->constants, m->arch, nvrtc};
    for (int i = 0; i < 4; i++) {
        const char *v;
        size_t n;
        if (!kiln__parts_field(m->parts, names[i], &v, &n))
            continue;
        if (have[i] && strlen(have[i]) == n && !memcmp(have[i], v, n))
            continue;
        snprintf(detail, cap, "its fingerprint parts say %s=%.*s, its %s is %.80s", names[i], (int)(n < 80 ? n : 80),
                 v, columns[i], have[i] ? have[i] : "not text");
        return 0;
    }
    return 1;
}

/* kiln__row_parts_agree of columns first..first+5 (template_id, constants,
 * arch, nvrtc_major, nvrtc_minor, parts). */
static int parts_agree(sqlite3_stmt *q, int first, char *detail, size_t cap)
{
    kiln__row_meta m = {.template_id = is_text(q, first) ? (const char *)sqlite3_column_text(q, first) : NULL,
                        .constants = is_text(q, first + 1) ? (const char *)sqlite3_column_text(q, first + 1) : NULL,
                        .arch = is_text(q, first + 2) ? (const char *)sqlite3_column_text(q, first + 2) : NULL,
                        .parts = is_text(q, first + 5) ? (const char *)sqlite3_column_text(q, first + 5) : NULL,
                        .nvrtc_is_integer = 1,
                        .nvrtc_major = sqlite3_column_int64(q, first + 3),
                        .nvrtc_minor = sqlite3_column_int64(q, first + 4)};
    return kiln__row_parts_agree(&m, detail, cap);
}

kiln_status kiln_cache_verify(kiln_cache *c,
                              void (*on_bad)(void *user, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                                             const char *detail),
                              void *user, kiln_cache_verify_report *out)
{
    if (!c || !out)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_verify: NULL argument");
    memset(out, 0, sizeof *out);
    sqlite3_stmt *q = NULL;
    kiln_status st = KILN_OK;
    char first_problem[DETAIL_CAP] = "";
    int rc;
    pthread_mutex_lock(&c->lock);
    /* One read transaction: the rows and the integrity check see one state. */
    if ((rc = sqlite3_exec(c->main.db, "BEGIN", NULL, NULL, NULL)) != SQLITE_OK) {
        st = main_fail(c, rc, "verifying");
        goto out_unlock;
    }
    rc = sqlite3_prepare_v2(c->main.db,
                            c->main.schema >= 2
                                ? "SELECT fingerprint, cubin, raw_size, checksum, template_id, constants, arch,"
                                  " nvrtc_major, nvrtc_minor, parts FROM kernels"
                                : "SELECT fingerprint, cubin, raw_size, checksum, template_id, constants, arch,"
                                  " nvrtc_major, nvrtc_minor, '' FROM kernels",
                            -1, &q, NULL);
    if (rc != SQLITE_OK) {
        st = main_fail(c, rc, "verifying");
        goto out_rollback;
    }
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        uint8_t fp[KILN_FINGERPRINT_SIZE];
        char detail[DETAIL_CAP];
        out->rows++;
        kiln_status row = check_row(q, 0, fp, detail, sizeof detail);
        if (row == KILN_ERR_HOST_OUT_OF_MEMORY) {
            st = kiln__fail(&c->err, row, "cache %s: out of memory verifying a row", c->main.path);
            goto out_finalize;
        }
        if (row == KILN_OK && !parts_agree(q, 4, detail, sizeof detail))
            row = KILN_ERR_CACHE_CORRUPT;
        if (row != KILN_OK) {
            out->bad_rows++;
            if (on_bad)
                on_bad(user, fp, detail);
        }
    }
    /* A file damaged below the rows makes SQLite itself fail: that is a
     * verdict on the database (integrity_ok = 0), not an error of this call. */
    int damaged = 0;
    if (rc != SQLITE_DONE) {
        if (kiln__sqlite_status(rc) != KILN_ERR_CACHE_CORRUPT) {
            st = main_fail(c, rc, "verifying");
            goto out_finalize;
        }
        damaged = 1;
        snprintf(first_problem, sizeof first_problem, "rows unreadable after %llu: %s",
                 (unsigned long long)out->rows, sqlite3_errmsg(c->main.db));
    }
    sqlite3_finalize(q);
    q = NULL;
    if (!damaged && (rc = kiln__verify_schema3_locked(c, on_bad, user, out)) != SQLITE_DONE) {
        if (kiln__sqlite_status(rc) != KILN_ERR_CACHE_CORRUPT) {
            st = main_fail(c, rc, "verifying tuning and coverage rows");
            goto out_rollback;
        }
        damaged = 1;
        snprintf(first_problem, sizeof first_problem, "tuning or coverage rows unreadable: %s",
                 sqlite3_errmsg(c->main.db));
    }
    if ((rc = sqlite3_prepare_v2(c->main.db, "PRAGMA integrity_check", -1, &q, NULL)) != SQLITE_OK) {
        st = main_fail(c, rc, "integrity check");
        goto out_rollback;
    }
    out->integrity_ok = !damaged;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        const unsigned char *line = sqlite3_column_text(q, 0);
        if (line && !strcmp((const char *)line, "ok"))
            continue;
        if (out->integrity_ok)
            snprintf(first_problem, sizeof first_problem, "%s", line ? (const char *)line : "?");
        out->integrity_ok = 0;
    }
    if (rc != SQLITE_DONE) {
        if (kiln__sqlite_status(rc) != KILN_ERR_CACHE_CORRUPT) {
            st = main_fail(c, rc, "integrity check");
            goto out_finalize;
        }
        if (out->integrity_ok)
            snprintf(first_problem, sizeof first_problem, "%s", sqlite3_errmsg(c->main.db));
        out->integrity_ok = 0;
    }
    if (!out->integrity_ok)
        kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT, "cache %s: SQLite integrity check: %s", c->main.path,
                   first_problem);
out_finalize:
    sqlite3_finalize(q);
out_rollback:
    sqlite3_exec(c->main.db, "ROLLBACK", NULL, NULL, NULL);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- gc ---- */

static int pragma_int64(sqlite3 *db, const char *sql, int64_t *out)
{
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(db, sql, -1, &q, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        *out = sqlite3_column_int64(q, 0);
        rc = SQLITE_OK;
    }
    sqlite3_finalize(q);
    return rc;
}

typedef struct victim {
    uint8_t fp[KILN_FINGERPRINT_SIZE]; /* the kernel's fingerprint, or the tuning row's id */
    int64_t bytes;
    int tuning;
} victim;

/* Deletes the listed rows with one statement; adds to the totals. */
static kiln_status delete_victims(kiln_cache *c, const victim *v, size_t n, uint64_t *rows, uint64_t *bytes)
{
    sqlite3_stmt *del = NULL;
    sqlite3_stmt *del_tuning = NULL;
    int rc = sqlite3_prepare_v2(c->main.db, "DELETE FROM kernels WHERE fingerprint = ?1", -1, &del, NULL);
    if (rc == SQLITE_OK && c->main.schema >= 3)
        rc = sqlite3_prepare_v2(c->main.db, "DELETE FROM tuning WHERE id = ?1", -1, &del_tuning, NULL);
    if (rc != SQLITE_OK) {
        sqlite3_finalize(del);
        return main_fail(c, rc, "collecting");
    }
    kiln_status st = KILN_OK;
    sqlite3_stmt *kernel_del = del;
    for (size_t i = 0; i < n; i++) {
        del = v[i].tuning ? del_tuning : kernel_del;
        sqlite3_bind_blob(del, 1, v[i].fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
        rc = sqlite3_step(del);
        sqlite3_reset(del);
        if (rc != SQLITE_DONE) {
            st = main_fail(c, rc, "collecting");
            break;
        }
        if (sqlite3_changes(c->main.db) > 0) {
            (*rows)++;
            *bytes += (uint64_t)v[i].bytes;
        }
    }
    sqlite3_finalize(kernel_del);
    sqlite3_finalize(del_tuning);
    return st;
}

/* Lists the rows to drop in least-recently-used order: those unused since
 * cutoff (when older), then more until the stored bytes fit max_bytes (when
 * set). The list is read in full before anything is deleted. */
static kiln_status pick_victims(kiln_cache *c, int64_t cutoff, int older, uint64_t max_bytes, victim **out,
                                size_t *n_out)
{
    sqlite3_stmt *q = NULL;
    victim *v = NULL;
    size_t n = 0, cap = 0;
    double total = 0;
    kiln_status st = KILN_OK;
    int rc;
    *out = NULL;
    *n_out = 0;
    /* Tuning rows are ranked with the kernels by last use, their bytes those
     * of key and payload. */
    const int tuning = c->main.schema >= 3;
    if (max_bytes) {
        rc = sqlite3_prepare_v2(c->main.db,
                                tuning ? "SELECT (SELECT total(length(cubin)) FROM kernels) +"
                                         " (SELECT total(length(key) + length(payload)) FROM tuning)"
                                       : "SELECT total(length(cubin)) FROM kernels",
                                -1, &q, NULL);
        if (rc == SQLITE_OK && (rc = sqlite3_step(q)) == SQLITE_ROW)
            total = sqlite3_column_double(q, 0);
        sqlite3_finalize(q);
        q = NULL;
        if (rc != SQLITE_ROW)
            return main_fail(c, rc, "collecting");
    }
    rc = sqlite3_prepare_v2(c->main.db,
                            tuning ? "SELECT fingerprint, length(cubin), last_used, 0, created FROM kernels"
                                     " UNION ALL SELECT id, length(key) + length(payload), last_used, 1, created"
                                     " FROM tuning ORDER BY 3, 5, 1"
                                   : "SELECT fingerprint, length(cubin), last_used, 0 FROM kernels"
                                     " ORDER BY last_used, created, fingerprint",
                            -1, &q, NULL);
    if (rc != SQLITE_OK)
        return main_fail(c, rc, "collecting");
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        int64_t bytes = sqlite3_column_int64(q, 1), last_used = sqlite3_column_int64(q, 2);
        int too_old = older && last_used < cutoff;
        int too_big = max_bytes && total > (double)max_bytes;
        if (!too_old && !too_big)
            break; /* the order is by last use: nothing further qualifies */
        if (n == cap) {
            size_t ncap = cap ? 2 * cap : 64;
            victim *p = realloc(v, ncap * sizeof *p);
            if (!p) {
                st = kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory listing %zu rows", ncap);
                goto out_free;
            }
            v = p;
            cap = ncap;
        }
        memset(v[n].fp, 0, KILN_FINGERPRINT_SIZE);
        const void *fp = sqlite3_column_blob(q, 0);
        int fp_size = sqlite3_column_bytes(q, 0);
        if (fp && fp_size == KILN_FINGERPRINT_SIZE)
            memcpy(v[n].fp, fp, KILN_FINGERPRINT_SIZE);
        v[n].bytes = bytes;
        v[n].tuning = sqlite3_column_int(q, 3);
        n++;
        total -= (double)bytes;
    }
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) {
        st = main_fail(c, rc, "collecting");
        goto out_free;
    }
    sqlite3_finalize(q);
    *out = v;
    *n_out = n;
    return KILN_OK;
out_free:
    sqlite3_finalize(q);
    free(v);
    return st;
}

/* gc when the WAL cannot grow: the rollback journal of one row's delete
 * needs room for a few pages, and leaving WAL mode frees the WAL and its
 * index. Rows go one transaction each, least recently used first, so what
 * was deleted stays deleted; then shrink_locked gives the pages back. The
 * handle stays in the rollback journal, which stores into freed pages. */
static kiln_status gc_on_full_disk_locked(kiln_cache *c, int64_t cutoff, int older, uint64_t max_bytes,
                                          uint64_t *rows, uint64_t *bytes)
{
    victim *v = NULL;
    size_t n = 0;
    if (kiln__rollback_journal(c->main.db))
        return kiln__fail(&c->err, KILN_ERR_CACHE_IO,
                          "cache %s: collecting: database or disk is full, and the rollback journal that needs"
                          " less room cannot replace the WAL while another process has the database open",
                          c->main.path);
    /* Zeroing the freed pages would journal each of them: a cubin is no secret. */
    sqlite3_exec(c->main.db, "PRAGMA secure_delete=OFF", NULL, NULL, NULL);
    kiln_status st = pick_victims(c, cutoff, older, max_bytes, &v, &n);
    if (!st)
        st = delete_victims(c, v, n, rows, bytes);
    free(v);
    return st;
}

/* The file could not shrink after gc deleted rows: says so, and what to do. */
static kiln_status not_shrunk(kiln_cache *c, uint64_t rows, uint64_t bytes, int64_t free_pages, int64_t page_size,
                              const char *why)
{
    return kiln__fail(&c->err, KILN_ERR_CACHE_IO,
                      "cache %s: gc removed %llu rows (%llu bytes), but the file could not shrink: %s; its %lld free"
                      " pages (%lld bytes) take new kernels. To give the space back, free room on its filesystem and"
                      " run `kiln gc` again, or `kiln merge %s -o NEW.db` onto a disk with room and replace the file"
                      " with NEW.db",
                      c->main.path, (unsigned long long)rows, (unsigned long long)bytes, why, (long long)free_pages,
                      (long long)(free_pages * page_size), c->main.path);
}

/* Gives the pages gc freed back to the filesystem. A database made with
 * auto_vacuum = INCREMENTAL moves its last pages into the free ones and
 * truncates, a few pages per transaction so that on a full disk each
 * journal is small and each step makes room for the next. One made
 * without it needs a VACUUM, a copy of the live pages (a temporary file and
 * the journal or WAL): only when the filesystem has room for it, and it
 * turns auto_vacuum on for the gcs after. */
static kiln_status shrink_locked(kiln_cache *c, uint64_t rows, uint64_t bytes)
{
    sqlite3 *db = c->main.db;
    int64_t auto_vacuum = 0, free_pages = 0, pages = 0, page_size = 0;
    int rc;
    if ((rc = pragma_int64(db, "PRAGMA auto_vacuum", &auto_vacuum)) != SQLITE_OK ||
        (rc = pragma_int64(db, "PRAGMA freelist_count", &free_pages)) != SQLITE_OK ||
        (rc = pragma_int64(db, "PRAGMA page_count", &pages)) != SQLITE_OK ||
        (rc = pragma_int64(db, "PRAGMA page_size", &page_size)) != SQLITE_OK)
        return main_fail(c, rc, "shrinking the file after gc");
    if (!free_pages || auto_vacuum == 1)
        return KILN_OK; /* auto_vacuum FULL truncates at every commit */
    char why[512];
    if (auto_vacuum == 2) {
        int64_t step = 256;
        while (free_pages > 0) {
            char sql[64];
            snprintf(sql, sizeof sql, "PRAGMA incremental_vacuum(%lld)", (long long)step);
            rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
            if ((rc & 0xff) == SQLITE_FULL && step > 1) {
                step /= 2;
                continue;
            }
            int64_t left = free_pages;
            if (rc != SQLITE_OK || (rc = pragma_int64(db, "PRAGMA freelist_count", &left)) != SQLITE_OK) {
                snprintf(why, sizeof why, "incremental_vacuum(%lld): %s (sqlite code %d)", (long long)step,
                         sqlite3_errmsg(db), rc);
                return not_shrunk(c, rows, bytes, free_pages, page_size, why);
            }
            if (left >= free_pages)
                break; /* nothing moved: stop rather than spin */
            free_pages = left;
            if (step < 256)
                step *= 2;
        }
        /* In WAL mode the file is truncated when the WAL is checkpointed;
         * a reader still on the old pages only delays that to a later one. */
        sqlite3_wal_checkpoint_v2(db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL);
        return KILN_OK;
    }
    char dir[4096];
    kiln__parent_of(c->main.path, dir, sizeof dir);
    struct statvfs vfs;
    uint64_t live = (uint64_t)(pages - free_pages) * (uint64_t)page_size;
    uint64_t need = 2 * live + (64u << 10); /* a temporary copy, and the journal or WAL of one */
    if (statvfs(dir, &vfs) != 0) {
        snprintf(why, sizeof why, "it was made without auto_vacuum, and VACUUM needs about %llu bytes free"
                 " beside it, but statvfs of its folder failed: %s", (unsigned long long)need, strerror(errno));
        return not_shrunk(c, rows, bytes, free_pages, page_size, why);
    }
    uint64_t avail = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
    if (avail < need) {
        snprintf(why, sizeof why, "it was made without auto_vacuum, and VACUUM needs about %llu bytes free"
                 " beside it (twice its %llu bytes in use), and its filesystem has %llu", (unsigned long long)need,
                 (unsigned long long)live, (unsigned long long)avail);
        return not_shrunk(c, rows, bytes, free_pages, page_size, why);
    }
    if ((rc = sqlite3_exec(db, "PRAGMA auto_vacuum = INCREMENTAL", NULL, NULL, NULL)) != SQLITE_OK ||
        (rc = sqlite3_exec(db, "VACUUM", NULL, NULL, NULL)) != SQLITE_OK) {
        snprintf(why, sizeof why, "it was made without auto_vacuum, and VACUUM failed: %s (sqlite code %d)",
                 sqlite3_errmsg(db), rc);
        return not_shrunk(c, rows, bytes, free_pages, page_size, why);
    }
    sqlite3_wal_checkpoint_v2(db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL);
    return KILN_OK;
}

kiln_status kiln_cache_gc(kiln_cache *c, const kiln_cache_gc_options *opts, uint64_t *removed_rows,
                          uint64_t *removed_bytes)
{
    kiln_cache_gc_options o;
    uint64_t rows = 0, bytes = 0;
    if (removed_rows)
        *removed_rows = 0;
    if (removed_bytes)
        *removed_bytes = 0;
    if (!c || !opts)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_gc: NULL argument");
    kiln_status st = KILN__READ_SIZED(&c->err, "kiln_cache_gc", kiln_cache_gc_options, o, opts);
    if (st)
        return st;
    if (c->main.read_only)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "cache %s is read-only: gc cannot remove rows",
                          c->main.path);
    if (o.older_than_seconds < 0)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_gc: older_than_seconds %lld is negative",
                          (long long)o.older_than_seconds);
    if (!o.max_bytes && !o.older_than_seconds)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_cache_gc: no limit (max_bytes and older_than_seconds are both 0)");
    /* Uses gathered in memory count: write them before ranking by last use. */
    if ((st = kiln_cache_flush(c)))
        return st;
    int64_t now = (int64_t)time(NULL);
    int64_t cutoff = o.older_than_seconds > now ? INT64_MIN : now - o.older_than_seconds;
    victim *v = NULL;
    size_t n = 0;
    int full = 0;
    pthread_mutex_lock(&c->lock);
    int rc = sqlite3_exec(c->main.db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        st = main_fail(c, rc, "collecting");
        goto out_unlock;
    }
    if ((st = pick_victims(c, cutoff, o.older_than_seconds > 0, o.max_bytes, &v, &n)) ||
        (st = delete_victims(c, v, n, &rows, &bytes)))
        goto out_rollback;
    if ((rc = sqlite3_exec(c->main.db, "COMMIT", NULL, NULL, NULL)) != SQLITE_OK) {
        st = main_fail(c, rc, "collecting");
        goto out_rollback;
    }
    goto out_shrink;
out_rollback:
    full = (sqlite3_extended_errcode(c->main.db) & 0xff) == SQLITE_FULL;
    sqlite3_exec(c->main.db, "ROLLBACK", NULL, NULL, NULL);
    if (!full)
        goto out_unlock;
    rows = bytes = 0;
    if ((st = gc_on_full_disk_locked(c, cutoff, o.older_than_seconds > 0, o.max_bytes, &rows, &bytes)))
        goto out_report;
out_shrink:
    /* Also when nothing was removed: a gc after one that could not shrink
     * the file (no room then) gives the pages back once there is room. */
    if ((st = shrink_locked(c, rows, bytes)) && !rows)
        st = KILN_OK;
out_report:
    if (removed_rows)
        *removed_rows = rows;
    if (removed_bytes)
        *removed_bytes = bytes;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    free(v);
    return st;
}

/* ---- merge ---- */

/* "file:" URI of path, the characters a URI gives meaning to escaped. */
static int uri_of(const char *path, const char *query, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "file:");
    for (const char *p = path; *p; p++) {
        if (n + 4 >= cap)
            return -1;
        if (*p == '?' || *p == '#' || *p == '%')
            n += (size_t)snprintf(buf + n, cap - n, "%%%02X", (unsigned char)*p);
        else
            buf[n++] = *p;
    }
    if (n + strlen(query) + 2 > cap)
        return -1;
    snprintf(buf + n, cap - n, "?%s", query);
    return 0;
}

/* Opens src_path read-only (immutable when nobody may write it, so that no
 * -wal or -shm appears beside it) and checks it is a kiln database of a
 * schema this library reads; *has_parts says whether it has `parts`. */
static kiln_status open_source(kiln_cache *c, const char *src_path, sqlite3 **out, int *has_parts)
{
    char uri[8300], dir[4096];
    sqlite3 *db = NULL;
    int64_t app_id = 0, version = 0;
    struct stat sb;
    *out = NULL;
    kiln_status st = kiln__check_regular_file(c, src_path, &sb);
    if (st)
        return st;
    kiln__parent_of(src_path, dir, sizeof dir);
    int immutable = access(src_path, W_OK) != 0 || access(dir, W_OK) != 0;
    if (uri_of(src_path, immutable ? "immutable=1" : "mode=ro", uri, sizeof uri))
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "merge: path too long: %s", src_path);
    int rc = sqlite3_open_v2(uri, &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI | SQLITE_OPEN_FULLMUTEX, NULL);
    if (rc != SQLITE_OK) {
        st = kiln__fail(&c->err, KILN_ERR_CACHE_IO, "merge: cannot open %s: %s", src_path,
                        db ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
        sqlite3_close(db);
        return st;
    }
    sqlite3_extended_result_codes(db, 1);
    sqlite3_busy_timeout(db, 10000);
    if ((rc = pragma_int64(db, "PRAGMA application_id", &app_id)) != SQLITE_OK ||
        (rc = pragma_int64(db, "PRAGMA user_version", &version)) != SQLITE_OK) {
        /* A file that is not SQLite at all is "not a kiln database" too. */
        st = kiln__sqlite_status(rc) == KILN_ERR_CACHE_CORRUPT
                 ? kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA, "merge: %s is not a kiln cache database (%s)",
                              src_path, sqlite3_errstr(rc))
                 : kiln__fail(&c->err, kiln__sqlite_status(rc), "merge: reading %s: %s", src_path,
                              sqlite3_errmsg(db));
        goto out_close;
    }
    if (app_id != KILN_APPLICATION_ID) {
        st = kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA,
                        "merge: %s is not a kiln cache database (application_id 0x%llx, expected 0x%x)", src_path,
                        (unsigned long long)app_id, KILN_APPLICATION_ID);
        goto out_close;
    }
    if (version < 1 || version > KILN_CACHE_SCHEMA_VERSION) {
        st = kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA,
                        "merge: %s has schema version %lld, this library reads versions 1 to %d%s", src_path,
                        (long long)version, KILN_CACHE_SCHEMA_VERSION,
                        version > KILN_CACHE_SCHEMA_VERSION ? " (made by a newer kiln)" : "");
        goto out_close;
    }
    int64_t n_parts = 0;
    if ((rc = pragma_int64(db, "SELECT count(*) FROM pragma_table_info('kernels') WHERE name = 'parts'",
                           &n_parts)) != SQLITE_OK) {
        st = kiln__fail(&c->err, kiln__sqlite_status(rc), "merge: reading %s: %s", src_path, sqlite3_errmsg(db));
        goto out_close;
    }
    *has_parts = n_parts > 0;
    *out = db;
    return KILN_OK;
out_close:
    sqlite3_close(db);
    return st;
}

/* Whether a source row's other columns would make a row kiln can use:
 * text where text belongs, integers where integers do. */
static int row_shape_ok(sqlite3_stmt *q, int has_parts, char *detail, size_t cap)
{
    static const char *const text_cols[] = {"template_id", "constants", "arch", "entries"};
    static const int text_idx[] = {4, 5, 6, 7};
    static const char *const int_cols[] = {"nvrtc_major", "nvrtc_minor", "created", "last_used", "hits"};
    static const int int_idx[] = {8, 9, 10, 11, 12};
    for (size_t i = 0; i < 4; i++) {
        if (!is_text(q, text_idx[i])) {
            snprintf(detail, cap, "%s is not text", text_cols[i]);
            return 0;
        }
    }
    for (size_t i = 0; i < 5; i++) {
        if (sqlite3_column_type(q, int_idx[i]) != SQLITE_INTEGER) {
            snprintf(detail, cap, "%s is not an integer", int_cols[i]);
            return 0;
        }
    }
    if (has_parts && sqlite3_column_type(q, 13) != SQLITE_TEXT && sqlite3_column_type(q, 13) != SQLITE_NULL) {
        snprintf(detail, cap, "parts is not text");
        return 0;
    }
    return 1;
}

/* Copies every verified row of src into the main database (inside the
 * caller's transaction). */
static kiln_status copy_rows(kiln_cache *c, sqlite3 *src, const char *src_path, int src_parts, uint64_t *copied,
                             uint64_t *skipped)
{
    sqlite3_stmt *q = NULL, *ins = NULL;
    kiln_status st = KILN_OK;
    int dst_parts = c->main.schema >= 2;
    char sql[512];
    snprintf(sql, sizeof sql,
             "SELECT fingerprint, cubin, raw_size, checksum, template_id, constants, arch, entries,"
             " nvrtc_major, nvrtc_minor, created, last_used, hits, %s FROM kernels",
             src_parts ? "parts" : "''");
    int rc = sqlite3_prepare_v2(src, sql, -1, &q, NULL);
    if (rc != SQLITE_OK) {
        st = kiln__fail(&c->err, kiln__sqlite_status(rc), "merge: reading %s: %s", src_path, sqlite3_errmsg(src));
        goto out;
    }
    snprintf(sql, sizeof sql,
             "INSERT OR IGNORE INTO kernels (fingerprint, cubin, raw_size, checksum, template_id, constants, arch,"
             " entries, nvrtc_major, nvrtc_minor, created, last_used, hits%s)"
             " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13%s)",
             dst_parts ? ", parts" : "", dst_parts ? ", ?14" : "");
    if ((rc = sqlite3_prepare_v2(c->main.db, sql, -1, &ins, NULL)) != SQLITE_OK) {
        st = main_fail(c, rc, "merging");
        goto out;
    }
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        uint8_t fp[KILN_FINGERPRINT_SIZE];
        char detail[DETAIL_CAP];
        kiln_status row = check_row(q, 0, fp, detail, sizeof detail);
        if (row == KILN_ERR_HOST_OUT_OF_MEMORY) {
            st = kiln__fail(&c->err, row, "merge: out of memory verifying a row of %s", src_path);
            goto out;
        }
        if (row != KILN_OK || !row_shape_ok(q, src_parts, detail, sizeof detail)) {
            (*skipped)++;
            continue;
        }
        /* Columns go across as SQLite values: nothing is reinterpreted. */
        for (int i = 0; i < 13; i++)
            sqlite3_bind_value(ins, i + 1, sqlite3_column_value(q, i));
        if (dst_parts) {
            const unsigned char *parts = sqlite3_column_text(q, 13);
            sqlite3_bind_text(ins, 14, parts ? (const char *)parts : "", -1, SQLITE_TRANSIENT);
        }
        int irc = sqlite3_step(ins);
        sqlite3_reset(ins);
        sqlite3_clear_bindings(ins);
        if (irc != SQLITE_DONE) {
            st = main_fail(c, irc, "merging");
            goto out;
        }
        if (sqlite3_changes(c->main.db) > 0)
            (*copied)++;
    }
    if (rc != SQLITE_DONE)
        st = kiln__fail(&c->err, kiln__sqlite_status(rc), "merge: reading %s: %s", src_path, sqlite3_errmsg(src));
out:
    sqlite3_finalize(ins);
    sqlite3_finalize(q);
    return st;
}

kiln_status kiln_cache_merge(kiln_cache *c, const char *src_path, uint64_t *copied, uint64_t *skipped)
{
    uint64_t n_copied = 0, n_skipped = 0;
    if (copied)
        *copied = 0;
    if (skipped)
        *skipped = 0;
    if (!c || !src_path)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_merge: NULL argument");
    if (c->main.read_only)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "cache %s is read-only: nothing can be merged in",
                          c->main.path);
    sqlite3 *src = NULL;
    int src_parts = 0;
    kiln_status st = open_source(c, src_path, &src, &src_parts);
    if (st)
        return st;
    pthread_mutex_lock(&c->lock);
    int rc = sqlite3_exec(c->main.db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        st = main_fail(c, rc, "merging");
        goto out_unlock;
    }
    if ((st = copy_rows(c, src, src_path, src_parts, &n_copied, &n_skipped)))
        goto out_rollback;
    /* Tuning rows and coverage records, verified as kernels are. */
    if ((rc = kiln__merge_schema3_locked(c, src, &n_copied, &n_skipped)) != SQLITE_DONE) {
        st = kiln__fail(&c->err, kiln__sqlite_status(rc), "merge: tuning and coverage rows of %s: %s", src_path,
                        sqlite3_errmsg(src));
        goto out_rollback;
    }
    if ((rc = sqlite3_exec(c->main.db, "COMMIT", NULL, NULL, NULL)) != SQLITE_OK) {
        st = main_fail(c, rc, "merging");
        goto out_rollback;
    }
    c->counters.inserts += n_copied;
    if (copied)
        *copied = n_copied;
    if (skipped)
        *skipped = n_skipped;
    goto out_unlock;
out_rollback:
    sqlite3_exec(c->main.db, "ROLLBACK", NULL, NULL, NULL);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    sqlite3_close(src);
    return st;
}
