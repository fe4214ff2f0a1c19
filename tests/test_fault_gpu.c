/* A kernel that faults on purpose (an illegal address): the process
 * survives, the error comes back with its stable code, every later call on
 * that runtime returns an error instead of crashing or hanging, and after the
 * runtime is destroyed a new one works.
 *
 * The CUDA driver makes such a fault sticky for the whole process ("the
 * process must be terminated and relaunched"; seen with driver 580: even a
 * fresh cuDevicePrimaryCtxRetain returns CUDA_ERROR_ILLEGAL_ADDRESS). So the
 * fault happens in a child process, which checks that everything after it
 * fails cleanly, a new runtime included; then this process, which had not
 * touched CUDA, makes a new runtime and runs a kernel from the database. */
#include <sys/wait.h>

#include "embedding_check.h"
#include "runtime/internal.h"

typedef struct bad_launch {
    kiln_runtime *rt;
    CUfunction fn;
    CUdeviceptr ids, out;
} bad_launch;

static kiln_status enqueue_bad(void *user, const kiln_launch_context *ctx)
{
    bad_launch *l = user;
    CUdeviceptr table = 0x10; /* nothing is mapped there */
    CUdeviceptr fault = (CUdeviceptr)kiln_launch_fault_record(ctx);
    unsigned base = 0;
    void *args[] = {&table, &l->ids, &l->out, &base, &fault};
    return kiln__launch(ctx, l->rt, l->fn, 64, 32, 0, args);
}

static void fault_in_child(const char *path)
{
    kiln_cache *cache;
    kiln_cache_options co = {.path = path};
    KILN_CHECK(kiln_cache_open(&co, &cache));
    kiln_runtime *rt;
    KILN_CHECK(kiln_runtime_create(NULL, &rt));
    kiln_jit_options jo = {.cache = cache, .runtime = rt};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    kiln_spec spec;
    KILN_CHECK(kiln_op_token_embedding_spec(KILN_DTYPE_F16, 1000, 64, 8, &spec));
    kiln_kernel *k;
    void *fn;
    KILN_CHECK(kiln_jit_acquire(jit, &spec, &k));
    KILN_CHECK(kiln_kernel_function(k, NULL, &fn));
    kiln_buffer *ids, *out;
    KILN_CHECK(kiln_buffer_create(rt, 64 * 4, 0, &ids));
    KILN_CHECK(kiln_buffer_create(rt, 64 * 64 * 2, 0, &out));
    KILN_CHECK(kiln_buffer_fill(ids, 0, 0, 64 * 4));
    bad_launch l = {rt, (CUfunction)fn, kiln__buffer_ptr(ids), kiln__buffer_ptr(out)};
    kiln_region r = {out, 0, 64 * 64 * 2};
    kiln_command_desc d = {.op_id = "test.illegal_address", .regions = &r, .n_regions = 1, .enqueue = enqueue_bad,
                           .user = &l, .dispatches = 1};
    kiln_command *cmd;
    KILN_CHECK(kiln_command_create(rt, &d, &cmd));
    kiln_stream *s = kiln_runtime_stream(rt);
    kiln_fence *fence = NULL;
    kiln_status st = kiln_stream_submit(s, &cmd, 1, NULL, &fence);
    if (st == KILN_OK)
        st = kiln_fence_wait(fence);
    KILN_EXPECT(st, KILN_ERR_CUDA_ILLEGAL_ADDRESS, kiln_errmsg(), "CUDA_ERROR_ILLEGAL_ADDRESS", NULL);
    assert_string_equal(kiln_status_code(st), "cuda_illegal_address");
    assert_false(kiln_status_retryable(st));
    fprintf(stderr, "the fault: %s\n", kiln_errmsg());
    if (fence) {
        kiln_fence_state fs;
        KILN_CHECK(kiln_fence_query(fence, &fs));
        assert_int_equal(fs, KILN_FENCE_INDETERMINATE);
    }
    /* Every later call on the runtime fails, quickly, with the same code. */
    kiln_buffer *more = NULL;
    KILN_EXPECT(kiln_buffer_create(rt, 1024, 0, &more), KILN_ERR_CUDA_ILLEGAL_ADDRESS, kiln_errmsg(),
                "failed earlier", NULL);
    assert_null(more);
    KILN_EXPECT(kiln_stream_submit(s, &cmd, 1, NULL, NULL), KILN_ERR_CUDA_ILLEGAL_ADDRESS, kiln_errmsg(), NULL,
                NULL);
    assert_int_equal(kiln_runtime_synchronize(rt), KILN_ERR_CUDA_ILLEGAL_ADDRESS);
    uint8_t byte;
    assert_int_equal(kiln_buffer_readback(out, 0, &byte, 1), KILN_ERR_CUDA_ILLEGAL_ADDRESS);
    kiln_stream *s2 = NULL;
    assert_int_equal(kiln_stream_create(rt, &s2), KILN_ERR_CUDA_ILLEGAL_ADDRESS);
    kiln_fence_release(fence);
    kiln_command_release(cmd);
    kiln_buffer_destroy(ids);
    kiln_buffer_destroy(out);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);

    /* In this process nothing works any more, and says so. */
    KILN_EXPECT(kiln_runtime_create(NULL, &rt), KILN_ERR_CUDA_ILLEGAL_ADDRESS, kiln_errmsg(), "restart the process",
                NULL);
    assert_null(rt);
    kiln_cache_close(cache);
}

static void test_fault_breaks_only_that_runtime(void **state)
{
    (void)state;
    char dir[512], path[600];
    kiln_test_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/kernels.db", dir);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        fault_in_child(path);
        _exit(0); /* a failed check in the child exits nonzero through cmocka */
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_msg("the faulting child ended with status 0x%x", status);

    /* A new runtime, in a process the fault did not touch. */
    kiln_cache *cache;
    kiln_cache_options co = {.path = path};
    KILN_CHECK(kiln_cache_open(&co, &cache));
    kiln_runtime *rt;
    KILN_CHECK(kiln_runtime_create(NULL, &rt));
    kiln_jit_options jo = {.cache = cache, .runtime = rt};
    kiln_jit *jit;
    KILN_CHECK(kiln_jit_create(&jo, &jit));
    /* The kernel the child compiled comes from the database. */
    kiln_rng rng = kiln_rng_new();
    emb_case c = {1000, 64, 64, 0, 0, UINT32_MAX};
    KILN_CHECK(run_embedding_case(rt, jit, &rng, &c));
    kiln_jit_counters jc;
    kiln_jit_get_counters(jit, &jc);
    assert_int_equal(jc.compiles, 0);
    kiln_jit_destroy(jit);
    kiln_runtime_destroy(rt);
    kiln_cache_close(cache);
    kiln_test_rmrf(dir);
}

int main(void)
{
    /* Probe for a GPU in a child: CUDA must not be initialized before the fork. */
    pid_t pid = fork();
    if (pid == 0) {
        const char *why = NULL;
        int ok = kiln_driver_available(&why);
        if (!ok)
            printf("SKIP: no GPU: %s\n", why ? why : "?");
        fflush(stdout);
        _exit(ok ? 0 : KILN_TEST_SKIP);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
        return 1;
    if (WEXITSTATUS(status) == KILN_TEST_SKIP)
        return KILN_TEST_SKIP;
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_fault_breaks_only_that_runtime)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
