/* Fuzz target: kiln_cache_get on a row that someone else wrote.
 *
 * The cache file is outside data: another process, an older kiln, a copied or
 * damaged file. Each input becomes one row, written straight into a real kiln
 * database through a second SQLite connection, and is then read back with
 * kiln_cache_get. The row is judged independently here (types as stored,
 * sizes, zstd, SHA-256 over OpenSSL EVP), and kiln must agree exactly: a valid
 * row is a hit with the very bytes; any other row is a miss that is dropped
 * from the file and counted. Each input starts from the same database, one
 * valid row stored by kiln_cache_put, so that a failure reproduces from its
 * input alone.
 *
 * Input layout (short inputs read as zero-padded):
 *   bytes 0..7    raw_size field: int64, little-endian
 *   byte  8       mode: bits 0-1 how the cubin blob is made, bits 2-3 how
 *                 raw_size is stored, bits 4-5 how the checksum is made,
 *                 bit 6 cubin stored as TEXT, bit 7 another fingerprint
 *   byte  9       length of the checksum field, modulo 41
 *   bytes 10..13  edit: uint32, little-endian: where and how to damage
 *   then          the checksum field, then the payload
 */
#include <openssl/evp.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zstd.h>

#include "fuzz_common.h"
#include "kiln/cache.h"

#define HEADER_SIZE 14
#define MAX_CHECKSUM_FIELD 40
/* cache.c's KILN_CACHE_MAX_CUBIN: a larger raw_size is a corrupt row. */
#define MAX_CUBIN (256u << 20)
/* Raw-fuzz blobs that declare more than this are not decoded here for a checksum. */
#define MAX_DECODE_FOR_CHECKSUM (1u << 20)
#define N_FINGERPRINTS 4
/* The fingerprint index of the row every input finds beside its own. */
#define ANCHOR N_FINGERPRINTS

enum { BLOB_RAW, BLOB_FRAME, BLOB_FRAME_EDITED, BLOB_FRAME_RESIZED };
enum { SIZE_FIELD, SIZE_REAL, SIZE_NEAR, SIZE_TYPED };
enum { SUM_FIELD, SUM_REAL, SUM_FLIPPED, SUM_AS_TEXT };

static struct {
    char dir[4096], path[4200];
    kiln_cache *cache;
    sqlite3 *db;
    sqlite3_stmt *insert, *peek, *count, *reset;
    uint8_t anchor[KILN_FINGERPRINT_SIZE];
    uint64_t events;
    uint8_t event_fp[KILN_FINGERPRINT_SIZE];
} g;

static struct {
    unsigned long long inputs, skipped, hits, dropped, oom;
    unsigned long long why_size, why_fields, why_frame, why_zstd, why_checksum, why_other;
} g_stats;

/* ---- the database, once per process ---- */

static void on_event(void *user, const kiln_cache_event *ev)
{
    (void)user;
    FUZZ_CHECK(ev && ev->kind == KILN_CACHE_EVENT_CORRUPT_DROPPED, "unexpected event kind %d", ev ? (int)ev->kind : -1);
    FUZZ_CHECK(ev->detail && ev->detail[0], "event without detail");
    g.events++;
    memcpy(g.event_fp, ev->fingerprint, KILN_FINGERPRINT_SIZE);
}

static void cleanup(void)
{
    char p[4300];
    sqlite3_finalize(g.insert);
    sqlite3_finalize(g.peek);
    sqlite3_finalize(g.count);
    sqlite3_finalize(g.reset);
    sqlite3_close(g.db);
    kiln_cache_close(g.cache);
    static const char *const suffixes[] = {"", "-wal", "-shm", "-journal"};
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        snprintf(p, sizeof p, "%s%s", g.path, suffixes[i]);
        unlink(p);
    }
    rmdir(g.dir);
}

static void prepare(const char *sql, sqlite3_stmt **st)
{
    int rc = sqlite3_prepare_v2(g.db, sql, -1, st, NULL);
    FUZZ_CHECK(rc == SQLITE_OK, "prepare %s: %s", sql, sqlite3_errmsg(g.db));
}

static void fingerprint(int index, uint8_t fp[KILN_FINGERPRINT_SIZE]);

static void setup(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g.dir, sizeof g.dir, "%s/kiln-fuzz-cache-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    FUZZ_CHECK(mkdtemp(g.dir) != NULL, "mkdtemp %s failed", g.dir);
    snprintf(g.path, sizeof g.path, "%s/kernels.db", g.dir);
    kiln_cache_options opts = {.size = sizeof opts, .path = g.path, .on_event = on_event};
    kiln_status st = kiln_cache_open(&opts, &g.cache);
    FUZZ_CHECK(st == KILN_OK, "kiln_cache_open %s: %s", g.path, kiln_errmsg());
    int rc = sqlite3_open_v2(g.path, &g.db, SQLITE_OPEN_READWRITE, NULL);
    FUZZ_CHECK(rc == SQLITE_OK, "sqlite3_open_v2 %s: %s", g.path, sqlite3_errstr(rc));
    sqlite3_busy_timeout(g.db, 10000);
    sqlite3_exec(g.db, "PRAGMA synchronous=OFF", NULL, NULL, NULL);
    prepare("INSERT OR REPLACE INTO kernels (fingerprint, template_id, constants, arch, nvrtc_major, nvrtc_minor,"
            " entries, cubin, raw_size, checksum, created, last_used, hits)"
            " VALUES (?1, 'fuzz', 'N=1', 'sm_90', 12, 4, 'k', ?2, ?3, ?4, 0, 0, 0)",
            &g.insert);
    prepare("SELECT typeof(raw_size), raw_size, checksum, cubin FROM kernels WHERE fingerprint = ?1", &g.peek);
    prepare("SELECT count(*) FROM kernels WHERE fingerprint = ?1", &g.count);
    prepare("DELETE FROM kernels WHERE fingerprint <> ?1", &g.reset);
    atexit(cleanup);
    static const char anchor_cubin[] = "\x7f" "ELF anchor cubin, stored by kiln_cache_put";
    kiln_cache_record r = {.template_id = "anchor", .constants = "N=1", .arch = "sm_90", .nvrtc_major = 12,
                           .nvrtc_minor = 4, .entries = "k", .cubin = anchor_cubin, .cubin_size = sizeof anchor_cubin};
    fingerprint(ANCHOR, g.anchor);
    memcpy(r.fingerprint, g.anchor, KILN_FINGERPRINT_SIZE);
    st = kiln_cache_put(g.cache, &r);
    FUZZ_CHECK(st == KILN_OK, "kiln_cache_put: %s", kiln_errmsg());
}

/* Back to the database setup() made: the anchor row alone. */
static void reset_database(void)
{
    sqlite3_bind_blob(g.reset, 1, g.anchor, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    int rc = sqlite3_step(g.reset);
    FUZZ_CHECK(rc == SQLITE_DONE, "reset: %s", sqlite3_errmsg(g.db));
    sqlite3_reset(g.reset);
}

/* ---- helpers ---- */

static uint64_t le(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void sha256(const void *p, size_t n, uint8_t out[32])
{
    unsigned int len = 0;
    FUZZ_CHECK(EVP_Digest(p, n, out, &len, EVP_sha256(), NULL) == 1 && len == 32, "EVP_Digest failed");
}

/* A growable byte string. */
typedef struct bytes {
    uint8_t *p;
    size_t n;
} bytes;

/* Appends n bytes: a copy of p, or n zero bytes when p is NULL. */
static void append(bytes *b, const void *p, size_t n)
{
    uint8_t *q = realloc(b->p, b->n + n + 1);
    FUZZ_CHECK(q != NULL, "out of memory");
    b->p = q;
    if (n && p)
        memcpy(b->p + b->n, p, n);
    else if (n)
        memset(b->p + b->n, 0, n);
    b->n += n;
}

static void append_frame(bytes *b, const uint8_t *p, size_t n, int level)
{
    size_t cap = ZSTD_compressBound(n);
    uint8_t *z = malloc(cap ? cap : 1);
    FUZZ_CHECK(z != NULL, "out of memory");
    size_t zn = ZSTD_compress(z, cap, p, n, level);
    FUZZ_CHECK(!ZSTD_isError(zn), "ZSTD_compress: %s", ZSTD_getErrorName(zn));
    append(b, z, zn);
    free(z);
}

static void fingerprint(int index, uint8_t fp[KILN_FINGERPRINT_SIZE])
{
    for (int i = 0; i < KILN_FINGERPRINT_SIZE; i++)
        fp[i] = (uint8_t)(0xa5 ^ (i * 29) ^ (index * 71));
}

/* ---- building the row ---- */

typedef struct row_input {
    uint64_t size_field;
    unsigned blob_mode, size_mode, sum_mode, cubin_text, fp_index;
    uint32_t edit;
    const uint8_t *sum_field, *payload;
    size_t sum_len, payload_len;
} row_input;

static void split(const uint8_t *data, size_t size, row_input *in)
{
    uint8_t head[HEADER_SIZE] = {0};
    memcpy(head, data, size < HEADER_SIZE ? size : HEADER_SIZE);
    memset(in, 0, sizeof *in);
    in->size_field = le(head, 8);
    uint8_t mode = head[8];
    in->blob_mode = mode & 3;
    in->size_mode = (mode >> 2) & 3;
    in->sum_mode = (mode >> 4) & 3;
    in->cubin_text = (mode >> 6) & 1;
    in->edit = (uint32_t)le(head + 10, 4);
    in->fp_index = (mode >> 7) ? 1 + (in->edit >> 12) % (N_FINGERPRINTS - 1) : 0;
    size_t rest = size > HEADER_SIZE ? size - HEADER_SIZE : 0;
    const uint8_t *p = data + (size > HEADER_SIZE ? HEADER_SIZE : size);
    in->sum_len = head[9] % (MAX_CHECKSUM_FIELD + 1);
    if (in->sum_len > rest)
        in->sum_len = rest;
    in->sum_field = p;
    in->payload = p + in->sum_len;
    in->payload_len = rest - in->sum_len;
}

/* The cubin blob as the input asks; *real is what the blob holds once decoded. */
static void make_blob(const row_input *in, bytes *blob, const uint8_t **real, size_t *real_len, bytes *scratch)
{
    static const int levels[4] = {1, 3, 9, -5};
    int level = levels[(in->edit >> 8) & 3];
    *real = in->payload;
    *real_len = in->payload_len;
    if (in->blob_mode == BLOB_RAW) {
        append(blob, in->payload, in->payload_len);
        unsigned long long fcs = ZSTD_getFrameContentSize(blob->p, blob->n);
        if (fcs < ZSTD_CONTENTSIZE_ERROR && fcs && fcs <= MAX_DECODE_FOR_CHECKSUM) {
            append(scratch, NULL, (size_t)fcs);
            size_t got = ZSTD_decompress(scratch->p, (size_t)fcs, blob->p, blob->n);
            if (!ZSTD_isError(got)) {
                *real = scratch->p;
                *real_len = got;
            }
        }
        return;
    }
    append_frame(blob, in->payload, in->payload_len, level);
    if (in->blob_mode == BLOB_FRAME_EDITED) {
        unsigned n_edits = 1 + ((in->edit >> 24) & 3);
        size_t span = (in->edit & 0x80000000u) && blob->n > 12 ? 12 : blob->n; /* the header holds the sizes */
        for (unsigned k = 0; k < n_edits; k++) {
            size_t pos = ((in->edit & 0xffff) + k * 7919u) % span;
            blob->p[pos] ^= (uint8_t)((((in->edit >> 16) & 0xff) | 1) << k); /* never 0: always an edit */
        }
    } else if (in->blob_mode == BLOB_FRAME_RESIZED) {
        switch (in->edit >> 30) {
        case 0: /* truncated */
            blob->n = in->edit % blob->n;
            break;
        case 1: /* trailing garbage */
            append(blob, in->payload, (in->edit & 0xff) < in->payload_len ? (in->edit & 0xff) : in->payload_len);
            if (!(in->edit & 0xff))
                append(blob, "\0", 1);
            break;
        case 2: /* a second frame after the first */
            append_frame(blob, in->payload, (in->edit & 0xff) < in->payload_len ? (in->edit & 0xff) : in->payload_len,
                         level);
            break;
        default: { /* a skippable frame before it */
            bytes skip = {0};
            uint8_t head[8] = {0x50 | (in->edit & 0xf), 0x2a, 0x4d, 0x18};
            uint32_t n = (in->edit >> 4) & 0xf;
            head[4] = (uint8_t)n;
            append(&skip, head, 8);
            append(&skip, "kilnkilnkilnkiln", n);
            append(&skip, blob->p, blob->n);
            free(blob->p);
            *blob = skip;
        }
        }
    }
}

/* Binds raw_size as the input asks. Returns 0 when the input wants NULL. */
static int bind_raw_size(const row_input *in, size_t real_len, char *text, size_t cap)
{
    sqlite3_stmt *q = g.insert;
    long long real = (long long)real_len;
    switch (in->size_mode) {
    case SIZE_FIELD:
        sqlite3_bind_int64(q, 3, (sqlite3_int64)in->size_field);
        return 1;
    case SIZE_REAL:
        sqlite3_bind_int64(q, 3, real);
        return 1;
    case SIZE_NEAR:
        sqlite3_bind_int64(q, 3, real + (int8_t)(in->size_field & 0xff));
        return 1;
    default:
        break;
    }
    switch (in->size_field & 7) {
    case 0:
        snprintf(text, cap, "%lld", real);
        break;
    case 1:
        snprintf(text, cap, "%lld%c", real, (char)('!' + (in->size_field >> 8) % 90));
        break;
    case 2:
        sqlite3_bind_double(q, 3, (double)real);
        return 1;
    case 3:
        sqlite3_bind_double(q, 3, (double)real + 0.5);
        return 1;
    case 4:
        sqlite3_bind_null(q, 3);
        return 0;
    case 5:
        sqlite3_bind_blob(q, 3, &in->size_field, 8, SQLITE_TRANSIENT);
        return 1;
    case 6:
        snprintf(text, cap, " %lld ", real);
        break;
    default:
        snprintf(text, cap, "0x%llx", real);
        break;
    }
    sqlite3_bind_text(q, 3, text, -1, SQLITE_TRANSIENT);
    return 1;
}

/* ---- the row as stored, judged here ---- */

typedef struct stored_row {
    int size_is_integer;
    long long raw_size;
    uint8_t checksum[32];
    int checksum_len;
    uint8_t *raw;      /* the decoded cubin when the row is valid */
    int valid;
} stored_row;

static void judge_stored_row(const uint8_t fp[KILN_FINGERPRINT_SIZE], stored_row *r)
{
    memset(r, 0, sizeof *r);
    sqlite3_stmt *q = g.peek;
    sqlite3_bind_blob(q, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    int rc = sqlite3_step(q);
    FUZZ_CHECK(rc == SQLITE_ROW, "the row just written is not there: %s", sqlite3_errmsg(g.db));
    r->size_is_integer = !strcmp((const char *)sqlite3_column_text(q, 0), "integer");
    r->raw_size = sqlite3_column_int64(q, 1);
    const void *sum = sqlite3_column_blob(q, 2);
    int sum_len = sqlite3_column_bytes(q, 2);
    r->checksum_len = sum_len;
    if (sum && sum_len == 32)
        memcpy(r->checksum, sum, 32);
    const void *blob = sqlite3_column_blob(q, 3);
    size_t blob_len = (size_t)sqlite3_column_bytes(q, 3);
    if (r->size_is_integer && r->raw_size >= 1 && r->raw_size <= (long long)MAX_CUBIN && sum_len == 32 && blob &&
        blob_len && ZSTD_getFrameContentSize(blob, blob_len) == (unsigned long long)r->raw_size) {
        r->raw = malloc((size_t)r->raw_size);
        FUZZ_CHECK(r->raw != NULL, "out of memory for %lld bytes", r->raw_size);
        size_t got = ZSTD_decompress(r->raw, (size_t)r->raw_size, blob, blob_len);
        uint8_t mine[32];
        if (!ZSTD_isError(got) && got == (size_t)r->raw_size) {
            sha256(r->raw, got, mine);
            r->valid = !memcmp(mine, r->checksum, 32);
        }
    }
    sqlite3_reset(q);
}

static int rows_with(const uint8_t fp[KILN_FINGERPRINT_SIZE])
{
    sqlite3_bind_blob(g.count, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    int rc = sqlite3_step(g.count);
    FUZZ_CHECK(rc == SQLITE_ROW, "count: %s", sqlite3_errmsg(g.db));
    int n = sqlite3_column_int(g.count, 0);
    sqlite3_reset(g.count);
    return n;
}

static int list_row(void *user, const kiln_cache_entry_info *info)
{
    (void)user;
    FUZZ_CHECK(info->template_id && info->constants && info->arch && info->entries, "an entry with a NULL text");
    return 0;
}

static void count_reason(const char *msg)
{
    if (strstr(msg, "raw_size"))
        g_stats.why_size++;
    else if (strstr(msg, "blob of"))
        g_stats.why_fields++;
    else if (strstr(msg, "zstd frame declares"))
        g_stats.why_frame++;
    else if (strstr(msg, "zstd:"))
        g_stats.why_zstd++;
    else if (strstr(msg, "checksum mismatch"))
        g_stats.why_checksum++;
    else
        g_stats.why_other++;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const uint8_t empty[1];
    if (!g.cache)
        setup();
    if (!data)
        data = empty;
    reset_database();
    g_stats.inputs++;
    row_input in;
    split(data, size, &in);
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    fingerprint((int)in.fp_index, fp);

    bytes blob = {0}, scratch = {0};
    const uint8_t *real;
    size_t real_len;
    make_blob(&in, &blob, &real, &real_len, &scratch);
    append(&blob, NULL, 0); /* never a NULL pointer: an empty blob stays a blob */

    uint8_t sum[32];
    const void *sum_p = in.sum_field;
    int sum_len = (int)in.sum_len;
    if (in.sum_mode != SUM_FIELD) {
        sha256(real, real_len, sum);
        if (in.sum_mode == SUM_FLIPPED)
            sum[(in.edit >> 3) & 31] ^= (uint8_t)(1u << (in.edit & 7));
        sum_p = sum;
        sum_len = 32;
    }

    sqlite3_stmt *q = g.insert;
    char size_text[64];
    int rc;
    sqlite3_bind_blob(q, 1, fp, KILN_FINGERPRINT_SIZE, SQLITE_STATIC);
    if (in.cubin_text)
        sqlite3_bind_text(q, 2, (const char *)blob.p, (int)blob.n, SQLITE_STATIC);
    else
        sqlite3_bind_blob(q, 2, blob.p, (int)blob.n, SQLITE_STATIC);
    bind_raw_size(&in, real_len, size_text, sizeof size_text);
    if (in.sum_mode == SUM_AS_TEXT)
        sqlite3_bind_text(q, 4, sum_p ? (const char *)sum_p : "", sum_len, SQLITE_STATIC);
    else
        sqlite3_bind_blob(q, 4, sum_p ? sum_p : "", sum_len, SQLITE_STATIC);
    rc = sqlite3_step(q);
    sqlite3_reset(q);
    sqlite3_clear_bindings(q);
    if (rc != SQLITE_DONE) {
        /* A row the schema refuses (NOT NULL) cannot reach kiln. */
        FUZZ_CHECK((rc & 0xff) == SQLITE_CONSTRAINT, "insert failed: %s (%d)", sqlite3_errmsg(g.db), rc);
        g_stats.skipped++;
        goto out;
    }

    stored_row row;
    judge_stored_row(fp, &row);

    /* Now and then, also list the database with this row in it. */
    if ((in.edit & 0x3f) == 0x3f) {
        kiln_cache_stats stats;
        FUZZ_CHECK(kiln_cache_foreach(g.cache, list_row, NULL) == KILN_OK, "foreach: %s", kiln_errmsg());
        FUZZ_CHECK(kiln_cache_get_stats(g.cache, &stats) == KILN_OK, "stats: %s", kiln_errmsg());
    }

    kiln_cache_counters before, after;
    kiln_cache_get_counters(g.cache, &before);
    uint64_t events = g.events;
    void *cubin = (void *)1;
    size_t cubin_size = 12345;
    int found = -1;
    kiln_status st = kiln_cache_get(g.cache, fp, &cubin, &cubin_size, &found);
    kiln_cache_get_counters(g.cache, &after);
    if (st == KILN_ERR_HOST_OUT_OF_MEMORY) {
        g_stats.oom++;
        free(row.raw);
        goto out;
    }
    FUZZ_CHECK(st == KILN_OK, "kiln_cache_get: %s: %s", kiln_status_code(st), kiln_errmsg());
    FUZZ_CHECK(found == 0 || found == 1, "found = %d", found);
    int present;
    if (found) {
        g_stats.hits++;
        FUZZ_CHECK(row.valid, "kiln accepted a row that fails verification (raw_size %lld %s, checksum %d bytes)",
                   row.raw_size, row.size_is_integer ? "integer" : "not an integer", row.checksum_len);
        FUZZ_CHECK(cubin && cubin_size == (size_t)row.raw_size, "hit of %zu bytes, row says %lld", cubin_size,
                   row.raw_size);
        uint8_t got[32];
        sha256(cubin, cubin_size, got);
        FUZZ_CHECK(!memcmp(got, row.checksum, 32), "hit whose SHA-256 is not the stored checksum");
        FUZZ_CHECK(!memcmp(cubin, row.raw, cubin_size), "hit whose bytes are not the stored frame's");
        FUZZ_CHECK(after.hits == before.hits + 1 && after.corrupt_dropped == before.corrupt_dropped,
                   "counters after a hit: hits %llu -> %llu, dropped %llu -> %llu", (unsigned long long)before.hits,
                   (unsigned long long)after.hits, (unsigned long long)before.corrupt_dropped,
                   (unsigned long long)after.corrupt_dropped);
        FUZZ_CHECK(kiln_cache_contains(g.cache, fp, &present) == KILN_OK && present, "a hit's row is gone");
    } else {
        g_stats.dropped++;
        const char *msg = kiln_cache_errmsg(g.cache);
        FUZZ_CHECK(!row.valid, "kiln dropped a valid row (raw_size %lld): %s", row.raw_size, msg);
        FUZZ_CHECK(cubin == NULL && cubin_size == 0, "a miss hands out %p, %zu bytes", cubin, cubin_size);
        FUZZ_CHECK(after.corrupt_dropped == before.corrupt_dropped + 1 && after.misses == before.misses + 1,
                   "counters after a drop: dropped %llu -> %llu, misses %llu -> %llu",
                   (unsigned long long)before.corrupt_dropped, (unsigned long long)after.corrupt_dropped,
                   (unsigned long long)before.misses, (unsigned long long)after.misses);
        FUZZ_CHECK(g.events == events + 1 && !memcmp(g.event_fp, fp, KILN_FINGERPRINT_SIZE),
                   "drop without its event (%llu events)", (unsigned long long)(g.events - events));
        FUZZ_CHECK(msg && strstr(msg, "dropped"), "drop without a message: \"%s\"", msg ? msg : "(null)");
        FUZZ_CHECK(kiln_cache_contains(g.cache, fp, &present) == KILN_OK && !present, "a dropped row is still there");
        FUZZ_CHECK(rows_with(fp) == 0, "a dropped row is still in the file");
        FUZZ_CHECK(rows_with(g.anchor) == 1, "dropping a row took another row with it");
        count_reason(msg);
    }
    kiln_free(cubin);
    free(row.raw);
out:
    free(blob.p);
    free(scratch.p);
    return 0;
}

void kiln_fuzz_summary(FILE *f)
{
    fprintf(f,
            "fuzz_cache_row: %llu inputs: %llu hits, %llu dropped (raw_size %llu, fields %llu, frame size %llu,"
            " zstd %llu, checksum %llu, other %llu), %llu refused by the schema, %llu out of memory\n",
            g_stats.inputs, g_stats.hits, g_stats.dropped, g_stats.why_size, g_stats.why_fields, g_stats.why_frame,
            g_stats.why_zstd, g_stats.why_checksum, g_stats.why_other, g_stats.skipped, g_stats.oom);
}
