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

#endif
