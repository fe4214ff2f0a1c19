/* Model configs: Hugging Face config.json parsed and checked into a
 * kiln_model_config (kiln/model.h), or the built-in default. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/internal.h"
#include "kiln/model.h"
#include "kiln/op_moe.h"
#include "model/file.h"
#include "model/json_strict.h"

/* A config.json larger than this is not a config. */
#define MAX_CONFIG_BYTES (16u << 20)

void kiln_model_config_default(kiln_model_config *c)
{
    memset(c, 0, sizeof *c);
    snprintf(c->name, sizeof c->name, "llama-3-8b");
    c->vocab_size = 128256;
    c->hidden_size = 4096;
    c->intermediate_size = 14336;
    c->num_attention_heads = 32;
    c->num_key_value_heads = 8;
    c->head_dim = 128;
    c->rms_norm_eps = 1e-5;
    c->rope_theta = 500000.0;
    c->tie_word_embeddings = 0;
    c->dtype = KILN_DTYPE_F16;
    c->rope_dim = 128;
    c->partial_rotary_factor = 1.0;
    c->max_position_embeddings = 8192;
}

/* src into dst (cap bytes), cut short at a character boundary: a name longer
 * than the field never ends in part of a UTF-8 sequence (the strict check
 * has already made src well-formed). */
static void copy_name(char *dst, size_t cap, const char *src)
{
    size_t n = strlen(src);
    if (n >= cap) {
        n = cap - 1;
        while (n > 0 && ((unsigned char)src[n] & 0xc0) == 0x80)
            n--;
    }
    memcpy(dst, src, n);
    dst[n] = 0;
}

/* The item's JSON text, shortened, for messages. */
static void value_text(const cJSON *item, char *buf, size_t cap)
{
    char *s = item ? cJSON_PrintUnformatted(item) : NULL;
    snprintf(buf, cap, "%s", s ? s : "(missing)");
    if (s && strlen(s) >= cap && cap > 4)
        strcpy(buf + cap - 4, "...");
    cJSON_free(s);
}

static kiln_status get_int(const cJSON *root, const char *field, int required, int64_t def, int64_t max,
                           int64_t *out)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, field);
    char text[64];
    if (!item || cJSON_IsNull(item)) {
        if (required)
            return kiln__fail(NULL, KILN_ERR_CONFIG, "config: field %s is missing", field);
        *out = def;
        return KILN_OK;
    }
    value_text(item, text, sizeof text);
    double v = cJSON_IsNumber(item) ? item->valuedouble : NAN;
    if (!cJSON_IsNumber(item) || !isfinite(v) || v != floor(v) || v < 1 || v > (double)max)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s = %s: must be a whole number in [1, %lld]", field, text,
                          (long long)max);
    *out = (int64_t)v;
    return KILN_OK;
}

static kiln_status get_real(const cJSON *root, const char *field, double def, double lo, double hi, double *out)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, field);
    char text[64];
    if (!item || cJSON_IsNull(item)) {
        *out = def;
        return KILN_OK;
    }
    value_text(item, text, sizeof text);
    double v = cJSON_IsNumber(item) ? item->valuedouble : NAN;
    if (!cJSON_IsNumber(item) || !isfinite(v) || !(v > lo) || v > hi)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s = %s: must be a number in (%g, %g]", field, text, lo, hi);
    *out = v;
    return KILN_OK;
}

/* Qwen3-Next's linear-attention fields: optional, but all four or none. */
static kiln_status get_linear_attention(const cJSON *root, kiln_model_config *c)
{
    static const char *const fields[4] = {"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                          "linear_value_head_dim"};
    static const int64_t max[4] = {KILN_MODEL_MAX_HEADS, KILN_MODEL_MAX_HEADS, KILN_MODEL_MAX_HEAD_DIM,
                                   KILN_MODEL_MAX_HEAD_DIM};
    int64_t v[4];
    int present = -1, missing = -1;
    kiln_status st;
    for (int i = 0; i < 4; i++) {
        if ((st = get_int(root, fields[i], 0, 0, max[i], &v[i])))
            return st;
        if (v[i])
            present = present < 0 ? i : present;
        else
            missing = missing < 0 ? i : missing;
    }
    if (present < 0)
        return KILN_OK;
    if (missing >= 0)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s = %lld is given but %s is missing (all four of %s, %s, %s "
                          "and %s, or none)",
                          fields[present], (long long)v[present], fields[missing], fields[0], fields[1], fields[2],
                          fields[3]);
    if (v[1] % v[0])
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: linear_num_key_heads = %lld does not divide linear_num_value_heads = %lld",
                          (long long)v[0], (long long)v[1]);
    c->linear_num_key_heads = v[0];
    c->linear_num_value_heads = v[1];
    c->linear_key_head_dim = v[2];
    c->linear_value_head_dim = v[3];
    return KILN_OK;
}

/* A whole number in [lo, hi], or def when absent or null. */
static kiln_status get_whole(const cJSON *o, const char *prefix, const char *field, int64_t def, int64_t lo,
                             int64_t hi, int64_t *out)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(o, field);
    char text[64];
    if (!item || cJSON_IsNull(item)) {
        *out = def;
        return KILN_OK;
    }
    value_text(item, text, sizeof text);
    double v = cJSON_IsNumber(item) ? item->valuedouble : NAN;
    if (!cJSON_IsNumber(item) || !isfinite(v) || v != floor(v) || v < (double)lo || v > (double)hi)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s%s%s = %s: must be null or a whole number in [%lld, %lld]",
                          prefix, *prefix ? "." : "", field, text, (long long)lo, (long long)hi);
    *out = (int64_t)v;
    return KILN_OK;
}

/* A number of a rope object: *present says whether it was given (not null). */
static kiln_status get_number(const cJSON *o, const char *prefix, const char *field, double *out, int *present)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(o, field);
    *present = 0;
    *out = 0;
    if (!item || cJSON_IsNull(item))
        return KILN_OK;
    if (!cJSON_IsNumber(item) || !isfinite(item->valuedouble)) {
        char text[64];
        value_text(item, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.%s = %s: must be a number", prefix, field, text);
    }
    *out = item->valuedouble;
    *present = 1;
    return KILN_OK;
}

/* "float16" -> F16, "bfloat16" -> BF16 (dtype in transformers 5, torch_dtype before). */
static kiln_status get_dtype(const cJSON *root, kiln_dtype *out)
{
    const char *field = "dtype";
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, field);
    if (!item || cJSON_IsNull(item)) {
        field = "torch_dtype";
        item = cJSON_GetObjectItemCaseSensitive(root, field);
    }
    *out = KILN_DTYPE_F16;
    if (!item || cJSON_IsNull(item))
        return KILN_OK;
    if (cJSON_IsString(item) && !strcmp(item->valuestring, "float16"))
        return KILN_OK;
    if (cJSON_IsString(item) && !strcmp(item->valuestring, "bfloat16")) {
        *out = KILN_DTYPE_BF16;
        return KILN_OK;
    }
    char text[64];
    value_text(item, text, sizeof text);
    return kiln__fail(NULL, KILN_ERR_CONFIG,
                      "config: %s = %s: kiln runs \"float16\" or \"bfloat16\" (--dtype f16|bf16 overrides the "
                      "config's)",
                      field, text);
}

static const char *const rope_type_names[] = {"default", "linear", "dynamic", "yarn", "llama3"};

/* The checks the parser and kiln_model_rope_frequencies share: the values of
 * c's rope fields, where names the object they came from in messages. */
static kiln_status check_rope(const kiln_model_config *c, const char *where)
{
    const kiln_rope_scaling *r = &c->rope;
    const char *type = (unsigned)r->type < 5 ? rope_type_names[r->type] : "?";
    int64_t dim = c->rope_dim ? c->rope_dim : c->head_dim;
    if ((unsigned)r->type >= 5)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.rope_type = %d: not a kiln_rope_type", where, (int)r->type);
    if (!isfinite(c->rope_theta) || !(c->rope_theta > 0))
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: rope_theta = %g: must be a number > 0", c->rope_theta);
    if (dim < 2 || dim > c->head_dim)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: the rotated dimension head_dim %lld x partial_rotary_factor %g = %lld: must be "
                          "in [2, head_dim]",
                          (long long)c->head_dim, c->partial_rotary_factor ? c->partial_rotary_factor : 1.0,
                          (long long)dim);
    if (r->type == KILN_ROPE_DEFAULT)
        return KILN_OK;
    if (!isfinite(r->factor) || !(r->factor > 0) || r->factor > 1e6)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.factor = %g (rope_type \"%s\"): must be in (0, 1e6]",
                          where, r->factor, type);
    if (r->type == KILN_ROPE_DYNAMIC) {
        if (!c->max_position_embeddings)
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: %s.rope_type \"dynamic\" needs max_position_embeddings (missing)", where);
        if (dim <= 2)
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: %s.rope_type \"dynamic\" needs a rotated dimension above 2, not %lld", where,
                              (long long)dim);
    }
    if ((r->type == KILN_ROPE_YARN || r->type == KILN_ROPE_LLAMA3) &&
        (r->original_max_position_embeddings < 1 || r->original_max_position_embeddings > KILN_MODEL_MAX_POSITIONS))
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: %s.original_max_position_embeddings = %lld (rope_type \"%s\"): must be in [1, %d] "
                          "(or max_position_embeddings given)",
                          where, (long long)r->original_max_position_embeddings, type, KILN_MODEL_MAX_POSITIONS);
    if (r->type == KILN_ROPE_LLAMA3) {
        if (!isfinite(r->low_freq_factor) || !(r->low_freq_factor > 0) || !isfinite(r->high_freq_factor) ||
            !(r->high_freq_factor > r->low_freq_factor))
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: %s.low_freq_factor = %g, high_freq_factor = %g (rope_type \"llama3\"): need "
                              "0 < low_freq_factor < high_freq_factor",
                              where, r->low_freq_factor, r->high_freq_factor);
    }
    if (r->type == KILN_ROPE_YARN) {
        double fast = r->beta_fast ? r->beta_fast : 32, slow = r->beta_slow ? r->beta_slow : 1;
        if (!isfinite(fast) || !isfinite(slow) || !(slow > 0) || fast < slow || fast > 1e6)
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: %s.beta_fast = %g, beta_slow = %g (rope_type \"yarn\"): need 0 < beta_slow <= "
                              "beta_fast <= 1e6",
                              where, fast, slow);
        if (!(c->rope_theta > 1))
            return kiln__fail(NULL, KILN_ERR_CONFIG, "config: rope_theta = %g: rope_type \"yarn\" needs a base above 1",
                              c->rope_theta);
        if (!isfinite(r->attention_factor) || r->attention_factor < 0 || r->attention_factor > 1e3)
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: %s.attention_factor = %g (rope_type \"yarn\"): must be in (0, 1000]", where,
                              r->attention_factor);
        if (!isfinite(r->mscale) || r->mscale < 0 || r->mscale > 1e3 || !isfinite(r->mscale_all_dim) ||
            r->mscale_all_dim < 0 || r->mscale_all_dim > 1e3)
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: %s.mscale = %g, mscale_all_dim = %g (rope_type \"yarn\"): each must be in "
                              "[0, 1000]",
                              where, r->mscale, r->mscale_all_dim);
    }
    return KILN_OK;
}

/* The RoPE fields: rope_scaling (older files, which transformers 5 still
 * prefers when set) or rope_parameters, as RotaryEmbeddingConfigMixin's
 * convert_rope_params_to_dict and standardize_rope_params read them. */
static kiln_status get_rope(const cJSON *root, kiln_model_config *c)
{
    const char *where = "rope_scaling";
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, where);
    if (!o || cJSON_IsNull(o) || (cJSON_IsObject(o) && !o->child)) {
        where = "rope_parameters";
        o = cJSON_GetObjectItemCaseSensitive(root, where);
    }
    char text[96];
    kiln_status st;
    if (o && cJSON_IsNull(o))
        o = NULL;
    if (o && !cJSON_IsObject(o)) {
        value_text(o, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s = %s: must be an object or null", where, text);
    }
    static const char *const layer_types[] = {"full_attention", "sliding_attention"};
    for (int i = 0; o && i < 2; i++)
        if (cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(o, layer_types[i])))
            return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.%s: RoPE per layer type is not supported", where,
                              layer_types[i]);
    if ((st = get_whole(root, "", "max_position_embeddings", 0, 1, KILN_MODEL_MAX_POSITIONS,
                        &c->max_position_embeddings)))
        return st;
    /* The type: rope_type, else the legacy key type, else default. */
    const cJSON *t = o ? cJSON_GetObjectItemCaseSensitive(o, "rope_type") : NULL;
    const char *tkey = "rope_type";
    if (o && (!t || cJSON_IsNull(t))) {
        t = cJSON_GetObjectItemCaseSensitive(o, "type");
        tkey = "type";
    }
    c->rope.type = KILN_ROPE_DEFAULT;
    if (t && !cJSON_IsNull(t)) {
        int found = -1;
        for (int i = 0; cJSON_IsString(t) && i < 5; i++)
            if (!strcmp(t->valuestring, rope_type_names[i]))
                found = i;
        if (found < 0) {
            value_text(t, text, sizeof text);
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: %s.%s = %s: supported RoPE types are default, linear, dynamic, yarn and llama3",
                              where, tkey, text);
        }
        c->rope.type = (kiln_rope_type)found;
    }
    /* rope_theta and partial_rotary_factor: in the object (transformers 5), else at the top. */
    double v;
    int present;
    if (o) {
        if ((st = get_number(o, where, "rope_theta", &v, &present)))
            return st;
        if (present) {
            if (!(v > 0) || v > 1e12)
                return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.rope_theta = %g: must be a number in (0, 1e12]",
                                  where, v);
            c->rope_theta = v;
        }
    }
    present = 0;
    if (o && (st = get_number(o, where, "partial_rotary_factor", &v, &present)))
        return st;
    c->partial_rotary_factor = 1.0;
    if (present && (!(v > 0) || v > 1))
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.partial_rotary_factor = %g: must be in (0, 1]", where, v);
    if (present)
        c->partial_rotary_factor = v;
    else if ((st = get_real(root, "partial_rotary_factor", 1.0, 0.0, 1.0, &c->partial_rotary_factor)))
        return st;
    /* int(head_dim * partial_rotary_factor), as transformers takes it. */
    /* An odd one (transformers refuses a fully rotated odd head) is kept:
     * kernels of other operations may be listed for such a shape; only
     * kiln_model_rope_frequencies, what rotates, refuses it. */
    c->rope_dim = (int64_t)floor((double)c->head_dim * c->partial_rotary_factor);
    if (c->rope_dim < 2)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: head_dim %lld x partial_rotary_factor %g = %lld rotated dimensions: must be at "
                          "least 2",
                          (long long)c->head_dim, c->partial_rotary_factor, (long long)c->rope_dim);
    kiln_rope_scaling *r = &c->rope;
    if (r->type == KILN_ROPE_DEFAULT)
        return check_rope(c, where);
    const char *type = rope_type_names[r->type];
    if ((st = get_number(o, where, "factor", &r->factor, &present)))
        return st;
    int have_factor = present;
    if (r->type == KILN_ROPE_YARN || r->type == KILN_ROPE_LLAMA3) {
        /* standardize_rope_params: a top-level original_max_position_embeddings
         * (Phi3) comes first, then the object's, then max_position_embeddings. */
        int64_t top = 0, inner = 0;
        if ((st = get_whole(root, "", "original_max_position_embeddings", 0, 1, KILN_MODEL_MAX_POSITIONS, &top)) ||
            (st = get_whole(o, where, "original_max_position_embeddings", 0, 1, KILN_MODEL_MAX_POSITIONS, &inner)))
            return st;
        r->original_max_position_embeddings = top ? top : inner ? inner : c->max_position_embeddings;
        if (!r->original_max_position_embeddings)
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: %s.rope_type = \"%s\" needs original_max_position_embeddings or "
                              "max_position_embeddings (both missing)",
                              where, type);
    }
    if (!have_factor && r->type == KILN_ROPE_YARN && c->max_position_embeddings) {
        /* _compute_yarn_parameters: no factor is the ratio of the two lengths
         * (a factor given wins over the ratio, as transformers 5.17 runs it). */
        r->factor = (double)c->max_position_embeddings / (double)r->original_max_position_embeddings;
        have_factor = 1;
    }
    if (!have_factor)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.rope_type = \"%s\" needs factor (missing)", where, type);
    if (r->type == KILN_ROPE_LLAMA3) {
        static const char *const need[2] = {"low_freq_factor", "high_freq_factor"};
        double *dst[2] = {&r->low_freq_factor, &r->high_freq_factor};
        for (int i = 0; i < 2; i++) {
            if ((st = get_number(o, where, need[i], dst[i], &present)))
                return st;
            if (!present)
                return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.rope_type = \"llama3\" needs %s (missing)", where,
                                  need[i]);
        }
    }
    if (r->type == KILN_ROPE_YARN) {
        static const char *const opt[5] = {"beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"};
        double *dst[5] = {&r->beta_fast, &r->beta_slow, &r->attention_factor, &r->mscale, &r->mscale_all_dim};
        for (int i = 0; i < 5; i++) {
            if ((st = get_number(o, where, opt[i], dst[i], &present)))
                return st;
            /* A given attention_factor must be usable; absent, it is derived. */
            if (i == 2 && present && !(r->attention_factor > 0))
                return kiln__fail(NULL, KILN_ERR_CONFIG,
                                  "config: %s.attention_factor = %g (rope_type \"yarn\"): must be in (0, 1000]", where,
                                  r->attention_factor);
        }
        r->beta_fast = r->beta_fast ? r->beta_fast : 32;
        r->beta_slow = r->beta_slow ? r->beta_slow : 1;
        r->truncate = 1;
        const cJSON *tr = cJSON_GetObjectItemCaseSensitive(o, "truncate");
        if (tr && !cJSON_IsNull(tr)) {
            if (!cJSON_IsBool(tr)) {
                value_text(tr, text, sizeof text);
                return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s.truncate = %s: must be true or false", where,
                                  text);
            }
            r->truncate = cJSON_IsTrue(tr);
        }
    }
    return check_rope(c, where);
}

/* Qwen3's per-head q/k RMSNorm, Mistral's (and Qwen2's) sliding window. */
static kiln_status get_family(const cJSON *root, kiln_model_config *c)
{
    /* By model_type, else (a file without one) by the first architecture. */
    static const char *const qk_norm_types[3][2] = {{"qwen3", "Qwen3ForCausalLM"},
                                                    {"qwen3_moe", "Qwen3MoeForCausalLM"},
                                                    {"qwen3_next", "Qwen3NextForCausalLM"}};
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    const cJSON *a0 = cJSON_IsArray(archs) ? archs->child : NULL;
    for (size_t i = 0; i < 3; i++)
        c->qk_norm |= cJSON_IsString(mt) && *mt->valuestring ? !strcmp(mt->valuestring, qk_norm_types[i][0])
                                         : cJSON_IsString(a0) && !strcmp(a0->valuestring, qk_norm_types[i][1]);
    kiln_status st = get_whole(root, "", "sliding_window", 0, 0, KILN_MODEL_MAX_POSITIONS, &c->sliding_window);
    if (st)
        return st;
    /* Qwen2Config keeps sliding_window only when use_sliding_window is true. */
    const cJSON *use = cJSON_GetObjectItemCaseSensitive(root, "use_sliding_window");
    if (use && !cJSON_IsNull(use) && !cJSON_IsBool(use)) {
        char text[64];
        value_text(use, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: use_sliding_window = %s: must be true or false", text);
    }
    if (cJSON_IsFalse(use))
        c->sliding_window = 0;
    return KILN_OK;
}

/* The config's model_type, else the family its first architecture names
 * (NULL when neither): Mixtral's and Qwen3-Next's rules hang on it. */
static int is_family(const cJSON *root, const char *model_type, const char *architecture)
{
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (cJSON_IsString(mt) && *mt->valuestring)
        return !strcmp(mt->valuestring, model_type);
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    const cJSON *a0 = cJSON_IsArray(archs) ? archs->child : NULL;
    return cJSON_IsString(a0) && !strcmp(a0->valuestring, architecture);
}

/* A mixture of experts' fields, as Mixtral (num_local_experts, its experts
 * intermediate_size wide, always renormalized), Qwen2-MoE and Qwen3-MoE
 * (num_experts, moe_intermediate_size, shared_expert_intermediate_size,
 * norm_topk_prob) and DeepSeek (n_routed_experts) write them; all 0 for a
 * dense model. A config whose layers are not all alike is refused: the
 * struct says one MLP for every layer. */
static kiln_status get_experts(const cJSON *root, kiln_model_config *c)
{
    static const char *const count_keys[3] = {"num_local_experts", "num_experts", "n_routed_experts"};
    kiln_status st;
    /* Qwen3-Next's gated delta layers alternate with attention layers
     * (full_attention_interval), a mix the struct cannot say. */
    if (is_family(root, "qwen3_next", "Qwen3NextForCausalLM"))
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: model_type = \"qwen3_next\": its gated delta (linear attention) layers "
                          "alternate with attention layers; kiln does not serve that layer mix");
    c->num_experts = 0;
    const char *count_key = NULL;
    for (int i = 0; i < 3 && !c->num_experts; i++) {
        if ((st = get_whole(root, "", count_keys[i], 0, 0, KILN_MODEL_MAX_EXPERTS, &c->num_experts)))
            return st;
        count_key = count_keys[i];
    }
    if (!c->num_experts)
        return KILN_OK;
    if (c->num_experts > KILN_MOE_MAX_EXPERTS)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %s = %lld: kiln's MoE operation takes at most %d experts",
                          count_key, (long long)c->num_experts, KILN_MOE_MAX_EXPERTS);
    if ((st = get_whole(root, "", "num_experts_per_tok", 1, 1, c->num_experts, &c->num_experts_per_tok)) ||
        (st = get_whole(root, "", "moe_intermediate_size", c->intermediate_size, 1, KILN_MODEL_MAX_INTERMEDIATE,
                        &c->moe_intermediate_size)) ||
        (st = get_whole(root, "", "shared_expert_intermediate_size", 0, 0, KILN_MODEL_MAX_INTERMEDIATE,
                        &c->shared_expert_intermediate_size)))
        return st;
    if (c->num_experts_per_tok > KILN_MOE_MAX_TOP_K)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: num_experts_per_tok = %lld: kiln's MoE operation takes at most %d experts a token",
                          (long long)c->num_experts_per_tok, KILN_MOE_MAX_TOP_K);
    /* Qwen2/3-MoE: the layers in mlp_only_layers, and those off the
     * decoder_sparse_step grid, have a dense MLP instead of the experts. */
    char text[64];
    const cJSON *dense = cJSON_GetObjectItemCaseSensitive(root, "mlp_only_layers");
    if (dense && !cJSON_IsNull(dense) && (!cJSON_IsArray(dense) || cJSON_GetArraySize(dense) > 0)) {
        value_text(dense, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: mlp_only_layers = %s: layers with a dense MLP among the experts' are not "
                          "supported (only [] or null: every layer's MLP is the experts)",
                          text);
    }
    int64_t step;
    if ((st = get_whole(root, "", "decoder_sparse_step", 1, 1, INT32_MAX, &step)))
        return st;
    if (step != 1)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: decoder_sparse_step = %lld: the layers off its grid have a dense MLP instead of the "
                          "experts; kiln takes 1 (every layer's MLP is the experts)",
                          (long long)step);
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "norm_topk_prob");
    if (norm && !cJSON_IsNull(norm) && !cJSON_IsBool(norm)) {
        value_text(norm, text, sizeof text);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: norm_topk_prob = %s: must be true or false", text);
    }
    /* Mixtral's block divides the chosen weights by their sum whatever the
     * file says (MixtralConfig has no norm_topk_prob). */
    c->norm_topk_prob = cJSON_IsTrue(norm) || is_family(root, "mixtral", "MixtralForCausalLM");
    return KILN_OK;
}

/* get_mscale of _compute_yarn_parameters. */
static double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0; }

kiln_status kiln_model_rope_frequencies(const kiln_model_config *cfg, int64_t seq_len, float *inv_freq, size_t n,
                                        float *attention_scaling)
{
    if (!cfg || !inv_freq || !attention_scaling)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_model_rope_frequencies: NULL argument");
    if (seq_len < 0)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_model_rope_frequencies: seq_len = %lld is negative",
                          (long long)seq_len);
    kiln_status st = check_rope(cfg, "rope");
    if (st)
        return st;
    const kiln_rope_scaling *r = &cfg->rope;
    const int64_t d = cfg->rope_dim ? cfg->rope_dim : cfg->head_dim;
    if (d % 2)
        return kiln__fail(NULL, KILN_ERR_CONFIG,
                          "config: head_dim %lld x partial_rotary_factor %g = %lld rotated dimensions: RoPE needs an "
                          "even number",
                          (long long)cfg->head_dim, cfg->partial_rotary_factor ? cfg->partial_rotary_factor : 1.0,
                          (long long)d);
    if (n != (size_t)(d / 2))
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_model_rope_frequencies: n = %zu, but rope_dim %lld needs rope_dim / 2 = %lld", n,
                          (long long)d, (long long)(d / 2));
    const double dim = (double)d, pi = 3.14159265358979323846;
    double base = cfg->rope_theta, scaling = 1.0;
    if (r->type == KILN_ROPE_DYNAMIC) {
        /* _compute_dynamic_ntk_parameters: seq_len at least max_position_embeddings. */
        double L = (double)(seq_len > cfg->max_position_embeddings ? seq_len : cfg->max_position_embeddings);
        double M = (double)cfg->max_position_embeddings;
        base *= pow(r->factor * L / M - (r->factor - 1), dim / (dim - 2));
    }
    /* _compute_yarn_parameters: the correction range and the attention factor. */
    double low = 0, high = 0;
    if (r->type == KILN_ROPE_YARN) {
        const double orig = (double)r->original_max_position_embeddings;
        double corr[2], beta[2] = {r->beta_fast ? r->beta_fast : 32, r->beta_slow ? r->beta_slow : 1};
        for (int k = 0; k < 2; k++)
            corr[k] = dim * log(orig / (beta[k] * 2 * pi)) / (2 * log(base));
        low = r->truncate ? floor(corr[0]) : corr[0];
        high = r->truncate ? ceil(corr[1]) : corr[1];
        low = low > 0 ? low : 0;
        high = high < dim - 1 ? high : dim - 1;
        if (low == high)
            high += 0.001; /* as linear_ramp_factor: no singularity */
        if (r->attention_factor > 0)
            scaling = r->attention_factor;
        else if (r->mscale && r->mscale_all_dim)
            scaling = yarn_mscale(r->factor, r->mscale) / yarn_mscale(r->factor, r->mscale_all_dim);
        else
            scaling = yarn_mscale(r->factor, 1.0);
    }
    float *tmp = malloc(n * sizeof *tmp);
    if (!tmp)
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "kiln_model_rope_frequencies: out of memory");
    for (size_t i = 0; i < n; i++) {
        const double inv = 1.0 / pow(base, (double)(2 * i) / dim);
        double f = inv;
        switch (r->type) {
        case KILN_ROPE_DEFAULT:
        case KILN_ROPE_DYNAMIC: break;
        case KILN_ROPE_LINEAR: f = inv / r->factor; break;
        case KILN_ROPE_YARN: {
            double ramp = ((double)i - low) / (high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            const double extrapolation = 1 - ramp; /* inv_freq_extrapolation_factor */
            f = inv / r->factor * (1 - extrapolation) + inv * extrapolation;
            break;
        }
        case KILN_ROPE_LLAMA3: {
            /* _compute_llama3_parameters: wavelengths past the pretraining
             * length / low_freq_factor are divided by factor, those under it /
             * high_freq_factor kept, those between blended smoothly. */
            const double orig = (double)r->original_max_position_embeddings;
            const double wavelen = 2 * pi / inv;
            const double low_wavelen = orig / r->low_freq_factor, high_wavelen = orig / r->high_freq_factor;
            if (wavelen > low_wavelen) {
                f = inv / r->factor;
            } else if (!(wavelen < high_wavelen)) {
                const double smooth = (orig / wavelen - r->low_freq_factor) / (r->high_freq_factor - r->low_freq_factor);
                f = (1 - smooth) * inv / r->factor + smooth * inv;
            }
            break;
        }
        }
        tmp[i] = (float)f;
        if (!isfinite(tmp[i]) || !(tmp[i] > 0)) {
            free(tmp);
            return kiln__fail(NULL, KILN_ERR_CONFIG,
                              "config: RoPE (%s, rope_theta %g, rope_dim %lld): inverse frequency %zu is %g, not a "
                              "finite positive float",
                              rope_type_names[r->type], cfg->rope_theta, (long long)d, i, f);
        }
    }
    if (!isfinite((float)scaling) || !((float)scaling > 0)) {
        free(tmp);
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: RoPE yarn attention scaling %g is not finite and positive",
                          scaling);
    }
    memcpy(inv_freq, tmp, n * sizeof *tmp);
    *attention_scaling = (float)scaling;
    free(tmp);
    return KILN_OK;
}

static kiln_status parse_config(const char *json, size_t len, const kiln_model_config_options *opts,
                                kiln_model_config *out)
{
    if (len > MAX_CONFIG_BYTES)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: %zu bytes; a config is at most %u", len, MAX_CONFIG_BYTES);
    /* cJSON alone takes the first of two equal keys, bytes after the value
     * and numbers like 0896, where Python's json.load (transformers) refuses. */
    char what[256];
    kiln_status strict = kiln__json_strict_check(json, len, 0, what, sizeof what);
    if (strict == KILN_ERR_HOST_OUT_OF_MEMORY)
        return kiln__fail(NULL, strict, "config: out of memory checking %zu bytes of JSON", len);
    if (strict)
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: not JSON: %s of %zu", what, len);
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!doc) {
        size_t at = end && end >= json ? (size_t)(end - json) : 0;
        return kiln__fail(NULL, KILN_ERR_CONFIG, "config: not JSON (error near byte %zu of %zu)", at, len);
    }
    kiln_status st = KILN_OK;
    kiln_model_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.name, sizeof c.name, "config");
    c.dtype = KILN_DTYPE_F16;
    const cJSON *root = doc;
    if (!cJSON_IsObject(root)) {
        st = kiln__fail(NULL, KILN_ERR_CONFIG, "config: the top level must be a JSON object");
        goto out;
    }
    /* Multimodal configs keep the language model's sizes in text_config. */
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (!cJSON_GetObjectItemCaseSensitive(root, "hidden_size") && cJSON_IsObject(text))
        root = text;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (cJSON_IsString(mt) && mt->valuestring && *mt->valuestring)
        copy_name(c.name, sizeof c.name, mt->valuestring);
    if ((st = get_int(root, "vocab_size", 1, 0, KILN_MODEL_MAX_VOCAB, &c.vocab_size)) ||
        (st = get_int(root, "hidden_size", 1, 0, KILN_MODEL_MAX_HIDDEN, &c.hidden_size)) ||
        (st = get_int(root, "intermediate_size", 1, 0, KILN_MODEL_MAX_INTERMEDIATE, &c.intermediate_size)) ||
        (st = get_int(root, "num_attention_heads", 1, 0, KILN_MODEL_MAX_HEADS, &c.num_attention_heads)) ||
        (st = get_int(root, "num_key_value_heads", 0, c.num_attention_heads, KILN_MODEL_MAX_HEADS,
                      &c.num_key_value_heads)))
        goto out;
    int64_t default_head_dim = c.hidden_size / c.num_attention_heads;
    if ((st = get_int(root, "head_dim", 0, default_head_dim ? default_head_dim : 1, KILN_MODEL_MAX_HEAD_DIM,
                      &c.head_dim)) ||
        (st = get_real(root, "rms_norm_eps", 1e-6, 0.0, 1.0, &c.rms_norm_eps)) ||
        (st = get_real(root, "rope_theta", 10000.0, 0.0, 1e12, &c.rope_theta)))
        goto out;
    if (c.head_dim > KILN_MODEL_MAX_HEAD_DIM) {
        /* Only a derived head_dim gets here: an explicit one was range-checked. */
        st = kiln__fail(NULL, KILN_ERR_CONFIG,
                        "config: no head_dim, and hidden_size / num_attention_heads = %lld / %lld = %lld exceeds %d",
                        (long long)c.hidden_size, (long long)c.num_attention_heads, (long long)c.head_dim,
                        KILN_MODEL_MAX_HEAD_DIM);
        goto out;
    }
    if (c.num_attention_heads % c.num_key_value_heads) {
        st = kiln__fail(NULL, KILN_ERR_CONFIG,
                        "config: num_key_value_heads = %lld does not divide num_attention_heads = %lld",
                        (long long)c.num_key_value_heads, (long long)c.num_attention_heads);
        goto out;
    }
    if (!cJSON_GetObjectItemCaseSensitive(root, "head_dim") && c.hidden_size % c.num_attention_heads) {
        st = kiln__fail(NULL, KILN_ERR_CONFIG,
                        "config: no head_dim, and num_attention_heads = %lld does not divide hidden_size = %lld",
                        (long long)c.num_attention_heads, (long long)c.hidden_size);
        goto out;
    }
    if ((st = get_linear_attention(root, &c)) || (st = get_rope(root, &c)) || (st = get_family(root, &c)) ||
        (st = get_experts(root, &c)))
        goto out;
    if (opts && opts->dtype)
        c.dtype = opts->dtype;
    else if ((st = get_dtype(root, &c.dtype)))
        goto out;
    const cJSON *tie = cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings");
    if (tie && !cJSON_IsNull(tie)) {
        if (!cJSON_IsBool(tie)) {
            char v[64];
            value_text(tie, v, sizeof v);
            st = kiln__fail(NULL, KILN_ERR_CONFIG, "config: tie_word_embeddings = %s: must be true or false", v);
            goto out;
        }
        c.tie_word_embeddings = cJSON_IsTrue(tie);
    }
    *out = c;
out:
    cJSON_Delete(doc);
    return st;
}

/* NULL options, or ones of the right size with dtype 0, F16 or BF16. */
static kiln_status check_options(const char *fn, const kiln_model_config_options *opts)
{
    if (opts && opts->size != sizeof *opts)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "%s: options size %zu, expected %zu", fn, opts->size,
                          sizeof *opts);
    if (opts && opts->dtype && opts->dtype != KILN_DTYPE_F16 && opts->dtype != KILN_DTYPE_BF16)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "%s: options dtype %d: kiln runs F16 (%d) or BF16 (%d)", fn,
                          (int)opts->dtype, (int)KILN_DTYPE_F16, (int)KILN_DTYPE_BF16);
    return KILN_OK;
}

kiln_status kiln_model_config_parse_with(const char *json, size_t len, const kiln_model_config_options *opts,
                                         kiln_model_config *out)
{
    if (!json || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_model_config_parse: NULL argument");
    kiln_status st = check_options("kiln_model_config_parse_with", opts);
    return st ? st : parse_config(json, len, opts, out);
}

kiln_status kiln_model_config_parse(const char *json, size_t len, kiln_model_config *out)
{
    return kiln_model_config_parse_with(json, len, NULL, out);
}

kiln_status kiln_model_config_load(const char *path, kiln_model_config *out)
{
    return kiln_model_config_load_with(path, NULL, out);
}

kiln_status kiln_model_config_load_with(const char *path, const kiln_model_config_options *opts,
                                        kiln_model_config *out)
{
    if (!path || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_model_config_load: NULL argument");
    kiln_status ost = check_options("kiln_model_config_load_with", opts);
    if (ost)
        return ost;
    int fd;
    kiln_status st = kiln__open_regular(path, &fd, NULL);
    if (st)
        return st;
    char *buf = malloc(MAX_CONFIG_BYTES + 1);
    if (!buf) {
        close(fd);
        return kiln__fail(NULL, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    }
    /* At most one byte past the limit, whatever the size said: the file may grow. */
    size_t n = 0;
    int err = 0;
    while (n < MAX_CONFIG_BYTES + 1) {
        ssize_t r = read(fd, buf + n, MAX_CONFIG_BYTES + 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            err = r < 0 ? errno : 0;
            break;
        }
        n += (size_t)r;
    }
    close(fd);
    if (err)
        st = kiln__fail(NULL, KILN_ERR_IO, "cannot read config %s: %s", path, strerror(err));
    else if ((st = parse_config(buf, n, opts, out)))
        kiln__fail(NULL, st, "%s: %s", path, kiln_errmsg());
    free(buf);
    return st;
}
