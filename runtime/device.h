/* The runtime's device interface for jit/ and providers/: modules and their
 * functions, function attributes and occupancy, launches, buffer addresses,
 * tensor maps, scratch memory and a timer, and the runtime's error slot. The
 * driver table and the runtime's structs stay in runtime/internal.h. Not API.
 *
 * The functions that return a CUresult pass the driver's answer through and
 * record nothing (the caller decides whether a failure is reported, through
 * kiln__runtime_cu_fail); those that return a kiln_status record their
 * failure in the runtime's error slot. */
#ifndef KILN_RUNTIME_DEVICE_H
#define KILN_RUNTIME_DEVICE_H

#include <cuda.h>

#include "common/internal.h"
#include "kiln/runtime.h"

/* ---- the runtime ---- */

kiln__errslot *kiln__runtime_errslot(kiln_runtime *rt);
/* Makes the runtime's context current on the calling thread, or returns the
 * sticky error of a broken runtime. */
kiln_status kiln__runtime_enter(kiln_runtime *rt);
/* Records a driver failure; a sticky one breaks the runtime for good. */
kiln_status kiln__runtime_cu_fail(kiln_runtime *rt, CUresult r, const char *what);
/* The device's L2 cache bytes (0 where the driver does not say). */
size_t kiln__runtime_l2_bytes(const kiln_runtime *rt);
/* Whether launches with KILN__LAUNCH_PDL use programmatic dependent launch
 * (sm_90 and later, not turned off by $KILN_PDL=0 when rt was created). */
int kiln__runtime_pdl(const kiln_runtime *rt);

/* ---- modules and functions ---- */

kiln_status kiln__runtime_load_module(kiln_runtime *rt, const void *cubin, CUmodule *out);
/* Waits for the device (graphs captured earlier may hold the module's
 * functions: none is launched again) and unloads it. NULL is a no-op. */
void kiln__runtime_unload_module(kiln_runtime *rt, CUmodule module);
/* The entry point name of module. A failure is reported in the calling
 * thread's message only (not the runtime's slot): it is the module's, not
 * the device's. */
kiln_status kiln__module_function(kiln_runtime *rt, CUmodule module, const char *name, CUfunction *out);
/* cuFuncSetAttribute: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (which
 * the driver refuses with CUDA_ERROR_INVALID_VALUE past the device's opt-in
 * limit; never lowered: a value at or below the function's present limit
 * leaves it, so commands encoded earlier keep their launches),
 * CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
 * CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT. */
CUresult kiln__function_set_attribute(kiln_runtime *rt, CUfunction fn, CUfunction_attribute attr, int value);
/* Blocks of fn (threads each, shared_bytes of dynamic shared memory) one SM
 * holds at once, after making the context current; 0 when the driver cannot
 * say. */
int kiln__function_blocks_per_sm(kiln_runtime *rt, CUfunction fn, unsigned threads, unsigned shared_bytes);
/* The dynamic shared memory that a block of a (threads_a) and one of b
 * (threads_b) have between them on one SM holding both at once (the SM's
 * shared memory less each one's static bytes and reservation); 0 where their
 * threads or registers do not fit one SM together, or the driver cannot say.
 * A kernel launched while another runs (programmatic dependent launch) can
 * then start its loads beside it. */
size_t kiln__function_pair_shared_bytes(kiln_runtime *rt, CUfunction a, unsigned threads_a, CUfunction b,
                                        unsigned threads_b);
/* fn declares its cluster size itself (__cluster_dims__): the occupancy query
 * names none. */
#define KILN__CLUSTER_DECLARED 1u
/* How many clusters of cluster_x blocks (block_x threads, shared_bytes of
 * dynamic shared memory each) the device holds at once: a query of a grid of
 * one cluster; 0 when none fits or the driver cannot say. flags:
 * KILN__CLUSTER_DECLARED or 0. */
int kiln__function_clusters(kiln_runtime *rt, CUfunction fn, unsigned cluster_x, unsigned block_x,
                            unsigned shared_bytes, unsigned flags);

/* ---- launches ---- */

/* Launches fn on the context's stream, with programmatic dependent launch
 * (every kiln template calls kiln_grid_dependency_sync() first thing). */
kiln_status kiln__launch(const kiln_launch_context *ctx, kiln_runtime *rt, CUfunction fn, unsigned grid_x,
                         unsigned block_x, unsigned shared_bytes, void **args);
/* The same with a 3-D grid, and with programmatic dependent launch when the
 * kernel calls kiln_grid_dependency_sync() first thing (KILN__LAUNCH_PDL; a
 * plain launch where the device has no PDL, before sm_90). */
#define KILN__LAUNCH_PDL 1u
kiln_status kiln__launch_ex(const kiln_launch_context *ctx, kiln_runtime *rt, CUfunction fn, const unsigned grid[3],
                            unsigned block_x, unsigned shared_bytes, void **args, unsigned flags);
/* kiln__launch_ex with the blocks in clusters of cluster_x along x (grid[0] a
 * multiple of it; 1 is kiln__launch_ex). */
kiln_status kiln__launch_cluster(const kiln_launch_context *ctx, kiln_runtime *rt, CUfunction fn,
                                 const unsigned grid[3], unsigned cluster_x, unsigned block_x, unsigned shared_bytes,
                                 void **args, unsigned flags);

/* ---- buffers and device memory ---- */

kiln_runtime *kiln__buffer_runtime(const kiln_buffer *buf);
/* The buffer's device address (its alignment applied). */
CUdeviceptr kiln__buffer_ptr(const kiln_buffer *buf);
/* cuTensorMapEncodeTiled, its arguments as the driver's. */
CUresult kiln__tensor_map_encode_tiled(kiln_runtime *rt, CUtensorMap *map, CUtensorMapDataType type, cuuint32_t rank,
                                       void *base, const cuuint64_t *dims, const cuuint64_t *strides,
                                       const cuuint32_t *box, const cuuint32_t *element_strides,
                                       CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                       CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob);
/* Scratch device memory outside any buffer (cuMemAlloc, cuMemFree), for work
 * on a timer's stream; free of 0 is a no-op. */
CUresult kiln__device_alloc(kiln_runtime *rt, CUdeviceptr *out, size_t bytes);
void kiln__device_free(kiln_runtime *rt, CUdeviceptr p);

/* ---- a timer: a private stream and an event pair ---- */

/* Work timed apart from every kiln stream (the dense providers time their
 * candidates on one). Used by one thread at a time. */
typedef struct kiln__device_timer kiln__device_timer;
/* Makes the context current, then creates the stream (non-blocking) and its
 * two events; any failure gives a CUresult other than CUDA_SUCCESS and
 * *out NULL. */
CUresult kiln__device_timer_create(kiln_runtime *rt, kiln__device_timer **out);
/* Waits for the stream, then destroys it and its events. NULL is a no-op. */
void kiln__device_timer_destroy(kiln__device_timer *t);
CUstream kiln__device_timer_stream(const kiln__device_timer *t);
/* Enqueues a write of value to every byte of [p, p + bytes) on the stream. */
CUresult kiln__device_timer_fill(kiln__device_timer *t, CUdeviceptr p, unsigned char value, size_t bytes);
/* Records the start event on the stream. */
CUresult kiln__device_timer_start(kiln__device_timer *t);
/* Records the end event, waits for it and gives *ms since the start event. */
CUresult kiln__device_timer_stop(kiln__device_timer *t, float *ms);
/* Waits for everything enqueued on the stream. */
CUresult kiln__device_timer_sync(kiln__device_timer *t);

#endif
