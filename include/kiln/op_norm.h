/* kiln — RMSNorm, residual add and the per-head q/k RMSNorm (included by kiln/ops.h).
 *
 * Storage in one element type per call, f16 or bf16 (bf16 needs sm_80 or
 * later), named by x (a for residual add): every other binding is of the
 * same, or the call is refused naming it. f32 arithmetic, one rounding to the
 * element type per output element. Every row is one token of a packed batch:
 * the token count is a launch argument, not a specialization constant, so one
 * kernel serves every batch of a model. The kernels are specialized on the
 * element type and hidden (and on the vector width: 16-byte accesses when
 * hidden % 8 == 0 and every binding starts 16-byte aligned, which buffers
 * from kiln_buffer_create give; scalar otherwise).
 * Workspace: none.
 *
 * Validation fails with KILN_ERR_RUNTIME_CONTRACT and a message naming the
 * binding, the expected and the actual value (dtype, rank, dims, bytes,
 * alignment, overlaps, eps). Needs a runtime: KILN_ERR_NO_DEVICE offline.
 * Errors from acquiring the kernel (KILN_ERR_NVRTC_COMPILE, KILN_ERR_CACHE_*,
 * KILN_ERR_CUDA_*) pass through. The _encode forms return a command to submit
 * on any stream of the jit's runtime: it retains its regions and is
 * replayable (its key: the kernel's fingerprint, the entry, every binding's
 * address and bytes, the token count and eps). The plain forms encode and
 * submit on the runtime's own stream (kiln_runtime_stream).
 */
#ifndef KILN_OP_NORM_H
#define KILN_OP_NORM_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/jit.h"
#include "kiln/runtime.h"
#include "kiln/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kiln_tensor;

/* RMSNorm: out[t, :] = x[t, :] * weight / sqrt(mean(x[t, :]^2) + eps).
 *   x [tokens, hidden], weight [hidden], out [tokens, hidden], all f16 or all bf16;
 *   eps a finite number > 0; 1 <= tokens <= 2^31 - 1, hidden <= KILN_MODEL_MAX_HIDDEN.
 * out may be x itself (the same bytes); any other overlap is refused. */
KILN_API kiln_status kiln_op_rms_norm_encode(kiln_jit *jit, const struct kiln_tensor *x,
                                             const struct kiln_tensor *weight, float eps,
                                             const struct kiln_tensor *out, kiln_command **cmd);
KILN_API kiln_status kiln_op_rms_norm(kiln_jit *jit, const struct kiln_tensor *x, const struct kiln_tensor *weight,
                                      float eps, const struct kiln_tensor *out);

/* The fused form a decoder layer wants, with the residual updated in place:
 *   h = elt(x + residual); residual = h; out = rms_norm(h) as above.
 * The same bits as kiln_op_residual_add(x, residual -> residual) followed by
 * kiln_op_rms_norm(residual -> out). x, residual, out [tokens, hidden],
 * weight [hidden], all f16 or all bf16. out may be x itself; residual
 * overlaps nothing. */
KILN_API kiln_status kiln_op_rms_norm_residual_encode(kiln_jit *jit, const struct kiln_tensor *x,
                                                      const struct kiln_tensor *residual,
                                                      const struct kiln_tensor *weight, float eps,
                                                      const struct kiln_tensor *out, kiln_command **cmd);
KILN_API kiln_status kiln_op_rms_norm_residual(kiln_jit *jit, const struct kiln_tensor *x,
                                               const struct kiln_tensor *residual, const struct kiln_tensor *weight,
                                               float eps, const struct kiln_tensor *out);

/* The specialization both RMSNorm forms use (one module, two entries), for
 * element type elt (KILN_DTYPE_F16 or KILN_DTYPE_BF16) and a vector width of
 * 8 (hidden % 8 == 0, aligned bindings) or 1. */
KILN_API kiln_status kiln_op_rms_norm_spec(kiln_dtype elt, int64_t hidden, int vector_width, kiln_spec *out);

/* Residual add: out = elt(a + b), the sum rounded once to the element type;
 * all f16 or all bf16 [tokens, hidden]. out may be a or b itself (the same
 * bytes); a and b may overlap each other; any other overlap is refused. */
KILN_API kiln_status kiln_op_residual_add_encode(kiln_jit *jit, const struct kiln_tensor *a,
                                                 const struct kiln_tensor *b, const struct kiln_tensor *out,
                                                 kiln_command **cmd);
KILN_API kiln_status kiln_op_residual_add(kiln_jit *jit, const struct kiln_tensor *a, const struct kiln_tensor *b,
                                          const struct kiln_tensor *out);
KILN_API kiln_status kiln_op_residual_add_spec(kiln_dtype elt, int64_t hidden, int vector_width, kiln_spec *out);

/* Per-head RMSNorm of q and k (Qwen3's q_norm and k_norm, before RoPE), one
 * dispatch: each head vector v of head_dim elements, of every token, becomes
 *   v * w / sqrt(mean(v^2) + eps),
 * w = q_weight [head_dim] for q's heads and k_weight [head_dim] for k's.
 * Two forms (kiln_head_rms_norm_bindings):
 *   fused     qkv [T, (heads + 2 kv_heads) * head_dim] (row: q heads | k
 *             heads | v heads, as the paged attention's qkv), heads and
 *             kv_heads given; out of qkv's shape (may be qkv itself). v is
 *             neither read nor written (out's v columns keep their bytes);
 *   separate  q [T, heads, head_dim], k [T, kv_heads, head_dim] (qkv NULL;
 *             heads and kv_heads 0 or their dims), q_out and k_out of their
 *             shapes (each may be its input itself).
 * All f16 or all bf16, named by qkv (q); eps finite > 0; 1 <= T <= 2^31 - 1;
 * head_dim <= KILN_MODEL_MAX_HEAD_DIM; any overlap but out = input is
 * refused. Kernels specialized on the element type, head_dim, heads and
 * kv_heads (16-byte accesses when head_dim % 8 == 0 and every binding is
 * 16-byte aligned; scalar otherwise). Key: the kernel, every binding's
 * address and bytes, the row strides, T and eps. No workspace. Statuses as
 * above, and KILN_ERR_INVALID_ARGUMENT for NULL bindings or a size under
 * this layout's. Threading and lifetime as the other operations. */
typedef struct kiln_head_rms_norm_bindings {
    /* sizeof(kiln_head_rms_norm_bindings), or 0 (the same). A larger one is
     * read as far as this header's; a smaller one is KILN_ERR_INVALID_ARGUMENT. */
    uint32_t size;
    /* By reference (borrowed for the call). */
    const struct kiln_tensor *qkv, *out;               /* the fused form */
    const struct kiln_tensor *q, *k, *q_out, *k_out;   /* the separate form */
    const struct kiln_tensor *q_weight, *k_weight;
    int64_t heads, kv_heads;
    float eps;
} kiln_head_rms_norm_bindings;

KILN_API kiln_status kiln_op_head_rms_norm_encode(kiln_jit *jit, const kiln_head_rms_norm_bindings *b,
                                                  kiln_command **cmd);
KILN_API kiln_status kiln_op_head_rms_norm(kiln_jit *jit, const kiln_head_rms_norm_bindings *b);
/* The specialization of both forms, for element type elt, head_dim (1 to
 * KILN_MODEL_MAX_HEAD_DIM), heads and kv_heads (each in [1,
 * KILN_MODEL_MAX_HEADS]) and a vector width of 8 (head_dim % 8 == 0, aligned
 * bindings) or 1. */
KILN_API kiln_status kiln_op_head_rms_norm_spec(kiln_dtype elt, int64_t head_dim, int64_t heads, int64_t kv_heads,
                                                int vector_width, kiln_spec *out);

/* Workspace the operations need, in bytes: always 0 (kept for the uniform
 * provider interface). KILN_ERR_INVALID_ARGUMENT for a NULL out. */
KILN_API kiln_status kiln_op_rms_norm_workspace(int64_t tokens, int64_t hidden, size_t *bytes);
KILN_API kiln_status kiln_op_residual_add_workspace(int64_t tokens, int64_t hidden, size_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
