/* The jit: specializations -> in-memory table -> cache database -> NVRTC,
 * with one compile per key however many threads ask at once. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/internal.h"
#include "cache/cache.h"
#include "jit/internal.h"
#include "jit/nearest.h"
#include "runtime/device.h"

typedef enum entry_state { ENTRY_BUSY, ENTRY_READY, ENTRY_FAILED } entry_state;

typedef struct entry {
    kiln_spec spec;
    uint64_t hash;
    entry_state state;
    int fingerprinted, persisted, loaded;
    uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
    const kiln__template *tmpl;
    CUmodule module;
    CUfunction functions[KILN__TEMPLATE_MAX_ENTRIES];
    kiln_status failure;
    char *failure_msg;
} entry;

struct kiln_kernel {
    entry e; /* a kernel is its table entry */
};

struct kiln_jit {
    kiln_cache *cache;
    kiln_runtime *rt;
    char arch[16];
    kiln__nvrtc_options opts;
    int nvrtc_major, nvrtc_minor;
    pthread_mutex_t lock;
    pthread_cond_t done;
    entry **slots; /* open addressing, capacity a power of two */
    size_t cap, count;
    kiln_jit_counters counters;
    int strict;                   /* a miss fails (KILN_JIT_COMPILE_OFF) instead of compiling */
    unsigned compile_slots;       /* free NVRTC slots, guarded by lock */
    unsigned compiling, peak_compiling;
    pthread_cond_t slot_free;
    kiln__errslot err;
};

/* ---- specializations ---- */

static int valid_name(const char *s)
{
    if (!s || !*s || strlen(s) >= KILN_NAME_MAX)
        return 0;
    for (const char *p = s; *p; p++) {
        int ok = (*p >= 'A' && *p <= 'Z') || *p == '_' || (p != s && *p >= '0' && *p <= '9');
        if (!ok)
            return 0;
    }
    return 1;
}

kiln_status kiln_spec_init(kiln_spec *spec, const char *template_id)
{
    if (!spec || !template_id || !*template_id || strlen(template_id) >= KILN_NAME_MAX)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_spec_init: template id \"%s\" is empty or too long",
                          template_id ? template_id : "(null)");
    memset(spec, 0, sizeof *spec);
    strcpy(spec->template_id, template_id);
    return KILN_OK;
}

kiln_status kiln_spec_set(kiln_spec *spec, const char *name, int64_t value)
{
    if (!spec || !valid_name(name))
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                          "constant name \"%s\" is not [A-Z_][A-Z0-9_]* of at most %d characters",
                          name ? name : "(null)", KILN_NAME_MAX - 1);
    uint32_t i = 0;
    while (i < spec->n_constants && strcmp(spec->constants[i].name, name) < 0)
        i++;
    if (i < spec->n_constants && !strcmp(spec->constants[i].name, name)) {
        spec->constants[i].value = value;
        return KILN_OK;
    }
    if (spec->n_constants == KILN_SPEC_MAX_CONSTANTS)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "spec %s: more than %d constants", spec->template_id,
                          KILN_SPEC_MAX_CONSTANTS);
    /* Kept sorted by name: the canonical order, whatever order they were set in. */
    memmove(&spec->constants[i + 1], &spec->constants[i], (spec->n_constants - i) * sizeof spec->constants[0]);
    memset(&spec->constants[i], 0, sizeof spec->constants[i]);
    strcpy(spec->constants[i].name, name);
    spec->constants[i].value = value;
    spec->n_constants++;
    return KILN_OK;
}

kiln_status kiln_spec_constants_text(const kiln_spec *spec, char *buf, size_t cap)
{
    if (!spec || !buf || !cap)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_spec_constants_text: NULL argument");
    size_t n = 0;
    buf[0] = 0;
    for (uint32_t i = 0; i < spec->n_constants; i++) {
        int w = snprintf(buf + n, cap - n, "%s%s=%" PRId64, i ? ";" : "", spec->constants[i].name,
                         spec->constants[i].value);
        if (w < 0 || (size_t)w >= cap - n)
            return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "constants text longer than %zu bytes", cap);
        n += (size_t)w;
    }
    return KILN_OK;
}

static int spec_equal(const kiln_spec *a, const kiln_spec *b)
{
    if (a->n_constants != b->n_constants || strcmp(a->template_id, b->template_id))
        return 0;
    for (uint32_t i = 0; i < a->n_constants; i++)
        if (a->constants[i].value != b->constants[i].value || strcmp(a->constants[i].name, b->constants[i].name))
            return 0;
    return 1;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 1099511628211ULL;
    return h;
}

static uint64_t spec_hash(const kiln_spec *s)
{
    uint64_t h = fnv(14695981039346656037ULL, s->template_id, strlen(s->template_id));
    for (uint32_t i = 0; i < s->n_constants; i++) {
        h = fnv(h, s->constants[i].name, strlen(s->constants[i].name));
        h = fnv(h, &s->constants[i].value, sizeof s->constants[i].value);
    }
    return h;
}

/* ---- the jit ---- */

/* Whether misses may compile: opts' choice, else $KILN_JIT's. */
static kiln_status compile_mode(int asked, int *strict)
{
    if (asked == KILN_JIT_COMPILE_ENV) {
        const char *env = getenv("KILN_JIT");
        if (env && strcmp(env, "on") && strcmp(env, "off"))
            return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                              "kiln_jit_create: KILN_JIT=\"%s\" is not \"on\" or \"off\" (unset means on)", env);
        asked = env && !strcmp(env, "off") ? KILN_JIT_COMPILE_OFF : KILN_JIT_COMPILE_ON;
    }
    if (asked != KILN_JIT_COMPILE_ON && asked != KILN_JIT_COMPILE_OFF)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_jit_create: compile mode %d is not KILN_JIT_COMPILE_ENV (0), _ON (1) or _OFF (2)",
                          asked);
    *strict = asked == KILN_JIT_COMPILE_OFF;
    return KILN_OK;
}

/* $KILN_NVRTC_LINEINFO=1: every compile also takes -lineinfo, so that a
 * profiler maps each instruction to its template line (other cubins, so
 * other fingerprints and cache rows). */
static kiln_status lineinfo_mode(int *on)
{
    const char *env = getenv("KILN_NVRTC_LINEINFO");
    *on = env && !strcmp(env, "1");
    if (env && strcmp(env, "0") && strcmp(env, "1"))
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_jit_create: KILN_NVRTC_LINEINFO=\"%s\" is not \"0\" or \"1\" (unset means 0)", env);
    return KILN_OK;
}

kiln_status kiln_jit_create(const kiln_jit_options *caller, kiln_jit **out)
{
    kiln_jit_options o;
    if (!out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_jit_create: out is NULL");
    *out = NULL;
    kiln_status st = KILN__READ_SIZED(NULL, "kiln_jit_create", kiln_jit_options, o, caller);
    if (st)
        return st;
    const kiln_jit_options *opts = &o;
    const char *arch = opts->arch;
    kiln_runtime_info info;
    if (!arch && opts->runtime) {
        kiln_runtime_get_info(opts->runtime, &info);
        arch = info.arch;
    }
    if (!arch)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_jit_create: no architecture: name one (e.g. \"sm_90\") or give a runtime");
    int strict = 0, lineinfo = 0;
    if ((st = kiln__arch_check(arch)) || (st = compile_mode(opts->compile, &strict)) || (st = lineinfo_mode(&lineinfo)))
        return st;
    kiln_jit *j = calloc(1, sizeof *j);
    if (!j)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    kiln__errslot_init(&j->err);
    pthread_mutex_init(&j->lock, NULL);
    pthread_cond_init(&j->done, NULL);
    pthread_cond_init(&j->slot_free, NULL);
    if (opts->max_parallel_compiles) {
        j->compile_slots = opts->max_parallel_compiles;
    } else {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        j->compile_slots = cpus < 1 ? 1 : cpus > 16 ? 16 : (unsigned)cpus;
    }
    snprintf(j->arch, sizeof j->arch, "%s", arch);
    j->strict = strict;
    j->cache = opts->cache;
    j->rt = opts->runtime;
    j->cap = 64;
    j->slots = calloc(j->cap, sizeof *j->slots);
    if (!j->slots) {
        st = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        goto out_free;
    }
    const size_t n_opts = opts->n_nvrtc_options;
    if (n_opts && !opts->nvrtc_options) {
        st = kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                        "kiln_jit_create: kiln_jit_options.nvrtc_options is NULL and n_nvrtc_options is %zu", n_opts);
        goto out_free;
    }
    const char **all = n_opts < SIZE_MAX / sizeof *all ? malloc((n_opts + 1) * sizeof *all) : NULL;
    if (!all) {
        st = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        goto out_free;
    }
    for (size_t i = 0; i < n_opts; i++)
        all[i] = opts->nvrtc_options[i];
    if (lineinfo)
        all[n_opts] = "-lineinfo";
    st = kiln__options_normalize(all, n_opts + (lineinfo != 0), &j->opts);
    free(all);
    if (st || (st = kiln__nvrtc_version(&j->nvrtc_major, &j->nvrtc_minor)))
        goto out_free;
    *out = j;
    return KILN_OK;
out_free:
    kiln_jit_destroy(j);
    return st;
}

void kiln_jit_destroy(kiln_jit *j)
{
    if (!j)
        return;
    for (size_t i = 0; i < j->cap && j->slots; i++) {
        entry *e = j->slots[i];
        if (!e)
            continue;
        if (e->module && j->rt)
            kiln__runtime_unload_module(j->rt, e->module);
        free(e->failure_msg);
        free(e);
    }
    free(j->slots);
    kiln__options_free(&j->opts);
    pthread_cond_destroy(&j->done);
    pthread_cond_destroy(&j->slot_free);
    pthread_mutex_destroy(&j->lock);
    kiln__errslot_destroy(&j->err);
    free(j);
}

kiln_runtime *kiln__jit_runtime(const kiln_jit *j) { return j->rt; }
kiln_cache *kiln__jit_cache(const kiln_jit *j) { return j ? j->cache : NULL; }

unsigned kiln__jit_peak_compiles(kiln_jit *j)
{
    pthread_mutex_lock(&j->lock);
    unsigned peak = j->peak_compiling;
    pthread_mutex_unlock(&j->lock);
    return peak;
}
kiln__errslot *kiln__jit_errslot(kiln_jit *j) { return &j->err; }
const char *kiln_jit_errmsg(const kiln_jit *j) { return j ? j->err.msg : ""; }
const char *kiln_jit_arch(const kiln_jit *j) { return j ? j->arch : ""; }

void kiln_jit_get_counters(const kiln_jit *j, kiln_jit_counters *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (!j)
        return;
    pthread_mutex_lock((pthread_mutex_t *)&j->lock);
    *out = j->counters;
    pthread_mutex_unlock((pthread_mutex_t *)&j->lock);
}

static entry *find_locked(kiln_jit *j, const kiln_spec *spec, uint64_t h)
{
    for (size_t i = h & (j->cap - 1);; i = (i + 1) & (j->cap - 1)) {
        entry *e = j->slots[i];
        if (!e)
            return NULL;
        if (e->hash == h && spec_equal(&e->spec, spec))
            return e;
    }
}

static void place(entry **slots, size_t cap, entry *e)
{
    size_t i = e->hash & (cap - 1);
    while (slots[i])
        i = (i + 1) & (cap - 1);
    slots[i] = e;
}

static entry *insert_locked(kiln_jit *j, const kiln_spec *spec, uint64_t h)
{
    if ((j->count + 1) * 10 > j->cap * 7) {
        size_t cap = j->cap * 2;
        entry **slots = calloc(cap, sizeof *slots);
        if (!slots)
            return NULL;
        for (size_t i = 0; i < j->cap; i++)
            if (j->slots[i])
                place(slots, cap, j->slots[i]);
        free(j->slots);
        j->slots = slots;
        j->cap = cap;
    }
    entry *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    e->spec = *spec;
    e->hash = h;
    e->state = ENTRY_BUSY;
    place(j->slots, j->cap, e);
    j->count++;
    return e;
}

/* Strict mode's answer to a miss: what was asked for and the nearest row of
 * the databases, as kiln explain would say it. */
static kiln_status refuse_compile(kiln_jit *j, const entry *e, const char *consts, const char *parts)
{
    char hex[2 * KILN_FINGERPRINT_SIZE + 1], why[KILN__EXPLAIN_MAX];
    kiln_fingerprint_hex(e->fingerprint, hex);
    if (!j->cache) {
        snprintf(why, sizeof why, "the jit has no database");
    } else {
        kiln__rows rows = {0};
        kiln_status st = kiln__rows_collect(j->cache, &rows);
        if (st)
            snprintf(why, sizeof why, "nearest unknown (listing %s failed: %s)", kiln_cache_path(j->cache),
                     st == KILN_ERR_HOST_OUT_OF_MEMORY ? "out of memory" : kiln_errmsg());
        else
            kiln__rows_explain_miss(&rows, parts, NULL, why, sizeof why);
        kiln__rows_free(&rows);
    }
    return kiln__fail(NULL, KILN_ERR_JIT_DISABLED,
                      "compiling is off (KILN_JIT=off or kiln_jit_options.compile) and no database holds kernel %s: "
                      "template %s, constants %s, arch %s, nvrtc %d.%d; %s",
                      hex, e->spec.template_id, *consts ? consts : "(none)", j->arch, j->nvrtc_major,
                      j->nvrtc_minor, why);
}

/* Makes the entry's cubin exist in the cache, and, when load is set, loaded.
 * Runs outside the lock: only the thread that marked the entry busy is here. */
static kiln_status resolve(kiln_jit *j, entry *e, int load, int *compiled)
{
    kiln_status st;
    void *cubin = NULL;
    size_t size = 0;
    if (!e->tmpl && (st = kiln__template_find(e->spec.template_id, &e->tmpl)))
        return st;
    if (!e->fingerprinted) {
        if ((st = kiln__fingerprint(e->tmpl, &e->spec, &j->opts, j->arch, j->nvrtc_major, j->nvrtc_minor,
                                    e->fingerprint)))
            return st;
        e->fingerprinted = 1;
    }
    /* What the fingerprint was computed from: a row under it must be of this
     * kernel (a key moved onto another kernel's row passes its checksum). */
    char consts[KILN_SPEC_MAX_CONSTANTS * (KILN_NAME_MAX + 24)], parts[2048];
    kiln_cache_record rec = {.template_id = e->tmpl->id,
                             .constants = consts,
                             .arch = j->arch,
                             .nvrtc_major = j->nvrtc_major,
                             .nvrtc_minor = j->nvrtc_minor,
                             .entries = e->tmpl->entries_text,
                             .parts = parts};
    memcpy(rec.fingerprint, e->fingerprint, KILN_FINGERPRINT_SIZE);
    if ((st = kiln_spec_constants_text(&e->spec, consts, sizeof consts)))
        return st;
    if (kiln__fingerprint_parts(e->tmpl, &e->spec, &j->opts, j->arch, j->nvrtc_major, j->nvrtc_minor, parts,
                                sizeof parts))
        parts[0] = 0; /* advisory: a row without parts still loads */
    kiln_status lookup = KILN_OK;
    /* Also when loading what an earlier prepare found: the row is the cubin. */
    if (j->cache && (!e->persisted || load)) {
        int found = 0;
        unsigned dropped = 0;
        /* Verified even when only preparing: prewarm must not count a corrupt row as cached. */
        st = kiln__cache_load(j->cache, e->fingerprint, &rec, load, &cubin, &size, &found, &dropped);
        if (!st && found && !load) {
            free(cubin);
            cubin = NULL;
        }
        pthread_mutex_lock(&j->lock);
        j->counters.corrupt_dropped += dropped;
        if (found && load)
            j->counters.database_hits++;
        if (st)
            j->counters.cache_errors++;
        pthread_mutex_unlock(&j->lock);
        /* Storing is all prepare does, so its failure is the answer; acquire
         * compiles instead: a busy or broken database must not stop a kernel. */
        if (st && !load)
            return st;
        e->persisted = !st && found;
        lookup = st;
    }
    int leased = 0;
    if (!cubin && (!e->persisted || load) && j->cache && !j->strict && !lookup) {
        /* Across processes: one compiles while the others wait for its row. */
        int found = 0;
        kiln__cache_remote_wait(j->cache, e->fingerprint, &rec, load, &cubin, &size, &found, &leased);
        if (found) {
            e->persisted = 1;
            if (!load) {
                free(cubin);
                cubin = NULL;
            }
            pthread_mutex_lock(&j->lock);
            if (load)
                j->counters.database_hits++;
            pthread_mutex_unlock(&j->lock);
        }
    }
    if (!cubin && (!e->persisted || load)) {
        /* A database that failed to answer is no miss: its error is the answer. */
        if (j->strict)
            return lookup ? lookup : refuse_compile(j, e, consts, parts);
        pthread_mutex_lock(&j->lock);
        while (!j->compile_slots)
            pthread_cond_wait(&j->slot_free, &j->lock);
        j->compile_slots--;
        if (++j->compiling > j->peak_compiling)
            j->peak_compiling = j->compiling;
        pthread_mutex_unlock(&j->lock);
        st = kiln__compile(e->tmpl, &e->spec, &j->opts, j->arch, &cubin, &size);
        pthread_mutex_lock(&j->lock);
        j->compile_slots++;
        j->compiling--;
        pthread_cond_signal(&j->slot_free);
        if (st)
            j->counters.compile_errors++;
        else
            j->counters.compiles++;
        pthread_mutex_unlock(&j->lock);
        if (st) {
            if (leased) /* the others need not wait out a compile that failed */
                kiln__cache_remote_release(j->cache, e->fingerprint);
            return st;
        }
        if (compiled)
            *compiled = 1;
        if (j->cache && !e->persisted) {
            rec.cubin = cubin;
            rec.cubin_size = size;
            if ((st = kiln_cache_put(j->cache, &rec))) {
                pthread_mutex_lock(&j->lock);
                j->counters.cache_errors++;
                pthread_mutex_unlock(&j->lock);
                if (!load) {
                    if (leased)
                        kiln__cache_remote_release(j->cache, e->fingerprint);
                    free(cubin);
                    return st;
                }
                st = KILN_OK; /* acquire loads what it compiled; a later call stores it */
            } else {
                e->persisted = 1;
            }
        }
        if (leased) /* after the put, which published the row */
            kiln__cache_remote_release(j->cache, e->fingerprint);
    }
    if (load && !e->loaded) {
        st = kiln__runtime_load_module(j->rt, cubin, &e->module);
        for (size_t i = 0; !st && i < e->tmpl->n_entries; i++)
            st = kiln__module_function(j->rt, e->module, e->tmpl->entries[i], &e->functions[i]);
        if (st) {
            kiln__runtime_unload_module(j->rt, e->module);
            e->module = NULL;
        } else {
            e->loaded = 1;
        }
    }
    free(cubin);
    return st;
}

static kiln_status obtain(kiln_jit *j, const kiln_spec *spec, int load, int *compiled, entry **out)
{
    if (compiled)
        *compiled = 0;
    if (!j || !spec)
        return kiln__fail(j ? &j->err : NULL, KILN_ERR_INVALID_ARGUMENT, "jit: NULL argument");
    if (load && !j->rt)
        return kiln__fail(&j->err, KILN_ERR_NO_DEVICE,
                          "jit for %s is offline (no runtime): it can compile and cache, not load", j->arch);
    uint64_t h = spec_hash(spec);
    pthread_mutex_lock(&j->lock);
    entry *e;
    int waited = 0;
    for (;;) {
        e = find_locked(j, spec, h);
        if (!e) {
            e = insert_locked(j, spec, h);
            if (!e) {
                pthread_mutex_unlock(&j->lock);
                return kiln__fail(&j->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
            }
            break;
        }
        if (e->state == ENTRY_BUSY) {
            pthread_cond_wait(&j->done, &j->lock);
            waited = 1;
            continue;
        }
        if (e->state == ENTRY_FAILED && waited) {
            /* The attempt this thread waited for failed: share its answer. */
            kiln_status st = kiln__fail(&j->err, e->failure, "%s", e->failure_msg ? e->failure_msg : "");
            pthread_mutex_unlock(&j->lock);
            return st;
        }
        if (e->state == ENTRY_READY && (load ? e->loaded : e->persisted || !j->cache)) {
            j->counters.memory_hits++;
            pthread_mutex_unlock(&j->lock);
            *out = e;
            return KILN_OK;
        }
        /* Failed earlier, or ready but not yet loaded: this thread retries. */
        e->state = ENTRY_BUSY;
        break;
    }
    pthread_mutex_unlock(&j->lock);

    kiln_status st = resolve(j, e, load, compiled);

    pthread_mutex_lock(&j->lock);
    free(e->failure_msg);
    e->failure_msg = NULL;
    if (st) {
        e->state = ENTRY_FAILED;
        e->failure = st;
        e->failure_msg = kiln__strdup(kiln_errmsg());
    } else {
        e->state = ENTRY_READY;
    }
    pthread_cond_broadcast(&j->done);
    pthread_mutex_unlock(&j->lock);
    if (st)
        return kiln__propagate(&j->err, st);
    *out = e;
    return KILN_OK;
}

kiln_status kiln_jit_prepare(kiln_jit *j, const kiln_spec *spec, int *compiled)
{
    entry *e;
    int c = 0;
    kiln_status st = obtain(j, spec, 0, &c, &e);
    if (compiled)
        *compiled = c;
    return st;
}

kiln_status kiln_jit_acquire(kiln_jit *j, const kiln_spec *spec, kiln_kernel **out)
{
    if (!out)
        return kiln__fail(j ? &j->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_jit_acquire: out is NULL");
    entry *e;
    kiln_status st = obtain(j, spec, 1, NULL, &e);
    *out = st ? NULL : (kiln_kernel *)e;
    return st;
}

kiln_status kiln_jit_fingerprint(kiln_jit *j, const kiln_spec *spec, uint8_t out[KILN_FINGERPRINT_SIZE])
{
    if (!j || !spec || !out)
        return kiln__fail(j ? &j->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_jit_fingerprint: NULL argument");
    const kiln__template *t;
    kiln_status st = kiln__template_find(spec->template_id, &t);
    if (!st)
        st = kiln__fingerprint(t, spec, &j->opts, j->arch, j->nvrtc_major, j->nvrtc_minor, out);
    return st ? kiln__propagate(&j->err, st) : KILN_OK;
}

kiln_status kiln_jit_fingerprint_parts(kiln_jit *j, const kiln_spec *spec, char *buf, size_t cap)
{
    if (!j || !spec || !buf || !cap)
        return kiln__fail(j ? &j->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_jit_fingerprint_parts: NULL argument");
    const kiln__template *t;
    kiln_status st = kiln__template_find(spec->template_id, &t);
    if (!st)
        st = kiln__fingerprint_parts(t, spec, &j->opts, j->arch, j->nvrtc_major, j->nvrtc_minor, buf, cap);
    return st ? kiln__propagate(&j->err, st) : KILN_OK;
}

kiln_status kiln_kernel_function(const kiln_kernel *k, const char *name, void **function)
{
    if (!k || !function)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_kernel_function: NULL argument");
    const entry *e = &k->e;
    for (size_t i = 0; i < e->tmpl->n_entries; i++) {
        if (!name || !strcmp(name, e->tmpl->entries[i])) {
            *function = (void *)e->functions[i];
            return KILN_OK;
        }
    }
    return kiln__fail(NULL, KILN_ERR_NOT_FOUND, "template %s has no entry \"%s\" (it has %s)", e->tmpl->id, name,
                      e->tmpl->entries_text);
}

const uint8_t *kiln_kernel_fingerprint(const kiln_kernel *k) { return k ? k->e.fingerprint : NULL; }
