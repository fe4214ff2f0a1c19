/* kiln — model configurations and the specializations they need.
 *
 * A model config carries the sizes that kernels are specialized on. It comes
 * from a Hugging Face config.json or from the built-in default (Llama-3-8B).
 * kiln_model_specializations lists the kernel specializations the providers
 * ask for on that model on the devices kiln is tuned for (sm_90 and on);
 * kiln_model_specializations_for_arch lists them for one architecture, with
 * what only it takes: what `kiln prewarm --arch` compiles.
 */
#ifndef KILN_MODEL_H
#define KILN_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/jit.h"
#include "kiln/status.h"
#include "kiln/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits a config must respect; beyond them a size is absurd, not a model. */
#define KILN_MODEL_MAX_VOCAB 16777216    /* 2^24 */
#define KILN_MODEL_MAX_HIDDEN 65536
#define KILN_MODEL_MAX_INTERMEDIATE 262144
#define KILN_MODEL_MAX_HEADS 1024
#define KILN_MODEL_MAX_HEAD_DIM 1024

typedef struct kiln_model_config {
    char name[64];                 /* "llama-3-8b" for the default, else "config" */
    int64_t vocab_size;
    int64_t hidden_size;
    int64_t intermediate_size;
    int64_t num_attention_heads;
    int64_t num_key_value_heads;   /* num_attention_heads when the file has none */
    int64_t head_dim;              /* hidden_size / num_attention_heads when absent */
    double rms_norm_eps;
    double rope_theta;
    int tie_word_embeddings;
    /* Qwen3-Next's linear-attention (gated delta) layers; all 0 when the
     * config has none, else all four present, each in [1, KILN_MODEL_MAX_HEADS]
     * (heads) or [1, KILN_MODEL_MAX_HEAD_DIM] (dims), key heads dividing
     * value heads. */
    int64_t linear_num_key_heads;
    int64_t linear_num_value_heads;
    int64_t linear_key_head_dim;
    int64_t linear_value_head_dim;
    /* The element type of activations, weights and the KV cache: F16 or
     * BF16 (the config's dtype, or torch_dtype in older files). */
    kiln_dtype dtype;
} kiln_model_config;

/* The built-in default shape: Llama-3-8B. */
KILN_API void kiln_model_config_default(kiln_model_config *out);
/* Parses a config.json held in memory (len bytes, no NUL needed).
 * KILN_ERR_CONFIG names the field and the value that is wrong (a missing
 * field, a zero, negative, fractional or absurd size, heads that do not
 * divide, linear-attention fields given in part), or, for text that is not
 * strict JSON (RFC 8259, as Python's json.load reads it), what and its byte
 * offset: a key given twice in one object at any depth, bytes after the
 * value, a number off the grammar (0896, NaN), a leading byte order mark,
 * a control byte, ill-formed UTF-8, a lone surrogate or \u0000 in a string,
 * nesting deeper than 512; KILN_ERR_HOST_OUT_OF_MEMORY. */
KILN_API kiln_status kiln_model_config_parse(const char *json, size_t len, kiln_model_config *out);
/* Reads and parses a file: KILN_ERR_IO when it cannot be read or is not a
 * regular file (a FIFO is refused, never waited on), else as parse. */
KILN_API kiln_status kiln_model_config_load(const char *path, kiln_model_config *out);

/* Lists the specializations a model needs, deduplicated, in a stable order.
 * *specs is freed with kiln_free. */
KILN_API kiln_status kiln_model_specializations(const kiln_model_config *config, kiln_spec **specs,
                                                size_t *count);
/* The same for a known architecture ("sm_90"; NULL: as above): adds what
 * only that architecture takes (the two-kernel decode attention, where the
 * one-kernel decode's shared memory is more than a block gets: before sm_80,
 * sm_86, sm_89, sm_12x) and leaves out what it never takes (the one-kernel
 * decode before sm_80). kiln prewarm, export and explain list this way. */
KILN_API kiln_status kiln_model_specializations_for_arch(const kiln_model_config *config, const char *arch,
                                                         kiln_spec **specs, size_t *count);

#ifdef __cplusplus
}
#endif
#endif
