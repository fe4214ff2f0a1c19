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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=counts, default=counts("1,8,32"))
    ap.add_argument("--context", type=counts, default=counts("1024"),
                    help="cached tokens, comma-separated: 1024,4096,16384")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk-file", default=None)
    ap.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    a = ap.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    V, H, I, NH, KVH, D, theta, eps = 128256, 4096, 14336, 32, 8, 128, 500000.0, 1e-5
    L = a.layers
    contexts, batches = a.context, a.batch
    torch.manual_seed(0)
    if a.chunk_file:
        chunk = torch.from_file(a.chunk_file, dtype=dt, size=32 << 20).cuda()
    else:
        chunk = (torch.randn(32 << 20, device="cuda") * 0.02).to(dt)
    make = tiler(chunk)
    embed, lm_head, final_norm = make(V, H), make(V, H), make(H)
    layers = []
    for _ in range(L):
        layers.append(dict(inn=make(H), post=make(H), wq=make(NH * D, H), wk=make(KVH * D, H),
                           wv=make(KVH * D, H), wo=make(H, NH * D),
                           wgu=torch.cat([make(I, H), make(I, H)]), wd=make(H, I)))
    weight_bytes = sum(t.numel() * 2 for l in layers for t in l.values()) + (lm_head.numel() + H) * 2

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
    for ctx, B in [(c, b) for c in contexts for b in batches]:
        kv = B * L * ctx * KVH * D * 2 * 2
        try:
            kc = [make(B, KVH, ctx, D) for _ in range(L)]
            vc = [make(B, KVH, ctx, D) for _ in range(L)]
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            print(json.dumps({"bench": "decode_step", "impl": "torch_cuda_graph", "dtype": a.dtype, "batch": B, "context": ctx,
                              "layers": L, "kv_bytes": kv,
                              "skipped": "out of memory: %s" % str(e).split("\n")[0]}), flush=True)
            continue
        tok = torch.randint(0, V, (B,), device="cuda")
        pos = torch.full((1,), ctx - 1, dtype=torch.long, device="cuda")

        def rope(x, cos, sin):
            x1, x2 = x[..., : D // 2], x[..., D // 2:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        def step():
            ang = pos.float()[:, None] * inv[None, :]        # [1, D/2]
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            x = F.embedding(tok, embed)                       # [B, H]
            for li, w in enumerate(layers):
                h = F.rms_norm(x, (H,), w["inn"], eps)
                q = rope(F.linear(h, w["wq"]).view(B, NH, D), cos, sin)
                k = rope(F.linear(h, w["wk"]).view(B, KVH, D), cos, sin)
                v = F.linear(h, w["wv"]).view(B, KVH, D)
                kc[li].index_copy_(2, pos, k.unsqueeze(2))
                vc[li].index_copy_(2, pos, v.unsqueeze(2))
                # GQA decode: the group's query heads as rows of one kv head.
                o = F.scaled_dot_product_attention(q.view(B, KVH, G, D), kc[li], vc[li])
                x = x + F.linear(o.reshape(B, NH * D), w["wo"])
                h = F.rms_norm(x, (H,), w["post"], eps)
                gu = F.linear(h, w["wgu"])
                x = x + F.linear(F.silu(gu[:, :I]) * gu[:, I:], w["wd"])
            h = F.rms_norm(x, (H,), final_norm, eps)
            return F.linear(h, lm_head).argmax(-1)

        with torch.no_grad():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            eager = median_ms(step, 5)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
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
        floor = (weight_bytes + kv) / bw * 1e3
        print(json.dumps({"bench": "decode_step", "impl": "torch_cuda_graph", "dtype": a.dtype, "batch": B, "context": ctx,
                          "layers": L, "device_ms": round(graph, 4), "back_to_back_ms": round(back_to_back, 4),
                          "eager_ms": round(eager, 4), "floor_ms": round(floor, 4),
                          "device_over_floor": round(graph / floor, 3), "weight_bytes": weight_bytes,
                          "kv_bytes": kv, "torch": torch.__version__}), flush=True)
        del kc, vc, g
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
