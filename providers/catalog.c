/* The operation catalog: every operation kiln provides, and what is derived
 * from it (kiln_op_catalog, the implementation fingerprint, the capability
 * set the runtime advertises). */
#include <stdio.h>
#include <string.h>

#include "jit/embedded.h"
#include "kiln/catalog.h"
#include "providers/catalog.h"
#include "providers/skinny.h"

#define F16 (1u << KILN_DTYPE_F16)
/* The element types an operation takes: f16, and bf16 from sm_80 on. */
#define ELT (F16 | (1u << KILN_DTYPE_BF16))
#define PACKED (1u << KILN_BATCHING_PACKED)
#define KERNELS (KILN_CAP_LAUNCH | KILN_CAP_F16 | KILN_CAP_BF16)
#define BLAS (KERNELS | KILN_CAP_CUBLASLT)

/* In prewarm's order: the specializations come out in this order. The skinny
 * path's (plain for dense_linear and dense_linear_norm, gated for
 * dense_swiglu) are listed by dense_linear; rms_norm_residual takes
 * rms_norm's kernels. */
static const kiln__op_row rows[] = {
    {"token_embedding", KILN__VERSION_TOKEN_EMBEDDING, KERNELS, ELT, PACKED, "token_embedding", NULL,
     kiln__token_embedding_specs, NULL},
    {"dense_swiglu", KILN__VERSION_DENSE_SWIGLU, BLAS, ELT, PACKED, "swiglu tma_swiglu skinny_linear",
     "kiln_op_dense_swiglu_workspace", NULL, kiln__dense_swiglu_arch_specs},
    {"last_token_linear", KILN__VERSION_LAST_TOKEN_LINEAR, BLAS, ELT, PACKED, "gather_last",
     "kiln_op_last_token_linear_workspace", kiln__last_token_linear_specs, NULL},
    {"rms_norm", KILN__VERSION_RMS_NORM, KERNELS, ELT, PACKED, "rms_norm", "kiln_op_rms_norm_workspace",
     kiln__rms_norm_specs, NULL},
    {"rms_norm_residual", KILN__VERSION_RMS_NORM_RESIDUAL, KERNELS, ELT, PACKED, "rms_norm",
     "kiln_op_rms_norm_workspace", kiln__rms_norm_specs, NULL},
    {"residual_add", KILN__VERSION_RESIDUAL_ADD, KERNELS, ELT, PACKED, "residual_add",
     "kiln_op_residual_add_workspace", kiln__residual_add_specs, NULL},
    {"head_rms_norm", KILN__VERSION_HEAD_RMS_NORM, KERNELS, ELT, PACKED, "head_rms_norm", NULL,
     kiln__head_rms_norm_specs, NULL},
    {"masked_argmax", KILN__VERSION_MASKED_ARGMAX, KERNELS, ELT, PACKED, "masked_argmax",
     "kiln_op_masked_argmax_workspace", NULL, kiln__masked_argmax_arch_specs},
    {"moe_router", KILN__VERSION_MOE_ROUTER, KERNELS, ELT, PACKED, "moe_router", "kiln_op_moe_router_workspace",
     kiln__moe_router_specs, NULL},
    {"moe_experts", KILN__VERSION_MOE_EXPERTS, KERNELS, ELT, PACKED, "moe_experts moe_experts_wgmma moe_experts_tma",
     "kiln_op_moe_experts_workspace", NULL, kiln__moe_experts_arch_specs},
    {"gated_delta", KILN__VERSION_GATED_DELTA, KERNELS, ELT, PACKED, "gated_delta gated_delta_chunk",
     "kiln_op_gated_delta_workspace", NULL, kiln__gated_delta_arch_specs},
    {"paged_attention", KILN__VERSION_PAGED_ATTENTION, KERNELS | KILN_CAP_PAGED_KV, ELT, PACKED,
     "paged_attention paged_decode paged_prefill paged_prefill_mma", "kiln_op_paged_attention_workspace", NULL, kiln__paged_attention_arch_specs},
    {"dense_linear", KILN__VERSION_DENSE_LINEAR, BLAS, ELT, PACKED, "skinny_linear", "kiln_op_dense_linear_workspace",
     kiln__skinny_linear_specs, NULL},
    {"dense_linear_norm", KILN__VERSION_DENSE_LINEAR_NORM, BLAS, ELT, PACKED, "tma_linear skinny_linear rms_norm",
     "kiln_op_dense_linear_norm_workspace", NULL, kiln__linear_norm_arch_specs},
};
#define N_ROWS (sizeof rows / sizeof rows[0])

const kiln__op_row *kiln__catalog_rows(size_t *n)
{
    *n = N_ROWS;
    return rows;
}

const kiln__op_row *kiln__catalog_find(const char *id)
{
    for (size_t i = 0; id && i < N_ROWS; i++)
        if (!strcmp(rows[i].id, id))
            return &rows[i];
    return NULL;
}

kiln_status kiln__catalog_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink, void *user)
{
    for (size_t i = 0; i < N_ROWS; i++) {
        kiln_status st =
            rows[i].arch_specs ? rows[i].arch_specs(cfg, arch, sink, user) : rows[i].specs(cfg, sink, user);
        if (st)
            return st;
    }
    return KILN_OK;
}

void kiln__catalog_digest(const kiln__op_row *r, size_t n, uint8_t out[32])
{
    kiln__hasher *h = kiln__hasher_new();
    if (!h) {
        memset(out, 0, 32);
        return;
    }
    kiln__hasher_str(h, "kiln-implementation-2");
    for (size_t i = 0; i < kiln__embedded_count; i++) {
        kiln__hasher_str(h, kiln__embedded_files[i].name);
        kiln__hasher_part(h, kiln__embedded_files[i].data, kiln__embedded_files[i].size);
    }
    for (size_t i = 0; i < n; i++) {
        char part[KILN_OP_ID_MAX + 16];
        snprintf(part, sizeof part, "%s:%u", r[i].id, (unsigned)r[i].version);
        kiln__hasher_str(h, part);
    }
    if (kiln__hasher_final(h, out) != 0)
        memset(out, 0, 32);
}

/* Declared in common/internal.h for the runtime. */
void kiln__implementation_digest(uint8_t out[32]) { kiln__catalog_digest(rows, N_ROWS, out); }

uint32_t kiln__catalog_capabilities(void)
{
    uint32_t caps = 0;
    for (size_t i = 0; i < N_ROWS; i++)
        caps |= rows[i].capabilities;
    return caps;
}

/* ---- the public catalog ---- */

static void fill(const kiln__op_row *r, void *dst, size_t bytes)
{
    kiln_op_info info;
    memset(&info, 0, sizeof info); /* the padding too: the caller gets no stack bytes */
    info.size = (uint32_t)bytes;
    info.id = r->id;
    info.version = r->version;
    info.capabilities = r->capabilities;
    info.dtypes = r->dtypes;
    info.batching = r->batching;
    info.templates = r->templates;
    info.workspace = r->workspace;
    memcpy(dst, &info, bytes);
}

/* The bytes of each caller's kiln_op_info: its size field's, capped at ours. */
static kiln_status info_bytes(const char *fn, const kiln_op_info *caller, size_t *bytes)
{
    const uint32_t size = caller->size;
    *bytes = sizeof(kiln_op_info);
    kiln_status st = kiln__check_size_field(NULL, fn, "kiln_op_info", size, sizeof(kiln_op_info));
    if (st)
        return st;
    if (size && size < sizeof(kiln_op_info))
        *bytes = size;
    return KILN_OK;
}

kiln_status kiln_op_catalog(kiln_op_info *ops, size_t *count)
{
    if (!count)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_op_catalog: count is NULL");
    if (!ops) {
        *count = N_ROWS;
        return KILN_OK;
    }
    if (*count) {
        size_t bytes;
        kiln_status st = info_bytes("kiln_op_catalog", ops, &bytes);
        if (st)
            return st;
        /* The caller's elements are ops[0].size bytes apart. */
        const size_t stride = ops->size ? ops->size : sizeof(kiln_op_info);
        for (size_t i = 0; i < *count && i < N_ROWS; i++)
            fill(&rows[i], (unsigned char *)ops + i * stride, bytes);
    }
    *count = N_ROWS;
    return KILN_OK;
}

kiln_status kiln_op_catalog_find(const char *id, kiln_op_info *out)
{
    if (!id || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_op_catalog_find: %s is NULL", id ? "out" : "id");
    size_t bytes;
    kiln_status st = info_bytes("kiln_op_catalog_find", out, &bytes);
    if (st)
        return st;
    const kiln__op_row *r = kiln__catalog_find(id);
    if (!r)
        return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "kiln_op_catalog_find: no operation '%s' (kiln ls-ops lists them)",
                          id);
    fill(r, out, bytes);
    return KILN_OK;
}
