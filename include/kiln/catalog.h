/* kiln — the operation catalog: every operation kiln provides, with what an
 * engine needs to plan by operation id before it encodes anything.
 *
 * The op id is the one an operation's commands carry (kiln_command_desc's
 * op_id, the attribution rows); each has its kiln_op_<id>_encode in the
 * op_*.h headers. The catalog is static: the same for every call, thread and
 * runtime of a build. Its provider versions are part of the runtime's
 * implementation fingerprint (kiln_runtime_info), and a runtime's
 * capabilities hold the ones its operations need.
 */
#ifndef KILN_CATALOG_H
#define KILN_CATALOG_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/export.h"
#include "kiln/runtime.h"
#include "kiln/status.h"
#include "kiln/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One operation. The strings are static: valid for the process's lifetime. */
typedef struct kiln_op_info {
    uint32_t size;          /* set by the caller: sizeof(kiln_op_info), or 0 (the same) */
    const char *id;         /* "dense_linear" */
    uint32_t version;       /* its provider's version */
    uint32_t capabilities;  /* the KILN_CAP_* it needs of a runtime */
    uint32_t dtypes;        /* bit (1u << KILN_DTYPE_*) per element type of its activations and weights */
    uint32_t batching;      /* bit (1u << KILN_BATCHING_*) per form its commands take */
    const char *templates;  /* its kernels' template ids, space-separated ("swiglu tma_swiglu skinny_linear") */
    const char *workspace;  /* its workspace estimator ("kiln_op_dense_linear_workspace"), or NULL: none */
} kiln_op_info;

/* Lists the operations, size-then-fill. With ops NULL, sets *count to how
 * many there are. Otherwise fills the first min(*count, total) of ops and
 * sets *count to the total (more than the caller's *count: the list was cut
 * short). The caller sets ops[0].size (0 means sizeof(kiln_op_info)); the
 * elements are that many bytes apart, and each gets the fields that fit in
 * it (its size field says how many bytes were written). Thread-safe.
 *   KILN_OK;
 *   KILN_ERR_INVALID_ARGUMENT: count is NULL, or ops[0].size is 1, 2 or 3
 *   (*count > 0). */
KILN_API kiln_status kiln_op_catalog(kiln_op_info *ops, size_t *count);

/* The operation of op id id into *out (out->size set as for kiln_op_catalog).
 *   KILN_OK;
 *   KILN_ERR_INVALID_ARGUMENT: id or out is NULL, or out->size is 1, 2 or 3;
 *   KILN_ERR_NOT_FOUND: no operation has that id. */
KILN_API kiln_status kiln_op_catalog_find(const char *id, kiln_op_info *out);

#ifdef __cplusplus
}
#endif
#endif
