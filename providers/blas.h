/* Dense matrix products through cuBLASLt, shared by the dense providers
 * (linear, SwiGLU, last-token linear). Not API.
 *
 * Every product here is, in row-major terms,
 *     D[rows, out] = X[rows, in] · W[out, in]ᵀ (+ bias[out]),
 * f16 or bf16 storage (the desc's elt: CUDA_R_16F or CUDA_R_16BF for X, W,
 * D and the bias), f32 accumulation and scale (CUBLAS_COMPUTE_32F, CUDA_R_32F).
 * cuBLASLt is column-major: a row-major [R, C] matrix with leading dimension C
 * is the column-major [C, R] matrix with the same leading dimension. So the
 * call computes Dᵀ (column-major [out, rows], ld out) = op(A) · B with
 *     A = W as column-major [in, out], ld in, op(A) = Aᵀ  (transa = T),
 *     B = X as column-major [in, rows], ld in, op(B) = B  (transb = N),
 *     m = out, n = rows, k = in,
 * the "TN" product tensor cores like best. The bias epilogue adds a vector of
 * length m to every column of Dᵀ, which is bias[o] added to out[t, o].
 *
 * The algorithm comes from cublasLtMatmulAlgoGetHeuristic, queried once per
 * (runtime, element type, m, n, k, bias, pointer alignments, workspace size,
 * parts) and kept in a
 * bounded per-process cache (thread-safe). An enqueue allocates nothing and
 * never synchronizes, so it can be captured into a CUDA graph. */
#ifndef KILN_PROVIDERS_BLAS_H
#define KILN_PROVIDERS_BLAS_H

#include <cublasLt.h>

#include "providers/internal.h"
#include "runtime/blas.h"

/* The workspace every cuBLASLt call is given (what cuBLAS uses on Hopper). */
#define KILN__BLAS_WORKSPACE ((size_t)32 << 20)
/* Alignment of the workspace and of anything providers carve out of it. */
#define KILN__WORKSPACE_ALIGN ((size_t)256)

typedef struct kiln__gemm_desc {
    uint64_t rows, in, out;  /* X [rows, in], W [out, in], D [rows, out] */
    kiln_dtype elt;            /* of X, W, the bias and D (not parts): F16 or BF16 */
    CUdeviceptr x, w, bias, d; /* bias 0: none */
    CUdeviceptr workspace;     /* KILN__BLAS_WORKSPACE bytes, 256-byte aligned */
    /* 0: D is the product (elt). P >= 1: D is P f32 partial products, [P,
     * rows, out], part p summing over in-columns [p in/P, (p+1) in/P) (in a
     * multiple of 8 P; no bias): one strided-batched call, K split by kiln
     * rather than by cuBLASLt, whose split-K is refused here so that the one
     * kernel is all it runs; the caller sums the parts (rms_norm.cu's
     * kiln_rms_norm_residual_parts). */
    uint32_t parts;
    /* The database whose tuning rows keep the timed choices (the jit's,
     * kiln__jit_cache); NULL: timed in this process only. */
    kiln_cache *tuning;
} kiln__gemm_desc;

/* A prepared product: descriptors and the algorithm, ready to enqueue. */
typedef struct kiln__gemm {
    kiln_runtime *rt;
    const kiln__blas *lt;
    cublasLtHandle_t handle;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
    kiln__gemm_desc desc;
    float ms; /* the algorithm's time when it was timed at first sight (cold, see blas_cache.c), else 0 */
} kiln__gemm;

/* Creates the descriptors and finds the algorithm (from the cache, or one
 * heuristic query). KILN_ERR_CUDA_BLAS (cuBLASLt missing, a descriptor
 * refused, no algorithm), KILN_ERR_RUNTIME_CONTRACT (a size past what
 * cuBLASLt takes, an elt other than F16 or BF16), recorded in err and
 * prefixed with op. On failure g holds
 * nothing to destroy. */
kiln_status kiln__gemm_prepare(kiln_runtime *rt, kiln__errslot *err, const char *op, const kiln__gemm_desc *desc,
                               kiln__gemm *g);
/* Enqueues the product on the launch context's stream. */
kiln_status kiln__gemm_enqueue(const kiln__gemm *g, const kiln_launch_context *ctx, const char *op);
/* Destroys the descriptors. A zeroed g is a no-op. */
void kiln__gemm_destroy(kiln__gemm *g);
/* A command's user_free for a malloc'ed launch whose first member is its
 * kiln__gemm: destroys the descriptors, then frees the launch. */
void kiln__gemm_free(void *launch);
/* What a command of a kernel and a product prepares (last_token_linear,
 * dense_swiglu): the kernel of spec with its only function, through jit,
 * then the product d on rt into g (as kiln__gemm_prepare). Failures recorded in
 * err; on failure g holds nothing to destroy. */
kiln_status kiln__kernel_and_gemm(kiln_jit *jit, kiln_runtime *rt, kiln__errslot *err, const char *op,
                                  const kiln_spec *spec, kiln_kernel **k, CUfunction *fn, const kiln__gemm_desc *d,
                                  kiln__gemm *g);

/* What a replay key needs of a product: the algorithm and every size and
 * address it runs with. */
typedef struct kiln__gemm_key {
    cublasLtMatmulAlgo_t algo;
    uint64_t rows, in, out, x, w, bias, d, workspace, parts, elt;
} kiln__gemm_key;
void kiln__gemm_key_of(const kiln__gemm *g, kiln__gemm_key *out);

/* The heuristic cache's counters since the process started: queries made
 * (misses) and lookups served from the cache (hits). */
void kiln__blas_cache_counters(uint64_t *queries, uint64_t *hits);

/* The tuning rows' kind for cuBLASLt products, and the payload: "KTL1", the
 * algorithm's size (u32, little-endian) and opaque bytes, the pick's time
 * (f32 bits), the pick's index and the number of candidates timed (u32 each). */
#define KILN__BLAS_TUNING_KIND "cublaslt_matmul"
#define KILN__BLAS_TUNING_PAYLOAD (4 + 4 + sizeof(cublasLtMatmulAlgo_t) + 12)
/* Parses a payload: 0 with *algo and *ms (finite, >= 0), or -1 when it is not
 * one (any size, any bytes). */
int kiln__blas_tuning_decode(const void *payload, size_t size, cublasLtMatmulAlgo_t *algo, float *ms);

/* What the database did for the timing since the process started: shapes
 * timed, choices loaded from tuning rows (nothing timed), rows stored, and
 * rows that no longer applied (cublasLtMatmulAlgoCheck refused them, or
 * their payload was not one), then timed again. Any may be NULL. */
void kiln__blas_tuning_counters(uint64_t *timed, uint64_t *loaded, uint64_t *stored, uint64_t *stale);

/* Rounds up to the workspace alignment; 0 on overflow. */
static inline int kiln__ws_align(size_t n, size_t *out)
{
    size_t r;
    if (kiln__add_overflows(n, KILN__WORKSPACE_ALIGN - 1, &r))
        return 0;
    *out = r & ~(KILN__WORKSPACE_ALIGN - 1);
    return 1;
}

/* Checks a workspace region: on rt, in bounds, 256-byte aligned, at least
 * need bytes, overlapping none of the n bindings. Names op, the binding
 * "workspace", both sizes. */
kiln_status kiln__check_workspace(kiln__errslot *err, const char *op, const kiln_region *ws, kiln_runtime *rt,
                                  size_t need, const kiln_tensor *const *bindings, const size_t *bytes,
                                  const char *const *names, size_t n);

#endif
