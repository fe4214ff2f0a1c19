/* What the decode program's main.c and its benchmarks (bench.c) share: the
 * session every run opens, the options of the two benchmarks and their entry
 * points. Each entry point prints JSON lines on stdout and returns the
 * program's exit status (0 ok, 1 failure; one JSON "skipped" line and 0
 * without a driver). */
#ifndef KILN_EXAMPLES_DECODE_BENCH_H
#define KILN_EXAMPLES_DECODE_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include <kiln/kiln.h>

#include "decoder.h"

#define DEC_MAX_LIST 16 /* values of a comma-separated option (--batch, --context, --shapes) */

/* The cache, runtime, jit and stream of one run. */
typedef struct dec_session {
    kiln_cache *cache;
    kiln_runtime *rt;
    kiln_jit *jit;
    kiln_stream *s;
} dec_session;

/* Opens the database db (NULL: the default) and device 0; on failure prints
 * why on stderr and returns 0 (what was opened is closed by dec_session_close). */
int dec_session_open(const char *db, dec_session *x);
void dec_session_close(dec_session *x);
/* Prints "decode: CODE: dec_errmsg()" on stderr; returns 1. */
int dec_report(kiln_status st);

/* One prefill shape: seqs sequences of tokens each. */
typedef struct dec_shape {
    uint32_t seqs, tokens;
} dec_shape;

typedef struct dec_bench_args {
    const char *config; /* a config.json, or NULL: Llama-3-8B's shape */
    const char *db;     /* NULL: the default database */
    uint32_t layers;    /* 0: the config's (32 for the default) */
    kiln_dtype dtype;   /* F16 or BF16; KILN_DTYPE_BYTES (0): the config's (f16 for the default) */
    /* --bench */
    const uint32_t *batches, *contexts;
    size_t n_batches, n_contexts;
    uint32_t steps;
    const char *chunk_file; /* where to write the random chunk, or NULL */
    /* --bench-prefill */
    const dec_shape *shapes;
    size_t n_shapes;
    uint32_t iters;
} dec_bench_args;

/* Start-up to the first decode step: the session (database, runtime, jit),
 * the weights put on the device (not counted), the engine, the first step;
 * t_main is when main began (dec__now_s's clock). */
int dec_run_bench_startup(const dec_bench_args *a, double t_main);
/* The monotonic clock, in seconds. */
double dec_bench_now_s(void);
/* A mixture of experts' routing, after dec_bench_steps for batch (defined in
 * engine_bench.c): one more decode step, eager, and each layer's chosen ids
 * read back (the engine keeps every layer's); distinct[l] (one per
 * layer) gets how many different experts layer l's batch x top_k choices
 * name. KILN_ERR_INVALID_ARGUMENT for a dense model or a batch not yet
 * stepped, KILN_ERR_DEVICE_CONTRACT for an id out of range; dec_errmsg()
 * says which. */
kiln_status dec_bench_routing(dec_engine *e, uint32_t batch, uint32_t context, uint32_t *distinct);
/* The decode step at every (context, batch), contexts outer. */
int dec_run_bench_decode(const dec_bench_args *a);
/* The dense peak in the model's element type, then the prefill of every shape. */
int dec_run_bench_prefill(const dec_bench_args *a);

#endif
