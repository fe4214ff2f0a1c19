/* kiln — what the fuzz targets and their standalone driver share. Not API. */
#ifndef KILN_FUZZ_COMMON_H
#define KILN_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The entry point every target defines (libFuzzer's contract). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Prints what a target saw (accepted, rejected, by reason). Each target defines
 * it; the standalone driver calls it after the last input, libFuzzer never. */
void kiln_fuzz_summary(FILE *f);

/* An invariant of the library that an input broke: say which, then abort so
 * that libFuzzer (or the driver's handler) keeps the input. */
#define FUZZ_CHECK(cond, ...)                                                                                         \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "%s:%d: invariant failed: %s\n  ", __FILE__, __LINE__, #cond);                             \
            fprintf(stderr, __VA_ARGS__);                                                                              \
            fputc('\n', stderr);                                                                                       \
            abort();                                                                                                   \
        }                                                                                                              \
    } while (0)

#endif
