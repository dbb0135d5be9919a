#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzzer (fuzz/corpus/safetensors/).

Run from the repository root: python3 scripts/make_safetensors_fuzz_seeds.py
Small files (well under libFuzzer's default 4096-byte max_len) covering every dtype, empty and
scalar shapes, metadata, a PEFT-style adapter, misaligned data, and a few near-miss invalid
headers (overlap, size mismatch, a hole, trailing padding). Deterministic output.
"""
import json
import os
import struct

OUT = os.path.join("fuzz", "corpus", "safetensors")
SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I32": 4, "I64": 8,
         "U8": 1, "BOOL": 1}


def build(entries, metadata=None, pad=True, raw_header=None, data=None):
    """entries: list of (name, dtype, shape); data laid out in order unless data is given."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    blob = bytearray()
    for i, (name, dtype, shape) in enumerate(entries):
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(blob), len(blob) + n]}
        blob += bytes((i * 37 + k * 11 + 1) % 256 for k in range(n))
    text = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":"))
    if pad:
        text += " " * ((8 - len(text) % 8) % 8)
    body = text.encode()
    return struct.pack("<Q", len(body)) + body + (bytes(data) if data is not None else bytes(blob))


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {
        "two_tensors": build([("a", "F32", [2, 3]), ("b", "BF16", [3])], {"format": "pt"}),
        "all_dtypes": build([(f"t_{d}", d, [2, 2]) for d in SIZES]),
        "scalar_and_empty": build([("s", "F32", []), ("e", "F16", [0, 5]), ("z", "I64", [1, 0])]),
        "misaligned": build([("pad", "U8", [3]), ("f", "F32", [2])], pad=False),
        "peft_adapter": build(
            [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "F32", [2, 4]),
             ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", "F32", [4, 2]),
             ("base_model.model.model.embed_tokens.lora_embedding_A", "BF16", [2, 6]),
             ("base_model.model.model.embed_tokens.lora_embedding_B", "BF16", [4, 2])],
            {"format": "pt"}),
        "overlap": build([], raw_header='{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                        '"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}',
                         data=range(12)),
        "size_mismatch": build([], raw_header='{"a":{"dtype":"F32","shape":[3],'
                                              '"data_offsets":[0,8]}}', data=range(8)),
        "hole": build([], raw_header='{"a":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}',
                      data=range(6)),
        "empty_header": build([], raw_header="{}"),
    }
    for name, data in seeds.items():
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
