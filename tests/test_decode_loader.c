/* examples/decode's loader, on the host: configs it takes and refuses, and
 * checkpoints whose tensors are missing, mis-shaped or of another dtype, each
 * refused with a message naming the tensor and the values; and the model
 * FLOPs its prefill benchmark counts. */
#include "testutil.h"
#include "decoder.h"
#include "st_writer.h"

static const tiny_model LLAMA = {"llama", 0, 512, 128, 256, 2, 2, 1, 64, 10000.0, 0.05f, 7};
static const tiny_model QWEN = {"qwen2", 1, 512, 128, 256, 2, 4, 2, 64, 1e6, 0.05f, 9};
/* head_dim 128, 4 heads: q is 512 wide, hidden 128. */
static const tiny_model QWEN3 = {"qwen3", 0, 512, 128, 256, 2, 4, 2, 128, 1e6, 0.05f, 5};

static const char *LLAMA_JSON =
    "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":128,"
    "\"intermediate_size\":256,\"num_hidden_layers\":2,\"num_attention_heads\":2,\"num_key_value_heads\":1,"
    "\"head_dim\":64,\"rms_norm_eps\":1e-5,\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":500000.0},"
    "\"tie_word_embeddings\":false%s}";

static const char *MISTRAL_JSON =
    "{\"model_type\":\"mistral\",\"vocab_size\":512,\"hidden_size\":128,\"intermediate_size\":256,"
    "\"num_hidden_layers\":2,\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":64%s}";

static kiln_status parse_mistral(const char *extra, dec_config *c)
{
    char json[2048];
    snprintf(json, sizeof json, MISTRAL_JSON, extra);
    return dec_config_parse(json, strlen(json), c);
}

static kiln_status parse_with(const char *extra, dec_config *c)
{
    char json[2048];
    snprintf(json, sizeof json, LLAMA_JSON, extra);
    return dec_config_parse(json, strlen(json), c);
}

static void expect_msg(kiln_status got, kiln_status want, const char *a, const char *b)
{
    if (got != want)
        fail_msg("status %s, want %s: %s", kiln_status_code(got), kiln_status_code(want), dec_errmsg());
    if (a && !strstr(dec_errmsg(), a))
        fail_msg("message \"%s\" lacks \"%s\"", dec_errmsg(), a);
    if (b && !strstr(dec_errmsg(), b))
        fail_msg("message \"%s\" lacks \"%s\"", dec_errmsg(), b);
}

static void test_config(void **state)
{
    (void)state;
    dec_config c;
    KILN_CHECK(parse_with(",\"eos_token_id\":[2,7],\"hidden_act\":\"silu\"", &c));
    assert_string_equal(c.model_type, "llama");
    assert_int_equal(c.layers, 2);
    assert_int_equal(c.qkv_bias, 0);
    assert_true(c.base.rope_theta == 500000.0);
    assert_int_equal(c.n_eos, 2);
    assert_int_equal(c.eos[1], 7);
    KILN_CHECK(parse_with(",\"attention_bias\":true,\"rope_scaling\":null", &c));
    assert_int_equal(c.qkv_bias, 1);
    char json[2048];
    tiny_config_json(&QWEN, json, sizeof json);
    KILN_CHECK(dec_config_parse(json, strlen(json), &c));
    assert_string_equal(c.model_type, "qwen2");
    assert_int_equal(c.qkv_bias, 1);
    assert_int_equal(c.base.tie_word_embeddings, 1);
    assert_true(c.base.rope_theta == 1e6);
    assert_true(c.rope_inv_freq[0] == 1.0f && c.rope_attention_scaling == 1.0f);
    /* Scaled RoPE is taken, and its frequencies computed: llama3 divides the
     * lowest by factor, yarn scales the attention. */
    KILN_CHECK(parse_with(",\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":1.0,"
                          "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192}",
                          &c));
    assert_int_equal(c.base.rope.type, KILN_ROPE_LLAMA3);
    float plain[32], s;
    kiln_model_config d = c.base;
    d.rope.type = KILN_ROPE_DEFAULT;
    KILN_CHECK(kiln_model_rope_frequencies(&d, 0, plain, 32, &s));
    assert_true(c.rope_inv_freq[0] == plain[0] && c.rope_inv_freq[31] == plain[31] / 8);
    KILN_CHECK(parse_with(",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4.0,"
                          "\"original_max_position_embeddings\":4096}",
                          &c));
    assert_true(c.rope_attention_scaling > 1.13f && c.rope_attention_scaling < 1.14f);
    /* Mistral: no window, or one as long as the model's longest sequence, is Llama. */
    KILN_CHECK(parse_mistral(",\"sliding_window\":null", &c));
    assert_string_equal(c.model_type, "mistral");
    KILN_CHECK(parse_mistral(",\"sliding_window\":32768,\"max_position_embeddings\":32768",
                          &c));
    assert_int_equal(c.base.sliding_window, 0);
    /* A shorter window is the attention's. */
    KILN_CHECK(parse_mistral(",\"sliding_window\":4096,\"max_position_embeddings\":32768", &c));
    assert_int_equal(c.base.sliding_window, 4096);
    KILN_CHECK(parse_mistral(",\"sliding_window\":4096", &c));
    assert_int_equal(c.base.sliding_window, 4096);
    /* head_dim 256 (Qwen3-Next's attention layers, Gemma's). */
    const char *hd256 = "{\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":128,\"intermediate_size\":256,"
                        "\"num_hidden_layers\":2,\"num_attention_heads\":2,\"head_dim\":256}";
    KILN_CHECK(dec_config_parse(hd256, strlen(hd256), &c));
    assert_int_equal(c.base.head_dim, 256);
    /* The real configs of tests/data: Llama 3.x, Qwen2.5, Qwen3 and Mistral parse. */
    static const char *const real[] = {"llama-3.1-8b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b-v0.3",
                                       "qwen2.5-0.5b", "qwen3-8b"};
    char path[1024];
    for (size_t i = 0; i < sizeof real / sizeof real[0]; i++) {
        snprintf(path, sizeof path, "%s/%s.json", KILN_TEST_DATA_DIR, real[i]);
        KILN_CHECK(dec_config_load(path, &c));
        assert_int_equal(c.base.dtype, KILN_DTYPE_BF16);
    }
    snprintf(path, sizeof path, "%s/llama-3.2-1b.json", KILN_TEST_DATA_DIR);
    KILN_CHECK(dec_config_load(path, &c));
    assert_true(c.base.tie_word_embeddings && c.base.head_dim == 64 && c.base.rope.factor == 32);
    snprintf(path, sizeof path, "%s/qwen2.5-7b.json", KILN_TEST_DATA_DIR);
    KILN_CHECK(dec_config_load(path, &c));
    assert_true(c.qkv_bias);
    snprintf(path, sizeof path, "%s/qwen3-8b.json", KILN_TEST_DATA_DIR);
    KILN_CHECK(dec_config_load(path, &c));
    assert_true(c.base.qk_norm && c.base.head_dim == 128 && !c.qkv_bias);
    assert_string_equal(c.model_type, "qwen3");
}

static void test_config_refused(void **state)
{
    (void)state;
    dec_config c;
    const char *bad = "{\"model_type\":\"gemma\",\"vocab_size\":512,\"hidden_size\":128,\"intermediate_size\":256,"
                      "\"num_hidden_layers\":2,\"num_attention_heads\":2}";
    expect_msg(dec_config_parse(bad, strlen(bad), &c), KILN_ERR_CONFIG, "model_type = \"gemma\"",
               "unsupported architecture");
    const char *hd80 = "{\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":160,\"intermediate_size\":256,"
                       "\"num_hidden_layers\":2,\"num_attention_heads\":2}";
    expect_msg(dec_config_parse(hd80, strlen(hd80), &c), KILN_ERR_CONFIG, "head_dim = 80", "64, 128 or 256");
    expect_msg(parse_with(",\"hidden_act\":\"gelu\"", &c), KILN_ERR_CONFIG, "hidden_act = \"gelu\"", NULL);
    expect_msg(parse_with(",\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8}", &c), KILN_ERR_CONFIG,
               "rope_type = \"llama3\" needs", "missing");
    expect_msg(parse_with(",\"rope_scaling\":{\"rope_type\":\"longrope\",\"factor\":8}", &c), KILN_ERR_CONFIG,
               "rope_scaling.rope_type = \"longrope\"", NULL);
    expect_msg(parse_with(",\"mlp_bias\":true", &c), KILN_ERR_CONFIG, "mlp_bias = true", NULL);
    expect_msg(parse_with(",\"use_sliding_window\":true", &c), KILN_ERR_CONFIG, "use_sliding_window", NULL);
    expect_msg(parse_with(",\"eos_token_id\":600", &c), KILN_ERR_CONFIG, "eos_token_id = 600", NULL);
    const char *no_layers = "{\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":128,"
                            "\"intermediate_size\":256,\"num_attention_heads\":2}";
    expect_msg(dec_config_parse(no_layers, strlen(no_layers), &c), KILN_ERR_CONFIG, "num_hidden_layers", NULL);
    const char *hd96 = "{\"model_type\":\"llama\",\"vocab_size\":512,\"hidden_size\":192,\"intermediate_size\":256,"
                       "\"num_hidden_layers\":2,\"num_attention_heads\":2}";
    expect_msg(dec_config_parse(hd96, strlen(hd96), &c), KILN_ERR_CONFIG, "head_dim = 96", "64, 128 or 256");
    expect_msg(dec_config_parse("{", 1, &c), KILN_ERR_CONFIG, NULL, NULL);
}

/* Writes m's checkpoint with one tensor changed: dropped (rank 0), renamed, reshaped or retyped. */
static void write_changed(const tiny_model *m, const char *dir, const char *name, int drop, long long d0,
                          const char *dtype)
{
    st_entry e[64];
    size_t n = tiny_entries(m, e, 64), k = 0;
    assert_true(n <= 64);
    for (size_t i = 0; i < n; i++) {
        if (!strcmp(e[i].name, name)) {
            if (drop)
                continue;
            if (d0)
                e[i].dims[0] = d0;
            if (dtype)
                e[i].dtype = dtype;
        }
        e[k++] = e[i];
    }
    size_t size;
    uint8_t *f = st_build(e, k, NULL, NULL, NULL, &size);
    char path[700], json[2048];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_true(st_write_file(path, f, size));
    free(f);
    snprintf(path, sizeof path, "%s/config.json", dir);
    tiny_config_json(m, json, sizeof json);
    assert_true(st_write_file(path, json, strlen(json)));
}

static void test_checkpoints(void **state)
{
    (void)state;
    char dir[512];
    kiln_test_tmpdir(dir, sizeof dir);
    dec_checkpoint ck;
    assert_true(tiny_write(&LLAMA, dir));
    KILN_CHECK(dec_checkpoint_open(dir, &ck));
    assert_int_equal(ck.n_files, 1);
    assert_int_equal(ck.config.layers, 2);
    dec_checkpoint_close(&ck);
    assert_true(tiny_write(&QWEN, dir));
    KILN_CHECK(dec_checkpoint_open(dir, &ck));
    dec_checkpoint_close(&ck);
    assert_true(tiny_write(&QWEN3, dir));
    KILN_CHECK(dec_checkpoint_open(dir, &ck));
    assert_true(ck.config.base.qk_norm);
    dec_checkpoint_close(&ck);
    /* Qwen3's q/k norms: needed, and of [head_dim]. */
    write_changed(&QWEN3, dir, "model.layers.1.self_attn.q_norm.weight", 1, 0, NULL);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND,
               "tensor model.layers.1.self_attn.q_norm.weight is missing", "qwen3");
    write_changed(&QWEN3, dir, "model.layers.0.self_attn.k_norm.weight", 0, 64, NULL);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_CONFIG,
               "tensor model.layers.0.self_attn.k_norm.weight: shape [64], expected [128]", NULL);

    write_changed(&LLAMA, dir, "model.layers.1.self_attn.k_proj.weight", 1, 0, NULL);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND, "tensor model.layers.1.self_attn.k_proj.weight is missing",
               NULL);
    write_changed(&LLAMA, dir, "lm_head.weight", 1, 0, NULL);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND, "tensor lm_head.weight is missing", NULL);
    write_changed(&QWEN, dir, "model.layers.0.self_attn.v_proj.bias", 1, 0, NULL);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND, "model.layers.0.self_attn.v_proj.bias is missing",
               NULL);
    write_changed(&LLAMA, dir, "model.layers.0.mlp.down_proj.weight", 0, 127, NULL);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_CONFIG,
               "tensor model.layers.0.mlp.down_proj.weight: shape [127, 256], expected [128, 256]", NULL);
    write_changed(&LLAMA, dir, "model.embed_tokens.weight", 0, 0, "F32");
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_CONFIG,
               "tensor model.embed_tokens.weight: dtype F32, expected F16", NULL);

    /* No weights at all; then a bad shard index. */
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(remove(path), 0);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_IO, "neither model.safetensors", NULL);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    const char *idx = "{\"weight_map\":{\"model.norm.weight\":\"../x.safetensors\"}}";
    assert_true(st_write_file(path, idx, strlen(idx)));
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_CONFIG, "not a file name", NULL);
    kiln_test_rmrf(dir);
}

/* A checkpoint split in two shards through model.safetensors.index.json. */
static void test_sharded(void **state)
{
    (void)state;
    char dir[512], path[700];
    kiln_test_tmpdir(dir, sizeof dir);
    st_entry e[64];
    size_t n = tiny_entries(&LLAMA, e, 64), size;
    uint8_t *a = st_build(e, n / 2, NULL, NULL, NULL, &size);
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    assert_true(st_write_file(path, a, size));
    free(a);
    a = st_build(e + n / 2, n - n / 2, NULL, NULL, NULL, &size);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    assert_true(st_write_file(path, a, size));
    free(a);
    char idx[16384];
    size_t len = (size_t)snprintf(idx, sizeof idx, "{\"metadata\":{},\"weight_map\":{");
    for (size_t i = 0; i < n; i++)
        len += (size_t)snprintf(idx + len, sizeof idx - len, "%s\"%s\":\"model-0000%d-of-00002.safetensors\"",
                                i ? "," : "", e[i].name, i < n / 2 ? 1 : 2);
    len += (size_t)snprintf(idx + len, sizeof idx - len, "}}");
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    assert_true(st_write_file(path, idx, len));
    char json[2048];
    tiny_config_json(&LLAMA, json, sizeof json);
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_true(st_write_file(path, json, strlen(json)));
    dec_checkpoint ck;
    KILN_CHECK(dec_checkpoint_open(dir, &ck));
    assert_int_equal(ck.n_files, 2);
    dec_checkpoint_close(&ck);

    /* The index puts the last tensor in shard 1, which does not hold it. */
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    char *moved = strstr(idx, e[n - 1].name);
    assert_non_null(moved);
    char *digit = strstr(moved, "model-00002");
    digit[10] = '1';
    assert_true(st_write_file(path, idx, len));
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND, e[n - 1].name,
               "in model-00001-of-00002.safetensors, which does not hold it");
    /* A shard the index names that is not there: both named. */
    digit[10] = '3';
    assert_true(st_write_file(path, idx, len));
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_IO, "shard model-00003-of-00002.safetensors", e[n - 1].name);
    kiln_test_rmrf(dir);
}

/* Opens the checkpoint folder that holds the file path. */
static kiln_status open_folder_of(const char *path)
{
    char dir[700];
    snprintf(dir, sizeof dir, "%s", path);
    *strrchr(dir, '/') = 0;
    dec_checkpoint ck;
    kiln_status st = dec_checkpoint_open(dir, &ck);
    if (!st)
        dec_checkpoint_close(&ck);
    return st;
}

/* `mkfifo d/model.safetensors` (or config.json, or the shard index) and
 * `decode --model d` blocked forever. */
static void test_fifo_refused(void **state)
{
    (void)state;
    static const char *const names[] = {"config.json", "model.safetensors", "model.safetensors.index.json"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char dir[512], path[700];
        kiln_test_tmpdir(dir, sizeof dir);
        assert_true(tiny_write(&LLAMA, dir));
        if (i == 2) {
            snprintf(path, sizeof path, "%s/model.safetensors", dir);
            assert_int_equal(remove(path), 0);
        }
        assert_int_equal(st_expect_fifo_refused(open_folder_of, dec_errmsg, dir, names[i]), 0);
        kiln_test_rmrf(dir);
    }
}

/* ---- mixtures of experts ---- */

/* A tiny MoE checkpoint: the attention of base (its type's biases / q-k
 * norms), every layer's MLP experts E wide XI, Qwen2-MoE's shared expert
 * (SI wide; 0: none), in one of transformers' layouts. */
typedef struct tiny_moe {
    const char *model_type; /* "qwen3_moe", "qwen2_moe", "mixtral" */
    tiny_model base;
    long long experts, top_k, inter, shared;
    int fused;
} tiny_moe;

static const tiny_moe Q3MOE = {"qwen3_moe", {"qwen3", 0, 512, 128, 256, 2, 2, 1, 64, 1e6, 0.05f, 3}, 4, 2, 128, 0, 0};
static const tiny_moe Q2MOE = {"qwen2_moe", {"qwen2", 0, 512, 128, 256, 2, 2, 1, 64, 1e6, 0.05f, 4}, 4, 2, 64, 192, 0};
static const tiny_moe MIXTRAL = {"mixtral", {"llama", 0, 512, 128, 256, 2, 2, 1, 64, 1e6, 0.05f, 6}, 4, 2, 64, 0, 0};

static void add_entry(st_entry *e, size_t *n, size_t cap, const char *name, int rank, long long d0, long long d1,
                      long long d2)
{
    assert_true(*n < cap);
    memset(&e[*n], 0, sizeof e[*n]);
    snprintf(e[*n].name, sizeof e[*n].name, "%s", name);
    e[*n].rank = rank;
    e[*n].dims[0] = d0;
    e[*n].dims[1] = d1;
    e[*n].dims[2] = d2;
    (*n)++;
}

static size_t moe_entries(const tiny_moe *m, st_entry *e, size_t cap)
{
    st_entry dense[64];
    size_t nd = tiny_entries(&m->base, dense, 64), n = 0;
    assert_true(nd <= 64);
    for (size_t i = 0; i < nd; i++)
        if (!strstr(dense[i].name, ".mlp.")) {
            assert_true(n < cap);
            e[n++] = dense[i];
        }
    const long long H = m->base.hidden, E = m->experts, XI = m->inter, SI = m->shared;
    const int mixtral = !strcmp(m->model_type, "mixtral");
    const char *block = mixtral && !m->fused ? "block_sparse_moe" : "mlp";
    char nm[128];
    for (long long l = 0; l < m->base.layers; l++) {
        snprintf(nm, sizeof nm, "model.layers.%lld.%s.gate.weight", l, block);
        add_entry(e, &n, cap, nm, 2, E, H, 0);
        if (m->fused) {
            snprintf(nm, sizeof nm, "model.layers.%lld.mlp.experts.gate_up_proj", l);
            add_entry(e, &n, cap, nm, 3, E, 2 * XI, H);
            snprintf(nm, sizeof nm, "model.layers.%lld.mlp.experts.down_proj", l);
            add_entry(e, &n, cap, nm, 3, E, H, XI);
        } else {
            static const char *const proj[2][3] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};
            for (long long x = 0; x < E; x++)
                for (int k = 0; k < 3; k++) {
                    snprintf(nm, sizeof nm, "model.layers.%lld.%s.experts.%lld.%s.weight", l, block, x, proj[mixtral][k]);
                    add_entry(e, &n, cap, nm, 2, k == 2 ? H : XI, k == 2 ? XI : H, 0);
                }
        }
        if (SI) {
            static const char *const sh[3] = {"gate_proj", "up_proj", "down_proj"};
            for (int k = 0; k < 3; k++) {
                snprintf(nm, sizeof nm, "model.layers.%lld.mlp.shared_expert.%s.weight", l, sh[k]);
                add_entry(e, &n, cap, nm, 2, k == 2 ? H : SI, k == 2 ? SI : H, 0);
            }
            snprintf(nm, sizeof nm, "model.layers.%lld.mlp.shared_expert_gate.weight", l);
            add_entry(e, &n, cap, nm, 2, 1, H, 0);
        }
    }
    return n;
}

static void moe_config_json(const tiny_moe *m, char *buf, size_t cap)
{
    const tiny_model *b = &m->base;
    const int mixtral = !strcmp(m->model_type, "mixtral");
    snprintf(buf, cap,
             "{\"model_type\":\"%s\",\"vocab_size\":%lld,\"hidden_size\":%lld,\"intermediate_size\":%lld,"
             "\"num_hidden_layers\":%lld,\"num_attention_heads\":%lld,\"num_key_value_heads\":%lld,\"head_dim\":%lld,"
             "\"rms_norm_eps\":1e-06,\"rope_theta\":%g,\"tie_word_embeddings\":false,\"dtype\":\"float16\","
             "\"%s\":%lld,\"num_experts_per_tok\":%lld%s%lld%s%lld}",
             m->model_type, b->vocab, b->hidden, mixtral ? m->inter : b->inter, b->layers, b->heads, b->kv_heads,
             b->head_dim, b->theta, mixtral ? "num_local_experts" : "num_experts", m->experts, m->top_k,
             mixtral ? ",\"max_position_embeddings\":" : ",\"moe_intermediate_size\":",
             mixtral ? 4096LL : m->inter, ",\"shared_expert_intermediate_size\":", m->shared);
}

/* Writes m's checkpoint with one tensor changed: dropped, or its dims 0 and 1 set. */
static void write_moe(const tiny_moe *m, const char *dir, const char *name, int drop, long long d0, long long d1)
{
    static st_entry e[512];
    size_t n = moe_entries(m, e, 512), k = 0;
    for (size_t i = 0; i < n; i++) {
        if (name && !strcmp(e[i].name, name)) {
            if (drop)
                continue;
            e[i].dims[0] = d0 ? d0 : e[i].dims[0];
            e[i].dims[1] = d1 ? d1 : e[i].dims[1];
        }
        e[k++] = e[i];
    }
    size_t size;
    uint8_t *f = st_build(e, k, NULL, NULL, NULL, &size);
    char path[700], json[2048];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_true(st_write_file(path, f, size));
    free(f);
    moe_config_json(m, json, sizeof json);
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_true(st_write_file(path, json, strlen(json)));
}

static void test_moe_config(void **state)
{
    (void)state;
    dec_config c;
    char json[2048];
    moe_config_json(&Q2MOE, json, sizeof json);
    KILN_CHECK(dec_config_parse(json, strlen(json), &c));
    assert_string_equal(c.model_type, "qwen2_moe");
    assert_true(c.base.num_experts == 4 && c.base.num_experts_per_tok == 2 && c.base.moe_intermediate_size == 64);
    assert_int_equal(c.shared_inter, 192);
    assert_int_equal(c.qkv_bias, 1); /* Qwen2-MoE's q/k/v biases, unless qkv_bias says otherwise */
    moe_config_json(&MIXTRAL, json, sizeof json);
    KILN_CHECK(dec_config_parse(json, strlen(json), &c));
    assert_true(c.base.norm_topk_prob && c.shared_inter == 0 && !c.qkv_bias && c.base.moe_intermediate_size == 64);
    moe_config_json(&Q3MOE, json, sizeof json);
    KILN_CHECK(dec_config_parse(json, strlen(json), &c));
    assert_true(c.base.qk_norm && c.shared_inter == 0);
    /* By the architecture, without a model_type. */
    const char *arch = "{\"architectures\":[\"Qwen2MoeForCausalLM\"],\"vocab_size\":512,\"hidden_size\":128,"
                       "\"intermediate_size\":256,\"num_hidden_layers\":2,\"num_attention_heads\":2,\"head_dim\":64,"
                       "\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":64,\"qkv_bias\":false,"
                       "\"shared_expert_intermediate_size\":64}";
    KILN_CHECK(dec_config_parse(arch, strlen(arch), &c));
    assert_string_equal(c.model_type, "qwen2_moe");
    assert_true(!c.qkv_bias && c.shared_inter == 64);
    /* The real configs of tests/data. */
    char path[1024];
    snprintf(path, sizeof path, "%s/qwen3-30b-a3b.json", KILN_TEST_DATA_DIR);
    KILN_CHECK(dec_config_load(path, &c));
    assert_true(c.layers == 48 && c.base.num_experts == 128 && c.base.num_experts_per_tok == 8 && c.base.qk_norm);
    assert_true(c.n_eos == 1 && c.eos[0] == 151645 && !c.qkv_bias);
    snprintf(path, sizeof path, "%s/mixtral-8x7b-v0.1.json", KILN_TEST_DATA_DIR);
    KILN_CHECK(dec_config_load(path, &c));
    assert_true(c.layers == 32 && c.base.num_experts == 8 && c.base.moe_intermediate_size == 14336);
    assert_string_equal(c.model_type, "mixtral");
    /* Refused: experts in a dense family, shapes the experts do not take,
     * dense layers among the experts' (the library's parse). */
    expect_msg(parse_with(",\"num_experts\":8", &c), KILN_ERR_CONFIG, "8 experts in a llama config", NULL);
    const char *h192 = "{\"model_type\":\"qwen3_moe\",\"vocab_size\":512,\"hidden_size\":192,\"intermediate_size\":256,"
                       "\"num_hidden_layers\":2,\"num_attention_heads\":3,\"head_dim\":64,\"num_experts\":4,"
                       "\"moe_intermediate_size\":64}";
    expect_msg(dec_config_parse(h192, strlen(h192), &c), KILN_ERR_CONFIG, "hidden_size = 192", "multiple of 128");
    const char *i96 = "{\"model_type\":\"mixtral\",\"vocab_size\":512,\"hidden_size\":128,\"intermediate_size\":96,"
                      "\"num_hidden_layers\":2,\"num_attention_heads\":2,\"num_local_experts\":4}";
    expect_msg(dec_config_parse(i96, strlen(i96), &c), KILN_ERR_CONFIG, "expert intermediate size = 96",
               "multiple of 64");
    const char *dense = "{\"model_type\":\"qwen2_moe\",\"vocab_size\":512,\"hidden_size\":128,\"intermediate_size\":256,"
                        "\"num_hidden_layers\":2,\"num_attention_heads\":2,\"num_experts\":4,\"mlp_only_layers\":[1]}";
    expect_msg(dec_config_parse(dense, strlen(dense), &c), KILN_ERR_CONFIG, "mlp_only_layers = [1]", NULL);
    const char *next = "{\"model_type\":\"qwen3_next\",\"vocab_size\":512,\"hidden_size\":128,\"intermediate_size\":256,"
                       "\"num_hidden_layers\":2,\"num_attention_heads\":2,\"num_experts\":4}";
    expect_msg(dec_config_parse(next, strlen(next), &c), KILN_ERR_CONFIG, "qwen3_next", NULL);
}

static void test_moe_checkpoints(void **state)
{
    (void)state;
    char dir[512];
    kiln_test_tmpdir(dir, sizeof dir);
    dec_checkpoint ck;
    /* Every family in both layouts: one tensor per expert and projection
     * (save_pretrained's default) and transformers 5's fused tensors. */
    const tiny_moe *fams[3] = {&Q3MOE, &Q2MOE, &MIXTRAL};
    for (int i = 0; i < 3; i++)
        for (int fused = 0; fused < 2; fused++) {
            tiny_moe m = *fams[i];
            m.fused = fused;
            write_moe(&m, dir, NULL, 0, 0, 0);
            kiln_status st = dec_checkpoint_open(dir, &ck);
            if (st)
                fail_msg("%s%s: %s", m.model_type, fused ? " fused" : "", dec_errmsg());
            assert_int_equal(ck.config.base.num_experts, 4);
            dec_checkpoint_close(&ck);
        }
    /* A missing expert names it, and the fused tensor that is not there either. */
    write_moe(&Q3MOE, dir, "model.layers.1.mlp.experts.3.up_proj.weight", 1, 0, 0);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND,
               "tensor model.layers.1.mlp.experts.3.up_proj.weight is missing",
               "nor is the fused model.layers.1.mlp.experts.gate_up_proj there");
    write_moe(&MIXTRAL, dir, "model.layers.0.block_sparse_moe.experts.2.w2.weight", 0, 0, 128);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_CONFIG,
               "tensor model.layers.0.block_sparse_moe.experts.2.w2.weight: shape [128, 128], expected [128, 64]",
               NULL);
    write_moe(&MIXTRAL, dir, "model.layers.1.block_sparse_moe.gate.weight", 1, 0, 0);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND,
               "tensor model.layers.1.block_sparse_moe.gate.weight is missing", "mixtral");
    /* Qwen2-MoE's shared expert and its gate ([1, hidden]). */
    write_moe(&Q2MOE, dir, "model.layers.0.mlp.shared_expert_gate.weight", 1, 0, 0);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND,
               "tensor model.layers.0.mlp.shared_expert_gate.weight is missing", NULL);
    write_moe(&Q2MOE, dir, "model.layers.1.mlp.shared_expert.down_proj.weight", 0, 0, 64);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_CONFIG,
               "tensor model.layers.1.mlp.shared_expert.down_proj.weight: shape [128, 64], expected [128, 192]",
               NULL);
    /* Fused tensors of another layout (gate_up_proj [experts, hidden, 2 inter]) are named with both shapes. */
    tiny_moe f = Q3MOE;
    f.fused = 1;
    write_moe(&f, dir, "model.layers.0.mlp.experts.gate_up_proj", 0, 0, 128);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_CONFIG,
               "tensor model.layers.0.mlp.experts.gate_up_proj: shape [4, 128, 128], expected [4, 256, 128]", NULL);
    write_moe(&f, dir, "model.layers.1.mlp.experts.down_proj", 1, 0, 0);
    expect_msg(dec_checkpoint_open(dir, &ck), KILN_ERR_NOT_FOUND, "tensor model.layers.1.mlp.experts.down_proj is missing",
               NULL);
    kiln_test_rmrf(dir);
}

/* The prefill benchmark's model FLOPs at Llama-3-8B's shape (32 layers),
 * against the products' parameters counted by hand: 4096 x 6144 (q/k/v),
 * 4096 x 4096 (o), 3 x 4096 x 14336 (gate/up, down) = 218103808 a layer. */
static void test_prefill_flops(void **state)
{
    (void)state;
    dec_config c;
    memset(&c, 0, sizeof c);
    kiln_model_config_default(&c.base);
    c.layers = 32;
    assert_int_equal(c.base.vocab_size, 128256);
    assert_int_equal(c.base.hidden_size, 4096);
    assert_int_equal(c.base.intermediate_size, 14336);
    assert_int_equal(c.base.num_attention_heads, 32);
    assert_int_equal(c.base.num_key_value_heads, 8);
    assert_int_equal(c.base.head_dim, 128);
    /* 1 x 4096: 2 T x params x layers, 2 x 2 x 4096 x 4096 (4096 + 1) / 2 x layers, 2 x vocab x hidden. */
    assert_true(dec_prefill_flops(&c, NULL, 1, 4096) == 57174604644352.0 + 4399120252928.0 + 1050673152.0);
    assert_true(dec_prefill_flops(&c, "attention", 1, 4096) == 4399120252928.0);
    assert_true(dec_prefill_flops(&c, "lm_head", 1, 4096) == 1050673152.0);
    /* 4 x 1024: the same products, attention over 4 sequences of 1024, 4 last tokens. */
    assert_true(dec_prefill_flops(&c, NULL, 4, 1024) == 57174604644352.0 + 1100585369600.0 + 4 * 1050673152.0);
    assert_true(dec_prefill_flops(&c, NULL, 1, 16384) == 299072508395520.0);
    /* The labels sum to the whole; a command that counts nothing is 0. */
    const char *labels[] = {"qkv_proj", "o_proj", "swiglu", "down_proj", "attention", "lm_head"};
    double sum = 0;
    for (size_t i = 0; i < sizeof labels / sizeof labels[0]; i++)
        sum += dec_prefill_flops(&c, labels[i], 4, 1024);
    assert_true(sum == dec_prefill_flops(&c, NULL, 4, 1024));
    assert_true(dec_prefill_flops(&c, "qkv_proj", 1, 1) == 2.0 * 4096 * 6144 * 32);
    assert_true(dec_prefill_flops(&c, "embedding", 1, 4096) == 0);
    assert_true(dec_prefill_flops(&c, "argmax", 1, 4096) == 0);
    /* Mixtral's shape: the same attention, each token's 2 of 8 experts as
     * wide as the dense MLP, the router; no dense MLP. */
    const double dense = dec_prefill_flops(&c, NULL, 1, 4096);
    c.base.num_experts = 8;
    c.base.num_experts_per_tok = 2;
    c.base.moe_intermediate_size = 14336;
    const double mlp = 2.0 * 4096 * 3 * 14336 * 4096 * 32;
    assert_true(dec_prefill_flops(&c, NULL, 1, 4096) == dense + mlp + 2.0 * 4096 * 4096 * 8 * 32);
    assert_true(dec_prefill_flops(&c, "experts", 1, 4096) == 2 * mlp);
    assert_true(dec_prefill_flops(&c, "swiglu", 1, 4096) == 0 && dec_prefill_flops(&c, "down_proj", 1, 4096) == 0);
    /* Qwen2-MoE's shared expert. */
    c.shared_inter = 1024;
    assert_true(dec_prefill_flops(&c, "shared_swiglu", 1, 4096) == 2.0 * 4096 * 4096 * 2 * 1024 * 32);
    assert_true(dec_prefill_flops(&c, "shared_down", 1, 4096) == 2.0 * 4096 * 1024 * 4096 * 32);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_config_refused),
        cmocka_unit_test(test_checkpoints),
        cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_fifo_refused),
        cmocka_unit_test(test_prefill_flops),
        cmocka_unit_test(test_moe_config),
        cmocka_unit_test(test_moe_checkpoints),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
