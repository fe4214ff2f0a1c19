/* Element types. */
#include "kiln/types.h"

const char *kiln_dtype_name(kiln_dtype t)
{
    switch (t) {
    case KILN_DTYPE_BYTES: return "bytes";
    case KILN_DTYPE_F16: return "f16";
    case KILN_DTYPE_F32: return "f32";
    case KILN_DTYPE_U32: return "u32";
    case KILN_DTYPE_U8: return "u8";
    case KILN_DTYPE_BF16: return "bf16";
    case KILN_DTYPE_I32: return "i32";
    }
    return "unknown";
}

size_t kiln_dtype_size(kiln_dtype t)
{
    switch (t) {
    case KILN_DTYPE_F16:
    case KILN_DTYPE_BF16: return 2;
    case KILN_DTYPE_F32:
    case KILN_DTYPE_U32:
    case KILN_DTYPE_I32: return 4;
    case KILN_DTYPE_U8:
    case KILN_DTYPE_BYTES: return 1;
    }
    return 0;
}

