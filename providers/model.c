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
    spec_list l = {0};
    /* Every operation of the catalog, in its order. */
    kiln_status st = kiln__catalog_specs(cfg, arch, add_spec, &l);
    if (st) {
        free(l.items);
        return st;
    }
    *specs = l.items;
    *count = l.n;
    return KILN_OK;
}
