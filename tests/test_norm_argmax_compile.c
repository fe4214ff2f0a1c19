/* RMSNorm, residual add, token embedding and the masked argmax without a
 * GPU: the specializations a model config lists (f16 and bf16), each compiled
 * offline by NVRTC for sm_90 (every code path of the four templates, in both
 * element types) and the bf16 ones for sm_80, the spec and workspace
 * arguments, and the validation of bindings against fake buffers (a fake
 * runtime has no driver table: a check that let a bad call through to the
 * driver would crash here). */
#include <math.h>
#include <stdatomic.h>

#include "providers/internal.h"
#include "offline_fixture.h"
#include "fake_runtime.h"
#include "testutil.h"

/* providers/masked_argmax.c: the spec for a cluster of 16 (the default) or 8 blocks. */
kiln_status kiln__masked_argmax_spec_cluster(kiln_dtype elt, int64_t vocab, int vec, int cluster, kiln_spec *out);

/* ---- configs ---- */

static void llama(kiln_model_config *c) { kiln_model_config_default(c); }

static void qwen(kiln_model_config *c)
{
    kiln_model_config_default(c);
    c->vocab_size = 151936;
    c->hidden_size = 896;
    c->intermediate_size = 4864;
    c->num_attention_heads = 14;
    c->num_key_value_heads = 2;
    c->head_dim = 64;
}

static void odd(kiln_model_config *c)
{
    kiln_model_config_default(c);
    c->vocab_size = 50001;
    c->hidden_size = 1000;
}

static void (*const configs[])(kiln_model_config *) = {llama, qwen, odd};

static int has_spec(const kiln_spec *specs, size_t n, const kiln_spec *want)
{
    for (size_t i = 0; i < n; i++)
        if (!memcmp(&specs[i], want, sizeof *want))
            return 1;
    return 0;
}

static const kiln_dtype elts[2] = {KILN_DTYPE_F16, KILN_DTYPE_BF16};

/* A model lists its own element type's kernels, and not the other's. */
static void test_model_lists_every_norm_argmax_spec(void **state)
{
    (void)state;
    for (size_t m = 0; m < 3; m++)
        for (int e = 0; e < 2; e++) {
            kiln_model_config c;
            configs[m](&c);
            c.dtype = elts[e];
            const kiln_dtype other = elts[1 - e];
            kiln_spec *specs = NULL, want;
            size_t n = 0;
            KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
            int hv = c.hidden_size % 8 ? 1 : 8, vv = c.vocab_size % 8 ? 1 : 8;
            KILN_CHECK(kiln_op_rms_norm_spec(c.dtype, c.hidden_size, hv, &want));
            assert_true(has_spec(specs, n, &want));
            KILN_CHECK(kiln_op_rms_norm_spec(other, c.hidden_size, hv, &want));
            assert_false(has_spec(specs, n, &want));
            KILN_CHECK(kiln_op_residual_add_spec(c.dtype, c.hidden_size, hv, &want));
            assert_true(has_spec(specs, n, &want));
            KILN_CHECK(kiln_op_residual_add_spec(other, c.hidden_size, hv, &want));
            assert_false(has_spec(specs, n, &want));
            KILN_CHECK(kiln_op_masked_argmax_spec(c.dtype, c.vocab_size, vv, &want));
            assert_true(has_spec(specs, n, &want));
            KILN_CHECK(kiln_op_masked_argmax_spec(other, c.vocab_size, vv, &want));
            assert_false(has_spec(specs, n, &want));
            KILN_CHECK(kiln_op_token_embedding_spec(c.dtype, c.vocab_size, c.hidden_size, hv, &want));
            assert_true(has_spec(specs, n, &want));
            KILN_CHECK(kiln_op_token_embedding_spec(other, c.vocab_size, c.hidden_size, hv, &want));
            assert_false(has_spec(specs, n, &want));
            kiln_free(specs);
        }
}

/* ---- offline compiles ---- */

typedef offline_fixture fixture;

static int ours(const char *t)
{
    return !strcmp(t, "rms_norm") || !strcmp(t, "residual_add") || !strcmp(t, "masked_argmax") ||
           !strcmp(t, "token_embedding");
}

/* Each model's kernels in f16 and in bf16: four modules a model and type, none shared. */
static void test_every_model_spec_compiles_for_sm90(void **state)
{
    fixture *f = *state;
    size_t total = 0;
    for (size_t m = 0; m < 3; m++)
        for (int e = 0; e < 2; e++) {
            kiln_model_config c;
            configs[m](&c);
            c.dtype = elts[e];
            kiln_spec *specs = NULL;
            size_t n = 0;
            KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
            for (size_t i = 0; i < n; i++)
                if (ours(specs[i].template_id)) {
                    offline_prepare(f->jit, &specs[i]);
                    total++;
                }
            kiln_free(specs);
        }
    assert_int_equal(total, 24);
    kiln_jit_counters k;
    kiln_jit_get_counters(f->jit, &k);
    assert_int_equal(k.compiles, 24);
    assert_int_equal(k.compile_errors, 0);
}

/* The paths the model configs do not reach: scalar rows, rows too long for
 * registers, the longest rows, vocabularies in several slices, the tiniest. */
static void test_every_code_path_compiles(void **state)
{
    fixture *f = *state;
    static const struct { int64_t n; int vec; } rows[] = {{1001, 1}, {1000, 8}, {8, 8}, {1, 1},
                                                         {65536, 8}, {65535, 1}, {4096, 1}};
    static const struct { int64_t n; int vec; } vocabs[] = {
        {7, 1}, {8, 8}, {50001, 1}, {151936, 1}, {2000000, 8}, {1999999, 1}, {16777216, 8}};
    kiln_spec s;
    for (int e = 0; e < 2; e++) {
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
            KILN_CHECK(kiln_op_rms_norm_spec(elts[e], rows[i].n, rows[i].vec, &s));
            offline_prepare(f->jit, &s);
            KILN_CHECK(kiln_op_residual_add_spec(elts[e], rows[i].n, rows[i].vec, &s));
            offline_prepare(f->jit, &s);
        }
        for (size_t i = 0; i < sizeof vocabs / sizeof vocabs[0]; i++) {
            KILN_CHECK(kiln_op_masked_argmax_spec(elts[e], vocabs[i].n, vocabs[i].vec, &s));
            offline_prepare(f->jit, &s);
            KILN_CHECK(kiln__masked_argmax_spec_cluster(elts[e], vocabs[i].n, vocabs[i].vec, 8, &s));
            offline_prepare(f->jit, &s);
        }
        KILN_CHECK(kiln_op_token_embedding_spec(elts[e], 50001, 1001, 1, &s)); /* the scalar path */
        offline_prepare(f->jit, &s);
    }
}

/* bf16 on sm_80 (cvt.rn.bf16.f32 and max.bf16x2 are sm_80's; add.bf16x2,
 * which the kernels do not use, would need sm_90): every path of the three
 * templates that do not need sm_90's clusters, and the argmax's one-block
 * kernel that sm_80 takes instead of a cluster (what prewarm lists for it,
 * f16 and bf16, both vector widths). Before sm_80, bf16 is refused at compile
 * time (kiln_prelude.cuh), and providers refuse it first. */
static void test_bf16_compiles_for_sm80(void **state)
{
    fixture *f = *state;
    kiln_jit_options jo = {.cache = f->cache, .arch = "sm_80"};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    static const struct { int64_t n; int vec; } rows[] = {{4096, 8}, {1001, 1}, {65536, 8}, {65535, 1}};
    kiln_spec s;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        KILN_CHECK(kiln_op_rms_norm_spec(KILN_DTYPE_BF16, rows[i].n, rows[i].vec, &s));
        offline_prepare(jit, &s);
        KILN_CHECK(kiln_op_residual_add_spec(KILN_DTYPE_BF16, rows[i].n, rows[i].vec, &s));
        offline_prepare(jit, &s);
        KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_BF16, 128256, rows[i].n, rows[i].vec, &s));
        offline_prepare(jit, &s);
    }
    static const struct { int64_t vocab; int vec; } vocabs[] = {{151936, 8}, {50001, 1}, {7, 1}};
    for (int e = 0; e < 2; e++)
        for (size_t i = 0; i < sizeof vocabs / sizeof vocabs[0]; i++) {
            KILN_CHECK(kiln__masked_argmax_spec_cluster(e ? KILN_DTYPE_BF16 : KILN_DTYPE_F16, vocabs[i].vocab,
                                                        vocabs[i].vec, 1, &s));
            offline_prepare(jit, &s);
        }
    kiln_model_config c;
    kiln_model_config_default(&c);
    kiln_spec *specs = NULL;
    size_t n = 0;
    KILN_CHECK(kiln_model_specializations_for_arch(&c, "sm_80", &specs, &n));
    KILN_CHECK(kiln__masked_argmax_spec_cluster(c.dtype, c.vocab_size, 8, 1, &s));
    assert_true(has_spec(specs, n, &s));
    KILN_CHECK(kiln_op_masked_argmax_spec(c.dtype, c.vocab_size, 8, &s)); /* sm_90's cluster of 16 */
    assert_false(has_spec(specs, n, &s));
    kiln_free(specs);
    kiln_jit_destroy(jit);
    jo.arch = "sm_75";
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    KILN_CHECK(kiln_op_rms_norm_spec(KILN_DTYPE_BF16, 4096, 8, &s));
    int compiled = 0;
    KILN_EXPECT(kiln_jit_prepare(jit, &s, &compiled), KILN_ERR_NVRTC_COMPILE, kiln_errmsg(), "bf16 needs sm_80",
                NULL);
    kiln_jit_destroy(jit);
}

static void test_spec_arguments(void **state)
{
    (void)state;
    kiln_spec s;
    KILN_EXPECT(kiln_op_rms_norm_spec(KILN_DTYPE_F16, 0, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "hidden 0", NULL);
    KILN_EXPECT(kiln_op_rms_norm_spec(KILN_DTYPE_F16, 1001, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "vector width 8", NULL);
    KILN_EXPECT(kiln_op_rms_norm_spec(KILN_DTYPE_F16, 65537, 1, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "65537", NULL);
    KILN_EXPECT(kiln_op_rms_norm_spec(KILN_DTYPE_F16, 4096, 4, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "width 4", NULL);
    KILN_EXPECT(kiln_op_rms_norm_spec(KILN_DTYPE_F16, 4096, 8, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
    KILN_EXPECT(kiln_op_residual_add_spec(KILN_DTYPE_F16, -1, 1, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "hidden -1", NULL);
    KILN_EXPECT(kiln_op_masked_argmax_spec(KILN_DTYPE_F16, 50001, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "vocab 50001",
                NULL);
    KILN_EXPECT(kiln_op_masked_argmax_spec(KILN_DTYPE_F16, 16777217, 1, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "16777217",
                NULL);
    /* The constants a kernel is specialized on. */
    KILN_CHECK(kiln_op_rms_norm_spec(KILN_DTYPE_F16, 4096, 8, &s));
    char text[256];
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=0;HIDDEN=4096;THREADS=128;VEC=8");
    KILN_CHECK(kiln_op_masked_argmax_spec(KILN_DTYPE_F16, 151936, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=0;CLUSTER=16;THREADS=608;UNROLL=2;VEC=8;VOCAB=151936");
    /* The portable cluster, where 16 blocks cannot be scheduled together. */
    KILN_CHECK(kiln__masked_argmax_spec_cluster(KILN_DTYPE_F16, 151936, 8, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=0;CLUSTER=8;THREADS=608;UNROLL=4;VEC=8;VOCAB=151936");
    KILN_CHECK(kiln__masked_argmax_spec_cluster(KILN_DTYPE_F16, 151936, 8, 1, &s)); /* before sm_90 */
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=0;CLUSTER=1;THREADS=1024;UNROLL=8;VEC=8;VOCAB=151936");
    KILN_EXPECT(kiln__masked_argmax_spec_cluster(KILN_DTYPE_F16, 151936, 8, 4, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "cluster 4", NULL);
    /* bf16: the same sizes, another kernel (BF16=1 in its constants). */
    KILN_CHECK(kiln_op_rms_norm_spec(KILN_DTYPE_BF16, 4096, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=1;HIDDEN=4096;THREADS=128;VEC=8");
    KILN_CHECK(kiln_op_residual_add_spec(KILN_DTYPE_BF16, 4096, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=1;HIDDEN=4096;THREADS=512;VEC=8");
    KILN_CHECK(kiln_op_masked_argmax_spec(KILN_DTYPE_BF16, 151936, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=1;CLUSTER=16;THREADS=608;UNROLL=2;VEC=8;VOCAB=151936");
    KILN_CHECK(kiln__masked_argmax_spec_cluster(KILN_DTYPE_BF16, 151936, 8, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=1;CLUSTER=8;THREADS=608;UNROLL=4;VEC=8;VOCAB=151936");
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_BF16, 128256, 4096, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=1;HIDDEN=4096;THREADS=128;VEC=8;VOCAB=128256");
    /* The f16 and bf16 specs of one size are different kernels. */
    kiln_spec h, b;
    KILN_CHECK(kiln_op_rms_norm_spec(KILN_DTYPE_F16, 896, 8, &h));
    KILN_CHECK(kiln_op_rms_norm_spec(KILN_DTYPE_BF16, 896, 8, &b));
    assert_true(memcmp(&h, &b, sizeof h) != 0);
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 151936, 896, 8, &h));
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_BF16, 151936, 896, 8, &b));
    assert_true(memcmp(&h, &b, sizeof h) != 0);
    /* No other element type. */
    KILN_EXPECT(kiln_op_rms_norm_spec(KILN_DTYPE_F32, 4096, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rms_norm: element type must be f16 or bf16", "got f32");
    KILN_EXPECT(kiln_op_residual_add_spec(KILN_DTYPE_U8, 4096, 8, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual_add: element type must be f16 or bf16", NULL);
    KILN_EXPECT(kiln_op_masked_argmax_spec(KILN_DTYPE_F32, 151936, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "masked_argmax: element type", "got f32");
    KILN_EXPECT(kiln_op_token_embedding_spec(KILN_DTYPE_I32, 1000, 64, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "token_embedding: element type", NULL);
}

static void test_workspace_estimates(void **state)
{
    (void)state;
    size_t b = 1;
    KILN_CHECK(kiln_op_masked_argmax_workspace(151936, 1, &b));
    assert_int_equal(b, 303872);
    KILN_CHECK(kiln_op_masked_argmax_workspace(50001, 3, &b));
    assert_int_equal(b, 3 * 100016); /* align16(100002) */
    KILN_CHECK(kiln_op_masked_argmax_workspace(128256, 64, &b));
    assert_int_equal(b, 64 * 256512);
    KILN_EXPECT(kiln_op_masked_argmax_workspace(0, 1, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "vocab 0", NULL);
    KILN_EXPECT(kiln_op_masked_argmax_workspace(10, 0, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "participants 0", NULL);
    KILN_EXPECT(kiln_op_masked_argmax_workspace(10, 1, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
    b = 1;
    KILN_CHECK(kiln_op_rms_norm_workspace(2048, 4096, &b));
    assert_int_equal(b, 0);
    b = 1;
    KILN_CHECK(kiln_op_residual_add_workspace(2048, 4096, &b));
    assert_int_equal(b, 0);
}

static void test_offline_encode_needs_a_device(void **state)
{
    fixture *f = *state;
    kiln_tensor t = {0};
    kiln_command *cmd = (kiln_command *)1;
    KILN_EXPECT(kiln_op_rms_norm_encode(f->jit, &t, &t, 1e-5f, &t, &cmd), KILN_ERR_NO_DEVICE, kiln_errmsg(),
                "offline", NULL);
    assert_null(cmd);
    KILN_EXPECT(kiln_op_rms_norm_residual(f->jit, &t, &t, &t, 1e-5f, &t), KILN_ERR_NO_DEVICE, kiln_errmsg(),
                "rms_norm_residual", NULL);
    KILN_EXPECT(kiln_op_residual_add(f->jit, &t, &t, &t), KILN_ERR_NO_DEVICE, kiln_errmsg(), "residual_add", NULL);
    kiln_masked_argmax_bindings b = {0};
    KILN_EXPECT(kiln_op_masked_argmax(f->jit, &b), KILN_ERR_NO_DEVICE, kiln_errmsg(), "masked_argmax", NULL);
    KILN_EXPECT(kiln_op_masked_argmax_encode(NULL, &b, &cmd), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
}

/* ---- validation against fake buffers ---- */


static kiln_tensor view(kiln_buffer *b, size_t offset, kiln_dtype dt, int64_t d0, int64_t d1)
{
    kiln_tensor t = {.buffer = b, .offset = offset, .dtype = dt, .rank = d1 ? 2 : 1, .dims = {d0, d1}};
    return t;
}

static void test_norm_validation_names_binding_and_values(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(4242), *other = fake_runtime(4242);
    kiln_buffer *buf = fake_buffer(rt, 64 << 20, KILN_DTYPE_BYTES), *small = fake_buffer(rt, 4096, KILN_DTYPE_BYTES),
                *foreign = fake_buffer(other, 1 << 20, KILN_DTYPE_BYTES);
    const size_t MB = 1 << 20;
    kiln_tensor x = view(buf, 0, KILN_DTYPE_F16, 16, 4096), w = view(buf, 8 * MB, KILN_DTYPE_F16, 4096, 0),
                r = view(buf, 16 * MB, KILN_DTYPE_F16, 16, 4096), o = view(buf, 24 * MB, KILN_DTYPE_F16, 16, 4096);
    int vec = 0;
    KILN_CHECK(kiln__rms_norm_check(rt, &x, NULL, &w, 1e-5f, &o, &vec));
    assert_int_equal(vec, 8);
    KILN_CHECK(kiln__rms_norm_check(rt, &x, &r, &w, 1e-6f, &o, &vec));
    KILN_CHECK(kiln__rms_norm_check(rt, &x, &r, &w, 1e-6f, &x, &vec)); /* out = x: in place */
    KILN_CHECK(kiln__rms_norm_check(rt, &x, NULL, &w, 1e-6f, &x, &vec));

    kiln_tensor t = x;
    t.dtype = KILN_DTYPE_F32;
    KILN_EXPECT(kiln__rms_norm_check(rt, &t, NULL, &w, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT,
                kiln_runtime_errmsg(rt), "rms_norm: binding x must be f16", "got f32");
    t = w;
    t.dims[0] = 4095;
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &t, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding weight has dims [4095]", "must be 4096");
    t = o;
    t.dims[0] = 17;
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &w, 1e-5f, &t, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out has dims [17, 4096]", "must be 16");
    t = r;
    t.rank = 1;
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, &t, &w, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rms_norm_residual: binding residual must have rank 2", "got 1");
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &w, 0.0f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "eps must be a finite number > 0", "got 0");
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &w, NAN, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "eps", "nan");
    t = o;
    t.offset = 64; /* partly over x */
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &w, 1e-5f, &t, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "out (offset 64) partly overlaps x (offset 0)", NULL);
    t = o;
    t.offset = 8 * MB - 2;
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &w, 1e-5f, &t, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "out overlaps weight", NULL);
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, &o, &w, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual (updated in place) overlaps out", NULL);
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, &x, &w, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual (updated in place) overlaps x", NULL);
    t = view(small, 0, KILN_DTYPE_F16, 16, 4096);
    KILN_EXPECT(kiln__rms_norm_check(rt, &t, NULL, &w, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "needs 131072 bytes", "has 4096");
    t = view(foreign, 0, KILN_DTYPE_F16, 4096, 0);
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &t, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "weight belongs to another runtime", NULL);
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, NULL, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding weight has no buffer", NULL);
    /* Misaligned or odd rows take the scalar path. */
    t = o;
    t.offset += 2;
    KILN_CHECK(kiln__rms_norm_check(rt, &x, NULL, &w, 1e-5f, &t, &vec));
    assert_int_equal(vec, 1);
    kiln_tensor x2 = view(buf, 0, KILN_DTYPE_F16, 3, 1001), w2 = view(buf, 8 * MB, KILN_DTYPE_F16, 1001, 0),
                o2 = view(buf, 24 * MB, KILN_DTYPE_F16, 3, 1001);
    KILN_CHECK(kiln__rms_norm_check(rt, &x2, NULL, &w2, 1e-5f, &o2, &vec));
    assert_int_equal(vec, 1);

    /* Residual add. */
    KILN_CHECK(kiln__residual_add_check(rt, &x, &r, &o, &vec));
    assert_int_equal(vec, 8);
    KILN_CHECK(kiln__residual_add_check(rt, &x, &r, &r, &vec)); /* in place, either side */
    KILN_CHECK(kiln__residual_add_check(rt, &x, &r, &x, &vec));
    KILN_CHECK(kiln__residual_add_check(rt, &x, &x, &o, &vec)); /* a + a */
    t = r;
    t.dims[1] = 4095;
    KILN_EXPECT(kiln__residual_add_check(rt, &x, &t, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual_add: binding b has dims [16, 4095]", "must be 4096");
    t = o;
    t.dtype = KILN_DTYPE_BF16;
    KILN_EXPECT(kiln__residual_add_check(rt, &x, &r, &t, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out must be f16", "got bf16");
    t = r;
    t.offset += 4096;
    KILN_EXPECT(kiln__residual_add_check(rt, &x, &r, &t, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "partly overlaps b", NULL);
    t = x;
    t.offset = 3;
    KILN_EXPECT(kiln__residual_add_check(rt, &t, &r, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding a offset 3 is not a multiple of 2", NULL);

    free(buf);
    free(small);
    free(foreign);
    fake_runtime_free(rt);
    fake_runtime_free(other);
}

/* bf16: x (a) names the element type, every other 16-bit binding must match
 * it, and a device before sm_80 refuses it. */
static void test_norm_validation_bf16(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(4242), *old = fake_runtime(4243);
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_90");
    snprintf(old->info.arch, sizeof old->info.arch, "sm_75");
    kiln_buffer *buf = fake_buffer(rt, 64 << 20, KILN_DTYPE_BYTES),
                *obuf = fake_buffer(old, 64 << 20, KILN_DTYPE_BYTES);
    const size_t MB = 1 << 20;
    kiln_tensor x = view(buf, 0, KILN_DTYPE_BF16, 16, 4096), w = view(buf, 8 * MB, KILN_DTYPE_BF16, 4096, 0),
                r = view(buf, 16 * MB, KILN_DTYPE_BF16, 16, 4096), o = view(buf, 24 * MB, KILN_DTYPE_BF16, 16, 4096);
    int vec = 0;
    KILN_CHECK(kiln__rms_norm_check(rt, &x, NULL, &w, 1e-5f, &o, &vec));
    assert_int_equal(vec, 8);
    KILN_CHECK(kiln__rms_norm_check(rt, &x, &r, &w, 1e-6f, &o, &vec));
    KILN_CHECK(kiln__residual_add_check(rt, &x, &r, &o, &vec));
    assert_int_equal(vec, 8);
    /* Mixed f16 and bf16: refused naming the binding and both types. */
    kiln_tensor t = w;
    t.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &t, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT,
                kiln_runtime_errmsg(rt), "rms_norm: binding weight must be bf16", "got f16");
    t = r;
    t.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, &t, &w, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rms_norm_residual: binding residual must be bf16", "got f16");
    t = o;
    t.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__rms_norm_check(rt, &x, NULL, &w, 1e-5f, &t, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rms_norm: binding out must be bf16", "got f16");
    /* An f16 x with a bf16 weight: the other way round. */
    t = x;
    t.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__rms_norm_check(rt, &t, NULL, &w, 1e-5f, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rms_norm: binding weight must be f16", "got bf16");
    t = r;
    t.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__residual_add_check(rt, &x, &t, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual_add: binding b must be bf16", "got f16");
    t = o;
    t.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__residual_add_check(rt, &x, &r, &t, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual_add: binding out must be bf16", "got f16");
    t = x;
    t.dtype = KILN_DTYPE_F32;
    KILN_EXPECT(kiln__residual_add_check(rt, &t, &r, &o, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "residual_add: binding a must be f16 or bf16", "got f32");
    /* Before sm_80. */
    kiln_tensor ox = view(obuf, 0, KILN_DTYPE_BF16, 16, 4096), ow = view(obuf, 8 * MB, KILN_DTYPE_BF16, 4096, 0),
                oo = view(obuf, 24 * MB, KILN_DTYPE_BF16, 16, 4096);
    KILN_EXPECT(kiln__rms_norm_check(old, &ox, NULL, &ow, 1e-5f, &oo, &vec), KILN_ERR_RUNTIME_CONTRACT,
                kiln_runtime_errmsg(old), "rms_norm: binding x is bf16", "sm_75");
    KILN_EXPECT(kiln__residual_add_check(old, &ox, &oo, &oo, &vec), KILN_ERR_RUNTIME_CONTRACT,
                kiln_runtime_errmsg(old), "residual_add: binding a is bf16", "sm_75");
    ox.dtype = ow.dtype = oo.dtype = KILN_DTYPE_F16;
    KILN_CHECK(kiln__rms_norm_check(old, &ox, NULL, &ow, 1e-5f, &oo, &vec));
    free(buf);
    free(obuf);
    fake_runtime_free(rt);
    fake_runtime_free(old);
}

static void test_argmax_validation_names_binding_and_values(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(4242);
    kiln_buffer *buf = fake_buffer(rt, 64 << 20, KILN_DTYPE_BYTES);
    const size_t MB = 1 << 20;
    const int64_t P = 3, V = 151936;
    kiln_tensor logits = view(buf, 0, KILN_DTYPE_F16, P, V), valid = view(buf, 4 * MB, KILN_DTYPE_U8, V, 0),
                ids = view(buf, 5 * MB, KILN_DTYPE_U32, 1000, 0), offs = view(buf, 6 * MB, KILN_DTYPE_U32, P + 1, 0),
                pen = view(buf, 7 * MB, KILN_DTYPE_F32, 1, 0), ws = view(buf, 8 * MB, KILN_DTYPE_U8, P * 303872, 0),
                out = view(buf, 12 * MB, KILN_DTYPE_U32, P, 0);
    kiln_masked_argmax_bindings b = {sizeof b, &logits, &valid, &ids, &offs, &pen, &ws, &out};
    size_t bytes[7];
    int vec = 0;
    KILN_CHECK(kiln__masked_argmax_check(rt, &b, bytes, &vec));
    assert_int_equal(vec, 8);
    assert_int_equal(bytes[0], (size_t)P * V * 2);
    assert_int_equal(bytes[5], (size_t)P * 303872);

    kiln_masked_argmax_bindings c = b;
    kiln_tensor t = offs;
    t.dims[0] = P;
    c.rep_offsets = &t;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "masked_argmax: binding rep_offsets has dims [3]", "must be 4");
    c = b;
    t = ws;
    t.dims[0] = P * 303872 - 1;
    c.workspace = &t;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding workspace has 911615 bytes; it needs at least 911616", "3 participants");
    c = b;
    t = valid;
    t.dims[0] = V - 1;
    c.valid = &t;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding valid has dims [151935]", "must be 151936");
    c = b;
    t = pen;
    t.dtype = KILN_DTYPE_F16;
    c.penalty = &t;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding penalty must be f32", "got f16");
    c = b;
    t = out;
    t.dims[0] = 1;
    c.out = &t;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out has dims [1]", "must be 3");
    c = b;
    t = out;
    t.offset = 4 * MB; /* over valid */
    c.out = &t;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "out overlaps valid", NULL);
    c = b;
    t = ws;
    t.offset = 6 * MB; /* over the offsets */
    c.workspace = &t;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "workspace overlaps rep_offsets", NULL);
    c = b;
    c.rep_ids = NULL;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding rep_ids has no buffer", NULL);
    c = b;
    c.size = 8;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "bindings size 8", NULL);
    /* The size field: one too small to be a size names the struct; a newer
     * caller's larger struct is read as far as this library knows it. */
    c.size = 2;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_masked_argmax_bindings.size is 2", NULL);
    struct {
        kiln_masked_argmax_bindings b;
        uint64_t later;
    } newer = {b, UINT64_MAX};
    newer.b.size = sizeof newer;
    KILN_CHECK(kiln__masked_argmax_check(rt, &newer.b, bytes, &vec));
    assert_int_equal(newer.later, UINT64_MAX);
    /* Vector width: vocab % 8 and alignment. */
    c = b;
    t = valid;
    t.offset += 4;
    c.valid = &t;
    KILN_CHECK(kiln__masked_argmax_check(rt, &c, bytes, &vec));
    assert_int_equal(vec, 1);
    kiln_tensor l2 = view(buf, 0, KILN_DTYPE_F16, 1, 50001), v2 = view(buf, 4 * MB, KILN_DTYPE_U8, 50001, 0),
                o2 = view(buf, 6 * MB, KILN_DTYPE_U32, 2, 0), out2 = view(buf, 12 * MB, KILN_DTYPE_U32, 1, 0);
    c = (kiln_masked_argmax_bindings){0, &l2, &v2, &ids, &o2, &pen, &ws, &out2};
    KILN_CHECK(kiln__masked_argmax_check(rt, &c, bytes, &vec));
    assert_int_equal(vec, 1);
    /* bf16 logits on a device of sm_80 or later; no other element type. */
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_90");
    t = logits;
    t.dtype = KILN_DTYPE_BF16;
    c = b;
    c.logits = &t;
    KILN_CHECK(kiln__masked_argmax_check(rt, &c, bytes, &vec));
    assert_int_equal(vec, 8);
    assert_int_equal(bytes[0], (size_t)P * V * 2);
    t.dtype = KILN_DTYPE_F32;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "masked_argmax: binding logits must be f16 or bf16", "got f32");
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_75");
    t.dtype = KILN_DTYPE_BF16;
    KILN_EXPECT(kiln__masked_argmax_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "masked_argmax: binding logits is bf16", "sm_75");
    free(buf);
    fake_runtime_free(rt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_lists_every_norm_argmax_spec),
        cmocka_unit_test_setup_teardown(test_every_model_spec_compiles_for_sm90, offline_fixture_setup, offline_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_every_code_path_compiles, offline_fixture_setup, offline_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_bf16_compiles_for_sm80, offline_fixture_setup, offline_fixture_teardown),
        cmocka_unit_test(test_spec_arguments),
        cmocka_unit_test(test_workspace_estimates),
        cmocka_unit_test_setup_teardown(test_offline_encode_needs_a_device, offline_fixture_setup, offline_fixture_teardown),
        cmocka_unit_test(test_norm_validation_names_binding_and_values),
        cmocka_unit_test(test_norm_validation_bf16),
        cmocka_unit_test(test_argmax_validation_names_binding_and_values),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
