/* The MoE router and routed experts without a GPU. Router: its
 * specializations (listed for a config with experts, none for a dense one),
 * each compiled by NVRTC for sm_90 in f16 and bf16 at the sizes of Mixtral,
 * Qwen2-MoE, Qwen3-MoE and the limits, the spec's refusals, and the
 * validation of bindings against fake buffers. Experts: the spec compiled by
 * NVRTC for sm_90 and sm_80 in f16 and bf16 at Qwen3-30B-A3B's and Mixtral's
 * sizes, its refusals naming the value, the workspace, and encode refused
 * offline (the binding checks need a runtime: test_moe_gpu). */
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

/* Compiles spec on jit (a fresh kernel: compiled, not found), or fails naming
 * its template and constants. */
static void expect_compiled(kiln_jit *jit, const kiln_spec *spec, const char *arch)
{
    char text[256];
    KILN_CHECK(kiln_spec_constants_text(spec, text, sizeof text));
    int compiled = 0;
    kiln_status st = kiln_jit_prepare(jit, spec, &compiled);
    if (st)
        fail_msg("%s, %s %s: %s: %s", arch, spec->template_id, text, kiln_status_code(st), kiln_errmsg());
    assert_true(compiled);
}

/* jit compiled n kernels in all, none failing. */
static void expect_compiles(kiln_jit *jit, size_t n)
{
    kiln_jit_counters k;
    kiln_jit_get_counters(jit, &k);
    assert_int_equal(k.compiles, n);
    assert_int_equal(k.compile_errors, 0);
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
            KILN_CHECK(kiln_op_moe_router_spec(b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16, sizes[i].e, sizes[i].k,
                                               sizes[i].norm, &s));
            expect_compiled(f->jit, &s, "sm_90");
            total++;
        }
    expect_compiles(f->jit, total);
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

/* Qwen3-30B-A3B (hidden 2048, moe_intermediate 768, 128 experts, top 8) and
 * Mixtral-8x7B (4096, 14336, 8, 2), f16 and bf16, for sm_90 and sm_80: one
 * kernel image each, all four specs distinct. */
static void test_experts_specs_compiled(void **state)
{
    fixture *f = *state;
    static const struct { int64_t h, i, e, k; } sizes[] = {{2048, 768, 128, 8}, {4096, 14336, 8, 2}};
    static const char *const archs[] = {"sm_90", "sm_80"};
    kiln_spec specs[4];
    size_t n = 0;
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            kiln_spec *s = &specs[n++];
            KILN_CHECK(kiln_op_moe_experts_spec(b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16, sizes[i].h, sizes[i].i,
                                                sizes[i].e, sizes[i].k, s));
            assert_string_equal(s->template_id, "moe_experts");
            kiln_spec again;
            KILN_CHECK(kiln_op_moe_experts_spec(b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16, sizes[i].h, sizes[i].i,
                                                sizes[i].e, sizes[i].k, &again));
            assert_memory_equal(s, &again, sizeof again);
        }
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < i; j++) {
            char a[256], b[256];
            KILN_CHECK(kiln_spec_constants_text(&specs[i], a, sizeof a));
            KILN_CHECK(kiln_spec_constants_text(&specs[j], b, sizeof b));
            assert_string_not_equal(a, b);
        }
    for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++) {
        kiln_jit_options jo = {.cache = f->cache, .arch = archs[a]};
        kiln_jit *jit;
        KILN_CHECK(kiln_jit_create(&jo, &jit));
        for (size_t i = 0; i < n; i++)
            expect_compiled(jit, &specs[i], archs[a]);
        expect_compiles(jit, n);
        kiln_jit_destroy(jit);
    }
}

/* The wgmma products: listed for sm_90 (or an unknown arch) for sizes they
 * serve unless KILN_MOE_WGMMA=0; the TMA decode products for sm_90 unless
 * KILN_MOE_TMA=0; both compiled by NVRTC for sm_90 at Qwen3-30B-A3B's,
 * Qwen2-MoE's and Mixtral's sizes in f16 and bf16. */
static void test_experts_wgmma_listed_and_compiled(void **state)
{
    fixture *f = *state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    c.num_experts = 128;
    c.num_experts_per_tok = 8;
    c.hidden_size = 2048;
    c.moe_intermediate_size = 768;
    spec_list l = {.n = 0};
    setenv("KILN_MOE_WGMMA", "0", 1);
    KILN_CHECK(kiln__moe_experts_arch_specs(&c, "sm_90", collect, &l));
    assert_int_equal(l.n, 2);
    assert_string_equal(l.items[1].template_id, "moe_experts_tma");
    setenv("KILN_MOE_TMA", "0", 1);
    l.n = 0;
    KILN_CHECK(kiln__moe_experts_arch_specs(&c, "sm_90", collect, &l));
    assert_int_equal(l.n, 1);
    unsetenv("KILN_MOE_WGMMA");
    l.n = 0;
    KILN_CHECK(kiln__moe_experts_arch_specs(&c, "sm_90", collect, &l));
    assert_int_equal(l.n, 2);
    assert_string_equal(l.items[1].template_id, "moe_experts_wgmma");
    unsetenv("KILN_MOE_TMA");
    l.n = 0;
    KILN_CHECK(kiln__moe_experts_arch_specs(&c, "sm_80", collect, &l));
    assert_int_equal(l.n, 1);
    assert_string_equal(l.items[0].template_id, "moe_experts");
    l.n = 0;
    c.moe_intermediate_size = 704; /* not a multiple of 128: no wgmma products */
    KILN_CHECK(kiln__moe_experts_arch_specs(&c, "sm_90", collect, &l));
    assert_int_equal(l.n, 2);
    assert_string_equal(l.items[1].template_id, "moe_experts_tma");
    static const struct { int64_t h, i, e, k; } sizes[] = {{2048, 768, 128, 8}, {2048, 1408, 60, 4}, {4096, 14336, 8, 2}};
    kiln_jit_options jo = {.cache = f->cache, .arch = "sm_90"};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    size_t total = 0;
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            c.dtype = b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
            c.hidden_size = sizes[i].h;
            c.moe_intermediate_size = sizes[i].i;
            c.num_experts = sizes[i].e;
            c.num_experts_per_tok = sizes[i].k;
            l.n = 0;
            KILN_CHECK(kiln__moe_experts_arch_specs(&c, i ? NULL : "sm_90", collect, &l));
            assert_int_equal(l.n, 3);
            assert_string_equal(l.items[1].template_id, "moe_experts_wgmma");
            assert_string_equal(l.items[2].template_id, "moe_experts_tma");
            expect_compiled(jit, &l.items[1], "sm_90");
            expect_compiled(jit, &l.items[2], "sm_90");
            total += 2;
        }
    expect_compiles(jit, total);
    kiln_jit_destroy(jit);
}

static void test_experts_spec_refusals(void **state)
{
    (void)state;
    kiln_spec s;
    const kiln_dtype h = KILN_DTYPE_F16;
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 100, 768, 128, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "hidden 100");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 2048, 100, 128, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "inter 100");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 2048, 768, 0, 1, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "experts 0");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 2048, 768, 513, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "experts 513");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 2048, 768, 128, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "top_k 0");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 2048, 768, 8, 9, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "top_k 9");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 2048, 768, 128, 17, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "top_k 17");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 0, 768, 128, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "hidden 0");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 2048, -64, 128, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "moe_experts", "inter -64");
    KILN_EXPECT(kiln_op_moe_experts_spec(KILN_DTYPE_F32, 2048, 768, 128, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "moe_experts", "f32");
    KILN_EXPECT(kiln_op_moe_experts_spec(h, 2048, 768, 128, 8, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "moe_experts", "NULL");
    /* The limits and the smallest sizes are accepted. */
    KILN_CHECK(kiln_op_moe_experts_spec(h, 128, 64, 1, 1, &s));
    KILN_CHECK(kiln_op_moe_experts_spec(KILN_DTYPE_BF16, 128, 64, 512, 16, &s));
    KILN_CHECK(kiln_op_moe_experts_spec(h, 384, 192, 16, 16, &s));
}

/* Nonzero, growing with the tokens (a command for fewer fits in more). */
static void test_experts_workspace(void **state)
{
    (void)state;
    static const struct { int64_t h, i, e, k; } sizes[] = {{2048, 768, 128, 8}, {4096, 14336, 8, 2}, {128, 64, 1, 1}};
    static const int64_t tokens[] = {1, 2, 15, 16, 64, 65, 300, 4096, 32768};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t prev = 0, first = 0;
        for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++) {
            size_t bytes = 0;
            KILN_CHECK(kiln_op_moe_experts_workspace(tokens[t], sizes[i].h, sizes[i].i, sizes[i].e, sizes[i].k,
                                                     &bytes));
            assert_true(bytes > 0);
            assert_true(bytes >= prev);
            first = t ? first : bytes;
            prev = bytes;
        }
        /* h and y hold a row per (token, slot): 32768 tokens' are more than a megabyte past one token's. */
        assert_true(prev - first >= (size_t)1 << 20);
    }
    KILN_EXPECT(kiln_op_moe_experts_workspace(64, 2048, 768, 128, 8, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "moe_experts", "NULL");
}

static void test_experts_offline_encode_needs_a_device(void **state)
{
    fixture *f = *state;
    kiln_moe_experts_desc d = {.size = sizeof d};
    kiln_command *cmd = (kiln_command *)1;
    KILN_EXPECT(kiln_op_moe_experts_encode(f->jit, &d, &cmd), KILN_ERR_NO_DEVICE, kiln_errmsg(), "moe_experts",
                NULL);
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
        cmocka_unit_test_setup_teardown(test_experts_specs_compiled, offline_fixture_setup,
                                        offline_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_experts_wgmma_listed_and_compiled, offline_fixture_setup,
                                        offline_fixture_teardown),
        cmocka_unit_test(test_experts_spec_refusals),
        cmocka_unit_test(test_experts_workspace),
        cmocka_unit_test_setup_teardown(test_experts_offline_encode_needs_a_device, offline_fixture_setup,
                                        offline_fixture_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
