/* The fixture of the offline (CPU) tests: a scratch folder with a fresh cache
 * database and a jit for sm_90 without a runtime. */
#ifndef KILN_TESTS_OFFLINE_FIXTURE_H
#define KILN_TESTS_OFFLINE_FIXTURE_H

#include "testutil.h"

typedef struct offline_fixture {
    char dir[512];
    kiln_cache *cache;
    kiln_jit *jit;
} offline_fixture;

static inline int offline_fixture_setup(void **state)
{
    offline_fixture *f = calloc(1, sizeof *f);
    char path[600];
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(path, sizeof path, "%s/kernels.db", f->dir);
    kiln_cache_options co = {.path = path};
    KILN_CHECK(kiln_cache_open(&co, &f->cache));
    kiln_jit_options jo = {.cache = f->cache, .arch = "sm_90"};
    KILN_CHECK(kiln_jit_create(&jo, &f->jit));
    *state = f;
    return 0;
}

/* Compiles s into the jit's cache (no device), or fails naming the spec and the log. */
static inline void offline_prepare(kiln_jit *jit, const kiln_spec *s)
{
    int compiled = 0;
    char text[256];
    KILN_CHECK(kiln_spec_constants_text(s, text, sizeof text));
    kiln_status st = kiln_jit_prepare(jit, s, &compiled);
    if (st)
        fail_msg("%s %s: %s: %s", s->template_id, text, kiln_status_code(st), kiln_errmsg());
}

static inline int offline_fixture_teardown(void **state)
{
    offline_fixture *f = *state;
    kiln_jit_destroy(f->jit);
    kiln_cache_close(f->cache);
    kiln_test_rmrf(f->dir);
    free(f);
    return 0;
}

#endif
