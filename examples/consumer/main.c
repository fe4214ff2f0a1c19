/* Compiles the token embedding kernel for a Qwen2.5-0.5B-sized model into a
 * cache database, offline (no GPU needed), through the installed library.
 * Usage: consumer DB_PATH */
#include <kiln/kiln.h>
#include <stdio.h>

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DB_PATH\n", argv[0]);
        return 2;
    }
    if (kiln_version_number() != KILN_VERSION_NUMBER) {
        fprintf(stderr, "header %u, library %u\n", KILN_VERSION_NUMBER, kiln_version_number());
        return 1;
    }
    kiln_cache_options co = {.path = argv[1]};
    kiln_cache *cache = NULL;
    kiln_jit *jit = NULL;
    kiln_spec spec;
    int compiled = 0, rc = 1;
    kiln_jit_options jo = {.arch = "sm_90"};
    if (kiln_cache_open(&co, &cache))
        goto out;
    jo.cache = cache;
    if (kiln_jit_create(&jo, &jit) || kiln_op_token_embedding_spec(KILN_DTYPE_F16, 151936, 896, 8, &spec) ||
        kiln_jit_prepare(jit, &spec, &compiled))
        goto out;
    printf("kiln %s: token_embedding for sm_90 %s\n", kiln_version_string(), compiled ? "compiled" : "cached");
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "error: %s\n", kiln_errmsg());
    kiln_jit_destroy(jit);
    kiln_cache_close(cache);
    return rc;
}
