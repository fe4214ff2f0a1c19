/* The sm_90a kernels (warpgroup MMA) as ptxas builds them: no wgmma that ptxas
 * serializes or fences on its own. A wgmma in a branch of its loop, or
 * accumulators touched between products, compile and run correctly but make
 * ptxas wait for each product before the next ("Potential Performance Loss",
 * C7518) or insert warpgroup.arrive (C7519): a kernel slower by a large
 * factor that no correctness test sees. Every arch-specific specialization
 * that prewarm lists for sm_90 for these models is compiled by NVRTC with
 * --ptxas-options=-v and its report read. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit/internal.h"
#include "testutil.h"

/* Lines of the report that say ptxas serialized or fenced wgmma itself. */
static int report_clean(const char *log, const char *what)
{
    int clean = 1;
    for (const char *l = log; l && *l;) {
        const char *end = strchr(l, '\n');
        size_t n = end ? (size_t)(end - l) : strlen(l);
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line - 1 ? n : sizeof line - 1), l);
        if (strstr(line, "Potential Performance Loss") || strstr(line, "warpgroup.arrive is injected")) {
            fprintf(stderr, "%s: %s\n", what, line);
            clean = 0;
        }
        l = end ? end + 1 : l + n;
    }
    return clean;
}

/* Compiles the model's arch-specific specializations for sm_90; returns how many. */
static size_t check_model(const kiln_model_config *c, const char *name)
{
    kiln_spec *specs;
    size_t n, compiled = 0;
    KILN_CHECK(kiln_model_specializations_for_arch(c, "sm_90", &specs, &n));
    const char *opt[] = {"--ptxas-options=-v"};
    kiln__nvrtc_options o;
    KILN_CHECK(kiln__options_normalize(opt, 1, &o));
    int clean = 1;
    for (size_t i = 0; i < n; i++) {
        const kiln__template *t;
        KILN_CHECK(kiln__template_find(specs[i].template_id, &t));
        if (!t->arch_specific)
            continue;
        void *cubin;
        size_t size;
        char *log, consts[1024], what[1200];
        KILN_CHECK(kiln__compile_logged(t, &specs[i], &o, "sm_90", &cubin, &size, &log));
        kiln_spec_constants_text(&specs[i], consts, sizeof consts);
        snprintf(what, sizeof what, "%s, %s %s", name, specs[i].template_id, consts);
        /* The report is there: one "Used N registers" line an entry. */
        assert_non_null(strstr(log, "registers"));
        clean &= report_clean(log, what);
        free(log);
        free(cubin);
        compiled++;
    }
    kiln__options_free(&o);
    kiln_free(specs);
    assert_true(clean);
    return compiled;
}

/* The prefill attention at head_dim 128, 64 and 256, f16 and bf16. */
static void test_prefill_attention(void **state)
{
    (void)state;
    kiln_model_config c;
    kiln_model_config_default(&c);
    assert_true(check_model(&c, "llama-3-8b f16") >= 1);
    c.head_dim = 64;
    c.dtype = KILN_DTYPE_BF16;
    assert_true(check_model(&c, "head_dim 64 bf16") >= 1);
    c.head_dim = 256;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 4;
    c.dtype = KILN_DTYPE_F16;
    assert_true(check_model(&c, "head_dim 256 f16") >= 1);
}

/* Qwen3-30B-A3B's experts (bf16) and a small f16 mixture: the wgmma expert
 * products beside the prefill attention. */
static void test_experts(void **state)
{
    (void)state;
    kiln_model_config c;
    KILN_CHECK(kiln_model_config_load(KILN_TEST_DATA_DIR "/qwen3-30b-a3b.json", &c));
    assert_true(check_model(&c, "qwen3-30b-a3b bf16") >= 2);
    KILN_CHECK(kiln_model_config_load(KILN_TEST_DATA_DIR "/mixtral-8x7b-v0.1.json", &c));
    c.dtype = KILN_DTYPE_F16;
    assert_true(check_model(&c, "mixtral-8x7b f16") >= 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefill_attention),
        cmocka_unit_test(test_experts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
