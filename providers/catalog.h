/* The operation catalog (providers/catalog.c): one row per operation, the
 * only list of them. Prewarm's specializations, kiln_op_catalog, kiln
 * explain, the implementation fingerprint and the runtime's capability set
 * are derived from it. Not API. */
#ifndef KILN_PROVIDERS_CATALOG_H
#define KILN_PROVIDERS_CATALOG_H

#include "providers/internal.h"

/* Each provider's version: bumped by hand when its host-side logic changes
 * what it enqueues. Part of the implementation fingerprint, and of the
 * replay keys that carry a tag (KILN__KEY_TAG). */
#define KILN__VERSION_TOKEN_EMBEDDING 1
#define KILN__VERSION_RMS_NORM 1
#define KILN__VERSION_RMS_NORM_RESIDUAL 1
#define KILN__VERSION_RESIDUAL_ADD 1
#define KILN__VERSION_MOE_ROUTER 1
#define KILN__VERSION_MOE_EXPERTS 2
#define KILN__VERSION_HEAD_RMS_NORM 1
#define KILN__VERSION_MASKED_ARGMAX 1
#define KILN__VERSION_DENSE_LINEAR 1
#define KILN__VERSION_DENSE_SWIGLU 1
#define KILN__VERSION_DENSE_LINEAR_NORM 1
#define KILN__VERSION_LAST_TOKEN_LINEAR 1
#define KILN__VERSION_GATED_DELTA 4
#define KILN__VERSION_PAGED_ATTENTION 5

#define KILN__STR_(x) #x
#define KILN__STR(x) KILN__STR_(x)
/* A provider's part of a replay key: "kiln.<op>.<version>". */
#define KILN__KEY_TAG(op, version) "kiln." op "." KILN__STR(version)

typedef kiln_status (*kiln__specs_fn)(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
typedef kiln_status (*kiln__arch_specs_fn)(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                           void *user);

/* One operation. Exactly one of specs and arch_specs is set (arch_specs for
 * an operation whose kernels depend on the architecture). */
typedef struct kiln__op_row {
    const char *id;         /* the op id its commands carry */
    uint32_t version;       /* KILN__VERSION_* */
    uint32_t capabilities;  /* KILN_CAP_* it needs and so provides when a runtime has them */
    uint32_t dtypes;        /* 1u << KILN_DTYPE_*: its activations' and weights' element types */
    uint32_t batching;      /* 1u << KILN_BATCHING_*: its commands' forms */
    const char *templates;  /* its kernels' template ids, space-separated */
    const char *workspace;  /* its public workspace estimator's name, or NULL */
    kiln__specs_fn specs;
    kiln__arch_specs_fn arch_specs;
} kiln__op_row;

/* The rows, in prewarm's order; *n their count. Static storage. */
const kiln__op_row *kiln__catalog_rows(size_t *n);
/* The row of op id, or NULL. */
const kiln__op_row *kiln__catalog_find(const char *id);
/* kiln__catalog_specs (providers/internal.h) walks the rows in order. */
/* SHA-256 over every embedded template file (names and bytes) and each of
 * the n rows' id and version: kiln__implementation_digest over the catalog's
 * rows; other rows for the tests. */
void kiln__catalog_digest(const kiln__op_row *rows, size_t n, uint8_t out[32]);

#endif
