#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/internal.h"

static _Thread_local char *tl_msg;
static _Thread_local size_t tl_cap;

const char *kiln_errmsg(void) { return tl_msg ? tl_msg : ""; }

static void set_thread_msg(const char *text)
{
    size_t n = strlen(text) + 1;
    if (n > tl_cap) {
        char *p = realloc(tl_msg, n);
        if (!p) {
            /* Keep what fits: a truncated message beats none. */
            if (tl_cap) {
                memcpy(tl_msg, text, tl_cap - 1);
                tl_msg[tl_cap - 1] = 0;
            }
            return;
        }
        tl_msg = p;
        tl_cap = n;
    }
    memcpy(tl_msg, text, n);
}

void kiln__errslot_init(kiln__errslot *slot)
{
    pthread_mutex_init(&slot->lock, NULL);
    slot->msg[0] = 0;
}

void kiln__errslot_destroy(kiln__errslot *slot) { pthread_mutex_destroy(&slot->lock); }

static void set_slot(kiln__errslot *slot, const char *text)
{
    if (!slot)
        return;
    pthread_mutex_lock(&slot->lock);
    snprintf(slot->msg, sizeof slot->msg, "%s", text);
    pthread_mutex_unlock(&slot->lock);
}

kiln_status kiln__vfail(kiln__errslot *slot, kiln_status st, const char *fmt, va_list ap)
{
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    char small[512];
    char *buf = small;
    if (n >= (int)sizeof small) {
        buf = malloc((size_t)n + 1);
        if (!buf)
            buf = small;
    }
    vsnprintf(buf, buf == small ? sizeof small : (size_t)n + 1, fmt, ap);
    set_thread_msg(buf);
    set_slot(slot, buf);
    if (buf != small)
        free(buf);
    return st;
}

kiln_status kiln__fail(kiln__errslot *slot, kiln_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kiln__vfail(slot, st, fmt, ap);
    va_end(ap);
    return st;
}

kiln_status kiln__propagate(kiln__errslot *slot, kiln_status st)
{
    set_slot(slot, kiln_errmsg());
    return st;
}

char *kiln__strdup(const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p)
        memcpy(p, s, n);
    return p;
}

void kiln_free(void *p) { free(p); }
