#!/usr/bin/env python3
"""Checks examples/decode against transformers, token for token.

For each model below: build it with random weights through transformers
(LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig, Qwen3MoeConfig,
Qwen2MoeConfig or MixtralConfig, a few layers, small sizes; Llama and Qwen2
with and without tied embeddings, Llama with llama3 and yarn RoPE scaling,
Qwen3 with its per-head q/k RMSNorm and a head_dim that is not hidden_size /
heads, Mistral with a sliding window shorter than its longer prompts; the
mixtures of experts with routers scaled (router_std) so that tokens choose
different experts, which is checked on the reference (ROUTING), and experts
drawn around a common one (expert_spread) so that a near-tied router choice
moves the output little: a Qwen3-MoE of 64 experts, 8 a token, renormalized; a Qwen2-MoE of 8, 2 a token, not
renormalized, with its gated shared expert; a Mixtral of 8, 2 a token, its
experts saved as transformers 5's fused tensors (mlp.experts.gate_up_proj,
down_proj: save_original_format=False, or fused here from the per-expert
tensors under transformers 4) where the others keep one tensor per expert),
save_pretrained in its dtype (f16 or bf16, safetensors; one model sharded into
three files), run greedy generate in that dtype on cuda for several prompts
of different lengths (one longer than 2048 tokens), one at a time, then run
the kiln decoder ONCE on all prompts as one batch (different token limits, so
that participants leave the batch at different steps) and compare:
  - the token ids, every one of them (>= 32 new tokens per prompt);
  - the last-position logits of every step: max |kiln - hf| / max |hf| <= 2e-2
    in f16, 4e-2 in bf16;
  - kiln's RoPE frequencies and attention scaling (kiln_model_rope_frequencies
    through libkiln) against the model's own rotary embedding, 1e-6 relative.
Both runs are also held against the same model in float32 (teacher-forced
along transformers' tokens): where kiln and transformers part ways, it is a
tie of the dtype, not a failure, only when kiln is at least as close to the
float32 logits as transformers is (1.5x its error, or a quarter of the
tolerance) and the float32 logits of the two tokens differ by less than twice
transformers' error.
A mixture of experts also has ties of its routers, where two correct
implementations may choose different experts and then part ways by more than
any dense tolerance. So kiln's routing is recorded (decode --dump-routing)
and checked decision by decision: at every position on transformers' token
path (the prompt's and the decoded ones), every layer's chosen experts are
the float32 model's top k, or differ from them only where float32's k-th
logit is within RTIE x the router's noise (transformers' largest router
distance from float32 in that layer up to that position) of the weakest
expert kiln chose; after kiln differed at an earlier layer, at that position
any difference is allowed, at later positions one within RTIE_AFTER x the
noise (attention carries the earlier choice). Then the float32 model is run
again with kiln's experts forced into its routers (their weights from
float32's own probabilities): kiln's logits must be within the tolerance of
it at every step, and where kiln's tokens part from transformers', that
model must rank the two tokens within twice kiln's error of each other.
A second kiln run with an EOS token taken from the reference checks that each
participant stops at its EOS while the others go on. The database is
prewarmed with `kiln prewarm --model config.json` first: the kiln runs must
compile nothing.

Random-weight models give near-tied logits, where two f16 implementations may
legitimately pick different tokens. The init is scaled (initializer_range) so
that attention is not uniform, and each prompt is drawn until the REFERENCE's
top-1 / top-2 gap stays above MARGIN x the logits' standard deviation at
every step (at most TRIES draws; the best draw otherwise). The selection looks
at transformers' outputs only, never at kiln's.

Usage (on the GPU machine, from the repository root, after building build-h8):
  python3 examples/decode/check.py --build build-h8 [--out DIR] [--only NAME,...]
Exit 0 when every check passes.
"""
import argparse
import copy
import ctypes
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

MARGIN = 0.01
TRIES = 16
LOGIT_TOL = {"f16": 2e-2, "bf16": 4e-2}
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
# A mixture of experts' reference must route: over a prompt, in every layer,
# at least this share of the experts is chosen by some token, and the tokens'
# sets of experts are not all one.
ROUTING = 0.5
RTIE = 2.0
RTIE_AFTER = 10.0

MODELS = [
    dict(name="llama-gqa", cls=(LlamaConfig, LlamaForCausalLM), tie=False, theta=10000.0,
         sizes=dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64),
         prompts=[(5, 40), (23, 36), (150, 33), (64, 48), (2100, 32)]),
    dict(name="qwen2-tied", cls=(Qwen2Config, Qwen2ForCausalLM), tie=True, theta=1000000.0,
         sizes=dict(vocab_size=1536, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=64),
         prompts=[(7, 40), (300, 34), (31, 44)]),
    dict(name="llama-tied-hd128", cls=(LlamaConfig, LlamaForCausalLM), tie=True, theta=500000.0,
         sizes=dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=128),
         prompts=[(3, 40), (45, 32), (100, 38)]),
    dict(name="llama-llama3-bf16-sharded", cls=(LlamaConfig, LlamaForCausalLM), tie=False, theta=500000.0,
         dtype="bf16", shards=3,
         rope=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=256),
         sizes=dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64),
         prompts=[(5, 40), (300, 34), (1200, 32)]),
    dict(name="llama-yarn-bf16", cls=(LlamaConfig, LlamaForCausalLM), tie=False, theta=10000.0, dtype="bf16",
         rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=512),
         sizes=dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=128),
         prompts=[(9, 36), (700, 32), (60, 40)]),
    dict(name="qwen2-tied-bf16", cls=(Qwen2Config, Qwen2ForCausalLM), tie=True, theta=1000000.0, dtype="bf16",
         sizes=dict(vocab_size=1536, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=64),
         prompts=[(7, 40), (300, 34), (31, 44)]),
    # head_dim 256 (the wgmma prefill on sm_90, the CUDA-core kernel for decode).
    dict(name="llama-hd256", cls=(LlamaConfig, LlamaForCausalLM), tie=False, theta=1000000.0,
         sizes=dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=256),
         prompts=[(6, 40), (250, 34), (700, 32)]),
    # A window shorter than two of the prompts: prefill and decode both
    # attend only the last 256 keys.
    dict(name="mistral-window-bf16", cls=(MistralConfig, MistralForCausalLM), tie=False, theta=1000000.0,
         dtype="bf16", extra=dict(sliding_window=256),
         sizes=dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64),
         prompts=[(5, 40), (400, 36), (900, 32)]),
    # Qwen3: q_norm / k_norm over head_dim 128 before RoPE; heads * head_dim
    # (1024) != hidden_size (512). Its norm weights are perturbed per
    # element (init leaves them 1), so that q's and k's weights differ.
    dict(name="qwen3-bf16", cls=(Qwen3Config, Qwen3ForCausalLM), tie=False, theta=1000000.0, dtype="bf16",
         qk_norm_noise=0.3,
         sizes=dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=128),
         prompts=[(6, 40), (250, 34), (1100, 32)]),
    # Mixtures of experts: hidden a multiple of 128, the experts' intermediate
    # size of 64 (kiln_op_moe_experts); every layer's MLP is the experts.
    dict(name="qwen3-moe-bf16", cls=(Qwen3MoeConfig, Qwen3MoeForCausalLM), tie=False, theta=1000000.0,
         dtype="bf16", qk_norm_noise=0.3, router_std=2.0, expert_spread=0.2,
         extra=dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[]),
         sizes=dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64),
         prompts=[(6, 40), (200, 34), (700, 32)]),
    dict(name="qwen2-moe-shared-bf16", cls=(Qwen2MoeConfig, Qwen2MoeForCausalLM), tie=False, theta=1000000.0,
         dtype="bf16", router_std=2.0, expert_spread=0.3,
         extra=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
                    shared_expert_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[]),
         sizes=dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64),
         prompts=[(7, 40), (300, 34), (31, 44)]),
    # Mixtral's experts are intermediate_size wide.
    dict(name="mixtral-fused", cls=(MixtralConfig, MixtralForCausalLM), tie=False, theta=1000000.0,
         router_std=2.0, expert_spread=0.3, fused=True,
         extra=dict(num_local_experts=8, num_experts_per_tok=2),
         sizes=dict(vocab_size=1024, hidden_size=384, intermediate_size=192, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=64),
         prompts=[(5, 40), (250, 34), (600, 32)]),
]


def log(*a):
    print(*a, flush=True)


def make_model(spec, path, seed):
    Cfg, Model = spec["cls"]
    kw = dict(spec["sizes"])
    kw.update(tie_word_embeddings=spec["tie"], initializer_range=0.06, rms_norm_eps=1e-6,
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(spec.get("extra", {}))
    rope = dict(spec.get("rope", {"rope_type": "default"}))
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = dict(rope, rope_theta=spec["theta"])
    else:
        kw["rope_theta"] = spec["theta"]
        if rope["rope_type"] != "default":
            kw["rope_scaling"] = rope
    cfg = Cfg(**kw)
    torch.manual_seed(seed)
    model = Model(cfg).to(DTYPES[spec.get("dtype", "f16")]).cuda().eval()
    # .to(dtype) rounds the rotary embedding's inv_freq buffer to f16 / bf16,
    # which moves the angle at position p by p times its rounding (a radian
    # at 2000 tokens in f16); the reference rotates by the float32
    # frequencies, as a checkpoint loaded by from_pretrained does.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    restored = 0
    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "rope_type"):
            fn = m.compute_default_rope_parameters if m.rope_type == "default" else ROPE_INIT_FUNCTIONS[m.rope_type]
            inv, _ = fn(m.config, torch.device("cuda"))
            m.inv_freq = inv.to(torch.float32)
            m.original_inv_freq = m.inv_freq.clone()
            restored += 1
    if not restored:
        raise RuntimeError("no rotary embedding with a rope_type in this transformers")
    noise = spec.get("qk_norm_noise")
    if noise:
        norms = [m for name, m in model.named_modules() if name.endswith((".q_norm", ".k_norm"))]
        if len(norms) != 2 * kw["num_hidden_layers"]:
            raise RuntimeError("%s: %d q/k norms, expected 2 per layer" % (spec["name"], len(norms)))
        with torch.no_grad():
            for m in norms:
                m.weight.copy_(1 + noise * torch.randn_like(m.weight, dtype=torch.float32))
    routers = [m for name, m in model.named_modules() if is_router(name)]
    if spec.get("router_std"):
        if len(routers) != kw["num_hidden_layers"]:
            raise RuntimeError("%s: %d routers, expected 1 per layer" % (spec["name"], len(routers)))
        # Logits of about router_std standard deviation (the normed hidden
        # has unit RMS): tokens prefer different experts, and few top-k
        # choices are near ties.
        with torch.no_grad():
            for m in routers:
                m.weight.normal_(0.0, spec["router_std"] / kw["hidden_size"] ** 0.5)
    if spec.get("expert_spread"):
        spread_experts(model, spec["expert_spread"])
    saved_fused = False
    if spec.get("fused") and int(transformers.__version__.split(".")[0]) >= 5:
        try:
            model.save_pretrained(path, save_original_format=False)  # the modules' own (fused) tensors
            saved_fused = True
        except TypeError:  # a 5.x without the switch
            pass
    if not saved_fused:
        model.save_pretrained(path)  # safetensors, in the model's dtype
    if spec.get("fused"):
        fuse_experts(path, kw["num_hidden_layers"])
    if spec.get("shards"):
        reshard(path, spec["shards"])
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    return model, saved


@torch.no_grad()
def spread_experts(model, a):
    """Each layer's experts become sqrt(1 - a^2) B + a W_e, B one draw like W_e
    shared by the layer's experts: the same spread of weights, and experts a
    token could swap at a near tie differ by a fraction a of one. Fused
    (transformers 5: experts.gate_up_proj [E, ...]) or one module an expert."""
    groups = {}
    for name, prm in model.named_parameters():
        if ".experts." not in name:
            continue
        if re.search(r"\.experts\.\d+\.", name):
            groups.setdefault(re.sub(r"\.experts\.\d+\.", ".experts.*.", name), []).append(prm)
        elif prm.dim() == 3:
            groups[name] = [prm[e] for e in range(prm.shape[0])]
    if not groups:
        raise RuntimeError("no expert weights to spread")
    for ws in groups.values():
        base = torch.randn_like(ws[0], dtype=torch.float32) * torch.stack([w.float() for w in ws]).std()
        for w in ws:
            w.copy_(((1 - a * a) ** 0.5 * base + a * w.float()).to(w.dtype))


def fuse_experts(path, layers):
    """Makes model.safetensors hold each layer's experts as transformers 5's
    modules do: mlp.experts.gate_up_proj [experts, 2 inter, hidden] (each
    expert's gate rows, then its up rows), mlp.experts.down_proj [experts,
    hidden, inter], the router as mlp.gate. A file already so is kept."""
    from safetensors.torch import load_file, save_file
    whole = os.path.join(path, "model.safetensors")
    t = load_file(whole)
    fused = "model.layers.0.mlp.experts.gate_up_proj" in t
    log("  experts: %s" % ("fused by save_pretrained" if fused else "fused here from the per-expert tensors"))
    if fused:
        return
    for l in range(layers):
        p = "model.layers.%d." % l
        block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if p + "block_sparse_moe.gate.weight" in t else \
            ("mlp", ("gate_proj", "up_proj", "down_proj"))
        e = 0
        gate_up, down = [], []
        while "%s%s.experts.%d.%s.weight" % (p, block, e, names[0]) in t:
            k = ["%s%s.experts.%d.%s.weight" % (p, block, e, n) for n in names]
            gate_up.append(torch.cat([t.pop(k[0]), t.pop(k[1])], dim=0))
            down.append(t.pop(k[2]))
            e += 1
        if not e:
            raise RuntimeError("%s: layer %d has no experts to fuse" % (path, l))
        t[p + "mlp.gate.weight"] = t.pop(p + block + ".gate.weight")
        t[p + "mlp.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        t[p + "mlp.experts.down_proj"] = torch.stack(down).contiguous()
    save_file(t, whole, metadata={"format": "pt"})


def is_router(name):
    return name.endswith(("mlp.gate", "block_sparse_moe.gate"))


@torch.no_grad()
def router_outputs(model, ids):
    """Each router's output over ids, in layer order, as a tuple of tensors
    (transformers 4: the gate's logits; 5: the router's tuple)."""
    got, hooks = [], []
    for name, m in model.named_modules():
        if is_router(name):
            hooks.append(m.register_forward_hook(
                lambda mod, inp, out: got.append(out if isinstance(out, tuple) else (out,))))
    try:
        model(input_ids=torch.tensor([ids], device="cuda"))
    finally:
        for h in hooks:
            h.remove()
    return got


def router_full(outs, n_experts):
    """A router's logits or probabilities [tokens, experts] in float32."""
    return [o for o in outs if o.is_floating_point() and o.shape[-1] == n_experts][0].reshape(-1, n_experts).float()


def routing(model, ids):
    """Per layer: how many experts some token of ids chose, and how many
    distinct sets of experts the tokens chose (the reference's own routers:
    their chosen indices where they return them)."""
    cfg = model.config
    k = cfg.num_experts_per_tok
    n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    stats = []
    for outs in router_outputs(model, ids):
        idx = [o for o in outs if not o.is_floating_point() and o.shape[-1] == k]
        chosen = idx[0].reshape(-1, k) if idx else router_full(outs, n_experts).topk(k, dim=-1).indices
        p = chosen.sort(-1).values
        stats.append((p.unique().numel(), len({tuple(r) for r in p.tolist()})))
    return stats


def router_logits(model, ids, n_experts):
    """Per router, in layer order: its logits [tokens, experts] in float32 over
    ids (log-probabilities where the router returns probabilities: the same
    differences)."""
    got = []
    for outs in router_outputs(model, ids):
        full = router_full(outs, n_experts)
        if (full >= 0).all() and ((full.sum(-1) - 1).abs() < 1e-3).all():
            full = full.clamp_min(1e-30).log()
        got.append(full)
    return got


def reshard(path, n):
    """Split the saved model.safetensors into exactly n shards and an index, as
    transformers names them (its own max_shard_size packing gives n or n+1)."""
    from safetensors.torch import load_file, save_file
    whole = os.path.join(path, "model.safetensors")
    tensors = load_file(whole)
    names = sorted(tensors, key=lambda k: -tensors[k].numel())
    bins = [dict() for _ in range(n)]
    sizes = [0] * n
    for k in names:  # largest first into the lightest shard
        i = sizes.index(min(sizes))
        bins[i][k] = tensors[k]
        sizes[i] += tensors[k].numel() * tensors[k].element_size()
    if any(not b for b in bins):
        raise RuntimeError("%d tensors cannot fill %d shards" % (len(tensors), n))
    weight_map = {}
    for i, b in enumerate(bins):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, n)
        save_file(b, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in b})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=2)
    os.remove(whole)


@torch.no_grad()
def reference(model, ids, n):
    x = torch.tensor([ids], device="cuda")
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(ids):].tolist()
    logits = torch.stack([l[0].float() for l in out.logits])  # [n, vocab]
    top = logits.topk(2, dim=-1).values
    gap = ((top[:, 0] - top[:, 1]) / logits.std(dim=-1)).min().item()
    return toks, logits.cpu(), gap


def read_records(path, n_head, values):
    """The records of a decode dump: n_head u32s, then values(head) 4-byte
    values; yields (head, their bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        head = struct.unpack_from("<%dI" % n_head, data, at)
        at += 4 * n_head
        n = 4 * values(head)
        yield head, bytearray(data[at:at + n])
        at += n


def read_dump(path):
    """decode --dump-logits: {(participant, step): [vocab] float32}."""
    return {(p, s): torch.frombuffer(b, dtype=torch.float32) for (p, s, v), b in read_records(path, 3, lambda h: h[2])}


def read_routing(path):
    """decode --dump-routing: {(participant, position): [layers, k] int64}."""
    return {(p, q): torch.frombuffer(b, dtype=torch.int32).long().view(layers, k)
            for (p, q, layers, k), b in read_records(path, 4, lambda h: h[2] * h[3])}


def check_routing(model, model32, ids, toks, upto, kiln_rows, p, k, n_experts):
    """Kiln's choices at positions < upto of ids + toks against float32's
    top k (see the docstring): (decisions, differing, ties' largest margin
    over the noise, failures as text)."""
    seq = ids + toks[:-1]
    lhs, lfs = router_logits(model, seq, n_experts), router_logits(model32, seq, n_experts)
    decisions, differ, worst, bad = 0, 0, 0.0, []
    differed_at = set()  # positions where kiln already differed at an earlier layer
    for layer, (lh, lf) in enumerate(zip(lhs, lfs)):
        first_earlier = min(differed_at) if differed_at else None
        noise = (lh - lf).abs().max(dim=-1).values.cummax(0).values  # running max over positions
        cut = lf.topk(k, dim=-1).values[:, k - 1]
        for q in range(min(upto, lf.shape[0])):
            got = kiln_rows.get((p, q))
            if got is None:
                bad.append("no routing recorded at position %d" % q)
                break
            chosen = got[layer]
            decisions += 1
            if chosen.min() < 0 or chosen.max() >= n_experts or chosen.unique().numel() != k:
                bad.append("layer %d position %d: chose %s" % (layer, q, chosen.tolist()))
                continue
            want = set(lf[q].topk(k).indices.tolist())
            if set(chosen.tolist()) == want:
                continue
            differ += 1
            margin = (cut[q] - lf[q][chosen].min()).item()
            after = first_earlier is not None and q > first_earlier
            allowed = (RTIE_AFTER if after else RTIE) * noise[q].item()
            if margin > allowed and q not in differed_at:
                bad.append("layer %d position %d: kiln chose %s, float32 %s; kiln's weakest is %.3g below "
                           "float32's k-th, noise allows %.3g" % (layer, q, sorted(chosen.tolist()), sorted(want),
                                                                 margin, allowed))
            elif margin <= allowed:
                worst = max(worst, margin / allowed if allowed > 0 else 0.0)
            differed_at.add(q)
    return decisions, differ, worst, bad


@torch.no_grad()
def float32_logits_routed(model32, ids, toks, upto, kiln_rows, p, k, n_experts):
    """The float32 model's logits after the prompt and each of toks but the
    last (as float32_logits), its routers made to choose kiln's experts at
    positions < upto, weighted by float32's own probabilities (renormalized
    over the k where the model renormalizes)."""
    norm = getattr(model32.config, "norm_topk_prob", True)  # Mixtral's renormalize, no switch
    hooks = []
    routers = [m for name, m in model32.named_modules() if is_router(name)]
    for layer, m in enumerate(routers):
        def hook(mod, inp, out, layer=layer):
            if not (isinstance(out, tuple) and len(out) == 3):
                raise RuntimeError("a router without (logits, scores, indices): this transformers is not handled")
            lg, scores, idx = out
            idx = idx.clone()
            for q in range(min(upto, idx.shape[0])):
                idx[q] = kiln_rows[(p, q)][layer].to(idx.device)
            w = torch.softmax(lg.float(), dim=-1).gather(-1, idx)  # the router's logits, as transformers 5 returns
            if norm:
                w = w / w.sum(-1, keepdim=True)
            return lg, w.to(scores.dtype), idx
        hooks.append(m.register_forward_hook(hook))
    try:
        return float32_logits(model32, ids, toks)
    finally:
        for h in hooks:
            h.remove()


def kiln_rope(args, config_path, n):
    """kiln_model_rope_frequencies of a saved config, through libkiln."""
    lib = ctypes.CDLL(os.path.join(args.build, "libkiln.so"))
    cfg = ctypes.create_string_buffer(1 << 16)  # kiln_model_config, opaque here
    if lib.kiln_model_config_load(config_path.encode(), cfg) != 0:
        raise RuntimeError("kiln_model_config_load failed")
    inv, scale = (ctypes.c_float * n)(), ctypes.c_float()
    if lib.kiln_model_rope_frequencies(cfg, ctypes.c_int64(0), inv, ctypes.c_size_t(n), ctypes.byref(scale)) != 0:
        raise RuntimeError("kiln_model_rope_frequencies failed")
    return torch.tensor(list(inv), dtype=torch.float64), scale.value


@torch.no_grad()
def float32_logits(model32, ids, toks):
    """The float32 model's logits after the prompt and after each of toks but the last."""
    x = torch.tensor([ids + toks[:-1]], device="cuda")
    out = model32(input_ids=x).logits[0, len(ids) - 1:].float()
    return out.cpu()


def rel_err(a, ref):
    return ((a - ref).abs().max() / ref.abs().max()).item()


def run_kiln(args, path, prompts, extra, db, dump=None, routing_dump=None):
    cmd = [os.path.join(args.build, "examples/decode/decode"), "--model", path, "--db", db]
    for ids, n in prompts:
        cmd += ["--prompt", ",".join(map(str, ids)) + ":" + str(n)]
    cmd += extra
    if dump:
        cmd += ["--dump-logits", dump]
    if routing_dump:
        cmd += ["--dump-routing", routing_dump]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("decode failed (%d): %s" % (r.returncode, r.stderr.strip()))
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
    parts = sorted([l for l in lines if "participant" in l], key=lambda l: l["participant"])
    summary = [l for l in lines if "summary" in l][0]
    summary["wall_s"] = round(time.time() - t0, 3)
    return parts, summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-h8")
    ap.add_argument("--out", default=None, help="where the models go (default: a temporary folder)")
    ap.add_argument("--only", default=None, help="comma-separated model names to check (default: all)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {m["name"] for m in MODELS}
    if unknown:
        sys.exit("check.py: --only names no model: %s" % ", ".join(sorted(unknown)))
    root = args.out or tempfile.mkdtemp(prefix="kiln-check-")
    os.makedirs(root, exist_ok=True)
    log("torch %s, transformers %s, %s" % (torch.__version__, transformers.__version__,
                                             torch.cuda.get_device_name(0)))
    failures = []
    gen = torch.Generator().manual_seed(1234)
    for mi, spec in enumerate(MODELS):
        if only and spec["name"] not in only:
            continue
        path = os.path.join(root, spec["name"])
        model, saved = make_model(spec, path, seed=100 + mi)
        model32 = copy.deepcopy(model).float()
        V = spec["sizes"]["vocab_size"]
        files = sorted(os.listdir(path))
        log("\n== %s: %s, %s, tie_word_embeddings=%s, rope %s, files %s" % (
            spec["name"], saved.get("architectures"), spec.get("dtype", "f16"), saved.get("tie_word_embeddings"),
            saved.get("rope_parameters", saved.get("rope_theta")), files))
        rot = model.model.rotary_emb
        hf_inv = rot.inv_freq.double().cpu()
        k_inv, k_scale = kiln_rope(args, os.path.join(path, "config.json"), hf_inv.numel())
        rope_err = ((k_inv - hf_inv).abs() / hf_inv).max().item()
        scale_err = abs(k_scale - float(rot.attention_scaling)) / float(rot.attention_scaling)
        log("  RoPE: %d frequencies, max rel diff %.2e; attention scaling kiln %.6f, hf %.6f" % (
            hf_inv.numel(), rope_err, k_scale, float(rot.attention_scaling)))
        if rope_err > 1e-6 or scale_err > 1e-6:
            failures.append("%s: RoPE differs from transformers' (frequencies %.3g, scaling %.3g)" % (
                spec["name"], rope_err, scale_err))
        if spec.get("router_std"):
            E = saved.get("num_experts") or saved.get("num_local_experts")
            ids = torch.randint(3, V, (200,), generator=gen).tolist()
            stats = routing(model, ids)
            log("  routing over 200 tokens, per layer (experts chosen of %d, distinct sets): %s" % (E, stats))
            if len(stats) != spec["sizes"]["num_hidden_layers"] or \
                    any(n < ROUTING * E or sets < 2 for n, sets in stats):
                failures.append("%s: the reference routes trivially: %s" % (spec["name"], stats))
        # Prompts, drawn until the reference's margins are clear.
        prompts, refs = [], []
        for plen, n in spec["prompts"]:
            best = None
            for t in range(TRIES):
                ids = torch.randint(3, V, (plen,), generator=gen).tolist()
                toks, logits, gap = reference(model, ids, n)
                if best is None or gap > best[3]:
                    best = (ids, toks, logits, gap, t + 1)
                if gap >= MARGIN:
                    break
            ids, toks, logits, gap, tries = best
            log("  prompt of %3d tokens, %d new: reference min gap %.4f x std (%d draw%s)" % (
                plen, n, gap, tries, "" if tries == 1 else "s"))
            prompts.append((ids, n))
            refs.append((toks, logits, gap))
        # A database prewarmed for this model: the kiln runs compile nothing.
        db = os.path.join(path, "kernels.db")
        pw = subprocess.run([os.path.join(args.build, "kiln"), "prewarm", "--model",
                             os.path.join(path, "config.json"), "--db", db, "-j", "8"],
                            capture_output=True, text=True)
        log("  kiln prewarm: exit %d, %s" % (pw.returncode, (pw.stdout.strip().splitlines() or ["?"])[-1]))
        dump = os.path.join(path, "logits.bin")
        moe = saved.get("num_experts") or saved.get("num_local_experts")
        rdump = os.path.join(path, "routing.bin") if moe else None
        try:
            parts, summary = run_kiln(args, path, prompts, ["--eos", "none"], db, dump, rdump)
        except RuntimeError as e:
            failures.append("%s: %s" % (spec["name"], e))
            log("  FAIL: %s" % e)
            continue
        rows = read_dump(dump)
        kiln_routing = read_routing(rdump) if moe else None
        tol = LOGIT_TOL[spec.get("dtype", "f16")]
        for p, ((ids, n), (toks, logits, gap)) in enumerate(zip(prompts, refs)):
            got = parts[p]["tokens"]
            first_diff = next((i for i in range(max(len(got), len(toks)))
                               if i >= len(got) or i >= len(toks) or got[i] != toks[i]), None)
            ref32 = float32_logits(model32, ids, toks)
            # Per step up to the first difference: kiln vs hf, kiln and hf vs float32.
            errs = []
            for s in range(min(len(got), len(toks))):
                if first_diff is not None and s > first_diff:
                    break
                k = rows[(p, s)]
                errs.append((rel_err(k, logits[s]), rel_err(k, ref32[s]), rel_err(logits[s], ref32[s])))
            rel, e_k, e_hf = (max([e[i] for e in errs], default=0.0) for i in range(3))
            closer = e_k <= max(1.5 * e_hf, tol / 4)
            ok = first_diff is None and len(got) == n
            diverged = not ok and first_diff is not None and first_diff < len(got) and first_diff < len(toks)
            tie = None
            if diverged:
                r = ref32[first_diff]
                g32 = ((r[toks[first_diff]] - r[got[first_diff]]) / r.abs().max()).item()
                tie = closer and g32 < 2 * e_hf
            routed = None
            if moe:
                k_top = saved["num_experts_per_tok"]
                upto = len(ids) + (first_diff if first_diff is not None else n)
                dec, differ, worst_tie, bad = check_routing(model, model32, ids, toks, upto, kiln_routing, p, k_top,
                                                            moe)
                forced = float32_logits_routed(model32, ids, toks, upto, kiln_routing, p, k_top, moe)
                e_kf = max((rel_err(rows[(p, s)], forced[s]) for s in range(len(errs))), default=0.0)
                routed_tie = None
                if diverged:
                    r = forced[first_diff]
                    g = ((r[toks[first_diff]] - r[got[first_diff]]) / r.abs().max()).item()
                    routed_tie = g < 2 * e_kf
                routed = (dec, differ, worst_tie, bad, e_kf, routed_tie)
            log("  participant %d: %d/%d tokens identical%s, logits max rel err %.2e vs hf; vs float32 kiln %.2e, "
                "hf %.2e (over %d steps)" % (
                    p, n if ok else (first_diff or 0), n,
                    "" if ok else " (first difference at new token %s: kiln %s, hf %s%s)" % (
                        first_diff, got[first_diff] if first_diff is not None and first_diff < len(got) else None,
                        toks[first_diff] if first_diff is not None and first_diff < len(toks) else None,
                        ", a tie of the dtype" if tie else ", a tie under kiln's routing" if routed and routed[5]
                        else ""),
                    rel, e_k, e_hf, min(len(got), len(toks))))
            if routed:
                dec, differ, worst_tie, bad, e_kf, routed_tie = routed
                log("    kiln's routing: %d decisions (%d layers x %d positions), %d differ from float32's, "
                    "each within %.2f of the noise it allows%s; logits %.2e from float32 under kiln's routing" % (
                        dec, len(kiln_routing[(p, 0)]), upto, differ, worst_tie,
                        "" if not bad else "; %d beyond it, first: %s" % (len(bad), bad[0]), e_kf))
                if bad:
                    failures.append("%s participant %d: kiln's routing: %s" % (spec["name"], p, bad[0]))
                if e_kf > tol:
                    failures.append("%s participant %d: logits %.3g from float32 under kiln's routing (> %g)" % (
                        spec["name"], p, e_kf, tol))
                if not ok and not tie and not routed_tie:
                    failures.append("%s participant %d: tokens differ at %s" % (spec["name"], p, first_diff))
                continue
            if not ok and not tie:
                failures.append("%s participant %d: tokens differ at %s" % (spec["name"], p, first_diff))
            if rel > tol and not closer:
                failures.append("%s participant %d: logits rel err %.3g > %g, and %.3g from float32 (hf %.3g)" % (
                    spec["name"], p, rel, tol, e_k, e_hf))
        log("  summary: %s" % json.dumps(summary))
        if summary["compiles"] != 0:
            failures.append("%s: the prewarmed run compiled %d kernels" % (spec["name"], summary["compiles"]))
        # EOS: the token participant 0 produced at new-token index 12 (its first
        # occurrence there or later); every participant must stop at its first
        # occurrence of it in the first run, the others going on to their limits.
        firsts = [p["tokens"] for p in parts]  # kiln's own first run: what the EOS run must cut
        toks0 = firsts[0]
        idx = next((i for i in range(12, len(toks0)) if toks0[i] not in toks0[:i]), None)
        if idx is None:
            log("  EOS check skipped: no fresh token in participant 0's tail")
            continue
        eos = toks0[idx]
        want = []
        for toks in firsts:
            cut = toks.index(eos) + 1 if eos in toks else len(toks)
            want.append((toks[:cut], "eos" if eos in toks else "limit"))
        parts2, summary2 = run_kiln(args, path, prompts, ["--eos", str(eos)], db)
        got2 = [(p["tokens"], p["stop"]) for p in parts2]
        same = got2 == want
        log("  EOS %d: stops %s, lengths %s: %s; compiles %d, database hits %d" % (
            eos, [g[1] for g in got2], [len(g[0]) for g in got2], "as expected" if same else "DIFFERENT",
            summary2["compiles"], summary2["database_hits"]))
        if not same:
            failures.append("%s: EOS run differs: %s vs %s" % (spec["name"], got2, want))
    log("")
    if failures:
        log("FAILED:\n  " + "\n  ".join(failures))
        return 1
    log("PASS: every token identical or at a tie, logits within %g (f16) / %g (bf16) relative, prewarmed runs "
        "compiled nothing"
        % (LOGIT_TOL["f16"], LOGIT_TOL["bf16"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
