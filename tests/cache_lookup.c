/* Looks up fingerprints in a cache database as a process that loads kernels
 * does, with the database opened read-only so that nothing changes. For
 * tests/corruption_trials.py: what a damaged database would hand out.
 *   usage: cache_lookup [--expect REF.db] DB FINGERPRINT_HEX...
 * With --expect, each fingerprint's template_id, constants, arch, NVRTC
 * version and parts are read from REF.db (the clean database) and the row
 * found must be of that kernel, as the jit checks (what a loading process
 * computed the key from); without it, kiln_cache_get (the checksum alone).
 * Prints one line per fingerprint: "<fp> hit <SHA-256 of the cubin>",
 * "<fp> miss" or "<fp> error <message>". An argument "tuning:KIND:KEY" looks
 * that tuning row up instead: "tuning hit <SHA-256 of the payload>",
 * "tuning miss" or "tuning error <message>".
 * Exit status: 0 every fingerprint was looked up; 1 a database could not be
 * opened; 2 a usage error. */
#include <sqlite3.h>
#include <stdio.h>
#include <string.h>

#include "cache/cache.h"
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

/* The row of fp in the reference database, as the record a requester
 * computes: 1 when found (its text is valid until the statement's next
 * step or reset), 0 when not. */
static int expected(sqlite3_stmt *q, const uint8_t *fp, kiln_cache_record *rec)
{
    sqlite3_reset(q);
    sqlite3_bind_blob(q, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_TRANSIENT);
    if (sqlite3_step(q) != SQLITE_ROW)
        return 0;
    memset(rec, 0, sizeof *rec);
    memcpy(rec->fingerprint, fp, KILN_FINGERPRINT_SIZE);
    rec->template_id = (const char *)sqlite3_column_text(q, 0);
    rec->constants = (const char *)sqlite3_column_text(q, 1);
    rec->arch = (const char *)sqlite3_column_text(q, 2);
    rec->nvrtc_major = sqlite3_column_int(q, 3);
    rec->nvrtc_minor = sqlite3_column_int(q, 4);
    rec->parts = (const char *)sqlite3_column_text(q, 5);
    return rec->template_id && rec->constants && rec->arch;
}

int main(int argc, char **argv)
{
    int first = 1;
    sqlite3 *ref = NULL;
    sqlite3_stmt *q = NULL;
    if (argc > 2 && !strcmp(argv[1], "--expect")) {
        if (sqlite3_open_v2(argv[2], &ref, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK ||
            sqlite3_prepare_v2(ref,
                               "SELECT template_id, constants, arch, nvrtc_major, nvrtc_minor, parts FROM kernels"
                               " WHERE fingerprint = ?1",
                               -1, &q, NULL) != SQLITE_OK) {
            fprintf(stderr, "cache_lookup: %s: %s\n", argv[2], ref ? sqlite3_errmsg(ref) : "cannot open");
            sqlite3_close(ref);
            return 1;
        }
        first = 3;
    }
    if (argc < first + 1) {
        fprintf(stderr, "usage: cache_lookup [--expect REF.db] DB FINGERPRINT_HEX...\n");
        sqlite3_finalize(q);
        sqlite3_close(ref);
        return 2;
    }
    kiln_cache_options opts = {.size = sizeof opts, .path = argv[first], .read_only = 1, .ignore_env = 1};
    kiln_cache *cache;
    if (kiln_cache_open(&opts, &cache) != KILN_OK) {
        fprintf(stderr, "cache_lookup: %s\n", kiln_errmsg());
        sqlite3_finalize(q);
        sqlite3_close(ref);
        return 1;
    }
    int rc = 0;
    for (int i = first + 1; i < argc; i++) {
        uint8_t fp[KILN_FINGERPRINT_SIZE], sum[32];
        if (!strncmp(argv[i], "tuning:", 7) && strchr(argv[i] + 7, ':')) {
            char kind[KILN_TUNING_KIND_MAX + 1];
            const char *colon = strchr(argv[i] + 7, ':');
            snprintf(kind, sizeof kind, "%.*s", (int)(colon - argv[i] - 7), argv[i] + 7);
            void *payload = NULL;
            size_t n = 0;
            int found = 0;
            if (kiln_cache_tuning_get(cache, kind, colon + 1, &payload, &n, &found) != KILN_OK) {
                printf("tuning error %s\n", kiln_errmsg());
            } else if (!found) {
                printf("tuning miss\n");
            } else if (kiln__sha256(payload, n, sum) != 0) {
                printf("tuning error sha256\n");
            } else {
                printf("tuning hit ");
                for (size_t k = 0; k < sizeof sum; k++)
                    printf("%02x", sum[k]);
                putchar('\n');
            }
            kiln_free(payload);
            continue;
        }
        if (parse_hex(argv[i], fp)) {
            fprintf(stderr, "cache_lookup: '%s' is not a fingerprint\n", argv[i]);
            rc = 2;
            break;
        }
        void *cubin = NULL;
        size_t size = 0;
        int found = 0;
        kiln_cache_record rec;
        if (q && !expected(q, fp, &rec)) {
            printf("%s error not in the reference database\n", argv[i]);
            continue;
        }
        if (kiln__cache_load(cache, fp, q ? &rec : NULL, 1, &cubin, &size, &found, NULL) != KILN_OK) {
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
    sqlite3_finalize(q);
    sqlite3_close(ref);
    return rc;
}
