// Probe: at decode shapes of 32 tokens, how fast is cuBLASLt's product when
// K is cut into P parts by kiln itself (one strided-batched call, f32 partial
// products, no split-K reduction: what kiln_op_dense_linear_norm does for
// o_proj and down_proj, its norm kernel summing the parts), beside the single
// f16 product? For the fused q/k/v and gate/up, whose consumers (the decode
// attention, the SwiGLU elementwise kernel) could sum the parts as they read.
// Every heuristic candidate without split-K (the reduction schemes refused,
// as providers/blas_cache.c asks), timed as a graph of R calls over R weight
// copies (each L2-cold), median of 7; the best per P printed, and P = 1 in
// f32 too.
// Usage: probe_parts [T]  (default 32)
#include <algorithm>
#include <vector>

#include "probe_gemm.cuh"

struct parted {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulHeuristicResult_t hr[16];
    int nh;
};

static void parted_init(cublasLtHandle_t lt, parted *g, int M, int K, int T, int P, bool f32, size_t wsb)
{
    CB(cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
    CB(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA));
    CB(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB));
    const int kp = K / P;
    CB(cublasLtMatrixLayoutCreate(&g->a, CUDA_R_16F, kp, M, K));
    CB(cublasLtMatrixLayoutCreate(&g->b, CUDA_R_16F, kp, T, K));
    CB(cublasLtMatrixLayoutCreate(&g->d, f32 ? CUDA_R_32F : CUDA_R_16F, M, T, M));
    if (P > 1) {
        const int32_t count = P;
        const int64_t ab = kp, dd = (int64_t)M * T;
        for (cublasLtMatrixLayout_t l : {g->a, g->b, g->d})
            CB(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
        CB(cublasLtMatrixLayoutSetAttribute(g->a, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &ab, sizeof ab));
        CB(cublasLtMatrixLayoutSetAttribute(g->b, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &ab, sizeof ab));
        CB(cublasLtMatrixLayoutSetAttribute(g->d, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &dd, sizeof dd));
    }
    cublasLtMatmulPreference_t pref;
    CB(cublasLtMatmulPreferenceCreate(&pref));
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &none, sizeof none));
    g->nh = 0;
    CB(cublasLtMatmulAlgoGetHeuristic(lt, g->op, g->a, g->b, g->d, g->d, pref, 16, g->hr, &g->nh));
    CB(cublasLtMatmulPreferenceDestroy(pref));
}

int main(int argc, char **argv)
{
    const int T = argc > 1 ? atoi(argv[1]) : 32, R = 8;
    struct {
        const char *name;
        int m, k;
    } shapes[] = {{"qkv", 6144, 4096}, {"gate_up", 28672, 4096}, {"q/o", 4096, 4096}, {"down", 4096, 14336}};
    cublasLtHandle_t lt;
    CB(cublasLtCreate(&lt));
    const size_t wsb = 32 << 20;
    void *ws;
    CK(cudaMalloc(&ws, wsb));
    half *x;
    void *d;
    CK(cudaMalloc(&x, (size_t)T * 14336 * 2));
    CK(cudaMalloc(&d, (size_t)8 * T * 28672 * 4));
    fillw<<<256, 256>>>(x, (size_t)T * 14336, 7);
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    for (auto &sh : shapes) {
        const size_t wn = (size_t)sh.m * sh.k;
        std::vector<half *> w(R);
        for (auto &p : w) {
            CK(cudaMalloc(&p, wn * 2));
            fillw<<<1024, 256>>>(p, wn, 11);
        }
        CK(cudaDeviceSynchronize());
        for (int P : {0, 1, 2, 3, 4, 8}) { // 0: the single f16 product
            const int parts = P ? P : 1;
            if (sh.k % (64 * parts))
                continue;
            parted g;
            parted_init(lt, &g, sh.m, sh.k, T, parts, P > 0, wsb);
            double best = 1e9;
            int bi = -1;
            for (int c = 0; c < g.nh; c++) {
                if (g.hr[c].state != CUBLAS_STATUS_SUCCESS)
                    continue;
                const float one = 1, zero = 0;
                const double us = probe_time_graph(s, R, [&](int i) {
                    return cublasLtMatmul(lt, g.op, &one, w[i], g.a, x, g.b, &zero, d, g.d, d, g.d, &g.hr[c].algo, ws,
                                          wsb, s) == CUBLAS_STATUS_SUCCESS;
                });
                if (us >= 0 && us < best)
                    best = us, bi = c;
            }
            printf("{\"shape\":\"%s\",\"T\":%d,\"parts\":%d,\"out\":\"%s\",\"candidates\":%d,\"best\":%d,\"us\":%.2f,"
                   "\"tb_s\":%.3f}\n",
                   sh.name, T, parts, P ? "f32" : "f16", g.nh, bi, best, wn * 2 / best / 1e6);
            fflush(stdout);
        }
        for (auto p : w)
            CK(cudaFree(p));
    }
    return 0;
}
