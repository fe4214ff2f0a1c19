/* kiln — helpers shared by every layer: error recording, checked arithmetic,
 * hashing, time. Not API. */
#ifndef KILN_COMMON_INTERNAL_H
#define KILN_COMMON_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kiln/status.h"

#define KILN__ERRSLOT_CAP 4096

/* The detailed message an object owns. Writes are serialized; the text stays
 * readable (never freed) for the object's lifetime. */
typedef struct kiln__errslot {
    pthread_mutex_t lock;
    char msg[KILN__ERRSLOT_CAP];
} kiln__errslot;

void kiln__errslot_init(kiln__errslot *slot);
void kiln__errslot_destroy(kiln__errslot *slot);

/* Records a failure: formats the message into the calling thread's last
 * message and, when slot is not NULL, into slot. Returns st. */
kiln_status kiln__fail(kiln__errslot *slot, kiln_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
kiln_status kiln__vfail(kiln__errslot *slot, kiln_status st, const char *fmt, va_list ap);
/* Copies the calling thread's last message into slot (a failure passed up). */
kiln_status kiln__propagate(kiln__errslot *slot, kiln_status st);
/* Empties the calling thread's last message: a failure that was handled (a
 * graph capture that fell back to eager) must not be taken for a later one's. */
void kiln__errmsg_clear(void);

static inline int kiln__add_overflows(size_t a, size_t b, size_t *r) { return __builtin_add_overflow(a, b, r); }
static inline int kiln__mul_overflows(size_t a, size_t b, size_t *r) { return __builtin_mul_overflow(a, b, r); }

/* SHA-256 of one buffer (OpenSSL libcrypto). 0 on success. */
int kiln__sha256(const void *data, size_t len, uint8_t out[32]);

/* An incremental SHA-256 over length-prefixed parts: each part is hashed as
 * its 8-byte little-endian length, then its bytes, so that no two different
 * part lists can give the same stream. */
typedef struct kiln__hasher kiln__hasher;
kiln__hasher *kiln__hasher_new(void);
void kiln__hasher_part(kiln__hasher *h, const void *data, size_t len);
void kiln__hasher_str(kiln__hasher *h, const char *s);
int kiln__hasher_final(kiln__hasher *h, uint8_t out[32]); /* frees h */
void kiln__hasher_free(kiln__hasher *h);

/* Defined by providers/catalog.c, the operation catalog, and declared here so
 * that the runtime, below the providers, reaches it at link time without
 * including their headers. The implementation digest: SHA-256 over every
 * embedded template file (names and bytes) and every operation's id and
 * provider version, what makes this build's kernels what they are. The
 * capabilities: the KILN_CAP_* that some operation needs (and so provides on
 * a runtime that has them). */
void kiln__implementation_digest(uint8_t out[32]);
uint32_t kiln__catalog_capabilities(void);

/* A caller's options or bindings struct, copied into the library's zeroed
 * local: the smaller of the caller's size (its first field, a uint32_t; 0
 * means the library's own) and the library's, so that a caller built
 * against an older or newer header reads the fields both know and defaults
 * for the rest. src NULL gives all defaults. -1 when the caller's size is
 * nonzero but too small to hold the size field itself. */
static inline int kiln__copy_sized(void *dst, size_t dst_size, const void *src)
{
    unsigned char *d = dst;
    for (size_t i = 0; i < dst_size; i++)
        d[i] = 0;
    if (!src)
        return 0;
    uint32_t caller = *(const uint32_t *)src;
    if (caller && caller < sizeof(uint32_t))
        return -1;
    size_t n = caller && caller < dst_size ? caller : dst_size;
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++)
        d[i] = s[i];
    return 0;
}
#define KILN__COPY_SIZED(local, caller) kiln__copy_sized(&(local), sizeof(local), (caller))

/* A caller's size field (0: the library's own size): one inside the field
 * itself is KILN_ERR_INVALID_ARGUMENT, recorded in slot, naming fn, the
 * struct type and the size. */
kiln_status kiln__check_size_field(kiln__errslot *slot, const char *fn, const char *type, uint32_t size,
                                  size_t library_size);
/* Copies the caller's struct of type into the zeroed local with
 * kiln__copy_sized (a NULL caller leaves the defaults); a size inside the size
 * field itself is KILN_ERR_INVALID_ARGUMENT, recorded in slot, naming fn, the
 * struct and the size. */
kiln_status kiln__read_sized(kiln__errslot *slot, const char *fn, const char *type, void *local, size_t local_size,
                             const void *caller);
#define KILN__READ_SIZED(slot, fn, type, local, caller)                                                             \
    kiln__read_sized((slot), (fn), #type, &(local), sizeof(type), (caller))

/* What a file that is not a regular one is, for messages ("a FIFO", "a
 * directory", ...), from its stat mode. */
const char *kiln__file_kind(mode_t mode);

/* n bytes as 2n lowercase hex digits and a NUL. */
void kiln__hex(const uint8_t *bytes, size_t n, char *out);

/* Monotonic seconds. */
double kiln__now(void);

/* strdup that reports failure instead of aborting; NULL in, NULL out. */
char *kiln__strdup(const char *s);

#endif
