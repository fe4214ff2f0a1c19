/* The decoder's model: config.json beyond kiln_model_config, checkpoint
 * folders, tensor checks and uploads, random weights for benchmarks. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "decoder.h"

static _Thread_local char g_msg[2048];

const char *dec_errmsg(void) { return g_msg; }

kiln_status dec_fail(kiln_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
kiln_status dec_fail(kiln_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_msg, sizeof g_msg, fmt, ap);
    va_end(ap);
    return st;
}

/* A kiln failure, with what was being done and kiln's message. */
kiln_status dec_kfail(kiln_status st, const char *what)
{
    return dec_fail(st, "%s: %s: %s", what, kiln_status_code(st), kiln_errmsg());
}

/* ---- config.json ---- */

static void value_text(const cJSON *item, char *buf, size_t cap)
{
    char *s = item ? cJSON_PrintUnformatted(item) : NULL;
    snprintf(buf, cap, "%s", s ? s : "(missing)");
    if (s && strlen(s) >= cap && cap > 4)
        strcpy(buf + cap - 4, "...");
    cJSON_free(s);
}

static int is_whole(const cJSON *item, double lo, double hi, int64_t *out)
{
    if (!cJSON_IsNumber(item))
        return 0;
    double v = item->valuedouble;
    if (!isfinite(v) || v != floor(v) || v < lo || v > hi)
        return 0;
    *out = (int64_t)v;
    return 1;
}

kiln_status dec_config_parse(const char *json, size_t len, dec_config *out)
{
    dec_config c;
    memset(&c, 0, sizeof c);
    kiln_status st = kiln_model_config_parse(json, len, &c.base);
    if (st)
        return dec_fail(st, "%s", kiln_errmsg());
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root)
        return dec_fail(KILN_ERR_CONFIG, "config: not JSON");
    char text[96];
    st = KILN_ERR_CONFIG;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (cJSON_IsString(mt)) {
        snprintf(c.model_type, sizeof c.model_type, "%s", mt->valuestring);
    } else {
        const cJSON *archs = cJSON_GetObjectItemCaseSensitive(root, "architectures");
        const cJSON *a0 = cJSON_IsArray(archs) ? archs->child : NULL;
        static const char *const archs_known[7][2] = {
            {"LlamaForCausalLM", "llama"},       {"Qwen2ForCausalLM", "qwen2"},
            {"Qwen3ForCausalLM", "qwen3"},       {"MistralForCausalLM", "mistral"},
            {"Qwen3MoeForCausalLM", "qwen3_moe"}, {"Qwen2MoeForCausalLM", "qwen2_moe"},
            {"MixtralForCausalLM", "mixtral"}};
        for (int i = 0; i < 7 && !c.model_type[0]; i++)
            if (cJSON_IsString(a0) && !strcmp(a0->valuestring, archs_known[i][0]))
                snprintf(c.model_type, sizeof c.model_type, "%s", archs_known[i][1]);
        if (!c.model_type[0]) {
            value_text(archs, text, sizeof text);
            dec_fail(KILN_ERR_CONFIG, "config: no model_type, and architectures = %s is not supported "
                                      "(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, "
                                      "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM)",
                     text);
            goto out;
        }
    }
    static const char *const dense_types[4] = {"llama", "qwen2", "qwen3", "mistral"};
    static const char *const moe_types[3] = {"qwen3_moe", "qwen2_moe", "mixtral"};
    int dense = 0, moe = 0;
    for (int i = 0; i < 4; i++)
        dense |= !strcmp(c.model_type, dense_types[i]);
    for (int i = 0; i < 3; i++)
        moe |= !strcmp(c.model_type, moe_types[i]);
    if (!dense && !moe) {
        value_text(mt, text, sizeof text);
        dec_fail(KILN_ERR_CONFIG,
                 "config: model_type = %s: unsupported architecture (supported: llama, qwen2, qwen3, mistral, "
                 "qwen3_moe, qwen2_moe, mixtral)",
                 text);
        goto out;
    }
    if (c.base.num_experts && dense) {
        dec_fail(KILN_ERR_CONFIG,
                 "config: %lld experts in a %s config: only qwen3_moe, qwen2_moe and mixtral have experts",
                 (long long)c.base.num_experts, c.model_type);
        goto out;
    }
    if (c.base.num_experts) {
        /* The shapes kiln_op_moe_experts takes (kiln/op_moe.h). */
        if (c.base.hidden_size % 128 || c.base.moe_intermediate_size % 64) {
            dec_fail(KILN_ERR_CONFIG,
                     "config: hidden_size = %lld, expert intermediate size = %lld: the experts take a hidden size "
                     "that is a multiple of 128 and an intermediate size that is a multiple of 64",
                     (long long)c.base.hidden_size, (long long)c.base.moe_intermediate_size);
            goto out;
        }
        /* Qwen2-MoE's shared expert, gated (shared_expert_gate); 0 is none. */
        if (!strcmp(c.model_type, "qwen2_moe"))
            c.shared_inter = c.base.shared_expert_intermediate_size;
    }
    /* A window at least as long as the longest sequence is no window (plain Llama). */
    if (c.base.max_position_embeddings && c.base.sliding_window >= c.base.max_position_embeddings)
        c.base.sliding_window = 0;
    if (c.base.sliding_window > UINT32_MAX) {
        dec_fail(KILN_ERR_CONFIG, "config: sliding_window = %lld: at most 2^32 - 1", (long long)c.base.sliding_window);
        goto out;
    }
    const cJSON *nl = cJSON_GetObjectItemCaseSensitive(root, "num_hidden_layers");
    if (!is_whole(nl, 1, 4096, &c.layers)) {
        value_text(nl, text, sizeof text);
        dec_fail(KILN_ERR_CONFIG, "config: num_hidden_layers = %s: must be a whole number in [1, 4096]", text);
        goto out;
    }
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (act && !cJSON_IsNull(act) && !(cJSON_IsString(act) && !strcmp(act->valuestring, "silu"))) {
        value_text(act, text, sizeof text);
        dec_fail(KILN_ERR_CONFIG, "config: hidden_act = %s: only silu is supported", text);
        goto out;
    }
    /* The library parsed the RoPE (rope_parameters or rope_scaling, scaled or
     * not); its frequencies are computed once, here, for the engine. */
    if (kiln_model_rope_frequencies(&c.base, 0, c.rope_inv_freq, (size_t)(c.base.rope_dim / 2),
                                    &c.rope_attention_scaling)) {
        dec_fail(KILN_ERR_CONFIG, "%s", kiln_errmsg());
        goto out;
    }
    const char *flags[3] = {"mlp_bias", "use_sliding_window", "attention_bias"};
    for (int i = 0; i < 3; i++) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(root, flags[i]);
        if (f && !cJSON_IsNull(f) && !cJSON_IsBool(f)) {
            value_text(f, text, sizeof text);
            dec_fail(KILN_ERR_CONFIG, "config: %s = %s: must be true or false", flags[i], text);
            goto out;
        }
        if (i < 2 && cJSON_IsTrue(f)) {
            dec_fail(KILN_ERR_CONFIG, "config: %s = true is not supported", flags[i]);
            goto out;
        }
        if (i == 2)
            c.qkv_bias = cJSON_IsTrue(f);
    }
    if (!strcmp(c.model_type, "qwen2"))
        c.qkv_bias = 1;
    if (!strcmp(c.model_type, "qwen2_moe")) {
        /* Qwen2MoeConfig.qkv_bias (true when absent, as before it existed). */
        const cJSON *qb = cJSON_GetObjectItemCaseSensitive(root, "qkv_bias");
        if (qb && !cJSON_IsNull(qb) && !cJSON_IsBool(qb)) {
            value_text(qb, text, sizeof text);
            dec_fail(KILN_ERR_CONFIG, "config: qkv_bias = %s: must be true or false", text);
            goto out;
        }
        c.qkv_bias = !cJSON_IsFalse(qb);
    }
    if (c.base.head_dim != 64 && c.base.head_dim != 128 && c.base.head_dim != 256) {
        dec_fail(KILN_ERR_CONFIG, "config: head_dim = %lld: the attention provider takes 64, 128 or 256",
                 (long long)c.base.head_dim);
        goto out;
    }
    if (c.base.linear_num_key_heads) {
        dec_fail(KILN_ERR_CONFIG, "config: linear-attention layers are not supported by this decoder");
        goto out;
    }
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id");
    if (eos && !cJSON_IsNull(eos)) {
        const cJSON *one = cJSON_IsArray(eos) ? eos->child : eos;
        for (; one; one = cJSON_IsArray(eos) ? one->next : NULL) {
            int64_t v;
            if (c.n_eos == DEC_MAX_EOS || !is_whole(one, 0, (double)c.base.vocab_size - 1, &v)) {
                value_text(eos, text, sizeof text);
                dec_fail(KILN_ERR_CONFIG, "config: eos_token_id = %s: must be at most %d token ids below %lld", text,
                         DEC_MAX_EOS, (long long)c.base.vocab_size);
                goto out;
            }
            c.eos[c.n_eos++] = v;
        }
    }
    *out = c;
    st = KILN_OK;
out:
    cJSON_Delete(root);
    return st;
}

static kiln_status read_file(const char *path, char **data, size_t *len)
{
    /* Non-blocking, so that a FIFO cannot hang the open; only a regular file is read. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return dec_fail(KILN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    const char *why = fstat(fd, &sb) != 0 ? strerror(errno) : !S_ISREG(sb.st_mode) ? "not a regular file" : NULL;
    int flags = why ? -1 : fcntl(fd, F_GETFL);
    if (!why && (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0))
        why = strerror(errno);
    if (why) {
        close(fd);
        return dec_fail(KILN_ERR_IO, "%s: %s", path, why);
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            if (cap > (64u << 20)) {
                free(buf);
                fclose(f);
                return dec_fail(KILN_ERR_IO, "%s: larger than 64 MiB", path);
            }
            cap = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "%s: out of memory", path);
            }
            buf = nb;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return dec_fail(KILN_ERR_IO, "%s: read error", path);
    }
    *data = buf;
    *len = n;
    return KILN_OK;
}

kiln_status dec_config_load(const char *path, dec_config *out)
{
    char *json;
    size_t len;
    kiln_status st = read_file(path, &json, &len);
    if (st)
        return st;
    st = dec_config_parse(json, len, out);
    free(json);
    if (st && st != KILN_ERR_IO) {
        char msg[sizeof g_msg];
        snprintf(msg, sizeof msg, "%s", g_msg);
        dec_fail(st, "%s: %s", path, msg);
    }
    return st;
}

/* ---- checkpoint folders ---- */

void dec_checkpoint_close(dec_checkpoint *ck)
{
    for (size_t i = 0; i < ck->n_files; i++)
        kiln_safetensors_close(ck->files[i]);
    ck->n_files = 0;
}

/* Opens the shard name (once) and sets *file to it. tensor: the index entry
 * that names it, for messages (NULL for model.safetensors). */
static kiln_status open_shard(dec_checkpoint *ck, const char *dir, const char *name, const char *tensor,
                              size_t *file)
{
    char path[4096];
    if (!name[0] || strchr(name, '/') || !strcmp(name, "..") || !strcmp(name, "."))
        return dec_fail(KILN_ERR_CONFIG, "%s/model.safetensors.index.json: shard name \"%.100s\" is not a file name",
                        dir, name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    for (size_t i = 0; i < ck->n_files; i++)
        if (!strcmp(kiln_safetensors_label(ck->files[i]), path)) {
            *file = i;
            return KILN_OK;
        }
    if (ck->n_files == DEC_MAX_FILES)
        return dec_fail(KILN_ERR_CONFIG, "%s: more than %d safetensors shards", dir, DEC_MAX_FILES);
    kiln_status st = kiln_safetensors_open(path, &ck->files[ck->n_files]);
    if (st && tensor)
        return dec_fail(st, "%s/model.safetensors.index.json: shard %s (of tensor %.100s) cannot be opened: %s", dir,
                        name, tensor, kiln_errmsg());
    if (st)
        return dec_fail(st, "%s", kiln_errmsg());
    *file = ck->n_files++;
    return KILN_OK;
}

kiln_status dec_checkpoint_open(const char *dir, dec_checkpoint *out)
{
    memset(out, 0, sizeof *out);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    kiln_status st = dec_config_load(path, &out->config);
    if (st)
        return st;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct stat sb;
    if (stat(path, &sb) == 0) {
        size_t file;
        st = open_shard(out, dir, "model.safetensors", NULL, &file);
    } else {
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        char *json;
        size_t len;
        if ((st = read_file(path, &json, &len))) {
            if (stat(path, &sb) == 0)
                return st;
            return dec_fail(KILN_ERR_IO, "%s: neither model.safetensors nor model.safetensors.index.json can be read",
                            dir);
        }
        cJSON *root = cJSON_ParseWithLength(json, len);
        free(json);
        const cJSON *map = root ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
        if (!cJSON_IsObject(map)) {
            cJSON_Delete(root);
            return dec_fail(KILN_ERR_CONFIG, "%s: no weight_map object", path);
        }
        for (const cJSON *e = map->child; e && !st; e = e->next) {
            size_t file;
            if (!cJSON_IsString(e))
                st = dec_fail(KILN_ERR_CONFIG, "%s: weight_map[%.100s] is not a file name", path, e->string);
            else if (!(st = open_shard(out, dir, e->valuestring, e->string, &file)) &&
                     !kiln_safetensors_find(out->files[file], e->string))
                /* The index is what transformers trusts: a tensor it places in
                 * a shard that lacks it is a broken checkpoint, wherever else
                 * the tensor may be. */
                st = dec_fail(KILN_ERR_NOT_FOUND, "%s: weight_map puts tensor %.100s in %s, which does not hold it",
                              path, e->string, e->valuestring);
        }
        cJSON_Delete(root);
    }
    if (!st)
        st = dec_check_weights(&out->config, out->files, out->n_files);
    if (st)
        dec_checkpoint_close(out);
    return st;
}

/* ---- the tensors a config needs ---- */

/* The layer's tensors, W_IN_NORM to W_KN, in the order of wspec_at's names;
 * then a mixture of experts' router, shared expert and experts (one tensor
 * per expert and projection, or the fused two). */
typedef enum { W_EMBED, W_FINAL_NORM, W_LM_HEAD, W_IN_NORM, W_POST_NORM, W_Q, W_K, W_V, W_BQ, W_BK, W_BV, W_O,
               W_GATE, W_UP, W_DOWN, W_QN, W_KN, W_ROUTER, W_SH_GATE, W_SH_UP, W_SH_DOWN, W_SH_SCALE, W_X_GATE,
               W_X_UP, W_X_DOWN, W_X_GATE_UP, W_X_DOWN_ALL } wkind;

typedef struct wspec {
    wkind kind;
    int64_t layer;  /* -1 for the model-level tensors */
    int64_t expert; /* W_X_GATE, W_X_UP, W_X_DOWN: which one */
    char name[128];
    uint32_t rank;
    int64_t dims[3];
} wspec;

/* The files a checkpoint's tensors are looked up in; NULL (random weights):
 * the fused expert layout. */
typedef struct tensor_files {
    kiln_safetensors *const *files;
    size_t n;
} tensor_files;

static const kiln_safetensors_tensor *find(kiln_safetensors *const *files, size_t n, const char *name,
                                           size_t *file)
{
    for (size_t i = 0; i < n; i++) {
        const kiln_safetensors_tensor *t = kiln_safetensors_find(files[i], name);
        if (t) {
            *file = i;
            return t;
        }
    }
    return NULL;
}

/* Whether layer l's experts are transformers 5's fused tensors. */
static int fused_experts(const tensor_files *tf, int64_t l)
{
    if (!tf)
        return 1;
    char name[128];
    size_t f;
    snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.gate_up_proj", (long long)l);
    return find(tf->files, tf->n, name, &f) != NULL;
}

/* Tensors before the experts in a layer: the 14 of layer_names, the router and the shared expert's 4. */
enum { PER_LAYER_FIXED = 19 };

/* The i-th tensor the config may need: 1, or -1 when this model has no such
 * tensor (biases; q/k norms but for Qwen3; the dense MLP of a mixture of
 * experts and the experts of a dense model; the layout not taken), or 0 past
 * the end. */
static int wspec_at(const dec_config *c, const tensor_files *tf, size_t i, wspec *w)
{
    const kiln_model_config *b = &c->base;
    const int64_t H = b->hidden_size, I = b->intermediate_size, V = b->vocab_size, E = b->num_experts,
                  XI = b->moe_intermediate_size, SI = c->shared_inter;
    const int64_t Q = b->num_attention_heads * b->head_dim, KV = b->num_key_value_heads * b->head_dim;
    static const char *const layer_names[] = {
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
        "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"};
    const size_t head = c->base.tie_word_embeddings ? 2 : 3, per = PER_LAYER_FIXED + 3 * (size_t)E;
    memset(w, 0, sizeof *w);
    w->layer = -1;
    if (i < head) {
        static const wkind k[3] = {W_EMBED, W_FINAL_NORM, W_LM_HEAD};
        static const char *const n[3] = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"};
        w->kind = k[i];
        snprintf(w->name, sizeof w->name, "%s", n[i]);
        w->rank = k[i] == W_FINAL_NORM ? 1 : 2;
        w->dims[0] = k[i] == W_FINAL_NORM ? H : V;
        w->dims[1] = H;
        return 1;
    }
    i -= head;
    if (i >= (size_t)c->layers * per)
        return 0;
    const size_t j = i % per;
    const int64_t l = (int64_t)(i / per);
    w->layer = l;
    if (j < 14) {
        w->kind = (wkind)(W_IN_NORM + j);
        if (!c->qkv_bias && (w->kind == W_BQ || w->kind == W_BK || w->kind == W_BV))
            return -1; /* not in this model: the caller goes on to i + 1 */
        if (!b->qk_norm && (w->kind == W_QN || w->kind == W_KN))
            return -1;
        if (E && (w->kind == W_GATE || w->kind == W_UP || w->kind == W_DOWN))
            return -1;
        snprintf(w->name, sizeof w->name, "model.layers.%lld.%s", (long long)l, layer_names[j]);
        const int64_t D = b->head_dim;
        const int64_t shapes[14][2] = {{H, 0},  {H, 0}, {Q, H}, {KV, H}, {KV, H}, {Q, 0}, {KV, 0},
                                       {KV, 0}, {H, Q}, {I, H}, {I, H},  {H, I},  {D, 0}, {D, 0}};
        w->dims[0] = shapes[j][0];
        w->dims[1] = shapes[j][1];
        w->rank = shapes[j][1] ? 2 : 1;
        return 1;
    }
    if (!E)
        return -1;
    const int fused = fused_experts(tf, l);
    /* Mixtral's per-expert checkpoint keeps its original module names;
     * transformers 5's modules (the fused layout) are mlp.gate and mlp.experts. */
    const int mixtral = !strcmp(c->model_type, "mixtral") && !fused;
    const char *block = mixtral ? "block_sparse_moe" : "mlp";
    char *nm = w->name;
    const size_t cap = sizeof w->name;
    w->rank = 2;
    if (j == 14) {
        w->kind = W_ROUTER;
        snprintf(nm, cap, "model.layers.%lld.%s.gate.weight", (long long)l, block);
        w->dims[0] = E;
        w->dims[1] = H;
        return 1;
    }
    if (j < PER_LAYER_FIXED) {
        if (!SI)
            return -1;
        static const char *const sh[4] = {"shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                                          "shared_expert.down_proj.weight", "shared_expert_gate.weight"};
        const int64_t shapes[4][2] = {{SI, H}, {SI, H}, {H, SI}, {1, H}};
        const size_t k = j - 15;
        w->kind = (wkind)(W_SH_GATE + k);
        snprintf(nm, cap, "model.layers.%lld.mlp.%s", (long long)l, sh[k]);
        w->dims[0] = shapes[k][0];
        w->dims[1] = shapes[k][1];
        return 1;
    }
    const size_t x = j - PER_LAYER_FIXED;
    if (fused) {
        if (x >= 2)
            return -1;
        w->kind = x ? W_X_DOWN_ALL : W_X_GATE_UP;
        snprintf(nm, cap, "model.layers.%lld.mlp.experts.%s", (long long)l, x ? "down_proj" : "gate_up_proj");
        w->rank = 3;
        w->dims[0] = E;
        w->dims[1] = x ? H : 2 * XI;
        w->dims[2] = x ? XI : H;
        return 1;
    }
    static const char *const proj[2][3] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};
    w->kind = (wkind)(W_X_GATE + x % 3);
    w->expert = (int64_t)(x / 3);
    snprintf(nm, cap, "model.layers.%lld.%s.experts.%lld.%s.weight", (long long)l, block, (long long)w->expert,
             proj[mixtral][x % 3]);
    w->dims[0] = x % 3 == 2 ? H : XI;
    w->dims[1] = x % 3 == 2 ? XI : H;
    return 1;
}

static kiln_status expect(const dec_config *c, kiln_safetensors *const *files, size_t n, const wspec *w,
                          const kiln_safetensors_tensor **out)
{
    size_t f = 0;
    if (!find(files, n, w->name, &f)) {
        char also[160] = "";
        if (w->kind == W_X_GATE || w->kind == W_X_UP || w->kind == W_X_DOWN)
            snprintf(also, sizeof also, "; nor is the fused model.layers.%lld.mlp.experts.gate_up_proj there",
                     (long long)w->layer);
        return dec_fail(KILN_ERR_NOT_FOUND, "%s: tensor %s is missing (needed by %s, %lld layers%s%s)",
                        n ? kiln_safetensors_label(files[0]) : "checkpoint", w->name, c->model_type,
                        (long long)c->layers, c->base.tie_word_embeddings ? ", tied embeddings" : "", also);
    }
    kiln_status st = kiln_safetensors_expect(files[f], w->name, c->base.dtype, w->rank, w->dims, out);
    if (st)
        return dec_fail(st, "%s", kiln_errmsg());
    return KILN_OK;
}

kiln_status dec_check_weights(const dec_config *c, kiln_safetensors *const *files, size_t n_files)
{
    const tensor_files tf = {files, n_files};
    wspec w;
    int r;
    for (size_t i = 0; (r = wspec_at(c, &tf, i, &w)); i++) {
        if (r < 0)
            continue;
        const kiln_safetensors_tensor *t;
        kiln_status st = expect(c, files, n_files, &w, &t);
        if (st)
            return st;
    }
    return KILN_OK;
}

/* ---- device weights ---- */

static kiln_buffer **slot_of(dec_model *m, const wspec *w)
{
    dec_layer *L = w->layer >= 0 ? &m->layer[w->layer] : NULL;
    switch (w->kind) {
    case W_EMBED: return &m->embed;
    case W_FINAL_NORM: return &m->final_norm;
    case W_LM_HEAD: return &m->lm_head;
    case W_IN_NORM: return &L->in_norm;
    case W_POST_NORM: return &L->post_norm;
    case W_Q:
    case W_K:
    case W_V: return &L->wqkv;
    case W_BQ:
    case W_BK:
    case W_BV: return &L->bqkv;
    case W_O: return &L->wo;
    case W_GATE:
    case W_UP: return &L->w_gate_up;
    case W_DOWN: return &L->w_down;
    case W_QN: return &L->q_norm;
    case W_KN: return &L->k_norm;
    case W_ROUTER: return &L->router;
    case W_SH_GATE:
    case W_SH_UP: return &L->sh_gate_up;
    case W_SH_DOWN: return &L->sh_down;
    case W_SH_SCALE: return &L->sh_gate;
    case W_X_GATE:
    case W_X_UP:
    case W_X_GATE_UP: return &L->x_gate_up;
    case W_X_DOWN:
    case W_X_DOWN_ALL: return &L->x_down;
    }
    return NULL;
}

/* Bytes of w's buffer, and where w lies in it: gate and up share one, q, k
 * and v (weights, and biases) share one, in that order, and so do the
 * experts, one after another (each expert's gate rows, then its up rows). */
static void placement(const dec_config *c, const wspec *w, size_t *buffer_bytes, size_t *offset, size_t *bytes)
{
    size_t n = 2;
    for (uint32_t d = 0; d < w->rank; d++)
        n *= (size_t)w->dims[d];
    const size_t row = (size_t)(w->rank == 2 ? w->dims[1] : 1) * 2; /* bytes per output row */
    const size_t q = (size_t)(c->base.num_attention_heads * c->base.head_dim) * row,
                 kv = (size_t)(c->base.num_key_value_heads * c->base.head_dim) * row;
    const size_t E = (size_t)c->base.num_experts, x = (size_t)w->expert;
    *bytes = n;
    *offset = 0;
    *buffer_bytes = n;
    switch (w->kind) {
    case W_GATE: case W_SH_GATE: *buffer_bytes = 2 * n; break;
    case W_UP: case W_SH_UP: *offset = n; *buffer_bytes = 2 * n; break;
    case W_Q: case W_BQ: *buffer_bytes = q + 2 * kv; break;
    case W_K: case W_BK: *offset = q; *buffer_bytes = q + 2 * kv; break;
    case W_V: case W_BV: *offset = q + kv; *buffer_bytes = q + 2 * kv; break;
    case W_X_GATE: *offset = x * 2 * n; *buffer_bytes = E * 2 * n; break;
    case W_X_UP: *offset = x * 2 * n + n; *buffer_bytes = E * 2 * n; break;
    case W_X_DOWN: *offset = x * n; *buffer_bytes = E * n; break;
    default: break;
    }
}

static kiln_status model_new(kiln_runtime *rt, const dec_config *c, dec_model **out)
{
    dec_model *m = calloc(1, sizeof *m);
    if (!m || !(m->layer = calloc((size_t)c->layers, sizeof *m->layer))) {
        free(m);
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    }
    m->config = *c;
    m->rt = rt;
    *out = m;
    return KILN_OK;
}

/* Allocates w's buffer when it has none yet. */
static kiln_status ensure_buffer(dec_model *m, const wspec *w, kiln_buffer **b)
{
    size_t total, off, bytes;
    placement(&m->config, w, &total, &off, &bytes);
    (void)off;
    kiln_buffer **slot = slot_of(m, w);
    if (!*slot) {
        kiln_status st = kiln_buffer_create(m->rt, total, 256, slot);
        if (st) {
            char what[200];
            snprintf(what, sizeof what, "allocating %zu bytes for %s", total, w->name);
            return dec_kfail(st, what);
        }
        if (w->kind != W_EMBED)
            m->weight_bytes += total;
    }
    *b = *slot;
    return KILN_OK;
}

static void finish_tied(dec_model *m)
{
    if (m->config.base.tie_word_embeddings) {
        m->lm_head = m->embed;
        m->weight_bytes += kiln_buffer_size(m->embed);
    }
}

kiln_status dec_model_load(kiln_runtime *rt, const dec_checkpoint *ck, dec_model **out)
{
    *out = NULL;
    kiln_status st = dec_check_weights(&ck->config, ck->files, ck->n_files);
    if (st)
        return st;
    dec_model *m = NULL;
    if ((st = model_new(rt, &ck->config, &m)))
        return st;
    const tensor_files tf = {ck->files, ck->n_files};
    wspec w;
    int r;
    for (size_t i = 0; (r = wspec_at(&ck->config, &tf, i, &w)); i++) {
        if (r < 0)
            continue;
        const kiln_safetensors_tensor *t;
        kiln_buffer *b = NULL;
        size_t total, off, bytes;
        if ((st = expect(&ck->config, ck->files, ck->n_files, &w, &t)) || (st = ensure_buffer(m, &w, &b)))
            goto fail;
        placement(&m->config, &w, &total, &off, &bytes);
        if ((st = kiln_buffer_upload(b, off, t->data, bytes))) {
            dec_kfail(st, w.name);
            goto fail;
        }
        m->uploaded_bytes += bytes;
    }
    finish_tied(m);
    *out = m;
    return KILN_OK;
fail:
    dec_model_free(m);
    return st;
}

kiln_status dec_model_random(kiln_runtime *rt, kiln_stream *s, const dec_config *c, const uint16_t *chunk,
                             size_t chunk_halves, dec_model **out)
{
    *out = NULL;
    dec_model *m = NULL;
    kiln_status st = model_new(rt, c, &m);
    if (st)
        return st;
    const size_t chunk_bytes = chunk_halves * 2;
    kiln_buffer *src = NULL;
    if ((st = kiln_buffer_create(rt, chunk_bytes, 256, &src)) || (st = kiln_buffer_upload(src, 0, chunk, chunk_bytes))) {
        dec_kfail(st, "the random chunk");
        goto fail;
    }
    wspec w;
    int r;
    for (size_t i = 0; (r = wspec_at(c, NULL, i, &w)); i++) {
        if (r < 0)
            continue;
        kiln_buffer *b = NULL;
        size_t total, off, bytes;
        if ((st = ensure_buffer(m, &w, &b)))
            goto fail;
        placement(c, &w, &total, &off, &bytes);
        kiln_command *cmds[64];
        size_t n = 0;
        for (size_t at = 0; at < bytes; at += chunk_bytes) {
            size_t len = bytes - at < chunk_bytes ? bytes - at : chunk_bytes;
            kiln_region from = {src, 0, len}, to = {b, off + at, off + at + len};
            if ((st = kiln_command_copy(rt, &from, &to, &cmds[n]))) {
                dec_kfail(st, "copy command");
                break;
            }
            if (++n == 64 || at + len >= bytes) {
                st = kiln_stream_submit(s, cmds, n, NULL, NULL);
                for (size_t k = 0; k < n; k++)
                    kiln_command_release(cmds[k]);
                n = 0;
                if (st) {
                    dec_kfail(st, "filling weights");
                    break;
                }
            }
        }
        for (size_t k = 0; k < n; k++)
            kiln_command_release(cmds[k]);
        if (st)
            goto fail;
        m->uploaded_bytes += bytes;
    }
    if ((st = kiln_stream_synchronize(s))) {
        dec_kfail(st, "filling weights");
        goto fail;
    }
    kiln_buffer_destroy(src);
    finish_tied(m);
    *out = m;
    return KILN_OK;
fail:
    kiln_stream_synchronize(s);
    kiln_buffer_destroy(src);
    dec_model_free(m);
    return st;
}

void dec_model_free(dec_model *m)
{
    if (!m)
        return;
    for (int64_t i = 0; i < m->config.layers; i++) {
        dec_layer *L = &m->layer[i];
        kiln_buffer *all[] = {L->in_norm, L->post_norm, L->wqkv,   L->bqkv,      L->wo,
                              L->w_gate_up, L->w_down, L->q_norm, L->k_norm,    L->router,
                              L->x_gate_up, L->x_down, L->sh_gate_up, L->sh_down, L->sh_gate};
        for (size_t k = 0; k < sizeof all / sizeof all[0]; k++)
            kiln_buffer_destroy(all[k]);
    }
    if (m->lm_head != m->embed)
        kiln_buffer_destroy(m->lm_head);
    kiln_buffer_destroy(m->embed);
    kiln_buffer_destroy(m->final_norm);
    free(m->layer);
    free(m);
}
