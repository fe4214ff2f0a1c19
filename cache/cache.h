/* kiln cache: what other layers (the jit) may call beyond kiln/cache.h. No
 * SQLite types; cache/internal.h holds the structs, for cache/ alone. Not API. */
#ifndef KILN_CACHE_CACHE_H
#define KILN_CACHE_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/cache.h"

/* kiln_cache_get, with the hit counted (a use) or not (prepare verifying a
 * row it will not load). When expect is not NULL, its template_id,
 * constants, arch, NVRTC version and parts (when both it and the row have
 * them; cubin and entries are not used) are what the caller computed the
 * fingerprint from: a row that differs holds another kernel under this key
 * (keys swapped or edited) and is corrupt, dropped or skipped as a row that
 * fails its checksum is. *corrupt_dropped (may be NULL) is set to the number
 * of rows this call found corrupt and dropped or skipped, so that a caller
 * counts its own and not another thread's. */
kiln_status kiln__cache_load(kiln_cache *cache, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                             const kiln_cache_record *expect, int count_hit, void **cubin, size_t *size, int *found,
                             unsigned *corrupt_dropped);

/* After a miss in every database, before compiling. With an active remote
 * layer, takes the kernel's lease across the fleet (*leased = 1: the caller
 * compiles, stores with kiln_cache_put, which publishes the row, and calls
 * kiln__cache_remote_release), or waits, with a bounded backoff, for the
 * process that holds it to publish the row: *found = 1 with *cubin as
 * kiln__cache_load gives it (the row is also stored in the writable
 * database). A lease that outlives its holder expires and is taken; a wait
 * longer than the lease ends with *found = 0 and *leased = 0, as does a
 * missing or failing remote layer: compile. Never fails. */
void kiln__cache_remote_wait(kiln_cache *cache, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                             const kiln_cache_record *expect, int count_hit, void **cubin, size_t *size, int *found,
                             int *leased);
void kiln__cache_remote_release(kiln_cache *cache, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE]);

#endif
