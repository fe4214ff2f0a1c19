/* kiln — last-token masked argmax with repetition penalty (included by
 * kiln/ops.h).
 *
 * For P participants (the sequences of a batch), each with its last token's
 * logits row:
 *   logits      f16 or bf16 [P, vocab] (bf16: sm_80 and later), read, never written;
 *   valid       u8  [vocab]      nonzero: the token may be chosen (one mask for all);
 *   rep_ids     u32 [R]          every participant's repetition ids, concatenated;
 *                                R is a capacity: rep_offsets says which are used;
 *   rep_offsets u32 [P + 1]      participant p's ids are rep_ids[rep_offsets[p] ..
 *                                rep_offsets[p + 1]) (read on the device: they
 *                                may change every step without a new command);
 *   penalty     f32 [1]          on the device; a finite number > 0 (1: none);
 *   workspace   u8  [>= kiln_op_masked_argmax_workspace(vocab, P)]:
 *                                P * align16(vocab * 2) bytes, the seed's
 *                                contract; reserved, its contents undefined after
 *                                the call (this implementation does not use it);
 *   out         u32 [P].
 * Semantics: l = logits[p, t] in f32; a repeated token (listed once or more)
 * gets l / penalty when l > 0, else l * penalty (f32, round to nearest, as
 * Hugging Face's repetition penalty); a token is eligible when valid[t] != 0
 * and l is not NaN; out[p] is the eligible token of largest l, the lowest
 * index on ties (-0 equals +0); KILN_ARGMAX_NONE when none is eligible. Ids
 * at or past vocab are ignored; offsets past R are clamped to R and a range
 * that ends before it starts is empty (never an out-of-bounds read).
 *
 * One launch; a cluster of 16 blocks per participant (a non-portable cluster
 * size; 8 where the device cannot schedule 16), sm_90 and later. The
 * kernel is specialized on the logits' element type and vocab (and a vector
 * width: 8 when vocab % 8 == 0,
 * logits start 16-byte and valid 8-byte aligned; else 1). Validation and
 * errors as in kiln/op_norm.h; the command is replayable (its key: the
 * kernel's fingerprint, every binding's address and bytes, P and R).
 */
#ifndef KILN_OP_SAMPLE_H
#define KILN_OP_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/jit.h"
#include "kiln/runtime.h"
#include "kiln/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What out[p] holds when participant p has no eligible token. */
#define KILN_ARGMAX_NONE 0xffffffffu

struct kiln_tensor;

/* The bindings, by reference (borrowed for the call). */
typedef struct kiln_masked_argmax_bindings {
    /* sizeof(kiln_masked_argmax_bindings), or 0 (the same). A larger one is
     * read as far as this header's; a smaller one is KILN_ERR_INVALID_ARGUMENT. */
    uint32_t size;
    const struct kiln_tensor *logits, *valid, *rep_ids, *rep_offsets, *penalty, *workspace, *out;
} kiln_masked_argmax_bindings;

KILN_API kiln_status kiln_op_masked_argmax_encode(kiln_jit *jit, const kiln_masked_argmax_bindings *b,
                                                  kiln_command **cmd);
KILN_API kiln_status kiln_op_masked_argmax(kiln_jit *jit, const kiln_masked_argmax_bindings *b);

/* The workspace bytes: participants * align16(vocab * 2).
 * KILN_ERR_RUNTIME_CONTRACT for sizes out of range, KILN_ERR_INVALID_ARGUMENT for NULL. */
KILN_API kiln_status kiln_op_masked_argmax_workspace(int64_t vocab, int64_t participants, size_t *bytes);

/* The specialization for logits of element type elt (KILN_DTYPE_F16 or
 * KILN_DTYPE_BF16), a vocabulary and a vector width (8: vocab % 8 == 0; or 1). */
KILN_API kiln_status kiln_op_masked_argmax_spec(kiln_dtype elt, int64_t vocab, int vector_width, kiln_spec *out);

#ifdef __cplusplus
}
#endif
#endif
