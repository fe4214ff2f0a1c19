#!/usr/bin/env python3
"""The torch peer of bench_attention --prefill: causal attention through
torch.nn.functional.scaled_dot_product_attention (is_causal=True,
enable_gqa=True; f16, or bf16 with --dtype bf16; torch picks its backend:
flash or cuDNN on an H200) at Llama-3-8B's heads (32 q, 8 kv) with head_dim
128, 64 and 256, for 1 x 512, 1 x 4096, 4 x 1024 and 1 x 16384 tokens. GPU time
with CUDA events around iters back-to-back calls, median of 5 such runs; TFLOP/s counted as
bench_attention counts them (4 * heads * head_dim * causal pairs). SDPA
attends contiguous q, k and v: no RoPE, no append, no paged gather, which
kiln's command does as well. Chunked prefill has no is_causal form in SDPA
(its causal mask is top-left aligned) and is not timed here.

Usage: peer_torch_sdpa.py [--iters 50] [--dtype f16|bf16]
"""
import argparse
import json
import sys

BENCH = "attention"
SHAPES = [(1, 512), (1, 4096), (4, 1024), (1, 16384)]


def emit(obj):
    base = {"bench": BENCH, "peer": "torch"}
    base.update(obj)
    sys.stdout.write(json.dumps(base) + "\n")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        emit({"skipped": "no torch: %s" % e})
        return 0
    if not torch.cuda.is_available():
        emit({"skipped": "no CUDA device"})
        return 0
    H, KVH = 32, 8
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    dev = torch.cuda.get_device_name()
    for D in (128, 64, 256):
        for S, n in SHAPES:
            q = torch.randn(S, H, n, D, device="cuda", dtype=dtype)
            k = torch.randn(S, KVH, n, D, device="cuda", dtype=dtype)
            v = torch.randn(S, KVH, n, D, device="cuda", dtype=dtype)
            work = S * n * n
            iters = int(args.iters * 4e6 / work) + 1

            def call():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            for _ in range(3):
                call()
            torch.cuda.synchronize()
            runs = []
            for _ in range(5):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(iters):
                    call()
                e1.record()
                torch.cuda.synchronize()
                runs.append(e0.elapsed_time(e1) * 1e3 / iters)
            runs.sort()
            us = runs[2]
            pairs = S * n * (n + 1) / 2
            emit({"phase": "prefill", "heads": H, "kv_heads": KVH, "head_dim": D, "seqs": S, "context": 0,
                  "new_tokens": n, "dtype": args.dtype, "kernel": "sdpa", "median_us": round(us, 3),
                  "tflops": round(4.0 * pairs * H * D / (us * 1e6), 2), "torch": torch.__version__,
                  "device": dev})
            del q, k, v
    return 0


if __name__ == "__main__":
    sys.exit(main())
