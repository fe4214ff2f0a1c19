#!/usr/bin/env bash
# Tests of coverage records and tuning rows through the command-line tool:
# prewarm's envelope and record, check by record, verify, stats, merge,
# export --tuning-from, gc, and damaged rows. Needs no GPU (tuning rows are
# written here as kiln writes them; --tune itself must fail without a driver).
#   usage: cli_coverage_test.sh KILN_BINARY CONFIG.json SCRATCH_DIR
set -euo pipefail

if [[ $# -ne 3 ]]; then
    echo "usage: $0 KILN_BINARY CONFIG.json SCRATCH_DIR" >&2
    exit 2
fi
KILN=$1
CONFIG=$2
S=$3
rm -rf "$S"
mkdir -p "$S"
export KILN_CACHE_DIR="$S/default-cache-unused"
unset XDG_CACHE_HOME KILN_CACHE_READONLY KILN_TRUSTED_KEYS
OUT="$S/stdout"
ERR="$S/stderr"
RC=0

fail() {
    echo "FAIL: $*" >&2
    if [[ -s $OUT ]]; then echo "--- stdout:" >&2; head -c 4000 "$OUT" >&2; fi
    if [[ -s $ERR ]]; then echo "--- stderr:" >&2; head -c 4000 "$ERR" >&2; fi
    exit 1
}
run() {
    RC=0
    "$@" >"$OUT" 2>"$ERR" || RC=$?
    if grep -q -E 'ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error:' "$ERR"; then
        fail "sanitizer report from: $*"
    fi
}
expect() {
    local want=$1
    shift
    run "$@"
    [[ $RC -eq $want ]] || fail "'$*' exited $RC, expected $want"
}
py() {
    local script=$1
    shift
    python3 -c "import hashlib, sqlite3, sys, time
$script" "$@" || fail "python: $script"
}
sha() { sha256sum "$1" | cut -d' ' -f1; }
# sqlx DB SQL: runs SQL on DB as another program would.
sqlx() { py 'db = sqlite3.connect(sys.argv[1]); db.executescript(sys.argv[2]); db.commit()' "$1" "$2"; }

A="$S/a.db"
expect 0 "$KILN" prewarm --model "$CONFIG" --db "$A" -j 2 --batch 1,8 --max-context 4096 --prefill-chunk 256
grep -q -E '^coverage [^ ]+: [0-9]+ kernels, envelope dtype=(f16|bf16);batch=1,8;context=4096;chunk=256$' "$OUT" ||
    fail "prewarm printed no coverage line with the envelope"
N=$(grep -c -E ' (compiled|cached) [0-9a-f]{16}$' "$OUT")
[[ $(py 'print(sqlite3.connect(sys.argv[1]).execute("PRAGMA user_version").fetchone()[0])' "$A") == 3 ]] ||
    fail "a new database is not of schema 3"

expect 0 "$KILN" stats --db "$A"
grep -q '^coverage      1$' "$OUT" || fail "stats does not count the coverage record"
grep -q '^tuning rows   0$' "$OUT" || fail "stats does not count tuning rows"
expect 0 "$KILN" stats --db "$A" --json
py 'import json; d = json.load(open(sys.argv[1])); assert d["coverage_records"] == 1 and d["tuning_rows"] == 0, d' "$OUT"

# check by record, and by model: both complete.
expect 0 "$KILN" check --db "$A"
grep -q -E "^summary: coverage .*: $N needed, $N present, 0 missing, database $A, 0 layers$" "$OUT" ||
    fail "check by record: no complete summary"
expect 0 "$KILN" check --db "$A" --model "$CONFIG"

# A tuning row, written as kiln writes one (length-prefixed SHA-256 parts).
py '
def H(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little")); h.update(p)
    return h.digest()
kind, key, payload = b"cublaslt_matmul", sys.argv[2].encode(), bytes(range(84))
rid = H(b"kiln-tuning-id-1", kind, key)
db = sqlite3.connect(sys.argv[1])
db.execute("INSERT INTO tuning VALUES (?, ?, ?, ?, ?, ?, ?, 0)",
           (rid, kind.decode(), key.decode(), payload, H(b"kiln-tuning-1", rid, kind, key, payload), int(time.time()), int(time.time())))
db.commit()' "$A" "gpu=NVIDIA H200;sms=132;driver=13000;cublaslt=130100;m=4096;n=8;k=4096;elt=f16"
expect 0 "$KILN" verify --db "$A"
grep -q "^tuning and coverage $A: 1 tuning rows, 0 bad, 1 coverage records, 0 bad$" "$OUT" ||
    fail "verify does not report the tuning row and the coverage record"

# merge and export carry them.
expect 0 "$KILN" merge "$A" -o "$S/m.db"
expect 0 "$KILN" stats --db "$S/m.db"
grep -q '^tuning rows   1$' "$OUT" && grep -q '^coverage      1$' "$OUT" || fail "merge lost the tuning row or record"
expect 0 "$KILN" check --db "$S/m.db"
expect 0 "$KILN" export --model "$CONFIG" -j 2 --tuning-from "$A" -o "$S/e.db"
grep -q "^tuning from $A: 1 copied, 0 skipped$" "$OUT" || fail "export --tuning-from: no copy line"
expect 0 "$KILN" stats --db "$S/e.db"
grep -q '^tuning rows   1$' "$OUT" && grep -q '^coverage      1$' "$OUT" || fail "export lacks the tuning row or record"
expect 2 "$KILN" export --model "$CONFIG" --tuning-from

# A damaged tuning row: verify reports it, merge and export skip it.
cp "$A" "$S/bad-tuning.db"
sqlx "$S/bad-tuning.db" "UPDATE tuning SET payload = CAST(x'00' || payload AS BLOB)"
expect 1 "$KILN" verify --db "$S/bad-tuning.db"
grep -q -E '^bad [0-9a-f]{64} tuning row: checksum mismatch' "$OUT" || fail "verify: no bad line for the tuning row"
grep -q "1 tuning rows, 1 bad" "$OUT" || fail "verify does not count the bad tuning row"
expect 0 "$KILN" merge "$S/bad-tuning.db" -o "$S/m2.db"
grep -q "copied, 1 skipped$" "$OUT" || fail "merge copied a bad tuning row"
expect 0 "$KILN" export --model "$CONFIG" -j 2 --tuning-from "$S/bad-tuning.db" -o "$S/e2.db"
grep -q "0 copied, 1 skipped$" "$OUT" || fail "export copied a bad tuning row"

# A damaged coverage record: verify and check fail and say so.
cp "$A" "$S/bad-cov.db"
sqlx "$S/bad-cov.db" "UPDATE coverage SET model_name = 'another'"
expect 1 "$KILN" verify --db "$S/bad-cov.db"
grep -q 'coverage record: checksum mismatch' "$OUT" || fail "verify: no bad line for the coverage record"
expect 1 "$KILN" check --db "$S/bad-cov.db"
grep -q -E '^coverage [0-9a-f]{64} bad: checksum mismatch' "$OUT" || fail "check: a bad record is not reported"

# A missing kernel: check names it with explain's reason and exits 1.
cp "$A" "$S/missing.db"
sqlx "$S/missing.db" "DELETE FROM kernels WHERE template_id = 'swiglu'"
expect 1 "$KILN" check --db "$S/missing.db"
grep -q -E '^swiglu [^ ]+ missing [0-9a-f]{64} nearest [0-9a-f]{64} differs: ' "$OUT" ||
    fail "check: the missing kernel is not listed with its nearest row"
grep -q "kernels of 1 coverage records are missing" "$ERR" || fail "check: no failure message"
# As a read-only layer beside an empty database, the full one covers it.
KILN_CACHE_READONLY="$A" expect 0 "$KILN" check --db "$S/missing.db" --model "$CONFIG"

# gc ranks tuning rows with kernels by last use.
cp "$A" "$S/gc.db"
sqlx "$S/gc.db" "UPDATE tuning SET last_used = 1000, created = 1000"
expect 0 "$KILN" gc --db "$S/gc.db" --older-than 1
grep -q "removed 1 rows" "$OUT" || fail "gc did not remove the unused tuning row"
expect 0 "$KILN" stats --db "$S/gc.db"
grep -q '^tuning rows   0$' "$OUT" || fail "gc left the tuning row"

# --tune needs a GPU: without a driver it fails clearly and changes nothing.
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
    BEFORE=$(sha "$A")
    expect 1 "$KILN" prewarm --model "$CONFIG" --db "$A" --tune
    grep -q -- '--tune times products on a GPU, and there is none here' "$ERR" || fail "--tune: no clear message"
    [[ $(sha "$A") == "$BEFORE" ]] || fail "--tune without a GPU changed the database"
fi
expect 2 "$KILN" prewarm --db "$A" --batch 8,1
grep -q -- '--batch 8,1: must be' "$ERR" || fail "--batch: a decreasing list is not refused by name"
expect 2 "$KILN" prewarm --db "$A" --batch 0
expect 2 "$KILN" prewarm --db "$A" --max-context x
expect 2 "$KILN" prewarm --db "$A" --tune --dry-run
echo "cli_coverage: all checks passed ($N kernels)"
