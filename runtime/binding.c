/* Binding arenas: per-step values in device memory, patched through a host
 * mirror and uploaded in one coalesced copy per submission. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"

kiln_status kiln__binding_layout_check(kiln__errslot *err, const kiln_binding_slot *slots, size_t n_slots,
                                       size_t total_bytes)
{
    if (!n_slots || !total_bytes || n_slots > UINT32_MAX)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "binding layout: %zu slots over %zu bytes; need both > 0",
                          n_slots, total_bytes);
    /* The slots must tile [0, total) exactly: sorted, non-empty, no gap, no overlap. */
    size_t at = 0;
    for (size_t i = 0; i < n_slots; i++) {
        size_t end;
        if (!slots[i].bytes || kiln__add_overflows(slots[i].offset, slots[i].bytes, &end))
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "binding layout: slot %zu [%zu, +%zu) is empty or overflows",
                              i, slots[i].offset, slots[i].bytes);
        if (slots[i].offset != at)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "binding layout: slot %zu starts at %zu, expected %zu (%s)", i, slots[i].offset, at,
                              slots[i].offset > at ? "a gap" : "an overlap or out of order");
        at = end;
    }
    if (at != total_bytes)
        return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                          "binding layout: the slots cover %zu bytes, the layout has %zu", at, total_bytes);
    return KILN_OK;
}

kiln_status kiln_binding_arena_create(kiln_runtime *rt, const kiln_binding_slot *slots, size_t n_slots,
                                      size_t total_bytes, kiln_binding_arena **out)
{
    if (!rt || !out || (n_slots && !slots))
        return kiln__fail(rt ? &rt->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_binding_arena_create: NULL argument");
    *out = NULL;
    kiln_status st = kiln__binding_layout_check(&rt->err, slots, n_slots, total_bytes);
    if (st)
        return st;
    kiln_binding_arena *a = calloc(1, sizeof *a);
    if (!a)
        return kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    a->rt = rt;
    a->n_slots = n_slots;
    a->total = total_bytes;
    a->slots = malloc(n_slots * sizeof *slots);
    a->mirror = calloc(1, total_bytes);
    if (!a->slots || !a->mirror) {
        st = kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a %zu-byte arena", total_bytes);
        goto out_free;
    }
    memcpy(a->slots, slots, n_slots * sizeof *slots);
    kiln_buffer_desc d = {.bytes = total_bytes, .alignment = 256, .usage = KILN_USAGE_BINDINGS};
    if ((st = kiln_buffer_create_ex(rt, &d, &a->buffer)))
        goto out_free;
    /* The device starts as the mirror does (zeros): a patch uploads only its dirty range. */
    if ((st = kiln_buffer_upload(a->buffer, 0, a->mirror, total_bytes)))
        goto out_free;
    *out = a;
    return KILN_OK;
out_free:
    kiln_binding_arena_destroy(a);
    return st;
}

void kiln_binding_arena_destroy(kiln_binding_arena *a)
{
    if (!a)
        return;
    kiln_buffer_destroy(a->buffer);
    free(a->slots);
    free(a->mirror);
    free(a);
}

kiln_buffer *kiln_binding_arena_buffer(const kiln_binding_arena *a) { return a ? a->buffer : NULL; }
uint64_t kiln_binding_arena_uploads(const kiln_binding_arena *a) { return a ? a->uploads : 0; }

kiln_status kiln_binding_arena_slot(const kiln_binding_arena *a, uint32_t slot, kiln_region *out)
{
    if (!a || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_binding_arena_slot: NULL argument");
    if (slot >= a->n_slots)
        return kiln__fail(&a->rt->err, KILN_ERR_RUNTIME_CONTRACT, "binding slot %u: the layout has %zu", slot,
                          a->n_slots);
    *out = (kiln_region){a->buffer, a->slots[slot].offset, a->slots[slot].offset + a->slots[slot].bytes};
    return KILN_OK;
}

/* Each patch inside its slot; patches sorted by (slot, offset); none overlapping. */
kiln_status kiln__binding_patches_check(kiln__errslot *err, const kiln_binding_slot *slots, size_t n_slots,
                                        const kiln_binding_patch *p, size_t n)
{
    if (n && !p)
        return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, "binding patches: NULL list of %zu", n);
    size_t prev_end = 0;
    for (size_t i = 0; i < n; i++) {
        size_t end;
        if (p[i].slot >= n_slots)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT, "binding patch %zu: slot %u of %zu", i, p[i].slot,
                              n_slots);
        const kiln_binding_slot *s = &slots[p[i].slot];
        if (!p[i].data)
            return kiln__fail(err, KILN_ERR_INVALID_ARGUMENT, "binding patch %zu (slot %u): data is NULL", i,
                              p[i].slot);
        if (!p[i].bytes || kiln__add_overflows(p[i].offset, p[i].bytes, &end) || end > s->bytes)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "binding patch %zu: [%zu, +%zu) is empty or outside slot %u of %zu bytes", i,
                              p[i].offset, p[i].bytes, p[i].slot, s->bytes);
        size_t abs_start = s->offset + p[i].offset;
        if (i && abs_start < prev_end)
            return kiln__fail(err, KILN_ERR_RUNTIME_CONTRACT,
                              "binding patch %zu (slot %u, offset %zu) %s patch %zu: patches are sorted and disjoint",
                              i, p[i].slot, p[i].offset,
                              (p[i].slot < p[i - 1].slot ||
                               (p[i].slot == p[i - 1].slot && p[i].offset < p[i - 1].offset))
                                  ? "comes before"
                                  : "overlaps",
                              i - 1);
        prev_end = s->offset + end;
    }
    return KILN_OK;
}

kiln_status kiln__binding_validate(kiln_binding_arena *a, kiln_runtime *rt, const kiln_binding_patch *p, size_t n)
{
    if (!a)
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT, "binding patches: %zu patches and no arena", n);
    if (a->rt != rt)
        return kiln__fail(&rt->err, KILN_ERR_RUNTIME_CONTRACT,
                          "binding patches: the arena belongs to another runtime (instance %llu, not %llu)",
                          (unsigned long long)a->rt->info.instance_id, (unsigned long long)rt->info.instance_id);
    return kiln__binding_patches_check(&rt->err, a->slots, a->n_slots, p, n);
}

/* Writes the patches into the mirror and enqueues one copy of the dirty range. */
kiln_status kiln__binding_apply(kiln_binding_arena *a, const kiln_binding_patch *p, size_t n, CUstream stream)
{
    size_t lo = SIZE_MAX, hi = 0;
    for (size_t i = 0; i < n; i++) {
        size_t at = a->slots[p[i].slot].offset + p[i].offset;
        memcpy(a->mirror + at, p[i].data, p[i].bytes);
        if (at < lo)
            lo = at;
        if (at + p[i].bytes > hi)
            hi = at + p[i].bytes;
    }
    /* From pageable memory the driver stages the bytes before returning, so
     * the mirror may change again at once; the copy runs in stream order. */
    CUresult r = a->rt->d->cuMemcpyHtoDAsync(kiln__buffer_ptr(a->buffer) + lo, a->mirror + lo, hi - lo, stream);
    if (r != CUDA_SUCCESS)
        return kiln__runtime_cu_fail(a->rt, r, "binding arena upload");
    a->uploads++;
    return KILN_OK;
}
