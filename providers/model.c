/* The specializations a model config needs. */
#include <stdlib.h>
#include <string.h>

#include "providers/internal.h"

/* ---- specializations ---- */

typedef struct spec_list {
    kiln_spec *items;
    size_t n, cap;
} spec_list;

static kiln_status add_spec(void *user, const kiln_spec *spec)
{
    spec_list *l = user;
    for (size_t i = 0; i < l->n; i++)
        if (!memcmp(&l->items[i], spec, sizeof *spec))
            return KILN_OK;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        kiln_spec *p = realloc(l->items, cap * sizeof *p);
        if (!p)
            return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        l->items = p;
        l->cap = cap;
    }
    l->items[l->n++] = *spec;
    return KILN_OK;
}

/* What kiln cannot serve is refused by name, rather than listed as a dense
 * model of its sizes: prewarm would compile kernels it never runs and none of
 * those it does. A hand-built config, or a file without a model_type, is
 * taken as the Llama layout. */
static kiln_status servable(const kiln_model_config *cfg)
{
    static const char *const dense[] = {"llama", "mistral", "qwen2", "qwen3", "config", "llama-3-8b"};
    static const char *const moe[] = {"mixtral", "qwen2_moe", "qwen3_moe"};
    int known = 0;
    const char *const *families = cfg->num_experts ? moe : dense;
    const size_t n = cfg->num_experts ? sizeof moe / sizeof moe[0] : sizeof dense / sizeof dense[0];
    for (size_t i = 0; i < n; i++)
        known |= !strcmp(cfg->name, families[i]);
    if (cfg->num_experts && !known)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "model %s: a mixture of experts (%lld experts, %lld a token, expert intermediate size %lld%s) "
                          "of a family kiln does not serve (mixtral, qwen2_moe, qwen3_moe: model_type names it)",
                          cfg->name, (long long)cfg->num_experts, (long long)cfg->num_experts_per_tok,
                          (long long)cfg->moe_intermediate_size, cfg->shared_expert_intermediate_size ? ", a shared expert" : "");
    if (!known)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "model %s: not a family kiln serves (llama, mistral, qwen2, qwen3, and the mixtures of "
                          "experts mixtral, qwen2_moe, qwen3_moe: model_type names it)",
                          cfg->name);
    return KILN_OK;
}

int64_t kiln__dense_intermediate(const kiln_model_config *cfg)
{
    return cfg->num_experts ? cfg->shared_expert_intermediate_size : cfg->intermediate_size;
}

kiln_status kiln_model_specializations(const kiln_model_config *cfg, kiln_spec **specs, size_t *count)
{
    return kiln_model_specializations_for_arch(cfg, NULL, specs, count);
}

kiln_status kiln_model_specializations_for_arch(const kiln_model_config *cfg, const char *arch, kiln_spec **specs,
                                                size_t *count)
{
    if (!cfg || !specs || !count)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_model_specializations%s: NULL argument",
                          arch ? "_for_arch" : "");
    *specs = NULL;
    *count = 0;
    kiln_status st = servable(cfg);
    if (st)
        return st;
    /* What an architecture before sm_80 cannot run at all, refused whole
     * rather than as one compile failure a kernel. */
    const int sm = kiln__arch_number(arch);
    if (sm && sm < 80 && cfg->dtype == KILN_DTYPE_BF16)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "model %s: bf16 needs sm_80 or later, and the arch is %s (f16 runs there)", cfg->name, arch);
    if (sm && sm < 80 && cfg->num_experts)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "model %s: its experts (mma.sync) need sm_80 or later, and the arch is %s", cfg->name, arch);
    spec_list l = {0};
    /* Every operation of the catalog, in its order. */
    st = kiln__catalog_specs(cfg, arch, add_spec, &l);
    if (st) {
        free(l.items);
        return st;
    }
    *specs = l.items;
    *count = l.n;
    return KILN_OK;
}
