#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/internal.h"
#include "kiln/cache.h"

/* The calling thread's last message, freed when the thread exits. */
typedef struct thread_msg {
    char *msg;
    size_t cap;
} thread_msg;

static pthread_key_t msg_key;
static pthread_once_t msg_once = PTHREAD_ONCE_INIT;

static void free_thread_msg(void *p)
{
    thread_msg *t = p;
    free(t->msg);
    free(t);
}

static void make_key(void) { pthread_key_create(&msg_key, free_thread_msg); }

static thread_msg *get_thread_msg(int create)
{
    pthread_once(&msg_once, make_key);
    thread_msg *t = pthread_getspecific(msg_key);
    if (!t && create) {
        t = calloc(1, sizeof *t);
        if (t && pthread_setspecific(msg_key, t) != 0) {
            free(t);
            t = NULL;
        }
    }
    return t;
}

const char *kiln_errmsg(void)
{
    thread_msg *t = get_thread_msg(0);
    return t && t->msg ? t->msg : "";
}

static void set_thread_msg(const char *text);

void kiln__errmsg_clear(void)
{
    thread_msg *t = get_thread_msg(0);
    if (t && t->msg)
        t->msg[0] = 0;
}

static void set_thread_msg(const char *text)
{
    thread_msg *t = get_thread_msg(1);
    if (!t)
        return;
    size_t n = strlen(text) + 1;
    if (n > t->cap) {
        char *p = realloc(t->msg, n);
        if (!p) {
            /* Keep what fits: a truncated message beats none. */
            if (t->cap) {
                memcpy(t->msg, text, t->cap - 1);
                t->msg[t->cap - 1] = 0;
            }
            return;
        }
        t->msg = p;
        t->cap = n;
    }
    memcpy(t->msg, text, n);
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

kiln_status kiln__check_size_field(kiln__errslot *slot, const char *fn, const char *type, uint32_t size,
                                  size_t library_size)
{
    if (!size || size >= sizeof(uint32_t))
        return KILN_OK;
    return kiln__fail(slot, KILN_ERR_INVALID_ARGUMENT,
                      "%s: %s.size is %u, inside the size field itself; set it to sizeof(%s) (%zu in this "
                      "library) or 0",
                      fn, type, (unsigned)size, type, library_size);
}

kiln_status kiln__read_sized(kiln__errslot *slot, const char *fn, const char *type, void *local, size_t local_size,
                             const void *caller)
{
    kiln_status st = kiln__check_size_field(slot, fn, type, caller ? *(const uint32_t *)caller : 0, local_size);
    if (!st)
        kiln__copy_sized(local, local_size, caller);
    return st;
}

const char *kiln__file_kind(mode_t mode)
{
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISFIFO(mode))
        return "a FIFO";
    if (S_ISCHR(mode))
        return "a character device";
    if (S_ISBLK(mode))
        return "a block device";
    if (S_ISSOCK(mode))
        return "a socket";
    return "not a plain file";
}
