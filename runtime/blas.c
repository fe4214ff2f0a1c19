/* cuBLASLt, loaded when the first stream is created: the library is large
 * (hundreds of MB), and a process that never touches a GPU (the CLI, prewarm)
 * should not pay for mapping it. */
#include <cublasLt.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static kiln__blas blas;
static const kiln__blas *loaded;
static char why_not[512];

static void load(void)
{
    static const char *const names[] = {"libcublasLt.so.13", "libcublasLt.so"};
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(why_not, sizeof why_not, "cuBLASLt (libcublasLt.so.13) cannot be loaded: %s", e ? e : "not found");
        return;
    }
#define KILN__BLAS_LOAD(name)                                                                                       \
    if (!(blas.name = (__typeof__(blas.name))dlsym(lib, #name))) {                                                \
        snprintf(why_not, sizeof why_not, "libcublasLt.so lacks %s", #name);                                      \
        return;                                                                                                     \
    }
    KILN__BLAS_FUNCS(KILN__BLAS_LOAD)
#undef KILN__BLAS_LOAD
    loaded = &blas;
}

const kiln__blas *kiln__blas_get(const char **why)
{
    pthread_once(&once, load);
    if (!loaded && why)
        *why = why_not;
    return loaded;
}

/* One heuristic query of a decode-shaped product (4096 -> 4096, one token)
 * in element type et. */
static void warm_query(const kiln__blas *b, cublasLtHandle_t lt, cudaDataType_t et)
{
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t a = NULL, x = NULL, d = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const uint64_t ws = 1 << 22;
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    if (!b->cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) &&
        !b->cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) &&
        !b->cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) &&
        !b->cublasLtMatrixLayoutCreate(&a, et, 4096, 4096, 4096) && !b->cublasLtMatrixLayoutCreate(&x, et, 4096, 1, 4096) &&
        !b->cublasLtMatrixLayoutCreate(&d, et, 4096, 1, 4096) && !b->cublasLtMatmulPreferenceCreate(&pref) &&
        !b->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws))
        (void)b->cublasLtMatmulAlgoGetHeuristic(lt, op, a, x, d, d, pref, 1, &result, &found);
    if (pref)
        b->cublasLtMatmulPreferenceDestroy(pref);
    if (d)
        b->cublasLtMatrixLayoutDestroy(d);
    if (x)
        b->cublasLtMatrixLayoutDestroy(x);
    if (a)
        b->cublasLtMatrixLayoutDestroy(a);
    if (op)
        b->cublasLtMatmulDescDestroy(op);
}

static void *warm_main(void *arg)
{
    kiln_runtime *rt = arg;
    const kiln__blas *b = kiln__blas_get(NULL);
    cublasLtHandle_t lt = NULL;
    if (!b || rt->d->cuCtxSetCurrent(rt->ctx) != CUDA_SUCCESS || b->cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS)
        return NULL;
    warm_query(b, lt, CUDA_R_16F);
    warm_query(b, lt, CUDA_R_16BF);
    b->cublasLtDestroy(lt);
    return NULL;
}

void kiln__blas_warm_start(kiln_runtime *rt)
{
    const char *v = getenv("KILN_BLAS_WARM");
    if (v && !strcmp(v, "0"))
        return;
    rt->blas_warm_started = pthread_create(&rt->blas_warm, NULL, warm_main, rt) == 0;
}
