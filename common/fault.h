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
    KILN__FAULT_SPAN_PAST_END = 3,  /* last_token_linear: participant index's span ends at value > limit */
    KILN__FAULT_GATED_DELTA_SPAN = 8, /* gated_delta: sequence index's span ends at value (saturated) > limit (tokens) */
    /* gated_delta's chunked kernels launched unlike their template (an
     * internal error): block index had value threads (or bytes of shared
     * memory), not limit. */
    KILN__FAULT_GATED_DELTA_THREADS = 9,
    KILN__FAULT_GATED_DELTA_SMEM = 10,
    KILN__FAULT_MOE_EXPERT_ID = 24,   /* moe_experts: ids[index] (the pair t x top_k + s) = value >= limit (experts) */
    /* paged_attention: index is the sequence. */
    KILN__FAULT_KV_SPAN = 16,             /* its query span ends at value (saturated) > limit (tokens) */
    KILN__FAULT_KV_QUERY_COUNT = 17,      /* its count (value) > limit = min(seq_len, max_query_tokens) */
    KILN__FAULT_KV_SEQ_PAST_TABLE = 18,   /* its seq_len (value) > limit = max_blocks * page_tokens */
    KILN__FAULT_KV_BLOCK_PAST_ARENA = 19  /* a block table entry (value) >= pages; limit = block << 32 | pages */
};

#endif
