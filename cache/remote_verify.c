/* kiln_cache_verify_remote: every row of the remote tier checked as a fetch
 * checks it (docs/cache.md, "The remote tier"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/remote.h"

static int lower_hex(char ch)
{
    return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
}

int kiln__remote_key_kind(const char *prefix, const char *key, size_t len, uint8_t fp[KILN_FINGERPRINT_SIZE])
{
    size_t pl = strlen(prefix), n;
    int kind;
    if (len <= pl || memcmp(key, prefix, pl) || key[pl] != ':')
        return KILN__REMOTE_KEY_OTHER;
    const char *rest = key + pl + 1;
    n = len - pl - 1;
    if (n == 4 + 2 * KILN_FINGERPRINT_SIZE && !memcmp(rest, "row:", 4)) {
        kind = KILN__REMOTE_KEY_ROW;
        rest += 4;
    } else if (n == 6 + 2 * KILN_FINGERPRINT_SIZE && !memcmp(rest, "lease:", 6)) {
        kind = KILN__REMOTE_KEY_LEASE;
        rest += 6;
    } else {
        return KILN__REMOTE_KEY_OTHER;
    }
    /* Lowercase only: key_of writes no other, so a fetch never reads another spelling. */
    for (int i = 0; i < KILN_FINGERPRINT_SIZE; i++) {
        int hi = lower_hex(rest[2 * i]), lo = lower_hex(rest[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return KILN__REMOTE_KEY_OTHER;
        fp[i] = (uint8_t)(hi << 4 | lo);
    }
    return kind;
}

/* Bounds on a scan, so that a server that never ends its cursor ends it. */
#define SCAN_COUNT "1000"
#define SCAN_KEYS_MAX (1u << 24)
#define SCAN_ROUNDS_MAX (1u << 24)

typedef struct scan_key {
    char *s; /* n bytes and a NUL (a key may hold NUL bytes) */
    size_t n;
} scan_key;

static int key_order(const void *a, const void *b)
{
    const scan_key *x = a, *y = b;
    int d = memcmp(x->s, y->s, x->n < y->n ? x->n : y->n);
    return d ? d : (x->n > y->n) - (x->n < y->n);
}

/* Ends a verify at a server that failed (the reason its cause) or answered
 * what the command never answers. */
static void verify_failed(kiln_cache *c, kiln_cache_remote_verify_report *rep, const char *what, redisReply *garbage,
                          const char *shape)
{
    kiln__remote *r = c->remote;
    pthread_mutex_lock(&r->lock);
    if (garbage) {
        char why[256];
        snprintf(why, sizeof why, "%s", shape);
        freeReplyObject(garbage);
        kiln__remote_fail_locked(r, what, why);
    }
    snprintf(rep->reason, sizeof rep->reason, "%s", r->cause[0] ? r->cause : "not connected");
    pthread_mutex_unlock(&r->lock);
    if (garbage)
        kiln__remote_count(c, &c->counters.remote_errors);
    rep->state = KILN_CACHE_REMOTE_FAILED;
}

/* Copies a SCAN batch's keys onto *keys: 0, or -1 out of memory. */
static int append_keys(const redisReply *batch, scan_key **keys, size_t *n, size_t *cap)
{
    for (size_t i = 0; i < batch->elements; i++) {
        if (*n == *cap) {
            size_t grown = *cap ? 2 * *cap : 256;
            scan_key *p = realloc(*keys, grown * sizeof *p);
            if (!p)
                return -1;
            *keys = p;
            *cap = grown;
        }
        const redisReply *k = batch->element[i];
        char *copy = malloc(k->len + 1);
        if (!copy)
            return -1;
        memcpy(copy, k->str, k->len);
        copy[k->len] = 0;
        (*keys)[*n].s = copy;
        (*keys)[(*n)++].n = k->len;
    }
    return 0;
}

/* Every key under the prefix, sorted, each once, in *out: KILN_OK (rep FAILED
 * when the server failed, *out then empty) or KILN_ERR_HOST_OUT_OF_MEMORY. */
static kiln_status scan_all(kiln_cache *c, kiln_cache_remote_verify_report *rep, scan_key **out, size_t *n_out)
{
    kiln__remote *r = c->remote;
    char cursor[32] = "0", match[KILN__REMOTE_PREFIX_MAX + 3];
    scan_key *keys = NULL;
    size_t n = 0, cap = 0;
    kiln_status st = KILN_OK;
    snprintf(match, sizeof match, "%s:*", r->where.prefix);
    for (unsigned round = 0;; round++) {
        if (round == SCAN_ROUNDS_MAX || n > SCAN_KEYS_MAX) {
            rep->state = KILN_CACHE_REMOTE_FAILED;
            snprintf(rep->reason, sizeof rep->reason, "redis %.256s:%d: SCAN: more than %u %s under %s:*; stopped",
                     r->where.host, r->where.port, round == SCAN_ROUNDS_MAX ? SCAN_ROUNDS_MAX : SCAN_KEYS_MAX,
                     round == SCAN_ROUNDS_MAX ? "rounds" : "keys", r->where.prefix);
            goto out_free_keys;
        }
        const char *argv[] = {"SCAN", cursor, "MATCH", match, "COUNT", SCAN_COUNT};
        size_t lens[] = {4, strlen(cursor), 5, strlen(match), 5, sizeof SCAN_COUNT - 1};
        redisReply *reply = kiln__remote_command(c, "SCAN", 6, argv, lens, 1u << REDIS_REPLY_ARRAY);
        if (!reply) {
            verify_failed(c, rep, "SCAN", NULL, NULL);
            goto out_free_keys;
        }
        redisReply *next = reply->elements == 2 ? reply->element[0] : NULL;
        redisReply *batch = reply->elements == 2 ? reply->element[1] : NULL;
        int shape_ok = next && batch && next->type == REDIS_REPLY_STRING && next->len > 0 &&
                       next->len < sizeof cursor && batch->type == REDIS_REPLY_ARRAY;
        for (size_t i = 0; shape_ok && i < batch->elements; i++)
            shape_ok = batch->element[i]->type == REDIS_REPLY_STRING;
        if (!shape_ok) {
            verify_failed(c, rep, "SCAN", reply, "a reply that is not a cursor and an array of keys");
            goto out_free_keys;
        }
        if (append_keys(batch, &keys, &n, &cap)) {
            freeReplyObject(reply);
            st = KILN_ERR_HOST_OUT_OF_MEMORY;
            goto out_free_keys;
        }
        memcpy(cursor, next->str, next->len);
        cursor[next->len] = 0;
        freeReplyObject(reply);
        if (!strcmp(cursor, "0"))
            break;
    }
    /* SCAN may return a key more than once (a rehash between rounds). */
    qsort(keys, n, sizeof *keys, key_order);
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        if (kept && !key_order(&keys[kept - 1], &keys[i]))
            free(keys[i].s);
        else
            keys[kept++] = keys[i];
    }
    *out = keys;
    *n_out = kept;
    return KILN_OK;
out_free_keys:
    for (size_t i = 0; i < n; i++)
        free(keys[i].s);
    free(keys);
    *out = NULL;
    *n_out = 0;
    return st;
}

/* Judges one row's value as a fetch does, and its parts as verify does. */
static kiln_status judge_value(const redisReply *reply, const uint8_t *fp, char *detail, size_t cap)
{
    if (reply->type == REDIS_REPLY_ERROR) {
        snprintf(detail, cap, "the key holds no string (the server answered %.200s)", reply->str ? reply->str : "");
        return KILN_ERR_CACHE_CORRUPT;
    }
    kiln__remote_row row;
    void *raw;
    kiln_status st = kiln__remote_value_check(reply->str, reply->len, fp, NULL, &row, &raw, detail, cap);
    if (st)
        return st;
    free(raw);
    const kiln__row_meta m = kiln__remote_row_meta(&row);
    if (!kiln__row_parts_agree(&m, detail, cap))
        st = KILN_ERR_CACHE_CORRUPT;
    kiln__remote_row_free(&row);
    return st;
}

kiln_status kiln_cache_verify_remote(kiln_cache *c, void (*on_bad)(void *user, const char *key, const char *detail),
                                     void *user, kiln_cache_remote_verify_report *out)
{
    if (!c || !out)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_verify_remote: NULL argument");
    size_t size = out->size ? out->size : sizeof *out;
    if (size < sizeof out->size)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_cache_verify_remote: report size %zu is smaller than its size field", size);
    kiln_cache_remote_verify_report rep;
    memset(&rep, 0, sizeof rep);
    kiln__remote *r = c->remote;
    kiln_status st = KILN_OK;
    scan_key *keys = NULL;
    size_t n = 0;
    if (!r)
        goto out_report;
    pthread_mutex_lock(&r->lock);
    int disabled = r->disabled;
    if (disabled)
        snprintf(rep.reason, sizeof rep.reason, "%.1000s", r->reason);
    pthread_mutex_unlock(&r->lock);
    if (disabled) {
        rep.state = KILN_CACHE_REMOTE_SKIPPED;
        goto out_report;
    }
    if (scan_all(c, &rep, &keys, &n) != KILN_OK)
        goto out_oom;
    if (rep.state == KILN_CACHE_REMOTE_FAILED)
        goto out_report;
    rep.state = KILN_CACHE_REMOTE_SCANNED;
    for (size_t i = 0; i < n; i++) {
        uint8_t fp[KILN_FINGERPRINT_SIZE];
        int kind = kiln__remote_key_kind(r->where.prefix, keys[i].s, keys[i].n, fp);
        if (kind != KILN__REMOTE_KEY_ROW) {
            if (kind == KILN__REMOTE_KEY_LEASE)
                rep.leases++;
            else
                rep.other_keys++;
            continue;
        }
        const char *argv[] = {"GET", keys[i].s};
        size_t lens[] = {3, keys[i].n};
        redisReply *reply = kiln__remote_command(c, "GET", 2, argv, lens,
                                          1u << REDIS_REPLY_STRING | 1u << REDIS_REPLY_NIL | 1u << REDIS_REPLY_ERROR);
        if (!reply) {
            verify_failed(c, &rep, "GET", NULL, NULL);
            break;
        }
        if (reply->type == REDIS_REPLY_ERROR && (!reply->str || strncmp(reply->str, "WRONGTYPE", 9))) {
            char why[256];
            snprintf(why, sizeof why, "the server answered an error: %.200s", reply->str ? reply->str : "");
            verify_failed(c, &rep, "GET", reply, why);
            break;
        }
        if (reply->type == REDIS_REPLY_NIL) { /* evicted since the scan */
            freeReplyObject(reply);
            continue;
        }
        char detail[512];
        rep.rows++;
        kiln_status judged = judge_value(reply, fp, detail, sizeof detail);
        freeReplyObject(reply);
        if (judged == KILN_ERR_HOST_OUT_OF_MEMORY)
            goto out_oom;
        if (judged == KILN_OK)
            continue;
        if (rep.bad_rows < KILN_CACHE_REMOTE_FIRST_BAD)
            snprintf(rep.first_bad[rep.bad_rows], sizeof rep.first_bad[0], "%.140s: %.360s", keys[i].s, detail);
        rep.bad_rows++;
        if (on_bad)
            on_bad(user, keys[i].s, detail);
    }
    goto out_report;
out_oom:
    pthread_mutex_lock(&c->lock);
    st = kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "cache %s: out of memory verifying the remote tier",
                    r->url);
    pthread_mutex_unlock(&c->lock);
out_report:
    for (size_t i = 0; i < n; i++)
        free(keys[i].s);
    free(keys);
    if (st == KILN_OK) {
        rep.size = (uint32_t)(size < sizeof rep ? size : sizeof rep);
        memcpy(out, &rep, rep.size);
    }
    return st;
}
