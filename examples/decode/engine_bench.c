/* The engine's benchmarks: decode steps at a context, prefill steps of a
 * shape, each with an eager breakdown by kind of command, and the model
 * FLOPs of a prefill. */
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "engine_int.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The decode step of batch participants at context: its commands (encoded
 * now or before) and the participants' ids, positions, lengths and rows. */
static kiln_status bench_decode_setup(dec_engine *e, uint32_t batch, uint32_t context, int steps, dec_stats *stats,
                                      const step_cmds **c)
{
    if (!batch || batch > e->o.max_participants || !context || context > e->o.max_seq_tokens || steps < 1)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "bench: batch %u (1..%u), context %u (1..%u), steps %d", batch,
                        e->o.max_participants, context, e->o.max_seq_tokens, steps);
    kiln_status st = dec__decode_cmds(e, batch, stats, c);
    if (st)
        return st;
    for (uint32_t j = 0; j < batch; j++) {
        e->ids[j] = (j * 7919u + 1) % (uint32_t)e->V;
        e->pos[j] = context - 1;
        e->lens[j] = context;
        e->spans[2 * j] = j;
        e->spans[2 * j + 1] = 1;
        dec__set_rows(e, j, j);
    }
    return KILN_OK;
}

kiln_status dec_bench_steps(dec_engine *e, uint32_t batch, uint32_t context, int warmup, int steps,
                            double *device_ms, double *wall_ms, uint64_t *replayed_commands)
{
    const step_cmds *c;
    dec_stats stats = {0};
    kiln_status st = bench_decode_setup(e, batch, context, steps, &stats, &c);
    if (st)
        return st;
    kiln_fence *fence;
    for (int i = 0; i < warmup; i++) {
        if ((st = dec__submit_step(e, c, batch, batch, i == 0, "decode", KILN_TIMING_OFF, &fence)) ||
            (st = dec__finish_step(e, fence, c->n, batch, 0, &stats)))
            return st;
    }
    double *ms = calloc((size_t)steps, sizeof *ms);
    if (!ms)
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    for (int i = 0; i < steps && !st; i++) {
        if ((st = dec__submit_step(e, c, batch, batch, 1, "decode", KILN_TIMING_COMPLETION, &fence)))
            break;
        if ((st = kiln_fence_wait(fence))) {
            dec_kfail(st, "bench step");
        } else {
            kiln_receipt r;
            if ((st = kiln_fence_receipt(fence, &r)))
                dec_kfail(st, "receipt");
            ms[i] = r.elapsed_ms;
            for (size_t k = 0; k < c->n; k++) {
                kiln_attribution a;
                if (kiln_fence_attribution(fence, k, &a) == KILN_OK && a.path == KILN_EXEC_REPLAYED)
                    stats.replayed_commands++;
            }
        }
        kiln_fence_release(fence);
    }
    if (!st) {
        qsort(ms, (size_t)steps, sizeof *ms, cmp_double);
        *device_ms = ms[steps / 2];
        double t0 = dec__now_s();
        for (int i = 0; i < steps && !st; i++)
            st = dec__submit_step(e, c, batch, batch, 0, "decode", KILN_TIMING_OFF, NULL);
        if (!st && (st = kiln_stream_synchronize(e->s)))
            dec_kfail(st, "bench synchronize");
        *wall_ms = (dec__now_s() - t0) * 1e3 / steps;
        *replayed_commands = stats.replayed_commands;
    }
    free(ms);
    return st;
}

kiln_status dec_bench_routing(dec_engine *e, uint32_t batch, uint32_t context, uint32_t *distinct)
{
    if (!e->E || batch > e->o.max_participants || !e->decode[batch].n)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "routing: a mixture of experts (%lld experts) after "
                        "dec_bench_steps for batch %u", (long long)e->E, batch);
    const step_cmds *c = &e->decode[batch];
    const size_t L = (size_t)e->m->config.layers, picks = (size_t)batch * (size_t)e->K;
    uint32_t *ids = malloc(L * picks * 4);
    kiln_fence *fence = NULL;
    kiln_status st = KILN_OK;
    if (!ids)
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    /* The step once more, eagerly; each layer's router keeps its choices. */
    kiln_binding_patch p[3] = {{SLOT_IDS, 0, e->ids, (size_t)batch * 4},
                               {SLOT_POS, 0, e->pos, (size_t)batch * 4},
                               {SLOT_LENS, 0, e->lens, (size_t)batch * 4}};
    kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_EAGER_ONLY, .timing = KILN_TIMING_OFF,
                              .phase = "decode", .arena = e->arena, .patches = p, .n_patches = 3};
    if ((st = kiln_stream_submit(e->s, c->cmd, c->n, &so, &fence)) || (st = kiln_fence_wait(fence))) {
        dec_kfail(st, "routing step");
        goto out;
    }
    if ((st = dec__read_routing(e, batch, ids)))
        goto out;
    for (size_t l = 0; l < L; l++) {
        uint8_t seen[512] = {0}; /* the loader takes at most 512 experts */
        distinct[l] = 0;
        for (size_t j = 0; j < picks; j++) {
            const uint32_t x = ids[l * picks + j];
            if (x >= (uint32_t)e->E || x >= sizeof seen) {
                st = dec_fail(KILN_ERR_DEVICE_CONTRACT, "routing: layer %zu chose expert %u of %lld (context %u)",
                              l, x, (long long)e->E, context);
                goto out;
            }
            distinct[l] += !seen[x];
            seen[x] = 1;
        }
    }
out:
    kiln_fence_release(fence);
    free(ids);
    return st;
}

/* Bytes a decode step's command of that label must read (weights, KV). */
kiln_status dec_bench_first_step(dec_engine *e, uint32_t batch, uint32_t context, double *encode_ms, double *step_ms)
{
    const step_cmds *c;
    dec_stats stats = {0};
    double t0 = dec__now_s();
    kiln_status st = bench_decode_setup(e, batch, context, 1, &stats, &c); /* the encode, and a few stores */
    if (st)
        return st;
    *encode_ms = (dec__now_s() - t0) * 1e3;
    kiln_fence *fence;
    t0 = dec__now_s();
    if ((st = dec__submit_step(e, c, batch, batch, 1, "decode", KILN_TIMING_OFF, &fence)) ||
        (st = dec__finish_step(e, fence, c->n, batch, 0, &stats)))
        return st;
    *step_ms = (dec__now_s() - t0) * 1e3;
    /* Where the encode went, by kind of command. */
    const char *labels[32];
    double ms[32];
    size_t count[32], n = 0;
    for (size_t i = 0; i < c->n; i++) {
        size_t k = 0;
        while (k < n && strcmp(labels[k], c->label[i]))
            k++;
        if (k == n && n < 32) {
            labels[n] = c->label[i];
            ms[n] = 0;
            count[n++] = 0;
        }
        if (k < n) {
            ms[k] += c->encode_s[i] * 1e3;
            count[k]++;
        }
    }
    printf("{\"bench\":\"startup_encode\",\"batch\":%u", batch);
    for (size_t k = 0; k < n; k++)
        printf(",\"%s_ms\":%.3f,\"%s_count\":%zu", labels[k], ms[k], labels[k], count[k]);
    printf("}\n");
    return KILN_OK;
}

static double label_bytes(const dec_engine *e, const char *label, uint32_t batch, uint32_t context)
{
    const double H = (double)e->H, I = (double)e->I, Q = (double)e->QD, KV = (double)e->KVD, L = (double)e->m->config.layers;
    if (!strcmp(label, "qkv_proj"))
        return 2 * H * (Q + 2 * KV) * L;
    if (!strcmp(label, "o_proj"))
        return 2 * H * Q * L;
    if (!strcmp(label, "swiglu"))
        return 2 * 2 * I * H * L;
    if (!strcmp(label, "down_proj"))
        return 2 * I * H * L;
    if (!strcmp(label, "lm_head"))
        return 2 * (double)e->V * H;
    if (!strcmp(label, "attention"))
        return 2 * 2 * (double)batch * context * KV * L;
    if (!strcmp(label, "qk_norm")) /* Qwen3's q and k heads, read and written in place */
        return 2 * 2 * (double)batch * (Q + KV) * L;
    /* A mixture of experts: the router, the experts the batch chose (at most
     * batch x top_k of them), the shared expert. */
    const double XI = (double)e->XI, SI = (double)e->SI, K = (double)batch * (double)e->K;
    if (!strcmp(label, "router_proj"))
        return 2 * (double)e->E * H * L;
    if (!strcmp(label, "experts"))
        return 2 * 3 * XI * H * (K < (double)e->E ? K : (double)e->E) * L;
    if (!strcmp(label, "shared_swiglu"))
        return 2 * 2 * SI * H * L;
    if (!strcmp(label, "shared_down"))
        return 2 * SI * H * L;
    return 0;
}

enum { MAX_LABELS = 16 };

/* Milliseconds per kind of command (its label), in the order first met. */
typedef struct label_times {
    const char *name[MAX_LABELS];
    double ms[MAX_LABELS], total;
    size_t n;
} label_times;

/* Runs c once, eager, every command timed (spans), and sums the times by label. */
static kiln_status time_by_label(dec_engine *e, const step_cmds *c, const kiln_binding_patch *p, size_t n_patches,
                                 const char *phase, label_times *out)
{
    memset(out, 0, sizeof *out);
    kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_EAGER_ONLY, .timing = KILN_TIMING_SPANS,
                              .phase = phase, .arena = e->arena, .patches = p, .n_patches = n_patches};
    kiln_fence *fence;
    kiln_status st = kiln_stream_submit(e->s, c->cmd, c->n, &so, &fence);
    if (st)
        return dec_kfail(st, "breakdown");
    if ((st = kiln_fence_wait(fence))) {
        kiln_fence_release(fence);
        return dec_kfail(st, "breakdown");
    }
    for (size_t i = 0; i < c->n; i++) {
        kiln_attribution a;
        kiln_span sp;
        if (kiln_fence_attribution(fence, i, &a) || a.span < 0 || kiln_fence_span(fence, (size_t)a.span, &sp))
            continue;
        size_t k = 0;
        while (k < out->n && strcmp(out->name[k], c->label[i]))
            k++;
        if (k == out->n) {
            if (out->n == MAX_LABELS)
                continue;
            out->name[out->n++] = c->label[i];
        }
        out->ms[k] += sp.duration_ms;
        out->total += sp.duration_ms;
    }
    kiln_fence_release(fence);
    return KILN_OK;
}

kiln_status dec_bench_breakdown(dec_engine *e, uint32_t batch, uint32_t context, FILE *out)
{
    if (batch > e->o.max_participants || !e->decode[batch].n)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "breakdown: run dec_bench_steps for batch %u first", batch);
    kiln_binding_patch p[3] = {{SLOT_IDS, 0, e->ids, (size_t)batch * 4},
                               {SLOT_POS, 0, e->pos, (size_t)batch * 4},
                               {SLOT_LENS, 0, e->lens, (size_t)batch * 4}};
    label_times t;
    kiln_status st = time_by_label(e, &e->decode[batch], p, 3, "decode", &t);
    if (st)
        return st;
    fprintf(out, "{\"bench\":\"decode_step_ops\",\"impl\":\"kiln\",\"path\":\"eager\",\"batch\":%u,\"context\":%u,"
                 "\"sum_ms\":%.4f,\"ops\":{", batch, context, t.total);
    for (size_t k = 0; k < t.n; k++) {
        double b = label_bytes(e, t.name[k], batch, context);
        fprintf(out, "%s\"%s\":{\"ms\":%.4f", k ? "," : "", t.name[k], t.ms[k]);
        if (b > 0 && t.ms[k] > 0)
            fprintf(out, ",\"gb\":%.3f,\"gb_s\":%.0f", b / 1e9, b / (t.ms[k] * 1e-3) / 1e9);
        fprintf(out, "}");
    }
    fprintf(out, "}}\n");
    return KILN_OK;
}

/* ---- the prefill benchmark ---- */

double dec_prefill_flops(const dec_config *c, const char *label, uint32_t seqs, uint32_t tokens)
{
    const kiln_model_config *b = &c->base;
    const double H = (double)b->hidden_size, I = (double)b->intermediate_size, V = (double)b->vocab_size,
                 Q = (double)b->num_attention_heads * (double)b->head_dim,
                 KV = (double)b->num_key_value_heads * (double)b->head_dim, L = (double)c->layers,
                 S = (double)seqs, N = (double)tokens, T = S * N, E = (double)b->num_experts,
                 K = (double)b->num_experts_per_tok, XI = (double)b->moe_intermediate_size,
                 SI = b->num_experts ? (double)c->shared_inter : 0;
    const struct {
        const char *label;
        double flops;
    } parts[] = {
        {"qkv_proj", 2 * T * H * (Q + 2 * KV) * L},
        {"o_proj", 2 * T * Q * H * L},
        {"swiglu", E ? 0 : 2 * T * H * 2 * I * L},
        {"down_proj", E ? 0 : 2 * T * I * H * L},
        /* A mixture of experts: each token's top_k experts, the router, the shared expert. */
        {"router_proj", 2 * T * H * E * L},
        {"experts", 2 * T * K * 3 * XI * H * L},
        {"shared_swiglu", 2 * T * H * 2 * SI * L},
        {"shared_down", 2 * T * SI * H * L},
        /* q.k and p.v, 2 x heads x head_dim each, over every (query, key at or before it) pair. */
        {"attention", 2 * 2 * Q * S * N * (N + 1) / 2 * L},
        {"lm_head", 2 * S * V * H},
    };
    double sum = 0;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        if (label && !strcmp(label, parts[i].label))
            return parts[i].flops;
        sum += parts[i].flops;
    }
    return label ? 0 : sum;
}

/* The patches of a prefill step of T rows and S sequences: every slot. */
static void prefill_patches(dec_engine *e, uint32_t T, uint32_t S, kiln_binding_patch p[N_SLOTS])
{
    const kiln_binding_patch all[N_SLOTS] = {
        {SLOT_IDS, 0, e->ids, (size_t)T * 4},     {SLOT_POS, 0, e->pos, (size_t)T * 4},
        {SLOT_LENS, 0, e->lens, (size_t)S * 4},   {SLOT_SPANS, 0, e->spans, (size_t)S * 8},
        {SLOT_TABLE, 0, e->table, (size_t)S * e->max_blocks * 4}};
    memcpy(p, all, sizeof all);
}

kiln_status dec_bench_prefill(dec_engine *e, uint32_t seqs, uint32_t tokens, int warmup, int iters,
                              double budget_ms, dec_prefill_times *out)
{
    memset(out, 0, sizeof *out);
    if (!seqs || seqs > e->o.max_participants || !tokens || tokens > e->o.max_seq_tokens ||
        (uint64_t)seqs * tokens > e->o.max_prefill_tokens || warmup < 0 || iters < 1)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT,
                        "prefill bench: %u sequences (1..%u) of %u tokens (1..%u, %u in all), warmup %d, iters %d",
                        seqs, e->o.max_participants, tokens, e->o.max_seq_tokens, e->o.max_prefill_tokens, warmup,
                        iters);
    const uint32_t T = seqs * tokens;
    for (uint32_t i = 0; i < seqs; i++) {
        for (uint32_t t = 0; t < tokens; t++) {
            const uint32_t row = i * tokens + t;
            e->ids[row] = (row * 7919u + 1) % (uint32_t)e->V;
            e->pos[row] = t;
        }
        e->lens[i] = tokens;
        e->spans[2 * i] = i * tokens;
        e->spans[2 * i + 1] = tokens;
        dec__set_rows(e, i, i);
    }
    dec__cmds_release(&e->prefill);
    kiln_status st = dec__encode_step(e, T, seqs, tokens, &e->prefill);
    if (st)
        return st;
    e->prefill_seqs = seqs;
    e->prefill_tokens = tokens;
    const step_cmds *c = &e->prefill;
    out->commands = c->n;
    kiln_binding_patch p[N_SLOTS];
    prefill_patches(e, T, seqs, p);
    kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_ADAPTIVE, .timing = KILN_TIMING_OFF,
                              .phase = "prefill", .arena = e->arena, .patches = p, .n_patches = N_SLOTS};
    kiln_fence *fence;
    /* The first submission, on a quiet stream, captures the step's graph; the rest replay it. */
    for (int i = 0; i < warmup; i++) {
        if ((st = kiln_stream_submit(e->s, c->cmd, c->n, &so, &fence)))
            return dec_kfail(st, "prefill warmup");
        st = kiln_fence_wait(fence);
        kiln_fence_release(fence);
        if (st)
            return dec_kfail(st, "prefill warmup");
    }
    double *ms = calloc((size_t)iters * 2, sizeof *ms), *wall = ms + iters, spent = 0;
    if (!ms)
        return dec_fail(KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory");
    so.timing = KILN_TIMING_COMPLETION;
    int n = 0;
    while (n < iters && !st && (n < 3 || spent < budget_ms)) {
        const double t0 = dec__now_s();
        if ((st = kiln_stream_submit(e->s, c->cmd, c->n, &so, &fence))) {
            dec_kfail(st, "prefill");
            break;
        }
        kiln_receipt r;
        if ((st = kiln_fence_wait(fence)) || (st = kiln_fence_receipt(fence, &r))) {
            dec_kfail(st, "prefill");
        } else {
            wall[n] = (dec__now_s() - t0) * 1e3;
            ms[n] = r.elapsed_ms;
            spent += r.elapsed_ms;
            uint64_t replayed = 0;
            for (size_t k = 0; k < c->n; k++) {
                kiln_attribution a;
                if (kiln_fence_attribution(fence, k, &a) == KILN_OK && a.path == KILN_EXEC_REPLAYED)
                    replayed++;
            }
            out->replayed = replayed;
            n++;
        }
        kiln_fence_release(fence);
    }
    if (!st) {
        qsort(ms, (size_t)n, sizeof *ms, cmp_double);
        qsort(wall, (size_t)n, sizeof *wall, cmp_double);
        out->device_ms = ms[n / 2];
        out->min_ms = ms[0];
        out->wall_ms = wall[n / 2];
        out->iters = n;
    }
    free(ms);
    return st;
}

kiln_status dec_bench_prefill_breakdown(dec_engine *e, FILE *out)
{
    const step_cmds *c = &e->prefill;
    if (!c->n)
        return dec_fail(KILN_ERR_INVALID_ARGUMENT, "prefill breakdown: run dec_bench_prefill first");
    const uint32_t S = e->prefill_seqs, N = e->prefill_tokens;
    kiln_binding_patch p[N_SLOTS];
    prefill_patches(e, S * N, S, p);
    label_times t;
    kiln_status st = time_by_label(e, c, p, N_SLOTS, "prefill", &t);
    if (st)
        return st;
    fprintf(out, "{\"bench\":\"prefill_ops\",\"impl\":\"kiln\",\"path\":\"eager\",\"shape\":\"%ux%u\",\"seqs\":%u,"
                 "\"tokens_each\":%u,\"sum_ms\":%.4f,\"ops\":{", S, N, S, N, t.total);
    for (size_t k = 0; k < t.n; k++) {
        const double f = dec_prefill_flops(&e->m->config, t.name[k], S, N);
        fprintf(out, "%s\"%s\":{\"ms\":%.4f", k ? "," : "", t.name[k], t.ms[k]);
        if (f > 0 && t.ms[k] > 0)
            fprintf(out, ",\"tflop\":%.4f,\"tflop_s\":%.1f", f / 1e12, f / (t.ms[k] * 1e-3) / 1e12);
        fprintf(out, "}");
    }
    fprintf(out, "}}\n");
    return KILN_OK;
}
