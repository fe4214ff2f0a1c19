/* kiln cache internals, shared by the files of cache/ alone (other layers
 * include cache/cache.h). Not API. */
#ifndef KILN_CACHE_INTERNAL_H
#define KILN_CACHE_INTERNAL_H

#include <pthread.h>
#include <sqlite3.h>
#include <sys/stat.h>

#include "cache/cache.h"
#include "common/internal.h"

/* PRAGMA application_id: "KILN" in ASCII. */
#define KILN_APPLICATION_ID 0x4b494c4e
/* No cubin kiln makes comes near this; a larger raw_size is a corrupt row. */
#define KILN_CACHE_MAX_CUBIN (256u << 20)
#define KILN__PENDING_HITS_MAX 256
#define KILN_CACHE_ZSTD_LEVEL 9

/* A parsed, verified manifest (cache/sign.c): what a signature covers. */
typedef struct kiln__manifest {
    uint8_t public_key[32], key_id[32];
    uint64_t n;              /* entries */
    const uint8_t *entries;  /* n x KILN__MANIFEST_ENTRY bytes, strictly increasing fingerprints, in data */
    uint8_t *data;           /* a copy of the manifest */
    size_t size;
} kiln__manifest;

/* The domain separation string that opens every manifest, its NUL included. */
#define KILN__MANIFEST_DOMAIN "kiln-signed-layer-1"
#define KILN__MANIFEST_DOMAIN_SIZE sizeof(KILN__MANIFEST_DOMAIN)
/* domain, public key, key id, entry count (8 bytes, little-endian) */
#define KILN__MANIFEST_HEADER (KILN__MANIFEST_DOMAIN_SIZE + 32 + 32 + 8)
/* fingerprint, SHA-256 of the cubin, SHA-256 of the row's other loaded columns */
#define KILN__MANIFEST_ENTRY 96
/* A bound on a manifest's rows (a shipped database holds thousands). */
#define KILN__MANIFEST_MAX_ROWS (1u << 22)
#define KILN__SIGNATURE_SIZE 64

/* One SQLite database: the writable one, or a shipped read-only layer. */
typedef struct kiln__db {
    sqlite3 *db;
    char *path;
    int read_only;  /* opened without writing */
    int immutable;  /* opened with immutable=1: a file nobody may write */
    int schema;     /* its user_version */
    kiln__manifest *manifest; /* under a trust policy, a layer's verified manifest; else NULL */
    sqlite3_stmt *st_get, *st_contains, *st_put, *st_delete, *st_hit;
} kiln__db;

typedef struct kiln__pending_hit {
    uint8_t fp[KILN_FINGERPRINT_SIZE];
    uint64_t count;
    int64_t last_used;
} kiln__pending_hit;

typedef struct kiln__remote kiln__remote; /* cache/remote.c */

struct kiln_cache {
    kiln__db main;                  /* the writable database (read-only when the cache is) */
    kiln__db *layers;               /* shipped read-only databases, searched first, in order */
    size_t n_layers;
    kiln_cache_layer_info *layer_info; /* one per layer asked for, skipped ones included */
    size_t n_layer_info;
    pthread_mutex_t lock;           /* guards the statements, counters and pending hits */
    kiln_cache_counters counters;
    kiln__pending_hit pending[KILN__PENDING_HITS_MAX];
    size_t n_pending;
    void (*on_event)(void *user, const kiln_cache_event *event);
    void *user;
    uint8_t (*trusted)[32];         /* the trust policy's key ids; n_trusted 0: no policy */
    size_t n_trusted;
    double open_deadline;           /* kiln__now() past which the open stops waiting for locks */
    kiln__remote *remote;           /* the remote layer; NULL when none is configured */
    kiln__errslot err;
};

/* Decodes and verifies one row's stored cubin: raw_size an integer in (0,
 * KILN_CACHE_MAX_CUBIN], a 32-byte checksum, a zstd frame that declares and
 * yields raw_size bytes whose SHA-256 is the checksum. KILN_OK with *raw
 * (malloc'd, raw_size bytes); KILN_ERR_CACHE_CORRUPT with detail saying what
 * failed; KILN_ERR_HOST_OUT_OF_MEMORY. */
kiln_status kiln__row_decode(const void *blob, size_t blob_size, sqlite3_int64 raw_size, int raw_size_is_integer,
                             const void *checksum, size_t checksum_size, void **raw, char *detail, size_t cap);

/* What a load reads of a row besides its cubin: SQLite's columns, or a
 * remote value's fields. A text that is NULL was not text in the row. */
typedef struct kiln__row_meta {
    const char *template_id, *constants, *arch, *parts;
    int nvrtc_is_integer;
    int64_t nvrtc_major, nvrtc_minor;
} kiln__row_meta;

/* Whether the row is the kernel x describes (template_id, constants, arch,
 * NVRTC version, and each part both have): a checksum covers a cubin, not
 * the key it is filed under. When not, detail names the first field that
 * differs, with both values. */
int kiln__row_is(const kiln__row_meta *row, const kiln_cache_record *x, char *detail, size_t cap);

/* Whether a row's parts (when it has them) say what its other fields say:
 * template, constants, arch and NVRTC (cache/maintenance.c, for verify). When
 * not, detail names the first that differs. */
int kiln__row_parts_agree(const kiln__row_meta *row, char *detail, size_t cap);

/* The value of part name ("template", "arch", "nvrtc", "constants", ...) in
 * a row's parts text: 1 with *value and *len (constants runs to the end, its
 * own ';' included), 0 when the text has no such part. */
int kiln__parts_field(const char *parts, const char *name, const char **value, size_t *len);

/* KILN_OK when path (a link followed) is a regular file, its stat in *sb;
 * else KILN_ERR_CACHE_IO naming what it is. Never opens it (a FIFO would block). */
kiln_status kiln__check_regular_file(kiln_cache *c, const char *path, struct stat *sb);

/* The folder of path ("." when it has none), in buf. */
void kiln__parent_of(const char *path, char *buf, size_t cap);

/* Leaves WAL mode for the rollback journal (on a full disk the WAL cannot
 * grow, and a rollback journal of a few pages fits): SQLITE_OK when the
 * database is in journal_mode=DELETE afterwards, else the failure. */
int kiln__rollback_journal(sqlite3 *db);

/* Fails with rc's status and a message naming d's file, what was being done
 * and SQLite's text; for a damaged file (SQLITE_CORRUPT) also the remedy. */
kiln_status kiln__db_fail(kiln_cache *c, kiln__db *d, int rc, const char *what);

/* Maps an SQLite result code to a status. */
kiln_status kiln__sqlite_status(int rc);

/* Parses a manifest and checks its signature with the public key it names:
 * the domain string, the key id being SHA-256 of the key, the size being
 * that of its entry count, the fingerprints strictly increasing, and the
 * Ed25519 signature of the whole manifest. KILN_OK with *out (freed with
 * kiln__manifest_free); KILN_ERR_CACHE_CORRUPT with detail saying what
 * failed; KILN_ERR_HOST_OUT_OF_MEMORY. */
kiln_status kiln__manifest_parse(const void *manifest, size_t size, const void *signature, size_t signature_size,
                                 kiln__manifest **out, char *detail, size_t cap);
void kiln__manifest_free(kiln__manifest *m);

/* Reads d's signature: 0 unsigned, 1 with *out parsed and verified, -1 a
 * signature that is unreadable or invalid (detail says why). */
int kiln__manifest_read(sqlite3 *db, kiln__manifest **out, char *detail, size_t cap);

/* Whether the row is the one the manifest signed: its fingerprint listed,
 * its checksum column (already checked against its cubin) and the digest of
 * its other loaded columns those listed. When not, detail says why. */
int kiln__manifest_row_ok(const kiln__manifest *m, const uint8_t *fp, const void *checksum, size_t checksum_size,
                          const char *template_id, const char *constants, const char *arch, sqlite3_int64 nvrtc_major,
                          sqlite3_int64 nvrtc_minor, const char *entries, const char *parts, char *detail,
                          size_t cap);

/* Loads the trust policy (key paths, or $KILN_TRUSTED_KEYS) into c->trusted. */
kiln_status kiln__load_trust(kiln_cache *c, const char *const *paths, size_t n, int ignore_env);

/* Under a trust policy, admits layer d (1) or says why not in reason (0). */
int kiln__layer_trusted(kiln_cache *c, kiln__db *d, char *reason, size_t cap);

/* ---- the remote layer (cache/remote.c) ---- */

/* The Redis URL, parsed: redis://HOST[:PORT][/PREFIX]. */
#define KILN__REMOTE_PREFIX_MAX 64
typedef struct kiln__remote_url {
    char host[256];
    int port;
    char prefix[KILN__REMOTE_PREFIX_MAX + 1];
} kiln__remote_url;

/* KILN_OK with *out; KILN_ERR_INVALID_ARGUMENT with detail naming what is
 * wrong (never reads past the NUL, never writes past cap). */
kiln_status kiln__remote_url_parse(const char *url, kiln__remote_url *out, char *detail, size_t cap);

/* The magic that opens every remote value, its NUL included. */
#define KILN__REMOTE_MAGIC "kiln-remote-row-1"
#define KILN__REMOTE_MAGIC_SIZE sizeof(KILN__REMOTE_MAGIC)
/* A bound on each text field of a remote value. */
#define KILN__REMOTE_TEXT_MAX 65536u

/* A remote value, parsed: checksum, blob and the NUL-terminated texts are
 * copies in store (the row outlives the value it was parsed from). */
typedef struct kiln__remote_row {
    uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
    int64_t nvrtc_major, nvrtc_minor, raw_size;
    const uint8_t *checksum; /* 32 bytes */
    const char *template_id, *constants, *arch, *entries, *parts;
    const uint8_t *blob;
    size_t blob_size;
    char *store;
} kiln__remote_row;

/* Parses a value (layout in docs/cache.md, "The remote tier"): KILN_OK with
 * *out (free with kiln__remote_row_free); KILN_ERR_CACHE_CORRUPT with detail
 * saying what is wrong; KILN_ERR_HOST_OUT_OF_MEMORY. The cubin is not
 * decoded here: kiln__row_decode does that, as for an SQLite row. */
kiln_status kiln__remote_value_parse(const void *value, size_t size, kiln__remote_row *out, char *detail, size_t cap);
void kiln__remote_row_free(kiln__remote_row *row);

/* What a key under the prefix is: PREFIX:row:FP or PREFIX:lease:FP (64
 * lowercase hex digits, as kiln writes them; fp set), or anything else. */
enum { KILN__REMOTE_KEY_OTHER = 0, KILN__REMOTE_KEY_ROW = 1, KILN__REMOTE_KEY_LEASE = 2 };
int kiln__remote_key_kind(const char *prefix, const char *key, size_t len, uint8_t fp[KILN_FINGERPRINT_SIZE]);

/* The value of record r (its cubin unused) whose raw cubin of raw_size
 * bytes is the zstd frame z of zn bytes with SHA-256 sum: *out malloc'd. */
kiln_status kiln__remote_value_encode(const kiln_cache_record *r, uint64_t raw_size, const void *z, size_t zn,
                                      const uint8_t sum[32], uint8_t **out, size_t *size);

/* Opens the remote layer of opts (or $KILN_CACHE_REMOTE) into c->remote;
 * KILN_ERR_INVALID_ARGUMENT for a URL that does not parse. An unreachable
 * server is no error: the layer is skipped with the reason until it answers. */
kiln_status kiln__remote_open(kiln_cache *c, const kiln_cache_options *opts);
void kiln__remote_close(kiln__remote *r);

/* Looks fp up: 1 with *row and *raw (the verified cubin, malloc'd) on a hit;
 * 0 on a miss, a refused value (counted, and reported to on_event) or a
 * server that failed (the layer skipped for a while). Call without c->lock. */
int kiln__remote_fetch(kiln_cache *c, const uint8_t *fp, const kiln_cache_record *expect, kiln__remote_row *row,
                       void **raw, size_t *raw_size);

/* Publishes a row just stored locally. Call without c->lock. */
void kiln__remote_publish(kiln_cache *c, const kiln_cache_record *r, const void *z, size_t zn,
                          const uint8_t sum[32]);

/* Takes fp's lease: 1 taken, 0 held by another process, -1 the layer is
 * skipped (no server, or it failed). */
int kiln__remote_lease(kiln_cache *c, const uint8_t *fp);
/* Gives back a lease this cache took (another's is left alone). */
void kiln__remote_release(kiln_cache *c, const uint8_t *fp);
/* The lease's length in milliseconds. */
int kiln__remote_lease_ms(const kiln_cache *c);
/* The layer's kiln_cache_layer answer, as of now. */
void kiln__remote_info(kiln_cache *c, kiln_cache_layer_info *out);

/* Stores a row whose zstd frame z (raw_size bytes once decoded, SHA-256 sum)
 * is already made, in the writable database, under c->lock. */
kiln_status kiln__store_locked(kiln_cache *c, const kiln_cache_record *r, const void *z, size_t zn,
                               const uint8_t sum[32]);

/* ---- schema 3: tuning rows and coverage records (cache/tuning.c) ---- */

/* The tables schema 3 adds (CREATE TABLE IF NOT EXISTS: also the migration). */
extern const char kiln__schema3_sql[];

/* A tuning row's id (SHA-256 of kind and key) and checksum (over id, kind,
 * key and payload). 0 on success. */
int kiln__tuning_id(const char *kind, const char *key, uint8_t out[32]);
int kiln__tuning_checksum(const uint8_t id[32], const char *kind, const char *key, const void *payload, size_t size,
                          uint8_t out[32]);
/* Whether a stored tuning row is whole: id 32 bytes and that of kind and
 * key, kind and key text of bounded length (len what the column holds, a NUL
 * inside fails), a payload of 1 to KILN_TUNING_PAYLOAD_MAX bytes, the
 * checksum. 1, or 0 with detail saying what failed. */
int kiln__tuning_row_check(const void *id, size_t id_size, const char *kind, size_t kind_len, const char *key,
                           size_t key_len, const void *payload, size_t payload_size, const void *checksum,
                           size_t checksum_size, char *detail, size_t cap);
/* Whether needs (len bytes as stored, no NUL among them) is lines of "<64 hex>\t<template>\t
 * <constants>\t<parts>\n": 1 with *n_lines, or 0 with detail. */
int kiln__coverage_needs_check(const char *needs, size_t len, size_t *n_lines, char *detail, size_t cap);
/* Whether a stored coverage row is whole: fields, id, checksum. */
int kiln__coverage_row_check(const void *id, size_t id_size, const kiln_coverage_record *r, const void *checksum,
                             size_t checksum_size, size_t *n_lines, char *detail, size_t cap);
/* kiln_cache_verify's and kiln_cache_merge's part for the schema 3 tables,
 * with the lock held and inside their transaction: SQLITE_DONE or the failure. */
int kiln__verify_schema3_locked(kiln_cache *c,
                                void (*on_bad)(void *user, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                                               const char *detail),
                                void *user, kiln_cache_verify_report *out);
int kiln__merge_schema3_locked(kiln_cache *c, sqlite3 *src, uint64_t *copied, uint64_t *skipped);

#endif
