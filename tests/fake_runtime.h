/* Runtimes and buffers built from the internal structs, for CPU tests of
 * validation paths: nothing here touches the CUDA driver (d is NULL, so a path
 * that reached it would crash, which would itself reveal a validation gap). */
#ifndef KILN_TESTS_FAKE_RUNTIME_H
#define KILN_TESTS_FAKE_RUNTIME_H

#include <stdatomic.h>

#include "runtime/internal.h"
#include "testutil.h"

/* A fake device address, aligned like a real allocation. */
#define FAKE_PTR 0x7f0000000000ull

static inline kiln_runtime *fake_runtime(uint64_t instance_id)
{
    kiln_runtime *rt = calloc(1, sizeof *rt);
    assert_non_null(rt);
    kiln__errslot_init(&rt->err);
    rt->info.instance_id = instance_id;
    return rt;
}

static inline void fake_runtime_free(kiln_runtime *rt)
{
    kiln__errslot_destroy(&rt->err);
    free(rt);
}

/* One reference (the test's), a fresh 64 KiB-aligned fake address each call.
 * The test keeps its reference to the end: reaching 0 would call the driver. */
static inline kiln_buffer *fake_buffer(kiln_runtime *rt, size_t size, kiln_dtype dtype)
{
    static uint64_t next = FAKE_PTR;
    kiln_buffer *b = calloc(1, sizeof *b);
    assert_non_null(b);
    b->rt = rt;
    atomic_init(&b->refs, 1);
    b->size = size;
    b->dtype = dtype;
    b->base = b->ptr = next;
    next += (size + 0xffff) & ~(uint64_t)0xffff;
    return b;
}

#endif
