/* NVRTC: normalized options, the fingerprint, compilation to cubin. */
#include <ctype.h>
#include <inttypes.h>
#include <nvrtc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/internal.h"
#include "jit/internal.h"

/* Options every kiln compile uses; a caller's options join them. -minimal
 * leaves out the runtime's device API, textures and driver types, which kiln's
 * templates never use, and so shortens every compile. */
static const char *const default_options[] = {"--std=c++17", "-minimal"};

/* NVRTC 12.9 and later keep their own cache (the driver's compute cache,
 * ~/.nv/ComputeCache), whose first use serializes every compiling thread
 * behind a driver lock and makes compile times depend on what an earlier
 * process left there; kiln's database is the cache, so that one is off
 * (bench/bench_prewarm.sh measures parallel compiles). The option changes where
 * the cubin comes from, never its bytes, so like the architecture it is not
 * part of the fingerprint. */
#define NO_CACHE_OPTION "--no-cache"

static pthread_once_t no_cache_once = PTHREAD_ONCE_INIT;
static int no_cache_known; /* this NVRTC accepts --no-cache */

static void probe_no_cache(void)
{
    int major = 0, minor = 0;
    no_cache_known = nvrtcVersion(&major, &minor) == NVRTC_SUCCESS && (major > 12 || (major == 12 && minor >= 9));
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

void kiln__options_free(kiln__nvrtc_options *o)
{
    if (!o)
        return;
    for (size_t i = 0; i < o->n; i++)
        free(o->items[i]);
    free(o->items);
    o->items = NULL;
    o->n = 0;
}

/* Trims blanks, refuses what kiln sets itself (the architecture, the output
 * kind), sorts and drops duplicates: the same options in any order give one
 * list, and so one fingerprint. */
kiln_status kiln__options_normalize(const char *const *opts, size_t n, kiln__nvrtc_options *out)
{
    size_t n_def = sizeof default_options / sizeof default_options[0];
    out->n = 0;
    out->items = calloc(n + n_def, sizeof(char *));
    if (!out->items)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (size_t i = 0; i < n + n_def; i++) {
        const char *s = i < n_def ? default_options[i] : opts[i - n_def];
        if (!s)
            goto bad_null;
        while (isspace((unsigned char)*s))
            s++;
        size_t len = strlen(s);
        while (len && isspace((unsigned char)s[len - 1]))
            len--;
        if (!len || s[0] != '-' || !strncmp(s, "--gpu-architecture", 18) || !strncmp(s, "-arch", 5) ||
            !strcmp(s, "-ptx") || !strncmp(s, "--relocatable-device-code", 25) || !strncmp(s, "-rdc", 4)) {
            kiln__options_free(out);
            return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                              "NVRTC option \"%s\" is not accepted: options start with '-', and kiln sets the "
                              "architecture (kiln_jit_options.arch) and the output itself",
                              i < n_def ? default_options[i] : opts[i - n_def]);
        }
        char *copy = malloc(len + 1);
        if (!copy) {
            kiln__options_free(out);
            return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        }
        memcpy(copy, s, len);
        copy[len] = 0;
        out->items[out->n++] = copy;
    }
    qsort(out->items, out->n, sizeof(char *), cmp_str);
    size_t w = 0;
    for (size_t i = 0; i < out->n; i++) {
        if (w && !strcmp(out->items[w - 1], out->items[i]))
            free(out->items[i]);
        else
            out->items[w++] = out->items[i];
    }
    out->n = w;
    return KILN_OK;
bad_null:
    kiln__options_free(out);
    return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "NVRTC option is NULL");
}

kiln_status kiln__nvrtc_version(int *major, int *minor)
{
    nvrtcResult r = nvrtcVersion(major, minor);
    if (r != NVRTC_SUCCESS)
        return kiln__fail(NULL, KILN_ERR_NVRTC, "nvrtcVersion: %s", nvrtcGetErrorString(r));
    return KILN_OK;
}

kiln_status kiln__arch_check(const char *arch)
{
    if (!arch || strncmp(arch, "sm_", 3) || !isdigit((unsigned char)arch[3]) || !isdigit((unsigned char)arch[4]))
        goto bad;
    const char *p = arch + 5;
    while (isdigit((unsigned char)*p))
        p++;
    if (*p == 'a' || *p == 'f')
        p++;
    if (*p || p - arch > 10)
        goto bad;
    /* The spelling is right; does this NVRTC know the architecture? */
    int n = 0, want = atoi(arch + 3);
    if (nvrtcGetNumSupportedArchs(&n) != NVRTC_SUCCESS || n <= 0 || n > 256)
        return KILN_OK; /* cannot tell: the compile will say */
    int archs[256];
    if (nvrtcGetSupportedArchs(archs) != NVRTC_SUCCESS)
        return KILN_OK;
    char list[256 * 5] = "";
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        if (archs[i] == want)
            return KILN_OK;
        len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", i ? " " : "", archs[i]);
    }
    return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "architecture %s is not supported by this NVRTC (it knows sm_: %s)",
                      arch, list);
bad:
    return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "architecture \"%s\" is not of the form sm_XY (e.g. sm_90)",
                      arch ? arch : "(null)");
}

kiln_status kiln__fingerprint(const kiln__template *t, const kiln_spec *spec, const kiln__nvrtc_options *opts,
                              const char *arch, int nvrtc_major, int nvrtc_minor, uint8_t out[32])
{
    kiln__hasher *h = kiln__hasher_new();
    if (!h)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    char buf[64];
    kiln__hasher_str(h, KILN__FINGERPRINT_SCHEMA);
    kiln__hasher_str(h, t->id);
    kiln__hasher_part(h, t->source->data, t->source->size);
    snprintf(buf, sizeof buf, "headers:%zu", t->n_headers);
    kiln__hasher_str(h, buf);
    for (size_t i = 0; i < t->n_headers; i++) {
        kiln__hasher_str(h, t->headers[i]->name);
        kiln__hasher_part(h, t->headers[i]->data, t->headers[i]->size);
    }
    snprintf(buf, sizeof buf, "options:%zu", opts->n);
    kiln__hasher_str(h, buf);
    for (size_t i = 0; i < opts->n; i++)
        kiln__hasher_str(h, opts->items[i]);
    kiln__hasher_str(h, arch);
    snprintf(buf, sizeof buf, "nvrtc:%d.%d", nvrtc_major, nvrtc_minor);
    kiln__hasher_str(h, buf);
    /* kiln_spec keeps its constants sorted by name: the canonical order. */
    snprintf(buf, sizeof buf, "constants:%u", spec->n_constants);
    kiln__hasher_str(h, buf);
    for (uint32_t i = 0; i < spec->n_constants; i++) {
        kiln__hasher_str(h, spec->constants[i].name);
        snprintf(buf, sizeof buf, "%" PRId64, spec->constants[i].value);
        kiln__hasher_str(h, buf);
    }
    if (kiln__hasher_final(h, out) != 0)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "SHA-256 failed");
    return KILN_OK;
}

/* 16 hex digits of SHA-256 over the given parts. */
static void digest16(kiln__hasher *h, char out[17])
{
    uint8_t fp[32];
    if (!h || kiln__hasher_final(h, fp) != 0)
        memset(fp, 0, sizeof fp);
    kiln__hex(fp, 8, out);
}

kiln_status kiln__fingerprint_parts(const kiln__template *t, const kiln_spec *spec, const kiln__nvrtc_options *opts,
                                    const char *arch, int nvrtc_major, int nvrtc_minor, char *buf, size_t cap)
{
    char source[17], headers[17], options[17], consts[KILN_SPEC_MAX_CONSTANTS * (KILN_NAME_MAX + 24)];
    kiln__hasher *h = kiln__hasher_new();
    if (h)
        kiln__hasher_part(h, t->source->data, t->source->size);
    digest16(h, source);
    h = kiln__hasher_new();
    for (size_t i = 0; h && i < t->n_headers; i++) {
        kiln__hasher_str(h, t->headers[i]->name);
        kiln__hasher_part(h, t->headers[i]->data, t->headers[i]->size);
    }
    digest16(h, headers);
    h = kiln__hasher_new();
    for (size_t i = 0; h && i < opts->n; i++)
        kiln__hasher_str(h, opts->items[i]);
    digest16(h, options);
    kiln_status st = kiln_spec_constants_text(spec, consts, sizeof consts);
    if (st)
        return st;
    int n = snprintf(buf, cap, "schema=%s;template=%s;source=%s;headers=%s;options=%s;arch=%s;nvrtc=%d.%d;constants=%s",
                     KILN__FINGERPRINT_SCHEMA, t->id, source, headers, options, arch, nvrtc_major, nvrtc_minor, consts);
    if (n < 0 || (size_t)n >= cap)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "fingerprint parts longer than %zu bytes", cap);
    return KILN_OK;
}

static char *program_log(nvrtcProgram prog)
{
    size_t log_size = 0;
    nvrtcGetProgramLogSize(prog, &log_size);
    char *log = malloc(log_size + 1);
    if (log && nvrtcGetProgramLog(prog, log) == NVRTC_SUCCESS)
        log[log_size] = 0;
    else if (log)
        log[0] = 0;
    return log;
}

kiln_status kiln__compile(const kiln__template *t, const kiln_spec *spec, const kiln__nvrtc_options *opts,
                          const char *arch, void **cubin, size_t *size)
{
    return kiln__compile_logged(t, spec, opts, arch, cubin, size, NULL);
}

kiln_status kiln__compile_logged(const kiln__template *t, const kiln_spec *spec, const kiln__nvrtc_options *opts,
                                 const char *arch, void **cubin, size_t *size, char **log_out)
{
    if (log_out)
        *log_out = NULL;
    *cubin = NULL;
    *size = 0;
    /* The prelude: one #define per constant, then the template from its line 1. */
    size_t cap = t->source->size + 128 + (size_t)spec->n_constants * (KILN_NAME_MAX + 40);
    char *src = malloc(cap);
    if (!src)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    size_t n = 0;
    for (uint32_t i = 0; i < spec->n_constants; i++)
        n += (size_t)snprintf(src + n, cap - n, "#define KILN_%s %" PRId64 "LL\n", spec->constants[i].name,
                              spec->constants[i].value);
    n += (size_t)snprintf(src + n, cap - n, "#line 1 \"%s\"\n", t->source->name);
    memcpy(src + n, t->source->data, t->source->size + 1);

    const char *header_src[KILN__TEMPLATE_MAX_HEADERS], *header_names[KILN__TEMPLATE_MAX_HEADERS];
    for (size_t i = 0; i < t->n_headers; i++) {
        header_src[i] = t->headers[i]->data;
        header_names[i] = t->headers[i]->name;
    }
    const char *argv[64];
    char arch_opt[48];
    size_t argc = 0;
    /* An arch-specific template (wgmma, setmaxnreg) is built for the
     * architecture's own features from sm_90 on, sm_90 -> sm_90a: its cubin
     * loads on that architecture only, which is what the jit is for (before
     * sm_90 there is no such target, and the template guards its body). The
     * directive is in the source, so the fingerprint already tells the two
     * builds apart. */
    const size_t alen = strlen(arch);
    const int add_a = t->arch_specific && alen && isdigit((unsigned char)arch[alen - 1]) && atoi(arch + 3) >= 90;
    snprintf(arch_opt, sizeof arch_opt, "--gpu-architecture=%s%s", arch, add_a ? "a" : "");
    argv[argc++] = arch_opt;
    int no_cache = 0;
    for (size_t i = 0; i < opts->n && argc < 63; i++) {
        argv[argc++] = opts->items[i];
        no_cache |= !strcmp(opts->items[i], NO_CACHE_OPTION) || !strcmp(opts->items[i], "-no-cache");
    }
    pthread_once(&no_cache_once, probe_no_cache);
    if (no_cache_known && !no_cache)
        argv[argc++] = NO_CACHE_OPTION;

    nvrtcProgram prog = NULL;
    kiln_status st = KILN_OK;
    char *log = NULL;
    nvrtcResult r = nvrtcCreateProgram(&prog, src, t->source->name, (int)t->n_headers, header_src, header_names);
    if (r != NVRTC_SUCCESS) {
        st = kiln__fail(NULL, KILN_ERR_NVRTC, "nvrtcCreateProgram(%s): %s", t->id, nvrtcGetErrorString(r));
        goto out_free_src;
    }
    r = nvrtcCompileProgram(prog, (int)argc, argv);
    if (r != NVRTC_SUCCESS) {
        log = program_log(prog);
        char consts[KILN_SPEC_MAX_CONSTANTS * (KILN_NAME_MAX + 24)];
        kiln_spec_constants_text(spec, consts, sizeof consts);
        st = kiln__fail(NULL, r == NVRTC_ERROR_COMPILATION ? KILN_ERR_NVRTC_COMPILE : KILN_ERR_NVRTC,
                        "NVRTC could not compile template %s for %s with %s: %s\n%s", t->id, arch, consts,
                        nvrtcGetErrorString(r), log ? log : "(no log)");
        goto out_destroy;
    }
    size_t cubin_size = 0;
    r = nvrtcGetCUBINSize(prog, &cubin_size);
    if (r != NVRTC_SUCCESS || cubin_size == 0) {
        st = kiln__fail(NULL, KILN_ERR_NVRTC, "nvrtcGetCUBINSize(%s): %s (%zu bytes)", t->id, nvrtcGetErrorString(r),
                        cubin_size);
        goto out_destroy;
    }
    void *bin = malloc(cubin_size);
    if (!bin) {
        st = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a %zu-byte cubin", cubin_size);
        goto out_destroy;
    }
    r = nvrtcGetCUBIN(prog, bin);
    if (r != NVRTC_SUCCESS) {
        free(bin);
        st = kiln__fail(NULL, KILN_ERR_NVRTC, "nvrtcGetCUBIN(%s): %s", t->id, nvrtcGetErrorString(r));
        goto out_destroy;
    }
    *cubin = bin;
    *size = cubin_size;
    if (log_out && !(*log_out = program_log(prog))) {
        free(bin);
        *cubin = NULL;
        *size = 0;
        st = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for NVRTC's log of %s", t->id);
    }
out_destroy:
    free(log);
    nvrtcDestroyProgram(&prog);
out_free_src:
    free(src);
    return st;
}
