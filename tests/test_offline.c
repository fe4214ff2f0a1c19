/* Without a driver: everything that needs a device says so; nothing crashes. */
#include "testutil.h"

static void test_no_device_is_a_clear_error(void **state)
{
    (void)state;
    const char *why = NULL;
    if (kiln_driver_available(&why)) {
        skip(); /* a machine with a GPU: the GPU tests cover it */
        return;
    }
    assert_non_null(why);
    kiln_runtime *rt = (kiln_runtime *)1;
    KILN_EXPECT(kiln_runtime_create(NULL, &rt), KILN_ERR_NO_DEVICE, kiln_errmsg(), "no device", NULL);
    assert_null(rt);
    kiln_runtime_options o = {.device_ordinal = 3};
    assert_int_equal(kiln_runtime_create(&o, &rt), KILN_ERR_NO_DEVICE);
    kiln_runtime_destroy(NULL);
    kiln_buffer_destroy(NULL);
    assert_int_equal(kiln_runtime_synchronize(NULL), KILN_ERR_INVALID_ARGUMENT);
    kiln_buffer *b;
    assert_int_equal(kiln_buffer_create(NULL, 16, 0, &b), KILN_ERR_INVALID_ARGUMENT);
}

static void test_ops_offline(void **state)
{
    (void)state;
    kiln_jit_options jo = {.arch = "sm_90"};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    kiln_tensor t = {0};
    KILN_EXPECT(kiln_op_token_embedding(jit, &t, &t, &t), KILN_ERR_NO_DEVICE, kiln_errmsg(), "offline", NULL);
    assert_int_equal(kiln_op_token_embedding(NULL, &t, &t, &t), KILN_ERR_INVALID_ARGUMENT);
    kiln_jit_destroy(jit);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_device_is_a_clear_error),
        cmocka_unit_test(test_ops_offline),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
