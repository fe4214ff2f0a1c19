/* Signed layers: the manifest of a database's rows, its Ed25519 signature
 * (OpenSSL's EVP API), and the trust policy that admits a read-only layer by
 * them. docs/cache.md, "Signed layers", is the contract. */
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/objects.h>
#include <openssl/pem.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/internal.h"

static const char signature_table_sql[] =
    "CREATE TABLE IF NOT EXISTS kiln_signature ("
    "  id INTEGER PRIMARY KEY CHECK (id = 1),"
    "  manifest BLOB NOT NULL,"
    "  signature BLOB NOT NULL)";

/* OpenSSL's last error as text (it queues them; the oldest is the cause). */
static const char *ssl_error(char *buf, size_t cap)
{
    unsigned long e = ERR_get_error();
    if (!e)
        snprintf(buf, cap, "no OpenSSL error recorded");
    else
        ERR_error_string_n(e, buf, cap);
    ERR_clear_error();
    return buf;
}

/* Never prompts for a passphrase: an encrypted key fails to load instead. */
static int no_passphrase(char *buf, int size, int rwflag, void *u)
{
    (void)buf, (void)size, (void)rwflag, (void)u;
    return 0;
}

/* The digest of what a load reads from a row besides its cubin. */
static int meta_digest(const char *template_id, const char *constants, const char *arch, sqlite3_int64 major,
                       sqlite3_int64 minor, const char *entries, const char *parts, uint8_t out[32])
{
    char nvrtc[48];
    kiln__hasher *h = kiln__hasher_new();
    if (!h)
        return -1;
    snprintf(nvrtc, sizeof nvrtc, "nvrtc:%lld.%lld", (long long)major, (long long)minor);
    kiln__hasher_str(h, "kiln-row-meta-1");
    kiln__hasher_str(h, template_id);
    kiln__hasher_str(h, constants);
    kiln__hasher_str(h, arch);
    kiln__hasher_str(h, nvrtc);
    kiln__hasher_str(h, entries);
    kiln__hasher_str(h, parts);
    return kiln__hasher_final(h, out);
}

static int ed25519_verify(const uint8_t pub[32], const void *msg, size_t len, const void *sig, size_t sig_len)
{
    EVP_PKEY *key = EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, NULL, pub, 32);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = key && ctx && EVP_DigestVerifyInit(ctx, NULL, NULL, NULL, key) == 1 &&
             EVP_DigestVerify(ctx, sig, sig_len, msg, len) == 1;
    EVP_MD_CTX_free(ctx);
    EVP_PKEY_free(key);
    ERR_clear_error();
    return ok;
}

static uint64_t read_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

void kiln__manifest_free(kiln__manifest *m)
{
    if (!m)
        return;
    free(m->data);
    free(m);
}

kiln_status kiln__manifest_parse(const void *manifest, size_t size, const void *signature, size_t signature_size,
                                 kiln__manifest **out, char *detail, size_t cap)
{
    const uint8_t *p = manifest;
    uint8_t id[32];
    *out = NULL;
    if (!p || size < KILN__MANIFEST_HEADER) {
        snprintf(detail, cap, "manifest of %zu bytes, shorter than its %zu-byte header", size,
                 (size_t)KILN__MANIFEST_HEADER);
        return KILN_ERR_CACHE_CORRUPT;
    }
    if (memcmp(p, KILN__MANIFEST_DOMAIN, KILN__MANIFEST_DOMAIN_SIZE) != 0) {
        snprintf(detail, cap, "manifest does not start with \"%s\"", KILN__MANIFEST_DOMAIN);
        return KILN_ERR_CACHE_CORRUPT;
    }
    const uint8_t *pub = p + KILN__MANIFEST_DOMAIN_SIZE, *key_id = pub + 32;
    if (kiln__sha256(pub, 32, id) != 0 || memcmp(id, key_id, 32) != 0) {
        snprintf(detail, cap, "manifest's key id is not the SHA-256 of its public key");
        return KILN_ERR_CACHE_CORRUPT;
    }
    uint64_t n = read_le64(key_id + 32);
    if (n > KILN__MANIFEST_MAX_ROWS || size != KILN__MANIFEST_HEADER + n * KILN__MANIFEST_ENTRY) {
        snprintf(detail, cap, "manifest of %zu bytes for %llu rows (at most %u rows, %zu + 96 bytes per row)", size,
                 (unsigned long long)n, KILN__MANIFEST_MAX_ROWS, (size_t)KILN__MANIFEST_HEADER);
        return KILN_ERR_CACHE_CORRUPT;
    }
    const uint8_t *e = p + KILN__MANIFEST_HEADER;
    for (uint64_t i = 1; i < n; i++) {
        if (memcmp(e + (i - 1) * KILN__MANIFEST_ENTRY, e + i * KILN__MANIFEST_ENTRY, KILN_FINGERPRINT_SIZE) >= 0) {
            snprintf(detail, cap, "manifest rows %llu and %llu are not in increasing fingerprint order",
                     (unsigned long long)i - 1, (unsigned long long)i);
            return KILN_ERR_CACHE_CORRUPT;
        }
    }
    if (!signature || signature_size != KILN__SIGNATURE_SIZE) {
        snprintf(detail, cap, "signature of %zu bytes, expected %d", signature_size, KILN__SIGNATURE_SIZE);
        return KILN_ERR_CACHE_CORRUPT;
    }
    if (!ed25519_verify(pub, p, size, signature, signature_size)) {
        char hex[65];
        kiln__hex(key_id, 32, hex);
        snprintf(detail, cap, "the Ed25519 signature does not verify with the manifest's key %s", hex);
        return KILN_ERR_CACHE_CORRUPT;
    }
    kiln__manifest *m = calloc(1, sizeof *m);
    if (!m || !(m->data = malloc(size))) {
        free(m);
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a %zu-byte manifest", size);
    }
    memcpy(m->data, p, size);
    m->size = size;
    memcpy(m->public_key, pub, 32);
    memcpy(m->key_id, key_id, 32);
    m->n = n;
    m->entries = m->data + KILN__MANIFEST_HEADER;
    *out = m;
    return KILN_OK;
}

int kiln__manifest_read(sqlite3 *db, kiln__manifest **out, char *detail, size_t cap)
{
    sqlite3_stmt *q = NULL;
    int64_t tables = 0;
    *out = NULL;
    detail[0] = 0;
    if (sqlite3_prepare_v2(db, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'kiln_signature'",
                           -1, &q, NULL) == SQLITE_OK &&
        sqlite3_step(q) == SQLITE_ROW)
        tables = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    q = NULL;
    if (!tables)
        return 0;
    int result = 0;
    if (sqlite3_prepare_v2(db, "SELECT manifest, signature FROM kiln_signature WHERE id = 1", -1, &q, NULL) !=
        SQLITE_OK) {
        snprintf(detail, cap, "the kiln_signature table cannot be read: %s", sqlite3_errmsg(db));
        result = -1;
    } else {
        int rc = sqlite3_step(q);
        if (rc == SQLITE_ROW) {
            if (sqlite3_column_type(q, 0) != SQLITE_BLOB || sqlite3_column_type(q, 1) != SQLITE_BLOB) {
                snprintf(detail, cap, "the manifest or signature is not a blob");
                result = -1;
            } else {
                kiln_status st = kiln__manifest_parse(sqlite3_column_blob(q, 0), (size_t)sqlite3_column_bytes(q, 0),
                                                      sqlite3_column_blob(q, 1), (size_t)sqlite3_column_bytes(q, 1),
                                                      out, detail, cap);
                if (st == KILN_ERR_HOST_OUT_OF_MEMORY)
                    snprintf(detail, cap, "out of memory reading the manifest");
                result = st ? -1 : 1;
            }
        } else if (rc != SQLITE_DONE) {
            snprintf(detail, cap, "the kiln_signature table cannot be read: %s", sqlite3_errmsg(db));
            result = -1;
        }
    }
    sqlite3_finalize(q);
    return result;
}

static const uint8_t *manifest_find(const kiln__manifest *m, const uint8_t *fp)
{
    uint64_t lo = 0, hi = m->n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        const uint8_t *e = m->entries + mid * KILN__MANIFEST_ENTRY;
        int c = memcmp(fp, e, KILN_FINGERPRINT_SIZE);
        if (!c)
            return e;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

int kiln__manifest_row_ok(const kiln__manifest *m, const uint8_t *fp, const void *checksum, size_t checksum_size,
                          const char *template_id, const char *constants, const char *arch, sqlite3_int64 nvrtc_major,
                          sqlite3_int64 nvrtc_minor, const char *entries, const char *parts, char *detail,
                          size_t cap)
{
    const uint8_t *e = manifest_find(m, fp);
    uint8_t meta[32];
    if (!e) {
        snprintf(detail, cap, "the row is not in the layer's signed manifest");
        return 0;
    }
    if (!checksum || checksum_size != 32 || memcmp(checksum, e + 32, 32) != 0) {
        snprintf(detail, cap, "the row's cubin is not the one the layer's manifest signed (SHA-256 differs)");
        return 0;
    }
    if (meta_digest(template_id, constants, arch, nvrtc_major, nvrtc_minor, entries, parts, meta) != 0 ||
        memcmp(meta, e + 64, 32) != 0) {
        snprintf(detail, cap,
                 "the row's template, constants, arch, NVRTC, entries or parts are not those the manifest signed");
        return 0;
    }
    return 1;
}

/* The raw public key and its id, of a PEM public or (want_private) private key. */
static kiln_status load_key(kiln__errslot *slot, const char *path, int want_private, EVP_PKEY **keep,
                            uint8_t pub[32], uint8_t id[32])
{
    char err[256];
    BIO *bio = BIO_new_file(path, "r");
    if (!bio)
        return kiln__fail(slot, KILN_ERR_INVALID_ARGUMENT, "key %s cannot be read: %s", path,
                          ssl_error(err, sizeof err));
    EVP_PKEY *key = want_private ? PEM_read_bio_PrivateKey(bio, NULL, no_passphrase, NULL)
                                 : PEM_read_bio_PUBKEY(bio, NULL, no_passphrase, NULL);
    BIO_free(bio);
    if (!key)
        return kiln__fail(slot, KILN_ERR_INVALID_ARGUMENT, "key %s: not a PEM %s key without a passphrase: %s", path,
                          want_private ? "private" : "public", ssl_error(err, sizeof err));
    size_t len = 32;
    kiln_status st = KILN_OK;
    if (EVP_PKEY_id(key) != EVP_PKEY_ED25519)
        st = kiln__fail(slot, KILN_ERR_INVALID_ARGUMENT, "key %s: a %s key, kiln signs with Ed25519 only", path,
                        OBJ_nid2sn(EVP_PKEY_id(key)));
    else if (EVP_PKEY_get_raw_public_key(key, pub, &len) != 1 || len != 32 || kiln__sha256(pub, 32, id) != 0)
        st = kiln__fail(slot, KILN_ERR_INVALID_ARGUMENT, "key %s: its public key cannot be read: %s", path,
                        ssl_error(err, sizeof err));
    if (st || !keep)
        EVP_PKEY_free(key);
    else
        *keep = key;
    return st;
}

kiln_status kiln__load_trust(kiln_cache *c, const char *const *paths, size_t n, int ignore_env)
{
    char *env_copy = NULL;
    const char *env_paths[64];
    kiln_status st = KILN_OK;
    if (n && !paths)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_open: %zu trusted keys and no list", n);
    if (!paths && !ignore_env) {
        const char *env = getenv("KILN_TRUSTED_KEYS");
        if (env && *env) {
            if (!(env_copy = kiln__strdup(env)))
                return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
            n = 0;
            for (char *save = NULL, *tok = strtok_r(env_copy, ":", &save); tok; tok = strtok_r(NULL, ":", &save)) {
                if (n == 64) {
                    st = kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "KILN_TRUSTED_KEYS: more than 64 keys");
                    goto out;
                }
                env_paths[n++] = tok;
            }
            paths = env_paths;
        }
    }
    if (!n)
        goto out;
    if (!(c->trusted = calloc(n, sizeof *c->trusted))) {
        st = kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        uint8_t pub[32];
        if (!paths[i]) {
            st = kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_open: trusted key %zu is NULL", i);
            goto out;
        }
        /* A policy that cannot be read must not quietly become no policy. */
        if ((st = load_key(NULL, paths[i], 0, NULL, pub, c->trusted[i])))
            goto out;
        c->n_trusted++;
    }
out:
    free(env_copy);
    return st;
}

static int is_trusted(const kiln_cache *c, const uint8_t id[32])
{
    for (size_t i = 0; i < c->n_trusted; i++)
        if (!memcmp(c->trusted[i], id, 32))
            return 1;
    return 0;
}

int kiln__layer_trusted(kiln_cache *c, kiln__db *d, char *reason, size_t cap)
{
    char detail[512], hex[65];
    kiln__manifest *m = NULL;
    int r = kiln__manifest_read(d->db, &m, detail, sizeof detail);
    if (r == 0) {
        snprintf(reason, cap,
                 "unsigned, and a trust policy is set (KILN_TRUSTED_KEYS or kiln_cache_options.trusted_keys)");
        return 0;
    }
    if (r < 0) {
        snprintf(reason, cap, "signature invalid: %s", detail);
        return 0;
    }
    if (!is_trusted(c, m->key_id)) {
        kiln__hex(m->key_id, 32, hex);
        snprintf(reason, cap, "signed by key %s, which the trust policy does not list", hex);
        kiln__manifest_free(m);
        return 0;
    }
    d->manifest = m;
    return 1;
}

/* Appends n bytes to a growing buffer; -1 when out of memory. */
static int append(uint8_t **buf, size_t *len, size_t *cap, const void *p, size_t n)
{
    if (*len + n > *cap) {
        size_t want = *cap ? *cap : 4096;
        while (want < *len + n)
            want *= 2;
        uint8_t *b = realloc(*buf, want);
        if (!b)
            return -1;
        *buf = b;
        *cap = want;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    return 0;
}

static const char *text_col(sqlite3_stmt *q, int i)
{
    return sqlite3_column_type(q, i) == SQLITE_TEXT ? (const char *)sqlite3_column_text(q, i) : "";
}

/* Builds the manifest of every row of d, each decoded and verified first. */
static kiln_status build_manifest_locked(kiln_cache *c, kiln__db *d, const uint8_t pub[32], const uint8_t id[32],
                                         uint8_t **out, size_t *out_len)
{
    uint8_t *buf = NULL, count[8] = {0};
    size_t len = 0, cap = 0;
    uint64_t n = 0;
    sqlite3_stmt *q = NULL;
    kiln_status st = KILN_OK;
    int rc = sqlite3_prepare_v2(d->db,
                                d->schema >= 2 ? "SELECT fingerprint, cubin, raw_size, checksum, template_id,"
                                                 " constants, arch, nvrtc_major, nvrtc_minor, entries, parts"
                                                 " FROM kernels ORDER BY fingerprint"
                                               : "SELECT fingerprint, cubin, raw_size, checksum, template_id,"
                                                 " constants, arch, nvrtc_major, nvrtc_minor, entries, ''"
                                                 " FROM kernels ORDER BY fingerprint",
                                -1, &q, NULL);
    if (rc != SQLITE_OK)
        return kiln__db_fail(c, d, rc, "listing the rows to sign");
    if (append(&buf, &len, &cap, KILN__MANIFEST_DOMAIN, KILN__MANIFEST_DOMAIN_SIZE) ||
        append(&buf, &len, &cap, pub, 32) || append(&buf, &len, &cap, id, 32) || append(&buf, &len, &cap, count, 8))
        goto out_oom;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        char detail[512], hex[65];
        void *raw = NULL;
        uint8_t meta[32];
        const void *fp = sqlite3_column_blob(q, 0);
        int fp_len = sqlite3_column_bytes(q, 0);
        if (!fp || fp_len != KILN_FINGERPRINT_SIZE) {
            st = kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT, "cache %s: a row's fingerprint is %d bytes, not 32; "
                            "nothing was signed", d->path, fp_len);
            goto out;
        }
        kiln_fingerprint_hex(fp, hex);
        kiln_status dst = kiln__row_decode(sqlite3_column_blob(q, 1), (size_t)sqlite3_column_bytes(q, 1),
                                           sqlite3_column_int64(q, 2), sqlite3_column_type(q, 2) == SQLITE_INTEGER,
                                           sqlite3_column_blob(q, 3), (size_t)sqlite3_column_bytes(q, 3), &raw, detail,
                                           sizeof detail);
        free(raw);
        if (dst == KILN_ERR_CACHE_CORRUPT) {
            st = kiln__fail(&c->err, KILN_ERR_CACHE_CORRUPT,
                            "cache %s: entry %s fails verification (%s); nothing was signed (run `kiln verify`)",
                            d->path, hex, detail);
            goto out;
        }
        if (dst) {
            st = kiln__propagate(&c->err, dst);
            goto out;
        }
        if (meta_digest(text_col(q, 4), text_col(q, 5), text_col(q, 6), sqlite3_column_int64(q, 7),
                        sqlite3_column_int64(q, 8), text_col(q, 9), text_col(q, 10), meta) != 0)
            goto out_oom;
        if (append(&buf, &len, &cap, fp, 32) || append(&buf, &len, &cap, sqlite3_column_blob(q, 3), 32) ||
            append(&buf, &len, &cap, meta, 32))
            goto out_oom;
        if (++n > KILN__MANIFEST_MAX_ROWS) {
            st = kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "cache %s: more than %u rows to sign", d->path,
                            KILN__MANIFEST_MAX_ROWS);
            goto out;
        }
    }
    if (rc != SQLITE_DONE) {
        st = kiln__db_fail(c, d, rc, "listing the rows to sign");
        goto out;
    }
    for (int i = 0; i < 8; i++)
        buf[KILN__MANIFEST_HEADER - 8 + i] = (uint8_t)(n >> (8 * i));
    *out = buf;
    *out_len = len;
    buf = NULL;
    goto out;
out_oom:
    st = kiln__fail(&c->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory building the manifest");
out:
    sqlite3_finalize(q);
    free(buf);
    return st;
}

static kiln_status exec_locked(kiln_cache *c, kiln__db *d, const char *sql, const char *what)
{
    int rc = sqlite3_exec(d->db, sql, NULL, NULL, NULL);
    return rc == SQLITE_OK ? KILN_OK : kiln__db_fail(c, d, rc, what);
}

kiln_status kiln_cache_sign(kiln_cache *c, const char *key_path, uint8_t key_id[KILN_KEY_ID_SIZE])
{
    if (!c || !key_path)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_sign: NULL argument");
    kiln__db *d = &c->main;
    if (d->read_only)
        return kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "cache %s is read-only: it cannot be signed", d->path);
    uint8_t pub[32], id[32], sig[KILN__SIGNATURE_SIZE];
    EVP_PKEY *key = NULL;
    kiln_status st = load_key(&c->err, key_path, 1, &key, pub, id);
    if (st)
        return st;
    if ((st = kiln_cache_flush(c))) {
        EVP_PKEY_free(key);
        return st;
    }
    uint8_t *manifest = NULL;
    size_t len = 0;
    pthread_mutex_lock(&c->lock);
    /* One write transaction: the rows signed are the rows there when it commits. */
    if ((st = exec_locked(c, d, "BEGIN IMMEDIATE", "signing")))
        goto out_unlock;
    if ((st = build_manifest_locked(c, d, pub, id, &manifest, &len)))
        goto out_rollback;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    size_t sig_len = sizeof sig;
    int signed_ok = ctx && EVP_DigestSignInit(ctx, NULL, NULL, NULL, key) == 1 &&
                    EVP_DigestSign(ctx, sig, &sig_len, manifest, len) == 1 && sig_len == sizeof sig;
    EVP_MD_CTX_free(ctx);
    if (!signed_ok) {
        char err[256];
        st = kiln__fail(&c->err, KILN_ERR_INVALID_ARGUMENT, "signing with %s failed: %s", key_path,
                        ssl_error(err, sizeof err));
        goto out_rollback;
    }
    if ((st = exec_locked(c, d, signature_table_sql, "creating the signature table")))
        goto out_rollback;
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(
        d->db, "INSERT OR REPLACE INTO kiln_signature (id, manifest, signature) VALUES (1, ?1, ?2)", -1, &q, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_bind_blob(q, 1, manifest, (int)len, SQLITE_STATIC);
        sqlite3_bind_blob(q, 2, sig, (int)sizeof sig, SQLITE_STATIC);
        rc = sqlite3_step(q);
        rc = rc == SQLITE_DONE ? SQLITE_OK : rc;
    }
    sqlite3_finalize(q);
    if (rc != SQLITE_OK) {
        st = kiln__db_fail(c, d, rc, "storing the signature");
        goto out_rollback;
    }
    if ((st = exec_locked(c, d, "COMMIT", "signing")))
        goto out_rollback;
    if (key_id)
        memcpy(key_id, id, 32);
    goto out_unlock;
out_rollback:
    sqlite3_exec(d->db, "ROLLBACK", NULL, NULL, NULL);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    free(manifest);
    EVP_PKEY_free(key);
    return st;
}

kiln_status kiln_cache_check_signature(kiln_cache *c,
                                       void (*on_bad)(void *user, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                                                      const char *detail),
                                       void *user, kiln_cache_signature_report *out)
{
    if (!c || !out)
        return kiln__fail(c ? &c->err : NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_cache_check_signature: NULL argument");
    memset(out, 0, sizeof *out);
    out->trusted = -1;
    kiln__db *d = &c->main;
    kiln__manifest *m = NULL;
    sqlite3_stmt *q = NULL;
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&c->lock);
    int r = kiln__manifest_read(d->db, &m, out->detail, sizeof out->detail);
    if (r < 0)
        out->state = KILN_CACHE_SIGNATURE_INVALID;
    if (r == 1) {
        memcpy(out->key_id, m->key_id, 32);
        out->signed_rows = m->n;
        if (c->n_trusted)
            out->trusted = is_trusted(c, m->key_id);
    }
    int rc = sqlite3_prepare_v2(d->db,
                                d->schema >= 2 ? "SELECT fingerprint, checksum, template_id, constants, arch,"
                                                 " nvrtc_major, nvrtc_minor, entries, parts FROM kernels"
                                                 " ORDER BY fingerprint"
                                               : "SELECT fingerprint, checksum, template_id, constants, arch,"
                                                 " nvrtc_major, nvrtc_minor, entries, '' FROM kernels"
                                                 " ORDER BY fingerprint",
                                -1, &q, NULL);
    if (rc != SQLITE_OK) {
        st = kiln__db_fail(c, d, rc, "checking the signature");
        goto out;
    }
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        char detail[256];
        out->rows++;
        if (r != 1)
            continue;
        const uint8_t *fp = sqlite3_column_blob(q, 0);
        if (!fp || sqlite3_column_bytes(q, 0) != KILN_FINGERPRINT_SIZE)
            continue; /* the table's CHECK makes this impossible; verify reports it */
        if (kiln__manifest_row_ok(m, fp, sqlite3_column_blob(q, 1), (size_t)sqlite3_column_bytes(q, 1),
                                  text_col(q, 2), text_col(q, 3), text_col(q, 4), sqlite3_column_int64(q, 5),
                                  sqlite3_column_int64(q, 6), text_col(q, 7), text_col(q, 8), detail, sizeof detail))
            continue;
        out->bad_rows++;
        if (on_bad)
            on_bad(user, fp, detail);
    }
    if (rc != SQLITE_DONE) {
        st = kiln__db_fail(c, d, rc, "checking the signature");
        goto out;
    }
    if (r == 1 && out->bad_rows) {
        out->state = KILN_CACHE_SIGNATURE_INVALID;
        snprintf(out->detail, sizeof out->detail, "%llu of %llu rows are not as signed",
                 (unsigned long long)out->bad_rows, (unsigned long long)out->rows);
    } else if (r == 1) {
        out->state = KILN_CACHE_SIGNATURE_VALID;
    }
out:
    sqlite3_finalize(q);
    pthread_mutex_unlock(&c->lock);
    kiln__manifest_free(m);
    return st;
}
