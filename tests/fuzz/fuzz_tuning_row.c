/* Fuzz target: tuning rows and coverage records that someone else wrote.
 *
 * Each input becomes one row of the tuning table (or, by its mode, of the
 * coverage table), written straight into a real kiln database through a
 * second SQLite connection, then read back through kiln: kiln_cache_tuning_get
 * (and the cuBLASLt payload decoder) or kiln_cache_coverage_foreach, and now
 * and then kiln_cache_verify. The row is judged here independently (types as
 * stored, lengths, SHA-256 over length-prefixed parts with OpenSSL EVP, the
 * needs lines) and kiln must agree: a valid tuning row is a hit with exactly
 * its payload; an invalid one under the key looked up is a miss, dropped and
 * counted; a coverage record is valid exactly when judged so.
 *
 * Input layout (short inputs read as zero-padded):
 *   byte  0       mode: bit 0 id as given (else computed), bit 1 checksum as
 *                 given (else computed), bit 2 payload stored as text, bit 3
 *                 kind stored as an integer (its length: SQLite keeps it as
 *                 decimal text in the TEXT column; computed digests cover
 *                 that text, and the lookup still asks for the kind bytes),
 *                 bit 4 a coverage record
 *   byte  1       kind length; bytes 2..3 key length (little-endian)
 *   bytes 4..35   the id field; bytes 36..67 the checksum field
 *   then          kind, key, then the payload (a record's needs) to the end
 */
#include <openssl/evp.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/internal.h"
#include "fuzz_common.h"
#include "providers/blas.h"

#define HEADER 68

static struct {
    char dir[4096], path[4200];
    kiln_cache *cache;
    sqlite3 *db;
} g;

static struct {
    unsigned long long inputs, tuning_hits, tuning_misses, dropped, coverage_valid, coverage_bad, payload_decoded;
} g_stats;

void kiln_fuzz_summary(FILE *f)
{
    fprintf(f,
            "fuzz_tuning_row: %llu inputs: tuning %llu hits, %llu misses (%llu dropped); coverage %llu valid, %llu "
            "bad; %llu cuBLASLt payloads decoded\n",
            g_stats.inputs, g_stats.tuning_hits, g_stats.tuning_misses, g_stats.dropped, g_stats.coverage_valid,
            g_stats.coverage_bad, g_stats.payload_decoded);
}

static void cleanup(void)
{
    char p[4300];
    kiln_cache_close(g.cache);
    sqlite3_close(g.db);
    static const char *const suffixes[] = {"", "-wal", "-shm", "-journal"};
    for (size_t i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s%s", g.path, suffixes[i]);
        unlink(p);
    }
    rmdir(g.dir);
}

static void init(void)
{
    if (g.cache)
        return;
    const char *tmp = getenv("TMPDIR");
    snprintf(g.dir, sizeof g.dir, "%s/fuzz-tuning-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    FUZZ_CHECK(mkdtemp(g.dir), "mkdtemp %s", g.dir);
    snprintf(g.path, sizeof g.path, "%s/kernels.db", g.dir);
    kiln_cache_options o = {.size = sizeof o, .path = g.path, .ignore_env = 1};
    FUZZ_CHECK(kiln_cache_open(&o, &g.cache) == KILN_OK, "open: %s", kiln_errmsg());
    FUZZ_CHECK(sqlite3_open(g.path, &g.db) == SQLITE_OK, "sqlite3_open");
    sqlite3_busy_timeout(g.db, 10000);
    /* The file is scratch: no fsync per input. */
    sqlite3_exec(g.db, "PRAGMA synchronous=OFF", NULL, NULL, NULL);
    atexit(cleanup);
}

/* SHA-256 over parts, each as its 8-byte little-endian length and its bytes. */
static void H(const void *const *p, const size_t *n, size_t count, uint8_t out[32])
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned int len = 0;
    FUZZ_CHECK(ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL), "EVP");
    for (size_t i = 0; i < count; i++) {
        uint8_t prefix[8];
        for (int b = 0; b < 8; b++)
            prefix[b] = (uint8_t)((uint64_t)n[i] >> (8 * b));
        EVP_DigestUpdate(ctx, prefix, 8);
        if (n[i])
            EVP_DigestUpdate(ctx, p[i], n[i]);
    }
    FUZZ_CHECK(EVP_DigestFinal_ex(ctx, out, &len) && len == 32, "EVP final");
    EVP_MD_CTX_free(ctx);
}

static int is_hex64(const uint8_t *s, size_t n)
{
    if (n != 64)
        return 0;
    for (size_t i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

/* The needs text judged here: lines of 64 hex, a tab, three tabs in all, a newline. */
static int needs_ok(const uint8_t *s, size_t n)
{
    if (memchr(s, 0, n))
        return 0;
    for (size_t at = 0; at < n;) {
        const uint8_t *end = memchr(s + at, '\n', n - at);
        if (!end)
            return 0;
        size_t l = (size_t)(end - (s + at)), tabs = 0;
        for (size_t i = 0; i < l; i++)
            tabs += s[at + i] == '\t';
        if (l < 65 || !is_hex64(s + at, 64) || s[at + 64] != '\t' || tabs != 3)
            return 0;
        at += l + 1;
    }
    return 1;
}

static int64_t count_rows(const char *table)
{
    char sql[64];
    sqlite3_stmt *q;
    int64_t n = -1;
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s", table);
    FUZZ_CHECK(sqlite3_prepare_v2(g.db, sql, -1, &q, NULL) == SQLITE_OK, "count");
    if (sqlite3_step(q) == SQLITE_ROW)
        n = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    return n;
}

static void bind_text_or(sqlite3_stmt *q, int i, const uint8_t *s, size_t n, int as_int)
{
    if (as_int)
        sqlite3_bind_int(q, i, (int)n);
    else
        sqlite3_bind_text(q, i, (const char *)s, (int)n, SQLITE_TRANSIENT);
}

typedef struct seen {
    int n, valid;
} seen;

static int on_record(void *user, const kiln_coverage_info *info)
{
    seen *s = user;
    s->n++;
    s->valid = info->valid;
    FUZZ_CHECK(info->valid || (info->detail && info->detail[0]), "an invalid record without a reason");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    init();
    uint8_t head[HEADER] = {0};
    memcpy(head, data, size < HEADER ? size : HEADER);
    const uint8_t *rest = size > HEADER ? data + HEADER : (const uint8_t *)"";
    size_t left = size > HEADER ? size - HEADER : 0;
    const int mode = head[0];
    size_t kind_len = head[1] < left ? head[1] : left;
    const uint8_t *kind = rest;
    size_t key_len = (size_t)(head[2] | head[3] << 8);
    key_len = key_len < left - kind_len ? key_len : left - kind_len;
    const uint8_t *key = rest + kind_len, *payload = key + key_len;
    size_t payload_len = left - kind_len - key_len;
    g_stats.inputs++;
    /* The kind as the row holds it: an integer (its length) bound to the TEXT
     * column is stored as its decimal text, and the digests a writer computed
     * over that text make a valid row. */
    char kind_text[24];
    const uint8_t *stored = kind;
    size_t stored_len = kind_len;
    if (mode & 8) {
        stored_len = (size_t)snprintf(kind_text, sizeof kind_text, "%d", (int)kind_len);
        stored = (const uint8_t *)kind_text;
    }
    const int stored_is_kind = stored_len == kind_len && !memcmp(stored, kind, kind_len);
    sqlite3_exec(g.db, "DELETE FROM tuning; DELETE FROM coverage;", NULL, NULL, NULL);

    uint8_t id[32], sum[32];
    if (mode & 16) {
        /* A coverage record: kind is the model name, key the envelope, the payload the needs. */
        static const char digest[] = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        const void *ip[] = {"kiln-coverage-id-1", digest, key, "sm_90", "13.0"};
        const size_t in[] = {18, 64, key_len, 5, 4};
        uint8_t want_id[32], want_sum[32];
        H(ip, in, 5, want_id);
        memcpy(id, mode & 1 ? head + 4 : want_id, 32);
        const void *cp[] = {"kiln-coverage-1", id, stored, digest, key, "sm_90", "13.0", payload};
        const size_t cn[] = {15, 32, stored_len, 64, key_len, 5, 4, payload_len};
        H(cp, cn, 8, want_sum);
        memcpy(sum, mode & 2 ? head + 36 : want_sum, 32);
        const int digests_ok = !memcmp(id, want_id, 32) && !memcmp(sum, want_sum, 32);
        sqlite3_stmt *ins;
        FUZZ_CHECK(sqlite3_prepare_v2(g.db,
                                      "INSERT INTO coverage VALUES (?1, ?2, ?3, ?4, 'sm_90', 13, 0, ?5, ?6, 1)", -1,
                                      &ins, NULL) == SQLITE_OK,
                   "prepare");
        sqlite3_bind_blob(ins, 1, id, 32, SQLITE_STATIC);
        bind_text_or(ins, 2, kind, kind_len, mode & 8);
        sqlite3_bind_text(ins, 3, digest, 64, SQLITE_STATIC);
        sqlite3_bind_text(ins, 4, (const char *)key, (int)key_len, SQLITE_TRANSIENT);
        if (mode & 4)
            sqlite3_bind_blob(ins, 5, payload, (int)payload_len, SQLITE_TRANSIENT);
        else
            sqlite3_bind_text(ins, 5, (const char *)payload, (int)payload_len, SQLITE_TRANSIENT);
        sqlite3_bind_blob(ins, 6, sum, 32, SQLITE_STATIC);
        FUZZ_CHECK(sqlite3_step(ins) == SQLITE_DONE, "insert: %s", sqlite3_errmsg(g.db));
        sqlite3_finalize(ins);
        const int want = digests_ok && !(mode & 4) && stored_len > 0 && !memchr(stored, 0, stored_len) &&
                         !memchr(key, 0, key_len) && needs_ok(payload, payload_len);
        seen s = {0};
        FUZZ_CHECK(kiln_cache_coverage_foreach(g.cache, on_record, &s) == KILN_OK, "foreach: %s", kiln_errmsg());
        FUZZ_CHECK(s.n == 1, "%d records listed", s.n);
        FUZZ_CHECK(s.valid == want, "record judged %d by kiln, %d here", s.valid, want);
        g_stats.coverage_valid += want;
        g_stats.coverage_bad += !want;
        char detail[256];
        size_t lines;
        (void)kiln__coverage_needs_check((const char *)payload, payload_len, &lines, detail, sizeof detail);
    } else {
        const void *ip[] = {"kiln-tuning-id-1", stored, key};
        const size_t in[] = {16, stored_len, key_len};
        uint8_t want_id[32], want_sum[32];
        H(ip, in, 3, want_id);
        memcpy(id, mode & 1 ? head + 4 : want_id, 32);
        const void *cp[] = {"kiln-tuning-1", id, stored, key, payload};
        const size_t cn[] = {13, 32, stored_len, key_len, payload_len};
        H(cp, cn, 5, want_sum);
        memcpy(sum, mode & 2 ? head + 36 : want_sum, 32);
        const int digests_ok = !memcmp(id, want_id, 32) && !memcmp(sum, want_sum, 32);
        sqlite3_stmt *ins;
        FUZZ_CHECK(sqlite3_prepare_v2(g.db, "INSERT INTO tuning VALUES (?1, ?2, ?3, ?4, ?5, 1, 1, 0)", -1, &ins,
                                      NULL) == SQLITE_OK,
                   "prepare");
        sqlite3_bind_blob(ins, 1, id, 32, SQLITE_STATIC);
        bind_text_or(ins, 2, kind, kind_len, mode & 8);
        sqlite3_bind_text(ins, 3, (const char *)key, (int)key_len, SQLITE_TRANSIENT);
        if (mode & 4)
            sqlite3_bind_text(ins, 4, (const char *)payload, (int)payload_len, SQLITE_TRANSIENT);
        else
            sqlite3_bind_blob(ins, 4, payload, (int)payload_len, SQLITE_TRANSIENT);
        sqlite3_bind_blob(ins, 5, sum, 32, SQLITE_STATIC);
        FUZZ_CHECK(sqlite3_step(ins) == SQLITE_DONE, "insert: %s", sqlite3_errmsg(g.db));
        sqlite3_finalize(ins);
        /* What the library is asked for: the kind and key as C strings. */
        char kbuf[KILN_TUNING_KIND_MAX + 2], ybuf[KILN_TUNING_KEY_MAX + 2];
        snprintf(kbuf, sizeof kbuf, "%.*s", (int)(kind_len < sizeof kbuf - 1 ? kind_len : sizeof kbuf - 1), kind);
        snprintf(ybuf, sizeof ybuf, "%.*s", (int)(key_len < sizeof ybuf - 1 ? key_len : sizeof ybuf - 1), key);
        const int args_ok = kbuf[0] && strlen(kbuf) <= KILN_TUNING_KIND_MAX && ybuf[0] &&
                            strlen(ybuf) <= KILN_TUNING_KEY_MAX;
        const int exact = strlen(kbuf) == kind_len && strlen(ybuf) == key_len;
        uint8_t lookup[32];
        const void *lp[] = {"kiln-tuning-id-1", kbuf, ybuf};
        const size_t ln[] = {16, strlen(kbuf), strlen(ybuf)};
        H(lp, ln, 3, lookup);
        const int valid = exact && args_ok && digests_ok && !(mode & 4) && stored_is_kind &&
                          payload_len >= 1 &&
                          payload_len <= KILN_TUNING_PAYLOAD_MAX;
        const int same_id = !memcmp(lookup, id, 32);
        kiln_cache_counters before, after;
        kiln_cache_get_counters(g.cache, &before);
        void *got = NULL;
        size_t got_size = 0;
        int found = 0;
        kiln_status st = kiln_cache_tuning_get(g.cache, kbuf, ybuf, &got, &got_size, &found);
        kiln_cache_get_counters(g.cache, &after);
        if (!args_ok) {
            FUZZ_CHECK(st == KILN_ERR_INVALID_ARGUMENT && !found, "bad arguments: status %d", (int)st);
        } else {
            FUZZ_CHECK(st == KILN_OK, "tuning_get: %s", kiln_errmsg());
            FUZZ_CHECK(found == valid, "found %d, judged valid %d", found, valid);
            if (found) {
                FUZZ_CHECK(got_size == payload_len && !memcmp(got, payload, payload_len), "a hit with other bytes");
                g_stats.tuning_hits++;
            } else {
                g_stats.tuning_misses++;
                /* A bad row under the key looked up is dropped and counted; another key's is left. */
                const int dropped = same_id;
                FUZZ_CHECK(count_rows("tuning") == (dropped ? 0 : 1), "the bad row was %sdropped",
                           dropped ? "not " : "");
                FUZZ_CHECK(after.corrupt_dropped - before.corrupt_dropped == (uint64_t)dropped, "corrupt_dropped");
                g_stats.dropped += dropped;
            }
        }
        kiln_free(got);
        cublasLtMatmulAlgo_t algo;
        float ms;
        if (kiln__blas_tuning_decode(payload, payload_len, &algo, &ms) == 0) {
            FUZZ_CHECK(payload_len == KILN__BLAS_TUNING_PAYLOAD && ms >= 0 && ms < 1e6f, "decoded a bad payload");
            g_stats.payload_decoded++;
        }
    }
    if (g_stats.inputs % 16 == 0) {
        kiln_cache_verify_report r;
        FUZZ_CHECK(kiln_cache_verify(g.cache, NULL, NULL, &r) == KILN_OK, "verify: %s", kiln_errmsg());
        FUZZ_CHECK(r.integrity_ok, "integrity");
    }
    return 0;
}
