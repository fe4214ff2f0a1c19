/* Model configs: real config.json files parse; bad ones name the field and value. */
#include "testutil.h"
#include "st_writer.h"

static kiln_status parse(const char *json, kiln_model_config *c) { return kiln_model_config_parse(json, strlen(json), c); }

/* json is refused as KILN_ERR_CONFIG, the message holding a and b, the
 * config untouched. */
static void expect_refused(const char *json, const char *a, const char *b)
{
    kiln_model_config c;
    memset(&c, 0x5a, sizeof c);
    kiln_model_config before = c;
    KILN_EXPECT(parse(json, &c), KILN_ERR_CONFIG, kiln_errmsg(), a, b);
    assert_memory_equal(&c, &before, sizeof c); /* untouched on failure */
}

static void test_default_is_llama_3_8b(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    assert_int_equal(c.vocab_size, 128256);
    assert_int_equal(c.hidden_size, 4096);
    assert_int_equal(c.intermediate_size, 14336);
    assert_int_equal(c.num_attention_heads, 32);
    assert_int_equal(c.num_key_value_heads, 8);
    assert_int_equal(c.head_dim, 128);
}

static void test_qwen2_config(void **state)
{
    (void)state;
    kiln_model_config c;
    KILN_CHECK(parse("{\"architectures\": [\"Qwen2ForCausalLM\"], \"model_type\": \"qwen2\", \"vocab_size\": 151936,"
                     " \"hidden_size\": 896, \"intermediate_size\": 4864, \"num_attention_heads\": 14,"
                     " \"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-06, \"rope_theta\": 1000000.0,"
                     " \"tie_word_embeddings\": true, \"torch_dtype\": \"bfloat16\"}",
                     &c));
    assert_string_equal(c.name, "qwen2");
    assert_int_equal(c.vocab_size, 151936);
    assert_int_equal(c.hidden_size, 896);
    assert_int_equal(c.head_dim, 64);
    assert_true(c.tie_word_embeddings);
    assert_true(c.rms_norm_eps > 0.9e-6 && c.rms_norm_eps < 1.1e-6);
    assert_true(c.rope_theta == 1e6);
}

static void test_defaults_and_text_config(void **state)
{
    (void)state;
    kiln_model_config c;
    KILN_CHECK(parse("{\"text_config\": {\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128,"
                     " \"num_attention_heads\": 4, \"head_dim\": 32}}",
                     &c));
    assert_int_equal(c.num_key_value_heads, 4);
    assert_int_equal(c.head_dim, 32);
    assert_false(c.tie_word_embeddings);
    assert_true(c.rope_theta == 10000.0);
}

static void test_bad_configs_name_field_and_value(void **state)
{
    (void)state;
    static const struct {
        const char *json, *field, *value;
    } cases[] = {
        {"not json", "not JSON", NULL},
        {"[1, 2]", "object", NULL},
        {"{\"vocab_size\": 1000, \"intermediate_size\": 1, \"num_attention_heads\": 1}", "hidden_size", "missing"},
        {"{\"vocab_size\": 1000, \"hidden_size\": 0, \"intermediate_size\": 1, \"num_attention_heads\": 1}",
         "hidden_size", "0"},
        {"{\"vocab_size\": 1000, \"hidden_size\": -4096, \"intermediate_size\": 1, \"num_attention_heads\": 1}",
         "hidden_size", "-4096"},
        {"{\"vocab_size\": 1e12, \"hidden_size\": 64, \"intermediate_size\": 1, \"num_attention_heads\": 1}",
         "vocab_size", "1000000000000"},
        {"{\"vocab_size\": 10.5, \"hidden_size\": 64, \"intermediate_size\": 1, \"num_attention_heads\": 1}",
         "vocab_size", "10.5"},
        {"{\"vocab_size\": \"big\", \"hidden_size\": 64, \"intermediate_size\": 1, \"num_attention_heads\": 1}",
         "vocab_size", "\"big\""},
        {"{\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 1, \"num_attention_heads\": 8,"
         " \"num_key_value_heads\": 3}",
         "num_key_value_heads", "3"},
        {"{\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 1, \"num_attention_heads\": 1,"
         " \"rms_norm_eps\": -1}",
         "rms_norm_eps", "-1"},
        {"{\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 1, \"num_attention_heads\": 1,"
         " \"tie_word_embeddings\": 3}",
         "tie_word_embeddings", "3"},
        {"{\"vocab_size\": 100, \"hidden_size\": 100, \"intermediate_size\": 1, \"num_attention_heads\": 3}",
         "num_attention_heads", "3"},
        {"{\"vocab_size\": 100, \"hidden_size\": 4096, \"intermediate_size\": 1, \"num_attention_heads\": 2}",
         "head_dim", "2048"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_refused(cases[i].json, cases[i].field, cases[i].value);
}

/* What Python's json.load refuses, kiln refuses too, naming the byte: else
 * kiln could prewarm another shape than transformers loads. */
static void test_strict_json_refused(void **state)
{
    (void)state;
#define SIZES "\"vocab_size\": 1000, \"intermediate_size\": 128, \"num_attention_heads\": 4"
    static const struct {
        const char *json, *what, *where;
    } cases[] = {
        /* Python takes the last hidden_size (1024), cJSON the first. */
        {"{" SIZES ", \"hidden_size\": 896, \"hidden_size\": 1024}", "second key \"hidden_size\"", "byte 93 of"},
        {"{\"text_config\": {\"hidden_size\": 64, \"x\": 1, \"x\": 2}, " SIZES ", \"hidden_size\": 64}",
         "second key \"x\"", "byte 44 of"},
        {"{\"a\": 1, \"\\u0061\": 2, " SIZES ", \"hidden_size\": 64}", "second key \"\\u0061\"", "byte 9 of"},
        {"{" SIZES ", \"hidden_size\": 64} x", "'x' after the end", "byte 92 of"},
        {"{" SIZES ", \"hidden_size\": 64}{}", "'{' after the end", "byte 91 of"},
        {"{" SIZES ", \"hidden_size\": 0896}", "leading zero", "byte 88 of"},
        {"{" SIZES ", \"hidden_size\": 64, \"rope_theta\": NaN}", "'N' where a value", "byte 106 of"},
        {"{" SIZES ", \"hidden_size\": 64, \"rope_theta\": -Infinity}", "'I' where a number", "byte 107 of"},
        {"{" SIZES ", \"hidden_size\": 64, \"rope_theta\": 1.}", "fraction", "byte 108 of"},
        {"{" SIZES ", \"hidden_size\": 64, \"model_type\": \"a\tb\"}", "control byte 0x09", "byte 108 of"},
        {"{" SIZES ", \"hidden_size\": 64, \"model_type\": \"a\xff\"}", "0xff that is not well-formed UTF-8",
         "byte 108 of"},
        {"{" SIZES ", \"hidden_size\": 64, \"model_type\": \"\\ud800\"}", "high surrogate", "byte 107 of"},
        {"{" SIZES ", \"hidden_size\": 64, \"hidden_size\\u0000\": 1024}", "\\u0000 in the string", "byte 104 of"},
        {"\xef\xbb\xbf{" SIZES ", \"hidden_size\": 64}", "byte order mark", "byte 0 of"},
        {"{" SIZES ",\f\"hidden_size\": 64}", "0x0c where an object key", "byte 72 of"},
        {"{" SIZES ", \"hidden_size\": 64,}", "'}' where an object key", "byte 91 of"},
    };
#undef SIZES
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_refused(cases[i].json, cases[i].what, cases[i].where);
    /* Whitespace after the object is JSON; so are escapes and UTF-8 in strings. */
    kiln_model_config c;
    KILN_CHECK(parse("{\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128,"
                     " \"num_attention_heads\": 4, \"model_type\": \"\\u00e9\\ud83d\\ude00\xc3\xa9\\n\", \"n\": -0.5e+3,"
                     " \"x\": {\"a\": [1, {\"a\": 2}]}, \"a\": null}\r\n\t ",
                     &c));
    assert_int_equal(c.hidden_size, 64);
    /* Nesting: cJSON's limit is 1000, kiln's 512. */
    char deep[2 * 600 + 128];
    size_t n = (size_t)snprintf(deep, sizeof deep, "{" "\"vocab_size\": 1000, \"x\": ");
    for (int i = 0; i < 600; i++)
        deep[n++] = '[';
    for (int i = 0; i < 600; i++)
        deep[n++] = ']';
    snprintf(deep + n, sizeof deep - n, "}");
    KILN_EXPECT(parse(deep, &c), KILN_ERR_CONFIG, kiln_errmsg(), "nesting deeper than 512", NULL);
}

static void test_load_missing_file(void **state)
{
    (void)state;
    kiln_model_config c;
    KILN_EXPECT(kiln_model_config_load("/nonexistent/config.json", &c), KILN_ERR_IO, kiln_errmsg(),
                     "/nonexistent/config.json", NULL);
}

static kiln_status load_config(const char *path)
{
    kiln_model_config c;
    return kiln_model_config_load(path, &c);
}

/* A FIFO blocked the open forever; a directory or a device is no config either. */
static void test_load_not_regular_file(void **state)
{
    (void)state;
    char dir[512];
    kiln_test_tmpdir(dir, sizeof dir);
    assert_int_equal(st_expect_fifo_refused(load_config, kiln_errmsg, dir, "config.json"), 0);
    assert_int_equal(st_expect_not_regular(load_config, kiln_errmsg, dir), 0);
    assert_int_equal(st_expect_not_regular(load_config, kiln_errmsg, "/dev/zero"), 0);
    kiln_test_rmrf(dir);
}

static void test_specializations(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    kiln_spec *specs = NULL;
    size_t n = 0;
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    assert_true(n >= 1);
    int found = 0;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(specs[i].template_id, "token_embedding"))
            continue;
        kiln_spec want;
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 128256, 4096, 8, &want));
        assert_memory_equal(&specs[i], &want, sizeof want);
        found = 1;
    }
    assert_true(found);
    kiln_free(specs);
    /* An odd hidden size takes the scalar path. */
    c.hidden_size = 1001;
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    kiln_spec want;
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 128256, 1001, 1, &want));
    assert_memory_equal(&specs[0], &want, sizeof want);
    kiln_free(specs);
}

/* Qwen3-Next's config.json (the fields kiln reads, and some it does not). */
#define QWEN3_NEXT                                                                                                 \
    "{\"architectures\": [\"Qwen3NextForCausalLM\"], \"model_type\": \"qwen3_next\", \"vocab_size\": 151936,"     \
    " \"hidden_size\": 2048, \"intermediate_size\": 5120, \"num_attention_heads\": 16,"                            \
    " \"num_key_value_heads\": 2, \"head_dim\": 256, \"rms_norm_eps\": 1e-06, \"rope_theta\": 10000000,"          \
    " \"linear_conv_kernel_dim\": 4, \"linear_key_head_dim\": 128, \"linear_num_key_heads\": 16,"                 \
    " \"linear_num_value_heads\": 32, \"linear_value_head_dim\": 128, \"full_attention_interval\": 4,"            \
    " \"num_experts\": 512, \"tie_word_embeddings\": false"

static void test_qwen3_next_linear_attention(void **state)
{
    (void)state;
    kiln_model_config c;
    KILN_CHECK(parse(QWEN3_NEXT "}", &c));
    assert_string_equal(c.name, "qwen3_next");
    assert_int_equal(c.head_dim, 256);
    assert_int_equal(c.linear_num_key_heads, 16);
    assert_int_equal(c.linear_num_value_heads, 32);
    assert_int_equal(c.linear_key_head_dim, 128);
    assert_int_equal(c.linear_value_head_dim, 128);
    /* Absent: all 0, for a parsed config and for the default. */
    KILN_CHECK(parse("{\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128,"
                     " \"num_attention_heads\": 4, \"linear_num_key_heads\": null}",
                     &c));
    assert_int_equal(c.linear_num_key_heads, 0);
    assert_int_equal(c.linear_num_value_heads, 0);
    assert_int_equal(c.linear_key_head_dim, 0);
    assert_int_equal(c.linear_value_head_dim, 0);
    kiln_model_config_default(&c);
    assert_int_equal(c.linear_num_key_heads + c.linear_num_value_heads + c.linear_key_head_dim +
                         c.linear_value_head_dim,
                     0);
    /* The small odd shape of the GPU tests: 3 key heads shared by 6 value heads. */
    KILN_CHECK(parse("{\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128,"
                     " \"num_attention_heads\": 4, \"linear_num_key_heads\": 3, \"linear_num_value_heads\": 6,"
                     " \"linear_key_head_dim\": 64, \"linear_value_head_dim\": 96}",
                     &c));
    assert_int_equal(c.linear_num_key_heads, 3);
    assert_int_equal(c.linear_num_value_heads, 6);
    assert_int_equal(c.linear_key_head_dim, 64);
    assert_int_equal(c.linear_value_head_dim, 96);
}

static void test_bad_linear_attention_names_field_and_value(void **state)
{
    (void)state;
#define BASE "{\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 1, \"num_attention_heads\": 1, "
#define FOUR(kh, vh, dk, dv)                                                                                       \
    BASE "\"linear_num_key_heads\": " kh ", \"linear_num_value_heads\": " vh ", \"linear_key_head_dim\": " dk      \
         ", \"linear_value_head_dim\": " dv "}"
    static const struct {
        const char *json, *field, *value;
    } cases[] = {
        {FOUR("0", "32", "128", "128"), "linear_num_key_heads", "= 0"},
        {FOUR("16", "-32", "128", "128"), "linear_num_value_heads", "-32"},
        {FOUR("16", "32", "1025", "128"), "linear_key_head_dim", "1025"},
        {FOUR("16", "32", "128", "12.5"), "linear_value_head_dim", "12.5"},
        {FOUR("16", "32", "128", "\"128\""), "linear_value_head_dim", "\"128\""},
        {FOUR("16", "2000", "128", "128"), "linear_num_value_heads", "2000"},
        {FOUR("16", "24", "128", "128"), "linear_num_key_heads = 16 does not divide linear_num_value_heads = 24",
         NULL},
        {FOUR("7", "3", "128", "128"), "linear_num_key_heads = 7", "linear_num_value_heads = 3"},
        {BASE "\"linear_num_key_heads\": 16}", "linear_num_key_heads = 16 is given",
         "linear_num_value_heads is missing"},
        {BASE "\"linear_num_key_heads\": 16, \"linear_num_value_heads\": 32, \"linear_key_head_dim\": 128}",
         "linear_value_head_dim is missing", NULL},
        {BASE "\"linear_value_head_dim\": 128}", "linear_value_head_dim = 128 is given",
         "linear_num_key_heads is missing"},
    };
#undef FOUR
#undef BASE
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_refused(cases[i].json, cases[i].field, cases[i].value);
}

static void test_linear_attention_specializations(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_spec *specs = NULL, want;
    size_t n = 0, found = 0;
    KILN_CHECK(parse(QWEN3_NEXT "}", &c));
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 4, &want));
    for (size_t i = 0; i < n; i++)
        if (!strcmp(specs[i].template_id, "gated_delta")) {
            assert_memory_equal(&specs[i], &want, sizeof want);
            found++;
        }
    assert_int_equal(found, 1);
    kiln_free(specs);
    /* Without the fields, no gated delta kernel is listed. */
    kiln_model_config_default(&c);
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    for (size_t i = 0; i < n; i++)
        assert_string_not_equal(specs[i].template_id, "gated_delta");
    kiln_free(specs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_is_llama_3_8b),
        cmocka_unit_test(test_qwen2_config),
        cmocka_unit_test(test_defaults_and_text_config),
        cmocka_unit_test(test_bad_configs_name_field_and_value),
        cmocka_unit_test(test_strict_json_refused),
        cmocka_unit_test(test_load_missing_file),
        cmocka_unit_test(test_load_not_regular_file),
        cmocka_unit_test(test_specializations),
        cmocka_unit_test(test_qwen3_next_linear_attention),
        cmocka_unit_test(test_bad_linear_attention_names_field_and_value),
        cmocka_unit_test(test_linear_attention_specializations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
