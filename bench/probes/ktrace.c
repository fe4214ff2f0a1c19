/* ktrace: a CUPTI injection library that writes one line per kernel the
 * process runs, graph replays included (the GPU machine has no nsys):
 *     start_ns end_ns graph_node_id blocks threads_per_block name
 * (memsets too, as "0 0 [memset N bytes]" for blocks, threads and name)
 * Use: CUDA_INJECTION64_PATH=$PWD/build/probes/libktrace.so KTRACE_OUT=k.txt
 *      build/examples/decode/decode --bench --batch 32 --steps 20
 * then python3 bench/probes/ktrace_layers.py k.txt 32 (the per-layer table).
 * Tracing adds about 0.1 ms to a Llama-3-8B decode step on the H200; compare
 * kernels within a trace, not a traced step with an untraced one. */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records)
{
    *size = (size_t)8 << 20;
    *buf = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid)
{
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    while (out && cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
            fprintf(out, "%llu %llu %llu 0 0 [memset %llu bytes]\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, (unsigned long long)m->graphNodeId, (unsigned long long)m->bytes);
            continue;
        }
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
            continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        fprintf(out, "%llu %llu %llu %u %d %s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                (unsigned long long)k->graphNodeId, (unsigned)(k->gridX * k->gridY * k->gridZ), k->blockX, k->name);
    }
    free(buf);
}

static void finish(void)
{
    cuptiActivityFlushAll(1);
    if (out)
        fclose(out);
}

int InitializeInjection(void)
{
    const char *path = getenv("KTRACE_OUT");
    out = fopen(path ? path : "ktrace.txt", "w");
    if (!out) {
        fprintf(stderr, "ktrace: cannot write %s\n", path ? path : "ktrace.txt");
        return 0;
    }
    CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (r == CUPTI_SUCCESS)
        r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r == CUPTI_SUCCESS)
        r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    if (r != CUPTI_SUCCESS) {
        fprintf(stderr, "ktrace: CUPTI refused kernel tracing (%d)\n", (int)r);
        return 0;
    }
    atexit(finish);
    return 1;
}
