/* A strict JSON check (model/json_strict.h): one pass over the bytes, before
 * cJSON reads them, refusing what cJSON accepts but RFC 8259 and Python's
 * json.load do not. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/json_strict.h"

/* One object key: the object it belongs to, where its quote is, and its
 * decoded bytes in the scanner's key buffer. */
typedef struct key {
    size_t object, at, off, len;
    const unsigned char *bytes; /* set once the key buffer no longer moves */
} key;

typedef struct scanner {
    const unsigned char *s;
    size_t n, i;
    char *what;
    size_t cap;
    unsigned char *dec; /* decoded keys, back to back */
    size_t dec_len, dec_cap;
    key *keys;
    size_t n_keys, keys_cap;
    unsigned flags;
} scanner;

static kiln_status fail(scanner *sc, size_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static kiln_status fail(scanner *sc, size_t at, const char *fmt, ...)
{
    /* The offset always fits: the description is cut short for it. */
    char tail[40];
    int t = snprintf(tail, sizeof tail, " at byte %zu", at);
    size_t room = sc->cap > (size_t)t ? sc->cap - (size_t)t : 1;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(sc->what, room, fmt, ap);
    va_end(ap);
    size_t used = k < 0 ? 0 : (size_t)k < room ? (size_t)k : room - 1;
    snprintf(sc->what + used, sc->cap - used, "%s", tail);
    return KILN_ERR_CONFIG;
}

static kiln_status oom(scanner *sc)
{
    snprintf(sc->what, sc->cap, "out of memory");
    return KILN_ERR_HOST_OUT_OF_MEMORY;
}

/* The byte at s[at] for a message: 'x', or 0x1b when not printable. */
static const char *byte_text(const scanner *sc, size_t at, char buf[8])
{
    if (at >= sc->n)
        return "the end of the input";
    unsigned char c = sc->s[at];
    if (c >= 0x20 && c < 0x7f && c != '\'')
        snprintf(buf, 8, "'%c'", c);
    else
        snprintf(buf, 8, "0x%02x", c);
    return buf;
}

/* The raw text of the string starting at s[at] (its quote), shortened, with
 * bytes outside printable ASCII as \xNN: what a message quotes. */
static void raw_string(const scanner *sc, size_t at, char *buf, size_t cap)
{
    size_t n = 0;
    for (size_t i = at; i < sc->n && n + 8 < cap && i - at < 80; i++) {
        unsigned char c = sc->s[i];
        if (c >= 0x20 && c < 0x7f)
            buf[n++] = (char)c;
        else
            n += (size_t)snprintf(buf + n, cap - n, "\\x%02x", c);
        if (i > at && c == '"' && sc->s[i - 1] != '\\') {
            buf[n] = 0;
            return;
        }
    }
    snprintf(buf + n, cap - n, "...");
}

static int ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static void skip_ws(scanner *sc)
{
    while (sc->i < sc->n && ws(sc->s[sc->i]))
        sc->i++;
}

static kiln_status put(scanner *sc, const unsigned char *b, size_t k)
{
    if (sc->dec_len + k > sc->dec_cap) {
        size_t cap = sc->dec_cap ? sc->dec_cap * 2 : 256;
        while (cap < sc->dec_len + k)
            cap *= 2;
        unsigned char *p = realloc(sc->dec, cap);
        if (!p)
            return oom(sc);
        sc->dec = p;
        sc->dec_cap = cap;
    }
    memcpy(sc->dec + sc->dec_len, b, k);
    sc->dec_len += k;
    return KILN_OK;
}

static int hex4(const unsigned char *p, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i], d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f')
            d = (c | 0x20) - 'a' + 10;
        else
            return 0;
        v = v << 4 | d;
    }
    *out = v;
    return 1;
}

/* The length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no
 * overlong form, no surrogate, nothing past U+10FFFF), or 0. */
static size_t utf8_length(const scanner *sc, size_t i)
{
    const unsigned char *p = sc->s + i;
    size_t left = sc->n - i, k;
    unsigned lo = 0x80, hi = 0xbf;
    if (p[0] >= 0xc2 && p[0] <= 0xdf)
        k = 2;
    else if (p[0] >= 0xe0 && p[0] <= 0xef) {
        k = 3;
        lo = p[0] == 0xe0 ? 0xa0 : 0x80;
        hi = p[0] == 0xed ? 0x9f : 0xbf;
    } else if (p[0] >= 0xf0 && p[0] <= 0xf4) {
        k = 4;
        lo = p[0] == 0xf0 ? 0x90 : 0x80;
        hi = p[0] == 0xf4 ? 0x8f : 0xbf;
    } else
        return 0;
    if (left < k || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t j = 2; j < k; j++)
        if (p[j] < 0x80 || p[j] > 0xbf)
            return 0;
    return k;
}

/* The string whose quote is at s[i]; a key's decoded bytes go to the key
 * buffer. */
static kiln_status string(scanner *sc, int is_key)
{
    const size_t start = sc->i;
    char raw[128];
    sc->i++;
    for (;;) {
        if (sc->i >= sc->n)
            return fail(sc, start, "an unterminated string");
        const unsigned char c = sc->s[sc->i];
        unsigned char out[4];
        size_t k = 1;
        out[0] = c;
        if (c == '"') {
            sc->i++;
            return KILN_OK;
        }
        if (c < 0x20)
            return fail(sc, sc->i, "control byte 0x%02x inside a string (it must be escaped)", c);
        if (c == '\\') {
            if (sc->i + 1 >= sc->n)
                return fail(sc, start, "an unterminated string");
            const unsigned char e = sc->s[sc->i + 1];
            const char *simple = strchr("\"\\/bfnrt", e);
            if (e && simple) {
                static const unsigned char value[] = {'"', '\\', '/', '\b', '\f', '\n', '\r', '\t'};
                out[0] = value[simple - "\"\\/bfnrt"];
                sc->i += 2;
            } else if (e == 'u') {
                unsigned cp, low;
                if (sc->n - sc->i < 6 || !hex4(sc->s + sc->i + 2, &cp))
                    return fail(sc, sc->i, "\\u without four hex digits");
                if (cp == 0) {
                    raw_string(sc, start, raw, sizeof raw);
                    return fail(sc, sc->i, "\\u0000 in the string %s (a NUL would cut it short)", raw);
                }
                if (cp >= 0xdc00 && cp <= 0xdfff)
                    return fail(sc, sc->i, "a lone low surrogate \\u%04x", cp);
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    if (sc->n - sc->i < 12 || sc->s[sc->i + 6] != '\\' || sc->s[sc->i + 7] != 'u' ||
                        !hex4(sc->s + sc->i + 8, &low) || low < 0xdc00 || low > 0xdfff)
                        return fail(sc, sc->i, "a high surrogate \\u%04x without a low one", cp);
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
                    sc->i += 6;
                }
                sc->i += 6;
                if (cp < 0x80)
                    out[0] = (unsigned char)cp;
                else if (cp < 0x800) {
                    out[0] = (unsigned char)(0xc0 | cp >> 6);
                    out[1] = (unsigned char)(0x80 | (cp & 0x3f));
                    k = 2;
                } else if (cp < 0x10000) {
                    out[0] = (unsigned char)(0xe0 | cp >> 12);
                    out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
                    out[2] = (unsigned char)(0x80 | (cp & 0x3f));
                    k = 3;
                } else {
                    out[0] = (unsigned char)(0xf0 | cp >> 18);
                    out[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
                    out[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
                    out[3] = (unsigned char)(0x80 | (cp & 0x3f));
                    k = 4;
                }
            } else {
                char b[8];
                return fail(sc, sc->i, "the escape \\ followed by %s", byte_text(sc, sc->i + 1, b));
            }
        } else if (c >= 0x80) {
            if (!(k = utf8_length(sc, sc->i)))
                return fail(sc, sc->i, "byte 0x%02x that is not well-formed UTF-8", c);
            memcpy(out, sc->s + sc->i, k);
            sc->i += k;
        } else {
            sc->i++;
        }
        if (is_key) {
            kiln_status st = put(sc, out, k);
            if (st)
                return st;
        }
    }
}

static int digit(const scanner *sc, size_t i) { return i < sc->n && sc->s[i] >= '0' && sc->s[i] <= '9'; }

/* A number by RFC 8259's grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static kiln_status number(scanner *sc)
{
    const size_t start = sc->i;
    char b[8];
    if (sc->s[sc->i] == '-')
        sc->i++;
    if (!digit(sc, sc->i))
        return fail(sc, sc->i, "%s where a number's digits were expected", byte_text(sc, sc->i, b));
    if (sc->s[sc->i] == '0' && digit(sc, sc->i + 1))
        return fail(sc, start, "a number with a leading zero");
    while (digit(sc, sc->i))
        sc->i++;
    if (sc->i < sc->n && sc->s[sc->i] == '.') {
        if (!digit(sc, ++sc->i))
            return fail(sc, sc->i, "%s where a fraction's digits were expected", byte_text(sc, sc->i, b));
        while (digit(sc, sc->i))
            sc->i++;
    }
    if (sc->i < sc->n && (sc->s[sc->i] == 'e' || sc->s[sc->i] == 'E')) {
        sc->i++;
        if (sc->i < sc->n && (sc->s[sc->i] == '+' || sc->s[sc->i] == '-'))
            sc->i++;
        if (!digit(sc, sc->i))
            return fail(sc, sc->i, "%s where an exponent's digits were expected", byte_text(sc, sc->i, b));
        while (digit(sc, sc->i))
            sc->i++;
    }
    return KILN_OK;
}

/* A key of the object numbered object: its string, remembered. */
static kiln_status object_key(scanner *sc, size_t object)
{
    char b[8];
    if (sc->i >= sc->n || sc->s[sc->i] != '"')
        return fail(sc, sc->i, "%s where an object key (a string) was expected", byte_text(sc, sc->i, b));
    if (sc->n_keys == sc->keys_cap) {
        size_t cap = sc->keys_cap ? sc->keys_cap * 2 : 64;
        key *p = realloc(sc->keys, cap * sizeof *p);
        if (!p)
            return oom(sc);
        sc->keys = p;
        sc->keys_cap = cap;
    }
    key *k = &sc->keys[sc->n_keys];
    k->object = object;
    k->at = sc->i;
    k->off = sc->dec_len;
    kiln_status st = string(sc, 1);
    if (st)
        return st;
    k->len = sc->dec_len - k->off;
    sc->n_keys++;
    skip_ws(sc);
    if (sc->i >= sc->n || sc->s[sc->i] != ':')
        return fail(sc, sc->i, "%s where ':' was expected after an object key", byte_text(sc, sc->i, b));
    sc->i++;
    return KILN_OK;
}

static int by_key(const void *a, const void *b)
{
    const key *x = a, *y = b;
    if (x->object != y->object)
        return x->object < y->object ? -1 : 1;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = n ? memcmp(x->bytes, y->bytes, n) : 0;
    if (c)
        return c;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return (x->at > y->at) - (x->at < y->at);
}

/* Two equal keys of one object: the first such pair in file order. */
static kiln_status duplicates(scanner *sc)
{
    if (sc->n_keys < 2)
        return KILN_OK;
    key *keys = sc->keys;
    for (size_t i = 0; i < sc->n_keys; i++)
        keys[i].bytes = sc->dec ? sc->dec + keys[i].off : NULL;
    qsort(keys, sc->n_keys, sizeof *keys, by_key);
    size_t best = SIZE_MAX, first = 0, group = 0;
    /* Object 0 is the outermost container; its keys sort first. */
    while ((sc->flags & KILN__JSON_TOP_KEYS_MAY_REPEAT) && group < sc->n_keys && !keys[group].object)
        group++;
    for (size_t i = group + 1; i < sc->n_keys; i++) {
        const key *a = &keys[i - 1], *b = &keys[i];
        if (a->object == b->object && a->len == b->len && (!a->len || !memcmp(a->bytes, b->bytes, a->len))) {
            if (b->at < best) {
                best = b->at;
                first = keys[group].at;
            }
        } else {
            group = i;
        }
    }
    if (best == SIZE_MAX)
        return KILN_OK;
    char raw[128];
    raw_string(sc, best, raw, sizeof raw);
    return fail(sc, best, "a second key %s in one object (the first is at byte %zu)", raw, first);
}

static kiln_status scan(scanner *sc)
{
    unsigned char kind[KILN__JSON_MAX_DEPTH]; /* '{' or '[' per open level */
    size_t object[KILN__JSON_MAX_DEPTH], depth = 0, objects = 0;
    char b[8];
    kiln_status st;
    if (sc->n >= 3 && !memcmp(sc->s, "\xef\xbb\xbf", 3))
        return fail(sc, 0, "a UTF-8 byte order mark (JSON text must not begin with one)");
value:
    skip_ws(sc);
    if (sc->i >= sc->n)
        return fail(sc, sc->i, "the end of the input where a value was expected");
    switch (sc->s[sc->i]) {
    case '{':
    case '[':
        if (depth == KILN__JSON_MAX_DEPTH)
            return fail(sc, sc->i, "nesting deeper than %d", KILN__JSON_MAX_DEPTH);
        kind[depth] = sc->s[sc->i];
        object[depth] = objects++;
        depth++;
        sc->i++;
        skip_ws(sc);
        if (sc->i < sc->n && sc->s[sc->i] == (kind[depth - 1] == '{' ? '}' : ']')) {
            sc->i++;
            depth--;
            goto after;
        }
        if (kind[depth - 1] == '{' && (st = object_key(sc, object[depth - 1])))
            return st;
        goto value;
    case '"':
        if ((st = string(sc, 0)))
            return st;
        goto after;
    case 't':
    case 'f':
    case 'n': {
        const char *word = sc->s[sc->i] == 't' ? "true" : sc->s[sc->i] == 'f' ? "false" : "null";
        size_t k = strlen(word);
        if (sc->n - sc->i < k || memcmp(sc->s + sc->i, word, k))
            return fail(sc, sc->i, "a word that is not %s", word);
        sc->i += k;
        goto after;
    }
    default:
        if (sc->s[sc->i] == '-' || digit(sc, sc->i)) {
            if ((st = number(sc)))
                return st;
            goto after;
        }
        return fail(sc, sc->i, "%s where a value was expected", byte_text(sc, sc->i, b));
    }
after:
    skip_ws(sc);
    if (!depth) {
        if (sc->i < sc->n)
            return fail(sc, sc->i, "%s after the end of the JSON value", byte_text(sc, sc->i, b));
        return duplicates(sc);
    }
    const unsigned char close = kind[depth - 1] == '{' ? '}' : ']';
    if (sc->i < sc->n && sc->s[sc->i] == ',') {
        sc->i++;
        if (kind[depth - 1] == '{') {
            skip_ws(sc);
            if ((st = object_key(sc, object[depth - 1])))
                return st;
        }
        goto value;
    }
    if (sc->i < sc->n && sc->s[sc->i] == close) {
        sc->i++;
        depth--;
        goto after;
    }
    return fail(sc, sc->i, "%s where ',' or '%c' was expected", byte_text(sc, sc->i, b), close);
}

kiln_status kiln__json_strict_check(const char *text, size_t len, unsigned flags, char *what, size_t cap)
{
    char spare[8];
    scanner sc = {.s = (const unsigned char *)text, .n = text ? len : 0, .what = cap ? what : spare,
                  .cap = cap ? cap : sizeof spare, .flags = flags};
    sc.what[0] = 0;
    kiln_status st = scan(&sc);
    free(sc.dec);
    free(sc.keys);
    return st;
}
