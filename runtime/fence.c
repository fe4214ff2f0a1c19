/* Fences: a submitted batch's lifetime, waiting on it, its receipt, spans
 * and attribution rows. */
#include <stdatomic.h>
#include <stdlib.h>

#include "runtime/internal.h"

void kiln__fence_free(kiln_fence *b)
{
    kiln_stream *s = b->stream;
    for (size_t i = 0; i < b->n; i++)
        kiln_command_release(b->cmds[i]);
    for (size_t i = 0; i < b->n_graphs; i++)
        kiln__graph_unref(b->graphs[i]);
    /* An event of a batch that completed can be recorded again. */
    int reusable = b->state == KILN_FENCE_SUCCEEDED;
    kiln__stream_event_put(s, b->timing != KILN_TIMING_OFF, b->done, reusable);
    kiln__stream_event_put(s, 1, b->start, reusable);
    for (size_t i = 0; b->span_events && i < 2 * b->n_spans; i++)
        kiln__stream_event_put(s, 1, b->span_events[i], reusable);
    free(b->span_events);
    free(b->spans);
    free(b->plans);
    free(b->rows);
    free(b->graphs);
    free(b->cmds);
    free(b->phase);
    free(b);
    kiln__stream_unref(s);
}

void kiln__fence_unref(kiln_fence *b)
{
    if (b && --b->refs == 0)
        kiln__fence_free(b);
}

kiln_status kiln_fence_query(kiln_fence *b, kiln_fence_state *state)
{
    if (!b || !state)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_fence_query: NULL argument");
    if (b->state == KILN_FENCE_PENDING && kiln__runtime_usable(b->stream->rt))
        kiln__stream_reap(b->stream);
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
        kiln__stream_reap(s);
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

void kiln_fence_release(kiln_fence *b) { kiln__fence_unref(b); }
