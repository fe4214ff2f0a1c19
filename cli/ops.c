/* kiln ls-ops: the operation catalog (kiln_op_catalog). */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#define CMD "ls-ops"

static const char help_text[] =
    "usage: kiln ls-ops [--json]\n"
    "\n"
    "Lists the operations kiln provides, one line each: op id, provider version,\n"
    "the capabilities it needs of a runtime, its element types, its batching\n"
    "forms, its workspace estimator ('-' for none) and its kernels' template ids.\n"
    "\n"
    "options:\n"
    "  -J, --json   print one JSON array of objects with the keys id, version,\n"
    "               capabilities, dtypes, batching, templates (arrays of names),\n"
    "               workspace (the estimator's name, or null)\n"
    "  -h, --help   print this help and exit\n"
    "\n"
    "exit status: 0 success; 1 the output could not be written; 2 a usage error.\n";

/* The names of a bit set's members, by bit. */
typedef struct bit_name {
    uint32_t bit;
    const char *name;
} bit_name;

static const bit_name cap_names[] = {{KILN_CAP_LAUNCH, "launch"},     {KILN_CAP_TIMING, "timing"},
                                     {KILN_CAP_GRAPHS, "graphs"},     {KILN_CAP_CUBLASLT, "cublaslt"},
                                     {KILN_CAP_F16, "f16"},           {KILN_CAP_BF16, "bf16"},
                                     {KILN_CAP_PAGED_KV, "paged_kv"}};
static const bit_name batching_names[] = {{1u << KILN_BATCHING_SCALAR, "scalar"},
                                          {1u << KILN_BATCHING_PARTICIPANT_LOOP, "participant_loop"},
                                          {1u << KILN_BATCHING_PACKED, "packed"}};

/* The dtype bits' names (kiln_dtype_name). */
static const char *dtype_bit_name(uint32_t bit, char *buf, size_t cap)
{
    for (int t = 0; t < 32; t++)
        if (bit == 1u << t)
            return kiln_dtype_name((kiln_dtype)t);
    snprintf(buf, cap, "0x%x", (unsigned)bit);
    return buf;
}

/* Calls add for each member's name of set (dtypes: names is NULL). */
static int each_name(uint32_t set, const bit_name *names, size_t n, int (*add)(void *, const char *), void *user)
{
    char buf[16];
    for (int b = 0; b < 32; b++) {
        const uint32_t bit = 1u << b;
        if (!(set & bit))
            continue;
        const char *name = NULL;
        for (size_t i = 0; names && i < n; i++)
            if (names[i].bit == bit)
                name = names[i].name;
        if (!names)
            name = dtype_bit_name(bit, buf, sizeof buf);
        if (!name) {
            snprintf(buf, sizeof buf, "0x%x", (unsigned)bit);
            name = buf;
        }
        if (add(user, name))
            return 1;
    }
    return 0;
}

typedef struct text_list {
    char *buf;
    size_t cap, n;
} text_list;

static int add_text(void *user, const char *name)
{
    text_list *t = user;
    int w = snprintf(t->buf + t->n, t->cap - t->n, "%s%s", t->n ? "," : "", name);
    if (w < 0 || (size_t)w >= t->cap - t->n)
        return 1;
    t->n += (size_t)w;
    return 0;
}

static int add_json(void *user, const char *name) { return !cJSON_AddItemToArray(user, cJSON_CreateString(name)); }

static const char *set_text(uint32_t set, const bit_name *names, size_t n, char *buf, size_t cap)
{
    text_list t = {buf, cap, 0};
    buf[0] = 0;
    each_name(set, names, n, add_text, &t);
    return t.n ? buf : "-";
}

static cJSON *set_json(uint32_t set, const bit_name *names, size_t n)
{
    cJSON *a = cJSON_CreateArray();
    if (a && each_name(set, names, n, add_json, a)) {
        cJSON_Delete(a);
        return NULL;
    }
    return a;
}

/* The templates as a JSON array (the field is space-separated). */
static cJSON *templates_json(const char *templates)
{
    cJSON *a = cJSON_CreateArray();
    for (const char *p = templates; a && p && *p;) {
        size_t len = strcspn(p, " ");
        char name[KILN_NAME_MAX];
        snprintf(name, sizeof name, "%.*s", (int)len, p);
        if (len && !cJSON_AddItemToArray(a, cJSON_CreateString(name))) {
            cJSON_Delete(a);
            return NULL;
        }
        p += len + (p[len] == ' ');
    }
    return a;
}

static cJSON *op_json(const kiln_op_info *op)
{
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddStringToObject(o, "id", op->id) || !cJSON_AddNumberToObject(o, "version", op->version) ||
        !cJSON_AddItemToObject(o, "capabilities", set_json(op->capabilities, cap_names, 7)) ||
        !cJSON_AddItemToObject(o, "dtypes", set_json(op->dtypes, NULL, 0)) ||
        !cJSON_AddItemToObject(o, "batching", set_json(op->batching, batching_names, 3)) ||
        !cJSON_AddItemToObject(o, "templates", templates_json(op->templates)) ||
        !(op->workspace ? cJSON_AddStringToObject(o, "workspace", op->workspace)
                        : cJSON_AddNullToObject(o, "workspace"))) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

int cli_ls_ops(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"json", no_argument, NULL, 'J'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    int c, json = 0;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":Jh", longopts, NULL)) != -1) {
        switch (c) {
        case 'J':
            json = 1;
            break;
        case 'h':
            fputs(help_text, stdout);
            return CLI_EXIT_OK;
        default:
            return cli_getopt_error(CMD, c, argv);
        }
    }
    if (optind < argc)
        return cli_usage_error(CMD, "unexpected argument '%s'", argv[optind]);
    size_t n = 0;
    if (kiln_op_catalog(NULL, &n) != KILN_OK)
        return cli_fail(CMD, "%s", kiln_errmsg());
    kiln_op_info *ops = calloc(n ? n : 1, sizeof *ops);
    if (!ops)
        return cli_fail(CMD, "out of memory");
    ops[0].size = sizeof *ops;
    int rc = CLI_EXIT_OK;
    if (kiln_op_catalog(ops, &n) != KILN_OK) {
        rc = cli_fail(CMD, "%s", kiln_errmsg());
        goto out;
    }
    if (json) {
        cJSON *doc = cJSON_CreateArray();
        for (size_t i = 0; doc && i < n; i++)
            if (!cJSON_AddItemToArray(doc, op_json(&ops[i]))) {
                cJSON_Delete(doc);
                doc = NULL;
            }
        char *text = doc ? cJSON_Print(doc) : NULL;
        cJSON_Delete(doc);
        if (!text) {
            rc = cli_fail(CMD, "out of memory building the JSON output");
            goto out;
        }
        puts(text);
        cJSON_free(text);
    } else {
        for (size_t i = 0; i < n; i++) {
            char caps[128], types[64], forms[64];
            printf("%-18s %u %-26s %-4s %-6s %-36s %s\n", ops[i].id, (unsigned)ops[i].version,
                   set_text(ops[i].capabilities, cap_names, 7, caps, sizeof caps),
                   set_text(ops[i].dtypes, NULL, 0, types, sizeof types),
                   set_text(ops[i].batching, batching_names, 3, forms, sizeof forms),
                   ops[i].workspace ? ops[i].workspace : "-", ops[i].templates);
        }
    }
    if (fflush(stdout) != 0 || ferror(stdout))
        rc = cli_fail(CMD, "cannot write the output");
out:
    free(ops);
    return rc;
}
