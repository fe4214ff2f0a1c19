/* Fingerprints: stable across processes, sensitive to every part, blind to option order. */
#include <inttypes.h>

#include "jit/internal.h"
#include "testutil.h"

static kiln__embedded_file src = {"t.cu", "#include \"h.cuh\"\n__global__ void k() {}\n", 40};
static kiln__embedded_file hdr = {"h.cuh", "#pragma once\n", 13};

static void make_template(kiln__template *t)
{
    memset(t, 0, sizeof *t);
    strcpy(t->id, "t");
    t->source = &src;
    t->n_headers = 1;
    t->headers[0] = &hdr;
}

static void make_spec(kiln_spec *s)
{
    KILN_CHECK(kiln_spec_init(s, "t"));
    KILN_CHECK(kiln_spec_set(s, "HIDDEN", 4096));
    KILN_CHECK(kiln_spec_set(s, "VOCAB", 128256));
}

static void fp_of(const kiln__template *t, const kiln_spec *s, const char *const *opts, size_t n_opts,
                  const char *arch, int major, int minor, uint8_t out[32])
{
    kiln__nvrtc_options o;
    KILN_CHECK(kiln__options_normalize(opts, n_opts, &o));
    KILN_CHECK(kiln__fingerprint(t, s, &o, arch, major, minor, out));
    kiln__options_free(&o);
}

static void test_every_part_changes_the_key(void **state)
{
    (void)state;
    kiln__template t;
    kiln_spec s;
    uint8_t base[32], other[32];
    const char *opts[] = {"-lineinfo"};
    make_template(&t);
    make_spec(&s);
    fp_of(&t, &s, opts, 1, "sm_90", 13, 0, base);

    /* The same inputs give the same key. */
    fp_of(&t, &s, opts, 1, "sm_90", 13, 0, other);
    assert_memory_equal(base, other, 32);

    kiln__template t2 = t;
    strcpy(t2.id, "u");
    fp_of(&t2, &s, opts, 1, "sm_90", 13, 0, other);
    assert_memory_not_equal(base, other, 32); /* template id */

    kiln__embedded_file src2 = src;
    src2.data = "#include \"h.cuh\"\n__global__ void k() {;}\n";
    src2.size = strlen(src2.data);
    t2 = t;
    t2.source = &src2;
    fp_of(&t2, &s, opts, 1, "sm_90", 13, 0, other);
    assert_memory_not_equal(base, other, 32); /* template bytes */

    kiln__embedded_file hdr2 = hdr;
    hdr2.data = "#pragma once \n";
    hdr2.size = strlen(hdr2.data);
    t2 = t;
    t2.headers[0] = &hdr2;
    fp_of(&t2, &s, opts, 1, "sm_90", 13, 0, other);
    assert_memory_not_equal(base, other, 32); /* header bytes */

    kiln_spec s2 = s;
    KILN_CHECK(kiln_spec_set(&s2, "HIDDEN", 4097));
    fp_of(&t, &s2, opts, 1, "sm_90", 13, 0, other);
    assert_memory_not_equal(base, other, 32); /* a constant's value */

    s2 = s;
    KILN_CHECK(kiln_spec_set(&s2, "EXTRA", 0));
    fp_of(&t, &s2, opts, 1, "sm_90", 13, 0, other);
    assert_memory_not_equal(base, other, 32); /* one more constant */

    const char *opts2[] = {"-lineinfo", "--use_fast_math"};
    fp_of(&t, &s, opts2, 2, "sm_90", 13, 0, other);
    assert_memory_not_equal(base, other, 32); /* options */

    fp_of(&t, &s, opts, 1, "sm_89", 13, 0, other);
    assert_memory_not_equal(base, other, 32); /* architecture */

    fp_of(&t, &s, opts, 1, "sm_90", 13, 1, other);
    assert_memory_not_equal(base, other, 32); /* NVRTC version */
}

static void test_option_order_and_blanks_do_not_matter(void **state)
{
    (void)state;
    kiln__template t;
    kiln_spec s;
    uint8_t a[32], b[32];
    make_template(&t);
    make_spec(&s);
    const char *o1[] = {"-lineinfo", "--use_fast_math", "-DX=1"};
    const char *o2[] = {" -DX=1", "--use_fast_math ", "-lineinfo", "-lineinfo"};
    fp_of(&t, &s, o1, 3, "sm_90", 13, 0, a);
    fp_of(&t, &s, o2, 4, "sm_90", 13, 0, b);
    assert_memory_equal(a, b, 32);
}

static void test_constant_order_does_not_matter(void **state)
{
    (void)state;
    kiln_spec a, b;
    KILN_CHECK(kiln_spec_init(&a, "t"));
    KILN_CHECK(kiln_spec_set(&a, "A", 1));
    KILN_CHECK(kiln_spec_set(&a, "B", 2));
    KILN_CHECK(kiln_spec_init(&b, "t"));
    KILN_CHECK(kiln_spec_set(&b, "B", 2));
    KILN_CHECK(kiln_spec_set(&b, "A", 1));
    assert_memory_equal(&a, &b, sizeof a);
    char text[128];
    KILN_CHECK(kiln_spec_constants_text(&a, text, sizeof text));
    assert_string_equal(text, "A=1;B=2");
}

static void test_bad_options_and_names_refused(void **state)
{
    (void)state;
    kiln__nvrtc_options o;
    const char *bad1[] = {"--gpu-architecture=sm_80"};
    const char *bad2[] = {"lineinfo"};
    const char *bad3[] = {"   "};
    KILN_EXPECT(kiln__options_normalize(bad1, 1, &o), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                     "--gpu-architecture=sm_80", NULL);
    KILN_EXPECT(kiln__options_normalize(bad2, 1, &o), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "lineinfo",
                     NULL);
    KILN_EXPECT(kiln__options_normalize(bad3, 1, &o), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
    kiln_spec s;
    KILN_CHECK(kiln_spec_init(&s, "t"));
    KILN_EXPECT(kiln_spec_set(&s, "lower", 1), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "lower", NULL);
    KILN_EXPECT(kiln_spec_set(&s, "9X", 1), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "9X", NULL);
    for (int i = 0; i < KILN_SPEC_MAX_CONSTANTS; i++) {
        char name[8];
        snprintf(name, sizeof name, "C%d", i);
        KILN_CHECK(kiln_spec_set(&s, name, i));
    }
    KILN_EXPECT(kiln_spec_set(&s, "ONE_TOO_MANY", 1), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "constants",
                     NULL);
    KILN_EXPECT(kiln__arch_check("sm_9"), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "sm_9", NULL);
    KILN_EXPECT(kiln__arch_check("compute_90"), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), NULL, NULL);
    KILN_EXPECT(kiln__arch_check("sm_10"), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "not supported", "90");
    KILN_CHECK(kiln__arch_check("sm_90a"));
    KILN_CHECK(kiln__arch_check("sm_100"));
}

/* The real embedding spec's key, as hex, through the public API. */
static void real_key(char hex[65])
{
    kiln_jit_options jo = {.arch = "sm_90"};
    kiln_jit *jit;
    kiln_spec s;
    uint8_t fp[32];
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 128256, 4096, 8, &s));
    KILN_CHECK(kiln_jit_fingerprint(jit, &s, fp));
    kiln_fingerprint_hex(fp, hex);
    kiln_jit_destroy(jit);
}

static void test_same_key_in_another_process(void **state)
{
    (void)state;
    char mine[65], theirs[80] = "", cmd[4200];
    real_key(mine);
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    assert_true(n > 0);
    self[n] = 0;
    snprintf(cmd, sizeof cmd, "'%s' --print-key", self);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    assert_non_null(fgets(theirs, sizeof theirs, p));
    assert_int_equal(pclose(p), 0);
    theirs[strcspn(theirs, "\n")] = 0;
    assert_string_equal(mine, theirs);
    uint8_t parsed[32], again[32];
    KILN_CHECK(kiln_fingerprint_parse(mine, parsed));
    char hex2[65];
    kiln_fingerprint_hex(parsed, hex2);
    assert_string_equal(hex2, mine);
    assert_int_equal(kiln_fingerprint_parse("zz", again), KILN_ERR_INVALID_ARGUMENT);
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--print-key")) {
        char hex[65];
        real_key(hex);
        printf("%s\n", hex);
        return 0;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_part_changes_the_key),
        cmocka_unit_test(test_option_order_and_blanks_do_not_matter),
        cmocka_unit_test(test_constant_order_does_not_matter),
        cmocka_unit_test(test_bad_options_and_names_refused),
        cmocka_unit_test(test_same_key_in_another_process),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
