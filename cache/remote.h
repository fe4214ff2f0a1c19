/* The remote layer's private parts, shared by cache/remote.c (the layer)
 * and cache/remote_verify.c (kiln_cache_verify_remote). */
#ifndef KILN_CACHE_REMOTE_H
#define KILN_CACHE_REMOTE_H

#include <hiredis/hiredis.h>

#include "cache/internal.h"

#define DEFAULT_PORT 6379
#define DEFAULT_PREFIX "kiln"
#define DEFAULT_TIMEOUT_MS 500
#define DEFAULT_LEASE_MS 30000
/* After a failure the server is left alone this long, then tried again. */
#define RETRY_AFTER_S 1.0
/* A value larger than this is no row kiln wrote (a cubin is at most KILN_CACHE_MAX_CUBIN). */
#define VALUE_MAX ((size_t)KILN_CACHE_MAX_CUBIN + (1u << 20))

struct kiln__remote {
    pthread_mutex_t lock; /* guards the connection and the state below */
    char *url;
    kiln__remote_url where;
    redisContext *ctx;
    int timeout_ms, lease_ms;
    int disabled;         /* for good: the trust policy does not admit it */
    double retry_at;      /* kiln__now() before which a failed server is not tried */
    char token[48];       /* this cache's lease value: who holds a lease */
    char cause[768];      /* the last failure: "redis HOST:PORT: WHAT: WHY" */
    char reason[1024];    /* why the layer is skipped; "" while it answers */
    char snapshot[1024];  /* reason as kiln_cache_layer last handed it out */
};

/* A value read from the server, checked exactly as an SQLite row: at most
 * VALUE_MAX bytes, a parse, the fingerprint its key names, the kernel it
 * must be of (expect; NULL: any), then size, frame and checksum. KILN_OK
 * with *row (free with kiln__remote_row_free) and *raw the cubin; else the
 * status and detail, *row freed. */
kiln_status kiln__remote_value_check(const void *value, size_t size, const uint8_t *fp,
                                     const kiln_cache_record *expect, kiln__remote_row *row, void **raw,
                                     char *detail, size_t cap);
/* A row's columns, as the local checks take them. */
kiln__row_meta kiln__remote_row_meta(const kiln__remote_row *row);
/* ++*counter under the cache's lock. */
void kiln__remote_count(kiln_cache *c, uint64_t *counter);
/* Drops the connection after a failure and says why; under r->lock. */
void kiln__remote_fail_locked(kiln__remote *r, const char *what, const char *why);
/* One command whose reply must be of the types in the mask (bits
 * 1 << REDIS_REPLY_*): the reply, or NULL (the layer skipped, counted). */
redisReply *kiln__remote_command(kiln_cache *c, const char *what, int argc, const char **argv, const size_t *lens,
                                 unsigned types);

#endif
