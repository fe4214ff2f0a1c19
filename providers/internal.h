/* kiln provider internals: contract checks shared by every operation. Not API. */
#ifndef KILN_PROVIDERS_INTERNAL_H
#define KILN_PROVIDERS_INTERNAL_H

#include "common/internal.h"
#include "kiln/model.h"
#include "kiln/ops.h"
#include "runtime/device.h"

/* Checks one binding: present, on rt, of dtype and rank, dims within (0,
 * max_dim] (a dim of -1 in want is not checked), its bytes inside the buffer
 * and its offset aligned to its element. Names op, binding and values. */
kiln_status kiln__check_tensor(kiln__errslot *err, const char *op, const char *binding, const kiln_tensor *t,
                               kiln_runtime *rt, kiln_dtype dtype, uint32_t rank, const int64_t *want,
                               size_t *bytes);
/* The number of an architecture name ("sm_90a" -> 90, "sm_100" -> 100); 0
 * when arch is NULL or not of that form. */
int kiln__arch_number(const char *arch);
/* The element type of an op's activations, weights and KV cache, from its
 * binding named binding (present): f16, or bf16 on a device of sm_80 or
 * later; any other dtype is refused naming op, binding and the dtype. The
 * op's other 16-bit bindings are then checked against *elt. */
kiln_status kiln__check_elt(kiln__errslot *err, const char *op, const char *binding, const kiln_tensor *t,
                            kiln_runtime *rt, kiln_dtype *elt);
/* Sets a spec's element-type constant (BF16: 0 for f16, 1 for bf16; every
 * template reads it through kiln_prelude.cuh's kiln_elt). Refuses, naming op,
 * any other dtype. */
kiln_status kiln__spec_set_elt(kiln_spec *spec, const char *op, kiln_dtype elt);
/* The start of every encode: jit and cmd given (KILN_ERR_INVALID_ARGUMENT),
 * *cmd set to NULL, and a runtime (offline: KILN_ERR_NO_DEVICE); *rt and
 * *err are then the jit's runtime and its error slot. Names op. */
kiln_status kiln__encode_begin(kiln_jit *jit, const char *op, kiln_command **cmd, kiln_runtime **rt,
                               kiln__errslot **err);
/* A caller's bindings or desc struct (its first field the uint32_t size) into
 * the library's zeroed local dst (kiln__read_sized): KILN_ERR_INVALID_ARGUMENT
 * naming op, what ("bindings"), the struct's type and the size when src is
 * NULL or its size is nonzero and under min_size, the first layout's size
 * (sizeof *dst when there has been one layout). */
kiln_status kiln__copy_bindings(kiln__errslot *err, const char *op, const char *what, const char *type, void *dst,
                                size_t dst_size, size_t min_size, const void *src);
/* A dense product's weight [-1, in] (of the element type elt, f16 or bf16:
 * the activation's, from kiln__check_elt; named name) and its optional bias
 * [weight rows] (elt too, its device address 16-byte aligned); *w_bytes and
 * *b_bytes (0 without a bias) their bytes. Names op, binding and values (a
 * weight of the other 16-bit type: both dtypes). */
kiln_status kiln__check_weight(kiln__errslot *err, const char *op, kiln_runtime *rt, kiln_dtype elt,
                               const char *name, const kiln_tensor *weight, int64_t in, const kiln_tensor *bias,
                               size_t *w_bytes, size_t *b_bytes);
/* That written (its bytes, named name) overlaps none of the n bindings
 * others (NULL ones passed over): "binding <name> overlaps binding <other>". */
kiln_status kiln__check_disjoint(kiln__errslot *err, const char *op, const kiln_tensor *written, size_t bytes,
                                 const char *name, const kiln_tensor *const *others, const size_t *other_bytes,
                                 const char *const *names, size_t n);
/* The region of a binding's bytes. */
static inline kiln_region kiln__tensor_region(const kiln_tensor *t, size_t bytes)
{
    return (kiln_region){t->buffer, t->offset, t->offset + bytes};
}
/* The immediate form of an op: where encoded (what its _encode returned) is
 * KILN_OK, submits *cmd on the jit's runtime's own stream and releases it;
 * otherwise returns encoded. */
kiln_status kiln__submit_encoded(kiln_jit *jit, kiln_status encoded, kiln_command **cmd);
/* A provider's command: packed attribution (op, participants and
 * dispatches, 0 meaning 1, tokens), its regions, enqueue on user, and the
 * replay key: the kernel's fingerprint, then the n_params launch parameters
 * (everything the kernel is launched with), or, kernel NULL, the key_bytes
 * of key the provider made. user goes with user_free (NULL: free()): with
 * the command, or here when the command cannot be made. */
typedef struct kiln__kernel_command_desc {
    const char *op;
    uint32_t participants, tokens, dispatches;
    const kiln_region *regions;
    size_t n_regions;
    kiln_enqueue_fn enqueue;
    void *user;
    void (*user_free)(void *user);
    const kiln_kernel *kernel;
    const uint64_t *params;
    size_t n_params;
    const void *key;
    size_t key_bytes;
} kiln__kernel_command_desc;
/* .params and .n_params of a kiln__kernel_command_desc from an array. */
#define KILN__PARAMS(array) .params = (array), .n_params = sizeof(array) / sizeof((array)[0])
kiln_status kiln__kernel_command(kiln_runtime *rt, const kiln__kernel_command_desc *d, kiln_command **cmd);
/* Blocks of fn (threads each, no dynamic shared memory) one SM holds at
 * once; 0 when the driver cannot say. */
int kiln__blocks_per_sm(kiln_runtime *rt, CUfunction fn, unsigned threads);
/* Whether two bindings' byte ranges overlap in one buffer. */
int kiln__tensors_overlap(const kiln_tensor *a, size_t a_bytes, const kiln_tensor *b, size_t b_bytes);

/* Each provider adds the specializations a model needs. */
typedef kiln_status (*kiln__spec_sink)(void *user, const kiln_spec *spec);
/* Every operation's (providers/catalog.c), in the catalog's order, for cfg on
 * arch (NULL: not known). */
kiln_status kiln__catalog_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink, void *user);
kiln_status kiln__token_embedding_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
kiln_status kiln__rms_norm_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
kiln_status kiln__residual_add_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
kiln_status kiln__masked_argmax_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                           void *user);
kiln_status kiln__moe_router_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
/* The width of the model's dense SwiGLU: intermediate_size, or for a mixture
 * of experts its shared expert's (0: none; the experts are moe_experts'). */
int64_t kiln__dense_intermediate(const kiln_model_config *cfg);
kiln_status kiln__moe_experts_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                         void *user);
/* The router's checks (include/kiln/op_moe.h), without encoding: *elt and
 * each binding's bytes (logits, ids, weights). */
kiln_status kiln__moe_router_check(kiln_runtime *rt, const kiln_moe_router_desc *d, kiln_dtype *elt, size_t bytes[3]);
/* Only for a config with qk_norm (Qwen3). */
kiln_status kiln__head_rms_norm_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);

/* Validation alone (no jit, no launch), for encode and for the CPU tests. *vec
 * is the vector width the bindings allow (8 or 1). */
/* Test hook (providers/linear_norm.c): how kiln_op_dense_linear_norm makes
 * its product where the skinny path does not apply: -1 by the times (the
 * default), 0 one f16 product, P > 0 P f32 parts. */
void kiln__linear_norm_force_parts(int parts);
/* Test hook: the way the last kiln_op_dense_linear_norm encode made its
 * product: "skinny", "parts", "plain" or "tma" ("none" before any). */
const char *kiln__linear_norm_last_way(void);
/* The threads a block of templates/rms_norm.cu's kernels has (its spec's THREADS). */
unsigned kiln__rms_norm_threads(int64_t hidden, int vec);
kiln_status kiln__rms_norm_check(kiln_runtime *rt, const kiln_tensor *x, const kiln_tensor *residual,
                                 const kiln_tensor *weight, float eps, const kiln_tensor *out, int *vec);
kiln_status kiln__residual_add_check(kiln_runtime *rt, const kiln_tensor *a, const kiln_tensor *b,
                                     const kiln_tensor *out, int *vec);
/* A checked head RMSNorm: its kernel's arguments (device addresses of the q
 * and k row bases, in and out, the weights; row strides in elements), the
 * spec's sizes, its regions, and bytes: qkv or q, k (0 fused), out or q_out,
 * k_out (0 fused), q_weight, k_weight. */
typedef struct kiln__head_norm_info {
    CUdeviceptr q, k, q_out, k_out, qw, kw;
    uint64_t q_stride, k_stride;
    float eps;
    kiln_dtype elt;
    int64_t tokens, head_dim, heads, kv_heads;
    int vec;
    size_t bytes[6];
    kiln_region regions[6];
    size_t n_regions;
} kiln__head_norm_info;
kiln_status kiln__head_rms_norm_check(kiln_runtime *rt, const kiln_head_rms_norm_bindings *b,
                                      kiln__head_norm_info *info);
/* bytes[7]: each binding's bytes, in the order of kiln_masked_argmax_bindings. */
kiln_status kiln__masked_argmax_check(kiln_runtime *rt, const kiln_masked_argmax_bindings *b, size_t bytes[7],
                                      int *vec);
kiln_status kiln__dense_swiglu_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                          void *user);
kiln_status kiln__linear_norm_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                         void *user);
kiln_status kiln__last_token_linear_specs(const kiln_model_config *cfg, kiln__spec_sink sink, void *user);
/* The scan's and the chunked kernel's specializations for a model on arch (NULL: not known). */
kiln_status kiln__gated_delta_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                         void *user);
/* bytes[8]: each binding's bytes, in the order of kiln_gated_delta_bindings. */
kiln_status kiln__gated_delta_check(kiln_runtime *rt, const kiln_gated_delta_bindings *b, size_t bytes[8], int *vec);
/* Test hook: the rows a block of the chunked kernel the calling thread's last
 * gated delta encode took, 0 for the scan, -1 before any. */
int kiln__gated_delta_last_rows(void);
/* Test hook: whether that encode took the keyed form, by the keyed kernel (1) or the
 * rows kernel (2), or not (0); -1 before any. */
int kiln__gated_delta_last_keyed(void);
/* Test hook: the f16 terms of that encode's f32 operands in the chunked
 * kernel's products (1 or 2), 0 for the scan. */
int kiln__gated_delta_last_terms(void);
/* Test hook: whether that encode took the rows kernel streamed beside the
 * pre-pass (1) or not (0). */
int kiln__gated_delta_last_streamed(void);

/* Paged attention: what the host knows of an invocation once it is checked.
 * bytes: each binding's bytes, in the order q, k, v, qkv, positions,
 * block_table, seq_lens, query_spans, out, kv_pages, workspace (0 for one
 * not given). */
#define KILN__PA_BINDINGS 11
typedef struct kiln__paged_attention_info {
    size_t bytes[KILN__PA_BINDINGS];
    uint32_t tokens, seqs, max_blocks, max_query, page_tokens, pages, append_tiles, attention_tiles;
    uint32_t q_stride, kv_stride; /* halves between two tokens' rows of q, and of k and v */
    size_t k_offset, v_offset;    /* fused: bytes from qkv's start to k's and v's first row */
    int64_t heads, kv_heads, head_dim;
    int decode, fused;
} kiln__paged_attention_info;
/* Its specializations for a model on a known architecture (NULL: not known). */
kiln_status kiln__paged_attention_arch_specs(const kiln_model_config *cfg, const char *arch, kiln__spec_sink sink,
                                             void *user);
kiln_status kiln__paged_attention_check(kiln_runtime *rt, const kiln_paged_attention_desc *d,
                                        kiln__paged_attention_info *info);
/* The blocks a split decode aims at (0: the default, the device's SMs; 1: no
 * split): for benchmarks and tests that compare split counts. Read at encode;
 * process-wide. */
void kiln__paged_attention_set_split_target(uint32_t blocks);
/* For the GPU tests and benchmarks: the wgmma prefill's grid at most this
 * many blocks, each taking work items until they run out (0: the device's
 * SMs; at least the items: a block an item). Read at encode; process-wide. */
void kiln__paged_attention_set_prefill_blocks(uint32_t blocks);
/* Test hook: 1 makes encode take the two-kernel decode (templates/paged_attention.cu)
 * where it would take the one-kernel one; process-wide. */
void kiln__paged_attention_set_two_kernel_decode(int on);
/* Test hook: a prefill encode takes the mma.sync attention kernel
 * (templates/paged_prefill_mma.cu) or the CUDA-core one (templates/paged_attention.cu)
 * where it would take another (0: as the device says); process-wide. */
enum { KILN__PREFILL_MMA = 1, KILN__PREFILL_CUDA_CORE = 2 };
void kiln__paged_attention_set_prefill_kernel(int which);
/* Test hook: 3 or 4 makes the one-kernel decode take that many stages
 * whatever its grid (4 where the device allows its shared memory); 0 (or
 * anything else): chosen at encode. Process-wide. */
void kiln__paged_attention_set_decode_stages(int stages);

#endif
