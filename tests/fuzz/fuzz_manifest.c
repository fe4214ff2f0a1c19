/* Fuzz target: the manifest and signature of a signed layer.
 *
 * A signed database's kiln_signature row is outside data as much as its
 * kernels are. Each input becomes that row of a real database of two kernels
 * (made once per process under $TMPDIR and signed there by kiln_cache_sign
 * with a fixed Ed25519 key), written through a second SQLite connection; the
 * database is then opened as a read-only layer under a policy that trusts
 * that key, and checked with kiln_cache_check_signature. The manifest is
 * judged here independently (its layout, SHA-256 and Ed25519 through OpenSSL
 * EVP) and kiln must agree: the layer is admitted exactly when the manifest
 * is well formed, its signature verifies and its key is the trusted one; a
 * kernel of it loads exactly when the manifest lists its fingerprint with
 * its cubin's and columns' digests; the signature report says the same.
 *
 * Input layout (a short input reads as zero-padded):
 *   byte 0   mode: bit 0 sign the manifest with the trusted key (else the
 *            signature field is the signature), bit 1 write the trusted
 *            public key and its id into the header, bit 2 set the entry
 *            count from the size, bit 3 write the domain string, bit 4
 *            makes bits 0 and 1 use another key, one the policy does not list
 *   byte 1   length of the signature field, modulo 80
 *   then     the signature field, then the manifest
 */
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_common.h"
#include "kiln/cache.h"

#define DOMAIN "kiln-signed-layer-1"
#define DOMAIN_SIZE sizeof(DOMAIN) /* its NUL included */
#define HEADER (DOMAIN_SIZE + 32 + 32 + 8)
#define ENTRY 96
#define MAX_ROWS (1u << 22)
#define N_ROWS 2
#define CUBIN 1000

static struct {
    char dir[4096], layer[4200], main_db[4200], pub_path[4200];
    EVP_PKEY *key, *other;
    uint8_t pub[32], key_id[32], other_pub[32], other_id[32];
    uint8_t fp[N_ROWS][32], cubin_sum[N_ROWS][32], meta[N_ROWS][32];
    sqlite3 *db;
    sqlite3_stmt *update;
} g;

static struct {
    unsigned long long inputs, admitted, bad_form, bad_signature, other_key, rows_loaded, rows_refused;
} g_stats;

static void cleanup(void)
{
    sqlite3_finalize(g.update);
    sqlite3_close(g.db);
    EVP_PKEY_free(g.key);
    EVP_PKEY_free(g.other);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g.dir);
    if (g.dir[0] && system(cmd) != 0)
        fprintf(stderr, "fuzz_manifest: could not remove %s\n", g.dir);
}

static void sha256(const void *p, size_t n, uint8_t out[32])
{
    unsigned len = 0;
    FUZZ_CHECK(EVP_Digest(p, n, out, &len, EVP_sha256(), NULL) == 1, "SHA-256 failed");
}

/* The digest of a row's loaded columns, as docs/cache.md defines it: SHA-256
 * of each part as its length (8 bytes, little-endian) and its bytes. */
static void meta_digest(const char *const parts[7], uint8_t out[32])
{
    uint8_t buf[1024];
    size_t n = 0;
    for (int i = 0; i < 7; i++) {
        uint64_t len = strlen(parts[i]);
        for (int b = 0; b < 8; b++)
            buf[n++] = (uint8_t)(len >> (8 * b));
        memcpy(buf + n, parts[i], len);
        n += len;
    }
    sha256(buf, n, out);
}

static void setup(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g.dir, sizeof g.dir, "%s/kiln-fuzz-manifest-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    FUZZ_CHECK(mkdtemp(g.dir) != NULL, "mkdtemp %s failed", g.dir);
    atexit(cleanup);
    snprintf(g.layer, sizeof g.layer, "%s/layer.db", g.dir);
    snprintf(g.main_db, sizeof g.main_db, "%s/main.db", g.dir);
    snprintf(g.pub_path, sizeof g.pub_path, "%s/key.pub", g.dir);
    char key_path[4200];
    snprintf(key_path, sizeof key_path, "%s/key.pem", g.dir);
    /* A fixed key, so that a seed's key id is the same in every run. */
    uint8_t seed[32];
    for (int i = 0; i < 32; i++)
        seed[i] = (uint8_t)(i * 37 + 11);
    g.key = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, seed, sizeof seed);
    size_t len = 32;
    FUZZ_CHECK(g.key && EVP_PKEY_get_raw_public_key(g.key, g.pub, &len) == 1, "no Ed25519 key");
    sha256(g.pub, 32, g.key_id);
    seed[0] ^= 0xff;
    g.other = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, seed, sizeof seed);
    len = 32;
    FUZZ_CHECK(g.other && EVP_PKEY_get_raw_public_key(g.other, g.other_pub, &len) == 1, "no Ed25519 key");
    sha256(g.other_pub, 32, g.other_id);
    FILE *f = fopen(key_path, "w");
    FUZZ_CHECK(f && PEM_write_PrivateKey(f, g.key, NULL, NULL, 0, NULL, NULL) == 1, "cannot write %s", key_path);
    fclose(f);
    f = fopen(g.pub_path, "w");
    FUZZ_CHECK(f && PEM_write_PUBKEY(f, g.key) == 1, "cannot write %s", g.pub_path);
    fclose(f);

    kiln_cache_options o = {.size = sizeof o, .path = g.layer, .ignore_env = 1};
    kiln_cache *c = NULL;
    FUZZ_CHECK(kiln_cache_open(&o, &c) == KILN_OK, "%s", kiln_errmsg());
    static uint8_t cubin[N_ROWS][CUBIN];
    for (int r = 0; r < N_ROWS; r++) {
        for (int i = 0; i < CUBIN; i++)
            cubin[r][i] = (uint8_t)(i * (r + 3) + r);
        memset(g.fp[r], 0x10 * (r + 1), 32);
        kiln_cache_record rec = {.template_id = "rms_norm", .constants = "HIDDEN=4096", .arch = "sm_90",
                                 .nvrtc_major = 13, .entries = "kiln_rms_norm", .parts = "",
                                 .cubin = cubin[r], .cubin_size = CUBIN};
        memcpy(rec.fingerprint, g.fp[r], 32);
        FUZZ_CHECK(kiln_cache_put(c, &rec) == KILN_OK, "%s", kiln_errmsg());
        sha256(cubin[r], CUBIN, g.cubin_sum[r]);
        const char *parts[7] = {"kiln-row-meta-1", "rms_norm", "HIDDEN=4096", "sm_90", "nvrtc:13.0", "kiln_rms_norm",
                                ""};
        meta_digest(parts, g.meta[r]);
    }
    uint8_t id[32];
    FUZZ_CHECK(kiln_cache_sign(c, key_path, id) == KILN_OK, "%s", kiln_errmsg());
    FUZZ_CHECK(!memcmp(id, g.key_id, 32), "kiln_cache_sign's key id is not SHA-256 of the public key");
    FUZZ_CHECK(kiln_cache_seal(c) == KILN_OK, "%s", kiln_errmsg());
    kiln_cache_close(c);
    FUZZ_CHECK(sqlite3_open(g.layer, &g.db) == SQLITE_OK, "cannot open %s", g.layer);
    /* A scratch file: no fsync per input. */
    sqlite3_exec(g.db, "PRAGMA synchronous=OFF", NULL, NULL, NULL);
    FUZZ_CHECK(sqlite3_prepare_v2(g.db, "UPDATE kiln_signature SET manifest = ?1, signature = ?2 WHERE id = 1", -1,
                                  &g.update, NULL) == SQLITE_OK,
               "%s", sqlite3_errmsg(g.db));
}

static int ed25519_ok(const uint8_t *pub, const uint8_t *msg, size_t n, const uint8_t *sig, size_t sig_n)
{
    EVP_PKEY *k = EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, NULL, pub, 32);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = k && ctx && EVP_DigestVerifyInit(ctx, NULL, NULL, NULL, k) == 1 &&
             EVP_DigestVerify(ctx, sig, sig_n, msg, n) == 1;
    EVP_MD_CTX_free(ctx);
    EVP_PKEY_free(k);
    return ok;
}

/* Whether the manifest is well formed (signature aside). */
static int well_formed(const uint8_t *m, size_t n)
{
    if (n < HEADER || memcmp(m, DOMAIN, DOMAIN_SIZE) != 0)
        return 0;
    uint8_t id[32];
    sha256(m + DOMAIN_SIZE, 32, id);
    if (memcmp(id, m + DOMAIN_SIZE + 32, 32) != 0)
        return 0;
    uint64_t count = 0;
    for (int b = 7; b >= 0; b--)
        count = count << 8 | m[HEADER - 8 + b];
    if (count > MAX_ROWS || n != HEADER + count * ENTRY)
        return 0;
    for (uint64_t i = 1; i < count; i++)
        if (memcmp(m + HEADER + (i - 1) * ENTRY, m + HEADER + i * ENTRY, 32) >= 0)
            return 0;
    return 1;
}

/* Whether a well-formed manifest lists row r as it is. */
static int lists_row(const uint8_t *m, size_t n, int r)
{
    for (size_t off = HEADER; off + ENTRY <= n; off += ENTRY)
        if (!memcmp(m + off, g.fp[r], 32))
            return !memcmp(m + off + 32, g.cubin_sum[r], 32) && !memcmp(m + off + 64, g.meta[r], 32);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!g.db)
        setup();
    g_stats.inputs++;
    uint8_t mode = size > 0 ? data[0] : 0;
    size_t sig_n = size > 1 ? data[1] % 80 : 0;
    size_t at = size < 2 ? size : 2;
    size_t sig_avail = size - at < sig_n ? size - at : sig_n;
    uint8_t sig[80] = {0};
    memcpy(sig, data + at, sig_avail);
    at += sig_avail;
    size_t n = size - at;
    uint8_t *m = malloc(n ? n : 1);
    FUZZ_CHECK(m != NULL, "out of memory");
    memcpy(m, data + at, n);
    if ((mode & 8) && n >= DOMAIN_SIZE)
        memcpy(m, DOMAIN, DOMAIN_SIZE);
    if ((mode & 2) && n >= DOMAIN_SIZE + 64) {
        memcpy(m + DOMAIN_SIZE, mode & 16 ? g.other_pub : g.pub, 32);
        memcpy(m + DOMAIN_SIZE + 32, mode & 16 ? g.other_id : g.key_id, 32);
    }
    if ((mode & 4) && n >= HEADER) {
        uint64_t count = (n - HEADER) / ENTRY;
        for (int b = 0; b < 8; b++)
            m[HEADER - 8 + b] = (uint8_t)(count >> (8 * b));
    }
    if (mode & 1) {
        EVP_MD_CTX *ctx = EVP_MD_CTX_new();
        size_t len = 64;
        FUZZ_CHECK(ctx && EVP_DigestSignInit(ctx, NULL, NULL, NULL, mode & 16 ? g.other : g.key) == 1 &&
                       EVP_DigestSign(ctx, sig, &len, m, n) == 1 && len == 64,
                   "signing failed");
        EVP_MD_CTX_free(ctx);
        sig_n = 64;
    } else {
        sig_n = sig_avail;
    }
    /* The judgement, before kiln sees it. */
    int form = well_formed(m, n);
    int signature = form && sig_n == 64 && ed25519_ok(m + DOMAIN_SIZE, m, n, sig, sig_n);
    int trusted = signature && !memcmp(m + DOMAIN_SIZE + 32, g.key_id, 32);
    int listed[N_ROWS];
    for (int r = 0; r < N_ROWS; r++)
        listed[r] = signature && lists_row(m, n, r);

    sqlite3_bind_blob(g.update, 1, m, (int)n, SQLITE_TRANSIENT);
    sqlite3_bind_blob(g.update, 2, sig, (int)sig_n, SQLITE_TRANSIENT);
    FUZZ_CHECK(sqlite3_step(g.update) == SQLITE_DONE, "%s", sqlite3_errmsg(g.db));
    sqlite3_reset(g.update);

    const char *layers[] = {g.layer}, *keys[] = {g.pub_path};
    kiln_cache_options o = {.size = sizeof o, .path = g.main_db, .ignore_env = 1, .readonly_paths = layers,
                            .n_readonly_paths = 1, .trusted_keys = keys, .n_trusted_keys = 1};
    kiln_cache *c = NULL;
    FUZZ_CHECK(kiln_cache_open(&o, &c) == KILN_OK, "%s", kiln_errmsg());
    kiln_cache_layer_info info;
    FUZZ_CHECK(kiln_cache_layer(c, 0, &info) == KILN_OK, "no layer");
    FUZZ_CHECK(info.active == trusted, "layer active %d, expected %d (form %d, signature %d): %s", info.active,
               trusted, form, signature, info.reason);
    FUZZ_CHECK(info.active || (*info.reason && strlen(info.reason) < 1024), "a skipped layer without a reason");
    if (!form)
        g_stats.bad_form++;
    else if (!signature)
        g_stats.bad_signature++;
    else if (!trusted)
        g_stats.other_key++;
    else
        g_stats.admitted++;
    for (int r = 0; r < N_ROWS; r++) {
        void *cubin = NULL;
        size_t got = 0;
        int found = -1;
        FUZZ_CHECK(kiln_cache_get(c, g.fp[r], &cubin, &got, &found) == KILN_OK, "%s", kiln_errmsg());
        FUZZ_CHECK(found == (trusted && listed[r]), "row %d found %d, expected %d", r, found, trusted && listed[r]);
        FUZZ_CHECK(!found || got == CUBIN, "row %d: %zu bytes", r, got);
        kiln_free(cubin);
        if (found)
            g_stats.rows_loaded++;
        else if (trusted)
            g_stats.rows_refused++;
    }
    kiln_cache_close(c);

    /* The report on the same file, opened alone. */
    kiln_cache_options v = {.size = sizeof v, .path = g.layer, .read_only = 1, .ignore_env = 1, .existing_only = 1,
                            .trusted_keys = keys, .n_trusted_keys = 1};
    kiln_cache_signature_report rep;
    FUZZ_CHECK(kiln_cache_open(&v, &c) == KILN_OK, "%s", kiln_errmsg());
    FUZZ_CHECK(kiln_cache_check_signature(c, NULL, NULL, &rep) == KILN_OK, "%s", kiln_errmsg());
    kiln_cache_close(c);
    int all_listed = signature && listed[0] && listed[1];
    FUZZ_CHECK(rep.state == (all_listed ? KILN_CACHE_SIGNATURE_VALID : KILN_CACHE_SIGNATURE_INVALID),
               "report state %d (form %d, signature %d, rows listed %d %d): %s", rep.state, form, signature,
               listed[0], listed[1], rep.detail);
    FUZZ_CHECK(rep.rows == N_ROWS && strlen(rep.detail) < sizeof rep.detail, "report of %llu rows",
               (unsigned long long)rep.rows);
    FUZZ_CHECK(rep.trusted == (signature ? trusted : -1), "report trusted %d, expected %d", rep.trusted,
               signature ? trusted : -1);
    if (signature)
        FUZZ_CHECK(rep.bad_rows == (uint64_t)(!listed[0] + !listed[1]), "report: %llu bad rows",
                   (unsigned long long)rep.bad_rows);
    free(m);
    return 0;
}

void kiln_fuzz_summary(FILE *f)
{
    fprintf(f,
            "fuzz_manifest: %llu inputs: %llu admitted, %llu malformed, %llu bad signatures, %llu other keys;"
            " %llu rows loaded, %llu refused\n",
            g_stats.inputs, g_stats.admitted, g_stats.bad_form, g_stats.bad_signature, g_stats.other_key,
            g_stats.rows_loaded, g_stats.rows_refused);
}
