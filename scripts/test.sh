#!/usr/bin/env bash
# Sets up, builds under AddressSanitizer + UndefinedBehaviorSanitizer, and
# runs the whole test suite. GPU tests skip (CTest's skip code) without a
# driver; on a GPU machine run scripts/gpu-run.sh from a plain build.
# Then, when clang can link libFuzzer, runs each fuzz target under libFuzzer
# for KILN_FUZZ_SECONDS (default 30; 0 skips) over its seed corpus
# (tests/fuzz/README.md); a crash fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build-test -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON >/dev/null
cmake --build build-test -j"$(nproc)"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir build-test --output-on-failure -j"$(nproc)"

# ---- libFuzzer, bounded ----
fuzz_seconds=${KILN_FUZZ_SECONDS:-30}
[[ $fuzz_seconds =~ ^[0-9]+$ ]] || { echo "test.sh: KILN_FUZZ_SECONDS must be a number of seconds" >&2; exit 2; }
if ((fuzz_seconds == 0)); then
  echo "fuzz: skipped (KILN_FUZZ_SECONDS=0)"
  exit 0
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }' >"$probe/probe.c"
if ! command -v clang >/dev/null || ! clang -fsanitize=fuzzer "$probe/probe.c" -o "$probe/probe" 2>"$probe/err"; then
  echo "fuzz: skipped: clang cannot link -fsanitize=fuzzer ($(command -v clang >/dev/null && head -c 300 "$probe/err" || echo 'no clang'))" >&2
  exit 0
fi
CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKILN_LIBFUZZER=ON -DKILN_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_config fuzz_cache_row fuzz_safetensors fuzz_manifest fuzz_remote fuzz_tuning_row
# target, seed corpus, extra libFuzzer options
targets=(
  "fuzz_config corpus_config -dict=$PWD/tests/fuzz/fuzz_config.dict"
  "fuzz_cache_row corpus_cache"
  "fuzz_safetensors corpus_safetensors -dict=$PWD/tests/fuzz/fuzz_safetensors.dict"
  "fuzz_manifest corpus_manifest"
  "fuzz_remote corpus_remote"
  "fuzz_tuning_row corpus_tuning"
)
root=$PWD
failed=0
for t in "${targets[@]}"; do
  read -r name corpus extra <<<"$t"
  run=$PWD/build-fuzz/fuzz-run/$name
  rm -rf "$run"
  # New inputs go to a scratch folder, never into the committed corpus.
  mkdir -p "$run/new" "$run/artifacts" "$run/tmp"
  rc=0
  (cd "$run" && TMPDIR="$run/tmp" "$root/build-fuzz/tests/$name" -max_total_time="$fuzz_seconds" -timeout=20 \
      -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$run/artifacts/" ${extra:+"$extra"} \
      new "$root/tests/fuzz/$corpus") >"$run/log" 2>&1 || rc=$?
  if ((rc != 0)) || compgen -G "$run/artifacts/*" >/dev/null; then
    echo "fuzz: $name FAILED (exit $rc); the input is in $run/artifacts/, the log in $run/log:" >&2
    tail -n 60 "$run/log" >&2
    failed=1
  else
    echo "fuzz: $name: $(grep -E '^(#[0-9]+[[:space:]]+DONE|Done [0-9]+ runs)' "$run/log" | tail -n 1)"
  fi
done
exit "$failed"
