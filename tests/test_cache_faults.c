/* The cubin database when the file or the filesystem goes wrong: random bytes,
 * a truncated database, a newer schema, a folder kiln may not write, a full
 * disk, a database locked past the busy timeout. Each gets a clear error
 * (a KILN_ERR_CACHE_* status and a message naming the file) or works, and a
 * lookup that finds something always returns the bytes that were stored:
 * never a crash, never a wrong cubin.
 *
 * Two cases need privileges: the full disk mounts a small tmpfs (root, and a
 * kernel that lets this process mount), and the read-only folder needs a user
 * whom permissions bind (as root, the check runs in a child that becomes
 * nobody). Without them the case says why and is skipped.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "testutil.h"

#define NOBODY 65534

typedef struct fixture {
    char dir[512];
    char mnt[600];
    int mounted;
    kiln_rng rng;
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    f->rng = kiln_rng_new();
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    if (f->mounted && umount2(f->mnt, MNT_DETACH) != 0)
        fprintf(stderr, "warning: cannot unmount %s: %s\n", f->mnt, strerror(errno));
    chmod(f->dir, 0700);
    kiln_test_rmrf(f->dir);
    free(f);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- files ---- */

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(p, 1, n, fp), n);
    assert_int_equal(fclose(fp), 0);
}

/* The whole file in a malloc'd buffer (NULL when it cannot be read). */
static uint8_t *read_bytes(const char *path, size_t *n)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *p = malloc(len > 0 ? (size_t)len : 1);
    assert_non_null(p);
    assert_int_equal(fread(p, 1, (size_t)len, fp), (size_t)len);
    fclose(fp);
    *n = (size_t)len;
    return p;
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

/* ---- what every failure must look like ---- */

/* A clear error: a cache status (not a crash's worth of anything else) and a
 * message that names the file. */
static void expect_clear_error(kiln_status st, const char *msg, const char *path, const char *what)
{
    if (st != KILN_ERR_CACHE_IO && st != KILN_ERR_CACHE_SCHEMA && st != KILN_ERR_CACHE_CORRUPT &&
        st != KILN_ERR_CACHE_BUSY)
        fail_msg("%s: expected a KILN_ERR_CACHE_* status, got %s: %s", what, kiln_status_code(st), msg);
    const char *base = strrchr(path, '/');
    if (!msg || !strstr(msg, base ? base + 1 : path))
        fail_msg("%s: %s, but the message does not name %s: \"%s\"", what, kiln_status_code(st), path,
                 msg ? msg : "(null)");
}

/* A record whose cubin is size random bytes. */
typedef struct rec {
    kiln_cache_record r;
    uint8_t *cubin;
} rec;

static void make_rec(kiln_rng *g, rec *x, size_t size)
{
    memset(x, 0, sizeof *x);
    x->cubin = malloc(size);
    assert_non_null(x->cubin);
    kiln_rng_fill(g, x->r.fingerprint, KILN_FINGERPRINT_SIZE);
    kiln_rng_fill(g, x->cubin, size);
    x->r.template_id = "token_embedding";
    x->r.constants = "HIDDEN=64;VOCAB=1000";
    x->r.arch = "sm_90";
    x->r.nvrtc_major = 13;
    x->r.entries = "kiln_token_embedding";
    x->r.cubin = x->cubin;
    x->r.cubin_size = size;
}

/* Looks fp up: a hit must hold exactly want (want NULL: the row must not
 * exist); a miss is fine; an error must be clear. Returns 1 on a hit, 0 on a
 * miss, -1 on an error. */
static int lookup(kiln_cache *c, const uint8_t *fp, const void *want, size_t want_size, const char *what)
{
    void *got = NULL;
    size_t size = 0;
    int found = 0;
    kiln_status st = kiln_cache_get(c, fp, &got, &size, &found);
    if (st) {
        expect_clear_error(st, kiln_cache_errmsg(c), kiln_cache_path(c), what);
        assert_null(got);
        return -1;
    }
    if (!found) {
        assert_null(got);
        return 0;
    }
    if (!want)
        fail_msg("%s: a hit for a row that was never stored", what);
    if (size != want_size || memcmp(got, want, size) != 0)
        fail_msg("%s: a WRONG CUBIN: %zu bytes back, %zu stored", what, size, want_size);
    kiln_free(got);
    return 1;
}

static kiln_cache *open_ok(const char *path, int busy_ms)
{
    kiln_cache_options o = {.path = path, .busy_timeout_ms = busy_ms, .ignore_env = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    return c;
}

static kiln_jit *new_jit(kiln_cache *c)
{
    kiln_jit_options o = {.cache = c, .arch = "sm_90"};
    kiln_jit *j = NULL;
    KILN_CHECK(kiln_jit_create(&o, &j));
    return j;
}

/* A real cubin of a small token embedding (hidden 64 * (i + 1)), as NVRTC makes it. */
typedef struct real {
    kiln_spec spec;
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    void *cubin;
    size_t size;
} real;

static void make_reals(real *out, int n, int vocab)
{
    char dir[512], path[600];
    kiln_test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/ref.db", dir);
    kiln_cache *c = open_ok(path, 0);
    kiln_jit *j = new_jit(c);
    for (int i = 0; i < n; i++) {
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, vocab, 64 * (i + 1), 8, &out[i].spec));
        int compiled;
        KILN_CHECK(kiln_jit_prepare(j, &out[i].spec, &compiled));
        KILN_CHECK(kiln_jit_fingerprint(j, &out[i].spec, out[i].fp));
        int found;
        KILN_CHECK(kiln_cache_get(c, out[i].fp, &out[i].cubin, &out[i].size, &found));
        assert_int_equal(found, 1);
    }
    kiln_jit_destroy(j);
    kiln_cache_close(c);
    kiln_test_rmrf(dir);
}

static void free_reals(real *r, int n)
{
    for (int i = 0; i < n; i++)
        kiln_free(r[i].cubin);
}

/* Prepares a real spec on cache c with a fresh jit: it works (and the row, if
 * any, is the right cubin) or fails clearly. Returns the status. */
static kiln_status prepare_real(kiln_cache *c, const real *r, const char *what)
{
    kiln_jit *j = new_jit(c);
    int compiled = 0;
    kiln_status st = kiln_jit_prepare(j, &r->spec, &compiled);
    if (st)
        expect_clear_error(st, kiln_jit_errmsg(j), kiln_cache_path(c), what);
    else
        lookup(c, r->fp, r->cubin, r->size, what);
    kiln_jit_destroy(j);
    return st;
}

/* ---- random bytes ---- */

static void test_random_file_is_refused_and_left_alone(void **state)
{
    fixture *f = *state;
    static const size_t sizes[] = {1, 99, 100, 512, 4096, 65536};
    char path[700];
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        for (int with_header = 0; with_header < 2; with_header++) {
            size_t n = sizes[i];
            uint8_t *bytes = malloc(n);
            kiln_rng_fill(&f->rng, bytes, n);
            /* With SQLite's magic in front, the random rest is parsed as a header and pages. */
            if (with_header)
                memcpy(bytes, "SQLite format 3", n < 16 ? n : 16);
            snprintf(path, sizeof path, "%s/random-%zu-%d.db", f->dir, n, with_header);
            write_bytes(path, bytes, n);
            for (int ro = 0; ro < 2; ro++) {
                kiln_cache_options o = {.path = path, .read_only = ro, .ignore_env = 1};
                kiln_cache *c = (kiln_cache *)1;
                kiln_status st = kiln_cache_open(&o, &c);
                char what[800];
                snprintf(what, sizeof what, "%zu random bytes%s, %s", n, with_header ? " after SQLite's magic" : "",
                         ro ? "read-only" : "writable");
                if (st == KILN_OK) {
                    kiln_cache_close(c);
                    free(bytes);
                    fail_msg("%s: opened as a kiln database (and made one of the file)", what);
                }
                assert_null(c);
                if (st != KILN_ERR_CACHE_SCHEMA)
                    fail_msg("%s: expected cache_schema, got %s: %s", what, kiln_status_code(st), kiln_errmsg());
                expect_clear_error(st, kiln_errmsg(), path, what);
                /* Somebody's file: kiln writes nothing into it. */
                size_t m = 0;
                uint8_t *after = read_bytes(path, &m);
                if (!after || m != n || memcmp(after, bytes, n) != 0)
                    fail_msg("%s: the file changed (%zu bytes, was %zu)", what, m, n);
                free(after);
            }
            free(bytes);
        }
    }
}

/* ---- a truncated database ---- */

static void test_truncated_database(void **state)
{
    fixture *f = *state;
    enum { N_REAL = 2, N_FILL = 24, FILL_SIZE = 9000 };
    real reals[N_REAL];
    make_reals(reals, N_REAL, 1000);
    rec fill[N_FILL];
    char src[700], path[700];
    snprintf(src, sizeof src, "%s/full.db", f->dir);
    kiln_cache *c = open_ok(src, 0);
    for (int i = 0; i < N_FILL; i++) {
        make_rec(&f->rng, &fill[i], FILL_SIZE);
        KILN_CHECK(kiln_cache_put(c, &fill[i].r));
        if (i == N_FILL / 2)
            for (int k = 0; k < N_REAL; k++)
                assert_int_equal(prepare_real(c, &reals[k], "building the database"), KILN_OK);
    }
    kiln_cache_close(c); /* the last connection: the WAL is checkpointed into the file */
    size_t full_size = 0;
    uint8_t *full = read_bytes(src, &full_size);
    assert_non_null(full);
    assert_true(full_size > N_FILL * FILL_SIZE);

    const size_t cuts[] = {full_size / 2, full_size / 4, full_size * 3 / 4, full_size - 1, 4096, 100, 50};
    int opened = 0, refused = 0, prepared = 0, prepare_failed = 0;
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
        snprintf(path, sizeof path, "%s/truncated-%zu.db", f->dir, cuts[i]);
        write_bytes(path, full, cuts[i]);
        char what[800];
        snprintf(what, sizeof what, "database truncated from %zu to %zu bytes", full_size, cuts[i]);
        kiln_cache_options o = {.path = path, .ignore_env = 1};
        kiln_cache *t = NULL;
        kiln_status st = kiln_cache_open(&o, &t);
        if (st) {
            expect_clear_error(st, kiln_errmsg(), path, what);
            assert_null(t);
            refused++;
            printf("%s: refused: %s: %s\n", what, kiln_status_code(st), kiln_errmsg());
            continue;
        }
        opened++;
        int hits = 0, misses = 0, errors = 0;
        for (int k = 0; k < N_FILL; k++) {
            int r = lookup(t, fill[k].r.fingerprint, fill[k].cubin, FILL_SIZE, what);
            hits += r == 1, misses += r == 0, errors += r < 0;
        }
        kiln_cache_verify_report vr = {0};
        st = kiln_cache_verify(t, NULL, NULL, &vr);
        if (st)
            expect_clear_error(st, kiln_cache_errmsg(t), path, what);
        else if (vr.integrity_ok && cuts[i] < full_size && misses + errors > 0)
            fail_msg("%s: rows are gone, yet kiln_cache_verify says the database is whole", what);
        /* A jit on it: compiles, or says clearly why not; a hit is the right cubin. */
        for (int k = 0; k < N_REAL; k++) {
            if (prepare_real(t, &reals[k], what) == KILN_OK)
                prepared++;
            else
                prepare_failed++;
        }
        printf("%s: opened: %d hits, %d misses, %d errors; verify %s (%llu rows, %llu bad, integrity %s)\n", what,
               hits, misses, errors, st ? kiln_status_code(st) : "ok", (unsigned long long)vr.rows,
               (unsigned long long)vr.bad_rows, vr.integrity_ok ? "ok" : "failed");
        kiln_cache_close(t);
    }
    printf("truncated databases: %d refused, %d opened; jit prepares on them: %d worked, %d failed clearly\n",
           refused, opened, prepared, prepare_failed);
    free(full);
    for (int i = 0; i < N_FILL; i++)
        free(fill[i].cubin);
    free_reals(reals, N_REAL);
}

/* ---- a newer schema ---- */

/* A kiln database at path holding one row, then changed by the SQL then. */
static void make_kiln_db_then(fixture *f, const char *path, const char *then)
{
    rec x;
    make_rec(&f->rng, &x, 2000);
    kiln_cache *c = open_ok(path, 0);
    KILN_CHECK(kiln_cache_put(c, &x.r));
    kiln_cache_close(c);
    sql(path, then);
    free(x.cubin);
}

static void test_newer_schema_is_refused_and_left_alone(void **state)
{
    fixture *f = *state;
    char path[700];
    snprintf(path, sizeof path, "%s/newer.db", f->dir);
    kiln_cache *c;
    make_kiln_db_then(f, path, "PRAGMA user_version = 99");
    size_t n0 = 0, n1 = 0;
    uint8_t *before = read_bytes(path, &n0);
    for (int ro = 0; ro < 2; ro++) {
        kiln_cache_options o = {.path = path, .read_only = ro, .ignore_env = 1};
        c = (kiln_cache *)1;
        KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_SCHEMA, kiln_errmsg(), "99", "newer.db");
        assert_null(c);
    }
    uint8_t *after = read_bytes(path, &n1);
    assert_int_equal(n0, n1);
    assert_memory_equal(before, after, n0);
    free(before);
    free(after);
}

/* ---- files kiln refuses are left byte for byte ---- */

/* Opens path writable, then read-only: both refused with want, and the file
 * keeps every byte (the journal-mode bytes 18-19, the change counter 24-27). */
static void expect_refused_untouched(const char *path, kiln_status want, const char *needle)
{
    size_t n0 = 0, n1 = 0;
    uint8_t *before = read_bytes(path, &n0);
    assert_non_null(before);
    assert_true(n0 >= 100);
    for (int ro = 0; ro < 2; ro++) {
        kiln_cache_options o = {.path = path, .read_only = ro, .ignore_env = 1};
        kiln_cache *c = (kiln_cache *)1;
        KILN_EXPECT(kiln_cache_open(&o, &c), want, kiln_errmsg(), needle, NULL);
        assert_null(c);
        uint8_t *after = read_bytes(path, &n1);
        assert_non_null(after);
        if (n1 != n0 || memcmp(before, after, n0) != 0)
            fail_msg("%s (%s): the refused file changed: header bytes 18-19 %u,%u -> %u,%u, change counter "
                     "%02x%02x%02x%02x -> %02x%02x%02x%02x, %zu -> %zu bytes",
                     path, ro ? "read-only" : "writable", before[18], before[19], after[18], after[19], before[24],
                     before[25], before[26], before[27], after[24], after[25], after[26], after[27], n0, n1);
        free(after);
    }
    free(before);
}

static void test_refused_files_are_not_modified_first(void **state)
{
    fixture *f = *state;
    char path[700];
    /* Another application's SQLite file, in the rollback journal. */
    snprintf(path, sizeof path, "%s/other.db", f->dir);
    sql(path, "CREATE TABLE t(x); INSERT INTO t VALUES (1);");
    expect_refused_untouched(path, KILN_ERR_CACHE_SCHEMA, "not a kiln cache");
    /* A kiln database of a newer schema, switched to the rollback journal. */
    snprintf(path, sizeof path, "%s/newer-delete.db", f->dir);
    make_kiln_db_then(f, path, "PRAGMA journal_mode=DELETE; PRAGMA user_version = 4");
    expect_refused_untouched(path, KILN_ERR_CACHE_SCHEMA, "schema version 4");
}

/* ---- paths that are not regular files, symbolic links ---- */

/* Runs fn(arg) in a child, which must finish within 10 s (a FIFO opened for
 * reading would block forever). Returns the status the child exited with. */
static kiln_status run_in_child(kiln_status (*fn)(const void *arg), const void *arg, const char *what)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        kiln_status st = fn(arg);
        if (st)
            fprintf(stderr, "%s: %s: %s\n", what, kiln_status_code(st), kiln_errmsg());
        _exit((int)st);
    }
    double t0 = now_s();
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
        if (now_s() - t0 > 10.0) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            fail_msg("%s: did not return within 10 s", what);
        }
        usleep(10000);
    }
    assert_true(WIFEXITED(status));
    return (kiln_status)WEXITSTATUS(status);
}

static kiln_status open_and_close(const void *arg)
{
    kiln_cache *c = NULL;
    kiln_status st = kiln_cache_open(arg, &c);
    kiln_cache_close(c);
    return st;
}

/* Merges the file at arg into a new database beside it. */
static kiln_status merge_from(const void *arg)
{
    char path[800];
    snprintf(path, sizeof path, "%s.merged", (const char *)arg);
    kiln_cache_options o = {.path = path, .ignore_env = 1};
    kiln_cache *c = NULL;
    kiln_status st = kiln_cache_open(&o, &c);
    if (!st)
        st = kiln_cache_merge(c, arg, NULL, NULL);
    kiln_cache_close(c);
    return st;
}

static kiln_status open_in_child(const kiln_cache_options *o, const char *what)
{
    return run_in_child(open_and_close, o, what);
}

static void test_paths_that_are_not_regular_files(void **state)
{
    fixture *f = *state;
    char fifo[700], dir[700];
    snprintf(fifo, sizeof fifo, "%s/fifo.db", f->dir);
    snprintf(dir, sizeof dir, "%s/dir.db", f->dir);
    assert_int_equal(mkfifo(fifo, 0644), 0);
    assert_int_equal(mkdir(dir, 0755), 0);
    const char *paths[] = {fifo, dir, "/dev/null"};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++) {
        for (int ro = 0; ro < 2; ro++) {
            char what[800];
            snprintf(what, sizeof what, "%s opened %s", paths[i], ro ? "read-only" : "writable");
            kiln_cache_options o = {.path = paths[i], .read_only = ro, .ignore_env = 1};
            assert_int_equal(open_in_child(&o, what), KILN_ERR_CACHE_IO);
            kiln_cache *c = (kiln_cache *)1;
            if (!strcmp(paths[i], fifo))
                continue; /* in this process, the child showed it returns */
            KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_IO, kiln_errmsg(), paths[i], "not a regular file");
            assert_null(c);
        }
        /* As a read-only layer: skipped, with the reason, in bounded time. */
        char main_path[700];
        snprintf(main_path, sizeof main_path, "%s/main-%zu.db", f->dir, i);
        kiln_cache_options o = {.path = main_path, .readonly_paths = &paths[i], .n_readonly_paths = 1};
        assert_int_equal(open_in_child(&o, "a layer that is not a regular file"), KILN_OK);
        kiln_cache *c = NULL;
        KILN_CHECK(kiln_cache_open(&o, &c));
        kiln_cache_layer_info info;
        KILN_CHECK(kiln_cache_layer(c, 0, &info));
        assert_false(info.active);
        kiln_test_expect(KILN_ERR_CACHE_IO, KILN_ERR_CACHE_IO, info.reason, "not a regular file", paths[i]);
        kiln_cache_close(c);
    }
    /* A merge source that is a FIFO is refused, not opened. */
    assert_int_equal(run_in_child(merge_from, fifo, "merging from a FIFO"), KILN_ERR_CACHE_IO);
    struct stat sb;
    assert_int_equal(stat(fifo, &sb), 0);
    assert_true(S_ISFIFO(sb.st_mode));
}

static void test_symbolic_links(void **state)
{
    fixture *f = *state;
    char target[700], link_path[700], dangling[700], nowhere[700];
    snprintf(target, sizeof target, "%s/empty-target", f->dir);
    snprintf(link_path, sizeof link_path, "%s/link.db", f->dir);
    snprintf(nowhere, sizeof nowhere, "%s/nowhere.db", f->dir);
    snprintf(dangling, sizeof dangling, "%s/dangling.db", f->dir);
    write_bytes(target, "", 0);
    assert_int_equal(symlink(target, link_path), 0);
    assert_int_equal(symlink(nowhere, dangling), 0);
    struct stat sb;
    for (int follow = 0; follow < 2; follow++) {
        /* A link to nothing: refused, and nothing is created at its target. */
        kiln_cache_options o = {.path = dangling, .ignore_env = 1, .follow_symlinks = follow};
        kiln_cache *c = (kiln_cache *)1;
        KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_IO, kiln_errmsg(), dangling, nowhere);
        assert_null(c);
        assert_int_not_equal(lstat(nowhere, &sb), 0);
    }
    /* A link to an empty file: refused, naming both, and the target stays empty. */
    kiln_cache_options o = {.path = link_path, .ignore_env = 1};
    kiln_cache *c = (kiln_cache *)1;
    KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_CACHE_IO, kiln_errmsg(), link_path, target);
    assert_null(c);
    assert_int_equal(stat(target, &sb), 0);
    assert_int_equal(sb.st_size, 0);
    /* Allowed: the target becomes the database. */
    o.follow_symlinks = 1;
    rec x;
    make_rec(&f->rng, &x, 1000);
    c = open_ok(target, 0);
    kiln_cache_close(c);
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_CHECK(kiln_cache_put(c, &x.r));
    kiln_cache_close(c);
    /* Read-only, the link is refused too, naming it and its target, unless allowed. */
    kiln_cache_options r = {.path = link_path, .read_only = 1, .ignore_env = 1};
    c = (kiln_cache *)1;
    KILN_EXPECT(kiln_cache_open(&r, &c), KILN_ERR_CACHE_IO, kiln_errmsg(), link_path, target);
    assert_null(c);
    r.follow_symlinks = 1;
    KILN_CHECK(kiln_cache_open(&r, &c));
    assert_int_equal(lookup(c, x.r.fingerprint, x.cubin, 1000, "a read through a link"), 1);
    kiln_cache_close(c);
    assert_int_equal(lstat(link_path, &sb), 0);
    assert_true(S_ISLNK(sb.st_mode));
    /* A read-only layer that is a link is skipped, its reason naming the link
     * and its target; allowed, by the option or the environment, it is searched. */
    char main_db[700];
    snprintf(main_db, sizeof main_db, "%s/main.db", f->dir);
    const char *layers[] = {link_path};
    for (int how = 0; how < 3; how++) {
        kiln_cache_options l = {.path = main_db,
                                .readonly_paths = layers,
                                .n_readonly_paths = 1,
                                .ignore_env = how != 2,
                                .follow_symlinks = how == 1};
        if (how == 2)
            assert_int_equal(setenv("KILN_CACHE_FOLLOW_SYMLINKS", "1", 1), 0);
        KILN_CHECK(kiln_cache_open(&l, &c));
        unsetenv("KILN_CACHE_FOLLOW_SYMLINKS");
        kiln_cache_layer_info info;
        assert_int_equal(kiln_cache_layer_count(c), 1);
        KILN_CHECK(kiln_cache_layer(c, 0, &info));
        if (how == 0) {
            assert_false(info.active);
            kiln_test_expect(KILN_ERR_CACHE_IO, KILN_ERR_CACHE_IO, info.reason, link_path, target);
            assert_non_null(strstr(info.reason, "symbolic link"));
            assert_int_equal(lookup(c, x.r.fingerprint, x.cubin, 1000, "a layer that is a link"), 0);
        } else {
            assert_true(info.active);
            assert_int_equal(lookup(c, x.r.fingerprint, x.cubin, 1000, "a layer through an allowed link"), 1);
        }
        kiln_cache_close(c);
    }
    /* A folder reached through a link is no link of the database's own. */
    char real_dir[700], dir_link[700], in_link[800];
    snprintf(real_dir, sizeof real_dir, "%s/real-folder", f->dir);
    snprintf(dir_link, sizeof dir_link, "%s/folder-link", f->dir);
    snprintf(in_link, sizeof in_link, "%s/kernels.db", dir_link);
    assert_int_equal(mkdir(real_dir, 0755), 0);
    assert_int_equal(symlink(real_dir, dir_link), 0);
    c = open_ok(in_link, 0);
    KILN_CHECK(kiln_cache_put(c, &x.r));
    kiln_cache_close(c);
    free(x.cubin);
}

/* ---- folders kiln may not write ---- */

static void test_unwritable_locations_fail_clearly(void **state)
{
    fixture *f = *state;
    char path[800], file[700];
    /* The folder is a regular file. */
    snprintf(file, sizeof file, "%s/plain-file", f->dir);
    write_bytes(file, "x", 1);
    snprintf(path, sizeof path, "%s/kernels.db", file);
    kiln_cache_options o = {.path = path, .ignore_env = 1};
    kiln_cache *c = (kiln_cache *)1;
    kiln_status st = kiln_cache_open(&o, &c);
    assert_int_equal(st, KILN_ERR_CACHE_IO);
    expect_clear_error(st, kiln_errmsg(), "plain-file", "a folder that is a file");
    assert_null(c);
    /* The database path is a folder. */
    snprintf(path, sizeof path, "%s/a-folder.db", f->dir);
    assert_int_equal(mkdir(path, 0755), 0);
    o.path = path;
    st = kiln_cache_open(&o, &c);
    assert_int_equal(st, KILN_ERR_CACHE_IO);
    expect_clear_error(st, kiln_errmsg(), path, "a database path that is a folder");
    assert_null(c);
    /* Somewhere nobody may create anything, root included. */
    o.path = "/proc/kiln-test-no-such/kernels.db";
    st = kiln_cache_open(&o, &c);
    assert_int_equal(st, KILN_ERR_CACHE_IO);
    expect_clear_error(st, kiln_errmsg(), "/proc/kiln-test-no-such", "a folder under /proc");
    assert_null(c);
}

/* What the child that is refused writing checks; exits 0, 77 (skip) or 1 with a message. */
static int read_only_folder_checks(const char *ro_dir, const char *existing, const rec *x)
{
    char path[800];
    if (access(ro_dir, W_OK) == 0) {
        printf("SKIP read-only folder: uid %d can still write a 0555 folder\n", (int)geteuid());
        return KILN_TEST_SKIP;
    }
    if (access(existing, R_OK) != 0) {
        printf("SKIP read-only folder: uid %d cannot reach %s: %s\n", (int)geteuid(), existing, strerror(errno));
        return KILN_TEST_SKIP;
    }
    /* A new database in the folder: a clear error, nothing created. */
    snprintf(path, sizeof path, "%s/new/kernels.db", ro_dir);
    kiln_cache_options o = {.path = path, .ignore_env = 1};
    kiln_cache *c = NULL;
    kiln_status st = kiln_cache_open(&o, &c);
    if (st != KILN_ERR_CACHE_IO || c || !strstr(kiln_errmsg(), ro_dir)) {
        fprintf(stderr, "new database in a read-only folder: %s: %s\n", kiln_status_code(st), kiln_errmsg());
        return 1;
    }
    snprintf(path, sizeof path, "%s/kernels.db", ro_dir);
    o.path = path;
    st = kiln_cache_open(&o, &c);
    if (st != KILN_ERR_CACHE_IO || c || access(path, F_OK) == 0) {
        fprintf(stderr, "new database file in a read-only folder: %s: %s\n", kiln_status_code(st), kiln_errmsg());
        return 1;
    }
    /* The existing database (not ours to write) opened for writing: refused,
     * or opened with every write failing clearly and every read right. */
    o.path = existing;
    st = kiln_cache_open(&o, &c);
    if (st) {
        if (st != KILN_ERR_CACHE_IO || !strstr(kiln_errmsg(), existing)) {
            fprintf(stderr, "existing database, writable open: %s: %s\n", kiln_status_code(st), kiln_errmsg());
            return 1;
        }
        printf("existing database in a read-only folder, writable open: refused: %s\n", kiln_errmsg());
    } else {
        rec y = *x;
        y.r.fingerprint[0] ^= 0xff;
        st = kiln_cache_put(c, &y.r);
        if (st != KILN_ERR_CACHE_IO && st != KILN_ERR_INVALID_ARGUMENT) {
            fprintf(stderr, "put into a database we may not write: %s: %s\n", kiln_status_code(st),
                    kiln_cache_errmsg(c));
            return 1;
        }
        printf("existing database in a read-only folder, writable open: opened; put: %s: %s\n",
               kiln_status_code(st), kiln_cache_errmsg(c));
        kiln_cache_close(c);
    }
    /* The same opened read-only, as a shipped database is: it reads. */
    o.read_only = 1;
    st = kiln_cache_open(&o, &c);
    if (st) {
        fprintf(stderr, "a database in a read-only folder cannot be opened read-only: %s: %s\n",
                kiln_status_code(st), kiln_errmsg());
        return 1;
    }
    void *got = NULL;
    size_t size = 0;
    int found = 0;
    st = kiln_cache_get(c, x->r.fingerprint, &got, &size, &found);
    int ok = !st && found && size == x->r.cubin_size && !memcmp(got, x->cubin, size);
    if (!ok)
        fprintf(stderr, "read-only open in a read-only folder: get %s, found %d, %zu bytes: %s\n",
                kiln_status_code(st), found, size, kiln_cache_errmsg(c));
    kiln_free(got);
    kiln_cache_close(c);
    return ok ? 0 : 1;
}

static void test_read_only_folder(void **state)
{
    fixture *f = *state;
    char ro_dir[700], existing[800];
    snprintf(ro_dir, sizeof ro_dir, "%s/ro", f->dir);
    snprintf(existing, sizeof existing, "%s/kernels-shipped.db", ro_dir);
    rec x;
    make_rec(&f->rng, &x, 3000);
    kiln_cache *c = open_ok(existing, 0);
    KILN_CHECK(kiln_cache_put(c, &x.r));
    kiln_cache_close(c);
    assert_int_equal(chmod(existing, 0644), 0);
    assert_int_equal(chmod(ro_dir, 0555), 0);
    /* Nobody else may need to walk to the folder: the scratch folder is 0700. */
    assert_int_equal(chmod(f->dir, 0755), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (geteuid() == 0 && (setgid(NOBODY) != 0 || setuid(NOBODY) != 0)) {
            printf("SKIP read-only folder: cannot become uid %d: %s\n", NOBODY, strerror(errno));
            fflush(NULL);
            _exit(KILN_TEST_SKIP);
        }
        int rc = read_only_folder_checks(ro_dir, existing, &x);
        fflush(NULL);
        _exit(rc);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    chmod(ro_dir, 0755);
    chmod(f->dir, 0700);
    free(x.cubin);
    assert_true(WIFEXITED(status));
    if (WEXITSTATUS(status) == KILN_TEST_SKIP)
        skip();
    assert_int_equal(WEXITSTATUS(status), 0);
}

/* ---- a full disk ---- */

static void test_full_disk(void **state)
{
    fixture *f = *state;
    enum { SIZE = 30000, MAX_RECS = 40 };
    snprintf(f->mnt, sizeof f->mnt, "%s/small-disk", f->dir);
    assert_int_equal(mkdir(f->mnt, 0755), 0);
    if (mount("tmpfs", f->mnt, "tmpfs", MS_NOSUID | MS_NODEV, "size=512k") != 0) {
        printf("SKIP full disk: cannot mount a 512 KiB tmpfs on %s: %s\n", f->mnt, strerror(errno));
        skip();
    }
    f->mounted = 1;
    char path[700], filler[700];
    snprintf(path, sizeof path, "%s/kernels.db", f->mnt);
    snprintf(filler, sizeof filler, "%s/filler", f->mnt);
    /* Room that can be given back later. */
    static uint8_t pad[192 << 10];
    memset(pad, 0x5a, sizeof pad);
    write_bytes(filler, pad, sizeof pad);

    real reals[1];
    make_reals(reals, 1, 1500);
    kiln_cache *c = open_ok(path, 0);
    rec recs[MAX_RECS];
    int stored = 0;
    kiln_status st = KILN_OK;
    while (stored < MAX_RECS) {
        make_rec(&f->rng, &recs[stored], SIZE);
        st = kiln_cache_put(c, &recs[stored].r);
        if (st)
            break;
        stored++;
    }
    if (!st)
        fail_msg("%d puts of %d bytes fit a 512 KiB disk", stored, SIZE);
    printf("full disk after %d rows: %s: %s\n", stored, kiln_status_code(st), kiln_cache_errmsg(c));
    assert_int_equal(st, KILN_ERR_CACHE_IO);
    expect_clear_error(st, kiln_cache_errmsg(c), path, "a put on a full disk");
    /* The process goes on: what was stored reads back, the failed row is not half there. */
    for (int i = 0; i < stored; i++)
        assert_int_equal(lookup(c, recs[i].r.fingerprint, recs[i].cubin, SIZE, "a row stored before the disk filled"),
                         1);
    assert_true(lookup(c, recs[stored].r.fingerprint, recs[stored].cubin, SIZE, "the row that did not fit") <= 0);
    /* Fill what is left with ever smaller rows, down to rows smaller than any cubin. */
    rec small[64];
    int n_small = 0;
    for (size_t size = SIZE / 2; size >= 64 && n_small < 64;) {
        make_rec(&f->rng, &small[n_small], size);
        st = kiln_cache_put(c, &small[n_small].r);
        if (st) {
            assert_int_equal(st, KILN_ERR_CACHE_IO);
            free(small[n_small].cubin);
            size /= 2;
        } else {
            n_small++;
        }
    }
    for (int i = 0; i < n_small; i++)
        assert_int_equal(lookup(c, small[i].r.fingerprint, small[i].cubin, small[i].r.cubin_size, "a small row"), 1);
    /* A jit compiles, and says clearly that it could not store. */
    kiln_jit *j = new_jit(c);
    int compiled = 0;
    st = kiln_jit_prepare(j, &reals[0].spec, &compiled);
    printf("jit prepare on a full disk (%d small rows more): %s: %s\n", n_small, kiln_status_code(st),
           st ? kiln_jit_errmsg(j) : "");
    assert_int_equal(st, KILN_ERR_CACHE_IO);
    expect_clear_error(st, kiln_jit_errmsg(j), path, "jit prepare on a full disk");
    kiln_jit_counters jc;
    kiln_jit_get_counters(j, &jc);
    assert_int_equal(jc.compiles, 1);
    assert_int_equal(lookup(c, reals[0].fp, reals[0].cubin, reals[0].size, "jit row on a full disk"), 0);

    /* Room again: the same calls work, with nothing to repair. */
    assert_int_equal(unlink(filler), 0);
    KILN_CHECK(kiln_cache_put(c, &recs[stored].r));
    assert_int_equal(lookup(c, recs[stored].r.fingerprint, recs[stored].cubin, SIZE, "the row stored later"), 1);
    KILN_CHECK(kiln_jit_prepare(j, &reals[0].spec, &compiled));
    assert_int_equal(lookup(c, reals[0].fp, reals[0].cubin, reals[0].size, "the jit row stored later"), 1);
    kiln_jit_destroy(j);
    kiln_cache_verify_report vr;
    KILN_CHECK(kiln_cache_verify(c, NULL, NULL, &vr));
    assert_true(vr.integrity_ok);
    assert_int_equal(vr.bad_rows, 0);
    assert_int_equal(vr.rows, (uint64_t)stored + (uint64_t)n_small + 2);
    kiln_cache_close(c);
    for (int i = 0; i <= stored; i++)
        free(recs[i].cubin);
    for (int i = 0; i < n_small; i++)
        free(small[i].cubin);
    free_reals(reals, 1);
    assert_int_equal(umount2(f->mnt, MNT_DETACH), 0);
    f->mounted = 0;
}

/* ---- locked past the busy timeout ---- */

static sqlite3 *lock_exclusively(const char *path, const char *journal_mode)
{
    sqlite3 *db;
    char *err = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    char text[200];
    snprintf(text, sizeof text, "PRAGMA journal_mode=%s; BEGIN EXCLUSIVE; UPDATE kernels SET hits = hits;",
             journal_mode);
    if (sqlite3_exec(db, text, NULL, NULL, &err) != SQLITE_OK)
        fail_msg("%s: %s", text, err);
    return db;
}

static void unlock(sqlite3 *db)
{
    assert_int_equal(sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
}

/* Asserts that a call that met the lock gave up after about the busy timeout. */
static void expect_timely(double seconds, const char *what)
{
    if (seconds > 5.0)
        fail_msg("%s took %.2f s: the 100 ms busy timeout was not honoured", what, seconds);
}

static void test_locked_past_the_busy_timeout_wal(void **state)
{
    fixture *f = *state;
    char path[700];
    snprintf(path, sizeof path, "%s/locked.db", f->dir);
    real reals[1];
    make_reals(reals, 1, 2500);
    rec present, fresh;
    make_rec(&f->rng, &present, 4000);
    make_rec(&f->rng, &fresh, 4000);
    kiln_cache *c = open_ok(path, 0);
    KILN_CHECK(kiln_cache_put(c, &present.r));
    kiln_cache_close(c);

    sqlite3 *holder = lock_exclusively(path, "WAL");
    /* Opening while another process writes: readers are not blocked in WAL. */
    double t0 = now_s();
    kiln_cache_options o = {.path = path, .busy_timeout_ms = 100, .ignore_env = 1};
    kiln_status st = kiln_cache_open(&o, &c);
    expect_timely(now_s() - t0, "opening a locked database");
    if (st) {
        expect_clear_error(st, kiln_errmsg(), path, "opening a database locked by a writer (WAL)");
        fail_msg("a WAL database with a writer cannot be opened: %s: %s", kiln_status_code(st), kiln_errmsg());
    }
    /* Reads go on. */
    assert_int_equal(lookup(c, present.r.fingerprint, present.cubin, 4000, "a read while another writes"), 1);
    /* A write gives up after the busy timeout, retryably. */
    t0 = now_s();
    st = kiln_cache_put(c, &fresh.r);
    double took = now_s() - t0;
    expect_timely(took, "a put on a locked database");
    printf("put on a locked WAL database: %s after %.3f s: %s\n", kiln_status_code(st), took, kiln_cache_errmsg(c));
    assert_int_equal(st, KILN_ERR_CACHE_BUSY);
    expect_clear_error(st, kiln_cache_errmsg(c), path, "a put on a locked database");
    assert_true(took >= 0.09);
    /* A jit compiles anyway, and either stores nothing and says busy, or works. */
    kiln_jit *j = new_jit(c);
    int compiled = 0;
    t0 = now_s();
    st = kiln_jit_prepare(j, &reals[0].spec, &compiled);
    expect_timely(now_s() - t0, "a jit prepare on a locked database");
    printf("jit prepare on a locked WAL database: %s: %s\n", kiln_status_code(st), st ? kiln_jit_errmsg(j) : "");
    if (st != KILN_OK && st != KILN_ERR_CACHE_BUSY)
        fail_msg("jit prepare on a locked database: %s: %s", kiln_status_code(st), kiln_jit_errmsg(j));
    if (st)
        expect_clear_error(st, kiln_jit_errmsg(j), path, "jit prepare on a locked database");
    assert_true(lookup(c, reals[0].fp, reals[0].cubin, reals[0].size, "jit row under the lock") >= 0);
    /* Closing with hit counts to write must not hang on the lock. */
    t0 = now_s();
    kiln_cache_flush(c);
    expect_timely(now_s() - t0, "a flush on a locked database");

    /* The lock goes: the same calls work. */
    unlock(holder);
    KILN_CHECK(kiln_cache_put(c, &fresh.r));
    assert_int_equal(lookup(c, fresh.r.fingerprint, fresh.cubin, 4000, "the put retried"), 1);
    KILN_CHECK(kiln_jit_prepare(j, &reals[0].spec, &compiled));
    assert_int_equal(lookup(c, reals[0].fp, reals[0].cubin, reals[0].size, "the jit prepare retried"), 1);
    kiln_jit_destroy(j);

    /* Locked again with a hit pending: close gives up on the hit count in time. */
    holder = lock_exclusively(path, "WAL");
    t0 = now_s();
    kiln_cache_close(c);
    expect_timely(now_s() - t0, "closing a locked database with hits to record");
    unlock(holder);
    free(present.cubin);
    free(fresh.cubin);
    free_reals(reals, 1);
}

static void test_locked_past_the_busy_timeout_rollback_journal(void **state)
{
    fixture *f = *state;
    char path[700];
    snprintf(path, sizeof path, "%s/locked-journal.db", f->dir);
    rec present, fresh;
    make_rec(&f->rng, &present, 4000);
    make_rec(&f->rng, &fresh, 4000);
    kiln_cache *c = open_ok(path, 0);
    KILN_CHECK(kiln_cache_put(c, &present.r));
    kiln_cache_close(c);
    /* A rollback journal (a filesystem without WAL, or another tool): an
     * exclusive lock keeps readers out too. */
    sqlite3 *holder = lock_exclusively(path, "DELETE");
    kiln_cache_options o = {.path = path, .busy_timeout_ms = 100, .ignore_env = 1};
    double t0 = now_s();
    kiln_status st = kiln_cache_open(&o, &c);
    expect_timely(now_s() - t0, "opening an exclusively locked database");
    printf("open of an exclusively locked database: %s: %s\n", kiln_status_code(st), st ? kiln_errmsg() : "");
    if (st) {
        assert_int_equal(st, KILN_ERR_CACHE_BUSY);
        expect_clear_error(st, kiln_errmsg(), path, "opening an exclusively locked database");
        assert_null(c);
    } else {
        t0 = now_s();
        int r = lookup(c, present.r.fingerprint, present.cubin, 4000, "a read under an exclusive lock");
        expect_timely(now_s() - t0, "a read under an exclusive lock");
        st = kiln_cache_put(c, &fresh.r);
        assert_int_equal(st, KILN_ERR_CACHE_BUSY);
        expect_clear_error(st, kiln_cache_errmsg(c), path, "a put under an exclusive lock");
        printf("under an exclusive lock: read %s, put %s\n", r == 1 ? "hit" : r == 0 ? "miss" : "error",
               kiln_status_code(st));
        kiln_cache_close(c);
    }
    unlock(holder);
    c = open_ok(path, 100);
    assert_int_equal(lookup(c, present.r.fingerprint, present.cubin, 4000, "a read after the lock"), 1);
    KILN_CHECK(kiln_cache_put(c, &fresh.r));
    kiln_cache_close(c);
    free(present.cubin);
    free(fresh.cubin);
}

/* Under another's exclusive lock, the whole open gives up after about one
 * busy timeout, not one per statement it runs. */
static void test_one_deadline_for_the_whole_open(void **state)
{
    fixture *f = *state;
    char path[700];
    snprintf(path, sizeof path, "%s/deadline.db", f->dir);
    kiln_cache *c = open_ok(path, 0);
    kiln_cache_close(c);
    sql(path, "PRAGMA journal_mode=DELETE");
    sqlite3 *holder = lock_exclusively(path, "DELETE");
    kiln_cache_options o = {.path = path, .busy_timeout_ms = 300, .ignore_env = 1};
    c = (kiln_cache *)1;
    double t0 = now_s();
    kiln_status st = kiln_cache_open(&o, &c);
    double took = now_s() - t0;
    printf("open under an exclusive lock, 300 ms busy timeout: %s after %.3f s\n", kiln_status_code(st), took);
    assert_int_equal(st, KILN_ERR_CACHE_BUSY);
    assert_null(c);
    expect_clear_error(st, kiln_errmsg(), path, "opening under an exclusive lock");
    if (took >= 0.9)
        fail_msg("the open took %.3f s, 3 times its 300 ms busy timeout or more", took);
    unlock(holder);
}

/* ---- a corrupt row whose delete fails ---- */

/* Gives the row of fp a raw_size of 0 (a row that fails verification) and
 * zeroes the first page of the kernels_by_template index, so that a delete
 * of any row fails with SQLITE_CORRUPT while lookups by fingerprint work. */
static void damage_row_and_index(const char *path, const uint8_t *fp)
{
    sqlite3 *db;
    sqlite3_stmt *q;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "PRAGMA journal_mode=DELETE", NULL, NULL, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, "UPDATE kernels SET raw_size = 0 WHERE fingerprint = ?1", -1, &q, NULL),
                     SQLITE_OK);
    sqlite3_bind_blob(q, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    assert_int_equal(sqlite3_step(q), SQLITE_DONE);
    assert_int_equal(sqlite3_changes(db), 1);
    sqlite3_finalize(q);
    assert_int_equal(sqlite3_prepare_v2(db,
                                        "SELECT rootpage, (SELECT page_size FROM pragma_page_size) FROM sqlite_master"
                                        " WHERE name = 'kernels_by_template'",
                                        -1, &q, NULL),
                     SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    long page = sqlite3_column_int(q, 0), page_size = sqlite3_column_int(q, 1);
    sqlite3_finalize(q);
    sqlite3_close(db);
    assert_true(page > 1 && page_size >= 512);
    size_t n = 0;
    uint8_t *b = read_bytes(path, &n);
    assert_non_null(b);
    assert_true((size_t)(page * page_size) <= n);
    memset(b + (page - 1) * page_size, 0, (size_t)page_size);
    write_bytes(path, b, n);
    free(b);
}

static void test_put_over_a_corrupt_row_that_cannot_be_dropped(void **state)
{
    fixture *f = *state;
    enum { N = 8, SIZE = 3000 };
    real reals[1];
    make_reals(reals, 1, 1000);
    char path[700];
    snprintf(path, sizeof path, "%s/damaged.db", f->dir);
    kiln_cache *c = open_ok(path, 0);
    rec recs[N];
    for (int i = 0; i < N; i++) {
        make_rec(&f->rng, &recs[i], SIZE);
        KILN_CHECK(kiln_cache_put(c, &recs[i].r));
    }
    assert_int_equal(prepare_real(c, &reals[0], "building the database"), KILN_OK);
    kiln_cache_close(c);
    damage_row_and_index(path, recs[0].r.fingerprint);

    /* The bad row is a miss, and a put of it says it did not store. */
    c = open_ok(path, 0);
    assert_int_equal(lookup(c, recs[0].r.fingerprint, recs[0].cubin, SIZE, "the damaged row"), 0);
    kiln_status st = kiln_cache_put(c, &recs[0].r);
    printf("put over a corrupt row that cannot be dropped: %s: %s\n", kiln_status_code(st), kiln_cache_errmsg(c));
    kiln_test_expect(st, KILN_ERR_CACHE_CORRUPT, kiln_cache_errmsg(c), "kiln verify", "kiln merge");
    expect_clear_error(st, kiln_cache_errmsg(c), path, "a put over a corrupt row");
    assert_int_equal(lookup(c, recs[1].r.fingerprint, recs[1].cubin, SIZE, "a good row beside it"), 1);
    kiln_cache_close(c);

    /* Through the jit, as prewarm stores: prepare fails and names the damage. */
    damage_row_and_index(path, reals[0].fp);
    c = open_ok(path, 0);
    kiln_jit *j = new_jit(c);
    int compiled = 0;
    st = kiln_jit_prepare(j, &reals[0].spec, &compiled);
    printf("jit prepare over a corrupt row that cannot be dropped: %s: %s\n", kiln_status_code(st),
           kiln_jit_errmsg(j));
    kiln_test_expect(st, KILN_ERR_CACHE_CORRUPT, kiln_jit_errmsg(j), "kiln verify", path);
    assert_int_equal(compiled, 1);
    kiln_jit_destroy(j);
    kiln_cache_close(c);
    for (int i = 0; i < N; i++)
        free(recs[i].cubin);
    free_reals(reals, 1);
}

/* ---- keys swapped between two rows ---- */

typedef struct seen_events {
    int n;
    char detail[512];
} seen_events;

static void on_corrupt(void *user, const kiln_cache_event *ev)
{
    seen_events *s = user;
    s->n++;
    snprintf(s->detail, sizeof s->detail, "%s", ev->detail);
}

/* The NVRTC version of the first row, into the record user. */
static int first_nvrtc(void *user, const kiln_cache_entry_info *info)
{
    kiln_cache_record *r = user;
    r->nvrtc_major = info->nvrtc_major;
    r->nvrtc_minor = info->nvrtc_minor;
    return 1;
}

/* Swaps the fingerprints of rows a and b, as a careless tool could. */
static void swap_keys(const char *path, const uint8_t *a, const uint8_t *b)
{
    sqlite3 *db;
    static const uint8_t spare[KILN_FINGERPRINT_SIZE];
    const uint8_t *steps[3][2] = {{a, spare}, {b, a}, {spare, b}};
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    for (int i = 0; i < 3; i++) {
        sqlite3_stmt *q;
        assert_int_equal(sqlite3_prepare_v2(db, "UPDATE kernels SET fingerprint = ?2 WHERE fingerprint = ?1", -1, &q,
                                            NULL),
                         SQLITE_OK);
        sqlite3_bind_blob(q, 1, steps[i][0], KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
        sqlite3_bind_blob(q, 2, steps[i][1], KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
        assert_int_equal(sqlite3_step(q), SQLITE_DONE);
        assert_int_equal(sqlite3_changes(db), 1);
        sqlite3_finalize(q);
    }
    sqlite3_close(db);
}

/* A row's checksum covers its cubin, not the key it is filed under: a key
 * moved onto another kernel's row must not load that kernel. The jit checks
 * the row is of the kernel it asked for, drops it as corrupt (a read-only
 * layer's is skipped), compiles and stores the right one; a put replaces it. */
static void test_swapped_keys_are_corrupt(void **state)
{
    fixture *f = *state;
    real reals[2];
    make_reals(reals, 2, 1000);
    char path[700], layer[700], main_db[700];
    snprintf(path, sizeof path, "%s/swapped.db", f->dir);
    snprintf(layer, sizeof layer, "%s/swapped-layer.db", f->dir);
    snprintf(main_db, sizeof main_db, "%s/main.db", f->dir);
    kiln_cache *c = open_ok(path, 0);
    for (int i = 0; i < 2; i++)
        KILN_CHECK(prepare_real(c, &reals[i], "building the database"));
    kiln_cache_close(c);
    swap_keys(path, reals[0].fp, reals[1].fp);
    sql(path, "PRAGMA journal_mode=DELETE");
    size_t n = 0;
    uint8_t *bytes = read_bytes(path, &n);
    write_bytes(layer, bytes, n);
    free(bytes);

    /* The writable database: each row is dropped, and the kernel compiled and stored. */
    seen_events ev = {0};
    kiln_cache_options o = {.path = path, .ignore_env = 1, .on_event = on_corrupt, .user = &ev};
    KILN_CHECK(kiln_cache_open(&o, &c));
    kiln_jit *j = new_jit(c);
    for (int i = 0; i < 2; i++) {
        int compiled = 0;
        KILN_CHECK(kiln_jit_prepare(j, &reals[i].spec, &compiled));
        if (!compiled || ev.n != i + 1)
            fail_msg("kernel %d under a swapped key: compiled %d, %d events: the other kernel's row was taken", i,
                     compiled, ev.n);
        kiln_test_expect(KILN_ERR_CACHE_CORRUPT, KILN_ERR_CACHE_CORRUPT, ev.detail, "another kernel", "constants");
        assert_int_equal(lookup(c, reals[i].fp, reals[i].cubin, reals[i].size, "a row stored over a swapped key"), 1);
    }
    kiln_jit_counters jc;
    kiln_jit_get_counters(j, &jc);
    assert_int_equal(jc.corrupt_dropped, 2);
    assert_int_equal(jc.compiles, 2);
    kiln_jit_destroy(j);
    kiln_cache_counters cc;
    kiln_cache_get_counters(c, &cc);
    assert_int_equal(cc.corrupt_dropped, 2);
    kiln_cache_close(c);

    /* A read-only layer: the rows are skipped and left, the kernels stored in the writable one. */
    const char *layers[] = {layer};
    ev.n = 0;
    kiln_cache_options lo = {.path = main_db, .readonly_paths = layers, .n_readonly_paths = 1, .ignore_env = 1,
                             .on_event = on_corrupt, .user = &ev};
    KILN_CHECK(kiln_cache_open(&lo, &c));
    j = new_jit(c);
    for (int i = 0; i < 2; i++) {
        int compiled = 0;
        KILN_CHECK(kiln_jit_prepare(j, &reals[i].spec, &compiled));
        assert_int_equal(compiled, 1);
    }
    assert_int_equal(ev.n, 2);
    kiln_test_expect(KILN_ERR_CACHE_CORRUPT, KILN_ERR_CACHE_CORRUPT, kiln_cache_errmsg(c), layer, "read-only layer");
    kiln_jit_destroy(j);
    kiln_cache_close(c);

    /* A put over a swapped key replaces the row it finds there. */
    swap_keys(path, reals[0].fp, reals[1].fp);
    c = open_ok(path, 0);
    char consts[256];
    KILN_CHECK(kiln_spec_constants_text(&reals[0].spec, consts, sizeof consts));
    kiln_cache_record r = {.template_id = reals[0].spec.template_id, .constants = consts, .arch = "sm_90",
                           .entries = "kiln_token_embedding", .cubin = reals[0].cubin, .cubin_size = reals[0].size};
    memcpy(r.fingerprint, reals[0].fp, KILN_FINGERPRINT_SIZE);
    KILN_CHECK(kiln_cache_foreach(c, first_nvrtc, &r));
    KILN_CHECK(kiln_cache_put(c, &r));
    assert_int_equal(lookup(c, reals[0].fp, reals[0].cubin, reals[0].size, "a put over a swapped key"), 1);
    kiln_cache_close(c);
    free_reals(reals, 2);
}

/* ---- gc on a full disk ---- */

/* Mounts a tmpfs of kib KiB on f->mnt; 0 when this process may not mount. */
static int mount_small_disk(fixture *f, unsigned kib)
{
    char opt[32];
    snprintf(f->mnt, sizeof f->mnt, "%s/small-disk", f->dir);
    snprintf(opt, sizeof opt, "size=%uk", kib);
    assert_int_equal(mkdir(f->mnt, 0755), 0);
    if (mount("tmpfs", f->mnt, "tmpfs", MS_NOSUID | MS_NODEV, opt) != 0) {
        printf("SKIP: cannot mount a %u KiB tmpfs on %s: %s\n", kib, f->mnt, strerror(errno));
        return 0;
    }
    f->mounted = 1;
    return 1;
}

/* Fills the filesystem of dir with a file dir/filler until leave bytes are free. */
static void fill_disk(const char *dir, size_t leave)
{
    char filler[800];
    snprintf(filler, sizeof filler, "%s/filler", dir);
    static uint8_t block[4096];
    memset(block, 0x5a, sizeof block);
    FILE *fp = fopen(filler, "wb");
    assert_non_null(fp);
    setvbuf(fp, NULL, _IONBF, 0);
    size_t written = 0;
    while (fwrite(block, 1, sizeof block, fp) == sizeof block)
        written += sizeof block;
    fclose(fp);
    assert_true(written > leave);
    assert_int_equal(truncate(filler, (off_t)(written - leave)), 0);
}

/* The database f->mnt/kernels.db (its path in path) with n random rows of
 * size bytes, closed: the last connection checkpoints the rows into the file. */
static void small_db(fixture *f, char *path, size_t cap, rec *recs, int n, size_t size)
{
    snprintf(path, cap, "%s/kernels.db", f->mnt);
    kiln_cache *c = open_ok(path, 0);
    for (int i = 0; i < n; i++) {
        make_rec(&f->rng, &recs[i], size);
        KILN_CHECK(kiln_cache_put(c, &recs[i].r));
    }
    kiln_cache_close(c);
}

static void test_gc_on_a_full_disk(void **state)
{
    fixture *f = *state;
    enum { SIZE = 30000, N = 20, LEAVE = 40 << 10 };
    if (!mount_small_disk(f, 2048))
        skip();
    char path[700];
    rec recs[N], again;
    small_db(f, path, sizeof path, recs, N, SIZE);
    fill_disk(f->mnt, LEAVE);

    /* Full: a row does not fit. */
    kiln_cache *c = open_ok(path, 0);
    make_rec(&f->rng, &again, SIZE);
    kiln_status st = kiln_cache_put(c, &again.r);
    printf("put on a disk with %d KiB free: %s: %s\n", LEAVE >> 10, kiln_status_code(st), kiln_cache_errmsg(c));
    assert_int_equal(st, KILN_ERR_CACHE_IO);

    /* gc, the documented remedy, frees room for it, and the file shrinks. */
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    off_t before = sb.st_size;
    kiln_cache_gc_options go = {.size = sizeof go, .max_bytes = (uint64_t)N * SIZE / 3};
    uint64_t rows = 0, bytes = 0;
    st = kiln_cache_gc(c, &go, &rows, &bytes);
    assert_int_equal(stat(path, &sb), 0);
    printf("gc on a full disk: %s: %s; %llu rows, %llu bytes; the file %lld -> %lld bytes\n", kiln_status_code(st),
           st ? kiln_cache_errmsg(c) : "", (unsigned long long)rows, (unsigned long long)bytes, (long long)before,
           (long long)sb.st_size);
    KILN_CHECK(st);
    assert_true(rows >= N / 2);
    assert_true(sb.st_size < before / 2);
    KILN_CHECK(kiln_cache_put(c, &again.r));
    assert_int_equal(lookup(c, again.r.fingerprint, again.cubin, SIZE, "a row stored after gc on a full disk"), 1);
    for (int i = 0; i < N; i++)
        assert_true(lookup(c, recs[i].r.fingerprint, recs[i].cubin, SIZE, "a row gc left or removed") >= 0);
    kiln_cache_verify_report vr;
    KILN_CHECK(kiln_cache_verify(c, NULL, NULL, &vr));
    assert_true(vr.integrity_ok);
    assert_int_equal(vr.bad_rows, 0);
    assert_int_equal(vr.rows, N - rows + 1);
    kiln_cache_close(c);
    /* A later process stores too: its WAL cannot grow, the freed pages take the row. */
    c = open_ok(path, 0);
    rec later;
    make_rec(&f->rng, &later, SIZE);
    KILN_CHECK(kiln_cache_put(c, &later.r));
    assert_int_equal(lookup(c, later.r.fingerprint, later.cubin, SIZE, "a row stored by a later process"), 1);
    kiln_cache_close(c);
    free(later.cubin);
    free(again.cubin);
    for (int i = 0; i < N; i++)
        free(recs[i].cubin);
    assert_int_equal(umount2(f->mnt, MNT_DETACH), 0);
    f->mounted = 0;
}

/* A database made without auto_vacuum on a full disk: gc deletes the rows,
 * and says that the file could not shrink (VACUUM needs room) and what to do. */
static void test_gc_on_a_full_disk_without_auto_vacuum(void **state)
{
    fixture *f = *state;
    enum { SIZE = 30000, N = 20, LEAVE = 40 << 10 };
    if (!mount_small_disk(f, 2048))
        skip();
    char path[700];
    rec recs[N], again;
    small_db(f, path, sizeof path, recs, N, SIZE);
    sql(path, "PRAGMA journal_mode=DELETE;PRAGMA auto_vacuum=NONE;VACUUM");
    fill_disk(f->mnt, LEAVE);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    off_t before = sb.st_size;
    kiln_cache *c = open_ok(path, 0);
    kiln_cache_gc_options go = {.size = sizeof go, .max_bytes = (uint64_t)N * SIZE / 3};
    uint64_t rows = 0, bytes = 0;
    kiln_status st = kiln_cache_gc(c, &go, &rows, &bytes);
    printf("gc on a full disk, no auto_vacuum: %s: %s; %llu rows, %llu bytes\n", kiln_status_code(st),
           kiln_cache_errmsg(c), (unsigned long long)rows, (unsigned long long)bytes);
    kiln_test_expect(st, KILN_ERR_CACHE_IO, kiln_cache_errmsg(c), path, "could not shrink");
    kiln_test_expect(st, KILN_ERR_CACHE_IO, kiln_cache_errmsg(c), "gc removed", "kiln merge");
    assert_true(rows >= N / 2);
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_size, before);
    /* The rows are gone, and their pages take new ones. */
    kiln_cache_verify_report vr;
    KILN_CHECK(kiln_cache_verify(c, NULL, NULL, &vr));
    assert_true(vr.integrity_ok);
    assert_int_equal(vr.rows, N - rows);
    make_rec(&f->rng, &again, SIZE);
    KILN_CHECK(kiln_cache_put(c, &again.r));
    assert_int_equal(lookup(c, again.r.fingerprint, again.cubin, SIZE, "a row stored after gc"), 1);
    /* The remedy: with room again, a gc that removes nothing shrinks the file. */
    char filler[800];
    snprintf(filler, sizeof filler, "%s/filler", f->mnt);
    assert_int_equal(unlink(filler), 0);
    go.max_bytes = (uint64_t)N * SIZE;
    KILN_CHECK(kiln_cache_gc(c, &go, &rows, &bytes));
    assert_int_equal(rows, 0);
    assert_int_equal(stat(path, &sb), 0);
    printf("gc again with room: the file %lld -> %lld bytes\n", (long long)before, (long long)sb.st_size);
    assert_true(sb.st_size < before * 3 / 4);
    kiln_cache_close(c);
    free(again.cubin);
    for (int i = 0; i < N; i++)
        free(recs[i].cubin);
    assert_int_equal(umount2(f->mnt, MNT_DETACH), 0);
    f->mounted = 0;
}

int main(void)
{
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(test_random_file_is_refused_and_left_alone),
        T(test_truncated_database),
        T(test_newer_schema_is_refused_and_left_alone),
        T(test_unwritable_locations_fail_clearly),
        T(test_read_only_folder),
        T(test_full_disk),
        T(test_locked_past_the_busy_timeout_wal),
        T(test_locked_past_the_busy_timeout_rollback_journal),
        T(test_refused_files_are_not_modified_first),
        T(test_paths_that_are_not_regular_files),
        T(test_symbolic_links),
        T(test_one_deadline_for_the_whole_open),
        T(test_put_over_a_corrupt_row_that_cannot_be_dropped),
        T(test_swapped_keys_are_corrupt),
        T(test_gc_on_a_full_disk),
        T(test_gc_on_a_full_disk_without_auto_vacuum),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
