/* kiln — mixture-of-experts routing (included by kiln/ops.h).
 *
 * The router of Mixtral, Qwen2-MoE and Qwen3-MoE after its gate product
 * (a dense linear, kiln_op_dense_linear, of the tokens by the gate weight
 * [experts, hidden], whose output rounds the logits to the element type as
 * the model's linear does):
 *   logits   f16 or bf16 [T, experts] (bf16: sm_80 and later), read only;
 *   ids      u32 [T, top_k]   the chosen experts, by descending weight;
 *   weights  f32 [T, top_k]   their weights.
 * Semantics, per token t: p = softmax(f32(logits[t])) over the experts (in
 * f32, exp of the difference to the row's max, divided by the sum, as
 * torch.softmax(dtype=float32)); the top_k largest p, the lower expert on
 * ties: the experts torch.topk chooses on CUDA (it takes the lower experts
 * of a tie too, though it may list tied ones in another order; the MoE
 * output sums over them, so the order is immaterial); with normalize, each chosen weight
 * divided by the sum of the chosen (norm_topk_prob; Mixtral always). A NaN
 * logit ranks below every number (its row's weights are then NaN); ids are
 * always distinct experts below experts, whatever the logits hold.
 *
 * One launch, a warp a token, the token count a launch argument (one kernel
 * serves every batch); the kernel is specialized on the element type,
 * experts, top_k and normalize. Checked at encode (KILN_ERR_RUNTIME_CONTRACT
 * naming the binding, the expected and the actual value): dtypes and dims,
 * 1 <= experts <= KILN_MOE_MAX_EXPERTS, 1 <= top_k <= min(experts,
 * KILN_MOE_MAX_TOP_K), 1 <= T <= 2^31 - 1, and that ids and weights overlap
 * nothing. The command is replayable (its key: the kernel's fingerprint,
 * every binding's address and bytes, T). Needs a runtime (KILN_ERR_NO_DEVICE
 * offline); errors from acquiring the kernel pass through.
 */
#ifndef KILN_OP_MOE_H
#define KILN_OP_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/jit.h"
#include "kiln/runtime.h"
#include "kiln/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_MOE_MAX_EXPERTS 512
#define KILN_MOE_MAX_TOP_K 16

struct kiln_tensor;

typedef struct kiln_moe_router_desc {
    /* sizeof(kiln_moe_router_desc), or 0 (the same). */
    uint32_t size;
    const struct kiln_tensor *logits, *ids, *weights;
    uint32_t top_k;
    int normalize; /* nonzero: the chosen weights sum to 1 */
} kiln_moe_router_desc;

KILN_API kiln_status kiln_op_moe_router_encode(kiln_jit *jit, const kiln_moe_router_desc *desc, kiln_command **cmd);
/* Encodes and submits on the runtime's own stream (kiln_runtime_stream). */
KILN_API kiln_status kiln_op_moe_router(kiln_jit *jit, const kiln_moe_router_desc *desc);

/* The specialization for an element type (f16 or bf16), experts, top_k and
 * normalize (0 or 1). KILN_ERR_RUNTIME_CONTRACT for sizes out of range. */
KILN_API kiln_status kiln_op_moe_router_spec(kiln_dtype elt, int64_t experts, int64_t top_k, int normalize,
                                             kiln_spec *out);
/* Workspace: none (0 bytes). KILN_ERR_INVALID_ARGUMENT for a NULL out. */
KILN_API kiln_status kiln_op_moe_router_workspace(int64_t tokens, int64_t experts, size_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
