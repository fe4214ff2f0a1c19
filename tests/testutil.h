/* Helpers shared by kiln's tests: scratch folders, random data, f16, GPU skip. */
#ifndef KILN_TESTUTIL_H
#define KILN_TESTUTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kiln/kiln.h"

/* CTest's skip code (SKIP_RETURN_CODE in tests/CMakeLists.txt). */
#define KILN_TEST_SKIP 77

/* Exits with the skip code when no driver or GPU is present. */
static inline void kiln_test_require_gpu(void)
{
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        printf("SKIP: no GPU: %s\n", why ? why : "?");
        exit(KILN_TEST_SKIP);
    }
}

/* Runs only the tests whose names match $KILN_TEST_FILTER (cmocka's pattern:
 * * and ? wildcards), when it is set: memcheck of a slow binary can take a
 * subset. */
static inline void kiln_test_filter(void)
{
    const char *pattern = getenv("KILN_TEST_FILTER");
    if (pattern && *pattern)
        cmocka_set_test_filter(pattern);
}

/* A fresh folder under $TMPDIR; the path is static storage per call site. */
static inline char *kiln_test_tmpdir(char *buf, size_t cap)
{
    const char *base = getenv("TMPDIR");
    snprintf(buf, cap, "%s/kiln-test-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(buf)) {
        perror("mkdtemp");
        abort();
    }
    return buf;
}

static inline void kiln_test_rmrf(const char *path)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0)
        fprintf(stderr, "warning: could not remove %s\n", path);
}

/* xorshift64*: fresh data each run (seeded from the clock unless KILN_TEST_SEED). */
typedef struct { uint64_t s; } kiln_rng;

static inline kiln_rng kiln_rng_new(void)
{
    const char *env = getenv("KILN_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    fprintf(stderr, "seed 0x%llx (set KILN_TEST_SEED to repeat)\n", (unsigned long long)seed);
    kiln_rng r = {seed ? seed : 1};
    return r;
}

static inline uint64_t kiln_rng_next(kiln_rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 2685821657736338717ULL;
}

static inline uint32_t kiln_rng_below(kiln_rng *r, uint32_t n) { return (uint32_t)((kiln_rng_next(r) >> 32) % n); }

/* Uniform in [lo, hi), 53 random bits. */
static inline double kiln_rng_uniform(kiln_rng *r, double lo, double hi)
{
    return lo + (hi - lo) * (double)(kiln_rng_next(r) >> 11) * 0x1p-53;
}

static inline void kiln_rng_fill(kiln_rng *r, void *p, size_t n)
{
    uint8_t *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = kiln_rng_next(r);
        memcpy(b + i, &v, 8);
    }
    for (; i < n; i++)
        b[i] = (uint8_t)kiln_rng_next(r);
}

/* Asserts a kiln call succeeded, printing its message when not. */
#define KILN_CHECK(call)                                                                                          \
    do {                                                                                                          \
        kiln_status st_ = (call);                                                                                 \
        if (st_ != KILN_OK)                                                                                       \
            fail_msg("%s -> %s: %s", #call, kiln_status_code(st_), kiln_errmsg());                              \
    } while (0)

/* Asserts a call failed with want and that the message contains each needle. */
static inline void kiln_test_expect(kiln_status got, kiln_status want, const char *msg, const char *needle1,
                                    const char *needle2)
{
    if (got != want)
        fail_msg("expected %s, got %s: %s", kiln_status_code(want), kiln_status_code(got), msg);
    if (needle1 && !strstr(msg, needle1))
        fail_msg("message lacks \"%s\": %s", needle1, msg);
    if (needle2 && !strstr(msg, needle2))
        fail_msg("message lacks \"%s\": %s", needle2, msg);
}

/* Runs call, then checks its status and the message msg (evaluated after the
 * call: C leaves the order of function arguments unspecified). */
#define KILN_EXPECT(call, want, msg, needle1, needle2)                                                           \
    do {                                                                                                          \
        kiln_status got_ = (call);                                                                                \
        kiln_test_expect(got_, (want), (msg), (needle1), (needle2));                                              \
    } while (0)

#endif
