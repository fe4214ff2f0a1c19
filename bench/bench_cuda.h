/* What benchmarks that time with CUDA events share: a driver error as text,
 * a temporary cache database, the "skipped" line of a machine without a GPU. */
#ifndef KILN_BENCH_CUDA_H
#define KILN_BENCH_CUDA_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_common.h"

#include "runtime/internal.h"

/* "what: NAME (code): text" for a failed driver call. */
static inline void bench_cu_message(const kiln__driver *d, CUresult r, const char *what, char *buf, size_t cap)
{
    const char *name = NULL, *text = NULL;
    d->cuGetErrorName(r, &name);
    d->cuGetErrorString(r, &text);
    snprintf(buf, cap, "%s: %s (%d): %s", what, name ? name : "?", (int)r, text ? text : "?");
}

/* A cache database in a fresh folder under parent, removed with its WAL files. */
typedef struct bench_tempdb {
    char dir[4096], path[4200];
    int made;
} bench_tempdb;

/* 0, or -1 with the reason in why. */
static inline int bench_tempdb_make(bench_tempdb *t, const char *parent, const char *tag, char *why, size_t cap)
{
    snprintf(t->dir, sizeof t->dir, "%s/kiln-bench-%s-XXXXXX", parent, tag);
    if (!mkdtemp(t->dir)) {
        snprintf(why, cap, "mkdtemp(%s): %s", t->dir, strerror(errno));
        return -1;
    }
    t->made = 1;
    snprintf(t->path, sizeof t->path, "%s/kernels.db", t->dir);
    return 0;
}

static inline void bench_tempdb_remove(bench_tempdb *t)
{
    if (!t->made)
        return;
    static const char *const suffixes[] = {"", "-wal", "-shm", "-journal"};
    char p[4300];
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        snprintf(p, sizeof p, "%s%s", t->path, suffixes[i]);
        unlink(p);
    }
    rmdir(t->dir);
    t->made = 0;
}

/* The one line a benchmark prints where there is no driver or no device. */
static inline void bench_skip_no_driver(const char *bench, const char *why)
{
    bench_json j;
    bench_json_begin(&j, bench);
    bench_json_bool(&j, "peer", 0);
    char msg[512];
    snprintf(msg, sizeof msg, "no driver: %s", why && *why ? why : "unknown");
    bench_json_str(&j, "skipped", msg);
    bench_json_end(&j);
}

#endif
