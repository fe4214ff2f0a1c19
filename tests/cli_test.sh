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
for cmd in prewarm ls stats verify gc export merge explain ls-ops; do
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
[[ ! -s $ERR ]] || fail "prewarm wrote to stderr without a terminal (progress belongs to terminals only)"

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

# ---- real configs as the hub ships them (tests/data): each listed, one compiled ----
DATA="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/data"
DRY_RE='^dry run: model [a-z0-9_]+ \(.*, dtype (f16|bf16)\), arch sm_90: ([0-9]+) specializations$'
# dry_summary: sets DRY_DTYPE and DRY_N from the dry run's summary in $OUT; checks its lines.
dry_summary() {
    local line
    line=$(tail -n 1 "$OUT")
    [[ $line =~ $DRY_RE ]] || fail "dry run summary not in the documented format: $line"
    DRY_DTYPE=${BASH_REMATCH[1]}
    DRY_N=${BASH_REMATCH[2]}
    [[ $DRY_N -ge 1 && $(grep -c -E '^[a-z0-9_]+ [A-Z0-9_=;]* [0-9a-f]{16}$' "$OUT") -eq $DRY_N ]] ||
        fail "dry run: expected $DRY_N specialization lines"
}
for name in llama-3.1-8b llama-3.2-1b qwen2.5-7b qwen3-8b mistral-7b-v0.3; do
    expect 0 "$KILN" prewarm --dry-run --model "$DATA/$name.json" --arch sm_90 --db "$S/dry/kernels.db"
    dry_summary
    [[ $DRY_DTYPE == bf16 ]] || fail "$name: dtype $DRY_DTYPE, the config says bfloat16"
    [[ ! -e $S/dry ]] || fail "a dry run created $S/dry"
    N_BF16=$DRY_N
    expect 0 "$KILN" prewarm -n --dtype f16 --model "$DATA/$name.json" --arch sm_90
    dry_summary
    [[ $DRY_DTYPE == f16 && $DRY_N -eq $N_BF16 ]] || fail "$name --dtype f16: dtype $DRY_DTYPE, $DRY_N specializations"
done
# Devices without wgmma compile a whole model: the mma.sync prefill, and before sm_90 the one-block
# argmax (no clusters).
for arch in sm_80 sm_86 sm_89 sm_120; do
    expect 0 "$KILN" prewarm --model "$DATA/qwen2.5-7b.json" --arch $arch --db "$S/arch-$arch/kernels.db" -j 2
    parse_summary
    [[ $N_SPECS -ge 1 && $N_COMPILED -eq $N_SPECS && $N_FAILED -eq 0 ]] ||
        fail "Qwen2.5-7B for $arch: $N_COMPILED of $N_SPECS compiled, $N_FAILED failed"
    expect 0 "$KILN" prewarm -n --model "$DATA/qwen2.5-7b.json" --arch $arch
    grep -q -E '^paged_prefill_mma ' "$OUT" || fail "$arch lists no mma.sync prefill"
    [[ $arch == sm_120 ]] || grep -q -E '^masked_argmax BF16=1;CLUSTER=1;' "$OUT" || fail "$arch lists no one-block argmax"
done
# Turing (sm_75) compiles an f16 model; bf16 there is refused whole, the model named once.
expect 0 "$KILN" prewarm --dtype f16 --arch sm_75 --db "$S/arch-sm_75/kernels.db" -j 2
parse_summary
[[ $N_SPECS -ge 1 && $N_COMPILED -eq $N_SPECS && $N_FAILED -eq 0 ]] ||
    fail "the default model for sm_75: $N_COMPILED of $N_SPECS compiled, $N_FAILED failed"
expect 1 "$KILN" prewarm --dtype bf16 --arch sm_75 --db "$S/arch-sm_75/kernels.db"
grep -q -x "kiln prewarm: model llama-3-8b: bf16 needs sm_80 or later, and the arch is sm_75 (f16 runs there)" "$ERR" ||
    fail "prewarm of bf16 for sm_75 is not one clear refusal"
# Mixtures of experts (Qwen3-30B-A3B, Mixtral-8x7B): the router and the routed experts at the config's
# sizes, named in the summary; no dense SwiGLU (neither has a shared expert).
for spec in "qwen3-30b-a3b:EXPERTS=128;NORMALIZE=1;TOP_K=8:EXPERTS=128;HIDDEN=2048;INTER=768;TOP_K=8:128 experts (8 a token, 768 wide)" \
    "mixtral-8x7b-v0.1:EXPERTS=8;NORMALIZE=1;TOP_K=2:EXPERTS=8;HIDDEN=4096;INTER=14336;TOP_K=2:8 experts (2 a token, 14336 wide)"; do
    IFS=: read -r name router experts described <<<"$spec"
    expect 0 "$KILN" prewarm -n --model "$DATA/$name.json" --arch sm_90
    dry_summary
    grep -q -E "^moe_router BF16=1;$router [0-9a-f]{16}\$" "$OUT" || fail "$name: no moe_router $router"
    grep -q -E "^moe_experts BF16=1;$experts [0-9a-f]{16}\$" "$OUT" || fail "$name: no moe_experts $experts"
    grep -q -E '^(swiglu|tma_swiglu) ' "$OUT" && fail "$name lists a dense SwiGLU it never runs"
    grep -q -F "$described" "$OUT" || fail "$name: the summary does not describe its experts"
done
# Qwen3's q/k norm adds the per-head norm (of its head_dim, heads and kv_heads); Qwen2.5 has none.
expect 0 "$KILN" prewarm -n --model "$DATA/qwen3-8b.json" --arch sm_90
grep -q -E '^head_rms_norm BF16=1;HEADS=32;HEAD_DIM=128;KV_HEADS=8;THREADS=128;VEC=8 [0-9a-f]{16}$' "$OUT" ||
    fail "Qwen3-8B's dry run does not list head_rms_norm"
expect 0 "$KILN" prewarm -n --model "$DATA/qwen2.5-7b.json" --arch sm_90
grep -q '^head_rms_norm ' "$OUT" && fail "Qwen2.5-7B (no q/k norm) lists head_rms_norm"
# Llama-3.1-8B is the built-in shape: its scaled RoPE changes no kernel key.
expect 0 "$KILN" prewarm -n --arch sm_90
cp "$OUT" "$S/dry-default.out"
expect 0 "$KILN" prewarm -n --dtype f16 --model "$DATA/llama-3.1-8b.json" --arch sm_90
diff <(grep -v '^dry run' "$S/dry-default.out") <(grep -v '^dry run' "$OUT") >/dev/null ||
    fail "Llama-3.1-8B in f16 lists other kernels than the built-in Llama-3-8B shape"
expect 2 "$KILN" prewarm --dtype f32
grep -q -- '--dtype f32: must be f16 or bf16' "$ERR" || fail "--dtype f32 was not refused by name"
cfg f32 '{"vocab_size": 1000, "hidden_size": 512, "intermediate_size": 128, "num_attention_heads": 4, "torch_dtype": "float32"}'
expect 1 "$KILN" prewarm -n --model "$S/f32.json"
grep -q 'torch_dtype = "float32"' "$ERR" && grep -q -- '--dtype' "$ERR" || fail "a float32 config was not refused clearly"
expect 0 "$KILN" prewarm -n --dtype bf16 --model "$S/f32.json"
# One compiled in full: Llama-3.2-1B (tied embeddings, head_dim 64).
expect 0 "$KILN" prewarm --model "$DATA/llama-3.2-1b.json" --arch sm_90 --db "$S/real/kernels.db" -j 2
parse_summary
[[ $N_SPECS -ge 1 && $N_COMPILED -eq $N_SPECS && $N_FAILED -eq 0 ]] ||
    fail "Llama-3.2-1B prewarm: $N_COMPILED of $N_SPECS compiled, $N_FAILED failed"
grep -q '^summary: model llama (vocab_size 128256, hidden_size 2048, .*head_dim 64, dtype bf16), arch sm_90' "$OUT" ||
    fail "the summary does not describe Llama-3.2-1B in bf16"
expect 0 "$KILN" prewarm --model "$DATA/llama-3.2-1b.json" --arch sm_90 --db "$S/real/kernels.db"
parse_summary
[[ $N_CACHED -eq $N_SPECS && $N_COMPILED -eq 0 ]] || fail "Llama-3.2-1B again: $N_COMPILED compiled"

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

# ---- prewarm shows progress on a terminal only ----
if command -v script >/dev/null; then
    RC=0
    script -qec "'$KILN' prewarm --db '$S/tty.db' -j 2 >'$S/tty.out'" /dev/null >"$S/tty.term" 2>&1 || RC=$?
    [[ $RC -eq 0 ]] || fail "prewarm on a terminal exited $RC: $(cat "$S/tty.term")"
    grep -q -a -E "\[$N/$N\] [0-9.]+ kernels/s, ETA" "$S/tty.term" || fail "no progress line on a terminal"
    [[ $(grep -c -E ' compiled [0-9a-f]{16}$' "$S/tty.out") -eq $N ]] || fail "progress changed prewarm's stdout"
fi

# py SCRIPT DB...: runs Python with sqlite3 imported and the databases in sys.argv[1:].
py() {
    local script=$1
    shift
    python3 -c "import sqlite3, sys, time
$script" "$@" || fail "python: $script"
}

# ls_fps DB: the database's fingerprints, sorted, one a line.
ls_fps() {
    "$KILN" ls --db "$1" --json >"$S/ls.json" || fail "ls --db $1 failed"
    python3 -c 'import json, sys
print("\n".join(sorted(e["fingerprint"] for e in json.load(open(sys.argv[1])))))' "$S/ls.json"
}

# ---- export: a new database of exactly one model's kernels ----
mkdir -p "$S/ship"
EXP="$S/ship/llama.kiln.db"
expect 2 "$KILN" export --db "$S/ship/x.db"
expect 2 "$KILN" export
grep -q -- '-o' "$ERR" || fail "export without -o does not ask for it"
expect 1 "$KILN" export --model "$S/hidden_zero.json" -o "$S/ship/bad.db"
grep -q hidden_size "$ERR" || fail "export: a bad config is not named"
[[ ! -e $S/ship/bad.db ]] || fail "export of a bad config created its output"
expect 1 "$KILN" export --arch sm_x -o "$S/ship/bad.db"
[[ ! -e $S/ship/bad.db ]] || fail "export for a bad architecture created its output"
KILN_CACHE_READONLY="$DB" expect 0 "$KILN" export -o "$EXP" -j 2
parse_summary
[[ $N_SPECS -eq $N && $N_COMPILED -eq $N && $N_FAILED -eq 0 ]] ||
    fail "export: $N_COMPILED of $N_SPECS compiled (a read-only layer must not stand in for the output)"
grep -q "^verified $EXP: $N rows, 0 bad, integrity ok\$" "$OUT" || fail "export did not verify its output"
grep -q "^export $EXP: $N kernels\$" "$OUT" || fail "export: no final line"
[[ ! -e $EXP-wal && ! -e $EXP-shm ]] || fail "export left -wal or -shm files beside its output"
grep -E ' compiled [0-9a-f]{16}$' "$OUT" | awk '{print $NF}' | sort >"$S/export.prefixes"
[[ $(ls_fps "$EXP" | cut -c1-16 | sort | tr '\n' ' ') == "$(tr '\n' ' ' <"$S/export.prefixes")" ]] ||
    fail "export does not hold exactly the model's kernels"
[[ $(python3 -c 'import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute("PRAGMA journal_mode").fetchone()[0])' "$EXP") == delete ]] ||
    fail "export did not seal its output (journal mode is not delete)"
expect 0 "$KILN" ls --db "$EXP"
[[ ! -e $EXP-wal && ! -e $EXP-shm ]] || fail "reading a sealed export left -wal or -shm files beside it"
BEFORE=$(sha "$EXP")
expect 1 "$KILN" export -o "$EXP"
grep -q 'exists' "$ERR" || fail "export over an existing file: the message does not say it exists"
[[ $(sha "$EXP") == "$BEFORE" ]] || fail "export over an existing file changed it"
QEXP="$S/ship/qwen.kiln.db"
expect 0 "$KILN" export --model "$S/qwen.json" -o "$QEXP"
[[ $(ls_fps "$QEXP" | wc -l) -eq $N_QWEN ]] || fail "qwen export does not hold $N_QWEN kernels"

# ---- verify ----
expect 0 "$KILN" verify --db "$EXP"
grep -q "^verified $EXP: $N rows, 0 bad, integrity ok\$" "$OUT" || fail "verify of a good database: $(cat "$OUT")"
[[ $(sha "$EXP") == "$BEFORE" ]] || fail "verify changed the database"
expect 1 "$KILN" verify --db "$S/missing/kernels.db"
[[ ! -e $S/missing ]] || fail "verify created a database"
BAD="$S/ship/bad-rows.db"
cp "$EXP" "$BAD"
# One row with a wrong checksum, one with a byte flipped inside its zstd frame.
read -r BAD1 BAD2 < <(py '
db = sqlite3.connect(sys.argv[1])
rows = db.execute("SELECT fingerprint, cubin FROM kernels ORDER BY fingerprint").fetchall()
a, b = rows[1], rows[-1]
db.execute("UPDATE kernels SET checksum = zeroblob(32) WHERE fingerprint = ?", (a[0],))
blob = bytearray(b[1]); blob[len(blob) // 2] ^= 0x5a
db.execute("UPDATE kernels SET cubin = ? WHERE fingerprint = ?", (bytes(blob), b[0]))
db.commit()
print(a[0].hex(), b[0].hex())' "$BAD")
expect 1 "$KILN" verify --db "$BAD"
[[ $(grep -c '^bad ' "$OUT") -eq 2 ]] || fail "verify does not list exactly the 2 bad rows"
grep -q "^bad $BAD1 .*checksum" "$OUT" || fail "verify does not list the row with a wrong checksum ($BAD1)"
grep -q "^bad $BAD2 " "$OUT" || fail "verify does not list the row with a flipped byte ($BAD2)"
grep -q "^verified $BAD: $N rows, 2 bad, integrity ok\$" "$OUT" || fail "verify: no summary of the bad database"
grep -q '2 of' "$ERR" || fail "verify: stderr does not count the bad rows"
grep -q "^keys $EXP: $N of $N recomputed" <("$KILN" verify --db "$EXP") || fail "verify does not recompute every key"
# Two rows' keys swapped: each passes its checksum under the other's key.
# verify names both; prewarm (the jit checks a row is of its key's kernel)
# drops and compiles them again.
SWAPK="$S/ship/swapped-keys.db"
cp "$EXP" "$SWAPK"
read -r KEY1 KEY2 < <(py '
db = sqlite3.connect(sys.argv[1])
a, b = [r[0] for r in db.execute("SELECT fingerprint FROM kernels ORDER BY fingerprint LIMIT 2")]
for old, new in ((a, bytes(32)), (b, a), (bytes(32), b)):
    db.execute("UPDATE kernels SET fingerprint = ? WHERE fingerprint = ?", (new, old))
db.commit()
print(a.hex(), b.hex())' "$SWAPK")
expect 1 "$KILN" verify --db "$SWAPK"
for k in "$KEY1" "$KEY2"; do
    grep -q "^bad $k the key is not the fingerprint of the row's kernel" "$OUT" ||
        fail "verify does not see the swapped key $k"
done
grep -q "^verified $SWAPK: $N rows, 2 bad, integrity ok\$" "$OUT" || fail "verify: swapped keys not counted"
expect 0 "$KILN" prewarm --db "$SWAPK"
[[ $(grep -c ' compiled ' "$OUT") -eq 2 ]] || fail "prewarm over two swapped keys did not compile exactly those two"
expect 0 "$KILN" verify --db "$SWAPK"
# Signed layers (kiln sign, verify's signature line, $KILN_TRUSTED_KEYS), with
# keys from the openssl tool when there is one.
if command -v openssl >/dev/null; then
    SG="$S/sign"
    mkdir -p "$SG"
    for k in a b; do
        openssl genpkey -algorithm ed25519 -out "$SG/$k.pem" 2>/dev/null
        openssl pkey -in "$SG/$k.pem" -pubout -out "$SG/$k.pub" 2>/dev/null
    done
    # A key's id: SHA-256 of the raw public key, the last 32 bytes of its DER.
    KEYA=$(openssl pkey -pubin -in "$SG/a.pub" -outform DER 2>/dev/null | tail -c 32 | sha256sum | cut -c1-64)
    KEYB=$(openssl pkey -pubin -in "$SG/b.pub" -outform DER 2>/dev/null | tail -c 32 | sha256sum | cut -c1-64)
    SIGNED="$SG/signed.db"
    cp "$EXP" "$SIGNED"
    expect 2 "$KILN" sign "$SIGNED"
    grep -q -- '--key' "$ERR" || fail "sign without a key does not ask for one"
    expect 2 "$KILN" sign --key "$SG/a.pem"
    expect 1 "$KILN" sign --key "$SG/a.pub" "$SIGNED"
    grep -q 'not a PEM private key' "$ERR" || fail "sign with a public key: $(cat "$ERR")"
    expect 0 "$KILN" sign --key "$SG/a.pem" "$SIGNED"
    grep -q "^verified $SIGNED: $N rows, 0 bad, integrity ok\$" "$OUT" || fail "sign did not verify first"
    grep -q "^signed $SIGNED: $N rows, key $KEYA\$" "$OUT" || fail "sign: no final line naming key $KEYA"
    [[ ! -e $SIGNED-wal && ! -e $SIGNED-shm ]] || fail "sign did not seal the database"
    expect 0 "$KILN" verify --db "$SIGNED"
    grep -q "^signature $SIGNED: valid, key $KEYA, $N rows as signed\$" "$OUT" || fail "verify of a signed database"
    KILN_TRUSTED_KEYS="$SG/b.pub:$SG/a.pub" expect 0 "$KILN" verify --db "$SIGNED"
    grep -q "^signature $SIGNED: valid, key $KEYA, $N rows as signed, trusted\$" "$OUT" || fail "verify: key not trusted"
    KILN_TRUSTED_KEYS="$SG/b.pub" expect 1 "$KILN" verify --db "$SIGNED"
    grep -q ", not trusted\$" "$OUT" && grep -q 'would be skipped' "$ERR" || fail "verify: an unlisted key passes"
    expect 0 "$KILN" verify --db "$EXP"
    grep -q "^signature $EXP: unsigned\$" "$OUT" || fail "verify of an unsigned database: $(cat "$OUT")"
    KILN_TRUSTED_KEYS="$SG/a.pub" expect 1 "$KILN" verify --db "$EXP"
    grep -q 'unsigned: under this trust policy' "$ERR" || fail "verify: unsigned under a policy passes"
    # A planted entry: two rows' cubins swapped with their checksums and
    # sizes, so that every checksum and key still verifies.
    PLANT="$SG/planted.db"
    cp "$SIGNED" "$PLANT"
    py '
db = sqlite3.connect(sys.argv[1])
a, b = db.execute("SELECT fingerprint, cubin, checksum, raw_size FROM kernels ORDER BY fingerprint LIMIT 2").fetchall()
for x, y in ((a, b), (b, a)):
    db.execute("UPDATE kernels SET cubin = ?, checksum = ?, raw_size = ? WHERE fingerprint = ?", (y[1], y[2], y[3], x[0]))
db.commit()' "$PLANT"
    expect 1 "$KILN" verify --db "$PLANT"
    grep -q "^verified $PLANT: $N rows, 0 bad, integrity ok\$" "$OUT" || fail "planted rows fail their checksums"
    [[ $(grep -c "^bad .*not the one the layer's manifest signed" "$OUT") -eq 2 ]] ||
        fail "verify does not name the 2 planted rows"
    grep -q "^signature $PLANT: invalid: 2 of $N rows are not as signed\$" "$OUT" || fail "verify: planted rows pass"
    # Without a policy the planted layer serves both (what a checksum trusts);
    # with one those two are compiled instead, and another key's layer is skipped.
    KILN_CACHE_READONLY="$PLANT" expect 0 "$KILN" prewarm --db "$SG/w0.db"
    parse_summary
    [[ $N_COMPILED -eq 0 ]] || fail "prewarm without a policy compiled $N_COMPILED over a full layer"
    KILN_TRUSTED_KEYS="$SG/a.pub" KILN_CACHE_READONLY="$PLANT" expect 0 "$KILN" prewarm --db "$SG/w1.db"
    parse_summary
    [[ $N_COMPILED -eq 2 ]] || fail "prewarm under a policy compiled $N_COMPILED, not the 2 planted kernels"
    expect 0 "$KILN" sign --key "$SG/b.pem" "$PLANT"
    KILN_TRUSTED_KEYS="$SG/a.pub" KILN_CACHE_READONLY="$PLANT" expect 0 "$KILN" prewarm --db "$SG/w2.db"
    grep -q "read-only layer $PLANT skipped: signed by key $KEYB" "$ERR" || fail "prewarm: a layer of key B not skipped"
    parse_summary
    [[ $N_COMPILED -eq $N ]] || fail "prewarm used $((N - N_COMPILED)) kernels of an untrusted layer"
else
    echo "note: no openssl tool: the kiln sign lines are skipped (tests/test_cache_sign.c covers signing)" >&2
fi

# ---- merge ----
MERGED="$S/ship/merged.db"
expect 2 "$KILN" merge -o "$MERGED"
expect 2 "$KILN" merge "$EXP"
expect 0 "$KILN" merge "$EXP" "$QEXP" -o "$MERGED"
# Each export holds its kernels and its coverage record: rows of both kinds are counted.
grep -q "^merged $EXP: $((N + 1)) copied, 0 skipped\$" "$OUT" || fail "merge: no line for $EXP"
grep -q "^merged $QEXP: $((N_QWEN + 1)) copied, 0 skipped\$" "$OUT" || fail "merge: no line for $QEXP"
[[ $(ls_fps "$MERGED") == "$( (ls_fps "$EXP"; ls_fps "$QEXP") | sort -u)" ]] || fail "merge is not the union"
expect 1 "$KILN" merge "$EXP" -o "$MERGED"
grep -q 'exists' "$ERR" || fail "merge over an existing file: the message does not say it exists"
expect 1 "$KILN" merge "$EXP" "$S/qwen.json" -o "$S/ship/foreign.db"
grep -q 'not a kiln' "$ERR" || fail "merge of a JSON file: the message does not say it is not a kiln database"
[[ ! -e $S/ship/foreign.db ]] || fail "a failed merge left its output"
py 'db = sqlite3.connect(sys.argv[1]); db.execute("CREATE TABLE kernels (x)"); db.commit()' "$S/ship/other-app.db"
expect 1 "$KILN" merge "$S/ship/other-app.db" -o "$S/ship/foreign.db"
grep -q 'not a kiln' "$ERR" || fail "merge of another application's database is not refused"
expect 1 "$KILN" merge "$S/ship/none.db" -o "$S/ship/foreign.db"
[[ ! -e $S/ship/foreign.db && ! -e $S/ship/none.db ]] || fail "merge of a missing source created a file"
expect 0 "$KILN" merge "$BAD" -o "$S/ship/repaired.db"
# N - 2 kernels and the coverage record.
grep -q "^merged $BAD: $((N - 2 + 1)) copied, 2 skipped\$" "$OUT" || fail "merge does not skip the 2 bad rows"
grep -q 'failed verification' "$ERR" || fail "merge does not report skipped rows on stderr"
FPS=$(ls_fps "$S/ship/repaired.db")
grep -q -e "$BAD1" -e "$BAD2" <<<"$FPS" && fail "merge copied a bad row"

# ---- gc ----
GC="$S/ship/gc.db"
expect 2 "$KILN" gc --db "$EXP"
for bad in 0 -5 abc 4X 1.5 ""; do
    expect 2 "$KILN" gc --db "$EXP" --max-bytes "$bad"
done
for bad in 0 -1 abc 1e9; do
    expect 2 "$KILN" gc --db "$EXP" --older-than "$bad"
done
expect 1 "$KILN" gc --db "$S/missing/kernels.db" --max-bytes 1
[[ ! -e $S/missing ]] || fail "gc created a database"
# Least recently used first: last use in reverse fingerprint order, so the
# order gc follows is not the table's own.
cp "$EXP" "$GC"
read -r LIMIT LRU1 LRU2 < <(py '
db = sqlite3.connect(sys.argv[1])
rows = db.execute("SELECT fingerprint, length(cubin) FROM kernels ORDER BY fingerprint DESC").fetchall()
for i, (fp, _) in enumerate(rows):
    db.execute("UPDATE kernels SET last_used = ? WHERE fingerprint = ?", (1000 + i, fp))
db.commit()
total = sum(n for _, n in rows)
print(total - rows[0][1] - rows[1][1] + 1, rows[0][0].hex(), rows[1][0].hex())' "$GC")
expect 0 "$KILN" gc --db "$GC" --max-bytes "$LIMIT"
grep -q "^gc $GC: removed 2 rows" "$OUT" || fail "gc --max-bytes did not remove the 2 least recently used rows"
[[ $(ls_fps "$GC" | wc -l) -eq $((N - 2)) ]] || fail "gc --max-bytes left the wrong number of rows"
FPS=$(ls_fps "$GC")
grep -q -e "$LRU1" -e "$LRU2" <<<"$FPS" && fail "gc --max-bytes kept a least recently used row"
expect 0 "$KILN" gc --db "$GC" --max-bytes "$LIMIT"
grep -q "^gc $GC: removed 0 rows" "$OUT" || fail "a second gc removed more"
expect 0 "$KILN" gc --db "$GC" --max-bytes 1K
py 'db = sqlite3.connect(sys.argv[1]); assert db.execute("SELECT total(length(cubin)) FROM kernels").fetchone()[0] <= 1024' "$GC"
# --older-than: three rows unused for ten days, the rest used now.
cp "$EXP" "$GC"
read -r OLD < <(py '
db = sqlite3.connect(sys.argv[1])
now = int(time.time())
fps = [r[0] for r in db.execute("SELECT fingerprint FROM kernels ORDER BY fingerprint")]
db.execute("UPDATE kernels SET last_used = ?", (now,))
for fp in fps[:3]:
    db.execute("UPDATE kernels SET last_used = ? WHERE fingerprint = ?", (now - 10 * 86400, fp))
db.commit()
print(" ".join(fp.hex() for fp in fps[:3]))' "$GC")
expect 0 "$KILN" gc --db "$GC" --older-than 7
grep -q "^gc $GC: removed 3 rows" "$OUT" || fail "gc --older-than 7 did not remove the 3 old rows"
FPS=$(ls_fps "$GC")
for fp in $OLD; do
    grep -q "$fp" <<<"$FPS" && fail "gc --older-than kept the old row $fp"
done
[[ $(ls_fps "$GC" | wc -l) -eq $((N - 3)) ]] || fail "gc --older-than removed recent rows"
expect 0 "$KILN" verify --db "$GC"
# gc on a full disk (a small tmpfs: root only, skipped without): a database
# made without auto_vacuum keeps its size and gc says so, the rows deleted,
# with the remedy (exit 1); one kiln made shrinks.
FULL="$S/full-disk"
mkdir -p "$FULL"
if mount -t tmpfs -o size=1m tmpfs "$FULL" 2>/dev/null; then
    trap 'umount -l "$FULL" 2>/dev/null || true' EXIT
    cp "$EXP" "$FULL/legacy.db"
    cp "$EXP" "$FULL/new.db"
    py 'db = sqlite3.connect(sys.argv[1]); db.execute("PRAGMA auto_vacuum=NONE"); db.execute("VACUUM")' "$FULL/legacy.db"
    dd if=/dev/zero of="$FULL/filler" bs=4k 2>/dev/null || true
    truncate -s -40K "$FULL/filler"
    SIZE0=$(stat -c %s "$FULL/legacy.db")
    expect 1 "$KILN" gc --db "$FULL/legacy.db" --max-bytes 1K
    grep -q "^gc $FULL/legacy.db: removed [1-9][0-9]* rows" "$OUT" || fail "gc on a full disk: no line of the rows removed"
    grep -q "could not shrink" "$ERR" && grep -q "kiln merge $FULL/legacy.db" "$ERR" ||
        fail "gc on a full disk does not say that the file could not shrink, with the remedy"
    [[ $(stat -c %s "$FULL/legacy.db") -eq $SIZE0 ]] || fail "gc on a full disk: the file changed size"
    SIZE0=$(stat -c %s "$FULL/new.db")
    expect 0 "$KILN" gc --db "$FULL/new.db" --max-bytes 1K
    [[ $(stat -c %s "$FULL/new.db") -lt $((SIZE0 / 2)) ]] || fail "gc on a full disk did not shrink the file"
    expect 0 "$KILN" verify --db "$FULL/new.db"
    umount "$FULL"
    trap - EXIT
else
    echo "cli: gc on a full disk skipped: cannot mount a tmpfs"
fi

# ---- explain: why a lookup would miss ----
expect 2 "$KILN" explain --db "$EXP"
grep -q -- '--op' "$ERR" || fail "explain without --op does not ask for it"
expect 1 "$KILN" explain --db "$EXP" --op no_such_op
grep -q 'rms_norm' "$ERR" || fail "explain of an unknown op does not list the model's ops"
expect 1 "$KILN" explain --db "$S/missing/kernels.db" --op rms_norm
[[ ! -e $S/missing ]] || fail "explain created a database"
expect 0 "$KILN" explain --db "$EXP" --op paged_attention
[[ $(grep -c -E '^paged_attention [A-Z0-9_=;]+ hit [0-9a-f]{64}$' "$OUT") -ge 1 ]] || fail "explain: no hit for paged_attention"
! grep -q ' miss ' "$OUT" || fail "explain: a miss in the model's own export"
expect 0 "$KILN" explain --db "$EXP" --op rms_norm --arch sm_80
grep -q -E '^rms_norm .* miss [0-9a-f]{64} nearest [0-9a-f]{64} differs: arch sm_90 -> sm_80$' "$OUT" ||
    fail "explain across architectures does not name the arch"
expect 0 "$KILN" explain --db "$QEXP" --op rms_norm
grep -q -E '^rms_norm .* miss .* differs: constants BF16=1;HIDDEN=896;[^,]* -> BF16=0;HIDDEN=4096;' "$OUT" ||
    fail "explain across models does not name the constants"
grep -q -E 'differs:.*(source|headers|options|arch|nvrtc) ' "$OUT" && fail "explain across models names parts that agree"
# The template's source changed since the row was stored: only its digest differs.
STALE="$S/ship/stale.db"
cp "$EXP" "$STALE"
py '
db = sqlite3.connect(sys.argv[1])
fp, parts = db.execute("SELECT fingerprint, parts FROM kernels WHERE template_id = ?", ("rms_norm",)).fetchone()
fields = parts.split(";")
fields = ["source=0123456789abcdef" if f.startswith("source=") else f for f in fields]
db.execute("UPDATE kernels SET fingerprint = ?, parts = ? WHERE fingerprint = ?", (bytes(32), ";".join(fields), fp))
db.commit()' "$STALE"
expect 0 "$KILN" explain --db "$STALE" --op rms_norm
grep -q -E "^rms_norm .* miss [0-9a-f]{64} nearest 0{64} differs: source 0123456789abcdef -> [0-9a-f]{16}\$" "$OUT" ||
    fail "explain does not single out the source digest"

# An operation id selects each of its templates' kernels.
expect 0 "$KILN" explain --db "$EXP" --op dense_swiglu
grep -q -E '^swiglu [A-Z0-9_=;]+ hit [0-9a-f]{64}$' "$OUT" || fail "explain of an operation id: no swiglu kernel"
grep -q -E '^skinny_linear [A-Z0-9_=;]+ hit ' "$OUT" || fail "explain of an operation id: no skinny_linear kernel"
grep -q -v -E '^(swiglu|tma_swiglu|skinny_linear) ' "$OUT" && fail "explain of an operation id lists another template"
# Qwen3's per-head norm, which the Llama export does not hold.
expect 0 "$KILN" explain --db "$EXP" --model "$DATA/qwen3-8b.json" --op head_rms_norm
grep -q -E '^head_rms_norm BF16=1;HEADS=32;HEAD_DIM=128;KV_HEADS=8;THREADS=128;VEC=8 miss [0-9a-f]{64} nearest ' "$OUT" ||
    fail "explain does not show Qwen3-8B's head_rms_norm as missing from the Llama export"

# ---- check: every kernel a model needs is in the databases (nothing to compile) ----
CK="$S/check"
mkdir -p "$CK"
cp "$QEXP" "$CK/full.db"
expect 0 "$KILN" prewarm --model "$S/qwen.json" --db "$CK/full.db"
parse_summary
[[ $N_COMPILED -eq 0 ]] || fail "prewarm over the qwen export compiled $N_COMPILED kernels"
BEFORE=$(sha "$CK/full.db")
expect 0 "$KILN" check --model "$S/qwen.json" --db "$CK/full.db"
grep -q -E "^summary: model qwen2, arch sm_90: $N_QWEN needed, $N_QWEN present, 0 missing, database .*full\.db, 0 layers\$" "$OUT" ||
    fail "check of a complete database: the summary is not '$N_QWEN needed, $N_QWEN present, 0 missing'"
[[ $(wc -l <"$OUT") -eq 1 ]] || fail "check of a complete database lists kernels"
[[ $(sha "$CK/full.db") == "$BEFORE" ]] || fail "check changed the database"
expect 0 "$KILN" check --help
grep -q 'KILN_CACHE_READONLY' "$OUT" || fail "check --help does not name the read-only layers"
# One row deleted: exactly that kernel is missing, with explain's reason.
cp "$CK/full.db" "$CK/partial.db"
GONE=$(py '
db = sqlite3.connect(sys.argv[1])
fp, = db.execute("SELECT fingerprint FROM kernels WHERE template_id = ? LIMIT 1", ("rms_norm",)).fetchone()
db.execute("DELETE FROM kernels WHERE fingerprint = ?", (fp,))
db.commit()
print(fp.hex())' "$CK/partial.db")
expect 1 "$KILN" check --model "$S/qwen.json" --db "$CK/partial.db"
grep -q -E "^rms_norm [A-Z0-9_=;]+ missing $GONE nearest [0-9a-f]{64} differs: " "$OUT" ||
    fail "check does not name the deleted rms_norm kernel $GONE with its nearest row"
[[ $(grep -c ' missing ' "$OUT") -eq 1 ]] || fail "check lists kernels other than the deleted one as missing"
grep -q -E ": $N_QWEN needed, $((N_QWEN - 1)) present, 1 missing," "$OUT" || fail "check's summary does not count one missing"
grep -q "1 of $N_QWEN kernels are missing" "$ERR" || fail "check does not say on stderr what is missing"
# A read-only layer fills the gap, as it would for a server.
KILN_CACHE_READONLY="$CK/full.db" expect 0 "$KILN" check --model "$S/qwen.json" --db "$CK/partial.db"
grep -q -E ": $N_QWEN needed, $N_QWEN present, 0 missing, database .*, 1 layers\$" "$OUT" ||
    fail "check does not count the kernels of a read-only layer"
# Another architecture: everything is missing, and the arch is what differs.
expect 1 "$KILN" check --model "$S/qwen.json" --db "$CK/full.db" --arch sm_80
N_80=$(sed -n -E 's/^summary: model qwen2, arch sm_80: ([0-9]+) needed, 0 present, \1 missing, .*/\1/p' "$OUT")
[[ -n $N_80 && $N_80 -gt 0 ]] || fail "check's summary for sm_80 does not say that nothing is present"
# (sm_80's argmax is the one-block kernel: its constants differ from sm_90's cluster kernel too)
[[ $(grep -c -E ' missing [0-9a-f]{64} nearest [0-9a-f]{64} differs: (.*, )?arch sm_90 -> sm_80(, constants .*)?$' "$OUT") -eq $N_80 ]] ||
    fail "check for sm_80 does not list all $N_80 kernels with the arch among the parts that differ"
# A database that does not exist is refused, never created; usage errors exit 2.
expect 1 "$KILN" check --model "$S/qwen.json" --db "$CK/none/kernels.db"
grep -q "$CK/none/kernels.db" "$ERR" || fail "check of a missing database does not name it"
[[ ! -e $CK/none ]] || fail "check created a database"
expect 2 "$KILN" check --db "$CK/full.db" -j 2
expect 2 "$KILN" check --db "$CK/full.db" --dtype f32
expect 2 "$KILN" check --db "$CK/full.db" stray
expect 1 "$KILN" check --model "$S/qwen.json" --db "$CK/full.db" --arch sm_9
grep -q 'sm_9' "$ERR" || fail "check with a bad arch does not name it"

# ---- ls-ops: the operation catalog ----
expect 0 "$KILN" ls-ops
N_OPS=$(wc -l <"$OUT")
[[ $N_OPS -ge 12 ]] || fail "ls-ops lists $N_OPS operations"
for op in token_embedding rms_norm rms_norm_residual residual_add head_rms_norm masked_argmax dense_linear \
    dense_swiglu dense_linear_norm last_token_linear gated_delta paged_attention; do
    grep -q -E "^$op +[0-9]+ [a-z0-9_,]+ +f16,bf16 +packed " "$OUT" || fail "ls-ops: no line for $op"
done
grep -q -E '^paged_attention +[0-9]+ [a-z0-9_,]*paged_kv .* kiln_op_paged_attention_workspace +paged_attention paged_decode paged_prefill paged_prefill_mma$' \
    "$OUT" || fail "ls-ops: paged_attention's line is not as documented"
grep -q -E '^token_embedding +1 launch,f16,bf16 +f16,bf16 +packed +- +token_embedding$' "$OUT" ||
    fail "ls-ops: an operation without a workspace estimator does not show '-'"
expect 0 "$KILN" ls-ops --json
[[ $(json_eval 'len(d)') -eq $N_OPS ]] || fail "ls-ops --json: not one object per line of ls-ops"
[[ $(json_eval 'sorted(d[0])') == "['batching', 'capabilities', 'dtypes', 'id', 'templates', 'version', 'workspace']" ]] ||
    fail "ls-ops --json: the keys are not as documented"
[[ $(json_eval '[o for o in d if o["id"] == "dense_linear_norm"][0]["templates"]') == "['tma_linear', 'skinny_linear', 'rms_norm']" ]] ||
    fail "ls-ops --json: dense_linear_norm's templates"
[[ $(json_eval '[o["workspace"] for o in d if o["id"] == "token_embedding"][0]') == None ]] ||
    fail "ls-ops --json: no estimator is not null"
[[ $(json_eval 'all("cublaslt" in o["capabilities"] for o in d if o["id"].startswith("dense_"))') == True ]] ||
    fail "ls-ops --json: a dense operation without cublaslt"

# ---- a missing database: ls and stats fail and create nothing ----
for cmd in ls stats; do
    expect 1 "$KILN" "$cmd" --db "$S/missing/kernels.db"
    grep -q "$S/missing/kernels.db" "$ERR" || fail "$cmd: the message does not name the missing database"
    [[ ! -e $S/missing ]] || fail "$cmd created a database"
    KILN_CACHE_DIR="$S/missing-env" expect 1 "$KILN" "$cmd"
    [[ ! -e $S/missing-env ]] || fail "$cmd created the default database"
done
[[ ! -e $S/default-cache-unused ]] || fail "a command wrote to the default cache without being asked"

# ---- opening a database: refused files stay as they were ----
O="$S/open"
mkdir -p "$O"
# header() prints a database's journal-mode bytes (18-19) and change counter (24-27).
header() { python3 -c 'import sys; b = open(sys.argv[1], "rb").read(28); print(b[18:20].hex(), b[24:28].hex())' "$1"; }
# Another application's SQLite file, and a kiln database of a newer schema,
# both in the rollback journal: prewarm and gc refuse them and change no byte.
py 'sqlite3.connect(sys.argv[1]).executescript("CREATE TABLE t(x); INSERT INTO t VALUES (1);")' "$O/other.db"
cp "$DB" "$O/newer.db"
py '
db = sqlite3.connect(sys.argv[1])
db.execute("PRAGMA journal_mode=DELETE")
db.execute("PRAGMA user_version = 4")
db.close()' "$O/newer.db"
for f in "$O/other.db" "$O/newer.db"; do
    BEFORE=$(sha "$f")
    HEAD=$(header "$f")
    expect 1 "$KILN" prewarm --db "$f"
    grep -q "$f" "$ERR" || fail "prewarm of a refused file: the message does not name it"
    expect 1 "$KILN" gc --db "$f" --max-bytes 1
    grep -q "$f" "$ERR" || fail "gc of a refused file: the message does not name it"
    [[ $(header "$f") == "$HEAD" ]] || fail "$f: header $HEAD became $(header "$f") after a refusal"
    [[ $(sha "$f") == "$BEFORE" ]] || fail "$f changed after a refusal"
    [[ ! -e $f-wal ]] || fail "$f: a -wal file appeared after a refusal"
done
# Every command but prewarm and export works on an existing kiln database only:
# an empty file or a missing path is refused and stays as it was.
: >"$O/empty.db"
for cmd in gc ls stats verify explain merge; do
    case $cmd in
    gc) args=(--db "$O/empty.db" --max-bytes 1) missing=(--db "$O/none/kernels.db" --max-bytes 1) ;;
    explain) args=(--db "$O/empty.db" --op rms_norm) missing=(--db "$O/none/kernels.db" --op rms_norm) ;;
    merge) args=("$O/empty.db" -o "$O/merged.db") missing=("$O/none/kernels.db" -o "$O/merged.db") ;;
    *) args=(--db "$O/empty.db") missing=(--db "$O/none/kernels.db") ;;
    esac
    expect 1 "$KILN" "$cmd" "${args[@]}"
    grep -q "$O/empty.db" "$ERR" || fail "$cmd of an empty file: the message does not name it"
    [[ -f $O/empty.db && ! -s $O/empty.db ]] || fail "$cmd made a database of an empty file"
    expect 1 "$KILN" "$cmd" "${missing[@]}"
    [[ ! -e $O/none ]] || fail "$cmd created a database at a missing path"
    [[ ! -e $O/merged.db ]] || fail "$cmd left $O/merged.db"
done
# A database path that is a symbolic link is refused for writing, naming the
# target; a dangling link creates nothing; a FIFO is refused, never opened.
: >"$O/target.db"
ln -s "$O/target.db" "$O/link.db"
ln -s "$O/nowhere.db" "$O/dangling.db"
mkfifo "$O/fifo.db"
for f in "$O/link.db" "$O/dangling.db" "$O/fifo.db"; do
    expect 1 timeout 20 "$KILN" prewarm --db "$f"
    grep -q "$f" "$ERR" || fail "prewarm --db $f: the message does not name the path"
    expect 1 timeout 20 "$KILN" gc --db "$f" --max-bytes 1
    expect 1 timeout 20 "$KILN" ls --db "$f"
done
[[ ! -s $O/target.db ]] || fail "a link's target was written"
[[ ! -e $O/nowhere.db ]] || fail "a file was created through a dangling link"
# Bad $KILN_CACHE_READONLY entries: prewarm works, and says once why each is skipped.
mkdir -p "$O/a-folder"
echo "not a database" >"$O/notes.txt"
KILN_CACHE_READONLY="$O/a-folder:/dev/null:$O/notes.txt:$O/missing.db" expect 0 "$KILN" prewarm --db "$DB"
[[ $(grep -c '^kiln: read-only layer .* skipped: ' "$ERR") -eq 4 ]] || fail "prewarm: not one line per skipped layer"
for l in "$O/a-folder" /dev/null "$O/notes.txt" "$O/missing.db"; do
    grep -q "^kiln: read-only layer $l skipped: .*$l" "$ERR" || fail "prewarm: no reason for the skipped layer $l"
done
# A read-only layer or a --db that is a symbolic link is refused, naming the
# link and its target, unless KILN_CACHE_FOLLOW_SYMLINKS=1.
cp "$DB" "$O/layer-target.db"
ln -s "$O/layer-target.db" "$O/layer-link.db"
KILN_CACHE_READONLY="$O/layer-link.db" expect 0 "$KILN" prewarm --db "$DB"
grep -q "^kiln: read-only layer $O/layer-link.db skipped: .*symbolic link to $O/layer-target.db" "$ERR" ||
    fail "prewarm: a layer that is a link is not reported as refused"
KILN_CACHE_FOLLOW_SYMLINKS=1 KILN_CACHE_READONLY="$O/layer-link.db" expect 0 "$KILN" prewarm --db "$DB"
! grep -q 'read-only layer' "$ERR" || fail "prewarm: KILN_CACHE_FOLLOW_SYMLINKS=1 does not let a layer be a link"
expect 1 "$KILN" ls --db "$O/layer-link.db"
grep -q "$O/layer-link.db is a symbolic link to $O/layer-target.db" "$ERR" ||
    fail "ls of a link: the message does not name the link and its target"
KILN_CACHE_FOLLOW_SYMLINKS=1 expect 0 "$KILN" ls --db "$O/layer-link.db"
# ---- a killed export leaves nothing that looks like its output ----
# The export is killed once it has started writing (a file of its own with
# bytes in it, polled for, at most 60 s); the path asked for must not exist,
# and what the killed run left must not stand in the way of the next export.
SHIP_M="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/data/qwen2.5-0.5b.json"
KX="$S/killed-export"
mkdir -p "$KX"
"$KILN" export --model "$SHIP_M" -o "$KX/ship.db" -j 2 >"$S/killed.out" 2>"$S/killed.err" &
KPID=$!
for ((i = 0; i < 1200; i++)); do
    [[ -n $(find "$KX" -type f -size +0 -print -quit) ]] && break
    sleep 0.05
done
kill -9 "$KPID" 2>/dev/null || true
wait "$KPID" 2>/dev/null || true
[[ -n $(find "$KX" -type f -print -quit) ]] || fail "the killed export had written nothing in 60 s"
[[ ! -e $KX/ship.db ]] || fail "a killed export left its output, $(ls -A "$KX" | tr '\n' ' ')"
for f in "$KX"/* "$KX"/.*; do
    [[ ! -e $f || $(basename "$f") == . || $(basename "$f") == .. || $(basename "$f") == .ship.db.kiln-tmp-* ]] ||
        fail "a killed export left $f, not named as a temporary file"
done
touch "$S/killed.mark"
expect 0 "$KILN" export --model "$SHIP_M" -o "$KX/ship.db" -j 2
grep -q "^verified $KX/ship.db: [0-9]* rows, 0 bad, integrity ok\$" "$OUT" || fail "export after a killed one: not verified"
expect 0 "$KILN" verify --db "$KX/ship.db"
[[ $(find "$KX" -name '.ship.db.kiln-tmp-*' -newer "$S/killed.mark" | wc -l) -eq 0 ]] ||
    fail "a completed export left its temporary file"
# A failed merge and a failed export leave no temporary file either.
expect 1 "$KILN" merge "$KX/ship.db" "$SHIP_M" -o "$KX/merged.db"
[[ -z $(find "$KX" -name '.merged.db*') && ! -e $KX/merged.db ]] || fail "a failed merge left a file"
expect 1 "$KILN" export --model "$SHIP_M" -o "$KX/no-such-dir/ship.db"
[[ ! -e $KX/no-such-dir ]] || fail "export into a missing folder created it"
expect 0 "$KILN" merge "$KX/ship.db" -o "$KX/merged.db"
[[ -z $(find "$KX" -name '.merged.db*') ]] || fail "merge left a temporary file"

# ---- ls, stats and explain escape the bytes of a database ----
# Text from a database is data: an escape sequence, a newline or a byte that
# is not UTF-8 in a row reaches the terminal as \xNN, never as itself.
ESC_DB="$S/escape.db"
cp "$KX/ship.db" "$ESC_DB"
py '
db = sqlite3.connect(sys.argv[1])
fps = [r[0] for r in db.execute("SELECT fingerprint FROM kernels WHERE template_id != ? ORDER BY fingerprint", ("rms_norm",))]
db.execute("UPDATE kernels SET template_id = CAST(? AS TEXT), constants = CAST(? AS TEXT), arch = CAST(? AS TEXT) WHERE fingerprint = ?",
           (b"evil\x1b[31m\x07", b"A=1;\x1b]0;title\x07\nB=\xff\xc2\x9b", b"sm_90\r", fps[0]))
parts = db.execute("SELECT parts FROM kernels WHERE template_id = ?", ("rms_norm",)).fetchone()[0]
parts = parts[:parts.index("constants=")].encode() + b"constants=HIDDEN=1\x1b[2J"
db.execute("UPDATE kernels SET parts = CAST(? AS TEXT), fingerprint = zeroblob(32) WHERE template_id = ?",
           (parts, "rms_norm"))
db.commit()' "$ESC_DB"
# has_raw FILE: whether FILE holds a control byte other than newline, or a byte that is not UTF-8.
has_raw() {
    python3 -c 'import sys
b = open(sys.argv[1], "rb").read()
try:
    t = b.decode("utf-8")
except UnicodeDecodeError:
    sys.exit(0)
sys.exit(0 if any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) < 0xa0 for c in t) else 1)' "$1"
}
expect 0 "$KILN" ls --db "$ESC_DB"
has_raw "$OUT" && fail "ls printed a control byte or a byte that is not UTF-8 from the database"
grep -q -F 'evil\x1b[31m\x07' "$OUT" || fail "ls does not show the escaped template id"
grep -q -F 'A=1;\x1b]0;title\x07\x0aB=\xff\xc2\x9b' "$OUT" || fail "ls does not show the escaped constants"
[[ $(wc -l <"$OUT") -eq $(($(py 'print(sqlite3.connect(sys.argv[1]).execute("SELECT count(*) FROM kernels").fetchone()[0])' "$ESC_DB") + 1)) ]] ||
    fail "ls: a newline in a row started a line"
expect 0 "$KILN" stats --db "$ESC_DB"
has_raw "$OUT" && fail "stats printed a control byte or a byte that is not UTF-8 from the database"
grep -q -F 'evil\x1b[31m\x07' "$OUT" || fail "stats does not show the escaped template id"
expect 0 "$KILN" explain --db "$ESC_DB" --model "$SHIP_M" --op rms_norm
has_raw "$OUT" && fail "explain printed a control byte from the database"
grep -q -F 'HIDDEN=1\x1b[2J' "$OUT" || fail "explain does not show the escaped part"
# JSON escapes controls itself; a byte that is not UTF-8 becomes U+FFFD, so the document still parses.
expect 0 "$KILN" ls --db "$ESC_DB" --json
[[ $(json_eval '"evil\x1b[31m\x07" in [e["template_id"] for e in d]') == True ]] || fail "ls --json changed the text"
[[ $(json_eval '"A=1;\x1b]0;title\x07\nB=\ufffd\x9b" in [e["constants"] for e in d]') == True ]] ||
    fail "ls --json: a byte that is not UTF-8 is not U+FFFD"
expect 0 "$KILN" stats --db "$ESC_DB" --json
[[ $(json_eval '"evil\x1b[31m\x07" in d["templates"]') == True ]] || fail "stats --json changed the text"

# ---- a corrupt row that cannot be dropped: prewarm fails, never says compiled ----
# Two pages of a sealed database swapped (the page size read from its header):
# a swap that leaves a bad row whose delete fails with SQLITE_CORRUPT must make
# prewarm exit 1 naming the kernel and the remedy; one that heals must leave
# verify clean.
SWAPPED="$S/ship/swapped.db"
N_PAGES=$(( $(stat -c %s "$QEXP") / $(python3 -c 'import sys; b = open(sys.argv[1], "rb").read(18); print(int.from_bytes(b[16:18], "big"))' "$QEXP") ))
REFUSED=0
for pair in "2 17" $(for b in $(seq 10 $((N_PAGES - 1))); do echo "2,$b 3,$b 4,$b 5,$b 6,$b"; done); do
    read -r A B <<<"${pair/,/ }"
    (( B < N_PAGES )) || continue
    cp "$QEXP" "$SWAPPED"
    py '
p, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = bytearray(open(p, "rb").read())
n = int.from_bytes(d[16:18], "big")
d[a * n:(a + 1) * n], d[b * n:(b + 1) * n] = d[b * n:(b + 1) * n], d[a * n:(a + 1) * n]
open(p, "wb").write(d)' "$SWAPPED" "$A" "$B"
    run "$KILN" verify --db "$SWAPPED"
    BAD_FP=$(grep -m1 '^bad ' "$OUT" | cut -d' ' -f2 || true)
    [[ -n $BAD_FP ]] || continue
    run "$KILN" prewarm --model "$S/qwen.json" --db "$SWAPPED"
    PRE_RC=$RC
    cp "$OUT" "$S/swapped.out"
    cp "$ERR" "$S/swapped.err"
    run "$KILN" verify --db "$SWAPPED"
    if grep -q "^bad $BAD_FP " "$OUT"; then
        cp "$S/swapped.out" "$OUT"
        cp "$S/swapped.err" "$ERR"
        [[ $PRE_RC -eq 1 ]] || fail "pages $A and $B swapped: prewarm exited $PRE_RC, yet row $BAD_FP is still bad"
        grep -q ' failed -$' "$OUT" || fail "pages $A and $B swapped: prewarm lists no failed kernel"
        ! grep -q -E " (compiled|cached) ${BAD_FP:0:16}\$" "$OUT" ||
            fail "pages $A and $B swapped: prewarm reports the row it could not replace as stored"
        grep -q "kiln verify --db $SWAPPED" "$ERR" && grep -q 'kiln merge' "$ERR" ||
            fail "pages $A and $B swapped: prewarm's error gives no remedy"
        # A swap that breaks the index on the way to the row fails the lookup
        # itself, before any row is read (which page holds what depends on the
        # rows prewarm lists): checked as above, and the search goes on for a
        # swap whose lookup reaches the bad row.
        if ! grep -q "cache_corrupt: cache $SWAPPED: entry $BAD_FP" "$ERR" &&
            grep -q "cache_corrupt: cache $SWAPPED: looking up a kernel: database disk image is malformed" "$ERR"; then
            continue
        fi
        grep -q "cache_corrupt: cache $SWAPPED: entry $BAD_FP" "$ERR" ||
            fail "pages $A and $B swapped: prewarm does not name the row and the damage"
        REFUSED=$((REFUSED + 1))
        break
    fi
    [[ $PRE_RC -ne 1 ]] || grep -q cache_corrupt "$S/swapped.err" ||
        fail "pages $A and $B swapped: prewarm healed row $BAD_FP, yet exited 1: $(cat "$S/swapped.err")"
done
[[ $REFUSED -eq 1 ]] || fail "no swap of two pages of $QEXP left a row that prewarm cannot replace"

echo "cli: all checks passed (default model: $N specializations, qwen2: $N_QWEN)"
