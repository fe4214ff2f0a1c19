/* kiln jit internals. Not API. */
#ifndef KILN_JIT_INTERNAL_H
#define KILN_JIT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "jit/embedded.h"
#include "kiln/jit.h"

#define KILN__TEMPLATE_MAX_HEADERS 8
#define KILN__TEMPLATE_MAX_ENTRIES 8
/* Bumped when the fingerprint's layout changes: every key changes with it. */
#define KILN__FINGERPRINT_SCHEMA "kiln-fingerprint-1"

/* A template and what it pulls in, resolved once. */
typedef struct kiln__template {
    char id[KILN_NAME_MAX];
    const kiln__embedded_file *source;
    size_t n_headers; /* every embedded header it includes, transitively, sorted by name */
    const kiln__embedded_file *headers[KILN__TEMPLATE_MAX_HEADERS];
    size_t n_entries;
    char entries[KILN__TEMPLATE_MAX_ENTRIES][KILN_NAME_MAX];
    char entries_text[KILN__TEMPLATE_MAX_ENTRIES * KILN_NAME_MAX]; /* "a,b" */
    int arch_specific; /* //! kiln:arch-specific: compiled for sm_XYa (wgmma needs it) */
} kiln__template;

/* Finds the template "<id>.cu". KILN_ERR_NOT_FOUND names the known ones. */
kiln_status kiln__template_find(const char *id, const kiln__template **out);

/* NVRTC, normalized options and compilation. */
typedef struct kiln__nvrtc_options {
    size_t n;
    char **items; /* sorted, deduplicated; without the architecture */
} kiln__nvrtc_options;

kiln_status kiln__options_normalize(const char *const *opts, size_t n, kiln__nvrtc_options *out);
void kiln__options_free(kiln__nvrtc_options *o);
kiln_status kiln__nvrtc_version(int *major, int *minor);
/* Checks "sm_XY" / "sm_XYa" form. */
kiln_status kiln__arch_check(const char *arch);

/* The fingerprint of spec (see jit.h for its parts). */
kiln_status kiln__fingerprint(const kiln__template *t, const kiln_spec *spec, const kiln__nvrtc_options *opts,
                              const char *arch, int nvrtc_major, int nvrtc_minor, uint8_t out[32]);

/* The parts of spec's fingerprint as "name=value;..." text, digests (16 hex
 * digits of SHA-256) for the byte-heavy ones: what explain compares. */
kiln_status kiln__fingerprint_parts(const kiln__template *t, const kiln_spec *spec, const kiln__nvrtc_options *opts,
                                    const char *arch, int nvrtc_major, int nvrtc_minor, char *buf, size_t cap);

/* Renders the #define prelude and compiles to cubin. On KILN_ERR_NVRTC_COMPILE
 * the thread's message holds the log. *cubin is freed with free(). */
kiln_status kiln__compile(const kiln__template *t, const kiln_spec *spec, const kiln__nvrtc_options *opts,
                          const char *arch, void **cubin, size_t *size);
/* kiln__compile, and on success NVRTC's log in *log (freed with free(); what
 * --ptxas-options=-v reports, for one). */
kiln_status kiln__compile_logged(const kiln__template *t, const kiln_spec *spec, const kiln__nvrtc_options *opts,
                                 const char *arch, void **cubin, size_t *size, char **log);

/* What providers need of a jit. */
kiln_runtime *kiln__jit_runtime(const kiln_jit *jit);
/* The jit's cache database (borrowed; NULL: none). */
kiln_cache *kiln__jit_cache(const kiln_jit *jit);
/* The most NVRTC compiles this jit ever ran at once (for tests). */
unsigned kiln__jit_peak_compiles(kiln_jit *jit);
struct kiln__errslot *kiln__jit_errslot(kiln_jit *jit);

#endif
