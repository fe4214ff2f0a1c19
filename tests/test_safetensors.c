/* kiln_safetensors: a valid file read back, and every kind of bad input
 * refused with a message naming the tensor and the values, never a crash. */
#include <fcntl.h>
#include <sys/stat.h>

#include "testutil.h"
#include "kiln/safetensors.h"
#include "st_writer.h"

static st_entry ent(const char *name, const char *dtype, int rank, long long d0, long long d1)
{
    st_entry e;
    memset(&e, 0, sizeof e);
    snprintf(e.name, sizeof e.name, "%s", name);
    e.dtype = dtype;
    e.rank = rank;
    e.dims[0] = d0;
    e.dims[1] = d1;
    return e;
}

static void fill_index(void *user, size_t index, void *dst, size_t bytes)
{
    (void)user;
    memset(dst, (int)(index + 1), bytes);
}

/* Parses bytes and expects st; the message must contain each of the strings. */
static void expect_refused(const void *data, size_t size, kiln_status want, const char *a, const char *b,
                           const char *c)
{
    kiln_safetensors *st = (kiln_safetensors *)1;
    kiln_status s = kiln_safetensors_parse(data, size, "t.safetensors", &st);
    const char *msg = kiln_errmsg();
    if (s != want || st != NULL)
        fail_msg("status %s (want %s), message: %s", kiln_status_code(s), kiln_status_code(want), msg);
    const char *need[3] = {a, b, c};
    for (int i = 0; i < 3; i++)
        if (need[i] && !strstr(msg, need[i]))
            fail_msg("message \"%s\" lacks \"%s\"", msg, need[i]);
}

static uint8_t *with_header(const char *json, size_t data_bytes, size_t *size)
{
    size_t n = strlen(json);
    uint8_t *f = calloc(1, 8 + n + data_bytes + 1);
    for (int i = 0; i < 8; i++)
        f[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(f + 8, json, n);
    *size = 8 + n + data_bytes;
    return f;
}

static void test_valid_file(void **state)
{
    (void)state;
    st_entry e[3] = {ent("b.weight", NULL, 2, 3, 4), ent("a.bias", "F32", 1, 5, 0), ent("scalar", NULL, 0, 0, 0)};
    size_t size;
    uint8_t *f = st_build(e, 3, "{\"format\":\"pt\"}", fill_index, NULL, &size);
    kiln_safetensors *st;
    KILN_CHECK(kiln_safetensors_parse(f, size, "mem", &st));
    assert_int_equal(kiln_safetensors_count(st), 3);
    assert_string_equal(kiln_safetensors_at(st, 0)->name, "a.bias"); /* sorted by name */
    const kiln_safetensors_tensor *t = kiln_safetensors_find(st, "b.weight");
    assert_non_null(t);
    assert_int_equal(t->dtype, KILN_DTYPE_F16);
    assert_string_equal(t->dtype_name, "F16");
    assert_int_equal(t->rank, 2);
    assert_int_equal(t->dims[0], 3);
    assert_int_equal(t->dims[1], 4);
    assert_int_equal(t->elements, 12);
    assert_int_equal(t->bytes, 24);
    assert_int_equal(((const uint8_t *)t->data)[0], 1);
    assert_ptr_equal(t->data, f + t->offset);
    t = kiln_safetensors_find(st, "a.bias");
    assert_int_equal(t->dtype, KILN_DTYPE_F32);
    assert_int_equal(((const uint8_t *)t->data)[19], 2);
    t = kiln_safetensors_find(st, "scalar");
    assert_int_equal(t->rank, 0);
    assert_int_equal(t->elements, 1);
    assert_null(kiln_safetensors_find(st, "__metadata__"));
    assert_null(kiln_safetensors_find(st, "c"));
    const int64_t dims[2] = {3, 4};
    KILN_CHECK(kiln_safetensors_expect(st, "b.weight", KILN_DTYPE_F16, 2, dims, &t));
    assert_string_equal(t->name, "b.weight");
    kiln_safetensors_close(st);
    kiln_safetensors_close(NULL);
    free(f);
}

static void test_truncated(void **state)
{
    (void)state;
    uint8_t small[5] = {0};
    expect_refused(small, sizeof small, KILN_ERR_CONFIG, "t.safetensors", "truncated", "5 bytes");
    expect_refused(NULL, 0, KILN_ERR_CONFIG, "truncated", "0 bytes", NULL);
    /* Every prefix of a valid file is refused, none crashes. */
    st_entry e[2] = {ent("x", NULL, 2, 4, 4), ent("y", NULL, 1, 8, 0)};
    size_t size;
    uint8_t *f = st_build(e, 2, NULL, NULL, NULL, &size);
    for (size_t n = 0; n < size; n++) {
        uint8_t *copy = malloc(n ? n : 1);
        memcpy(copy, f, n);
        kiln_safetensors *st = NULL;
        kiln_status s = kiln_safetensors_parse(copy, n, "t", &st);
        assert_int_equal(s, KILN_ERR_CONFIG);
        assert_null(st);
        free(copy);
    }
    free(f);
}

static void test_header_length_past_file(void **state)
{
    (void)state;
    size_t size;
    uint8_t *f = with_header("{}", 0, &size);
    f[0] = 200; /* 200 bytes of header, 2 in the file */
    expect_refused(f, size, KILN_ERR_CONFIG, "header length 200", "past the end", "2 bytes");
    memset(f, 0xff, 8);
    expect_refused(f, size, KILN_ERR_CONFIG, "header length 18446744073709551615", "past the end", NULL);
    free(f);
    /* Within the file but above the limit. */
    size_t big = (size_t)KILN_SAFETENSORS_MAX_HEADER + 16;
    uint8_t *g = calloc(1, big + 8);
    uint64_t n = big;
    for (int i = 0; i < 8; i++)
        g[i] = (uint8_t)(n >> (8 * i));
    g[8] = '{';
    expect_refused(g, big + 8, KILN_ERR_CONFIG, "exceeds", NULL, NULL);
    free(g);
}

static void test_bad_json(void **state)
{
    (void)state;
    const char *cases[][2] = {
        {"{\"a\":{\"dtype\":\"F16\",", "not JSON"},
        {"[1,2,3]", "does not start with '{'"},
        {"{} x", "follows the header"},
        {"{\"a\":3}", "not an object"},
        {"{\"a\":{\"dtype\":7,\"shape\":[],\"data_offsets\":[0,2]}}", "dtype 7 is not a string"},
        {"{\"a\":{\"dtype\":\"F17\",\"shape\":[],\"data_offsets\":[0,2]}}", "unknown dtype \"F17\""},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":7,\"data_offsets\":[0,2]}}", "shape 7 is not an array"},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":[-1],\"data_offsets\":[0,2]}}", "dimension 0 = -1"},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":[1.5],\"data_offsets\":[0,2]}}", "dimension 0 = 1.5"},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,2]}}", "rank 9 exceeds 8"},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,2]}}", "overflows"},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0]}}", "data_offsets [0] is not two"},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":[1]}}", "data_offsets (missing)"},
        {"{\"__metadata__\":3}", "__metadata__ is not an object"},
        {"{\"\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}}", "empty name"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t size;
        uint8_t *f = with_header(cases[i][0], 16, &size);
        expect_refused(f, size, KILN_ERR_CONFIG, cases[i][1], NULL, NULL);
        free(f);
    }
}

static void test_offsets(void **state)
{
    (void)state;
    size_t size;
    /* shape [3] F16 = 6 bytes, but the offsets hold 8 */
    uint8_t *f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "tensor w", "hold 8 bytes", "3 elements of F16 need 6");
    free(f);
    f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[4,12]}}", 10, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "tensor w", "[4, 12] out of range", "holds 10 bytes");
    free(f);
    f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[0],\"data_offsets\":[6,4]}}", 10, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "tensor w", "[6, 4]", NULL);
    free(f);
    f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]},"
                    "\"v\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[6,14]}}",
                    16, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "tensors w [0, 8) and v [6, 14) overlap", NULL, NULL);
    free(f);
    f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]},"
                    "\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[8,16]}}",
                    16, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "tensor w is listed twice", NULL, NULL);
    free(f);
    /* Empty tensors hold no byte: they may share offsets with anything. */
    f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]},"
                    "\"e\":{\"dtype\":\"F16\",\"shape\":[0,3],\"data_offsets\":[4,4]}}",
                    8, &size);
    kiln_safetensors *st;
    KILN_CHECK(kiln_safetensors_parse(f, size, "t", &st));
    assert_int_equal(kiln_safetensors_count(st), 2);
    kiln_safetensors_close(st);
    free(f);
}

/* The format says the data section is entirely indexed: a byte after the
 * last tensor, or between two, belongs to no tensor and is refused. */
static void test_unindexed_bytes(void **state)
{
    (void)state;
    size_t size;
    uint8_t *f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]}}", 10, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "the data holds 10 bytes", "the tensors end at 8",
                   "2 bytes after the last tensor");
    free(f);
    f = with_header("{\"__metadata__\":{}}", 3, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "the data holds 3 bytes", "the tensors end at 0", NULL);
    free(f);
    f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]},"
                    "\"v\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[12,16]}}",
                    16, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "bytes [8, 12) of the data", "between tensors w and v", NULL);
    free(f);
    f = with_header("{\"v\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[4,8]}}", 8, &size);
    expect_refused(f, size, KILN_ERR_CONFIG, "bytes [0, 4) of the data", "before tensor v", NULL);
    free(f);
    /* Exactly indexed, with an empty tensor at the end: accepted. */
    f = with_header("{\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]},"
                    "\"e\":{\"dtype\":\"F16\",\"shape\":[0],\"data_offsets\":[8,8]}}",
                    8, &size);
    kiln_safetensors *st;
    KILN_CHECK(kiln_safetensors_parse(f, size, "t", &st));
    kiln_safetensors_close(st);
    free(f);
}

/* cJSON would read "a\u0000b" as "a": such a name, and any header that is
 * not strict JSON, is refused naming the text and its offset. */
static void test_strict_header(void **state)
{
    (void)state;
    const char *cases[][3] = {
        {"{\"a\\u0000b\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}}", "\"a\\u0000b\"", "byte 3 of"},
        {"{\"a\":{\"dtype\":\"F16\\u0000x\",\"shape\":[1],\"data_offsets\":[0,2]}}", "\"F16\\u0000x\"", "byte 18 of"},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,02]}}", "leading zero", "byte 50 of"},
        {"{\"a\":{\"dtype\":\"F16\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,2]}}", "second key \"dtype\"",
         "byte 20 of"},
        {"{\"__metadata__\":{\"k\":\"\x01\"}}", "control byte 0x01", "byte 22 of"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t size;
        uint8_t *f = with_header(cases[i][0], 2, &size);
        expect_refused(f, size, KILN_ERR_CONFIG, "t.safetensors: the header", cases[i][1], cases[i][2]);
        free(f);
    }
}

static void test_expect(void **state)
{
    (void)state;
    st_entry e[2] = {ent("model.norm.weight", "BF16", 1, 64, 0), ent("lm_head.weight", NULL, 2, 100, 64)};
    size_t size;
    uint8_t *f = st_build(e, 2, NULL, NULL, NULL, &size);
    kiln_safetensors *st;
    KILN_CHECK(kiln_safetensors_parse(f, size, "model.safetensors", &st));
    const kiln_safetensors_tensor *t = (const kiln_safetensors_tensor *)1;
    const int64_t norm[1] = {64}, head[2] = {128, 64};
    assert_int_equal(kiln_safetensors_expect(st, "model.norm.weight", KILN_DTYPE_F16, 1, norm, &t), KILN_ERR_CONFIG);
    assert_null(t);
    assert_non_null(strstr(kiln_errmsg(), "model.safetensors: tensor model.norm.weight: dtype BF16, expected F16"));
    assert_int_equal(kiln_safetensors_expect(st, "lm_head.weight", KILN_DTYPE_F16, 2, head, &t), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "tensor lm_head.weight: shape [100, 64], expected [128, 64]"));
    assert_int_equal(kiln_safetensors_expect(st, "model.embed_tokens.weight", KILN_DTYPE_F16, 2, head, &t),
                     KILN_ERR_NOT_FOUND);
    assert_non_null(strstr(kiln_errmsg(), "tensor model.embed_tokens.weight is missing"));
    kiln_safetensors_close(st);
    free(f);
}

static void test_open(void **state)
{
    (void)state;
    char dir[512], path[600];
    kiln_test_tmpdir(dir, sizeof dir);
    kiln_safetensors *st = (kiln_safetensors *)1;
    snprintf(path, sizeof path, "%s/none.safetensors", dir);
    assert_int_equal(kiln_safetensors_open(path, &st), KILN_ERR_IO);
    assert_null(st);
    assert_non_null(strstr(kiln_errmsg(), "none.safetensors"));
    assert_int_equal(kiln_safetensors_open(dir, &st), KILN_ERR_IO);
    snprintf(path, sizeof path, "%s/empty.safetensors", dir);
    assert_true(st_write_file(path, "", 0));
    assert_int_equal(kiln_safetensors_open(path, &st), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "empty.safetensors: truncated"));
    st_entry e[1] = {ent("x", NULL, 1, 10, 0)};
    size_t size;
    uint8_t *f = st_build(e, 1, NULL, fill_index, NULL, &size);
    snprintf(path, sizeof path, "%s/x.safetensors", dir);
    assert_true(st_write_file(path, f, size));
    KILN_CHECK(kiln_safetensors_open(path, &st));
    assert_string_equal(kiln_safetensors_label(st), path);
    assert_int_equal(((const uint8_t *)kiln_safetensors_find(st, "x")->data)[9], 1);
    kiln_safetensors_close(st);
    /* The same file cut short: the header says more than the file holds. */
    assert_true(st_write_file(path, f, 12));
    assert_int_equal(kiln_safetensors_open(path, &st), KILN_ERR_CONFIG);
    assert_non_null(strstr(kiln_errmsg(), "runs past the end"));
    free(f);
    kiln_test_rmrf(dir);
}

static kiln_status open_file(const char *path)
{
    kiln_safetensors *st = NULL;
    kiln_status s = kiln_safetensors_open(path, &st);
    kiln_safetensors_close(st);
    return s;
}

/* A FIFO blocked the open forever. */
static void test_open_fifo(void **state)
{
    (void)state;
    char dir[512];
    kiln_test_tmpdir(dir, sizeof dir);
    assert_int_equal(st_expect_fifo_refused(open_file, kiln_errmsg, dir, "model.safetensors"), 0);
    assert_int_equal(st_expect_not_regular(open_file, kiln_errmsg, dir), 0);
    kiln_test_rmrf(dir);
}

static void test_arguments(void **state)
{
    (void)state;
    kiln_safetensors *st;
    assert_int_equal(kiln_safetensors_parse(NULL, 4, "t", &st), KILN_ERR_INVALID_ARGUMENT);
    assert_int_equal(kiln_safetensors_parse("12345678", 8, "t", NULL), KILN_ERR_INVALID_ARGUMENT);
    assert_int_equal(kiln_safetensors_open(NULL, &st), KILN_ERR_INVALID_ARGUMENT);
    assert_int_equal(kiln_safetensors_count(NULL), 0);
    assert_null(kiln_safetensors_at(NULL, 0));
    assert_null(kiln_safetensors_find(NULL, "x"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_file),       cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_header_length_past_file), cmocka_unit_test(test_bad_json),
        cmocka_unit_test(test_offsets),          cmocka_unit_test(test_expect),
        cmocka_unit_test(test_open),             cmocka_unit_test(test_arguments),
        cmocka_unit_test(test_unindexed_bytes),  cmocka_unit_test(test_strict_header),
        cmocka_unit_test(test_open_fifo),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
