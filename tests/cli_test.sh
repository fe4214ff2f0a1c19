#!/usr/bin/env bash
# Tests of the kiln command-line tool. Needs no GPU: prewarm compiles offline.
#   usage: cli_test.sh KILN_BINARY SCRATCH_DIR
# Each check prints what failed and exits 1.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 KILN_BINARY SCRATCH_DIR" >&2
    exit 2
fi
KILN=$1
S=$2
rm -rf "$S"
mkdir -p "$S"
# A default path must never be the user's own cache.
export KILN_CACHE_DIR="$S/default-cache-unused"
unset XDG_CACHE_HOME

OUT="$S/stdout"
ERR="$S/stderr"
RC=0

fail() {
    echo "FAIL: $*" >&2
    if [[ -s $OUT ]]; then echo "--- stdout:" >&2; head -c 4000 "$OUT" >&2; fi
    if [[ -s $ERR ]]; then echo "--- stderr:" >&2; head -c 4000 "$ERR" >&2; fi
    exit 1
}

# run CMD...: runs it with stdout in $OUT, stderr in $ERR and its status in $RC.
run() {
    RC=0
    "$@" >"$OUT" 2>"$ERR" || RC=$?
    if grep -q -E 'ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error:' "$ERR"; then
        fail "sanitizer report from: $*"
    fi
}

# expect STATUS CMD...: runs CMD and checks its exit status.
expect() {
    local want=$1
    shift
    run "$@"
    [[ $RC -eq $want ]] || fail "'$*' exited $RC, expected $want"
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

# Sets N_SPECS, N_COMPILED, N_CACHED, N_FAILED and SUMMARY_DB from prewarm's summary line in $OUT.
parse_summary() {
    local line
    line=$(grep '^summary: ' "$OUT" || true)
    [[ -n $line ]] || fail "no summary line in prewarm output"
    [[ $(grep -c '^summary: ' "$OUT") -eq 1 ]] || fail "more than one summary line"
    local re='([0-9]+) specializations, ([0-9]+) compiled, ([0-9]+) already cached, ([0-9]+) failed, [0-9.]+ s, database (.*)$'
    [[ $line =~ $re ]] || fail "summary line not in the documented format: $line"
    N_SPECS=${BASH_REMATCH[1]}
    N_COMPILED=${BASH_REMATCH[2]}
    N_CACHED=${BASH_REMATCH[3]}
    N_FAILED=${BASH_REMATCH[4]}
    SUMMARY_DB=${BASH_REMATCH[5]}
}

# json_eval EXPR: evaluates a Python expression over the JSON document in $OUT (bound to d).
json_eval() {
    python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
print(eval(sys.argv[2]))' "$OUT" "$1" || fail "output is not the expected JSON ($1)"
}

# ---- help, version, usage errors ----
expect 0 "$KILN" --help
grep -q '^usage: kiln' "$OUT" || fail "kiln --help prints no usage"
for cmd in prewarm ls stats; do
    expect 0 "$KILN" "$cmd" --help
    grep -q "^usage: kiln $cmd" "$OUT" || fail "kiln $cmd --help prints no usage"
    [[ ! -s $ERR ]] || fail "kiln $cmd --help wrote to stderr"
    expect 0 "$KILN" "$cmd" -h
    expect 2 "$KILN" "$cmd" --no-such-option
    grep -q -- '--no-such-option' "$ERR" || fail "kiln $cmd: the message does not name the unknown option"
    expect 2 "$KILN" "$cmd" stray-argument
done
expect 0 "$KILN" --version
grep -q -E '^kiln [0-9]+\.[0-9]+\.[0-9]+' "$OUT" || fail "kiln --version prints no version"
expect 2 "$KILN"
expect 2 "$KILN" no-such-command
grep -q 'no-such-command' "$ERR" || fail "the message does not name the unknown command"
expect 2 "$KILN" --no-such-option
for j in 0 257 -1 abc 4x ""; do
    expect 2 "$KILN" prewarm -j "$j" --db "$S/never.db"
done
expect 2 "$KILN" prewarm --db
[[ ! -e $S/never.db ]] || fail "a usage error created the database"

# ---- prewarm: a fresh database, then again ----
DB="$S/cache/kernels.db"
expect 0 "$KILN" prewarm --db "$DB" -j 2
parse_summary
[[ $N_SPECS -ge 1 ]] || fail "prewarm found no specializations"
[[ $N_COMPILED -eq $N_SPECS ]] || fail "fresh prewarm compiled $N_COMPILED of $N_SPECS"
[[ $N_CACHED -eq 0 && $N_FAILED -eq 0 ]] || fail "fresh prewarm: $N_CACHED cached, $N_FAILED failed"
[[ $SUMMARY_DB == "$DB" ]] || fail "summary names database '$SUMMARY_DB', expected '$DB'"
grep -q '^summary: model llama-3-8b (vocab_size 128256, hidden_size 4096,' "$OUT" ||
    fail "the summary does not describe the default model"
N=$N_SPECS
[[ $(grep -c -E '^[a-z0-9_]+ [A-Z0-9_=;]* compiled [0-9a-f]{16}$' "$OUT") -eq $N ]] ||
    fail "expected $N 'compiled' lines"
[[ -f $DB ]] || fail "prewarm did not create $DB"

expect 0 "$KILN" prewarm --db "$DB"
parse_summary
[[ $N_SPECS -eq $N ]] || fail "second prewarm: $N_SPECS specializations, first had $N"
[[ $N_COMPILED -eq 0 ]] || fail "second prewarm compiled $N_COMPILED kernels"
[[ $N_CACHED -eq $N ]] || fail "second prewarm: $N_CACHED already cached, expected $N"
[[ $(grep -c -E '^[a-z0-9_]+ [A-Z0-9_=;]* cached [0-9a-f]{16}$' "$OUT") -eq $N ]] ||
    fail "expected $N 'cached' lines"

# ---- ls and stats read without writing ----
BEFORE=$(sha "$DB")
expect 0 "$KILN" ls --db "$DB" --json
[[ $(json_eval 'len(d)') -eq $N ]] || fail "ls --json does not list $N entries"
[[ $(json_eval 'all(len(e["fingerprint"]) == 64 and e["arch"] == "sm_90" and e["raw_size"] > 0
                    and e["stored_size"] > 0 and e["template_id"] and "created" in e and "last_used" in e
                    and "hits" in e and "nvrtc_version" in e and "constants" in e for e in d)') == True ]] ||
    fail "ls --json entries lack fields"
expect 0 "$KILN" ls --db "$DB"
[[ $(grep -c -E '^[0-9a-f]{64} ' "$OUT") -eq $N ]] || fail "ls does not print $N rows"
expect 0 "$KILN" stats --db "$DB" --json
[[ $(json_eval 'd["entries"]') -eq $N ]] || fail "stats --json: entries is not $N"
[[ $(json_eval 'sum(t["entries"] for t in d["templates"].values())') -eq $N ]] ||
    fail "stats --json: per-template entries do not add up to $N"
[[ $(json_eval 'd["raw_bytes"] > 0 and d["stored_bytes"] > 0 and d["path"] != ""') == True ]] ||
    fail "stats --json: empty totals"
[[ $(json_eval '"token_embedding" in d["templates"]') == True ]] || fail "stats --json: no token_embedding"
expect 0 "$KILN" stats --db "$DB"
grep -q -E "^entries +$N\$" "$OUT" || fail "stats does not print 'entries $N'"
[[ $(sha "$DB") == "$BEFORE" ]] || fail "ls or stats changed the database"

# ---- bad configs: exit 1, the field named, the database untouched ----
cfg() { # cfg NAME JSON: writes $S/NAME.json
    printf '%s\n' "$2" >"$S/$1.json"
}
cfg not_json '{"vocab_size": 128256, "hidden_size": 4096,'
cfg no_hidden '{"vocab_size": 128256, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}'
cfg hidden_zero '{"vocab_size": 128256, "hidden_size": 0, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}'
cfg hidden_negative '{"vocab_size": 128256, "hidden_size": -4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}'
cfg vocab_absurd '{"vocab_size": 1e12, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}'
cfg kv_not_dividing '{"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 5}'
BAD_CASES=("not_json:JSON" "no_hidden:hidden_size" "hidden_zero:hidden_size" "hidden_negative:hidden_size"
           "vocab_absurd:vocab_size" "kv_not_dividing:num_key_value_heads")
BEFORE=$(sha "$DB")
for case in "${BAD_CASES[@]}"; do
    name=${case%%:*}
    field=${case#*:}
    expect 1 "$KILN" prewarm --model "$S/$name.json" --db "$DB"
    grep -q "$field" "$ERR" || fail "$name: stderr does not name $field"
    [[ $(sha "$DB") == "$BEFORE" ]] || fail "$name: the database changed"
    expect 1 "$KILN" prewarm --model "$S/$name.json" --db "$S/fresh-$name/kernels.db"
    grep -q "$field" "$ERR" || fail "$name: stderr does not name $field"
    [[ ! -e $S/fresh-$name ]] || fail "$name: a bad config created the database or its folder"
done
[[ $(grep -c "hidden_size = -4096" <(
    "$KILN" prewarm --model "$S/hidden_negative.json" --db "$DB" 2>&1 || true)) -eq 1 ]] ||
    fail "the message does not give the bad value"
expect 1 "$KILN" prewarm --model "$S/no-such-config.json" --db "$S/fresh-missing/kernels.db"
grep -q 'no-such-config.json' "$ERR" || fail "a missing config file is not named"
[[ ! -e $S/fresh-missing ]] || fail "a missing config created the database"

# ---- a bad architecture: exit 1 before the database is touched ----
expect 1 "$KILN" prewarm --arch sm_x --db "$S/fresh-arch/kernels.db"
grep -q 'sm_x' "$ERR" || fail "the message does not name the bad architecture"
[[ ! -e $S/fresh-arch ]] || fail "a bad architecture created the database"
expect 1 "$KILN" prewarm --arch sm_x --db "$DB"
[[ $(sha "$DB") == "$BEFORE" ]] || fail "a bad architecture changed the database"

# ---- another model: Qwen2.5-0.5B ----
cfg qwen '{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
  "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": true, "torch_dtype": "bfloat16"}'
expect 0 "$KILN" prewarm --model "$S/qwen.json" --db "$DB" -j 1
parse_summary
N_QWEN=$N_SPECS
[[ $N_QWEN -ge 1 && $N_COMPILED -eq $N_QWEN && $N_FAILED -eq 0 ]] ||
    fail "qwen prewarm: $N_COMPILED of $N_QWEN compiled, $N_FAILED failed"
grep -q 'vocab_size 151936, hidden_size 896, intermediate_size 4864, num_attention_heads 14, num_key_value_heads 2, head_dim 64' "$OUT" ||
    fail "the summary does not describe the qwen config"
expect 0 "$KILN" ls --db "$DB" --json
[[ $(json_eval 'len(d)') -eq $((N + N_QWEN)) ]] || fail "ls after qwen does not list $((N + N_QWEN)) entries"

# ---- processes sharing one new database ----
SHARED="$S/shared/kernels.db"
PIDS=()
for k in 1 2 3; do
    "$KILN" prewarm --db "$SHARED" -j 1 >"$S/concurrent$k.out" 2>"$S/concurrent$k.err" &
    PIDS+=($!)
done
"$KILN" prewarm --model "$S/qwen.json" --db "$SHARED" >"$S/concurrent4.out" 2>"$S/concurrent4.err" &
PIDS+=($!)
for k in 1 2 3 4; do
    RC=0
    wait "${PIDS[$((k - 1))]}" || RC=$?
    [[ $RC -eq 0 ]] || fail "concurrent prewarm $k exited $RC: $(cat "$S/concurrent$k.err")"
    ! grep -q -E 'Sanitizer|runtime error:' "$S/concurrent$k.err" || fail "sanitizer report from concurrent prewarm $k"
done
expect 0 "$KILN" ls --db "$SHARED" --json
[[ $(json_eval 'len(d)') -eq $((N + N_QWEN)) ]] || fail "concurrent prewarms left $(json_eval 'len(d)') entries"

# ---- the default path follows KILN_CACHE_DIR ----
KILN_CACHE_DIR="$S/envdir" expect 0 "$KILN" prewarm
parse_summary
[[ -f $S/envdir/kernels.db ]] || fail "KILN_CACHE_DIR: no $S/envdir/kernels.db"
[[ $SUMMARY_DB == "$S/envdir/kernels.db" ]] || fail "KILN_CACHE_DIR: summary names '$SUMMARY_DB'"
[[ $N_COMPILED -eq $N ]] || fail "KILN_CACHE_DIR: compiled $N_COMPILED of $N"
KILN_CACHE_DIR="$S/envdir" expect 0 "$KILN" stats --json
[[ $(json_eval 'd["entries"]') -eq $N ]] || fail "stats with KILN_CACHE_DIR: entries is not $N"

# ---- a missing database: ls and stats fail and create nothing ----
for cmd in ls stats; do
    expect 1 "$KILN" "$cmd" --db "$S/missing/kernels.db"
    grep -q "$S/missing/kernels.db" "$ERR" || fail "$cmd: the message does not name the missing database"
    [[ ! -e $S/missing ]] || fail "$cmd created a database"
    KILN_CACHE_DIR="$S/missing-env" expect 1 "$KILN" "$cmd"
    [[ ! -e $S/missing-env ]] || fail "$cmd created the default database"
done
[[ ! -e $S/default-cache-unused ]] || fail "a command wrote to the default cache without being asked"

echo "cli: all checks passed (default model: $N specializations, qwen2: $N_QWEN)"
