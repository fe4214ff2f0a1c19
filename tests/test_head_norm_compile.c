/* The per-head q/k RMSNorm without a GPU: the specialization a qk_norm config
 * lists (and only such a config), each code path compiled offline by NVRTC
 * for sm_90 in f16 and bf16 (and bf16 for sm_80), the spec arguments, and
 * the validation of both forms' bindings against fake buffers (a check that
 * let a bad call through to the driver would crash here). */
#include <math.h>
#include <stddef.h>

#include "providers/internal.h"
#include "offline_fixture.h"
#include "fake_runtime.h"
#include "testutil.h"

static const kiln_dtype elts[2] = {KILN_DTYPE_F16, KILN_DTYPE_BF16};

static int has_spec(const kiln_spec *specs, size_t n, const kiln_spec *want)
{
    for (size_t i = 0; i < n; i++)
        if (!memcmp(&specs[i], want, sizeof *want))
            return 1;
    return 0;
}

static size_t count_template(const kiln_spec *specs, size_t n, const char *id)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += !strcmp(specs[i].template_id, id);
    return k;
}

/* Qwen3-8B's config (tests/data) lists the kernel in its own element type;
 * the same sizes without qk_norm list none. */
static void test_qk_norm_config_lists_the_kernel(void **state)
{
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/qwen3-8b.json", KILN_TEST_DATA_DIR);
    for (int e = 0; e < 2; e++) {
        kiln_model_config c;
        KILN_CHECK(kiln_model_config_load(path, &c));
        assert_true(c.qk_norm);
        assert_int_equal(c.head_dim, 128);
        c.dtype = elts[e];
        kiln_spec *specs = NULL, want;
        size_t n = 0;
        KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
        KILN_CHECK(kiln_op_head_rms_norm_spec(elts[e], 128, 32, 8, 8, &want));
        assert_true(has_spec(specs, n, &want));
        KILN_CHECK(kiln_op_head_rms_norm_spec(elts[1 - e], 128, 32, 8, 8, &want));
        assert_false(has_spec(specs, n, &want));
        assert_int_equal(count_template(specs, n, "head_rms_norm"), 1);
        kiln_free(specs);
        c.qk_norm = 0;
        KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
        assert_int_equal(count_template(specs, n, "head_rms_norm"), 0);
        kiln_free(specs);
    }
}

typedef offline_fixture fixture;

/* Groups of 32, 16 and 8 lanes (head_dim 256, 128, 64), several items a lane
 * (1024), the scalar path (odd and tiny heads), in both element types. */
static void test_every_code_path_compiles(void **state)
{
    fixture *f = *state;
    static const struct { int64_t d, h, kv; int vec; } cases[] = {
        {64, 16, 2, 8}, {128, 32, 8, 8}, {256, 16, 4, 8}, {1024, 2, 1, 8}, {8, 1, 1, 8},
        {100, 12, 3, 1}, {1, 1, 1, 1}, {128, 32, 8, 1}, {1024, 4, 4, 1}};
    kiln_spec s;
    for (int e = 0; e < 2; e++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            KILN_CHECK(kiln_op_head_rms_norm_spec(elts[e], cases[i].d, cases[i].h, cases[i].kv, cases[i].vec, &s));
            offline_prepare(f->jit, &s);
        }
    kiln_jit_counters k;
    kiln_jit_get_counters(f->jit, &k);
    assert_int_equal(k.compiles, 18);
    assert_int_equal(k.compile_errors, 0);
    kiln_jit_options jo = {.cache = f->cache, .arch = "sm_80"};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    KILN_CHECK(kiln_op_head_rms_norm_spec(KILN_DTYPE_BF16, 128, 32, 8, 8, &s));
    offline_prepare(jit, &s);
    KILN_CHECK(kiln_op_head_rms_norm_spec(KILN_DTYPE_BF16, 100, 12, 3, 1, &s));
    offline_prepare(jit, &s);
    kiln_jit_destroy(jit);
}

static void test_spec_arguments(void **state)
{
    (void)state;
    kiln_spec s, t;
    char text[256];
    KILN_CHECK(kiln_op_head_rms_norm_spec(KILN_DTYPE_BF16, 128, 32, 8, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=1;HEADS=32;HEAD_DIM=128;KV_HEADS=8;THREADS=128;VEC=8");
    KILN_CHECK(kiln_op_head_rms_norm_spec(KILN_DTYPE_F16, 128, 32, 8, 8, &t));
    assert_true(memcmp(&s, &t, sizeof s) != 0);
    KILN_EXPECT(kiln_op_head_rms_norm_spec(KILN_DTYPE_F16, 0, 32, 8, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "head_dim 0", NULL);
    KILN_EXPECT(kiln_op_head_rms_norm_spec(KILN_DTYPE_F16, 100, 32, 8, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "vector width 8", NULL);
    KILN_EXPECT(kiln_op_head_rms_norm_spec(KILN_DTYPE_F16, 1025, 32, 8, 1, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "head_dim 1025", NULL);
    KILN_EXPECT(kiln_op_head_rms_norm_spec(KILN_DTYPE_F16, 128, 0, 8, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "heads 0", NULL);
    KILN_EXPECT(kiln_op_head_rms_norm_spec(KILN_DTYPE_F16, 128, 32, 2000, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "kv_heads 2000", NULL);
    KILN_EXPECT(kiln_op_head_rms_norm_spec(KILN_DTYPE_F32, 128, 32, 8, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "head_rms_norm: element type must be f16 or bf16", "got f32");
    KILN_EXPECT(kiln_op_head_rms_norm_spec(KILN_DTYPE_F16, 128, 32, 8, 8, NULL), KILN_ERR_INVALID_ARGUMENT,
                kiln_errmsg(), NULL, NULL);
}

static void test_offline_encode_needs_a_device(void **state)
{
    fixture *f = *state;
    kiln_head_rms_norm_bindings b = {0};
    kiln_command *cmd = (kiln_command *)1;
    KILN_EXPECT(kiln_op_head_rms_norm_encode(f->jit, &b, &cmd), KILN_ERR_NO_DEVICE, kiln_errmsg(), "offline", NULL);
    assert_null(cmd);
    KILN_EXPECT(kiln_op_head_rms_norm(f->jit, &b), KILN_ERR_NO_DEVICE, kiln_errmsg(), "head_rms_norm", NULL);
    KILN_EXPECT(kiln_op_head_rms_norm_encode(NULL, &b, &cmd), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
}

/* ---- validation against fake buffers ---- */

static kiln_tensor view(kiln_buffer *b, size_t offset, kiln_dtype dt, uint32_t rank, int64_t d0, int64_t d1,
                        int64_t d2)
{
    kiln_tensor t = {.buffer = b, .offset = offset, .dtype = dt, .rank = rank, .dims = {d0, d1, d2}};
    return t;
}

#define MB ((size_t)1 << 20)
#define AT(field) offsetof(kiln_head_rms_norm_bindings, field)

/* A binding replaced (at, the offsetof of its pointer in the bindings; NULL
 * t drops it), and the message the check must give. */
typedef struct bad_binding {
    size_t at;
    const kiln_tensor *t;
    const char *a, *b;
} bad_binding;

static void expect_refused(kiln_runtime *rt, const kiln_head_rms_norm_bindings *good, const bad_binding *bad,
                           size_t n)
{
    for (size_t i = 0; i < n; i++) {
        kiln_head_rms_norm_bindings c = *good;
        memcpy((char *)&c + bad[i].at, &bad[i].t, sizeof bad[i].t);
        kiln__head_norm_info info;
        KILN_EXPECT(kiln__head_rms_norm_check(rt, &c, &info), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                    bad[i].a, bad[i].b);
    }
}

static void test_fused_validation(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(4242), *other = fake_runtime(4242);
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_90");
    kiln_buffer *buf = fake_buffer(rt, 64 << 20, KILN_DTYPE_BYTES), *foreign = fake_buffer(other, MB, KILN_DTYPE_BYTES);
    const kiln_dtype F = KILN_DTYPE_BF16;
    /* Qwen3-8B: 32 q heads, 8 kv heads, head_dim 128: rows of 6144. */
    kiln_tensor qkv = view(buf, 0, F, 2, 7, 6144, 0), out = view(buf, 8 * MB, F, 2, 7, 6144, 0),
                qw = view(buf, 16 * MB, F, 1, 128, 0, 0), kw = view(buf, 17 * MB, F, 1, 128, 0, 0);
    kiln_head_rms_norm_bindings b = {.size = sizeof b, .qkv = &qkv, .out = &out, .q_weight = &qw, .k_weight = &kw,
                                     .heads = 32, .kv_heads = 8, .eps = 1e-6f};
    kiln__head_norm_info info;
    KILN_CHECK(kiln__head_rms_norm_check(rt, &b, &info));
    assert_int_equal(info.vec, 8);
    assert_int_equal(info.tokens, 7);
    assert_int_equal(info.head_dim, 128);
    assert_int_equal(info.q_stride, 6144);
    assert_int_equal(info.k_stride, 6144);
    assert_int_equal(info.k - info.q, 32 * 128 * 2);
    assert_int_equal(info.n_regions, 4);
    kiln_head_rms_norm_bindings c = b;
    c.out = &qkv; /* in place */
    KILN_CHECK(kiln__head_rms_norm_check(rt, &c, &info));
    c.size = 0; /* 0: this header's size */
    KILN_CHECK(kiln__head_rms_norm_check(rt, &c, &info));

    kiln_tensor kw64 = kw, qw2 = qw, kw16 = kw, out16 = out, qkv32 = qkv, out6 = out, part = out, over_w = out,
                alien = view(foreign, 0, F, 1, 128, 0, 0);
    kw64.dims[0] = 64;
    qw2.rank = 2;
    qw2.dims[1] = 1;
    kw16.dtype = out16.dtype = KILN_DTYPE_F16;
    qkv32.dtype = KILN_DTYPE_F32;
    out6.dims[0] = 6;
    part.offset = 256;
    over_w.offset = 16 * MB - 256;
    const bad_binding bad[] = {
        {AT(k_weight), &kw64, "head_rms_norm: binding k_weight has dims [64]", "must be 128"},
        {AT(q_weight), &qw2, "binding q_weight must have rank 1", "got 2"},
        {AT(k_weight), &kw16, "binding k_weight must be bf16", "got f16"},
        {AT(out), &out16, "binding out must be bf16", "got f16"},
        {AT(qkv), &qkv32, "binding qkv must be f16 or bf16", "got f32"},
        {AT(out), &out6, "binding out has dims [6, 6144]", "must be 7"},
        {AT(out), &part, "out (offset 256) partly overlaps qkv (offset 0)", NULL},
        {AT(out), &over_w, "binding out overlaps binding q_weight", NULL},
        {AT(q), &qkv, "the fused form takes qkv and out only", NULL},
        {AT(k_weight), NULL, "binding k_weight has no buffer", NULL},
        {AT(q_weight), &alien, "q_weight belongs to another runtime", NULL},
    };
    expect_refused(rt, &b, bad, sizeof bad / sizeof bad[0]);
    c = b;
    c.kv_heads = 4; /* rows of (32 + 8) * 128: not this qkv */
    KILN_EXPECT(kiln__head_rms_norm_check(rt, &c, &info), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv has dims [7, 6144]", "5120");
    c.kv_heads = 8;
    c.heads = 0;
    KILN_EXPECT(kiln__head_rms_norm_check(rt, &c, &info), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "heads 0 and kv_heads 8", NULL);
    c.heads = 32;
    c.eps = 0.0f;
    KILN_EXPECT(kiln__head_rms_norm_check(rt, &c, &info), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "eps must be a finite number > 0", "got 0");
    c.eps = NAN;
    KILN_EXPECT(kiln__head_rms_norm_check(rt, &c, &info), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "eps", "nan");
    c = b;
    c.size = 8;
    KILN_EXPECT(kiln__head_rms_norm_check(rt, &c, &info), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "bindings size 8", NULL);
    KILN_EXPECT(kiln__head_rms_norm_check(rt, NULL, &info), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "bindings is NULL", NULL);
    /* A misaligned binding, or a head_dim of no whole vectors, takes the scalar path. */
    kiln_tensor skewed = out;
    skewed.offset += 2;
    c = b;
    c.out = &skewed;
    KILN_CHECK(kiln__head_rms_norm_check(rt, &c, &info));
    assert_int_equal(info.vec, 1);
    kiln_tensor q2 = view(buf, 0, F, 2, 3, 1400, 0), w2 = view(buf, 16 * MB, F, 1, 100, 0, 0),
                k2 = view(buf, 17 * MB, F, 1, 100, 0, 0);
    c = (kiln_head_rms_norm_bindings){.qkv = &q2, .out = &q2, .q_weight = &w2, .k_weight = &k2, .heads = 10,
                                      .kv_heads = 2, .eps = 1e-6f};
    KILN_CHECK(kiln__head_rms_norm_check(rt, &c, &info));
    assert_int_equal(info.vec, 1);
    free(buf);
    free(foreign);
    fake_runtime_free(rt);
    fake_runtime_free(other);
}

static void test_separate_validation(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(4242);
    kiln_buffer *buf = fake_buffer(rt, 64 << 20, KILN_DTYPE_BYTES);
    const kiln_dtype F = KILN_DTYPE_F16;
    kiln_tensor q = view(buf, 0, F, 3, 5, 16, 64), k = view(buf, 4 * MB, F, 3, 5, 2, 64),
                qo = view(buf, 8 * MB, F, 3, 5, 16, 64), ko = view(buf, 12 * MB, F, 3, 5, 2, 64),
                qw = view(buf, 16 * MB, F, 1, 64, 0, 0), kw = view(buf, 17 * MB, F, 1, 64, 0, 0);
    kiln_head_rms_norm_bindings b = {.q = &q, .k = &k, .q_out = &qo, .k_out = &ko, .q_weight = &qw,
                                     .k_weight = &kw, .eps = 1e-6f};
    kiln__head_norm_info info;
    KILN_CHECK(kiln__head_rms_norm_check(rt, &b, &info));
    assert_int_equal(info.heads, 16);
    assert_int_equal(info.kv_heads, 2);
    assert_int_equal(info.q_stride, 16 * 64);
    assert_int_equal(info.k_stride, 2 * 64);
    assert_int_equal(info.n_regions, 6);
    assert_int_equal(info.vec, 8);
    kiln_head_rms_norm_bindings c = b;
    c.q_out = &q;
    c.k_out = &k; /* in place */
    KILN_CHECK(kiln__head_rms_norm_check(rt, &c, &info));
    c = b;
    c.heads = 16;
    c.kv_heads = 2;
    KILN_CHECK(kiln__head_rms_norm_check(rt, &c, &info));
    c.heads = 8;
    KILN_EXPECT(kiln__head_rms_norm_check(rt, &c, &info), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "heads 8, but binding q has 16 heads", NULL);
    c.heads = 16;
    c.kv_heads = 4;
    KILN_EXPECT(kiln__head_rms_norm_check(rt, &c, &info), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding k has dims [5, 2, 64]", "must be 4");

    kiln_tensor k128 = k, kw128 = kw, ko16 = ko, qo_bf = qo, ko_over_q = ko, qo_over_ko = qo;
    k128.dims[2] = 128;
    kw128.dims[0] = 128;
    ko16.dims[1] = 16;
    qo_bf.dtype = KILN_DTYPE_BF16;
    ko_over_q.offset = 0;
    qo_over_ko.offset = 12 * MB;
    const bad_binding bad[] = {
        {AT(k), &k128, "binding k has dims [5, 2, 128]", "must be 64"},
        {AT(k_weight), &kw128, "binding k_weight has dims [128]", "must be 64"},
        {AT(k_out), &ko16, "binding k_out has dims [5, 16, 64]", "dim 1 must be 2"},
        {AT(q_out), &qo_bf, "binding q_out must be f16", "got bf16"},
        {AT(q_out), &k, "binding q_out has dims [5, 2, 64]", NULL},
        {AT(k_out), &ko_over_q, "binding k_out overlaps binding q", NULL},
        {AT(q_out), &qo_over_ko, "binding q_out overlaps binding k_out", NULL},
        {AT(out), &qo, "out given without qkv", NULL},
        {AT(k), NULL, "binding k has no buffer", NULL},
    };
    expect_refused(rt, &b, bad, sizeof bad / sizeof bad[0]);
    free(buf);
    fake_runtime_free(rt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qk_norm_config_lists_the_kernel),
        cmocka_unit_test_setup_teardown(test_every_code_path_compiles, offline_fixture_setup, offline_fixture_teardown),
        cmocka_unit_test(test_spec_arguments),
        cmocka_unit_test_setup_teardown(test_offline_encode_needs_a_device, offline_fixture_setup,
                                        offline_fixture_teardown),
        cmocka_unit_test(test_fused_validation),
        cmocka_unit_test(test_separate_validation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
