/* The runtime on the GPU: transfers, batched submission, fences, timing,
 * attribution, replayed segments, binding arenas, buffer lifetime, the
 * quarantine of a half-enqueued batch, cross-runtime misuse. */
#include <stdatomic.h>

#include "embedding_check.h"
#include "gpu_fixture.h"
#include "runtime/internal.h"

typedef gpu_fixture fixture;

static kiln_buffer *typed(kiln_runtime *rt, size_t bytes, kiln_dtype t)
{
    kiln_buffer_desc d = {.bytes = bytes, .dtype = t, .usage = KILN_USAGE_ACTIVATIONS};
    kiln_buffer *b;
    KILN_CHECK(kiln_buffer_create_ex(rt, &d, &b));
    return b;
}

static void submit_wait(kiln_stream *s, kiln_command **cmds, size_t n, const kiln_submit_options *o)
{
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_submit(s, cmds, n, o, &fence));
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_fence_state st;
    KILN_CHECK(kiln_fence_query(fence, &st));
    assert_int_equal(st, KILN_FENCE_SUCCEEDED);
    kiln_fence_release(fence);
}

static void test_transfers(void **state)
{
    fixture *f = *state;
    enum { N = 1 << 16 };
    uint8_t *in = malloc(N), *back = malloc(N);
    kiln_rng_fill(&f->rng, in, N);
    kiln_buffer *a = typed(f->rt, N, KILN_DTYPE_U8), *b = typed(f->rt, N, KILN_DTYPE_U8);
    kiln_buffer *h = typed(f->rt, N, KILN_DTYPE_F16);
    kiln_region ra = {a, 0, N}, rb = {b, 0, N}, half = {b, N / 4, N / 2};
    kiln_command *cmds[3];
    KILN_CHECK(kiln_command_upload(f->rt, &ra, in, N, &cmds[0]));
    uint8_t orig = in[7];
    in[7] ^= 0xff; /* the command kept its own copy: this must not reach the device */
    KILN_CHECK(kiln_command_copy(f->rt, &ra, &rb, &cmds[1]));
    KILN_CHECK(kiln_command_zero(f->rt, &half, &cmds[2]));
    submit_wait(f->s, cmds, 3, NULL);
    KILN_CHECK(kiln_stream_readback(f->s, &rb, back));
    for (size_t i = 0; i < N; i++) {
        uint8_t want = (i >= N / 4 && i < N / 2) ? 0 : i == 7 ? orig : in[i];
        if (back[i] != want)
            fail_msg("byte %zu: 0x%02x, want 0x%02x", i, back[i], want);
    }
    kiln_region rh = {h, 0, N};
    kiln_command *bad = NULL;
    KILN_EXPECT(kiln_command_copy(f->rt, &ra, &rh, &bad), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "u8", "f16");
    assert_null(bad);
    for (int i = 0; i < 3; i++)
        kiln_command_release(cmds[i]);
    kiln_buffer_destroy(a);
    kiln_buffer_destroy(b);
    kiln_buffer_destroy(h);
    free(in);
    free(back);
}

/* An embedding command over fresh random data; checks the output after. */
typedef struct emb {
    kiln_buffer *table, *ids, *out;
    uint16_t *host_table;
    uint32_t *host_ids;
    int64_t vocab, hidden, tokens;
} emb;

static void emb_make(fixture *f, emb *e, int64_t vocab, int64_t hidden, int64_t tokens)
{
    e->vocab = vocab;
    e->hidden = hidden;
    e->tokens = tokens;
    e->host_table = malloc((size_t)(vocab * hidden) * 2);
    e->host_ids = malloc((size_t)tokens * 4);
    for (int64_t i = 0; i < vocab * hidden; i++)
        e->host_table[i] = random_f16(&f->rng);
    for (int64_t t = 0; t < tokens; t++)
        e->host_ids[t] = kiln_rng_below(&f->rng, (uint32_t)vocab);
    e->table = typed(f->rt, (size_t)(vocab * hidden) * 2, KILN_DTYPE_F16);
    e->ids = typed(f->rt, (size_t)tokens * 4, KILN_DTYPE_U32);
    e->out = typed(f->rt, (size_t)(tokens * hidden) * 2, KILN_DTYPE_F16);
    KILN_CHECK(kiln_buffer_upload(e->table, 0, e->host_table, (size_t)(vocab * hidden) * 2));
    KILN_CHECK(kiln_buffer_upload(e->ids, 0, e->host_ids, (size_t)tokens * 4));
    KILN_CHECK(kiln_buffer_fill(e->out, 0, 0xff, (size_t)(tokens * hidden) * 2));
}

static kiln_command *emb_encode(fixture *f, emb *e)
{
    kiln_tensor tt = {.buffer = e->table, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {e->vocab, e->hidden}};
    kiln_tensor ti = {.buffer = e->ids, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {e->tokens}};
    kiln_tensor to = {.buffer = e->out, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {e->tokens, e->hidden}};
    kiln_command *c;
    KILN_CHECK(kiln_op_token_embedding_encode(f->jit, &tt, &ti, &to, &c));
    return c;
}

static void emb_check(fixture *f, emb *e)
{
    size_t n = (size_t)(e->tokens * e->hidden);
    uint16_t *out = malloc(n * 2);
    KILN_CHECK(kiln_buffer_readback(e->out, 0, out, n * 2));
    for (int64_t t = 0; t < e->tokens; t++)
        for (int64_t h = 0; h < e->hidden; h++) {
            uint16_t got = out[t * e->hidden + h], want = e->host_table[(int64_t)e->host_ids[t] * e->hidden + h];
            if (got != want)
                fail_msg("out[%lld][%lld] = 0x%04x, want 0x%04x", (long long)t, (long long)h, got, want);
        }
    free(out);
    (void)f;
}

static void emb_free(emb *e)
{
    kiln_buffer_destroy(e->table);
    kiln_buffer_destroy(e->ids);
    kiln_buffer_destroy(e->out);
    free(e->host_table);
    free(e->host_ids);
}

static void test_fences_timing_attribution(void **state)
{
    fixture *f = *state;
    emb e[3];
    kiln_command *cmds[3];
    for (int i = 0; i < 3; i++) {
        emb_make(f, &e[i], 5000, 4096, 2048);
        cmds[i] = emb_encode(f, &e[i]);
    }
    assert_int_equal(kiln_stream_get_state(f->s), KILN_STREAM_READY);
    kiln_submit_options o = {.path = KILN_PATH_EAGER_ONLY, .timing = KILN_TIMING_SPANS, .phase = "prefill"};
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_submit(f->s, cmds, 3, &o, &fence));
    kiln_stream_state ss = kiln_stream_get_state(f->s);
    assert_true(ss == KILN_STREAM_SUBMITTED || ss == KILN_STREAM_READY);
    KILN_CHECK(kiln_fence_wait(fence));
    assert_int_equal(kiln_stream_get_state(f->s), KILN_STREAM_READY);
    kiln_receipt r;
    KILN_CHECK(kiln_fence_receipt(fence, &r));
    assert_int_equal(r.state, KILN_FENCE_SUCCEEDED);
    assert_int_equal(r.n_commands, 3);
    assert_int_equal(r.n_spans, 3);
    assert_true(r.elapsed_ms > 0);
    double prev_end = 0, sum = 0;
    for (size_t k = 0; k < 3; k++) {
        kiln_span sp;
        KILN_CHECK(kiln_fence_span(fence, k, &sp));
        assert_int_equal(sp.first, k);
        assert_int_equal(sp.last, k);
        assert_int_equal(sp.path, KILN_EXEC_EAGER);
        assert_true(sp.duration_ms > 0);
        assert_true(sp.start_ms >= prev_end - 1e-3);
        prev_end = sp.start_ms + sp.duration_ms;
        sum += sp.duration_ms;
        kiln_attribution a;
        KILN_CHECK(kiln_fence_attribution(fence, k, &a));
        assert_int_equal(a.index, k);
        assert_string_equal(a.op_id, "token_embedding");
        assert_string_equal(a.phase, "prefill");
        assert_int_equal(a.path, KILN_EXEC_EAGER);
        assert_int_equal(a.batching, KILN_BATCHING_PACKED);
        assert_int_equal(a.tokens, 2048);
        assert_int_equal(a.dispatches, 1);
        assert_int_equal(a.span, (int32_t)k);
    }
    assert_true(sum <= r.elapsed_ms + 1e-3);
    fprintf(stderr, "3 embeddings: %.3f ms in all, spans sum %.3f ms\n", r.elapsed_ms, sum);
    kiln_attribution a;
    assert_int_equal(kiln_fence_attribution(fence, 3, &a), KILN_ERR_NOT_FOUND);
    kiln_fence_release(fence);

    /* Completion timing only: elapsed, no spans. */
    kiln_submit_options oc = {.path = KILN_PATH_EAGER_ONLY, .timing = KILN_TIMING_COMPLETION};
    KILN_CHECK(kiln_stream_submit(f->s, cmds, 3, &oc, &fence));
    KILN_CHECK(kiln_fence_wait(fence));
    KILN_CHECK(kiln_fence_receipt(fence, &r));
    assert_true(r.elapsed_ms > 0);
    assert_int_equal(r.n_spans, 0);
    kiln_span sp;
    assert_int_equal(kiln_fence_span(fence, 0, &sp), KILN_ERR_NOT_FOUND);
    kiln_fence_release(fence);
    for (int i = 0; i < 3; i++) {
        emb_check(f, &e[i]);
        kiln_command_release(cmds[i]);
        emb_free(&e[i]);
    }
}

static void test_replayed_segments(void **state)
{
    fixture *f = *state;
    emb e[2];
    kiln_command *cmds[3];
    emb_make(f, &e[0], 3000, 896, 300);
    emb_make(f, &e[1], 3000, 896, 77);
    /* A new ids upload (eager boundary), then two replayed embeddings. */
    for (int64_t t = 0; t < e[0].tokens; t++)
        e[0].host_ids[t] = kiln_rng_below(&f->rng, 3000);
    kiln_region ids = {e[0].ids, 0, (size_t)e[0].tokens * 4};
    KILN_CHECK(kiln_command_upload(f->rt, &ids, e[0].host_ids, ids.end, &cmds[0]));
    cmds[1] = emb_encode(f, &e[0]);
    cmds[2] = emb_encode(f, &e[1]);

    /* Replayed-only refuses the upload (no replay key), before enqueueing anything. */
    kiln_submit_options ro = {.path = KILN_PATH_REPLAYED_ONLY};
    KILN_EXPECT(kiln_stream_submit(f->s, cmds, 3, &ro, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "command 0 (transfer.upload)", "no replay key");
    assert_int_equal(kiln_stream_get_state(f->s), KILN_STREAM_READY);

    uint32_t boundary = 0;
    kiln_submit_options o = {.path = KILN_PATH_REPLAYED_WITH_EAGER_BOUNDARIES, .timing = KILN_TIMING_SPANS,
                             .eager_boundaries = &boundary, .n_eager_boundaries = 1};
    kiln_fence *fence;
    /* The replayed paths launch resident graphs only: not captured yet, refused before enqueueing. */
    KILN_EXPECT(kiln_stream_submit(f->s, cmds, 3, &o, &fence), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "commands 1 (token_embedding) to 2 (token_embedding)", "not resident");
    assert_int_equal(kiln_stream_get_state(f->s), KILN_STREAM_READY);
    size_t captured = 0;
    KILN_CHECK(kiln_stream_prepare(f->s, cmds, 3, &o, &captured));
    assert_int_equal(captured, 1);
    KILN_CHECK(kiln_stream_prepare(f->s, cmds, 3, &o, &captured));
    assert_int_equal(captured, 0); /* resident already */
    KILN_CHECK(kiln_stream_submit(f->s, cmds, 3, &o, &fence));
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_receipt r;
    KILN_CHECK(kiln_fence_receipt(fence, &r));
    assert_int_equal(r.n_spans, 2); /* the upload, then one segment of two */
    kiln_span sp;
    KILN_CHECK(kiln_fence_span(fence, 1, &sp));
    assert_int_equal(sp.first, 1);
    assert_int_equal(sp.last, 2);
    assert_int_equal(sp.path, KILN_EXEC_REPLAYED);
    assert_true(sp.duration_ms > 0);
    kiln_attribution a;
    KILN_CHECK(kiln_fence_attribution(fence, 0, &a));
    assert_int_equal(a.path, KILN_EXEC_EAGER);
    KILN_CHECK(kiln_fence_attribution(fence, 2, &a));
    assert_int_equal(a.path, KILN_EXEC_REPLAYED);
    assert_int_equal(a.span, 1);
    kiln_fence_release(fence);
    emb_check(f, &e[0]);
    emb_check(f, &e[1]);

    /* Replayed only, over the two replayable commands. */
    KILN_CHECK(kiln_buffer_fill(e[1].out, 0, 0xff, (size_t)(e[1].tokens * e[1].hidden) * 2));
    submit_wait(f->s, cmds + 1, 2, &ro);
    emb_check(f, &e[1]);
    for (int i = 0; i < 3; i++)
        kiln_command_release(cmds[i]);
    emb_free(&e[0]);
    emb_free(&e[1]);
}

static void test_binding_arena(void **state)
{
    fixture *f = *state;
    kiln_binding_slot slots[3] = {{0, 64}, {64, 256}, {320, 16}};
    kiln_binding_arena *arena;
    KILN_CHECK(kiln_binding_arena_create(f->rt, slots, 3, 336, &arena));
    kiln_binding_slot bad[2] = {{0, 64}, {65, 10}};
    kiln_binding_arena *x = NULL;
    KILN_EXPECT(kiln_binding_arena_create(f->rt, bad, 2, 75, &x), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "gap",
                NULL);
    /* Copy the whole arena out after the patches, to see what the device holds. */
    kiln_buffer *out = typed(f->rt, 336, KILN_DTYPE_BYTES);
    kiln_region all = {kiln_binding_arena_buffer(arena), 0, 336}, dst = {out, 0, 336};
    kiln_command *copy;
    KILN_CHECK(kiln_command_copy(f->rt, &all, &dst, &copy));
    uint8_t want[336] = {0}, got[336];
    for (int step = 0; step < 3; step++) {
        uint8_t a[8], b[40], c[16];
        kiln_rng_fill(&f->rng, a, sizeof a);
        kiln_rng_fill(&f->rng, b, sizeof b);
        kiln_rng_fill(&f->rng, c, sizeof c);
        kiln_binding_patch p[3] = {{0, 8, a, sizeof a}, {1, 200, b, sizeof b}, {2, 0, c, sizeof c}};
        memcpy(want + 8, a, sizeof a);
        memcpy(want + 64 + 200, b, sizeof b);
        memcpy(want + 320, c, sizeof c);
        kiln_submit_options o = {.arena = arena, .patches = p, .n_patches = 3};
        submit_wait(f->s, &copy, 1, &o);
        KILN_CHECK(kiln_stream_readback(f->s, &dst, got));
        assert_memory_equal(got, want, sizeof want);
    }
    assert_int_equal(kiln_binding_arena_uploads(arena), 3); /* one coalesced copy per submission */
    /* Bad patches are refused before anything runs. */
    uint8_t z[4] = {0};
    kiln_binding_patch unsorted[2] = {{1, 0, z, 4}, {0, 0, z, 4}};
    kiln_submit_options o = {.arena = arena, .patches = unsorted, .n_patches = 2};
    KILN_EXPECT(kiln_stream_submit(f->s, &copy, 1, &o, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "comes before", NULL);
    kiln_binding_patch outside = {2, 14, z, 4};
    o.patches = &outside;
    o.n_patches = 1;
    KILN_EXPECT(kiln_stream_submit(f->s, &copy, 1, &o, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "outside slot 2", NULL);
    assert_int_equal(kiln_binding_arena_uploads(arena), 3);
    kiln_command_release(copy);
    kiln_buffer_destroy(out);
    kiln_binding_arena_destroy(arena);
}

static void test_buffers_outlive_their_handles(void **state)
{
    fixture *f = *state;
    emb e;
    emb_make(f, &e, 1000, 4096, 4096);
    kiln_command *cmd = emb_encode(f, &e);
    kiln_buffer *table = e.table;
    assert_int_equal(atomic_load(&table->refs), 2); /* the handle and the command */
    /* The caller lets go of the table before the work even runs. */
    kiln_buffer_destroy(e.table);
    e.table = NULL;
    assert_int_equal(atomic_load(&table->refs), 1);
    kiln_fence *fence;
    KILN_CHECK(kiln_stream_submit(f->s, &cmd, 1, NULL, &fence));
    kiln_command_release(cmd); /* the fence's batch still holds it */
    assert_int_equal(atomic_load(&table->refs), 1);
    KILN_CHECK(kiln_fence_wait(fence));
    kiln_fence_release(fence);
    KILN_CHECK(kiln_stream_synchronize(f->s));
    emb_check(f, &e);
    emb_free(&e);
}

static int fail_calls;

static kiln_status failing_enqueue(void *user, const kiln_launch_context *ctx)
{
    (void)user;
    (void)ctx;
    fail_calls++;
    return kiln__fail(NULL, KILN_ERR_CUDA_DRIVER, "failing_enqueue: failed on purpose");
}

static void test_half_enqueued_batch_is_quarantined(void **state)
{
    fixture *f = *state;
    emb e;
    emb_make(f, &e, 1000, 896, 64);
    kiln_command *cmds[3];
    cmds[0] = emb_encode(f, &e);
    kiln_region r = {e.out, 0, 64};
    kiln_command_desc d = {.op_id = "test.fail", .regions = &r, .n_regions = 1, .enqueue = failing_enqueue};
    KILN_CHECK(kiln_command_create(f->rt, &d, &cmds[1]));
    cmds[2] = emb_encode(f, &e);
    kiln_buffer *out = e.out;
    long before = atomic_load(&out->refs);
    kiln_fence *fence = (kiln_fence *)1;
    KILN_EXPECT(kiln_stream_submit(f->s, cmds, 3, NULL, &fence), KILN_ERR_CUDA_DRIVER, kiln_errmsg(),
                "on purpose", NULL);
    assert_null(fence);
    assert_int_equal(fail_calls, 1);
    assert_int_equal(kiln_stream_get_state(f->s), KILN_STREAM_FAILED);
    /* The stream refuses work until synchronized. */
    KILN_EXPECT(kiln_stream_submit(f->s, cmds, 1, NULL, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "Failed",
                NULL);
    /* Every command of the batch, and so its memory, is held. */
    for (int i = 0; i < 3; i++)
        kiln_command_release(cmds[i]);
    assert_true(atomic_load(&out->refs) >= before - 3 + 1);
    kiln_buffer_destroy(e.out);
    e.out = NULL;
    assert_true(atomic_load(&out->refs) >= 1); /* quarantined, not freed */
    KILN_CHECK(kiln_stream_synchronize(f->s));
    assert_int_equal(kiln_stream_get_state(f->s), KILN_STREAM_READY);
    /* And the stream works again. */
    emb e2;
    emb_make(f, &e2, 1000, 896, 64);
    kiln_command *c = emb_encode(f, &e2);
    submit_wait(f->s, &c, 1, NULL);
    emb_check(f, &e2);
    kiln_command_release(c);
    emb_free(&e2);
    emb_free(&e);
}

static void test_cross_runtime_misuse(void **state)
{
    fixture *f = *state;
    kiln_runtime *other;
    KILN_CHECK(kiln_runtime_create(NULL, &other));
    kiln_runtime_info a, b;
    kiln_runtime_get_info(f->rt, &a);
    kiln_runtime_get_info(other, &b);
    assert_int_not_equal(a.instance_id, b.instance_id);
    assert_int_equal(strlen(a.implementation_fingerprint), 64);
    assert_string_equal(a.implementation_fingerprint, b.implementation_fingerprint);
    assert_true(a.capabilities & KILN_CAP_GRAPHS);
    assert_int_equal(a.n_storage_profiles, 2);
    assert_int_equal(a.storage_profiles[1].block_bytes, 65536);
    kiln_buffer *theirs = typed(other, 256, KILN_DTYPE_U8), *mine = typed(f->rt, 256, KILN_DTYPE_U8);
    kiln_region rt = {theirs, 0, 256}, rm = {mine, 0, 256};
    kiln_command *c = NULL;
    KILN_EXPECT(kiln_command_copy(f->rt, &rt, &rm, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "another runtime",
                NULL);
    KILN_CHECK(kiln_command_zero(other, &rt, &c));
    KILN_EXPECT(kiln_stream_submit(f->s, &c, 1, NULL, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "belongs to runtime instance", NULL);
    kiln_stream *os = kiln_runtime_stream(other);
    submit_wait(os, &c, 1, NULL);
    kiln_command_release(c);
    assert_non_null(kiln_stream_cublaslt(f->s));
    kiln_buffer_destroy(theirs);
    kiln_buffer_destroy(mine);
    kiln_runtime_destroy(other);
}

int main(void)
{
    kiln_test_require_gpu();
#define T(fn) cmocka_unit_test_setup_teardown(fn, gpu_fixture_setup, gpu_fixture_teardown)
    const struct CMUnitTest tests[] = {
        T(test_transfers),
        T(test_fences_timing_attribution),
        T(test_replayed_segments),
        T(test_binding_arena),
        T(test_buffers_outlive_their_handles),
        T(test_half_enqueued_batch_is_quarantined),
        T(test_cross_runtime_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
