/* Token embedding on the GPU: every element against a host gather, at the
 * sizes of real models and odd ones, in f16 and bf16, chunked launches, bad
 * ids, bad bindings (an out of another element type than the table's). */
#include "embedding_check.h"
#include "gpu_fixture.h"

typedef gpu_fixture fixture;

static void test_model_sizes(void **state)
{
    fixture *f = *state;
    static const int64_t hiddens[] = {896, 4096, 5120};
    static const int64_t tokens[] = {1, 7, 2048, 70000};
    for (size_t h = 0; h < 3; h++) {
        for (size_t t = 0; t < 4; t++) {
            emb_case c = {.vocab = 32000, .hidden = hiddens[h], .tokens = tokens[t], .bad_index = UINT32_MAX};
            KILN_CHECK(run_embedding_case(f->rt, f->jit, &f->rng, &c));
        }
    }
    kiln_jit_counters k;
    kiln_jit_get_counters(f->jit, &k);
    assert_int_equal(k.compiles, 3); /* one per hidden size; the token count is not a constant */
    assert_int_equal(k.memory_hits, 9);
}

static void test_real_vocabularies_and_odd_sizes(void **state)
{
    fixture *f = *state;
    static const emb_case cases[] = {
        {151936, 896, 2048, 0, 0, UINT32_MAX},  /* Qwen2.5-0.5B */
        {128256, 4096, 300, 0, 0, UINT32_MAX},  /* Llama-3-8B */
        {50001, 1000, 2048, 0, 0, UINT32_MAX},  /* odd: 125 vectors a row */
        {50001, 1000, 70000, 0, 0, UINT32_MAX},
        {50001, 1001, 2048, 0, 0, UINT32_MAX},  /* odd: scalar path */
        {1, 8, 5, 0, 0, UINT32_MAX},            /* the smallest table */
        {777, 4096, 513, 2, 2, UINT32_MAX},     /* misaligned views: scalar path */
        {777, 4096, 65535, 0, 0, UINT32_MAX},   /* exactly one full launch */
        {777, 64, 65536, 0, 0, UINT32_MAX},     /* one more than a launch */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        KILN_CHECK(run_embedding_case(f->rt, f->jit, &f->rng, &cases[i]));
}

/* bf16 tables: the same bytes copied, by their own kernel (BF16=1). */
static void test_bf16_tables(void **state)
{
    fixture *f = *state;
    static const emb_case cases[] = {
        {128256, 4096, 300, 0, 0, UINT32_MAX},  /* Llama-3-8B */
        {151936, 896, 2048, 0, 0, UINT32_MAX},  /* Qwen2.5-0.5B */
        {50001, 1001, 2048, 0, 0, UINT32_MAX},  /* scalar path */
        {777, 4096, 513, 2, 2, UINT32_MAX},     /* misaligned views: scalar path */
        {777, 64, 65536, 0, 0, UINT32_MAX},     /* one more than a launch */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        KILN_CHECK(run_embedding_case_elt(f->rt, f->jit, &f->rng, &cases[i], KILN_DTYPE_BF16));
    /* An out-of-range id: its row zeroed, the fault reported. */
    emb_case bad = {1000, 4096, 100, 0, 0, 37};
    KILN_EXPECT(run_embedding_case_elt(f->rt, f->jit, &f->rng, &bad, KILN_DTYPE_BF16), KILN_ERR_DEVICE_CONTRACT,
                kiln_runtime_errmsg(f->rt), "ids[37]", "vocabulary size");
    /* The same sizes in f16 are another kernel: one compile per type. */
    kiln_jit_counters k0, k1;
    kiln_jit_get_counters(f->jit, &k0);
    emb_case c = {.vocab = 128256, .hidden = 4096, .tokens = 3, .bad_index = UINT32_MAX};
    KILN_CHECK(run_embedding_case_elt(f->rt, f->jit, &f->rng, &c, KILN_DTYPE_F16));
    KILN_CHECK(run_embedding_case_elt(f->rt, f->jit, &f->rng, &c, KILN_DTYPE_BF16));
    kiln_jit_get_counters(f->jit, &k1);
    assert_int_equal(k1.compiles - k0.compiles, 1);
}

static void test_out_of_range_ids_are_reported_not_read(void **state)
{
    fixture *f = *state;
    static const emb_case cases[] = {
        {1000, 4096, 100, 0, 0, 37},    /* id = vocab exactly */
        {1000, 4096, 100, 0, 0, 38},    /* id far past it */
        {1000, 1001, 70000, 0, 0, 69999}, /* in the second launch, scalar path */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_status st = run_embedding_case(f->rt, f->jit, &f->rng, &cases[i]);
        char index[32];
        snprintf(index, sizeof index, "ids[%u]", cases[i].bad_index);
        KILN_EXPECT(st, KILN_ERR_DEVICE_CONTRACT, kiln_runtime_errmsg(f->rt), index, "vocabulary size");
        /* The fault is cleared: the runtime goes on working. */
        emb_case ok = cases[i];
        ok.bad_index = UINT32_MAX;
        KILN_CHECK(run_embedding_case(f->rt, f->jit, &f->rng, &ok));
    }
}

static void test_bad_bindings_are_refused_before_launch(void **state)
{
    fixture *f = *state;
    kiln_buffer *b, *small;
    KILN_CHECK(kiln_buffer_create(f->rt, 1 << 20, 0, &b));
    KILN_CHECK(kiln_buffer_create(f->rt, 64, 0, &small));
    kiln_tensor table = {.buffer = b, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {100, 1024}};
    kiln_tensor ids = {.buffer = b, .offset = 300000, .dtype = KILN_DTYPE_U32, .rank = 1, .dims = {10}};
    kiln_tensor out = {.buffer = b, .offset = 400000, .dtype = KILN_DTYPE_F16, .rank = 2, .dims = {10, 1024}};
    KILN_CHECK(kiln_op_token_embedding(f->jit, &table, &ids, &out));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));

    kiln_tensor t2 = table;
    t2.dtype = KILN_DTYPE_F32;
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &t2, &ids, &out), KILN_ERR_RUNTIME_CONTRACT,
                     kiln_runtime_errmsg(f->rt), "table must be f16", "f32");
    kiln_tensor o2 = out;
    o2.dims[1] = 512;
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &table, &ids, &o2), KILN_ERR_RUNTIME_CONTRACT,
                     kiln_errmsg(), "out", "1024");
    o2 = out;
    o2.dims[0] = 11;
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &table, &ids, &o2), KILN_ERR_RUNTIME_CONTRACT,
                     kiln_errmsg(), "out", "10");
    kiln_tensor i2 = ids;
    i2.buffer = small;
    i2.offset = 40;
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &table, &i2, &out), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                     "needs 40 bytes", "has 64");
    o2 = out;
    o2.offset = 100000; /* overlaps the table rows [0, 204800) */
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &table, &ids, &o2), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                     "overlaps table", NULL);
    i2 = ids;
    i2.offset = 300001;
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &table, &i2, &out), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                     "multiple of 4", NULL);
    i2 = ids;
    i2.dims[0] = 0;
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &table, &i2, &out), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                     "ids", NULL);
    /* One element type: the table's is out's. */
    t2 = table;
    t2.dtype = KILN_DTYPE_BF16;
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &t2, &ids, &out), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "token_embedding: binding out must be bf16", "got f16");
    o2 = out;
    o2.dtype = KILN_DTYPE_BF16;
    KILN_EXPECT(kiln_op_token_embedding(f->jit, &table, &ids, &o2), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "token_embedding: binding out must be f16", "got bf16");
    KILN_CHECK(kiln_op_token_embedding(f->jit, &t2, &ids, &o2));
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    t2 = table;
    t2.dims[1] = 70000; /* past KILN_MODEL_MAX_HIDDEN, and past the buffer */
    assert_int_equal(kiln_op_token_embedding(f->jit, &t2, &ids, &out), KILN_ERR_RUNTIME_CONTRACT);
    /* Nothing was launched by the refused calls; the runtime is fine. */
    KILN_CHECK(kiln_runtime_synchronize(f->rt));
    kiln_buffer_destroy(small);
    kiln_buffer_destroy(b);
}

static void test_buffers(void **state)
{
    fixture *f = *state;
    kiln_buffer *b;
    KILN_CHECK(kiln_buffer_create(f->rt, 1000, 4096, &b));
    assert_int_equal(kiln_buffer_device_address(b) % 4096, 0);
    uint8_t in[1000], back[1000];
    kiln_rng_fill(&f->rng, in, sizeof in);
    KILN_CHECK(kiln_buffer_upload(b, 0, in, sizeof in));
    KILN_CHECK(kiln_buffer_readback(b, 0, back, sizeof back));
    assert_memory_equal(in, back, sizeof in);
    KILN_EXPECT(kiln_buffer_upload(b, 999, in, 2), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "999", "1000");
    KILN_EXPECT(kiln_buffer_upload(b, SIZE_MAX, in, 2), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), NULL, NULL);
    KILN_EXPECT(kiln_buffer_readback(b, 0, back, 0), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "empty", NULL);
    kiln_buffer *x;
    KILN_EXPECT(kiln_buffer_create(f->rt, 10, 3, &x), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "power-of-two",
                     NULL);
    /* Out of device memory is an error, retryable, and the runtime goes on. */
    kiln_status st = kiln_buffer_create(f->rt, (size_t)1 << 50, 0, &x);
    assert_int_equal(st, KILN_ERR_CUDA_OUT_OF_MEMORY);
    assert_true(kiln_status_retryable(st));
    KILN_CHECK(kiln_buffer_create(f->rt, 1 << 20, 0, &x));
    kiln_buffer_destroy(x);
    kiln_buffer_destroy(b);
    kiln_runtime_info info;
    kiln_runtime_get_info(f->rt, &info);
    fprintf(stderr, "device: %s, %s, %d SMs, %llu MiB, driver %d\n", info.name, info.arch, info.multiprocessors,
            (unsigned long long)(info.total_memory >> 20), info.driver_version);
    assert_true(strncmp(info.arch, "sm_", 3) == 0);
}

int main(void)
{
    kiln_test_require_gpu();
#define T(fn) cmocka_unit_test_setup_teardown(fn, gpu_fixture_setup, gpu_fixture_teardown)
    const struct CMUnitTest tests[] = {
        T(test_model_sizes),
        T(test_real_vocabularies_and_odd_sizes),
        T(test_bf16_tables),
        T(test_out_of_range_ids_are_reported_not_read),
        T(test_bad_bindings_are_refused_before_launch),
        T(test_buffers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
