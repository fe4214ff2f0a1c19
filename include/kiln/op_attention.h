/* kiln — causal paged attention with RoPE (included by kiln/ops.h).
 *
 * One invocation covers the new tokens of S sequences packed together (T
 * tokens in all): it applies RoPE to q and k, appends k and v to each
 * sequence's pages of a paged KV cache, then computes causal attention of
 * every new token over its sequence's cached tokens (its own included).
 *
 * Bindings (kiln_paged_attention_desc); elt, the element type, is f16 or bf16
 * (bf16 from sm_80 on), q's (qkv's when fused), and every other 16-bit
 * binding must have it (a mixed call is refused naming the binding):
 *   q            elt [T, heads, head_dim]      the new tokens' queries (not rotated);
 *   k, v         elt [T, kv_heads, head_dim]   their keys (not rotated) and values;
 *   qkv          elt [T, (heads + 2 kv_heads) * head_dim]   instead of q, k and v
 *                (which are then NULL): each row holds the token's q, then its
 *                k, then its v, as one dense product of the three weights
 *                concatenated writes them; heads and head_dim come from out;
 *   positions    u32 [T]                       RoPE position of each new token;
 *   block_table  u32 [S, max_blocks]           page numbers, within kv_pages, of
 *                                              each sequence's cached tokens, in order;
 *   seq_lens     u32 [S]                       each sequence's cached length AFTER
 *                                              this call appends its new tokens;
 *   query_spans  u32 [S, 2]                    (start, count): sequence s's new
 *                                              tokens are rows [start, start + count)
 *                                              of q, k, v, positions and out;
 *   kv_pages     a region of whole 64 KiB pages (KILN_PAGED_KV_PAGE_BYTES, the
 *                fixed-block storage profile "paged_kv"): page p is bytes
 *                [start + p * 65536, start + (p + 1) * 65536); its device address
 *                16-byte aligned; its buffer untyped (KILN_DTYPE_BYTES) or of
 *                dtype elt (a bf16 cache with f16 q is refused);
 *   out          elt [T, heads, head_dim];
 *   workspace    optional, and used by no kernel now (kiln_op_paged_attention_workspace
 *                says 0 bytes): a region given is still checked (on the runtime,
 *                256-byte aligned on its device address, overlapping no other
 *                binding) and left untouched.
 * positions, block_table, seq_lens and query_spans are read on the device
 * (put them in a binding arena): one command, and the graph it is captured
 * in, serve every step of the same T, S and max_blocks.
 *
 * Page layout. A page holds page_tokens = 32768 / (kv_heads * head_dim * 2)
 * tokens (rounded down) of one sequence: K in bytes [0, 32768), V in
 * [32768, 65536), each laid out [kv_heads][page_tokens][head_dim] elt. Token
 * c (its index in the sequence's cache, 0-based) lives in page
 * block_table[s][c / page_tokens], slot c % page_tokens. The cache holds k
 * after RoPE. Shapes where a page holds no token (kv_heads * head_dim >
 * 16384) are refused; kiln_op_paged_attention_page_tokens says how many.
 *
 * Semantics, for a sequence s with (start, count) and length L = seq_lens[s]:
 * its new token j (0 <= j < count, row t = start + j) has cache index
 * c = L - count + j (the new tokens follow the cached prefix, in order).
 *   RoPE (rotate-half, as Llama and Qwen2, over the first r = rope_dim dims
 *     of a head; the others pass through unchanged): for i < r / 2,
 *     inv_freq[i] = rope_inv_freq[i], or rope_theta^(-2i / r) (computed in
 *     double, rounded to f32), a = f32(f32(positions[t]) * inv_freq[i]),
 *     cs = cos a * m and sn = sin a * m (m = rope_attention_scaling), and in
 *     f32 y[i] = x[i] cs - x[i + r/2] sn, y[i + r/2] = x[i + r/2] cs + x[i] sn.
 *   Append: rotated k (rounded to elt) and v are written at cache index c.
 *   Attention, for each query head hq (kv head hq / (heads / kv_heads)):
 *     out[t, hq] = softmax_{c - W < c' <= c}(q_rot . k_cache[c'] / sqrt(head_dim)) . v_cache[c'],
 *     W = sliding_window (with none, every c' <= c),
 *     scores and softmax in f32 with a running max (online), one rounding to elt.
 * A sequence with count 0 is skipped (nothing read, checked or written).
 * Spans of different sequences must not overlap, nor two sequences' pages
 * written by the same call: the results are then undefined (never out of
 * bounds). Positions are exact in f32 below 2^24.
 *
 * Checked at encode (KILN_ERR_RUNTIME_CONTRACT naming the binding, the
 * expected and the actual value): dtypes, ranks and dims of every binding,
 * head_dim in {64, 128, 256}, kv_heads dividing heads, a page holding >= 1 token,
 * kv_pages whole pages, max_blocks * page_tokens <= 2^32 - 65, 1 <= S <= 65535,
 * max_query_tokens <= T, rope_theta finite and > 0, rope_inv_freq's values
 * finite and > 0, rope_attention_scaling finite, rope_dim even in [2,
 * head_dim], every 16-bit binding and kv_pages' buffer of one dtype, qkv's width (heads +
 * 2 kv_heads) * head_dim and q, k, v NULL when qkv is given, a given
 * workspace on the runtime, in its buffer and aligned, and that
 * nothing written (out, kv_pages, workspace) overlaps another binding.
 * Checked on the device, per sequence, before anything of it is read: the
 * span within T, count <= min(seq_lens[s], max_query_tokens), seq_lens[s] <=
 * max_blocks * page_tokens, and every block table entry the sequence uses
 * (the first ceil(L / page_tokens)) below the number of pages. A bad sequence
 * is skipped: its cache pages and its out rows are left as they were, and the
 * next kiln_stream_synchronize (or kiln_fence_wait) of the stream returns
 * KILN_ERR_DEVICE_CONTRACT with a message naming the lowest bad sequence, the
 * value and the limit; the stream goes on. The kernels never read or write
 * out of bounds whatever the device data holds.
 *
 * Kernels. Prefill, max_query_tokens > 1: two dispatches, an append
 * kernel (templates/paged_attention.cu: one block per sequence and 4 new
 * tokens, every kv head) then an attention kernel, one block per sequence,
 * kv head and tile of query rows (a GQA group's heads share a tile, so each
 * K and V tile is read once per kv head), specialized on head_dim, heads,
 * kv_heads and the page's tokens:
 *   sm_90: templates/paged_prefill.cu, 128 rows a block on warpgroup MMA
 *     (wgmma, built for sm_90a): a producer warpgroup streams K and V tiles
 *     of 128 keys (64 at head_dim 256) through three stages (four at
 *     head_dim 64, two at 256) by TMA, one box a panel where a tile's pages
 *     follow one another in the arena, and two consumer warpgroups take
 *     turns on the tensor cores;
 *   sm_80 on otherwise: templates/paged_prefill_mma.cu, 64 rows a block on
 *     mma.sync m16n8k16 (FlashAttention-2's design), head_dim 64 and 128;
 *   before sm_80, where a block cannot have the shared memory, and at
 *     head_dim 256 but on sm_90 (and decode at head_dim 256 everywhere):
 *     the CUDA-core kernel of templates/paged_attention.cu (16 rows a block,
 *     8 at head_dim 256, f32 arithmetic).
 * On the tensor cores q (rotated, scaled) and the softmax's p are rounded to
 * elt for their products, as FlashAttention does: an output may differ from
 * the f32 result by about 2^-11 (f16; 2^-8 in bf16) of sum p |v| / sum p
 * beyond its rounding. Decode, max_query_tokens = 1 (templates/paged_decode.cu,
 * specialized on head_dim, heads and kv_heads; sm_80 on where a block may
 * have its shared memory (about 101 KiB at head_dim 128: not on sm_86, sm_89,
 * sm_12x), else the prefill kernels with 4, 8 or 16 rows a block, two
 * dispatches; kiln_model_specializations_for_arch lists those where they are
 * taken): one kernel, one dispatch, that
 * appends and attends: one block per sequence, kv head, tile of 8 query
 * heads of the group and key chunk; keys stream through shared memory with
 * cp.async, scores and P.V on the tensor cores with f32 accumulation and q
 * and p each as two elt terms (about as exact as f32); the block whose chunk holds
 * the new token rotates its k, writes k and v to the page and uses them from
 * shared memory. Split-KV: the command's split count n (1, 2, 4, 8 or 16) is
 * fixed at encode, the largest that keeps S x kv_heads x row tiles x n
 * within the device's SMs and that the device launches as a thread
 * block cluster, so one graph serves every step; on the device each
 * sequence's L keys are cut in ceil(L / c) chunks of c = 64 * ceil(ceil(L /
 * n) / 64) keys (blocks past them take none), the n blocks of one cluster,
 * and after a cluster barrier each block combines a slice of the output
 * from every block's partial (unnormalized output, max, sum) in its shared
 * memory, in rank order: the result is the same bits however the blocks
 * were scheduled, replayed or eager, and no workspace is needed. The
 * command is replayable: its key holds the kernel's fingerprint, every
 * binding's address and bytes, T, S, max_blocks, max_query_tokens, the row
 * strides, the split count, rope_theta and the inverse frequencies, scaling
 * and rope_dim. Needs a runtime
 * (KILN_ERR_NO_DEVICE offline); errors from acquiring the kernel pass
 * through.
 */
#ifndef KILN_OP_ATTENTION_H
#define KILN_OP_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "kiln/jit.h"
#include "kiln/runtime.h"
#include "kiln/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The bytes of one KV page: the block size of the "paged_kv" storage profile. */
#define KILN_PAGED_KV_PAGE_BYTES 65536u

struct kiln_tensor;

typedef struct kiln_paged_attention_desc {
    /* sizeof(kiln_paged_attention_desc), or 0 (the same). The library reads
     * the fields both sizes hold; one under the first layout's (up to
     * max_query_tokens) is KILN_ERR_INVALID_ARGUMENT. */
    uint32_t size;
    /* The bindings, by reference (borrowed for the call). */
    const struct kiln_tensor *q, *k, *v, *positions, *block_table, *seq_lens, *query_spans, *out;
    const kiln_region *kv_pages;
    float rope_theta;          /* finite, > 0 (10000 for Llama-2, 1000000 for Qwen2.5) */
    /* The most new tokens any sequence has in this command (its grid is sized
     * for it; a sequence with more is reported, not computed). 0: T. 1: the
     * decode kernel, specialized for one token per sequence. */
    uint32_t max_query_tokens;
    /* Appended after the first release (a desc whose size ends at
     * max_query_tokens has neither, and is still taken):
     * the split-KV scratch, by reference (borrowed; may be NULL), and the
     * fused q | k | v input (NULL: q, k and v). */
    const kiln_region *workspace;
    const struct kiln_tensor *qkv;
    /* Appended for scaled and partial RoPE (a desc whose size ends at qkv
     * has none of them: RoPE from rope_theta over the whole head, as before):
     * rope_inv_freq, by copy at encode (the caller's array may go after it):
     * rope_dim / 2 inverse frequencies, each finite and > 0, computed by the
     * caller (llama3, yarn, linear or dynamic scaling as transformers
     * defines them); NULL: rope_theta^(-2i / rope_dim). */
    const float *rope_inv_freq;
    /* cos and sin are multiplied by it (yarn's attention factor); finite;
     * 0: 1. */
    float rope_attention_scaling;
    /* The dims of each head that rotate (partial_rotary_factor x head_dim):
     * even, in [2, head_dim]; 0: head_dim. */
    int64_t rope_dim;
    /* Appended for sliding-window attention (a desc whose size ends at
     * rope_dim has none): a new token attends only the sliding_window keys
     * up to its own (cache indices c' with c - sliding_window < c' <= c, as
     * Mistral's and transformers' sliding_window); 0: every key before it. */
    uint32_t sliding_window;
} kiln_paged_attention_desc;

KILN_API kiln_status kiln_op_paged_attention_encode(kiln_jit *jit, const kiln_paged_attention_desc *desc,
                                                    kiln_command **cmd);
/* Encodes and submits on the runtime's own stream (kiln_runtime_stream). */
KILN_API kiln_status kiln_op_paged_attention(kiln_jit *jit, const kiln_paged_attention_desc *desc);

/* Tokens one page holds: 32768 / (kv_heads * head_dim * 2), rounded down.
 * KILN_ERR_RUNTIME_CONTRACT when head_dim is not 64, 128 or 256, kv_heads < 1, or
 * a page would hold no token; KILN_ERR_INVALID_ARGUMENT for a NULL out. */
KILN_API kiln_status kiln_op_paged_attention_page_tokens(int64_t head_dim, int64_t kv_heads, uint32_t *out);

/* The specialization for an element type (f16 or bf16) and a head layout,
 * decode (1: one new token per sequence; template paged_decode, or at
 * head_dim 256 paged_attention with the decode's rows) or prefill (0;
 * template paged_attention). KILN_ERR_RUNTIME_CONTRACT for another elt, head_dim not in
 * {64, 128, 256}, kv_heads not dividing heads, heads > KILN_MODEL_MAX_HEADS, or a
 * page holding no token. */
KILN_API kiln_status kiln_op_paged_attention_spec(kiln_dtype elt, int64_t head_dim, int64_t heads, int64_t kv_heads, int decode,
                                                  kiln_spec *out);

/* Workspace bytes a command needs (see the desc's workspace): 0, now that
 * the decode splits over a cluster's shared memory (kept so that a caller
 * sizing a shared workspace need not change). seqs is S (the block table's
 * first dim), max_query_tokens the desc's (T where the desc says 0).
 * KILN_ERR_RUNTIME_CONTRACT for a head layout kiln_op_paged_attention_spec
 * refuses, seqs outside [1, 65535] or max_query_tokens < 1;
 * KILN_ERR_INVALID_ARGUMENT for a NULL bytes. */
KILN_API kiln_status kiln_op_paged_attention_workspace(int64_t seqs, int64_t heads, int64_t kv_heads,
                                                       int64_t head_dim, int64_t max_query_tokens, size_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
