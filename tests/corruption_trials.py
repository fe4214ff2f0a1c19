#!/usr/bin/env python3
"""Corruption trials: damage copies of a prewarmed database and watch kiln.

  usage: corruption_trials.py KILN CACHE_PROBE CONFIG.json SCRATCH_DIR

The model's kernels are prewarmed once (offline, sm_90) into a clean database
in journal mode DELETE, the template of every trial. Each trial damages a
fresh copy in one way (the kinds below, in turn), then runs `kiln verify`,
`kiln prewarm` and `kiln verify` again, and looks every clean key up with
cache_lookup before and after the prewarm, as a loading process (the jit)
does: the row's checksum checked, and its columns checked against what the
key was computed from (the clean database's row). Of the kinds, swap_keys
swaps two rows' fingerprints: each row then passes its checksum under the
other kernel's key; tuning and coverage damage one column of the tuning
row (added to the clean database as kiln writes one) or of the coverage
record prewarm stored, and a tuning lookup must return its own payload or
miss. It prints, per kind, how many trials verify caught, how many prewarm
healed (verify passes after and every key loads its own cubin) and how many
it did not. A trial fails the run only if a key loads a cubin other than the
one compiled for it (the safety property), or a command crashes (an exit
status other than 0 and 1, or a sanitizer report).

KILN_CORRUPTION_TRIALS sets the number of trials (default 60; 1000 for a
thorough run), KILN_TEST_SEED the seed (default: random, printed).
"""
import hashlib
import os
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import time

KINDS = ["flip", "truncate", "zero_page", "swap_pages", "blob", "key", "swap_keys", "raw_size", "checksum", "tuning",
         "coverage"]
# The clean database's tuning row (written as kiln writes one); its payload's SHA-256 is what a lookup may return.
TUNING_KIND, TUNING_KEY = "cublaslt_matmul", "gpu=NVIDIA H200;sms=132;driver=13000;cublaslt=130100;m=896;n=8;k=896"
TUNING_PAYLOAD = bytes(range(84))


def parts_digest(*parts):
    """SHA-256 over length-prefixed parts, as kiln's ids and checksums are made."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def add_tuning_row(path):
    kind, key = TUNING_KIND.encode(), TUNING_KEY.encode()
    rid = parts_digest(b"kiln-tuning-id-1", kind, key)
    db = sqlite3.connect(path)
    db.execute("INSERT INTO tuning VALUES (?, ?, ?, ?, ?, ?, ?, 0)",
               (rid, TUNING_KIND, TUNING_KEY, TUNING_PAYLOAD,
                parts_digest(b"kiln-tuning-1", rid, kind, key, TUNING_PAYLOAD), int(time.time()), int(time.time())))
    db.commit()
    db.close()
SANITIZER = re.compile(r"ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error:")


def run(argv, env):
    """Runs a command; returns (status, stdout, stderr)."""
    p = subprocess.run(argv, env=env, capture_output=True, text=True, errors="replace", timeout=600)
    return p.returncode, p.stdout, p.stderr


def page_size(data):
    size = int.from_bytes(data[16:18], "big")
    return 65536 if size == 1 else (size or 4096)


def mutate(kind, path, rng):
    """Damages the database at path in one way of kind; returns a description."""
    if kind in ("blob", "key", "swap_keys", "raw_size", "checksum"):
        return mutate_row(kind, path, rng)
    if kind in ("tuning", "coverage"):
        return mutate_schema3_row(kind, path, rng)
    data = bytearray(open(path, "rb").read())
    ps = page_size(data)
    pages = len(data) // ps
    if kind == "flip":
        offsets = [rng.randrange(len(data)) for _ in range(rng.randint(1, 8))]
        for o in offsets:
            data[o] ^= 1 << rng.randrange(8)
        desc = "bits at " + ",".join(map(str, offsets))
    elif kind == "truncate":
        n = rng.choice([rng.randrange(len(data)), rng.randrange(pages) * ps])
        del data[n:]
        desc = "to %d bytes" % n
    elif kind == "zero_page":
        p = rng.randrange(pages)
        data[p * ps:(p + 1) * ps] = bytes(ps)
        desc = "page %d" % (p + 1)
    else:
        a, b = rng.sample(range(pages), 2)
        pa, pb = bytes(data[a * ps:(a + 1) * ps]), bytes(data[b * ps:(b + 1) * ps])
        data[a * ps:(a + 1) * ps], data[b * ps:(b + 1) * ps] = pb, pa
        desc = "pages %d and %d" % (a + 1, b + 1)
    open(path, "wb").write(data)
    return desc


def mutate_row(kind, path, rng):
    """Edits one column of one row through SQLite, as a careless tool would."""
    db = sqlite3.connect(path)
    fp, cubin, raw_size, checksum = rng.choice(
        db.execute("SELECT fingerprint, cubin, raw_size, checksum FROM kernels ORDER BY fingerprint").fetchall())
    if kind == "blob":
        b = bytearray(cubin)
        how = rng.choice(["flip", "truncate", "other"])
        if how == "flip":
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif how == "truncate":
            del b[rng.randrange(len(b)):]
        else:
            b = bytearray(db.execute("SELECT cubin FROM kernels WHERE fingerprint != ? LIMIT 1", (fp,)).fetchone()[0])
        db.execute("UPDATE kernels SET cubin = ? WHERE fingerprint = ?", (bytes(b), fp))
    elif kind == "key":
        k = bytearray(fp)
        k[rng.randrange(len(k))] ^= 1 << rng.randrange(8)
        how = "flip"
        db.execute("UPDATE kernels SET fingerprint = ? WHERE fingerprint = ?", (bytes(k), fp))
    elif kind == "swap_keys":
        other = rng.choice([r[0] for r in db.execute("SELECT fingerprint FROM kernels WHERE fingerprint != ?", (fp,))])
        swap_keys(db, fp, other)
        how = "swap with row %s" % other.hex()[:16]
    elif kind == "raw_size":
        how = rng.choice(["zero", "minus_one", "off_by_one", "huge"])
        value = {"zero": 0, "minus_one": -1, "off_by_one": raw_size + rng.choice([-1, 1]), "huge": 1 << 40}[how]
        db.execute("UPDATE kernels SET raw_size = ? WHERE fingerprint = ?", (value, fp))
    else:
        how = rng.choice(["flip", "zero", "short"])
        c = bytearray(checksum)
        if how == "flip":
            c[rng.randrange(len(c))] ^= 1 << rng.randrange(8)
        elif how == "zero":
            c = bytearray(32)
        else:
            del c[16:]
        db.execute("UPDATE kernels SET checksum = ? WHERE fingerprint = ?", (bytes(c), fp))
    db.commit()
    db.close()
    return "%s of row %s" % (how, fp.hex()[:16])


def mutate_schema3_row(kind, path, rng):
    """Edits one column of the tuning row or the coverage record."""
    db = sqlite3.connect(path)
    table = "tuning" if kind == "tuning" else "coverage"
    cols = ["id", "payload", "checksum", "key"] if kind == "tuning" else ["id", "needs", "checksum", "model_name"]
    col = rng.choice(cols)
    value = db.execute("SELECT %s FROM %s" % (col, table)).fetchone()[0]
    raw = bytearray(value.encode() if isinstance(value, str) else value)
    # The schema's CHECK keeps an id 32 bytes long: it can only be flipped.
    how = "flip" if col == "id" else rng.choice(["flip", "truncate", "other_type"])
    if how == "flip":
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(7)
    elif how == "truncate":
        del raw[rng.randrange(len(raw)):]
    if how == "other_type":
        new = 7
    elif isinstance(value, str):
        new = raw.decode("utf-8", "replace")
    else:
        new = bytes(raw)
    db.execute("UPDATE %s SET %s = ?" % (table, col), (new,))
    db.commit()
    db.close()
    return "%s of the %s row's %s" % (how, table, col)


def tuning_lookup(lookup_bin, path, env):
    """What a process loads for the tuning row: the payload's SHA-256 hex, "miss", or None."""
    rc, out, err = run([lookup_bin, path, "tuning:%s:%s" % (TUNING_KIND, TUNING_KEY)], env)
    if SANITIZER.search(err) or rc not in (0, 1):
        raise RuntimeError("cache_lookup exited %d: %s" % (rc, err.strip()[-2000:]))
    for line in out.splitlines():
        parts = line.split(" ")
        if parts[0] == "tuning":
            return parts[2] if parts[1] == "hit" else parts[1]
    return None


def swap_keys(db, a, b):
    """Swaps the fingerprints of rows a and b (through a key no row has)."""
    for old, new in ((a, bytes(32)), (b, a), (bytes(32), b)):
        db.execute("UPDATE kernels SET fingerprint = ? WHERE fingerprint = ?", (new, old))


def lookup(lookup_bin, path, clean, env, expect=None):
    """What each clean key loads: {fp: sha256 hex, "miss" or "error"}; None
    when the database cannot be opened at all (nothing loads). With expect
    (the clean database), the row must be of the kernel the key is for, as
    the jit checks; without it, the checksum alone (kiln_cache_get)."""
    rc, out, err = run([lookup_bin] + (["--expect", expect] if expect else []) + [path] + sorted(clean), env)
    if SANITIZER.search(err) or rc not in (0, 1):
        raise RuntimeError("cache_lookup exited %d: %s" % (rc, err.strip()[-2000:]))
    if rc == 1:
        return None
    got = {}
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) >= 2 and parts[0] in clean:
            got[parts[0]] = parts[2] if parts[1] == "hit" else parts[1]
    return got


def main():
    if len(sys.argv) != 5:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    kiln, lookup_bin, model, scratch = sys.argv[1:]
    trials = int(os.environ.get("KILN_CORRUPTION_TRIALS") or "60")
    seed = int(os.environ.get("KILN_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print("corruption trials: %d, seed %d (KILN_TEST_SEED=%d reproduces them)" % (trials, seed, seed), flush=True)
    rng = random.Random(seed)
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    env = dict(os.environ, KILN_CACHE_DIR=os.path.join(scratch, "default-cache-unused"))
    env.pop("KILN_CACHE_READONLY", None)
    env.pop("XDG_CACHE_HOME", None)

    # The clean database: every kernel of the model, one file (journal mode DELETE).
    clean_db = os.path.join(scratch, "clean.db")
    start = time.time()
    rc, out, err = run([kiln, "prewarm", "--model", model, "--arch", "sm_90", "--db", clean_db, "-j", "2"], env)
    if rc != 0:
        print("FAIL: prewarm of the clean database exited %d\n%s%s" % (rc, out, err), file=sys.stderr)
        return 1
    db = sqlite3.connect(clean_db)
    db.execute("PRAGMA journal_mode=DELETE")
    db.execute("VACUUM")
    clean = {fp.hex(): sum_.hex() for fp, sum_ in db.execute("SELECT fingerprint, checksum FROM kernels")}
    db.close()
    # prewarm stored the coverage record; a tuning row joins it.
    add_tuning_row(clean_db)
    clean_tuning = hashlib.sha256(TUNING_PAYLOAD).hexdigest()
    if tuning_lookup(lookup_bin, clean_db, env) != clean_tuning:
        print("FAIL: the clean database does not load its tuning row", file=sys.stderr)
        return 1
    if lookup(lookup_bin, clean_db, clean, env, clean_db) != clean:
        print("FAIL: the clean database does not load its own cubins", file=sys.stderr)
        return 1
    print("clean database: %d kernels in %.1f s" % (len(clean), time.time() - start), flush=True)

    # A control: two rows' keys swapped on purpose. By the checksum alone
    # each key loads the other's cubin, and the safety check must see that;
    # a loading process (the row checked against its key) must miss both,
    # and verify must fail.
    control = os.path.join(scratch, "control.db")
    shutil.copyfile(clean_db, control)
    db = sqlite3.connect(control)
    a, b = sorted(clean)[:2]
    swap_keys(db, bytes.fromhex(a), bytes.fromhex(b))
    db.commit()
    db.close()
    got = lookup(lookup_bin, control, clean, env)
    if not got or got[a] != clean[b] or got[b] != clean[a]:
        print("FAIL: the safety check does not see two swapped keys: %s" % got, file=sys.stderr)
        return 1
    got = lookup(lookup_bin, control, clean, env, clean_db)
    if not got or got[a] != "miss" or got[b] != "miss":
        print("FAIL: a loading process takes a row under a swapped key: %s" % got, file=sys.stderr)
        return 1
    rc, _, _ = run([kiln, "verify", "--db", control], env)
    if rc != 1:
        print("FAIL: verify exits %d on two swapped keys" % rc, file=sys.stderr)
        return 1
    print("control, two keys swapped on purpose: the checksum alone loads the other cubins (the safety check"
          " sees it); checked against their keys both miss; verify exits 1", flush=True)

    cols = ["trials", "caught", "healed", "not_healed", "pw_exit_0", "unsafe", "crash"]
    table = {k: dict.fromkeys(cols, 0) for k in KINDS}
    failures = []
    for t in range(trials):
        kind = KINDS[t % len(KINDS)]
        path = os.path.join(scratch, "trial-%d.db" % t)
        shutil.copyfile(clean_db, path)
        row = table[kind]
        row["trials"] += 1
        desc = mutate(kind, path, rng)
        what = "trial %d (%s: %s)" % (t, kind, desc)
        statuses, errors, unsafe = [], [], []
        try:
            loaded = [lookup(lookup_bin, path, clean, env, clean_db)]
            tuned = [tuning_lookup(lookup_bin, path, env)]
            for argv in (["verify", "--db", path],
                         ["prewarm", "--model", model, "--arch", "sm_90", "--db", path, "-j", "2"],
                         ["verify", "--db", path]):
                rc, out, err = run([kiln] + argv, env)
                if rc not in (0, 1) or SANITIZER.search(err):
                    raise RuntimeError("kiln %s exited %d: %s" % (argv[0], rc, err.strip()[-2000:]))
                statuses.append(rc)
                errors.append(err.strip().splitlines()[-1] if err.strip() else "")
            loaded.append(lookup(lookup_bin, path, clean, env, clean_db))
            tuned.append(tuning_lookup(lookup_bin, path, env))
        except RuntimeError as e:
            row["crash"] += 1
            failures.append("%s: %s" % (what, e))
            continue
        # Safety: a key that loads at all loads the cubin compiled for it.
        for stage, got in zip(("after the damage", "after prewarm"), loaded):
            for fp, sha in (got or {}).items():
                if len(sha) == 64 and sha != clean[fp]:
                    unsafe.append("%s loads another cubin %s" % (fp[:16], stage))
        # The same for the tuning row: its own payload or a miss, nothing else.
        for stage, got in zip(("after the damage", "after prewarm"), tuned):
            if got is not None and len(got) == 64 and got != clean_tuning:
                unsafe.append("the tuning row loads another payload %s" % stage)
        row["caught"] += statuses[0] == 1
        # A tuning row is healed by its next timing (a GPU process), not by prewarm.
        healed = statuses[2] == 0 and loaded[1] == clean and tuned[1] == clean_tuning
        row["healed"] += healed
        row["not_healed"] += not healed
        row["pw_exit_0"] += not healed and statuses[1] == 0
        if not healed:
            print("not healed: %s: prewarm exited %d (%s), verify %d (%s)"
                  % (what, statuses[1], errors[1][:160], statuses[2], errors[2][:160]), flush=True)
        if unsafe:
            row["unsafe"] += 1
            failures.append("%s: %s" % (what, "; ".join(unsafe)))
        else:
            for suffix in ("", "-wal", "-shm", "-journal"):
                if os.path.exists(path + suffix):
                    os.unlink(path + suffix)

    print("\n%-11s" % "kind" + "".join("%11s" % c for c in cols))
    for k in KINDS:
        print("%-11s" % k + "".join("%11d" % table[k][c] for c in cols))
    total = {c: sum(table[k][c] for k in KINDS) for c in cols}
    print("%-11s" % "all" + "".join("%11d" % total[c] for c in cols))
    print("(caught: verify exited 1 after the damage; healed: after prewarm verify passes and every key loads\n"
          " its own cubin and the tuning row its payload; pw_exit_0: not healed, yet prewarm exited 0; unsafe: a key\n"
          " loaded another cubin or the tuning row another payload; a damaged tuning row is timed again by its\n"
          " next GPU use, so prewarm does not heal it)")
    print("%.1f s" % (time.time() - start))
    for f in failures:
        print("FAIL: " + f, file=sys.stderr)
    if failures:
        print("FAIL: %d trials broke the safety property or crashed (seed %d; their databases are kept in %s)"
              % (len(failures), seed, scratch), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
