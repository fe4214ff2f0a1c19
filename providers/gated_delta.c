/* Gated delta recurrent attention (templates/gated_delta.cu). */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/blas.h" /* kiln__check_workspace */
#include "providers/internal.h"

#define OP "gated_delta"
#define BLOCK_THREADS 128
#define MAX_GRID 0x7fffffffu
#define CHUNK "gated_delta_chunk"
#define CHUNK_THREADS 256
#define CHUNK_MAX_DK 128
#define CHUNK_TOKENS 64
/* A workspace record of the keyed form (templates/gated_delta_chunk.cu's
 * REC_FLOATS floats): γ's two floats, rk and rq (64 each), T's and P's 10
 * blocks of 16 x 16 each (f32, or their hi and lo f16 terms for the rows
 * kernel), P's 64 row scales and their inverses, and beta (split records). */
#define RECORD_BYTES ((4 * CHUNK_TOKENS + 2 * 10 * 256 + 3 * CHUNK_TOKENS) * 4)
/* In bf16 a record then holds the chunk's k and q rows rewritten as f16
 * (REC_KQ, room for DK 128), which the rows kernel reads in their place:
 * the records' stride in the workspace (REC_STRIDE). */
static size_t record_stride(kiln_dtype elt)
{
    return RECORD_BYTES + (elt == KILN_DTYPE_BF16 ? 2u * CHUNK_TOKENS * CHUNK_MAX_DK * 2u : 0u);
}

/* Lanes per row of the state: a power of two giving each lane about 8 columns. */
static int64_t lanes_for(int64_t dk)
{
    int64_t g = 1;
    while (g < 32 && g * 8 < dk)
        g *= 2;
    return g;
}

/* BLOCK_THREADS, or fewer when the head has fewer rows than a block holds. */
static int64_t threads_for(int64_t dk, int64_t dv)
{
    int64_t t = (lanes_for(dk) * dv + 31) / 32 * 32;
    return t < BLOCK_THREADS ? t : BLOCK_THREADS;
}

static int64_t row_blocks(int64_t dk, int64_t dv)
{
    int64_t rows = threads_for(dk, dv) / lanes_for(dk);
    return (dv + rows - 1) / rows;
}

static int sizes_ok(int64_t dk, int64_t dv, int64_t kh, int64_t vh)
{
    return dk >= 1 && dk <= KILN_MODEL_MAX_HEAD_DIM && dv >= 1 && dv <= KILN_MODEL_MAX_HEAD_DIM && kh >= 1 &&
           kh <= KILN_MODEL_MAX_HEADS && vh >= 1 && vh <= KILN_MODEL_MAX_HEADS && vh % kh == 0;
}

kiln_status kiln_op_gated_delta_spec(kiln_dtype elt, int64_t dk, int64_t dv, int64_t kh, int64_t vh, int vec,
                                     kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (!sizes_ok(dk, dv, kh, vh) || (vec != 1 && vec != 4) || dk % vec)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": dk %lld, dv %lld (1..%d), key heads %lld, value heads %lld (1..%d, key heads "
                          "dividing value heads), vector width %d (1, or 4 dividing dk)",
                          (long long)dk, (long long)dv, KILN_MODEL_MAX_HEAD_DIM, (long long)kh, (long long)vh,
                          KILN_MODEL_MAX_HEADS, vec);
    kiln_status st;
    if ((st = kiln_spec_init(out, OP)) || (st = kiln__spec_set_elt(out, OP, elt)) ||
        (st = kiln_spec_set(out, "DK", dk)) || (st = kiln_spec_set(out, "DV", dv)) ||
        (st = kiln_spec_set(out, "KH", kh)) || (st = kiln_spec_set(out, "VH", vh)) ||
        (st = kiln_spec_set(out, "G", lanes_for(dk))) || (st = kiln_spec_set(out, "VEC", vec)) ||
        (st = kiln_spec_set(out, "THREADS", threads_for(dk, dv))))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_gated_delta_state_bytes(int64_t seqs, int64_t vh, int64_t dv, int64_t dk, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    size_t n;
    if (seqs < 1 || vh < 1 || vh > KILN_MODEL_MAX_HEADS || dv < 1 || dv > KILN_MODEL_MAX_HEAD_DIM || dk < 1 ||
        dk > KILN_MODEL_MAX_HEAD_DIM || kiln__mul_overflows((size_t)seqs, (size_t)vh * (size_t)dv * (size_t)dk * 4, &n))
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": a state of %lld sequences x %lld value heads x %lld x %lld is out of range",
                          (long long)seqs, (long long)vh, (long long)dv, (long long)dk);
    *bytes = n;
    return KILN_OK;
}

/* The keyed form's records a value head: ceil(tokens / 64) + seqs. Each
 * record has a 4-byte flag after all of them (the streamed pre-pass's). */
static uint64_t records_for(int64_t tokens, int64_t seqs)
{
    return ((uint64_t)tokens + CHUNK_TOKENS - 1) / CHUNK_TOKENS + (uint64_t)seqs;
}

kiln_status kiln_op_gated_delta_workspace(kiln_dtype elt, int64_t tokens, int64_t seqs, int64_t vh, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    if (elt != KILN_DTYPE_F16 && elt != KILN_DTYPE_BF16)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": a workspace for element type %s (f16 or bf16)",
                          kiln_dtype_name(elt));
    size_t n;
    if (tokens < 0 || tokens > (int64_t)UINT32_MAX || seqs < 1 || seqs > (int64_t)MAX_GRID || vh < 1 ||
        vh > KILN_MODEL_MAX_HEADS ||
        kiln__mul_overflows((size_t)records_for(tokens, seqs), (size_t)vh * (record_stride(elt) + 4), &n))
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": a workspace for %lld tokens (0..%u), %lld sequences (1..%u) and %lld value heads "
                          "(1..%d) is out of range",
                          (long long)tokens, UINT32_MAX, (long long)seqs, MAX_GRID, (long long)vh,
                          KILN_MODEL_MAX_HEADS);
    *bytes = n;
    return KILN_OK;
}

/* The chunked kernels' dynamic shared memory: sizeof(chunk_smem) of
 * templates/gated_delta_chunk.cu, member by member (every member a multiple
 * of 16 bytes, so there is no padding): k, q, v in two stages, g and beta,
 * the state's hi and lo terms, R (f32), the union of A and T with U and U',
 * T's partial sums, γ (two floats), rk and rq in two stages, the maxima and
 * scales of the columns of U' and R and the rows of S, and 16 words of
 * sums. */
static unsigned chunk_smem(int64_t dk, int64_t rows)
{
    const uint64_t C = CHUNK_TOKENS, ldk = (uint64_t)(dk + 15) / 16 * 16 + 8, ldv = (uint64_t)rows + 8, ldf = C + 4;
    const uint64_t at = 2 * C * ldf * 4, u = 4 * C * ldv * 2;
    return (unsigned)(2 * (2 * C * ldk * 2) + 2 * C * ldv * 2 + 2 * 2 * C * 4 + 2 * (uint64_t)rows * ldk * 2 +
                      C * ((uint64_t)rows + 4) * 4 + (at > u ? at : u) + 3 * 16 * 16 * 4 + 2 * 4 * C * 4 +
                      15 * (uint64_t)rows * 4 + 16 * 4);
}

/* The rows kernel's: sizeof(rows_smem), two stages of k, q, v and a
 * record, then its warps' output tiles (a warp to 16 rows, 64 x 24 elements)
 * and 16 words. */
static unsigned rows_smem(int64_t dk, int64_t rows)
{
    const uint64_t C = CHUNK_TOKENS, ldk = (uint64_t)(dk + 15) / 16 * 16 + 8, ldv = (uint64_t)rows + 8;
    return (unsigned)(2 * (2 * C * ldk * 2 + C * ldv * 2 + RECORD_BYTES) + rows / 16 * C * 24 * 2 +
                      16 * 4);
}

/* The rows kernel's threads: a warp to 16 rows, and streamed one that
 * loads the records. */
static unsigned rows_threads(int rows, int streamed)
{
    return 32u * ((unsigned)rows / 16u + (streamed ? 1u : 0u));
}

/* The pre-pass's: sizeof(keys_smem), one stage of k, q, g and beta, A and
 * T, T's partial sums, one stage of γ, rk and rq, and the sums. */
static unsigned keys_smem(int64_t dk)
{
    const uint64_t C = CHUNK_TOKENS, ldk = (uint64_t)(dk + 15) / 16 * 16 + 8, ldf = C + 4;
    return (unsigned)(2 * C * ldk * 2 + 2 * C * 4 + 2 * C * ldf * 4 + 3 * 16 * 16 * 4 + 4 * C * 4 + 16 * 4);
}

/* The opt-in shared memory a block may have on sm, in KiB (0: unknown arch). */
static unsigned optin_kib(int sm)
{
    if (sm == 80 || sm == 87)
        return 163;
    if (sm == 86 || sm == 89 || sm >= 120)
        return 99;
    if (sm >= 90)
        return 227;
    return 0;
}

kiln_status kiln_op_gated_delta_chunk_spec(kiln_dtype elt, int64_t dk, int64_t dv, int64_t kh, int64_t vh, int rows,
                                           int vec, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, CHUNK ": out is NULL");
    if (!sizes_ok(dk, dv, kh, vh) || dk > CHUNK_MAX_DK || (rows != 32 && rows != 64) || (vec != 1 && vec != 8) ||
        (vec == 8 && (dk % 8 || dv % 8)))
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          CHUNK ": dk %lld (1..%d), dv %lld (1..%d), key heads %lld, value heads %lld (1..%d, key "
                          "heads dividing value heads), rows %d (32 or 64), vector width %d (1, or 8 dividing dk and "
                          "dv)",
                          (long long)dk, CHUNK_MAX_DK, (long long)dv, KILN_MODEL_MAX_HEAD_DIM, (long long)kh,
                          (long long)vh, KILN_MODEL_MAX_HEADS, rows, vec);
    kiln_status st;
    if ((st = kiln_spec_init(out, CHUNK)) || (st = kiln__spec_set_elt(out, CHUNK, elt)) ||
        (st = kiln_spec_set(out, "DK", dk)) || (st = kiln_spec_set(out, "DV", dv)) ||
        (st = kiln_spec_set(out, "KH", kh)) || (st = kiln_spec_set(out, "VH", vh)) ||
        (st = kiln_spec_set(out, "ROWS", rows)) || (st = kiln_spec_set(out, "VEC", vec)))
        return st;
    return KILN_OK;
}

/* The f16 terms the chunked kernels' f32 operands (the state, R, T, U and
 * the scores) take in the chain's products: 1 (f16 operands, f32
 * accumulators and state, as fla's kernels take their input type, at
 * fla's accuracy), or 2 where $KILN_GATED_DELTA_TERMS is 2 (hi and lo,
 * about 22 bits, for about twice the tensor-core work: bench_recurrent
 * times both, test_recurrent_gpu bounds both). Prewarm lists what the
 * encode takes. */
static int chunk_terms(void)
{
    const char *env = getenv("KILN_GATED_DELTA_TERMS");
    return env && !strcmp(env, "2") ? 2 : 1;
}

/* kiln_op_gated_delta_chunk_spec's spec (one term, the template's default),
 * with the constant TERMS 2 for two. */
static kiln_status chunk_spec(kiln_dtype elt, int64_t dk, int64_t dv, int64_t kh, int64_t vh, int rows, int vec,
                              int terms, kiln_spec *out)
{
    kiln_status st = kiln_op_gated_delta_chunk_spec(elt, dk, dv, kh, vh, rows, vec, out);
    if (!st && terms == 2)
        st = kiln_spec_set(out, "TERMS", 2);
    return st;
}

/* A Qwen3-Next model's linear-attention layers, when its config has them:
 * the scan, and the chunked kernel's row counts that the encode may take on
 * arch (NULL or unreadable: both; none before sm_80 or where a block cannot
 * have its shared memory). */
kiln_status kiln__gated_delta_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                         void *user)
{
    if (!cfg->linear_num_key_heads)
        return KILN_OK;
    const int64_t dk = cfg->linear_key_head_dim, dv = cfg->linear_value_head_dim, kh = cfg->linear_num_key_heads,
                  vh = cfg->linear_num_value_heads;
    kiln_spec spec;
    kiln_status st = kiln_op_gated_delta_spec(cfg->dtype, dk, dv, kh, vh, dk % 4 ? 1 : 4, &spec);
    if (st || (st = sink(user, &spec)))
        return st;
    if (dk > CHUNK_MAX_DK)
        return KILN_OK;
    const int sm = kiln__arch_number(arch);
    if (sm && sm < 80)
        return KILN_OK;
    const int vec = dk % 8 || dv % 8 ? 1 : 8;
    static const int rows[2] = {64, 32};
    for (int i = 0; i < 2; i++) {
        if (sm && chunk_smem(dk, rows[i]) > optin_kib(sm) * 1024u)
            continue;
        if ((st = chunk_spec(cfg->dtype, dk, dv, kh, vh, rows[i], vec, chunk_terms(), &spec)) ||
            (st = sink(user, &spec)))
            return st;
    }
    return KILN_OK;
}

enum { B_Q, B_K, B_V, B_G, B_BETA, B_STATE, B_SPANS, B_OUT, N_BINDINGS };
static const char *const names[N_BINDINGS] = {"q", "k", "v", "g", "beta", "state", "spans", "out"};

static void views(const kiln_gated_delta_bindings *b, const kiln_tensor *t[N_BINDINGS])
{
    t[B_Q] = b->q;
    t[B_K] = b->k;
    t[B_V] = b->v;
    t[B_G] = b->g;
    t[B_BETA] = b->beta;
    t[B_STATE] = b->state;
    t[B_SPANS] = b->spans;
    t[B_OUT] = b->out;
}

kiln_status kiln__gated_delta_check(kiln_runtime *rt, const kiln_gated_delta_bindings *b, size_t bytes[8], int *vec)
{
    kiln__errslot *err = kiln__runtime_errslot(rt);
    kiln_gated_delta_bindings local;
    kiln_status st = kiln__copy_bindings(err, OP, "bindings", "kiln_gated_delta_bindings", &local, sizeof local,
                                         offsetof(kiln_gated_delta_bindings, max_span_tokens), b);
    if (st)
        return st;
    const kiln_tensor *t[N_BINDINGS];
    views(&local, t);
    /* q sets the element type; k, v and out must match it. */
    kiln_dtype elt;
    if ((st = kiln__check_elt(err, OP, "q", t[B_Q], rt, &elt)) ||
        (st = kiln__check_tensor(err, OP, "q", t[B_Q], rt, elt, 3, NULL, &bytes[B_Q])))
        return st;
    const int64_t T = t[B_Q]->dims[0], KH = t[B_Q]->dims[1], DK = t[B_Q]->dims[2];
    const int64_t want_k[3] = {T, KH, DK}, want_v[3] = {T, -1, -1};
    if ((st = kiln__check_tensor(err, OP, "k", t[B_K], rt, elt, 3, want_k, &bytes[B_K])) ||
        (st = kiln__check_tensor(err, OP, "v", t[B_V], rt, elt, 3, want_v, &bytes[B_V])))
        return st;
    const int64_t VH = t[B_V]->dims[1], DV = t[B_V]->dims[2];
    if (DK > KILN_MODEL_MAX_HEAD_DIM || DV > KILN_MODEL_MAX_HEAD_DIM)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": head dims dk %lld (q) and dv %lld (v): at most %d",
                          (long long)DK, (long long)DV, KILN_MODEL_MAX_HEAD_DIM);
    if (KH > KILN_MODEL_MAX_HEADS || VH > KILN_MODEL_MAX_HEADS || VH % KH)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": %lld key heads (q) and %lld value heads (v): at most %d, and key heads must divide "
                          "value heads",
                          (long long)KH, (long long)VH, KILN_MODEL_MAX_HEADS);
    const int64_t want_gb[2] = {T, VH}, want_spans[2] = {-1, 2};
    if ((st = kiln__check_tensor(err, OP, "g", t[B_G], rt, KILN_DTYPE_F32, 2, want_gb, &bytes[B_G])) ||
        (st = kiln__check_tensor(err, OP, "beta", t[B_BETA], rt, KILN_DTYPE_F32, 2, want_gb, &bytes[B_BETA])) ||
        (st = kiln__check_tensor(err, OP, "spans", t[B_SPANS], rt, KILN_DTYPE_U32, 2, want_spans, &bytes[B_SPANS])))
        return st;
    const int64_t S = t[B_SPANS]->dims[0];
    const int64_t want_state[4] = {S, VH, DV, DK}, want_out[3] = {T, VH, DV};
    if ((st = kiln__check_tensor(err, OP, "state", t[B_STATE], rt, KILN_DTYPE_F32, 4, want_state,
                                 &bytes[B_STATE])) ||
        (st = kiln__check_tensor(err, OP, "out", t[B_OUT], rt, elt, 3, want_out, &bytes[B_OUT])))
        return st;
    if (T > (int64_t)UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding q has %lld tokens; at most %u", (long long)T,
                          UINT32_MAX);
    if ((uint64_t)S * (uint64_t)VH * (uint64_t)row_blocks(DK, DV) > MAX_GRID)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": %lld sequences x %lld value heads x %lld row blocks exceed one launch's %u blocks",
                          (long long)S, (long long)VH, (long long)row_blocks(DK, DV), MAX_GRID);
    /* What is written (state, out) overlaps nothing else. */
    static const int written[2] = {B_STATE, B_OUT};
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < N_BINDINGS; i++)
            if (i != written[w] && kiln__tensors_overlap(t[written[w]], bytes[written[w]], t[i], bytes[i]))
                return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": %s overlaps %s", names[written[w]], names[i]);
    /* The workspace: checked whenever given, whichever kernel the encode takes. */
    if (local.workspace) {
        size_t need;
        if ((st = kiln_op_gated_delta_workspace(t[B_Q]->dtype, T, S, VH, &need)))
            return kiln__propagate(err, st);
        if ((st = kiln__check_workspace(err, OP, local.workspace, rt, need, t, bytes, names, N_BINDINGS)))
            return st;
    }
    const uint64_t qp = kiln__buffer_ptr(t[B_Q]->buffer) + t[B_Q]->offset,
                   kp = kiln__buffer_ptr(t[B_K]->buffer) + t[B_K]->offset,
                   sp = kiln__buffer_ptr(t[B_STATE]->buffer) + t[B_STATE]->offset;
    *vec = (DK % 4 == 0 && qp % 8 == 0 && kp % 8 == 0 && sp % 16 == 0) ? 4 : 1;
    return KILN_OK;
}

typedef struct delta_launch {
    kiln_runtime *rt;
    CUfunction fn, keys; /* keys: the pre-pass, or NULL (the single kernel or the scan) */
    CUdeviceptr ptr[N_BINDINGS], ws, flags; /* flags: the streamed form's, or 0 */
    uint32_t tokens, grid, seqs, records, vh, split; /* split: the pre-pass writes the rows kernel's records */
    unsigned threads, smem, keys_smem, keys_grid; /* keys_grid: the streamed pre-pass's blocks */
} delta_launch;

enum { LAST_NONE, LAST_SCAN, LAST_CHUNK32, LAST_CHUNK64 };
/* last_keyed: 0 the single kernel, 1 the keyed kernel, 2 the rows kernel (both after the pre-pass). */
static _Thread_local int last_kernel = LAST_NONE, last_keyed = -1, last_terms = 0, last_streamed = 0;

int kiln__gated_delta_last_rows(void)
{
    return last_kernel == LAST_CHUNK64 ? 64 : last_kernel == LAST_CHUNK32 ? 32 : last_kernel == LAST_SCAN ? 0 : -1;
}

int kiln__gated_delta_last_keyed(void) { return last_keyed; }

int kiln__gated_delta_last_terms(void) { return last_terms; }

int kiln__gated_delta_last_streamed(void) { return last_streamed; }

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    delta_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    kiln_status st;
    if (l->keys) {
        void *ka[] = {&l->ptr[B_Q], &l->ptr[B_K], &l->ptr[B_G], &l->ptr[B_BETA], &l->ptr[B_SPANS],
                      &l->ws,       &l->tokens,   &l->seqs,   &l->split,  &l->flags};
        const unsigned grid[3] = {l->flags ? l->keys_grid : l->records, l->flags ? 1 : l->vh, 1};
        if ((st = kiln__launch_ex(ctx, l->rt, l->keys, grid, CHUNK_THREADS, l->keys_smem, ka, KILN__LAUNCH_PDL)))
            return st;
        /* The flags are the rows kernel's last argument (the keyed kernel has one fewer). */
        void *args[] = {&l->ptr[B_Q],     &l->ptr[B_K],   &l->ptr[B_V], &l->ptr[B_G], &l->ptr[B_BETA],
                        &l->ptr[B_STATE], &l->ptr[B_SPANS], &l->ptr[B_OUT], &l->tokens, &fault,
                        &l->ws,           &l->records,    &l->flags};
        return kiln__launch(ctx, l->rt, l->fn, l->grid, l->threads, l->smem, args);
    }
    void *args[] = {&l->ptr[B_Q],     &l->ptr[B_K],     &l->ptr[B_V],   &l->ptr[B_G], &l->ptr[B_BETA],
                    &l->ptr[B_STATE], &l->ptr[B_SPANS], &l->ptr[B_OUT], &l->tokens,   &fault};
    return kiln__launch(ctx, l->rt, l->fn, l->grid, l->threads, l->smem, args);
}

/* The span length the kernel choices go by: max_span, or T / S rounded up. */
static uint64_t span_hint(const kiln_tensor *const t[N_BINDINGS], uint32_t max_span)
{
    const uint64_t T = (uint64_t)t[B_Q]->dims[0], S = (uint64_t)t[B_SPANS]->dims[0];
    return max_span ? max_span : (T + S - 1) / S;
}

/* The waves over the device's SMs of a chunked launch of heads (sequence,
 * value head) pairs at rows of the value dim dv a block. */
static uint64_t waves(const kiln_runtime_info *info, uint64_t heads, int64_t dv, int rows)
{
    const uint64_t sms = info->multiprocessors > 0 ? (uint64_t)info->multiprocessors : 1;
    return (heads * (uint64_t)((dv + rows - 1) / rows) + sms - 1) / sms;
}

/* Whether the chunked kernel serves these bindings (see kiln/op_recurrent.h),
 * and then its rows a block and vector width. Rows: the fewer waves of
 * blocks over the SMs, a wave of 64-row blocks counted as 1.4 of 32-row ones
 * (the products with k and q and T do not shrink with the rows); 32 where
 * the value dim fits in 32 or the device has no room for 64. */
static int chunk_plan(kiln_runtime *rt, const kiln_tensor *const t[N_BINDINGS], uint32_t max_span, int *rows,
                      int *vec)
{
    const char *env = getenv("KILN_GATED_DELTA_CHUNK");
    if (env && !strcmp(env, "0"))
        return 0;
    const int forced = env && !strcmp(env, "32") ? 32 : env && !strcmp(env, "64") ? 64 : 0;
    const int64_t DK = t[B_Q]->dims[2], VH = t[B_V]->dims[1], DV = t[B_V]->dims[2], S = t[B_SPANS]->dims[0];
    if (DK > CHUNK_MAX_DK || span_hint(t, max_span) < KILN_GATED_DELTA_CHUNK_MIN_TOKENS)
        return 0;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    const int sm = kiln__arch_number(info.arch);
    if (sm < 80)
        return 0;
    const uint64_t heads = (uint64_t)S * (uint64_t)VH, waves64 = waves(&info, heads, DV, 64),
                   waves32 = waves(&info, heads, DV, 32);
    *rows = DV > 32 && chunk_smem(DK, 64) <= optin_kib(sm) * 1024u && waves64 * 7 <= waves32 * 5 ? 64 : 32;
    if (forced)
        *rows = forced;
    if (chunk_smem(DK, *rows) > optin_kib(sm) * 1024u || heads * (uint64_t)((DV + *rows - 1) / *rows) > MAX_GRID)
        return 0;
    uint64_t align = 0;
    for (int i = B_Q; i <= B_V; i++)
        align |= kiln__buffer_ptr(t[i]->buffer) + t[i]->offset;
    const uint64_t sp = kiln__buffer_ptr(t[B_STATE]->buffer) + t[B_STATE]->offset;
    *vec = DK % 8 == 0 && DV % 8 == 0 && align % 16 == 0 && sp % 8 == 0 ? 8 : 1;
    return 1;
}

/* Whether the keyed form (the pre-pass into the workspace, then the keyed
 * chunked kernel) serves a chunked launch: a workspace bound, the
 * pre-pass's grid within a launch, and $KILN_GATED_DELTA_PREP (0: never; 1:
 * always), else spans (span_hint) as long as KILN_GATED_DELTA_PREP_MIN_TOKENS. */
static int keyed_plan(const kiln_tensor *const t[N_BINDINGS], const kiln_region *ws, uint32_t max_span)
{
    const int64_t T = t[B_Q]->dims[0], S = t[B_SPANS]->dims[0];
    if (!ws || records_for(T, S) > MAX_GRID)
        return 0;
    const char *env = getenv("KILN_GATED_DELTA_PREP");
    if (env && (!strcmp(env, "0") || !strcmp(env, "1")))
        return env[0] == '1';
    return span_hint(t, max_span) >= KILN_GATED_DELTA_PREP_MIN_TOKENS;
}

/* Whether a keyed launch takes the rows kernel (a warp to 16 rows of S, no
 * barrier of the block within a chunk) rather than the keyed kernel. It
 * needs vectors of 8, out 16-byte aligned and the shared memory. $KILN_GATED_DELTA_ROWS=0
 * never takes it, 1 always. By default, in one term or bf16, it serves
 * wherever it can: its chain of halved products beat the keyed kernel's at
 * every shape (bench_recurrent: 1 x 16384 0.83x, 4 x 1024 0.7x; in bf16,
 * reading k and q as the pre-pass rewrote them, 0.68x in one term and 0.88x
 * in two at 1 x 4096, where the keyed kernel's eight warps rewrite them on
 * its chain). In f16 and two terms it serves only where the keyed
 * kernel's blocks at its own rows (chunk_rows: 64, or 32 with DV <= 32)
 * need more than one wave over the SMs: a warp a scheduler leaves it
 * latency-bound, ahead of the keyed kernel's second wave but behind its
 * one (4 x 1024 and 16 x 256 against 1 x 4096 and 1 x 16384).
 * It runs at chunk_rows (what $KILN_GATED_DELTA_CHUNK forces), the spec
 * prewarm lists, since both kernels are entries of one cubin. */
static int rows_plan(kiln_runtime *rt, const kiln_tensor *const t[N_BINDINGS], int vec, int chunk_rows, int terms)
{
    const char *env = getenv("KILN_GATED_DELTA_ROWS");
    if ((env && !strcmp(env, "0")) || vec != 8 || (kiln__buffer_ptr(t[B_OUT]->buffer) + t[B_OUT]->offset) % 16)
        return 0;
    const int64_t DK = t[B_Q]->dims[2], VH = t[B_V]->dims[1], DV = t[B_V]->dims[2], S = t[B_SPANS]->dims[0];
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    const uint64_t heads = (uint64_t)S * (uint64_t)VH;
    const int always = (env && !strcmp(env, "1")) || terms == 1 || t[B_Q]->dtype == KILN_DTYPE_BF16;
    if (!always && (waves(&info, heads, DV, chunk_rows) <= 1 || (chunk_rows != 64 && DV > 32)))
        return 0;
    return rows_smem(DK, chunk_rows) <= optin_kib(kiln__arch_number(info.arch)) * 1024u;
}

/* The pre-pass's blocks (at most one an SM, never more than its items)
 * where the rows kernel (rows, its function, threads and shared memory)
 * runs streamed beside it (keys, ksmem), else 0: each of its blocks waits
 * on its records' flags rather than on the whole pre-pass, which deals its
 * records round one block an SM, so the chain starts once its first records
 * are in. It needs programmatic dependent launch, the rows kernel's grid
 * within the SMs and a block of each fitting one SM together (else a
 * block of the chain could start only as the pre-pass ends); one long
 * sequence, where the pre-pass is time the chain's blocks would spend
 * waiting (bench_recurrent). $KILN_GATED_DELTA_STREAM=0: never. */
static unsigned stream_plan(kiln_runtime *rt, CUfunction rows, unsigned threads, unsigned smem, unsigned grid,
                            CUfunction keys, unsigned ksmem, uint64_t items)
{
    const char *env = getenv("KILN_GATED_DELTA_STREAM");
    if ((env && !strcmp(env, "0")) || !kiln__runtime_pdl(rt))
        return 0;
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    if (info.multiprocessors <= 0 || grid > (unsigned)info.multiprocessors ||
        kiln__function_pair_shared_bytes(rt, keys, CHUNK_THREADS, rows, threads) < (size_t)ksmem + smem)
        return 0;
    return (unsigned)(items < (uint64_t)info.multiprocessors ? items : (uint64_t)info.multiprocessors);
}

/* Raises fn's dynamic shared memory limit to smem (and, with carveout, asks
 * for the largest shared memory carveout); *fits = 0 (and KILN_OK) where
 * the device refuses the limit. */
static kiln_status chunk_setup(kiln_runtime *rt, CUfunction fn, unsigned smem, int carveout, int *fits)
{
    kiln_status st = kiln__runtime_enter(rt);
    if (st)
        return st;
    CUresult r = kiln__function_set_attribute(rt, fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem);
    *fits = r == CUDA_SUCCESS;
    /* A hint, for the pre-pass: its blocks (256 threads, 80 registers) fit
     * three an SM where the driver's own carveout left room for two (ncu of
     * bench_recurrent --only 1,16384: 288 -> 243 us). The rows kernel ran
     * 15% slower with it, so the chunked kernels keep the driver's. */
    if (r == CUDA_SUCCESS && carveout)
        (void)kiln__function_set_attribute(rt, fn, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100);
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_INVALID_VALUE)
        return KILN_OK;
    return kiln__runtime_cu_fail(rt, r, "cuFuncSetAttribute (gated_delta_chunk shared memory)");
}

kiln_status kiln_op_gated_delta_encode(kiln_jit *jit, const kiln_gated_delta_bindings *b, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    size_t bytes[N_BINDINGS];
    int vec;
    kiln_status st;
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) || (st = kiln__gated_delta_check(rt, b, bytes, &vec)))
        return st;
    kiln_gated_delta_bindings local; /* checked: its size is 0 or at least the first layout's */
    (void)KILN__COPY_SIZED(local, b);
    const kiln_tensor *t[N_BINDINGS];
    views(&local, t);
    const int64_t T = t[B_Q]->dims[0], KH = t[B_Q]->dims[1], DK = t[B_Q]->dims[2], VH = t[B_V]->dims[1],
                  DV = t[B_V]->dims[2], S = t[B_SPANS]->dims[0];
    const kiln_dtype elt = t[B_Q]->dtype; /* checked: f16 or bf16, and k, v, out the same */
    kiln_spec spec;
    kiln_kernel *k = NULL;
    void *fn = NULL, *keys = NULL;
    int rows = 0, cvec = 1, fits = 0, by_rows = 0, terms = 0;
    unsigned smem = 0, ksmem = 0;
    if (chunk_plan(rt, t, local.max_span_tokens, &rows, &cvec)) {
        terms = chunk_terms();
        const int keyed = keyed_plan(t, local.workspace, local.max_span_tokens);
        by_rows = keyed && rows_plan(rt, t, cvec, rows, terms);
        if ((st = chunk_spec(elt, DK, DV, KH, VH, rows, cvec, terms, &spec)) ||
            (st = kiln_jit_acquire(jit, &spec, &k)))
            return kiln__propagate(err, st);
        if (keyed) {
            int kfits = 0;
            ksmem = keys_smem(DK);
            if ((st = kiln_kernel_function(k, "kiln_gated_delta_keys", &keys)) ||
                (st = chunk_setup(rt, (CUfunction)keys, ksmem, 1, &kfits)))
                return kiln__propagate(err, st);
            if (!kfits)
                keys = NULL;
        }
        by_rows = by_rows && keys != NULL; /* without the pre-pass: the single kernel */
        smem = by_rows ? rows_smem(DK, rows) : chunk_smem(DK, rows);
        const char *entry = by_rows ? "kiln_gated_delta_rows"
                            : keys  ? "kiln_gated_delta_chunk_keyed"
                                    : "kiln_gated_delta_chunk";
        if ((st = kiln_kernel_function(k, entry, &fn)) || (st = chunk_setup(rt, (CUfunction)fn, smem, 0, &fits)))
            return kiln__propagate(err, st);
    }
    if (!fits) { /* the scan */
        rows = 0;
        smem = 0;
        keys = NULL;
        by_rows = 0;
        terms = 0;
        if ((st = kiln_op_gated_delta_spec(elt, DK, DV, KH, VH, vec, &spec)) ||
            (st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, NULL, &fn)))
            return kiln__propagate(err, st);
    }
    delta_launch *l = malloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    l->rt = rt;
    l->fn = (CUfunction)fn;
    l->keys = (CUfunction)keys;
    l->tokens = (uint32_t)T;
    l->smem = smem;
    l->keys_smem = ksmem;
    l->seqs = (uint32_t)S;
    l->vh = (uint32_t)VH;
    l->records = keys ? (uint32_t)records_for(T, S) : 0; /* keyed_plan: within MAX_GRID */
    l->split = (uint32_t)by_rows;
    l->ws = local.workspace ? kiln__buffer_ptr(local.workspace->buffer) + local.workspace->start : 0;
    l->flags = 0;
    l->keys_grid = 0;
    if (rows) {
        l->grid = (uint32_t)((uint64_t)S * (uint64_t)VH * (uint64_t)((DV + rows - 1) / rows));
        l->threads = by_rows ? rows_threads(rows, 0) : CHUNK_THREADS;
        const uint64_t items = (uint64_t)l->records * (uint64_t)VH;
        if (by_rows)
            l->keys_grid =
                stream_plan(rt, l->fn, rows_threads(rows, 1), smem, l->grid, l->keys, ksmem, items);
        if (l->keys_grid) {
            l->threads = rows_threads(rows, 1);
            l->flags = l->ws + items * record_stride(elt);
        }
    } else {
        l->grid = (uint32_t)((uint64_t)S * (uint64_t)VH * (uint64_t)row_blocks(DK, DV));
        l->threads = (unsigned)threads_for(DK, DV);
    }
    last_kernel = rows == 64 ? LAST_CHUNK64 : rows == 32 ? LAST_CHUNK32 : LAST_SCAN;
    last_keyed = by_rows ? 2 : keys != NULL;
    last_terms = terms;
    last_streamed = l->flags != 0;
    /* The replay key: the kernel and every binding (address, bytes), the
     * workspace (address, bytes: 0 without one) and the form that runs
     * (single, keyed or rows, streamed or not: one cubin holds them all); T
     * and S travel in the bytes too. */
    uint64_t params[2 * N_BINDINGS + 6];
    kiln_region regions[N_BINDINGS + 1];
    for (int i = 0; i < N_BINDINGS; i++) {
        l->ptr[i] = kiln__buffer_ptr(t[i]->buffer) + t[i]->offset;
        params[2 * i] = l->ptr[i];
        params[2 * i + 1] = bytes[i];
        regions[i] = (kiln_region){t[i]->buffer, t[i]->offset, t[i]->offset + bytes[i]};
    }
    size_t n_regions = N_BINDINGS;
    if (local.workspace)
        regions[n_regions++] = *local.workspace;
    params[2 * N_BINDINGS] = (uint64_t)T;
    params[2 * N_BINDINGS + 1] = (uint64_t)S;
    params[2 * N_BINDINGS + 2] = l->ws;
    params[2 * N_BINDINGS + 3] = local.workspace ? local.workspace->end - local.workspace->start : 0;
    params[2 * N_BINDINGS + 4] = (uint64_t)last_keyed;
    params[2 * N_BINDINGS + 5] = (uint64_t)last_streamed;
    const kiln__kernel_command_desc d = {.op = OP, .participants = (uint32_t)S, .tokens = (uint32_t)T,
                                         .dispatches = keys ? 2 : 1, .regions = regions, .n_regions = n_regions,
                                         .enqueue = enqueue, .user = l, .kernel = k, KILN__PARAMS(params)};
    return kiln__kernel_command(rt, &d, cmd);
}

kiln_status kiln_op_gated_delta(kiln_jit *jit, const kiln_gated_delta_bindings *b)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_gated_delta_encode(jit, b, &cmd), &cmd);
}
