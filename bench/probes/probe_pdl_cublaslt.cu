// Probe: does a cuBLASLt kernel honour a programmatic (PDL) graph edge into
// it, i.e. wait for its producer, and what would such an edge save?
// A graph of N x (producer kernel -> cuBLASLt gemm) is captured (the producer
// launched with programmatic stream serialization, as kiln's kernels are);
// its edges are printed (type 1 = programmatic); then the producer -> gemm
// edges are made programmatic (port 1: trigger, port 2: launch completion),
// the pair timed, and, with producers that spin before writing the gemm's
// input, every gemm output compared with the default-edge run's.
// Usage: probe_pdl_cublaslt [N M K T [algo]]  (defaults 64 4096 4096 32 0)
#include <cuda.h>
#include <string.h>
#include <algorithm>
#include <vector>

#include "probe_gemm.cuh"

__global__ void prod(half *x, int n, int tag, long long spin)
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    long long t0 = clock64();
    while (clock64() - t0 < spin) {}
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
        x[j] = __float2half((float)(((j * 7 + tag) % 13) - 6) * 0.05f);
}
static const char *node_name(cudaGraphNode_t nd)
{
    static char buf[8][256]; static int k; char *b = buf[k++ % 8];
    cudaGraphNodeType t; cudaGraphNodeGetType(nd, &t);
    if (t != cudaGraphNodeTypeKernel) { snprintf(b, 256, "type%d", (int)t); return b; }
    CUDA_KERNEL_NODE_PARAMS p; memset(&p, 0, sizeof p);
    if (cuGraphKernelNodeGetParams((CUgraphNode)nd, &p)) { snprintf(b, 256, "kernel?"); return b; }
    const char *nm = 0; cuFuncGetName(&nm, p.func);
    snprintf(b, 256, "%.90s grid %u,%u,%u blk %u smem %u", nm ? nm : "?", p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.sharedMemBytes);
    return b;
}

int main(int argc, char **argv)
{
    const int N = argc > 1 ? atoi(argv[1]) : 64, M = argc > 2 ? atoi(argv[2]) : 4096, K = argc > 3 ? atoi(argv[3]) : 4096, T = argc > 4 ? atoi(argv[4]) : 32;
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<half *> w(N), x(N), d(N);
    for (int i = 0; i < N; i++) {
        CK(cudaMalloc(&w[i], (size_t)M * K * 2)); CK(cudaMalloc(&x[i], (size_t)T * K * 2)); CK(cudaMalloc(&d[i], (size_t)T * M * 2));
        fillw<<<1024, 256>>>(w[i], (size_t)M * K, 77 + i);
    }
    CK(cudaDeviceSynchronize());
    probe_gemm gm;
    probe_gemm_init(&gm, M, K, T);
    const int pick = argc > 5 ? atoi(argv[5]) : 0;
    printf("{\"probe\":\"pdl_cublaslt\",\"M\":%d,\"K\":%d,\"T\":%d,\"heuristic_results\":%d,\"pick\":%d}\n", M, K, T, gm.nh, pick);
    auto build = [&](long long spin, cudaGraph_t *g) {
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < N; i++) {
            cudaLaunchConfig_t c = {}; cudaLaunchAttribute a[1];
            a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; a[0].val.programmaticStreamSerializationAllowed = 1;
            c.gridDim = dim3(16); c.blockDim = dim3(256); c.stream = s; c.attrs = a; c.numAttrs = 1;
            CK(cudaLaunchKernelEx(&c, prod, x[i], T * K, i, spin));
            probe_gemm_run(&gm, w[i], x[i], d[i], pick, s);
        }
        CK(cudaStreamEndCapture(s, g));
    };
    cudaGraph_t g0; build(0, &g0);
    size_t ne = 0; CK(cudaGraphGetEdges(g0, NULL, NULL, NULL, &ne));
    std::vector<cudaGraphNode_t> fr(ne), to(ne); std::vector<cudaGraphEdgeData> ed(ne);
    CK(cudaGraphGetEdges(g0, fr.data(), to.data(), ed.data(), &ne));
    size_t nn = 0; cudaGraphGetNodes(g0, NULL, &nn);
    printf("{\"nodes\":%zu,\"edges\":%zu}\n", nn, ne);
    for (size_t e = 0; e < ne && e < 6; e++)
        printf("{\"edge\":%zu,\"from\":\"%s\",\"to\":\"%s\",\"type\":%d,\"from_port\":%d}\n", e, node_name(fr[e]), node_name(to[e]), ed[e].type, ed[e].from_port);
    // a copy of the captured graph with every edge into a non-prod kernel made programmatic
    auto progify = [&](cudaGraph_t g, int port) {
        size_t n = 0; CK(cudaGraphGetEdges(g, NULL, NULL, NULL, &n));
        std::vector<cudaGraphNode_t> f(n), t(n); std::vector<cudaGraphEdgeData> dd(n);
        CK(cudaGraphGetEdges(g, f.data(), t.data(), dd.data(), &n));
        int changed = 0;
        for (size_t e = 0; e < n; e++) {
            if (dd[e].type == cudaGraphDependencyTypeProgrammatic) continue;
            cudaGraphNodeType ft, tt; cudaGraphNodeGetType(f[e], &ft); cudaGraphNodeGetType(t[e], &tt);
            if (ft != cudaGraphNodeTypeKernel || tt != cudaGraphNodeTypeKernel) continue;
            if (!strstr(node_name(f[e]), "prod")) continue;
            CK(cudaGraphRemoveDependencies(g, &f[e], &t[e], &dd[e], 1));
            cudaGraphEdgeData nd = {}; nd.type = cudaGraphDependencyTypeProgrammatic; nd.from_port = port;
            CK(cudaGraphAddDependencies(g, &f[e], &t[e], &nd, 1));
            changed++;
        }
        return changed;
    };
    auto timeit = [&](cudaGraphExec_t ex, const char *what) {
        cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
        for (int r = 0; r < 3; r++) CK(cudaGraphLaunch(ex, s));
        std::vector<float> ms;
        for (int r = 0; r < 15; r++) { cudaEventRecord(a, s); CK(cudaGraphLaunch(ex, s)); cudaEventRecord(b, s); CK(cudaEventSynchronize(b)); float t; cudaEventElapsedTime(&t, a, b); ms.push_back(t); }
        std::sort(ms.begin(), ms.end());
        printf("{\"what\":\"%s\",\"M\":%d,\"K\":%d,\"T\":%d,\"n\":%d,\"us_per_pair\":%.3f}\n", what, M, K, T, N, ms[7] * 1000 / N);
    };
    std::vector<half> ref((size_t)T * M * N), got((size_t)T * M);
    cudaGraphExec_t e0; CK(cudaGraphInstantiate(&e0, g0, 0));
    timeit(e0, "default edges");
    for (int i = 0; i < N; i++) CK(cudaMemcpy(&ref[(size_t)i * T * M], d[i], (size_t)T * M * 2, cudaMemcpyDeviceToHost));
    for (int port = 1; port <= 2; port++) {
        cudaGraph_t g1; build(0, &g1);
        int ch = progify(g1, port);
        cudaGraphExec_t e1; cudaError_t ie = cudaGraphInstantiate(&e1, g1, 0);
        printf("{\"port\":%d,\"edges_made_programmatic\":%d,\"instantiate\":\"%s\"}\n", port, ch, cudaGetErrorString(ie));
        if (ie) continue;
        timeit(e1, port == 1 ? "programmatic (trigger) into gemm" : "programmatic (launch completion) into gemm");
        // race check: spin producers, clear x and d, run, compare
        cudaGraph_t g2; build(200000, &g2); progify(g2, port);
        cudaGraphExec_t e2; CK(cudaGraphInstantiate(&e2, g2, 0));
        long bad = 0;
        for (int rep = 0; rep < 3; rep++) {
            for (int i = 0; i < N; i++) { CK(cudaMemsetAsync(x[i], 0, (size_t)T * K * 2, s)); CK(cudaMemsetAsync(d[i], 0xff, (size_t)T * M * 2, s)); }
            CK(cudaGraphLaunch(e2, s)); CK(cudaStreamSynchronize(s));
            for (int i = 0; i < N; i++) {
                CK(cudaMemcpy(got.data(), d[i], (size_t)T * M * 2, cudaMemcpyDeviceToHost));
                bad += memcmp(got.data(), &ref[(size_t)i * T * M], (size_t)T * M * 2) != 0;
            }
        }
        printf("{\"port\":%d,\"race_check\":\"producers spin 200k cycles\",\"outputs_differing\":%ld,\"outputs\":%d}\n", port, bad, 3 * N);
    }
    return 0;
}
