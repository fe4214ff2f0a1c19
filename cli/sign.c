/* kiln sign, and the signature lines of kiln verify. */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char sign_help[] =
    "usage: kiln sign --key KEY.pem DB\n"
    "\n"
    "Signs the database DB for shipping with the Ed25519 private key in KEY.pem\n"
    "(PEM, no passphrase; 'openssl genpkey -algorithm ed25519 -out KEY.pem' makes\n"
    "one, 'openssl pkey -in KEY.pem -pubout -out KEY.pub' its public key). Every\n"
    "row is verified first (as 'kiln verify' does; a bad row signs nothing), then\n"
    "a manifest of every row's fingerprint, cubin SHA-256 and the digest of its\n"
    "other loaded columns is signed and stored in DB, replacing an earlier\n"
    "signature, and DB is sealed as export seals its output. A process whose\n"
    "trust policy ($KILN_TRUSTED_KEYS) lists the public key loads DB as a\n"
    "read-only layer; a row changed after signing is never loaded.\n"
    "\n"
    "options:\n"
    "  -k, --key KEY.pem  the Ed25519 private key (required)\n"
    "  -h, --help         print this help and exit\n"
    "\n"
    "output: verify's lines, then\n"
    "  signed <path>: <N> rows, key <key id>\n"
    "(the key id is the SHA-256 of the raw public key, as 'kiln verify' prints it)\n"
    "\n"
    "exit status: 0 DB is signed and sealed; 1 a missing or bad database, a bad\n"
    "row, a key that is not an Ed25519 private key; 2 a usage error.\n";

int cli_sign(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"key", required_argument, NULL, 'k'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    const char *cmd = "sign", *key = NULL;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":k:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'k':
            key = optarg;
            break;
        case 'h':
            fputs(sign_help, stdout);
            return CLI_EXIT_OK;
        default:
            return cli_getopt_error(cmd, c, argv);
        }
    }
    if (!key)
        return cli_usage_error(cmd, "no key: give --key KEY.pem");
    if (optind >= argc)
        return cli_usage_error(cmd, "no database: give DB");
    if (optind + 1 < argc)
        return cli_usage_error(cmd, "unexpected argument '%s'", argv[optind + 1]);
    kiln_cache *cache;
    int rc = cli_open_existing_writable(cmd, argv[optind], &cache);
    if (rc)
        return rc;
    uint8_t id[KILN_KEY_ID_SIZE];
    char hex[2 * KILN_KEY_ID_SIZE + 1];
    kiln_cache_stats s;
    if ((rc = cli_verify_cache(cmd, cache)))
        goto out_close;
    if (kiln_cache_sign(cache, key, id) != KILN_OK || kiln_cache_seal(cache) != KILN_OK ||
        kiln_cache_get_stats(cache, &s) != KILN_OK) {
        rc = cli_fail(cmd, "%s", kiln_errmsg());
        goto out_close;
    }
    kiln_fingerprint_hex(id, hex);
    printf("signed %s: %" PRIu64 " rows, key %s\n", kiln_cache_path(cache), s.entries, hex);
    if (fflush(stdout) != 0 || ferror(stdout))
        rc = cli_fail(cmd, "cannot write the output");
out_close:
    kiln_cache_close(cache);
    return rc;
}

static void print_unsigned_row(void *user, const uint8_t fingerprint[KILN_FINGERPRINT_SIZE], const char *detail)
{
    (void)user;
    char hex[2 * KILN_FINGERPRINT_SIZE + 1];
    kiln_fingerprint_hex(fingerprint, hex);
    printf("bad %s %s\n", hex, detail);
}

int cli_verify_signature(const char *cmd, const char *path)
{
    /* Its own read-only handle, under the policy of $KILN_TRUSTED_KEYS: an
     * empty layer list keeps $KILN_CACHE_READONLY out. */
    static const char *const no_layers[1] = {NULL};
    kiln_cache_options opts = {.size = sizeof opts,
                               .path = path,
                               .read_only = 1,
                               .existing_only = 1,
                               .remote = "", /* a file's signature: no server */
                               .readonly_paths = no_layers,
                               .n_readonly_paths = 0};
    kiln_cache *cache = NULL;
    kiln_cache_signature_report r;
    if (kiln_cache_open(&opts, &cache) != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    kiln_status st = kiln_cache_check_signature(cache, print_unsigned_row, NULL, &r);
    kiln_cache_close(cache);
    if (st != KILN_OK)
        return cli_fail(cmd, "%s", kiln_errmsg());
    char hex[2 * KILN_KEY_ID_SIZE + 1];
    kiln_fingerprint_hex(r.key_id, hex);
    int rc = CLI_EXIT_OK;
    const char *policy_note = "";
    if (r.state == KILN_CACHE_UNSIGNED) {
        printf("signature %s: unsigned\n", path);
        const char *env = getenv("KILN_TRUSTED_KEYS");
        if (env && *env)
            policy_note = "unsigned";
    } else if (r.state == KILN_CACHE_SIGNATURE_VALID) {
        printf("signature %s: valid, key %s, %" PRIu64 " rows as signed%s\n", path, hex, r.rows,
               r.trusted == 1 ? ", trusted" : r.trusted == 0 ? ", not trusted" : "");
        if (r.trusted == 0)
            policy_note = "signed by a key KILN_TRUSTED_KEYS does not list";
    } else {
        char *shown = cli_escape(r.detail);
        printf("signature %s: invalid: %s\n", path, shown ? shown : "(out of memory)");
        free(shown);
        rc = cli_fail(cmd, "%s: the signature is invalid", path);
    }
    if (fflush(stdout) != 0 || ferror(stdout))
        return cli_fail(cmd, "cannot write the output");
    if (*policy_note)
        rc = cli_fail(cmd, "%s: %s: under this trust policy it would be skipped as a read-only layer", path,
                      policy_note);
    return rc;
}
