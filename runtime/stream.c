/* Streams: batched submission, replayed segments, fences, timing,
 * attribution, and the quarantine of batches that failed half-way. */
#include <cublasLt.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fault.h"
#include "runtime/internal.h"

static const kiln__fault clean_fault = {.first = UINT64_MAX};

kiln_status kiln__stream_init(kiln_runtime *rt, kiln_stream **out)
{
    *out = NULL;
    kiln_stream *s = calloc(1, sizeof *s);
    if (!s)
        return kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    s->rt = rt;
    s->state = KILN_STREAM_READY;
    s->refs = 1;
    kiln_status st;
    CUresult r;
    if ((st = kiln__graph_cache_create(rt, &s->graphs))) {
        free(s);
        return st;
    }
    if ((r = rt->d->cuStreamCreate(&s->handle, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
        s->handle = NULL;
        st = kiln__runtime_cu_fail(rt, r, "cuStreamCreate");
        goto out_free;
    }
    if ((r = rt->d->cuMemAlloc(&s->fault, sizeof(kiln__fault))) != CUDA_SUCCESS) {
        s->fault = 0;
        st = kiln__runtime_cu_fail(rt, r, "allocating the fault record");
        goto out_free;
    }
    if ((r = rt->d->cuMemcpyHtoD(s->fault, &clean_fault, sizeof clean_fault)) != CUDA_SUCCESS) {
        st = kiln__runtime_cu_fail(rt, r, "clearing the fault record");
        goto out_free;
    }
    const char *why = NULL;
    const kiln__blas *blas = kiln__blas_get(&why);
    if (!blas) {
        st = kiln__fail(&rt->err, KILN_ERR_CUDA_BLAS, "%s", why);
        goto out_free;
    }
    cublasLtHandle_t lt = NULL;
    cublasStatus_t bs = blas->cublasLtCreate(&lt);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        st = kiln__fail(&rt->err, KILN_ERR_CUDA_BLAS, "cublasLtCreate: status %d", (int)bs);
        goto out_free;
    }
    s->cublaslt = lt;
    *out = s;
    return KILN_OK;
out_free:
    kiln_stream_destroy(s);
    return st;
}

kiln_status kiln_stream_create(kiln_runtime *rt, kiln_stream **out)
{
    if (!rt || !out)
        return kiln__fail(rt ? &rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_stream_create: NULL argument");
    kiln_status st = kiln__runtime_enter(rt);
    return st ? st : kiln__stream_init(rt, out);
}

void *kiln_stream_cublaslt(const kiln_stream *s) { return s ? s->cublaslt : NULL; }
void *kiln_stream_handle(const kiln_stream *s) { return s ? (void *)s->handle : NULL; }

/* ---- the state machine ---- */

const char *kiln__stream_state_name(kiln_stream_state s)
{
    switch (s) {
    case KILN_STREAM_READY: return "Ready";
    case KILN_STREAM_RECORDING: return "Recording";
    case KILN_STREAM_SUBMITTED: return "Submitted";
    case KILN_STREAM_FAILED: return "Failed";
    }
    return "unknown";
}

kiln_status kiln__stream_next(kiln__errslot *err, kiln_stream_state from, kiln__stream_event ev,
                              kiln_stream_state *to)
{
    kiln_stream_state next = from;
    const char *why = NULL;
    switch (ev) {
    case KILN__EV_BEGIN:
        if (from == KILN_STREAM_READY || from == KILN_STREAM_SUBMITTED)
            next = KILN_STREAM_RECORDING;
        else if (from == KILN_STREAM_RECORDING)
            why = "it is already Recording a batch";
        else if (from == KILN_STREAM_FAILED)
            why = "it is Failed: kiln_stream_synchronize it first";
        else
            why = "unknown state";
        break;
    case KILN__EV_ENQUEUED:
    case KILN__EV_ENQUEUE_FAILED:
        if (from == KILN_STREAM_RECORDING)
            next = ev == KILN__EV_ENQUEUED ? KILN_STREAM_SUBMITTED : KILN_STREAM_FAILED;
        else
            why = "no batch is being recorded";
        break;
    case KILN__EV_DRAINED:
        if (from == KILN_STREAM_SUBMITTED)
            next = KILN_STREAM_READY;
        break;
    case KILN__EV_SYNCED:
        if (from == KILN_STREAM_RECORDING)
            why = "it is Recording a batch";
        else if ((unsigned)from > KILN_STREAM_FAILED)
            why = "unknown state";
        else
            next = KILN_STREAM_READY;
        break;
    case KILN__EV_DEVICE_FAILED:
        next = KILN_STREAM_FAILED;
        break;
    default:
        why = "unknown event";
    }
    if (why)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "stream in state %s: %s", kiln__stream_state_name(from),
                          why);
    *to = next;
    return KILN_OK;
}

/* Applies a move the code knows to be allowed. */
static void move(kiln_stream *s, kiln__stream_event ev)
{
    kiln_stream_state to;
    if (kiln__stream_next(NULL, s->state, ev, &to) == KILN_OK)
        s->state = to;
}

/* ---- batches (fences) ---- */

/* ---- events: reused once their batch is freed ---- */

#define MAX_IDLE_EVENTS 256

static kiln_status event_get(kiln_stream *s, int timed, CUevent *ev)
{
    if (s->n_idle_events[timed]) {
        *ev = s->idle_events[timed][--s->n_idle_events[timed]];
        return KILN_OK;
    }
    CUresult r = s->rt->d->cuEventCreate(ev, timed ? CU_EVENT_DEFAULT : CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS) {
        *ev = NULL;
        return kiln__runtime_cu_fail(s->rt, r, "cuEventCreate");
    }
    return KILN_OK;
}

/* Keeps ev for reuse, or destroys it (a failed device, a destroyed stream, a full pool). */
static void event_put(kiln_stream *s, int timed, CUevent ev, int reusable)
{
    if (!ev)
        return;
    if (reusable && !s->destroyed && s->n_idle_events[timed] < MAX_IDLE_EVENTS) {
        if (!s->idle_events[timed] &&
            !(s->idle_events[timed] = malloc(MAX_IDLE_EVENTS * sizeof *s->idle_events[timed])))
            goto destroy;
        s->idle_events[timed][s->n_idle_events[timed]++] = ev;
        return;
    }
destroy:
    if (kiln__runtime_usable(s->rt))
        s->rt->d->cuEventDestroy(ev);
}

static void stream_unref(kiln_stream *s)
{
    if (--s->refs > 0)
        return;
    free(s->idle_events[0]);
    free(s->idle_events[1]);
    free(s);
}

static void batch_free(kiln_fence *b)
{
    kiln_stream *s = b->stream;
    for (size_t i = 0; i < b->n; i++)
        kiln_command_release(b->cmds[i]);
    for (size_t i = 0; i < b->n_graphs; i++)
        kiln__graph_unref(b->graphs[i]);
    /* An event of a batch that completed can be recorded again. */
    int reusable = b->state == KILN_FENCE_SUCCEEDED;
    event_put(s, b->timing != KILN_TIMING_OFF, b->done, reusable);
    event_put(s, 1, b->start, reusable);
    for (size_t i = 0; b->span_events && i < 2 * b->n_spans; i++)
        event_put(s, 1, b->span_events[i], reusable);
    free(b->span_events);
    free(b->spans);
    free(b->plans);
    free(b->rows);
    free(b->graphs);
    free(b->cmds);
    free(b->phase);
    free(b);
    stream_unref(s);
}

static void batch_unref(kiln_fence *b)
{
    if (b && --b->refs == 0)
        batch_free(b);
}

/* Notes batches that have completed, oldest first, dropping the stream's
 * reference to each; a failed query marks the batch indeterminate. */
static void reap(kiln_stream *s)
{
    while (s->pending) {
        kiln_fence *b = s->pending;
        CUresult r = s->rt->d->cuEventQuery(b->done);
        if (r == CUDA_ERROR_NOT_READY)
            break;
        if (r == CUDA_SUCCESS) {
            b->state = KILN_FENCE_SUCCEEDED;
        } else {
            kiln__runtime_cu_fail(s->rt, r, "a submitted batch");
            /* Whatever is still pending is as unknown as this one. */
            for (kiln_fence *p = s->pending; p; p = p->next)
                p->state = KILN_FENCE_INDETERMINATE;
            move(s, KILN__EV_DEVICE_FAILED);
            return;
        }
        s->pending = b->next;
        b->next = NULL;
        batch_unref(b);
    }
    if (!s->pending)
        move(s, KILN__EV_DRAINED);
}

kiln_stream_state kiln_stream_get_state(kiln_stream *s)
{
    if (!s)
        return KILN_STREAM_FAILED;
    if (s->state == KILN_STREAM_SUBMITTED && kiln__runtime_usable(s->rt))
        reap(s);
    return s->state;
}

/* The message of each fault code the kernels report: printf formats of
 * (index, value, limit) as unsigned, unsigned, unsigned long long; a format
 * may leave the later ones out. */
static const struct {
    uint32_t code;
    const char *format;
} fault_texts[] = {
    {KILN__FAULT_TOKEN_ID, "token_embedding: ids[%u] = %u is at or past the vocabulary size %llu (lowest bad index); "
                           "its output row was zeroed"},
    {KILN__FAULT_EMPTY_SPAN,
     "last_token_linear: participant %u has an empty span (lowest such participant); its row was zeroed"},
    {KILN__FAULT_SPAN_PAST_END, "last_token_linear: participant %u's span ends at row %u, past the %llu rows it may "
                                "read (lowest such participant); its row was zeroed"},
    {KILN__FAULT_KV_SPAN, "paged_attention: sequence %u's query span ends at token %u, past the %llu tokens of q "
                          "(lowest bad sequence); the sequence was skipped"},
    {KILN__FAULT_KV_QUERY_COUNT, "paged_attention: sequence %u has %u new tokens, more than its limit %llu (its "
                                 "seq_len, or max_query_tokens) (lowest bad sequence); the sequence was skipped"},
    {KILN__FAULT_KV_SEQ_PAST_TABLE, "paged_attention: sequence %u has seq_len %u, longer than its block table holds "
                                    "(%llu tokens) (lowest bad sequence); the sequence was skipped"},
    {KILN__FAULT_GATED_DELTA_SPAN, "gated_delta: sequence %u's span ends at token %u, past the %llu tokens of the "
                                   "batch (lowest bad sequence); nothing of that sequence was touched"},
};

kiln_status kiln__stream_check_fault(kiln_stream *s)
{
    kiln__fault f;
    const kiln__driver *d = s->rt->d;
    CUresult r = d->cuMemcpyDtoH(&f, s->fault, sizeof f);
    if (r != CUDA_SUCCESS)
        return kiln__runtime_cu_fail(s->rt, r, "reading the fault record");
    if (!f.code)
        return KILN_OK;
    if ((r = d->cuMemcpyHtoD(s->fault, &clean_fault, sizeof clean_fault)) != CUDA_SUCCESS)
        return kiln__runtime_cu_fail(s->rt, r, "clearing the fault record");
    const uint32_t index = (uint32_t)(f.first >> 32), value = (uint32_t)f.first;
    if (f.code == KILN__FAULT_KV_BLOCK_PAST_ARENA) /* limit = block << 32 | pages */
        return kiln__fail(&s->rt->err, KILN_ERR_DEVICE_CONTRACT,
                          "paged_attention: sequence %u's block table entry %llu is page %u, past the %llu pages of "
                          "kv_pages (lowest bad sequence); the sequence was skipped",
                          index, (unsigned long long)(f.limit >> 32), value,
                          (unsigned long long)(f.limit & 0xffffffffu));
    for (size_t i = 0; i < sizeof fault_texts / sizeof fault_texts[0]; i++)
        if (fault_texts[i].code == f.code)
            return kiln__fail(&s->rt->err, KILN_ERR_DEVICE_CONTRACT, fault_texts[i].format, index, value,
                              (unsigned long long)f.limit);
    return kiln__fail(&s->rt->err, KILN_ERR_DEVICE_CONTRACT, "a kernel reported fault code %u (index %u, value %u)",
                      f.code, index, value);
}

kiln_status kiln_stream_synchronize(kiln_stream *s)
{
    if (!s)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_stream_synchronize: stream is NULL");
    kiln_status st = kiln__runtime_enter(s->rt);
    if (!st) {
        CUresult r = s->rt->d->cuStreamSynchronize(s->handle);
        if (r != CUDA_SUCCESS)
            st = kiln__runtime_cu_fail(s->rt, r, "cuStreamSynchronize");
    }
    int device_ok = !st;
    if (device_ok)
        reap(s);
    /* The GPU is done with the quarantine (or can touch nothing any more). */
    while (s->quarantine) {
        kiln_fence *b = s->quarantine;
        s->quarantine = b->next;
        b->next = NULL;
        batch_unref(b);
    }
    if (!device_ok) {
        while (s->pending) {
            kiln_fence *b = s->pending;
            b->state = KILN_FENCE_INDETERMINATE;
            s->pending = b->next;
            b->next = NULL;
            batch_unref(b);
        }
        move(s, KILN__EV_DEVICE_FAILED);
        return st;
    }
    move(s, KILN__EV_SYNCED);
    return kiln__stream_check_fault(s);
}

void kiln_stream_destroy(kiln_stream *s)
{
    if (!s)
        return;
    kiln_runtime *rt = s->rt;
    /* Batches the device finished are succeeded for fences the caller still holds. */
    if (kiln__runtime_usable(rt) && s->handle && rt->d->cuStreamSynchronize(s->handle) == CUDA_SUCCESS)
        reap(s);
    kiln_fence *lists[2] = {s->pending, s->quarantine};
    for (int l = 0; l < 2; l++) {
        while (lists[l]) {
            kiln_fence *b = lists[l];
            lists[l] = b->next;
            b->next = NULL;
            if (b->state == KILN_FENCE_PENDING)
                b->state = KILN_FENCE_INDETERMINATE;
            batch_unref(b);
        }
    }
    kiln__graph_cache_destroy(s->graphs);
    s->graphs = NULL;
    int usable = kiln__runtime_usable(rt);
    for (int t = 0; t < 2; t++) {
        for (size_t i = 0; usable && i < s->n_idle_events[t]; i++)
            rt->d->cuEventDestroy(s->idle_events[t][i]);
        s->n_idle_events[t] = 0;
    }
    if (s->cublaslt)
        kiln__blas_get(NULL)->cublasLtDestroy((cublasLtHandle_t)s->cublaslt);
    if (s->fault)
        rt->d->cuMemFree(s->fault);
    if (s->handle)
        rt->d->cuStreamDestroy(s->handle);
    s->cublaslt = NULL;
    s->fault = 0;
    s->handle = NULL;
    /* Fences the caller still holds keep the struct (not the CUDA objects). */
    s->destroyed = 1;
    stream_unref(s);
}

kiln_status kiln_stream_readback(kiln_stream *s, const kiln_region *src, void *dst)
{
    if (!s || !src || !dst)
        return kiln__fail(s ? &s->rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_stream_readback: NULL argument");
    kiln_status st = kiln_region_check(src);
    if (st)
        return kiln__fail(&s->rt->err, st, "readback: %s", kiln_errmsg());
    if (src->buffer->rt != s->rt)
        return kiln__fail(&s->rt->err, KILN_ERR_RUNTIME_CONTRACT, "readback: the region is of another runtime");
    if ((st = kiln__runtime_enter(s->rt)))
        return st;
    const kiln__driver *d = s->rt->d;
    CUresult r = d->cuStreamSynchronize(s->handle);
    if (r == CUDA_SUCCESS)
        r = d->cuMemcpyDtoH(dst, src->buffer->ptr + src->start, src->end - src->start);
    return r == CUDA_SUCCESS ? KILN_OK : kiln__runtime_cu_fail(s->rt, r, "readback");
}

/* ---- submission ---- */

static int is_boundary(const kiln_submit_options *o, uint32_t i)
{
    for (size_t k = 0; k < o->n_eager_boundaries; k++)
        if (o->eager_boundaries[k] == i)
            return 1;
    return 0;
}

/* Whether the path requires command i replayed (after validation). */
static int replayed(const kiln_submit_options *o, uint32_t i)
{
    switch (o->path) {
    case KILN_PATH_REPLAYED_ONLY:
        return 1;
    case KILN_PATH_REPLAYED_WITH_EAGER_BOUNDARIES:
        return !is_boundary(o, i);
    default:
        /* Adaptive requires nothing: candidate() says what it may replay. */
        return 0;
    }
}

/* Everything that can be known before enqueueing anything. */
kiln_status kiln__submit_validate(kiln_stream *s, kiln_command *const *cmds, size_t n, const kiln_submit_options *o)
{
    kiln__errslot *err = &s->rt->err;
    kiln_stream_state next;
    if (kiln__stream_next(NULL, s->state, KILN__EV_BEGIN, &next))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "submit: %s", kiln_errmsg());
    if (!cmds)
        return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, "submit: the command list is NULL (n = %zu)", n);
    if (n == 0 || n > UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "submit: a batch needs 1 to 2^32-1 commands, got %zu", n);
    if ((unsigned)o->path > KILN_PATH_REPLAYED_WITH_EAGER_BOUNDARIES || (unsigned)o->timing > KILN_TIMING_SPANS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "submit: unknown compute path %d or timing mode %d",
                          (int)o->path, (int)o->timing);
    for (size_t i = 0; i < n; i++) {
        if (!cmds[i])
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "submit: command %zu is NULL", i);
        if (cmds[i]->rt != s->rt)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "submit: command %zu (%s) belongs to runtime instance %llu, the stream to %llu", i,
                              cmds[i]->op_id, (unsigned long long)cmds[i]->rt->info.instance_id,
                              (unsigned long long)s->rt->info.instance_id);
    }
    if (o->n_eager_boundaries && !o->eager_boundaries)
        return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, "submit: eager boundaries missing");
    if (o->path != KILN_PATH_REPLAYED_WITH_EAGER_BOUNDARIES && o->n_eager_boundaries)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "submit: eager boundaries are declared for the replayed-with-eager-boundaries path only");
    for (size_t k = 0; k < o->n_eager_boundaries; k++)
        if (o->eager_boundaries[k] >= n || (k && o->eager_boundaries[k] <= o->eager_boundaries[k - 1]))
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "submit: eager boundary %zu is %u; boundaries are increasing indices below %zu", k,
                              o->eager_boundaries[k], n);
    for (uint32_t i = 0; i < n; i++) {
        if (replayed(o, i) && !cmds[i]->replay_key_bytes)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "submit: command %u (%s) has no replay key, and the %s path %s", i, cmds[i]->op_id,
                              o->path == KILN_PATH_REPLAYED_ONLY ? "replayed-only" : "replayed-with-eager-boundaries",
                              o->path == KILN_PATH_REPLAYED_ONLY ? "replays every command"
                                                                 : "does not declare it an eager boundary");
    }
    if (o->n_patches || o->arena) {
        kiln_status st = kiln__binding_validate(o->arena, s->rt, o->patches, o->n_patches);
        if (st)
            return st;
    }
    return KILN_OK;
}

/* ---- segments and the graph cache ---- */

/* What a replayed span does. */
struct kiln__span_plan {
    kiln__graph *graph; /* resident when planned (the batch holds a reference), or NULL: capture */
    uint64_t hash;
    int deferred;       /* an eager command of a segment deferred on a busy stream */
};

/* Whether command i may be part of a replayed segment under the path. */
static int candidate(const kiln_submit_options *o, kiln_command *const *cmds, uint32_t i)
{
    return o->path == KILN_PATH_ADAPTIVE ? cmds[i]->replay_key_bytes > 0 : replayed(o, i);
}

/* The end of the segment starting at first (first is a candidate). */
static uint32_t segment_end(const kiln_submit_options *o, kiln_command *const *cmds, uint32_t n, uint32_t first)
{
    uint32_t last = first;
    while (last + 1 < n && candidate(o, cmds, last + 1))
        last++;
    return last;
}

static kiln_launch_context launch_context(const kiln_stream *s, const kiln_command *cmd)
{
    return (kiln_launch_context){s->handle, s->fault, cmd, s->cublaslt};
}

static void describe_segment(char *buf, size_t cap, kiln_command *const *cmds, uint32_t first, uint32_t last)
{
    if (first == last)
        snprintf(buf, cap, "command %u (%s)", first, cmds[first]->op_id);
    else
        snprintf(buf, cap, "commands %u (%s) to %u (%s)", first, cmds[first]->op_id, last, cmds[last]->op_id);
}

/* How a capture ended. */
typedef enum capture_outcome {
    CAPTURED,   /* resident now, *out holds it */
    REJECTED,   /* the capture itself failed (an enqueue capture cannot hold, an
                 * instantiation the driver refuses): remembered, runs eager */
    NOT_NOW,    /* a failure that may pass (memory, the command's own enqueue
                 * error): not remembered; the caller may run the segment eager */
    FAILED      /* the runtime failed: the error goes up */
} capture_outcome;

/* Captures commands [first, last] into an executable, instantiates and
 * uploads it and takes it into the cache. The status carries the message of
 * anything but CAPTURED. */
static kiln_status capture(kiln_stream *s, kiln_command *const *cmds, uint32_t first, uint32_t last, uint64_t hash,
                           kiln__graph **out, capture_outcome *how)
{
    kiln_runtime *rt = s->rt;
    const kiln__driver *d = rt->d;
    *out = NULL;
    *how = FAILED;
    char what[2 * KILN_OP_ID_MAX + 64];
    describe_segment(what, sizeof what, cmds, first, last);
    CUresult r = d->cuStreamBeginCapture(s->handle, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    if (r != CUDA_SUCCESS)
        return kiln__runtime_cu_fail(rt, r, "cuStreamBeginCapture");
    kiln_status st = KILN_OK;
    uint32_t failed = first;
    for (uint32_t i = first; i <= last && !st; i++) {
        kiln_launch_context ctx = launch_context(s, cmds[i]);
        st = cmds[i]->enqueue(cmds[i]->user, &ctx);
        failed = i;
    }
    CUgraph graph = NULL;
    CUresult end = d->cuStreamEndCapture(s->handle, &graph);
    if (atomic_load(&rt->broken)) {
        if (graph)
            d->cuGraphDestroy(graph);
        return kiln__runtime_enter(rt);
    }
    if (end != CUDA_SUCCESS || st) {
        if (graph)
            d->cuGraphDestroy(graph);
        if (end == CUDA_SUCCESS) {
            /* The capture held: the command failed on its own account. */
            *how = NOT_NOW;
            return kiln__fail(&rt->err, st, "graph capture of %s: command %u (%s) failed to enqueue: %s", what,
                              failed, cmds[failed]->op_id, kiln_errmsg());
        }
        *how = REJECTED;
        kiln__graph_reject(s->graphs, cmds, first, last, hash);
        if (st)
            return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT,
                              "graph capture of %s failed at command %u (%s): %s; the segment runs eager", what,
                              failed, cmds[failed]->op_id, kiln_errmsg());
        kiln__cuda_fail(&rt->err, end, "cuStreamEndCapture");
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "graph capture of %s: %s; the segment runs eager",
                          what, kiln_errmsg());
    }
    size_t nodes = 0, free0 = 0, free1 = 0, total = 0;
    CUgraphExec exec = NULL;
    d->cuGraphGetNodes(graph, NULL, &nodes);
    d->cuMemGetInfo(&free0, &total);
    r = d->cuGraphInstantiateWithFlags(&exec, graph, 0);
    d->cuGraphDestroy(graph);
    if (r != CUDA_SUCCESS) {
        *how = r == CUDA_ERROR_OUT_OF_MEMORY ? NOT_NOW : REJECTED;
        if (*how == REJECTED)
            kiln__graph_reject(s->graphs, cmds, first, last, hash);
        kiln__cuda_fail(&rt->err, r, "cuGraphInstantiate");
        return kiln__fail(&rt->err, *how == REJECTED ? KILN_ERR_RUNTIME_CONTRACT : KILN_ERR_CUDA_OUT_OF_MEMORY,
                          "graph capture of %s: %s; the segment runs eager", what, kiln_errmsg());
    }
    if ((r = d->cuGraphUpload(exec, s->handle)) != CUDA_SUCCESS) {
        d->cuGraphExecDestroy(exec);
        st = kiln__runtime_cu_fail(rt, r, "cuGraphUpload");
        *how = atomic_load(&rt->broken) ? FAILED : NOT_NOW;
        return st;
    }
    d->cuMemGetInfo(&free1, &total);
    size_t bytes = free0 > free1 ? free0 - free1 : 0;
    if (bytes < nodes * KILN_GRAPH_NODE_BYTES)
        bytes = nodes * KILN_GRAPH_NODE_BYTES;
    if ((st = kiln__graph_insert(s->graphs, cmds, first, last, hash, exec, bytes, out))) {
        d->cuGraphExecDestroy(exec);
        *how = NOT_NOW;
        return st;
    }
    *how = CAPTURED;
    return KILN_OK;
}

/* Decides what each replayable segment does before anything is enqueued:
 * launch a resident graph, capture it, or run eager (rejected earlier, or
 * deferred on a busy stream). Fills b->spans, b->plans and b->rows. The
 * replayed paths require every segment resident. */
static kiln_status plan(kiln_stream *s, kiln_fence *b, kiln_command *const *cmds, const kiln_submit_options *o)
{
    kiln_runtime *rt = s->rt;
    b->spans = calloc(b->n, sizeof *b->spans);
    b->plans = calloc(b->n, sizeof *b->plans);
    b->rows = calloc(b->n, sizeof *b->rows);
    b->graphs = calloc(b->n, sizeof *b->graphs);
    if (!b->spans || !b->plans || !b->rows || !b->graphs)
        return kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a batch of %zu", b->n);
    int quiescent = s->pending == NULL, captures = kiln__graph_cache_captures(s->graphs);
    uint32_t n = (uint32_t)b->n, deferred = 0;
    kiln__graph_cache_begin_call(s->graphs);
    for (uint32_t i = 0; i < n;) {
        uint32_t last = i;
        kiln_exec_path path = KILN_EXEC_EAGER;
        struct kiln__span_plan pl = {0};
        if (o->path != KILN_PATH_EAGER_ONLY && candidate(o, cmds, i)) {
            last = segment_end(o, cmds, n, i);
            pl.hash = kiln__segment_hash(cmds, i, last);
            int rejected = 0;
            pl.graph = kiln__graph_find(s->graphs, cmds, i, last, pl.hash, &rejected);
            if (pl.graph) {
                kiln__graph_ref(pl.graph);
                kiln__graph_use(s->graphs, pl.graph);
                b->graphs[b->n_graphs++] = pl.graph;
                path = KILN_EXEC_REPLAYED;
            } else if (o->path != KILN_PATH_ADAPTIVE) {
                char what[2 * KILN_OP_ID_MAX + 64];
                describe_segment(what, sizeof what, cmds, i, last);
                return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT,
                                  "submit: the segment of %s is not resident in the stream's graph cache%s; the %s "
                                  "path launches resident graphs only (make it resident with kiln_stream_prepare "
                                  "or an adaptive submission)",
                                  what, rejected ? " (its capture was rejected)" : "",
                                  o->path == KILN_PATH_REPLAYED_ONLY ? "replayed-only"
                                                                     : "replayed-with-eager-boundaries");
            } else if (!rejected && quiescent && captures) {
                path = KILN_EXEC_REPLAYED; /* captured at run */
            } else if (!rejected && captures) {
                /* The whole segment runs eager, one span per command; counted once per distinct segment. */
                pl.deferred = 1;
                int seen = 0;
                for (size_t k = 0; k < b->n_spans && !seen; k++)
                    seen = b->plans[k].deferred && b->plans[k].hash == pl.hash;
                deferred += !seen;
            }
        }
        /* A replayed segment is one span; eager commands are a span each. */
        for (uint32_t j = i; j <= last; j++) {
            if (path == KILN_EXEC_REPLAYED ? j == i : 1) {
                b->plans[b->n_spans] = pl;
                b->spans[b->n_spans++] = (kiln_span){.first = j, .last = path == KILN_EXEC_REPLAYED ? last : j,
                                                     .path = path, .start_ms = -1, .duration_ms = -1};
            }
            const kiln_command *c = cmds[j];
            b->rows[j] = (kiln_attribution){.index = j, .phase = b->phase, .op_id = c->op_id, .path = path,
                                            .batching = c->batching, .participants = c->participants,
                                            .tokens = c->tokens, .dispatches = c->dispatches,
                                            .transfers = c->transfers,
                                            .span = o->timing == KILN_TIMING_SPANS ? (int32_t)(b->n_spans - 1)
                                                                                    : -1};
        }
        i = last + 1;
    }
    b->n_deferred = deferred; /* counted once the batch is enqueued */
    return KILN_OK;
}

static kiln_status record(kiln_runtime *rt, CUevent ev, CUstream stream)
{
    CUresult r = rt->d->cuEventRecord(ev, stream);
    return r == CUDA_SUCCESS ? KILN_OK : kiln__runtime_cu_fail(rt, r, "cuEventRecord");
}

static kiln_status run_eager(kiln_stream *s, kiln_fence *b, uint32_t first, uint32_t last)
{
    kiln_status st = KILN_OK;
    for (uint32_t i = first; i <= last && !st; i++) {
        kiln_launch_context ctx = launch_context(s, b->cmds[i]);
        st = b->cmds[i]->enqueue(b->cmds[i]->user, &ctx);
        if (st && !kiln_errmsg()[0])
            kiln__fail(&s->rt->err, st, "command %u (%s) failed to enqueue", i, b->cmds[i]->op_id);
        else if (st)
            kiln__fail(&s->rt->err, st, "command %u (%s): %s", i, b->cmds[i]->op_id, kiln_errmsg());
    }
    return st;
}

/* Launches span k's graph, capturing it first when the plan says so; a
 * rejected capture runs the span eager and says so in its rows. */
static kiln_status run_replayed(kiln_stream *s, kiln_fence *b, size_t k)
{
    kiln_runtime *rt = s->rt;
    kiln_span *sp = &b->spans[k];
    kiln__graph *g = b->plans[k].graph;
    if (g) {
        kiln__graph_hit(s->graphs, g);
    } else {
        int rejected = 0;
        /* The same segment may have been captured earlier in this batch. */
        g = kiln__graph_find(s->graphs, b->cmds, sp->first, sp->last, b->plans[k].hash, &rejected);
        if (g) {
            kiln__graph_hit(s->graphs, g);
        } else if (!rejected) {
            capture_outcome how;
            kiln_status st = capture(s, b->cmds, sp->first, sp->last, b->plans[k].hash, &g, &how);
            if (how == FAILED)
                return st;
        }
        if (!g) {
            /* Handled: the segment runs eager. Its message must not pass for a later failure's. */
            kiln__errmsg_clear();
            sp->path = KILN_EXEC_EAGER;
            for (uint32_t i = sp->first; i <= sp->last; i++)
                b->rows[i].path = KILN_EXEC_EAGER;
            return run_eager(s, b, sp->first, sp->last);
        }
        kiln__graph_ref(g);
        b->graphs[b->n_graphs++] = g;
    }
    CUresult r = rt->d->cuGraphLaunch(kiln__graph_exec(g), s->handle);
    return r == CUDA_SUCCESS ? KILN_OK : kiln__runtime_cu_fail(rt, r, "cuGraphLaunch");
}

static kiln_status run(kiln_stream *s, kiln_fence *b)
{
    kiln_runtime *rt = s->rt;
    kiln_status st = KILN_OK;
    int spans = b->timing == KILN_TIMING_SPANS;
    if (b->timing != KILN_TIMING_OFF && (st = record(rt, b->start, s->handle)))
        return st;
    for (size_t k = 0; k < b->n_spans && !st; k++) {
        const kiln_span *sp = &b->spans[k];
        if (spans && (st = record(rt, b->span_events[2 * k], s->handle)))
            break;
        if (sp->path == KILN_EXEC_REPLAYED)
            st = run_replayed(s, b, k);
        else
            st = run_eager(s, b, sp->first, sp->last);
        if (!st && spans)
            st = record(rt, b->span_events[2 * k + 1], s->handle);
    }
    if (!st)
        st = record(rt, b->done, s->handle);
    return st;
}

/* What submit and prepare check first: the stream, the runtime, the batch. */
static kiln_status submit_begin(kiln_stream *s, kiln_command *const *cmds, size_t n, const kiln_submit_options *opts,
                                const char *fn)
{
    if (!s)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "%s: stream is NULL", fn);
    kiln_status st = kiln__runtime_enter(s->rt);
    if (st)
        return st;
    if (s->state == KILN_STREAM_SUBMITTED)
        reap(s);
    return kiln__submit_validate(s, cmds, n, opts);
}

static const kiln_submit_options default_submit;

kiln_status kiln_stream_submit(kiln_stream *s, kiln_command *const *cmds, size_t n, const kiln_submit_options *opts,
                               kiln_fence **fence)
{
    if (fence)
        *fence = NULL;
    if (!opts)
        opts = &default_submit;
    kiln_status st = submit_begin(s, cmds, n, opts, "kiln_stream_submit");
    if (st)
        return st;
    kiln_runtime *rt = s->rt;

    kiln_fence *b = calloc(1, sizeof *b);
    if (!b)
        return kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    b->stream = s;
    s->refs++;
    b->refs = 1;
    b->timing = opts->timing;
    b->state = KILN_FENCE_PENDING;
    b->phase = kiln__strdup(opts->phase ? opts->phase : "");
    b->cmds = malloc(n * sizeof *b->cmds);
    if (!b->phase || !b->cmds) {
        st = kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a batch of %zu", n);
        goto out_unwind;
    }
    for (size_t i = 0; i < n; i++) {
        b->cmds[i] = cmds[i];
        kiln__command_retain(cmds[i]);
    }
    b->n = n;
    if ((st = plan(s, b, cmds, opts)))
        goto out_unwind;
    int timed = opts->timing != KILN_TIMING_OFF;
    /* done is timed only when the batch is: a timed event costs more to record. */
    if ((st = event_get(s, timed, &b->done)) || (timed && (st = event_get(s, 1, &b->start))))
        goto out_unwind;
    if (opts->timing == KILN_TIMING_SPANS) {
        b->span_events = calloc(2 * b->n_spans, sizeof *b->span_events);
        if (!b->span_events) {
            st = kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
            goto out_unwind;
        }
        for (size_t i = 0; i < 2 * b->n_spans && !st; i++)
            st = event_get(s, 1, &b->span_events[i]);
        if (st)
            goto out_unwind;
    }

    /* Nothing has been enqueued yet: failures above leave the stream as it was. */
    move(s, KILN__EV_BEGIN);
    if (opts->n_patches)
        st = kiln__binding_apply(opts->arena, opts->patches, opts->n_patches, s->handle);
    if (!st)
        st = run(s, b);
    if (st) {
        /* Half-enqueued: the GPU may run part of it. Keep it all until synchronize. */
        kiln__propagate(&rt->err, st);
        move(s, KILN__EV_ENQUEUE_FAILED);
        b->state = KILN_FENCE_INDETERMINATE;
        b->next = s->quarantine;
        s->quarantine = b;
        return st;
    }
    move(s, KILN__EV_ENQUEUED);
    kiln__graph_deferred(s->graphs, b->n_deferred);
    kiln_fence **tail = &s->pending;
    while (*tail)
        tail = &(*tail)->next;
    *tail = b;
    if (fence) {
        b->refs++;
        *fence = b;
    }
    return KILN_OK;
out_unwind:
    /* Events taken from the pool go back unused. */
    b->state = KILN_FENCE_SUCCEEDED;
    batch_free(b);
    return st;
}

kiln_status kiln_stream_prepare(kiln_stream *s, kiln_command *const *cmds, size_t n, const kiln_submit_options *opts,
                                size_t *captured)
{
    if (captured)
        *captured = 0;
    if (!opts)
        opts = &default_submit;
    kiln_status st = submit_begin(s, cmds, n, opts, "kiln_stream_prepare");
    if (st)
        return st;
    kiln_runtime *rt = s->rt;
    if (opts->path == KILN_PATH_EAGER_ONLY)
        return KILN_OK;
    kiln_status first_failure = KILN_OK;
    kiln__graph_cache_begin_call(s->graphs);
    for (uint32_t i = 0; i < (uint32_t)n; i++) {
        if (!candidate(opts, cmds, i))
            continue;
        uint32_t last = segment_end(opts, cmds, (uint32_t)n, i);
        uint64_t hash = kiln__segment_hash(cmds, i, last);
        int rejected = 0;
        kiln__graph *g = kiln__graph_find(s->graphs, cmds, i, last, hash, &rejected);
        if (g) {
            kiln__graph_use(s->graphs, g);
        } else if (!rejected) {
            capture_outcome how;
            st = capture(s, cmds, i, last, hash, &g, &how);
            if (how == FAILED)
                return st;
            if (how == CAPTURED && captured)
                (*captured)++;
            if (st && !first_failure)
                first_failure = st;
        } else if (!first_failure) {
            char what[2 * KILN_OP_ID_MAX + 64];
            describe_segment(what, sizeof what, cmds, i, last);
            first_failure = kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT,
                                       "the segment of %s was rejected earlier (its capture failed)", what);
        }
        i = last;
    }
    return first_failure;
}

/* ---- fences ---- */

kiln_status kiln_fence_query(kiln_fence *b, kiln_fence_state *state)
{
    if (!b || !state)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_fence_query: NULL argument");
    if (b->state == KILN_FENCE_PENDING && kiln__runtime_usable(b->stream->rt))
        reap(b->stream);
    if (b->state == KILN_FENCE_PENDING && atomic_load(&b->stream->rt->broken))
        b->state = KILN_FENCE_INDETERMINATE;
    *state = b->state;
    return KILN_OK;
}

kiln_status kiln_fence_wait(kiln_fence *b)
{
    if (!b)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_fence_wait: fence is NULL");
    kiln_stream *s = b->stream;
    kiln_runtime *rt = s->rt;
    if (s->destroyed && b->state == KILN_FENCE_SUCCEEDED)
        return KILN_OK; /* its stream (and fault record) is gone; the batch completed */
    if (b->state == KILN_FENCE_INDETERMINATE)
        return kiln__fail(&rt->err, atomic_load(&rt->broken) ? (kiln_status)atomic_load(&rt->broken)
                                                             : KILN_ERR_RUNTIME_CONTRACT,
                          "the batch failed to enqueue or the device failed; its outcome is unknown");
    kiln_status st = kiln__runtime_enter(rt);
    if (st) {
        b->state = KILN_FENCE_INDETERMINATE;
        return st;
    }
    if (b->state == KILN_FENCE_PENDING) {
        CUresult r = rt->d->cuEventSynchronize(b->done);
        if (r != CUDA_SUCCESS) {
            b->state = KILN_FENCE_INDETERMINATE;
            return kiln__runtime_cu_fail(rt, r, "waiting for a batch");
        }
        reap(s);
    }
    return kiln__stream_check_fault(s);
}

/* Reads the events once the batch is done. */
static void read_timings(kiln_fence *b)
{
    if (b->timed || b->state != KILN_FENCE_SUCCEEDED || b->timing == KILN_TIMING_OFF)
        return;
    const kiln__driver *d = b->stream->rt->d;
    if (!kiln__runtime_usable(b->stream->rt))
        return;
    for (size_t k = 0; b->timing == KILN_TIMING_SPANS && k < b->n_spans; k++) {
        float start = 0, len = 0;
        if (d->cuEventElapsedTime(&start, b->start, b->span_events[2 * k]) == CUDA_SUCCESS &&
            d->cuEventElapsedTime(&len, b->span_events[2 * k], b->span_events[2 * k + 1]) == CUDA_SUCCESS) {
            b->spans[k].start_ms = start;
            b->spans[k].duration_ms = len;
        }
    }
    b->timed = 1;
}

kiln_status kiln_fence_receipt(kiln_fence *b, kiln_receipt *out)
{
    if (!b || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_fence_receipt: NULL argument");
    kiln_fence_state state;
    kiln_fence_query(b, &state);
    read_timings(b);
    *out = (kiln_receipt){.state = state, .timing = b->timing, .elapsed_ms = -1, .n_commands = b->n,
                          .n_spans = b->timing == KILN_TIMING_SPANS ? b->n_spans : 0};
    float ms = 0;
    if (state == KILN_FENCE_SUCCEEDED && b->timing != KILN_TIMING_OFF &&
        b->stream->rt->d->cuEventElapsedTime(&ms, b->start, b->done) == CUDA_SUCCESS)
        out->elapsed_ms = ms;
    return KILN_OK;
}

kiln_status kiln_fence_span(kiln_fence *b, size_t index, kiln_span *out)
{
    if (!b || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_fence_span: NULL argument");
    if (b->timing != KILN_TIMING_SPANS || index >= b->n_spans)
        return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "span %zu: the batch has %zu spans", index,
                          b->timing == KILN_TIMING_SPANS ? b->n_spans : 0);
    read_timings(b);
    *out = b->spans[index];
    return KILN_OK;
}

kiln_status kiln_fence_attribution(const kiln_fence *b, size_t index, kiln_attribution *out)
{
    if (!b || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_fence_attribution: NULL argument");
    if (index >= b->n)
        return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "attribution row %zu: the batch has %zu commands", index, b->n);
    *out = b->rows[index];
    return KILN_OK;
}

void kiln_fence_release(kiln_fence *b) { batch_unref(b); }
