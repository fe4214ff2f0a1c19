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

/* ---- routed SwiGLU experts, with an optional shared expert ----
 * The experts of Mixtral, Qwen2-MoE and Qwen3-MoE after the router:
 *   out[t] = elt( sum_s weights[t, s] · y(t, s)  +  c(t) · shared[t] )
 *   y(t, s) = elt( h · down[e]ᵀ ),  h = elt( silu(g) · u ),
 *   [g | u] = x[t] · gate_up[e]ᵀ (f32, not rounded),  e = ids[t, s];
 *   c(t) = sigmoid(x[t] · shared_gate) with shared_gate (Qwen2-MoE's
 *   shared_expert_gate, the dot product in f32), 1 without it; the term is
 *   absent without shared. Bindings:
 *   x        elt [T, hidden] (f16 or bf16; bf16 on sm_80 and later);
 *   ids      u32 [T, top_k], weights f32 [T, top_k] (kiln_op_moe_router's);
 *   gate_up  elt [experts, 2·inter, hidden]: expert e's rows [0, inter) its
 *            gate_proj, [inter, 2·inter) its up_proj (the dense SwiGLU's
 *            layout, one expert after another);
 *   down     elt [experts, hidden, inter] (each expert's down_proj);
 *   shared   elt [T, hidden] or NULL: the shared expert's output (a dense
 *            SwiGLU and linear the caller ran on x), added;
 *   shared_gate elt [hidden] or NULL (only with shared);
 *   out      elt [T, hidden].
 * hidden a multiple of 128, inter a multiple of 64, 1 <= experts <=
 * KILN_MOE_MAX_EXPERTS, 1 <= top_k <= min(experts, KILN_MOE_MAX_TOP_K),
 * 1 <= T · top_k <= 1,000,000 (a command's pairs); every binding 16-byte
 * aligned; out, ids and weights
 * overlap nothing written. The workspace (kiln_op_moe_experts_workspace
 * bytes, 256-byte aligned) holds the grouping, h and y.
 * Four launches: the (token, slot) pairs grouped by expert on the device (a
 * count kernel first past 2048 pairs, then a block a slice of 2048; a
 * permutation and a tile list in the workspace: the host never sees the
 * routing, so one command serves every step whatever it routes); the gate_up
 * product of every selected expert's rows with its silu(g)·u epilogue, one
 * grouped launch; the down product likewise; the weighted combine back into
 * token order (with the shared term), f32 sums added in slot order, one
 * rounding. The grouped products are tensor-core tiles (mma.sync) that read
 * only the selected experts' weights, each once per tile of 16 rows (fewer
 * than 32 pairs per selected expert on average: the decode step) or 64 rows
 * (a prefill) of the expert's tokens. On sm_90 a step of at most 8 tokens
 * and 16 pairs (KILN_MOE_TMA in the README) runs three launches instead: the two
 * products fed by TMA, each block planning from the ids itself, then the
 * combine. An id at or past experts is reported by the device (the
 * runtime's fault record: KILN_ERR_DEVICE_CONTRACT at the next
 * synchronization, naming the pair and the id) and its slot adds nothing.
 * Replayable (its key: the kernel's fingerprint, every binding's address,
 * T, the tile size, or on the TMA path its stages and threads). Attribution:
 * op "moe_experts", tokens T, 4 dispatches (5 past 2048 pairs, 3 on the
 * TMA path).
 * Checked at encode as the router is (KILN_ERR_RUNTIME_CONTRACT naming the
 * binding, the expected and the actual). */
typedef struct kiln_moe_experts_desc {
    /* sizeof(kiln_moe_experts_desc), or 0 (the same). */
    uint32_t size;
    const struct kiln_tensor *x, *ids, *weights, *gate_up, *down;
    const struct kiln_tensor *shared, *shared_gate; /* optional */
    const struct kiln_tensor *out;
    const kiln_region *workspace;
} kiln_moe_experts_desc;

KILN_API kiln_status kiln_op_moe_experts_encode(kiln_jit *jit, const kiln_moe_experts_desc *desc, kiln_command **cmd);
/* Encodes and submits on the runtime's own stream (kiln_runtime_stream). */
KILN_API kiln_status kiln_op_moe_experts(kiln_jit *jit, const kiln_moe_experts_desc *desc);
/* The specialization for an element type, hidden, inter, experts and top_k
 * (one kernel image holds every launch of both tile sizes).
 * KILN_ERR_RUNTIME_CONTRACT for sizes out of range, naming them. */
KILN_API kiln_status kiln_op_moe_experts_spec(kiln_dtype elt, int64_t hidden, int64_t inter, int64_t experts,
                                              int64_t top_k, kiln_spec *out);
/* Workspace bytes for T tokens (a command for fewer tokens fits in it). */
KILN_API kiln_status kiln_op_moe_experts_workspace(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts,
                                                   int64_t top_k, size_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
