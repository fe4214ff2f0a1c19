/* Looks up fingerprints in a cache database as a process that loads kernels
 * does (kiln_cache_get, which decodes and checks every row it returns), with
 * the database opened read-only so that nothing changes. For
 * tests/corruption_trials.py: what a damaged database would hand out.
 *   usage: cache_lookup DB FINGERPRINT_HEX...
 * Prints one line per fingerprint: "<fp> hit <SHA-256 of the cubin>",
 * "<fp> miss" or "<fp> error <message>".
 * Exit status: 0 every fingerprint was looked up; 1 the database could not be
 * opened; 2 a usage error. */
#include <stdio.h>
#include <string.h>

#include "common/internal.h"
#include "kiln/kiln.h"

static int parse_hex(const char *text, uint8_t out[KILN_FINGERPRINT_SIZE])
{
    if (strlen(text) != 2 * KILN_FINGERPRINT_SIZE)
        return -1;
    for (size_t i = 0; i < KILN_FINGERPRINT_SIZE; i++) {
        unsigned v;
        if (sscanf(text + 2 * i, "%2x", &v) != 1)
            return -1;
        out[i] = (uint8_t)v;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: cache_lookup DB FINGERPRINT_HEX...\n");
        return 2;
    }
    kiln_cache_options opts = {.size = sizeof opts, .path = argv[1], .read_only = 1, .ignore_env = 1};
    kiln_cache *cache;
    if (kiln_cache_open(&opts, &cache) != KILN_OK) {
        fprintf(stderr, "cache_lookup: %s\n", kiln_errmsg());
        return 1;
    }
    int rc = 0;
    for (int i = 2; i < argc; i++) {
        uint8_t fp[KILN_FINGERPRINT_SIZE], sum[32];
        if (parse_hex(argv[i], fp)) {
            fprintf(stderr, "cache_lookup: '%s' is not a fingerprint\n", argv[i]);
            rc = 2;
            break;
        }
        void *cubin = NULL;
        size_t size = 0;
        int found = 0;
        if (kiln_cache_get(cache, fp, &cubin, &size, &found) != KILN_OK) {
            printf("%s error %s\n", argv[i], kiln_errmsg());
        } else if (!found) {
            printf("%s miss\n", argv[i]);
        } else if (kiln__sha256(cubin, size, sum) != 0) {
            printf("%s error sha256\n", argv[i]);
        } else {
            printf("%s hit ", argv[i]);
            for (size_t k = 0; k < sizeof sum; k++)
                printf("%02x", sum[k]);
            putchar('\n');
        }
        kiln_free(cubin);
    }
    kiln_cache_close(cache);
    return rc;
}
