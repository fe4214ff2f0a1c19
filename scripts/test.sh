#!/usr/bin/env bash
# Sets up, builds under AddressSanitizer + UndefinedBehaviorSanitizer, and
# runs the whole test suite. GPU tests skip (CTest's skip code) without a
# driver; on a GPU machine run scripts/gpu-run.sh from a plain build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build-test -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON >/dev/null
cmake --build build-test -j"$(nproc)"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir build-test --output-on-failure -j"$(nproc)"
