/* The dense linear's path for a few tokens (templates/skinny_linear.cu): a
 * weight-streaming kernel on the tensor cores, launched with programmatic
 * dependent launch, that providers/linear.c takes instead of cuBLASLt where
 * it applies (kiln__skinny_linear_applies). */
#ifndef KILN_PROVIDERS_SKINNY_H
#define KILN_PROVIDERS_SKINNY_H
#include "kiln/kiln.h"
#include "providers/internal.h"

/* The most tokens the path takes. */
#define KILN__SKINNY_MAX_TOKENS 8

/* Whether the path serves tokens x in -> out on this runtime: tokens in [1,
 * KILN__SKINNY_MAX_TOKENS], in a multiple of 32, x and weight 16-byte
 * aligned (dx, dw: their device addresses), an sm_80+ device, and not
 * turned off ($KILN_SKINNY=0). */
int kiln__skinny_linear_applies(kiln_runtime *rt, int64_t tokens, int64_t in, uint64_t dx, uint64_t dw);

/* The specialization for in (a multiple of 32, at most INT32_MAX). */
kiln_status kiln__skinny_linear_spec(int64_t in, kiln_spec *out);

/* A command for out = x weightᵀ (+ bias) through the path; the bindings are
 * checked (linear.c), regions and key made here. */
kiln_status kiln__skinny_linear_encode(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight,
                                       const kiln_tensor *bias, const kiln_tensor *out, const kiln_region *regions,
                                       size_t n_regions, kiln_command **cmd);

/* The model's specializations: in = hidden_size, intermediate_size and
 * num_attention_heads * head_dim (what its projections read), once each. */
kiln_status kiln__skinny_linear_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
#endif
