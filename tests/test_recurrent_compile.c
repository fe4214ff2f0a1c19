/* Gated delta recurrent attention without a GPU: the specializations a
 * Qwen3-Next config lists (and none for a model without linear attention),
 * per architecture for the chunked kernel and in the config's element type,
 * every code path of both templates compiled offline by NVRTC in f16 and
 * bf16 (the chunked one, its four entries, for sm_80 and sm_90, the scan
 * for sm_90 and, in bf16, sm_80), the spec
 * and size arguments, and the validation of bindings against fake buffers (a
 * fake runtime has no driver table: a check that let a bad call through to
 * the driver would crash here). */
#include <stdatomic.h>

#include "jit/internal.h"
#include "providers/internal.h"
#include "offline_fixture.h"
#include "fake_runtime.h"
#include "testutil.h"

static void qwen3_next(kiln_model_config *c)
{
    kiln_model_config_default(c);
    c->vocab_size = 151936;
    c->hidden_size = 2048;
    c->linear_num_key_heads = 16;
    c->linear_num_value_heads = 32;
    c->linear_key_head_dim = 128;
    c->linear_value_head_dim = 128;
}

static size_t count_template(const kiln_spec *specs, size_t n, const char *id, kiln_spec *found)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(specs[i].template_id, id)) {
            if (found)
                *found = specs[i];
            k++;
        }
    return k;
}

static void test_model_lists_the_spec_only_with_linear_attention(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_spec *specs = NULL, got, want;
    size_t n = 0;
    kiln_model_config_default(&c);
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    assert_int_equal(count_template(specs, n, "gated_delta", NULL), 0);
    assert_int_equal(count_template(specs, n, "gated_delta_chunk", NULL), 0);
    kiln_free(specs);
    qwen3_next(&c);
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    assert_int_equal(count_template(specs, n, "gated_delta", &got), 1);
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 4, &want));
    assert_memory_equal(&got, &want, sizeof want);
    kiln_free(specs);
    /* An odd key dim takes the scalar path. */
    c.linear_key_head_dim = 63;
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    assert_int_equal(count_template(specs, n, "gated_delta", &got), 1);
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 63, 128, 16, 32, 1, &want));
    assert_memory_equal(&got, &want, sizeof want);
    kiln_free(specs);
    /* A bf16 model lists the bf16 kernels, scan and chunked alike. */
    qwen3_next(&c);
    c.dtype = KILN_DTYPE_BF16;
    KILN_CHECK(kiln_model_specializations_for_arch(&c, "sm_90", &specs, &n));
    assert_int_equal(count_template(specs, n, "gated_delta", &got), 1);
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_BF16, 128, 128, 16, 32, 4, &want));
    assert_memory_equal(&got, &want, sizeof want);
    assert_int_equal(count_template(specs, n, "gated_delta_chunk", &got), 2);
    KILN_CHECK(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_BF16, 128, 128, 16, 32, 32, 8, &want));
    assert_memory_equal(&got, &want, sizeof want);
    kiln_free(specs);
}

/* The chunked kernel per architecture: both row counts where a block may have
 * their shared memory (sm_90, sm_100; an unknown arch), 32 rows on sm_80,
 * none where it has 99 KiB (sm_86, sm_89, sm_120), before sm_80, or past 128
 * key dims. */
static void test_arch_lists_the_chunked_kernel(void **state)
{
    (void)state;
    unsetenv("KILN_GATED_DELTA_TERMS"); /* the default: one term */
    kiln_model_config c;
    qwen3_next(&c);
    static const struct { const char *arch; size_t chunks; int rows; } cases[] = {
        {"sm_90", 2, 32}, {"sm_90a", 2, 32}, {"sm_100", 2, 32}, {NULL, 2, 32}, {"sm_80", 1, 32},
        {"sm_86", 0, 0},  {"sm_89", 0, 0},   {"sm_120", 0, 0},  {"sm_75", 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_spec *specs = NULL, got, want;
        size_t n = 0;
        KILN_CHECK(kiln_model_specializations_for_arch(&c, cases[i].arch, &specs, &n));
        assert_int_equal(count_template(specs, n, "gated_delta", NULL), 1);
        if (count_template(specs, n, "gated_delta_chunk", &got) != cases[i].chunks)
            fail_msg("%s: %zu chunked kernels, want %zu", cases[i].arch ? cases[i].arch : "(no arch)",
                     count_template(specs, n, "gated_delta_chunk", NULL), cases[i].chunks);
        if (cases[i].chunks) {
            KILN_CHECK(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 128, 16, 32, cases[i].rows, 8, &want));
            assert_memory_equal(&got, &want, sizeof want); /* the last listed */
        }
        kiln_free(specs);
    }
    c.linear_key_head_dim = 256;
    kiln_spec *specs = NULL;
    size_t n = 0;
    KILN_CHECK(kiln_model_specializations_for_arch(&c, "sm_90", &specs, &n));
    assert_int_equal(count_template(specs, n, "gated_delta_chunk", NULL), 0);
    kiln_free(specs);
    /* An odd value dim takes the chunked kernel's scalar loads. */
    c.linear_key_head_dim = 128;
    c.linear_value_head_dim = 100;
    kiln_spec got, want;
    KILN_CHECK(kiln_model_specializations_for_arch(&c, "sm_90", &specs, &n));
    assert_int_equal(count_template(specs, n, "gated_delta_chunk", &got), 2);
    KILN_CHECK(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 100, 16, 32, 32, 1, &want));
    assert_memory_equal(&got, &want, sizeof want);
    kiln_free(specs);
    /* $KILN_GATED_DELTA_TERMS=2: the same kernels in two terms, as the encode takes them. */
    setenv("KILN_GATED_DELTA_TERMS", "2", 1);
    const kiln_status st = kiln_model_specializations_for_arch(&c, "sm_90", &specs, &n);
    unsetenv("KILN_GATED_DELTA_TERMS");
    KILN_CHECK(st);
    assert_int_equal(count_template(specs, n, "gated_delta_chunk", &got), 2);
    KILN_CHECK(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 100, 16, 32, 32, 1, &want));
    KILN_CHECK(kiln_spec_set(&want, "TERMS", 2));
    assert_memory_equal(&got, &want, sizeof want);
    kiln_free(specs);
}

/* ---- offline compiles ---- */

typedef offline_fixture fixture;

/* Qwen3-Next, the small odd shape of the GPU tests, scalar paths, partial
 * vectors per lane, the extremes of one lane per row and 32 lanes per row:
 * in f16 for sm_90, and in bf16 for sm_90 and sm_80 (bf16's first). */
static void test_every_code_path_compiles(void **state)
{
    fixture *f = *state;
    static const struct { int64_t dk, dv, kh, vh; int vec; } cases[] = {
        {128, 128, 16, 32, 4}, {64, 96, 3, 6, 4}, {64, 96, 3, 6, 1}, {63, 17, 1, 1, 1}, {200, 40, 2, 2, 4},
        {1, 1, 1, 1, 1},       {4, 5, 1, 7, 4},   {1024, 1024, 1, 1024, 4}, {1023, 3, 4, 8, 1}};
    static const struct { const char *arch; kiln_dtype elt; } runs[] = {
        {"sm_90", KILN_DTYPE_F16}, {"sm_90", KILN_DTYPE_BF16}, {"sm_80", KILN_DTYPE_BF16}};
    for (size_t a = 0; a < sizeof runs / sizeof runs[0]; a++) {
        kiln_jit_options jo = {.cache = f->cache, .arch = runs[a].arch};
        kiln_jit *jit;
        KILN_CHECK(kiln_jit_create(&jo, &jit));
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            kiln_spec s;
            char text[256];
            int compiled = 0;
            KILN_CHECK(kiln_op_gated_delta_spec(runs[a].elt, cases[i].dk, cases[i].dv, cases[i].kh, cases[i].vh,
                                                cases[i].vec, &s));
            KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
            kiln_status st = kiln_jit_prepare(jit, &s, &compiled);
            if (st)
                fail_msg("gated_delta %s %s: %s: %s", runs[a].arch, text, kiln_status_code(st), kiln_errmsg());
            assert_int_equal(compiled, 1);
        }
        kiln_jit_counters k;
        kiln_jit_get_counters(jit, &k);
        assert_int_equal(k.compile_errors, 0);
        kiln_jit_destroy(jit);
    }
}

/* The chunked kernel for sm_80 and sm_90, in f16 and bf16: Qwen3-Next at
 * both row counts and both vector widths, the small odd shape, a key dim that is not a whole
 * k-step (63: scalar, 72: 8-wide with a padded k-step), a value dim that
 * leaves a block partly empty, and the extremes of one key dim and 128, in
 * one f16 term an operand (the default); Qwen3-Next and the scalar odd
 * shape in two (TERMS 2) too. */
static void test_chunked_kernel_compiles(void **state)
{
    fixture *f = *state;
    static const struct { int64_t dk, dv, kh, vh; int rows, vec, terms; } cases[] = {
        {128, 128, 16, 32, 64, 8, 1}, {128, 128, 16, 32, 32, 8, 1}, {128, 128, 16, 32, 64, 1, 1},
        {64, 96, 3, 6, 32, 8, 1},     {64, 96, 3, 6, 64, 8, 1},     {63, 17, 1, 2, 32, 1, 1},
        {72, 40, 2, 2, 64, 8, 1},     {1, 1, 1, 1, 32, 1, 1},       {128, 1024, 1, 4, 64, 8, 1},
        {128, 128, 16, 32, 64, 8, 2}, {63, 17, 1, 2, 32, 1, 2}};
    static const char *const arches[] = {"sm_90", "sm_80"};
    static const kiln_dtype elts[] = {KILN_DTYPE_F16, KILN_DTYPE_BF16};
    for (size_t a = 0; a < sizeof arches / sizeof arches[0]; a++) {
        kiln_jit_options jo = {.cache = f->cache, .arch = arches[a]};
        kiln_jit *jit;
        KILN_CHECK(kiln_jit_create(&jo, &jit));
        for (size_t e = 0; e < sizeof elts / sizeof elts[0]; e++)
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                kiln_spec s;
                char text[256];
                int compiled = 0;
                KILN_CHECK(kiln_op_gated_delta_chunk_spec(elts[e], cases[i].dk, cases[i].dv, cases[i].kh,
                                                          cases[i].vh, cases[i].rows, cases[i].vec, &s));
                if (cases[i].terms == 2)
                    KILN_CHECK(kiln_spec_set(&s, "TERMS", 2));
                KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
                kiln_status st = kiln_jit_prepare(jit, &s, &compiled);
                if (st)
                    fail_msg("gated_delta_chunk %s %s: %s: %s", arches[a], text, kiln_status_code(st),
                             kiln_errmsg());
                assert_int_equal(compiled, 1);
            }
        kiln_jit_counters k;
        kiln_jit_get_counters(jit, &k);
        assert_int_equal(k.compile_errors, 0);
        kiln_jit_destroy(jit);
    }
}

/* The chunked template's four entries (the single kernel first: the one
 * kiln_kernel_function(k, NULL) finds), each in the cubin NVRTC makes of it,
 * in both element types and both vector widths. */
static void test_chunked_template_has_four_entries(void **state)
{
    (void)state;
    static const char *const want[4] = {"kiln_gated_delta_chunk", "kiln_gated_delta_keys",
                                        "kiln_gated_delta_chunk_keyed", "kiln_gated_delta_rows"};
    const kiln__template *t;
    KILN_CHECK(kiln__template_find("gated_delta_chunk", &t));
    assert_int_equal(t->n_entries, 4);
    for (int i = 0; i < 4; i++)
        assert_string_equal(t->entries[i], want[i]);
    kiln__nvrtc_options o;
    KILN_CHECK(kiln__options_normalize(NULL, 0, &o));
    static const struct { kiln_dtype elt; int vec; } runs[] = {{KILN_DTYPE_F16, 8}, {KILN_DTYPE_BF16, 1}};
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        kiln_spec s;
        void *cubin = NULL;
        size_t size = 0;
        KILN_CHECK(kiln_op_gated_delta_chunk_spec(runs[r].elt, 128, 128, 16, 32, 64, runs[r].vec, &s));
        KILN_CHECK(kiln__compile(t, &s, &o, "sm_90", &cubin, &size));
        for (int i = 0; i < 4; i++) {
            const size_t n = strlen(want[i]) + 1; /* the name with its NUL: no longer name's prefix */
            int found = 0;
            for (size_t at = 0; at + n <= size && !found; at++)
                found = !memcmp((const char *)cubin + at, want[i], n);
            if (!found)
                fail_msg("%s is not in the cubin (%s)", want[i], kiln_dtype_name(runs[r].elt));
        }
        free(cubin);
    }
    kiln__options_free(&o);
}

static void test_spec_and_size_arguments(void **state)
{
    (void)state;
    kiln_spec s;
    char text[256];
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 4, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=0;DK=128;DV=128;G=16;KH=16;THREADS=128;VEC=4;VH=32");
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 64, 96, 3, 6, 4, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=0;DK=64;DV=96;G=8;KH=3;THREADS=128;VEC=4;VH=6");
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 4, 3, 1, 1, 4, &s)); /* a block no larger than the head */
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=0;DK=4;DV=3;G=1;KH=1;THREADS=32;VEC=4;VH=1");
    /* bf16 is its own kernel: only BF16 differs. */
    kiln_spec s16, s8;
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 4, &s16));
    KILN_CHECK(kiln_op_gated_delta_spec(KILN_DTYPE_BF16, 128, 128, 16, 32, 4, &s8));
    assert_memory_not_equal(&s16, &s8, sizeof s8);
    KILN_CHECK(kiln_spec_constants_text(&s8, text, sizeof text));
    assert_string_equal(text, "BF16=1;DK=128;DV=128;G=16;KH=16;THREADS=128;VEC=4;VH=32");
    KILN_CHECK(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 64, 8, &s16));
    KILN_CHECK(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_BF16, 128, 128, 16, 32, 64, 8, &s8));
    assert_memory_not_equal(&s16, &s8, sizeof s8);
    KILN_CHECK(kiln_spec_constants_text(&s8, text, sizeof text));
    assert_string_equal(text, "BF16=1;DK=128;DV=128;KH=16;ROWS=64;VEC=8;VH=32");
    KILN_EXPECT(kiln_op_gated_delta_spec(KILN_DTYPE_F32, 128, 128, 16, 32, 4, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "gated_delta: element type must be f16 or bf16", "got f32");
    KILN_EXPECT(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F32, 128, 128, 16, 32, 64, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "gated_delta_chunk: element type must be f16 or bf16", "got f32");
    KILN_EXPECT(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 0, 128, 16, 32, 1, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "dk 0", NULL);
    KILN_EXPECT(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 128, 1025, 16, 32, 1, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "dv 1025", NULL);
    KILN_EXPECT(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 128, 128, 3, 32, 1, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "key heads 3", "value heads 32");
    KILN_EXPECT(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 63, 128, 16, 32, 4, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "vector width 4", NULL);
    KILN_EXPECT(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 64, 128, 16, 32, 2, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "vector width 2", NULL);
    KILN_EXPECT(kiln_op_gated_delta_spec(KILN_DTYPE_F16, 64, 128, 16, 32, 4, NULL), KILN_ERR_INVALID_ARGUMENT,
                kiln_errmsg(), NULL, NULL);
    size_t b = 1;
    KILN_CHECK(kiln_op_gated_delta_state_bytes(8, 32, 128, 128, &b));
    assert_int_equal(b, (size_t)8 * 32 * 128 * 128 * 4);
    KILN_EXPECT(kiln_op_gated_delta_state_bytes(0, 32, 128, 128, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "0 sequences", NULL);
    KILN_EXPECT(kiln_op_gated_delta_state_bytes(INT64_MAX, 32, 128, 128, &b), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "out of range", NULL);
    KILN_EXPECT(kiln_op_gated_delta_state_bytes(1, 1, 1, 1, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL,
                NULL);
    /* The workspace: (ceil(T / 64) + S) records a value head of 22272 bytes
     * (bf16: 55040, with the chunk's k and q rows as f16) and a 4-byte flag. */
    const kiln_dtype f16 = KILN_DTYPE_F16;
    b = 1;
    KILN_CHECK(kiln_op_gated_delta_workspace(f16, 4096, 8, 32, &b));
    assert_int_equal(b, (size_t)(64 + 8) * 32 * 22276);
    KILN_CHECK(kiln_op_gated_delta_workspace(KILN_DTYPE_BF16, 4096, 8, 32, &b));
    assert_int_equal(b, (size_t)(64 + 8) * 32 * 55044);
    KILN_CHECK(kiln_op_gated_delta_workspace(f16, 4097, 1, 32, &b));
    assert_int_equal(b, (size_t)(65 + 1) * 32 * 22276);
    KILN_CHECK(kiln_op_gated_delta_workspace(f16, 0, 3, 1, &b));
    assert_int_equal(b, (size_t)3 * 22276);
    KILN_EXPECT(kiln_op_gated_delta_workspace(KILN_DTYPE_F32, 4096, 8, 32, &b), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "element type f32", "(f16 or bf16)");
    KILN_EXPECT(kiln_op_gated_delta_workspace(f16, 4096, 0, 32, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "0 sequences", "out of range");
    KILN_EXPECT(kiln_op_gated_delta_workspace(f16, 4096, 8, 0, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "0 value heads", NULL);
    KILN_EXPECT(kiln_op_gated_delta_workspace(f16, -1, 8, 32, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "-1 tokens", NULL);
    KILN_EXPECT(kiln_op_gated_delta_workspace(f16, (int64_t)UINT32_MAX + 1, 8, 32, &b), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "4294967296 tokens", NULL);
    KILN_EXPECT(kiln_op_gated_delta_workspace(f16, 1, 1, 1, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL,
                NULL);
    KILN_CHECK(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 64, 8, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(text, "BF16=0;DK=128;DV=128;KH=16;ROWS=64;VEC=8;VH=32");
    assert_string_equal(s.template_id, "gated_delta_chunk");
    KILN_EXPECT(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 129, 128, 16, 32, 64, 1, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "dk 129 (1..128)", NULL);
    KILN_EXPECT(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 16, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "rows 16", NULL);
    KILN_EXPECT(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 100, 16, 32, 32, 8, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "vector width 8", NULL);
    KILN_EXPECT(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 32, 4, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "vector width 4", NULL);
    KILN_EXPECT(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 128, 3, 32, 32, 1, &s), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "key heads 3", NULL);
    KILN_EXPECT(kiln_op_gated_delta_chunk_spec(KILN_DTYPE_F16, 128, 128, 16, 32, 32, 1, NULL),
                KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
}

static void test_offline_encode_needs_a_device(void **state)
{
    fixture *f = *state;
    kiln_gated_delta_bindings b = {0};
    kiln_command *cmd = (kiln_command *)1;
    KILN_EXPECT(kiln_op_gated_delta_encode(f->jit, &b, &cmd), KILN_ERR_NO_DEVICE, kiln_errmsg(), "gated_delta",
                "offline");
    assert_null(cmd);
    KILN_EXPECT(kiln_op_gated_delta(f->jit, &b), KILN_ERR_NO_DEVICE, kiln_errmsg(), "gated_delta", NULL);
    KILN_EXPECT(kiln_op_gated_delta_encode(NULL, &b, &cmd), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
}

/* ---- validation against fake buffers ---- */


static kiln_tensor view(kiln_buffer *b, size_t offset, kiln_dtype dt, uint32_t rank, int64_t d0, int64_t d1,
                        int64_t d2, int64_t d3)
{
    kiln_tensor t = {.buffer = b, .offset = offset, .dtype = dt, .rank = rank, .dims = {d0, d1, d2, d3}};
    return t;
}

static void test_validation_names_binding_and_values(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(4343), *other = fake_runtime(4343);
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_90"); /* where bf16 is taken */
    kiln_buffer *buf = fake_buffer(rt, 256 << 20, KILN_DTYPE_BYTES),
                *foreign = fake_buffer(other, 1 << 20, KILN_DTYPE_BYTES);
    const size_t MB = 1 << 20;
    const int64_t T = 40, S = 4, KH = 16, VH = 32, DK = 128, DV = 128;
    kiln_tensor q = view(buf, 0, KILN_DTYPE_F16, 3, T, KH, DK, 0), k = view(buf, MB, KILN_DTYPE_F16, 3, T, KH, DK, 0),
                v = view(buf, 2 * MB, KILN_DTYPE_F16, 3, T, VH, DV, 0),
                g = view(buf, 3 * MB, KILN_DTYPE_F32, 2, T, VH, 0, 0),
                beta = view(buf, 4 * MB, KILN_DTYPE_F32, 2, T, VH, 0, 0),
                st = view(buf, 8 * MB, KILN_DTYPE_F32, 4, S, VH, DV, DK),
                spans = view(buf, 5 * MB, KILN_DTYPE_U32, 2, S, 2, 0, 0),
                out = view(buf, 6 * MB, KILN_DTYPE_F16, 3, T, VH, DV, 0);
    const kiln_gated_delta_bindings b = {sizeof b, &q, &k, &v, &g, &beta, &st, &spans, &out, 0, NULL};
    size_t bytes[8];
    int vec = 0;
    KILN_CHECK(kiln__gated_delta_check(rt, &b, bytes, &vec));
    assert_int_equal(vec, 4);
    assert_int_equal(bytes[5], (size_t)S * VH * DV * DK * 4);
    assert_int_equal(bytes[7], (size_t)T * VH * DV * 2);
    /* Read-only bindings may share bytes: q and k the same view. */
    kiln_gated_delta_bindings c = b;
    c.k = &q;
    KILN_CHECK(kiln__gated_delta_check(rt, &c, bytes, &vec));

    kiln_tensor t;
#define EXPECT_BAD(field, value, n1, n2)                                                                          \
    do {                                                                                                          \
        c = b;                                                                                                    \
        t = value;                                                                                                \
        c.field = &t;                                                                                             \
        KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT,                      \
                    kiln_runtime_errmsg(rt), n1, n2);                                                             \
    } while (0)
    t = q;
    t.dtype = KILN_DTYPE_BF16;
    EXPECT_BAD(q, t, "gated_delta: binding k must be bf16", "got f16"); /* q sets the element type */
    t = k;
    t.dtype = KILN_DTYPE_BF16;
    EXPECT_BAD(k, t, "gated_delta: binding k must be f16", "got bf16");
    t = v;
    t.dtype = KILN_DTYPE_BF16;
    EXPECT_BAD(v, t, "gated_delta: binding v must be f16", "got bf16");
    t = out;
    t.dtype = KILN_DTYPE_BF16;
    EXPECT_BAD(out, t, "gated_delta: binding out must be f16", "got bf16");
    t = q;
    t.dtype = KILN_DTYPE_F32;
    EXPECT_BAD(q, t, "gated_delta: binding q must be f16 or bf16", "got f32");
    t = k;
    t.dims[1] = 8;
    EXPECT_BAD(k, t, "binding k has dims [40, 8, 128]", "must be 16");
    t = v;
    t.dims[0] = 39;
    EXPECT_BAD(v, t, "binding v has dims [39, 32, 128]", "must be 40");
    t = v;
    t.dims[1] = 24; /* 16 key heads do not divide 24 value heads */
    EXPECT_BAD(v, t, "16 key heads (q) and 24 value heads (v)", "must divide");
    t = g;
    t.dtype = KILN_DTYPE_F16;
    EXPECT_BAD(g, t, "binding g must be f32", "got f16");
    t = beta;
    t.dims[1] = 16;
    EXPECT_BAD(beta, t, "binding beta has dims [40, 16]", "must be 32");
    t = st;
    t.dims[3] = 64;
    EXPECT_BAD(state, t, "binding state has dims [4, 32, 128, 64]", "must be 128");
    t = st;
    t.rank = 3;
    EXPECT_BAD(state, t, "binding state must have rank 4", "got 3");
    t = spans;
    t.dims[1] = 3;
    EXPECT_BAD(spans, t, "binding spans has dims [4, 3]", "must be 2");
    t = spans;
    t.dtype = KILN_DTYPE_I32;
    EXPECT_BAD(spans, t, "binding spans must be u32", "got i32");
    t = out;
    t.dims[2] = 64;
    EXPECT_BAD(out, t, "binding out has dims [40, 32, 64]", "must be 128");
    t = q;
    t.dims[2] = 2048;
    c = b;
    c.q = &t;
    kiln_tensor k2 = k, st2 = st;
    k2.dims[2] = 2048;
    st2.dims[3] = 2048;
    c.k = &k2;
    c.state = &st2;
    st2.offset = 64 * MB;
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "dk 2048",
                "at most 1024");
    t = out;
    t.offset = 4 * MB; /* over beta */
    EXPECT_BAD(out, t, "out overlaps beta", NULL);
    t = st;
    t.offset = 6 * MB; /* over out */
    EXPECT_BAD(state, t, "state overlaps out", NULL);
    t = st;
    t.offset = 5 * MB - 16; /* state's first bytes below spans, the rest over it */
    EXPECT_BAD(state, t, "state overlaps", NULL);
    t = view(foreign, 0, KILN_DTYPE_U32, 2, S, 2, 0, 0);
    EXPECT_BAD(spans, t, "binding spans belongs to another runtime", NULL);
    t = view(buf, 256 * MB - 100, KILN_DTYPE_F32, 2, T, VH, 0, 0);
    EXPECT_BAD(g, t, "needs 5120 bytes", "the buffer has");
    c = b;
    c.beta = NULL;
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding beta has no buffer", NULL);
    c = b;
    c.size = 8;
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "bindings size 8", NULL);
    /* The size field: one too small to be a size names the struct; a newer
     * caller's larger struct is read as far as this library knows it. */
    c.size = 3;
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_gated_delta_bindings.size is 3", NULL);
    struct {
        kiln_gated_delta_bindings b;
        uint64_t later;
    } newer = {b, UINT64_MAX};
    newer.b.size = sizeof newer;
    KILN_CHECK(kiln__gated_delta_check(rt, &newer.b, bytes, &vec));
    /* The first layout, which ends at out, is still taken (max_span_tokens 0);
     * one a byte short of it is not. */
    c = b;
    c.size = (uint32_t)offsetof(kiln_gated_delta_bindings, max_span_tokens);
    KILN_CHECK(kiln__gated_delta_check(rt, &c, bytes, &vec));
    c.size -= 1;
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "an earlier layout", NULL);
    KILN_EXPECT(kiln__gated_delta_check(rt, NULL, bytes, &vec), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "bindings is NULL", NULL);
    /* The workspace: taken at its bytes (or more) on the runtime, 256-byte
     * aligned; too small, on another runtime, misaligned or over a binding is
     * refused naming both sizes or the binding; the first two layouts (no
     * workspace field) read it as NULL. */
    size_t need;
    KILN_CHECK(kiln_op_gated_delta_workspace(KILN_DTYPE_F16, T, S, VH, &need));
    kiln_region ws = {buf, 32 * MB, 32 * MB + need};
    c = b;
    c.workspace = &ws;
    KILN_CHECK(kiln__gated_delta_check(rt, &c, bytes, &vec));
    ws.end += 256;
    KILN_CHECK(kiln__gated_delta_check(rt, &c, bytes, &vec));
    char msg[160];
    snprintf(msg, sizeof msg, "has %zu bytes; it must have at least %zu", need - 1, need);
    ws = (kiln_region){buf, 32 * MB, 32 * MB + need - 1};
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "gated_delta: binding workspace", msg);
    ws = (kiln_region){buf, 32 * MB + 128, 32 * MB + 128 + need};
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "binding workspace must start 256-byte aligned", NULL);
    ws = (kiln_region){buf, 4 * MB + 8192, 4 * MB + 8192 + need}; /* over spans and out */
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "binding workspace", "overlaps binding spans");
    ws = (kiln_region){foreign, 0, need};
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "binding workspace belongs to another runtime", NULL);
    ws = (kiln_region){NULL, 0, need};
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "binding workspace has no buffer", NULL);
    ws = (kiln_region){buf, 6 * MB, 6 * MB + need}; /* over out, but not read: an earlier size */
    c.size = (uint32_t)offsetof(kiln_gated_delta_bindings, workspace);
    KILN_CHECK(kiln__gated_delta_check(rt, &c, bytes, &vec));
#undef EXPECT_BAD
    /* All of q, k, v and out in bf16: taken where the device has bf16 (the
     * same bytes), each of them alone in f16 refused by name, g, beta and
     * state f32 still; before sm_80, refused naming the arch. */
    kiln_tensor q8 = q, k8 = k, v8 = v, o8 = out;
    q8.dtype = k8.dtype = v8.dtype = o8.dtype = KILN_DTYPE_BF16;
    const kiln_gated_delta_bindings b8 = {sizeof b8, &q8, &k8, &v8, &g, &beta, &st, &spans, &o8, 0, NULL};
    KILN_CHECK(kiln__gated_delta_check(rt, &b8, bytes, &vec));
    assert_int_equal(vec, 4);
    assert_int_equal(bytes[0], (size_t)T * KH * DK * 2);
    assert_int_equal(bytes[7], (size_t)T * VH * DV * 2);
    const kiln_tensor *const f16s[3] = {&k, &v, &out};
    static const char *const f16_msg[3] = {"gated_delta: binding k must be bf16", "gated_delta: binding v must be bf16",
                                           "gated_delta: binding out must be bf16"};
    for (int i = 0; i < 3; i++) {
        c = b8;
        if (i == 0)
            c.k = f16s[i];
        else if (i == 1)
            c.v = f16s[i];
        else
            c.out = f16s[i];
        KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                    f16_msg[i], "got f16");
    }
    c = b8;
    t = st;
    t.dtype = KILN_DTYPE_BF16;
    t.dims[3] = DK * 2; /* the same bytes as the f32 state */
    c.state = &t;
    KILN_EXPECT(kiln__gated_delta_check(rt, &c, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "binding state must be f32", "got bf16");
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_75");
    KILN_EXPECT(kiln__gated_delta_check(rt, &b8, bytes, &vec), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "gated_delta: binding q is bf16", "sm_75 (before sm_80)");
    KILN_CHECK(kiln__gated_delta_check(rt, &b, bytes, &vec)); /* f16 there still */
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_90");
    /* The vector width: dk % 4, q and k 8-byte and state 16-byte aligned. */
    c = b;
    t = st;
    t.offset += 8;
    c.state = &t;
    KILN_CHECK(kiln__gated_delta_check(rt, &c, bytes, &vec));
    assert_int_equal(vec, 1);
    c = b;
    t = k;
    t.offset += 4;
    c.k = &t;
    KILN_CHECK(kiln__gated_delta_check(rt, &c, bytes, &vec));
    assert_int_equal(vec, 1);
    kiln_tensor q3 = view(buf, 0, KILN_DTYPE_F16, 3, T, 3, 66, 0), k3 = view(buf, MB, KILN_DTYPE_F16, 3, T, 3, 66, 0),
                v3 = view(buf, 2 * MB, KILN_DTYPE_F16, 3, T, 6, 96, 0),
                g3 = view(buf, 3 * MB, KILN_DTYPE_F32, 2, T, 6, 0, 0),
                b3 = view(buf, 4 * MB, KILN_DTYPE_F32, 2, T, 6, 0, 0),
                s3 = view(buf, 8 * MB, KILN_DTYPE_F32, 4, S, 6, 96, 66),
                o3 = view(buf, 6 * MB, KILN_DTYPE_F16, 3, T, 6, 96, 0);
    c = (kiln_gated_delta_bindings){0, &q3, &k3, &v3, &g3, &b3, &s3, &spans, &o3, 0, NULL};
    KILN_CHECK(kiln__gated_delta_check(rt, &c, bytes, &vec));
    assert_int_equal(vec, 1);
    free(buf);
    free(foreign);
    fake_runtime_free(rt);
    fake_runtime_free(other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_lists_the_spec_only_with_linear_attention),
        cmocka_unit_test(test_arch_lists_the_chunked_kernel),
        cmocka_unit_test_setup_teardown(test_every_code_path_compiles, offline_fixture_setup, offline_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_chunked_kernel_compiles, offline_fixture_setup, offline_fixture_teardown),
        cmocka_unit_test(test_chunked_template_has_four_entries),
        cmocka_unit_test(test_spec_and_size_arguments),
        cmocka_unit_test_setup_teardown(test_offline_encode_needs_a_device, offline_fixture_setup,
                                        offline_fixture_teardown),
        cmocka_unit_test(test_validation_names_binding_and_values),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
