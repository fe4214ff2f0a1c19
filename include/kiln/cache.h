/* kiln — the cubin database.
 *
 * One SQLite file holds one row per compiled kernel, keyed by the kernel's
 * fingerprint (32 bytes of SHA-256, see jit.h): the zstd-compressed cubin, its
 * raw size and SHA-256 checksum, the template id, the specialization constants,
 * the architecture, the NVRTC version, the kernel entry names, created and
 * last-used times and a hit count. Every load verifies size and checksum; a
 * row that fails (flipped bytes, a truncated blob, a wrong size, a blob zstd
 * cannot decode, for the jit a row of another kernel) is reported as a miss, dropped from the database and counted
 * (kiln_cache_counters.corrupt_dropped, and the on_event callback).
 *
 * Schema 3 adds tuning rows (choices kiln made by timing, keyed by what decides
 * them) and coverage records (a model, its serving envelope and the kernels
 * they need), each checksummed and verified as kernel rows are.
 *
 * Threading: one kiln_cache may be used from several threads at once (the
 * connection is serialized inside); several processes may share one file
 * (WAL journal, a busy timeout, short write transactions).
 */
#ifndef KILN_CACHE_H
#define KILN_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_FINGERPRINT_SIZE 32
/* The schema this library reads and writes (PRAGMA user_version). */
#define KILN_CACHE_SCHEMA_VERSION 3

typedef struct kiln_cache kiln_cache;

typedef enum kiln_cache_event_kind {
    KILN_CACHE_EVENT_CORRUPT_DROPPED = 1 /* a row failed verification and was dropped */
} kiln_cache_event_kind;

typedef struct kiln_cache_event {
    kiln_cache_event_kind kind;
    uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
    const char *detail; /* what failed, with the values; valid during the callback */
} kiln_cache_event;

/* Zero-initialized means defaults. size tells the library which fields the
 * caller's header had: fields past it take their defaults. */
typedef struct kiln_cache_options {
    uint32_t size;           /* sizeof(kiln_cache_options), or 0 for the library's */
    const char *path;        /* NULL: kiln_cache_default_path() */
    int read_only;           /* open without writing (a shipped database) */
    int busy_timeout_ms;     /* 0: 10000 */
    /* Called (on the thread that found it) for each event; may be NULL. */
    void (*on_event)(void *user, const kiln_cache_event *event);
    void *user;
    /* Shipped read-only databases, searched in this order before path and
     * never written; a hit there is not copied. NULL: the colon-separated
     * list in $KILN_CACHE_READONLY (unless ignore_env). A layer that cannot
     * be opened, or holds no row for arch and NVRTC below, is skipped with a
     * reason (kiln_cache_layer). */
    const char *const *readonly_paths;
    size_t n_readonly_paths;
    /* Read neither $KILN_CACHE_READONLY nor $KILN_CACHE_FOLLOW_SYMLINKS. */
    int ignore_env;
    /* When arch is set: the architecture and NVRTC version this process
     * compiles for, so that layers built for others are skipped. */
    const char *arch;
    int nvrtc_major, nvrtc_minor;
    /* Open only a kiln database that exists: a missing or empty file is
     * refused (KILN_ERR_CACHE_IO, KILN_ERR_CACHE_SCHEMA), never created. */
    int existing_only;
    /* A path (writable, read-only or a layer) whose last component is a
     * symbolic link is refused unless this is set, or $KILN_CACHE_FOLLOW_SYMLINKS
     * is 1 (unless ignore_env); a link to nothing is refused even then (kiln
     * never creates a file through a link). A refused layer is skipped. */
    int follow_symlinks;
    /* A trust policy for the read-only layers: paths of Ed25519 public keys
     * (PEM). With one, a layer is searched only when it carries a valid
     * signature (kiln_cache_sign) by one of these keys, and a row of it only
     * when its digests are those the signature covers; any other layer is
     * skipped with the reason. NULL: the colon-separated list in
     * $KILN_TRUSTED_KEYS (unless ignore_env); none there: no policy, every
     * layer that opens is searched. A key that cannot be read fails the open. */
    const char *const *trusted_keys;
    size_t n_trusted_keys;
    /* A remote layer shared by a fleet (docs/cache.md, "The remote tier"):
     * "redis://HOST[:PORT][/PREFIX]", searched after the local databases and
     * before compiling; every row stored is published there, and a process
     * that misses takes a lease so that one process of the fleet compiles a
     * kernel while the others wait for its row. NULL: $KILN_CACHE_REMOTE
     * (unless ignore_env); "" or none there: no remote layer. A URL that does
     * not parse fails the open (KILN_ERR_INVALID_ARGUMENT, naming it); a
     * server that cannot be reached, is slow or answers garbage never does:
     * the layer is skipped with the reason (kiln_cache_layer), counted
     * (kiln_cache_counters.remote_errors), tried again a second later, and
     * kernels are compiled locally. */
    const char *remote;
    int remote_timeout_ms;   /* connect and each command; 0: 500 */
    int remote_lease_ms;     /* a compile's lease, and how long others wait for its row; 0: 30000 */
    /* Under a trust policy the remote layer is skipped unless this is set,
     * or $KILN_CACHE_REMOTE_TRUSTED is 1 (unless ignore_env): its rows carry
     * no signature, so trusting it is the deployment's explicit choice. */
    int remote_trusted;
} kiln_cache_options;

/* A read-only layer as opened: searched (active) or skipped, and why. The
 * remote layer, when one is configured, is listed last with remote = 1: its
 * path is the URL, active and reason its state at the time of the call
 * (reason valid until the next call into the cache), entries 0. */
typedef struct kiln_cache_layer_info {
    const char *path;   /* valid as long as the cache */
    int active;
    const char *reason; /* why it was skipped; "" when active */
    uint64_t entries;
    int remote;
} kiln_cache_layer_info;

/* One row, as handed to kiln_cache_put (the cache copies every field). */
typedef struct kiln_cache_record {
    uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
    const char *template_id;
    const char *constants;   /* canonical "NAME=value;..." text */
    const char *arch;        /* "sm_90" */
    int nvrtc_major, nvrtc_minor;
    const char *entries;     /* kernel entry names, separated by ',' */
    const char *parts;       /* digests of the fingerprint's parts, for explain; may be NULL */
    const void *cubin;
    size_t cubin_size;
} kiln_cache_record;

/* One row's description, as listed by kiln_cache_foreach. */
typedef struct kiln_cache_entry_info {
    uint8_t fingerprint[KILN_FINGERPRINT_SIZE];
    const char *template_id, *constants, *arch, *entries;
    const char *parts;       /* "" for rows of schema 1 */
    int nvrtc_major, nvrtc_minor;
    uint64_t raw_size, stored_size, hits;
    int64_t created, last_used; /* seconds since the epoch */
} kiln_cache_entry_info;

typedef struct kiln_cache_stats {
    uint64_t entries, raw_bytes, stored_bytes;
    uint64_t tuning_rows, coverage_rows; /* schema 3's tables (0 before) */
} kiln_cache_stats;

/* What this handle has done since it was opened. */
typedef struct kiln_cache_counters {
    uint64_t hits, misses, inserts, corrupt_dropped;
    /* The remote layer: rows found there (also counted in hits), looked up
     * and absent, refused (garbage, or a row that fails verification),
     * published, failures of the server (each skips the layer for a while),
     * leases taken, waits for another process's lease that ended with its row,
     * and waits that ran out (the kernel was compiled here). */
    uint64_t remote_hits, remote_misses, remote_refused, remote_published, remote_errors;
    uint64_t remote_leases, remote_waits_filled, remote_waits_expired;
} kiln_cache_counters;

/* Resolves the default database path into buf: $KILN_CACHE_DIR/kernels.db,
 * else $XDG_CACHE_HOME/kiln/kernels.db, else $HOME/.cache/kiln/kernels.db.
 * KILN_ERR_INVALID_ARGUMENT when buf is too small or no variable is set. */
KILN_API kiln_status kiln_cache_default_path(char *buf, size_t cap);

/* Opens (creating the file and its folder when writable) the database; opts
 * NULL: every default. KILN_ERR_INVALID_ARGUMENT: opts->size nonzero and
 * smaller than the size field, a path too long, read-only paths counted but
 * not given; KILN_ERR_CACHE_IO: the file cannot be opened or created, is not
 * a regular file, is a symbolic link without follow_symlinks, or is missing
 * under existing_only; KILN_ERR_CACHE_BUSY:
 * locked past busy_timeout_ms (one deadline for the whole open);
 * KILN_ERR_CACHE_SCHEMA: the file is not a kiln database of this schema (or
 * is empty under existing_only), and is left byte for byte as it was;
 * KILN_ERR_HOST_OUT_OF_MEMORY. On failure *out is NULL and kiln_errmsg() says why. */
KILN_API kiln_status kiln_cache_open(const kiln_cache_options *opts, kiln_cache **out);
/* Flushes pending hit counts and closes. NULL is a no-op. */
KILN_API void kiln_cache_close(kiln_cache *cache);
KILN_API const char *kiln_cache_path(const kiln_cache *cache);
KILN_API const char *kiln_cache_errmsg(const kiln_cache *cache);

/* Looks a fingerprint up. On a verified hit *found = 1 and *cubin (freed with
 * kiln_free) holds the raw cubin of *size bytes; on a miss or a dropped
 * corrupt row *found = 0. KILN_ERR_CACHE_IO / KILN_ERR_CACHE_BUSY when SQLite
 * fails. Given a fingerprint alone, it verifies the cubin alone; the jit's
 * loads also check that the row is of the kernel the key was computed from
 * (template, constants, arch, NVRTC, parts), so that a key swapped onto
 * another kernel's row is a corrupt row, not that kernel. */
KILN_API kiln_status kiln_cache_get(kiln_cache *cache, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                                    void **cubin, size_t *size, int *found);
/* Whether a row exists for the fingerprint (no verification, no hit counted). */
KILN_API kiln_status kiln_cache_contains(kiln_cache *cache, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                                         int *found);
/* Stores a row in one transaction; an existing row that verifies is kept as
 * it is, a corrupt one replaced. KILN_ERR_INVALID_ARGUMENT (read-only cache,
 * empty cubin, missing text), KILN_ERR_CACHE_IO, KILN_ERR_CACHE_BUSY,
 * KILN_ERR_CACHE_CORRUPT (a corrupt row could not be replaced: the file is damaged). */
KILN_API kiln_status kiln_cache_put(kiln_cache *cache, const kiln_cache_record *record);
/* Calls fn for each row in fingerprint order; fn returning nonzero stops. */
KILN_API kiln_status kiln_cache_foreach(kiln_cache *cache,
                                        int (*fn)(void *user, const kiln_cache_entry_info *info), void *user);
KILN_API kiln_status kiln_cache_get_stats(kiln_cache *cache, kiln_cache_stats *out);
KILN_API void kiln_cache_get_counters(const kiln_cache *cache, kiln_cache_counters *out);
/* Writes the hit counts and last-used times gathered in memory (also done by close). */
KILN_API kiln_status kiln_cache_flush(kiln_cache *cache);

/* The read-only layers asked for (active or skipped), in search order. */
KILN_API size_t kiln_cache_layer_count(const kiln_cache *cache);
KILN_API kiln_status kiln_cache_layer(const kiln_cache *cache, size_t index, kiln_cache_layer_info *out);

/* ---- maintenance (the writable database) ---- */

typedef struct kiln_cache_verify_report {
    uint64_t rows, bad_rows;
    int integrity_ok;        /* SQLite's integrity_check said "ok" */
    uint64_t tuning_rows, bad_tuning_rows;     /* schema 3's tuning table */
    uint64_t coverage_rows, bad_coverage_rows; /* schema 3's coverage table */
} kiln_cache_verify_report;

/* Decodes every row and checks its checksum and that its template_id,
 * (tuning and coverage rows too: their checksums and ids, their payloads'
 * shape; on_bad gets a bad one's id as the fingerprint, detail saying which kind)
 * constants, arch and NVRTC version are those its parts name (when it has
 * parts), and runs SQLite's integrity check; on_bad (may be NULL) is called for each bad row, under the cache's
 * lock (it must not call into the cache). Removes nothing. When
 * integrity_ok is 0, kiln_cache_errmsg holds SQLite's report. */
KILN_API kiln_status kiln_cache_verify(kiln_cache *cache,
                                       void (*on_bad)(void *user, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                                                      const char *detail),
                                       void *user, kiln_cache_verify_report *out);

/* What kiln_cache_verify_remote found in the remote tier. */
typedef enum kiln_cache_remote_state {
    KILN_CACHE_REMOTE_NONE = 0,    /* the cache has no remote tier: nothing read */
    KILN_CACHE_REMOTE_SCANNED = 1, /* every key under the prefix was read and judged */
    KILN_CACHE_REMOTE_SKIPPED = 2, /* the trust policy keeps the tier off (reason): nothing read */
    KILN_CACHE_REMOTE_FAILED = 3   /* the server could not be reached or failed (reason); the counts
                                      are of the keys judged before */
} kiln_cache_remote_state;

/* How many bad rows' reasons the report keeps (on_bad gets every one). */
#define KILN_CACHE_REMOTE_FIRST_BAD 4

/* size tells the library which fields the caller's header had: fields past
 * it are not written. */
typedef struct kiln_cache_remote_verify_report {
    uint32_t size;                 /* sizeof(kiln_cache_remote_verify_report), or 0 for the library's */
    kiln_cache_remote_state state;
    uint64_t rows;                 /* PREFIX:row:FINGERPRINT keys read */
    uint64_t bad_rows;             /* of them, values a fetch would refuse */
    uint64_t leases;               /* PREFIX:lease:FINGERPRINT keys: not rows, never bad */
    uint64_t other_keys;           /* any other key under "PREFIX:": not kiln's, never bad */
    char reason[1024];             /* why SKIPPED or FAILED; "" otherwise */
    /* "KEY: WHY" of the first bad rows, in the order found; "" past bad_rows. */
    char first_bad[KILN_CACHE_REMOTE_FIRST_BAD][512];
} kiln_cache_remote_verify_report;

/* Checks every row of the cache's remote tier as a fetch checks it:
 * iterates the keys under its prefix (SCAN with MATCH and COUNT, never
 * KEYS; a key SCAN returns twice is judged once), GETs each row and parses
 * it, then checks that the fingerprint it holds is its key's, that its
 * template, constants, arch and NVRTC are those its parts name, and that its
 * zstd frame yields raw_size bytes whose SHA-256 is its checksum. A key that
 * holds no string, or a value that fails, is a bad row: on_bad (may be NULL)
 * gets its key and what failed, without the cache's lock held. Lease keys
 * and other keys under the prefix are counted, not judged; a row evicted
 * between SCAN and GET is not counted. Under a trust policy that keeps the
 * tier off (kiln_cache_options.remote_trusted) nothing is read (SKIPPED).
 * Each command is bounded by remote_timeout_ms; a server that cannot be
 * reached, is skipped after a recent failure, or fails during the scan ends
 * it with FAILED and the reason (and is skipped by fetches as after any
 * failure). Changes nothing, neither on the server nor in the databases,
 * and counts nothing in kiln_cache_counters but remote_errors.
 * KILN_OK with *out filled (whatever the state); KILN_ERR_INVALID_ARGUMENT:
 * cache or out NULL, out->size nonzero and smaller than the size field;
 * KILN_ERR_HOST_OUT_OF_MEMORY. */
KILN_API kiln_status kiln_cache_verify_remote(kiln_cache *cache,
                                              void (*on_bad)(void *user, const char *key, const char *detail),
                                              void *user, kiln_cache_remote_verify_report *out);

typedef struct kiln_cache_gc_options {
    uint32_t size;              /* sizeof(kiln_cache_gc_options), or 0; fields past it are 0 */
    uint64_t max_bytes;         /* keep at most this many stored bytes; 0: no limit */
    int64_t older_than_seconds; /* drop rows unused for longer; 0: no limit */
} kiln_cache_gc_options;

/* Drops rows (kernels and tuning rows, ranked together by last use), least
 * recently used first, in one transaction (on a full disk,
 * one per transaction in the rollback journal), then gives the freed pages
 * back to the filesystem: incremental_vacuum in a database made with
 * auto_vacuum (every one this library creates), else a VACUUM (which turns
 * it on) when the filesystem has room for twice the pages in use.
 * KILN_ERR_INVALID_ARGUMENT for a read-only cache, no limit, a negative age,
 * or opts->size nonzero and smaller than the size field; KILN_ERR_CACHE_IO
 * with *removed_rows nonzero: the rows were deleted but the file could not
 * shrink (the message says why and what to do); the other KILN_ERR_CACHE_*. */
KILN_API kiln_status kiln_cache_gc(kiln_cache *cache, const kiln_cache_gc_options *opts, uint64_t *removed_rows,
                                   uint64_t *removed_bytes);

/* Makes the writable database a file to ship: hits flushed, the WAL folded
 * in, the rollback journal instead of WAL (so a read-only open needs no -wal
 * or -shm beside it) and free pages vacuumed. Later writers still work. */
KILN_API kiln_status kiln_cache_seal(kiln_cache *cache);

/* Copies every row of the database at src_path that verifies and is not
 * already present (kernels, tuning rows, coverage records: all counted in
 * copied); a row that fails verification is skipped and counted. */
KILN_API kiln_status kiln_cache_merge(kiln_cache *cache, const char *src_path, uint64_t *copied, uint64_t *skipped);

/* ---- signatures (docs/cache.md, "Signed layers") ---- */

#define KILN_KEY_ID_SIZE 32 /* SHA-256 of the raw 32-byte Ed25519 public key */

/* Signs the writable database with the Ed25519 private key in the PEM file
 * at key_path: every row is decoded and verified first, then a manifest of
 * each row's fingerprint, cubin SHA-256 and the SHA-256 of what else a load
 * reads (template, constants, arch, NVRTC, entries, parts), sorted by
 * fingerprint, is signed and stored in the database (table kiln_signature),
 * replacing an earlier signature. key_id (may be NULL) receives the key's id.
 * Seal it afterwards to ship it. KILN_ERR_INVALID_ARGUMENT: a read-only
 * cache, a key that is not an Ed25519 private key in PEM; KILN_ERR_CACHE_CORRUPT:
 * a row fails verification (nothing is signed); the other KILN_ERR_CACHE_*. */
KILN_API kiln_status kiln_cache_sign(kiln_cache *cache, const char *key_path, uint8_t key_id[KILN_KEY_ID_SIZE]);

typedef enum kiln_cache_signature_state {
    KILN_CACHE_UNSIGNED = 0,          /* no kiln_signature table, or no row in it */
    KILN_CACHE_SIGNATURE_VALID = 1,   /* the signature verifies and every row is as signed */
    KILN_CACHE_SIGNATURE_INVALID = 2  /* see detail */
} kiln_cache_signature_state;

typedef struct kiln_cache_signature_report {
    kiln_cache_signature_state state;
    uint8_t key_id[KILN_KEY_ID_SIZE]; /* the signing key's id; zero when unsigned or unreadable */
    int trusted;                      /* the cache's trust policy lists the key: 1, 0; no policy: -1 */
    uint64_t signed_rows;             /* rows the manifest lists */
    uint64_t rows;                    /* rows in the database */
    uint64_t bad_rows;                /* rows absent from the manifest or whose digests differ */
    char detail[256];                 /* why it is invalid; "" otherwise */
} kiln_cache_signature_report;

/* Checks the writable database's signature and every row against its
 * manifest (without decoding the cubins: kiln_cache_verify does that);
 * on_bad (may be NULL) is called for each row that is not as signed, under
 * the cache's lock. Changes nothing. KILN_ERR_CACHE_IO / _BUSY when SQLite fails. */
KILN_API kiln_status kiln_cache_check_signature(kiln_cache *cache,
                                                void (*on_bad)(void *user,
                                                               const uint8_t fingerprint[KILN_FINGERPRINT_SIZE],
                                                               const char *detail),
                                                void *user, kiln_cache_signature_report *out);

/* ---- tuning rows (docs/cache.md, "Tuning rows") ----
 *
 * A choice kiln made by timing (a cuBLASLt algorithm for a product shape),
 * filed under the text of everything that decided it: its kind ("cublaslt")
 * and its key ("gpu=...;sms=...;driver=...;cublaslt=...;m=...;...;policy=..."),
 * whose SHA-256 is the row's id. The payload is the kind's own bytes. Each
 * row has a SHA-256 checksum over id, kind, key and payload; a row that
 * fails it is a miss, dropped from the writable database (skipped in a
 * layer) and counted in corrupt_dropped. Under a trust policy the layers'
 * tuning rows are not read (the signature covers kernels only). */

#define KILN_TUNING_KIND_MAX 64
#define KILN_TUNING_KEY_MAX 2048
#define KILN_TUNING_PAYLOAD_MAX 4096

/* Stores (or replaces: a new timing supersedes) the row of kind and key in
 * the writable database. KILN_ERR_INVALID_ARGUMENT: a read-only cache, a
 * schema older than 3 (opened read-only), an empty or too long kind, key or
 * payload; the other KILN_ERR_CACHE_*. */
KILN_API kiln_status kiln_cache_tuning_put(kiln_cache *cache, const char *kind, const char *key, const void *payload,
                                           size_t payload_size);
/* Looks the row of kind and key up: the writable database first (a local
 * timing overrides a shipped one), then each active layer. On a verified hit
 * *found = 1 and *payload (freed with kiln_free) holds *size bytes. A bad row
 * is a miss. KILN_ERR_CACHE_IO / _BUSY when SQLite fails. */
KILN_API kiln_status kiln_cache_tuning_get(kiln_cache *cache, const char *kind, const char *key, void **payload,
                                           size_t *size, int *found);
/* Removes the row of kind and key from the writable database (one that no
 * longer applies); absent is not an error. */
KILN_API kiln_status kiln_cache_tuning_drop(kiln_cache *cache, const char *kind, const char *key);

typedef struct kiln_tuning_info {
    uint8_t id[KILN_FINGERPRINT_SIZE];
    const char *kind, *key;  /* valid during the callback */
    const void *payload;
    size_t payload_size;
    uint64_t hits;
    int64_t created, last_used;
} kiln_tuning_info;
/* Calls fn for each tuning row of the writable database in id order (none
 * before schema 3); fn returning nonzero stops. Rows are listed as stored,
 * not verified (kiln_cache_verify does that). */
KILN_API kiln_status kiln_cache_tuning_foreach(kiln_cache *cache, int (*fn)(void *user, const kiln_tuning_info *info),
                                               void *user);

/* ---- coverage records (docs/cache.md, "Coverage") ----
 *
 * What prewarm made a database for: a model (its name and the SHA-256 of its
 * config), the serving envelope (canonical text: dtype, batch buckets,
 * largest context, prefill chunk), the architecture and NVRTC, and every
 * kernel that needs: `needs` holds one line per kernel,
 * "<64 hex fingerprint>\t<template id>\t<constants>\t<parts>\n". The id is
 * SHA-256 of config digest, envelope, arch and NVRTC; a checksum covers every
 * column. */
typedef struct kiln_coverage_record {
    const char *model_name;
    const char *config_digest; /* 64 hex digits */
    const char *envelope;
    const char *arch;
    int nvrtc_major, nvrtc_minor;
    const char *needs;
} kiln_coverage_record;

/* Stores (or replaces) a coverage record in the writable database.
 * KILN_ERR_INVALID_ARGUMENT: a read-only cache or schema older than 3, a
 * missing field, a config digest that is not 64 hex digits, needs that is
 * not lines of that form (the message names the line). */
KILN_API kiln_status kiln_cache_coverage_put(kiln_cache *cache, const kiln_coverage_record *record);
/* Calls fn for each coverage record of the writable database (bad ones
 * included, with valid 0 and the reason in detail); fn returning nonzero stops. */
typedef struct kiln_coverage_info {
    uint8_t id[KILN_FINGERPRINT_SIZE];
    kiln_coverage_record record; /* strings valid during the callback */
    size_t n_needs;              /* lines of needs */
    int64_t created;
    int valid;
    const char *detail;          /* why not valid; "" otherwise */
} kiln_coverage_info;
KILN_API kiln_status kiln_cache_coverage_foreach(kiln_cache *cache,
                                                 int (*fn)(void *user, const kiln_coverage_info *info), void *user);

/* The fingerprint as 64 lowercase hex digits and a NUL. */
KILN_API void kiln_fingerprint_hex(const uint8_t fp[KILN_FINGERPRINT_SIZE], char out[2 * KILN_FINGERPRINT_SIZE + 1]);
/* Parses 64 hex digits; KILN_ERR_INVALID_ARGUMENT otherwise. */
KILN_API kiln_status kiln_fingerprint_parse(const char *hex, uint8_t out[KILN_FINGERPRINT_SIZE]);

/* Frees memory that kiln handed out. NULL is a no-op. */
KILN_API void kiln_free(void *p);

#ifdef __cplusplus
}
#endif
#endif
