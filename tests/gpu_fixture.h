/* The fixture of the GPU tests: a scratch folder with a fresh cache database,
 * a runtime on device 0, a jit on both, a stream, and a seeded generator. */
#ifndef KILN_TESTS_GPU_FIXTURE_H
#define KILN_TESTS_GPU_FIXTURE_H

#include "testutil.h"

typedef struct gpu_fixture {
    char dir[512];
    kiln_runtime *rt;
    kiln_cache *cache;
    kiln_jit *jit;
    kiln_stream *s;
    kiln_rng rng;
} gpu_fixture;

static inline int gpu_fixture_setup(void **state)
{
    gpu_fixture *f = calloc(1, sizeof *f);
    char path[600];
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(path, sizeof path, "%s/kernels.db", f->dir);
    kiln_cache_options co = {.path = path};
    KILN_CHECK(kiln_cache_open(&co, &f->cache));
    KILN_CHECK(kiln_runtime_create(NULL, &f->rt));
    kiln_jit_options jo = {.cache = f->cache, .runtime = f->rt};
    KILN_CHECK(kiln_jit_create(&jo, &f->jit));
    KILN_CHECK(kiln_stream_create(f->rt, &f->s));
    f->rng = kiln_rng_new();
    *state = f;
    return 0;
}

/* A buffer of bytes on rt, 256-byte aligned, or the test fails. */
static inline kiln_buffer *gpu_buffer(kiln_runtime *rt, size_t bytes)
{
    kiln_buffer *b;
    KILN_CHECK(kiln_buffer_create(rt, bytes, 256, &b));
    return b;
}

/* Submits cmd alone through its prepared graph (KILN_PATH_REPLAYED_ONLY),
 * waits, and returns its attribution, checked to say replayed. */
static inline void gpu_submit_replayed(kiln_stream *s, kiln_command *cmd, kiln_attribution *a)
{
    kiln_submit_options so = {.path = KILN_PATH_REPLAYED_ONLY};
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_prepare(s, &cmd, 1, &so, NULL));
    KILN_CHECK(kiln_stream_submit(s, &cmd, 1, &so, &fence));
    KILN_CHECK(kiln_fence_wait(fence));
    KILN_CHECK(kiln_fence_attribution(fence, 0, a));
    kiln_fence_release(fence);
    assert_int_equal(a->path, KILN_EXEC_REPLAYED);
}

static inline int gpu_fixture_teardown(void **state)
{
    gpu_fixture *f = *state;
    kiln_stream_destroy(f->s);
    kiln_jit_destroy(f->jit);
    kiln_runtime_destroy(f->rt);
    kiln_cache_close(f->cache);
    kiln_test_rmrf(f->dir);
    free(f);
    return 0;
}

#endif
