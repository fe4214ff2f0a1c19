#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/internal.h"
#include "kiln/cache.h"

struct kiln__hasher {
    EVP_MD_CTX *ctx;
    int failed;
};

int kiln__sha256(const void *data, size_t len, uint8_t out[32])
{
    unsigned int n = 0;
    return EVP_Digest(data, len, out, &n, EVP_sha256(), NULL) == 1 && n == 32 ? 0 : -1;
}

kiln__hasher *kiln__hasher_new(void)
{
    kiln__hasher *h = calloc(1, sizeof *h);
    if (!h)
        return NULL;
    h->ctx = EVP_MD_CTX_new();
    if (!h->ctx || EVP_DigestInit_ex(h->ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(h->ctx);
        free(h);
        return NULL;
    }
    return h;
}

void kiln__hasher_part(kiln__hasher *h, const void *data, size_t len)
{
    uint8_t prefix[8];
    uint64_t n = len;
    for (int i = 0; i < 8; i++)
        prefix[i] = (uint8_t)(n >> (8 * i));
    if (EVP_DigestUpdate(h->ctx, prefix, sizeof prefix) != 1 || (len && EVP_DigestUpdate(h->ctx, data, len) != 1))
        h->failed = 1;
}

void kiln__hasher_str(kiln__hasher *h, const char *s) { kiln__hasher_part(h, s, s ? strlen(s) : 0); }

int kiln__hasher_final(kiln__hasher *h, uint8_t out[32])
{
    unsigned int n = 0;
    int rc = (!h->failed && EVP_DigestFinal_ex(h->ctx, out, &n) == 1 && n == 32) ? 0 : -1;
    kiln__hasher_free(h);
    return rc;
}

void kiln__hasher_free(kiln__hasher *h)
{
    if (!h)
        return;
    EVP_MD_CTX_free(h->ctx);
    free(h);
}

double kiln__now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void kiln__hex(const uint8_t *bytes, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
    out[2 * n] = 0;
}

void kiln_fingerprint_hex(const uint8_t fp[32], char out[65]) { kiln__hex(fp, 32, out); }

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

kiln_status kiln_fingerprint_parse(const char *hex, uint8_t out[32])
{
    if (!hex || strlen(hex) != 64)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "a fingerprint is 64 hex digits, got \"%s\"",
                          hex ? hex : "(null)");
    for (int i = 0; i < 32; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "fingerprint \"%s\": not a hex digit at %d", hex,
                              hi < 0 ? 2 * i : 2 * i + 1);
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return KILN_OK;
}
