#!/usr/bin/env python3
"""Peer of bench_graph: torch.cuda.CUDAGraph replaying a 64-kernel decode-like
segment (a step counter copied into pinned host memory, then 64 one-row
index_select kernels of a 64 x 64 f16 table), in the same run as kiln.

Lines (bench "graph", peer "torch"):
  per_kernel      mode torch_graph | torch_eager: host_ns_per_kernel (the
                  counter upload + replay() call, or the 65 eager calls),
                  step_us (that + synchronize), b2b_ns_per_kernel (200 steps
                  back to back / (200 * 64), median of 5 runs);
  submit_to_busy  mode torch_graph: from the counter upload + replay() until
                  the host sees the counter in the pinned flag (the graph's
                  first node ran), the GPU idle before; median/p10/p90.
With --kiln FILE (bench.jsonl holding bench_graph's lines) it adds kiln's
replayed numbers and the ratios beside torch's.
"""
import argparse
import json
import sys
import time

N = 64
B2B_STEPS = 200
B2B_RUNS = 5


def line(**kw):
    d = {"bench": "graph", "peer": "torch"}
    d.update(kw)
    print(json.dumps(d), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--kiln", default=None)
    a = ap.parse_args()
    try:
        import torch
    except Exception as e:  # pragma: no cover
        line(skipped="torch: %s" % e)
        return 0
    if not torch.cuda.is_available():
        line(skipped="no CUDA device")
        return 0
    dev = "cuda"
    table = torch.randn(64, 64, dtype=torch.float16, device=dev)
    ids = torch.tensor([(i * 37 + 11) % 64 for i in range(N)], dtype=torch.int64, device=dev)
    out = torch.empty(N, 64, dtype=torch.float16, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    host_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    flag = host_flag.numpy()
    cpu_counter = torch.zeros(1, dtype=torch.int32)
    ids_views = [ids[i:i + 1] for i in range(N)]
    out_views = [out[i:i + 1] for i in range(N)]

    def body():
        host_flag.copy_(counter, non_blocking=True)
        for i in range(N):
            torch.index_select(table, 0, ids_views[i], out=out_views[i])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()

    step = [0]

    def submit(mode):
        step[0] += 1
        cpu_counter[0] = step[0]
        t0 = time.perf_counter_ns()
        counter.copy_(cpu_counter, non_blocking=True)
        if mode == "torch_graph":
            g.replay()
        else:
            body()
        return time.perf_counter_ns() - t0

    # Correctness once: the rows and the flag.
    out.zero_()
    submit("torch_graph")
    torch.cuda.synchronize()
    ok = bool(torch.equal(out, table[ids])) and int(flag[0]) == step[0]
    line(phase="verify", ok=ok)

    for mode in ("torch_graph", "torch_eager"):
        host, lat, stp = [], [], []
        for i in range(a.steps + 50):
            t0 = time.perf_counter_ns()
            h = submit(mode)
            want = step[0]
            while int(flag[0]) != want:
                pass
            t1 = time.perf_counter_ns()
            torch.cuda.synchronize()
            t2 = time.perf_counter_ns()
            if i >= 50:
                host.append(h)
                lat.append(t1 - t0)
                stp.append((t2 - t0) / 1e3)
        b2b = []
        for _ in range(B2B_RUNS):
            t0 = time.perf_counter_ns()
            for _ in range(B2B_STEPS):
                submit(mode)
            torch.cuda.synchronize()
            b2b.append((time.perf_counter_ns() - t0) / (B2B_STEPS * N))
        host.sort(), lat.sort(), stp.sort(), b2b.sort()
        q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))]
        line(phase="per_kernel", mode=mode, kernels=N, steps=a.steps, host_ns_per_kernel=q(host, 0.5) / N,
             host_us_per_step=q(host, 0.5) / 1e3, step_us=q(stp, 0.5), b2b_ns_per_kernel=q(b2b, 0.5),
             torch=torch.__version__)
        line(phase="submit_to_busy", mode=mode, median_us=q(lat, 0.5) / 1e3, p10_us=q(lat, 0.1) / 1e3,
             p90_us=q(lat, 0.9) / 1e3,
             what="from the counter upload + replay() (GPU idle) until the host sees the counter in pinned memory")
        if mode == "torch_graph":
            torch_busy = q(lat, 0.5) / 1e3
            torch_b2b = q(b2b, 0.5)

    if a.kiln:
        kb = kp = None
        for l in open(a.kiln):
            try:
                d = json.loads(l)
            except Exception:
                continue
            if d.get("bench") == "graph" and d.get("peer") is False and d.get("mode") == "replayed":
                if d.get("phase") == "submit_to_busy":
                    kb = d["median_us"]
                if d.get("phase") == "per_kernel":
                    kp = d["b2b_ns_per_kernel"]
        if kb is not None and kp is not None:
            line(phase="compare", kiln_submit_to_busy_us=kb, torch_submit_to_busy_us=torch_busy,
                 busy_meets_target=kb < torch_busy, kiln_b2b_ns_per_kernel=kp, torch_b2b_ns_per_kernel=torch_b2b,
                 per_kernel_meets_target=kp <= 1000.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
