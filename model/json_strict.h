/* A strict JSON check for the model/ parsers; private to model/. */
#ifndef KILN_MODEL_JSON_STRICT_H
#define KILN_MODEL_JSON_STRICT_H

#include <stddef.h>

#include "kiln/status.h"

/* Deeper nesting than this is refused (cJSON's own limit is 1000). */
#define KILN__JSON_MAX_DEPTH 512

/* Checks that text[0, len) is exactly one JSON value as RFC 8259 defines it,
 * with only space, tab, CR and LF around it: no byte order mark, no trailing
 * bytes, numbers by the grammar (no leading zero, no NaN or Infinity),
 * strings of well-formed UTF-8 with no control byte, no "\u0000" (cJSON
 * would cut the string there) and no lone surrogate, nesting at most
 * KILN__JSON_MAX_DEPTH, and no object with two equal keys (compared
 * decoded, at any depth: Python's json keeps the last, cJSON the first).
 * Returns KILN_OK, KILN_ERR_CONFIG with "<what> at byte N" in *what (cap
 * bytes, always terminated; N counts from text), or KILN_ERR_HOST_OUT_OF_MEMORY.
 * Sets no error slot: the caller words the failure. With
 * KILN__JSON_TOP_KEYS_MAY_REPEAT, keys of the outermost object are not
 * compared: for a caller that checks them itself and names them better. */
#define KILN__JSON_TOP_KEYS_MAY_REPEAT 1u
kiln_status kiln__json_strict_check(const char *text, size_t len, unsigned flags, char *what, size_t cap);

#endif
