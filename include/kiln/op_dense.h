/* kiln — dense operations: linear, SwiGLU, last-token linear.
 *
 * Shared by all three:
 *   - f16 or bf16 storage (the element type, "elt" below: x's dtype; bf16
 *     on sm_80 and later), f32 accumulation (cuBLASLt with CUBLAS_COMPUTE_32F
 *     and f32 scale); every other 16-bit binding (weights, bias, residual,
 *     norm weight, out) must have x's element type, else the call is refused
 *     naming the binding and both dtypes; tensors are dense and row-major
 *     (kiln_tensor);
 *   - weights are [out, in] as Hugging Face stores them; the product is
 *     x · Wᵀ (+ bias), bias optional (NULL), elt [out];
 *   - the caller gives a workspace: a region of at least the op's
 *     *_workspace bytes, starting 256-byte aligned (buffers from
 *     kiln_buffer_create are), overlapping no other binding. A smaller one is
 *     refused naming both sizes. The cuBLASLt algorithm is chosen once per
 *     shape, element type and process (cublasLtMatmulAlgoGetHeuristic) and kept;
 *   - encode returns a command to submit on any stream of the jit's runtime;
 *     it retains its regions, allocates nothing when enqueued and never
 *     waits on the device, so it is replayable: its replay key is the provider
 *     id, the kernel fingerprint (when there is a kernel), the cuBLASLt
 *     algorithm, the sizes and the addresses it runs with;
 *   - the immediate kiln_op_* variants encode and submit on the runtime's
 *     own stream (kiln_runtime_stream);
 *   - errors: KILN_ERR_INVALID_ARGUMENT (NULL jit or cmd), KILN_ERR_NO_DEVICE
 *     (an offline jit), KILN_ERR_RUNTIME_CONTRACT (a binding's type, rank,
 *     dims, bounds, alignment or overlap; the message names the binding, what
 *     was expected and what was given), KILN_ERR_CUDA_BLAS (cuBLASLt missing
 *     or without an algorithm), the jit's errors (the SwiGLU and gather
 *     kernels), KILN_ERR_HOST_OUT_OF_MEMORY.
 * Threading: as kiln_jit (any thread); a command as kiln_runtime.h says.
 */
#ifndef KILN_OP_DENSE_H
#define KILN_OP_DENSE_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/jit.h"
#include "kiln/runtime.h"
#include "kiln/status.h"
#include "kiln/types.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kiln_tensor;

/* ---- dense linear ----
 * out[t, o] = sum_i x[t, i] · weight[o, i] (+ bias[o]).
 *   x elt [tokens, in], weight elt [out, in], bias elt [out] or NULL,
 *   out elt [tokens, out]; tokens, in, out at most 2^31 - 1.
 * One cuBLASLt call; or, for 1 to 8 tokens with in a multiple of 32, x and
 * weight 16-byte aligned and an sm_80+ device, kiln's own weight-streaming
 * kernel (templates/skinny_linear.cu: tensor-core products, f32 sums added in
 * a fixed order, the bias in f32, one rounding; $KILN_SKINNY=0 turns it
 * off). A product whose blocks would take two waves of the device's SMs and
 * fit in one at 3 blocks an SM takes the kernel's variant compiled for that.
 * Attribution: op "dense_linear", packed, 1 participant, tokens, 1 dispatch.
 * kiln_model_specializations lists the kernel, in both variants, for in =
 * hidden_size, intermediate_size and num_attention_heads * head_dim. */
KILN_API kiln_status kiln_op_dense_linear_workspace(int64_t tokens, int64_t in, int64_t out, size_t *bytes);
KILN_API kiln_status kiln_op_dense_linear_encode(kiln_jit *jit, const struct kiln_tensor *x,
                                                 const struct kiln_tensor *weight, const struct kiln_tensor *bias,
                                                 const struct kiln_tensor *out, const kiln_region *workspace,
                                                 kiln_command **cmd);
KILN_API kiln_status kiln_op_dense_linear(kiln_jit *jit, const struct kiln_tensor *x, const struct kiln_tensor *weight,
                                          const struct kiln_tensor *bias, const struct kiln_tensor *out,
                                          const kiln_region *workspace);

/* ---- dense linear, residual add, RMSNorm ----
 * The pair a decoder layer runs after its attention (o_proj, then the
 * post-attention norm) and its MLP (down_proj, then the next layer's input
 * norm), in one command:
 *   y = elt(x · weightᵀ); h = elt(y + residual); residual = h;
 *   out = h · norm_weight / sqrt(mean(h²) + eps)     (f32 sums, one rounding)
 *   x elt [tokens, in], weight elt [hidden, in], residual and out elt
 *   [tokens, hidden], norm_weight elt [hidden]; eps finite, > 0;
 *   tokens, in at most 2^31 - 1; hidden at most KILN_MODEL_MAX_HIDDEN.
 * The same as kiln_op_dense_linear into a scratch tensor, then
 * kiln_op_rms_norm_residual (up to the order of the product's f32 sums). The
 * product goes to the workspace past its first 32 MiB; for 1 to 8 tokens
 * through kiln's weight-streaming kernel (where the dense linear takes it),
 * for up to 64 tokens possibly as f32 partial products of K split in 1, 2
 * or 4 (one cuBLASLt call, no reduction kernel of cuBLASLt's own: the norm
 * kernel sums the parts), taken when the times of the candidates cuBLASLt
 * offered, measured at first sight of the shape, say it is faster; else one
 * cuBLASLt call for the elt product. From 9 to 32 tokens on sm_90 and later
 * (in a multiple of 64, hidden of 16 and at most 256 x (the SM count / the
 * part count), x and weight 16-byte aligned; $KILN_TMA=0 turns it off) kiln's
 * kernel templates/tma_linear.cu writes 4, 2 or 1 f32 parts instead, the
 * weight streamed by TMA; that kernel requests its first stages of weight
 * before the commands ahead of it on the stream have finished (programmatic
 * dependent launch): weight must not be written by a kernel that can still
 * be running on that stream (a model weight, uploaded by a transfer, is
 * never). residual and out overlap nothing else.
 * Attribution: op "dense_linear_norm", packed, 1 participant, tokens, 2
 * dispatches. The norm is kiln_op_rms_norm_spec's module (listed by
 * kiln_model_specializations, with the TMA kernel's). */
KILN_API kiln_status kiln_op_dense_linear_norm_workspace(int64_t tokens, int64_t in, int64_t hidden, size_t *bytes);
KILN_API kiln_status kiln_op_dense_linear_norm_encode(kiln_jit *jit, const struct kiln_tensor *x,
                                                      const struct kiln_tensor *weight,
                                                      const struct kiln_tensor *residual,
                                                      const struct kiln_tensor *norm_weight, float eps,
                                                      const struct kiln_tensor *out, const kiln_region *workspace,
                                                      kiln_command **cmd);
KILN_API kiln_status kiln_op_dense_linear_norm(kiln_jit *jit, const struct kiln_tensor *x,
                                               const struct kiln_tensor *weight, const struct kiln_tensor *residual,
                                               const struct kiln_tensor *norm_weight, float eps,
                                               const struct kiln_tensor *out, const kiln_region *workspace);

/* ---- dense SwiGLU ----
 * out[t, i] = silu(g[t, i]) · u[t, i], silu(v) = v / (1 + e^-v), where
 *   [g | u] = x · gate_upᵀ, x elt [tokens, hidden],
 *   gate_up elt [2·intermediate, hidden]: rows [0, intermediate) are the gate
 *   projection (HF's gate_proj), rows [intermediate, 2·intermediate) the up
 *   projection (up_proj), stacked in that order;
 *   out elt [tokens, intermediate].
 * One cuBLASLt call writes [g | u] as elt [tokens, 2·intermediate] at the
 * start of the workspace, past its first 32 MiB (it stays there after the
 * command ran: offset kiln_op_dense_swiglu_product_offset()); then the
 * kernel specialized on intermediate computes silu(g)·u in f32 and rounds to
 * elt. Attribution: op "dense_swiglu", packed, 1 participant, tokens, 2
 * dispatches. Where the dense linear would take kiln's own kernel (1 to 8
 * tokens, hidden a multiple of 32, ...: above), one kernel does both: its
 * gated form, silu(g)·u from g and u in f32, never rounded nor stored (the
 * workspace is not written), 1 dispatch; kiln_model_specializations lists it
 * (in = hidden_size) beside the elementwise kernel. From 9 to 32 tokens on
 * sm_90 and later (hidden a multiple of 64, intermediate a multiple of 8 and
 * at most 248 x the SM count, x and gate_up 16-byte aligned; $KILN_TMA=0
 * turns it off) one kernel does both as well (templates/tma_swiglu.cu: gate_up
 * streamed by TMA, g and u in f32 registers, the workspace not written), 1
 * dispatch, listed by kiln_model_specializations too. That kernel requests
 * its first stages of gate_up before the commands ahead of it on the stream
 * have finished (programmatic dependent launch): gate_up must not be written
 * by a kernel that can still be running on that stream (a model weight,
 * uploaded by a transfer, is never). */
KILN_API kiln_status kiln_op_dense_swiglu_workspace(int64_t tokens, int64_t hidden, int64_t intermediate,
                                                    size_t *bytes);
/* Where in the workspace the [g | u] product lies (bytes from its start). */
KILN_API size_t kiln_op_dense_swiglu_product_offset(void);
KILN_API kiln_status kiln_op_dense_swiglu_encode(kiln_jit *jit, const struct kiln_tensor *x,
                                                 const struct kiln_tensor *gate_up, const struct kiln_tensor *out,
                                                 const kiln_region *workspace, kiln_command **cmd);
KILN_API kiln_status kiln_op_dense_swiglu(kiln_jit *jit, const struct kiln_tensor *x, const struct kiln_tensor *gate_up,
                                          const struct kiln_tensor *out, const kiln_region *workspace);
/* The elementwise kernel's specialization for element type elt (f16 or bf16;
 * else KILN_ERR_RUNTIME_CONTRACT) and an intermediate size; vector
 * width 8 (16-byte accesses: intermediate a multiple of 8 and out 16-byte
 * aligned, what encode takes for buffers from kiln_buffer_create) or 1. */
KILN_API kiln_status kiln_op_dense_swiglu_spec(kiln_dtype elt, int64_t intermediate, int vector_width, kiln_spec *out);

/* ---- last-token dense linear ----
 * For each participant p, the last token of its span times weightᵀ:
 *   out[p, o] = sum_i x[row(p), i] · weight[o, i] (+ bias[o]).
 * spans u32 [participants, 2]: spans[p] = (start, length), in device memory
 * (so one command serves every batch whose spans change but whose sizes do
 * not). Coordinates follow x's rank:
 *   packed: x elt [tokens, in], row(p) = start + length - 1, which must be
 *           below tokens (start indexes the packed rows of the batch);
 *   source: x elt [participants, seq, in], row(p) = the participant's own
 *           row start + length - 1, which must be below seq.
 * weight elt [out, in], bias elt [out] or NULL, out elt [participants, out].
 * A kernel specialized on in gathers the participants' rows into the
 * workspace (past its first 32 MiB, [participants, in]); then one cuBLASLt
 * call computes all participants at once. A span with length 0 or past the
 * end is never read: its gathered row is zeroed (its output row is the bias,
 * or 0) and the next synchronize returns KILN_ERR_DEVICE_CONTRACT naming the
 * lowest such participant (fault code KILN_FAULT_EMPTY_SPAN or
 * KILN_FAULT_SPAN_PAST_END below). Attribution: op "last_token_linear",
 * packed, participants, tokens = the rows of x, 2 dispatches. */
#define KILN_FAULT_EMPTY_SPAN 2u    /* index: participant; value 0 */
#define KILN_FAULT_SPAN_PAST_END 3u /* index: participant; value start + length; limit tokens or seq */
KILN_API kiln_status kiln_op_last_token_linear_workspace(int64_t participants, int64_t in, int64_t out,
                                                         size_t *bytes);
KILN_API kiln_status kiln_op_last_token_linear_encode(kiln_jit *jit, const struct kiln_tensor *x,
                                                      const struct kiln_tensor *spans,
                                                      const struct kiln_tensor *weight,
                                                      const struct kiln_tensor *bias, const struct kiln_tensor *out,
                                                      const kiln_region *workspace, kiln_command **cmd);
KILN_API kiln_status kiln_op_last_token_linear(kiln_jit *jit, const struct kiln_tensor *x,
                                               const struct kiln_tensor *spans, const struct kiln_tensor *weight,
                                               const struct kiln_tensor *bias, const struct kiln_tensor *out,
                                               const kiln_region *workspace);
/* The gather kernel's specialization for element type elt (f16 or bf16) and
 * a row length; vector width 8 (in a
 * multiple of 8 and x 16-byte aligned) or 1. */
KILN_API kiln_status kiln_op_last_token_linear_spec(kiln_dtype elt, int64_t in, int vector_width, kiln_spec *out);

#ifdef __cplusplus
}
#endif
#endif
