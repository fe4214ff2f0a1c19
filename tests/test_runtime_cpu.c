/* The runtime's validation, without a GPU: regions, buffer descriptions,
 * commands and transfers, the stream state machine, submission checks and
 * binding layouts and patches, and the size field of the options structs.
 *
 * No driver is loaded here. The objects are built from runtime/internal.h's
 * structs: a fake runtime has no driver table (d is NULL), so a check that
 * let a bad call through to the driver would crash this test, which is the
 * point (the size test gives one a stub of the one entry point validation
 * reaches). The test keeps a reference on every fake buffer, so that no command
 * release can drop one to zero (which would call cuMemFree). */
#include <stdatomic.h>
#include <stddef.h>

#include "runtime/internal.h"
#include "fake_runtime.h"
#include "testutil.h"

#define RT1_ID 1001u
#define RT2_ID 2002u
static long refs_of(kiln_buffer *b) { return atomic_load(&b->refs); }

/* Only the test's own reference may be left. */
static void fake_buffer_free(kiln_buffer *b)
{
    assert_int_equal(refs_of(b), 1);
    free(b);
}

static kiln_stream *fake_stream(kiln_runtime *rt, kiln_stream_state state)
{
    kiln_stream *s = calloc(1, sizeof *s);
    assert_non_null(s);
    s->rt = rt;
    s->state = state;
    return s;
}

/* No command is ever enqueued here. */
static kiln_status never_enqueue(void *user, const kiln_launch_context *ctx)
{
    (void)user;
    (void)ctx;
    fail_msg("an enqueue function ran in a CPU test");
    return KILN_ERR_RUNTIME_CONTRACT;
}

static int g_user_frees;
static void *g_user_freed;
static void count_user_free(void *user)
{
    g_user_frees++;
    g_user_freed = user;
}

/* A command without regions; replayable when key is not NULL. */
static kiln_command *plain_command(kiln_runtime *rt, const char *op, const char *key)
{
    kiln_command_desc d = {.op_id = op,
                           .dispatches = 1,
                           .enqueue = never_enqueue,
                           .replay_key = key,
                           .replay_key_bytes = key ? strlen(key) : 0};
    kiln_command *c = NULL;
    KILN_CHECK(kiln_command_create(rt, &d, &c));
    assert_non_null(c);
    return c;
}

/* ---- regions ---- */

static void test_region_check(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(RT1_ID);
    kiln_buffer *b = fake_buffer(rt, 64, KILN_DTYPE_BYTES);

    KILN_EXPECT(kiln_region_check(NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "no buffer", NULL);
    kiln_region r = {NULL, 0, 8};
    KILN_EXPECT(kiln_region_check(&r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "no buffer", NULL);

    r = (kiln_region){b, 5, 5};
    KILN_EXPECT(kiln_region_check(&r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "[5, 5) is empty", NULL);
    assert_null(strstr(kiln_errmsg(), "start past end"));
    /* A check, not an object's failure: the buffer's runtime keeps its own message. */
    assert_null(strstr(rt->err.msg, "[5, 5) is empty"));

    r = (kiln_region){b, 9, 4};
    KILN_EXPECT(kiln_region_check(&r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "[9, 4)", "start past end");

    r = (kiln_region){b, 60, 65};
    KILN_EXPECT(kiln_region_check(&r), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "[60, 65)", "buffer of 64 bytes");
    assert_null(strstr(rt->err.msg, "buffer of 64 bytes"));

    r = (kiln_region){b, 0, 64};
    KILN_CHECK(kiln_region_check(&r));
    r = (kiln_region){b, 63, 64};
    KILN_CHECK(kiln_region_check(&r));
    assert_int_equal(refs_of(b), 1);

    fake_buffer_free(b);
    fake_runtime_free(rt);
}

static void test_region_overlaps(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(RT1_ID);
    kiln_buffer *a = fake_buffer(rt, 64, KILN_DTYPE_BYTES), *b = fake_buffer(rt, 64, KILN_DTYPE_BYTES);

    kiln_region x = {a, 0, 8}, touching = {a, 8, 16}, over = {a, 7, 9}, inside = {a, 2, 3}, same = {a, 0, 8};
    kiln_region other = {b, 0, 8};
    assert_false(kiln_region_overlaps(&x, &touching));
    assert_false(kiln_region_overlaps(&touching, &x));
    assert_true(kiln_region_overlaps(&x, &over));
    assert_true(kiln_region_overlaps(&over, &touching));
    assert_true(kiln_region_overlaps(&x, &inside));
    assert_true(kiln_region_overlaps(&inside, &x));
    assert_true(kiln_region_overlaps(&x, &same));
    assert_false(kiln_region_overlaps(&x, &other));
    /* An empty or inverted region shares no byte with anything. */
    kiln_region empty = {a, 4, 4}, inverted = {a, 6, 2};
    assert_false(kiln_region_overlaps(&empty, &x));
    assert_false(kiln_region_overlaps(&x, &empty));
    assert_false(kiln_region_overlaps(&empty, &empty));
    assert_false(kiln_region_overlaps(&inverted, &x));
    assert_false(kiln_region_overlaps(&x, &inverted));
    assert_false(kiln_region_overlaps(&x, NULL));
    assert_false(kiln_region_overlaps(NULL, &x));

    fake_buffer_free(a);
    fake_buffer_free(b);
    fake_runtime_free(rt);
}

/* ---- buffers ---- */

static void test_alloc_size_and_align(void **state)
{
    (void)state;
    size_t total = 0;
    for (int k = 0; k <= 30; k++) {
        size_t align = (size_t)1 << k;
        assert_int_equal(kiln__alloc_size(1000, align, &total), 0);
        /* cuMemAlloc aligns to 256: only more than that needs slack. */
        assert_int_equal(total, align > 256 ? 1000 + align - 256 : 1000);
        /* Any 256-aligned base: the aligned block fits inside the allocation. */
        const uint64_t bases[] = {0x100, 0x7f0000000000ull, 0x7f0000000100ull, 0x7f00000fff00ull};
        for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
            uint64_t p = kiln__align_up(bases[i], align);
            assert_int_equal(p % align, 0);
            assert_true(p >= bases[i]);
            assert_true(p - bases[i] < align);
            assert_true(p + 1000 <= bases[i] + total);
        }
    }
    assert_int_equal(kiln__align_up(0x1000, 1), 0x1000);
    assert_int_equal(kiln__align_up(0x1001, 1), 0x1001);
    assert_int_equal(kiln__align_up(0x1001, 0x1000), 0x2000);
    assert_int_equal(kiln__align_up(0x2000, 0x1000), 0x2000);

    /* Overflow near SIZE_MAX. */
    assert_int_equal(kiln__alloc_size(SIZE_MAX, 512, &total), -1);
    assert_int_equal(kiln__alloc_size(SIZE_MAX - 255, 512, &total), -1);
    assert_int_equal(kiln__alloc_size(SIZE_MAX - 256, 512, &total), 0);
    assert_int_equal(total, SIZE_MAX);
    assert_int_equal(kiln__alloc_size(SIZE_MAX - 1000, (size_t)1 << 30, &total), -1);
    assert_int_equal(kiln__alloc_size(SIZE_MAX, 256, &total), 0);
    assert_int_equal(total, SIZE_MAX);
}

static void test_buffer_create_refusals(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(RT1_ID);
    kiln_buffer *b = (kiln_buffer *)(uintptr_t)1;
    kiln_buffer_desc d = {.size = sizeof d, .bytes = 0};

    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "0 bytes", NULL);
    assert_null(b);
    assert_non_null(strstr(rt->err.msg, "0 bytes"));

    d = (kiln_buffer_desc){.bytes = 1024, .alignment = 3};
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "aligned to 3",
                "power-of-two");
    d.alignment = 0x30000;
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "aligned to 196608",
                NULL);
    d.alignment = (size_t)1 << 31;
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "aligned to 2147483648",
                "2^30");
    /* The untyped form goes through the same checks. */
    KILN_EXPECT(kiln_buffer_create(rt, 64, 48, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "aligned to 48", NULL);
    KILN_EXPECT(kiln_buffer_create(rt, 0, 0, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "0 bytes", NULL);

    d = (kiln_buffer_desc){.bytes = 3, .dtype = KILN_DTYPE_F16};
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "3 bytes", "f16");
    d = (kiln_buffer_desc){.bytes = 6, .dtype = KILN_DTYPE_F32};
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "6 bytes", "f32");
    d = (kiln_buffer_desc){.bytes = 64, .dtype = (kiln_dtype)42};
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "dtype 42", NULL);

    d = (kiln_buffer_desc){.bytes = 64, .usage = (kiln_buffer_usage)6};
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "unknown usage 6", NULL);
    d.usage = (kiln_buffer_usage)-1;
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "unknown usage -1", NULL);

    /* The over-allocation for the alignment would overflow. */
    d = (kiln_buffer_desc){.bytes = SIZE_MAX - 1000, .alignment = (size_t)1 << 30};
    KILN_EXPECT(kiln_buffer_create_ex(rt, &d, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "overflows", NULL);

    KILN_EXPECT(kiln_buffer_create_ex(rt, NULL, &b), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    KILN_EXPECT(kiln_buffer_create_ex(NULL, &d, &b), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    assert_null(b);

    /* Accessors and destroy take NULL. */
    assert_int_equal(kiln_buffer_size(NULL), 0);
    assert_int_equal(kiln_buffer_device_address(NULL), 0);
    kiln_buffer_destroy(NULL);
    fake_runtime_free(rt);
}

/* ---- commands ---- */

static void test_command_op_ids(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(RT1_ID);
    char long_id[KILN_OP_ID_MAX + 1];
    memset(long_id, 'a', KILN_OP_ID_MAX);
    long_id[KILN_OP_ID_MAX] = 0;
    const char *bad[] = {"Token", "1x", "a b", "x-y", "", "_x", ".x", "tok\xc3\xa9n", long_id};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kiln_command_desc d = {.op_id = bad[i], .enqueue = never_enqueue};
        kiln_command *c = (kiln_command *)(uintptr_t)1;
        char quoted[KILN_OP_ID_MAX + 8];
        snprintf(quoted, sizeof quoted, "\"%s\"", bad[i]);
        KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), quoted,
                    "not portable");
        assert_null(c);
        assert_non_null(strstr(rt->err.msg, quoted));
    }
    kiln_command_desc d = {.op_id = NULL, .enqueue = never_enqueue};
    kiln_command *c = NULL;
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "(null)", NULL);

    /* The longest portable id (63 characters) and the allowed characters. */
    long_id[KILN_OP_ID_MAX - 1] = 0;
    const char *good[] = {long_id, "a", "transfer.copy", "token_embedding", "z9._"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        kiln_command *k = plain_command(rt, good[i], NULL);
        assert_string_equal(kiln_command_op_id(k), good[i]);
        kiln_command_release(k);
    }
    fake_runtime_free(rt);
}

static void test_command_refusals(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(RT1_ID), *rt2 = fake_runtime(RT2_ID);
    kiln_buffer *a = fake_buffer(rt, 256, KILN_DTYPE_F16), *other = fake_buffer(rt2, 256, KILN_DTYPE_F16);
    kiln_command *c = NULL;

    kiln_command_desc d = {.op_id = "probe.op", .enqueue = NULL};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "probe.op",
                "no enqueue function");

    d = (kiln_command_desc){.op_id = "probe.op", .enqueue = never_enqueue, .batching = (kiln_batching)7};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "probe.op",
                "unknown batching form 7");

    uint8_t key[KILN_REPLAY_KEY_MAX + 1] = {0};
    d = (kiln_command_desc){.op_id = "probe.op", .enqueue = never_enqueue, .replay_key = key,
                            .replay_key_bytes = KILN_REPLAY_KEY_MAX + 1};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "replay key of 1025 bytes",
                "at most 1024");
    d.replay_key = NULL;
    d.replay_key_bytes = 8;
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "replay key of 8 bytes",
                NULL);
    /* The largest key is fine. */
    d.replay_key = key;
    d.replay_key_bytes = KILN_REPLAY_KEY_MAX;
    KILN_CHECK(kiln_command_create(rt, &d, &c));
    assert_true(kiln_command_replayable(c));
    kiln_command_release(c);

    /* Regions and host bytes announced but missing. */
    d = (kiln_command_desc){.op_id = "probe.op", .enqueue = never_enqueue, .n_regions = 1};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "probe.op", NULL);
    d = (kiln_command_desc){.op_id = "probe.op", .enqueue = never_enqueue, .host_bytes = 4};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "probe.op", NULL);

    /* A region of a buffer of another runtime: both instances named. */
    kiln_region regions[2] = {{a, 0, 64}, {other, 0, 64}};
    d = (kiln_command_desc){.op_id = "probe.op", .enqueue = never_enqueue, .regions = regions, .n_regions = 2};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "region 1", "another runtime");
    assert_non_null(strstr(kiln_errmsg(), "instance 2002"));
    assert_non_null(strstr(kiln_errmsg(), "not 1001"));
    assert_non_null(strstr(rt->err.msg, "instance 2002"));

    /* An empty region (after a good one): nothing retained. */
    regions[1] = (kiln_region){a, 128, 128};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "region 1",
                "[128, 128) is empty");
    assert_non_null(strstr(kiln_errmsg(), "probe.op"));
    /* Out of bounds. */
    regions[1] = (kiln_region){a, 128, 257};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "region 1",
                "[128, 257) is outside the buffer of 256 bytes");
    regions[1] = (kiln_region){NULL, 0, 1};
    KILN_EXPECT(kiln_command_create(rt, &d, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "region 1", "no buffer");
    assert_int_equal(refs_of(a), 1);
    assert_int_equal(refs_of(other), 1);
    assert_null(c);

    KILN_EXPECT(kiln_command_create(rt, NULL, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    KILN_EXPECT(kiln_command_create(rt, &d, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    KILN_EXPECT(kiln_command_create(NULL, &d, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    kiln_command_release(NULL);
    assert_string_equal(kiln_command_op_id(NULL), "");
    assert_false(kiln_command_replayable(NULL));

    fake_buffer_free(a);
    fake_buffer_free(other);
    fake_runtime_free(rt);
    fake_runtime_free(rt2);
}

static void test_command_retains_and_copies(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(RT1_ID);
    kiln_buffer *a = fake_buffer(rt, 256, KILN_DTYPE_F16), *b = fake_buffer(rt, 128, KILN_DTYPE_U32);
    char host[16] = "fifteen bytes..";
    uint8_t key[40];
    for (size_t i = 0; i < sizeof key; i++)
        key[i] = (uint8_t)(i * 7 + 1);
    int user = 0;
    kiln_region regions[3] = {{a, 0, 64}, {a, 64, 256}, {b, 0, 128}};
    kiln_command_desc d = {.size = sizeof d,
                           .op_id = "token_embedding",
                           .batching = KILN_BATCHING_PACKED,
                           .participants = 2,
                           .tokens = 9,
                           .dispatches = 1,
                           .regions = regions,
                           .n_regions = 3,
                           .host_data = host,
                           .host_bytes = sizeof host,
                           .enqueue = never_enqueue,
                           .user = &user,
                           .user_free = count_user_free,
                           .replay_key = key,
                           .replay_key_bytes = sizeof key};
    kiln_command *c = NULL;
    g_user_frees = 0;
    KILN_CHECK(kiln_command_create(rt, &d, &c));
    assert_int_equal(refs_of(a), 3); /* one per region */
    assert_int_equal(refs_of(b), 2);
    assert_ptr_equal(c->rt, rt);
    assert_int_equal(c->batching, KILN_BATCHING_PACKED);
    assert_int_equal(c->participants, 2);
    assert_int_equal(c->tokens, 9);
    assert_int_equal(c->n_regions, 3);
    assert_int_equal(c->regions[1].start, 64);
    assert_int_equal(c->regions[1].end, 256);

    /* Host bytes, the key and the regions are the command's own copies. */
    memset(host, 'X', sizeof host);
    memset(key, 0, sizeof key);
    regions[0].start = 99;
    assert_int_equal(c->host_bytes, 16);
    assert_memory_equal(c->host_data, "fifteen bytes..", 16);
    assert_ptr_not_equal(c->host_data, host);
    assert_int_equal(c->replay_key_bytes, 40);
    for (size_t i = 0; i < sizeof key; i++)
        assert_int_equal(c->replay_key[i], (uint8_t)(i * 7 + 1));
    assert_int_equal(c->regions[0].start, 0);
    assert_true(kiln_command_replayable(c));
    assert_string_equal(kiln_command_op_id(c), "token_embedding");

    /* A second holder (a batch): the last release frees, once. */
    kiln__command_retain(c);
    kiln_command_release(c);
    assert_int_equal(g_user_frees, 0);
    assert_int_equal(refs_of(a), 3);
    kiln_command_release(c);
    assert_int_equal(g_user_frees, 1);
    assert_ptr_equal(g_user_freed, &user);
    assert_int_equal(refs_of(a), 1);
    assert_int_equal(refs_of(b), 1);

    /* Without a key: not replayable; without user_free: nothing called. */
    kiln_command *p = plain_command(rt, "plain", NULL);
    assert_false(kiln_command_replayable(p));
    kiln_command_release(p);
    assert_int_equal(g_user_frees, 1);

    fake_buffer_free(a);
    fake_buffer_free(b);
    fake_runtime_free(rt);
}

static void test_transfer_commands(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(RT1_ID), *rt2 = fake_runtime(RT2_ID);
    kiln_buffer *h = fake_buffer(rt, 256, KILN_DTYPE_F16), *f = fake_buffer(rt, 256, KILN_DTYPE_F32);
    kiln_buffer *h2 = fake_buffer(rt, 256, KILN_DTYPE_F16), *far = fake_buffer(rt2, 256, KILN_DTYPE_F16);
    kiln_command *c = NULL;

    kiln_region src = {h, 0, 64}, dst = {f, 0, 64};
    KILN_EXPECT(kiln_command_copy(rt, &src, &dst, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "source f16",
                "destination f32");
    assert_non_null(strstr(rt->err.msg, "element types differ"));

    dst = (kiln_region){h2, 0, 128};
    KILN_EXPECT(kiln_command_copy(rt, &src, &dst, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "64 bytes",
                "destination 128");

    dst = (kiln_region){h, 32, 96};
    KILN_EXPECT(kiln_command_copy(rt, &src, &dst, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "[0, 64) overlaps",
                "[32, 96)");

    dst = (kiln_region){h, 32, 32};
    KILN_EXPECT(kiln_command_copy(rt, &src, &dst, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "copy",
                "[32, 32) is empty");

    /* A region of another runtime. */
    dst = (kiln_region){far, 0, 64};
    KILN_EXPECT(kiln_command_copy(rt, &src, &dst, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "instance 2002",
                "not 1001");
    assert_null(c);
    assert_int_equal(refs_of(h), 1);

    /* Touching regions of one buffer are fine. */
    dst = (kiln_region){h, 64, 128};
    KILN_CHECK(kiln_command_copy(rt, &src, &dst, &c));
    assert_string_equal(kiln_command_op_id(c), "transfer.copy");
    assert_int_equal(c->transfers, 1);
    assert_int_equal(c->n_regions, 2);
    assert_int_equal(refs_of(h), 3);
    assert_false(kiln_command_replayable(c));
    kiln_command_release(c);
    assert_int_equal(refs_of(h), 1);

    /* Upload: the host bytes must fill the region exactly. */
    uint8_t bytes[64];
    for (size_t i = 0; i < sizeof bytes; i++)
        bytes[i] = (uint8_t)i;
    kiln_region up = {h, 0, 64};
    KILN_EXPECT(kiln_command_upload(rt, &up, bytes, 32, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "32 host bytes", "region of 64");
    KILN_EXPECT(kiln_command_upload(rt, &up, NULL, 64, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    up.end = 300;
    KILN_EXPECT(kiln_command_upload(rt, &up, bytes, 300, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "upload",
                "outside the buffer of 256 bytes");
    up.end = 64;
    KILN_CHECK(kiln_command_upload(rt, &up, bytes, 64, &c));
    memset(bytes, 0xee, sizeof bytes);
    assert_string_equal(kiln_command_op_id(c), "transfer.upload");
    assert_int_equal(c->host_bytes, 64);
    for (size_t i = 0; i < 64; i++)
        assert_int_equal(((uint8_t *)c->host_data)[i], (uint8_t)i);
    assert_int_equal(refs_of(h), 2);
    kiln_command_release(c);
    assert_int_equal(refs_of(h), 1);

    /* Zero. */
    kiln_region z = {f, 16, 48};
    KILN_CHECK(kiln_command_zero(rt, &z, &c));
    assert_string_equal(kiln_command_op_id(c), "transfer.zero");
    assert_int_equal(c->regions[0].start, 16);
    assert_int_equal(c->regions[0].end, 48);
    assert_int_equal(refs_of(f), 2);
    kiln_command_release(c);
    assert_int_equal(refs_of(f), 1);
    z.end = 16;
    KILN_EXPECT(kiln_command_zero(rt, &z, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "fill",
                "[16, 16) is empty");
    KILN_EXPECT(kiln_command_zero(rt, NULL, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    KILN_EXPECT(kiln_command_copy(rt, NULL, &dst, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL", NULL);
    /* A filled region other than zero is named for what it does. */
    z.end = 32;
    KILN_CHECK(kiln__command_fill(rt, &z, 0xab, &c));
    assert_string_equal(kiln_command_op_id(c), "transfer.fill");
    kiln_command_release(c);

    fake_buffer_free(h);
    fake_buffer_free(f);
    fake_buffer_free(h2);
    fake_buffer_free(far);
    fake_runtime_free(rt);
    fake_runtime_free(rt2);
}

/* ---- the stream state machine ---- */

#define N_STATES 4
#define N_EVENTS 6
#define FORBIDDEN (-1)

static void test_stream_transitions(void **state)
{
    (void)state;
    /* [from][event]: the next state, or FORBIDDEN. Events in enum order:
     * BEGIN, ENQUEUED, ENQUEUE_FAILED, DRAINED, SYNCED, DEVICE_FAILED. */
    static const int table[N_STATES][N_EVENTS] = {
        [KILN_STREAM_READY] = {KILN_STREAM_RECORDING, FORBIDDEN, FORBIDDEN, KILN_STREAM_READY, KILN_STREAM_READY,
                               KILN_STREAM_FAILED},
        /* Earlier batches may drain while the next one records: it stays Recording. */
        [KILN_STREAM_RECORDING] = {FORBIDDEN, KILN_STREAM_SUBMITTED, KILN_STREAM_FAILED, KILN_STREAM_RECORDING,
                                   FORBIDDEN, KILN_STREAM_FAILED},
        [KILN_STREAM_SUBMITTED] = {KILN_STREAM_RECORDING, FORBIDDEN, FORBIDDEN, KILN_STREAM_READY, KILN_STREAM_READY,
                                   KILN_STREAM_FAILED},
        /* A failed stream keeps its quarantine until synchronize. */
        [KILN_STREAM_FAILED] = {FORBIDDEN, FORBIDDEN, FORBIDDEN, KILN_STREAM_FAILED, KILN_STREAM_READY,
                                KILN_STREAM_FAILED},
    };
    static const char *const names[N_STATES] = {"Ready", "Recording", "Submitted", "Failed"};
    kiln__errslot err;
    kiln__errslot_init(&err);
    for (int from = 0; from < N_STATES; from++) {
        assert_string_equal(kiln__stream_state_name((kiln_stream_state)from), names[from]);
        for (int ev = 0; ev < N_EVENTS; ev++) {
            kiln_stream_state to = (kiln_stream_state)77;
            err.msg[0] = 0;
            kiln_status st = kiln__stream_next(&err, (kiln_stream_state)from, (kiln__stream_event)ev, &to);
            if (table[from][ev] == FORBIDDEN) {
                if (st != KILN_ERR_RUNTIME_CONTRACT)
                    fail_msg("state %s, event %d: expected a refusal, got %s (to %d)", names[from], ev,
                             kiln_status_code(st), (int)to);
                char want[64];
                snprintf(want, sizeof want, "in state %s", names[from]);
                kiln_test_expect(st, KILN_ERR_RUNTIME_CONTRACT, err.msg, want, NULL);
                kiln_test_expect(st, KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), want, NULL);
                assert_int_equal(to, 77); /* untouched */
            } else {
                if (st != KILN_OK || (int)to != table[from][ev])
                    fail_msg("state %s, event %d: expected %s, got %s and state %d", names[from], ev,
                             names[table[from][ev]], kiln_status_code(st), (int)to);
                assert_string_equal(err.msg, "");
            }
        }
        kiln_stream_state to = KILN_STREAM_READY;
        kiln_status st = kiln__stream_next(&err, (kiln_stream_state)from, (kiln__stream_event)N_EVENTS, &to);
        kiln_test_expect(st, KILN_ERR_RUNTIME_CONTRACT, err.msg, "unknown event", names[from]);
    }
    /* The messages say what to do. */
    kiln_stream_state to;
    kiln__stream_next(&err, KILN_STREAM_FAILED, KILN__EV_BEGIN, &to);
    assert_non_null(strstr(err.msg, "kiln_stream_synchronize"));
    kiln__stream_next(&err, KILN_STREAM_RECORDING, KILN__EV_BEGIN, &to);
    assert_non_null(strstr(err.msg, "already Recording"));
    /* A NULL slot still leaves the thread's message. */
    KILN_EXPECT(kiln__stream_next(NULL, KILN_STREAM_READY, KILN__EV_ENQUEUED, &to), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "in state Ready", "no batch is being recorded");
    assert_string_equal(kiln__stream_state_name((kiln_stream_state)9), "unknown");
    kiln__errslot_destroy(&err);
}

/* ---- submission checks ---- */

typedef struct submit_fixture {
    kiln_runtime *rt, *rt2;
    kiln_stream *s;
    kiln_command *rep[4], *plain, *foreign;
    kiln_binding_slot slots[3];
    kiln_binding_arena arena, foreign_arena;
} submit_fixture;

static int submit_setup(void **state)
{
    submit_fixture *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->rt = fake_runtime(RT1_ID);
    f->rt2 = fake_runtime(RT2_ID);
    f->s = fake_stream(f->rt, KILN_STREAM_READY);
    for (int i = 0; i < 4; i++)
        f->rep[i] = plain_command(f->rt, "replayable.op", "key");
    f->plain = plain_command(f->rt, "plain.op", NULL);
    f->foreign = plain_command(f->rt2, "foreign.op", "key");
    f->slots[0] = (kiln_binding_slot){0, 16};
    f->slots[1] = (kiln_binding_slot){16, 8};
    f->slots[2] = (kiln_binding_slot){24, 40};
    f->arena = (kiln_binding_arena){.rt = f->rt, .slots = f->slots, .n_slots = 3, .total = 64};
    f->foreign_arena = (kiln_binding_arena){.rt = f->rt2, .slots = f->slots, .n_slots = 3, .total = 64};
    *state = f;
    return 0;
}

static int submit_teardown(void **state)
{
    submit_fixture *f = *state;
    for (int i = 0; i < 4; i++)
        kiln_command_release(f->rep[i]);
    kiln_command_release(f->plain);
    kiln_command_release(f->foreign);
    free(f->s);
    fake_runtime_free(f->rt);
    fake_runtime_free(f->rt2);
    free(f);
    return 0;
}

/* Validates and checks that the stream's state did not move. */
static kiln_status validate(submit_fixture *f, kiln_command *const *cmds, size_t n, const kiln_submit_options *o)
{
    kiln_stream_state before = f->s->state;
    kiln_status st = kiln__submit_validate(f->s, cmds, n, o);
    assert_int_equal(f->s->state, before);
    if (st)
        assert_string_equal(f->rt->err.msg, kiln_errmsg());
    return st;
}

static void test_submit_batch_and_state(void **state)
{
    submit_fixture *f = *state;
    kiln_submit_options o = {.size = sizeof o};
    kiln_command *cmds[4] = {f->rep[0], f->plain, f->rep[1], f->rep[2]};

    KILN_EXPECT(validate(f, cmds, 0, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "got 0", NULL);
    KILN_EXPECT(validate(f, NULL, 2, &o), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "command list is NULL", "n = 2");

    kiln_command *with_null[3] = {f->rep[0], f->rep[1], NULL};
    KILN_EXPECT(validate(f, with_null, 3, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "command 2 is NULL", NULL);

    kiln_command *mixed[3] = {f->rep[0], f->foreign, f->rep[1]};
    KILN_EXPECT(validate(f, mixed, 3, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "command 1 (foreign.op)",
                "instance 2002, the stream to 1001");

    f->s->state = KILN_STREAM_FAILED;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "Failed",
                "kiln_stream_synchronize");
    f->s->state = KILN_STREAM_RECORDING;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "Recording", NULL);
    /* Submitted: more batches may follow. */
    f->s->state = KILN_STREAM_SUBMITTED;
    KILN_CHECK(validate(f, cmds, 4, &o));
    f->s->state = KILN_STREAM_READY;
    KILN_CHECK(validate(f, cmds, 4, &o));
    KILN_CHECK(validate(f, cmds, 1, &o));

    o.path = (kiln_compute_path)4;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "compute path 4", NULL);
    o.path = (kiln_compute_path)-1;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "compute path -1", NULL);
    o.path = KILN_PATH_EAGER_ONLY;
    o.timing = (kiln_timing)3;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "timing mode 3", NULL);
    for (int t = KILN_TIMING_OFF; t <= KILN_TIMING_SPANS; t++) {
        o.timing = (kiln_timing)t;
        KILN_CHECK(validate(f, cmds, 4, &o));
    }
    o.phase = "decode";
    KILN_CHECK(validate(f, cmds, 4, &o));
}

static void test_submit_paths(void **state)
{
    submit_fixture *f = *state;
    kiln_command *cmds[4] = {f->rep[0], f->rep[1], f->plain, f->rep[2]};
    kiln_submit_options o = {.size = sizeof o, .path = KILN_PATH_REPLAYED_ONLY};

    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "command 2 (plain.op)",
                "replayed-only");
    kiln_command *all_rep[3] = {f->rep[0], f->rep[1], f->rep[2]};
    KILN_CHECK(validate(f, all_rep, 3, &o));

    /* Adaptive and eager take anything. */
    o.path = KILN_PATH_ADAPTIVE;
    KILN_CHECK(validate(f, cmds, 4, &o));
    o.path = KILN_PATH_EAGER_ONLY;
    KILN_CHECK(validate(f, cmds, 4, &o));

    o.path = KILN_PATH_REPLAYED_WITH_EAGER_BOUNDARIES;
    uint32_t at2[] = {2}, at1[] = {1}, at13[] = {1, 3}, at023[] = {0, 2, 3};
    o.eager_boundaries = at2;
    o.n_eager_boundaries = 1;
    KILN_CHECK(validate(f, cmds, 4, &o));
    o.eager_boundaries = at023;
    o.n_eager_boundaries = 3;
    KILN_CHECK(validate(f, cmds, 4, &o));
    o.eager_boundaries = at1;
    o.n_eager_boundaries = 1;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "command 2 (plain.op)",
                "does not declare it an eager boundary");
    o.eager_boundaries = at13;
    o.n_eager_boundaries = 2;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "command 2 (plain.op)", NULL);
    o.n_eager_boundaries = 0;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "command 2 (plain.op)", NULL);
    KILN_CHECK(validate(f, all_rep, 3, &o));

    uint32_t out_of_range[] = {2, 4}, repeated[] = {2, 2}, decreasing[] = {3, 2};
    o.eager_boundaries = out_of_range;
    o.n_eager_boundaries = 2;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "eager boundary 1 is 4",
                "below 4");
    o.eager_boundaries = repeated;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "eager boundary 1 is 2",
                "increasing");
    o.eager_boundaries = decreasing;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "eager boundary 1 is 2",
                "increasing");
    o.eager_boundaries = NULL;
    o.n_eager_boundaries = 1;
    KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "eager boundaries missing", NULL);

    /* Boundaries are for that path only. */
    o.eager_boundaries = at2;
    o.n_eager_boundaries = 1;
    const kiln_compute_path others[] = {KILN_PATH_ADAPTIVE, KILN_PATH_EAGER_ONLY, KILN_PATH_REPLAYED_ONLY};
    for (size_t i = 0; i < 3; i++) {
        o.path = others[i];
        KILN_EXPECT(validate(f, cmds, 4, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                    "replayed-with-eager-boundaries path only", NULL);
    }
}

static void test_submit_patches(void **state)
{
    submit_fixture *f = *state;
    kiln_command *cmds[2] = {f->rep[0], f->plain};
    uint32_t ids[4] = {1, 2, 3, 4};
    kiln_binding_patch p[2] = {{.slot = 0, .offset = 0, .data = ids, .bytes = 16},
                               {.slot = 2, .offset = 8, .data = ids, .bytes = 8}};
    kiln_submit_options o = {.size = sizeof o, .patches = p, .n_patches = 2};

    KILN_EXPECT(validate(f, cmds, 2, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "2 patches and no arena", NULL);
    o.arena = &f->foreign_arena;
    KILN_EXPECT(validate(f, cmds, 2, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "another runtime", NULL);
    /* The arena's runtime is named beside the stream's. */
    assert_non_null(strstr(kiln_errmsg(), "2002"));
    assert_non_null(strstr(kiln_errmsg(), "1001"));
    /* An arena of another runtime is refused even without patches. */
    o.n_patches = 0;
    KILN_EXPECT(validate(f, cmds, 2, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "another runtime", NULL);

    o.arena = &f->arena;
    o.n_patches = 2;
    KILN_CHECK(validate(f, cmds, 2, &o));
    o.n_patches = 0;
    KILN_CHECK(validate(f, cmds, 2, &o));
    o.patches = NULL;
    KILN_CHECK(validate(f, cmds, 2, &o));

    /* The patch checks run under submission too. */
    p[1].bytes = 40;
    o.patches = p;
    o.n_patches = 2;
    KILN_EXPECT(validate(f, cmds, 2, &o), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "binding patch 1",
                "slot 2 of 40 bytes");
    o.patches = NULL;
    KILN_EXPECT(validate(f, cmds, 2, &o), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL list of 2", NULL);
}

/* ---- binding layouts and patches ---- */

static void test_binding_layout(void **state)
{
    (void)state;
    kiln__errslot err;
    kiln__errslot_init(&err);
    const kiln_binding_slot good[3] = {{0, 16}, {16, 8}, {24, 40}};
    KILN_CHECK(kiln__binding_layout_check(&err, good, 3, 64));
    KILN_CHECK(kiln__binding_layout_check(&err, good, 1, 16));

    KILN_EXPECT(kiln__binding_layout_check(&err, good, 0, 64), KILN_ERR_RUNTIME_CONTRACT, err.msg, "0 slots",
                "64 bytes");
    KILN_EXPECT(kiln__binding_layout_check(&err, good, 3, 0), KILN_ERR_RUNTIME_CONTRACT, err.msg, "3 slots",
                "0 bytes");
    /* Too many slots for a uint32_t slot index: refused before any is read. */
    KILN_EXPECT(kiln__binding_layout_check(&err, good, (size_t)UINT32_MAX + 1, 64), KILN_ERR_RUNTIME_CONTRACT,
                err.msg, "4294967296 slots", NULL);

    const kiln_binding_slot gap[3] = {{0, 16}, {20, 8}, {28, 36}};
    KILN_EXPECT(kiln__binding_layout_check(&err, gap, 3, 64), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 1 starts at 20, expected 16", "a gap");
    const kiln_binding_slot overlap[3] = {{0, 16}, {12, 8}, {20, 44}};
    KILN_EXPECT(kiln__binding_layout_check(&err, overlap, 3, 64), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 1 starts at 12, expected 16", "overlap");
    const kiln_binding_slot unordered[3] = {{16, 8}, {0, 16}, {24, 40}};
    KILN_EXPECT(kiln__binding_layout_check(&err, unordered, 3, 64), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 0 starts at 16, expected 0", "a gap");
    const kiln_binding_slot unordered2[3] = {{0, 16}, {24, 40}, {16, 8}};
    KILN_EXPECT(kiln__binding_layout_check(&err, unordered2, 3, 64), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 1 starts at 24, expected 16", "a gap");
    const kiln_binding_slot repeated[3] = {{0, 16}, {16, 8}, {0, 16}};
    KILN_EXPECT(kiln__binding_layout_check(&err, repeated, 3, 40), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 2 starts at 0, expected 24", "out of order");
    const kiln_binding_slot empty[3] = {{0, 16}, {16, 0}, {16, 48}};
    KILN_EXPECT(kiln__binding_layout_check(&err, empty, 3, 64), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 1 [16, +0) is empty", NULL);
    const kiln_binding_slot overflow[2] = {{0, 16}, {SIZE_MAX, 2}};
    KILN_EXPECT(kiln__binding_layout_check(&err, overflow, 2, 64), KILN_ERR_RUNTIME_CONTRACT, err.msg, "slot 1",
                "overflows");
    const kiln_binding_slot overflow2[2] = {{0, 16}, {16, SIZE_MAX - 8}};
    KILN_EXPECT(kiln__binding_layout_check(&err, overflow2, 2, 64), KILN_ERR_RUNTIME_CONTRACT, err.msg, "slot 1",
                "overflows");

    KILN_EXPECT(kiln__binding_layout_check(&err, good, 3, 80), KILN_ERR_RUNTIME_CONTRACT, err.msg, "cover 64 bytes",
                "has 80");
    KILN_EXPECT(kiln__binding_layout_check(&err, good, 3, 48), KILN_ERR_RUNTIME_CONTRACT, err.msg, "cover 64 bytes",
                "has 48");
    assert_string_equal(err.msg, kiln_errmsg());

    /* The public constructor checks before it allocates anything. */
    kiln_runtime *rt = fake_runtime(RT1_ID);
    kiln_binding_arena *a = (kiln_binding_arena *)(uintptr_t)1;
    KILN_EXPECT(kiln_binding_arena_create(rt, gap, 3, 64, &a), KILN_ERR_RUNTIME_CONTRACT, rt->err.msg, "a gap", NULL);
    assert_null(a);
    KILN_EXPECT(kiln_binding_arena_create(rt, NULL, 3, 64, &a), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL",
                NULL);
    KILN_EXPECT(kiln_binding_arena_create(rt, NULL, 0, 64, &a), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "0 slots",
                NULL);
    kiln_binding_arena_destroy(NULL);
    fake_runtime_free(rt);
    kiln__errslot_destroy(&err);
}

static void test_binding_patches(void **state)
{
    (void)state;
    kiln__errslot err;
    kiln__errslot_init(&err);
    const kiln_binding_slot slots[3] = {{0, 16}, {16, 8}, {24, 40}};
    const uint8_t data[64] = {0};
    kiln_binding_patch p[4];

    /* A valid sorted list: whole slot, touching patches in one slot. */
    p[0] = (kiln_binding_patch){0, 0, data, 16};
    p[1] = (kiln_binding_patch){1, 0, data, 4};
    p[2] = (kiln_binding_patch){1, 4, data, 4};
    p[3] = (kiln_binding_patch){2, 32, data, 8};
    KILN_CHECK(kiln__binding_patches_check(&err, slots, 3, p, 4));
    KILN_CHECK(kiln__binding_patches_check(&err, slots, 3, NULL, 0));
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, NULL, 2), KILN_ERR_INVALID_ARGUMENT, err.msg,
                "NULL list of 2", NULL);

    kiln_binding_patch q[2];
    q[0] = (kiln_binding_patch){3, 0, data, 4};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 1), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "binding patch 0: slot 3 of 3", NULL);
    q[0] = (kiln_binding_patch){UINT32_MAX, 0, data, 4};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 1), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 4294967295 of 3", NULL);

    q[0] = (kiln_binding_patch){1, 2, data, 0};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 1), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "[2, +0) is empty", "slot 1 of 8 bytes");
    q[0] = (kiln_binding_patch){1, 0, NULL, 4};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 1), KILN_ERR_INVALID_ARGUMENT, err.msg,
                "binding patch 0 (slot 1)", "data is NULL");
    q[0] = (kiln_binding_patch){1, 4, data, 5};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 1), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "[4, +5) is empty or outside slot 1 of 8 bytes", NULL);
    q[0] = (kiln_binding_patch){1, 8, data, 1};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 1), KILN_ERR_RUNTIME_CONTRACT, err.msg, "[8, +1)",
                NULL);
    q[0] = (kiln_binding_patch){2, SIZE_MAX, data, 2};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 1), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 2 of 40 bytes", NULL);
    q[0] = (kiln_binding_patch){2, 8, data, SIZE_MAX};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 1), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "slot 2 of 40 bytes", NULL);

    /* Out of order by slot, then by offset within a slot. */
    q[0] = (kiln_binding_patch){2, 0, data, 4};
    q[1] = (kiln_binding_patch){0, 0, data, 4};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 2), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "patch 1 (slot 0, offset 0) comes before patch 0", NULL);
    q[0] = (kiln_binding_patch){0, 8, data, 4};
    q[1] = (kiln_binding_patch){0, 0, data, 4};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 2), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "patch 1 (slot 0, offset 0) comes before patch 0", NULL);
    /* Overlapping within a slot. */
    q[0] = (kiln_binding_patch){2, 0, data, 8};
    q[1] = (kiln_binding_patch){2, 4, data, 8};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 2), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "patch 1 (slot 2, offset 4) overlaps patch 0", NULL);
    /* The same bytes twice. */
    q[1] = q[0];
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, q, 2), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "patch 1 (slot 2, offset 0) overlaps patch 0", NULL);
    /* The last bad patch of a longer list is found. */
    p[3] = (kiln_binding_patch){1, 6, data, 2};
    KILN_EXPECT(kiln__binding_patches_check(&err, slots, 3, p, 4), KILN_ERR_RUNTIME_CONTRACT, err.msg,
                "patch 3 (slot 1, offset 6) overlaps patch 2", NULL);
    assert_string_equal(err.msg, kiln_errmsg());
    kiln__errslot_destroy(&err);
}

/* ---- the size field of the options structs ---- */

static CUresult ctx_current(CUcontext *c)
{
    *c = (CUcontext)0x1;
    return CUDA_SUCCESS;
}

static void test_options_size(void **state)
{
    (void)state;
    /* Refused before the driver is loaded, so without a GPU too. */
    kiln_runtime *made = (kiln_runtime *)(uintptr_t)1;
    for (uint32_t size = 1; size < sizeof(uint32_t); size++) {
        kiln_runtime_options ro = {.size = size};
        KILN_EXPECT(kiln_runtime_create(&ro, &made), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                    "kiln_runtime_options.size is", "inside the size field");
        assert_null(made);
    }

    /* A broken runtime fails at kiln__runtime_enter, after every check of the
     * description and before any driver call: reaching it shows a field was
     * not read. */
    kiln_runtime *rt = fake_runtime(RT1_ID);
    atomic_store(&rt->broken, (int)KILN_ERR_CUDA_ILLEGAL_ADDRESS);
    kiln_buffer *b = NULL;
    kiln_buffer_desc bd = {.size = sizeof bd, .bytes = 1024, .alignment = 3};
    KILN_EXPECT(kiln_buffer_create_ex(rt, &bd, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "aligned to 3", NULL);
    bd.size = 0;
    KILN_EXPECT(kiln_buffer_create_ex(rt, &bd, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "aligned to 3", NULL);
    bd.size = sizeof bd + 16; /* a newer header's: the fields known here are read */
    KILN_EXPECT(kiln_buffer_create_ex(rt, &bd, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "aligned to 3", NULL);
    bd.size = offsetof(kiln_buffer_desc, alignment); /* alignment, dtype and usage take 0 */
    bd.dtype = (kiln_dtype)42;
    bd.usage = (kiln_buffer_usage)9;
    KILN_EXPECT(kiln_buffer_create_ex(rt, &bd, &b), KILN_ERR_CUDA_ILLEGAL_ADDRESS, kiln_errmsg(), "failed earlier",
                NULL);
    bd = (kiln_buffer_desc){.size = offsetof(kiln_buffer_desc, dtype), .bytes = 3, .dtype = KILN_DTYPE_F16};
    KILN_EXPECT(kiln_buffer_create_ex(rt, &bd, &b), KILN_ERR_CUDA_ILLEGAL_ADDRESS, kiln_errmsg(), "failed earlier",
                NULL);
    bd.size = 2;
    KILN_EXPECT(kiln_buffer_create_ex(rt, &bd, &b), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_buffer_desc.size is 2", "sizeof(kiln_buffer_desc)");
    assert_non_null(strstr(rt->err.msg, "kiln_buffer_desc.size is 2"));
    assert_null(b);
    fake_runtime_free(rt);

    /* A command description that stops before the replay key is not replayable. */
    rt = fake_runtime(RT1_ID);
    kiln_command *c = NULL;
    kiln_command_desc cd = {.size = sizeof cd, .op_id = "sized.op", .enqueue = never_enqueue,
                            .user = &g_user_frees, .user_free = count_user_free, .replay_key = "k",
                            .replay_key_bytes = 1};
    KILN_CHECK(kiln_command_create(rt, &cd, &c));
    assert_true(kiln_command_replayable(c));
    g_user_frees = 0;
    kiln_command_release(c);
    assert_int_equal(g_user_frees, 1);
    cd.size = offsetof(kiln_command_desc, replay_key);
    KILN_CHECK(kiln_command_create(rt, &cd, &c));
    assert_false(kiln_command_replayable(c));
    kiln_command_release(c);
    cd.size = offsetof(kiln_command_desc, user_free); /* and without user_free, nothing is freed */
    KILN_CHECK(kiln_command_create(rt, &cd, &c));
    g_user_frees = 0;
    kiln_command_release(c);
    assert_int_equal(g_user_frees, 0);
    cd.size = offsetof(kiln_command_desc, enqueue);
    KILN_EXPECT(kiln_command_create(rt, &cd, &c), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "no enqueue function",
                NULL);
    cd.size = 3;
    KILN_EXPECT(kiln_command_create(rt, &cd, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_command_desc.size is 3", NULL);
    assert_null(c);

    /* Submit options: validation needs the context current, which a stub
     * driver of one entry point gives; prepare on the eager path stops after
     * validating. */
    kiln__driver stub = {.cuCtxGetCurrent = ctx_current};
    rt->d = &stub;
    rt->ctx = (CUcontext)0x1;
    kiln_stream *s = fake_stream(rt, KILN_STREAM_READY);
    kiln_command *cmd = plain_command(rt, "plain.op", NULL);
    kiln_submit_options so = {.size = sizeof so, .path = KILN_PATH_EAGER_ONLY, .timing = (kiln_timing)3};
    KILN_EXPECT(kiln_stream_prepare(s, &cmd, 1, &so, NULL), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "timing mode 3", NULL);
    so.size = offsetof(kiln_submit_options, timing);
    KILN_CHECK(kiln_stream_prepare(s, &cmd, 1, &so, NULL));
    so.size = 2;
    KILN_EXPECT(kiln_stream_prepare(s, &cmd, 1, &so, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_stream_prepare: kiln_submit_options.size is 2", NULL);
    kiln_fence *fence = (kiln_fence *)(uintptr_t)1;
    KILN_EXPECT(kiln_stream_submit(s, &cmd, 1, &so, &fence), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_stream_submit: kiln_submit_options.size is 2", NULL);
    assert_null(fence);
    assert_int_equal(s->state, KILN_STREAM_READY);

    /* Graph options that stop before the buckets keep the default buckets. */
    KILN_CHECK(kiln__graph_cache_create(rt, &s->graphs));
    const uint32_t buckets[] = {3, 5};
    kiln_graph_options go = {.size = sizeof go, .buckets = buckets, .n_buckets = 2};
    uint32_t bucket = 0;
    KILN_CHECK(kiln_stream_set_graph_options(s, &go));
    KILN_CHECK(kiln_stream_batch_bucket(s, 3, &bucket));
    assert_int_equal(bucket, 3);
    go.size = offsetof(kiln_graph_options, buckets);
    KILN_CHECK(kiln_stream_set_graph_options(s, &go));
    KILN_CHECK(kiln_stream_batch_bucket(s, 3, &bucket));
    assert_int_equal(bucket, 4);
    go.size = 1;
    KILN_EXPECT(kiln_stream_set_graph_options(s, &go), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_graph_options.size is 1", NULL);
    KILN_CHECK(kiln_stream_batch_bucket(s, 3, &bucket));
    assert_int_equal(bucket, 4); /* unchanged */
    kiln__graph_cache_destroy(s->graphs);
    kiln_command_release(cmd);
    free(s);
    fake_runtime_free(rt);
}

/* The dense providers' candidate timing gives up on a runtime without a driver. */
static void test_device_timer_without_driver(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(RT1_ID);
    kiln__device_timer *t = (kiln__device_timer *)(uintptr_t)1;
    assert_int_not_equal(kiln__device_timer_create(rt, &t), CUDA_SUCCESS);
    assert_null(t);
    kiln__device_timer_destroy(NULL);
    fake_runtime_free(rt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_region_check),
        cmocka_unit_test(test_region_overlaps),
        cmocka_unit_test(test_alloc_size_and_align),
        cmocka_unit_test(test_buffer_create_refusals),
        cmocka_unit_test(test_command_op_ids),
        cmocka_unit_test(test_command_refusals),
        cmocka_unit_test(test_command_retains_and_copies),
        cmocka_unit_test(test_transfer_commands),
        cmocka_unit_test(test_stream_transitions),
        cmocka_unit_test_setup_teardown(test_submit_batch_and_state, submit_setup, submit_teardown),
        cmocka_unit_test_setup_teardown(test_submit_paths, submit_setup, submit_teardown),
        cmocka_unit_test_setup_teardown(test_submit_patches, submit_setup, submit_teardown),
        cmocka_unit_test(test_binding_layout),
        cmocka_unit_test(test_binding_patches),
        cmocka_unit_test(test_options_size),
        cmocka_unit_test(test_device_timer_without_driver),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
