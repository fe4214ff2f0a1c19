// kiln's own prelude for every template: what the kernels need, without any
// toolkit header (a deployment may ship libnvrtc without them, and including
// cuda_fp16.h costs compile time). Its bytes are part of every fingerprint.
#pragma once

typedef unsigned short kiln_f16;   // IEEE half, stored as its 16 bits
typedef unsigned int kiln_u32;
typedef unsigned long long kiln_u64;

struct __align__(16) kiln_u32x4 { kiln_u32 x, y, z, w; };

__device__ __forceinline__ float kiln_f16_to_f32(kiln_f16 h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ kiln_f16 kiln_f32_to_f16(float f)
{
    kiln_f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The element type of activations, weights and the KV cache: f16, or bf16
// when the spec sets BF16 = 1 (kiln__spec_set_elt). Both are stored as 16
// bits; arithmetic is f32. bf16 needs sm_80 or later (cvt.rn.bf16.f32).
#ifndef KILN_BF16
#define KILN_BF16 0
#endif
#if KILN_BF16 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "bf16 needs sm_80 or later"
#endif
typedef unsigned short kiln_elt;
// Its name in PTX type suffixes (mma.sync, wgmma, cvt).
#if KILN_BF16
#define KILN_ELT_PTX "bf16"
#else
#define KILN_ELT_PTX "f16"
#endif

__device__ __forceinline__ float kiln_elt_to_f32(kiln_elt h)
{
#if KILN_BF16
    return __uint_as_float((kiln_u32)h << 16);
#else
    return kiln_f16_to_f32(h);
#endif
}

__device__ __forceinline__ kiln_elt kiln_f32_to_elt(float f)
{
#if KILN_BF16
    kiln_elt h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return kiln_f32_to_f16(f);
#endif
}

// 16-byte load through the read-only path; p must be 16-byte aligned.
__device__ __forceinline__ kiln_u32x4 kiln_ldg16(const void *p)
{
    kiln_u32x4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// 16-byte load through L2 (ld.global.cg), for what a kernel reads before its
// dependency sync (KILN_INPUT_BEFORE_DEPENDENCY_SYNC); p 16-byte aligned.
__device__ __forceinline__ kiln_u32x4 kiln_ldcg16(const void *p)
{
    kiln_u32x4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void kiln_stg16(void *p, kiln_u32x4 v)
{
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// The device fault record (common/fault.h restated): a kernel that finds bad
// data reports it here and touches nothing it must not.
struct kiln_fault {
    kiln_u32 code;
    kiln_u32 pad;
    kiln_u64 first;  // min of (index << 32 | value): the lowest index wins
    kiln_u64 limit;
};

#define KILN_FAULT_TOKEN_ID 1u

// The two halves of programmatic dependent launch (below), no-ops before
// sm_90. The wait alone starts a kernel that lets its dependents launch
// itself (kiln_grid_launch_dependents, later in the same body) once what
// they read before their own sync is ready: the gated delta pre-pass clears
// the flags its streamed chain kernel polls, then lets that kernel launch.
__device__ __forceinline__ void kiln_grid_dependency_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void kiln_grid_launch_dependents()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Programmatic dependent launch (sm_90 and later). A kernel kiln launches
// with programmatic stream serialization may start before the kernel ahead of
// it in the stream has finished: it must call kiln_grid_dependency_sync()
// before it reads or writes anything that kernel touches (kiln's kernels call
// it first thing). It first lets the next kernel start launching
// (launch_dependents), then waits (wait): wait returns only when every grid
// this one depends on has completed and its memory is visible, so the next
// kernel, which waits in turn, can never run ahead of this one's writes, nor
// of anything before it (this grid completes only after its own wait). The
// next grid launches once every block of this one has triggered (or exited),
// that is once no block of this grid is left waiting for an SM, so its early
// blocks take no slot this grid needs; they sit in their own wait, and the
// launch latency of a chain of small kernels overlaps the work ahead of it.
// A no-op when launched the ordinary way.
__device__ __forceinline__ void kiln_grid_dependency_sync()
{
    kiln_grid_launch_dependents();
    kiln_grid_dependency_wait();
}

// The sync's other order, for a kernel whose next one reads, before its own
// sync, what the kernels ahead of this one wrote: wait, then let the next
// kernel launch. That kernel then launches only once everything ahead of this
// one is complete (it reads that through L2: ld.global.cg), and starts with
// KILN_INPUT_BEFORE_DEPENDENCY_SYNC.
__device__ __forceinline__ void kiln_grid_dependency_wait_then_launch()
{
    kiln_grid_dependency_wait();
    kiln_grid_launch_dependents();
}
#define KILN_INPUT_BEFORE_DEPENDENCY_SYNC ((void)0)

// The one exception to "kiln_grid_dependency_sync() first": a kernel whose
// body starts with this marker requests part of its weight (a model
// parameter, which no kernel ahead of it writes: the op's contract says so)
// before its kiln_grid_dependency_sync(), and reads nothing else before it
// (tests/test_jit.c checks the marker and that the sync follows).
#define KILN_WEIGHT_BEFORE_DEPENDENCY_SYNC ((void)0)

__device__ __forceinline__ void kiln_report_fault(kiln_fault *f, kiln_u32 code, kiln_u32 index, kiln_u32 value,
                                                  kiln_u64 limit)
{
    atomicMin(&f->first, ((kiln_u64)index << 32) | value);
    f->limit = limit;
    atomicExch(&f->code, code);
}
