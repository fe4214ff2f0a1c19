/* kiln — version. Compare KILN_VERSION_NUMBER (the header you built against)
 * with kiln_version_number() (the library you run with). */
#ifndef KILN_VERSION_H
#define KILN_VERSION_H

#include "kiln/export.h"

#define KILN_VERSION_MAJOR 0
#define KILN_VERSION_MINOR 1
#define KILN_VERSION_PATCH 0
#define KILN_VERSION_NUMBER (KILN_VERSION_MAJOR * 10000 + KILN_VERSION_MINOR * 100 + KILN_VERSION_PATCH)
#define KILN_VERSION_STRING "0.1.0"

#ifdef __cplusplus
extern "C" {
#endif

KILN_API unsigned kiln_version_number(void);
KILN_API const char *kiln_version_string(void);

#ifdef __cplusplus
}
#endif
#endif
