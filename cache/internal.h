/* kiln cache internals. Not API. */
#ifndef KILN_CACHE_INTERNAL_H
#define KILN_CACHE_INTERNAL_H

#include "kiln/cache.h"

/* kiln_cache_get, with the hit counted (a use) or not (prewarm verifying a
 * row it will not load). */
kiln_status kiln__cache_load(kiln_cache *cache, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE], int count_hit,
                             void **cubin, size_t *size, int *found);

#endif
