/* Fuzz target: kiln_model_config_parse on a config.json from outside.
 *
 * Accepted configs must respect every documented limit, list their
 * specializations, and survive a round trip through JSON unchanged; rejected
 * ones must say KILN_ERR_CONFIG with a message. The input is copied so that it
 * ends against an unmapped page: cJSON is a system library that no sanitizer
 * instruments, and a read past len must still crash.
 *
 * The strict JSON check the parser runs first is held against cJSON and a
 * walk of its tree: what the parser accepts the check accepts; what the
 * check accepts cJSON reads whole, with no object holding a key twice, and
 * printed back it is strict again; an accepted config has the sizes that the
 * last occurrence of each field says (Python's json.load keeps the last).
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kiln/cache.h"
#include "kiln/model.h"
#include "model/json_strict.h"
#include "fuzz_common.h"

#define GUARDED_CAP (1u << 20)

static struct {
    unsigned long long inputs, accepted, rejected, oom, specs, strict;
} g_stats;

/* Returns a copy of data whose last byte sits just before a PROT_NONE page
 * (or a plain heap copy, which ASan still guards, for inputs past the cap). */
static const char *guarded_copy(const uint8_t *data, size_t size, char **heap)
{
    static uint8_t *region;
    static size_t page;
    *heap = NULL;
    if (!region) {
        page = (size_t)sysconf(_SC_PAGESIZE);
        void *p = mmap(NULL, GUARDED_CAP + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        FUZZ_CHECK(p != MAP_FAILED, "mmap of %u bytes failed", GUARDED_CAP + (unsigned)page);
        FUZZ_CHECK(mprotect((uint8_t *)p + GUARDED_CAP, page, PROT_NONE) == 0, "mprotect failed");
        region = p;
    }
    if (size <= GUARDED_CAP) {
        uint8_t *at = region + GUARDED_CAP - size;
        if (size)
            memcpy(at, data, size);
        return (const char *)at;
    }
    *heap = malloc(size);
    FUZZ_CHECK(*heap != NULL, "out of memory copying %zu bytes", size);
    memcpy(*heap, data, size);
    return *heap;
}

static void check_limits(const kiln_model_config *c)
{
    FUZZ_CHECK(memchr(c->name, 0, sizeof c->name) != NULL && c->name[0], "name not a non-empty C string");
    FUZZ_CHECK(c->vocab_size >= 1 && c->vocab_size <= KILN_MODEL_MAX_VOCAB, "vocab_size %lld",
               (long long)c->vocab_size);
    FUZZ_CHECK(c->hidden_size >= 1 && c->hidden_size <= KILN_MODEL_MAX_HIDDEN, "hidden_size %lld",
               (long long)c->hidden_size);
    FUZZ_CHECK(c->intermediate_size >= 1 && c->intermediate_size <= KILN_MODEL_MAX_INTERMEDIATE,
               "intermediate_size %lld", (long long)c->intermediate_size);
    FUZZ_CHECK(c->num_attention_heads >= 1 && c->num_attention_heads <= KILN_MODEL_MAX_HEADS,
               "num_attention_heads %lld", (long long)c->num_attention_heads);
    FUZZ_CHECK(c->num_key_value_heads >= 1 && c->num_key_value_heads <= KILN_MODEL_MAX_HEADS,
               "num_key_value_heads %lld", (long long)c->num_key_value_heads);
    FUZZ_CHECK(c->head_dim >= 1 && c->head_dim <= KILN_MODEL_MAX_HEAD_DIM, "head_dim %lld", (long long)c->head_dim);
    FUZZ_CHECK(c->num_attention_heads % c->num_key_value_heads == 0, "heads %lld, kv heads %lld",
               (long long)c->num_attention_heads, (long long)c->num_key_value_heads);
    FUZZ_CHECK(isfinite(c->rms_norm_eps) && c->rms_norm_eps > 0 && c->rms_norm_eps <= 1, "rms_norm_eps %.17g",
               c->rms_norm_eps);
    FUZZ_CHECK(isfinite(c->rope_theta) && c->rope_theta > 0, "rope_theta %.17g", c->rope_theta);
    FUZZ_CHECK(c->tie_word_embeddings == 0 || c->tie_word_embeddings == 1, "tie_word_embeddings %d",
               c->tie_word_embeddings);
    FUZZ_CHECK(c->dtype == KILN_DTYPE_F16 || c->dtype == KILN_DTYPE_BF16, "dtype %d", (int)c->dtype);
    FUZZ_CHECK(c->rope_dim >= 2 && c->rope_dim <= c->head_dim, "rope_dim %lld of head_dim %lld",
               (long long)c->rope_dim, (long long)c->head_dim);
    FUZZ_CHECK(c->partial_rotary_factor > 0 && c->partial_rotary_factor <= 1, "partial_rotary_factor %.17g",
               c->partial_rotary_factor);
    FUZZ_CHECK((unsigned)c->rope.type <= KILN_ROPE_LLAMA3, "rope type %d", (int)c->rope.type);
    FUZZ_CHECK(c->rope.type == KILN_ROPE_DEFAULT || (isfinite(c->rope.factor) && c->rope.factor > 0),
               "rope factor %.17g", c->rope.factor);
    FUZZ_CHECK(c->rope.type != KILN_ROPE_LLAMA3 || (c->rope.low_freq_factor > 0 &&
                                                    c->rope.high_freq_factor > c->rope.low_freq_factor),
               "llama3 low %.17g high %.17g", c->rope.low_freq_factor, c->rope.high_freq_factor);
    FUZZ_CHECK(c->max_position_embeddings >= 0 && c->max_position_embeddings <= KILN_MODEL_MAX_POSITIONS,
               "max_position_embeddings %lld", (long long)c->max_position_embeddings);
    FUZZ_CHECK(c->sliding_window >= 0 && c->sliding_window <= KILN_MODEL_MAX_POSITIONS, "sliding_window %lld",
               (long long)c->sliding_window);
    FUZZ_CHECK(c->qk_norm == 0 || c->qk_norm == 1, "qk_norm %d", c->qk_norm);
}

/* An accepted config's RoPE: its frequencies are computable, finite and
 * positive, for a short sequence and a long one (dynamic grows the base). */
static void check_rope(const kiln_model_config *c)
{
    float f[KILN_MODEL_MAX_HEAD_DIM / 2], s;
    const size_t n = (size_t)(c->rope_dim / 2);
    if (c->rope_dim % 2) {
        kiln_status st = kiln_model_rope_frequencies(c, 0, f, n, &s);
        FUZZ_CHECK(st == KILN_ERR_CONFIG && strstr(kiln_errmsg(), "even"), "odd rope_dim %lld: %s",
                   (long long)c->rope_dim, kiln_errmsg());
        return;
    }
    const int64_t lens[2] = {0, (int64_t)KILN_MODEL_MAX_POSITIONS};
    for (int k = 0; k < 2; k++) {
        kiln_status st = kiln_model_rope_frequencies(c, lens[k], f, n, &s);
        if (st == KILN_ERR_HOST_OUT_OF_MEMORY)
            return;
        /* An extreme but accepted theta or factor may underflow a float:
         * refused by name, never written as 0 or NaN. */
        if (st == KILN_ERR_CONFIG) {
            FUZZ_CHECK(strstr(kiln_errmsg(), "not a finite positive float") ||
                           strstr(kiln_errmsg(), "attention scaling"),
                       "frequencies of an accepted config: %s", kiln_errmsg());
            continue;
        }
        FUZZ_CHECK(st == KILN_OK, "frequencies of an accepted config: %s: %s", kiln_status_code(st), kiln_errmsg());
        for (size_t i = 0; i < n; i++)
            FUZZ_CHECK(isfinite(f[i]) && f[i] > 0, "inv_freq[%zu] = %g", i, (double)f[i]);
        FUZZ_CHECK(isfinite(s) && s > 0, "attention scaling %g", (double)s);
        if (c->rope.type != KILN_ROPE_YARN)
            FUZZ_CHECK(s == 1.0f, "attention scaling %g for rope type %d", (double)s, (int)c->rope.type);
    }
    kiln_status st = kiln_model_rope_frequencies(c, 0, f, n + 1, &s);
    FUZZ_CHECK(st == KILN_ERR_INVALID_ARGUMENT, "n = rope_dim / 2 + 1 was not refused");
}

/* A model kiln serves (include/kiln/model.h): dense, of a family it knows or
 * of none named; or a mixture of experts of a family it serves. */
static int servable(const kiln_model_config *c)
{
    static const char *const dense[] = {"llama", "mistral", "qwen2", "qwen3", "config", "llama-3-8b"};
    static const char *const moe[] = {"mixtral", "qwen2_moe", "qwen3_moe"};
    int known = 0;
    if (c->num_experts)
        for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++)
            known |= !strcmp(c->name, moe[i]);
    else
        for (size_t i = 0; i < sizeof dense / sizeof dense[0]; i++)
            known |= !strcmp(c->name, dense[i]);
    return known;
}

static void check_specializations(const kiln_model_config *given)
{
    kiln_spec *specs = (kiln_spec *)1;
    size_t count = 12345;
    kiln_status st = kiln_model_specializations(given, &specs, &count);
    kiln_model_config dense = *given;
    const kiln_model_config *c = given;
    /* A servable mixture of experts whose expert sizes the kernels cannot take
     * is refused by the expert operations, naming them. */
    const int moe_sizes = servable(given) && given->num_experts && st == KILN_ERR_RUNTIME_CONTRACT;
    if (moe_sizes)
        FUZZ_CHECK(strstr(kiln_errmsg(), "moe_"), "a MoE config refused, but not by the expert operations: %s",
                   kiln_errmsg());
    if (!servable(given) || moe_sizes) {
        /* Refused by name; the same sizes in kiln's layout are then listed. */
        FUZZ_CHECK(moe_sizes || (st == KILN_ERR_CONFIG && strstr(kiln_errmsg(), "model ")),
                   "an unservable config (%s, %lld experts) was not refused: %s", given->name,
                   (long long)given->num_experts, kiln_status_code(st));
        snprintf(dense.name, sizeof dense.name, "config");
        dense.num_experts = 0;
        c = &dense;
        specs = (kiln_spec *)1;
        st = kiln_model_specializations(c, &specs, &count);
    }
    if (st == KILN_ERR_HOST_OUT_OF_MEMORY) {
        g_stats.oom++;
        return;
    }
    FUZZ_CHECK(st == KILN_OK, "kiln_model_specializations on an accepted config: %s: %s", kiln_status_code(st),
               kiln_errmsg());
    FUZZ_CHECK(specs != NULL && count >= 1, "%zu specializations", count);
    for (size_t i = 0; i < count; i++) {
        FUZZ_CHECK(memchr(specs[i].template_id, 0, sizeof specs[i].template_id) && specs[i].template_id[0],
                   "spec %zu has no template id", i);
        FUZZ_CHECK(specs[i].n_constants <= KILN_SPEC_MAX_CONSTANTS, "spec %zu: %u constants", i,
                   specs[i].n_constants);
        char text[1024];
        st = kiln_spec_constants_text(&specs[i], text, sizeof text);
        FUZZ_CHECK(st == KILN_OK, "constants text of spec %zu: %s", i, kiln_errmsg());
        for (size_t j = 0; j < i; j++)
            FUZZ_CHECK(memcmp(&specs[i], &specs[j], sizeof specs[i]) != 0, "specs %zu and %zu are duplicates", j, i);
    }
    g_stats.specs += count;
    kiln_free(specs);
}

/* Writes s as a JSON string body (no quotes). */
static size_t json_escape(char *out, size_t cap, const char *s)
{
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char tmp[8];
        int k = (*p == '"' || *p == '\\' || *p < 0x20) ? snprintf(tmp, sizeof tmp, "\\u%04x", *p)
                                                       : snprintf(tmp, sizeof tmp, "%c", *p);
        if (n + (size_t)k + 1 > cap)
            break;
        memcpy(out + n, tmp, (size_t)k);
        n += (size_t)k;
    }
    out[n] = 0;
    return n;
}

/* What the parser accepted, printed back as JSON, must parse to the same config.
 * Fields a rope type does not read are 0, which the parser takes as absent. */
static void check_round_trip(const kiln_model_config *c)
{
    static const char *const rope_names[] = {"default", "linear", "dynamic", "yarn", "llama3"};
    /* 0 means absent for these; written as 0 the parser would refuse them. */
    char maxpos[32] = "null", attn[40] = "null";
    if (c->max_position_embeddings)
        snprintf(maxpos, sizeof maxpos, "%lld", (long long)c->max_position_embeddings);
    if (c->rope.attention_factor)
        snprintf(attn, sizeof attn, "%.17g", c->rope.attention_factor);
    char name[64 * 6 + 1], json[2048];
    json_escape(name, sizeof name, c->name);
    /* "config" is the name of a file without model_type: written without one. */
    const int named = strcmp(c->name, "config") != 0;
    int n = snprintf(json, sizeof json,
                     "{%s%s%s\"vocab_size\":%lld,\"hidden_size\":%lld,\"intermediate_size\":%lld,"
                     "\"num_attention_heads\":%lld,\"num_key_value_heads\":%lld,\"head_dim\":%lld,"
                     "\"rms_norm_eps\":%.17g,\"rope_theta\":%.17g,\"tie_word_embeddings\":%s,\"dtype\":\"%s\","
                     "\"architectures\":[\"%s\"],\"max_position_embeddings\":%s,\"sliding_window\":%lld,\"partial_rotary_factor\":%.17g,"
                     "\"rope_scaling\":{\"rope_type\":\"%s\",\"factor\":%.17g,\"original_max_position_embeddings\":%lld,"
                     "\"low_freq_factor\":%.17g,\"high_freq_factor\":%.17g,\"beta_fast\":%.17g,\"beta_slow\":%.17g,"
                     "\"attention_factor\":%s,\"mscale\":%.17g,\"mscale_all_dim\":%.17g,\"truncate\":%s}}",
                     named ? "\"model_type\":\"" : "", named ? name : "", named ? "\"," : "", (long long)c->vocab_size,
                     (long long)c->hidden_size, (long long)c->intermediate_size,
                     (long long)c->num_attention_heads, (long long)c->num_key_value_heads, (long long)c->head_dim,
                     c->rms_norm_eps, c->rope_theta, c->tie_word_embeddings ? "true" : "false",
                     c->dtype == KILN_DTYPE_BF16 ? "bfloat16" : "float16", c->qk_norm ? "Qwen3ForCausalLM" : "X", maxpos,
                     (long long)c->sliding_window, c->partial_rotary_factor, rope_names[c->rope.type], c->rope.factor,
                     (long long)c->rope.original_max_position_embeddings, c->rope.low_freq_factor,
                     c->rope.high_freq_factor, c->rope.beta_fast, c->rope.beta_slow, attn,
                     c->rope.mscale, c->rope.mscale_all_dim, c->rope.truncate ? "true" : "false");
    FUZZ_CHECK(n > 0 && (size_t)n < sizeof json, "round-trip JSON of %d bytes", n);
    kiln_model_config r;
    kiln_status st = kiln_model_config_parse(json, (size_t)n, &r);
    if (st == KILN_ERR_HOST_OUT_OF_MEMORY)
        return;
    FUZZ_CHECK(st == KILN_OK, "round trip of an accepted config rejected: %s\n  %s", kiln_errmsg(), json);
    FUZZ_CHECK(!strcmp(r.name, c->name) && r.vocab_size == c->vocab_size && r.hidden_size == c->hidden_size &&
                   r.intermediate_size == c->intermediate_size && r.num_attention_heads == c->num_attention_heads &&
                   r.num_key_value_heads == c->num_key_value_heads && r.head_dim == c->head_dim &&
                   r.rms_norm_eps == c->rms_norm_eps && r.rope_theta == c->rope_theta &&
                   r.tie_word_embeddings == c->tie_word_embeddings && r.dtype == c->dtype &&
                   r.rope_dim == c->rope_dim && r.partial_rotary_factor == c->partial_rotary_factor &&
                   !memcmp(&r.rope, &c->rope, sizeof r.rope) &&
                   r.max_position_embeddings == c->max_position_embeddings && r.sliding_window == c->sliding_window &&
                   r.qk_norm == c->qk_norm,
               "round trip changed the config\n  %s", json);
}

/* A key that one object of the tree holds twice, or NULL: the strict check's
 * rule, walked independently (past 4096 members an object is not compared). */
static const cJSON *repeated_key(const cJSON *item)
{
    size_t members = 0;
    for (const cJSON *c = item->child; c; c = c->next) {
        if (cJSON_IsObject(item) && ++members <= 4096)
            for (const cJSON *d = c->next; d; d = d->next)
                if (c->string && d->string && !strcmp(c->string, d->string))
                    return c;
        const cJSON *r = repeated_key(c);
        if (r)
            return r;
    }
    return NULL;
}

/* The last member of that name, as Python's json.load would keep it. */
static const cJSON *last_member(const cJSON *object, const char *name)
{
    const cJSON *found = NULL;
    for (const cJSON *c = object ? object->child : NULL; c; c = c->next)
        if (c->string && !strcmp(c->string, name))
            found = c;
    return found;
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static void check_strict(const char *json, size_t size, kiln_status parsed, const kiln_model_config *c)
{
    char what[256];
    kiln_status st = kiln__json_strict_check(json, size, 0, what, sizeof what);
    if (st == KILN_ERR_HOST_OUT_OF_MEMORY)
        return;
    if (st) {
        FUZZ_CHECK(st == KILN_ERR_CONFIG, "strict check status %s", kiln_status_code(st));
        FUZZ_CHECK(parsed != KILN_OK, "the config parser accepted what the strict check refuses: %s", what);
        /* The offset ends the text; a quoted string before it may hold " at byte " too. */
        const char *at = NULL;
        for (const char *p = strstr(what, " at byte "); p; p = strstr(p + 1, " at byte "))
            at = p;
        FUZZ_CHECK(at && strtoull(at + 9, NULL, 10) <= size, "strict refusal without an offset in the input: %s",
                   what);
        return;
    }
    g_stats.strict++;
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(json, size, &end, 0);
    FUZZ_CHECK(doc != NULL, "the strict check accepted what cJSON refuses (near byte %td)",
               end ? end - json : (ptrdiff_t)-1);
    for (const char *p = end; p && p < json + size; p++)
        FUZZ_CHECK(is_ws(*p), "the strict check accepted byte 0x%02x at %td after cJSON's value", (unsigned char)*p,
                   p - json);
    const cJSON *dup = repeated_key(doc);
    FUZZ_CHECK(dup == NULL, "the strict check accepted an object holding the key \"%s\" twice", dup->string);
    char *printed = cJSON_PrintUnformatted(doc);
    if (printed) {
        st = kiln__json_strict_check(printed, strlen(printed), 0, what, sizeof what);
        FUZZ_CHECK(st != KILN_ERR_CONFIG, "cJSON printed strict JSON back as: %s\n  %s", what, printed);
        cJSON_free(printed);
    }
    if (parsed == KILN_OK) {
        const cJSON *root = doc, *text = last_member(doc, "text_config");
        if (!last_member(doc, "hidden_size") && cJSON_IsObject(text))
            root = text;
        static const char *const fields[4] = {"vocab_size", "hidden_size", "intermediate_size",
                                              "num_attention_heads"};
        const int64_t got[4] = {c->vocab_size, c->hidden_size, c->intermediate_size, c->num_attention_heads};
        for (int i = 0; i < 4; i++) {
            const cJSON *v = last_member(root, fields[i]);
            FUZZ_CHECK(cJSON_IsNumber(v) && v->valuedouble == (double)got[i], "%s is %lld, its last member says %s",
                       fields[i], (long long)got[i], v && cJSON_IsNumber(v) ? "another number" : "no number");
        }
    }
    cJSON_Delete(doc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *heap;
    const char *json = guarded_copy(data, size, &heap);
    kiln_model_config cfg;
    g_stats.inputs++;
    kiln_status st = kiln_model_config_parse(json, size, &cfg);
    check_strict(json, size, st, &cfg);
    if (st == KILN_OK) {
        g_stats.accepted++;
        check_limits(&cfg);
        check_specializations(&cfg);
        check_rope(&cfg);
        check_round_trip(&cfg);
    } else if (st == KILN_ERR_HOST_OUT_OF_MEMORY) {
        g_stats.oom++;
    } else {
        const char *msg = kiln_errmsg();
        FUZZ_CHECK(st == KILN_ERR_CONFIG, "status %d (%s): %s", (int)st, kiln_status_code(st), msg);
        FUZZ_CHECK(msg && msg[0], "KILN_ERR_CONFIG with an empty kiln_errmsg()");
        /* The message quotes values shortened; it never echoes the whole input. */
        FUZZ_CHECK(strlen(msg) < 1024, "a message of %zu bytes", strlen(msg));
        g_stats.rejected++;
    }
    free(heap);
    return 0;
}

void kiln_fuzz_summary(FILE *f)
{
    fprintf(f,
            "fuzz_config: %llu inputs: %llu accepted (%llu specializations), %llu rejected, %llu out of memory; "
            "%llu strict JSON\n",
            g_stats.inputs, g_stats.accepted, g_stats.specs, g_stats.rejected, g_stats.oom, g_stats.strict);
}
