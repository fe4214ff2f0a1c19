/* The files of templates/, embedded at build time (cmake/embed.cmake). */
#ifndef KILN_JIT_EMBEDDED_H
#define KILN_JIT_EMBEDDED_H

#include <stddef.h>

typedef struct kiln__embedded_file {
    const char *name; /* "token_embedding.cu", "kiln_prelude.cuh" */
    const char *data; /* NUL-terminated */
    size_t size;      /* without the NUL */
} kiln__embedded_file;

extern const kiln__embedded_file kiln__embedded_files[];
extern const size_t kiln__embedded_count;

#endif
