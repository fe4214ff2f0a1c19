/* Writes safetensors files and tiny Llama / Qwen2 checkpoints for the
 * safetensors and decoder tests. Not API. */
#ifndef KILN_TESTS_ST_WRITER_H
#define KILN_TESTS_ST_WRITER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kiln/status.h"

/* One tensor to write. dtype NULL: "F16". With explicit offsets (has_offsets)
 * the header says begin/end as given, whatever the shape. */
typedef struct st_entry {
    char name[128];
    const char *dtype;
    int rank;
    long long dims[4];
    int has_offsets;
    unsigned long long begin, end;
} st_entry;

static inline size_t st_entry_bytes(const st_entry *e)
{
    size_t n = (e->dtype && (!strcmp(e->dtype, "F32") || !strcmp(e->dtype, "U32"))) ? 4 : 2;
    for (int i = 0; i < e->rank; i++)
        n *= (size_t)e->dims[i];
    return n;
}

/* A whole file in memory: 8-byte length, header padded to 8 with spaces,
 * then data (each tensor's bytes from fill(), or zeros). *size is set. */
static inline uint8_t *st_build(const st_entry *e, size_t n, const char *metadata,
                                void (*fill)(void *user, size_t index, void *dst, size_t bytes), void *user,
                                size_t *size)
{
    size_t cap = 256 + n * 256 + (metadata ? strlen(metadata) : 0), len = 0, off = 0, data = 0;
    char *h = malloc(cap);
    len += (size_t)snprintf(h + len, cap - len, "{");
    if (metadata)
        len += (size_t)snprintf(h + len, cap - len, "\"__metadata__\":%s%s", metadata, n ? "," : "");
    for (size_t i = 0; i < n; i++) {
        size_t b = st_entry_bytes(&e[i]);
        unsigned long long begin = e[i].has_offsets ? e[i].begin : off, end = e[i].has_offsets ? e[i].end : off + b;
        len += (size_t)snprintf(h + len, cap - len, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", i ? "," : "", e[i].name,
                                e[i].dtype ? e[i].dtype : "F16");
        for (int d = 0; d < e[i].rank; d++)
            len += (size_t)snprintf(h + len, cap - len, "%s%lld", d ? "," : "", e[i].dims[d]);
        len += (size_t)snprintf(h + len, cap - len, "],\"data_offsets\":[%llu,%llu]}", begin, end);
        off += b;
        if (end > data)
            data = end;
    }
    if (off > data)
        data = off;
    len += (size_t)snprintf(h + len, cap - len, "}");
    while (len % 8)
        h[len++] = ' ';
    uint8_t *f = calloc(1, 8 + len + data + 1);
    for (int i = 0; i < 8; i++)
        f[i] = (uint8_t)((uint64_t)len >> (8 * i));
    memcpy(f + 8, h, len);
    free(h);
    off = 0;
    for (size_t i = 0; i < n; i++) {
        size_t b = st_entry_bytes(&e[i]);
        if (fill && !e[i].has_offsets)
            fill(user, i, f + 8 + len + off, b);
        off += b;
    }
    *size = 8 + len + data;
    return f;
}

/* Runs fn(arg) in a forked child that SIGALRM ends after seconds: 0 when fn
 * returned 0, else nonzero. A call that would block forever (a FIFO opened
 * for reading) fails the test instead of hanging it. */
static inline int st_run_bounded(int (*fn)(void *), void *arg, unsigned seconds)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        alarm(seconds);
        _exit(fn(arg) ? 1 : 0);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid)
        return -1;
    if (WIFSIGNALED(status))
        fprintf(stderr, "the call was ended by signal %d (%s)\n", WTERMSIG(status),
                WTERMSIG(status) == SIGALRM ? "it blocked" : "it crashed");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

typedef struct st_refusal {
    kiln_status (*call)(const char *path);
    const char *(*message)(void);
    const char *path;
} st_refusal;

static inline int st_refused_as_not_regular(void *arg)
{
    const st_refusal *r = arg;
    kiln_status st = r->call(r->path);
    const char *msg = r->message();
    if (st == KILN_ERR_IO && strstr(msg, r->path) && strstr(msg, "not a regular file"))
        return 0;
    fprintf(stderr, "status %d: %s\n", (int)st, msg);
    return 1;
}

/* 0 when call(path), in a child bounded to 5 s, fails with KILN_ERR_IO and
 * a message (from message()) naming path as not a regular file. */
static inline int st_expect_not_regular(kiln_status (*call)(const char *), const char *(*message)(void),
                                        const char *path)
{
    st_refusal r = {call, message, path};
    return st_run_bounded(st_refused_as_not_regular, &r, 5);
}

/* The same for a FIFO made as dir/name (replacing what is there). */
static inline int st_expect_fifo_refused(kiln_status (*call)(const char *), const char *(*message)(void),
                                         const char *dir, const char *name)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    remove(path);
    if (mkfifo(path, 0600) != 0)
        return -1;
    return st_expect_not_regular(call, message, path);
}

static inline int st_write_file(const char *path, const void *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return 0;
    int ok = fwrite(data, 1, size, f) == size;
    return fclose(f) == 0 && ok;
}

/* ---- tiny checkpoints ---- */

typedef struct tiny_model {
    const char *type; /* "llama", "qwen2" (q/k/v biases) or "qwen3" (q/k norms) */
    int tie;
    long long vocab, hidden, inter, layers, heads, kv_heads, head_dim;
    double theta;
    float scale;      /* weights uniform in [-scale, scale]; norms 1 */
    uint64_t seed;
} tiny_model;

/* The tensors of a tiny model, in the order a checkpoint lists them. */
static inline size_t tiny_entries(const tiny_model *m, st_entry *e, size_t cap)
{
    size_t n = 0;
    const long long H = m->hidden, Q = m->heads * m->head_dim, KV = m->kv_heads * m->head_dim, I = m->inter;
#define TINY_ADD(nm, r, d0, d1)                                                                                       \
    do {                                                                                                               \
        if (n < cap) {                                                                                                 \
            memset(&e[n], 0, sizeof e[n]);                                                                             \
            snprintf(e[n].name, sizeof e[n].name, "%s", nm);                                                           \
            e[n].rank = r;                                                                                             \
            e[n].dims[0] = d0;                                                                                         \
            e[n].dims[1] = d1;                                                                                         \
        }                                                                                                              \
        n++;                                                                                                           \
    } while (0)
    TINY_ADD("model.embed_tokens.weight", 2, m->vocab, H);
    TINY_ADD("model.norm.weight", 1, H, 0);
    if (!m->tie)
        TINY_ADD("lm_head.weight", 2, m->vocab, H);
    for (long long l = 0; l < m->layers; l++) {
        char nm[128];
#define TINY_LAYER(suffix, r, d0, d1)                                                                                 \
    do {                                                                                                               \
        snprintf(nm, sizeof nm, "model.layers.%lld.%s", l, suffix);                                                    \
        TINY_ADD(nm, r, d0, d1);                                                                                       \
    } while (0)
        TINY_LAYER("input_layernorm.weight", 1, H, 0);
        TINY_LAYER("post_attention_layernorm.weight", 1, H, 0);
        TINY_LAYER("self_attn.q_proj.weight", 2, Q, H);
        TINY_LAYER("self_attn.k_proj.weight", 2, KV, H);
        TINY_LAYER("self_attn.v_proj.weight", 2, KV, H);
        if (!strcmp(m->type, "qwen2")) {
            TINY_LAYER("self_attn.q_proj.bias", 1, Q, 0);
            TINY_LAYER("self_attn.k_proj.bias", 1, KV, 0);
            TINY_LAYER("self_attn.v_proj.bias", 1, KV, 0);
        }
        if (!strcmp(m->type, "qwen3")) {
            TINY_LAYER("self_attn.q_norm.weight", 1, m->head_dim, 0);
            TINY_LAYER("self_attn.k_norm.weight", 1, m->head_dim, 0);
        }
        TINY_LAYER("self_attn.o_proj.weight", 2, H, Q);
        TINY_LAYER("mlp.gate_proj.weight", 2, I, H);
        TINY_LAYER("mlp.up_proj.weight", 2, I, H);
        TINY_LAYER("mlp.down_proj.weight", 2, H, I);
#undef TINY_LAYER
    }
#undef TINY_ADD
    return n;
}

static inline uint16_t tiny_f2h(float f)
{
    /* Values here are small: normal f16 range or zero. */
    union { float f; uint32_t u; } x = {f};
    uint32_t sign = (x.u >> 16) & 0x8000;
    int e = (int)((x.u >> 23) & 0xff) - 127 + 15;
    if (e <= 0)
        return (uint16_t)sign;
    uint32_t m = x.u & 0x7fffff, h = ((uint32_t)e << 10) | (m >> 13);
    if ((m & 0x1fff) > 0x1000 || ((m & 0x1fff) == 0x1000 && (h & 1)))
        h++;
    return (uint16_t)(sign | h);
}

typedef struct tiny_fill_ctx {
    const tiny_model *m;
    const st_entry *e;
    uint64_t s;
} tiny_fill_ctx;

static inline void tiny_fill(void *user, size_t index, void *dst, size_t bytes)
{
    tiny_fill_ctx *c = user;
    uint16_t *h = dst;
    int norm = strstr(c->e[index].name, "norm") != NULL;
    for (size_t i = 0; i < bytes / 2; i++) {
        c->s ^= c->s >> 12;
        c->s ^= c->s << 25;
        c->s ^= c->s >> 27;
        float u = (float)((c->s * 2685821657736338717ull) >> 40) / 16777216.0f * 2.0f - 1.0f;
        h[i] = norm ? tiny_f2h(1.0f + 0.1f * u) : tiny_f2h(u * c->m->scale);
    }
}

static inline const char *tiny_config_json(const tiny_model *m, char *buf, size_t cap)
{
    snprintf(buf, cap,
             "{\"architectures\":[\"%s\"],\"model_type\":\"%s\",\"vocab_size\":%lld,\"hidden_size\":%lld,"
             "\"intermediate_size\":%lld,\"num_hidden_layers\":%lld,\"num_attention_heads\":%lld,"
             "\"num_key_value_heads\":%lld,\"head_dim\":%lld,\"rms_norm_eps\":1e-06,"
             "\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":%g},\"tie_word_embeddings\":%s,"
             "\"hidden_act\":\"silu\",\"eos_token_id\":2,\"bos_token_id\":1,\"dtype\":\"float16\"}",
             !strcmp(m->type, "qwen2")   ? "Qwen2ForCausalLM"
             : !strcmp(m->type, "qwen3") ? "Qwen3ForCausalLM"
                                         : "LlamaForCausalLM",
             m->type, m->vocab, m->hidden,
             m->inter, m->layers, m->heads, m->kv_heads, m->head_dim, m->theta, m->tie ? "true" : "false");
    return buf;
}

/* Writes dir/config.json and dir/model.safetensors; 1 on success. */
static inline int tiny_write(const tiny_model *m, const char *dir)
{
    st_entry e[512];
    size_t n = tiny_entries(m, e, 512), size;
    if (n > 512)
        return 0;
    tiny_fill_ctx c = {m, e, m->seed ? m->seed : 88172645463325252ull};
    uint8_t *f = st_build(e, n, "{\"format\":\"pt\"}", tiny_fill, &c, &size);
    char path[1024], json[2048];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    int ok = st_write_file(path, f, size);
    free(f);
    tiny_config_json(m, json, sizeof json);
    snprintf(path, sizeof path, "%s/config.json", dir);
    return ok && st_write_file(path, json, strlen(json));
}

#endif
