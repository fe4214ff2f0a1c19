/* Opening the cubin database: the writable one and the shipped read-only
 * layers, their schema (created, migrated or refused), and closing. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "cache/internal.h"

/* The kernels table of schema 2: schema 1's plus `parts`, the digests of the
 * fingerprint's parts. Schema 3 adds cache/tuning.c's tables. */
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
    "  hits INTEGER NOT NULL DEFAULT 0,"
    "  parts TEXT NOT NULL DEFAULT ''"
    ") WITHOUT ROWID;"
    "CREATE INDEX IF NOT EXISTS kernels_by_template ON kernels (template_id);";

kiln_status kiln__sqlite_status(int rc)
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

static kiln_status db_fail(kiln_cache *c, kiln__db *d, int rc, const char *what)
{
    return kiln__fail(&c->err, kiln__sqlite_status(rc), "cache %s: %s: %s (sqlite code %d)", d->path, what,
                      d->db ? sqlite3_errmsg(d->db) : sqlite3_errstr(rc), rc);
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

void kiln__parent_of(const char *path, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s", path);
    char *slash = strrchr(buf, '/');
    if (!slash)
        snprintf(buf, cap, ".");
    else if (slash == buf)
        buf[1] = 0;
    else
        *slash = 0;
}

/* Network filesystems (NFS, SMB/CIFS, Lustre, GPFS) break WAL's shared
 * memory: there the rollback journal is used. */
static int on_network_filesystem(const char *path)
{
    char dir[4096];
    struct statfs fs;
    kiln__parent_of(path, dir, sizeof dir);
    if (statfs(dir, &fs) != 0)
        return 0;
    switch ((unsigned long)fs.f_type) {
    case 0x6969UL:     /* NFS */
    case 0x517BUL:     /* SMB */
    case 0xFF534D42UL: /* CIFS */
    case 0xFE534D42UL: /* SMB2 */
    case 0x0BD00BD0UL: /* Lustre */
    case 0x47504653UL: /* GPFS */
        return 1;
    default:
        return 0;
    }
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

static kiln_status exec_tx(kiln_cache *c, kiln__db *d, const char *sql, const char *what)
{
    char *msg = NULL;
    int rc = sqlite3_exec(d->db, sql, NULL, NULL, &msg);
    if (rc == SQLITE_OK)
        return KILN_OK;
    kiln_status st = kiln__fail(&c->err, kiln__sqlite_status(rc), "cache %s: %s: %s", d->path, what,
                                msg ? msg : sqlite3_errstr(rc));
    sqlite3_free(msg);
    sqlite3_exec(d->db, "ROLLBACK", NULL, NULL, NULL);
    return st;
}

/* Whether the file starts with SQLite's header. */
static int is_sqlite_file(const char *path)
{
    static const char magic[16] = "SQLite format 3";
    char head[16];
    FILE *f = fopen(path, "rb");
    if (!f)
        return 0;
    size_t n = fread(head, 1, sizeof head, f);
    fclose(f);
    return n == sizeof head && !memcmp(head, magic, sizeof magic);
}

/* Creates the schema in an empty database, migrates schema 1, accepts ours,
 * refuses the rest (another application's file, a newer kiln's). */
static kiln_status check_schema(kiln_cache *c, kiln__db *d)
{
    int64_t app_id = 0, version = 0, n_tables = 0;
    int rc;
    /* One statement, so one snapshot: read one by one, a process creating the
     * schema at the same moment could show tables without their application_id. */
    sqlite3_stmt *q = NULL;
    rc = sqlite3_prepare_v2(d->db,
                            "SELECT (SELECT application_id FROM pragma_application_id()),"
                            " (SELECT user_version FROM pragma_user_version()), (SELECT count(*) FROM sqlite_master)",
                            -1, &q, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(q)) == SQLITE_ROW) {
        app_id = sqlite3_column_int64(q, 0);
        version = sqlite3_column_int64(q, 1);
        n_tables = sqlite3_column_int64(q, 2);
        rc = SQLITE_OK;
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_OK) {
        if (kiln__sqlite_status(rc) == KILN_ERR_CACHE_CORRUPT) {
            /* An SQLite file whose pages are damaged (truncated, overwritten)
             * is a corrupt cache; anything else is not a kiln database. */
            if ((rc & 0xff) == SQLITE_CORRUPT && is_sqlite_file(d->path))
                return kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT,
                                  "cache %s: the database is damaged (%s); delete it and kiln rebuilds it", d->path,
                                  sqlite3_errstr(rc));
            return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA, "cache %s: not a kiln cache database (%s)", d->path,
                              sqlite3_errstr(rc));
        }
        return db_fail(c, d, rc, "reading the schema");
    }
    if (app_id == 0 && version == 0 && n_tables == 0) {
        if (d->read_only)
            return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA, "cache %s: empty database opened read-only", d->path);
        char sql[sizeof schema_sql + 4096];
        /* auto_vacuum takes only before the first table: it lets gc give freed
         * pages back to the filesystem (incremental_vacuum) without a VACUUM,
         * which needs room for a copy of the file. */
        snprintf(sql, sizeof sql,
                 "PRAGMA auto_vacuum = INCREMENTAL;BEGIN IMMEDIATE;%s%sPRAGMA application_id = %d;"
                 "PRAGMA user_version = %d;COMMIT;",
                 schema_sql, kiln__schema3_sql, KILN_APPLICATION_ID, KILN_CACHE_SCHEMA_VERSION);
        kiln_status st = exec_tx(c, d, sql, "creating the schema");
        /* Another process may have created it at the same moment. */
        if (st && pragma_int(d->db, "PRAGMA user_version", &version) == SQLITE_OK &&
            version == KILN_CACHE_SCHEMA_VERSION)
            st = KILN_OK;
        d->schema = KILN_CACHE_SCHEMA_VERSION;
        return st;
    }
    if (app_id != KILN_APPLICATION_ID)
        return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA,
                          "cache %s: not a kiln cache database (application_id 0x%llx, expected 0x%x)", d->path,
                          (unsigned long long)app_id, KILN_APPLICATION_ID);
    if ((version == 1 || version == 2) && !d->read_only) {
        /* Schema 1 lacks `parts` (its rows stay valid, their parts unknown);
         * schemas 1 and 2 lack the tuning and coverage tables. */
        char sql[4096];
        snprintf(sql, sizeof sql, "BEGIN IMMEDIATE;%s%sPRAGMA user_version = %d;COMMIT;",
                 version == 1 ? "ALTER TABLE kernels ADD COLUMN parts TEXT NOT NULL DEFAULT '';" : "",
                 kiln__schema3_sql, KILN_CACHE_SCHEMA_VERSION);
        kiln_status st = exec_tx(c, d, sql, version == 1 ? "migrating schema 1 to 3" : "migrating schema 2 to 3");
        if (st && pragma_int(d->db, "PRAGMA user_version", &version) == SQLITE_OK &&
            version == KILN_CACHE_SCHEMA_VERSION)
            st = KILN_OK; /* migrated by another process meanwhile */
        d->schema = KILN_CACHE_SCHEMA_VERSION;
        return st;
    }
    if (version < 1 || version > KILN_CACHE_SCHEMA_VERSION)
        return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA,
                          "cache %s: schema version %lld, this library reads versions 1 to %d%s", d->path,
                          (long long)version, KILN_CACHE_SCHEMA_VERSION,
                          version > KILN_CACHE_SCHEMA_VERSION ? " (made by a newer kiln)" : "");
    d->schema = (int)version;
    return KILN_OK;
}

static kiln_status prepare(kiln_cache *c, kiln__db *d, sqlite3_stmt **st, const char *sql)
{
    int rc = sqlite3_prepare_v3(d->db, sql, -1, SQLITE_PREPARE_PERSISTENT, st, NULL);
    return rc == SQLITE_OK ? KILN_OK : db_fail(c, d, rc, "preparing a statement");
}

/* "file:" URI of path with the characters a URI gives meaning to escaped. */
static kiln_status uri_of(const char *path, const char *query, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "file:");
    for (const char *p = path; *p && n + 4 < cap; p++) {
        if (*p == '?' || *p == '#' || *p == '%')
            n += (size_t)snprintf(buf + n, cap - n, "%%%02X", (unsigned char)*p);
        else
            buf[n++] = *p;
    }
    if (n + strlen(query) + 2 >= cap)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "cache path too long: %s", path);
    snprintf(buf + n, cap - n, "?%s", query);
    return KILN_OK;
}

kiln_status kiln__check_regular_file(kiln_cache *c, const char *path, struct stat *sb)
{
    if (stat(path, sb) != 0)
        return kiln__fail(&c->err, KILN_ERR_CACHE_IO, "cannot open cache database %s: %s", path, strerror(errno));
    if (!S_ISREG(sb->st_mode))
        return kiln__fail(&c->err, KILN_ERR_CACHE_IO, "cannot open cache database %s: not a regular file (%s)", path,
                          kiln__file_kind(sb->st_mode));
    return KILN_OK;
}

/* Checks what is at path with lstat and stat before SQLite opens it: SQLite
 * would block on a FIFO, create a file through a dangling link, overwrite a
 * link's target, or take a short file for an empty database and write the
 * schema over it. *exists says whether a file is there. */
static kiln_status check_path(kiln_cache *c, const char *path, int read_only, const kiln_cache_options *o,
                              int *exists)
{
    struct stat sb;
    *exists = 0;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT && !read_only && !o->existing_only)
            return KILN_OK; /* absent: it will be created */
        return kiln__fail(&c->err, KILN_ERR_CACHE_IO, "cannot open cache database %s: %s", path, strerror(errno));
    }
    if (S_ISLNK(sb.st_mode)) {
        char target[4096];
        ssize_t n = readlink(path, target, sizeof target - 1);
        target[n > 0 ? n : 0] = 0;
        /* Read-only too: a shipped layer's link can be repointed by whoever owns its folder. */
        if (!o->follow_symlinks)
            return kiln__fail(&c->err, KILN_ERR_CACHE_IO,
                              "cache database %s is a symbolic link to %s: refused%s (name the target, or set "
                              "KILN_CACHE_FOLLOW_SYMLINKS=1 or kiln_cache_options.follow_symlinks)",
                              path, target, read_only ? "" : " for writing");
        if (stat(path, &sb) != 0)
            return kiln__fail(&c->err, KILN_ERR_CACHE_IO,
                              "cache database %s is a symbolic link to %s: %s (kiln creates no file through a link)",
                              path, target, strerror(errno));
    }
    kiln_status st = kiln__check_regular_file(c, path, &sb);
    if (st)
        return st;
    *exists = 1;
    if (sb.st_size == 0 && o->existing_only)
        return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA,
                          "cache %s: an empty file, not a kiln cache database; left as it is", path);
    if (read_only || sb.st_size == 0 || is_sqlite_file(path))
        return KILN_OK;
    return kiln__fail(&c->err, KILN_ERR_CACHE_SCHEMA,
                      "cache %s: not a kiln cache database (a file of %lld bytes that is not SQLite); left as it is",
                      path, (long long)sb.st_size);
}

/* Creates the missing database file itself (O_EXCL never follows a link, so a
 * link made meanwhile is not followed), then checks the path again. */
static kiln_status create_and_check(kiln_cache *c, const char *path, const kiln_cache_options *o)
{
    int exists = 0;
    kiln_status st = check_path(c, path, 0, o, &exists);
    if (st || exists)
        return st;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST)
        return kiln__fail(&c->err, KILN_ERR_CACHE_IO, "cannot create cache database %s: %s", path, strerror(errno));
    if (fd >= 0)
        close(fd);
    return check_path(c, path, 0, o, &exists);
}

/* The busy handler while the cache opens: every statement of the open waits
 * for one deadline, so the open as a whole gives up after one busy timeout. */
static int busy_until_deadline(void *arg, int count)
{
    double left = *(const double *)arg - kiln__now();
    if (left <= 0)
        return 0;
    double wait = count < 5 ? 0.001 * (1 << count) : 0.02;
    usleep((useconds_t)((wait < left ? wait : left) * 1e6) + 1);
    return 1;
}

/* Opens one database. A read-only one is opened immutable when nobody may
 * write it (the file or its folder is read-only): then SQLite takes no lock
 * and makes no -wal or -shm file beside it. The file is checked (kind, link,
 * application id and schema) before anything is written to it. */
static kiln_status open_db(kiln_cache *c, kiln__db *d, const char *path, int read_only,
                           const kiln_cache_options *o, int busy_ms)
{
    char uri[8300];
    kiln_status st;
    int exists = 0;
    d->read_only = read_only;
    if (!(d->path = kiln__strdup(path)))
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    if (read_only) {
        char dir[4096];
        kiln__parent_of(path, dir, sizeof dir);
        if ((st = check_path(c, path, 1, o, &exists)))
            return st;
        d->immutable = access(path, W_OK) != 0 || access(dir, W_OK) != 0;
        if ((st = uri_of(path, d->immutable ? "immutable=1" : "mode=ro", uri, sizeof uri)))
            return st;
    } else if ((!o->existing_only && (st = make_parent_dirs(path))) ||
               (st = uri_of(path, "mode=rw", uri, sizeof uri)) || (st = create_and_check(c, path, o))) {
        return st;
    }
    /* Not SQLITE_OPEN_NOFOLLOW: it refuses a link anywhere in the path, and a
     * folder reached through a link (~/.cache on another disk) is fine. */
    int flags = (read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE) | SQLITE_OPEN_URI | SQLITE_OPEN_FULLMUTEX;
    int rc = sqlite3_open_v2(uri, &d->db, flags, NULL);
    if (rc != SQLITE_OK)
        return kiln__fail(&c->err, KILN_ERR_CACHE_IO, "cannot open cache database %s: %s", path,
                          d->db ? sqlite3_errmsg(d->db) : sqlite3_errstr(rc));
    sqlite3_extended_result_codes(d->db, 1);
    sqlite3_busy_handler(d->db, busy_until_deadline, &c->open_deadline);
    if ((st = check_schema(c, d)))
        return st;
    if (!read_only) {
        /* WAL where the filesystem allows it; the rollback journal otherwise. */
        sqlite3_exec(d->db, on_network_filesystem(path) ? "PRAGMA journal_mode=DELETE" : "PRAGMA journal_mode=WAL",
                     NULL, NULL, NULL);
        sqlite3_exec(d->db, "PRAGMA synchronous=NORMAL", NULL, NULL, NULL);
    }
    if ((st = prepare(c, d, &d->st_get,
                      d->schema >= 2 ? "SELECT cubin, raw_size, checksum, template_id, constants, arch, nvrtc_major,"
                                       " nvrtc_minor, parts, entries FROM kernels WHERE fingerprint = ?1"
                                     : "SELECT cubin, raw_size, checksum, template_id, constants, arch, nvrtc_major,"
                                       " nvrtc_minor, '', entries FROM kernels WHERE fingerprint = ?1")) ||
        (st = prepare(c, d, &d->st_contains, "SELECT 1 FROM kernels WHERE fingerprint = ?1")))
        return st;
    if (!read_only &&
        ((st = prepare(c, d, &d->st_put,
                       "INSERT OR IGNORE INTO kernels (fingerprint, template_id, constants, arch, nvrtc_major,"
                       " nvrtc_minor, entries, cubin, raw_size, checksum, created, last_used, hits, parts)"
                       " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11, 0, ?12)")) ||
         (st = prepare(c, d, &d->st_delete, "DELETE FROM kernels WHERE fingerprint = ?1")) ||
         (st = prepare(c, d, &d->st_hit,
                       "UPDATE kernels SET hits = hits + ?2, last_used = max(last_used, ?3) WHERE fingerprint = ?1"))))
        return st;
    /* Past the open, each statement gets the busy timeout of its own. */
    sqlite3_busy_timeout(d->db, busy_ms);
    return KILN_OK;
}

static void close_db(kiln__db *d)
{
    sqlite3_finalize(d->st_get);
    sqlite3_finalize(d->st_contains);
    sqlite3_finalize(d->st_put);
    sqlite3_finalize(d->st_delete);
    sqlite3_finalize(d->st_hit);
    sqlite3_close(d->db);
    kiln__manifest_free(d->manifest);
    free(d->path);
    memset(d, 0, sizeof *d);
}

/* Whether a layer holds any row for the architecture and NVRTC asked for;
 * when not, *reason says what it was built for. */
static int layer_matches(kiln__db *d, const kiln_cache_options *o, char *reason, size_t cap, uint64_t *entries)
{
    sqlite3_stmt *q = NULL;
    int64_t n = 0;
    *entries = pragma_int(d->db, "SELECT count(*) FROM kernels", &n) == SQLITE_OK ? (uint64_t)n : 0;
    if (!o->arch)
        return 1;
    int match = 0;
    size_t len = (size_t)snprintf(reason, cap, "built for");
    if (sqlite3_prepare_v2(d->db, "SELECT DISTINCT arch, nvrtc_major, nvrtc_minor FROM kernels ORDER BY 1, 2, 3",
                           -1, &q, NULL) == SQLITE_OK) {
        int first = 1;
        while (sqlite3_step(q) == SQLITE_ROW) {
            const char *arch = (const char *)sqlite3_column_text(q, 0);
            int major = sqlite3_column_int(q, 1), minor = sqlite3_column_int(q, 2);
            if (arch && !strcmp(arch, o->arch) && major == o->nvrtc_major && minor == o->nvrtc_minor)
                match = 1;
            if (len < cap)
                len += (size_t)snprintf(reason + len, cap - len, "%s %s with NVRTC %d.%d", first ? "" : ",",
                                        arch ? arch : "?", major, minor);
            first = 0;
        }
        if (first && len < cap)
            snprintf(reason + len, cap - len, " nothing (it is empty)");
    }
    sqlite3_finalize(q);
    if (!match) {
        len = strlen(reason);
        if (len < cap)
            snprintf(reason + len, cap - len, "; this process needs %s with NVRTC %d.%d", o->arch, o->nvrtc_major,
                     o->nvrtc_minor);
    }
    return match;
}

/* Opens each shipped layer; one that fails to open or does not match is
 * skipped with its reason, never an error for the cache as a whole. */
static kiln_status open_layers(kiln_cache *c, const kiln_cache_options *o, int busy_ms)
{
    const char *const *paths = o->readonly_paths;
    size_t n = o->n_readonly_paths;
    char *env_copy = NULL;
    const char *env_paths[64];
    if (!paths && !o->ignore_env) {
        const char *env = getenv("KILN_CACHE_READONLY");
        if (env && *env) {
            if (!(env_copy = kiln__strdup(env)))
                return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
            n = 0;
            for (char *save = NULL, *tok = strtok_r(env_copy, ":", &save); tok && n < 64;
                 tok = strtok_r(NULL, ":", &save))
                env_paths[n++] = tok;
            paths = env_paths;
        }
    }
    kiln_status st = KILN_OK;
    if (!n)
        goto out;
    c->layers = calloc(n, sizeof *c->layers);
    c->layer_info = calloc(n, sizeof *c->layer_info);
    if (!c->layers || !c->layer_info) {
        st = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        kiln_cache_layer_info *info = &c->layer_info[c->n_layer_info++];
        char reason[1024] = "";
        kiln__db d = {0};
        info->path = kiln__strdup(paths[i] ? paths[i] : "");
        if (!paths[i] || open_db(c, &d, paths[i], 1, o, busy_ms) != KILN_OK) {
            snprintf(reason, sizeof reason, "%s", paths[i] ? kiln_errmsg() : "NULL path");
            close_db(&d);
        } else if (!layer_matches(&d, o, reason, sizeof reason, &info->entries) ||
                   (c->n_trusted && !kiln__layer_trusted(c, &d, reason, sizeof reason))) {
            /* Under a trust policy no row of a layer it does not admit is searched. */
            close_db(&d);
        } else {
            c->layers[c->n_layers++] = d;
            info->active = 1;
            reason[0] = 0;
        }
        info->reason = kiln__strdup(reason);
        if (!info->path || !info->reason) {
            st = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
            goto out;
        }
    }
out:
    free(env_copy);
    return st;
}

kiln_status kiln_cache_open(const kiln_cache_options *caller, kiln_cache **out)
{
    kiln_cache_options o;
    char path[4096];
    kiln_status st;
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_open: out is NULL");
    *out = NULL;
    if ((st = KILN__READ_SIZED(NULL, "kiln_cache_open", kiln_cache_options, o, caller)))
        return st;
    if (!o.ignore_env) {
        const char *follow = getenv("KILN_CACHE_FOLLOW_SYMLINKS");
        if (follow && !strcmp(follow, "1"))
            o.follow_symlinks = 1;
    }
    const kiln_cache_options *opts = &o;
    if (opts->path && *opts->path) {
        if (strlen(opts->path) >= sizeof path)
            return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "cache path longer than %zu bytes", sizeof path - 1);
        strcpy(path, opts->path);
    } else if ((st = kiln_cache_default_path(path, sizeof path)) != KILN_OK) {
        return st;
    }
    if (opts->n_readonly_paths && !opts->readonly_paths)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_open: %zu read-only paths and no list",
                          opts->n_readonly_paths);
    kiln_cache *c = calloc(1, sizeof *c);
    if (!c)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln__errslot_init(&c->err);
    pthread_mutex_init(&c->lock, NULL);
    c->on_event = opts->on_event;
    c->user = opts->user;
    int busy_ms = opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : 10000;
    c->open_deadline = kiln__now() + busy_ms / 1000.0;
    /* The remote's URL is checked before any file is created. */
    if ((st = kiln__load_trust(c, opts->trusted_keys, opts->n_trusted_keys, opts->ignore_env)) ||
        (st = kiln__remote_open(c, opts)) || (st = open_layers(c, opts, busy_ms)) ||
        (st = open_db(c, &c->main, path, opts->read_only, opts, busy_ms)))
        goto out_free;
    *out = c;
    return KILN_OK;
out_free:
    kiln__propagate(NULL, st);
    kiln_cache_close(c);
    return st;
}

void kiln_cache_close(kiln_cache *c)
{
    if (!c)
        return;
    if (c->main.db)
        kiln_cache_flush(c);
    close_db(&c->main);
    for (size_t i = 0; i < c->n_layers; i++)
        close_db(&c->layers[i]);
    for (size_t i = 0; i < c->n_layer_info; i++) {
        free((char *)c->layer_info[i].path);
        free((char *)c->layer_info[i].reason);
    }
    free(c->layers);
    free(c->layer_info);
    kiln__remote_close(c->remote);
    free(c->trusted);
    pthread_mutex_destroy(&c->lock);
    kiln__errslot_destroy(&c->err);
    free(c);
}

kiln_status kiln_cache_seal(kiln_cache *c)
{
    if (!c)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_seal: cache is NULL");
    if (c->main.read_only)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "cache %s is read-only", c->main.path);
    kiln_status st = kiln_cache_flush(c);
    if (st)
        return st;
    pthread_mutex_lock(&c->lock);
    static const char *const steps[] = {"PRAGMA wal_checkpoint(TRUNCATE)", "PRAGMA journal_mode=DELETE", "VACUUM"};
    for (size_t i = 0; i < sizeof steps / sizeof steps[0] && !st; i++) {
        int rc = sqlite3_exec(c->main.db, steps[i], NULL, NULL, NULL);
        if (rc != SQLITE_OK)
            st = db_fail(c, &c->main, rc, steps[i]);
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

const char *kiln_cache_path(const kiln_cache *c) { return c && c->main.path ? c->main.path : ""; }
const char *kiln_cache_errmsg(const kiln_cache *c) { return c ? c->err.msg : ""; }
size_t kiln_cache_layer_count(const kiln_cache *c) { return c ? c->n_layer_info + (c->remote != NULL) : 0; }

kiln_status kiln_cache_layer(const kiln_cache *c, size_t index, kiln_cache_layer_info *out)
{
    if (!c || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_layer: NULL argument");
    if (index == c->n_layer_info && c->remote) {
        /* Its state changes with the server's: read now. */
        kiln__remote_info((kiln_cache *)c, out);
        return KILN_OK;
    }
    if (index >= c->n_layer_info)
        return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "layer %zu: the cache has %zu", index,
                          kiln_cache_layer_count(c));
    *out = c->layer_info[index];
    return KILN_OK;
}
