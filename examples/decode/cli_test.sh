#!/usr/bin/env bash
# Tests of the decode program's command line that need no GPU: usage errors
# (exit 2, a message naming the option) and, with the device hidden, the one
# JSON "skipped" line each benchmark prints without a driver.
#   usage: cli_test.sh DECODE_BINARY SCRATCH_DIR
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 DECODE_BINARY SCRATCH_DIR" >&2
    exit 2
fi
DECODE=$1
S=$2
rm -rf "$S"
mkdir -p "$S"
OUT="$S/stdout"
ERR="$S/stderr"
RC=0
# No run here may reach a device: a benchmark would start on a GPU machine.
export CUDA_VISIBLE_DEVICES=

fail() {
    echo "FAIL: $*" >&2
    if [[ -s $OUT ]]; then echo "--- stdout:" >&2; head -c 4000 "$OUT" >&2; fi
    if [[ -s $ERR ]]; then echo "--- stderr:" >&2; head -c 4000 "$ERR" >&2; fi
    exit 1
}

# expect STATUS ARGS...: runs decode with ARGS, checks its exit status.
expect() {
    local want=$1
    shift
    RC=0
    "$DECODE" "$@" >"$OUT" 2>"$ERR" || RC=$?
    if grep -q -E 'ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error:' "$ERR"; then
        fail "sanitizer report from: decode $*"
    fi
    [[ $RC -eq $want ]] || fail "'decode $*' exited $RC, expected $want"
}

# usage_error PATTERN ARGS...: exit 2, PATTERN on stderr, the usage after it, nothing on stdout.
usage_error() {
    local pattern=$1
    shift
    expect 2 "$@"
    grep -q -- "$pattern" "$ERR" || fail "'decode $*': no '$pattern' in the message"
    grep -q '^usage: decode' "$ERR" || fail "'decode $*': no usage"
    [[ ! -s $OUT ]] || fail "'decode $*' wrote to stdout"
}

# skipped BENCH ARGS...: exit 0 and exactly one JSON object on stdout, {"bench": BENCH, "skipped": ...}.
skipped() {
    local bench=$1
    shift
    expect 0 "$@"
    python3 - "$OUT" "$bench" <<'PY' || fail "'decode $*': not one skipped line of $bench"
import json, sys
lines = open(sys.argv[1]).read().splitlines()
assert len(lines) == 1, lines
d = json.loads(lines[0])
assert d["bench"] == sys.argv[2] and d["skipped"].startswith("no driver"), d
PY
}

expect 0 --help
for flag in --bench-prefill --shapes --iters --context; do
    grep -q -- "$flag" "$ERR" || fail "the usage does not mention $flag"
done

# --context: a list of counts.
for bad in "" 0 abc 1024, ,1024 1024,,4096 1024,x -1 +5 " 5" 1048577 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17; do
    usage_error "--context takes" --bench --context "$bad"
done
# --batch: a list of sizes.
for bad in "" 0 8, 1,,8 65536 1.5; do
    usage_error "--batch takes" --bench --batch "$bad"
done
# --shapes: SEQSxTOKENS, at most 2^20 tokens a shape.
for bad in "" 1x x512 512 1x512, ,1x512 1x512,,4x1024 0x512 1x0 1x512x2 1X512 2x1048576 1x1048577 65536x1 \
    ax512 1xb " 1x512"; do
    usage_error "--shapes takes" --bench-prefill --shapes "$bad"
done
usage_error "--iters takes" --bench-prefill --iters 0
usage_error "--layers takes" --bench-prefill --layers 0
# Options of one benchmark are refused by the other.
usage_error "separate runs" --bench --bench-prefill
usage_error "are --bench-prefill options" --bench --shapes 1x512
usage_error "are --bench-prefill options" --bench --iters 3
for opt in "--context 1024" "--batch 1" "--steps 3" "--chunk-file $S/chunk"; do
    # shellcheck disable=SC2086
    usage_error "are --bench options" --bench-prefill $opt
done
usage_error "lacks its value" --bench-prefill --shapes
usage_error "unknown option" --bench-prefill --no-such-option 1

# Good arguments, no device: one skipped line each.
skipped decode_step --bench --context 1024,4096,16384,32768 --batch 1,8
skipped decode_step --bench --context 1024
skipped prefill --bench-prefill
skipped prefill --bench-prefill --shapes 1x512,1x4096,4x1024,1x16384 --layers 2 --iters 3
skipped prefill --bench-prefill --shapes 1024x1024,1x1048576

echo "decode cli: all checks passed"
