/* kiln — the device fault record: how a kernel that finds bad data reports it
 * without touching memory it must not. Shared by templates/kiln_prelude.cuh
 * (which must restate it: NVRTC sees no host header) and the runtime. */
#ifndef KILN_COMMON_FAULT_H
#define KILN_COMMON_FAULT_H

#include <stdint.h>

/* One per runtime, in device memory, zeroed after each report. */
typedef struct kiln__fault {
    uint32_t code;   /* 0: none; else a KILN__FAULT_* kind */
    uint32_t pad;
    uint64_t first;  /* min over reports of (index << 32 | value): the lowest index wins */
    uint64_t limit;  /* the bound the value broke */
} kiln__fault;

enum {
    KILN__FAULT_NONE = 0,
    KILN__FAULT_TOKEN_ID = 1,       /* token_embedding: ids[index] = value >= vocab (limit) */
    KILN__FAULT_EMPTY_SPAN = 2,     /* last_token_linear: participant index has an empty span */
    KILN__FAULT_SPAN_PAST_END = 3   /* last_token_linear: participant index's span ends at value > limit */
};

#endif
