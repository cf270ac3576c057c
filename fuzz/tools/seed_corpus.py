#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/.

Small, valid and near-valid inputs for each decoder. Re-running it rewrites
the seed files (named seed-*) and leaves files the fuzzer added alone.
Run from the repository root: python3 fuzz/tools/seed_corpus.py
"""
import json
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "corpus")
TORCH_CASES = os.path.join(ROOT, "..", "crates", "cuda-ipc", "tests", "data", "torch", "cases.json")

H = "".join(f"{(i * 37 + 200) % 256:02x}" for i in range(64))  # a 64-byte handle, hex
E = "".join(f"{(i * 11 + 3) % 256:02x}" for i in range(64))
UUID = "GPU-5e2c7a1f-03b4-4c6d-9e8f-0a1b2c3d4e5f"


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, f"seed-{name}"), "wb") as f:
        f.write(data)


def compact(v):
    return json.dumps(v, separators=(",", ":"), sort_keys=True)


def descriptors():
    base = {"cuda_ipc": 1, "alloc_size": 2097152, "offset": 0, "len": 4096, "dtype": "u32",
            "elem_size": 4, "device_uuid": UUID, "pid": 4242}
    valid = {
        "legacy": {**base, "mechanism": "legacy", "handle": H},
        "legacy-event-gen": {**base, "mechanism": "legacy", "handle": H, "event": E, "generation": 7},
        "vmm": {**base, "mechanism": "vmm", "fd": 5},
        "vmm-shape": {**base, "mechanism": "vmm", "fd": 5, "shape": [32, 32], "dtype": "f32"},
        "pool": {**base, "mechanism": "pool", "fd": 9, "handle": H, "offset": 1024},
        "fabric": {**base, "mechanism": "fabric", "handle": H, "dtype": "bf16", "elem_size": 2},
        "strided": {**base, "mechanism": "legacy", "handle": H, "dtype": "f64", "elem_size": 8,
                    "len": 4096, "shape": [8, 4], "strides": [64, 1]},
        "null-optionals": {**base, "mechanism": "vmm", "fd": 3, "shape": None, "event": None},
    }
    for name, d in valid.items():
        write("descriptor", name, compact(d))
    near = {
        "unknown-field": {**valid["legacy"], "colour": "red"},
        "version-2": {**valid["legacy"], "cuda_ipc": 2},
        "fd-on-legacy": {**valid["legacy"], "fd": 3},
        "handle-on-vmm": {**valid["vmm"], "handle": H},
        "short-handle": {**valid["legacy"], "handle": H[:-2]},
        "negative-len": {**valid["vmm"], "len": -4},
        "fraction": {**valid["vmm"], "offset": 0.5},
        "past-end": {**valid["vmm"], "offset": 2097152},
        "elem-size": {**valid["vmm"], "elem_size": 8},
        "strides-no-shape": {**valid["vmm"], "strides": [1]},
        "shape-overflow": {**valid["vmm"], "shape": [2**63, 4]},
        "pid-zero": {**valid["vmm"], "pid": 0},
        "fd-huge": {**valid["vmm"], "fd": 2**40},
        "bad-uuid": {**valid["vmm"], "device_uuid": "GPU-xyz"},
        "dtype-unknown": {**valid["vmm"], "dtype": "f8"},
    }
    for name, d in near.items():
        write("descriptor", name, compact(d))
    write("descriptor", "not-object", "[1,2,3]")
    write("descriptor", "truncated", compact(valid["pool"])[:57])
    with open(TORCH_CASES) as f:
        cases = json.load(f)["cases"]
    for c in cases:
        if isinstance(c.get("descriptor"), dict):
            write("descriptor", "torch-" + c["name"], compact(c["descriptor"]))


MESSAGES = [
    {"type": "hello", "protocol": 1, "pid": 42},
    {"type": "list", "id": 1},
    {"type": "list", "id": 2, "after": "weights"},
    {"type": "attach", "id": 3, "name": "weights"},
    {"type": "release", "id": 4, "lease": 9},
    {"type": "attach_ring", "id": 5, "name": "frames"},
    {"type": "ack", "lease": 9, "slot": 1, "seq": 17},
    {"type": "ping", "id": 6},
    {"type": "welcome", "protocol": 1, "pid": 7},
    {"type": "listing", "id": 1, "entries": [{"name": "weights", "kind": "entry", "meta": {"len": 4096}},
                                              {"name": "frames", "kind": "ring", "meta": None}],
     "next": "frames"},
    {"type": "attached", "id": 3, "lease": 9, "meta": {"len": 4096, "seed": 5}, "fds": 1},
    {"type": "released", "id": 4},
    {"type": "ring_attached", "id": 5, "lease": 10, "slots": 2, "meta": [1, 2.5, "x"]},
    {"type": "ring_slot", "id": 5, "lease": 10, "slot": 0, "meta": {"off": 0}, "fds": 1},
    {"type": "update", "lease": 9, "name": "weights", "generation": 1, "notice": {"step": 1}},
    {"type": "ring_frame", "lease": 10, "slot": 1, "seq": 2, "notice": None},
    {"type": "unpublished", "lease": 9, "name": "weights"},
    {"type": "pong", "id": 6},
    {"type": "error", "id": None, "code": "refused", "message": "no",
     "details": {"uid": 65534, "allowed": [0]}},
    {"type": "error", "id": 3, "code": "not_found", "message": "no entry"},
]


def header(length, fds=0, magic=b"CIPC", version=1, kind=1, reserved=0):
    return magic + struct.pack("<HHIHH", version, kind, length, fds, reserved)


def frames():
    for m in MESSAGES:
        payload = compact(m).encode()
        write("frame_message", m["type"] + ("-" + str(m.get("id")) if "id" in m else ""), payload)
        write("frame_header", "frame-" + m["type"],
              header(len(payload), m.get("fds", 0)) + payload)
    near = {
        "unknown-type": '{"type":"gossip","id":1}',
        "no-type": '{"id":1}',
        "type-number": '{"type":7}',
        "extra-field": '{"type":"ping","id":1,"x":2}',
        "missing-field": '{"type":"attach","id":1}',
        "negative-id": '{"type":"ping","id":-1}',
        "big-fds": '{"type":"attached","id":1,"lease":1,"meta":null,"fds":65535}',
        "float-number": '{"type":"ring_frame","lease":1,"slot":0,"seq":1,"notice":1E2}',
        "deep": '{"type":"update","lease":1,"name":"a","generation":1,"notice":' + "[" * 100 + "]" * 100 + "}",
        "not-json": "{type:ping}",
        "not-utf8": b'{"type":"attach","id":1,"name":"\xff"}',
        "array": "[]",
        # Shared-memory notices asked for and granted, and their ring_late.
        "hello-shm": '{"type":"hello","protocol":1,"pid":42,"shm_notices":true}',
        "hello-shm-false": '{"type":"hello","protocol":1,"pid":42,"shm_notices":false}',
        "welcome-shm": '{"type":"welcome","protocol":1,"pid":7,"shm_notices":65536}',
        "welcome-shm-null": '{"type":"welcome","protocol":1,"pid":7,"shm_notices":null}',
        "ring_late": '{"type":"ring_late","lease":10,"stale_through":4,"evicted":true,"reason":"slow"}',
        # Calls and replies: each admin method, and method names and bodies
        # at and past the limits (1 to 64 of a-z, 0-9, _ and .).
        "call-stats": '{"type":"call","id":4,"method":"stats","body":{}}',
        "call-drop": '{"type":"call","id":5,"method":"drop","body":{"set":"model","force":true}}',
        "call-shutdown": '{"type":"call","id":6,"method":"shutdown","body":{}}',
        "call-load-copies": '{"type":"call","id":7,"method":"load","body":{"set":"m","path":"/p",'
                            '"streams":8,"staging":2097152}}',
        "call-dotted": '{"type":"call","id":8,"method":"set.open_write","body":[1,"x",null]}',
        "call-method-64": '{"type":"call","id":9,"method":"' + "a" * 64 + '","body":null}',
        "call-method-65": '{"type":"call","id":9,"method":"' + "a" * 65 + '","body":null}',
        "call-method-empty": '{"type":"call","id":9,"method":"","body":{}}',
        "call-method-upper": '{"type":"call","id":9,"method":"Load","body":{}}',
        "call-method-space": '{"type":"call","id":9,"method":"lo ad","body":{}}',
        "call-no-body": '{"type":"call","id":9,"method":"ls"}',
        "call-id-max": '{"type":"call","id":18446744073709551615,"method":"ls","body":{}}',
        "reply-null": '{"type":"reply","id":3,"body":null}',
        "reply-float": '{"type":"reply","id":3,"body":{"load_s":0.1,"gb_per_s":1.7976931348623157e308}}',
        "reply-nested": '{"type":"reply","id":3,"body":{"sets":[{"leases":[{"pid":1,"uid":2}]}]}}',
        "reply-no-id": '{"type":"reply","body":{}}',
    }
    for name, p in near.items():
        write("frame_message", name, p)
    for name, h in {
        "valid-empty": header(0),
        "valid-max": header(1 << 20, 16),
        "too-long": header((1 << 20) + 1),
        "too-many-fds": header(10, 17),
        "bad-magic": header(2, magic=b"CIPD"),
        "version-2": header(2, version=2),
        "kind-2": header(2, kind=2),
        "reserved": header(2, reserved=1),
        "short": header(2)[:15],
        "empty": b"",
    }.items():
        write("frame_header", name, h)


def handles():
    write("hex_handle", "lower", H)
    write("hex_handle", "upper", H.upper())
    write("hex_handle", "short", H[:-1])
    write("hex_handle", "long", H + "0")
    write("hex_handle", "non-hex", H[:-1] + "g")
    write("hex_handle", "unicode", H[:-2] + "é")
    write("hex_handle", "zero", "0" * 128)
    write("hex_handle", "raw-64", bytes.fromhex(H))
    write("hex_handle", "raw-63", bytes.fromhex(H)[:63])
    write("hex_handle", "json-string", json.dumps(H))
    write("hex_handle", "uuid", UUID)
    write("hex_handle", "uuid-upper", UUID.upper())
    write("hex_handle", "uuid-grouping", "GPU-5e2c7a1f03b4-4c6d-9e8f-0a1b2c3d4e5f")


def sizes():
    for i, s in enumerate(["4096", "0x1000", "0X1000", "2MiB", "2mib", "1GiB", "1 GiB", " 64M ", "1KB",
                           "8GiB", "7b", "16TiB", "0", "18446744073709551615", "0xffffffffffffffff",
                           "4294967295", "0xFFFFFFFF", "", "MiB", "1.5GiB", "-1", "+1", "0x+10",
                           "12XB", "99999999999999999999", "17179869184GiB", "0xZZ", "0x",
                           "4294967296", "1 kib", "1\tMiB"]):
        write("cli_size", f"{i:02}", s)


def torch():
    with open(TORCH_CASES) as f:
        cases = json.load(f)["cases"]
    for c in cases:
        rec = c.get("record")
        write("torch_record", "record-" + c["name"], compact(rec) if rec is not None else "null")
        if isinstance(rec, dict) and isinstance(rec.get("storage_handle"), str):
            try:
                raw = bytes.fromhex(rec["storage_handle"])
            except ValueError:
                continue
            write("torch_record", "handle-" + c["name"], raw)


if __name__ == "__main__":
    descriptors()
    frames()
    handles()
    sizes()
    torch()
    for t in sorted(os.listdir(CORPUS)):
        n = len(os.listdir(os.path.join(CORPUS, t)))
        print(f"{t}: {n} files")
