/* kiln runtime internals, for the files of runtime/ alone: the driver table,
 * the objects' structs, streams, fences and the graph cache. jit/ and
 * providers/ see the runtime through runtime/device.h. Not API. */
#ifndef KILN_RUNTIME_INTERNAL_H
#define KILN_RUNTIME_INTERNAL_H

#include <cuda.h>
#include <cudaTypedefs.h>

#include "common/internal.h"
#include "kiln/runtime.h"
#include "runtime/blas.h"
#include "runtime/device.h"

/* Every driver entry point kiln uses: name, PFN type. */
#define KILN__DRIVER_FUNCS(X)                                                                                       \
    X(cuInit, PFN_cuInit_v2000)                                                                                     \
    X(cuDriverGetVersion, PFN_cuDriverGetVersion_v2020)                                                             \
    X(cuGetErrorName, PFN_cuGetErrorName_v6000)                                                                     \
    X(cuGetErrorString, PFN_cuGetErrorString_v6000)                                                                 \
    X(cuDeviceGetCount, PFN_cuDeviceGetCount_v2000)                                                                 \
    X(cuDeviceGet, PFN_cuDeviceGet_v2000)                                                                           \
    X(cuDeviceGetName, PFN_cuDeviceGetName_v2000)                                                                   \
    X(cuDeviceGetAttribute, PFN_cuDeviceGetAttribute_v2000)                                                         \
    X(cuDeviceTotalMem, PFN_cuDeviceTotalMem_v3020)                                                                 \
    X(cuDevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain_v7000)                                                 \
    X(cuDevicePrimaryCtxRelease, PFN_cuDevicePrimaryCtxRelease_v11000)                                              \
    X(cuDevicePrimaryCtxReset, PFN_cuDevicePrimaryCtxReset_v11000)                                                  \
    X(cuCtxSetCurrent, PFN_cuCtxSetCurrent_v4000)                                                                   \
    X(cuCtxGetCurrent, PFN_cuCtxGetCurrent_v4000)                                                                   \
    X(cuCtxSynchronize, PFN_cuCtxSynchronize_v2000)                                                                 \
    X(cuStreamCreate, PFN_cuStreamCreate_v2000)                                                                     \
    X(cuStreamDestroy, PFN_cuStreamDestroy_v4000)                                                                   \
    X(cuStreamSynchronize, PFN_cuStreamSynchronize_v2000)                                                           \
    X(cuMemAlloc, PFN_cuMemAlloc_v3020)                                                                             \
    X(cuMemFree, PFN_cuMemFree_v3020)                                                                               \
    X(cuMemcpyHtoD, PFN_cuMemcpyHtoD_v3020)                                                                         \
    X(cuMemcpyDtoHAsync, PFN_cuMemcpyDtoHAsync_v3020)                                                               \
    X(cuMemsetD8Async, PFN_cuMemsetD8Async_v3020)                                                                   \
    X(cuModuleLoadData, PFN_cuModuleLoadData_v2000)                                                                 \
    X(cuModuleUnload, PFN_cuModuleUnload_v2000)                                                                     \
    X(cuModuleGetFunction, PFN_cuModuleGetFunction_v2000)                                                           \
    X(cuLaunchKernel, PFN_cuLaunchKernel_v4000)                                                                     \
    X(cuLaunchKernelEx, PFN_cuLaunchKernelEx_v11060)                                                                \
    X(cuEventCreate, PFN_cuEventCreate_v2000)                                                                       \
    X(cuEventDestroy, PFN_cuEventDestroy_v4000)                                                                     \
    X(cuEventRecord, PFN_cuEventRecord_v2000)                                                                       \
    X(cuEventSynchronize, PFN_cuEventSynchronize_v2000)                                                             \
    X(cuEventElapsedTime, PFN_cuEventElapsedTime_v2000)                                                             \
    X(cuEventQuery, PFN_cuEventQuery_v2000)                                                                         \
    X(cuStreamQuery, PFN_cuStreamQuery_v2000)                                                                       \
    X(cuMemcpyAsync, PFN_cuMemcpyAsync_v4000)                                                                       \
    X(cuMemcpyHtoDAsync, PFN_cuMemcpyHtoDAsync_v3020)                                                               \
    X(cuMemcpyDtoH, PFN_cuMemcpyDtoH_v3020)                                                                         \
    X(cuStreamBeginCapture, PFN_cuStreamBeginCapture_v10010)                                                        \
    X(cuStreamEndCapture, PFN_cuStreamEndCapture_v10000)                                                            \
    X(cuGraphInstantiateWithFlags, PFN_cuGraphInstantiateWithFlags_v11040)                                          \
    X(cuGraphLaunch, PFN_cuGraphLaunch_v10000)                                                                      \
    X(cuGraphExecDestroy, PFN_cuGraphExecDestroy_v10000)                                                            \
    X(cuGraphDestroy, PFN_cuGraphDestroy_v10000)                                                                  \
    X(cuGraphUpload, PFN_cuGraphUpload_v11010)                                                                    \
    X(cuGraphGetNodes, PFN_cuGraphGetNodes_v10000)                                                                \
    X(cuMemGetInfo, PFN_cuMemGetInfo_v3020)                                                                       \
    X(cuLaunchHostFunc, PFN_cuLaunchHostFunc_v10000)                                                              \
    X(cuMemHostAlloc, PFN_cuMemHostAlloc_v2020)                                                                   \
    X(cuMemFreeHost, PFN_cuMemFreeHost_v2000)                                                                     \
    X(cuMemHostGetDevicePointer, PFN_cuMemHostGetDevicePointer_v3020)                                             \
    X(cuFuncSetAttribute, PFN_cuFuncSetAttribute_v9000)                                                           \
    X(cuFuncGetAttribute, PFN_cuFuncGetAttribute_v2020)                                                           \
    X(cuTensorMapEncodeTiled, PFN_cuTensorMapEncodeTiled_v12000)                                                  \
    X(cuOccupancyMaxActiveClusters, PFN_cuOccupancyMaxActiveClusters_v11070)                                      \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor, PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050)

typedef struct kiln__driver {
#define KILN__DRIVER_FIELD(name, type) type name;
    KILN__DRIVER_FUNCS(KILN__DRIVER_FIELD)
#undef KILN__DRIVER_FIELD
} kiln__driver;

/* The loaded driver, or NULL with *why saying what failed (dlopen, a missing
 * entry point, cuInit). Loaded once per process; thread-safe. */
const kiln__driver *kiln__driver_get(const char **why);

/* Maps a CUresult to a status and records "what: NAME (code): text". */
kiln_status kiln__cuda_fail(kiln__errslot *slot, CUresult r, const char *what);

/* ---- objects, shared by the files of runtime/ ---- */

struct kiln_runtime {
    const kiln__driver *d;
    CUdevice dev;
    CUcontext ctx;
    kiln_runtime_info info;
    _Atomic int broken;         /* a sticky device error: every later call fails with it */
    _Atomic uint64_t module_epoch; /* bumped when a module is unloaded: older graphs are dropped */
    int pdl;                    /* programmatic dependent launch (sm_90 and later) */
    struct kiln_stream *own;    /* the stream of the immediate calls */
    pthread_t blas_warm;        /* cuBLASLt's first use, off the caller's thread (runtime/blas.c) */
    int blas_warm_started;
    kiln__errslot err;
};

struct kiln_buffer {
    kiln_runtime *rt;
    _Atomic long refs;          /* the caller's handle + each command naming it */
    CUdeviceptr base;           /* what cuMemAlloc returned */
    CUdeviceptr ptr;            /* base rounded up to the alignment */
    size_t size;
    kiln_dtype dtype;
    kiln_buffer_usage usage;
};

struct kiln_command {
    kiln_runtime *rt;
    _Atomic long refs;          /* the caller's handle + each batch holding it */
    char op_id[KILN_OP_ID_MAX];
    kiln_batching batching;
    uint32_t participants, tokens, dispatches, transfers;
    kiln_region *regions;       /* each holds a reference on its buffer */
    size_t n_regions;
    void *host_data;
    size_t host_bytes;
    kiln_enqueue_fn enqueue;
    void *user;
    void (*user_free)(void *);
    uint8_t *replay_key;
    size_t replay_key_bytes;
    uint64_t key_hash;          /* kiln__key_hash of the replay key */
};

struct kiln_launch_context {
    CUstream stream;
    CUdeviceptr fault;
    const kiln_command *cmd;
    void *cublaslt;             /* the submitting stream's handle */
};

typedef struct kiln__graph kiln__graph;
typedef struct kiln__graph_cache kiln__graph_cache;

/* A submitted batch. The fence handle a caller gets is the batch itself. */
struct kiln_fence {
    struct kiln_stream *stream;
    int refs;                   /* the stream's pending list + the caller's handle */
    kiln_command **cmds;
    size_t n;
    char *phase;
    kiln_timing timing;
    CUevent done;               /* recorded after the batch */
    CUevent start;              /* with timing on */
    CUevent *span_events;       /* two per span */
    kiln_span *spans;
    size_t n_spans;
    kiln_attribution *rows;
    struct kiln__span_plan *plans; /* per span: the graph to launch or the segment to capture */
    kiln__graph **graphs;       /* the graphs it launched, one reference each */
    size_t n_graphs;
    uint32_t n_deferred;        /* distinct segments run eager on a busy stream */
    kiln_fence_state state;
    int timed;                  /* timings read back */
    struct kiln_fence *next;    /* in the stream's pending or quarantine list */
};

struct kiln_stream {
    kiln_runtime *rt;
    CUstream handle;
    void *cublaslt;             /* cublasLtHandle_t */
    CUdeviceptr fault;          /* one kiln__fault */
    kiln_stream_state state;
    struct kiln_fence *pending; /* submitted, not known complete (oldest first) */
    struct kiln_fence *quarantine;
    int refs;                   /* the caller's handle + each batch not yet freed */
    int destroyed;              /* kiln_stream_destroy was called: the CUDA objects are gone */
    kiln__graph_cache *graphs;
    CUevent *idle_events[2];    /* finished events for reuse: [0] untimed, [1] timed */
    size_t n_idle_events[2];
};

struct kiln_binding_arena {
    kiln_runtime *rt;
    kiln_buffer *buffer;
    uint8_t *mirror;
    kiln_binding_slot *slots;
    size_t n_slots, total;
    uint64_t uploads;
};

/* The cleanup paths' kiln__runtime_enter: 1 when the context is usable and
 * current, and no message is recorded either way (a destroy must not hide the
 * error that led to it). */
int kiln__runtime_usable(kiln_runtime *rt);
void kiln__buffer_retain(kiln_buffer *buf);

/* A transfer command that sets every byte of dst to value (zero is value 0). */
kiln_status kiln__command_fill(kiln_runtime *rt, const kiln_region *dst, uint8_t value, kiln_command **out);
void kiln__command_retain(kiln_command *cmd);

/* Streams (runtime/stream.c; submission in runtime/submit.c). */

/* What moves a stream between states. */
typedef enum kiln__stream_event {
    KILN__EV_BEGIN,          /* a submission starts enqueueing */
    KILN__EV_ENQUEUED,       /* it was enqueued whole */
    KILN__EV_ENQUEUE_FAILED, /* it failed half-way */
    KILN__EV_DRAINED,        /* every submitted batch is known complete */
    KILN__EV_SYNCED,         /* synchronize waited and released everything */
    KILN__EV_DEVICE_FAILED   /* the device failed */
} kiln__stream_event;

/* The state machine, pure: Ready -> Recording -> Submitted -> Ready, and
 * Failed. KILN_ERR_RUNTIME_CONTRACT (recorded in err) for a move it forbids. */
kiln_status kiln__stream_next(kiln__errslot *err, kiln_stream_state from, kiln__stream_event ev,
                              kiln_stream_state *to);
const char *kiln__stream_state_name(kiln_stream_state s);
/* Every check of a submission that needs no device: the stream's state, each
 * command's runtime, the compute path's requirement, the patches. */
kiln_status kiln__submit_validate(kiln_stream *s, kiln_command *const *cmds, size_t n,
                                  const kiln_submit_options *o);
/* A binding layout's slots tile [0, total) exactly. */
kiln_status kiln__binding_layout_check(kiln__errslot *err, const kiln_binding_slot *slots, size_t n,
                                       size_t total);
/* Patches inside their slots, sorted by (slot, offset), disjoint. */
kiln_status kiln__binding_patches_check(kiln__errslot *err, const kiln_binding_slot *slots, size_t n_slots,
                                        const kiln_binding_patch *p, size_t n);
kiln_status kiln__binding_validate(kiln_binding_arena *a, kiln_runtime *rt, const kiln_binding_patch *p, size_t n);
kiln_status kiln__binding_apply(kiln_binding_arena *a, const kiln_binding_patch *p, size_t n, CUstream stream);
/* The bytes to allocate for bytes at align (cuMemAlloc aligns to 256), and
 * the aligned address inside an allocation at base; 0, or -1 on overflow. */
int kiln__alloc_size(size_t bytes, size_t align, size_t *total);
uint64_t kiln__align_up(uint64_t base, size_t align);
kiln_status kiln__stream_init(kiln_runtime *rt, kiln_stream **out);
/* Reads and clears the stream's fault record; KILN_ERR_DEVICE_CONTRACT when a kernel reported. */
kiln_status kiln__stream_check_fault(kiln_stream *s);
/* Applies a move of the state machine that the caller knows to be allowed. */
void kiln__stream_move(kiln_stream *s, kiln__stream_event ev);
/* Notes the batches that have completed, oldest first (the stream's
 * reference to each dropped); a failed query fails the stream. */
void kiln__stream_reap(kiln_stream *s);
/* Drops a reference to the stream struct (its handle's or a batch's). */
void kiln__stream_unref(kiln_stream *s);
/* An event from the stream's pool ([timed] or untimed), or a new one; and
 * back into the pool (reusable: its batch completed) or destroyed. */
kiln_status kiln__stream_event_get(kiln_stream *s, int timed, CUevent *ev);
void kiln__stream_event_put(kiln_stream *s, int timed, CUevent ev, int reusable);

/* Fences (runtime/fence.c): a batch's last reference frees its commands'
 * references, graphs and events. */
void kiln__fence_free(kiln_fence *b);
void kiln__fence_unref(kiln_fence *b);

/* The graph executable cache (runtime/graph.c). */
uint64_t kiln__key_hash(const void *p, size_t n);
uint64_t kiln__segment_hash(kiln_command *const *cmds, uint32_t first, uint32_t last);
kiln_status kiln__graph_cache_create(kiln_runtime *rt, kiln__graph_cache **out);
/* Drops the cache's references; graphs a batch still holds live until it is freed. */
void kiln__graph_cache_destroy(kiln__graph_cache *c);
/* The resident graph of commands [first, last] (no reference added), or NULL;
 * *rejected says whether the segment is remembered as rejected. */
kiln__graph *kiln__graph_find(kiln__graph_cache *c, kiln_command *const *cmds, uint32_t first, uint32_t last,
                              uint64_t hash, int *rejected);
/* Counts a launch of a resident graph and makes it the most recently used. */
void kiln__graph_hit(kiln__graph_cache *c, kiln__graph *g);
/* Takes exec into the cache (the cache's reference) and evicts what no longer fits. */
kiln_status kiln__graph_insert(kiln__graph_cache *c, kiln_command *const *cmds, uint32_t first, uint32_t last,
                               uint64_t hash, CUgraphExec exec, size_t bytes, kiln__graph **out);
void kiln__graph_reject(kiln__graph_cache *c, kiln_command *const *cmds, uint32_t first, uint32_t last,
                        uint64_t hash);
void kiln__graph_deferred(kiln__graph_cache *c, uint64_t n);
/* A submission or prepare begins: graphs it uses (kiln__graph_use, hits,
 * captures) are not evicted for capacity until the next call begins. */
void kiln__graph_cache_begin_call(kiln__graph_cache *c);
void kiln__graph_use(kiln__graph_cache *c, kiln__graph *g);
/* Whether the adaptive path captures segments it has not seen (1 by default). */
void kiln__graph_cache_set_capture(kiln__graph_cache *c, int on);
int kiln__graph_cache_captures(const kiln__graph_cache *c);
void kiln__graph_ref(kiln__graph *g);
void kiln__graph_unref(kiln__graph *g);
CUgraphExec kiln__graph_exec(const kiln__graph *g);

#endif
