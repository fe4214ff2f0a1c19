/* A standalone main for kiln's fuzz targets, for builds without libFuzzer.
 *
 *   fuzz_xxx [--runs N] [--seed S] [--max-len BYTES] DIR_OR_FILE...
 *
 * Runs LLVMFuzzerTestOneInput once on every seed file (folders are read in
 * name order), then on N pseudo-random mutations of them. Everything is
 * deterministic: the same seed files, N and S give the same inputs. The
 * environment overrides the arguments, so CI can go longer without editing
 * the test: KILN_FUZZ_RUNS=N, KILN_FUZZ_SEED=S. When an input crashes the
 * target (a failed invariant aborts, a sanitizer reports), the input is
 * written to ./crash-<target>-<seed>-<run> first; run the target on that file
 * alone (--runs 0 FILE) to reproduce.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fuzz_common.h"

/* Present only in sanitizer builds. */
extern void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

#define DEFAULT_SEED 0x6b696c6e66757a7aull /* "kilnfuzz" */
#define DEFAULT_MAX_LEN (64u << 10)
#define MAX_SEED_FILE (16u << 20)

typedef struct input {
    uint8_t *p;
    size_t n;
    char *name;
} input;

static struct {
    const char *target;
    uint64_t seed;
    long run; /* -1 while running the seed files */
    const uint8_t *current;
    size_t current_size;
    const char *current_file; /* when the input is a seed file as it is */
    char crash_path[512];
} g;

/* ---- crash artifacts ---- */

static void write_current_input(void)
{
    ssize_t ignored;
    if (!g.current)
        return;
    if (g.current_file) {
        static const char msg[] = "\ndriver: the input that failed is the seed file ";
        ignored = write(2, msg, sizeof msg - 1);
        ignored = write(2, g.current_file, strlen(g.current_file));
        ignored = write(2, "\n", 1);
        (void)ignored;
        g.current = NULL;
        return;
    }
    snprintf(g.crash_path, sizeof g.crash_path, "crash-%s-%016" PRIx64 "-%ld", g.target, g.seed, g.run);
    int fd = open(g.crash_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return;
    size_t off = 0;
    while (off < g.current_size) {
        ssize_t k = write(fd, g.current + off, g.current_size - off);
        if (k <= 0)
            break;
        off += (size_t)k;
    }
    close(fd);
    static const char msg[] = "\ndriver: the input that failed is in ./";
    ignored = write(2, msg, sizeof msg - 1);
    ignored = write(2, g.crash_path, strlen(g.crash_path));
    ignored = write(2, "\n", 1);
    (void)ignored;
    g.current = NULL;
}

static void on_fatal_signal(int sig)
{
    write_current_input();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install_crash_handlers(void)
{
    if (__sanitizer_set_death_callback)
        __sanitizer_set_death_callback(write_current_input);
    signal(SIGABRT, on_fatal_signal); /* a failed FUZZ_CHECK; sanitizers leave SIGABRT alone */
    if (!__sanitizer_set_death_callback) {
        /* Without a sanitizer nobody else reports these. */
        signal(SIGSEGV, on_fatal_signal);
        signal(SIGBUS, on_fatal_signal);
        signal(SIGFPE, on_fatal_signal);
        signal(SIGILL, on_fatal_signal);
    }
}

/* ---- the PRNG: xorshift64*, seeded through splitmix64 ---- */

static uint64_t rng_state;

static void rng_seed(uint64_t s)
{
    uint64_t z = s + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    rng_state = (z ^ (z >> 31)) | 1;
}

static uint64_t rng(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}

/* Uniform in [0, n); 0 when n is 0. */
static size_t below(size_t n) { return n ? (size_t)(rng() % n) : 0; }

/* ---- seed files ---- */

static input *seeds;
static size_t n_seeds, cap_seeds;

static int read_file(const char *path, input *out)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "driver: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    uint8_t *buf = malloc(MAX_SEED_FILE);
    size_t n = buf ? fread(buf, 1, MAX_SEED_FILE, f) : 0;
    int bad = !buf || ferror(f);
    fclose(f);
    if (bad) {
        fprintf(stderr, "driver: cannot read %s\n", path);
        free(buf);
        return -1;
    }
    uint8_t *fit = realloc(buf, n ? n : 1);
    out->p = fit ? fit : buf;
    out->n = n;
    out->name = strdup(path);
    return 0;
}

static int add_seed(const char *path)
{
    if (n_seeds == cap_seeds) {
        cap_seeds = cap_seeds ? 2 * cap_seeds : 32;
        seeds = realloc(seeds, cap_seeds * sizeof *seeds);
        if (!seeds) {
            fprintf(stderr, "driver: out of memory\n");
            return -1;
        }
    }
    if (read_file(path, &seeds[n_seeds]) != 0)
        return -1;
    n_seeds++;
    return 0;
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int add_path(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        fprintf(stderr, "driver: %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode))
        return add_seed(path);
    DIR *d = opendir(path);
    if (!d) {
        fprintf(stderr, "driver: cannot list %s: %s\n", path, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            char **p = realloc(names, cap * sizeof *names);
            if (!p) {
                rc = -1;
                break;
            }
            names = p;
        }
        size_t len = strlen(path) + strlen(e->d_name) + 2;
        if (!(names[n] = malloc(len))) {
            rc = -1;
            break;
        }
        snprintf(names[n++], len, "%s/%s", path, e->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, by_name); /* readdir's order is the filesystem's */
    for (size_t i = 0; i < n; i++) {
        if (rc == 0 && stat(names[i], &sb) == 0 && S_ISREG(sb.st_mode))
            rc = add_seed(names[i]);
        free(names[i]);
    }
    free(names);
    return rc;
}

/* ---- mutations ---- */

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

/* Tokens of both targets' languages: config.json keys and values, zstd magic. */
static const char *const dictionary[] = {
    "\"vocab_size\":", "\"hidden_size\":", "\"intermediate_size\":", "\"num_attention_heads\":",
    "\"num_key_value_heads\":", "\"head_dim\":", "\"rms_norm_eps\":", "\"rope_theta\":",
    "\"tie_word_embeddings\":", "\"text_config\":{", "\"model_type\":", "null", "true", "false", "{", "}", "[", "]",
    ",", ":", "\"", "\\u0000", "\\ud800", "\xef\xbb\xbf", "1e-5", "-0", "1.5", "\x28\xb5\x2f\xfd",
    "\x50\x2a\x4d\x18", "\"rope_scaling\":{", "\"rope_parameters\":{", "\"rope_type\":", "\"factor\":",
    "\"yarn\"", "\"llama3\"", "\"dynamic\"", "\"dtype\":", "\"bfloat16\"", "\"sliding_window\":"};

/* What numbers become: the extremes a parser of sizes must survive. */
static const char *const extremes[] = {
    "0",        "-1",         "1e309",     "99999999999", "-0",        "1e-320",     "16777216",
    "16777217", "65536",      "65537",     "262145",      "1025",      "1.5",        "4096.0000000000001",
    "NaN",      "Infinity",   "-1e309",    "2147483648",  "4294967297", "9223372036854775807",
    "9223372036854775808",    "18446744073709551616", "1e12", "1000000000001", "5e-324", "0x10",
    "00012",    "1E+3",       "268435456", "268435457"};

/* Little-endian integers a binary header might hold. */
static const int64_t interesting[] = {0,          1,          -1,          2,          32,         127,
                                      128,        255,        256,         65535,      65536,      INT32_MAX,
                                      INT32_MIN,  (int64_t)1 << 32,        268435456,  268435457,  INT64_MAX,
                                      INT64_MIN};

static void ensure(buf *b, size_t n)
{
    if (n + 1 <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < n + 1)
        cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p) {
        fprintf(stderr, "driver: out of memory\n");
        exit(2);
    }
    b->p = p;
    b->cap = cap;
}

static void insert_at(buf *b, size_t at, const void *p, size_t n, size_t max_len)
{
    if (b->n + n > max_len)
        return;
    ensure(b, b->n + n);
    memmove(b->p + at + n, b->p + at, b->n - at);
    memcpy(b->p + at, p, n);
    b->n += n;
}

static void erase_at(buf *b, size_t at, size_t n)
{
    if (at + n > b->n)
        n = b->n - at;
    memmove(b->p + at, b->p + at + n, b->n - at - n);
    b->n -= n;
}

static int numeric(uint8_t c) { return (c >= '0' && c <= '9') || c == '.' || c == '-' || c == '+' || c == 'e' || c == 'E'; }

enum {
    M_BIT_FLIP,
    M_BYTE_SET,
    M_INSERT_BYTES,
    M_DELETE,
    M_TRUNCATE,
    M_SPLICE,
    M_NUMBER,
    M_DUPLICATE,
    M_DICTIONARY,
    M_INTEGER,
    M_COUNT
};
static const char *const mutation_names[M_COUNT] = {"bit flip", "byte set", "insert", "delete", "truncate",
                                                    "splice",   "number",   "duplicate", "dictionary", "integer"};
static unsigned long long mutation_counts[M_COUNT];

static void mutate(buf *b, size_t max_len)
{
    static const uint8_t special[] = {0, 0xff, 0x7f, 0x80, '"', '{', '}', '[', ']', ',', ':', '\\', '-', '.', 'e', ' '};
    int m = (int)below(M_COUNT);
    mutation_counts[m]++;
    switch (m) {
    case M_BIT_FLIP:
        if (b->n)
            b->p[below(b->n)] ^= (uint8_t)(1u << below(8));
        break;
    case M_BYTE_SET:
        if (b->n)
            b->p[below(b->n)] = rng() & 1 ? special[below(sizeof special)] : (uint8_t)rng();
        break;
    case M_INSERT_BYTES: {
        uint8_t tmp[8];
        size_t n = 1 + below(sizeof tmp);
        for (size_t i = 0; i < n; i++)
            tmp[i] = rng() & 1 ? special[below(sizeof special)] : (uint8_t)rng();
        insert_at(b, below(b->n + 1), tmp, n, max_len);
        break;
    }
    case M_DELETE:
        if (b->n)
            erase_at(b, below(b->n), 1 + below(16));
        break;
    case M_TRUNCATE:
        b->n = below(b->n + 1);
        break;
    case M_SPLICE: {
        const input *o = &seeds[below(n_seeds)];
        size_t keep = below(b->n + 1), from = below(o->n + 1), n = o->n - from;
        b->n = keep;
        if (keep + n > max_len)
            n = max_len - keep;
        insert_at(b, keep, o->p + from, n, max_len);
        break;
    }
    case M_NUMBER: {
        /* The first number at or after a random place becomes an extreme. */
        size_t at = below(b->n + 1);
        while (at < b->n && !(b->p[at] >= '0' && b->p[at] <= '9'))
            at++;
        if (at == b->n)
            break;
        size_t start = at, end = at;
        while (start > 0 && numeric(b->p[start - 1]))
            start--;
        while (end < b->n && numeric(b->p[end]))
            end++;
        const char *x = extremes[below(sizeof extremes / sizeof extremes[0])];
        erase_at(b, start, end - start);
        insert_at(b, start, x, strlen(x), max_len);
        break;
    }
    case M_DUPLICATE: {
        if (!b->n)
            break;
        size_t from = below(b->n), n = 1 + below(b->n - from);
        uint8_t *tmp = malloc(n);
        if (!tmp)
            break;
        memcpy(tmp, b->p + from, n);
        insert_at(b, below(b->n + 1), tmp, n, max_len);
        free(tmp);
        break;
    }
    case M_DICTIONARY: {
        const char *t = dictionary[below(sizeof dictionary / sizeof dictionary[0])];
        insert_at(b, below(b->n + 1), t, strlen(t), max_len);
        break;
    }
    case M_INTEGER: {
        uint64_t v = (uint64_t)interesting[below(sizeof interesting / sizeof interesting[0])];
        if (rng() & 1)
            v += (uint64_t)below(5) - 2; /* wraps: INT64_MAX + 1 is wanted too */
        uint8_t le[8];
        for (int i = 0; i < 8; i++)
            le[i] = (uint8_t)(v >> (8 * i));
        size_t width = (size_t)1 << below(4); /* 1, 2, 4 or 8 bytes */
        if (b->n >= width) {
            /* Mostly the start, where binary headers keep their sizes. */
            size_t at = rng() & 1 ? below(b->n - width + 1) : below(b->n - width < 16 ? b->n - width + 1 : 17);
            memcpy(b->p + at, le, width);
        }
        break;
    }
    }
}

/* ---- running ---- */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The target gets its own exact-size heap copy, so that ASan sees any read past it. */
static void run_one(const uint8_t *p, size_t n)
{
    uint8_t *copy = malloc(n ? n : 1);
    if (!copy) {
        fprintf(stderr, "driver: out of memory\n");
        exit(2);
    }
    if (n)
        memcpy(copy, p, n);
    g.current = copy;
    g.current_size = n;
    LLVMFuzzerTestOneInput(copy, n);
    g.current = NULL;
    free(copy);
}

static int parse_count(const char *s, const char *what, unsigned long long *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end || s[0] == '-') {
        fprintf(stderr, "driver: %s: not a count: %s\n", what, s);
        return -1;
    }
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    unsigned long long runs = 1000, seed = DEFAULT_SEED, max_len = DEFAULT_MAX_LEN;
    const char *slash = strrchr(argv[0], '/');
    g.target = slash ? slash + 1 : argv[0];
    int first_path = argc;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            if (parse_count(argv[++i], "--runs", &runs))
                return 2;
        } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            if (parse_count(argv[++i], "--seed", &seed))
                return 2;
        } else if (!strcmp(argv[i], "--max-len") && i + 1 < argc) {
            if (parse_count(argv[++i], "--max-len", &max_len) || !max_len)
                return 2;
        } else if (!strcmp(argv[i], "--")) {
            first_path = i + 1;
            break;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "usage: %s [--runs N] [--seed S] [--max-len BYTES] DIR_OR_FILE...\n", g.target);
            return 2;
        } else {
            first_path = i;
            break;
        }
    }
    const char *env;
    if ((env = getenv("KILN_FUZZ_RUNS")) && *env && parse_count(env, "KILN_FUZZ_RUNS", &runs))
        return 2;
    if ((env = getenv("KILN_FUZZ_SEED")) && *env && parse_count(env, "KILN_FUZZ_SEED", &seed))
        return 2;
    for (int i = first_path; i < argc; i++)
        if (add_path(argv[i]) != 0)
            return 2;
    if (!n_seeds) {
        fprintf(stderr, "driver: no seed files (give folders or files)\n");
        return 2;
    }
    g.seed = seed;
    install_crash_handlers();

    double t0 = now();
    size_t biggest = 0;
    g.run = -1;
    for (size_t i = 0; i < n_seeds; i++) {
        g.current_file = seeds[i].name;
        run_one(seeds[i].p, seeds[i].n);
        g.current_file = NULL;
        biggest = seeds[i].n > biggest ? seeds[i].n : biggest;
    }
    double t_seeds = now() - t0;

    rng_seed(seed);
    buf b = {0};
    for (unsigned long long r = 0; r < runs; r++) {
        g.run = (long)r;
        const input *s = &seeds[below(n_seeds)];
        size_t n = s->n < max_len ? s->n : (size_t)max_len;
        ensure(&b, n);
        if (n)
            memcpy(b.p, s->p, n);
        b.n = n;
        /* Mostly a few edits; sometimes many, to reach inputs far from any seed. */
        unsigned k = rng() % 8 ? 1 + (unsigned)below(4) : 1 + (unsigned)below(32);
        for (unsigned j = 0; j < k; j++)
            mutate(&b, (size_t)max_len);
        run_one(b.p, b.n);
        biggest = b.n > biggest ? b.n : biggest;
    }
    double total = now() - t0;

    printf("driver: %s: %zu seed files (%.2f s) + %llu mutated inputs, seed 0x%016llx, largest %zu bytes,"
           " %.2f s in all\n",
           g.target, n_seeds, t_seeds, runs, seed, biggest, total);
    printf("driver: mutations:");
    for (int m = 0; m < M_COUNT; m++)
        printf(" %s %llu%s", mutation_names[m], mutation_counts[m], m + 1 < M_COUNT ? "," : "\n");
    kiln_fuzz_summary(stdout);
    free(b.p);
    for (size_t i = 0; i < n_seeds; i++) {
        free(seeds[i].p);
        free(seeds[i].name);
    }
    free(seeds);
    return 0;
}
