/* kiln — the device boundary.
 *
 * The CUDA driver is loaded at run time (dlopen of libcuda.so.1, entry points
 * through cuGetProcAddress), never linked: on a machine without a driver every
 * call here returns KILN_ERR_NO_DEVICE with a message saying why, and the rest
 * of kiln (jit, cache, prewarm) works offline for a named architecture.
 *
 * Objects: a kiln_runtime holds the primary context of one device. Buffers are
 * byte allocations with a power-of-two alignment, an element type and a usage.
 * A command is one unit of device work (a kernel launch an operation encoded,
 * or a transfer) with the regions and host bytes it retains. A stream submits
 * batches of commands and returns a fence per batch; a fence says when the
 * batch is done, how long it took, and which command did what (attribution).
 *
 * Lifetime: buffers, commands and fences are reference counted. A buffer's
 * memory is freed after its last user is gone: the caller's handle, every
 * command that names one of its regions, every pending fence and every
 * quarantined batch holding such a command. Nothing is freed while the GPU
 * may still touch it.
 *
 * Failure: an enqueue that fails half-way through a batch marks the stream
 * Failed and quarantines the batch (its commands and so their memory) until
 * kiln_stream_synchronize. A device fault (an illegal address) breaks the
 * runtime for good: every later call returns the fault's code, and the
 * runtime can only be destroyed. The CUDA driver makes such a fault sticky
 * for the whole process: a new runtime in that process fails with the same
 * code and a message saying to restart; a new process works (tested).
 *
 * Threading: a stream (and what it submits, its fences included) is used by
 * one thread at a time; different streams of one runtime may be used from
 * different threads. The reference counts of buffers and commands are atomic;
 * release a fence on its stream's thread.
 *
 * Options structs (kiln_runtime_options, kiln_buffer_desc, kiln_command_desc,
 * kiln_submit_options, kiln_graph_options) begin with a size: sizeof the
 * struct as the caller's header declares it, or 0 for this header's. The
 * library reads the fields that size covers and gives every field past it
 * its default (the value of zero), so that a caller built against an older,
 * shorter struct keeps working; of a larger size it reads the fields it
 * knows. A size of 1 to 3 (inside the size field itself) is refused with
 * KILN_ERR_INVALID_ARGUMENT naming the struct and the size. A NULL options
 * pointer, where one is allowed, is every default.
 */
#ifndef KILN_RUNTIME_H
#define KILN_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/status.h"
#include "kiln/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_runtime kiln_runtime;
typedef struct kiln_buffer kiln_buffer;
typedef struct kiln_command kiln_command;
typedef struct kiln_stream kiln_stream;
typedef struct kiln_fence kiln_fence;
typedef struct kiln_binding_arena kiln_binding_arena;

/* ---- the runtime ---- */

typedef struct kiln_runtime_options {
    uint32_t size;      /* sizeof(kiln_runtime_options) or 0; fields past it take their defaults */
    int device_ordinal; /* 0: the first device */
} kiln_runtime_options;

/* What a runtime can do (kiln_runtime_info.capabilities). */
enum {
    KILN_CAP_LAUNCH = 1u << 0,      /* kernels and transfers */
    KILN_CAP_TIMING = 1u << 1,      /* device-measured elapsed time and spans */
    KILN_CAP_GRAPHS = 1u << 2,      /* stream capture and graph replay */
    KILN_CAP_CUBLASLT = 1u << 3,    /* a cuBLASLt handle per stream */
    KILN_CAP_F16 = 1u << 4,
    KILN_CAP_BF16 = 1u << 5,        /* advertised once an operation of the catalog takes bf16 */
    KILN_CAP_PAGED_KV = 1u << 6     /* the fixed-block storage profile */
};

typedef enum kiln_storage_kind {
    KILN_STORAGE_LINEAR_ARENA = 1, /* one contiguous arena, bump-allocated */
    KILN_STORAGE_FIXED_BLOCK = 2   /* fixed-size pages (the paged KV cache) */
} kiln_storage_kind;

typedef struct kiln_storage_profile {
    const char *name;       /* "linear", "paged_kv": static strings */
    kiln_storage_kind kind;
    size_t block_bytes;     /* 0 for a linear arena; 65536 for paged KV */
    size_t alignment;
} kiln_storage_profile;

#define KILN_MAX_STORAGE_PROFILES 4

typedef struct kiln_runtime_info {
    int device_ordinal;
    char arch[16];        /* "sm_90" */
    char name[128];       /* the device's name */
    uint64_t total_memory;
    int multiprocessors;
    int driver_version;   /* 13000 for CUDA 13.0 */
    uint64_t instance_id; /* unique in this process; never reused */
    uint32_t capabilities;/* KILN_CAP_* */
    /* SHA-256 (hex) over kiln's template sources and provider versions. */
    char implementation_fingerprint[65];
    size_t n_storage_profiles;
    kiln_storage_profile storage_profiles[KILN_MAX_STORAGE_PROFILES];
} kiln_runtime_info;

/* Whether the driver loads and reports at least one device: 1 or 0. When 0
 * and why is not NULL, *why names the reason (static text). */
KILN_API int kiln_driver_available(const char **why);

/* KILN_ERR_NO_DEVICE (no driver, no device, bad ordinal), KILN_ERR_CUDA_*,
 * KILN_ERR_INVALID_ARGUMENT (out NULL, a size inside the size field; checked
 * before the driver is loaded). opts may be NULL. */
KILN_API kiln_status kiln_runtime_create(const kiln_runtime_options *opts, kiln_runtime **out);
/* Waits for all work, releases what the runtime holds, then frees it. Buffers,
 * commands and fences of it must be released before. NULL is a no-op. */
KILN_API void kiln_runtime_destroy(kiln_runtime *rt);
KILN_API void kiln_runtime_get_info(const kiln_runtime *rt, kiln_runtime_info *out);
KILN_API const char *kiln_runtime_errmsg(const kiln_runtime *rt);
/* Waits for the work of the runtime's own stream (the one the immediate
 * kiln_op_* calls use) and reports as kiln_stream_synchronize. */
KILN_API kiln_status kiln_runtime_synchronize(kiln_runtime *rt);
/* The runtime's own stream. Owned by the runtime. */
KILN_API kiln_stream *kiln_runtime_stream(kiln_runtime *rt);

/* ---- buffers and regions ---- */

typedef enum kiln_buffer_usage {
    KILN_USAGE_GENERAL = 0,
    KILN_USAGE_WEIGHTS = 1,
    KILN_USAGE_ACTIVATIONS = 2,
    KILN_USAGE_KV_CACHE = 3,
    KILN_USAGE_BINDINGS = 4,
    KILN_USAGE_WORKSPACE = 5
} kiln_buffer_usage;

typedef struct kiln_buffer_desc {
    uint32_t size;          /* sizeof(kiln_buffer_desc) or 0; fields past it take their defaults */
    size_t bytes;           /* > 0 */
    size_t alignment;       /* a power of two <= 2^30; 0: 256 */
    kiln_dtype dtype;       /* the element type; KILN_DTYPE_BYTES: untyped */
    kiln_buffer_usage usage;
} kiln_buffer_desc;

/* KILN_ERR_RUNTIME_CONTRACT (zero bytes, a bad alignment, bytes not a whole
 * number of elements, an unknown dtype or usage), KILN_ERR_CUDA_OUT_OF_MEMORY
 * (retryable), KILN_ERR_INVALID_ARGUMENT (NULL arguments, a size inside the
 * size field). */
KILN_API kiln_status kiln_buffer_create_ex(kiln_runtime *rt, const kiln_buffer_desc *desc, kiln_buffer **out);
/* An untyped buffer: kiln_buffer_create_ex with dtype bytes, usage general. */
KILN_API kiln_status kiln_buffer_create(kiln_runtime *rt, size_t bytes, size_t align, kiln_buffer **out);
/* Drops the caller's reference; the memory goes when the last user is done.
 * NULL is a no-op. */
KILN_API void kiln_buffer_destroy(kiln_buffer *buf);
KILN_API size_t kiln_buffer_size(const kiln_buffer *buf);
KILN_API kiln_dtype kiln_buffer_dtype(const kiln_buffer *buf);
KILN_API kiln_buffer_usage kiln_buffer_usage_of(const kiln_buffer *buf);
/* The device address (a CUdeviceptr), for interoperation. */
KILN_API uint64_t kiln_buffer_device_address(const kiln_buffer *buf);
/* Copies host bytes into [offset, offset + bytes) after the runtime's own
 * stream's work; synchronous. KILN_ERR_RUNTIME_CONTRACT for an empty or
 * out-of-bounds region. */
KILN_API kiln_status kiln_buffer_upload(kiln_buffer *buf, size_t offset, const void *src, size_t bytes);
/* Copies [offset, offset + bytes) to host memory after all streams' work. */
KILN_API kiln_status kiln_buffer_readback(kiln_buffer *buf, size_t offset, void *dst, size_t bytes);
/* Sets every byte of [offset, offset + bytes) to value, on the runtime's own stream. */
KILN_API kiln_status kiln_buffer_fill(kiln_buffer *buf, size_t offset, uint8_t value, size_t bytes);

/* Bytes [start, end) of a buffer. */
typedef struct kiln_region {
    kiln_buffer *buffer;
    size_t start, end;
} kiln_region;

/* Checks a region: a buffer, start < end (not empty), end within the buffer.
 * KILN_ERR_RUNTIME_CONTRACT names the values. */
KILN_API kiln_status kiln_region_check(const kiln_region *region);
/* Whether two regions share a byte (same buffer, ranges intersect). */
KILN_API int kiln_region_overlaps(const kiln_region *a, const kiln_region *b);

/* ---- commands ---- */

typedef enum kiln_batching {
    KILN_BATCHING_SCALAR = 0,           /* one invocation */
    KILN_BATCHING_PARTICIPANT_LOOP = 1, /* one dispatch per participant */
    KILN_BATCHING_PACKED = 2            /* every participant's tokens in one dispatch */
} kiln_batching;

/* What an enqueue function gets: where to put its work. */
typedef struct kiln_launch_context kiln_launch_context;
/* The CUstream to enqueue on (capturing, when the command is replayed). */
KILN_API void *kiln_launch_stream(const kiln_launch_context *ctx);
/* The submitting stream's cuBLASLt handle (a cublasLtHandle_t). */
KILN_API void *kiln_launch_cublaslt(const kiln_launch_context *ctx);
/* The device address of the stream's fault record, for kernels that report bad data. */
KILN_API uint64_t kiln_launch_fault_record(const kiln_launch_context *ctx);
/* The retained host bytes of the command being enqueued (its own copy). */
KILN_API const void *kiln_launch_host_data(const kiln_launch_context *ctx, size_t *bytes);

typedef kiln_status (*kiln_enqueue_fn)(void *user, const kiln_launch_context *ctx);

#define KILN_OP_ID_MAX 64
#define KILN_REPLAY_KEY_MAX 1024

typedef struct kiln_command_desc {
    uint32_t size;              /* sizeof(kiln_command_desc) or 0; fields past it take their defaults */
    const char *op_id;          /* portable: [a-z0-9._]+, starting with a letter, < KILN_OP_ID_MAX */
    kiln_batching batching;
    uint32_t participants, tokens;
    uint32_t dispatches;        /* kernel launches it makes */
    uint32_t transfers;         /* copies it makes */
    const kiln_region *regions; /* retained: their buffers live as long as the command */
    size_t n_regions;
    const void *host_data;      /* copied, retained until the command is released */
    size_t host_bytes;
    kiln_enqueue_fn enqueue;    /* required */
    void *user;
    void (*user_free)(void *user); /* called when the command is freed; may be NULL */
    const void *replay_key;     /* optional, copied: the command can be replayed from a graph */
    size_t replay_key_bytes;    /* 0: not replayable; at most KILN_REPLAY_KEY_MAX */
} kiln_command_desc;

/* KILN_ERR_RUNTIME_CONTRACT names what is wrong (the op id, a region, a key,
 * a buffer of another runtime); KILN_ERR_INVALID_ARGUMENT for regions or host
 * data declared but NULL, and for a size inside the size field. */
KILN_API kiln_status kiln_command_create(kiln_runtime *rt, const kiln_command_desc *desc, kiln_command **out);
/* Transfers. copy: the element types of both buffers must match, the regions
 * be of one size and not overlap. upload: the host bytes are copied now and
 * retained until the command is released. zero: sets every byte to 0. */
KILN_API kiln_status kiln_command_copy(kiln_runtime *rt, const kiln_region *src, const kiln_region *dst,
                                       kiln_command **out);
KILN_API kiln_status kiln_command_upload(kiln_runtime *rt, const kiln_region *dst, const void *src, size_t bytes,
                                         kiln_command **out);
KILN_API kiln_status kiln_command_zero(kiln_runtime *rt, const kiln_region *dst, kiln_command **out);
/* Drops the caller's reference. NULL is a no-op. */
KILN_API void kiln_command_release(kiln_command *cmd);
KILN_API const char *kiln_command_op_id(const kiln_command *cmd);
KILN_API int kiln_command_replayable(const kiln_command *cmd);

/* ---- streams, submission, fences ---- */

typedef enum kiln_stream_state {
    KILN_STREAM_READY = 0,     /* nothing in flight */
    KILN_STREAM_RECORDING = 1, /* a submission is being enqueued */
    KILN_STREAM_SUBMITTED = 2, /* batches in flight */
    KILN_STREAM_FAILED = 3     /* an enqueue failed: synchronize before anything else */
} kiln_stream_state;

typedef enum kiln_compute_path {
    KILN_PATH_ADAPTIVE = 0,   /* replay what can be replayed, else eager */
    KILN_PATH_EAGER_ONLY = 1,
    KILN_PATH_REPLAYED_ONLY = 2, /* every command must be replayable */
    KILN_PATH_REPLAYED_WITH_EAGER_BOUNDARIES = 3 /* replayed, but for the declared eager commands */
} kiln_compute_path;

typedef enum kiln_timing {
    KILN_TIMING_OFF = 0,
    KILN_TIMING_COMPLETION = 1, /* device-measured elapsed time of the batch */
    KILN_TIMING_SPANS = 2       /* and one span per eager command or replayed segment */
} kiln_timing;

/* A write into a binding arena's slot, applied before the batch runs. */
typedef struct kiln_binding_patch {
    uint32_t slot;
    size_t offset;     /* within the slot */
    const void *data;  /* copied at submit */
    size_t bytes;
} kiln_binding_patch;

typedef struct kiln_submit_options {
    uint32_t size;               /* sizeof(kiln_submit_options) or 0; fields past it take their defaults */
    kiln_compute_path path;
    kiln_timing timing;
    const char *phase;           /* a label for attribution ("prefill", "decode"); NULL: "" */
    const uint32_t *eager_boundaries; /* strictly increasing command indices, for REPLAYED_WITH_EAGER_BOUNDARIES */
    size_t n_eager_boundaries;
    kiln_binding_arena *arena;   /* where patches go; may be NULL when there are none (checked when given) */
    const kiln_binding_patch *patches; /* sorted by (slot, offset), none overlapping */
    size_t n_patches;
} kiln_submit_options;

/* KILN_ERR_CUDA_* (no stream could be made). */
KILN_API kiln_status kiln_stream_create(kiln_runtime *rt, kiln_stream **out);
/* Synchronizes, releases what the stream holds, frees it. NULL is a no-op. */
KILN_API void kiln_stream_destroy(kiln_stream *stream);
/* The state, after noting batches that have completed. */
KILN_API kiln_stream_state kiln_stream_get_state(kiln_stream *stream);
/* The stream's cuBLASLt handle (a cublasLtHandle_t), created with the stream. */
KILN_API void *kiln_stream_cublaslt(const kiln_stream *stream);
/* The stream's CUstream, for interoperation. */
KILN_API void *kiln_stream_handle(const kiln_stream *stream);

/* Submits cmds[0..n) in order. Everything is checked before anything is
 * enqueued (the stream's state, each command's runtime, the compute path's
 * requirement, the patches): a batch refused there returns
 * KILN_ERR_RUNTIME_CONTRACT, is definitely not submitted and leaves the
 * stream as it was (KILN_ERR_INVALID_ARGUMENT for a NULL list, boundaries or
 * patch data, or a size inside the size field; opts may be NULL: every
 * default). A failure while enqueueing marks the stream Failed,
 * quarantines the batch and returns the failure. On success *fence (released
 * with kiln_fence_release) tracks the batch; fence may be NULL when the
 * caller does not want one. */
KILN_API kiln_status kiln_stream_submit(kiln_stream *stream, kiln_command *const *cmds, size_t n,
                                        const kiln_submit_options *opts, kiln_fence **fence);
/* Waits for everything submitted, releases the completed batches and the
 * quarantine, and returns the stream to Ready. Reports a device fault
 * (KILN_ERR_CUDA_*, the runtime broken for good) or the bad data a kernel
 * found (KILN_ERR_DEVICE_CONTRACT: op, index, value; the stream goes on). */
KILN_API kiln_status kiln_stream_synchronize(kiln_stream *stream);
/* Copies a region to host memory after everything the stream submitted. */
KILN_API kiln_status kiln_stream_readback(kiln_stream *stream, const kiln_region *src, void *dst);

/* ---- the graph executable cache (one per stream) ----
 *
 * A segment is a run of consecutive replayable commands in a submission; its
 * key is the commands' replay keys, in order. Under the adaptive path a
 * segment seen for the first time is captured (stream capture, thread-local
 * mode), instantiated and uploaded when the stream is quiescent (nothing
 * submitted earlier still running) and then launched; every later submission
 * with the same key launches the resident graph. A segment first seen while
 * the stream is busy runs eager and is "deferred" (captured at a later quiet
 * submission); one whose capture fails (an enqueue that cannot be captured)
 * is remembered as "rejected" and always runs eager. The replayed-only and
 * replayed-with-eager-boundaries paths never capture: each of their replayed
 * segments must be resident already, or the submission fails before anything
 * is enqueued (KILN_ERR_RUNTIME_CONTRACT naming the segment).
 * kiln_stream_prepare makes a batch's segments resident without running it,
 * busy stream or not. The runtime's own stream (kiln_runtime_stream, the one
 * the immediate kiln_op_* calls use) launches resident graphs but does not
 * capture under the adaptive path: its one-off commands would each cost a
 * capture.
 *
 * Values that change every step (token ids, positions, lengths, block tables)
 * belong in a binding arena, not in replay keys, so that one graph serves
 * every step of a batch bucket: pad the participants to
 * kiln_stream_batch_bucket's size and one executable covers every batch of
 * that bucket.
 *
 * Capacity: a count of resident graphs and an estimate of their device memory
 * (the drop in the device's free memory across instantiating and uploading
 * it, device-wide, at least KILN_GRAPH_NODE_BYTES per node); the least
 * recently launched go first, but never a graph the current submission (or
 * prepare) uses: a batch larger than the capacity keeps its graphs until the
 * next call. An evicted graph is destroyed once no pending batch uses it.
 * Unloading a module (a jit destroyed) waits for the device and drops every
 * graph captured before it.
 *
 * Spans: a replayed segment is one span. A segment whose capture is rejected
 * while its batch is being enqueued runs eager within that one span; later
 * batches, which know it is rejected, give each of its commands a span.
 * Statistics: "deferred" counts each distinct segment once per submission in
 * which it ran eager because the stream was busy; a capture that failed for a
 * reason that may pass (memory, an enqueue error of the command itself) runs
 * the segment eager without rejecting it. */

#define KILN_GRAPH_NODE_BYTES 1024u
#define KILN_MAX_BATCH_BUCKETS 32

typedef struct kiln_graph_options {
    uint32_t size;           /* sizeof(kiln_graph_options) or 0; fields past it take their defaults */
    size_t max_graphs;       /* resident executables; 0: 256 */
    size_t max_bytes;        /* their estimated device memory; 0: 1 GiB */
    const uint32_t *buckets; /* strictly increasing, > 0; NULL: 1, 2, 4, 8, 16, 32, 64 */
    size_t n_buckets;        /* at most KILN_MAX_BATCH_BUCKETS */
} kiln_graph_options;

typedef struct kiln_graph_stats {
    uint64_t captured;  /* segments captured and instantiated */
    uint64_t hits;      /* segment launches of a resident graph (a capture's own launch is not one) */
    uint64_t rejected;  /* captures that failed; the segment runs eager from then on */
    uint64_t deferred;  /* first sightings on a busy stream, run eager */
    uint64_t evicted;   /* graphs dropped for capacity, trim or an unloaded module */
    size_t resident;    /* graphs held now */
    size_t resident_bytes;
} kiln_graph_stats;

/* Sets the capacity and the batch buckets; evicts at once what no longer
 * fits. KILN_ERR_RUNTIME_CONTRACT for buckets not strictly increasing, a zero
 * bucket or too many of them; KILN_ERR_INVALID_ARGUMENT for NULL arguments or
 * a size inside the size field. */
KILN_API kiln_status kiln_stream_set_graph_options(kiln_stream *stream, const kiln_graph_options *opts);
KILN_API void kiln_stream_graph_stats(const kiln_stream *stream, kiln_graph_stats *out);
/* Evicts least recently used graphs until at most keep_graphs remain and
 * their bytes are at most keep_bytes; 0 is no limit on that count, and 0, 0
 * evicts every graph. Rejected segments are forgotten too (they will be tried
 * again). A graph a pending batch launched lives until that batch is done. */
KILN_API kiln_status kiln_stream_graph_trim(kiln_stream *stream, size_t keep_graphs, size_t keep_bytes);
/* The smallest batch bucket holding participants; KILN_ERR_RUNTIME_CONTRACT
 * naming the largest bucket when none does, or for 0 participants. */
KILN_API kiln_status kiln_stream_batch_bucket(const kiln_stream *stream, uint32_t participants, uint32_t *bucket);
/* Captures, instantiates and uploads every replayed segment of the batch
 * under opts->path (adaptive: every run of replayable commands) that is not
 * resident yet, running nothing. *captured (may be NULL) counts the new
 * graphs. A segment whose capture fails is rejected and reported as
 * KILN_ERR_RUNTIME_CONTRACT naming it (the adaptive path then runs it eager).
 * The stream may be busy; it must not be Recording or Failed. */
KILN_API kiln_status kiln_stream_prepare(kiln_stream *stream, kiln_command *const *cmds, size_t n,
                                         const kiln_submit_options *opts, size_t *captured);

typedef enum kiln_fence_state {
    KILN_FENCE_PENDING = 0,
    KILN_FENCE_SUCCEEDED = 1,
    KILN_FENCE_INDETERMINATE = 2 /* the device failed: whether the batch ran is unknown */
} kiln_fence_state;

typedef enum kiln_exec_path { KILN_EXEC_EAGER = 0, KILN_EXEC_REPLAYED = 1 } kiln_exec_path;

/* One row per command of the batch. Strings live as long as the fence. */
typedef struct kiln_attribution {
    uint32_t index;
    const char *phase;
    const char *op_id;
    kiln_exec_path path;
    kiln_batching batching;
    uint32_t participants, tokens, dispatches, transfers;
    int32_t span;   /* the span that timed it, or -1 */
} kiln_attribution;

/* A device-measured interval: commands [first, last], relative to the batch's start. */
typedef struct kiln_span {
    uint32_t first, last;
    kiln_exec_path path;
    double start_ms, duration_ms;
} kiln_span;

typedef struct kiln_receipt {
    kiln_fence_state state;
    kiln_timing timing;
    double elapsed_ms;  /* with timing on and the batch succeeded, else -1 */
    size_t n_commands;
    size_t n_spans;
} kiln_receipt;

/* Pending, succeeded or indeterminate, without waiting. */
KILN_API kiln_status kiln_fence_query(kiln_fence *fence, kiln_fence_state *state);
/* Waits for the batch; returns as kiln_stream_synchronize would for it. */
KILN_API kiln_status kiln_fence_wait(kiln_fence *fence);
/* The receipt; timings are filled once the batch has completed (wait first). */
KILN_API kiln_status kiln_fence_receipt(kiln_fence *fence, kiln_receipt *out);
KILN_API kiln_status kiln_fence_span(kiln_fence *fence, size_t index, kiln_span *out);
KILN_API kiln_status kiln_fence_attribution(const kiln_fence *fence, size_t index, kiln_attribution *out);
/* Drops the caller's reference: the batch stays alive until it completes. NULL is a no-op. */
KILN_API void kiln_fence_release(kiln_fence *fence);

/* ---- binding arenas ---- */

/* A slot of a compiled binding layout: bytes [offset, offset + bytes). */
typedef struct kiln_binding_slot {
    size_t offset, bytes;
} kiln_binding_slot;

/* A device arena for values that change every step (token ids, positions,
 * sequence lengths, block tables), laid out in slots that must be sorted,
 * non-empty, non-overlapping and cover [0, total_bytes) exactly. Patches
 * submitted with a batch land in a host mirror and go up in one coalesced
 * host-to-device copy before the batch. An arena is used by one thread at a
 * time (its mirror is written at submit), and its patches take effect in the
 * order of the stream they are submitted on. */
KILN_API kiln_status kiln_binding_arena_create(kiln_runtime *rt, const kiln_binding_slot *slots, size_t n_slots,
                                               size_t total_bytes, kiln_binding_arena **out);
KILN_API void kiln_binding_arena_destroy(kiln_binding_arena *arena);
/* The arena's buffer (borrowed): kernels read their bindings from it. */
KILN_API kiln_buffer *kiln_binding_arena_buffer(const kiln_binding_arena *arena);
/* The region of one slot. */
KILN_API kiln_status kiln_binding_arena_slot(const kiln_binding_arena *arena, uint32_t slot, kiln_region *out);
/* Host-to-device copies the arena has made (one per submission with patches). */
KILN_API uint64_t kiln_binding_arena_uploads(const kiln_binding_arena *arena);

#ifdef __cplusplus
}
#endif
#endif
