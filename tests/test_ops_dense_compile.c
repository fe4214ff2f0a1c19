/* The dense operations without a GPU: their specializations for the three
 * model configs compile offline with NVRTC for sm_90 (what `kiln prewarm`
 * does), in f16 and in bf16 (for sm_80 and sm_90), the model's list holds
 * exactly what encode will ask for in the config's element type, and sizes
 * out of contract are refused naming the value. */
#include "offline_fixture.h"
#include "providers/skinny.h"
#include "testutil.h"

typedef offline_fixture fixture;

static const char qwen_json[] =
    "{\"model_type\": \"qwen2\", \"vocab_size\": 151936, \"hidden_size\": 896, \"intermediate_size\": 4864,"
    " \"num_attention_heads\": 14, \"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-6,"
    " \"tie_word_embeddings\": true}";
static const char odd_json[] =
    "{\"vocab_size\": 50001, \"hidden_size\": 1000, \"intermediate_size\": 2731, \"num_attention_heads\": 8}";

/* The model's dense specializations: one SwiGLU kernel and one gather, of
 * the config's element type. */
static void expect_dense_specs(const kiln_model_config *c, int64_t inter, int swiglu_vec, int64_t hidden,
                               int gather_vec)
{
    kiln_spec *specs = NULL, want_swiglu, want_gather;
    size_t n = 0, found_swiglu = 0, found_gather = 0;
    KILN_CHECK(kiln_model_specializations(c, &specs, &n));
    KILN_CHECK(kiln_op_dense_swiglu_spec(c->dtype, inter, swiglu_vec, &want_swiglu));
    KILN_CHECK(kiln_op_last_token_linear_spec(c->dtype, hidden, gather_vec, &want_gather));
    for (size_t i = 0; i < n; i++) {
        if (!strcmp(specs[i].template_id, "swiglu")) {
            assert_memory_equal(&specs[i], &want_swiglu, sizeof want_swiglu);
            found_swiglu++;
        } else if (!strcmp(specs[i].template_id, "gather_last")) {
            assert_memory_equal(&specs[i], &want_gather, sizeof want_gather);
            found_gather++;
        }
    }
    assert_int_equal(found_swiglu, 1);
    assert_int_equal(found_gather, 1);
    kiln_free(specs);
}

static void test_model_lists_what_encode_needs(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    expect_dense_specs(&c, 14336, 8, 4096, 8);
    KILN_CHECK(kiln_model_config_parse(qwen_json, strlen(qwen_json), &c));
    expect_dense_specs(&c, 4864, 8, 896, 8);
    KILN_CHECK(kiln_model_config_parse(odd_json, strlen(odd_json), &c));
    expect_dense_specs(&c, 2731, 1, 1000, 8);
    /* A bf16 model lists the bf16 kernels. */
    kiln_model_config_default(&c);
    c.dtype = KILN_DTYPE_BF16;
    expect_dense_specs(&c, 14336, 8, 4096, 8);
    KILN_CHECK(kiln_model_config_parse(odd_json, strlen(odd_json), &c));
    c.dtype = KILN_DTYPE_BF16;
    expect_dense_specs(&c, 2731, 1, 1000, 8);
}

static void test_specializations_compile_offline(void **state)
{
    fixture *f = *state;
    kiln_model_config configs[3];
    kiln_model_config_default(&configs[0]);
    KILN_CHECK(kiln_model_config_parse(qwen_json, strlen(qwen_json), &configs[1]));
    KILN_CHECK(kiln_model_config_parse(odd_json, strlen(odd_json), &configs[2]));
    size_t dense = 0;
    for (int m = 0; m < 3; m++) {
        kiln_spec *specs = NULL;
        size_t n = 0;
        KILN_CHECK(kiln_model_specializations(&configs[m], &specs, &n));
        for (size_t i = 0; i < n; i++) {
            if (strcmp(specs[i].template_id, "swiglu") && strcmp(specs[i].template_id, "gather_last"))
                continue;
            int compiled = 0;
            KILN_CHECK(kiln_jit_prepare(f->jit, &specs[i], &compiled));
            assert_int_equal(compiled, 1);
            KILN_CHECK(kiln_jit_prepare(f->jit, &specs[i], &compiled));
            assert_int_equal(compiled, 0);
            dense++;
        }
        kiln_free(specs);
    }
    assert_int_equal(dense, 6);
    /* The scalar variants encode falls back to (odd sizes, misaligned views). */
    kiln_spec s;
    int compiled = 0;
    KILN_CHECK(kiln_op_dense_swiglu_spec(KILN_DTYPE_F16, 4864, 1, &s));
    KILN_CHECK(kiln_jit_prepare(f->jit, &s, &compiled));
    KILN_CHECK(kiln_op_last_token_linear_spec(KILN_DTYPE_F16, 1001, 1, &s));
    KILN_CHECK(kiln_jit_prepare(f->jit, &s, &compiled));
    /* The largest sizes a config may hold still compile (chunked loops, no spills into failure). */
    KILN_CHECK(kiln_op_dense_swiglu_spec(KILN_DTYPE_F16, 262144, 8, &s));
    KILN_CHECK(kiln_jit_prepare(f->jit, &s, &compiled));
    KILN_CHECK(kiln_op_last_token_linear_spec(KILN_DTYPE_F16, 65536, 8, &s));
    KILN_CHECK(kiln_jit_prepare(f->jit, &s, &compiled));
}

/* The skinny dense linear (1 to 8 tokens): the model lists, for each
 * distinct in of its projections that is a multiple of 32, the plain kernel
 * and its wide variant (more blocks an SM), then the gated (SwiGLU) one of in
 * = hidden; each compiles offline, from one warp per block to eight, plain,
 * wide and gated. ins: n_ins - 1 plain ins, then the gated. */
static void expect_skinny_specs(const kiln_model_config *c, const int64_t *ins, size_t n_ins)
{
    kiln_spec *specs = NULL;
    size_t n = 0, found = 0;
    KILN_CHECK(kiln_model_specializations(c, &specs, &n));
    for (size_t i = 0; i < n; i++) {
        if (strcmp(specs[i].template_id, "skinny_linear"))
            continue;
        /* found: 2 per plain in (narrow, wide), then the gated one. */
        const size_t which = found / 2 < n_ins - 1 ? found / 2 : n_ins - 1;
        const int glu = which == n_ins - 1, wide = !glu && found % 2;
        assert_true(n_ins > 0 && (glu ? found == 2 * (n_ins - 1) : 1));
        kiln_spec want;
        KILN_CHECK(kiln__skinny_linear_spec(c->dtype, ins[which], glu, wide, &want));
        assert_memory_equal(&specs[i], &want, sizeof want);
        found++;
    }
    assert_int_equal(found, n_ins ? 2 * (n_ins - 1) + 1 : 0);
    kiln_free(specs);
}

static void test_skinny_linear_specs(void **state)
{
    fixture *f = *state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    static const int64_t llama[] = {4096, 14336, 4096}, qwen[] = {896, 4864, 896};
    expect_skinny_specs(&c, llama, 3);
    KILN_CHECK(kiln_model_config_parse(qwen_json, strlen(qwen_json), &c));
    expect_skinny_specs(&c, qwen, 3);
    KILN_CHECK(kiln_model_config_parse(odd_json, strlen(odd_json), &c)); /* 1000, 2731: not multiples of 32 */
    expect_skinny_specs(&c, NULL, 0);
    kiln_model_config_default(&c);
    c.dtype = KILN_DTYPE_BF16;
    expect_skinny_specs(&c, llama, 3);
    static const int64_t compile[] = {32, 64, 96, 256, 896, 4096, 14336, 65536};
    for (size_t i = 0; i < sizeof compile / sizeof compile[0]; i++)
        for (int v = 0; v < 3; v++) {
            kiln_spec s;
            int compiled = 0;
            KILN_CHECK(kiln__skinny_linear_spec(KILN_DTYPE_F16, compile[i], v == 2, v == 1, &s));
            KILN_CHECK(kiln_jit_prepare(f->jit, &s, &compiled));
        }
    kiln_spec s;
    KILN_EXPECT(kiln__skinny_linear_spec(KILN_DTYPE_F16, 1000, 0, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "in = 1000",
                "multiple of 32");
    KILN_EXPECT(kiln__skinny_linear_spec(KILN_DTYPE_F16, 0, 1, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "in = 0", NULL);
    assert_int_equal(kiln__skinny_linear_spec(KILN_DTYPE_F16, 64, 0, 0, NULL), KILN_ERR_INVALID_ARGUMENT);
}

/* The dense templates a model lists (skinny plain, wide and gated, SwiGLU,
 * gather, the two TMA kernels), f16 and bf16 for one config. */
static int is_dense(const char *template_id)
{
    static const char *const ids[] = {"skinny_linear", "swiglu", "gather_last", "tma_linear", "tma_swiglu"};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (!strcmp(template_id, ids[i]))
            return 1;
    return 0;
}

/* A bf16 model's dense kernels are the f16 model's with BF16=1 in place of
 * BF16=0 (every other constant the same), and each compiles for sm_80 and
 * sm_90, as do the scalar variants encode falls back to. */
static void test_bf16_specializations_compile(void **state)
{
    offline_fixture *f = *state;
    kiln_model_config c16, c;
    kiln_model_config_default(&c16);
    kiln_model_config_default(&c);
    c.dtype = KILN_DTYPE_BF16;
    kiln_spec *s16 = NULL, *s = NULL;
    size_t n16 = 0, n = 0;
    KILN_CHECK(kiln_model_specializations(&c16, &s16, &n16));
    KILN_CHECK(kiln_model_specializations(&c, &s, &n));
    kiln_spec bf16[32];
    size_t nb = 0, j = 0;
    for (size_t i = 0; i < n; i++) {
        if (!is_dense(s[i].template_id))
            continue;
        while (j < n16 && !is_dense(s16[j].template_id))
            j++;
        assert_true(j < n16);
        assert_string_equal(s[i].template_id, s16[j].template_id);
        char t16[256], t[256];
        KILN_CHECK(kiln_spec_constants_text(&s16[j], t16, sizeof t16));
        KILN_CHECK(kiln_spec_constants_text(&s[i], t, sizeof t));
        if (strncmp(t16, "BF16=0;", 7) || strncmp(t, "BF16=1;", 7) || strcmp(t16 + 7, t + 7))
            fail_msg("%s: f16 constants %s, bf16 constants %s", s[i].template_id, t16, t);
        assert_true(nb < sizeof bf16 / sizeof bf16[0]);
        bf16[nb++] = s[i];
        j++;
    }
    /* skinny: 2 plain ins x 2 variants + gated; SwiGLU; gather; tma_linear for 2 ins; tma_swiglu. */
    assert_int_equal(nb, 10);
    kiln_free(s16);
    kiln_free(s);
    KILN_CHECK(kiln_op_dense_swiglu_spec(KILN_DTYPE_BF16, 4864, 1, &bf16[nb++]));
    KILN_CHECK(kiln_op_last_token_linear_spec(KILN_DTYPE_BF16, 1001, 1, &bf16[nb++]));
    KILN_CHECK(kiln__skinny_linear_spec(KILN_DTYPE_BF16, 96, 1, 0, &bf16[nb++])); /* one warp, gated */
    static const char *const archs[] = {"sm_80", "sm_90"};
    for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++) {
        kiln_jit_options jo = {.cache = f->cache, .arch = archs[a]};
        kiln_jit *jit;
        KILN_CHECK(kiln_jit_create(&jo, &jit));
        for (size_t i = 0; i < nb; i++) {
            int compiled = 0;
            if (kiln_jit_prepare(jit, &bf16[i], &compiled))
                fail_msg("%s, bf16 %s: %s", archs[a], bf16[i].template_id, kiln_errmsg());
            assert_int_equal(compiled, 1);
        }
        kiln_jit_destroy(jit);
    }
    /* The constants text names the element type. */
    kiln_spec one;
    char text[256];
    KILN_CHECK(kiln_op_dense_swiglu_spec(KILN_DTYPE_BF16, 14336, 8, &one));
    KILN_CHECK(kiln_spec_constants_text(&one, text, sizeof text));
    assert_string_equal(text, "BF16=1;INTERMEDIATE=14336;THREADS=128;VEC=8");
    KILN_CHECK(kiln_op_last_token_linear_spec(KILN_DTYPE_F16, 4096, 8, &one));
    KILN_CHECK(kiln_spec_constants_text(&one, text, sizeof text));
    assert_string_equal(text, "BF16=0;IN=4096;THREADS=128;VEC=8");
    KILN_CHECK(kiln_op_last_token_linear_spec(KILN_DTYPE_BF16, 4096, 8, &one));
    KILN_CHECK(kiln_spec_constants_text(&one, text, sizeof text));
    assert_string_equal(text, "BF16=1;IN=4096;THREADS=128;VEC=8");
    /* Any other element type is refused, naming it. */
    KILN_EXPECT(kiln_op_dense_swiglu_spec(KILN_DTYPE_F32, 14336, 8, &one), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "element type must be f16 or bf16", "got f32");
    KILN_EXPECT(kiln__skinny_linear_spec(KILN_DTYPE_U8, 4096, 0, 0, &one), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "skinny_linear", "got u8");
}

static void test_spec_sizes_out_of_contract(void **state)
{
    (void)state;
    kiln_spec s;
    KILN_EXPECT(kiln_op_dense_swiglu_spec(KILN_DTYPE_F16, 0, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "intermediate 0",
                NULL);
    KILN_EXPECT(kiln_op_dense_swiglu_spec(KILN_DTYPE_F16, 2731, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "2731",
                "vector width 8");
    KILN_EXPECT(kiln_op_dense_swiglu_spec(KILN_DTYPE_F16, 262145, 1, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "262145",
                "262144");
    KILN_EXPECT(kiln_op_dense_swiglu_spec(KILN_DTYPE_F16, 64, 4, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "vector width 4",
                NULL);
    KILN_EXPECT(kiln_op_last_token_linear_spec(KILN_DTYPE_F16, 65537, 1, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "65537",
                "65536");
    KILN_EXPECT(kiln_op_last_token_linear_spec(KILN_DTYPE_F16, 1001, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "in 1001",
                NULL);
    assert_int_equal(kiln_op_last_token_linear_spec(KILN_DTYPE_F16, 64, 8, NULL), KILN_ERR_INVALID_ARGUMENT);
}

static void test_workspace_estimates(void **state)
{
    (void)state;
    const size_t blas = (size_t)32 << 20;
    size_t b = 0;
    KILN_CHECK(kiln_op_dense_linear_workspace(2048, 4096, 28672, &b));
    assert_int_equal(b, blas);
    KILN_CHECK(kiln_op_dense_swiglu_workspace(4096, 4096, 14336, &b));
    assert_int_equal(b, blas + (size_t)4096 * 28672 * 2);
    assert_int_equal(kiln_op_dense_swiglu_product_offset(), blas);
    KILN_CHECK(kiln_op_dense_swiglu_workspace(1, 1000, 2731, &b));
    assert_int_equal(b, blas + 11008); /* 10924 bytes, rounded up to 256 */
    KILN_CHECK(kiln_op_last_token_linear_workspace(64, 4096, 128256, &b));
    assert_int_equal(b, blas + (size_t)64 * 4096 * 2);
    KILN_CHECK(kiln_op_last_token_linear_workspace(3, 1001, 50001, &b));
    assert_int_equal(b, blas + 6144); /* 6006 bytes, rounded up */
    KILN_EXPECT(kiln_op_dense_linear_workspace(0, 4096, 4096, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "tokens = 0", NULL);
    KILN_EXPECT(kiln_op_dense_linear_workspace(1, 4096, (int64_t)1 << 31, &b), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "out = 2147483648", "2147483647");
    KILN_EXPECT(kiln_op_dense_swiglu_workspace(1, 4096, (int64_t)1 << 30, &b), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "intermediate 1073741824", NULL);
    KILN_EXPECT(kiln_op_last_token_linear_workspace(-1, 4096, 10, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "participants -1", NULL);
    assert_int_equal(kiln_op_dense_linear_workspace(1, 1, 1, NULL), KILN_ERR_INVALID_ARGUMENT);
}

static void test_encode_offline_is_a_clear_error(void **state)
{
    fixture *f = *state;
    kiln_tensor t = {0};
    kiln_region ws = {0};
    kiln_command *cmd = (kiln_command *)1;
    KILN_EXPECT(kiln_op_dense_linear_encode(f->jit, &t, &t, NULL, &t, &ws, &cmd), KILN_ERR_NO_DEVICE,
                kiln_errmsg(), "dense_linear", "offline");
    assert_null(cmd);
    KILN_EXPECT(kiln_op_dense_swiglu(f->jit, &t, &t, &t, &ws), KILN_ERR_NO_DEVICE, kiln_errmsg(), "dense_swiglu",
                "offline");
    KILN_EXPECT(kiln_op_last_token_linear(f->jit, &t, &t, &t, NULL, &t, &ws), KILN_ERR_NO_DEVICE, kiln_errmsg(),
                "last_token_linear", "offline");
    assert_int_equal(kiln_op_dense_linear(NULL, &t, &t, NULL, &t, &ws), KILN_ERR_INVALID_ARGUMENT);
    assert_int_equal(kiln_op_dense_swiglu_encode(f->jit, &t, &t, &t, &ws, NULL), KILN_ERR_INVALID_ARGUMENT);
}

/* Every kernel of the default model (Llama-3-8B, f16) that prewarm lists
 * for an architecture other than sm_90 compiles for it: `kiln prewarm
 * --arch sm_100`, sm_120, an Ampere or Ada one, or Turing's sm_75 (the
 * oldest NVRTC 13 takes) must not fail on a template that only suits Hopper
 * or on an instruction of a later architecture. */
static void test_default_model_compiles_for_other_archs(void **state)
{
    offline_fixture *f = *state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    static const char *const archs[] = {"sm_100", "sm_120", "sm_80", "sm_86", "sm_89", "sm_75"};
    for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++) {
        kiln_spec *specs = NULL;
        size_t n = 0;
        KILN_CHECK(kiln_model_specializations_for_arch(&c, archs[a], &specs, &n));
        kiln_jit_options jo = {.cache = f->cache, .arch = archs[a]};
        kiln_jit *jit;
        KILN_CHECK(kiln_jit_create(&jo, &jit));
        for (size_t i = 0; i < n; i++) {
            int compiled = 0;
            kiln_status st = kiln_jit_prepare(jit, &specs[i], &compiled);
            if (st)
                fail_msg("%s, %s: %s", archs[a], specs[i].template_id, kiln_errmsg());
        }
        kiln_jit_counters k;
        kiln_jit_get_counters(jit, &k);
        assert_int_equal(k.compiles, n);
        assert_int_equal(k.compile_errors, 0);
        kiln_jit_destroy(jit);
        kiln_free(specs);
    }
}

/* The TMA products (9 to 32 tokens) run from sm_90 on only
 * (kiln__tma_applies), so prewarm lists them there and nowhere before. */
static void test_tma_kernels_listed_from_sm_90(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    static const struct { const char *arch; size_t tma; } want[] = {
        {NULL, 3}, {"sm_90", 3}, {"sm_90a", 3}, {"sm_100", 3}, {"sm_120", 3}, {"sm_89", 0}, {"sm_86", 0}, {"sm_80", 0}};
    for (size_t a = 0; a < sizeof want / sizeof want[0]; a++) {
        kiln_spec *specs = NULL;
        size_t n = 0, tma = 0, skinny = 0;
        KILN_CHECK(kiln_model_specializations_for_arch(&c, want[a].arch, &specs, &n));
        for (size_t i = 0; i < n; i++) {
            tma += !strcmp(specs[i].template_id, "tma_linear") || !strcmp(specs[i].template_id, "tma_swiglu");
            skinny += !strcmp(specs[i].template_id, "skinny_linear");
        }
        if (tma != want[a].tma || skinny != 5)
            fail_msg("%s: %zu TMA kernels listed (want %zu), %zu skinny (want 5)",
                     want[a].arch ? want[a].arch : "default", tma, want[a].tma, skinny);
        kiln_free(specs);
    }
}

int main(void)
{
#define T(fn) cmocka_unit_test_setup_teardown(fn, offline_fixture_setup, offline_fixture_teardown)
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_lists_what_encode_needs),
        T(test_specializations_compile_offline),
        T(test_skinny_linear_specs),
        T(test_bf16_specializations_compile),
        cmocka_unit_test(test_spec_sizes_out_of_contract),
        cmocka_unit_test(test_workspace_estimates),
        T(test_encode_offline_is_a_clear_error),
        T(test_default_model_compiles_for_other_archs),
        cmocka_unit_test(test_tma_kernels_listed_from_sm_90),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
