/* Templates: lookup by id, the headers they include, their entry points. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/internal.h"
#include "jit/internal.h"

#define MAX_TEMPLATES 64

static pthread_once_t once = PTHREAD_ONCE_INIT;
static kiln__template templates[MAX_TEMPLATES];
static size_t n_templates;
static const char *scan_error;

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

static const kiln__embedded_file *find_file(const char *name, size_t len)
{
    for (size_t i = 0; i < kiln__embedded_count; i++)
        if (strlen(kiln__embedded_files[i].name) == len && !strncmp(kiln__embedded_files[i].name, name, len))
            return &kiln__embedded_files[i];
    return NULL;
}

static void add_header(kiln__template *t, const kiln__embedded_file *h)
{
    for (size_t i = 0; i < t->n_headers; i++)
        if (t->headers[i] == h)
            return;
    if (t->n_headers == KILN__TEMPLATE_MAX_HEADERS) {
        scan_error = "a template includes too many headers";
        return;
    }
    /* Insertion keeps them sorted by name: a stable order for the fingerprint. */
    size_t i = t->n_headers++;
    while (i > 0 && strcmp(t->headers[i - 1]->name, h->name) > 0) {
        t->headers[i] = t->headers[i - 1];
        i--;
    }
    t->headers[i] = h;
}

/* Adds every embedded file that text includes as #include "name", recursively. */
static void scan_includes(kiln__template *t, const char *text, int depth)
{
    if (depth > 8)
        return;
    for (const char *p = strstr(text, "#include \""); p; p = strstr(p + 1, "#include \"")) {
        const char *name = p + 10, *end = strchr(name, '"');
        if (!end)
            break;
        const kiln__embedded_file *h = find_file(name, (size_t)(end - name));
        if (!h)
            continue; /* NVRTC will report it */
        size_t before = t->n_headers;
        add_header(t, h);
        if (t->n_headers != before)
            scan_includes(t, h->data, depth + 1);
    }
}

static void scan_entries(kiln__template *t)
{
    static const char tag[] = "//! kiln:entry ";
    char *out = t->entries_text;
    for (const char *p = strstr(t->source->data, tag); p; p = strstr(p + 1, tag)) {
        const char *name = p + sizeof tag - 1;
        size_t len = strcspn(name, " \t\r\n");
        if (!len || len >= KILN_NAME_MAX || t->n_entries == KILN__TEMPLATE_MAX_ENTRIES) {
            scan_error = "a template declares a bad or an extra entry";
            continue;
        }
        memcpy(t->entries[t->n_entries], name, len);
        t->entries[t->n_entries][len] = 0;
        out += sprintf(out, "%s%s", t->n_entries ? "," : "", t->entries[t->n_entries]);
        t->n_entries++;
    }
}

static void scan(void)
{
    for (size_t i = 0; i < kiln__embedded_count && n_templates < MAX_TEMPLATES; i++) {
        const kiln__embedded_file *f = &kiln__embedded_files[i];
        if (!ends_with(f->name, ".cu"))
            continue;
        size_t len = strlen(f->name) - 3;
        if (len >= KILN_NAME_MAX)
            continue;
        kiln__template *t = &templates[n_templates++];
        memcpy(t->id, f->name, len);
        t->id[len] = 0;
        t->source = f;
        scan_includes(t, f->data, 0);
        scan_entries(t);
        t->arch_specific = strstr(f->data, "//! kiln:arch-specific") != NULL;
    }
}

kiln_status kiln__template_find(const char *id, const kiln__template **out)
{
    pthread_once(&once, scan);
    if (scan_error)
        return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "embedded templates are malformed: %s", scan_error);
    for (size_t i = 0; i < n_templates; i++) {
        if (!strcmp(templates[i].id, id)) {
            if (!templates[i].n_entries)
                return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "template %s declares no entry (//! kiln:entry NAME)",
                                  id);
            *out = &templates[i];
            return KILN_OK;
        }
    }
    char known[512] = "";
    for (size_t i = 0, n = 0; i < n_templates && n + KILN_NAME_MAX + 2 < sizeof known; i++)
        n += (size_t)snprintf(known + n, sizeof known - n, "%s%s", i ? ", " : "", templates[i].id);
    return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "no template \"%s\" (known: %s)", id, known);
}

const char *kiln_template_id(size_t index)
{
    pthread_once(&once, scan);
    return index < n_templates ? templates[index].id : NULL;
}

size_t kiln_spec_compile_cost(const kiln_spec *spec)
{
    const kiln__template *t;
    if (!spec || kiln__template_find(spec->template_id, &t) != KILN_OK)
        return 0;
    size_t cost = t->source->size;
    for (size_t i = 0; i < t->n_headers; i++)
        cost += t->headers[i]->size;
    return cost;
}
