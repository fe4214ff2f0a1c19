/* `kiln prewarm` killed with SIGKILL in the middle: the database it leaves
 * passes verification, every row in it is the cubin a full prewarm stores,
 * and prewarm run again completes it, compiling exactly what is missing.
 *
 * The CLI's path comes from CMake (KILN_CLI). Kills land at fixed delays and
 * at fractions of the time a whole prewarm takes on this machine, so that
 * some land while kernels are being stored whatever the speed (ASan, CI).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>

#include "testutil.h"

#ifndef KILN_CLI
#error "KILN_CLI (the path of the kiln command-line tool) must be defined by the build"
#endif

typedef struct fixture {
    char dir[512];
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    /* A default path must never be the user's own cache. */
    char env[600];
    snprintf(env, sizeof env, "%s/default-cache-unused", f->dir);
    setenv("KILN_CACHE_DIR", env, 1);
    unsetenv("KILN_CACHE_READONLY");
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

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Starts KILN_CLI with args (NULL-terminated), stdout and stderr into files. */
static pid_t spawn(const char *out, const char *err, const char *const *args)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644), e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0)
            _exit(126);
        char *argv[16];
        int n = 0;
        argv[n++] = (char *)KILN_CLI;
        for (; args[n - 1] && n < 15; n++)
            argv[n] = (char *)args[n - 1];
        argv[n] = NULL;
        execv(KILN_CLI, argv);
        _exit(127);
    }
    return pid;
}

static char *slurp(const char *path)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return strdup("");
    char *buf = calloc(1, 1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, fp);
    buf[n] = 0;
    fclose(fp);
    return buf;
}

typedef struct outcome {
    int status; /* as waitpid gives it */
    char *out, *err;
} outcome;

static void outcome_free(outcome *o)
{
    free(o->out);
    free(o->err);
}

/* Runs the CLI to the end. */
static outcome run_cli(const fixture *f, const char *const *args)
{
    char out[700], err[700];
    snprintf(out, sizeof out, "%s/stdout", f->dir);
    snprintf(err, sizeof err, "%s/stderr", f->dir);
    pid_t pid = spawn(out, err, args);
    outcome o = {0};
    assert_int_equal(waitpid(pid, &o.status, 0), pid);
    o.out = slurp(out);
    o.err = slurp(err);
    if (strstr(o.err, "Sanitizer") || strstr(o.err, "runtime error:"))
        fail_msg("sanitizer report from %s %s:\n%s", KILN_CLI, args[0], o.err);
    return o;
}

static void expect_exit(const outcome *o, int want, const char *what)
{
    if (!WIFEXITED(o->status) || WEXITSTATUS(o->status) != want)
        fail_msg("%s: status 0x%x, expected exit %d\n--- stdout:\n%.4000s\n--- stderr:\n%.4000s", what, o->status,
                 want, o->out, o->err);
}

typedef struct summary {
    int specs, compiled, cached, failed;
} summary;

/* Parses "summary: model ... arch A: N specializations, C compiled, R already cached, F failed, ...". */
static summary parse_summary(const outcome *o)
{
    const char *line = strstr(o->out, "summary: ");
    if (!line)
        fail_msg("no summary line in prewarm's output:\n%.4000s", o->out);
    const char *arch = strstr(line, ", arch ");
    const char *colon = arch ? strstr(arch, ": ") : NULL;
    summary s;
    if (!colon || sscanf(colon + 2, "%d specializations, %d compiled, %d already cached, %d failed", &s.specs,
                         &s.compiled, &s.cached, &s.failed) != 4)
        fail_msg("summary line not in the documented format:\n%.2000s", line);
    return s;
}

static int cli_has(const fixture *f, const char *command)
{
    const char *args[] = {command, "--help", NULL};
    outcome o = run_cli(f, args);
    int yes = WIFEXITED(o.status) && WEXITSTATUS(o.status) == 0;
    outcome_free(&o);
    return yes;
}

static int64_t sql_int(sqlite3 *db, const char *text)
{
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db, text, -1, &q, NULL) != SQLITE_OK)
        fail_msg("%s: %s", text, sqlite3_errmsg(db));
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    int64_t v = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    return v;
}

static void on_bad_row(void *user, const uint8_t fp[KILN_FINGERPRINT_SIZE], const char *detail)
{
    const char *what = user;
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fp, hex);
    fail_msg("%s: kiln_cache_verify: row %s is bad: %s", what, hex, detail);
}

typedef struct fp_list {
    int n;
    uint8_t fp[64][KILN_FINGERPRINT_SIZE];
} fp_list;

static int collect(void *user, const kiln_cache_entry_info *info)
{
    fp_list *l = user;
    if (l->n < 64)
        memcpy(l->fp[l->n], info->fingerprint, KILN_FINGERPRINT_SIZE);
    l->n++;
    return 0;
}

/* Each row must load (a load verifies size and checksum) as the bytes a whole prewarm stored. */
static void expect_reference_rows(kiln_cache *c, kiln_cache *ref, const fp_list *rows, const char *what)
{
    for (int i = 0; i < rows->n && i < 64; i++) {
        void *got = NULL, *want = NULL;
        size_t got_size = 0, want_size = 0;
        int found = 0;
        char hex[2 * KILN_FINGERPRINT_SIZE + 1];
        kiln_fingerprint_hex(rows->fp[i], hex);
        KILN_CHECK(kiln_cache_get(ref, rows->fp[i], &want, &want_size, &found));
        if (!found)
            fail_msg("%s: row %s is not one a whole prewarm stores", what, hex);
        KILN_CHECK(kiln_cache_get(c, rows->fp[i], &got, &got_size, &found));
        if (!found)
            fail_msg("%s: row %s is listed but does not load", what, hex);
        if (got_size != want_size || memcmp(got, want, got_size) != 0)
            fail_msg("%s: row %s holds %zu bytes unlike the reference's %zu", what, hex, got_size, want_size);
        kiln_free(got);
        kiln_free(want);
    }
}

/* The database a killed prewarm left: whole, verified, rows right. Returns its row count. */
static int check_left_database(const fixture *f, const char *db_path, kiln_cache *ref, int n_specs, int has_verify,
                               const char *what)
{
    sqlite3 *db;
    assert_int_equal(sqlite3_open_v2(db_path, &db, SQLITE_OPEN_READWRITE, NULL), SQLITE_OK);
    sqlite3_busy_timeout(db, 10000);
    sqlite3_stmt *q;
    assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &q, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    if (strcmp((const char *)sqlite3_column_text(q, 0), "ok") != 0)
        fail_msg("%s: integrity_check: %s", what, sqlite3_column_text(q, 0));
    sqlite3_finalize(q);
    /* A kill before the schema was committed leaves a file without the table. */
    int has_table = sql_int(db, "SELECT count(*) FROM sqlite_master WHERE name = 'kernels'") == 1;
    sqlite3_close(db);
    if (!has_table)
        return 0;

    kiln_cache_options co = {.path = db_path, .ignore_env = 1};
    kiln_cache *c;
    KILN_CHECK(kiln_cache_open(&co, &c));
    kiln_cache_verify_report vr;
    KILN_CHECK(kiln_cache_verify(c, on_bad_row, (void *)what, &vr));
    if (!vr.integrity_ok || vr.bad_rows)
        fail_msg("%s: kiln_cache_verify: integrity %d, %llu bad rows", what, vr.integrity_ok,
                 (unsigned long long)vr.bad_rows);
    fp_list rows = {0};
    KILN_CHECK(kiln_cache_foreach(c, collect, &rows));
    assert_int_equal((uint64_t)rows.n, vr.rows);
    assert_true(rows.n <= n_specs);
    expect_reference_rows(c, ref, &rows, what);
    kiln_cache_counters cc;
    kiln_cache_get_counters(c, &cc);
    assert_int_equal(cc.corrupt_dropped, 0);
    kiln_cache_close(c);

    const char *ls[] = {"ls", "--db", db_path, NULL};
    outcome o = run_cli(f, ls);
    expect_exit(&o, 0, "kiln ls on the database a killed prewarm left");
    outcome_free(&o);
    if (has_verify) {
        const char *verify[] = {"verify", "--db", db_path, NULL};
        o = run_cli(f, verify);
        expect_exit(&o, 0, "kiln verify on the database a killed prewarm left");
        outcome_free(&o);
    }
    return rows.n;
}

static void test_prewarm_killed_then_completed(void **state)
{
    fixture *f = *state;
    int has_verify = cli_has(f, "verify");
    printf("kiln verify: %s\n", has_verify ? "present, used" : "absent, checked through the library only");

    /* A whole prewarm: the reference rows, and how long one takes here. */
    char ref_path[700];
    snprintf(ref_path, sizeof ref_path, "%s/reference/kernels.db", f->dir);
    const char *whole[] = {"prewarm", "--db", ref_path, "-j", "2", NULL};
    double t0 = now_s();
    outcome o = run_cli(f, whole);
    double full_s = now_s() - t0;
    expect_exit(&o, 0, "a whole prewarm");
    summary ref = parse_summary(&o);
    outcome_free(&o);
    assert_true(ref.specs >= 2);
    assert_int_equal(ref.compiled, ref.specs);
    assert_int_equal(ref.failed, 0);
    printf("a whole prewarm: %d specializations in %.2f s\n", ref.specs, full_s);
    kiln_cache_options ro = {.path = ref_path, .read_only = 1, .ignore_env = 1};
    kiln_cache *ref_cache;
    KILN_CHECK(kiln_cache_open(&ro, &ref_cache));

    double delays[] = {0.05, 0.15, 0.30, full_s * 0.25, full_s * 0.45, full_s * 0.65, full_s * 0.85};
    int killed = 0, partial = 0;
    for (size_t i = 0; i < sizeof delays / sizeof *delays; i++) {
        char dir[700], db_path[800], out[800], err[800], what[900];
        snprintf(dir, sizeof dir, "%s/kill-%zu", f->dir, i);
        snprintf(db_path, sizeof db_path, "%s/kernels.db", dir);
        snprintf(out, sizeof out, "%s/kill-%zu.out", f->dir, i);
        snprintf(err, sizeof err, "%s/kill-%zu.err", f->dir, i);
        const char *args[] = {"prewarm", "--db", db_path, "-j", "2", NULL};
        pid_t pid = spawn(out, err, args);
        usleep((useconds_t)(delays[i] * 1e6));
        kill(pid, SIGKILL);
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        int was_killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
        if (!was_killed && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
            fail_msg("prewarm before the kill at %.3f s ended with status 0x%x", delays[i], status);
        killed += was_killed;
        snprintf(what, sizeof what, "prewarm killed after %.3f s", delays[i]);

        int rows = 0;
        if (access(db_path, F_OK) == 0)
            rows = check_left_database(f, db_path, ref_cache, ref.specs, has_verify, what);
        partial += rows > 0 && rows < ref.specs;

        /* Again, to the end: what is there is kept, what is missing is compiled. */
        o = run_cli(f, args);
        expect_exit(&o, 0, "prewarm after a killed one");
        summary s = parse_summary(&o);
        outcome_free(&o);
        printf("%s: %s, %d of %d rows left; prewarm again: %d compiled, %d cached\n", what,
               was_killed ? "killed" : "had finished", rows, ref.specs, s.compiled, s.cached);
        assert_int_equal(s.specs, ref.specs);
        assert_int_equal(s.failed, 0);
        assert_int_equal(s.compiled + s.cached, ref.specs);
        assert_int_equal(s.cached, rows);
        assert_int_equal(check_left_database(f, db_path, ref_cache, ref.specs, has_verify, "the completed prewarm"),
                         ref.specs);
    }
    kiln_cache_close(ref_cache);
    printf("%d of %zu prewarms killed, %d of them between the first and the last row\n", killed,
           sizeof delays / sizeof *delays, partial);
    assert_true(killed > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_prewarm_killed_then_completed, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
