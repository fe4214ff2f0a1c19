/* The dense linear's path for a few tokens (templates/skinny_linear.cu): a
 * weight-streaming kernel on the tensor cores (launched with programmatic
 * dependent launch in its gated form and wide variant only: skinny_linear.c
 * says why), that
 * providers/linear.c and providers/swiglu.c take instead of cuBLASLt where it
 * applies (kiln__skinny_linear_applies). */
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

/* The specialization for in (a multiple of 32, at most INT32_MAX), plain
 * (glu 0) or gated (glu 1: out = silu(gate) * up of a [2 n_out, in] weight);
 * wide: the variant compiled for more blocks an SM (fewer registers), which
 * a product takes when that puts its grid in one wave instead of two. */
kiln_status kiln__skinny_linear_spec(kiln_dtype elt, int64_t in, int glu, int wide, kiln_spec *out);

/* A command of op (its attribution) for out = x weightᵀ (+ bias), or with glu
 * out = silu(x gateᵀ) * (x upᵀ) where weight is [gate; up] (no bias), through
 * the path; the bindings are checked by the caller (linear.c, swiglu.c),
 * regions given, the key made here. */
kiln_status kiln__skinny_linear_encode(kiln_jit *jit, const char *op, const kiln_tensor *x,
                                       const kiln_tensor *weight, const kiln_tensor *bias, int glu,
                                       const kiln_tensor *out, const kiln_region *regions, size_t n_regions,
                                       kiln_command **cmd);

/* The path's launch, for a caller that enqueues it among its own dispatches
 * (providers/linear_norm.c): prepare fills l (and the kernel, for a replay
 * key) for out = x weightᵀ (+ bias) (glu: gated) into the device address
 * out; enqueue launches it; params writes what a replay key needs. */
typedef struct kiln__skinny {
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr x, w, bias, out;
    uint64_t in;
    uint32_t n_out, tokens;
    unsigned grid, threads;
    unsigned flags; /* KILN__LAUNCH_PDL or 0 */
} kiln__skinny;
kiln_status kiln__skinny_prepare(kiln_jit *jit, const kiln_tensor *x, const kiln_tensor *weight,
                                 const kiln_tensor *bias, int glu, CUdeviceptr out, kiln__skinny *l, kiln_kernel **k);
kiln_status kiln__skinny_enqueue(const kiln__skinny *l, const kiln_launch_context *ctx);
void kiln__skinny_params(const kiln__skinny *l, uint64_t params[7]);

/* The model's specializations (of cfg->dtype): plain, in both variants, for in =
 * hidden_size, intermediate_size and num_attention_heads * head_dim (what its
 * projections read), once each; gated for in = hidden_size (the MLP's
 * gate/up). */
kiln_status kiln__skinny_linear_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
#endif
