/* Causal paged attention with RoPE (templates/paged_attention.cu): the
 * contract of include/kiln/op_attention.h, checked here for what the host
 * knows; the kernels check what lives in device memory. */
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "providers/blas.h"
#include "providers/catalog.h"
#include "providers/internal.h"
#include "providers/tma.h"

#define OP "paged_attention"
#define KEY_TAG KILN__KEY_TAG(OP, KILN__VERSION_PAGED_ATTENTION)
#define THREADS 128
#define APPEND_TOKENS 4 /* new tokens per append block (the template's) */
#define PREFILL_ROWS 16
#define MAX_SEQS 65535u  /* the grid's z */
#define GRID_X_MAX 0x7fffffffu
/* The first layout of the desc: everything before workspace and qkv. */
#define DESC_V1_SIZE offsetof(kiln_paged_attention_desc, workspace)
#define DECODE_ROWS 8      /* query rows per decode block (the decode template's) */
#define DECODE_MAX_CLUSTER 16 /* blocks a decode's keys split over at most: sm_90's non-portable cluster */
#define PORTABLE_CLUSTER 8
/* Decode blocks a split aims at per SM. One, though an SM may hold two (the
 * template's launch bounds and shared memory): splitting less costs less
 * combining, as bench/bench_attention --sweep shows. */
#define DECODE_BLOCKS_PER_SM 1

static _Atomic uint32_t split_target; /* 0: DECODE_BLOCKS_PER_SM per SM */

void kiln__paged_attention_set_split_target(uint32_t blocks)
{
    atomic_store(&split_target, blocks);
}

static _Atomic uint32_t prefill_blocks; /* 0: the wgmma prefill's grid as encode picks it */

void kiln__paged_attention_set_prefill_blocks(uint32_t blocks)
{
    atomic_store(&prefill_blocks, blocks);
}

static _Atomic int two_kernel_decode; /* 1: decode as where the one-kernel decode does not fit */
static _Atomic int prefill_forced; /* KILN__PREFILL_*: the prefill kernel a test asks for */

/* For the GPU tests and benchmarks: prefill on the kernel another device
 * would take (KILN__PREFILL_MMA: sm_80 on without wgmma; KILN__PREFILL_CUDA_CORE:
 * before sm_80), where the device allows it. Read at encode; process-wide. */
void kiln__paged_attention_set_prefill_kernel(int which)
{
    atomic_store(&prefill_forced, which >= KILN__PREFILL_MMA && which <= KILN__PREFILL_CUDA_CORE ? which : 0);
}
static _Atomic int decode_stages_forced; /* 3 or 4: the one-kernel decode's stages; 0: chosen */

/* For the GPU tests: the one-kernel decode with 3 or 4 stages whatever its
 * grid (4 only where the device allows the shared memory; 0: chosen as
 * decode_setup says). Read at encode; process-wide. */
void kiln__paged_attention_set_decode_stages(int stages)
{
    atomic_store(&decode_stages_forced, stages == 3 || stages == 4 ? stages : 0);
}

/* For the GPU tests: the two-kernel decode, which sm_86/89/12x take at
 * head_dim 128, run on a device that would take the one-kernel one. Read at
 * encode; process-wide. */
void kiln__paged_attention_set_two_kernel_decode(int on)
{
    atomic_store(&two_kernel_decode, on);
}

/* The decode template's stages (tiles of 64 keys, K and V, in shared memory):
 * at head_dim 128, 3 (two blocks an SM) or, deep, 4 (one block an SM, a
 * deeper pipeline), taken from sm_90 on where the grid holds at most one
 * block an SM (bench/bench_attention --sweep shows both). At head_dim 64: 4. */
static unsigned decode_stages(int64_t head_dim, int deep) { return head_dim == 128 && !deep ? 3u : 4u; }

/* The wgmma prefill kernel's threads, keys a tile and shared memory
 * (templates/paged_prefill.cu's THREADS, BN and SMEM_BYTES): q for 128 rows,
 * K and V tiles of 128 keys (64 at head_dim 256), 6 of them (8 at head_dim
 * 64, 5 at 256: its 2 K and 3 V slots; otherwise stages of K and V), and
 * 1024 bytes of slack to align them. */
#define PREFILL_THREADS 384
#define PREFILL_BM 128
static unsigned prefill_bn(int64_t head_dim) { return head_dim == 256 ? 64u : 128u; }
static unsigned prefill_smem(int64_t head_dim)
{
    const unsigned slots = head_dim == 256 ? 5u : head_dim == 128 ? 6u : 8u;
    return (unsigned)(PREFILL_BM * head_dim * 2 + slots * prefill_bn(head_dim) * head_dim * 2 + 1024);
}

/* The mma.sync prefill kernel's (templates/paged_prefill_mma.cu): 128 threads,
 * q for 64 rows, two stages of K and V tiles of 64 keys, the slack. */
#define PREFILL_MMA_THREADS 128
#define PREFILL_MMA_BM 64
static unsigned prefill_mma_smem(int64_t head_dim)
{
    return (unsigned)(PREFILL_MMA_BM * head_dim * 2 + 2 * 2 * 64 * head_dim * 2 + 1024);
}

/* The spec of template tmpl specialized on the head layout alone: the
 * decode (paged_decode) and the tensor-core prefills (paged_prefill, wgmma:
 * sm_90 only, wgmma is sm_90a's; paged_prefill_mma, mma.sync: sm_80 on). */
static kiln_status layout_spec(kiln_dtype elt, const char *tmpl, int64_t head_dim, int64_t heads, int64_t kv_heads, kiln_spec *out)
{
    uint32_t pt;
    kiln_status st;
    if ((st = kiln_op_paged_attention_page_tokens(head_dim, kv_heads, &pt)) ||
        (st = kiln_spec_init(out, tmpl)) || (st = kiln__spec_set_elt(out, tmpl, elt)) ||
        (st = kiln_spec_set(out, "HEAD_DIM", head_dim)) ||
        (st = kiln_spec_set(out, "HEADS", heads)) || (st = kiln_spec_set(out, "KV_HEADS", kv_heads)) ||
        (st = kiln_spec_set(out, "PAGE_TOKENS", pt)))
        return st;
    return KILN_OK;
}

/* Its dynamic shared memory. */
static unsigned decode_smem(int64_t head_dim, int deep)
{
    return decode_stages(head_dim, deep) * 2u * 64u * (unsigned)head_dim * 2u;
}

kiln_status kiln_op_paged_attention_page_tokens(int64_t head_dim, int64_t kv_heads, uint32_t *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    if (head_dim != 64 && head_dim != 128 && head_dim != 256)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT, OP ": head_dim %lld; supported: 64, 128, 256",
                          (long long)head_dim);
    if (kv_heads < 1 || kv_heads * head_dim * 2 > KILN_PAGED_KV_PAGE_BYTES / 2)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": kv_heads %lld x head_dim %lld: a %u-byte page (K and V halves) must hold at least one "
                          "token, so kv_heads x head_dim must be in [1, %u]",
                          (long long)kv_heads, (long long)head_dim, KILN_PAGED_KV_PAGE_BYTES,
                          KILN_PAGED_KV_PAGE_BYTES / 4);
    *out = (uint32_t)(KILN_PAGED_KV_PAGE_BYTES / 2 / (uint64_t)(kv_heads * head_dim * 2));
    return KILN_OK;
}

/* The CUDA-core kernel's query rows a block: at head_dim 256 at most 8 (its
 * shared memory). */
static int64_t rows_for(int64_t group, int decode, int64_t head_dim)
{
    const int64_t most = head_dim == 256 ? 8 : PREFILL_ROWS;
    if (!decode)
        return most;
    const int64_t rows = group <= 4 ? 4 : group <= 8 ? 8 : 16;
    return rows < most ? rows : most;
}

/* Head dims the tensor-core kernels (paged_decode, paged_prefill,
 * paged_prefill_mma) take; 256 runs on the CUDA-core kernel but for the
 * wgmma prefill (prefill_head_dim). */
static int tensor_core_head_dim(int64_t head_dim) { return head_dim <= 128; }

/* Whether prefill on sm attends on the tensor cores at head_dim: wgmma (sm_90)
 * takes 64, 128 and 256, mma.sync 64 and 128. */
static int prefill_head_dim(int sm, int64_t head_dim) { return tensor_core_head_dim(head_dim) || (sm == 90 && head_dim == 256); }

/* The paged_attention template's spec with rows query rows per block (16:
 * prefill; 4, 8 or 16: its decode, taken where the one-kernel decode does not
 * run: before sm_80, or short of shared memory). */
static kiln_status attention_spec(kiln_dtype elt, int64_t head_dim, int64_t heads, int64_t kv_heads, int64_t rows, kiln_spec *out)
{
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": out is NULL");
    uint32_t pt;
    kiln_status st = kiln_op_paged_attention_page_tokens(head_dim, kv_heads, &pt);
    if (st)
        return st;
    if (heads < 1 || heads > KILN_MODEL_MAX_HEADS || heads % kv_heads)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": heads %lld must be in [1, %d] and a multiple of kv_heads %lld", (long long)heads,
                          KILN_MODEL_MAX_HEADS, (long long)kv_heads);
    if ((st = kiln_spec_init(out, OP)) || (st = kiln__spec_set_elt(out, OP, elt)) ||
        (st = kiln_spec_set(out, "HEAD_DIM", head_dim)) ||
        (st = kiln_spec_set(out, "HEADS", heads)) || (st = kiln_spec_set(out, "KV_HEADS", kv_heads)) ||
        (st = kiln_spec_set(out, "PAGE_TOKENS", pt)) ||
        (st = kiln_spec_set(out, "ROWS", rows)))
        return st;
    return KILN_OK;
}

kiln_status kiln_op_paged_attention_spec(kiln_dtype elt, int64_t head_dim, int64_t heads, int64_t kv_heads, int decode,
                                         kiln_spec *out)
{
    kiln_status st = attention_spec(elt, head_dim, heads, kv_heads, rows_for(1, 0, head_dim), out);
    if (st || !decode)
        return st;
    if (!tensor_core_head_dim(head_dim))
        return attention_spec(elt, head_dim, heads, kv_heads, rows_for(heads / kv_heads, 1, head_dim), out);
    return layout_spec(elt, "paged_decode", head_dim, heads, kv_heads, out);
}

kiln_status kiln_op_paged_attention_workspace(int64_t seqs, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                              int64_t max_query_tokens, size_t *bytes)
{
    if (!bytes)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, OP ": bytes is NULL");
    kiln_spec spec; /* the head layout's checks, the same for either element type */
    kiln_status st = kiln_op_paged_attention_spec(KILN_DTYPE_F16, head_dim, heads, kv_heads, 1, &spec);
    if (st)
        return st;
    if (seqs < 1 || seqs > (int64_t)MAX_SEQS || max_query_tokens < 1)
        return kiln__fail(NULL, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": %lld sequences (1 to %u) of at most %lld new tokens (>= 1): no such command",
                          (long long)seqs, MAX_SEQS, (long long)max_query_tokens);
    /* The decode kernel splits over a cluster's shared memory, prefill does
     * not split: no command needs scratch. */
    *bytes = 0;
    return KILN_OK;
}

/* The shared memory a block may opt in to on sm (KiB), from the CUDA
 * programming guide's table: what decides, before a device is seen, whether
 * the one-kernel decode runs there (the encode asks the driver). */
static unsigned optin_smem_kib(int sm)
{
    if (sm == 86 || sm == 89 || sm / 10 == 12)
        return 99;
    if (sm < 90)
        return 163; /* sm_80, sm_87 */
    return 227;     /* sm_90, sm_100, sm_103, sm_110 */
}

/* Whether a decode on sm takes the two-kernel fallback: before sm_80, or where
 * a block cannot have the one-kernel decode's dynamic shared memory plus its
 * static part (under 12 KiB: 11.25 at head_dim 128 on sm_90). */
static int decode_falls_back(int sm, int64_t head_dim)
{
    return sm < 80 || optin_smem_kib(sm) < decode_smem(head_dim, 0) / 1024u + 12u;
}

/* Prefill and decode for the model's head layout; a layout the kernels do
 * not serve (another head_dim) adds nothing rather than failing prewarm.
 * arch ("sm_86", "sm_90a"; NULL or unreadable: not known) adds the two-kernel
 * decode where the encode falls back to it, and drops the one-kernel decode
 * before sm_80, where the encode never asks for it. */
kiln_status kiln__paged_attention_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                             void *user)
{
    const int64_t d = cfg->head_dim, h = cfg->num_attention_heads, kvh = cfg->num_key_value_heads;
    if ((d != 64 && d != 128 && d != 256) || kvh < 1 || h % kvh || kvh * d > KILN_PAGED_KV_PAGE_BYTES / 4)
        return KILN_OK;
    const int sm = kiln__arch_number(arch);
    const kiln_dtype elt = cfg->dtype;
    if (elt == KILN_DTYPE_BF16 && sm && sm < 80)
        return KILN_OK; /* no bf16 before sm_80: the encode refuses it */
    kiln_spec spec;
    kiln_status st;
    if ((st = kiln_op_paged_attention_spec(elt, d, h, kvh, 0, &spec)) || (st = sink(user, &spec)))
        return st;
    if (!tensor_core_head_dim(d)) { /* the CUDA-core kernel, with its decode rows, and sm_90's wgmma prefill */
        const int64_t rows = rows_for(h / kvh, 1, d);
        if (rows != rows_for(1, 0, d) && ((st = attention_spec(elt, d, h, kvh, rows, &spec)) || (st = sink(user, &spec))))
            return st;
        if (prefill_head_dim(sm, d) &&
            ((st = layout_spec(elt, "paged_prefill", d, h, kvh, &spec)) || (st = sink(user, &spec))))
            return st;
        return KILN_OK;
    }
    if (sm >= 80 && ((st = layout_spec(elt, sm == 90 ? "paged_prefill" : "paged_prefill_mma", d, h, kvh, &spec)) ||
                     (st = sink(user, &spec))))
        return st;
    if ((!sm || sm >= 80) &&
        ((st = kiln_op_paged_attention_spec(elt, d, h, kvh, 1, &spec)) || (st = sink(user, &spec))))
        return st;
    const int64_t rows = rows_for(h / kvh, 1, d);
    if (sm && decode_falls_back(sm, d) && rows != PREFILL_ROWS &&
        ((st = attention_spec(elt, d, h, kvh, rows, &spec)) || (st = sink(user, &spec))))
        return st;
    return KILN_OK;
}

enum { B_Q, B_K, B_V, B_QKV, B_POS, B_TABLE, B_LENS, B_SPANS, B_OUT, B_PAGES, B_WS };
static const char *const names[KILN__PA_BINDINGS] = {
    "q", "k", "v", "qkv", "positions", "block_table", "seq_lens", "query_spans", "out", "kv_pages", "workspace"};

/* T, H and D from q (three tensors) or from out (fused qkv), then kv heads
 * from k or from qkv's width. */
static kiln_status check_qkv(kiln__errslot *err, kiln_runtime *rt, const kiln_paged_attention_desc *d,
                             kiln__paged_attention_info *info, kiln_dtype *elt, int64_t *T, int64_t *H, int64_t *D,
                             int64_t *KVH)
{
    size_t *bytes = info->bytes;
    const kiln_tensor *shape = d->qkv ? d->out : d->q;
    const char *shape_name = d->qkv ? "out" : "q";
    kiln_status st;
    if (d->qkv && (d->q || d->k || d->v)) {
        char given[8] = "";
        const kiln_tensor *each[3] = {d->q, d->k, d->v};
        for (int i = 0; i < 3; i++)
            if (each[i])
                snprintf(given + strlen(given), sizeof given - strlen(given), "%s%c", *given ? " " : "", "qkv"[i]);
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding qkv is given, so bindings q, k and v must be NULL (given: %s)", given);
    }
    /* The element type is the input's (q, or qkv); every other 16-bit binding
     * must have it. */
    if ((st = kiln__check_elt(err, OP, d->qkv ? "qkv" : "q", d->qkv ? d->qkv : d->q, rt, elt)) ||
        (st = kiln__check_tensor(err, OP, shape_name, shape, rt, *elt, 3, NULL, &bytes[d->qkv ? B_OUT : B_Q])))
        return st;
    *T = shape->dims[0];
    *H = shape->dims[1];
    *D = shape->dims[2];
    if (*D != 64 && *D != 128 && *D != 256)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding %s has head_dim %lld; supported: 64, 128, 256",
                          shape_name, (long long)*D);
    if (*T > INT32_MAX || *H > KILN_MODEL_MAX_HEADS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding %s is [%lld, %lld, %lld]; at most %d tokens and %d heads", shape_name,
                          (long long)*T, (long long)*H, (long long)*D, INT32_MAX, KILN_MODEL_MAX_HEADS);
    if (d->qkv) {
        const int64_t want[2] = {*T, -1};
        if ((st = kiln__check_tensor(err, OP, "qkv", d->qkv, rt, *elt, 2, want, &bytes[B_QKV])))
            return st;
        const int64_t cols = d->qkv->dims[1], heads = cols / *D;
        if (cols % *D || heads <= *H || (heads - *H) % 2)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              OP ": binding qkv has %lld columns; expected (heads %lld + 2 x kv_heads) x head_dim %lld "
                              "(q, then k, then v in each row)",
                              (long long)cols, (long long)*H, (long long)*D);
        *KVH = (heads - *H) / 2;
        info->q_stride = info->kv_stride = (uint32_t)cols;
        info->k_offset = (size_t)*H * (size_t)*D * 2;
        info->v_offset = info->k_offset + (size_t)*KVH * (size_t)*D * 2;
    } else {
        const int64_t want_kv[3] = {*T, -1, *D};
        if ((st = kiln__check_tensor(err, OP, "k", d->k, rt, *elt, 3, want_kv, &bytes[B_K])))
            return st;
        *KVH = d->k->dims[1];
    }
    if (*H % *KVH)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding %s has %lld kv heads, which does not divide the %lld heads of %s",
                          d->qkv ? "qkv" : "k", (long long)*KVH, (long long)*H, shape_name);
    uint32_t pt;
    if ((st = kiln_op_paged_attention_page_tokens(*D, *KVH, &pt)))
        return kiln__propagate(err, st);
    info->page_tokens = pt;
    const int64_t want_v[3] = {*T, *KVH, *D}, want_out[3] = {*T, *H, *D};
    if (!d->qkv) {
        if ((st = kiln__check_tensor(err, OP, "v", d->v, rt, *elt, 3, want_v, &bytes[B_V])) ||
            (st = kiln__check_tensor(err, OP, "out", d->out, rt, *elt, 3, want_out, &bytes[B_OUT])))
            return st;
        info->q_stride = (uint32_t)(*H * *D);
        info->kv_stride = (uint32_t)(*KVH * *D);
    }
    return KILN_OK;
}

kiln_status kiln__paged_attention_check(kiln_runtime *rt, const kiln_paged_attention_desc *desc,
                                        kiln__paged_attention_info *info)
{
    kiln__errslot *err = kiln__runtime_errslot(rt);
    if (!info)
        return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, OP ": info is NULL");
    /* A desc of the earlier size has no workspace and no qkv. */
    kiln_paged_attention_desc full;
    kiln_status st = kiln__copy_bindings(err, OP, "desc", "kiln_paged_attention_desc", &full, sizeof full,
                                         DESC_V1_SIZE, desc);
    if (st)
        return st;
    const kiln_paged_attention_desc *d = &full;
    memset(info, 0, sizeof *info);
    size_t *bytes = info->bytes;
    int64_t T = 0, H = 0, D = 0, KVH = 1;
    kiln_dtype elt = KILN_DTYPE_F16;
    st = check_qkv(err, rt, d, info, &elt, &T, &H, &D, &KVH);
    if (st)
        return st;
    const uint32_t pt = info->page_tokens;
    const int64_t want_pos[1] = {T};
    if ((st = kiln__check_tensor(err, OP, "positions", d->positions, rt, KILN_DTYPE_U32, 1, want_pos, &bytes[B_POS])) ||
        (st = kiln__check_tensor(err, OP, "block_table", d->block_table, rt, KILN_DTYPE_U32, 2, NULL,
                                 &bytes[B_TABLE])))
        return st;
    const int64_t S = d->block_table->dims[0], MB = d->block_table->dims[1];
    if (S > (int64_t)MAX_SEQS)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding block_table has %lld sequences; at most %u",
                          (long long)S, MAX_SEQS);
    /* Keys go in tiles of 64 with a 32-bit index: a length past 2^32 - 65
     * would wrap it (and a device seq_len up to the table's capacity is
     * accepted). */
    if ((uint64_t)MB * pt > UINT32_MAX - 64u)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding block_table has %lld blocks per sequence of %u tokens: more than 2^32 - 65 tokens",
                          (long long)MB, pt);
    const int64_t want_lens[1] = {S}, want_spans[2] = {S, 2};
    if ((st = kiln__check_tensor(err, OP, "seq_lens", d->seq_lens, rt, KILN_DTYPE_U32, 1, want_lens, &bytes[B_LENS])) ||
        (st = kiln__check_tensor(err, OP, "query_spans", d->query_spans, rt, KILN_DTYPE_U32, 2, want_spans,
                                 &bytes[B_SPANS])))
        return st;
    /* The page arena. */
    const kiln_region *pg = d->kv_pages;
    if (!pg || !pg->buffer)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding kv_pages has no buffer");
    if (kiln__buffer_runtime(pg->buffer) != rt)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding kv_pages belongs to another runtime");
    if (pg->start >= pg->end || pg->end > kiln_buffer_size(pg->buffer))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding kv_pages [%zu, %zu) is empty or past its buffer of %zu bytes", pg->start,
                          pg->end, kiln_buffer_size(pg->buffer));
    const size_t pbytes = pg->end - pg->start;
    if (pbytes % KILN_PAGED_KV_PAGE_BYTES || pbytes / KILN_PAGED_KV_PAGE_BYTES > UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding kv_pages has %zu bytes; it must be whole %u-byte pages (at most 2^32 - 1)",
                          pbytes, KILN_PAGED_KV_PAGE_BYTES);
    /* The pages hold elt; an untyped buffer is the caller's word for it. */
    const kiln_dtype pdt = kiln_buffer_dtype(pg->buffer);
    if (pdt != KILN_DTYPE_BYTES && pdt != elt)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding kv_pages is a %s buffer, but %s is %s: the cache must hold %s (or be untyped)",
                          kiln_dtype_name(pdt), d->qkv ? "qkv" : "q", kiln_dtype_name(elt), kiln_dtype_name(elt));
    if ((kiln__buffer_ptr(pg->buffer) + pg->start) % 16)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding kv_pages starts at offset %zu: its device address must be 16-byte aligned",
                          pg->start);
    /* The kernels store out two halves at a time. */
    if ((kiln__buffer_ptr(d->out->buffer) + d->out->offset) % 4)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": binding out starts at offset %zu: its device address must be 4-byte aligned",
                          d->out->offset);
    bytes[B_PAGES] = pbytes;
    const uint64_t maxq = d->max_query_tokens ? d->max_query_tokens : (uint64_t)T;
    if (maxq > (uint64_t)T)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": max_query_tokens %u exceeds the %lld tokens of %s",
                          d->max_query_tokens, (long long)T, d->qkv ? "qkv" : "q");
    const int64_t G = H / KVH;
    const int decode = maxq == 1;
    const uint64_t rows = (uint64_t)rows_for(G, decode, D), tiles = (maxq * (uint64_t)G + rows - 1) / rows;
    if (maxq * (uint64_t)G > INT32_MAX || tiles > GRID_X_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": max_query_tokens %llu x %lld heads per kv head exceeds 2^31 - 1 query rows",
                          (unsigned long long)maxq, (long long)G);
    if (!isfinite(d->rope_theta) || !(d->rope_theta > 0.0f))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": rope_theta must be a finite number > 0, got %g",
                          (double)d->rope_theta);
    if (d->rope_dim && (d->rope_dim < 2 || d->rope_dim > D || d->rope_dim % 2))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          OP ": rope_dim %lld must be even and in [2, head_dim %lld] (0: head_dim)",
                          (long long)d->rope_dim, (long long)D);
    if (d->rope_inv_freq) {
        const int64_t n = (d->rope_dim ? d->rope_dim : D) / 2;
        for (int64_t i = 0; i < n; i++)
            if (!isfinite(d->rope_inv_freq[i]) || !(d->rope_inv_freq[i] > 0.0f))
                return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                                  OP ": rope_inv_freq[%lld] must be a finite number > 0, got %g (of %lld frequencies)",
                                  (long long)i, (double)d->rope_inv_freq[i], (long long)n);
    }
    if (!isfinite(d->rope_attention_scaling))
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": rope_attention_scaling must be finite, got %g",
                          (double)d->rope_attention_scaling);
    /* What is written (out, kv_pages, workspace) overlaps nothing else. */
    const kiln_tensor pages_view = {.buffer = pg->buffer, .offset = pg->start};
    const kiln_tensor *t[KILN__PA_BINDINGS] = {d->q,           d->k,        d->v,           d->qkv,
                                               d->positions,   d->block_table, d->seq_lens, d->query_spans,
                                               d->out,         &pages_view, NULL};
    for (int w = B_OUT; w <= B_PAGES; w++)
        for (int i = 0; i < B_WS; i++)
            if (i != w && t[i] && kiln__tensors_overlap(t[w], bytes[w], t[i], bytes[i]))
                return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, OP ": binding %s overlaps binding %s", names[w],
                                  names[i]);
    /* The workspace: checked whenever given; no kernel uses it. */
    if (d->workspace) {
        if ((st = kiln__check_workspace(err, OP, d->workspace, rt, 0, t, bytes, names, B_WS)))
            return st;
        bytes[B_WS] = d->workspace->end - d->workspace->start;
    }
    info->tokens = (uint32_t)T;
    info->seqs = (uint32_t)S;
    info->max_blocks = (uint32_t)MB;
    info->max_query = (uint32_t)maxq;
    info->heads = H;
    info->kv_heads = KVH;
    info->head_dim = D;
    info->pages = (uint32_t)(pbytes / KILN_PAGED_KV_PAGE_BYTES);
    info->decode = decode;
    info->fused = d->qkv != NULL;
    info->append_tiles = (uint32_t)((maxq + APPEND_TOKENS - 1) / APPEND_TOKENS);
    info->attention_tiles = (uint32_t)tiles;
    return KILN_OK;
}

/* A 3-D f16 or bf16 view for the wgmma prefill's TMA copies, 128-byte
 * swizzle, elements past the dimensions read as zeros; what: for the error. */
static kiln_status map3(kiln_runtime *rt, kiln_dtype elt, CUtensorMap *m, CUdeviceptr base, const cuuint64_t dims[3],
                        const cuuint64_t strides[2], const cuuint32_t box[3], const char *what)
{
    static const cuuint32_t es[3] = {1, 1, 1};
    const CUtensorMapDataType type =
        elt == KILN_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    CUresult r = kiln__tensor_map_encode_tiled(rt, m, type, 3, (void *)base, dims, strides, box, es,
                                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? KILN_OK : kiln__runtime_cu_fail(rt, r, what);
}

/* The arena for the wgmma prefill's tiles whose pages follow one another:
 * (head_dim columns, a page's rows of head_dim elements, pages), boxes of 64
 * columns x the page's tokens x the pages of a tile (prefill_bn), so that one
 * copy a panel brings a tile's K (or V) of one head. */
static kiln_status arena_map3(kiln_runtime *rt, kiln_dtype elt, CUtensorMap *m, CUdeviceptr base, int64_t head_dim,
                              int64_t pages, int64_t page_tokens)
{
    const cuuint64_t rows = KILN_PAGED_KV_PAGE_BYTES / (2 * (cuuint64_t)head_dim);
    const cuuint64_t dims[3] = {(cuuint64_t)head_dim, rows, (cuuint64_t)pages},
                     strides[2] = {(cuuint64_t)head_dim * 2, KILN_PAGED_KV_PAGE_BYTES};
    const cuuint32_t box[3] = {64, (cuuint32_t)page_tokens, (cuuint32_t)(prefill_bn(head_dim) / page_tokens)};
    return map3(rt, elt, m, base, dims, strides, box, "cuTensorMapEncodeTiled (" OP ", pages)");
}

/* The arena as rows of head_dim elements (the map kvmap's rows). */
static uint64_t arena_rows(const kiln__paged_attention_info *in)
{
    return (uint64_t)in->pages * (KILN_PAGED_KV_PAGE_BYTES / (2 * (uint64_t)in->head_dim));
}

/* Whether the wgmma prefill may bring K and V tiles by TMA (the template's
 * KV_TMA: whole pages a tile, 8-row aligned boxes) with the arena's rows
 * within a map's. */
static int kv_tma_fits(const kiln__paged_attention_info *in)
{
    return in->page_tokens % 8 == 0 && prefill_bn(in->head_dim) % in->page_tokens == 0 &&
           arena_rows(in) <= UINT32_MAX;
}

typedef struct attn_launch {
    /* The wgmma prefill's view of the arena for TMA (first: CUtensorMap's
     * alignment; the struct comes from kiln__tma_calloc). */
    CUtensorMap kvmap;
    CUtensorMap kvmap3; /* the same arena as (columns, a page's rows, pages), for runs of pages */
    uint32_t kv_tma;  /* bit 0: kvmap is encoded, bit 1: kvmap3 (the kernel's argument) */
    int wgmma;        /* the attention kernel is the wgmma prefill: it takes kvmap, kvmap3, kv_tma */
    kiln_runtime *rt;
    CUfunction append, attention, decode; /* decode: the one-kernel decode (then the others are NULL) */
    /* The attention's block and shared memory: 384 (wgmma) or 128 (mma.sync)
     * and theirs for a tensor-core prefill; 128 and 0 on the CUDA cores. */
    unsigned attention_threads, attention_smem;
    CUdeviceptr q, k, v, pos, table, lens, spans, pages, out;
    uint32_t q_stride, kv_stride, n_pages, max_blocks, tokens, max_query, seqs, kv_heads, append_tiles,
        attention_tiles;
    uint32_t prefill_blocks; /* the wgmma prefill's grid (its work items or, persistent, one block an SM) */
    uint32_t splits; /* the one-kernel decode's blocks per row tile: one cluster */
    unsigned smem; /* the decode kernel's dynamic shared memory */
    uint32_t stages; /* and its stages (decode_stages) */
    int pdl;       /* the decode's cluster launch also asks for programmatic dependent launch */
    uint32_t window; /* the sliding window, 0xffffffff for none */
    float qscale;
    /* The kernels' rope_freqs (templates/kiln_paged.cuh), by value: head_dim
     * / 2 floats (the first rope_dim / 2 used), then the scale, then the
     * rotated pairs as a u32. */
    float rope[128 + 2];
} attn_launch;

static kiln_status launch3(const kiln_launch_context *ctx, kiln_runtime *rt, CUfunction fn, unsigned x, unsigned y,
                           unsigned z, unsigned threads, unsigned smem, void **args, const char *what)
{
    const unsigned grid[3] = {x, y, z};
    kiln_status st = kiln__launch_ex(ctx, rt, fn, grid, threads, smem, args, KILN__LAUNCH_PDL);
    return st ? kiln__fail(kiln__runtime_errslot(rt), st, "%s: %s", what, kiln_errmsg()) : KILN_OK;
}

/* The decode kernel: grid x = row tiles x splits, the splits of a row tile one
 * cluster (a plain launch when there is one split). */
static kiln_status launch_decode(attn_launch *l, const kiln_launch_context *ctx, CUdeviceptr *fault)
{
    void *args[] = {&l->q,     &l->q_stride,   &l->k,      &l->v,         &l->kv_stride, &l->pos,
                    &l->table, &l->lens,       &l->spans,  &l->pages,     &l->out,       &l->n_pages,
                    &l->max_blocks, &l->tokens, &l->max_query, &l->window, &l->stages, &l->qscale, l->rope, fault};
    const unsigned grid[3] = {l->attention_tiles * l->splits, l->kv_heads, l->seqs};
    kiln_status st = kiln__launch_cluster(ctx, l->rt, l->decode, grid, l->splits, THREADS, l->smem, args,
                                          l->pdl ? KILN__LAUNCH_PDL : 0);
    return st ? kiln__fail(kiln__runtime_errslot(l->rt), st, "paged_attention decode: %s", kiln_errmsg()) : KILN_OK;
}

static kiln_status enqueue(void *user, const kiln_launch_context *ctx)
{
    attn_launch *l = user;
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    if (l->decode)
        return launch_decode(l, ctx, &fault);
    void *append_args[] = {&l->k,       &l->v,          &l->kv_stride, &l->pos,       &l->table,
                           &l->lens,    &l->spans,      &l->pages,     &l->n_pages,   &l->max_blocks,
                           &l->tokens,  &l->max_query,  l->rope,       &fault};
    kiln_status st = launch3(ctx, l->rt, l->append, l->append_tiles, 1, l->seqs, THREADS, 0, append_args,
                             "cuLaunchKernel (paged_attention append)");
    if (st)
        return st;
    void *attn_args[] = {&l->q,      &l->q_stride, &l->pos,     &l->table,      &l->lens,   &l->spans,
                         &l->pages,  &l->out,      &l->n_pages, &l->max_blocks, &l->tokens, &l->max_query,
                         &l->window, &l->qscale,   l->rope,     &fault,         &l->kvmap,  &l->kvmap3,
                         &l->kv_tma, &l->attention_tiles, &l->seqs};
    /* kvmap to seqs are the wgmma prefill's last parameters, its grid one
     * dimension of work items; the other attention kernels end at fault, and
     * the driver reads no further. */
    if (l->wgmma)
        return launch3(ctx, l->rt, l->attention, l->prefill_blocks, 1, 1, l->attention_threads, l->attention_smem,
                       attn_args, "cuLaunchKernel (paged_attention prefill)");
    return launch3(ctx, l->rt, l->attention, l->attention_tiles, l->kv_heads, l->seqs, l->attention_threads,
                   l->attention_smem, attn_args, "cuLaunchKernel (paged_attention)");
}

/* The architecture's whole number: "sm_90" -> 90 (0 when unreadable). */
static int arch_number(kiln_runtime *rt, int *sms)
{
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    *sms = info.multiprocessors;
    return kiln__arch_number(info.arch);
}

/* How many clusters of n decode blocks of smem bytes each the device holds
 * at once (n > 1; 0 when none fits or the driver cannot say). */
static int clusters_resident(kiln_runtime *rt, CUfunction fn, uint32_t n, unsigned smem)
{
    return kiln__function_clusters(rt, fn, n, THREADS, smem, 0);
}

/* Prepares the decode kernel (its shared memory) and picks its split: the
 * largest of 1, 2, 4, 8, 16 (past 8 where the function may have a non-portable
 * cluster) that keeps seqs x kv_heads x tiles x splits within the
 * blocks the device holds at once (the split target), and that the device
 * can launch as a cluster; then its stages (*deep: where the grid holds at
 * most one block an SM, sm_90 on, where measured). *fits = 0 (and KILN_OK)
 * where the device gives a block less shared memory than the kernel's
 * (static plus the dynamic of 3 stages: at head_dim 128 about 107 KiB, past
 * the 99 KiB of sm_86, sm_89 and sm_120): the caller takes the two-kernel
 * decode there. The function's limit is set to the deep size where the
 * device allows it, whatever this command takes, so that no later encode
 * lowers it under a command encoded before. */
static kiln_status decode_setup(kiln_runtime *rt, CUfunction fn, int sm, int sms, uint64_t pairs, int64_t head_dim,
                                uint32_t *splits, int *deep, int *fits)
{
    kiln_status st = kiln__runtime_enter(rt);
    if (st)
        return st;
    *fits = 1;
    *deep = 0;
    /* The driver refuses a dynamic size whose sum with the static one passes
     * the device's opt-in limit (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN). */
    const unsigned smem = decode_smem(head_dim, 0), deep_smem = decode_smem(head_dim, 1);
    int deep_ok = sm >= 90 && deep_smem > smem;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (deep_ok)
        r = kiln__function_set_attribute(rt, fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)deep_smem);
    if (r == CUDA_ERROR_INVALID_VALUE) {
        deep_ok = 0;
        r = kiln__function_set_attribute(rt, fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem);
    }
    if (r == CUDA_ERROR_INVALID_VALUE) {
        *fits = 0;
        return KILN_OK;
    }
    if (r != CUDA_SUCCESS)
        return kiln__runtime_cu_fail(rt, r, "cuFuncSetAttribute (paged_attention decode shared memory)");
    const uint32_t target_set = atomic_load(&split_target);
    const uint64_t target = target_set ? target_set : (uint64_t)(sms > 0 ? sms : 1) * DECODE_BLOCKS_PER_SM;
    /* Clusters past 8 blocks are non-portable: the function must allow them. */
    const uint32_t most = kiln__function_set_attribute(rt, fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                                                       1) == CUDA_SUCCESS
                              ? DECODE_MAX_CLUSTER
                              : PORTABLE_CLUSTER;
    uint32_t n = 1;
    while (sm >= 90 && n < most && pairs * n * 2 <= target)
        n *= 2;
    while (n > 1 && clusters_resident(rt, fn, n, smem) < 1)
        n /= 2;
    *splits = n;
    /* Deep only where the whole grid is resident at once at one block an SM:
     * clusters of 4 and 8 sit within one GPC, so "grid <= SMs" alone does
     * not say it. A test may force the stage count (decode_stages_forced). */
    const int forced = atomic_load(&decode_stages_forced);
    const uint64_t grid = pairs * n;
    *deep = deep_ok && (forced ? forced == 4
                               : sms > 0 && grid <= (uint64_t)sms &&
                                     (n == 1 || (uint64_t)clusters_resident(rt, fn, n, deep_smem) * n >= grid));
    return KILN_OK;
}

kiln_status kiln_op_paged_attention_encode(kiln_jit *jit, const kiln_paged_attention_desc *desc, kiln_command **cmd)
{
    kiln_runtime *rt;
    kiln__errslot *err;
    kiln__paged_attention_info in;
    kiln_status st;
    if ((st = kiln__encode_begin(jit, OP, cmd, &rt, &err)) || (st = kiln__paged_attention_check(rt, desc, &in)))
        return st;
    kiln_paged_attention_desc full; /* checked: size is 0, the earlier layout's or larger */
    (void)KILN__COPY_SIZED(full, desc);
    const kiln_paged_attention_desc *d = &full;
    const kiln_dtype elt = in.fused ? d->qkv->dtype : d->q->dtype; /* checked: every binding's */
    kiln_spec spec;
    kiln_kernel *k;
    void *fa = NULL, *fb = NULL, *fd = NULL;
    int sms = 0;
    const int sm = arch_number(rt, &sms);
    /* Decode: one kernel on the tensor cores (sm_80 on, where a block gets
     * its shared memory); before that, and for prefill, the append and
     * attention kernels. */
    int one_kernel = in.decode && sm >= 80 && tensor_core_head_dim(in.head_dim) && !atomic_load(&two_kernel_decode);
    uint32_t splits = 1, tiles = in.attention_tiles;
    unsigned smem = 0, stages = 0;
    if (one_kernel) {
        const uint32_t decode_tiles = (uint32_t)((in.heads / in.kv_heads + DECODE_ROWS - 1) / DECODE_ROWS);
        int fits = 0, deep = 0;
        if ((st = kiln_op_paged_attention_spec(elt, in.head_dim, in.heads, in.kv_heads, 1, &spec)) ||
            (st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, "kiln_paged_decode", &fd)))
            return kiln__propagate(err, st);
        if ((st = decode_setup(rt, (CUfunction)fd, sm, sms, (uint64_t)in.seqs * (uint64_t)in.kv_heads * decode_tiles,
                               in.head_dim, &splits, &deep, &fits)))
            return st;
        if (fits) {
            tiles = decode_tiles;
            smem = decode_smem(in.head_dim, deep);
            stages = decode_stages(in.head_dim, deep);
        } else {
            one_kernel = 0;
            fd = NULL;
        }
    }
    if (!one_kernel &&
        ((st = attention_spec(elt, in.head_dim, in.heads, in.kv_heads,
                              rows_for(in.heads / in.kv_heads, in.decode, in.head_dim), &spec)) ||
         (st = kiln_jit_acquire(jit, &spec, &k)) || (st = kiln_kernel_function(k, "kiln_paged_append", &fa)) ||
         (st = kiln_kernel_function(k, "kiln_paged_attention", &fb))))
        return kiln__propagate(err, st);
    /* Prefill from sm_80 on: the attention on the tensor cores (the append
     * stays), wgmma on sm_90 and mma.sync elsewhere, where the device gives
     * a block its shared memory; the CUDA-core kernel before. */
    unsigned attention_threads = THREADS, attention_smem = 0;
    int prefill_wgmma = 0;
    const int forced = atomic_load(&prefill_forced);
    if (!in.decode && sm >= 80 && prefill_head_dim(sm, in.head_dim) && forced != KILN__PREFILL_CUDA_CORE &&
        (tensor_core_head_dim(in.head_dim) || forced != KILN__PREFILL_MMA)) {
        const int wgmma = sm == 90 && forced != KILN__PREFILL_MMA;
        kiln_kernel *kp;
        void *fp = NULL;
        if ((st = layout_spec(elt, wgmma ? "paged_prefill" : "paged_prefill_mma", in.head_dim, in.heads, in.kv_heads,
                               &spec)) ||
            (st = kiln_jit_acquire(jit, &spec, &kp)) ||
            (st = kiln_kernel_function(kp, wgmma ? "kiln_paged_prefill" : "kiln_paged_prefill_mma", &fp)) ||
            (st = kiln__runtime_enter(rt)))
            return kiln__propagate(err, st);
        const unsigned want = wgmma ? prefill_smem(in.head_dim) : prefill_mma_smem(in.head_dim);
        const uint64_t bm = wgmma ? PREFILL_BM : PREFILL_MMA_BM;
        CUresult r =
            kiln__function_set_attribute(rt, (CUfunction)fp, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)want);
        if (r == CUDA_SUCCESS) {
            k = kp;
            fb = fp;
            tiles = (uint32_t)(((uint64_t)in.max_query * (uint64_t)(in.heads / in.kv_heads) + bm - 1) / bm);
            attention_threads = wgmma ? PREFILL_THREADS : PREFILL_MMA_THREADS;
            attention_smem = want;
            prefill_wgmma = wgmma;
        } else if (r != CUDA_ERROR_INVALID_VALUE) {
            return kiln__runtime_cu_fail(rt, r, "cuFuncSetAttribute (paged_attention prefill shared memory)");
        }
    }
    attn_launch *l = kiln__tma_calloc(sizeof *l);
    if (!l)
        return kiln__fail(err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
#define PTR(t) (kiln__buffer_ptr((t)->buffer) + (t)->offset)
    l->rt = rt;
    l->append = (CUfunction)fa;
    l->attention = (CUfunction)fb;
    l->attention_threads = attention_threads;
    l->attention_smem = attention_smem;
    l->decode = (CUfunction)fd;
    l->smem = smem;
    l->stages = stages;
    l->pdl = kiln__runtime_pdl(rt);
    if (in.fused) {
        l->q = PTR(d->qkv);
        l->k = l->q + in.k_offset;
        l->v = l->q + in.v_offset;
    } else {
        l->q = PTR(d->q);
        l->k = PTR(d->k);
        l->v = PTR(d->v);
    }
    l->pos = PTR(d->positions);
    l->table = PTR(d->block_table);
    l->lens = PTR(d->seq_lens);
    l->spans = PTR(d->query_spans);
    l->out = PTR(d->out);
#undef PTR
    l->pages = kiln__buffer_ptr(d->kv_pages->buffer) + d->kv_pages->start;
    l->q_stride = in.q_stride;
    l->kv_stride = in.kv_stride;
    l->n_pages = in.pages;
    /* The wgmma prefill reads whole pages by TMA where a page's tokens are a
     * multiple of 8 dividing its tiles of keys (templates/paged_prefill.cu's
     * KV_TMA): the arena as rows of head_dim elements, boxes of 64 x the page's tokens. */
    l->wgmma = prefill_wgmma;
    if (prefill_wgmma && kv_tma_fits(&in)) {
        if ((st = kiln__tma_map(rt, OP, elt, &l->kvmap, l->pages, in.head_dim, (int64_t)arena_rows(&in),
                                in.page_tokens))) {
            free(l);
            return kiln__propagate(err, st);
        }
        l->kv_tma = 1;
        if ((st = arena_map3(rt, elt, &l->kvmap3, l->pages, in.head_dim, in.pages, in.page_tokens))) {
            free(l);
            return kiln__propagate(err, st);
        }
        l->kv_tma |= 2;
    }
    l->max_blocks = in.max_blocks;
    l->tokens = in.tokens;
    l->max_query = in.max_query;
    l->seqs = in.seqs;
    l->kv_heads = (uint32_t)in.kv_heads;
    l->append_tiles = in.append_tiles;
    l->attention_tiles = tiles;
    l->splits = splits;
    /* The wgmma prefill's work items, persistent (one block an SM, each
     * taking items until they run out, its producer copying the next item's
     * tiles under the last one's products) where there are more items than
     * SMs, else a block an item. */
    const uint64_t items = (uint64_t)tiles * (uint64_t)in.kv_heads * (uint64_t)in.seqs;
    const uint32_t forced_blocks = atomic_load(&prefill_blocks);
    const uint64_t most = forced_blocks ? forced_blocks : (uint64_t)(sms > 0 ? sms : 1);
    const uint64_t blocks = items < most ? items : most;
    l->prefill_blocks = (uint32_t)(blocks < GRID_X_MAX ? blocks : GRID_X_MAX);
    l->window = d->sliding_window ? d->sliding_window : UINT32_MAX;
    /* Scores in the log2 domain: the kernel's softmax uses exp2. */
    l->qscale = (float)(1.4426950408889634 / sqrt((double)in.head_dim));
    /* RoPE's parameters, computed once here (checked: rope_dim even in [2,
     * head_dim], the frequencies finite and > 0, the scaling finite). */
    const int64_t rope_dim = d->rope_dim ? d->rope_dim : in.head_dim;
    const uint32_t rope_half = (uint32_t)(rope_dim / 2);
    const float rope_scale = d->rope_attention_scaling != 0.0f ? d->rope_attention_scaling : 1.0f;
    for (uint32_t i = 0; i < rope_half; i++)
        l->rope[i] = d->rope_inv_freq ? d->rope_inv_freq[i]
                                      : (float)pow((double)d->rope_theta, -2.0 * (double)i / (double)rope_dim);
    l->rope[in.head_dim / 2] = rope_scale;
    memcpy(&l->rope[in.head_dim / 2 + 1], &rope_half, sizeof rope_half);

    struct {
        char tag[sizeof KEY_TAG];
        uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
        uint64_t ptrs[KILN__PA_BINDINGS], bytes[KILN__PA_BINDINGS];
        uint32_t tokens, seqs, max_blocks, max_query, q_stride, kv_stride, splits, stages, window, blocks;
        float theta;
        float rope[128 + 2]; /* the launch's: frequencies, scale and rotated pairs */
    } key;
    memset(&key, 0, sizeof key);
    memcpy(key.tag, KEY_TAG, sizeof KEY_TAG);
    memcpy(key.fingerprint, kiln_kernel_fingerprint(k), KILN_FINGERPRINT_SIZE);
    const kiln_tensor *t[KILN__PA_BINDINGS] = {d->q,         d->k,           d->v,        d->qkv,
                                               d->positions, d->block_table, d->seq_lens, d->query_spans,
                                               d->out,       NULL,           NULL};
    const kiln_region *whole[KILN__PA_BINDINGS] = {[B_PAGES] = d->kv_pages, [B_WS] = d->workspace};
    kiln_region regions[KILN__PA_BINDINGS];
    size_t n_regions = 0;
    for (int i = 0; i < KILN__PA_BINDINGS; i++) {
        if (!t[i] && !whole[i])
            continue;
        regions[n_regions++] = whole[i] ? *whole[i]
                                        : (kiln_region){t[i]->buffer, t[i]->offset, t[i]->offset + in.bytes[i]};
        key.ptrs[i] = kiln__buffer_ptr(regions[n_regions - 1].buffer) + regions[n_regions - 1].start;
        key.bytes[i] = in.bytes[i];
    }
    key.tokens = in.tokens;
    key.seqs = in.seqs;
    key.max_blocks = in.max_blocks;
    key.max_query = in.max_query;
    key.q_stride = in.q_stride;
    key.kv_stride = in.kv_stride;
    key.splits = splits;
    key.stages = stages;
    key.window = l->window;
    key.blocks = l->prefill_blocks;
    key.theta = d->rope_theta;
    memcpy(key.rope, l->rope, sizeof key.rope);
    const kiln__kernel_command_desc cd = {.op = OP, .participants = in.seqs, .tokens = in.tokens,
                                          .dispatches = one_kernel ? 1 : 2, .regions = regions, .n_regions = n_regions,
                                          .enqueue = enqueue, .user = l, .key = &key, .key_bytes = sizeof key};
    return kiln__kernel_command(rt, &cd, cmd);
}

kiln_status kiln_op_paged_attention(kiln_jit *jit, const kiln_paged_attention_desc *d)
{
    kiln_command *cmd = NULL;
    return kiln__submit_encoded(jit, kiln_op_paged_attention_encode(jit, d, &cmd), &cmd);
}
