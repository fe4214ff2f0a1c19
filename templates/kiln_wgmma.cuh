// Warpgroup MMA (wgmma, sm_90a only: compiled where __CUDA_ARCH_FEAT_SM90_ALL is) for kiln's Hopper kernels: the fences, the
// shared-memory matrix descriptor of a 128-byte-swizzled tile, and the shapes
// templates/paged_prefill.cu uses. A tile in shared memory is stored
// as panels of 64 kiln_elt (16-bit) columns: row r of a panel is its 128
// bytes at r * 128, 16-byte chunk c at chunk c ^ (r % 8) (what TMA's 128-byte swizzle writes),
// each panel 1024-byte aligned. wgmma needs an arch-specific target: a
// template that includes this declares //! kiln:arch-specific.
#pragma once
#include "kiln_mma.cuh" // saddr

// The registers a thread has at launch in a block of `threads` under
// __launch_bounds__(threads, 1): the SM's 65536 over the threads, in the
// allocation's steps of 8. A warp-specialized kernel's setmaxnreg split
// must fit in threads times this: setmaxnreg.inc waits for registers that
// a .dec has freed, so a split past the launch's allocation hangs the block.
#define KILN_LAUNCH_REGS(threads) (65536 / (threads) / 8 * 8)
#define KILN_SPLIT_FITS(producers, producer_regs, consumers, consumer_regs) \
    ((producers) * (producer_regs) + (consumers) * (consumer_regs) <= \
     ((producers) + (consumers)) * KILN_LAUNCH_REGS((producers) + (consumers)))

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Makes this thread's generic-proxy writes to shared memory (st.shared,
// cp.async) visible to the async proxy that wgmma reads through.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Thread 0 initializes N stages' mbarriers: full[i] completes on the P
// producers' cp.async.mbarrier.arrive.noinc (one a producer thread),
// empty[i] on one arrival of each of C consumer threads. The caller's
// __syncthreads publishes them.
template <int N, int P, int C>
__device__ __forceinline__ void stage_barriers_init(kiln_u64 *full, kiln_u64 *empty)
{
    if (threadIdx.x == 0) {
        for (int i = 0; i < N; i++) {
            asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(saddr(&full[i])), "n"(P));
            asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(saddr(&empty[i])), "n"(C));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
}

// The descriptor of a 128-byte-swizzled operand at shared address a: sbo is
// the byte stride between groups of 8 rows (1024 here); lbo, for an N-major
// operand, the byte stride between 64-column panels (unused for K-major).
__device__ __forceinline__ kiln_u64 wgmma_desc(kiln_u32 a, kiln_u32 lbo, kiln_u32 sbo)
{
    return (kiln_u64)((a & 0x3ffffu) >> 4) | ((kiln_u64)(lbo >> 4) << 16) | ((kiln_u64)(sbo >> 4) << 32) |
           (1ull << 62);
}

// The accumulator operands of a wgmma of N = 128 (64 registers) or 64 (32):
// the register list, and the operands with constraint c ("=f" or "+f").
#define WGMMA_REGS64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20," \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39," \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58," \
    "%59, %60, %61, %62, %63}, "
#define WGMMA_REGS32 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20," \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define WGMMA_D64(c) \
    c(d[0]), c(d[1]), c(d[2]), c(d[3]), c(d[4]), c(d[5]), c(d[6]), c(d[7]), c(d[8]), c(d[9]), c(d[10]), \
    c(d[11]), c(d[12]), c(d[13]), c(d[14]), c(d[15]), c(d[16]), c(d[17]), c(d[18]), c(d[19]), c(d[20]), \
    c(d[21]), c(d[22]), c(d[23]), c(d[24]), c(d[25]), c(d[26]), c(d[27]), c(d[28]), c(d[29]), c(d[30]), \
    c(d[31]), c(d[32]), c(d[33]), c(d[34]), c(d[35]), c(d[36]), c(d[37]), c(d[38]), c(d[39]), c(d[40]), \
    c(d[41]), c(d[42]), c(d[43]), c(d[44]), c(d[45]), c(d[46]), c(d[47]), c(d[48]), c(d[49]), c(d[50]), \
    c(d[51]), c(d[52]), c(d[53]), c(d[54]), c(d[55]), c(d[56]), c(d[57]), c(d[58]), c(d[59]), c(d[60]), \
    c(d[61]), c(d[62]), c(d[63])
#define WGMMA_D32(c) \
    c(d[0]), c(d[1]), c(d[2]), c(d[3]), c(d[4]), c(d[5]), c(d[6]), c(d[7]), c(d[8]), c(d[9]), c(d[10]), \
    c(d[11]), c(d[12]), c(d[13]), c(d[14]), c(d[15]), c(d[16]), c(d[17]), c(d[18]), c(d[19]), c(d[20]), \
    c(d[21]), c(d[22]), c(d[23]), c(d[24]), c(d[25]), c(d[26]), c(d[27]), c(d[28]), c(d[29]), c(d[30]), \
    c(d[31])

#define WGMMA_REGS128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
#define WGMMA_D128(c) \
    c(d[0]), c(d[1]), c(d[2]), c(d[3]), c(d[4]), c(d[5]), c(d[6]), c(d[7]), c(d[8]), c(d[9]), \
    c(d[10]), c(d[11]), c(d[12]), c(d[13]), c(d[14]), c(d[15]), c(d[16]), c(d[17]), c(d[18]), c(d[19]), \
    c(d[20]), c(d[21]), c(d[22]), c(d[23]), c(d[24]), c(d[25]), c(d[26]), c(d[27]), c(d[28]), c(d[29]), \
    c(d[30]), c(d[31]), c(d[32]), c(d[33]), c(d[34]), c(d[35]), c(d[36]), c(d[37]), c(d[38]), c(d[39]), \
    c(d[40]), c(d[41]), c(d[42]), c(d[43]), c(d[44]), c(d[45]), c(d[46]), c(d[47]), c(d[48]), c(d[49]), \
    c(d[50]), c(d[51]), c(d[52]), c(d[53]), c(d[54]), c(d[55]), c(d[56]), c(d[57]), c(d[58]), c(d[59]), \
    c(d[60]), c(d[61]), c(d[62]), c(d[63]), c(d[64]), c(d[65]), c(d[66]), c(d[67]), c(d[68]), c(d[69]), \
    c(d[70]), c(d[71]), c(d[72]), c(d[73]), c(d[74]), c(d[75]), c(d[76]), c(d[77]), c(d[78]), c(d[79]), \
    c(d[80]), c(d[81]), c(d[82]), c(d[83]), c(d[84]), c(d[85]), c(d[86]), c(d[87]), c(d[88]), c(d[89]), \
    c(d[90]), c(d[91]), c(d[92]), c(d[93]), c(d[94]), c(d[95]), c(d[96]), c(d[97]), c(d[98]), c(d[99]), \
    c(d[100]), c(d[101]), c(d[102]), c(d[103]), c(d[104]), c(d[105]), c(d[106]), c(d[107]), c(d[108]), c(d[109]), \
    c(d[110]), c(d[111]), c(d[112]), c(d[113]), c(d[114]), c(d[115]), c(d[116]), c(d[117]), c(d[118]), c(d[119]), \
    c(d[120]), c(d[121]), c(d[122]), c(d[123]), c(d[124]), c(d[125]), c(d[126]), c(d[127])

// d (64 x 128, f32) = A (64 x 16, K-major in shared memory) . B (16 x 128,
// K-major in shared memory: B's rows are its N index); d's old values are not
// read, so nothing before needs to have defined them.
__device__ __forceinline__ void wgmma_ss_n128_first(float *d, kiln_u64 da, kiln_u64 db)
{
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." KILN_ELT_PTX "." KILN_ELT_PTX " " WGMMA_REGS64
                 "%64, %65, p, 1, 1, 0, 0;\n\t}"
                 : WGMMA_D64("=f")
                 : "l"(da), "l"(db), "r"(0u));
}

// d (64 x 128, f32) += A (64 x 16, K-major in shared memory) . B (16 x 128,
// K-major in shared memory: B's rows are its N index).
__device__ __forceinline__ void wgmma_ss_n128(float *d, kiln_u64 da, kiln_u64 db)
{
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." KILN_ELT_PTX "." KILN_ELT_PTX " " WGMMA_REGS64
                 "%64, %65, p, 1, 1, 0, 0;\n\t}"
                 : WGMMA_D64("+f")
                 : "l"(da), "l"(db), "r"(1u));
}

// d (64 x 256, f32) += A (64 x 16, K-major in shared memory) . B (16 x 256,
// K-major: B's 256 rows are its N index, 8-row groups sbo apart). One
// instruction reads A once where two of N = 128 read it twice: registers
// 0-63 are columns 0-127 as wgmma_ss_n128's, 64-127 columns 128-255.
__device__ __forceinline__ void wgmma_ss_n256(float *d, kiln_u64 da, kiln_u64 db)
{
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %130, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." KILN_ELT_PTX "." KILN_ELT_PTX " " WGMMA_REGS128
                 "%128, %129, p, 1, 1, 0, 0;\n\t}"
                 : WGMMA_D128("+f")
                 : "l"(da), "l"(db), "r"(1u));
}

// The same two of N = 64 (32 registers).
__device__ __forceinline__ void wgmma_ss_n64_first(float *d, kiln_u64 da, kiln_u64 db)
{
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." KILN_ELT_PTX "." KILN_ELT_PTX " " WGMMA_REGS32
                 "%32, %33, p, 1, 1, 0, 0;\n\t}"
                 : WGMMA_D32("=f")
                 : "l"(da), "l"(db), "r"(0u));
}

__device__ __forceinline__ void wgmma_ss_n64(float *d, kiln_u64 da, kiln_u64 db)
{
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." KILN_ELT_PTX "." KILN_ELT_PTX " " WGMMA_REGS32
                 "%32, %33, p, 1, 1, 0, 0;\n\t}"
                 : WGMMA_D32("+f")
                 : "l"(da), "l"(db), "r"(1u));
}

// d (64 x 128, f32) += A (64 x 16 kiln_elt: a, as the accumulator's rows lie)
// . B (16 x 128, N-major in shared memory: B's rows are its K index).
__device__ __forceinline__ void wgmma_rs_n128(float *d, const kiln_u32 *a, kiln_u64 db)
{
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %69, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." KILN_ELT_PTX "." KILN_ELT_PTX " " WGMMA_REGS64
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n\t}"
                 : WGMMA_D64("+f")
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1u));
}

// d (64 x 64, f32) += A (64 x 16 kiln_elt: a, as the accumulator's rows lie)
// . B (16 x 64, N-major in shared memory: B's rows are its K index).
__device__ __forceinline__ void wgmma_rs_n64(float *d, const kiln_u32 *a, kiln_u64 db)
{
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." KILN_ELT_PTX "." KILN_ELT_PTX " " WGMMA_REGS32
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n\t}"
                 : WGMMA_D32("+f")
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1u));
}
#endif
