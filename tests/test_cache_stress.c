/* Many processes and threads on one writable database: 8 processes of 4
 * threads each prepare (what prewarm does) and look up an overlapping set of
 * small specializations, all at once, on one file that none of them created
 * beforehand. No call may fail, no row may be lost or duplicated, a process
 * compiles each key at most once, and every lookup of a key, in any process,
 * returns the same bytes: the row that ended up in the file.
 *
 * Children report through a pipe (a fixed-size record, written in one atomic
 * write) and their exit status. KILN_STRESS_PROCS / KILN_STRESS_THREADS /
 * KILN_STRESS_PASSES scale the run by hand.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>

#include "testutil.h"

#define N_SPECS 12
#define MAX_PROCS 32
#define MAX_THREADS 16
#define DEADLINE_S 240 /* a hung child fails the test instead of reaching CTest's timeout */

typedef struct fixture {
    char dir[512];
    char path[600];
    kiln_spec specs[N_SPECS];
    uint8_t fps[N_SPECS][KILN_FINGERPRINT_SIZE];
    uint64_t seed;
    int procs, threads, passes;
} fixture;

/* What a child sends back: under PIPE_BUF, so one write() is atomic. */
typedef struct child_report {
    int failures;
    char first_error[1024];
    kiln_jit_counters jit;
    kiln_cache_counters cache;
    uint64_t lookups;
    /* What this process saw for each key: size and FNV-1a of the bytes (0: never seen). */
    uint64_t size[N_SPECS], hash[N_SPECS];
    /* How many prepares of each key said they compiled it. */
    uint32_t compiled[N_SPECS];
} child_report;

_Static_assert(sizeof(child_report) <= 4096, "a report must fit one atomic pipe write");

static int env_int(const char *name, int def, int lo, int hi)
{
    const char *v = getenv(name);
    int n = v ? atoi(v) : def;
    return n < lo ? lo : n > hi ? hi : n;
}

static uint64_t fnv1a(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h | 1; /* never 0, which means "not seen" */
}

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(f->path, sizeof f->path, "%s/db/kernels.db", f->dir);
    /* Small token embeddings: each compiles in well under a second. */
    static const int64_t hidden[] = {64, 128, 192, 256};
    static const int64_t vocab[] = {1000, 2000, 3000};
    for (int i = 0; i < N_SPECS; i++)
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, vocab[i % 3], hidden[i / 3], 8, &f->specs[i]));
    kiln_rng r = kiln_rng_new();
    f->seed = kiln_rng_next(&r);
    f->procs = env_int("KILN_STRESS_PROCS", 8, 1, MAX_PROCS);
    f->threads = env_int("KILN_STRESS_THREADS", 4, 1, MAX_THREADS);
    f->passes = env_int("KILN_STRESS_PASSES", 3, 1, 100);
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

/* ---- a child process ---- */

typedef struct child {
    const fixture *f;
    kiln_cache *cache;
    kiln_jit *jit;
    pthread_barrier_t start;
    pthread_mutex_t lock; /* guards report */
    child_report report;
} child;

typedef struct worker {
    child *c;
    kiln_rng rng;
} worker;

static void child_fail(child *c, const char *fmt, ...)
{
    va_list ap;
    pthread_mutex_lock(&c->lock);
    if (!c->report.failures++) {
        va_start(ap, fmt);
        vsnprintf(c->report.first_error, sizeof c->report.first_error, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&c->lock);
}

/* Records what a lookup returned; every lookup of a key must see the same bytes. */
static void child_saw(child *c, int k, const void *cubin, size_t size)
{
    uint64_t h = fnv1a(cubin, size);
    pthread_mutex_lock(&c->lock);
    c->report.lookups++;
    if (!c->report.hash[k]) {
        c->report.hash[k] = h;
        c->report.size[k] = size;
    }
    int same = c->report.hash[k] == h && c->report.size[k] == size;
    pthread_mutex_unlock(&c->lock);
    if (!same)
        child_fail(c, "key %d: a lookup returned %zu bytes (hash %016llx), an earlier one %llu bytes", k, size,
                   (unsigned long long)h, (unsigned long long)c->report.size[k]);
    if (size < 4 || memcmp(cubin, "\x7f" "ELF", 4) != 0)
        child_fail(c, "key %d: a lookup returned %zu bytes that are not an ELF cubin", k, size);
}

static void *work(void *arg)
{
    worker *w = arg;
    child *c = w->c;
    const fixture *f = c->f;
    int order[N_SPECS];
    pthread_barrier_wait(&c->start);
    for (int pass = 0; pass < f->passes; pass++) {
        for (int i = 0; i < N_SPECS; i++)
            order[i] = i;
        for (int i = N_SPECS - 1; i > 0; i--) {
            int j = (int)kiln_rng_below(&w->rng, (uint32_t)i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (int i = 0; i < N_SPECS; i++) {
            int k = order[i];
            uint8_t fp[KILN_FINGERPRINT_SIZE];
            void *cubin = NULL;
            size_t size = 0;
            int found = 0, compiled = 0;
            kiln_status st;
            /* Look before preparing now and then: a miss or a hit, never an error. */
            if (kiln_rng_below(&w->rng, 2)) {
                st = kiln_cache_get(c->cache, f->fps[k], &cubin, &size, &found);
                if (st)
                    child_fail(c, "kiln_cache_get before prepare, key %d: %s: %s", k, kiln_status_code(st),
                               kiln_errmsg());
                else if (found)
                    child_saw(c, k, cubin, size);
                kiln_free(cubin);
                cubin = NULL;
            }
            /* A key nobody stores: a miss, never an error. */
            if (!kiln_rng_below(&w->rng, 4)) {
                uint8_t none[KILN_FINGERPRINT_SIZE];
                kiln_rng_fill(&w->rng, none, sizeof none);
                st = kiln_cache_get(c->cache, none, &cubin, &size, &found);
                if (st || found)
                    child_fail(c, "kiln_cache_get of an absent key: %s, found %d: %s", kiln_status_code(st), found,
                               kiln_errmsg());
                kiln_free(cubin);
                cubin = NULL;
            }
            st = kiln_jit_prepare(c->jit, &f->specs[k], &compiled);
            if (st) {
                child_fail(c, "kiln_jit_prepare key %d: %s: %s", k, kiln_status_code(st), kiln_errmsg());
                continue;
            }
            if (compiled) {
                pthread_mutex_lock(&c->lock);
                c->report.compiled[k]++;
                pthread_mutex_unlock(&c->lock);
            }
            if ((st = kiln_jit_fingerprint(c->jit, &f->specs[k], fp)) || memcmp(fp, f->fps[k], sizeof fp)) {
                child_fail(c, "key %d: the fingerprint differs from the parent's", k);
                continue;
            }
            /* Prepared means in the database: a lookup must find it, whole. */
            st = kiln_cache_get(c->cache, fp, &cubin, &size, &found);
            if (st)
                child_fail(c, "kiln_cache_get after prepare, key %d: %s: %s", k, kiln_status_code(st),
                           kiln_errmsg());
            else if (!found)
                child_fail(c, "key %d: prepared, yet kiln_cache_get misses", k);
            else
                child_saw(c, k, cubin, size);
            kiln_free(cubin);
            if ((st = kiln_cache_contains(c->cache, fp, &found)) || !found)
                child_fail(c, "kiln_cache_contains key %d: %s, found %d", k, kiln_status_code(st), found);
        }
    }
    return NULL;
}

static void run_child(const fixture *f, int index, int go_fd, int report_fd)
{
    child *c = calloc(1, sizeof *c);
    if (!c)
        _exit(3);
    c->f = f;
    pthread_mutex_init(&c->lock, NULL);
    /* Wait until every sibling exists, so that they all open the new file together. */
    char b;
    while (read(go_fd, &b, 1) < 0 && errno == EINTR) {
    }
    close(go_fd);
    kiln_cache_options co = {.path = f->path};
    kiln_status st = kiln_cache_open(&co, &c->cache);
    if (st) {
        child_fail(c, "kiln_cache_open: %s: %s", kiln_status_code(st), kiln_errmsg());
    } else {
        kiln_jit_options jo = {.cache = c->cache, .arch = "sm_90"};
        if ((st = kiln_jit_create(&jo, &c->jit)))
            child_fail(c, "kiln_jit_create: %s: %s", kiln_status_code(st), kiln_errmsg());
    }
    if (!st) {
        pthread_t th[MAX_THREADS];
        worker ws[MAX_THREADS];
        pthread_barrier_init(&c->start, NULL, (unsigned)f->threads);
        for (int t = 0; t < f->threads; t++) {
            ws[t] = (worker){.c = c, .rng = {f->seed + 1000003u * (uint64_t)index + 7919u * (uint64_t)t + 1}};
            if (pthread_create(&th[t], NULL, work, &ws[t]) != 0)
                _exit(4); /* the barrier would never open */
        }
        for (int t = 0; t < f->threads; t++)
            pthread_join(th[t], NULL);
        pthread_barrier_destroy(&c->start);
        kiln_jit_get_counters(c->jit, &c->report.jit);
        kiln_cache_get_counters(c->cache, &c->report.cache);
    }
    kiln_jit_destroy(c->jit);
    kiln_cache_close(c->cache);
    int failed = c->report.failures != 0;
    ssize_t w = write(report_fd, &c->report, sizeof c->report);
    close(report_fd);
    pthread_mutex_destroy(&c->lock);
    free(c);
    /* exit (not _exit) so that LeakSanitizer looks at the child too. */
    exit(w != (ssize_t)sizeof(child_report) ? 5 : failed ? 1 : 0);
}

/* ---- the parent ---- */

/* Forks procs children, lets them go at once, and collects their reports. */
static void run_round(fixture *f, child_report *reports, double *seconds)
{
    pid_t pids[MAX_PROCS];
    int fds[MAX_PROCS];
    int go[2];
    assert_int_equal(pipe(go), 0);
    fflush(NULL);
    for (int p = 0; p < f->procs; p++) {
        int rep[2];
        assert_int_equal(pipe(rep), 0);
        pids[p] = fork();
        assert_true(pids[p] >= 0);
        if (pids[p] == 0) {
            close(go[1]);
            close(rep[0]);
            for (int q = 0; q < p; q++)
                close(fds[q]);
            run_child(f, p, go[0], rep[1]);
        }
        close(rep[1]);
        fds[p] = rep[0];
    }
    close(go[0]);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    close(go[1]); /* every child's read() returns now */

    int status[MAX_PROCS], done = 0;
    for (int p = 0; p < f->procs; p++)
        status[p] = -1;
    while (done < f->procs) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (t1.tv_sec - t0.tv_sec > DEADLINE_S) {
            for (int p = 0; p < f->procs; p++)
                if (status[p] == -1)
                    kill(pids[p], SIGKILL);
            fail_msg("children still running after %d s: a deadlock or a lost busy timeout", DEADLINE_S);
        }
        for (int p = 0; p < f->procs; p++) {
            if (status[p] != -1)
                continue;
            pid_t r = waitpid(pids[p], &status[p], WNOHANG);
            if (r == 0)
                status[p] = -1;
            else
                done++;
        }
        usleep(20 * 1000);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;

    for (int p = 0; p < f->procs; p++) {
        memset(&reports[p], 0, sizeof reports[p]);
        ssize_t n = read(fds[p], &reports[p], sizeof reports[p]);
        close(fds[p]);
        if (!WIFEXITED(status[p]))
            fail_msg("child %d died of signal %d", p, WIFSIGNALED(status[p]) ? WTERMSIG(status[p]) : -1);
        if (n != (ssize_t)sizeof reports[p])
            fail_msg("child %d exited %d without a whole report (%zd bytes)", p, WEXITSTATUS(status[p]), n);
        if (reports[p].failures)
            fail_msg("child %d: %d failed checks, the first: %s", p, reports[p].failures, reports[p].first_error);
        if (WEXITSTATUS(status[p]) != 0)
            fail_msg("child %d exited %d", p, WEXITSTATUS(status[p]));
    }
}

typedef struct row_list {
    int n;
    uint8_t fp[64][KILN_FINGERPRINT_SIZE];
} row_list;

static int list_row(void *user, const kiln_cache_entry_info *info)
{
    row_list *l = user;
    if (l->n < 64)
        memcpy(l->fp[l->n], info->fingerprint, KILN_FINGERPRINT_SIZE);
    l->n++;
    return 0;
}

static void on_bad_row(void *user, const uint8_t fp[KILN_FINGERPRINT_SIZE], const char *detail)
{
    (void)user;
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fp, hex);
    fail_msg("kiln_cache_verify: row %s is bad: %s", hex, detail);
}

static int64_t sql_int(sqlite3 *db, const char *sql)
{
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(db, sql, -1, &q, NULL) != SQLITE_OK)
        fail_msg("%s: %s", sql, sqlite3_errmsg(db));
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    int64_t v = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    return v;
}

/* The file holds exactly the specs' rows, each whole and the one every child saw. */
static void check_database(const fixture *f, const child_report *reports)
{
    sqlite3 *db;
    assert_int_equal(sqlite3_open_v2(f->path, &db, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    sqlite3_busy_timeout(db, 10000);
    sqlite3_stmt *q;
    assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &q, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    assert_string_equal((const char *)sqlite3_column_text(q, 0), "ok");
    sqlite3_finalize(q);
    assert_int_equal(sql_int(db, "SELECT count(*) FROM kernels"), N_SPECS);
    assert_int_equal(sql_int(db, "SELECT count(DISTINCT fingerprint) FROM kernels"), N_SPECS);
    assert_int_equal(sql_int(db, "SELECT count(DISTINCT template_id || '/' || constants) FROM kernels"), N_SPECS);
    sqlite3_close(db);

    kiln_cache_options co = {.path = f->path};
    kiln_cache *c;
    KILN_CHECK(kiln_cache_open(&co, &c));
    kiln_cache_verify_report vr;
    KILN_CHECK(kiln_cache_verify(c, on_bad_row, NULL, &vr));
    assert_int_equal(vr.rows, N_SPECS);
    assert_int_equal(vr.bad_rows, 0);
    assert_true(vr.integrity_ok);
    row_list rows = {0};
    KILN_CHECK(kiln_cache_foreach(c, list_row, &rows));
    assert_int_equal(rows.n, N_SPECS);
    for (int k = 0; k < N_SPECS; k++) {
        int listed = 0;
        for (int i = 0; i < rows.n; i++)
            listed += !memcmp(rows.fp[i], f->fps[k], KILN_FINGERPRINT_SIZE);
        if (listed != 1)
            fail_msg("key %d is listed %d times", k, listed);
        void *cubin;
        size_t size;
        int found;
        KILN_CHECK(kiln_cache_get(c, f->fps[k], &cubin, &size, &found));
        assert_int_equal(found, 1);
        uint64_t h = fnv1a(cubin, size);
        kiln_free(cubin);
        for (int p = 0; p < f->procs; p++) {
            if (reports[p].hash[k] && (reports[p].hash[k] != h || reports[p].size[k] != size))
                fail_msg("key %d: child %d saw %llu bytes (hash %016llx), the file holds %zu (hash %016llx)", k, p,
                         (unsigned long long)reports[p].size[k], (unsigned long long)reports[p].hash[k], size,
                         (unsigned long long)h);
        }
    }
    kiln_cache_counters cc;
    kiln_cache_get_counters(c, &cc);
    assert_int_equal(cc.corrupt_dropped, 0);
    kiln_cache_close(c);
}

static void test_eight_processes_four_threads_one_database(void **state)
{
    fixture *f = *state;
    /* The fingerprints, from a jit without a database (nothing is created). */
    kiln_jit_options jo = {.arch = "sm_90"};
    kiln_jit *j;
    KILN_CHECK(kiln_jit_create(&jo, &j));
    for (int k = 0; k < N_SPECS; k++)
        KILN_CHECK(kiln_jit_fingerprint(j, &f->specs[k], f->fps[k]));
    kiln_jit_destroy(j);
    assert_int_not_equal(access(f->path, F_OK), 0);

    child_report reports[MAX_PROCS];
    double seconds;
    /* Round 1: a file nobody has created yet; everyone compiles and stores. */
    run_round(f, reports, &seconds);
    uint64_t compiles = 0, lookups = 0;
    for (int p = 0; p < f->procs; p++) {
        const kiln_jit_counters *k = &reports[p].jit;
        if (k->compiles > N_SPECS)
            fail_msg("child %d compiled %llu times for %d keys", p, (unsigned long long)k->compiles, N_SPECS);
        assert_int_equal(k->compile_errors, 0);
        assert_int_equal(k->corrupt_dropped, 0);
        assert_int_equal(reports[p].cache.corrupt_dropped, 0);
        uint64_t flagged = 0;
        for (int k2 = 0; k2 < N_SPECS; k2++) {
            if (!reports[p].hash[k2])
                fail_msg("child %d never saw key %d", p, k2);
            if (reports[p].compiled[k2] > 1)
                fail_msg("child %d compiled key %d %u times", p, k2, reports[p].compiled[k2]);
            flagged += reports[p].compiled[k2];
        }
        if (flagged != k->compiles)
            fail_msg("child %d: %llu prepares said they compiled, the jit counted %llu compiles", p,
                     (unsigned long long)flagged, (unsigned long long)k->compiles);
        compiles += k->compiles;
        lookups += reports[p].lookups;
    }
    assert_true(compiles >= N_SPECS); /* every key was compiled by someone */
    printf("round 1: %d processes x %d threads x %d passes, %llu compiles, %llu lookups, %.2f s\n", f->procs,
           f->threads, f->passes, (unsigned long long)compiles, (unsigned long long)lookups, seconds);
    check_database(f, reports);

    /* Round 2: the same on the full file: nobody compiles anything. */
    run_round(f, reports, &seconds);
    for (int p = 0; p < f->procs; p++)
        if (reports[p].jit.compiles)
            fail_msg("round 2: child %d compiled %llu kernels already in the database", p,
                     (unsigned long long)reports[p].jit.compiles);
    printf("round 2: no compiles, %.2f s\n", seconds);
    check_database(f, reports);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_eight_processes_four_threads_one_database, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
