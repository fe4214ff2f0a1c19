/* Streams: creation and destruction, the state machine, the pool of events
 * their batches record, reaping completed batches, the fault record, and
 * synchronize and readback. Submission is in submit.c, fences in fence.c. */
#include <cublasLt.h>
#include <stdlib.h>

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
void kiln__stream_move(kiln_stream *s, kiln__stream_event ev)
{
    kiln_stream_state to = s->state;
    if (kiln__stream_next(NULL, s->state, ev, &to) == KILN_OK)
        s->state = to;
}


/* ---- events: reused once their batch is freed ---- */

#define MAX_IDLE_EVENTS 256

kiln_status kiln__stream_event_get(kiln_stream *s, int timed, CUevent *ev)
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
void kiln__stream_event_put(kiln_stream *s, int timed, CUevent ev, int reusable)
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

void kiln__stream_unref(kiln_stream *s)
{
    if (--s->refs > 0)
        return;
    free(s->idle_events[0]);
    free(s->idle_events[1]);
    free(s);
}

/* Notes batches that have completed, oldest first, dropping the stream's
 * reference to each; a failed query marks the batch indeterminate. */
void kiln__stream_reap(kiln_stream *s)
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
            kiln__stream_move(s, KILN__EV_DEVICE_FAILED);
            return;
        }
        s->pending = b->next;
        b->next = NULL;
        kiln__fence_unref(b);
    }
    if (!s->pending)
        kiln__stream_move(s, KILN__EV_DRAINED);
}

kiln_stream_state kiln_stream_get_state(kiln_stream *s)
{
    if (!s)
        return KILN_STREAM_FAILED;
    if (s->state == KILN_STREAM_SUBMITTED && kiln__runtime_usable(s->rt))
        kiln__stream_reap(s);
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
    {KILN__FAULT_GATED_DELTA_THREADS, "gated_delta: a chunked kernel's block %u ran with %u threads, not the %llu "
                                      "its template was built for (an internal error); it touched nothing"},
    {KILN__FAULT_GATED_DELTA_SMEM, "gated_delta: a chunked kernel's block %u had %u bytes of shared memory, below "
                                   "the %llu it needs (an internal error); it touched nothing"},
    {KILN__FAULT_MOE_EXPERT_ID, "moe_experts: ids[%u] (token x top_k + slot) = %u is at or past the %llu experts "
                                "(lowest bad pair); that slot added nothing"},
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
        kiln__stream_reap(s);
    /* The GPU is done with the quarantine (or can touch nothing any more). */
    while (s->quarantine) {
        kiln_fence *b = s->quarantine;
        s->quarantine = b->next;
        b->next = NULL;
        kiln__fence_unref(b);
    }
    if (!device_ok) {
        while (s->pending) {
            kiln_fence *b = s->pending;
            b->state = KILN_FENCE_INDETERMINATE;
            s->pending = b->next;
            b->next = NULL;
            kiln__fence_unref(b);
        }
        kiln__stream_move(s, KILN__EV_DEVICE_FAILED);
        return st;
    }
    kiln__stream_move(s, KILN__EV_SYNCED);
    return kiln__stream_check_fault(s);
}

void kiln_stream_destroy(kiln_stream *s)
{
    if (!s)
        return;
    kiln_runtime *rt = s->rt;
    /* Batches the device finished are succeeded for fences the caller still holds. */
    if (kiln__runtime_usable(rt) && s->handle && rt->d->cuStreamSynchronize(s->handle) == CUDA_SUCCESS)
        kiln__stream_reap(s);
    kiln_fence *lists[2] = {s->pending, s->quarantine};
    for (int l = 0; l < 2; l++) {
        while (lists[l]) {
            kiln_fence *b = lists[l];
            lists[l] = b->next;
            b->next = NULL;
            if (b->state == KILN_FENCE_PENDING)
                b->state = KILN_FENCE_INDETERMINATE;
            kiln__fence_unref(b);
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
    kiln__stream_unref(s);
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
