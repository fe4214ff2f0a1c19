/* The remote layer: rows shared by a fleet through Redis (hiredis), leases
 * for cross-process single flight, and bounded timeouts, so that a server
 * that is down, slow or answers garbage costs a bounded wait and never an
 * acquire. docs/cache.md, "The remote tier", is the contract. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "cache/remote.h"

/* ---- the URL ---- */

static int prefix_char(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
           ch == '_' || ch == '-' || ch == ':';
}

static int host_char(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
           ch == '-' || ch == '_';
}

kiln_status kiln__remote_url_parse(const char *url, kiln__remote_url *out, char *detail, size_t cap)
{
    static const char scheme[] = "redis://";
    memset(out, 0, sizeof *out);
    if (!url || strncmp(url, scheme, sizeof scheme - 1)) {
        snprintf(detail, cap, "remote \"%.200s\" does not start with redis://", url ? url : "(null)");
        return KILN_ERR_INVALID_ARGUMENT;
    }
    const char *p = url + sizeof scheme - 1;
    const char *host = p, *host_end;
    if (strchr(p, '@')) {
        snprintf(detail, cap, "remote \"%.200s\": credentials in the URL are not supported", url);
        return KILN_ERR_INVALID_ARGUMENT;
    }
    if (*p == '[') { /* [IPv6] */
        host = ++p;
        while (*p && *p != ']' && ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f') || (*p >= 'A' && *p <= 'F') ||
                                   *p == ':' || *p == '.'))
            p++;
        if (*p != ']') {
            snprintf(detail, cap, "remote \"%.200s\": an IPv6 address in [] is not closed or holds other characters",
                     url);
            return KILN_ERR_INVALID_ARGUMENT;
        }
        host_end = p++;
    } else {
        while (host_char(*p))
            p++;
        host_end = p;
    }
    size_t n = (size_t)(host_end - host);
    if (!n || n >= sizeof out->host) {
        snprintf(detail, cap, "remote \"%.200s\": the host is empty or longer than %zu characters", url,
                 sizeof out->host - 1);
        return KILN_ERR_INVALID_ARGUMENT;
    }
    memcpy(out->host, host, n);
    out->host[n] = 0;
    out->port = DEFAULT_PORT;
    if (*p == ':') {
        long port = 0;
        int digits = 0;
        for (p++; *p >= '0' && *p <= '9' && digits < 6; p++, digits++)
            port = port * 10 + (*p - '0');
        if (!digits || port < 1 || port > 65535 || (*p >= '0' && *p <= '9')) {
            snprintf(detail, cap, "remote \"%.200s\": the port is not a number in [1, 65535]", url);
            return KILN_ERR_INVALID_ARGUMENT;
        }
        out->port = (int)port;
    }
    snprintf(out->prefix, sizeof out->prefix, "%s", DEFAULT_PREFIX);
    if (*p == '/' && p[1]) {
        const char *prefix = ++p;
        while (prefix_char(*p))
            p++;
        n = (size_t)(p - prefix);
        if (*p || n > KILN__REMOTE_PREFIX_MAX) {
            snprintf(detail, cap,
                     "remote \"%.200s\": the key prefix must be 1 to %d of [A-Za-z0-9._:-] (at byte %zu: 0x%02x)", url,
                     KILN__REMOTE_PREFIX_MAX, (size_t)(p - url), (unsigned char)*p);
            return KILN_ERR_INVALID_ARGUMENT;
        }
        memcpy(out->prefix, prefix, n);
        out->prefix[n] = 0;
    } else if (*p == '/') {
        p++;
    }
    if (*p) {
        snprintf(detail, cap, "remote \"%.200s\": unexpected 0x%02x at byte %zu (the form is redis://HOST[:PORT][/PREFIX])",
                 url, (unsigned char)*p, (size_t)(p - url));
        return KILN_ERR_INVALID_ARGUMENT;
    }
    return KILN_OK;
}

/* ---- values ---- */

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* magic, fingerprint, nvrtc major and minor (int32), raw_size (int64), checksum */
#define FIXED_SIZE (KILN__REMOTE_MAGIC_SIZE + KILN_FINGERPRINT_SIZE + 4 + 4 + 8 + 32)
#define N_TEXTS 5

kiln_status kiln__remote_value_encode(const kiln_cache_record *r, uint64_t raw_size, const void *z, size_t zn,
                                      const uint8_t sum[32], uint8_t **out, size_t *size)
{
    const char *texts[N_TEXTS] = {r->template_id, r->constants, r->arch, r->entries, r->parts ? r->parts : ""};
    size_t lens[N_TEXTS], total = FIXED_SIZE + 4 + zn;
    *out = NULL;
    *size = 0;
    for (int i = 0; i < N_TEXTS; i++) {
        lens[i] = texts[i] ? strlen(texts[i]) : 0;
        if (lens[i] > KILN__REMOTE_TEXT_MAX)
            return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "remote row: a text field of %zu bytes (at most %u)",
                              lens[i], KILN__REMOTE_TEXT_MAX);
        total += 4 + lens[i];
    }
    if (zn > VALUE_MAX)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "remote row: a frame of %zu bytes", zn);
    uint8_t *v = malloc(total), *p = v;
    if (!v)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a %zu-byte remote row", total);
    memcpy(p, KILN__REMOTE_MAGIC, KILN__REMOTE_MAGIC_SIZE);
    p += KILN__REMOTE_MAGIC_SIZE;
    memcpy(p, r->fingerprint, KILN_FINGERPRINT_SIZE);
    p += KILN_FINGERPRINT_SIZE;
    put_le(p, (uint32_t)r->nvrtc_major, 4);
    put_le(p + 4, (uint32_t)r->nvrtc_minor, 4);
    put_le(p + 8, raw_size, 8);
    p += 16;
    memcpy(p, sum, 32);
    p += 32;
    for (int i = 0; i < N_TEXTS; i++) {
        put_le(p, lens[i], 4);
        if (lens[i])
            memcpy(p + 4, texts[i], lens[i]);
        p += 4 + lens[i];
    }
    put_le(p, zn, 4);
    memcpy(p + 4, z, zn);
    *out = v;
    *size = total;
    return KILN_OK;
}

kiln_status kiln__remote_value_parse(const void *value, size_t size, kiln__remote_row *out, char *detail, size_t cap)
{
    static const char *const names[N_TEXTS] = {"template_id", "constants", "arch", "entries", "parts"};
    const uint8_t *v = value, *p, *end = v + size;
    memset(out, 0, sizeof *out);
    if (!v || size < FIXED_SIZE || memcmp(v, KILN__REMOTE_MAGIC, KILN__REMOTE_MAGIC_SIZE)) {
        snprintf(detail, cap, "a value of %zu bytes that is not a kiln row (no %s header)", size, KILN__REMOTE_MAGIC);
        return KILN_ERR_CACHE_CORRUPT;
    }
    p = v + KILN__REMOTE_MAGIC_SIZE;
    memcpy(out->fingerprint, p, KILN_FINGERPRINT_SIZE);
    p += KILN_FINGERPRINT_SIZE;
    out->nvrtc_major = (int32_t)get_le(p, 4);
    out->nvrtc_minor = (int32_t)get_le(p + 4, 4);
    uint64_t raw = get_le(p + 8, 8);
    out->raw_size = raw > (uint64_t)INT64_MAX ? -1 : (int64_t)raw;
    p += 16;
    out->checksum = p;
    p += 32;
    const uint8_t *texts[N_TEXTS];
    size_t lens[N_TEXTS], total = 0;
    for (int i = 0; i < N_TEXTS; i++) {
        if ((size_t)(end - p) < 4) {
            snprintf(detail, cap, "the value ends inside the length of %s (%zu bytes)", names[i], size);
            return KILN_ERR_CACHE_CORRUPT;
        }
        uint64_t n = get_le(p, 4);
        p += 4;
        if (n > KILN__REMOTE_TEXT_MAX || n > (size_t)(end - p)) {
            snprintf(detail, cap, "%s of %llu bytes: more than %s", names[i], (unsigned long long)n,
                     n > KILN__REMOTE_TEXT_MAX ? "the bound" : "the value holds");
            return KILN_ERR_CACHE_CORRUPT;
        }
        if (memchr(p, 0, (size_t)n)) {
            snprintf(detail, cap, "%s holds a NUL byte", names[i]);
            return KILN_ERR_CACHE_CORRUPT;
        }
        texts[i] = p;
        lens[i] = (size_t)n;
        total += (size_t)n + 1;
        p += n;
    }
    if ((size_t)(end - p) < 4) {
        snprintf(detail, cap, "the value ends inside the length of the cubin frame");
        return KILN_ERR_CACHE_CORRUPT;
    }
    uint64_t zn = get_le(p, 4);
    p += 4;
    if (zn != (uint64_t)(end - p)) {
        snprintf(detail, cap, "a cubin frame of %llu bytes where %zu remain", (unsigned long long)zn,
                 (size_t)(end - p));
        return KILN_ERR_CACHE_CORRUPT;
    }
    /* One copy of what the row needs, so that it outlives the reply. */
    if (!(out->store = malloc(32 + (size_t)zn + total)))
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a remote row");
    memcpy(out->store, out->checksum, 32);
    out->checksum = (const uint8_t *)out->store;
    memcpy(out->store + 32, p, (size_t)zn);
    out->blob = (const uint8_t *)out->store + 32;
    out->blob_size = (size_t)zn;
    char *s = out->store + 32 + zn;
    const char **fields[N_TEXTS] = {&out->template_id, &out->constants, &out->arch, &out->entries, &out->parts};
    for (int i = 0; i < N_TEXTS; i++) {
        if (lens[i])
            memcpy(s, texts[i], lens[i]);
        s[lens[i]] = 0;
        *fields[i] = s;
        s += lens[i] + 1;
    }
    return KILN_OK;
}

void kiln__remote_row_free(kiln__remote_row *row)
{
    if (!row)
        return;
    free(row->store);
    memset(row, 0, sizeof *row);
}

kiln__row_meta kiln__remote_row_meta(const kiln__remote_row *row)
{
    return (kiln__row_meta){.template_id = row->template_id,
                            .constants = row->constants,
                            .arch = row->arch,
                            .parts = row->parts,
                            .nvrtc_is_integer = 1,
                            .nvrtc_major = row->nvrtc_major,
                            .nvrtc_minor = row->nvrtc_minor};
}

/* Its size, its parse, the key it claims, the kernel it is of (with
 * expect), then size, frame and checksum. */
kiln_status kiln__remote_value_check(const void *value, size_t size, const uint8_t *fp,
                                     const kiln_cache_record *expect, kiln__remote_row *row, void **raw,
                                     char *detail, size_t cap)
{
    *raw = NULL;
    memset(row, 0, sizeof *row);
    if (size > VALUE_MAX) {
        snprintf(detail, cap, "a value of %zu bytes", size);
        return KILN_ERR_CACHE_CORRUPT;
    }
    kiln_status st = kiln__remote_value_parse(value, size, row, detail, cap);
    if (st)
        return st;
    if (memcmp(row->fingerprint, fp, KILN_FINGERPRINT_SIZE)) {
        snprintf(detail, cap, "the value holds another fingerprint than its key");
        st = KILN_ERR_CACHE_CORRUPT;
    } else {
        const kiln__row_meta m = kiln__remote_row_meta(row);
        if (expect && !kiln__row_is(&m, expect, detail, cap))
            st = KILN_ERR_CACHE_CORRUPT;
        else
            st = kiln__row_decode(row->blob, row->blob_size, row->raw_size, 1, row->checksum, 32, raw, detail, cap);
    }
    if (st)
        kiln__remote_row_free(row);
    return st;
}

/* ---- the connection ---- */

void kiln__remote_count(kiln_cache *c, uint64_t *counter)
{
    pthread_mutex_lock(&c->lock);
    (*counter)++;
    pthread_mutex_unlock(&c->lock);
}

void kiln__remote_fail_locked(kiln__remote *r, const char *what, const char *why)
{
    snprintf(r->cause, sizeof r->cause, "redis %.256s:%d: %.64s: %.256s", r->where.host, r->where.port, what, why);
    snprintf(r->reason, sizeof r->reason, "%s; compiling locally, trying again in %.0f s", r->cause, RETRY_AFTER_S);
    if (r->ctx)
        redisFree(r->ctx);
    r->ctx = NULL;
    r->retry_at = kiln__now() + RETRY_AFTER_S;
}

/* A connection to use, under r->lock: NULL while the layer is skipped. *failed
 * is set when this call tried and failed (to be counted). */
static redisContext *connection_locked(kiln__remote *r, int *failed)
{
    *failed = 0;
    if (r->disabled)
        return NULL;
    if (r->ctx)
        return r->ctx;
    if (kiln__now() < r->retry_at)
        return NULL;
    struct timeval tv = {.tv_sec = r->timeout_ms / 1000, .tv_usec = (r->timeout_ms % 1000) * 1000};
    redisContext *ctx = redisConnectWithTimeout(r->where.host, r->where.port, tv);
    if (!ctx || ctx->err) {
        char why[256];
        snprintf(why, sizeof why, "%s", ctx ? ctx->errstr : "out of memory");
        if (ctx)
            redisFree(ctx);
        kiln__remote_fail_locked(r, "cannot connect", why);
        *failed = 1;
        return NULL;
    }
    if (redisSetTimeout(ctx, tv) != REDIS_OK) {
        redisFree(ctx);
        kiln__remote_fail_locked(r, "cannot set the command timeout", "setsockopt failed");
        *failed = 1;
        return NULL;
    }
    r->ctx = ctx;
    r->reason[0] = r->cause[0] = 0;
    return ctx;
}

/* Runs one command under r->lock: the reply, or NULL after a failure (the
 * connection dropped, the reason set, *failed set). An error reply is a
 * failure too, unless keep_errors (verify judges a key's wrong type itself). */
static redisReply *command_locked(kiln__remote *r, const char *what, int argc, const char **argv, const size_t *lens,
                                  int keep_errors, int *failed)
{
    redisContext *ctx = connection_locked(r, failed);
    if (!ctx)
        return NULL;
    errno = 0;
    redisReply *reply = redisCommandArgv(ctx, argc, argv, lens);
    if (!reply) {
        char why[256];
        if (ctx->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK))
            snprintf(why, sizeof why, "no answer within %d ms (the command timeout)", r->timeout_ms);
        else
            snprintf(why, sizeof why, "%s", ctx->err ? ctx->errstr : "no reply");
        kiln__remote_fail_locked(r, what, why);
        *failed = 1;
        return NULL;
    }
    if (reply->type == REDIS_REPLY_ERROR && !keep_errors) {
        char why[256];
        snprintf(why, sizeof why, "the server answered an error: %.200s", reply->str ? reply->str : "");
        freeReplyObject(reply);
        kiln__remote_fail_locked(r, what, why);
        *failed = 1;
        return NULL;
    }
    return reply;
}

/* A reply of a type the command never gives is garbage: the layer is skipped. */
static void garbage_locked(kiln__remote *r, const char *what, redisReply *reply)
{
    char why[64];
    snprintf(why, sizeof why, "a reply of type %d", reply ? reply->type : -1);
    freeReplyObject(reply);
    kiln__remote_fail_locked(r, what, why);
}

static void key_of(const kiln__remote *r, const char *kind, const uint8_t *fp, char *buf, size_t cap)
{
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fp, hex);
    snprintf(buf, cap, "%s:%s:%s", r->where.prefix, kind, hex);
}

/* One command, its reply of one of types (bits 1 << REDIS_REPLY_*; with
 * REDIS_REPLY_ERROR among them an error reply is handed back, not a
 * failure): the reply, or NULL (no server, a failure, or a reply of another
 * type: the layer skipped with the reason, and counted). */
redisReply *kiln__remote_command(kiln_cache *c, const char *what, int argc, const char **argv, const size_t *lens,
                                 unsigned types)
{
    kiln__remote *r = c->remote;
    int failed = 0;
    pthread_mutex_lock(&r->lock);
    redisReply *reply = command_locked(r, what, argc, argv, lens, types & (1u << REDIS_REPLY_ERROR), &failed);
    if (reply && !(types & (1u << reply->type))) {
        garbage_locked(r, what, reply);
        reply = NULL;
        failed = 1;
    }
    pthread_mutex_unlock(&r->lock);
    if (failed)
        kiln__remote_count(c, &c->counters.remote_errors);
    return reply;
}

kiln_status kiln__remote_open(kiln_cache *c, const kiln_cache_options *o)
{
    const char *url = o->remote;
    if (!url && !o->ignore_env)
        url = getenv("KILN_CACHE_REMOTE");
    if (!url || !*url)
        return KILN_OK;
    char detail[512];
    kiln__remote_url where;
    if (kiln__remote_url_parse(url, &where, detail, sizeof detail))
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_open: %s (KILN_CACHE_REMOTE or "
                          "kiln_cache_options.remote)", detail);
    kiln__remote *r = calloc(1, sizeof *r);
    if (!r || !(r->url = kiln__strdup(url))) {
        free(r);
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    }
    pthread_mutex_init(&r->lock, NULL);
    r->where = where;
    r->timeout_ms = o->remote_timeout_ms > 0 ? o->remote_timeout_ms : DEFAULT_TIMEOUT_MS;
    r->lease_ms = o->remote_lease_ms > 0 ? o->remote_lease_ms : DEFAULT_LEASE_MS;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    /* Distinct per cache handle: a lease is given back only by its holder. */
    snprintf(r->token, sizeof r->token, "%ld-%lx-%lx", (long)getpid(), (unsigned long)ts.tv_nsec,
             (unsigned long)(uintptr_t)r);
    c->remote = r;
    const char *trusted_env = o->ignore_env ? NULL : getenv("KILN_CACHE_REMOTE_TRUSTED");
    int trusted = o->remote_trusted || (trusted_env && !strcmp(trusted_env, "1"));
    if (c->n_trusted && !trusted) {
        /* Its rows carry no signature: under a policy it is off unless trusted by name. */
        r->disabled = 1;
        snprintf(r->reason, sizeof r->reason,
                 "a trust policy is set (KILN_TRUSTED_KEYS) and remote rows carry no signature: the remote layer is "
                 "searched under a policy only when trusted (KILN_CACHE_REMOTE_TRUSTED=1 or "
                 "kiln_cache_options.remote_trusted)");
        return KILN_OK;
    }
    int failed = 0;
    pthread_mutex_lock(&r->lock);
    connection_locked(r, &failed);
    pthread_mutex_unlock(&r->lock);
    if (failed)
        c->counters.remote_errors++;
    return KILN_OK;
}

void kiln__remote_close(kiln__remote *r)
{
    if (!r)
        return;
    if (r->ctx)
        redisFree(r->ctx);
    pthread_mutex_destroy(&r->lock);
    free(r->url);
    free(r);
}

int kiln__remote_lease_ms(const kiln_cache *c) { return c->remote ? c->remote->lease_ms : 0; }

void kiln__remote_info(kiln_cache *c, kiln_cache_layer_info *out)
{
    kiln__remote *r = c->remote;
    pthread_mutex_lock(&r->lock);
    memset(out, 0, sizeof *out);
    out->path = r->url;
    out->remote = 1;
    out->active = !r->disabled && r->ctx != NULL;
    snprintf(r->snapshot, sizeof r->snapshot, "%s", out->active ? "" : r->reason[0] ? r->reason : "not connected");
    out->reason = r->snapshot;
    pthread_mutex_unlock(&r->lock);
}

/* Reports a value that failed verification: counted, on_event, the message. */
static void refuse(kiln_cache *c, const uint8_t *fp, const char *detail)
{
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fp, hex);
    pthread_mutex_lock(&c->lock);
    c->counters.remote_refused++;
    kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT, "cache %s: entry %s refused: %s", c->remote->url, hex, detail);
    pthread_mutex_unlock(&c->lock);
    if (c->on_event) {
        kiln_cache_event ev = {.kind = KILN_CACHE_EVENT_CORRUPT_DROPPED, .detail = detail};
        memcpy(ev.fingerprint, fp, KILN_FINGERPRINT_SIZE);
        c->on_event(c->user, &ev);
    }
}

int kiln__remote_fetch(kiln_cache *c, const uint8_t *fp, const kiln_cache_record *expect, kiln__remote_row *row,
                       void **raw, size_t *raw_size)
{
    kiln__remote *r = c->remote;
    char key[KILN__REMOTE_PREFIX_MAX + 80], detail[512];
    *raw = NULL;
    *raw_size = 0;
    memset(row, 0, sizeof *row);
    key_of(r, "row", fp, key, sizeof key);
    const char *argv[] = {"GET", key};
    size_t lens[] = {3, strlen(key)};
    redisReply *reply =
        kiln__remote_command(c, "GET", 2, argv, lens, 1u << REDIS_REPLY_STRING | 1u << REDIS_REPLY_NIL);
    if (!reply)
        return 0;
    if (reply->type == REDIS_REPLY_NIL) {
        freeReplyObject(reply);
        kiln__remote_count(c, &c->counters.remote_misses);
        return 0;
    }
    kiln_status st = kiln__remote_value_check(reply->str, reply->len, fp, expect, row, raw, detail, sizeof detail);
    if (st) {
        /* The row stays: another kiln may judge it otherwise, and a good one replaces it on publish. */
        if (st == KILN_ERR_CACHE_CORRUPT)
            refuse(c, fp, detail);
        freeReplyObject(reply);
        return 0;
    }
    freeReplyObject(reply);
    *raw_size = (size_t)row->raw_size;
    kiln__remote_count(c, &c->counters.remote_hits);
    return 1;
}

void kiln__remote_publish(kiln_cache *c, const kiln_cache_record *rec, const void *z, size_t zn,
                          const uint8_t sum[32])
{
    kiln__remote *r = c->remote;
    uint8_t *value = NULL;
    size_t size = 0;
    char key[KILN__REMOTE_PREFIX_MAX + 80], detail[512];
    if (r->disabled || kiln__remote_value_encode(rec, rec->cubin_size, z, zn, sum, &value, &size))
        return;
    /* Checked as a reader will check it: a value that would be refused is never sent. */
    kiln__remote_row row;
    void *raw;
    kiln_status st =
        kiln__remote_value_check(value, size, rec->fingerprint, rec, &row, &raw, detail, sizeof detail);
    if (!st) {
        free(raw);
        kiln__remote_row_free(&row);
    }
    if (st) {
        free(value);
        return;
    }
    key_of(r, "row", rec->fingerprint, key, sizeof key);
    const char *argv[] = {"SET", key, (const char *)value};
    size_t lens[] = {3, strlen(key), size};
    redisReply *reply = kiln__remote_command(c, "SET", 3, argv, lens, 1u << REDIS_REPLY_STATUS);
    free(value);
    if (reply) {
        freeReplyObject(reply);
        kiln__remote_count(c, &c->counters.remote_published);
    }
}

int kiln__remote_lease(kiln_cache *c, const uint8_t *fp)
{
    kiln__remote *r = c->remote;
    char key[KILN__REMOTE_PREFIX_MAX + 80], ms[24];
    key_of(r, "lease", fp, key, sizeof key);
    snprintf(ms, sizeof ms, "%d", r->lease_ms);
    const char *argv[] = {"SET", key, r->token, "NX", "PX", ms};
    size_t lens[] = {3, strlen(key), strlen(r->token), 2, 2, strlen(ms)};
    redisReply *reply =
        kiln__remote_command(c, "SET NX", 6, argv, lens, 1u << REDIS_REPLY_STATUS | 1u << REDIS_REPLY_NIL);
    const int result = !reply ? -1 : reply->type == REDIS_REPLY_STATUS ? 1 : 0;
    freeReplyObject(reply);
    if (result == 1)
        kiln__remote_count(c, &c->counters.remote_leases);
    return result;
}

void kiln__remote_release(kiln_cache *c, const uint8_t *fp)
{
    kiln__remote *r = c->remote;
    /* Deleted only while it is still this cache's: an expired lease may be another's by now. */
    static const char script[] =
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";
    char key[KILN__REMOTE_PREFIX_MAX + 80];
    key_of(r, "lease", fp, key, sizeof key);
    const char *argv[] = {"EVAL", script, "1", key, r->token};
    size_t lens[] = {4, sizeof script - 1, 1, strlen(key), strlen(r->token)};
    freeReplyObject(kiln__remote_command(c, "EVAL (release a lease)", 5, argv, lens, 1u << REDIS_REPLY_INTEGER));
}
