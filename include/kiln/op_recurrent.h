/* kiln — gated delta recurrent attention, the linear-attention layer of
 * Qwen3-Next (included by kiln/ops.h).
 *
 * For each sequence s of a batch, its span of packed tokens
 * (start, count) = spans[s], each value head h and its key head
 * kh = h / (VH / KH) (value heads share key heads in groups, as Qwen3-Next's
 * repeat_interleave), for t = start .. start + count - 1 in order:
 *   k̂ = k[t, kh] / sqrt(|k[t, kh]|² + 1e-6)
 *   q̂ = q[t, kh] / sqrt(|q[t, kh]|² + 1e-6) / sqrt(DK)
 *   a = exp(g[t, h])
 *   S = a·S;  S += beta[t, h] · (v[t, h] − S k̂) k̂ᵀ;  out[t, h] = S q̂
 * where S = state[s, h] is updated in place.
 *
 * What the operation does and what it expects done:
 *   does:    the L2 normalization of q and k per head (eps 1e-6 inside the
 *            square root, Qwen3-Next's use_qk_l2norm_in_kernel) and the
 *            1/sqrt(DK) scale of q; exp of g; f32 arithmetic throughout
 *            (the chunked kernel's tensor-core products take their f32
 *            operands as one f16 term, as fla's kernels take their input
 *            type; as two, hi and lo, about 22 bits, where
 *            $KILN_GATED_DELTA_TERMS is 2: about twice the tensor-core
 *            work, a tighter bound below);
 *   expects: q, k, v after the causal conv1d and SiLU; g the log decay
 *            (Qwen3-Next: -exp(A_log) · softplus(a + dt_bias)), finite and
 *            <= 0 for a decay; beta already through the sigmoid, in (0, 1);
 *            the output gated RMSNorm and the projections are other
 *            operations.
 *
 * Bindings (T tokens, S sequences, KH key heads, VH value heads; the element
 * type E is f16, or bf16 on sm_80 and later: q's, which k, v and out must
 * share; g, beta and state are f32 whatever E is):
 *   q, k   E [T, KH, DK]
 *   v      E [T, VH, DV]
 *   g      f32 [T, VH]      log decay
 *   beta   f32 [T, VH]      (f32 rather than f16: it is one number per head
 *                           and token, and the recurrence is sensitive to it)
 *   state  f32 [S, VH, DV, DK], updated in place. Layout: state[s, h, i, j]
 *          is row i (value component) and column j (key component) of
 *          S ∈ R^{DV×DK}, at element ((s·VH + h)·DV + i)·DK + j; rows are
 *          contiguous along the key dimension. Hugging Face and fla keep
 *          [B, H, DK, DV]: transpose the last two dims to exchange states.
 *          A new sequence starts from zeros (kiln_command_zero).
 *   spans  u32 [S, 2]       (start, count) in packed token rows, in device
 *                           memory: the same command serves every batch of
 *                           the same sizes. Decode is count 1 per sequence;
 *                           prefill is a longer span; both in one launch.
 *   out    E [T, VH, DV]    written for the tokens of the spans only.
 * DK, DV in [1, KILN_MODEL_MAX_HEAD_DIM], KH dividing VH <= KILN_MODEL_MAX_HEADS,
 * T <= 2^32 - 1, S · VH · ceil(DV / rows per block) < 2^31.
 *
 * Spans: a count of 0 leaves the sequence's state alone. A span that ends
 * past T is never read: the sequence's state and outputs are left alone, and
 * the next synchronize returns KILN_ERR_DEVICE_CONTRACT for fault code
 * KILN_FAULT_GATED_DELTA_SPAN (index: the lowest such sequence; value: start +
 * count, saturated to 2^32 - 1; limit: T). Spans of different sequences must
 * not share tokens (their outputs would race); that is not checked.
 *
 * Overlaps: state, out and the workspace overlap nothing (each other
 * included); q, k, v, g, beta and spans are read only and may share bytes.
 *
 * Two kernels compute it, chosen at encode; both serve any spans:
 *   the sequential scan (templates/gated_delta.cu), for decode: one block
 *   per (sequence, value head, group of rows of S), each row kept in
 *   registers across the span. Specialized on E, DK, DV, KH, VH and a vector
 *   width (4 when DK % 4 == 0, q and k start 8-byte and state 16-byte
 *   aligned, which buffers from kiln_buffer_create give; else 1);
 *   the chunked form (templates/gated_delta_chunk.cu), for prefill: chunks
 *   of 64 tokens in the WY / UT representation, tensor-core products within
 *   a chunk and the f32 state carried across chunks, one block per
 *   (sequence, value head, 32 or 64 rows of S). Specialized on E, DK, DV, KH,
 *   VH, the rows a block and a vector width (8 when DK and DV are multiples
 *   of 8, q, k, v 16-byte and state 8-byte aligned; else 1).
 * The chunked kernel runs where the device is sm_80 or later with the shared
 * memory it needs (sm_80, sm_90 and later datacenter parts; not sm_86,
 * sm_89, sm_120), DK <= 128, and the spans are long: max_span_tokens (or,
 * where it is 0, T / S rounded up) at least KILN_GATED_DELTA_CHUNK_MIN_TOKENS.
 * $KILN_GATED_DELTA_CHUNK=0 keeps the scan everywhere; 32 or 64 sets the
 * chunked kernel's rows a block (where the device has the room), which is
 * otherwise chosen by the waves of blocks over the SMs. Against a float64
 * recurrence (tests/test_recurrent_gpu.c), the chunked form is within about
 * 7e-3 (out) and 2e-3 (state) of each row's scale, as fla's
 * chunk_gated_delta_rule is within 5e-3 and 3e-3 on the same measure; the
 * scan, and the chunked form in two terms ($KILN_GATED_DELTA_TERMS=2),
 * within 2e-3 (bf16 outputs add their own rounding).
 *
 * Workspace (optional; kiln_op_gated_delta_workspace gives its bytes): with
 * one bound, the chunked form may run keyed: a pre-pass, parallel over
 * (chunk, value head), finds what of each chunk depends on its k, q, g and
 * beta alone (the norms, the decays, the inverse T and the scores q·k) into
 * the workspace, and the chunked kernel reads them instead of finding them
 * on its sequential chain. Its out and state are the single kernel's bit
 * for bit. Where the vector width is 8 and out is 16-byte aligned, the rows
 * kernel runs in the keyed kernel's place (a warp to 16 rows of S, no block
 * barrier within a chunk; its results agree with the others within
 * rounding, not bit for bit): in one term (the default) or bf16 wherever
 * it can run; in f16 and two terms, where the keyed kernel's blocks of 64
 * rows (or of 32 where DV <= 32) would need more than one wave over the SMs
 * (e.g. several sequences). $KILN_GATED_DELTA_ROWS=1 takes it wherever it can run, 0
 * never. Where its blocks fit
 * the SMs beside one of the pre-pass's each (one long sequence, or in f16
 * two at 64 rows a block; sm_90), it runs streamed: the pre-pass deals its records
 * round a block an SM and flags each one in the workspace, and the rows
 * kernel, launched beside it, waits on its records' flags rather than on
 * the whole pre-pass ($KILN_GATED_DELTA_STREAM=0: never).
 * It runs where $KILN_GATED_DELTA_PREP is 1 (and the chunked
 * kernel runs), never where it is 0, and otherwise where the spans (the
 * hint above) are at least KILN_GATED_DELTA_PREP_MIN_TOKENS long. No workspace
 * (NULL) is the single kernel, as before. The workspace is written and read
 * within the command only (its contents need not survive it); it must be on
 * the runtime, 256-byte aligned on its device address, at least the bytes
 * the function gives for (q's element type, T, S, VH), and overlap no
 * binding. With it, spans that share tokens (see Spans) may also leave a
 * sequence uncomputed.
 *
 * Validation and errors as in kiln/op_norm.h: KILN_ERR_RUNTIME_CONTRACT names
 * the binding, the expected and the actual value; KILN_ERR_NO_DEVICE offline;
 * errors of acquiring the kernel pass through. The command is replayable (its
 * key: the kernel's fingerprint, every binding's address and bytes, the
 * workspace's and the form taken, T and S).
 * Attribution: op "gated_delta", packed, participants S, tokens T, 1 dispatch
 * (2 keyed).
 */
#ifndef KILN_OP_RECURRENT_H
#define KILN_OP_RECURRENT_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/jit.h"
#include "kiln/runtime.h"
#include "kiln/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The fault code of a span past the tokens (see above). */
#define KILN_FAULT_GATED_DELTA_SPAN 8u

struct kiln_tensor;

/* The span length from which the chunked kernel is chosen (see above). */
#define KILN_GATED_DELTA_CHUNK_MIN_TOKENS 16u
/* The span length from which the keyed chunked form is chosen where a
 * workspace is bound (see above): the shortest of bench/bench_recurrent.c's
 * prefill shapes, at every one of which (16 x 256 to 1 x 16384 tokens) the
 * keyed form was the faster on an H200. */
#define KILN_GATED_DELTA_PREP_MIN_TOKENS 256u

/* The bindings, by reference (borrowed for the call). */
typedef struct kiln_gated_delta_bindings {
    /* sizeof(kiln_gated_delta_bindings), or 0 (the same). A larger one is
     * read as far as this header's; one that ends at out (the first layout)
     * reads max_span_tokens as 0; a smaller one is KILN_ERR_INVALID_ARGUMENT. */
    uint32_t size;
    const struct kiln_tensor *q, *k, *v, *g, *beta, *state, *spans, *out;
    /* Appended: the most tokens the caller expects in one span, a hint read
     * at encode that picks the command's kernel and never limits the spans
     * (every span is computed, whatever it says): 1 for decode, the longest
     * prompt part for prefill. 0: T / S rounded up. */
    uint32_t max_span_tokens;
    /* Appended (a struct whose size ends at max_span_tokens has none): the
     * workspace, by reference (borrowed for the call; the command keeps its
     * address), or NULL. */
    const kiln_region *workspace;
} kiln_gated_delta_bindings;

KILN_API kiln_status kiln_op_gated_delta_encode(kiln_jit *jit, const kiln_gated_delta_bindings *b,
                                                kiln_command **cmd);
/* Encodes and submits on the runtime's own stream (kiln_runtime_stream). */
KILN_API kiln_status kiln_op_gated_delta(kiln_jit *jit, const kiln_gated_delta_bindings *b);

/* Bytes of the state of seqs sequences: seqs · vh · dv · dk · 4.
 * KILN_ERR_RUNTIME_CONTRACT for sizes out of range (or an overflow),
 * KILN_ERR_INVALID_ARGUMENT for a NULL bytes. */
KILN_API kiln_status kiln_op_gated_delta_state_bytes(int64_t seqs, int64_t num_v_heads, int64_t dv, int64_t dk,
                                                     size_t *bytes);
/* Bytes of the workspace (see above) of a command of element type elt
 * (q's), T = tokens, S = seqs and num_v_heads value heads: (ceil(T / 64) +
 * S) · VH records, one per (chunk of a sequence, value head), of 22272 bytes
 * in f16 and 55040 in bf16 (the chunk's k and q rows rewritten as f16, which
 * the rows kernel reads), and a 4-byte flag each; spans that share no
 * tokens have at most that many chunks. KILN_ERR_RUNTIME_CONTRACT for elt
 * not f16 or bf16, tokens outside [0, 2^32 - 1], seqs outside [1, 2^31 -
 * 1], num_v_heads outside [1, KILN_MODEL_MAX_HEADS] or an overflow;
 * KILN_ERR_INVALID_ARGUMENT for a NULL bytes. */
KILN_API kiln_status kiln_op_gated_delta_workspace(kiln_dtype elt, int64_t tokens, int64_t seqs,
                                                   int64_t num_v_heads, size_t *bytes);

/* The specialization for the element type elt (KILN_DTYPE_F16 or
 * KILN_DTYPE_BF16), these sizes and a vector width (4: dk % 4 == 0; or 1).
 * KILN_ERR_RUNTIME_CONTRACT for another elt or sizes out of range,
 * KILN_ERR_INVALID_ARGUMENT for a NULL out. */
KILN_API kiln_status kiln_op_gated_delta_spec(kiln_dtype elt, int64_t dk, int64_t dv, int64_t num_k_heads,
                                              int64_t num_v_heads, int vector_width, kiln_spec *out);
/* The chunked kernel's specialization: elt f16 or bf16, dk 1..128, rows a
 * block 32 or 64, a vector width 8 (dk and dv multiples of 8) or 1.
 * KILN_ERR_RUNTIME_CONTRACT for another elt or sizes out of range,
 * KILN_ERR_INVALID_ARGUMENT for a NULL out. */
KILN_API kiln_status kiln_op_gated_delta_chunk_spec(kiln_dtype elt, int64_t dk, int64_t dv, int64_t num_k_heads,
                                                    int64_t num_v_heads, int rows, int vector_width, kiln_spec *out);

#ifdef __cplusplus
}
#endif
#endif
