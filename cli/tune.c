/* kiln prewarm --tune: time the model's dense products on this GPU for each
 * batch bucket, so that the choices land in the database as tuning rows and
 * a serving process times nothing. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static uint64_t tuning_rows(kiln_cache *cache)
{
    kiln_cache_stats s;
    return kiln_cache_get_stats(cache, &s) == KILN_OK ? s.tuning_rows : 0;
}

/* A zeroed device buffer of bytes (at least 256). */
static kiln_status zeroed(kiln_runtime *rt, size_t bytes, kiln_buffer **out)
{
    kiln_status st = kiln_buffer_create(rt, bytes < 256 ? 256 : bytes, 256, out);
    if (st == KILN_OK && (st = kiln_buffer_fill(*out, 0, 0, kiln_buffer_size(*out))) != KILN_OK) {
        kiln_buffer_destroy(*out);
        *out = NULL;
    }
    return st;
}

static kiln_tensor t2(kiln_buffer *b, kiln_dtype dt, int64_t d0, int64_t d1)
{
    kiln_tensor t = {.buffer = b, .dtype = dt, .rank = 2, .dims = {d0, d1}};
    return t;
}

/* Encodes (and releases, unsubmitted) the products of one decoder layer at
 * tokens rows: encoding a product picks its algorithm, timing it when the
 * shape calls for that. */
static kiln_status tune_bucket(kiln_jit *jit, kiln_runtime *rt, const kiln_model_config *m, int64_t tokens,
                               kiln_buffer *const w[4], size_t *products)
{
    const kiln_dtype dt = m->dtype;
    const int64_t H = m->hidden_size, I = m->intermediate_size, AD = m->num_attention_heads * m->head_dim,
                  QKV = (m->num_attention_heads + 2 * m->num_key_value_heads) * m->head_dim;
    const int64_t sizes[] = {QKV, AD, 2 * I};
    int64_t widest = H;
    for (int i = 0; i < 3; i++)
        widest = sizes[i] > widest ? sizes[i] : widest;
    kiln_buffer *x = NULL, *out = NULL, *res = NULL, *norm = NULL, *ws = NULL;
    size_t ws_bytes = 0, need;
    kiln_status st;
    if ((st = kiln_op_dense_linear_workspace(tokens, H, QKV, &need)))
        return st;
    ws_bytes = need;
    if ((st = kiln_op_dense_linear_norm_workspace(tokens, AD, H, &need)))
        return st;
    ws_bytes = need > ws_bytes ? need : ws_bytes;
    if ((st = kiln_op_dense_linear_norm_workspace(tokens, I, H, &need)))
        return st;
    ws_bytes = need > ws_bytes ? need : ws_bytes;
    if ((st = kiln_op_dense_swiglu_workspace(tokens, H, I, &need)))
        return st;
    ws_bytes = need > ws_bytes ? need : ws_bytes;
    const size_t act_bytes = (size_t)(tokens * widest) * 2;
    if ((st = zeroed(rt, act_bytes, &x)) || (st = zeroed(rt, act_bytes, &out)) ||
        (st = zeroed(rt, (size_t)(tokens * H) * 2, &res)) || (st = zeroed(rt, (size_t)H * 2, &norm)) ||
        (st = zeroed(rt, ws_bytes, &ws)))
        goto out;
    kiln_region wr = {ws, 0, ws_bytes};
    kiln_command *cmd = NULL;
    /* q, k and v in one product; the attention output into the residual and
     * norm; gate and up in one product; down into the residual and norm. */
    kiln_tensor xin = t2(x, dt, tokens, H), wqkv = t2(w[0], dt, QKV, H), oqkv = t2(out, dt, tokens, QKV);
    if ((st = kiln_op_dense_linear_encode(jit, &xin, &wqkv, NULL, &oqkv, &wr, &cmd)))
        goto out;
    kiln_command_release(cmd);
    kiln_tensor xat = t2(x, dt, tokens, AD), wo = t2(w[1], dt, H, AD), r = t2(res, dt, tokens, H),
                on = t2(out, dt, tokens, H);
    kiln_tensor nw = {.buffer = norm, .dtype = dt, .rank = 1, .dims = {H}};
    if ((st = kiln_op_dense_linear_norm_encode(jit, &xat, &wo, &r, &nw, 1e-5f, &on, &wr, &cmd)))
        goto out;
    kiln_command_release(cmd);
    kiln_tensor gu = t2(w[2], dt, 2 * I, H), act = t2(out, dt, tokens, I);
    if ((st = kiln_op_dense_swiglu_encode(jit, &xin, &gu, &act, &wr, &cmd)))
        goto out;
    kiln_command_release(cmd);
    kiln_tensor xi = t2(x, dt, tokens, I), wd = t2(w[3], dt, H, I);
    if ((st = kiln_op_dense_linear_norm_encode(jit, &xi, &wd, &r, &nw, 1e-5f, &on, &wr, &cmd)))
        goto out;
    kiln_command_release(cmd);
    *products += 4;
    st = kiln_runtime_synchronize(rt);
out:
    kiln_buffer_destroy(x);
    kiln_buffer_destroy(out);
    kiln_buffer_destroy(res);
    kiln_buffer_destroy(norm);
    kiln_buffer_destroy(ws);
    return st;
}

typedef struct tuning_keys {
    char **kinds, **keys;
    size_t n, cap;
    int oom;
} tuning_keys;

static int list_key(void *user, const kiln_tuning_info *info)
{
    tuning_keys *t = user;
    if (t->n == t->cap) {
        size_t ncap = t->cap ? 2 * t->cap : 64;
        char **k = realloc(t->kinds, ncap * sizeof *k), **y = k ? realloc(t->keys, ncap * sizeof *y) : NULL;
        if (k)
            t->kinds = k;
        if (!y) {
            t->oom = 1;
            return 1;
        }
        t->keys = y;
        t->cap = ncap;
    }
    t->kinds[t->n] = strdup(info->kind);
    t->keys[t->n] = strdup(info->key);
    t->n++;
    t->oom |= !t->kinds[t->n - 1] || !t->keys[t->n - 1];
    return t->oom;
}

int cli_copy_tuning(const char *cmd, kiln_cache *from, kiln_cache *to)
{
    tuning_keys t = {0};
    uint64_t copied = 0, skipped = 0;
    int rc = CLI_EXIT_OK;
    if (kiln_cache_tuning_foreach(from, list_key, &t) != KILN_OK)
        rc = cli_fail(cmd, "%s", kiln_errmsg());
    else if (t.oom)
        rc = cli_fail(cmd, "out of memory");
    /* Each row is loaded as a process would load it (verified), then stored. */
    for (size_t i = 0; i < t.n && !rc; i++) {
        void *payload = NULL;
        size_t size = 0;
        int found = 0;
        kiln_status st = kiln_cache_tuning_get(from, t.kinds[i], t.keys[i], &payload, &size, &found);
        if (st == KILN_ERR_INVALID_ARGUMENT) {
            skipped++; /* a row whose kind or key is no text a row can have */
        } else if (st != KILN_OK) {
            rc = cli_fail(cmd, "%s", kiln_errmsg());
        } else if (!found) {
            skipped++;
        } else if (kiln_cache_tuning_put(to, t.kinds[i], t.keys[i], payload, size) != KILN_OK) {
            rc = cli_fail(cmd, "%s", kiln_errmsg());
        } else {
            copied++;
        }
        kiln_free(payload);
    }
    for (size_t i = 0; i < t.n; i++) {
        free(t.kinds[i]);
        free(t.keys[i]);
    }
    free(t.kinds);
    free(t.keys);
    if (!rc)
        printf("tuning from %s: %" PRIu64 " copied, %" PRIu64 " skipped\n", kiln_cache_path(from), copied, skipped);
    return rc;
}

int cli_tune_check_gpu(const char *cmd)
{
    const char *why = NULL;
    if (!kiln_driver_available(&why))
        return cli_fail(cmd, "--tune times products on a GPU, and there is none here: %s",
                        why && *why ? why : "no CUDA driver");
    return CLI_EXIT_OK;
}

int cli_tune_model(const char *cmd, const kiln_model_config *m, const int64_t *buckets, size_t n_buckets,
                   kiln_cache *cache)
{
    kiln_runtime *rt = NULL;
    kiln_jit *jit = NULL;
    kiln_buffer *w[4] = {NULL};
    int rc = CLI_EXIT_OK;
    if ((rc = cli_tune_check_gpu(cmd)))
        return rc;
    if (kiln_runtime_create(NULL, &rt) != KILN_OK)
        return cli_fail(cmd, "--tune: %s", kiln_errmsg());
    kiln_jit_options jo = {.size = sizeof jo, .cache = cache, .runtime = rt};
    if (kiln_jit_create(&jo, &jit) != KILN_OK) {
        rc = cli_fail(cmd, "--tune: %s", kiln_errmsg());
        goto out;
    }
    const int64_t H = m->hidden_size, I = m->intermediate_size, AD = m->num_attention_heads * m->head_dim,
                  QKV = (m->num_attention_heads + 2 * m->num_key_value_heads) * m->head_dim;
    const int64_t rows[4] = {QKV, H, 2 * I, H}, cols[4] = {H, AD, H, I};
    for (int i = 0; i < 4; i++)
        if (zeroed(rt, (size_t)(rows[i] * cols[i]) * 2, &w[i]) != KILN_OK) {
            rc = cli_fail(cmd, "--tune: weights of %lld x %lld: %s", (long long)rows[i], (long long)cols[i],
                          kiln_errmsg());
            goto out;
        }
    const uint64_t before = tuning_rows(cache);
    size_t products = 0;
    for (size_t b = 0; b < n_buckets; b++) {
        if (tune_bucket(jit, rt, m, buckets[b], w, &products) != KILN_OK) {
            rc = cli_fail(cmd, "--tune: %lld tokens: %s", (long long)buckets[b], kiln_errmsg());
            goto out;
        }
        printf("tune %lld tokens: 4 products\n", (long long)buckets[b]);
    }
    const uint64_t after = tuning_rows(cache);
    printf("tune: model %s, %zu batch buckets, %zu products, %" PRIu64 " tuning rows (%" PRIu64
           " new), database %s\n",
           m->name, n_buckets, products, after, after - before, kiln_cache_path(cache));
out:
    for (int i = 0; i < 4; i++)
        kiln_buffer_destroy(w[i]);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);
    return rc;
}
