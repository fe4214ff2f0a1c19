/* Helpers the kiln benchmarks share: a monotonic clock, order statistics and
 * one-line JSON output. Every function is static inline, so a benchmark that
 * uses only some of them still builds with -Wall -Wextra -Werror. */
#ifndef KILN_BENCH_COMMON_H
#define KILN_BENCH_COMMON_H

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Microseconds on CLOCK_MONOTONIC. */
static inline double bench_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Nanoseconds on CLOCK_MONOTONIC. */
static inline double bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v in place. */
static inline void bench_sort(double *v, size_t n) { qsort(v, n, sizeof *v, bench_cmp_double); }

/* The q-quantile (0..1) of sorted v, interpolated linearly between ranks. */
static inline double bench_quantile(const double *sorted, size_t n, double q)
{
    if (n == 0)
        return NAN;
    double pos = q * (double)(n - 1);
    size_t lo = (size_t)pos;
    if (lo + 1 >= n)
        return sorted[n - 1];
    double frac = pos - (double)lo;
    return sorted[lo] + (sorted[lo + 1] - sorted[lo]) * frac;
}

static inline double bench_mean(const double *v, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += v[i];
    return n ? s / (double)n : NAN;
}

/* ---- one JSON object per line ---- */

#define BENCH_JSON_CAP 16384

typedef struct bench_json {
    char buf[BENCH_JSON_CAP];
    size_t n;
    int fields;
} bench_json;

static inline void bench_json_raw(bench_json *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline void bench_json_raw(bench_json *j, const char *fmt, ...)
{
    if (j->n >= sizeof j->buf - 1)
        return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(j->buf + j->n, sizeof j->buf - j->n, fmt, ap);
    va_end(ap);
    if (w < 0)
        return;
    j->n += (size_t)w;
    if (j->n >= sizeof j->buf)
        j->n = sizeof j->buf - 1;
}

/* A JSON string literal of s (at most max_len source bytes, then "..."). */
static inline void bench_json_quote(bench_json *j, const char *s, size_t max_len)
{
    bench_json_raw(j, "\"");
    size_t i = 0;
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++, i++) {
        if (i >= max_len) {
            bench_json_raw(j, "...");
            break;
        }
        switch (*p) {
        case '"': bench_json_raw(j, "\\\""); break;
        case '\\': bench_json_raw(j, "\\\\"); break;
        case '\n': bench_json_raw(j, "\\n"); break;
        case '\r': bench_json_raw(j, "\\r"); break;
        case '\t': bench_json_raw(j, "\\t"); break;
        default:
            if (*p < 0x20 || *p >= 0x7f)
                bench_json_raw(j, "\\u%04x", (unsigned)*p); /* keeps the line ASCII and valid */
            else
                bench_json_raw(j, "%c", (char)*p);
        }
    }
    bench_json_raw(j, "\"");
}

static inline void bench_json_key(bench_json *j, const char *key)
{
    bench_json_raw(j, "%s\"%s\":", j->fields++ ? "," : "", key);
}

static inline void bench_json_begin(bench_json *j, const char *bench)
{
    j->n = 0;
    j->fields = 0;
    j->buf[0] = 0;
    bench_json_raw(j, "{");
    bench_json_key(j, "bench");
    bench_json_quote(j, bench, 64);
}

static inline void bench_json_str(bench_json *j, const char *key, const char *value)
{
    bench_json_key(j, key);
    bench_json_quote(j, value, 2000);
}

/* A number with 3 decimals; NaN and infinities become null. */
static inline void bench_json_num(bench_json *j, const char *key, double v)
{
    bench_json_key(j, key);
    if (isfinite(v))
        bench_json_raw(j, "%.3f", v);
    else
        bench_json_raw(j, "null");
}

static inline void bench_json_int(bench_json *j, const char *key, long long v)
{
    bench_json_key(j, key);
    bench_json_raw(j, "%lld", v);
}

static inline void bench_json_bool(bench_json *j, const char *key, int v)
{
    bench_json_key(j, key);
    bench_json_raw(j, "%s", v ? "true" : "false");
}

/* median_us, p10_us, p90_us, min_us, max_us, mean_us of v (sorted here). */
static inline void bench_json_stats_us(bench_json *j, double *v, size_t n)
{
    bench_sort(v, n);
    bench_json_num(j, "median_us", bench_quantile(v, n, 0.5));
    bench_json_num(j, "p10_us", bench_quantile(v, n, 0.1));
    bench_json_num(j, "p90_us", bench_quantile(v, n, 0.9));
    bench_json_num(j, "min_us", n ? v[0] : NAN);
    bench_json_num(j, "max_us", n ? v[n - 1] : NAN);
    bench_json_num(j, "mean_us", bench_mean(v, n));
}

/* Closes the object, prints it as one line and flushes. */
static inline void bench_json_end(bench_json *j)
{
    if (j->n > sizeof j->buf - 2)
        j->n = sizeof j->buf - 2;
    j->buf[j->n++] = '}';
    j->buf[j->n] = 0;
    fputs(j->buf, stdout);
    fputc('\n', stdout);
    fflush(stdout);
}

/* Parses a positive integer option value; 0 when it is not one. */
static inline long bench_parse_positive(const char *s)
{
    if (!s || !*s)
        return 0;
    char *end = NULL;
    long v = strtol(s, &end, 10);
    return (*end || v <= 0) ? 0 : v;
}

/* The error line every benchmark prints before it exits 1: the phase, the
 * element type when the benchmark has one (dtype NULL: none), the status
 * code and the detail (fallback, kiln_errmsg(), when detail is empty). */
static inline void bench_json_error_dtype(const char *bench, const char *dtype, const char *phase, const char *code,
                                          const char *detail, const char *fallback)
{
    bench_json j;
    bench_json_begin(&j, bench);
    bench_json_bool(&j, "peer", 0);
    if (dtype)
        bench_json_str(&j, "dtype", dtype);
    bench_json_str(&j, "phase", phase);
    bench_json_str(&j, "error", code);
    bench_json_str(&j, "message", detail && *detail ? detail : fallback);
    bench_json_end(&j);
}

static inline void bench_json_error(const char *bench, const char *phase, const char *code, const char *detail,
                                    const char *fallback)
{
    bench_json_error_dtype(bench, NULL, phase, code, detail, fallback);
}

/* xorshift64: the benchmarks' random inputs, reproducible from the state's seed. */
static inline uint64_t bench_xorshift64(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

#endif
