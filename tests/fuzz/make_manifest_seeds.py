#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_manifest (tests/fuzz/corpus_manifest/).

Each seed is one input in the layout fuzz_manifest.c describes: a mode byte,
a signature length, the signature field, the manifest. The manifests list the
target's two kernels (their fingerprints, cubins and columns are fixed in
fuzz_manifest.c), whole or damaged; the mode asks the target to write its key
and sign, since its private key is not here. The files are committed; run
this again only to change them:  python3 tests/fuzz/make_manifest_seeds.py
"""
import hashlib
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_manifest")
DOMAIN = b"kiln-signed-layer-1\0"
SIGN, KEY, COUNT, DOM, OTHER = 1, 2, 4, 8, 16


def lp(*parts):
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def row(r):
    fp = bytes([0x10 * (r + 1)]) * 32
    cubin = bytes((i * (r + 3) + r) & 0xFF for i in range(1000))
    meta = hashlib.sha256(lp(b"kiln-row-meta-1", b"rms_norm", b"HIDDEN=4096", b"sm_90", b"nvrtc:13.0",
                             b"kiln_rms_norm", b"")).digest()
    return fp + hashlib.sha256(cubin).digest() + meta


def manifest(entries, count=None, pub=bytes(32), domain=DOMAIN):
    key_id = hashlib.sha256(pub).digest()
    n = len(entries) if count is None else count
    return domain + pub + key_id + struct.pack("<Q", n) + b"".join(entries)


def seed(mode, body, sig=b""):
    return bytes([mode, len(sig)]) + sig + body


r0, r1 = row(0), row(1)
bad1 = r1[:40] + bytes([r1[40] ^ 1]) + r1[41:]
seeds = {
    "both-rows": seed(SIGN | KEY | COUNT | DOM, manifest([r0, r1])),
    "one-row": seed(SIGN | KEY | COUNT | DOM, manifest([r0])),
    "no-rows": seed(SIGN | KEY | COUNT | DOM, manifest([])),
    "out-of-order": seed(SIGN | KEY | COUNT | DOM, manifest([r1, r0])),
    "twice": seed(SIGN | KEY | COUNT | DOM, manifest([r0, r0])),
    "wrong-digest": seed(SIGN | KEY | COUNT | DOM, manifest([r0, bad1])),
    "count-lies": seed(SIGN | KEY | DOM, manifest([r0, r1], count=3)),
    "truncated": seed(SIGN | KEY | DOM, manifest([r0, r1])[:-1]),
    "other-domain": seed(SIGN | KEY | COUNT, manifest([r0, r1], domain=b"kiln-signed-layer-2\0")),
    "untrusted-key": seed(SIGN | KEY | COUNT | DOM | OTHER, manifest([r0, r1])),
    "key-mismatch": seed(SIGN | COUNT | DOM, manifest([r0, r1], pub=bytes(range(32)))),
    "zero-signature": seed(KEY | COUNT | DOM, manifest([r0, r1]), sig=bytes(64)),
    "short-signature": seed(KEY | COUNT | DOM, manifest([r0, r1]), sig=bytes(63)),
    "raw": seed(0, manifest([r0]), sig=bytes(range(64))),
}
os.makedirs(OUT, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
