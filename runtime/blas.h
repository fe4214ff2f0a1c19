/* cuBLASLt, loaded at run time (runtime/blas.c): the entry points the dense
 * providers call on a stream's handle. Not API. */
#ifndef KILN_RUNTIME_BLAS_H
#define KILN_RUNTIME_BLAS_H

#include <cublasLt.h>

#define KILN__BLAS_FUNCS(X)                                                                                         \
    X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtGetStatusString) X(cublasLtMatmul)                               \
    X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute)                      \
    X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy) X(cublasLtMatmulPreferenceCreate)                  \
    X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatmulAlgoGetHeuristic)     \
    X(cublasLtMatmulAlgoConfigGetAttribute) X(cublasLtMatrixLayoutSetAttribute) X(cublasLtMatmulAlgoCheck)           \
    X(cublasLtGetVersion)

typedef struct kiln__blas {
#define KILN__BLAS_FIELD(name) __typeof__(&name) name;
    KILN__BLAS_FUNCS(KILN__BLAS_FIELD)
#undef KILN__BLAS_FIELD
} kiln__blas;

/* The loaded cuBLASLt, or NULL with *why saying what failed. Thread-safe. */
const kiln__blas *kiln__blas_get(const char **why);

struct kiln_runtime;
/* Starts a thread that makes cuBLASLt's first heuristic query of the
 * process (f16 and bf16) on rt's context and its own handle, so that the
 * library's one-time set-up (80-180 ms on an H200, decode --bench-startup)
 * runs while the caller loads its weights rather than in its first
 * product's encode; kiln_runtime_destroy joins it. $KILN_BLAS_WARM=0 (or a
 * thread that cannot start) leaves it to the first product. */
void kiln__blas_warm_start(struct kiln_runtime *rt);

#endif
