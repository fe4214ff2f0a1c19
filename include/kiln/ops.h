/* kiln — operations (providers).
 *
 * Each operation validates its invocation against its contract (bindings,
 * element types, dimensions) and fails with KILN_ERR_RUNTIME_CONTRACT naming
 * the binding, the expected and the actual value; then it acquires its
 * specialized kernel through the jit (compiled at most once, ever, thanks to
 * the cache database) and enqueues it on the jit's runtime.
 */
#ifndef KILN_OPS_H
#define KILN_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/jit.h"
#include "kiln/runtime.h"
#include "kiln/status.h"
#include "kiln/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_TENSOR_MAX_RANK 4

/* A view of a buffer: dense, row-major, starting offset bytes in. */
typedef struct kiln_tensor {
    kiln_buffer *buffer; /* borrowed */
    size_t offset;
    kiln_dtype dtype;
    uint32_t rank;
    int64_t dims[KILN_TENSOR_MAX_RANK];
} kiln_tensor;

/* Token embedding: out[t, :] = table[ids[t], :].
 *   table f16 or bf16 [vocab, hidden], ids u32 [tokens], out [tokens, hidden]
 *   of the table's dtype (bf16 needs sm_80 or later; any other dtype, or an
 *   out of another, is KILN_ERR_RUNTIME_CONTRACT naming the binding).
 * Specialized on the element type, hidden and vocab. Any number of tokens (launches are chunked
 * at 65535 tokens). A token id at or past vocab is never read: its output row
 * is zeroed and the next kiln_runtime_synchronize returns
 * KILN_ERR_DEVICE_CONTRACT with the lowest such index and its id. Enqueued
 * on the runtime's own stream (kiln_runtime_stream); needs a runtime
 * (KILN_ERR_NO_DEVICE offline). */
KILN_API kiln_status kiln_op_token_embedding(kiln_jit *jit, const kiln_tensor *table, const kiln_tensor *ids,
                                             const kiln_tensor *out);

/* The same, as a command to submit on any stream of the jit's runtime (it
 * retains the three regions; replayable: its key is the kernel's fingerprint
 * and its launch arguments). Released with kiln_command_release. */
KILN_API kiln_status kiln_op_token_embedding_encode(kiln_jit *jit, const kiln_tensor *table, const kiln_tensor *ids,
                                                    const kiln_tensor *out, kiln_command **cmd);

/* The specialization kiln_op_token_embedding uses for a table of element type
 * elt (KILN_DTYPE_F16 or KILN_DTYPE_BF16) and these sizes, for a vector width
 * of 8 (every row 16-byte aligned, which buffers from kiln_buffer_create
 * give) or 1. */
KILN_API kiln_status kiln_op_token_embedding_spec(kiln_dtype elt, int64_t vocab, int64_t hidden, int vector_width,
                                                  kiln_spec *out);

#ifdef __cplusplus
}
#endif

#include "kiln/op_dense.h"
#include "kiln/op_norm.h"
#include "kiln/op_sample.h"
#include "kiln/op_recurrent.h"
#include "kiln/op_attention.h"
#include "kiln/op_moe.h"
#endif
