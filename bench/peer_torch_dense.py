#!/usr/bin/env python3
"""Dense operations, the torch peer of bench_dense.

The same shapes, f16 (or bf16: --dtype) on cuda, timed the same way (at least --warmup calls and
0.3 s of warm-up; torch.cuda.Event, an event pair around each call: median;
one pair around iters calls: back to back):
  lm_head      F.linear(x[last], W), x [1, 4096], W [151936, 4096]: GB/s
  linear       F.linear(x, W), x [2048, 4096], W [28672, 4096]: TFLOP/s
  swiglu       gu = F.linear(x, W[2*14336, 4096]); F.silu(gu[:, :I]) * gu[:, I:]
  lm_head_p64  F.linear(x[last_rows], W), 64 rows gathered from [4096, 4096], W [128256, 4096]
With --kiln FILE (bench_dense's JSON lines), one "phase":"compare" line per
shape: kiln / torch, and for the two targets meets_target (lm_head: kiln's
GB/s at least 95% of torch's; linear: kiln's TFLOP/s at least 95% of torch's),
comparing kiln's lines of the same dtype only. Every line carries "dtype".

Usage: peer_torch_dense.py [--iters 200] [--warmup 10] [--dtype f16|bf16] [--kiln bench.jsonl]
"""
import argparse
import json
import sys
import time

from peer_common import Emitter, cuda_device, quantile, r3

BENCH = "dense"
PEER = "torch"
SHAPES = [("lm_head", 1, 4096, 151936, 1), ("linear", 2048, 4096, 28672, 1),
          ("swiglu", 2048, 4096, 14336, 1), ("lm_head_p64", 4096, 4096, 128256, 64)]
WARM_S = 0.3
emit = Emitter(BENCH, PEER)  # its dtype set from --dtype in main
TARGETS = {"lm_head": "per_launch_gbps", "linear": "per_launch_tflops"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--kiln", default=None)
    ap.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    args = ap.parse_args()
    emit.dtype = args.dtype
    found = cuda_device(emit)
    if not found:
        return 0
    torch, dev = found
    import torch.nn.functional as F
    tdtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    stream = torch.cuda.current_stream(dev)
    name = torch.cuda.get_device_name(dev)
    results = {}
    failed = False
    for shape, tokens, k, n, parts in SHAPES:
        try:
            swiglu = shape == "swiglu"
            wrows = 2 * n if swiglu else n
            w = (torch.rand(wrows, k, device=dev, dtype=tdtype) - 0.5) * 0.1
            x = (torch.rand(tokens, k, device=dev, dtype=tdtype) - 0.5)
            last = torch.arange(parts, device=dev) * (tokens // parts) + (tokens // parts - 1)

            if shape.startswith("lm_head"):
                def call():
                    return F.linear(x[last], w)
            elif swiglu:
                def call():
                    gu = F.linear(x, w)
                    return F.silu(gu[:, :n]) * gu[:, n:]
            else:
                def call():
                    return F.linear(x, w)
            # Warm-up: at least --warmup calls and WARM_S of them, as bench_dense.
            t0, calls = time.perf_counter(), 0
            while calls < args.warmup or time.perf_counter() - t0 < WARM_S:
                call()
                calls += 1
                if calls % 8 == 0:
                    torch.cuda.synchronize(dev)
            torch.cuda.synchronize(dev)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            for i in range(args.iters):
                starts[i].record(stream)
                call()
                ends[i].record(stream)
            ends[-1].synchronize()
            per = sorted(starts[i].elapsed_time(ends[i]) * 1e3 for i in range(args.iters))
            b0 = torch.cuda.Event(enable_timing=True)
            b1 = torch.cuda.Event(enable_timing=True)
            b0.record(stream)
            for _ in range(args.iters):
                call()
            b1.record(stream)
            b1.synchronize()
            b2b = b0.elapsed_time(b1) * 1e3 / args.iters
            rows = parts if shape.startswith("lm_head") else tokens
            flop = 2.0 * rows * k * wrows
            nbytes = wrows * k * 2 + rows * k * 2 + rows * n * 2 + (rows * wrows * 4 if swiglu else 0)
            med = quantile(per, 0.5)
            row = {"shape": shape, "tokens": tokens, "participants": parts, "in": k, "out": n,
                   "iters": args.iters, "per_launch_median_us": r3(med),
                   "per_launch_p10_us": r3(quantile(per, 0.1)), "per_launch_p90_us": r3(quantile(per, 0.9)),
                   "back_to_back_avg_us": r3(b2b), "bytes": nbytes, "flop": flop,
                   "per_launch_gbps": r3(nbytes / (med * 1e3)), "per_launch_tflops": r3(flop / (med * 1e6)),
                   "back_to_back_gbps": r3(nbytes / (b2b * 1e3)), "back_to_back_tflops": r3(flop / (b2b * 1e6)),
                   "device": name, "torch_version": torch.__version__}
            emit(row)
            results[shape] = row
            del w, x
            torch.cuda.empty_cache()
        except Exception as e:
            failed = True
            emit({"shape": shape, "error": type(e).__name__, "message": str(e)[:2000]})

    if args.kiln:
        kiln = {}
        try:
            for line in open(args.kiln):
                try:
                    o = json.loads(line)
                except ValueError:
                    continue
                if (o.get("bench") == BENCH and o.get("peer") is False and "shape" in o and "error" not in o
                        and o.get("dtype", "f16") == args.dtype):
                    kiln[o["shape"]] = o
        except OSError as e:
            emit({"phase": "compare", "error": "OSError", "message": str(e)})
            return 1
        for shape, row in results.items():
            if shape not in kiln:
                failed = True
                emit({"phase": "compare", "shape": shape, "error": "missing", "message": "no kiln line"})
                continue
            out = {"phase": "compare", "shape": shape}
            for key in ("per_launch_gbps", "per_launch_tflops", "back_to_back_gbps", "back_to_back_tflops"):
                if row.get(key) and kiln[shape].get(key):
                    out["kiln_" + key] = kiln[shape][key]
                    out["torch_" + key] = row[key]
                    out["ratio_" + key] = r3(kiln[shape][key] / row[key])
            if shape in TARGETS:
                ratio = out.get("ratio_" + TARGETS[shape])
                out["target"] = "kiln %s >= 0.95 x torch" % TARGETS[shape]
                out["meets_target"] = bool(ratio is not None and ratio >= 0.95)
            emit(out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
