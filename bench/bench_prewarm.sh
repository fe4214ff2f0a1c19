#!/usr/bin/env bash
# kiln prewarm of a model into a fresh database at -j 1, 2, 4, 8 and 16 (up
# to the CPUs present): wall time (median of RUNS rounds, default 3; each
# round runs every -j once, so drift falls on all alike) and speedup over
# -j 1, as JSON lines. Needs no GPU.
# Usage: [RUNS=3] bench/bench_prewarm.sh BUILD_DIR [config.json]
#
# With N >= the model's kernel count every kernel has a thread from the
# start, so the wall time is the longest single compile plus the process's
# serial part: the -j 16 line is the most this model's compiles can scale
# ("kernels" says how many there are). kiln passes NVRTC --no-cache, so no
# round is served from NVRTC's own cache (the driver's compute cache) that an
# earlier round filled.
set -euo pipefail
build=${1:-build}
model=${2:-}
runs=${RUNS:-3}
kiln="$build/kiln"
cpus=$(nproc)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
jobs=()
for j in 1 2 4 8 16; do
  ((j <= cpus)) && jobs+=("$j")
done
: >"$scratch/times"
for ((r = 0; r < runs; r++)); do
  for j in "${jobs[@]}"; do
    db="$scratch/j$j-r$r.db"
    start=$(date +%s.%N)
    "$kiln" prewarm --db "$db" -j "$j" ${model:+--model "$model"} >"$scratch/out" 2>/dev/null
    end=$(date +%s.%N)
    n=$(grep -c ' compiled ' "$scratch/out" || true)
    echo "$j $start $end $n" >>"$scratch/times"
    rm -f "$db" "$db-wal" "$db-shm"
  done
done
python3 - "$scratch/times" "$cpus" <<'EOF'
import json, statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
cpus = int(sys.argv[2])
by_jobs = {}
for j, start, end, n in rows:
    by_jobs.setdefault(int(j), []).append((float(end) - float(start), int(n)))
base = statistics.median(t for t, _ in by_jobs[1])
for j in sorted(by_jobs):
    times = [t for t, _ in by_jobs[j]]
    secs = statistics.median(times)
    speedup = base / secs
    target = round(0.8 * min(j, 8), 2) if j > 1 else None
    print(json.dumps({'bench': 'prewarm', 'peer': False, 'jobs': j, 'cpus': cpus, 'kernels': min(n for _, n in by_jobs[j]),
                      'seconds': round(secs, 4), 'runs': [round(t, 4) for t in times], 'speedup': round(speedup, 3),
                      'target_speedup': target, 'meets_target': (speedup >= target) if target else None}))
EOF
