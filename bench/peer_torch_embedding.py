#!/usr/bin/env python3
"""Token embedding bandwidth, the torch peer of bench_embedding.

torch.nn.functional.embedding on an f16 (or, with --dtype bf16, bf16) cuda
table of vocab x hidden (random bits) with random int32 ids, at bench_embedding's shapes and modes, timed the
same way with torch.cuda.Event on the current stream:
  per_launch    an event pair around each call; median, p10, p90;
  back_to_back  one event pair around iters calls, divided by iters.
Bytes per call: tokens*hidden*2 read + tokens*hidden*2 written + tokens*4.
Modes: hot (the same ids every call) and rotated (calls cycle through up to 16
id sets and hold as many outputs alive, about 256 MiB, so L2 cannot keep the
previous call's data), as bench_embedding does.

Every line names the dtype ("dtype").

Usage: peer_torch_embedding.py [--iters 200] [--warmup 20] [--vocab 128256] [--dtype f16|bf16]
"""
import argparse
import sys

from peer_common import Emitter, cuda_device, quantile, r3

BENCH = "embedding"
PEER = "torch"
SHAPES = [(2048, 4096), (2048, 896), (2048, 5120), (1, 4096), (7, 4096), (70000, 4096)]
MAX_SETS = 16
ROTATE_BYTES = 256 << 20
emit = Emitter(BENCH, PEER, "f16")  # its dtype set from --dtype in main


def sets_for(tokens, hidden, rotated):
    if not rotated:
        return 1
    out_bytes = tokens * hidden * 2
    return max(1, min(MAX_SETS, -(-ROTATE_BYTES // out_bytes)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    args = ap.parse_args()
    emit.dtype = args.dtype
    if args.iters < 1 or args.warmup < 1 or args.vocab < 1:
        ap.error("--iters, --warmup and --vocab must be positive")

    found = cuda_device(emit)
    if not found:
        return 0
    torch, dev = found
    import torch.nn.functional as F

    iters, vocab = args.iters, args.vocab
    name = torch.cuda.get_device_name(dev)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    stream = torch.cuda.current_stream(dev)
    results = {}
    failed = False
    table = None
    table_hidden = None
    for tokens, hidden in SHAPES:
        try:
            if table_hidden != hidden:
                table = None
                torch.cuda.empty_cache()
                # Random bits, NaNs included: a gather moves bits, it does no arithmetic.
                table = torch.randint(-32768, 32768, (vocab, hidden), dtype=torch.int32, device=dev,
                                      generator=gen).to(torch.int16).view(dt)
                table_hidden = hidden
            nbytes = tokens * hidden * 2 * 2 + tokens * 4
            for rotated in (False, True):
                sets = sets_for(tokens, hidden, rotated)
                ids = [torch.randint(0, vocab, (tokens,), dtype=torch.int32, device=dev, generator=gen)
                       for _ in range(sets)]
                idx_dtype = "int32"
                try:
                    F.embedding(ids[0], table)
                except Exception:
                    ids = [i.long() for i in ids]  # a torch without int32 indices
                    idx_dtype = "int64"
                outs = [None] * sets
                for i in range(args.warmup + sets):
                    outs[i % sets] = F.embedding(ids[i % sets], table)
                torch.cuda.synchronize(dev)

                starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
                for i in range(iters):
                    starts[i].record(stream)
                    outs[i % sets] = F.embedding(ids[i % sets], table)
                    ends[i].record(stream)
                ends[-1].synchronize()
                per = sorted(starts[i].elapsed_time(ends[i]) * 1e3 for i in range(iters))

                b0 = torch.cuda.Event(enable_timing=True)
                b1 = torch.cuda.Event(enable_timing=True)
                b0.record(stream)
                for i in range(iters):
                    outs[i % sets] = F.embedding(ids[i % sets], table)
                b1.record(stream)
                b1.synchronize()
                b2b = b0.elapsed_time(b1) * 1e3 / iters

                # The output is what it must be.
                check = F.embedding(ids[0], table)
                verified = bool(torch.equal(check.view(torch.int16), table[ids[0].long()].view(torch.int16)))
                failed |= not verified

                med = quantile(per, 0.5)
                mode = "rotated" if rotated else "hot"
                emit({"mode": mode, "tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": args.dtype,
                      "index_dtype": idx_dtype, "iters": iters, "sets": sets, "bytes": nbytes,
                      "per_launch_median_us": r3(med), "per_launch_p10_us": r3(quantile(per, 0.1)),
                      "per_launch_p90_us": r3(quantile(per, 0.9)), "per_launch_min_us": r3(per[0]),
                      "back_to_back_avg_us": r3(b2b),
                      "per_launch_gbps": r3(nbytes / (med * 1e3)), "per_launch_tbps": r3(nbytes / (med * 1e6)),
                      "back_to_back_gbps": r3(nbytes / (b2b * 1e3)), "back_to_back_tbps": r3(nbytes / (b2b * 1e6)),
                      "verified": verified, "device": name, "torch_version": torch.__version__})
                if (tokens, hidden) == SHAPES[0]:
                    results[mode] = (nbytes / (med * 1e6), nbytes / (b2b * 1e6))
                del outs, ids, check
        except Exception as e:
            failed = True
            emit({"tokens": tokens, "hidden": hidden, "error": type(e).__name__, "message": str(e)[:2000]})

    if results:
        hot = results.get("hot", (None, None))
        rot = results.get("rotated", (None, None))
        emit({"phase": "reference", "tokens": SHAPES[0][0], "hidden": SHAPES[0][1],
              "per_launch_tbps_hot": r3(hot[0]), "per_launch_tbps_rotated": r3(rot[0]),
              "back_to_back_tbps_hot": r3(hot[1]), "back_to_back_tbps_rotated": r3(rot[1])})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
