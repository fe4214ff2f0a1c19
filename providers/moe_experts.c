/* Routed SwiGLU experts with an optional shared expert: grouping on the
 * device, two grouped tensor-core products, the weighted combine
 * (templates/moe_experts.cu; include/kiln/op_moe.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fault.h"
#include "jit/internal.h"
#include "providers/blas.h" /* kiln__check_workspace */
#include "providers/internal.h"
#include "providers/tma.h"
#include "runtime/device.h"

#define OP "moe_experts"
/* Pairs (tokens x top_k) a command takes: its row tiles (64 rows a tile
 * plus a partial one an expert, at this many pairs) fit a grid's y (65535). */
#define MAX_PAIRS 1000000u
#define GROUP_THREADS 1024u
/* Pairs a grouping block takes where there are more than this many
 * (moe_experts.cu's SLICE): kiln_moe_count, then a kiln_moe_group block a
 * slice. */
#define GROUP_SLICE 2048u
#define COMBINE_THREADS 256u
#define WGMMA_TEMPLATE "moe_experts_wgmma"
#define TMA_TEMPLATE "moe_experts_tma"
/* The decode path (moe_experts_tma.cu): at most this many tokens and pairs,
 * so that an expert's tokens are one 8-token mma tile and the ids fit the
 * kernels' plan; taken by default for at most TMA_DEFAULT_PAIRS pairs (at
 * Qwen3-30B-A3B's sizes bench_moe measured it faster than the 16-row tiles
 * at 1 and 2 tokens of top-8, slower at 4 and 8). */
#define TMA_TOKENS 8
#define TMA_PAIRS 64
#define TMA_DEFAULT_PAIRS 16
#define TMA_MAX_WARPS 16 /* consumer warps a block; one more produces */
#define TMA_MAX_STAGES 8
#define TMA_GATE_UP_SHARE (80u * 1024u) /* gate_up stages beside down: bench_moe at 1 token, of 56, 80, 104 KiB */

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
    size_t n_tiles, offsets, tile_e, tile_r, sorted, inv, hist, h, y, total;
    uint32_t max_tiles, slices;
} ws_layout;

static size_t up256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Sizes are checked (pairs at most MAX_PAIRS, inter and hidden bounded), so
 * nothing here overflows a size_t. */
static void layout(uint64_t pairs, uint64_t hidden, uint64_t inter, uint64_t experts, uint32_t rows, ws_layout *w)
{
    const uint64_t touched = experts < pairs ? experts : pairs;
    /* h and y rows: a pair's each, and at least the decode path's 8 token
     * slots per expert a step of at most TMA_PAIRS pairs can name
     * (moe_experts_tma.cu), so that the bytes grow with the tokens. */
    const uint64_t slots = 8 * (touched < TMA_PAIRS ? touched : TMA_PAIRS);
    const uint64_t hy_rows = pairs > slots ? pairs : slots;
    w->max_tiles = (uint32_t)((pairs + rows - 1) / rows + touched);
    w->n_tiles = 0;
    w->offsets = 256;
    w->tile_e = w->offsets + up256((experts + 1) * 4);
    w->tile_r = w->tile_e + up256((size_t)w->max_tiles * 4);
    w->sorted = w->tile_r + up256((size_t)w->max_tiles * 4);
    w->inv = w->sorted + up256(pairs * 4);
    w->slices = pairs > GROUP_SLICE ? (uint32_t)((pairs + GROUP_SLICE - 1) / GROUP_SLICE) : 1;
    w->hist = w->inv + up256(pairs * 4);
    w->h = w->hist + up256(w->slices > 1 ? (size_t)w->slices * experts * 4 : 0);
    w->y = w->h + up256(hy_rows * inter * 2);
    w->total = w->y + up256(hy_rows * hidden * 2);
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

/* Whether the TMA decode products serve on sm (0: not known, so perhaps
 * sm_90), unless $KILN_MOE_TMA=0. */
static int tma_serves(int sm)
{
    const char *env = getenv("KILN_MOE_TMA");
    return (!sm || sm == 90) && (!env || strcmp(env, "0"));
}

/* The most pairs a step the TMA decode products take: TMA_PAIRS with
 * $KILN_MOE_TMA=1, else TMA_DEFAULT_PAIRS. */
static uint64_t tma_pairs(void)
{
    const char *env = getenv("KILN_MOE_TMA");
    return env && !strcmp(env, "1") ? TMA_PAIRS : TMA_DEFAULT_PAIRS;
}

/* The experts at the config's sizes; on sm_90 (arch NULL: not known), for
 * sizes they serve and unless $KILN_MOE_WGMMA=0, the wgmma products too,
 * and unless $KILN_MOE_TMA=0 the TMA decode products. */
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
    const int sm = kiln__arch_number(arch);
    if (wgmma_serves(sm, h, i) &&
        ((st = spec_of(WGMMA_TEMPLATE, cfg->dtype, h, i, cfg->num_experts, cfg->num_experts_per_tok, &spec)) ||
         (st = sink(user, &spec))))
        return st;
    if (!tma_serves(sm))
        return KILN_OK;
    if ((st = spec_of(TMA_TEMPLATE, cfg->dtype, h, i, cfg->num_experts, cfg->num_experts_per_tok, &spec)))
        return st;
    return sink(user, &spec);
}

/* ---- the decode path: templates/moe_experts_tma.cu, then the combine ---- */
typedef struct tma_launch {
    CUtensorMap gate_up_map, x_map, down_map, h_map; /* first: CUtensorMap's alignment */
    kiln_runtime *rt;
    CUfunction gate_up, down, combine;
    CUdeviceptr ids, weights, x, shared, shared_gate, out, h, y, inv;
    uint32_t tokens, pairs, gu_stages, dn_stages;
    unsigned grid, gu_threads, dn_threads, gu_smem, dn_smem;
} tma_launch;

static kiln_status tma_enqueue(void *user, const kiln_launch_context *ctx)
{
    tma_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    void *ua[] = {&l->gate_up_map, &l->x_map, &l->h, &l->ids, &l->pairs, &l->gu_stages, &l->inv, &fault};
    void *da[] = {&l->down_map, &l->h_map, &l->y, &l->ids, &l->pairs, &l->dn_stages};
    void *ca[] = {&l->y, &l->inv, &l->weights, &l->x, &l->shared, &l->shared_gate, &l->out};
    const unsigned grid[3] = {l->grid, 1, 1}, cb[3] = {l->tokens, 1, 1};
    kiln_status st;
    if ((st = kiln__launch_ex(ctx, l->rt, l->gate_up, grid, l->gu_threads, l->gu_smem, ua, KILN__LAUNCH_PDL)) ||
        (st = kiln__launch_ex(ctx, l->rt, l->down, grid, l->dn_threads, l->dn_smem, da, KILN__LAUNCH_PDL)))
        return st;
    return kiln__launch_ex(ctx, l->rt, l->combine, cb, COMBINE_THREADS, 0, ca, KILN__LAUNCH_PDL);
}

/* A group's units (consumer warps) for experts of per_expert units each over
 * grid blocks: enough that the most experts a step can name fill the grid
 * once, a divisor of per_expert where one is at most TMA_MAX_WARPS (no rows
 * read past an expert's last group). */
static unsigned tma_warps(uint64_t experts, uint64_t per_expert, unsigned grid)
{
    uint64_t w = (experts * per_expert + grid - 1) / grid;
    w = w < 1 ? 1 : w > TMA_MAX_WARPS ? TMA_MAX_WARPS : w;
    for (uint64_t v = w; v <= TMA_MAX_WARPS; v++)
        if (per_expert % v == 0)
            return (unsigned)v;
    return (unsigned)w;
}

/* As many stages of stage bytes as fit most bytes of dynamic shared memory
 * (1 KiB of it the 1024-byte alignment) and the device's opt-in limit, 2 to
 * TMA_MAX_STAGES, the function's attribute set. */
static kiln_status tma_stages(kiln_runtime *rt, kiln__errslot *err, CUfunction fn, unsigned stage, size_t most,
                              uint32_t *stages, unsigned *smem)
{
    const size_t fit = most > 1024 ? (most - 1024) / stage : 0;
    const CUresult r =
        kiln__tma_fit_stages(rt, fn, stage, fit < TMA_MAX_STAGES ? (uint32_t)fit : TMA_MAX_STAGES, stages, smem);
    if (r != CUDA_SUCCESS)
        return kiln__fail(err, KILN_ERR_CUDA_DRIVER, OP ": the TMA products cannot have %u bytes of shared memory (CUresult %d)",
                          *smem, (int)r);
    return KILN_OK;
}

/* The shared memory of the two TMA products. Where a block of each fits one
 * SM together, gate_up takes about TMA_GATE_UP_SHARE bytes of stages and
 * down the rest, so that down's blocks, launched while gate_up runs, stream
 * their first stages of weight beside it (bench_moe at 1 and 2 tokens);
 * otherwise each takes all it can. */
static kiln_status tma_shared(kiln_runtime *rt, kiln__errslot *err, tma_launch *l, unsigned gu_warps,
                              unsigned dn_warps)
{
    const unsigned gu_stage = (2u * gu_warps + 1u) * 1024u, dn_stage = (2u * dn_warps + 1u) * 1024u;
    size_t gu_most = SIZE_MAX, dn_most = SIZE_MAX;
    const size_t both = kiln__function_pair_shared_bytes(rt, l->gate_up, l->gu_threads, l->down, l->dn_threads);
    size_t gu_stages = TMA_GATE_UP_SHARE / gu_stage;
    gu_stages = gu_stages < 2 ? 2 : gu_stages > TMA_MAX_STAGES ? TMA_MAX_STAGES : gu_stages;
    const size_t gu_want = gu_stages * gu_stage + 1024u;
    if (both >= gu_want + 2u * dn_stage + 1024u) {
        gu_most = gu_want;
        dn_most = both - gu_want;
    }
    kiln_status st = tma_stages(rt, err, l->gate_up, gu_stage, gu_most, &l->gu_stages, &l->gu_smem);
    return st ? st : tma_stages(rt, err, l->down, dn_stage, dn_most, &l->dn_stages, &l->dn_smem);
}

typedef struct experts_launch {
    /* The wgmma products' maps of the experts' weights and of h as down's A
     * (first: CUtensorMap's alignment; the struct comes from
     * kiln__tma_calloc) and whether they are encoded: their last parameters,
     * past the mma.sync kernels' last. */
    CUtensorMap gu_map, dn_map, h_map;
    uint32_t w_tma;
    kiln_runtime *rt;
    CUfunction count, group, gate_up, down, combine;
    CUdeviceptr x, ids, weights, gate_up_w, down_w, shared, shared_gate, out;
    CUdeviceptr n_tiles, offsets, tile_e, tile_r, sorted, inv, hist, h, y;
    uint32_t tokens, pairs, rows, max_tiles, slices, smem, gu_cols, down_cols, gemm_threads;
} experts_launch;

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    experts_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    void *na[] = {&l->ids, &l->pairs, &l->hist, &fault};
    void *ga[] = {&l->ids,    &l->pairs,  &l->rows,   &l->hist, &l->n_tiles, &l->offsets,
                  &l->tile_e, &l->tile_r, &l->sorted, &l->inv,  &fault};
    void *ua[] = {&l->x,      &l->gate_up_w, &l->h,      &l->n_tiles, &l->offsets,
                  &l->tile_e, &l->tile_r,    &l->sorted, &l->gu_map,  &l->w_tma};
    void *da[] = {&l->h,      &l->down_w, &l->y,      &l->n_tiles, &l->offsets,
                  &l->tile_e, &l->tile_r, &l->sorted, &l->dn_map,  &l->w_tma, &l->h_map};
    void *ca[] = {&l->y, &l->inv, &l->weights, &l->x, &l->shared, &l->shared_gate, &l->out};
    const unsigned slices[3] = {l->slices, 1, 1}, gu[3] = {l->gu_cols, l->max_tiles, 1},
                   dn[3] = {l->down_cols, l->max_tiles, 1}, cb[3] = {l->tokens, 1, 1};
    kiln_status st;
    if ((l->slices > 1 &&
         (st = kiln__launch_ex(ctx, l->rt, l->count, slices, GROUP_THREADS, 0, na, KILN__LAUNCH_PDL))) ||
        (st = kiln__launch_ex(ctx, l->rt, l->group, slices, GROUP_THREADS, 0, ga, KILN__LAUNCH_PDL)) ||
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

static CUdeviceptr ptr(const kiln_tensor *t);

/* The decode step on sm_90: the two TMA products (moe_experts_tma.cu) with
 * a grid of the SM count, then moe_experts.cu's combine. */
static kiln_status encode_tma(kiln_jit *jit, kiln_runtime *rt, kiln__errslot *err, const kiln_moe_experts_desc *d,
                              kiln_dtype elt, size_t bytes[N_BINDINGS], kiln_command **cmd)
{
    const int64_t T = d->x->dims[0], H = d->x->dims[1], K = d->ids->dims[1], E = d->gate_up->dims[0],
                  I = d->gate_up->dims[1] / 2;
    const uint64_t P = (uint64_t)(T * K), touched = (uint64_t)E < P ? (uint64_t)E : P;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    ws_layout w;
    layout(P, (uint64_t)H, (uint64_t)I, (uint64_t)E, SMALL.rows, &w);
    size_t need;
    kiln_status st;
    const kiln_tensor *t[N_BINDINGS] = {d->x, d->ids, d->weights, d->gate_up, d->down, d->shared, d->shared_gate, d->out};
    if ((st = kiln_op_moe_experts_workspace(T, H, I, E, K, &need)))
        return kiln__propagate(err, st);
    if ((st = kiln__check_workspace(err, OP, d->workspace, rt, need, t, bytes, names, N_BINDINGS)))
        return st;
    kiln_spec spec;
    kiln_kernel *k, *kt;
    tma_launch *l = kiln__tma_calloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    const CUdeviceptr ws = kiln__buffer_ptr(d->workspace->buffer) + d->workspace->start;
    l->rt = rt;
    l->ids = ptr(d->ids);
    l->weights = ptr(d->weights);
    l->x = ptr(d->x);
    l->shared = ptr(d->shared);
    l->shared_gate = ptr(d->shared_gate);
    l->out = ptr(d->out);
    l->h = ws + w.h;
    l->y = ws + w.y;
    l->inv = ws + w.inv;
    l->tokens = (uint32_t)T;
    l->pairs = (uint32_t)P;
    l->grid = (unsigned)info.multiprocessors;
    void *fu, *fd;
    if ((st = kiln_op_moe_experts_spec(elt, H, I, E, K, &spec)) || (st = kiln_jit_acquire(jit, &spec, &k)) ||
        (st = spec_of(TMA_TEMPLATE, elt, H, I, E, K, &spec)) || (st = kiln_jit_acquire(jit, &spec, &kt)) ||
        (st = function(rt, err, k, "kiln_moe_combine", 0, &l->combine)) ||
        (st = kiln_kernel_function(kt, "kiln_moe_gate_up_t", &fu)) ||
        (st = kiln_kernel_function(kt, "kiln_moe_down_t", &fd))) {
        free(l);
        return kiln__propagate(err, st);
    }
    l->gate_up = (CUfunction)fu;
    l->down = (CUfunction)fd;
    /* A stage: a warp's 8 gate and 8 up rows of gate_up (2 KiB) and x's box
     * (1 KiB); a warp's 16 rows of down (2 KiB) and h's 8 (1 KiB). */
    const unsigned gu_warps = tma_warps(touched, (uint64_t)(I / 8), l->grid),
                   dn_warps = tma_warps(touched, (uint64_t)(H / 16), l->grid);
    l->gu_threads = 32u * (gu_warps + 1u);
    l->dn_threads = 32u * (dn_warps + 1u);
    if ((st = tma_shared(rt, err, l, gu_warps, dn_warps)) ||
        (st = kiln__tma_map(rt, OP, elt, &l->gate_up_map, ptr(d->gate_up), H, E * 2 * I, 8 * gu_warps)) ||
        (st = kiln__tma_map(rt, OP, elt, &l->x_map, l->x, H, T, 8)) ||
        (st = kiln__tma_map(rt, OP, elt, &l->down_map, ptr(d->down), I, E * H, 16 * dn_warps)) ||
        (st = kiln__tma_map(rt, OP, elt, &l->h_map, l->h, I, (int64_t)(8 * touched), 8))) {
        free(l);
        return kiln__propagate(err, st);
    }
    const uint64_t params[] = {l->x,       l->ids,  l->weights, ptr(d->gate_up), ptr(d->down), l->shared,
                               l->shared_gate, l->out, ws, l->tokens, ((uint64_t)l->gu_stages << 32) | l->dn_stages,
                               ((uint64_t)l->gu_threads << 32) | l->dn_threads};
    kiln_region regions[N_BINDINGS + 1];
    size_t n = 0;
    for (int i = 0; i < N_BINDINGS; i++)
        if (t[i])
            regions[n++] = kiln__tensor_region(t[i], bytes[i]);
    regions[n++] = *d->workspace;
    const kiln__kernel_command_desc cd = {.op = OP, .tokens = (uint32_t)T, .dispatches = 3, .regions = regions,
                                          .n_regions = n, .enqueue = tma_enqueue, .user = l, .kernel = k,
                                          KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &cd, cmd);
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
    if (T <= TMA_TOKENS && P <= tma_pairs() && kiln__arch_number(info.arch) == 90 &&
        tma_serves(kiln__arch_number(info.arch)) && info.multiprocessors > 0)
        return encode_tma(jit, rt, err, &d, elt, bytes, cmd);
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
    experts_launch *l = kiln__tma_calloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    l->smem = tl->smem;
    if ((st = kiln_op_moe_experts_spec(elt, H, I, E, K, &spec)) || (st = kiln_jit_acquire(jit, &spec, &k)) ||
        (wg && ((st = spec_of(WGMMA_TEMPLATE, elt, H, I, E, K, &spec)) ||
                (st = kiln_jit_acquire(jit, &spec, &kw)))) ||
        (st = function(rt, err, k, "kiln_moe_count", 0, &l->count)) ||
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
    l->hist = ws + w.hist;
    l->h = ws + w.h;
    l->y = ws + w.y;
    l->tokens = (uint32_t)T;
    l->pairs = (uint32_t)P;
    l->rows = tl->rows;
    l->max_tiles = w.max_tiles;
    l->slices = w.slices;
    l->gu_cols = (uint32_t)I / tl->cols_gu;
    l->down_cols = (uint32_t)H / tl->cols_down;
    l->gemm_threads = tl->threads;
    /* The wgmma products read the weights by TMA: rows of the inner
     * dimension, boxes of 64 x 128 (gate_up's two halves of a column tile)
     * and 64 x 256 (down's); down reads h, a row a pair in the experts'
     * order, in boxes of 64 x 128 (a row tile). */
    if (wg && (uint64_t)E * (uint64_t)(2 * I) <= INT32_MAX && (uint64_t)E * (uint64_t)H <= INT32_MAX) {
        if ((st = kiln__tma_map(rt, OP, elt, &l->gu_map, l->gate_up_w, H, E * 2 * I, 128)) ||
            (st = kiln__tma_map(rt, OP, elt, &l->dn_map, l->down_w, I, E * H, 256)) ||
            (st = kiln__tma_map(rt, OP, elt, &l->h_map, l->h, I, (int64_t)P, 128))) {
            free(l);
            return kiln__propagate(err, st);
        }
        l->w_tma = 1;
    }
    const uint64_t params[] = {l->x,   l->ids,  l->weights, l->gate_up_w, l->down_w, l->shared, l->shared_gate,
                               l->out, ws,      l->tokens,  l->rows};
    kiln_region regions[N_BINDINGS + 1];
    size_t n = 0;
    for (int i = 0; i < N_BINDINGS; i++)
        if (t[i])
            regions[n++] = kiln__tensor_region(t[i], bytes[i]);
    regions[n++] = *d.workspace;
    const kiln__kernel_command_desc cd = {.op = OP, .tokens = (uint32_t)T,
                                          .dispatches = w.slices > 1 ? 5 : 4, .regions = regions,
                                          .n_regions = n, .enqueue = enqueue, .user = l, .kernel = k,
                                          KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &cd, cmd);
}

kiln_status kiln_op_moe_experts(kiln_jit *jit, const kiln_moe_experts_desc *desc)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_moe_experts_encode(jit, desc, &cmd), &cmd);
}
