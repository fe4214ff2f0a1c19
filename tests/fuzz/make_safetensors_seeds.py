#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_safetensors (corpus_safetensors/)."""
import json, os, struct
here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_safetensors")
os.makedirs(here, exist_ok=True)
SIZES = {"F16": 2, "BF16": 2, "F32": 4, "U8": 1, "I32": 4, "U32": 4, "F64": 8, "BOOL": 1, "F8_E4M3": 1}

def write(name, tensors, meta=None, pad=True, raw_header=None, data_extra=b""):
    hdr, off = {}, 0
    if meta is not None:
        hdr["__metadata__"] = meta
    for n, dt, shape in tensors:
        b = SIZES[dt]
        for d in shape:
            b *= d
        hdr[n] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + b]}
        off += b
    h = raw_header if raw_header is not None else json.dumps(hdr, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    data = bytes((i * 37) & 0xff for i in range(off)) + data_extra
    with open(os.path.join(here, name), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)

write("llama-tiny.safetensors", [("model.embed_tokens.weight", "F16", [16, 8]), ("model.norm.weight", "F16", [8]),
      ("model.layers.0.self_attn.q_proj.weight", "F16", [8, 8]), ("lm_head.weight", "F16", [16, 8])],
      meta={"format": "pt"})
write("dtypes.safetensors", [(dt.lower(), dt, [3]) for dt in SIZES])
write("empty-and-scalar.safetensors", [("e", "F16", [0, 4]), ("s", "F32", []), ("v", "U8", [5])])
write("empty-header.safetensors", [])
write("qwen-bias.safetensors", [("model.layers.0.self_attn.q_proj.bias", "F16", [8]),
      ("model.layers.0.self_attn.k_proj.bias", "F16", [4])], meta={"format": "pt", "note": "x"})
write("overlap.safetensors", [], raw_header=b'{"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]},'
      b'"b":{"dtype":"F16","shape":[4],"data_offsets":[4,12]}}', data_extra=bytes(12))
write("bad-size.safetensors", [], raw_header=b'{"a":{"dtype":"F16","shape":[3],"data_offsets":[0,8]}}',
      data_extra=bytes(8))
with open(os.path.join(here, "bad-length.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", 1 << 40) + b"{}")
# The data must be indexed entirely: bytes after the last tensor, or between two.
write("bad-trailing-bytes.safetensors", [("w", "F16", [4])], data_extra=bytes(2))
write("bad-hole.safetensors", [], raw_header=b'{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},'
      b'"b":{"dtype":"F16","shape":[2],"data_offsets":[8,12]}}', data_extra=bytes(12))
# Names cJSON would cut short, and a header that is not strict JSON.
write("bad-nul-name.safetensors", [], raw_header=b'{"a\\u0000b":{"dtype":"F16","shape":[1],"data_offsets":[0,2]}}',
      data_extra=bytes(2))
write("bad-leading-zero.safetensors", [], raw_header=b'{"a":{"dtype":"F16","shape":[01],"data_offsets":[0,2]}}',
      data_extra=bytes(2))
