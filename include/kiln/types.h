/* kiln — element types shared by buffers, regions and operations. */
#ifndef KILN_TYPES_H
#define KILN_TYPES_H

#include <stddef.h>

#include "kiln/export.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kiln_dtype {
    KILN_DTYPE_BYTES = 0, /* untyped bytes */
    KILN_DTYPE_F16 = 1,
    KILN_DTYPE_F32 = 2,
    KILN_DTYPE_U32 = 3,
    KILN_DTYPE_U8 = 4,
    KILN_DTYPE_BF16 = 5,
    KILN_DTYPE_I32 = 6
} kiln_dtype;

KILN_API const char *kiln_dtype_name(kiln_dtype t);
KILN_API size_t kiln_dtype_size(kiln_dtype t);

#ifdef __cplusplus
}
#endif
#endif
