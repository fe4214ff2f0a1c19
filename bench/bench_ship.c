/* A shipped database, ready: open it as a read-only layer (beside an empty
 * writable database), create a runtime's jit, and acquire every kernel a
 * model needs (SQLite read + zstd + checksum + cuModuleLoadData each). The
 * time from kiln_cache_open to the last kernel loaded is what a new server
 * pays before its first request; the target is 20 ms for Llama-3-8B.
 *
 * Usage: bench_ship --db SHIPPED.db [--model config.json] [--runs 20]
 * The runtime (the CUDA context) is created once, outside the timing: a
 * process pays for it with or without kiln. Reported: the median over runs
 * and the first run alone (what a new process pays: nothing of kiln's is warm
 * yet); the target holds when both are within it and nothing was compiled.
 * The database must hold the model's kernels: a shipped database of another
 * model (or architecture) compiles, and the line says how many. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_common.h"
#include "kiln/kiln.h"

#define BENCH "ship"
#define TARGET_MS 20.0

static void fail(const char *phase, kiln_status st, const char *detail)
{
    bench_json_error(BENCH, phase, st ? kiln_status_code(st) : "bench", detail, kiln_errmsg());
    exit(1);
}

int main(int argc, char **argv)
{
    const char *db = NULL, *model = NULL;
    long runs = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--db") && i + 1 < argc)
            db = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc && (runs = bench_parse_positive(argv[++i])) > 0)
            ;
        else {
            fprintf(stderr, "usage: bench_ship --db SHIPPED.db [--model config.json] [--runs N]\n");
            return 2;
        }
    }
    if (!db) {
        fprintf(stderr, "bench_ship: --db is required\n");
        return 2;
    }
    const char *why = NULL;
    if (!kiln_driver_available(&why)) {
        bench_json j;
        bench_json_begin(&j, BENCH);
        bench_json_bool(&j, "peer", 0);
        bench_json_str(&j, "skipped", why ? why : "no driver");
        bench_json_end(&j);
        return 0;
    }
    kiln_model_config cfg;
    kiln_status st = model ? kiln_model_config_load(model, &cfg) : (kiln_model_config_default(&cfg), KILN_OK);
    if (st)
        fail("config", st, NULL);
    kiln_spec *specs = NULL;
    size_t n = 0;
    if ((st = kiln_model_specializations(&cfg, &specs, &n)))
        fail("specializations", st, NULL);
    kiln_runtime *rt;
    if ((st = kiln_runtime_create(NULL, &rt)))
        fail("runtime", st, NULL);
    char dir[] = "/tmp/kiln-bench-ship-XXXXXX", path[64];
    if (!mkdtemp(dir))
        fail("setup", KILN_OK, "mkdtemp failed");
    double *t = calloc((size_t)runs, sizeof *t);
    kiln_jit_counters last = {0};
    for (long r = 0; r < runs; r++) {
        snprintf(path, sizeof path, "%s/w%ld.db", dir, r);
        const char *layers[] = {db};
        double t0 = bench_now_us();
        kiln_cache_options co = {.path = path, .readonly_paths = layers, .n_readonly_paths = 1};
        kiln_cache *cache;
        kiln_jit *jit;
        if ((st = kiln_cache_open(&co, &cache)))
            fail("open", st, NULL);
        kiln_jit_options jo = {.cache = cache, .runtime = rt};
        if ((st = kiln_jit_create(&jo, &jit)))
            fail("jit", st, NULL);
        for (size_t i = 0; i < n; i++) {
            kiln_kernel *k;
            if ((st = kiln_jit_acquire(jit, &specs[i], &k)))
                fail("acquire", st, NULL);
        }
        t[r] = (bench_now_us() - t0) / 1e3;
        kiln_jit_get_counters(jit, &last);
        kiln_jit_destroy(jit);
        kiln_cache_close(cache);
        unlink(path);
        char side[80];
        snprintf(side, sizeof side, "%s-wal", path);
        unlink(side);
        snprintf(side, sizeof side, "%s-shm", path);
        unlink(side);
    }
    rmdir(dir);
    double first = t[0];
    bench_sort(t, (size_t)runs);
    double med = bench_quantile(t, (size_t)runs, 0.5);
    bench_json j;
    bench_json_begin(&j, BENCH);
    bench_json_bool(&j, "peer", 0);
    bench_json_str(&j, "phase", "ready");
    bench_json_str(&j, "model", cfg.name);
    bench_json_int(&j, "kernels", (long long)n);
    bench_json_int(&j, "runs", runs);
    bench_json_num(&j, "median_ms", med);
    bench_json_num(&j, "p10_ms", bench_quantile(t, (size_t)runs, 0.1));
    bench_json_num(&j, "p90_ms", bench_quantile(t, (size_t)runs, 0.9));
    bench_json_num(&j, "first_ms", first);
    bench_json_int(&j, "compiles", (long long)last.compiles);
    bench_json_int(&j, "database_hits", (long long)last.database_hits);
    bench_json_num(&j, "target_ms", TARGET_MS);
    bench_json_bool(&j, "meets_target", med <= TARGET_MS && first <= TARGET_MS && last.compiles == 0);
    bench_json_str(&j, "what", "kiln_cache_open (shipped layer + empty writable db) + kiln_jit_create + "
                               "kiln_jit_acquire of every kernel the model needs");
    bench_json_end(&j);
    kiln_runtime_info info;
    kiln_runtime_get_info(rt, &info);
    if (last.compiles)
        fprintf(stderr,
                "bench_ship: %s lacks %llu of the %zu kernels %s needs for %s: they were compiled, so this is "
                "not a shipped start (export the model: kiln export%s -o DB)\n",
                db, (unsigned long long)last.compiles, n, cfg.name, info.arch, model ? " --model CONFIG" : "");
    free(t);
    kiln_free(specs);
    kiln_runtime_destroy(rt);
    return 0;
}
