/* kiln — kernels specialized and compiled on demand.
 *
 * A specialization is a template id (a CUDA C file of templates/, embedded in
 * the library), named integer constants (which reach the source as a prelude
 * of #defines) and a target architecture. Its fingerprint is SHA-256 over
 * length-prefixed parts: the schema version, the template id, the template
 * bytes, the bytes of every header the template includes, the normalized
 * NVRTC options, the architecture, the NVRTC version, and the constants in
 * canonical (name) order. Everything that changes the binary changes the key.
 *
 * kiln_jit_acquire looks in the in-memory table, then the cache database, then
 * compiles with NVRTC straight to cubin for the real architecture. Concurrent
 * requests for one key compile it once (single flight); different keys compile
 * in parallel. Threading: every kiln_jit function may be called from any
 * number of threads at once.
 */
#ifndef KILN_JIT_H
#define KILN_JIT_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/cache.h"
#include "kiln/runtime.h"
#include "kiln/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_SPEC_MAX_CONSTANTS 16
#define KILN_NAME_MAX 48

typedef struct kiln_jit kiln_jit;
typedef struct kiln_kernel kiln_kernel;

typedef struct kiln_spec_constant {
    char name[KILN_NAME_MAX]; /* [A-Z_][A-Z0-9_]*, becomes #define KILN_<name> */
    int64_t value;
} kiln_spec_constant;

/* A specialization, by value (no pointers, so it can be copied and kept). */
typedef struct kiln_spec {
    char template_id[KILN_NAME_MAX];  /* "token_embedding" */
    uint32_t n_constants;
    kiln_spec_constant constants[KILN_SPEC_MAX_CONSTANTS];
} kiln_spec;

/* Sets a spec's template and clears its constants. */
KILN_API kiln_status kiln_spec_init(kiln_spec *spec, const char *template_id);
/* Adds or replaces a constant. KILN_ERR_INVALID_ARGUMENT for a bad name or a full spec. */
KILN_API kiln_status kiln_spec_set(kiln_spec *spec, const char *name, int64_t value);
/* Writes the canonical "NAME=value;..." text (sorted by name) into buf. */
KILN_API kiln_status kiln_spec_constants_text(const kiln_spec *spec, char *buf, size_t cap);

/* Zero-initialized means defaults. size tells the library which fields the
 * caller's header had: fields past it take their defaults. */
typedef struct kiln_jit_options {
    uint32_t size;                /* sizeof(kiln_jit_options), or 0 for the library's */
    kiln_cache *cache;            /* borrowed; NULL: nothing persists */
    kiln_runtime *runtime;        /* borrowed; NULL: offline (compile and cache only) */
    const char *arch;             /* "sm_90"; NULL: the runtime's, required offline */
    const char *const *nvrtc_options; /* extra NVRTC options, any order; may be NULL */
    size_t n_nvrtc_options;
    /* At most this many NVRTC compiles at once (an NVRTC instance uses
     * hundreds of MB); further callers wait. 0: the number of online CPUs,
     * at most 16. */
    unsigned max_parallel_compiles;
    /* Whether a miss may compile (KILN_JIT_COMPILE_*). 0: $KILN_JIT decides. */
    int compile;
} kiln_jit_options;

/* kiln_jit_options.compile. With OFF (strict mode), a prepare or acquire of a
 * kernel in no database fails at once with KILN_ERR_JIT_DISABLED, naming the
 * template, its constants, the architecture and the database's nearest row
 * with the parts that differ; hits work as ever. ENV: "off" in $KILN_JIT is
 * OFF, "on" or unset is ON, any other value fails kiln_jit_create. */
#define KILN_JIT_COMPILE_ENV 0
#define KILN_JIT_COMPILE_ON 1
#define KILN_JIT_COMPILE_OFF 2

typedef struct kiln_jit_counters {
    uint64_t compiles;        /* NVRTC compilations that produced a cubin */
    uint64_t compile_errors;  /* NVRTC compilations that failed */
    uint64_t database_hits;   /* cubins loaded from the cache database */
    uint64_t memory_hits;     /* acquisitions served by the in-memory table */
    uint64_t corrupt_dropped; /* cache rows that failed verification */
    uint64_t cache_errors;    /* database reads or writes that failed (acquire compiled or loaded anyway) */
} kiln_jit_counters;

/* KILN_ERR_INVALID_ARGUMENT (no arch offline, a malformed arch or option, a
 * compile mode or $KILN_JIT value kiln does not know, opts->size nonzero and
 * smaller than the size field), KILN_ERR_NVRTC (NVRTC cannot be used). */
KILN_API kiln_status kiln_jit_create(const kiln_jit_options *opts, kiln_jit **out);
/* Unloads every module. NULL is a no-op. */
KILN_API void kiln_jit_destroy(kiln_jit *jit);
KILN_API const char *kiln_jit_errmsg(const kiln_jit *jit);
KILN_API const char *kiln_jit_arch(const kiln_jit *jit);
KILN_API void kiln_jit_get_counters(const kiln_jit *jit, kiln_jit_counters *out);

/* The fingerprint of spec for this jit's architecture and options.
 * KILN_ERR_NOT_FOUND for an unknown template. */
KILN_API kiln_status kiln_jit_fingerprint(kiln_jit *jit, const kiln_spec *spec,
                                          uint8_t out[KILN_FINGERPRINT_SIZE]);
/* The parts of spec's fingerprint, as "name=value;..." text: schema, template,
 * source, headers and options (16-hex-digit digests), arch, nvrtc, constants.
 * Stored with each row (kiln_cache_entry_info.parts) so that a miss can be
 * explained part by part. */
KILN_API kiln_status kiln_jit_fingerprint_parts(kiln_jit *jit, const kiln_spec *spec, char *buf, size_t cap);

/* Makes sure spec's cubin is in the cache (compiling it when missing) without
 * loading it: what prewarm does, and it needs no device. *compiled is set to 1
 * when this call compiled it. KILN_ERR_NOT_FOUND, KILN_ERR_NVRTC_COMPILE (the
 * message holds the NVRTC log), KILN_ERR_CACHE_*, KILN_ERR_JIT_DISABLED (a
 * miss in strict mode). */
KILN_API kiln_status kiln_jit_prepare(kiln_jit *jit, const kiln_spec *spec, int *compiled);
/* The loaded kernel of spec: memory, then database, then NVRTC. The kernel
 * belongs to the jit and lives until kiln_jit_destroy. Needs a runtime
 * (KILN_ERR_NO_DEVICE offline). A database that cannot be read or written
 * (busy past its timeout, a full disk) does not fail it: the kernel is
 * compiled and loaded anyway, counted in cache_errors, and stored by a later
 * call. Otherwise as kiln_jit_prepare, plus KILN_ERR_CUDA_*. */
KILN_API kiln_status kiln_jit_acquire(kiln_jit *jit, const kiln_spec *spec, kiln_kernel **out);
/* A loaded entry point (a CUfunction) by name; NULL name: the first entry. */
KILN_API kiln_status kiln_kernel_function(const kiln_kernel *kernel, const char *entry, void **function);
KILN_API const uint8_t *kiln_kernel_fingerprint(const kiln_kernel *kernel);

/* A relative estimate of what compiling spec costs: the bytes of its template
 * and every header it includes (0 for an unknown template). Prewarm compiles
 * the dearest first, so that parallel compiles finish together. */
KILN_API size_t kiln_spec_compile_cost(const kiln_spec *spec);

/* The ids of the embedded templates, one per call: index 0.. until NULL. */
KILN_API const char *kiln_template_id(size_t index);

#ifdef __cplusplus
}
#endif
#endif
