/* Fuzz target: what the remote layer reads from outside, the Redis URL (an
 * environment variable) and the values a Redis server hands back.
 *
 * Input layout: byte 0 selects what the rest is.
 *   0  a URL (cut at its first NUL) for kiln__remote_url_parse. Accepted: the
 *      host is 1..255 of [A-Za-z0-9._-] (or hex digits, ':' and '.' in []),
 *      the port in [1, 65535], the prefix 1..64 of [A-Za-z0-9._:-]; the URL
 *      written back from them parses to the same. Refused: a bounded,
 *      nonempty message.
 *   1  a value as Redis returns it, for kiln__remote_value_parse. Accepted:
 *      its layout is judged here independently (docs/cache.md, "The remote
 *      tier") and agrees, and writing the fields back gives the same bytes;
 *      then kiln__row_decode, whose hit must be raw_size bytes whose
 *      SHA-256 (OpenSSL EVP) is the checksum.
 *   2  bytes 1..4 an edit (uint32, little-endian: position, then xor), the
 *      rest a cubin: kiln's own value of it (valid by construction, so that
 *      mutations reach past the header) with one byte changed unless the
 *      xor is 0; the unchanged value must parse and decode to the cubin.
 *   3  a key as SCAN returns it (NUL bytes included), for
 *      kiln__remote_key_kind under the prefix "kiln", and under the prefix
 *      of byte 1 % 16 bytes after it (the rest the key): a row or a lease
 *      exactly when the key is the one kiln writes for the fingerprint it
 *      reads (the prefix, ":row:" or ":lease:", 64 lowercase hex digits).
 */
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#include "cache/internal.h"
#include "fuzz_common.h"

static struct {
    unsigned long long urls, urls_ok, values, values_ok, decoded, built, built_ok, keys, keys_kiln;
} g_stats;

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

static int allowed(const char *s, const char *extra)
{
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || strchr(extra, *s)))
            return 0;
    return 1;
}

static void fuzz_url(const uint8_t *data, size_t size)
{
    char *url = malloc(size + 1), detail[512];
    FUZZ_CHECK(url != NULL, "out of memory");
    memcpy(url, data, size);
    url[size] = 0;
    g_stats.urls++;
    kiln__remote_url u;
    memset(detail, 0, sizeof detail);
    kiln_status st = kiln__remote_url_parse(url, &u, detail, sizeof detail);
    if (st) {
        FUZZ_CHECK(st == KILN_ERR_INVALID_ARGUMENT, "status %d", (int)st);
        FUZZ_CHECK(detail[0] && strlen(detail) < sizeof detail, "refusal without a bounded message");
        free(url);
        return;
    }
    g_stats.urls_ok++;
    size_t hl = strlen(u.host), pl = strlen(u.prefix);
    int v6 = strchr(u.host, ':') != NULL;
    FUZZ_CHECK(hl >= 1 && hl < sizeof u.host, "host of %zu bytes", hl);
    FUZZ_CHECK(v6 ? allowed(u.host, ":.") : allowed(u.host, "._-"), "host \"%s\"", u.host);
    FUZZ_CHECK(u.port >= 1 && u.port <= 65535, "port %d", u.port);
    FUZZ_CHECK(pl >= 1 && pl <= KILN__REMOTE_PREFIX_MAX && allowed(u.prefix, "._:-"), "prefix \"%s\"", u.prefix);
    FUZZ_CHECK(!strncmp(url, "redis://", 8), "accepted without the scheme");
    char again[512];
    snprintf(again, sizeof again, "redis://%s%s%s:%d/%s", v6 ? "[" : "", u.host, v6 ? "]" : "", u.port, u.prefix);
    kiln__remote_url w;
    st = kiln__remote_url_parse(again, &w, detail, sizeof detail);
    FUZZ_CHECK(st == KILN_OK, "%s written back does not parse: %s", again, detail);
    FUZZ_CHECK(!strcmp(u.host, w.host) && u.port == w.port && !strcmp(u.prefix, w.prefix), "%s parses otherwise",
               again);
    free(url);
}

/* The layout, judged here: 1 when v is a well-formed value. */
static int judge_value(const uint8_t *v, size_t n)
{
    size_t fixed = KILN__REMOTE_MAGIC_SIZE + KILN_FINGERPRINT_SIZE + 16 + 32, off = fixed;
    if (n < fixed || memcmp(v, KILN__REMOTE_MAGIC, KILN__REMOTE_MAGIC_SIZE))
        return 0;
    for (int i = 0; i < 5; i++) {
        if (n - off < 4)
            return 0;
        uint64_t len = le(v + off, 4);
        off += 4;
        if (len > KILN__REMOTE_TEXT_MAX || len > n - off || memchr(v + off, 0, (size_t)len))
            return 0;
        off += (size_t)len;
    }
    if (n - off < 4)
        return 0;
    return le(v + off, 4) == n - off - 4;
}

static void check_value(const uint8_t *v, size_t n, const uint8_t *cubin, size_t cubin_size)
{
    kiln__remote_row row;
    char detail[512];
    memset(detail, 0, sizeof detail);
    g_stats.values++;
    kiln_status st = kiln__remote_value_parse(v, n, &row, detail, sizeof detail);
    if (st == KILN_ERR_HOST_OUT_OF_MEMORY)
        return;
    int ok = judge_value(v, n);
    FUZZ_CHECK(ok == (st == KILN_OK), "kiln %s a value the layout %s: %s", st ? "refused" : "accepted",
               ok ? "allows" : "refuses", st ? detail : "");
    if (st) {
        FUZZ_CHECK(st == KILN_ERR_CACHE_CORRUPT && detail[0], "refusal %d without a message", (int)st);
        FUZZ_CHECK(!cubin, "kiln's own value was refused: %s", detail);
        return;
    }
    g_stats.values_ok++;
    /* Canonical: the fields written back are the bytes read (raw_size past INT64_MAX reads as -1). */
    if (row.raw_size >= 0) {
        kiln_cache_record r = {.template_id = row.template_id,
                               .constants = row.constants,
                               .arch = row.arch,
                               .entries = row.entries,
                               .parts = row.parts,
                               .nvrtc_major = (int)row.nvrtc_major,
                               .nvrtc_minor = (int)row.nvrtc_minor};
        memcpy(r.fingerprint, row.fingerprint, KILN_FINGERPRINT_SIZE);
        uint8_t *again = NULL;
        size_t again_n = 0;
        st = kiln__remote_value_encode(&r, (uint64_t)row.raw_size, row.blob, row.blob_size, row.checksum, &again,
                                       &again_n);
        FUZZ_CHECK(st == KILN_OK, "encode: %s", kiln_errmsg());
        FUZZ_CHECK(again_n == n && !memcmp(again, v, n), "written back: %zu bytes unlike the %zu read", again_n, n);
        free(again);
    }
    void *raw = NULL;
    st = kiln__row_decode(row.blob, row.blob_size, row.raw_size, 1, row.checksum, 32, &raw, detail, sizeof detail);
    if (st == KILN_OK) {
        g_stats.decoded++;
        uint8_t sum[32];
        sha256(raw, (size_t)row.raw_size, sum);
        FUZZ_CHECK(!memcmp(sum, row.checksum, 32), "a decoded cubin whose SHA-256 is not the checksum");
        if (cubin)
            FUZZ_CHECK((size_t)row.raw_size == cubin_size && !memcmp(raw, cubin, cubin_size),
                       "kiln's own value decodes to other bytes");
        free(raw);
    } else {
        FUZZ_CHECK(st == KILN_ERR_CACHE_CORRUPT || st == KILN_ERR_HOST_OUT_OF_MEMORY, "decode status %d", (int)st);
        FUZZ_CHECK(!cubin, "kiln's own value does not decode: %s", detail);
    }
    kiln__remote_row_free(&row);
}

static void fuzz_built(const uint8_t *data, size_t size)
{
    uint8_t head[4] = {0};
    memcpy(head, data, size < 4 ? size : 4);
    uint32_t edit = (uint32_t)le(head, 4);
    const uint8_t *cubin = data + (size < 4 ? size : 4);
    size_t n = size < 4 ? 0 : size - 4;
    if (!n)
        return;
    g_stats.built++;
    uint8_t sum[32];
    sha256(cubin, n, sum);
    size_t cap = ZSTD_compressBound(n);
    uint8_t *z = malloc(cap);
    FUZZ_CHECK(z != NULL, "out of memory");
    size_t zn = ZSTD_compress(z, cap, cubin, n, 1);
    FUZZ_CHECK(!ZSTD_isError(zn), "zstd: %s", ZSTD_getErrorName(zn));
    kiln_cache_record r = {.template_id = "fuzz", .constants = "N=1", .arch = "sm_90", .nvrtc_major = 12,
                           .nvrtc_minor = 4, .entries = "k", .parts = "schema=kiln-fingerprint-1"};
    memset(r.fingerprint, 0x5a, sizeof r.fingerprint);
    uint8_t *v = NULL;
    size_t vn = 0;
    FUZZ_CHECK(kiln__remote_value_encode(&r, n, z, zn, sum, &v, &vn) == KILN_OK, "encode: %s", kiln_errmsg());
    uint8_t x = (uint8_t)(edit >> 24);
    if (x) {
        v[(edit & 0xffffff) % vn] ^= x;
        check_value(v, vn, NULL, 0);
    } else {
        g_stats.built_ok++;
        check_value(v, vn, cubin, n);
    }
    free(v);
    free(z);
}

static void check_key(const char *prefix, const uint8_t *key, size_t n)
{
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    memset(fp, 0xa5, sizeof fp);
    int kind = kiln__remote_key_kind(prefix, (const char *)key, n, fp);
    FUZZ_CHECK(kind == KILN__REMOTE_KEY_OTHER || kind == KILN__REMOTE_KEY_ROW || kind == KILN__REMOTE_KEY_LEASE,
               "kind %d", kind);
    if (kind == KILN__REMOTE_KEY_OTHER) {
        /* Judged here: a key of the form is never taken for another. */
        static const char *const kinds[] = {"row", "lease"};
        size_t pl = strlen(prefix);
        for (int k = 0; k < 2; k++) {
            size_t kl = strlen(kinds[k]), i = 0;
            if (n != pl + 1 + kl + 1 + 64 || memcmp(key, prefix, pl) || key[pl] != ':' ||
                memcmp(key + pl + 1, kinds[k], kl) || key[pl + 1 + kl] != ':')
                continue;
            while (i < 64 && key[n - 64 + i] && strchr("0123456789abcdef", key[n - 64 + i]))
                i++;
            FUZZ_CHECK(i < 64, "a %s key of the form taken for another key", kinds[k]);
        }
        return;
    }
    g_stats.keys_kiln++;
    char hex[2 * KILN_FINGERPRINT_SIZE + 1], again[KILN__REMOTE_PREFIX_MAX + 80];
    kiln_fingerprint_hex(fp, hex);
    int len = snprintf(again, sizeof again, "%s:%s:%s", prefix, kind == KILN__REMOTE_KEY_ROW ? "row" : "lease", hex);
    FUZZ_CHECK(len > 0 && (size_t)len == n && !memcmp(again, key, n), "a key kiln does not write taken for %s",
               again);
}

static void fuzz_key(const uint8_t *data, size_t size)
{
    g_stats.keys++;
    check_key("kiln", data, size);
    size_t pl = size ? data[0] % 16 : 0;
    char prefix[16];
    if (!pl || pl + 1 > size)
        return;
    memcpy(prefix, data + 1, pl);
    prefix[pl] = 0;
    if (strlen(prefix) == pl)
        check_key(prefix, data + 1, size - 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!size)
        return 0;
    switch (data[0] % 4) {
    case 0:
        fuzz_url(data + 1, size - 1);
        break;
    case 1:
        check_value(data + 1, size - 1, NULL, 0);
        break;
    case 2:
        fuzz_built(data + 1, size - 1);
        break;
    default:
        fuzz_key(data + 1, size - 1);
        break;
    }
    return 0;
}

void kiln_fuzz_summary(FILE *f)
{
    fprintf(f,
            "fuzz_remote: %llu URLs (%llu accepted), %llu values (%llu parsed, %llu decoded), %llu built by kiln"
            " (%llu unedited), %llu keys (%llu kiln's)\n",
            g_stats.urls, g_stats.urls_ok, g_stats.values, g_stats.values_ok, g_stats.decoded, g_stats.built,
            g_stats.built_ok, g_stats.keys, g_stats.keys_kiln);
}
