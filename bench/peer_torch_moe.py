#!/usr/bin/env python3
"""The mixture-of-experts layer, the torch peer of bench_moe.

transformers' Qwen3MoeSparseMoeBlock (the router's gate, softmax and top k,
the routed SwiGLU experts), built from a Qwen3MoeConfig of bench_moe's sizes
(Qwen3-30B-A3B's by default: hidden 2048, 128 experts, top 8, expert
intermediate 768, norm_topk_prob), bf16 (--dtype) on cuda, weights uniform
with variance 1/fan_in and x uniform with variance 1, as bench_moe's. --sets
blocks share the gate's weight (so that they route alike) and differ in the
experts' weights; calls cycle through them so that the selected experts'
weights are not still in L2 from the previous call, as bench_moe's sets.

For each T of --tokens and each experts implementation of --impls that this
transformers has (config._experts_implementation: "eager", the block's own
loop over the selected experts; "grouped_mm" and "batched_mm", when
transformers registers them; batched_mm is skipped where its gathered
weights would pass 8 GiB):
  eager   an event pair around each call (torch.cuda.Event), median of --iters;
  graph   --reps calls captured in one torch.cuda.CUDAGraph after a warm-up on
          a side stream, an event pair around each of --iters replays, over
          reps: median. A capture that fails (the block syncs on the host, as
          the eager loop does with .nonzero()) gives "graph": "unsupported"
          and the reason; the eager time stands.
Each line carries the distinct experts the routing selects and the floor, as
bench_moe's: the distinct experts' weights (3·I·H elements each), the gate's
(E·H), x and out (T·H each), over the device-to-device copy bandwidth of a
1 GiB copy measured here ("phase":"copy"). Prefill lines (T > 64) add
TFLOP/s (2·T·K·3·I·H over the time).

For each prefill T, torch._grouped_mm where this torch has it ("phase":
"grouped_mm"): the bf16 gate_up and down products of the (token, slot) pairs
pre-sorted by expert (offs: the cumulative counts, int32), each alone and
the two with silu(g)·u between them: time and TFLOP/s; a "skipped" line
with the reason otherwise.

With --kiln FILE (bench_moe's JSON lines), one "phase":"compare" line per T:
kiln's layer_us beside torch's fastest (graph or eager, any implementation)
and torch_us / kiln_us. Every line carries "dtype".

Usage: peer_torch_moe.py [--hidden 2048] [--inter 768] [--experts 128]
       [--top-k 8] [--dtype bf16|f16] [--tokens 1,8,32,64,4096] [--iters 50]
       [--warmup 5] [--reps 8] [--sets 4] [--impls grouped_mm,batched_mm,eager]
       [--kiln bench.jsonl]
"""
import argparse
import json
import math
import sys

from peer_common import Emitter, cuda_device, quantile, r3

BENCH = "moe"
PEER = "torch"
DECODE_MAX_T = 64
COPY_BYTES = 1 << 30
COPY_ITERS = 20
BATCHED_MM_MAX_BYTES = 8 << 30
emit = Emitter(BENCH, PEER)  # its dtype set from --dtype in main


def event_times(torch, fn, iters, per_call=1):
    """fn() timed between an event pair iters times, back to back: sorted us per call."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(starts[i].elapsed_time(ends[i]) * 1e3 / per_call for i in range(iters))


def copy_bandwidth(torch, dev):
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dev).fill_(0x3c)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    per = event_times(torch, lambda i: dst.copy_(src), COPY_ITERS)
    med = quantile(per, 0.5)
    bps = 2.0 * COPY_BYTES / (med * 1e-6)
    emit({"phase": "copy", "copy_bytes": COPY_BYTES, "iters": COPY_ITERS, "median_us": r3(med),
          "p10_us": r3(quantile(per, 0.1)), "p90_us": r3(quantile(per, 0.9)), "tbps": r3(bps / 1e12)})
    return bps


def expert_weights(block):
    """The block's experts as [E, 2I, H] and [E, H, I] (transformers 5's fused layout, or stacked)."""
    import torch
    ex = block.experts
    if hasattr(ex, "gate_up_proj") and hasattr(ex, "down_proj"):
        gu, dn = ex.gate_up_proj, ex.down_proj
        if getattr(ex, "is_transposed", False):
            gu, dn = gu.transpose(-2, -1), dn.transpose(-2, -1)
        return gu, dn
    gu = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight], 0) for m in ex])
    dn = torch.stack([m.down_proj.weight for m in ex])
    return gu, dn


def output_of(y):
    return y[0] if isinstance(y, tuple) else y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dtype", choices=("bf16", "f16"), default="bf16")
    ap.add_argument("--tokens", default="1,8,32,64,4096")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--impls", default="grouped_mm,batched_mm,eager")
    ap.add_argument("--kiln", default=None)
    args = ap.parse_args()
    emit.dtype = args.dtype
    H, I, E, K = args.hidden, args.inter, args.experts, args.top_k
    tokens = [int(t) for t in args.tokens.split(",") if t]
    found = cuda_device(emit)
    if not found:
        return 0
    torch, dev = found
    import torch.nn.functional as F
    try:
        import transformers
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except Exception as e:
        emit({"skipped": "no transformers: %s: %s" % (type(e).__name__, str(e)[:500])})
        return 0
    tdtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    name = torch.cuda.get_device_name(dev)
    common = {"hidden": H, "inter": I, "experts": E, "top_k": K, "device": name,
              "torch_version": torch.__version__, "transformers_version": transformers.__version__}
    failed = False
    torch.manual_seed(0)
    copy_bps = copy_bandwidth(torch, dev)
    torch.cuda.empty_cache()

    try:
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=True, hidden_act="silu", num_hidden_layers=1)
        default_impl = getattr(cfg, "_experts_implementation", None)
        blocks = []
        with torch.no_grad():
            for s in range(args.sets):
                with torch.device(dev):
                    b = Qwen3MoeSparseMoeBlock(cfg)
                b = b.to(dtype=tdtype).eval()
                for p in b.parameters():
                    a = math.sqrt(3.0 / p.shape[-1])
                    p.uniform_(-a, a)
                    p.requires_grad_(False)
                if s:
                    b.gate.weight.copy_(blocks[0].gate.weight)
                blocks.append(b)
        gate_w = blocks[0].gate.weight
        x_all = (torch.rand(1, max(tokens), H, device=dev, dtype=torch.float32) * 2 - 1) * math.sqrt(3.0)
        x_all = x_all.to(tdtype)
    except Exception as e:
        emit(dict(common, phase="setup", error=type(e).__name__, message=str(e)[:2000]))
        return 1

    impls = []
    for impl in [s for s in args.impls.split(",") if s]:
        if impl == "eager":
            impls.append(impl)
            continue
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
            ok = impl in ALL_EXPERTS_FUNCTIONS
        except Exception:
            ok = False
        if ok:
            impls.append(impl)
        else:
            emit(dict(common, phase="impl", impl=impl,
                      skipped="not an experts implementation of transformers %s" % transformers.__version__))

    results = {}
    for T in tokens:
        x = x_all[:, :T].contiguous()
        phase = "decode" if T <= DECODE_MAX_T else "prefill"
        with torch.no_grad():
            logits = F.linear(x.view(T, H), gate_w)
            ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), K, dim=-1).indices
            distinct = int(torch.unique(ids).numel())
        floor_bytes = distinct * 3 * I * H * 2 + E * H * 2 + 2 * T * H * 2
        floor_us = floor_bytes / copy_bps * 1e6
        flop = 2.0 * T * K * 3 * I * H
        for impl in impls:
            row = dict(common, phase=phase, impl=impl, tokens=T, iters=args.iters, reps=args.reps,
                       sets=args.sets, distinct_experts=distinct, default_experts_implementation=default_impl)
            if impl == "batched_mm" and T * K * 3 * I * H * 2 > BATCHED_MM_MAX_BYTES:
                emit(dict(row, skipped="batched_mm gathers %d bytes of weights (limit %d)"
                          % (T * K * 3 * I * H * 2, BATCHED_MM_MAX_BYTES)))
                continue
            try:
                cfg._experts_implementation = impl
                with torch.no_grad():
                    for i in range(max(args.warmup, args.sets)):
                        output_of(blocks[i % args.sets](x))
                    torch.cuda.synchronize()
                    per = event_times(torch, lambda i: output_of(blocks[i % args.sets](x)), args.iters)
                    out = output_of(blocks[0](x))
                    torch.cuda.synchronize()
                row["eager_us"] = r3(quantile(per, 0.5))
                row["eager_p10_us"] = r3(quantile(per, 0.1))
                row["eager_p90_us"] = r3(quantile(per, 0.9))
                row["out_nonfinite"] = int((~torch.isfinite(out)).sum().item())
                del out
            except Exception as e:
                failed = True
                emit(dict(row, error=type(e).__name__, message=str(e)[:2000]))
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
                continue
            graph_us = None
            try:
                with torch.no_grad():
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for i in range(3):
                            output_of(blocks[i % args.sets](x))
                    torch.cuda.current_stream().wait_stream(side)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for r in range(args.reps):
                            output_of(blocks[r % args.sets](x))
                    for _ in range(3):
                        g.replay()
                    torch.cuda.synchronize()
                    gper = event_times(torch, lambda i: g.replay(), args.iters, per_call=args.reps)
                graph_us = quantile(gper, 0.5)
                row["graph"] = "replayed"
                row["graph_us"] = r3(graph_us)
                row["graph_p10_us"] = r3(quantile(gper, 0.1))
                row["graph_p90_us"] = r3(quantile(gper, 0.9))
                g = None
            except Exception as e:
                reason = "%s: %s" % (type(e).__name__, str(e)[:600])
                if e.__context__ is not None and e.__context__ is not e:
                    reason += " (while: %s: %s)" % (type(e.__context__).__name__, str(e.__context__)[:600])
                row["graph"] = "unsupported"
                row["graph_reason"] = reason
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
            best = min(t for t in (graph_us, quantile(per, 0.5)) if t is not None)
            row["best_us"] = r3(best)
            row["floor_bytes"] = floor_bytes
            row["copy_tbps"] = r3(copy_bps / 1e12)
            row["floor_us"] = r3(floor_us)
            row["ratio"] = r3(best / floor_us)
            if T > DECODE_MAX_T:
                row["flop"] = flop
                row["tflops"] = r3(flop / (best * 1e6))
            emit(row)
            if T not in results or best < results[T][0]:
                results[T] = (best, impl, "graph" if graph_us is not None and graph_us <= best else "eager")
        torch.cuda.empty_cache()

        if T > DECODE_MAX_T:
            gm = {"phase": "grouped_mm", "tokens": T, "hidden": H, "inter": I, "experts": E, "top_k": K,
                  "dtype": "bf16", "device": name, "torch_version": torch.__version__}
            if not hasattr(torch, "_grouped_mm"):
                emit(dict(gm, skipped="torch %s has no torch._grouped_mm" % torch.__version__))
                continue
            try:
                with torch.no_grad():
                    gu_w, dn_w = expert_weights(blocks[0])
                    gu_w, dn_w = gu_w.to(torch.bfloat16), dn_w.to(torch.bfloat16)
                    flat = ids.reshape(-1)
                    perm = torch.argsort(flat, stable=True)
                    xs = x.view(T, H)[perm // K].to(torch.bfloat16).contiguous()
                    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
                    gu_t, dn_t = gu_w.transpose(-2, -1), dn_w.transpose(-2, -1)

                    def gate_up(_i=0):
                        return torch._grouped_mm(xs, gu_t, offs=offs)

                    def down(h):
                        return torch._grouped_mm(h, dn_t, offs=offs)

                    def both(_i=0):
                        gu = gate_up()
                        return down(F.silu(gu[:, :I]) * gu[:, I:])

                    gu0 = gate_up()
                    hmid = F.silu(gu0[:, :I]) * gu0[:, I:]
                    del gu0
                    for _ in range(args.warmup):
                        both()
                    torch.cuda.synchronize()
                    t_gu = quantile(event_times(torch, gate_up, args.iters), 0.5)
                    t_dn = quantile(event_times(torch, lambda i: down(hmid), args.iters), 0.5)
                    t_all = quantile(event_times(torch, both, args.iters), 0.5)
                S = T * K
                emit(dict(gm, iters=args.iters, pairs=S, gate_up_us=r3(t_gu), down_us=r3(t_dn), total_us=r3(t_all),
                          gate_up_tflops=r3(2.0 * S * 2 * I * H / (t_gu * 1e6)),
                          down_tflops=r3(2.0 * S * H * I / (t_dn * 1e6)), tflops=r3(flop / (t_all * 1e6))))
                del xs, hmid
            except Exception as e:
                emit(dict(gm, skipped="torch._grouped_mm failed: %s: %s" % (type(e).__name__, str(e)[:1000])))
            torch.cuda.empty_cache()

    if args.kiln:
        kiln = {}
        try:
            for line in open(args.kiln):
                try:
                    o = json.loads(line)
                except ValueError:
                    continue
                if (o.get("bench") == BENCH and o.get("peer") is False and "layer_us" in o and "error" not in o
                        and o.get("dtype") == args.dtype and o.get("hidden") == H and o.get("experts") == E):
                    kiln[o["tokens"]] = o
        except OSError as e:
            emit({"phase": "compare", "error": "OSError", "message": str(e)})
            return 1
        for T, (best, impl, how) in sorted(results.items()):
            if T not in kiln or not kiln[T].get("layer_us"):
                failed = True
                emit({"phase": "compare", "tokens": T, "error": "missing", "message": "no kiln line"})
                continue
            k_us = kiln[T]["layer_us"]
            emit({"phase": "compare", "tokens": T, "kiln_layer_us": k_us, "kiln_ratio": kiln[T].get("ratio"),
                  "torch_us": r3(best), "torch_impl": impl, "torch_timing": how,
                  "torch_over_kiln": r3(best / k_us)})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
