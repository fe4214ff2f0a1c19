/* Signed layers: kiln_cache_sign, kiln_cache_check_signature and the trust
 * policy on read-only layers, over real SQLite files and real Ed25519 keys
 * made here with libcrypto. */
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <sqlite3.h>
#include <zstd.h>

#include "testutil.h"

#define ROWS 3
#define CUBIN 2048

typedef struct fixture {
    char dir[4096];
    char main_db[4200], layer[4200];
    char key_a[4200], pub_a[4200], key_b[4200], pub_b[4200];
    uint8_t id_a[32], id_b[32];
    kiln_rng rng;
    kiln_cache_record rec[ROWS];
    uint8_t cubin[ROWS][CUBIN];
    unsigned events;
} fixture;

/* A fresh Ed25519 key pair (or another algorithm's, for the refusals), as PEM
 * files; id receives SHA-256 of the raw public key. */
static void make_key(const char *type, const char *priv_path, const char *pub_path, uint8_t id[32])
{
    EVP_PKEY *key = strcmp(type, "EC") ? EVP_PKEY_Q_keygen(NULL, NULL, type)
                                       : EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
    assert_non_null(key);
    FILE *f = fopen(priv_path, "w");
    assert_non_null(f);
    assert_int_equal(PEM_write_PrivateKey(f, key, NULL, NULL, 0, NULL, NULL), 1);
    fclose(f);
    f = fopen(pub_path, "w");
    assert_non_null(f);
    assert_int_equal(PEM_write_PUBKEY(f, key), 1);
    fclose(f);
    if (id) {
        uint8_t raw[32];
        size_t len = sizeof raw;
        unsigned n = 0;
        assert_int_equal(EVP_PKEY_get_raw_public_key(key, raw, &len), 1);
        assert_int_equal(EVP_Digest(raw, len, id, &n, EVP_sha256(), NULL), 1);
    }
    EVP_PKEY_free(key);
}

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    assert_non_null(f);
    kiln_test_tmpdir(f->dir, sizeof f->dir);
    snprintf(f->main_db, sizeof f->main_db, "%s/main.db", f->dir);
    snprintf(f->layer, sizeof f->layer, "%s/layer.db", f->dir);
    snprintf(f->key_a, sizeof f->key_a, "%s/a.pem", f->dir);
    snprintf(f->pub_a, sizeof f->pub_a, "%s/a.pub", f->dir);
    snprintf(f->key_b, sizeof f->key_b, "%s/b.pem", f->dir);
    snprintf(f->pub_b, sizeof f->pub_b, "%s/b.pub", f->dir);
    make_key("ED25519", f->key_a, f->pub_a, f->id_a);
    make_key("ED25519", f->key_b, f->pub_b, f->id_b);
    f->rng = kiln_rng_new();
    /* The layer: ROWS random kernels, as export would make it. */
    kiln_cache_options o = {.size = sizeof o, .path = f->layer, .ignore_env = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    for (int i = 0; i < ROWS; i++) {
        kiln_cache_record *r = &f->rec[i];
        kiln_rng_fill(&f->rng, r->fingerprint, 32);
        kiln_rng_fill(&f->rng, f->cubin[i], CUBIN);
        r->template_id = "rms_norm";
        r->constants = "HIDDEN=4096";
        r->arch = "sm_90";
        r->nvrtc_major = 13;
        r->entries = "kiln_rms_norm";
        r->parts = "schema=kiln-fingerprint-1;template=rms_norm";
        r->cubin = f->cubin[i];
        r->cubin_size = CUBIN;
        KILN_CHECK(kiln_cache_put(c, r));
    }
    KILN_CHECK(kiln_cache_seal(c));
    kiln_cache_close(c);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    kiln_test_rmrf(f->dir);
    free(f);
    return 0;
}

static void sign_with(const char *db, const char *key, uint8_t want_id[32])
{
    kiln_cache_options o = {.size = sizeof o, .path = db, .ignore_env = 1, .existing_only = 1};
    kiln_cache *c = NULL;
    uint8_t id[32];
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_CHECK(kiln_cache_sign(c, key, id));
    assert_memory_equal(id, want_id, 32);
    KILN_CHECK(kiln_cache_seal(c));
    kiln_cache_close(c);
}

static void on_event(void *user, const kiln_cache_event *ev)
{
    fixture *f = user;
    if (ev->kind == KILN_CACHE_EVENT_CORRUPT_DROPPED)
        f->events++;
}

/* The writable main.db with f->layer as its one read-only layer, under the
 * policy of keys (n of them; 0: none). */
static kiln_cache *open_layered(fixture *f, const char *const *keys, size_t n)
{
    const char *layers[] = {f->layer};
    kiln_cache_options o = {.size = sizeof o,
                            .path = f->main_db,
                            .ignore_env = 1,
                            .readonly_paths = layers,
                            .n_readonly_paths = 1,
                            .on_event = on_event,
                            .user = f,
                            .trusted_keys = keys,
                            .n_trusted_keys = n};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    return c;
}

static kiln_cache_layer_info layer_of(kiln_cache *c)
{
    kiln_cache_layer_info info;
    assert_int_equal(kiln_cache_layer_count(c), 1);
    KILN_CHECK(kiln_cache_layer(c, 0, &info));
    return info;
}

/* 1 with the cubin checked against want when the row loads, 0 on a miss. */
static int loads(kiln_cache *c, const kiln_cache_record *r, const void *want)
{
    void *got = NULL;
    size_t size = 0;
    int found = -1;
    KILN_CHECK(kiln_cache_get(c, r->fingerprint, &got, &size, &found));
    if (found) {
        assert_int_equal(size, CUBIN);
        assert_memory_equal(got, want, CUBIN);
    }
    kiln_free(got);
    return found;
}

/* kiln_cache_check_signature of db, opened alone, under the policy keys. */
static kiln_cache_signature_report check_sig(const char *db, const char *const *keys, size_t n)
{
    kiln_cache_options o = {.size = sizeof o, .path = db, .read_only = 1, .ignore_env = 1, .existing_only = 1,
                            .trusted_keys = keys, .n_trusted_keys = n};
    kiln_cache *c = NULL;
    kiln_cache_signature_report rep;
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_CHECK(kiln_cache_check_signature(c, NULL, NULL, &rep));
    kiln_cache_close(c);
    return rep;
}

/* Rewrites column `column` of row fp with sqlite3 directly. */
static void set_text(const char *db, const uint8_t *fp, const char *column, const char *value)
{
    sqlite3 *s = NULL;
    sqlite3_stmt *q = NULL;
    char sql[128];
    snprintf(sql, sizeof sql, "UPDATE kernels SET %s = ?2 WHERE fingerprint = ?1", column);
    assert_int_equal(sqlite3_open(db, &s), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(s, sql, -1, &q, NULL), SQLITE_OK);
    sqlite3_bind_blob(q, 1, fp, 32, SQLITE_STATIC);
    sqlite3_bind_text(q, 2, value, -1, SQLITE_STATIC);
    assert_int_equal(sqlite3_step(q), SQLITE_DONE);
    assert_int_equal(sqlite3_changes(s), 1);
    sqlite3_finalize(q);
    sqlite3_close(s);
}

/* Plants a different cubin under fp, its zstd blob and SHA-256 recomputed so
 * that the row passes every check a checksum can make. */
static void plant(const char *db, const uint8_t *fp, const uint8_t *cubin, size_t size)
{
    uint8_t sum[32], z[CUBIN + 512];
    unsigned n = 0;
    size_t zn = ZSTD_compress(z, sizeof z, cubin, size, 9);
    assert_false(ZSTD_isError(zn));
    assert_int_equal(EVP_Digest(cubin, size, sum, &n, EVP_sha256(), NULL), 1);
    sqlite3 *s = NULL;
    sqlite3_stmt *q = NULL;
    assert_int_equal(sqlite3_open(db, &s), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(s, "UPDATE kernels SET cubin = ?2, checksum = ?3, raw_size = ?4"
                                           " WHERE fingerprint = ?1", -1, &q, NULL), SQLITE_OK);
    sqlite3_bind_blob(q, 1, fp, 32, SQLITE_STATIC);
    sqlite3_bind_blob(q, 2, z, (int)zn, SQLITE_STATIC);
    sqlite3_bind_blob(q, 3, sum, 32, SQLITE_STATIC);
    sqlite3_bind_int64(q, 4, (sqlite3_int64)size);
    assert_int_equal(sqlite3_step(q), SQLITE_DONE);
    assert_int_equal(sqlite3_changes(s), 1);
    sqlite3_finalize(q);
    sqlite3_close(s);
}

static void test_signed_layer_loads(void **state)
{
    fixture *f = *state;
    sign_with(f->layer, f->key_a, f->id_a);
    const char *keys[] = {f->pub_a};
    kiln_cache *c = open_layered(f, keys, 1);
    kiln_cache_layer_info info = layer_of(c);
    assert_true(info.active);
    assert_string_equal(info.reason, "");
    for (int i = 0; i < ROWS; i++)
        assert_true(loads(c, &f->rec[i], f->cubin[i]));
    kiln_cache_counters k;
    kiln_cache_get_counters(c, &k);
    assert_int_equal(k.hits, ROWS);
    assert_int_equal(k.corrupt_dropped, 0);
    kiln_cache_close(c);

    kiln_cache_signature_report rep = check_sig(f->layer, keys, 1);
    assert_int_equal(rep.state, KILN_CACHE_SIGNATURE_VALID);
    assert_memory_equal(rep.key_id, f->id_a, 32);
    assert_int_equal(rep.trusted, 1);
    assert_int_equal(rep.signed_rows, ROWS);
    assert_int_equal(rep.rows, ROWS);
    assert_int_equal(rep.bad_rows, 0);
    /* No policy: valid, trust unknown. */
    rep = check_sig(f->layer, NULL, 0);
    assert_int_equal(rep.state, KILN_CACHE_SIGNATURE_VALID);
    assert_int_equal(rep.trusted, -1);
}

static void test_planted_row_refused(void **state)
{
    fixture *f = *state;
    sign_with(f->layer, f->key_a, f->id_a);
    uint8_t evil[CUBIN];
    memcpy(evil, f->cubin[0], CUBIN);
    evil[100] ^= 1;
    plant(f->layer, f->rec[0].fingerprint, evil, CUBIN);
    /* What a checksum alone sees: a whole row. */
    kiln_cache_options o = {.size = sizeof o, .path = f->layer, .read_only = 1, .ignore_env = 1, .existing_only = 1};
    kiln_cache *c = NULL;
    kiln_cache_verify_report vr;
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_CHECK(kiln_cache_verify(c, NULL, NULL, &vr));
    assert_int_equal(vr.bad_rows, 0);
    kiln_cache_close(c);
    /* Without a policy the planted cubin is what loads (today's trust). */
    c = open_layered(f, NULL, 0);
    assert_true(loads(c, &f->rec[0], evil));
    kiln_cache_close(c);
    /* With one, the layer is admitted but that row is never loaded. */
    const char *keys[] = {f->pub_a};
    c = open_layered(f, keys, 1);
    assert_true(layer_of(c).active);
    f->events = 0;
    assert_false(loads(c, &f->rec[0], NULL));
    assert_int_equal(f->events, 1);
    assert_non_null(strstr(kiln_cache_errmsg(c), "not the one the layer's manifest signed"));
    for (int i = 1; i < ROWS; i++)
        assert_true(loads(c, &f->rec[i], f->cubin[i]));
    kiln_cache_close(c);
    kiln_cache_signature_report rep = check_sig(f->layer, keys, 1);
    assert_int_equal(rep.state, KILN_CACHE_SIGNATURE_INVALID);
    assert_int_equal(rep.bad_rows, 1);
    assert_non_null(strstr(rep.detail, "1 of 3 rows are not as signed"));
}

/* What a load reads besides the cubin is signed too: an edited entries list
 * (which names the kernels the driver looks up) is refused. */
static void test_edited_columns_refused(void **state)
{
    fixture *f = *state;
    sign_with(f->layer, f->key_a, f->id_a);
    set_text(f->layer, f->rec[1].fingerprint, "entries", "kiln_evil");
    set_text(f->layer, f->rec[2].fingerprint, "parts", "schema=kiln-fingerprint-1;template=other");
    const char *keys[] = {f->pub_a};
    kiln_cache *c = open_layered(f, keys, 1);
    assert_true(loads(c, &f->rec[0], f->cubin[0]));
    assert_false(loads(c, &f->rec[1], NULL));
    assert_false(loads(c, &f->rec[2], NULL));
    assert_non_null(strstr(kiln_cache_errmsg(c), "not those the manifest signed"));
    kiln_cache_close(c);
    assert_int_equal(check_sig(f->layer, keys, 1).bad_rows, 2);
}

static void test_resigned_with_other_key_skipped(void **state)
{
    fixture *f = *state;
    sign_with(f->layer, f->key_a, f->id_a);
    sign_with(f->layer, f->key_b, f->id_b); /* replaces A's signature */
    const char *keys[] = {f->pub_a};
    kiln_cache *c = open_layered(f, keys, 1);
    kiln_cache_layer_info info = layer_of(c);
    assert_false(info.active);
    char hex[65];
    kiln_fingerprint_hex(f->id_b, hex);
    assert_non_null(strstr(info.reason, hex));
    assert_non_null(strstr(info.reason, "the trust policy does not list"));
    for (int i = 0; i < ROWS; i++)
        assert_false(loads(c, &f->rec[i], NULL));
    kiln_cache_close(c);
    kiln_cache_signature_report rep = check_sig(f->layer, keys, 1);
    assert_int_equal(rep.state, KILN_CACHE_SIGNATURE_VALID);
    assert_memory_equal(rep.key_id, f->id_b, 32);
    assert_int_equal(rep.trusted, 0);
    /* Both keys listed: B's signature is admitted. */
    const char *both[] = {f->pub_a, f->pub_b};
    c = open_layered(f, both, 2);
    assert_true(layer_of(c).active);
    assert_true(loads(c, &f->rec[0], f->cubin[0]));
    kiln_cache_close(c);
}

static void test_unsigned_layer_skipped_under_policy(void **state)
{
    fixture *f = *state;
    const char *keys[] = {f->pub_a};
    kiln_cache *c = open_layered(f, keys, 1);
    kiln_cache_layer_info info = layer_of(c);
    assert_false(info.active);
    assert_non_null(strstr(info.reason, "unsigned, and a trust policy is set"));
    assert_false(loads(c, &f->rec[0], NULL));
    kiln_cache_close(c);
    kiln_cache_signature_report rep = check_sig(f->layer, keys, 1);
    assert_int_equal(rep.state, KILN_CACHE_UNSIGNED);
    assert_int_equal(rep.rows, ROWS);
    assert_int_equal(rep.signed_rows, 0);
    /* The policy from $KILN_TRUSTED_KEYS, read when the environment is. */
    char env[9000];
    snprintf(env, sizeof env, "%s:%s", f->pub_b, f->pub_a);
    setenv("KILN_TRUSTED_KEYS", env, 1);
    const char *layers[] = {f->layer};
    kiln_cache_options o = {.size = sizeof o, .path = f->main_db, .readonly_paths = layers, .n_readonly_paths = 1};
    KILN_CHECK(kiln_cache_open(&o, &c));
    assert_false(layer_of(c).active);
    kiln_cache_close(c);
    sign_with(f->layer, f->key_a, f->id_a);
    KILN_CHECK(kiln_cache_open(&o, &c));
    assert_true(layer_of(c).active);
    kiln_cache_close(c);
    unsetenv("KILN_TRUSTED_KEYS");
}

static void test_without_policy_all_load(void **state)
{
    fixture *f = *state;
    kiln_cache *c = open_layered(f, NULL, 0); /* unsigned */
    assert_true(layer_of(c).active);
    for (int i = 0; i < ROWS; i++)
        assert_true(loads(c, &f->rec[i], f->cubin[i]));
    kiln_cache_close(c);
    sign_with(f->layer, f->key_b, f->id_b); /* signed by a key nobody lists */
    c = open_layered(f, NULL, 0);
    assert_true(layer_of(c).active);
    for (int i = 0; i < ROWS; i++)
        assert_true(loads(c, &f->rec[i], f->cubin[i]));
    kiln_cache_close(c);
}

static void test_damaged_signature_skipped(void **state)
{
    fixture *f = *state;
    sign_with(f->layer, f->key_a, f->id_a);
    /* One bit of the signature flipped. */
    sqlite3 *s = NULL;
    sqlite3_stmt *q = NULL;
    uint8_t sig[64];
    assert_int_equal(sqlite3_open(f->layer, &s), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(s, "SELECT signature FROM kiln_signature", -1, &q, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(q), SQLITE_ROW);
    assert_int_equal(sqlite3_column_bytes(q, 0), 64);
    memcpy(sig, sqlite3_column_blob(q, 0), 64);
    sqlite3_finalize(q);
    sig[63] ^= 0x10;
    assert_int_equal(sqlite3_prepare_v2(s, "UPDATE kiln_signature SET signature = ?1", -1, &q, NULL), SQLITE_OK);
    sqlite3_bind_blob(q, 1, sig, 64, SQLITE_STATIC);
    assert_int_equal(sqlite3_step(q), SQLITE_DONE);
    sqlite3_finalize(q);
    sqlite3_close(s);
    const char *keys[] = {f->pub_a};
    kiln_cache *c = open_layered(f, keys, 1);
    kiln_cache_layer_info info = layer_of(c);
    assert_false(info.active);
    assert_non_null(strstr(info.reason, "signature invalid"));
    kiln_cache_close(c);
    kiln_cache_signature_report rep = check_sig(f->layer, keys, 1);
    assert_int_equal(rep.state, KILN_CACHE_SIGNATURE_INVALID);
    assert_true(rep.detail[0] != 0);
}

static void test_bad_keys_refused(void **state)
{
    fixture *f = *state;
    char ec_key[4200], ec_pub[4200], missing[4200];
    snprintf(ec_key, sizeof ec_key, "%s/ec.pem", f->dir);
    snprintf(ec_pub, sizeof ec_pub, "%s/ec.pub", f->dir);
    snprintf(missing, sizeof missing, "%s/none.pub", f->dir);
    make_key("EC", ec_key, ec_pub, NULL);
    const char *layers[] = {f->layer};
    const char *const lists[][1] = {{missing}, {ec_pub}, {f->key_a}};
    const char *needles[] = {"none.pub", "Ed25519 only", "not a PEM public key"};
    for (int i = 0; i < 3; i++) {
        kiln_cache_options o = {.size = sizeof o, .path = f->main_db, .ignore_env = 1, .readonly_paths = layers,
                                .n_readonly_paths = 1, .trusted_keys = lists[i], .n_trusted_keys = 1};
        kiln_cache *c = NULL;
        KILN_EXPECT(kiln_cache_open(&o, &c), KILN_ERR_INVALID_ARGUMENT, kiln_errmsg(), needles[i], NULL);
        assert_null(c);
    }
    kiln_cache_options o = {.size = sizeof o, .path = f->layer, .ignore_env = 1, .existing_only = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_EXPECT(kiln_cache_sign(c, ec_key, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_cache_errmsg(c), "Ed25519 only",
                NULL);
    KILN_EXPECT(kiln_cache_sign(c, f->pub_a, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_cache_errmsg(c),
                "not a PEM private key", NULL);
    kiln_cache_close(c);
    o.read_only = 1;
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_EXPECT(kiln_cache_sign(c, f->key_a, NULL), KILN_ERR_INVALID_ARGUMENT, kiln_cache_errmsg(c), "read-only",
                NULL);
    kiln_cache_close(c);
}

/* A database with a row that fails verification is not signed at all. */
static void test_sign_refuses_corrupt_rows(void **state)
{
    fixture *f = *state;
    sqlite3 *s = NULL;
    assert_int_equal(sqlite3_open(f->layer, &s), SQLITE_OK);
    assert_int_equal(sqlite3_exec(s, "UPDATE kernels SET checksum = zeroblob(32)", NULL,
                                  NULL, NULL),
                     SQLITE_OK);
    sqlite3_close(s);
    kiln_cache_options o = {.size = sizeof o, .path = f->layer, .ignore_env = 1, .existing_only = 1};
    kiln_cache *c = NULL;
    KILN_CHECK(kiln_cache_open(&o, &c));
    KILN_EXPECT(kiln_cache_sign(c, f->key_a, NULL), KILN_ERR_CACHE_CORRUPT, kiln_cache_errmsg(c),
                "nothing was signed", "checksum mismatch");
    kiln_cache_close(c);
    assert_int_equal(check_sig(f->layer, NULL, 0).state, KILN_CACHE_UNSIGNED);
}

int main(void)
{
    kiln_test_filter();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_signed_layer_loads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_planted_row_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_edited_columns_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_resigned_with_other_key_skipped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unsigned_layer_skipped_under_policy, setup, teardown),
        cmocka_unit_test_setup_teardown(test_without_policy_all_load, setup, teardown),
        cmocka_unit_test_setup_teardown(test_damaged_signature_skipped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_keys_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sign_refuses_corrupt_rows, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
