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
#define KILN_MODEL_MAX_POSITIONS 1073741824 /* 2^30: max_position_embeddings, sliding_window */
#define KILN_MODEL_MAX_EXPERTS 4096

/* RoPE scaling as transformers' modeling_rope_utils defines it (ROPE_INIT_FUNCTIONS). */
typedef enum kiln_rope_type {
    KILN_ROPE_DEFAULT = 0, /* no scaling */
    KILN_ROPE_LINEAR = 1,  /* frequencies divided by factor */
    KILN_ROPE_DYNAMIC = 2, /* NTK: the base grows once a sequence passes max_position_embeddings */
    KILN_ROPE_YARN = 3,    /* YaRN: a ramp between extrapolation and interpolation, attention scaled */
    KILN_ROPE_LLAMA3 = 4   /* Llama 3.1: low frequencies divided by factor, a smooth band between */
} kiln_rope_type;

/* The RoPE scaling fields of a config (rope_parameters in transformers 5,
 * rope_scaling in older files); all 0 (KILN_ROPE_DEFAULT) when it has none.
 * A field the type does not use is 0. */
typedef struct kiln_rope_scaling {
    kiln_rope_type type;
    double factor;                            /* linear, dynamic, yarn, llama3: > 0 */
    int64_t original_max_position_embeddings; /* yarn, llama3: the pretraining length */
    double low_freq_factor, high_freq_factor; /* llama3: 0 < low < high */
    double beta_fast, beta_slow;              /* yarn: 32 and 1 when absent (or 0) */
    double attention_factor;                  /* yarn: 0 when absent (then derived from factor and mscales) */
    double mscale, mscale_all_dim;            /* yarn: 0 when absent */
    int truncate;                             /* yarn: 1 (floor/ceil the correction range) when absent */
} kiln_rope_scaling;

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
    /* The rotated dimensions of each head: head_dim x partial_rotary_factor
     * rounded down, at least 2 (0 in a config built by hand: head_dim). An
     * odd one is parsed (the other operations' kernels may be listed for it)
     * and refused by kiln_model_rope_frequencies. */
    int64_t rope_dim;
    double partial_rotary_factor; /* (0, 1]; 1 when absent (0 in a hand-built config: 1) */
    kiln_rope_scaling rope;
    int64_t max_position_embeddings; /* 0 when absent */
    /* Qwen3's per-head RMSNorm of q and k before RoPE (model_type qwen3,
     * qwen3_moe, qwen3_next): 1, else 0. */
    int qk_norm;
    /* The attention window (sliding_window; Qwen2's only when
     * use_sliding_window is true): 0 when none. */
    int64_t sliding_window;
    /* A mixture of experts (num_local_experts, num_experts or
     * n_routed_experts): the experts, those a token takes
     * (num_experts_per_tok, 1 when absent), an expert's intermediate size
     * (moe_intermediate_size, else intermediate_size as Mixtral's), the
     * shared expert's (0: none) and norm_topk_prob (always 1 for Mixtral,
     * whose router renormalizes); all 0 for a dense model. Every layer's MLP
     * is the experts: the parser refuses a config that says otherwise
     * (mlp_only_layers not empty, decoder_sparse_step other than 1, or
     * model_type qwen3_next, whose gated delta layers alternate with
     * attention), and more experts than kiln's MoE operation takes
     * (KILN_MOE_MAX_EXPERTS, KILN_MOE_MAX_TOP_K a token), naming the value. */
    int64_t num_experts;
    int64_t num_experts_per_tok;
    int64_t moe_intermediate_size;
    int64_t shared_expert_intermediate_size;
    int norm_topk_prob;
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
 * nesting deeper than 512; KILN_ERR_HOST_OUT_OF_MEMORY. Also refused: a
 * dtype / torch_dtype other than "float16" and "bfloat16" (absent: F16), a
 * rope_type other than default, linear, dynamic, yarn and llama3 (or the
 * legacy key "type"), a scaling field out of range or missing for its type,
 * a partial_rotary_factor leaving fewer than 2 rotated dimensions, a sliding_window
 * that is not null or a whole number. */
KILN_API kiln_status kiln_model_config_parse(const char *json, size_t len, kiln_model_config *out);
/* Reads and parses a file: KILN_ERR_IO when it cannot be read or is not a
 * regular file (a FIFO is refused, never waited on), else as parse. */
KILN_API kiln_status kiln_model_config_load(const char *path, kiln_model_config *out);

/* Options of the _with variants; zero-initialized (size set) means defaults. */
typedef struct kiln_model_config_options {
    size_t size;      /* sizeof(kiln_model_config_options) */
    kiln_dtype dtype; /* KILN_DTYPE_F16 or KILN_DTYPE_BF16: overrides the config's dtype or
                       * torch_dtype, which is then not read; 0: from the config */
} kiln_model_config_options;
/* As kiln_model_config_parse / _load, with options (NULL: defaults).
 * KILN_ERR_INVALID_ARGUMENT for a size that is not the struct's or a dtype
 * other than 0, F16 and BF16. */
KILN_API kiln_status kiln_model_config_parse_with(const char *json, size_t len, const kiln_model_config_options *opts,
                                                  kiln_model_config *out);
KILN_API kiln_status kiln_model_config_load_with(const char *path, const kiln_model_config_options *opts,
                                                 kiln_model_config *out);

/* The RoPE inverse frequencies of a config, scaled as transformers' rope init
 * functions compute them (computed in double, stored as float): inv_freq[i]
 * for the rotated pair i of a head, n = rope_dim / 2 of them, and
 * *attention_scaling, the factor of cos and sin (1 except for yarn). seq_len
 * is the sequence length the frequencies are for; only dynamic scaling reads
 * it (the base grows once seq_len passes max_position_embeddings; 0: at most
 * that). The config may be built by hand: its rope fields are checked as the
 * parser checks them. KILN_ERR_INVALID_ARGUMENT: a NULL pointer, seq_len < 0,
 * n other than rope_dim / 2 (both named); KILN_ERR_CONFIG: an odd rope_dim,
 * rope fields out of range (the field and value named), or frequencies that
 * are not finite and positive. Thread-safe; writes nothing on failure. */
KILN_API kiln_status kiln_model_rope_frequencies(const kiln_model_config *cfg, int64_t seq_len, float *inv_freq,
                                                 size_t n, float *attention_scaling);

/* Lists the specializations a model needs, deduplicated, in a stable order.
 * *specs is freed with kiln_free. KILN_ERR_CONFIG, naming the model, for one
 * kiln cannot serve, whose kernels would be another model's: a model_type
 * outside llama, mistral, qwen2 and qwen3 (a config without one is taken as
 * their layout) and the mixtures of experts mixtral, qwen2_moe and
 * qwen3_moe. */
KILN_API kiln_status kiln_model_specializations(const kiln_model_config *config, kiln_spec **specs,
                                                size_t *count);
/* The same for a known architecture ("sm_90"; NULL: as above): adds what
 * only that architecture takes (the two-kernel decode attention, where the
 * one-kernel decode's shared memory is more than a block gets: before sm_80,
 * sm_86, sm_89, sm_12x) and leaves out what it never takes (the one-kernel
 * decode before sm_80, the TMA products before sm_90). kiln prewarm, export
 * and explain list this way. */
KILN_API kiln_status kiln_model_specializations_for_arch(const kiln_model_config *config, const char *arch,
                                                         kiln_spec **specs, size_t *count);

#ifdef __cplusplus
}
#endif
#endif
