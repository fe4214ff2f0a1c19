/* Maintenance of the cubin database: verify, gc (least recently used first),
 * merge (verified rows only, kiln databases only, schema 1 sources too). */
#include <sqlite3.h>
#include <sys/stat.h>

#include "testutil.h"

typedef struct fixture {
    char dir[512];
    char path[600]; /* the cache under test */
    char src[600];  /* a second database, merged from */
    kiln_rng rng;
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(f->path, sizeof f->path, "%s/kernels.db", f->dir);
    snprintf(f->src, sizeof f->src, "%s/src.db", f->dir);
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
    kiln_cache_options o = {.size = sizeof o, .path = path, .read_only = read_only, .ignore_env = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    return c;
}

enum { MAX_ROWS = 8, CUBIN = 3000 };

/* Rows with random (incompressible) cubins, so each stores a little over CUBIN bytes. */
typedef struct rows {
    kiln_cache_record rec[MAX_ROWS];
    uint8_t cubin[MAX_ROWS][CUBIN];
    size_t n;
} rows;

static void put_rows(fixture *f, const char *path, rows *r, size_t n, const char *parts)
{
    kiln_cache *c = open_db(path, 0);
    for (size_t i = 0; i < n; i++) {
        kiln_cache_record *rec = &r->rec[r->n];
        memset(rec, 0, sizeof *rec);
        kiln_rng_fill(&f->rng, rec->fingerprint, KILN_FINGERPRINT_SIZE);
        kiln_rng_fill(&f->rng, r->cubin[r->n], CUBIN);
        rec->template_id = "rms_norm";
        rec->constants = "HIDDEN=4096";
        rec->arch = "sm_90";
        rec->nvrtc_major = 12;
        rec->nvrtc_minor = 8;
        rec->entries = "kiln_rms_norm";
        rec->parts = parts;
        rec->cubin = r->cubin[r->n];
        rec->cubin_size = CUBIN;
        KILN_CHECK(kiln_cache_put(c, rec));
        r->n++;
    }
    kiln_cache_close(c);
}

static void sql(const char *path, const char *text)
{
    sqlite3 *db;
    char *err = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    if (sqlite3_exec(db, text, NULL, NULL, &err) != SQLITE_OK)
        fail_msg("%s: %s", text, err);
    sqlite3_close(db);
}

/* Runs an UPDATE with one fingerprint bound as ?1 and an integer as ?2. */
static void sql_row(const char *path, const char *text, const uint8_t *fp, int64_t v)
{
    sqlite3 *db;
    sqlite3_stmt *q;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, text, -1, &q, NULL), SQLITE_OK);
    sqlite3_bind_blob(q, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    sqlite3_bind_int64(q, 2, v);
    assert_int_equal(sqlite3_step(q), SQLITE_DONE);
    assert_int_equal(sqlite3_changes(db), 1);
    sqlite3_finalize(q);
    sqlite3_close(db);
}

static int has_row(kiln_cache *c, const uint8_t *fp)
{
    int found = 0;
    KILN_CHECK(kiln_cache_contains(c, fp, &found));
    return found;
}

static int64_t stored_bytes(const char *path)
{
    kiln_cache *c = open_db(path, 1);
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    kiln_cache_close(c);
    return (int64_t)s.stored_bytes;
}

/* ---- verify ---- */

typedef struct bad_rows {
    int n;
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    char detail[256];
} bad_rows;

static void on_bad(void *user, const uint8_t fp[KILN_FINGERPRINT_SIZE], const char *detail)
{
    bad_rows *b = user;
    b->n++;
    memcpy(b->fp, fp, KILN_FINGERPRINT_SIZE);
    snprintf(b->detail, sizeof b->detail, "%s", detail);
}

static void test_verify_reports_bad_rows_and_removes_none(void **state)
{
    fixture *f = *state;
    rows r = {0};
    put_rows(f, f->path, &r, 3, NULL);
    kiln_cache *c = open_db(f->path, 1);
    kiln_cache_verify_report rep;
    bad_rows b = {0};
    KILN_CHECK(kiln_cache_verify(c, on_bad, &b, &rep));
    assert_int_equal(rep.rows, 3);
    assert_int_equal(rep.bad_rows, 0);
    assert_int_equal(rep.integrity_ok, 1);
    assert_int_equal(b.n, 0);
    kiln_cache_close(c);

    sql_row(f->path, "UPDATE kernels SET checksum = zeroblob(32) WHERE fingerprint = ?1 AND ?2", r.rec[1].fingerprint,
            1);
    c = open_db(f->path, 0);
    KILN_CHECK(kiln_cache_verify(c, on_bad, &b, &rep));
    assert_int_equal(rep.rows, 3);
    assert_int_equal(rep.bad_rows, 1);
    assert_int_equal(rep.integrity_ok, 1);
    assert_int_equal(b.n, 1);
    assert_memory_equal(b.fp, r.rec[1].fingerprint, KILN_FINGERPRINT_SIZE);
    assert_non_null(strstr(b.detail, "checksum"));
    assert_true(has_row(c, r.rec[1].fingerprint)); /* reported, not removed */
    /* No callback is fine too. */
    KILN_CHECK(kiln_cache_verify(c, NULL, NULL, &rep));
    assert_int_equal(rep.bad_rows, 1);
    KILN_EXPECT(kiln_cache_verify(c, NULL, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    kiln_cache_close(c);
    KILN_EXPECT(kiln_cache_verify(NULL, NULL, NULL, &rep), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
}

/* A row whose columns disagree with its fingerprint parts (an edited
 * template_id, constants, arch or NVRTC version) is bad. */
static void test_verify_checks_columns_against_parts(void **state)
{
    fixture *f = *state;
    static const struct {
        const char *sql, *detail;
    } cases[] = {
        {"UPDATE kernels SET template_id = 'rms_norm_fused' WHERE fingerprint = ?1 AND ?2", "template=rms_norm"},
        {"UPDATE kernels SET constants = 'HIDDEN=8192' WHERE fingerprint = ?1 AND ?2", "constants=HIDDEN=4096"},
        {"UPDATE kernels SET arch = 'sm_100' WHERE fingerprint = ?1 AND ?2", "arch=sm_90"},
        {"UPDATE kernels SET nvrtc_minor = ?2 WHERE fingerprint = ?1", "nvrtc=12.8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rows r = {0};
        unlink(f->path);
        put_rows(f, f->path, &r, 2,
                 "schema=kiln-fingerprint-1;template=rms_norm;source=0123456789abcdef;headers=0123456789abcdef;"
                 "options=0123456789abcdef;arch=sm_90;nvrtc=12.8;constants=HIDDEN=4096");
        kiln_cache *c = open_db(f->path, 1);
        kiln_cache_verify_report rep;
        bad_rows b = {0};
        KILN_CHECK(kiln_cache_verify(c, on_bad, &b, &rep));
        assert_int_equal(rep.bad_rows, 0);
        kiln_cache_close(c);
        sql_row(f->path, cases[i].sql, r.rec[0].fingerprint, 9);
        c = open_db(f->path, 1);
        KILN_CHECK(kiln_cache_verify(c, on_bad, &b, &rep));
        assert_int_equal(rep.rows, 2);
        assert_int_equal(rep.bad_rows, 1);
        assert_memory_equal(b.fp, r.rec[0].fingerprint, KILN_FINGERPRINT_SIZE);
        if (!strstr(b.detail, cases[i].detail) || !strstr(b.detail, "parts say"))
            fail_msg("%s: detail \"%s\" lacks \"%s\"", cases[i].sql, b.detail, cases[i].detail);
        kiln_cache_close(c);
    }
}

/* ---- gc ---- */

static void test_gc_refuses_read_only_and_no_limit(void **state)
{
    fixture *f = *state;
    rows r = {0};
    put_rows(f, f->path, &r, 2, NULL);
    uint64_t rows_out = 9, bytes_out = 9;
    kiln_cache_gc_options o = {.size = sizeof o, .max_bytes = 1};
    kiln_cache *c = open_db(f->path, 1);
    KILN_EXPECT(kiln_cache_gc(c, &o, &rows_out, &bytes_out), KILN_ERR_INVALID_ARGUMENT, kiln_cache_errmsg(c),
                "read-only", NULL);
    assert_int_equal(rows_out, 0);
    assert_int_equal(bytes_out, 0);
    kiln_cache_close(c);
    c = open_db(f->path, 0);
    kiln_cache_gc_options none = {.size = sizeof none};
    KILN_EXPECT(kiln_cache_gc(c, &none, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "no limit", NULL);
    kiln_cache_gc_options negative = {.size = sizeof negative, .older_than_seconds = -1};
    KILN_EXPECT(kiln_cache_gc(c, &negative, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "negative", NULL);
    KILN_EXPECT(kiln_cache_gc(c, NULL, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
    KILN_EXPECT(kiln_cache_gc(NULL, &o, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
    kiln_cache_gc_options short_size = {.size = 2, .max_bytes = 1};
    KILN_EXPECT(kiln_cache_gc(c, &short_size, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_cache_errmsg(c),
                "kiln_cache_gc_options.size is 2", NULL);
    /* A size that stops before older_than_seconds leaves it at 0: no limit. */
    kiln_cache_gc_options old_size = {.size = offsetof(kiln_cache_gc_options, older_than_seconds),
                                      .older_than_seconds = 1};
    KILN_EXPECT(kiln_cache_gc(c, &old_size, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "no limit", NULL);
    assert_true(has_row(c, r.rec[0].fingerprint) && has_row(c, r.rec[1].fingerprint));
    kiln_cache_close(c);
}

static void test_gc_max_bytes_drops_least_recently_used_first(void **state)
{
    fixture *f = *state;
    rows r = {0};
    put_rows(f, f->path, &r, 6, NULL);
    /* Last use: row 3 oldest, then 1, 5, 0, 4, 2; rows 5 and 0 share a last
     * use and are told apart by creation (0 created earlier). */
    static const int64_t last_used[6] = {300, 200, 500, 100, 400, 300};
    static const int64_t created[6] = {10, 10, 10, 10, 10, 20};
    for (int i = 0; i < 6; i++) {
        sql_row(f->path, "UPDATE kernels SET last_used = ?2 WHERE fingerprint = ?1", r.rec[i].fingerprint,
                last_used[i]);
        sql_row(f->path, "UPDATE kernels SET created = ?2 WHERE fingerprint = ?1", r.rec[i].fingerprint, created[i]);
    }
    int64_t total = stored_bytes(f->path);
    /* Room for a little over three rows: the three least recently used go. */
    int64_t row = total / 6;
    kiln_cache_gc_options o = {.size = sizeof o, .max_bytes = (uint64_t)(total - 3 * row + row / 2)};
    kiln_cache *c = open_db(f->path, 0);
    uint64_t removed = 0, bytes = 0;
    KILN_CHECK(kiln_cache_gc(c, &o, &removed, &bytes));
    assert_int_equal(removed, 3);
    assert_true(bytes >= 3 * CUBIN);
    assert_false(has_row(c, r.rec[3].fingerprint));
    assert_false(has_row(c, r.rec[1].fingerprint));
    assert_false(has_row(c, r.rec[0].fingerprint)); /* same last use as 5, created first */
    assert_true(has_row(c, r.rec[5].fingerprint));
    assert_true(has_row(c, r.rec[4].fingerprint));
    assert_true(has_row(c, r.rec[2].fingerprint));
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_true(s.stored_bytes <= o.max_bytes);
    assert_int_equal(s.stored_bytes + bytes, (uint64_t)total);
    /* Fitting already: nothing more goes. */
    KILN_CHECK(kiln_cache_gc(c, &o, &removed, &bytes));
    assert_int_equal(removed, 0);
    assert_int_equal(bytes, 0);
    /* A size of 0 (an old caller) means the whole struct is this one's. */
    kiln_cache_gc_options tiny = {.size = 0, .max_bytes = 1};
    KILN_CHECK(kiln_cache_gc(c, &tiny, &removed, NULL));
    assert_int_equal(removed, 3);
    kiln_cache_close(c);
}

/* One integer a pragma or query gives, read through a connection of its own. */
static int64_t query_int(const char *path, const char *text)
{
    sqlite3 *db;
    sqlite3_stmt *q;
    int64_t v = -1;
    assert_int_equal(sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, text, -1, &q, NULL), SQLITE_OK);
    if (sqlite3_step(q) == SQLITE_ROW)
        v = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    sqlite3_close(db);
    return v;
}

static int64_t size_of(const char *path)
{
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    return (int64_t)sb.st_size;
}

/* gc gives the freed pages back: a new database (auto_vacuum incremental)
 * truncates them off, one made without auto_vacuum is vacuumed (the disk
 * has room) and has auto_vacuum from then on. */
static void test_gc_shrinks_the_file(void **state)
{
    fixture *f = *state;
    enum { N = 40, SIZE = 20000, KEEP = 4 };
    static uint8_t cubins[N][SIZE];
    for (int legacy = 0; legacy < 2; legacy++) {
        const char *path = legacy ? f->src : f->path;
        kiln_cache *c = open_db(path, 0);
        kiln_cache_record rec = {.template_id = "rms_norm", .constants = "HIDDEN=4096", .arch = "sm_90",
                                 .nvrtc_major = 12, .nvrtc_minor = 8, .entries = "kiln_rms_norm",
                                 .cubin_size = SIZE};
        for (int i = 0; i < N; i++) {
            kiln_rng_fill(&f->rng, rec.fingerprint, KILN_FINGERPRINT_SIZE);
            kiln_rng_fill(&f->rng, cubins[i], SIZE);
            rec.cubin = cubins[i];
            KILN_CHECK(kiln_cache_put(c, &rec));
        }
        kiln_cache_close(c);
        if (legacy)
            sql(path, "PRAGMA journal_mode=DELETE;PRAGMA auto_vacuum=NONE;VACUUM");
        assert_int_equal(query_int(path, "PRAGMA auto_vacuum"), legacy ? 0 : 2);
        int64_t pages = query_int(path, "PRAGMA page_count"), bytes_before = size_of(path);
        c = open_db(path, 0);
        kiln_cache_gc_options o = {.size = sizeof o, .max_bytes = (uint64_t)KEEP * SIZE + SIZE / 2};
        uint64_t removed = 0, bytes = 0;
        KILN_CHECK(kiln_cache_gc(c, &o, &removed, &bytes));
        assert_int_equal(removed, N - KEEP);
        kiln_cache_close(c);
        int64_t pages_after = query_int(path, "PRAGMA page_count"), bytes_after = size_of(path);
        printf("gc of %d of %d rows (%s): %lld pages (%lld bytes) -> %lld pages (%lld bytes), %lld free\n",
               N - KEEP, N, legacy ? "made without auto_vacuum" : "auto_vacuum incremental", (long long)pages,
               (long long)bytes_before, (long long)pages_after, (long long)bytes_after,
               (long long)query_int(path, "PRAGMA freelist_count"));
        assert_true(pages_after * 4 < pages);
        assert_true(bytes_after * 4 < bytes_before);
        assert_true(query_int(path, "PRAGMA freelist_count") < 8);
        assert_int_equal(query_int(path, "PRAGMA auto_vacuum"), 2);
        assert_int_equal(query_int(path, "SELECT count(*) FROM kernels"), KEEP);
        c = open_db(path, 1);
        kiln_cache_verify_report vr;
        KILN_CHECK(kiln_cache_verify(c, NULL, NULL, &vr));
        assert_true(vr.integrity_ok);
        assert_int_equal(vr.rows, KEEP);
        assert_int_equal(vr.bad_rows, 0);
        kiln_cache_close(c);
    }
}

static void test_gc_older_than_counts_uses_still_in_memory(void **state)
{
    fixture *f = *state;
    rows r = {0};
    put_rows(f, f->path, &r, 4, NULL);
    int64_t now = (int64_t)time(NULL);
    for (int i = 0; i < 4; i++)
        sql_row(f->path, "UPDATE kernels SET last_used = ?2 WHERE fingerprint = ?1", r.rec[i].fingerprint,
                i == 3 ? now : now - 10 * 86400);
    kiln_cache *c = open_db(f->path, 0);
    /* A hit now, held in memory until a flush: gc must see it. */
    void *cubin = NULL;
    size_t size = 0;
    int found = 0;
    KILN_CHECK(kiln_cache_get(c, r.rec[0].fingerprint, &cubin, &size, &found));
    assert_int_equal(found, 1);
    kiln_free(cubin);
    kiln_cache_gc_options o = {.size = sizeof o, .older_than_seconds = 7 * 86400};
    uint64_t removed = 0, bytes = 0;
    KILN_CHECK(kiln_cache_gc(c, &o, &removed, &bytes));
    assert_int_equal(removed, 2);
    assert_true(bytes >= 2 * CUBIN);
    assert_true(has_row(c, r.rec[0].fingerprint));
    assert_false(has_row(c, r.rec[1].fingerprint));
    assert_false(has_row(c, r.rec[2].fingerprint));
    assert_true(has_row(c, r.rec[3].fingerprint));
    kiln_cache_close(c);
}

/* ---- merge ---- */

typedef struct seen {
    int n;
    kiln_cache_entry_info info[MAX_ROWS];
    char parts[MAX_ROWS][64];
} seen;

static int collect(void *user, const kiln_cache_entry_info *info)
{
    seen *s = user;
    if (s->n < MAX_ROWS) {
        s->info[s->n] = *info;
        snprintf(s->parts[s->n], sizeof s->parts[s->n], "%s", info->parts ? info->parts : "(null)");
        s->info[s->n].parts = s->parts[s->n];
        s->info[s->n].template_id = s->info[s->n].constants = s->info[s->n].arch = s->info[s->n].entries = NULL;
    }
    s->n++;
    return 0;
}

static const kiln_cache_entry_info *find(const seen *s, const uint8_t *fp)
{
    for (int i = 0; i < s->n && i < MAX_ROWS; i++)
        if (!memcmp(s->info[i].fingerprint, fp, KILN_FINGERPRINT_SIZE))
            return &s->info[i];
    return NULL;
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

static void test_merge_copies_new_rows_with_their_columns(void **state)
{
    fixture *f = *state;
    rows src = {0}, dst = {0};
    put_rows(f, f->src, &src, 3, "schema=2;arch=sm_90");
    put_rows(f, f->path, &dst, 1, NULL);
    sql_row(f->src, "UPDATE kernels SET hits = ?2 WHERE fingerprint = ?1", src.rec[0].fingerprint, 41);
    sql_row(f->src, "UPDATE kernels SET created = ?2, last_used = ?2 + 5 WHERE fingerprint = ?1",
            src.rec[0].fingerprint, 1000000);
    /* One source row is in the destination already: it stays as it is there. */
    {
        kiln_cache *c = open_db(f->path, 0);
        KILN_CHECK(kiln_cache_put(c, &src.rec[2]));
        kiln_cache_close(c);
    }
    kiln_cache *c = open_db(f->path, 0);
    uint64_t copied = 9, skipped = 9;
    KILN_CHECK(kiln_cache_merge(c, f->src, &copied, &skipped));
    assert_int_equal(copied, 2);
    assert_int_equal(skipped, 0);
    for (int i = 0; i < 3; i++)
        expect_hit(c, &src.rec[i]);
    expect_hit(c, &dst.rec[0]);
    kiln_cache_flush(c);
    kiln_cache_close(c);

    c = open_db(f->path, 1);
    seen s = {0};
    KILN_CHECK(kiln_cache_foreach(c, collect, &s));
    assert_int_equal(s.n, 4);
    const kiln_cache_entry_info *e = find(&s, src.rec[0].fingerprint);
    assert_non_null(e);
    assert_int_equal(e->hits, 41 + 1); /* its own hits, and the one above */
    assert_int_equal(e->created, 1000000);
    assert_string_equal(e->parts, "schema=2;arch=sm_90");
    assert_int_equal(e->raw_size, CUBIN);
    kiln_cache_close(c);

    /* Merging again copies nothing; the source was only read. */
    c = open_db(f->path, 0);
    KILN_CHECK(kiln_cache_merge(c, f->src, &copied, &skipped));
    assert_int_equal(copied, 0);
    assert_int_equal(skipped, 0);
    kiln_cache_close(c);
    c = open_db(f->src, 1);
    seen t = {0};
    KILN_CHECK(kiln_cache_foreach(c, collect, &t));
    assert_int_equal(t.n, 3);
    kiln_cache_close(c);
}

static void test_merge_skips_a_corrupt_row(void **state)
{
    fixture *f = *state;
    rows src = {0};
    put_rows(f, f->src, &src, 3, NULL);
    sql_row(f->src, "UPDATE kernels SET checksum = zeroblob(32) WHERE fingerprint = ?1 AND ?2", src.rec[0].fingerprint,
            1);
    sql_row(f->src, "UPDATE kernels SET cubin = substr(cubin, 1, length(cubin) / 2) WHERE fingerprint = ?1 AND ?2",
            src.rec[1].fingerprint, 1);
    kiln_cache *c = open_db(f->path, 0);
    uint64_t copied = 0, skipped = 0;
    KILN_CHECK(kiln_cache_merge(c, f->src, &copied, &skipped));
    assert_int_equal(copied, 1);
    assert_int_equal(skipped, 2);
    assert_false(has_row(c, src.rec[0].fingerprint));
    assert_false(has_row(c, src.rec[1].fingerprint));
    expect_hit(c, &src.rec[2]);
    kiln_cache_verify_report rep;
    KILN_CHECK(kiln_cache_verify(c, NULL, NULL, &rep));
    assert_int_equal(rep.bad_rows, 0);
    kiln_cache_close(c);
}

static void test_merge_refuses_what_is_not_a_kiln_database(void **state)
{
    fixture *f = *state;
    char path[700];
    uint64_t copied = 9, skipped = 9;
    kiln_cache *c = open_db(f->path, 0);
    /* Another application's SQLite file. */
    snprintf(path, sizeof path, "%s/other.db", f->dir);
    sql(path, "CREATE TABLE kernels (x); INSERT INTO kernels VALUES (1);");
    KILN_EXPECT(kiln_cache_merge(c, path, &copied, &skipped), KILN_ERR_CACHE_SCHEMA, kiln_cache_errmsg(c),
                "not a kiln", "other.db");
    assert_int_equal(copied, 0);
    assert_int_equal(skipped, 0);
    /* Not SQLite at all. */
    snprintf(path, sizeof path, "%s/garbage.db", f->dir);
    FILE *fp = fopen(path, "wb");
    for (int i = 0; i < 4096; i++)
        fputc((int)kiln_rng_next(&f->rng), fp);
    fclose(fp);
    KILN_EXPECT(kiln_cache_merge(c, path, NULL, NULL), KILN_ERR_CACHE_SCHEMA, kiln_errmsg(), "not a kiln", NULL);
    /* A kiln database of a newer schema. */
    rows src = {0};
    put_rows(f, f->src, &src, 1, NULL);
    sql(f->src, "PRAGMA user_version = 99");
    KILN_EXPECT(kiln_cache_merge(c, f->src, NULL, NULL), KILN_ERR_CACHE_SCHEMA, kiln_errmsg(), "99", "newer");
    /* Missing: an I/O error, and nothing is created. */
    snprintf(path, sizeof path, "%s/none.db", f->dir);
    KILN_EXPECT(kiln_cache_merge(c, path, NULL, NULL), KILN_ERR_CACHE_IO, kiln_errmsg(), "none.db", NULL);
    assert_int_not_equal(access(path, F_OK), 0);
    KILN_EXPECT(kiln_cache_merge(c, NULL, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_int_equal(s.entries, 0);
    kiln_cache_close(c);
    /* Into a read-only cache: refused before the source is opened. */
    sql(f->src, "PRAGMA user_version = 2");
    c = open_db(f->path, 1);
    KILN_EXPECT(kiln_cache_merge(c, f->src, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "read-only", NULL);
    kiln_cache_close(c);
}

static void test_merge_reads_a_schema_1_database(void **state)
{
    fixture *f = *state;
    rows src = {0};
    char v2[700], text[2048];
    snprintf(v2, sizeof v2, "%s/v2.db", f->dir);
    put_rows(f, v2, &src, 2, "schema=2");
    /* Schema 1 is schema 2 without `parts`. */
    snprintf(text, sizeof text,
             "ATTACH '%s' AS v2;"
             "CREATE TABLE kernels (fingerprint BLOB PRIMARY KEY NOT NULL CHECK (length(fingerprint) = 32),"
             " template_id TEXT NOT NULL, constants TEXT NOT NULL, arch TEXT NOT NULL,"
             " nvrtc_major INTEGER NOT NULL, nvrtc_minor INTEGER NOT NULL, entries TEXT NOT NULL,"
             " cubin BLOB NOT NULL, raw_size INTEGER NOT NULL, checksum BLOB NOT NULL, created INTEGER NOT NULL,"
             " last_used INTEGER NOT NULL, hits INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;"
             "INSERT INTO kernels SELECT fingerprint, template_id, constants, arch, nvrtc_major, nvrtc_minor,"
             " entries, cubin, raw_size, checksum, created, last_used, hits FROM v2.kernels;"
             "PRAGMA application_id = 1263094862; PRAGMA user_version = 1;",
             v2);
    sql(f->src, text);
    kiln_cache *c = open_db(f->path, 0);
    uint64_t copied = 0, skipped = 0;
    KILN_CHECK(kiln_cache_merge(c, f->src, &copied, &skipped));
    assert_int_equal(copied, 2);
    assert_int_equal(skipped, 0);
    expect_hit(c, &src.rec[0]);
    expect_hit(c, &src.rec[1]);
    seen s = {0};
    KILN_CHECK(kiln_cache_foreach(c, collect, &s));
    assert_int_equal(s.n, 2);
    assert_string_equal(s.info[0].parts, "");
    kiln_cache_close(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_verify_reports_bad_rows_and_removes_none, setup, teardown),
        cmocka_unit_test_setup_teardown(test_verify_checks_columns_against_parts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gc_refuses_read_only_and_no_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gc_max_bytes_drops_least_recently_used_first, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gc_older_than_counts_uses_still_in_memory, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gc_shrinks_the_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_merge_copies_new_rows_with_their_columns, setup, teardown),
        cmocka_unit_test_setup_teardown(test_merge_skips_a_corrupt_row, setup, teardown),
        cmocka_unit_test_setup_teardown(test_merge_refuses_what_is_not_a_kiln_database, setup, teardown),
        cmocka_unit_test_setup_teardown(test_merge_reads_a_schema_1_database, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
