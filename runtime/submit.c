/* Submission: validation, segments and their capture into the graph cache,
 * the plan of a batch, enqueueing it, and the quarantine of batches that
 * failed half-way; kiln_stream_prepare. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime/internal.h"

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

/* What submit and prepare check first: the stream, the options (copied
 * into *opts, NULL the defaults), the runtime, the batch. */
static kiln_status submit_begin(kiln_stream *s, kiln_command *const *cmds, size_t n,
                                const kiln_submit_options *caller, const char *fn, kiln_submit_options *opts)
{
    if (!s)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "%s: stream is NULL", fn);
    kiln_status st = KILN__READ_SIZED(&s->rt->err, fn, kiln_submit_options, *opts, caller);
    if (st || (st = kiln__runtime_enter(s->rt)))
        return st;
    if (s->state == KILN_STREAM_SUBMITTED)
        kiln__stream_reap(s);
    return kiln__submit_validate(s, cmds, n, opts);
}

kiln_status kiln_stream_submit(kiln_stream *s, kiln_command *const *cmds, size_t n,
                               const kiln_submit_options *caller_opts, kiln_fence **fence)
{
    if (fence)
        *fence = NULL;
    kiln_submit_options local;
    const kiln_submit_options *opts = &local;
    kiln_status st = submit_begin(s, cmds, n, caller_opts, "kiln_stream_submit", &local);
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
    if ((st = kiln__stream_event_get(s, timed, &b->done)) || (timed && (st = kiln__stream_event_get(s, 1, &b->start))))
        goto out_unwind;
    if (opts->timing == KILN_TIMING_SPANS) {
        b->span_events = calloc(2 * b->n_spans, sizeof *b->span_events);
        if (!b->span_events) {
            st = kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
            goto out_unwind;
        }
        for (size_t i = 0; i < 2 * b->n_spans && !st; i++)
            st = kiln__stream_event_get(s, 1, &b->span_events[i]);
        if (st)
            goto out_unwind;
    }

    /* Nothing has been enqueued yet: failures above leave the stream as it was. */
    kiln__stream_move(s, KILN__EV_BEGIN);
    if (opts->n_patches)
        st = kiln__binding_apply(opts->arena, opts->patches, opts->n_patches, s->handle);
    if (!st)
        st = run(s, b);
    if (st) {
        /* Half-enqueued: the GPU may run part of it. Keep it all until synchronize. */
        kiln__propagate(&rt->err, st);
        kiln__stream_move(s, KILN__EV_ENQUEUE_FAILED);
        b->state = KILN_FENCE_INDETERMINATE;
        b->next = s->quarantine;
        s->quarantine = b;
        return st;
    }
    kiln__stream_move(s, KILN__EV_ENQUEUED);
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
    kiln__fence_free(b);
    return st;
}

kiln_status kiln_stream_prepare(kiln_stream *s, kiln_command *const *cmds, size_t n,
                                const kiln_submit_options *caller_opts, size_t *captured)
{
    if (captured)
        *captured = 0;
    kiln_submit_options local;
    const kiln_submit_options *opts = &local;
    kiln_status st = submit_begin(s, cmds, n, caller_opts, "kiln_stream_prepare", &local);
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
