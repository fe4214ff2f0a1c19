#!/usr/bin/env bash
# Process start to the first decode step of a Llama-3-8B-shaped model (or a
# config's) with a complete database: `kiln prewarm` fills a fresh database,
# one `decode --bench-startup` run fills what only a device decides (the
# products' plans), then RUNS more runs, each a new process, are measured
# (`"phase":"measured"`); the weights' upload is reported apart. JSON lines.
# usage: bench/bench_startup.sh [BUILD_DIR] [decode --bench-startup options]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
runs=${RUNS:-3}
dir=$(mktemp -d "${TMPDIR:-/tmp}/kiln-startup.XXXXXX")
trap 'rm -rf "$dir"' EXIT
config=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    if [[ ${args[i]} == --config ]] && ((i + 1 < ${#args[@]})); then config=(--model "${args[i + 1]}"); fi
done
"$build/kiln" prewarm --db "$dir/kernels.db" "${config[@]}" >/dev/null
"$build/examples/decode/decode" --bench-startup --db "$dir/kernels.db" "$@" | sed 's/^{/{"phase":"fill",/'
for ((r = 0; r < runs; r++)); do
    "$build/examples/decode/decode" --bench-startup --db "$dir/kernels.db" "$@" | sed 's/^{/{"phase":"measured",/'
done
