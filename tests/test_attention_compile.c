/* Paged attention without a GPU: the specializations a model lists (f16 and
 * bf16), each head layout and path (prefill, and the one-kernel decode of
 * templates/paged_decode.cu) compiled offline by NVRTC for sm_90 in f16 and
 * bf16, bf16 also for sm_80, sm_86 and sm_120, the spec and page arguments, and the validation of an
 * invocation against fake buffers (a fake runtime has no driver table: a
 * check that let a bad call through would crash here). */
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>

#include "providers/internal.h"
#include "offline_fixture.h"
#include "fake_runtime.h"
#include "testutil.h"

static int has_spec(const kiln_spec *specs, size_t n, const kiln_spec *want)
{
    for (size_t i = 0; i < n; i++)
        if (!memcmp(&specs[i], want, sizeof *want))
            return 1;
    return 0;
}

static void test_model_lists_prefill_and_decode(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_model_config_default(&c); /* Llama-3-8B: 32 heads, 8 kv heads, head_dim 128 */
    kiln_spec *specs = NULL, want;
    size_t n = 0;
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 128, 32, 8, 0, &want));
    assert_true(has_spec(specs, n, &want));
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 128, 32, 8, 1, &want));
    assert_true(has_spec(specs, n, &want));
    kiln_free(specs);
    /* A head layout the kernels do not serve adds nothing and fails nothing. */
    c.head_dim = 96;
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    for (size_t i = 0; i < n; i++)
        assert_true(strcmp(specs[i].template_id, "paged_attention") && strcmp(specs[i].template_id, "paged_decode"));
    kiln_free(specs);
}

typedef offline_fixture fixture;

typedef struct spec_set {
    kiln_spec items[8];
    size_t n;
} spec_set;

static kiln_status collect(void *user, const kiln_spec *spec)
{
    spec_set *l = user;
    assert_true(l->n < sizeof l->items / sizeof l->items[0]);
    assert_false(has_spec(l->items, l->n, spec)); /* each once */
    l->items[l->n++] = *spec;
    return KILN_OK;
}

static spec_set arch_specs_elt(kiln_dtype elt, int64_t head_dim, int64_t heads, int64_t kv_heads, const char *arch)
{
    kiln_model_config c;
    kiln_model_config_default(&c);
    c.dtype = elt;
    c.head_dim = head_dim;
    c.num_attention_heads = heads;
    c.num_key_value_heads = kv_heads;
    spec_set l = {.n = 0};
    KILN_CHECK(kiln__paged_attention_arch_specs(&c, arch, collect, &l));
    return l;
}

static spec_set arch_specs(int64_t head_dim, int64_t heads, int64_t kv_heads, const char *arch)
{
    return arch_specs_elt(KILN_DTYPE_F16, head_dim, heads, kv_heads, arch);
}

/* The two-kernel decode (paged_attention with the decode's rows: 4 for a
 * group of 4) that a device takes where the one-kernel decode does not run. */
static kiln_spec fallback_spec_elt(kiln_dtype elt, int64_t head_dim, int64_t heads, int64_t kv_heads, int64_t rows)
{
    kiln_spec s;
    KILN_CHECK(kiln_op_paged_attention_spec(elt, head_dim, heads, kv_heads, 0, &s));
    KILN_CHECK(kiln_spec_set(&s, "ROWS", rows));
    return s;
}

static kiln_spec fallback_spec(int64_t head_dim, int64_t heads, int64_t kv_heads, int64_t rows)
{
    return fallback_spec_elt(KILN_DTYPE_F16, head_dim, heads, kv_heads, rows);
}

/* The tensor-core prefill an architecture takes: wgmma on sm_90, mma.sync
 * elsewhere from sm_80 on. */
static kiln_spec tc_prefill_spec_elt(kiln_dtype elt, int64_t head_dim, int64_t heads, int64_t kv_heads, int wgmma)
{
    kiln_spec s;
    uint32_t pt;
    KILN_CHECK(kiln_op_paged_attention_page_tokens(head_dim, kv_heads, &pt));
    KILN_CHECK(kiln_spec_init(&s, wgmma ? "paged_prefill" : "paged_prefill_mma"));
    KILN_CHECK(kiln_spec_set(&s, "BF16", elt == KILN_DTYPE_BF16));
    KILN_CHECK(kiln_spec_set(&s, "HEAD_DIM", head_dim));
    KILN_CHECK(kiln_spec_set(&s, "HEADS", heads));
    KILN_CHECK(kiln_spec_set(&s, "KV_HEADS", kv_heads));
    KILN_CHECK(kiln_spec_set(&s, "PAGE_TOKENS", pt));
    return s;
}

static kiln_spec tc_prefill_spec(int64_t head_dim, int64_t heads, int64_t kv_heads, int wgmma)
{
    return tc_prefill_spec_elt(KILN_DTYPE_F16, head_dim, heads, kv_heads, wgmma);
}

/* head_dim 64 and 128; group sizes 1, 4, 7 (the GPU test's), 16 and 32
 * (several row tiles per group); prefill, decode, and the two-kernel decode's
 * 4 and 8 rows (16 are the prefill's kernel); f16 every layout, bf16 groups
 * 1, 4, 7 and 32 (each path, each head_dim). */
static void test_every_path_compiles_for_sm90(void **state)
{
    fixture *f = *state;
    static const struct { int64_t heads, kv_heads; } layouts[] = {{8, 8}, {32, 8}, {28, 4}, {64, 2},
                                                                 {14, 2}, {16, 1}, {4, 4}};
    size_t total = 0;
    /* bd: bf16 (bd / 2) and head_dim 64 or 128 (bd % 2). */
    for (int bd = 0; bd < 4; bd++)
        for (size_t i = 0; i < (bd / 2 ? 4 : sizeof layouts / sizeof layouts[0]); i++)
            for (int decode = 0; decode < 2; decode++) {
                const int b = bd / 2, d = bd % 2 ? 128 : 64;
                const kiln_dtype elt = b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
                kiln_spec s;
                char text[256];
                KILN_CHECK(kiln_op_paged_attention_spec(elt, d, layouts[i].heads, layouts[i].kv_heads, decode, &s));
                KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
                assert_int_equal(strncmp(text, b ? "BF16=1;" : "BF16=0;", 7), 0);
                int compiled = 0;
                kiln_status st = kiln_jit_prepare(f->jit, &s, &compiled);
                if (st)
                    fail_msg("%s %s: %s: %s", s.template_id, text, kiln_status_code(st), kiln_errmsg());
                total++;
                if (!decode) { /* and the wgmma prefill, sm_90's */
                    s = tc_prefill_spec_elt(elt, d, layouts[i].heads, layouts[i].kv_heads, 1);
                    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
                    if ((st = kiln_jit_prepare(f->jit, &s, &compiled)))
                        fail_msg("%s %s: %s: %s", s.template_id, text, kiln_status_code(st), kiln_errmsg());
                    total++;
                }
                const int64_t g = layouts[i].heads / layouts[i].kv_heads, rows = g <= 4 ? 4 : g <= 8 ? 8 : 16;
                if (decode && rows != 16) {
                    s = fallback_spec_elt(elt, d, layouts[i].heads, layouts[i].kv_heads, rows);
                    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
                    if ((st = kiln_jit_prepare(f->jit, &s, &compiled)))
                        fail_msg("%s %s: %s: %s", s.template_id, text, kiln_status_code(st), kiln_errmsg());
                    total++;
                }
            }
    kiln_jit_counters k;
    kiln_jit_get_counters(f->jit, &k);
    assert_int_equal(k.compile_errors, 0);
    assert_int_equal(k.compiles, total); /* every spec its own kernel */
}

/* head_dim 256 (Qwen3-Next's attention layers, Gemma's) runs on the CUDA-core
 * kernel, 8 rows a block (its decode: 4 for a group of at most 4), but for
 * sm_90's prefill, on the wgmma kernel: every architecture lists the first,
 * sm_90 the second too, and they compile in f16 and bf16 for sm_90. */
static void test_head_dim_256_lists_and_compiles(void **state)
{
    fixture *f = *state;
    static const struct { int64_t heads, kv_heads, decode_rows; } layouts[] = {{16, 2, 8}, {8, 8, 4}, {32, 16, 4}};
    static const char *const archs[] = {NULL, "sm_75", "sm_86", "sm_90"};
    size_t total = 0;
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
            const kiln_dtype elt = b ? KILN_DTYPE_BF16 : KILN_DTYPE_F16;
            const int64_t H = layouts[i].heads, KVH = layouts[i].kv_heads, rows = layouts[i].decode_rows;
            kiln_spec prefill, decode;
            KILN_CHECK(kiln_op_paged_attention_spec(elt, 256, H, KVH, 0, &prefill));
            KILN_CHECK(kiln_op_paged_attention_spec(elt, 256, H, KVH, 1, &decode));
            assert_string_equal(prefill.template_id, "paged_attention");
            assert_string_equal(decode.template_id, "paged_attention");
            const kiln_spec want_prefill = fallback_spec_elt(elt, 256, H, KVH, 8),
                            want_decode = fallback_spec_elt(elt, 256, H, KVH, rows);
            assert_true(has_spec(&prefill, 1, &want_prefill));
            assert_true(has_spec(&decode, 1, &want_decode));
            for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++) {
                if (b && a == 1)
                    continue; /* no bf16 before sm_80 */
                spec_set l = arch_specs_elt(elt, 256, H, KVH, archs[a]);
                const int sm90 = archs[a] && !strcmp(archs[a], "sm_90");
                const kiln_spec wgmma = tc_prefill_spec_elt(elt, 256, H, KVH, 1);
                assert_int_equal(l.n, (rows == 8 ? 1 : 2) + sm90);
                assert_true(has_spec(l.items, l.n, &prefill));
                assert_true(has_spec(l.items, l.n, &decode));
                assert_int_equal(has_spec(l.items, l.n, &wgmma), sm90);
            }
            int compiled = 0;
            KILN_CHECK(kiln_jit_prepare(f->jit, &prefill, &compiled));
            total++;
            const kiln_spec wgmma = tc_prefill_spec_elt(elt, 256, H, KVH, 1);
            kiln_status st = kiln_jit_prepare(f->jit, &wgmma, &compiled);
            if (st)
                fail_msg("paged_prefill head_dim 256 %lld/%lld: %s: %s", (long long)H, (long long)KVH,
                         kiln_status_code(st), kiln_errmsg());
            total++;
            if (rows != 8) {
                KILN_CHECK(kiln_jit_prepare(f->jit, &decode, &compiled));
                total++;
            }
        }
    kiln_jit_counters k;
    kiln_jit_get_counters(f->jit, &k);
    assert_int_equal(k.compile_errors, 0);
    assert_int_equal(k.compiles, total);
}

/* Prewarm for an architecture that takes the two-kernel decode lists it, so
 * that a prewarmed database holds every kernel a decode there asks for: before
 * sm_80 (without the one-kernel decode, which is never asked for there), and
 * at head_dim 128 on the 99 KiB devices (sm_86, sm_89, sm_12x), where the
 * one-kernel decode is still asked for first. Each listed kernel compiles for
 * sm_86 and sm_120. */
static void test_fallback_archs_list_the_two_kernel_decode(void **state)
{
    fixture *f = *state;
    kiln_spec prefill, decode, fb = fallback_spec(128, 32, 8, 4);
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 128, 32, 8, 0, &prefill));
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 128, 32, 8, 1, &decode));
    /* Unknown: the CUDA-core prefill and the decode; from sm_80 on also the
     * tensor-core prefill (wgmma on sm_90). */
    static const char *const fits[] = {NULL, "bogus", "sm_80", "sm_87", "sm_90", "sm_90a", "sm_100", "sm_103"};
    for (size_t i = 0; i < sizeof fits / sizeof fits[0]; i++) {
        spec_set l = arch_specs(128, 32, 8, fits[i]);
        const kiln_spec tc = tc_prefill_spec(128, 32, 8, fits[i] && !strncmp(fits[i], "sm_90", 5));
        assert_int_equal(l.n, i < 2 ? 2 : 3);
        assert_true(has_spec(l.items, l.n, &prefill));
        assert_true(has_spec(l.items, l.n, &decode));
        assert_true(i < 2 || has_spec(l.items, l.n, &tc));
    }
    static const char *const short_smem[] = {"sm_86", "sm_89", "sm_120", "sm_121", "sm_120f"};
    const kiln_spec mma = tc_prefill_spec(128, 32, 8, 0);
    for (size_t i = 0; i < sizeof short_smem / sizeof short_smem[0]; i++) {
        spec_set l = arch_specs(128, 32, 8, short_smem[i]);
        assert_int_equal(l.n, 4);
        assert_true(has_spec(l.items, l.n, &prefill));
        assert_true(has_spec(l.items, l.n, &decode));
        assert_true(has_spec(l.items, l.n, &fb));
        assert_true(has_spec(l.items, l.n, &mma));
    }
    spec_set l = arch_specs(128, 32, 8, "sm_75");
    assert_int_equal(l.n, 2);
    assert_true(has_spec(l.items, l.n, &prefill));
    assert_true(has_spec(l.items, l.n, &fb));
    /* head_dim 64: the one-kernel decode's 64 KiB fit 99 KiB; before sm_80 a
     * group of 7 takes 8 rows. */
    l = arch_specs(64, 14, 2, "sm_86");
    assert_int_equal(l.n, 3);
    kiln_spec fb64 = fallback_spec(64, 14, 2, 8);
    l = arch_specs(64, 14, 2, "sm_75");
    assert_int_equal(l.n, 2);
    assert_true(has_spec(l.items, l.n, &fb64));
    /* A group of 16 decodes with the prefill's 16 rows: the same kernel, listed once. */
    l = arch_specs(128, 32, 2, "sm_89");
    assert_int_equal(l.n, 3);

    /* Through the public list (what kiln prewarm --arch asks): the default
     * model for sm_86 holds the fallback and the mma.sync prefill beside
     * everything it lists without an architecture, but for the argmax, which
     * is its one-block kernel there (no clusters), and the three TMA products
     * (sm_90 only); NULL lists the same as kiln_model_specializations. */
    {
        kiln_model_config c;
        kiln_model_config_default(&c);
        kiln_spec *plain, *for86, *for_null;
        size_t n_plain, n86, n_null;
        KILN_CHECK(kiln_model_specializations(&c, &plain, &n_plain));
        KILN_CHECK(kiln_model_specializations_for_arch(&c, "sm_86", &for86, &n86));
        KILN_CHECK(kiln_model_specializations_for_arch(&c, NULL, &for_null, &n_null));
        kiln_spec dfb = fallback_spec(c.head_dim, c.num_attention_heads, c.num_key_value_heads, 4);
        const kiln_spec dmma =
            tc_prefill_spec(c.head_dim, c.num_attention_heads, c.num_key_value_heads, 0);
        assert_int_equal(n86, n_plain + 2 - 3);
        assert_true(has_spec(for86, n86, &dfb));
        assert_true(has_spec(for86, n86, &dmma));
        assert_false(has_spec(plain, n_plain, &dfb));
        for (size_t i = 0; i < n_plain; i++)
            assert_true(has_spec(for86, n86, &plain[i]) ==
                        (strcmp(plain[i].template_id, "masked_argmax") && strncmp(plain[i].template_id, "tma_", 4)));
        assert_int_equal(n_null, n_plain);
        assert_memory_equal(for_null, plain, n_plain * sizeof *plain);
        kiln_free(plain);
        kiln_free(for86);
        kiln_free(for_null);
        kiln_spec *none = NULL;
        size_t n_none = 0;
        assert_int_equal(kiln_model_specializations_for_arch(NULL, "sm_90", &none, &n_none),
                         KILN_ERR_INVALID_ARGUMENT);
        assert_null(none);
    }

    /* (sm_75 has no mma.sync prefill; test_ops_dense_compile builds the
     * default model there, its CUDA-core attention kernels too.) */
    static const char *const archs[] = {"sm_80", "sm_86", "sm_89", "sm_120"};
    for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++) {
        kiln_jit_options jo = {.cache = f->cache, .arch = archs[a]};
        kiln_jit *jit;
        KILN_CHECK(kiln_jit_create(&jo, &jit));
        l = arch_specs(128, 32, 8, archs[a]);
        assert_true(has_spec(l.items, l.n, &mma));
        for (size_t i = 0; i < l.n; i++) {
            char text[256];
            KILN_CHECK(kiln_spec_constants_text(&l.items[i], text, sizeof text));
            kiln_status st = kiln_jit_prepare(jit, &l.items[i], NULL);
            if (st)
                fail_msg("%s, %s %s: %s", archs[a], l.items[i].template_id, text, kiln_errmsg());
        }
        kiln_jit_counters k;
        kiln_jit_get_counters(jit, &k);
        assert_int_equal(k.compiles, l.n);
        assert_int_equal(k.compile_errors, 0);
        kiln_jit_destroy(jit);
    }
}

/* A bf16 model lists bf16 kernels (BF16=1, each differing from its f16
 * twin only there), as many as f16 lists for each architecture, none before
 * sm_80; each compiles for sm_80, sm_86, sm_90 (the wgmma prefill) and
 * sm_120, at head_dim 128 (group 4) and 64 (group 7). */
static void test_bf16_specs_listed_and_compiled(void **state)
{
    fixture *f = *state;
    static const char *const archs[] = {"sm_80", "sm_86", "sm_90", "sm_120"};
    static const struct { int64_t d, h, kvh; } ls[] = {{128, 32, 8}, {64, 14, 2}};
    for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++) {
        kiln_jit_options jo = {.cache = f->cache, .arch = archs[a]};
        kiln_jit *jit;
        KILN_CHECK(kiln_jit_create(&jo, &jit));
        size_t listed = 0;
        for (size_t i = 0; i < sizeof ls / sizeof ls[0]; i++) {
            const spec_set h = arch_specs(ls[i].d, ls[i].h, ls[i].kvh, archs[a]);
            const spec_set b = arch_specs_elt(KILN_DTYPE_BF16, ls[i].d, ls[i].h, ls[i].kvh, archs[a]);
            assert_int_equal(b.n, h.n);
            for (size_t k = 0; k < b.n; k++) {
                char text[256], ftext[256];
                KILN_CHECK(kiln_spec_constants_text(&b.items[k], text, sizeof text));
                KILN_CHECK(kiln_spec_constants_text(&h.items[k], ftext, sizeof ftext));
                assert_string_equal(b.items[k].template_id, h.items[k].template_id);
                assert_int_equal(strncmp(text, "BF16=1;", 7), 0);
                assert_int_equal(strncmp(ftext, "BF16=0;", 7), 0);
                assert_string_equal(text + 7, ftext + 7);
                assert_false(has_spec(h.items, h.n, &b.items[k]));
                kiln_status st = kiln_jit_prepare(jit, &b.items[k], NULL);
                if (st)
                    fail_msg("%s, %s %s: %s", archs[a], b.items[k].template_id, text, kiln_errmsg());
            }
            if (!strcmp(archs[a], "sm_90")) {
                const kiln_spec wg = tc_prefill_spec_elt(KILN_DTYPE_BF16, ls[i].d, ls[i].h, ls[i].kvh, 1);
                assert_true(has_spec(b.items, b.n, &wg));
            }
            listed += b.n;
        }
        kiln_jit_counters k;
        kiln_jit_get_counters(jit, &k);
        assert_int_equal(k.compiles, listed);
        assert_int_equal(k.compile_errors, 0);
        kiln_jit_destroy(jit);
    }
    /* Before sm_80 no kernel serves bf16: nothing listed (the encode refuses it). */
    assert_int_equal(arch_specs_elt(KILN_DTYPE_BF16, 128, 32, 8, "sm_75").n, 0);
    assert_int_equal(arch_specs_elt(KILN_DTYPE_BF16, 128, 32, 8, NULL).n, 2);
    /* Through the public list: the bf16 model holds the bf16 attention kernels. */
    kiln_model_config c;
    kiln_model_config_default(&c);
    c.dtype = KILN_DTYPE_BF16;
    kiln_spec *specs = NULL, want;
    size_t n = 0;
    KILN_CHECK(kiln_model_specializations(&c, &specs, &n));
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_BF16, 128, 32, 8, 0, &want));
    assert_true(has_spec(specs, n, &want));
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_BF16, 128, 32, 8, 1, &want));
    assert_true(has_spec(specs, n, &want));
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 128, 32, 8, 1, &want));
    assert_false(has_spec(specs, n, &want));
    kiln_free(specs);
    KILN_EXPECT(kiln_op_paged_attention_spec(KILN_DTYPE_F32, 128, 32, 8, 0, &want), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "element type must be f16 or bf16", "f32");
}

static void test_spec_and_page_arguments(void **state)
{
    (void)state;
    uint32_t pt = 0;
    KILN_CHECK(kiln_op_paged_attention_page_tokens(128, 8, &pt));
    assert_int_equal(pt, 16);
    KILN_CHECK(kiln_op_paged_attention_page_tokens(64, 2, &pt));
    assert_int_equal(pt, 128);
    KILN_CHECK(kiln_op_paged_attention_page_tokens(128, 3, &pt));
    assert_int_equal(pt, 42); /* rounded down */
    KILN_CHECK(kiln_op_paged_attention_page_tokens(128, 128, &pt));
    assert_int_equal(pt, 1);
    KILN_EXPECT(kiln_op_paged_attention_page_tokens(128, 129, &pt), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "at least one token", "129");
    KILN_EXPECT(kiln_op_paged_attention_page_tokens(96, 8, &pt), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "head_dim 96", "64, 128, 256");
    KILN_EXPECT(kiln_op_paged_attention_page_tokens(64, 8, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL,
                NULL);
    kiln_spec s;
    KILN_EXPECT(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 128, 30, 8, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "heads 30", "kv_heads 8");
    KILN_EXPECT(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 80, 32, 8, 0, &s), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "head_dim 80", NULL);
    char text[256];
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 128, 28, 4, 1, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(s.template_id, "paged_decode");
    assert_string_equal(text, "BF16=0;HEADS=28;HEAD_DIM=128;KV_HEADS=4;PAGE_TOKENS=32");
    KILN_CHECK(kiln_op_paged_attention_spec(KILN_DTYPE_F16, 64, 14, 2, 0, &s));
    KILN_CHECK(kiln_spec_constants_text(&s, text, sizeof text));
    assert_string_equal(s.template_id, "paged_attention");
    assert_string_equal(text, "BF16=0;HEADS=14;HEAD_DIM=64;KV_HEADS=2;PAGE_TOKENS=128;ROWS=16");
    /* Workspace: no command needs one (decode splits over a cluster's shared memory). */
    size_t b = 1;
    static const int64_t ws_cases[][5] = {{100, 32, 8, 128, 100}, {1, 32, 8, 128, 2}, {1, 32, 8, 128, 1},
                                          {8, 32, 8, 128, 1},     {32, 32, 8, 128, 1}, {3, 28, 4, 128, 1},
                                          {1, 64, 2, 64, 1}};
    for (size_t i = 0; i < sizeof ws_cases / sizeof ws_cases[0]; i++) {
        b = 1;
        KILN_CHECK(kiln_op_paged_attention_workspace(ws_cases[i][0], ws_cases[i][1], ws_cases[i][2], ws_cases[i][3],
                                                     ws_cases[i][4], &b));
        assert_int_equal(b, 0);
    }
    KILN_EXPECT(kiln_op_paged_attention_workspace(0, 32, 8, 128, 1, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "0 sequences", NULL);
    KILN_EXPECT(kiln_op_paged_attention_workspace(65536, 32, 8, 128, 1, &b), KILN_ERR_RUNTIME_CONTRACT,
                kiln_errmsg(), "65536 sequences", "65535");
    KILN_EXPECT(kiln_op_paged_attention_workspace(1, 32, 8, 128, 0, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "0 new tokens", NULL);
    KILN_EXPECT(kiln_op_paged_attention_workspace(1, 30, 8, 128, 1, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "heads 30", NULL);
    KILN_EXPECT(kiln_op_paged_attention_workspace(1, 32, 8, 96, 1, &b), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "head_dim 96", NULL);
    KILN_EXPECT(kiln_op_paged_attention_workspace(1, 32, 8, 128, 1, NULL), KILN_ERR_INVALID_ARGUMENT,
                kiln_errmsg(), NULL, NULL);
}

/* ---- validation against fake buffers ---- */


static kiln_tensor view3(kiln_buffer *b, size_t offset, kiln_dtype dt, int64_t d0, int64_t d1, int64_t d2)
{
    kiln_tensor t = {.buffer = b, .offset = offset, .dtype = dt, .rank = d2 ? 3 : d1 ? 2 : 1, .dims = {d0, d1, d2}};
    return t;
}

typedef struct call {
    kiln_tensor q, k, v, pos, table, lens, spans, out;
    kiln_region pages;
    kiln_paged_attention_desc d;
} call;

static void link_call(call *c)
{
    c->d.q = &c->q;
    c->d.k = &c->k;
    c->d.v = &c->v;
    c->d.positions = &c->pos;
    c->d.block_table = &c->table;
    c->d.seq_lens = &c->lens;
    c->d.query_spans = &c->spans;
    c->d.out = &c->out;
    c->d.kv_pages = &c->pages;
}

/* c: a call of T tokens over S sequences (block tables of B pages) at
 * Llama-3-8B's heads (32 / 8, head_dim 128) in element type dt, its
 * bindings at fixed megabytes of buf, every page in kv, linked. */
static void call_at(call *c, kiln_buffer *buf, kiln_buffer *kv, kiln_dtype dt, int64_t T, int64_t S, int64_t B)
{
    const size_t MB = 1 << 20;
    const int64_t H = 32, KVH = 8, D = 128;
    memset(c, 0, sizeof *c);
    c->q = view3(buf, 0, dt, T, H, D);
    c->k = view3(buf, 4 * MB, dt, T, KVH, D);
    c->v = view3(buf, 5 * MB, dt, T, KVH, D);
    c->out = view3(buf, 8 * MB, dt, T, H, D);
    c->pos = view3(buf, 12 * MB, KILN_DTYPE_U32, T, 0, 0);
    c->table = view3(buf, 13 * MB, KILN_DTYPE_U32, S, B, 0);
    c->lens = view3(buf, 14 * MB, KILN_DTYPE_U32, S, 0, 0);
    c->spans = view3(buf, 15 * MB, KILN_DTYPE_U32, S, 2, 0);
    c->pages = (kiln_region){kv, 0, 64 * MB};
    c->d.rope_theta = 500000.0f;
    link_call(c);
}

static void test_validation_names_binding_and_values(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(0), *other = fake_runtime(0);
    const size_t MB = 1 << 20;
    kiln_buffer *buf = fake_buffer(rt, 64 * MB, KILN_DTYPE_BYTES), *kv = fake_buffer(rt, 64 * MB, KILN_DTYPE_BYTES),
                *foreign = fake_buffer(other, MB, KILN_DTYPE_BYTES);
    const int64_t T = 100, S = 3, B = 40;
    call c;
    call_at(&c, buf, kv, KILN_DTYPE_F16, T, S, B);
    kiln__paged_attention_info in;
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    assert_int_equal(in.pages, 1024);
    assert_int_equal(in.page_tokens, 16);
    assert_int_equal(in.max_query, 100);
    assert_int_equal(in.decode, 0);
    assert_int_equal(in.attention_tiles, (100 * 4 + 15) / 16);
    assert_int_equal(in.append_tiles, 25); /* tiles of 4 tokens */
    c.d.max_query_tokens = 1;
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    assert_int_equal(in.decode, 1);
    assert_int_equal(in.attention_tiles, 1);
    c.d.max_query_tokens = 101;
    KILN_EXPECT(kiln__paged_attention_check(rt, &c.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "max_query_tokens 101", "100 tokens");
    c.d.max_query_tokens = 0;

    call b = c;
    link_call(&b);
    b.k.dims[1] = 5;
    b.v.dims[1] = 5;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(rt),
                "binding k has 5 kv heads", "does not divide the 32 heads");
    b = c;
    link_call(&b);
    b.q.dims[2] = 96;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding q has head_dim 96", "64, 128, 256");
    b = c;
    link_call(&b);
    b.v.dims[0] = 99;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding v has dims [99, 8, 128]", "must be 100");
    b = c;
    link_call(&b);
    b.lens.dims[0] = 4;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding seq_lens has dims [4]", "must be 3");
    b = c;
    link_call(&b);
    b.spans.dims[1] = 3;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding query_spans has dims [3, 3]", "must be 2");
    b = c;
    link_call(&b);
    b.pos.dtype = KILN_DTYPE_I32;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding positions must be u32", "got i32");
    b = c;
    link_call(&b);
    b.pages.end = 64 * MB - 4096;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages has 67104768 bytes", "whole 65536-byte pages");
    b = c;
    link_call(&b);
    b.pages = (kiln_region){kv, 8, 8 + 65536};
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages starts at offset 8", "16-byte aligned");
    b = c;
    link_call(&b);
    b.out.offset = 8 * MB + 2; /* the kernels store out two halves at a time */
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "out starts at offset 8388610", "4-byte aligned");
    b = c;
    link_call(&b);
    b.pages = (kiln_region){kv, 0, 65 * MB};
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages [0, 68157440)", "past its buffer");
    b = c;
    link_call(&b);
    b.pages = (kiln_region){foreign, 0, 65536};
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages belongs to another runtime", NULL);
    b = c;
    link_call(&b);
    b.d.kv_pages = NULL;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages has no buffer", NULL);
    b = c;
    link_call(&b);
    b.pages = (kiln_region){buf, 4 * MB, 4 * MB + 65536}; /* over k */
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding kv_pages overlaps binding k", NULL);
    b = c;
    link_call(&b);
    b.out.offset = 12 * MB - 64;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out overlaps binding positions", NULL);
    b = c;
    link_call(&b);
    b.d.rope_theta = NAN;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "rope_theta",
                "nan");
    b.d.rope_theta = 0.0f;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "rope_theta",
                "got 0");
    b = c;
    link_call(&b);
    b.table.dims[1] = 0x10000000; /* 2^28 blocks of 16 tokens: 2^32 tokens */
    b.table.offset = 0;
    b.table.buffer = fake_buffer(rt, (size_t)3 << 30, KILN_DTYPE_BYTES);
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "268435456 blocks per sequence", "2^32 - 65 tokens");
    b.table.dims[1] = 0x10000000 - 3; /* 2^32 - 48 tokens: the key tiles' index would wrap */
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "268435453 blocks per sequence", "2^32 - 65 tokens");
    kiln_buffer *big_table = b.table.buffer;
    b = c;
    link_call(&b);
    b.d.q = NULL;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding q has no buffer", NULL);
    b = c;
    link_call(&b);
    b.d.size = 4;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "desc size 4",
                NULL);
    KILN_EXPECT(kiln__paged_attention_check(rt, NULL, &in), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "desc", NULL);
    /* head_dim 64 with 2 kv heads: 128 tokens a page. */
    b = c;
    link_call(&b);
    b.q = view3(buf, 0, KILN_DTYPE_F16, T, 14, 64);
    b.out = view3(buf, 8 * MB, KILN_DTYPE_F16, T, 14, 64);
    b.k = view3(buf, 4 * MB, KILN_DTYPE_F16, T, 2, 64);
    b.v = view3(buf, 5 * MB, KILN_DTYPE_F16, T, 2, 64);
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    assert_int_equal(in.page_tokens, 128);

    kiln_buffer *bufs[5] = {buf, kv, foreign, big_table, NULL};
    for (int i = 0; bufs[i]; i++)
        free(bufs[i]);
    fake_runtime_free(rt);
    fake_runtime_free(other);
}

/* The workspace (split-KV decode) and the fused q | k | v input. */
static void test_workspace_and_fused_qkv(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(0), *other = fake_runtime(0);
    const size_t MB = 1 << 20;
    kiln_buffer *buf = fake_buffer(rt, 64 * MB, KILN_DTYPE_BYTES), *kv = fake_buffer(rt, 64 * MB, KILN_DTYPE_BYTES),
                *wsb = fake_buffer(rt, 16 * MB, KILN_DTYPE_BYTES), *foreign = fake_buffer(other, 16 * MB, KILN_DTYPE_BYTES);
    const int64_t S = 8, H = 32, KVH = 8, D = 128, B = 64;
    call c;
    call_at(&c, buf, kv, KILN_DTYPE_F16, S, S, B);
    c.d.max_query_tokens = 1;
    kiln__paged_attention_info in;
    /* No workspace: the decode needs none (it splits over a cluster's shared memory). */
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    assert_int_equal(in.q_stride, H * D);
    assert_int_equal(in.kv_stride, KVH * D);
    size_t need = 1;
    KILN_CHECK(kiln_op_paged_attention_workspace(S, H, KVH, D, 1, &need));
    assert_int_equal(need, 0);
    /* One given anyway is checked, and left unused. */
    need = 4096;
    kiln_region ws = {wsb, 0, need};
    c.d.workspace = &ws;
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    assert_int_equal(in.bytes[10], need);
    c.d.max_query_tokens = 0;
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    c.d.max_query_tokens = 1;
    ws = (kiln_region){wsb, 64, 64 + need};
    KILN_EXPECT(kiln__paged_attention_check(rt, &c.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding workspace must start 256-byte aligned", "offset 64");
    ws = (kiln_region){foreign, 0, need};
    KILN_EXPECT(kiln__paged_attention_check(rt, &c.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding workspace belongs to another runtime", NULL);
    ws = (kiln_region){buf, 4 * MB, 4 * MB + need}; /* over k */
    KILN_EXPECT(kiln__paged_attention_check(rt, &c.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding workspace", "overlaps binding k");
    ws = (kiln_region){kv, 0, need}; /* over the pages */
    KILN_EXPECT(kiln__paged_attention_check(rt, &c.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding workspace", "overlaps binding kv_pages");
    ws = (kiln_region){NULL, 0, need};
    KILN_EXPECT(kiln__paged_attention_check(rt, &c.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding workspace has no buffer", NULL);
    ws = (kiln_region){wsb, 0, need};
    /* A desc of the size before workspace and qkv: neither is read. */
    c.d.size = (uint32_t)offsetof(kiln_paged_attention_desc, workspace);
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    assert_int_equal(in.bytes[10], 0);
    c.d.size = sizeof c.d;
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    assert_int_equal(in.bytes[10], need);
    /* One too small to be a size names the struct; a newer caller's larger
     * desc is read as far as this library knows it. */
    c.d.size = 1;
    KILN_EXPECT(kiln__paged_attention_check(rt, &c.d, &in), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_paged_attention_desc.size is 1", NULL);
    struct {
        kiln_paged_attention_desc d;
        uint64_t later;
    } newer = {c.d, UINT64_MAX};
    newer.d.size = sizeof newer;
    KILN_CHECK(kiln__paged_attention_check(rt, &newer.d, &in));
    assert_int_equal(in.bytes[10], need);
    c.d.size = sizeof c.d;

    /* Fused: qkv [S, (32 + 2 x 8) x 128], q, k and v NULL. */
    kiln_tensor qkv = view3(buf, 0, KILN_DTYPE_F16, S, (H + 2 * KVH) * D, 0);
    call f = c;
    link_call(&f);
    f.d.workspace = &ws;
    f.d.qkv = &qkv;
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv is given, so bindings q, k and v must be NULL", "(given: q k v)");
    f.d.q = f.d.v = NULL;
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv is given", "(given: k)");
    f.d.q = f.d.k = f.d.v = NULL;
    KILN_CHECK(kiln__paged_attention_check(rt, &f.d, &in));
    assert_int_equal(in.fused, 1);
    assert_int_equal(in.kv_heads, KVH);
    assert_int_equal(in.heads, H);
    assert_int_equal(in.q_stride, (H + 2 * KVH) * D);
    assert_int_equal(in.kv_stride, (H + 2 * KVH) * D);
    assert_int_equal(in.k_offset, H * D * 2);
    assert_int_equal(in.v_offset, (H + KVH) * D * 2);
    assert_int_equal(in.bytes[3], S * (H + 2 * KVH) * D * 2);
    qkv.dims[1] = (H + 2 * KVH) * D + 64;
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv has 6208 columns", "(heads 32 + 2 x kv_heads) x head_dim 128");
    qkv.dims[1] = (H + 2 * KVH + 1) * D; /* an odd number of k and v heads */
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv has 6272 columns", NULL);
    qkv.dims[1] = H * D; /* no k, no v */
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv has 4096 columns", NULL);
    qkv.dims[1] = (H + 2 * 5) * D; /* 5 kv heads */
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv has 5 kv heads", "does not divide the 32 heads of out");
    qkv.dims[1] = (H + 2 * KVH) * D;
    qkv.dims[0] = S + 1;
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv has dims [9, 6144]", "must be 8");
    qkv.dims[0] = S;
    qkv.dtype = KILN_DTYPE_F32;
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding qkv must be f16", NULL);
    qkv.dtype = KILN_DTYPE_F16;
    f.out.dims[2] = 96;
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out has head_dim 96", "64, 128, 256");
    f.out.dims[2] = D;
    f.out.offset = 64; /* over qkv */
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out overlaps binding qkv", NULL);
    f.out.offset = 8 * MB;
    ws = (kiln_region){buf, 0, need}; /* over qkv */
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding workspace", "overlaps binding qkv");
    ws = (kiln_region){wsb, 0, need};
    f.d.out = NULL;
    KILN_EXPECT(kiln__paged_attention_check(rt, &f.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out has no buffer", NULL);

    kiln_buffer *bufs[5] = {buf, kv, wsb, foreign, NULL};
    for (int i = 0; bufs[i]; i++)
        free(bufs[i]);
    fake_runtime_free(rt);
    fake_runtime_free(other);
}

/* bf16: every 16-bit binding and the page buffer of q's (qkv's) element
 * type, a mixed call refused naming the binding and both dtypes, bf16 refused
 * before sm_80; RoPE's rope_dim, rope_inv_freq and rope_attention_scaling. */
static void test_validation_bf16_and_rope(void **state)
{
    (void)state;
    kiln_runtime *rt = fake_runtime(0), *old = fake_runtime(0);
    snprintf(rt->info.arch, sizeof rt->info.arch, "sm_90");
    snprintf(old->info.arch, sizeof old->info.arch, "sm_75");
    const size_t MB = 1 << 20;
    kiln_buffer *buf = fake_buffer(rt, 64 * MB, KILN_DTYPE_BYTES), *kv = fake_buffer(rt, 64 * MB, KILN_DTYPE_BYTES),
                *kv16 = fake_buffer(rt, 64 * MB, KILN_DTYPE_F16), *kvb = fake_buffer(rt, 64 * MB, KILN_DTYPE_BF16),
                *kv32 = fake_buffer(rt, 64 * MB, KILN_DTYPE_F32), *obuf = fake_buffer(old, 64 * MB, KILN_DTYPE_BYTES),
                *okv = fake_buffer(old, 64 * MB, KILN_DTYPE_BYTES);
    const int64_t T = 100, H = 32, KVH = 8, D = 128, S = 3, B = 40;
    const kiln_dtype BF = KILN_DTYPE_BF16;
    call c;
    call_at(&c, buf, kv, BF, T, S, B);
    kiln__paged_attention_info in;
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    c.pages.buffer = kvb; /* a bf16 cache */
    KILN_CHECK(kiln__paged_attention_check(rt, &c.d, &in));
    call b = c;
    link_call(&b);
    b.k.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding k must be bf16", "got f16");
    b = c;
    link_call(&b);
    b.v.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding v must be bf16", "got f16");
    b = c;
    link_call(&b);
    b.out.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out must be bf16", "got f16");
    b = c;
    link_call(&b);
    b.pages.buffer = kv16; /* an f16 cache with bf16 q */
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages is a f16 buffer", "q is bf16");
    b.pages.buffer = kv32;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages is a f32 buffer", "q is bf16");
    /* f16 q, k, v and out with a bf16 cache. */
    b = c;
    link_call(&b);
    b.q.dtype = b.k.dtype = b.v.dtype = b.out.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "kv_pages is a bf16 buffer", "q is f16");
    b.pages.buffer = kv16;
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    /* f16 q with bf16 k: named by k. */
    b.k.dtype = BF;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding k must be f16", "got bf16");
    /* Fused: the element type is qkv's; out must have it. */
    b = c;
    link_call(&b);
    kiln_tensor qkv = view3(buf, 0, BF, T, (H + 2 * KVH) * D, 0);
    b.d.q = b.d.k = b.d.v = NULL;
    b.d.qkv = &qkv;
    b.out.offset = 16 * MB;
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    b.out.dtype = KILN_DTYPE_F16;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "binding out must be bf16", "got f16");
    /* Before sm_80: bf16 refused, naming the architecture. */
    b = c;
    b.q.buffer = b.k.buffer = b.v.buffer = b.out.buffer = b.pos.buffer = b.table.buffer = b.lens.buffer =
        b.spans.buffer = obuf;
    b.pages = (kiln_region){okv, 0, 64 * MB};
    link_call(&b);
    KILN_EXPECT(kiln__paged_attention_check(old, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_runtime_errmsg(old),
                "binding q is bf16", "sm_75");

    /* RoPE. */
    float inv[64];
    for (int i = 0; i < 64; i++)
        inv[i] = 1.0f / (float)(i + 1);
    b = c;
    link_call(&b);
    b.d.rope_inv_freq = inv;
    b.d.rope_attention_scaling = 1.3f;
    b.d.rope_dim = 64;
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    b.d.rope_dim = 2;
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    b.d.rope_dim = D;
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    static const int64_t bad_dims[] = {1, 63, -2, 130, 256};
    for (size_t i = 0; i < sizeof bad_dims / sizeof bad_dims[0]; i++) {
        b.d.rope_dim = bad_dims[i];
        char want[32];
        snprintf(want, sizeof want, "rope_dim %lld", (long long)bad_dims[i]);
        KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), want,
                    "even and in [2, head_dim 128]");
    }
    /* Only the first rope_dim / 2 frequencies are read and checked. */
    b.d.rope_dim = 64;
    inv[32] = NAN;
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    b.d.rope_dim = 0;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rope_inv_freq[32] must be a finite number > 0", "nan");
    inv[32] = 1.0f;
    inv[5] = 0.0f;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rope_inv_freq[5]", "got 0");
    inv[5] = -1.0f;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rope_inv_freq[5]", "got -1");
    inv[5] = INFINITY;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rope_inv_freq[5]", "inf");
    inv[5] = 0.5f;
    b.d.rope_attention_scaling = NAN;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rope_attention_scaling must be finite", "nan");
    b.d.rope_attention_scaling = INFINITY;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(),
                "rope_attention_scaling must be finite", "inf");
    b.d.rope_attention_scaling = 0.0f; /* 1 */
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    /* A desc of the size before the RoPE fields: none of them is read. */
    b.d.rope_attention_scaling = NAN;
    b.d.rope_dim = 3;
    b.d.size = (uint32_t)offsetof(kiln_paged_attention_desc, rope_inv_freq);
    KILN_CHECK(kiln__paged_attention_check(rt, &b.d, &in));
    b.d.size = sizeof b.d;
    KILN_EXPECT(kiln__paged_attention_check(rt, &b.d, &in), KILN_ERR_RUNTIME_CONTRACT, kiln_errmsg(), "rope_dim 3",
                NULL);

    kiln_buffer *bufs[8] = {buf, kv, kv16, kvb, kv32, obuf, okv, NULL};
    for (int i = 0; bufs[i]; i++)
        free(bufs[i]);
    fake_runtime_free(rt);
    fake_runtime_free(old);
}

static void test_offline_encode_needs_a_device(void **state)
{
    fixture *f = *state;
    kiln_paged_attention_desc d = {0};
    kiln_command *cmd = (kiln_command *)1;
    KILN_EXPECT(kiln_op_paged_attention_encode(f->jit, &d, &cmd), KILN_ERR_NO_DEVICE, kiln_errmsg(), "offline",
                NULL);
    assert_null(cmd);
    KILN_EXPECT(kiln_op_paged_attention(f->jit, &d), KILN_ERR_NO_DEVICE, kiln_errmsg(), "paged_attention", NULL);
    KILN_EXPECT(kiln_op_paged_attention_encode(NULL, &d, &cmd), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL,
                NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_lists_prefill_and_decode),
        cmocka_unit_test_setup_teardown(test_every_path_compiles_for_sm90, offline_fixture_setup, offline_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_head_dim_256_lists_and_compiles, offline_fixture_setup,
                                        offline_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_fallback_archs_list_the_two_kernel_decode, offline_fixture_setup,
                                        offline_fixture_teardown),
        cmocka_unit_test_setup_teardown(test_bf16_specs_listed_and_compiled, offline_fixture_setup,
                                        offline_fixture_teardown),
        cmocka_unit_test(test_spec_and_page_arguments),
        cmocka_unit_test(test_validation_names_binding_and_values),
        cmocka_unit_test(test_workspace_and_fused_qkv),
        cmocka_unit_test(test_validation_bf16_and_rope),
        cmocka_unit_test_setup_teardown(test_offline_encode_needs_a_device, offline_fixture_setup, offline_fixture_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
