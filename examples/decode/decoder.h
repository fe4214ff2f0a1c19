/* examples/decode — a Llama / Qwen2 / Qwen3 / Mistral decoder, and the
 * mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral, on kiln's providers.
 *
 * A checkpoint (config.json + safetensors, f16 or bf16) is checked tensor by
 * tensor on the host, uploaded into device buffers, and run with every operation
 * encoded through kiln's providers: token embedding, RMSNorm (fused with the
 * residual), dense linear (+bias), causal paged attention with RoPE over a
 * paged KV cache, dense SwiGLU or the experts (the router's linear,
 * kiln_op_moe_router, kiln_op_moe_experts with Qwen2-MoE's shared expert),
 * last-token linear and masked argmax.
 *
 * Each step (the prefill of every prompt packed together, then one decode
 * step per new token of the batch) is ONE submission of pre-encoded commands.
 * The values that change from step to step (token ids, positions, sequence
 * lengths, query spans, block tables) live in a binding arena and travel as
 * patches of that submission, so the same commands (and, once the runtime
 * caches graph executables, the same graph) serve every decode step of one
 * batch size. A participant that reaches its EOS or its token limit leaves
 * the batch; the others go on with the commands encoded for the smaller batch.
 *
 * Errors: every function returns a kiln_status; dec_errmsg() says what failed
 * (the tensor, the field, the values), in the calling thread.
 */
#ifndef KILN_EXAMPLES_DECODER_H
#define KILN_EXAMPLES_DECODER_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <kiln/kiln.h>
#include <kiln/safetensors.h>

#define DEC_MAX_EOS 8
#define DEC_MAX_FILES 64

typedef struct dec_config {
    kiln_model_config base;   /* sizes, eps, dtype, RoPE (rope_parameters or rope_scaling), tie */
    char model_type[32];      /* "llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe" or "mixtral" */
    int64_t layers;           /* num_hidden_layers */
    int qkv_bias;             /* qwen2: always; qwen2_moe: qkv_bias (true when absent); llama: attention_bias */
    /* Mixture of experts: base.num_experts, num_experts_per_tok,
     * moe_intermediate_size and norm_topk_prob (every layer's MLP the
     * experts; 0 experts: dense); the shared expert's intermediate size
     * (Qwen2-MoE's, gated by shared_expert_gate), 0 for none. */
    int64_t shared_inter;
    int64_t eos[DEC_MAX_EOS]; /* eos_token_id (a number or a list); none when n_eos is 0 */
    size_t n_eos;
    /* kiln_model_rope_frequencies of base, for sequences up to
     * max_position_embeddings: base.rope_dim / 2 inverse frequencies (scaled
     * as the config says) and the factor of cos and sin (1 except yarn). */
    float rope_inv_freq[KILN_MODEL_MAX_HEAD_DIM / 2];
    float rope_attention_scaling;
} dec_config;

/* The message of the calling thread's last failure in this module. */
const char *dec_errmsg(void);

/* Parses a config.json held in memory. KILN_ERR_CONFIG names the field and
 * the value: an unsupported architecture (model_type other than llama, qwen2,
 * qwen3, mistral, qwen3_moe, qwen2_moe and mixtral), experts in a dense
 * family's config, expert shapes kiln_op_moe_experts does not take (hidden
 * a multiple of 128, the expert intermediate size of 64), what the engine
 * does not run yet (Qwen2's use_sliding_window), an activation other than
 * silu, MLP biases, a head_dim the attention provider does not take (64,
 * 128, 256), and everything kiln_model_config_parse refuses (RoPE scaling of
 * an unknown type or with bad fields among it; dense layers among the
 * experts' layers; more experts than the MoE operation takes). */
kiln_status dec_config_parse(const char *json, size_t len, dec_config *out);
kiln_status dec_config_load(const char *path, dec_config *out);

/* A checkpoint folder: config.json and model.safetensors, or the shards that
 * model.safetensors.index.json names. */
typedef struct dec_checkpoint {
    dec_config config;
    kiln_safetensors *files[DEC_MAX_FILES];
    size_t n_files;
} dec_checkpoint;

kiln_status dec_checkpoint_open(const char *dir, dec_checkpoint *out);
void dec_checkpoint_close(dec_checkpoint *ck);

/* Checks that every tensor the config needs is in the files, of the
 * config's dtype (f16 or bf16) and its shape (on the host; no device).
 * KILN_ERR_NOT_FOUND names a missing tensor, KILN_ERR_CONFIG a tensor of
 * another dtype or shape. A mixture of experts' layer is read in either
 * layout transformers writes: one tensor per expert and projection
 * (model.layers.L.mlp.experts.J.{gate,up,down}_proj.weight; Mixtral's
 * block_sparse_moe.experts.J.{w1,w3,w2}.weight and block_sparse_moe.gate),
 * as save_pretrained writes them by default, or the fused tensors of
 * transformers 5's modules (mlp.experts.gate_up_proj [experts, 2 inter,
 * hidden], gate rows then up rows; mlp.experts.down_proj [experts, hidden,
 * inter]; Mixtral's router then mlp.gate), as save_pretrained writes with
 * save_original_format=False; the fused layout when the layer has its
 * gate_up_proj. */
kiln_status dec_check_weights(const dec_config *c, kiln_safetensors *const *files, size_t n_files);

/* The model's weights on the device. q_proj, k_proj and v_proj are
 * concatenated at load (rows q, then k, then v: [(heads + 2 kv_heads) *
 * head_dim, hidden]), and so are their biases when the model has them: one
 * dense product writes the fused qkv rows the attention reads. q_norm and
 * k_norm ([head_dim] each) are Qwen3's (config qk_norm), NULL otherwise.
 * A mixture of experts' layer has no w_gate_up and w_down but the router
 * [experts, hidden], the experts in kiln_op_moe_experts' layout (x_gate_up
 * [experts, 2 inter, hidden], each expert's gate rows then its up rows;
 * x_down [experts, hidden, inter]) and, for Qwen2-MoE, the shared expert
 * (sh_gate_up [2 shared_inter, hidden], sh_down [hidden, shared_inter],
 * sh_gate [hidden]: shared_expert_gate); NULL where the model has none. */
typedef struct dec_layer {
    kiln_buffer *in_norm, *post_norm, *wqkv, *bqkv, *wo, *w_gate_up, *w_down, *q_norm, *k_norm;
    kiln_buffer *router, *x_gate_up, *x_down, *sh_gate_up, *sh_down, *sh_gate;
} dec_layer;

typedef struct dec_model {
    dec_config config;
    kiln_runtime *rt;
    kiln_buffer *embed, *final_norm, *lm_head; /* lm_head == embed when tied (one reference each) */
    dec_layer *layer;
    uint64_t weight_bytes;   /* what one decode step reads: every weight but the embedding table (every
                              * expert: a mixture of experts' step reads at most batch x top_k of them) */
    uint64_t uploaded_bytes;
} dec_model;

/* Checks and uploads a checkpoint's weights. */
kiln_status dec_model_load(kiln_runtime *rt, const dec_checkpoint *ck, dec_model **out);
/* Weights of the config's shapes filled by tiling chunk (halves) from its
 * start into every tensor (device-to-device copies after one upload): for
 * benchmarks of models no file holds. */
kiln_status dec_model_random(kiln_runtime *rt, kiln_stream *s, const dec_config *c, const uint16_t *chunk,
                             size_t chunk_halves, dec_model **out);
void dec_model_free(dec_model *m);

typedef struct dec_engine_options {
    uint32_t max_participants;   /* sequences at once */
    uint32_t max_prefill_tokens; /* all prompts of one prefill together */
    uint32_t max_seq_tokens;     /* the most tokens one sequence's cache holds */
} dec_engine_options;

typedef struct dec_engine dec_engine;

/* Allocates the activations, the workspace, the KV pages and the binding
 * arena. The jit and the stream are borrowed and must outlive the engine. */
kiln_status dec_engine_create(kiln_jit *jit, kiln_stream *s, const dec_model *m, const dec_engine_options *o,
                              dec_engine **out);
void dec_engine_free(dec_engine *e);
/* The KV page bytes the engine holds. */
uint64_t dec_engine_kv_bytes(const dec_engine *e);

typedef struct dec_request {
    const uint32_t *prompt;
    uint32_t prompt_len; /* >= 1 */
    uint32_t max_new;    /* >= 1 */
} dec_request;

typedef struct dec_result {
    uint32_t *tokens; /* max_new capacity, the caller's */
    uint32_t n;
    int stopped_at_eos;
} dec_result;

typedef struct dec_stats {
    double prefill_s, decode_s, encode_s; /* wall time: the prefill submission to its tokens, the decode steps, encoding */
    uint64_t prefill_tokens, decode_tokens, decode_steps;
    uint64_t replayed_commands, eager_commands; /* per the fences' attribution */
} dec_stats;

/* Called with each participant's last-position logits (f16 or bf16 bits: the
 * model's dtype) at each step: step 0 is the prefill, step k the k-th decode step. */
typedef void (*dec_logits_fn)(void *user, uint32_t participant, uint32_t step, const uint16_t *logits,
                              size_t vocab);

/* Called, for a mixture of experts under dec_record_routing, after each step
 * of dec_generate for each row it computed: the participant, the row's
 * position in its sequence (the prefill's prompt tokens, then one a decode
 * step), and the K experts layer l's router chose for it at ids[l *
 * layer_stride + j], j < K, in the router's order. */
typedef void (*dec_routing_fn)(void *user, uint32_t participant, uint32_t position, const uint32_t *ids,
                               size_t layer_stride);

/* Makes dec_generate report every routing decision to fn (NULL: none, the
 * default). A dense model has none to report. */
void dec_record_routing(dec_engine *e, dec_routing_fn fn, void *user);

/* Greedy decoding of n requests at once. Each stops at one of eos[0..n_eos)
 * (the EOS token is kept) or at its max_new tokens. logits may be NULL. */
kiln_status dec_generate(dec_engine *e, const dec_request *reqs, size_t n, const int64_t *eos, size_t n_eos,
                         dec_logits_fn logits, void *user, dec_result *results, dec_stats *stats);

/* Decode-step latency for batch participants whose caches hold context - 1
 * tokens (each step appends one, attends over context, and is not kept: the
 * same context every step). steps timed after warmup; *device_ms: the median
 * device-measured time of one submission; *wall_ms: steps submitted back to
 * back, wall time per step. */
kiln_status dec_bench_steps(dec_engine *e, uint32_t batch, uint32_t context, int warmup, int steps,
                            double *device_ms, double *wall_ms, uint64_t *replayed_commands);

/* The first decode step of a new engine, as a server's first request meets
 * it: *encode_ms to encode the step's commands (kernels from the jit or its
 * database, products planned), *step_ms to submit it (capturing its graph)
 * and wait for it. */
kiln_status dec_bench_first_step(dec_engine *e, uint32_t batch, uint32_t context, double *encode_ms, double *step_ms);

/* After dec_bench_steps for batch: one more step, eager, timed command by
 * command; prints one JSON line of milliseconds (and, for the commands that
 * read weights or the KV cache, bytes and GB/s) per kind of command. */
kiln_status dec_bench_breakdown(dec_engine *e, uint32_t batch, uint32_t context, FILE *out);

/* Model FLOPs of a prefill of seqs sequences of tokens each, a multiply-add
 * counted as 2 and only the products counted (norms, RoPE, silu, softmax and
 * the embedding gather are not), with T = seqs x tokens:
 *   per layer, the dense products: 2 x T x (hidden x (q + 2 kv) + q x hidden
 *     + hidden x 2 intermediate + intermediate x hidden), q = heads x head_dim,
 *     kv = kv_heads x head_dim; for a mixture of experts, in place of the
 *     dense MLP, 2 x T x (hidden x experts (the router) + top_k x 3 x
 *     expert intermediate x hidden + 3 x shared intermediate x hidden);
 *   per layer, causal attention: 2 x 2 x q x seqs x tokens (tokens + 1) / 2
 *     (q.k and p.v over every pair of a query and a key at or before it);
 *   the lm head of each sequence's last token: 2 x seqs x vocab x hidden.
 * label: one kind of command of the step ("qkv_proj", "attention", "o_proj",
 * "swiglu", "down_proj", "router_proj", "experts", "shared_swiglu",
 * "shared_down", "lm_head"; 0 for any other), NULL for the sum. */
double dec_prefill_flops(const dec_config *c, const char *label, uint32_t seqs, uint32_t tokens);

typedef struct dec_prefill_times {
    double device_ms, min_ms; /* the median and the least device-measured time of one prefill submission */
    double wall_ms;           /* the median wall time from submit to its fence's completion */
    int iters;                /* submissions timed */
    uint64_t commands;        /* commands of the step */
    uint64_t replayed;        /* of them, replayed from a graph in the last timed submission */
} dec_prefill_times;

/* Prefill latency: seqs sequences of tokens each (token ids arbitrary, no
 * cached prefix), packed in one step as dec_generate's prefill submits it
 * (embedding, every layer, the final norm, each sequence's last-token logits
 * and argmax), encoded once, submitted warmup times and then timed: iters
 * submissions, or fewer (at least 3) once their device time passes
 * budget_ms. Under the adaptive path: the first submission captures the
 * step's graph, the others replay it. The engine needs seqs participants,
 * seqs x tokens prefill tokens and tokens sequence tokens. */
kiln_status dec_bench_prefill(dec_engine *e, uint32_t seqs, uint32_t tokens, int warmup, int iters,
                              double budget_ms, dec_prefill_times *out);

/* After dec_bench_prefill: one more prefill, eager, timed command by
 * command; prints one JSON line of milliseconds (and, for the products and
 * the attention, TFLOP and TFLOP/s by dec_prefill_flops) per kind of command. */
kiln_status dec_bench_prefill_breakdown(dec_engine *e, FILE *out);

#endif
