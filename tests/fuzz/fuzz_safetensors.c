/* Fuzz target: kiln_safetensors_parse on a safetensors file from outside.
 *
 * Accepted files must keep every promise of kiln/safetensors.h: each
 * tensor's bytes inside the data section, its byte count its element count
 * times its element size, names sorted and unique and found again, no two
 * tensors sharing a byte, kiln_safetensors_expect agreeing with the parsed
 * shape, every byte of the data section in exactly one tensor (their byte
 * counts add up to it). Every byte of every tensor is read, so a tensor
 * that points past the input crashes (the input ends against an unmapped
 * page). Rejected files must say KILN_ERR_CONFIG (or out of memory) with a
 * bounded message.
 */
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kiln/safetensors.h"
#include "fuzz_common.h"

#define GUARDED_CAP (4u << 20)

static struct {
    unsigned long long inputs, accepted, rejected, oom, tensors;
} g_stats;

static const uint8_t *guarded_copy(const uint8_t *data, size_t size, uint8_t **heap)
{
    static uint8_t *region;
    static size_t page;
    *heap = NULL;
    if (!region) {
        page = (size_t)sysconf(_SC_PAGESIZE);
        void *p = mmap(NULL, GUARDED_CAP + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        FUZZ_CHECK(p != MAP_FAILED, "mmap failed");
        FUZZ_CHECK(mprotect((uint8_t *)p + GUARDED_CAP, page, PROT_NONE) == 0, "mprotect failed");
        region = p;
    }
    if (size <= GUARDED_CAP) {
        uint8_t *at = region + GUARDED_CAP - size;
        if (size)
            memcpy(at, data, size);
        return at;
    }
    *heap = malloc(size);
    FUZZ_CHECK(*heap != NULL, "out of memory copying %zu bytes", size);
    memcpy(*heap, data, size);
    return *heap;
}

static void check_accepted(const kiln_safetensors *st, const uint8_t *base, size_t size)
{
    uint64_t hdr = 0;
    for (int i = 7; i >= 0; i--)
        hdr = hdr << 8 | base[i];
    const size_t n = kiln_safetensors_count(st);
    volatile uint8_t sink = 0;
    uint64_t indexed = 0;
    for (size_t i = 0; i < n; i++) {
        const kiln_safetensors_tensor *t = kiln_safetensors_at(st, i);
        FUZZ_CHECK(t && t->name && t->name[0], "tensor %zu has no name", i);
        if (i)
            FUZZ_CHECK(strcmp(kiln_safetensors_at(st, i - 1)->name, t->name) < 0, "names not sorted or unique at %zu",
                       i);
        FUZZ_CHECK(kiln_safetensors_find(st, t->name) == t, "find(%s) is not the tensor", t->name);
        FUZZ_CHECK(t->rank <= KILN_SAFETENSORS_MAX_RANK, "rank %u", t->rank);
        uint64_t el = 1;
        for (uint32_t d = 0; d < t->rank; d++) {
            FUZZ_CHECK(t->dims[d] >= 0, "negative dim");
            FUZZ_CHECK(!__builtin_mul_overflow(el, (uint64_t)t->dims[d], &el), "elements overflow");
        }
        FUZZ_CHECK(el == t->elements, "elements %llu, dims say %llu", (unsigned long long)t->elements,
                   (unsigned long long)el);
        FUZZ_CHECK(t->element_bytes >= 1 && t->bytes == t->elements * t->element_bytes, "bytes");
        FUZZ_CHECK(t->offset >= 8 + hdr && t->offset <= size && t->bytes <= size - t->offset,
                   "tensor %s [%llu, +%llu) outside the data of a %zu-byte file", t->name,
                   (unsigned long long)t->offset, (unsigned long long)t->bytes, size);
        FUZZ_CHECK((const uint8_t *)t->data == base + t->offset, "data pointer");
        indexed += t->bytes;
        for (uint64_t b = 0; b < t->bytes; b++)
            sink ^= ((const uint8_t *)t->data)[b];
        const kiln_safetensors_tensor *back = NULL;
        if (t->dtype != KILN_DTYPE_BYTES) {
            kiln_status s = kiln_safetensors_expect(st, t->name, t->dtype, t->rank, t->dims, &back);
            FUZZ_CHECK(s == KILN_OK && back == t, "expect(%s) on its own shape: %s", t->name, kiln_errmsg());
        }
        for (size_t j = 0; j < i; j++) {
            const kiln_safetensors_tensor *u = kiln_safetensors_at(st, j);
            if (t->bytes && u->bytes)
                FUZZ_CHECK(t->offset + t->bytes <= u->offset || u->offset + u->bytes <= t->offset,
                           "tensors %s and %s overlap", t->name, u->name);
            if (j > 64)
                break; /* quadratic otherwise; the sorted scan in the parser covers the rest */
        }
    }
    /* No two share a byte, so adding up to the data's size leaves none unindexed. */
    FUZZ_CHECK(indexed == size - 8 - hdr, "the tensors index %llu bytes of a data section of %llu",
               (unsigned long long)indexed, (unsigned long long)(size - 8 - hdr));
    (void)sink;
    g_stats.tensors += n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *heap;
    const uint8_t *in = guarded_copy(data, size, &heap);
    g_stats.inputs++;
    kiln_safetensors *st = NULL;
    kiln_status s = kiln_safetensors_parse(in, size, "fuzz", &st);
    if (s == KILN_OK) {
        g_stats.accepted++;
        FUZZ_CHECK(st != NULL, "OK without an object");
        check_accepted(st, in, size);
        kiln_safetensors_close(st);
    } else if (s == KILN_ERR_HOST_OUT_OF_MEMORY) {
        g_stats.oom++;
    } else {
        const char *msg = kiln_errmsg();
        FUZZ_CHECK(s == KILN_ERR_CONFIG, "status %d (%s): %s", (int)s, kiln_status_code(s), msg);
        FUZZ_CHECK(st == NULL, "refused with an object");
        FUZZ_CHECK(msg && msg[0] && strlen(msg) < 1024, "a message of %zu bytes", msg ? strlen(msg) : 0);
        g_stats.rejected++;
    }
    free(heap);
    return 0;
}

void kiln_fuzz_summary(FILE *f)
{
    fprintf(f, "fuzz_safetensors: %llu inputs: %llu accepted (%llu tensors), %llu rejected, %llu out of memory\n",
            g_stats.inputs, g_stats.accepted, g_stats.tensors, g_stats.rejected, g_stats.oom);
}
