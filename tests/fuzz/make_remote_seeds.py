#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_remote (tests/fuzz/corpus_remote/).

Each seed is one input in the layout fuzz_remote.c describes: a selector byte
(0 a URL, 1 a value as Redis returns it, 2 an edit and a cubin that the target
makes a value of, 3 a key as SCAN returns it), then its bytes. Frames come from
the system libzstd (through ctypes). The files are committed; run this again only to change
them:  python3 tests/fuzz/make_remote_seeds.py
"""
import ctypes
import hashlib
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_remote")
MAGIC = b"kiln-remote-row-1\0"

_zstd = ctypes.CDLL("libzstd.so.1")
_zstd.ZSTD_compressBound.restype = ctypes.c_size_t
_zstd.ZSTD_compressBound.argtypes = [ctypes.c_size_t]
_zstd.ZSTD_compress.restype = ctypes.c_size_t
_zstd.ZSTD_compress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
_zstd.ZSTD_isError.restype = ctypes.c_uint
_zstd.ZSTD_isError.argtypes = [ctypes.c_size_t]


def compress(data, level=9):
    cap = _zstd.ZSTD_compressBound(len(data))
    out = ctypes.create_string_buffer(cap)
    n = _zstd.ZSTD_compress(out, cap, data, len(data), level)
    assert not _zstd.ZSTD_isError(n)
    return out.raw[:n]


def fake_cubin(n, salt=0):
    return b"\x7fELF" + bytes((i * 31 + salt) & 0xFF for i in range(n - 4))


def value(cubin, fp=b"\x5a" * 32, texts=(b"fuzz", b"N=1", b"sm_90", b"k", b"schema=kiln-fingerprint-1"),
          raw_size=None, frame=None):
    out = MAGIC + fp + struct.pack("<iiq", 12, 4, len(cubin) if raw_size is None else raw_size)
    out += hashlib.sha256(cubin).digest()
    for t in texts:
        out += struct.pack("<I", len(t)) + t
    frame = compress(cubin) if frame is None else frame
    return out + struct.pack("<I", len(frame)) + frame


def main():
    os.makedirs(OUT, exist_ok=True)
    cubin = fake_cubin(600)
    good = value(cubin)
    seeds = {
        "url-basic": b"\0redis://127.0.0.1:6379/kiln",
        "url-ipv6": b"\0redis://[::1]:7000/team:a",
        "url-no-port": b"\0redis://cache.local",
        "url-credentials": b"\0redis://user:pw@host:1/x",
        "url-bad-port": b"\0redis://host:65536/x",
        "value-good": b"\1" + good,
        "value-truncated": b"\1" + good[:-1],
        "value-trailing": b"\1" + good + b"\0",
        "value-size-lies": b"\1" + value(cubin, raw_size=601),
        "value-text-nul": b"\1" + value(cubin, texts=(b"fu\0zz", b"", b"", b"", b"")),
        "value-empty-texts": b"\1" + value(cubin, texts=(b"", b"", b"", b"", b"")),
        "value-not-a-frame": b"\1" + value(cubin, frame=b"not zstd at all"),
        "value-magic-only": b"\1" + MAGIC,
        "built-unedited": b"\2" + struct.pack("<I", 0) + fake_cubin(300, 7),
        "built-header-edit": b"\2" + struct.pack("<I", (1 << 24) | 20) + fake_cubin(300, 7),
        "built-frame-edit": b"\2" + struct.pack("<I", (0x80 << 24) | 200) + fake_cubin(300, 7),
        "key-row": b"\3kiln:row:" + b"5a" * 32,
        "key-lease": b"\3kiln:lease:" + b"0f" * 32,
        "key-upper-hex": b"\3kiln:row:" + b"5A" * 32,
        "key-other-prefix": b"\3\x04team:row:" + b"5a" * 32,
    }
    for name, data in seeds.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
