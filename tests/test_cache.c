/* The cubin database: round trips, verification of every load, corruption in
 * the real file, schemas, several processes, a killed writer. */
#include <signal.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "testutil.h"

typedef struct fixture {
    char dir[512];
    char path[600];
    kiln_rng rng;
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(f->path, sizeof f->path, "%s/sub/dir/kernels.db", f->dir);
    f->rng = kiln_rng_new();
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    kiln_test_rmrf(f->dir);
    free(f);
    return 0;
}

static kiln_cache *open_db(const char *path, int read_only)
{
    kiln_cache_options o = {.path = path, .read_only = read_only};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    return c;
}

/* A record whose cubin is size random bytes (incompressible: the bytes land
 * verbatim in the file, where a test can find and flip them). */
static void make_record(kiln_rng *r, kiln_cache_record *rec, uint8_t *cubin, size_t size)
{
    memset(rec, 0, sizeof *rec);
    kiln_rng_fill(r, rec->fingerprint, 32);
    kiln_rng_fill(r, cubin, size);
    rec->template_id = "token_embedding";
    rec->constants = "HIDDEN=4096;VOCAB=128256";
    rec->arch = "sm_90";
    rec->nvrtc_major = 13;
    rec->entries = "kiln_token_embedding";
    rec->cubin = cubin;
    rec->cubin_size = size;
}

/* A fresh random record stored in f's database, which is then closed. */
static void store_one(fixture *f, kiln_cache_record *rec, uint8_t *cubin, size_t size)
{
    make_record(&f->rng, rec, cubin, size);
    kiln_cache *c = open_db(f->path, 0);
    KILN_CHECK(kiln_cache_put(c, rec));
    kiln_cache_close(c);
}

static void expect_hit(kiln_cache *c, const kiln_cache_record *rec)
{
    void *got = NULL;
    size_t size = 0;
    int found = 0;
    KILN_CHECK(kiln_cache_get(c, rec->fingerprint, &got, &size, &found));
    assert_int_equal(found, 1);
    assert_int_equal(size, rec->cubin_size);
    assert_memory_equal(got, rec->cubin, size);
    kiln_free(got);
}

static void expect_miss(kiln_cache *c, const uint8_t *fp)
{
    void *got = (void *)1;
    size_t size = 1;
    int found = 1;
    KILN_CHECK(kiln_cache_get(c, fp, &got, &size, &found));
    assert_int_equal(found, 0);
    assert_null(got);
    assert_int_equal(size, 0);
}

static void test_round_trip_and_reopen(void **state)
{
    fixture *f = *state;
    uint8_t cubin[5000];
    kiln_cache_record rec;
    make_record(&f->rng, &rec, cubin, sizeof cubin);
    kiln_cache *c = open_db(f->path, 0);
    expect_miss(c, rec.fingerprint);
    KILN_CHECK(kiln_cache_put(c, &rec));
    KILN_CHECK(kiln_cache_put(c, &rec)); /* an existing row stays as it is */
    expect_hit(c, &rec);
    kiln_cache_counters k;
    kiln_cache_get_counters(c, &k);
    assert_int_equal(k.inserts, 1);
    assert_int_equal(k.hits, 1);
    assert_int_equal(k.misses, 1);
    kiln_cache_close(c);

    c = open_db(f->path, 1);
    expect_hit(c, &rec);
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_int_equal(s.entries, 1);
    assert_int_equal(s.raw_bytes, sizeof cubin);
    assert_true(s.stored_bytes > 0);
    KILN_EXPECT(kiln_cache_put(c, &rec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "read-only", NULL);
    kiln_cache_close(c);
}

static int count_cb(void *user, const kiln_cache_entry_info *info)
{
    int *n = user;
    assert_string_equal(info->template_id, "token_embedding");
    assert_string_equal(info->arch, "sm_90");
    assert_int_equal(info->nvrtc_major, 13);
    (*n)++;
    return 0;
}

static void test_hits_are_recorded(void **state)
{
    fixture *f = *state;
    uint8_t cubin[300];
    kiln_cache_record rec;
    make_record(&f->rng, &rec, cubin, sizeof cubin);
    kiln_cache *c = open_db(f->path, 0);
    KILN_CHECK(kiln_cache_put(c, &rec));
    for (int i = 0; i < 3; i++)
        expect_hit(c, &rec);
    kiln_cache_close(c); /* flushes the hit counts */
    sqlite3 *db;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    sqlite3_stmt *q;
    assert_int_equal(sqlite3_prepare_v2(db, "SELECT hits FROM kernels", -1, &q, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    assert_int_equal(sqlite3_column_int(q, 0), 3);
    sqlite3_finalize(q);
    sqlite3_close(db);
    c = open_db(f->path, 1);
    int n = 0;
    KILN_CHECK(kiln_cache_foreach(c, count_cb, &n));
    assert_int_equal(n, 1);
    kiln_cache_close(c);
}

typedef struct events {
    int n;
    char detail[256];
} events;

static void on_event(void *user, const kiln_cache_event *ev)
{
    events *e = user;
    assert_int_equal(ev->kind, KILN_CACHE_EVENT_CORRUPT_DROPPED);
    e->n++;
    snprintf(e->detail, sizeof e->detail, "%s", ev->detail);
}

/* Finds needle in the file and xors one byte in the middle of it. */
static void flip_in_file(const char *path, const uint8_t *needle, size_t n)
{
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    long size = ftell(fp);
    uint8_t *buf = malloc((size_t)size);
    fseek(fp, 0, SEEK_SET);
    assert_int_equal(fread(buf, 1, (size_t)size, fp), (size_t)size);
    long at = -1;
    for (long i = 0; i + (long)n <= size; i++) {
        if (!memcmp(buf + i, needle, n)) {
            at = i;
            break;
        }
    }
    assert_true(at >= 0);
    fseek(fp, at + (long)n / 2, SEEK_SET);
    uint8_t b = buf[at + (long)n / 2] ^ 0x5a;
    assert_int_equal(fwrite(&b, 1, 1, fp), 1);
    fclose(fp);
    free(buf);
}

static void test_flipped_bytes_in_the_file_are_a_miss(void **state)
{
    fixture *f = *state;
    uint8_t good_cubin[4000], bad_cubin[4000];
    kiln_cache_record good, bad;
    make_record(&f->rng, &good, good_cubin, sizeof good_cubin);
    make_record(&f->rng, &bad, bad_cubin, sizeof bad_cubin);
    kiln_cache *c = open_db(f->path, 0);
    KILN_CHECK(kiln_cache_put(c, &good));
    KILN_CHECK(kiln_cache_put(c, &bad));
    kiln_cache_close(c); /* the last close checkpoints the WAL into the file */

    flip_in_file(f->path, bad_cubin + 1000, 64);

    events ev = {0};
    kiln_cache_options o = {.path = f->path, .on_event = on_event, .user = &ev};
    KILN_CHECK(kiln_cache_open(&o, &c));
    expect_miss(c, bad.fingerprint);
    assert_int_equal(ev.n, 1);
    assert_non_null(strstr(ev.detail, "checksum"));
    kiln_cache_counters k;
    kiln_cache_get_counters(c, &k);
    assert_int_equal(k.corrupt_dropped, 1);
    assert_non_null(strstr(kiln_cache_errmsg(c), "dropped"));
    int found = 1;
    KILN_CHECK(kiln_cache_contains(c, bad.fingerprint, &found));
    assert_int_equal(found, 0); /* dropped from the writable database */
    expect_hit(c, &good);       /* the neighbour is untouched */
    /* Recompiled and stored again, it is whole. */
    KILN_CHECK(kiln_cache_put(c, &bad));
    expect_hit(c, &bad);
    kiln_cache_close(c);
}

/* Rewrites one column of the only row with SQL: the lies a row can tell. */
static void corrupt_with_sql(const char *path, const char *sql)
{
    sqlite3 *db;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    char *err = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &err) != SQLITE_OK)
        fail_msg("%s: %s", sql, err);
    sqlite3_close(db);
}

static void test_lying_rows_are_a_miss(void **state)
{
    fixture *f = *state;
    static const struct {
        const char *sql, *detail;
    } cases[] = {
        {"UPDATE kernels SET cubin = substr(cubin, 1, length(cubin) / 2)", "zstd"},
        {"UPDATE kernels SET raw_size = raw_size + 1", "zstd frame"},
        {"UPDATE kernels SET raw_size = -5", "raw_size"},
        {"UPDATE kernels SET raw_size = 'abc'", "raw_size"},
        {"UPDATE kernels SET raw_size = 1e18", "raw_size"},
        {"UPDATE kernels SET checksum = zeroblob(32)", "checksum"},
        {"UPDATE kernels SET checksum = x'00'", "checksum"},
        {"UPDATE kernels SET cubin = x'28b52ffd00'", "zstd"},
        {"UPDATE kernels SET cubin = 'plain text'", "zstd"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t cubin[2048];
        kiln_cache_record rec;
        make_record(&f->rng, &rec, cubin, sizeof cubin);
        unlink(f->path);
        kiln_cache *c = open_db(f->path, 0);
        KILN_CHECK(kiln_cache_put(c, &rec));
        kiln_cache_close(c);
        corrupt_with_sql(f->path, cases[i].sql);
        events ev = {0};
        kiln_cache_options o = {.path = f->path, .on_event = on_event, .user = &ev};
        KILN_CHECK(kiln_cache_open(&o, &c));
        expect_miss(c, rec.fingerprint);
        if (ev.n != 1 || !strstr(ev.detail, cases[i].detail))
            fail_msg("case %s: %d events, detail \"%s\"", cases[i].sql, ev.n, ev.detail);
        int found = 1;
        KILN_CHECK(kiln_cache_contains(c, rec.fingerprint, &found));
        assert_int_equal(found, 0);
        kiln_cache_close(c);
    }
}

/* A row lying about its size must not break the totals (found by fuzz_cache_row). */
static void test_stats_survive_a_lying_row(void **state)
{
    fixture *f = *state;
    uint8_t cubin[1000];
    kiln_cache_record rec;
    store_one(f, &rec, cubin, sizeof cubin);
    kiln_cache *c;
    corrupt_with_sql(f->path, "INSERT INTO kernels VALUES (zeroblob(32), 't', '', 'sm_90', 12, 4, 'k', x'00',"
                              " 9223372036854775807, zeroblob(32), 0, 0, 0, '')");
    corrupt_with_sql(f->path, "INSERT INTO kernels VALUES (x'0101010101010101010101010101010101010101010101010101010101010101',"
                              " 't', '', 'sm_90', 12, 4, 'k', x'00', -7, zeroblob(32), 0, 0, 0, '')");
    c = open_db(f->path, 1);
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_int_equal(s.entries, 3);
    assert_int_equal(s.raw_bytes, sizeof cubin);
    kiln_cache_close(c);
}

static void test_read_only_layer_is_never_written(void **state)
{
    fixture *f = *state;
    uint8_t cubin[1000];
    kiln_cache_record rec;
    store_one(f, &rec, cubin, sizeof cubin);
    kiln_cache *c;
    corrupt_with_sql(f->path, "UPDATE kernels SET checksum = zeroblob(32)");
    c = open_db(f->path, 1);
    expect_miss(c, rec.fingerprint);
    int found = 0;
    KILN_CHECK(kiln_cache_contains(c, rec.fingerprint, &found));
    assert_int_equal(found, 1); /* reported, counted, but not deleted */
    kiln_cache_close(c);
    /* A missing file opened read-only is an error, and is not created. */
    char missing[700];
    snprintf(missing, sizeof missing, "%s/none.db", f->dir);
    kiln_cache_options o = {.path = missing, .read_only = 1};
    KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_IO, kiln_errmsg(), "none.db", NULL);
    assert_null(c);
    assert_int_not_equal(access(missing, F_OK), 0);
}

static void test_foreign_and_newer_databases_are_refused(void **state)
{
    fixture *f = *state;
    char path[700];
    kiln_cache *c = NULL;
    kiln_cache_options o = {.path = path};
    /* Another application's SQLite file. */
    snprintf(path, sizeof path, "%s/other.db", f->dir);
    corrupt_with_sql(path, "CREATE TABLE t(x); INSERT INTO t VALUES (1);");
    KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_SCHEMA, kiln_errmsg(), "not a kiln cache", NULL);
    assert_null(c);
    /* A kiln database of a newer schema. */
    unlink(f->path);
    c = open_db(f->path, 0);
    kiln_cache_close(c);
    corrupt_with_sql(f->path, "PRAGMA user_version = 99");
    o.path = f->path;
    KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_SCHEMA, kiln_errmsg(), "99", "newer");
    /* Not a database at all. */
    snprintf(path, sizeof path, "%s/garbage.db", f->dir);
    FILE *fp = fopen(path, "wb");
    for (int i = 0; i < 4096; i++)
        fputc((int)kiln_rng_next(&f->rng), fp);
    fclose(fp);
    o.path = path;
    kiln_status st = kiln_cache_open(&o, &c);
    assert_true(st == KILN_ERR_CACHE_SCHEMA);
    assert_null(c);
}

static uint64_t rows_in(const char *path)
{
    sqlite3 *db;
    sqlite3_stmt *q;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, "SELECT count(*) FROM kernels", -1, &q, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    uint64_t n = (uint64_t)sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    sqlite3_close(db);
    return n;
}

static void file_bytes(const char *path, uint8_t **out, size_t *n)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    *n = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    *out = malloc(*n);
    assert_int_equal(fread(*out, 1, *n, fp), *n);
    fclose(fp);
}

/* A shipped layer is searched first, never written, and its hits are not copied. */
static void test_shipped_layers(void **state)
{
    fixture *f = *state;
    char shipped[700], missing[700];
    snprintf(shipped, sizeof shipped, "%s/shipped.db", f->dir);
    snprintf(missing, sizeof missing, "%s/missing.db", f->dir);
    uint8_t c1[900], c2[900], c3[900];
    kiln_cache_record r1, r2, r3;
    make_record(&f->rng, &r1, c1, sizeof c1);
    make_record(&f->rng, &r2, c2, sizeof c2);
    make_record(&f->rng, &r3, c3, sizeof c3);
    kiln_cache *c = open_db(shipped, 0);
    KILN_CHECK(kiln_cache_put(c, &r1));
    KILN_CHECK(kiln_cache_put(c, &r3));
    kiln_cache_close(c);
    uint8_t *before, *after;
    size_t n_before, n_after;
    file_bytes(shipped, &before, &n_before);

    const char *layers[] = {missing, shipped};
    kiln_cache_options o = {.path = f->path, .readonly_paths = layers, .n_readonly_paths = 2, .arch = "sm_90",
                            .nvrtc_major = 13, .nvrtc_minor = 0};
    KILN_CHECK(kiln_cache_open(&o, &c));
    assert_int_equal(kiln_cache_layer_count(c), 2);
    kiln_cache_layer_info info;
    KILN_CHECK(kiln_cache_layer(c, 0, &info));
    assert_false(info.active);
    assert_non_null(strstr(info.reason, "missing.db"));
    KILN_CHECK(kiln_cache_layer(c, 1, &info));
    assert_true(info.active);
    assert_int_equal(info.entries, 2);
    assert_string_equal(info.reason, "");
    expect_hit(c, &r1);                  /* from the layer */
    KILN_CHECK(kiln_cache_put(c, &r2)); /* into the writable one */
    expect_hit(c, &r2);
    kiln_cache_close(c);
    assert_int_equal(rows_in(f->path), 1); /* r1's hit was not copied */
    file_bytes(shipped, &after, &n_after);
    assert_int_equal(n_before, n_after);
    assert_memory_equal(before, after, n_before); /* never written */
    free(after);

    /* A layer built for another architecture is skipped, with the reason. */
    o.arch = "sm_80";
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_CHECK(kiln_cache_layer(c, 1, &info));
    assert_false(info.active);
    assert_non_null(strstr(info.reason, "built for sm_90 with NVRTC 13.0"));
    assert_non_null(strstr(info.reason, "needs sm_80"));
    expect_miss(c, r1.fingerprint);
    kiln_cache_close(c);

    /* KILN_CACHE_READONLY, colon-separated, when the options name none. */
    char env[1500];
    snprintf(env, sizeof env, "%s:%s", shipped, missing);
    setenv("KILN_CACHE_READONLY", env, 1);
    kiln_cache_options e = {.path = f->path};
    KILN_CHECK(kiln_cache_open(&e, &c));
    assert_int_equal(kiln_cache_layer_count(c), 2);
    expect_hit(c, &r3);
    kiln_cache_close(c);
    e.ignore_env = 1;
    KILN_CHECK(kiln_cache_open(&e, &c));
    assert_int_equal(kiln_cache_layer_count(c), 0);
    kiln_cache_close(c);
    unsetenv("KILN_CACHE_READONLY");

    /* A corrupt row in a layer is a miss there, reported, not deleted; the
     * writable database's good copy serves. */
    corrupt_with_sql(shipped, "UPDATE kernels SET checksum = zeroblob(32)");
    free(before);
    file_bytes(shipped, &before, &n_before);
    events ev = {0};
    o.arch = NULL;
    o.on_event = on_event;
    o.user = &ev;
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_CHECK(kiln_cache_put(c, &r1));
    expect_hit(c, &r1);
    assert_true(ev.n >= 1);
    assert_non_null(strstr(kiln_cache_errmsg(c), "read-only layer"));
    kiln_cache_close(c);
    file_bytes(shipped, &after, &n_after);
    assert_memory_equal(before, after, n_before < n_after ? n_before : n_after);
    free(before);
    free(after);
}

/* A schema-1 database is migrated when opened writable, read as it is when not. */
static void test_schema_1_is_migrated(void **state)
{
    fixture *f = *state;
    uint8_t cubin[700];
    kiln_cache_record rec;
    store_one(f, &rec, cubin, sizeof cubin);
    kiln_cache *c;
    corrupt_with_sql(f->path, "ALTER TABLE kernels DROP COLUMN parts; PRAGMA user_version = 1;");
    c = open_db(f->path, 1); /* read-only: read as schema 1 */
    expect_hit(c, &rec);
    int n = 0;
    KILN_CHECK(kiln_cache_foreach(c, count_cb, &n));
    assert_int_equal(n, 1);
    kiln_cache_close(c);
    c = open_db(f->path, 0); /* writable: migrated */
    expect_hit(c, &rec);
    kiln_cache_close(c);
    sqlite3 *db;
    sqlite3_stmt *q;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, "SELECT parts FROM kernels", -1, &q, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    assert_string_equal((const char *)sqlite3_column_text(q, 0), "");
    sqlite3_finalize(q);
    assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA user_version", -1, &q, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    assert_int_equal(sqlite3_column_int(q, 0), KILN_CACHE_SCHEMA_VERSION);
    sqlite3_finalize(q);
    sqlite3_close(db);
}

static void test_default_path(void **state)
{
    (void)state;
    char buf[512];
    setenv("KILN_CACHE_DIR", "/x/kc", 1);
    KILN_CHECK(kiln_cache_default_path(buf, sizeof buf));
    assert_string_equal(buf, "/x/kc/kernels.db");
    unsetenv("KILN_CACHE_DIR");
    setenv("XDG_CACHE_HOME", "/x/xdg", 1);
    KILN_CHECK(kiln_cache_default_path(buf, sizeof buf));
    assert_string_equal(buf, "/x/xdg/kiln/kernels.db");
    unsetenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    char *saved = home ? strdup(home) : NULL;
    setenv("HOME", "/x/home", 1);
    KILN_CHECK(kiln_cache_default_path(buf, sizeof buf));
    assert_string_equal(buf, "/x/home/.cache/kiln/kernels.db");
    assert_int_equal(kiln_cache_default_path(buf, 8), KILN_ERR_INVALID_ARGUMENT);
    if (saved) {
        setenv("HOME", saved, 1);
        free(saved);
    }
}

/* Several processes writing one file at once: every row lands whole. */
static void test_processes_share_one_database(void **state)
{
    fixture *f = *state;
    enum { PROCS = 4, ROWS = 40 };
    kiln_cache_close(open_db(f->path, 0));
    uint64_t seed = kiln_rng_next(&f->rng);
    for (int p = 0; p < PROCS; p++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            kiln_rng r = {seed + (uint64_t)p * 7919};
            kiln_cache_options o = {.path = f->path};
            kiln_cache *c;
            if (kiln_cache_open(&o, &c))
                _exit(2);
            for (int i = 0; i < ROWS; i++) {
                uint8_t cubin[700];
                kiln_cache_record rec;
                make_record(&r, &rec, cubin, sizeof cubin);
                if (kiln_cache_put(c, &rec)) {
                    fprintf(stderr, "child %d: %s\n", p, kiln_errmsg());
                    _exit(3);
                }
            }
            kiln_cache_close(c);
            _exit(0);
        }
    }
    for (int p = 0; p < PROCS; p++) {
        int status;
        wait(&status);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0);
    }
    kiln_cache *c = open_db(f->path, 0);
    for (int p = 0; p < PROCS; p++) {
        kiln_rng r = {seed + (uint64_t)p * 7919};
        for (int i = 0; i < ROWS; i++) {
            uint8_t cubin[700];
            kiln_cache_record rec;
            make_record(&r, &rec, cubin, sizeof cubin);
            expect_hit(c, &rec);
        }
    }
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_int_equal(s.entries, PROCS * ROWS);
    kiln_cache_close(c);
}

/* A writer killed mid-stream leaves a database whose every row verifies. */
static void test_killed_writer_leaves_a_consistent_database(void **state)
{
    fixture *f = *state;
    kiln_cache_close(open_db(f->path, 0));
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        kiln_rng r = {12345};
        kiln_cache_options o = {.path = f->path};
        kiln_cache *c;
        if (kiln_cache_open(&o, &c))
            _exit(2);
        for (;;) {
            uint8_t cubin[3000];
            kiln_cache_record rec;
            make_record(&r, &rec, cubin, sizeof cubin);
            kiln_cache_put(c, &rec);
        }
    }
    usleep(300 * 1000);
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    assert_true(WIFSIGNALED(status));
    sqlite3 *db;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    sqlite3_stmt *q;
    assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &q, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    assert_string_equal((const char *)sqlite3_column_text(q, 0), "ok");
    sqlite3_finalize(q);
    sqlite3_close(db);
    kiln_cache *c = open_db(f->path, 0);
    kiln_rng r = {12345};
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_true(s.entries > 0);
    for (uint64_t i = 0; i < s.entries; i++) {
        uint8_t cubin[3000];
        kiln_cache_record rec;
        make_record(&r, &rec, cubin, sizeof cubin);
        expect_hit(c, &rec);
    }
    kiln_cache_counters k;
    kiln_cache_get_counters(c, &k);
    assert_int_equal(k.corrupt_dropped, 0);
    kiln_cache_close(c);
}

static void test_bad_arguments(void **state)
{
    fixture *f = *state;
    kiln_cache *c = open_db(f->path, 0);
    kiln_cache_record rec = {0};
    rec.template_id = "t";
    KILN_EXPECT(kiln_cache_put(c, &rec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "cubin", NULL);
    void *p;
    size_t n;
    int found;
    assert_int_equal(kiln_cache_get(c, NULL, &p, &n, &found), KILN_ERR_INVALID_ARGUMENT);
    assert_int_equal(kiln_cache_open(NULL, NULL), KILN_ERR_INVALID_ARGUMENT);
    kiln_cache_close(c);
    kiln_cache_close(NULL);
}

/* Fields past the caller's size take their defaults; a size that does not
 * even hold the size field is refused, naming the struct and the value. */
static void test_options_size_is_honoured(void **state)
{
    fixture *f = *state;
    kiln_cache_options o = {.size = offsetof(kiln_cache_options, read_only), .path = f->path, .read_only = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    uint8_t cubin[100];
    kiln_cache_record rec;
    make_record(&f->rng, &rec, cubin, sizeof cubin);
    KILN_CHECK(kiln_cache_put(c, &rec)); /* writable: read_only was past the size */
    kiln_cache_close(c);
    o.size = sizeof o;
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_EXPECT(kiln_cache_put(c, &rec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "read-only", NULL);
    kiln_cache_close(c);
    o.size = 2;
    c = (kiln_cache *)1;
    KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "kiln_cache_options.size is 2",
                NULL);
    assert_null(c);
}

/* existing_only: a missing or empty file is refused and never becomes a database. */
static void test_existing_only_creates_nothing(void **state)
{
    fixture *f = *state;
    char empty[700], missing[800], missing_dir[700];
    snprintf(empty, sizeof empty, "%s/empty.db", f->dir);
    snprintf(missing_dir, sizeof missing_dir, "%s/nothing-here", f->dir);
    snprintf(missing, sizeof missing, "%s/kernels.db", missing_dir);
    FILE *fp = fopen(empty, "wb");
    assert_non_null(fp);
    fclose(fp);
    struct stat sb;
    for (int ro = 0; ro < 2; ro++) {
        kiln_cache_options o = {.path = empty, .read_only = ro, .ignore_env = 1, .existing_only = 1};
        kiln_cache *c = (kiln_cache *)1;
        KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_SCHEMA, kiln_errmsg(), empty, "empty");
        assert_null(c);
        assert_int_equal(stat(empty, &sb), 0);
        assert_int_equal(sb.st_size, 0);
        o.path = missing;
        KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_IO, kiln_errmsg(), missing, "No such file");
        assert_null(c);
        assert_int_not_equal(stat(missing_dir, &sb), 0);
    }
    /* An existing kiln database opens as before. */
    kiln_cache_close(open_db(f->path, 0));
    kiln_cache_options o = {.path = f->path, .ignore_env = 1, .existing_only = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    kiln_cache_close(c);
}

/* Each read-only layer that cannot be used says why through kiln_cache_layer. */
static void test_skipped_layers_say_why(void **state)
{
    fixture *f = *state;
    char dir[700], text[700], missing[700];
    snprintf(dir, sizeof dir, "%s/a-folder", f->dir);
    snprintf(text, sizeof text, "%s/notes.txt", f->dir);
    snprintf(missing, sizeof missing, "%s/missing.db", f->dir);
    assert_int_equal(mkdir(dir, 0755), 0);
    FILE *fp = fopen(text, "w");
    assert_non_null(fp);
    fputs("these are not the kernels you are looking for\n", fp);
    fclose(fp);
    const char *layers[] = {dir, "/dev/null", text, missing};
    const char *why[] = {"a directory", "a character device", "not a kiln cache database", "No such file"};
    kiln_cache_options o = {.path = f->path, .readonly_paths = layers, .n_readonly_paths = 4};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    assert_int_equal(kiln_cache_layer_count(c), 4);
    for (size_t i = 0; i < 4; i++) {
        kiln_cache_layer_info info;
        KILN_CHECK(kiln_cache_layer(c, i, &info));
        assert_string_equal(info.path, layers[i]);
        assert_false(info.active);
        if (!strstr(info.reason, why[i]) || !strstr(info.reason, layers[i]))
            fail_msg("layer %s: the reason does not say \"%s\": %s", layers[i], why[i], info.reason);
    }
    kiln_cache_close(c);
}

int main(void)
{
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(test_round_trip_and_reopen),
        T(test_hits_are_recorded),
        T(test_flipped_bytes_in_the_file_are_a_miss),
        T(test_lying_rows_are_a_miss),
        T(test_stats_survive_a_lying_row),
        T(test_read_only_layer_is_never_written),
        T(test_foreign_and_newer_databases_are_refused),
        T(test_shipped_layers),
        T(test_schema_1_is_migrated),
        T(test_default_path),
        T(test_processes_share_one_database),
        T(test_killed_writer_leaves_a_consistent_database),
        T(test_bad_arguments),
        T(test_options_size_is_honoured),
        T(test_existing_only_creates_nothing),
        T(test_skipped_layers_say_why),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
