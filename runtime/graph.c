/* The graph executable cache of a stream: segment keys, lookup, LRU capacity
 * by count and by device memory, rejected segments, statistics. What is
 * captured and how it is launched lives in submit.c; this file only keeps
 * executables. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"

#define DEFAULT_MAX_GRAPHS 256
#define DEFAULT_MAX_BYTES ((size_t)1 << 30)
#define MAX_REJECTED 256
#define MIN_TABLE 64

static const uint32_t default_buckets[] = {1, 2, 4, 8, 16, 32, 64};

struct kiln__graph {
    kiln_runtime *rt;            /* for the driver when the last reference goes */
    int refs;                    /* the cache's + each batch (or plan) that launches it */
    int resident;                /* in the cache's table (and list) */
    uint64_t hash;
    uint64_t epoch;              /* the runtime's module epoch at capture */
    uint64_t call;               /* the last submission (or prepare) that used it */
    uint8_t *key;                /* the commands' keys, each as u32 length + bytes */
    size_t key_bytes;
    uint32_t n_cmds;
    CUgraphExec exec;            /* NULL: a rejected segment */
    size_t bytes;
    struct kiln__graph *hnext;   /* hash chain */
    struct kiln__graph *prev, *next; /* the LRU list (resident) or the rejected FIFO */
};

struct kiln__graph_cache {
    kiln_runtime *rt;
    kiln__graph **table;
    size_t table_size, n_entries;
    /* Most recently used first. */
    kiln__graph *lru_head, *lru_tail;
    kiln__graph *rej_head, *rej_tail;
    size_t n_resident, resident_bytes, n_rejected;
    size_t max_graphs, max_bytes;
    int capture;                 /* 0: the adaptive path never captures (the runtime's own stream) */
    uint64_t call;               /* the current submission or prepare: what it uses is not evicted by it */
    uint32_t buckets[KILN_MAX_BATCH_BUCKETS];
    size_t n_buckets;
    kiln_graph_stats stats;
};

/* ---- hashing ---- */

static uint64_t mix(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

uint64_t kiln__key_hash(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (n * 0x100000001b3ULL);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ mix(w)) * 0x100000001b3ULL;
        h = (h << 29) | (h >> 35);
    }
    uint64_t tail = 0;
    memcpy(&tail, b + i, n - i);
    return mix(h ^ mix(tail ^ (uint64_t)(n - i) << 56));
}

uint64_t kiln__segment_hash(kiln_command *const *cmds, uint32_t first, uint32_t last)
{
    uint64_t h = 0x2545f4914f6cdd1dULL ^ (uint64_t)(last - first + 1);
    for (uint32_t i = first; i <= last; i++)
        h = mix(h ^ cmds[i]->key_hash) + 0x9e3779b97f4a7c15ULL;
    return h;
}

static int same_key(const kiln__graph *g, kiln_command *const *cmds, uint32_t first, uint32_t last)
{
    if (g->n_cmds != last - first + 1)
        return 0;
    const uint8_t *p = g->key, *end = g->key + g->key_bytes;
    for (uint32_t i = first; i <= last; i++) {
        uint32_t len;
        if ((size_t)(end - p) < sizeof len)
            return 0;
        memcpy(&len, p, sizeof len);
        p += sizeof len;
        if (len != cmds[i]->replay_key_bytes || (size_t)(end - p) < len || memcmp(p, cmds[i]->replay_key, len))
            return 0;
        p += len;
    }
    return p == end;
}

/* ---- lists ---- */

static void list_unlink(kiln__graph **head, kiln__graph **tail, kiln__graph *g)
{
    if (g->prev)
        g->prev->next = g->next;
    else
        *head = g->next;
    if (g->next)
        g->next->prev = g->prev;
    else
        *tail = g->prev;
    g->prev = g->next = NULL;
}

static void list_push_front(kiln__graph **head, kiln__graph **tail, kiln__graph *g)
{
    g->prev = NULL;
    g->next = *head;
    if (*head)
        (*head)->prev = g;
    *head = g;
    if (!*tail)
        *tail = g;
}

/* ---- references ---- */

void kiln__graph_ref(kiln__graph *g) { g->refs++; }

void kiln__graph_unref(kiln__graph *g)
{
    if (!g || --g->refs > 0)
        return;
    if (g->exec && kiln__runtime_usable(g->rt))
        g->rt->d->cuGraphExecDestroy(g->exec);
    free(g->key);
    free(g);
}

CUgraphExec kiln__graph_exec(const kiln__graph *g) { return g->exec; }

/* ---- the cache ---- */

kiln_status kiln__graph_cache_create(kiln_runtime *rt, kiln__graph_cache **out)
{
    kiln__graph_cache *c = calloc(1, sizeof *c);
    if (c)
        c->table = calloc(MIN_TABLE, sizeof *c->table);
    if (!c || !c->table) {
        free(c);
        *out = NULL;
        return kiln__fail(&rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a graph cache");
    }
    c->rt = rt;
    c->table_size = MIN_TABLE;
    c->max_graphs = DEFAULT_MAX_GRAPHS;
    c->max_bytes = DEFAULT_MAX_BYTES;
    c->capture = 1;
    memcpy(c->buckets, default_buckets, sizeof default_buckets);
    c->n_buckets = sizeof default_buckets / sizeof default_buckets[0];
    *out = c;
    return KILN_OK;
}

/* Takes g out of the table and its list, dropping the cache's reference. */
static void drop(kiln__graph_cache *c, kiln__graph *g, int count_eviction)
{
    kiln__graph **pp = &c->table[g->hash & (c->table_size - 1)];
    while (*pp && *pp != g)
        pp = &(*pp)->hnext;
    if (*pp)
        *pp = g->hnext;
    g->hnext = NULL;
    c->n_entries--;
    if (g->exec) {
        list_unlink(&c->lru_head, &c->lru_tail, g);
        c->n_resident--;
        c->resident_bytes -= g->bytes;
        if (count_eviction)
            c->stats.evicted++;
    } else {
        list_unlink(&c->rej_head, &c->rej_tail, g);
        c->n_rejected--;
    }
    g->resident = 0;
    kiln__graph_unref(g);
}

void kiln__graph_cache_destroy(kiln__graph_cache *c)
{
    if (!c)
        return;
    while (c->lru_head)
        drop(c, c->lru_head, 0);
    while (c->rej_head)
        drop(c, c->rej_head, 0);
    free(c->table);
    free(c);
}

/* Evicts from the cold end until the capacity holds. With protect, graphs the
 * current call uses stay (the capacity holds again at a later call): a batch
 * must not evict the graph it is about to launch. */
static void enforce(kiln__graph_cache *c, size_t max_graphs, size_t max_bytes, int protect)
{
    kiln__graph *g = c->lru_tail;
    while (g && (c->n_resident > max_graphs || c->resident_bytes > max_bytes)) {
        kiln__graph *prev = g->prev;
        if (!protect || g->call != c->call)
            drop(c, g, 1);
        g = prev;
    }
}

void kiln__graph_cache_begin_call(kiln__graph_cache *c) { c->call++; }
void kiln__graph_use(kiln__graph_cache *c, kiln__graph *g) { g->call = c->call; }

static void grow(kiln__graph_cache *c)
{
    size_t n = c->table_size * 2;
    kiln__graph **t = calloc(n, sizeof *t);
    if (!t)
        return; /* longer chains, still correct */
    for (size_t i = 0; i < c->table_size; i++) {
        kiln__graph *g = c->table[i];
        while (g) {
            kiln__graph *next = g->hnext;
            g->hnext = t[g->hash & (n - 1)];
            t[g->hash & (n - 1)] = g;
            g = next;
        }
    }
    free(c->table);
    c->table = t;
    c->table_size = n;
}

kiln__graph *kiln__graph_find(kiln__graph_cache *c, kiln_command *const *cmds, uint32_t first, uint32_t last,
                              uint64_t hash, int *rejected)
{
    *rejected = 0;
    uint64_t epoch = atomic_load(&c->rt->module_epoch);
    kiln__graph *g = c->table[hash & (c->table_size - 1)];
    while (g) {
        kiln__graph *next = g->hnext;
        if (g->hash == hash && same_key(g, cmds, first, last)) {
            if (g->exec && g->epoch != epoch) {
                drop(c, g, 1); /* captured before a module it may use was unloaded */
                return NULL;
            }
            if (!g->exec) {
                *rejected = 1;
                return NULL;
            }
            return g;
        }
        g = next;
    }
    return NULL;
}

void kiln__graph_hit(kiln__graph_cache *c, kiln__graph *g)
{
    c->stats.hits++;
    g->call = c->call;
    if (g->resident && c->lru_head != g) {
        list_unlink(&c->lru_head, &c->lru_tail, g);
        list_push_front(&c->lru_head, &c->lru_tail, g);
    }
}

static kiln__graph *entry_new(kiln__graph_cache *c, kiln_command *const *cmds, uint32_t first, uint32_t last,
                              uint64_t hash)
{
    size_t bytes = 0;
    for (uint32_t i = first; i <= last; i++)
        bytes += sizeof(uint32_t) + cmds[i]->replay_key_bytes;
    kiln__graph *g = calloc(1, sizeof *g);
    if (!g || !(g->key = malloc(bytes ? bytes : 1))) {
        free(g);
        return NULL;
    }
    uint8_t *p = g->key;
    for (uint32_t i = first; i <= last; i++) {
        uint32_t len = (uint32_t)cmds[i]->replay_key_bytes;
        memcpy(p, &len, sizeof len);
        memcpy(p + sizeof len, cmds[i]->replay_key, len);
        p += sizeof len + len;
    }
    g->rt = c->rt;
    g->refs = 1;
    g->hash = hash;
    g->key_bytes = bytes;
    g->n_cmds = last - first + 1;
    g->epoch = atomic_load(&c->rt->module_epoch);
    return g;
}

static void table_insert(kiln__graph_cache *c, kiln__graph *g)
{
    if (c->n_entries >= c->table_size)
        grow(c);
    size_t slot = g->hash & (c->table_size - 1);
    g->hnext = c->table[slot];
    c->table[slot] = g;
    c->n_entries++;
    g->resident = 1;
}

kiln_status kiln__graph_insert(kiln__graph_cache *c, kiln_command *const *cmds, uint32_t first, uint32_t last,
                               uint64_t hash, CUgraphExec exec, size_t bytes, kiln__graph **out)
{
    kiln__graph *g = entry_new(c, cmds, first, last, hash);
    if (!g) {
        *out = NULL;
        return kiln__fail(&c->rt->err, KILN_ERR_HOST_OUT_OF_MEMORY, "out of memory for a graph cache entry");
    }
    g->exec = exec;
    g->bytes = bytes;
    g->call = c->call;
    table_insert(c, g);
    list_push_front(&c->lru_head, &c->lru_tail, g);
    c->n_resident++;
    c->resident_bytes += bytes;
    c->stats.captured++;
    enforce(c, c->max_graphs, c->max_bytes, 1);
    *out = g;
    return KILN_OK;
}

void kiln__graph_reject(kiln__graph_cache *c, kiln_command *const *cmds, uint32_t first, uint32_t last,
                        uint64_t hash)
{
    c->stats.rejected++;
    kiln__graph *g = entry_new(c, cmds, first, last, hash);
    if (!g)
        return; /* not remembered: the next submission tries again */
    table_insert(c, g);
    list_push_front(&c->rej_head, &c->rej_tail, g);
    if (++c->n_rejected > MAX_REJECTED)
        drop(c, c->rej_tail, 0);
}

void kiln__graph_deferred(kiln__graph_cache *c, uint64_t n) { c->stats.deferred += n; }
void kiln__graph_cache_set_capture(kiln__graph_cache *c, int on) { c->capture = on; }
int kiln__graph_cache_captures(const kiln__graph_cache *c) { return c->capture; }

/* ---- the API ---- */

kiln_status kiln_stream_set_graph_options(kiln_stream *s, const kiln_graph_options *opts)
{
    if (!s || !opts)
        return kiln__fail(s ? &s->rt->err : NULL, KILN_ERR_INVALID_ARGUMENT,
                          "kiln_stream_set_graph_options: NULL argument");
    kiln_graph_options local;
    kiln_status st = KILN__READ_SIZED(&s->rt->err, "kiln_stream_set_graph_options", kiln_graph_options, local, opts);
    if (st)
        return st;
    const kiln_graph_options *o = &local;
    kiln__graph_cache *c = s->graphs;
    if (o->n_buckets > KILN_MAX_BATCH_BUCKETS || (o->n_buckets && !o->buckets))
        return kiln__fail(&s->rt->err, KILN_ERR_RUNTIME_CONTRACT,
                          "graph options: %zu batch buckets%s (at most %d)", o->n_buckets,
                          o->buckets ? "" : " and no list", KILN_MAX_BATCH_BUCKETS);
    for (size_t i = 0; i < o->n_buckets; i++)
        if (!o->buckets[i] || (i && o->buckets[i] <= o->buckets[i - 1]))
            return kiln__fail(&s->rt->err, KILN_ERR_RUNTIME_CONTRACT,
                              "graph options: batch bucket %zu is %u; buckets are strictly increasing and > 0", i,
                              o->buckets[i]);
    c->max_graphs = o->max_graphs ? o->max_graphs : DEFAULT_MAX_GRAPHS;
    c->max_bytes = o->max_bytes ? o->max_bytes : DEFAULT_MAX_BYTES;
    if (o->n_buckets) {
        memcpy(c->buckets, o->buckets, o->n_buckets * sizeof *o->buckets);
        c->n_buckets = o->n_buckets;
    } else {
        memcpy(c->buckets, default_buckets, sizeof default_buckets);
        c->n_buckets = sizeof default_buckets / sizeof default_buckets[0];
    }
    enforce(c, c->max_graphs, c->max_bytes, 0);
    return KILN_OK;
}

void kiln_stream_graph_stats(const kiln_stream *s, kiln_graph_stats *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (!s || !s->graphs)
        return;
    *out = s->graphs->stats;
    out->resident = s->graphs->n_resident;
    out->resident_bytes = s->graphs->resident_bytes;
}

kiln_status kiln_stream_graph_trim(kiln_stream *s, size_t keep_graphs, size_t keep_bytes)
{
    if (!s)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_stream_graph_trim: stream is NULL");
    /* 0 means no limit on that count, unless both are 0: then everything goes. */
    if (keep_graphs || keep_bytes) {
        keep_graphs = keep_graphs ? keep_graphs : SIZE_MAX;
        keep_bytes = keep_bytes ? keep_bytes : SIZE_MAX;
    }
    enforce(s->graphs, keep_graphs, keep_bytes, 0);
    while (s->graphs->rej_head)
        drop(s->graphs, s->graphs->rej_head, 0);
    return KILN_OK;
}

kiln_status kiln_stream_batch_bucket(const kiln_stream *s, uint32_t participants, uint32_t *bucket)
{
    if (!s || !bucket)
        return kiln__fail(NULL, KILN_ERR_INVALID_ARGUMENT, "kiln_stream_batch_bucket: NULL argument");
    const kiln__graph_cache *c = s->graphs;
    for (size_t i = 0; participants && i < c->n_buckets; i++)
        if (c->buckets[i] >= participants) {
            *bucket = c->buckets[i];
            return KILN_OK;
        }
    return kiln__fail(&s->rt->err, KILN_ERR_RUNTIME_CONTRACT,
                      "batch bucket: %u participants; the buckets hold 1 to %u", participants,
                      c->buckets[c->n_buckets - 1]);
}
