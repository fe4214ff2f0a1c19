#!/usr/bin/env python3
"""Kernel acquisition, the CuPy peer of bench_acquire.

The same specializations as bench_acquire (token_embedding, vocab 128256,
hidden 1024, 1088, ... in steps of 64), compiled from the same source: kiln's
templates/token_embedding.cu with templates/kiln_prelude.cuh inlined and the
constants as a prelude of #defines, exactly as kiln renders it. Each spec is a
distinct source, so each one is a distinct CuPy cache entry.

Phases (JSON lines on stdout, "peer": "cupy"):
  cold_compile      a fresh CUPY_CACHE_DIR: cupy.RawModule(code=...).get_function()
                    per spec = NVRTC compile + cache-file write + module load;
                    once with options ('--std=c++17',) and once with kiln's
                    ('--std=c++17', '-minimal') ("variant").
  disk_hit          a new Python process on the same CUPY_CACHE_DIR: the same
                    call per spec, each spec once (CuPy memoizes modules in the
                    process) = cache-file read + md5 check + module load.
  memory_hit        RawModule(code=...).get_function() again in the process that
                    compiled (CuPy's memoized module + cuModuleGetFunction),
                    mean of --reps calls per spec.
  memory_hit_kernel RawKernel.kernel on a RawKernel already held (a list lookup).
One extra spec (vocab 1000, hidden 64) warms every phase up and is not timed.

Usage: peer_cupy_acquire.py [--n 60] [--reps 200] [--keep]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from peer_common import Emitter, quantile, r3

BENCH = "acquire"
PEER = "cupy"
VOCAB = 128256
WARM = (1000, 64)
ENTRY = "kiln_token_embedding"
OPTIONS = ("--std=c++17",)
OPTIONS_MINIMAL = ("--std=c++17", "-minimal")
HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(os.path.dirname(HERE), "templates")
emit = Emitter(BENCH, PEER)


def stats_us(values):
    v = sorted(values)
    r = r3
    return {
        "n": len(v),
        "median_us": r(quantile(v, 0.5)),
        "p10_us": r(quantile(v, 0.1)),
        "p90_us": r(quantile(v, 0.9)),
        "min_us": r(v[0]) if v else None,
        "max_us": r(v[-1]) if v else None,
        "mean_us": r(sum(v) / len(v)) if v else None,
    }


def threads_for(hidden, vec):
    """providers/token_embedding.c's threads_for."""
    vecs = hidden // vec
    t = ((vecs + 3) // 4 + 31) // 32 * 32
    return max(32, min(256, t))


def load_template():
    with open(os.path.join(TEMPLATES, "token_embedding.cu")) as f:
        body = f.read()
    with open(os.path.join(TEMPLATES, "kiln_prelude.cuh")) as f:
        prelude = f.read()
    # Inline the prelude (CuPy gets one self-contained source); its
    # '#pragma once' means nothing in a main file.
    prelude = "\n".join(l for l in prelude.splitlines() if l.strip() != "#pragma once") + "\n"
    inc = '#include "kiln_prelude.cuh"'
    if inc not in body:
        raise RuntimeError("templates/token_embedding.cu no longer includes kiln_prelude.cuh")
    return body.replace(inc, prelude)


def render(body, vocab, hidden, vec=8):
    consts = {"HIDDEN": hidden, "THREADS": threads_for(hidden, vec), "VEC": vec, "VOCAB": vocab}
    head = "".join("#define KILN_%s %dLL\n" % (k, consts[k]) for k in sorted(consts))
    return head + body


def spec_list(n):
    return [(VOCAB, 1024 + 64 * i) for i in range(n)]


def cache_files(d):
    try:
        return len([f for f in os.listdir(d) if not f.startswith(".")])
    except OSError:
        return -1


def acquire(cupy, src, options):
    mod = cupy.RawModule(code=src, backend="nvrtc", options=options)
    return mod.get_function(ENTRY)


def import_cupy():
    """cupy with a current device, or raises."""
    import cupy  # noqa: E402  (CUPY_CACHE_DIR must be set first)

    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no CUDA device")
    cupy.cuda.Device(0).use()
    # The context, without compiling any of CuPy's own kernels (a memset).
    cupy.zeros(1, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    return cupy


def child(spec_path):
    """The disk-hit phase, in a process of its own. Prints one JSON object."""
    with open(spec_path) as f:
        job = json.load(f)
    cupy = import_cupy()
    body = load_template()
    options = tuple(job["options"])
    srcs = [render(body, v, h) for v, h in job["specs"]]
    # Warm-up: CuPy's compiler probes and first file read, on a spec not timed.
    acquire(cupy, render(body, *job["warm"]), options)
    before = cache_files(job["cache_dir"])
    times = []
    for src in srcs:
        t0 = time.perf_counter_ns()
        acquire(cupy, src, options)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    after = cache_files(job["cache_dir"])
    print(json.dumps({"times_us": times, "new_cache_files": after - before}))
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    if args.n < 1 or args.n > 1000 or args.reps < 1:
        ap.error("--n must be 1..1000 and --reps >= 1")

    cache_dir = tempfile.mkdtemp(prefix="kiln-bench-cupy-")
    os.environ["CUPY_CACHE_DIR"] = cache_dir
    os.environ.pop("CUPY_CACHE_IN_MEMORY", None)  # that would bypass the disk cache
    failed = False
    try:
        try:
            cupy = import_cupy()
        except Exception as e:  # ImportError, no driver, no device, CUDA errors
            emit({"skipped": "cupy unavailable: %s: %s" % (type(e).__name__, str(e)[:500])})
            return 0
        try:
            body = load_template()
        except Exception as e:
            emit({"phase": "setup", "error": "template", "message": "%s: %s" % (type(e).__name__, e)})
            return 1
        specs = spec_list(args.n)
        srcs = [render(body, v, h) for v, h in specs]
        warm_src = render(body, *WARM)
        common = {"cupy_version": cupy.__version__, "arch": "sm_%s" % cupy.cuda.Device(0).compute_capability}
        try:
            major, minor = cupy.cuda.nvrtc.getVersion()
            common["nvrtc"] = "%d.%d" % (major, minor)
        except Exception:
            pass

        # (a) Cold compile, with the options the brief names, then with kiln's.
        for variant, options in (("std", OPTIONS), ("minimal", OPTIONS_MINIMAL)):
            try:
                acquire(cupy, warm_src, options)
                before = cache_files(cache_dir)
                times = []
                for src in srcs:
                    t0 = time.perf_counter_ns()
                    acquire(cupy, src, options)
                    times.append((time.perf_counter_ns() - t0) / 1e3)
                line = {"phase": "cold_compile", "variant": variant, "options": list(options)}
                line.update(stats_us(times))
                line.update({"new_cache_files": cache_files(cache_dir) - before,
                             "what": "RawModule(code).get_function, fresh CUPY_CACHE_DIR: NVRTC compile to cubin "
                                     "+ cache-file write + cuModuleLoadData + cuModuleGetFunction"})
                line.update(common)
                emit(line)
            except Exception as e:
                failed = True
                emit({"phase": "cold_compile", "variant": variant, "error": type(e).__name__,
                      "message": str(e)[:2000]})

        # (b) Disk-cache hit in a fresh process.
        try:
            job = {"specs": specs, "warm": list(WARM), "options": list(OPTIONS), "cache_dir": cache_dir}
            job_path = os.path.join(cache_dir, ".job.json")
            with open(job_path, "w") as f:
                json.dump(job, f)
            env = dict(os.environ, CUPY_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", job_path], env=env,
                               capture_output=True, text=True, timeout=300)
            if r.stderr:
                sys.stderr.write(r.stderr)
            lines = [l for l in r.stdout.splitlines() if l.strip().startswith("{")]
            if r.returncode != 0 or not lines:
                raise RuntimeError("child exited %d: %s" % (r.returncode, (r.stderr or r.stdout)[-1500:]))
            res = json.loads(lines[-1])
            line = {"phase": "disk_hit", "options": list(OPTIONS)}
            line.update(stats_us(res["times_us"]))
            line.update({"new_cache_files": res["new_cache_files"], "compiled_in_child": res["new_cache_files"] != 0,
                         "what": "RawModule(code).get_function in a new process on the same CUPY_CACHE_DIR, each "
                                 "spec once: cache-file read + md5 check + cuModuleLoadData + cuModuleGetFunction"})
            line.update(common)
            emit(line)
            if res["new_cache_files"] != 0:
                failed = True
        except Exception as e:
            failed = True
            emit({"phase": "disk_hit", "error": type(e).__name__, "message": str(e)[:2000]})

        # (c) In-memory hits in this process.
        try:
            acquire(cupy, warm_src, OPTIONS)
            times = []
            for src in srcs:
                t0 = time.perf_counter_ns()
                for _ in range(args.reps):
                    acquire(cupy, src, OPTIONS)
                times.append((time.perf_counter_ns() - t0) / 1e3 / args.reps)
            line = {"phase": "memory_hit", "options": list(OPTIONS), "reps_per_spec": args.reps}
            line.update(stats_us(times))
            line.update({"what": "RawModule(code).get_function again in the same process: CuPy's memoized "
                                 "module + a new RawKernel + cuModuleGetFunction (mean of reps calls per spec)"})
            line.update(common)
            emit(line)

            times = []
            for src in srcs:
                ker = acquire(cupy, src, OPTIONS)
                ker.kernel
                t0 = time.perf_counter_ns()
                for _ in range(args.reps):
                    ker.kernel
                times.append((time.perf_counter_ns() - t0) / 1e3 / args.reps)
            line = {"phase": "memory_hit_kernel", "options": list(OPTIONS), "reps_per_spec": args.reps}
            line.update(stats_us(times))
            line.update({"what": "RawKernel.kernel on a RawKernel already held: its per-device list "
                                 "(mean of reps calls per spec)"})
            line.update(common)
            emit(line)
        except Exception as e:
            failed = True
            emit({"phase": "memory_hit", "error": type(e).__name__, "message": str(e)[:2000]})
    finally:
        if not args.keep:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
