#!/usr/bin/env python3
"""The torch peer of bench_norm_argmax, timed the same three ways on the current stream:
  per_launch    an event pair around each call; median, p10, p90;
  back_to_back  one event pair around iters calls, divided by iters;
  graph         GRAPH_OPS calls captured in one torch.cuda.CUDAGraph, replayed
                GRAPH_REPS times: GPU time per call, launch gaps included.
Ops: rms_norm (torch.nn.functional.rms_norm), rms_norm_residual (r.add_(x)
then rms_norm(r): what eager torch does for the fused form), residual_add
(torch.add(a, b, out=o)); shapes and bytes as bench_norm_argmax, modes hot and
rotated. masked_argmax: Hugging Face's repetition penalty on a float32 copy
(gather, where, scatter), masked_fill of invalid tokens, argmax; vocab 151936
and 128256, P 1 and 64, 512 ids per participant.

--dtype picks the element type of every tensor (f16, the default, or bf16, as
bench_norm_argmax's --dtype); every line names it ("dtype").

With --kiln FILE (bench_norm_argmax's JSON lines), a "compare" line per op and shape
says whether kiln's graph time is below torch's (the 1- and 16-token targets);
only kiln's lines of the same dtype are compared.

Usage: peer_torch_norm_argmax.py [--iters 200] [--warmup 20] [--dtype f16|bf16] [--kiln bench.jsonl]
"""
import argparse
import json
import sys

from peer_common import Emitter, cuda_device, quantile, r3

BENCH = "norm_argmax"
PEER = "torch"
SHAPES = [(2048, 4096), (1, 4096), (16, 4096), (2048, 896), (4096, 4096)]
MAX_SETS = 16
ROTATE_BYTES = 256 << 20
GRAPH_OPS = 64
GRAPH_REPS = 20
emit = Emitter(BENCH, PEER, "f16")  # its dtype set from --dtype in main


def time_calls(torch, calls, iters, warmup):
    stream = torch.cuda.current_stream()
    n = len(calls)
    for i in range(warmup + n):
        calls[i % n]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record(stream)
        calls[i % n]()
        ends[i].record(stream)
    ends[-1].synchronize()
    per = sorted(starts[i].elapsed_time(ends[i]) * 1e3 for i in range(iters))
    b0, b1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    b0.record(stream)
    for i in range(iters):
        calls[i % n]()
    b1.record(stream)
    b1.synchronize()
    b2b = b0.elapsed_time(b1) * 1e3 / iters
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            calls[i % n]()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(GRAPH_OPS):
            calls[i % n]()
    g.replay()
    torch.cuda.synchronize()
    b0.record(stream)
    for _ in range(GRAPH_REPS):
        g.replay()
    b1.record(stream)
    b1.synchronize()
    graph = b0.elapsed_time(b1) * 1e3 / (GRAPH_REPS * GRAPH_OPS)
    del g
    return {"per_launch_median_us": r3(quantile(per, 0.5)), "per_launch_p10_us": r3(quantile(per, 0.1)),
            "per_launch_p90_us": r3(quantile(per, 0.9)), "back_to_back_avg_us": r3(b2b), "graph_avg_us": r3(graph)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    ap.add_argument("--kiln", default=None)
    args = ap.parse_args()
    emit.dtype = args.dtype
    found = cuda_device(emit)
    if not found:
        return 0
    torch, dev = found
    import torch.nn.functional as F
    name = torch.cuda.get_device_name(dev)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.half
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    results = {}
    failed = False
    for tokens, hidden in SHAPES:
        set_bytes = tokens * hidden * 2
        w = torch.rand(hidden, device=dev, generator=gen).to(dt)
        for op in ("rms_norm", "rms_norm_residual", "residual_add"):
            for rotated in (False, True):
                try:
                    sets = max(1, min(MAX_SETS, -(-ROTATE_BYTES // set_bytes))) if rotated else 1
                    xs = [torch.rand(tokens, hidden, device=dev, generator=gen).to(dt) for _ in range(sets)]
                    rs = [torch.rand(tokens, hidden, device=dev, generator=gen).to(dt) for _ in range(sets)]
                    os_ = [torch.empty(tokens, hidden, device=dev, dtype=dt) for _ in range(sets)]

                    def mk(k):
                        x, r, o = xs[k], rs[k], os_[k]
                        if op == "rms_norm":
                            return lambda: F.rms_norm(x, (hidden,), w, 1e-5)
                        if op == "rms_norm_residual":
                            def f():
                                r.add_(x)
                                return F.rms_norm(r, (hidden,), w, 1e-5)
                            return f
                        return lambda: torch.add(x, r, out=o)
                    t = time_calls(torch, [mk(k) for k in range(sets)], args.iters, args.warmup)
                    nbytes = {"rms_norm": 2 * set_bytes + hidden * 2, "rms_norm_residual": 4 * set_bytes + hidden * 2,
                              "residual_add": 3 * set_bytes}[op]
                    line = {"op": op, "mode": "rotated" if rotated else "hot", "tokens": tokens, "hidden": hidden,
                            "sets": sets, "bytes": nbytes, "device": name, "torch_version": torch.__version__}
                    line.update(t)
                    line["graph_tbps"] = r3(nbytes / (t["graph_avg_us"] * 1e6))
                    line["per_launch_tbps"] = r3(nbytes / (t["per_launch_median_us"] * 1e6))
                    emit(line)
                    results[(op, line["mode"], tokens, hidden)] = t
                    del xs, rs, os_
                except Exception as e:
                    failed = True
                    emit({"op": op, "tokens": tokens, "hidden": hidden, "error": type(e).__name__,
                          "message": str(e)[:2000]})
    R = 512
    for vocab, P in ((151936, 1), (151936, 64), (128256, 1), (128256, 64)):
        try:
            logits = (torch.rand(P, vocab, device=dev, generator=gen) * 8 - 4).to(dt)
            valid = torch.rand(vocab, device=dev, generator=gen) > 0.1
            ids = torch.randint(0, vocab, (P, R), device=dev, generator=gen)
            pen = torch.tensor(1.3, device=dev)

            def argmax():
                s = logits.float()
                g = torch.gather(s, 1, ids)
                g = torch.where(g < 0, g * pen, g / pen)
                s.scatter_(1, ids, g)
                s.masked_fill_(~valid, float("-inf"))
                return torch.argmax(s, dim=1)
            t = time_calls(torch, [argmax], args.iters, args.warmup)
            line = {"op": "masked_argmax", "mode": "hot", "vocab": vocab, "participants": P, "device": name,
                    "torch_version": torch.__version__}
            line.update(t)
            emit(line)
            results[("masked_argmax", "hot", vocab, P)] = t
        except Exception as e:
            failed = True
            emit({"op": "masked_argmax", "vocab": vocab, "error": type(e).__name__, "message": str(e)[:2000]})

    if args.kiln:
        try:
            for line in open(args.kiln):
                k = json.loads(line)
                if k.get("bench") != BENCH or k.get("peer") is not False or "op" not in k or "phase" in k:
                    continue
                if k.get("dtype", "f16") != args.dtype:
                    continue
                key = (k["op"], k.get("mode"), k.get("tokens", k.get("vocab")), k.get("hidden", k.get("participants")))
                t = results.get(key)
                if not t or k.get("graph_avg_us") is None:
                    continue
                emit({"phase": "compare", "op": k["op"], "mode": k.get("mode"), "shape": list(key[2:]),
                      "kiln_graph_us": k["graph_avg_us"], "torch_graph_us": t["graph_avg_us"],
                      "kiln_per_launch_us": k["per_launch_median_us"], "torch_per_launch_us": t["per_launch_median_us"],
                      "kiln_faster_graph": k["graph_avg_us"] < t["graph_avg_us"],
                      "kiln_faster_per_launch": k["per_launch_median_us"] < t["per_launch_median_us"]})
        except Exception as e:
            emit({"phase": "compare", "error": type(e).__name__, "message": str(e)[:500]})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
