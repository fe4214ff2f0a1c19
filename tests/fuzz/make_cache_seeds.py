#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_cache_row (tests/fuzz/corpus_cache/).

Each seed is one input in the layout fuzz_cache_row.c describes: an 8-byte
raw_size field, a mode byte, a checksum length, a 4-byte edit, the checksum
field, the payload. Frames come from the system libzstd (through ctypes) or
are written by hand. The files are committed; run this again only to change
them:  python3 tests/fuzz/make_cache_seeds.py
"""
import ctypes
import hashlib
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_cache")

# mode bits, as fuzz_cache_row.c reads them
BLOB_RAW, BLOB_FRAME, BLOB_FRAME_EDITED, BLOB_FRAME_RESIZED = 0, 1, 2, 3
SIZE_FIELD, SIZE_REAL, SIZE_NEAR, SIZE_TYPED = 0, 1, 2, 3
SUM_FIELD, SUM_REAL, SUM_FLIPPED, SUM_AS_TEXT = 0, 1, 2, 3
CUBIN_TEXT, OTHER_FP = 0x40, 0x80

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
    """Something shaped like a small ELF cubin: a header, names, then code-like bytes."""
    head = b"\x7fELF\x02\x01\x01\x33\x07" + bytes(7) + b"\x02\x00\xbe\x00\x01\x00\x00\x00"
    names = b"\x00.shstrtab\x00.strtab\x00.symtab\x00.text.token_embedding\x00.nv.info\x00"
    body = bytes((i * 37 + salt) & 0xFF if i % 16 < 8 else 0 for i in range(n))
    return (head + names + body)[:n]


def seed(name, payload, mode, size_field=0, edit=0, checksum=b""):
    data = struct.pack("<qBBI", size_field, mode, len(checksum), edit) + checksum + payload
    assert len(checksum) <= 40
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


def m(blob, size, total, extra=0):
    return blob | size << 2 | total << 4 | extra


def raw_block_frame(content, fcs=None):
    """One frame of one raw block, written by hand (RFC 8878)."""
    fcs = len(content) if fcs is None else fcs
    assert fcs < 256 and len(content) < 1 << 21
    return b"\x28\xb5\x2f\xfd" + bytes([0x20, fcs]) + struct.pack("<I", len(content) << 3 | 1)[:3] + content


def rle_frame(total, byte, fcs=None):
    """A frame of 128 KiB RLE blocks declaring fcs (4-byte Frame_Content_Size)."""
    fcs = total if fcs is None else fcs
    out = b"\x28\xb5\x2f\xfd" + bytes([0xA0]) + struct.pack("<I", fcs)
    left = total
    while left > 0:
        n = min(left, 128 << 10)
        left -= n
        out += struct.pack("<I", n << 3 | 2 << 1 | (1 if left == 0 else 0))[:3] + bytes([byte])
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    cubin = fake_cubin(384)
    small = fake_cubin(40, salt=5)
    # Rows kiln must return: a frame of the right size with the right checksum.
    seed("valid-frame", cubin, m(BLOB_FRAME, SIZE_REAL, SUM_REAL))
    seed("valid-cubin-as-text", cubin, m(BLOB_FRAME, SIZE_REAL, SUM_REAL, CUBIN_TEXT))
    seed("valid-checksum-as-text", small, m(BLOB_FRAME, SIZE_REAL, SUM_AS_TEXT, OTHER_FP), edit=0x1000)
    seed("valid-raw-size-as-text", small, m(BLOB_FRAME, SIZE_TYPED, SUM_REAL), size_field=0)
    seed("valid-raw-size-as-real", small, m(BLOB_FRAME, SIZE_TYPED, SUM_REAL), size_field=2)
    seed("valid-precompressed", compress(cubin), m(BLOB_RAW, SIZE_REAL, SUM_REAL))
    seed("valid-raw-block", raw_block_frame(small), m(BLOB_RAW, SIZE_REAL, SUM_REAL))
    seed("valid-rle-1mib", rle_frame(1 << 20, 0x5A), m(BLOB_RAW, SIZE_REAL, SUM_REAL))
    seed("valid-two-frames", cubin, m(BLOB_FRAME_RESIZED, SIZE_REAL, SUM_REAL), edit=2 << 30)
    # Rows kiln must drop.
    seed("frame-header-edited", cubin, m(BLOB_FRAME_EDITED, SIZE_REAL, SUM_REAL), edit=0x80010005)
    seed("frame-body-edited", cubin, m(BLOB_FRAME_EDITED, SIZE_REAL, SUM_REAL), edit=0x03400033)
    seed("frame-truncated", cubin, m(BLOB_FRAME_RESIZED, SIZE_REAL, SUM_REAL), edit=0x00000020)
    seed("frame-trailing-bytes", cubin, m(BLOB_FRAME_RESIZED, SIZE_REAL, SUM_REAL), edit=(1 << 30) | 7)
    seed("frame-after-skippable", cubin, m(BLOB_FRAME_RESIZED, SIZE_REAL, SUM_REAL), edit=(3 << 30) | 0x85)
    seed("frame-content-size-lies", raw_block_frame(small, fcs=41), m(BLOB_RAW, SIZE_FIELD, SUM_REAL), size_field=41)
    seed("frame-without-size", b"\x28\xb5\x2f\xfd\x00\x00" + struct.pack("<I", len(small) << 3 | 1)[:3] + small,
         m(BLOB_RAW, SIZE_FIELD, SUM_REAL), size_field=len(small))
    seed("frame-declares-256mib", rle_frame(128 << 10, 1, fcs=256 << 20), m(BLOB_RAW, SIZE_FIELD, SUM_FIELD),
         size_field=256 << 20, checksum=hashlib.sha256(bytes([1]) * (128 << 10)).digest())
    seed("raw-size-past-limit", cubin, m(BLOB_FRAME, SIZE_FIELD, SUM_REAL), size_field=(256 << 20) + 1)
    seed("raw-size-negative", cubin, m(BLOB_FRAME, SIZE_FIELD, SUM_REAL), size_field=-1)
    seed("raw-size-zero-empty-cubin", b"", m(BLOB_FRAME, SIZE_REAL, SUM_REAL))
    seed("raw-size-off-by-one", cubin, m(BLOB_FRAME, SIZE_NEAR, SUM_REAL), size_field=0xFF)
    seed("raw-size-text-junk", cubin, m(BLOB_FRAME, SIZE_TYPED, SUM_REAL), size_field=1 | 40 << 8)
    seed("raw-size-fractional", cubin, m(BLOB_FRAME, SIZE_TYPED, SUM_REAL), size_field=3)
    seed("raw-size-null", cubin, m(BLOB_FRAME, SIZE_TYPED, SUM_REAL), size_field=4)
    seed("raw-size-blob", cubin, m(BLOB_FRAME, SIZE_TYPED, SUM_REAL), size_field=5)
    seed("raw-size-hex-text", cubin, m(BLOB_FRAME, SIZE_TYPED, SUM_REAL), size_field=7)
    seed("checksum-flipped", cubin, m(BLOB_FRAME, SIZE_REAL, SUM_FLIPPED), edit=0x5B)
    seed("checksum-31-bytes", cubin, m(BLOB_FRAME, SIZE_REAL, SUM_FIELD),
         checksum=hashlib.sha256(cubin).digest()[:31])
    seed("checksum-40-bytes", cubin, m(BLOB_FRAME, SIZE_REAL, SUM_FIELD),
         checksum=hashlib.sha256(cubin).digest() + b"\x00" * 8)
    seed("checksum-empty", cubin, m(BLOB_FRAME, SIZE_REAL, SUM_FIELD))
    seed("not-zstd", cubin, m(BLOB_RAW, SIZE_REAL, SUM_REAL, CUBIN_TEXT))
    with open(os.path.join(OUT, "short-header"), "wb") as f:
        f.write(b"\x80\x00\x00\x00\x00\x00\x00\x00\x15")


if __name__ == "__main__":
    main()
