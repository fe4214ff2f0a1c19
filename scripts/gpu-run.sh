#!/usr/bin/env bash
# The one script that runs on the GPU machine. It builds nothing: build here
# (cmake -B build ... && cmake --build build), send build/ and .device-libs/
# along, and run
#     scripts/gpu-run.sh [build-dir]          (default: build)
# from anywhere in the checkout. Everything it writes lands in "${OUT:-./gpu-out}":
#     summary.txt     one line per step: its name, its exit status, its seconds
#     gpu-tests.log   ctest -L gpu
#     memcheck.log    compute-sanitizer --tool memcheck over each build/tests/test_*_gpu
#     bench.jsonl     the benchmarks' JSON lines (kiln and its peers), nothing else
#     bench.err       the benchmarks' stderr
#     env.txt         the machine: nvidia-smi -L, driver, python packages
#     decode-check.log  examples/decode/check.py (kiln vs transformers, token for token)
# and, where more than 8 files would come back, all but summary.txt and
# bench.jsonl packed into logs.tar.gz (the GPU machine returns 8 at most).
# A failing step does not stop the others; the script exits 1 when any failed.
# Filters, for a run that cannot afford everything (device time is scarce):
#     MEMCHECK_TESTS="test_graph_gpu ..."   memcheck only these binaries
#     BENCHES="bench_graph peer_torch_graph ..."   only these benchmark steps
#     DECODE_MOE=1   adds bench_decode_moe (the mixture of experts' decode step, kiln and torch)
#     PROFILE_MOE=1  adds moe-ncu.log: ncu's time of each kernel of a one-token MoE layer
#     PROFILE_MOE_PREFILL=1  adds moe-prefill.ncu-rep (ncu --set full of the wgmma expert products at
#                    4096 tokens, compiled with -lineinfo) and moe-prefill-ncu.log, its source page by
#                    template line (the report holds the templates' source: --import-source; read it
#                    again with ncu --import FILE --page source --print-source cuda,sass)
#     PROFILE_DELTA=1  adds delta-ncu.log: ncu's warp states, scheduler and source counters of
#                    the keyed gated delta kernel and the rows kernel at one sequence of 16384 tokens
#                    (their chains of chunks; each launched twice: the warm-up and the timed run)
# Each step has a time limit and the whole run a budget (GPU_RUN_BUDGET_S,
# default 480 s; the tests and memcheck leave BENCH_RESERVE_S, default 180 s,
# of it to the benchmarks): a step that would start past the budget is
# recorded as "skipped-budget" and counts as failed.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
BUILD="${1:-build}"
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
BUDGET_S="${GPU_RUN_BUDGET_S:-480}"

export LD_LIBRARY_PATH="$ROOT/.device-libs:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin"
export PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.txt"
BENCH_JSONL="$OUT/bench.jsonl"
BENCH_ERR="$OUT/bench.err"
: >"$SUMMARY"
: >"$BENCH_JSONL"
: >"$BENCH_ERR"
START=$SECONDS
FAILED=0

# record NAME RC SECONDS [NOTE]
record() {
    printf '%-28s rc=%-4s %5ss %s\n' "$1" "$2" "$3" "${4:-}" >>"$SUMMARY"
    echo "== $1: rc=$2 (${3}s) ${4:-}" >&2
}

# step NAME LIMIT_S RESERVE_S CMD...   runs CMD under a time limit, keeping
# RESERVE_S of the budget for the steps after it; its output goes where the
# caller redirects it. Returns CMD's status.
step() {
    local name="$1" limit="$2" reserve="$3"
    shift 3
    local left=$((BUDGET_S - (SECONDS - START) - reserve))
    if [ "$left" -lt 10 ]; then
        record "$name" skipped-budget 0 "(budget of ${BUDGET_S}s spent, ${reserve}s kept for later steps)"
        FAILED=1
        return 125
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS rc=0
    timeout -k 10 "$limit" "$@" || rc=$?
    local note=""
    [ "$rc" -eq 124 ] && note="(timed out after ${limit}s)"
    record "$name" "$rc" $((SECONDS - t0)) "$note"
    [ "$rc" -ne 0 ] && FAILED=1
    return "$rc"
}

# A benchmark: its stdout, JSON lines only, appended to bench.jsonl.
bench() {
    local name="$1" limit="$2"
    shift 2
    if [ -n "${BENCHES:-}" ] && ! [[ " $BENCHES " == *" $name "* ]]; then
        record "$name" skipped 0 "(not in BENCHES)"
        return 0
    fi
    echo "== $name: $*" >>"$BENCH_ERR"
    step "$name" "$limit" 0 "$@" >>"$BENCH_JSONL" 2>>"$BENCH_ERR"
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "root: $ROOT"
    echo "build: $BUILD"
    echo "git: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null) $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed"
    nvidia-smi -L 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    python3 -c 'import sys; print("python", sys.version.split()[0])' 2>&1
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1
    python3 -c 'import cupy; print("cupy", cupy.__version__)' 2>&1 | tail -1
    command -v compute-sanitizer || echo "compute-sanitizer: not found"
} >"$OUT/env.txt" 2>&1
nvidia-smi -L 2>&1 || true

# 1. The GPU tests. Tests and memcheck keep BENCH_RESERVE_S for the benchmarks.
BENCH_RESERVE_S="${BENCH_RESERVE_S:-180}"
step gpu-tests 240 "$BENCH_RESERVE_S" ctest --test-dir "$BUILD" --output-on-failure -L gpu >"$OUT/gpu-tests.log" 2>&1
cat "$OUT/gpu-tests.log"

# 2. memcheck over each GPU test binary, run as CTest runs it (from
# BUILD/tests, TMPDIR there); exit 86 when memcheck finds an error. API
# errors are not reported: test_buffers asks for 1 PiB on purpose.
: >"$OUT/memcheck.log"
SANITIZER="$(command -v compute-sanitizer || true)"
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -n "$SANITIZER" ] && break
    [ -x "$c" ] && SANITIZER="$c"
done
found=0
for t in "$BUILD"/tests/test_*_gpu; do
    if [ ! -f "$t" ] || [ ! -x "$t" ]; then continue; fi
    # test_fault_gpu makes an illegal address on purpose: memcheck would (rightly) report it.
    case "$(basename "$t")" in test_fault_gpu) continue ;; esac
    if [ -n "${MEMCHECK_TESTS:-}" ] && ! [[ " $MEMCHECK_TESTS " == *" $(basename "$t") "* ]]; then continue; fi
    found=1
    name="memcheck-$(basename "$t")"
    echo "===== $name" >>"$OUT/memcheck.log"
    cd "$BUILD/tests" || exit 2
    step "$name" 150 "$BENCH_RESERVE_S" env TMPDIR="$BUILD/tests" \
        "${SANITIZER:-compute-sanitizer}" --tool memcheck --report-api-errors no --error-exitcode 86 --print-limit 50 "$t" >>"$OUT/memcheck.log" 2>&1
    cd "$ROOT" || exit 2
done
if [ "$found" -eq 0 ]; then
    record memcheck none 0 "(no $BUILD/tests/test_*_gpu)"
    FAILED=1
fi
tail -n 5 "$OUT/memcheck.log"

# 3. The benchmarks, each kiln measurement followed by its peer.
if [ -x "$BUILD/bench/bench_acquire" ]; then
    bench bench_acquire 120 "$BUILD/bench/bench_acquire" --n 60
else
    record bench_acquire missing 0 "($BUILD/bench/bench_acquire)"
    FAILED=1
fi
bench peer_cupy_acquire 150 python3 "$ROOT/bench/peer_cupy_acquire.py" --n 60
if [ -x "$BUILD/bench/bench_embedding" ]; then
    bench bench_embedding 120 "$BUILD/bench/bench_embedding"
else
    record bench_embedding missing 0 "($BUILD/bench/bench_embedding)"
    FAILED=1
fi
bench peer_torch_embedding 150 python3 "$ROOT/bench/peer_torch_embedding.py"
if [ -x "$BUILD/bench/bench_submit" ]; then
    bench bench_submit 120 "$BUILD/bench/bench_submit"
else
    record bench_submit missing 0 "($BUILD/bench/bench_submit)"
    FAILED=1
fi

# Graph replay of a 64-kernel segment beside the raw driver, then torch.cuda.CUDAGraph.
bench bench_graph 120 "$BUILD/bench/bench_graph" && bench peer_torch_graph 150 python3 "$ROOT/bench/peer_torch_graph.py" --kiln "$BENCH_JSONL"

if [ -x "$BUILD/bench/bench_dense" ]; then
    bench bench_dense 150 "$BUILD/bench/bench_dense"
else
    record bench_dense missing 0 "($BUILD/bench/bench_dense)"
    FAILED=1
fi
bench peer_torch_dense 150 python3 "$ROOT/bench/peer_torch_dense.py" --kiln "$BENCH_JSONL"

bench bench_norm_argmax 120 "$BUILD/bench/bench_norm_argmax" && bench peer_torch_norm_argmax 180 python3 "$ROOT/bench/peer_torch_norm_argmax.py" --kiln "$BENCH_JSONL"
# Dense linear at decode shapes: kiln's choice (the skinny kernel up to 8 tokens) beside every cuBLASLt candidate.
if [ -x "$BUILD/bench/bench_linear_tune" ]; then bench bench_linear_tune 120 "$BUILD/bench/bench_linear_tune"; fi

# Every line of bench.jsonl must be one JSON object.
# A shipped database ready in <= 20 ms; prewarm's -j scaling on this machine's cores.
rm -f "$BUILD/tests/llama-export.db"
"$BUILD/kiln" export --arch sm_90 -o "$BUILD/tests/llama-export.db" >/dev/null 2>>"$BENCH_ERR" || true
bench bench_ship 60 "$BUILD/bench/bench_ship" --db "$BUILD/tests/llama-export.db"
bench bench_prewarm 120 bash "$ROOT/bench/bench_prewarm.sh" "$BUILD"
for b in bench_attention bench_recurrent; do
    if [ -x "$BUILD/bench/$b" ]; then bench "$b" 120 "$BUILD/bench/$b"; fi
done

# The mixture-of-experts layer at Qwen3-30B-A3B's shape (gate product, router, experts; replayed), then
# transformers' Qwen3MoeSparseMoeBlock (eager and in a CUDA graph) and torch._grouped_mm.
if [ -x "$BUILD/bench/bench_moe" ]; then
    bench bench_moe 180 "$BUILD/bench/bench_moe"
else
    record bench_moe missing 0 "($BUILD/bench/bench_moe)"
    FAILED=1
fi
bench peer_torch_moe 240 python3 "$ROOT/bench/peer_torch_moe.py" --kiln "$BENCH_JSONL"
# The prefill again on the 64-row mma.sync tiles that sm_90's wgmma products replace ("moe_wgmma":false).
if [ -x "$BUILD/bench/bench_moe" ]; then
    bench bench_moe_mma 90 env KILN_MOE_WGMMA=0 "$BUILD/bench/bench_moe" --tokens 4096
fi
# Where a one-token MoE layer's time goes, kernel by kernel (ncu, clocks not locked): only with PROFILE_MOE=1.
if [ "${PROFILE_MOE:-0}" = 1 ] && command -v ncu >/dev/null; then
    step profile_moe 150 0 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:kiln -c 30 \
        "$BUILD/bench/bench_moe" --tokens 1 --iters 1 --reps 1 --sets 1 >"$OUT/moe-ncu.log" 2>&1
fi
# Where the prefill expert products wait, by template line: only with PROFILE_MOE_PREFILL=1.
if [ "${PROFILE_MOE_PREFILL:-0}" = 1 ] && command -v ncu >/dev/null && [ -x "$BUILD/bench/bench_moe" ]; then
    step profile_moe_prefill 240 0 env KILN_NVRTC_LINEINFO=1 ncu --clock-control none --set full \
        --import-source yes --source-folders "$ROOT/templates" -k regex:"kiln_moe_(gate_up|down)_w" -c 2 \
        -f -o "$OUT/moe-prefill" "$BUILD/bench/bench_moe" --tokens 4096 --iters 1 --reps 1 --sets 1 \
        >"$OUT/moe-prefill-ncu.log" 2>&1 &&
        ncu --import "$OUT/moe-prefill.ncu-rep" --page source --print-source cuda,sass --csv \
            --resolve-source-file "$ROOT/templates/moe_experts_wgmma.cu,$ROOT/templates/kiln_wgmma.cuh,$ROOT/templates/kiln_tma.cuh" \
            >>"$OUT/moe-prefill-ncu.log" 2>&1
fi
# Where the keyed gated delta kernel's chain of chunks waits (ncu, one launch, clocks not locked):
# only with PROFILE_DELTA=1.
if [ "${PROFILE_DELTA:-0}" = 1 ] && command -v ncu >/dev/null && [ -x "$BUILD/bench/bench_recurrent" ]; then
    step profile_delta 240 0 ncu --clock-control none --section WarpStateStats --section SchedulerStats \
        --section SourceCounters --section LaunchStats --section Occupancy -k regex:"gated_delta_(chunk_keyed|rows)" -c 4 \
        "$BUILD/bench/bench_recurrent" --only 1,16384 --iters 1 --reps 1 >"$OUT/delta-ncu.log" 2>&1
fi

# Decode-step latency beside torch + CUDA graph, and the token-for-token check against transformers.
bench bench_decode 240 bash "$ROOT/bench/bench_decode.sh" "$BUILD"
# The decode step of a 48-layer Qwen3-30B-A3B-shaped mixture of experts (bf16, ~58 GB of weights), kiln then
# the torch peer on the same weights: only with DECODE_MOE=1 or bench_decode_moe in BENCHES.
if [ "${DECODE_MOE:-0}" = 1 ] || [[ " ${BENCHES:-} " == *" bench_decode_moe "* ]]; then
    bench bench_decode_moe 420 bash "$ROOT/bench/bench_decode.sh" "$BUILD" --config "$ROOT/tests/data/qwen3-30b-a3b.json" \
        --layers 48 --dtype bf16 --batch 1,8,32 --context 1024
fi
if [ -z "${BENCHES:-}" ] || [[ " $BENCHES " == *" decode-check "* ]]; then
    step decode-check 300 0 python3 "$ROOT/examples/decode/check.py" --build "$BUILD" >"$OUT/decode-check.log" 2>&1
    tail -n 30 "$OUT/decode-check.log"
fi

# Prefill of the Llama-3-8B-shaped model (1x512, 1x4096, 4x1024, 1x16384 tokens): time, TFLOP/s and MFU
# against the dense f16 peak of the same run, then transformers (sdpa) eager and torch.compile'd.
bench bench_prefill 300 "$BUILD/examples/decode/decode" --bench-prefill
bench peer_torch_prefill 480 python3 "$ROOT/bench/peer_torch_prefill.py"

step bench-jsonl-valid 30 0 python3 -c '
import json, sys
bad = 0
for n, line in enumerate(open(sys.argv[1]), 1):
    try:
        assert isinstance(json.loads(line), dict)
    except Exception:
        bad += 1
        sys.stderr.write("bench.jsonl line %d is not a JSON object: %r\n" % (n, line[:200]))
sys.exit(1 if bad else 0)
' "$BENCH_JSONL"

echo "total: $((SECONDS - START))s failed: $FAILED" >>"$SUMMARY"
cat "$SUMMARY" >&2
# The GPU machine's runner brings back at most 8 files: past that, all but
# summary.txt and bench.jsonl travel as logs.tar.gz.
mapfile -t extra < <(cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name bench.jsonl \
    ! -name logs.tar.gz -printf '%f\n' | sort)
if [ $((${#extra[@]} + 2)) -gt 8 ]; then
    (cd "$OUT" && tar czf logs.tar.gz --remove-files "${extra[@]}") && echo "logs: $OUT/logs.tar.gz" >&2
fi
exit "$FAILED"
