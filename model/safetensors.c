/* safetensors files: header parsing, checks and lookup (kiln/safetensors.h). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/internal.h"
#include "kiln/safetensors.h"
#include "model/file.h"
#include "model/json_strict.h"

struct kiln_safetensors {
    char *label;
    const uint8_t *data;
    size_t size;
    void *map; /* the mapping kiln_safetensors_open made, else NULL */
    size_t map_bytes;
    kiln_safetensors_tensor *tensors; /* sorted by name */
    size_t count;
};

typedef struct dtype_info {
    const char *name;
    size_t bytes;
    kiln_dtype dtype;
} dtype_info;

static const dtype_info g_dtypes[] = {
    {"F64", 8, KILN_DTYPE_BYTES}, {"F32", 4, KILN_DTYPE_F32},  {"F16", 2, KILN_DTYPE_F16},
    {"BF16", 2, KILN_DTYPE_BF16}, {"I64", 8, KILN_DTYPE_BYTES}, {"I32", 4, KILN_DTYPE_I32},
    {"I16", 2, KILN_DTYPE_BYTES}, {"I8", 1, KILN_DTYPE_BYTES},  {"U64", 8, KILN_DTYPE_BYTES},
    {"U32", 4, KILN_DTYPE_U32},   {"U16", 2, KILN_DTYPE_BYTES}, {"U8", 1, KILN_DTYPE_U8},
    {"BOOL", 1, KILN_DTYPE_BYTES}, {"F8_E4M3", 1, KILN_DTYPE_BYTES}, {"F8_E5M2", 1, KILN_DTYPE_BYTES},
};

/* A name for messages: at most 80 bytes, control bytes as '?'. */
static void short_name(const char *s, char *buf, size_t cap)
{
    size_t n = 0;
    for (; s[n] && n + 4 < cap && n < 80; n++)
        buf[n] = ((unsigned char)s[n] < 0x20 || s[n] == 0x7f) ? '?' : s[n];
    if (s[n] && n + 4 <= cap) {
        memcpy(buf + n, "...", 3);
        n += 3;
    }
    buf[n] = 0;
}

/* The item's JSON text, shortened, for messages. */
static void value_text(const cJSON *item, char *buf, size_t cap)
{
    char *s = item ? cJSON_PrintUnformatted(item) : NULL;
    if (!s) {
        snprintf(buf, cap, "%s", item ? "(unprintable)" : "(missing)");
        return;
    }
    short_name(s, buf, cap);
    cJSON_free(s);
}

/* A whole number in [0, 2^53] (exact in a double). */
static int whole(const cJSON *item, uint64_t *out)
{
    if (!cJSON_IsNumber(item))
        return 0;
    double v = item->valuedouble;
    if (!isfinite(v) || v < 0 || v != floor(v) || v > 9007199254740992.0)
        return 0;
    *out = (uint64_t)v;
    return 1;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const kiln_safetensors_tensor *)a)->name, ((const kiln_safetensors_tensor *)b)->name);
}

static int by_offset(const void *a, const void *b)
{
    const kiln_safetensors_tensor *x = *(const kiln_safetensors_tensor *const *)a;
    const kiln_safetensors_tensor *y = *(const kiln_safetensors_tensor *const *)b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return (x->bytes > y->bytes) - (x->bytes < y->bytes);
}

static void free_tensors(kiln_safetensors *st)
{
    for (size_t i = 0; i < st->count; i++)
        free((char *)st->tensors[i].name);
    free(st->tensors);
    st->tensors = NULL;
    st->count = 0;
}

/* One entry of the header into *t (its name not yet set). */
static kiln_status parse_entry(const kiln_safetensors *st, const cJSON *e, const char *name, uint64_t data_bytes,
                               uint64_t data_base, kiln_safetensors_tensor *t)
{
    char text[96];
    if (!cJSON_IsObject(e)) {
        value_text(e, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s: entry %s is not an object", st->label, name, text);
    }
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt) || !dt->valuestring) {
        value_text(dt, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s: dtype %s is not a string", st->label, name, text);
    }
    const dtype_info *info = NULL;
    for (size_t i = 0; i < sizeof g_dtypes / sizeof g_dtypes[0]; i++)
        if (!strcmp(dt->valuestring, g_dtypes[i].name))
            info = &g_dtypes[i];
    if (!info) {
        short_name(dt->valuestring, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s: unknown dtype \"%s\"", st->label, name, text);
    }
    t->dtype_name = info->name;
    t->dtype = info->dtype;
    t->element_bytes = info->bytes;
    if (!cJSON_IsArray(shape)) {
        value_text(shape, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s: shape %s is not an array", st->label, name, text);
    }
    int rank = cJSON_GetArraySize(shape);
    if (rank > KILN_SAFETENSORS_MAX_RANK)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s: rank %d exceeds %d", st->label, name, rank,
                          KILN_SAFETENSORS_MAX_RANK);
    t->rank = (uint32_t)rank;
    uint64_t elements = 1;
    int overflow = 0;
    int i = 0;
    for (const cJSON *d = shape->child; d; d = d->next, i++) {
        uint64_t v;
        if (!whole(d, &v) || v > (uint64_t)INT64_MAX) {
            value_text(d, text, sizeof text);
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "%s: tensor %s: dimension %d = %s is not a whole number in [0, 2^53]", st->label, name,
                              i, text);
        }
        t->dims[i] = (int64_t)v;
        overflow |= __builtin_mul_overflow(elements, v, &elements);
    }
    uint64_t bytes = 0;
    if (overflow || __builtin_mul_overflow(elements, (uint64_t)info->bytes, &bytes))
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s: the shape's byte count overflows 64 bits",
                          st->label, name);
    t->elements = elements;
    uint64_t begin, end;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || !whole(offs->child, &begin) ||
        !whole(offs->child->next, &end)) {
        value_text(offs, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "%s: tensor %s: data_offsets %s is not two whole numbers [begin, end]", st->label, name,
                          text);
    }
    if (begin > end || end > data_bytes)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "%s: tensor %s: data_offsets [%llu, %llu] out of range: the data holds %llu bytes",
                          st->label, name, (unsigned long long)begin, (unsigned long long)end,
                          (unsigned long long)data_bytes);
    if (end - begin != bytes)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "%s: tensor %s: data_offsets [%llu, %llu] hold %llu bytes, but %llu elements of %s "
                          "need %llu",
                          st->label, name, (unsigned long long)begin, (unsigned long long)end,
                          (unsigned long long)(end - begin), (unsigned long long)elements, info->name,
                          (unsigned long long)bytes);
    t->offset = data_base + begin;
    t->bytes = bytes;
    t->data = st->data + t->offset;
    return KILN_OK;
}

/* The format indexes every byte of the data: the tensors in order (order[0,
 * m), sorted by offset, not overlapping) leave no gap and end at its end. */
static kiln_status check_indexed(const kiln_safetensors *st, kiln_safetensors_tensor *const *order, size_t m,
                                 uint64_t base, uint64_t data_bytes)
{
    uint64_t at = 0;
    for (size_t i = 0; i < m; i++) {
        const uint64_t begin = order[i]->offset - base;
        if (begin > at) {
            char where[224], na[96], nb[96];
            short_name(order[i]->name, nb, sizeof nb);
            if (i) {
                short_name(order[i - 1]->name, na, sizeof na);
                snprintf(where, sizeof where, "between tensors %s and %s", na, nb);
            } else {
                snprintf(where, sizeof where, "before tensor %s", nb);
            }
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "%s: bytes [%llu, %llu) of the data belong to no tensor (%s); the format indexes "
                              "every byte",
                              st->label, (unsigned long long)at, (unsigned long long)begin, where);
        }
        at = begin + order[i]->bytes;
    }
    if (at != data_bytes)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "%s: the data holds %llu bytes but the tensors end at %llu: %llu bytes after the last "
                          "tensor belong to none; the format indexes every byte",
                          st->label, (unsigned long long)data_bytes, (unsigned long long)at,
                          (unsigned long long)(data_bytes - at));
    return KILN_OK;
}

/* Parses st->data[0, st->size) into st->tensors. */
static kiln_status parse(kiln_safetensors *st)
{
    if (st->size < 8)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "%s: truncated: %zu bytes, shorter than the 8-byte header length", st->label, st->size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | st->data[i];
    if (n > st->size - 8)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "%s: header length %llu runs past the end of the file (%zu bytes after the length)",
                          st->label, (unsigned long long)n, st->size - 8);
    if (n > KILN_SAFETENSORS_MAX_HEADER)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: header length %llu exceeds %u bytes", st->label,
                          (unsigned long long)n, KILN_SAFETENSORS_MAX_HEADER);
    if (n < 2)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: header length %llu: too short for a JSON object", st->label,
                          (unsigned long long)n);
    const char *hdr = (const char *)st->data + 8;
    if (hdr[0] != '{')
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: the header does not start with '{' (byte 0x%02x)", st->label,
                          (unsigned char)hdr[0]);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        size_t pos = at && at >= hdr && at <= hdr + n ? (size_t)(at - hdr) : 0;
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: the header (%llu bytes) is not JSON (near byte %zu)",
                          st->label, (unsigned long long)n, pos);
    }
    kiln_status s = KILN_OK;
    kiln_safetensors_tensor **order = NULL;
    if (!cJSON_IsObject(root)) {
        s = kiln__fail(NULL, KILN_ERR_CONFIG, "%s: the header is not a JSON object", st->label);
        goto out_root;
    }
    for (const char *p = end ? end : hdr + n; p < hdr + n; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            s = kiln__fail(NULL, KILN_ERR_CONFIG, "%s: byte 0x%02x at %zu follows the header's JSON object",
                           st->label, (unsigned char)*p, (size_t)(p - hdr));
            goto out_root;
        }
    /* cJSON reads "a\u0000b" as "a", 08 as 8, and keeps both of two equal
     * keys inside an entry; the tensor names themselves are compared below. */
    char what[256];
    s = kiln__json_strict_check(hdr, (size_t)n, KILN__JSON_TOP_KEYS_MAY_REPEAT, what, sizeof what);
    if (s == KILN_ERR_HOST_OUT_OF_MEMORY) {
        s = kiln__fail(NULL, s, "%s: out of memory checking the header", st->label);
        goto out_root;
    }
    if (s) {
        s = kiln__fail(NULL, s, "%s: the header is not strict JSON: %s of %llu (counting from the header's first "
                       "byte, file byte 8)", st->label, what, (unsigned long long)n);
        goto out_root;
    }
    size_t cap = 0;
    for (const cJSON *e = root->child; e; e = e->next)
        cap++;
    st->tensors = calloc(cap ? cap : 1, sizeof *st->tensors);
    if (!st->tensors) {
        s = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "%s: out of memory for %zu tensors", st->label, cap);
        goto out_root;
    }
    const uint64_t base = 8 + n, data_bytes = st->size - base;
    for (const cJSON *e = root->child; e; e = e->next) {
        char name[96];
        const char *key = e->string ? e->string : "";
        short_name(key, name, sizeof name);
        if (!strcmp(key, "__metadata__")) {
            if (!cJSON_IsObject(e)) {
                s = kiln__fail(NULL, KILN_ERR_CONFIG, "%s: __metadata__ is not an object", st->label);
                goto out_root;
            }
            continue;
        }
        if (!key[0]) {
            s = kiln__fail(NULL, KILN_ERR_CONFIG, "%s: a tensor has an empty name", st->label);
            goto out_root;
        }
        kiln_safetensors_tensor *t = &st->tensors[st->count];
        memset(t, 0, sizeof *t);
        if ((s = parse_entry(st, e, name, data_bytes, base, t)))
            goto out_root;
        t->name = kiln__strdup(key);
        if (!t->name) {
            s = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "%s: out of memory", st->label);
            goto out_root;
        }
        st->count++;
    }
    qsort(st->tensors, st->count, sizeof *st->tensors, by_name);
    for (size_t i = 1; i < st->count; i++)
        if (!strcmp(st->tensors[i - 1].name, st->tensors[i].name)) {
            char name[96];
            short_name(st->tensors[i].name, name, sizeof name);
            s = kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s is listed twice", st->label, name);
            goto out_root;
        }
    /* No two tensors may share a byte (empty ones hold none). */
    order = malloc((st->count ? st->count : 1) * sizeof *order);
    if (!order) {
        s = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "%s: out of memory", st->label);
        goto out_root;
    }
    size_t m = 0;
    for (size_t i = 0; i < st->count; i++)
        if (st->tensors[i].bytes)
            order[m++] = &st->tensors[i];
    qsort(order, m, sizeof *order, by_offset);
    for (size_t i = 1; i < m; i++) {
        const kiln_safetensors_tensor *a = order[i - 1], *b = order[i];
        if (a->offset + a->bytes > b->offset) {
            char na[96], nb[96];
            short_name(a->name, na, sizeof na);
            short_name(b->name, nb, sizeof nb);
            s = kiln__fail(NULL, KILN_ERR_CONFIG,
                           "%s: tensors %s [%llu, %llu) and %s [%llu, %llu) overlap (data offsets)", st->label, na,
                           (unsigned long long)(a->offset - base), (unsigned long long)(a->offset - base + a->bytes),
                           nb, (unsigned long long)(b->offset - base),
                           (unsigned long long)(b->offset - base + b->bytes));
            goto out_root;
        }
    }
    if ((s = check_indexed(st, order, m, base, data_bytes)))
        goto out_root;
out_root:
    free(order);
    cJSON_Delete(root);
    if (s)
        free_tensors(st);
    return s;
}

static kiln_status create(const void *data, size_t size, const char *label, kiln_safetensors **out)
{
    kiln_safetensors *st = calloc(1, sizeof *st);
    if (!st)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "safetensors: out of memory");
    st->label = kiln__strdup(label ? label : "safetensors");
    if (!st->label) {
        free(st);
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "safetensors: out of memory");
    }
    st->data = data;
    st->size = size;
    *out = st;
    return KILN_OK;
}

kiln_status kiln_safetensors_parse(const void *data, size_t size, const char *label, kiln_safetensors **out)
{
    if (!out || (!data && size))
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_safetensors_parse: NULL %s", out ? "data" : "out");
    *out = NULL;
    kiln_safetensors *st = NULL;
    kiln_status s = create(data, size, label, &st);
    if (s)
        return s;
    if ((s = parse(st))) {
        kiln_safetensors_close(st);
        return s;
    }
    *out = st;
    return KILN_OK;
}

kiln_status kiln_safetensors_open(const char *path, kiln_safetensors **out)
{
    if (!path || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_safetensors_open: NULL %s", path ? "out" : "path");
    *out = NULL;
    int fd;
    size_t size;
    kiln_status s = kiln__open_regular(path, &fd, &size);
    if (s)
        return s;
    void *map = NULL;
    if (size) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int e = errno;
            close(fd);
            return kiln__fail(NULL, KILN_ERR_IO, "%s: cannot map %zu bytes: %s", path, size, strerror(e));
        }
    }
    close(fd);
    kiln_safetensors *st = NULL;
    s = create(map, size, path, &st);
    if (s) {
        if (map)
            munmap(map, size);
        return s;
    }
    st->map = map;
    st->map_bytes = size;
    if ((s = parse(st))) {
        kiln_safetensors_close(st);
        return s;
    }
    *out = st;
    return KILN_OK;
}

void kiln_safetensors_close(kiln_safetensors *st)
{
    if (!st)
        return;
    free_tensors(st);
    if (st->map)
        munmap(st->map, st->map_bytes);
    free(st->label);
    free(st);
}

size_t kiln_safetensors_count(const kiln_safetensors *st) { return st ? st->count : 0; }

const kiln_safetensors_tensor *kiln_safetensors_at(const kiln_safetensors *st, size_t index)
{
    return st && index < st->count ? &st->tensors[index] : NULL;
}

const char *kiln_safetensors_label(const kiln_safetensors *st) { return st ? st->label : ""; }

const kiln_safetensors_tensor *kiln_safetensors_find(const kiln_safetensors *st, const char *name)
{
    if (!st || !name || !st->count)
        return NULL;
    kiln_safetensors_tensor key = {.name = name};
    return bsearch(&key, st->tensors, st->count, sizeof key, by_name);
}

static void shape_text(uint32_t rank, const int64_t *dims, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (uint32_t i = 0; i < rank && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)dims[i]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
}

kiln_status kiln_safetensors_expect(const kiln_safetensors *st, const char *name, kiln_dtype dtype, uint32_t rank,
                                    const int64_t *dims, const kiln_safetensors_tensor **out)
{
    if (!st || !name || (rank && !dims) || rank > KILN_SAFETENSORS_MAX_RANK)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_safetensors_expect: bad arguments");
    if (out)
        *out = NULL;
    const kiln_safetensors_tensor *t = kiln_safetensors_find(st, name);
    if (!t)
        return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "%s: tensor %s is missing", st->label, name);
    if (t->dtype != dtype || t->dtype == KILN_DTYPE_BYTES) {
        const char *want = dtype == KILN_DTYPE_F16    ? "F16"
                           : dtype == KILN_DTYPE_BF16 ? "BF16"
                           : dtype == KILN_DTYPE_F32  ? "F32"
                           : dtype == KILN_DTYPE_U32  ? "U32"
                           : dtype == KILN_DTYPE_I32  ? "I32"
                           : dtype == KILN_DTYPE_U8   ? "U8"
                                                      : kiln_dtype_name(dtype);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s: dtype %s, expected %s", st->label, name,
                          t->dtype_name, want);
    }
    int same = t->rank == rank;
    for (uint32_t i = 0; same && i < rank; i++)
        same = t->dims[i] == dims[i];
    if (!same) {
        char want[160], got[160];
        shape_text(rank, dims, want, sizeof want);
        shape_text(t->rank, t->dims, got, sizeof got);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "%s: tensor %s: shape %s, expected %s", st->label, name, got, want);
    }
    if (out)
        *out = t;
    return KILN_OK;
}
