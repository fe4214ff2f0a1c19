/* The operation catalog: a row for every operation the headers declare and
 * every template the library embeds, its versions in the implementation
 * fingerprint, and kiln_op_catalog's size-then-fill contract. */
#include <ctype.h>
#include <dirent.h>

#include "testutil.h"

#include "jit/embedded.h"
#include "providers/catalog.h"

/* The names <name> of every "kiln_op_<name><suffix>(" declared by the public
 * headers (KILN_INCLUDE_DIR/kiln/ *.h), written space-separated into out. */
static void declared(const char *suffix, char *out, size_t cap)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/kiln", KILN_INCLUDE_DIR);
    DIR *d = opendir(dir);
    assert_non_null(d);
    size_t n = 0;
    out[0] = 0;
    const struct dirent *e;
    while ((e = readdir(d))) {
        const size_t len = strlen(e->d_name);
        if (len < 3 || strcmp(e->d_name + len - 2, ".h"))
            continue;
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r");
        assert_non_null(f);
        char line[1024];
        while (fgets(line, sizeof line, f)) {
            const char *api = strstr(line, "KILN_API");
            for (const char *p = api ? strstr(api, "kiln_op_") : NULL; p; p = strstr(p + 1, "kiln_op_")) {
                const char *name = p + strlen("kiln_op_"), *q = name;
                while (islower((unsigned char)*q) || isdigit((unsigned char)*q) || *q == '_')
                    q++;
                const size_t nl = (size_t)(q - name), sl = strlen(suffix);
                if (*q != '(' || nl <= sl || strncmp(q - sl, suffix, sl))
                    continue;
                int w = snprintf(out + n, cap - n, "%s%.*s", n ? " " : "", (int)(nl - sl), name);
                assert_true(w > 0 && (size_t)w < cap - n);
                n += (size_t)w;
            }
        }
        fclose(f);
    }
    closedir(d);
}

/* Whether word is one of the space-separated words of list. */
static int has_word(const char *list, const char *word)
{
    const size_t len = strlen(word);
    for (const char *p = list; p && *p;) {
        const size_t n = strcspn(p, " ");
        if (n == len && !strncmp(p, word, len))
            return 1;
        p += n + (p[n] == ' ');
    }
    return 0;
}

static void test_every_encoded_operation_has_a_row(void **state)
{
    (void)state;
    char ops[4096];
    declared("_encode", ops, sizeof ops);
    assert_true(has_word(ops, "dense_linear")); /* the scan itself works */
    for (const char *p = ops; *p;) {
        char id[KILN_OP_ID_MAX];
        const size_t n = strcspn(p, " ");
        snprintf(id, sizeof id, "%.*s", (int)n, p);
        if (!kiln__catalog_find(id))
            fail_msg("kiln_op_%s_encode is declared but the catalog (providers/catalog.c) has no row %s", id, id);
        p += n + (p[n] == ' ');
    }
    size_t n_rows;
    const kiln__op_row *rows = kiln__catalog_rows(&n_rows);
    for (size_t i = 0; i < n_rows; i++) {
        if (!has_word(ops, rows[i].id))
            fail_msg("catalog row %s has no kiln_op_%s_encode in include/kiln", rows[i].id, rows[i].id);
        for (size_t j = 0; j < i; j++)
            assert_string_not_equal(rows[i].id, rows[j].id);
        assert_true(strlen(rows[i].id) < KILN_OP_ID_MAX);
        assert_true((rows[i].specs == NULL) != (rows[i].arch_specs == NULL));
        assert_true(rows[i].version >= 1);
        assert_true(rows[i].dtypes != 0 && rows[i].batching != 0);
        assert_true(rows[i].capabilities & KILN_CAP_LAUNCH);
    }
}

static void test_workspace_estimators_match_the_headers(void **state)
{
    (void)state;
    char ws[4096];
    declared("_workspace", ws, sizeof ws);
    size_t n_rows;
    const kiln__op_row *rows = kiln__catalog_rows(&n_rows);
    for (size_t i = 0; i < n_rows; i++) {
        if (!rows[i].workspace)
            continue;
        char name[128];
        assert_int_equal(sscanf(rows[i].workspace, "kiln_op_%127s", name), 1);
        assert_true(strlen(name) > strlen("_workspace"));
        name[strlen(name) - strlen("_workspace")] = 0;
        if (!has_word(ws, name))
            fail_msg("catalog row %s names %s, which include/kiln does not declare", rows[i].id, rows[i].workspace);
    }
    /* Every declared estimator is some row's. */
    for (const char *p = ws; *p;) {
        const size_t n = strcspn(p, " ");
        char name[160];
        snprintf(name, sizeof name, "kiln_op_%.*s_workspace", (int)n, p);
        int named = 0;
        for (size_t i = 0; i < n_rows; i++)
            named |= rows[i].workspace && !strcmp(rows[i].workspace, name);
        if (!named)
            fail_msg("%s is declared but no catalog row names it", name);
        p += n + (p[n] == ' ');
    }
}

static void test_every_template_belongs_to_an_operation(void **state)
{
    (void)state;
    size_t n_rows, n_cu = 0;
    const kiln__op_row *rows = kiln__catalog_rows(&n_rows);
    for (size_t f = 0; f < kiln__embedded_count; f++) {
        const char *name = kiln__embedded_files[f].name;
        const size_t len = strlen(name);
        if (len < 4 || strcmp(name + len - 3, ".cu"))
            continue;
        char id[KILN_NAME_MAX];
        snprintf(id, sizeof id, "%.*s", (int)(len - 3), name);
        int owned = 0;
        for (size_t i = 0; i < n_rows; i++)
            owned |= has_word(rows[i].templates, id);
        if (!owned)
            fail_msg("templates/%s is embedded but no catalog row lists template %s", name, id);
        n_cu++;
    }
    assert_true(n_cu >= 12);
    /* And every template a row lists exists. */
    for (size_t i = 0; i < n_rows; i++) {
        for (const char *p = rows[i].templates; *p;) {
            const size_t n = strcspn(p, " ");
            char file[KILN_NAME_MAX + 4];
            snprintf(file, sizeof file, "%.*s.cu", (int)n, p);
            int found = 0;
            for (size_t f = 0; f < kiln__embedded_count; f++)
                found |= !strcmp(kiln__embedded_files[f].name, file);
            if (!found)
                fail_msg("catalog row %s lists template %s, which is not embedded", rows[i].id, file);
            p += n + (p[n] == ' ');
        }
    }
}

/* Each row's specializations are of templates that row lists. */
typedef struct row_sink {
    const kiln__op_row *row;
    size_t n;
} row_sink;

static kiln_status check_spec(void *user, const kiln_spec *spec)
{
    row_sink *s = user;
    if (!has_word(s->row->templates, spec->template_id))
        fail_msg("catalog row %s adds a %s specialization; its templates are %s", s->row->id, spec->template_id,
                 s->row->templates);
    s->n++;
    return KILN_OK;
}

static void test_rows_specialize_their_own_templates(void **state)
{
    (void)state;
    kiln_model_config cfgs[2];
    kiln_model_config_default(&cfgs[0]);
    kiln_model_config_default(&cfgs[1]);
    cfgs[1].linear_num_key_heads = 16;
    cfgs[1].linear_num_value_heads = 32;
    cfgs[1].linear_key_head_dim = 128;
    cfgs[1].linear_value_head_dim = 128;
    static const char *const archs[] = {NULL, "sm_75", "sm_86", "sm_90"};
    size_t n_rows, total = 0;
    const kiln__op_row *rows = kiln__catalog_rows(&n_rows);
    for (int c = 0; c < 2; c++)
        for (int a = 0; a < 4; a++)
            for (size_t i = 0; i < n_rows; i++) {
                row_sink s = {&rows[i], 0};
                KILN_CHECK(rows[i].arch_specs ? rows[i].arch_specs(&cfgs[c], archs[a], check_spec, &s)
                                              : rows[i].specs(&cfgs[c], check_spec, &s));
                total += s.n;
            }
    assert_true(total > 0);
}

static void test_versions_are_in_the_fingerprint(void **state)
{
    (void)state;
    size_t n_rows;
    const kiln__op_row *rows = kiln__catalog_rows(&n_rows);
    uint8_t base[32], again[32], other[32];
    kiln__implementation_digest(base);
    kiln__catalog_digest(rows, n_rows, again);
    assert_memory_equal(base, again, 32);
    kiln__op_row *copy = malloc(n_rows * sizeof *copy);
    assert_non_null(copy);
    for (size_t i = 0; i < n_rows; i++) {
        memcpy(copy, rows, n_rows * sizeof *copy);
        copy[i].version++;
        kiln__catalog_digest(copy, n_rows, other);
        if (!memcmp(base, other, 32))
            fail_msg("the version of %s is not part of the implementation fingerprint", rows[i].id);
        memcpy(copy, rows, n_rows * sizeof *copy);
        copy[i].id = "renamed";
        kiln__catalog_digest(copy, n_rows, other);
        assert_memory_not_equal(base, other, 32);
    }
    /* A row left out changes it too. */
    kiln__catalog_digest(rows, n_rows - 1, other);
    assert_memory_not_equal(base, other, 32);
    free(copy);
}

static void test_capabilities_are_the_rows(void **state)
{
    (void)state;
    size_t n_rows;
    const kiln__op_row *rows = kiln__catalog_rows(&n_rows);
    uint32_t caps = 0;
    for (size_t i = 0; i < n_rows; i++)
        caps |= rows[i].capabilities;
    assert_int_equal(kiln__catalog_capabilities(), caps);
    assert_true(caps & KILN_CAP_F16);
    assert_true(caps & KILN_CAP_CUBLASLT);
    assert_true(caps & KILN_CAP_PAGED_KV);
    /* Every operation takes bf16 (each test_*_gpu runs it). */
    assert_true(caps & KILN_CAP_BF16);
    for (size_t i = 0; i < n_rows; i++) {
        assert_true(rows[i].capabilities & KILN_CAP_BF16);
        assert_true(rows[i].dtypes & (1u << KILN_DTYPE_BF16));
    }
}

/* An older caller's view: the fields up to capabilities. */
typedef struct old_info {
    uint32_t size;
    const char *id;
    uint32_t version;
    uint32_t capabilities;
} old_info;

static void test_size_then_fill(void **state)
{
    (void)state;
    size_t total = 0, n_rows;
    kiln__catalog_rows(&n_rows);
    KILN_CHECK(kiln_op_catalog(NULL, &total));
    assert_int_equal(total, n_rows);
    KILN_EXPECT(kiln_op_catalog(NULL, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "count", NULL);

    kiln_op_info *all = calloc(total + 1, sizeof *all);
    assert_non_null(all);
    size_t n = total + 1;
    KILN_CHECK(kiln_op_catalog(all, &n)); /* size 0: sizeof(kiln_op_info) */
    assert_int_equal(n, total);
    assert_null(all[total].id); /* past the total: untouched */
    for (size_t i = 0; i < total; i++) {
        assert_int_equal(all[i].size, sizeof(kiln_op_info));
        assert_non_null(all[i].id);
        kiln_op_info one = {.size = sizeof one};
        KILN_CHECK(kiln_op_catalog_find(all[i].id, &one));
        assert_memory_equal(&one, &all[i], sizeof one);
    }

    /* Cut short: the first two filled, the count says how many there are. */
    kiln_op_info some[3];
    memset(some, 0, sizeof some);
    some[0].size = sizeof some[0];
    n = 2;
    KILN_CHECK(kiln_op_catalog(some, &n));
    assert_int_equal(n, total);
    assert_string_equal(some[0].id, all[0].id);
    assert_string_equal(some[1].id, all[1].id);
    assert_null(some[2].id);
    n = 0;
    KILN_CHECK(kiln_op_catalog(some, &n));
    assert_int_equal(n, total);

    /* An older, smaller struct: its fields only, at its stride. */
    old_info old[4];
    memset(old, 0xab, sizeof old);
    old[0].size = sizeof old[0];
    n = 3;
    KILN_CHECK(kiln_op_catalog((kiln_op_info *)(void *)old, &n));
    for (int i = 0; i < 3; i++) {
        assert_int_equal(old[i].size, sizeof old[i]);
        assert_string_equal(old[i].id, all[i].id);
        assert_int_equal(old[i].version, all[i].version);
        assert_int_equal(old[i].capabilities, all[i].capabilities);
    }
    assert_int_equal(old[3].size, 0xabababab);
    /* A newer, larger one: ours filled, the rest untouched. */
    struct newer {
        kiln_op_info info;
        uint64_t later;
    } big[2];
    memset(big, 0, sizeof big);
    big[0].info.size = sizeof big[0];
    big[0].later = big[1].later = 7;
    n = 2;
    KILN_CHECK(kiln_op_catalog(&big[0].info, &n));
    assert_string_equal(big[1].info.id, all[1].id);
    assert_int_equal(big[1].info.size, sizeof(kiln_op_info));
    assert_int_equal(big[0].later, 7);
    assert_int_equal(big[1].later, 7);

    some[0].size = 3;
    n = 1;
    KILN_EXPECT(kiln_op_catalog(some, &n), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "kiln_op_info.size is 3", NULL);
    free(all);
}

static void test_find(void **state)
{
    (void)state;
    kiln_op_info info = {.size = sizeof info};
    KILN_CHECK(kiln_op_catalog_find("paged_attention", &info));
    assert_string_equal(info.id, "paged_attention");
    assert_int_equal(info.version, KILN__VERSION_PAGED_ATTENTION);
    assert_true(info.capabilities & KILN_CAP_PAGED_KV);
    assert_true(info.dtypes & (1u << KILN_DTYPE_F16));
    assert_true(info.batching & (1u << KILN_BATCHING_PACKED));
    assert_true(has_word(info.templates, "paged_decode"));
    assert_string_equal(info.workspace, "kiln_op_paged_attention_workspace");
    KILN_CHECK(kiln_op_catalog_find("token_embedding", &info));
    assert_null(info.workspace);
    KILN_EXPECT(kiln_op_catalog_find("no_such_op", &info), KILN_ERR_NOT_FOUND, kiln_errmsg(), "no_such_op", NULL);
    KILN_EXPECT(kiln_op_catalog_find(NULL, &info), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "id", NULL);
    KILN_EXPECT(kiln_op_catalog_find("rms_norm", NULL), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), "out", NULL);
    info.size = 1;
    KILN_EXPECT(kiln_op_catalog_find("rms_norm", &info), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(),
                "kiln_op_info.size is 1", NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_encoded_operation_has_a_row),
        cmocka_unit_test(test_workspace_estimators_match_the_headers),
        cmocka_unit_test(test_every_template_belongs_to_an_operation),
        cmocka_unit_test(test_rows_specialize_their_own_templates),
        cmocka_unit_test(test_versions_are_in_the_fingerprint),
        cmocka_unit_test(test_capabilities_are_the_rows),
        cmocka_unit_test(test_size_then_fill),
        cmocka_unit_test(test_find),
    };
    kiln_test_filter();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
