#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_tuning_row (tests/fuzz/corpus_tuning/).

Each seed is one input in the layout fuzz_tuning_row.c describes: a mode
byte, the kind length, the key length (2 bytes, little-endian), a 32-byte id
field, a 32-byte checksum field, then kind, key and payload (a coverage
record's needs). The files are committed; run this again only to change
them:  python3 tests/fuzz/make_tuning_seeds.py
"""
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_tuning")
ID_GIVEN, SUM_GIVEN, PAYLOAD_TEXT, KIND_INT, COVERAGE = 1, 2, 4, 8, 16
KEY = (b"gpu=NVIDIA H200;sms=132;driver=13000;cublaslt=130100;m=4096;n=8;k=4096;elt=f16;bias=0;parts=0;"
       b"align=256/256/256;workspace=33554432;policy=candidates=8/16,wide=hot:2.0fms/20,narrow=cold-median:7,rows<=64")
# A cuBLASLt payload as blas_cache.c writes it: "KTL1", 64, 64 algo bytes, ms bits, pick, count.
PAYLOAD = b"KTL1" + struct.pack("<I", 64) + bytes(range(64)) + struct.pack("<fII", 0.125, 2, 8)
NEEDS = (b"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\trms_norm\tHIDDEN=4096;\t"
         b"template=rms_norm;arch=sm_90;nvrtc=13.0;constants=HIDDEN=4096;\n")


def seed(mode, kind, key, payload, id_field=bytes(32), sum_field=bytes(32)):
    return bytes([mode, len(kind)]) + struct.pack("<H", len(key)) + id_field + sum_field + kind + key + payload


SEEDS = {
    "valid": seed(0, b"cublaslt_matmul", KEY, PAYLOAD),
    "short-payload": seed(0, b"cublaslt_matmul", KEY, PAYLOAD[:40]),
    "bad-magic": seed(0, b"cublaslt_matmul", KEY, b"KTL2" + PAYLOAD[4:]),
    "nan-time": seed(0, b"cublaslt_matmul", KEY, PAYLOAD[:72] + struct.pack("<fII", float("nan"), 2, 8)),
    "pick-past-count": seed(0, b"cublaslt_matmul", KEY, PAYLOAD[:72] + struct.pack("<fII", 1.0, 9, 8)),
    "empty-payload": seed(0, b"cublaslt_matmul", KEY, b""),
    "id-given": seed(ID_GIVEN, b"cublaslt_matmul", KEY, PAYLOAD, id_field=b"\x11" * 32),
    "sum-given": seed(SUM_GIVEN, b"cublaslt_matmul", KEY, PAYLOAD, sum_field=b"\x22" * 32),
    "payload-text": seed(PAYLOAD_TEXT, b"cublaslt_matmul", KEY, PAYLOAD),
    "kind-int": seed(KIND_INT, b"cublaslt_matmul", KEY, PAYLOAD),
    "nul-in-key": seed(0, b"cublaslt_matmul", KEY[:20] + b"\0" + KEY[20:], PAYLOAD),
    "long-kind": seed(0, b"k" * 80, KEY, PAYLOAD),
    "coverage": seed(COVERAGE, b"llama-3-8b", b"dtype=f16;batch=1,8;context=8192;chunk=512", NEEDS * 3),
    "coverage-empty-needs": seed(COVERAGE, b"llama-3-8b", b"dtype=f16;batch=1", b""),
    "coverage-bad-line": seed(COVERAGE, b"llama-3-8b", b"dtype=f16;batch=1", NEEDS[:70] + b"\n"),
    "coverage-no-newline": seed(COVERAGE, b"llama-3-8b", b"dtype=f16;batch=1", NEEDS[:-1]),
    "coverage-sum-given": seed(COVERAGE | SUM_GIVEN, b"llama-3-8b", b"dtype=f16", NEEDS, sum_field=b"\x33" * 32),
    "coverage-blob": seed(COVERAGE | PAYLOAD_TEXT, b"llama-3-8b", b"dtype=f16", NEEDS),
    # A kind bound as the integer 1 into a TEXT column is stored as "1": the same row as the text "1".
    "kind-int-as-text": seed(KIND_INT, b"1", KEY, PAYLOAD),
    "coverage-kind-int-as-text": seed(COVERAGE | KIND_INT, b"1", b"dtype=f16;batch=1", NEEDS),
}

if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print("wrote %d seeds to %s" % (len(SEEDS), OUT))
