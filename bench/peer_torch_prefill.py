#!/usr/bin/env python3
"""The torch peer of `decode --bench-prefill` (examples/decode): the prefill
forward of a Llama-3-8B-shaped LlamaForCausalLM (transformers, random f16
weights, attn_implementation "sdpa", on cuda) for each shape SEQSxTOKENS
(SEQS sequences of TOKENS each, one batch, no padding), as a time to first
token: the decoder over every token, the final norm, then lm_head and argmax
of each sequence's last token only (as kiln's prefill step). use_cache=False:
a fresh prefill keeps nothing the first token needs (kiln's step does write
its KV pages, a memory pass this peer is spared).

Two implementations: "torch_sdpa" (eager) and "torch_compile" (the same
forward with each decoder layer compiled by torch.compile, mode "default"
unless --mode says otherwise, dynamic=False so every shape gets its own
graph; --compile model compiles the whole decoder instead, which takes far
longer to compile and fuses only the norm of one layer into the next).

JSON lines: the dense f16 peak of this run (torch.matmul of 8192 x 8192 by
8192 x 8192, f16 in and out, f32 accumulation as torch's default cuBLAS
path), then one line per implementation and shape with the median device
time (CUDA events) and the same fields as kiln's lines: tokens_per_s,
model_tflop (the formula of dec_prefill_flops in examples/decode/decoder.h),
tflop_s, peak_tflop_s and mfu. Without torch, transformers or a GPU it
prints one line saying what is missing and exits 0.
"""
import argparse
import json
import sys
import time

PEAK_N = 8192
WARMUP = 2
BUDGET_MS = 10000.0  # past this much device time a shape stops at 3 timed forwards, as kiln's


def emit(d):
    print(json.dumps(d), flush=True)


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        s, _, n = item.partition("x")
        if not (s.isdigit() and n.isdigit()) or int(s) < 1 or int(n) < 1:
            raise argparse.ArgumentTypeError("shapes are SEQSxTOKENS separated by commas, e.g. 1x4096,4x1024")
        shapes.append((int(s), int(n)))
    return shapes


def prefill_flops(c, seqs, tokens):
    """Model FLOPs of one prefill, as dec_prefill_flops counts them: per layer
    2 T (H (Q + 2 KV) + Q H + 2 H I + I H) for the products (T = seqs x
    tokens) and 2 x 2 x Q x seqs x tokens (tokens + 1) / 2 for causal
    attention (q.k and p.v over each query's keys at or before it), plus
    2 x seqs x V x H for the last tokens' lm head."""
    H, I, V, L = c["hidden"], c["inter"], c["vocab"], c["layers"]
    Q, KV = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    T = seqs * tokens
    dense = 2 * T * (H * (Q + 2 * KV) + Q * H + 2 * H * I + I * H) * L
    attn = 2 * 2 * Q * seqs * tokens * (tokens + 1) / 2 * L
    return dense + attn + 2 * seqs * V * H


def main():
    ap = argparse.ArgumentParser(description="The torch peer of decode --bench-prefill (see the docstring).")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1x512,1x4096,4x1024,1x16384"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    ap.add_argument("--impls", default="torch_sdpa,torch_compile",
                    help="comma-separated: torch_sdpa (eager), torch_compile")
    ap.add_argument("--compile", choices=("layers", "model"), default="layers",
                    help="what torch.compile compiles: each decoder layer (default) or the whole decoder")
    ap.add_argument("--mode", default="default", help="torch.compile mode (default, max-autotune-no-cudagraphs)")
    a = ap.parse_args()
    impls = a.impls.split(",")
    for i in impls:
        if i not in ("torch_sdpa", "torch_compile"):
            ap.error("unknown implementation %r" % i)
    if a.layers < 1 or a.iters < 1:
        ap.error("--layers and --iters take counts >= 1")

    missing = []
    try:
        import torch
    except Exception as e:  # torch absent or broken: say so, as every peer does
        missing.append("torch (%s)" % e)
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:
        missing.append("transformers (%s)" % e)
    if missing:
        emit({"bench": "prefill", "impl": "torch", "skipped": "missing: " + ", ".join(missing)})
        return 0
    if not torch.cuda.is_available():
        emit({"bench": "prefill", "impl": "torch", "skipped": "no CUDA device"})
        return 0

    c = dict(vocab=128256, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, layers=a.layers)
    theta, eps = 500000.0, 1e-5
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}

    def median_ms(fn, iters, per=1):
        """Median device milliseconds of fn (CUDA events), divided by per;
        fewer than iters (at least 3) once BUDGET_MS of device time is spent."""
        times, spent = [], 0.0
        while len(times) < iters and (len(times) < 3 or spent < BUDGET_MS):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            t = s.elapsed_time(e)
            spent += t
            times.append(t / per)
        times.sort()
        return times[len(times) // 2], times[0], len(times)

    # The dense peak: eight products back to back per timing, as kiln's.
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    x = (torch.randn(PEAK_N, PEAK_N, device="cuda", generator=g) * 0.02).to(dt)
    w = (torch.randn(PEAK_N, PEAK_N, device="cuda", generator=g) * 0.02).to(dt)
    out = torch.empty(PEAK_N, PEAK_N, dtype=dt, device="cuda")

    def products():
        for _ in range(8):
            torch.matmul(x, w.t(), out=out)

    for _ in range(3):
        products()
    pms, _, _ = median_ms(products, 11, per=8)
    peak = 2.0 * PEAK_N ** 3 / (pms * 1e-3)
    emit({"bench": "dense_peak", "impl": "torch", "op": "torch.matmul", "m": PEAK_N, "n": PEAK_N, "k": PEAK_N,
          "dtype": a.dtype, "accumulate": "f32",
          "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
          "ms": round(pms, 4), "tflop_s": round(peak / 1e12, 1), **versions})
    del x, w, out
    torch.cuda.empty_cache()

    kw = dict(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
              num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
              head_dim=c["head_dim"], rms_norm_eps=eps, max_position_embeddings=131072,
              tie_word_embeddings=False, attn_implementation="sdpa")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
    cfg = LlamaConfig(**kw)
    # Built on the GPU in f16 or bf16 (initializer_range 0.02): 16 GB initialized there in seconds, not on the host.
    t0 = time.time()
    torch.manual_seed(0)
    torch.set_default_dtype(dt)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    attn = getattr(model.config, "_attn_implementation", None)
    sys.stderr.write("peer_torch_prefill: %d parameters on cuda in %.1f s, attention %s\n"
                     % (params, time.time() - t0, attn))

    def forward(ids):
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state
        return model.lm_head(h[:, -1]).argmax(-1)

    for impl in impls:
        compiled = impl == "torch_compile"
        if compiled:
            import torch._dynamo as dynamo
            # Every shape is its own static graph: room for all of them.
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(dynamo.config, name):
                    setattr(dynamo.config, name, max(64, 2 * len(a.shapes)))
            if a.compile == "layers":
                for layer in model.model.layers:
                    layer.compile(mode=a.mode, dynamic=False)
            else:
                model.model.compile(mode=a.mode, dynamic=False)
        for seqs, tokens in a.shapes:
            line = {"bench": "prefill", "impl": impl, "model": "llama-3-8b", "dtype": a.dtype, "layers": c["layers"],
                    "shape": "%dx%d" % (seqs, tokens), "seqs": seqs, "tokens_each": tokens,
                    "tokens": seqs * tokens, "attn_implementation": attn, "use_cache": False}
            if compiled:
                line.update(compile=a.compile, mode=a.mode)
            try:
                ids = torch.randint(0, c["vocab"], (seqs, tokens), device="cuda", generator=g)
                with torch.no_grad():
                    t0 = time.time()
                    forward(ids)  # the compile, when there is one
                    torch.cuda.synchronize()
                    first_s = time.time() - t0
                    for _ in range(WARMUP):
                        forward(ids)
                    torch.cuda.synchronize()
                    ms, least, n = median_ms(lambda: forward(ids), a.iters)
            except torch.cuda.OutOfMemoryError as e:
                line["skipped"] = "out of memory: %s" % str(e).split("\n")[0]
                emit(line)
                torch.cuda.empty_cache()
                continue
            except Exception as e:  # a compile that fails is reported, and the other shapes still run
                line["skipped"] = "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:300])
                emit(line)
                continue
            flops = prefill_flops(c, seqs, tokens)
            achieved = flops / (ms * 1e-3)
            line.update(path="eager" if not compiled else "compiled", warmup=WARMUP, iters=n,
                        time_ms=round(ms, 4), min_ms=round(least, 4), first_call_s=round(first_s, 2),
                        tokens_per_s=round(seqs * tokens / (ms * 1e-3), 1), model_tflop=round(flops / 1e12, 4),
                        tflop_s=round(achieved / 1e12, 1), peak_tflop_s=round(peak / 1e12, 1),
                        mfu=round(achieved / peak, 4), **versions)
            if compiled:
                try:
                    from torch._dynamo.utils import counters
                    line["dynamo_unique_graphs"] = int(counters["stats"]["unique_graphs"])
                except Exception:
                    pass
            emit(line)
            del ids
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
