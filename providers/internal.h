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

#endif
