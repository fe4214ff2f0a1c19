/* The rows of a cache and the one nearest a key that misses: what kiln
 * explain and kiln check print and what the jit's strict mode reports. Uses
 * the public API alone, so that the CLI compiles it too. Not API. */
#ifndef KILN_JIT_NEAREST_H
#define KILN_JIT_NEAREST_H

#include <stddef.h>

#include "kiln/cache.h"

/* Room for a fingerprint's parts text, and for a miss's explanation (a row's
 * values may grow fourfold when escaped). */
#define KILN__PARTS_MAX 2048
#define KILN__EXPLAIN_MAX 8192

typedef struct kiln__row {
    char fp[2 * KILN_FINGERPRINT_SIZE + 1];
    char *parts; /* as stored; for schema 1 rows, made from the row's columns */
    int known;   /* parts were stored (schema 2) */
} kiln__row;

typedef struct kiln__rows {
    kiln__row *items;
    size_t n, cap;
} kiln__rows;

/* Adds every row of cache to rows: its database's, then those of each active
 * read-only layer (opened again, read-only, to list them). KILN_OK,
 * KILN_ERR_HOST_OUT_OF_MEMORY, or the failing cache call's status (its
 * message in kiln_errmsg()). rows keeps what it had on failure. */
kiln_status kiln__rows_collect(kiln_cache *cache, kiln__rows *rows);
void kiln__rows_free(kiln__rows *rows);

/* Writes into buf (always terminated) what explain says of a miss whose
 * fingerprint parts are want_parts (kiln_jit_fingerprint_parts):
 *   "nearest <fp> differs: <part> <have> -> <want>, ..."
 *   "nearest none (the database is empty)"
 * The nearest row has the most parts equal; one with stored parts beats one
 * without. A row's values pass through escape (a malloc'd copy, NULL when
 * out of memory); NULL escape: control, DEL and non-ASCII bytes as \xNN. */
void kiln__rows_explain_miss(const kiln__rows *rows, const char *want_parts, char *(*escape)(const char *),
                             char *buf, size_t cap);

#endif
