#!/usr/bin/env bash
# Sets up, builds, and prewarms the cache for the built-in model shape
# (Llama-3-8B) for sm_90. Needs no GPU. Extra arguments go to `kiln prewarm`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target kiln_cli
build/kiln prewarm --arch sm_90 "$@"
