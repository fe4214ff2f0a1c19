/* The decoder engine's private header: its struct and the step functions
 * that engine.c (generation) and engine_bench.c (the benchmarks) share.
 * Not for main.c or bench.c, which see decoder.h only. */
#ifndef KILN_EXAMPLES_ENGINE_INT_H
#define KILN_EXAMPLES_ENGINE_INT_H

#include <stdio.h>

#include "decoder.h"

kiln_status dec_fail(kiln_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
kiln_status dec_kfail(kiln_status st, const char *what);

enum { SLOT_IDS, SLOT_POS, SLOT_LENS, SLOT_SPANS, SLOT_TABLE, N_SLOTS };

/* The commands of one step shape (tokens, participants). */
typedef struct step_cmds {
    kiln_command **cmd;
    const char **label; /* what each command is ("q_proj", ...): static strings */
    size_t n;
    double *encode_s; /* the seconds each command took to encode */
    double mark;      /* while encoding: when the last command was pushed */
} step_cmds;

struct dec_engine {
    kiln_jit *jit;
    kiln_stream *s;
    kiln_runtime *rt;
    const dec_model *m;
    dec_engine_options o;
    int64_t H, I, V, NH, KVH, HD, QD, KVD, QKVD; /* QKVD: a fused q | k | v row */
    /* A mixture of experts (E 0: dense): experts, those a token takes, an
     * expert's and the shared expert's intermediate sizes (SI 0: none). */
    int64_t E, K, XI, SI;
    float eps, theta;
    /* RoPE as the config scales it (kiln_model_rope_frequencies for sequences
     * up to max_seq_tokens): rope_dim / 2 inverse frequencies, cos and sin's factor. */
    int64_t rope_dim;
    float rope_inv_freq[KILN_MODEL_MAX_HEAD_DIM / 2], rope_scaling;
    uint32_t page_tokens, max_blocks, pages_per_layer, max_rows;
    uint32_t window; /* the attention's sliding window (0: none) */
    kiln_buffer *res, *norm, *qkv, *attn, *act, *logits, *ws, *kv;
    /* The experts' router logits [rows, E], choices (u32 [layers, rows, K]:
     * each layer's own, so that a step's routing can be read back) and
     * weights (f32 [rows, K]), their output and the shared expert's [rows, H];
     * NULL for a dense model. act holds the shared expert's activations then. */
    kiln_buffer *moe_logits, *moe_ids, *moe_weights, *moe_out, *shared_out;
    kiln_buffer *valid, *rep_ids, *rep_off, *penalty, *am_ws, *next;
    kiln_binding_arena *arena;
    kiln_buffer *ab; /* the arena's buffer (borrowed) */
    kiln_binding_slot slots[N_SLOTS];
    step_cmds *decode; /* [max_participants + 1]: decode commands per batch size, encoded on first use */
    step_cmds prefill; /* the prefill benchmark's step, kept for its breakdown */
    uint32_t prefill_seqs, prefill_tokens;
    /* host staging of the arena's slots */
    uint32_t *ids, *pos, *lens, *spans, *table;
    uint16_t *logits_host;
    uint32_t *next_host;
    dec_routing_fn routing_fn; /* dec_record_routing's */
    void *routing_user;
    uint32_t *routing_host; /* [layers, rows, K], allocated on first use */
};

/* Releases the commands and the arrays; c is left empty. */
void dec__cmds_release(step_cmds *c);
/* Encodes a step of T tokens of S sequences, each with at most maxq new
 * tokens (1: decode), into out. */
kiln_status dec__encode_step(dec_engine *e, uint32_t T, uint32_t S, uint32_t maxq, step_cmds *out);
/* Seconds on the monotonic clock. */
double dec__now_s(void);
/* Submits one step: ids and positions of T rows, lengths of S sequences,
 * and (when all) the spans and block table rows too; fence may be NULL. */
kiln_status dec__submit_step(dec_engine *e, const step_cmds *c, uint32_t T, uint32_t S, int all, const char *phase,
                             kiln_timing timing, kiln_fence **fence);
/* Waits for a step and releases its fence, counts how its commands ran
 * (stats may be NULL), reads back the next tokens (and the logits when asked). */
kiln_status dec__finish_step(dec_engine *e, kiln_fence *fence, size_t n_cmds, uint32_t S, int want_logits,
                             dec_stats *stats);
/* The decode commands of batch size P, encoded on first use. */
kiln_status dec__decode_cmds(dec_engine *e, uint32_t P, dec_stats *stats, const step_cmds **out);
/* The last step's chosen experts of its first T rows, every layer's, into
 * host [layers, T, K]. */
kiln_status dec__read_routing(dec_engine *e, uint32_t T, uint32_t *host);
/* Points block table row `row` at the pages of sequence slot seq_slot. */
void dec__set_rows(dec_engine *e, uint32_t row, uint32_t seq_slot);

#endif
