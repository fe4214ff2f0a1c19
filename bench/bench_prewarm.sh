#!/usr/bin/env bash
# kiln prewarm of a model into a fresh database at -j 1, 2, 4, 8 and 16 (up
# to the CPUs present): wall time and speedup over -j 1, as JSON lines. Needs
# no GPU. Usage: bench/bench_prewarm.sh BUILD_DIR [config.json]
set -euo pipefail
build=${1:-build}
model=${2:-}
kiln="$build/kiln"
cpus=$(nproc)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
base=""
for j in 1 2 4 8 16; do
  ((j <= cpus)) || break
  db="$scratch/j$j.db"
  start=$(date +%s.%N)
  "$kiln" prewarm --db "$db" -j "$j" ${model:+--model "$model"} >"$scratch/out" 2>/dev/null
  end=$(date +%s.%N)
  secs=$(python3 -c "print(f'{$end - $start:.4f}')")
  n=$(grep -c ' compiled ' "$scratch/out" || true)
  [[ -n $base ]] || base=$secs
  python3 -c "
import json, sys
j, secs, base, n, cpus = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
speedup = base / secs
print(json.dumps({'bench': 'prewarm', 'peer': False, 'jobs': j, 'cpus': cpus, 'kernels': n, 'seconds': secs,
                  'speedup': round(speedup, 3), 'target_speedup': round(0.8 * min(j, 8), 2) if j > 1 else None,
                  'meets_target': (speedup >= 0.8 * min(j, 8)) if j > 1 else None}))" "$j" "$secs" "$base" "$n" "$cpus"
done
