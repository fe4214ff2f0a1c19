// What the cuBLASLt probes share: error checks, a deterministic fill, and the
// decode-shaped product kiln runs (out[T][M] = x[T][K] . w[M][K]^T, f16 in
// and out, f32 compute), set up with the heuristic's first 8 candidates.
#pragma once
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CB(x) do { cublasStatus_t e_ = (x); if (e_) { printf("%s:%d cublas %d\n", __FILE__, __LINE__, (int)e_); exit(1); } } while (0)

// n halves of small values from a hash of the index and seed.
__global__ void fillw(half *w, size_t n, unsigned seed)
{
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)j * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
        w[j] = __float2half(((int)(h % 2001) - 1000) * 1e-5f);
    }
}

struct probe_gemm {
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulHeuristicResult_t hr[8];
    int nh;
    void *ws;
    size_t wsb;
};

// Column-major as cuBLASLt sees it: D (M x T) = W^T (W: K x M) . X (K x T).
static void probe_gemm_init(probe_gemm *g, int M, int K, int T)
{
    CB(cublasLtCreate(&g->lt));
    g->wsb = 32 << 20;
    CK(cudaMalloc(&g->ws, g->wsb));
    CB(cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
    CB(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA));
    CB(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB));
    CB(cublasLtMatrixLayoutCreate(&g->la, CUDA_R_16F, K, M, K));
    CB(cublasLtMatrixLayoutCreate(&g->lb, CUDA_R_16F, K, T, K));
    CB(cublasLtMatrixLayoutCreate(&g->ld, CUDA_R_16F, M, T, M));
    cublasLtMatmulPreference_t pref;
    CB(cublasLtMatmulPreferenceCreate(&pref));
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &g->wsb, sizeof g->wsb));
    g->nh = 0;
    CB(cublasLtMatmulAlgoGetHeuristic(g->lt, g->op, g->la, g->lb, g->ld, g->ld, pref, 8, g->hr, &g->nh));
    CB(cublasLtMatmulPreferenceDestroy(pref));
    if (g->nh < 1) {
        printf("{\"error\":\"no cuBLASLt algorithm for M %d K %d T %d\"}\n", M, K, T);
        exit(1);
    }
}

// d = w . x with candidate pick of the heuristic's list, on stream s.
static void probe_gemm_run(const probe_gemm *g, const half *w, const half *x, half *d, int pick, cudaStream_t s)
{
    if (pick < 0 || pick >= g->nh) {
        printf("{\"error\":\"candidate %d: the heuristic gave %d (0 to %d)\"}\n", pick, g->nh, g->nh - 1);
        exit(1);
    }
    const float one = 1, zero = 0;
    CB(cublasLtMatmul(g->lt, g->op, &one, w, g->la, x, g->lb, &zero, d, g->ld, d, g->ld, &g->hr[pick].algo, g->ws,
                      g->wsb, s));
}

// µs per launch: a graph of R launches, launch(i) for i = 0..R-1 (each over
// its own weight copy, so each is L2-cold), replayed 9 times, the median.
// launch returns false when it could not be captured: then -1.
template <class F>
static double probe_time_graph(cudaStream_t s, int R, F launch)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    cudaGraph_t gr;
    cudaGraphExec_t ex;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    bool ok = true;
    for (int i = 0; i < R && ok; i++)
        ok = launch(i);
    CK(cudaStreamEndCapture(s, &gr));
    double us = -1;
    if (ok) {
        CK(cudaGraphInstantiate(&ex, gr, 0));
        std::vector<float> ms;
        for (int k = 0; k < 9; k++) {
            CK(cudaEventRecord(e0, s));
            CK(cudaGraphLaunch(ex, s));
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float t;
            CK(cudaEventElapsedTime(&t, e0, e1));
            ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        us = ms[4] * 1000.0 / R;
        cudaGraphExecDestroy(ex);
    }
    cudaGraphDestroy(gr);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return us;
}
