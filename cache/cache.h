/* kiln cache: what other layers (the jit) may call beyond kiln/cache.h. No
 * SQLite types; cache/internal.h holds the structs, for cache/ alone. Not API. */
#ifndef KILN_CACHE_CACHE_H
#define KILN_CACHE_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/cache.h"

/* kiln_cache_get, with the hit counted (a use) or not (prepare verifying a
 * row it will not load). *corrupt_dropped (may be NULL) is set to the number
 * of rows this call found corrupt and dropped or skipped, so that a caller
 * counts its own and not another thread's. */
kiln_status kiln__cache_load(kiln_cache *cache, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE], int count_hit,
                             void **cubin, size_t *size, int *found, unsigned *corrupt_dropped);

#endif
