/* Coverage records: what prewarm stores of a model and its serving envelope,
 * and check's reading of them against the layers. */
#include <inttypes.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../jit/nearest.h" /* compiled into the CLI too: it links only the API */
#include "cli.h"

void cli_envelope_text(const cli_build_args *a, const kiln_model_config *config, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "dtype=%s;batch=", config->dtype == KILN_DTYPE_BF16 ? "bf16" : "f16");
    for (size_t i = 0; i < a->n_batch && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? "," : "", (long long)a->batch[i]);
    if (n < cap)
        snprintf(buf + n, cap - n, ";context=%lld;chunk=%ld",
                 (long long)(a->max_context ? a->max_context : config->max_position_embeddings), a->prefill_chunk);
}

/* SHA-256 (hex) of the config file's bytes, or of the built-in shape's
 * fields when there is no file. */
static int config_digest(const char *cmd, const char *model_path, const kiln_model_config *c, char hex[65])
{
    unsigned char md[32];
    unsigned int md_len = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL);
    if (model_path) {
        FILE *f = fopen(model_path, "rb");
        char buf[65536];
        size_t got;
        if (!f) {
            EVP_MD_CTX_free(ctx);
            return cli_fail(cmd, "cannot read %s for its digest", model_path);
        }
        while (ok && (got = fread(buf, 1, sizeof buf, f)) > 0)
            ok = EVP_DigestUpdate(ctx, buf, got);
        ok = ok && !ferror(f);
        fclose(f);
    } else {
        char text[512];
        int len = snprintf(text, sizeof text, "builtin:%s;%lld;%lld;%lld;%lld;%lld;%lld", c->name,
                           (long long)c->vocab_size, (long long)c->hidden_size, (long long)c->intermediate_size,
                           (long long)c->num_attention_heads, (long long)c->num_key_value_heads,
                           (long long)c->head_dim);
        ok = ok && EVP_DigestUpdate(ctx, text, (size_t)len);
    }
    ok = ok && EVP_DigestFinal_ex(ctx, md, &md_len) && md_len == 32;
    EVP_MD_CTX_free(ctx);
    if (!ok)
        return cli_fail(cmd, "cannot compute the config's SHA-256");
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
    return CLI_EXIT_OK;
}

/* The NVRTC version in a spec's fingerprint parts ("nvrtc=13.0;"). */
static int nvrtc_of(const char *parts, int *major, int *minor)
{
    const char *p = strstr(parts, "nvrtc=");
    return p && sscanf(p + 6, "%d.%d", major, minor) == 2 ? 0 : -1;
}

/* Appends text to a growing buffer; -1 when out of memory. */
static int append(char **buf, size_t *len, size_t *cap, const char *text)
{
    size_t n = strlen(text);
    if (*len + n + 1 > *cap) {
        size_t ncap = (*cap ? 2 * *cap : 4096) + n;
        char *p = realloc(*buf, ncap);
        if (!p)
            return -1;
        *buf = p;
        *cap = ncap;
    }
    memcpy(*buf + *len, text, n + 1);
    *len += n;
    return 0;
}

int cli_write_coverage(const char *cmd, const char *model_path, const kiln_model_config *config,
                       const kiln_spec *specs, size_t n_specs, const char *arch, const char *envelope,
                       kiln_cache *cache)
{
    char digest[65];
    int rc = config_digest(cmd, model_path, config, digest);
    if (rc)
        return rc;
    kiln_jit *jit = NULL;
    kiln_jit_options jo = {.size = sizeof jo, .arch = arch, .compile = KILN_JIT_COMPILE_ON};
    if (kiln_jit_create(&jo, &jit) != KILN_OK)
        return cli_fail(cmd, "--arch %s: %s", arch, kiln_errmsg());
    char *needs = NULL;
    size_t len = 0, cap = 0;
    int major = 0, minor = 0;
    if (append(&needs, &len, &cap, "")) {
        rc = cli_fail(cmd, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_specs; i++) {
        char hex[2 * KILN_FINGERPRINT_SIZE + 1], consts[KILN__PARTS_MAX], parts[KILN__PARTS_MAX];
        char line[3 * KILN__PARTS_MAX + 200];
        if ((rc = cli_spec_texts(cmd, jit, &specs[i], hex, consts, parts)))
            goto out;
        if (i == 0 && nvrtc_of(parts, &major, &minor)) {
            rc = cli_fail(cmd, "%s: no NVRTC version in its fingerprint parts", specs[i].template_id);
            goto out;
        }
        snprintf(line, sizeof line, "%s\t%s\t%s\t%s\n", hex, specs[i].template_id, consts, parts);
        if (append(&needs, &len, &cap, line)) {
            rc = cli_fail(cmd, "out of memory");
            goto out;
        }
    }
    kiln_coverage_record r = {.model_name = config->name,
                              .config_digest = digest,
                              .envelope = envelope,
                              .arch = kiln_jit_arch(jit),
                              .nvrtc_major = major,
                              .nvrtc_minor = minor,
                              .needs = needs};
    kiln_status st = kiln_cache_coverage_put(cache, &r);
    if (st != KILN_OK) {
        rc = cli_fail(cmd, "coverage record: %s: %s", kiln_status_code(st), kiln_errmsg());
        goto out;
    }
    printf("coverage %s: %zu kernels, envelope %s\n", config->name, n_specs, envelope);
out:
    free(needs);
    kiln_jit_destroy(jit);
    return rc;
}

/* ---- check against stored records ---- */

typedef struct stored {
    kiln_coverage_info info; /* its strings copies, freed with the list */
} stored;

typedef struct stored_list {
    stored *items;
    size_t n, cap;
    int oom;
} stored_list;

static char *dup_or_null(const char *s, int *oom)
{
    char *d = strdup(s ? s : "");
    if (!d)
        *oom = 1;
    return d;
}

static int collect(void *user, const kiln_coverage_info *info)
{
    stored_list *l = user;
    if (l->n == l->cap) {
        size_t ncap = l->cap ? 2 * l->cap : 8;
        stored *p = realloc(l->items, ncap * sizeof *p);
        if (!p) {
            l->oom = 1;
            return 1;
        }
        l->items = p;
        l->cap = ncap;
    }
    stored *s = &l->items[l->n++];
    memset(s, 0, sizeof *s);
    s->info = *info;
    kiln_coverage_record *r = &s->info.record;
    r->model_name = dup_or_null(r->model_name, &l->oom);
    r->config_digest = dup_or_null(r->config_digest, &l->oom);
    r->envelope = dup_or_null(r->envelope, &l->oom);
    r->arch = dup_or_null(r->arch, &l->oom);
    r->needs = dup_or_null(r->needs, &l->oom);
    s->info.detail = dup_or_null(info->detail, &l->oom);
    return l->oom;
}

static void free_list(stored_list *l)
{
    for (size_t i = 0; i < l->n; i++) {
        kiln_coverage_record *r = &l->items[i].info.record;
        free((char *)r->model_name);
        free((char *)r->config_digest);
        free((char *)r->envelope);
        free((char *)r->arch);
        free((char *)r->needs);
        free((char *)l->items[i].info.detail);
    }
    free(l->items);
}

/* This build's NVRTC version, from a probe spec's fingerprint parts. */
static int local_nvrtc(const char *arch, int *major, int *minor)
{
    kiln_jit *jit = NULL;
    kiln_spec spec;
    char parts[KILN__PARTS_MAX];
    kiln_jit_options jo = {.size = sizeof jo, .arch = arch, .compile = KILN_JIT_COMPILE_OFF};
    int rc = -1;
    if (kiln_jit_create(&jo, &jit) == KILN_OK && kiln_op_dense_swiglu_spec(KILN_DTYPE_F16, 1024, 8, &spec) == KILN_OK &&
        kiln_jit_fingerprint_parts(jit, &spec, parts, sizeof parts) == KILN_OK)
        rc = nvrtc_of(parts, major, minor);
    kiln_jit_destroy(jit);
    return rc;
}

/* Checks one record: each kernel it lists present and verified in the
 * layers. Returns the number missing (a bad record counts as one). */
static size_t check_one(const char *cmd, kiln_cache *cache, const kiln_coverage_info *info, kiln__rows *rows,
                        int *listed, int *failed)
{
    const kiln_coverage_record *r = &info->record;
    char id[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(info->id, id);
    char *name = cli_escape(r->model_name), *env = cli_escape(r->envelope), *arch = cli_escape(r->arch);
    size_t missing = 0, needed = 0;
    int major = 0, minor = 0;
    if (!name || !env || !arch) {
        *failed = cli_fail(cmd, "out of memory");
        goto out;
    }
    if (!info->valid) {
        printf("coverage %s bad: %s\n", id, info->detail);
        missing = 1;
        goto out;
    }
    if (local_nvrtc(r->arch, &major, &minor) == 0 && (major != r->nvrtc_major || minor != r->nvrtc_minor)) {
        printf("coverage %s (%s): made for NVRTC %d.%d, this is NVRTC %d.%d: its kernels are not the ones this build "
               "looks up\n",
               name, env, r->nvrtc_major, r->nvrtc_minor, major, minor);
        missing = info->n_needs ? info->n_needs : 1;
        needed = info->n_needs;
        goto summary;
    }
    for (const char *line = r->needs; *line;) {
        const char *end = strchr(line, '\n');
        char hex[65], tmpl[256], consts[KILN__PARTS_MAX], parts[KILN__PARTS_MAX];
        uint8_t fp[KILN_FINGERPRINT_SIZE];
        /* Lines were checked by the library: hex, three tabs, a newline. */
        const char *t1 = line + 64, *t2 = strchr(t1 + 1, '\t'), *t3 = t2 ? strchr(t2 + 1, '\t') : NULL;
        if (!end || !t2 || !t3)
            break;
        snprintf(hex, sizeof hex, "%.64s", line);
        snprintf(tmpl, sizeof tmpl, "%.*s", (int)(t2 - t1 - 1), t1 + 1);
        snprintf(consts, sizeof consts, "%.*s", (int)(t3 - t2 - 1), t2 + 1);
        snprintf(parts, sizeof parts, "%.*s", (int)(end - t3 - 1), t3 + 1);
        line = end + 1;
        needed++;
        void *cubin = NULL;
        size_t size = 0;
        int found = 0;
        if (kiln_fingerprint_parse(hex, fp) != KILN_OK) {
            missing++;
            continue;
        }
        if (kiln_cache_get(cache, fp, &cubin, &size, &found) != KILN_OK) {
            *failed = cli_fail(cmd, "%s", kiln_errmsg());
            goto out;
        }
        kiln_free(cubin);
        if (found)
            continue;
        if (!*listed && kiln__rows_collect(cache, rows) != KILN_OK) {
            *failed = cli_fail(cmd, "%s", kiln_errmsg());
            goto out;
        }
        *listed = 1;
        char why[KILN__EXPLAIN_MAX];
        kiln__rows_explain_miss(rows, parts, cli_escape, why, sizeof why);
        char *et = cli_escape(tmpl), *ec = cli_escape(consts);
        printf("%s %s missing %s %s\n", et ? et : "?", ec ? ec : "?", hex, why);
        free(et);
        free(ec);
        missing++;
    }
summary:
    printf("summary: coverage %s (%s), arch %s, NVRTC %d.%d: %zu needed, %zu present, %zu missing, database %s, %zu "
           "layers\n",
           name, env, arch, r->nvrtc_major, r->nvrtc_minor, needed, needed - (missing < needed ? missing : needed),
           missing, kiln_cache_path(cache), kiln_cache_layer_count(cache));
out:
    free(name);
    free(env);
    free(arch);
    return missing;
}

int cli_check_records(const char *cmd, kiln_cache *cache)
{
    stored_list l = {0};
    kiln__rows rows = {0};
    int listed = 0, failed = 0;
    size_t missing = 0;
    if (kiln_cache_coverage_foreach(cache, collect, &l) != KILN_OK) {
        free_list(&l);
        return cli_fail(cmd, "%s", kiln_errmsg());
    }
    if (l.oom) {
        free_list(&l);
        return cli_fail(cmd, "out of memory");
    }
    if (!l.n) {
        free_list(&l);
        return -1;
    }
    /* The records' lists were copied: kiln_cache_get may take the cache's lock. */
    for (size_t i = 0; i < l.n && !failed; i++)
        missing += check_one(cmd, cache, &l.items[i].info, &rows, &listed, &failed);
    kiln__rows_free(&rows);
    size_t n = l.n;
    free_list(&l);
    if (failed)
        return failed;
    if (fflush(stdout) != 0 || ferror(stdout))
        return cli_fail(cmd, "cannot write the output");
    if (missing)
        return cli_fail(cmd, "%zu kernels of %zu coverage records are missing: 'kiln prewarm' with the record's model, "
                             "dtype and arch compiles them",
                        missing, n);
    return CLI_EXIT_OK;
}
