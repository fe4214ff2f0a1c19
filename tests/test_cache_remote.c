/* The remote layer against a real redis-server that the test starts on a
 * loopback port (no saving, no append-only file, a scratch folder) and stops
 * at the end: a fleet of prewarms compiles each kernel once; a server killed
 * mid-run loses and fails nothing; garbage values are refused and never
 * loaded; a closed port or a server that never answers is skipped with a
 * reason within the timeout; a dead holder's lease expires; a trust policy
 * keeps the layer off unless it is trusted; verify (the library's and `kiln
 * verify`'s) reports each bad row of the tier by its key, and why it cannot
 * read one. Skipped (CTest's skip code) when
 * redis-server is not installed. CPU only: NVRTC needs no GPU. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "cache/cache.h"
#include "cache/internal.h"
#include "testutil.h"

#ifndef KILN_CLI
#error "KILN_CLI (the path of the kiln command-line tool) must be defined by the build"
#endif

#define FLEET 8

static struct {
    char dir[512], redis[512], remote[256];
    int port;
    pid_t pid;
} g;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int find_redis(char *buf, size_t cap)
{
    const char *path = getenv("PATH");
    char dirs[8192];
    snprintf(dirs, sizeof dirs, "%s:/usr/bin:/usr/sbin:/usr/local/bin", path ? path : "");
    for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(buf, cap, "%s/redis-server", d);
        if (access(buf, X_OK) == 0)
            return 1;
    }
    return 0;
}

/* A loopback port nobody listens on (bound, read, closed). */
static int free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_true(s >= 0);
    assert_int_equal(bind(s, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(s, (struct sockaddr *)&a, &len), 0);
    close(s);
    return ntohs(a.sin_port);
}

static redisContext *connect_redis(void)
{
    struct timeval tv = {.tv_sec = 2};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", g.port, tv);
    if (c && c->err) {
        redisFree(c);
        return NULL;
    }
    return c;
}

static void start_redis(void)
{
    char port[16], log[700];
    snprintf(port, sizeof port, "%d", g.port);
    snprintf(log, sizeof log, "%s/redis.log", g.dir);
    fflush(NULL);
    g.pid = fork();
    assert_true(g.pid >= 0);
    if (g.pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0)
            _exit(126);
        execl(g.redis, g.redis, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
              g.dir, "--daemonize", "no", "--protected-mode", "no", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 500; i++) {
        redisContext *c = connect_redis();
        redisReply *r = c ? redisCommand(c, "PING") : NULL;
        int up = r && r->type == REDIS_REPLY_STATUS;
        freeReplyObject(r);
        if (c)
            redisFree(c);
        if (up)
            return;
        usleep(10000);
    }
    fail_msg("redis-server on port %d did not answer within 5 s (log in %s)", g.port, log);
}

static void stop_redis(int sig)
{
    if (g.pid <= 0)
        return;
    kill(g.pid, sig);
    waitpid(g.pid, NULL, 0);
    g.pid = 0;
}

static int group_setup(void **state)
{
    (void)state;
    if (!find_redis(g.redis, sizeof g.redis)) {
        printf("SKIP: redis-server is not installed (apt-get install redis-server)\n");
        exit(KILN_TEST_SKIP);
    }
    kiln_test_tmpdir(g.dir, sizeof g.dir);
    char env[600];
    snprintf(env, sizeof env, "%s/default-cache-unused", g.dir);
    setenv("KILN_CACHE_DIR", env, 1);
    unsetenv("KILN_CACHE_READONLY");
    unsetenv("KILN_TRUSTED_KEYS");
    unsetenv("KILN_CACHE_REMOTE");
    unsetenv("KILN_CACHE_REMOTE_TRUSTED");
    unsetenv("KILN_JIT");
    g.port = free_port();
    start_redis();
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    stop_redis(SIGTERM);
    kiln_test_rmrf(g.dir);
    return 0;
}

/* redis://127.0.0.1:PORT/prefix */
static const char *remote_url(const char *prefix)
{
    snprintf(g.remote, sizeof g.remote, "redis://127.0.0.1:%d/%s", g.port, prefix);
    return g.remote;
}

static long long count_keys(const char *pattern)
{
    redisContext *c = connect_redis();
    assert_non_null(c);
    redisReply *r = redisCommand(c, "KEYS %s", pattern);
    assert_true(r && r->type == REDIS_REPLY_ARRAY);
    long long n = (long long)r->elements;
    freeReplyObject(r);
    redisFree(c);
    return n;
}

static kiln_cache *open_cache(const char *path, const char *remote, int timeout_ms)
{
    kiln_cache_options o = {.size = sizeof o, .path = path, .ignore_env = 1, .remote = remote,
                            .remote_timeout_ms = timeout_ms};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    return c;
}

static kiln_cache_counters counters(kiln_cache *c)
{
    kiln_cache_counters k;
    kiln_cache_get_counters(c, &k);
    return k;
}

static kiln_cache_layer_info remote_layer(kiln_cache *c)
{
    kiln_cache_layer_info info;
    size_t n = kiln_cache_layer_count(c);
    assert_true(n >= 1);
    KILN_CHECK(kiln_cache_layer(c, n - 1, &info));
    assert_int_equal(info.remote, 1);
    return info;
}

/* kiln_cache_verify_remote's bad rows, by key. */
typedef struct bad_seen {
    char keys[16][200], details[16][512];
    int n;
} bad_seen;

static void collect_bad(void *user, const char *key, const char *detail)
{
    bad_seen *b = user;
    assert_true(b->n < 16);
    snprintf(b->keys[b->n], sizeof b->keys[0], "%s", key);
    snprintf(b->details[b->n], sizeof b->details[0], "%s", detail);
    b->n++;
}

/* The detail on_bad gave for key, which must hold needle. */
static void expect_bad(const bad_seen *b, const char *key, const char *needle)
{
    for (int i = 0; i < b->n; i++) {
        if (strcmp(b->keys[i], key))
            continue;
        if (needle && !strstr(b->details[i], needle))
            fail_msg("bad %s: \"%s\" lacks \"%s\"", key, b->details[i], needle);
        return;
    }
    fail_msg("%s is not reported bad (%d reported)", key, b->n);
}

static kiln_cache_remote_verify_report verify_tier(kiln_cache *c, bad_seen *bad)
{
    kiln_cache_remote_verify_report rep = {.size = sizeof rep};
    if (bad)
        memset(bad, 0, sizeof *bad);
    KILN_CHECK(kiln_cache_verify_remote(c, bad ? collect_bad : NULL, bad, &rep));
    return rep;
}

/* ---- the CLI fleet ---- */

typedef struct summary {
    int specs, compiled, cached, failed;
} summary;

static pid_t spawn_prewarm(const char *db, const char *remote, const char *out)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0)
            _exit(126);
        setenv("KILN_CACHE_REMOTE", remote, 1);
        execl(KILN_CLI, KILN_CLI, "prewarm", "--db", db, "-j", "2", (char *)NULL);
        _exit(127);
    }
    return pid;
}

static char *slurp(const char *path)
{
    FILE *fp = fopen(path, "rb");
    char *buf = calloc(1, 1 << 20);
    if (fp) {
        size_t n = fread(buf, 1, (1 << 20) - 1, fp);
        buf[n] = 0;
        fclose(fp);
    }
    return buf;
}

static summary wait_prewarm(pid_t pid, const char *out, const char *what)
{
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    char *text = slurp(out);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_msg("%s: status 0x%x:\n%.4000s", what, status, text);
    if (strstr(text, "Sanitizer") || strstr(text, "runtime error:"))
        fail_msg("%s: sanitizer report:\n%.4000s", what, text);
    const char *line = strstr(text, "summary: ");
    const char *arch = line ? strstr(line, ", arch ") : NULL;
    const char *colon = arch ? strstr(arch, ": ") : NULL;
    summary s = {0};
    if (!colon || sscanf(colon + 2, "%d specializations, %d compiled, %d already cached, %d failed", &s.specs,
                         &s.compiled, &s.cached, &s.failed) != 4)
        fail_msg("%s: no summary line:\n%.4000s", what, text);
    free(text);
    return s;
}

static void on_bad_row(void *user, const uint8_t fp[KILN_FINGERPRINT_SIZE], const char *detail)
{
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fp, hex);
    fail_msg("%s: row %s is bad: %s", (const char *)user, hex, detail);
}

/* Every row verifies, and there are as many as the model needs. */
static void expect_whole_database(const char *path, int specs, const char *what)
{
    kiln_cache_options o = {.size = sizeof o, .path = path, .ignore_env = 1, .existing_only = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    kiln_cache_verify_report vr;
    KILN_CHECK(kiln_cache_verify(c, on_bad_row, (void *)what, &vr));
    if (!vr.integrity_ok || vr.bad_rows || vr.rows != (uint64_t)specs)
        fail_msg("%s: %llu rows (%d needed), %llu bad, integrity %d", what, (unsigned long long)vr.rows, specs,
                 (unsigned long long)vr.bad_rows, vr.integrity_ok);
    kiln_cache_close(c);
}

/* n prewarms of the default model, each into an empty database of its own,
 * against one remote; with kill_after_rows, redis is killed (SIGKILL) once
 * that many rows are published. */
static void run_fleet(int n, const char *prefix, int kill_after_rows, summary *out)
{
    pid_t pids[FLEET];
    char db[FLEET][700], log[FLEET][700];
    const char *remote = remote_url(prefix);
    for (int i = 0; i < n; i++) {
        snprintf(db[i], sizeof db[i], "%s/%s-%d/kernels.db", g.dir, prefix, i);
        snprintf(log[i], sizeof log[i], "%s/%s-%d.log", g.dir, prefix, i);
        pids[i] = spawn_prewarm(db[i], remote, log[i]);
    }
    if (kill_after_rows) {
        char pattern[128];
        snprintf(pattern, sizeof pattern, "%s:row:*", prefix);
        double t0 = now_s();
        while (count_keys(pattern) < kill_after_rows && now_s() - t0 < 120)
            usleep(5000);
        assert_true(count_keys(pattern) >= kill_after_rows);
        stop_redis(SIGKILL); /* mid-run: leases held, waits in progress */
    }
    for (int i = 0; i < n; i++) {
        char what[800];
        snprintf(what, sizeof what, "prewarm %d of %d (%s)", i + 1, n, prefix);
        out[i] = wait_prewarm(pids[i], log[i], what);
        assert_int_equal(out[i].failed, 0);
        assert_int_equal(out[i].compiled + out[i].cached, out[i].specs);
        assert_int_equal(out[i].specs, out[0].specs);
        expect_whole_database(db[i], out[i].specs, what);
    }
}

static void test_fleet_compiles_each_kernel_once(void **state)
{
    (void)state;
    summary s[FLEET];
    double t0 = now_s();
    run_fleet(FLEET, "fleet", 0, s);
    int compiled = 0;
    for (int i = 0; i < FLEET; i++)
        compiled += s[i].compiled;
    printf("%d prewarms of %d kernels against one redis: %d compiles in all, %.2f s\n", FLEET, s[0].specs, compiled,
           now_s() - t0);
    assert_true(s[0].specs >= 2);
    assert_int_equal(compiled, s[0].specs);
    assert_int_equal(count_keys("fleet:row:*"), s[0].specs);
    assert_int_equal(count_keys("fleet:lease:*"), 0); /* every lease given back */
    /* The tier a fleet of prewarms filled verifies whole. */
    char path[700];
    snprintf(path, sizeof path, "%s/fleet-verify/kernels.db", g.dir);
    kiln_cache *c = open_cache(path, remote_url("fleet"), 0);
    bad_seen bad;
    kiln_cache_remote_verify_report rep = verify_tier(c, &bad);
    if (rep.state != KILN_CACHE_REMOTE_SCANNED || rep.bad_rows || bad.n)
        fail_msg("the fleet's tier: state %d, %llu bad (%s), %s", (int)rep.state, (unsigned long long)rep.bad_rows,
                 rep.first_bad[0], rep.reason);
    assert_int_equal(rep.rows, (uint64_t)s[0].specs);
    assert_int_equal(rep.leases, 0);
    assert_int_equal(rep.other_keys, 0);
    kiln_cache_close(c);
}

static void test_redis_killed_mid_run_loses_nothing(void **state)
{
    (void)state;
    summary s[4];
    run_fleet(4, "killed", 4, s);
    int compiled = 0;
    for (int i = 0; i < 4; i++)
        compiled += s[i].compiled;
    printf("redis killed mid-run: 4 prewarms of %d kernels ended whole, %d compiles in all\n", s[0].specs, compiled);
    assert_true(compiled >= s[0].specs);
    start_redis(); /* for the tests after this one */
}

/* ---- values ---- */

static kiln_cache_record fake_record(uint8_t seed, uint8_t *cubin, size_t n)
{
    for (size_t i = 0; i < n; i++)
        cubin[i] = (uint8_t)(i * 31 + seed);
    kiln_cache_record r = {.template_id = "fake",
                           .constants = "N=1",
                           .arch = "sm_90",
                           .nvrtc_major = 12,
                           .nvrtc_minor = 4,
                           .entries = "k",
                           .parts = "schema=kiln-fingerprint-1;template=fake;arch=sm_90;nvrtc=12.4;constants=N=1",
                           .cubin = cubin,
                           .cubin_size = n};
    for (int i = 0; i < KILN_FINGERPRINT_SIZE; i++)
        r.fingerprint[i] = (uint8_t)(seed * 7 + i);
    return r;
}

static void key_of(const char *prefix, const uint8_t *fp, char *buf, size_t cap)
{
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fp, hex);
    snprintf(buf, cap, "%s:row:%s", prefix, hex);
}

static void redis_set(const char *key, const void *v, size_t n)
{
    redisContext *c = connect_redis();
    assert_non_null(c);
    redisReply *r = redisCommand(c, "SET %s %b", key, v, n);
    assert_true(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    redisFree(c);
}

static uint8_t *redis_get(const char *key, size_t *n)
{
    redisContext *c = connect_redis();
    assert_non_null(c);
    redisReply *r = redisCommand(c, "GET %s", key);
    assert_true(r && r->type == REDIS_REPLY_STRING);
    uint8_t *v = malloc(r->len + 1);
    memcpy(v, r->str, r->len);
    *n = r->len;
    freeReplyObject(r);
    redisFree(c);
    return v;
}

static uint64_t g_events;
static void on_event(void *user, const kiln_cache_event *ev)
{
    (void)user;
    assert_true(ev->detail && *ev->detail);
    g_events++;
}

/* A fresh empty local database with the remote layer: the value is refused. */
static void expect_refused(const uint8_t *fp, const char *remote, const char *what, const char *needle)
{
    char path[700];
    static int n;
    snprintf(path, sizeof path, "%s/refused-%d/kernels.db", g.dir, n++);
    kiln_cache_options o = {.size = sizeof o, .path = path, .ignore_env = 1, .remote = remote, .on_event = on_event};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    void *cubin = NULL;
    size_t size = 0;
    int found = 1;
    uint64_t events = g_events;
    KILN_CHECK(kiln_cache_get(c, fp, &cubin, &size, &found));
    kiln_cache_counters k = counters(c);
    if (found || k.remote_refused != 1 || k.hits != 0 || k.misses != 1 || g_events != events + 1)
        fail_msg("%s: found %d, refused %llu, hits %llu, misses %llu, events %llu", what, found,
                 (unsigned long long)k.remote_refused, (unsigned long long)k.hits, (unsigned long long)k.misses,
                 (unsigned long long)(g_events - events));
    if (needle && !strstr(kiln_cache_errmsg(c), needle))
        fail_msg("%s: the message lacks \"%s\": %s", what, needle, kiln_cache_errmsg(c));
    int present = 1;
    KILN_CHECK(kiln_cache_contains(c, fp, &present));
    assert_int_equal(present, 0); /* never loaded into the local database */
    assert_int_equal(remote_layer(c).active, 1); /* garbage in a value is the row's fault, not the server's */
    kiln_cache_close(c);
}

static void test_garbage_values_are_refused(void **state)
{
    (void)state;
    const char *remote = remote_url("garbage");
    char path[700], key[200], key2[200];
    snprintf(path, sizeof path, "%s/publisher/kernels.db", g.dir);
    kiln_cache *pub = open_cache(path, remote, 0);
    uint8_t cubin[4096], cubin2[3000];
    kiln_cache_record r = fake_record(1, cubin, sizeof cubin), r2 = fake_record(2, cubin2, sizeof cubin2);
    KILN_CHECK(kiln_cache_put(pub, &r));
    KILN_CHECK(kiln_cache_put(pub, &r2));
    assert_int_equal(counters(pub).remote_published, 2);
    kiln_cache_close(pub);
    key_of("garbage", r.fingerprint, key, sizeof key);
    key_of("garbage", r2.fingerprint, key2, sizeof key2);
    size_t n = 0, n2 = 0;
    uint8_t *good = redis_get(key, &n), *other = redis_get(key2, &n2);
    uint8_t *bad = malloc(n + 16);

    redis_set(key, "", 0);
    expect_refused(r.fingerprint, remote, "an empty value", "not a kiln row");
    redis_set(key, "hello, not a row at all", 23);
    expect_refused(r.fingerprint, remote, "text", "not a kiln row");
    redis_set(key, good, n - 1);
    expect_refused(r.fingerprint, remote, "truncated by one byte", "frame");
    memcpy(bad, good, n);
    bad[n] = 0;
    redis_set(key, bad, n + 1);
    expect_refused(r.fingerprint, remote, "a byte appended", "frame");
    memcpy(bad, good, n);
    bad[n - 1] ^= 0x40; /* in the zstd frame */
    redis_set(key, bad, n);
    expect_refused(r.fingerprint, remote, "a frame byte flipped", NULL);
    memcpy(bad, good, n);
    bad[KILN__REMOTE_MAGIC_SIZE + KILN_FINGERPRINT_SIZE + 16] ^= 1; /* the checksum */
    redis_set(key, bad, n);
    expect_refused(r.fingerprint, remote, "a checksum byte flipped", "checksum");
    memcpy(bad, good, n);
    bad[KILN__REMOTE_MAGIC_SIZE + KILN_FINGERPRINT_SIZE + 8] ^= 4; /* raw_size */
    redis_set(key, bad, n);
    expect_refused(r.fingerprint, remote, "raw_size changed", "zstd frame declares");
    redis_set(key, other, n2); /* a valid row of another kernel, filed under this key */
    expect_refused(r.fingerprint, remote, "another key's row", "another fingerprint");

    /* The jit's load checks the kernel too: a row of another template is refused. */
    redis_set(key, good, n);
    snprintf(path, sizeof path, "%s/expect/kernels.db", g.dir);
    kiln_cache *c = open_cache(path, remote, 0);
    kiln_cache_record want = r;
    want.template_id = "not_fake";
    void *raw = NULL;
    size_t size = 0;
    int found = 1;
    unsigned dropped = 0;
    KILN_CHECK(kiln__cache_load(c, r.fingerprint, &want, 1, &raw, &size, &found, &dropped));
    assert_int_equal(found, 0);
    assert_int_equal(counters(c).remote_refused, 1);
    assert_non_null(strstr(kiln_cache_errmsg(c), "another kernel"));
    /* The good value loads, with its bytes, and lands in the local database. */
    KILN_CHECK(kiln__cache_load(c, r.fingerprint, &r, 1, &raw, &size, &found, &dropped));
    assert_int_equal(found, 1);
    assert_int_equal(size, sizeof cubin);
    assert_memory_equal(raw, cubin, sizeof cubin);
    kiln_free(raw);
    kiln_cache_counters k = counters(c);
    assert_int_equal(k.remote_hits, 1);
    assert_int_equal(k.hits, 1);
    int present = 0;
    KILN_CHECK(kiln_cache_contains(c, r.fingerprint, &present));
    assert_int_equal(present, 1);
    kiln_cache_close(c);

    /* A key of another type: the server answers an error, the layer is skipped for a while. */
    redisContext *rc = connect_redis();
    freeReplyObject(redisCommand(rc, "DEL %s", key));
    freeReplyObject(redisCommand(rc, "RPUSH %s x", key));
    redisFree(rc);
    snprintf(path, sizeof path, "%s/wrongtype/kernels.db", g.dir);
    c = open_cache(path, remote, 0);
    KILN_CHECK(kiln_cache_get(c, r.fingerprint, &raw, &size, &found));
    assert_int_equal(found, 0);
    k = counters(c);
    assert_int_equal(k.remote_errors, 1);
    kiln_cache_layer_info info = remote_layer(c);
    assert_int_equal(info.active, 0);
    if (!strstr(info.reason, "WRONGTYPE"))
        fail_msg("reason: %s", info.reason);
    kiln_cache_close(c);
    free(good);
    free(other);
    free(bad);
}

/* ---- verify: every row of the tier, judged as a fetch judges it ---- */

/* kiln verify --db db with $KILN_CACHE_REMOTE: its exit status, its output in *text. */
static int run_verify_cli(const char *db, const char *remote, char **text)
{
    char out[700];
    snprintf(out, sizeof out, "%s/verify-cli.log", g.dir);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0)
            _exit(126);
        setenv("KILN_CACHE_REMOTE", remote, 1);
        execl(KILN_CLI, KILN_CLI, "verify", "--db", db, (char *)NULL);
        _exit(127);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    *text = slurp(out);
    if (strstr(*text, "Sanitizer") || strstr(*text, "runtime error:"))
        fail_msg("kiln verify: sanitizer report:\n%.4000s", *text);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

static void test_verify_reports_each_bad_row(void **state)
{
    (void)state;
    const char *remote = remote_url("verify");
    char path[700], line[512], keys[8][200];
    snprintf(path, sizeof path, "%s/verify/kernels.db", g.dir);
    kiln_cache *pub = open_cache(path, remote, 0);
    uint8_t cubins[5][2048];
    kiln_cache_record r[5];
    for (int i = 0; i < 5; i++) {
        r[i] = fake_record((uint8_t)(21 + i), cubins[i], sizeof cubins[i] - 64 * (size_t)i);
        key_of("verify", r[i].fingerprint, keys[i], sizeof keys[i]);
    }
    /* r[4]'s parts name another template than its template_id: whole bytes, a row no key of it gives. */
    r[4].parts = "schema=kiln-fingerprint-1;template=other;arch=sm_90;nvrtc=12.4;constants=N=1";
    for (int i = 0; i < 4; i++)
        KILN_CHECK(kiln_cache_put(pub, &r[i]));
    assert_int_equal(counters(pub).remote_published, 4);
    snprintf(path, sizeof path, "%s/verify-parts/kernels.db", g.dir); /* the local database stays whole */
    kiln_cache *pub2 = open_cache(path, remote, 0);
    KILN_CHECK(kiln_cache_put(pub2, &r[4]));
    assert_int_equal(counters(pub2).remote_published, 1);
    kiln_cache_close(pub2);
    snprintf(path, sizeof path, "%s/verify/kernels.db", g.dir);
    /* Not rows: a lease, a note, a key of a spelling kiln never writes, another prefix's row. */
    uint8_t fp5[KILN_FINGERPRINT_SIZE], fp6[KILN_FINGERPRINT_SIZE];
    memset(fp5, 0x55, sizeof fp5);
    memset(fp6, 0x66, sizeof fp6);
    key_of("verify", fp5, keys[5], sizeof keys[5]);
    key_of("verify", fp6, keys[6], sizeof keys[6]);
    char lease[200], upper[200], other[200];
    snprintf(lease, sizeof lease, "verify:lease:%.64s", keys[0] + strlen("verify:row:"));
    snprintf(upper, sizeof upper, "verify:row:%064d", 0);
    memcpy(upper + strlen("verify:row:"), "ABCDEF", 6);
    key_of("verifyx", fp5, other, sizeof other);
    redis_set(lease, "someone", 7);
    redis_set("verify:note", "hello", 5);
    redis_set(upper, "not looked at", 13);
    redis_set(other, "not this prefix's", 17);

    /* Whole: every row verifies, leases and other keys counted, not bad. */
    kiln_cache_remote_verify_report rep = verify_tier(pub, NULL);
    r[4].parts = NULL;
    assert_int_equal(rep.state, KILN_CACHE_REMOTE_SCANNED);
    assert_int_equal(rep.rows, 5);
    assert_int_equal(rep.bad_rows, 1); /* the row whose parts disagree */
    assert_non_null(strstr(rep.first_bad[0], keys[4]));
    assert_non_null(strstr(rep.first_bad[0], "its fingerprint parts say template=other"));
    assert_int_equal(rep.leases, 1);
    assert_int_equal(rep.other_keys, 2); /* the note and the uppercase spelling; verifyx: is not matched */
    assert_string_equal(rep.reason, "");
    assert_string_equal(rep.first_bad[1], "");
    redisContext *rc = connect_redis();
    freeReplyObject(redisCommand(rc, "DEL %s", keys[4]));
    redisFree(rc);
    rep = verify_tier(pub, NULL);
    assert_int_equal(rep.rows, 4);
    assert_int_equal(rep.bad_rows, 0);
    kiln_cache_counters k = counters(pub);
    assert_int_equal(k.remote_errors, 0);
    assert_int_equal(k.remote_refused, 0);
    assert_int_equal(k.remote_hits + k.remote_misses, 0); /* verify is no fetch */

    /* The CLI on the clean tier: its line, exit 0. */
    char *text = NULL;
    int status = run_verify_cli(path, remote, &text);
    snprintf(line, sizeof line, "remote %s: 4 rows verified, 0 bad, 1 leases, 2 other keys\n", remote);
    if (status != 0 || !strstr(text, line))
        fail_msg("kiln verify of a clean tier: status %d, no \"%s\":\n%.4000s", status, line, text);
    assert_non_null(strstr(text, "verified ")); /* the local lines are still there */
    free(text);

    /* Corrupted in Redis directly. */
    size_t n0 = 0, n1 = 0, n3 = 0;
    uint8_t *v0 = redis_get(keys[0], &n0), *v1 = redis_get(keys[1], &n1), *v3 = redis_get(keys[3], &n3);
    v0[n0 - 1] ^= 0x40; /* a byte of the zstd frame */
    redis_set(keys[0], v0, n0);
    redis_set(keys[1], v1, n1 - 1);          /* truncated */
    redis_set(keys[2], v3, n3);              /* another fingerprint's value */
    redis_set(keys[5], "garbage bytes", 13); /* garbage */
    rc = connect_redis();
    freeReplyObject(redisCommand(rc, "RPUSH %s x", keys[6])); /* not a string at all */
    redisFree(rc);
    bad_seen bad;
    rep = verify_tier(pub, &bad);
    assert_int_equal(rep.state, KILN_CACHE_REMOTE_SCANNED);
    assert_int_equal(rep.rows, 6);
    assert_int_equal(rep.bad_rows, 5);
    assert_int_equal(bad.n, 5);
    expect_bad(&bad, keys[0], NULL);
    expect_bad(&bad, keys[1], "frame");
    expect_bad(&bad, keys[2], "another fingerprint");
    expect_bad(&bad, keys[5], "not a kiln row");
    expect_bad(&bad, keys[6], "WRONGTYPE");
    for (int i = 0; i < KILN_CACHE_REMOTE_FIRST_BAD; i++) /* "KEY: WHY", a key of those reported */
        assert_true(!strncmp(rep.first_bad[i], "verify:row:", 11) && strstr(rep.first_bad[i], ": "));
    assert_int_equal(remote_layer(pub).active, 1); /* a wrong type is the row's fault here */
    assert_int_equal(counters(pub).remote_errors, 0);

    /* An older caller's report: fields past its size are not written; a size inside the size field is refused. */
    kiln_cache_remote_verify_report small;
    memset(&small, 0x7e, sizeof small);
    small.size = (uint32_t)offsetof(kiln_cache_remote_verify_report, first_bad);
    KILN_CHECK(kiln_cache_verify_remote(pub, NULL, NULL, &small));
    assert_int_equal(small.bad_rows, 5);
    assert_int_equal((unsigned char)small.first_bad[0][0], 0x7e);
    small.size = 2;
    KILN_EXPECT(kiln_cache_verify_remote(pub, NULL, NULL, &small), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "size", NULL);
    kiln_cache_close(pub);

    /* Each is refused by a fetch too (the list's fetch is a server error, as before). */
    expect_refused(r[0].fingerprint, remote, "verify: a frame byte flipped", NULL);
    expect_refused(r[1].fingerprint, remote, "verify: truncated", "frame");
    expect_refused(r[2].fingerprint, remote, "verify: another fingerprint's value", "another fingerprint");
    expect_refused(fp5, remote, "verify: garbage", "not a kiln row");

    /* The CLI: a line per bad row naming its key, the summary, exit 1. */
    status = run_verify_cli(path, remote, &text);
    snprintf(line, sizeof line, "remote %s: 6 rows verified, 5 bad (first: verify:row:", remote);
    if (status != 1 || !strstr(text, line) || !strstr(text, ", 1 leases, 2 other keys\n"))
        fail_msg("kiln verify of a bad tier: status %d, no \"%s\":\n%.4000s", status, line, text);
    for (int i = 0; i < 7; i++) {
        if (i == 3 || i == 4)
            continue;
        snprintf(line, sizeof line, "bad %.200s ", keys[i]);
        if (!strstr(text, line))
            fail_msg("kiln verify: no \"%s\":\n%.4000s", line, text);
    }
    assert_non_null(strstr(text, "remote rows failed verification"));
    free(text);

    /* A closed port: the CLI says why and exits 1. */
    char url[128];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/verify", free_port());
    status = run_verify_cli(path, url, &text);
    snprintf(line, sizeof line, "remote %s: failed: redis 127.0.0.1:", url);
    if (status != 1 || !strstr(text, line) || !strstr(text, "cannot connect"))
        fail_msg("kiln verify of a closed port: status %d, no \"%s\":\n%.4000s", status, line, text);
    free(text);
    free(v0);
    free(v1);
    free(v3);
}


/* A loopback socket that accepts connections and never answers; url gets
 * its redis:// address with the prefix "mute". Close the socket after. */
static int mute_server(char *url, size_t cap)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(s, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(s, 16), 0);
    assert_int_equal(getsockname(s, (struct sockaddr *)&a, &len), 0);
    snprintf(url, cap, "redis://127.0.0.1:%d/mute", ntohs(a.sin_port));
    return s;
}

static void test_verify_unreachable_gives_the_reason(void **state)
{
    (void)state;
    char url[128], path[700];
    /* No remote tier: nothing to say. */
    snprintf(path, sizeof path, "%s/verify-none/kernels.db", g.dir);
    kiln_cache *c = open_cache(path, "", 0);
    kiln_cache_remote_verify_report rep = verify_tier(c, NULL);
    assert_int_equal(rep.state, KILN_CACHE_REMOTE_NONE);
    assert_int_equal(rep.rows, 0);
    KILN_EXPECT(kiln_cache_verify_remote(c, NULL, NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL",
                NULL);
    kiln_cache_close(c);

    /* A closed port. */
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/closed", free_port());
    snprintf(path, sizeof path, "%s/verify-closed/kernels.db", g.dir);
    c = open_cache(path, url, 300);
    double t0 = now_s();
    rep = verify_tier(c, NULL);
    printf("verify, closed port: %.3f s: %s\n", now_s() - t0, rep.reason);
    assert_true(now_s() - t0 < 2.0);
    assert_int_equal(rep.state, KILN_CACHE_REMOTE_FAILED);
    assert_non_null(strstr(rep.reason, "cannot connect"));
    assert_null(strstr(rep.reason, "compiling locally")); /* verify compiles nothing */
    kiln_cache_close(c);

    /* A server that accepts and never answers: the SCAN times out. */
    int s = mute_server(url, sizeof url);
    snprintf(path, sizeof path, "%s/verify-mute/kernels.db", g.dir);
    c = open_cache(path, url, 300);
    t0 = now_s();
    rep = verify_tier(c, NULL);
    double took = now_s() - t0;
    printf("verify, silent server: %.3f s: %s\n", took, rep.reason);
    assert_true(took >= 0.25 && took < 2.0);
    assert_int_equal(rep.state, KILN_CACHE_REMOTE_FAILED);
    assert_non_null(strstr(rep.reason, "SCAN"));
    assert_non_null(strstr(rep.reason, "no answer within 300 ms"));
    assert_int_equal(counters(c).remote_errors, 1);
    kiln_cache_close(c);
    close(s);

    /* A server killed between the open and the verify. */
    snprintf(path, sizeof path, "%s/verify-killed/kernels.db", g.dir);
    c = open_cache(path, remote_url("verify-killed"), 300);
    assert_int_equal(remote_layer(c).active, 1);
    stop_redis(SIGKILL);
    rep = verify_tier(c, NULL);
    start_redis();
    printf("verify, server killed: %s\n", rep.reason);
    assert_int_equal(rep.state, KILN_CACHE_REMOTE_FAILED);
    assert_non_null(strstr(rep.reason, "SCAN"));
    kiln_cache_close(c);
}

/* ---- a server that is not there, or never answers ---- */

static kiln_jit *offline_jit(kiln_cache *c)
{
    kiln_jit_options o = {.cache = c, .arch = "sm_90", .compile = KILN_JIT_COMPILE_ON};
    kiln_jit *j = NULL;
    KILN_CHECK(kiln_jit_create(&o, &j));
    return j;
}

static void expect_compiles(kiln_cache *c, int vocab)
{
    kiln_jit *j = offline_jit(c);
    kiln_spec s;
    int compiled = 0;
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, vocab, 896, 8, &s));
    KILN_CHECK(kiln_jit_prepare(j, &s, &compiled));
    assert_int_equal(compiled, 1);
    kiln_jit_destroy(j);
}

static void test_unreachable_is_skipped_within_the_timeout(void **state)
{
    (void)state;
    char url[128], path[700];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d/closed", free_port());
    snprintf(path, sizeof path, "%s/closed/kernels.db", g.dir);
    double t0 = now_s();
    kiln_cache *c = open_cache(path, url, 300);
    double open_s = now_s() - t0;
    kiln_cache_layer_info info = remote_layer(c);
    printf("closed port: open in %.3f s, skipped: %s\n", open_s, info.reason);
    assert_true(open_s < 2.0);
    assert_int_equal(info.active, 0);
    assert_non_null(strstr(info.reason, "cannot connect"));
    assert_string_equal(info.path, url);
    assert_true(counters(c).remote_errors >= 1);
    uint8_t cubin[512];
    kiln_cache_record r = fake_record(3, cubin, sizeof cubin);
    KILN_CHECK(kiln_cache_put(c, &r)); /* local work goes on */
    void *raw = NULL;
    size_t size = 0;
    int found = 0;
    KILN_CHECK(kiln_cache_get(c, r.fingerprint, &raw, &size, &found));
    assert_int_equal(found, 1);
    kiln_free(raw);
    expect_compiles(c, 1001);
    kiln_cache_close(c);

    /* A server that accepts connections and never answers: each command times out. */
    int s = mute_server(url, sizeof url);
    snprintf(path, sizeof path, "%s/mute/kernels.db", g.dir);
    c = open_cache(path, url, 300);
    uint8_t fp[KILN_FINGERPRINT_SIZE] = {9};
    t0 = now_s();
    KILN_CHECK(kiln_cache_get(c, fp, &raw, &size, &found));
    double get_s = now_s() - t0;
    info = remote_layer(c);
    printf("silent server: a get gave up after %.3f s: %s\n", get_s, info.reason);
    assert_int_equal(found, 0);
    assert_true(get_s >= 0.25 && get_s < 2.0);
    assert_int_equal(info.active, 0);
    assert_non_null(strstr(info.reason, "GET"));
    assert_int_equal(counters(c).remote_errors, 1);
    /* Skipped now without waiting again, until the retry. */
    t0 = now_s();
    KILN_CHECK(kiln_cache_get(c, fp, &raw, &size, &found));
    assert_true(now_s() - t0 < 0.2);
    expect_compiles(c, 1002);
    kiln_cache_close(c);
    close(s);
}

/* ---- leases ---- */

static void test_a_dead_holders_lease_expires(void **state)
{
    (void)state;
    const char *remote = remote_url("lease");
    char path[700], key[200], hex[2 * KILN_FINGERPRINT_SIZE + 1];
    snprintf(path, sizeof path, "%s/lease-a/kernels.db", g.dir);
    kiln_cache *c = open_cache(path, remote, 0);
    kiln_jit *j = offline_jit(c);
    kiln_spec s;
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 1003, 896, 8, &s));
    KILN_CHECK(kiln_jit_fingerprint(j, &s, fp));
    kiln_fingerprint_hex(fp, hex);
    snprintf(key, sizeof key, "lease:lease:%s", hex);
    /* A holder that took the lease and died: nobody publishes, the lease runs out. */
    redisContext *rc = connect_redis();
    redisReply *rep = redisCommand(rc, "SET %s dead-holder NX PX 1500", key);
    assert_true(rep && rep->type == REDIS_REPLY_STATUS);
    freeReplyObject(rep);
    int compiled = 0;
    double t0 = now_s();
    KILN_CHECK(kiln_jit_prepare(j, &s, &compiled));
    double waited = now_s() - t0;
    printf("a dead holder's lease: compiled after %.2f s\n", waited);
    assert_int_equal(compiled, 1);
    assert_true(waited >= 1.2);
    kiln_cache_counters k = counters(c);
    assert_int_equal(k.remote_leases, 1);
    assert_int_equal(k.remote_published, 1);
    rep = redisCommand(rc, "EXISTS %s", key);
    assert_true(rep && rep->type == REDIS_REPLY_INTEGER && rep->integer == 0); /* given back */
    freeReplyObject(rep);
    redisFree(rc);
    kiln_jit_destroy(j);
    kiln_cache_close(c);

    /* Another process with an empty database: the row, no compile. */
    snprintf(path, sizeof path, "%s/lease-b/kernels.db", g.dir);
    c = open_cache(path, remote, 0);
    j = offline_jit(c);
    KILN_CHECK(kiln_jit_prepare(j, &s, &compiled));
    assert_int_equal(compiled, 0);
    assert_int_equal(counters(c).remote_hits, 1);
    kiln_jit_destroy(j);
    kiln_cache_close(c);
}

/* ---- configuration ---- */

static void test_trust_policy_keeps_the_remote_off(void **state)
{
    (void)state;
    char pub[700], path[700];
    snprintf(pub, sizeof pub, "%s/trusted.pub", g.dir);
    EVP_PKEY *key = EVP_PKEY_Q_keygen(NULL, NULL, "ED25519");
    assert_non_null(key);
    FILE *f = fopen(pub, "w");
    assert_non_null(f);
    assert_int_equal(PEM_write_PUBKEY(f, key), 1);
    fclose(f);
    EVP_PKEY_free(key);
    const char *keys[] = {pub};
    for (int trusted = 0; trusted <= 1; trusted++) {
        snprintf(path, sizeof path, "%s/trust-%d/kernels.db", g.dir, trusted);
        kiln_cache_options o = {.size = sizeof o, .path = path, .ignore_env = 1, .remote = remote_url("trust"),
                                .trusted_keys = keys, .n_trusted_keys = 1, .remote_trusted = trusted};
        kiln_cache *c = NULL;
        KILN_CHECK(kiln_cache_open(&o, &c));
        kiln_cache_layer_info info = remote_layer(c);
        uint8_t cubin[256];
        kiln_cache_record r = fake_record((uint8_t)(10 + trusted), cubin, sizeof cubin);
        KILN_CHECK(kiln_cache_put(c, &r));
        kiln_cache_remote_verify_report rep = verify_tier(c, NULL);
        if (!trusted) {
            assert_int_equal(info.active, 0);
            assert_non_null(strstr(info.reason, "trust policy"));
            assert_int_equal(counters(c).remote_published, 0);
            assert_int_equal(rep.state, KILN_CACHE_REMOTE_SKIPPED); /* nothing read */
            assert_non_null(strstr(rep.reason, "trust policy"));
            assert_int_equal(rep.rows, 0);
        } else {
            assert_int_equal(info.active, 1);
            assert_int_equal(counters(c).remote_published, 1);
            assert_int_equal(rep.state, KILN_CACHE_REMOTE_SCANNED);
            assert_int_equal(rep.rows, 1);
            assert_int_equal(rep.bad_rows, 0);
        }
        kiln_cache_close(c);
    }
}

static void test_bad_urls_fail_the_open(void **state)
{
    (void)state;
    static const char *const bad[] = {"http://127.0.0.1:6379", "redis://", "redis://:6379", "redis://h:0",
                                      "redis://h:65536", "redis://h:12x", "redis://user:pw@h:1",
                                      "redis://h:1/bad prefix", "redis://h:1/a?b", "redis://[::1",
                                      "redis://h:1/01234567890123456789012345678901234567890123456789012345678901234"};
    char path[700];
    snprintf(path, sizeof path, "%s/bad-url/kernels.db", g.dir);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kiln_cache_options o = {.size = sizeof o, .path = path, .ignore_env = 1, .remote = bad[i]};
        kiln_cache *c = NULL;
        KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "remote", NULL);
        assert_null(c);
    }
    kiln__remote_url u;
    char detail[256];
    KILN_CHECK(kiln__remote_url_parse("redis://cache.local", &u, detail, sizeof detail));
    assert_string_equal(u.host, "cache.local");
    assert_int_equal(u.port, 6379);
    assert_string_equal(u.prefix, "kiln");
    KILN_CHECK(kiln__remote_url_parse("redis://[::1]:7000/team:a", &u, detail, sizeof detail));
    assert_string_equal(u.host, "::1");
    assert_int_equal(u.port, 7000);
    assert_string_equal(u.prefix, "team:a");
    /* The environment, and "" for none. */
    setenv("KILN_CACHE_REMOTE", remote_url("env"), 1);
    kiln_cache_options o = {.size = sizeof o, .path = path};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    assert_int_equal(kiln_cache_layer_count(c), 1);
    assert_int_equal(remote_layer(c).active, 1);
    kiln_cache_close(c);
    o.remote = "";
    KILN_CHECK(kiln_cache_open(&o, &c));
    assert_int_equal(kiln_cache_layer_count(c), 0);
    kiln_cache_close(c);
    unsetenv("KILN_CACHE_REMOTE");
}

int main(void)
{
    kiln_test_filter();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_urls_fail_the_open),
        cmocka_unit_test(test_garbage_values_are_refused),
        cmocka_unit_test(test_verify_reports_each_bad_row),
        cmocka_unit_test(test_verify_unreachable_gives_the_reason),
        cmocka_unit_test(test_unreachable_is_skipped_within_the_timeout),
        cmocka_unit_test(test_a_dead_holders_lease_expires),
        cmocka_unit_test(test_trust_policy_keeps_the_remote_off),
        cmocka_unit_test(test_fleet_compiles_each_kernel_once),
        cmocka_unit_test(test_redis_killed_mid_run_loses_nothing),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
