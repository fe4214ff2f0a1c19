/* Tuning rows and coverage records (schema 3) in a real SQLite file: store,
 * load, replace, verify, merge, gc, migration of schema 2, and damaged rows
 * (a miss, dropped from the writable database, never a crash). */
#include <sqlite3.h>

#include "testutil.h"

typedef struct fixture {
    char dir[512];
    char path[600], src[600], out[600];
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(f->path, sizeof f->path, "%s/kernels.db", f->dir);
    snprintf(f->src, sizeof f->src, "%s/src.db", f->dir);
    snprintf(f->out, sizeof f->out, "%s/out.db", f->dir);
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

static kiln_cache *open_db(const char *path, int read_only, const char *layer)
{
    const char *layers[] = {layer};
    kiln_cache_options o = {.size = sizeof o,
                            .path = path,
                            .read_only = read_only,
                            .ignore_env = 1,
                            .readonly_paths = layer ? layers : NULL,
                            .n_readonly_paths = layer ? 1 : 0};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    return c;
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

static int64_t sql_int(const char *path, const char *text)
{
    sqlite3 *db;
    sqlite3_stmt *q;
    int64_t v = -1;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, text, -1, &q, NULL), SQLITE_OK);
    if (sqlite3_step(q) == SQLITE_ROW)
        v = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    sqlite3_close(db);
    return v;
}

#define KIND "cublaslt_matmul"
static const char key_a[] = "gpu=NVIDIA H200;sms=132;driver=13000;cublaslt=130000;m=4096;n=1;k=4096;elt=f16";
static const char key_b[] = "gpu=NVIDIA H200;sms=132;driver=13000;cublaslt=130000;m=14336;n=8;k=4096;elt=bf16";

static void expect_payload(kiln_cache *c, const char *key, const char *want)
{
    void *p = NULL;
    size_t n = 0;
    int found = -1;
    KILN_CHECK(kiln_cache_tuning_get(c, KIND, key, &p, &n, &found));
    if (!want) {
        assert_int_equal(found, 0);
        assert_null(p);
        return;
    }
    assert_int_equal(found, 1);
    assert_int_equal(n, strlen(want));
    assert_memory_equal(p, want, n);
    kiln_free(p);
}

static void test_store_load_replace(void **state)
{
    fixture *f = *state;
    kiln_cache *c = open_db(f->path, 0, NULL);
    expect_payload(c, key_a, NULL);
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "choice-1", 8));
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_b, "choice-b", 8));
    expect_payload(c, key_a, "choice-1");
    /* A new timing replaces the old. */
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "choice-2", 8));
    kiln_cache_close(c);
    /* Another open (a later process) loads it. */
    c = open_db(f->path, 1, NULL);
    expect_payload(c, key_a, "choice-2");
    expect_payload(c, key_b, "choice-b");
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_int_equal(s.tuning_rows, 2);
    /* Bad arguments are refused with a message, never a crash. */
    assert_int_equal(kiln_cache_tuning_put(c, KIND, key_a, "x", 1), KILN_ERR_INVALID_ARGUMENT);
    kiln_cache_close(c);
    c = open_db(f->path, 0, NULL);
    assert_int_equal(kiln_cache_tuning_put(c, "", key_a, "x", 1), KILN_ERR_INVALID_ARGUMENT);
    assert_int_equal(kiln_cache_tuning_put(c, KIND, key_a, NULL, 0), KILN_ERR_INVALID_ARGUMENT);
    static char big[KILN_TUNING_PAYLOAD_MAX + 1];
    assert_int_equal(kiln_cache_tuning_put(c, KIND, key_a, big, sizeof big), KILN_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kiln_cache_errmsg(c), "payload of 4097 bytes"));
    KILN_CHECK(kiln_cache_tuning_drop(c, KIND, key_b));
    expect_payload(c, key_b, NULL);
    kiln_cache_close(c);
}

/* A read-only layer's tuning rows load; the writable database's override them. */
static void test_layer(void **state)
{
    fixture *f = *state;
    kiln_cache *c = open_db(f->src, 0, NULL);
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "shipped", 7));
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_b, "shipped-b", 9));
    /* A layer needs a kernel row to be active for an arch; none asked here. */
    KILN_CHECK(kiln_cache_seal(c));
    kiln_cache_close(c);
    c = open_db(f->path, 0, f->src);
    expect_payload(c, key_a, "shipped");
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "local", 5));
    expect_payload(c, key_a, "local");
    expect_payload(c, key_b, "shipped-b");
    kiln_cache_close(c);
}

typedef struct bad_list {
    int n;
    char detail[512];
} bad_list;

static void on_bad(void *user, const uint8_t fp[KILN_FINGERPRINT_SIZE], const char *detail)
{
    (void)fp;
    bad_list *b = user;
    b->n++;
    snprintf(b->detail, sizeof b->detail, "%s", detail);
}

/* Each way a row can lie is a miss that drops it, and verify reports it. */
static void test_corrupt_rows(void **state)
{
    fixture *f = *state;
    static const char *const damage[] = {
        "UPDATE tuning SET payload = x'00' || payload",                 /* payload changed */
        "UPDATE tuning SET checksum = zeroblob(32)",                    /* checksum changed */
        "UPDATE tuning SET checksum = x'00'",                           /* checksum short */
        "UPDATE tuning SET key = key || 'x'",                           /* key edited: the id no longer matches */
        "UPDATE tuning SET payload = 'text'",                           /* a payload that is not a blob */
        "UPDATE tuning SET kind = 7",                                   /* kind not text */
        "UPDATE tuning SET payload = zeroblob(0)",                      /* empty payload */
    };
    for (size_t i = 0; i < sizeof damage / sizeof damage[0]; i++) {
        unlink(f->path);
        kiln_cache *c = open_db(f->path, 0, NULL);
        KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "choice", 6));
        kiln_cache_close(c);
        sql(f->path, damage[i]);
        c = open_db(f->path, 0, NULL);
        bad_list bad = {0};
        kiln_cache_verify_report r;
        KILN_CHECK(kiln_cache_verify(c, on_bad, &bad, &r));
        assert_int_equal(r.tuning_rows, 1);
        assert_int_equal(r.bad_tuning_rows, 1);
        assert_int_equal(bad.n, 1);
        assert_non_null(strstr(bad.detail, "tuning row"));
        expect_payload(c, key_a, NULL);
        kiln_cache_counters cnt;
        kiln_cache_get_counters(c, &cnt);
        /* An edited key makes the row another key's: key_a simply misses. */
        if (!strstr(damage[i], "key = key"))
            assert_int_equal(cnt.corrupt_dropped, 1);
        kiln_cache_close(c);
        if (!strstr(damage[i], "key = key"))
            assert_int_equal(sql_int(f->path, "SELECT count(*) FROM tuning"), 0);
        /* Re-timed, it is stored again. */
        c = open_db(f->path, 0, NULL);
        KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "again", 5));
        expect_payload(c, key_a, "again");
        kiln_cache_close(c);
    }
}

static const char needs_text[] =
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\trms_norm\tHIDDEN=4096;\ttemplate=aa;arch=sm_90\n"
    "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210\tswiglu\tI=14336;\ttemplate=bb;arch=sm_90\n";

static kiln_coverage_record coverage(const char *envelope)
{
    kiln_coverage_record r = {.model_name = "llama-3-8b",
                              .config_digest = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
                              .envelope = envelope,
                              .arch = "sm_90",
                              .nvrtc_major = 13,
                              .nvrtc_minor = 0,
                              .needs = needs_text};
    return r;
}

typedef struct cov_seen {
    int n, valid;
    size_t needs;
    char envelope[128];
} cov_seen;

static int on_coverage(void *user, const kiln_coverage_info *info)
{
    cov_seen *s = user;
    s->n++;
    s->valid += info->valid;
    s->needs += info->n_needs;
    snprintf(s->envelope, sizeof s->envelope, "%s", info->record.envelope);
    return 0;
}

static void test_coverage(void **state)
{
    fixture *f = *state;
    kiln_cache *c = open_db(f->path, 0, NULL);
    kiln_coverage_record r = coverage("dtype=f16;batch=1,2,4;context=8192;chunk=512");
    KILN_CHECK(kiln_cache_coverage_put(c, &r));
    KILN_CHECK(kiln_cache_coverage_put(c, &r)); /* the same record again replaces it */
    kiln_coverage_record bad = r;
    bad.config_digest = "not-hex";
    assert_int_equal(kiln_cache_coverage_put(c, &bad), KILN_ERR_INVALID_ARGUMENT);
    bad = r;
    bad.needs = "abc\trms_norm\tX\tY\n";
    assert_int_equal(kiln_cache_coverage_put(c, &bad), KILN_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kiln_cache_errmsg(c), "needs line 1"));
    cov_seen s = {0};
    KILN_CHECK(kiln_cache_coverage_foreach(c, on_coverage, &s));
    assert_int_equal(s.n, 1);
    assert_int_equal(s.valid, 1);
    assert_int_equal(s.needs, 2);
    kiln_cache_close(c);
    /* An edited envelope fails its checksum: reported by verify and listed as invalid. */
    sql(f->path, "UPDATE coverage SET envelope = 'dtype=f16;batch=1'");
    c = open_db(f->path, 1, NULL);
    bad_list b = {0};
    kiln_cache_verify_report rep;
    KILN_CHECK(kiln_cache_verify(c, on_bad, &b, &rep));
    assert_int_equal(rep.coverage_rows, 1);
    assert_int_equal(rep.bad_coverage_rows, 1);
    assert_non_null(strstr(b.detail, "coverage record"));
    memset(&s, 0, sizeof s);
    KILN_CHECK(kiln_cache_coverage_foreach(c, on_coverage, &s));
    assert_int_equal(s.n, 1);
    assert_int_equal(s.valid, 0);
    kiln_cache_close(c);
}

/* merge copies verified tuning and coverage rows and skips bad ones. */
static void test_merge(void **state)
{
    fixture *f = *state;
    kiln_cache *c = open_db(f->src, 0, NULL);
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "a", 1));
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_b, "b", 1));
    kiln_coverage_record r = coverage("dtype=f16;batch=1");
    KILN_CHECK(kiln_cache_coverage_put(c, &r));
    kiln_cache_close(c);
    sql(f->src, "UPDATE tuning SET payload = x'ff' WHERE key LIKE '%m=14336%'");
    c = open_db(f->out, 0, NULL);
    uint64_t copied = 0, skipped = 0;
    KILN_CHECK(kiln_cache_merge(c, f->src, &copied, &skipped));
    assert_int_equal(copied, 2); /* key_a's tuning row and the coverage record */
    assert_int_equal(skipped, 1);
    expect_payload(c, key_a, "a");
    expect_payload(c, key_b, NULL);
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_int_equal(s.tuning_rows, 1);
    assert_int_equal(s.coverage_rows, 1);
    kiln_cache_verify_report rep;
    KILN_CHECK(kiln_cache_verify(c, NULL, NULL, &rep));
    assert_int_equal(rep.bad_tuning_rows + rep.bad_coverage_rows + rep.bad_rows, 0);
    kiln_cache_close(c);
}

/* gc ranks tuning rows with kernels by last use. */
static void test_gc(void **state)
{
    fixture *f = *state;
    kiln_cache *c = open_db(f->path, 0, NULL);
    uint8_t cubin[100] = {1};
    kiln_cache_record rec = {.template_id = "rms_norm", .constants = "H=1", .arch = "sm_90", .nvrtc_major = 13,
                             .entries = "k", .cubin = cubin, .cubin_size = sizeof cubin};
    memset(rec.fingerprint, 7, sizeof rec.fingerprint);
    KILN_CHECK(kiln_cache_put(c, &rec));
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "old", 3));
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_b, "new", 3));
    kiln_cache_close(c);
    sql(f->path, "UPDATE tuning SET last_used = 1000, created = 1000 WHERE key LIKE '%m=4096;%'");
    c = open_db(f->path, 0, NULL);
    kiln_cache_gc_options o = {.size = sizeof o, .older_than_seconds = 86400};
    uint64_t rows = 0, bytes = 0;
    KILN_CHECK(kiln_cache_gc(c, &o, &rows, &bytes));
    assert_int_equal(rows, 1);
    expect_payload(c, key_a, NULL);
    expect_payload(c, key_b, "new");
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_int_equal(s.entries, 1);
    kiln_cache_close(c);
}

/* A schema 2 database gains the tables when opened for writing; opened
 * read-only it is read as it is, with no tuning rows. */
static void test_migrate_schema2(void **state)
{
    fixture *f = *state;
    kiln_cache *c = open_db(f->path, 0, NULL);
    kiln_cache_close(c);
    sql(f->path, "DROP TABLE tuning; DROP TABLE coverage; PRAGMA user_version = 2;");
    c = open_db(f->path, 1, NULL);
    expect_payload(c, key_a, NULL);
    kiln_cache_stats s;
    KILN_CHECK(kiln_cache_get_stats(c, &s));
    assert_int_equal(s.tuning_rows, 0);
    kiln_cache_close(c);
    assert_int_equal(sql_int(f->path, "PRAGMA user_version"), 2);
    c = open_db(f->path, 0, NULL);
    KILN_CHECK(kiln_cache_tuning_put(c, KIND, key_a, "m", 1));
    kiln_cache_close(c);
    assert_int_equal(sql_int(f->path, "PRAGMA user_version"), 3);
    assert_int_equal(sql_int(f->path, "SELECT count(*) FROM tuning"), 1);
    /* A newer schema than this library's is refused. */
    sql(f->path, "PRAGMA user_version = 4;");
    kiln_cache_options o = {.size = sizeof o, .path = f->path, .ignore_env = 1};
    assert_int_equal(kiln_cache_open(&o, &c), KILN_ERR_CACHE_SCHEMA);
}

int main(void)
{
    kiln_test_filter();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_store_load_replace, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupt_rows, setup, teardown),
        cmocka_unit_test_setup_teardown(test_coverage, setup, teardown),
        cmocka_unit_test_setup_teardown(test_merge, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gc, setup, teardown),
        cmocka_unit_test_setup_teardown(test_migrate_schema2, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
