#!/usr/bin/env python3
"""Writes the hand-made seeds of fuzz targets `checkpoint_index` and
`checkpoint_header` into fuzz/corpus/checkpoint_index/ and
fuzz/corpus/checkpoint_header/: Hugging Face sharded-checkpoint indexes and
safetensors files, valid ones and near-valid ones that each break one rule."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
INDEX = os.path.join(HERE, "..", "corpus", "checkpoint_index")
HEADER = os.path.join(HERE, "..", "corpus", "checkpoint_header")

BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
        "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
        "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
        "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}


def put(directory, name, data):
    os.makedirs(directory, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(directory, "seed-" + name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None, extra=0, header_text=None):
    """A file: `tensors` is [(name, dtype, shape)], laid one after another."""
    header, at = {}, 0
    for name, dtype, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        size = n * BITS[dtype] // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    if metadata is not None:
        header["__metadata__"] = metadata
    text = header_text if header_text is not None else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(i % 251 for i in range(at + extra))


def indexes():
    wm = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
          "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
          "lm_head.weight": "model-00002-of-00002.safetensors"}
    put(INDEX, "valid", json.dumps({"metadata": {"total_size": 4400000000}, "weight_map": wm}, indent=2))
    put(INDEX, "valid-no-metadata", json.dumps({"weight_map": {"a": "a.safetensors"}}))
    put(INDEX, "valid-subdir", json.dumps({"metadata": {"total_size": 1.5e3, "format": "pt"},
                                           "weight_map": {"a": "./shards/a.safetensors"}}))
    put(INDEX, "valid-extra-key", json.dumps({"weight_map": {"a": "a"}, "other": [1, 2]}))
    put(INDEX, "parent-dir", json.dumps({"weight_map": {"a": "../a.safetensors"}}))
    put(INDEX, "absolute", json.dumps({"weight_map": {"a": "/etc/passwd"}}))
    put(INDEX, "duplicate-key", '{"weight_map": {"a": "x", "a": "y"}}')
    put(INDEX, "empty-map", '{"weight_map": {}}')
    put(INDEX, "not-object", '[{"weight_map": {}}]')
    put(INDEX, "number-shard", '{"weight_map": {"a": 1}}')
    put(INDEX, "negative-total", '{"metadata": {"total_size": -5}, "weight_map": {"a": "x"}}')
    put(INDEX, "cut", json.dumps({"weight_map": wm})[:40])


def headers():
    put(HEADER, "valid", safetensors([("w", "BF16", [4, 8]), ("b", "F32", [8])], {"format": "pt"}))
    put(HEADER, "valid-every-type", safetensors(
        [(d.lower(), d, [2, 4]) for d in BITS if not d.startswith("F6")]))
    put(HEADER, "valid-empty", safetensors([]))
    put(HEADER, "valid-zero-size", safetensors([("e", "F32", [0, 3]), ("s", "U8", [])]))
    put(HEADER, "f6", safetensors([("x", "F6_E2M3", [4])]))
    put(HEADER, "f4-odd", safetensors([("x", "F4", [2, 3])]))
    put(HEADER, "trailing", safetensors([("x", "U8", [3])], extra=5))
    put(HEADER, "overlap", safetensors([], header_text=json.dumps({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})) + bytes(6))
    put(HEADER, "past-end", safetensors([], header_text=json.dumps({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})) + bytes(2))
    put(HEADER, "duplicate-name", safetensors([], header_text=(
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}')) + bytes(1))
    put(HEADER, "huge-length", struct.pack("<Q", 1 << 40) + b"{}")
    put(HEADER, "short", b"\x02\x00\x00")
    put(HEADER, "bad-metadata", safetensors([], {"k": 1}))


if __name__ == "__main__":
    indexes()
    headers()
