/* kiln — safetensors files: a parser of outside data.
 *
 * The format: an 8-byte little-endian header length N, N bytes of a JSON
 * object (padded with spaces), then the tensors' bytes. Each member of the
 * object but "__metadata__" describes one tensor:
 *   "name": {"dtype": "F16", "shape": [d0, d1, ...], "data_offsets": [begin, end]}
 * with offsets relative to the first byte after the header.
 *
 * What is checked, each failure a KILN_ERR_CONFIG whose message (kiln_errmsg)
 * names the file label, the tensor and the values: the file holds the 8
 * length bytes; the header length is at least 2, at most
 * KILN_SAFETENSORS_MAX_HEADER and within the file; the header is one JSON
 * object followed by nothing but spaces, and strict JSON (RFC 8259: no key
 * twice in an entry, no number like 08, no control byte, ill-formed UTF-8,
 * lone surrogate or \u0000 in a string, which would cut a name short; the
 * message has the offset in the header); every tensor entry is an object with
 * a known dtype (F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL F8_E4M3
 * F8_E5M2), a shape of at most KILN_SAFETENSORS_MAX_RANK whole numbers >= 0
 * whose product (times the element size) does not overflow, and two whole
 * data_offsets with begin <= end <= the bytes after the header and
 * end - begin equal to the tensor's bytes; no two tensors share a name or a
 * byte; every byte of the data belongs to a tensor (none before, between or
 * after them: the message has the range and the sizes). "__metadata__",
 * when present, must be an object. A tensor name is
 * any JSON string but the empty one.
 *
 * The parser never reads outside [data, data + size) (fuzzed: tests/fuzz/
 * fuzz_safetensors.c) and never aborts.
 */
#ifndef KILN_SAFETENSORS_H
#define KILN_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/status.h"
#include "kiln/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_SAFETENSORS_MAX_RANK 8
/* The same bound as the reference implementation (100 MB). */
#define KILN_SAFETENSORS_MAX_HEADER (100u * 1000u * 1000u)

typedef struct kiln_safetensors kiln_safetensors;

/* One tensor of a file. Strings and data belong to the file object and live
 * until kiln_safetensors_close. */
typedef struct kiln_safetensors_tensor {
    const char *name;
    const char *dtype_name;   /* as in the header: "F16" (static storage) */
    kiln_dtype dtype;         /* F16, BF16, F32, U8, U32, I32; KILN_DTYPE_BYTES for the other dtypes */
    size_t element_bytes;     /* 2 for F16 */
    uint32_t rank;
    int64_t dims[KILN_SAFETENSORS_MAX_RANK];
    uint64_t elements;        /* the product of dims (1 for rank 0) */
    uint64_t offset;          /* of the first byte, from the start of the file */
    uint64_t bytes;           /* elements * element_bytes */
    const void *data;         /* the bytes, inside the file's mapping */
} kiln_safetensors_tensor;

/* Parses size bytes at data, by reference: data must outlive the object.
 * label names the file in messages (copied; NULL: "safetensors").
 * KILN_ERR_CONFIG (see above), KILN_ERR_INVALID_ARGUMENT (NULL data with a
 * size, NULL out), KILN_ERR_HOST_OUT_OF_MEMORY. */
KILN_API kiln_status kiln_safetensors_parse(const void *data, size_t size, const char *label,
                                            kiln_safetensors **out);
/* Maps a file read-only and parses it; the label is the path. KILN_ERR_IO
 * (cannot open, stat or map it, or it is not a regular file: a FIFO is
 * refused, never waited on; the message has the path and errno text),
 * else as kiln_safetensors_parse. */
KILN_API kiln_status kiln_safetensors_open(const char *path, kiln_safetensors **out);
/* Unmaps and frees. NULL is a no-op. */
KILN_API void kiln_safetensors_close(kiln_safetensors *st);

/* The tensors, sorted by name: index 0 .. count - 1. */
KILN_API size_t kiln_safetensors_count(const kiln_safetensors *st);
KILN_API const kiln_safetensors_tensor *kiln_safetensors_at(const kiln_safetensors *st, size_t index);
/* The tensor of that name, or NULL. */
KILN_API const kiln_safetensors_tensor *kiln_safetensors_find(const kiln_safetensors *st, const char *name);
KILN_API const char *kiln_safetensors_label(const kiln_safetensors *st);

/* The tensor of that name, checked: KILN_ERR_NOT_FOUND ("<label>: tensor
 * <name> is missing"), KILN_ERR_CONFIG for another dtype or shape (the
 * message has the name, the expected and the actual dtype or shape). */
KILN_API kiln_status kiln_safetensors_expect(const kiln_safetensors *st, const char *name, kiln_dtype dtype,
                                             uint32_t rank, const int64_t *dims,
                                             const kiln_safetensors_tensor **out);

#ifdef __cplusplus
}
#endif
#endif
