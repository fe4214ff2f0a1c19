/* Model configs: real config.json files parse; bad ones name the field and value. */
#include "testutil.h"
#include "st_writer.h"

#include <math.h>

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

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
    /* A model_type longer than the name field is cut at a character, never
     * inside a UTF-8 sequence: 62 ASCII bytes, then a two-byte é. */
    KILN_CHECK(parse("{\"vocab_size\": 1000, \"hidden_size\": 64, \"intermediate_size\": 128,"
                     " \"num_attention_heads\": 4, \"model_type\": "
                     "\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\xc3\xa9\"}",
                     &c));
    assert_int_equal(strlen(c.name), 62);
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

/* Qwen3-Next's config.json (the fields kiln reads, and some it does not);
 * QWEN3_NEXT_SIZES without its model_type and architectures, as a config of
 * kiln's layout with its linear-attention fields. */
#define QWEN3_NEXT_SIZES                                                                                           \
    "\"vocab_size\": 151936,"                                                                                       \
    " \"hidden_size\": 2048, \"intermediate_size\": 5120, \"num_attention_heads\": 16,"                            \
    " \"num_key_value_heads\": 2, \"head_dim\": 256, \"rms_norm_eps\": 1e-06, \"rope_theta\": 10000000,"          \
    " \"linear_conv_kernel_dim\": 4, \"linear_key_head_dim\": 128, \"linear_num_key_heads\": 16,"                 \
    " \"linear_num_value_heads\": 32, \"linear_value_head_dim\": 128, \"full_attention_interval\": 4,"            \
    " \"num_experts\": 512, \"tie_word_embeddings\": false"
#define QWEN3_NEXT                                                                                                 \
    "{\"architectures\": [\"Qwen3NextForCausalLM\"], \"model_type\": \"qwen3_next\", " QWEN3_NEXT_SIZES

static void test_qwen3_next_linear_attention(void **state)
{
    (void)state;
    kiln_model_config c;
    /* Qwen3-Next itself is refused by name: its gated delta layers alternate
     * with attention layers, which the config struct cannot say. */
    expect_refused(QWEN3_NEXT "}", "model_type = \"qwen3_next\"", "gated delta");
    expect_refused("{\"architectures\": [\"Qwen3NextForCausalLM\"], " QWEN3_NEXT_SIZES "}", "qwen3_next", NULL);
    KILN_CHECK(parse("{" QWEN3_NEXT_SIZES "}", &c));
    assert_string_equal(c.name, "config");
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

/* Whether a listing holds a specialization of op whose key has text. */
static int lists(const kiln_spec *specs, size_t n, const char *op, const char *text)
{
    for (size_t i = 0; i < n; i++) {
        char key[512];
        KILN_CHECK(kiln_spec_constants_text(&specs[i], key, sizeof key));
        if (!strcmp(specs[i].template_id, op) && (!text || strstr(key, text)))
            return 1;
    }
    return 0;
}

/* Mixtral's, Qwen3-MoE's and Qwen2-MoE's expert fields are read (Mixtral
 * always renormalizes its chosen experts' weights) and prewarm lists the
 * router and the experts at their sizes, and dense SwiGLU kernels only for a
 * shared expert; a MoE of another family, or a family kiln does not serve,
 * is refused with its name rather than listed as a dense model. */
static void test_moe_fields_and_unknown_families(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_spec *specs = NULL;
    size_t n = 0;
#define DENSE "\"vocab_size\": 32000, \"hidden_size\": 4096, \"intermediate_size\": 14336, \"num_attention_heads\": 32"
    KILN_CHECK(parse("{\"model_type\": \"mixtral\", " DENSE ", \"num_local_experts\": 8, \"num_experts_per_tok\": 2}", &c));
    assert_int_equal(c.num_experts, 8);
    assert_int_equal(c.num_experts_per_tok, 2);
    assert_int_equal(c.moe_intermediate_size, 14336); /* Mixtral's experts are intermediate_size wide */
    assert_int_equal(c.norm_topk_prob, 1);
    assert_int_equal(c.shared_expert_intermediate_size, 0);
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    assert_true(lists(specs, n, "moe_experts", "EXPERTS=8;HIDDEN=4096;INTER=14336;TOP_K=2"));
    assert_true(lists(specs, n, "moe_router", "EXPERTS=8;"));
    assert_true(lists(specs, n, "moe_router", "NORMALIZE=1;TOP_K=2"));
    assert_false(lists(specs, n, "swiglu", NULL));
    assert_false(lists(specs, n, "tma_swiglu", NULL));
    kiln_free(specs);
    specs = NULL;
    /* Whatever the file says, and by the architecture without a model_type. */
    KILN_CHECK(parse("{\"model_type\": \"mixtral\", " DENSE ", \"num_local_experts\": 8, \"norm_topk_prob\": false}", &c));
    assert_int_equal(c.norm_topk_prob, 1);
    KILN_CHECK(parse("{\"architectures\": [\"MixtralForCausalLM\"], " DENSE ", \"num_local_experts\": 8}", &c));
    assert_int_equal(c.norm_topk_prob, 1);
    KILN_CHECK(parse("{\"model_type\": \"qwen3_moe\", " DENSE ", \"num_experts\": 128, \"num_experts_per_tok\": 8,"
                     " \"moe_intermediate_size\": 768, \"norm_topk_prob\": true, \"mlp_only_layers\": [],"
                     " \"decoder_sparse_step\": 1}", &c));
    assert_true(c.num_experts == 128 && c.num_experts_per_tok == 8 && c.moe_intermediate_size == 768 && c.norm_topk_prob);
    assert_true(c.qk_norm);
    KILN_CHECK(kiln_model_specializations_for_arch(&c, "sm_90", &specs, &n));
    assert_true(lists(specs, n, "moe_experts", "EXPERTS=128;HIDDEN=4096;INTER=768;TOP_K=8"));
    assert_true(lists(specs, n, "moe_router", "NORMALIZE=1;TOP_K=8"));
    assert_false(lists(specs, n, "swiglu", NULL));
    kiln_free(specs);
    specs = NULL;
    /* Before sm_80 the experts (mma.sync) cannot run: the model is refused
     * whole, naming it and the arch. */
    assert_int_equal(kiln_model_specializations_for_arch(&c, "sm_75", &specs, &n), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "model qwen3_moe: its experts (mma.sync) need sm_80 or later, and the arch "
                                          "is sm_75"));
    assert_null(specs);
    KILN_CHECK(kiln_model_specializations_for_arch(&c, "sm_80", &specs, &n));
    kiln_free(specs);
    specs = NULL;
    KILN_CHECK(parse("{\"model_type\": \"qwen2_moe\", " DENSE ", \"num_experts\": 60, \"num_experts_per_tok\": 4,"
                     " \"moe_intermediate_size\": 1408, \"shared_expert_intermediate_size\": 5632,"
                     " \"norm_topk_prob\": false, \"mlp_only_layers\": null}", &c));
    assert_int_equal(c.shared_expert_intermediate_size, 5632);
    assert_int_equal(c.norm_topk_prob, 0);
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    assert_true(lists(specs, n, "moe_experts", "EXPERTS=60;HIDDEN=4096;INTER=1408;TOP_K=4"));
    assert_true(lists(specs, n, "swiglu", "INTERMEDIATE=5632"));
    assert_false(lists(specs, n, "swiglu", "INTERMEDIATE=14336"));
    kiln_free(specs);
    specs = NULL;
    /* Experts the kernels cannot take, by their sizes; a MoE of another family. */
    KILN_CHECK(parse("{\"model_type\": \"qwen3_moe\", " DENSE ", \"num_experts\": 16, \"num_experts_per_tok\": 2,"
                     " \"moe_intermediate_size\": 100}", &c));
    assert_int_equal(kiln_model_specializations(&c, &specs, &n), KILN_ERR_RUNTIME_CONTRACT);
    assert_non_null(strstr(kiln_errmsg(), "inter 100 a multiple of 64"));
    assert_null(specs);
    KILN_CHECK(parse("{\"model_type\": \"deepseek_v3\", " DENSE ", \"n_routed_experts\": 256, \"num_experts_per_tok\": 8,"
                     " \"moe_intermediate_size\": 2048}", &c));
    assert_int_equal(kiln_model_specializations(&c, &specs, &n), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "model deepseek_v3: a mixture of experts (256 experts, 8 a token"));
    assert_null(specs);
    /* Bad expert fields name the field and the value. */
    assert_int_equal(parse("{" DENSE ", \"num_experts\": 8, \"num_experts_per_tok\": 9}", &c), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "num_experts_per_tok = 9"));
    assert_int_equal(parse("{" DENSE ", \"num_experts\": -1}", &c), KILN_ERR_CONFIG);
    assert_int_equal(parse("{" DENSE ", \"num_experts\": 4, \"norm_topk_prob\": 1}", &c), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "norm_topk_prob = 1"));
    /* num_experts 0 or null is dense. */
    KILN_CHECK(parse("{\"model_type\": \"qwen3\", " DENSE ", \"num_experts\": null}", &c));
    assert_int_equal(c.num_experts, 0);
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    kiln_free(specs);
    specs = NULL;
    /* bf16 before sm_80 is refused whole; f16 there is listed. */
    KILN_CHECK(parse("{\"model_type\": \"qwen3\", " DENSE ", \"torch_dtype\": \"bfloat16\"}", &c));
    assert_int_equal(kiln_model_specializations_for_arch(&c, "sm_75", &specs, &n), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "model qwen3: bf16 needs sm_80 or later, and the arch is sm_75"));
    assert_null(specs);
    c.dtype = KILN_DTYPE_F16;
    KILN_CHECK(kiln_model_specializations_for_arch(&c, "sm_75", &specs, &n));
    assert_true(n > 0);
    kiln_free(specs);
    specs = NULL;
    /* A family kiln does not serve. */
    KILN_CHECK(parse("{\"model_type\": \"gemma\", " DENSE "}", &c));
    assert_int_equal(kiln_model_specializations(&c, &specs, &n), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "model gemma: not a family kiln serves"));
    assert_null(specs);
    /* Without a model_type: kiln's layout. */
    KILN_CHECK(parse("{" DENSE "}", &c));
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    kiln_free(specs);
#undef DENSE
}

/* What the struct cannot say (dense layers among the experts') and what
 * kiln's MoE operation does not take is refused, naming the field and value. */
static void test_moe_configs_refused(void **state)
{
    (void)state;
#define QMOE "{\"model_type\": \"qwen2_moe\", \"vocab_size\": 1000, \"hidden_size\": 256, \"intermediate_size\": 512," \
             " \"num_attention_heads\": 4, \"num_experts\": 8, \"num_experts_per_tok\": 2, "
    static const struct {
        const char *json, *a, *b;
    } cases[] = {
        {QMOE "\"mlp_only_layers\": [1, 3]}", "mlp_only_layers = [1,3]", "dense MLP"},
        {QMOE "\"mlp_only_layers\": [0]}", "mlp_only_layers = [0]", NULL},
        {QMOE "\"mlp_only_layers\": 2}", "mlp_only_layers = 2", NULL},
        {QMOE "\"decoder_sparse_step\": 2}", "decoder_sparse_step = 2", "dense MLP"},
        {QMOE "\"decoder_sparse_step\": 0}", "decoder_sparse_step = 0", NULL},
        {QMOE "\"decoder_sparse_step\": 1.5}", "decoder_sparse_step = 1.5", NULL},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 1000, \"hidden_size\": 256, \"intermediate_size\": 512,"
         " \"num_attention_heads\": 4, \"num_experts\": 513}",
         "num_experts = 513", "at most 512 experts"},
        {"{\"model_type\": \"mixtral\", \"vocab_size\": 1000, \"hidden_size\": 256, \"intermediate_size\": 512,"
         " \"num_attention_heads\": 4, \"num_local_experts\": 1024}",
         "num_local_experts = 1024", "at most 512"},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 1000, \"hidden_size\": 256, \"intermediate_size\": 512,"
         " \"num_attention_heads\": 4, \"num_experts\": 64, \"num_experts_per_tok\": 17}",
         "num_experts_per_tok = 17", "at most 16 experts a token"},
    };
#undef QMOE
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_refused(cases[i].json, cases[i].a, cases[i].b);
    /* At the limits: 512 experts, 16 a token. */
    kiln_model_config c;
    KILN_CHECK(parse("{\"model_type\": \"qwen3_moe\", \"vocab_size\": 1000, \"hidden_size\": 256,"
                     " \"intermediate_size\": 512, \"num_attention_heads\": 4, \"num_experts\": 512,"
                     " \"num_experts_per_tok\": 16, \"decoder_sparse_step\": null}",
                     &c));
    assert_true(c.num_experts == 512 && c.num_experts_per_tok == 16);
}

/* The real MoE configs of tests/data. */
static void test_moe_real_configs(void **state)
{
    (void)state;
    kiln_model_config c;
    char path[1024];
    snprintf(path, sizeof path, "%s/qwen3-30b-a3b.json", KILN_TEST_DATA_DIR);
    KILN_CHECK(kiln_model_config_load(path, &c));
    assert_string_equal(c.name, "qwen3_moe");
    assert_true(c.num_experts == 128 && c.num_experts_per_tok == 8 && c.moe_intermediate_size == 768);
    assert_true(c.norm_topk_prob && c.qk_norm && c.shared_expert_intermediate_size == 0);
    assert_true(c.hidden_size == 2048 && c.head_dim == 128 && c.num_key_value_heads == 4);
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    snprintf(path, sizeof path, "%s/mixtral-8x7b-v0.1.json", KILN_TEST_DATA_DIR);
    KILN_CHECK(kiln_model_config_load(path, &c));
    assert_string_equal(c.name, "mixtral");
    assert_true(c.num_experts == 8 && c.num_experts_per_tok == 2 && c.moe_intermediate_size == 14336);
    assert_true(c.norm_topk_prob && !c.qk_norm && c.sliding_window == 0);
    assert_true(c.hidden_size == 4096 && c.head_dim == 128 && c.num_key_value_heads == 8);
}

static void test_linear_attention_specializations(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_spec *specs = NULL, want;
    size_t n = 0, found = 0;
    /* Qwen3-Next's linear-attention layers, in a config of kiln's layout. */
    KILN_CHECK(parse("{" QWEN3_NEXT_SIZES "}", &c));
    c.num_experts = 0;
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

/* ---- dtype, RoPE scaling, model families ---- */

#define SMALL "\"vocab_size\": 1000, \"hidden_size\": 512, \"intermediate_size\": 128, \"num_attention_heads\": 4"

static void test_dtype(void **state)
{
    (void)state;
    kiln_model_config c;
    KILN_CHECK(parse("{" SMALL "}", &c));
    assert_int_equal(c.dtype, KILN_DTYPE_F16);
    KILN_CHECK(parse("{" SMALL ", \"torch_dtype\": \"bfloat16\"}", &c));
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    KILN_CHECK(parse("{" SMALL ", \"dtype\": \"float16\"}", &c));
    assert_int_equal(c.dtype, KILN_DTYPE_F16);
    /* transformers 5's dtype comes before an older torch_dtype. */
    KILN_CHECK(parse("{" SMALL ", \"dtype\": \"bfloat16\", \"torch_dtype\": \"float16\"}", &c));
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    KILN_CHECK(parse("{" SMALL ", \"dtype\": null, \"torch_dtype\": \"bfloat16\"}", &c));
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    expect_refused("{" SMALL ", \"torch_dtype\": \"float32\"}", "torch_dtype = \"float32\"", "--dtype");
    expect_refused("{" SMALL ", \"dtype\": \"int8\"}", "dtype = \"int8\"", "bfloat16");
    expect_refused("{" SMALL ", \"dtype\": 16}", "dtype = 16", NULL);
    /* An override takes the place of the config's, which is then not read. */
    kiln_model_config_options o = {.size = sizeof o, .dtype = KILN_DTYPE_BF16};
    const char *f32 = "{" SMALL ", \"torch_dtype\": \"float32\"}";
    KILN_CHECK(kiln_model_config_parse_with(f32, strlen(f32), &o, &c));
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    o.dtype = KILN_DTYPE_F16;
    KILN_CHECK(kiln_model_config_parse_with(f32, strlen(f32), &o, &c));
    assert_int_equal(c.dtype, KILN_DTYPE_F16);
    o.dtype = KILN_DTYPE_F32;
    KILN_EXPECT(kiln_model_config_parse_with(f32, strlen(f32), &o, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "dtype 2", NULL);
    o = (kiln_model_config_options){.size = 3};
    KILN_EXPECT(kiln_model_config_parse_with(f32, strlen(f32), &o, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "size 3", NULL);
    KILN_CHECK(kiln_model_config_parse_with("{" SMALL "}", strlen("{" SMALL "}"), NULL, &c));
    assert_int_equal(c.dtype, KILN_DTYPE_F16);
}

/* The reference: transformers' rope init functions (modeling_rope_utils),
 * re-derived here in float64 from their formulas, each type on its own. */
static double ref_default(double base, int64_t dim, int64_t i) { return pow(base, -(double)(2 * i) / (double)dim); }

static void ref_frequencies(const kiln_model_config *c, int64_t seq_len, double *out, double *scaling)
{
    const int64_t dim = c->rope_dim;
    const kiln_rope_scaling *r = &c->rope;
    *scaling = 1.0;
    double base = c->rope_theta;
    if (r->type == KILN_ROPE_DYNAMIC && seq_len > c->max_position_embeddings) {
        double grow = r->factor * (double)seq_len / (double)c->max_position_embeddings - (r->factor - 1);
        base = base * pow(grow, (double)dim / (double)(dim - 2));
    }
    /* yarn: the correction range over the dimension pairs. */
    double lo = 0, hi = 0;
    if (r->type == KILN_ROPE_YARN) {
        double orig = (double)r->original_max_position_embeddings;
        lo = (double)dim * log(orig / (r->beta_fast * 2 * M_PI)) / (2 * log(base));
        hi = (double)dim * log(orig / (r->beta_slow * 2 * M_PI)) / (2 * log(base));
        if (r->truncate) {
            lo = floor(lo);
            hi = ceil(hi);
        }
        lo = fmax(lo, 0);
        hi = fmin(hi, (double)dim - 1);
        if (lo == hi)
            hi += 0.001;
        double m = r->factor <= 1 ? 1 : 0.1 * log(r->factor) + 1;
        if (r->attention_factor > 0)
            *scaling = r->attention_factor;
        else if (r->mscale > 0 && r->mscale_all_dim > 0)
            *scaling = (r->factor <= 1 ? 1 : 0.1 * r->mscale * log(r->factor) + 1) /
                       (r->factor <= 1 ? 1 : 0.1 * r->mscale_all_dim * log(r->factor) + 1);
        else
            *scaling = m;
    }
    for (int64_t i = 0; i < dim / 2; i++) {
        double f = ref_default(base, dim, i);
        if (r->type == KILN_ROPE_LINEAR) {
            f /= r->factor;
        } else if (r->type == KILN_ROPE_YARN) {
            double ramp = fmin(fmax(((double)i - lo) / (hi - lo), 0), 1);
            double keep = 1 - ramp; /* the share of the unscaled (extrapolated) frequency */
            f = keep * f + (1 - keep) * f / r->factor;
        } else if (r->type == KILN_ROPE_LLAMA3) {
            double orig = (double)r->original_max_position_embeddings, wl = 2 * M_PI / f;
            if (wl > orig / r->low_freq_factor)
                f /= r->factor;
            else if (wl >= orig / r->high_freq_factor) {
                double s = (orig / wl - r->low_freq_factor) / (r->high_freq_factor - r->low_freq_factor);
                f = (1 - s) * f / r->factor + s * f;
            }
        }
        out[i] = f;
    }
}

/* kiln's frequencies for c against the reference, within float rounding. */
static void expect_frequencies(const kiln_model_config *c, int64_t seq_len, float *got, float *scaling)
{
    double want[KILN_MODEL_MAX_HEAD_DIM / 2], want_scaling;
    size_t n = (size_t)(c->rope_dim / 2);
    KILN_CHECK(kiln_model_rope_frequencies(c, seq_len, got, n, scaling));
    ref_frequencies(c, seq_len, want, &want_scaling);
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]) / want[i];
        if (err > 1e-6)
            fail_msg("rope type %d, pair %zu: %.9g, expected %.9g", (int)c->rope.type, i, (double)got[i], want[i]);
    }
    assert_true(fabs((double)*scaling - want_scaling) <= 1e-6 * want_scaling);
}

#define ROPE_BASE "{" SMALL ", \"rope_theta\": 500000.0, \"max_position_embeddings\": 131072, "

static void test_rope_types_against_reference(void **state)
{
    (void)state;
    static const char *const configs[] = {
        ROPE_BASE "\"rope_scaling\": null}",
        ROPE_BASE "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}}",
        ROPE_BASE "\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 4, \"rope_theta\": 10000}}",
        ROPE_BASE "\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}}",
        ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0,"
                  " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}}",
        ROPE_BASE "\"rope_parameters\": {\"rope_type\": \"llama3\", \"factor\": 32.0, \"low_freq_factor\": 1.0,"
                  " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192, \"rope_theta\": 500000.0}}",
        ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\":"
                  " 32768}}",
        ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 40, \"beta_fast\": 32, \"beta_slow\": 1,"
                  " \"mscale\": 0.707, \"mscale_all_dim\": 0.707, \"original_max_position_embeddings\": 4096}}",
        ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 8, \"beta_fast\": 16, \"beta_slow\": 2,"
                  " \"mscale\": 1.0, \"mscale_all_dim\": 0.5, \"truncate\": false,"
                  " \"original_max_position_embeddings\": 4096}}",
        ROPE_BASE "\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4.0, \"attention_factor\": 1.25,"
                  " \"original_max_position_embeddings\": 32768}}",
    };
    static const kiln_rope_type types[] = {KILN_ROPE_DEFAULT, KILN_ROPE_LINEAR, KILN_ROPE_LINEAR, KILN_ROPE_DYNAMIC,
                                           KILN_ROPE_LLAMA3,  KILN_ROPE_LLAMA3, KILN_ROPE_YARN,   KILN_ROPE_YARN,
                                           KILN_ROPE_YARN,    KILN_ROPE_YARN};
    for (size_t k = 0; k < sizeof configs / sizeof configs[0]; k++) {
        kiln_model_config c;
        KILN_CHECK(parse(configs[k], &c));
        assert_int_equal(c.rope.type, types[k]);
        assert_int_equal(c.head_dim, 128);
        assert_int_equal(c.rope_dim, 128);
        float f[64], scaling;
        for (int64_t seq_len = 0; seq_len <= 4 * 131072; seq_len += 131072 + 77)
            expect_frequencies(&c, seq_len, f, &scaling);
    }
}

/* Values checked by hand, beside the reference. */
static void test_rope_hand_checked(void **state)
{
    (void)state;
    kiln_model_config c;
    float f[64], g[64], s;
    KILN_CHECK(parse(ROPE_BASE "\"rope_scaling\": null}", &c));
    KILN_CHECK(kiln_model_rope_frequencies(&c, 0, g, 64, &s));
    assert_true(g[0] == 1.0f && s == 1.0f);
    assert_true(fabs(g[1] - pow(500000.0, -2.0 / 128)) < 1e-7);
    /* llama3, factor 8: wavelengths under 8192 / 4 = 2048 keep their
     * frequency, those over 8192 / 1 are divided by 8. */
    KILN_CHECK(parse(ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0,"
                               " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}}",
                     &c));
    assert_true(c.rope.factor == 8 && c.rope.low_freq_factor == 1 && c.rope.high_freq_factor == 4);
    assert_int_equal(c.rope.original_max_position_embeddings, 8192);
    KILN_CHECK(kiln_model_rope_frequencies(&c, 0, f, 64, &s));
    assert_true(s == 1.0f);
    assert_true(f[0] == g[0] && f[1] == g[1] && f[10] == g[10]); /* 2 pi / g[10] ~ 26 < 2048 */
    assert_true(f[63] == (float)((double)pow(500000.0, -126.0 / 128) / 8));
    assert_true(f[50] == (float)((double)pow(500000.0, -100.0 / 128) / 8));
    /* Between, the smooth band: strictly between the two. */
    int band = 0;
    for (int i = 0; i < 64; i++) {
        double wl = 2 * M_PI / g[i];
        if (wl >= 2048 && wl <= 8192) {
            assert_true(f[i] <= g[i] && f[i] >= g[i] / 8);
            band++;
        }
    }
    assert_true(band >= 1);
    /* linear, factor 2: every frequency halved. */
    KILN_CHECK(parse(ROPE_BASE "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}}", &c));
    KILN_CHECK(kiln_model_rope_frequencies(&c, 0, f, 64, &s));
    for (int i = 0; i < 64; i++)
        assert_true(f[i] == (float)(pow(500000.0, -(double)(2 * i) / 128) / 2));
    /* dynamic, factor 2: unchanged up to max_position_embeddings; at twice
     * it, the base is 500000 x (2 x 2 - 1)^(128 / 126). */
    KILN_CHECK(parse(ROPE_BASE "\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}}", &c));
    KILN_CHECK(kiln_model_rope_frequencies(&c, 131072, f, 64, &s));
    assert_memory_equal(f, g, sizeof f);
    KILN_CHECK(kiln_model_rope_frequencies(&c, 2 * 131072, f, 64, &s));
    assert_true(f[0] == 1.0f);
    assert_true(fabs(f[63] - pow(500000.0 * pow(3.0, 128.0 / 126), -126.0 / 128)) < 1e-12);
    /* yarn, factor 4: attention scaled by 0.1 ln 4 + 1; the highest frequency
     * kept, the lowest divided by 4. */
    KILN_CHECK(parse(ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0,"
                               " \"original_max_position_embeddings\": 32768}}",
                     &c));
    KILN_CHECK(kiln_model_rope_frequencies(&c, 0, f, 64, &s));
    assert_true(fabs(s - (0.1 * log(4.0) + 1)) < 1e-7);
    assert_true(f[0] == 1.0f && f[63] == g[63] / 4);
}

static void test_rope_fields_and_partial_rotary(void **state)
{
    (void)state;
    kiln_model_config c;
    /* rope_parameters (transformers 5) carries rope_theta and partial_rotary_factor. */
    KILN_CHECK(parse("{" SMALL ", \"rope_theta\": 1, \"rope_parameters\": {\"rope_type\": \"default\","
                     " \"rope_theta\": 25000, \"partial_rotary_factor\": 0.5}}",
                     &c));
    assert_true(c.rope_theta == 25000 && c.partial_rotary_factor == 0.5);
    assert_int_equal(c.rope_dim, 64);
    float f[64], s;
    KILN_EXPECT(kiln_model_rope_frequencies(&c, 0, f, 64, &s), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "n = 64",
                "rope_dim / 2 = 32");
    KILN_CHECK(kiln_model_rope_frequencies(&c, 0, f, 32, &s));
    assert_true(fabs(f[1] - pow(25000.0, -2.0 / 64)) < 1e-7);
    /* An odd rotated dimension is parsed; only the frequencies refuse it. */
    KILN_CHECK(parse("{" SMALL ", \"partial_rotary_factor\": 0.29}", &c));
    assert_int_equal(c.rope_dim, 37);
    KILN_EXPECT(kiln_model_rope_frequencies(&c, 0, f, 18, &s), KILN_ERR_CONFIG, kiln_errmsg(),
                "partial_rotary_factor 0.29 = 37", "even");
    /* At the top level, in older files (Phi). */
    KILN_CHECK(parse("{" SMALL ", \"partial_rotary_factor\": 0.25}", &c));
    assert_int_equal(c.rope_dim, 32);
    /* yarn: no factor, the ratio of the lengths; defaults of the optional fields. */
    KILN_CHECK(parse(ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"original_max_position_embeddings\": 32768,"
                               " \"beta_fast\": 0, \"beta_slow\": null}}",
                     &c));
    assert_true(c.rope.factor == 4.0 && c.rope.beta_fast == 32 && c.rope.beta_slow == 1 && c.rope.truncate == 1);
    /* yarn without original_max_position_embeddings: max_position_embeddings,
     * as standardize_rope_params sets it; a top-level one comes first. */
    KILN_CHECK(parse(ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 2}}", &c));
    assert_int_equal(c.rope.original_max_position_embeddings, 131072);
    KILN_CHECK(parse(ROPE_BASE "\"original_max_position_embeddings\": 4096, \"rope_scaling\": {\"rope_type\": \"yarn\","
                               " \"factor\": 2, \"original_max_position_embeddings\": 8192}}",
                     &c));
    assert_int_equal(c.rope.original_max_position_embeddings, 4096);
    /* A factor given wins over the ratio of the lengths (transformers 5.17
     * warns of the mismatch and keeps the factor: examples/decode/check.py). */
    assert_true(c.rope.factor == 2);
    KILN_CHECK(parse(ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 2}}", &c));
    assert_true(c.rope.factor == 2);
    /* A hand-built config: rope_dim 0 is head_dim, type 0 default. */
    kiln_model_config_default(&c);
    c.rope_dim = 0;
    KILN_CHECK(kiln_model_rope_frequencies(&c, 0, f, 64, &s));
    c.rope.type = KILN_ROPE_LLAMA3;
    c.rope.factor = 8;
    c.rope.low_freq_factor = 4;
    c.rope.high_freq_factor = 1;
    c.rope.original_max_position_embeddings = 8192;
    KILN_EXPECT(kiln_model_rope_frequencies(&c, 0, f, 64, &s), KILN_ERR_CONFIG, kiln_errmsg(), "low_freq_factor = 4",
                "high_freq_factor = 1");
    KILN_EXPECT(kiln_model_rope_frequencies(&c, -1, f, 64, &s), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "seq_len = -1", NULL);
    KILN_EXPECT(kiln_model_rope_frequencies(NULL, 0, f, 64, &s), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "NULL",
                NULL);
}

static void test_bad_rope_names_field_and_value(void **state)
{
    (void)state;
    static const struct {
        const char *json, *a, *b;
    } cases[] = {
        {ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"longrope\", \"factor\": 2}}", "rope_scaling.rope_type",
         "\"longrope\""},
        {ROPE_BASE "\"rope_scaling\": {\"type\": \"su\"}}", "rope_scaling.type = \"su\"", "llama3"},
        {ROPE_BASE "\"rope_parameters\": {\"rope_type\": 3}}", "rope_parameters.rope_type = 3", NULL},
        {ROPE_BASE "\"rope_scaling\": \"linear\"}", "rope_scaling = \"linear\"", "object"},
        {ROPE_BASE "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 0}}", "rope_scaling.factor = 0", NULL},
        {ROPE_BASE "\"rope_scaling\": {\"type\": \"linear\", \"factor\": -2}}", "rope_scaling.factor = -2", NULL},
        {ROPE_BASE "\"rope_scaling\": {\"type\": \"linear\"}}", "needs factor", "missing"},
        {ROPE_BASE "\"rope_scaling\": {\"type\": \"linear\", \"factor\": \"2\"}}", "rope_scaling.factor = \"2\"",
         "number"},
        {ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"high_freq_factor\": 4}}",
         "needs low_freq_factor", "missing"},
        {ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4,"
                   " \"high_freq_factor\": 4}}",
         "low_freq_factor = 4", "high_freq_factor = 4"},
        {ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1,"
                   " \"high_freq_factor\": 4, \"original_max_position_embeddings\": 0}}",
         "original_max_position_embeddings = 0", NULL},
        {"{" SMALL ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1,"
                   " \"high_freq_factor\": 4}}",
         "needs original_max_position_embeddings", "missing"},
        {"{" SMALL ", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2}}", "\"dynamic\" needs "
                                                                               "max_position_embeddings", NULL},
        {ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4, \"beta_fast\": 1, \"beta_slow\": 8}}",
         "beta_fast = 1", "beta_slow = 8"},
        {ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4, \"attention_factor\": 0}}",
         "attention_factor = 0", NULL},
        {ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4, \"mscale\": -1, \"mscale_all_dim\": 1}}",
         "mscale = -1", NULL},
        {ROPE_BASE "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4, \"truncate\": 1}}",
         "rope_scaling.truncate = 1", "true or false"},
        {ROPE_BASE "\"rope_parameters\": {\"full_attention\": {\"rope_type\": \"default\"}}}",
         "rope_parameters.full_attention", "per layer type"},
        {"{" SMALL ", \"partial_rotary_factor\": 0.01}", "partial_rotary_factor 0.01 = 1", "at least 2"},
        {"{" SMALL ", \"rope_parameters\": {\"partial_rotary_factor\": 1.5}}", "partial_rotary_factor = 1.5",
         NULL},
        {"{" SMALL ", \"sliding_window\": 4096.5}", "sliding_window = 4096.5", NULL},
        {"{" SMALL ", \"sliding_window\": -1}", "sliding_window = -1", NULL},
        {"{" SMALL ", \"use_sliding_window\": \"yes\"}", "use_sliding_window = \"yes\"", NULL},
        {"{" SMALL ", \"max_position_embeddings\": 0}", "max_position_embeddings = 0", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_refused(cases[i].json, cases[i].a, cases[i].b);
}

static void test_qk_norm_and_sliding_window(void **state)
{
    (void)state;
    kiln_model_config c;
    KILN_CHECK(parse("{" SMALL ", \"model_type\": \"qwen3\", \"head_dim\": 256}", &c));
    assert_true(c.qk_norm);
    assert_int_equal(c.head_dim, 256);
    KILN_CHECK(parse("{" SMALL ", \"model_type\": \"qwen2\"}", &c));
    assert_false(c.qk_norm);
    KILN_CHECK(parse("{" SMALL ", \"architectures\": [\"Qwen3ForCausalLM\"]}", &c));
    assert_true(c.qk_norm);
    KILN_CHECK(parse("{" SMALL ", \"model_type\": \"mistral\", \"sliding_window\": 4096}", &c));
    assert_int_equal(c.sliding_window, 4096);
    KILN_CHECK(parse("{" SMALL ", \"model_type\": \"mistral\", \"sliding_window\": null}", &c));
    assert_int_equal(c.sliding_window, 0);
    /* Qwen2 keeps its window only when use_sliding_window says so. */
    KILN_CHECK(parse("{" SMALL ", \"sliding_window\": 32768, \"use_sliding_window\": false}", &c));
    assert_int_equal(c.sliding_window, 0);
    KILN_CHECK(parse("{" SMALL ", \"sliding_window\": 32768, \"use_sliding_window\": true}", &c));
    assert_int_equal(c.sliding_window, 32768);
}

/* The config.json files as the hub ships them (tests/data). */
static void load_data(const char *name, kiln_model_config *c)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", KILN_TEST_DATA_DIR, name);
    KILN_CHECK(kiln_model_config_load(path, c));
    float f[KILN_MODEL_MAX_HEAD_DIM / 2], s;
    expect_frequencies(c, 0, f, &s);
}

static void test_real_configs(void **state)
{
    (void)state;
    kiln_model_config c;
    load_data("llama-3.1-8b.json", &c);
    assert_string_equal(c.name, "llama");
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    assert_int_equal(c.vocab_size, 128256);
    assert_int_equal(c.hidden_size, 4096);
    assert_int_equal(c.intermediate_size, 14336);
    assert_int_equal(c.num_attention_heads, 32);
    assert_int_equal(c.num_key_value_heads, 8);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.rope_dim, 128);
    assert_true(c.rope_theta == 500000.0);
    assert_int_equal(c.rope.type, KILN_ROPE_LLAMA3);
    assert_true(c.rope.factor == 8 && c.rope.low_freq_factor == 1 && c.rope.high_freq_factor == 4);
    assert_int_equal(c.rope.original_max_position_embeddings, 8192);
    assert_int_equal(c.max_position_embeddings, 131072);
    assert_false(c.tie_word_embeddings || c.qk_norm || c.sliding_window);

    load_data("llama-3.2-1b.json", &c);
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    assert_int_equal(c.hidden_size, 2048);
    assert_int_equal(c.intermediate_size, 8192);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.rope_dim, 64);
    assert_true(c.tie_word_embeddings);
    assert_int_equal(c.rope.type, KILN_ROPE_LLAMA3);
    assert_true(c.rope.factor == 32 && c.rope.low_freq_factor == 1 && c.rope.high_freq_factor == 4);

    load_data("qwen2.5-7b.json", &c);
    assert_string_equal(c.name, "qwen2");
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    assert_int_equal(c.vocab_size, 152064);
    assert_int_equal(c.hidden_size, 3584);
    assert_int_equal(c.intermediate_size, 18944);
    assert_int_equal(c.num_attention_heads, 28);
    assert_int_equal(c.num_key_value_heads, 4);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.rope.type, KILN_ROPE_DEFAULT);
    assert_true(c.rope_theta == 1e6);
    assert_int_equal(c.sliding_window, 0); /* use_sliding_window: false */
    assert_false(c.tie_word_embeddings || c.qk_norm);

    load_data("qwen3-8b.json", &c);
    assert_string_equal(c.name, "qwen3");
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    assert_int_equal(c.vocab_size, 151936);
    assert_int_equal(c.hidden_size, 4096);
    assert_int_equal(c.intermediate_size, 12288);
    assert_int_equal(c.num_key_value_heads, 8);
    assert_int_equal(c.head_dim, 128);
    assert_true(c.qk_norm);
    assert_int_equal(c.rope.type, KILN_ROPE_DEFAULT);
    assert_int_equal(c.max_position_embeddings, 40960);
    assert_int_equal(c.sliding_window, 0);

    load_data("mistral-7b-v0.3.json", &c);
    assert_string_equal(c.name, "mistral");
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    assert_int_equal(c.vocab_size, 32768);
    assert_int_equal(c.hidden_size, 4096);
    assert_int_equal(c.intermediate_size, 14336);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.rope.type, KILN_ROPE_DEFAULT);
    assert_true(c.rope_theta == 1e6);
    assert_int_equal(c.sliding_window, 0);
    assert_false(c.qk_norm);

    load_data("qwen2.5-0.5b.json", &c);
    assert_int_equal(c.dtype, KILN_DTYPE_BF16);
    assert_int_equal(c.head_dim, 64);
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
        cmocka_unit_test(test_moe_fields_and_unknown_families),
        cmocka_unit_test(test_moe_configs_refused),
        cmocka_unit_test(test_moe_real_configs),
        cmocka_unit_test(test_bad_linear_attention_names_field_and_value),
        cmocka_unit_test(test_linear_attention_specializations),
        cmocka_unit_test(test_dtype),
        cmocka_unit_test(test_rope_types_against_reference),
        cmocka_unit_test(test_rope_hand_checked),
        cmocka_unit_test(test_rope_fields_and_partial_rotary),
        cmocka_unit_test(test_bad_rope_names_field_and_value),
        cmocka_unit_test(test_qk_norm_and_sliding_window),
        cmocka_unit_test(test_real_configs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
