/* What benchmarks that time with CUDA events share: a driver error as text. */
#ifndef KILN_BENCH_CUDA_H
#define KILN_BENCH_CUDA_H

#include <stdio.h>

#include "runtime/internal.h"

/* "what: NAME (code): text" for a failed driver call. */
static inline void bench_cu_message(const kiln__driver *d, CUresult r, const char *what, char *buf, size_t cap)
{
    const char *name = NULL, *text = NULL;
    d->cuGetErrorName(r, &name);
    d->cuGetErrorString(r, &text);
    snprintf(buf, cap, "%s: %s (%d): %s", what, name ? name : "?", (int)r, text ? text : "?");
}

#endif
