// Probe: does prefetching the next product's weight into L2 on a concurrent
// graph branch (cp.async.bulk.prefetch.L2, plain or evict_last), while a
// KV-streaming kernel runs (a stand-in for decode attention, evict-first
// loads), make the (stream, cuBLASLt gemm) pair faster? Prints JSON lines:
// microseconds per pair for each arrangement.
// Usage: probe_l2_prefetch [N M K stream_MB]  (defaults 32 4096 4096 134)
#include <string.h>
#include <algorithm>
#include <vector>

#include "probe_gemm.cuh"

// a stand-in for decode attention: streams bytes once (evict-first when cs), writes a little
__global__ void stream_k(const int4 *p, size_t n, float *out, int cs)
{
    float acc = 0;
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        int4 v = cs ? __ldcs(p + j) : p[j];
        acc += __int_as_float(v.x ^ v.y ^ v.z ^ v.w) * 1e-30f;
    }
    if (acc == 12345.0f) out[blockIdx.x] = acc;
}
// L2 prefetch of [p, p + bytes): 16 KiB bulk prefetches, spread over the grid
__global__ void pf_k(const char *p, size_t bytes, int hint)
{
    const size_t chunk = 16384;
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    for (size_t o = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * chunk; o < bytes; o += (size_t)gridDim.x * blockDim.x * chunk) {
        unsigned sz = (unsigned)(bytes - o < chunk ? bytes - o : chunk);
        if (hint)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p + o), "r"(sz), "l"(pol) : "memory");
        else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + o), "r"(sz) : "memory");
    }
}
int main(int argc, char **argv)
{
    const int N = argc > 1 ? atoi(argv[1]) : 32, M = argc > 2 ? atoi(argv[2]) : 4096, K = argc > 3 ? atoi(argv[3]) : 4096, T = 32;
    const size_t kvb = (size_t)(argc > 4 ? atof(argv[4]) : 134.0) * 1e6;
    cudaStream_t s, s2; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    std::vector<half *> w(N), x(N), d(N); std::vector<int4 *> kv(N);
    float *junk; CK(cudaMalloc(&junk, 1 << 20));
    for (int i = 0; i < N; i++) {
        CK(cudaMalloc(&w[i], (size_t)M * K * 2)); CK(cudaMalloc(&x[i], (size_t)T * K * 2)); CK(cudaMalloc(&d[i], (size_t)T * M * 2));
        CK(cudaMalloc(&kv[i], kvb)); CK(cudaMemset(kv[i], 1, kvb));
        fillw<<<1024, 256>>>(w[i], (size_t)M * K, 77 + i); fillw<<<64, 256>>>(x[i], (size_t)T * K, 5 + i);
    }
    CK(cudaDeviceSynchronize());
    probe_gemm gm;
    probe_gemm_init(&gm, M, K, T);
    int dev; cudaGetDevice(&dev); int l2; cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
    printf("{\"probe\":\"l2_prefetch\",\"l2_bytes\":%d,\"M\":%d,\"K\":%d,\"weight_mb\":%.1f,\"stream_mb\":%.1f}\n", l2, M, K, M * (double)K * 2 / 1e6, kvb / 1e6);
    // mode: 0 stream+gemm, 1 + prefetch branch (plain), 2 + prefetch (evict_last), 3 stream only, 4 gemm only, 5 = 2 with non-cs stream
    auto run = [&](int mode, int pfblocks) {
        cudaGraph_t g; cudaEvent_t ev[2 * 64];
        for (int i = 0; i < 2 * N; i++) CK(cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming));
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < N; i++) {
            const int pf = mode == 1 || mode == 2 || mode == 5;
            if (pf) { CK(cudaEventRecord(ev[2 * i], s)); CK(cudaStreamWaitEvent(s2, ev[2 * i], 0)); pf_k<<<pfblocks, 32, 0, s2>>>((const char *)w[i], (size_t)M * K * 2, mode != 1); CK(cudaEventRecord(ev[2 * i + 1], s2)); }
            if (mode != 4) stream_k<<<264, 512, 0, s>>>(kv[i], kvb / 16, junk, mode != 5);
            if (pf) CK(cudaStreamWaitEvent(s, ev[2 * i + 1], 0));
            if (mode != 3) probe_gemm_run(&gm, w[i], x[i], d[i], 0, s);
        }
        CK(cudaStreamEndCapture(s, &g));
        cudaGraphExec_t ex; CK(cudaGraphInstantiate(&ex, g, 0));
        cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
        for (int r = 0; r < 3; r++) CK(cudaGraphLaunch(ex, s));
        std::vector<float> ms;
        for (int r = 0; r < 11; r++) { cudaEventRecord(a, s); CK(cudaGraphLaunch(ex, s)); cudaEventRecord(b, s); CK(cudaEventSynchronize(b)); float t; cudaEventElapsedTime(&t, a, b); ms.push_back(t); }
        std::sort(ms.begin(), ms.end());
        static const char *names[] = {"stream+gemm", "stream+gemm, prefetch branch", "stream+gemm, prefetch evict_last", "stream only", "gemm only", "stream(no cs)+gemm, prefetch evict_last"};
        printf("{\"mode\":\"%s\",\"pf_blocks\":%d,\"M\":%d,\"K\":%d,\"stream_mb\":%.0f,\"us_per_pair\":%.3f}\n", names[mode], pfblocks, M, K, kvb / 1e6, ms[5] * 1000 / N);
        cudaGraphExecDestroy(ex); cudaGraphDestroy(g);
    };
    run(3, 0); run(4, 0); run(0, 0);
    for (int pb : {4, 16, 64}) { run(1, pb); run(2, pb); }
    run(5, 16);
    return 0;
}
