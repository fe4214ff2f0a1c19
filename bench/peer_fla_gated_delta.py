#!/usr/bin/env python3
"""The fla peer of bench_recurrent's prefill: flash-linear-attention's
chunk_gated_delta_rule (from fla.ops.gated_delta_rule; PyPI fla-core and
flash-linear-attention 0.6.x) at the same shapes, Qwen3-Next-80B-A3B's heads
(16 key heads, 32 value heads, dims 128): 1 x 4096, 4 x 1024, 16 x 256 and
1 x 16384 tokens, packed into one row with cu_seqlens, as kiln packs them.

q and k are f16 (or bf16: --dtype, which fla takes natively), repeated to the
32 value heads once before timing (as Qwen3-Next's layer does before it
calls fla: fla takes one head count), v the same, g and beta f32 (the element
type where this fla refuses f32; the line says which),
use_qk_l2norm_in_kernel=True, an f32 initial state of zeros and
output_final_state=True (kiln reads and writes its state too).

Timing as bench_recurrent: iters back-to-back calls between two CUDA events
on the current stream, divided by iters; the median and the minimum of reps
such runs, after one warm-up run; each shape twice, "graph": false as
called, then "graph": true with the call captured once in a CUDA graph and
replayed (fla's kernels without its host's Python launches, as kiln's
benchmark times its own; with one sequence and no cu_seqlens where capture
refuses them: "cu_seqlens" says which, an "error" line where neither
captures). Fields as bench_recurrent's prefill lines:
bench, peer ("fla"), phase, dtype, kernel, seqs, span, dk, dv, key_heads,
value_heads, iters, median_us, min_us, tokens_per_s; also beta_dtype,
fla_version, torch_version, device. A "check" line compares fla's output and
final state at 2 x 100 tokens from a random state with a float64 recurrence
(max error relative to each row's root mean square, as test_recurrent_gpu
measures kiln), so the peer is known to compute the same operation.

Without torch, CUDA or fla it prints one line saying what is missing and
exits 0.

Usage: peer_fla_gated_delta.py [--iters 20] [--reps 5] [--dtype f16|bf16]
"""
import argparse
import json
import sys

BENCH = "recurrent"
PEER = "fla"
KH, VH, DK, DV = 16, 32, 128, 128
SHAPES = [(1, 4096), (4, 1024), (16, 256), (1, 16384)]


DTYPE = "f16"  # --dtype, named in every line


def emit(obj):
    base = {"bench": BENCH, "peer": PEER, "dtype": DTYPE}
    base.update(obj)
    sys.stdout.write(json.dumps(base) + "\n")
    sys.stdout.flush()


def r3(x):
    return None if x is None else round(x, 3)


def inputs(torch, seqs, span, elt, beta_dtype, gen):
    """Packed inputs of seqs sequences of span tokens, batch 1; q, k, v in elt."""
    T = seqs * span
    dev = "cuda"
    q = torch.randn(1, T, KH, DK, device=dev, generator=gen).to(elt)
    k = torch.randn(1, T, KH, DK, device=dev, generator=gen).to(elt)
    q = q.repeat_interleave(VH // KH, dim=2).contiguous()
    k = k.repeat_interleave(VH // KH, dim=2).contiguous()
    v = torch.randn(1, T, VH, DV, device=dev, generator=gen).to(elt)
    g = -torch.rand(1, T, VH, device=dev, generator=gen).float() * 0.5
    beta = torch.rand(1, T, VH, device=dev, generator=gen).float().sigmoid().to(beta_dtype)
    h0 = torch.zeros(seqs, VH, DK, DV, device=dev, dtype=torch.float32)
    cu = torch.arange(0, T + 1, span, device=dev, dtype=torch.long)
    return q, k, v, g, beta, h0, cu


def reference(torch, q, k, v, g, beta, h0, cu):
    """The recurrence in float64: out [T, H, DV] and the final states [N, H, DK, DV] (fla's layout)."""
    qd, kd, vd = q[0].double(), k[0].double(), v[0].double()
    qd = qd / torch.sqrt((qd * qd).sum(-1, keepdim=True) + 1e-6) / DK ** 0.5
    kd = kd / torch.sqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
    gd, bd = g[0].double(), beta[0].double()
    out = torch.empty_like(vd)
    states = []
    for n in range(len(cu) - 1):
        S = h0[n].double().clone()  # [H, DK, DV]
        for t in range(int(cu[n]), int(cu[n + 1])):
            S = S * torch.exp(gd[t])[:, None, None]
            u = torch.einsum("hk,hkv->hv", kd[t], S)
            d = bd[t][:, None] * (vd[t] - u)
            S = S + kd[t][:, :, None] * d[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", qd[t], S)
        states.append(S)
    return out, torch.stack(states)


def rel_err(torch, got, want, floor):
    rms = want.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(floor)
    return ((got.double() - want).abs() / torch.maximum(want.abs(), rms)).max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", choices=["f16", "bf16"], default="f16",
                    help="element type of q, k, v and the output")
    args = ap.parse_args()
    if args.iters < 1 or args.reps < 1:
        ap.error("--iters and --reps must be positive")
    global DTYPE
    DTYPE = args.dtype

    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        torch.zeros(1, device="cuda").sum().item()
    except Exception as e:
        emit({"skipped": "no driver or no torch: %s: %s" % (type(e).__name__, str(e)[:500])})
        return 0
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:
        emit({"skipped": "fla is missing (pip install fla-core flash-linear-attention): %s: %s"
              % (type(e).__name__, str(e)[:500])})
        return 0

    dev_name = torch.cuda.get_device_name(0)
    versions = {"fla_version": getattr(fla, "__version__", None), "torch_version": torch.__version__,
                "device": dev_name}
    elt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    # The rms floor: f16's subnormal range (as test_recurrent_gpu's for f16 outputs); bf16 has f32's.
    rms_floor = 2.0 ** -126 if args.dtype == "bf16" else 2.0 ** -14
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)

    def call(q, k, v, g, beta, h0, cu):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

    # Which beta this fla takes: f32, else the element type.
    beta_dtype = torch.float32
    try:
        call(*inputs(torch, 1, 64, elt, beta_dtype, gen))
        torch.cuda.synchronize()
    except Exception:
        beta_dtype = elt
    bname = "f32" if beta_dtype == torch.float32 else args.dtype

    failed = False
    try:
        x = inputs(torch, 2, 100, elt, beta_dtype, gen)
        x = x[:5] + (torch.randn(x[5].shape, device="cuda", generator=gen) * 0.5,) + x[6:]
        o, ht = call(*x)
        torch.cuda.synchronize()
        ro, rs = reference(torch, *x)
        emit(dict({"phase": "check", "seqs": 2, "span": 100, "beta_dtype": bname,
                   "max_err_out": float("%.3g" % rel_err(torch, o[0], ro, rms_floor)),
                   "max_err_state": float("%.3g" % rel_err(torch, ht, rs, rms_floor))}, **versions))
    except Exception as e:
        failed = True
        emit({"phase": "check", "error": type(e).__name__, "message": str(e)[:2000]})

    def timed(fn):
        """(median, min) µs of fn over reps runs of iters calls, after a warm-up run."""
        stream = torch.cuda.current_stream()
        times = []
        for r in range(-1, args.reps):  # r = -1: warm-up
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            for _ in range(args.iters):
                fn()
            e1.record(stream)
            e1.synchronize()
            if r >= 0:
                times.append(e0.elapsed_time(e1) * 1e3 / args.iters)
        times.sort()
        n = len(times)
        return (times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])), times[0]

    def captured(x):
        """fla's call captured in a CUDA graph (its launches without the host's Python), or the
        reason it cannot be; with one sequence, without cu_seqlens where capture refuses them."""
        tries = [x] + ([x[:6] + (None,)] if x[6] is not None and len(x[6]) == 2 else [])
        why = None
        for xs in tries:
            first = None  # the first failure: the call's, not the capture_end it spoils
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # the current stream again after it, whatever fails
                try:
                    for _ in range(3):
                        call(*xs)
                    side.synchronize()
                    graph.capture_begin()
                    try:
                        call(*xs)
                    except Exception as e:
                        first = e
                    graph.capture_end()
                except Exception as e:
                    first = first or e
            torch.cuda.current_stream().wait_stream(side)
            try:
                torch.cuda.synchronize()
            except Exception as e:
                first = first or e
            if first is None:
                return graph, xs[6] is not None, None
            why = "%s: %s" % (type(first).__name__, str(first)[:500])
        return None, False, why

    for seqs, span in SHAPES:
        T = seqs * span
        line = {"phase": "prefill", "kernel": "chunk_gated_delta_rule", "seqs": seqs, "span": span, "dk": DK,
                "dv": DV, "key_heads": KH, "value_heads": VH, "iters": args.iters, "beta_dtype": bname}
        try:
            x = inputs(torch, seqs, span, elt, beta_dtype, gen)
            med, lo = timed(lambda: call(*x))
            emit(dict(line, graph=False, median_us=r3(med), min_us=r3(lo), tokens_per_s=r3(T / (med * 1e-6)),
                      **versions))
            # The same call replayed from a CUDA graph: the peer's device time, as kiln's is.
            graph, cu_used, why = captured(x)
            if graph is None:
                emit(dict(line, graph=True, error="capture", message=why, **versions))
            else:
                med, lo = timed(graph.replay)
                emit(dict(line, graph=True, cu_seqlens=cu_used, median_us=r3(med), min_us=r3(lo),
                          tokens_per_s=r3(T / (med * 1e-6)), **versions))
                del graph
            del x
        except Exception as e:
            failed = True
            emit({"phase": "prefill", "seqs": seqs, "span": span, "error": type(e).__name__, "message": str(e)[:2000]})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
