// Probe: a decode product of 32 tokens (out[T][N] = x[T][K] . w[N][K]^T)
// with the weight streamed by TMA, as cuBLASLt's nvjet kernels do, in a
// grid balanced over the SMs, and with programmatic dependent launch: the
// weight does not depend on the kernel before, so its first stages are
// requested before griddepcontrol.wait, under the tail of the kernel ahead.
// One block an SM. Block b serves part p = b % P of K (P f32 partial sums,
// added atomically here) and a contiguous run of 16-row units of its part;
// its rows come in one TMA box per 64-wide K step (128-byte swizzle), x's 32
// rows in another; a producer thread fills S stages (full / empty
// mbarriers), consumer warps take 16 rows each (ldmatrix, mma.sync
// m16n8k16, 4 token tiles). Timed as a graph of R launches over R weight
// copies (each L2-cold): plain launches, and launches with PDL and `pre`
// stages requested before the wait; beside every cuBLASLt heuristic
// candidate in the same run. Outputs checked against cuBLASLt's.
// Usage: probe_tma_gemm
#include <cuda.h>

#include <algorithm>
#include <vector>

#include "probe_gemm.cuh"

#define T 32
#define KB 64 // K per stage: one 128-byte swizzle row

__device__ __forceinline__ unsigned sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity)
{
    asm volatile("{\n\t.reg .pred p;\n\tW_%=:\n\tmbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n\t@!p bra W_%=;\n\t}" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void tma2d(unsigned dst, const CUtensorMap *m, int c0, int c1, unsigned bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(m), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void ldsm4(unsigned a, unsigned *r)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void mma(float *c, const unsigned *a, unsigned b0, unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Byte offset of (row r, 16-byte chunk c) in a tile of 128-byte rows, 128-byte swizzle.
__device__ __forceinline__ unsigned swz(unsigned r, unsigned c) { return r * 128 + ((c ^ (r & 7)) << 4); }

struct args {
    int n, k, parts, boxr, stages, pre;
    int l2; // 1: before the wait only an L2 prefetch of the first stages' weight (always safe), loads after
    float *out32; // parts > 1: f32 [T][n], atomically added
    half *out;    // parts == 1
};

__global__ void __launch_bounds__(17 * 32, 1) tma_gemm(const __grid_constant__ CUtensorMap wm,
                                                     const __grid_constant__ CUtensorMap xm, args a)
{
    extern __shared__ __align__(1024) unsigned char sm_raw[];
    unsigned char *sm = (unsigned char *)(((size_t)sm_raw + 1023) & ~(size_t)1023);
    __shared__ __align__(8) unsigned long long full[8], empty[8];
    const int warps = a.boxr / 16, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int P = a.parts, p = blockIdx.x % P, q = blockIdx.x / P, bp = gridDim.x / P;
    const int units = a.n / 16, u0 = (int)((long long)q * units / bp), u1 = (int)((long long)(q + 1) * units / bp);
    const int r0 = 16 * u0, r1 = 16 * u1, kl = a.k / P, k0 = p * kl, nk = kl / KB, S = a.stages;
    const unsigned wbytes = a.boxr * 128, stage_bytes = wbytes + T * 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) {
            asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(sa(&full[s])));
            asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(sa(&empty[s])), "r"(warps));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const bool producer = warp == warps && lane == 0;
    // The weight of the first stages before the wait: it does not depend on the kernel ahead.
    int pre = a.pre < S ? (a.pre < nk ? a.pre : nk) : S;
    if (producer && a.l2) {
        for (int it = 0; it < pre; it++)
            asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global [%0, {%1, %2}];" ::"l"(&wm), "r"(k0 + it * KB), "r"(r0)
                         : "memory");
    }
    if (a.l2)
        pre = 0;
    if (producer)
        for (int it = 0; it < pre; it++) {
            asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(sa(&full[it])), "r"(stage_bytes) : "memory");
            tma2d(sa(sm + it * stage_bytes), &wm, k0 + it * KB, r0, sa(&full[it]));
        }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (producer) {
        for (int it = 0; it < pre; it++)
            tma2d(sa(sm + it * stage_bytes + wbytes), &xm, k0 + it * KB, 0, sa(&full[it]));
        for (int it = pre; it < nk; it++) {
            const int s = it % S;
            if (it >= S)
                bar_wait(sa(&empty[s]), ((it / S) - 1) & 1);
            asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(sa(&full[s])), "r"(stage_bytes) : "memory");
            tma2d(sa(sm + s * stage_bytes), &wm, k0 + it * KB, r0, sa(&full[s]));
            tma2d(sa(sm + s * stage_bytes + wbytes), &xm, k0 + it * KB, 0, sa(&full[s]));
        }
        return;
    }
    if (warp >= warps)
        return;
    float acc[4][4] = {};
    const unsigned ar = 16 * warp + (lane % 8) + 8 * ((lane / 8) % 2), ac = lane / 16; // A: matrix lane/8
    const unsigned bt = (lane % 8) + 8 * (lane / 16), bc = (lane / 8) % 2;             // B: tokens, chunk
    for (int it = 0; it < nk; it++) {
        const int s = it % S;
        bar_wait(sa(&full[s]), (it / S) & 1);
        const unsigned wt = sa(sm + s * stage_bytes), xt = wt + wbytes;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            unsigned af[4], b01[4], b23[4];
            ldsm4(wt + swz(ar, 2 * kk + ac), af);
            ldsm4(xt + swz(bt, 2 * kk + bc), b01);      // tokens 0-15
            ldsm4(xt + swz(bt + 16, 2 * kk + bc), b23); // tokens 16-31
            mma(acc[0], af, b01[0], b01[1]);
            mma(acc[1], af, b01[2], b01[3]);
            mma(acc[2], af, b23[0], b23[1]);
            mma(acc[3], af, b23[2], b23[3]);
        }
        __syncwarp();
        if (lane == 0)
            asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(sa(&empty[s])) : "memory");
    }
    const int g = lane / 4, t4 = lane % 4;
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) {
            const int row = r0 + 16 * warp + g + (i >= 2 ? 8 : 0), tok = 8 * j + 2 * t4 + (i & 1);
            if (row >= r1)
                continue;
            if (P == 1)
                a.out[(size_t)tok * a.n + row] = __float2half(acc[j][i]);
            else
                atomicAdd(&a.out32[(size_t)tok * a.n + row], acc[j][i]);
        }
}

static CUtensorMap map2d(void *base, int k, int rows, int boxr)
{
    CUtensorMap m;
    cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)k * 2};
    cuuint32_t box[2] = {KB, (cuuint32_t)boxr}, es[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, base, dims, strides, box, es,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r) {
        printf("{\"error\":\"cuTensorMapEncodeTiled %d (k %d rows %d box %d)\"}\n", (int)r, k, rows, boxr);
        exit(1);
    }
    return m;
}

int main()
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int R = 8;
    struct {
        const char *name;
        int n, k;
    } shapes[] = {{"gate_up", 28672, 4096}, {"qkv", 6144, 4096}, {"q/o", 4096, 4096}, {"down", 4096, 14336}};
    half *x, *ref, *out;
    float *out32;
    CK(cudaMalloc(&x, (size_t)T * 14336 * 2));
    CK(cudaMalloc(&ref, (size_t)T * 28672 * 2));
    CK(cudaMalloc(&out, (size_t)T * 28672 * 2));
    CK(cudaMalloc(&out32, (size_t)T * 28672 * 4));
    fillw<<<256, 256>>>(x, (size_t)T * 14336, 7);
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    CK(cudaFuncSetAttribute(tma_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024 - 2048));
    for (auto &sh : shapes) {
        const size_t wn = (size_t)sh.n * sh.k;
        std::vector<half *> w(R);
        for (auto &p : w) {
            CK(cudaMalloc(&p, wn * 2));
            fillw<<<1024, 256>>>(p, wn, 13);
        }
        CK(cudaDeviceSynchronize());
        probe_gemm gm;
        probe_gemm_init(&gm, sh.n, sh.k, T);
        double best = 1e9;
        for (int c = 0; c < gm.nh; c++)
            best = std::min(best, probe_time_graph(s, R, [&](int i) { probe_gemm_run(&gm, w[i], x, ref, c, s); return true; }));
        printf("{\"shape\":\"%s\",\"impl\":\"cublaslt\",\"us_best\":%.2f,\"tb_s\":%.3f}\n", sh.name, best, wn * 2 / best / 1e6);
        probe_gemm_run(&gm, w[R - 1], x, ref, 0, s);
        CK(cudaStreamSynchronize(s));
        std::vector<half> hr((size_t)T * sh.n);
        CK(cudaMemcpy(hr.data(), ref, hr.size() * 2, cudaMemcpyDeviceToHost));
        for (int P : {1, 2, 3, 4, 6}) {
            if (sms % P || (sh.k / P) % KB || sh.k % P)
                continue;
            const int bp = sms / P, units = sh.n / 16, maxu = (units + bp - 1) / bp, boxr = 16 * maxu;
            if (boxr > 256 || boxr / 16 + 1 > 17)
                continue;
            const int stage = boxr * 128 + T * 128, S = std::min(8, (227 * 1024 - 3072) / stage);
            if (S < 2)
                continue;
            std::vector<CUtensorMap> wm(R);
            for (int i = 0; i < R; i++)
                wm[i] = map2d(w[i], sh.k, sh.n, boxr);
            const CUtensorMap xm = map2d(x, sh.k, T, T);
            for (int mode = 0; mode < 5; mode++) {
                const int pre = mode == 0 ? 0 : mode % 2 ? 2 : 8, l2 = mode >= 3;
                args a = {sh.n, sh.k, P, boxr, S, pre, l2, out32, out};
                const int threads = (boxr / 16 + 1) * 32, smem = S * stage + 1024;
                auto go = [&](int i) {
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(sms);
                    cfg.blockDim = dim3(threads);
                    cfg.dynamicSmemBytes = smem;
                    cfg.stream = s;
                    cudaLaunchAttribute at[1];
                    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    at[0].val.programmaticStreamSerializationAllowed = pre > 0;
                    cfg.attrs = at;
                    cfg.numAttrs = 1;
                    CK(cudaLaunchKernelEx(&cfg, tma_gemm, wm[i], xm, a));
                    return true;
                };
                // P > 1 adds atomically: the timed runs add into whatever is there.
                const double us = probe_time_graph(s, R, go);
                CK(cudaMemsetAsync(out32, 0, (size_t)T * sh.n * 4, s));
                CK(cudaMemsetAsync(out, 0xff, (size_t)T * sh.n * 2, s));
                go(R - 1);
                CK(cudaStreamSynchronize(s));
                std::vector<half> ho((size_t)T * sh.n);
                std::vector<float> h32((size_t)T * sh.n);
                CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(h32.data(), out32, h32.size() * 4, cudaMemcpyDeviceToHost));
                double maxerr = 0, scale = 1e-30;
                for (size_t e = 0; e < hr.size(); e++) {
                    const double want = __half2float(hr[e]), got = P == 1 ? __half2float(ho[e]) : h32[e];
                    const double d = fabs(got - want);
                    scale = std::max(scale, fabs(want));
                    maxerr = d != d ? 1e30 : std::max(maxerr, d);
                }
                printf("{\"shape\":\"%s\",\"impl\":\"tma\",\"P\":%d,\"boxr\":%d,\"stages\":%d,\"pre\":%d,\"l2\":%d,\"us\":%.2f,"
                       "\"tb_s\":%.3f,\"vs_cublaslt_best\":%.3f,\"max_rel_err\":%.2e}\n",
                       sh.name, P, boxr, S, pre, l2, us, wn * 2 / us / 1e6, us / best, maxerr / scale);
                fflush(stdout);
            }
        }
        for (auto p : w)
            CK(cudaFree(p));
    }
    return 0;
}
