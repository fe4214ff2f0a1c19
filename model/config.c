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

kiln_status kiln_model_config_parse(const char *json, size_t len, kiln_model_config *out)
{
    if (!json || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_model_config_parse: NULL argument");
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
        snprintf(c.name, sizeof c.name, "%s", mt->valuestring);
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
    if ((st = get_linear_attention(root, &c)))
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

kiln_status kiln_model_config_load(const char *path, kiln_model_config *out)
{
    if (!path || !out)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_model_config_load: NULL argument");
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
    else if ((st = kiln_model_config_parse(buf, n, out)))
        kiln__fail(NULL, st, "%s: %s", path, kiln_errmsg());
    free(buf);
    return st;
}
