/* Last-token masked argmax with repetition penalty over f16 or bf16 logits (templates/masked_argmax.cu). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/internal.h"

#define OP "masked_argmax"
/* Blocks per participant: 16, a non-portable cluster size sm_90 allows (the
 * function's attribute is set before launch); 8, the portable size, where 16
 * cannot be scheduled. */
#define CLUSTER 16
#define PORTABLE_CLUSTER 8
/* Before sm_90 (no clusters): one block a participant. */
#define NO_CLUSTER 1
#define MAX_THREADS 640
#define MAX_PARTICIPANTS 65535u

/* Vectors per thread per pass: the fewest (1, 2, 4, 8) that keep a block at
 * most MAX_THREADS threads, so that a slice is one pass of loads in flight. */
static int64_t unroll_for(int64_t vocab, int vec, int cluster)
{
    const int64_t chunk = (vocab / vec + cluster - 1) / cluster;
    int64_t u = 1;
    while (u < 8 && (chunk + u - 1) / u > MAX_THREADS)
        u *= 2;
    return u;
}

static int64_t threads_for(int64_t vocab, int vec, int cluster)
{
    const int64_t chunk = (vocab / vec + cluster - 1) / cluster, u = unroll_for(vocab, vec, cluster);
    int64_t t = ((chunk + u - 1) / u + 31) / 32 * 32;
    return t < 64 ? 64 : t > 1024 ? 1024 : t;
}

/* The largest cluster encode may use (tests lower it to cover the portable
 * size and the one-block kernel of devices before sm_90). */
static _Atomic int max_cluster = CLUSTER;

void kiln__masked_argmax_set_max_cluster(int cluster)
{
    atomic_store(&max_cluster, cluster == PORTABLE_CLUSTER || cluster == NO_CLUSTER ? cluster : CLUSTER);
}

/* The cluster size for an architecture ("sm_90"; NULL: not known, sm_90's). */
static int cluster_for(const char *arch)
{
    return arch && kiln__arch_number(arch) < 90 ? NO_CLUSTER : CLUSTER;
}

kiln_status kiln__masked_argmax_spec_cluster(kiln_dtype elt, int64_t vocab, int vec, int cluster, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (vocab < 1 || vocab > KILN_MODEL_MAX_VOCAB || (vec != 1 && vec != 8) || vocab % vec)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": vocab %lld (1..%d), vector width %d (1, or 8 dividing vocab)", (long long)vocab,
                          KILN_MODEL_MAX_VOCAB, vec);
    if (cluster != CLUSTER && cluster != PORTABLE_CLUSTER && cluster != NO_CLUSTER)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": cluster %d (%d, %d or %d)", cluster, CLUSTER,
                          PORTABLE_CLUSTER, NO_CLUSTER);
    kiln_status st;
    if ((st = kiln_spec_init(out, OP)) || (st = kiln__spec_set_elt(out, OP, elt)) ||
        (st = kiln_spec_set(out, "VOCAB", vocab)) || (st = kiln_spec_set(out, "VEC", vec)) ||
        (st = kiln_spec_set(out, "THREADS", threads_for(vocab, vec, cluster))) ||
        (st = kiln_spec_set(out, "UNROLL", unroll_for(vocab, vec, cluster))) ||
        (st = kiln_spec_set(out, "CLUSTER", cluster)))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_masked_argmax_spec(kiln_dtype elt, int64_t vocab, int vec, kiln_spec *out)
{
    return kiln__masked_argmax_spec_cluster(elt, vocab, vec, CLUSTER, out);
}

kiln_status kiln_op_masked_argmax_workspace(int64_t vocab, int64_t participants, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    if (vocab < 1 || vocab > KILN_MODEL_MAX_VOCAB || participants < 1 || participants > MAX_PARTICIPANTS)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": vocab %lld (1..%d), participants %lld (1..%u)",
                          (long long)vocab, KILN_MODEL_MAX_VOCAB, (long long)participants, MAX_PARTICIPANTS);
    /* The seed's contract: align16(vocab * 2) bytes per sequence. */
    *bytes = (size_t)participants * (((size_t)vocab * 2 + 15) & ~(size_t)15);
    return KILN_OK;
}

kiln_status kiln__masked_argmax_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                           void *user)
{
    kiln_spec spec;
    kiln_status st = kiln__masked_argmax_spec_cluster(cfg->dtype, cfg->vocab_size, cfg->vocab_size % 8 ? 1 : 8,
                                                      cluster_for(arch), &spec);
    return st ? st : sink(user, &spec);
}

enum { B_LOGITS, B_VALID, B_IDS, B_OFFSETS, B_PENALTY, B_WORKSPACE, B_OUT, N_BINDINGS };
static const char *const names[N_BINDINGS] = {"logits",  "valid",     "rep_ids", "rep_offsets",
                                              "penalty", "workspace", "out"};

static void views(const kiln_masked_argmax_bindings *b, const kiln_tensor *t[N_BINDINGS])
{
    t[B_LOGITS] = b->logits;
    t[B_VALID] = b->valid;
    t[B_IDS] = b->rep_ids;
    t[B_OFFSETS] = b->rep_offsets;
    t[B_PENALTY] = b->penalty;
    t[B_WORKSPACE] = b->workspace;
    t[B_OUT] = b->out;
}

kiln_status kiln__masked_argmax_check(kiln_runtime *rt, const kiln_masked_argmax_bindings *b, size_t bytes[7],
                                      int *vec)
{
    kiln__errslot *err = kiln__runtime_errslot(rt);
    kiln_masked_argmax_bindings local;
    kiln_status st = kiln__copy_bindings(err, OP, "bindings", "kiln_masked_argmax_bindings", &local, sizeof local,
                                         sizeof local, b);
    if (st)
        return st;
    const kiln_tensor *t[N_BINDINGS];
    views(&local, t);
    kiln_dtype elt;
    if ((st = kiln__check_elt(err, OP, "logits", t[B_LOGITS], rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "logits", t[B_LOGITS], rt, elt, 2, NULL, &bytes[B_LOGITS])))
        return st;
    const int64_t P = t[B_LOGITS]->dims[0], vocab = t[B_LOGITS]->dims[1];
    if (vocab > KILN_MODEL_MAX_VOCAB || P > MAX_PARTICIPANTS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding logits is [%lld, %lld]; at most %u participants and vocab %d", (long long)P,
                          (long long)vocab, MAX_PARTICIPANTS, KILN_MODEL_MAX_VOCAB);
    size_t ws_need;
    if ((st = kiln_op_masked_argmax_workspace(vocab, P, &ws_need)))
        return kiln__propagate(err, st);
    const int64_t want_valid[1] = {vocab}, want_ids[1] = {-1}, want_off[1] = {P + 1}, want_pen[1] = {1},
                  want_ws[1] = {-1}, want_out[1] = {P};
    if ((st = kiln__check_tensor(err, OP, "valid", t[B_VALID], rt, KILN_DTYPE_U8, 1, want_valid, &bytes[B_VALID])) ||
        (st = kiln__check_tensor(err, OP, "rep_ids", t[B_IDS], rt, KILN_DTYPE_U32, 1, want_ids, &bytes[B_IDS])) ||
        (st = kiln__check_tensor(err, OP, "rep_offsets", t[B_OFFSETS], rt, KILN_DTYPE_U32, 1, want_off,
                                 &bytes[B_OFFSETS])) ||
        (st = kiln__check_tensor(err, OP, "penalty", t[B_PENALTY], rt, KILN_DTYPE_F32, 1, want_pen,
                                 &bytes[B_PENALTY])) ||
        (st = kiln__check_tensor(err, OP, "workspace", t[B_WORKSPACE], rt, KILN_DTYPE_U8, 1, want_ws,
                                 &bytes[B_WORKSPACE])) ||
        (st = kiln__check_tensor(err, OP, "out", t[B_OUT], rt, KILN_DTYPE_U32, 1, want_out, &bytes[B_OUT])))
        return st;
    if (t[B_IDS]->dims[0] > UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding rep_ids has %lld ids; at most %u",
                          (long long)t[B_IDS]->dims[0], UINT32_MAX);
    if (bytes[B_WORKSPACE] < ws_need)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding workspace has %zu bytes; it needs at least %zu (%lld participants x "
                          "align16(vocab %lld x 2))",
                          bytes[B_WORKSPACE], ws_need, (long long)P, (long long)vocab);
    /* What is written (out, workspace) overlaps nothing else. */
    for (int w = B_WORKSPACE; w <= B_OUT; w++)
        for (int i = 0; i < N_BINDINGS; i++)
            if (i != w && kiln__tensors_overlap(t[w], bytes[w], t[i], bytes[i]))
                return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": %s overlaps %s", names[w], names[i]);
    const uint64_t lp = kiln__buffer_ptr(t[B_LOGITS]->buffer) + t[B_LOGITS]->offset,
                   vp = kiln__buffer_ptr(t[B_VALID]->buffer) + t[B_VALID]->offset;
    *vec = (vocab % 8 == 0 && lp % 16 == 0 && vp % 8 == 0) ? 8 : 1;
    return KILN_OK;
}

typedef struct argmax_launch {
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr logits, valid, ids, offsets, penalty, out;
    uint32_t capacity, participants, cluster;
    unsigned threads;
} argmax_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    argmax_launch *l = user;
    void *args[] = {&l->logits, &l->valid, &l->ids, &l->offsets, &l->penalty, &l->capacity, &l->out};
    return kiln__launch(ctx, l->rt, l->fn, l->participants * l->cluster, l->threads, 0, args);
}

/* Whether fn, compiled for a cluster of CLUSTER blocks, may be launched here:
 * the non-portable size allowed on the function and at least one cluster
 * that fits the device. */
static int big_cluster_fits(kiln_runtime *rt, CUfunction fn, unsigned threads)
{
    if (kiln__runtime_enter(rt) ||
        kiln__function_set_attribute(rt, fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1) != CUDA_SUCCESS)
        return 0;
    return kiln__function_clusters(rt, fn, CLUSTER, threads, 0, KILN__CLUSTER_DECLARED) >= 1;
}

kiln_status kiln_op_masked_argmax_encode(kiln_jit *jit, const kiln_masked_argmax_bindings *b, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    size_t bytes[N_BINDINGS];
    int vec;
    kiln_status st;
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) || (st = kiln__masked_argmax_check(rt, b, bytes, &vec)))
        return st;
    kiln_masked_argmax_bindings local; /* checked: its size is 0 or at least ours */
    (void)KILN__COPY_SIZED(local, b);
    const kiln_tensor *t[N_BINDINGS];
    views(&local, t);
    const int64_t P = t[B_LOGITS]->dims[0], vocab = t[B_LOGITS]->dims[1];
    kiln_spec spec;
    kiln_kernel *k;
    void *fn;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    int cluster = cluster_for(info.arch) == NO_CLUSTER ? NO_CLUSTER : atomic_load(&max_cluster);
    for (;;) {
        if ((st = kiln__masked_argmax_spec_cluster(t[B_LOGITS]->dtype, vocab, vec, cluster, &spec)))
            return kiln__propagate(err, st);
        if ((st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, NULL, &fn)))
            return kiln__propagate(err, st);
        if (cluster <= PORTABLE_CLUSTER ||
            big_cluster_fits(rt, (CUfunction)fn, (unsigned)threads_for(vocab, vec, cluster)))
            break;
        cluster = PORTABLE_CLUSTER;
    }
    argmax_launch *l = malloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
#define PTR(i) (kiln__buffer_ptr(t[i]->buffer) + t[i]->offset)
    *l = (argmax_launch){.rt = rt,
                         .fn = (CUfunction)fn,
                         .logits = PTR(B_LOGITS),
                         .valid = PTR(B_VALID),
                         .ids = PTR(B_IDS),
                         .offsets = PTR(B_OFFSETS),
                         .penalty = PTR(B_PENALTY),
                         .out = PTR(B_OUT),
                         .capacity = (uint32_t)t[B_IDS]->dims[0],
                         .participants = (uint32_t)P,
                         .cluster = (uint32_t)cluster,
                         .threads = (unsigned)threads_for(vocab, vec, cluster)};
    /* The replay key: the kernel and every binding (address, bytes); P and R are in the bytes. */
    uint64_t params[2 * N_BINDINGS];
    kiln_region regions[N_BINDINGS];
    for (int i = 0; i < N_BINDINGS; i++) {
        params[2 * i] = PTR(i);
        params[2 * i + 1] = bytes[i];
        regions[i] = (kiln_region){t[i]->buffer, t[i]->offset, t[i]->offset + bytes[i]};
    }
#undef PTR
    /* Its tokens: the last of each participant. */
    const kiln__kernel_command_desc d = {.op = OP, .participants = (uint32_t)P, .tokens = (uint32_t)P,
                                         .regions = regions, .n_regions = N_BINDINGS, .enqueue = enqueue, .user = l,
                                         .kernel = k, KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &d, cmd);
}

kiln_status kiln_op_masked_argmax(kiln_jit *jit, const kiln_masked_argmax_bindings *b)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_masked_argmax_encode(jit, b, &cmd), &cmd);
}
