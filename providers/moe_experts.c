/* Routed SwiGLU experts with an optional shared expert: grouping on the
 * device, two grouped tensor-core products, the weighted combine
 * (templates/moe_experts.cu; include/kiln/op_moe.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fault.h"
#include "jit/internal.h"
#include "providers/blas.h" /* kiln__check_workspace */
#include "providers/internal.h"
#include "runtime/device.h"

#define OP "moe_experts"
/* Pairs (tokens x top_k) a command takes: its row tiles (64 rows a tile
 * plus a partial one an expert, at this many pairs) fit a grid's y (65535). */
#define MAX_PAIRS 1000000u
#define GROUP_THREADS 1024u
#define COMBINE_THREADS 256u
#define WGMMA_TEMPLATE "moe_experts_wgmma"

/* One way of running the two grouped products: their entries and, as their
 * kernels have them, rows a tile, output columns of a gate_up and a down
 * block, threads and dynamic shared memory. */
typedef struct tiling {
    const char *gate_up, *down;
    unsigned rows, cols_gu, cols_down, threads, smem;
} tiling;

/* A grouped_tile<...> stage of moe_experts.cu: the rows' 128 bytes of a
 * k-step and twice the gate_up columns' weight rows (down's are as many). */
#define MMA_SMEM(rows, cols_gu, stages) (((rows) + 2u * (cols_gu)) * 128u * (stages) + 128u)
/* 16 rows for the few a decode step gives each expert; 64 once an expert
 * averages 32 rows (prefill); on sm_90, where the experts average
 * WGMMA_MIN_ROWS or more ($KILN_MOE_WGMMA=0: never), moe_experts_wgmma.cu's
 * 128-row tiles, 4 stages of 48 KiB: 1.28x the 64-row tiles at 4096 tokens
 * of Qwen3-30B-A3B (bench_moe). */
static const tiling SMALL = {"kiln_moe_gate_up_s", "kiln_moe_down_s", 16, 32, 64, 128, MMA_SMEM(16u, 32u, 6u)};
static const tiling LARGE = {"kiln_moe_gate_up_l", "kiln_moe_down_l", 64, 64, 128, 128, MMA_SMEM(64u, 64u, 3u)};
static const tiling WGMMA = {"kiln_moe_gate_up_w", "kiln_moe_down_w", 128, 128, 256, 384, 4u * 49152u + 1024u};
#define LARGE_MIN_ROWS 32u
#define WGMMA_MIN_ROWS 128u

static kiln_status sizes_ok(int64_t hidden, int64_t inter, int64_t experts, int64_t top_k)
{
    if (hidden < 128 || hidden > KILN_MODEL_MAX_HIDDEN || hidden % 128 || inter < 64 ||
        inter > KILN_MODEL_MAX_INTERMEDIATE || inter % 64)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": hidden %lld must be a multiple of 128 in [128, %d] and inter %lld a multiple of 64 "
                             "in [64, %d]",
                          (long long)hidden, KILN_MODEL_MAX_HIDDEN, (long long)inter, KILN_MODEL_MAX_INTERMEDIATE);
    if (experts < 1 || experts > KILN_MOE_MAX_EXPERTS || top_k < 1 || top_k > KILN_MOE_MAX_TOP_K || top_k > experts)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": experts %lld (1..%d), top_k %lld (1..min(experts, %d))", (long long)experts,
                          KILN_MOE_MAX_EXPERTS, (long long)top_k, KILN_MOE_MAX_TOP_K);
    return KILN_OK;
}

/* The spec of template name (moe_experts, or its wgmma products). */
static kiln_status spec_of(const char *name, kiln_dtype elt, int64_t hidden, int64_t inter, int64_t experts,
                           int64_t top_k, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    kiln_status st;
    if ((st = sizes_ok(hidden, inter, experts, top_k)) || (st = kiln_spec_init(out, name)) ||
        (st = kiln__spec_set_elt(out, OP, elt)) || (st = kiln_spec_set(out, "HIDDEN", hidden)) ||
        (st = kiln_spec_set(out, "INTER", inter)) || (st = kiln_spec_set(out, "EXPERTS", experts)) ||
        (st = kiln_spec_set(out, "TOP_K", top_k)))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_moe_experts_spec(kiln_dtype elt, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k,
                                     kiln_spec *out)
{
    return spec_of(OP, elt, hidden, inter, experts, top_k, out);
}

/* Whether the wgmma products serve these sizes on sm (0: not known, so
 * perhaps sm_90), unless $KILN_MOE_WGMMA=0. */
static int wgmma_serves(int sm, int64_t hidden, int64_t inter)
{
    const char *env = getenv("KILN_MOE_WGMMA");
    return (!sm || sm == 90) && hidden % 256 == 0 && inter % 128 == 0 && (!env || strcmp(env, "0"));
}

/* Where each part of the workspace lies, bytes from its start. */
typedef struct ws_layout {
    size_t n_tiles, offsets, tile_e, tile_r, sorted, inv, h, y, total;
    uint32_t max_tiles;
} ws_layout;

static size_t up256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Sizes are checked (pairs at most MAX_PAIRS, inter and hidden bounded), so
 * nothing here overflows a size_t. */
static void layout(uint64_t pairs, uint64_t hidden, uint64_t inter, uint64_t experts, uint32_t rows, ws_layout *w)
{
    const uint64_t touched = experts < pairs ? experts : pairs;
    w->max_tiles = (uint32_t)((pairs + rows - 1) / rows + touched);
    w->n_tiles = 0;
    w->offsets = 256;
    w->tile_e = w->offsets + up256((experts + 1) * 4);
    w->tile_r = w->tile_e + up256((size_t)w->max_tiles * 4);
    w->sorted = w->tile_r + up256((size_t)w->max_tiles * 4);
    w->inv = w->sorted + up256(pairs * 4);
    w->h = w->inv + up256(pairs * 4);
    w->y = w->h + up256(pairs * inter * 2);
    w->total = w->y + up256(pairs * hidden * 2);
}

static kiln_status pairs_ok(kiln__errslot *err, int64_t tokens, int64_t top_k)
{
    if (tokens < 1 || tokens > (int64_t)MAX_PAIRS || tokens * top_k > (int64_t)MAX_PAIRS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": %lld tokens x top_k %lld: at most %u pairs a command",
                          (long long)tokens, (long long)top_k, MAX_PAIRS);
    return KILN_OK;
}

kiln_status kiln_op_moe_experts_workspace(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts,
                                          int64_t top_k, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    kiln_status st;
    if ((st = sizes_ok(hidden, inter, experts, top_k)) || (st = pairs_ok(NULL, tokens, top_k)))
        return st;
    ws_layout w;
    layout((uint64_t)(tokens * top_k), (uint64_t)hidden, (uint64_t)inter, (uint64_t)experts, SMALL.rows, &w);
    *bytes = w.total;
    return KILN_OK;
}

/* The experts at the config's sizes; on sm_90 (arch NULL: not known), for
 * sizes they serve and unless $KILN_MOE_WGMMA=0, the wgmma products too. */
kiln_status kiln__moe_experts_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                         void *user)
{
    if (!cfg->num_experts)
        return KILN_OK;
    kiln_spec spec;
    const int64_t h = cfg->hidden_size, i = cfg->moe_intermediate_size;
    kiln_status st = kiln_op_moe_experts_spec(cfg->dtype, h, i, cfg->num_experts, cfg->num_experts_per_tok, &spec);
    if (st || (st = sink(user, &spec)))
        return st;
    if (!wgmma_serves(kiln__arch_number(arch), h, i))
        return KILN_OK;
    if ((st = spec_of(WGMMA_TEMPLATE, cfg->dtype, h, i, cfg->num_experts, cfg->num_experts_per_tok, &spec)))
        return st;
    return sink(user, &spec);
}

typedef struct experts_launch {
    kiln_runtime *rt;
    CUfunction group, gate_up, down, combine;
    CUdeviceptr x, ids, weights, gate_up_w, down_w, shared, shared_gate, out;
    CUdeviceptr n_tiles, offsets, tile_e, tile_r, sorted, inv, h, y;
    uint32_t tokens, pairs, rows, max_tiles, smem, gu_cols, down_cols, gemm_threads;
} experts_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    experts_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    void *ga[] = {&l->ids, &l->pairs, &l->rows, &l->n_tiles, &l->offsets, &l->tile_e, &l->tile_r, &l->sorted, &l->inv,
                  &fault};
    void *ua[] = {&l->x, &l->gate_up_w, &l->h, &l->n_tiles, &l->offsets, &l->tile_e, &l->tile_r, &l->sorted};
    void *da[] = {&l->h, &l->down_w, &l->y, &l->n_tiles, &l->offsets, &l->tile_e, &l->tile_r, &l->sorted};
    void *ca[] = {&l->y, &l->inv, &l->weights, &l->x, &l->shared, &l->shared_gate, &l->out};
    const unsigned one[3] = {1, 1, 1}, gu[3] = {l->gu_cols, l->max_tiles, 1}, dn[3] = {l->down_cols, l->max_tiles, 1},
                   cb[3] = {l->tokens, 1, 1};
    kiln_status st;
    if ((st = kiln__launch_ex(ctx, l->rt, l->group, one, GROUP_THREADS, 0, ga, KILN__LAUNCH_PDL)) ||
        (st = kiln__launch_ex(ctx, l->rt, l->gate_up, gu, l->gemm_threads, l->smem, ua, KILN__LAUNCH_PDL)) ||
        (st = kiln__launch_ex(ctx, l->rt, l->down, dn, l->gemm_threads, l->smem, da, KILN__LAUNCH_PDL)))
        return st;
    return kiln__launch_ex(ctx, l->rt, l->combine, cb, COMBINE_THREADS, 0, ca, KILN__LAUNCH_PDL);
}

static CUdeviceptr ptr(const kiln_tensor *t) { return t ? kiln__buffer_ptr(t->buffer) + t->offset : 0; }

enum { X, IDS, WEIGHTS, GATE_UP, DOWN, SHARED, SHARED_GATE, OUT, N_BINDINGS };
static const char *const names[N_BINDINGS] = {"x", "ids", "weights", "gate_up", "down", "shared", "shared_gate", "out"};

static kiln_status check(kiln_runtime *rt, kiln__errslot *err, const kiln_moe_experts_desc *d, kiln_dtype *elt,
                         size_t bytes[N_BINDINGS])
{
    kiln_status st;
    const kiln_tensor *t[N_BINDINGS] = {d->x, d->ids, d->weights, d->gate_up, d->down, d->shared, d->shared_gate, d->out};
    if ((st = kiln__check_elt(err, OP, "x", d->x, rt, elt)) ||
        (st = kiln__check_tensor(err, OP, "x", d->x, rt, *elt, 2, NULL, &bytes[X])) ||
        (st = kiln__check_tensor(err, OP, "ids", d->ids, rt, KILN_DTYPE_U32, 2, NULL, &bytes[IDS])) ||
        (st = kiln__check_tensor(err, OP, "gate_up", d->gate_up, rt, *elt, 3, NULL, &bytes[GATE_UP])))
        return st;
    const int64_t T = d->x->dims[0], H = d->x->dims[1], K = d->ids->dims[1], E = d->gate_up->dims[0];
    const int64_t two_i = d->gate_up->dims[1], I = two_i / 2;
    if (d->ids->dims[0] != T)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding ids has %lld rows; x has %lld tokens",
                          (long long)d->ids->dims[0], (long long)T);
    if (two_i % 2 || d->gate_up->dims[2] != H)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding gate_up is [%lld, %lld, %lld]; it must be [experts, 2 x inter, hidden %lld] "
                             "(each expert's gate rows, then its up rows)",
                          (long long)E, (long long)two_i, (long long)d->gate_up->dims[2], (long long)H);
    if ((st = sizes_ok(H, I, E, K)))
        return kiln__propagate(err, st);
    if ((st = pairs_ok(err, T, K)))
        return st;
    const int64_t want_w[2] = {T, K}, want_down[3] = {E, H, I}, want_th[2] = {T, H}, want_h[1] = {H};
    if ((st = kiln__check_tensor(err, OP, "weights", d->weights, rt, KILN_DTYPE_F32, 2, want_w, &bytes[WEIGHTS])) ||
        (st = kiln__check_tensor(err, OP, "down", d->down, rt, *elt, 3, want_down, &bytes[DOWN])) ||
        (st = kiln__check_tensor(err, OP, "out", d->out, rt, *elt, 2, want_th, &bytes[OUT])))
        return st;
    bytes[SHARED] = bytes[SHARED_GATE] = 0;
    if (d->shared_gate && !d->shared)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding shared_gate is given without shared");
    if (d->shared && (st = kiln__check_tensor(err, OP, "shared", d->shared, rt, *elt, 2, want_th, &bytes[SHARED])))
        return st;
    if (d->shared_gate &&
        (st = kiln__check_tensor(err, OP, "shared_gate", d->shared_gate, rt, *elt, 1, want_h, &bytes[SHARED_GATE])))
        return st;
    for (int i = 0; i < N_BINDINGS; i++)
        if (t[i] && ptr(t[i]) % 16)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              OP ": binding %s must start 16-byte aligned; it starts %llu bytes past that", names[i],
                              (unsigned long long)(ptr(t[i]) % 16));
    if ((st = kiln__check_disjoint(err, OP, d->out, bytes[OUT], "out", t, bytes, names, OUT)))
        return st;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    if (kiln__arch_number(info.arch) < 80)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": needs sm_80 or later (mma.sync); the device is %s",
                          info.arch);
    return KILN_OK;
}

static kiln_status function(kiln_runtime *rt, kiln__errslot *err, kiln_kernel *k, const char *name, unsigned smem,
                            CUfunction *fn)
{
    void *f;
    kiln_status st = kiln_kernel_function(k, name, &f);
    if (st)
        return kiln__propagate(err, st);
    *fn = (CUfunction)f;
    if (smem > 48u * 1024u) {
        CUresult r = kiln__function_set_attribute(rt, *fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem);
        if (r != CUDA_SUCCESS)
            return kiln__fail(err, KILN_ERR_CUDA_DRIVER, OP ": %s cannot have %u bytes of shared memory (CUresult %d)",
                              name, smem, (int)r);
    }
    return KILN_OK;
}

kiln_status kiln_op_moe_experts_encode(kiln_jit *jit, const kiln_moe_experts_desc *desc, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    kiln_status st;
    kiln_moe_experts_desc d;
    kiln_dtype elt;
    size_t bytes[N_BINDINGS];
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) ||
        (st = kiln__copy_bindings(err, OP, "desc", "kiln_moe_experts_desc", &d, sizeof d, sizeof d, desc)) ||
        (st = check(rt, err, &d, &elt, bytes)))
        return st;
    const int64_t T = d.x->dims[0], H = d.x->dims[1], K = d.ids->dims[1], E = d.gate_up->dims[0],
                  I = d.gate_up->dims[1] / 2;
    const uint64_t P = (uint64_t)(T * K), touched = (uint64_t)E < P ? (uint64_t)E : P;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    const uint64_t per_expert = P / touched;
    const tiling *tl = per_expert >= WGMMA_MIN_ROWS && wgmma_serves(kiln__arch_number(info.arch), H, I) ? &WGMMA
                       : per_expert >= LARGE_MIN_ROWS                                                 ? &LARGE
                                                                                                      : &SMALL;
    ws_layout w;
    layout(P, (uint64_t)H, (uint64_t)I, (uint64_t)E, tl->rows, &w);
    size_t need;
    if ((st = kiln_op_moe_experts_workspace(T, H, I, E, K, &need)))
        return kiln__propagate(err, st);
    const kiln_tensor *t[N_BINDINGS] = {d.x, d.ids, d.weights, d.gate_up, d.down, d.shared, d.shared_gate, d.out};
    if ((st = kiln__check_workspace(err, OP, d.workspace, rt, need, t, bytes, names, N_BINDINGS)))
        return st;
    kiln_spec spec;
    kiln_kernel *k, *kw = NULL; /* moe_experts, and the wgmma template's products where they are taken */
    const int wg = tl == &WGMMA;
    experts_launch *l = calloc(1, sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    l->smem = tl->smem;
    if ((st = kiln_op_moe_experts_spec(elt, H, I, E, K, &spec)) || (st = kiln_jit_acquire(jit, &spec, &k)) ||
        (wg && ((st = spec_of(WGMMA_TEMPLATE, elt, H, I, E, K, &spec)) ||
                (st = kiln_jit_acquire(jit, &spec, &kw)))) ||
        (st = function(rt, err, k, "kiln_moe_group", 0, &l->group)) ||
        (st = function(rt, err, wg ? kw : k, tl->gate_up, l->smem, &l->gate_up)) ||
        (st = function(rt, err, wg ? kw : k, tl->down, l->smem, &l->down)) ||
        (st = function(rt, err, k, "kiln_moe_combine", 0, &l->combine))) {
        free(l);
        return kiln__propagate(err, st);
    }
    const CUdeviceptr ws = kiln__buffer_ptr(d.workspace->buffer) + d.workspace->start;
    l->rt = rt;
    l->x = ptr(d.x);
    l->ids = ptr(d.ids);
    l->weights = ptr(d.weights);
    l->gate_up_w = ptr(d.gate_up);
    l->down_w = ptr(d.down);
    l->shared = ptr(d.shared);
    l->shared_gate = ptr(d.shared_gate);
    l->out = ptr(d.out);
    l->n_tiles = ws + w.n_tiles;
    l->offsets = ws + w.offsets;
    l->tile_e = ws + w.tile_e;
    l->tile_r = ws + w.tile_r;
    l->sorted = ws + w.sorted;
    l->inv = ws + w.inv;
    l->h = ws + w.h;
    l->y = ws + w.y;
    l->tokens = (uint32_t)T;
    l->pairs = (uint32_t)P;
    l->rows = tl->rows;
    l->max_tiles = w.max_tiles;
    l->gu_cols = (uint32_t)I / tl->cols_gu;
    l->down_cols = (uint32_t)H / tl->cols_down;
    l->gemm_threads = tl->threads;
    const uint64_t params[] = {l->x,   l->ids,  l->weights, l->gate_up_w, l->down_w, l->shared, l->shared_gate,
                               l->out, ws,      l->tokens,  l->rows};
    kiln_region regions[N_BINDINGS + 1];
    size_t n = 0;
    for (int i = 0; i < N_BINDINGS; i++)
        if (t[i])
            regions[n++] = kiln__tensor_region(t[i], bytes[i]);
    regions[n++] = *d.workspace;
    const kiln__kernel_command_desc cd = {.op = OP, .tokens = (uint32_t)T, .dispatches = 4, .regions = regions,
                                          .n_regions = n, .enqueue = enqueue, .user = l, .kernel = k,
                                          KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &cd, cmd);
}

kiln_status kiln_op_moe_experts(kiln_jit *jit, const kiln_moe_experts_desc *desc)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_moe_experts_encode(jit, desc, &cmd), &cmd);
}
