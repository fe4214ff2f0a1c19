// Probe: can a hand-written kernel beat cuBLASLt on decode products of 9 to
// 32 tokens (out[T][N] = x[T][K] . w[N][K]^T), weight-bound, L2-cold?
// The design asked about ("row split"): the weight cut into units of 16
// rows by K / P (P parts of K), the units dealt evenly over one block per SM
// (the SM's bandwidth is what is shared, so what matters is each SM's bytes),
// one unit per warp. A lane streams its two 16-byte pieces of each 32-wide K
// step (rows g and g + 8, halves 8q..8q+8, as templates/skinny_linear.cu)
// through a private ring in shared memory (cp.async, S stages of U steps: the
// bytes in flight do not cost registers), x through L1 (every warp of a block
// reads the same K range of x), 4 token tiles of mma.sync m16n8k16.
// P = 1: f16 out (+ GLU: gate/up pairs, silu(g) u); P > 1: f32 parts [P][T][N].
// Timed as a graph of R launches over R weight copies (each L2-cold), median
// of 7, beside every cuBLASLt heuristic candidate in the same run; outputs
// checked against cuBLASLt's (sum of parts for P > 1; GLU against silu(g) u
// of cuBLASLt's gate and up products).
// Usage: probe_rowsplit [T]  (default 32)
#include <algorithm>
#include <vector>

#include "probe_gemm.cuh"

struct __align__(16) u4 { unsigned x, y, z, w; };

__device__ __forceinline__ void mma(float *c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp16(unsigned s, const void *g)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}
__device__ __forceinline__ u4 lds16(unsigned s)
{
    u4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(s));
    return v;
}
__device__ __forceinline__ u4 ldx(const half *p)
{
    u4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// TT token tiles of 8; U 32-wide K steps a stage; S stages in the ring.
template <int TT, int U, int S, int GLU>
__global__ void __launch_bounds__(512, 1)
rowsplit(const half *__restrict__ x, const half *__restrict__ w, half *__restrict__ out, float *__restrict__ parts,
         int T, int n_out, int K, int P, int mode)
{
    extern __shared__ __align__(16) unsigned char ring[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const int R = GLU ? n_out / 8 : n_out / 16; // 16-row units per part
    const int units = R * P, B = gridDim.x;
    const int u = (int)((long long)blockIdx.x * units / B) + warp;
    if (u >= (int)((long long)(blockIdx.x + 1) * units / B))
        return;
    const int p = u / R, r = u % R, KL = K / P, k0 = p * KL + 8 * q;
    const long long row0 = GLU ? 8LL * r + g : 16LL * r + g, row1 = GLU ? n_out + 8LL * r + g : row0 + 8;
    const half *w0 = w + row0 * K + k0, *w1 = w + row1 * K + k0;
    const half *xs[TT];
    bool has[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) {
        has[t] = 8 * t + g < T;
        xs[t] = x + (long long)(has[t] ? 8 * t + g : 0) * K + k0;
    }
    // this lane's 16-byte slots: [stage][step][row g, g + 8]
    const unsigned base = (unsigned)__cvta_generic_to_shared(ring) + (unsigned)(warp * S * U * 2 * 32 + lane) * 16;
#define SLOT(st, i, j) (base + (unsigned)((((st) * U + (i)) * 2 + (j)) * 32 * 16))
    const int steps = KL / 32, NS = steps / U;
    // mode & 3: where in its K range a warp starts (0: at the start; 1: rotated by block; 2: by warp);
    // mode & 4: x not read (its registers stay 0: timing only)
    const int rot = (mode & 3) == 1 ? (int)((long long)blockIdx.x * NS / B) * U
                  : (mode & 3) == 2 ? (int)((long long)(blockIdx.x * (blockDim.x / 32) + warp) * NS / (B * (blockDim.x / 32))) * U : 0;
    const bool readx = !(mode & 4);
    auto kstep = [&](int j) { j += rot; return j >= steps ? j - steps : j; };
    auto issue = [&](int st) {
        if (st < NS) {
            const int slot = st % S;
#pragma unroll
            for (int i = 0; i < U; i++) {
                cp16(SLOT(slot, i, 0), w0 + kstep(st * U + i) * 32);
                cp16(SLOT(slot, i, 1), w1 + kstep(st * U + i) * 32);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    float acc[TT][4];
#pragma unroll
    for (int t = 0; t < TT; t++)
        acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
#pragma unroll
    for (int st = 0; st < S - 1; st++)
        issue(st);
    u4 xc[TT]; // x of the step being multiplied; the next step's is loaded before it
#pragma unroll
    for (int t = 0; t < TT; t++)
        xc[t] = has[t] && readx ? ldx(xs[t] + kstep(0) * 32) : u4{0, 0, 0, 0};
#pragma unroll 1
    for (int st = 0; st < NS; st++) {
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
        issue(st + S - 1);
        const int slot = st % S;
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int j = st * U + i + 1;
            u4 xn[TT];
#pragma unroll
            for (int t = 0; t < TT; t++)
                xn[t] = has[t] && readx && j < steps ? ldx(xs[t] + kstep(j) * 32) : u4{0, 0, 0, 0};
            const u4 a0 = lds16(SLOT(slot, i, 0)), a1 = lds16(SLOT(slot, i, 1));
#pragma unroll
            for (int t = 0; t < TT; t++) {
                mma(acc[t], a0.x, a1.x, a0.y, a1.y, xc[t].x, xc[t].y);
                mma(acc[t], a0.z, a1.z, a0.w, a1.w, xc[t].z, xc[t].w);
            }
#pragma unroll
            for (int t = 0; t < TT; t++)
                xc[t] = xn[t];
        }
    }
#undef SLOT
    // acc[t][i]: row g (i < 2) or g + 8, token 8t + 2q + (i & 1)
#pragma unroll
    for (int t = 0; t < TT; t++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int tok = 8 * t + 2 * q + i;
            if (tok >= T)
                continue;
            if (GLU) {
                const float gt = acc[t][i], up = acc[t][i + 2];
                out[(long long)tok * n_out + 8 * r + g] = __float2half(gt / (1.f + __expf(-gt)) * up);
            } else if (P == 1) {
                out[(long long)tok * n_out + row0] = __float2half(acc[t][i]);
                out[(long long)tok * n_out + row1] = __float2half(acc[t][i + 2]);
            } else {
                float *pp = parts + ((long long)p * T + tok) * n_out;
                pp[row0] = acc[t][i];
                pp[row1] = acc[t][i + 2];
            }
        }
}


// The same work with the weight loaded into registers (as
// templates/skinny_linear.cu: two stages of U steps, the next in flight
// while this one is multiplied), x loaded at use.
__device__ __forceinline__ u4 ldw(const half *p)
{
    u4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
template <int TT, int U, int GLU>
__global__ void __launch_bounds__(512, 1)
rowsplit_reg(const half *__restrict__ x, const half *__restrict__ w, half *__restrict__ out, float *__restrict__ parts,
             int T, int n_out, int K, int P, int mode)
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const int R = GLU ? n_out / 8 : n_out / 16;
    const int units = R * P, B = gridDim.x;
    const int u = (int)((long long)blockIdx.x * units / B) + warp;
    if (u >= (int)((long long)(blockIdx.x + 1) * units / B))
        return;
    const int p = u / R, r = u % R, KL = K / P, k0 = p * KL + 8 * q;
    const long long row0 = GLU ? 8LL * r + g : 16LL * r + g, row1 = GLU ? n_out + 8LL * r + g : row0 + 8;
    const half *w0 = w + row0 * K + k0, *w1 = w + row1 * K + k0;
    const half *xs[TT];
    bool has[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) {
        has[t] = 8 * t + g < T;
        xs[t] = x + (long long)(has[t] ? 8 * t + g : 0) * K + k0;
    }
    const int steps = KL / 32, NS = steps / U;
    const int rot = (mode & 3) == 1 ? (int)((long long)blockIdx.x * NS / B) * U
                  : (mode & 3) == 2 ? (int)((long long)(blockIdx.x * (blockDim.x / 32) + warp) * NS / (B * (blockDim.x / 32))) * U : 0;
    const bool readx = !(mode & 4);
    auto kstep = [&](int j) { j += rot; return j >= steps ? j - steps : j; };
    float acc[TT][4];
#pragma unroll
    for (int t = 0; t < TT; t++)
        acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    u4 c0[U], c1[U], n0[U], n1[U];
#pragma unroll
    for (int i = 0; i < U; i++) {
        c0[i] = ldw(w0 + kstep(i) * 32);
        c1[i] = ldw(w1 + kstep(i) * 32);
    }
#pragma unroll 1
    for (int st = 0; st < NS; st++) {
        if (st + 1 < NS) {
#pragma unroll
            for (int i = 0; i < U; i++) {
                n0[i] = ldw(w0 + kstep((st + 1) * U + i) * 32);
                n1[i] = ldw(w1 + kstep((st + 1) * U + i) * 32);
            }
        }
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int j = kstep(st * U + i);
#pragma unroll
            for (int t = 0; t < TT; t++) {
                const u4 b = has[t] && readx ? ldx(xs[t] + j * 32) : u4{0, 0, 0, 0};
                mma(acc[t], c0[i].x, c1[i].x, c0[i].y, c1[i].y, b.x, b.y);
                mma(acc[t], c0[i].z, c1[i].z, c0[i].w, c1[i].w, b.z, b.w);
            }
        }
#pragma unroll
        for (int i = 0; i < U; i++) {
            c0[i] = n0[i];
            c1[i] = n1[i];
        }
    }
#pragma unroll
    for (int t = 0; t < TT; t++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int tok = 8 * t + 2 * q + i;
            if (tok >= T)
                continue;
            if (GLU) {
                const float gt = acc[t][i], up = acc[t][i + 2];
                out[(long long)tok * n_out + 8 * r + g] = __float2half(gt / (1.f + __expf(-gt)) * up);
            } else if (P == 1) {
                out[(long long)tok * n_out + row0] = __float2half(acc[t][i]);
                out[(long long)tok * n_out + row1] = __float2half(acc[t][i + 2]);
            } else {
                float *pp = parts + ((long long)p * T + tok) * n_out;
                pp[row0] = acc[t][i];
                pp[row1] = acc[t][i + 2];
            }
        }
}

struct shape {
    const char *name;
    int n, k, glu;
};

int main(int argc, char **argv)
{
    const int T = argc > 1 ? atoi(argv[1]) : 32;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    const int R = 8;
    const shape shapes[] = {{"q/o", 4096, 4096, 0}, {"qkv", 6144, 4096, 0}, {"gate_up", 28672, 4096, 1},
                            {"down", 4096, 14336, 0}};
    half *x, *ref, *ref2, *out;
    float *parts;
    CK(cudaMalloc(&x, (size_t)T * 14336 * 2));
    CK(cudaMalloc(&ref, (size_t)T * 28672 * 2));
    CK(cudaMalloc(&ref2, (size_t)T * 28672 * 2));
    CK(cudaMalloc(&out, (size_t)T * 28672 * 2));
    CK(cudaMalloc(&parts, (size_t)16 * T * 28672 * 4));
    fillw<<<256, 256>>>(x, (size_t)T * 14336, 7);
    for (const shape &sh : shapes) {
        const size_t wn = (size_t)sh.n * sh.k;
        std::vector<half *> ws(R);
        for (int i = 0; i < R; i++) {
            CK(cudaMalloc(&ws[i], wn * 2));
            fillw<<<1024, 256>>>(ws[i], wn, 100 + i);
        }
        CK(cudaDeviceSynchronize());
        // cuBLASLt: the whole weight (GLU: gate and up rows as one product)
        probe_gemm gm;
        probe_gemm_init(&gm, sh.n, sh.k, T);
        double best = 1e9;
        int bi = 0;
        for (int c = 0; c < gm.nh; c++) {
            double us = probe_time_graph(s, R, [&](int i) { probe_gemm_run(&gm, ws[i], x, ref, c, s); return true; });
            if (us < best)
                best = us, bi = c;
        }
        double first = probe_time_graph(s, R, [&](int i) { probe_gemm_run(&gm, ws[i], x, ref, 0, s); return true; });
        printf("{\"shape\":\"%s\",\"impl\":\"cublaslt\",\"T\":%d,\"us_first\":%.2f,\"us_best\":%.2f,\"best\":%d,\"mb\":%.1f}\n",
               sh.name, T, first, best, bi, wn * 2 / 1e6);
        probe_gemm_run(&gm, ws[R - 1], x, ref, 0, s);
        CK(cudaStreamSynchronize(s));
        std::vector<half> hr((size_t)T * sh.n);
        CK(cudaMemcpy(hr.data(), ref, hr.size() * 2, cudaMemcpyDeviceToHost));
        const int n_out = sh.glu ? sh.n / 2 : sh.n;
        for (int P : {1, 2, 4, 8}) {
            if (sh.glu && P > 1)
                continue;
            if ((sh.k / P) % 256)
                continue;
            const int units = (sh.glu ? n_out / 8 : n_out / 16) * P;
            for (int cfg = 0; cfg < 8; cfg++)
            for (int mode : {0, 1, 4}) {
                const bool reg = cfg >= 4;
                const int blocks = (cfg & 3) < 2 ? sms : 2 * sms;
                const int warps = (units + blocks - 1) / blocks;
                if (warps > 16 || warps < 6)
                    continue;
                // cfg: (U, S) = (2, 4), (4, 3), then the same at 2 blocks an SM
                const int U = reg ? (cfg % 2 ? 8 : 4) : cfg % 2 ? 4 : 2, S = reg ? 2 : cfg % 2 ? 3 : 4;
                const int smem = reg ? 0 : warps * S * U * 2 * 32 * 16;
                if (reg && (cfg & 2))
                    continue;
                if (smem > 227 * 1024 / (blocks / sms))
                    continue;
                auto kern = reg ? (sh.glu ? (cfg % 2 ? rowsplit_reg<4, 8, 1> : rowsplit_reg<4, 4, 1>)
                                          : (cfg % 2 ? rowsplit_reg<4, 8, 0> : rowsplit_reg<4, 4, 0>))
                          : sh.glu ? (cfg % 2 ? rowsplit<4, 4, 3, 1> : rowsplit<4, 2, 4, 1>)
                                   : (cfg % 2 ? rowsplit<4, 4, 3, 0> : rowsplit<4, 2, 4, 0>);
                CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                auto go = [&](int i) {
                    kern<<<blocks, warps * 32, smem, s>>>(x, ws[i], out, parts, T, n_out, sh.k, P, mode);
                    return true;
                };
                double us = probe_time_graph(s, R, go);
                CK(cudaGetLastError());
                // check the last weight's result against cuBLASLt's
                CK(cudaMemset(out, 0xff, (size_t)T * n_out * 2));
                CK(cudaMemset(parts, 0xff, (size_t)P * T * n_out * 4));
                go(R - 1);
                CK(cudaStreamSynchronize(s));
                double maxerr = 0, scale = 1e-30;
                std::vector<half> ho((size_t)T * n_out);
                std::vector<float> hp((size_t)P * T * n_out);
                CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(hp.data(), parts, hp.size() * 4, cudaMemcpyDeviceToHost));
                for (int t = 0; t < T; t++)
                    for (int n = 0; n < n_out; n++) {
                        double got, want;
                        if (sh.glu) {
                            const double gt = __half2float(hr[(size_t)t * sh.n + n]),
                                         up = __half2float(hr[(size_t)t * sh.n + n_out + n]);
                            want = gt / (1 + exp(-gt)) * up;
                            got = __half2float(ho[(size_t)t * n_out + n]);
                        } else {
                            want = __half2float(hr[(size_t)t * sh.n + n]);
                            if (P == 1)
                                got = __half2float(ho[(size_t)t * n_out + n]);
                            else {
                                got = 0;
                                for (int pp = 0; pp < P; pp++)
                                    got += hp[((size_t)pp * T + t) * n_out + n];
                            }
                        }
                        const double e = fabs(got - want);
                        scale = std::max(scale, fabs(want));
                        maxerr = e != e ? 1e30 : std::max(maxerr, e);
                    }
                if (mode & 4)
                    maxerr = -scale;
                printf("{\"shape\":\"%s\",\"impl\":\"%s\",\"mode\":%d,\"T\":%d,\"P\":%d,\"U\":%d,\"S\":%d,\"blocks\":%d,"
                       "\"warps\":%d,\"smem\":%d,\"us\":%.2f,\"tb_s\":%.3f,\"vs_cublaslt_best\":%.3f,\"max_rel_err\":%.2e}\n",
                       sh.name, reg ? "rowsplit_reg" : "rowsplit", mode, T, P, U, S, blocks, warps, smem, us, wn * 2 / us / 1e6, us / best, maxerr / scale);
                fflush(stdout);
            }
        }
        for (half *p : ws)
            CK(cudaFree(p));
    }
    return 0;
}
