/* The MoE router without a GPU: its specializations (listed for a config
 * with experts, none for a dense one), each compiled by NVRTC for sm_90 in
 * f16 and bf16 at the sizes of Mixtral, Qwen2-MoE, Qwen3-MoE and the limits,
 * the spec's refusals, and the validation of bindings against fake buffers. */
#include "providers/internal.h"
#include "offline_fixture.h"
#include "fake_runtime.h"
#include "testutil.h"

typedef offline_fixture fixture;

typedef struct spec_list {
    kiln_spec items[4];
    size_t n;
} spec_list;

static kiln_status collect(void *user, const kiln_spec *spec)
{
    spec_list *l = user;
    assert_true(l->n < 4);
    l->items[l->n++] = *spec;
    return KILN_OK;
}

static void test_specs_listed_and_compiled(void **state)
{
    fixture *f = *state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    spec_list l = {.n = 0};
    KILN_CHECK(kiln__moe_router_specs(&c, collect, &l));
    assert_int_equal(l.n, 0); /* dense: nothing */
    c.num_experts = 128;
    c.num_experts_per_tok = 8;
    c.norm_topk_prob = 1;
    c.dtype = KILN_DTYPE_BF16;
    KILN_CHECK(kiln__moe_router_specs(&c, collect, &l));
    assert_int_equal(l.n, 1);
    kiln_spec want;
    KILN_CHECK(kiln_op_moe_router_spec(KILN_DTYPE_BF16, 128, 8, 1, &want));
    assert_memory_equal(&l.items[0], &want, sizeof want);
    char text[256];
    KILN_CHECK(kiln_spec_constants_text(&want, text, sizeof text));
    assert_string_equal(text, "BF16=1;EXPERTS=128;NORMALIZE=1;TOP_K=8"); /* sorted by name */
    /* Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-like, the limits and odd sizes. */
    static const struct { int64_t e, k; int norm; } sizes[] = {{8, 2, 1}, {60, 4, 0}, {128, 8, 1}, {256, 8, 1},
                                                              {512, 16, 0}, {1, 1, 0}, {33, 16, 1}, {100, 3, 0}};
    size_t total = 0;
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            kiln_spec s;
            int compiled = 0;
            KILN_CHECK(kiln_op_moe_router_spec(b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16, sizes[i].e, sizes[i].k,
                                               sizes[i].norm, &s));
            kiln_status st = kiln_jit_prepare(f->jit, &s, &compiled);
            if (st)
                fail_msg("moe_router E %lld K %lld: %s: %s", (long long)sizes[i].e, (long long)sizes[i].k,
                         kiln_status_code(st), kiln_errmsg());
            assert_true(compiled);
            total++;
        }
    kiln_jit_counters k;
    kiln_jit_get_counters(f->jit, &k);
    assert_int_equal(k.compiles, total);
    assert_int_equal(k.compile_errors, 0);
}

static void test_spec_refusals(void **state)
{
    (void)state;
    kiln_spec s;
    KILN_EXPECT(kiln_op_moe_router_spec(KILN_DTYPE_F16, 513, 8, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "experts 513", "1..512");
    KILN_EXPECT(kiln_op_moe_router_spec(KILN_DTYPE_F16, 8, 9, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "top_k 9", NULL);
    KILN_EXPECT(kiln_op_moe_router_spec(KILN_DTYPE_F16, 64, 17, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "top_k 17", NULL);
    KILN_EXPECT(kiln_op_moe_router_spec(KILN_DTYPE_F16, 64, 0, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "top_k 0", NULL);
    KILN_EXPECT(kiln_op_moe_router_spec(KILN_DTYPE_F16, 64, 2, 2, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "normalize 2", NULL);
    KILN_EXPECT(kiln_op_moe_router_spec(KILN_DTYPE_F32, 64, 2, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_router", NULL);
    KILN_EXPECT(kiln_op_moe_router_spec(KILN_DTYPE_F16, 64, 2, 0, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "out is NULL", NULL);
    size_t bytes = 1;
    KILN_CHECK(kiln_op_moe_router_workspace(64, 128, &bytes));
    assert_int_equal(bytes, 0);
}

static kiln_tensor view(kiln_buffer *b, size_t offset, kiln_dtype dt, int64_t d0, int64_t d1)
{
    kiln_tensor t = {.buffer = b, .offset = offset, .dtype = dt, .rank = 2, .dims = {d0, d1}};
    return t;
}

static void test_validation_names_binding_and_values(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(4242);
    kiln_buffer *buf = fake_buffer(rt, 16 << 20, KILN_DTYPE_BYTES);
    const size_t MB = 1 << 20;
    kiln_tensor lg = view(buf, 0, KILN_DTYPE_F16, 64, 128), ids = view(buf, 4 * MB, KILN_DTYPE_U32, 64, 8),
                w = view(buf, 8 * MB, KILN_DTYPE_F32, 64, 8);
    kiln_moe_router_desc d = {.size = sizeof d, .logits = &lg, .ids = &ids, .weights = &w, .top_k = 8, .normalize = 1};
    kiln_dtype elt;
    size_t bytes[3];
    KILN_CHECK(kiln__moe_router_check(rt, &d, &elt, bytes));
    assert_int_equal(elt, KILN_DTYPE_F16);
    assert_int_equal(bytes[0], 64 * 128 * 2);
    assert_int_equal(bytes[1], 64 * 8 * 4);
    kiln_moe_router_desc e = d;
    e.top_k = 17;
    KILN_EXPECT(kiln__moe_router_check(rt, &e, &elt, bytes), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "top_k 17",
                "min(experts 128, 16)");
    e.top_k = 0;
    KILN_EXPECT(kiln__moe_router_check(rt, &e, &elt, bytes), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "top_k 0",
                NULL);
    kiln_tensor t = lg;
    t.dims[1] = 600;
    e = d;
    e.logits = &t;
    KILN_EXPECT(kiln__moe_router_check(rt, &e, &elt, bytes), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "logits has 600 experts", "at most 512");
    t = lg;
    t.dtype = KILN_DTYPE_F32;
    KILN_EXPECT(kiln__moe_router_check(rt, &e, &elt, bytes), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding logits", "f32");
    t = ids;
    t.dims[1] = 7;
    e = d;
    e.ids = &t;
    KILN_EXPECT(kiln__moe_router_check(rt, &e, &elt, bytes), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding ids has dims [64, 7]", NULL);
    t = w;
    t.dtype = KILN_DTYPE_F16;
    e = d;
    e.weights = &t;
    KILN_EXPECT(kiln__moe_router_check(rt, &e, &elt, bytes), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding weights", "f32");
    t = w;
    t.offset = 4 * MB + 64; /* over ids */
    KILN_EXPECT(kiln__moe_router_check(rt, &e, &elt, bytes), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding ids overlaps binding weights", NULL);
    e = d;
    e.ids = NULL;
    assert_int_equal(kiln__moe_router_check(rt, &e, &elt, bytes), KILN_ERR_RUNTIME_CONTRACT);
    free(buf);
    fake_runtime_free(rt);
}

static void test_offline_encode_needs_a_device(void **state)
{
    fixture *f = *state;
    kiln_moe_router_desc d = {.size = sizeof d, .top_k = 2};
    kiln_command *cmd = (kiln_command *)1;
    KILN_EXPECT(kiln_op_moe_router_encode(f->jit, &d, &cmd), KILN_ERR_NO_DEVICE, kiln_errmsg(), "moe_router", NULL);
    assert_null(cmd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_specs_listed_and_compiled, offline_fixture_setup,
                                        offline_fixture_teardown),
        cmocka_unit_test(test_spec_refusals),
        cmocka_unit_test(test_validation_names_binding_and_values),
        cmocka_unit_test_setup_teardown(test_offline_encode_needs_a_device, offline_fixture_setup,
                                        offline_fixture_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
