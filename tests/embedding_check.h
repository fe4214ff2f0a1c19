/* Runs token embedding on the GPU and checks every output element against a
 * host gather. Shared by the GPU tests. */
#ifndef KILN_TESTS_EMBEDDING_CHECK_H
#define KILN_TESTS_EMBEDDING_CHECK_H

#include "testutil.h"

/* A finite f16 or bf16 bit pattern (bit 14, the top exponent bit of both,
 * clear), never 0xffff, the poison. */
static inline uint16_t random_f16(kiln_rng *r) { return (uint16_t)(kiln_rng_next(r) >> 48) & 0xbfff; }

typedef struct emb_case {
    int64_t vocab, hidden, tokens;
    size_t table_offset, out_offset; /* bytes; nonzero to leave the 16-byte path */
    uint32_t bad_index;              /* a token id made out of range, or UINT32_MAX */
} emb_case;

/* Uploads a random table of element type elt (KILN_DTYPE_F16 or
 * KILN_DTYPE_BF16) and random ids, poisons the output, runs, reads back and
 * compares all tokens x hidden elements. Returns the sync status. */
static inline kiln_status run_embedding_case_elt(kiln_runtime *rt, kiln_jit *jit, kiln_rng *r, const emb_case *c,
                                                 kiln_dtype elt)
{
    size_t row = (size_t)c->hidden, table_n = (size_t)c->vocab * row, out_n = (size_t)c->tokens * row;
    uint16_t *table = malloc(table_n * 2), *out = malloc(out_n * 2);
    uint32_t *ids = malloc((size_t)c->tokens * 4);
    assert_non_null(table);
    assert_non_null(out);
    assert_non_null(ids);
    for (size_t i = 0; i < table_n; i++)
        table[i] = random_f16(r);
    for (int64_t t = 0; t < c->tokens; t++)
        ids[t] = kiln_rng_below(r, (uint32_t)c->vocab);
    /* The first and last rows are where off-by-one gathers hide. */
    ids[0] = (uint32_t)c->vocab - 1;
    if (c->tokens > 1)
        ids[c->tokens - 1] = 0;
    if (c->bad_index != UINT32_MAX)
        ids[c->bad_index] = (uint32_t)c->vocab + (c->bad_index % 3 == 0 ? 0 : 12345);

    kiln_buffer *bt, *bi, *bo;
    KILN_CHECK(kiln_buffer_create(rt, table_n * 2 + c->table_offset, 256, &bt));
    KILN_CHECK(kiln_buffer_create(rt, (size_t)c->tokens * 4, 256, &bi));
    KILN_CHECK(kiln_buffer_create(rt, out_n * 2 + c->out_offset, 256, &bo));
    KILN_CHECK(kiln_buffer_upload(bt, c->table_offset, table, table_n * 2));
    KILN_CHECK(kiln_buffer_upload(bi, 0, ids, (size_t)c->tokens * 4));
    KILN_CHECK(kiln_buffer_fill(bo, 0, 0xff, out_n * 2 + c->out_offset));

    kiln_tensor tt = {.buffer = bt, .offset = c->table_offset, .dtype = elt, .rank = 2,
                      .dims = {c->vocab, c->hidden}};
    kiln_tensor ti = {.buffer = bi, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {c->tokens}};
    kiln_tensor to = {.buffer = bo, .offset = c->out_offset, .dtype = elt, .rank = 2,
                      .dims = {c->tokens, c->hidden}};
    KILN_CHECK(kiln_op_token_embedding(jit, &tt, &ti, &to));
    kiln_status st = kiln_runtime_synchronize(rt);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kiln_errmsg());
    KILN_CHECK(kiln_buffer_readback(bo, c->out_offset, out, out_n * 2));

    size_t wrong = 0;
    for (int64_t t = 0; t < c->tokens; t++) {
        int bad = (uint64_t)ids[t] >= (uint64_t)c->vocab;
        const uint16_t *want = bad ? NULL : table + (size_t)ids[t] * row;
        for (size_t h = 0; h < row; h++) {
            uint16_t w = bad ? 0 : want[h], got = out[(size_t)t * row + h];
            if (got != w && wrong++ < 5)
                fprintf(stderr, "%s vocab %lld hidden %lld tokens %lld: out[%lld][%zu] = 0x%04x, want 0x%04x\n",
                        kiln_dtype_name(elt), (long long)c->vocab, (long long)c->hidden, (long long)c->tokens,
                        (long long)t, h, got, w);
        }
    }
    if (wrong)
        fail_msg("%zu of %zu elements wrong", wrong, out_n);
    kiln_buffer_destroy(bt);
    kiln_buffer_destroy(bi);
    kiln_buffer_destroy(bo);
    free(table);
    free(out);
    free(ids);
    if (st && !strstr(kiln_errmsg(), msg))
        fail_msg("the message changed after sync: %s", kiln_errmsg());
    return st;
}

/* The same with an f16 table. */
static inline kiln_status run_embedding_case(kiln_runtime *rt, kiln_jit *jit, kiln_rng *r, const emb_case *c)
{
    return run_embedding_case_elt(rt, jit, r, c, KILN_DTYPE_F16);
}

#endif
