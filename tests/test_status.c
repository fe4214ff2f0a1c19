/* Status codes: stable strings, retryable flags, messages per thread and per object. */
#include "common/internal.h"
#include "testutil.h"

static void test_codes_are_pinned(void **state)
{
    (void)state;
    /* Values and code strings are API: a change here breaks users. */
    assert_int_equal(KILN_OK, 0);
    assert_string_equal(kiln_status_code(KILN_OK), "ok");
    assert_string_equal(kiln_status_code(KILN_ERR_CUDA_OUT_OF_MEMORY), "cuda_out_of_memory");
    assert_string_equal(kiln_status_code(KILN_ERR_CUDA_ILLEGAL_ADDRESS), "cuda_illegal_address");
    assert_string_equal(kiln_status_code(KILN_ERR_CUDA_INVALID_CONTEXT), "cuda_invalid_context");
    assert_string_equal(kiln_status_code(KILN_ERR_CUDA_DRIVER), "cuda_driver_error");
    assert_string_equal(kiln_status_code(KILN_ERR_CUDA_BLAS), "cuda_blas_error");
    assert_string_equal(kiln_status_code(KILN_ERR_RUNTIME_CONTRACT), "runtime_contract");
    assert_string_equal(kiln_status_code(KILN_ERR_NVRTC_COMPILE), "nvrtc_compile_error");
    assert_string_equal(kiln_status_code(KILN_ERR_CACHE_CORRUPT), "cache_corrupt");
    assert_string_equal(kiln_status_code(KILN_ERR_NO_DEVICE), "no_device");
    assert_int_equal(KILN_ERR_CACHE_CORRUPT, 12);
    assert_int_equal(KILN_ERR_UNSUPPORTED, 20);
    assert_int_equal(KILN_ERR_JIT_DISABLED, 21);
    assert_string_equal(kiln_status_code(KILN_ERR_JIT_DISABLED), "jit_disabled");
}

static void test_every_status_has_text(void **state)
{
    (void)state;
    for (int s = 0; s <= KILN_ERR_JIT_DISABLED; s++) {
        assert_non_null(kiln_status_string((kiln_status)s));
        assert_true(strlen(kiln_status_code((kiln_status)s)) > 1);
        assert_string_not_equal(kiln_status_code((kiln_status)s), "unknown");
    }
    assert_string_equal(kiln_status_code((kiln_status)9999), "unknown");
    assert_string_equal(kiln_status_code((kiln_status)-1), "unknown");
}

static void test_retryable(void **state)
{
    (void)state;
    assert_true(kiln_status_retryable(KILN_ERR_CUDA_OUT_OF_MEMORY));
    assert_true(kiln_status_retryable(KILN_ERR_CACHE_BUSY));
    assert_false(kiln_status_retryable(KILN_ERR_CUDA_ILLEGAL_ADDRESS));
    assert_false(kiln_status_retryable(KILN_ERR_NVRTC_COMPILE));
    assert_false(kiln_status_retryable(KILN_OK));
    assert_false(kiln_status_retryable(KILN_ERR_JIT_DISABLED)); /* only a prewarm makes it succeed */
}

static void test_messages(void **state)
{
    (void)state;
    kiln__errslot slot;
    kiln__errslot_init(&slot);
    char big[6000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    assert_int_equal(kiln__fail(&slot, KILN_ERR_IO, "file %s: %d", "a", 7), KILN_ERR_IO);
    assert_string_equal(kiln_errmsg(), "file a: 7");
    assert_string_equal(slot.msg, "file a: 7");
    /* A long message (an NVRTC log) is whole per thread, truncated in the slot. */
    kiln__fail(&slot, KILN_ERR_NVRTC_COMPILE, "%s", big);
    assert_int_equal(strlen(kiln_errmsg()), sizeof big - 1);
    assert_int_equal(strlen(slot.msg), KILN__ERRSLOT_CAP - 1);
    kiln__errslot_destroy(&slot);
}

static void test_version(void **state)
{
    (void)state;
    assert_int_equal(kiln_version_number(), KILN_VERSION_NUMBER);
    assert_string_equal(kiln_version_string(), KILN_VERSION_STRING);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codes_are_pinned), cmocka_unit_test(test_every_status_has_text),
        cmocka_unit_test(test_retryable),        cmocka_unit_test(test_messages),
        cmocka_unit_test(test_version),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
