#!/usr/bin/env python3
"""The torch peer of `decode --bench` (examples/decode): one Llama decode step
(Llama-3-8B's shape by default) at batch B with every sequence's cache
holding `context` tokens, for each context of --context (a comma-separated
list) and each batch size of --batch, contexts outer as in kiln's sweep,
written as a plain torch decode loop (F.linear,
F.rms_norm, RoPE, F.scaled_dot_product_attention over a static KV cache,
SwiGLU, lm_head, argmax) and captured in a CUDA graph. Weights are f16 (or
bf16 with --dtype bf16) on the GPU; with --chunk-file (written by `decode --bench --chunk-file`) every tensor
is that chunk tiled from its start, as kiln's bench fills its own: the same
weights. Prints JSON lines: the device-to-device copy bandwidth, then per
context and batch size the graph replay's median device time (CUDA events),
the eager step's, and the floor (weight bytes + KV bytes read, over the copy
bandwidth); a context and batch whose cache does not fit in device memory
gives a line with "skipped".

With --config (a transformers config.json) the shapes are the config's
(--layers: its num_hidden_layers unless given): llama, qwen3 (with its
per-head q/k RMSNorm before RoPE) or qwen3_moe, whose MLP is the mixture of
experts as transformers' Qwen3MoeSparseMoeBlock computes it: the router's
linear, softmax in float32, top-k, the weights renormalized when
norm_topk_prob, each chosen expert's down(silu(gate x) * up x) times its
weight, summed. The experts run as transformers' grouped_mm experts do
("moe_impl": "grouped_mm": the (token, slot) pairs sorted by expert on the
device, offsets the int32 cumulative sum of a histc, torch._grouped_mm for
gate_up and down), where this torch has torch._grouped_mm and the dtype is
bf16; otherwise ("dense_loop") every expert over every token, masked by the
routing weights: graph-capturable, reading every expert, slow. RoPE
scaling in the config is not applied (the step's time does not depend on
it). The MoE step uses kiln's bench's inputs too: token ids (j * 7919 + 1) %
vocab and a zeroed KV cache, so that both route alike; the router is the
chunk tiled like every other tensor. After the timed replays one more eager
step records each layer's chosen experts: the floor counts, per layer, the
distinct experts they name (3 * moe_intermediate * hidden elements each) in
place of all of them ("floor_experts": "measured").
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F


def tiler(chunk):
    def make(*shape):
        t = torch.empty(shape, dtype=chunk.dtype, device="cuda")
        flat = t.view(-1)
        n, c = flat.numel(), chunk.numel()
        for off in range(0, n, c):
            m = min(c, n - off)
            flat[off:off + m].copy_(chunk[:m])
        return t
    return make


def median_ms(fn, iters):
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def counts(text):
    """A comma-separated list of counts >= 1, as decode --bench takes them."""
    items = text.split(",")
    if not all(i.isdigit() and int(i) >= 1 for i in items):
        raise argparse.ArgumentTypeError("%r is not a comma-separated list of counts >= 1" % text)
    return [int(i) for i in items]


def config_shapes(path):
    """The shapes of a transformers config.json: llama, qwen3 (q/k norm) or qwen3_moe (also the experts)."""
    c = json.load(open(path))
    mt = c.get("model_type")
    if mt not in ("llama", "qwen3", "qwen3_moe"):
        raise SystemExit("peer_torch_decode.py: model_type %r: only llama, qwen3 and qwen3_moe" % mt)
    if mt == "qwen3_moe" and (c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1):
        raise SystemExit("peer_torch_decode.py: dense layers among the experts (mlp_only_layers, decoder_sparse_step)")
    NH = c["num_attention_heads"]
    theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    moe = mt == "qwen3_moe"
    return {"model_type": mt, "V": c["vocab_size"], "H": c["hidden_size"], "I": c["intermediate_size"], "NH": NH,
            "KVH": c.get("num_key_value_heads", NH), "D": c.get("head_dim") or c["hidden_size"] // NH,
            "theta": float(theta), "eps": float(c.get("rms_norm_eps", 1e-6)), "L": c["num_hidden_layers"],
            "tie": bool(c.get("tie_word_embeddings", False)), "qk_norm": mt in ("qwen3", "qwen3_moe"),
            "E": c["num_experts"] if moe else 0, "K": c["num_experts_per_tok"] if moe else 0,
            "XI": c["moe_intermediate_size"] if moe else 0, "norm_topk": bool(c.get("norm_topk_prob", False))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=counts, default=counts("1,8,32"))
    ap.add_argument("--context", type=counts, default=counts("1024"),
                    help="cached tokens, comma-separated: 1024,4096,16384")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=None, help="default: 32, or the config's num_hidden_layers")
    ap.add_argument("--chunk-file", default=None)
    ap.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    ap.add_argument("--config", default=None, help="a config.json (llama, qwen3, qwen3_moe): its shapes")
    ap.add_argument("--moe-impl", choices=("auto", "grouped_mm", "dense_loop"), default="auto")
    a = ap.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    V, H, I, NH, KVH, D, theta, eps = 128256, 4096, 14336, 32, 8, 128, 500000.0, 1e-5
    L = a.layers if a.layers is not None else 32
    qk_norm, tie, E, K, XI, norm_topk, model_type = False, False, 0, 0, 0, False, "llama"
    if a.config:
        cfg = config_shapes(a.config)
        V, H, I, NH, KVH, D, theta, eps = (cfg[k] for k in ("V", "H", "I", "NH", "KVH", "D", "theta", "eps"))
        qk_norm, tie, E, K, XI, norm_topk, model_type = (
            cfg[k] for k in ("qk_norm", "tie", "E", "K", "XI", "norm_topk", "model_type"))
        L = a.layers if a.layers is not None else cfg["L"]
    moe = E > 0
    moe_impl = None
    if moe:
        moe_impl = a.moe_impl
        if moe_impl == "auto":
            moe_impl = "grouped_mm" if hasattr(torch, "_grouped_mm") and dt == torch.bfloat16 else "dense_loop"
    contexts, batches = a.context, a.batch
    torch.manual_seed(0)
    if a.chunk_file:
        chunk = torch.from_file(a.chunk_file, dtype=dt, size=32 << 20).cuda()
    else:
        chunk = (torch.randn(32 << 20, device="cuda") * 0.02).to(dt)
    make = tiler(chunk)
    embed = make(V, H)
    lm_head, final_norm = embed if tie else make(V, H), make(H)
    layers = []
    for _ in range(L):
        w = dict(inn=make(H), post=make(H), wq=make(NH * D, H), wk=make(KVH * D, H),
                 wv=make(KVH * D, H), wo=make(H, NH * D))
        if qk_norm:
            w.update(qn=make(D), kn=make(D))
        if moe:
            # kiln_op_moe_experts' layout and transformers 5's fused one: [E, 2 XI, H] (each expert's gate
            # rows, then its up rows) and [E, H, XI], each tiled from the chunk's start as kiln fills them.
            w.update(router=make(E, H), xgu=make(E, 2 * XI, H), xd=make(E, H, XI))
        else:
            w.update(wgu=torch.cat([make(I, H), make(I, H)]), wd=make(H, I))
        layers.append(w)
    weight_bytes = sum(t.numel() * 2 for l in layers for t in l.values()) + (lm_head.numel() + H) * 2
    expert_bytes = 3 * XI * H * 2  # one expert's gate, up and down

    # Device-to-device copy bandwidth (read + write), as kiln's bench measures it.
    n = 1 << 30
    src = torch.ones(n // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    cms = median_ms(lambda: dst.copy_(src), 10)
    bw = 2 * n / (cms * 1e-3)
    del src, dst
    print(json.dumps({"bench": "d2d_copy", "impl": "torch", "bytes": n, "ms": round(cms, 4),
                      "gb_s": round(bw / 1e9, 1)}), flush=True)

    inv = (1.0 / torch.tensor([theta ** (2 * i / D) for i in range(D // 2)], dtype=torch.float64)).float().cuda()
    G = NH // KVH
    moe_fields = {}
    if moe:
        moe_fields = {"model_type": model_type, "experts": E, "top_k": K}
    for ctx, B in [(c, b) for c in contexts for b in batches]:
        kv = B * L * ctx * KVH * D * 2 * 2
        try:
            if moe:
                # Zeros, as kiln's engine fills its pages: the same residual stream, so the same routing.
                kc = [torch.zeros(B, KVH, ctx, D, dtype=dt, device="cuda") for _ in range(L)]
                vc = [torch.zeros(B, KVH, ctx, D, dtype=dt, device="cuda") for _ in range(L)]
            else:
                kc = [make(B, KVH, ctx, D) for _ in range(L)]
                vc = [make(B, KVH, ctx, D) for _ in range(L)]
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            print(json.dumps(dict({"bench": "decode_step", "impl": "torch_cuda_graph", "dtype": a.dtype, "batch": B, "context": ctx,
                                   "layers": L, "kv_bytes": kv,
                                   "skipped": "out of memory: %s" % str(e).split("\n")[0]}, **moe_fields)), flush=True)
            continue
        if moe:
            tok = torch.tensor([(j * 7919 + 1) % V for j in range(B)], device="cuda")  # kiln's bench's ids
        else:
            tok = torch.randint(0, V, (B,), device="cuda")
        pos = torch.full((1,), ctx - 1, dtype=torch.long, device="cuda")

        def rope(x, cos, sin):
            x1, x2 = x[..., : D // 2], x[..., D // 2:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        def experts(h, w, impl, chosen):
            """Qwen3MoeSparseMoeBlock's MLP on h [B, H], without a host sync (capturable)."""
            probs = torch.softmax(F.linear(h, w["router"]), dim=-1, dtype=torch.float32)
            tw, ids = torch.topk(probs, K, dim=-1)            # [B, K]
            if norm_topk:
                tw = tw / tw.sum(dim=-1, keepdim=True)
            tw = tw.to(dt)
            if chosen is not None:
                chosen.append(ids)
            if impl == "grouped_mm":
                # As transformers' grouped_mm experts: pairs sorted by expert, offsets from a histc.
                ids_g, perm = torch.sort(ids.reshape(-1))
                xs = h[perm // K]
                counts = torch.histc(ids_g.int(), bins=E, min=0, max=E - 1)
                offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
                gu = torch._grouped_mm(xs, w["xgu"].transpose(-2, -1), offs=offs)   # [B K, 2 XI]
                y = torch._grouped_mm(F.silu(gu[:, :XI]) * gu[:, XI:], w["xd"].transpose(-2, -1), offs=offs)
                y = y * tw.reshape(-1)[perm].unsqueeze(-1)
                out = torch.empty_like(y).index_copy_(0, perm, y)                  # back to (token, slot) order
                return out.view(B, K, H).sum(dim=1)
            out = torch.zeros_like(h)
            for e in range(E):
                we = (tw * (ids == e)).sum(dim=-1, keepdim=True)   # [B, 1]: 0 where e was not chosen
                gu = F.linear(h, w["xgu"][e])
                out = out + F.linear(F.silu(gu[:, :XI]) * gu[:, XI:], w["xd"][e]) * we
            return out

        def step(impl=moe_impl, chosen=None):
            ang = pos.float()[:, None] * inv[None, :]        # [1, D/2]
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            x = F.embedding(tok, embed)                       # [B, H]
            for li, w in enumerate(layers):
                h = F.rms_norm(x, (H,), w["inn"], eps)
                q = F.linear(h, w["wq"]).view(B, NH, D)
                if qk_norm:  # Qwen3: each head RMSNormed before RoPE
                    q = F.rms_norm(q, (D,), w["qn"], eps)
                q = rope(q, cos, sin)
                k = F.linear(h, w["wk"]).view(B, KVH, D)
                if qk_norm:
                    k = F.rms_norm(k, (D,), w["kn"], eps)
                k = rope(k, cos, sin)
                v = F.linear(h, w["wv"]).view(B, KVH, D)
                kc[li].index_copy_(2, pos, k.unsqueeze(2))
                vc[li].index_copy_(2, pos, v.unsqueeze(2))
                # GQA decode: the group's query heads as rows of one kv head.
                o = F.scaled_dot_product_attention(q.view(B, KVH, G, D), kc[li], vc[li])
                x = x + F.linear(o.reshape(B, NH * D), w["wo"])
                h = F.rms_norm(x, (H,), w["post"], eps)
                if moe:
                    x = x + experts(h, w, impl, chosen)
                else:
                    gu = F.linear(h, w["wgu"])
                    x = x + F.linear(F.silu(gu[:, :I]) * gu[:, I:], w["wd"])
            h = F.rms_norm(x, (H,), final_norm, eps)
            return F.linear(h, lm_head).argmax(-1)

        impl_note = None
        with torch.no_grad():
            if moe and moe_impl == "grouped_mm":
                try:
                    step()
                    torch.cuda.synchronize()
                except Exception as e:  # this torch's _grouped_mm refuses the shapes or the device
                    impl_note = "grouped_mm failed, dense_loop instead: %s: %s" % (type(e).__name__, str(e)[:300])
                    moe_impl = "dense_loop"
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step(moe_impl)
            torch.cuda.current_stream().wait_stream(s)
            eager = median_ms(lambda: step(moe_impl), 5)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step(moe_impl)
            for _ in range(5):
                g.replay()
            graph = median_ms(g.replay, a.steps)
            torch.cuda.synchronize()
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(a.steps):
                g.replay()
            t1.record()
            t1.synchronize()
            back_to_back = t0.elapsed_time(t1) / a.steps
            read_bytes, extra = weight_bytes, {}
            if moe:
                # One more step, eager, each layer's choices kept: the experts the step reads.
                chosen = []
                step(moe_impl, chosen)
                distinct = [int(torch.unique(c).numel()) for c in chosen]
                read_bytes = weight_bytes - L * E * expert_bytes + sum(distinct) * expert_bytes
                extra = dict(moe_fields, moe_impl=moe_impl, distinct_experts=round(sum(distinct) / L, 2),
                             distinct_experts_min=min(distinct), distinct_experts_max=max(distinct),
                             expected_distinct_experts=round(E * (1 - (1 - K / E) ** B), 2),
                             floor_experts="measured", model_weight_bytes=weight_bytes)
                if impl_note:
                    extra["moe_impl_note"] = impl_note
        floor = (read_bytes + kv) / bw * 1e3
        print(json.dumps(dict({"bench": "decode_step", "impl": "torch_cuda_graph", "dtype": a.dtype, "batch": B, "context": ctx,
                               "layers": L, "device_ms": round(graph, 4), "back_to_back_ms": round(back_to_back, 4),
                               "eager_ms": round(eager, 4), "floor_ms": round(floor, 4),
                               "device_over_floor": round(graph / floor, 3), "weight_bytes": read_bytes,
                               "kv_bytes": kv, "torch": torch.__version__}, **extra)), flush=True)
        del kc, vc, g
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
