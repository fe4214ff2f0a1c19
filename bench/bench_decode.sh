#!/usr/bin/env bash
# Decode-step latency of a Llama-3-8B-shaped model of random f16 weights at
# batch 1, 8 and 32 (context 1024, or each context of a --context list):
# kiln (examples/decode --bench) beside the torch peer
# (bench/peer_torch_decode.py, a CUDA-graph-captured decode loop) on the same
# weights, in one run. Each prints the device-to-device copy bandwidth it
# measured and the floor it implies. JSON lines on stdout.
# usage: bench/bench_decode.sh [BUILD_DIR] [extra decode --bench options]
# --batch, --context, --layers, --steps, --dtype and --config go to the peer
# too, e.g.
#   bench/bench_decode.sh build --batch 1,8 --context 1024,4096,16384,32768
# The mixture of experts' step (48 layers of Qwen3-30B-A3B's shape, bf16,
# about 58 GB of weights; each side measures the experts its routing reads):
#   bench/bench_decode.sh build --config tests/data/qwen3-30b-a3b.json \
#       --layers 48 --dtype bf16 --batch 1,8,32 --context 1024
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
peer=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
    --batch | --context | --layers | --steps | --dtype | --config)
        if ((i + 1 < ${#args[@]})); then peer+=("${args[i]}" "${args[i + 1]}"); fi
        ;;
    esac
done
chunk=$(mktemp "${TMPDIR:-/tmp}/kiln-decode-chunk.XXXXXX")
trap 'rm -f "$chunk"' EXIT
"$build/examples/decode/decode" --bench --chunk-file "$chunk" "$@"
python3 bench/peer_torch_decode.py --chunk-file "$chunk" "${peer[@]}"
