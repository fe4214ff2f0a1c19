/* kiln provider internals: contract checks shared by every operation. Not API. */
#ifndef KILN_PROVIDERS_INTERNAL_H
#define KILN_PROVIDERS_INTERNAL_H

#include "common/internal.h"
#include "kiln/model.h"
#include "kiln/ops.h"
#include "runtime/internal.h"

/* Checks one binding: present, on rt, of dtype and rank, dims within (0,
 * max_dim] (a dim of -1 in want is not checked), its bytes inside the buffer
 * and its offset aligned to its element. Names op, binding and values. */
kiln_status kiln__check_tensor(kiln__errslot *err, const char *op, const char *binding, const kiln_tensor *t,
                               kiln_runtime *rt, kiln_dtype dtype, uint32_t rank, const int64_t *want,
                               size_t *bytes);
/* Whether two bindings' byte ranges overlap in one buffer. */
int kiln__tensors_overlap(const kiln_tensor *a, size_t a_bytes, const kiln_tensor *b, size_t b_bytes);

/* Each provider adds the specializations a model needs. */
typedef kiln_status (*kiln__spec_sink)(void *user, const kiln_spec *spec);
kiln_status kiln__token_embedding_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
kiln_status kiln__rms_norm_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
kiln_status kiln__residual_add_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
kiln_status kiln__masked_argmax_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);

/* Validation alone (no jit, no launch), for encode and for the CPU tests. *vec
 * is the vector width the bindings allow (8 or 1). */
kiln_status kiln__rms_norm_check(kiln_runtime *rt, const kiln_tensor *x, const kiln_tensor *residual,
                                 const kiln_tensor *weight, float eps, const kiln_tensor *out, int *vec);
kiln_status kiln__residual_add_check(kiln_runtime *rt, const kiln_tensor *a, const kiln_tensor *b,
                                     const kiln_tensor *out, int *vec);
/* bytes[7]: each binding's bytes, in the order of kiln_masked_argmax_bindings. */
kiln_status kiln__masked_argmax_check(kiln_runtime *rt, const kiln_masked_argmax_bindings *b, size_t bytes[7],
                                      int *vec);
kiln_status kiln__dense_swiglu_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
kiln_status kiln__last_token_linear_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);

#endif
